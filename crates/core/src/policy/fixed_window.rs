//! `fixed-window`: one count per aligned window.

use super::{bits_for, time_bound, window_start, Policy};
use crate::registry::{check_limit, check_window};
use crate::{ConfigError, Decision};

/// At most `limit` per aligned window of `window_ms` (`[k W, (k+1) W)`).
///
/// Cheap (one count per key) but lets `2 x limit` through around an edge: a
/// full budget just before it and another just after.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FixedWindow {
    limit: u64,
    window_ms: u64,
    /// Packed layout: the count in the low `count_bits` (enough for
    /// `limit`), the window start above it, below `time_bound`.
    count_bits: u32,
    time_bound: u64,
}

/// A key's fixed window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FixedWindowState {
    /// Start of the window `current` counts in: `now - now mod window_ms`.
    /// It is the key's recorded time for the clock-regression rule.
    pub window_start_ms: u64,
    /// Cost admitted in that window. Never above `limit`.
    pub current: u64,
}

impl FixedWindow {
    /// `limit` per `window_ms`; `window_ms >= 1`, both at most `2^53 - 1`.
    pub fn new(limit: u64, window_ms: u64) -> Result<Self, ConfigError> {
        check_limit(limit)?;
        check_window(window_ms)?;
        let count_bits = bits_for(u128::from(limit));
        Ok(FixedWindow {
            limit,
            window_ms,
            count_bits,
            time_bound: time_bound(count_bits),
        })
    }
}

impl Policy for FixedWindow {
    type State = FixedWindowState;

    fn new_state(&self, now_ms: u64) -> FixedWindowState {
        FixedWindowState {
            window_start_ms: now_ms - now_ms % self.window_ms,
            current: 0,
        }
    }

    #[inline(always)]
    fn decide(&self, s: &mut FixedWindowState, now_ms: u64, cost: u64) -> Decision {
        // Clock regression: a request from before the recorded window is
        // decided at its start, so a clock that steps back never resets it.
        let now = now_ms.max(s.window_start_ms);
        let window = window_start(now, s.window_start_ms, self.window_ms);
        if window != s.window_start_ms {
            s.current = 0;
            s.window_start_ms = window;
        }
        let left = self.limit.saturating_sub(s.current);
        if cost <= left {
            s.current += cost;
            return Decision::admitted(left - cost);
        }
        // Counts never fall inside a window, so the next window is the
        // first chance, and there the count is 0.
        let retry = (cost <= self.limit)
            .then(|| window.saturating_add(self.window_ms).saturating_sub(now_ms));
        Decision::refused(retry, left)
    }

    fn is_forgettable(&self, s: &FixedWindowState, now_ms: u64) -> bool {
        // A window that counts nothing is a new key's from its start on
        // (a peek or a refusal is all it saw): kept, it would hold a place
        // a key that counts needs, for a whole window.
        let counting_ms = if s.current == 0 { 0 } else { self.window_ms };
        now_ms >= s.window_start_ms && now_ms - s.window_start_ms >= counting_ms
    }

    fn limit(&self) -> u64 {
        self.limit
    }

    fn window_ms(&self) -> u64 {
        self.window_ms
    }

    #[inline]
    fn pack(&self, s: &FixedWindowState) -> Option<u64> {
        (s.window_start_ms < self.time_bound && s.current >> self.count_bits == 0)
            .then(|| (s.window_start_ms << self.count_bits) | s.current)
    }

    #[inline]
    fn unpack(&self, packed: u64) -> FixedWindowState {
        FixedWindowState {
            window_start_ms: packed >> self.count_bits,
            current: packed & ((1u64 << self.count_bits) - 1),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(
        p: &FixedWindow,
        s: &mut FixedWindowState,
        now: u64,
        cost: u64,
    ) -> (bool, Option<u64>, u64) {
        let d = p.decide(s, now, cost);
        (d.allowed, d.retry_after_ms, d.remaining)
    }

    #[test]
    fn counts_per_aligned_window() {
        let p = FixedWindow::new(3, 1000).unwrap();
        let mut s = p.new_state(990);
        assert_eq!(run(&p, &mut s, 990, 2), (true, Some(0), 1));
        assert_eq!(run(&p, &mut s, 995, 1), (true, Some(0), 0));
        assert_eq!(run(&p, &mut s, 999, 1), (false, Some(1), 0));
        // A new window: the full budget again, 10 ms after the last one.
        assert_eq!(run(&p, &mut s, 1000, 3), (true, Some(0), 0));
        assert_eq!(run(&p, &mut s, 1500, 1), (false, Some(500), 0));
    }

    #[test]
    fn cost_above_limit_never_fits_and_peek_records_nothing() {
        let p = FixedWindow::new(3, 1000).unwrap();
        let mut s = p.new_state(0);
        assert_eq!(run(&p, &mut s, 0, 4), (false, None, 3));
        assert_eq!(run(&p, &mut s, 1, 0), (true, Some(0), 3));
        assert_eq!(run(&p, &mut s, 2, 3), (true, Some(0), 0));
        assert_eq!(run(&p, &mut s, 3, 0), (true, Some(0), 0));
    }

    #[test]
    fn clock_regression_is_decided_at_the_window_start() {
        let p = FixedWindow::new(2, 1000).unwrap();
        let mut s = p.new_state(1500);
        assert_eq!(run(&p, &mut s, 1500, 2), (true, Some(0), 0));
        // 400 ms lies in an earlier window: decided at 1000, still full,
        // and the wait counts from the caller's own time.
        assert_eq!(run(&p, &mut s, 400, 1), (false, Some(1600), 0));
        assert_eq!(run(&p, &mut s, 2000, 1), (true, Some(0), 1));
    }

    #[test]
    fn limit_zero_refuses_every_cost_forever() {
        let p = FixedWindow::new(0, 1000).unwrap();
        let mut s = p.new_state(0);
        assert_eq!(run(&p, &mut s, 0, 1), (false, None, 0));
        assert_eq!(run(&p, &mut s, 0, 0), (true, Some(0), 0));
    }

    #[test]
    fn forgettable_after_one_idle_window() {
        let p = FixedWindow::new(2, 1000).unwrap();
        let mut s = p.new_state(100);
        p.decide(&mut s, 100, 1);
        assert!(!p.is_forgettable(&s, 999));
        assert!(p.is_forgettable(&s, 1000));
    }

    /// A key that counted nothing (peeks, refusals of a cost above the
    /// limit) is forgettable at once, from its window's start.
    #[test]
    fn a_window_that_counts_nothing_is_forgettable_from_its_start() {
        let p = FixedWindow::new(2, 1000).unwrap();
        let mut s = p.new_state(1100);
        assert!(p.decide(&mut s, 1100, 0).allowed);
        assert!(!p.decide(&mut s, 1200, 3).allowed);
        assert!(p.is_forgettable(&s, 1200));
        // Not before it: a request from before 1000 is decided at 1000.
        assert!(!p.is_forgettable(&s, 999));
    }
}
