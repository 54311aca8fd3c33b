//! A key is kept only while something it counted still counts, as the
//! policies' `is_forgettable` says: a request that counted nothing (a peek,
//! a refusal of a cost above the limit) on a new key writes none, whatever
//! the policy, and a key's TTL ends when its count stops counting.

mod common;

use ratewarden_core::{PolicyConfig, PolicyKind};
use ratewarden_redis::test_support::RedisServer;
use ratewarden_redis::{RedisOptions, RedisStore};

/// A connection of the test's own to the server at `url`, and a store on
/// it for `config` with options `tag` and no grace: the TTLs are the
/// policy's.
fn connected(
    url: &str,
    rt: &tokio::runtime::Runtime,
    config: PolicyConfig,
    tag: &str,
) -> (redis::Connection, RedisStore) {
    let con = redis::Client::open(url)
        .and_then(|c| c.get_connection())
        .expect("connect to the test Redis");
    let options = RedisOptions {
        ttl_grace_ms: 0,
        ..common::exact_options(tag)
    };
    let store = rt
        .block_on(RedisStore::connect(url, config, options))
        .expect("connect to the test Redis");
    (con, store)
}

/// The key's PTTL (-2: no key).
fn pttl(con: &mut redis::Connection, store: &RedisStore, key: u64) -> i64 {
    redis::cmd("PTTL")
        .arg(store.key_name(key))
        .query(con)
        .expect("PTTL")
}

#[test]
fn requests_that_count_nothing_keep_no_key() {
    let server = RedisServer::start();
    let rt = common::runtime();
    for policy in PolicyKind::ALL {
        let config = PolicyConfig::new(policy, 5, 1000);
        let (mut con, store) = connected(&server.url(), &rt, config, "kept");
        let peek = rt.block_on(store.decide(1, None, 0)).unwrap();
        assert!(peek.allowed, "{config}");
        let over = rt.block_on(store.decide(2, None, 6)).unwrap();
        assert!(!over.allowed, "{config}");
        assert_eq!(pttl(&mut con, &store, 1), -2, "{config}: a peek kept a key");
        assert_eq!(
            pttl(&mut con, &store, 2),
            -2,
            "{config}: a refusal kept a key"
        );
        // A request that counts keeps one, for a while. It spends the whole
        // limit at a caller's time at a window's start, so that every
        // policy keeps the key a window or more: on Redis's clock a request
        // just before a fixed window's end, or one token that a bucket
        // refills in a fifth of the window, leaves a TTL that a busy
        // machine can outlast before the PTTL.
        assert!(
            rt.block_on(store.decide(3, Some(1_000), 5))
                .unwrap()
                .allowed
        );
        let kept = pttl(&mut con, &store, 3);
        assert!(kept > 0, "{config}: PTTL {kept}");
    }
}

/// A sliding-window counter's count goes on counting, as the previous
/// window's, for one window after its own: a key rolled into the next
/// window by a peek is kept for that window only.
#[test]
fn a_counter_carrying_only_its_previous_window_is_kept_one_window() {
    let server = RedisServer::start();
    let rt = common::runtime();
    let config = PolicyConfig::new(PolicyKind::SlidingWindowCounter, 5, 1000);
    let (mut con, store) = connected(&server.url(), &rt, config, "carried");
    // Caller's times: TTLs run on Redis's clock from the request's time.
    assert!(
        rt.block_on(store.decide(1, Some(1_100), 1))
            .unwrap()
            .allowed
    );
    // Bounds wide apart: what is checked is two windows or one, on a
    // machine that can be slow between a call and its PTTL.
    let counting = pttl(&mut con, &store, 1);
    assert!((1_000..=1_900).contains(&counting), "PTTL {counting}");
    assert!(
        rt.block_on(store.decide(1, Some(2_500), 0))
            .unwrap()
            .allowed
    );
    let carried = pttl(&mut con, &store, 1);
    assert!((1..=500).contains(&carried), "PTTL {carried}");
}
