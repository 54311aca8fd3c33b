//! An axum server that serves `GET /` and limits every request to it to the
//! reference configuration (sliding-window-counter, 100 requests per
//! second) per client IP: the layer wraps the whole router, so requests
//! answered `404` or `405` spend budget too.
//!
//! ```text
//! cargo run --example axum_server -- --addr 127.0.0.1:3000
//! curl -i http://127.0.0.1:3000/
//! ```
//!
//! The 101st request within a second is answered `429 Too Many Requests`
//! with `Retry-After`, `RateLimit-Policy` and `RateLimit`.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::Request;
use axum::routing::get;
use axum::Router;
use clap::Parser;
use ratewarden_core::{Clock, Decision, Limiter, LocalLimiter, REFERENCE};
use ratewarden_tower::key::PeerIp;
use ratewarden_tower::RateLimitLayer;
use tokio::net::TcpListener;

/// How often idle keys are forgotten, and how many are looked at each time:
/// the store stays bounded without a pause proportional to its size.
const HOUSEKEEPING_EVERY: Duration = Duration::from_secs(1);
const HOUSEKEEPING_MAX_SCANNED: usize = 65_536;

#[derive(Debug, Parser)]
#[command(
    about = "An axum server serving GET /, limiting every request to 100 per second per client IP"
)]
struct Args {
    /// The address to listen on, HOST:PORT, e.g. 127.0.0.1:3000 (a name
    /// such as localhost is resolved).
    #[arg(long, default_value = "127.0.0.1:3000")]
    addr: String,
}

/// The application: `GET /`, with every request to the router (a `404` or
/// `405` too) behind the rate limit, keyed by the peer's IP.
pub fn app(limiter: Arc<dyn Limiter>) -> Router {
    Router::new()
        .route("/", get(hello))
        .layer(RateLimitLayer::new(limiter, PeerIp::new()))
}

/// Answers with what is left of the client's budget; the layer put the
/// decision in the request's extensions.
async fn hello(request: Request) -> String {
    match request.extensions().get::<Decision>() {
        Some(decision) => format!("hello; {} left this second\n", decision.remaining),
        None => "hello\n".to_owned(),
    }
}

/// Serves `app` on `listener` until `shutdown` completes. The peer address
/// reaches the layer through `ConnectInfo<SocketAddr>`.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(shutdown)
    .await
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let limiter = LocalLimiter::new(REFERENCE, Default::default())?;

    // The library starts no threads; the server owns the housekeeping timer.
    let housekeeping = limiter.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(HOUSEKEEPING_EVERY);
        loop {
            tick.tick().await;
            let now_ms = housekeeping.clock().now_ms();
            housekeeping
                .store()
                .forget_idle(now_ms, HOUSEKEEPING_MAX_SCANNED);
        }
    });

    let listener = TcpListener::bind(&args.addr).await.map_err(|e| {
        anyhow::anyhow!(
            "cannot listen on --addr {} ({e}): write HOST:PORT, e.g. 127.0.0.1:3000",
            args.addr
        )
    })?;
    println!(
        "listening on http://{}/ ({REFERENCE} per client IP)",
        listener.local_addr()?
    );
    serve(listener, app(Arc::new(limiter)), async {
        // Without a Ctrl-C handler the server runs until killed.
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    })
    .await?;
    Ok(())
}
