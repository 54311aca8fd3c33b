//! The answer to one request.

use serde::{Deserialize, Serialize};

/// What a policy decided for one request `(key, now_ms, cost)`.
///
/// "Refused" is a value, not an error: errors are for a store that fails or
/// input that can never be valid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Decision {
    /// Admitted or refused. A refused request changes no count.
    pub allowed: bool,
    /// `Some(0)` when admitted. When refused, the smallest `d >= 1` such that
    /// the same request made at `now_ms + d`, with no other traffic on the
    /// key, would be admitted; `None` when no wait ever admits it (a cost
    /// above what the policy can hold, or a bucket that never refills).
    ///
    /// Exact, and so 128 bits wide, like [`std::time::Duration::as_millis`]:
    /// a token bucket with a huge burst and window and a tiny limit can need
    /// a wait of up to about 2^106 ms. Every other policy's wait is at most
    /// two windows.
    pub retry_after_ms: Option<u128>,
    /// After this decision: the largest cost a request at the same instant
    /// would be admitted with. Never negative.
    pub remaining: u64,
}

impl Decision {
    /// An admitted request that leaves `remaining`.
    pub const fn admitted(remaining: u64) -> Self {
        Decision {
            allowed: true,
            retry_after_ms: Some(0),
            remaining,
        }
    }

    /// A refused request; `retry_after_ms` is `None` for "never".
    pub const fn refused(retry_after_ms: Option<u128>, remaining: u64) -> Self {
        Decision {
            allowed: false,
            retry_after_ms,
            remaining,
        }
    }
}
