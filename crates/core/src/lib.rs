//! The core of ratewarden: exact, integer-only rate-limit policies and the
//! in-memory store.
//!
//! Every policy is a pure state transition `(state, now_ms, cost) -> Decision`
//! with the time passed in: this crate never reads a clock by itself and does
//! no I/O, so the same inputs give the same decisions on every store and every
//! port. The contract is `SPEC.md` (kept in the repository as `docs/SPEC.md`).
//!
//! ```
//! use ratewarden_core::{MemoryStore, PolicyConfig, PolicyKind};
//!
//! // 3 permits per second, sliding-window counter.
//! let config = PolicyConfig::new(PolicyKind::SlidingWindowCounter, 3, 1000);
//! let store = MemoryStore::for_config(&config, Default::default()).unwrap();
//! for now_ms in [0, 10, 20] {
//!     assert!(store.decide(7, now_ms, 1).unwrap().allowed);
//! }
//! let refused = store.decide(7, 30, 1).unwrap();
//! assert!(!refused.allowed);
//! // The full window waits to its edge plus 1 ms (at 1000 the count is
//! // carried undecayed).
//! assert_eq!(refused.retry_after_ms, Some(971));
//! ```
//!
//! The feature `vectors` adds the reader of conformance vector files
//! (`vectors`). It is off by default since it turns on serde_json's
//! `arbitrary_precision` for the whole build, which changes how serde_json
//! reads numbers in the embedding program too.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod clock;
// What decides is integers only (SPEC), so that every port agrees to the
// bit: clippy refuses floating-point arithmetic there.
#[deny(clippy::float_arithmetic)]
pub mod decision;
pub mod error;
pub mod key;
pub mod limiter;
pub mod log_gate;
#[deny(clippy::float_arithmetic)]
pub mod policy;
#[deny(clippy::float_arithmetic)]
pub mod registry;
#[deny(clippy::float_arithmetic)]
pub mod store;
#[cfg(feature = "vectors")]
pub mod vectors;

pub use clock::{Clock, ManualClock, MonotonicClock, SystemClock};
pub use decision::Decision;
pub use error::{check_request, ConfigError, StoreError, StoreErrorKind};
pub use key::{mix32, xxh3_64, KeyHash};
pub use limiter::{BoxFuture, FailurePolicy, Limiter, LocalLimiter};
pub use log_gate::LogGate;
pub use policy::{FixedWindow, Gcra, Policy, SlidingLog, SlidingWindowCounter, TokenBucket};
pub use registry::{AnyPolicy, AnyState, PolicyConfig, PolicyKind, REFERENCE};
pub use store::memory::{Housekeeping, MemoryOptions, MemoryStore};

/// The largest integer every input may take: `2^53 - 1`.
///
/// It is the largest integer a IEEE-754 double holds exactly, so JSON
/// clients, Lua scripts and JavaScript ports can carry every input unchanged.
pub const MAX_SAFE: u64 = (1 << 53) - 1;

/// The README's Rust examples, compiled and run as doctests.
#[doc = include_str!("../../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
