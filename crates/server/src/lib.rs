//! The ratewarden rate-limit service: HTTP JSON and Envoy's RLS v3 gRPC
//! over any store.
//!
//! A configuration (see [`config`]) maps keys and descriptors to rules; each
//! rule decides through an `Arc<dyn Limiter>` made by a [`StoreFactory`], so
//! the embedded memory store and networked stores are interchangeable. The
//! `ratewarden serve` command is a thin wrapper around [`start`] and
//! [`serve_until_signal`].
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod call_deadline;
pub mod config;
pub mod conn;
pub mod count_key;
pub mod grpc;
pub mod http;
pub mod metrics;
pub mod request_bytes;
pub mod rules;
pub mod service;
pub mod store;

/// The Envoy API types, generated from the `.proto` files under `proto/`.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod proto {
    /// `envoy.*` packages.
    pub mod envoy {
        /// `envoy.config.*`.
        pub mod config {
            /// `envoy.config.core.*`.
            pub mod core {
                /// `envoy.config.core.v3`.
                pub mod v3 {
                    tonic::include_proto!("envoy.config.core.v3");
                }
            }
        }
        /// `envoy.type.*`.
        pub mod r#type {
            /// `envoy.type.v3`.
            pub mod v3 {
                tonic::include_proto!("envoy.r#type.v3");
            }
        }
        /// `envoy.extensions.*`.
        pub mod extensions {
            /// `envoy.extensions.common.*`.
            pub mod common {
                /// `envoy.extensions.common.ratelimit.*`.
                pub mod ratelimit {
                    /// `envoy.extensions.common.ratelimit.v3`.
                    pub mod v3 {
                        tonic::include_proto!("envoy.extensions.common.ratelimit.v3");
                    }
                }
            }
        }
        /// `envoy.service.*`.
        pub mod service {
            /// `envoy.service.ratelimit.*`.
            pub mod ratelimit {
                /// `envoy.service.ratelimit.v3`.
                pub mod v3 {
                    tonic::include_proto!("envoy.service.ratelimit.v3");
                }
            }
        }
    }
}

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic_health::ServingStatus;

use crate::metrics::Api;

pub use config::{Config, ConfigFileError, ConfigSource, RedisTlsFiles, ServerSettings};
pub use service::Service;
pub use store::{BuiltLimiter, MemoryFactory, RedisFactory, StoreFactory, StoreUrl};

/// How to run the server.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// The configuration file, or none for the reference configuration.
    pub config: ConfigSource,
    /// The store.
    pub store: StoreUrl,
    /// Where HTTP listens (port 0 picks a free one).
    pub http: SocketAddr,
    /// Where gRPC listens (port 0 picks a free one).
    pub grpc: SocketAddr,
    /// Where `GET /metrics` is served, on a port of its own, instead of
    /// on `http` (port 0 picks a free one).
    pub metrics: Option<SocketAddr>,
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            config: ConfigSource { path: None },
            store: StoreUrl::Memory,
            http: SocketAddr::from(([127, 0, 0, 1], 8080)),
            grpc: SocketAddr::from(([127, 0, 0, 1], 8081)),
            metrics: None,
        }
    }
}

/// The factory for a store named on the command line.
pub fn factory_for(
    store: &StoreUrl,
    settings: &ServerSettings,
) -> anyhow::Result<Arc<dyn StoreFactory>> {
    match store {
        StoreUrl::Memory => {
            if settings.redis_tls != RedisTlsFiles::default() {
                tracing::warn!(
                    "the configuration's [redis] table names TLS files, but the store is the \
                     embedded one: they are not used (they are for a rediss:// or \
                     rediss-cluster:// --store)"
                );
            }
            Ok(Arc::new(MemoryFactory {
                options: settings.memory_options(),
            }))
        }
        StoreUrl::Redis(url) | StoreUrl::RedisCluster(url) => {
            let factory = store::RedisFactory::new(
                url.clone(),
                settings.store_timeout_ms,
                settings.key_prefix.clone(),
                settings.redis_tls.clone(),
            );
            // The [redis] files are checked here, with the options every
            // connection is made with, so that a mistake in them is told
            // as the table's, not as the first rule's.
            // Without files named there, what fails is the system's
            // certificates (SSL_CERT_FILE, say), which the table has no part in.
            let whose = if settings.redis_tls == RedisTlsFiles::default() {
                "TLS"
            } else {
                "the configuration's [redis] table"
            };
            ratewarden_redis::check_tls_files(url, &factory.options())
                .map_err(|e| anyhow::anyhow!("{whose}: {}", e.detail()))?;
            Ok(Arc::new(factory))
        }
    }
}

/// A running server.
#[derive(Debug)]
pub struct Running {
    /// Where HTTP listens.
    pub http_addr: SocketAddr,
    /// Where gRPC listens.
    pub grpc_addr: SocketAddr,
    /// Where `GET /metrics` is served when it has a port of its own.
    pub metrics_addr: Option<SocketAddr>,
    /// The shared state, for reloads and inspection.
    pub service: Arc<Service>,
    health: tonic_health::server::HealthReporter,
    shutdown: watch::Sender<bool>,
    http_task: JoinHandle<anyhow::Result<()>>,
    metrics_task: Option<JoinHandle<anyhow::Result<()>>>,
    grpc_task: JoinHandle<anyhow::Result<()>>,
    grpc_calls: Arc<grpc::Calls>,
    keeper_task: JoinHandle<anyhow::Result<()>>,
}

/// How long the gRPC side waits, once no call is left to answer, for its
/// connections to close on their own after the GOAWAY: a peer that answers
/// it takes a round trip. Connections still open then are dropped.
pub const GRPC_GOAWAY_GRACE: Duration = Duration::from_secs(1);

/// How long a gRPC connection may stay silent before the server pings it.
pub const GRPC_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);

/// How long a ping may go unanswered before the connection is closed.
pub const GRPC_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// Returns once no gRPC call has been open for [`GRPC_GOAWAY_GRACE`].
async fn grpc_quiet(calls: &grpc::Calls) {
    loop {
        calls.none_open().await;
        tokio::time::sleep(GRPC_GOAWAY_GRACE).await;
        if calls.open() == 0 {
            return;
        }
    }
}

impl Running {
    /// Stops accepting connections, lets requests in flight finish (at most
    /// `grace`), and returns when both interfaces have stopped.
    pub async fn shutdown(self, grace: Duration) -> anyhow::Result<()> {
        // First tell health checkers (Envoy's grpc_health_check, and anyone
        // watching) to send traffic elsewhere.
        set_health(&self.health, ServingStatus::NotServing).await;
        let _ = self.shutdown.send(true);
        let calls = self.grpc_calls;
        let mut grpc_task = self.grpc_task;
        let grpc = async {
            // A graceful shutdown waits for every connection to
            // close, which its peer may never do (one that never finished
            // its handshake, or a health `Watch` stream). What must finish
            // is the calls: once none is left, the rest are dropped.
            tokio::select! {
                done = &mut grpc_task => done,
                () = grpc_quiet(&calls) => {
                    grpc_task.abort();
                    Ok(Ok(()))
                }
            }
        };
        let all = async {
            self.http_task.await.context("a server task panicked")??;
            if let Some(task) = self.metrics_task {
                task.await.context("a server task panicked")??;
            }
            grpc.await.context("a server task panicked")??;
            self.keeper_task.await.context("a server task panicked")??;
            anyhow::Ok(())
        };
        let deadline = tokio::time::Instant::now() + grace;
        let mut all = std::pin::pin!(all);
        // Most shutdowns end at once, or once idle gRPC peers have had
        // their GRPC_GOAWAY_GRACE; one that waits on a slow client (a body
        // still arriving, up to its 10 s) says so, rather than going quiet
        // until it ends.
        let said_after = wait_said_after(grace);
        if let Ok(result) = tokio::time::timeout(said_after, &mut all).await {
            return result;
        }
        tracing::info!(
            "waiting for the requests in flight to finish (at most {} ms more)",
            grace.saturating_sub(said_after).as_millis()
        );
        match tokio::time::timeout_at(deadline, all).await {
            Ok(result) => result,
            // Logged as the server's other lines are, so that a log
            // collector that reads them finds the one that says the stop
            // was cut short.
            Err(_) => {
                tracing::error!(
                    "requests still in flight after {} ms; stopping anyway",
                    grace.as_millis()
                );
                Err(StoppedUnclean.into())
            }
        }
    }
}

/// How long into a stop [`Running::shutdown`] says that it waits for
/// requests in flight, when it still does.
fn wait_said_after(grace: Duration) -> Duration {
    (3 * GRPC_GOAWAY_GRACE).min(grace)
}

/// The service name envoyproxy/ratelimit reports its health under: an
/// Envoy cluster moved from it checks `grpc_health_check: {service_name:
/// ratelimit}`, which would otherwise get `NOT_FOUND` and mark every host
/// unhealthy.
pub const ENVOYPROXY_RATELIMIT_HEALTH_NAME: &str = "ratelimit";

/// Sets the health status of the whole server (`""`) and of the rate-limit
/// service, under its own name and envoyproxy/ratelimit's.
async fn set_health(health: &tonic_health::server::HealthReporter, status: ServingStatus) {
    health.set_service_status("", status).await;
    health.set_service_status(grpc::SERVICE_NAME, status).await;
    health
        .set_service_status(ENVOYPROXY_RATELIMIT_HEALTH_NAME, status)
        .await;
}

/// Reads the configuration as [`start`] would, checks the `store`
/// settings it names (the `[redis]` table's files), and compiles its rules
/// on the embedded store, connecting to nothing and listening nowhere: the
/// number of rules, or what is wrong, as at start. Warnings (rules that
/// admit nothing, unused files) are logged as at start.
pub async fn check_config(source: &ConfigSource, store: &StoreUrl) -> anyhow::Result<usize> {
    let config = source.load_within(service::RELOAD_READ_TIMEOUT).await?;
    factory_for(store, &config.server)?;
    let memory = MemoryFactory {
        options: config.server.memory_options(),
    };
    let rules = rules::RuleSet::build(config, &memory, None, &metrics::Metrics::default()).await?;
    rules.warn_of_closed_rules();
    Ok(rules.rules().len())
}

/// A listener on `addr` for the interface `what`, which `flag` sets; a
/// failure says what to change for the usual causes.
async fn listen(addr: SocketAddr, what: &str, flag: &str) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr).await.map_err(|e| {
        let hint = match e.kind() {
            std::io::ErrorKind::AddrInUse => format!(
                ": something listens on port {} already (another process, or another of \
                 this server's interfaces: an unspecified address such as 0.0.0.0 or [::] \
                 takes the port on every address); give {flag} another port, or port 0 \
                 for a free one",
                addr.port()
            ),
            std::io::ErrorKind::PermissionDenied => format!(
                ": a port below 1024 takes privileges (root, or CAP_NET_BIND_SERVICE, as \
                 systemd's AmbientCapabilities grants); give {flag} a port from 1024 up"
            ),
            std::io::ErrorKind::AddrNotAvailable => format!(
                ": {} is no address of this machine; give {flag} one of its own (127.0.0.1 \
                 for this machine only, 0.0.0.0 or [::] for all)",
                addr.ip()
            ),
            _ => String::new(),
        };
        anyhow::anyhow!("cannot listen for {what} on {addr}: {e}{hint}")
    })
}

/// Loads the configuration, builds the store and starts both interfaces and
/// the housekeeping timer.
pub async fn start(options: ServeOptions) -> anyhow::Result<Running> {
    // Bounded, as a reload's read is: a start on a file that never reads
    // through ends with a message rather than hang in silence.
    let config = options
        .config
        .load_within(service::RELOAD_READ_TIMEOUT)
        .await?;
    let factory = factory_for(&options.store, &config.server)?;
    let service = Arc::new(Service::with_config(config, options.config.clone(), factory).await?);
    let http_listener = listen(options.http, "HTTP", "--http").await?;
    let grpc_listener = listen(options.grpc, "gRPC", "--grpc").await?;
    let metrics_listener = match options.metrics {
        Some(addr) => Some(listen(addr, "metrics", "--metrics").await?),
        None => None,
    };
    let http_addr = http_listener.local_addr()?;
    let grpc_addr = grpc_listener.local_addr()?;
    let metrics_addr = match &metrics_listener {
        Some(listener) => Some(listener.local_addr()?),
        None => None,
    };
    let (shutdown, stop) = watch::channel(false);

    let max_connections = raise_open_file_limit(service.settings().max_connections);
    let metrics = Arc::clone(&service.metrics);
    let http_acceptor = conn::Acceptor::new(
        http_listener,
        Api::Http,
        max_connections,
        Arc::clone(&metrics),
    );
    let app = http::router(
        Arc::clone(&service),
        http::Port::Check {
            metrics_elsewhere: metrics_listener.is_some(),
        },
    );
    let http_stop = stop.clone();
    let http_task = tokio::spawn(async move {
        http::serve(http_acceptor, app, http_stop)
            .await
            .context("the HTTP server failed")
    });
    let metrics_task = metrics_listener.map(|listener| {
        let acceptor = conn::Acceptor::new(
            listener,
            Api::Metrics,
            METRICS_MAX_CONNECTIONS,
            Arc::clone(&metrics),
        );
        let app = http::router(Arc::clone(&service), http::Port::Metrics);
        let stop = stop.clone();
        tokio::spawn(async move {
            http::serve(acceptor, app, stop)
                .await
                .context("the metrics server failed")
        })
    });

    let grpc_calls = Arc::new(grpc::Calls::default());
    let rls = grpc::server(Arc::clone(&service), Arc::clone(&grpc_calls));
    let grpc_calls_bodies = Arc::clone(&grpc_calls);
    let deadline_metrics = Arc::clone(&service.metrics);
    // grpc.health.v1.Health, as envoyproxy/ratelimit serves it: Envoy
    // clusters with grpc_health_check need it.
    let (health, health_service) = tonic_health::server::health_reporter();
    set_health(&health, ServingStatus::Serving).await;
    let routes = tonic::service::Routes::new(rls)
        .add_service(health_service)
        .prepare();
    let grpc_service = tower::ServiceBuilder::new()
        // Every call has an end, its client's or the server's (see
        // call_deadline).
        .layer(call_deadline::CallDeadlines::new(deadline_metrics))
        // And the bytes a connection's calls hold, and the time a message
        // may take to arrive (see request_bytes).
        .layer(request_bytes::BoundRequestBodies::new(grpc_calls_bodies))
        .service(routes);
    let grpc_acceptor = conn::Acceptor::new(grpc_listener, Api::Grpc, max_connections, metrics);
    let grpc_stop = stop.clone();
    let grpc_max_streams = service.settings().grpc_max_streams_per_connection;
    let grpc_task = tokio::spawn(async move {
        grpc::serve(grpc_acceptor, grpc_service, grpc_max_streams, grpc_stop)
            .await
            .context("the gRPC server failed")
    });

    let keeper = Arc::clone(&service);
    let mut keeper_stop = stop;
    let keeper_task = tokio::spawn(async move {
        let period = Duration::from_millis(keeper.settings().housekeeping_interval_ms);
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = keeper_stop.wait_for(|s| *s) => return Ok(()),
            }
            // On the blocking pool: a pass takes whole shards' locks and
            // visits every rule's store, with many rules many milliseconds
            // that a runtime worker would not spend on the requests queued
            // to it.
            let pass = Arc::clone(&keeper);
            let done = match tokio::task::spawn_blocking(move || pass.housekeeping()).await {
                Ok(done) => done,
                // Said now, and the next pass tried: ending the timer here
                // would let idle keys fill the stores, said only at
                // shutdown.
                Err(e) => {
                    tracing::error!(error = %e, "a housekeeping pass failed");
                    continue;
                }
            };
            if done.forgotten + done.forgotten_for_new_keys > 0 {
                tracing::debug!(
                    forgotten = done.forgotten,
                    forgotten_for_new_keys = done.forgotten_for_new_keys,
                    "idle keys forgotten"
                );
            }
        }
    });

    tracing::info!(
        http = %http_addr,
        grpc = %grpc_addr,
        metrics = %metrics_addr.map_or_else(|| "on the HTTP port".to_owned(), |a| a.to_string()),
        store = %service.store_description(),
        config = %service.rules().config.source,
        "ratewarden serve is listening"
    );
    Ok(Running {
        http_addr,
        grpc_addr,
        metrics_addr,
        service,
        health,
        shutdown,
        http_task,
        metrics_task,
        grpc_task,
        grpc_calls,
        keeper_task,
    })
}

/// Open files the process needs beside its connections: listeners, Redis
/// connections, the configuration file when it is read, the `--metrics`
/// port's connections, a margin.
const FILES_BESIDE_CONNECTIONS: u64 = 256;

/// The most connections the `--metrics` port holds open at once: its
/// clients are a few scrapers and an operator's curl, and the bound keeps
/// them well within the open files kept beside the other interfaces'
/// connections (256).
pub const METRICS_MAX_CONNECTIONS: usize = 64;

/// Raises the soft open-file limit towards the hard one, so that
/// `max_connections` on each of the two interfaces can be open at once
/// (processes start with a soft limit of 1,024 on most systems, below the
/// default of 10,000 connections per interface), and returns how many
/// connections each interface may hold: `max_connections`, or what fits
/// when even the hard limit is too low, which is said at start. Past the
/// open files a new connection would wait unserved, however few requests
/// are in flight; past what fits it is closed at once and counted, as one
/// over `max_connections` is.
fn raise_open_file_limit(max_connections: usize) -> usize {
    let wanted = (max_connections as u64)
        .saturating_mul(2)
        .saturating_add(FILES_BESIDE_CONNECTIONS);
    match rlimit::increase_nofile_limit(wanted) {
        Ok(limit) if limit >= wanted => max_connections,
        Ok(limit) => {
            // The margin is for a process with many rules on Redis; a
            // limit below it still serves about half its files.
            let connections = limit.saturating_sub(FILES_BESIDE_CONNECTIONS.min(limit / 2));
            let each = usize::try_from(connections / 2)
                .unwrap_or(usize::MAX)
                .clamp(1, max_connections);
            let said = format!(
                "the open-file limit is {limit} (the hard limit), below the {wanted} that \
                 server.max_connections = {max_connections} needs (twice it, for HTTP and gRPC, \
                 and {FILES_BESIDE_CONNECTIONS} more): each interface holds at most {each} \
                 connections, closing further ones as over max_connections; raise the hard \
                 limit (`ulimit -Hn`, systemd's LimitNOFILE) or lower server.max_connections"
            );
            // The default, not chosen, is fitted without a warning: a
            // container's limit (often 20,000 or so) need not alarm.
            if max_connections == ServerSettings::default().max_connections {
                tracing::info!("{said}");
            } else {
                tracing::warn!("{said}");
            }
            each
        }
        Err(e) => {
            tracing::warn!(
                "cannot raise the open-file limit for server.max_connections = \
                 {max_connections}: {e}"
            );
            max_connections
        }
    }
}

/// Starts the server and serves until SIGTERM or SIGINT, reloading the
/// configuration on SIGHUP, then shuts down gracefully. `on_listening` runs
/// once both interfaces listen; the signal handlers are in place before it
/// runs, so a signal sent as soon as the addresses are known is handled.
#[cfg(unix)]
pub async fn serve_until_signal(
    options: ServeOptions,
    on_listening: impl FnOnce(&Running),
) -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut hangup = signal(SignalKind::hangup())?;
    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    // A start held up (its configuration file read blocks, or the store
    // does not answer) still stops when told to.
    let running = tokio::select! {
        started = start(options) => started?,
        _ = terminate.recv() => {
            tracing::info!("SIGTERM before the server started: stopping");
            return Ok(());
        }
        _ = interrupt.recv() => {
            tracing::info!("SIGINT before the server started: stopping");
            return Ok(());
        }
    };
    on_listening(&running);
    loop {
        tokio::select! {
            _ = hangup.recv() => {
                tracing::info!("SIGHUP: reloading the configuration");
                // Apart from this loop, so that a reload held up (a file
                // whose read blocks, a store that does not answer) keeps
                // no signal from being handled; reloads run one at a
                // time. The outcome is logged and counted by `reload`.
                let service = Arc::clone(&running.service);
                tokio::spawn(async move {
                    let _ = service.reload().await;
                });
            }
            _ = terminate.recv() => {
                tracing::info!("SIGTERM: shutting down");
                break;
            }
            _ = interrupt.recv() => {
                tracing::info!("SIGINT: shutting down");
                break;
            }
        }
    }
    // A second SIGTERM or SIGINT ends the wait for requests in flight (up
    // to 30 s), as a second Ctrl-C does elsewhere, so that an operator who
    // has seen what waits can stop without SIGKILL; the log says what was
    // cut. Only once the stop has said that it waits: service managers
    // and process supervisors often send two signals for one stop (an
    // ExecStop kill then systemd's own, a terminal's SIGINT then a
    // supervisor's SIGTERM), which must not cut a drain short.
    let grace = Duration::from_secs(30);
    let honoured_from = tokio::time::Instant::now() + wait_said_after(grace);
    let mut stopping = std::pin::pin!(running.shutdown(grace));
    let again = |name: &str| {
        if tokio::time::Instant::now() < honoured_from {
            tracing::info!(
                "{name} again while stopping: the stop goes on (a second signal stops at once \
                 only once the stop has said that it waits)"
            );
            false
        } else {
            tracing::error!(
                "{name} again: stopping now, closing the connections of requests still in \
                 flight unanswered"
            );
            true
        }
    };
    let stopped = loop {
        tokio::select! {
            stopped = &mut stopping => break stopped,
            _ = terminate.recv() => if again("SIGTERM") {
                break Err(StoppedUnclean.into());
            },
            _ = interrupt.recv() => if again("SIGINT") {
                break Err(StoppedUnclean.into());
            },
        }
    };
    stopped?;
    tracing::info!("stopped");
    Ok(())
}

/// The error of a stop that did not finish every request in flight (cut
/// short by a second signal, or past its 30 s), once the log has said so
/// and why: whoever runs the server exits non-zero without saying it again.
/// Other failures of a stop (a server task that failed) are errors of
/// their own, to be said.
#[derive(Debug)]
pub struct StoppedUnclean;

impl std::fmt::Display for StoppedUnclean {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the server stopped before every request in flight was answered")
    }
}

impl std::error::Error for StoppedUnclean {}

/// `text` with its control characters (line breaks, escapes) written as
/// Rust escapes, for a log line that carries a client's words: they cannot
/// end the line and start one that reads as the server's own.
pub(crate) fn one_line(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return text.into();
    }
    text.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect::<String>()
        .into()
}
