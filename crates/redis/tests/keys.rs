//! Key names: a prefix with `{`, `}` and `:` can neither pin every key to
//! one cluster slot nor make two limiters share a key.

mod common;

use ratewarden_core::{PolicyConfig, PolicyKind};
use ratewarden_redis::test_support::RedisCluster;
use ratewarden_redis::{RedisOptions, RedisStore};

#[test]
fn braces_in_the_prefix_form_no_hash_tag_on_a_cluster() {
    let cluster = RedisCluster::start();
    let rt = common::runtime();
    let config = PolicyConfig::new(PolicyKind::FixedWindow, 5, 1000);
    rt.block_on(async {
        let options = RedisOptions {
            prefix: "{tenant}:api".to_owned(),
            ..common::exact_options("keys")
        };
        let store = RedisStore::connect(&cluster.url(), config, options)
            .await
            .unwrap();
        assert_eq!(
            store.key_name(3),
            "%7Btenant%7D%3Aapi:v2:fixed-window:5:1000:3"
        );
        for key in 0..60 {
            assert!(store.decide(key, Some(1_000), 1).await.unwrap().allowed);
        }
    });
    // Unescaped, `{tenant}` would be the hash tag of every key: one slot,
    // one node. Escaped, the keys spread over the masters.
    let holding: Vec<u64> = cluster
        .nodes()
        .iter()
        .map(|n| n.cli(&["DBSIZE"]).trim().parse().unwrap())
        .collect();
    assert_eq!(holding.iter().sum::<u64>(), 60, "{holding:?}");
    assert!(
        holding.iter().filter(|&&n| n > 0).count() >= 2,
        "{holding:?}"
    );
    assert_eq!(cluster.keys_without_ttl(), Vec::<String>::new());
}

#[test]
fn prefixes_that_would_run_together_stay_apart() {
    let cluster = RedisCluster::start();
    let rt = common::runtime();
    let config = PolicyConfig::new(PolicyKind::FixedWindow, 1, 1000);
    rt.block_on(async {
        // "a:v2:fixed-window:1:1000:7" could otherwise be read as prefix
        // "a" or as prefix "a:v2:fixed-window:1:1000:7".
        let opts = |prefix: &str| RedisOptions {
            prefix: prefix.to_owned(),
            ..common::exact_options("apart")
        };
        let a = RedisStore::connect(&cluster.url(), config, opts("a"))
            .await
            .unwrap();
        let b = RedisStore::connect(&cluster.url(), config, opts("a:v2:fixed-window:1:1000:7"))
            .await
            .unwrap();
        assert_ne!(a.key_name(7), b.key_name(7));
        assert!(a.decide(7, Some(0), 1).await.unwrap().allowed);
        assert!(b.decide(7, Some(0), 1).await.unwrap().allowed);
        // Different configurations under one prefix do not share state.
        let c = RedisStore::connect(
            &cluster.url(),
            PolicyConfig::new(PolicyKind::FixedWindow, 2, 1000),
            opts("a"),
        )
        .await
        .unwrap();
        assert_eq!(c.decide(7, Some(0), 1).await.unwrap().remaining, 1);
    });
}

#[test]
fn a_batch_spanning_every_node_decides_as_single_calls_do() {
    let cluster = RedisCluster::start();
    let rt = common::runtime();
    let config = PolicyConfig::new(PolicyKind::SlidingWindowCounter, 3, 1000);
    rt.block_on(async {
        let batched = common::store(&cluster.url(), config, "batch").await;
        let single = common::store(&cluster.url(), config, "single").await;
        // 200 keys spread over all masters, each asked 4 times in one batch.
        let requests: Vec<(u64, u64)> = (0..800).map(|i| (i % 200, 1)).collect();
        let results = batched.decide_many(&requests, Some(5_000)).await.unwrap();
        for (&(key, cost), result) in requests.iter().zip(results) {
            let expected = single.decide(key, Some(5_000), cost).await.unwrap();
            assert_eq!(result.unwrap(), expected, "key {key}");
        }
        let too_many = vec![(1, 1); ratewarden_redis::MAX_BATCH + 1];
        let err = batched.decide_many(&too_many, None).await.unwrap_err();
        assert!(err.is_invalid_input(), "{err}");
        // One cost out of range refuses the whole batch, naming it.
        let err = batched
            .decide_many(&[(1, 1), (2, 1), (3, 1 << 53)], None)
            .await
            .unwrap_err();
        assert!(err.is_invalid_input(), "{err}");
        assert!(err.detail().starts_with("requests[2]: "), "{err}");
    });
    assert_eq!(cluster.keys_without_ttl(), Vec::<String>::new());
}
