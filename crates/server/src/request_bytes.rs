//! Bounds on what a gRPC request's message can make the server hold: its
//! bytes, per connection, and the time it may take to arrive.
//!
//! A message is read whole before it is decoded, up to
//! [`MAX_MESSAGE_BYTES`](crate::grpc::MAX_MESSAGE_BYTES) (4 MiB), and a
//! client that sent part of one and then waited had the server hold that
//! part until the call's 10 s deadline, on as many streams as it liked: one
//! connection could make the server hold gigabytes. Now:
//!
//! - every data frame a call receives is counted against its connection's
//!   budget, [`MAX_BYTES_PER_CONNECTION`], and given back when the call's
//!   request body is dropped (once the request has ended and its message
//!   is decoded, before the call is decided; or when the call fails); a
//!   frame past the budget fails its call with `RESOURCE_EXHAUSTED`;
//! - a request body not ended within [`MESSAGE_DEADLINE`] of the call's
//!   start fails its call with `DEADLINE_EXCEEDED`, which gives its bytes
//!   back: holding memory costs a client the bandwidth to send it again
//!   every [`MESSAGE_DEADLINE`].
//!
//! While a call's request body is read, it counts as a call with work to
//! finish ([`Calls`]): shutdown waits for its message (at most
//! [`MESSAGE_DEADLINE`]) and then for its answer, rather than cutting it.
//!
//! There is no budget shared by all connections on purpose: any client
//! could fill it with a few connections and have every other call refused,
//! Envoy's among them (which Envoy answers, by default, by letting its
//! traffic through). What all connections hold together is bounded by
//! `max_connections` times the budget, and in practice by what clients can
//! send within [`MESSAGE_DEADLINE`].

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

use crate::grpc::{CallGuard, Calls};

/// The most bytes the calls of one gRPC connection may hold: two messages
/// of the largest size, so a client can always send one while another is
/// read, and Envoy's calls (a few KiB each) never come near it.
pub const MAX_BYTES_PER_CONNECTION: usize = 2 * crate::grpc::MAX_MESSAGE_BYTES + 64 * 1024;

/// How long a call's request message may take to arrive whole, from the
/// call's start. Envoy sends a call's message at once, and waits for the
/// answer 20 ms by default: a message still arriving after this is of use
/// to no one.
pub const MESSAGE_DEADLINE: Duration = Duration::from_secs(2);

/// Bytes held against a bound: one connection's.
#[derive(Debug, Clone)]
pub struct Budget {
    held: Arc<AtomicUsize>,
    max: usize,
}

impl Budget {
    /// A budget of `max` bytes.
    pub fn new(max: usize) -> Self {
        Budget {
            held: Arc::default(),
            max,
        }
    }

    /// The bytes held now.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    /// Takes `n` bytes, unless that would pass the bound.
    fn take(&self, n: usize) -> bool {
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(n).filter(|&total| total <= self.max)
            })
            .is_ok()
    }

    fn give_back(&self, n: usize) {
        self.held.fetch_sub(n, Ordering::AcqRel);
    }

    fn refusal(&self) -> tonic::Status {
        tonic::Status::resource_exhausted(format!(
            "this connection's calls would hold more than its bound of {} KiB of request \
             messages: finish or cancel calls before sending more",
            self.max / 1024
        ))
    }
}

/// What [`grpc::serve`](crate::grpc::serve) puts in each request's
/// extensions for a connection: its address, and its budget of request
/// bytes.
#[derive(Debug, Clone)]
pub struct ConnectionBudget {
    /// The peer's address, as tonic reports it for TCP.
    pub tcp: tonic::transport::server::TcpConnectInfo,
    /// The connection's budget.
    pub budget: Budget,
}

/// The layer that counts every gRPC request's body against its
/// connection's budget (from [`ConnectionBudget`] in the request's
/// extensions), gives it [`MESSAGE_DEADLINE`] to end, and counts it among
/// the calls shutdown waits for until it has.
#[derive(Debug, Clone)]
pub struct BoundRequestBodies {
    calls: Arc<Calls>,
}

impl BoundRequestBodies {
    /// The layer, counting bodies being read among `calls`.
    pub fn new(calls: Arc<Calls>) -> Self {
        BoundRequestBodies { calls }
    }
}

impl<S> tower::Layer<S> for BoundRequestBodies {
    type Service = Bounding<S>;

    fn layer(&self, inner: S) -> Bounding<S> {
        Bounding {
            inner,
            calls: Arc::clone(&self.calls),
        }
    }
}

/// The service of [`BoundRequestBodies`].
#[derive(Debug, Clone)]
pub struct Bounding<S> {
    inner: S,
    calls: Arc<Calls>,
}

impl<S> tower::Service<http::Request<tonic::body::Body>> for Bounding<S>
where
    S: tower::Service<http::Request<tonic::body::Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<tonic::body::Body>) -> Self::Future {
        let connection = request.extensions().get::<ConnectionBudget>().cloned();
        let budget = connection.map(|c| {
            // Where tonic's `Request::remote_addr` looks for the peer.
            request.extensions_mut().insert(c.tcp);
            c.budget
        });
        let call = self.calls.enter();
        let request = request.map(|body| {
            let mut body = Bounded::new(body, budget, MESSAGE_DEADLINE);
            body.call = Some(call);
            tonic::body::Body::new(body)
        });
        self.inner.call(request)
    }
}

/// A request body whose data frames are held against a budget until it is
/// dropped, and which fails when it has not ended by its deadline.
struct Bounded {
    inner: tonic::body::Body,
    held: usize,
    budget: Option<Budget>,
    /// Counts the call among those shutdown waits for while its message
    /// arrives. Let go once the body has ended, so that a call whose
    /// handler keeps its body (a streaming method) does not hold it.
    call: Option<CallGuard>,
    deadline: Pin<Box<tokio::time::Sleep>>,
    /// The time from the call's start to the deadline, for its message.
    within: Duration,
    /// Failed (past its budget or deadline): nothing more is read.
    failed: bool,
}

impl Bounded {
    fn new(inner: tonic::body::Body, budget: Option<Budget>, within: Duration) -> Self {
        Bounded {
            inner,
            held: 0,
            budget,
            call: None,
            deadline: Box::pin(tokio::time::sleep(within)),
            within,
            failed: false,
        }
    }

    fn fail(&mut self, status: tonic::Status) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        self.failed = true;
        self.call = None;
        Poll::Ready(Some(Err(status)))
    }
}

impl Body for Bounded {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        let this = &mut *self;
        if this.failed {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                let n = frame.data_ref().map_or(0, Bytes::len);
                match &this.budget {
                    Some(budget) if !budget.take(n) => {
                        let refusal = budget.refusal();
                        this.fail(refusal)
                    }
                    _ => {
                        // Given back on drop, when there is a budget.
                        this.held += n;
                        Poll::Ready(Some(Ok(frame)))
                    }
                }
            }
            Poll::Pending => match this.deadline.as_mut().poll(cx) {
                Poll::Ready(()) => {
                    let late = tonic::Status::deadline_exceeded(format!(
                        "the request message did not arrive whole within {} ms of the call's \
                         start",
                        this.within.as_millis()
                    ));
                    this.fail(late)
                }
                Poll::Pending => Poll::Pending,
            },
            Poll::Ready(None) => {
                this.call = None;
                Poll::Ready(None)
            }
            other => other,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.failed || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Bounded {
    fn drop(&mut self) {
        if let Some(budget) = &self.budget {
            budget.give_back(self.held);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[test]
    fn a_budget_takes_up_to_its_bound_and_gets_bytes_back() {
        let budget = Budget::new(10);
        assert!(budget.take(6));
        assert!(!budget.take(5), "6 + 5 is past 10");
        assert!(budget.take(4));
        assert_eq!(budget.held(), 10);
        budget.give_back(10);
        assert_eq!(budget.held(), 0);
        assert_eq!(budget.refusal().code(), tonic::Code::ResourceExhausted);
    }

    fn full(bytes: &'static [u8]) -> tonic::body::Body {
        tonic::body::Body::new(http_body_util::Full::new(Bytes::from_static(bytes)))
    }

    #[tokio::test]
    async fn a_body_past_its_budget_fails_and_gives_back_what_it_held() {
        let budget = Budget::new(8);
        let body = |bytes| Bounded::new(full(bytes), Some(budget.clone()), MESSAGE_DEADLINE);
        let mut first = body(b"12345");
        let frame = first.frame().await.unwrap().unwrap();
        assert_eq!(frame.data_ref().unwrap().len(), 5);
        assert_eq!(budget.held(), 5);
        // 5 + 5 passes 8: refused, nothing more held, and the body ends.
        let mut second = body(b"abcde");
        let e = second.frame().await.unwrap().unwrap_err();
        assert_eq!(e.code(), tonic::Code::ResourceExhausted);
        assert!(
            e.message()
                .starts_with("this connection's calls would hold"),
            "{e}"
        );
        assert!(second.frame().await.is_none());
        assert_eq!(budget.held(), 5);
        drop(first);
        assert_eq!(budget.held(), 0);
    }

    /// A body whose rest never comes.
    struct Stalled;

    impl Body for Stalled {
        type Data = Bytes;
        type Error = tonic::Status;

        fn poll_frame(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
            Poll::Pending
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_not_ended_by_its_deadline_fails() {
        let started = tokio::time::Instant::now();
        let mut body = Bounded::new(tonic::body::Body::new(Stalled), None, MESSAGE_DEADLINE);
        let e = body.frame().await.unwrap().unwrap_err();
        assert_eq!(e.code(), tonic::Code::DeadlineExceeded);
        assert_eq!(started.elapsed(), MESSAGE_DEADLINE);
        assert!(body.is_end_stream());
    }
}
