//! Stores: where keys' states live. A store performs one atomic
//! read-modify-write per request; the decision itself is the policy's.

pub mod memory;
mod table;
mod views;

use crate::{Decision, StoreError};

/// A keyed store deciding requests synchronously under one policy.
///
/// The criterion benches (`benches/policies.rs`) are written against this
/// trait, so every store that implements it (the in-memory store here; the
/// benches drive the asynchronous Redis store through it too) runs the
/// same benches.
pub trait Store: Send + Sync {
    /// Decides a request of `cost` for `key` at `now_ms`, atomically with
    /// respect to every other request on the same key.
    fn decide(&self, key: u64, now_ms: u64, cost: u64) -> Result<Decision, StoreError>;

    /// How many keys the store holds now.
    fn entries_tracked(&self) -> usize;
}
