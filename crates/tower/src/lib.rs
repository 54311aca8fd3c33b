//! tower and axum middleware for ratewarden: rate limiting as a layer.
//!
//! [`RateLimitLayer`] limits requests by a key taken from each request (the
//! client address, a header, the authenticated user, one global key, or any
//! closure; see [`key`]), on any store and policy behind
//! `Arc<dyn ratewarden_core::Limiter>`.
//!
//! - **One budget.** The limiter sits behind an `Arc`, so every clone of the
//!   layer and of the service (axum clones the service per request) draws
//!   on the same budget.
//! - **Always ready.** `poll_ready` is always ready; the limiter decides in
//!   `call`, and only an admitted request then waits for the inner service
//!   to be ready. A refusal is a response, sent at once, never
//!   back-pressure (see [`RateLimitService`]'s readiness).
//! - **Standard headers.** A refusal is `429 Too Many Requests` with
//!   `Retry-After` (whole seconds, rounded up, at least 1),
//!   `RateLimit-Policy` and `RateLimit`; an admitted response carries
//!   `RateLimit-Policy` and `RateLimit` (see [`headers`]). Handlers find the
//!   [`Decision`](ratewarden_core::Decision) in the request's extensions.
//! - **Failures follow a policy.** When the store fails, the
//!   [`FailurePolicy`](ratewarden_core::FailurePolicy) admits (open), answers
//!   `503 Service Unavailable` (closed), or decides on an in-memory limiter
//!   (local).
//!
//! ```
//! use std::sync::Arc;
//! use axum::{body::Body, routing::get, Router};
//! use axum::http::{Request, StatusCode};
//! use ratewarden_core::{LocalLimiter, ManualClock, PolicyConfig, PolicyKind};
//! use ratewarden_tower::{key::GlobalKey, RateLimitLayer};
//! use tower::ServiceExt;
//!
//! # tokio_test_run(async {
//! let config = PolicyConfig::new(PolicyKind::FixedWindow, 2, 1000);
//! let limiter = LocalLimiter::with_clock(config, Default::default(), ManualClock::new(0)).unwrap();
//! let app = Router::new()
//!     .route("/", get(|| async { "hello" }))
//!     .layer(RateLimitLayer::new(Arc::new(limiter), GlobalKey::new(0)));
//! let mut statuses = Vec::new();
//! for _ in 0..3 {
//!     // Every request goes to a fresh clone of the router: one budget still.
//!     let response = app.clone().oneshot(Request::new(Body::empty())).await.unwrap();
//!     statuses.push(response.status());
//! }
//! assert_eq!(statuses, [StatusCode::OK, StatusCode::OK, StatusCode::TOO_MANY_REQUESTS]);
//! # });
//! # fn tokio_test_run(f: impl std::future::Future<Output = ()>) {
//! #     tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(f)
//! # }
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod forwarded;
pub mod headers;
pub mod key;
mod layer;

pub use layer::{
    default_refusal, BuildError, LayerError, LayerErrorKind, RateLimitBuilder, RateLimitLayer,
    RateLimitService, Refusal, DEFAULT_CHECK_TIMEOUT, DEFAULT_KEY_HASH,
};
