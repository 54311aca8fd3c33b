//! The Redis benchmark: pipelined decisions per second and single-call
//! round trips (p50, p99) for each policy, beside `redis-benchmark`'s
//! figures for `INCR` and for `EVALSHA` of a minimal sliding-window counter
//! script, all against one Redis in the same run; and the server CPU per
//! call (`INFO commandstats`) of the project's sliding-window counter
//! script against that minimal script.
//!
//! Run as `ratewarden bench-redis --store redis://HOST:PORT`. It writes
//! keys under its own prefix (`ratewarden-bench:<pid>`), each with a TTL of
//! at most two seconds, and resets the server's command statistics.

use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ratewarden_core::{PolicyConfig, PolicyKind, REFERENCE};
use ratewarden_redis::{RedisOptions, RedisStore};

const MINIMAL_SWC: &str = include_str!("lua/minimal_swc.lua");

/// Arguments of `ratewarden bench-redis`.
#[derive(clap::Args)]
pub struct Args {
    /// The Redis to measure: `redis://HOST:PORT` (one node; redis-benchmark
    /// is pointed at the same host and port).
    #[arg(long)]
    pub store: String,
    /// Decisions per pipelined measurement (per policy).
    #[arg(long, default_value_t = 200_000)]
    pub requests: u64,
    /// Requests per pipelined batch.
    #[arg(long, default_value_t = 16)]
    pub pipeline: usize,
    /// Connections used at once, each with its own batches.
    #[arg(long, default_value_t = 4)]
    pub connections: usize,
    /// Distinct keys the requests spread over.
    #[arg(long, default_value_t = 10_000)]
    pub keys: u64,
    /// Single calls timed for the round-trip percentiles (per policy).
    #[arg(long, default_value_t = 5_000)]
    pub round_trips: usize,
}

impl Args {
    /// The default sizes, as the command line gives them, for `store`;
    /// `quick` divides the work by ten.
    pub fn defaults(store: String, quick: bool) -> Self {
        let scale = if quick { 10 } else { 1 };
        Args {
            store,
            requests: 200_000 / scale,
            pipeline: 16,
            connections: 4,
            keys: 10_000,
            round_trips: 5_000 / scale as usize,
        }
    }
}

/// One policy's figures.
struct PolicyFigures {
    policy: PolicyKind,
    decisions_per_s: f64,
    round_trip_us_p50: f64,
    round_trip_us_p99: f64,
    server_usec_per_call: Option<f64>,
}

/// Runs the benchmark and prints its table.
pub fn run(args: Args) -> ExitCode {
    match run_inner(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench-redis: {e}");
            ExitCode::from(2)
        }
    }
}

fn run_inner(args: &Args) -> Result<(), String> {
    if args.requests == 0 || args.pipeline == 0 || args.connections == 0 || args.keys == 0 {
        return Err("--requests, --pipeline, --connections and --keys must be at least 1".into());
    }
    if args.pipeline > ratewarden_redis::MAX_BATCH
        || args.connections > 256
        || args.round_trips > 1_000_000
    {
        return Err(format!(
            "use --pipeline up to {}, --connections up to 256, --round-trips up to 1000000",
            ratewarden_redis::MAX_BATCH
        ));
    }
    let (host, port) = host_port(&args.store)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))?;
    let client = redis::Client::open(args.store.as_str()).map_err(|e| e.to_string())?;
    let mut admin = client
        .get_connection_with_timeout(Duration::from_secs(2))
        .map_err(|e| format!("cannot connect to {}: {e}", args.store))?;
    let prefix = format!("ratewarden-bench:{}", std::process::id());

    let mut figures = Vec::new();
    for policy in PolicyKind::ALL {
        let config = PolicyConfig::new(policy, REFERENCE.limit, REFERENCE.window_ms);
        let stores =
            runtime.block_on(connect_all(&args.store, config, &prefix, args.connections))?;
        let (p50, p99) = runtime.block_on(round_trips(&stores[0], args.round_trips, args.keys))?;
        reset_stats(&mut admin)?;
        let rate = runtime.block_on(pipelined(&stores, args))?;
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
    let minimal_rate = runtime.block_on(pipelined_minimal(&args.store, &sha, &prefix, args))?;
    let minimal_usec = usec_per_call(&mut admin, "evalsha")?;
    let n = args.requests.to_string();
    let (c, p) = (args.connections.to_string(), args.pipeline.to_string());
    let common = [
        "-h",
        host.as_str(),
        "-p",
        port.as_str(),
        "-n",
        n.as_str(),
        "-c",
        c.as_str(),
        "-P",
        p.as_str(),
        "-q",
    ];
    let incr = redis_benchmark(&common, &["-t", "incr"])?;
    let limit = REFERENCE.limit.to_string();
    let window = REFERENCE.window_ms.to_string();
    let key = format!("{prefix}:minimal:__rand_int__");
    let keys = args.keys.to_string();
    // The minimal script, driven by redis-benchmark: measured once before
    // and once after the project's script, so a drift of the machine shows.
    let minimal_args = [
        "-r",
        keys.as_str(),
        "EVALSHA",
        sha.as_str(),
        "1",
        key.as_str(),
        limit.as_str(),
        window.as_str(),
    ];
    let evalsha = redis_benchmark(&common, &minimal_args)?;

    // The server-CPU comparison, both scripts driven by redis-benchmark
    // (a light C client), so that a busy client process sharing the
    // machine does not inflate one figure more than the other.
    let swc_store = runtime.block_on(connect_all(&args.store, REFERENCE, &prefix, 1))?;
    // One call loads the script (EVALSHA, then SCRIPT LOAD on NOSCRIPT).
    runtime
        .block_on(swc_store[0].decide(0, None, 0))
        .map_err(|e| e.to_string())?;
    let swc_key = swc_store[0].key_name(0);
    let swc_key = format!(
        "{}__rand_int__",
        swc_key.strip_suffix('0').unwrap_or(&swc_key)
    );
    let max_ttl = swc_store[0].options().max_ttl_ms.to_string();
    reset_stats(&mut admin)?;
    let swc_rb = redis_benchmark(
        &common,
        &[
            "-r",
            keys.as_str(),
            "EVALSHA",
            swc_store[0].script_sha(),
            "1",
            swc_key.as_str(),
            limit.as_str(),
            window.as_str(),
            limit.as_str(),
            "1",
            "",
            "0",
            max_ttl.as_str(),
        ],
    )?;
    let swc_rb_usec = usec_per_call(&mut admin, "evalsha")?;
    reset_stats(&mut admin)?;
    let minimal_rb = redis_benchmark(&common, &minimal_args)?;
    let minimal_rb_usec = usec_per_call(&mut admin, "evalsha")?;

    println!(
        "Redis at {}: {} requests per measurement, pipeline {}, {} connections, {} keys; \
         reference numbers ({} per {} ms)",
        args.store,
        args.requests,
        args.pipeline,
        args.connections,
        args.keys,
        REFERENCE.limit,
        REFERENCE.window_ms
    );
    println!(
        "{:<24} {:>14} {:>12} {:>12} {:>16}",
        "policy", "decisions/s", "rtt_us_p50", "rtt_us_p99", "server_usec/call"
    );
    for f in &figures {
        println!(
            "{:<24} {:>14.0} {:>12.1} {:>12.1} {:>16}",
            f.policy.name(),
            f.decisions_per_s,
            f.round_trip_us_p50,
            f.round_trip_us_p99,
            f.server_usec_per_call
                .map_or("-".to_owned(), |u| format!("{u:.2}"))
        );
    }
    println!(
        "{:<24} {:>14.0} {:>12} {:>12} {:>16}",
        "minimal-swc (this client)",
        minimal_rate,
        "-",
        "-",
        minimal_usec.map_or("-".to_owned(), |u| format!("{u:.2}"))
    );
    println!("redis-benchmark INCR:                           {incr:.0} requests/s");
    println!("redis-benchmark EVALSHA minimal-swc:            {evalsha:.0} requests/s");
    let show = |u: Option<f64>| u.map_or("-".to_owned(), |u| format!("{u:.2}"));
    println!(
        "redis-benchmark EVALSHA sliding-window-counter: {swc_rb:.0} requests/s, server usec/call {}",
        show(swc_rb_usec)
    );
    println!(
        "redis-benchmark EVALSHA minimal-swc again:      {minimal_rb:.0} requests/s, server usec/call {}",
        show(minimal_rb_usec)
    );
    if let (Some(ours), Some(minimal)) = (swc_rb_usec, minimal_rb_usec) {
        let ratio = ours / minimal;
        println!(
            "server CPU per call, sliding-window-counter / minimal: {ratio:.2}x \
             (target at most 1.2x: {})",
            if ratio <= 1.2 { "met" } else { "not met" }
        );
    }
    if let Some(swc) = figures
        .iter()
        .find(|f| f.policy == PolicyKind::SlidingWindowCounter)
    {
        let share = swc.decisions_per_s / evalsha;
        println!(
            "pipelined sliding-window-counter through this client / redis-benchmark EVALSHA \
             minimal: {:.0}% (target at least 80%: {})",
            share * 100.0,
            if share >= 0.8 { "met" } else { "not met" }
        );
    }
    Ok(())
}

fn host_port(url: &str) -> Result<(String, String), String> {
    let rest = url
        .strip_prefix("redis://")
        .ok_or_else(|| format!("{url:?}: the Redis benchmark takes one node, redis://HOST:PORT"))?;
    let authority = rest.split('/').next().unwrap_or_default();
    let authority = authority.rsplit('@').next().unwrap_or_default();
    match authority.rsplit_once(':') {
        Some((h, p)) if !h.is_empty() && p.parse::<u16>().is_ok() => {
            Ok((h.to_owned(), p.to_owned()))
        }
        _ => Ok((
            if authority.is_empty() {
                "127.0.0.1"
            } else {
                authority
            }
            .to_owned(),
            "6379".to_owned(),
        )),
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

async fn pipelined(stores: &[RedisStore], args: &Args) -> Result<f64, String> {
    let per_conn = args.requests / stores.len() as u64;
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
    Ok(total as f64 / started.elapsed().as_secs_f64())
}

async fn pipelined_minimal(url: &str, sha: &str, prefix: &str, args: &Args) -> Result<f64, String> {
    let client = redis::Client::open(url).map_err(|e| e.to_string())?;
    let per_conn = args.requests / args.connections as u64;
    let sha: Arc<str> = sha.into();
    let started = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..args.connections {
        let mut conn = client
            .get_multiplexed_async_connection()
            .await
            .map_err(|e| e.to_string())?;
        let (sha, prefix) = (Arc::clone(&sha), prefix.to_owned());
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
                        .arg(format!("{prefix}:minimal:{}", (next + i) % keys))
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

/// Runs `redis-benchmark` and reads its requests per second.
fn redis_benchmark(common: &[&str], extra: &[&str]) -> Result<f64, String> {
    let out = Command::new("redis-benchmark")
        .args(common)
        .args(extra)
        .output()
        .map_err(|e| format!("cannot run redis-benchmark (install redis-tools): {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    // Quiet mode ends with "NAME: 123456.78 requests per second, p50=...";
    // progress lines before it are separated by carriage returns.
    text.split(['\r', '\n'])
        .rev()
        .find_map(|l| {
            let (_, rest) = l.rsplit_once(": ")?;
            rest.split(" requests per second")
                .next()?
                .trim()
                .parse::<f64>()
                .ok()
        })
        .ok_or_else(|| format!("no figure in redis-benchmark's output: {text}"))
}
