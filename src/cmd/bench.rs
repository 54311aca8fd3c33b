//! `ratewarden bench`: speed, memory and accuracy of every policy on the
//! in-memory store, beside governor's keyed GCRA, measured in one run.

use std::process::ExitCode;

use anyhow::{bail, ensure, Context as _, Result};
use indicatif::{ProgressBar, ProgressStyle};
use ratewarden_core::{
    FixedWindow, Gcra, PolicyKind, SlidingLog, SlidingWindowCounter, TokenBucket,
};
use serde_json::json;

use super::{errln, outln};
use crate::measure::accuracy::{compare, decisions};
use crate::measure::memory::{measure_here, measure_in_child, Footprint};
use crate::measure::shapes::{Shape, ShapeParams, MAX_REQUESTS};
use crate::measure::speed::{
    insert_all, key_set, median, run_single, run_threads, uniform_sequence, zipf_sequence,
    AtomicBaseline, Baseline, Contender, Governor, Store, DECISIONS_PER_MS,
};
use crate::measure::{check_size, Row, MAX_KEYS, REFERENCE_LIMIT, REFERENCE_WINDOW_MS};

/// Arguments of `ratewarden bench`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The store to measure: `memory` (every policy beside governor and a
    /// bare hash map), `redis://HOST:PORT` or `redis+unix:///PATH`
    /// (pipelined decisions per second
    /// and round trips per policy beside redis-benchmark, as
    /// `ratewarden bench-redis` measures with its default sizes).
    #[arg(long, default_value = "memory", value_parser = super::trimmed)]
    pub store: String,
    /// A shorter run (fewer decisions and repetitions, shorter traffic)
    /// that finishes within a minute on two cores.
    #[arg(long)]
    pub quick: bool,
    /// One JSON object per row on standard output instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Distinct keys of the `*-1m` workloads and of the memory rows, 1 to
    /// 16,777,216 [default: 1,000,000].
    #[arg(long, value_parser = crate::cmd::whole::<usize>)]
    pub keys: Option<usize>,
    /// Decisions per repetition of a speed workload, 1 to 100,000,000
    /// [default: 2,000,000; 500,000 with --quick].
    #[arg(long, value_parser = crate::cmd::whole::<usize>)]
    pub decisions: Option<usize>,
    /// Repetitions of each speed workload, 1 to 1,000; the median is
    /// reported [default: 5; 3 with --quick].
    #[arg(long, value_parser = crate::cmd::whole::<usize>)]
    pub reps: Option<usize>,
    /// Threads of `uniform-1m-threads`, 1 to 256 [default: every core, up
    /// to 256 and to what the 400-million-key bound on the key sequences
    /// leaves room for]
    #[arg(long, value_parser = crate::cmd::whole::<usize>)]
    pub threads: Option<usize>,
    /// How long each accuracy shape lasts, in ms: at least 1,001 (past the
    /// first window edge of the reference configuration) and at most 275,862 (20
    /// million requests of the largest shape) [default: 60,000; 20,000
    /// with --quick].
    #[arg(long, value_parser = crate::cmd::whole::<u64>)]
    pub accuracy_duration_ms: Option<u64>,
    /// The seed of every key sequence and traffic shape [default: 1].
    #[arg(long, value_parser = crate::cmd::whole::<u64>)]
    pub seed: Option<u64>,
}

impl Args {
    /// The flags given that only the in-memory bench takes.
    fn memory_only_flags(&self) -> Vec<&'static str> {
        [
            ("--keys", self.keys.is_some()),
            ("--decisions", self.decisions.is_some()),
            ("--reps", self.reps.is_some()),
            ("--threads", self.threads.is_some()),
            (
                "--accuracy-duration-ms",
                self.accuracy_duration_ms.is_some(),
            ),
            ("--seed", self.seed.is_some()),
        ]
        .into_iter()
        .filter_map(|(flag, given)| given.then_some(flag))
        .collect()
    }
}

/// Arguments of the hidden `bench-memory` subcommand, which `bench` starts
/// in a fresh process to measure one contender's memory.
#[derive(clap::Args, Debug)]
pub struct MemoryArgs {
    /// A registry name or `governor`.
    #[arg(long)]
    pub contender: String,
    /// Keys to insert.
    #[arg(long, value_parser = crate::cmd::whole::<usize>)]
    pub keys: usize,
    /// Stop once standard input closes: `bench` holds it open, so that
    /// this process does not outlive it.
    #[arg(long)]
    pub while_stdin_open: bool,
}

/// The most decisions per repetition of a speed workload.
const MAX_DECISIONS: usize = 100_000_000;
/// The most repetitions of each speed workload.
const MAX_REPS: usize = 1_000;
/// The fewest keys `bytes_per_key` is measured for: resident memory moves
/// in pages of 4 KiB, which below this would be more than 0.04 bytes a
/// key, and a table's growth steps would weigh more than its slots.
const MIN_MEMORY_KEYS: usize = 100_000;
/// The most threads of `uniform-1m-threads`.
const MAX_THREADS: usize = 256;
/// The most keys all the pre-generated sequences may hold together, 8
/// bytes each: 3.2 GB.
const MAX_SEQUENCE_KEYS: usize = 400_000_000;

/// The threads of `uniform-1m-threads` when `--threads` is not given:
/// every core, as many as the bounds allow (a machine with more cores than
/// [`MAX_THREADS`], or than the sequences' bound leaves room for at
/// `decisions` each, runs the most it can rather than refusing a flag it
/// was not given).
fn default_threads(cores: usize, decisions: usize) -> usize {
    let room = (MAX_SEQUENCE_KEYS / decisions.max(1)).saturating_sub(3);
    cores.min(MAX_THREADS).min(room).max(1)
}

/// The run's sizes, from the arguments.
struct Plan {
    keys: usize,
    decisions: usize,
    reps: usize,
    threads: usize,
    accuracy_duration_ms: u64,
    seed: u64,
}

impl Plan {
    fn from_args(args: &Args) -> Result<Plan> {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let decisions = args
            .decisions
            .unwrap_or(if args.quick { 500_000 } else { 2_000_000 });
        let plan = Plan {
            keys: args.keys.unwrap_or(1_000_000),
            decisions,
            reps: args.reps.unwrap_or(if args.quick { 3 } else { 5 }),
            threads: args
                .threads
                .unwrap_or_else(|| default_threads(cores, decisions)),
            accuracy_duration_ms: args.accuracy_duration_ms.unwrap_or(if args.quick {
                20_000
            } else {
                60_000
            }),
            seed: args.seed.unwrap_or(1),
        };
        check_size("--keys", plan.keys, MAX_KEYS)?;
        check_size("--decisions", plan.decisions, MAX_DECISIONS)?;
        check_size("--reps", plan.reps, MAX_REPS)?;
        check_size("--threads", plan.threads, MAX_THREADS)?;
        // The hot, uniform and Zipf sequences and one per thread, all
        // held at once.
        let sequence_keys = (plan.threads + 3).saturating_mul(plan.decisions);
        ensure!(
            sequence_keys <= MAX_SEQUENCE_KEYS,
            "--decisions {} with --threads {} holds {sequence_keys} keys of sequences \
             ({} MB), above {MAX_SEQUENCE_KEYS}; lower --decisions or --threads",
            plan.decisions,
            plan.threads,
            sequence_keys * 8 / 1_000_000
        );
        // The boundary attack's first requests straddle the first window
        // edge: a shorter run would offer it nothing and score it perfect.
        ensure!(
            plan.accuracy_duration_ms > REFERENCE_WINDOW_MS,
            "--accuracy-duration-ms must reach past the first window edge ({REFERENCE_WINDOW_MS} \
             ms), where the boundary attack begins: give {} or more",
            REFERENCE_WINDOW_MS + 1
        );
        // The largest shape bounds the duration; every count grows in
        // proportion to the duration, so the longest allowed one follows.
        let params = plan.accuracy_params();
        let (largest, expected) = Shape::ALL
            .into_iter()
            .map(|shape| (shape, shape.expected_requests(&params)))
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .expect("there are shapes");
        ensure!(
            expected <= MAX_REQUESTS as f64,
            "--accuracy-duration-ms {} makes {largest} about {expected:.0} requests, above the \
             {MAX_REQUESTS} a shape may generate; use at most {:.0}",
            plan.accuracy_duration_ms,
            (plan.accuracy_duration_ms as f64 * MAX_REQUESTS as f64 / expected).floor()
        );
        Ok(plan)
    }

    /// The accuracy shapes' parameters: the reference configuration over
    /// the run's duration and seed.
    fn accuracy_params(&self) -> ShapeParams {
        ShapeParams {
            limit: REFERENCE_LIMIT,
            window_ms: REFERENCE_WINDOW_MS,
            duration_ms: self.accuracy_duration_ms,
            seed: self.seed,
        }
    }
}

/// The pre-generated key sequences every contender runs.
struct Sequences {
    keys: Vec<u64>,
    hot: Vec<u64>,
    uniform: Vec<u64>,
    zipf: Vec<u64>,
    per_thread: Vec<Vec<u64>>,
}

impl Sequences {
    fn new(plan: &Plan) -> Sequences {
        let keys = key_set(plan.keys);
        let n = plan.decisions;
        Sequences {
            hot: vec![keys[0]; n],
            uniform: uniform_sequence(&keys, n, plan.seed),
            // Seeds near 2^64 wrap: any seed gives its own sequences.
            zipf: zipf_sequence(&keys, n, 1.0, plan.seed.wrapping_add(1)),
            // Each thread does the single-thread run's number of decisions,
            // on its own uniform draw over the same keys.
            per_thread: (0..plan.threads)
                .map(|t| uniform_sequence(&keys, n, plan.seed.wrapping_add(100 + t as u64)))
                .collect(),
            keys,
        }
    }
}

/// One contender of the speed table: an instance of its own for the
/// `hot-key` workloads (holding that one key) and one holding every key
/// for the `*-1m` workloads, each kept over the repetitions.
struct Entry<C: Contender> {
    name: &'static str,
    hot: C,
    big: C,
    /// How to run the threaded workload, for contenders that can be shared.
    threads: Option<ThreadedRun<C>>,
}

/// Runs one sequence per thread on a shared contender; see [`run_threads`].
type ThreadedRun<C> = fn(&C, &[Vec<u64>]) -> f64;

/// The speed workloads, named as in the table.
const WORKLOADS: [&str; 5] = [
    "hot-key",
    "hot-key-every-ms",
    "uniform-1m",
    "zipf-1m",
    "uniform-1m-threads",
];

/// A contender seen through one type, so that repetitions can go round
/// every contender in turn; each call runs a whole, statically dispatched
/// loop.
trait Runner {
    fn name(&self) -> &'static str;
    /// Nanoseconds per decision of one repetition of `workload`, or `None`
    /// when the contender does not run it.
    fn run(&self, workload: &str, seq: &Sequences) -> Option<f64>;
    fn entries_tracked(&self, workload: &str) -> usize;
}

impl<C: Contender> Runner for Entry<C> {
    fn name(&self) -> &'static str {
        self.name
    }

    fn run(&self, workload: &str, seq: &Sequences) -> Option<f64> {
        match workload {
            "hot-key" => Some(run_single(&self.hot, &seq.hot, DECISIONS_PER_MS)),
            // The same key with a new millisecond on every decision: no
            // request repeats an earlier one, so the store's memo of a
            // flood's refusal never answers (see docs/bench.md).
            "hot-key-every-ms" => Some(run_single(&self.hot, &seq.hot, 1)),
            "uniform-1m" => Some(run_single(&self.big, &seq.uniform, DECISIONS_PER_MS)),
            "zipf-1m" => Some(run_single(&self.big, &seq.zipf, DECISIONS_PER_MS)),
            _ => self.threads.map(|run| run(&self.big, &seq.per_thread)),
        }
    }

    fn entries_tracked(&self, workload: &str) -> usize {
        if workload.starts_with("hot-key") {
            self.hot.entries_tracked()
        } else {
            self.big.entries_tracked()
        }
    }
}

fn entry<C: Contender + Sync + 'static>(
    name: &'static str,
    make: impl Fn() -> C,
    seq: &Sequences,
) -> Box<dyn Runner> {
    let big = make();
    insert_all(&big, &seq.keys);
    Box::new(Entry {
        name,
        hot: make(),
        big,
        threads: Some(run_threads::<C>),
    })
}

/// Nanoseconds per decision of every repetition, by contender and workload,
/// in the order the repetitions ran.
type Samples = Vec<(String, &'static str, Vec<f64>)>;

fn speed_rows(plan: &Plan, seq: &Sequences, bar: &ProgressBar) -> Result<(Vec<Row>, Samples)> {
    let (l, w) = (REFERENCE_LIMIT, REFERENCE_WINDOW_MS);
    // Twice the key count: room for every key, never near the bound.
    let max_keys = plan.keys * 2;
    let fixed = FixedWindow::new(l, w)?;
    let counter = SlidingWindowCounter::new(l, w)?;
    let log = SlidingLog::new(l, w)?;
    let bucket = TokenBucket::new(l, w, None)?;
    let gcra = Gcra::new(l, w, None)?;
    Governor::new(l as u32, w)?;
    let runners: Vec<Box<dyn Runner>> = vec![
        entry(
            PolicyKind::FixedWindow.name(),
            || Store::new(fixed, max_keys),
            seq,
        ),
        entry(
            PolicyKind::SlidingWindowCounter.name(),
            || Store::new(counter, max_keys),
            seq,
        ),
        entry(
            PolicyKind::SlidingLog.name(),
            || Store::new(log, max_keys),
            seq,
        ),
        entry(
            PolicyKind::TokenBucket.name(),
            || Store::new(bucket, max_keys),
            seq,
        ),
        entry(PolicyKind::Gcra.name(), || Store::new(gcra, max_keys), seq),
        entry(
            "governor",
            || Governor::new(l as u32, w).expect("checked above"),
            seq,
        ),
        {
            let big = Baseline::new(l, w);
            insert_all(&big, &seq.keys);
            Box::new(Entry {
                name: "baseline-hashmap",
                hot: Baseline::new(l, w),
                big,
                threads: None,
            })
        },
        {
            // The hot-key instance holds one key: a table for one.
            let big = AtomicBaseline::new(l, w, plan.keys)?;
            insert_all(&big, &seq.keys);
            Box::new(Entry {
                name: "baseline-atomic",
                hot: AtomicBaseline::new(l, w, 1)?,
                big,
                threads: Some(run_threads::<AtomicBaseline>),
            })
        },
    ];
    bar.inc(1);
    // Repetitions go round every contender in turn, so a slow spell of the
    // machine falls on all of them alike rather than on one.
    let mut samples = vec![vec![Vec::new(); WORKLOADS.len()]; runners.len()];
    for _ in 0..plan.reps {
        for (w, workload) in WORKLOADS.iter().enumerate() {
            for (r, runner) in runners.iter().enumerate() {
                if let Some(ns) = runner.run(workload, seq) {
                    samples[r][w].push(ns);
                }
            }
        }
        bar.inc(1);
    }
    let mut rows = Vec::new();
    let mut by_repetition = Samples::new();
    for (r, runner) in runners.iter().enumerate() {
        for (w, workload) in WORKLOADS.iter().enumerate() {
            if samples[r][w].is_empty() {
                continue;
            }
            by_repetition.push((runner.name().to_owned(), workload, samples[r][w].clone()));
            let ns = median(&mut samples[r][w]);
            let threads = if *workload == "uniform-1m-threads" {
                plan.threads
            } else {
                1
            };
            rows.push(Row {
                policy: runner.name().to_owned(),
                workload: (*workload).to_owned(),
                ns_per_decision: Some(ns),
                decisions_per_sec: Some(1e9 / ns),
                time_source: Some("supplied"),
                threads: Some(threads),
                entries_tracked: Some(runner.entries_tracked(workload)),
                ..Row::default()
            });
        }
    }
    Ok((rows, by_repetition))
}

fn accuracy_rows(plan: &Plan, bar: &ProgressBar) -> Result<Vec<Row>> {
    let (limit, window_ms) = (REFERENCE_LIMIT, REFERENCE_WINDOW_MS);
    let params = plan.accuracy_params();
    let mut rows = Vec::new();
    for shape in Shape::ALL {
        // The reference configuration draws far fewer than the bound.
        let requests = shape
            .generate(&params)
            .map_err(|_| anyhow::anyhow!("{shape} drew more requests than a run may hold"))?;
        let exact = decisions(PolicyKind::SlidingLog, limit, window_ms, &requests)?;
        for kind in PolicyKind::ALL {
            let mine = decisions(kind, limit, window_ms, &requests)?;
            let acc = compare(&requests, &mine, &exact, limit, window_ms);
            // A shape that offered nothing has no error to report: its
            // columns stay empty rather than read as a perfect score.
            let offered = acc.requests > 0;
            rows.push(Row {
                policy: kind.name().to_owned(),
                workload: shape.name().to_owned(),
                requests: Some(acc.requests),
                false_admit_pct: offered.then(|| acc.false_admit_pct()),
                false_reject_pct: offered.then(|| acc.false_reject_pct()),
                max_in_window_ratio: offered.then_some(acc.max_in_window_ratio),
                ..Row::default()
            });
        }
        bar.inc(1);
    }
    Ok(rows)
}

/// One target of the issue, checked against this run's rows.
struct Target {
    policy: String,
    check: &'static str,
    ratio: f64,
    bound: f64,
    at_least: bool,
}

impl Target {
    fn met(&self) -> bool {
        if self.at_least {
            self.ratio >= self.bound
        } else {
            self.ratio <= self.bound
        }
    }
}

/// The nanoseconds per decision of each repetition of `workload` by
/// `policy`, if it ran.
fn repetitions<'s>(samples: &'s Samples, policy: &str, workload: &str) -> Option<&'s [f64]> {
    samples
        .iter()
        .find(|(p, w, _)| p == policy && *w == workload)
        .map(|(_, _, reps)| reps.as_slice())
}

/// The median over repetitions of `a / b` within each repetition.
fn paired(a: Option<&[f64]>, b: Option<&[f64]>) -> Option<f64> {
    let (a, b) = a.zip(b)?;
    let mut ratios: Vec<f64> = a.iter().zip(b).map(|(a, b)| a / b).collect();
    (!ratios.is_empty()).then(|| median(&mut ratios))
}

/// The targets. A speed ratio is the median, over repetitions, of
/// the ratio within each repetition: the contenders of one repetition run
/// one after another, so a slow spell of the shared machine moves both
/// sides of that repetition's ratio, where it would move only one median
/// if the medians were divided. Bytes per key are measured once.
fn targets(rows: &[Row], samples: &Samples) -> Vec<Target> {
    let find = |policy: &str, workload: &str| {
        rows.iter()
            .find(|r| r.policy == policy && r.workload == workload && r.ns_per_decision.is_some())
    };
    let ns = |p: &str, w: &str| repetitions(samples, p, w);
    let mut out = Vec::new();
    for kind in [
        PolicyKind::SlidingWindowCounter,
        PolicyKind::FixedWindow,
        PolicyKind::TokenBucket,
        PolicyKind::Gcra,
    ] {
        let p = kind.name();
        let mut push = |check, ratio: Option<f64>, bound, at_least| {
            if let Some(ratio) = ratio {
                out.push(Target {
                    policy: p.to_owned(),
                    check,
                    ratio,
                    bound,
                    at_least,
                });
            }
        };
        push(
            "hot-key ns / governor's",
            paired(ns(p, "hot-key"), ns("governor", "hot-key")),
            0.5,
            false,
        );
        push(
            "uniform-1m ns / governor's",
            paired(ns(p, "uniform-1m"), ns("governor", "uniform-1m")),
            0.35,
            false,
        );
        push(
            "hot-key ns / baseline-hashmap's",
            paired(ns(p, "hot-key"), ns("baseline-hashmap", "hot-key")),
            1.5,
            false,
        );
        push(
            "uniform-1m ns / baseline-hashmap's",
            paired(ns(p, "uniform-1m"), ns("baseline-hashmap", "uniform-1m")),
            1.5,
            false,
        );
        // Throughput ratio: single-thread ns over threaded wall ns. The
        // target is for two threads or more: one thread has nothing to gain.
        if threaded(rows, p) {
            push(
                "threads / single-thread decisions_per_sec",
                paired(ns(p, "uniform-1m"), ns(p, "uniform-1m-threads")),
                1.6,
                true,
            );
        }
        let bytes = |q: &str| find(q, "uniform-1m").and_then(|r| r.bytes_per_key);
        push(
            "bytes_per_key / governor's",
            bytes(p).zip(bytes("governor")).map(|(a, b)| a / b),
            1.0,
            false,
        );
    }
    out
}

/// Whether `policy`'s `uniform-1m-threads` row ran on two threads or more.
fn threaded(rows: &[Row], policy: &str) -> bool {
    rows.iter().any(|r| {
        r.policy == policy && r.workload == "uniform-1m-threads" && r.threads.unwrap_or(0) >= 2
    })
}

/// A ratio printed under the targets to read them by: the peers' own
/// figures on this machine, with no bound of their own.
struct Context {
    policy: &'static str,
    check: &'static str,
    ratio: f64,
    why: &'static str,
}

/// The context lines of this run, paired per repetition as the targets are.
fn context(rows: &[Row], samples: &Samples) -> Vec<Context> {
    let ns = |p: &str, w: &str| repetitions(samples, p, w);
    let atomic_threads = if threaded(rows, "baseline-atomic") {
        paired(
            ns("baseline-atomic", "uniform-1m"),
            ns("baseline-atomic", "uniform-1m-threads"),
        )
    } else {
        None
    };
    [
        (
            "baseline-hashmap",
            "uniform-1m ns / governor's",
            paired(
                ns("baseline-hashmap", "uniform-1m"),
                ns("governor", "uniform-1m"),
            ),
            "the unsynchronized floor's own ratio, beside the 0.35 bound",
        ),
        (
            "baseline-atomic",
            "threads / single-thread decisions_per_sec",
            atomic_threads,
            "what threads gain here when no cache line is shared",
        ),
    ]
    .into_iter()
    .filter_map(|(policy, check, ratio, why)| {
        ratio.map(|ratio| Context {
            policy,
            check,
            ratio,
            why,
        })
    })
    .collect()
}

fn fmt_opt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{v:.digits$}"))
}

/// The machine, as the table's first line names it: cores, CPU model
/// and the load average when the run started (other work on the machine
/// slows every contender and the threaded rows most).
pub(super) fn machine(load_at_start: &str) -> String {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, m)| m.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".to_owned());
    format!("{cores} cores, {model}, load average at start {load_at_start}")
}

/// The load averages over 1, 5 and 15 minutes, as `/proc/loadavg` gives them.
pub(super) fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".to_owned())
}

/// Where Cloudflare's figure for the sliding-window counter comes from.
const CLOUDFLARE_SOURCE: &str = "Cloudflare, sliding-window-counter on 400 million requests of \
                                 real traffic from 270,000 sources";
/// How their traffic differs from the shapes measured here.
const CLOUDFLARE_NOTE: &str = "Their traffic is mostly far below the limit; these shapes come \
                               near it, pass it or attack its edges, so they show the worst of \
                               each policy rather than its everyday error. And a decision counts \
                               here when it differs from the exact log's on the same requests, \
                               even where the policy's own history made it right (see \
                               docs/bench.md).";

/// What the speed and memory rows leave out for this run's sizes, and
/// why: under the table, and in `--json`'s run row, so that a reader of
/// either can tell a missing column from a lost one.
fn speed_notes(plan: &Plan) -> Vec<String> {
    let mut notes = Vec::new();
    if plan.keys < MIN_MEMORY_KEYS {
        notes.push(format!(
            "bytes_per_key: not measured below --keys {MIN_MEMORY_KEYS} (resident memory moves \
             in 4 KiB pages, too coarse for {} keys)",
            plan.keys
        ));
    }
    if plan.threads < 2 {
        notes.push(format!(
            "uniform-1m-threads ran on one thread (--threads {}): no threads target",
            plan.threads
        ));
    }
    notes
}

fn print_table(
    rows: &[Row],
    targets: &[Target],
    context: &[Context],
    plan: &Plan,
    load_at_start: &str,
) -> String {
    let mut out = String::new();
    outln!(out, "machine: {}", machine(load_at_start));
    outln!(out,
        "speed and memory: reference configuration (100 per 1000 ms), {} keys, {} decisions x {} repetitions \
         (median); supplied time for every contender (an atomic millisecond counter, governor through \
         FakeRelativeClock)",
        plan.keys, plan.decisions, plan.reps
    );
    outln!(
        out,
        "{:<24} {:<20} {:>8} {:>15} {:>7} {:>15} {:>13}",
        "policy",
        "workload",
        "ns/dec",
        "decisions/s",
        "threads",
        "entries_tracked",
        "bytes_per_key"
    );
    for r in rows.iter().filter(|r| r.ns_per_decision.is_some()) {
        outln!(
            out,
            "{:<24} {:<20} {:>8} {:>15} {:>7} {:>15} {:>13}",
            r.policy,
            r.workload,
            fmt_opt(r.ns_per_decision, 1),
            fmt_opt(r.decisions_per_sec, 0),
            r.threads.map_or("-".into(), |t| t.to_string()),
            r.entries_tracked.map_or("-".into(), |t| t.to_string()),
            fmt_opt(r.bytes_per_key, 1),
        );
    }
    for note in speed_notes(plan) {
        outln!(out, "{note}");
    }
    outln!(out);
    outln!(
        out,
        "accuracy against sliding-log (exact), {} ms of traffic per shape, seed {}",
        plan.accuracy_duration_ms,
        plan.seed
    );
    outln!(
        out,
        "{:<24} {:<18} {:>9} {:>16} {:>17} {:>19}",
        "policy",
        "shape",
        "requests",
        "false_admit_pct",
        "false_reject_pct",
        "max_in_window_ratio"
    );
    for r in rows.iter().filter(|r| r.requests.is_some()) {
        outln!(
            out,
            "{:<24} {:<18} {:>9} {:>16} {:>17} {:>19}",
            r.policy,
            r.workload,
            r.requests.unwrap_or(0),
            fmt_opt(r.false_admit_pct, 4),
            fmt_opt(r.false_reject_pct, 4),
            fmt_opt(r.max_in_window_ratio, 3),
        );
    }
    outln!(
        out,
        "published ({CLOUDFLARE_SOURCE}): 0.003% wrongly allowed or limited, in total. \
         {CLOUDFLARE_NOTE}"
    );
    outln!(out);
    outln!(
        out,
        "targets (ratios within this run: for speed, the median over repetitions of each \
         repetition's ratio)"
    );
    for t in targets {
        outln!(
            out,
            "{:<24} {:<44} {:>7.3} {} {:<5} {}",
            t.policy,
            t.check,
            t.ratio,
            if t.at_least { ">=" } else { "<=" },
            t.bound,
            if t.met() { "met" } else { "MISSED" }
        );
    }
    for c in context {
        outln!(
            out,
            "{:<24} {:<44} {:>7.3} (no target: {})",
            c.policy,
            c.check,
            c.ratio,
            c.why
        );
    }
    out
}

fn bench(args: &Args, plan: &Plan) -> Result<()> {
    let load_at_start = load_average();
    let contenders: Vec<&str> = PolicyKind::ALL
        .iter()
        .map(|k| k.name())
        .chain(["governor"])
        .collect();
    // Setting up, the repetitions, the memory processes, the shapes.
    let steps = 1 + plan.reps + contenders.len() + Shape::ALL.len();
    let bar = ProgressBar::new(steps as u64);
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} {msg}")
            .expect("a valid template")
            .progress_chars("=> "),
    );
    bar.set_message("generating key sequences");
    let seq = Sequences::new(plan);
    bar.set_message("speed");
    let (mut rows, samples) = speed_rows(plan, &seq, &bar)?;
    drop(seq);
    bar.set_message("memory");
    // A measurement that failed (its process killed for memory, say)
    // leaves its row without bytes_per_key; the rest of the run, minutes
    // of it, is still printed before the run fails.
    let mut memory_failures = Vec::new();
    for name in contenders {
        if plan.keys < MIN_MEMORY_KEYS {
            bar.inc(1);
            continue;
        }
        let bytes_per_key = match measure_in_child(name, plan.keys) {
            Ok(Footprint { bytes_per_key, .. }) => bytes_per_key,
            Err(e) => {
                memory_failures.push(format!("{e:#}"));
                bar.inc(1);
                continue;
            }
        };
        if let Some(row) = rows
            .iter_mut()
            .find(|r| r.policy == name && r.workload == "uniform-1m")
        {
            row.bytes_per_key = Some(bytes_per_key);
        }
        bar.inc(1);
    }
    bar.set_message("accuracy");
    rows.extend(accuracy_rows(plan, &bar)?);
    bar.finish_and_clear();
    let targets = targets(&rows, &samples);
    let mut out = String::new();
    if args.json {
        // What the rows were measured with, so that a saved file can be
        // read on its own.
        outln!(
            out,
            "{}",
            json!({
                "policy": null, "workload": "run", "machine": machine(&load_at_start),
                "limit": REFERENCE_LIMIT, "window_ms": REFERENCE_WINDOW_MS,
                "keys": plan.keys, "decisions": plan.decisions, "reps": plan.reps,
                "threads": plan.threads, "accuracy_duration_ms": plan.accuracy_duration_ms,
                "seed": plan.seed, "time_source": "supplied", "notes": speed_notes(plan),
            })
        );
        for row in &rows {
            outln!(out, "{}", serde_json::to_string(row)?);
        }
        // In the table's order: the published figure under the accuracy
        // rows, then the targets.
        outln!(
            out,
            "{}",
            json!({
                "policy": "sliding-window-counter", "workload": "published",
                "source": CLOUDFLARE_SOURCE, "wrong_pct": 0.003, "note": CLOUDFLARE_NOTE,
            })
        );
        for t in &targets {
            outln!(
                out,
                "{}",
                json!({
                    "policy": t.policy, "workload": "target", "check": t.check,
                    "ratio": t.ratio, "bound": t.bound,
                    "direction": if t.at_least { "at_least" } else { "at_most" }, "met": t.met(),
                })
            );
        }
        for c in context(&rows, &samples) {
            outln!(
                out,
                "{}",
                json!({
                    "policy": c.policy, "workload": "context", "check": c.check,
                    "ratio": c.ratio, "note": c.why,
                })
            );
        }
    } else {
        out = print_table(
            &rows,
            &targets,
            &context(&rows, &samples),
            plan,
            &load_at_start,
        );
    }
    super::print_out(&out).context("cannot write to standard output")?;
    if !memory_failures.is_empty() {
        bail!(
            "{}; the rows above are without those bytes_per_key",
            memory_failures.join("; ")
        );
    }
    Ok(())
}

/// Why `flags`, given with the Redis store `store`, are refused, and the
/// command that measures Redis with sizes of its own. The URL is shown
/// without its password, which the user must put back: the message says
/// so rather than print a line that cannot be pasted as it stands.
fn memory_only_message(flags: &[&str], store: &str, quick: bool, json: bool) -> String {
    let shown = ratewarden_redis::redact_url(store);
    // The flags bench-redis takes too, as the user gave them.
    let kept = format!(
        "{}{}",
        if quick { " --quick" } else { "" },
        if json { " --json" } else { "" }
    );
    let hidden = if shown == store {
        String::new()
    } else {
        " (the URL you gave; its credentials are hidden here as ***: write them back)".to_owned()
    };
    // Quoted for a shell: a `redis+unix://` URL's query holds `?` and `&`.
    format!(
        "{} {} of the in-memory bench only; for Redis, run `ratewarden bench-redis \
         --store '{shown}'{kept}`{hidden}, which takes sizes of its own (--requests, --keys, \
         --pipeline, --connections, --round-trips, --rounds)",
        flags.join(", "),
        if flags.len() == 1 {
            "is an option"
        } else {
            "are options"
        }
    )
}

/// Runs `ratewarden bench`.
pub fn run(args: Args) -> ExitCode {
    if args.store != "memory" {
        // Every Redis-like URL goes to bench-redis, which says what is
        // wrong with the ones it does not take (TLS, a cluster).
        if ratewarden_redis::is_redis_like_url(&args.store) {
            let ignored = args.memory_only_flags();
            if !ignored.is_empty() {
                errln!(
                    "ratewarden bench: {}",
                    memory_only_message(&ignored, &args.store, args.quick, args.json)
                );
                return ExitCode::from(2);
            }
            return super::bench_redis::run(super::bench_redis::Args {
                command: "bench",
                ..super::bench_redis::Args::defaults(args.store, args.quick, args.json)
            });
        }
        errln!(
            "ratewarden bench: {}",
            ratewarden_server::store::unknown_store(
                &args.store,
                "memory, redis://HOST:PORT or redis+unix:///PATH"
            )
        );
        return ExitCode::from(2);
    }
    // Sizes out of their bounds are mistakes in the command line, as
    // clap's own refusals are: exit status 2, where 1 is a run that failed.
    let plan = match Plan::from_args(&args) {
        Ok(plan) => plan,
        Err(e) => {
            errln!("ratewarden bench: {e:#}");
            return ExitCode::from(2);
        }
    };
    match bench(&args, &plan) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            errln!("ratewarden bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Runs the hidden `bench-memory` subcommand: prints one JSON footprint.
pub fn run_memory(args: MemoryArgs) -> ExitCode {
    if args.while_stdin_open {
        std::thread::spawn(|| {
            // Nothing is ever written: the read ends when the pipe closes.
            let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
            errln!("ratewarden bench-memory: bench, which started it, has gone; stopping");
            std::process::exit(1);
        });
    }
    match measure_here(&args.contender, args.keys) {
        Ok(footprint) => match serde_json::to_string(&footprint) {
            Ok(line) => match super::print_out(&format!("{line}\n")) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    errln!("ratewarden bench-memory: cannot write to standard output: {e}");
                    ExitCode::FAILURE
                }
            },
            Err(e) => {
                errln!("ratewarden bench-memory: {e}");
                ExitCode::FAILURE
            }
        },
        Err(e) => {
            errln!("ratewarden bench-memory: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target<'t>(targets: &'t [Target], policy: &str, check: &str) -> &'t Target {
        targets
            .iter()
            .find(|t| t.policy == policy && t.check == check)
            .unwrap_or_else(|| panic!("no target {policy} / {check}"))
    }

    #[test]
    fn memory_only_flags_with_redis_point_at_bench_redis() {
        let m = memory_only_message(&["--seed"], "redis://127.0.0.1:6379", false, false);
        assert!(
            m.starts_with("--seed is an option of the in-memory bench only"),
            "{m}"
        );
        assert!(
            m.contains("`ratewarden bench-redis --store 'redis://127.0.0.1:6379'`,"),
            "{m}"
        );
        // --quick and --json, which bench-redis takes too, are kept.
        let m = memory_only_message(&["--seed"], "redis://127.0.0.1:6379", true, true);
        assert!(
            m.contains("`ratewarden bench-redis --store 'redis://127.0.0.1:6379' --quick --json`,"),
            "{m}"
        );
        let m = memory_only_message(&["--keys", "--seed"], "redis://:s3cret@h:1", false, false);
        assert!(m.starts_with("--keys, --seed are options"), "{m}");
        assert!(!m.contains("s3cret"), "{m}");
        assert!(m.contains("redis://:***@h:1"), "{m}");
        assert!(m.contains("hidden here as ***: write them back"), "{m}");
    }

    #[test]
    fn the_default_threads_fit_the_bounds_on_any_machine() {
        assert_eq!(default_threads(2, 2_000_000), 2);
        assert_eq!(default_threads(1, 2_000_000), 1);
        // More cores than the flag allows: the most it allows.
        assert_eq!(default_threads(1024, 500_000), MAX_THREADS);
        // 197 threads and the three shared sequences of 2,000,000 keys
        // each are the 400,000,000 the sequences may hold.
        assert_eq!(default_threads(300, 2_000_000), 197);
        assert_eq!(default_threads(4, 100_000_000), 1);
        for (cores, decisions) in [(1024, 2_000_000), (300, 100_000), (64, 7_000_000)] {
            let threads = default_threads(cores, decisions);
            assert!((threads + 3) * decisions <= MAX_SEQUENCE_KEYS);
        }
    }

    #[test]
    fn speed_targets_take_the_median_of_each_repetitions_ratio() {
        // Per repetition gcra takes 0.4, 0.2 and 0.5 of governor's time:
        // the median ratio is 0.4, where dividing the medians (40 / 200)
        // would give 0.2.
        let samples: Samples = vec![
            ("gcra".into(), "uniform-1m", vec![40.0, 40.0, 150.0]),
            ("governor".into(), "uniform-1m", vec![100.0, 200.0, 300.0]),
            ("gcra".into(), "uniform-1m-threads", vec![20.0, 40.0, 100.0]),
        ];
        let rows = vec![
            Row {
                policy: "gcra".into(),
                workload: "uniform-1m".into(),
                ns_per_decision: Some(40.0),
                bytes_per_key: Some(18.0),
                ..Row::default()
            },
            Row {
                policy: "governor".into(),
                workload: "uniform-1m".into(),
                ns_per_decision: Some(200.0),
                bytes_per_key: Some(36.0),
                ..Row::default()
            },
            Row {
                policy: "gcra".into(),
                workload: "uniform-1m-threads".into(),
                ns_per_decision: Some(40.0),
                threads: Some(2),
                ..Row::default()
            },
        ];
        let targets = targets(&rows, &samples);
        let vs_governor = target(&targets, "gcra", "uniform-1m ns / governor's");
        assert!(
            (vs_governor.ratio - 0.4).abs() < 1e-12,
            "{}",
            vs_governor.ratio
        );
        assert!(!vs_governor.met());
        // Threads: 2.0, 1.0 and 1.5 times the single thread's rate.
        let threads = target(
            &targets,
            "gcra",
            "threads / single-thread decisions_per_sec",
        );
        assert!((threads.ratio - 1.5).abs() < 1e-12, "{}", threads.ratio);
        assert!(!threads.met());
        let bytes = target(&targets, "gcra", "bytes_per_key / governor's");
        assert!((bytes.ratio - 0.5).abs() < 1e-12 && bytes.met());
        // No samples, no target: nothing is invented for a missing peer.
        assert!(targets.iter().all(|t| t.check != "hot-key ns / governor's"));
        // One thread has nothing to gain from threads: no target.
        let mut one = rows.clone();
        one[2].threads = Some(1);
        let targets = super::targets(&one, &samples);
        assert!(targets
            .iter()
            .all(|t| t.check != "threads / single-thread decisions_per_sec"));
    }

    #[test]
    fn context_lines_pair_the_peers_per_repetition_and_skip_missing_ones() {
        // The bare map takes 0.5, 0.2 and 0.4 of governor's time: 0.4.
        let samples: Samples = vec![
            (
                "baseline-hashmap".into(),
                "uniform-1m",
                vec![50.0, 40.0, 120.0],
            ),
            ("governor".into(), "uniform-1m", vec![100.0, 200.0, 300.0]),
        ];
        let lines = context(&[], &samples);
        assert_eq!(lines.len(), 1, "no baseline-atomic samples, no line");
        assert_eq!(lines[0].policy, "baseline-hashmap");
        assert!((lines[0].ratio - 0.4).abs() < 1e-12, "{}", lines[0].ratio);
    }
}
