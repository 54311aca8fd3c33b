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
pub use sliding_log::{SlidingLog, SlidingLogState};
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

    /// Whether forgetting the key at `now_ms` can change no later decision
    /// (SPEC "Memory"): a store may then drop it.
    fn is_forgettable(&self, state: &Self::State, now_ms: u64) -> bool;

    /// The configured limit (permits per window).
    fn limit(&self) -> u64;

    /// The configured window, in ms.
    fn window_ms(&self) -> u64;
}

/// `a * b / c`, floored, in 128 bits: exact for all 64-bit inputs when the
/// quotient fits (the callers guarantee it).
#[inline]
pub(crate) fn mul_div(a: u64, b: u64, c: u64) -> u64 {
    (u128::from(a) * u128::from(b) / u128::from(c)) as u64
}

/// A 128-bit value split into two 64-bit words so that per-key state stays
/// 8-byte aligned (a `u128` field would pad every entry to 16).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Wide {
    hi: u64,
    lo: u64,
}

impl Wide {
    #[inline]
    pub fn get(self) -> u128 {
        (u128::from(self.hi) << 64) | u128::from(self.lo)
    }

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
        assert_eq!(size_of::<FixedWindowState>(), 16);
        assert_eq!(size_of::<SlidingWindowCounterState>(), 24);
        assert_eq!(size_of::<TokenBucketState>(), 24);
        assert_eq!(size_of::<GcraState>(), 16);
        assert_eq!(size_of::<SlidingLogState>(), 40);
        assert_eq!(std::mem::align_of::<TokenBucketState>(), 8);
    }
}
