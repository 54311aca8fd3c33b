//! The project's vector files under `vectors/`: the generated ones are
//! reproduced here from the naive model with fixed seeds (so they can never
//! drift from it), and every file is run against the memory store.
//!
//! To rewrite the generated files after a deliberate change:
//! `RATEWARDEN_REGENERATE_VECTORS=1 cargo test -p ratewarden-core --test generated_vectors`.

mod common;

use std::path::{Path, PathBuf};

use common::naive::Naive;
use common::rng::Rng;
use ratewarden_core::vectors::{self, Case, CaseOutcome, Expected, Step, VectorFile, VectorKey};
use ratewarden_core::{mix32, MemoryOptions, MemoryStore, PolicyConfig, PolicyKind, MAX_SAFE};

fn vectors_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../vectors")
}

/// Requests of a case, before the model fills in what each must get.
type Script = Vec<(VectorKey, u64, u64)>;

fn expect(description: String, config: PolicyConfig, script: Script) -> Case {
    let mut model = Naive::new(config);
    let steps = script
        .into_iter()
        .map(|(key, now_ms, cost)| {
            let d = model.decide(key.resolve(), now_ms, cost);
            Step {
                key,
                now_ms,
                cost,
                expected: Expected::from(d),
            }
        })
        .collect();
    Case {
        description,
        config,
        steps,
    }
}

/// Scales of numbers a case is drawn from.
#[derive(Clone, Copy, Debug)]
enum Scale {
    Small,
    WallClock,
    Near2Pow53,
    /// Wall-clock numbers over dozens of keys, so that the stores hold
    /// many keys at once: the memory store's tables grow while earlier
    /// keys keep their states, and on Redis Cluster the keys spread over
    /// every master.
    ManyKeys,
}

fn draw_config(rng: &mut Rng, policy: PolicyKind, scale: Scale) -> PolicyConfig {
    let (limit, window_ms) = match scale {
        Scale::Small => (rng.range(0, 12), rng.range(1, 50)),
        Scale::WallClock => (
            *rng.pick(&[1, 3, 10, 100, 100, 250, 1000]),
            *rng.pick(&[100, 1000, 1000, 1500, 60_000, 3_600_000]),
        ),
        // Small limits, so that keys revisited within a window are refused.
        Scale::ManyKeys => (
            *rng.pick(&[1, 2, 3, 5, 10]),
            *rng.pick(&[100, 250, 1000, 1500]),
        ),
        Scale::Near2Pow53 => (
            *rng.pick(&[MAX_SAFE, MAX_SAFE - 1, 1 << 52, 1_000_000_000, MAX_SAFE / 3]),
            *rng.pick(&[1, 7, 1000, 31_536_000_000, 1 << 52, MAX_SAFE]),
        ),
    };
    let mut config = PolicyConfig::new(policy, limit, window_ms);
    if policy.has_burst() && rng.chance(50) {
        config.burst = Some(match scale {
            Scale::Small => rng.range(0, 20),
            Scale::WallClock | Scale::ManyKeys => limit * rng.range(1, 5),
            Scale::Near2Pow53 => *rng.pick(&[MAX_SAFE, limit, limit / 2 + 1]),
        });
    }
    config
}

fn draw_script(rng: &mut Rng, config: &PolicyConfig, scale: Scale, len: usize) -> Script {
    let mut keys = vec![
        VectorKey::Int(1),
        VectorKey::Int(2),
        VectorKey::Str("user:21620".into()),
        VectorKey::Str("user:32611".into()),
        VectorKey::Str("tenant/ä".into()),
    ];
    let w = config.window_ms;
    let top = if config.policy.has_burst() {
        config.effective_burst()
    } else {
        config.limit
    };
    let mut now = match scale {
        Scale::Small => rng.range(0, 3 * w),
        Scale::WallClock | Scale::ManyKeys => 1_700_000_000_000 + rng.range(0, 10 * w),
        Scale::Near2Pow53 => MAX_SAFE - rng.range(0, 3u64.saturating_mul(w).min(MAX_SAFE / 2)),
    };
    let mut model = Naive::new(*config);
    let mut script = Vec::with_capacity(len);
    // Few keys per case, so that requests meet on one key; or, for
    // `ManyKeys`, a pool of 40 to 80 more (integers anywhere in 64 bits,
    // small integers, strings), each met two or three times.
    let key_count = match scale {
        Scale::ManyKeys => {
            for i in 0..rng.range(40, 80) {
                keys.push(match i % 3 {
                    0 => VectorKey::Int(rng.next_u64()),
                    1 => VectorKey::Int(rng.range(0, 1000)),
                    _ => VectorKey::Str(format!("client:{}", rng.range(0, 1_000_000))),
                });
            }
            keys.len()
        }
        _ => rng.range(1, 3) as usize,
    };
    for _ in 0..len {
        let key = keys[rng.range(0, key_count as u64 - 1) as usize].clone();
        let edge = now - now % w + w;
        now = match rng.range(0, 99) {
            0..=29 => now,
            30..=54 => now.saturating_add(rng.range(1, (w / 4).max(1))),
            55..=64 => edge.saturating_sub(1),
            65..=72 => edge,
            73..=77 => edge.saturating_add(1),
            78..=84 => now.saturating_add(*rng.pick(&[w, 2 * w, 2 * w + 1, 5 * w])),
            85..=91 => now.saturating_sub(rng.range(1, 2 * w)),
            _ => now.saturating_add(rng.range(1, 3 * w)),
        }
        .min(MAX_SAFE);
        let remaining = model.clone().decide(key.resolve(), now, 0).remaining;
        let cost = match rng.range(0, 99) {
            0..=9 => 0,
            10..=44 => 1,
            45..=59 => remaining,
            60..=67 => remaining.saturating_add(1).min(MAX_SAFE),
            68..=74 => top,
            75..=79 => top.saturating_add(1).min(MAX_SAFE),
            _ => rng.range(0, top),
        };
        model.decide(key.resolve(), now, cost);
        script.push((key, now, cost));
    }
    script
}

/// Random traces for one policy at every scale.
fn generated_file(policy: PolicyKind, seed: u64) -> VectorFile {
    let mut rng = Rng::new(seed);
    let mut cases = Vec::new();
    for (scale, count, len) in [
        (Scale::Small, 60, 40),
        (Scale::WallClock, 30, 40),
        (Scale::Near2Pow53, 30, 25),
        (Scale::ManyKeys, 6, 160),
    ] {
        let mut made = 0;
        while made < count {
            let config = draw_config(&mut rng, policy, scale);
            let script = draw_script(&mut rng, &config, scale, len);
            let case = expect(
                format!("generated {scale:?} #{made}: {config}"),
                config,
                script,
            );
            // Waits beyond 2^62 ms only arise for buckets with a huge
            // window and a tiny rate; no port needs to agree past u64.
            if case
                .steps
                .iter()
                .any(|s| s.expected.retry_after_ms.is_some_and(|r| r > 1 << 62))
            {
                continue;
            }
            cases.push(case);
            made += 1;
        }
    }
    VectorFile {
        mix32: Vec::new(),
        cases,
    }
}

fn k(n: u64) -> VectorKey {
    VectorKey::Int(n)
}

/// Edge cases, written as requests; what each gets comes from the model.
fn edges_file() -> VectorFile {
    use PolicyKind::*;
    let mut cases = Vec::new();
    let mut add = |d: &str, config: PolicyConfig, script: Script| {
        cases.push(expect(d.to_owned(), config, script));
    };
    for policy in PolicyKind::ALL {
        let c = PolicyConfig::new(policy, 5, 1000);
        add(
            &format!("{policy}: costs 0, 1, exactly the remaining budget, limit and limit + 1"),
            c,
            vec![
                (k(1), 10, 0),
                (k(1), 10, 1),
                (k(1), 20, 4),
                (k(1), 30, 0),
                (k(1), 40, 1),
                (k(2), 40, 5),
                (k(3), 40, 6),
                (k(3), 41, 0),
            ],
        );
        add(
            &format!("{policy}: the last millisecond of a window, its edge, and one past it"),
            c,
            vec![
                (k(1), 998, 3),
                (k(1), 999, 2),
                (k(1), 999, 1),
                (k(1), 1000, 1),
                (k(1), 1000, 5),
                (k(1), 1001, 1),
                (k(1), 1999, 1),
                (k(1), 2000, 1),
            ],
        );
        add(
            &format!("{policy}: gaps of one window and of two windows"),
            c,
            vec![
                (k(1), 500, 5),
                (k(1), 1500, 1),
                (k(1), 1500, 5),
                (k(1), 3500, 5),
                (k(1), 5499, 1),
                (k(1), 7500, 5),
            ],
        );
        add(
            &format!("{policy}: a clock that steps back is decided at the key's recorded time"),
            c,
            vec![
                (k(1), 1500, 5),
                (k(1), 900, 1),
                (k(1), 100, 0),
                (k(1), 1499, 1),
                (k(1), 2600, 1),
                (k(1), 2000, 1),
                (k(1), 2600, 5),
            ],
        );
        // docs/SPEC.md's reading: a refused request still moves the key's
        // clock as the pseudocode does (a new window, a refill, old log
        // entries dropped), while a refused GCRA request writes nothing;
        // a request stepping back then shows which.
        add(
            &format!("{policy}: a refused request moves the clock as the pseudocode says"),
            c,
            vec![
                (k(1), 500, 5),
                (k(1), 2500, 6),
                (k(1), 900, 1),
                (k(1), 900, 0),
            ],
        );
        add(
            &format!("{policy}: mix32 collisions share one count (user:21620, user:32611)"),
            c,
            vec![
                (VectorKey::Str("user:21620".into()), 0, 3),
                (VectorKey::Str("user:32611".into()), 1, 3),
                (VectorKey::Str("user:32611".into()), 2, 2),
                (VectorKey::Int(u64::from(mix32("user:21620"))), 3, 1),
                (VectorKey::Str("user:1".into()), 3, 5),
            ],
        );
        add(
            &format!("{policy}: limit 0 admits only peeks"),
            PolicyConfig::new(policy, 0, 1000),
            vec![(k(1), 0, 0), (k(1), 0, 1), (k(1), 5000, 1), (k(1), 5000, 0)],
        );
        add(
            &format!("{policy}: numbers near 2^53"),
            PolicyConfig::new(policy, MAX_SAFE, MAX_SAFE),
            vec![
                (k(1), MAX_SAFE - 2, MAX_SAFE - 1),
                (k(1), MAX_SAFE - 1, 1),
                (k(1), MAX_SAFE - 1, 1),
                (k(1), MAX_SAFE, MAX_SAFE),
                (k(1), MAX_SAFE, 2),
                (k(1), MAX_SAFE, 0),
            ],
        );
        add(
            &format!("{policy}: one-millisecond windows"),
            PolicyConfig::new(policy, 2, 1),
            vec![
                (k(1), 0, 2),
                (k(1), 0, 1),
                (k(1), 1, 2),
                (k(1), 1, 1),
                (k(1), 2, 1),
                (k(1), 4, 2),
            ],
        );
        add(
            &format!("{policy}: wall-clock time, one minute window, costs larger than 1"),
            PolicyConfig::new(policy, 1000, 60_000),
            vec![
                (k(7), 1_764_460_800_123, 400),
                (k(7), 1_764_460_830_000, 500),
                (k(7), 1_764_460_859_999, 200),
                (k(7), 1_764_460_860_000, 200),
                (k(7), 1_764_460_875_000, 100),
                (k(7), 1_764_460_900_000, 1000),
            ],
        );
    }
    for policy in [TokenBucket, Gcra] {
        let c = PolicyConfig::new(policy, 2, 1000).with_burst(5);
        add(
            &format!("{policy}: burst above the rate; a cost above the burst never fits"),
            c,
            vec![
                (k(1), 0, 5),
                (k(1), 0, 1),
                (k(1), 0, 6),
                (k(1), 499, 1),
                (k(1), 500, 1),
                (k(1), 3000, 5),
                (k(1), 3000, 0),
            ],
        );
        add(
            &format!("{policy}: burst 0 admits nothing but peeks"),
            PolicyConfig::new(policy, 10, 1000).with_burst(0),
            vec![(k(1), 0, 1), (k(1), 0, 0), (k(1), 10_000, 1)],
        );
        add(
            &format!("{policy}: burst below the rate"),
            PolicyConfig::new(policy, 10, 1000).with_burst(3),
            vec![
                (k(1), 0, 3),
                (k(1), 0, 3),
                (k(1), 100, 1),
                (k(1), 250, 3),
                (k(1), 300, 2),
            ],
        );
        add(
            &format!("{policy}: huge burst, tiny rate, huge window"),
            PolicyConfig::new(policy, 1 << 30, MAX_SAFE).with_burst(MAX_SAFE),
            vec![
                (k(1), 0, MAX_SAFE),
                (k(1), 1, 1),
                (k(1), 1_000_000, 1 << 20),
                (k(1), MAX_SAFE, 1 << 30),
                (k(1), MAX_SAFE, 0),
            ],
        );
    }
    // docs/SPEC.md's other readings, each on its own.
    add(
        "sliding-window-counter: a peek after a step back is decided at the window's start, \
         where the previous window is carried whole, and can be refused",
        PolicyConfig::new(SlidingWindowCounter, 2, 10),
        vec![(k(1), 5, 2), (k(1), 15, 1), (k(1), 9, 0), (k(1), 9, 1)],
    );
    add(
        "sliding-log: a peek drops entries W old, so a step back finds an empty log",
        PolicyConfig::new(SlidingLog, 1, 10),
        vec![(k(1), 0, 1), (k(1), 20, 0), (k(1), 5, 1), (k(1), 5, 0)],
    );
    add(
        "gcra: a peek after the clock steps back before the arrival time is refused",
        PolicyConfig::new(Gcra, 1, 10),
        vec![
            (k(1), 100, 1),
            (k(1), 90, 0),
            (k(1), 100, 0),
            (k(1), 110, 1),
        ],
    );
    // GCRA near 2^53 with limit 1: now * limit stays below 2^53 while the
    // arrival time an admission sets (now * limit + cost * W) passes it.
    add(
        "gcra: limit 1 near 2^53, where an admitted arrival time passes 2^53",
        PolicyConfig::new(Gcra, 1, 1000).with_burst(3),
        vec![
            (k(1), MAX_SAFE - 10, 1),
            (k(1), MAX_SAFE - 10, 0),
            (k(1), MAX_SAFE - 9, 2),
            (k(1), MAX_SAFE - 8, 1),
            (k(1), MAX_SAFE, 1),
            (k(1), MAX_SAFE, 0),
        ],
    );
    // Large states whose 64-bit packing in the memory store is one of the
    // two values it reserves for itself: each must decide as any other.
    let reserved = "a state whose packing is a value the memory store reserves";
    add(
        &format!("fixed-window: {reserved}"),
        PolicyConfig::new(FixedWindow, 4_294_967_294, 1),
        vec![
            (k(1), 4_294_967_295, 4_294_967_294),
            (k(1), 4_294_967_295, 0),
            (k(1), 4_294_967_295, 1),
            (k(1), 4_294_967_296, 1),
        ],
    );
    add(
        &format!("token-bucket: {reserved}"),
        PolicyConfig::new(TokenBucket, 1, 1).with_burst(4_294_967_294),
        vec![
            (k(1), 4_294_967_295, 0),
            (k(1), 4_294_967_295, 0),
            (k(1), 4_294_967_295, 4_294_967_294),
            (k(1), 4_294_967_295, 1),
        ],
    );
    add(
        &format!("gcra: {reserved}"),
        PolicyConfig::new(Gcra, 2048, 1),
        vec![
            (k(1), MAX_SAFE, 2046),
            (k(1), MAX_SAFE, 0),
            (k(1), MAX_SAFE, 3),
            (k(1), MAX_SAFE, 2),
        ],
    );
    add(
        &format!("sliding-window-counter: {reserved}"),
        PolicyConfig::new(SlidingWindowCounter, 255, 257),
        vec![
            (k(1), 281_474_976_710_398, 255),
            (k(1), 281_474_976_710_911, 254),
            (k(1), 281_474_976_710_911, 0),
            (k(1), 281_474_976_710_911, 2),
        ],
    );
    VectorFile {
        mix32: Vec::new(),
        cases,
    }
}

fn mix32_file() -> VectorFile {
    let inputs = [
        "",
        "a",
        "ab",
        "abc",
        "abcd",
        "hello",
        "user:42",
        "user:21620",
        "user:32611",
        "The quick brown fox jumps over the lazy dog",
        "ключ",
        "😀 emoji",
        "tenant/ä",
        "\u{0}",
    ];
    VectorFile {
        mix32: inputs
            .iter()
            .map(|s| vectors::Mix32Vector {
                input: (*s).to_owned(),
                output: mix32(s),
            })
            .collect(),
        cases: Vec::new(),
    }
}

fn generated() -> Vec<(String, VectorFile)> {
    let mut files = vec![
        ("generated/edges.json".to_owned(), edges_file()),
        ("generated/mix32.json".to_owned(), mix32_file()),
    ];
    for (i, policy) in PolicyKind::ALL.into_iter().enumerate() {
        files.push((
            format!("generated/{}.json", policy.name()),
            generated_file(policy, 0x5eed_0000 + i as u64),
        ));
    }
    files
}

#[test]
fn generated_vector_files_match_the_naive_model() {
    let regenerate = std::env::var_os("RATEWARDEN_REGENERATE_VECTORS").is_some();
    for (name, file) in generated() {
        let path = vectors_dir().join(&name);
        let text = vectors::write(&file);
        if regenerate {
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, &text).unwrap();
            continue;
        }
        let committed = std::fs::read_to_string(&path).unwrap_or_else(|e| {
            panic!(
                "{}: {e}; regenerate with RATEWARDEN_REGENERATE_VECTORS=1",
                path.display()
            )
        });
        assert!(
            committed == text,
            "{} differs from the naive model; regenerate it",
            path.display()
        );
    }
}

#[test]
fn every_vector_file_passes_on_the_memory_store() {
    let mut files = Vec::new();
    let mut dirs = vec![vectors_dir()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|x| x == "json") {
                files.push(path);
            }
        }
    }
    assert!(
        files.len() >= 8,
        "expected the seed and generated files, found {files:?}"
    );
    let mut cases = 0;
    let mut forgotten = 0;
    for path in files {
        let file = vectors::parse(&std::fs::read_to_string(&path).unwrap()).unwrap();
        for m in &file.mix32 {
            assert_eq!(
                mix32(&m.input),
                m.output,
                "{}: mix32({:?})",
                path.display(),
                m.input
            );
        }
        for (i, case) in file.cases.iter().enumerate() {
            // Whether each step's time is the earliest of the rest of the
            // case: forgetting idle keys at that time cannot change a later
            // decision (SPEC "Memory"; a request stepping back before it
            // may find its key forgotten, see docs/SPEC.md).
            let mut earliest_after = u64::MAX;
            let mut no_step_back: Vec<bool> = case
                .steps
                .iter()
                .rev()
                .map(|step| {
                    earliest_after = earliest_after.min(step.now_ms);
                    earliest_after == step.now_ms
                })
                .collect();
            no_step_back.reverse();
            // The default sharding; one shard, whose table then holds every
            // key of the case and grows several times in the cases with
            // many keys; and one shard forgetting every idle key before
            // each step it may.
            for (shards, forget, run) in [
                (0, false, "default shards"),
                (1, false, "one shard"),
                (1, true, "one shard, forgetting idle keys"),
            ] {
                let options = MemoryOptions {
                    shards,
                    ..MemoryOptions::default()
                };
                let store = MemoryStore::for_config(&case.config, options).unwrap();
                let mut may_forget = no_step_back.iter();
                let outcome = vectors::run_case(case, |key, now, cost| {
                    if may_forget.next() == Some(&true) && forget {
                        forgotten += store.forget_idle(now, usize::MAX).forgotten;
                    }
                    store.decide(key, now, cost)
                });
                assert_eq!(
                    outcome,
                    CaseOutcome::Passed,
                    "{} case {i} ({run}): {}",
                    path.display(),
                    case.description
                );
            }
            cases += 1;
        }
    }
    assert!(cases > 600, "only {cases} cases");
    // The forgetting run forgot keys that were asked for again.
    assert!(forgotten > 1000, "only {forgotten} keys forgotten");
}
