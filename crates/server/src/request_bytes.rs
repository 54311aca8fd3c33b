//! A bound on the bytes of gRPC request messages held at once, per
//! connection and in all.
//!
//! A message is read whole before it is decoded, up to
//! [`MAX_MESSAGE_BYTES`](crate::grpc::MAX_MESSAGE_BYTES) (4 MiB), and a
//! client that sends part of one and then waits has the server hold that
//! part until the call's 10 s deadline. Without a bound, one connection's
//! streams could hold gigabytes at once, and the process be killed for its
//! memory. Every data frame of a request is counted against its
//! connection's budget and the process's, and released when the request's
//! body is dropped (once its message is decoded, or the call ends); a frame
//! that would pass either budget fails its call with `RESOURCE_EXHAUSTED`.

use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

/// The most bytes of unfinished request messages one gRPC connection may
/// hold: two messages of the largest size, so a client can always send
/// one while another is read, and Envoy's calls (a few KiB each) never
/// come near it.
pub const MAX_BYTES_PER_CONNECTION: usize = 2 * crate::grpc::MAX_MESSAGE_BYTES + 64 * 1024;

/// The most bytes of unfinished request messages all gRPC connections
/// together may hold.
pub const MAX_BYTES: usize = 128 * 1024 * 1024;

/// Bytes held against a bound.
#[derive(Debug, Clone)]
pub struct Budget {
    held: Arc<AtomicUsize>,
    max: usize,
    /// What the bound is of, for the message of a call refused by it.
    of: &'static str,
}

impl Budget {
    /// A budget of `max` bytes, named `of` in refusals ("this connection").
    pub fn new(max: usize, of: &'static str) -> Self {
        Budget {
            held: Arc::default(),
            max,
            of,
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
            "{} would hold more than its bound of {} KiB of unfinished request messages: \
             finish or cancel calls before sending more",
            self.of,
            self.max / 1024
        ))
    }
}

/// What tonic puts in each request's extensions for a connection: its
/// address, and its budget of request bytes.
#[derive(Debug, Clone)]
pub struct ConnectionBudget {
    /// The peer's address, as tonic reports it for TCP.
    pub tcp: tonic::transport::server::TcpConnectInfo,
    /// The connection's own budget.
    pub budget: Budget,
}

/// The layer that counts every gRPC request's body against its
/// connection's budget (from [`ConnectionBudget`] in the request's
/// extensions) and the process's.
#[derive(Debug, Clone)]
pub struct CountRequestBytes {
    all: Budget,
}

impl CountRequestBytes {
    /// Counts against `all` for the process.
    pub fn new(all: Budget) -> Self {
        CountRequestBytes { all }
    }
}

impl<S> tower::Layer<S> for CountRequestBytes {
    type Service = Counting<S>;

    fn layer(&self, inner: S) -> Counting<S> {
        Counting {
            inner,
            all: self.all.clone(),
        }
    }
}

/// The service of [`CountRequestBytes`].
#[derive(Debug, Clone)]
pub struct Counting<S> {
    inner: S,
    all: Budget,
}

impl<S> tower::Service<http::Request<tonic::body::Body>> for Counting<S>
where
    S: tower::Service<http::Request<tonic::body::Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let connection = request
            .extensions()
            .get::<ConnectionBudget>()
            .map(|c| c.budget.clone());
        let all = self.all.clone();
        let request = request.map(|body| {
            tonic::body::Body::new(Counted {
                inner: body,
                held: 0,
                budgets: [connection, Some(all)],
            })
        });
        self.inner.call(request)
    }
}

/// A request body whose data frames are held against budgets until it is
/// dropped.
struct Counted {
    inner: tonic::body::Body,
    held: usize,
    /// The connection's (when known) and the process's.
    budgets: [Option<Budget>; 2],
}

impl Counted {
    /// Takes `n` more bytes from every budget, or from none.
    fn take(&mut self, n: usize) -> Result<(), tonic::Status> {
        let mut taken: Vec<&Budget> = Vec::with_capacity(2);
        for budget in self.budgets.iter().flatten() {
            if !budget.take(n) {
                for done in taken {
                    done.give_back(n);
                }
                return Err(budget.refusal());
            }
            taken.push(budget);
        }
        self.held += n;
        Ok(())
    }
}

impl Body for Counted {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                let n = frame.data_ref().map_or(0, Bytes::len);
                Poll::Ready(Some(this.take(n).map(|()| frame)))
            }
            other => other,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        for budget in self.budgets.iter().flatten() {
            budget.give_back(self.held);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_takes_up_to_its_bound_and_gets_bytes_back() {
        let budget = Budget::new(10, "this connection");
        assert!(budget.take(6));
        assert!(!budget.take(5), "6 + 5 is past 10");
        assert!(budget.take(4));
        assert_eq!(budget.held(), 10);
        budget.give_back(10);
        assert_eq!(budget.held(), 0);
        let refusal = budget.refusal();
        assert_eq!(refusal.code(), tonic::Code::ResourceExhausted);
    }

    #[tokio::test]
    async fn a_body_past_either_budget_fails_and_gives_back_what_it_held() {
        use http_body_util::BodyExt;
        let connection = Budget::new(8, "this connection");
        let all = Budget::new(12, "the server");
        let body = |bytes: &'static [u8]| Counted {
            inner: tonic::body::Body::new(http_body_util::Full::new(Bytes::from_static(bytes))),
            held: 0,
            budgets: [Some(connection.clone()), Some(all.clone())],
        };
        let mut first = body(b"12345");
        let frame = first.frame().await.unwrap().unwrap();
        assert_eq!(frame.data_ref().unwrap().len(), 5);
        assert_eq!((connection.held(), all.held()), (5, 5));
        // 5 + 5 passes the connection's 8: refused, and nothing more held.
        let e = body(b"abcde").frame().await.unwrap().unwrap_err();
        assert_eq!(e.code(), tonic::Code::ResourceExhausted);
        assert!(e.message().starts_with("this connection would hold"), "{e}");
        assert_eq!((connection.held(), all.held()), (5, 5));
        drop(first);
        assert_eq!((connection.held(), all.held()), (0, 0));
    }
}
