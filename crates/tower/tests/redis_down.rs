//! The layer on the Redis store, with a real `redis-server` that the test
//! starts on a free loopback port and then kills: the failure policy with a
//! Redis that is down.
//!
//! Two ways to put Redis behind the layer are covered:
//!
//! - [`RedisLimiter`], which answers Redis failures with its own failure
//!   policy, so the layer sees decisions (here `Local`: the limit is enforced
//!   per process while Redis is down);
//! - the bare [`RedisStore`] as a `Limiter` that passes Redis's errors on, so
//!   the layer's failure policy answers them (503, admit, or local).

use std::sync::Arc;

use axum::body::Body;
use axum::extract::Request;
use axum::routing::get;
use axum::Router;
use http::header::RETRY_AFTER;
use http::StatusCode;
use ratewarden_core::{
    BoxFuture, Clock, Decision, FailurePolicy, Limiter, LocalLimiter, ManualClock, PolicyConfig,
    PolicyKind, StoreError,
};
use ratewarden_redis::test_support::RedisServer;
use ratewarden_redis::{RedisLimiter, RedisOptions, RedisStore, RedisTime};
use ratewarden_tower::headers::RATELIMIT;
use ratewarden_tower::key::GlobalKey;
use ratewarden_tower::RateLimitLayer;
use tower::ServiceExt;

const CONFIG: PolicyConfig = PolicyConfig::new(PolicyKind::FixedWindow, 3, 1000);

fn app(layer: RateLimitLayer) -> Router {
    Router::new()
        .route(
            "/",
            get(|request: Request| async move {
                match request.extensions().get::<Decision>() {
                    Some(d) => format!("decided {}", d.remaining),
                    None => "undecided".to_owned(),
                }
            }),
        )
        .layer(layer)
}

async fn status(app: &Router) -> (StatusCode, Option<String>, Option<String>) {
    let response = app
        .clone()
        .oneshot(Request::new(Body::empty()))
        .await
        .unwrap();
    let header = |name| {
        response
            .headers()
            .get(name)
            .map(|v: &http::HeaderValue| v.to_str().unwrap().to_owned())
    };
    (response.status(), header(&RATELIMIT), header(&RETRY_AFTER))
}

async fn count_admitted(app: &Router, n: usize) -> usize {
    let mut ok = 0;
    for _ in 0..n {
        ok += usize::from(status(app).await.0 == StatusCode::OK);
    }
    ok
}

/// The Redis store as a `Limiter` that passes every Redis error on, so that
/// the layer's own failure policy decides what a failure means.
struct StoreLimiter {
    store: RedisStore,
    clock: ManualClock,
}

impl Limiter for StoreLimiter {
    fn config(&self) -> &PolicyConfig {
        self.store.config()
    }

    fn check(&self, key: u64, cost: u64) -> BoxFuture<'_, Result<Decision, StoreError>> {
        Box::pin(self.store.decide(key, Some(self.clock.now_ms()), cost))
    }
}

async fn connect(server: &RedisServer) -> RedisStore {
    let options = RedisOptions {
        prefix: "tower-test".to_owned(),
        // The tests count admissions while Redis is up and the failure
        // policy once it is killed, when calls fail at once (refused): a
        // healthy call slowed by a busy machine must not time out.
        timeout_ms: 5_000,
        connect_timeout_ms: 10_000,
        ..RedisOptions::default()
    };
    RedisStore::connect(&server.url(), CONFIG, options)
        .await
        .unwrap()
}

#[tokio::test]
async fn redis_limiter_falls_back_to_local_decisions_when_redis_dies() {
    let mut server = RedisServer::start();
    let clock = ManualClock::new(10_000);
    let time = RedisTime::Caller(Arc::new(clock.clone()));
    // Two processes' limiters on one Redis share one budget while it is up.
    let first = RedisLimiter::new(
        connect(&server).await,
        time.clone(),
        FailurePolicy::Local,
        Default::default(),
    )
    .unwrap();
    let second = RedisLimiter::new(
        connect(&server).await,
        time,
        FailurePolicy::Local,
        Default::default(),
    )
    .unwrap();
    let first_app = app(RateLimitLayer::new(
        Arc::new(first.clone()),
        GlobalKey::new(1),
    ));
    let second_app = app(RateLimitLayer::new(Arc::new(second), GlobalKey::new(1)));
    assert_eq!(count_admitted(&first_app, 2).await, 2);
    assert_eq!(count_admitted(&second_app, 3).await, 1);
    assert_eq!(status(&first_app).await.0, StatusCode::TOO_MANY_REQUESTS);

    server.kill();

    // Each process now enforces the limit alone, with the usual headers.
    clock.advance_ms(1000);
    assert_eq!(count_admitted(&first_app, 5).await, 3);
    let (code, ratelimit, retry_after) = status(&first_app).await;
    assert_eq!(code, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(ratelimit.as_deref(), Some("\"default\";r=0;t=1"));
    assert_eq!(retry_after.as_deref(), Some("1"));
    assert_eq!(count_admitted(&second_app, 5).await, 3);
    assert!(
        first.failure_counts().decided_locally >= 6,
        "{:?}",
        first.failure_counts()
    );
}

#[tokio::test]
async fn the_layer_fails_closed_with_503_when_redis_is_down() {
    let mut server = RedisServer::start();
    let clock = ManualClock::new(10_000);
    let limiter = StoreLimiter {
        store: connect(&server).await,
        clock: clock.clone(),
    };
    let app = app(RateLimitLayer::new(Arc::new(limiter), GlobalKey::new(2)));
    assert_eq!(count_admitted(&app, 4).await, 3);

    server.kill();
    clock.advance_ms(1000);
    for _ in 0..3 {
        let (code, ratelimit, retry_after) = status(&app).await;
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!((ratelimit, retry_after), (None, None));
    }
}

#[tokio::test]
async fn the_layer_fails_open_when_redis_is_down() {
    let mut server = RedisServer::start();
    let clock = ManualClock::new(10_000);
    let limiter = StoreLimiter {
        store: connect(&server).await,
        clock: clock.clone(),
    };
    let layer = RateLimitLayer::builder(Arc::new(limiter), GlobalKey::new(3))
        .failure_policy(FailurePolicy::FailOpen)
        .build()
        .unwrap();
    let app = app(layer);
    assert_eq!(count_admitted(&app, 4).await, 3);

    server.kill();
    // Admitted without a decision, so without rate-limit headers.
    for _ in 0..10 {
        let response = app
            .clone()
            .oneshot(Request::new(Body::empty()))
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert!(response.headers().get(&RATELIMIT).is_none());
        let body = axum::body::to_bytes(response.into_body(), 1024)
            .await
            .unwrap();
        assert_eq!(&body[..], b"undecided");
    }
}

#[tokio::test]
async fn the_layer_decides_locally_when_redis_is_down() {
    let mut server = RedisServer::start();
    let clock = ManualClock::new(10_000);
    let limiter = StoreLimiter {
        store: connect(&server).await,
        clock: clock.clone(),
    };
    let fallback = LocalLimiter::with_clock(CONFIG, Default::default(), clock.clone()).unwrap();
    let layer = RateLimitLayer::builder(Arc::new(limiter), GlobalKey::new(4))
        .failure_policy(FailurePolicy::Local)
        .local_fallback(fallback)
        .build()
        .unwrap();
    let app = app(layer);
    assert_eq!(count_admitted(&app, 4).await, 3);

    server.kill();
    // The local limiter has seen none of Redis's traffic: a fresh budget.
    assert_eq!(count_admitted(&app, 5).await, 3);
    clock.advance_ms(1000);
    assert_eq!(count_admitted(&app, 5).await, 3);
    let (code, ratelimit, _) = status(&app).await;
    assert_eq!(code, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(ratelimit.as_deref(), Some("\"default\";r=0;t=1"));
}

/// A `RedisLimiter` whose `local` fallback is full of keys passes the
/// fallback's error on, deciding nothing (and counting nothing as decided
/// locally); the layer's own failure policy answers it.
#[tokio::test]
async fn a_full_local_fallback_is_left_to_the_layer() {
    use ratewarden_tower::key::HeaderKey;
    for (policy, refused) in [
        (FailurePolicy::FailOpen, StatusCode::OK),
        (FailurePolicy::FailClosed, StatusCode::SERVICE_UNAVAILABLE),
    ] {
        let mut server = RedisServer::start();
        let clock = ManualClock::new(10_000);
        let limiter = RedisLimiter::new(
            connect(&server).await,
            RedisTime::Caller(Arc::new(clock)),
            FailurePolicy::Local,
            ratewarden_core::MemoryOptions {
                max_keys: 1,
                shards: 1,
            },
        )
        .unwrap();
        let key = HeaderKey::new(http::HeaderName::from_static("x-key"));
        let layer = RateLimitLayer::builder(Arc::new(limiter.clone()), key)
            .failure_policy(policy)
            .build()
            .unwrap();
        let app = app(layer);
        server.kill();
        let mut answers = Vec::new();
        for key in ["a", "b", "c"] {
            let request = Request::builder().uri("/").header("x-key", key);
            let response = app
                .clone()
                .oneshot(request.body(Body::empty()).unwrap())
                .await
                .unwrap();
            let status = response.status();
            let body = axum::body::to_bytes(response.into_body(), 1024)
                .await
                .unwrap();
            answers.push((status, String::from_utf8_lossy(&body).into_owned()));
        }
        // The fallback holds one key: `a` is decided there, `b` and `c`
        // find it full.
        assert_eq!(
            answers[0],
            (StatusCode::OK, "decided 2".to_owned()),
            "{policy}"
        );
        for answer in &answers[1..] {
            assert_eq!(answer.0, refused, "{policy}: {answers:?}");
        }
        if policy == FailurePolicy::FailOpen {
            assert_eq!(answers[1].1, "undecided");
        }
        assert_eq!(limiter.failure_counts().decided_locally, 1, "{policy}");
    }
}
