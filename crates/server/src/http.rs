//! The HTTP JSON interface: `POST /v1/check`, `GET /healthz`, `GET /readyz`,
//! `GET /metrics` (on a port of its own when `--metrics` gives one).

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, FromRef, FromRequest, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode, Uri, Version};
use axum::middleware::{from_fn_with_state, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use ratewarden_core::{StoreErrorKind, MAX_SAFE};
// The middleware's header rules, so that both say a wait alike.
use ratewarden_tower::headers::{advertised_remaining, header_wait_secs, quota, window_secs};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};
use tokio_io_timeout::TimeoutStream;

use crate::conn::Acceptor;
use crate::metrics::Api;
use crate::rules::LimitOverride;
use crate::service::{unanswered, BadRequest, DescriptorOutcome, DescriptorRequest, Service};

/// The longest a client may take to send a request's headers (and the
/// longest an idle keep-alive connection is kept), so connections that
/// send nothing cannot pile up.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// The longest an answer's write may wait on a client that does not read
/// it (the time between two writes that make progress, as nginx's
/// `send_timeout`): then the connection is closed.
pub const WRITE_STALL_TIMEOUT: Duration = Duration::from_secs(10);

/// Each HTTP connection's socket send buffer, in bytes, as asked of the
/// kernel. Linux doubles it (for its bookkeeping) and wakes a blocked
/// write once about a third of that has drained, so a client that reads
/// about 85 KB per [`WRITE_STALL_TIMEOUT`] (some 10 KB/s) or more is never
/// cut. Answers are small but for `/metrics`.
pub const SEND_BUFFER_BYTES: usize = 128 * 1024;

/// Serves `app` on the connections `acceptor` admits until `stop` turns
/// true, then stops accepting and lets every open connection finish the
/// request it is on.
pub async fn serve(
    mut acceptor: Acceptor,
    app: Router,
    mut stop: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    // Each connection task holds a sender; when all are gone, every
    // connection has finished.
    let (open_tx, mut open_rx) = mpsc::channel::<()>(1);
    loop {
        let (stream, permit) = tokio::select! {
            accepted = acceptor.accept() => accepted,
            _ = stop.wait_for(|s| *s) => break,
        };
        let service = TowerToHyperService::new(app.clone());
        let mut conn_stop = stop.clone();
        let open = open_tx.clone();
        let metrics = Arc::clone(acceptor.metrics());
        let api = acceptor.api();
        tokio::spawn(async move {
            let _open = open;
            let _permit = permit;
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT);
            // A bounded send buffer: a blocked write is woken once about a
            // third of the buffer has drained, so with the kernel's own
            // (auto-tuned up to 4 MiB) a client reading steadily, but below
            // about 130 KB/s, let no write progress for 10 s and was cut.
            // It also bounds the kernel memory each connection holds.
            let _ = socket2::SockRef::from(&stream).set_send_buffer_size(SEND_BUFFER_BYTES);
            // A client that stops reading would otherwise stall an
            // answer's write, and so hold its connection (and delay a
            // shutdown), for as long as it likes.
            let mut stream = TimeoutStream::new(stream);
            stream.set_write_timeout(Some(WRITE_STALL_TIMEOUT));
            let conn = builder.serve_connection(TokioIo::new(Box::pin(stream)), service);
            tokio::pin!(conn);
            let stopping = tokio::select! {
                served = conn.as_mut() => {
                    // A request the HTTP layer could not read (a garbled
                    // request line, a bad Content-Length, a URI or headers
                    // too large) is answered by hyper with a bare 400, 414
                    // or 431 before the router sees it: counted here with
                    // the router's own bad requests.
                    if let Err(e) = served {
                        if e.is_parse() || e.is_parse_too_large() {
                            metrics.bad_request(api);
                            tracing::debug!("unreadable HTTP request: {e}");
                        }
                    }
                    false
                }
                _ = conn_stop.wait_for(|s| *s) => true,
            };
            if stopping {
                conn.as_mut().graceful_shutdown();
                let _ = conn.await;
            }
        });
    }
    // Closed now, so that a client connecting during shutdown is refused at
    // once instead of waiting on a backlog nobody accepts from.
    acceptor.close();
    drop(open_tx);
    let _ = open_rx.recv().await;
    Ok(())
}

/// The longest a client may take to send a request's body, once its
/// headers are in: a body that trickles in would otherwise hold its
/// connection (and delay shutdown) for as long as the client likes.
pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// The largest request body read, in bytes.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// Which of the server's HTTP ports a router serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Port {
    /// `--http`: checks, health, and `/metrics` unless `metrics_elsewhere`.
    Check {
        /// Whether `/metrics` has a port of its own (`--metrics`).
        metrics_elsewhere: bool,
    },
    /// `--metrics`: `/metrics` and health, no checks, so that the
    /// operator's port can be kept from the clients'.
    Metrics,
}

impl Port {
    /// The interface its connections and bad requests are counted under.
    pub fn api(self) -> Api {
        match self {
            Port::Check { .. } => Api::Http,
            Port::Metrics => Api::Metrics,
        }
    }

    /// Its endpoints, for the errors that send a client to the right one
    /// (a bare 404 leaves a client guessing at a typo).
    fn endpoints(self) -> &'static str {
        match self {
            Port::Check {
                metrics_elsewhere: false,
            } => "POST /v1/check, GET /healthz, GET /readyz and GET /metrics",
            Port::Check {
                metrics_elsewhere: true,
            } => {
                "POST /v1/check, GET /healthz and GET /readyz (GET /metrics is served on \
                 the address given by --metrics)"
            }
            Port::Metrics => {
                "GET /metrics, GET /healthz and GET /readyz (POST /v1/check is served on \
                 the address given by --http)"
            }
        }
    }
}

/// What every handler may ask for: the service, and which port it serves.
#[derive(Clone)]
struct AppState {
    service: Arc<Service>,
    port: Port,
}

impl FromRef<AppState> for Arc<Service> {
    fn from_ref(state: &AppState) -> Arc<Service> {
        Arc::clone(&state.service)
    }
}

/// The routes of `port`, sharing `service`.
pub fn router(service: Arc<Service>, port: Port) -> Router {
    let routes = match port {
        Port::Check { metrics_elsewhere } => {
            let check = Router::new().route("/v1/check", post(check));
            if metrics_elsewhere {
                check
            } else {
                check.route("/metrics", get(metrics))
            }
        }
        Port::Metrics => Router::new().route("/metrics", get(metrics)),
    };
    let state = AppState { service, port };
    routes
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(from_fn_with_state(state.clone(), one_host))
        .with_state(state)
}

/// Refuses what RFC 9112 (section 3.2) says a server must answer 400: an
/// HTTP/1.1 request without a `Host` header, and any request with more
/// than one or with a value that is no `host[:port]`. hyper leaves these
/// to the service. An HTTP/1.0 request may leave `Host` out; an empty value
/// is allowed (a request whose target has no host sends one).
async fn one_host(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let mut hosts = request.headers().get_all(header::HOST).iter();
    let problem = match (hosts.next(), hosts.next()) {
        (None, _) if request.version() == Version::HTTP_11 => {
            Some("has no Host header; an HTTP/1.1 request must carry one".to_owned())
        }
        (None, _) => None,
        (Some(_), Some(_)) => Some(format!(
            "has {} Host headers; send exactly one",
            request.headers().get_all(header::HOST).iter().count()
        )),
        (Some(host), None) => {
            let value = host.as_bytes();
            // An authority without a user part: `userinfo@` is no host,
            // and with a port that is one (the parser takes any digits).
            let valid = value.is_empty()
                || (!value.contains(&b'@')
                    && axum::http::uri::Authority::try_from(value).is_ok_and(|a| {
                        // After the host (an IPv6 one ends at `]`), digits
                        // after a `:` must be a port: `port()` reads an
                        // out-of-range one as none.
                        let text = a.as_str();
                        let after_host = &text[text.rfind(']').map_or(0, |i| i + 1)..];
                        after_host
                            .split_once(':')
                            .is_none_or(|(_, port)| port.is_empty() || a.port_u16().is_some())
                    }));
            (!valid).then(|| {
                "has a Host header that is no host[:port]; send the server's name or address, \
                 with its port if not the default"
                    .to_owned()
            })
        }
    };
    if let Some(problem) = problem {
        state.service.metrics.bad_request(state.port.api());
        return bad(
            StatusCode::BAD_REQUEST,
            format!("the request {problem} (RFC 9112, section 3.2), such as Host: localhost"),
        );
    }
    next.run(request).await
}

/// A path that is no endpoint: said in JSON, like every other error, and
/// naming the endpoints.
async fn not_found(State(state): State<AppState>, method: Method, uri: Uri) -> Response {
    state.service.metrics.bad_request(state.port.api());
    bad(
        StatusCode::NOT_FOUND,
        format!(
            "there is no endpoint {} {}; the endpoints are {}",
            cut_short(method.as_str()),
            // A CONNECT's target is an authority (HOST:PORT), no path.
            cut_short(&match uri.path() {
                "" => uri.to_string(),
                path => path.to_owned(),
            }),
            state.port.endpoints()
        ),
    )
}

/// An endpoint asked with the wrong method (axum adds the `Allow` header).
async fn method_not_allowed(State(state): State<AppState>, method: Method, uri: Uri) -> Response {
    state.service.metrics.bad_request(state.port.api());
    bad(
        StatusCode::METHOD_NOT_ALLOWED,
        format!(
            "{} does not take {}; the endpoints are {}",
            cut_short(uri.path()),
            cut_short(method.as_str()),
            state.port.endpoints()
        ),
    )
}

async fn healthz() -> &'static str {
    "ok\n"
}

/// Whether decisions reach the store: `200 ready`, or `503` saying what
/// did not answer. Liveness stays with `/healthz`, which a store outage
/// does not fail: the failure policy still answers every request.
async fn readyz(State(service): State<Arc<Service>>) -> Response {
    match service.probe_store().await {
        Ok(()) => "ready\n".into_response(),
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {e:#}\n"),
        )
            .into_response(),
    }
}

async fn metrics(State(service): State<Arc<Service>>) -> Response {
    // On the blocking pool: with many rules a scrape locks every shard of
    // every store to count its keys and writes megabytes (50,000 rules:
    // some 150 ms, 33 MB), time a runtime worker would not spend on the
    // checks queued to it.
    let rendered =
        tokio::task::spawn_blocking(move || service.metrics.render(&service.keys_tracked())).await;
    let text = match rendered {
        Ok(text) => text,
        Err(e) => {
            tracing::error!(error = %e, "rendering /metrics failed");
            return (
                StatusCode::INTERNAL_SERVER_ERROR,
                "rendering /metrics failed\n",
            )
                .into_response();
        }
    };
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CheckRequest {
    /// Any JSON value, as `cost`: null and a value of another type get
    /// messages of their own from [`parse_string`].
    #[serde(default, deserialize_with = "present")]
    key: Option<serde_json::Value>,
    /// As `key`.
    #[serde(default, deserialize_with = "present")]
    domain: Option<serde_json::Value>,
    /// `Some(None)` for `null`, which is refused as `key`'s is: read as
    /// absent, a key request with it was decided, and a domain with it
    /// was said to have no descriptors at all.
    #[serde(default, deserialize_with = "present")]
    descriptors: Option<Option<Vec<Object<DescriptorJson>>>>,
    /// `None` when absent, `Some(Value::Null)` for `null`, which is not
    /// the absent cost of 1. Any JSON value, so that [`parse_cost`] says
    /// what is wrong with one that is no number in its own words (a
    /// `Number` read from an object complains of "a field with custom
    /// name", serde_json's private spelling of a precise number).
    #[serde(default, deserialize_with = "present")]
    cost: Option<serde_json::Value>,
}

/// Reads a field that is present, null or not, so that absent (the
/// default, `None`) and null (`Some(Value::Null)`, the raw text `null`,
/// or `Some(None)`) stay apart: a plain option reads both as `None`.
fn present<'de, D: serde::Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
) -> Result<Option<T>, D::Error> {
    T::deserialize(d).map(Some)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DescriptorJson {
    /// Missing is empty, as a repeated field is in Envoy's protobuf: both
    /// get the message that names the descriptor by its index.
    #[serde(default)]
    entries: Vec<Object<EntryJson>>,
    /// The descriptor's own limit, as Envoy's `RateLimitDescriptor.limit`
    /// gives it: decided in place of the configured rule's. Any JSON value
    /// (null included), read by [`LimitJson::read`], which says what is
    /// wrong with one that is no such object. Kept as its text: read into a
    /// `Value` first, a member given twice was taken silently (the last
    /// one), where every other object refuses it.
    #[serde(default, deserialize_with = "present")]
    limit: Option<Box<serde_json::value::RawValue>>,
}

/// A descriptor's limit override: `requests_per_unit` per `unit`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LimitJson {
    /// Any JSON value, so that [`whole_number`] says what is wrong with one
    /// that is no number.
    #[serde(default, deserialize_with = "present")]
    requests_per_unit: Option<serde_json::Value>,
    unit: Option<String>,
}

impl LimitJson {
    /// The override in `raw` (its JSON text), or what to change; `at`
    /// names the descriptor.
    fn read(raw: &serde_json::value::RawValue, at: &str) -> Result<LimitOverride, String> {
        let example = "such as {\"requests_per_unit\": 10, \"unit\": \"minute\"}";
        // The text starts at the value, with no whitespace before it.
        if !raw.get().starts_with('{') {
            // `null` too: absent is the configured rule's limit, and a
            // client sending null may have meant no limit at all. No
            // object, so no member given twice to lose in a `Value`.
            let kind = serde_json::from_str(raw.get())
                .map_or_else(|_| "no object".to_owned(), |v| kind_of(&v));
            return Err(format!(
                "{at}.limit is {kind}: leave it out for the configured rule's limit, or send \
                 an object, {example}"
            ));
        }
        let mut reader = serde_json::Deserializer::from_str(raw.get());
        let limit: LimitJson = serde_path_to_error::deserialize(&mut reader).map_err(|e| {
            let place = place_of(&e);
            let error = e.into_inner();
            // The line and column are in the limit's own text, not the
            // body: left out, the place saying where.
            let message = JsonError { place: None, error }.message();
            match place {
                Some(place) => format!("{at}.limit.{place}: {message}"),
                None => format!("{at}.limit: {message}"),
            }
        })?;
        let (Some(n), Some(unit)) = (limit.requests_per_unit, limit.unit) else {
            return Err(format!(
                "{at}.limit needs both requests_per_unit and unit, {example}"
            ));
        };
        let limit = whole_number(&format!("{at}.limit.requests_per_unit"), n)?;
        // The configuration's units, but for its advice to write window_ms.
        let window_ms = crate::config::unit_ms(&unit).map_err(|_| {
            format!(
                "{at}.limit.unit {:?} is no unit; use second, minute, hour, day, week, \
                 month (30 days) or year (365 days)",
                cut_short(&unit)
            )
        })?;
        Ok(LimitOverride { limit, window_ms })
    }
}

/// A `T` read from a JSON object only. serde's derive also reads a struct
/// from an array (its fields in order), which took `[[["k", "v"]]]` for
/// descriptors and answered a near miss with a message about arrays
/// ("trailing characters") instead of saying an object was wanted.
struct Object<T>(T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Object<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct OnlyMaps<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>> serde::de::Visitor<'de> for OnlyMaps<T> {
            type Value = T;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
                T::deserialize(serde::de::value::MapAccessDeserializer::new(map))
            }
        }
        d.deserialize_map(OnlyMaps(std::marker::PhantomData))
            .map(Object)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EntryJson {
    key: String,
    /// Optional, as in Envoy's `RateLimitDescriptor.Entry`, where a value
    /// left out is the empty string.
    #[serde(default)]
    value: String,
}

/// One decision as JSON.
#[derive(Serialize)]
struct DecisionJson {
    allowed: bool,
    /// Exact: past 2^64 ms when a bucket's wait is (JSON has no limit).
    retry_after_ms: Option<u128>,
    remaining: Option<u64>,
    limit: Option<u64>,
    window_ms: Option<u64>,
    /// The bucket's capacity, for `token-bucket` and `gcra` (where
    /// `remaining` can pass `limit`).
    #[serde(skip_serializing_if = "Option::is_none")]
    burst: Option<u64>,
    policy: Option<&'static str>,
    rule: Option<String>,
    shadow: bool,
    /// For a shadow rule, whether it would have admitted the request:
    /// `allowed` is always true there.
    #[serde(skip_serializing_if = "Option::is_none")]
    would_allow: Option<bool>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    failure_policy: bool,
    /// With `failure_policy`, the store's failure: `timeout`,
    /// `connection_dropped`, `capacity_exhausted` (a full in-memory store),
    /// `corrupt_state` or `backend`.
    #[serde(skip_serializing_if = "Option::is_none")]
    failure: Option<&'static str>,
    /// Present and `true` for a descriptor that reached an `unlimited =
    /// true` node: matched, and never limited. gRPC says the same with
    /// `limit_remaining` 2^32 - 1; without it a client could not tell such
    /// a descriptor from one that matched no rule.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    unlimited: bool,
}

#[derive(Serialize)]
struct CheckResponse {
    #[serde(flatten)]
    decision: DecisionJson,
    #[serde(skip_serializing_if = "Option::is_none")]
    descriptors: Option<Vec<DecisionJson>>,
}

#[derive(Serialize)]
struct ErrorJson {
    error: String,
}

fn bad(status: StatusCode, message: impl Into<String>) -> Response {
    let error = message.into();
    // The client is told; the operator, under `ratewarden_server=debug`,
    // on one line whatever the client wrote.
    tracing::debug!(
        "HTTP request answered {status}: {}",
        crate::one_line(&error)
    );
    (status, axum::Json(ErrorJson { error })).into_response()
}

fn decision_json(o: &DescriptorOutcome) -> DecisionJson {
    match &o.rule {
        Some(rule) => DecisionJson {
            allowed: o.allowed,
            retry_after_ms: if o.allowed {
                Some(0)
            } else {
                o.decision.retry_after_exact_ms()
            },
            remaining: Some(o.decision.remaining),
            limit: Some(rule.spec.policy.limit),
            window_ms: Some(rule.spec.policy.window_ms),
            burst: rule
                .spec
                .policy
                .policy
                .has_burst()
                .then(|| rule.spec.policy.effective_burst()),
            policy: Some(rule.spec.policy.policy.name()),
            rule: Some(rule.spec.name.clone()),
            shadow: rule.spec.shadow,
            // Left unanswered, a shadow rule has no verdict to report.
            would_allow: (rule.spec.shadow && !o.unanswered).then_some(o.decision.allowed),
            failure_policy: o.by_failure_policy(),
            failure: o.failure.map(StoreErrorKind::name),
            unlimited: false,
        },
        None => DecisionJson {
            allowed: true,
            retry_after_ms: Some(0),
            remaining: None,
            limit: None,
            window_ms: None,
            burst: None,
            policy: None,
            rule: None,
            shadow: false,
            would_allow: None,
            failure_policy: false,
            failure: None,
            unlimited: o.unlimited,
        },
    }
}

/// Reads the string field `name` (`key`, `domain`), `None` when absent.
/// Null or another type is refused, saying what to send (`example`, a JSON
/// string), rather than read as absent, which would say the field is
/// missing when it was sent.
fn parse_string(
    name: &str,
    value: Option<serde_json::Value>,
    example: &str,
) -> Result<Option<String>, String> {
    match value {
        None => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s)),
        Some(other) => Err(format!(
            "{name} is {}: it must be a JSON string, such as {{\"{name}\": {example}}}",
            kind_of(&other)
        )),
    }
}

/// Reads `cost`: a whole number from 0 to 2^53 - 1, 1 when absent. Null is
/// refused rather than read as absent: a client that sends it most likely
/// meant some cost, and the API says a cost is a whole number.
fn parse_cost(cost: Option<serde_json::Value>) -> Result<u64, String> {
    match cost {
        None => Ok(1),
        Some(serde_json::Value::Null) => Err(format!(
            "cost is null: leave `cost` out for a cost of 1, or send a whole number \
             from 0 to {MAX_SAFE} (2^53 - 1)"
        )),
        Some(value) => whole_number("cost", value),
    }
}

/// What kind of JSON value `value` is, for a message: `null`, `true` or
/// `false`, a number as written (cut short), else its type.
fn kind_of(value: &serde_json::Value) -> String {
    use serde_json::Value;
    match value {
        Value::Null => "null".to_owned(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => cut_short(&n.to_string()),
        Value::String(_) => "a string".to_owned(),
        Value::Array(_) => "an array".to_owned(),
        Value::Object(_) => "an object".to_owned(),
    }
}

/// `text` from a client, to be shown in a message: cut after 24
/// characters, so that a long one is not echoed back whole.
fn cut_short(text: &str) -> String {
    cut_after(text, 24)
}

/// The most characters of serde's message, or of a field's place in the
/// request, shown before it is cut: either can quote a client's text (a
/// string of the wrong type, a member name) or be made of many parts.
const MAX_MESSAGE_CHARS: usize = 200;

/// `text` cut after `max_chars` characters, saying how long it was.
fn cut_after(text: &str, max_chars: usize) -> String {
    match text.char_indices().nth(max_chars) {
        Some((cut, _)) => format!("{}... ({} characters)", &text[..cut], text.chars().count()),
        None => text.to_owned(),
    }
}

/// `message` with the text between each pair of backticks or double
/// quotes (serde quotes a client's strings and member names so, escaping a
/// `"` inside as `\"`) cut short, quotes kept.
fn quotes_cut_short(message: &str) -> String {
    let mut out = String::with_capacity(message.len().min(MAX_MESSAGE_CHARS * 2));
    let mut rest = message;
    while let Some(open) = rest.find(['`', '"']) {
        let quote = rest[open..].chars().next().unwrap_or('"');
        let inner_start = open + 1;
        // The closing quote: the next one not escaped by a backslash.
        let mut close = None;
        let mut escaped = false;
        for (i, c) in rest[inner_start..].char_indices() {
            match c {
                '\\' if quote == '"' && !escaped => escaped = true,
                c if c == quote && !escaped => {
                    close = Some(inner_start + i);
                    break;
                }
                _ => escaped = false,
            }
        }
        let Some(close) = close else {
            break;
        };
        out.push_str(&rest[..inner_start]);
        out.push_str(&cut_short(&rest[inner_start..close]));
        out.push(quote);
        rest = &rest[close + 1..];
    }
    out.push_str(rest);
    out
}

/// `value` as a whole number from 0 to 2^53 - 1, or what is wrong with it,
/// naming it `field`.
fn whole_number(field: &str, value: serde_json::Value) -> Result<u64, String> {
    let n = match value {
        serde_json::Value::Number(n) => n,
        other => {
            let what = kind_of(&other);
            return Err(format!(
                "{field} is {what}: it must be a JSON number, a whole number from 0 to \
                 {MAX_SAFE} (2^53 - 1), written without quotes"
            ));
        }
    };
    match n.as_u64() {
        Some(c) if c <= MAX_SAFE => Ok(c),
        _ => {
            // Numbers are kept as written: a long one is shown cut short.
            let shown = cut_short(&n.to_string());
            Err(format!(
                "{field} is {shown}: it must be a whole number from 0 to {MAX_SAFE} (2^53 - 1), \
                 written without a fraction or exponent"
            ))
        }
    }
}

/// The answer to a body over [`MAX_BODY_BYTES`]. The connection closes:
/// the rest of the body may still come, and whether hyper reads it away
/// to keep the connection depends on its length, so the client is told.
fn too_large() -> Response {
    let mut response = bad(
        StatusCode::PAYLOAD_TOO_LARGE,
        format!("the request body is larger than {MAX_BODY_BYTES} bytes; send a shorter key, or fewer or shorter descriptors"),
    );
    response
        .headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

async fn check(State(service): State<Arc<Service>>, request: Request) -> Response {
    let started = Instant::now();
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    // A client that went away mid-body sent nothing wrong: answered (in
    // case it still reads), but not counted as a bad request.
    let mut client_cut = false;
    let headers = request.headers();
    let encoded = codings_besides(headers, header::CONTENT_ENCODING, "identity", false);
    let transferred = codings_besides(headers, header::TRANSFER_ENCODING, "chunked", true);
    let response = if let Some(coding) = transferred {
        // hyper undoes `chunked` only, and would hand on the rest still
        // coded, to be read as malformed JSON: RFC 9112 (section 6.1)
        // answers a transfer coding the server does not know with a 501.
        let mut response = bad(
            StatusCode::NOT_IMPLEMENTED,
            format!(
                "the request body is sent with Transfer-Encoding {:?}, which this service \
                 does not decode; send the JSON with Content-Length, or with \
                 Transfer-Encoding: chunked alone",
                cut_short(&coding)
            ),
        );
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        response
    } else if let Some(coding) = encoded {
        // A compressed body would read as malformed JSON, which misleads:
        // say what is wrong. RFC 7694: a 415 for a content coding names
        // the codings taken in `Accept-Encoding`. Answered before the
        // body is read, as a body too large is.
        let mut response = bad(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            format!(
                "the request body is sent with Content-Encoding {:?}, which this \
                 service does not decode; send the JSON uncompressed, with no \
                 Content-Encoding",
                cut_short(&coding)
            ),
        );
        let headers = response.headers_mut();
        headers.insert(
            header::ACCEPT_ENCODING,
            HeaderValue::from_static("identity"),
        );
        headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
        response
    } else if declared.is_some_and(|n| n > MAX_BODY_BYTES as u64) {
        // Answered before the body is read, so hyper sends no `100
        // Continue` inviting it; the connection closes, since the body
        // may follow all the same.
        too_large()
    } else {
        match tokio::time::timeout(BODY_READ_TIMEOUT, Bytes::from_request(request, &())).await {
            Ok(body) => {
                client_cut = body.as_ref().is_err_and(cut_short_by_the_client);
                decide(&service, body).await
            }
            Err(_) => {
                let mut response = bad(
                    StatusCode::REQUEST_TIMEOUT,
                    format!(
                        "the request body did not arrive within {} s; send the whole body at once",
                        BODY_READ_TIMEOUT.as_secs()
                    ),
                );
                // The rest of the body may still come: the connection cannot
                // carry another request.
                response
                    .headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
                response
            }
        }
    };
    // A refusal (429) is an answer, not a bad request; a transfer coding
    // not taken (501) is the client's.
    if (response.status().is_client_error() || response.status() == StatusCode::NOT_IMPLEMENTED)
        && response.status() != StatusCode::TOO_MANY_REQUESTS
        && !client_cut
    {
        service.metrics.bad_request(Api::Http);
    }
    service.metrics.latency(Api::Http, started.elapsed());
    response
}

/// The request's `name` header (`Content-Encoding`, `Transfer-Encoding`),
/// when it names any coding but `harmless` (`identity`, which changes
/// nothing; `chunked`, which hyper undoes), or names that one more than
/// once where it must be `once` (hyper undoes `chunked` once, and RFC 9112
/// forbids applying it twice: `chunked, chunked` is a framing a proxy in
/// front may read otherwise); shown as sent, or `None`.
fn codings_besides(
    headers: &HeaderMap,
    name: header::HeaderName,
    harmless: &str,
    once: bool,
) -> Option<String> {
    let sent: Vec<String> = headers
        .get_all(name)
        .iter()
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .collect();
    let codings: Vec<&str> = sent
        .iter()
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .collect();
    let other = codings.iter().any(|c| !c.eq_ignore_ascii_case(harmless));
    (other || once && codings.len() > 1).then(|| sent.join(", "))
}

/// Whether the body could not be read because the connection ended or
/// was reset before all of it came (hyper's reading gives an I/O error of
/// these kinds), rather than because of what was sent (a malformed
/// chunked encoding is `InvalidInput`).
fn cut_short_by_the_client(rejection: &BytesRejection) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(rejection);
    while let Some(e) = source {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            return matches!(
                io.kind(),
                std::io::ErrorKind::UnexpectedEof
                    | std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::ConnectionAborted
                    | std::io::ErrorKind::BrokenPipe
            );
        }
        source = e.source();
    }
    false
}

/// `body` with each UTF-16 surrogate escape inside a JSON string that is
/// no half of a pair (`"\ud800"`, `"\udc00"`, a high one not followed by
/// a low one) made `\uFFFD`, which has the same length, so that serde's
/// line and column still point into the body as sent.
///
/// serde_json refuses a lone surrogate, but JavaScript's `JSON.stringify`
/// and Python's `json.dumps` write one from a client's string, and a caller
/// that fails open on an error would let such a request through unlimited.
/// So it is read as U+FFFD and decided, as gRPC reads bytes that are not
/// UTF-8.
fn lone_surrogates_replaced(body: &[u8]) -> Cow<'_, [u8]> {
    // Most bodies have no `\u` escape at all: they are read as they came.
    if !body.windows(2).any(|w| w == b"\\u") {
        return Cow::Borrowed(body);
    }
    let mut out = Cow::Borrowed(body);
    let mut in_string = false;
    let mut i = 0;
    while i < body.len() {
        match body[i] {
            b'"' => {
                in_string = !in_string;
                i += 1;
            }
            // Backslashes outside strings are a syntax error, left to serde.
            b'\\' if in_string => match surrogate_at(body, i) {
                Some(0xD800..=0xDBFF)
                    if matches!(surrogate_at(body, i + 6), Some(0xDC00..=0xDFFF)) =>
                {
                    i += 12
                }
                Some(_) => {
                    out.to_mut()[i..i + 6].copy_from_slice(b"\\uFFFD");
                    i += 6;
                }
                // Any other escape's two bytes are passed together, so
                // that the backslash or quote that `\\` or `\"` escapes is
                // read as the start of nothing (the hex digits after any
                // other `\u` hold neither).
                None => i += 2,
            },
            _ => i += 1,
        }
    }
    out
}

/// The code unit of the `\uXXXX` escape at `at` (hex in either case), if
/// there is one and it is a surrogate.
fn surrogate_at(body: &[u8], at: usize) -> Option<u16> {
    let escape = body.get(at..at + 6)?;
    let hex = escape.strip_prefix(b"\\u")?;
    if !hex.iter().all(u8::is_ascii_hexdigit) {
        return None;
    }
    let unit = u16::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok()?;
    (0xD800..=0xDFFF).contains(&unit).then_some(unit)
}

/// The byte of `body` at serde_json's `line` and `column` (both from 1;
/// the column counts bytes), if there is one.
fn byte_at(body: &[u8], line: usize, column: usize) -> Option<u8> {
    let start = match line.checked_sub(2) {
        None => 0,
        Some(newlines) => {
            body.iter()
                .enumerate()
                .filter(|(_, &b)| b == b'\n')
                .nth(newlines)?
                .0
                + 1
        }
    };
    body.get(start + column.checked_sub(1)?).copied()
}

/// A request's JSON as serde_json reads it, with the place of a field of
/// the wrong type or name put before serde's message
/// (`descriptors[0].entries[1].value: invalid type: ...`); the error keeps
/// serde_json's line and column.
fn from_slice_at(body: &[u8]) -> Result<CheckRequest, JsonError> {
    let mut reader = serde_json::Deserializer::from_slice(body);
    // An object only: every field has a default, so serde's derive would
    // read `[1]` as a request with the key 1.
    let Object(request) = serde_path_to_error::deserialize(&mut reader).map_err(|e| JsonError {
        place: place_of(&e),
        error: e.into_inner(),
    })?;
    // Trailing characters, as serde_json::from_slice refuses them.
    reader
        .end()
        .map_err(|error| JsonError { place: None, error })?;
    Ok(request)
}

/// Where a serde error is, from the value read: the field of a wrong type,
/// the table of an unknown field (whose message names the field itself);
/// `None` at the value itself.
fn place_of(e: &serde_path_to_error::Error<serde_json::Error>) -> Option<String> {
    use serde_path_to_error::Segment;
    let segments: Vec<&Segment> = e.path().iter().collect();
    // By segment, not by the text's last `.`, which can be in the unknown
    // field's own name.
    let upto = if e.inner().to_string().starts_with("unknown field") {
        segments.len().saturating_sub(1)
    } else {
        segments.len()
    };
    let mut place = String::new();
    for segment in &segments[..upto] {
        // A member name is the client's: cut as other client text is (one
        // of 60,000 characters was echoed whole).
        let name = match segment {
            Segment::Seq { index } => {
                place.push_str(&format!("[{index}]"));
                continue;
            }
            Segment::Map { key } => cut_short(key),
            Segment::Enum { variant } => cut_short(variant),
            // serde_path_to_error's `?`, where a syntax error stops it
            // before a member's name is read (`{`, a trailing comma),
            // says nothing: the known part of the place is said alone.
            Segment::Unknown => continue,
        };
        if !place.is_empty() {
            place.push('.');
        }
        place.push_str(&name);
    }
    // Any JSON value (a key's, a cost's) nests up to serde_json's 128
    // levels, each of which adds a member name.
    (!place.is_empty()).then(|| cut_after(&place, MAX_MESSAGE_CHARS))
}

/// serde_json's error, and the field it is in.
struct JsonError {
    place: Option<String>,
    error: serde_json::Error,
}

impl JsonError {
    fn line(&self) -> usize {
        self.error.line()
    }

    fn column(&self) -> usize {
        self.error.column()
    }

    /// serde's message without its line and column, with the client's text
    /// it quotes whole cut short (a string of the wrong type, `invalid
    /// type: string "..."`; an unknown member's name, ``unknown field `...`,
    /// expected ...``), so that what follows it (the fields expected) is
    /// still said; and the whole cut, as a bound.
    fn message(&self) -> String {
        let message = self.error.to_string();
        let at = format!(" at line {} column {}", self.line(), self.column());
        cut_after(
            &quotes_cut_short(message.strip_suffix(&at).unwrap_or(&message)),
            MAX_MESSAGE_CHARS,
        )
    }
}

impl std::fmt::Display for JsonError {
    /// The place, the message cut as other client text is, and the line
    /// and column after it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(place) = &self.place {
            write!(f, "{place}: ")?;
        }
        write!(f, "{}", self.message())?;
        if self.line() > 0 {
            write!(f, " at line {} column {}", self.line(), self.column())?;
        }
        Ok(())
    }
}

async fn decide(service: &Service, body: Result<Bytes, BytesRejection>) -> Response {
    let body = match body {
        Ok(b) => b,
        Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => return too_large(),
        Err(e) => {
            return bad(
                StatusCode::BAD_REQUEST,
                format!("the request body could not be read: {e}"),
            )
        }
    };
    // RFC 8259 lets a reader ignore a byte order mark, which some clients
    // (PowerShell, Windows editors) put before the JSON.
    let body = body.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(&body);
    if body.trim_ascii().is_empty() {
        return bad(
            StatusCode::BAD_REQUEST,
            "the request body is empty; send {\"key\": \"user:42\", \"cost\": 1} or \
             {\"domain\": \"...\", \"descriptors\": [...]}, with Content-Length or chunked",
        );
    }
    // Bytes that are not UTF-8 read as U+FFFD, each bad sequence, as the
    // gRPC API reads them, and for the same reason: an error would let a
    // caller that fails open pass such a key unlimited. (A syntax error
    // after one is then placed up to two columns further on: U+FFFD takes
    // three bytes where a bad byte took one.)
    let text = String::from_utf8_lossy(body);
    let body = lone_surrogates_replaced(text.as_bytes());
    let body = &*body;
    let request: CheckRequest = match from_slice_at(body) {
        Ok(r) => r,
        // serde reads a struct from an array too, and then names a field's
        // type, which misleads: say what the body must be.
        Err(_) if body.trim_ascii_start().first().is_some_and(|&b| b != b'{') => {
            return bad(
                StatusCode::BAD_REQUEST,
                "malformed JSON: the body must be a JSON object, such as {\"key\": \"user:42\", \"cost\": 1}",
            )
        }
        // serde_json's "key must be a string" means an unquoted member
        // name, which reads as if the "key" field were meant; or, at a `}`,
        // a trailing comma in JSON it skips whole (a descriptor's limit,
        // kept as its text), where it elsewhere says "trailing comma".
        Err(e) if e.error.to_string().starts_with("key must be a string") => {
            let what = if byte_at(body, e.line(), e.column()) == Some(b'}') {
                "a comma is followed by no member; remove it (JSON allows no trailing comma)"
            } else {
                "a member name must be a string in double quotes, as in {\"key\": \"user:42\"}"
            };
            let place = e.place.as_ref().map_or(String::new(), |p| format!(" in {p}"));
            return bad(
                StatusCode::BAD_REQUEST,
                format!(
                    "malformed JSON at line {} column {}{place}: {what}",
                    e.line(),
                    e.column()
                ),
            );
        }
        Err(e) if e.to_string().contains("unknown field `hits_addend`") => {
            return bad(
                StatusCode::BAD_REQUEST,
                format!(
                    "malformed JSON: {e}; over HTTP a request's cost is \"cost\", at the top \
                     level, for every descriptor"
                ),
            )
        }
        Err(e) => {
            return bad(
                StatusCode::BAD_REQUEST,
                format!(
                    "malformed JSON: {e}; send {{\"key\": \"...\", \"cost\": 1}} or \
                     {{\"domain\": \"...\", \"descriptors\": [{{\"entries\": [{{\"key\": \"...\", \"value\": \"...\"}}]}}]}}"
                ),
            )
        }
    };
    let cost = match parse_cost(request.cost) {
        Ok(c) => c,
        Err(m) => return bad(StatusCode::BAD_REQUEST, m),
    };
    let key = match parse_string("key", request.key, "\"user:42\"") {
        Ok(k) => k,
        Err(m) => return bad(StatusCode::BAD_REQUEST, m),
    };
    let domain = match parse_string("domain", request.domain, "\"api\"") {
        Ok(d) => d,
        Err(m) => return bad(StatusCode::BAD_REQUEST, m),
    };
    let descriptors = match request.descriptors {
        Some(None) => {
            return bad(
                StatusCode::BAD_REQUEST,
                "descriptors is null: send a list of descriptors with a domain, such as \
                 {\"domain\": \"api\", \"descriptors\": [{\"entries\": [{\"key\": \"user\", \
                 \"value\": \"ann\"}]}]}, or leave descriptors out and send a key",
            )
        }
        descriptors => descriptors.flatten(),
    };
    let listed = key.is_none();
    let outcomes = match (key, domain, descriptors) {
        (Some(key), None, None) if key.is_empty() => Err(BadRequest(
            "key is empty; send the key to limit by, such as {\"key\": \"user:42\"} (an empty key \
             would put every such request in one budget)"
                .into(),
        )),
        (Some(key), None, None) => service.check_key(&key, cost).await.map(|o| vec![o]),
        (None, Some(domain), Some(descriptors)) => {
            let mut requests = Vec::with_capacity(descriptors.len());
            for (i, Object(d)) in descriptors.into_iter().enumerate() {
                let limit = match d.limit.map(|l| LimitJson::read(&l, &format!("descriptors[{i}]"))) {
                    Some(Err(m)) => return bad(StatusCode::BAD_REQUEST, m),
                    Some(Ok(l)) => Some(l),
                    None => None,
                };
                requests.push(DescriptorRequest {
                    entries: d.entries.into_iter().map(|Object(e)| (e.key, e.value)).collect(),
                    cost,
                    limit,
                });
            }
            service.check_descriptors(&domain, &requests).await
        }
        (Some(_), _, _) => Err(BadRequest(
            "key is given together with domain or descriptors; send either a key or a domain with descriptors".into(),
        )),
        (None, Some(_), None) => Err(BadRequest("descriptors is missing; a domain needs descriptors".into())),
        (None, None, Some(_)) => Err(BadRequest("domain is missing; descriptors belong to a domain".into())),
        (None, None, None) => Err(BadRequest(
            "key is missing; send {\"key\": \"...\", \"cost\": 1} or {\"domain\": \"...\", \"descriptors\": [...]}".into(),
        )),
    };
    let outcomes = match outcomes {
        Ok(o) => o,
        Err(BadRequest(m)) => return bad(StatusCode::BAD_REQUEST, m),
    };
    if let Some(m) = unanswered(&outcomes, listed) {
        return bad(StatusCode::SERVICE_UNAVAILABLE, m);
    }
    respond(outcomes, listed)
}

/// The descriptor that speaks for the request: the refusal with the
/// longest wait (a refusal that no wait admits first), else the enforcing
/// descriptor with the least remaining, else the first with a rule (a
/// shadow rule's), else the first.
///
/// The longest wait is the request's: it is admitted once every refusing
/// descriptor admits, and with no other traffic a descriptor that admits
/// at some time still admits later (time only ever frees budget), so the
/// request's smallest wait is the largest of theirs.
fn deciding(outcomes: &[DescriptorOutcome]) -> usize {
    // Refusals all enforce (shadow rules and unmatched descriptors always
    // admit); among admissions only the enforcing ones speak.
    outcomes
        .iter()
        .enumerate()
        .filter(|(_, o)| !o.allowed || o.rule.as_ref().is_some_and(|r| !r.spec.shadow))
        .reduce(|best, next| {
            if binds_more(next.1, best.1) {
                next
            } else {
                best
            }
        })
        .map_or_else(
            // `null` at the top level says no descriptor had a rule: a
            // shadow rule's, wherever it stands, speaks before it.
            || outcomes.iter().position(|o| o.rule.is_some()).unwrap_or(0),
            |(i, _)| i,
        )
}

/// Whether `a` binds the request more than `b`: a refusal before an
/// admission, the longer wait among refusals (a refusal that no wait admits
/// longest), the less remaining among admissions; on a tie, `b` (the
/// earlier) stays.
fn binds_more(a: &DescriptorOutcome, b: &DescriptorOutcome) -> bool {
    let wait = |o: &DescriptorOutcome| o.decision.retry_after_exact_ms().map_or(u128::MAX, |ms| ms);
    match (a.allowed, b.allowed) {
        (false, true) => true,
        (true, false) => false,
        (false, false) => wait(a) > wait(b),
        (true, true) => a.decision.remaining < b.decision.remaining,
    }
}

/// The answer; `listed` adds every descriptor's decision (for descriptor
/// requests).
fn respond(outcomes: Vec<DescriptorOutcome>, listed: bool) -> Response {
    let allowed = outcomes.iter().all(|o| o.allowed);
    let main = &outcomes[deciding(&outcomes)];
    let mut headers = HeaderMap::new();
    // One list member per enforcing rule: several descriptors can match one
    // rule (each with a count of its own), and members of one name would
    // leave a client unable to tell them apart. The one that binds most
    // speaks for the rule.
    let mut speaking: Vec<&DescriptorOutcome> = Vec::new();
    for o in &outcomes {
        let Some(rule) = &o.rule else { continue };
        if rule.spec.shadow {
            continue;
        }
        let same_rule = speaking.iter_mut().find(|s| {
            s.rule
                .as_ref()
                .is_some_and(|r| r.spec.name == rule.spec.name)
        });
        match same_rule {
            Some(s) if binds_more(o, s) => *s = o,
            Some(_) => {}
            None => speaking.push(o),
        }
    }
    let mut policies = Vec::new();
    let mut states = Vec::new();
    for o in speaking {
        let Some(rule) = &o.rule else { continue };
        let name = sf_string(&rule.spec.name);
        let policy = &rule.spec.policy;
        policies.push(format!(
            "{name};q={};w={}",
            quota(policy),
            window_secs(policy.window_ms)
        ));
        let r = advertised_remaining(policy, o.decision.remaining);
        let mut state = format!("{name};r={r}");
        if !o.allowed {
            if let Some(secs) = header_wait_secs(&o.decision) {
                state.push_str(&format!(";t={secs}"));
            }
        }
        states.push(state);
    }
    if !policies.is_empty() {
        if let Ok(v) = HeaderValue::from_str(&policies.join(", ")) {
            headers.insert("ratelimit-policy", v);
        }
        if let Ok(v) = HeaderValue::from_str(&states.join(", ")) {
            headers.insert("ratelimit", v);
        }
    }
    if !allowed {
        if let Some(secs) = header_wait_secs(&main.decision) {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
    }
    let body = CheckResponse {
        decision: decision_json(main),
        descriptors: listed.then(|| outcomes.iter().map(decision_json).collect()),
    };
    let status = if allowed {
        StatusCode::OK
    } else {
        StatusCode::TOO_MANY_REQUESTS
    };
    (status, headers, axum::Json(body)).into_response()
}

/// A structured-field string (RFC 8941): printable ASCII, with `"` and `\`
/// escaped; other characters become `?` so the header stays valid.
fn sf_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            // A structured-field string holds printable ASCII only. The
            // rest is percent-encoded, `%` too, so that two different
            // names never read the same in a header (a `?` for each such
            // character made `d.k_\u{fc}` and `d.k_\u{e9}` one name).
            ' '..='~' if c != '%' => out.push(c),
            _ => {
                let mut bytes = [0; 4];
                for b in c.encode_utf8(&mut bytes).bytes() {
                    out.push_str(&format!("%{b:02X}"));
                }
            }
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn costs_must_be_whole_and_in_range() {
        let n = |s: &str| Some(serde_json::from_str::<serde_json::Value>(s).unwrap());
        assert_eq!(parse_cost(None), Ok(1));
        let e = parse_cost(n("null")).unwrap_err();
        assert!(e.contains("leave `cost` out for a cost of 1"), "{e}");
        assert_eq!(parse_cost(n("0")), Ok(0));
        assert_eq!(parse_cost(n("9007199254740991")), Ok(MAX_SAFE));
        for bad in [
            "-1",
            "1.5",
            "1.0",
            "9007199254740992",
            "1e3",
            "18446744073709551616",
        ] {
            let e = parse_cost(n(bad)).unwrap_err();
            assert!(
                e.contains("whole number from 0 to 9007199254740991"),
                "{bad}: {e}"
            );
        }
        // A long number is cut short in the message, not echoed whole.
        let e = parse_cost(n(&"1".repeat(60_000))).unwrap_err();
        assert!(
            e.starts_with(&format!(
                "cost is {}... (60000 characters): ",
                "1".repeat(24)
            )),
            "{e}"
        );
        assert!(e.len() < 200, "{e}");
        let e = parse_cost(n("18446744073709551616")).unwrap_err();
        assert!(e.starts_with("cost is 18446744073709551616: "), "{e}");
        for (bad, what) in [
            (r#""1""#, "a string"),
            ("true", "true"),
            ("[1]", "an array"),
            (r#"{"n": 1}"#, "an object"),
        ] {
            let e = parse_cost(n(bad)).unwrap_err();
            assert!(
                e.starts_with(&format!("cost is {what}: it must be a JSON number")),
                "{bad}: {e}"
            );
        }
    }

    /// A client's text that serde quotes is cut short on its own, so that
    /// what follows it is still said.
    #[test]
    fn quoted_client_text_is_cut_and_the_rest_kept() {
        let long = "u".repeat(300);
        let cut = format!("{}... (300 characters)", "u".repeat(24));
        assert_eq!(
            quotes_cut_short(&format!(
                "unknown field `{long}`, expected `requests_per_unit` or `unit`"
            )),
            format!("unknown field `{cut}`, expected `requests_per_unit` or `unit`")
        );
        // An escaped quote inside a string does not end it.
        let quoted = format!("{}\\\"{}", "a".repeat(20), "b".repeat(20));
        assert_eq!(
            quotes_cut_short(&format!("invalid type: string \"{quoted}\", expected u64")),
            format!(
                "invalid type: string \"{}... (42 characters)\", expected u64",
                &quoted[..24]
            )
        );
        // Short quotes, and an unmatched one, are left as they are.
        for kept in ["expected `a` or `b`", "a \"b", "no quotes"] {
            assert_eq!(quotes_cut_short(kept), kept);
        }
    }

    #[test]
    fn lone_surrogate_escapes_are_read_as_replacement_characters() {
        let replaced = |body: &str| {
            String::from_utf8(lone_surrogates_replaced(body.as_bytes()).into_owned()).unwrap()
        };
        let read = |body: &str| serde_json::from_str::<String>(&replaced(body)).unwrap();
        assert_eq!(replaced(r#"{"key": "\ud800"}"#), r#"{"key": "\uFFFD"}"#);
        // A trailing surrogate alone, or before its leading one.
        assert_eq!(read(r#""\udc00""#), "\u{fffd}");
        assert_eq!(read(r#""\uDE00\uD83D""#), "\u{fffd}\u{fffd}");
        // A leading one followed by no trailing one, and then a pair.
        assert_eq!(read(r#""\ud800\u0041""#), "\u{fffd}A");
        assert_eq!(read(r#""\uD800\ud83d\ude00x""#), "\u{fffd}\u{1f600}x");
        // A pair is kept, in either case.
        assert_eq!(replaced(r#""\ud83d\ude00""#), r#""\ud83d\ude00""#);
        assert_eq!(read(r#""\uD83D\uDE00""#), "\u{1f600}");
        // An escaped backslash before `u` is no escape; one before an
        // escape leaves that escape one.
        assert_eq!(replaced(r#""\\ud800""#), r#""\\ud800""#);
        assert_eq!(read(r#""\\\ud800""#), "\\\u{fffd}");
        // An escaped quote does not end the string, and member names are
        // strings too.
        assert_eq!(
            replaced(r#"{"a\"\ud800": "\udfff"}"#),
            r#"{"a\"\uFFFD": "\uFFFD"}"#
        );
        // Outside strings nothing is changed: serde says what is wrong.
        assert_eq!(replaced(r#"{\ud800: 1}"#), r#"{\ud800: 1}"#);
        // A cut escape is left to serde too.
        assert_eq!(replaced(r#""\ud80"#), r#""\ud80"#);
        assert!(matches!(
            lone_surrogates_replaced(br#"{"key": "\n"}"#),
            Cow::Borrowed(_)
        ));
    }

    #[test]
    fn names_become_valid_structured_strings() {
        assert_eq!(sf_string("api.path_/login"), "\"api.path_/login\"");
        assert_eq!(sf_string("a\"b\\c\u{e9}"), "\"a\\\"b\\\\c%C3%A9\"");
        // Distinct names stay distinct: `%` is encoded as well.
        assert_eq!(sf_string("k_\u{fc}"), "\"k_%C3%BC\"");
        assert_eq!(sf_string("k_%C3%BC"), "\"k_%25C3%25BC\"");
        assert_eq!(sf_string("tab\there"), "\"tab%09here\"");
    }
}
