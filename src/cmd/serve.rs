//! `ratewarden serve`: the rate-limit service.

use super::errln;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;

use ratewarden_server::{ConfigSource, ServeOptions, StoreUrl};

/// Arguments of `ratewarden serve`.
#[derive(clap::Args)]
pub struct Args {
    /// Configuration file (TOML). Without one, every key and every
    /// descriptor is limited by the reference configuration:
    /// sliding-window-counter, 100 per 1000 ms. SIGHUP reloads it.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Where counts live: memory, redis://host:port[/db] (with a password:
    /// redis://:PASSWORD@host:port), redis+unix:///path,
    /// redis-cluster://host:port,host:port, or over TLS rediss://host:port
    /// and rediss-cluster://host:port,host:port (certificate files in the
    /// config's [redis] table, or SSL_CERT_FILE for the CA). Also read from the environment
    /// variable RATEWARDEN_STORE, which keeps a password out of the
    /// process list.
    #[arg(long, env = "RATEWARDEN_STORE", hide_env_values = true, default_value = "memory", value_name = "STORE", value_parser = super::StoreUrlParser)]
    pub store: StoreUrl,
    /// Address of the HTTP JSON interface, HOST:PORT (a name such as
    /// localhost is resolved at start; port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:8080", value_name = "ADDR", value_parser = parse_addr)]
    pub http: SocketAddr,
    /// Address of the Envoy RLS v3 gRPC interface, HOST:PORT (as --http).
    #[arg(long, default_value = "127.0.0.1:8081", value_name = "ADDR", value_parser = parse_addr)]
    pub grpc: SocketAddr,
    /// Serve GET /metrics on a port of its own, HOST:PORT (as --http), and
    /// no longer on --http's: a port the operator can keep from the
    /// clients (/healthz and /readyz are served on both).
    #[arg(long, value_name = "ADDR", value_parser = parse_addr)]
    pub metrics: Option<SocketAddr>,
    /// Check the configuration and exit: read the file as a start would,
    /// compile its rules, and say how many there are (exit 0) or what is
    /// wrong (exit 1; a flag's bad value, --store's included, exits 2, as
    /// without --check). Nothing listens and no store is connected
    /// (--store's [redis] files are checked). Run it on a file before
    /// SIGHUP reloads it.
    #[arg(long)]
    pub check: bool,
}

/// `HOST:PORT` with an IP address or a name, resolved now: the README's
/// own examples say localhost, so the flags take it too. A name with
/// several addresses listens on the first the resolver gives.
fn parse_addr(s: &str) -> Result<SocketAddr, String> {
    use std::net::ToSocketAddrs;
    if let Ok(addr) = s.parse() {
        return Ok(addr);
    }
    let usage = "write HOST:PORT, such as 127.0.0.1:8080, [::1]:8080 or localhost:8080";
    match s.to_socket_addrs() {
        Ok(mut addrs) => addrs
            .next()
            .ok_or_else(|| format!("{s:?} resolves to no address; {usage}")),
        Err(e) => Err(format!("{s:?} is not an address: {e}; {usage}")),
    }
}

/// Whether listening on `a` keeps a listener on `b` from starting: one
/// port (not 0, which picks a free one each), on one address (an
/// IPv4-mapped IPv6 address is its IPv4 one; a link-local one is one per
/// interface), or where one of them is unspecified: `0.0.0.0` takes the
/// port on every IPv4 address, `[::]` on every IPv6 one, and on every IPv4
/// one too unless `v6_only` (`net.ipv6.bindv6only`).
fn clash_with(a: SocketAddr, b: SocketAddr, v6_only: bool) -> bool {
    let ip = |addr: SocketAddr| match addr.ip() {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    };
    let (ia, ib) = (ip(a), ip(b));
    let same_scope = match (a, b) {
        (SocketAddr::V6(x), SocketAddr::V6(y)) => x.scope_id() == y.scope_id(),
        _ => true,
    };
    let covers = |wide: IpAddr, other: IpAddr| {
        wide.is_unspecified() && (wide.is_ipv4() == other.is_ipv4() || (wide.is_ipv6() && !v6_only))
    };
    a.port() == b.port()
        && a.port() != 0
        && ((ia == ib && same_scope) || covers(ia, ib) || covers(ib, ia))
}

/// Runs the service until SIGTERM or SIGINT.
pub fn run(args: Args) -> ExitCode {
    // A RUST_LOG that does not parse is said, not dropped without a word:
    // whoever set it expects its lines.
    let (filter, bad_filter) = match tracing_subscriber::EnvFilter::try_from_default_env() {
        Ok(filter) => (filter, None),
        Err(e) => {
            let given = std::env::var("RUST_LOG")
                .ok()
                .filter(|v| !v.trim().is_empty());
            (
                tracing_subscriber::EnvFilter::new("info"),
                given.map(|v| (v, e)),
            )
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        // A line that cannot be written (the log's reader went away) is
        // lost; by default the subscriber would say so with eprintln!,
        // whose panic on the same broken pipe would end the call being
        // answered, or the process on a reload or a stop.
        .log_internal_errors(false)
        .init();
    if let Some((given, e)) = bad_filter {
        errln!(
            "ratewarden serve: warning: RUST_LOG={given:?} is not a filter tracing reads \
             ({e}), so it is ignored and info and above are logged; write directives such as \
             warn or info,ratewarden_server=debug"
        );
    }
    // Linux's default, dual-stack `[::]`, unless the host says otherwise.
    let v6_only =
        std::fs::read_to_string("/proc/sys/net/ipv6/bindv6only").is_ok_and(|s| s.trim() == "1");
    let mut given = vec![("--http", args.http), ("--grpc", args.grpc)];
    given.extend(args.metrics.map(|a| ("--metrics", a)));
    for (i, (flag, addr)) in given.iter().enumerate() {
        if let Some((other, other_addr)) = given[..i]
            .iter()
            .find(|(_, a)| clash_with(*a, *addr, v6_only))
        {
            let what = if other_addr == addr {
                format!("are both {addr}")
            } else if other_addr.ip().is_unspecified() || addr.ip().is_unspecified() {
                format!(
                    "share port {} ({other_addr} and {addr}: an unspecified address takes \
                     the port on every address)",
                    addr.port()
                )
            } else {
                format!(
                    "share port {} ({other_addr} and {addr} are one address)",
                    addr.port()
                )
            };
            errln!(
                "ratewarden serve: {other} and {flag} {what}; give each interface a port of \
                 its own"
            );
            return ExitCode::FAILURE;
        }
    }
    // After the addresses: a command line --check passes must start.
    if args.check {
        return check(args);
    }
    let options = ServeOptions {
        config: ConfigSource { path: args.config },
        store: args.store,
        http: args.http,
        grpc: args.grpc,
        metrics: args.metrics,
    };
    let Some(runtime) = runtime(tokio::runtime::Builder::new_multi_thread()) else {
        return ExitCode::FAILURE;
    };
    let result = runtime.block_on(async {
        ratewarden_server::serve_until_signal(options, |running| {
            // Tests and scripts read this line to learn the ports. One
            // that stopped reading (or a closed standard output) is no
            // reason to stop serving, as println!'s panic would.
            // The gRPC address stays last, where scripts written for
            // the line without metrics find it.
            let metrics = running
                .metrics_addr
                .map(|a| format!(", metrics on http://{a}/metrics"))
                .unwrap_or_default();
            let _ = super::print_out(&format!(
                "ratewarden serve: HTTP on http://{}/v1/check{metrics}, gRPC on {}\n",
                running.http_addr, running.grpc_addr
            ));
        })
        .await
    });
    // A configuration read that still blocks (see ConfigSource::
    // load_in_background) must not keep the process from exiting, as
    // dropping the runtime would: it waits for every blocking thread.
    runtime.shutdown_timeout(std::time::Duration::from_millis(100));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // Already logged, with the reason.
        Err(e) if e.is::<ratewarden_server::StoppedUnclean>() => ExitCode::FAILURE,
        Err(e) => {
            errln!("ratewarden serve: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// `serve --check`: the configuration read and compiled, nothing started.
fn check(args: Args) -> ExitCode {
    let source = ConfigSource { path: args.config };
    let shown = source.path.as_ref().map_or_else(
        || "the reference configuration".to_owned(),
        |p| p.display().to_string(),
    );
    let Some(runtime) = runtime(tokio::runtime::Builder::new_current_thread()) else {
        return ExitCode::FAILURE;
    };
    // A read that blocks (a pipe no one writes to, a hung mount) is given
    // as long as a reload gives it, then left: it must not keep the process
    // from exiting either.
    let checked = runtime.block_on(ratewarden_server::check_config(&source, &args.store));
    runtime.shutdown_timeout(std::time::Duration::from_millis(100));
    match checked {
        Ok(rules) => {
            let rules = match rules {
                1 => "1 rule".to_owned(),
                n => format!("{n} rules"),
            };
            match super::print_out(&format!("ratewarden serve: {shown} loads: {rules}\n")) {
                Ok(()) => ExitCode::SUCCESS,
                Err(_) => ExitCode::FAILURE,
            }
        }
        Err(e) => {
            errln!("ratewarden serve: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The runtime `builder` makes, with I/O and time; `None` once it has said
/// why it could not.
fn runtime(mut builder: tokio::runtime::Builder) -> Option<tokio::runtime::Runtime> {
    match builder.enable_all().build() {
        Ok(r) => Some(r),
        Err(e) => {
            errln!("ratewarden serve: cannot start the runtime: {e}");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn addresses_clash_on_one_port_where_one_covers_the_other() {
        let clash =
            |a: &str, b: &str| super::clash_with(a.parse().unwrap(), b.parse().unwrap(), false);
        assert!(clash("127.0.0.1:80", "127.0.0.1:80"));
        assert!(clash("0.0.0.0:80", "127.0.0.1:80"));
        assert!(clash("127.0.0.1:80", "[::]:80"));
        assert!(clash("[::]:80", "[::1]:80"));
        assert!(!clash("0.0.0.0:80", "[::1]:80"));
        assert!(!clash("127.0.0.1:80", "127.0.0.2:80"));
        assert!(!clash("0.0.0.0:80", "0.0.0.0:81"));
        assert!(!clash("0.0.0.0:0", "127.0.0.1:0"));
        // One address written two ways; one per interface.
        assert!(clash("[::ffff:127.0.0.1]:80", "127.0.0.1:80"));
        assert!(clash("0.0.0.0:80", "[::ffff:127.0.0.1]:80"));
        assert!(!clash("[fe80::1%1]:80", "[fe80::1%2]:80"));
        assert!(clash("[fe80::1%1]:80", "[fe80::1%1]:80"));
        // With net.ipv6.bindv6only, [::] leaves IPv4 alone.
        let v6_only =
            |a: &str, b: &str| super::clash_with(a.parse().unwrap(), b.parse().unwrap(), true);
        assert!(!v6_only("0.0.0.0:80", "[::]:80"));
        assert!(v6_only("[::]:80", "[::1]:80"));
    }
}
