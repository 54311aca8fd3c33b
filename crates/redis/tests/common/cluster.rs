//! Shared by the Redis Cluster fault tests (`cluster_faults.rs`) and the
//! batch tests under cluster faults (`cluster_batches.rs`), which run as
//! test binaries of their own.

use ratewarden_core::{StoreError, REFERENCE};
use ratewarden_redis::test_support::RedisCluster;
use ratewarden_redis::{RedisOptions, RedisStore};

/// The single calls' timeout.
pub const TIMEOUT_MS: u64 = 200;

/// Keys decided in each round: enough to land on every master's slots.
pub const KEYS: u64 = 100;

/// Store options with a prefix of their own, the single calls' timeout and
/// 2 s to connect.
pub fn options(tag: &str) -> RedisOptions {
    RedisOptions {
        prefix: super::fresh_prefix(tag),
        timeout_ms: TIMEOUT_MS,
        connect_timeout_ms: 2_000,
        ..RedisOptions::default()
    }
}

/// One decision for each of the keys, all at once; the errors.
pub async fn failures(store: &RedisStore) -> Vec<StoreError> {
    failures_of(store, KEYS).await
}

/// One decision for each of keys 0 to `keys`, all at once; the errors.
pub async fn failures_of(store: &RedisStore, keys: u64) -> Vec<StoreError> {
    let calls = (0..keys).map(|key| store.decide(key, None, 1));
    futures_util::future::join_all(calls)
        .await
        .into_iter()
        .filter_map(Result::err)
        .collect()
}

/// The store options of the batch tests: a batch of thousands needs more
/// than the single calls' 200 ms.
pub fn batch_options(tag: &str, timeout_ms: u64) -> RedisOptions {
    RedisOptions {
        timeout_ms,
        ..options(tag)
    }
}

/// A store on `cluster` with options `tag` and a timeout of `timeout_ms`.
pub fn store_with_timeout(
    cluster: &RedisCluster,
    rt: &tokio::runtime::Runtime,
    tag: &str,
    timeout_ms: u64,
) -> RedisStore {
    rt.block_on(RedisStore::connect(
        &cluster.url(),
        REFERENCE,
        batch_options(tag, timeout_ms),
    ))
    .expect("connect")
}

/// The keys node `index` holds: the names it lists end in the key.
pub fn keys_on_node(cluster: &RedisCluster, index: usize) -> std::collections::HashSet<u64> {
    cluster.nodes()[index]
        .cli(&["--scan"])
        .lines()
        .filter_map(|name| name.rsplit(':').next()?.parse().ok())
        .collect()
}

/// Requests for keys 0 to `keys`, one each.
pub fn batch(keys: u64) -> Vec<(u64, u64)> {
    (0..keys).map(|key| (key, 1)).collect()
}
