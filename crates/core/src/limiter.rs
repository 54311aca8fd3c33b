//! The asynchronous face that services and middleware call: a limiter
//! decides `(key, cost)` at its own clock, on whatever store it wraps.
//!
//! The in-memory [`LocalLimiter`] answers at once; a networked store (Redis)
//! implements the same trait, so a server or a middleware layer takes any
//! store without knowing which.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::clock::{Clock, SystemClock};
use crate::registry::{AnyPolicy, PolicyConfig};
use crate::store::memory::{MemoryOptions, MemoryStore};
use crate::{ConfigError, Decision, StoreError, StoreErrorKind};

/// A boxed, sendable future, as [`Limiter::check`] returns.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A rate limiter for one policy configuration.
pub trait Limiter: Send + Sync {
    /// The configuration every key is decided by.
    fn config(&self) -> &PolicyConfig;

    /// Decides a request of `cost` for `key` now, by the limiter's clock.
    fn check(&self, key: u64, cost: u64) -> BoxFuture<'_, Result<Decision, StoreError>>;
}

impl<L: Limiter + ?Sized> Limiter for Arc<L> {
    fn config(&self) -> &PolicyConfig {
        (**self).config()
    }

    fn check(&self, key: u64, cost: u64) -> BoxFuture<'_, Result<Decision, StoreError>> {
        (**self).check(key, cost)
    }
}

/// What a limiter does with a request when its store fails.
///
/// With serde it is its name, as in configuration files: `"open"`,
/// `"closed"` or `"local"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum FailurePolicy {
    /// Admit the request: availability over protection.
    #[serde(rename = "open")]
    FailOpen,
    /// Refuse the request: protection over availability.
    #[default]
    #[serde(rename = "closed")]
    FailClosed,
    /// Decide it on a local in-memory limiter with the same configuration:
    /// each process enforces the limit alone until the store returns.
    #[serde(rename = "local")]
    Local,
}

impl FailurePolicy {
    /// The policy that answers a store failure of `kind`. The policies are
    /// for a store that is away and comes back; a key whose state the store
    /// cannot read ([`StoreErrorKind::CorruptState`]) fails on every request
    /// until someone deletes it, and admitting it would lift that key's
    /// limit for good, silently, so `open` refuses it as `closed` does.
    ///
    /// ```
    /// use ratewarden_core::{FailurePolicy, StoreErrorKind};
    /// let open = FailurePolicy::FailOpen;
    /// assert_eq!(open.answering(StoreErrorKind::Timeout), FailurePolicy::FailOpen);
    /// assert_eq!(open.answering(StoreErrorKind::CorruptState), FailurePolicy::FailClosed);
    /// ```
    pub fn answering(self, kind: StoreErrorKind) -> FailurePolicy {
        match (kind, self) {
            (StoreErrorKind::CorruptState, FailurePolicy::FailOpen) => FailurePolicy::FailClosed,
            (_, policy) => policy,
        }
    }

    /// The name used in configuration files and on the command line.
    pub const fn name(self) -> &'static str {
        match self {
            FailurePolicy::FailOpen => "open",
            FailurePolicy::FailClosed => "closed",
            FailurePolicy::Local => "local",
        }
    }
}

impl fmt::Display for FailurePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for FailurePolicy {
    type Err = ConfigError;

    /// `open`, `closed` or `local`, as [`Display`](std::fmt::Display)
    /// writes them.
    fn from_str(s: &str) -> Result<Self, ConfigError> {
        match s {
            "open" => Ok(FailurePolicy::FailOpen),
            "closed" => Ok(FailurePolicy::FailClosed),
            "local" => Ok(FailurePolicy::Local),
            other => Err(ConfigError::UnknownName {
                setting: "failure policy",
                name: other.to_owned(),
                choices: "open, closed, local",
            }),
        }
    }
}

/// A limiter on the in-memory store, reading a clock of the caller's choice.
/// Clones share one store (one budget) and one clock.
///
/// ```
/// use ratewarden_core::{Limiter, LocalLimiter, ManualClock, REFERENCE};
/// let clock = ManualClock::new(0);
/// let limiter = LocalLimiter::with_clock(REFERENCE, Default::default(), clock.clone()).unwrap();
/// let decision = limiter.check_now(42, 100).unwrap();
/// assert!(decision.allowed);
/// assert!(!limiter.check_now(42, 1).unwrap().allowed);
/// clock.advance_ms(2000);
/// assert_eq!(limiter.check_now(42, 1).unwrap().remaining, 99);
/// ```
#[derive(Clone)]
pub struct LocalLimiter {
    config: PolicyConfig,
    store: MemoryStore<AnyPolicy>,
    clock: Arc<dyn Clock>,
}

impl fmt::Debug for LocalLimiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalLimiter")
            .field("config", &self.config)
            .field("store", &self.store)
            .finish()
    }
}

impl LocalLimiter {
    /// A limiter on the system clock.
    pub fn new(config: PolicyConfig, options: MemoryOptions) -> Result<Self, ConfigError> {
        Self::with_clock(config, options, SystemClock)
    }

    /// A limiter on `clock`.
    pub fn with_clock(
        config: PolicyConfig,
        options: MemoryOptions,
        clock: impl Clock + 'static,
    ) -> Result<Self, ConfigError> {
        let store = MemoryStore::for_config(&config, options)?;
        Ok(LocalLimiter {
            config,
            store,
            clock: Arc::new(clock),
        })
    }

    /// Decides at once, synchronously.
    pub fn check_now(&self, key: u64, cost: u64) -> Result<Decision, StoreError> {
        self.store.decide(key, self.clock.now_ms(), cost)
    }

    /// The store, for housekeeping and `entries_tracked`.
    pub fn store(&self) -> &MemoryStore<AnyPolicy> {
        &self.store
    }

    /// The clock the limiter reads.
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }
}

impl Limiter for LocalLimiter {
    fn config(&self) -> &PolicyConfig {
        &self.config
    }

    fn check(&self, key: u64, cost: u64) -> BoxFuture<'_, Result<Decision, StoreError>> {
        let decision = self.check_now(key, cost);
        Box::pin(std::future::ready(decision))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failure_policy_names_round_trip() {
        for p in [
            FailurePolicy::FailOpen,
            FailurePolicy::FailClosed,
            FailurePolicy::Local,
        ] {
            assert_eq!(p.name().parse::<FailurePolicy>().unwrap(), p);
        }
        let err = "fail-open"
            .parse::<FailurePolicy>()
            .unwrap_err()
            .to_string();
        assert!(err.contains("open, closed, local"), "{err}");
    }

    /// Clones share one store, so one budget (a layer's clones in each
    /// worker rely on it).
    #[test]
    fn clones_share_one_budget() {
        let clock = crate::ManualClock::new(0);
        let config = PolicyConfig::new(crate::PolicyKind::FixedWindow, 3, 1000);
        let a = LocalLimiter::with_clock(config, MemoryOptions::default(), clock).unwrap();
        let b = a.clone();
        assert!(a.check_now(7, 2).unwrap().allowed);
        assert_eq!(b.check_now(7, 1).unwrap().remaining, 0);
        assert!(!a.check_now(7, 1).unwrap().allowed);
        assert_eq!(b.store().entries_tracked(), 1);
    }
}
