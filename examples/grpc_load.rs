//! Keeps many Envoy RLS v3 `ShouldRateLimit` calls in flight against a
//! running `ratewarden serve`, for a fixed time, and says how they were
//! answered. `scripts/bench-overload.sh` runs it to load a server past
//! what its store can answer; it is usable alone against any server:
//!
//! ```sh
//! cargo run --release --example grpc_load -- --addr 127.0.0.1:8081 \
//!     --connections 16 --in-flight 400 --duration-s 10
//! ```
//!
//! Each call sends one descriptor `KEY=VALUE`, its value new for every call
//! (`c<connection>-<n>`), so each is one decision on a key of its own: on a
//! rule with a limit above 1, an `OVER_LIMIT` answer is the server's failure
//! policy (`closed`) speaking for a store that did not answer, not a limit.
//! A call is counted by how it ended: `OK`, `OVER_LIMIT`, or the gRPC error
//! it failed with. No call starts after the sending time; those in flight
//! then are waited for, and the rate is over the whole time.
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Parser;
use ratewarden_server::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use ratewarden_server::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use ratewarden_server::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use ratewarden_server::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use ratewarden_server::proto::envoy::service::ratelimit::v3::RateLimitRequest;
use tonic::transport::{Channel, Endpoint};

/// The most connections and calls per connection taken: past these the
/// client's own memory and file limits, not the server, would be measured.
const MAX_CONNECTIONS: usize = 1_024;
const MAX_IN_FLIGHT: usize = 10_000;
/// The longest run taken, in seconds: every answered call's time is kept
/// for the percentiles, 8 bytes each (some 100 MB for ten minutes at
/// 20,000 calls a second).
const MAX_DURATION_S: u64 = 600;

#[derive(Parser)]
#[command(about = "Keeps ShouldRateLimit calls in flight against a running server")]
struct Args {
    /// The server's gRPC address.
    #[arg(long, default_value = "127.0.0.1:8081")]
    addr: String,
    /// HTTP/2 connections, each its own.
    #[arg(long, default_value_t = 4)]
    connections: usize,
    /// Calls each connection keeps in flight (keep it at or under the
    /// server's `grpc_max_streams_per_connection`, 1024 by default, or the
    /// calls past it are refused with REFUSED_STREAM).
    #[arg(long, default_value_t = 400)]
    in_flight: usize,
    /// How long to send, in seconds.
    #[arg(long, default_value_t = 10)]
    duration_s: u64,
    /// The request's domain.
    #[arg(long, default_value = "api")]
    domain: String,
    /// The descriptor entry's key.
    #[arg(long, default_value = "user")]
    key: String,
    /// How long a call may take, in milliseconds, before the client gives
    /// up on it (sent as `grpc-timeout`, as Envoy sends its `timeout`).
    #[arg(long, default_value_t = 10_000)]
    call_timeout_ms: u64,
}

/// How one connection's calls ended.
#[derive(Default)]
struct Tally {
    ok: u64,
    over_limit: u64,
    /// Answers with a code other than OK and OVER_LIMIT, by code (the
    /// protocol's number).
    other_codes: BTreeMap<i32, u64>,
    /// Failed calls, by gRPC status code name.
    errors: BTreeMap<String, u64>,
    /// Each answered call's time, in microseconds.
    latencies_us: Vec<u64>,
}

impl Tally {
    fn add(&mut self, other: Tally) {
        self.ok += other.ok;
        self.over_limit += other.over_limit;
        for (code, n) in other.other_codes {
            *self.other_codes.entry(code).or_default() += n;
        }
        for (code, n) in other.errors {
            *self.errors.entry(code).or_default() += n;
        }
        self.latencies_us.extend(other.latencies_us);
    }
}

fn check(args: &Args) -> anyhow::Result<()> {
    if !(1..=MAX_CONNECTIONS).contains(&args.connections) {
        bail!(
            "--connections is {}: use 1 to {MAX_CONNECTIONS}",
            args.connections
        );
    }
    if !(1..=MAX_IN_FLIGHT).contains(&args.in_flight) {
        bail!(
            "--in-flight is {}: use 1 to {MAX_IN_FLIGHT}",
            args.in_flight
        );
    }
    if !(1..=MAX_DURATION_S).contains(&args.duration_s) {
        bail!(
            "--duration-s is {}: use 1 to {MAX_DURATION_S}",
            args.duration_s
        );
    }
    if args.call_timeout_ms == 0 {
        bail!("--call-timeout-ms is 0: use at least 1");
    }
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    check(&args)?;
    let endpoint = Endpoint::from_shared(format!("http://{}", args.addr))
        .with_context(|| format!("--addr {}: give HOST:PORT", args.addr))?
        .connect_timeout(Duration::from_secs(5));
    let mut channels = Vec::with_capacity(args.connections);
    for _ in 0..args.connections {
        // One channel per connection: a channel is one HTTP/2 connection.
        let channel = endpoint
            .connect()
            .await
            .with_context(|| format!("connect to {}", args.addr))?;
        channels.push(channel);
    }
    let started = Instant::now();
    let until = started + Duration::from_secs(args.duration_s);
    let call_timeout = Duration::from_millis(args.call_timeout_ms);
    let mut tasks = Vec::new();
    for (c, channel) in channels.into_iter().enumerate() {
        for slot in 0..args.in_flight {
            let client = RateLimitServiceClient::new(channel.clone());
            let (domain, key) = (args.domain.clone(), args.key.clone());
            let value_prefix = format!("c{c}-s{slot}");
            tasks.push(tokio::spawn(caller(
                client,
                domain,
                key,
                value_prefix,
                until,
                call_timeout,
            )));
        }
    }
    let mut tally = Tally::default();
    for task in tasks {
        tally.add(task.await.context("a caller task panicked")?);
    }
    let took_s = started.elapsed().as_secs_f64();
    report(&args, &mut tally, took_s);
    Ok(())
}

/// Makes one call after another, each with a value of its own, until
/// `until`.
async fn caller(
    mut client: RateLimitServiceClient<Channel>,
    domain: String,
    key: String,
    value_prefix: String,
    until: Instant,
    call_timeout: Duration,
) -> Tally {
    let mut tally = Tally::default();
    let mut n: u64 = 0;
    while Instant::now() < until {
        n += 1;
        let mut request = tonic::Request::new(RateLimitRequest {
            domain: domain.clone(),
            descriptors: vec![RateLimitDescriptor {
                entries: vec![Entry {
                    key: key.clone(),
                    value: format!("{value_prefix}-{n}"),
                }],
                ..Default::default()
            }],
            hits_addend: 1,
        });
        request.set_timeout(call_timeout);
        let sent = Instant::now();
        match client.should_rate_limit(request).await {
            Ok(answer) => {
                let took_us = u64::try_from(sent.elapsed().as_micros()).unwrap_or(u64::MAX);
                tally.latencies_us.push(took_us);
                let code = answer.into_inner().overall_code;
                match Code::try_from(code) {
                    Ok(Code::Ok) => tally.ok += 1,
                    Ok(Code::OverLimit) => tally.over_limit += 1,
                    _ => *tally.other_codes.entry(code).or_default() += 1,
                }
            }
            Err(status) => {
                *tally
                    .errors
                    .entry(format!("{:?}", status.code()))
                    .or_default() += 1;
            }
        }
    }
    tally
}

fn report(args: &Args, tally: &mut Tally, took_s: f64) {
    let answered = tally.ok + tally.over_limit + tally.other_codes.values().sum::<u64>();
    let failed: u64 = tally.errors.values().sum();
    tally.latencies_us.sort_unstable();
    let quantile_ms = |q: f64| -> f64 {
        if tally.latencies_us.is_empty() {
            return f64::NAN;
        }
        let i = ((tally.latencies_us.len() - 1) as f64 * q).round() as usize;
        tally.latencies_us[i] as f64 / 1_000.0
    };
    println!(
        "connections {} x in flight {} = {} calls in flight, {:.1} s",
        args.connections,
        args.in_flight,
        args.connections * args.in_flight,
        took_s
    );
    println!(
        "answered {answered} ({:.0}/s): OK {}, OVER_LIMIT {}{}",
        answered as f64 / took_s,
        tally.ok,
        tally.over_limit,
        if tally.other_codes.is_empty() {
            String::new()
        } else {
            format!(", other codes {}", tally.other_codes.values().sum::<u64>())
        }
    );
    let errors: Vec<String> = tally
        .errors
        .iter()
        .map(|(code, n)| format!("{code} {n}"))
        .collect();
    println!(
        "failed {failed}{}",
        if errors.is_empty() {
            String::new()
        } else {
            format!(": {}", errors.join(", "))
        }
    );
    println!(
        "latency of answered calls: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        quantile_ms(0.5),
        quantile_ms(0.99),
        quantile_ms(1.0)
    );
}
