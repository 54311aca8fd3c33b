//! The layer inside real axum routers, driven by a manual clock: exact admit
//! counts, header values checked against the limiter's decisions, one budget
//! across clones, every key extractor, proxy trust and the failure policy.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{ConnectInfo, Request};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::get;
use axum::Router;
use bytes::Bytes;
use http::header::{HeaderName, RETRY_AFTER};
use http::StatusCode;
use http_body_util::BodyExt;
use ratewarden_core::{
    BoxFuture, Decision, FailurePolicy, KeyHash, Limiter, LocalLimiter, ManualClock, PolicyConfig,
    PolicyKind, StoreError, StoreErrorKind, REFERENCE,
};
use ratewarden_tower::headers::{retry_after_secs, RATELIMIT, RATELIMIT_POLICY};
use ratewarden_tower::key::{
    ExtensionKey, GlobalKey, HeaderKey, KeyExtractor, KeyExtractorExt, KeyRejection, PeerIp,
    RequestKey,
};
use ratewarden_tower::RateLimitLayer;
use tower::{Layer, Service, ServiceExt};

/// A limiter on a manual clock, and the clock.
fn local(config: PolicyConfig) -> (LocalLimiter, ManualClock) {
    let clock = ManualClock::new(0);
    let limiter = LocalLimiter::with_clock(config, Default::default(), clock.clone()).unwrap();
    (limiter, clock)
}

/// A handler that answers with the decision the layer made, so a test can
/// hold the headers against it.
async fn echo_decision(request: Request) -> String {
    match request.extensions().get::<Decision>() {
        Some(d) => format!("{:?} {} {}", d.retry_after_ms, d.allowed, d.remaining),
        None => "undecided".to_owned(),
    }
}

fn router(layer: RateLimitLayer) -> Router {
    Router::new().route("/", get(echo_decision)).layer(layer)
}

fn get_from(peer: &str) -> http::request::Builder {
    let addr: SocketAddr = peer.parse().unwrap();
    Request::builder().uri("/").extension(ConnectInfo(addr))
}

async fn send(app: &Router, request: http::request::Builder) -> (Response<Body>, String) {
    let response = app
        .clone()
        .oneshot(request.body(Body::empty()).unwrap())
        .await
        .unwrap();
    let (parts, body) = response.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    (
        Response::from_parts(parts, Body::empty()),
        String::from_utf8(bytes.to_vec()).unwrap(),
    )
}

fn header<'a>(response: &'a Response<Body>, name: &HeaderName) -> Option<&'a str> {
    response.headers().get(name).map(|v| v.to_str().unwrap())
}

/// Sends `n` requests from `peer` and counts the admitted ones.
async fn admitted(app: &Router, request: impl Fn() -> http::request::Builder, n: usize) -> usize {
    let mut count = 0;
    for _ in 0..n {
        let (response, _) = send(app, request()).await;
        if response.status() == StatusCode::OK {
            count += 1;
        }
    }
    count
}

#[tokio::test]
async fn reference_admits_exactly_100_and_headers_match_the_decisions() {
    let (limiter, _clock) = local(REFERENCE);
    // A twin limiter on its own clock, fed the same requests, says what each
    // decision must be.
    let (twin, _twin_clock) = local(REFERENCE);
    let app = router(RateLimitLayer::new(Arc::new(limiter), GlobalKey::new(1)));
    for _ in 0..100 {
        let expected = twin.check_now(1, 1).unwrap();
        let (response, body) = send(&app, Request::builder().uri("/")).await;
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(body, format!("Some(0) true {}", expected.remaining));
        let ratelimit = format!("\"default\";r={}", expected.remaining);
        assert_eq!(header(&response, &RATELIMIT), Some(ratelimit.as_str()));
        // The quota with every count, before any refusal.
        assert_eq!(
            header(&response, &RATELIMIT_POLICY),
            Some("\"default\";q=100;w=1")
        );
        assert_eq!(header(&response, &RETRY_AFTER), None);
    }
    let expected = twin.check_now(1, 1).unwrap();
    assert!(!expected.allowed);
    let (response, body) = send(&app, Request::builder().uri("/")).await;
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    // A full window at 0 ms waits to its edge plus 1 ms: 1001 ms, 2 s.
    assert_eq!(expected.retry_after_ms, Some(1001));
    assert_eq!(header(&response, &RETRY_AFTER), Some("2"));
    assert_eq!(
        header(&response, &RATELIMIT_POLICY),
        Some("\"default\";q=100;w=1")
    );
    assert_eq!(header(&response, &RATELIMIT), Some("\"default\";r=0;t=2"));
    assert_eq!(body, "rate limit exceeded; retry in 2 s\n");
}

#[tokio::test]
async fn retry_after_is_exact_against_the_decision_as_the_clock_moves() {
    let config = PolicyConfig::new(PolicyKind::FixedWindow, 3, 1000);
    let (limiter, clock) = local(config);
    let (twin, twin_clock) = local(config);
    let app = router(RateLimitLayer::new(Arc::new(limiter), GlobalKey::new(1)));
    // Fixed window: refused at `t` waits until 1000, so the wait runs
    // through 1000 ms (1 s), 1 ms (1 s) and 999 ms (1 s), and a window of
    // 2500 ms gives 2 s and 3 s below.
    for now_ms in [0, 1, 999] {
        clock.set_ms(now_ms);
        twin_clock.set_ms(now_ms);
        loop {
            let expected = twin.check_now(1, 1).unwrap();
            let (response, _) = send(&app, Request::builder().uri("/")).await;
            if expected.allowed {
                assert_eq!(response.status(), StatusCode::OK);
                continue;
            }
            assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
            let ms = expected.retry_after_ms.unwrap();
            assert_eq!(ms, 1000 - now_ms);
            let secs = retry_after_secs(ms).to_string();
            assert_eq!(header(&response, &RETRY_AFTER), Some(secs.as_str()));
            assert_eq!(secs, "1");
            break;
        }
    }
    let config = PolicyConfig::new(PolicyKind::FixedWindow, 1, 2500);
    let (limiter, clock) = local(config);
    let app = router(RateLimitLayer::new(Arc::new(limiter), GlobalKey::new(1)));
    assert_eq!(
        send(&app, Request::builder().uri("/")).await.0.status(),
        StatusCode::OK
    );
    let expectations = [
        (0, "3", "\"default\";r=0;t=3"),
        (1499, "2", "\"default\";r=0;t=2"),
    ];
    for (now_ms, retry_after, ratelimit) in expectations {
        clock.set_ms(now_ms);
        let (response, _) = send(&app, Request::builder().uri("/")).await;
        assert_eq!(header(&response, &RETRY_AFTER), Some(retry_after));
        assert_eq!(header(&response, &RATELIMIT), Some(ratelimit));
        assert_eq!(
            header(&response, &RATELIMIT_POLICY),
            Some("\"default\";q=1;w=3")
        );
    }
}

/// tower's `RateLimit` kept its state in each clone of the service, so behind
/// axum, which clones the service for every request, each request had a
/// fresh budget (tower #794, axum #2634). Here every clone of the layer, of
/// the router and of the service draws on one budget.
#[tokio::test]
async fn tower_794_axum_2634_clones_share_one_budget() {
    let config = PolicyConfig::new(PolicyKind::FixedWindow, 10, 1000);
    let (limiter, _clock) = local(config);
    let layer = RateLimitLayer::new(Arc::new(limiter), GlobalKey::new(0));

    // Two routers built from two clones of the layer, each request sent to a
    // fresh clone of a router.
    let first = router(layer.clone());
    let second = router(layer.clone());
    let mut ok = 0;
    for i in 0..20 {
        let router = if i % 2 == 0 { &first } else { &second };
        let (response, _) = send(router, Request::builder().uri("/")).await;
        ok += usize::from(response.status() == StatusCode::OK);
    }
    assert_eq!(ok, 10);

    // The bare tower service, cloned for each call as a server does.
    let (limiter, _clock) = local(config);
    let layer = RateLimitLayer::new(Arc::new(limiter), GlobalKey::new(0));
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&calls);
    let service = layer.layer(tower::service_fn(move |_req: Request| {
        counted.fetch_add(1, Ordering::SeqCst);
        async { Ok::<_, std::convert::Infallible>(Response::new(Body::empty())) }
    }));
    // The service type's clones must be the budget's clones, not copies.
    let mut statuses = Vec::new();
    for _ in 0..15 {
        let response = service
            .clone()
            .oneshot(Request::new(Body::empty()))
            .await
            .unwrap();
        statuses.push(response.status());
    }
    assert_eq!(
        statuses.iter().filter(|s| **s == StatusCode::OK).count(),
        10
    );
    assert_eq!(
        statuses
            .iter()
            .filter(|s| **s == StatusCode::TOO_MANY_REQUESTS)
            .count(),
        5
    );
    // Refused requests never reach the inner service.
    assert_eq!(calls.load(Ordering::SeqCst), 10);
}

fn ok_service() -> impl Service<
    Request,
    Response = Response<Body>,
    Error = std::convert::Infallible,
    Future = impl Send,
> + Clone
       + Send
       + 'static {
    tower::service_fn(|_req: Request| async {
        Ok::<_, std::convert::Infallible>(Response::new(Body::empty()))
    })
}

#[tokio::test]
async fn poll_ready_never_waits_on_the_limiter() {
    // A limiter that never answers: the service is ready at once, because
    // the limiter is asked only in `call`.
    let never = RateLimitLayer::new(Arc::new(Pending(REFERENCE)), GlobalKey::new(0));
    let mut service = never.layer(ok_service());
    let mut cx = Context::from_waker(Waker::noop());
    assert!(matches!(
        Service::<Request>::poll_ready(&mut service, &mut cx),
        Poll::Ready(Ok(()))
    ));

    // An exhausted budget: still ready, and the call is answered with 429.
    let config = PolicyConfig::new(PolicyKind::FixedWindow, 1, 1000);
    let (limiter, _clock) = local(config);
    let mut service = RateLimitLayer::new(Arc::new(limiter), GlobalKey::new(0)).layer(ok_service());
    let first = service
        .clone()
        .oneshot(Request::new(Body::empty()))
        .await
        .unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    assert!(matches!(
        Service::<Request>::poll_ready(&mut service, &mut cx),
        Poll::Ready(Ok(()))
    ));
    let refused = service.call(Request::new(Body::empty())).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
}

/// An inner service that is not ready until opened, and counts its calls.
#[derive(Clone, Default)]
struct Gate(Arc<std::sync::Mutex<GateState>>);

#[derive(Default)]
struct GateState {
    open: bool,
    waiting: Vec<Waker>,
    calls: usize,
}

impl Gate {
    fn open(&self) {
        let mut state = self.0.lock().unwrap();
        state.open = true;
        state.waiting.drain(..).for_each(Waker::wake);
    }

    fn waiters(&self) -> usize {
        self.0.lock().unwrap().waiting.len()
    }

    fn calls(&self) -> usize {
        self.0.lock().unwrap().calls
    }
}

impl Service<Request> for Gate {
    type Response = Response<Body>;
    type Error = std::convert::Infallible;
    type Future = std::future::Ready<Result<Response<Body>, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        let mut state = self.0.lock().unwrap();
        if state.open {
            Poll::Ready(Ok(()))
        } else {
            state.waiting.push(cx.waker().clone());
            Poll::Pending
        }
    }

    fn call(&mut self, _request: Request) -> Self::Future {
        let mut state = self.0.lock().unwrap();
        assert!(state.open, "called before it was ready");
        state.calls += 1;
        std::future::ready(Ok(Response::new(Body::empty())))
    }
}

// Time is paused: if the refusal waited for the gate, nothing could make
// progress, tokio would jump its clock to the timeout, and the test would
// fail at once. No real time is measured.
#[tokio::test(start_paused = true)]
async fn a_refusal_does_not_wait_for_the_inner_service_to_be_ready() {
    let config = PolicyConfig::new(PolicyKind::FixedWindow, 1, 60_000);
    let (limiter, _clock) = local(config);
    let gate = Gate::default();
    let mut service = RateLimitLayer::new(Arc::new(limiter), GlobalKey::new(0)).layer(gate.clone());
    let mut cx = Context::from_waker(Waker::noop());
    assert!(matches!(
        Service::<Request>::poll_ready(&mut service, &mut cx),
        Poll::Ready(Ok(()))
    ));

    // The first request is admitted, spending the budget, and waits for
    // the gate.
    let first = tokio::spawn(service.clone().oneshot(Request::new(Body::empty())));
    while gate.waiters() == 0 {
        tokio::task::yield_now().await;
    }

    // The second is refused while the gate is still shut.
    let refused = tokio::time::timeout(
        Duration::from_secs(3600),
        service.clone().oneshot(Request::new(Body::empty())),
    )
    .await
    .expect("the refusal waited for the inner service to be ready")
    .unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(gate.calls(), 0);
    assert!(!first.is_finished());

    // Opening the gate lets the admitted request through.
    gate.open();
    let admitted = first.await.unwrap().unwrap();
    assert_eq!(admitted.status(), StatusCode::OK);
    assert_eq!(gate.calls(), 1);
}

#[tokio::test]
async fn peer_ip_gives_each_client_its_own_budget() {
    let config = PolicyConfig::new(PolicyKind::SlidingLog, 2, 1000);
    let (limiter, clock) = local(config);
    let app = router(RateLimitLayer::new(Arc::new(limiter), PeerIp::new()));
    assert_eq!(admitted(&app, || get_from("198.51.100.7:1000"), 5).await, 2);
    assert_eq!(admitted(&app, || get_from("198.51.100.8:1000"), 5).await, 2);
    // Another port of the same address is the same client.
    assert_eq!(admitted(&app, || get_from("198.51.100.7:2000"), 5).await, 0);
    // The same address through an IPv6 socket is the same client too.
    assert_eq!(
        admitted(&app, || get_from("[::ffff:198.51.100.7]:2000"), 5).await,
        0
    );
    assert_eq!(
        admitted(&app, || get_from("[2001:db8::1]:2000"), 5).await,
        2
    );
    clock.advance_ms(1000);
    assert_eq!(admitted(&app, || get_from("198.51.100.7:1000"), 5).await, 2);
}

#[tokio::test]
async fn an_ipv6_client_cannot_escape_its_budget_by_rotating_addresses_in_its_64() {
    let config = PolicyConfig::new(PolicyKind::FixedWindow, 3, 60_000);
    let (limiter, _clock) = local(config);
    let app = router(RateLimitLayer::new(Arc::new(limiter), PeerIp::new()));
    let mut ok = 0;
    for i in 1..=50 {
        let peer = format!("[2001:db8:1:2::{i:x}]:443");
        ok += admitted(&app, || get_from(&peer), 1).await;
    }
    assert_eq!(ok, 3);
    // The next /64 is another client.
    assert_eq!(
        admitted(&app, || get_from("[2001:db8:1:3::1]:443"), 5).await,
        3
    );

    // Per address when asked for.
    let (limiter, _clock) = local(config);
    let key = PeerIp::new().ipv6_prefix_len(128);
    let app = router(RateLimitLayer::new(Arc::new(limiter), key));
    assert_eq!(
        admitted(&app, || get_from("[2001:db8:1:2::1]:443"), 5).await,
        3
    );
    assert_eq!(
        admitted(&app, || get_from("[2001:db8:1:2::2]:443"), 5).await,
        3
    );
}

#[tokio::test]
async fn peer_ip_without_connect_info_is_a_server_error() {
    let (limiter, _clock) = local(REFERENCE);
    let app = router(RateLimitLayer::new(Arc::new(limiter), PeerIp::new()));
    let (response, body) = send(&app, Request::builder().uri("/")).await;
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    // How to set the server up is logged, not told to the client.
    assert_eq!(body, "internal server error\n");
}

#[tokio::test]
async fn spoofed_x_forwarded_for_is_ignored_unless_the_peer_is_trusted() {
    let config = PolicyConfig::new(PolicyKind::FixedWindow, 2, 1000);

    // No trust configured: a client rotating X-Forwarded-For values is still
    // one client.
    let (limiter, _clock) = local(config);
    let app = router(RateLimitLayer::new(Arc::new(limiter), PeerIp::new()));
    let mut ok = 0;
    for i in 0..6 {
        let (response, _) = send(
            &app,
            get_from("203.0.113.9:5000")
                .header("x-forwarded-for", format!("192.0.2.{i}"))
                .header("forwarded", format!("for=192.0.2.{i}")),
        )
        .await;
        ok += usize::from(response.status() == StatusCode::OK);
    }
    assert_eq!(ok, 2);

    // Trust configured, but this peer is not a trusted proxy: same result.
    let (limiter, _clock) = local(config);
    let trusted = PeerIp::new().trust_x_forwarded_for(["10.0.0.0/8".parse().unwrap()]);
    let app = router(RateLimitLayer::new(Arc::new(limiter), trusted));
    let rotating =
        |i: usize| get_from("203.0.113.9:5000").header("x-forwarded-for", format!("192.0.2.{i}"));
    let mut ok = 0;
    for i in 0..6 {
        ok += usize::from(send(&app, rotating(i)).await.0.status() == StatusCode::OK);
    }
    assert_eq!(ok, 2);

    // Through the trusted proxy 10.0.0.1 the right-most untrusted address is
    // the client; what the client wrote to its left changes nothing.
    let via_proxy = |xff: String| get_from("10.0.0.1:443").header("x-forwarded-for", xff);
    let mut ok = 0;
    for i in 0..6 {
        let xff = format!("192.0.2.{i}, 198.51.100.7, 10.0.0.5");
        ok += usize::from(send(&app, via_proxy(xff)).await.0.status() == StatusCode::OK);
    }
    assert_eq!(ok, 2);
    // Another real client behind the same proxy has its own budget.
    assert_eq!(
        admitted(&app, || via_proxy("198.51.100.8".into()), 4).await,
        2
    );
    // A trusted proxy's Forwarded header is not read when X-Forwarded-For is
    // the one trusted: these requests are keyed by the proxy itself.
    let forwarded = || get_from("10.0.0.1:443").header("forwarded", "for=198.51.100.9");
    assert_eq!(admitted(&app, forwarded, 4).await, 2);
    assert_eq!(admitted(&app, || get_from("10.0.0.1:443"), 4).await, 0);
}

#[tokio::test]
async fn forwarded_header_is_read_when_trusted() {
    let config = PolicyConfig::new(PolicyKind::FixedWindow, 1, 1000);
    let (limiter, _clock) = local(config);
    let key = PeerIp::new().trust_forwarded(["10.0.0.0/8".parse().unwrap()]);
    let app = router(RateLimitLayer::new(Arc::new(limiter), key));
    let client = |c: &'static str| get_from("10.0.0.1:443").header("forwarded", c);
    assert_eq!(
        admitted(&app, || client("for=\"[2001:db8::1]:5000\";proto=https"), 3).await,
        1
    );
    assert_eq!(admitted(&app, || client("for=198.51.100.7"), 3).await, 1);
    // An obfuscated port hides only the port.
    assert_eq!(
        admitted(&app, || client("for=\"192.0.2.43:_p1\""), 3).await,
        1
    );
    assert_eq!(admitted(&app, || client("for=192.0.2.43:4711"), 3).await, 0);
    assert_eq!(
        admitted(&app, || client("for=6.6.6.6, for=198.51.100.7"), 3).await,
        0
    );
}

#[tokio::test]
async fn header_key_limits_each_api_key_and_rejects_requests_without_one() {
    let config = PolicyConfig::new(PolicyKind::TokenBucket, 3, 1000);
    let (limiter, clock) = local(config);
    let key = HeaderKey::new(HeaderName::from_static("x-api-key"))
        .missing_status(StatusCode::UNAUTHORIZED)
        .missing_header(
            http::header::WWW_AUTHENTICATE,
            http::HeaderValue::from_static("ApiKey"),
        );
    let app = router(RateLimitLayer::new(Arc::new(limiter), key));
    let with_key = |k: &'static str| Request::builder().uri("/").header("x-api-key", k);
    assert_eq!(admitted(&app, || with_key("alpha"), 5).await, 3);
    assert_eq!(admitted(&app, || with_key("beta"), 5).await, 3);
    let (response, body) = send(&app, Request::builder().uri("/")).await;
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(body, "header x-api-key is missing\n");
    // A 401 carries its challenge (RFC 9110 §15.5.2).
    assert_eq!(response.headers()["www-authenticate"], "ApiKey");
    // The bucket refills one permit per 333⅓ ms.
    clock.advance_ms(334);
    assert_eq!(admitted(&app, || with_key("alpha"), 5).await, 1);
}

/// The authenticated user, as an authentication layer would insert it.
#[derive(Clone)]
struct User {
    id: u64,
}

async fn authenticate(mut request: Request, next: Next) -> Response {
    let user = request
        .headers()
        .get("x-user")
        .and_then(|v| v.to_str().ok()?.parse().ok());
    match user {
        Some(id) => {
            request.extensions_mut().insert(User { id });
            next.run(request).await
        }
        None => Response::builder()
            .status(StatusCode::UNAUTHORIZED)
            .body(Body::empty())
            .unwrap(),
    }
}

#[tokio::test]
async fn extension_key_limits_the_authenticated_user() {
    let config = PolicyConfig::new(PolicyKind::Gcra, 2, 1000);
    let (limiter, _clock) = local(config);
    let key = ExtensionKey::new(|user: &User| RequestKey::Id(user.id));
    let rate_limit = RateLimitLayer::new(Arc::new(limiter), key);
    // The authentication layer is added last, so it runs first.
    let app = Router::new()
        .route("/", get(echo_decision))
        .layer(rate_limit.clone())
        .layer(middleware::from_fn(authenticate));
    let as_user = |id: &'static str| Request::builder().uri("/").header("x-user", id);
    assert_eq!(admitted(&app, || as_user("1"), 4).await, 2);
    assert_eq!(admitted(&app, || as_user("2"), 4).await, 2);
    // The same user from elsewhere shares the budget.
    let elsewhere =
        || as_user("1").extension(ConnectInfo("192.0.2.1:1".parse::<SocketAddr>().unwrap()));
    assert_eq!(admitted(&app, elsewhere, 4).await, 0);

    // With the layers in the wrong order the extension is missing: a server
    // error (whose log says what to change), not an unlimited request, and
    // a body that names no type or layer.
    let misordered = Router::new()
        .route("/", get(echo_decision))
        .layer(middleware::from_fn(authenticate))
        .layer(rate_limit);
    let (response, body) = send(&misordered, as_user("3")).await;
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(body, "internal server error\n");

    // Anonymous users answered 401 are told only that.
    let (limiter, _clock) = local(config);
    let key = ExtensionKey::new(|user: &User| RequestKey::Id(user.id))
        .missing_status(StatusCode::UNAUTHORIZED);
    let app = router(RateLimitLayer::new(Arc::new(limiter), key));
    let (response, body) = send(&app, Request::builder().uri("/")).await;
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(body, "authentication required\n");
}

#[tokio::test]
async fn closure_key_and_fallback_key() {
    let config = PolicyConfig::new(PolicyKind::FixedWindow, 2, 1000);
    let (limiter, _clock) = local(config);
    // Keyed by the first path segment.
    let tenant = |parts: &http::request::Parts| -> Result<RequestKey, KeyRejection> {
        let segment = parts
            .uri
            .path()
            .trim_start_matches('/')
            .split('/')
            .next()
            .unwrap_or("");
        if segment.is_empty() {
            Err(KeyRejection::new(
                StatusCode::NOT_FOUND,
                "no tenant in the path",
            ))
        } else {
            Ok(RequestKey::from(segment))
        }
    };
    let layer = RateLimitLayer::new(Arc::new(limiter), tenant);
    let app = Router::new()
        .route("/{tenant}/items", get(echo_decision))
        .layer(layer);
    let path = |p: &'static str| Request::builder().uri(p);
    assert_eq!(admitted(&app, || path("/acme/items"), 4).await, 2);
    assert_eq!(admitted(&app, || path("/globex/items"), 4).await, 2);

    // An API key when there is one, else the client address.
    let key = HeaderKey::new(HeaderName::from_static("x-api-key")).or(PeerIp::new());
    let (parts, ()) = get_from("192.0.2.1:1").body(()).unwrap().into_parts();
    assert_eq!(
        key.extract(&parts).unwrap(),
        RequestKey::from("ip:192.0.2.1")
    );
    let (parts, ()) = get_from("192.0.2.1:1")
        .header("x-api-key", "k")
        .body(())
        .unwrap()
        .into_parts();
    assert_eq!(
        key.extract(&parts).unwrap(),
        RequestKey::from("header:x-api-key:k")
    );
}

#[tokio::test]
async fn a_header_value_cannot_spend_the_budget_of_a_client_address() {
    let config = PolicyConfig::new(PolicyKind::FixedWindow, 3, 60_000);
    let (limiter, _clock) = local(config);
    let key = HeaderKey::new(HeaderName::from_static("x-api-key")).or(PeerIp::new());
    let app = router(RateLimitLayer::new(Arc::new(limiter), key));
    // An attacker names the victim's address as its API key and spends
    // everything that key has.
    let attacker = || get_from("203.0.113.9:1").header("x-api-key", "198.51.100.7");
    assert_eq!(admitted(&app, attacker, 5).await, 3);
    // The victim, keyed by its address, still has its whole budget.
    assert_eq!(admitted(&app, || get_from("198.51.100.7:1"), 5).await, 3);
}

#[tokio::test]
async fn string_keys_are_hashed_with_the_configured_hash() {
    // "user:21620" and "user:32611" share one mix32 hash. The default,
    // xxh3-64, keeps them apart; mix32, chosen explicitly, gives them one
    // budget.
    let config = PolicyConfig::new(PolicyKind::FixedWindow, 1, 1000);
    // A closure's string is hashed as written, with no namespace prefix.
    let key = || {
        |parts: &http::request::Parts| -> Result<RequestKey, KeyRejection> {
            let user = parts.headers.get("x-user").unwrap().to_str().unwrap();
            Ok(RequestKey::from(user))
        }
    };
    let user = |u: &'static str| Request::builder().uri("/").header("x-user", u);
    let (limiter, _clock) = local(config);
    let app = router(RateLimitLayer::new(Arc::new(limiter), key()));
    assert_eq!(admitted(&app, || user("user:21620"), 2).await, 1);
    assert_eq!(admitted(&app, || user("user:32611"), 2).await, 1);
    let (limiter, _clock) = local(config);
    let layer = RateLimitLayer::builder(Arc::new(limiter), key())
        .key_hash(KeyHash::Mix32)
        .build()
        .unwrap();
    let app = router(layer);
    assert_eq!(admitted(&app, || user("user:21620"), 2).await, 1);
    assert_eq!(admitted(&app, || user("user:32611"), 2).await, 0);
}

#[tokio::test]
async fn cost_comes_from_the_request() {
    let config = PolicyConfig::new(PolicyKind::SlidingLog, 10, 1000);
    let (limiter, _clock) = local(config);
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
    let app = router(layer);
    let costing = |c: &'static str| Request::builder().uri("/").header("x-cost", c);
    let (response, _) = send(&app, costing("7")).await;
    assert_eq!(header(&response, &RATELIMIT), Some("\"default\";r=3"));
    let (response, _) = send(&app, costing("4")).await;
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    // The refused request changed nothing.
    assert_eq!(header(&response, &RATELIMIT), Some("\"default\";r=3;t=1"));
    let (response, _) = send(&app, costing("3")).await;
    assert_eq!(header(&response, &RATELIMIT), Some("\"default\";r=0"));
}

#[tokio::test]
async fn a_request_that_never_fits_claims_no_retry_time() {
    let config = PolicyConfig::new(PolicyKind::TokenBucket, 10, 1000).with_burst(5);
    let (limiter, _clock) = local(config);
    let layer = RateLimitLayer::builder(Arc::new(limiter), GlobalKey::new(0))
        .cost(|_| 6)
        .policy_name("bulk")
        .build()
        .unwrap();
    let (response, body) = send(&router(layer), Request::builder().uri("/")).await;
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&response, &RETRY_AFTER), None);
    assert_eq!(header(&response, &RATELIMIT), Some("\"bulk\";r=5"));
    assert_eq!(
        header(&response, &RATELIMIT_POLICY),
        Some("\"bulk\";q=5;w=1")
    );
    assert!(
        body.contains("above what token-bucket 10 per 1000 ms (burst 5) can ever admit"),
        "{body}"
    );
}

/// A bucket that never refills admits its burst, then refuses for good:
/// the body says why, rather than blaming the cost.
#[tokio::test]
async fn a_bucket_that_never_refills_says_so_once_its_burst_is_spent() {
    for kind in [PolicyKind::TokenBucket, PolicyKind::Gcra] {
        let config = PolicyConfig::new(kind, 0, 1000).with_burst(2);
        let (limiter, _clock) = local(config);
        let app = router(RateLimitLayer::new(Arc::new(limiter), GlobalKey::new(0)));
        assert_eq!(admitted(&app, || Request::builder().uri("/"), 2).await, 2);
        let (response, body) = send(&app, Request::builder().uri("/")).await;
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(header(&response, &RETRY_AFTER), None);
        assert_eq!(
            body,
            format!("rate limit exceeded; {kind} 0 per 1000 ms (burst 2) never refills, and its burst is spent\n")
        );
        // A cost above the burst is refused even by a full bucket: the
        // body blames the cost, not a burst that was never spent.
        let (limiter, _clock) = local(config);
        let layer = RateLimitLayer::builder(Arc::new(limiter), GlobalKey::new(0))
            .cost(|_| 3)
            .build()
            .unwrap();
        let (response, body) = send(&router(layer), Request::builder().uri("/")).await;
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(
            body,
            format!("rate limit exceeded; a request of cost 3 is above what {kind} 0 per 1000 ms (burst 2) can ever admit\n")
        );
    }
}

#[tokio::test]
async fn the_refusal_response_is_configurable() {
    let config = PolicyConfig::new(PolicyKind::FixedWindow, 1, 1000);
    let (limiter, _clock) = local(config);
    let layer = RateLimitLayer::builder(Arc::new(limiter), GlobalKey::new(0))
        .on_refused(|refusal| {
            let body = format!(
                "{{\"error\":\"slow down\",\"retry_after_ms\":{}}}",
                refusal.decision.retry_after_ms.unwrap_or(0)
            );
            http::Response::builder()
                .status(StatusCode::TOO_MANY_REQUESTS)
                .header("content-type", "application/json")
                // The closure's own Retry-After is kept.
                .header("retry-after", "60")
                .body(Bytes::from(body))
                .unwrap()
        })
        .build()
        .unwrap();
    let app = router(layer);
    send(&app, Request::builder().uri("/")).await;
    let (response, body) = send(&app, Request::builder().uri("/")).await;
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(body, "{\"error\":\"slow down\",\"retry_after_ms\":1000}");
    assert_eq!(
        header(&response, &http::header::CONTENT_TYPE),
        Some("application/json")
    );
    assert_eq!(header(&response, &RETRY_AFTER), Some("60"));
    assert_eq!(header(&response, &RATELIMIT), Some("\"default\";r=0;t=1"));
    assert_eq!(
        header(&response, &RATELIMIT_POLICY),
        Some("\"default\";q=1;w=1")
    );
}

#[test]
fn bad_configuration_is_an_error_that_says_what_to_change() {
    let (limiter, _clock) = local(REFERENCE);
    let err = RateLimitLayer::builder(Arc::new(limiter.clone()), GlobalKey::new(0))
        .policy_name("per\nminute")
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("printable ASCII"), "{err}");
    let err = RateLimitLayer::builder(Arc::new(limiter.clone()), GlobalKey::new(0))
        .check_timeout(Duration::ZERO)
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("use 1 ms or more"), "{err}");
    let err = RateLimitLayer::builder(Arc::new(limiter.clone()), GlobalKey::new(0))
        .check_timeout(Duration::from_micros(999))
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("under 1 ms"), "{err}");
    // "At least 1 ms": 1 ms itself is accepted.
    assert!(
        RateLimitLayer::builder(Arc::new(limiter.clone()), GlobalKey::new(0))
            .check_timeout(Duration::from_millis(1))
            .build()
            .is_ok()
    );
    let (unused, _clock) = local(REFERENCE);
    let err = RateLimitLayer::builder(Arc::new(limiter.clone()), GlobalKey::new(0))
        .failure_policy(FailurePolicy::FailOpen)
        .local_fallback(unused)
        .build()
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("set .failure_policy(FailurePolicy::Local) or drop .local_fallback"),
        "{err}"
    );
    let (other, _clock) = local(PolicyConfig::new(PolicyKind::Gcra, 100, 1000));
    let err = RateLimitLayer::builder(Arc::new(limiter), GlobalKey::new(0))
        .failure_policy(FailurePolicy::Local)
        .local_fallback(other)
        .build()
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("give the fallback the limiter's configuration"),
        "{err}"
    );
    // A bucket's default burst and that burst written out decide alike,
    // on either side.
    let bucket = PolicyConfig::new(PolicyKind::TokenBucket, 10, 1000);
    for (limiter, fallback) in [
        (bucket, bucket.with_burst(10)),
        (bucket.with_burst(10), bucket),
    ] {
        let (limiter, _clock) = local(limiter);
        let (fallback, _clock) = local(fallback);
        let built = RateLimitLayer::builder(Arc::new(limiter), GlobalKey::new(0))
            .failure_policy(FailurePolicy::Local)
            .local_fallback(fallback)
            .build();
        assert!(built.is_ok(), "{:?}", built.err());
    }
}

/// A limiter whose store has failed.
struct Failing(PolicyConfig, StoreErrorKind);

impl Limiter for Failing {
    fn config(&self) -> &PolicyConfig {
        &self.0
    }

    fn check(&self, _key: u64, _cost: u64) -> BoxFuture<'_, Result<Decision, StoreError>> {
        Box::pin(std::future::ready(Err(StoreError::new(
            self.1,
            "connection refused",
        ))))
    }
}

/// A limiter whose store never answers.
struct Pending(PolicyConfig);

impl Limiter for Pending {
    fn config(&self) -> &PolicyConfig {
        &self.0
    }

    fn check(&self, _key: u64, _cost: u64) -> BoxFuture<'_, Result<Decision, StoreError>> {
        Box::pin(std::future::pending())
    }
}

fn failing() -> Arc<dyn Limiter> {
    Arc::new(Failing(REFERENCE, StoreErrorKind::ConnectionDropped))
}

#[tokio::test]
async fn fail_open_admits_without_rate_limit_headers() {
    let layer = RateLimitLayer::builder(failing(), GlobalKey::new(0))
        .failure_policy(FailurePolicy::FailOpen)
        .build()
        .unwrap();
    let app = router(layer);
    for _ in 0..150 {
        let (response, body) = send(&app, Request::builder().uri("/")).await;
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(body, "undecided");
        assert_eq!(header(&response, &RATELIMIT), None);
    }
}

/// What a writer of log lines wrote, shared with the test.
#[derive(Clone, Default)]
struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);

impl Captured {
    /// Captures what this thread logs until the guards are dropped.
    ///
    /// A second dispatcher stays registered meanwhile. tracing caches each
    /// callsite's interest for the whole process, and while one dispatcher
    /// alone is registered it takes that interest from whichever thread
    /// reaches the callsite first: a sibling test's thread, with no
    /// subscriber, caches "never", and this thread's events at that
    /// callsite are lost (tokio-rs/tracing#3611). With two, the interest is
    /// taken from every registered dispatcher, this one included.
    fn on_this_thread() -> (
        Captured,
        (tracing::subscriber::DefaultGuard, tracing::Dispatch),
    ) {
        let second = tracing::Dispatch::new(tracing::subscriber::NoSubscriber::default());
        let log = Captured::default();
        let writer = log.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        (log, (tracing::subscriber::set_default(subscriber), second))
    }
}

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A limiter that is down fails every request: the layer logs one line a
/// second, not one a request (which any client could turn into a flood).
#[tokio::test]
async fn a_failing_limiter_is_logged_once_a_second_not_per_request() {
    // A current-thread runtime: the requests run on this thread.
    let (log, _guard) = Captured::on_this_thread();
    let layer = RateLimitLayer::builder(failing(), GlobalKey::new(0))
        .failure_policy(FailurePolicy::FailOpen)
        .build()
        .unwrap();
    let app = router(layer);
    let started = std::time::Instant::now();
    for _ in 0..150 {
        let (response, _) = send(&app, Request::builder().uri("/")).await;
        assert_eq!(response.status(), StatusCode::OK);
    }
    let seconds = started.elapsed().as_millis().div_ceil(1000) as usize;
    let text = String::from_utf8_lossy(&log.0.lock().unwrap()).into_owned();
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("rate limiter failed"))
        .collect();
    // One line for the first failure, and at most one more per second
    // the requests took (far less than a second, unless the machine is
    // very busy).
    assert!(!lines.is_empty() && lines.len() <= 1 + seconds, "{text}");
    assert!(
        lines[0].contains("WARN") && lines[0].contains("connection refused"),
        "{text}"
    );
    assert!(lines[0].contains("failures_not_logged=0"), "{text}");
}

#[tokio::test]
async fn fail_closed_answers_503_without_a_retry_claim() {
    let app = router(RateLimitLayer::new(failing(), GlobalKey::new(0)));
    let (response, body) = send(&app, Request::builder().uri("/")).await;
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(body, "the rate limiter is unavailable; try again later\n");
    assert_eq!(header(&response, &RETRY_AFTER), None);
    assert_eq!(header(&response, &RATELIMIT), None);
}

/// `on_error` answers each of the layer's other errors with the page the
/// operator chose (a JSON API's, here), at the status it gives, while the
/// refusals keep theirs.
#[tokio::test]
async fn an_error_page_answers_no_key_an_unavailable_limiter_and_an_invalid_cost() {
    use ratewarden_tower::{LayerError, LayerErrorKind};
    let page = |e: &LayerError<'_>| {
        let kind = match e.kind {
            LayerErrorKind::NoKey => "no_key",
            LayerErrorKind::Unavailable => "unavailable",
            LayerErrorKind::InvalidCost => "invalid_cost",
            _ => "other",
        };
        let mut page = http::Response::new(Bytes::from(format!(
            r#"{{"error":{:?},"kind":"{kind}"}}"#,
            e.message
        )));
        *page.status_mut() = e.status;
        page.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
        page
    };
    let api_key = || HeaderKey::new(HeaderName::from_static("x-api-key"));
    let with_key = || Request::builder().uri("/").header("x-api-key", "k1");
    let json = |response: &Response<Body>| {
        header(response, &http::header::CONTENT_TYPE).map(str::to_owned)
    };

    let (limiter, _clock) = local(PolicyConfig::new(PolicyKind::FixedWindow, 1, 1000));
    let app = router(
        RateLimitLayer::builder(Arc::new(limiter), api_key())
            .on_error(page)
            .build()
            .unwrap(),
    );
    let (response, body) = send(&app, Request::builder().uri("/")).await;
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    assert_eq!(json(&response).as_deref(), Some("application/json"));
    assert!(body.contains(r#""kind":"no_key""#), "{body}");
    assert!(body.contains("x-api-key"), "{body}");
    // Refusals are not errors: the default refusal, with its headers.
    let (response, _) = send(&app, with_key()).await;
    assert_eq!(response.status(), StatusCode::OK);
    let (response, body) = send(&app, with_key()).await;
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(body.starts_with("rate limit exceeded"), "{body}");

    let app = router(
        RateLimitLayer::builder(failing(), api_key())
            .on_error(page)
            .build()
            .unwrap(),
    );
    let (response, body) = send(&app, with_key()).await;
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        body,
        r#"{"error":"the rate limiter is unavailable; try again later","kind":"unavailable"}"#
    );
    assert_eq!(header(&response, &RETRY_AFTER), None);

    let (limiter, _clock) = local(REFERENCE);
    let app = router(
        RateLimitLayer::builder(Arc::new(limiter), api_key())
            .cost(|_| ratewarden_core::MAX_SAFE + 1)
            .on_error(page)
            .build()
            .unwrap(),
    );
    let (response, body) = send(&app, with_key()).await;
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        body,
        r#"{"error":"internal server error","kind":"invalid_cost"}"#
    );
}

/// `skip_if` lets a request through untouched: no key is needed, nothing
/// is spent, no headers are added; the others are limited as before.
#[tokio::test]
async fn skipped_requests_pass_untouched_and_spend_nothing() {
    let (limiter, _clock) = local(PolicyConfig::new(PolicyKind::FixedWindow, 1, 1000));
    let api_key = HeaderKey::new(HeaderName::from_static("x-api-key"));
    let layer = RateLimitLayer::builder(Arc::new(limiter), api_key)
        .skip_if(|parts| parts.uri.path() == "/healthz")
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(echo_decision))
        .route("/healthz", get(|| async { "ok" }))
        .layer(layer);
    let with_key = |path: &str| Request::builder().uri(path).header("x-api-key", "k1");
    for _ in 0..3 {
        // No key, and again and again: never refused, nothing counted.
        let (response, body) = send(&app, Request::builder().uri("/healthz")).await;
        assert_eq!((response.status(), body.as_str()), (StatusCode::OK, "ok"));
        assert_eq!(header(&response, &RATELIMIT), None);
        assert_eq!(header(&response, &RATELIMIT_POLICY), None);
        let (response, _) = send(&app, with_key("/healthz")).await;
        assert_eq!(response.status(), StatusCode::OK);
    }
    // The key's one request is still there to spend.
    let (response, _) = send(&app, with_key("/")).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert!(header(&response, &RATELIMIT).is_some());
    let (response, _) = send(&app, with_key("/")).await;
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    let (response, _) = send(&app, Request::builder().uri("/")).await;
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    // Skipped even with the budget spent.
    let (response, _) = send(&app, with_key("/healthz")).await;
    assert_eq!(response.status(), StatusCode::OK);
}

/// docs/middleware.md's tiers: one layer per tier, each skipping the other
/// tier's requests, so each request meets exactly one tier's limit and
/// carries only its headers.
#[tokio::test]
async fn a_layer_per_tier_limits_each_request_by_its_own_tier() {
    fn is_paid(parts: &http::request::Parts) -> bool {
        parts.headers.contains_key("x-paid")
    }
    let tier = |limit, name: &str, skip: fn(&http::request::Parts) -> bool| {
        let (limiter, _clock) = local(PolicyConfig::new(PolicyKind::FixedWindow, limit, 1000));
        RateLimitLayer::builder(Arc::new(limiter), GlobalKey::new(0))
            .policy_name(name)
            .skip_if(skip)
            .build()
            .unwrap()
    };
    let app = Router::new()
        .route("/", get(echo_decision))
        .layer(tier(3, "paid", |parts| !is_paid(parts)))
        .layer(tier(1, "free", is_paid));
    let free = || Request::builder().uri("/");
    let paid = || Request::builder().uri("/").header("x-paid", "1");
    let (response, _) = send(&app, free()).await;
    assert_eq!(header(&response, &RATELIMIT), Some("\"free\";r=0"));
    let (response, _) = send(&app, free()).await;
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    for left in [2, 1, 0] {
        let (response, _) = send(&app, paid()).await;
        assert_eq!(response.status(), StatusCode::OK);
        let expected = format!("\"paid\";r={left}");
        assert_eq!(header(&response, &RATELIMIT), Some(expected.as_str()));
    }
    let (response, _) = send(&app, paid()).await;
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
}

/// A key whose state the store cannot read fails on every request until
/// someone deletes it: failing open would lift its limit for good, so the
/// layer refuses it as it would fail closed (as `ratewarden serve` does).
#[tokio::test]
async fn corrupt_state_is_refused_even_when_failing_open() {
    let corrupt = Arc::new(Failing(REFERENCE, StoreErrorKind::CorruptState));
    let open = RateLimitLayer::builder(corrupt.clone(), GlobalKey::new(0))
        .failure_policy(FailurePolicy::FailOpen)
        .build()
        .unwrap();
    let (response, body) = send(&router(open), Request::builder().uri("/")).await;
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(body, "the rate limiter is unavailable; try again later\n");
    assert_eq!(header(&response, &RETRY_AFTER), None);
    // The local fallback still decides: it holds state of its own.
    let (fallback, _clock) = local(REFERENCE);
    let local = RateLimitLayer::builder(corrupt, GlobalKey::new(0))
        .failure_policy(FailurePolicy::Local)
        .local_fallback(fallback)
        .build()
        .unwrap();
    let (response, _) = send(&router(local), Request::builder().uri("/")).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(header(&response, &RATELIMIT), Some("\"default\";r=99"));
}

/// A new key at a full in-memory store is a failure like any other: failing
/// open admits it, without headers (there was no decision), and failing
/// closed answers 503. The keys already held keep their limits.
#[tokio::test]
async fn a_new_key_at_a_full_store_gets_the_failure_policy() {
    for (policy, status) in [
        (FailurePolicy::FailOpen, StatusCode::OK),
        (FailurePolicy::FailClosed, StatusCode::SERVICE_UNAVAILABLE),
    ] {
        let config = PolicyConfig::new(PolicyKind::FixedWindow, 1, 60_000);
        let options = ratewarden_core::MemoryOptions {
            max_keys: 2,
            shards: 1,
        };
        let full = LocalLimiter::with_clock(config, options, ManualClock::new(0)).unwrap();
        let key = HeaderKey::new(HeaderName::from_static("x-api-key"));
        let layer = RateLimitLayer::builder(Arc::new(full), key)
            .failure_policy(policy)
            .build()
            .unwrap();
        let app = router(layer);
        let with_key = |key: &str| Request::builder().uri("/").header("x-api-key", key);
        for key in ["a", "b"] {
            let (response, _) = send(&app, with_key(key)).await;
            assert_eq!(response.status(), StatusCode::OK, "{policy} {key}");
        }
        for key in ["c", "d", "c"] {
            let (response, _) = send(&app, with_key(key)).await;
            assert_eq!(response.status(), status, "{policy} {key}");
            assert_eq!(header(&response, &RATELIMIT), None, "{policy} {key}");
        }
        let (response, _) = send(&app, with_key("a")).await;
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS, "{policy}");
    }
}

/// No budget ever admits a cost above the policy's capacity, which needs
/// no store to know: refused with no wait whatever the failure policy.
#[tokio::test]
async fn a_cost_above_the_capacity_is_refused_while_the_store_fails() {
    for policy in [
        FailurePolicy::FailOpen,
        FailurePolicy::FailClosed,
        FailurePolicy::Local,
    ] {
        let mut builder = RateLimitLayer::builder(failing(), GlobalKey::new(0))
            .cost(|_| REFERENCE.capacity() + 1)
            .failure_policy(policy);
        if policy == FailurePolicy::Local {
            builder = builder.local_fallback(local(REFERENCE).0);
        }
        let (response, body) = send(
            &router(builder.build().unwrap()),
            Request::builder().uri("/"),
        )
        .await;
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS, "{policy}");
        assert_eq!(header(&response, &RETRY_AFTER), None, "{policy}");
        assert_eq!(
            header(&response, &RATELIMIT),
            Some("\"default\";r=0"),
            "{policy}"
        );
        assert!(body.contains("above what"), "{policy}: {body}");
    }
}

#[tokio::test]
async fn fail_local_decides_on_the_in_memory_fallback() {
    let config = PolicyConfig::new(PolicyKind::FixedWindow, 3, 1000);
    let (fallback, clock) = local(config);
    let layer = RateLimitLayer::builder(
        Arc::new(Failing(config, StoreErrorKind::Timeout)),
        PeerIp::new(),
    )
    .failure_policy(FailurePolicy::Local)
    .local_fallback(fallback)
    .build()
    .unwrap();
    let app = router(layer);
    assert_eq!(admitted(&app, || get_from("192.0.2.1:1"), 5).await, 3);
    assert_eq!(admitted(&app, || get_from("192.0.2.2:1"), 5).await, 3);
    let (response, _) = send(&app, get_from("192.0.2.1:1")).await;
    assert_eq!(header(&response, &RATELIMIT), Some("\"default\";r=0;t=1"));
    clock.advance_ms(1000);
    assert_eq!(admitted(&app, || get_from("192.0.2.1:1"), 5).await, 3);
}

/// Under `Local`, a fallback that fails is answered by how it failed: a
/// full fallback is unavailable (503, as failing closed), and a fallback
/// that can decide nothing (its clock past 2^53 - 1 ms, which every store
/// refuses as invalid input) is a server error, as the limiter's own
/// invalid input is.
#[tokio::test]
async fn a_failing_local_fallback_is_answered_by_how_it_failed() {
    let config = PolicyConfig::new(PolicyKind::FixedWindow, 3, 1000);
    let with_fallback = |fallback: LocalLimiter| {
        let down = Arc::new(Failing(config, StoreErrorKind::ConnectionDropped));
        let key = HeaderKey::new(HeaderName::from_static("x-api-key"));
        router(
            RateLimitLayer::builder(down, key)
                .failure_policy(FailurePolicy::Local)
                .local_fallback(fallback)
                .build()
                .unwrap(),
        )
    };
    let with_key = |key: &str| Request::builder().uri("/").header("x-api-key", key);
    let options = ratewarden_core::MemoryOptions {
        max_keys: 1,
        shards: 1,
    };
    let full =
        with_fallback(LocalLimiter::with_clock(config, options, ManualClock::new(0)).unwrap());
    let (response, _) = send(&full, with_key("a")).await;
    assert_eq!(response.status(), StatusCode::OK);
    let (response, body) = send(&full, with_key("b")).await;
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(body, "the rate limiter is unavailable; try again later\n");
    let past = ManualClock::new(ratewarden_core::MAX_SAFE + 1);
    let broken = with_fallback(LocalLimiter::with_clock(config, Default::default(), past).unwrap());
    let (response, body) = send(&broken, with_key("a")).await;
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(body, "internal server error\n");
}

/// A store that fails every other call, and decides the others.
struct Flapping(LocalLimiter, AtomicUsize);

impl Limiter for Flapping {
    fn config(&self) -> &PolicyConfig {
        self.0.config()
    }

    fn check(&self, key: u64, cost: u64) -> BoxFuture<'_, Result<Decision, StoreError>> {
        if self.1.fetch_add(1, Ordering::SeqCst) % 2 == 1 {
            Box::pin(std::future::ready(Err(StoreError::new(
                StoreErrorKind::Timeout,
                "timed out",
            ))))
        } else {
            self.0.check(key, cost)
        }
    }
}

/// What docs/middleware.md states: the store and the local fallback count
/// apart, so while failures alternate one process admits about twice the
/// limit.
#[tokio::test]
async fn fail_local_with_an_intermittent_store_counts_twice() {
    let config = PolicyConfig::new(PolicyKind::FixedWindow, 3, 60_000);
    let (store, _clock) = local(config);
    let (fallback, _clock) = local(config);
    let layer = RateLimitLayer::builder(
        Arc::new(Flapping(store, AtomicUsize::new(0))),
        GlobalKey::new(0),
    )
    .failure_policy(FailurePolicy::Local)
    .local_fallback(fallback)
    .build()
    .unwrap();
    let app = router(layer);
    assert_eq!(admitted(&app, || Request::builder().uri("/"), 20).await, 6);
}

#[tokio::test]
async fn a_limiter_that_does_not_answer_times_out_into_the_failure_policy() {
    let closed = RateLimitLayer::builder(Arc::new(Pending(REFERENCE)), GlobalKey::new(0))
        .check_timeout(Duration::from_millis(20))
        .build()
        .unwrap();
    let (response, _) = send(&router(closed), Request::builder().uri("/")).await;
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    let open = RateLimitLayer::builder(Arc::new(Pending(REFERENCE)), GlobalKey::new(0))
        .check_timeout(Duration::from_millis(20))
        .failure_policy(FailurePolicy::FailOpen)
        .build()
        .unwrap();
    let (response, body) = send(&router(open), Request::builder().uri("/")).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(body, "undecided");
}

#[tokio::test]
async fn invalid_cost_is_a_server_error_under_every_failure_policy() {
    for policy in [
        FailurePolicy::FailOpen,
        FailurePolicy::FailClosed,
        FailurePolicy::Local,
    ] {
        let (limiter, _clock) = local(REFERENCE);
        // Also from a limiter of a user's own that fails before it looks
        // at the cost: no failure policy makes the cost decidable.
        let limiters: [Arc<dyn Limiter>; 2] = [Arc::new(limiter), failing()];
        for limiter in limiters {
            let layer = RateLimitLayer::builder(limiter, GlobalKey::new(0))
                .cost(|_| u64::MAX)
                .failure_policy(policy)
                .build()
                .unwrap();
            let (response, body) = send(&router(layer), Request::builder().uri("/")).await;
            assert_eq!(
                response.status(),
                StatusCode::INTERNAL_SERVER_ERROR,
                "{policy}"
            );
            // The cost and the store's limits are logged, not sent.
            assert_eq!(body, "internal server error\n");
        }
    }
}

#[tokio::test]
async fn nested_layers_each_report_their_own_policy() {
    let (per_ip, _clock) = local(PolicyConfig::new(PolicyKind::FixedWindow, 2, 1000));
    let (global, _clock) = local(PolicyConfig::new(PolicyKind::FixedWindow, 3, 60_000));
    let per_ip = RateLimitLayer::builder(Arc::new(per_ip), PeerIp::new())
        .policy_name("per-ip")
        .build()
        .unwrap();
    let global = RateLimitLayer::builder(Arc::new(global), GlobalKey::new(0))
        .policy_name("global")
        .build()
        .unwrap();
    // The global limit runs first, then the per-client one.
    let app = Router::new()
        .route("/", get(echo_decision))
        .layer(per_ip)
        .layer(global);
    let (response, _) = send(&app, get_from("192.0.2.1:1")).await;
    let all = |response: &http::Response<_>, name: http::HeaderName| -> Vec<String> {
        let values = response.headers().get_all(name).iter();
        values.map(|v| v.to_str().unwrap().to_owned()).collect()
    };
    let policies = ["\"per-ip\";q=2;w=1", "\"global\";q=3;w=60"];
    assert_eq!(
        all(&response, RATELIMIT),
        ["\"per-ip\";r=1", "\"global\";r=2"]
    );
    assert_eq!(all(&response, RATELIMIT_POLICY), policies);
    send(&app, get_from("192.0.2.1:1")).await;
    // Refused per client: the global budget was spent by the admitted
    // request, and the refusal carries both policies' counts.
    let (response, _) = send(&app, get_from("192.0.2.1:1")).await;
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        all(&response, RATELIMIT),
        ["\"per-ip\";r=0;t=1", "\"global\";r=0"]
    );
    assert_eq!(all(&response, RATELIMIT_POLICY), policies);
    // The global budget is spent: another client is refused by it.
    let (response, _) = send(&app, get_from("192.0.2.2:1")).await;
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&response, &RATELIMIT), Some("\"global\";r=0;t=60"));
    assert_eq!(
        header(&response, &RATELIMIT_POLICY),
        Some("\"global\";q=3;w=60")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_through_clones_admit_exactly_the_limit() {
    let (limiter, _clock) = local(REFERENCE);
    let app = router(RateLimitLayer::new(Arc::new(limiter), GlobalKey::new(0)));
    let tasks: Vec<_> = (0..300)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move {
                let response = app.oneshot(Request::new(Body::empty())).await.unwrap();
                response.status()
            })
        })
        .collect();
    let mut ok = 0;
    for task in tasks {
        let status = tokio::time::timeout(Duration::from_secs(20), task)
            .await
            .expect("a request took too long")
            .unwrap();
        ok += usize::from(status == StatusCode::OK);
    }
    assert_eq!(ok, 100);
}

#[tokio::test]
async fn any_response_body_made_from_bytes_works() {
    // A plain tower service with http-body-util's Full body, no axum.
    type Full = http_body_util::Full<Bytes>;
    let config = PolicyConfig::new(PolicyKind::FixedWindow, 1, 1000);
    let (limiter, _clock) = local(config);
    let service = RateLimitLayer::new(Arc::new(limiter), GlobalKey::new(0)).layer(
        tower::service_fn(|_req: http::Request<()>| async {
            Ok::<_, std::convert::Infallible>(http::Response::new(Full::from("ok")))
        }),
    );
    let admitted = service
        .clone()
        .oneshot(http::Request::new(()))
        .await
        .unwrap();
    assert_eq!(admitted.status(), StatusCode::OK);
    let refused = service.oneshot(http::Request::new(())).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    let body = refused.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"rate limit exceeded; retry in 1 s\n");
}

/// Two nested layers of one policy name write items a client cannot tell
/// apart: the outer one says so in the log (once a minute, not per
/// request); layers named apart say nothing.
#[tokio::test]
async fn nested_layers_of_one_name_are_logged() {
    // A current-thread runtime: the requests run on this thread.
    let (log, _guard) = Captured::on_this_thread();
    let layer = |name: &str| {
        let (limiter, _) = local(PolicyConfig::new(PolicyKind::FixedWindow, 100, 1000));
        RateLimitLayer::builder(Arc::new(limiter), GlobalKey::new(0))
            .policy_name(name)
            .build()
            .unwrap()
    };
    let warned = || {
        String::from_utf8_lossy(&log.0.lock().unwrap())
            .lines()
            .filter(|l| l.contains("use one policy name"))
            .count()
    };
    let apart = router(layer("per-client")).layer(layer("global"));
    for _ in 0..3 {
        let (response, _) = send(&apart, Request::builder().uri("/")).await;
        assert_eq!(response.status(), StatusCode::OK);
    }
    assert_eq!(warned(), 0);
    let same = router(layer("default")).layer(layer("default"));
    for _ in 0..3 {
        let (response, _) = send(&same, Request::builder().uri("/")).await;
        assert_eq!(response.status(), StatusCode::OK);
    }
    assert_eq!(warned(), 1);
}

/// docs/middleware.md, "Separate budgets per route": the limiter keeps
/// budgets apart, never the policy name. Two limiters are two budgets; one
/// limiter given to two layers is one budget, whatever the layers' names.
#[tokio::test]
async fn routes_share_a_budget_only_through_one_limiter() {
    let config = PolicyConfig::new(PolicyKind::FixedWindow, 3, 10_000);
    let app = |login: Arc<dyn Limiter>, api: Arc<dyn Limiter>| {
        let layer = |limiter, name| {
            RateLimitLayer::builder(limiter, PeerIp::new())
                .policy_name(name)
                .build()
                .unwrap()
        };
        Router::new()
            .route("/login", get(echo_decision).layer(layer(login, "login")))
            .route("/api", get(echo_decision).layer(layer(api, "api")))
    };
    let spend_login_then_call_api = |app: Router| async move {
        for _ in 0..3 {
            let (response, _) = send(&app, get_from("192.0.2.1:1").uri("/login")).await;
            assert_eq!(response.status(), StatusCode::OK);
        }
        let (response, _) = send(&app, get_from("192.0.2.1:1").uri("/login")).await;
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        let (response, _) = send(&app, get_from("192.0.2.1:1").uri("/api")).await;
        response.status()
    };
    let (login, _clock) = local(config);
    let (api, _clock) = local(config);
    let apart = app(Arc::new(login), Arc::new(api));
    assert_eq!(spend_login_then_call_api(apart).await, StatusCode::OK);
    let (shared, _clock) = local(config);
    let shared: Arc<dyn Limiter> = Arc::new(shared);
    let together = app(shared.clone(), shared);
    assert_eq!(
        spend_login_then_call_api(together).await,
        StatusCode::TOO_MANY_REQUESTS
    );
}
