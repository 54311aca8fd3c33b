//! `ratewarden key`: the Redis key of the count one request spends, to
//! find (and delete, or read) one client's count.

use super::errln;
use std::path::PathBuf;
use std::process::ExitCode;

use ratewarden_server::count_key::{self, Request};
use ratewarden_server::rules::LimitOverride;
use ratewarden_server::ConfigSource;

/// Arguments of `ratewarden key`.
#[derive(clap::Args)]
#[command(group = clap::ArgGroup::new("request").required(true).args(["key", "domain"]))]
pub struct Args {
    /// The configuration file `serve` runs with (TOML); without one, the
    /// reference configuration, as `serve` without --config.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// A key request's key, as `{"key": ...}` sends it to /v1/check.
    #[arg(long, value_name = "KEY", allow_hyphen_values = true, conflicts_with_all = ["domain", "entry", "limit"])]
    pub key: Option<String>,
    /// A descriptor's domain (with --entry).
    #[arg(
        long,
        value_name = "DOMAIN",
        allow_hyphen_values = true,
        requires = "entry"
    )]
    pub domain: Option<String>,
    /// One entry of the descriptor, KEY=VALUE (the value may be empty, and
    /// may hold '='); repeat it for each entry, in the request's order.
    #[arg(long, value_name = "KEY=VALUE", allow_hyphen_values = true, value_parser = parse_entry)]
    pub entry: Vec<(String, String)>,
    /// The descriptor's own limit, when it carries one (Envoy's limit
    /// override): REQUESTS_PER_UNIT/UNIT, such as 10/minute.
    #[arg(long, value_name = "N/UNIT", value_parser = count_key::parse_limit)]
    pub limit: Option<LimitOverride>,
}

fn parse_entry(text: &str) -> Result<(String, String), String> {
    text.split_once('=')
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| {
            format!("{text:?} has no '='; write KEY=VALUE, such as remote_address=10.0.0.1")
        })
}

/// Prints the key's name on standard output (alone, for `redis-cli DEL
/// "$(ratewarden key ...)"`) and its rule on standard error.
pub fn run(args: Args) -> ExitCode {
    let source = ConfigSource { path: args.config };
    let request = match args.key {
        Some(key) => Request::Key(key),
        None => Request::Descriptor {
            domain: args.domain.unwrap_or_default(),
            entries: args.entry,
            limit: args.limit,
        },
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            errln!("ratewarden key: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    // A read that blocks (a pipe no one writes to) is given as long as
    // `serve --check` gives it, then left: it must not keep the process
    // from exiting either.
    let found = runtime.block_on(count_key::count_of(&source, &request));
    runtime.shutdown_timeout(std::time::Duration::from_millis(100));
    let count = match found {
        Ok(count) => count,
        Err(e) => {
            errln!("ratewarden key: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(ignored) = &count.ignored {
        errln!("{ignored}; the rule's count is named");
    }
    // The policy's own rendering, so the line names its burst too.
    let shadow = if count.shadow { ", shadow" } else { "" };
    errln!("rule {:?}: {}{shadow}", count.rule, count.policy);
    match super::print_out(&format!("{}\n", count.redis_key)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(_) => ExitCode::FAILURE,
    }
}
