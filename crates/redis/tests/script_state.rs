//! What the scripts leave in Redis, beyond the decisions the vectors pin:
//! keys forgettable at once are deleted when there is no grace (a PX of 0
//! is refused by `SET`), a sliding log keeps one entry per millisecond, and
//! a decision by Redis `TIME` is stamped with its milliseconds.

mod common;

use ratewarden_core::{MemoryStore, PolicyConfig, PolicyKind};
use ratewarden_redis::test_support::RedisServer;
use ratewarden_redis::{RedisOptions, RedisStore};

/// Ten minutes: no key written below expires by Redis's clock while a test
/// runs, whatever the machine's load.
const W: u64 = 600_000;

fn no_grace(tag: &str) -> RedisOptions {
    RedisOptions {
        ttl_grace_ms: 0,
        ..common::exact_options(tag)
    }
}

fn exists(server: &RedisServer, name: &str) -> bool {
    server.cli(&["EXISTS", name]).trim() == "1"
}

/// With no grace, a request that leaves its key forgettable at once (a
/// log whose entries are all W old, a bucket refilled to full, a GCRA
/// arrival time reached) deletes the key rather than writing it with a
/// PX of 0, which `SET` refuses; a request that would write such a state
/// to a new key writes nothing. The decisions stay the memory store's,
/// also for a request stepping back past the deletion (the bucket's and
/// the log's recorded times were already reached, so a new key decides
/// that request alike). A key left in place would keep its older state
/// and refuse it.
#[test]
fn keys_forgettable_at_once_are_deleted_without_a_grace() {
    let server = RedisServer::start();
    let rt = common::runtime();
    for policy in [
        PolicyKind::SlidingLog,
        PolicyKind::TokenBucket,
        PolicyKind::Gcra,
    ] {
        let config = PolicyConfig::new(policy, 1, W);
        let memory = MemoryStore::for_config(&config, Default::default()).unwrap();
        let store = rt
            .block_on(RedisStore::connect(&server.url(), config, no_grace("gone")))
            .expect("connect to the test Redis");
        // (key, now_ms, cost, whether the key is held afterwards)
        let mut steps = vec![
            // A cost above the limit on a new key: nothing to keep.
            (2, 0, 2, false),
            (1, 0, 1, true),
            // W later the entry is gone, the bucket is full, the arrival
            // time is reached: a peek deletes the key.
            (1, W, 0, false),
        ];
        if policy == PolicyKind::Gcra {
            // GCRA keeps no recorded time: a step back past its deletion
            // is decided as a new key's (docs/SPEC.md, "Forgetting").
            steps.push((1, W, 1, true));
        } else {
            steps.push((1, W / 2, 1, true));
        }
        for (i, (key, now, cost, held)) in steps.into_iter().enumerate() {
            let expected = memory.decide(key, now, cost).unwrap();
            let actual = rt
                .block_on(store.decide(key, Some(now), cost))
                .unwrap_or_else(|e| panic!("{config} step {i}: {e}"));
            assert_eq!(actual, expected, "{config} step {i} at {now} cost {cost}");
            assert_eq!(
                exists(&server, &store.key_name(key)),
                held,
                "{config} step {i}: whether key {key} is held"
            );
        }
    }
    assert_eq!(server.keys_without_ttl(), Vec::<String>::new());
}

/// Requests admitted in one millisecond share one log entry (`used`, then
/// 16 bytes per millisecond with admitted cost): a log holds at most one
/// entry per millisecond of its window, whatever the number of requests.
/// Peeks and refusals append nothing.
#[test]
fn a_sliding_log_keeps_one_entry_per_millisecond() {
    let server = RedisServer::start();
    let rt = common::runtime();
    let config = PolicyConfig::new(PolicyKind::SlidingLog, 10, W);
    let memory = MemoryStore::for_config(&config, Default::default()).unwrap();
    let store = rt.block_on(common::store(&server.url(), config, "log"));
    let name = store.key_name(1);
    for (now, cost, entries) in [
        (5, 1, 1),
        (5, 2, 1),
        (5, 0, 1),
        (5, 3, 1),
        (6, 1, 2),
        (6, 0, 2),
        (6, 20, 2),
        (7, 3, 3),
        (7, 1, 3),
        (7, 1, 3),
    ] {
        let expected = memory.decide(1, now, cost).unwrap();
        let actual = rt.block_on(store.decide(1, Some(now), cost)).unwrap();
        assert_eq!(actual, expected, "at {now} cost {cost}");
        let len: usize = server.cli(&["STRLEN", &name]).trim().parse().unwrap();
        assert_eq!(len, 8 + 16 * entries, "at {now} cost {cost}: STRLEN {len}");
    }
}

/// Redis's `TIME` in whole milliseconds, as the scripts read it.
fn redis_ms(server: &RedisServer) -> u64 {
    let out = server.cli(&["TIME"]);
    let mut parts = out.split_whitespace().map(|p| p.parse::<u64>().unwrap());
    let (s, us) = (parts.next().unwrap(), parts.next().unwrap());
    s * 1000 + us / 1000
}

/// Without a caller's time a decision is made at Redis `TIME` in
/// milliseconds. A log entry made by Redis's clock between `before` and
/// `after`, asked about again at `before` (a step back), refuses with the
/// wait to that entry's expiry, counted from `before`: at least W and at
/// most W + (after - before). An order, not a duration: it holds however
/// slowly the calls run.
#[test]
fn a_decision_by_redis_time_is_made_at_its_milliseconds() {
    let server = RedisServer::start();
    let rt = common::runtime();
    let config = PolicyConfig::new(PolicyKind::SlidingLog, 1, W);
    let store = rt.block_on(common::store(&server.url(), config, "time"));
    // A clock cut to whole seconds passes with odds of about 1 in 1000 per
    // key; three keys make it one in 10^9.
    for key in 1..=3 {
        let before = redis_ms(&server);
        assert!(rt.block_on(store.decide(key, None, 1)).unwrap().allowed);
        let after = redis_ms(&server);
        let d = rt.block_on(store.decide(key, Some(before), 1)).unwrap();
        assert!(!d.allowed, "key {key}: {d:?}");
        let retry = d.retry_after_ms.unwrap();
        assert!(
            (W..=W + (after - before)).contains(&retry),
            "key {key}: made between {before} and {after} ms by Redis TIME, yet the wait \
             from {before} is {retry} ms (window {W})"
        );
    }
}
