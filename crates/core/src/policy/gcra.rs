//! `gcra`: the token bucket held as one integer, the theoretical arrival
//! time.

use super::{Divisor, Policy, Wide};
use crate::registry::{check_burst, check_limit, check_window};
use crate::{ConfigError, Decision};

/// The generic cell rate algorithm: the same bucket as
/// [`TokenBucket`](crate::TokenBucket) (capacity `burst`, default `limit`,
/// refilled at `limit` per `window_ms`), kept as a single theoretical
/// arrival time.
///
/// It makes exactly the token bucket's decisions on any trace whose time
/// never steps back (a property test checks this); an earlier `now_ms` only
/// makes it stricter, so it needs no clock-regression rule. It differs from
/// the token bucket in state: one integer, not two.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gcra {
    limit: u64,
    window_ms: u64,
    burst: u64,
    /// `window_ms` and `limit` as divisors, for `remaining` and the wait.
    per_window: Divisor,
    per_limit: Divisor,
}

/// A key's theoretical arrival time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GcraState {
    /// The theoretical arrival time scaled by `limit` (units of
    /// `ms x limit`): the bucket is full at any `now` with
    /// `now * limit >= tat`, and holds `(burst * W - (tat - now * limit)) / W`
    /// tokens before that. Up to 107 bits, held in two words.
    pub tat: Wide,
}

impl Gcra {
    /// `limit` per `window_ms`, holding at most `burst` (`None`: `limit`).
    pub fn new(limit: u64, window_ms: u64, burst: Option<u64>) -> Result<Self, ConfigError> {
        check_limit(limit)?;
        check_window(window_ms)?;
        let burst = burst.unwrap_or(limit);
        check_burst(burst)?;
        Ok(Gcra {
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
}

impl Policy for Gcra {
    type State = GcraState;

    fn new_state(&self, _now_ms: u64) -> GcraState {
        GcraState::default()
    }

    #[inline(always)]
    fn decide(&self, s: &mut GcraState, now_ms: u64, cost: u64) -> Decision {
        let w = u128::from(self.window_ms);
        let capacity = u128::from(self.burst) * w;
        let now_scaled = u128::from(now_ms) * u128::from(self.limit);
        let base = s.tat.get().max(now_scaled);
        // How much of the bucket is spent at `now`, in the same units.
        let spent = base - now_scaled;
        let need = u128::from(cost) * w;
        // Saturating: a state written by hand (the field is public) may
        // hold any arrival time; a valid one stays within `capacity`.
        let spent_after = spent.saturating_add(need);
        if spent_after <= capacity {
            s.tat = Wide::new(base + need);
            return Decision::admitted(self.per_window.div(capacity - spent - need) as u64);
        }
        let remaining = self.per_window.div(capacity.saturating_sub(spent)) as u64;
        let retry = (cost <= self.burst && self.limit > 0)
            .then(|| self.per_limit.div_ceil(spent_after - capacity));
        Decision::refused_exact(retry, remaining)
    }

    fn is_forgettable(&self, s: &GcraState, now_ms: u64) -> bool {
        s.tat.get() <= u128::from(now_ms) * u128::from(self.limit)
    }

    fn limit(&self) -> u64 {
        self.limit
    }

    fn window_ms(&self) -> u64 {
        self.window_ms
    }

    #[inline]
    fn pack(&self, s: &GcraState) -> Option<u64> {
        u64::try_from(s.tat.get()).ok()
    }

    #[inline]
    fn unpack(&self, packed: u64) -> GcraState {
        GcraState {
            tat: Wide::new(u128::from(packed)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(p: &Gcra, s: &mut GcraState, now: u64, cost: u64) -> (bool, Option<u64>, u64) {
        let d = p.decide(s, now, cost);
        (d.allowed, d.retry_after_ms, d.remaining)
    }

    #[test]
    fn spends_at_once_then_refills_continuously() {
        let p = Gcra::new(10, 1000, None).unwrap();
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
    fn an_earlier_time_is_only_stricter() {
        let p = Gcra::new(10, 1000, None).unwrap();
        let mut s = p.new_state(5000);
        assert!(run(&p, &mut s, 5000, 10).0);
        assert_eq!(run(&p, &mut s, 4000, 1), (false, Some(1100), 0));
    }

    #[test]
    fn limit_zero_never_refills() {
        let p = Gcra::new(0, 1000, Some(2)).unwrap();
        let mut s = p.new_state(0);
        assert_eq!(run(&p, &mut s, 0, 2), (true, Some(0), 0));
        assert_eq!(run(&p, &mut s, 1_000_000, 1), (false, None, 0));
    }
}
