//! Every gRPC call's deadline: the shorter of the client's `grpc-timeout`
//! and [`MAX_CALL_TIME`].
//!
//! A call still unanswered at its deadline is answered `DEADLINE_EXCEEDED`,
//! as the gRPC protocol has a server answer it. And a call whose deadline
//! has passed by the time it is polled is not decided at all: its client
//! has stopped waiting (Envoy applies its own `failure_mode_deny` then), so
//! deciding it would spend budget that no one receives, and work an
//! overloaded server does not have to spare. tonic's own timeout answers
//! `CANCELLED` instead, and decides a call whenever its decision is ready at
//! the first poll, however late that poll comes.
//!
//! A `grpc-timeout` of zero is read as none (see [`Deadlined`]'s `call`),
//! so that such a call is decided rather than refused. (tonic's transport
//! would read the header too and end such a call about a millisecond in,
//! which is why the server does not run on it: see
//! [`grpc::serve`](crate::grpc::serve).)
//!
//! A `grpc-timeout` that is not one (1 to 8 digits and a unit) is refused
//! with `INVALID_ARGUMENT` rather than ignored (grpc-go refuses it too,
//! with `INTERNAL`): a client that sends one has a bug worth hearing about. Such calls are
//! counted as bad requests, and calls past their deadline in
//! `ratewarden_grpc_deadlines_exceeded_total`: a sign of an overloaded
//! server or a slow store.
//!
//! The layer also times every `ShouldRateLimit` call, from its headers to
//! its answer (or to its client's reset), for
//! `ratewarden_request_duration_seconds`: here, and not in the call itself,
//! so that calls answered `DEADLINE_EXCEEDED` or given up by their client
//! (whose decision is dropped unfinished, or never started) are in the
//! histogram too. Left out, a store slowed past Envoy's timeout would show there as
//! no slow call at all.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use std::sync::Arc;

use tokio::time::{Instant, Sleep};

use crate::metrics::{Api, Metrics};

/// The longest a gRPC call may take, from its headers to its answer's
/// headers, whatever its `grpc-timeout`: Envoy's own timeout is far
/// shorter, and a client that never finishes must not hold a task forever.
pub const MAX_CALL_TIME: Duration = Duration::from_secs(10);

/// The path of the calls the latency histogram times.
const SHOULD_RATE_LIMIT_PATH: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// The layer that gives every gRPC call its deadline.
#[derive(Debug, Clone)]
pub struct CallDeadlines {
    metrics: Arc<Metrics>,
}

impl CallDeadlines {
    /// The layer, counting what it refuses in `metrics`.
    pub fn new(metrics: Arc<Metrics>) -> Self {
        CallDeadlines { metrics }
    }
}

impl<S> tower::Layer<S> for CallDeadlines {
    type Service = Deadlined<S>;

    fn layer(&self, inner: S) -> Deadlined<S> {
        Deadlined {
            inner,
            metrics: Arc::clone(&self.metrics),
        }
    }
}

/// The service of [`CallDeadlines`].
#[derive(Debug, Clone)]
pub struct Deadlined<S> {
    inner: S,
    metrics: Arc<Metrics>,
}

impl<S, B> tower::Service<http::Request<B>> for Deadlined<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = DeadlineFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let timed = (request.uri().path() == SHOULD_RATE_LIMIT_PATH).then(Instant::now);
        let (within, from_client) = match grpc_timeout(request.headers()) {
            // Envoy sent `0m` for a `timeout: 0s` its user meant as "no
            // timeout" (which Envoy now reads it as): a real client never
            // sends a deadline already passed, since it fails the call
            // itself first.
            Ok(Some(asked)) if asked.is_zero() => (MAX_CALL_TIME, false),
            Ok(Some(asked)) if asked < MAX_CALL_TIME => (asked, true),
            Ok(_) => (MAX_CALL_TIME, false),
            Err(refusal) => {
                self.metrics.bad_request(Api::Grpc);
                if let Some(arrived) = timed {
                    self.metrics.latency(Api::Grpc, arrived.elapsed());
                }
                return DeadlineFuture::Refused(Some(refusal));
            }
        };
        DeadlineFuture::Running {
            inner: Box::pin(self.inner.call(request)),
            deadline: Box::pin(tokio::time::sleep(within)),
            within,
            from_client,
            timed,
            metrics: Arc::clone(&self.metrics),
        }
    }
}

/// A call's answer, or `DEADLINE_EXCEEDED` once its deadline has passed.
pub enum DeadlineFuture<F> {
    /// The call runs, until its answer or its deadline.
    Running {
        /// The call. Boxed, so that this future needs no pin projection.
        inner: Pin<Box<F>>,
        /// When it is due.
        deadline: Pin<Box<Sleep>>,
        /// Its time, for the answer's message.
        within: Duration,
        /// Whether that time is the client's `grpc-timeout`.
        from_client: bool,
        /// When a `ShouldRateLimit` call arrived, until it is timed;
        /// `None` for other calls, which the latency histogram leaves out.
        timed: Option<Instant>,
        /// Where a call past its deadline is counted.
        metrics: Arc<Metrics>,
    },
    /// The call is refused before it runs; taken when answered.
    Refused(Option<tonic::Status>),
}

impl<F, E> Future for DeadlineFuture<F>
where
    F: Future<Output = Result<http::Response<tonic::body::Body>, E>>,
{
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        match self.get_mut() {
            DeadlineFuture::Refused(refusal) => {
                let refusal = refusal
                    .take()
                    .expect("a call's future polled after its answer");
                Poll::Ready(Ok(refusal.into_http()))
            }
            DeadlineFuture::Running {
                inner,
                deadline,
                within,
                from_client,
                timed,
                metrics,
            } => {
                // Before the call, so that a call first polled late (a
                // busy server) is not decided for a client gone.
                if Instant::now() < deadline.deadline() {
                    if let Poll::Ready(answer) = inner.as_mut().poll(cx) {
                        if let Some(arrived) = timed.take() {
                            metrics.latency(Api::Grpc, arrived.elapsed());
                        }
                        return Poll::Ready(answer);
                    }
                    if deadline.as_mut().poll(cx).is_pending() {
                        return Poll::Pending;
                    }
                }
                let whose = if *from_client {
                    "the client's grpc-timeout"
                } else {
                    "the server's bound on a call"
                };
                let late = tonic::Status::deadline_exceeded(format!(
                    "the call was not answered within its deadline, {within:?} ({whose})"
                ));
                metrics.grpc_deadline_exceeded();
                if let Some(arrived) = timed.take() {
                    metrics.latency(Api::Grpc, arrived.elapsed());
                }
                Poll::Ready(Ok(late.into_http()))
            }
        }
    }
}

/// A call its client gave up (a stream reset, as Envoy sends at its own
/// timeout) is dropped unanswered: it is timed to that moment, so that the
/// calls a slow store held past the client's patience are in the histogram
/// whichever end gave up first.
impl<F> Drop for DeadlineFuture<F> {
    fn drop(&mut self) {
        if let DeadlineFuture::Running {
            timed: Some(arrived),
            metrics,
            ..
        } = self
        {
            metrics.latency(Api::Grpc, arrived.elapsed());
        }
    }
}

/// The `grpc-timeout` header, read as the gRPC protocol over HTTP/2 writes
/// it: a positive integer of at most 8 digits, then a unit (`H`, `M`, `S`,
/// `m`, `u` or `n`). `None` when there is none.
fn grpc_timeout(headers: &http::HeaderMap) -> Result<Option<Duration>, tonic::Status> {
    let Some(value) = headers.get("grpc-timeout") else {
        return Ok(None);
    };
    let bad = || {
        // Only printable ASCII is shown, and only so much of it; a space
        // or tab, often the very mistake, shows as itself (the tab
        // escaped), not as `?`.
        let shown: String = String::from_utf8_lossy(value.as_bytes())
            .chars()
            .take(32)
            .map(|c| {
                if c.is_ascii_graphic() || c == ' ' || c == '\t' {
                    c
                } else {
                    '?'
                }
            })
            .collect();
        tonic::Status::invalid_argument(format!(
            "the grpc-timeout header {shown:?} is not a gRPC timeout: write 1 to 8 digits \
             and a unit, H, M, S, m (ms), u (us) or n (ns), such as 20m"
        ))
    };
    let text = value.to_str().map_err(|_| bad())?;
    let digits = text.get(..text.len().saturating_sub(1)).unwrap_or("");
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let n: u64 = digits.parse().map_err(|_| bad())?;
    let timeout = match &text[digits.len()..] {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return Err(bad()),
    };
    Ok(Some(timeout))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(value: &str) -> Result<Option<Duration>, tonic::Status> {
        let mut headers = http::HeaderMap::new();
        headers.insert("grpc-timeout", value.parse().unwrap());
        grpc_timeout(&headers)
    }

    #[test]
    fn grpc_timeouts_are_read_in_every_unit() {
        assert_eq!(grpc_timeout(&http::HeaderMap::new()).unwrap(), None);
        let cases = [
            ("1H", Duration::from_secs(3600)),
            ("2M", Duration::from_secs(120)),
            ("3S", Duration::from_secs(3)),
            ("20m", Duration::from_millis(20)),
            ("5u", Duration::from_micros(5)),
            ("7n", Duration::from_nanos(7)),
            ("0m", Duration::ZERO),
            ("99999999H", Duration::from_secs(99_999_999 * 3600)),
        ];
        for (value, expected) in cases {
            assert_eq!(read(value).unwrap(), Some(expected), "{value}");
        }
    }

    #[test]
    fn a_malformed_grpc_timeout_is_refused_with_the_form_to_write() {
        for value in [
            "",
            "m",
            "20",
            "20ms",
            "123456789m",
            "-1m",
            "1.5S",
            "2h",
            " 20m",
            "+5S",
        ] {
            let e = read(value).unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{value:?}");
            assert!(
                e.message().contains("write 1 to 8 digits and a unit"),
                "{value:?}: {e}"
            );
        }
        let mut headers = http::HeaderMap::new();
        let not_ascii = http::HeaderValue::from_bytes(b"2\xffm").unwrap();
        headers.insert("grpc-timeout", not_ascii);
        let e = grpc_timeout(&headers).unwrap_err();
        assert!(e.message().contains("\"2?m\""), "{e}");
        // A stray space or tab is shown as one.
        assert!(read(" 20m").unwrap_err().message().contains("\" 20m\""));
        assert!(read("20\tm").unwrap_err().message().contains("\"20\\tm\""));
    }
}
