//! Accepting connections. Each interface holds at most `max_connections`
//! open at once: a connection past that is closed unserved (and counted),
//! so a flood of idle connections runs into the cap, not into the process's
//! file-descriptor limit, where it would stop every interface from
//! accepting. Failures are logged at most once a second, since they repeat
//! at every attempt while they last; those held back within the second are
//! logged when it is up, not at the next failure, which may come hours
//! later or never.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Sleep;
use tonic::transport::server::Connected;

use crate::metrics::{Api, Metrics};
use crate::request_bytes::{self, Budget, ConnectionBudget};

/// How long a gRPC peer has to send the HTTP/2 connection preface. Until
/// then the connection has no HTTP/2 state, so keepalive pings cannot
/// close it; this does.
pub const GRPC_PREFACE_TIMEOUT: Duration = Duration::from_secs(10);

/// The most often a failure to accept, or a refusal, is logged.
const WARNING_INTERVAL: Duration = Duration::from_secs(1);

/// The HTTP/2 client connection preface, `PRI * HTTP/2.0...`, in bytes.
const PREFACE_LEN: usize = 24;

/// A listener that admits at most `max_connections` open connections.
pub struct Acceptor {
    listener: TcpListener,
    permits: Arc<Semaphore>,
    api: Api,
    metrics: Arc<Metrics>,
    max_connections: usize,
    last_warning: Option<Instant>,
    /// Since the last warning.
    refused: u64,
    /// Since the last warning, with the last error (`Some` exactly while
    /// `failed` is above 0).
    failed: u64,
    last_error: Option<io::Error>,
}

impl Acceptor {
    /// The metrics connections are counted in.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The interface its connections are counted under.
    pub fn api(&self) -> Api {
        self.api
    }

    /// Admits connections from `listener` for `api`.
    pub fn new(
        listener: TcpListener,
        api: Api,
        max_connections: usize,
        metrics: Arc<Metrics>,
    ) -> Self {
        Acceptor {
            listener,
            permits: Arc::new(Semaphore::new(max_connections)),
            api,
            metrics,
            max_connections,
            last_warning: None,
            refused: 0,
            failed: 0,
            last_error: None,
        }
    }

    /// The next connection, with its place among the open ones (held until
    /// the permit is dropped). Connections past the cap are closed here,
    /// and failures to accept waited out, so this only returns a
    /// connection to serve.
    pub async fn accept(&mut self) -> (TcpStream, OwnedSemaphorePermit) {
        loop {
            let held_until = match self.last_warning {
                Some(at) if self.refused + self.failed > 0 => Some(at + WARNING_INTERVAL),
                _ => None,
            };
            let accepted = tokio::select! {
                accepted = self.listener.accept() => accepted,
                () = tokio::time::sleep_until(held_until.unwrap_or_else(Instant::now).into()),
                    if held_until.is_some() =>
                {
                    self.warn();
                    continue;
                }
            };
            match accepted {
                Ok((stream, _)) => match Arc::clone(&self.permits).try_acquire_owned() {
                    Ok(permit) => {
                        let _ = stream.set_nodelay(true);
                        return (stream, permit);
                    }
                    Err(_) => {
                        // Closed at once, so the peer learns now rather
                        // than waiting in a backlog.
                        drop(stream);
                        self.metrics.connection_refused(self.api);
                        self.refused += 1;
                        self.warn();
                    }
                },
                Err(e) => {
                    // Out of file descriptors, mostly: wait a little rather
                    // than spin on the error.
                    self.failed += 1;
                    self.last_error = Some(e);
                    self.warn();
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
    }

    /// Logs what went wrong since the last warning, at most once a second
    /// (`accept` logs what was held back when the second is up).
    fn warn(&mut self) {
        if self
            .last_warning
            .is_some_and(|at| at.elapsed() < WARNING_INTERVAL)
        {
            return;
        }
        let api = self.api.label();
        if let Some(e) = self.last_error.take() {
            tracing::warn!(
                api,
                failed = self.failed,
                "cannot accept a connection: {e} (the process may be out of file descriptors: \
                 raise its limit, `ulimit -n`, or lower server.max_connections)"
            );
        }
        if self.refused > 0 {
            let open = match self.max_connections {
                1 => "1 connection is".to_owned(),
                n => format!("{n} connections are"),
            };
            // The metrics port's bound is fixed: naming max_connections
            // there would send its reader to a setting that does not move it.
            let bound = match self.api {
                Api::Metrics => {
                    "on the metrics port, its own fixed bound (a few scrapers need a few)"
                }
                Api::Http | Api::Grpc => "on this interface, server.max_connections",
            };
            tracing::warn!(
                api,
                refused = self.refused,
                "{open} open {bound}: further ones are closed unserved"
            );
        }
        self.refused = 0;
        self.failed = 0;
        self.last_warning = Some(Instant::now());
    }

    /// Stops listening: new connections are refused by the system at once.
    pub fn close(self) {
        drop(self.listener);
    }
}

/// A gRPC connection: closed when its peer has not sent the HTTP/2
/// preface within [`GRPC_PREFACE_TIMEOUT`], and holding its place among the
/// open connections until it ends.
pub struct GrpcConn {
    inner: TcpStream,
    preface_deadline: Option<Pin<Box<Sleep>>>,
    received: usize,
    /// The bytes its calls' requests may hold (see
    /// [`crate::request_bytes`]).
    budget: Budget,
    _permit: OwnedSemaphorePermit,
}

impl GrpcConn {
    /// Wraps an accepted connection.
    pub fn new(inner: TcpStream, permit: OwnedSemaphorePermit) -> Self {
        GrpcConn {
            inner,
            preface_deadline: Some(Box::pin(tokio::time::sleep(GRPC_PREFACE_TIMEOUT))),
            received: 0,
            budget: Budget::new(request_bytes::MAX_BYTES_PER_CONNECTION),
            _permit: permit,
        }
    }
}

impl AsyncRead for GrpcConn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                this.received += buf.filled().len() - before;
                if this.received >= PREFACE_LEN {
                    this.preface_deadline = None;
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending => {
                // Polling the deadline registers this task to be woken at
                // it, beside the socket's own wake-up.
                let expired = this
                    .preface_deadline
                    .as_mut()
                    .is_some_and(|deadline| deadline.as_mut().poll(cx).is_ready());
                if expired {
                    Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "no HTTP/2 connection preface within 10 s",
                    )))
                } else {
                    Poll::Pending
                }
            }
            ready => ready,
        }
    }
}

impl AsyncWrite for GrpcConn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl Connected for GrpcConn {
    type ConnectInfo = ConnectionBudget;

    fn connect_info(&self) -> ConnectionBudget {
        ConnectionBudget {
            tcp: self.inner.connect_info(),
            budget: self.budget.clone(),
        }
    }
}
