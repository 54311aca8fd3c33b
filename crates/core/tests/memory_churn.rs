//! The memory store while its tables change shape under racing threads:
//! growing, shrinking, forgetting keys (by `forget_idle` and by a full
//! shard making room) and turning wide. A store that decides known keys
//! without the shard's lock must still count every request exactly once
//! while the key's slot is moved, dropped or copied into a wide table; an
//! update made to a copy that the table no longer holds is lost, and one
//! applied twice is counted twice.
//!
//! Every test runs in rounds separated by a barrier. Within a round all
//! requests for one key are identical (one `now_ms`, one cost), so every
//! serial order of them gives the same multiset of decisions: the threads'
//! decisions for each key and round must be exactly the multiset a serial
//! replay on the bare policy gives. A lost update shows as one admission
//! too many, a doubled one as a `remaining` seen twice, a decision on a
//! forgotten or stale copy as a refusal the replay does not make.

use std::panic::{self, AssertUnwindSafe};
use std::sync::{Barrier, Mutex};
use std::thread;

use ratewarden_core::policy::Policy;
use ratewarden_core::registry::AnyState;
use ratewarden_core::{Decision, MemoryOptions, MemoryStore, PolicyConfig, PolicyKind, MAX_SAFE};

/// How many times as often the narrowest races are tried in an optimized
/// build: each try is shorter there, so less likely to meet the race, and
/// cheaper.
const TRIES: usize = if cfg!(debug_assertions) { 1 } else { 4 };

/// What `entries_tracked` must be at the end of each round, when every
/// thread waits.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Tracked {
    /// Every key ever requested: nothing can be forgotten.
    Every,
    /// Exactly the keys of the round just ended: a full shard forgot the
    /// rest to make room.
    ThisRound,
    /// After a sweep of every shard at the round's time, exactly the keys
    /// whose serial state is not forgettable then.
    AfterSweep,
}

/// Who calls `forget_idle` during a round, at the round's time.
#[derive(Clone, Copy)]
enum Forget {
    Never,
    /// Each decider, every `every` requests from its `t`-th (threads
    /// take turns), with this bound: shards are swept while the other
    /// threads decide their keys, from early in the round on, when most
    /// keys are not yet decided in it and may be forgettable.
    Every {
        every: usize,
        bound: usize,
    },
}

/// Racing rounds on one store.
struct Plan<'a> {
    config: PolicyConfig,
    options: MemoryOptions,
    /// Keys `0..keys` by index; see [`key_of`].
    keys: usize,
    /// `now_ms` of each round, at which `forget_idle` is called...
    times: Vec<u64>,
    /// ...and how much later key `k`'s requests come in round `r`, as
    /// `later(r, k)`.
    later: &'a (dyn Fn(usize, usize) -> u64 + Sync),
    /// Threads deciding.
    threads: usize,
    /// Each thread shuffles its requests, its own way, within runs of
    /// this many (in key order); `usize::MAX` shuffles them all.
    spread: usize,
    /// How many requests thread `t` sends for key `k` in round `r`, as
    /// `requests(r, k, t)`.
    requests: &'a (dyn Fn(usize, usize, usize) -> usize + Sync),
    /// The cost of every request for key `k` in round `r`, as `cost(r, k)`.
    cost: &'a (dyn Fn(usize, usize) -> u64 + Sync),
    forget: Forget,
    tracked: Tracked,
}

/// Spreads indices over the whole key space (key 0 included: a table may
/// treat it apart), so keys land in every shard and slot.
fn key_of(index: usize) -> u64 {
    (index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// SplitMix64's finalizer: the plans' per-(round, key) choices.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn mix2(round: usize, key: usize) -> u64 {
    mix(((round as u64) << 40) ^ key as u64)
}

/// Orders decisions so that equal multisets sort equal.
fn order(d: &Decision) -> (bool, u64, Option<u64>) {
    (d.allowed, d.remaining, d.retry_after_ms)
}

/// Thread `t`'s requests of round `r`, as key indices, in an order of its
/// own (a xorshift-driven shuffle), so threads meet on keys at different
/// moments and a table grows or shrinks under requests for every key.
fn schedule(plan: &Plan, round: usize, thread: usize) -> Vec<u32> {
    let mut mine = Vec::new();
    for k in 0..plan.keys {
        for _ in 0..(plan.requests)(round, k, thread) {
            mine.push(k as u32);
        }
    }
    let mut x = mix2(round, thread) | 1;
    for run in mine.chunks_mut(plan.spread) {
        for i in (1..run.len()).rev() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            run.swap(i, (x % (i as u64 + 1)) as usize);
        }
    }
    mine
}

/// Runs `f`, turning an error or a panic into a message, so that a
/// failing thread still keeps to the barrier protocol: a thread that left
/// it would leave the others waiting for ever instead of failing.
fn guarded<T, E: std::fmt::Display>(f: impl FnOnce() -> Result<T, E>) -> Result<T, String> {
    match panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(e.to_string()),
        Err(payload) => Err(payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "a panic".into())),
    }
}

/// Runs `plan` and checks every round's decisions against a serial replay,
/// the keys tracked after every round, and a final peek at every key of
/// the last round.
fn run(plan: &Plan) {
    // One plan at a time: the races need the machine's cores for their
    // own threads, and two plans sharing them mostly take turns.
    static ALONE: Mutex<()> = Mutex::new(());
    let _alone = ALONE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let config = plan.config;
    let store = MemoryStore::for_config(&config, plan.options).unwrap();
    let rounds = plan.times.len();
    // The main thread is a party too: it checks the store between rounds,
    // while every other thread waits.
    let barrier = Barrier::new(plan.threads + 1);
    let failures = Mutex::new(Vec::new());
    let policy = config.build().unwrap();
    let mut serial: Vec<Option<AnyState>> = vec![None; plan.keys];
    let mut expected: Vec<Vec<(u32, Decision)>> = Vec::with_capacity(rounds);
    let mut seen: Vec<Vec<(u32, Decision)>> = vec![Vec::new(); rounds];
    thread::scope(|scope| {
        let deciders: Vec<_> = (0..plan.threads)
            .map(|t| {
                let (store, barrier, failures) = (&store, &barrier, &failures);
                scope.spawn(move || {
                    let mut mine = Vec::with_capacity(rounds);
                    for (round, &now) in plan.times.iter().enumerate() {
                        let requests = schedule(plan, round, t);
                        let mut decided = Vec::with_capacity(requests.len());
                        barrier.wait();
                        for (i, k) in requests.into_iter().enumerate() {
                            if let Forget::Every { every, bound } = plan.forget {
                                if i % every == t % every {
                                    let swept =
                                        guarded(|| Ok::<_, String>(store.forget_idle(now, bound)));
                                    if let Err(e) = swept {
                                        failures.lock().unwrap().push(format!(
                                            "forget_idle in round {round} at {now} ms: {e}"
                                        ));
                                        break;
                                    }
                                }
                            }
                            let cost = (plan.cost)(round, k as usize);
                            let now = now + (plan.later)(round, k as usize);
                            match guarded(|| store.decide(key_of(k as usize), now, cost)) {
                                Ok(d) => decided.push((k, d)),
                                Err(e) => {
                                    failures.lock().unwrap().push(format!(
                                        "round {round} at {now} ms, key #{k}, cost {cost}: {e}"
                                    ));
                                    break;
                                }
                            }
                        }
                        barrier.wait();
                        mine.push(decided);
                    }
                    mine
                })
            })
            .collect();
        for (round, &now) in plan.times.iter().enumerate() {
            barrier.wait();
            barrier.wait();
            let mut replay = Vec::new();
            let mut in_round = 0;
            for (k, state) in serial.iter_mut().enumerate() {
                let n: usize = (0..plan.threads)
                    .map(|t| (plan.requests)(round, k, t))
                    .sum();
                if n == 0 {
                    continue;
                }
                in_round += 1;
                let cost = (plan.cost)(round, k);
                let now = now + (plan.later)(round, k);
                let state = state.get_or_insert_with(|| policy.new_state(now));
                for _ in 0..n {
                    replay.push((k as u32, policy.decide(state, now, cost)));
                }
            }
            expected.push(replay);
            let wanted = match plan.tracked {
                Tracked::Every => serial.iter().flatten().count(),
                Tracked::ThisRound => in_round,
                Tracked::AfterSweep => serial
                    .iter()
                    .flatten()
                    .filter(|s| !policy.is_forgettable(s, now))
                    .count(),
            };
            let tracked = guarded(|| {
                if plan.tracked == Tracked::AfterSweep {
                    store.forget_idle(now, usize::MAX);
                }
                Ok::<_, String>(store.entries_tracked())
            });
            if tracked != Ok(wanted) {
                failures.lock().unwrap().push(format!(
                    "keys tracked after round {round} at {now} ms: {tracked:?}, not {wanted}"
                ));
            }
        }
        for h in deciders {
            for (round, decided) in h.join().unwrap().into_iter().enumerate() {
                seen[round].extend(decided);
            }
        }
    });
    let failures = failures.into_inner().unwrap();
    assert!(failures.is_empty(), "{config}:\n{}", failures.join("\n"));
    let (mut admitted, mut refused) = (0usize, 0usize);
    for (round, (mut seen, mut expected)) in seen.into_iter().zip(expected).enumerate() {
        admitted += expected.iter().filter(|(_, d)| d.allowed).count();
        refused += expected.iter().filter(|(_, d)| !d.allowed).count();
        seen.sort_unstable_by_key(|(k, d)| (*k, order(d)));
        expected.sort_unstable_by_key(|(k, d)| (*k, order(d)));
        if seen != expected {
            let at = seen
                .iter()
                .zip(&expected)
                .position(|(a, b)| a != b)
                .unwrap_or(seen.len().min(expected.len()));
            let first = [seen.get(at), expected.get(at)]
                .into_iter()
                .flatten()
                .map(|(k, _)| *k)
                .min()
                .unwrap();
            let now = plan.times[round] + (plan.later)(round, first as usize);
            let of = |all: &[(u32, Decision)]| -> Vec<Decision> {
                all.iter()
                    .filter(|(k, _)| *k == first)
                    .map(|(_, d)| *d)
                    .collect()
            };
            panic!(
                "{config}: round {round} at {now} ms, key #{first}: the threads decided\n{:?}\n\
                 where a serial replay decides\n{:?}",
                of(&seen),
                of(&expected)
            );
        }
    }
    // A plan that admits everything or nothing checks little.
    assert!(
        admitted > 0 && refused > 0,
        "{config}: {admitted} admitted, {refused} refused"
    );
    // A peek leaves every state as a serial history would have it.
    let last = rounds - 1;
    for (k, state) in serial.iter_mut().enumerate() {
        let now = plan.times[last] + (plan.later)(last, k);
        let touched = (0..plan.threads).any(|t| (plan.requests)(last, k, t) > 0);
        if let (true, Some(state)) = (touched, state) {
            let peek = store.decide(key_of(k), now, 0).unwrap();
            assert_eq!(
                peek,
                policy.decide(state, now, 0),
                "{config}: peek at key #{k} at {now} ms"
            );
        }
    }
}

/// A fresh store with two shards takes twenty thousand new keys from four
/// threads at one instant, each thread in an order of its own: every
/// shard's table grows many times while other threads decide keys it
/// already holds, and each key still admits exactly `min(limit, its
/// requests)` with the `remaining` values of a serial history, each once.
/// The threads shuffle only within runs of 64 keys, so they stay close
/// and meet on keys another has just added, when a growth is likeliest
/// to move a state under a decision.
#[test]
fn growing_tables_count_every_request_once() {
    const KEYS: usize = 20_000;
    const THREADS: usize = 4;
    // 0 to 3 requests per thread and key: 0 to 12 in all, around the
    // limit of 5, so some keys stay under it and most go over.
    let requests = |_: usize, k: usize, t: usize| (mix(k as u64) >> (8 * t)) as usize % 4;
    for policy in [
        PolicyKind::FixedWindow,
        PolicyKind::SlidingWindowCounter,
        PolicyKind::TokenBucket,
        PolicyKind::Gcra,
    ] {
        let plan = Plan {
            config: PolicyConfig::new(policy, 5, 1000),
            options: MemoryOptions {
                max_keys: 1 << 22,
                shards: 2,
            },
            keys: KEYS,
            times: vec![12_345],
            later: &|_, _| 0,
            threads: THREADS,
            spread: 64,
            requests: &requests,
            cost: &|_, _| 1,
            forget: Forget::Never,
            tracked: Tracked::Every,
        };
        run(&plan);
    }
}

/// Keys come and go over many rounds while each deciding thread, every
/// few hundred requests, forgets the idle keys of one shard: a key idle
/// since an earlier round is forgotten while another thread decides it,
/// a burst of keys is followed by a lull (the tables shrink) and a lull
/// by a burst (they grow again). Forgetting changes no decision, so
/// every round matches a serial replay that never forgets, and a full
/// sweep after each round leaves exactly the keys still counting.
#[test]
fn forgetting_while_deciding_loses_no_count() {
    const KEYS: usize = 2000;
    const ROUNDS: usize = 20;
    // Steps of 20 ms and more make every key of a 10 ms window
    // forgettable; the shorter ones leave some keys counting.
    let steps = [23, 3, 7, 11];
    let times: Vec<u64> = (0..ROUNDS)
        .scan(1_000, |now, r| {
            *now += steps[r % steps.len()];
            Some(*now)
        })
        .collect();
    // Rounds touch 7/8, 1/8 or half of the keys, out of step with the
    // time steps, and each key's membership is drawn anew each round.
    let requests = |r: usize, k: usize, t: usize| {
        let h = mix2(r, k);
        let share = [7, 1, 4][r % 3];
        if h % 8 >= share {
            0
        } else {
            (h >> (8 + 2 * t)) as usize % 3
        }
    };
    let cases = [
        (PolicyConfig::new(PolicyKind::FixedWindow, 3, 10), 1),
        (
            PolicyConfig::new(PolicyKind::SlidingWindowCounter, 3, 10),
            1,
        ),
        (PolicyConfig::new(PolicyKind::SlidingLog, 3, 10), 1),
        (PolicyConfig::new(PolicyKind::TokenBucket, 3, 10), 1),
        (PolicyConfig::new(PolicyKind::Gcra, 3, 10), 1),
        // No state packs at these times: forgetting from wide tables.
        (
            PolicyConfig::new(PolicyKind::SlidingWindowCounter, 1 << 30, 3),
            1 << 28,
        ),
    ];
    for (config, unit) in cases {
        let plan = Plan {
            config,
            options: MemoryOptions {
                max_keys: 1 << 22,
                shards: 4,
            },
            keys: KEYS,
            times: times.clone(),
            later: &|_, _| 0,
            threads: 4,
            spread: usize::MAX,
            requests: &requests,
            cost: &|r, k| unit * (1 + mix2(r, k) % 2),
            forget: Forget::Every {
                every: 256,
                bound: 1,
            },
            tracked: Tracked::AfterSweep,
        };
        run(&plan);
    }
}

/// One shard holding at most `max_keys` keys: each round brings new keys
/// to a shard full of keys idle since the round before, so the first new
/// key forgets them all while other threads are deciding some of them
/// again. Those decisions must land on the state the table keeps (a
/// fresh one, or the old one if it was decided before the sweep), and
/// after each round the shard holds exactly that round's keys.
#[test]
fn a_full_shard_forgets_while_deciding() {
    const ROUND_KEYS: usize = 512;
    const ROUNDS: usize = 16;
    // Half of each round's keys were in the round before, half are new.
    let first = |r: usize| r * ROUND_KEYS / 2;
    let requests = |r: usize, k: usize, t: usize| {
        if k < first(r) || k >= first(r) + ROUND_KEYS {
            return 0;
        }
        let h = mix2(r, k);
        // One thread at least asks for each of the round's keys.
        (h >> (8 + 2 * t)) as usize % 3 + usize::from(h % 4 == t as u64)
    };
    for policy in PolicyKind::ALL {
        let plan = Plan {
            config: PolicyConfig::new(policy, 3, 10),
            options: MemoryOptions {
                max_keys: ROUND_KEYS,
                shards: 1,
            },
            keys: first(ROUNDS) + ROUND_KEYS,
            // 25 ms apart: more than two windows, and more than a bucket
            // takes to refill, so every key of the round before is
            // forgettable under every policy.
            times: (0..ROUNDS as u64).map(|r| 100 + 25 * r).collect(),
            later: &|_, _| 0,
            threads: 4,
            spread: usize::MAX,
            requests: &requests,
            cost: &|r, k| 1 + mix2(r, k) % 2,
            forget: Forget::Never,
            tracked: Tracked::ThisRound,
        };
        run(&plan);
    }
}

/// Threads race on one shard's keys through the time at which their
/// states stop packing into 64 bits. In the widening round most keys are
/// decided just before that time, still packed, and a few, which every
/// thread reaches about halfway through its requests, just after it: the
/// first of those turns the whole shard wide in the middle of the round
/// while other threads decide the packed keys (for `gcra`, admissions
/// alone also carry a state past 2^64 mid-round). No decision
/// made on a packed copy may be lost in the copy, and every round,
/// before, during and after, matches a serial replay. Each fresh store
/// widens once, so the test takes many.
#[test]
fn widening_while_deciding_loses_no_count() {
    const STORES: usize = 16 * TRIES;
    const KEYS: usize = 256;
    const WIDENING_ROUND: usize = 3;
    // (configuration, the last time at which a state packs, the first at
    // which none does), checked below.
    let cases = [
        // 2 x 31 count bits leave 2 bits for the window's index: window 9
        // (index 3) packs, 12 not.
        (
            PolicyConfig::new(PolicyKind::SlidingWindowCounter, 1 << 30, 3),
            11,
            12,
        ),
        // 41 count bits leave 23 of time: the window from 2^23 - 4
        // packs, the next one (2^23 + 3) does not.
        (
            PolicyConfig::new(PolicyKind::FixedWindow, 1 << 40, 7),
            (1 << 23) - 1,
            (1 << 23) + 3,
        ),
        // A level of 52 bits, counted in units of gcd(2^47, 16) = 16,
        // takes 48 and leaves 16 of time.
        (
            PolicyConfig::new(PolicyKind::TokenBucket, 1 << 47, 16),
            65_535,
            65_536,
        ),
        // The scaled time passes 2^64 at 2048 ms; at 2047 ms three
        // admissions of an eighth of the limit carry a state past it.
        (PolicyConfig::new(PolicyKind::Gcra, MAX_SAFE, 3), 2047, 2048),
    ];
    // 0 to 2 requests per thread, key and round.
    let requests = |r: usize, k: usize, t: usize| (mix2(r, k) >> (2 * t)) as usize % 3;
    for (config, packs, wide) in cases {
        let policy = config.build().unwrap();
        let unit = config.limit / 8;
        let mut state = policy.new_state(packs);
        assert!(policy.decide(&mut state, packs, unit).allowed);
        assert!(policy.pack(&state).is_some(), "{config} at {packs} ms");
        policy.decide(&mut state, packs, unit);
        policy.decide(&mut state, wide, unit);
        assert!(policy.pack(&state).is_none(), "{config} at {wide} ms");
        if config.policy == PolicyKind::Gcra {
            let mut state = policy.new_state(packs);
            for _ in 0..3 {
                assert!(policy.decide(&mut state, packs, unit).allowed);
            }
            assert!(policy.pack(&state).is_none(), "{config} at {packs} ms");
        }
        let times: Vec<u64> = [packs.saturating_sub(5), packs - 3, packs - 1, packs]
            .into_iter()
            .chain([wide, wide + 1, wide + 4, wide + 9])
            .collect();
        assert_eq!(times[WIDENING_ROUND], packs);
        let later = |r: usize, k: usize| {
            if r == WIDENING_ROUND && (KEYS * 5 / 8..KEYS * 5 / 8 + 8).contains(&k) {
                wide - packs
            } else {
                0
            }
        };
        for _ in 0..STORES {
            let plan = Plan {
                config,
                options: MemoryOptions {
                    max_keys: 1 << 22,
                    shards: 1,
                },
                keys: KEYS,
                times: times.clone(),
                later: &later,
                threads: 4,
                // Shuffled only locally, so that every thread reaches
                // the late keys about halfway through, when all are
                // deciding.
                spread: 32,
                requests: &requests,
                // One to three eighths of the limit: a few admissions
                // per window, then refusals.
                cost: &|r, k| unit * (1 + (r + k) as u64 % 3),
                forget: Forget::Never,
                tracked: Tracked::Every,
            };
            run(&plan);
        }
    }
}

/// Every round starts in a new window, so every key is forgettable until
/// its first decision of the round, and the threads take turns sweeping
/// the one shard every few requests: a key's first decision races
/// another thread's sweep that may forget it. A decision that lands on
/// the forgotten state is lost, and the key admits once too often. The
/// race is narrow, so the rounds are small and many.
#[test]
fn a_key_forgotten_under_its_first_decision_keeps_it() {
    const KEYS: usize = 16;
    const ROUNDS: usize = 600 * TRIES;
    let requests = |r: usize, k: usize, t: usize| (mix2(r, k) >> (2 * t)) as usize % 3;
    for policy in [
        PolicyKind::FixedWindow,
        PolicyKind::SlidingWindowCounter,
        PolicyKind::TokenBucket,
        PolicyKind::Gcra,
    ] {
        let plan = Plan {
            config: PolicyConfig::new(policy, 3, 10),
            options: MemoryOptions {
                max_keys: 1 << 22,
                shards: 1,
            },
            keys: KEYS,
            // As in the full shard's test: 25 ms leaves every key of the
            // round before forgettable under every policy.
            times: (0..ROUNDS as u64).map(|r| 100 + 25 * r).collect(),
            later: &|_, _| 0,
            threads: 3,
            spread: usize::MAX,
            requests: &requests,
            cost: &|r, k| 1 + mix2(r, k) % 2,
            forget: Forget::Every {
                every: 4,
                bound: usize::MAX,
            },
            tracked: Tracked::AfterSweep,
        };
        run(&plan);
    }
}
