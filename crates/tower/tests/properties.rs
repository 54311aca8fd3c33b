//! Properties of the headers over random policies and traffic, through a real
//! axum router on a manual clock:
//!
//! - `Retry-After` is never earlier than the real next admission: advancing
//!   the clock by `Retry-After` seconds admits the same request; it is also
//!   the smallest such whole number of seconds.
//! - The remaining count `r` is never negative, and `t` always equals
//!   `Retry-After`.
//! - Status, `r` and `Retry-After` are exactly those of the decision a twin
//!   limiter makes for the same requests at the same times.
//! - A refusal without `Retry-After` is a request no wait can admit.

use std::sync::Arc;

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use http::header::RETRY_AFTER;
use http::{Request, Response, StatusCode};
use proptest::prelude::*;
use ratewarden_core::{Limiter, LocalLimiter, ManualClock, PolicyConfig, PolicyKind};
use ratewarden_tower::headers::{retry_after_secs, RATELIMIT, SF_INTEGER_MAX};
use ratewarden_tower::key::GlobalKey;
use ratewarden_tower::RateLimitLayer;
use tower::ServiceExt;

fn config() -> impl Strategy<Value = PolicyConfig> {
    let kind = prop::sample::select(PolicyKind::ALL.to_vec());
    (kind, 0u64..=20, 1u64..=5000, prop::option::of(0u64..=30)).prop_map(
        |(kind, limit, window_ms, burst)| {
            let config = PolicyConfig::new(kind, limit, window_ms);
            match burst {
                Some(burst) if kind.has_burst() => config.with_burst(burst),
                _ => config,
            }
        },
    )
}

/// `(advance_ms, cost)` per request.
fn trace() -> impl Strategy<Value = Vec<(u64, u64)>> {
    prop::collection::vec((prop_oneof![Just(0u64), 0u64..=3000], 0u64..=25), 1..40)
}

/// The parameters of a `RateLimit` value: `r` (as a signed number, so that a
/// negative count would be seen) and `t` when present.
fn ratelimit(response: &Response<Body>) -> (i128, Option<u64>) {
    let value = response
        .headers()
        .get(&RATELIMIT)
        .expect("RateLimit header")
        .to_str()
        .unwrap();
    let mut params = value.split(';');
    assert_eq!(params.next(), Some("\"default\""), "{value}");
    let mut r = None;
    let mut t = None;
    for param in params {
        match param.split_once('=') {
            Some(("r", n)) => r = Some(n.parse::<i128>().unwrap()),
            Some(("t", n)) => t = Some(n.parse::<u64>().unwrap()),
            _ => panic!("unexpected parameter in {value}"),
        }
    }
    (r.expect("r parameter"), t)
}

fn retry_after(response: &Response<Body>) -> Option<u64> {
    response
        .headers()
        .get(RETRY_AFTER)
        .map(|v| v.to_str().unwrap().parse().unwrap())
}

/// Sends a request of `cost` and holds the response against the decision
/// of `twin`, a limiter on the same clock fed the same requests.
async fn send(
    app: &Router,
    twin: &LocalLimiter,
    cost: u64,
) -> Result<Response<Body>, TestCaseError> {
    let request = Request::builder()
        .uri("/")
        .header("x-cost", cost)
        .body(Body::empty())
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let expected = twin.check_now(0, cost).unwrap();
    prop_assert_eq!(response.status() == StatusCode::OK, expected.allowed);
    let (r, _) = ratelimit(&response);
    // `r` never exceeds `q`: for a bucket, the smaller of limit and burst.
    let config = twin.config();
    let q = if config.policy.has_burst() {
        config.limit.min(config.effective_burst())
    } else {
        config.limit
    };
    let advertised = expected.remaining.min(q).min(SF_INTEGER_MAX);
    prop_assert_eq!(r, i128::from(advertised));
    let wait = match expected.retry_after_ms {
        Some(ms) if !expected.allowed => Some(retry_after_secs(ms)),
        _ => None,
    };
    prop_assert_eq!(retry_after(&response), wait);
    Ok(response)
}

fn check_counts(response: &Response<Body>) -> Result<Option<u64>, TestCaseError> {
    let (r, t) = ratelimit(response);
    prop_assert!(r >= 0, "negative remaining {r}");
    prop_assert!(r <= i128::from(SF_INTEGER_MAX));
    prop_assert_eq!(
        t,
        if response.status() == StatusCode::OK {
            None
        } else {
            retry_after(response)
        }
    );
    Ok(t)
}

async fn run(config: PolicyConfig, trace: Vec<(u64, u64)>) -> Result<(), TestCaseError> {
    let clock = ManualClock::new(0);
    let limiter = LocalLimiter::with_clock(config, Default::default(), clock.clone()).unwrap();
    let layer = RateLimitLayer::builder(Arc::new(limiter), GlobalKey::new(0))
        .cost(|parts| {
            parts
                .headers
                .get("x-cost")
                .and_then(|v| v.to_str().ok()?.parse().ok())
                .unwrap_or(1)
        })
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
    let twin = LocalLimiter::with_clock(config, Default::default(), clock.clone()).unwrap();
    for (advance_ms, cost) in trace {
        clock.advance_ms(advance_ms);
        let response = send(&app, &twin, cost).await?;
        check_counts(&response)?;
        if response.status() == StatusCode::OK {
            prop_assert_eq!(retry_after(&response), None);
            continue;
        }
        prop_assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        let Some(secs) = retry_after(&response) else {
            // No wait admits it: the cost is above the policy's capacity, or
            // a bucket that never refills.
            let capacity = if config.policy.has_burst() {
                config.effective_burst()
            } else {
                config.limit
            };
            prop_assert!(
                cost > capacity || (config.policy.has_burst() && config.limit == 0),
                "refused without a retry time, cost {cost}, {config}"
            );
            continue;
        };
        prop_assert!(secs >= 1);
        if secs >= 2 {
            // One second less is too early: the refusal changes nothing.
            clock.advance_ms((secs - 1) * 1000);
            let early = send(&app, &twin, cost).await?;
            check_counts(&early)?;
            prop_assert_eq!(
                early.status(),
                StatusCode::TOO_MANY_REQUESTS,
                "{} s was enough",
                secs - 1
            );
            clock.advance_ms(1000);
        } else {
            clock.advance_ms(1000);
        }
        let retried = send(&app, &twin, cost).await?;
        check_counts(&retried)?;
        prop_assert_eq!(
            retried.status(),
            StatusCode::OK,
            "refused after waiting Retry-After = {} s, cost {}, {}",
            secs,
            cost,
            config
        );
    }
    Ok(())
}

proptest! {
    #[test]
    fn retry_after_is_never_early_and_remaining_never_negative(config in config(), trace in trace()) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(run(config, trace))?;
    }
}
