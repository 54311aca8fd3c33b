//! The layer and the service.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::request::Parts;
use http::{HeaderName, HeaderValue, Request, Response, StatusCode};
use ratewarden_core::{
    BoxFuture, Clock, ConfigError, Decision, FailurePolicy, KeyHash, Limiter, LocalLimiter,
    LogGate, MonotonicClock, PolicyConfig, StoreError, StoreErrorKind,
};
use tower_layer::Layer;
use tower_service::Service;

use crate::headers::{RateLimitHeaders, RATELIMIT, RATELIMIT_POLICY};
use crate::key::{KeyExtractor, KeyRejection, RequestKey};

/// The default bound on one limiter call: a store that has not answered in
/// a second is treated as failed.
pub const DEFAULT_CHECK_TIMEOUT: Duration = Duration::from_millis(1000);

/// The layer's default key hash: 64 bits, so that a client choosing its
/// own key material must search about 2^64 strings to meet another
/// client's key (the core keeps SPEC's mix32 as its default, for its
/// vectors).
pub const DEFAULT_KEY_HASH: KeyHash = KeyHash::Xxh3_64;

/// A refused request, as the refusal closure sees it.
#[derive(Debug)]
pub struct Refusal<'a> {
    /// The limiter's decision: `allowed` is false.
    pub decision: Decision,
    /// The configuration that refused it.
    pub config: &'a PolicyConfig,
    /// The request's head.
    pub parts: &'a Parts,
    /// The request's cost.
    pub cost: u64,
}

impl Refusal<'_> {
    /// Whole seconds until the same request would be admitted (rounded up,
    /// at least 1), exactly as `Retry-After` says it (so at most
    /// [`SF_INTEGER_MAX`](crate::headers::SF_INTEGER_MAX)); `None` when no
    /// wait ever admits it.
    pub fn retry_after_secs(&self) -> Option<u64> {
        crate::headers::header_wait_secs(&self.decision)
    }
}

/// A response the layer makes that is not a refusal, as the error closure
/// ([`RateLimitBuilder::on_error`]) sees it.
#[derive(Debug)]
#[non_exhaustive]
pub struct LayerError<'a> {
    /// The status the default response has: the key extractor's for
    /// [`LayerErrorKind::NoKey`] (`400`, `401`, `500`, ...), `503` for
    /// [`LayerErrorKind::Unavailable`], `500` for
    /// [`LayerErrorKind::InvalidCost`].
    pub status: StatusCode,
    /// The message the default body carries: what the client may read,
    /// never the detail the log gives the operator.
    pub message: &'a str,
    /// Why the layer answers instead of the service.
    pub kind: LayerErrorKind,
    /// The request's head.
    pub parts: &'a Parts,
}

/// Why the layer answered a request with an error. New kinds may be
/// added: match with a catch-all arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LayerErrorKind {
    /// The key extractor found no key (a missing header, an anonymous
    /// user, a server not set up to give the peer address).
    NoKey,
    /// The limiter failed under [`FailurePolicy::FailClosed`] (or with a
    /// corrupt state under `FailOpen`).
    Unavailable,
    /// The limiter refused the request as invalid input
    /// ([`StoreErrorKind::InvalidInput`](ratewarden_core::StoreErrorKind::InvalidInput)):
    /// a cost above 2^53 - 1, the cost function's mistake, or, from a
    /// limiter of your own, whatever input it refuses (the log gives its
    /// error).
    InvalidCost,
}

type CostFn = dyn Fn(&Parts) -> u64 + Send + Sync;
type SkipFn = dyn Fn(&Parts) -> bool + Send + Sync;
type RefusalFn = dyn for<'a> Fn(&Refusal<'a>) -> Response<Bytes> + Send + Sync;
type ErrorFn = dyn for<'a> Fn(&LayerError<'a>) -> Response<Bytes> + Send + Sync;

/// Why a layer could not be built. New reasons may be added: match with a
/// catch-all arm.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum BuildError {
    /// The policy name cannot be written into the headers.
    PolicyName(String),
    /// The fallback limiter for [`FailurePolicy::Local`] could not be built.
    Fallback(ConfigError),
    /// The limiter timeout is under a millisecond: every call would fail.
    ZeroTimeout,
    /// A fallback limiter was given with a failure policy other than
    /// [`FailurePolicy::Local`], which would never use it.
    FallbackUnused(FailurePolicy),
    /// The fallback limiter's configuration decides otherwise than the
    /// limiter's ([`PolicyConfig::decides_alike`]: a bucket's default burst
    /// and that burst written out are no difference).
    FallbackConfig {
        /// The limiter's configuration.
        limiter: PolicyConfig,
        /// The fallback's configuration.
        fallback: PolicyConfig,
    },
}

impl fmt::Display for BuildError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BuildError::PolicyName(why) => f.write_str(why),
            BuildError::Fallback(e) => write!(f, "the local fallback limiter: {e}"),
            BuildError::ZeroTimeout => f.write_str(
                "check_timeout is under 1 ms: every limiter call would time out; use 1 ms or more",
            ),
            BuildError::FallbackUnused(policy) => write!(
                f,
                "a local fallback limiter is set but the failure policy is FailurePolicy::{policy:?}, which \
                 never uses it; set .failure_policy(FailurePolicy::Local) or drop .local_fallback(..)"
            ),
            BuildError::FallbackConfig { limiter, fallback } => write!(
                f,
                "the local fallback limiter decides by {fallback}, the limiter by {limiter}; \
                 give the fallback the limiter's configuration"
            ),
        }
    }
}

impl std::error::Error for BuildError {}

/// Everything a layer and all its services share: one limiter, hence one
/// budget, however often the layer or the service is cloned.
struct Shared {
    limiter: Arc<dyn Limiter>,
    key: Box<dyn KeyExtractor>,
    key_hash: KeyHash,
    cost: Option<Box<CostFn>>,
    skip: Option<Box<SkipFn>>,
    refusal: Option<Box<RefusalFn>>,
    error: Option<Box<ErrorFn>>,
    failure_policy: FailurePolicy,
    fallback: Option<LocalLimiter>,
    check_timeout: Duration,
    headers: RateLimitHeaders,
    logs: FailureLogs,
}

/// One warning a second while the limiter fails, and one for a failing
/// fallback: a limiter that is down fails every request, and a line per
/// request would let any client flood the log.
struct FailureLogs {
    limiter: LogGate,
    fallback: LogGate,
    /// Requests the layer cannot rate-limit for the operator's reasons (a
    /// missing `ConnectInfo`, a cost out of range).
    rejection: LogGate,
    /// Responses on which an inner layer used this layer's policy name.
    shared_name: LogGate,
    /// The gates' clock.
    clock: MonotonicClock,
}

impl FailureLogs {
    fn new() -> Self {
        FailureLogs {
            limiter: LogGate::new(1000),
            fallback: LogGate::new(1000),
            rejection: LogGate::new(1000),
            // A configuration mistake, the same on every response: one
            // line a minute says it.
            shared_name: LogGate::new(60_000),
            clock: MonotonicClock::new(),
        }
    }
}

/// Configures a [`RateLimitLayer`]; made by [`RateLimitLayer::builder`].
pub struct RateLimitBuilder {
    limiter: Arc<dyn Limiter>,
    key: Box<dyn KeyExtractor>,
    key_hash: KeyHash,
    cost: Option<Box<CostFn>>,
    skip: Option<Box<SkipFn>>,
    refusal: Option<Box<RefusalFn>>,
    error: Option<Box<ErrorFn>>,
    failure_policy: FailurePolicy,
    fallback: Option<LocalLimiter>,
    check_timeout: Duration,
    policy_name: String,
}

impl fmt::Debug for RateLimitBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitBuilder")
            .field("config", self.limiter.config())
            .field("key_hash", &self.key_hash)
            .field("failure_policy", &self.failure_policy)
            .field("check_timeout", &self.check_timeout)
            .field("policy_name", &self.policy_name)
            .finish_non_exhaustive()
    }
}

impl RateLimitBuilder {
    /// The hash that turns string keys into integer keys: default
    /// [`KeyHash::Xxh3_64`], or [`KeyHash::Mix32`], SPEC's portable hash,
    /// to share counts with a program that keys by mix32.
    ///
    /// Both are public and unkeyed, and neither is a cryptographic hash.
    /// Where clients choose key material (a header's value, an address in
    /// their own network), a client can search for a string whose hash
    /// equals another client's key and so spend that client's budget:
    /// mix32's 32 bits fall to such a search in seconds, xxh3-64 raises its
    /// cost to about 2^64 tries. That raises the cost of a search; it is no
    /// proof against every crafted collision.
    pub fn key_hash(mut self, key_hash: KeyHash) -> Self {
        self.key_hash = key_hash;
        self
    }

    /// The cost of each request (default 1), for example its size class.
    pub fn cost<F>(mut self, cost: F) -> Self
    where
        F: Fn(&Parts) -> u64 + Send + Sync + 'static,
    {
        self.cost = Some(Box::new(cost));
        self
    }

    /// Requests the layer lets through untouched: for those for which
    /// `skip` is true, no key is taken, no budget is spent or checked, and
    /// the response carries no rate-limit headers (health checks, a trusted
    /// network's callers). Checked first, on the request's head; it should
    /// be cheap, since it runs for every request.
    pub fn skip_if<F>(mut self, skip: F) -> Self
    where
        F: Fn(&Parts) -> bool + Send + Sync + 'static,
    {
        self.skip = Some(Box::new(skip));
        self
    }

    /// Builds the response to a refused request. The layer then adds
    /// `Retry-After`, `RateLimit-Policy` and `RateLimit` unless the response
    /// already has them.
    pub fn on_refused<F>(mut self, refusal: F) -> Self
    where
        F: for<'a> Fn(&Refusal<'a>) -> Response<Bytes> + Send + Sync + 'static,
    {
        self.refusal = Some(Box::new(refusal));
        self
    }

    /// Builds the layer's other answers: a request with no key, a limiter
    /// that is unavailable, a cost the limiter refuses as invalid (see
    /// [`LayerError`]). The default is a one-line `text/plain` body with
    /// [`LayerError::status`]; an API that answers in JSON gives its own.
    /// The headers a key extractor's rejection carries (the
    /// `WWW-Authenticate` challenge of a `401`) are added unless the
    /// response already has them. What the log says is the same either way.
    pub fn on_error<F>(mut self, error: F) -> Self
    where
        F: for<'a> Fn(&LayerError<'a>) -> Response<Bytes> + Send + Sync + 'static,
    {
        self.error = Some(Box::new(error));
        self
    }

    /// What to do when the limiter fails (default
    /// [`FailurePolicy::FailClosed`]): `FailOpen` admits the request without
    /// rate-limit headers (but answers corrupt state as `FailClosed` does:
    /// admitting would lift that key's limit until someone deletes it),
    /// `FailClosed` answers `503 Service Unavailable`, `Local` decides on an
    /// in-memory limiter with the same configuration. A cost above the
    /// policy's capacity is refused under each, as the store would. A new
    /// key at a full in-memory store is such a failure too: `FailOpen`
    /// admits it (see docs/middleware.md, "Keys", for keys clients choose).
    pub fn failure_policy(mut self, policy: FailurePolicy) -> Self {
        self.failure_policy = policy;
        self
    }

    /// The in-memory limiter that [`FailurePolicy::Local`] falls back to
    /// (default: a [`LocalLimiter`] on the system clock with the limiter's
    /// configuration). Its configuration must equal the limiter's, and the
    /// failure policy must be `Local` ([`build`](Self::build) refuses a
    /// fallback that would never be used).
    pub fn local_fallback(mut self, fallback: LocalLimiter) -> Self {
        self.fallback = Some(fallback);
        self
    }

    /// The longest a limiter call may take before it counts as failed
    /// (default [`DEFAULT_CHECK_TIMEOUT`]; at least 1 ms).
    pub fn check_timeout(mut self, timeout: Duration) -> Self {
        self.check_timeout = timeout;
        self
    }

    /// The policy's name in the `RateLimit-Policy` and `RateLimit` headers
    /// (default `default`): printable ASCII, at most 64 bytes.
    ///
    /// It names the policy in the headers only and does not separate
    /// budgets: two layers whose limiters share a store and its keys (one
    /// Redis, one prefix, the same policy) share one budget whatever their
    /// names (see "Separate budgets per route" in docs/middleware.md).
    pub fn policy_name(mut self, name: impl Into<String>) -> Self {
        self.policy_name = name.into();
        self
    }

    /// Checks the configuration and builds the layer.
    pub fn build(self) -> Result<RateLimitLayer, BuildError> {
        if self.check_timeout < Duration::from_millis(1) {
            return Err(BuildError::ZeroTimeout);
        }
        let config = *self.limiter.config();
        let headers =
            RateLimitHeaders::new(&self.policy_name, &config).map_err(BuildError::PolicyName)?;
        let fallback = match (self.failure_policy, self.fallback) {
            (FailurePolicy::Local, Some(fallback)) => {
                if !fallback.config().decides_alike(&config) {
                    return Err(BuildError::FallbackConfig {
                        limiter: config,
                        fallback: *fallback.config(),
                    });
                }
                Some(fallback)
            }
            (FailurePolicy::Local, None) => {
                Some(LocalLimiter::new(config, Default::default()).map_err(BuildError::Fallback)?)
            }
            (policy, Some(_)) => return Err(BuildError::FallbackUnused(policy)),
            (_, None) => None,
        };
        Ok(RateLimitLayer {
            shared: Arc::new(Shared {
                limiter: self.limiter,
                key: self.key,
                key_hash: self.key_hash,
                cost: self.cost,
                skip: self.skip,
                refusal: self.refusal,
                error: self.error,
                failure_policy: self.failure_policy,
                fallback,
                check_timeout: self.check_timeout,
                headers,
                logs: FailureLogs::new(),
            }),
        })
    }
}

/// A tower [`Layer`] that rate-limits requests by a key taken from each
/// request.
///
/// The limiter lives behind an `Arc`: every clone of the layer and every
/// service it makes (axum clones the service for each request) draws on one
/// budget.
///
/// ```
/// use std::sync::Arc;
/// use axum::{routing::get, Router};
/// use ratewarden_core::{LocalLimiter, REFERENCE};
/// use ratewarden_tower::{key::PeerIp, RateLimitLayer};
///
/// let limiter = LocalLimiter::new(REFERENCE, Default::default()).unwrap();
/// let layer = RateLimitLayer::new(Arc::new(limiter), PeerIp::new());
/// let app: Router = Router::new().route("/", get(|| async { "hello" })).layer(layer);
/// ```
#[derive(Clone)]
pub struct RateLimitLayer {
    shared: Arc<Shared>,
}

impl fmt::Debug for RateLimitLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("config", self.shared.limiter.config())
            .field("failure_policy", &self.shared.failure_policy)
            .finish_non_exhaustive()
    }
}

impl RateLimitLayer {
    /// A layer with the defaults: cost 1, xxh3-64 for string keys, the default
    /// refusal, fail closed, a one-second limiter timeout, policy name
    /// `default`.
    pub fn new(limiter: Arc<dyn Limiter>, key: impl KeyExtractor) -> Self {
        RateLimitLayer {
            shared: Arc::new(Shared {
                headers: RateLimitHeaders::default_name(limiter.config()),
                limiter,
                key: Box::new(key),
                key_hash: DEFAULT_KEY_HASH,
                cost: None,
                skip: None,
                refusal: None,
                error: None,
                failure_policy: FailurePolicy::FailClosed,
                fallback: None,
                check_timeout: DEFAULT_CHECK_TIMEOUT,
                logs: FailureLogs::new(),
            }),
        }
    }

    /// A builder for a layer on `limiter`, keyed by `key`.
    pub fn builder(limiter: Arc<dyn Limiter>, key: impl KeyExtractor) -> RateLimitBuilder {
        RateLimitBuilder {
            limiter,
            key: Box::new(key),
            key_hash: DEFAULT_KEY_HASH,
            cost: None,
            skip: None,
            refusal: None,
            error: None,
            failure_policy: FailurePolicy::FailClosed,
            fallback: None,
            check_timeout: DEFAULT_CHECK_TIMEOUT,
            policy_name: "default".to_owned(),
        }
    }

    /// The limiter every request is decided by.
    pub fn limiter(&self) -> &Arc<dyn Limiter> {
        &self.shared.limiter
    }
}

impl<S> Layer<S> for RateLimitLayer {
    type Service = RateLimitService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimitService {
            inner,
            shared: Arc::clone(&self.shared),
        }
    }
}

/// The service made by [`RateLimitLayer`]. Clones share the layer's budget.
///
/// # Readiness
///
/// `poll_ready` is always ready: the limiter decides in `call`, first. Only
/// an admitted request then waits for the inner service, on a clone of it
/// driven to readiness and called (as `tower::ServiceExt::oneshot` does).
/// A refusal, a key rejection or a failure answer is therefore sent at once,
/// even while the inner service is not ready, and never holds its capacity
/// (a `ConcurrencyLimit` permit, a `Buffer` slot). An error from the inner
/// service's `poll_ready` is returned by the admitted request's future.
#[derive(Clone)]
pub struct RateLimitService<S> {
    inner: S,
    shared: Arc<Shared>,
}

impl<S: fmt::Debug> fmt::Debug for RateLimitService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitService")
            .field("inner", &self.inner)
            .field("config", self.shared.limiter.config())
            .finish_non_exhaustive()
    }
}

/// What the limiter, or the failure policy, made of a request.
enum Verdict {
    /// Decided, by the limiter or the local fallback.
    Decided(Decision),
    /// The limiter failed and the failure policy admits without a decision.
    AdmitUndecided,
    /// The limiter failed and the failure policy refuses.
    Unavailable,
    /// The request itself cannot be decided (a cost out of range).
    Invalid(StoreError),
}

impl Shared {
    fn key(&self, key: RequestKey) -> u64 {
        match key {
            RequestKey::Id(id) => id,
            RequestKey::Name(name) => self.key_hash.hash(&name),
        }
    }

    async fn decide(&self, key: u64, cost: u64) -> Verdict {
        // The in-memory limiter answers on the first poll; only a limiter
        // that has to wait gets a timer, which spares every local decision
        // the cost of arming one.
        let mut check = self.limiter.check(key, cost);
        let first = std::future::poll_fn(|cx| Poll::Ready(check.as_mut().poll(cx))).await;
        let result = match first {
            Poll::Ready(result) => result,
            Poll::Pending => match tokio::time::timeout(self.check_timeout, check).await {
                Ok(result) => result,
                Err(_) => Err(StoreError::new(
                    StoreErrorKind::Timeout,
                    format!(
                        "the limiter did not answer within {} ms",
                        self.check_timeout.as_millis()
                    ),
                )),
            },
        };
        let error = match result {
            Ok(decision) => return Verdict::Decided(decision),
            // Invalid input is the same on any store: no failure policy can
            // make it decidable.
            Err(e) if e.is_invalid_input() => return Verdict::Invalid(e),
            Err(e) => e,
        };
        let now_ms = self.logs.clock.now_ms();
        if let Some(held_back) = self.logs.limiter.pass(now_ms) {
            tracing::warn!(
                %error,
                failure_policy = %self.failure_policy,
                failures_not_logged = held_back,
                "rate limiter failed"
            );
        }
        // A cost no store can decide is invalid whatever failed first: a
        // limiter of the user's own may fail before it looks at the cost.
        if let Err(invalid) = ratewarden_core::check_request(0, cost) {
            return Verdict::Invalid(invalid);
        }
        if let Some(refused) = self.limiter.config().refused_whatever_the_state(cost) {
            return Verdict::Decided(refused);
        }
        match self.failure_policy.answering(error.kind()) {
            FailurePolicy::FailOpen => Verdict::AdmitUndecided,
            FailurePolicy::FailClosed => Verdict::Unavailable,
            FailurePolicy::Local => match self.fallback.as_ref().map(|f| f.check_now(key, cost)) {
                Some(Ok(decision)) => Verdict::Decided(decision),
                Some(Err(e)) if e.is_invalid_input() => Verdict::Invalid(e),
                Some(Err(fallback_error)) => {
                    if let Some(held_back) = self.logs.fallback.pass(now_ms) {
                        tracing::warn!(
                            %error,
                            %fallback_error,
                            failures_not_logged = held_back,
                            "rate limiter and local fallback failed; refusing"
                        );
                    }
                    Verdict::Unavailable
                }
                None => Verdict::Unavailable,
            },
        }
    }

    fn refused(&self, decision: Decision, parts: &Parts, cost: u64) -> Response<Bytes> {
        let config = self.limiter.config();
        let refusal = Refusal {
            decision,
            config,
            parts,
            cost,
        };
        let mut response = match &self.refusal {
            Some(build) => build(&refusal),
            None => default_refusal(&refusal),
        };
        let headers = response.headers_mut();
        if !headers.contains_key(RETRY_AFTER) {
            if let Some(value) = self.headers.retry_after(&decision) {
                headers.insert(RETRY_AFTER, value);
            }
        }
        if !headers.contains_key(&RATELIMIT_POLICY) {
            headers.insert(RATELIMIT_POLICY, self.headers.policy().clone());
        }
        if !headers.contains_key(&RATELIMIT) {
            headers.insert(RATELIMIT, self.headers.ratelimit(&decision));
        }
        response
    }
}

fn text_response(status: StatusCode, body: String) -> Response<Bytes> {
    let mut response = Response::new(Bytes::from(body));
    *response.status_mut() = status;
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

/// The default refusal: `429 Too Many Requests` with a one-line message.
pub fn default_refusal(refusal: &Refusal<'_>) -> Response<Bytes> {
    let body = match refusal.retry_after_secs() {
        Some(secs) => format!("rate limit exceeded; retry in {secs} s\n"),
        // A bucket that never refills refuses every cost once its burst
        // is spent, not only a cost above what it holds.
        None if refusal.config.policy.has_burst()
            && refusal.config.limit == 0
            && refusal.cost <= refusal.config.effective_burst() =>
        {
            format!(
                "rate limit exceeded; {} never refills, and its burst is spent\n",
                refusal.config
            )
        }
        None => format!(
            "rate limit exceeded; a request of cost {} is above what {} can ever admit\n",
            refusal.cost, refusal.config
        ),
    };
    text_response(StatusCode::TOO_MANY_REQUESTS, body)
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for RateLimitService<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Send + 'static,
    ResBody: From<Bytes> + Send + 'static,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<Response<ResBody>, S::Error>>;

    /// Always ready: the request is decided in `call`, and only an admitted
    /// request waits for the inner service (see [Readiness](Self#readiness)).
    /// Forwarding the inner service's readiness here would make a request
    /// that is about to be refused wait for, and hold, the inner service.
    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // A clone, made ready inside the future only once the request is
        // admitted: the one kept here is never polled for readiness.
        let mut inner = self.inner.clone();
        let shared = Arc::clone(&self.shared);
        Box::pin(async move {
            let (mut parts, body) = request.into_parts();
            if shared.skip.as_ref().is_some_and(|skip| skip(&parts)) {
                return ready_call(&mut inner, Request::from_parts(parts, body)).await;
            }
            let key = match shared.key.extract(&parts) {
                Ok(key) => shared.key(key),
                Err(rejection) => return Ok(shared.rejected(rejection, &parts).map(ResBody::from)),
            };
            let cost = shared.cost.as_ref().map_or(1, |cost| cost(&parts));
            match shared.decide(key, cost).await {
                Verdict::Decided(decision) if decision.allowed => {
                    parts.extensions.insert(decision);
                    let mut response =
                        ready_call(&mut inner, Request::from_parts(parts, body)).await?;
                    let headers = response.headers_mut();
                    if headers
                        .get_all(&RATELIMIT)
                        .iter()
                        .any(|v| shared.headers.names_an_item_in(v))
                    {
                        if let Some(held_back) =
                            shared.logs.shared_name.pass(shared.logs.clock.now_ms())
                        {
                            tracing::warn!(
                                responses_not_logged = held_back,
                                "two nested rate-limit layers use one policy name, so a client \
                                 cannot tell their RateLimit items apart; give each its own with \
                                 RateLimitLayer::builder(..).policy_name(..)"
                            );
                        }
                    }
                    // The quota with every count, so that a client learns
                    // it before its first refusal; appended, as `RateLimit`
                    // is, beside the items of any nested layer.
                    headers.append(RATELIMIT_POLICY, shared.headers.policy().clone());
                    headers.append(RATELIMIT, shared.headers.ratelimit(&decision));
                    Ok(response)
                }
                Verdict::Decided(decision) => {
                    Ok(shared.refused(decision, &parts, cost).map(ResBody::from))
                }
                Verdict::AdmitUndecided => {
                    ready_call(&mut inner, Request::from_parts(parts, body)).await
                }
                Verdict::Unavailable => Ok(shared
                    .error_page(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "the rate limiter is unavailable; try again later",
                        LayerErrorKind::Unavailable,
                        &parts,
                    )
                    .map(ResBody::from)),
                // The cost comes from the operator's cost function, so the
                // fix is theirs: the log says what is wrong, the client
                // only that the server failed.
                Verdict::Invalid(error) => {
                    // Once a second: a cost taken from the request could
                    // otherwise be sent to flood the log.
                    if let Some(held_back) = shared.logs.rejection.pass(shared.logs.clock.now_ms())
                    {
                        tracing::error!(
                            %error,
                            cost,
                            rejections_not_logged = held_back,
                            "the request cannot be rate-limited"
                        );
                    }
                    Ok(shared
                        .error_page(
                            StatusCode::INTERNAL_SERVER_ERROR,
                            "internal server error",
                            LayerErrorKind::InvalidCost,
                            &parts,
                        )
                        .map(ResBody::from))
                }
            }
        })
    }
}

/// Waits until `inner` is ready, then calls it: `tower::ServiceExt::oneshot`
/// without the dependency.
async fn ready_call<S, R>(inner: &mut S, request: R) -> Result<S::Response, S::Error>
where
    S: Service<R>,
{
    std::future::poll_fn(|cx| inner.poll_ready(cx)).await?;
    inner.call(request).await
}

impl Shared {
    /// The answer to a request with no key: logged as its status deserves,
    /// then the error page, with the rejection's headers.
    fn rejected(&self, rejection: KeyRejection, parts: &Parts) -> Response<Bytes> {
        log_rejection(&rejection, &self.logs);
        let mut response = self.error_page(
            rejection.status(),
            rejection.message(),
            LayerErrorKind::NoKey,
            parts,
        );
        // The names a custom page set itself: it keeps its own of those.
        let own: Vec<HeaderName> = match &self.error {
            Some(_) => response.headers().keys().cloned().collect(),
            None => Vec::new(),
        };
        let headers = response.headers_mut();
        for (name, value) in rejection.headers() {
            if own.contains(name) {
                continue;
            }
            if name == CONTENT_TYPE {
                // One content type: the rejection's replaces the default
                // page's.
                headers.insert(name.clone(), value.clone());
            } else {
                headers.append(name.clone(), value.clone());
            }
        }
        response
    }

    /// The error closure's page, or the default one-line text.
    fn error_page(
        &self,
        status: StatusCode,
        message: &str,
        kind: LayerErrorKind,
        parts: &Parts,
    ) -> Response<Bytes> {
        match &self.error {
            Some(page) => page(&LayerError {
                status,
                message,
                kind,
                parts,
            }),
            None => text_response(status, format!("{message}\n")),
        }
    }
}

fn log_rejection(rejection: &KeyRejection, logs: &FailureLogs) {
    let status = rejection.status();
    let detail = rejection.detail().unwrap_or(rejection.message());
    // A server error is the operator's to fix, so it is logged loudly, but
    // at most once a second: it fails every request alike. A client error
    // is the client's doing (a missing API key, an anonymous user):
    // logging it above debug would let any client flood the log.
    if status.is_server_error() {
        if let Some(held_back) = logs.rejection.pass(logs.clock.now_ms()) {
            tracing::error!(
                %status,
                rejections_not_logged = held_back,
                "no rate-limit key for the request: {detail}"
            );
        }
    } else {
        tracing::debug!(%status, "no rate-limit key for the request: {detail}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::headers::SF_INTEGER_MAX;
    use ratewarden_core::REFERENCE;

    #[test]
    fn a_rejection_carries_its_headers_and_one_content_type() {
        let rejection = KeyRejection::new(StatusCode::UNAUTHORIZED, "who are you?")
            .with_header(
                http::header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer"),
            )
            .with_header(CONTENT_TYPE, HeaderValue::from_static("text/html"));
        let parts = Request::new(()).into_parts().0;
        let response = layer(RateLimitLayer::builder).rejected(rejection, &parts);
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(response.headers()[http::header::WWW_AUTHENTICATE], "Bearer");
        let types: Vec<_> = response.headers().get_all(CONTENT_TYPE).iter().collect();
        assert_eq!(types, ["text/html"]);
    }

    fn layer(
        builder: fn(Arc<dyn Limiter>, crate::key::GlobalKey) -> RateLimitBuilder,
    ) -> Arc<Shared> {
        let limiter = LocalLimiter::new(REFERENCE, Default::default()).unwrap();
        builder(Arc::new(limiter), crate::key::GlobalKey::new(0))
            .build()
            .unwrap()
            .shared
    }

    /// A custom error page keeps its own status, content type and any
    /// header it sets; the rejection's other headers are added, every
    /// value of them (two challenges stay two).
    #[test]
    fn a_custom_error_page_keeps_its_own_and_gets_the_rejection_s_headers() {
        let custom = |limiter, key| {
            RateLimitLayer::builder(limiter, key).on_error(|e: &LayerError<'_>| {
                assert_eq!(e.kind, LayerErrorKind::NoKey);
                let mut page = Response::new(Bytes::from(format!(
                    r#"{{"error":{:?},"status":{}}}"#,
                    e.message,
                    e.status.as_u16()
                )));
                *page.status_mut() = e.status;
                let headers = page.headers_mut();
                headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
                headers.insert("x-kept", HeaderValue::from_static("page"));
                page
            })
        };
        let rejection = KeyRejection::new(StatusCode::UNAUTHORIZED, "who are you?")
            .with_header(
                http::header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer"),
            )
            .with_header(
                http::header::WWW_AUTHENTICATE,
                HeaderValue::from_static("ApiKey"),
            )
            .with_header(CONTENT_TYPE, HeaderValue::from_static("text/html"))
            .with_header(
                HeaderName::from_static("x-kept"),
                HeaderValue::from_static("rejection"),
            );
        let parts = Request::new(()).into_parts().0;
        let response = layer(custom).rejected(rejection, &parts);
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
        let all = |name| -> Vec<_> { response.headers().get_all(name).iter().collect() };
        assert_eq!(all("www-authenticate"), ["Bearer", "ApiKey"]);
        assert_eq!(all("content-type"), ["application/json"]);
        assert_eq!(all("x-kept"), ["page"]);
        assert_eq!(response.body(), r#"{"error":"who are you?","status":401}"#);
    }

    #[test]
    fn a_refusal_states_the_wait_its_retry_after_header_states() {
        let (parts, ()) = Request::new(()).into_parts();
        let refusal = |decision| Refusal {
            decision,
            config: &REFERENCE,
            parts: &parts,
            cost: 1,
        };
        assert_eq!(
            refusal(Decision::refused(Some(1001), 0)).retry_after_secs(),
            Some(2)
        );
        assert_eq!(
            refusal(Decision::refused(Some(0), 0)).retry_after_secs(),
            Some(1)
        );
        assert_eq!(refusal(Decision::refused(None, 0)).retry_after_secs(), None);
        // A wait past 15 digits of seconds is clamped as the header's is.
        let huge = Decision::refused(Some(u64::MAX), 0);
        let headers = RateLimitHeaders::default_name(&REFERENCE);
        assert_eq!(refusal(huge).retry_after_secs(), Some(SF_INTEGER_MAX));
        assert_eq!(
            headers.retry_after(&huge).unwrap(),
            SF_INTEGER_MAX.to_string().as_str()
        );
    }

    #[test]
    fn builder_layer_and_service_debug_as_their_configuration() {
        // The limiter, key and closures have no Debug; what is shown in
        // their place is the configuration that decides.
        let limiter = Arc::new(LocalLimiter::new(REFERENCE, Default::default()).unwrap());
        let builder =
            RateLimitLayer::builder(limiter, crate::key::GlobalKey::new(0)).policy_name("api");
        let text = format!("{builder:?}");
        assert!(text.starts_with("RateLimitBuilder"), "{text}");
        assert!(
            text.contains("limit: 100") && text.contains("\"api\""),
            "{text}"
        );
        let layer = builder.build().unwrap();
        let text = format!("{layer:?}");
        assert!(text.starts_with("RateLimitLayer"), "{text}");
        assert!(
            text.contains("limit: 100") && text.contains("FailClosed"),
            "{text}"
        );
        let text = format!("{:?}", layer.layer("the inner service"));
        assert!(text.starts_with("RateLimitService"), "{text}");
        assert!(
            text.contains("limit: 100") && text.contains("the inner service"),
            "{text}"
        );
    }
}
