//! The runtime that drives every Redis connection of the process.
//!
//! A connection's reads and writes are done by a task of the client
//! library's own (redis-rs spawns one per connection, and another per
//! reconnection), which would otherwise run among the caller's tasks. A
//! server whose runtime holds thousands of runnable tasks (a rate-limit
//! service under more calls than it can answer) then polls that task about
//! once per pass through them all: calls wait unsent and answers unread
//! while Redis is idle, every call times out, and each timeout makes more
//! runnable work, so the answers a second fall to almost none however
//! little Redis is asked. On a thread of their own, the connections keep
//! sending and reading whatever the caller's runtime is doing.
//!
//! Every public call of the store runs its future inside this runtime's
//! context ([`on_io`]): the future itself is still polled by the caller,
//! but what it spawns (a connection's task, a reconnection, a probe of a
//! cluster node) and the sockets and timers it makes belong to this
//! runtime. One thread does the connections' work for every store of the
//! process: it serializes the commands, routes a cluster's, writes them,
//! parses the replies and fires the store's timers (a 10,000-request
//! cluster batch, with 50 ms calls of another store beside it, kept their
//! median at about 1 ms in a release build, none timing out).
//!
//! Each command also goes to Redis from a task of this runtime
//! ([`handed_over`]), so that no caller waits to be polled again for a
//! place in a connection's queue. Measured with serve on one Redis on 2
//! cores, 16 HTTP/2 clients keeping 6,400 gRPC calls in flight: before,
//! 80 to 93% of calls timed out in three runs, Redis receiving from a few
//! to a few thousand commands a second; after, none did, at some 25,000
//! decisions a second, nor with 12,800 in flight; a 3-master cluster the
//! same. The cost is the hand-over between threads: 11 to 15% fewer
//! decisions a second at a normal load (wrk over HTTP, 2 and 32
//! connections, same run).

use std::future::Future;
use std::sync::OnceLock;

use redis::{RedisError, RedisResult};
use tokio::runtime::Handle;

/// The runtime, made at the first call and run by a thread of its own for
/// the process's life: connections on it outlive any caller's runtime that
/// made them. A current-thread runtime: with one thread, it hands work
/// back and forth with the callers at less cost than a one-worker
/// multi-thread runtime (in one run through serve, up to a tenth more
/// decisions a second).
fn handle() -> &'static Handle {
    static HANDLE: OnceLock<Handle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        // Only fails when the OS refuses a thread or an epoll instance:
        // nothing a store could do without them.
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("the Redis connections' runtime starts");
        let handle = runtime.handle().clone();
        std::thread::Builder::new()
            .name("ratewarden-redis".into())
            .spawn(move || runtime.block_on(std::future::pending::<()>()))
            .expect("the Redis connections' thread starts");
        handle
    })
}

/// Polls `call` with the connections' runtime as the current one, so that
/// what it spawns and the connections it makes run there.
pub(crate) async fn on_io<F: Future>(call: F) -> F::Output {
    let handle = handle();
    let mut call = std::pin::pin!(call);
    std::future::poll_fn(|cx| {
        let _entered = handle.enter();
        call.as_mut().poll(cx)
    })
    .await
}

/// Runs `request` (one command or pipeline to Redis, and its reply) as a
/// task of the connections' runtime, and waits for it; dropping the wait
/// cancels the task, as dropping `request` would.
///
/// A connection's queue has a few dozen places (redis-rs's: 50 for one
/// node, 100 for a cluster), and a caller that finds it full must be
/// polled again to hand its command over once a place frees: among
/// thousands of runnable tasks, a pass through them all for each command,
/// and calls time out before they are sent. This runtime's tasks are
/// polled as soon as a place frees. Only the request goes here (redis-rs
/// serializes it, and for a cluster routes it, on this thread): deciding
/// what to send, reading the reply's decision and timing the call stay
/// with the caller.
pub(crate) async fn handed_over<T: Send + 'static>(
    request: impl Future<Output = RedisResult<T>> + Send + 'static,
) -> RedisResult<T> {
    /// Cancels the task when its caller stops waiting.
    struct AbortOnDrop(tokio::task::AbortHandle);
    impl Drop for AbortOnDrop {
        fn drop(&mut self) {
            self.0.abort();
        }
    }
    let task = handle().spawn(request);
    let _abort = AbortOnDrop(task.abort_handle());
    match task.await {
        Ok(out) => out,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        // Only this function aborts the task, once its caller is gone; the
        // runtime is never shut down.
        Err(e) => Err(RedisError::from(std::io::Error::other(format!(
            "the request to Redis was cancelled: {e}"
        )))),
    }
}
