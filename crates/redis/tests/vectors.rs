//! Every vector file passes on one Redis node and on a 3-master Redis
//! Cluster, with caller-supplied time, each case under its own prefix.

mod common;

use ratewarden_core::vectors::{run_case, CaseOutcome};
use ratewarden_redis::test_support::{RedisCluster, RedisServer};

fn run_all(url: &str) -> usize {
    let rt = common::runtime();
    let cases = common::all_cases();
    let mut failures = Vec::new();
    for (path, case) in &cases {
        let store = rt.block_on(common::store(url, case.config, "vec"));
        let outcome = run_case(case, |key, now_ms, cost| {
            rt.block_on(store.decide(key, Some(now_ms), cost))
        });
        if outcome != CaseOutcome::Passed {
            failures.push(format!(
                "{} {:?} ({}): {outcome:?}",
                path.display(),
                case.description,
                case.config
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
    cases.len()
}

#[test]
fn all_vectors_pass_on_one_node() {
    let server = RedisServer::start();
    assert!(run_all(&server.url()) > 100);
    assert_eq!(server.keys_without_ttl(), Vec::<String>::new());
}

#[test]
fn all_vectors_pass_on_a_cluster() {
    let cluster = RedisCluster::start();
    assert!(run_all(&cluster.url()) > 100);
    assert_eq!(cluster.keys_without_ttl(), Vec::<String>::new());
}
