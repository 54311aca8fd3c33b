//! Stores made with `RedisStore::with_config` share their first store's
//! connection, on one node and on a cluster, and keep their counts apart.

mod common;

use ratewarden_core::{PolicyConfig, PolicyKind, StoreErrorKind, REFERENCE};
use ratewarden_redis::test_support::{RedisCluster, RedisServer};
use ratewarden_redis::RedisStore;

/// Twenty stores of several policies, made from `first`: each decides on
/// its own counts, keyed by its prefix and its configuration.
async fn twenty_stores(first: &RedisStore) -> Vec<RedisStore> {
    let kinds = PolicyKind::ALL;
    let mut stores = Vec::new();
    for i in 0..20 {
        let config = PolicyConfig::new(kinds[i % kinds.len()], 2, 60_000);
        // Every other pair shares a prefix: their configurations differ in
        // policy, which the key names hold, so they still share no count.
        let prefix = format!("{}-{}", first.options().prefix, i / 2);
        let store = first
            .with_config(config, prefix)
            .await
            .expect("with_config");
        assert_eq!(store.config(), &config);
        stores.push(store);
    }
    stores
}

/// Each store admits exactly its own limit of 2 for each of `keys`, at one
/// instant, whatever the others decided.
async fn each_admits_its_own_limit(stores: &[RedisStore], keys: &[u64]) {
    for &key in keys {
        for store in stores {
            let mut admitted = Vec::new();
            for _ in 0..3 {
                let decision = store.decide(key, Some(1_000_000), 1).await;
                admitted.push(decision.expect("decide").allowed);
            }
            assert_eq!(
                admitted,
                [true, true, false],
                "{:?} key {key}",
                store.key_name(key)
            );
        }
    }
}

#[test]
fn stores_made_with_config_share_one_connection_on_a_node() {
    let server = RedisServer::start();
    let rt = common::runtime();
    rt.block_on(async {
        let first = common::store(&server.url(), REFERENCE, "shared").await;
        let stores = twenty_stores(&first).await;
        each_admits_its_own_limit(&stores, &[1, 2, 3]).await;
        assert_eq!(server.clients(), 1, "{}", server.cli(&["CLIENT", "LIST"]));

        // A configuration that is no configuration is refused as such.
        let e = first
            .with_config(PolicyConfig::new(PolicyKind::Gcra, 2, 0), "bad")
            .await
            .expect_err("a window of 0 ms");
        assert_eq!(e.kind(), StoreErrorKind::InvalidInput, "{e}");
    });
}

#[test]
fn stores_made_with_config_reconnect_together() {
    let mut server = RedisServer::start();
    let rt = common::runtime();
    rt.block_on(async {
        let first = common::store(&server.url(), REFERENCE, "reconnect").await;
        let stores = twenty_stores(&first).await;
        server.kill();
        // Out of reach: nothing is made, and the error says why.
        let e = first
            .with_config(PolicyConfig::new(PolicyKind::Gcra, 2, 1000), "away")
            .await
            .expect_err("Redis is down");
        assert_eq!(e.kind(), StoreErrorKind::ConnectionDropped, "{e}");
        assert!(
            e.to_string().contains("cannot load the policy's script"),
            "{e}"
        );
        server.restart();
        // The restarted Redis has no data and no scripts: every store
        // decides again, on one new connection, from empty counts.
        each_admits_its_own_limit(&stores, &[4]).await;
        let late = first
            .with_config(PolicyConfig::new(PolicyKind::Gcra, 2, 60_000), "late")
            .await
            .expect("Redis is back");
        each_admits_its_own_limit(&[late], &[4]).await;
        assert_eq!(server.clients(), 1, "{}", server.cli(&["CLIENT", "LIST"]));
    });
}

#[test]
fn stores_made_with_config_share_one_connection_to_each_cluster_node() {
    let cluster = RedisCluster::start();
    let rt = common::runtime();
    rt.block_on(async {
        let first = common::store(&cluster.url(), REFERENCE, "shared-cluster").await;
        let stores = twenty_stores(&first).await;
        // 240 key names: every master holds some.
        let keys: Vec<u64> = (0..12).collect();
        each_admits_its_own_limit(&stores, &keys).await;
        for node in cluster.nodes() {
            assert_eq!(node.clients(), 1, "{}", node.cli(&["CLIENT", "LIST"]));
        }
    });
}
