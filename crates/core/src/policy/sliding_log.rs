//! `sliding-log`: every admitted request, exactly.

use std::collections::VecDeque;

use super::Policy;
use crate::registry::{check_limit, check_window};
use crate::{ConfigError, Decision};

/// No more than `limit` in any `window_ms` consecutive milliseconds,
/// literally: an entry made at `s` counts while `now - s < window_ms`.
///
/// Exact, at the price of memory: a key holds one entry per distinct
/// millisecond with admitted traffic in the trailing window, at most
/// `min(limit, window_ms)` entries of 16 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlidingLog {
    limit: u64,
    window_ms: u64,
}

/// A log's buffer is never shrunk below this many entries' room (1 KiB):
/// smaller ones are not worth the copy.
const SHRINK_ABOVE_ENTRIES: usize = 64;

/// One millisecond's admitted cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogEntry {
    /// When the cost was admitted.
    pub at_ms: u64,
    /// The cost admitted at that millisecond (several requests at one
    /// millisecond share an entry: they leave the window together).
    pub cost: u64,
}

/// A key's log, oldest entry first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlidingLogState {
    /// Admitted cost per millisecond, oldest first; the newest entry's time
    /// is the key's recorded time for the clock-regression rule.
    pub entries: VecDeque<LogEntry>,
    /// The sum of `entries`' costs: the count in the trailing window as of
    /// the last decision. Never above `limit`.
    pub used: u64,
}

impl SlidingLog {
    /// `limit` in any `window_ms`; `window_ms >= 1`, both at most `2^53 - 1`.
    pub fn new(limit: u64, window_ms: u64) -> Result<Self, ConfigError> {
        check_limit(limit)?;
        check_window(window_ms)?;
        Ok(SlidingLog { limit, window_ms })
    }
}

impl Policy for SlidingLog {
    type State = SlidingLogState;

    fn new_state(&self, _now_ms: u64) -> SlidingLogState {
        SlidingLogState::default()
    }

    fn decide(&self, s: &mut SlidingLogState, now_ms: u64, cost: u64) -> Decision {
        // Clock regression: decided at the newest entry's time, so entries
        // can neither be re-counted nor appended out of order.
        let newest = s.entries.back().map_or(0, |e| e.at_ms);
        let now = now_ms.max(newest);
        // An entry made at `at` covers `at ..= at + W - 1`.
        while let Some(front) = s.entries.front() {
            // Saturating, as below: a state written by hand may hold its
            // entries out of order.
            if now.saturating_sub(front.at_ms) < self.window_ms {
                break;
            }
            // Saturating, here and below: a state written by hand (the
            // fields are public) may count less than its entries, or hold
            // entries no decision made; a valid one never does.
            s.used = s.used.saturating_sub(front.cost);
            s.entries.pop_front();
        }
        // A buffer keeps the room of its busiest moment: a key that once
        // held thousands of entries, then kept in use by a trickle, would
        // hold that memory for as long as it is used (the memory store
        // decides in place). Halved when under a quarter full, past a small
        // size, so that its cost is spread over the entries that left.
        let room = s.entries.capacity();
        if room > SHRINK_ABOVE_ENTRIES && s.entries.len() < room / 4 {
            s.entries.shrink_to(room / 2);
        }
        let left = self.limit.saturating_sub(s.used);
        if cost <= left {
            if cost > 0 {
                match s.entries.back_mut() {
                    Some(last) if last.at_ms == now => last.cost = last.cost.saturating_add(cost),
                    _ => s.entries.push_back(LogEntry { at_ms: now, cost }),
                }
                s.used += cost;
            }
            return Decision::admitted(left - cost);
        }
        if cost > self.limit {
            return Decision::refused(None, left);
        }
        // The oldest entries leave first; the request fits once enough of
        // them have left.
        let mut still_used = s.used;
        for e in &s.entries {
            still_used = still_used.saturating_sub(e.cost);
            if still_used.saturating_add(cost) <= self.limit {
                let at = e.at_ms.saturating_add(self.window_ms);
                return Decision::refused(Some(at.saturating_sub(now_ms)), left);
            }
        }
        // Unreachable for valid state (an empty log admits any cost <=
        // limit); answered conservatively rather than panicking. The Redis
        // script, which reads whatever a key holds, calls such a state
        // (and one whose entries leaving the window count more than
        // `used`, which the loop above floors at 0) corrupt instead: an
        // error for its caller's failure policy, where here only a state
        // built by hand in Rust gets this far.
        Decision::refused(Some(self.window_ms), left)
    }

    fn is_forgettable(&self, s: &SlidingLogState, now_ms: u64) -> bool {
        s.entries
            .back()
            .is_none_or(|e| now_ms.saturating_sub(e.at_ms) >= self.window_ms)
    }

    fn limit(&self) -> u64 {
        self.limit
    }

    fn window_ms(&self) -> u64 {
        self.window_ms
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A log that held many entries and now holds few gives back most of
    /// its buffer as it is used, not only when its key is forgotten.
    #[test]
    fn a_log_that_empties_gives_back_its_room() {
        let p = SlidingLog::new(100_000, 60_000).unwrap();
        let mut s = SlidingLogState::default();
        for at in 0..20_000 {
            assert!(p.decide(&mut s, at, 1).allowed);
        }
        assert!(s.entries.capacity() >= 20_000);
        // A trickle, one a second, once the burst has left the window.
        for at in (80_000..200_000).step_by(1000) {
            assert!(p.decide(&mut s, at, 1).allowed);
        }
        assert_eq!(s.entries.len(), 60);
        assert!(s.entries.capacity() <= 256, "{}", s.entries.capacity());
    }

    /// A state written by hand (its fields are public) that counts less
    /// than its entries is decided, not a panic (an overflow in a debug
    /// build): what leaves the window takes the count to 0 at most.
    #[test]
    fn a_state_counting_less_than_its_entries_is_decided() {
        let p = SlidingLog::new(5, 10).unwrap();
        let mut s = SlidingLogState::default();
        s.entries.push_back(LogEntry { at_ms: 0, cost: 5 });
        assert_eq!(run(&p, &mut s, 20, 1), (true, Some(0), 4));
        assert_eq!(s.used, 1);
    }

    fn run(
        p: &SlidingLog,
        s: &mut SlidingLogState,
        now: u64,
        cost: u64,
    ) -> (bool, Option<u64>, u64) {
        let d = p.decide(s, now, cost);
        (d.allowed, d.retry_after_ms, d.remaining)
    }

    #[test]
    fn entries_leave_exactly_one_window_later() {
        let p = SlidingLog::new(3, 1000).unwrap();
        let mut s = p.new_state(0);
        assert_eq!(run(&p, &mut s, 0, 1), (true, Some(0), 2));
        assert_eq!(run(&p, &mut s, 100, 2), (true, Some(0), 0));
        assert_eq!(run(&p, &mut s, 999, 1), (false, Some(1), 0));
        assert_eq!(run(&p, &mut s, 1000, 1), (true, Some(0), 0));
        // Cost 2 needs the entry at 100 gone: at 1100.
        assert_eq!(run(&p, &mut s, 1000, 2), (false, Some(100), 0));
        assert_eq!(run(&p, &mut s, 1100, 2), (true, Some(0), 0));
    }

    #[test]
    fn same_millisecond_entries_share_one() {
        let p = SlidingLog::new(100, 1000).unwrap();
        let mut s = p.new_state(0);
        for _ in 0..100 {
            assert!(p.decide(&mut s, 5, 1).allowed);
        }
        assert_eq!(s.entries.len(), 1);
        assert_eq!(run(&p, &mut s, 6, 1), (false, Some(999), 0));
    }

    #[test]
    fn peek_and_refusal_record_nothing() {
        let p = SlidingLog::new(2, 1000).unwrap();
        let mut s = p.new_state(0);
        assert_eq!(run(&p, &mut s, 10, 0), (true, Some(0), 2));
        assert!(s.entries.is_empty());
        assert_eq!(run(&p, &mut s, 10, 3), (false, None, 2));
        assert!(s.entries.is_empty());
    }

    #[test]
    fn clock_regression_is_decided_at_the_newest_entry() {
        let p = SlidingLog::new(1, 1000).unwrap();
        let mut s = p.new_state(0);
        assert!(run(&p, &mut s, 5000, 1).0);
        assert_eq!(run(&p, &mut s, 4000, 1), (false, Some(2000), 0));
        assert!(run(&p, &mut s, 6000, 1).0);
    }
}
