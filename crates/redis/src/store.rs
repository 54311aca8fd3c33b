//! The store: connection, key names, script calls, replies and errors.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use futures_util::future::{BoxFuture, Either};
use futures_util::StreamExt;
use ratewarden_core::{Decision, PolicyConfig, PolicyKind, StoreError, StoreErrorKind, MAX_SAFE};
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{
    MultipleNodeRoutingInfo, ResponsePolicy, Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr,
};
use redis::io::tcp::socket2::TcpKeepalive;
use redis::io::tcp::TcpSettings;
use redis::{AsyncConnectionConfig, TlsCertificates};
use redis::{
    Cmd, ErrorKind, IntoConnectionInfo, Pipeline, RedisError, RedisFuture, RedisResult, Script,
    ServerErrorKind, Value,
};

use crate::down::{refuses_connections, DownMasters, Probe};

const PRELUDE: &str = include_str!("lua/prelude.lua");
const FIXED_WINDOW: &str = include_str!("lua/fixed_window.lua");
const SLIDING_WINDOW_COUNTER: &str = include_str!("lua/sliding_window_counter.lua");
const SLIDING_LOG: &str = include_str!("lua/sliding_log.lua");
const TOKEN_BUCKET: &str = include_str!("lua/token_bucket.lua");
const GCRA: &str = include_str!("lua/gcra.lua");

/// Evaluates `$check`, a connect-time command that changes nothing but a
/// key of the store's own checks (awaited inside, giving a
/// `Result<_, StoreError>`), again while it
/// times out and one more try, taking up to `$per_try`, still ends before
/// `$deadline`: connecting is bounded by `connect_timeout_ms`, not by the
/// call timeout, so a Redis that is slow for a moment (a loaded machine)
/// is not refused for it, while one that never answers is refused in
/// time, with the check's own error. A macro rather than a function taking
/// an async closure: the futures of such closures are not provably `Send`
/// for every lifetime, which the server's boxed futures need.
macro_rules! retry_timeouts {
    ($deadline:expr, $per_try:expr, $check:block) => {
        loop {
            match $check {
                Err(e)
                    if e.kind() == StoreErrorKind::Timeout
                        && tokio::time::Instant::now() + $per_try < $deadline => {}
                done => break done,
            }
        }
    };
}

/// The version of the stored state's format, part of every key name. The
/// first format (hashes of decimal fields) had no version in its names;
/// `v2` is packed doubles. A process of one version never reads another
/// version's keys (it would take them for corrupt state): they expire on
/// their own.
const STATE_FORMAT: &str = "v2";

/// The longest TTL of the key a connect or readiness check decides on
/// (see `RedisStore::check_writes`), in ms: it is deleted at once, and
/// lives this long only when the check is cut short.
const PROBE_TTL_MS: u64 = 10_000;

/// The most times a one-node [`RedisStore::decide_many`] batch loads its
/// script again after `NOSCRIPT` before its requests that still meet it
/// fail: a cache flushed that often is not served. (A batch's thousands
/// of calls would each carry the text by `EVAL`.)
const MAX_SCRIPT_LOADS: u32 = 5;

/// The most rounds a call that met `NOSCRIPT` waits for another call to
/// send the script's text before it sends the text itself (see
/// [`RedisStore::eval`]): a round per master on a cluster whose masters
/// all lost the script, so calls on up to about this many masters wait
/// rather than each send the text.
const MAX_SCRIPT_ROUNDS: u32 = 32;

/// The most keys of a cluster batch whose requests are in flight at once.
///
/// The cluster connection queues and tracks every request it is given, for
/// every node: with all 10,000 requests of a batch given at once, a batch
/// on a three-master cluster on loopback took about 1 s in a debug build,
/// some requests missing a 1 s timeout; with 64, 256 or 1,024 at a time,
/// about 0.32, 0.31 and 0.39 s, none missing it.
const CLUSTER_BATCH_KEYS_IN_FLIGHT: usize = 256;

/// How long a call of a cluster batch keeps its place among the
/// [`CLUSTER_BATCH_KEYS_IN_FLIGHT`] without an answer while other calls of
/// the batch are answered, before it gives the place up and waits on
/// without one. Without it a master that does not answer (frozen, or its
/// host gone) would take every place with its own keys, one after another,
/// and the batch's other keys would wait for the deadline unsent: with one
/// of three masters frozen, a 10,000-request batch decided about 470 of
/// them in 3 s, where the other masters' 6,700 were due. A call answered
/// on loopback within a few milliseconds, even 256 at a time.
const CLUSTER_BATCH_SLOW_CALL: Duration = Duration::from_millis(100);

/// The most requests one [`RedisStore::decide_many`] call takes: a bound on
/// the memory a batch holds and on how long it keeps Redis busy.
pub const MAX_BATCH: usize = 10_000;

/// How a [`RedisStore`] names keys, bounds its calls and sets TTLs.
///
/// With serde, an object of these fields; a field left out takes its
/// [`Default`] value, and a field it does not know is refused. In Rust,
/// name the fields you set and take the rest from
/// `..RedisOptions::default()`: fields are added as the store learns new
/// settings, and a literal that names every field stops compiling then.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RedisOptions {
    /// The first part of every key name (escaped; see [`escape_key_part`]).
    pub prefix: String,
    /// The most a call may take, in ms, connection and reply included; a
    /// call that takes longer returns [`StoreErrorKind::Timeout`].
    pub timeout_ms: u64,
    /// The most connecting may take, in ms. On a cluster each node's
    /// connection may take a quarter of it, so that a node that accepts
    /// connections but never answers cannot use up the whole time; a
    /// new cluster connection (see `docs/redis.md`, "A hung cluster
    /// node") may take all of it. The checks made while connecting
    /// (`PING`, `CLUSTER INFO`, loading the script) each have the call's
    /// time, and are tried again while this time lasts.
    pub connect_timeout_ms: u64,
    /// Added to every TTL, in ms. With Redis `TIME` (the default) 0 is
    /// exact: keys expire by the clock the scripts read. When callers pass
    /// their own `now_ms`, that clock and Redis's may drift apart; a grace
    /// keeps a key that Redis's clock would expire while the caller's time
    /// says it still counts.
    pub ttl_grace_ms: u64,
    /// The longest TTL set, in ms: a bucket that never refills (`limit` 0)
    /// or refills over centuries keeps its key this long, not forever.
    pub max_ttl_ms: u64,
    /// TLS only (`rediss://`, `rediss-cluster://`): a PEM file of the
    /// certificate authorities trusted to sign the server's certificate,
    /// in place of the system's (which are still loaded, and must load).
    /// `None` trusts the system's roots, or the PEM bundle and folder that
    /// the environment variables `SSL_CERT_FILE` and `SSL_CERT_DIR` name.
    /// A relative path is taken from the working directory. The TLS files
    /// are read when the store connects and again for each new connection
    /// it makes, so files replaced on disk take effect at the next one
    /// (see `docs/redis.md`, "TLS").
    pub tls_ca_file: Option<PathBuf>,
    /// TLS only: a PEM file of this client's certificate chain, for a Redis
    /// that asks clients for one (`tls-auth-clients yes`, Redis's default
    /// once TLS is on); given with `tls_key_file`.
    pub tls_cert_file: Option<PathBuf>,
    /// TLS only: the PEM file of `tls_cert_file`'s private key.
    pub tls_key_file: Option<PathBuf>,
    /// The clock of the decision the store's own checks make (connecting,
    /// [`RedisStore::with_config`] and [`RedisStore::ping`]): `true` (the
    /// default) Redis `TIME`, as every decision without a `now_ms` reads
    /// it, so that an ACL user refused `TIME` is refused at connect rather
    /// than at every decision; `false` this machine's clock, for a store
    /// whose callers pass `now_ms` to every decision and whose user need
    /// not be granted `TIME`.
    pub checks_by_redis_time: bool,
}

impl Default for RedisOptions {
    /// Prefix `ratewarden`, a 50 ms timeout, 1 s to connect, no grace,
    /// TTLs of at most 2^40 ms (about 35 years), over TLS the system's
    /// roots and no client certificate, and checks by Redis `TIME`.
    fn default() -> Self {
        RedisOptions {
            prefix: "ratewarden".to_owned(),
            timeout_ms: 50,
            connect_timeout_ms: 1000,
            ttl_grace_ms: 0,
            max_ttl_ms: 1 << 40,
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            checks_by_redis_time: true,
        }
    }
}

/// Escapes one part of a key name: `%`, `{`, `}` and `:` become `%25`,
/// `%7B`, `%7D` and `%3A`.
///
/// With `{` and `}` escaped no part can form a Redis Cluster hash tag, so
/// the whole name picks the slot; with `:` escaped, parts joined by `:`
/// can never run into each other, so two different limiters never share a
/// key.
///
/// ```
/// use ratewarden_redis::escape_key_part;
/// assert_eq!(escape_key_part("api:{v1}"), "api%3A%7Bv1%7D");
/// assert_eq!(escape_key_part("100%"), "100%25");
/// ```
pub fn escape_key_part(part: &str) -> String {
    let mut out = String::with_capacity(part.len());
    for c in part.chars() {
        match c {
            '%' => out.push_str("%25"),
            '{' => out.push_str("%7B"),
            '}' => out.push_str("%7D"),
            ':' => out.push_str("%3A"),
            c => out.push(c),
        }
    }
    out
}

/// What a connect error says of a host name that did not resolve.
const UNRESOLVED_HOST: &str = "the host's name did not resolve";

/// Whether `e`, from [`RedisStore::connect`], is a host name that did not
/// resolve: its message says to check the name, and no server can be
/// started "there".
pub fn is_unresolved_host(e: &StoreError) -> bool {
    e.detail().contains(UNRESOLVED_HOST)
}

/// A Redis glob (`ACL SETUSER ... ~PATTERN`, `SCAN ... MATCH`) that
/// matches every key under `prefix` and its `:`, and no other: the prefix
/// as stored ([`escape_key_part`]), with the characters a glob reads
/// (`*`, `?`, `[`, `]`, `\`) escaped, so that a prefix holding them (`key_prefix =
/// "team[1]"`) matches itself rather than a class of prefixes.
///
/// ```
/// assert_eq!(ratewarden_redis::key_glob("app:limits"), "app%3Alimits:*");
/// assert_eq!(ratewarden_redis::key_glob("t[1]*?"), "t\\[1\\]\\*\\?:*");
/// ```
pub fn key_glob(prefix: &str) -> String {
    let mut out = String::new();
    for c in escape_key_part(prefix).chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out.push_str(":*");
    out
}

/// How long one try of a node's check or call may take, for a store call
/// timeout of `response_timeout`.
///
/// redis-rs re-sends a request whose cluster node connection timed out,
/// unless the caller has stopped waiting: its response timeout is longer
/// than the store's, so the store's always ends a call first and a
/// timed-out call is never sent again (it may have been applied). Also the
/// longest one try of a connect check can take.
fn node_response_timeout(response_timeout: Duration) -> Duration {
    response_timeout + (response_timeout / 2).max(Duration::from_millis(50))
}

/// The script of `policy` and its text, made once per process: a store
/// per rule, of thousands of rules, holds no copy of its own.
fn policy_script(policy: PolicyKind) -> (&'static Script, &'static str) {
    static SCRIPTS: std::sync::OnceLock<[(Script, String); 5]> = std::sync::OnceLock::new();
    let scripts = SCRIPTS.get_or_init(|| {
        [
            FIXED_WINDOW,
            SLIDING_WINDOW_COUNTER,
            SLIDING_LOG,
            TOKEN_BUCKET,
            GCRA,
        ]
        .map(|body| {
            let source = format!("{PRELUDE}{body}");
            (Script::new(&source), source)
        })
    });
    // In the order of the bodies above; a policy added is a compile error
    // here until it has its script.
    let (script, source) = &scripts[match policy {
        PolicyKind::FixedWindow => 0,
        PolicyKind::SlidingWindowCounter => 1,
        PolicyKind::SlidingLog => 2,
        PolicyKind::TokenBucket => 3,
        PolicyKind::Gcra => 4,
    }];
    (script, source)
}

/// One call's handle on the connection: cheap to clone. A node's comes
/// with its [`Renewing`], whose [`ReconnectPace`] its calls go through.
#[derive(Clone)]
enum Conn {
    Node(ConnectionManager, Arc<Renewing<ConnectionManager>>),
    Cluster(ClusterConnection),
}

/// The store's connection, shared by the stores made from it with
/// [`RedisStore::with_config`].
#[derive(Clone)]
enum Backend {
    /// With the node's address (`HOST:PORT`, or a socket's path).
    Node(Arc<Renewing<ConnectionManager>>, Arc<str>),
    /// With the cluster's masters found down (see [`crate::down`]).
    Cluster(Arc<Renewing<ClusterConnection>>, Arc<DownMasters>),
}

/// The least time between two starts of a new connection, so that a Redis
/// that keeps timing out is not sent a storm of connections.
const REBUILD_INTERVAL: Duration = Duration::from_secs(1);

/// How long calls to one node fail at once, without trying a new
/// connection, after Redis closed the new ones as soon as they were made.
const RECONNECT_PACE: Duration = Duration::from_millis(100);

/// Paces the new connections to one node that Redis closes as soon as they
/// are made: a Redis at its `maxclients` accepts each, answers with an
/// error and closes it. redis-rs's connection manager starts a new
/// connection on the next call after a connection fails, so every call
/// would make one (about 2,700 a second from one `serve` at 10,000 calls a
/// second, each accepted and closed by a Redis already at its limit, and
/// as many from every process of a fleet). A call begun after the last
/// that failed so, and failing so itself within twice [`RECONNECT_PACE`]
/// of it with no call answered between, starts a pause of
/// [`RECONNECT_PACE`] in which calls fail at once as connection errors; the
/// first call after it tries again. A lone failure starts none: an idle
/// connection Redis closed (which the call's retry on a new connection
/// replaces), or the error a connection manager kept from an outage,
/// returned once to the first call after it; nor do the calls that were in
/// flight together on a connection that broke (a Redis killed under load),
/// begun before the first of them failed. Nor does a refused connection (a
/// Redis that is down costs itself nothing, and is decided on again from
/// its first call back).
struct ReconnectPace {
    /// When, in milliseconds from `made`, a call last failed with a
    /// connection closed by Redis, with no call answered since; 0 for none.
    last_closed_ms: AtomicU64,
    /// Until when, in milliseconds from `made`, calls fail at once.
    paused_until_ms: AtomicU64,
    made: Instant,
}

impl ReconnectPace {
    fn new() -> Self {
        ReconnectPace {
            last_closed_ms: AtomicU64::new(0),
            paused_until_ms: AtomicU64::new(0),
            made: Instant::now(),
        }
    }

    /// Milliseconds from `made`, at least 1 (0 means none).
    fn now_ms(&self) -> u64 {
        u64::try_from(self.made.elapsed().as_millis())
            .unwrap_or(u64::MAX)
            .max(1)
    }

    fn pace_ms() -> u64 {
        u64::try_from(RECONNECT_PACE.as_millis()).unwrap_or(u64::MAX)
    }

    /// Makes `call`, unless a pause is on (then fails at once), and takes
    /// its outcome.
    async fn call<T>(
        &self,
        call: impl std::future::Future<Output = RedisResult<T>>,
    ) -> RedisResult<T> {
        let begun_ms = self.now_ms();
        if let Some(e) = self.paused(begun_ms) {
            return Err(e);
        }
        let result = call.await;
        self.took(&result, begun_ms);
        result
    }

    /// The error of a call made at `now_ms` during a pause, or `None` to
    /// make it.
    fn paused(&self, now_ms: u64) -> Option<RedisError> {
        let until = self.paused_until_ms.load(Ordering::Relaxed);
        if now_ms >= until {
            return None;
        }
        Some(RedisError::from(std::io::Error::new(
            std::io::ErrorKind::ConnectionAborted,
            format!(
                "Redis closed the connections as soon as they were made or used (a Redis \
                 at its maxclients, a proxy before it refusing them, or a Redis gone); the \
                 next is tried in {} ms, calls fail at once until then",
                until - now_ms
            ),
        )))
    }

    /// Takes the outcome of a call made, begun at `begun_ms` (from
    /// [`ReconnectPace::now_ms`]).
    fn took<T>(&self, result: &RedisResult<T>, begun_ms: u64) {
        match result {
            Ok(_) => {
                if self.last_closed_ms.load(Ordering::Relaxed) != 0 {
                    self.last_closed_ms.store(0, Ordering::Relaxed);
                }
            }
            Err(e) if e.is_connection_dropped() && !e.is_connection_refusal() => {
                let now_ms = self.now_ms();
                let last = self.last_closed_ms.swap(now_ms, Ordering::Relaxed);
                if last != 0
                    && begun_ms > last
                    && now_ms.saturating_sub(last) <= 2 * Self::pace_ms()
                {
                    self.paused_until_ms
                        .fetch_max(now_ms.saturating_add(Self::pace_ms()), Ordering::Relaxed);
                }
            }
            Err(_) => {}
        }
    }
}

/// Makes a new connection of the store's kind, for [`Renewing`].
type Connect<C> = Box<dyn Fn() -> BoxFuture<'static, RedisResult<C>> + Send + Sync>;

/// A connection that is replaced by a new one when calls time out.
///
/// A connection that stops answering without failing is never replaced by
/// the client: redis-rs (1.8) reconnects when a call fails on a connection,
/// and a timeout is no failure. On one node, a link whose far end is gone
/// without a word (a host or VM lost, a managed Redis whose endpoint moved
/// to another machine, a NAT or load balancer that dropped the flow) then
/// times out every call until the kernel gives up on the socket, some
/// fifteen minutes later, while a new connection to the same address
/// answers at once. On a cluster, a master that hangs (a frozen process
/// or host) neither answers `MOVED` nor fails: its connection stays open,
/// every call routed to it times out, and after its replica takes over its
/// slots the client still sends them to the hung node; a new connection
/// reads the slot map afresh and finds the new master. Calls already under
/// way finish on the old connection. A timed-out call is never tried again
/// (it may have been applied): only later calls go to the new connection.
struct Renewing<C> {
    connect: Connect<C>,
    conn: RwLock<C>,
    /// How many times a new connection replaced the old one: a call begun
    /// on an older generation went out on a connection no longer used.
    generation: AtomicU64,
    /// When the last new connection was started, and whether one is being
    /// made now: at most one at a time, at most one per
    /// [`REBUILD_INTERVAL`].
    rebuild: Mutex<Rebuild>,
    /// The most making a new connection may take.
    connect_timeout: Duration,
    /// The store's call timeout: calls begun on a replaced connection end
    /// within it, so their timeouts say nothing of the new one.
    call_timeout: Duration,
    /// When a call (single or of a batch, on any generation) last had an
    /// answer from Redis, in milliseconds from `made`: a single call left
    /// without an answer for a while judges by it whether the connection
    /// still answers others (see [`RedisStore::watched`]).
    last_answer_ms: AtomicU64,
    made: Instant,
    /// Each replacement's generation and when making its connection began:
    /// a single call waiting on a connection that stopped answering waits
    /// for one begun after the call (see [`RedisStore::watched`]).
    swaps: tokio::sync::watch::Sender<Swap>,
    /// On one node, the pause after new connections Redis closed at once.
    pace: ReconnectPace,
}

/// A replacement of a [`Renewing`] connection.
#[derive(Clone, Copy)]
struct Swap {
    /// The generation of the new connection.
    generation: u64,
    /// When making it began.
    begun: tokio::time::Instant,
}

#[derive(Default)]
struct Rebuild {
    in_flight: bool,
    last_started: Option<Instant>,
    /// When a new connection last replaced the old one.
    last_swapped: Option<Instant>,
}

impl<C: Clone + Send + Sync + 'static> Renewing<C> {
    fn new(
        connect: Connect<C>,
        conn: C,
        connect_timeout: Duration,
        call_timeout: Duration,
    ) -> Self {
        Renewing {
            connect,
            conn: RwLock::new(conn),
            generation: AtomicU64::new(0),
            rebuild: Mutex::default(),
            connect_timeout,
            call_timeout,
            last_answer_ms: AtomicU64::new(0),
            made: Instant::now(),
            swaps: tokio::sync::watch::Sender::new(Swap {
                generation: 0,
                begun: tokio::time::Instant::now(),
            }),
            pace: ReconnectPace::new(),
        }
    }

    fn conn(&self) -> C {
        self.conn
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// A call had an answer from Redis: the connection still answers.
    fn answered(&self) {
        let now_ms = u64::try_from(self.made.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_answer_ms.fetch_max(now_ms, Ordering::Relaxed);
    }

    /// How long no call has had an answer from Redis.
    fn quiet_for(&self) -> Duration {
        let last = Duration::from_millis(self.last_answer_ms.load(Ordering::Relaxed));
        self.made.elapsed().saturating_sub(last)
    }

    /// The connection's generation: read before [`Renewing::conn`], a call
    /// on the connection it gets is of this generation or a later one.
    fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Calls on the connection of `generation` went unanswered while in
    /// flight for a while (a cluster batch's, see
    /// [`RedisStore::decide_many`]): as [`Renewing::timed_out`], but even
    /// soon after the last replacement, since these calls were sent on the
    /// connection that replacement made; nothing if it was replaced since.
    fn stalled(self: &Arc<Self>, generation: u64) {
        if self.generation() == generation {
            self.renew(false);
        }
    }

    /// A call timed out (or a probe found a cluster's slot map out of
    /// date): starts making a new connection in the background, unless
    /// one is being made, or was started less than [`REBUILD_INTERVAL`]
    /// ago, or replaced the old one less than a call timeout ago (the
    /// timeout may be a late one of a call begun on the old connection).
    /// Never makes the caller wait.
    fn timed_out(self: &Arc<Self>) {
        self.renew(true);
    }

    /// Starts making a new connection in the background, unless one is
    /// being made or was started less than [`REBUILD_INTERVAL`] ago, or,
    /// `if_not_just_replaced`, the old one was replaced less than a call
    /// timeout ago.
    fn renew(self: &Arc<Self>, if_not_just_replaced: bool) {
        {
            let mut rebuild = self.rebuild.lock().unwrap_or_else(PoisonError::into_inner);
            let now = Instant::now();
            let within =
                |t: Option<Instant>, d: Duration| t.is_some_and(|t| now.duration_since(t) < d);
            if rebuild.in_flight
                || within(rebuild.last_started, REBUILD_INTERVAL)
                || (if_not_just_replaced && within(rebuild.last_swapped, self.call_timeout))
            {
                return;
            }
            rebuild.in_flight = true;
            rebuild.last_started = Some(now);
        }
        let begun = tokio::time::Instant::now();
        /// Ends the rebuild however its task ends (even cancelled, when the
        /// runtime shuts down), so that a later timeout can start another.
        struct Done<C>(Arc<Renewing<C>>);
        impl<C> Drop for Done<C> {
            fn drop(&mut self) {
                self.0
                    .rebuild
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .in_flight = false;
            }
        }
        let done = Done(Arc::clone(self));
        tokio::spawn(async move {
            let renewing = &done.0;
            let connecting = (renewing.connect)();
            // A failed attempt keeps the old connection: on a cluster it
            // may still serve the slots of every node that answers, and on
            // one node the next timeout tries again.
            if let Ok(Ok(conn)) = tokio::time::timeout(renewing.connect_timeout, connecting).await {
                let mut current = renewing
                    .conn
                    .write()
                    .unwrap_or_else(PoisonError::into_inner);
                *current = conn;
                // Under the lock: whoever reads the new generation gets
                // the new connection.
                let generation = renewing.generation.fetch_add(1, Ordering::Release) + 1;
                drop(current);
                renewing.swaps.send_replace(Swap { generation, begun });
                renewing
                    .rebuild
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .last_swapped = Some(Instant::now());
            }
            drop(done);
        });
    }
}

/// Every command sent through a `Conn` (every decision's and batch's,
/// and the checks') goes to Redis from a task of the connections' runtime
/// (see `io.rs`; a cluster's `ASKING` pipeline, its `SCRIPT LOAD` on every
/// master and the masters' probes go on the cluster connection directly,
/// from the caller): a connection's queue has a few dozen places (redis-rs's),
/// and a caller that finds it full must be polled again to hand its
/// command over once a place frees, which a runtime busy with thousands of
/// runnable tasks does too late. The caller keeps its own work (building
/// the command, reading the reply, timeouts) and waits for the reply;
/// dropping the wait cancels the task, as dropping the call did.
impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        let (mut conn, cmd) = (self.clone(), cmd.clone());
        Box::pin(crate::io::handed_over(async move {
            match &mut conn {
                Conn::Node(c, renewing) => renewing.pace.call(c.req_packed_command(&cmd)).await,
                Conn::Cluster(c) => c.req_packed_command(&cmd).await,
            }
        }))
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        let (mut conn, cmd) = (self.clone(), cmd.clone());
        Box::pin(crate::io::handed_over(async move {
            match &mut conn {
                Conn::Node(c, renewing) => {
                    renewing
                        .pace
                        .call(c.req_packed_commands(&cmd, offset, count))
                        .await
                }
                Conn::Cluster(c) => c.req_packed_commands(&cmd, offset, count).await,
            }
        }))
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Node(c, _) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// A store keeping every key's state in Redis, deciding under one policy
/// configuration. Cloning is cheap: clones share one connection.
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

struct Inner {
    backend: Backend,
    config: PolicyConfig,
    script: &'static Script,
    /// The script's text, for a node the script was not loaded on.
    script_source: &'static str,
    /// Held by the one call that sends the script's text (`EVAL`) after
    /// `NOSCRIPT`; the calls that met `NOSCRIPT` meanwhile wait for it and
    /// try `EVALSHA` again (see [`RedisStore::eval`]).
    script_turn: tokio::sync::Mutex<()>,
    /// How many times the script's text was sent after `NOSCRIPT`.
    scripts_sent: AtomicU64,
    /// The escaped prefix and the configuration, joined by `:`, ending in `:`.
    key_prefix: String,
    /// ARGV 1..3: limit, window_ms, burst.
    config_args: [String; 3],
    options: RedisOptions,
    /// The URL connected to, redacted.
    url: String,
    /// Whether Redis refused this store's `INFO` (a user without `+info`,
    /// or `INFO` renamed away): `ping` then stops asking it, since every
    /// refusal is one more entry in Redis's `ACL LOG`.
    info_refused: AtomicBool,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("url", &self.inner.url)
            .field("config", &self.inner.config)
            .field("key_prefix", &self.inner.key_prefix)
            .field("options", &self.inner.options)
            .finish()
    }
}

impl RedisStore {
    /// Connects to `url` and prepares the policy's script.
    ///
    /// `url` is one of (and no other form):
    ///
    /// - `redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]`: one node over TCP
    ///   (without `:PORT`, Redis's own 6379);
    /// - `redis+unix:///PATH[?db=DB&user=USER&pass=PASSWORD]`: one node over
    ///   a Unix socket;
    /// - `redis-cluster://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...]`: Redis
    ///   Cluster, any of its nodes as seeds, each with its port, none with
    ///   a `/DB` (Redis Cluster has only database 0);
    /// - `rediss://...` and `rediss-cluster://...`: the same over TLS, the
    ///   server's certificate always checked: against
    ///   [`RedisOptions::tls_ca_file`], else the system's roots (or the PEM
    ///   bundle the environment variable `SSL_CERT_FILE` names), with
    ///   [`RedisOptions::tls_cert_file`] shown when Redis asks for a client
    ///   certificate.
    ///
    /// Connecting checks that the store can be used, so that a store that
    /// cannot is refused here rather than at every decision: a single node
    /// must answer `PING` and must not be a cluster node, the policy's
    /// script is loaded (on every master of a cluster), and one decision
    /// is made on a key of the store's own, which is then deleted (see
    /// [`RedisStore::ping`]).
    ///
    /// Errors: an invalid configuration or URL, a Redis that wants a
    /// password the URL lacks, refuses the URL's credentials, is a cluster
    /// node behind `redis://` or a single node behind `redis-cluster://`,
    /// is a read-only replica, or refuses the URL's user a command or key
    /// the scripts need ([`StoreErrorKind::InvalidInput`], naming the node
    /// and saying what to change); a Redis out of memory or short of the
    /// replicas it needs to take writes ([`StoreErrorKind::Backend`]); no
    /// connection, or a node that cannot be
    /// used, within `connect_timeout_ms` (a check that only timed out is
    /// tried again while that time lasts) ([`StoreErrorKind::ConnectionDropped`],
    /// [`StoreErrorKind::Backend`] or [`StoreErrorKind::Timeout`]).
    pub async fn connect(
        url: &str,
        config: PolicyConfig,
        options: RedisOptions,
    ) -> Result<Self, StoreError> {
        crate::io::on_io(Self::connect_on_io(url, config, options)).await
    }

    async fn connect_on_io(
        url: &str,
        config: PolicyConfig,
        options: RedisOptions,
    ) -> Result<Self, StoreError> {
        config
            .build()
            .map_err(|e| StoreError::new(StoreErrorKind::InvalidInput, e.to_string()))?;
        if options.timeout_ms == 0 || options.connect_timeout_ms == 0 {
            return Err(StoreError::new(
                StoreErrorKind::InvalidInput,
                "timeout_ms and connect_timeout_ms must be at least 1",
            ));
        }
        if options.max_ttl_ms == 0 || options.max_ttl_ms > MAX_SAFE {
            return Err(StoreError::new(
                StoreErrorKind::InvalidInput,
                format!("max_ttl_ms is {}: use 1 to 2^53 - 1", options.max_ttl_ms),
            ));
        }
        if options.ttl_grace_ms > MAX_SAFE - options.max_ttl_ms {
            return Err(StoreError::new(
                StoreErrorKind::InvalidInput,
                "ttl_grace_ms + max_ttl_ms must stay below 2^53; use a smaller ttl_grace_ms",
            ));
        }
        if !crate::is_store_url(url) {
            return Err(StoreError::new(
                StoreErrorKind::InvalidInput,
                crate::url_form_error(url),
            ));
        }
        let tls = crate::tls::is_tls_url(url);
        let cluster_url = crate::is_cluster_url(url);
        let certificates = crate::tls::certificates(&options, url)?;
        // Read again for each new connection, so that files replaced on
        // disk take effect.
        let files = Arc::new(crate::tls::CertificateFiles::new(
            &options,
            url,
            certificates.clone(),
        ));
        let form = Form {
            cluster: cluster_url,
            tls,
            ca_file: options.tls_ca_file.is_some(),
            user_without_password: user_without_password(url),
        };
        if tls {
            // rustls takes its crypto from the process's provider: ring,
            // unless the application installed another first (then that
            // one stays, and this does nothing).
            let _ = rustls::crypto::ring::default_provider().install_default();
        }
        let certificates = certificates.as_ref();
        // Every message shows the URL without its credentials.
        let shown = crate::redact_url(url);
        let shown = shown.as_str();
        let connect_timeout_ms = options.connect_timeout_ms;
        let connect_timeout = Duration::from_millis(connect_timeout_ms);
        let response_timeout = Duration::from_millis(options.timeout_ms);
        let deadline = tokio::time::Instant::now() + connect_timeout;
        let node_response_timeout = node_response_timeout(response_timeout);
        let connecting = async move {
            let cluster_seeds = url
                .strip_prefix("redis-cluster://")
                .or_else(|| url.strip_prefix("rediss-cluster://"));
            let backend = if let Some(seeds) = cluster_seeds {
                let nodes = seed_urls(seeds, shown, tls)?;
                // Each node's connection gets a part of the time to
                // connect: the cluster connection waits for every seed, and
                // then for every node of the slot map, so one node that
                // accepts connections but never answers would otherwise
                // spend the whole time alone.
                let node_connect_timeout = Duration::from_millis(connect_timeout_ms.div_ceil(4));
                // From the seeds that serve slots, when there are several:
                // redis-rs takes the slot map of whichever seed answers
                // first, and a seed removed with del-node runs on as an
                // empty cluster of its own, so a start from a URL naming
                // members too would fail at random (with a seed that does
                // not answer beside them, by timing out). Each is asked
                // within a node's connect timeout, all at once; when none
                // answers with slots, every seed is tried, for the error.
                let members = if nodes.len() > 1 {
                    seeds_serving_slots(&nodes, certificates, node_connect_timeout).await
                } else {
                    Vec::new()
                };
                let tried = if members.is_empty() { &nodes } else { &members };
                let client = cluster_client(
                    tried,
                    node_connect_timeout,
                    node_response_timeout,
                    certificates,
                )
                .map_err(|e| invalid_url(shown, e))?;
                let mut conn = match client.get_async_connection().await {
                    Ok(conn) => conn,
                    Err(e) => {
                        return Err(cluster_connect_error(
                            e,
                            tried,
                            certificates,
                            form,
                            shown,
                            node_connect_timeout,
                        )
                        .await)
                    }
                };
                // A cluster that answers but has a slot no master serves
                // (cluster_state:fail) would fail the decisions of every
                // key in that slot: a store that cannot be used, which
                // stops the caller at start, as a node that is down does.
                let info: String = retry_timeouts!(deadline, node_response_timeout, {
                    redis::cmd("CLUSTER")
                        .arg("INFO")
                        .query_async(&mut conn)
                        .await
                        .map_err(|e| {
                            let e = map_error(e);
                            // Over TLS, seeds that connected but a slot map
                            // whose nodes could not be: their certificates
                            // lack the addresses the nodes announce.
                            // The seeds answered, so it is no Redis to
                            // start (Backend, not ConnectionDropped, for
                            // which callers say to start one).
                            let no_node = e.detail().contains("ClusterConnectionNotFound");
                            let (kind, hint) = if tls && no_node {
                                (
                                    StoreErrorKind::Backend,
                                    "; over TLS, each node's certificate must hold the address \
                                     it announces in CLUSTER SLOTS (its IP, unless \
                                     cluster-preferred-endpoint-type is hostname)"
                                        .to_owned(),
                                )
                            } else if no_node {
                                // Without TLS, a slot map naming no node:
                                // seeds that serve no slot.
                                (
                                    StoreErrorKind::Backend,
                                    "; the seeds answered, but their slot map names no node \
                                     (redis-cli -p PORT CLUSTER SLOTS on a seed shows it): give \
                                     seeds that are members of the cluster, which a node not yet \
                                     joined (CLUSTER MEET), or removed with redis-cli --cluster \
                                     del-node (it runs on as an empty cluster of its own), is not"
                                        .to_owned(),
                                )
                            } else if refused_permission(e.detail()) {
                                (
                                    StoreErrorKind::InvalidInput,
                                    format!("; {}", permission_advice(e.detail())),
                                )
                            } else {
                                (e.kind(), String::new())
                            };
                            StoreError::new(
                                kind,
                                format!(
                                    "Redis Cluster at {shown} cannot be used: CLUSTER INFO: \
                                     {}{hint}",
                                    e.detail()
                                ),
                            )
                        })
                })?;
                let state = cluster_state(&info).unwrap_or("(not given)");
                if state != "ok" {
                    return Err(StoreError::new(
                        StoreErrorKind::Backend,
                        format!(
                            "Redis Cluster at {shown} reports cluster_state:{state}: some slot \
                             has no master that answers, so decisions for its keys would fail; \
                             bring the cluster back (redis-cli --cluster check HOST:PORT shows \
                             what is missing) and start again"
                        ),
                    ));
                }
                // A key moving between masters is decided on its new one
                // after `ASKING` (see `call_asking`): a user refused it
                // would fail those decisions while a slot migrates, with
                // every node up, so it is asked now. With a `PING` in the
                // same pipeline, on the same node, so that the flag it sets
                // is spent at once.
                retry_timeouts!(deadline, node_response_timeout, {
                    redis::pipe()
                        .cmd("ASKING")
                        .cmd("PING")
                        .query_async::<()>(&mut conn)
                        .await
                        .map_err(|e| {
                            let e = map_error(e);
                            // The PING beside it can be the one refused.
                            let advice = match refused_command(e.detail()) {
                                Some("asking") => "; the URL's user may not run ASKING, with \
                                                   which a key moving between masters is \
                                                   decided on its new one: grant it +asking \
                                                   (ACL SETUSER USER +asking, on every node)"
                                    .to_owned(),
                                _ if refused_permission(e.detail()) => {
                                    format!("; {}", permission_advice(e.detail()))
                                }
                                _ => String::new(),
                            };
                            StoreError::new(
                                if advice.is_empty() {
                                    e.kind()
                                } else {
                                    StoreErrorKind::InvalidInput
                                },
                                format!(
                                    "Redis Cluster at {shown} cannot be used: ASKING: {}{advice}",
                                    e.detail()
                                ),
                            )
                        })
                })?;
                // The slot map, to tell which master a key's call goes to
                // (see crate::down); one not read now is read at the first
                // failed call.
                let map =
                    match tokio::time::timeout(node_response_timeout, ask_slot_map(&conn, &[]))
                        .await
                    {
                        Ok(Ok(reply)) => slot_ranges(&reply).unwrap_or_default(),
                        _ => Vec::new(),
                    };
                let down = Arc::new(DownMasters::new(
                    map,
                    node_connect_timeout,
                    node_response_timeout,
                    // A new connection is started at most once per
                    // REBUILD_INTERVAL, and given connect_timeout.
                    REBUILD_INTERVAL + connect_timeout,
                ));
                let connect: Connect<ClusterConnection> = {
                    let down = Arc::clone(&down);
                    let nodes = Arc::new(nodes);
                    Box::new(move || {
                        let (nodes, files) = (Arc::clone(&nodes), Arc::clone(&files));
                        let down = Arc::clone(&down);
                        Box::pin(async move {
                            let certificates = read_again(files).await;
                            let connect = |seeds: Vec<String>| {
                                new_cluster_connection(
                                    seeds,
                                    node_connect_timeout,
                                    node_response_timeout,
                                    certificates.clone(),
                                    Arc::clone(&down),
                                )
                            };
                            // From the masters last known first: the URL's
                            // seeds may have left the cluster since. One
                            // removed with del-node runs on as an empty
                            // cluster of its own, whose slot map names no
                            // node, and redis-rs takes the map of whichever
                            // seed answers first.
                            let known = known_master_urls(&down, &nodes);
                            if !known.is_empty() {
                                if let Ok(conn) = connect(known).await {
                                    return Ok(conn);
                                }
                            }
                            connect(nodes.to_vec()).await
                        })
                    })
                };
                Backend::Cluster(
                    Arc::new(Renewing::new(
                        connect,
                        conn,
                        connect_timeout,
                        response_timeout,
                    )),
                    down,
                )
            } else {
                if let Some(what) = crate::url::query_error(url, shown) {
                    return Err(StoreError::new(StoreErrorKind::InvalidInput, what));
                }
                let client = client_for(url, certificates).map_err(|e| invalid_url(shown, e))?;
                // One attempt per (re)connection, no backoff: redis-rs
                // sleeps a backoff delay before each retry (at least a
                // second in 0.32), so retries made every call wait its
                // whole timeout while Redis refused connections, and the
                // first calls after Redis returned wait for a sleeping
                // attempt.
                // Without them a refused connection fails the call at once,
                // as a connection error, and the next call (or this call's
                // one more try, see retry_on_new_connection) starts a new
                // attempt, so the first call after Redis returns connects.
                let manager_config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(connect_timeout))
                    .set_response_timeout(Some(response_timeout))
                    .set_number_of_retries(0);
                let address = address_of(client.get_connection_info().addr());
                let connected =
                    ConnectionManager::new_with_config(client.clone(), manager_config.clone())
                        .await
                        .map_err(|e| connect_error(e, &address, form));
                let mut conn = match connected {
                    Ok(conn) => conn,
                    Err(e) => {
                        return Err(
                            said_at_accept(e, &address, form.tls, node_response_timeout).await
                        )
                    }
                };
                // Connecting sends nothing when the URL has no password, so
                // a Redis that wants one, a cluster node, or a server that
                // is not Redis would only show at the first decision: ask
                // now, so that an unusable store stops the caller at start.
                let checked = retry_timeouts!(deadline, node_response_timeout, {
                    check_node(&mut conn, &address, form).await
                });
                if let Err(e) = checked {
                    return Err(said_at_accept(e, &address, form.tls, node_response_timeout).await);
                }
                // A new client for each new connection: the one made at
                // start would reconnect with the certificates read then.
                let url: Arc<str> = Arc::from(url);
                let connect: Connect<ConnectionManager> = Box::new(move || {
                    let (url, files) = (Arc::clone(&url), Arc::clone(&files));
                    let manager_config = manager_config.clone();
                    Box::pin(async move {
                        let client = client_for(&url, read_again(files).await.as_ref())?;
                        ConnectionManager::new_with_config(client, manager_config).await
                    })
                });
                Backend::Node(
                    Arc::new(Renewing::new(
                        connect,
                        conn,
                        connect_timeout,
                        response_timeout,
                    )),
                    Arc::from(address),
                )
            };
            let store = Self::with_connection(backend, crate::redact_url(url), config, options);
            store.prepare(deadline, node_response_timeout).await?;
            let _ = tokio::time::timeout(node_response_timeout, store.warn_if_evicting()).await;
            Ok(store)
        };
        // A TLS handshake sent to a plain port gets no answer: the time
        // runs out, here or in the connection's own timeout, whichever
        // comes first, and either says so.
        let plain_hint = if !tls {
            String::new()
        } else {
            let ports = if cluster_url {
                "these ports take"
            } else {
                "this port takes"
            };
            format!(
                "; if {ports} plain connections, not TLS, use {}://",
                form.other_scheme()
            )
        };
        tokio::time::timeout(connect_timeout, connecting)
            .await
            .map_err(|_| {
                StoreError::new(
                    StoreErrorKind::Timeout,
                    format!("no connection to {shown} within {connect_timeout_ms} ms{plain_hint}"),
                )
            })?
    }

    /// A store on this store's connection, deciding by `config`, every key
    /// name starting with `prefix`: what [`RedisStore::connect`] with the
    /// same URL and options would give, but for those two, without a
    /// connection of its own.
    ///
    /// Many limiters on one Redis (one per rule of a service, say) then
    /// share one connection, multiplexed, instead of holding one each, and
    /// reconnect together; their calls, and on a cluster its
    /// [replacement connection](RedisStore::ping), are the same as with
    /// connections of their own. Keys stay apart as with separate stores:
    /// the prefix and the configuration are part of every key name.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), ratewarden_core::StoreError> {
    /// use ratewarden_core::{PolicyConfig, PolicyKind, REFERENCE};
    /// use ratewarden_redis::{RedisOptions, RedisStore};
    /// let logins = RedisStore::connect("redis://127.0.0.1:6379", REFERENCE, RedisOptions::default()).await?;
    /// let uploads = logins
    ///     .with_config(PolicyConfig::new(PolicyKind::TokenBucket, 10, 60_000), "uploads")
    ///     .await?;
    /// assert!(uploads.key_name(7).starts_with("uploads:"));
    /// # Ok(()) }
    /// ```
    ///
    /// Loading the script and the decision on a key of the store's own
    /// are made as when connecting, and refuse what connecting refuses.
    ///
    /// Errors: an invalid configuration ([`StoreErrorKind::InvalidInput`]);
    /// within `connect_timeout_ms`, the policy's script not loaded (on
    /// every master of a cluster), or the check's decision refused, as when
    /// connecting: Redis out of reach ([`StoreErrorKind::ConnectionDropped`]),
    /// a read-only replica or an ACL user without what the scripts need
    /// ([`StoreErrorKind::InvalidInput`]), Redis refusing otherwise
    /// ([`StoreErrorKind::Backend`]), or not answering
    /// ([`StoreErrorKind::Timeout`]).
    pub async fn with_config(
        &self,
        config: PolicyConfig,
        prefix: impl Into<String>,
    ) -> Result<RedisStore, StoreError> {
        crate::io::on_io(self.with_config_on_io(config, prefix.into())).await
    }

    async fn with_config_on_io(
        &self,
        config: PolicyConfig,
        prefix: String,
    ) -> Result<RedisStore, StoreError> {
        config
            .build()
            .map_err(|e| StoreError::new(StoreErrorKind::InvalidInput, e.to_string()))?;
        let options = RedisOptions {
            prefix,
            ..self.inner.options.clone()
        };
        let connect_timeout_ms = options.connect_timeout_ms;
        let per_try = node_response_timeout(Duration::from_millis(options.timeout_ms));
        let store = Self::with_connection(
            self.inner.backend.clone(),
            self.inner.url.clone(),
            config,
            options,
        );
        let deadline = tokio::time::Instant::now() + Duration::from_millis(connect_timeout_ms);
        let shown = store.url();
        match tokio::time::timeout_at(deadline, store.prepare(deadline, per_try)).await {
            Ok(Ok(())) => Ok(store),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(StoreError::new(
                StoreErrorKind::Timeout,
                format!(
                    "Redis at {shown} did not load the policy's script and decide on {} \
                     within {connect_timeout_ms} ms",
                    store.probe_key()
                ),
            )),
        }
    }

    /// Makes a new store ready to decide, by `deadline`, each try of a
    /// check that only timed out made again while `per_try` fits: loads
    /// the policy's script, which proves that scripts can run (on every
    /// master of a cluster) and saves the first call a NOSCRIPT, then
    /// makes the decision check (see [`RedisStore::check_writes`]).
    async fn prepare(
        &self,
        deadline: tokio::time::Instant,
        per_try: Duration,
    ) -> Result<(), StoreError> {
        retry_timeouts!(deadline, per_try, {
            self.load_script(&mut self.conn()).await
        })
        .map_err(|e| {
            // A user refused SCRIPT LOAD is told what to grant, as one
            // refused a decision's commands is.
            let (kind, advice) = if refused_permission(e.detail()) {
                (
                    StoreErrorKind::InvalidInput,
                    format!("; {}", permission_advice(e.detail())),
                )
            } else if let Some((kind, advice)) = refusal_advice(e.detail()) {
                (kind, format!("; {advice}"))
            } else {
                (e.kind(), String::new())
            };
            StoreError::new(
                kind,
                format!(
                    "Redis at {} cannot load the policy's script: {}{advice}",
                    self.url(),
                    e.detail()
                ),
            )
        })?;
        retry_timeouts!(deadline, per_try, {
            self.check_writes(&mut self.conn(), &self.probe_key()).await
        })
    }

    /// Logs a warning, once per Redis (by URL) in the process, when a
    /// Redis (on a cluster, any master, named) evicts keys once full: a key
    /// evicted starts its count again from empty, and admits again within
    /// its window, with nothing to show for it. Said, not refused: a Redis
    /// shared with a cache may have reasons. When no `INFO` is answered (a
    /// user without `+info`), that is said instead: the check did not run,
    /// nor did a single node's for a writable replica.
    async fn warn_if_evicting(&self) {
        static WARNED: Mutex<Vec<String>> = Mutex::new(Vec::new());
        let mut cmd = redis::cmd("INFO");
        cmd.arg("memory");
        // Each answer with the master it came from, where known: on a
        // cluster, the URL's seed need not be the node that evicts, and an
        // operator who looked there would find `noeviction`.
        let (answers, masters): (Vec<_>, Vec<Option<String>>) = match self.conn() {
            Conn::Cluster(cluster) => {
                let known = self.known_slot_map();
                let calls = every_master(&cluster, &cmd, &known, ResponsePolicy::AllSucceeded);
                // every_master calls one master per range of
                // one_range_per_master, in its order, or (with no map
                // known) makes one call of them all.
                let masters = if known.is_empty() {
                    vec![None]
                } else {
                    one_range_per_master(&known)
                        .map(|range| range.master.as_ref().map(|(h, p)| host_port(h, p)))
                        .collect()
                };
                (futures_util::future::join_all(calls).await, masters)
            }
            mut node => (vec![cmd.query_async::<Value>(&mut node).await], vec![None]),
        };
        let url = self.url();
        let first_warning = || {
            let mut warned = WARNED.lock().unwrap_or_else(PoisonError::into_inner);
            if warned.iter().any(|u| u == url) {
                return false;
            }
            // A bound on what is kept: past it, a Redis may be warned of
            // again.
            if warned.len() < 64 {
                warned.push(url.to_owned());
            }
            true
        };
        let refusals: Vec<RedisError> = answers
            .iter()
            .filter_map(|answer| match answer {
                Ok(value) => value.clone().extract_error().err(),
                Err(e) => Some(e.clone()),
            })
            .collect();
        if refusals.len() == answers.len() {
            // Timeouts and lost connections say nothing of INFO, and are
            // met by the calls that follow.
            let refused = refusals
                .into_iter()
                .find(|e| !e.is_timeout() && !e.is_connection_dropped());
            if let Some(e) = refused {
                self.inner.info_refused.store(true, Ordering::Relaxed);
                if first_warning() {
                    let replica = match self.conn() {
                        Conn::Cluster(_) => "",
                        _ => {
                            " (nor whether it is a writable replica, which counts apart from its \
                              master)"
                        }
                    };
                    let e = map_error(e);
                    tracing::warn!(
                        "Redis at {url} did not answer INFO memory ({}): whether it evicts keys \
                         once full was not checked{replica}; grant the URL's user +info, \
                         unless INFO is renamed away on purpose (docs/redis.md, \"What \
                         connecting checks\")",
                        e.detail()
                    );
                }
            }
            return;
        }
        let evicting = answers.iter().zip(masters).find_map(|(answer, master)| {
            let info = redis::from_redis_value_ref::<String>(answer.as_ref().ok()?).ok()?;
            Some((evicting_policy(&info)?, master))
        });
        let Some(((policy, maxmemory), master)) = evicting else {
            return;
        };
        let which = master.map_or_else(String::new, |m| format!(" (its master at {m})"));
        if !first_warning() {
            return;
        }
        tracing::warn!(
            "Redis at {url}{which} evicts keys once full (maxmemory-policy {policy}, maxmemory \
             {maxmemory} bytes): a rate-limit key evicted starts its count again from empty, and \
             admits again within its window; set maxmemory-policy noeviction, under which a full \
             Redis refuses writes and the failure policy answers (docs/redis.md, \"Failures\")"
        );
    }

    fn with_connection(
        backend: Backend,
        url: String,
        config: PolicyConfig,
        options: RedisOptions,
    ) -> Self {
        let (script, script_source) = policy_script(config.policy);
        let burst = config.effective_burst();
        let key_prefix = key_prefix(&options.prefix, &config);
        let config_args = [
            config.limit.to_string(),
            config.window_ms.to_string(),
            burst.to_string(),
        ];
        RedisStore {
            inner: Arc::new(Inner {
                backend,
                config,
                script,
                script_source,
                script_turn: tokio::sync::Mutex::new(()),
                scripts_sent: AtomicU64::new(0),
                key_prefix,
                config_args,
                options,
                url,
                info_refused: AtomicBool::new(false),
            }),
        }
    }

    /// The URL the store connected to, with any password replaced by
    /// `***`: what logs and messages name it by.
    pub fn url(&self) -> &str {
        &self.inner.url
    }

    /// The configuration every key is decided by.
    pub fn config(&self) -> &PolicyConfig {
        &self.inner.config
    }

    /// The options the store was built with.
    pub fn options(&self) -> &RedisOptions {
        &self.inner.options
    }

    /// The Redis key holding `key`'s state: the escaped prefix, the state
    /// format's version, the policy and its numbers, then the key, joined
    /// by `:`.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), ratewarden_core::StoreError> {
    /// # use ratewarden_redis::{RedisOptions, RedisStore};
    /// let store = RedisStore::connect("redis://127.0.0.1:6379", ratewarden_core::REFERENCE, RedisOptions::default()).await?;
    /// assert_eq!(store.key_name(7), "ratewarden:v2:sliding-window-counter:100:1000:7");
    /// # Ok(()) }
    /// ```
    pub fn key_name(&self, key: u64) -> String {
        format!("{}{}", self.inner.key_prefix, key)
    }

    /// The SHA1 of the policy's script, as `EVALSHA` takes it.
    pub fn script_sha(&self) -> &str {
        self.inner.script.get_hash()
    }

    /// The script's arguments (`ARGV`) for one request of `cost`, by
    /// `now_ms` or, with `None`, by Redis `TIME`: what `EVALSHA` takes after
    /// the script's SHA, `1` and the key's name. For tools that drive the
    /// script themselves, such as the benchmark's `redis-benchmark` runs.
    pub fn script_args(&self, cost: u64, now_ms: Option<u64>) -> Vec<String> {
        let o = &self.inner.options;
        let mut args = self.inner.config_args.to_vec();
        args.push(cost.to_string());
        args.push(now_ms.map_or(String::new(), |n| n.to_string()));
        args.push(o.ttl_grace_ms.to_string());
        args.push(o.max_ttl_ms.to_string());
        args
    }

    fn eval_cmd(&self, key: u64, now_ms: Option<u64>, cost: u64) -> Cmd {
        self.eval_named(false, &self.key_name(key), now_ms, cost)
    }

    /// The script call for the Redis key `name`, with the store's TTL
    /// options (see [`RedisStore::script_call`]).
    fn eval_named(&self, by_source: bool, name: &str, now_ms: Option<u64>, cost: u64) -> Cmd {
        let o = &self.inner.options;
        self.script_call(
            by_source,
            name,
            now_ms,
            cost,
            (o.ttl_grace_ms, o.max_ttl_ms),
        )
    }

    /// The script's call on the Redis key `name`, with `ttl`'s grace and
    /// longest TTL: by `EVALSHA`, or `by_source`, as `EVAL` with the
    /// script's text, which any node runs, and caches, whether or not the
    /// script was loaded there.
    fn script_call(
        &self,
        by_source: bool,
        name: &str,
        now_ms: Option<u64>,
        cost: u64,
        ttl: (u64, u64),
    ) -> Cmd {
        let mut cmd = if by_source {
            let mut cmd = redis::cmd("EVAL");
            cmd.arg(self.inner.script_source);
            cmd
        } else {
            let mut cmd = redis::cmd("EVALSHA");
            cmd.arg(self.inner.script.get_hash());
            cmd
        };
        cmd.arg(1)
            .arg(name)
            .arg(&self.inner.config_args[..])
            .arg(cost)
            .arg(now_ms.map_or(String::new(), |n| n.to_string()))
            .arg(ttl.0)
            .arg(ttl.1);
        cmd
    }

    /// The core's range check; Redis `TIME` (no `now_ms`) is in range.
    fn check(now_ms: Option<u64>, cost: u64) -> Result<(), StoreError> {
        ratewarden_core::check_request(now_ms.unwrap_or(0), cost)
    }

    /// A handle on the current connection, for one call.
    fn conn(&self) -> Conn {
        match &self.inner.backend {
            Backend::Node(c, _) => Conn::Node(c.conn(), Arc::clone(c)),
            Backend::Cluster(c, _) => Conn::Cluster(c.conn()),
        }
    }

    /// What a failed TLS handshake in the client's error `text` means, in
    /// the user's terms, as when connecting; `None` when it is no such
    /// failure. The client reconnects with the certificates it was made
    /// with, so such a failure also starts a new connection (at most one a
    /// second), which reads the files again: they may have been replaced
    /// since (see `CertificateFiles`).
    fn tls_failure(&self, text: &str) -> Option<String> {
        let url = self.url();
        if !crate::tls::is_tls_url(url) {
            return None;
        }
        let ca_file = self.inner.options.tls_ca_file.is_some();
        let said = crate::tls::handshake_error(text, url, ca_file, crate::is_cluster_url(url))?;
        self.renew_connection();
        Some(said)
    }

    /// A failed call's error, the same for every timeout (the store's own
    /// or the client's): a timeout says that the request may have been
    /// applied.
    fn call_error(&self, e: StoreError) -> StoreError {
        match e.kind() {
            StoreErrorKind::Timeout => self.timed_out(),
            // Named, since the connection's own words ("Reconnecting
            // failed: Connection refused") do not say which Redis; a
            // reconnection refused in TLS (certificates replaced on either
            // side) is said as when connecting, with what to change.
            StoreErrorKind::ConnectionDropped | StoreErrorKind::Backend => {
                let url = self.url();
                let over_tls = crate::tls::is_tls_url(url);
                let tls = self.tls_failure(e.detail());
                // On a cluster the client says only that it has no
                // connection to a node, not why: a handshake that failed
                // is one reason, met as `tls_failure` meets it; a slot map
                // read from a node since removed (`del-node`), which names
                // no node and so dropped every connection, is another. The
                // client itself then reconnects only to the URL's seeds,
                // which may be that node, for good: a new connection starts
                // from the masters last known.
                if e.detail().contains("ClusterConnectionNotFound") {
                    self.renew_connection();
                }
                let detail = tls.unwrap_or_else(|| {
                    // A replica after a failover, an ACL changed, a full
                    // Redis: what was checked at connect no longer holds.
                    let advice = refusal_advice(e.detail())
                        .map(|(_, advice)| advice)
                        .or_else(|| self.cluster_node_advice(e.detail()))
                        .or_else(|| cluster_hint(e.detail(), over_tls))
                        .map(|advice| format!("; {advice}"))
                        .unwrap_or_default();
                    format!("Redis at {url}: {}{advice}", e.detail())
                });
                StoreError::new(e.kind(), detail)
            }
            _ => e,
        }
    }

    /// On one node, when an error's `detail` is a redirection to another
    /// node, which only a cluster node sends (a cluster node behind a
    /// one-node URL whose user may not run the INFO that connecting reads
    /// to tell, or a node restarted as a cluster node): what to change.
    fn cluster_node_advice(&self, detail: &str) -> Option<String> {
        if !matches!(self.inner.backend, Backend::Node(..)) || !redirected(detail) {
            return None;
        }
        let (_, cluster_scheme) = schemes(crate::tls::is_tls_url(self.url()));
        Some(format!(
            "it is a cluster node: use {cluster_scheme}://HOST:PORT[,HOST:PORT...] (any nodes as \
             seeds)"
        ))
    }

    /// After a failed call, with error `e`: on a cluster, when its master
    /// may be down (the call timed out or lost its connection), checks in
    /// the background which masters are (see [`crate::down`]).
    fn look_for_down_masters(&self, e: &StoreError) {
        if matches!(
            e.kind(),
            StoreErrorKind::Timeout | StoreErrorKind::ConnectionDropped
        ) {
            self.probe_every_master();
        }
    }

    /// On a cluster, notes that a call got `result` from Redis, so that
    /// the connection still answers (see [`RedisStore::decide`]): a
    /// decision or an error of Redis's own, not a failure to reach a
    /// master, which redis-rs can report at once for a master that is
    /// down while it answers no other call.
    fn note_answer(&self, result: &Result<Decision, StoreError>) {
        let Backend::Cluster(cluster, _) = &self.inner.backend else {
            return;
        };
        // Only single calls read it, and only those whose timeout is
        // longer than the stall they watch for: every store on one
        // connection has the same timeout.
        let timeout = Duration::from_millis(self.inner.options.timeout_ms);
        if Self::stall_of(timeout) >= timeout {
            return;
        }
        let reached = match result {
            Ok(_) => true,
            Err(e) => !matches!(
                e.kind(),
                StoreErrorKind::Timeout | StoreErrorKind::ConnectionDropped
            ),
        };
        if reached {
            cluster.answered();
        }
    }

    /// Calls on the cluster connection of `generation` went unanswered for
    /// a while (a batch's, or a single call's): every master is probed and
    /// a new connection made (see [`Renewing::stalled`]). Probed first: a
    /// master killed under the calls can be why, since redis-rs tries its
    /// calls again instead of failing them, and a slot-map read it starts
    /// meanwhile can wait for ever, with every other call behind it. No
    /// call has failed, so no probe has found the master down yet; until
    /// one does, the new connection would be sent its calls too, and stall
    /// the same way.
    fn cluster_stalled(&self, cluster: &Arc<Renewing<ClusterConnection>>, generation: u64) {
        self.probe_every_master();
        cluster.stalled(generation);
    }

    /// On a cluster with masters found down, probes them again in the
    /// background (see [`crate::down`]), so that a mark is cleared once its
    /// master accepts connections.
    fn probe_down_masters(&self) {
        if let Backend::Cluster(cluster, down) = &self.inner.backend {
            if down.any_down() {
                let renewing = Arc::clone(cluster);
                down.check(
                    Probe::Down,
                    || cluster.conn(),
                    move || renewing.renew(false),
                );
            }
        }
    }

    /// On a cluster, checks in the background which masters are down (see
    /// [`crate::down`]).
    fn probe_every_master(&self) {
        if let Backend::Cluster(cluster, down) = &self.inner.backend {
            let renewing = Arc::clone(cluster);
            down.check(
                Probe::Every,
                || cluster.conn(),
                move || renewing.renew(false),
            );
        }
    }

    /// On a cluster, when the master of `key` is down (see
    /// [`crate::down`]), the error of its call, which is not sent; the
    /// masters found down are then probed again, in the background.
    fn not_sent_to_down_master(&self, key: u64) -> Option<StoreError> {
        let Backend::Cluster(_, down) = &self.inner.backend else {
            return None;
        };
        if !down.any_down() {
            return None;
        }
        let (range, why) = down.refusing(self.key_name(key).as_bytes())?;
        self.probe_down_masters();
        Some(self.call_error(StoreError::new(
            StoreErrorKind::ConnectionDropped,
            format!(
                "the master of slots {range} {why}, so the call was not sent and nothing was \
                 applied; its slots are sent again once it accepts connections or the cluster \
                 names another master for them"
            ),
        )))
    }

    /// On a cluster, a timeout's or a lost connection's error for `key`
    /// with the master its slot went to, as the slot map last read names
    /// it: the URL names only the seeds, and the master that stopped
    /// answering is what an operator looks for among many.
    fn naming_the_master(&self, key: u64, e: StoreError) -> StoreError {
        let Backend::Cluster(_, down) = &self.inner.backend else {
            return e;
        };
        let lost = matches!(
            e.kind(),
            StoreErrorKind::Timeout | StoreErrorKind::ConnectionDropped
        );
        if !lost || e.detail().contains("the master of slots") {
            return e;
        }
        match down.range_of_key(self.key_name(key).as_bytes()) {
            Some(range) => StoreError::new(
                e.kind(),
                format!(
                    "{} (the key's slot is in {range}, as the slot map last read names its \
                     master)",
                    e.detail()
                ),
            ),
            None => e,
        }
    }

    /// The cluster's slot map as last read (see [`DownMasters`]); empty on
    /// one node, or when none could be read.
    fn known_slot_map(&self) -> Vec<SlotRange> {
        match &self.inner.backend {
            Backend::Cluster(_, down) => down.map(),
            Backend::Node(..) => Vec::new(),
        }
    }

    /// Starts a new connection in the background for later calls, at most
    /// one a second (see [`Renewing`]).
    fn renew_connection(&self) {
        match &self.inner.backend {
            Backend::Node(node, _) => node.timed_out(),
            Backend::Cluster(cluster, _) => cluster.timed_out(),
        }
    }

    /// The error for a call that took its whole timeout. A timeout also
    /// starts a new connection (see [`Renewing`]), for later calls.
    fn timed_out(&self) -> StoreError {
        self.renew_connection();
        StoreError::new(
            StoreErrorKind::Timeout,
            format!(
                "Redis at {} did not answer within {} ms; the request may or may not have been \
                 applied",
                self.url(),
                self.inner.options.timeout_ms
            ),
        )
    }

    /// The error of a batch's request that was not sent because an
    /// earlier request of its key was given up (see
    /// [`RedisStore::decide_many`]): nothing of it was applied.
    fn not_sent_after_give_up(&self) -> StoreError {
        StoreError::new(
            StoreErrorKind::Timeout,
            "an earlier request of its key in the batch was given up (see its error), so this \
             one was not sent, to keep the key's requests in order",
        )
    }

    /// The error of a cluster batch's call given up for a new connection
    /// after the batch got no answer for `stall` (see
    /// [`RedisStore::decide_many`]).
    fn given_up(&self, stall: Duration) -> StoreError {
        StoreError::new(
            StoreErrorKind::Timeout,
            format!(
                "Redis at {} answered none of the batch's calls for {} ms, so this call was \
                 given up for a new connection; the request may or may not have been applied",
                self.url(),
                stall.as_millis()
            ),
        )
    }

    /// The error of a single call on a cluster given up, after `stall`
    /// or more without an answer, because its connection was replaced
    /// (see [`RedisStore::watched`]).
    fn single_given_up(&self, stall: Duration) -> StoreError {
        StoreError::new(
            StoreErrorKind::Timeout,
            format!(
                "Redis at {} did not answer this call for {} ms or more, and its connection, which \
                 had stopped answering, was replaced meanwhile, so the call was given up; the \
                 request may or may not have been applied",
                self.url(),
                stall.as_millis()
            ),
        )
    }

    /// The error of a batch's request that was not sent because the
    /// batch's time ran out before its turn (a key's earlier request, or
    /// sending the batch's other requests, took it): nothing of it was
    /// applied.
    fn not_sent(&self) -> StoreError {
        StoreError::new(
            StoreErrorKind::Timeout,
            format!(
                "the batch's {} ms ran out before this request's turn; it was not sent",
                self.inner.options.timeout_ms
            ),
        )
    }

    /// Decides a request of `cost` for `key`, atomically on Redis.
    ///
    /// `now_ms`: `None` reads Redis `TIME` inside the script (one clock for
    /// every client); `Some` uses the caller's time (for tests and vectors;
    /// every client must then share a good clock). Keys still expire by
    /// Redis's clock: times that do not follow it (a test's made-up times,
    /// a replayed trace) are decided as the policy says only with a
    /// [`RedisOptions::ttl_grace_ms`] longer than the run, as `ratewarden
    /// vectors` sets; without one, a key whose TTL (from the caller's
    /// times) runs out in real time is forgotten while it still counts.
    /// The call never takes longer than `timeout_ms`. On a cluster, one
    /// left without an answer for a quarter of it (at least 100 ms) while
    /// no call at all is answered has every master probed and a new
    /// connection made, and is given up with a
    /// [`StoreErrorKind::Timeout`] once that is in place (it may have been
    /// applied); see `docs/redis.md`.
    pub async fn decide(
        &self,
        key: u64,
        now_ms: Option<u64>,
        cost: u64,
    ) -> Result<Decision, StoreError> {
        crate::io::on_io(self.decide_on_io(key, now_ms, cost)).await
    }

    async fn decide_on_io(
        &self,
        key: u64,
        now_ms: Option<u64>,
        cost: u64,
    ) -> Result<Decision, StoreError> {
        Self::check(now_ms, cost)?;
        if let Some(e) = self.not_sent_to_down_master(key) {
            return Err(e);
        }
        let timeout = Duration::from_millis(self.inner.options.timeout_ms);
        let result = match self
            .watched(timeout, self.call_one(key, now_ms, cost))
            .await
        {
            Watched::Answered(result) => {
                self.note_answer(&result);
                result.map_err(|e| self.call_error(e))
            }
            Watched::TimedOut => Err(self.timed_out()),
            Watched::GivenUp(stall) => Err(self.single_given_up(stall)),
        };
        if let Err(e) = &result {
            self.look_for_down_masters(e);
        }
        result.map_err(|e| self.naming_the_master(key, e))
    }

    /// How long calls with `timeout` go without an answer before the
    /// connection is taken for stalled: a quarter of it, at least
    /// [`CLUSTER_BATCH_SLOW_CALL`].
    fn stall_of(timeout: Duration) -> Duration {
        (timeout / 4).max(CLUSTER_BATCH_SLOW_CALL)
    }

    /// Awaits a single call for at most `timeout`.
    ///
    /// On a cluster, a call left without an answer for a quarter of its
    /// timeout (at least [`CLUSTER_BATCH_SLOW_CALL`]) may be on a
    /// connection that stopped answering every call: redis-rs stops
    /// polling its calls while it reads the slot map again, and after a
    /// failover, or a master killed under many calls, that read can wait
    /// for ever (see [`RedisStore::decide_many`]). So the call is looked at
    /// then, and every sixteenth of its timeout after:
    /// - once no call at all has had an answer from Redis for a quarter of
    ///   the timeout, every master is probed and a new connection is made,
    ///   as the call's timeout would, sooner (a master found down has its
    ///   later calls not sent, and so cannot stall the new connection
    ///   too), and the call is given up once that connection is in place;
    /// - once its connection has been replaced (for another call, or a
    ///   timeout), the call is given up at once: the answers since may be
    ///   the new connection's.
    ///
    /// In both, only by a connection whose making began after the call was
    /// sent. A cluster connection is taken only when every master answered
    /// on it as itself or is down, and its commands reached each master
    /// after the call, so a call still waiting on the old one waits on a
    /// connection that stopped answering: a Redis that is only slow
    /// answers the call first. (A call sent after the making began, and
    /// before the new connection was in place, waits on to its timeout:
    /// the new connection's commands may have reached Redis before it.)
    async fn watched<T>(
        &self,
        timeout: Duration,
        call: impl std::future::Future<Output = T>,
    ) -> Watched<T> {
        let started = tokio::time::Instant::now();
        let deadline = started + timeout;
        let Backend::Cluster(cluster, _) = &self.inner.backend else {
            return Watched::by(deadline, call).await;
        };
        let stall = Self::stall_of(timeout);
        // Read before the call takes its connection (see `generation`).
        let generation = cluster.generation();
        // A replacement begun after this call was sent: the new
        // connection's commands reached every master after this call, and
        // were answered while this call was not.
        let replaced = move |swap: &Swap| generation < swap.generation && started <= swap.begun;
        let mut call = std::pin::pin!(call);
        let mut look_at = started + stall;
        let out = loop {
            if look_at >= deadline {
                break Watched::by(deadline, &mut call).await;
            }
            if let Ok(out) = tokio::time::timeout_at(look_at, &mut call).await {
                break Watched::Answered(out);
            }
            if replaced(&cluster.swaps.borrow()) {
                break Watched::GivenUp(stall);
            }
            if cluster.quiet_for() < stall {
                // Other calls are answered: this one is only slow.
                look_at += stall / 4;
                continue;
            }
            self.cluster_stalled(cluster, generation);
            let mut swaps = cluster.swaps.subscribe();
            let swapped = async move {
                if swaps.wait_for(replaced).await.is_err() {
                    // The sender lives as long as the connection.
                    std::future::pending::<()>().await;
                }
            };
            break match futures_util::future::select(
                std::pin::pin!(Watched::by(deadline, &mut call)),
                std::pin::pin!(swapped),
            )
            .await
            {
                Either::Left((out, _)) => out,
                Either::Right(_) => Watched::GivenUp(stall),
            };
        };
        out
    }

    /// Asks Redis whether it can decide, within
    /// [`RedisOptions::timeout_ms`], touching no limiter's key. For
    /// readiness checks.
    ///
    /// One node: `PING`, then one decision of cost 1 on a key of the
    /// store's own, named apart from every limiter key (its prefix and
    /// configuration, then `probe`), which is then deleted: a read-only
    /// replica, an ACL user without a command or key the scripts need, or a
    /// Redis out of memory answers `PING` and refuses every decision. A
    /// cluster: `CLUSTER SLOTS` (of every master, the
    /// first answer taken), then, to each master, routed by slot as a
    /// decision for its first slot range is, `CLUSTER MYID` and `CLUSTER
    /// INFO`, then the decision check on a key of the store's own in that
    /// range (the key above with a hash tag): the node that answers must be
    /// the master the slot map names (the client answers from another node
    /// when it cannot reach a slot's master), must report
    /// `cluster_state:ok` (a master just restarted answers at once, but
    /// refuses its keys until the cluster takes it back) and must decide,
    /// as a node must (a master out of memory answers the rest). Every slot
    /// must have a master. So a cluster is ready only when every slot's
    /// master answers and decides, and a master this client cannot reach
    /// fails it, even while the others answer. When another node answers in
    /// a master's place, or a connection is found broken, a new connection
    /// is started in the background, as for a timeout: the client's slot
    /// map may be out of date (a failover it has not seen, which nothing
    /// else would tell it without decisions on those keys).
    ///
    /// Errors: as [`RedisStore::decide`]'s, except that a timeout says
    /// only what did not answer (a `PING` changes nothing, the decision only
    /// the store's own key), on a cluster
    /// naming the master's slots and address. On a cluster, a timeout also
    /// starts a new connection for later calls, as a decision's does.
    pub async fn ping(&self) -> Result<(), StoreError> {
        crate::io::on_io(self.ping_on_io()).await
    }

    async fn ping_on_io(&self) -> Result<(), StoreError> {
        let timeout_ms = self.inner.options.timeout_ms;
        let deadline = tokio::time::Instant::now() + Duration::from_millis(timeout_ms);
        let timed_out = |what: &str| {
            let e = self.timed_out();
            StoreError::new(e.kind(), format!("{what} within {timeout_ms} ms"))
        };
        // Marks of masters found down age here too, not only by calls: a
        // store that only pings makes none.
        self.probe_down_masters();
        let cluster = match self.conn() {
            Conn::Cluster(cluster) => cluster,
            mut conn => {
                let cmd = redis::cmd("PING");
                match tokio::time::timeout_at(deadline, self.try_call(&mut conn, &cmd)).await {
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) if e.is_timeout() => {
                        return Err(timed_out("Redis did not answer PING"))
                    }
                    Ok(Err(e)) => {
                        let e = map_error(e);
                        if let Some(advised) = advised(&e) {
                            return Err(advised);
                        }
                        return Err(match self.tls_failure(e.detail()) {
                            Some(said) => StoreError::new(e.kind(), said),
                            None => self.said_at_accept(e, deadline).await,
                        });
                    }
                    Err(_) => return Err(timed_out("Redis did not answer PING")),
                }
                // A node made a replica since connecting (REPLICAOF): a
                // writable one goes on deciding, apart from its master and
                // refused at connect. Not asked where INFO was refused
                // (connecting warned of it), and given half the time left,
                // so that a slow answer leaves the decision check its own.
                if !self.inner.info_refused.load(Ordering::Relaxed) {
                    let mut info = redis::cmd("INFO");
                    info.arg("replication");
                    let now = tokio::time::Instant::now();
                    let half = now + deadline.saturating_duration_since(now) / 2;
                    match tokio::time::timeout_at(half, self.try_call(&mut conn, &info)).await {
                        Ok(Ok(answer)) => {
                            let text =
                                redis::from_redis_value_ref::<String>(&answer).unwrap_or_default();
                            if let Some(master) = replica_of(&text) {
                                return Err(replica_error(self.url(), &master));
                            }
                        }
                        Ok(Err(e)) if !e.is_timeout() && !e.is_connection_dropped() => {
                            self.inner.info_refused.store(true, Ordering::Relaxed);
                        }
                        _ => {}
                    }
                }
                // A Redis that answers can still refuse every decision.
                let name = self.probe_key();
                let checked =
                    tokio::time::timeout_at(deadline, self.check_writes(&mut conn, &name));
                return match checked.await {
                    Ok(Ok(())) => Ok(()),
                    Ok(Err(e)) if e.kind() != StoreErrorKind::Timeout => Err(e),
                    _ => Err(timed_out(&format!(
                        "Redis answered PING, but not a decision on {}",
                        self.probe_key()
                    ))),
                };
            }
        };
        let slots = {
            let known = self.known_slot_map();
            let asked = ask_slot_map(&cluster, &known);
            match tokio::time::timeout_at(deadline, asked).await {
                Ok(Ok(value)) => slot_ranges(&value)?,
                Ok(Err(e)) if e.is_timeout() => {
                    return Err(timed_out("no master answered CLUSTER SLOTS"))
                }
                Ok(Err(e)) => {
                    // A connection broken (every node restarted, say) is
                    // mended by a new one, as after a timeout: probes make
                    // no decision that would show the client otherwise.
                    let e = map_error(e);
                    if e.kind() == StoreErrorKind::ConnectionDropped {
                        self.renew_connection();
                    }
                    if let Some(advised) = advised(&e) {
                        return Err(advised);
                    }
                    // Said as a call's error says it.
                    if e.detail().contains("ClusterConnectionNotFound") {
                        let tls = crate::tls::is_tls_url(self.url());
                        let hint = cluster_hint(e.detail(), tls).unwrap_or_default();
                        let detail = format!("{}; {hint}", e.detail());
                        return Err(StoreError::new(e.kind(), detail));
                    }
                    return Err(e);
                }
                Err(_) => return Err(timed_out("no master answered CLUSTER SLOTS")),
            }
        };
        // A cluster that does not require full coverage stays
        // `cluster_state:ok` with slots nobody serves, whose keys fail.
        let assigned: u32 = slots
            .iter()
            .map(|r| u32::from(r.last.saturating_sub(r.first)) + 1)
            .sum();
        if assigned < u32::from(SLOTS) {
            return Err(StoreError::new(
                StoreErrorKind::ConnectionDropped,
                format!(
                    "CLUSTER SLOTS assigns {assigned} of the 16384 slots to a master: keys of \
                     the others cannot be decided"
                ),
            ));
        }
        // One check per master: its first range stands for the others.
        let mut ranges_of: std::collections::HashMap<&str, usize> = Default::default();
        let mut masters: Vec<&SlotRange> = Vec::new();
        for range in &slots {
            match ranges_of.get_mut(range.id.as_str()) {
                Some(n) => *n += 1,
                None => {
                    ranges_of.insert(&range.id, 1);
                    masters.push(range);
                }
            }
        }
        let checks = masters.into_iter().map(|range| {
            let mut conn = cluster.clone();
            async move {
                let checked = async {
                    // A master that answers can still refuse every
                    // decision (out of memory, say), as a node can.
                    let name = self.probe_key_in(range);
                    match check_master(&mut conn, range).await {
                        Ok(()) => self
                            .check_writes(&mut Conn::Cluster(conn), &name)
                            .await
                            .map_err(MasterCheck::Refused),
                        Err(MasterCheck::Another(id)) => {
                            // redis-rs sends a dead master's calls to
                            // another node (which answers as itself).
                            let down = match (&self.inner.backend, range.master.as_ref()) {
                                (Backend::Cluster(_, down), Some(address)) => {
                                    down.refuses(address).await
                                }
                                _ => false,
                            };
                            if down {
                                return Err(MasterCheck::Down);
                            }
                            // Or the client's slot map is behind the
                            // cluster's, as it is through every slot
                            // migration: a decision, redirected by MOVED
                            // or ASK, still reaches the master, and then
                            // nothing is wrong but the map.
                            match self.check_writes(&mut Conn::Cluster(conn), &name).await {
                                Ok(()) => Err(MasterCheck::MapBehind),
                                Err(_) => Err(MasterCheck::Another(id)),
                            }
                        }
                        Err(e) => Err(e),
                    }
                };
                (range, tokio::time::timeout_at(deadline, checked).await)
            }
        });
        let answers = futures_util::future::join_all(checks).await;
        let checked = answers.len();
        let master = |range: &SlotRange| match ranges_of[range.id.as_str()] - 1 {
            0 => format!("the master of slots {range}"),
            1 => format!("the master of slots {range} and 1 more range"),
            n => format!("the master of slots {range} and {n} more ranges"),
        };
        // Every master that did not answer in time is named: while the
        // client reconnects to a node that failed, it can hold up the
        // checks of the others too, and naming only the first would then
        // name a healthy master.
        let mut silent = Vec::new();
        // Masters that answered without cluster_state:ok: while one hangs,
        // the cluster reports fail on every other, and the hung one is
        // the one to name, so these are said only when no master is
        // silent.
        let mut not_ok = Vec::new();
        for (range, answer) in answers {
            let master = master(range);
            let failed =
                |detail: String| Err(StoreError::new(StoreErrorKind::ConnectionDropped, detail));
            match answer {
                Ok(Ok(())) => {}
                // A slot map out of date (a failover or a slot migration
                // the client has not seen) is mended only by a new
                // connection: nothing else tells redis-rs, since its
                // fallback node answered, or MOVED was followed.
                Ok(Err(MasterCheck::MapBehind)) => self.renew_connection(),
                Ok(Err(MasterCheck::Down)) => {
                    self.renew_connection();
                    return failed(format!(
                        "{master} refuses connections (it is down): its keys cannot be \
                         decided until it is back, or until a replica that took over its \
                         slots is found (a new connection reads the slot map again)"
                    ));
                }
                Ok(Err(MasterCheck::Another(id))) => {
                    self.renew_connection();
                    return failed(format!(
                        "{master}: node {id} answered in its place (the client cannot reach \
                         it or use it, or its slot map is out of date; a master new to the \
                         cluster may lack the URL's ACL user, which Redis keeps per node)"
                    ));
                }
                Ok(Err(MasterCheck::NotOk)) => not_ok.push(master),
                Ok(Err(MasterCheck::Refused(e))) if e.kind() == StoreErrorKind::Timeout => {
                    silent.push(master)
                }
                Ok(Err(MasterCheck::Refused(e))) => {
                    return Err(StoreError::new(
                        e.kind(),
                        format!("{master}: {}", e.detail()),
                    ))
                }
                Ok(Err(MasterCheck::Redis(e))) if e.is_timeout() => silent.push(master),
                Ok(Err(MasterCheck::Redis(e))) => {
                    let e = map_error(e);
                    if e.kind() == StoreErrorKind::ConnectionDropped {
                        self.renew_connection();
                    }
                    return Err(StoreError::new(
                        e.kind(),
                        format!("{master}: {}", e.detail()),
                    ));
                }
                Err(_) => silent.push(master),
            }
        }
        match silent.as_slice() {
            [] => not_ok_said(&not_ok, checked),
            [one] => Err(timed_out(&format!("{one} did not answer"))),
            all if all.len() == checked => Err(timed_out(&format!(
                "none of the {checked} masters ({}) answered",
                all.join("; ")
            ))),
            some => Err(timed_out(&format!("{} did not answer", some.join("; ")))),
        }
    }

    /// Whether a call that failed with `e` goes once more, on a new
    /// connection, within the same timeout.
    ///
    /// A single node's connection can be gone when a call starts: closed by
    /// Redis's idle `timeout`, by a restart or by `CLIENT KILL`, it is
    /// noticed only when a call fails on it. The connection manager then
    /// starts a new connection, but does not repeat the call, so without
    /// one more try the first call after such a close would get the
    /// failure policy although Redis has been back for a while.
    ///
    /// A connection error does not prove that Redis ran nothing: when the
    /// connection broke after the script reached Redis and before its
    /// reply came back, the script ran and the second try runs it again,
    /// spending that request's cost twice. That is the worst case, and a
    /// conservative one (later decisions may be stricter, never looser),
    /// as for a timed-out call (see "The ambiguous outcome" in
    /// `docs/redis.md`). A timeout is never tried again: the call's time is
    /// spent. A cluster connection retries such errors itself.
    fn retry_on_new_connection(&self, e: &RedisError) -> bool {
        matches!(self.inner.backend, Backend::Node(..))
            && e.is_unrecoverable_error()
            && !e.is_timeout()
    }

    /// On one node, `e` or what the node said as it closed a new
    /// connection (see [`said_at_accept`]), asked until `deadline`.
    async fn said_at_accept(&self, e: StoreError, deadline: tokio::time::Instant) -> StoreError {
        let Backend::Node(_, address) = &self.inner.backend else {
            return e;
        };
        let tls = crate::tls::is_tls_url(self.url());
        let wait = deadline.saturating_duration_since(tokio::time::Instant::now());
        said_at_accept(e, address, tls, wait).await
    }

    /// After a failed call on one node: when its error is that of a
    /// reconnection refused in its set-up (the URL's password or database
    /// no longer accepted), starts a new connection (at most one a
    /// second). redis-rs's connection manager reconnects only after an
    /// I/O error; a reconnection that failed for another reason is kept,
    /// and its error returned to every call after, for good, though Redis
    /// would take the connection again once the password or database is
    /// set back.
    fn renew_if_reconnection_refused(&self, e: &RedisError) {
        if matches!(self.inner.backend, Backend::Node(..)) && reconnection_refused(e) {
            self.renew_connection();
        }
    }

    /// A script call that a migrating slot's node answered `ASK`, sent to
    /// the node the key moved to, as one pipeline `ASKING` + the call.
    ///
    /// The cluster client follows `ASK` itself, but sends `ASKING` and the
    /// command as two requests on the node's connection, which concurrent
    /// requests share: another request's command can fall between them,
    /// take the `ASKING`, and the command is answered `ASK` again, until
    /// the client's retries run out (most decisions on a moved key failed
    /// that way under eight concurrent callers). A pipeline goes out in
    /// one write, so nothing comes between the two. The node that answered
    /// `ASK` ran nothing, so this is the call's only run.
    async fn call_asking(
        cluster: &mut ClusterConnection,
        ask: RedisError,
        cmd: &Cmd,
    ) -> RedisResult<Value> {
        let Some((host, port)) = ask
            .redirect_node()
            .and_then(|(addr, _slot)| addr.rsplit_once(':'))
            .and_then(|(host, port)| Some((host.to_owned(), port.parse().ok()?)))
        else {
            return Err(ask);
        };
        let mut pipe = redis::pipe();
        pipe.cmd("ASKING").add_command(cmd.clone());
        let mut values = cluster
            .route_pipeline(pipe, 1, 1, SingleNodeRoutingInfo::ByAddress { host, port })
            .await?;
        match values.pop() {
            Some(value) => value.extract_error(),
            None => Err(ask),
        }
    }

    /// One try of a script call: once more on a new connection when the
    /// old one was found closed (see
    /// [`RedisStore::retry_on_new_connection`]), and straight to the
    /// importing node when a migrating slot answers `ASK`.
    async fn try_call(&self, conn: &mut Conn, cmd: &Cmd) -> RedisResult<Value> {
        // Server errors arrive as values; extract_error makes them errors.
        let mut result = conn
            .req_packed_command(cmd)
            .await
            .and_then(Value::extract_error);
        if matches!(&result, Err(e) if self.retry_on_new_connection(e)) {
            result = conn
                .req_packed_command(cmd)
                .await
                .and_then(Value::extract_error);
        }
        if let Err(e) = &result {
            self.renew_if_reconnection_refused(e);
        }
        match (result, conn) {
            (Err(e), Conn::Cluster(cluster))
                if e.kind() == ErrorKind::Server(ServerErrorKind::Ask) =>
            {
                Self::call_asking(cluster, e, cmd).await
            }
            (result, _) => result,
        }
    }

    /// The Redis key the store's own checks decide on and then delete:
    /// under its prefix and configuration, as its keys are (so an ACL key
    /// pattern that lets it decide lets the checks too), and named apart
    /// from every one of them, which end in a number.
    fn probe_key(&self) -> String {
        format!("{}probe", self.inner.key_prefix)
    }

    /// [`RedisStore::probe_key`] with a hash tag that puts it in `range`'s
    /// first slot, for the check of that range's master (see
    /// [`slot_tag`]).
    fn probe_key_in(&self, range: &SlotRange) -> String {
        format!("{}:{{{}}}", self.probe_key(), slot_tag(range.first))
    }

    /// Whether decisions can be made, not only commands answered: one
    /// decision of cost 1 on [`RedisStore::probe_key`], then `DEL` of that
    /// key. A read-only replica, an ACL user without a command or key the
    /// scripts need, a Redis out of memory or short of replicas answer
    /// `PING` and `SCRIPT LOAD`, and refuse this (the `DEL` writes even
    /// when the decision does not).
    ///
    /// The decision is by Redis `TIME`, which decisions without a `now_ms`
    /// need, or with [`RedisOptions::checks_by_redis_time`] `false` by this
    /// machine's clock, as a caller's time (a store whose decisions all
    /// pass `now_ms` needs no `TIME`). A check by `TIME` refused by the ACL
    /// is made again by this machine's clock: if that one passes, `TIME`
    /// alone is missing, and the error says so. The check sets a TTL of at
    /// most [`PROBE_TTL_MS`], so a key left by a check cut short before its
    /// `DEL` goes soon, whatever the configuration.
    async fn check_writes(&self, conn: &mut Conn, name: &str) -> Result<(), StoreError> {
        let machine_now_ms = || ratewarden_core::Clock::now_ms(&ratewarden_core::SystemClock);
        let by_redis_time = self.inner.options.checks_by_redis_time;
        let now_ms = (!by_redis_time).then(machine_now_ms);
        let checked = self.decide_and_delete(conn, name, now_ms).await;
        if let Err(e) = &checked {
            if by_redis_time
                && refused_permission(e.detail())
                && (self
                    .decide_and_delete(conn, name, Some(machine_now_ms()))
                    .await)
                    .is_ok()
            {
                return Err(StoreError::new(
                    StoreErrorKind::InvalidInput,
                    format!(
                        "Redis at {} {TIME_REFUSED}, which decisions \
                         by Redis's clock (no now_ms: serve's, RedisTime::Server) read: grant \
                         it +time (ACL SETUSER); a caller that passes now_ms to every decision \
                         can instead connect with RedisOptions::checks_by_redis_time false \
                         (the check on the key {name}: {})",
                        self.url(),
                        e.detail()
                    ),
                ));
            }
        }
        // A master that died before the cluster noticed: redis-rs sends
        // its calls elsewhere and gives up on the MOVED back, or on the
        // connection it cannot make. Said as what it is.
        let master_down = match (&checked, &self.inner.backend) {
            (Err(e), Backend::Cluster(_, down))
                if e.kind() == StoreErrorKind::ConnectionDropped =>
            {
                down.down_master_of(name.as_bytes()).await
            }
            _ => None,
        };
        checked.map_err(|e| {
            let url = self.url();
            let detail = e.detail();
            if let Some(master) = &master_down {
                return StoreError::new(
                    e.kind(),
                    format!(
                        "Redis at {url} cannot decide: the check on the key {name} failed, \
                         since {master}; its keys cannot be decided until it is back or a \
                         replica takes over its slots ({detail})"
                    ),
                );
            }
            // A cluster node behind a one-node URL, whose user may not run
            // INFO (which check_node reads to tell): its MOVED says it.
            let cluster_node = || {
                self.cluster_node_advice(detail)
                    .map(|advice| (StoreErrorKind::InvalidInput, advice))
            };
            // A refused key: its prefix is stored escaped (`:` as %3A),
            // which a pattern written from the prefix as given misses.
            let refusal = refusal_advice(detail).map(|(kind, advice)| {
                if refused_key(detail) {
                    let prefix = &self.inner.options.prefix;
                    let escaped = escape_key_part(prefix);
                    let glob = key_glob(prefix);
                    (
                        kind,
                        format!(
                            "{advice}; a key pattern must match the prefix as stored, escaped \
                             (each : written %3A): this store's prefix {prefix:?} is stored as \
                             {escaped}:, matched by ~{glob} (any * ? [ ] \\ of the prefix \
                             escaped with a \\; quote the pattern in a shell)"
                        ),
                    )
                } else {
                    (kind, advice)
                }
            });
            match refusal.or_else(cluster_node) {
                Some((kind, advice)) => StoreError::new(
                    kind,
                    format!(
                        "Redis at {url} cannot decide: {advice} (the check on the key \
                         {name}: {detail})"
                    ),
                ),
                None => {
                    // A hung master times the check out with no word of
                    // which node it is.
                    let hint = if e.kind() == StoreErrorKind::Timeout
                        && matches!(self.inner.backend, Backend::Cluster(..))
                    {
                        "; a master that does not answer (a hung node) does this: \
                         redis-cli --cluster check HOST:PORT shows which"
                    } else {
                        ""
                    };
                    StoreError::new(
                        e.kind(),
                        format!(
                            "Redis at {url} cannot decide: the check on the key {name} \
                             failed: {detail}{hint}"
                        ),
                    )
                }
            }
        })
    }

    /// One decision of cost 1 on the check's key `name`, at `now_ms` (`None`:
    /// Redis `TIME`), then `DEL` of the key.
    async fn decide_and_delete(
        &self,
        conn: &mut Conn,
        name: &str,
        now_ms: Option<u64>,
    ) -> Result<(), StoreError> {
        self.eval(conn, |by_source| {
            self.script_call(by_source, name, now_ms, 1, (0, PROBE_TTL_MS))
        })
        .await?;
        redis::cmd("DEL")
            .arg(name)
            .query_async::<()>(conn)
            .await
            .map_err(map_error)
    }

    /// The script's call on the Redis key `name`, by `EVALSHA`; when the
    /// node answers `NOSCRIPT` (its cache flushed; restarted; a replica
    /// promoted; on a cluster, a node just added, which takes its first
    /// keys by `ASK`), by `EVAL` with the script's text, which runs it and
    /// keeps it in that node's cache. A `NOSCRIPT` ran nothing, so the
    /// call runs once.
    ///
    /// Every call in flight on that node meets `NOSCRIPT` together (a
    /// batch's thousands on a cluster, where each request is a call), and
    /// the text is some 12 KB: one of them sends it, and the others wait
    /// for it, then try `EVALSHA` again. On a cluster whose several nodes
    /// lost the script, that takes a round per node, up to
    /// [`MAX_SCRIPT_ROUNDS`]; after that, or when the cache is flushed
    /// again between the text and the retry, a call sends the text itself.
    ///
    /// `call` makes the call, by `EVALSHA`, or with `true` by `EVAL`.
    async fn eval(&self, conn: &mut Conn, call: impl Fn(bool) -> Cmd) -> Result<Value, StoreError> {
        let inner = &self.inner;
        for _ in 0..MAX_SCRIPT_ROUNDS {
            let sent = inner.scripts_sent.load(Ordering::Acquire);
            match self.try_call(conn, &call(false)).await {
                Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {}
                other => return other.map_err(map_error),
            }
            let _turn = inner.script_turn.lock().await;
            if inner.scripts_sent.load(Ordering::Acquire) == sent {
                // No call sent the text since this one's EVALSHA set out:
                // this one does. (Cancelled by its timeout, it counts
                // nothing, and the next call in line sends it.)
                let called = self.call_with_text(conn, &call).await;
                inner.scripts_sent.fetch_add(1, Ordering::Release);
                return called.map_err(map_error);
            }
        }
        self.call_with_text(conn, &call).await.map_err(map_error)
    }

    /// The call with the script's text (`EVAL`, `call(true)`); where Redis
    /// refuses `EVAL` (renamed away, or not granted to the URL's user),
    /// the script loaded with `SCRIPT LOAD` and the call made again by
    /// `EVALSHA`, one round trip more. The refused `EVAL` ran nothing.
    async fn call_with_text(
        &self,
        conn: &mut Conn,
        call: &impl Fn(bool) -> Cmd,
    ) -> RedisResult<Value> {
        match self.try_call(conn, &call(true)).await {
            Err(e) if eval_refused(&e) => {
                self.load_script_once(conn).await?;
                self.try_call(conn, &call(false)).await
            }
            called => called,
        }
    }

    /// Loads the policy's script into the script cache: of the one node,
    /// or of every master of a cluster (replicas decide nothing, and one
    /// that is loading its data or down must not stop a store; a replica
    /// promoted later gets the script at its first call, by `EVAL`).
    async fn load_script(&self, conn: &mut Conn) -> Result<(), StoreError> {
        let mut loaded = self.load_script_once(conn).await;
        // As a call does (see try_call): the first command after Redis
        // returns can meet the error of the reconnection that failed while
        // it was away, and only then start a new one. A new rule's or
        // override's store would be refused for it, with Redis up.
        if matches!(&loaded, Err(e) if self.retry_on_new_connection(e)) {
            loaded = self.load_script_once(conn).await;
        }
        if let Err(e) = &loaded {
            self.renew_if_reconnection_refused(e);
        }
        loaded.map_err(map_error)
    }

    async fn load_script_once(&self, conn: &mut Conn) -> RedisResult<()> {
        match conn {
            Conn::Node(..) => self
                .inner
                .script
                .prepare_invoke()
                .load_async(conn)
                .await
                .map(drop),
            Conn::Cluster(cluster) => {
                let mut cmd = redis::cmd("SCRIPT");
                cmd.arg("LOAD").arg(self.inner.script_source);
                let calls = every_master(
                    cluster,
                    &cmd,
                    &self.known_slot_map(),
                    ResponsePolicy::AllSucceeded,
                );
                futures_util::future::try_join_all(calls).await.map(drop)
            }
        }
    }

    /// One script call, without the timeout.
    async fn call_one(
        &self,
        key: u64,
        now_ms: Option<u64>,
        cost: u64,
    ) -> Result<Decision, StoreError> {
        let name = self.key_name(key);
        let value = self
            .eval(&mut self.conn(), |by_source| {
                self.eval_named(by_source, &name, now_ms, cost)
            })
            .await
            .map_err(|e| naming_the_key(e, &name))?;
        parse_reply(value)
    }

    /// Decides many `(key, cost)` requests in one round trip: their
    /// `EVALSHA` calls are pipelined. Each request is still decided
    /// atomically on its own, in order per key, with one exception on one
    /// node: when the script cache is flushed and the script loaded again
    /// by another client while the pipeline runs, a request that met
    /// `NOSCRIPT` is sent again after later requests of its key were
    /// decided (each is still decided once, and counted).
    ///
    /// The outer error is for the whole batch: too large, or a request
    /// with a cost or time out of range (then nothing was sent); on one
    /// node, timed out or connection lost (then any subset may have been
    /// applied). The inner results are per request. At most [`MAX_BATCH`]
    /// requests.
    ///
    /// On a cluster the keys are sent at once, each key's requests in
    /// turn, rather than as one pipeline (a pipeline may not cross slots),
    /// and failures are per request: a request not answered by the
    /// batch's deadline gets a [`StoreErrorKind::Timeout`] of its own (a
    /// key's later requests, not sent then, say so), while the keys of the
    /// masters that answered keep their decisions. So one hung master
    /// costs its own keys only, and one found down fails its keys at once
    /// without sending them (see `docs/redis.md`). When the batch gets no
    /// answer at all for a quarter of its timeout (a cluster connection
    /// can stop answering every call after a failover, or after a master
    /// is killed), every master is probed and a new connection is made,
    /// and once it is in place the requests still waiting on the
    /// old one get a [`StoreErrorKind::Timeout`] (they may have been
    /// applied), their keys' later requests are not sent, and the other
    /// keys go on the new connection.
    ///
    /// [`RedisOptions::timeout_ms`] bounds the whole batch, not each
    /// request: a batch of thousands needs more than the default 50 ms
    /// (10,000 requests took about 125 ms on a quiet 2-core machine and
    /// 325 ms on a loaded one), or it fails with a timeout after Redis has
    /// applied it.
    pub async fn decide_many(
        &self,
        requests: &[(u64, u64)],
        now_ms: Option<u64>,
    ) -> Result<Vec<Result<Decision, StoreError>>, StoreError> {
        crate::io::on_io(self.decide_many_on_io(requests, now_ms)).await
    }

    async fn decide_many_on_io(
        &self,
        requests: &[(u64, u64)],
        now_ms: Option<u64>,
    ) -> Result<Vec<Result<Decision, StoreError>>, StoreError> {
        if requests.len() > MAX_BATCH {
            return Err(StoreError::new(
                StoreErrorKind::InvalidInput,
                format!(
                    "a batch of {} requests is above the maximum of {MAX_BATCH}; split it",
                    requests.len()
                ),
            ));
        }
        Self::check(now_ms, 0)?;
        for (i, &(_, cost)) in requests.iter().enumerate() {
            // The whole batch is refused: the message names which request.
            Self::check(None, cost)
                .map_err(|e| StoreError::new(e.kind(), format!("requests[{i}]: {}", e.detail())))?;
        }
        let timeout = Duration::from_millis(self.inner.options.timeout_ms);
        if let Backend::Cluster(cluster, _) = &self.inner.backend {
            return Ok(self
                .decide_many_on_cluster(cluster, requests, now_ms, timeout)
                .await);
        }
        let call = async {
            let mut conn = self.conn();
            let mut results: Vec<Option<Result<Decision, StoreError>>> = vec![None; requests.len()];
            let mut todo: Vec<usize> = (0..requests.len()).collect();
            // Once, and again for the requests that met NOSCRIPT after the
            // script is loaded again, up to MAX_SCRIPT_LOADS times (a cache
            // flushed again between the load and the batch).
            for attempt in 0..=MAX_SCRIPT_LOADS {
                if todo.is_empty() {
                    break;
                }
                let mut pipe = redis::pipe();
                for &i in &todo {
                    let (key, cost) = requests[i];
                    pipe.add_command(self.eval_cmd(key, now_ms, cost));
                }
                let mut sent = conn.req_packed_commands(&pipe, 0, todo.len()).await;
                if matches!(&sent, Err(e) if self.retry_on_new_connection(e)) {
                    // As for one call: the connection was gone, and the
                    // batch goes once more on the new one.
                    sent = conn.req_packed_commands(&pipe, 0, todo.len()).await;
                }
                if let Err(e) = &sent {
                    self.renew_if_reconnection_refused(e);
                }
                let values = sent.map_err(|e| self.call_error(map_error(e)))?;
                if values.len() != todo.len() {
                    return Err(StoreError::new(
                        StoreErrorKind::Backend,
                        format!(
                            "Redis answered {} replies to {} commands",
                            values.len(),
                            todo.len()
                        ),
                    ));
                }
                let mut again = Vec::new();
                for (&i, value) in todo.iter().zip(values) {
                    match value.extract_error() {
                        Err(e)
                            if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript)
                                && attempt < MAX_SCRIPT_LOADS =>
                        {
                            again.push(i)
                        }
                        Err(e) => {
                            let e = self.call_error(map_error(e));
                            let name = self.key_name(requests[i].0);
                            results[i] = Some(Err(naming_the_key(e, &name)));
                        }
                        Ok(v) => results[i] = Some(parse_reply(v)),
                    }
                }
                if !again.is_empty() {
                    self.load_script(&mut conn)
                        .await
                        .map_err(|e| self.call_error(e))?;
                }
                todo = again;
            }
            Ok(every_result(results))
        };
        tokio::time::timeout(timeout, call)
            .await
            .map_err(|_| self.timed_out())?
    }

    /// [`RedisStore::decide_many`] on a cluster, whose connection is
    /// `cluster`: each key's requests in turn, the keys at once (at most
    /// [`CLUSTER_BATCH_KEYS_IN_FLIGHT`] calls holding a place).
    ///
    /// A cluster connection can stop answering every call at once (after a
    /// failover or a master's kill, see docs/redis.md), and then no
    /// timeout frees it: when the batch gets no answer for a quarter of its
    /// timeout, every master is probed (so that a master found down is
    /// sent none of the calls that follow) and a new connection is made,
    /// and once it is in place the calls still waiting
    /// on the old one are given up (a timeout's error: they may have been
    /// applied), their keys' later requests are not sent (so that a key's
    /// requests stay in order), and the other keys go on the new one.
    async fn decide_many_on_cluster(
        &self,
        cluster: &Arc<Renewing<ClusterConnection>>,
        requests: &[(u64, u64)],
        now_ms: Option<u64>,
        timeout: Duration,
    ) -> Vec<Result<Decision, StoreError>> {
        // A cluster pipeline may not cross slots: the keys go out at once
        // instead (the cluster connection pipelines them on each node's
        // connection), and each key's requests one after the other, so
        // that they are decided in order.
        let mut by_key: std::collections::HashMap<u64, Vec<usize>> = Default::default();
        for (i, &(key, _)) in requests.iter().enumerate() {
            by_key.entry(key).or_default().push(i);
        }
        // One deadline for the batch, kept per request: a master that does
        // not answer costs its own keys, not the others' answers.
        let started = tokio::time::Instant::now();
        let deadline = started + timeout;
        let stall = Self::stall_of(timeout);
        // A call is sent once it has a place among the
        // CLUSTER_BATCH_KEYS_IN_FLIGHT (first come, first served), and
        // gives it up when it is slow while others are answered.
        let places = tokio::sync::Semaphore::new(CLUSTER_BATCH_KEYS_IN_FLIGHT);
        let answered = AtomicU64::new(0);
        // When the batch last got an answer (or gave calls up), in
        // milliseconds from its start.
        let last_answer_ms = AtomicU64::new(0);
        let elapsed_ms = || u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
        // Calls begun on a connection of an older generation give up.
        let (give_up, given_up) = tokio::sync::watch::channel(cluster.generation());
        let (places, answered, last_answer_ms) = (&places, &answered, &last_answer_ms);
        let groups = by_key.into_values().map(|indices| {
            let mut given_up = given_up.clone();
            async move {
                let mut out = Vec::with_capacity(indices.len());
                let mut key_given_up = false;
                for i in indices {
                    let (key, cost) = requests[i];
                    // The semaphore is never closed: always a place.
                    let place = if key_given_up {
                        None
                    } else {
                        places.acquire().await.ok()
                    };
                    let result = if key_given_up {
                        Err(self.not_sent_after_give_up())
                    } else if tokio::time::Instant::now() >= deadline {
                        // Checked before sending (a timeout polls its call
                        // once even when it is late): this one never went.
                        Err(self.not_sent())
                    } else if let Some(e) = self.not_sent_to_down_master(key) {
                        Err(e)
                    } else {
                        let generation = cluster.generation();
                        let call = tokio::time::timeout_at(
                            deadline,
                            keeping_place_while_quiet(
                                self.call_one(key, now_ms, cost),
                                place,
                                answered,
                            ),
                        );
                        let given_up = &mut given_up;
                        let replaced = async move {
                            if given_up.wait_for(|&g| generation < g).await.is_err() {
                                // The sender outlives every call; were it
                                // gone, the call would wait on.
                                std::future::pending::<()>().await;
                            }
                        };
                        match futures_util::future::select(
                            std::pin::pin!(call),
                            std::pin::pin!(replaced),
                        )
                        .await
                        {
                            Either::Left((Ok(result), _)) => {
                                answered.fetch_add(1, Ordering::Relaxed);
                                self.note_answer(&result);
                                last_answer_ms.store(elapsed_ms(), Ordering::Relaxed);
                                let result = result.map_err(|e| self.call_error(e));
                                if let Err(e) = &result {
                                    self.look_for_down_masters(e);
                                }
                                result
                            }
                            Either::Left((Err(_), _)) => {
                                let e = self.timed_out();
                                self.look_for_down_masters(&e);
                                Err(e)
                            }
                            Either::Right(_) => {
                                key_given_up = true;
                                Err(self.given_up(stall))
                            }
                        }
                    };
                    out.push((i, result));
                }
                out
            }
        });
        let all = groups
            .collect::<futures_util::stream::FuturesUnordered<_>>()
            .collect::<Vec<Vec<_>>>();
        let watchdog = async {
            let stall_ms = u64::try_from(stall.as_millis()).unwrap_or(u64::MAX);
            loop {
                tokio::time::sleep(stall / 4).await;
                let now_ms = elapsed_ms();
                if now_ms.saturating_sub(last_answer_ms.load(Ordering::Relaxed)) < stall_ms {
                    continue;
                }
                let current = cluster.generation();
                if *give_up.borrow() < current {
                    // A new connection is in place: the calls still
                    // waiting on an older one give up, and the calls sent
                    // next get a whole stall's time on the new one.
                    give_up.send_replace(current);
                    last_answer_ms.store(now_ms, Ordering::Relaxed);
                } else {
                    self.cluster_stalled(cluster, current);
                }
            }
        };
        let all = match futures_util::future::select(std::pin::pin!(all), std::pin::pin!(watchdog))
            .await
        {
            Either::Left((all, _)) => all,
            Either::Right(((), _)) => unreachable!("the watchdog loops until the batch ends"),
        };
        let mut results: Vec<Option<Result<Decision, StoreError>>> = vec![None; requests.len()];
        for (i, r) in all.into_iter().flatten() {
            results[i] = Some(r);
        }
        every_result(results)
    }
}

/// How a single call watched by [`RedisStore::watched`] ended.
enum Watched<T> {
    Answered(T),
    TimedOut,
    /// Given up for a new connection after no answer for this long.
    GivenUp(Duration),
}

impl<T> Watched<T> {
    /// `call`'s answer, or a timeout at `deadline`.
    async fn by(
        deadline: tokio::time::Instant,
        call: impl std::future::Future<Output = T>,
    ) -> Self {
        match tokio::time::timeout_at(deadline, call).await {
            Ok(out) => Watched::Answered(out),
            Err(_) => Watched::TimedOut,
        }
    }
}

/// A batch's results, each request's (one left without a result, which
/// no path leaves, says so rather than panics).
fn every_result(
    results: Vec<Option<Result<Decision, StoreError>>>,
) -> Vec<Result<Decision, StoreError>> {
    results
        .into_iter()
        .map(|r| {
            r.unwrap_or_else(|| {
                Err(StoreError::new(
                    StoreErrorKind::Backend,
                    "request left undecided",
                ))
            })
        })
        .collect()
}

/// Awaits a cluster batch's `call`, holding its `place` (see
/// [`CLUSTER_BATCH_SLOW_CALL`]) until it is answered, or until it has gone
/// unanswered for that long while other calls of the batch were answered
/// (`answered` counts them): then the call is slow on its own, and its
/// place goes to the next key while it waits on. While nothing is
/// answered at all the places are kept, so that a connection that answers
/// nothing more is not sent the whole batch.
async fn keeping_place_while_quiet<F: std::future::Future>(
    call: F,
    place: Option<tokio::sync::SemaphorePermit<'_>>,
    answered: &AtomicU64,
) -> F::Output {
    let mut call = std::pin::pin!(call);
    let mut seen = answered.load(Ordering::Relaxed);
    loop {
        if let Ok(out) = tokio::time::timeout(CLUSTER_BATCH_SLOW_CALL, &mut call).await {
            return out;
        }
        let now = answered.load(Ordering::Relaxed);
        if now != seen {
            drop(place);
            return call.await;
        }
        seen = now;
    }
}

/// A corrupt state's error naming the Redis key `name`: the scripts name
/// the key of a value they refuse, but Redis's own `WRONGTYPE` does not,
/// and deleting the key needs its name.
fn naming_the_key(e: StoreError, name: &str) -> StoreError {
    if e.kind() == StoreErrorKind::CorruptState && !e.detail().contains(name) {
        StoreError::new(e.kind(), format!("under key {name}: {}", e.detail()))
    } else {
        e
    }
}

/// A slot range of `CLUSTER SLOTS`, with its master's address when the
/// reply names one (for messages, and to probe it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SlotRange {
    pub(crate) first: u16,
    pub(crate) last: u16,
    /// The master's host and port.
    pub(crate) master: Option<(String, u16)>,
    /// The master's node id.
    pub(crate) id: String,
}

impl std::fmt::Display for SlotRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.first, self.last)?;
        match &self.master {
            Some((host, port)) => write!(f, " ({})", host_port(host, port)),
            None => Ok(()),
        }
    }
}

/// The slot ranges of a `CLUSTER SLOTS` reply: each an array of the first
/// and last slot, then the master's `[host, port, ...]`, then replicas'.
/// At most [`MAX_SLOT_RANGES`]: a cluster has at most 16,384 slots, and
/// far fewer ranges in practice.
pub(crate) fn slot_ranges(reply: &Value) -> Result<Vec<SlotRange>, StoreError> {
    let malformed = || {
        StoreError::new(
            StoreErrorKind::Backend,
            "CLUSTER SLOTS answered something that is not a list of slot ranges",
        )
    };
    let Value::Array(entries) = reply else {
        return Err(malformed());
    };
    let slot = |v: Option<&Value>| match v {
        Some(Value::Int(n)) => u16::try_from(*n).ok().filter(|&n| n < SLOTS),
        _ => None,
    };
    let mut ranges = Vec::with_capacity(entries.len().min(MAX_SLOT_RANGES));
    for entry in entries.iter().take(MAX_SLOT_RANGES) {
        let Value::Array(fields) = entry else {
            return Err(malformed());
        };
        let (Some(first), Some(last)) = (slot(fields.first()), slot(fields.get(1))) else {
            return Err(malformed());
        };
        let Some(Value::Array(node)) = fields.get(2) else {
            return Err(malformed());
        };
        // The id, since Redis 3.2 (a cluster before it has no EVALSHA
        // fit for these scripts either).
        let Some(Value::BulkString(id)) = node.get(2) else {
            return Err(malformed());
        };
        let master = match (node.first(), node.get(1)) {
            (Some(Value::BulkString(host)), Some(Value::Int(port))) if !host.is_empty() => {
                u16::try_from(*port)
                    .ok()
                    .map(|port| (String::from_utf8_lossy(host).into_owned(), port))
            }
            _ => None,
        };
        ranges.push(SlotRange {
            first,
            last,
            master,
            id: String::from_utf8_lossy(id).into_owned(),
        });
    }
    if ranges.is_empty() {
        return Err(StoreError::new(
            StoreErrorKind::ConnectionDropped,
            "CLUSTER SLOTS lists no slot: the cluster serves none (is it set up?)",
        ));
    }
    Ok(ranges)
}

/// Why the master of a slot range cannot decide (see [`check_master`]).
enum MasterCheck {
    /// The call failed.
    Redis(RedisError),
    /// Another node, of this id, answered in its place, and a decision on
    /// the master's slots failed.
    Another(String),
    /// Another node answered in its place, but a decision on its slots
    /// reached it: only the client's slot map is behind the cluster's.
    MapBehind,
    /// Another node answered in its place, and the master refuses
    /// connections.
    Down,
    /// It answered, without `cluster_state:ok`.
    NotOk,
    /// It refused, or failed, the decision on the check's key.
    Refused(StoreError),
}

/// Whether the master of `range` can decide: `CLUSTER MYID` and `CLUSTER
/// INFO` in one pipeline, routed by slot as a decision for that range is
/// (connecting to the master when the client has no connection to it).
///
/// Its id must be the one `CLUSTER SLOTS` gave, because the client answers
/// from any node when it cannot reach a slot's master; and it must report
/// `cluster_state:ok`, because a master just restarted answers at once but
/// refuses its keys (`CLUSTERDOWN`) until the cluster takes it back.
async fn check_master(conn: &mut ClusterConnection, range: &SlotRange) -> Result<(), MasterCheck> {
    let mut pipe = redis::pipe();
    pipe.cmd("CLUSTER").arg("MYID").cmd("CLUSTER").arg("INFO");
    let route = SingleNodeRoutingInfo::SpecificNode(Route::new(range.first, SlotAddr::Master));
    let values = conn
        .route_pipeline(pipe, 0, 2, route)
        .await
        .map_err(MasterCheck::Redis)?;
    let text = |v: Option<&Value>| {
        v.and_then(|v| redis::from_redis_value_ref::<String>(v).ok())
            .unwrap_or_default()
    };
    let id = text(values.first());
    let id = id.trim();
    if id != range.id {
        return Err(MasterCheck::Another(id.to_owned()));
    }
    if cluster_state(&text(values.get(1))) != Some("ok") {
        return Err(MasterCheck::NotOk);
    }
    Ok(())
}

/// `cmd` sent to every master, each as a call of its own: to the master of
/// the first slot of each master's range in `known` (the slot map last
/// read), or, when no map was read, one call by redis-rs's own fan-out,
/// which answers by `policy`.
///
/// redis-rs's fan-out (`MultipleNodeRoutingInfo::AllMasters`, in 1.8 and
/// 2.0.0-rc.2) queues the calls to the nodes from within its connection's
/// task without waking it; the task wakes itself only when the fan-out was
/// the only call under way. Otherwise the calls wait, unsent, for the next
/// wake: the answer of another call under way (one to a frozen master made
/// a fan-out wait until the master thawed, see the test
/// `a_read_of_every_master_does_not_wait_for_another_call`), or, when the
/// others end in the same turn of the task, the next call of any kind. A
/// store's connect, whose `SCRIPT LOAD` follows a `CLUSTER SLOTS` fan-out
/// whose other answers were still coming, waited its whole 10 s about once
/// in 4,000 on a loopback cluster. A call routed to one node is queued
/// through the task's channel, which wakes it (and sends any calls queued
/// before it). The fan-out is kept for the first read of a map, when no
/// other call is under way on the connection.
pub(crate) fn every_master(
    conn: &ClusterConnection,
    cmd: &redis::Cmd,
    known: &[SlotRange],
    policy: ResponsePolicy,
) -> Vec<BoxFuture<'static, RedisResult<Value>>> {
    if known.is_empty() {
        let mut conn = conn.clone();
        let cmd = cmd.clone();
        let every_master =
            RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, Some(policy)));
        return vec![Box::pin(async move {
            conn.route_command(cmd, every_master).await
        })];
    }
    one_range_per_master(known)
        .map(|range| {
            let mut conn = conn.clone();
            let cmd = cmd.clone();
            let route = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(Route::new(
                range.first,
                SlotAddr::Master,
            )));
            Box::pin(async move { conn.route_command(cmd, route).await })
                as BoxFuture<'static, RedisResult<Value>>
        })
        .collect()
}

/// The first range of each master of a slot map, the others left out: a
/// call to that range's master stands for a call to the master.
fn one_range_per_master(map: &[SlotRange]) -> impl Iterator<Item = &SlotRange> {
    let mut seen = std::collections::HashSet::new();
    map.iter()
        .filter(move |range| seen.insert(range.id.as_str()))
}

/// `CLUSTER SLOTS`, asked of every master (see [`every_master`]; `known`:
/// the slot map last read, if any) and the first answer taken: a frozen
/// master must not stop a probe before it can be named (and replicas,
/// which a probe does not need, are left out).
pub(crate) async fn ask_slot_map(
    conn: &ClusterConnection,
    known: &[SlotRange],
) -> RedisResult<Value> {
    let mut cmd = redis::cmd("CLUSTER");
    cmd.arg("SLOTS");
    let calls = every_master(conn, &cmd, known, ResponsePolicy::OneSucceeded);
    futures_util::future::select_ok(calls)
        .await
        .map(|(answer, _)| answer)
}

/// A new cluster connection from `seeds` (`redis://` or `rediss://` URLs),
/// taken only once no master hangs for it (see [`no_master_hangs`]), which
/// also refuses a connection whose slot map names no slot; `down` is given
/// its slot map and the masters found refusing connections.
async fn new_cluster_connection(
    seeds: Vec<String>,
    node_connect_timeout: Duration,
    node_response_timeout: Duration,
    certificates: Option<TlsCertificates>,
    down: Arc<DownMasters>,
) -> RedisResult<ClusterConnection> {
    let client = cluster_client(
        &seeds,
        node_connect_timeout,
        node_response_timeout,
        certificates.as_ref(),
    )?;
    let mut conn = client.get_async_connection().await?;
    let (map, refusing) = no_master_hangs(&mut conn, node_connect_timeout, &down).await?;
    down.set_map(map);
    down.found_refusing(refusing);
    Ok(conn)
}

/// The URLs of the masters of the slot map that `down` last read, each
/// once, but for those it has found down, written as the URL's `seeds`
/// are (scheme, and the credentials of the first seed, which every seed
/// without its own is connected with).
fn known_master_urls(down: &DownMasters, seeds: &[String]) -> Vec<String> {
    let Some(first) = seeds.first() else {
        return Vec::new();
    };
    let (scheme, rest) = first.split_once("://").unwrap_or(("redis", first));
    let credentials = rest
        .rsplit_once('@')
        .map_or(String::new(), |(userinfo, _)| format!("{userinfo}@"));
    let mut masters: Vec<crate::down::Address> = Vec::new();
    for range in down.map() {
        if let Some(master) = range.master {
            if !masters.contains(&master) && !down.is_down(&master) {
                masters.push(master);
            }
        }
    }
    masters
        .into_iter()
        .map(|(host, port)| format!("{scheme}://{credentials}{}", host_port(&host, port)))
        .collect()
}

/// Whether no master of the slot map that `conn` reads hangs for it: each
/// answers on it as itself (see [`check_master`]; one that answers but is
/// not `ok` counts), or, when it does not, is down: `down` has found its
/// host gone, or it refuses a TCP connection within `probe_timeout`. The map
/// read, and the masters found refusing here, which the caller marks down
/// in `down` before it takes the connection.
///
/// A new connection that has no connection to a master tries to make one
/// for each call of its slots. To a master that is down that fails at
/// once, and the other masters' calls go on; to one that hangs (a frozen
/// process, a host that no longer answers) each try waits, holding up
/// every other call meanwhile. In place of an old connection (whose calls
/// to the hung master wait alone) such a connection decided almost
/// nothing, where the old one decided the other masters' keys; so it is
/// not taken while the master hangs, and is once its replica has taken
/// over. A master that is down is no reason to keep the old connection:
/// after a master was killed, the old one could stop answering every call
/// until its replica took over, and a new one decided the others' keys.
/// Nor is a host that `down` found gone: calls for its slots are not sent,
/// so no call waits on a try to connect to it, and the old connection,
/// whose connection to it was lost, stalled every call (measured: every
/// other master's key timed out, for as long as the host stayed away).
async fn no_master_hangs(
    conn: &mut ClusterConnection,
    probe_timeout: Duration,
    down: &DownMasters,
) -> RedisResult<(Vec<SlotRange>, Vec<crate::down::Address>)> {
    let not_taken =
        |what: String| RedisError::from((ErrorKind::Client, "new connection not taken", what));
    let reply = ask_slot_map(conn, &down.map()).await?;
    let slots = slot_ranges(&reply).map_err(|e| not_taken(e.detail().to_owned()))?;
    let checks = one_range_per_master(&slots).map(|range| {
        let mut conn = conn.clone();
        async move {
            match check_master(&mut conn, range).await {
                Ok(()) | Err(MasterCheck::NotOk) => Ok(None),
                // A host found gone is trusted; a master found refusing
                // connections is asked again (at once): it may be back, and
                // hang now.
                Err(_)
                    if range
                        .master
                        .as_ref()
                        .is_some_and(|m| down.is_unreachable(m)) =>
                {
                    Ok(None)
                }
                Err(_) if refuses_connections(range.master.as_ref(), probe_timeout).await => {
                    Ok(range.master.clone())
                }
                Err(_) => Err(not_taken(format!("the master of {range} does not answer"))),
            }
        }
    });
    let refusing = futures_util::future::try_join_all(checks).await?;
    Ok((slots, refusing.into_iter().flatten().collect()))
}

/// What `ping` says of the masters `not_ok` that answered without
/// `cluster_state:ok`, of the `checked` that answered: "none" only when
/// it is every one (a master restarted can report `ok` a moment before
/// the others have taken it back).
fn not_ok_said(not_ok: &[String], checked: usize) -> Result<(), StoreError> {
    let said = match not_ok {
        [] => return Ok(()),
        [one] => format!(
            "{one}: it does not report cluster_state:ok (the cluster has not taken it back \
             yet, or is down)"
        ),
        all if all.len() == checked => format!(
            "{}: none reports cluster_state:ok (the cluster is down: some slot has no master \
             that answers)",
            all.join("; ")
        ),
        some => format!(
            "{}: they do not report cluster_state:ok (the cluster has not taken a master \
             back yet, or is down)",
            some.join("; ")
        ),
    };
    Err(StoreError::new(StoreErrorKind::ConnectionDropped, said))
}

/// The `cluster_state` a `CLUSTER INFO` reply gives (`ok` or `fail`).
fn cluster_state(info: &str) -> Option<&str> {
    info_field(info, "cluster_state")
}

/// How many hash slots a Redis Cluster has.
const SLOTS: u16 = 16_384;

/// The cluster slot of the Redis key `name`: CRC16-XMODEM of its hash tag
/// (the part between the first `{` and the next `}`, when not empty), or
/// of the whole name, modulo [`SLOTS`], as Redis Cluster places keys.
/// (redis-rs computes it too, but does not give the number out.)
pub(crate) fn key_slot(name: &[u8]) -> u16 {
    let tagged = name
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &name[open + 1..];
            rest.iter()
                .position(|&b| b == b'}')
                .map(|close| &rest[..close])
        })
        .filter(|tag| !tag.is_empty());
    crc16::State::<crc16::XMODEM>::calculate(tagged.unwrap_or(name)) % SLOTS
}

/// The least number whose decimal text hashes to `slot`, as a hash tag
/// (Redis Cluster's CRC16-XMODEM of the tag, modulo [`SLOTS`]). The table
/// of every slot's tag is made once per process, on first use: about
/// 110,000 CRC16s of a few bytes, a few milliseconds, where searching for
/// one slot's tag on each readiness check took up to as many.
fn slot_tag(slot: u16) -> u32 {
    static TAGS: std::sync::OnceLock<Vec<u32>> = std::sync::OnceLock::new();
    let tags = TAGS.get_or_init(|| {
        let mut tags = vec![u32::MAX; usize::from(SLOTS)];
        let mut left = tags.len();
        for n in 0u32.. {
            let slot = key_slot(n.to_string().as_bytes());
            let tag = &mut tags[usize::from(slot)];
            if *tag == u32::MAX {
                *tag = n;
                left -= 1;
                if left == 0 {
                    break;
                }
            }
        }
        tags
    });
    tags[usize::from(slot % SLOTS)]
}

/// The `redis://` (or `rediss://`) URL of each seed of a cluster URL,
/// `seeds` its part after the scheme, as [`cluster_nodes`] makes them;
/// refused when it names none.
fn seed_urls(seeds: &str, shown: &str, tls: bool) -> Result<Vec<String>, StoreError> {
    let nodes = cluster_nodes(seeds, shown, tls)?;
    if nodes.is_empty() {
        return Err(StoreError::new(
            StoreErrorKind::InvalidInput,
            format!(
                "{shown:?} names no node; write {}://HOST:PORT[,HOST:PORT...]",
                schemes(tls).1
            ),
        ));
    }
    Ok(nodes)
}

/// What [`RedisStore::connect`] would refuse in `url`'s form before it
/// dials: a cluster URL's seeds, and the address redis-rs reads from each
/// URL (a `redis://` with no host, say). A query's fields are checked by
/// [`crate::url::query_error`].
pub(crate) fn address_error(url: &str) -> Option<String> {
    let shown = crate::redact_url(url);
    let cluster_seeds = url
        .strip_prefix("redis-cluster://")
        .or_else(|| url.strip_prefix("rediss-cluster://"));
    let nodes = match cluster_seeds {
        Some(seeds) => match seed_urls(seeds, &shown, url.starts_with("rediss")) {
            Ok(nodes) => nodes,
            Err(e) => return Some(e.detail().to_owned()),
        },
        None => vec![url.to_owned()],
    };
    let node_error = nodes.iter().find_map(|node| {
        node.as_str()
            .into_connection_info()
            .err()
            .map(|e| invalid_url(&shown, e).detail().to_owned())
    });
    // The seeds must also agree with each other (one password for all,
    // say), which redis-rs checks when it builds a cluster client: that
    // connects to nothing.
    node_error.or_else(|| {
        cluster_seeds
            .is_some()
            .then(|| cluster_client(&nodes, Duration::from_secs(1), Duration::from_secs(1), None))
            .and_then(|built| built.err())
            .map(|e| invalid_url(&shown, e).detail().to_owned())
    })
}

/// A connection of its own to the one node `client` names, made and
/// answered within `timeout` each: for asking a seed on its own.
async fn node_connection(
    client: &redis::Client,
    timeout: Duration,
) -> RedisResult<redis::aio::MultiplexedConnection> {
    let config = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(timeout))
        .set_response_timeout(Some(timeout));
    client
        .get_multiplexed_async_connection_with_config(&config)
        .await
}

/// Those of the seeds `nodes` (their `redis://` or `rediss://` URLs) whose
/// `CLUSTER SLOTS` names a slot, each asked within `node_timeout`: members
/// of a cluster, not a node removed with del-node (an empty cluster of its
/// own) or not yet joined.
async fn seeds_serving_slots(
    nodes: &[String],
    certificates: Option<&TlsCertificates>,
    node_timeout: Duration,
) -> Vec<String> {
    let asks = nodes.iter().map(|node| async move {
        let client = client_for(node, certificates).ok()?;
        let mut conn = node_connection(&client, node_timeout).await.ok()?;
        let slots: Value = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query_async(&mut conn)
            .await
            .ok()?;
        matches!(slots, Value::Array(ref ranges) if !ranges.is_empty()).then(|| node.clone())
    });
    futures_util::future::join_all(asks)
        .await
        .into_iter()
        .flatten()
        .collect()
}

/// What every key name of a limiter of `config` under `prefix` starts
/// with. The configuration is part of every key name: two limiters with
/// different policies or numbers under one prefix never read each other's
/// state. So is the state format's version: a process of another version
/// never reads state it would take for corrupt.
fn key_prefix(prefix: &str, config: &PolicyConfig) -> String {
    let mut key_prefix = format!(
        "{}:{STATE_FORMAT}:{}:{}:{}",
        escape_key_part(prefix),
        config.policy,
        config.limit,
        config.window_ms
    );
    if config.policy.has_burst() {
        key_prefix.push_str(&format!(":{}", config.effective_burst()));
    }
    key_prefix.push(':');
    key_prefix
}

/// The name of the Redis key that holds `key`'s state for a store of
/// `config` whose [`RedisOptions::prefix`] is `prefix`, as
/// [`RedisStore::key_name`] gives it, without a connection: for finding
/// one client's count (to delete it, say) from outside the process.
///
/// ```
/// use ratewarden_core::{PolicyConfig, PolicyKind};
/// let config = PolicyConfig::new(PolicyKind::SlidingWindowCounter, 100, 1000);
/// assert_eq!(
///     ratewarden_redis::key_name("ratewarden", &config, 42),
///     "ratewarden:v2:sliding-window-counter:100:1000:42"
/// );
/// ```
pub fn key_name(prefix: &str, config: &PolicyConfig, key: u64) -> String {
    format!("{}{key}", key_prefix(prefix, config))
}

/// The most slot ranges [`RedisStore::ping`] reads.
const MAX_SLOT_RANGES: usize = SLOTS as usize;

/// The `redis://` URL of each seed of a `redis-cluster://` URL (its part
/// after the scheme). Credentials written once, on the first seed, hold for
/// every seed: redis-rs wants the same on each.
///
/// Each seed must be `[[USER]:PASSWORD@]HOST:PORT`: a `/DB` is refused
/// (Redis Cluster has only database 0, so a number there would be ignored
/// and a reader misled), and so is a seed without a port (rather than
/// taking 6379 silently). `shown`: the URL without its credentials, for
/// the message.
fn cluster_nodes(seeds: &str, shown: &str, tls: bool) -> Result<Vec<String>, StoreError> {
    let (scheme, cluster_scheme) = schemes(tls);
    if seeds.is_empty() {
        return Ok(Vec::new());
    }
    let seeds: Vec<&str> = seeds.split(',').collect();
    let refuse = |what: String| {
        StoreError::new(
            StoreErrorKind::InvalidInput,
            format!("{shown:?}: {what}, as in {cluster_scheme}://HOST:PORT[,HOST:PORT...]"),
        )
    };
    // An empty seed is most often a host a template left out
    // (`${A},${B}` with B unset): the fleet would run on fewer seeds than
    // its operator wrote without a word.
    if let Some(n) = seeds.iter().position(|s| s.is_empty()) {
        return Err(refuse(format!(
            "seed {} of the URL is empty (two commas together, or one at an end): \
             name a node there or drop the extra ',' (a password holding ',' must be \
             written %2C)",
            n + 1
        )));
    }
    // A seed is echoed only when it cannot hold a password: what follows
    // a `/` or `?` may (`?pass=...`), and so may a seed without `@` in a
    // URL that has one (a password holding a `,` splits into two "seeds").
    let credentials_anywhere = seeds.iter().any(|s| s.contains('@'));
    for (n, seed) in seeds.iter().enumerate() {
        // The node without its credentials: the part after the last `@`.
        let node = seed.rsplit_once('@').map_or(*seed, |(_, node)| node);
        if let Some(i) = node.find(['/', '?']) {
            // In a URL with credentials, what precedes the `/` may be part
            // of a password: the seed is named by its place.
            let after = if credentials_anywhere || !crate::url::is_showable_node(&node[..i]) {
                format!("in seed {} of the URL", n + 1)
            } else {
                format!("after {:?}", &node[..i])
            };
            return Err(refuse(format!(
                "Redis Cluster has only database 0, so a cluster URL takes no /DB (nor \
                 options): drop everything from the {:?} {after} (a password holding it \
                 must be percent-encoded)",
                &node[i..=i],
            )));
        }
        let valid = node.rsplit_once(':').is_some_and(|(host, port)| {
            !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p != 0)
        });
        if !valid {
            let which = if credentials_anywhere || !crate::url::is_showable_node(node) {
                format!("seed {} of the URL", n + 1)
            } else {
                format!("the node {node:?}")
            };
            return Err(refuse(format!(
                "{which} needs a host and a port (1 to 65535): write each node as HOST:PORT \
                 (a password holding ',' must be written %2C)"
            )));
        }
    }
    // redis-rs takes the first seed's credentials for every node: others
    // written on a later seed would be dropped without a word (a user
    // name beside the first seed's password alone, say).
    let userinfo = |seed: &str| {
        seed.rsplit_once('@')
            .map(|(userinfo, _)| userinfo.to_owned())
    };
    let first = seeds.first().and_then(|s| userinfo(s));
    if let Some(n) = seeds
        .iter()
        .skip(1)
        .position(|s| s.contains('@') && userinfo(s) != first)
    {
        return Err(refuse(format!(
            "seed {} of the URL carries a user or password other than the first seed's: \
             write them once, on the first seed, where they hold for every seed",
            n + 2
        )));
    }
    let credentials = first.as_deref().unwrap_or("");
    Ok(seeds
        .iter()
        .map(|s| {
            if s.contains('@') || credentials.is_empty() {
                format!("{scheme}://{s}")
            } else {
                format!("{scheme}://{credentials}@{s}")
            }
        })
        .collect())
}

/// Why a cluster connection could not be made, found by asking each seed
/// on its own (each within `node_timeout`): a seed that wants a password,
/// refuses the URL's credentials or is not a cluster node is named, saying
/// what to change; when no seed could be reached, each seed's failure is
/// listed ([`StoreErrorKind::ConnectionDropped`] when every one refused or
/// dropped the connection: nothing answered); otherwise the cluster
/// connection's own error, as [`StoreErrorKind::Backend`] unless it was a
/// timeout (something answered, so it is not a Redis to start).
///
/// `nodes`: the seeds' `redis://` (or `rediss://`) URLs, with the TLS
/// `certificates` they are connected with; `form`: the cluster URL's;
/// `shown`: the cluster URL without its credentials.
async fn cluster_connect_error(
    e: RedisError,
    nodes: &[String],
    certificates: Option<&TlsCertificates>,
    form: Form,
    shown: &str,
    node_timeout: Duration,
) -> StoreError {
    let probes = nodes.iter().map(|node| async move {
        let client = client_for(node, certificates).map_err(|e| invalid_url(shown, e))?;
        let address = address_of(client.get_connection_info().addr());
        let mut conn = node_connection(&client, node_timeout)
            .await
            .map_err(|e| connect_error(e, &address, form))?;
        check_node(&mut conn, &address, form).await
    });
    let probed = futures_util::future::join_all(probes).await;
    if let Some(Err(refused)) = probed
        .iter()
        .find(|p| matches!(p, Err(e) if e.kind() == StoreErrorKind::InvalidInput))
    {
        return refused.clone();
    }
    if probed.iter().all(Result::is_err) {
        let failures: Vec<&StoreError> = probed.iter().filter_map(|p| p.as_ref().err()).collect();
        let kind = if failures
            .iter()
            .all(|f| f.kind() == StoreErrorKind::ConnectionDropped)
        {
            StoreErrorKind::ConnectionDropped
        } else {
            failures
                .iter()
                .map(|f| f.kind())
                .find(|&k| k != StoreErrorKind::ConnectionDropped)
                .unwrap_or(StoreErrorKind::Backend)
        };
        let each: Vec<&str> = failures.iter().map(|f| f.detail()).collect();
        return StoreError::new(
            kind,
            format!("no seed of {shown} could be used: {}", each.join("; ")),
        );
    }
    let e = map_error(e);
    if refused_permission(e.detail()) {
        return StoreError::new(
            StoreErrorKind::InvalidInput,
            format!(
                "Redis Cluster at {shown} cannot be used: {}; {}",
                e.detail(),
                permission_advice(e.detail())
            ),
        );
    }
    let kind = match e.kind() {
        StoreErrorKind::Timeout => StoreErrorKind::Timeout,
        _ => StoreErrorKind::Backend,
    };
    StoreError::new(
        kind,
        format!("Redis Cluster at {shown} cannot be used: {}", e.detail()),
    )
}

/// The form of URL a node was reached by, for advice that shows it.
#[derive(Debug, Clone, Copy)]
struct Form {
    /// A seed of a `redis-cluster://` (or `rediss-cluster://`) URL.
    cluster: bool,
    /// Over TLS.
    tls: bool,
    /// With a `tls_ca_file` of its own.
    ca_file: bool,
    /// The URL names a user without a password (`USER@` or `USER:@`), for
    /// which the redis crate sends no `AUTH`.
    user_without_password: bool,
}

impl Form {
    /// The scheme of a node's own URL and of a cluster's, in this form.
    fn schemes(self) -> (&'static str, &'static str) {
        schemes(self.tls)
    }

    /// The scheme of this form's URL with TLS the other way round: what to
    /// write when TLS and plain ports were mixed up.
    fn other_scheme(self) -> &'static str {
        let (node, cluster) = schemes(!self.tls);
        if self.cluster {
            cluster
        } else {
            node
        }
    }
}

/// The scheme of a node's own URL and of a cluster's, over TLS or not.
fn schemes(tls: bool) -> (&'static str, &'static str) {
    if tls {
        ("rediss", "rediss-cluster")
    } else {
        ("redis", "redis-cluster")
    }
}

/// Checks that a single node can be used: it answers commands (with the
/// URL's credentials, if any) and is not a cluster node, whose keys a
/// single-node connection would meet as `MOVED` errors. For a seed of a
/// cluster URL the other way round: the node must be a cluster node.
async fn check_node<C: ConnectionLike>(
    conn: &mut C,
    address: &str,
    form: Form,
) -> Result<(), StoreError> {
    redis::cmd("PING")
        .query_async::<Value>(conn)
        .await
        .and_then(Value::extract_error)
        .map_err(|e| connect_error(e, address, form))?;
    // A replica that takes writes (replica-read-only no) would count apart
    // from its master and every other replica, and one that does not
    // refuses every decision: either way the URL should name its master.
    // A seed of a cluster URL may be a replica. Like INFO cluster below,
    // only a clear answer refuses.
    if !form.cluster {
        if let Ok(info) = redis::cmd("INFO")
            .arg("replication")
            .query_async::<String>(conn)
            .await
        {
            if let Some(master) = replica_of(&info) {
                return Err(replica_error(address, &master));
            }
        }
    }
    // INFO may be renamed away on some servers: PING proved the node
    // answers, so only a clear "cluster_enabled" line refuses.
    let Ok(info) = redis::cmd("INFO")
        .arg("cluster")
        .query_async::<String>(conn)
        .await
    else {
        return Ok(());
    };
    let (node_scheme, cluster_scheme) = form.schemes();
    let advice = match (cluster_enabled(&info), form.cluster) {
        (Some(true), false) => format!(
            "Redis at {address} is a cluster node: use \
             {cluster_scheme}://HOST:PORT[,HOST:PORT...] (any nodes as seeds)"
        ),
        (Some(false), true) => format!(
            "Redis at {address} is not a cluster node (cluster_enabled:0): use \
             {node_scheme}://{address}"
        ),
        _ => return Ok(()),
    };
    Err(StoreError::new(StoreErrorKind::InvalidInput, advice))
}

/// The `maxmemory-policy` and `maxmemory` an `INFO memory` reply gives,
/// when Redis evicts keys once full: a limit is set, and the policy is not
/// `noeviction`.
fn evicting_policy(info_memory: &str) -> Option<(String, u64)> {
    let maxmemory: u64 = info_field(info_memory, "maxmemory")?.parse().ok()?;
    let policy = info_field(info_memory, "maxmemory_policy")?;
    (maxmemory > 0 && policy != "noeviction").then(|| (policy.to_owned(), maxmemory))
}

/// `e`, a connection to the node at `address` found closed, or what
/// Redis said as it closed it: a Redis at its `maxclients` answers a new
/// connection with an error and closes it at once, which the client
/// reports as a broken pipe or a reset, and which a new connection, read
/// before anything is sent, shows (within `wait`). Over TLS, Redis says it
/// only after a handshake, so it is not asked.
async fn said_at_accept(e: StoreError, address: &str, tls: bool, wait: Duration) -> StoreError {
    if e.kind() != StoreErrorKind::ConnectionDropped || address.starts_with('/') || tls {
        return e;
    }
    let greeting = async {
        let mut stream = tokio::net::TcpStream::connect(address).await.ok()?;
        let mut said = [0u8; 128];
        let n = tokio::io::AsyncReadExt::read(&mut stream, &mut said)
            .await
            .ok()?;
        Some(String::from_utf8_lossy(&said[..n]).into_owned())
    };
    let Ok(Some(said)) = tokio::time::timeout(wait, greeting).await else {
        return e;
    };
    let said = said.trim_end();
    if !said.starts_with("-ERR max number of clients reached") {
        return e;
    }
    StoreError::new(
        StoreErrorKind::Backend,
        format!(
            "Redis at {address} takes no more connections: it answers new ones {:?} (its \
             maxclients): close some of its clients, or raise maxclients (CONFIG SET \
             maxclients N)",
            &said[1..]
        ),
    )
}

/// Whether a TCP URL (one node's, or a cluster's first seed's) names a
/// user without a password (`USER@HOST` or `USER:@HOST`).
fn user_without_password(url: &str) -> bool {
    let Some((_, rest)) = url.split_once("://") else {
        return false;
    };
    let authority = rest.split(['/', ',', '?', '#']).next().unwrap_or("");
    let Some((userinfo, _)) = authority.rsplit_once('@') else {
        return false;
    };
    match userinfo.split_once(':') {
        None => !userinfo.is_empty(),
        Some((user, password)) => !user.is_empty() && password.is_empty(),
    }
}

/// The error of a node at `address` that is a replica of `master`.
fn replica_error(address: &str, master: &str) -> StoreError {
    StoreError::new(
        StoreErrorKind::InvalidInput,
        format!(
            "Redis at {address} is a replica of {master} (INFO replication): a read-only \
             replica refuses every decision, and a writable one counts apart from its master \
             and the other replicas; point the URL at its master"
        ),
    )
}

/// The master (`HOST:PORT`) of a server that its `INFO replication`
/// reply says is a replica (`role:slave`); `None` when it is not, or the
/// reply does not say.
fn replica_of(info_replication: &str) -> Option<String> {
    if info_field(info_replication, "role")? != "slave" {
        return None;
    }
    let host = info_field(info_replication, "master_host").unwrap_or("?");
    let port = info_field(info_replication, "master_port").unwrap_or("?");
    Some(host_port(host, port))
}

/// The value of the field `name` (`name:value`) of an `INFO` reply.
fn info_field<'a>(info: &'a str, name: &str) -> Option<&'a str> {
    info.lines().find_map(|l| {
        let (field, value) = l.trim().split_once(':')?;
        (field == name).then_some(value)
    })
}

/// Whether a server is a cluster node, as its `INFO cluster` reply says
/// (`cluster_enabled:1` or `:0`); `None` when the reply does not say.
///
/// ```
/// use ratewarden_redis::cluster_enabled;
/// assert_eq!(cluster_enabled("# Cluster\r\ncluster_enabled:1\r\n"), Some(true));
/// assert_eq!(cluster_enabled("# Cluster\r\ncluster_enabled:0\r\n"), Some(false));
/// assert_eq!(cluster_enabled(""), None);
/// ```
pub fn cluster_enabled(info_cluster: &str) -> Option<bool> {
    info_cluster.lines().find_map(|l| match l.trim() {
        "cluster_enabled:1" => Some(true),
        "cluster_enabled:0" => Some(false),
        _ => None,
    })
}

/// A node's address as a user writes it: `HOST:PORT` (an IPv6 host in
/// brackets, `[::1]:6379`), or a Unix socket's path.
fn address_of(addr: &redis::ConnectionAddr) -> String {
    match addr {
        redis::ConnectionAddr::Tcp(host, port)
        | redis::ConnectionAddr::TcpTls { host, port, .. } => host_port(host, port),
        other => other.to_string(),
    }
}

/// `HOST:PORT`, an IPv6 host in brackets (`[::1]:6379`).
fn host_port(host: &str, port: impl std::fmt::Display) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// A failure to connect or to authenticate to the node at `address`,
/// saying what to change when the cause is the credentials or TLS. `form`:
/// the URL's, whose scheme the advice shows; an `address` that is a path
/// is a Unix socket's, whose URL takes the credentials in its query.
fn connect_error(e: RedisError, address: &str, form: Form) -> StoreError {
    let (node_scheme, cluster_scheme) = form.schemes();
    let (with_password, with_user) = if form.cluster {
        (
            format!("{cluster_scheme}://:PASSWORD@HOST:PORT[,HOST:PORT...]"),
            format!("{cluster_scheme}://USER:PASSWORD@HOST:PORT[,HOST:PORT...]"),
        )
    } else if address.starts_with('/') {
        (
            "redis+unix:///PATH?pass=PASSWORD".to_owned(),
            "redis+unix:///PATH?user=USER&pass=PASSWORD".to_owned(),
        )
    } else {
        (
            format!("{node_scheme}://:PASSWORD@HOST:PORT"),
            format!("{node_scheme}://USER:PASSWORD@HOST:PORT"),
        )
    };
    let (db, db0) = if address.starts_with('/') {
        ("?db=", "?db=0")
    } else {
        ("/DB", "/0")
    };
    let text = e.to_string();
    // With a /DB, connecting sends SELECT first, whose refusal wraps the
    // NOAUTH in its own words.
    if e.kind() == ErrorKind::Server(ServerErrorKind::BusyLoading) || e.code() == Some("LOADING") {
        // Met when a service starts beside a Redis restarted with much
        // data: the wait is Redis's, not the URL's fault.
        StoreError::new(
            StoreErrorKind::Backend,
            format!(
                "Redis at {address} is still loading its data set into memory ({e}): start \
                 again once it has (redis-cli INFO persistence then shows loading:0)"
            ),
        )
    } else if (e.code() == Some("NOAUTH") || text.contains("Authentication required"))
        && form.user_without_password
    {
        StoreError::new(
            StoreErrorKind::InvalidInput,
            format!(
                "Redis at {address} requires a password, and the URL names the user but no \
                 password, with which no AUTH is sent: write {with_user} (for a user with \
                 nopass, any password)"
            ),
        )
    } else if e.code() == Some("NOAUTH") || text.contains("Authentication required") {
        StoreError::new(
            StoreErrorKind::InvalidInput,
            format!(
                "Redis at {address} requires a password: put it in the URL as \
                 {with_password} (or {with_user} for an ACL user)"
            ),
        )
    } else if e.kind() == ErrorKind::AuthenticationFailed || e.code() == Some("WRONGPASS") {
        StoreError::new(
            StoreErrorKind::InvalidInput,
            format!(
                "Redis at {address} refused the URL's user or password ({e}): \
                 correct them in {with_password} (or {with_user}); a Redis with no password \
                 set refuses one too: then leave it out"
            ),
        )
    } else if text.contains("SELECT is not allowed in cluster mode") {
        StoreError::new(
            StoreErrorKind::InvalidInput,
            format!(
                "Redis at {address} is a cluster node, which has only database 0 ({e}): use \
                 {}://HOST:PORT[,HOST:PORT...] without a /DB",
                form.schemes().1
            ),
        )
    } else if text.contains("DB index is out of range")
        || (text.contains("refused to switch database") && text.contains("out of range"))
    {
        StoreError::new(
            StoreErrorKind::InvalidInput,
            format!(
                "Redis at {address} has no database of the number the URL's {db} names ({e}): \
                 use one below the server's `databases` setting (16 by default), such as {db0}"
            ),
        )
    } else if let Some((kind, why)) = address
        .starts_with('/')
        .then(|| socket_problem(address, &text))
        .flatten()
    {
        StoreError::new(kind, format!("Redis at {address} cannot be used: {why}"))
    } else if refused_permission(&text) {
        StoreError::new(
            StoreErrorKind::InvalidInput,
            format!(
                "Redis at {address} cannot be used: {}; {}",
                map_error(e).detail(),
                permission_advice(&text)
            ),
        )
    } else if let Some(why) = form
        .tls
        .then(|| crate::tls::handshake_error(&text, address, form.ca_file, form.cluster))
        .flatten()
    {
        StoreError::new(StoreErrorKind::InvalidInput, why)
    } else {
        let refused = e.is_connection_refusal();
        let not_redis = e.kind() == ErrorKind::Parse;
        // getaddrinfo's failure, as the standard library words it.
        let unresolved = text.contains("failed to lookup address information");
        let e = map_error(e);
        // The detail, not the whole error: shown, the error starts with its
        // kind ("store connection dropped: "), which the caller's showing
        // of this error says already.
        let cause = if refused {
            "connection refused"
        } else if not_redis {
            "it answered with something that is not Redis's protocol: another server (HTTP, \
             a proxy) holds the port; check the port"
        } else if e.kind() == StoreErrorKind::Timeout {
            "no answer in time: the port took the connection, but a Redis that is \
             stopped or overloaded, or a server that is not Redis, did not answer"
        } else {
            e.detail()
        };
        // A TLS handshake sent to a plain port gets no answer (Redis
        // waits for the rest of what it takes for a command), and a plain
        // command sent to a TLS port has the connection closed.
        let other = form.other_scheme();
        let hint = match (form.tls, e.kind()) {
            _ if unresolved => {
                format!("; {UNRESOLVED_HOST}: check the host in the URL (and this machine's DNS)")
            }
            (true, StoreErrorKind::Timeout) => {
                format!("; if this port takes plain connections, not TLS, use {other}://")
            }
            (false, StoreErrorKind::ConnectionDropped) if !refused && !address.starts_with('/') => {
                format!("; if this port takes TLS only, use {other}://")
            }
            _ => String::new(),
        };
        StoreError::new(
            e.kind(),
            format!("Redis at {address} cannot be used: {cause}{hint}"),
        )
    }
}

/// The TCP settings of every connection to Redis.
///
/// No Nagle delay: the calls of many tasks share one connection, and a
/// request written while the one before it is unacknowledged would wait
/// for that acknowledgement (as hiredis and `redis-benchmark` do, for the
/// same reason). Keepalive probes after 15 s idle, then every 5 s, three
/// of them on Linux (elsewhere, as many as the system sends): a
/// connection whose far end is gone without a word (a host lost, a flow
/// dropped by a NAT or load balancer) fails while idle, and is replaced
/// before a call waits on it, rather than timing out the first calls
/// after a quiet spell (see [`Renewing`] for a connection that stops
/// answering while in use).
fn tcp_settings() -> TcpSettings {
    let keepalive = TcpKeepalive::new()
        .with_time(Duration::from_secs(15))
        .with_interval(Duration::from_secs(5));
    // Three probes: about 30 s from the last reply to the failure, where
    // Linux's default of nine would take a minute.
    #[cfg(target_os = "linux")]
    let keepalive = keepalive.with_retries(3);
    TcpSettings::default()
        .set_nodelay(true)
        .set_keepalive(keepalive)
}

/// The certificates of `files` read again for a new connection, on a
/// thread that may block: the files, and the system's roots, are read
/// from disk.
async fn read_again(files: Arc<crate::tls::CertificateFiles>) -> Option<TlsCertificates> {
    match tokio::task::spawn_blocking(move || files.read_again()).await {
        Ok(read) => read,
        // The runtime is shutting down: no connection is made any more.
        Err(e) if e.is_cancelled() => std::future::pending().await,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

/// A one-node client for `url`, with `certificates` when it takes TLS
/// files of its own.
fn client_for(url: &str, certificates: Option<&TlsCertificates>) -> RedisResult<redis::Client> {
    let info = url.into_connection_info()?.set_tcp_settings(tcp_settings());
    match certificates {
        Some(certificates) => redis::Client::build_with_tls(info, certificates.clone()),
        None => redis::Client::open(info),
    }
}

/// A cluster client for the seeds `nodes` (their `redis://` or `rediss://`
/// URLs), each node's connection made within `connect_timeout` and each
/// call to a node answered within `response_timeout`, with `certificates`
/// when it takes TLS files of its own.
fn cluster_client(
    nodes: &[String],
    connect_timeout: Duration,
    response_timeout: Duration,
    certificates: Option<&TlsCertificates>,
) -> RedisResult<ClusterClient> {
    let mut builder = ClusterClient::builder(nodes.to_vec())
        .connection_timeout(connect_timeout)
        .response_timeout(response_timeout)
        .retries(2)
        .min_retry_wait(5)
        .max_retry_wait(50)
        .tcp_settings(tcp_settings());
    if let Some(certificates) = certificates {
        builder = builder.certs(certificates.clone());
    }
    builder.build()
}

/// Whether `e` is the error of a connection's set-up refused by Redis:
/// the URL's user or password (`AUTH`), or its database (`SELECT`).
fn reconnection_refused(e: &RedisError) -> bool {
    let text = e.to_string();
    e.kind() == ErrorKind::AuthenticationFailed
        || e.code() == Some("WRONGPASS")
        || text.contains("DB index is out of range")
        || (text.contains("refused to switch database") && text.contains("out of range"))
}

/// `shown`: the URL without its credentials.
fn invalid_url(shown: &str, e: RedisError) -> StoreError {
    // Without the error's detail: redis-rs puts there the part of the URL
    // it could not take (a `protocol=` value, say), which can be the rest
    // of a password holding `&` or `?`.
    let text = e.to_string();
    let text = e
        .detail()
        .and_then(|detail| text.strip_suffix(detail))
        .map_or(text.as_str(), |t| t.trim_end_matches(": "));
    let text = if text.contains("Invalid protocol version") {
        format!("{text}; protocol takes 2, 3, resp2 or resp3")
    } else {
        text.to_owned()
    };
    StoreError::new(
        StoreErrorKind::InvalidInput,
        format!(
            "{} is not a Redis address ({text}); write {} (a user name or password \
             holding any of / ? # @ % , & is written percent-encoded: / as %2F, @ as %40, \
             & as %26)",
            crate::url::quoted_or_hidden(shown, "the address given"),
            crate::url::FORMS
        ),
    )
}

/// Whether an error's `text` is the ACL refusing the URL's user a command
/// or a key (in a script, "can't run this command").
fn refused_permission(text: &str) -> bool {
    text.contains("NOPERM") || text.contains("NoPerm:") || text.contains("can't run this command")
}

/// What kept a connection to the Unix socket at `path` from being made,
/// when the file system or the system's error says more than the text of
/// the client's error, `error_text`, does (redis-rs reports a missing file
/// as a refused connection, and a file that is no socket is refused too),
/// and what to change; `None` when they do not (a socket left by a
/// redis-server that stopped refuses connections: so it reads).
pub fn unix_socket_problem(path: &str, error_text: &str) -> Option<String> {
    socket_problem(path, error_text).map(|(_, why)| why)
}

/// [`unix_socket_problem`], with the kind of error it is.
fn socket_problem(path: &str, text: &str) -> Option<(StoreErrorKind, String)> {
    // redis-rs keeps the system's error behind a type of its own, and
    // shows it as Rust does: "... (os error N)".
    let code = text
        .rsplit_once("(os error ")
        .and_then(|(_, rest)| rest.strip_suffix(')'))
        .and_then(|code| code.parse::<i32>().ok());
    let io = code.map(|code| std::io::Error::from_raw_os_error(code).kind());
    if io == Some(std::io::ErrorKind::PermissionDenied) {
        return Some((
            StoreErrorKind::InvalidInput,
            "this process's user may not open the socket: it needs write permission on it \
             (redis-server's unixsocketperm, such as 770 with the user in the socket's group) \
             and search permission on each folder above it"
                .to_owned(),
        ));
    }
    match std::fs::metadata(path) {
        Err(missing) if missing.kind() == std::io::ErrorKind::NotFound => Some((
            StoreErrorKind::ConnectionDropped,
            "no such file: no redis-server listens there (its unixsocket setting names the \
             socket it makes)"
                .to_owned(),
        )),
        Ok(meta) if !is_socket(&meta) => Some((
            StoreErrorKind::InvalidInput,
            format!(
                "it is not a socket but a {}: name the socket that redis-server's unixsocket \
                 setting names",
                if meta.is_dir() { "folder" } else { "file" }
            ),
        )),
        // A socket that refuses connections was left by a redis-server
        // that stopped: the generic words say so.
        _ => None,
    }
}

#[cfg(unix)]
fn is_socket(meta: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::FileTypeExt;
    meta.file_type().is_socket()
}

#[cfg(not(unix))]
fn is_socket(_: &std::fs::Metadata) -> bool {
    true
}

/// Whether an error's `text` is a cluster node sending the call to
/// another node (`MOVED` or `ASK`, as redis-rs words them or as Redis
/// does), which only a cluster node does.
fn redirected(text: &str) -> bool {
    ["Moved:", "Ask:", "MOVED ", "ASK "]
        .iter()
        .any(|redirect| text.starts_with(redirect))
}

/// What the store needs the URL's user to be granted.
const NEEDED_GRANTS: &str = "the commands +evalsha +eval +script|load +ping +info (and +cluster \
     +asking on a cluster), +time +get +set +del, which the scripts run, and the keys under the \
     store's escaped prefix (docs/redis.md, \"Use\")";

/// The command that an error's `text` says the ACL refuses the URL's
/// user, as Redis names it ("no permissions to run the 'cluster|slots'
/// command"), if it names one (a refused key names none).
fn refused_command(text: &str) -> Option<&str> {
    quoted_command(text, "permissions to run the '")
}

/// The command name quoted in `text` right after `before` (up to the
/// closing `'`), when it reads as one.
fn quoted_command<'a>(text: &'a str, before: &str) -> Option<&'a str> {
    let rest = &text[text.find(before)? + before.len()..];
    let command = &rest[..rest.find('\'')?];
    let plain = |c: char| c.is_ascii_alphanumeric() || c == '|' || c == '-' || c == '_';
    (!command.is_empty() && command.len() <= 64 && command.chars().all(plain)).then_some(command)
}

/// Whether `e` is Redis refusing `EVAL` itself: not granted to the URL's
/// user, or renamed away (`rename-command EVAL ""`).
fn eval_refused(e: &RedisError) -> bool {
    let text = e.to_string();
    refused_command(&text)
        .or_else(|| quoted_command(&text, "unknown command '"))
        .is_some_and(|c| c.eq_ignore_ascii_case("eval"))
}

/// Whether an error's `text` is the ACL refusing the URL's user a key
/// (not a command).
fn refused_key(text: &str) -> bool {
    refused_permission(text) && refused_command(text).is_none()
}

/// Whether `e` is the store refused at connect because the ACL refuses
/// the URL's user its keys, not a command: a caller that chose the
/// store's prefix can name the key pattern its own keys need.
pub fn is_refused_key(e: &StoreError) -> bool {
    // A script refused TIME says only that it "can't run this command",
    // as for a key; the store's error then names TIME.
    e.kind() == StoreErrorKind::InvalidInput
        && refused_key(e.detail())
        && !e.detail().contains(TIME_REFUSED)
}

/// What the store's error says of a user refused `TIME`.
const TIME_REFUSED: &str = "refuses the URL's user the command TIME";

/// What to change when Redis refuses the URL's user a command or a key,
/// from the error's `text`: the refused command, when it names one, and
/// what else the store needs.
fn permission_advice(text: &str) -> String {
    match refused_command(text) {
        Some(command) => format!(
            "the URL's user lacks the command {command}, which the store needs: grant it \
             +{command} (ACL SETUSER USER +{command}, on every node of a cluster), and whatever \
             else it lacks of {NEEDED_GRANTS}"
        ),
        None => format!(
            "the URL's user lacks a command or a key the store needs: grant it (ACL SETUSER) \
             {NEEDED_GRANTS}"
        ),
    }
}

/// `e` with the advice a call's error gives for what it says (a password
/// changed since the store connected, say), for a probe's error; `None`
/// when there is none.
fn advised(e: &StoreError) -> Option<StoreError> {
    let (_, advice) = refusal_advice(e.detail())?;
    Some(StoreError::new(
        e.kind(),
        format!("{}; {advice}", e.detail()),
    ))
}

/// What Redis refusing every decision for what it is (not for a passing
/// fault) means, and what to change, from the error's `text`: the kind of
/// error, [`StoreErrorKind::InvalidInput`] for a URL or user that must
/// change, [`StoreErrorKind::Backend`] for a state of Redis's; `None` for
/// any other error.
fn refusal_advice(text: &str) -> Option<(StoreErrorKind, String)> {
    let advice = if text.contains("ReadOnly") || text.contains("READONLY") {
        (
            StoreErrorKind::InvalidInput,
            "it is a read-only replica, and every decision writes: point the URL at its \
             master"
                .to_owned(),
        )
    } else if refused_permission(text) {
        (StoreErrorKind::InvalidInput, permission_advice(text))
    } else if text.contains("OOM") && text.contains("maxmemory") {
        (
            StoreErrorKind::Backend,
            "it is out of memory (maxmemory) and takes no writes: raise maxmemory, or make \
             room"
                .to_owned(),
        )
    } else if text.contains("AuthenticationFailed")
        || text.contains("WRONGPASS")
        || text.contains("NOAUTH")
    {
        (
            StoreErrorKind::InvalidInput,
            "it refuses the URL's user or password (changed since the store connected?): \
             correct them in the URL"
                .to_owned(),
        )
    } else if text.contains("MISCONF") {
        (
            StoreErrorKind::Backend,
            "it takes no writes since it failed to save to disk (stop-writes-on-bgsave-error): \
             mend its disk or its save settings"
                .to_owned(),
        )
    } else if text.contains("NOREPLICAS") {
        (
            StoreErrorKind::Backend,
            "it takes no writes until enough replicas answer (min-replicas-to-write)".to_owned(),
        )
    } else if let Some(command) = unknown_command(text) {
        (
            StoreErrorKind::InvalidInput,
            format!(
                "it knows no {command} (disabled or renamed on this server with \
                 rename-command), which the store needs: give it back its own name"
            ),
        )
    } else if text.contains("Unknown Redis command called from script") {
        (
            StoreErrorKind::InvalidInput,
            "a command its scripts run (TIME, GET, SET or DEL) is disabled or renamed on this \
             server (rename-command), and the scripts need it: give it back its own name"
                .to_owned(),
        )
    } else {
        return None;
    };
    Some(advice)
}

/// The command an "unknown command 'X'" error names, as "the command x".
fn unknown_command(text: &str) -> Option<String> {
    quoted_command(text, "unknown command '")
        .map(|command| format!("the command {}", command.to_ascii_lowercase()))
}

/// What a cluster client's error means in the cluster's terms, from its
/// `text`, on a cluster reached over TLS when `tls`: `None` when it needs
/// no words beyond its own.
fn cluster_hint(text: &str, tls: bool) -> Option<String> {
    if text.contains("ClusterConnectionNotFound") {
        // All redis-rs says of nodes whose TLS handshakes failed, too.
        let certificates = if tls {
            "; or, over TLS, the nodes' certificates and the store's files no longer fit (a CA \
             rotated on one side only; the files are read again for each new connection)"
        } else {
            ""
        };
        Some(format!(
            "no node of the cluster accepts a connection: its nodes are down, or have moved from \
             every address the client knows (if the cluster now runs elsewhere, start again \
             with seeds there), or the seeds a new connection starts from have left the \
             cluster (keep one seed a member){certificates}"
        ))
    } else if text.contains("Requested connection not found") {
        Some(
            "the client could not use the node the cluster sent it to (while a slot moves, an \
             ACL user needs +asking there)"
                .to_owned(),
        )
    } else if text.contains("Moved:") {
        Some(
            "the node the cluster names for that slot cannot be reached or used (a failover \
             may be under way; or, when the node is new, it may lack the URL's ACL user, \
             which Redis keeps per node)"
                .to_owned(),
        )
    } else {
        None
    }
}

/// Classifies a client error so that a limiter can choose its failure
/// policy without parsing messages.
///
/// On a cluster, the errors that say the key's node cannot be reached (a
/// master that died or hangs, a failover under way) count as a dropped
/// connection, as the same node's failure on a single node would: the
/// cluster is down or not serving the slot (`CLUSTERDOWN`, `TRYAGAIN`,
/// `MASTERDOWN`), the client has no connection for it, or its redirection
/// (`MOVED`) could not be followed within the client's retries.
pub(crate) fn map_error(e: RedisError) -> StoreError {
    let text = e.to_string();
    let kind = if text.contains("RATEWARDEN_CORRUPT")
        || e.code() == Some("WRONGTYPE")
        || text.contains("WRONGTYPE")
    {
        StoreErrorKind::CorruptState
    } else if e.is_timeout() {
        StoreErrorKind::Timeout
    } else if e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_io_error()
        || matches!(
            e.kind(),
            ErrorKind::ClusterConnectionNotFound
                | ErrorKind::Server(
                    ServerErrorKind::ClusterDown
                        | ServerErrorKind::TryAgain
                        | ServerErrorKind::MasterDown
                        | ServerErrorKind::Moved
                )
        )
    {
        StoreErrorKind::ConnectionDropped
    } else {
        StoreErrorKind::Backend
    };
    if kind == StoreErrorKind::CorruptState {
        // What a reader can do about it: the key holds what this version
        // did not write, and only deleting it lets the key count again.
        return StoreError::new(
            kind,
            format!(
                "{text} (the key holds a value this version of ratewarden did not write: \
                 another program, or a bug; delete the key, DEL in redis-cli, to start its \
                 count again from empty)"
            ),
        );
    }
    StoreError::new(kind, text)
}

fn int(v: &Value) -> Option<u64> {
    match v {
        Value::Int(n) => u64::try_from(*n).ok(),
        _ => None,
    }
}

/// Reads a script's reply: `{allowed, remaining, retry_kind, retry...}`.
fn parse_reply(value: Value) -> Result<Decision, StoreError> {
    let bad = |what: &str| {
        StoreError::new(
            StoreErrorKind::Backend,
            format!("unexpected script reply ({what}): {value:?}"),
        )
    };
    let Value::Array(items) = &value else {
        return Err(bad("not an array"));
    };
    let field = |i: usize| items.get(i).and_then(int);
    let (Some(allowed), Some(remaining), Some(kind)) = (field(0), field(1), field(2)) else {
        return Err(bad("missing fields"));
    };
    let retry_after_ms = match kind {
        0 => None,
        1 => Some(u128::from(field(3).ok_or_else(|| bad("no retry"))?)),
        2 => {
            // Base-2^24 limbs, least significant first: five hold any wait
            // (below 2^106 ms), exact as the core's.
            let mut wide: u128 = 0;
            for (shift, item) in items[3..].iter().enumerate() {
                let limb = int(item)
                    .filter(|&l| l < 1 << 24)
                    .ok_or_else(|| bad("bad limb"))?;
                if shift >= 5 {
                    return Err(bad("too many limbs"));
                }
                wide |= u128::from(limb) << (24 * shift);
            }
            Some(wide)
        }
        _ => return Err(bad("unknown retry kind")),
    };
    match (allowed, retry_after_ms) {
        (1, Some(0)) => Ok(Decision::admitted(remaining)),
        (0, Some(0)) => Err(bad("a refusal with no wait")),
        (0, retry) => Ok(Decision::refused_exact(retry, remaining)),
        _ => Err(bad("not a decision")),
    }
}

/// The store on its own is a [`Limiter`](ratewarden_core::Limiter) that
/// decides by Redis `TIME` and passes every failure on as a
/// [`StoreError`]: for callers that apply a failure policy of their own
/// (the tower layer does). [`RedisLimiter`](crate::RedisLimiter) adds the
/// caller's clock as an option and a failure policy.
impl ratewarden_core::Limiter for RedisStore {
    fn config(&self) -> &PolicyConfig {
        RedisStore::config(self)
    }

    fn check(
        &self,
        key: u64,
        cost: u64,
    ) -> ratewarden_core::BoxFuture<'_, Result<Decision, StoreError>> {
        Box::pin(self.decide(key, None, cost))
    }
}

#[cfg(test)]
mod tests {
    use ratewarden_core::{StoreError, StoreErrorKind};
    use std::time::Duration;

    /// "none reports cluster_state:ok" only when no master that answered
    /// does: after a restart, the restarted master can report `ok` while
    /// two others do not yet.
    #[test]
    fn ping_says_none_only_of_every_master() {
        let masters = |n: usize| -> Vec<String> { (0..n).map(|i| format!("m{i}")).collect() };
        assert!(super::not_ok_said(&[], 3).is_ok());
        let said = |n, checked| super::not_ok_said(&masters(n), checked).unwrap_err();
        assert_eq!(
            said(1, 3).detail(),
            "m0: it does not report cluster_state:ok (the cluster has not taken it back yet, \
             or is down)"
        );
        assert_eq!(
            said(2, 3).detail(),
            "m0; m1: they do not report cluster_state:ok (the cluster has not taken a master \
             back yet, or is down)"
        );
        assert_eq!(
            said(3, 3).detail(),
            "m0; m1; m2: none reports cluster_state:ok (the cluster is down: some slot has no \
             master that answers)"
        );
        assert_eq!(said(3, 3).kind(), StoreErrorKind::ConnectionDropped);
    }

    /// A read of the slot map from every master does not wait for another
    /// call under way on the connection to end. redis-rs's own fan-out
    /// did: its calls to the nodes waited unsent until something woke the
    /// connection's task, here the answer of a call to a frozen master,
    /// 1.5 s later.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_read_of_every_master_does_not_wait_for_another_call() {
        use super::*;
        let cluster = crate::test_support::RedisCluster::start();
        let options = RedisOptions {
            timeout_ms: 5_000,
            ..RedisOptions::default()
        };
        let store = RedisStore::connect(&cluster.url(), ratewarden_core::REFERENCE, options)
            .await
            .expect("connect");
        let Conn::Cluster(conn) = store.conn() else {
            panic!("a cluster connection");
        };
        let known = store.known_slot_map();
        assert_eq!(known.len(), 3, "three masters' ranges");
        // A key of node 0, decided while node 0 is frozen: its call stays
        // under way until node 0 thaws.
        let node_0 = cluster.nodes()[0].port();
        let on_node_0 = known
            .iter()
            .find(|range| range.master.as_ref().is_some_and(|m| m.1 == node_0))
            .expect("node 0 is a master");
        let key = (0u64..)
            .find(|&key| {
                let slot = key_slot(store.key_name(key).as_bytes());
                (on_node_0.first..=on_node_0.last).contains(&slot)
            })
            .expect("a key of node 0");
        cluster.nodes()[0].pause();
        let under_way = tokio::spawn({
            let store = store.clone();
            async move { store.decide(key, None, 1).await }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        let pid = cluster.nodes()[0].pid().expect("node 0 runs");
        let thaw = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(1_500));
            std::process::Command::new("kill")
                .args(["-CONT", &pid.to_string()])
                .status()
        });
        let started = Instant::now();
        let read = ask_slot_map(&conn, &known).await;
        let took = started.elapsed();
        cluster.nodes()[0].resume();
        assert!(read.is_ok(), "{read:?}");
        assert!(
            took < Duration::from_millis(1_000),
            "the read took {took:?}, waiting for the frozen master's call"
        );
        under_way.await.expect("call").expect("decided once thawed");
        let _ = thaw.join();
    }

    /// A connect-time check that times out is tried again while another
    /// try fits before the deadline; other errors end it at once, and so
    /// does the last timeout, which is returned as it is.
    #[tokio::test(start_paused = true)]
    async fn connect_checks_are_tried_again_only_while_time_is_left() {
        let timeout = || StoreError::new(StoreErrorKind::Timeout, "slow");
        let per_try = Duration::from_millis(100);
        let deadline = tokio::time::Instant::now() + Duration::from_millis(1_000);
        // Slow twice, then it answers.
        let mut tries = 0;
        let answered: Result<i32, StoreError> = retry_timeouts!(deadline, per_try, {
            tries += 1;
            tokio::time::sleep(per_try).await;
            if tries < 3 {
                Err(timeout())
            } else {
                Ok(tries)
            }
        });
        assert_eq!(answered.unwrap(), 3);
        // Never answers: tried while one more try fits, then refused with
        // the check's own error, before the deadline.
        let deadline = tokio::time::Instant::now() + Duration::from_millis(1_000);
        let mut tries = 0;
        let refused: Result<(), StoreError> = retry_timeouts!(deadline, per_try, {
            tries += 1;
            tokio::time::sleep(per_try).await;
            Err(timeout())
        });
        assert_eq!(refused.unwrap_err().detail(), "slow");
        assert_eq!(tries, 9);
        assert!(tokio::time::Instant::now() < deadline);
        // Any other error is not retried.
        let mut tries = 0;
        let wrong: Result<(), StoreError> = retry_timeouts!(deadline, per_try, {
            tries += 1;
            Err(StoreError::new(StoreErrorKind::InvalidInput, "not Redis"))
        });
        assert_eq!(
            (wrong.unwrap_err().kind(), tries),
            (StoreErrorKind::InvalidInput, 1)
        );
    }

    #[test]
    fn each_slot_has_a_tag_that_hashes_to_it() {
        // CRC16-XMODEM's check value, which Redis Cluster's key hash is.
        assert_eq!(
            crc16::State::<crc16::XMODEM>::calculate(b"123456789"),
            0x31C3
        );
        for slot in 0..SLOTS {
            let tag = slot_tag(slot).to_string();
            assert_eq!(key_slot(tag.as_bytes()), slot);
        }
    }

    #[test]
    fn keys_are_placed_as_redis_cluster_places_them() {
        // What CLUSTER KEYSLOT answered on Redis 7.0.
        assert_eq!(key_slot(b"somekey"), 11058);
        assert_eq!(key_slot(b"foo"), 12182);
        // A hash tag picks the slot, the first one only; an empty one, or
        // a `{` never closed, does not.
        assert_eq!(key_slot(b"{foo}.bar"), 12182);
        assert_eq!(key_slot(b"x{foo}y{bar}"), 12182);
        assert_eq!(key_slot(b"{}foo"), 9500);
        assert_eq!(key_slot(b"foo{"), 7673);
        // A store's key name, whose parts are escaped of braces.
        assert_eq!(
            key_slot(b"t123-down-master-0:fixed-window:100:1000:0:42"),
            6826
        );
    }

    #[test]
    fn options_read_from_a_file_take_defaults_and_refuse_unknown_fields() {
        let options: super::RedisOptions =
            serde_json::from_str(r#"{"prefix": "app", "timeout_ms": 20}"#).unwrap();
        assert_eq!(
            options,
            super::RedisOptions {
                prefix: "app".to_owned(),
                timeout_ms: 20,
                ..super::RedisOptions::default()
            }
        );
        let e = serde_json::from_str::<super::RedisOptions>(r#"{"timeout": 20}"#).unwrap_err();
        assert!(e.to_string().contains("unknown field `timeout`"), "{e}");
    }

    #[test]
    fn slot_ranges_read_cluster_slots_with_or_without_addresses() {
        let node = |host: &str, port: i64| {
            Value::Array(vec![
                Value::BulkString(host.as_bytes().to_vec()),
                Value::Int(port),
                Value::BulkString(format!("id-{port}").into_bytes()),
            ])
        };
        let reply = Value::Array(vec![
            Value::Array(vec![
                Value::Int(0),
                Value::Int(5460),
                node("127.0.0.1", 7001),
            ]),
            Value::Array(vec![Value::Int(5461), Value::Int(16383), node("::1", 7002)]),
            Value::Array(vec![Value::Int(9), Value::Int(9), node("", 7003)]),
        ]);
        let ranges = slot_ranges(&reply).unwrap();
        assert_eq!(ranges[0].master, Some(("127.0.0.1".to_owned(), 7001)));
        assert_eq!(ranges[2].id, "id-7003");
        let shown: Vec<String> = ranges.iter().map(ToString::to_string).collect();
        assert_eq!(
            shown,
            ["0-5460 (127.0.0.1:7001)", "5461-16383 ([::1]:7002)", "9-9"]
        );

        let bad = |v: Value| slot_ranges(&v).unwrap_err();
        assert_eq!(bad(Value::Int(1)).kind(), StoreErrorKind::Backend);
        let past_last_slot = Value::Array(vec![Value::Array(vec![
            Value::Int(0),
            Value::Int(16_384),
            node("h", 1),
        ])]);
        assert_eq!(bad(past_last_slot).kind(), StoreErrorKind::Backend);
        let without_id = Value::Array(vec![Value::Array(vec![
            Value::Int(0),
            Value::Int(1),
            Value::Array(vec![Value::BulkString(b"h".to_vec()), Value::Int(1)]),
        ])]);
        assert_eq!(bad(without_id).kind(), StoreErrorKind::Backend);
        let none = bad(Value::Array(vec![]));
        assert_eq!(none.kind(), StoreErrorKind::ConnectionDropped);
        assert!(none.detail().contains("serves none"), "{none}");
    }

    use super::*;

    fn reply(items: &[i64]) -> Value {
        Value::Array(items.iter().map(|&n| Value::Int(n)).collect())
    }

    /// Every TTL reaches Redis as a decimal string: Redis 7.2.0 to 7.2.4
    /// write a Lua number such as 100000000 as `1e+08`, which `PX` refuses
    /// (redis/redis#13113). The Redis these tests run on does not, so
    /// `tests/round_ttls.rs` alone could not catch a script that passes a
    /// number again; this reads the scripts.
    #[test]
    fn every_px_is_formatted_as_a_whole_number() {
        for (name, script) in [
            ("fixed_window", FIXED_WINDOW),
            ("sliding_window_counter", SLIDING_WINDOW_COUNTER),
            ("sliding_log", SLIDING_LOG),
            ("token_bucket", TOKEN_BUCKET),
            ("gcra", GCRA),
        ] {
            let uses: Vec<&str> = script.split("'PX',").skip(1).collect();
            assert!(!uses.is_empty(), "{name} sets no PX");
            for after in uses {
                assert!(
                    after.trim_start().starts_with("string.format('%.0f',"),
                    "{name}: a PX not formatted as a whole number: {}",
                    after.lines().next().unwrap_or("")
                );
            }
        }
    }

    #[test]
    fn credentials_on_the_first_seed_hold_for_every_seed() {
        let nodes = |seeds| cluster_nodes(seeds, "shown", false).unwrap();
        assert_eq!(
            nodes(":pw@a:1,b:2,:pw@c:3"),
            ["redis://:pw@a:1", "redis://:pw@b:2", "redis://:pw@c:3"]
        );
        // Others on a later seed would not be used (redis-rs takes the
        // first seed's for every node): refused, naming the seed.
        let e = cluster_nodes(":pw@a:1,b:2,u:q@c:3", "shown", false).unwrap_err();
        assert!(e.detail().contains("seed 3 of the URL carries"), "{e}");
        assert_eq!(nodes("[::1]:7000"), ["redis://[::1]:7000"]);
        // An empty seed is refused, by its place, not dropped.
        for (seeds, n) in [("a:1,,b:2", 2), (",", 1), ("a:1,", 2)] {
            let e = cluster_nodes(seeds, "shown", false).unwrap_err();
            let said = format!("seed {n} of the URL is empty");
            assert!(e.detail().contains(&said), "{seeds}: {e}");
        }
        assert!(nodes("").is_empty());
        // Over TLS, each seed is a TLS node.
        assert_eq!(
            cluster_nodes(":pw@a:1,b:2", "shown", true).unwrap(),
            ["rediss://:pw@a:1", "rediss://:pw@b:2"]
        );
    }

    #[test]
    fn a_cluster_seed_with_a_database_or_without_a_port_is_refused() {
        let refused = |seeds: &str| {
            let shown = crate::redact_url(&format!("redis-cluster://{seeds}"));
            let e = cluster_nodes(seeds, &shown, false).unwrap_err();
            assert_eq!(e.kind(), StoreErrorKind::InvalidInput, "{seeds}: {e}");
            assert!(!e.to_string().contains("s3cret"), "{e}");
            assert!(!e.to_string().contains(":pa"), "{e}");
            assert!(e.to_string().contains("redis-cluster://HOST:PORT"), "{e}");
            e.to_string()
        };
        for seeds in [
            "a:1/2",
            "a:1/0",
            "a:1/",
            ":s3cret@a:1,b:2/3",
            "a:1?protocol=3",
            "a:1?password=s3cret",
            "a:1/0?pass=s3cret",
        ] {
            let text = refused(seeds);
            assert!(text.contains("only database 0"), "{seeds}: {text}");
        }
        for seeds in [
            "a",
            "a:1,b",
            ":s3cret@a",
            "a:",
            ":7000",
            "a:x",
            "a:0",
            "a:65536",
            "[::1]",
            ":pa,s3cret@a:1",
        ] {
            let text = refused(seeds);
            assert!(text.contains("HOST:PORT"), "{seeds}: {text}");
            assert!(text.contains("needs a host and a port"), "{seeds}: {text}");
        }
    }

    /// A server's error reply, as the client reads it.
    fn server_error(reply: &str) -> RedisError {
        redis::parse_redis_value(format!("-{reply}\r\n").as_bytes())
            .unwrap()
            .extract_error()
            .unwrap_err()
    }

    #[test]
    fn a_cluster_node_out_of_reach_is_a_dropped_connection() {
        for reply in [
            "CLUSTERDOWN The cluster is down",
            "CLUSTERDOWN Hash slot not served",
            "TRYAGAIN Multiple keys request during rehashing of slot",
            "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
            "MOVED 3999 127.0.0.1:6381",
        ] {
            let e = map_error(server_error(reply));
            assert_eq!(e.kind(), StoreErrorKind::ConnectionDropped, "{reply}: {e}");
        }
        let lost = RedisError::from((ErrorKind::ClusterConnectionNotFound, "no connection"));
        assert_eq!(map_error(lost).kind(), StoreErrorKind::ConnectionDropped);
        // The server's own errors stay backend errors, corrupt state stays
        // corrupt state, and a timeout stays a timeout.
        let e = map_error(server_error("ERR Error running script"));
        assert_eq!(e.kind(), StoreErrorKind::Backend, "{e}");
        let e = map_error(server_error(
            "WRONGTYPE Operation against a key holding the wrong kind of value",
        ));
        assert_eq!(e.kind(), StoreErrorKind::CorruptState, "{e}");
        let timeout = RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut));
        assert_eq!(map_error(timeout).kind(), StoreErrorKind::Timeout);
    }

    /// A socket this process may not open is told apart by the system's
    /// error; a missing file and one that is no socket by the file
    /// system; a socket that refuses (its Redis stopped) is left to the
    /// generic words.
    #[cfg(unix)]
    #[test]
    fn a_unix_socket_that_cannot_be_used_says_why() {
        let denied = RedisError::from(std::io::Error::from_raw_os_error(13)).to_string();
        let refused = RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionRefused))
            .to_string();
        let folder = std::env::temp_dir().display().to_string();
        let (kind, why) = socket_problem(&folder, &denied).expect("denied");
        assert_eq!(kind, StoreErrorKind::InvalidInput);
        assert!(why.contains("may not open the socket"), "{why}");
        let (kind, why) = socket_problem(&folder, &refused).expect("a folder");
        assert_eq!(kind, StoreErrorKind::InvalidInput);
        assert!(why.contains("not a socket but a folder"), "{why}");
        let missing = format!("{folder}/ratewarden-no-such-{}.sock", std::process::id());
        let (kind, why) = socket_problem(&missing, &refused).expect("missing");
        assert_eq!(kind, StoreErrorKind::ConnectionDropped);
        assert!(why.contains("no such file"), "{why}");
        let listening = format!("{folder}/ratewarden-stale-{}.sock", std::process::id());
        let listener = std::os::unix::net::UnixListener::bind(&listening).expect("bind");
        assert_eq!(socket_problem(&listening, &refused), None);
        drop(listener);
        let _ = std::fs::remove_file(&listening);
    }

    /// The refused command is read from Redis's words (6 and 7) and
    /// redis-rs's; a refused key, or text that is no command, names none.
    #[test]
    fn a_refused_command_is_named_from_the_error() {
        let named = [
            (
                "NoPerm: this user has no permissions to run the 'cluster|slots' command",
                Some("cluster|slots"),
            ),
            (
                "NOPERM User limiter has no permissions to run the 'ping' command",
                Some("ping"),
            ),
            (
                "NOPERM this user has no permissions to run the 'script' command or its \
                 subcommand",
                Some("script"),
            ),
            (
                "NoPerm: this user has no permissions to access one of the keys used as \
                 arguments",
                None,
            ),
            ("NOPERM no permissions to run the '' command", None),
            ("NOPERM no permissions to run the 'a b; rm' command", None),
            ("NOPERM no permissions to run the 'ping", None),
        ];
        for (text, command) in named {
            assert_eq!(refused_command(text), command, "{text}");
        }
        let advice = permission_advice(named[0].0);
        assert!(advice.contains("grant it +cluster|slots (ACL SETUSER USER +cluster|slots"));
        assert!(permission_advice(named[3].0).contains("lacks a command or a key"));
    }

    /// A redirection reads as one whether redis-rs words it (as the store
    /// gets it) or Redis does; other errors that name a slot do not.
    #[test]
    fn redirections_are_told_from_other_cluster_errors() {
        for reply in ["MOVED 3999 127.0.0.1:6381", "ASK 3999 127.0.0.1:6381"] {
            assert!(redirected(reply), "{reply}");
            let worded = map_error(server_error(reply));
            assert!(redirected(worded.detail()), "{reply}: {worded}");
        }
        for reply in [
            "CLUSTERDOWN Hash slot not served",
            "TRYAGAIN Multiple keys request during rehashing of slot",
            "ERR Error running script: MOVED elsewhere",
        ] {
            assert!(!redirected(reply), "{reply}");
            assert!(
                !redirected(map_error(server_error(reply)).detail()),
                "{reply}"
            );
        }
    }

    #[test]
    fn replies_read_as_decisions() {
        let read = |items: &[i64]| parse_reply(reply(items)).unwrap();
        assert_eq!(read(&[1, 4, 1, 0]), Decision::admitted(4));
        assert_eq!(read(&[0, 0, 1, 250]), Decision::refused(Some(250), 0));
        assert_eq!(read(&[0, 3, 0]), Decision::refused(None, 3));
        // A refusal with no wait contradicts itself: no script sends one.
        assert!(parse_reply(reply(&[0, 0, 1, 0])).is_err());
        // Five 24-bit limbs, least significant first: 2^96 + 5 ms.
        let wide = read(&[0, 0, 2, 5, 0, 0, 0, 1]);
        assert_eq!(wide.retry_after_exact_ms(), Some((1 << 96) + 5));
        assert_eq!(wide.retry_after_ms, Some(u64::MAX));
    }

    #[test]
    fn replies_that_are_no_decision_are_backend_errors() {
        for items in [
            &[2, 0, 1, 0][..],            // allowed is neither 0 nor 1
            &[1, 0, 1, 7],                // admitted, yet with a wait
            &[1, 0, 0],                   // admitted, yet never
            &[0, 0, 3, 1],                // no such retry kind
            &[0, 0, 2, 1 << 24],          // a limb out of range
            &[0, 0, 2, 1, 1, 1, 1, 1, 1], // six limbs
            &[0, 0],                      // fields missing
        ] {
            let e = parse_reply(reply(items)).unwrap_err();
            assert_eq!(e.kind(), StoreErrorKind::Backend, "{items:?}");
            assert!(
                e.to_string().contains("unexpected script reply"),
                "{items:?}: {e}"
            );
        }
    }
}
