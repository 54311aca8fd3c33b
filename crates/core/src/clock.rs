//! Clocks the caller chooses. The policies never read one: a store or a
//! limiter reads the clock it was given and passes `now_ms` in.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// A source of the current time in milliseconds.
pub trait Clock: Send + Sync {
    /// The current time, in milliseconds.
    fn now_ms(&self) -> u64;
}

/// Milliseconds since the Unix epoch, from the operating system.
///
/// A system clock can step back (NTP, a manual change); the policies decide
/// such requests at the key's recorded time, so a step back never resets or
/// refills a key.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        // A clock set before 1970 reads as 0 rather than failing: the
        // policies' clock-regression rule already makes that safe.
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or(0)
    }
}

/// Milliseconds since the clock was made, from the operating system's
/// monotonic clock, which never steps back: for intervals within one
/// process (log gates, idle times), never for counts shared between
/// processes, whose times must agree.
///
/// ```
/// use ratewarden_core::{Clock, MonotonicClock};
/// let clock = MonotonicClock::new();
/// assert!(clock.now_ms() < 60_000);
/// ```
#[derive(Debug, Clone, Copy)]
pub struct MonotonicClock {
    started: Instant,
}

impl MonotonicClock {
    /// A clock reading 0 now.
    pub fn new() -> Self {
        MonotonicClock {
            started: Instant::now(),
        }
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    fn now_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}

/// A clock that moves only when told to: for tests and simulation.
///
/// Clones share one time, so a test can hold one handle and give another to
/// the code under test.
///
/// ```
/// use ratewarden_core::{Clock, ManualClock};
/// let clock = ManualClock::new(1_000);
/// let handle = clock.clone();
/// clock.advance_ms(250);
/// assert_eq!(handle.now_ms(), 1_250);
/// ```
#[derive(Debug, Clone, Default)]
pub struct ManualClock {
    now_ms: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock reading `now_ms`.
    pub fn new(now_ms: u64) -> Self {
        ManualClock {
            now_ms: Arc::new(AtomicU64::new(now_ms)),
        }
    }

    /// Sets the time; it may move backwards, as a real clock can.
    pub fn set_ms(&self, now_ms: u64) {
        self.now_ms.store(now_ms, Ordering::SeqCst);
    }

    /// Moves the time forward by `delta_ms`, saturating at `u64::MAX`.
    pub fn advance_ms(&self, delta_ms: u64) {
        let _ = self
            .now_ms
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |t| {
                Some(t.saturating_add(delta_ms))
            });
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.now_ms.load(Ordering::SeqCst)
    }
}

/// A shared clock, a boxed one (`Box<dyn Clock>`, chosen at run time) and
/// a borrowed one are clocks too.
///
/// ```
/// use ratewarden_core::{Clock, ManualClock, SystemClock};
/// fn read(clock: impl Clock) -> u64 {
///     clock.now_ms()
/// }
/// let manual = ManualClock::new(5);
/// assert_eq!(read(&manual), 5);
/// let chosen: Box<dyn Clock> = Box::new(SystemClock);
/// assert!(read(&chosen) > 0);
/// let boxed: Box<dyn Clock> = Box::new(ManualClock::new(7));
/// assert_eq!(read(boxed), 7);
/// ```
impl<C: Clock + ?Sized> Clock for Arc<C> {
    fn now_ms(&self) -> u64 {
        (**self).now_ms()
    }
}

impl<C: Clock + ?Sized> Clock for Box<C> {
    fn now_ms(&self) -> u64 {
        (**self).now_ms()
    }
}

impl<C: Clock + ?Sized> Clock for &C {
    fn now_ms(&self) -> u64 {
        (**self).now_ms()
    }
}
