//! The memory store under many threads: per-key decisions are
//! linearizable, so N threads hammering one key admit exactly what one
//! thread would, and their `remaining` values are exactly the ones a single
//! thread would see, each once.

use std::collections::HashMap;
use std::sync::{Arc, Barrier};
use std::thread;

use ratewarden_core::{MemoryOptions, MemoryStore, PolicyConfig, PolicyKind};

const THREADS: usize = 8;

/// Every thread sends `per_thread` requests of cost 1 at one instant; the
/// decisions must be those of some serial order.
fn hammer(config: PolicyConfig, keys: u64, per_thread: u64) {
    let store = MemoryStore::for_config(&config, MemoryOptions::default()).unwrap();
    let barrier = Arc::new(Barrier::new(THREADS));
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let (store, barrier) = (store.clone(), Arc::clone(&barrier));
            thread::spawn(move || {
                barrier.wait();
                let mut seen = Vec::new();
                for i in 0..per_thread {
                    let key = (i + t as u64) % keys;
                    let d = store.decide(key, 5_000, 1).unwrap();
                    seen.push((key, d));
                }
                seen
            })
        })
        .collect();
    let mut admitted: HashMap<u64, Vec<u64>> = HashMap::new();
    let mut refused = 0u64;
    for h in handles {
        for (key, d) in h.join().unwrap() {
            if d.allowed {
                admitted.entry(key).or_default().push(d.remaining);
            } else {
                assert_eq!(d.remaining, 0, "{config}: a refusal left budget");
                refused += 1;
            }
        }
    }
    let limit = config.effective_burst().min(config.limit);
    for key in 0..keys {
        let mut remaining = admitted.remove(&key).unwrap_or_default();
        remaining.sort_unstable();
        let serial: Vec<u64> = (0..limit).collect();
        assert_eq!(
            remaining, serial,
            "{config}: key {key} is not a serial history"
        );
    }
    assert_eq!(
        refused,
        THREADS as u64 * per_thread - keys * limit,
        "{config}"
    );
}

#[test]
fn one_hot_key_admits_exactly_the_limit_under_every_policy() {
    for policy in PolicyKind::ALL {
        hammer(PolicyConfig::new(policy, 1000, 60_000), 1, 2000);
    }
}

#[test]
fn many_keys_at_once_each_admit_exactly_the_limit() {
    for policy in PolicyKind::ALL {
        hammer(PolicyConfig::new(policy, 50, 60_000), 64, 2000);
    }
}
