//! The Redis benchmark: pipelined decisions per second and single-call
//! round trips (p50, p99) for each policy, beside `redis-benchmark`'s
//! figures for `INCR` and for `EVALSHA` of a minimal sliding-window counter
//! script, all against one Redis in the same run; then the issue's two
//! targets, measured in interleaved rounds: the server CPU per call
//! (`INFO commandstats`) of the project's sliding-window counter script
//! against the minimal one, and this client's pipelined throughput against
//! `redis-benchmark`'s for the minimal script. Each target is judged by the
//! median of its per-round ratios, so that one noisy moment on a shared
//! machine cannot decide it.
//!
//! Run as `ratewarden bench-redis --store redis://HOST:PORT`. Every key it
//! writes is under one prefix, `ratewarden-bench%3A<pid>:` (the store's
//! escaped form of `ratewarden-bench:<pid>`): the scripts' keys expire
//! within two seconds, and the keys of `redis-benchmark`'s `INCR`, which
//! sets no TTL, are removed when that step ends. It resets the server's
//! command statistics.

use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ratewarden_core::{PolicyConfig, PolicyKind, REFERENCE};
use ratewarden_redis::{escape_key_part, redact_url, RedisOptions, RedisStore};
use serde_json::json;

const MINIMAL_SWC: &str = include_str!("lua/minimal_swc.lua");

/// The issue's bound on server CPU per call, ours over the minimal script's.
const CPU_RATIO_AT_MOST: f64 = 1.2;
/// The issue's bound on this client's pipelined throughput over
/// `redis-benchmark`'s `EVALSHA` of the minimal script.
const THROUGHPUT_SHARE_AT_LEAST: f64 = 0.8;
/// The most rounds a run may take: each lasts seconds.
const MAX_ROUNDS: usize = 50;
/// Each round measures both scripts in this many slices of `--requests /
/// SLICES` requests, alternating A B B A ..., so that load that comes and
/// goes on a shared machine falls on both scripts alike.
const SLICES: u64 = 4;

/// Arguments of `ratewarden bench-redis`.
#[derive(clap::Args)]
pub struct Args {
    /// The Redis to measure: `redis://[[USER]:PASSWORD@]HOST:PORT[/DB]`
    /// (one standalone node; redis-benchmark is pointed at the same host,
    /// port, database and credentials).
    #[arg(long)]
    pub store: String,
    /// Decisions per pipelined measurement (per policy, and per script in
    /// each round).
    #[arg(long, default_value_t = 200_000, value_parser = crate::cmd::whole::<u64>)]
    pub requests: u64,
    /// Requests per pipelined batch.
    #[arg(long, default_value_t = 16, value_parser = crate::cmd::whole::<usize>)]
    pub pipeline: usize,
    /// Connections used at once, each with its own batches.
    #[arg(long, default_value_t = 4, value_parser = crate::cmd::whole::<usize>)]
    pub connections: usize,
    /// Distinct keys the requests spread over.
    #[arg(long, default_value_t = 10_000, value_parser = crate::cmd::whole::<u64>)]
    pub keys: u64,
    /// Single calls timed for the round-trip percentiles (per policy).
    #[arg(long, default_value_t = 5_000, value_parser = crate::cmd::whole::<usize>)]
    pub round_trips: usize,
    /// Interleaved rounds measuring the two targets; each target is judged
    /// by the median of its per-round ratios [default: 5; 3 with --quick].
    #[arg(long, value_parser = crate::cmd::whole::<usize>)]
    pub rounds: Option<usize>,
    /// A shorter run: a tenth of the requests and round trips, 3 rounds.
    #[arg(long)]
    pub quick: bool,
    /// One JSON object per line on standard output instead of the tables.
    #[arg(long)]
    pub json: bool,
}

impl Args {
    /// The default sizes, as the command line gives them, for `store`;
    /// `quick` divides the work by ten and takes 3 rounds; `json` prints
    /// JSON lines.
    pub fn defaults(store: String, quick: bool, json: bool) -> Self {
        Args {
            store,
            requests: 200_000,
            pipeline: 16,
            connections: 4,
            keys: 10_000,
            round_trips: 5_000,
            rounds: None,
            quick,
            json,
        }
    }

    /// The sizes of this run, `--quick` applied.
    fn plan(&self) -> Plan {
        let scale = if self.quick { 10 } else { 1 };
        Plan {
            requests: (self.requests / scale).max(1),
            round_trips: self.round_trips / scale as usize,
            rounds: self.rounds.unwrap_or(if self.quick { 3 } else { 5 }),
        }
    }
}

/// The sizes a run uses.
struct Plan {
    requests: u64,
    round_trips: usize,
    rounds: usize,
}

/// One policy's figures.
struct PolicyFigures {
    policy: PolicyKind,
    decisions_per_s: f64,
    round_trip_us_p50: f64,
    round_trip_us_p99: f64,
    server_usec_per_call: Option<f64>,
}

/// Sums over a round's slices of one script's measurements.
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    requests: f64,
    seconds: f64,
    calls: f64,
    usec: f64,
}

impl Tally {
    fn add(&mut self, requests: f64, seconds: f64, calls: f64, usec: f64) {
        self.requests += requests;
        self.seconds += seconds;
        self.calls += calls;
        self.usec += usec;
    }

    fn per_s(&self) -> f64 {
        self.requests / self.seconds
    }

    fn usec_per_call(&self) -> f64 {
        self.usec / self.calls
    }
}

/// One round's figures for the two targets, all taken back to back.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Round {
    /// Whether the minimal script was measured first in this round.
    minimal_first: bool,
    /// `redis-benchmark`, `EVALSHA` of the minimal script: requests/s.
    minimal_per_s: f64,
    /// The server's `usec_per_call` over that run.
    minimal_usec_per_call: f64,
    /// `redis-benchmark`, `EVALSHA` of the sliding-window counter script.
    ours_usec_per_call: f64,
    /// This client's pipelined sliding-window counter decisions/s.
    ours_client_per_s: f64,
}

impl Round {
    /// Server CPU per call, ours over the minimal script's.
    fn cpu_ratio(&self) -> f64 {
        self.ours_usec_per_call / self.minimal_usec_per_call
    }

    /// This client's pipelined throughput over redis-benchmark's for the
    /// minimal script.
    fn throughput_share(&self) -> f64 {
        self.ours_client_per_s / self.minimal_per_s
    }
}

/// The median of `values` (the mean of the middle two for an even count),
/// `None` when there are none or one is not a number.
fn median(values: &[f64]) -> Option<f64> {
    if values.is_empty() || values.iter().any(|v| v.is_nan()) {
        return None;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mid = sorted.len() / 2;
    Some(if sorted.len() % 2 == 1 {
        sorted[mid]
    } else {
        (sorted[mid - 1] + sorted[mid]) / 2.0
    })
}

/// The two targets judged over a run's rounds: the medians of the
/// per-round ratios.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Verdict {
    cpu_ratio_median: f64,
    throughput_share_median: f64,
}

impl Verdict {
    fn of(rounds: &[Round]) -> Option<Verdict> {
        let cpu: Vec<f64> = rounds.iter().map(Round::cpu_ratio).collect();
        let share: Vec<f64> = rounds.iter().map(Round::throughput_share).collect();
        Some(Verdict {
            cpu_ratio_median: median(&cpu)?,
            throughput_share_median: median(&share)?,
        })
    }

    fn cpu_met(&self) -> bool {
        self.cpu_ratio_median <= CPU_RATIO_AT_MOST
    }

    fn throughput_met(&self) -> bool {
        self.throughput_share_median >= THROUGHPUT_SHARE_AT_LEAST
    }
}

/// Runs the benchmark and prints its tables.
pub fn run(args: Args) -> ExitCode {
    match run_inner(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench-redis: {e}");
            ExitCode::from(2)
        }
    }
}

/// What every run of the minimal and the project's sliding-window counter
/// scripts shares: the server, the client sizes and the prepared commands.
struct Drivers<'a> {
    args: &'a Args,
    runtime: &'a tokio::runtime::Runtime,
    admin: redis::Connection,
    /// Requests per slice, for each script and driver.
    slice_requests: u64,
    /// `redis-benchmark`'s host, port, request count (one slice's),
    /// connections, pipeline.
    common: Vec<String>,
    /// `redis-benchmark`'s arguments for `EVALSHA` of the minimal script.
    minimal_args: Vec<String>,
    /// `redis-benchmark`'s arguments for `EVALSHA` of ours.
    ours_args: Vec<String>,
    /// This client's connections deciding by the sliding-window counter.
    ours_stores: Vec<RedisStore>,
}

impl Drivers<'_> {
    /// redis-benchmark on `extra`, added to `tally` with the server's
    /// `EVALSHA` statistics over exactly that run.
    fn redis_benchmark_evalsha(
        &mut self,
        extra: &[String],
        tally: &mut Tally,
    ) -> Result<(), String> {
        reset_stats(&mut self.admin)?;
        let rate = redis_benchmark(&self.common, extra)?;
        let (calls, usec) = commandstat(&mut self.admin, "evalsha")?
            .ok_or("INFO commandstats has no evalsha after redis-benchmark ran it")?;
        let n = self.slice_requests as f64;
        tally.add(n, n / rate, calls, usec);
        Ok(())
    }

    /// One slice of the minimal script, driven by redis-benchmark.
    fn minimal(&mut self, tally: &mut Tally) -> Result<(), String> {
        let extra = self.minimal_args.clone();
        self.redis_benchmark_evalsha(&extra, tally)
    }

    /// One slice of ours: driven by redis-benchmark for the server's CPU,
    /// then through this client for throughput.
    fn ours(&mut self, cpu: &mut Tally, client: &mut Tally) -> Result<(), String> {
        let extra = self.ours_args.clone();
        self.redis_benchmark_evalsha(&extra, cpu)?;
        let (done, seconds) =
            self.runtime
                .block_on(pipelined(&self.ours_stores, self.args, self.slice_requests))?;
        client.add(done as f64, seconds, 0.0, 0.0);
        Ok(())
    }

    /// One round: the minimal script and ours in alternating slices,
    /// starting with the minimal one or with ours.
    fn round(&mut self, minimal_first: bool) -> Result<Round, String> {
        let (mut minimal, mut cpu, mut client) = Default::default();
        for slice in 0..SLICES {
            let minimal_now = (slice % 2 == 0) == minimal_first;
            if minimal_now {
                self.minimal(&mut minimal)?;
            }
            self.ours(&mut cpu, &mut client)?;
            if !minimal_now {
                self.minimal(&mut minimal)?;
            }
        }
        let minimal: Tally = minimal;
        let (cpu, client): (Tally, Tally) = (cpu, client);
        Ok(Round {
            minimal_first,
            minimal_per_s: minimal.per_s(),
            minimal_usec_per_call: minimal.usec_per_call(),
            ours_usec_per_call: cpu.usec_per_call(),
            ours_client_per_s: client.per_s(),
        })
    }
}

fn run_inner(args: &Args) -> Result<(), String> {
    if args.requests == 0 || args.pipeline == 0 || args.connections == 0 || args.keys == 0 {
        return Err("--requests, --pipeline, --connections and --keys must be at least 1".into());
    }
    let plan = args.plan();
    if args.pipeline > ratewarden_redis::MAX_BATCH
        || args.connections > 256
        || args.round_trips > 1_000_000
        || args.requests > 100_000_000
    {
        return Err(format!(
            "use --pipeline up to {}, --connections up to 256, --round-trips up to 1000000, \
             --requests up to 100000000",
            ratewarden_redis::MAX_BATCH
        ));
    }
    if plan.rounds == 0 || plan.rounds > MAX_ROUNDS {
        return Err(format!(
            "--rounds is {}: use 1 to {MAX_ROUNDS}",
            plan.rounds
        ));
    }
    let started = Instant::now();
    let load_at_start = super::bench::load_average();
    let target = redis_benchmark_target(&args.store)?;
    // One client thread, as redis-benchmark has: on a small machine a
    // second worker thread only takes a core from the server it measures,
    // and hands every reply across threads.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))?;
    let client = redis::Client::open(args.store.as_str()).map_err(|e| e.to_string())?;
    let mut admin = client
        .get_connection_with_timeout(Duration::from_secs(2))
        .map_err(|e| format!("cannot connect to {}: {e}", redact_url(&args.store)))?;
    // The store's own refusal of a cluster node points at redis-cluster://,
    // which this benchmark does not take: say here what it does take.
    let cluster_info: String = redis::cmd("INFO")
        .arg("cluster")
        .query(&mut admin)
        .unwrap_or_default();
    if ratewarden_redis::cluster_enabled(&cluster_info) == Some(true) {
        return Err(format!(
            "Redis at {} is a cluster node; bench-redis measures one standalone \
             redis-server (its keys all on that server, as redis-benchmark's are): point \
             --store at a redis-server started without cluster-enabled",
            redact_url(&args.store)
        ));
    }
    let prefix = format!("ratewarden-bench:{}", std::process::id());
    // The store escapes its prefix (`:` becomes `%3A`); the keys this
    // benchmark names itself go under the same escaped form, so that one
    // pattern finds every key of the run.
    let key_prefix = format!("{}:", escape_key_part(&prefix));

    let mut figures = Vec::new();
    for policy in PolicyKind::ALL {
        let config = PolicyConfig::new(policy, REFERENCE.limit, REFERENCE.window_ms);
        let stores =
            runtime.block_on(connect_all(&args.store, config, &prefix, args.connections))?;
        let (p50, p99) = runtime.block_on(round_trips(&stores[0], plan.round_trips, args.keys))?;
        reset_stats(&mut admin)?;
        let (done, seconds) = runtime.block_on(pipelined(&stores, args, plan.requests))?;
        let rate = done as f64 / seconds;
        let usec = usec_per_call(&mut admin, "evalsha")?;
        figures.push(PolicyFigures {
            policy,
            decisions_per_s: rate,
            round_trip_us_p50: p50,
            round_trip_us_p99: p99,
            server_usec_per_call: usec,
        });
    }

    // The baseline script, through this client and through redis-benchmark.
    let sha: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(MINIMAL_SWC)
        .query(&mut admin)
        .map_err(|e| format!("SCRIPT LOAD: {e}"))?;
    reset_stats(&mut admin)?;
    let minimal_rate = runtime.block_on(pipelined_minimal(
        &args.store,
        &sha,
        &key_prefix,
        args,
        &plan,
    ))?;
    let minimal_usec = usec_per_call(&mut admin, "evalsha")?;
    let slice_requests = (plan.requests / SLICES).max(1);
    let common_with = |n: u64| -> Vec<String> {
        let mut common = target.clone();
        common.extend(
            [
                "-n",
                &n.to_string(),
                "-c",
                &args.connections.to_string(),
                "-P",
                &args.pipeline.to_string(),
                "-q",
            ]
            .map(str::to_owned),
        );
        common
    };
    let keys = args.keys.to_string();
    let incr = incr_step(&mut admin, &common_with(plan.requests), &keys, &key_prefix)
        .map_err(|e| format!("redis-benchmark INCR: {e}"))?;
    let minimal_args: Vec<String> = [
        "-r",
        keys.as_str(),
        "EVALSHA",
        sha.as_str(),
        "1",
        &format!("{key_prefix}minimal:__rand_int__"),
        &REFERENCE.limit.to_string(),
        &REFERENCE.window_ms.to_string(),
    ]
    .map(str::to_owned)
    .to_vec();

    // The targets, both scripts' server CPU driven by redis-benchmark (a
    // light C client), so that a busy client process sharing the machine
    // does not inflate one figure more than the other.
    let ours_stores = runtime.block_on(connect_all(
        &args.store,
        REFERENCE,
        &prefix,
        args.connections,
    ))?;
    // One call loads the script (EVALSHA, then SCRIPT LOAD on NOSCRIPT).
    runtime
        .block_on(ours_stores[0].decide(0, None, 0))
        .map_err(|e| e.to_string())?;
    let key = ours_stores[0].key_name(0);
    let mut ours_args = vec![
        "-r".to_owned(),
        keys.clone(),
        "EVALSHA".to_owned(),
        ours_stores[0].script_sha().to_owned(),
        "1".to_owned(),
        format!("{}__rand_int__", key.strip_suffix('0').unwrap_or(&key)),
    ];
    ours_args.extend(ours_stores[0].script_args(1, None));
    let mut drivers = Drivers {
        args,
        runtime: &runtime,
        admin,
        slice_requests,
        common: common_with(slice_requests),
        minimal_args,
        ours_args,
        ours_stores,
    };
    let mut rounds = Vec::with_capacity(plan.rounds);
    for i in 0..plan.rounds {
        // Alternate which script goes first, so that a machine warming up
        // or slowing down over a round favours neither.
        rounds.push(drivers.round(i % 2 == 0)?);
    }
    let verdict = Verdict::of(&rounds).ok_or("a round gave no figure")?;
    let elapsed_s = started.elapsed().as_secs_f64();
    let load_at_end = super::bench::load_average();

    if args.json {
        print_json(&figures, minimal_rate, incr, &rounds, &verdict, elapsed_s);
        println!(
            "{}",
            json!({ "load_average_at_start": load_at_start, "load_average_at_end": load_at_end })
        );
        return Ok(());
    }
    println!("machine: {}", super::bench::machine(&load_at_start));
    println!(
        "Redis at {}: {} requests per measurement, pipeline {}, {} connections, {} keys; \
         reference numbers ({} per {} ms); {} rounds",
        redact_url(&args.store),
        plan.requests,
        args.pipeline,
        args.connections,
        args.keys,
        REFERENCE.limit,
        REFERENCE.window_ms,
        plan.rounds
    );
    println!(
        "{:<26} {:>12} {:>11} {:>11} {:>17}",
        "policy", "decisions/s", "rtt_us_p50", "rtt_us_p99", "server_usec/call"
    );
    let show = |u: Option<f64>| u.map_or("-".to_owned(), |u| format!("{u:.2}"));
    for f in &figures {
        println!(
            "{:<26} {:>12.0} {:>11.1} {:>11.1} {:>17}",
            f.policy.name(),
            f.decisions_per_s,
            f.round_trip_us_p50,
            f.round_trip_us_p99,
            show(f.server_usec_per_call)
        );
    }
    println!(
        "{:<26} {:>12.0} {:>11} {:>11} {:>17}",
        "minimal-swc (this client)",
        minimal_rate,
        "-",
        "-",
        show(minimal_usec)
    );
    println!("redis-benchmark INCR: {incr:.0} requests/s");
    println!();
    println!(
        "Targets, per round (redis-benchmark EVALSHA for both scripts' server CPU; \
         this client's pipelined sliding-window-counter against redis-benchmark's minimal):"
    );
    println!(
        "{:>5} {:>8} {:>13} {:>13} {:>10} {:>13} {:>13} {:>8}",
        "round",
        "first",
        "minimal_usec",
        "ours_usec",
        "cpu_ratio",
        "minimal_rb/s",
        "ours_client/s",
        "share"
    );
    for (i, r) in rounds.iter().enumerate() {
        println!(
            "{:>5} {:>8} {:>13.2} {:>13.2} {:>9.2}x {:>13.0} {:>13.0} {:>7.0}%",
            i + 1,
            if r.minimal_first { "minimal" } else { "ours" },
            r.minimal_usec_per_call,
            r.ours_usec_per_call,
            r.cpu_ratio(),
            r.minimal_per_s,
            r.ours_client_per_s,
            r.throughput_share() * 100.0
        );
    }
    println!(
        "server CPU per call, sliding-window-counter / minimal, median of {} rounds: {:.2}x \
         (target at most {CPU_RATIO_AT_MOST}x: {})",
        rounds.len(),
        verdict.cpu_ratio_median,
        met(verdict.cpu_met())
    );
    println!(
        "pipelined sliding-window-counter through this client / redis-benchmark EVALSHA \
         minimal, median of {} rounds: {:.0}% (target at least {:.0}%: {})",
        rounds.len(),
        verdict.throughput_share_median * 100.0,
        THROUGHPUT_SHARE_AT_LEAST * 100.0,
        met(verdict.throughput_met())
    );
    println!("run took {elapsed_s:.0} s; load average at end {load_at_end}");
    Ok(())
}

/// `redis-benchmark`'s `INCR`, Redis's simplest write, for scale: over
/// `keys` keys under `key_prefix`, as the scripts' requests are spread.
/// `INCR` sets no TTL, so its keys are removed as soon as the step ends,
/// whether it ended well or not.
fn incr_step(
    admin: &mut redis::Connection,
    common: &[String],
    keys: &str,
    key_prefix: &str,
) -> Result<f64, String> {
    let extra = [
        "-r".to_owned(),
        keys.to_owned(),
        "INCR".to_owned(),
        format!("{key_prefix}incr:__rand_int__"),
    ];
    let rate = redis_benchmark(common, &extra);
    let pattern = format!("{key_prefix}incr:*");
    let removed = remove_keys(admin, &pattern).map_err(|e| {
        format!(
            "removing its keys, which have no TTL: {e}; remove them with \
             redis-cli --scan --pattern '{pattern}' | xargs redis-cli unlink"
        )
    });
    match (rate, removed) {
        (Ok(rate), Ok(_)) => Ok(rate),
        (Err(e), Ok(_)) => Err(e),
        (Ok(_), Err(cleanup)) => Err(cleanup),
        (Err(e), Err(cleanup)) => Err(format!("{e}; then {cleanup}")),
    }
}

/// Removes every key matching `pattern`, one `SCAN` page at a time (each
/// page's keys in one `UNLINK`), so that neither a reply nor a command
/// grows with the number of keys. Returns how many were removed.
fn remove_keys(admin: &mut redis::Connection, pattern: &str) -> Result<u64, String> {
    let mut cursor = 0u64;
    let mut removed = 0;
    loop {
        let (next, keys): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000)
            .query(admin)
            .map_err(|e| format!("SCAN: {e}"))?;
        if !keys.is_empty() {
            removed += redis::cmd("UNLINK")
                .arg(&keys)
                .query::<u64>(admin)
                .map_err(|e| format!("UNLINK: {e}"))?;
        }
        if next == 0 {
            return Ok(removed);
        }
        cursor = next;
    }
}

fn met(yes: bool) -> &'static str {
    if yes {
        "met"
    } else {
        "not met"
    }
}

fn print_json(
    figures: &[PolicyFigures],
    minimal_rate: f64,
    incr: f64,
    rounds: &[Round],
    verdict: &Verdict,
    elapsed_s: f64,
) {
    for f in figures {
        println!(
            "{}",
            json!({
                "policy": f.policy.name(), "decisions_per_s": f.decisions_per_s,
                "round_trip_us_p50": f.round_trip_us_p50, "round_trip_us_p99": f.round_trip_us_p99,
                "server_usec_per_call": f.server_usec_per_call,
            })
        );
    }
    println!(
        "{}",
        json!({ "policy": "minimal-swc", "client": "ratewarden", "decisions_per_s": minimal_rate })
    );
    println!(
        "{}",
        json!({ "command": "INCR", "client": "redis-benchmark", "requests_per_s": incr })
    );
    for (i, r) in rounds.iter().enumerate() {
        println!(
            "{}",
            json!({
                "round": i + 1, "first": if r.minimal_first { "minimal" } else { "ours" },
                "minimal_usec_per_call": r.minimal_usec_per_call,
                "ours_usec_per_call": r.ours_usec_per_call, "cpu_ratio": r.cpu_ratio(),
                "minimal_requests_per_s": r.minimal_per_s,
                "ours_client_decisions_per_s": r.ours_client_per_s,
                "throughput_share": r.throughput_share(),
            })
        );
    }
    println!(
        "{}",
        json!({
            "target": "server_cpu_ratio", "median": verdict.cpu_ratio_median,
            "bound": CPU_RATIO_AT_MOST, "direction": "at_most", "met": verdict.cpu_met(),
            "rounds": rounds.len(),
        })
    );
    println!(
        "{}",
        json!({
            "target": "throughput_share", "median": verdict.throughput_share_median,
            "bound": THROUGHPUT_SHARE_AT_LEAST, "direction": "at_least",
            "met": verdict.throughput_met(), "rounds": rounds.len(),
        })
    );
    println!("{}", json!({ "elapsed_s": elapsed_s }));
}

/// Where `redis-benchmark` is pointed: the store URL's host, port,
/// database and credentials, as its own options.
fn redis_benchmark_target(url: &str) -> Result<Vec<String>, String> {
    if !url.starts_with("redis://") {
        return Err(format!(
            "{:?}: bench-redis measures one standalone redis-server, named \
             redis://HOST:PORT (not a cluster: its keys would hash to other nodes, and \
             redis-benchmark, the peer it is measured against, drives one node)",
            redact_url(url)
        ));
    }
    let info: redis::ConnectionInfo = url
        .parse()
        .map_err(|e| format!("{:?} is not a Redis URL: {e}", redact_url(url)))?;
    let redis::ConnectionAddr::Tcp(host, port) = info.addr else {
        return Err(format!(
            "{:?}: bench-redis takes redis://HOST:PORT",
            redact_url(url)
        ));
    };
    let mut target = vec!["-h".to_owned(), host, "-p".to_owned(), port.to_string()];
    if info.redis.db != 0 {
        target.extend(["--dbnum".to_owned(), info.redis.db.to_string()]);
    }
    // redis-benchmark reads a password only from its command line (unlike
    // redis-cli, it ignores REDISCLI_AUTH), where other users of this
    // machine can see it while it runs: say so.
    if let Some(password) = info.redis.password {
        eprintln!(
            "bench-redis: the URL's password is passed to redis-benchmark as -a, visible in \
             this machine's process list while it runs"
        );
        if let Some(user) = info.redis.username {
            target.extend(["--user".to_owned(), user]);
        }
        target.extend(["-a".to_owned(), password]);
    }
    Ok(target)
}

async fn connect_all(
    url: &str,
    config: PolicyConfig,
    prefix: &str,
    n: usize,
) -> Result<Vec<RedisStore>, String> {
    let mut stores = Vec::with_capacity(n);
    for _ in 0..n {
        let options = RedisOptions {
            prefix: prefix.to_owned(),
            // Throughput is measured here, not failure handling: a long
            // timeout keeps a slow moment from ending the run.
            timeout_ms: 10_000,
            ..RedisOptions::default()
        };
        stores.push(
            RedisStore::connect(url, config, options)
                .await
                .map_err(|e| e.to_string())?,
        );
    }
    Ok(stores)
}

async fn round_trips(store: &RedisStore, n: usize, keys: u64) -> Result<(f64, f64), String> {
    let mut us = Vec::with_capacity(n);
    for i in 0..n {
        let started = Instant::now();
        store
            .decide(i as u64 % keys, None, 1)
            .await
            .map_err(|e| e.to_string())?;
        us.push(started.elapsed().as_secs_f64() * 1e6);
    }
    if us.is_empty() {
        return Ok((0.0, 0.0));
    }
    us.sort_by(f64::total_cmp);
    let at = |q: f64| us[((us.len() - 1) as f64 * q).round() as usize];
    Ok((at(0.50), at(0.99)))
}

/// Decides `requests` requests in pipelined batches over `stores` (one
/// connection each); returns how many were decided and in how many seconds.
async fn pipelined(
    stores: &[RedisStore],
    args: &Args,
    requests: u64,
) -> Result<(u64, f64), String> {
    let per_conn = (requests / stores.len() as u64).max(1);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (c, store) in stores.iter().enumerate() {
        let store = store.clone();
        let (batch, keys) = (args.pipeline as u64, args.keys);
        tasks.push(tokio::spawn(async move {
            let mut done = 0u64;
            let mut next = c as u64 * 7919;
            while done < per_conn {
                let n = batch.min(per_conn - done);
                let requests: Vec<(u64, u64)> = (0..n).map(|i| ((next + i) % keys, 1)).collect();
                next += n;
                for r in store
                    .decide_many(&requests, None)
                    .await
                    .map_err(|e| e.to_string())?
                {
                    r.map_err(|e| e.to_string())?;
                }
                done += n;
            }
            Ok::<u64, String>(done)
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await.map_err(|e| e.to_string())??;
    }
    Ok((total, started.elapsed().as_secs_f64()))
}

async fn pipelined_minimal(
    url: &str,
    sha: &str,
    key_prefix: &str,
    args: &Args,
    plan: &Plan,
) -> Result<f64, String> {
    let client = redis::Client::open(url).map_err(|e| e.to_string())?;
    let per_conn = (plan.requests / args.connections as u64).max(1);
    let sha: Arc<str> = sha.into();
    let started = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..args.connections {
        let mut conn = client
            .get_multiplexed_async_connection()
            .await
            .map_err(|e| e.to_string())?;
        let (sha, key_prefix) = (Arc::clone(&sha), key_prefix.to_owned());
        let (batch, keys) = (args.pipeline as u64, args.keys);
        tasks.push(tokio::spawn(async move {
            let mut done = 0u64;
            let mut next = c as u64 * 7919;
            while done < per_conn {
                let n = batch.min(per_conn - done);
                let mut pipe = redis::pipe();
                for i in 0..n {
                    pipe.cmd("EVALSHA")
                        .arg(&*sha)
                        .arg(1)
                        .arg(format!("{key_prefix}minimal:{}", (next + i) % keys))
                        .arg(REFERENCE.limit)
                        .arg(REFERENCE.window_ms);
                }
                next += n;
                let _: Vec<i64> = pipe
                    .query_async(&mut conn)
                    .await
                    .map_err(|e| e.to_string())?;
                done += n;
            }
            Ok::<u64, String>(done)
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await.map_err(|e| e.to_string())??;
    }
    Ok(total as f64 / started.elapsed().as_secs_f64())
}

fn reset_stats(admin: &mut redis::Connection) -> Result<(), String> {
    redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query::<()>(admin)
        .map_err(|e| format!("CONFIG RESETSTAT: {e}"))
}

/// `usec_per_call` of one command from `INFO commandstats`.
fn usec_per_call(admin: &mut redis::Connection, command: &str) -> Result<Option<f64>, String> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(admin)
        .map_err(|e| format!("INFO: {e}"))?;
    let tag = format!("cmdstat_{command}:");
    Ok(info.lines().find_map(|l| {
        let stats = l.strip_prefix(&tag)?;
        stats
            .split(',')
            .find_map(|kv| kv.strip_prefix("usec_per_call=")?.parse().ok())
    }))
}

/// `calls` and `usec` (total) of one command from `INFO commandstats`.
fn commandstat(admin: &mut redis::Connection, command: &str) -> Result<Option<(f64, f64)>, String> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(admin)
        .map_err(|e| format!("INFO: {e}"))?;
    Ok(parse_commandstat(&info, command))
}

fn parse_commandstat(info: &str, command: &str) -> Option<(f64, f64)> {
    let tag = format!("cmdstat_{command}:");
    let stats = info.lines().find_map(|l| l.strip_prefix(&tag))?;
    let field = |name: &str| {
        stats.split(',').find_map(|kv| {
            kv.strip_prefix(name)?
                .strip_prefix('=')?
                .parse::<f64>()
                .ok()
        })
    };
    let (calls, usec) = (field("calls")?, field("usec")?);
    (calls > 0.0).then_some((calls, usec))
}

/// Runs `redis-benchmark` and reads its requests per second.
fn redis_benchmark(common: &[String], extra: &[String]) -> Result<f64, String> {
    let out = Command::new("redis-benchmark")
        .args(common)
        .args(extra)
        .output()
        .map_err(|e| format!("cannot run redis-benchmark (install redis-tools): {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    // Quiet mode ends with "NAME: 123456.78 requests per second, p50=...";
    // progress lines before it are separated by carriage returns.
    let figure = text.split(['\r', '\n']).rev().find_map(|l| {
        let (_, rest) = l.rsplit_once(": ")?;
        rest.split(" requests per second")
            .next()?
            .trim()
            .parse::<f64>()
            .ok()
    });
    figure.ok_or_else(|| {
        // Its errors (NOAUTH, a refused connection) go to either stream.
        let both = format!("{text}\n{}", String::from_utf8_lossy(&out.stderr));
        let said: Vec<&str> = both
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .take(4)
            .collect();
        format!(
            "redis-benchmark gave no figure ({}): {}",
            out.status,
            said.join(" / ")
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redis_benchmark_gets_the_urls_database_and_credentials() {
        let args = |url: &str| redis_benchmark_target(url).unwrap().join(" ");
        assert_eq!(args("redis://127.0.0.1:6380"), "-h 127.0.0.1 -p 6380");
        assert_eq!(args("redis://h:6379/3"), "-h h -p 6379 --dbnum 3");
        assert_eq!(args("redis://:pw@h:1"), "-h h -p 1 -a pw");
        assert_eq!(
            args("redis://app:pw@h:1/2"),
            "-h h -p 1 --dbnum 2 --user app -a pw"
        );
        let e = redis_benchmark_target("redis-cluster://:pw@h:1").unwrap_err();
        assert!(e.contains("one standalone redis-server"), "{e}");
        assert!(!e.contains("pw@"), "{e}");
        let e = redis_benchmark_target("redis+unix:///tmp/r.sock").unwrap_err();
        assert!(e.contains("redis://HOST:PORT"), "{e}");
    }

    fn round(minimal_usec: f64, ours_usec: f64, minimal_per_s: f64, ours_per_s: f64) -> Round {
        Round {
            minimal_first: true,
            minimal_per_s,
            minimal_usec_per_call: minimal_usec,
            ours_usec_per_call: ours_usec,
            ours_client_per_s: ours_per_s,
        }
    }

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
        assert_eq!(median(&[7.5]), Some(7.5));
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[1.0, f64::NAN]), None);
    }

    #[test]
    fn the_verdict_is_the_median_of_per_round_ratios_not_a_ratio_of_medians() {
        // Per-round CPU ratios 1.5, 1.0, 1.1: median 1.1, where the ratio
        // of the medians would be 15 / 11 = 1.36. Throughput shares 0.5,
        // 1.0, 0.9: median 0.9, where the ratio of the medians would be
        // 60,000 / 60,000 = 1.0.
        let rounds = [
            round(10.0, 15.0, 200_000.0, 100_000.0),
            round(11.0, 11.0, 60_000.0, 60_000.0),
            round(20.0, 22.0, 50_000.0, 45_000.0),
        ];
        let v = Verdict::of(&rounds).expect("figures");
        assert!((v.cpu_ratio_median - 1.1).abs() < 1e-12);
        assert!((v.throughput_share_median - 0.9).abs() < 1e-12);
        assert!(v.cpu_met());
        assert!(v.throughput_met());
    }

    #[test]
    fn one_bad_round_does_not_flip_the_verdict() {
        let rounds = [
            round(10.0, 11.0, 50_000.0, 45_000.0),
            round(10.0, 16.0, 100_000.0, 45_000.0),
            round(10.0, 11.5, 50_000.0, 44_000.0),
        ];
        let v = Verdict::of(&rounds).expect("figures");
        assert!(v.cpu_met(), "{v:?}");
        assert!(v.throughput_met(), "{v:?}");
        let bad = [rounds[1], rounds[1], rounds[0]];
        let v = Verdict::of(&bad).expect("figures");
        assert!(!v.cpu_met(), "{v:?}");
        assert!(!v.throughput_met(), "{v:?}");
    }

    #[test]
    fn commandstats_give_calls_and_total_usec() {
        let info = "# Commandstats\r\n\
            cmdstat_evalsha:calls=50000,usec=512345,usec_per_call=10.25,rejected_calls=0,failed_calls=0\r\n\
            cmdstat_eval:calls=3,usec=30,usec_per_call=10.00,rejected_calls=0,failed_calls=0\r\n";
        assert_eq!(
            parse_commandstat(info, "evalsha"),
            Some((50000.0, 512345.0))
        );
        assert_eq!(parse_commandstat(info, "eval"), Some((3.0, 30.0)));
        assert_eq!(parse_commandstat(info, "get"), None);
    }

    #[test]
    fn a_round_weighs_its_slices_by_requests_and_calls() {
        // Two slices of 1000 requests at 1000/s and 4000/s take 1.25 s:
        // 1600/s, not the mean of the rates (2500/s).
        let mut t = Tally::default();
        t.add(1000.0, 1.0, 1000.0, 10_000.0);
        t.add(1000.0, 0.25, 3000.0, 60_000.0);
        assert!((t.per_s() - 1600.0).abs() < 1e-9);
        assert!((t.usec_per_call() - 17.5).abs() < 1e-9);
    }

    #[test]
    fn quick_takes_three_rounds_and_a_tenth_of_the_work() {
        let args = Args::defaults("redis://127.0.0.1:6379".into(), true, false);
        let plan = args.plan();
        assert_eq!(
            (plan.rounds, plan.requests, plan.round_trips),
            (3, 20_000, 500)
        );
        let args = Args::defaults("redis://127.0.0.1:6379".into(), false, false);
        let plan = args.plan();
        assert_eq!(
            (plan.rounds, plan.requests, plan.round_trips),
            (5, 200_000, 5_000)
        );
    }
}
