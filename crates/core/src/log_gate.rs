//! [`LogGate`]: one log line per interval for a failure that repeats on
//! every request.

use std::sync::atomic::{AtomicU64, Ordering};

/// Lets one event through per interval and counts the rest.
///
/// A store that is down fails every request; logging each one would let
/// any client flood the log during an outage. Behind a gate, the outage
/// logs one line per interval, saying how many failures it stands for.
/// Like everything in the core, it reads no clock: the caller passes
/// `now_ms`.
///
/// ```
/// use ratewarden_core::LogGate;
/// let gate = LogGate::new(1000);
/// assert_eq!(gate.pass(5_000), Some(0)); // the first event is logged
/// assert_eq!(gate.pass(5_400), None); // held back, and counted
/// assert_eq!(gate.pass(5_900), None);
/// assert_eq!(gate.pass(6_000), Some(2)); // logged: two were held back
/// ```
#[derive(Debug)]
pub struct LogGate {
    interval_ms: u64,
    /// The earliest `now_ms` at which the next event is let through.
    next_ms: AtomicU64,
    /// Events held back since the last one let through.
    held: AtomicU64,
}

/// One event a second, the interval of most gates in this project.
///
/// ```
/// use ratewarden_core::LogGate;
/// let gate = LogGate::default();
/// assert_eq!(gate.pass(0), Some(0));
/// assert_eq!(gate.pass(999), None);
/// assert_eq!(gate.pass(1_000), Some(1));
/// ```
impl Default for LogGate {
    fn default() -> Self {
        LogGate::new(1000)
    }
}

impl LogGate {
    /// A gate letting one event through per `interval_ms`.
    pub const fn new(interval_ms: u64) -> Self {
        LogGate {
            interval_ms,
            next_ms: AtomicU64::new(0),
            held: AtomicU64::new(0),
        }
    }

    /// Whether to log the event happening at `now_ms`: `Some(n)`, with `n`
    /// the events held back since the last one let through, or `None` to
    /// stay quiet (the event is counted in the next `n`). Of threads racing
    /// for one interval, exactly one is let through.
    pub fn pass(&self, now_ms: u64) -> Option<u64> {
        let next = self.next_ms.load(Ordering::Relaxed);
        if now_ms >= next
            && self
                .next_ms
                .compare_exchange(
                    next,
                    now_ms.saturating_add(self.interval_ms),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok()
        {
            return Some(self.held.swap(0, Ordering::Relaxed));
        }
        self.held.fetch_add(1, Ordering::Relaxed);
        None
    }

    /// The events held back since the last one let through, taken: for a
    /// line that closes a run of events (an outage's end, say), so that
    /// the lines' counts add up to every event.
    ///
    /// ```
    /// use ratewarden_core::LogGate;
    /// let gate = LogGate::new(1000);
    /// assert_eq!(gate.pass(0), Some(0));
    /// assert_eq!(gate.pass(10), None);
    /// assert_eq!(gate.take_held(), 1);
    /// assert_eq!(gate.pass(1000), Some(0));
    /// ```
    pub fn take_held(&self) -> u64 {
        self.held.swap(0, Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_event_per_interval_carries_the_count_of_the_rest() {
        let gate = LogGate::new(1000);
        assert_eq!(gate.pass(0), Some(0));
        for t in 1..1000 {
            assert_eq!(gate.pass(t), None, "{t}");
        }
        assert_eq!(gate.pass(1000), Some(999));
        // A clock that steps back holds events until it passes the mark.
        assert_eq!(gate.pass(10), None);
        assert_eq!(gate.pass(2500), Some(1));
        // No overflow at the end of time.
        assert_eq!(gate.pass(u64::MAX), Some(0));
    }

    #[test]
    fn racing_threads_let_one_through_per_interval() {
        let gate = LogGate::new(1000);
        let passed: u64 = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|_| s.spawn(|| (0..10_000).filter(|_| gate.pass(7).is_some()).count() as u64))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).sum()
        });
        assert_eq!(passed, 1);
        assert_eq!(gate.pass(1007), Some(39_999));
    }
}
