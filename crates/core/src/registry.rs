//! The registry: policies by name, configurations validated once.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::policy::{FixedWindow, Gcra, Policy, SlidingLog, SlidingWindowCounter, TokenBucket};
use crate::{ConfigError, Decision, MAX_SAFE};

/// The five policies, by their registry names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyKind {
    /// `fixed-window`: one count per aligned window.
    FixedWindow,
    /// `sliding-window-counter`: two aligned windows, the older fading out.
    SlidingWindowCounter,
    /// `sliding-log`: every admitted request, exact.
    SlidingLog,
    /// `token-bucket`: a bucket refilled continuously.
    TokenBucket,
    /// `gcra`: the token bucket as one theoretical arrival time.
    Gcra,
}

impl PolicyKind {
    /// Every policy, in the registry's order.
    pub const ALL: [PolicyKind; 5] = [
        PolicyKind::FixedWindow,
        PolicyKind::SlidingWindowCounter,
        PolicyKind::SlidingLog,
        PolicyKind::TokenBucket,
        PolicyKind::Gcra,
    ];

    /// The registry name, e.g. `sliding-window-counter`.
    pub const fn name(self) -> &'static str {
        match self {
            PolicyKind::FixedWindow => "fixed-window",
            PolicyKind::SlidingWindowCounter => "sliding-window-counter",
            PolicyKind::SlidingLog => "sliding-log",
            PolicyKind::TokenBucket => "token-bucket",
            PolicyKind::Gcra => "gcra",
        }
    }

    /// Whether the policy is a bucket and takes a `burst`.
    pub const fn has_burst(self) -> bool {
        matches!(self, PolicyKind::TokenBucket | PolicyKind::Gcra)
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PolicyKind {
    type Err = ConfigError;

    /// Looks a policy up by its registry name.
    ///
    /// ```
    /// use ratewarden_core::PolicyKind;
    /// assert_eq!("gcra".parse::<PolicyKind>().unwrap(), PolicyKind::Gcra);
    /// assert!("leaky-bucket".parse::<PolicyKind>().is_err());
    /// ```
    fn from_str(name: &str) -> Result<Self, ConfigError> {
        PolicyKind::ALL
            .into_iter()
            .find(|k| k.name() == name)
            .ok_or_else(|| ConfigError::UnknownPolicy {
                name: name.to_owned(),
            })
    }
}

/// A policy's configuration as a user writes it; [`PolicyConfig::build`]
/// validates it once and yields the policy.
///
/// Read with serde, a field it does not know is refused: `"burts": 5`
/// would otherwise mean no burst at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyConfig {
    /// Which policy.
    pub policy: PolicyKind,
    /// Permits per window (the refill rate for the buckets).
    pub limit: u64,
    /// The window, in ms; at least 1.
    pub window_ms: u64,
    /// The bucket's capacity for `token-bucket` and `gcra` (default:
    /// `limit`); not allowed for the window policies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<u64>,
}

/// The reference configuration: `sliding-window-counter`, 100 per 1000 ms.
/// Benchmarks and examples use it unless they say otherwise.
pub const REFERENCE: PolicyConfig = PolicyConfig {
    policy: PolicyKind::SlidingWindowCounter,
    limit: 100,
    window_ms: 1000,
    burst: None,
};

impl Default for PolicyConfig {
    fn default() -> Self {
        REFERENCE
    }
}

impl PolicyConfig {
    /// `limit` per `window_ms` under `policy`, with no burst.
    pub const fn new(policy: PolicyKind, limit: u64, window_ms: u64) -> Self {
        PolicyConfig {
            policy,
            limit,
            window_ms,
            burst: None,
        }
    }

    /// The same configuration with a bucket capacity.
    pub const fn with_burst(mut self, burst: u64) -> Self {
        self.burst = Some(burst);
        self
    }

    /// Validates the configuration and builds the policy.
    ///
    /// ```
    /// use ratewarden_core::{PolicyConfig, PolicyKind};
    /// let err = PolicyConfig::new(PolicyKind::FixedWindow, 10, 0).build().unwrap_err();
    /// assert!(err.to_string().contains("window_ms is 0"));
    /// let err = PolicyConfig::new(PolicyKind::FixedWindow, 10, 1000)
    ///     .with_burst(20)
    ///     .build()
    ///     .unwrap_err();
    /// assert!(err.to_string().contains("remove burst"));
    /// ```
    pub fn build(&self) -> Result<AnyPolicy, ConfigError> {
        if self.burst.is_some() && !self.policy.has_burst() {
            return Err(ConfigError::BurstNotAllowed {
                policy: self.policy.name(),
            });
        }
        let (l, w, b) = (self.limit, self.window_ms, self.burst);
        Ok(match self.policy {
            PolicyKind::FixedWindow => AnyPolicy::FixedWindow(FixedWindow::new(l, w)?),
            PolicyKind::SlidingWindowCounter => {
                AnyPolicy::SlidingWindowCounter(SlidingWindowCounter::new(l, w)?)
            }
            PolicyKind::SlidingLog => AnyPolicy::SlidingLog(SlidingLog::new(l, w)?),
            PolicyKind::TokenBucket => AnyPolicy::TokenBucket(TokenBucket::new(l, w, b)?),
            PolicyKind::Gcra => AnyPolicy::Gcra(Gcra::new(l, w, b)?),
        })
    }

    /// The bucket capacity in effect: `burst`, or `limit` when unset.
    pub fn effective_burst(&self) -> u64 {
        self.burst.unwrap_or(self.limit)
    }

    /// Whether a limiter built for `self` decides as one built for `other`
    /// would: the same policy and numbers, a default burst and that default
    /// written out (`burst = limit`) being one. The Redis store names its
    /// keys by the burst in effect too, so such limiters share counts.
    ///
    /// ```
    /// use ratewarden_core::{PolicyConfig, PolicyKind};
    /// let bucket = PolicyConfig::new(PolicyKind::TokenBucket, 10, 1000);
    /// assert!(bucket.decides_alike(&bucket.with_burst(10)));
    /// assert!(!bucket.decides_alike(&bucket.with_burst(20)));
    /// ```
    pub fn decides_alike(&self, other: &PolicyConfig) -> bool {
        (
            self.policy,
            self.limit,
            self.window_ms,
            self.effective_burst(),
        ) == (
            other.policy,
            other.limit,
            other.window_ms,
            other.effective_burst(),
        )
    }

    /// The largest cost any request can be admitted with: a bucket's burst,
    /// a window's limit. A larger cost is refused with no wait, whatever
    /// the state.
    ///
    /// ```
    /// use ratewarden_core::{PolicyConfig, PolicyKind, REFERENCE};
    /// assert_eq!(REFERENCE.capacity(), 100);
    /// let bucket = PolicyConfig::new(PolicyKind::Gcra, 10, 1000).with_burst(40);
    /// assert_eq!(bucket.capacity(), 40);
    /// ```
    pub fn capacity(&self) -> u64 {
        if self.policy.has_burst() {
            self.effective_burst()
        } else {
            self.limit
        }
    }

    /// The longest a key's state can still count after the latest time it
    /// was decided at, in ms: once this long has passed with no request,
    /// the key is forgettable ([`Policy::is_forgettable`]) and a store may
    /// drop it. So a store of `max_keys` keys holds every key of a rule
    /// that sees at most `max_keys` distinct keys in any span this long.
    /// `None` for a bucket with a limit of 0, which never refills, so a
    /// key that spent anything is never forgettable.
    ///
    /// The windows: one window (fixed window, sliding log), two for the
    /// sliding-window counter (its previous window still counts). The
    /// buckets: the time to refill from empty, `burst * window_ms / limit`
    /// rounded up.
    ///
    /// ```
    /// use ratewarden_core::{PolicyConfig, PolicyKind, REFERENCE};
    /// assert_eq!(REFERENCE.idle_until_forgettable_ms(), Some(2_000));
    /// let bucket = PolicyConfig::new(PolicyKind::TokenBucket, 10, 1000).with_burst(25);
    /// assert_eq!(bucket.idle_until_forgettable_ms(), Some(2_500));
    /// let closed = PolicyConfig::new(PolicyKind::Gcra, 0, 1000).with_burst(5);
    /// assert_eq!(closed.idle_until_forgettable_ms(), None);
    /// ```
    pub fn idle_until_forgettable_ms(&self) -> Option<u64> {
        let window_ms = self.window_ms;
        match self.policy {
            PolicyKind::FixedWindow | PolicyKind::SlidingLog => Some(window_ms),
            PolicyKind::SlidingWindowCounter => Some(window_ms.saturating_mul(2)),
            PolicyKind::TokenBucket | PolicyKind::Gcra => {
                if self.limit == 0 {
                    return None;
                }
                let refill = (u128::from(self.effective_burst()) * u128::from(window_ms))
                    .div_ceil(u128::from(self.limit));
                Some(u64::try_from(refill).unwrap_or(u64::MAX))
            }
        }
    }

    /// The decision for `cost` that needs no state, if there is one: a cost
    /// above [`PolicyConfig::capacity`] is refused with no wait by every
    /// state, so a limiter whose store failed gives this answer under every
    /// failure policy, as the store would have. Its `remaining` is 0: what
    /// the key has left is in the store that failed.
    ///
    /// ```
    /// use ratewarden_core::{Decision, REFERENCE};
    /// assert_eq!(REFERENCE.refused_whatever_the_state(100), None);
    /// assert_eq!(
    ///     REFERENCE.refused_whatever_the_state(101),
    ///     Some(Decision::refused(None, 0))
    /// );
    /// ```
    pub fn refused_whatever_the_state(&self, cost: u64) -> Option<Decision> {
        (cost > self.capacity()).then(|| Decision::refused(None, 0))
    }

    /// The refusal of the `closed` failure policy: retry after a second, or
    /// after the window when it is shorter, by when the store may answer
    /// again. Its `remaining` is 0, so that a client reading it slows down:
    /// what the key has left is in the store that failed.
    ///
    /// ```
    /// use ratewarden_core::{Decision, PolicyConfig, PolicyKind, REFERENCE};
    /// assert_eq!(REFERENCE.refused_while_failing(), Decision::refused(Some(1000), 0));
    /// let short = PolicyConfig::new(PolicyKind::FixedWindow, 5, 250);
    /// assert_eq!(short.refused_while_failing(), Decision::refused(Some(250), 0));
    /// ```
    pub fn refused_while_failing(&self) -> Decision {
        Decision::refused(Some(self.window_ms.clamp(1, 1000)), 0)
    }
}

impl fmt::Display for PolicyConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} per {} ms",
            self.policy, self.limit, self.window_ms
        )?;
        if let Some(b) = self.burst {
            write!(f, " (burst {b})")?;
        }
        Ok(())
    }
}

pub(crate) fn check_limit(limit: u64) -> Result<(), ConfigError> {
    check_range("limit", limit)
}

pub(crate) fn check_burst(burst: u64) -> Result<(), ConfigError> {
    check_range("burst", burst)
}

pub(crate) fn check_window(window_ms: u64) -> Result<(), ConfigError> {
    if window_ms == 0 {
        return Err(ConfigError::ZeroWindow);
    }
    check_range("window_ms", window_ms)
}

fn check_range(field: &'static str, value: u64) -> Result<(), ConfigError> {
    if value > MAX_SAFE {
        return Err(ConfigError::OutOfRange {
            field,
            value: u128::from(value),
        });
    }
    Ok(())
}

/// Any policy of the registry, chosen at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AnyPolicy {
    /// `fixed-window`.
    FixedWindow(FixedWindow),
    /// `sliding-window-counter`.
    SlidingWindowCounter(SlidingWindowCounter),
    /// `sliding-log`.
    SlidingLog(SlidingLog),
    /// `token-bucket`.
    TokenBucket(TokenBucket),
    /// `gcra`.
    Gcra(Gcra),
}

/// The state of a key under an [`AnyPolicy`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AnyState {
    /// `fixed-window` state.
    FixedWindow(crate::policy::FixedWindowState),
    /// `sliding-window-counter` state.
    SlidingWindowCounter(crate::policy::SlidingWindowCounterState),
    /// `sliding-log` state.
    SlidingLog(crate::policy::SlidingLogState),
    /// `token-bucket` state.
    TokenBucket(crate::policy::TokenBucketState),
    /// `gcra` state.
    Gcra(crate::policy::GcraState),
}

impl AnyPolicy {
    /// The registry entry this policy belongs to.
    pub fn kind(&self) -> PolicyKind {
        match self {
            AnyPolicy::FixedWindow(_) => PolicyKind::FixedWindow,
            AnyPolicy::SlidingWindowCounter(_) => PolicyKind::SlidingWindowCounter,
            AnyPolicy::SlidingLog(_) => PolicyKind::SlidingLog,
            AnyPolicy::TokenBucket(_) => PolicyKind::TokenBucket,
            AnyPolicy::Gcra(_) => PolicyKind::Gcra,
        }
    }
}

impl Policy for AnyPolicy {
    type State = AnyState;

    fn new_state(&self, now_ms: u64) -> AnyState {
        match self {
            AnyPolicy::FixedWindow(p) => AnyState::FixedWindow(p.new_state(now_ms)),
            AnyPolicy::SlidingWindowCounter(p) => {
                AnyState::SlidingWindowCounter(p.new_state(now_ms))
            }
            AnyPolicy::SlidingLog(p) => AnyState::SlidingLog(p.new_state(now_ms)),
            AnyPolicy::TokenBucket(p) => AnyState::TokenBucket(p.new_state(now_ms)),
            AnyPolicy::Gcra(p) => AnyState::Gcra(p.new_state(now_ms)),
        }
    }

    fn decide(&self, state: &mut AnyState, now_ms: u64, cost: u64) -> Decision {
        match (self, &mut *state) {
            (AnyPolicy::FixedWindow(p), AnyState::FixedWindow(s)) => p.decide(s, now_ms, cost),
            (AnyPolicy::SlidingWindowCounter(p), AnyState::SlidingWindowCounter(s)) => {
                p.decide(s, now_ms, cost)
            }
            (AnyPolicy::SlidingLog(p), AnyState::SlidingLog(s)) => p.decide(s, now_ms, cost),
            (AnyPolicy::TokenBucket(p), AnyState::TokenBucket(s)) => p.decide(s, now_ms, cost),
            (AnyPolicy::Gcra(p), AnyState::Gcra(s)) => p.decide(s, now_ms, cost),
            // A state of another policy is the caller's mistake; starting
            // the key afresh is the only state this policy can vouch for.
            _ => {
                *state = self.new_state(now_ms);
                self.decide(state, now_ms, cost)
            }
        }
    }

    fn is_forgettable(&self, state: &AnyState, now_ms: u64) -> bool {
        match (self, state) {
            (AnyPolicy::FixedWindow(p), AnyState::FixedWindow(s)) => p.is_forgettable(s, now_ms),
            (AnyPolicy::SlidingWindowCounter(p), AnyState::SlidingWindowCounter(s)) => {
                p.is_forgettable(s, now_ms)
            }
            (AnyPolicy::SlidingLog(p), AnyState::SlidingLog(s)) => p.is_forgettable(s, now_ms),
            (AnyPolicy::TokenBucket(p), AnyState::TokenBucket(s)) => p.is_forgettable(s, now_ms),
            (AnyPolicy::Gcra(p), AnyState::Gcra(s)) => p.is_forgettable(s, now_ms),
            _ => true,
        }
    }

    fn limit(&self) -> u64 {
        match self {
            AnyPolicy::FixedWindow(p) => p.limit(),
            AnyPolicy::SlidingWindowCounter(p) => p.limit(),
            AnyPolicy::SlidingLog(p) => p.limit(),
            AnyPolicy::TokenBucket(p) => p.limit(),
            AnyPolicy::Gcra(p) => p.limit(),
        }
    }

    fn window_ms(&self) -> u64 {
        match self {
            AnyPolicy::FixedWindow(p) => p.window_ms(),
            AnyPolicy::SlidingWindowCounter(p) => p.window_ms(),
            AnyPolicy::SlidingLog(p) => p.window_ms(),
            AnyPolicy::TokenBucket(p) => p.window_ms(),
            AnyPolicy::Gcra(p) => p.window_ms(),
        }
    }

    #[inline]
    fn pack(&self, state: &AnyState) -> Option<u64> {
        match (self, state) {
            (AnyPolicy::FixedWindow(p), AnyState::FixedWindow(s)) => p.pack(s),
            (AnyPolicy::SlidingWindowCounter(p), AnyState::SlidingWindowCounter(s)) => p.pack(s),
            (AnyPolicy::TokenBucket(p), AnyState::TokenBucket(s)) => p.pack(s),
            (AnyPolicy::Gcra(p), AnyState::Gcra(s)) => p.pack(s),
            _ => None,
        }
    }

    #[inline]
    fn unpack(&self, packed: u64) -> AnyState {
        match self {
            AnyPolicy::FixedWindow(p) => AnyState::FixedWindow(p.unpack(packed)),
            AnyPolicy::SlidingWindowCounter(p) => AnyState::SlidingWindowCounter(p.unpack(packed)),
            AnyPolicy::SlidingLog(p) => AnyState::SlidingLog(p.unpack(packed)),
            AnyPolicy::TokenBucket(p) => AnyState::TokenBucket(p.unpack(packed)),
            AnyPolicy::Gcra(p) => AnyState::Gcra(p.unpack(packed)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_round_trips() {
        for kind in PolicyKind::ALL {
            assert_eq!(kind.name().parse::<PolicyKind>().unwrap(), kind);
            let json = serde_json::to_string(&kind).unwrap();
            assert_eq!(json, format!("\"{}\"", kind.name()));
        }
    }

    #[test]
    fn a_misspelt_field_is_refused_not_ignored() {
        let good = r#"{"policy":"token-bucket","limit":10,"window_ms":1000,"burst":5}"#;
        let config: PolicyConfig = serde_json::from_str(good).unwrap();
        assert_eq!(config.burst, Some(5));
        let typo = r#"{"policy":"token-bucket","limit":10,"window_ms":1000,"burts":5}"#;
        let err = serde_json::from_str::<PolicyConfig>(typo)
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown field `burts`"), "{err}");
    }

    #[test]
    fn unknown_name_lists_the_known_ones() {
        let err = "sliding-window"
            .parse::<PolicyKind>()
            .unwrap_err()
            .to_string();
        assert!(err.contains("\"sliding-window\""), "{err}");
        assert!(err.contains("sliding-window-counter"), "{err}");
    }

    #[test]
    fn bad_configurations_say_what_to_change() {
        use PolicyKind::*;
        let cases = [
            (PolicyConfig::new(SlidingLog, 10, 0), "window_ms is 0"),
            (
                PolicyConfig::new(FixedWindow, MAX_SAFE + 1, 1000),
                "limit is 9007199254740992",
            ),
            (
                PolicyConfig::new(Gcra, 1, MAX_SAFE + 1),
                "window_ms is 9007199254740992",
            ),
            (
                PolicyConfig::new(TokenBucket, 1, 10).with_burst(MAX_SAFE + 1),
                "burst is",
            ),
            (
                PolicyConfig::new(SlidingWindowCounter, 1, 10).with_burst(5),
                "remove burst",
            ),
            (
                PolicyConfig::new(FixedWindow, 1, 10).with_burst(5),
                "remove burst",
            ),
            (
                PolicyConfig::new(SlidingLog, 1, 10).with_burst(5),
                "remove burst",
            ),
        ];
        for (config, needle) in cases {
            let err = config.build().unwrap_err().to_string();
            assert!(err.contains(needle), "{config:?}: {err}");
        }
    }

    #[test]
    fn limits_at_the_edges_of_the_range_are_valid() {
        for kind in PolicyKind::ALL {
            PolicyConfig::new(kind, 0, 1).build().unwrap();
            PolicyConfig::new(kind, MAX_SAFE, MAX_SAFE).build().unwrap();
        }
        PolicyConfig::new(PolicyKind::Gcra, 1, 1)
            .with_burst(MAX_SAFE)
            .build()
            .unwrap();
    }

    #[test]
    fn reference_is_100_per_second_sliding_window_counter() {
        assert_eq!(REFERENCE.policy.name(), "sliding-window-counter");
        assert_eq!((REFERENCE.limit, REFERENCE.window_ms), (100, 1000));
        assert_eq!(
            REFERENCE.build().unwrap().kind(),
            PolicyKind::SlidingWindowCounter
        );
    }
}
