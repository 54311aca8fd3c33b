//! The memory store under many threads: per-key decisions are
//! linearizable, so N threads hammering one key admit exactly what one
//! thread would, and their `remaining` values are exactly the ones a single
//! thread would see, each once.

use std::collections::HashMap;
use std::sync::{Arc, Barrier};
use std::thread;

use ratewarden_core::policy::Policy;
use ratewarden_core::{Decision, MemoryOptions, MemoryStore, PolicyConfig, PolicyKind};

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

/// Threads race on one key through many milliseconds: every request of a
/// round is the same (key, now_ms, cost), so every serial order gives the
/// same multiset of decisions, and the threads' decisions must be exactly
/// that multiset, round by round. Refusals come from the lock-free paths
/// (the memo of a repeated request, the snapshot of an unchanged state)
/// while admissions and rolled windows take the lock, so this checks that
/// the three paths together stay linearizable.
#[test]
fn racing_rounds_decide_as_a_serial_replay() {
    const ROUNDS: usize = 120;
    const PER_THREAD: usize = 60;
    for policy in PolicyKind::ALL {
        let config = PolicyConfig::new(policy, 40, 50);
        let store = MemoryStore::for_config(&config, MemoryOptions::default()).unwrap();
        // Time changes between rounds, while every thread waits, so that
        // all requests of a round are alike: mostly by a varying step
        // forward, and every tenth round the clock steps back a little
        // (decided at the key's recorded time, which the lock-free paths
        // must not skip past).
        let times: Vec<u64> = (0..ROUNDS as u64)
            .map(|r| match r % 10 {
                9 => (r * 7).saturating_sub(9),
                _ => r * 7 + (r * r) % 5,
            })
            .collect();
        let cost = |round: usize| if round % 3 == 0 { 2 } else { 1 };
        let barrier = Barrier::new(THREADS);
        let mut seen: Vec<Vec<Decision>> = vec![Vec::new(); ROUNDS];
        thread::scope(|scope| {
            let handles: Vec<_> = (0..THREADS)
                .map(|_| {
                    let (store, barrier, times) = (store.clone(), &barrier, &times);
                    scope.spawn(move || {
                        let mut mine = vec![Vec::new(); ROUNDS];
                        for (round, &now) in times.iter().enumerate() {
                            barrier.wait();
                            for _ in 0..PER_THREAD {
                                mine[round].push(store.decide(3, now, cost(round)).unwrap());
                            }
                        }
                        mine
                    })
                })
                .collect();
            for h in handles {
                for (round, decisions) in h.join().unwrap().into_iter().enumerate() {
                    seen[round].extend(decisions);
                }
            }
        });
        let serial = config.build().unwrap();
        let mut state = serial.new_state(times[0]);
        for (round, &now) in times.iter().enumerate() {
            let mut expected: Vec<Decision> = (0..THREADS * PER_THREAD)
                .map(|_| serial.decide(&mut state, now, cost(round)))
                .collect();
            let key = |d: &Decision| (d.allowed, d.remaining, d.retry_after_ms);
            expected.sort_by_key(key);
            seen[round].sort_by_key(key);
            assert_eq!(seen[round], expected, "{config}: round {round} at {now} ms");
        }
    }
}
