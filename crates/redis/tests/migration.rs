//! Redis Cluster while a slot moves: a key already migrated to the
//! importing node is answered `ASK` by the old one, and every decision on
//! it must still be made, exactly, however many run at once.

mod common;

use ratewarden_core::{PolicyConfig, PolicyKind, REFERENCE};
use ratewarden_redis::test_support::RedisCluster;
use ratewarden_redis::RedisStore;

/// The first half of a slot migration, as `redis-cli --cluster reshard`
/// does it, for the slot of `name`, from the node that holds it to the
/// node `to` (or the next one): the key moves, the slot still belongs to
/// the source, which now answers `ASK` for it.
fn move_key_half_way(cluster: &RedisCluster, name: &str, to: Option<usize>) {
    let nodes = cluster.nodes();
    let source = nodes
        .iter()
        .position(|n| n.cli(&["EXISTS", name]).trim() == "1")
        .expect("one node holds the key");
    let target = to.unwrap_or((source + 1) % 3);
    let (src, dst) = (&nodes[source], &nodes[target]);
    let slot = src.cli(&["CLUSTER", "KEYSLOT", name]).trim().to_owned();
    let src_id = src.cli(&["CLUSTER", "MYID"]).trim().to_owned();
    let dst_id = dst.cli(&["CLUSTER", "MYID"]).trim().to_owned();
    assert_eq!(
        dst.cli(&["CLUSTER", "SETSLOT", &slot, "IMPORTING", &src_id])
            .trim(),
        "OK"
    );
    assert_eq!(
        src.cli(&["CLUSTER", "SETSLOT", &slot, "MIGRATING", &dst_id])
            .trim(),
        "OK"
    );
    let port = dst.port().to_string();
    assert_eq!(
        src.cli(&["MIGRATE", "127.0.0.1", &port, name, "0", "5000"])
            .trim(),
        "OK"
    );
    assert_eq!(src.cli(&["CLUSTER", "COUNTKEYSINSLOT", &slot]).trim(), "0");
    assert_eq!(dst.cli(&["CLUSTER", "COUNTKEYSINSLOT", &slot]).trim(), "1");
}

#[test]
fn decisions_on_a_key_whose_slot_is_migrating_all_succeed() {
    let cluster = RedisCluster::start();
    let rt = common::runtime();
    // Far above what the test spends: every decision admits.
    let config = PolicyConfig::new(PolicyKind::FixedWindow, 100_000_000, 86_400_000);
    let now_ms = Some(1_000);
    let store = rt.block_on(async {
        RedisStore::connect(&cluster.url(), config, common::exact_options("migrating"))
            .await
            .unwrap()
    });
    rt.block_on(async { store.decide(7, now_ms, 1).await.unwrap() });
    move_key_half_way(&cluster, &store.key_name(7), None);

    // Concurrent decisions share the cluster connection's node
    // connections, where another request's command can fall between a
    // redirect's ASKING and its command.
    const TASKS: usize = 8;
    const EACH: usize = 40;
    let failures = rt.block_on(async {
        let runs = (0..TASKS).map(|_| {
            let store = store.clone();
            tokio::spawn(async move {
                let mut failed = Vec::new();
                for _ in 0..EACH {
                    if let Err(e) = store.decide(7, now_ms, 1).await {
                        failed.push(e.to_string());
                    }
                }
                failed
            })
        });
        let mut all = Vec::new();
        for run in futures_util::future::join_all(runs).await {
            all.extend(run.unwrap());
        }
        all
    });
    assert!(
        failures.is_empty(),
        "{} failed, first: {:?}",
        failures.len(),
        failures.first()
    );
    // Exactly once each: the first decision and every one since.
    let peek = rt.block_on(async { store.decide(7, now_ms, 0).await.unwrap() });
    assert_eq!(peek.remaining, 100_000_000 - 1 - (TASKS * EACH) as u64);
}

/// The ACL docs/redis.md gives a user of a cluster, for keys under
/// `prefix`.
fn documented_acl(prefix: &str) -> Vec<String> {
    let mut rule: Vec<String> = [
        "ACL",
        "SETUSER",
        "limiter",
        "on",
        ">pw",
        "resetkeys",
        "-@all",
    ]
    .map(str::to_owned)
    .into();
    rule.push(format!("~{prefix}:*"));
    rule.extend(
        [
            "+evalsha",
            "+eval",
            "+script|load",
            "+ping",
            "+info",
            "+cluster",
            "+asking",
            "+get",
            "+set",
            "+del",
            "+time",
        ]
        .map(str::to_owned),
    );
    rule
}

/// A cluster user refused `ASKING` would fail the decisions of every key
/// moving between masters, with every node up: it is refused at connect,
/// saying what to grant.
#[test]
fn a_cluster_user_without_asking_is_refused_at_connect() {
    let cluster = RedisCluster::start();
    let options = common::exact_options("no-asking");
    let acl: Vec<String> = documented_acl(&options.prefix)
        .into_iter()
        .filter(|part| part != "+asking")
        .collect();
    let acl: Vec<&str> = acl.iter().map(String::as_str).collect();
    for node in cluster.nodes() {
        assert_eq!(node.cli(&acl).trim(), "OK");
    }
    let url = cluster.url().replacen("://", "://limiter:pw@", 1);
    let rt = common::runtime();
    let e = rt
        .block_on(RedisStore::connect(&url, REFERENCE, options))
        .unwrap_err();
    assert!(e.is_invalid_input(), "{e}");
    assert!(
        e.to_string().contains("ASKING") && e.to_string().contains("grant it +asking"),
        "{e}"
    );
}

/// A node just added, which serves no slot, takes its first key: loading
/// the script on every master did not reach it, so the first call `ASK`ed
/// there meets `NOSCRIPT`, and the store sends the call with the script's
/// text, which is decided, exactly once. With the ACL the docs give.
#[test]
fn a_key_moving_to_a_node_that_serves_no_slot_yet_is_decided() {
    let mut cluster = RedisCluster::start();
    let options = common::exact_options("new-node");
    let acl = documented_acl(&options.prefix);
    let acl: Vec<&str> = acl.iter().map(String::as_str).collect();
    for node in cluster.nodes() {
        assert_eq!(node.cli(&acl).trim(), "OK");
    }
    let url = cluster.url().replacen("://", "://limiter:pw@", 1);
    let rt = common::runtime();
    let config = PolicyConfig::new(PolicyKind::SlidingWindowCounter, 1_000, 86_400_000);
    let now_ms = Some(1_000);
    let store = rt.block_on(async { RedisStore::connect(&url, config, options).await.unwrap() });
    rt.block_on(async { store.decide(7, now_ms, 1).await.unwrap() });
    let new = cluster.add_empty_master();
    assert_eq!(cluster.nodes()[new].cli(&acl).trim(), "OK");
    move_key_half_way(&cluster, &store.key_name(7), Some(new));
    rt.block_on(async {
        for n in 2..=5 {
            let d = store
                .decide(7, now_ms, 1)
                .await
                .expect("decided on the new node");
            assert_eq!(d.remaining, 1_000 - n);
        }
    });
}

/// The index of the node that owns `slot`, by its own `CLUSTER NODES`.
fn owner_of(cluster: &RedisCluster, slot: u16) -> usize {
    cluster
        .nodes()
        .iter()
        .position(|n| {
            n.cli(&["CLUSTER", "NODES"])
                .lines()
                .find(|l| l.contains("myself"))
                .is_some_and(|l| {
                    l.split_whitespace().skip(8).any(|r| {
                        let (first, last) = r.split_once('-').unwrap_or((r, r));
                        matches!((first.parse::<u16>(), last.parse::<u16>()),
                            (Ok(f), Ok(l)) if f <= slot && slot <= l)
                    })
                })
        })
        .expect("a node owns the slot")
}

/// Readiness through a slot migration: once a slot has moved, the
/// client's slot map is behind the cluster's until it reads it again, so
/// a check routed by that map reaches the old owner. Decisions still reach
/// the new one (redirected by `MOVED`), so the store is ready: a
/// resharding, which operators run under load, must not turn `/readyz` off.
#[test]
fn readiness_holds_when_a_slot_has_moved_to_another_master() {
    let cluster = RedisCluster::start();
    let rt = common::runtime();
    let store = rt.block_on(async {
        RedisStore::connect(&cluster.url(), REFERENCE, common::exact_options("moved"))
            .await
            .unwrap()
    });
    rt.block_on(async { store.ping().await.unwrap() });
    // Slot 0 moves to the master after its owner: it becomes that
    // master's first range, the one its readiness check is routed by.
    let nodes = cluster.nodes();
    let source = owner_of(&cluster, 0);
    let target = (source + 1) % nodes.len();
    let target_id = nodes[target].cli(&["CLUSTER", "MYID"]).trim().to_owned();
    for node in nodes {
        assert_eq!(
            node.cli(&["CLUSTER", "SETSLOT", "0", "NODE", &target_id])
                .trim(),
            "OK"
        );
    }
    assert_eq!(owner_of(&cluster, 0), target);
    rt.block_on(async { store.ping().await }).unwrap();
}
