//! Envoy's rate-limit service, `envoy.service.ratelimit.v3.RateLimitService`.

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::sync::{mpsc, watch, Notify};
use tonic::transport::server::Connected as _;
use tonic::{Request, Response, Status};

use ratewarden_core::{Clock, PolicyKind, SystemClock};

use crate::conn::{Acceptor, GrpcConn};
use crate::metrics::Api;
use crate::proto::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use crate::proto::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use crate::proto::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use crate::proto::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use crate::rules::LimitOverride;
use crate::service::{unanswered, DescriptorOutcome, DescriptorRequest, Service};

/// The rate-limit service's full name, as health checks ask for it.
pub const SERVICE_NAME: &str = <RateLimitServiceServer<Rls> as tonic::server::NamedService>::NAME;

/// The largest gRPC request decoded, in bytes: grpc-go's default, which
/// envoyproxy/ratelimit keeps. Envoy fills descriptor values from request
/// headers (60 KiB of them by default), and one value may appear in each
/// of the 64 descriptors a request may carry; a message refused for its
/// size is an error, which Envoy's default `failure_mode_deny: false`
/// answers by letting the request through unlimited.
pub const MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;

/// The first size of the buffer an answer is encoded into, in bytes; it
/// grows for a longer answer (up to 64 descriptors' statuses, a few KiB).
/// tonic's default is 8 KiB, which an answer keeps until it is sent: an
/// answer waiting on a client that opens no flow-control window holds it
/// until the connection closes, one per stream.
pub const ANSWER_BUFFER_BYTES: usize = 512;

/// prost's codec, encoding answers into a buffer of
/// [`ANSWER_BUFFER_BYTES`] at first (tonic's default decoding buffer). The
/// generated service and client use it (`codec_path` in `build.rs`).
#[derive(Debug, Clone)]
pub struct Codec<T, U>(std::marker::PhantomData<(T, U)>);

impl<T, U> Default for Codec<T, U> {
    fn default() -> Self {
        Codec(std::marker::PhantomData)
    }
}

impl<T, U> tonic::codec::Codec for Codec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + DecodeLossy + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = tonic_prost::ProstEncoder<T>;
    type Decoder = Decoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        // tonic's default yield threshold, 32 KiB: only the first size
        // changes.
        let settings = tonic::codec::BufferSettings::new(ANSWER_BUFFER_BYTES, 32 * 1024);
        tonic_prost::ProstCodec::<T, U>::raw_encoder(settings)
    }

    fn decoder(&mut self) -> Self::Decoder {
        Decoder(std::marker::PhantomData)
    }
}

/// prost's decoding, but for a message whose strings are not all UTF-8,
/// decoded again by [`DecodeLossy`] where the message has a lossy form.
#[derive(Debug)]
pub struct Decoder<U>(std::marker::PhantomData<U>);

impl<U> tonic::codec::Decoder for Decoder<U>
where
    U: prost::Message + Default + DecodeLossy,
{
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut tonic::codec::DecodeBuf<'_>) -> Result<Option<U>, Status> {
        use bytes::Buf as _;
        // Split off the buffer (not copied), and kept for a second reading.
        let bytes = buf.copy_to_bytes(buf.remaining());
        match U::decode(bytes.clone()) {
            Ok(message) => Ok(Some(message)),
            Err(e) => U::decode_lossy(bytes)
                .map(Some)
                .ok_or_else(|| Status::internal(e.to_string())),
        }
    }
}

/// A message with a lossy reading: its strings taken as bytes, and any
/// not UTF-8 read with U+FFFD in place of each bad sequence.
///
/// A request's descriptor values come from the client's headers, which
/// Envoy passes on as they came, bytes 0x80 to 0xFF included (its protobuf
/// library only logs that a string field is not UTF-8, and sends it). A
/// request prost refuses for it would be an error, which Envoy's default
/// `failure_mode_deny: false` answers by letting the request through
/// unlimited: a client could escape every limit with one such byte in a
/// header. (envoyproxy/ratelimit's Go decoder refuses such a request too.)
/// Only a request prost refuses is read again, so the mirror below (which
/// must keep the request's fields, tags and wire types) costs nothing on
/// any other.
pub trait DecodeLossy: Sized {
    /// The lossy reading of `bytes`, or `None` when the message has none
    /// (then prost's error stands).
    fn decode_lossy(_bytes: bytes::Bytes) -> Option<Self> {
        None
    }
}

impl DecodeLossy for RateLimitResponse {}

impl DecodeLossy for RateLimitRequest {
    fn decode_lossy(bytes: bytes::Bytes) -> Option<Self> {
        use prost::Message as _;
        let raw = lossy::Request::decode(bytes).ok()?;
        Some(raw.into())
    }
}

/// `RateLimitRequest` with its strings as bytes: the same fields, tags and
/// wire types.
mod lossy {
    use crate::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
        Entry as GivenEntry, RateLimitOverride,
    };
    use crate::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
    use crate::proto::envoy::service::ratelimit::v3::RateLimitRequest;

    #[derive(Clone, PartialEq, prost::Message)]
    pub(super) struct Request {
        #[prost(bytes = "vec", tag = "1")]
        domain: Vec<u8>,
        #[prost(message, repeated, tag = "2")]
        descriptors: Vec<Descriptor>,
        #[prost(uint32, tag = "3")]
        hits_addend: u32,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    struct Descriptor {
        #[prost(message, repeated, tag = "1")]
        entries: Vec<Entry>,
        #[prost(message, optional, tag = "2")]
        limit: Option<RateLimitOverride>,
        #[prost(message, optional, tag = "3")]
        hits_addend: Option<u64>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    struct Entry {
        #[prost(bytes = "vec", tag = "1")]
        key: Vec<u8>,
        #[prost(bytes = "vec", tag = "2")]
        value: Vec<u8>,
    }

    fn text(bytes: Vec<u8>) -> String {
        String::from_utf8(bytes)
            .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
    }

    impl From<Request> for RateLimitRequest {
        fn from(r: Request) -> Self {
            RateLimitRequest {
                domain: text(r.domain),
                descriptors: r
                    .descriptors
                    .into_iter()
                    .map(|d| RateLimitDescriptor {
                        entries: d
                            .entries
                            .into_iter()
                            .map(|e| GivenEntry {
                                key: text(e.key),
                                value: text(e.value),
                            })
                            .collect(),
                        limit: d.limit,
                        hits_addend: d.hits_addend,
                    })
                    .collect(),
                hits_addend: r.hits_addend,
            }
        }
    }
}

/// The service, sharing `service`; every call is counted in `calls`.
pub fn server(service: Arc<Service>, calls: Arc<Calls>) -> RateLimitServiceServer<Rls> {
    RateLimitServiceServer::new(Rls { service, calls }).max_decoding_message_size(MAX_MESSAGE_BYTES)
}

/// The most resets a connection's peer may provoke before the connection
/// is closed (see [`serve`]).
pub const MAX_LOCAL_RESETS_PER_CONNECTION: usize = 65_536;

/// Serves `service` (tonic's routes, under the server's layers) on the
/// connections `acceptor` admits until `stop` turns true, then stops
/// accepting and sends every open connection a GOAWAY, so that it
/// finishes the calls it has; returns once all have closed.
///
/// This is hyper's HTTP/2 server, not tonic's transport: that wraps every
/// service in its own `grpc-timeout` timer, which ends a call whose client
/// sent a zero timeout (Envoy's `timeout: 0s`, meant as none) about a
/// millisecond in, where [`call_deadline`](crate::call_deadline) reads zero
/// as no deadline. Its other layers do nothing here: the service never
/// fails (so there is no error to turn into a status), and the streams'
/// bound, set here, bounds a connection's concurrent calls. The HTTP/2
/// settings are hyper's defaults, as tonic's are, but for those set here
/// (tonic also turned off hyper's bound on the resets a peer provokes,
/// which is kept here, raised).
pub async fn serve<S>(
    mut acceptor: Acceptor,
    service: S,
    max_streams_per_connection: u32,
    mut stop: watch::Receiver<bool>,
) -> anyhow::Result<()>
where
    S: tower::Service<
            http::Request<tonic::body::Body>,
            Response = http::Response<tonic::body::Body>,
            Error = Infallible,
        > + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        // A connection whose peer stops answering pings is closed, so dead
        // peers do not pile up; Envoy answers them.
        .keep_alive_interval(crate::GRPC_KEEPALIVE_INTERVAL)
        .keep_alive_timeout(crate::GRPC_KEEPALIVE_TIMEOUT)
        // Streams are bounded per connection: a stream whose answer waits
        // on a client that opens no flow-control window lives until the
        // connection closes, and without a bound one connection could
        // open hundreds of thousands.
        .max_concurrent_streams(max_streams_per_connection)
        // A stream past that bound is refused with a reset, which h2 counts
        // (twice) among the resets a peer provokes, and past hyper's
        // default of 1024 it closes the connection, calls in flight and
        // all (its guard against reset floods): 512 refusals over a
        // connection's life. A client that overruns the server's own bound
        // provokes no work; the guard stays, but far enough that overruns
        // alone take some 32,000 refusals to close a connection.
        .max_local_error_reset_streams(Some(MAX_LOCAL_RESETS_PER_CONNECTION));
    // Each connection task holds a sender; when all are gone, every
    // connection has closed.
    let (open_tx, mut open_rx) = mpsc::channel::<()>(1);
    loop {
        let (stream, permit) = tokio::select! {
            accepted = acceptor.accept() => accepted,
            _ = stop.wait_for(|s| *s) => break,
        };
        let connection = GrpcConn::new(stream, permit);
        // The peer's address and the connection's budget of request bytes,
        // in every request (see request_bytes).
        let info = connection.connect_info();
        let service = service.clone();
        let per_call =
            hyper::service::service_fn(move |request: http::Request<hyper::body::Incoming>| {
                let mut request = request.map(tonic::body::Body::new);
                request.extensions_mut().insert(info.clone());
                let mut service = service.clone();
                async move {
                    std::future::poll_fn(|cx| service.poll_ready(cx)).await?;
                    service.call(request).await
                }
            });
        let builder = builder.clone();
        let open = open_tx.clone();
        let mut connection_stop = stop.clone();
        tokio::spawn(async move {
            let _open = open;
            let served = builder.serve_connection(TokioIo::new(connection), per_call);
            tokio::pin!(served);
            let stopping = tokio::select! {
                done = served.as_mut() => {
                    if let Err(e) = done {
                        tracing::debug!("a gRPC connection failed: {e}");
                    }
                    false
                }
                _ = connection_stop.wait_for(|s| *s) => true,
            };
            if stopping {
                served.as_mut().graceful_shutdown();
                let _ = served.await;
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

/// The gRPC calls with work to finish: `ShouldRateLimit` calls being
/// answered, and calls of any method whose request message is still
/// arriving (at most [`MESSAGE_DEADLINE`](crate::request_bytes::MESSAGE_DEADLINE)).
///
/// Shutdown waits for these, not for connections: an HTTP/2 connection
/// ends only when its peer lets it (a peer that never sends its preface,
/// or never answers the GOAWAY's ping, holds it open), and a health
/// `Watch` stream never ends by itself. Neither has work to finish.
#[derive(Debug, Default)]
pub struct Calls {
    open: AtomicUsize,
    none_open: Notify,
}

impl Calls {
    /// How many calls are being answered now.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::SeqCst)
    }

    /// Returns once no call is being answered.
    pub async fn none_open(&self) {
        loop {
            let notified = self.none_open.notified();
            tokio::pin!(notified);
            // Registered before the check, so a last call ending between
            // the check and the wait still wakes it.
            notified.as_mut().enable();
            if self.open() == 0 {
                return;
            }
            notified.await;
        }
    }

    pub(crate) fn enter(self: &Arc<Self>) -> CallGuard {
        self.open.fetch_add(1, Ordering::SeqCst);
        CallGuard(Arc::clone(self))
    }
}

/// One call with work to finish; dropped when that work is done (or the
/// call is cancelled).
#[derive(Debug)]
pub(crate) struct CallGuard(Arc<Calls>);

impl Drop for CallGuard {
    fn drop(&mut self) {
        if self.0.open.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.none_open.notify_waiters();
        }
    }
}

/// The `ShouldRateLimit` implementation.
#[derive(Debug, Clone)]
pub struct Rls {
    service: Arc<Service>,
    calls: Arc<Calls>,
}

#[tonic::async_trait]
impl RateLimitService for Rls {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let _call = self.calls.enter();
        let result = self.decide(request.into_inner()).await;
        // Not a store failure left to the client (`UNAVAILABLE`): the
        // request was sound.
        if result
            .as_ref()
            .is_err_and(|s| s.code() == tonic::Code::InvalidArgument)
        {
            self.service.metrics.bad_request(Api::Grpc);
        }
        // Its time is taken by the deadline layer (see call_deadline), which
        // also sees the calls that end at their deadline.
        result.map(Response::new)
    }
}

impl Rls {
    async fn decide(&self, request: RateLimitRequest) -> Result<RateLimitResponse, Status> {
        // Envoy sends 0 when it means "one hit".
        let request_cost = u64::from(request.hits_addend.max(1));
        let mut unknown_units = 0;
        let descriptors: Vec<DescriptorRequest> = request
            .descriptors
            .into_iter()
            .map(|d| DescriptorRequest {
                entries: d.entries.into_iter().map(|e| (e.key, e.value)).collect(),
                // A descriptor's own hits_addend, when set, overrides the
                // request's.
                cost: d.hits_addend.map_or(request_cost, |h| h),
                limit: d.limit.and_then(|o| {
                    let window_ms = unit_ms(o.unit);
                    // envoyproxy/ratelimit panics on a unit it cannot
                    // convert; here that descriptor alone keeps its
                    // configured rule, counted and logged.
                    unknown_units += usize::from(window_ms.is_none());
                    Some(LimitOverride {
                        limit: u64::from(o.requests_per_unit),
                        window_ms: window_ms?,
                    })
                }),
            })
            .collect();
        let outcomes = self
            .service
            .check_descriptors(&request.domain, &descriptors)
            .await
            .map_err(|e| {
                tracing::debug!(
                    "gRPC call answered INVALID_ARGUMENT: {}",
                    crate::one_line(&e.0)
                );
                Status::invalid_argument(e.0)
            })?;
        // Counted once the request is known to be decided: a request
        // refused as invalid applied no rule in an override's place.
        for _ in 0..unknown_units {
            self.service
                .limit_override_ignored("an UNKNOWN (or unrecognised) unit");
        }
        // Envoy applies its own failure_mode_deny to an error, as to
        // envoyproxy/ratelimit's.
        if let Some(m) = unanswered(&outcomes, true) {
            return Err(Status::unavailable(m));
        }
        let overall = if outcomes.iter().all(|o| o.allowed) {
            Code::Ok
        } else {
            Code::OverLimit
        };
        // The wall clock the rules' limiters decide by (Redis's own on a
        // Redis store, which agrees with this one to the clocks' skew).
        let now_ms = SystemClock.now_ms();
        Ok(RateLimitResponse {
            overall_code: overall as i32,
            statuses: outcomes.iter().map(|o| status(o, now_ms)).collect(),
            ..Default::default()
        })
    }
}

/// The status of one descriptor, answered at `now_ms`.
fn status(o: &DescriptorOutcome, now_ms: u64) -> DescriptorStatus {
    let Some(rule) = &o.rule else {
        return DescriptorStatus {
            code: Code::Ok as i32,
            // As envoyproxy/ratelimit answers: an unlimited descriptor has
            // all there is left, so that a client can tell it from one that
            // matched no rule.
            limit_remaining: if o.unlimited { u32::MAX } else { 0 },
            ..Default::default()
        };
    };
    let policy = &rule.spec.policy;
    let refused = !o.allowed;
    DescriptorStatus {
        code: if refused { Code::OverLimit } else { Code::Ok } as i32,
        current_limit: Some(RateLimit {
            name: rule.spec.name.clone(),
            requests_per_unit: u32::try_from(policy.limit).unwrap_or(u32::MAX),
            unit: unit_of(policy.window_ms) as i32,
        }),
        limit_remaining: u32::try_from(o.decision.remaining).unwrap_or(u32::MAX),
        duration_until_reset: if refused {
            o.decision.retry_after_ms.map(duration)
        } else if policy.policy == PolicyKind::FixedWindow && !o.by_failure_policy() {
            // A fixed window's count starts again at the window's end, as
            // envoyproxy/ratelimit's do (its windows are aligned the same
            // way), and Envoy shows it as `X-RateLimit-Reset`. The other
            // policies have no such moment.
            Some(duration(policy.window_ms - now_ms % policy.window_ms))
        } else {
            None
        },
        quota: None,
    }
}

/// Envoy's unit for a window, when the window is exactly one; `UNKNOWN`
/// otherwise (the window is then only in the rule's configuration).
fn unit_of(window_ms: u64) -> Unit {
    match window_ms {
        1000 => Unit::Second,
        60_000 => Unit::Minute,
        3_600_000 => Unit::Hour,
        86_400_000 => Unit::Day,
        604_800_000 => Unit::Week,
        2_592_000_000 => Unit::Month,
        31_536_000_000 => Unit::Year,
        _ => Unit::Unknown,
    }
}

/// The length of an Envoy unit, as [`unit_of`] maps windows to units;
/// `None` for `UNKNOWN` and values no unit has.
fn unit_ms(unit: i32) -> Option<u64> {
    match Unit::try_from(unit).ok()? {
        Unit::Unknown => None,
        Unit::Second => Some(1000),
        Unit::Minute => Some(60_000),
        Unit::Hour => Some(3_600_000),
        Unit::Day => Some(86_400_000),
        Unit::Week => Some(604_800_000),
        Unit::Month => Some(2_592_000_000),
        Unit::Year => Some(31_536_000_000),
    }
}

/// The longest `google.protobuf.Duration`, in seconds (10,000 years): a
/// longer one is invalid, and a client that checks it (Envoy converting
/// it to milliseconds, say) would fail the whole answer.
const MAX_DURATION_SECONDS: u64 = 315_576_000_000;

/// `ms` as a protobuf duration, at most [`MAX_DURATION_SECONDS`] (a wait
/// that long is forever in any client's terms).
fn duration(ms: u64) -> prost_types::Duration {
    if ms / 1000 >= MAX_DURATION_SECONDS {
        return prost_types::Duration {
            seconds: MAX_DURATION_SECONDS as i64,
            nanos: 0,
        };
    }
    prost_types::Duration {
        seconds: (ms / 1000) as i64,
        nanos: ((ms % 1000) * 1_000_000) as i32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_map_to_envoy_units() {
        assert_eq!(unit_of(1000), Unit::Second);
        assert_eq!(unit_of(60_000), Unit::Minute);
        assert_eq!(unit_of(1500), Unit::Unknown);
        assert_eq!(unit_of(30 * 86_400_000), Unit::Month);
        assert_eq!(unit_of(365 * 86_400_000), Unit::Year);
        for unit in 1..=7 {
            let ms = unit_ms(unit).unwrap();
            assert_eq!(unit_of(ms) as i32, unit);
        }
        assert_eq!(unit_ms(Unit::Unknown as i32), None);
        assert_eq!(unit_ms(99), None);
        assert_eq!(
            duration(1500),
            prost_types::Duration {
                seconds: 1,
                nanos: 500_000_000
            }
        );
        // At most the longest valid protobuf duration.
        let longest = prost_types::Duration {
            seconds: 315_576_000_000,
            nanos: 0,
        };
        assert_eq!(duration(315_576_000_000_000), longest);
        assert_eq!(duration(u64::MAX), longest);
        assert_eq!(duration(315_575_999_999_999).seconds, 315_575_999_999);
    }
}
