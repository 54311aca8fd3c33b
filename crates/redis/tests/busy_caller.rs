//! A call that Redis answers in time is decided, however long the caller's
//! runtime is kept from polling the call again: the call's command is
//! handed over at its first poll, and the connection is written and read
//! on a thread of its own, not by the caller's runtime.

mod common;

use std::time::Duration;

use ratewarden_core::{PolicyConfig, PolicyKind};
use ratewarden_redis::test_support::{RedisCluster, RedisServer};
use ratewarden_redis::{RedisOptions, RedisStore};

/// How many calls are started at once: past the 50 commands that redis-rs
/// lets one node's connection hold by default, and past the 100 of a
/// cluster connection's channel.
const CALLS: u64 = 300;

/// On a runtime of one thread, `CALLS` calls are started, each polled
/// once, then the thread is kept busy for three times their timeout (as a
/// server's runtime is by thousands of runnable tasks): each is decided by
/// the answer read meanwhile. Calls used to wait unsent for a place, or
/// their answers unread, until the runtime was free again, and then timed
/// out, Redis idle.
fn answered_while_the_caller_is_busy(url: &str) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let options = RedisOptions {
        timeout_ms: 100,
        ..common::exact_options("busy-caller")
    };
    rt.block_on(async {
        let config = PolicyConfig::new(PolicyKind::FixedWindow, 1_000, 60_000);
        let store = RedisStore::connect(url, config, options)
            .await
            .expect("connect to the test Redis");
        let calls: Vec<_> = (0..CALLS)
            .map(|key| {
                let store = store.clone();
                tokio::spawn(async move { store.decide(key, None, 1).await })
            })
            .collect();
        // The calls are polled once, in turn, before this task is again.
        tokio::task::yield_now().await;
        std::thread::sleep(Duration::from_millis(300));
        let mut failed = Vec::new();
        for (key, call) in calls.into_iter().enumerate() {
            match call.await.expect("the call's task") {
                Ok(decision) => assert!(decision.allowed, "key {key}: {decision:?}"),
                Err(e) => failed.push(format!("key {key}: {e}")),
            }
        }
        assert!(
            failed.is_empty(),
            "{} of {CALLS} calls failed, the first: {}",
            failed.len(),
            failed[0]
        );
    });
}

#[test]
fn a_node_answers_a_busy_caller() {
    let redis = RedisServer::start();
    answered_while_the_caller_is_busy(&redis.url());
}

#[test]
fn a_cluster_answers_a_busy_caller() {
    let cluster = RedisCluster::start();
    answered_while_the_caller_is_busy(&cluster.url());
}
