//! What the layer costs per request: an axum router answered in-process
//! (`oneshot`, no network) without the layer, and with it admitting,
//! refusing, and admitting keyed by peer IP over many clients.
//!
//! `cargo bench -p ratewarden-tower --bench layer`

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{ConnectInfo, Request};
use axum::routing::get;
use axum::Router;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use ratewarden_core::{LocalLimiter, ManualClock, PolicyConfig, PolicyKind};
use ratewarden_tower::key::{GlobalKey, KeyExtractor, PeerIp};
use ratewarden_tower::RateLimitLayer;
use tower::ServiceExt;

/// Distinct client addresses in the peer-IP case: enough that keys miss the
/// CPU caches now and then, as a busy server's do.
const CLIENTS: u32 = 4096;

fn router() -> Router {
    Router::new().route("/", get(|| async { "ok" }))
}

fn limited(config: PolicyConfig, key: impl KeyExtractor) -> Router {
    // The clock stands still so that every iteration meets the same state.
    let limiter = LocalLimiter::with_clock(config, Default::default(), ManualClock::new(0))
        .expect("valid configuration");
    router().layer(RateLimitLayer::new(Arc::new(limiter), key))
}

fn request(peer: Option<SocketAddr>) -> Request {
    let mut request = Request::new(Body::empty());
    if let Some(peer) = peer {
        request.extensions_mut().insert(ConnectInfo(peer));
    }
    request
}

fn bench(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let mut group = c.benchmark_group("layer");
    group.throughput(Throughput::Elements(1));

    let plain = router();
    group.bench_function("no_layer", |b| {
        b.iter(|| runtime.block_on(plain.clone().oneshot(request(None))))
    });

    // A limit no benchmark run can spend (a billion, at a standing clock:
    // about 20 minutes of requests at a microsecond each), so every request
    // is admitted; and small enough that a state still packs into 64 bits,
    // as a real limit's does, so the path timed is the usual one.
    let unlimited = PolicyConfig::new(PolicyKind::SlidingWindowCounter, 1 << 30, 1000);
    let admitting = limited(unlimited, GlobalKey::new(0));
    group.bench_function("admitted", |b| {
        b.iter(|| runtime.block_on(admitting.clone().oneshot(request(None))))
    });

    // One permit, spent before measuring: every request is refused.
    let one = PolicyConfig::new(PolicyKind::SlidingWindowCounter, 1, 1000);
    let refusing = limited(one, GlobalKey::new(0));
    let _ = runtime.block_on(refusing.clone().oneshot(request(None)));
    group.bench_function("refused", |b| {
        b.iter(|| runtime.block_on(refusing.clone().oneshot(request(None))))
    });

    // The same unspendable limit: at a standing clock the reference
    // limit (100 per client) would be spent in the warm-up, and the samples
    // would time refusals only. Refusals have their case above.
    let per_ip = limited(unlimited, PeerIp::new());
    let mut client = 0u32;
    group.bench_function("peer_ip_4096_clients", |b| {
        b.iter(|| {
            client = (client + 1) % CLIENTS;
            let ip = IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + client));
            runtime.block_on(
                per_ip
                    .clone()
                    .oneshot(request(Some(SocketAddr::new(ip, 443)))),
            )
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
