//! TTLs that are round numbers of ms (10^8, 10^12) are set as written.
//!
//! Redis 7.2.0 to 7.2.4 turn a Lua number passed to `redis.call` into text
//! with fpconv_dtoa, which writes a whole number with many trailing zeros
//! in exponent form (10^8 becomes `1e+08`); `SET ... PX 1e+08` then fails
//! with "value is not an integer or out of range" (redis/redis#13113), and
//! the decision with it. The scripts pass the PX as a decimal string. On
//! those Redis versions these tests fail if a script passes the PX as a
//! number; on every version they pass with the PX as a string.

mod common;

use std::time::Instant;

use ratewarden_core::{PolicyConfig, PolicyKind};
use ratewarden_redis::test_support::RedisServer;
use ratewarden_redis::{RedisOptions, RedisStore};

/// One admitted request, and the PX it must leave on its key.
struct Case {
    config: PolicyConfig,
    now_ms: u64,
    ttl_grace_ms: u64,
    max_ttl_ms: u64,
    px: u64,
}

const E8: u64 = 100_000_000;
const E12: u64 = 1_000_000_000_000;

fn case(config: PolicyConfig, now_ms: u64, px: u64) -> Case {
    Case {
        config,
        now_ms,
        ttl_grace_ms: 0,
        max_ttl_ms: RedisOptions::default().max_ttl_ms,
        px,
    }
}

/// Decides each case's one request on a fresh key and checks that it was
/// admitted and that the key's PTTL is the expected PX less the time
/// since the call began.
fn run(cases: &[Case]) {
    let server = RedisServer::start();
    let url = server.url();
    let rt = common::runtime();
    let mut con = redis::Client::open(url.as_str())
        .and_then(|c| c.get_connection())
        .expect("connect to the test Redis");
    let mut failures = Vec::new();
    for c in cases {
        let options = RedisOptions {
            ttl_grace_ms: c.ttl_grace_ms,
            max_ttl_ms: c.max_ttl_ms,
            ..common::exact_options("round")
        };
        let store = rt
            .block_on(RedisStore::connect(&url, c.config, options))
            .expect("connect to the test Redis");
        let started = Instant::now();
        let decision = match rt.block_on(store.decide(7, Some(c.now_ms), 1)) {
            Ok(d) => d,
            Err(e) => {
                failures.push(format!("{}: {e}", c.config));
                continue;
            }
        };
        let pttl: i64 = redis::cmd("PTTL")
            .arg(store.key_name(7))
            .query(&mut con)
            .expect("PTTL");
        let elapsed_ms = started.elapsed().as_millis() as u64;
        let lowest = c.px.saturating_sub(elapsed_ms + 1);
        if !decision.allowed || pttl < 0 || !(lowest..=c.px).contains(&(pttl as u64)) {
            failures.push(format!(
                "{} at {} ms: allowed {}, PTTL {pttl}, expected {lowest}..={}",
                c.config, c.now_ms, decision.allowed, c.px
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert_eq!(server.keys_without_ttl(), Vec::<String>::new());
}

#[test]
fn a_ttl_of_10_pow_8_ms_is_set_by_every_policy() {
    run(&[
        // Forgettable one window after the window's start, 0.
        case(PolicyConfig::new(PolicyKind::FixedWindow, 1, E8), 0, E8),
        // Forgettable two windows after the window's start, 0.
        case(
            PolicyConfig::new(PolicyKind::SlidingWindowCounter, 1, E8 / 2),
            0,
            E8,
        ),
        // Forgettable one window after the newest entry.
        case(PolicyConfig::new(PolicyKind::SlidingLog, 1, E8), 1_000, E8),
        // Drained: refilled to its burst of 1 after one window.
        case(
            PolicyConfig::new(PolicyKind::TokenBucket, 1, E8).with_burst(1),
            1_000,
            E8,
        ),
        // Drained: the theoretical arrival time is one window ahead.
        case(
            PolicyConfig::new(PolicyKind::Gcra, 1, E8).with_burst(1),
            1_000,
            E8,
        ),
    ]);
}

#[test]
fn a_round_max_ttl_or_grace_is_set() {
    let capped = |config| Case {
        max_ttl_ms: E12,
        ..case(config, 1_000, E12)
    };
    run(&[
        // Buckets that never refill keep their key for max_ttl_ms.
        capped(PolicyConfig::new(PolicyKind::TokenBucket, 0, 1_000).with_burst(1)),
        capped(PolicyConfig::new(PolicyKind::Gcra, 0, 1_000).with_burst(1)),
        // A TTL of 1000 ms plus a grace: the sum is the round number.
        Case {
            ttl_grace_ms: E8 - 1_000,
            ..case(PolicyConfig::new(PolicyKind::FixedWindow, 1, 1_000), 0, E8)
        },
    ]);
}
