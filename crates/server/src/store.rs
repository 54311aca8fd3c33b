//! Where counts live: a factory that makes one limiter per rule.
//!
//! The server only ever holds `Arc<dyn Limiter>`, so a store is pluggable by
//! writing a [`StoreFactory`]. The embedded store is [`MemoryFactory`]; a
//! networked store provides its own factory.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use ratewarden_core::{BoxFuture, Limiter, LocalLimiter, MemoryOptions, PolicyConfig};

/// A limiter made for one rule.
#[derive(Clone)]
pub struct BuiltLimiter {
    /// The limiter every request of the rule goes through.
    pub limiter: Arc<dyn Limiter>,
    /// The in-memory limiter behind it, when it is one, so the server's
    /// housekeeping timer can forget its idle keys.
    pub local: Option<LocalLimiter>,
}

impl fmt::Debug for BuiltLimiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BuiltLimiter")
            .field("config", self.limiter.config())
            .finish()
    }
}

/// Makes the limiter for each rule.
pub trait StoreFactory: Send + Sync {
    /// A short description for logs (`memory`, `redis://host:port`).
    fn describe(&self) -> String;

    /// A limiter for `config`. `rule_id` is the rule's identity: a store
    /// that shares one key space between rules can use it as a prefix, but
    /// keys reaching the limiter already include it in their hash.
    fn build<'a>(
        &'a self,
        rule_id: &'a str,
        config: &'a PolicyConfig,
    ) -> BoxFuture<'a, anyhow::Result<BuiltLimiter>>;

    /// Whether the store answers now, for `GET /readyz`: deciding nothing
    /// and bounded in time. A store in this process always does (the
    /// default); a networked store asks its server.
    fn probe(&self) -> BoxFuture<'_, anyhow::Result<()>> {
        Box::pin(std::future::ready(Ok(())))
    }
}

/// The embedded in-memory store: one sharded table per rule, bounded to
/// `max_keys` keys.
#[derive(Debug, Clone, Copy)]
pub struct MemoryFactory {
    /// Options of every rule's store.
    pub options: MemoryOptions,
}

impl StoreFactory for MemoryFactory {
    fn describe(&self) -> String {
        format!("memory (at most {} keys per rule)", self.options.max_keys)
    }

    fn build<'a>(
        &'a self,
        _rule_id: &'a str,
        config: &'a PolicyConfig,
    ) -> BoxFuture<'a, anyhow::Result<BuiltLimiter>> {
        let built = LocalLimiter::new(*config, self.options)
            .map(|local| BuiltLimiter {
                limiter: Arc::new(local.clone()),
                local: Some(local),
            })
            .map_err(anyhow::Error::from);
        Box::pin(std::future::ready(built))
    }
}

/// Redis (one node, or a cluster): one Lua script and one key space per
/// rule, every rule's store on one shared connection. Decisions read Redis
/// `TIME`, so every server process on one Redis shares one clock. Its
/// description and `Debug` show the URL without its credentials. Clones
/// share the rules' connection and the one [`StoreFactory::probe`] uses.
#[derive(Clone)]
pub struct RedisFactory {
    url: String,
    timeout_ms: u64,
    key_prefix: String,
    tls: crate::RedisTlsFiles,
    /// The connection every rule's store shares (multiplexed), made by the
    /// first rule built, and by each later one until it is made: a rule
    /// (or an override) then costs a script load, not a connection,
    /// and thousands of rules need no thousands of connections.
    rules: Arc<tokio::sync::OnceCell<ratewarden_redis::RedisStore>>,
    /// The connection [`StoreFactory::probe`] pings on, its own so that a
    /// probe never waits behind decisions: made at the first probe, and at
    /// each later one until it is made. The fields above are private so
    /// that both connections always belong to `url`.
    probe: Arc<tokio::sync::OnceCell<ratewarden_redis::RedisStore>>,
}

impl RedisFactory {
    /// A factory for the Redis at `url` (`redis://host:port[/db]`,
    /// `redis+unix:///path` or `redis-cluster://host:port,host:port`, or
    /// over TLS `rediss://...` and `rediss-cluster://...`), each call
    /// bounded by `timeout_ms`, every key name starting with `key_prefix`
    /// (`[server] key_prefix`), a TLS connection made with `tls`' files
    /// (`[redis]`). No connection is made until a rule or a probe needs
    /// one.
    pub fn new(
        url: String,
        timeout_ms: u64,
        key_prefix: String,
        tls: crate::RedisTlsFiles,
    ) -> Self {
        RedisFactory {
            url,
            timeout_ms,
            key_prefix,
            tls,
            rules: Arc::default(),
            probe: Arc::default(),
        }
    }

    /// The options every connection of this factory is made with. Its
    /// prefix names only the key the store's own checks use (see
    /// `RedisStore::ping`): under `key_prefix` and its `:`, as every rule's
    /// keys are, so that an ACL key pattern for the rules covers it.
    pub(crate) fn options(&self) -> ratewarden_redis::RedisOptions {
        ratewarden_redis::RedisOptions {
            prefix: format!("{}:probe", self.key_prefix),
            timeout_ms: self.timeout_ms,
            tls_ca_file: self.tls.tls_ca_file.clone(),
            tls_cert_file: self.tls.tls_cert_file.clone(),
            tls_key_file: self.tls.tls_key_file.clone(),
            ..Default::default()
        }
    }

    /// The URL, with its credentials: show [`StoreFactory::describe`]
    /// instead.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// A connect error, with the key pattern every rule's keys need when
    /// the ACL refused the URL's user the check's key: the store names
    /// only its own (the check's) prefix, and the rules' keys are under
    /// `key_prefix` too.
    fn keys_hint(&self, e: ratewarden_core::StoreError) -> anyhow::Error {
        match self.key_pattern(&e) {
            Some(pattern) => StoreFailure::error(&e, format!("{}; {pattern}", e.detail())),
            None => unreachable_hint(e),
        }
    }

    /// When `e` is the ACL refusing the URL's user a key: the pattern that
    /// covers every rule's keys and the check's. The store's own error
    /// names the pattern for its prefix alone (one rule's, or the
    /// check's), which, granted, leaves the others refused.
    fn key_pattern(&self, e: &ratewarden_core::StoreError) -> Option<String> {
        if !ratewarden_redis::is_refused_key(e) {
            return None;
        }
        // The rules' prefixes are `key_prefix` and a `:` (escaped as %3A),
        // then a hash: a glob for `key_prefix:` with its `:*` dropped.
        let glob = ratewarden_redis::key_glob(&format!("{}:", self.key_prefix));
        let glob = glob.strip_suffix(":*").unwrap_or(&glob);
        Some(format!(
            "for serve, grant ~{glob}* instead: every rule's keys, and the check's, are \
             under [server] key_prefix {:?} and a :",
            self.key_prefix
        ))
    }

    /// `e`'s detail, with [`RedisFactory::key_pattern`] when it applies.
    fn detail_with_pattern(&self, e: &ratewarden_core::StoreError) -> String {
        match self.key_pattern(e) {
            Some(pattern) => format!("{}; {pattern}", e.detail()),
            None => e.detail().to_owned(),
        }
    }

    /// The longest one call may take, in ms.
    pub fn timeout_ms(&self) -> u64 {
        self.timeout_ms
    }

    /// What every key name starts with.
    pub fn key_prefix(&self) -> &str {
        &self.key_prefix
    }
}

impl fmt::Debug for RedisFactory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisFactory")
            .field("url", &ratewarden_redis::redact_url(&self.url))
            .field("timeout_ms", &self.timeout_ms)
            .field("key_prefix", &self.key_prefix)
            .field("tls", &self.tls)
            .finish()
    }
}

/// The prefix of a rule's keys on Redis, under `[server] key_prefix`: each
/// rule gets its own key space, its identity (hashed, to keep key names
/// short) being part of every key name.
pub(crate) fn rule_prefix(key_prefix: &str, rule_id: &str) -> String {
    format!("{key_prefix}:{:016x}", ratewarden_core::xxh3_64(rule_id))
}

/// A rule's limiter on Redis. Failures are returned, not answered here: the
/// server applies its failure policy and counts them.
struct RedisRuleLimiter {
    store: ratewarden_redis::RedisStore,
}

impl Limiter for RedisRuleLimiter {
    fn config(&self) -> &PolicyConfig {
        self.store.config()
    }

    fn check(
        &self,
        key: u64,
        cost: u64,
    ) -> BoxFuture<'_, Result<ratewarden_core::Decision, ratewarden_core::StoreError>> {
        Box::pin(self.store.decide(key, None, cost))
    }
}

impl StoreFactory for RedisFactory {
    fn describe(&self) -> String {
        // Logged at start: never the password.
        ratewarden_redis::redact_url(&self.url)
    }

    fn build<'a>(
        &'a self,
        rule_id: &'a str,
        config: &'a PolicyConfig,
    ) -> BoxFuture<'a, anyhow::Result<BuiltLimiter>> {
        Box::pin(async move {
            let shared = self
                .rules
                .get_or_try_init(|| {
                    // It decides nothing but its connect check: it holds
                    // the connection the rules' stores share.
                    ratewarden_redis::RedisStore::connect(
                        &self.url,
                        ratewarden_core::REFERENCE,
                        self.options(),
                    )
                })
                .await
                .map_err(|e| self.keys_hint(e))?;
            let store = shared
                .with_config(*config, rule_prefix(&self.key_prefix, rule_id))
                .await
                .map_err(|e| self.keys_hint(e))?;
            Ok(BuiltLimiter {
                limiter: Arc::new(RedisRuleLimiter { store }),
                local: None,
            })
        })
    }

    fn probe(&self) -> BoxFuture<'_, anyhow::Result<()>> {
        Box::pin(async move {
            let url = ratewarden_redis::redact_url(&self.url);
            let options = self.options();
            // Probes that come while a connection is being made wait for
            // it, in turn: the bound keeps each one's wait to one connect
            // and one call, however many queue.
            let bound =
                Duration::from_millis(options.connect_timeout_ms.saturating_add(self.timeout_ms));
            let probe = async {
                let store = self
                    .probe
                    .get_or_try_init(|| {
                        // Any configuration would do: a probe only pings.
                        ratewarden_redis::RedisStore::connect(
                            &self.url,
                            ratewarden_core::REFERENCE,
                            options.clone(),
                        )
                    })
                    .await
                    .map_err(|e| {
                        anyhow::anyhow!("cannot connect to {url}: {}", self.detail_with_pattern(&e))
                    })?;
                store
                    .ping()
                    .await
                    .map_err(|e| anyhow::anyhow!("{url}: {}", self.detail_with_pattern(&e)))
            };
            tokio::time::timeout(bound, probe)
                .await
                .unwrap_or_else(|_| {
                    Err(anyhow::anyhow!(
                        "{url}: no connection made within {} ms",
                        bound.as_millis()
                    ))
                })
        })
    }
}

/// A connect error, with what to change when Redis could not be reached.
/// The detail alone: the error's kind would repeat what the detail says.
fn unreachable_hint(e: ratewarden_core::StoreError) -> anyhow::Error {
    // A name that does not resolve has its own advice already.
    if e.is_connection_dropped() && !ratewarden_redis::is_unresolved_host(&e) {
        let message = format!(
            "{}; start redis-server there or change --store (or RATEWARDEN_STORE) to \
             where it runs",
            e.detail()
        );
        StoreFailure::error(&e, message)
    } else {
        StoreFailure::error(&e, e.detail().to_owned())
    }
}

/// A store's failure to make a rule's limiter, said in `message` (its
/// detail and what to change), keeping its kind: an override first used
/// while Redis is away fails its calls with that kind, as the rules' do
/// (`connection_dropped` in metrics and answers, not `backend`).
#[derive(Debug)]
pub struct StoreFailure {
    /// What kind of failure it was.
    pub kind: ratewarden_core::StoreErrorKind,
    message: String,
}

impl StoreFailure {
    fn error(e: &ratewarden_core::StoreError, message: String) -> anyhow::Error {
        anyhow::Error::new(StoreFailure {
            kind: e.kind(),
            message,
        })
    }
}

impl std::fmt::Display for StoreFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for StoreFailure {}

/// What `--store` names. `Debug` shows a URL without its credentials.
#[derive(Clone, PartialEq, Eq)]
pub enum StoreUrl {
    /// The embedded in-memory store.
    Memory,
    /// A single Redis server, `redis://host:port/db` or
    /// `redis+unix:///path`.
    Redis(String),
    /// A Redis Cluster, `redis-cluster://host:port,host:port`.
    RedisCluster(String),
}

impl fmt::Debug for StoreUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreUrl::Memory => f.write_str("Memory"),
            StoreUrl::Redis(url) => f
                .debug_tuple("Redis")
                .field(&ratewarden_redis::redact_url(url))
                .finish(),
            StoreUrl::RedisCluster(url) => f
                .debug_tuple("RedisCluster")
                .field(&ratewarden_redis::redact_url(url))
                .finish(),
        }
    }
}

impl std::str::FromStr for StoreUrl {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        // A URL holds no raw whitespace (a space in a password is %20), and
        // a secret mounted from a file often ends with a newline.
        let s = s.trim_matches(|c: char| c.is_ascii_whitespace());
        if s == "memory" {
            Ok(StoreUrl::Memory)
        } else if ratewarden_redis::is_store_url(s) {
            // A query the client would ignore, or an address it cannot
            // read, is refused here, with the other mistakes of form,
            // rather than when the rules connect (where it would be blamed
            // on the first rule, and where `serve --check` never goes).
            match ratewarden_redis::url_error(s) {
                Some(e) => Err(e),
                None if ratewarden_redis::is_cluster_url(s) => {
                    Ok(StoreUrl::RedisCluster(s.to_owned()))
                }
                None => Ok(StoreUrl::Redis(s.to_owned())),
            }
        } else if ratewarden_redis::is_redis_like_url(s) {
            // Says what is wrong with the form.
            Err(ratewarden_redis::url_form_error(s))
        } else {
            Err(unknown_store(
                s,
                "memory or a Redis URL: redis://HOST:PORT[/DB], redis+unix:///PATH or \
                 redis-cluster://HOST:PORT[,HOST:PORT...] (over TLS: rediss://... or \
                 rediss-cluster://...)",
            ))
        }
    }
}

/// The error for a store that is neither `memory` nor a Redis URL, `forms`
/// naming what the caller takes. An empty value (an environment variable
/// set to nothing, a template's empty substitution) is said to be empty,
/// and `memory` in another case or with spaces is named as what it is;
/// anything else is quoted only as far as it cannot be a password.
///
/// ```
/// use ratewarden_server::store::unknown_store;
/// assert!(unknown_store("", "memory").starts_with("the store is empty; use memory"));
/// assert!(unknown_store(" Memory", "memory").contains("write memory in lower case"));
/// assert!(!unknown_store("Secret pass", "memory").contains("Secret"));
/// ```
pub fn unknown_store(s: &str, forms: &str) -> String {
    if s.trim().is_empty() {
        format!("the store is empty; use {forms}")
    } else if s.trim().eq_ignore_ascii_case("memory") {
        format!("unknown store {s:?}; write memory in lower case")
    } else {
        format!(
            "unknown store {}; use {forms}",
            ratewarden_redis::quoted_or_hidden(&ratewarden_redis::redact_url(s), "")
        )
    }
}
