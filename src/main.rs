//! `ratewarden`: the command-line entry point. Each subcommand lives in its
//! own module under `cmd/`.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod cmd;
mod measure;

/// Exact, portable rate limiting.
#[derive(Parser)]
#[command(name = "ratewarden", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run conformance vector files against a store.
    Vectors(cmd::vectors::Args),
    /// Run the rate-limit service: HTTP JSON and Envoy RLS v3 gRPC.
    ///
    /// SIGHUP reloads the configuration file; SIGTERM and SIGINT stop
    /// accepting connections, let requests in flight finish (at most 30 s;
    /// a second signal, once the stop has logged that it waits, stops at
    /// once) and exit. Everything else: docs/serve.md.
    Serve(cmd::serve::Args),
    /// Measure speed, memory and accuracy of every policy, beside governor.
    #[command(allow_negative_numbers = true)]
    Bench(cmd::bench::Args),
    /// Draw how policies answer a traffic shape (SVG chart, CSV series).
    #[command(allow_negative_numbers = true)]
    Simulate(cmd::simulate::Args),
    /// Measure the Redis store: pipelined decisions/s, round trips and
    /// server CPU per policy, beside redis-benchmark on the same server.
    #[command(allow_negative_numbers = true)]
    BenchRedis(cmd::bench_redis::Args),
    /// Name the Redis key that holds the count a request spends: to delete
    /// one client's count (its whole budget back), or read it.
    ///
    /// The name is printed alone on standard output, so that
    /// `redis-cli DEL "$(ratewarden key --config FILE --key user:42)"`
    /// works; the rule that counts it goes to standard error. Give the
    /// configuration file `serve` runs with: key names hold the rule's
    /// place in it and `[server] key_prefix`. The embedded store's counts
    /// live in the serve process only (a restart clears them).
    Key(cmd::key::Args),
}

// `bench`'s own child, `ratewarden bench-memory ...`, is parsed apart from
// the subcommands: clap names even a hidden subcommand when it suggests one
// for a misspelt name (`benhc`), and `help bench-memory` documents it.
#[derive(Parser)]
#[command(
    name = "ratewarden bench-memory",
    bin_name = "ratewarden bench-memory",
    about = "Measure one contender's memory in a fresh process (used by `bench`)."
)]
struct BenchMemory {
    #[command(flatten)]
    args: cmd::bench::MemoryArgs,
}

fn main() -> ExitCode {
    if std::env::args_os()
        .nth(1)
        .is_some_and(|arg| arg == "bench-memory")
    {
        // The subcommand's name stands as the program's.
        let memory = BenchMemory::parse_from(std::env::args_os().skip(1));
        return cmd::bench::run_memory(memory.args);
    }
    let cli = Cli::parse();
    match cli.command {
        Command::Vectors(args) => cmd::vectors::run(args),
        Command::Serve(args) => cmd::serve::run(args),
        Command::Bench(args) => cmd::bench::run(args),
        Command::Simulate(args) => cmd::simulate::run(args),
        Command::Key(args) => cmd::key::run(args),
        Command::BenchRedis(args) => cmd::bench_redis::run(args),
    }
}
