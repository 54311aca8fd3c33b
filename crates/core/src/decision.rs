//! The answer to one request.

use serde::{Deserialize, Serialize};

/// What a policy decided for one request `(key, now_ms, cost)`.
///
/// "Refused" is a value, not an error: errors are for a store that fails or
/// input that can never be valid.
///
/// With serde it is `{"allowed", "retry_after_ms", "remaining"}`, the wait
/// exact (as [`Decision::retry_after_exact_ms`] gives it, so a JSON number
/// above `u64::MAX` for the longest waits); reading one back refuses fields
/// that contradict each other. Such a wait (only a token bucket or GCRA
/// with a huge burst and a tiny limit can make one) is a `u128`, which a
/// serializer that goes through a value of its own may not hold: with
/// serde_json (without its `arbitrary_precision` feature), `to_string` and
/// `to_writer` write it, but `to_value` fails with "number out of range"
/// (and the `json!` macro, which calls it, panics), and an `untagged` enum
/// reads it back as a float. Where that matters, write
/// [`Decision::retry_after_ms`] (capped at `u64::MAX`) in a struct of your
/// own.
///
/// ```
/// use ratewarden_core::Decision;
/// let refused = Decision::refused(Some(250), 0);
/// let json = serde_json::to_string(&refused).unwrap();
/// assert_eq!(json, r#"{"allowed":false,"retry_after_ms":250,"remaining":0}"#);
/// assert_eq!(serde_json::from_str::<Decision>(&json).unwrap(), refused);
/// let contradiction = r#"{"allowed":true,"retry_after_ms":250,"remaining":0}"#;
/// assert!(serde_json::from_str::<Decision>(contradiction).is_err());
/// ```
#[derive(Clone, Copy, Serialize, Deserialize)]
#[serde(into = "DecisionFields", try_from = "DecisionFields")]
pub struct Decision {
    /// Admitted or refused. A refused request changes no count.
    pub allowed: bool,
    /// `Some(0)` when admitted. When refused, the smallest `d >= 1` such that
    /// the same request made at `now_ms + d`, with no other traffic on the
    /// key, would be admitted; `None` when no wait ever admits it (a cost
    /// above what the policy can hold, or a bucket that never refills).
    ///
    /// A wait longer than `u64::MAX` ms (585 million years: only a token
    /// bucket or GCRA with a huge burst and window and a tiny limit needs
    /// one, up to about 2^106 ms) reads `u64::MAX` here;
    /// [`Decision::retry_after_exact_ms`] has it exactly, for as long as
    /// this field says `Some(u64::MAX)`: a wrapper that caps the wait by
    /// writing a smaller one here caps the exact wait too.
    pub retry_after_ms: Option<u64>,
    /// After this decision: the largest cost a request at the same instant
    /// would be admitted with. Never negative.
    pub remaining: u64,
    /// The exact wait, when it is longer than `u64::MAX` ms, as its high
    /// and low 64 bits; `[0, 0]` otherwise.
    ///
    /// Why not one `Option<u128>` field: a `u128` is 16-byte aligned, and
    /// `Result<Decision, _>` took that option's 16-byte tag as its niche
    /// (where it now takes `retry_after_ms`'s 8-byte one). Telling `Ok` from
    /// `Err` then loaded 16 bytes that had been written as two 8-byte
    /// halves, a store-forwarding stall on every decision: a hot key's
    /// decision took 10 to 15 ns in `ratewarden bench --quick` instead of 5
    /// to 10.
    retry_after_wide_ms: [u64; 2],
}

/// Equal when the fields a user knows are, the wait exact (a wide wait's
/// halves left behind by a capped `retry_after_ms` do not count).
impl PartialEq for Decision {
    fn eq(&self, other: &Self) -> bool {
        self.allowed == other.allowed
            && self.remaining == other.remaining
            && self.retry_after_exact_ms() == other.retry_after_exact_ms()
    }
}

impl Eq for Decision {}

impl std::hash::Hash for Decision {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.allowed.hash(state);
        self.retry_after_exact_ms().hash(state);
        self.remaining.hash(state);
    }
}

/// A [`Decision`] as serde writes and reads it: the wait exact, in one
/// field.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct DecisionFields {
    allowed: bool,
    retry_after_ms: Option<Wait>,
    remaining: u64,
}

/// A wait in ms, written as a `u64` when it fits (every format takes one)
/// and as a `u128` only past `u64::MAX`; read from either.
#[derive(Clone, Copy)]
struct Wait(u128);

impl Serialize for Wait {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match u64::try_from(self.0) {
            Ok(ms) => s.serialize_u64(ms),
            Err(_) => s.serialize_u128(self.0),
        }
    }
}

impl<'de> Deserialize<'de> for Wait {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        u128::deserialize(d).map(Wait)
    }
}

/// The three fields a user knows, the wait exact: the private high and
/// low halves of a wide wait are how it is kept, not what it is.
impl std::fmt::Debug for Decision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Decision")
            .field("allowed", &self.allowed)
            .field("retry_after_ms", &self.retry_after_exact_ms())
            .field("remaining", &self.remaining)
            .finish()
    }
}

/// One line for logs and messages: `allowed, 99 remaining`, `refused,
/// retry after 250 ms, 0 remaining`, or `refused, no wait admits it, 0
/// remaining`. The wait is exact, however long.
///
/// ```
/// use ratewarden_core::Decision;
/// assert_eq!(Decision::admitted(99).to_string(), "allowed, 99 remaining");
/// assert_eq!(
///     Decision::refused(Some(250), 0).to_string(),
///     "refused, retry after 250 ms, 0 remaining"
/// );
/// assert_eq!(
///     Decision::refused(None, 3).to_string(),
///     "refused, no wait admits it, 3 remaining"
/// );
/// assert_eq!(
///     Decision::refused_exact(Some(1 << 70), 0).to_string(),
///     "refused, retry after 1180591620717411303424 ms, 0 remaining"
/// );
/// ```
impl std::fmt::Display for Decision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.allowed {
            return write!(f, "allowed, {} remaining", self.remaining);
        }
        match self.retry_after_exact_ms() {
            Some(ms) => write!(
                f,
                "refused, retry after {ms} ms, {} remaining",
                self.remaining
            ),
            None => write!(
                f,
                "refused, no wait admits it, {} remaining",
                self.remaining
            ),
        }
    }
}

impl From<Decision> for DecisionFields {
    fn from(d: Decision) -> Self {
        DecisionFields {
            allowed: d.allowed,
            retry_after_ms: d.retry_after_exact_ms().map(Wait),
            remaining: d.remaining,
        }
    }
}

impl TryFrom<DecisionFields> for Decision {
    type Error = String;

    fn try_from(f: DecisionFields) -> Result<Self, String> {
        match (f.allowed, f.retry_after_ms.map(|w| w.0)) {
            (true, Some(0)) => Ok(Decision::admitted(f.remaining)),
            (true, Some(ms)) => Err(format!(
                "allowed is true, so retry_after_ms must be 0, not {ms}"
            )),
            (true, None) => {
                Err("allowed is true, so retry_after_ms must be 0, not null".to_owned())
            }
            (false, Some(0)) => Err(
                "allowed is false, so retry_after_ms must be at least 1 (or null for never), not 0"
                    .to_owned(),
            ),
            (false, wait) => Ok(Decision::refused_exact(wait, f.remaining)),
        }
    }
}

impl Decision {
    /// An admitted request that leaves `remaining`.
    pub const fn admitted(remaining: u64) -> Self {
        Decision {
            allowed: true,
            retry_after_ms: Some(0),
            remaining,
            retry_after_wide_ms: [0, 0],
        }
    }

    /// A refused request; `retry_after_ms` is `None` for "never", else at
    /// least 1 (a refusal with no wait contradicts itself, and serde
    /// refuses to read one back). That is the caller's to keep: it is not
    /// checked here, and a bare policy given inputs past 2^53 - 1, which
    /// stores refuse, can make such a refusal.
    pub const fn refused(retry_after_ms: Option<u64>, remaining: u64) -> Self {
        Decision {
            allowed: false,
            retry_after_ms,
            remaining,
            retry_after_wide_ms: [0, 0],
        }
    }

    /// A refused request whose wait may be longer than `u64::MAX` ms.
    pub const fn refused_exact(retry_after_ms: Option<u128>, remaining: u64) -> Self {
        match retry_after_ms {
            // The casts split the wait into its two halves.
            Some(ms) if ms > u64::MAX as u128 => {
                let mut decision = Decision::refused(Some(u64::MAX), remaining);
                decision.retry_after_wide_ms = [(ms >> 64) as u64, ms as u64];
                decision
            }
            Some(ms) => Decision::refused(Some(ms as u64), remaining),
            None => Decision::refused(None, remaining),
        }
    }

    /// A decision from its stored parts (the store's own copies).
    pub(crate) const fn from_parts(
        allowed: bool,
        retry_after_ms: Option<u64>,
        remaining: u64,
        retry_after_wide_ms: [u64; 2],
    ) -> Self {
        Decision {
            allowed,
            retry_after_ms,
            remaining,
            retry_after_wide_ms,
        }
    }

    /// The exact wait past `u64::MAX` ms as (high, low) words, `[0, 0]`
    /// for any other (the store's own copies).
    pub(crate) const fn retry_after_wide_ms(&self) -> [u64; 2] {
        self.retry_after_wide_ms
    }

    /// The exact wait, as [`Decision::retry_after_ms`] says it but also
    /// past `u64::MAX` ms; 128 bits, as [`std::time::Duration::as_millis`].
    pub const fn retry_after_exact_ms(&self) -> Option<u128> {
        let [high, low] = self.retry_after_wide_ms;
        match self.retry_after_ms {
            Some(u64::MAX) if high != 0 => Some(((high as u128) << 64) | low as u128),
            Some(ms) => Some(ms as u128),
            None => None,
        }
    }

    /// The exact wait: [`Decision::retry_after_exact_ms`], under its
    /// former name.
    #[deprecated(since = "0.1.0", note = "renamed retry_after_exact_ms (units last)")]
    pub const fn retry_after_ms_exact(&self) -> Option<u128> {
        self.retry_after_exact_ms()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_shows_the_fields_a_user_knows_with_the_wait_exact() {
        assert_eq!(
            format!("{:?}", Decision::refused(Some(250), 3)),
            "Decision { allowed: false, retry_after_ms: Some(250), remaining: 3 }"
        );
        let wide = Decision::refused_exact(Some(1 << 70), 0);
        assert_eq!(
            format!("{wide:?}"),
            format!(
                "Decision {{ allowed: false, retry_after_ms: Some({}), remaining: 0 }}",
                1u128 << 70
            )
        );
    }

    #[test]
    fn waits_round_trip_exactly_and_saturate_in_the_u64_field() {
        for wait in [0, 1, u128::from(u64::MAX) - 1, u128::from(u64::MAX)] {
            let d = Decision::refused_exact(Some(wait), 3);
            assert_eq!(d.retry_after_exact_ms(), Some(wait));
            assert_eq!(d, Decision::refused(Some(wait as u64), 3));
        }
        let max_safe = u128::from(crate::MAX_SAFE);
        for wait in [u128::from(u64::MAX) + 1, 1 << 64 | 5, max_safe * max_safe] {
            let d = Decision::refused_exact(Some(wait), 3);
            assert_eq!(d.retry_after_exact_ms(), Some(wait));
            assert_eq!(d.retry_after_ms, Some(u64::MAX));
            assert_ne!(d, Decision::refused(Some(u64::MAX), 3));
        }
        assert_eq!(Decision::refused_exact(None, 3), Decision::refused(None, 3));
        // A wrapper that caps the wait through the public field caps it
        // everywhere: the exact wait, `Debug`, equality.
        let mut capped = Decision::refused_exact(Some(1 << 70), 3);
        capped.retry_after_ms = Some(60_000);
        assert_eq!(capped.retry_after_exact_ms(), Some(60_000));
        assert_eq!(capped, Decision::refused(Some(60_000), 3));
        assert!(format!("{capped:?}").contains("Some(60000)"));
        assert_eq!(Decision::admitted(7).retry_after_exact_ms(), Some(0));
        // No 16-byte field, so no 16-byte tag for a `Result` to test.
        assert_eq!(std::mem::align_of::<Decision>(), 8);
    }

    #[test]
    fn serde_writes_the_exact_wait_and_reads_it_back() {
        let long = u128::from(u64::MAX) + 7;
        let d = Decision::refused_exact(Some(long), 2);
        let json = serde_json::to_string(&d).unwrap();
        assert_eq!(
            json,
            format!(r#"{{"allowed":false,"retry_after_ms":{long},"remaining":2}}"#)
        );
        assert_eq!(serde_json::from_str::<Decision>(&json).unwrap(), d);
        for d in [Decision::admitted(4), Decision::refused(None, 0)] {
            let json = serde_json::to_string(&d).unwrap();
            assert_eq!(serde_json::from_str::<Decision>(&json).unwrap(), d);
        }
        // A wait that fits is a plain u64, so a buffered value (as
        // untagged enums and flatten use) holds it.
        let d = Decision::refused(Some(u64::MAX), 0);
        let value = serde_json::to_value(d).unwrap();
        assert_eq!(value["retry_after_ms"], serde_json::json!(u64::MAX));
        assert_eq!(serde_json::from_value::<Decision>(value).unwrap(), d);
        for bad in [
            r#"{"allowed":false,"retry_after_ms":0,"remaining":0}"#,
            r#"{"allowed":true,"retry_after_ms":null,"remaining":0}"#,
            r#"{"allowed":true,"retry_after_ms":0,"remaining":0,"retry_after_wide_ms":[1,0]}"#,
        ] {
            assert!(serde_json::from_str::<Decision>(bad).is_err(), "{bad}");
        }
    }
}
