//! Redis Cluster failures: a master that hangs (SIGSTOP) while its replica
//! takes over, and nodes that accept connections but never answer.

mod common;

use std::time::{Duration, Instant};

use ratewarden_core::REFERENCE;
use ratewarden_redis::test_support::RedisCluster;
use ratewarden_redis::{RedisOptions, RedisStore};

const TIMEOUT_MS: u64 = 200;
/// Keys decided in each round: enough to land on every master's slots.
const KEYS: u64 = 100;

fn options(tag: &str) -> RedisOptions {
    RedisOptions {
        prefix: common::fresh_prefix(tag),
        timeout_ms: TIMEOUT_MS,
        connect_timeout_ms: 2_000,
        ..RedisOptions::default()
    }
}

/// One decision for each of the keys, all at once; how many failed.
async fn round(store: &RedisStore) -> usize {
    let calls = (0..KEYS).map(|key| store.decide(key, None, 1));
    futures_util::future::join_all(calls)
        .await
        .iter()
        .filter(|r| r.is_err())
        .count()
}

#[test]
fn a_hung_master_costs_its_slots_only_until_its_replica_takes_over() {
    let cluster = RedisCluster::start_with_replicas();
    assert!(
        (0..3).all(|i| cluster.is_master(i)),
        "nodes 0-2 are masters"
    );
    let replica = cluster
        .replica_of(0, 1)
        .expect("the first master has a replica");
    let rt = common::runtime();
    let store = rt.block_on(async {
        let store = RedisStore::connect(&cluster.url(), REFERENCE, options("hung-master"))
            .await
            .expect("connect");
        assert_eq!(
            round(&store).await,
            0,
            "a healthy cluster decides every key"
        );
        store
    });

    cluster.nodes()[0].pause();
    // Decisions go on while the cluster notices the hung master; the
    // replica's promotion is watched from a thread of its own.
    let promoted = std::thread::scope(|scope| {
        let watcher = scope.spawn(|| cluster.wait_until_master(replica, Duration::from_secs(20)));
        rt.block_on(async {
            while !watcher.is_finished() {
                round(&store).await;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
        watcher.join().expect("watcher")
    });
    assert!(promoted, "the replica was not promoted within 20 s");
    let promoted_at = Instant::now();

    // Within a bound after the promotion every key is decided again, and
    // stays so: the hung master's slots are served by the new master.
    let recovery_bound = Duration::from_secs(10);
    rt.block_on(async {
        let mut clean_rounds = 0;
        let mut last_failed = 0;
        while clean_rounds < 5 {
            assert!(
                promoted_at.elapsed() < recovery_bound,
                "{last_failed} of {KEYS} decisions still failed {recovery_bound:?} after the \
                 replica took over"
            );
            last_failed = round(&store).await;
            if last_failed == 0 {
                clean_rounds += 1;
            } else {
                assert_eq!(clean_rounds, 0, "decisions failed again after recovering");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
}
