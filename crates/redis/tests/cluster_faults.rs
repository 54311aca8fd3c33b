//! Redis Cluster failures: a master that hangs (SIGSTOP) or dies (SIGKILL)
//! while its replica takes over, and nodes that accept connections but
//! never answer. Batches and many callers under such failures are in
//! `cluster_batches.rs`.

mod common;

use std::net::{Ipv4Addr, TcpListener};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::cluster::{
    batch, failures, failures_of, keys_on_node, options, store_with_timeout, KEYS, TIMEOUT_MS,
};
use ratewarden_core::{PolicyConfig, PolicyKind, StoreError, StoreErrorKind, REFERENCE};
use ratewarden_redis::test_support::RedisCluster;
use ratewarden_redis::{RedisOptions, RedisStore};

/// Scheduling slack on a busy 2-core machine, where other jobs can take
/// the CPU for most of a second; a call that hung, or waited for a connect
/// (2 s here, `options`), would blow past it.
const MARGIN: Duration = Duration::from_millis(1_500);

/// A store on `cluster`, checked with a `ping` that answers (tried up to
/// five times: on a busy machine a healthy master can miss 200 ms).
fn ready_store(cluster: &RedisCluster, rt: &tokio::runtime::Runtime, tag: &str) -> RedisStore {
    rt.block_on(async {
        let store = RedisStore::connect(&cluster.url(), REFERENCE, options(tag))
            .await
            .expect("connect");
        let mut tries = 0;
        while let Err(e) = store.ping().await {
            tries += 1;
            assert!(
                e.kind() == StoreErrorKind::Timeout && tries < 5,
                "a healthy cluster answers: {e}"
            );
        }
        store
    })
}

/// Every key decided in one round, on a cluster that should decide them
/// all: up to five rounds, since on a busy machine a healthy call can miss
/// its 200 ms now and then, while any failure but a timeout fails at once.
async fn every_key_decided(store: &RedisStore, what: &str) {
    for _ in 0..5 {
        let failed = failures(store).await;
        if failed.is_empty() {
            return;
        }
        if let Some(e) = failed.iter().find(|e| e.kind() != StoreErrorKind::Timeout) {
            panic!(
                "{what}: {} of {KEYS} decisions failed, one with {e}",
                failed.len()
            );
        }
    }
    panic!("{what}: decisions still timed out after 5 rounds");
}

/// One decision for each of the keys, all at once; how many failed.
async fn round(store: &RedisStore) -> usize {
    failures(store).await.len()
}

/// A store on the cluster at `url` with options `tag`, on which every key
/// was decided.
fn decided_store(rt: &tokio::runtime::Runtime, url: &str, tag: &str) -> RedisStore {
    rt.block_on(async {
        let store = RedisStore::connect(url, REFERENCE, options(tag))
            .await
            .expect("connect");
        every_key_decided(&store, "a healthy cluster decides every key").await;
        store
    })
}

/// Three masters (nodes 0-2) with a replica each (`node_timeout_ms`), the
/// index of node 0's replica, and a store with options `tag` on which
/// every key was decided.
fn replicated_cluster(
    node_timeout_ms: u64,
    tag: &str,
) -> (RedisCluster, usize, tokio::runtime::Runtime, RedisStore) {
    let cluster = RedisCluster::start_with_replicas(node_timeout_ms);
    assert!(
        (0..3).all(|i| cluster.is_master(i)),
        "nodes 0-2 are masters"
    );
    let replica = cluster
        .replica_of(0, 1)
        .expect("the first master has a replica");
    let rt = common::runtime();
    let store = decided_store(&rt, &cluster.url(), tag);
    (cluster, replica, rt, store)
}

#[test]
fn a_hung_master_costs_its_slots_only_until_its_replica_takes_over() {
    let (cluster, replica, rt, store) = replicated_cluster(1000, "hung-master");
    cluster.nodes()[0].pause();
    let promoted_at = decide_until_master(&cluster, &store, &rt, replica);
    decided_again(&store, &rt, promoted_at);
}

/// A master killed (SIGKILL) while decisions go on: its slots fail as
/// dropped connections or timeouts, never as errors of Redis's own, until
/// its replica takes over.
#[test]
fn a_killed_master_costs_its_slots_only_until_its_replica_takes_over() {
    let mut cluster = RedisCluster::start_with_replicas(1000);
    let replica = cluster
        .replica_of(0, 1)
        .expect("the first master has a replica");
    let rt = common::runtime();
    let store = rt.block_on(async {
        RedisStore::connect(&cluster.url(), REFERENCE, options("killed-master"))
            .await
            .expect("connect")
    });
    cluster.kill_node(0);
    let promoted_at = decide_until_master(&cluster, &store, &rt, replica);
    decided_again(&store, &rt, promoted_at);
}

/// A store whose URL named one seed, since removed from the cluster
/// (`redis-cli --cluster del-node`: it runs on, an empty cluster of its
/// own, whose slot map names no node): a failover afterwards is still
/// followed, since a new connection starts from the nodes the store last
/// knew, and the seed's empty slot map is never taken.
#[test]
fn a_failover_is_followed_after_the_only_seed_was_removed() {
    let mut cluster = RedisCluster::start_with_replicas(1000);
    let replica = cluster
        .replica_of(0, 1)
        .expect("the first master has a replica");
    let seed = cluster.add_empty_master();
    let url = format!("redis-cluster://127.0.0.1:{}", cluster.nodes()[seed].port());
    let rt = common::runtime();
    let store = decided_store(&rt, &url, "removed-seed");
    cluster.remove_node(seed);
    cluster.kill_node(0);
    let promoted_at = decide_until_master(&cluster, &store, &rt, replica);
    decided_again(&store, &rt, promoted_at);
    rt.block_on(async {
        let deadline = promoted_at + Duration::from_secs(10);
        loop {
            match store.ping().await {
                Ok(()) => break,
                Err(e) => assert!(
                    Instant::now() < deadline,
                    "still not ready 10 s after the replica took over: {e}"
                ),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
}

/// A store whose URL named one seed, a replica since removed (`del-node`:
/// it runs on as an empty cluster of its own). Its client still holds a
/// connection to it, and after a failover reads the slot map from the
/// first of its connections that answers, in no set order: when that is
/// the removed seed (here made sure of: the members refuse the store's
/// user `CLUSTER` meanwhile), its empty map drops every connection, and
/// the client reconnects to its URL's seed alone, which gives the same
/// empty map, for good. A call that fails so starts a new connection,
/// from the masters last known, as a timeout's does (here the store's own
/// probes may mend it first): the store decides again.
#[test]
fn a_failover_is_followed_after_a_removed_seed_gave_an_empty_slot_map() {
    let mut cluster = RedisCluster::start_with_replicas(1000);
    let grant = |node: &ratewarden_redis::test_support::RedisServer, rule: &str| {
        let said = node.cli(&["ACL", "SETUSER", "rw", "on", ">pw", "~*", "+@all", rule]);
        assert_eq!(said.trim(), "OK");
    };
    for node in cluster.nodes() {
        grant(node, "+cluster");
    }
    let seed = cluster
        .replica_of(1, 0)
        .expect("the second master has a replica");
    let promoted = cluster
        .replica_of(0, 1)
        .expect("the first master has a replica");
    let url = format!(
        "redis-cluster://rw:pw@127.0.0.1:{}",
        cluster.nodes()[seed].port()
    );
    let rt = common::runtime();
    let store = decided_store(&rt, &url, "empty-map");
    cluster.remove_node(seed);
    let members = || {
        cluster
            .nodes()
            .iter()
            .enumerate()
            .filter(move |&(i, _)| i != seed)
            .map(|(_, node)| node)
    };
    for node in members() {
        grant(node, "-cluster");
    }
    let said = cluster.nodes()[promoted].cli(&["CLUSTER", "FAILOVER"]);
    assert_eq!(said.trim(), "OK");
    assert!(
        cluster.wait_until_master(promoted, Duration::from_secs(20)),
        "the replica was not promoted within 20 s"
    );
    // The old master's keys are MOVED: the client reads the map again,
    // from the removed seed, the one node that lets it (the calls fail,
    // as the client drops its connections, or time out).
    let failed = rt.block_on(failures(&store));
    assert!(!failed.is_empty(), "no call failed after the failover");
    for node in members() {
        grant(node, "+cluster");
    }
    decided_again(&store, &rt, Instant::now());
}

/// A master new to the cluster without the URL's ACL user (Redis keeps
/// users per node) fails the calls for its slots, safely; the readiness
/// check's error says it may lack the user, not only that it is out of
/// reach.
#[test]
fn a_new_master_without_the_acl_user_is_said_to_maybe_lack_it() {
    let mut cluster = RedisCluster::start();
    for node in cluster.nodes() {
        let granted = node.cli(&["ACL", "SETUSER", "rw", "on", ">pw", "~*", "+@all"]);
        assert_eq!(granted.trim(), "OK");
    }
    let url = cluster.url().replacen("://", "://rw:pw@", 1);
    let rt = common::runtime();
    let store = rt.block_on(async {
        RedisStore::connect(&url, REFERENCE, options("acl-new-master"))
            .await
            .expect("connect")
    });
    // The new master takes slot 0 (no key yet) without the user.
    let new = cluster.add_empty_master();
    let id = cluster.node_id(new);
    for node in cluster.nodes() {
        assert_eq!(
            node.cli(&["CLUSTER", "SETSLOT", "0", "NODE", &id]).trim(),
            "OK"
        );
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    rt.block_on(async {
        loop {
            match store.ping().await {
                Err(e) if e.detail().contains("may lack the URL's ACL user") => break,
                other => assert!(
                    Instant::now() < deadline,
                    "20 s after the move, ping gave {other:?}"
                ),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
}

/// A URL naming a seed since removed (`del-node`) beside a member: the
/// store connects every time, though redis-rs takes the slot map of
/// whichever seed answers first, and the removed one's names no node.
#[test]
fn a_removed_seed_beside_a_member_does_not_stop_connecting() {
    let mut cluster = RedisCluster::start();
    let removed = cluster.add_empty_master();
    cluster.remove_node(removed);
    let (removed, member) = (cluster.nodes()[removed].port(), cluster.nodes()[0].port());
    // And a seed that takes connections but never answers, before them.
    let hung = TcpListener::bind("127.0.0.1:0").unwrap();
    let hung = hung.local_addr().unwrap().port();
    let rt = common::runtime();
    for url in [
        format!("redis-cluster://127.0.0.1:{removed},127.0.0.1:{member}"),
        format!("redis-cluster://127.0.0.1:{hung},127.0.0.1:{removed},127.0.0.1:{member}"),
    ] {
        for _ in 0..20 {
            rt.block_on(async {
                let store = RedisStore::connect(&url, REFERENCE, options("removed-beside"))
                    .await
                    .unwrap_or_else(|e| panic!("{url}: a member among the seeds is enough: {e}"));
                every_key_decided(&store, "connected beside a removed seed").await;
            });
        }
    }
}

/// As above, with every connection of the store closed by the nodes
/// (`CLIENT KILL`) instead of a failover, three times: each time every key
/// is decided again within 10 s.
#[test]
fn dropped_connections_are_mended_after_the_only_seed_was_removed() {
    let mut cluster = RedisCluster::start_with_replicas(1000);
    let seed = cluster.add_empty_master();
    let url = format!("redis-cluster://127.0.0.1:{}", cluster.nodes()[seed].port());
    let rt = common::runtime();
    let store = decided_store(&rt, &url, "removed-seed-killed");
    cluster.remove_node(seed);
    for round_no in 0..3 {
        for (i, node) in cluster.nodes().iter().enumerate() {
            if i != seed {
                node.cli(&["CLIENT", "KILL", "TYPE", "normal"]);
            }
        }
        let started = Instant::now();
        rt.block_on(async {
            loop {
                let failed = failures(&store).await;
                let Some(e) = failed.first() else { break };
                assert!(
                    started.elapsed() < Duration::from_secs(10),
                    "round {round_no}: {} of {KEYS} decisions still failed after 10 s, one \
                     with {e}",
                    failed.len()
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
    }
}

/// Decides every key, again and again, until the node at `replica` is a
/// master (at most 20 s); checks that every failure meanwhile is a
/// timeout or a dropped connection. Returns when the promotion was seen.
fn decide_until_master(
    cluster: &RedisCluster,
    store: &RedisStore,
    rt: &tokio::runtime::Runtime,
    replica: usize,
) -> Instant {
    let promoted = std::thread::scope(|scope| {
        let watcher = scope.spawn(|| cluster.wait_until_master(replica, Duration::from_secs(20)));
        rt.block_on(async {
            while !watcher.is_finished() {
                // A hung node's calls time out, saying that they may have
                // been applied; a node out of reach is a dropped
                // connection, never an error of Redis's own.
                for e in failures(store).await {
                    match e.kind() {
                        StoreErrorKind::Timeout => assert!(
                            e.detail().contains("may or may not have been applied"),
                            "{e}"
                        ),
                        StoreErrorKind::ConnectionDropped => {}
                        _ => panic!("a failover gave {e}"),
                    }
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
        watcher.join().expect("watcher")
    });
    assert!(promoted, "the replica was not promoted within 20 s");
    Instant::now()
}

/// Within a bound after the promotion every key is decided again, and
/// stays so: the old master's slots are served by the new master. Five
/// rounds without a failure are asked for, and after the first of them at
/// most one round with a failure: on a busy machine a healthy call can
/// miss its 200 ms now and then, while a slot still sent to the old master
/// fails every round.
fn decided_again(store: &RedisStore, rt: &tokio::runtime::Runtime, promoted_at: Instant) {
    let recovery_bound = Duration::from_secs(10);
    rt.block_on(async {
        let mut clean_rounds = 0;
        let mut failed_after_recovering = 0;
        let mut last_failed = 0;
        while clean_rounds < 5 {
            assert!(
                promoted_at.elapsed() < recovery_bound,
                "{last_failed} of {KEYS} decisions still failed {recovery_bound:?} after the \
                 replica took over ({clean_rounds} rounds without a failure)"
            );
            last_failed = round(store).await;
            if last_failed == 0 {
                clean_rounds += 1;
            } else if clean_rounds > 0 {
                failed_after_recovering += 1;
                assert!(
                    failed_after_recovering <= 1,
                    "decisions failed again in {failed_after_recovering} rounds after recovering"
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
}

/// A node that accepts connections and never answers (a listener whose
/// connections the kernel accepts and no one reads), named first among
/// the seeds, costs connecting only its own part of the time.
#[test]
fn a_seed_that_never_answers_does_not_stop_connecting() {
    let cluster = RedisCluster::start();
    let silent = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind");
    let silent_port = silent.local_addr().expect("address").port();
    let url = cluster.url().replacen(
        "redis-cluster://",
        &format!("redis-cluster://127.0.0.1:{silent_port},"),
        1,
    );
    let rt = common::runtime();
    rt.block_on(async {
        let store = RedisStore::connect(&url, REFERENCE, options("silent-seed"))
            .await
            .expect("the other seeds are enough");
        every_key_decided(&store, "every key is decided").await;
    });
    drop(silent);
}

/// A replica that hangs, named by no seed, is found in the slot map and
/// connected to: it costs connecting only its own part of the time.
#[test]
fn a_hung_replica_does_not_stop_connecting() {
    // Redis's default node timeout: the hung replica stays in the slot map
    // (rather than flagged as failed) while the store connects.
    let cluster = RedisCluster::start_with_replicas(15_000);
    let masters: Vec<String> = cluster.nodes()[..3]
        .iter()
        .map(|n| format!("127.0.0.1:{}", n.port()))
        .collect();
    let url = format!("redis-cluster://{}", masters.join(","));
    let replica = cluster
        .replica_of(0, 1)
        .expect("the first master has a replica");
    cluster.nodes()[replica].pause();
    let rt = common::runtime();
    rt.block_on(async {
        let store = RedisStore::connect(&url, REFERENCE, options("hung-replica"))
            .await
            .expect("a hung replica does not stop connecting");
        every_key_decided(&store, "every key is decided").await;
    });
}

/// A cluster whose slots are not all served (a master down, no replica to
/// take over: `cluster_state:fail`) cannot be used, so connecting says so,
/// as it does for a single node that is down, rather than handing back a
/// store whose decisions fail.
#[test]
fn a_failed_cluster_stops_connecting_saying_so() {
    let mut cluster = RedisCluster::start();
    let survivors: Vec<String> = cluster.nodes()[..2]
        .iter()
        .map(|n| format!("127.0.0.1:{}", n.port()))
        .collect();
    // A short node timeout, so that the survivors flag the dead master
    // within a second rather than Redis's default 15.
    for node in cluster.nodes() {
        node.cli(&["CONFIG", "SET", "cluster-node-timeout", "500"]);
    }
    cluster.kill_node(2);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !cluster.nodes()[..2]
        .iter()
        .all(|n| n.cli(&["CLUSTER", "INFO"]).contains("cluster_state:fail"))
    {
        assert!(Instant::now() < deadline, "the cluster never failed");
        std::thread::sleep(Duration::from_millis(50));
    }
    let url = format!("redis-cluster://{}", survivors.join(","));
    let rt = common::runtime();
    let e = rt
        .block_on(RedisStore::connect(&url, REFERENCE, options("failed")))
        .expect_err("a failed cluster cannot be used");
    assert!(e.to_string().contains("cluster_state:fail"), "{e}");
    assert!(e.to_string().contains("redis-cli --cluster check"), "{e}");
}

/// A master killed with no replica to take over, before the cluster
/// flags it failed (Redis's default node timeout is 15 s): `ping` names it
/// as down, not the node that redis-rs sent its check to instead.
#[test]
fn ping_names_a_killed_master_as_down() {
    let mut cluster = RedisCluster::start();
    let port = cluster.nodes()[2].port();
    let rt = common::runtime();
    // A timeout a busy machine cannot miss: the ping's checks and the
    // probe of the dead master all fit in it.
    let store = store_with_timeout(&cluster, &rt, "killed-ping", 5_000);
    cluster.kill_node(2);
    let e = rt.block_on(store.ping()).expect_err("a master is down");
    assert!(
        e.detail().contains(&format!(
            "(127.0.0.1:{port}) refuses connections (it is down)"
        )),
        "{e}"
    );
    assert!(!e.detail().contains("answered in its place"), "{e}");
}

/// Connecting just after a master died, before the cluster flags it
/// failed: a check whose key is that master's fails naming the master as
/// down (it read "Moved: SLOT HOST:PORT" alone, redis-rs having sent the
/// check elsewhere). The prefix is chosen, before the kill, so that the
/// check key is that master's (left to chance, 20 prefixes can all miss).
#[test]
fn connecting_just_after_a_master_died_names_it_as_down() {
    let mut cluster = RedisCluster::start();
    let port = cluster.nodes()[0].port();
    let (options, check_key) = options_with_check_key_on(&cluster, 0, "died-at-connect");
    cluster.kill_node(0);
    let rt = common::runtime();
    let e = rt
        .block_on(RedisStore::connect(&cluster.url(), REFERENCE, options))
        .expect_err("the check key's master is down");
    assert_eq!(e.kind(), StoreErrorKind::ConnectionDropped, "{e}");
    assert!(e.detail().contains(&check_key), "{e}");
    assert!(
        e.detail().contains(&format!(
            "(127.0.0.1:{port}) refuses connections (it is down); its keys cannot be decided"
        )),
        "{e}"
    );
}

/// Options for a store whose connect check decides on a key of the
/// master at `index` (which must answer), with that key's name: tried
/// prefix by prefix, as the check key's slot follows from the prefix.
fn options_with_check_key_on(
    cluster: &RedisCluster,
    index: usize,
    tag: &str,
) -> (RedisOptions, String) {
    (0..1_000)
        .map(|i| {
            let options = options(&format!("{tag}-{i}"));
            // Under the store's prefix and configuration, as its keys
            // are, named `probe` where they end in a number.
            let key = ratewarden_redis::key_name(&options.prefix, &REFERENCE, 0);
            let stem = key
                .strip_suffix('0')
                .expect("a key name ends in its number");
            let check_key = format!("{stem}probe");
            (options, check_key)
        })
        .find(|(_, check_key)| {
            let answer = cluster.nodes()[index].cli(&["EXISTS", check_key]);
            !answer.contains("MOVED")
        })
        .expect("one of 1,000 prefixes has its check key on the master")
}

/// While a killed node is down, a node that a concurrent test starts
/// cannot take its ports (were one to, the killed node's peers would drop
/// its address at the newcomer's first answer and never flag it failed),
/// and the killed node takes them back when it restarts.
#[test]
fn a_killed_nodes_ports_stay_its_own_until_it_restarts() {
    let mut cluster = RedisCluster::start();
    let port = cluster.nodes()[2].port();
    cluster.kill_node(2);
    let dir = tempfile::tempdir().expect("temporary directory");
    let mut newcomer = Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args([
            "--save",
            "",
            "--appendonly",
            "no",
            "--cluster-enabled",
            "yes",
        ])
        .args(["--dir", &dir.path().display().to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start redis-server");
    let deadline = Instant::now() + Duration::from_secs(10);
    let exited = loop {
        if let Some(status) = newcomer.try_wait().expect("wait for redis-server") {
            break Some(status);
        }
        if Instant::now() >= deadline {
            let _ = newcomer.kill();
            let _ = newcomer.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let status = exited.expect("a new node took a killed node's ports");
    assert!(!status.success(), "{status}");
    cluster.restart_node(2);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !cluster
        .nodes()
        .iter()
        .all(|n| n.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok"))
    {
        assert!(
            Instant::now() < deadline,
            "the restarted node did not rejoin"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `ping` on a cluster asks every slot's master: with one frozen, every
/// ping fails within its timeout, naming that master's slots, even once
/// the client has made a new connection (which leaves out the frozen
/// node); thawed, pings succeed again.
#[test]
fn ping_fails_while_any_master_is_frozen() {
    let cluster = RedisCluster::start();
    let rt = common::runtime();
    let store = ready_store(&cluster, &rt, "ping");
    cluster.nodes()[0].pause();
    let port = cluster.nodes()[0].port();
    // Spaced past the store's one new connection a second, so that later
    // pings run on a connection made while the master was frozen.
    let names_frozen = |err: &StoreError| {
        err.detail().contains("the master of slots") && err.detail().contains(&format!(":{port})"))
    };
    for _ in 0..4 {
        // Every ping fails in time, naming every master that missed the
        // deadline: the frozen one always, a slow healthy one beside it
        // now and then on a busy machine.
        let started = Instant::now();
        let err = rt.block_on(store.ping()).unwrap_err();
        assert!(started.elapsed() < Duration::from_millis(TIMEOUT_MS) + MARGIN);
        assert!(err.is_transient(), "{err}");
        assert!(
            names_frozen(&err) || err.detail().contains("no master answered CLUSTER SLOTS"),
            "{err}"
        );
        std::thread::sleep(Duration::from_millis(1_100));
    }
    cluster.nodes()[0].resume();
    rt.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(10);
        while let Err(e) = store.ping().await {
            assert!(
                Instant::now() < deadline,
                "no answer 10 s after the thaw: {e}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
}

/// A master found down by `ping` and restarted is not taken for down
/// when it later hangs: `ping` says it does not answer, as it says of a
/// master never down, and not that it refuses connections (the mark of
/// the first outage stayed, where no decision had the masters probed
/// again, and every ping after the first said so).
#[test]
fn ping_says_a_master_that_hangs_after_a_restart_does_not_answer() {
    let mut cluster = RedisCluster::start();
    let port = cluster.nodes()[1].port();
    let rt = common::runtime();
    let store = ready_store(&cluster, &rt, "hang-after-restart");
    cluster.kill_node(1);
    let refused = format!("(127.0.0.1:{port}) refuses connections (it is down)");
    rt.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let e = store.ping().await.expect_err("a master is down");
            if e.detail().contains(&refused) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the killed master not named: {e}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    cluster.restart_node(1);
    rt.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(30);
        while let Err(e) = store.ping().await {
            assert!(
                Instant::now() < deadline,
                "not ready 30 s after the restart: {e}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    cluster.nodes()[1].pause();
    // Spaced past the store's one new connection a second, as readiness
    // probes are.
    for _ in 0..4 {
        let e = rt.block_on(store.ping()).expect_err("a master hangs");
        assert!(!e.detail().contains("refuses connections"), "{e}");
        assert!(
            e.is_timeout() || e.detail().contains("no master answered CLUSTER SLOTS"),
            "{e}"
        );
        std::thread::sleep(Duration::from_millis(1_100));
    }
    cluster.nodes()[1].resume();
}

/// A master restarted from its `nodes.conf` answers at once, but refuses
/// its keys (`CLUSTERDOWN`) until the cluster takes it back: `ping` is not
/// ready until then, so once it is, every key decides.
#[test]
fn ping_is_not_ready_while_a_restarted_master_refuses_its_keys() {
    let mut cluster = RedisCluster::start();
    let rt = common::runtime();
    let store = ready_store(&cluster, &rt, "restart");
    cluster.restart_node(0);
    let deadline = Instant::now() + Duration::from_secs(30);
    while let Err(e) = rt.block_on(store.ping()) {
        assert!(
            Instant::now() < deadline,
            "not ready 30 s after the restart: {e}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // A master that takes its keys back never refuses them again unless
    // it fails anew: what ping saw holds for the decisions after it.
    rt.block_on(every_key_decided(&store, "ready, but"));
}

/// After a failover, with no decision to send the client a `MOVED`, `ping`
/// still finds the new master: a master answered for by another node makes
/// the store read the slot map afresh, and pings are then ready, every one.
#[test]
fn ping_is_ready_again_after_a_failover_without_decisions() {
    let mut cluster = RedisCluster::start_with_replicas(1000);
    let replica = cluster
        .replica_of(0, 1)
        .expect("the first master has a replica");
    let rt = common::runtime();
    let store = ready_store(&cluster, &rt, "failover-ping");
    cluster.kill_node(0);
    assert!(
        cluster.wait_until_master(replica, Duration::from_secs(20)),
        "the replica was not promoted"
    );
    // Ready within a few seconds, then five pings in a row: a ping that
    // got through only when a fallback node happened to be the new master
    // would not pass five times running.
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut in_a_row = 0;
    while in_a_row < 5 {
        match rt.block_on(store.ping()) {
            Ok(()) => in_a_row += 1,
            Err(e) => {
                in_a_row = 0;
                assert!(
                    Instant::now() < deadline,
                    "not ready 15 s after the failover: {e}"
                );
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The error of a `ping` that must fail, past up to four timeouts: on a
/// busy machine a healthy master's answer can miss the 200 ms, and the
/// failure under test is another.
fn ping_failure(store: &RedisStore, rt: &tokio::runtime::Runtime) -> StoreError {
    for _ in 0..4 {
        match rt.block_on(store.ping()) {
            Err(e) if e.kind() == StoreErrorKind::Timeout => continue,
            result => return result.expect_err("ping fails"),
        }
    }
    rt.block_on(store.ping()).expect_err("ping fails")
}

/// A master that answers but refuses every decision (out of memory) makes
/// the cluster unready, named, as one node would be; the checks' keys are
/// deleted.
#[test]
fn ping_is_not_ready_while_a_master_refuses_every_decision() {
    let cluster = RedisCluster::start();
    let rt = common::runtime();
    let store = ready_store(&cluster, &rt, "full-master");
    let full = &cluster.nodes()[1];
    assert_eq!(full.cli(&["CONFIG", "SET", "maxmemory", "1"]).trim(), "OK");
    let err = ping_failure(&store, &rt);
    assert_eq!(err.kind(), StoreErrorKind::Backend, "{err}");
    assert!(err.detail().contains("out of memory"), "{err}");
    assert!(
        err.detail()
            .contains(&format!("(127.0.0.1:{})", full.port())),
        "{err}"
    );
    assert_eq!(full.cli(&["CONFIG", "SET", "maxmemory", "0"]).trim(), "OK");
    let deadline = Instant::now() + Duration::from_secs(10);
    while let Err(e) = rt.block_on(store.ping()) {
        assert!(
            e.kind() == StoreErrorKind::Timeout && Instant::now() < deadline,
            "ready again once it takes writes: {e}"
        );
    }
    for node in cluster.nodes() {
        assert_eq!(node.cli(&["DBSIZE"]).trim(), "0", "{}", node.port());
    }
}

/// A cluster that does not require full coverage stays `cluster_state:ok`
/// with a slot no master serves: `ping` is not ready, since that slot's
/// keys cannot be decided.
#[test]
fn ping_is_not_ready_while_a_slot_has_no_master() {
    let cluster = RedisCluster::start();
    let rt = common::runtime();
    let store = ready_store(&cluster, &rt, "coverage");
    for node in cluster.nodes() {
        node.cli(&["CONFIG", "SET", "cluster-require-full-coverage", "no"]);
        node.cli(&["CLUSTER", "DELSLOTS", "0"]);
    }
    let err = ping_failure(&store, &rt);
    assert_eq!(err.kind(), StoreErrorKind::ConnectionDropped, "{err}");
    assert!(
        err.detail().contains("assigns 16383 of the 16384 slots"),
        "{err}"
    );
}

/// On a cluster, a batch's timeout is per request: with one master frozen,
/// its keys time out and the other masters' keys keep their decisions,
/// all within the batch's time; a request said not to have been sent was
/// not applied.
#[test]
fn a_hung_master_costs_a_batch_its_own_keys_only() {
    let cluster = RedisCluster::start();
    let rt = common::runtime();
    // Every call at one caller's time, half an hour into an hour's window:
    // on Redis's clock a window edge could fall between the batches, and
    // just after one the previous window's count, weighted and rounded
    // down, counts one less, so the counts checked below would be off.
    let config = PolicyConfig::new(PolicyKind::SlidingWindowCounter, 100, 3_600_000);
    let now_ms = Some(1_800_000);
    let limit = config.limit;
    let options = options("hung-batch");
    // The healthy batch goes through a store of the same keys with a long
    // timeout: on a busy machine a healthy master can miss 200 ms, and a
    // retry would change the counts checked below.
    let patient = RedisOptions {
        timeout_ms: 10_000,
        ..options.clone()
    };
    let url = cluster.url();
    let (store, patient) = rt.block_on(async {
        let connect = |options| RedisStore::connect(&url, config, options);
        let store = connect(options).await.expect("connect");
        (store, connect(patient).await.expect("connect"))
    });
    // Each key twice: a key's second request waits for its first.
    let keys = KEYS as usize;
    let requests: Vec<(u64, u64)> = (0..KEYS).chain(0..KEYS).map(|key| (key, 1)).collect();
    let healthy = rt
        .block_on(patient.decide_many(&requests, now_ms))
        .expect("a healthy cluster takes the batch");
    assert!(healthy.iter().all(Result::is_ok), "{healthy:?}");

    cluster.nodes()[0].pause();
    let started = Instant::now();
    let results = rt.block_on(store.decide_many(&requests, now_ms));
    let elapsed = started.elapsed();
    cluster.nodes()[0].resume();
    let results = results.expect("a hung master fails requests, not the batch");
    assert!(
        elapsed < Duration::from_millis(TIMEOUT_MS) + MARGIN,
        "{elapsed:?}"
    );
    let is_timeout = |e: &StoreError, what: &str| {
        e.kind() == StoreErrorKind::Timeout && e.detail().contains(what)
    };
    let (mut decided, mut sent_unanswered) = (0, Vec::new());
    for key in 0..keys {
        match (&results[key], &results[key + keys]) {
            // The second request of a key sees its first.
            (Ok(first), Ok(second)) => {
                assert_eq!(
                    (first.remaining, second.remaining),
                    (limit - 3, limit - 4),
                    "key {key}"
                );
                decided += 1;
            }
            // A healthy master slow past the deadline on the second.
            (Ok(first), Err(e)) => {
                assert_eq!(first.remaining, limit - 3, "key {key}");
                assert_eq!(e.kind(), StoreErrorKind::Timeout, "key {key}: {e}");
            }
            // Once the first took the batch's time, the second never goes.
            (Err(first), Err(second)) => {
                assert!(is_timeout(second, "it was not sent"), "key {key}: {second}");
                if is_timeout(first, "may or may not have been applied") {
                    sent_unanswered.push(key as u64);
                } else {
                    assert!(is_timeout(first, "it was not sent"), "key {key}: {first}");
                }
            }
            (Err(first), Ok(_)) => panic!("key {key}: decided after its first failed ({first})"),
        }
    }
    // Three masters, about a third of the keys each.
    assert!(decided > 0, "no key of a healthy master was decided");
    assert!(
        !sent_unanswered.is_empty(),
        "no key of the frozen master timed out"
    );
    // Thawed, the frozen master runs what reached it: each such key's
    // first request, which may or may not have been applied, and never
    // its second, which was not sent.
    rt.block_on(async {
        for key in sent_unanswered {
            let deadline = Instant::now() + Duration::from_secs(10);
            let peek = loop {
                match store.decide(key, now_ms, 0).await {
                    Ok(d) => break d,
                    Err(e) => assert!(Instant::now() < deadline, "key {key}: {e}"),
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            };
            assert!(
                peek.remaining >= limit - 3,
                "key {key}: a request said not to have been sent was applied ({peek:?})"
            );
        }
    });
}

/// Connecting while a master hangs fails within the connect time, saying
/// what failed and how to find the node: the check's timeout names none.
/// (The check decides on one key, so it meets the hung master only when
/// the key's slot is there: the prefix is chosen so that it is.)
#[test]
fn connecting_while_a_master_hangs_says_how_to_find_it() {
    let cluster = RedisCluster::start();
    let (options, _) = options_with_check_key_on(&cluster, 1, "hung-at-connect");
    cluster.nodes()[1].pause();
    let rt = common::runtime();
    let started = Instant::now();
    let connected = rt.block_on(RedisStore::connect(&cluster.url(), REFERENCE, options));
    let took = started.elapsed();
    cluster.nodes()[1].resume();
    let e = connected.expect_err("the check key's master hangs");
    assert!(
        took < Duration::from_millis(2_000) + MARGIN,
        "{took:?}: {e}"
    );
    let message = e.to_string();
    assert!(
        message.contains(
            "failed: timed out; a master that does not answer (a hung node) does \
             this: redis-cli --cluster check HOST:PORT shows which"
        ),
        "{message}"
    );
}

/// A master and its replica hung: the other masters then report
/// `cluster_state:fail`, and readiness names the master that does not
/// answer, not the first healthy one that says the cluster is down.
#[test]
fn readiness_names_the_hung_master_not_those_reporting_the_cluster_down() {
    let cluster = RedisCluster::start_with_replicas(1000);
    let replica = cluster
        .replica_of(0, 1)
        .expect("the first master has a replica");
    let rt = common::runtime();
    let store = ready_store(&cluster, &rt, "hung-pair");
    cluster.nodes()[0].pause();
    cluster.nodes()[replica].pause();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !cluster.nodes()[1]
        .cli(&["CLUSTER", "INFO"])
        .contains("cluster_state:fail")
    {
        assert!(
            Instant::now() < deadline,
            "the cluster did not see the pair fail"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let e = rt.block_on(store.ping()).unwrap_err();
    cluster.nodes()[0].resume();
    cluster.nodes()[replica].resume();
    let hung = format!("127.0.0.1:{})", cluster.nodes()[0].port());
    let message = e.to_string();
    assert!(
        message.contains("did not answer") && message.contains(&hung),
        "{message}"
    );
    assert!(!message.contains("cluster_state"), "{message}");
}

/// The script is loaded on the masters only, which decide: a replica that
/// is down stops neither a store made for another configuration nor the
/// calls on masters that lost the script; and those calls send its text
/// (`EVAL`) to their own master, once per master or so, not each to every
/// node.
#[test]
fn scripts_go_to_masters_only_and_once_after_a_flush() {
    let (mut cluster, replica, rt, store) = replicated_cluster(15_000, "masters-only");
    cluster.kill_node(replica);
    let config = PolicyConfig::new(PolicyKind::FixedWindow, 100, 60_000);
    let other = rt
        .block_on(store.with_config(config, common::fresh_prefix("masters-only-other")))
        .expect("a replica down does not stop a new store");
    let live: Vec<usize> = (0..cluster.nodes().len())
        .filter(|&i| i != replica)
        .collect();
    for &i in &live {
        let node = &cluster.nodes()[i];
        // At connect and by with_config, on masters only (a load that
        // timed out on a busy machine is tried again: at least twice).
        let loads = common::command_calls(node, "script|load");
        if cluster.is_master(i) {
            assert!(loads >= 2, "master {i}: {loads} loads");
        } else {
            assert_eq!(loads, 0, "replica {i}");
        }
        if cluster.is_master(i) {
            assert_eq!(node.cli(&["SCRIPT", "FLUSH"]).trim(), "OK");
        }
        assert_eq!(node.cli(&["CONFIG", "RESETSTAT"]).trim(), "OK");
    }
    rt.block_on(every_key_decided(
        &other,
        "every key is decided after the flush",
    ));
    let sent: u64 = live
        .iter()
        .map(|&i| common::command_calls(&cluster.nodes()[i], "eval"))
        .sum();
    assert!(
        (1..=9).contains(&sent),
        "the text sent {sent} times for {KEYS} calls"
    );
    for &i in &live {
        assert_eq!(
            common::command_calls(&cluster.nodes()[i], "script|load"),
            0,
            "node {i}"
        );
    }
}

/// A lone call on a cluster that is only slow is answered, not given up:
/// with no other call answered for a quarter of its timeout, the store
/// probes the masters and makes a new connection, as for a connection
/// that stopped answering, but gives the call up only once that
/// connection is in place, and the masters answer its commands only after
/// the call, sent before them. Every master runs a script that keeps it
/// busy for 800 ms; the call, begun 100 ms in, has a 2 s timeout. A round
/// in which a script had not surely begun before the call (a busy machine
/// can start `redis-cli` late), or in which the call began so late that
/// the scripts may end less than 500 ms after it (a busy machine can
/// oversleep the 100 ms), proves nothing and is made again.
#[test]
fn a_lone_call_on_a_slow_cluster_is_answered_not_given_up() {
    let cluster = RedisCluster::start();
    let rt = common::runtime();
    let store = store_with_timeout(&cluster, &rt, "slow-lone-call", 2_000);
    // Busy for 800 ms by Redis's clock, then 1.
    let busy = "local s = redis.call('TIME') \
                local t0 = s[1] * 1000000 + s[2] \
                repeat local t = redis.call('TIME') \
                until t[1] * 1000000 + t[2] - t0 > 800000 \
                return 1";
    let mut rounds = 0;
    for attempt in 0..12 {
        if rounds == 3 {
            break;
        }
        let round = attempt;
        rt.block_on(store.decide(round, None, 1))
            .expect("a healthy cluster decides");
        let (answered, set_up) = std::thread::scope(|scope| {
            // No script begins before this, so none ends before 800 ms
            // after it.
            let spawned = Instant::now();
            let scripts: Vec<_> = (0..3)
                .map(|i| {
                    let node = &cluster.nodes()[i];
                    scope.spawn(move || {
                        let said = node.cli(&["EVAL", busy, "0"]);
                        (said, Instant::now())
                    })
                })
                .collect();
            std::thread::sleep(Duration::from_millis(100));
            let began = Instant::now();
            let result = rt.block_on(store.decide(round, None, 1));
            let took = began.elapsed();
            // The call waits for its master's script, which ends 800 ms or
            // more after `spawned`: at least 500 ms after the call began
            // only when it began within 300 ms of `spawned`.
            let mut set_up = began.duration_since(spawned) <= Duration::from_millis(300);
            // Each script ran 800 ms and ended before its redis-cli did:
            // one whose redis-cli ended 800 ms or more after the call
            // began may have begun after it.
            for script in scripts {
                let (said, ended) = script.join().expect("script");
                assert_eq!(said.trim(), "1");
                set_up &= ended.duration_since(began) < Duration::from_millis(800);
            }
            ((result, took), set_up)
        });
        if !set_up {
            continue;
        }
        rounds += 1;
        match answered {
            // Past the quarter (0.5 s): the store looked and did not give
            // the call up.
            (Ok(_), took) => assert!(
                took >= Duration::from_millis(500),
                "round {round}: {took:?}"
            ),
            (Err(e), took) => panic!("round {round}: a slow call failed after {took:?}: {e}"),
        }
    }
    assert_eq!(
        rounds, 3,
        "scripts that surely began before the call, in 12 tries"
    );
}

/// A master killed with no replica to take over costs its own keys only,
/// and those fail at once: their calls are not sent (a dropped connection
/// saying so), single or in a batch, and the other masters' keys are
/// decided, until it restarts, when every key is decided again. Before,
/// a round of calls that included its keys stalled the cluster connection
/// for every key (0 to 45 of the others decided per round), new
/// connections too, for as long as it stayed down.
#[test]
fn a_killed_master_without_a_replica_costs_only_its_own_keys() {
    let found = Duration::from_secs(1);
    a_master_down_costs_only_its_own_keys(RedisCluster::kill_node, found, "refuses connections");
}

/// The same when the master's host is gone: its port neither accepts nor
/// refuses connections, after its process died (so the connections to it
/// were closed first). Before, every other master's key timed out in every
/// round, for as long as the host stayed away: each call for the master's
/// slots had the client try to connect to it, and no new connection was
/// taken in place of the stalled one.
#[test]
fn a_master_whose_host_is_gone_costs_only_its_own_keys() {
    // Found after the first call's timeout (200 ms) and two probes of
    // 500 ms (a quarter of connect_timeout_ms), then a new connection.
    let found = Duration::from_millis(2_500);
    a_master_down_costs_only_its_own_keys(RedisCluster::kill_host, found, "could not be connected");
}

/// Takes node 0 (a master with no replica) down with `take_down` under
/// rounds of calls on 300 keys; from `found` on, for 3 s, checks that its
/// keys fail as not sent, their errors saying `why`, while the other
/// masters' keys are decided; then that a batch fails its keys the same
/// way, and that every key is decided again after it restarts.
fn a_master_down_costs_only_its_own_keys(
    take_down: fn(&mut RedisCluster, usize),
    found: Duration,
    why: &str,
) {
    const KEYS: u64 = 300;
    let mut cluster = RedisCluster::start();
    let rt = common::runtime();
    let tag = "down-master";
    let (store, batch_store) = rt.block_on(async {
        let url = cluster.url();
        let store = RedisStore::connect(&url, REFERENCE, options(tag))
            .await
            .expect("connect");
        // The same keys on the same connection, for the batch.
        let prefix = store.options().prefix.clone();
        let batch_store = store
            .with_config(REFERENCE, prefix)
            .await
            .expect("same keys");
        // Every key stored, so that node 0 lists all of its own: tried
        // again while calls time out (a busy machine can miss 200 ms).
        let mut tries = 0;
        while let Some(e) = failures_of(&store, KEYS).await.into_iter().next() {
            tries += 1;
            assert!(
                e.kind() == StoreErrorKind::Timeout && tries < 5,
                "a healthy cluster decides every key: {e}"
            );
        }
        (store, batch_store)
    });
    let on_node_0 = keys_on_node(&cluster, 0);
    assert!(
        on_node_0.len() > 50 && on_node_0.len() < 150,
        "{} of {KEYS} keys on node 0",
        on_node_0.len()
    );
    take_down(&mut cluster, 0);
    let killed = Instant::now();
    let mut rounds = 0;
    let mut rounds_with_others_failing = 0;
    while killed.elapsed() < found + Duration::from_secs(3) {
        let results = rt.block_on(futures_util::future::join_all(
            (0..KEYS).map(|k| store.decide(k, None, 1)),
        ));
        // Until `found`, the calls sent before the master was found down
        // stall the connection (one or two rounds here, for a killed
        // master).
        if killed.elapsed() < found {
            continue;
        }
        rounds += 1;
        let mut others_failed = false;
        for (key, result) in (0..KEYS).zip(&results) {
            match result {
                Err(e) if on_node_0.contains(&key) => {
                    assert_eq!(e.kind(), StoreErrorKind::ConnectionDropped, "{e}");
                    assert!(e.detail().contains("was not sent"), "{e}");
                    assert!(e.detail().contains(why), "{e}");
                }
                Ok(_) if on_node_0.contains(&key) => panic!("key {key} decided on a dead master"),
                // A busy machine can miss 200 ms now and then.
                Err(e) if e.kind() == StoreErrorKind::Timeout => others_failed = true,
                Err(e) => panic!("key {key} of a master that is up: {e}"),
                Ok(_) => {}
            }
        }
        rounds_with_others_failing += u64::from(others_failed);
        std::thread::sleep(Duration::from_millis(100));
    }
    // Before, the other masters' keys failed in every round; now in none
    // on a quiet machine.
    assert!(rounds >= 5, "only {rounds} rounds in 3 s");
    assert!(
        rounds_with_others_failing <= rounds / 4,
        "the other masters' keys failed in {rounds_with_others_failing} rounds of {rounds}"
    );
    // A batch: the dead master's keys not sent (not waiting out the
    // batch's time), the others' decided.
    let requests = batch(KEYS);
    let results = rt
        .block_on(batch_store.decide_many(&requests, None))
        .expect("batch");
    let mut others_decided = 0;
    for (&(key, _), result) in requests.iter().zip(&results) {
        match result {
            Err(e) if on_node_0.contains(&key) => {
                assert_eq!(e.kind(), StoreErrorKind::ConnectionDropped, "{e}");
                assert!(e.detail().contains(why), "{e}");
            }
            Ok(_) if on_node_0.contains(&key) => panic!("key {key} decided on a dead master"),
            // 200 ms for the whole batch: a busy machine can miss it.
            Err(e) => assert_eq!(e.kind(), StoreErrorKind::Timeout, "key {key}: {e}"),
            Ok(_) => others_decided += 1,
        }
    }
    assert!(
        others_decided > 0,
        "none of the other masters' keys was decided in a batch"
    );
    // Restarted, it is sent its keys again (the cluster refuses them
    // until it has taken the node back).
    cluster.restart_node(0);
    let restarted = Instant::now();
    rt.block_on(async {
        loop {
            let failed = failures_of(&store, KEYS).await;
            if failed.is_empty() {
                break;
            }
            assert!(
                restarted.elapsed() < Duration::from_secs(20),
                "{} of {KEYS} still failed 20 s after the restart, one with {}",
                failed.len(),
                failed[0]
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
}
