//! The Rust examples of docs/middleware.md and docs/redis.md, compiled with
//! the suite. The pages show excerpts; each is written out here, line for
//! line, inside the context the page leaves out (imports, the enclosing
//! function, the helpers it names), and the tests run those that need no
//! server. The first test checks that every `rust` block of the pages
//! appears here as written, so an edit to a page that is not made here too
//! fails, and one made here compiles or fails the build.
//!
//! Blocks are compared line by line with leading and trailing spaces
//! trimmed; `#[rustfmt::skip]` keeps each block's lines as the page has
//! them.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::routing::get;
use axum::Router;
use pulldown_cmark::{CodeBlockKind, Event, Parser, Tag, TagEnd};
use ratewarden_core::{Limiter, LocalLimiter, ManualClock, REFERENCE};
use ratewarden_tower::key::{ExtensionKey, PeerIp, RequestKey};
use ratewarden_tower::RateLimitLayer;
use tokio::net::TcpListener;
use tower::ServiceExt;

type Error = Box<dyn std::error::Error + Send + Sync>;

/// The `rust` blocks of `markdown` (info string `rust`, or `rust,` and
/// attributes such as `ignore`, which are compiled here all the same):
/// each one's first line number (its opening fence's) and its lines. A
/// CommonMark parser finds them, so fences of every form count, and a
/// fence shown inside another block opens nothing.
fn rust_blocks(markdown: &str) -> Vec<(usize, Vec<String>)> {
    let mut blocks = Vec::new();
    // The open rust block's line and text.
    let mut open: Option<(usize, String)> = None;
    for (event, at) in Parser::new(markdown).into_offset_iter() {
        match event {
            Event::Start(Tag::CodeBlock(CodeBlockKind::Fenced(info)))
                if info.split(',').next() == Some("rust") =>
            {
                let line = markdown[..at.start].matches('\n').count() + 1;
                open = Some((line, String::new()));
            }
            Event::Text(text) => {
                if let Some((_, body)) = &mut open {
                    body.push_str(&text);
                }
            }
            Event::End(TagEnd::CodeBlock) => {
                if let Some((line, body)) = open.take() {
                    assert!(!body.is_empty(), "an empty rust block at line {line}");
                    blocks.push((line, body.lines().map(str::to_owned).collect()));
                }
            }
            _ => {}
        }
    }
    blocks
}

#[test]
fn every_rust_block_of_the_pages_is_compiled_here() {
    let here: Vec<&str> = include_str!("doc_examples.rs")
        .lines()
        .map(str::trim)
        .collect();
    let pages = [
        (
            "docs/middleware.md",
            include_str!("../../../docs/middleware.md"),
            6,
        ),
        ("docs/redis.md", include_str!("../../../docs/redis.md"), 2),
    ];
    for (page, markdown, expected) in pages {
        let blocks = rust_blocks(markdown);
        // A block the parser missed would be checked by nothing.
        assert_eq!(blocks.len(), expected, "{page}: rust blocks found");
        for (line, block) in blocks {
            let block: Vec<&str> = block.iter().map(|l| l.trim()).collect();
            assert!(
                here.windows(block.len()).any(|w| w == block.as_slice()),
                "{page}, the block from line {line}: not in crates/tower/tests/doc_examples.rs \
                 as the page has it; write it there, inside the context it needs, so that it \
                 compiles"
            );
        }
    }
}

fn owned(lines: &[&str]) -> Vec<String> {
    lines.iter().map(|l| l.to_string()).collect()
}

#[test]
fn the_block_checker_finds_blocks_and_their_lines() {
    // Fences of other kinds, and a rust fence shown inside another block.
    let markdown =
        "````markdown\n```rust\nnot code\n```\n````\n~~~rust,ignore\ny\n~~~\n```sh\n```rust\n```\n";
    assert_eq!(rust_blocks(markdown), [(6, owned(&["y"]))]);
    let markdown =
        "text\n```rust\nlet a = 1;\n\n  let b = 2;\n```\n```sh\nls\n```\n```rust\nx\n```\n";
    assert_eq!(
        rust_blocks(markdown),
        [
            (2, owned(&["let a = 1;", "", "  let b = 2;"])),
            (10, owned(&["x"]))
        ]
    );
}

// docs/middleware.md, "The example, step by step": compiled, not run (it
// serves until the process ends).

async fn hello() -> &'static str {
    "hello"
}

#[allow(dead_code)]
#[rustfmt::skip]
async fn the_example_step_by_step(listener: TcpListener) -> Result<(), Error> {
pub fn app(limiter: Arc<dyn Limiter>) -> Router {
    Router::new().route("/", get(hello)).layer(RateLimitLayer::new(limiter, PeerIp::new()))
}

let limiter = LocalLimiter::new(REFERENCE, Default::default())?;
axum::serve(listener, app(Arc::new(limiter)).into_make_service_with_connect_info::<SocketAddr>())
    .await?;
    Ok(())
}

// docs/middleware.md, "Building a layer": built, then a POST (cost 5)
// spends a fifth of the burst of 20, and the refusal is the page's JSON.

// The page writes a closure where the function alone would do, to show
// the argument a closure gets.
#[allow(clippy::redundant_closure)]
#[rustfmt::skip]
fn building_a_layer() -> Result<RateLimitLayer, Error> {
use std::sync::Arc;
use std::time::Duration;
use axum::body::Bytes;
// or the `http` crate's, with `http` as a direct dependency:
use axum::http::{header::CONTENT_TYPE, HeaderValue, Method, Response, StatusCode};
use ratewarden_core::{FailurePolicy, KeyHash, LocalLimiter, PolicyConfig, PolicyKind};
use ratewarden_tower::{key::PeerIp, RateLimitLayer, Refusal};

// A JSON refusal; the layer adds Retry-After and the RateLimit fields to it.
fn my_429_page(refusal: &Refusal<'_>) -> Response<Bytes> {
    let body = match refusal.retry_after_secs() {
        Some(secs) => format!(r#"{{"error":"rate limited","retry_after":{secs}}}"#),
        None => r#"{"error":"rate limited"}"#.to_owned(), // no wait would admit it
    };
    let mut page = Response::new(Bytes::from(body));
    *page.status_mut() = StatusCode::TOO_MANY_REQUESTS;
    page.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    page
}

let config = PolicyConfig::new(PolicyKind::TokenBucket, 10, 1000).with_burst(20);
let limiter = Arc::new(LocalLimiter::new(config, Default::default())?);
let layer = RateLimitLayer::builder(limiter, PeerIp::new())
    .cost(|parts| if parts.method == Method::POST { 5 } else { 1 })
    .key_hash(KeyHash::Xxh3_64)              // the default; Mix32 to share counts with SPEC's hash
    .failure_policy(FailurePolicy::FailOpen) // default: FailClosed
    .check_timeout(Duration::from_millis(50))// default: 1000 ms
    .policy_name("api")                      // default: "default"
    .on_refused(|refusal| my_429_page(refusal))
    .build()?;
    Ok(layer)
}

#[tokio::test]
async fn the_built_layer_charges_posts_five_and_answers_with_its_page() {
    let app = Router::new()
        .route("/", get(hello).post(hello))
        .layer(building_a_layer().unwrap());
    let post = || {
        let mut request = Request::post("/").body(Body::empty()).unwrap();
        let peer: SocketAddr = "192.0.2.1:4000".parse().unwrap();
        request
            .extensions_mut()
            .insert(axum::extract::ConnectInfo(peer));
        request
    };
    // A burst of 20 holds four requests of cost 5, within the same second.
    for _ in 0..4 {
        let response = app.clone().oneshot(post()).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
    }
    let response = app.clone().oneshot(post()).await.unwrap();
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(response.headers().contains_key("retry-after"));
    assert_eq!(response.headers()["content-type"], "application/json");
    let body = axum::body::to_bytes(response.into_body(), 1024)
        .await
        .unwrap();
    assert_eq!(body, r#"{"error":"rate limited","retry_after":1}"#);
}

// docs/middleware.md, "Building a layer", `on_error`: a request with no
// key is answered with the JSON page.

#[rustfmt::skip]
fn error_page_layer(
    limiter: Arc<dyn Limiter>,
    key: ratewarden_tower::key::HeaderKey,
) -> Result<RateLimitLayer, Error> {
    use axum::body::Bytes;
    use axum::http::{header::CONTENT_TYPE, HeaderValue, Response};
    use ratewarden_tower::LayerError;
let layer = RateLimitLayer::builder(limiter, key)
    .on_error(|e: &LayerError<'_>| {
        let mut page = Response::new(Bytes::from(format!(r#"{{"error":{:?}}}"#, e.message)));
        *page.status_mut() = e.status;
        page.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        page
    })
    .build()?;
    Ok(layer)
}

#[tokio::test]
async fn the_error_page_answers_a_request_with_no_key() {
    let limiter = Arc::new(LocalLimiter::new(REFERENCE, Default::default()).unwrap());
    let key =
        ratewarden_tower::key::HeaderKey::new(axum::http::HeaderName::from_static("x-api-key"));
    let app = Router::new()
        .route("/", get(hello))
        .layer(error_page_layer(limiter, key).unwrap());
    let response = app.oneshot(Request::new(Body::empty())).await.unwrap();
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    assert_eq!(response.headers()["content-type"], "application/json");
    let body = axum::body::to_bytes(response.into_body(), 1024)
        .await
        .unwrap();
    let body = String::from_utf8(body.to_vec()).unwrap();
    assert!(
        body.starts_with(r#"{"error":""#) && body.contains("x-api-key"),
        "{body}"
    );
}

// docs/middleware.md, the layer order for an `ExtensionKey`: each user
// has a budget of their own.

#[derive(Clone)]
struct User(String);

async fn authenticate(mut request: Request, next: Next) -> axum::response::Response {
    let user = request
        .headers()
        .get("x-user")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("anonymous")
        .to_owned();
    request.extensions_mut().insert(User(user));
    next.run(request).await
}

async fn handler() -> &'static str {
    "hello"
}

// The page's block ends in `;`, so the router is returned by a `return`
// on the line before it.
#[allow(clippy::needless_return)]
#[rustfmt::skip]
fn extension_key_order(limiter: Arc<dyn Limiter>) -> Router {
    let rate_limit = RateLimitLayer::new(
        limiter,
        ExtensionKey::new(|user: &User| RequestKey::from(user.0.clone())),
    );
    return
Router::new()
    .route("/", get(handler))
    .layer(rate_limit)                         // runs second: sees the User
    .layer(middleware::from_fn(authenticate)); // runs first: inserts the User
}

#[tokio::test]
async fn the_user_is_inserted_before_the_rate_limit_reads_it() {
    let config =
        ratewarden_core::PolicyConfig::new(ratewarden_core::PolicyKind::FixedWindow, 1, 60_000);
    // On a clock of the test's own, which does not move: on the real one a
    // window edge between Ada's two requests would admit both.
    let app = extension_key_order(Arc::new(
        LocalLimiter::with_clock(config, Default::default(), ManualClock::new(0)).unwrap(),
    ));
    let get_as = |user: &str| {
        Request::get("/")
            .header("x-user", user)
            .body(Body::empty())
            .unwrap()
    };
    let first = app.clone().oneshot(get_as("ada")).await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    // Ada has spent her one request; Grace has her own.
    let again = app.clone().oneshot(get_as("ada")).await.unwrap();
    assert_eq!(again.status(), StatusCode::TOO_MANY_REQUESTS);
    let other = app.clone().oneshot(get_as("grace")).await.unwrap();
    assert_eq!(other.status(), StatusCode::OK);
}

// docs/middleware.md, "Separate budgets per route": compiled, not run (it
// needs a Redis at 6379; the Redis key layout it relies on is tested in
// crates/redis/tests).

async fn log_in() -> &'static str {
    "welcome"
}

async fn list() -> &'static str {
    "[]"
}

#[allow(dead_code)]
#[rustfmt::skip]
async fn separate_budgets_on_one_redis() -> Result<Router, Error> {
    use axum::routing::post;
    use ratewarden_core::{PolicyConfig, PolicyKind};
    use ratewarden_redis::{RedisOptions, RedisStore};
let config = PolicyConfig::new(PolicyKind::FixedWindow, 3, 10_000);
// Keys under `login:` rather than the default `ratewarden:`:
let options = RedisOptions { prefix: "login".into(), ..RedisOptions::default() };
let login = RedisStore::connect("redis://127.0.0.1:6379", config, options).await?;
// Keys under `api:`, on the same connection:
let api = login.with_config(config, "api").await?;
let app = Router::new()
    .route("/login", post(log_in).layer(RateLimitLayer::new(Arc::new(login), PeerIp::new())))
    .route("/api", get(list).layer(RateLimitLayer::new(Arc::new(api), PeerIp::new())));
    Ok(app)
}

// docs/middleware.md, "Proxies and X-Forwarded-For": the ranges parse.

// The page shows two alternatives in one block: the first key is unused.
#[test]
#[allow(unused_variables)]
#[rustfmt::skip]
fn trusted_proxies() -> Result<(), Error> {
let key = PeerIp::new().trust_x_forwarded_for(["10.0.0.0/8".parse()?, "fd00::/8".parse()?]);
// or, for proxies that write RFC 7239:
let key = PeerIp::new().trust_forwarded(["10.0.0.0/8".parse()?]);
    drop(key);
    Ok(())
}

// docs/redis.md, the Redis store as a library: compiled, not run (it
// needs a Redis at 6379; crates/redis/tests run the same calls against
// servers they start).

// The page shows two ways to decide in one block: the first decision is
// unused.
#[allow(dead_code, unused_variables)]
#[rustfmt::skip]
async fn redis_store_as_a_library() -> Result<(), Box<dyn std::error::Error>> {
use ratewarden_core::{FailurePolicy, Limiter, PolicyConfig, PolicyKind};
use ratewarden_redis::{RedisLimiter, RedisOptions, RedisStore, RedisTime};

// Inside an async function returning Result<_, Box<dyn Error>>:
let config = PolicyConfig::new(PolicyKind::SlidingWindowCounter, 100, 1000);
let store = RedisStore::connect("redis://127.0.0.1:6379", config, RedisOptions::default()).await?;

// One request, by Redis's clock:
let decision = store.decide(42, None, 1).await?;

// Many requests in one round trip (pipelined EVALSHAs, at most 10,000;
// on a cluster the keys go out at once, each key's requests in turn).
// timeout_ms bounds the whole batch: give batches of thousands a store
// with a timeout of their own (10,000 took about 125 ms on a quiet 2-core
// machine, 325 ms on a loaded one). On a cluster a request its master did
// not answer in time fails alone (with the key's later requests in the
// batch, which are then not sent).
let decisions = store.decide_many(&[(1, 1), (2, 1), (1, 3)], None).await?;

// Whether Redis can decide now, within timeout_ms, deciding on no
// limiter's key (PING and a decision on a key of its own; on a cluster,
// every slot's master asked, and a decision in each): for readiness checks.
store.ping().await?;

// Another limit on the same connection (one per limit would mean a
// connection each), its keys under a prefix of its own:
let uploads = store
    .with_config(PolicyConfig::new(PolicyKind::TokenBucket, 10, 60_000), "uploads")
    .await?;

// Behind the core's Limiter trait, with a failure policy:
let limiter = RedisLimiter::new(store, RedisTime::Server, FailurePolicy::Local, Default::default())?;
let decision = limiter.check(42, 1).await?;
    drop((decision, decisions, uploads));
    Ok(())
}

// docs/redis.md, "TLS": compiled, not run (crates/redis/tests/tls.rs makes
// the same connection to a server it starts).
#[allow(dead_code)]
#[rustfmt::skip]
async fn redis_store_over_tls() -> Result<(), Box<dyn std::error::Error>> {
    use ratewarden_redis::{RedisOptions, RedisStore};
    let config = REFERENCE;
let options = RedisOptions {
    tls_ca_file: Some("redis-ca.crt".into()),
    tls_cert_file: Some("client.crt".into()),
    tls_key_file: Some("client.key".into()),
    ..RedisOptions::default()
};
let store = RedisStore::connect("rediss://redis.internal:6380", config, options).await?;
    drop(store);
    Ok(())
}
