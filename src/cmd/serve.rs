//! `ratewarden serve`: the rate-limit service.

use std::net::SocketAddr;
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
    /// Where counts live: memory, redis://host:port[/db],
    /// redis+unix:///path or redis-cluster://host:port,host:port.
    #[arg(long, default_value = "memory", value_name = "STORE")]
    pub store: StoreUrl,
    /// Address of the HTTP JSON interface.
    #[arg(long, default_value = "127.0.0.1:8080", value_name = "ADDR")]
    pub http: SocketAddr,
    /// Address of the Envoy RLS v3 gRPC interface.
    #[arg(long, default_value = "127.0.0.1:8081", value_name = "ADDR")]
    pub grpc: SocketAddr,
}

/// Runs the service until SIGTERM or SIGINT.
pub fn run(args: Args) -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
    let options = ServeOptions {
        config: ConfigSource { path: args.config },
        store: args.store,
        http: args.http,
        grpc: args.grpc,
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("ratewarden serve: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        ratewarden_server::serve_until_signal(options, |running| {
            // Tests and scripts read this line to learn the ports.
            println!(
                "ratewarden serve: HTTP on http://{}/v1/check, gRPC on {}",
                running.http_addr, running.grpc_addr
            );
        })
        .await
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ratewarden serve: {e:#}");
            ExitCode::FAILURE
        }
    }
}
