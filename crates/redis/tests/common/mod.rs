//! Shared by the integration tests: vector files, store construction, and
//! a runtime.

#![allow(dead_code)]

pub mod cluster;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use ratewarden_core::vectors::{self, Case};
use ratewarden_core::PolicyConfig;
use ratewarden_redis::{RedisOptions, RedisStore};

/// The repository's vector files (`vectors/**/*.json`).
pub fn vector_files() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../vectors");
    let mut out = Vec::new();
    collect(&root, &mut out);
    out.sort();
    assert!(!out.is_empty(), "no vector files under {}", root.display());
    out
}

fn collect(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read vectors directory") {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            collect(&path, out);
        } else if path.extension().is_some_and(|x| x == "json") {
            out.push(path);
        }
    }
}

/// Every case of every vector file, with the file it came from.
pub fn all_cases() -> Vec<(PathBuf, Case)> {
    let mut cases = Vec::new();
    for path in vector_files() {
        let text = std::fs::read_to_string(&path).expect("read vector file");
        let file = vectors::parse(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        cases.extend(file.cases.into_iter().map(|c| (path.clone(), c)));
    }
    cases
}

/// A prefix no other test in this process uses.
pub fn fresh_prefix(tag: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!(
        "t{}-{tag}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// Options for decision tests: caller time, a grace that outlives the
/// test (the traces' times are not Redis's), and a timeout generous enough
/// for a loaded machine (timeouts are tested separately).
pub fn exact_options(tag: &str) -> RedisOptions {
    RedisOptions {
        prefix: fresh_prefix(tag),
        timeout_ms: 10_000,
        connect_timeout_ms: 10_000,
        ttl_grace_ms: 600_000,
        ..RedisOptions::default()
    }
}

pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

pub async fn store(url: &str, config: PolicyConfig, tag: &str) -> RedisStore {
    RedisStore::connect(url, config, exact_options(tag))
        .await
        .expect("connect to the test Redis")
}

/// The calls of `command` in a server's `INFO commandstats`
/// (`cmdstat_<command>:calls=N,...`; 0 when the command never ran).
pub fn command_calls(server: &ratewarden_redis::test_support::RedisServer, command: &str) -> u64 {
    let stats = server.cli(&["INFO", "commandstats"]);
    let prefix = format!("cmdstat_{command}:calls=");
    stats
        .lines()
        .find_map(|line| line.strip_prefix(&prefix))
        .map_or(0, |rest| {
            rest.split(',').next().unwrap().parse().expect("calls")
        })
}

/// A connection for a test's own commands, with no response timeout:
/// redis-rs sets 500 ms by default, which a loaded machine can miss.
pub async fn plain_connection(url: &str) -> redis::aio::MultiplexedConnection {
    let config = redis::AsyncConnectionConfig::new().set_response_timeout(None);
    redis::Client::open(url)
        .expect("a Redis URL")
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .expect("connect")
}
