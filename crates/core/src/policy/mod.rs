//! The policies: one file each, each a pure state transition.
//!
//! A policy holds its validated configuration; the per-key state is a
//! separate value that a store keeps and hands back. `decide` never reads a
//! clock and never allocates for the window counters and buckets, so a store
//! only has to perform the read-modify-write atomically.
//!
//! Inputs: `now_ms` and `cost` are expected in `0 ..= 2^53 - 1` (stores
//! check this and return an error otherwise). Every product is computed in
//! 128 bits, so no input in that range overflows; inputs above it never
//! panic either, though their decisions are unspecified.

mod fixed_window;
mod gcra;
mod sliding_log;
mod sliding_window_counter;
mod token_bucket;

pub use fixed_window::{FixedWindow, FixedWindowState};
pub use gcra::{Gcra, GcraState};
pub use sliding_log::{LogEntry, SlidingLog, SlidingLogState};
pub use sliding_window_counter::{SlidingWindowCounter, SlidingWindowCounterState};
pub use token_bucket::{TokenBucket, TokenBucketState};

use crate::Decision;

/// A rate-limit policy: a pure function from a key's state, the time and a
/// cost to a decision and the key's next state.
pub trait Policy: Send + Sync + 'static {
    /// Everything the policy remembers about one key.
    type State: Clone + Send + Sync + std::fmt::Debug + 'static;

    /// The state of a key never seen before, first touched at `now_ms`.
    fn new_state(&self, now_ms: u64) -> Self::State;

    /// Decides a request of `cost` at `now_ms` and updates `state`.
    fn decide(&self, state: &mut Self::State, now_ms: u64, cost: u64) -> Decision;

    /// Whether forgetting the key at `now_ms` can change no decision at
    /// `now_ms` or later: a store may then drop it. Precisely: the state
    /// decides every request at `now_ms` or later exactly as a key never
    /// seen would, so only a request stamped before `now_ms` can tell that
    /// the key was forgotten (where this departs from SPEC "Memory", and
    /// what the memory store does for such a request: docs/SPEC.md, "open
    /// points").
    fn is_forgettable(&self, state: &Self::State, now_ms: u64) -> bool;

    /// The configured limit (permits per window).
    fn limit(&self) -> u64;

    /// The configured window, in ms.
    fn window_ms(&self) -> u64;

    /// `state` packed into 64 bits, when every field fits exactly in the
    /// layout this policy chose at construction; `None` otherwise.
    ///
    /// A store may keep packed states (16 bytes per key with the key) and
    /// decide by unpacking, deciding and packing again; when a state does
    /// not fit it keeps the wide state instead, so decisions are the same
    /// either way. The default packs nothing.
    #[inline]
    fn pack(&self, _state: &Self::State) -> Option<u64> {
        None
    }

    /// The state [`Policy::pack`] packed into `packed`. Only values that
    /// `pack` returned are valid; the default (for policies that pack
    /// nothing, so it is never called with one) gives a new key's state.
    #[inline]
    fn unpack(&self, _packed: u64) -> Self::State {
        self.new_state(0)
    }
}

/// Milliseconds since 1970 stay below this until the year 2109: a packed
/// layout whose time field reaches it packs states at wall-clock times.
/// A layout whose field falls short stores its time more compactly
/// instead (a window's index, a level in larger units), at the cost of a
/// division when packing.
pub(crate) const WALL_CLOCK_BOUND_MS: u64 = 1 << 42;

/// The greatest common divisor of `a` and `b` (`b` when `a` is 0).
pub(crate) const fn gcd(mut a: u64, mut b: u64) -> u64 {
    while a != 0 {
        (a, b) = (b % a, a);
    }
    b
}

/// Bits needed to hold every value up to `max` (0 for 0).
#[inline]
pub(crate) const fn bits_for(max: u128) -> u32 {
    128 - max.leading_zeros()
}

/// The exclusive bound on a time field given `used` bits of a 64-bit word
/// for counts: `2^(64 - used)`, or 0 when no bits are left (nothing packs).
#[inline]
pub(crate) const fn time_bound(used: u32) -> u64 {
    if used >= 64 {
        0
    } else if used == 0 {
        u64::MAX
    } else {
        1u64 << (64 - used)
    }
}

/// `a * b / c`, floored, in 128 bits: exact for all 64-bit inputs when the
/// quotient fits (the callers guarantee it).
#[inline]
pub(crate) fn mul_div(a: u64, b: u64, c: u64) -> u64 {
    // `c` is a count in its only caller: small, and different each call.
    div_by_small(u128::from(a) * u128::from(b), c) as u64
}

/// `n / d`, floored, with the narrowest hardware division that holds both.
///
/// The quotient is the same at every width; only the cost differs: a
/// 128-bit division is a library call, and on many x86-64 cores a 64-bit
/// `div` takes several times as long as a 32-bit one. The reference
/// configuration's numbers (100 per 1000 ms) fit in 32 bits.
#[inline]
pub(crate) fn div(n: u128, d: u128) -> u128 {
    if n <= u128::from(u32::MAX) && d <= u128::from(u32::MAX) {
        u128::from(n as u32 / d as u32)
    } else if n <= u128::from(u64::MAX) && d <= u128::from(u64::MAX) {
        u128::from(n as u64 / d as u64)
    } else {
        n / d
    }
}

/// A divisor fixed at construction (a policy's window or limit), with its
/// reciprocal worked out once so that dividing by it is a multiplication.
///
/// For `2 <= d < 2^32` and any `n < 2^32`, `floor(n / d)` equals
/// `floor(n * ceil(2^64 / d) / 2^64)` (Lemire, Kaser and Kurz, "Faster
/// remainder by direct computation", 2019, theorem 1 with 64 fractional
/// bits); other operands take [`div`]. The quotient is the same either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Divisor {
    d: u64,
    /// `ceil(2^64 / d)` when `2 <= d < 2^32`, else 0.
    reciprocal: u64,
}

impl Divisor {
    pub(crate) fn new(d: u64) -> Divisor {
        let reciprocal = if (2..=u64::from(u32::MAX)).contains(&d) {
            // At most 2^63 for d >= 2, so it fits in 64 bits.
            ((1u128 << 64).div_ceil(u128::from(d))) as u64
        } else {
            0
        };
        Divisor { d, reciprocal }
    }

    /// `n / d`, floored.
    #[inline]
    pub(crate) fn div(self, n: u128) -> u128 {
        if self.reciprocal != 0 && n <= u128::from(u32::MAX) {
            (u128::from(self.reciprocal) * n) >> 64
        } else {
            div(n, u128::from(self.d))
        }
    }

    /// `n / d`, rounded up.
    #[inline]
    pub(crate) fn div_ceil(self, n: u128) -> u128 {
        let q = self.div(n);
        if q * u128::from(self.d) < n {
            q + 1
        } else {
            q
        }
    }
}

/// The largest divisor [`div_by_small`] finds in its table.
const SMALL_DIVISORS: usize = 1024;

/// `ceil(2^64 / d)` for every `d` in `2..=SMALL_DIVISORS` (index `d`),
/// worked out at compile time; entries 0 and 1 are unused.
static SMALL_RECIPROCALS: [u64; SMALL_DIVISORS + 1] = {
    let mut table = [0u64; SMALL_DIVISORS + 1];
    let mut d = 2;
    while d <= SMALL_DIVISORS {
        table[d] = ((1u128 << 64).div_ceil(d as u128)) as u64;
        d += 1;
    }
    table
};

/// `n / d`, floored, for a divisor that changes from call to call (a
/// count): small divisors multiply by a reciprocal from a table (exact for
/// `n < 2^32`, as for [`Divisor`]); others take [`div`].
#[inline]
pub(crate) fn div_by_small(n: u128, d: u64) -> u128 {
    match SMALL_RECIPROCALS.get(d as usize) {
        Some(&reciprocal) if reciprocal != 0 && n <= u128::from(u32::MAX) => {
            (u128::from(reciprocal) * n) >> 64
        }
        _ => div(n, u128::from(d)),
    }
}

/// `now - now % window_ms`: the start of the aligned window holding `now`.
///
/// `known` is the aligned window start a key's state recorded (states only
/// ever record aligned starts). Most requests fall in that window or the
/// next, and checking for them first spares a division.
#[inline]
pub(crate) fn window_start(now: u64, known: u64, window_ms: u64) -> u64 {
    match now.checked_sub(known) {
        Some(elapsed) if elapsed < window_ms => known,
        Some(elapsed) if elapsed - window_ms < window_ms => known + window_ms,
        _ => now - rem(now, window_ms),
    }
}

/// `n % d` with the narrowest division that holds both.
#[inline]
pub(crate) fn rem(n: u64, d: u64) -> u64 {
    if n <= u64::from(u32::MAX) && d <= u64::from(u32::MAX) {
        u64::from(n as u32 % d as u32)
    } else {
        n % d
    }
}

/// A 128-bit value split into two 64-bit words so that per-key state stays
/// 8-byte aligned (a `u128` field would pad every entry to 16).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Wide {
    hi: u64,
    lo: u64,
}

impl Wide {
    /// The value.
    #[inline]
    pub fn get(self) -> u128 {
        (u128::from(self.hi) << 64) | u128::from(self.lo)
    }

    /// `v`, split into its two words.
    #[inline]
    pub fn new(v: u128) -> Self {
        Wide {
            hi: (v >> 64) as u64,
            lo: v as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::size_of;

    /// The per-key sizes the memory store documents; a change here changes
    /// its memory per key.
    #[test]
    fn state_sizes_are_as_documented() {
        // The memory store keeps these packed into 8 bytes when they fit
        // (see `Policy::pack`); these are the wide forms.
        assert_eq!(size_of::<FixedWindowState>(), 16);
        assert_eq!(size_of::<SlidingWindowCounterState>(), 24);
        assert_eq!(size_of::<TokenBucketState>(), 24);
        assert_eq!(size_of::<GcraState>(), 16);
        assert_eq!(size_of::<SlidingLogState>(), 40);
        assert_eq!(std::mem::align_of::<TokenBucketState>(), 8);
    }

    /// The memory store keeps 16 bytes per key (key and packed state) for
    /// the reference configuration at wall-clock times: every state of
    /// the four packing policies round-trips through 64 bits there.
    #[test]
    fn reference_states_pack_at_wall_clock_times() {
        fn round_trips<P: Policy>(p: &P, now_ms: u64)
        where
            P::State: PartialEq,
        {
            let mut s = p.new_state(now_ms);
            for step in 0..300 {
                p.decide(&mut s, now_ms + step * 7, 1);
                let packed = p.pack(&s).expect("a reference state packs");
                assert_eq!(p.unpack(packed), s);
            }
        }
        // 2026 in ms since 1970 is about 2^40.7; the layouts reach 2^47
        // (token-bucket) or more.
        let now_ms = 1_800_000_000_000;
        round_trips(&FixedWindow::new(100, 1000).unwrap(), now_ms);
        round_trips(&SlidingWindowCounter::new(100, 1000).unwrap(), now_ms);
        round_trips(&TokenBucket::new(100, 1000, None).unwrap(), now_ms);
        round_trips(&Gcra::new(100, 1000, None).unwrap(), now_ms);
        assert_eq!(size_of::<(u64, u64)>(), 16);
    }

    /// Larger limits pack at wall-clock times too: a sliding-window
    /// counter stores its window's index once the start in ms leaves too
    /// few bits (a limit of 2,048 or more), and a bucket its level in
    /// units of `gcd(limit, window_ms)` once `burst * W` reaches 2^22.
    #[test]
    fn common_larger_limits_pack_at_wall_clock_times() {
        fn round_trips<P: Policy + std::fmt::Debug>(p: &P, now_ms: u64, cost: u64)
        where
            P::State: PartialEq + std::fmt::Debug,
        {
            let mut s = p.new_state(now_ms);
            for step in 0..3000 {
                // Forward mostly, across many windows, and back now and then.
                let now = now_ms + step * 97 - (step % 7) * 300;
                p.decide(&mut s, now, cost + step % 3);
                let packed = p
                    .pack(&s)
                    .unwrap_or_else(|| panic!("{p:?} at {now}: {s:?}"));
                assert_eq!(p.unpack(packed), s);
            }
        }
        // 2100 in ms since 1970 is about 2^41.9.
        for now_ms in [1_800_000_000_000, 4_102_444_800_000] {
            for (limit, window_ms) in [
                (2048, 1000),
                (65_535, 1000),
                (5000, 60_000),
                (262_143, 60_000),
            ] {
                let p = SlidingWindowCounter::new(limit, window_ms).unwrap();
                round_trips(&p, now_ms, limit / 600);
            }
            for (limit, window_ms, burst) in [
                (1000, 60_000, None),
                (10_000, 3_600_000, None),
                (100, 1000, Some(100_000)),
            ] {
                let p = TokenBucket::new(limit, window_ms, burst).unwrap();
                round_trips(&p, now_ms, limit / 300);
            }
        }
    }
}

#[cfg(test)]
mod narrow_division_tests {
    use super::*;
    use proptest::prelude::*;

    /// A numerator of 32 bits over a divisor past them: the 32-bit path
    /// must not take it (`2^32` as a `u32` is 0).
    #[test]
    fn rem_with_a_divisor_past_32_bits() {
        assert_eq!(rem(5, 1 << 32), 5);
        assert_eq!(rem(u64::from(u32::MAX), (1 << 32) + 3), u64::from(u32::MAX));
        assert_eq!(rem(1000, (1 << 33) + 999), 1000);
    }

    fn wide() -> impl Strategy<Value = u128> {
        // Every width the fast paths choose between, and their edges.
        prop_oneof![
            0u128..=1 << 33,
            Just(u128::from(u32::MAX)),
            Just(u128::from(u64::MAX)),
            any::<u64>().prop_map(u128::from),
            any::<u128>(),
        ]
    }

    #[test]
    fn a_divisor_is_exact_at_the_edges_of_32_bits() {
        // The theorem's worst cases: the largest numerators, for divisors
        // near powers of two and the largest 32-bit divisors.
        let top = u128::from(u32::MAX);
        for d in [
            2,
            3,
            7,
            641,
            1000,
            65_535,
            65_537,
            (1 << 31) - 1,
            1 << 31,
            u32::MAX as u64,
        ] {
            let divisor = Divisor::new(d);
            for n in (top - 2000..=top).chain(0..2000) {
                assert_eq!(divisor.div(n), n / u128::from(d), "{n} / {d}");
                assert_eq!(div_by_small(n, d), n / u128::from(d), "{n} / {d}");
            }
        }
        // Every divisor of the table, at the largest numerators.
        for d in 1..=SMALL_DIVISORS as u64 + 1 {
            for n in [top, top - 1, top - u128::from(d), u128::from(d) * 1000 - 1] {
                assert_eq!(div_by_small(n, d), n / u128::from(d), "{n} / {d}");
            }
        }
    }

    proptest! {
        #[test]
        fn narrow_division_equals_128_bit_division(n in wide(), d in wide()) {
            prop_assume!(d > 0);
            prop_assert_eq!(div(n, d), n / d);
        }

        #[test]
        fn a_divisor_divides_as_128_bit_division_does(n in wide(), d in prop_oneof![
            1u64..=4096,
            Just(u64::from(u32::MAX)),
            Just(u64::from(u32::MAX) + 1),
            any::<u32>().prop_map(|d| u64::from(d.max(1))),
            any::<u64>().prop_map(|d| d.max(1)),
        ]) {
            let divisor = Divisor::new(d);
            prop_assert_eq!(divisor.div(n), n / u128::from(d));
            prop_assert_eq!(div_by_small(n, d), n / u128::from(d));
            prop_assert_eq!(divisor.div_ceil(n), n.div_ceil(u128::from(d)));
        }

        #[test]
        fn window_start_equals_the_remainder_formula(
            now in any::<u64>(),
            window_ms in prop_oneof![1u64..=3000, any::<u64>().prop_map(|w| w.max(1))],
            back in 0u64..5,
        ) {
            let aligned = now - now % window_ms;
            // A recorded start some windows back, or ahead (clock regression
            // is clamped by the callers, but the helper must not care).
            for known in [aligned.saturating_sub(back.saturating_mul(window_ms)), aligned] {
                let known = known - known % window_ms;
                if known <= now {
                    prop_assert_eq!(window_start(now, known, window_ms), aligned);
                }
            }
            prop_assert_eq!(rem(now, window_ms), now % window_ms);
        }
    }
}
