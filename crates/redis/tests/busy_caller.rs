//! A call that Redis answers in time is decided, however long the caller's
//! runtime is kept from polling the call again: its command is handed to
//! a thread of the store's own at its first poll, and that thread writes
//! it, waits for a place in the connection's queue if need be, and reads
//! the reply.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ratewarden_core::{PolicyConfig, PolicyKind};
use ratewarden_redis::test_support::{RedisCluster, RedisServer};
use ratewarden_redis::{RedisOptions, RedisStore};

/// How many calls are started at once: past the 50 commands that redis-rs
/// lets one node's connection hold by default, and past the 100 of a
/// cluster connection's channel.
const CALLS: u64 = 300;

/// The calls' timeout: long enough that a loaded machine answers them all
/// within it.
const TIMEOUT: Duration = Duration::from_secs(1);

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
        timeout_ms: TIMEOUT.as_millis() as u64,
        ..common::exact_options("busy-caller")
    };
    rt.block_on(async {
        let config = PolicyConfig::new(PolicyKind::FixedWindow, 1_000, 60_000);
        let store = RedisStore::connect(url, config, options)
            .await
            .expect("connect to the test Redis");
        let started = Arc::new(AtomicU64::new(0));
        let calls: Vec<_> = (0..CALLS)
            .map(|key| {
                let (store, started) = (store.clone(), Arc::clone(&started));
                tokio::spawn(async move {
                    started.fetch_add(1, Ordering::Relaxed);
                    store.decide(key, None, 1).await
                })
            })
            .collect();
        // The runtime polls some 60 tasks between two polls of this one:
        // every call is polled once before the thread is kept busy.
        while started.load(Ordering::Relaxed) < CALLS {
            tokio::task::yield_now().await;
        }
        std::thread::sleep(3 * TIMEOUT);
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
