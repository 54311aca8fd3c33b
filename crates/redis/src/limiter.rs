//! [`RedisLimiter`]: the Redis store behind the core's `Limiter` trait,
//! with a failure policy for when Redis fails.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use ratewarden_core::{
    BoxFuture, Clock, ConfigError, Decision, FailurePolicy, Limiter, LocalLimiter, LogGate,
    MemoryOptions, MonotonicClock, PolicyConfig, StoreError, StoreErrorKind,
};

use crate::RedisStore;

/// Which clock a [`RedisLimiter`] decides by.
#[derive(Clone)]
pub enum RedisTime {
    /// Redis `TIME`, read inside the script: every client of one Redis
    /// shares one clock, whatever their own clocks say.
    Server,
    /// The caller's clock, passed as `now_ms`: clients whose clocks
    /// disagree disagree about windows, and keys still expire by Redis's
    /// clock (see [`RedisStore::decide`](crate::RedisStore::decide) for
    /// the grace a clock that does not follow it needs). An ACL user refused
    /// `TIME` can decide so, on a store connected with
    /// [`RedisOptions::checks_by_redis_time`](crate::RedisOptions::checks_by_redis_time)
    /// `false`.
    Caller(Arc<dyn Clock>),
}

impl std::fmt::Debug for RedisTime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RedisTime::Server => "Server",
            RedisTime::Caller(_) => "Caller",
        })
    }
}

/// How often each failure path was taken, since the limiter was built.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
// Read, not built, by users: a later field must not break them.
#[non_exhaustive]
pub struct FailureCounts {
    /// Calls that timed out.
    pub timeouts: u64,
    /// Calls that found the connection lost or could not connect.
    pub connection_dropped: u64,
    /// Calls that Redis answered with an error of its own.
    pub backend_errors: u64,
    /// Requests admitted by `FailurePolicy::FailOpen`.
    pub failed_open: u64,
    /// Requests refused by `FailurePolicy::FailClosed`.
    pub failed_closed: u64,
    /// Requests decided by the local fallback limiter.
    pub decided_locally: u64,
}

#[derive(Default)]
struct Counters {
    timeouts: AtomicU64,
    connection_dropped: AtomicU64,
    backend_errors: AtomicU64,
    failed_open: AtomicU64,
    failed_closed: AtomicU64,
    decided_locally: AtomicU64,
}

/// A decision and, when Redis failed, the failure the policy answered.
#[derive(Debug, Clone, PartialEq, Eq)]
// Read, not built, by users: a later field must not break them.
#[non_exhaustive]
pub struct Checked {
    /// The decision given to the caller.
    pub decision: Decision,
    /// `Some` when the decision came from the failure policy, not Redis.
    pub failure: Option<StoreError>,
}

/// A [`Limiter`] deciding on Redis, with a timeout on every call and a
/// failure policy. Clones share the connection, the fallback limiter and
/// the counters.
///
/// Transient failures (timeout, lost connection, a Redis error) get the
/// failure policy: `FailOpen` admits (`remaining` 0), `FailClosed` refuses
/// (`retry_after_ms` the window, at most 1000), `Local` decides on an
/// in-memory limiter with the same configuration, so each process enforces
/// the limit alone until Redis returns. A cost above the policy's capacity
/// is refused with no wait under each, as Redis would refuse it. Corrupt
/// state and invalid input are returned as errors: retrying cannot fix
/// them and admitting would hide them; so is the error of a `Local`
/// fallback that cannot decide (full of keys). The connection reconnects
/// by itself when Redis returns.
///
/// A failure answered by the policy is logged with `tracing::warn!`, at
/// most one line a second (each line says how many failures it stands for),
/// and the first decision by Redis after failures with `tracing::info!`;
/// [`failure_counts`](RedisLimiter::failure_counts) counts every one.
#[derive(Clone)]
pub struct RedisLimiter {
    inner: Arc<Inner>,
}

struct Inner {
    store: RedisStore,
    time: RedisTime,
    failure_policy: FailurePolicy,
    fallback: LocalLimiter,
    counters: Counters,
    /// One warning a second while Redis fails.
    failure_log: LogGate,
    /// Whether the last call failed, so that the first success says Redis
    /// answers again.
    failing: AtomicBool,
    /// The gate's clock.
    clock: MonotonicClock,
}

impl std::fmt::Debug for RedisLimiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisLimiter")
            .field("store", &self.inner.store)
            .field("time", &self.inner.time)
            .field("failure_policy", &self.inner.failure_policy)
            .finish()
    }
}

impl RedisLimiter {
    /// A limiter on `store`, deciding by `time`, answering failures with
    /// `failure_policy`. `fallback_options` bound the local limiter's memory
    /// (used only with `FailurePolicy::Local`).
    pub fn new(
        store: RedisStore,
        time: RedisTime,
        failure_policy: FailurePolicy,
        fallback_options: MemoryOptions,
    ) -> Result<Self, ConfigError> {
        let fallback = match &time {
            RedisTime::Server => LocalLimiter::new(*store.config(), fallback_options)?,
            RedisTime::Caller(clock) => {
                LocalLimiter::with_clock(*store.config(), fallback_options, Arc::clone(clock))?
            }
        };
        Ok(RedisLimiter {
            inner: Arc::new(Inner {
                store,
                time,
                failure_policy,
                fallback,
                counters: Counters::default(),
                failure_log: LogGate::new(1000),
                failing: AtomicBool::new(false),
                clock: MonotonicClock::new(),
            }),
        })
    }

    /// The store the limiter decides on.
    pub fn store(&self) -> &RedisStore {
        &self.inner.store
    }

    /// The failure policy.
    pub fn failure_policy(&self) -> FailurePolicy {
        self.inner.failure_policy
    }

    /// How often each failure path was taken.
    pub fn failure_counts(&self) -> FailureCounts {
        let c = &self.inner.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        FailureCounts {
            timeouts: get(&c.timeouts),
            connection_dropped: get(&c.connection_dropped),
            backend_errors: get(&c.backend_errors),
            failed_open: get(&c.failed_open),
            failed_closed: get(&c.failed_closed),
            decided_locally: get(&c.decided_locally),
        }
    }

    /// Decides `(key, cost)` now and says whether the failure policy gave
    /// the answer. Errors only for corrupt state, invalid input, or a local
    /// fallback that fails itself.
    pub async fn check_detailed(&self, key: u64, cost: u64) -> Result<Checked, StoreError> {
        let inner = &*self.inner;
        let now_ms = match &inner.time {
            RedisTime::Server => None,
            RedisTime::Caller(clock) => Some(clock.now_ms()),
        };
        let error = match inner.store.decide(key, now_ms, cost).await {
            Ok(decision) => {
                if inner.failing.load(Ordering::Relaxed)
                    && inner.failing.swap(false, Ordering::Relaxed)
                {
                    // With the failures held back since the last line,
                    // so that the lines' counts add up to every failure.
                    tracing::info!(
                        redis = inner.store.url(),
                        failures_not_logged = inner.failure_log.take_held(),
                        "Redis answers again"
                    );
                }
                return Ok(Checked {
                    decision,
                    failure: None,
                });
            }
            Err(e) if e.is_transient() => e,
            Err(e) => return Err(e),
        };
        let c = &inner.counters;
        match error.kind() {
            StoreErrorKind::Timeout => &c.timeouts,
            StoreErrorKind::ConnectionDropped => &c.connection_dropped,
            _ => &c.backend_errors,
        }
        .fetch_add(1, Ordering::Relaxed);
        let now_ms = inner.clock.now_ms();
        if let Some(held_back) = inner.failure_log.pass(now_ms) {
            // Only a logged failure arms the recovery line: with failures
            // and successes interleaved (one cluster node down), a line
            // per recovery would be a line per failure.
            inner.failing.store(true, Ordering::Relaxed);
            tracing::warn!(
                redis = inner.store.url(),
                failure_policy = %inner.failure_policy,
                failures_not_logged = held_back,
                "Redis failed, the failure policy answers: {error}"
            );
        }
        let config = inner.store.config();
        let decision = match config.refused_whatever_the_state(cost) {
            Some(refused) => refused,
            None => match inner.failure_policy {
                FailurePolicy::FailOpen => {
                    c.failed_open.fetch_add(1, Ordering::Relaxed);
                    Decision::admitted(0)
                }
                FailurePolicy::FailClosed => {
                    c.failed_closed.fetch_add(1, Ordering::Relaxed);
                    config.refused_while_failing()
                }
                FailurePolicy::Local => {
                    // Counted once decided: a fallback that fails (full of
                    // keys) passes its error on and decides nothing.
                    let decision = inner.fallback.check_now(key, cost)?;
                    c.decided_locally.fetch_add(1, Ordering::Relaxed);
                    decision
                }
            },
        };
        Ok(Checked {
            decision,
            failure: Some(error),
        })
    }
}

impl Limiter for RedisLimiter {
    fn config(&self) -> &PolicyConfig {
        self.inner.store.config()
    }

    fn check(&self, key: u64, cost: u64) -> BoxFuture<'_, Result<Decision, StoreError>> {
        Box::pin(async move { self.check_detailed(key, cost).await.map(|c| c.decision) })
    }
}
