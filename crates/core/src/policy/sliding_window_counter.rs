//! `sliding-window-counter`: the current and previous aligned windows, the
//! previous one fading out linearly as the current one fills.

use super::{bits_for, mul_div, time_bound, window_start, Divisor, Policy, WALL_CLOCK_BOUND_MS};
use crate::registry::{check_limit, check_window};
use crate::{ConfigError, Decision};

/// Estimates the count over the trailing window as
/// `carried + current`, with `carried = previous * (W - elapsed) div W`
/// (floored, so every port agrees to the last bit).
///
/// Three integers per key and no boundary burst; the estimate assumes the
/// previous window's traffic was spread evenly, so it can err either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlidingWindowCounter {
    limit: u64,
    window_ms: u64,
    /// `window_ms` as a divisor, for the carried share.
    per_window: Divisor,
    /// Packed layout: `current` in the low `count_bits`, `previous` in the
    /// next `count_bits` (both enough for `limit`), the window above them,
    /// below `time_bound`: its start in ms or, when `by_index`, its index
    /// (`start / window_ms`). The index is chosen when the start in ms
    /// would not fit at wall-clock times (a limit of 2,048 or more), so
    /// that such limits still pack (up to 65,535 per second or 262,143 per
    /// minute, until the year 2100).
    count_bits: u32,
    time_bound: u64,
    by_index: bool,
}

/// A key's two windows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SlidingWindowCounterState {
    /// Start of the current window, `now - now mod window_ms`; the key's
    /// recorded time for the clock-regression rule.
    pub window_start_ms: u64,
    /// Cost admitted in the window before the current one (0 when that
    /// window saw no request or lies more than one window back).
    pub previous: u64,
    /// Cost admitted in the current window.
    pub current: u64,
}

impl SlidingWindowCounter {
    /// `limit` per trailing `window_ms`; `window_ms >= 1`, both at most
    /// `2^53 - 1`.
    pub fn new(limit: u64, window_ms: u64) -> Result<Self, ConfigError> {
        check_limit(limit)?;
        check_window(window_ms)?;
        let count_bits = bits_for(u128::from(limit));
        let time_bound = time_bound(2 * count_bits);
        Ok(SlidingWindowCounter {
            limit,
            window_ms,
            per_window: Divisor::new(window_ms),
            count_bits,
            time_bound,
            by_index: time_bound < WALL_CLOCK_BOUND_MS && window_ms > 1,
        })
    }

    /// `previous * (W - elapsed) div W`.
    #[inline]
    fn carried(&self, previous: u64, elapsed: u64) -> u64 {
        self.per_window
            .div(u128::from(previous) * u128::from(self.window_ms - elapsed)) as u64
    }

    /// The smallest `elapsed` at which `carried(previous, elapsed) <= need`,
    /// for `previous > need`:
    /// `previous * (W - e) < (need + 1) * W  <=>  e > W * (previous - need - 1) / previous`.
    #[inline]
    fn first_elapsed(&self, previous: u64, need: u64) -> u64 {
        mul_div(self.window_ms, previous - need - 1, previous) + 1
    }

    /// The earliest time at which a refused request of `cost <= limit` is
    /// admitted with no other traffic: later in this window, else somewhere
    /// in the next (where `current` becomes `previous`), else two windows
    /// on, where nothing is carried.
    fn admission_time(&self, window: u64, s: &SlidingWindowCounterState, cost: u64) -> u64 {
        let w = self.window_ms;
        if let Some(need) = self
            .limit
            .checked_sub(s.current)
            .and_then(|r| r.checked_sub(cost))
        {
            // Refused here means carried > need, hence previous > need.
            if s.previous > need {
                let e = self.first_elapsed(s.previous, need);
                if e < w {
                    return window.saturating_add(e);
                }
            }
        }
        // Saturating: in range (SPEC's 2^53 - 1) nothing here comes near
        // 2^64, and a bare policy fed a time above it must not panic.
        let next = window.saturating_add(w);
        let need = self.limit - cost;
        if s.current <= need {
            return next;
        }
        let e = self.first_elapsed(s.current, need);
        if e < w {
            next.saturating_add(e)
        } else {
            next.saturating_add(w)
        }
    }
}

impl Policy for SlidingWindowCounter {
    type State = SlidingWindowCounterState;

    fn new_state(&self, now_ms: u64) -> SlidingWindowCounterState {
        SlidingWindowCounterState {
            window_start_ms: now_ms - now_ms % self.window_ms,
            previous: 0,
            current: 0,
        }
    }

    #[inline(always)]
    fn decide(&self, s: &mut SlidingWindowCounterState, now_ms: u64, cost: u64) -> Decision {
        // Clock regression: decided at the recorded window start, never
        // rolling the windows back.
        let now = now_ms.max(s.window_start_ms);
        let window = window_start(now, s.window_start_ms, self.window_ms);
        if window != s.window_start_ms {
            // Only the window just before this one carries; a gap of two
            // windows or more has left the trailing window entirely.
            s.previous = if window == s.window_start_ms.saturating_add(self.window_ms) {
                s.current
            } else {
                0
            };
            s.current = 0;
            s.window_start_ms = window;
        }
        let carried = self.carried(s.previous, now - window);
        let estimate = carried.saturating_add(s.current);
        let left = self.limit.saturating_sub(estimate);
        if cost <= left && estimate <= self.limit {
            s.current += cost;
            return Decision::admitted(left - cost);
        }
        let retry = (cost <= self.limit)
            .then(|| self.admission_time(window, s, cost).saturating_sub(now_ms));
        Decision::refused(retry, left)
    }

    fn is_forgettable(&self, s: &SlidingWindowCounterState, now_ms: u64) -> bool {
        // What still counts: the current window's cost for two windows (one
        // as the previous), the previous window's for one. A key that
        // counts nothing (a peek or a refusal is all it saw) is a new key's
        // from its window's start; kept, it would hold a place a key that
        // counts needs, for two windows.
        let counting_ms = if s.current > 0 {
            self.window_ms.saturating_mul(2)
        } else if s.previous > 0 {
            self.window_ms
        } else {
            0
        };
        now_ms >= s.window_start_ms && now_ms - s.window_start_ms >= counting_ms
    }

    fn limit(&self) -> u64 {
        self.limit
    }

    fn window_ms(&self) -> u64 {
        self.window_ms
    }

    #[inline]
    fn pack(&self, s: &SlidingWindowCounterState) -> Option<u64> {
        let b = self.count_bits;
        let window = if self.by_index {
            // Exact only for a start on a window edge, which every state
            // the policy makes has; any other stays wide.
            let index = s.window_start_ms / self.window_ms;
            if index * self.window_ms != s.window_start_ms {
                return None;
            }
            index
        } else {
            s.window_start_ms
        };
        (window < self.time_bound && s.previous >> b == 0 && s.current >> b == 0).then(|| {
            // `time_bound` is non-zero only when 2 b < 64, so every shift
            // is below 64.
            (window << (2 * b)) | (s.previous << b) | s.current
        })
    }

    #[inline]
    fn unpack(&self, packed: u64) -> SlidingWindowCounterState {
        let b = self.count_bits;
        let mask = (1u64 << b) - 1;
        let window = packed >> (2 * b);
        SlidingWindowCounterState {
            // Below 2^53 when packed: the index times the window is the
            // start it was packed from.
            window_start_ms: if self.by_index {
                window * self.window_ms
            } else {
                window
            },
            previous: (packed >> b) & mask,
            current: packed & mask,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MAX_SAFE;

    fn run(
        p: &SlidingWindowCounter,
        s: &mut SlidingWindowCounterState,
        now: u64,
        cost: u64,
    ) -> (bool, Option<u64>, u64) {
        let d = p.decide(s, now, cost);
        (d.allowed, d.retry_after_ms, d.remaining)
    }

    #[test]
    fn flooring_admits_one_ms_into_the_window() {
        let p = SlidingWindowCounter::new(5, 1000).unwrap();
        let mut s = p.new_state(100);
        for (i, now) in [100, 200, 300, 400, 999].into_iter().enumerate() {
            assert_eq!(run(&p, &mut s, now, 1), (true, Some(0), 4 - i as u64));
        }
        assert_eq!(run(&p, &mut s, 999, 1), (false, Some(2), 0));
        // carried = 5 * 999 div 1000 = 4: the exact 4.995 would refuse.
        assert_eq!(run(&p, &mut s, 1001, 1), (true, Some(0), 0));
        assert_eq!(run(&p, &mut s, 1001, 1), (false, Some(200), 0));
    }

    #[test]
    fn full_current_window_waits_to_the_edge_plus_one() {
        let p = SlidingWindowCounter::new(3, 1000).unwrap();
        let mut s = p.new_state(10);
        for now in [10, 20, 30] {
            assert!(run(&p, &mut s, now, 1).0);
        }
        assert_eq!(run(&p, &mut s, 40, 1), (false, Some(961), 0));
        assert_eq!(run(&p, &mut s, 1000, 1), (false, Some(1), 0));
        assert_eq!(run(&p, &mut s, 1001, 1), (true, Some(0), 0));
    }

    #[test]
    fn large_cost_waits_into_the_next_window() {
        // limit 10, 8 spent at 0..: cost 9 needs carried <= 1 next window.
        let p = SlidingWindowCounter::new(10, 1000).unwrap();
        let mut s = p.new_state(0);
        assert!(run(&p, &mut s, 0, 8).0);
        let (allowed, retry, remaining) = run(&p, &mut s, 500, 9);
        assert!(!allowed);
        assert_eq!(remaining, 2);
        // 8 * (1000 - e) < 2 * 1000  <=>  e > 750: admitted at 1751.
        assert_eq!(retry, Some(1251));
        let mut later = s;
        assert!(!run(&p, &mut later.clone(), 1750, 9).0);
        assert!(run(&p, &mut later, 1751, 9).0);
    }

    #[test]
    fn previous_at_least_window_waits_two_windows() {
        // window 2 ms, limit 5: carried never falls below need before the
        // window ends, so the wait runs two windows on.
        let p = SlidingWindowCounter::new(5, 2).unwrap();
        let mut s = p.new_state(0);
        assert!(run(&p, &mut s, 0, 5).0);
        let (allowed, retry, _) = run(&p, &mut s, 1, 5);
        assert!(!allowed);
        // At 2: carried 5; at 3: carried 5 * 1 div 2 = 2; at 4: nothing.
        assert_eq!(retry, Some(3));
    }

    #[test]
    fn clock_regression_decides_at_window_start() {
        let p = SlidingWindowCounter::new(5, 1000).unwrap();
        let mut s = p.new_state(1500);
        assert_eq!(run(&p, &mut s, 1500, 5), (true, Some(0), 0));
        assert_eq!(run(&p, &mut s, 900, 1), (false, Some(1101), 0));
        assert_eq!(run(&p, &mut s, 2600, 1), (true, Some(0), 2));
    }

    #[test]
    fn numbers_near_2_pow_53_do_not_overflow() {
        let p = SlidingWindowCounter::new(MAX_SAFE, MAX_SAFE).unwrap();
        let mut s = p.new_state(MAX_SAFE - 1);
        assert_eq!(run(&p, &mut s, MAX_SAFE - 1, MAX_SAFE), (true, Some(0), 0));
        let (allowed, retry, remaining) = run(&p, &mut s, MAX_SAFE, 1);
        assert!(!allowed);
        assert_eq!(remaining, 0);
        // The window starting at W = MAX_SAFE carries all MAX_SAFE; one
        // millisecond later the carried part floors to MAX_SAFE - 1.
        assert_eq!(retry, Some(1));
    }

    /// What counts decides how long a key is kept: its current window's
    /// cost two windows, its previous window's one, nothing not at all.
    #[test]
    fn a_key_is_forgettable_once_nothing_it_counted_counts() {
        let p = SlidingWindowCounter::new(5, 1000).unwrap();
        // Only peeks and a refusal of a cost above the limit: at once.
        let mut s = p.new_state(1100);
        assert!(p.decide(&mut s, 1100, 0).allowed);
        assert!(!p.decide(&mut s, 1200, 6).allowed);
        assert!(p.is_forgettable(&s, 1200));
        assert!(!p.is_forgettable(&s, 999));
        // One admitted at 1100: until 3000.
        p.decide(&mut s, 1100, 1);
        assert!(!p.is_forgettable(&s, 2999));
        assert!(p.is_forgettable(&s, 3000));
        // Rolled into the next window by a peek, it still carries that
        // cost as the previous window's, until 3000 too.
        assert!(p.decide(&mut s, 2500, 0).allowed);
        assert_eq!((s.previous, s.current), (1, 0));
        assert!(!p.is_forgettable(&s, 2999));
        assert!(p.is_forgettable(&s, 3000));
    }
}
