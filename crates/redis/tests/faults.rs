//! Failures: a killed, a frozen and a script-flushed Redis, and corrupted
//! state. Every call returns within its timeout (plus a margin for a
//! loaded machine) with a typed error, the failure policy answers, and
//! calls succeed again once Redis is back.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use ratewarden_core::{
    Decision, FailurePolicy, ManualClock, MemoryOptions, PolicyConfig, PolicyKind, StoreErrorKind,
    REFERENCE,
};
use ratewarden_redis::test_support::RedisServer;
use ratewarden_redis::{RedisLimiter, RedisOptions, RedisStore, RedisTime};

const TIMEOUT_MS: u64 = 200;
/// Scheduling slack on a busy 2-core machine, where other jobs can take
/// the CPU for most of a second; a call that hung, or waited for a connect
/// (10 s here), would blow far past it.
const MARGIN: Duration = Duration::from_millis(2_000);

fn options(tag: &str) -> RedisOptions {
    RedisOptions {
        prefix: common::fresh_prefix(tag),
        timeout_ms: TIMEOUT_MS,
        // Connecting is not what these tests time: a connect slowed by a
        // busy machine must not fail them.
        connect_timeout_ms: 10_000,
        ..RedisOptions::default()
    }
}

/// Options for a test that is not about timeouts: a busy machine can make a
/// healthy call miss 200 ms, and the failure under test is another.
fn patient_options(tag: &str) -> RedisOptions {
    RedisOptions {
        timeout_ms: 5_000,
        ..options(tag)
    }
}

/// A store on `server` with [`options`]`(tag)`.
async fn connected(server: &RedisServer, tag: &str) -> RedisStore {
    RedisStore::connect(&server.url(), REFERENCE, options(tag))
        .await
        .expect("connect")
}

/// A store on `server` with [`patient_options`]`(tag)`.
async fn connected_patiently(server: &RedisServer, tag: &str) -> RedisStore {
    RedisStore::connect(&server.url(), REFERENCE, patient_options(tag))
        .await
        .expect("connect")
}

async fn limiter(server: &RedisServer, policy: FailurePolicy) -> RedisLimiter {
    let store = connected(server, "fault").await;
    RedisLimiter::new(store, RedisTime::Server, policy, MemoryOptions::default()).unwrap()
}

/// Calls until `deadline`, from 4 tasks; returns (calls answered by Redis,
/// calls answered by the failure policy), checking every call's duration.
async fn load(limiter: &RedisLimiter, until: Instant) -> (u64, u64) {
    let mut tasks = Vec::new();
    for t in 0..4u64 {
        let limiter = limiter.clone();
        tasks.push(tokio::spawn(async move {
            let (mut ok, mut failed) = (0, 0);
            let mut i = 0u64;
            while Instant::now() < until {
                let started = Instant::now();
                let checked = limiter
                    .check_detailed(t * 1_000_000 + i, 1)
                    .await
                    .expect("transient failures are answered");
                let took = started.elapsed();
                assert!(
                    took <= Duration::from_millis(TIMEOUT_MS) + MARGIN,
                    "a call took {took:?}"
                );
                match checked.failure {
                    None => ok += 1,
                    Some(e) => {
                        assert!(
                            matches!(
                                e.kind(),
                                StoreErrorKind::Timeout | StoreErrorKind::ConnectionDropped
                            ),
                            "untyped failure: {e}"
                        );
                        failed += 1;
                    }
                }
                i += 1;
                // Bounded rate: the loop is about behaviour, not throughput.
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            (ok, failed)
        }));
    }
    let mut total = (0, 0);
    for t in tasks {
        let (ok, failed) = t.await.expect("load task");
        total.0 += ok;
        total.1 += failed;
    }
    total
}

/// A healthy Redis answers (nearly) every call: a rare timeout on a busy
/// machine is tolerated, a failing Redis is not.
fn mostly_answered((ok, failed): (u64, u64)) -> bool {
    ok > 0 && failed * 10 <= ok
}

/// Waits (bounded) until a call is answered by Redis again.
async fn until_redis_answers(limiter: &RedisLimiter) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let checked = limiter.check_detailed(42, 1).await.expect("answered");
        if checked.failure.is_none() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "Redis did not answer again within 10 s: {:?}",
            checked.failure
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[test]
fn sigkill_under_load_applies_the_failure_policy_then_recovers() {
    let rt = common::runtime();
    for policy in [
        FailurePolicy::FailOpen,
        FailurePolicy::FailClosed,
        FailurePolicy::Local,
    ] {
        let mut server = RedisServer::start();
        let limiter = rt.block_on(limiter(&server, policy));
        let before = rt.block_on(load(&limiter, Instant::now() + Duration::from_millis(300)));
        assert!(
            mostly_answered(before),
            "{policy}: healthy Redis answered {before:?}"
        );

        let counts_before = limiter.failure_counts();
        server.kill();
        let during = rt.block_on(load(&limiter, Instant::now() + Duration::from_millis(600)));
        assert!(
            during.1 > 0 && during.0 == 0,
            "{policy}: dead Redis answered {during:?}"
        );
        let counts = limiter.failure_counts();
        let applied = match policy {
            FailurePolicy::FailOpen => counts.failed_open - counts_before.failed_open,
            FailurePolicy::FailClosed => counts.failed_closed - counts_before.failed_closed,
            FailurePolicy::Local => counts.decided_locally - counts_before.decided_locally,
        };
        assert_eq!(applied, during.1, "{policy}: {counts:?}");
        let typed = counts.timeouts + counts.connection_dropped
            - counts_before.timeouts
            - counts_before.connection_dropped;
        assert_eq!(typed, during.1, "{policy}: {counts:?}");

        server.restart();
        rt.block_on(until_redis_answers(&limiter));
        let after = rt.block_on(load(&limiter, Instant::now() + Duration::from_millis(300)));
        assert!(
            mostly_answered(after),
            "{policy}: restarted Redis answered {after:?}"
        );
        assert_eq!(server.keys_without_ttl(), Vec::<String>::new());
    }
}

#[test]
fn the_failure_policies_decide_as_documented() {
    let rt = common::runtime();
    let mut server = RedisServer::start();
    let open = rt.block_on(limiter(&server, FailurePolicy::FailOpen));
    let closed = rt.block_on(limiter(&server, FailurePolicy::FailClosed));
    // A clock that stands still: the local budget cannot refill while the
    // test counts it.
    let local = rt.block_on(async {
        let store = connected(&server, "fault").await;
        let clock = Arc::new(ManualClock::new(1_000_000));
        RedisLimiter::new(
            store,
            RedisTime::Caller(clock),
            FailurePolicy::Local,
            MemoryOptions::default(),
        )
        .unwrap()
    });
    server.kill();
    rt.block_on(async {
        let d = open.check_detailed(1, 1).await.unwrap();
        assert!(d.decision.allowed && d.failure.is_some());
        let d = closed.check_detailed(1, 1).await.unwrap();
        assert!(!d.decision.allowed && d.decision.retry_after_ms == Some(1000));
        // The local limiter enforces the same configuration alone.
        let admitted = {
            let mut n = 0;
            for _ in 0..150 {
                if local.check_detailed(1, 1).await.unwrap().decision.allowed {
                    n += 1;
                }
            }
            n
        };
        assert_eq!(admitted, REFERENCE.limit);
        // A cost above the capacity is refused with no wait, as Redis
        // would refuse it, whatever the policy.
        for limiter in [&open, &closed, &local] {
            let d = limiter
                .check_detailed(2, REFERENCE.capacity() + 1)
                .await
                .unwrap();
            assert_eq!(d.decision, Decision::refused(None, 0), "{limiter:?}");
            assert!(d.failure.is_some());
        }
    });
}

/// What a writer of log lines wrote, shared with the test.
#[derive(Clone, Default)]
struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn lines(&self, containing: &str) -> Vec<String> {
        String::from_utf8_lossy(&self.0.lock().unwrap())
            .lines()
            .filter(|l| l.contains(containing))
            .map(str::to_owned)
            .collect()
    }
}

/// An outage is logged, one line a second saying how many failures it
/// stands for (not one per request, which any client could turn into a
/// flood), and so is the first answer after it.
#[test]
fn failures_are_logged_once_a_second_and_the_recovery_once() {
    let log = Captured::default();
    let writer = log.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    // The calls below run on this thread (block_on), where this applies.
    let _guard = tracing::subscriber::set_default(subscriber);
    // A second dispatcher stays registered meanwhile. tracing caches each
    // callsite's interest for the whole process, and while one dispatcher
    // alone is registered it takes that interest from whichever thread
    // reaches the callsite first: a sibling test's thread, with no
    // subscriber, caches "never", and this thread's failure lines are lost
    // (tokio-rs/tracing#3611). With two, every registered one counts.
    let _second = tracing::Dispatch::new(tracing::subscriber::NoSubscriber::default());
    let rt = common::runtime();
    let mut server = RedisServer::start();
    let limiter = rt.block_on(limiter(&server, FailurePolicy::FailOpen));
    server.kill();
    let started = Instant::now();
    rt.block_on(all_fail(&limiter, 50));
    let seconds = started.elapsed().as_millis().div_ceil(1000) as usize;
    let warned = log.lines("Redis failed, the failure policy answers");
    // One line for the first failure, at most one more per second the
    // calls took (far less than a second, unless the machine is very busy).
    assert!(
        !warned.is_empty() && warned.len() <= 1 + seconds,
        "{warned:?}"
    );
    assert!(warned[0].contains("WARN"), "{warned:?}");
    assert!(warned[0].contains(&server.url()), "{warned:?}");
    assert!(warned[0].contains("failures_not_logged=0"), "{warned:?}");
    // A second later the next failure is logged, with the count of those
    // held back: every failure is either a line or counted in one.
    std::thread::sleep(Duration::from_millis(1100));
    rt.block_on(async { limiter.check_detailed(0, 1).await.unwrap() });
    let after = log.lines("Redis failed, the failure policy answers");
    assert_eq!(after.len(), warned.len() + 1, "{after:?}");
    let held: usize = after.iter().map(|l| not_logged(l)).sum();
    assert_eq!(held + after.len(), 51, "{after:?}");
    // Failures within the second after a line are held back (unless the
    // machine is very slow); the line saying Redis answers again counts
    // them.
    rt.block_on(all_fail(&limiter, 3));

    server.restart();
    rt.block_on(async {
        until_redis_answers(&limiter).await;
        for i in 0..10 {
            assert!(limiter
                .check_detailed(i, 1)
                .await
                .unwrap()
                .failure
                .is_none());
        }
    });
    let back = log.lines("Redis answers again");
    assert_eq!(back.len(), 1, "{back:?}");
    assert!(back[0].contains("INFO"), "{back:?}");
    // Every failure, those while Redis came back included, is a line or
    // counted in one: the recovery line counts the last ones.
    let failed = log.lines("Redis failed, the failure policy answers");
    let lines = failed.iter().chain(&back);
    let counted: usize = lines.map(|l| not_logged(l)).sum::<usize>() + failed.len();
    let counts = limiter.failure_counts();
    let failures = counts.timeouts + counts.connection_dropped + counts.backend_errors;
    assert_eq!(counted as u64, failures, "{failed:?} {back:?}");
}

/// `n` checks, each answered by the failure policy.
async fn all_fail(limiter: &RedisLimiter, n: u64) {
    for key in 0..n {
        let checked = limiter.check_detailed(key, 1).await.unwrap();
        assert!(checked.failure.is_some(), "{checked:?}");
    }
}

/// The `failures_not_logged` count a log line gives.
fn not_logged(line: &str) -> usize {
    let n = line.split("failures_not_logged=").nth(1).unwrap();
    let digits: String = n.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().unwrap()
}

/// The bare store as a `Limiter` applies no failure policy: a dead Redis
/// reaches the caller as a typed error, so a layer above can apply its own.
#[test]
fn the_store_as_a_limiter_passes_failures_on() {
    use ratewarden_core::Limiter;
    let rt = common::runtime();
    let mut server = RedisServer::start();
    let store = rt.block_on(connected(&server, "bare"));
    rt.block_on(async {
        let d = store.check(7, 1).await.unwrap();
        assert!(d.allowed);
        assert_eq!(d.remaining, REFERENCE.limit - 1);
    });
    server.kill();
    rt.block_on(async {
        let started = Instant::now();
        let err = store.check(7, 1).await.unwrap_err();
        assert!(err.is_transient(), "{err}");
        assert!(started.elapsed() < Duration::from_millis(TIMEOUT_MS) + MARGIN);
    });
}

/// `ping` answers while Redis does, times out (saying so, and nothing
/// about an applied request) while it is frozen, and fails at once while
/// it is down; it writes no key.
#[test]
fn ping_follows_redis() {
    let rt = common::runtime();
    let mut server = RedisServer::start();
    let store = rt.block_on(connected(&server, "ping"));
    rt.block_on(store.ping()).expect("a running Redis answers");
    assert_eq!(server.cli(&["DBSIZE"]).trim(), "0");

    server.pause();
    let started = Instant::now();
    let err = rt.block_on(store.ping()).unwrap_err();
    assert!(started.elapsed() < Duration::from_millis(TIMEOUT_MS) + MARGIN);
    assert_eq!(err.kind(), StoreErrorKind::Timeout, "{err}");
    assert_eq!(
        err.detail(),
        format!("Redis did not answer PING within {TIMEOUT_MS} ms")
    );
    server.resume();
    rt.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(10);
        while store.ping().await.is_err() {
            assert!(Instant::now() < deadline, "no answer 10 s after the thaw");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });

    server.kill();
    let err = rt.block_on(store.ping()).unwrap_err();
    // Refused at once, not a timeout.
    assert_eq!(err.kind(), StoreErrorKind::ConnectionDropped, "{err}");
}

/// A node made a replica after the store connected (REPLICAOF) is not
/// ready: a writable one would go on deciding apart from its master, and
/// connecting refuses one. Made a master again, it is ready again.
#[test]
fn ping_is_not_ready_on_a_node_made_a_replica() {
    let rt = common::runtime();
    let master = RedisServer::start();
    let server = RedisServer::start();
    let store = rt.block_on(connected_patiently(&server, "replica"));
    rt.block_on(store.ping()).expect("a running Redis answers");
    for args in [
        &["CONFIG", "SET", "replica-read-only", "no"][..],
        &["REPLICAOF", "127.0.0.1", &master.port().to_string()],
    ] {
        assert_eq!(server.cli(args).trim(), "OK");
    }
    let err = rt.block_on(store.ping()).unwrap_err();
    assert!(
        err.detail().contains(&format!(
            "is a replica of 127.0.0.1:{} (INFO replication)",
            master.port()
        )) && err.detail().contains("point the URL at its master"),
        "{err}"
    );
    assert_eq!(server.cli(&["REPLICAOF", "NO", "ONE"]).trim(), "OK");
    rt.block_on(store.ping()).expect("a master again");
}

/// A user refused INFO is asked it at connect, and once by ping at most:
/// each refusal is an entry in Redis's ACL LOG, and readiness probes come
/// every few seconds for as long as the store runs.
#[test]
fn ping_stops_asking_info_of_a_user_refused_it() {
    let rt = common::runtime();
    let server = RedisServer::start();
    let granted = server.cli(&["ACL", "SETUSER", "rw", "on", ">pw", "~*", "+@all", "-info"]);
    assert_eq!(granted.trim(), "OK");
    let url = format!("redis://rw:pw@127.0.0.1:{}", server.port());
    let store = rt
        .block_on(RedisStore::connect(
            &url,
            REFERENCE,
            patient_options("no-info"),
        ))
        .expect("connect");
    // The refusals counted in the ACL LOG (one entry for them all).
    let refusals = || -> u64 {
        let log = server.cli(&["ACL", "LOG"]);
        let lines: Vec<&str> = log.lines().map(str::trim).collect();
        lines
            .iter()
            .position(|l| *l == "count")
            .map_or(0, |i| lines[i + 1].parse().unwrap())
    };
    rt.block_on(store.ping()).expect("ready");
    let after_first = refusals();
    for _ in 0..5 {
        rt.block_on(store.ping()).expect("ready");
    }
    assert_eq!(refusals(), after_first);
}

#[test]
fn sigstop_never_blocks_a_call_past_the_timeout() {
    let rt = common::runtime();
    let server = RedisServer::start();
    let limiter = rt.block_on(limiter(&server, FailurePolicy::FailClosed));
    rt.block_on(until_redis_answers(&limiter));
    server.pause();
    // Three times the timeout frozen; the load runs a little longer so that
    // calls straddle the thaw.
    let frozen = Duration::from_millis(3 * TIMEOUT_MS);
    let load_until = Instant::now() + frozen + Duration::from_millis(300);
    let handle = {
        let limiter = limiter.clone();
        rt.spawn(async move { load(&limiter, load_until).await })
    };
    std::thread::sleep(frozen);
    server.resume();
    let (ok, failed) = rt.block_on(handle).expect("load task");
    assert!(
        failed > 0,
        "no call noticed the frozen server ({ok} answered)"
    );
    assert!(
        limiter.failure_counts().timeouts > 0,
        "{:?}",
        limiter.failure_counts()
    );
    // After the thaw nothing stays blocked: calls are answered by Redis.
    rt.block_on(until_redis_answers(&limiter));
    let after = rt.block_on(load(&limiter, Instant::now() + Duration::from_millis(300)));
    assert!(mostly_answered(after), "{after:?}");
    assert_eq!(server.keys_without_ttl(), Vec::<String>::new());
}

#[test]
fn script_flush_is_survived_by_single_calls_and_batches() {
    let rt = common::runtime();
    let server = RedisServer::start();
    rt.block_on(async {
        let store = common::store(&server.url(), REFERENCE, "flush").await;
        assert!(store.decide(1, Some(5_000), 1).await.unwrap().allowed);
        assert_eq!(server.cli(&["SCRIPT", "FLUSH"]).trim(), "OK");
        assert_eq!(store.decide(1, Some(5_000), 1).await.unwrap().remaining, 98);
        assert_eq!(server.cli(&["SCRIPT", "FLUSH"]).trim(), "OK");
        let results = store
            .decide_many(&[(1, 1), (2, 5), (1, 1)], Some(5_000))
            .await
            .unwrap();
        let remaining: Vec<u64> = results.into_iter().map(|r| r.unwrap().remaining).collect();
        assert_eq!(remaining, vec![97, 95, 96]);
    });
    assert_eq!(server.keys_without_ttl(), Vec::<String>::new());
}

/// A script cache flushed about every millisecond, for 2 s, while single
/// calls are made: each one meeting `NOSCRIPT` after its reload goes by
/// `EVAL`, so none fails; and each call is applied once (the counts add up).
#[test]
fn single_calls_are_decided_under_a_storm_of_script_flushes() {
    let rt = common::runtime();
    let server = RedisServer::start();
    let url = server.url();
    rt.block_on(async {
        let config = PolicyConfig::new(PolicyKind::FixedWindow, 1_000_000, 1000);
        let store = common::store(&url, config, "storm").await;
        let mut conn = common::plain_connection(&url).await;
        let stop = Instant::now() + Duration::from_secs(2);
        let flusher = tokio::spawn(async move {
            let mut flushes = 0u32;
            while Instant::now() < stop {
                let () = redis::cmd("SCRIPT")
                    .arg("FLUSH")
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                flushes += 1;
                tokio::time::sleep(Duration::from_micros(300)).await;
            }
            flushes
        });
        let mut calls = 0;
        while Instant::now() < stop {
            let decision = store.decide(1, Some(5_000), 1).await;
            calls += 1;
            let decision = decision.unwrap_or_else(|e| panic!("call {calls}: {e}"));
            assert_eq!(decision.remaining, 1_000_000 - calls, "call {calls}");
        }
        let flushes = flusher.await.unwrap();
        assert!(
            flushes > 100 && calls > 100,
            "{flushes} flushes, {calls} calls"
        );
    });
}

/// How a test puts bad state under a key.
#[derive(Debug)]
enum Setup {
    /// `SET` to these bytes.
    Bytes(Vec<u8>),
    /// This redis-cli command.
    Cli(Vec<String>),
}

#[test]
fn corrupt_state_is_a_typed_error_never_an_admit() {
    let rt = common::runtime();
    let server = RedisServer::start();
    rt.block_on(async {
        for policy in PolicyKind::ALL {
            let config = PolicyConfig::new(policy, 10, 1000);
            let store = common::store(&server.url(), config, "corrupt").await;
            let limiter = RedisLimiter::new(
                store.clone(),
                RedisTime::Server,
                FailurePolicy::FailOpen,
                MemoryOptions::default(),
            )
            .unwrap();
            let name = store.key_name(7);
            // State is big-endian doubles: each bad value below is the
            // right length with a number that is not valid state (not an
            // integer, negative, past 2^53, NaN, a malformed limb), or the
            // wrong length.
            let nan = f64::NAN;
            let two53 = 9_007_199_254_740_992.0;
            let values: &[&[f64]] = match policy {
                // (A window start off the window's multiples, too.)
                PolicyKind::FixedWindow => &[
                    &[1.0, 0.0],
                    &[0.0, nan],
                    &[-1.0, 0.0],
                    &[0.0, 1.5],
                    &[two53, 0.0],
                    &[0.0, 0.0, 0.0],
                ],
                PolicyKind::SlidingWindowCounter => &[
                    &[1500.0, 0.0, 0.0],
                    &[0.0, 1.5, 0.0],
                    &[0.0, 0.0, f64::INFINITY],
                    &[nan, 0.0, 0.0],
                    &[0.0, 0.0],
                ],
                PolicyKind::TokenBucket => &[&[0.0, nan], &[-5.0, 0.0], &[0.0, 1.0, 2.0], &[0.0]],
                PolicyKind::Gcra => &[
                    &[nan],
                    &[1e300],
                    &[1.0, 2.0],
                    &[1.0, 2.0, 0.0],
                    &[1.0, 2.0, 16_777_216.0],
                    &[1.0, 2.5, 3.0],
                ],
                PolicyKind::SlidingLog => &[&[nan], &[1.0, 5.5, 1.0], &[1.0, 5.0]],
            };
            let mut setups: Vec<Setup> = values
                .iter()
                .map(|v| Setup::Bytes(v.iter().flat_map(|d| d.to_be_bytes()).collect()))
                .collect();
            setups.push(Setup::Bytes(b"5".to_vec()));
            // The wrong Redis type for the policy: a hash (as the first
            // stored format was) and a list.
            setups.push(Setup::Cli(vec![
                "HSET".into(),
                name.clone(),
                "w".into(),
                "0".into(),
            ]));
            setups.push(Setup::Cli(vec!["RPUSH".into(), name.clone(), "5".into()]));
            let mut conn = common::plain_connection(&server.url()).await;
            for setup in setups {
                server.cli(&["DEL", &name]);
                match &setup {
                    Setup::Bytes(bytes) => redis::cmd("SET")
                        .arg(&name)
                        .arg(bytes.as_slice())
                        .exec_async(&mut conn)
                        .await
                        .unwrap(),
                    Setup::Cli(args) => {
                        let args: Vec<&str> = args.iter().map(String::as_str).collect();
                        server.cli(&args);
                    }
                }
                server.cli(&["PEXPIRE", &name, "60000"]);
                let err = store
                    .decide(7, Some(5_000), 1)
                    .await
                    .expect_err(&format!("{policy} {setup:?}"));
                assert_eq!(
                    err.kind(),
                    StoreErrorKind::CorruptState,
                    "{policy} {setup:?}: {err}"
                );
                // It says what to do, and to which key, and names no field
                // by a letter.
                let text = err.to_string();
                assert!(text.contains("delete the key"), "{text}");
                assert!(text.contains(&name), "{text}");
                assert!(
                    !text.contains("field w ") && !text.contains("field a "),
                    "{text}"
                );
                // In a batch, too, beside a request decided as usual.
                let results = store
                    .decide_many(&[(8, 1), (7, 1)], Some(5_000))
                    .await
                    .expect("the batch is sent");
                assert!(results[0].is_ok(), "{:?}", results[0]);
                let err = results[1].as_ref().expect_err("corrupt state in a batch");
                assert_eq!(err.kind(), StoreErrorKind::CorruptState, "{err}");
                assert!(err.to_string().contains(&name), "{policy} {setup:?}: {err}");
                // Even failing open, corrupt state is an error, not an admit.
                let err = limiter
                    .check_detailed(7, 1)
                    .await
                    .expect_err("corrupt state is not failed open");
                assert_eq!(err.kind(), StoreErrorKind::CorruptState);
            }
            server.cli(&["DEL", &name]);
        }
    });
    assert_eq!(server.keys_without_ttl(), Vec::<String>::new());
}

/// A connection that Redis closed while it was idle (its `timeout`), or
/// killed (`CLIENT KILL`, as a restart does), is noticed only by the next
/// call on it: that call goes once more on a new connection and is
/// decided, rather than getting the failure policy although Redis is up.
#[test]
fn a_connection_closed_by_redis_costs_no_call() {
    let rt = common::runtime();
    let server = RedisServer::start();
    rt.block_on(async {
        // A generous timeout: this test counts outcomes, not latency.
        let generous = |tag| RedisOptions {
            timeout_ms: 5_000,
            ..options(tag)
        };
        let store = RedisStore::connect(&server.url(), REFERENCE, generous("closed"))
            .await
            .expect("connect");
        let batch = RedisStore::connect(&server.url(), REFERENCE, generous("closed-batch"))
            .await
            .expect("connect");
        let mut failures = Vec::new();
        let mut decide = |round: &str, r: Result<_, ratewarden_core::StoreError>| {
            if let Err(e) = r {
                failures.push(format!("{round}: {e}"));
            }
        };
        for round in 0..3 {
            assert_eq!(
                server.cli(&["CLIENT", "KILL", "TYPE", "normal"]).trim(),
                "2",
                "both stores' connections are killed"
            );
            decide(
                &format!("kill {round}"),
                store.decide(round, None, 1).await.map(drop),
            );
            decide(
                &format!("kill {round}, batch"),
                batch
                    .decide_many(&[(round, 1), (round + 10, 1)], None)
                    .await
                    .map(drop),
            );
        }
        // Redis closes connections idle for a second (it checks a few
        // times a second): wait well past it, twice.
        assert_eq!(server.cli(&["CONFIG", "SET", "timeout", "1"]).trim(), "OK");
        for round in 0..2 {
            tokio::time::sleep(Duration::from_millis(2_500)).await;
            decide(
                &format!("idle {round}"),
                store.decide(round, None, 1).await.map(drop),
            );
            decide(
                &format!("idle {round}, batch"),
                batch.decide_many(&[(round, 1)], None).await.map(drop),
            );
        }
        assert_eq!(failures, Vec::<String>::new());
    });
}

/// While Redis refuses connections each call fails at once as a
/// connection error (not by waiting out its timeout behind a reconnect
/// backoff), and the first call once Redis is back is decided.
#[test]
fn a_refusing_redis_fails_calls_as_connection_errors_and_the_first_call_back_succeeds() {
    let rt = common::runtime();
    let mut server = RedisServer::start();
    let store = rt
        .block_on(RedisStore::connect(
            &server.url(),
            REFERENCE,
            RedisOptions {
                // Generous: a call that waited for a reconnect backoff of
                // a second or more would still end as Timeout within it.
                timeout_ms: 3_000,
                ..options("refused")
            },
        ))
        .expect("connect");
    assert!(rt.block_on(store.decide(1, None, 1)).is_ok());
    server.kill();
    let errors: Vec<_> = (0..10)
        .map(|i| {
            rt.block_on(store.decide(i, None, 1))
                .expect_err("Redis is down")
        })
        .collect();
    let kinds: Vec<StoreErrorKind> = errors.iter().map(|e| e.kind()).collect();
    assert_eq!(kinds, vec![StoreErrorKind::ConnectionDropped; 10]);
    // The connection's own words do not say which Redis: the error does.
    let named = format!("Redis at {}: ", server.url());
    assert!(errors[0].detail().starts_with(&named), "{}", errors[0]);
    server.restart();
    for i in 0..3 {
        if let Err(e) = rt.block_on(store.decide(i, None, 1)) {
            panic!("call {i} after Redis returned failed: {e}");
        }
    }
}

/// A reconnection refused (the URL's password no longer accepted) is tried
/// again: once the password is accepted again, decisions are made again,
/// within a few seconds, though no call timed out. A connection whose
/// reconnection failed that way kept returning its error for good.
#[test]
fn a_reconnection_refused_its_password_is_tried_again() {
    let rt = common::runtime();
    let server = RedisServer::start();
    let acl = |args: &[&str]| {
        let said = server.cli(args);
        assert!(
            said.trim() == "OK" || said.trim().parse::<u64>().is_ok(),
            "{said}"
        );
    };
    acl(&["ACL", "SETUSER", "limiter", "on", ">first", "~*", "+@all"]);
    let url = server
        .url()
        .replacen("redis://", "redis://limiter:first@", 1);
    let store = rt
        .block_on(RedisStore::connect(&url, REFERENCE, options("reauth")))
        .expect("connect");
    assert!(rt.block_on(store.decide(1, None, 1)).is_ok());
    acl(&["ACL", "SETUSER", "limiter", "resetpass", ">second"]);
    acl(&["CLIENT", "KILL", "USER", "limiter"]);
    let e = (0..5)
        .find_map(|i| rt.block_on(store.decide(i, None, 1)).err())
        .expect("a refused password fails decisions");
    assert!(e.detail().contains("password"), "{e}");
    acl(&["ACL", "SETUSER", "limiter", "resetpass", ">first"]);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match rt.block_on(store.decide(2, None, 1)) {
            Ok(_) => break,
            Err(e) => assert!(
                Instant::now() < deadline,
                "still failing 5 s after the password was accepted again: {e}"
            ),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A Redis that refuses `EVAL` (renamed away, or an ACL user without it)
/// still decides after its script cache is flushed: the script is loaded
/// again with `SCRIPT LOAD` and called by `EVALSHA`. Every decision failed
/// for good, since `EVAL` of the text was the only way back.
#[test]
fn a_flushed_script_comes_back_without_eval() {
    let rt = common::runtime();
    let renamed = RedisServer::start_with(&["--rename-command", "EVAL", ""]);
    let with_acl = RedisServer::start();
    let said = with_acl.cli(&[
        "ACL", "SETUSER", "noeval", "on", ">pw", "~*", "+@all", "-eval",
    ]);
    assert_eq!(said.trim(), "OK");
    let acl_url = with_acl.url().replacen("redis://", "redis://noeval:pw@", 1);
    for (server, url) in [(&renamed, renamed.url()), (&with_acl, acl_url)] {
        let store = rt
            .block_on(RedisStore::connect(
                &url,
                REFERENCE,
                patient_options("no-eval"),
            ))
            .expect("connect");
        assert!(rt.block_on(store.decide(1, None, 1)).is_ok());
        assert_eq!(server.cli(&["SCRIPT", "FLUSH"]).trim(), "OK");
        if let Err(e) = rt.block_on(store.decide(1, None, 1)) {
            panic!("{url}: a call after the flush failed: {e}");
        }
        assert_eq!(server.cli(&["SCRIPT", "FLUSH"]).trim(), "OK");
        let batch = rt.block_on(store.decide_many(&[(2, 1), (3, 1)], None));
        for decided in batch.expect("a batch after the flush") {
            if let Err(e) = decided {
                panic!("{url}: a batch's call after the flush failed: {e}");
            }
        }
    }
}

/// An error Redis answers (here out of memory) names the Redis, from one
/// call and from each request of a batch alike: Redis's own words do not
/// say which one answered.
#[test]
fn errors_redis_answers_name_the_redis() {
    let rt = common::runtime();
    let server = RedisServer::start();
    let store = rt.block_on(connected_patiently(&server, "oom"));
    assert_eq!(
        server.cli(&["CONFIG", "SET", "maxmemory", "1"]).trim(),
        "OK"
    );
    let named = format!("Redis at {}: ", server.url());
    let e = rt.block_on(store.decide(1, None, 1)).unwrap_err();
    assert_eq!(e.kind(), StoreErrorKind::Backend, "{e}");
    assert!(e.detail().starts_with(&named), "{e}");
    let batch = rt
        .block_on(store.decide_many(&[(2, 1), (3, 1)], None))
        .unwrap();
    for e in batch {
        let e = e.unwrap_err();
        assert_eq!(e.kind(), StoreErrorKind::Backend, "{e}");
        assert!(e.detail().starts_with(&named), "{e}");
    }
}

/// A store made for a new configuration (serve's new rule after a reload,
/// or a gRPC override) on a connection that lost Redis loads its script
/// as soon as Redis is back: the connection's error from its failed
/// reconnection while Redis was away is not taken for Redis's answer.
#[test]
fn a_store_made_once_redis_is_back_is_not_refused_with_the_outage_error() {
    let rt = common::runtime();
    let mut server = RedisServer::start();
    let store = rt.block_on(connected(&server, "made-after"));
    let config = |limit| PolicyConfig::new(PolicyKind::FixedWindow, limit, 1000);
    server.kill();
    // While Redis is away: refused, and the connection's reconnection
    // fails too.
    let away = rt.block_on(store.with_config(config(7), "made-after-away"));
    assert!(away.is_err());
    server.restart();
    let made = rt.block_on(store.with_config(config(8), "made-after-back"));
    let made = made.unwrap_or_else(|e| panic!("Redis is back: {e}"));
    assert!(rt.block_on(made.decide(1, None, 1)).unwrap().allowed);
}

/// A TCP relay to a Redis whose connections can be made silent: after
/// [`SilencingRelay::silence`], the connections open then stay open but
/// carry nothing either way, as a link whose far end is gone without a
/// word (a host lost, a flow dropped by a NAT); connections made later
/// are relayed.
struct SilencingRelay {
    port: u16,
    generation: Arc<std::sync::atomic::AtomicU64>,
}

impl SilencingRelay {
    async fn start(target_port: u16) -> SilencingRelay {
        use std::sync::atomic::Ordering;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the relay");
        let port = listener.local_addr().expect("relay address").port();
        let generation = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let relay_generation = Arc::clone(&generation);
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", target_port)).await
                else {
                    continue;
                };
                let born = relay_generation.load(Ordering::SeqCst);
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                for (mut from, mut to) in [(client_read, server_write), (server_read, client_write)]
                {
                    let generation = Arc::clone(&relay_generation);
                    tokio::spawn(async move {
                        let mut buf = vec![0u8; 16 * 1024];
                        // Once silenced, what arrives is read and dropped,
                        // and both sockets stay open until the test ends.
                        while let Ok(n @ 1..) = from.read(&mut buf).await {
                            if generation.load(Ordering::SeqCst) == born
                                && to.write_all(&buf[..n]).await.is_err()
                            {
                                break;
                            }
                        }
                        std::future::pending::<()>().await;
                    });
                }
            }
        });
        SilencingRelay { port, generation }
    }

    fn silence(&self) {
        self.generation
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A connection that stops answering without failing (its far end gone)
/// is replaced: the calls on it time out, and within a few seconds calls
/// on the same store are decided on a new connection, rather than timing
/// out until the kernel gives up on the socket, many minutes later.
#[test]
fn a_connection_that_stops_answering_is_replaced() {
    let rt = common::runtime();
    let server = RedisServer::start();
    rt.block_on(async {
        let relay = SilencingRelay::start(server.port()).await;
        let url = format!("redis://127.0.0.1:{}", relay.port);
        let store = RedisStore::connect(&url, REFERENCE, options("silenced"))
            .await
            .expect("connect");
        assert!(store.decide(1, Some(5_000), 1).await.unwrap().allowed);
        relay.silence();
        let err = store.decide(2, Some(5_000), 1).await.unwrap_err();
        assert_eq!(err.kind(), StoreErrorKind::Timeout, "{err}");
        // At most one new connection a second, made in the background.
        let give_up = Instant::now() + Duration::from_secs(20);
        let mut timeouts = 1;
        loop {
            match store.decide(3, Some(5_000), 1).await {
                Ok(decision) => {
                    assert_eq!(decision.remaining, 99, "{decision:?}");
                    break;
                }
                Err(e) => {
                    assert_eq!(e.kind(), StoreErrorKind::Timeout, "{e}");
                    timeouts += 1;
                    assert!(
                        Instant::now() < give_up,
                        "{timeouts} calls timed out on the silent connection: none replaced it"
                    );
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    });
}

/// Calls in flight when the script cache is flushed all meet `NOSCRIPT`:
/// one of them sends the script's text (`EVAL`) and the others wait for it
/// and go by `EVALSHA` again, rather than each sending some 12 KB; and
/// each call is applied once.
#[test]
fn concurrent_calls_after_a_script_flush_send_the_script_once() {
    let rt = common::runtime();
    let server = RedisServer::start();
    rt.block_on(async {
        let config = PolicyConfig::new(PolicyKind::FixedWindow, 100, 60_000);
        let store = common::store(&server.url(), config, "flush-herd").await;
        assert!(store.decide(1, Some(5_000), 1).await.unwrap().allowed);
        assert_eq!(server.cli(&["SCRIPT", "FLUSH"]).trim(), "OK");
        assert_eq!(server.cli(&["CONFIG", "RESETSTAT"]).trim(), "OK");
        let calls = (0..200).map(|_| store.decide(1, Some(5_000), 1));
        let decisions = futures_util::future::join_all(calls).await;
        let admitted = decisions
            .into_iter()
            .map(|d| d.expect("every call is decided"))
            .filter(|d| d.allowed)
            .count();
        assert_eq!(admitted, 99, "each call applied once");
        assert_eq!(
            common::command_calls(&server, "eval"),
            1,
            "the text sent once"
        );
        assert_eq!(common::command_calls(&server, "script|load"), 0);
    });
}

/// A Redis that reached its `maxclients` while the store was away from it
/// refuses the store's new connection with its own words, which the
/// client reports as a broken pipe: `ping` (`/readyz`) gives Redis's words
/// and what to change, as connecting does.
#[test]
fn a_redis_at_maxclients_is_named_so_by_ping() {
    use std::io::{Read, Write};
    let rt = common::runtime();
    let server = RedisServer::start();
    let store = rt.block_on(connected(&server, "maxclients"));
    rt.block_on(store.ping()).expect("a healthy Redis");
    // One client of the test's own, kept; then a bound of one, which the
    // store's connection, closed from that client, cannot come back under.
    let mut held =
        std::net::TcpStream::connect(("127.0.0.1", server.port())).expect("the test's client");
    held.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert_eq!(
        server.cli(&["CONFIG", "SET", "maxclients", "1"]).trim(),
        "OK"
    );
    held.write_all(b"CLIENT KILL TYPE normal SKIPME yes\r\n")
        .unwrap();
    let mut said = [0u8; 64];
    let n = held.read(&mut said).expect("CLIENT KILL answers");
    assert!(
        said[..n].starts_with(b":"),
        "{:?}",
        String::from_utf8_lossy(&said[..n])
    );
    let e = rt.block_on(store.ping()).expect_err("no connection left");
    drop(held);
    assert!(
        e.detail().contains("max number of clients reached") && e.detail().contains("maxclients"),
        "{e}"
    );
}

/// A Redis at its `maxclients` accepts each new connection only to close
/// it: the store tries a new one at most about every 100 ms while that
/// lasts (each call made one, some 2,700 a second from one busy `serve`),
/// its calls failing at once meanwhile, and decides again soon after Redis
/// takes connections again.
#[test]
fn a_redis_at_maxclients_is_not_sent_a_connection_per_call() {
    use std::io::{Read, Write};
    let rt = common::runtime();
    let server = RedisServer::start();
    let store = rt.block_on(connected_patiently(&server, "maxclients-pace"));
    assert!(rt.block_on(store.decide(0, None, 1)).is_ok());
    // One client of the test's own, kept, which asks Redis what it
    // rejected; then a bound of one, under which the store's connection,
    // closed from that client, cannot come back.
    let mut held =
        std::net::TcpStream::connect(("127.0.0.1", server.port())).expect("the test's client");
    held.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut ask = |command: &str| -> String {
        held.write_all(format!("{command}\r\n").as_bytes()).unwrap();
        let mut said = Vec::new();
        let mut buf = [0u8; 4096];
        // A bulk reply (`$N\r\n` and N bytes and `\r\n`) or a line.
        loop {
            let n = held
                .read(&mut buf)
                .expect("Redis answers the test's client");
            assert!(n > 0, "Redis closed the test's client");
            said.extend_from_slice(&buf[..n]);
            let text = String::from_utf8_lossy(&said).into_owned();
            let whole = match text.strip_prefix('$') {
                Some(rest) => rest.split_once("\r\n").is_some_and(|(len, body)| {
                    len.parse::<usize>().is_ok_and(|len| body.len() >= len + 2)
                }),
                None => text.ends_with("\r\n"),
            };
            if whole {
                return text;
            }
        }
    };
    let rejected = |ask: &mut dyn FnMut(&str) -> String| -> u64 {
        ask("INFO stats")
            .lines()
            .find_map(|l| l.strip_prefix("rejected_connections:"))
            .and_then(|n| n.trim().parse().ok())
            .expect("INFO stats gives rejected_connections")
    };
    assert_eq!(
        server.cli(&["CONFIG", "SET", "maxclients", "1"]).trim(),
        "OK"
    );
    assert!(ask("CLIENT KILL TYPE normal SKIPME yes").starts_with(':'));
    let before = rejected(&mut ask);
    let started = Instant::now();
    let calls = rt.block_on(async {
        let mut tasks = Vec::new();
        for t in 0..4u64 {
            let store = store.clone();
            tasks.push(tokio::spawn(async move {
                let mut calls = 0u64;
                while started.elapsed() < Duration::from_secs(1) {
                    let e = store
                        .decide(t * 1_000_000 + calls, None, 1)
                        .await
                        .expect_err("Redis takes no connection");
                    assert_eq!(e.kind(), StoreErrorKind::ConnectionDropped, "{e}");
                    calls += 1;
                }
                calls
            }));
        }
        let mut calls = 0;
        for task in tasks {
            calls += task.await.expect("caller");
        }
        calls
    });
    let took_ms = u64::try_from(started.elapsed().as_millis()).unwrap();
    let tried = rejected(&mut ask) - before;
    // A pause of 100 ms after each pair of closed connections: at most two
    // tries per 100 ms (the call's own and its retry on a new connection).
    let bound = 2 * (took_ms / 100 + 2);
    assert!(
        calls > 4 * bound && tried <= bound,
        "{calls} calls in {took_ms} ms made {tried} connections (at most {bound})"
    );
    assert_eq!(ask("CONFIG SET maxclients 10000").trim(), "+OK");
    rt.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(5);
        while let Err(e) = store.decide(1, None, 1).await {
            assert!(
                Instant::now() < deadline,
                "not decided 5 s after Redis took connections again: {e}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
}
