//! `token-bucket`: a bucket of `burst` tokens refilled continuously at
//! `limit` per `window_ms`.

use super::{bits_for, gcd, time_bound, Divisor, Policy, Wide, WALL_CLOCK_BOUND_MS};
use crate::registry::{check_burst, check_limit, check_window};
use crate::{ConfigError, Decision};

/// Capacity `burst` (default `limit`), refilled at `limit` permits per
/// `window_ms`; a new key starts full.
///
/// Exact in integers by counting `level = tokens * window_ms`, which grows
/// by `limit` each millisecond. [`Gcra`](crate::Gcra) decides identically
/// on any trace whose time never steps back, in one integer instead of two.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenBucket {
    limit: u64,
    window_ms: u64,
    burst: u64,
    /// `window_ms` and `limit` as divisors, for `remaining` and the wait.
    per_window: Divisor,
    per_limit: Divisor,
    /// Packed layout: the level divided by `level_unit` in the low
    /// `level_bits` (enough for the capacity), the last refill time above
    /// it, below `time_bound`. Every level is a multiple of
    /// `gcd(limit, window_ms)` (it starts at `burst * W`, gains `L` a
    /// millisecond and loses `cost * W`); `level_unit` is that divisor when
    /// the level in units of 1 would leave too few bits for wall-clock
    /// times (`burst * W` of 2^22 or more, as 1,000 per minute), else 1.
    level_bits: u32,
    level_unit: u64,
    time_bound: u64,
}

/// A key's bucket. Its `Default` is an empty bucket refilled at time 0,
/// not a new key's (which is full): a new key's state is
/// [`Policy::new_state`](crate::Policy::new_state).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TokenBucketState {
    /// Tokens scaled by `window_ms` (`tokens * W`), at most `burst * W`.
    /// Up to 106 bits, held in two words.
    pub level: Wide,
    /// When `level` was last refilled; the key's recorded time for the
    /// clock-regression rule.
    pub last_ms: u64,
}

impl TokenBucket {
    /// `limit` per `window_ms`, holding at most `burst` (`None`: `limit`).
    pub fn new(limit: u64, window_ms: u64, burst: Option<u64>) -> Result<Self, ConfigError> {
        check_limit(limit)?;
        check_window(window_ms)?;
        let burst = burst.unwrap_or(limit);
        check_burst(burst)?;
        let capacity = u128::from(burst) * u128::from(window_ms);
        let mut level_unit = 1;
        if time_bound(bits_for(capacity)) < WALL_CLOCK_BOUND_MS {
            level_unit = gcd(limit, window_ms);
        }
        let level_bits = bits_for(capacity / u128::from(level_unit));
        Ok(TokenBucket {
            level_bits,
            level_unit,
            time_bound: time_bound(level_bits),
            limit,
            window_ms,
            burst,
            per_window: Divisor::new(window_ms),
            per_limit: Divisor::new(limit),
        })
    }

    /// The bucket's capacity in tokens.
    pub fn burst(&self) -> u64 {
        self.burst
    }

    fn capacity(&self) -> u128 {
        u128::from(self.burst) * u128::from(self.window_ms)
    }
}

impl Policy for TokenBucket {
    type State = TokenBucketState;

    fn new_state(&self, now_ms: u64) -> TokenBucketState {
        TokenBucketState {
            level: Wide::new(self.capacity()),
            last_ms: now_ms,
        }
    }

    #[inline(always)]
    fn decide(&self, s: &mut TokenBucketState, now_ms: u64, cost: u64) -> Decision {
        // Clock regression: decided at the last refill, so a clock that
        // steps back never refills the bucket twice.
        let now = now_ms.max(s.last_ms);
        let w = u128::from(self.window_ms);
        let refill = u128::from(now - s.last_ms) * u128::from(self.limit);
        // Saturating: a state written by hand (the fields are public) may
        // hold any level; a valid one never comes near u128's bound.
        let mut level = s.level.get().saturating_add(refill).min(self.capacity());
        s.last_ms = now;
        let need = u128::from(cost) * w;
        if level >= need {
            level -= need;
            s.level = Wide::new(level);
            return Decision::admitted(self.per_window.div(level) as u64);
        }
        s.level = Wide::new(level);
        let retry = (cost <= self.burst && self.limit > 0).then(|| {
            let wait = self.per_limit.div_ceil(need - level);
            wait + u128::from(now - now_ms)
        });
        Decision::refused_exact(retry, self.per_window.div(level) as u64)
    }

    fn is_forgettable(&self, s: &TokenBucketState, now_ms: u64) -> bool {
        // Full at `now_ms`, and not refilled after it: a bucket last
        // refilled later refills from that later time, where a new key
        // made at `now_ms` or after would start refilling sooner.
        now_ms >= s.last_ms
            && s.level
                .get()
                .saturating_add(u128::from(now_ms - s.last_ms) * u128::from(self.limit))
                >= self.capacity()
    }

    fn limit(&self) -> u64 {
        self.limit
    }

    fn window_ms(&self) -> u64 {
        self.window_ms
    }

    #[inline]
    fn pack(&self, s: &TokenBucketState) -> Option<u64> {
        // A level past 64 bits stays wide: no layout has room for it.
        let mut level = u64::try_from(s.level.get()).ok()?;
        if self.level_unit > 1 {
            // Exact only for a multiple of the unit, which every level the
            // policy makes is; any other stays wide.
            if level % self.level_unit != 0 {
                return None;
            }
            level /= self.level_unit;
        }
        // `time_bound` is non-zero only when `level_bits < 64`, so the
        // shift is evaluated only below 64.
        (s.last_ms < self.time_bound && level >> self.level_bits == 0)
            .then(|| (s.last_ms << self.level_bits) | level)
    }

    #[inline]
    fn unpack(&self, packed: u64) -> TokenBucketState {
        let level = packed & ((1u64 << self.level_bits) - 1);
        TokenBucketState {
            level: Wide::new(if self.level_unit > 1 {
                u128::from(level) * u128::from(self.level_unit)
            } else {
                u128::from(level)
            }),
            last_ms: packed >> self.level_bits,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MAX_SAFE;

    fn run(
        p: &TokenBucket,
        s: &mut TokenBucketState,
        now: u64,
        cost: u64,
    ) -> (bool, Option<u64>, u64) {
        let d = p.decide(s, now, cost);
        (d.allowed, d.retry_after_ms, d.remaining)
    }

    /// A state written by hand (its fields are public) with a level past
    /// any bucket's is decided as a full bucket, not a panic (an overflow
    /// in a debug build).
    #[test]
    fn a_level_past_the_capacity_is_a_full_bucket() {
        let p = TokenBucket::new(10, 1000, None).unwrap();
        let mut s = TokenBucketState {
            level: Wide::new(u128::MAX),
            last_ms: 0,
        };
        assert_eq!(run(&p, &mut s, 5, 1), (true, Some(0), 9));
    }

    #[test]
    fn spends_at_once_then_refills_continuously() {
        let p = TokenBucket::new(10, 1000, None).unwrap();
        let mut s = p.new_state(0);
        assert_eq!(run(&p, &mut s, 0, 10), (true, Some(0), 0));
        assert_eq!(run(&p, &mut s, 0, 1), (false, Some(100), 0));
        assert_eq!(run(&p, &mut s, 50, 1), (false, Some(50), 0));
        assert_eq!(run(&p, &mut s, 99, 1), (false, Some(1), 0));
        assert_eq!(run(&p, &mut s, 100, 1), (true, Some(0), 0));
        assert_eq!(run(&p, &mut s, 150, 3), (false, Some(250), 0));
        assert_eq!(run(&p, &mut s, 5000, 0), (true, Some(0), 10));
    }

    #[test]
    fn burst_above_rate_and_cost_above_burst() {
        let p = TokenBucket::new(2, 1000, Some(5)).unwrap();
        let mut s = p.new_state(0);
        assert_eq!(run(&p, &mut s, 0, 5), (true, Some(0), 0));
        assert_eq!(run(&p, &mut s, 0, 1), (false, Some(500), 0));
        assert_eq!(run(&p, &mut s, 0, 6), (false, None, 0));
        assert_eq!(run(&p, &mut s, 2400, 5), (false, Some(100), 4));
        assert_eq!(run(&p, &mut s, 2400, 1), (true, Some(0), 3));
    }

    #[test]
    fn limit_zero_never_refills() {
        let p = TokenBucket::new(0, 1000, Some(2)).unwrap();
        let mut s = p.new_state(0);
        assert_eq!(run(&p, &mut s, 0, 2), (true, Some(0), 0));
        assert_eq!(run(&p, &mut s, 1_000_000, 1), (false, None, 0));
    }

    #[test]
    fn clock_regression_never_refills() {
        let p = TokenBucket::new(10, 1000, None).unwrap();
        let mut s = p.new_state(5000);
        assert!(run(&p, &mut s, 5000, 10).0);
        // Decided at 5000: empty; the wait counts from the caller's time.
        assert_eq!(run(&p, &mut s, 4000, 1), (false, Some(1100), 0));
    }

    #[test]
    fn waits_beyond_u64_are_exact() {
        let p = TokenBucket::new(1, MAX_SAFE, Some(MAX_SAFE)).unwrap();
        let mut s = p.new_state(0);
        assert!(run(&p, &mut s, 0, MAX_SAFE).0);
        // Empty: the whole burst takes MAX_SAFE windows of MAX_SAFE ms.
        let d = p.decide(&mut s, 0, MAX_SAFE);
        let full = u128::from(MAX_SAFE) * u128::from(MAX_SAFE);
        assert_eq!(d.retry_after_exact_ms(), Some(full));
        assert_eq!(run(&p, &mut s, 0, MAX_SAFE), (false, Some(u64::MAX), 0));
        assert_eq!(run(&p, &mut s, 0, 1), (false, Some(MAX_SAFE), 0));
    }
}
