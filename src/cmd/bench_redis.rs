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
//! Run as `ratewarden bench-redis --store redis://HOST:PORT` (or
//! `redis+unix:///PATH`). Every key it
//! writes is under one prefix, `ratewarden-bench%3A<pid>:` (the store's
//! escaped form of `ratewarden-bench:<pid>`): the scripts' keys expire
//! within two seconds, and the keys of `redis-benchmark`'s `INCR`, which
//! sets no TTL, are removed when that step ends. It resets the server's
//! command statistics.
//!
//! Exit status: 2 for a command line that cannot run (a size out of its
//! bounds, a URL of a form it does not take), checked before anything
//! starts; 1 for a run that failed (no `redis-benchmark`, a server that
//! cannot be reached or used, or that stops answering).

use std::io::Read;
use std::process::{Command, ExitCode, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ratewarden_core::{PolicyConfig, PolicyKind, REFERENCE};
use ratewarden_redis::{escape_key_part, redact_url, RedisOptions, RedisStore};
use redis::{ErrorKind, RedisError};
use serde_json::json;

use super::{errln, outln};

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
/// The most `--requests`: a run of this many per measurement already
/// takes hours.
const MAX_REQUESTS: u64 = 100_000_000;
/// The fewest requests a measurement may take, `--quick` applied: a slice
/// of fewer than about a thousand can end within `redis-benchmark`'s
/// clock's millisecond, which then gives no rate, and the run fails
/// halfway.
const MIN_PLANNED_REQUESTS: u64 = 1_000 * SLICES;
/// The most `--connections`.
const MAX_CONNECTIONS: usize = 256;
/// The most `--round-trips`.
const MAX_ROUND_TRIPS: usize = 1_000_000;
/// The most `--keys`: `redis-benchmark` reads `-r` as a C `int`, and above
/// this it wraps, sending every request to one key.
const MAX_KEYS: u64 = i32::MAX as u64;
/// How long connecting may take, the first reply included.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long any one call may wait for Redis, as the store's calls do in
/// this benchmark: long enough that a slow moment does not end the run,
/// short enough that a server that stops answering does.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// Arguments of `ratewarden bench-redis`.
#[derive(clap::Args)]
pub struct Args {
    /// The Redis to measure: `redis://[[USER]:PASSWORD@]HOST:PORT[/DB]`
    /// (one standalone node, over TCP) or
    /// `redis+unix:///PATH[?db=DB&user=USER&pass=PASSWORD]` (over a Unix
    /// socket); redis-benchmark is pointed at the same address, database
    /// and credentials.
    #[arg(long, value_parser = super::trimmed)]
    pub store: String,
    /// Decisions per pipelined measurement (per policy, and per script in
    /// each round), 4,000 to 100,000,000; --quick takes a tenth of it (20,000
    /// by default), so with --quick at least 40,000.
    #[arg(long, default_value_t = 200_000, value_parser = crate::cmd::whole::<u64>)]
    pub requests: u64,
    /// Requests per pipelined batch, 1 to 10,000.
    #[arg(long, default_value_t = 16, value_parser = crate::cmd::whole::<usize>)]
    pub pipeline: usize,
    /// Connections used at once, each with its own batches, 1 to 256;
    /// connections times --pipeline at most a quarter of the requests
    /// (redis-benchmark measures a quarter at a time, and sends a whole
    /// batch on every connection).
    #[arg(long, default_value_t = 4, value_parser = crate::cmd::whole::<usize>)]
    pub connections: usize,
    /// Distinct keys the requests spread over, 1 to 2,147,483,647
    /// (redis-benchmark's -r wraps above it).
    #[arg(long, default_value_t = 10_000, value_parser = crate::cmd::whole::<u64>)]
    pub keys: u64,
    /// Single calls timed for the round-trip percentiles (per policy), 0 to
    /// 1,000,000; when none is timed (0, or under 10 with --quick) the
    /// percentiles show `-` (`null` in JSON).
    #[arg(long, default_value_t = 5_000, value_parser = crate::cmd::whole::<usize>)]
    pub round_trips: usize,
    /// Interleaved rounds measuring the two targets, 1 to 50; each target
    /// is judged by the median of its per-round ratios [default: 5; 3 with
    /// --quick].
    #[arg(long, value_parser = crate::cmd::whole::<usize>)]
    pub rounds: Option<usize>,
    /// A shorter run: a tenth of the requests and round trips, 3 rounds.
    #[arg(long)]
    pub quick: bool,
    /// One JSON object per line on standard output instead of the tables.
    #[arg(long)]
    pub json: bool,
    /// The command the user typed, which messages name: `bench --store
    /// redis://...` runs this one too.
    #[arg(skip = "bench-redis")]
    pub command: &'static str,
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
            command: "bench-redis",
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

    /// The sizes of this run, each flag checked against its own bounds.
    fn checked_plan(&self) -> Result<Plan, String> {
        let scale = if self.quick { 10 } else { 1 };
        bound(
            "--requests",
            self.requests,
            MIN_PLANNED_REQUESTS * scale,
            MAX_REQUESTS,
        )
        .map_err(|e| {
            // The reason for the bound that was crossed, not the other's.
            if self.requests > MAX_REQUESTS {
                return format!("{e} (a run of more per measurement takes hours)");
            }
            format!(
                "{e} (a measurement of fewer can end within redis-benchmark's millisecond \
                 clock, which then gives no rate{})",
                if self.quick {
                    "; --quick takes a tenth"
                } else {
                    ""
                }
            )
        })?;
        bound(
            "--pipeline",
            self.pipeline as u64,
            1,
            ratewarden_redis::MAX_BATCH as u64,
        )?;
        bound(
            "--connections",
            self.connections as u64,
            1,
            MAX_CONNECTIONS as u64,
        )?;
        bound("--keys", self.keys, 1, MAX_KEYS).map_err(|e| {
            format!(
                "{e} (redis-benchmark, which spreads its requests over the keys with -r, \
                 wraps above it)"
            )
        })?;
        bound(
            "--round-trips",
            self.round_trips as u64,
            0,
            MAX_ROUND_TRIPS as u64,
        )?;
        let plan = self.plan();
        bound("--rounds", plan.rounds as u64, 1, MAX_ROUNDS as u64)?;
        // redis-benchmark sends a whole pipeline on every connection before
        // it counts: `-c 256 -P 10000 -n 1000` sends some two million
        // calls, not a thousand, and outlasts the time given to a run of a
        // thousand. Its smallest run is one slice of a measurement.
        let in_flight = self.connections as u64 * self.pipeline as u64;
        let slice = plan.requests / SLICES;
        if in_flight > slice {
            let needed = in_flight * SLICES * scale;
            let raise = if needed <= MAX_REQUESTS {
                format!(", or give --requests {needed} or more")
            } else {
                String::new()
            };
            return Err(format!(
                "--connections {} and --pipeline {} send {in_flight} requests at once, more \
                 than the {slice} of each redis-benchmark run (--requests{} in {SLICES} slices), \
                 which would send far more than asked and measure nothing: lower \
                 --connections or --pipeline{raise}",
                self.connections,
                self.pipeline,
                if self.quick {
                    ", after --quick's tenth"
                } else {
                    ""
                }
            ));
        }
        Ok(plan)
    }
}

/// `flag`'s `value` if it is within `min ..= max`, or a message naming
/// the flag, its range and the value given.
fn bound(flag: &str, value: u64, min: u64, max: u64) -> Result<(), String> {
    if (min..=max).contains(&value) {
        Ok(())
    } else {
        Err(format!(
            "{flag} must be between {min} and {max}, not {value}"
        ))
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
    /// The round-trip percentiles, `None` when no round trip was timed.
    round_trip_us: Option<(f64, f64)>,
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
    // A command line that cannot run is refused before anything starts,
    // with exit status 2 as clap's own refusals; a run that fails (the
    // machine, the network, the server) exits with 1, as `bench` does.
    let checked = args
        .checked_plan()
        .and_then(|plan| Ok((plan, redis_benchmark_target(&args.store)?)));
    let (plan, target) = match checked {
        Ok(checked) => checked,
        Err(e) => {
            errln!("ratewarden {}: {e}", args.command);
            return ExitCode::from(2);
        }
    };
    match measure(&args, &plan, &target) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            errln!("ratewarden {}: {e}", args.command);
            ExitCode::FAILURE
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
        let rate = redis_benchmark(&self.common, extra, self.slice_requests)?;
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
            .map_err(|e| format!("redis-benchmark EVALSHA of minimal-swc: {e}"))
    }

    /// One slice of ours: driven by redis-benchmark for the server's CPU,
    /// then through this client for throughput.
    fn ours(&mut self, cpu: &mut Tally, client: &mut Tally) -> Result<(), String> {
        let extra = self.ours_args.clone();
        self.redis_benchmark_evalsha(&extra, cpu)
            .map_err(|e| format!("redis-benchmark EVALSHA of sliding-window-counter: {e}"))?;
        let (done, seconds) = self
            .runtime
            .block_on(pipelined(&self.ours_stores, self.args, self.slice_requests))
            .map_err(|e| format!("sliding-window-counter through this client: {e}"))?;
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

/// Says which step failed, and on which server, before what went wrong.
fn during(step: &str, shown: &str) -> impl FnOnce(String) -> String {
    let at = format!("{step}, on Redis at {shown}");
    move |e| format!("{at}: {e}")
}

/// What a run says before its rounds: what it measured with, and the
/// figures measured so far. A run that fails partway prints this much
/// (rows of later steps are `None`), so that minutes of a run are not lost
/// to a later step.
struct FirstPart {
    /// The URL without its credentials.
    shown: String,
    load_at_start: String,
    /// `redis-benchmark --version`'s answer.
    redis_benchmark: String,
    /// What every key the run wrote begins with.
    key_prefix: String,
    figures: Vec<PolicyFigures>,
    /// The minimal script through this client: decisions a second and the
    /// server's usec per call.
    minimal: Option<(f64, Option<f64>)>,
    /// redis-benchmark's `INCR`: requests a second, and how many keys it
    /// wrote, all removed when it ended.
    incr: Option<(f64, u64)>,
}

/// Everything a run measured, for the table or the JSON lines.
struct Measured {
    first: FirstPart,
    load_at_end: String,
    rounds: Vec<Round>,
    verdict: Verdict,
    elapsed_s: f64,
}

fn measure(args: &Args, plan: &Plan, target: &Target) -> Result<(), String> {
    let started = Instant::now();
    let load_at_start = super::bench::load_average();
    let shown = redact_url(&args.store);
    // Without it the run could measure every policy and only then fail:
    // look first.
    let redis_benchmark_version = redis_benchmark_version()?;
    // The calls are made on one thread, as redis-benchmark's are: on a
    // small machine a second worker thread only takes a core from the
    // server it measures. (The store writes and reads its connections on
    // a thread of its own, as in every process that uses it: see
    // docs/redis.md, "The connections' thread".)
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))?;
    let mut admin = connect_admin(&args.store, &target.address)?;
    // The store's own refusal of a cluster node points at redis-cluster://,
    // which this benchmark does not take: say here what it does take.
    // INFO may be renamed away on some servers: PING proved the server
    // answers, so only a clear "cluster_enabled:1" refuses.
    let cluster_info: String = redis::cmd("INFO")
        .arg("cluster")
        .query(&mut admin)
        .unwrap_or_default();
    if ratewarden_redis::cluster_enabled(&cluster_info) == Some(true) {
        return Err(format!(
            "Redis at {shown} is a cluster node; bench-redis measures one standalone \
             redis-server (its keys all on that server, as redis-benchmark's are): point \
             --store at a redis-server started without cluster-enabled"
        ));
    }
    // redis-benchmark reads a password only from its command line (unlike
    // redis-cli, it ignores REDISCLI_AUTH), where other users of this
    // machine can see it while it runs: say so, once the server has
    // answered (a run that cannot connect never starts it).
    if target.password {
        errln!(
            "ratewarden {}: the URL's password is passed to redis-benchmark as -a, visible in \
             this machine's process list while it runs",
            args.command
        );
    }
    let prefix = format!("ratewarden-bench:{}", std::process::id());
    // The store escapes its prefix (`:` becomes `%3A`); the keys this
    // benchmark names itself go under the same escaped form, so that one
    // pattern finds every key of the run.
    let key_prefix = format!("{}:", escape_key_part(&prefix));

    let mut first = FirstPart {
        shown: shown.clone(),
        load_at_start,
        redis_benchmark: redis_benchmark_version,
        key_prefix: key_prefix.clone(),
        figures: Vec::new(),
        minimal: None,
        incr: None,
    };
    let measured = (|| -> Result<(String, Vec<Round>, Verdict), String> {
        for policy in PolicyKind::ALL {
            let name = policy.name();
            let config = PolicyConfig::new(policy, REFERENCE.limit, REFERENCE.window_ms);
            let stores = runtime
                .block_on(connect_all(&args.store, config, &prefix, args.connections))
                .map_err(during(&format!("{name}, connecting"), &shown))?;
            let round_trip_us = runtime
                .block_on(round_trips(&stores[0], plan.round_trips, args.keys))
                .map_err(during(&format!("{name}, round trips"), &shown))?;
            let step = format!("{name}, pipelined decisions");
            reset_stats(&mut admin).map_err(during(&step, &shown))?;
            let (done, seconds) = runtime
                .block_on(pipelined(&stores, args, plan.requests))
                .map_err(during(&step, &shown))?;
            let usec = usec_per_call(&mut admin, "evalsha").map_err(during(&step, &shown))?;
            first.figures.push(PolicyFigures {
                policy,
                decisions_per_s: done as f64 / seconds,
                round_trip_us,
                server_usec_per_call: usec,
            });
        }

        // The baseline script, through this client and through redis-benchmark.
        let step = "minimal-swc through this client";
        let sha: String = redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(MINIMAL_SWC)
            .query(&mut admin)
            .map_err(|e| admin_error("SCRIPT LOAD", e))
            .map_err(during(step, &shown))?;
        reset_stats(&mut admin).map_err(during(step, &shown))?;
        let minimal_rate = runtime
            .block_on(pipelined_minimal(
                &args.store,
                &sha,
                &key_prefix,
                args,
                plan,
            ))
            .map_err(during(step, &shown))?;
        let minimal_usec = usec_per_call(&mut admin, "evalsha").map_err(during(step, &shown))?;
        first.minimal = Some((minimal_rate, minimal_usec));
        let slice_requests = slice_requests(plan);
        let common_with = |n: u64| -> Vec<String> {
            let mut common = target.args.clone();
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
        let (incr, incr_keys_removed) = incr_step(
            &mut admin,
            &common_with(plan.requests),
            &target.redis_cli_options(),
            &keys,
            &key_prefix,
            plan.requests,
        )
        .map_err(during("redis-benchmark INCR", &shown))?;
        first.incr = Some((incr, incr_keys_removed));
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
        let step = "sliding-window-counter for the rounds, connecting";
        let ours_stores = runtime
            .block_on(connect_all(
                &args.store,
                REFERENCE,
                &prefix,
                args.connections,
            ))
            .map_err(during(step, &shown))?;
        // One call loads the script (EVALSHA, then SCRIPT LOAD on NOSCRIPT).
        runtime
            .block_on(ours_stores[0].decide(0, None, 0))
            .map_err(|e| e.to_string())
            .map_err(during(step, &shown))?;
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
            let round = drivers
                .round(i % 2 == 0)
                .map_err(during(&format!("round {}", i + 1), &shown))?;
            rounds.push(round);
        }
        let verdict = Verdict::of(&rounds).ok_or("a round gave no figure")?;
        Ok((super::bench::load_average(), rounds, verdict))
    })();
    let measured = match measured {
        Ok((load_at_end, rounds, verdict)) => Measured {
            first,
            load_at_end,
            rounds,
            verdict,
            elapsed_s: started.elapsed().as_secs_f64(),
        },
        Err(e) if !first.figures.is_empty() => {
            let out = if args.json {
                first_part_json(args, plan, &first)
            } else {
                first_part_table(args, plan, &first)
            };
            let _ = super::print_out(&out);
            return Err(format!("{e}; what was measured before it is printed"));
        }
        Err(e) => return Err(e),
    };
    let out = if args.json {
        print_json(args, plan, &measured)
    } else {
        print_table(args, plan, &measured)
    };
    super::print_out(&out).map_err(|e| format!("cannot write to standard output: {e}"))
}

/// `redis-benchmark`'s `INCR`, Redis's simplest write, for scale: over
/// `keys` keys under `key_prefix`, as the scripts' requests are spread.
/// `INCR` sets no TTL, so its keys are removed as soon as the step ends,
/// whether it ended well or not; a failure to remove them gives the
/// command that does, with `cli`, the target as `redis-cli` options.
/// Returns the requests per second and how many keys were removed.
fn incr_step(
    admin: &mut redis::Connection,
    common: &[String],
    cli: &str,
    keys: &str,
    key_prefix: &str,
    requests: u64,
) -> Result<(f64, u64), String> {
    let extra = [
        "-r".to_owned(),
        keys.to_owned(),
        "INCR".to_owned(),
        format!("{key_prefix}incr:__rand_int__"),
    ];
    let rate = redis_benchmark(common, &extra, requests);
    let pattern = format!("{key_prefix}incr:*");
    let removed = remove_keys(admin, &pattern).map_err(|e| {
        format!(
            "removing its keys, which have no TTL: {e}; remove them with \
             redis-cli{cli} --scan --pattern '{pattern}' | xargs redis-cli{cli} unlink"
        )
    });
    match (rate, removed) {
        (Ok(rate), Ok(removed)) => Ok((rate, removed)),
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
            .map_err(|e| admin_error("SCAN", e))?;
        if !keys.is_empty() {
            removed += redis::cmd("UNLINK")
                .arg(&keys)
                .query::<u64>(admin)
                .map_err(|e| admin_error("UNLINK", e))?;
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

/// A figure with `digits` decimals, or `-` when there is none.
fn show(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{v:.digits$}"))
}

/// `n` rounds, in words: "1 round", "3 rounds".
fn rounds(n: usize) -> String {
    match n {
        1 => "1 round".to_owned(),
        n => format!("{n} rounds"),
    }
}

fn print_table(args: &Args, plan: &Plan, m: &Measured) -> String {
    let mut out = first_part_table(args, plan, &m.first);
    outln!(out);
    outln!(
        out,
        "Targets, per round (redis-benchmark EVALSHA for both scripts' server CPU; \
         this client's pipelined sliding-window-counter against redis-benchmark's minimal):"
    );
    outln!(
        out,
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
    for (i, r) in m.rounds.iter().enumerate() {
        outln!(
            out,
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
    let verdict = &m.verdict;
    outln!(
        out,
        "server CPU per call, sliding-window-counter / minimal, median of {}: {:.2}x \
         (target at most {CPU_RATIO_AT_MOST}x: {})",
        rounds(m.rounds.len()),
        verdict.cpu_ratio_median,
        met(verdict.cpu_met())
    );
    outln!(
        out,
        "pipelined sliding-window-counter through this client / redis-benchmark EVALSHA \
         minimal, median of {}: {:.0}% (target at least {:.0}%: {})",
        rounds(m.rounds.len()),
        verdict.throughput_share_median * 100.0,
        THROUGHPUT_SHARE_AT_LEAST * 100.0,
        met(verdict.throughput_met())
    );
    outln!(
        out,
        "run took {:.0} s; load average at end {}",
        m.elapsed_s,
        m.load_at_end
    );
    out
}

/// The table's lines of what the run measured with and of the figures
/// measured before the rounds (those measured so far, for a run that
/// failed partway).
fn first_part_table(args: &Args, plan: &Plan, first: &FirstPart) -> String {
    let mut out = String::new();
    outln!(
        out,
        "machine: {}",
        super::bench::machine(&first.load_at_start)
    );
    outln!(
        out,
        "Redis at {}: {} requests per measurement, pipeline {}, {} connections, {} keys, \
         {} round trips per policy; reference numbers ({} per {} ms); {}; keys under {}",
        first.shown,
        plan.requests,
        args.pipeline,
        args.connections,
        args.keys,
        plan.round_trips,
        REFERENCE.limit,
        REFERENCE.window_ms,
        rounds(plan.rounds),
        first.key_prefix
    );
    out.push_str(&policy_table(&first.figures));
    if let Some((rate, usec)) = first.minimal {
        outln!(
            out,
            "{:<26} {:>12.0} {:>11} {:>11} {:>17}",
            "minimal-swc (this client)",
            rate,
            "-",
            "-",
            show(usec, 2)
        );
    }
    if let Some((incr, _)) = first.incr {
        outln!(out, "redis-benchmark INCR: {incr:.0} requests/s");
    }
    out
}

/// The table's rows of the policies' own figures, with their header.
fn policy_table(figures: &[PolicyFigures]) -> String {
    let mut out = String::new();
    outln!(
        out,
        "{:<26} {:>12} {:>11} {:>11} {:>17}",
        "policy",
        "decisions/s",
        "rtt_us_p50",
        "rtt_us_p99",
        "server_usec/call"
    );
    for f in figures {
        outln!(
            out,
            "{:<26} {:>12.0} {:>11} {:>11} {:>17}",
            f.policy.name(),
            f.decisions_per_s,
            show(f.round_trip_us.map(|(p50, _)| p50), 1),
            show(f.round_trip_us.map(|(_, p99)| p99), 1),
            show(f.server_usec_per_call, 2)
        );
    }
    out
}

/// One policy's JSON row.
fn policy_json(f: &PolicyFigures) -> serde_json::Value {
    json!({
        "workload": "policy", "policy": f.policy.name(),
        "decisions_per_s": f.decisions_per_s,
        "round_trip_us_p50": f.round_trip_us.map(|(p50, _)| p50),
        "round_trip_us_p99": f.round_trip_us.map(|(_, p99)| p99),
        "server_usec_per_call": f.server_usec_per_call,
    })
}

/// The JSON lines of what the run measured with and of the figures
/// measured before the rounds (those measured so far, for a run that
/// failed partway).
fn first_part_json(args: &Args, plan: &Plan, first: &FirstPart) -> String {
    let mut out = String::new();
    // What the rows were measured with, so that a saved file can be read
    // on its own.
    outln!(
        out,
        "{}",
        json!({
            "workload": "run", "policy": null, "store": first.shown,
            "machine": super::bench::machine(&first.load_at_start),
            "redis_benchmark": first.redis_benchmark,
            "limit": REFERENCE.limit, "window_ms": REFERENCE.window_ms,
            "requests": plan.requests, "pipeline": args.pipeline,
            "connections": args.connections, "keys": args.keys,
            "round_trips": plan.round_trips, "rounds": plan.rounds,
            "slices": SLICES, "slice_requests": slice_requests(plan), "quick": args.quick,
            "key_prefix": first.key_prefix,
        })
    );
    for f in &first.figures {
        outln!(out, "{}", policy_json(f));
    }
    if let Some((rate, usec)) = first.minimal {
        outln!(
            out,
            "{}",
            json!({
                "workload": "baseline", "policy": "minimal-swc", "client": "ratewarden",
                "decisions_per_s": rate, "server_usec_per_call": usec,
            })
        );
    }
    if let Some((incr, removed)) = first.incr {
        outln!(
            out,
            "{}",
            json!({
                "workload": "baseline", "command": "INCR", "client": "redis-benchmark",
                "requests_per_s": incr, "keys_removed": removed,
            })
        );
    }
    out
}

/// Requests per slice of a round, for each script and driver.
fn slice_requests(plan: &Plan) -> u64 {
    (plan.requests / SLICES).max(1)
}

/// The JSON lines, in the table's order; `workload` tells the kinds of
/// row apart, as in `bench`'s JSON (docs/redis.md lists every field).
fn print_json(args: &Args, plan: &Plan, m: &Measured) -> String {
    let mut out = first_part_json(args, plan, &m.first);
    for (i, r) in m.rounds.iter().enumerate() {
        outln!(
            out,
            "{}",
            json!({
                "workload": "round", "round": i + 1,
                "first": if r.minimal_first { "minimal" } else { "ours" },
                "minimal_usec_per_call": r.minimal_usec_per_call,
                "ours_usec_per_call": r.ours_usec_per_call, "cpu_ratio": r.cpu_ratio(),
                "minimal_requests_per_s": r.minimal_per_s,
                "ours_client_decisions_per_s": r.ours_client_per_s,
                "throughput_share": r.throughput_share(),
            })
        );
    }
    let verdict = &m.verdict;
    outln!(
        out,
        "{}",
        json!({
            "workload": "target", "target": "server_cpu_ratio",
            "median": verdict.cpu_ratio_median, "bound": CPU_RATIO_AT_MOST,
            "direction": "at_most", "met": verdict.cpu_met(), "rounds": m.rounds.len(),
        })
    );
    outln!(
        out,
        "{}",
        json!({
            "workload": "target", "target": "throughput_share",
            "median": verdict.throughput_share_median, "bound": THROUGHPUT_SHARE_AT_LEAST,
            "direction": "at_least", "met": verdict.throughput_met(), "rounds": m.rounds.len(),
        })
    );
    outln!(
        out,
        "{}",
        json!({
            "workload": "end", "elapsed_s": m.elapsed_s,
            "load_average_at_start": m.first.load_at_start, "load_average_at_end": m.load_at_end,
        })
    );
    out
}

/// Where `redis-benchmark` is pointed, from the store URL.
#[derive(Debug)]
struct Target {
    /// The URL's host, port, database and credentials, as
    /// `redis-benchmark`'s own options.
    args: Vec<String>,
    /// `HOST:PORT`, as a user writes it (an IPv6 host in brackets), or
    /// `unix:PATH`.
    address: String,
    /// Whether the URL's password goes on `redis-benchmark`'s command line.
    password: bool,
}

impl Target {
    /// The server, as `redis-cli` options (each with a space before it),
    /// the password shown as `***` for the user to write back: a command to
    /// paste that names no server would go to 127.0.0.1:6379.
    fn redis_cli_options(&self) -> String {
        let mut out = String::new();
        for pair in self.args.chunks(2) {
            let [option, value] = pair else {
                continue;
            };
            let (name, value) = match option.as_str() {
                "-h" | "-p" | "-s" | "--user" => (option.as_str(), value.as_str()),
                "--dbnum" => ("-n", value.as_str()),
                "-a" => ("-a", "***"),
                _ => continue,
            };
            out.push_str(&format!(" {name} '{value}'"));
        }
        out
    }
}

/// Reads the store URL for `redis-benchmark`, or says what is wrong with
/// its form, scheme by scheme.
fn redis_benchmark_target(url: &str) -> Result<Target, String> {
    let shown = redact_url(url);
    if url.starts_with("rediss://") {
        return Err(format!(
            "{shown:?}: bench-redis measures plain connections only (TLS costs the same \
             per call on both sides of its comparison, and redis-benchmark would need \
             certificates of its own): name a plain port of the same Redis, \
             redis://HOST:PORT"
        ));
    }
    if ratewarden_redis::is_cluster_url(url) {
        return Err(format!(
            "{shown:?}: bench-redis measures one standalone redis-server, named \
             redis://HOST:PORT (not a cluster: its keys would hash to other nodes, and \
             redis-benchmark, the peer it is measured against, drives one node)"
        ));
    }
    let form = "redis://[[USER]:PASSWORD@]HOST:PORT[/DB] or \
                redis+unix:///PATH[?db=DB&user=USER&pass=PASSWORD]";
    // `unix://` is redis-rs's other spelling, which the store does not
    // take: it is refused below, naming the two forms.
    let socket = url.starts_with("redis+unix://");
    if !url.starts_with("redis://") && !socket {
        return Err(format!(
            "{shown:?} is not a Redis URL: bench-redis takes {form}"
        ));
    }
    // A query field the store would ignore (`?db=3`), refused here as the
    // store refuses it, before anything runs.
    if let Some(e) = ratewarden_redis::url_error(url) {
        return Err(e);
    }
    let info: redis::ConnectionInfo = url
        .parse()
        .map_err(|e| format!("{shown:?} is not a Redis URL ({e}): bench-redis takes {form}"))?;
    let (address, mut args) = match info.addr().clone() {
        redis::ConnectionAddr::Tcp(host, port) => {
            let address = if host.contains(':') {
                format!("[{host}]:{port}")
            } else {
                format!("{host}:{port}")
            };
            (
                address,
                vec!["-h".to_owned(), host, "-p".to_owned(), port.to_string()],
            )
        }
        redis::ConnectionAddr::Unix(path) => {
            let path = path
                .to_str()
                .ok_or_else(|| format!("{shown:?}: the socket's path is not UTF-8"))?
                .to_owned();
            (format!("unix:{path}"), vec!["-s".to_owned(), path])
        }
        _ => return Err(format!("{shown:?}: bench-redis takes {form}")),
    };
    let settings = info.redis_settings();
    if settings.db() != 0 {
        args.extend(["--dbnum".to_owned(), settings.db().to_string()]);
    }
    let password = settings.password().is_some();
    if let Some(password) = settings.password() {
        if let Some(user) = settings.username() {
            args.extend(["--user".to_owned(), user.to_owned()]);
        }
        args.extend(["-a".to_owned(), password.to_owned()]);
    }
    Ok(Target {
        args,
        address,
        password,
    })
}

/// `redis-benchmark --version`'s answer, or what to install.
fn redis_benchmark_version() -> Result<String, String> {
    const INSTALL: &str = "install it (Debian/Ubuntu: the redis-tools package, \
                           `apt install redis-tools`) or put it on PATH";
    match Command::new("redis-benchmark").arg("--version").output() {
        Ok(out) if out.status.success() => {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
        }
        Ok(out) => Err(format!(
            "`redis-benchmark --version` failed ({}): {}; bench-redis measures beside it: \
             {INSTALL}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(format!(
            "redis-benchmark is not on PATH; bench-redis measures the store beside it: \
             {INSTALL}"
        )),
        Err(e) => Err(format!(
            "cannot run redis-benchmark ({e}); bench-redis measures the store beside it: \
             {INSTALL}"
        )),
    }
}

/// The connection for statistics and set-up, checked with a `PING`, and
/// with every later call bounded by [`CALL_TIMEOUT`].
fn connect_admin(url: &str, address: &str) -> Result<redis::Connection, String> {
    let client = redis::Client::open(url)
        .map_err(|e| format!("{:?} is not a Redis URL: {e}", redact_url(url)))?;
    // The message gives the time waited, not the timeout: redis-rs
    // waits the timeout for each reply of its connection set-up (two, and
    // one more for each of a password, a /DB and RESP3), so a server that
    // takes the connection and never answers is given it two to four
    // times.
    let started = Instant::now();
    let mut admin = client
        .get_connection_with_timeout(CONNECT_TIMEOUT)
        .map_err(|e| connect_error(&e, address, started.elapsed()))?;
    admin
        .set_read_timeout(Some(CALL_TIMEOUT))
        .and_then(|()| admin.set_write_timeout(Some(CALL_TIMEOUT)))
        .map_err(|e| format!("Redis at {address}: cannot bound the connection's waits: {e}"))?;
    // Connecting sends nothing that needs a password when the URL has
    // none: a server that wants one says so only when asked.
    let started = Instant::now();
    redis::cmd("PING")
        .query::<String>(&mut admin)
        .map_err(|e| connect_error(&e, address, started.elapsed()))?;
    Ok(admin)
}

/// A failure to connect to, or to use, the server at `address`, saying
/// what to change; `waited`: how long the call that failed waited.
fn connect_error(e: &RedisError, address: &str, waited: Duration) -> String {
    let with_password = if address.starts_with("unix:") {
        "redis+unix:///PATH?pass=PASSWORD (with &user=USER for an ACL user)"
    } else {
        "redis://:PASSWORD@HOST:PORT (or redis://USER:PASSWORD@HOST:PORT for an ACL user)"
    };
    let text = e.to_string();
    let socket = address.strip_prefix("unix:");
    // With a /DB, connecting sends SELECT first, whose refusal wraps the
    // NOAUTH in its own words.
    if e.code() == Some("NOAUTH") || text.contains("Authentication required") {
        format!("Redis at {address} requires a password: put it in the URL as {with_password}")
    } else if e.kind() == ErrorKind::AuthenticationFailed || e.code() == Some("WRONGPASS") {
        format!(
            "Redis at {address} refused the URL's user or password: correct them in \
             {with_password}"
        )
    } else if text.contains("DB index is out of range") {
        let (db, db0) = if socket.is_some() {
            ("?db=", "?db=0")
        } else {
            ("/DB", "/0")
        };
        format!(
            "Redis at {address} has no database of the number the URL's {db} names: use one \
             below the server's `databases` setting (16 by default), such as {db0}"
        )
    } else if let Some(why) =
        socket.and_then(|path| ratewarden_redis::unix_socket_problem(path, &text))
    {
        // The store's words: a missing file, one that is no socket, or
        // one this process may not open.
        format!("Redis at {address} cannot be used: {why}")
    } else if e.is_connection_refusal() {
        format!(
            "nothing accepts connections at {address} (connection refused): start \
             redis-server there, or correct the URL's address"
        )
    } else if e.kind() == ErrorKind::Parse {
        format!(
            "the server at {address} answered with something that is not Redis's protocol: \
             another server (HTTP, a proxy) holds the port; check the port"
        )
    } else if e.is_timeout() {
        format!(
            "Redis at {address} did not answer in {:.1} s: the port took the connection, \
             but a Redis that is stopped or overloaded, or a server that is not Redis, did \
             not answer",
            waited.as_secs_f64()
        )
    } else {
        format!("Redis at {address} cannot be used: {e}")
    }
}

/// A failed call of `command` on the admin connection.
fn admin_error(command: &str, e: RedisError) -> String {
    if e.is_timeout() {
        format!(
            "Redis did not answer {command} within {} s",
            CALL_TIMEOUT.as_secs()
        )
    } else {
        format!("{command}: {e}")
    }
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
            // Throughput is measured here, not failure handling: long
            // timeouts keep a slow moment from ending the run.
            timeout_ms: CALL_TIMEOUT.as_millis() as u64,
            connect_timeout_ms: CALL_TIMEOUT.as_millis() as u64,
            ..RedisOptions::default()
        };
        stores.push(
            RedisStore::connect(url, config, options)
                .await
                // The detail alone: the error's kind ("invalid input")
                // would only stand in the way of what it says.
                .map_err(|e| e.detail().to_owned())?,
        );
    }
    Ok(stores)
}

/// The p50 and p99 of `n` single calls, in microseconds; `None` for none.
async fn round_trips(
    store: &RedisStore,
    n: usize,
    keys: u64,
) -> Result<Option<(f64, f64)>, String> {
    let mut us = Vec::with_capacity(n);
    for i in 0..n {
        let started = Instant::now();
        store
            .decide(i as u64 % keys, None, 1)
            .await
            .map_err(|e| e.to_string())?;
        us.push(started.elapsed().as_secs_f64() * 1e6);
    }
    Ok(percentiles(us))
}

/// The p50 and p99 of `us`, `None` when it is empty: no figure is shown
/// for what was not measured.
fn percentiles(mut us: Vec<f64>) -> Option<(f64, f64)> {
    if us.is_empty() {
        return None;
    }
    us.sort_by(f64::total_cmp);
    let at = |q: f64| us[((us.len() - 1) as f64 * q).round() as usize];
    Some((at(0.50), at(0.99)))
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

/// The minimal script's decisions per second through this client, over
/// plain multiplexed connections: every connection and every batch is
/// bounded by [`CALL_TIMEOUT`], as the store's calls are, so that a server
/// that stops answering fails the run instead of holding it for ever.
async fn pipelined_minimal(
    url: &str,
    sha: &str,
    key_prefix: &str,
    args: &Args,
    plan: &Plan,
) -> Result<f64, String> {
    let secs = CALL_TIMEOUT.as_secs();
    let client = redis::Client::open(url).map_err(|e| e.to_string())?;
    let per_conn = (plan.requests / args.connections as u64).max(1);
    let sha: Arc<str> = sha.into();
    // Every connection is made before the clock starts: the rate is of
    // decisions, as the store's is (its connections are made beforehand).
    let mut conns = Vec::with_capacity(args.connections);
    // Bounded here, by CALL_TIMEOUT, as each batch is below: redis-rs's
    // own defaults (500 ms a reply) would fail a large batch.
    let config = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(None)
        .set_response_timeout(None);
    for _ in 0..args.connections {
        let connecting = client.get_multiplexed_async_connection_with_config(&config);
        let conn = tokio::time::timeout(CALL_TIMEOUT, connecting)
            .await
            .map_err(|_| format!("Redis did not answer a new connection within {secs} s"))?
            .map_err(|e| e.to_string())?;
        conns.push(conn);
    }
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (c, mut conn) in conns.into_iter().enumerate() {
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
                let _: Vec<i64> = tokio::time::timeout(CALL_TIMEOUT, pipe.query_async(&mut conn))
                    .await
                    .map_err(|_| format!("Redis did not answer a batch within {secs} s"))?
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
        .map_err(|e| admin_error("CONFIG RESETSTAT", e))
}

/// `usec_per_call` of one command from `INFO commandstats`.
fn usec_per_call(admin: &mut redis::Connection, command: &str) -> Result<Option<f64>, String> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(admin)
        .map_err(|e| admin_error("INFO", e))?;
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
        .map_err(|e| admin_error("INFO", e))?;
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

/// How long a `redis-benchmark` run of `requests` requests may take: 10 s
/// to start, then 1 ms a request. Redis answers the slowest script here
/// tens of thousands of times a second even on a small, busy machine, so
/// only a server that stopped answering (which redis-benchmark would wait
/// on for ever) reaches it.
fn redis_benchmark_deadline(requests: u64) -> Duration {
    Duration::from_secs(10) + Duration::from_millis(requests)
}

/// Runs `redis-benchmark` and reads its requests per second, killing it
/// past [`redis_benchmark_deadline`].
fn redis_benchmark(common: &[String], extra: &[String], requests: u64) -> Result<f64, String> {
    let mut command = Command::new("redis-benchmark");
    command.args(common).args(extra);
    let out = output_within(command, redis_benchmark_deadline(requests))?;
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
    // Its clock counts whole milliseconds: a run that ends within one is
    // "inf requests per second", no figure at all.
    if figure.is_some_and(|rate| !rate.is_finite()) {
        return Err(format!(
            "redis-benchmark ran its {requests} requests within its clock's 1 ms and gave no \
             rate (inf); raise --requests"
        ));
    }
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

/// Runs `command` to its end and collects what it printed; a child still
/// running after `deadline` is killed and the call fails, rather than
/// waiting for ever. On Linux the child is killed too when this process
/// ends, however it ends: a signal sent to this process alone (`kill PID`,
/// `timeout`, a job runner's stop; a terminal's Ctrl-C reaches both) would
/// otherwise leave redis-benchmark loading the server for the rest of its
/// run.
fn output_within(mut command: Command, deadline: Duration) -> Result<Output, String> {
    let program = command.get_program().to_string_lossy().into_owned();
    #[cfg(target_os = "linux")]
    end_with_this_process(&mut command);
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start {program}: {e}"))?;
    // Both pipes are read while the child runs: on a long run its progress
    // lines could fill a pipe and stop it.
    let stdout = drain(child.stdout.take());
    let stderr = drain(child.stderr.take());
    let until = Instant::now() + deadline;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < until => std::thread::sleep(Duration::from_millis(10)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "{program} did not finish within {deadline:?} and was stopped: the \
                     server stopped answering, or answers far slower than it should"
                ));
            }
            Err(e) => return Err(format!("cannot wait for {program}: {e}")),
        }
    };
    Ok(Output {
        status,
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
    })
}

/// Has the kernel kill `command`'s process when the thread that starts it
/// ends (`PR_SET_PDEATHSIG`): this process's main thread, which runs the
/// whole measurement. A signal handler instead would change how this
/// process itself ends (a signal ignored under `nohup` would be caught, a
/// Ctrl-C in a shell loop read as handled), and would not cover SIGKILL.
#[cfg(target_os = "linux")]
fn end_with_this_process(command: &mut Command) {
    use std::os::unix::process::CommandExt;
    let parent = std::process::id();
    // SAFETY: the closure runs in the child between fork and exec, and
    // calls only prctl and getppid, which are async-signal-safe, and
    // allocates nothing (`last_os_error` reads errno).
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            // The parent may have ended before the setting took: then no
            // signal comes, and the child must not run on (ESRCH: no such
            // process; a raw code, since a message would allocate).
            if libc::getppid() as u32 != parent {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
}

/// Reads `pipe` to its end on a thread of its own.
fn drain<R: Read + Send + 'static>(pipe: Option<R>) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        if let Some(mut pipe) = pipe {
            // What was read before a failed read is still worth showing.
            let _ = pipe.read_to_end(&mut bytes);
        }
        bytes
    })
}

#[cfg(test)]
mod tests {

    /// The cleanup command a failed INCR step prints names the server that
    /// was benchmarked, its password hidden.
    #[test]
    fn redis_cli_options_name_the_benchmarked_server() {
        let cli = |url: &str| redis_benchmark_target(url).unwrap().redis_cli_options();
        assert_eq!(
            cli("redis://rw:secret@10.0.0.5:6380/3"),
            " -h '10.0.0.5' -p '6380' -n '3' --user 'rw' -a '***'"
        );
        assert_eq!(cli("redis+unix:///run/redis.sock"), " -s '/run/redis.sock'");
    }
    use super::*;

    #[test]
    fn redis_benchmark_gets_the_urls_database_and_credentials() {
        let args = |url: &str| redis_benchmark_target(url).unwrap().args.join(" ");
        assert_eq!(args("redis://127.0.0.1:6380"), "-h 127.0.0.1 -p 6380");
        assert_eq!(args("redis://h:6379/3"), "-h h -p 6379 --dbnum 3");
        assert_eq!(args("redis://:pw@h:1"), "-h h -p 1 -a pw");
        assert_eq!(
            args("redis://app:pw@h:1/2"),
            "-h h -p 1 --dbnum 2 --user app -a pw"
        );
        // A Unix socket goes to redis-benchmark's -s.
        assert_eq!(args("redis+unix:///tmp/r.sock"), "-s /tmp/r.sock");
        assert_eq!(
            args("redis+unix:///tmp/r.sock?db=2&user=app&pass=pw"),
            "-s /tmp/r.sock --dbnum 2 --user app -a pw"
        );
        // redis-rs's other spelling, which the store does not take, is
        // refused before anything starts, naming the form it takes.
        let e = redis_benchmark_target("unix:///tmp/r.sock").unwrap_err();
        assert!(e.contains("redis+unix:///PATH"), "{e}");
        let target = redis_benchmark_target("redis+unix:///tmp/r.sock").unwrap();
        assert_eq!(target.address, "unix:/tmp/r.sock");
        let target = redis_benchmark_target("redis://[::1]:6380").unwrap();
        assert_eq!(target.address, "[::1]:6380");
        assert!(!target.password);
        assert!(redis_benchmark_target("redis://:pw@h:1").unwrap().password);
    }

    /// Each scheme it does not take is answered for what it is, and no
    /// message shows a password.
    #[test]
    fn each_scheme_it_does_not_take_gets_its_own_reason() {
        let refused = |url: &str| {
            let e = redis_benchmark_target(url).unwrap_err();
            assert!(!e.contains("pw@") && !e.contains("=pw"), "{e}");
            e
        };
        let e = refused("redis-cluster://:pw@h:1");
        assert!(e.contains("one standalone redis-server"), "{e}");
        assert!(e.contains("not a cluster"), "{e}");
        for url in ["rediss://:pw@h:1", "rediss://h:6379"] {
            let e = refused(url);
            assert!(e.contains("TLS"), "{e}");
            assert!(e.contains("plain connections only"), "{e}");
            assert!(e.contains("redis://HOST:PORT"), "{e}");
        }
        // A cluster over TLS is refused as a cluster.
        let e = refused("rediss-cluster://:pw@h:1");
        assert!(e.contains("one standalone redis-server"), "{e}");
        let e = refused("valkey://h:1");
        assert!(e.contains("is not a Redis URL"), "{e}");
        assert!(!e.contains("cluster"), "{e}");
        // A query field the store would ignore, as the store refuses it.
        let e = refused("redis://h:1?db=3");
        assert!(e.contains("redis://HOST:PORT/DB"), "{e}");
        let e = refused("redis://h:1?password=pw");
        assert!(e.contains(":PASSWORD@HOST:PORT"), "{e}");
    }

    #[test]
    fn each_size_is_checked_against_its_own_bounds() {
        let args = || Args::defaults("redis://127.0.0.1:6379".into(), false, false);
        let refused = |args: Args| args.checked_plan().err().expect("refused");
        // At the bounds: accepted.
        let mut at = args();
        (at.requests, at.pipeline, at.connections, at.keys) =
            (100_000_000, 10_000, 256, 2_147_483_647);
        (at.round_trips, at.rounds) = (1_000_000, Some(50));
        assert!(at.checked_plan().is_ok());
        // Every connection's pipeline at once within one slice of a
        // measurement: at most, accepted; past it, refused naming both.
        let mut full = args();
        (full.requests, full.connections, full.pipeline) = (4_000, 10, 100);
        assert!(full.checked_plan().is_ok());
        full.pipeline = 101;
        let e = refused(full);
        assert!(
            e.starts_with(
                "--connections 10 and --pipeline 101 send 1010 requests at once, more than \
                 the 1000 of each redis-benchmark run"
            ),
            "{e}"
        );
        assert!(e.ends_with("or give --requests 4040 or more"), "{e}");
        let mut audit = args();
        (audit.requests, audit.connections, audit.pipeline) = (4_000, 256, 10_000);
        (audit.quick, audit.requests) = (true, 100_000_000);
        let e = refused(audit);
        assert!(e.contains("after --quick's tenth"), "{e}");
        assert!(e.ends_with("lower --connections or --pipeline"), "{e}");
        let mut none = args();
        (none.round_trips, none.rounds) = (0, Some(1));
        assert_eq!(none.checked_plan().unwrap().round_trips, 0);
        // One past each, and below each: the flag, its range and the value.
        type Change = fn(&mut Args);
        let cases: [(Change, &str); 12] = [
            (
                |a| a.requests = 100_000_001,
                "--requests must be between 4000 and 100000000, not 100000001",
            ),
            (
                |a| a.requests = 3_999,
                "--requests must be between 4000 and 100000000, not 3999",
            ),
            (
                |a| {
                    a.quick = true;
                    a.requests = 39_999;
                },
                "--requests must be between 40000 and 100000000, not 39999",
            ),
            (
                |a| a.pipeline = 10_001,
                "--pipeline must be between 1 and 10000, not 10001",
            ),
            (
                |a| a.pipeline = 0,
                "--pipeline must be between 1 and 10000, not 0",
            ),
            (
                |a| a.connections = 257,
                "--connections must be between 1 and 256, not 257",
            ),
            (
                |a| a.connections = 0,
                "--connections must be between 1 and 256, not 0",
            ),
            (
                |a| a.keys = 2_147_483_648,
                "--keys must be between 1 and 2147483647, not 2147483648",
            ),
            (
                |a| a.keys = 0,
                "--keys must be between 1 and 2147483647, not 0",
            ),
            (
                |a| a.round_trips = 1_000_001,
                "--round-trips must be between 0 and 1000000, not 1000001",
            ),
            (
                |a| a.rounds = Some(51),
                "--rounds must be between 1 and 50, not 51",
            ),
            (
                |a| a.rounds = Some(0),
                "--rounds must be between 1 and 50, not 0",
            ),
        ];
        for (change, message) in cases {
            let mut a = args();
            change(&mut a);
            let too_many = a.requests > 100_000_000;
            let e = refused(a);
            assert!(e.starts_with(message), "{e}");
            // Each bound of --requests gives its own reason.
            if message.starts_with("--requests") {
                assert_eq!(e.contains("takes hours"), too_many, "{e}");
                assert_eq!(e.contains("millisecond clock"), !too_many, "{e}");
            }
            let flag = message.split(' ').next().unwrap();
            for other in [
                "--requests",
                "--pipeline",
                "--connections",
                "--keys",
                "--round-trips",
                "--rounds",
            ] {
                assert!(other == flag || !e.contains(other), "{e}");
            }
        }
        // The help names this bound of --pipeline.
        assert_eq!(ratewarden_redis::MAX_BATCH, 10_000);
    }

    #[test]
    fn rounds_are_counted_in_words() {
        assert_eq!(rounds(1), "1 round");
        assert_eq!(rounds(3), "3 rounds");
    }

    #[test]
    fn no_round_trip_timed_gives_no_percentile() {
        assert_eq!(percentiles(Vec::new()), None);
        assert_eq!(percentiles(vec![5.0]), Some((5.0, 5.0)));
        let us: Vec<f64> = (1..=101).rev().map(f64::from).collect();
        assert_eq!(percentiles(us), Some((51.0, 100.0)));
        // --round-trips under 10 with --quick times none.
        let mut args = Args::defaults("redis://127.0.0.1:6379".into(), true, false);
        args.round_trips = 9;
        assert_eq!(args.checked_plan().unwrap().round_trips, 0);
    }

    #[test]
    fn connection_failures_say_what_to_change() {
        let io = |kind| RedisError::from(std::io::Error::new(kind, "os error"));
        let e = connect_error(
            &RedisError::from((
                ErrorKind::AuthenticationFailed,
                "Password authentication failed",
            )),
            "h:1",
            CONNECT_TIMEOUT,
        );
        assert!(e.contains("refused the URL's user or password"), "{e}");
        assert!(!e.contains("AuthenticationFailed"), "{e}");
        let e = connect_error(
            &RedisError::from((ErrorKind::Parse, "invalid response", "HTTP/1.1".to_owned())),
            "h:1",
            CONNECT_TIMEOUT,
        );
        assert!(e.contains("not Redis's protocol"), "{e}");
        assert!(e.contains("check the port"), "{e}");
        let e = connect_error(&io(std::io::ErrorKind::WouldBlock), "h:1", CONNECT_TIMEOUT);
        assert!(e.contains("Redis at h:1 did not answer in 2.0 s"), "{e}");
        let e = connect_error(
            &io(std::io::ErrorKind::ConnectionRefused),
            "h:1",
            CONNECT_TIMEOUT,
        );
        assert!(e.contains("connection refused"), "{e}");
        assert!(e.contains("start redis-server there"), "{e}");
        // A Unix socket is said as the store says it: a missing file, one
        // that is no socket, and its database in the query.
        let missing = format!("unix:/ratewarden-none-{}.sock", std::process::id());
        let e = connect_error(
            &RedisError::from(std::io::Error::from(std::io::ErrorKind::NotFound)),
            &missing,
            CONNECT_TIMEOUT,
        );
        assert!(
            e.contains("no such file: no redis-server listens there"),
            "{e}"
        );
        let folder = format!("unix:{}", std::env::temp_dir().display());
        let e = connect_error(
            &io(std::io::ErrorKind::ConnectionRefused),
            &folder,
            CONNECT_TIMEOUT,
        );
        assert!(e.contains("it is not a socket but a folder"), "{e}");
        let no_db = RedisError::from((
            ErrorKind::Server(redis::ServerErrorKind::ResponseError),
            "An error was signalled by the server",
            "DB index is out of range".to_owned(),
        ));
        let e = connect_error(&no_db, &folder, CONNECT_TIMEOUT);
        assert!(
            e.contains("the URL's ?db= names") && e.contains("such as ?db=0"),
            "{e}"
        );
        let e = connect_error(&no_db, "h:1", CONNECT_TIMEOUT);
        assert!(
            e.contains("the URL's /DB names") && e.contains("such as /0"),
            "{e}"
        );
    }

    #[test]
    fn a_child_past_its_deadline_is_stopped_and_the_step_fails() {
        let mut sleeper = Command::new("sleep");
        sleeper.arg("30");
        let started = Instant::now();
        let e = output_within(sleeper, Duration::from_millis(200)).unwrap_err();
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        assert!(e.contains("sleep did not finish within 200ms"), "{e}");
        let mut echo = Command::new("echo");
        echo.arg("done");
        let out = output_within(echo, Duration::from_secs(10)).unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), "done\n");
        // A generous bound: 10 s to start, then a millisecond a request.
        assert_eq!(redis_benchmark_deadline(50), Duration::from_millis(10_050));
        assert_eq!(redis_benchmark_deadline(200_000), Duration::from_secs(210));
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
