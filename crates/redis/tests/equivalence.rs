//! Random traces get identical decisions on Redis and on the core's
//! in-memory store, for every policy, with numbers up to 2^53 - 1 and
//! wall-clock times (bounded: a fixed number of cases and steps).

mod common;

use std::collections::HashMap;
use std::time::Instant;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use ratewarden_core::{MemoryStore, Policy, PolicyConfig, PolicyKind, StoreErrorKind, MAX_SAFE};
use ratewarden_redis::test_support::RedisServer;

const WALL_CLOCK_MS: u64 = 1_764_000_000_000;
const YEAR_MS: u64 = 31_536_000_000;

/// Small, medium, wall-clock-sized and near-2^53 numbers.
fn number() -> impl Strategy<Value = u64> {
    prop_oneof![
        3 => 0u64..=12,
        2 => 13u64..=2_000,
        1 => Just(1_000_000_000u64),
        1 => Just(YEAR_MS),
        1 => (MAX_SAFE - 1000)..=MAX_SAFE,
        1 => 0u64..=MAX_SAFE,
    ]
}

#[derive(Debug, Clone)]
struct Trace {
    config: PolicyConfig,
    start_ms: u64,
    steps: Vec<(u64, u8, u64, u8, u64)>,
}

fn trace() -> impl Strategy<Value = Trace> {
    let kind = prop::sample::select(PolicyKind::ALL.to_vec());
    let start = prop_oneof![
        Just(0u64),
        WALL_CLOCK_MS..WALL_CLOCK_MS + 10_000,
        (MAX_SAFE - 5_000)..=MAX_SAFE
    ];
    (
        kind,
        number(),
        number().prop_map(|w| w.max(1)),
        prop::option::of(number()),
        start,
        prop::collection::vec((0u64..3, 0u8..8, any::<u64>(), 0u8..6, any::<u64>()), 1..40),
    )
        .prop_map(|(policy, limit, window_ms, burst, start_ms, steps)| {
            let burst = if policy.has_burst() { burst } else { None };
            Trace {
                config: PolicyConfig {
                    policy,
                    limit,
                    window_ms,
                    burst,
                },
                start_ms,
                steps,
            }
        })
}

/// The next time: stays, steps a little, moves by fractions or multiples of
/// the window, jumps anywhere, or steps back.
fn next_time(now: u64, w: u64, kind: u8, r: u64) -> u64 {
    let t = match kind {
        0 => now,
        1 => now.saturating_add(r % 7),
        2 => now.saturating_add(r % w.max(1)),
        3 => now
            .saturating_add(w.saturating_mul(1 + r % 2))
            .saturating_sub(r % 3),
        4 => now.saturating_sub(r % w.max(1)),
        5 => now.saturating_sub(r % 5),
        6 => now.saturating_add(r % 100_000),
        _ => r % (MAX_SAFE + 1),
    };
    t.min(MAX_SAFE)
}

fn cost(config: &PolicyConfig, kind: u8, r: u64) -> u64 {
    let cap = config.capacity();
    match kind {
        0 => 0,
        1 => 1,
        2 => cap,
        3 => cap.saturating_add(1).min(MAX_SAFE),
        4 => r % (cap.saturating_add(1)),
        _ => r % 4,
    }
}

impl Trace {
    /// The trace's requests in order, as `(key, now_ms, cost)`.
    fn requests(&self) -> Vec<(u64, u64, u64)> {
        let mut now = self.start_ms;
        self.steps
            .iter()
            .map(|&(key, time_kind, time_r, cost_kind, cost_r)| {
                now = next_time(now, self.config.window_ms, time_kind, time_r);
                (key, now, cost(&self.config, cost_kind, cost_r))
            })
            .collect()
    }
}

#[test]
fn random_traces_decide_as_the_memory_store_does() {
    let server = RedisServer::start();
    let url = server.url();
    let rt = common::runtime();
    let mut runner = TestRunner::new(Config {
        cases: 300,
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(&trace(), |t| {
            let memory = MemoryStore::for_config(&t.config, Default::default()).unwrap();
            let redis = rt.block_on(common::store(&url, t.config, "prop"));
            for (i, (key, now, cost)) in t.requests().into_iter().enumerate() {
                let expected = memory.decide(key, now, cost).unwrap();
                let actual = rt
                    .block_on(redis.decide(key, Some(now), cost))
                    .map_err(|e| TestCaseError::fail(format!("step {i}: {e}")))?;
                prop_assert_eq!(
                    actual,
                    expected,
                    "step {} key {} now {} cost {}",
                    i,
                    key,
                    now,
                    cost
                );
            }
            Ok(())
        })
        .unwrap();
    assert_eq!(server.keys_without_ttl(), Vec::<String>::new());
}

/// The first time at or after `now_ms` at which the core would forget
/// `state`, as a TTL from `now_ms`, capped at `max_ttl_ms` (also when it
/// is never forgettable). Forgettability only ever turns on as time
/// passes, so a binary search finds it.
fn ttl_until_forgettable<P: Policy>(
    policy: &P,
    state: &P::State,
    now_ms: u64,
    max_ttl_ms: u64,
) -> u64 {
    let (mut lo, mut hi) = (now_ms, now_ms + max_ttl_ms);
    if !policy.is_forgettable(state, hi) {
        return max_ttl_ms;
    }
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if policy.is_forgettable(state, mid) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    lo - now_ms
}

/// Every write keeps its key for exactly as long as the core's policy
/// says the state still counts (SPEC "Memory"), measured from the
/// request's time, plus the grace: the TTLs and `is_forgettable` agree on
/// every policy, including after a step back in time.
#[test]
fn every_ttl_runs_until_the_state_is_forgettable() {
    let server = RedisServer::start();
    let url = server.url();
    let rt = common::runtime();
    // `TestRunner::run` takes a `Fn`: the connection is borrowed per query.
    let con = std::cell::RefCell::new(
        redis::Client::open(url.as_str())
            .and_then(|c| c.get_connection())
            .expect("connect to the test Redis"),
    );
    let mut runner = TestRunner::new(Config {
        cases: 150,
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(&trace(), |t| {
            let policy = t.config.build().unwrap();
            let redis = rt.block_on(common::store(&url, t.config, "ttl"));
            let (grace_ms, max_ttl_ms) = (redis.options().ttl_grace_ms, redis.options().max_ttl_ms);
            let mut states = HashMap::new();
            for (i, (key, now, cost)) in t.requests().into_iter().enumerate() {
                let state = states.entry(key).or_insert_with(|| policy.new_state(now));
                policy.decide(state, now, cost);
                let started = Instant::now();
                rt.block_on(redis.decide(key, Some(now), cost))
                    .map_err(|e| TestCaseError::fail(format!("step {i}: {e}")))?;
                let pttl: i64 = redis::cmd("PTTL")
                    .arg(redis.key_name(key))
                    .query(&mut *con.borrow_mut())
                    .map_err(|e| TestCaseError::fail(format!("PTTL: {e}")))?;
                let elapsed_ms = started.elapsed().as_millis() as u64;
                let ttl_ms = ttl_until_forgettable(&policy, state, now, max_ttl_ms);
                // A state forgettable only past 2^53 - 1 ms, beyond any
                // time a request can carry, may keep the longest TTL.
                let px = if now + ttl_ms > MAX_SAFE && pttl as u64 > ttl_ms + grace_ms {
                    max_ttl_ms + grace_ms
                } else {
                    ttl_ms + grace_ms
                };
                // The TTL set, less the time since it was set.
                prop_assert!(
                    pttl >= 0 && (px.saturating_sub(elapsed_ms + 1)..=px).contains(&(pttl as u64)),
                    "step {} key {} now {} cost {}: PTTL {} where the state is forgettable \
                     after {} ms (+ {} grace)",
                    i,
                    key,
                    now,
                    cost,
                    pttl,
                    ttl_ms,
                    grace_ms
                );
            }
            Ok(())
        })
        .unwrap();
}

/// The brief's bound, explicitly: wall-clock time, a limit of 10^9 and a
/// window of one year, where every product passes 2^53.
#[test]
fn wall_clock_with_a_billion_per_year_is_exact() {
    let server = RedisServer::start();
    let rt = common::runtime();
    for policy in PolicyKind::ALL {
        let config = PolicyConfig::new(policy, 1_000_000_000, YEAR_MS);
        let memory = MemoryStore::for_config(&config, Default::default()).unwrap();
        let redis = rt.block_on(common::store(&server.url(), config, "bound"));
        let mut now = WALL_CLOCK_MS;
        for (dt, cost) in [
            (0, 999_999_999),
            (1, 2),
            (7, 1),
            (YEAR_MS - 3, 500_000_000),
            (YEAR_MS / 2 + 1, 999_999_999),
            (13, 0),
            (1, 1_000_000_000),
            (YEAR_MS * 2, 1_000_000_000),
            (31, 1),
        ] {
            now += dt;
            let expected = memory.decide(9, now, cost).unwrap();
            let actual = rt.block_on(redis.decide(9, Some(now), cost)).unwrap();
            assert_eq!(actual, expected, "{config} at {now} cost {cost}");
        }
    }
}

/// Waits past 2^53 ms come back as limbs, exact past 2^64 as the core's are;
/// every policy at the edges of SPEC's range matches the memory store.
#[test]
fn extreme_configurations_match_including_waits_past_2_pow_53() {
    let server = RedisServer::start();
    let rt = common::runtime();
    let configs = [
        PolicyConfig::new(PolicyKind::TokenBucket, 1, MAX_SAFE).with_burst(MAX_SAFE),
        PolicyConfig::new(PolicyKind::Gcra, 1, MAX_SAFE).with_burst(MAX_SAFE),
        PolicyConfig::new(PolicyKind::TokenBucket, 0, 1000).with_burst(2),
        PolicyConfig::new(PolicyKind::Gcra, 0, 1000).with_burst(2),
        PolicyConfig::new(PolicyKind::SlidingWindowCounter, MAX_SAFE, MAX_SAFE),
        PolicyConfig::new(PolicyKind::FixedWindow, MAX_SAFE, MAX_SAFE),
        PolicyConfig::new(PolicyKind::SlidingLog, MAX_SAFE, MAX_SAFE),
    ];
    let mut saw_past_u64 = false;
    for config in configs {
        let memory = MemoryStore::for_config(&config, Default::default()).unwrap();
        let redis = rt.block_on(common::store(&server.url(), config, "edge"));
        for (now, cost) in [
            (0, MAX_SAFE),
            (0, MAX_SAFE),
            (0, 1),
            (MAX_SAFE - 1, 1),
            (MAX_SAFE, MAX_SAFE),
            (1, 2),
            (MAX_SAFE, 0),
        ] {
            let expected = memory.decide(1, now, cost).unwrap();
            let actual = rt.block_on(redis.decide(1, Some(now), cost)).unwrap();
            assert_eq!(actual, expected, "{config} at {now} cost {cost}");
            saw_past_u64 |= actual.retry_after_exact_ms() > Some(u128::from(u64::MAX));
        }
    }
    assert!(saw_past_u64, "no wait past u64::MAX was exercised");
    assert_eq!(server.keys_without_ttl(), Vec::<String>::new());
    // One step past the range: refused before Redis is asked, with the
    // memory store's very error.
    let config = PolicyConfig::new(PolicyKind::FixedWindow, 1, 1000);
    let memory = MemoryStore::for_config(&config, Default::default()).unwrap();
    let redis = rt.block_on(common::store(&server.url(), config, "range"));
    let keys = server.cli(&["DBSIZE"]);
    for (now, cost) in [(MAX_SAFE + 1, 1), (0, MAX_SAFE + 1)] {
        let expected = memory.decide(1, now, cost).unwrap_err();
        let actual = rt.block_on(redis.decide(1, Some(now), cost)).unwrap_err();
        assert_eq!(actual.kind(), StoreErrorKind::InvalidInput, "{actual}");
        assert_eq!(actual.detail(), expected.detail());
    }
    let e = rt
        .block_on(redis.decide(1, None, MAX_SAFE + 1))
        .unwrap_err();
    assert_eq!(
        e.detail(),
        "cost is 9007199254740992, above 2^53 - 1 (9007199254740991)"
    );
    assert_eq!(server.cli(&["DBSIZE"]), keys, "nothing was written");
}
