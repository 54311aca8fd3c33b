//! The response headers: `Retry-After` (RFC 9110) and `RateLimit-Policy` /
//! `RateLimit` from draft-ietf-httpapi-ratelimit-headers, revision -10,
//! written in the draft's structured-field syntax:
//!
//! ```text
//! RateLimit-Policy: "default";q=100;w=1
//! RateLimit: "default";r=0;t=1
//! ```
//!
//! The draft counts time in whole seconds, the policies in milliseconds.
//! Every conversion here rounds so that a client that obeys the headers is
//! never refused because of the rounding:
//!
//! - `Retry-After` and `t` round the wait **up** to whole seconds, at least 1:
//!   waiting that long is never earlier than the real next admission.
//! - `w` rounds the window **up** to whole seconds, at least 1: a client that
//!   sends at most `q` in any `w` seconds sends at most `q` in any shorter
//!   window too.

use http::header::HeaderName;
use http::HeaderValue;
use ratewarden_core::{Decision, PolicyConfig};

/// The `RateLimit` response header.
pub const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// The `RateLimit-Policy` response header.
pub const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");

/// The largest integer a structured field may carry (RFC 9651 §3.3.1:
/// at most 15 digits). Larger counts are reported as this value.
pub const SF_INTEGER_MAX: u64 = 999_999_999_999_999;

/// The longest policy name accepted, in bytes; a header is not the place for
/// prose.
pub const MAX_POLICY_NAME_LEN: usize = 64;

/// Whole seconds to wait for a wait of `retry_after_ms`, as `Retry-After`
/// and `t` say it: rounded up, at least 1 (a `Retry-After: 0` would invite
/// an immediate retry that is refused again), at most [`SF_INTEGER_MAX`]
/// (the structured fields' bound). [`header_wait_secs`] does the same for
/// a decision, with its wait past `u64::MAX` ms too.
///
/// ```
/// use ratewarden_tower::headers::{retry_after_secs, SF_INTEGER_MAX};
/// assert_eq!(retry_after_secs(1), 1);
/// assert_eq!(retry_after_secs(1000), 1);
/// assert_eq!(retry_after_secs(1001), 2);
/// assert_eq!(retry_after_secs(0), 1);
/// assert_eq!(retry_after_secs(u64::MAX), SF_INTEGER_MAX);
/// ```
pub const fn retry_after_secs(retry_after_ms: u64) -> u64 {
    let secs = retry_after_ms.div_ceil(1000);
    if secs == 0 {
        1
    } else if secs > SF_INTEGER_MAX {
        SF_INTEGER_MAX
    } else {
        secs
    }
}

/// The window advertised as `w`: `window_ms` in whole seconds, rounded up,
/// at least 1.
///
/// ```
/// use ratewarden_tower::headers::window_secs;
/// assert_eq!(window_secs(1000), 1);
/// assert_eq!(window_secs(100), 1);
/// assert_eq!(window_secs(1500), 2);
/// assert_eq!(window_secs(60_000), 60);
/// ```
pub const fn window_secs(window_ms: u64) -> u64 {
    retry_after_secs(window_ms)
}

/// The wait of `decision` as both `t` and `Retry-After` say it: whole
/// seconds from the exact wait (the 64-bit `retry_after_ms` saturates for
/// the longest waits), rounded up, at least 1, and at most
/// `SF_INTEGER_MAX` because `t` is a structured-field integer and the two
/// headers should not disagree. `None` when no wait admits the request.
///
/// ```
/// use ratewarden_core::Decision;
/// use ratewarden_tower::headers::{header_wait_secs, SF_INTEGER_MAX};
/// assert_eq!(header_wait_secs(&Decision::refused(Some(1001), 0)), Some(2));
/// assert_eq!(header_wait_secs(&Decision::refused_exact(Some(u128::MAX), 0)), Some(SF_INTEGER_MAX));
/// assert_eq!(header_wait_secs(&Decision::refused(None, 0)), None);
/// ```
pub fn header_wait_secs(decision: &Decision) -> Option<u64> {
    let ms = decision.retry_after_exact_ms()?;
    let secs = ms.div_ceil(1000).max(1);
    Some(u64::try_from(secs).map_or(SF_INTEGER_MAX, sf_integer))
}

/// The quota advertised as `q`: the limit per window, or for the buckets the
/// smaller of the limit and the burst (a bucket smaller than its refill can
/// never admit a whole window's limit at once), at most [`SF_INTEGER_MAX`].
///
/// ```
/// use ratewarden_core::{PolicyConfig, PolicyKind, REFERENCE};
/// use ratewarden_tower::headers::quota;
/// assert_eq!(quota(&REFERENCE), 100);
/// let bucket = PolicyConfig::new(PolicyKind::TokenBucket, 10, 1000).with_burst(4);
/// assert_eq!(quota(&bucket), 4);
/// ```
pub fn quota(config: &PolicyConfig) -> u64 {
    let q = if config.policy.has_burst() {
        config.limit.min(config.effective_burst())
    } else {
        config.limit
    };
    sf_integer(q)
}

/// The remaining count advertised as `r`: `remaining`, but never above
/// [`quota`]. A bucket whose burst exceeds its limit can hold more than `q`
/// (a full bucket of 200 under a limit of 100 per second); saying so would
/// contradict `q`, and a client told less than it may send is never refused
/// for believing it.
///
/// ```
/// use ratewarden_core::{PolicyConfig, PolicyKind, REFERENCE};
/// use ratewarden_tower::headers::advertised_remaining;
/// assert_eq!(advertised_remaining(&REFERENCE, 99), 99);
/// let bucket = PolicyConfig::new(PolicyKind::TokenBucket, 100, 1000).with_burst(200);
/// assert_eq!(advertised_remaining(&bucket, 199), 100);
/// ```
pub fn advertised_remaining(config: &PolicyConfig, remaining: u64) -> u64 {
    remaining.min(quota(config))
}

/// Checks that `name` can be written as a structured-field String: printable
/// ASCII, at most [`MAX_POLICY_NAME_LEN`] bytes, not empty.
pub fn check_policy_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("the policy name is empty; give a short name such as \"default\"".into());
    }
    if name.len() > MAX_POLICY_NAME_LEN {
        return Err(format!(
            "the policy name is {} bytes long; use at most {MAX_POLICY_NAME_LEN}",
            name.len()
        ));
    }
    if let Some(c) = name.chars().find(|c| !(' '..='~').contains(c)) {
        return Err(format!(
            "the policy name {name:?} contains {c:?}; use printable ASCII only \
             (a structured-field String cannot carry it)"
        ));
    }
    Ok(())
}

/// `name` as a structured-field String: quoted, with `"` and `\` escaped.
fn sf_string(name: &str) -> String {
    let mut out = String::with_capacity(name.len() + 2);
    out.push('"');
    for c in name.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

fn sf_integer(n: u64) -> u64 {
    n.min(SF_INTEGER_MAX)
}

/// The header values for one layer: the policy's name and configuration are
/// fixed, so `RateLimit-Policy` is built once.
#[derive(Debug, Clone)]
pub struct RateLimitHeaders {
    name: String,
    /// `name;`, how every item of this policy starts.
    item_start: String,
    policy: HeaderValue,
    /// `q`, which bounds every `r`.
    quota: u64,
}

impl RateLimitHeaders {
    /// The headers for `config` under the policy name `name`.
    pub fn new(name: &str, config: &PolicyConfig) -> Result<Self, String> {
        check_policy_name(name)?;
        Ok(Self::checked(name, config))
    }

    /// Whether a `RateLimit` field value already holds an item of this
    /// policy's name: two nested layers of one name, whose items a client
    /// cannot tell apart. A list's members are split at each comma outside
    /// a quoted string, with any spaces or tabs after it (RFC 9651's OWS).
    pub fn names_an_item_in(&self, value: &HeaderValue) -> bool {
        let bytes = value.as_bytes();
        let item_at = |from: usize| {
            bytes[from..]
                .trim_ascii_start()
                .starts_with(self.item_start.as_bytes())
        };
        let (mut quoted, mut escaped) = (false, false);
        for (i, &b) in bytes.iter().enumerate() {
            match b {
                _ if escaped => escaped = false,
                b'\\' if quoted => escaped = true,
                b'"' => quoted = !quoted,
                b',' if !quoted && item_at(i + 1) => return true,
                _ => {}
            }
        }
        item_at(0)
    }

    /// The headers for `config` under the name `default`.
    pub fn default_name(config: &PolicyConfig) -> Self {
        Self::checked("default", config)
    }

    /// Builds the headers for a name that passed [`check_policy_name`].
    fn checked(name: &str, config: &PolicyConfig) -> Self {
        let name = sf_string(name);
        let quota = quota(config);
        let policy = format!(
            "{name};q={quota};w={}",
            sf_integer(window_secs(config.window_ms))
        );
        // A checked name and digits always make a valid value; an empty
        // value would still be a valid field rather than a panic.
        let policy = HeaderValue::try_from(policy).unwrap_or_else(|_| HeaderValue::from_static(""));
        RateLimitHeaders {
            item_start: format!("{name};"),
            name,
            policy,
            quota,
        }
    }

    /// The `RateLimit-Policy` value.
    ///
    /// ```
    /// use ratewarden_core::REFERENCE;
    /// use ratewarden_tower::headers::RateLimitHeaders;
    /// let h = RateLimitHeaders::new("default", &REFERENCE).unwrap();
    /// assert_eq!(h.policy(), "\"default\";q=100;w=1");
    /// ```
    pub fn policy(&self) -> &HeaderValue {
        &self.policy
    }

    /// The `RateLimit` value for `decision`: `r` is the remaining count (as
    /// [`advertised_remaining`] bounds it); `t`,
    /// the wait in whole seconds rounded up, is present only on a refusal
    /// that some wait can end. An admitted request has no wait to report,
    /// and a request that can never be admitted must not promise one.
    ///
    /// ```
    /// use ratewarden_core::{Decision, REFERENCE};
    /// use ratewarden_tower::headers::RateLimitHeaders;
    /// let h = RateLimitHeaders::new("default", &REFERENCE).unwrap();
    /// assert_eq!(h.ratelimit(&Decision::admitted(99)), "\"default\";r=99");
    /// assert_eq!(h.ratelimit(&Decision::refused(Some(1001), 0)), "\"default\";r=0;t=2");
    /// assert_eq!(h.ratelimit(&Decision::refused(None, 100)), "\"default\";r=100");
    /// ```
    pub fn ratelimit(&self, decision: &Decision) -> HeaderValue {
        let r = decision.remaining.min(self.quota);
        let value = match (decision.allowed, header_wait_secs(decision)) {
            (false, Some(t)) => format!("{};r={r};t={t}", self.name),
            _ => format!("{};r={r}", self.name),
        };
        // The name was checked to be printable ASCII and the rest is digits,
        // so the conversion cannot fail; an empty value would still be a
        // valid field rather than a panic.
        HeaderValue::try_from(value).unwrap_or_else(|_| HeaderValue::from_static(""))
    }

    /// The `Retry-After` value for `decision`, when it is a refusal that some
    /// wait can end.
    ///
    /// ```
    /// use ratewarden_core::{Decision, REFERENCE};
    /// use ratewarden_tower::headers::RateLimitHeaders;
    /// let h = RateLimitHeaders::new("default", &REFERENCE).unwrap();
    /// assert_eq!(h.retry_after(&Decision::refused(Some(1), 0)).unwrap(), "1");
    /// assert!(h.retry_after(&Decision::refused(None, 0)).is_none());
    /// assert!(h.retry_after(&Decision::admitted(5)).is_none());
    /// ```
    pub fn retry_after(&self, decision: &Decision) -> Option<HeaderValue> {
        match (decision.allowed, header_wait_secs(decision)) {
            (false, Some(secs)) => Some(HeaderValue::from(secs)),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn header_waits_round_up_to_at_least_a_second_and_clamp_to_15_digits() {
        use super::{header_wait_secs, SF_INTEGER_MAX};
        use ratewarden_core::Decision;
        let secs = |ms: u128| header_wait_secs(&Decision::refused_exact(Some(ms), 0)).unwrap();
        assert_eq!(secs(1), 1);
        assert_eq!(secs(1000), 1);
        assert_eq!(secs(1001), 2);
        assert_eq!(secs(0), 1);
        assert_eq!(secs(999_999_999_999_999_000), SF_INTEGER_MAX);
        assert_eq!(secs(999_999_999_999_999_001), SF_INTEGER_MAX);
        assert_eq!(secs(u128::from(u64::MAX)), SF_INTEGER_MAX);
        assert_eq!(secs(u128::MAX), SF_INTEGER_MAX);
    }

    use super::*;
    use ratewarden_core::PolicyKind;

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        let cases = [(1, 1), (999, 1), (1000, 1), (1001, 2), (2000, 2), (2001, 3)];
        for (ms, secs) in cases {
            assert_eq!(retry_after_secs(ms), secs, "{ms} ms");
        }
        assert_eq!(retry_after_secs(u64::MAX), SF_INTEGER_MAX);
    }

    #[test]
    fn policy_header_rounds_sub_second_windows_up() {
        let config = PolicyConfig::new(PolicyKind::FixedWindow, 10, 250);
        let h = RateLimitHeaders::new("api", &config).unwrap();
        assert_eq!(h.policy(), "\"api\";q=10;w=1");
        let config = PolicyConfig::new(PolicyKind::FixedWindow, 10, 2500);
        let h = RateLimitHeaders::new("api", &config).unwrap();
        assert_eq!(h.policy(), "\"api\";q=10;w=3");
    }

    #[test]
    fn names_are_escaped_and_checked() {
        let h = RateLimitHeaders::new("a\"b\\c", &ratewarden_core::REFERENCE).unwrap();
        assert_eq!(h.policy(), "\"a\\\"b\\\\c\";q=100;w=1");
        assert!(RateLimitHeaders::new("", &ratewarden_core::REFERENCE).is_err());
        let err = RateLimitHeaders::new("caf\u{e9}", &ratewarden_core::REFERENCE).unwrap_err();
        assert!(err.contains("printable ASCII"), "{err}");
        let long = "x".repeat(MAX_POLICY_NAME_LEN + 1);
        assert!(RateLimitHeaders::new(&long, &ratewarden_core::REFERENCE).is_err());
        // "At most 64 bytes" (the builder's docs): a name of exactly 64 is taken.
        let longest = "x".repeat(64);
        assert!(RateLimitHeaders::new(&longest, &ratewarden_core::REFERENCE).is_ok());
    }

    #[test]
    fn an_item_of_the_same_name_is_found() {
        let h = RateLimitHeaders::new("api", &ratewarden_core::REFERENCE).unwrap();
        for (value, found) in [
            ("\"api\";r=3", true),
            ("\"web\";r=1, \"api\";r=0;t=1", true),
            ("\"api-2\";r=3", false),
            ("\"web\";r=1", false),
            ("\"web, \\\"api\";r=1", false),
            ("\"web\";r=1,\"api\";r=0;t=1", true),
            ("\"web\";r=1 ,\t\"api\";r=0;t=1", true),
            ("  \"api\";r=3", true),
            ("\"web\";r=1,\"api-2\";r=3", false),
        ] {
            let value = HeaderValue::from_str(value).unwrap();
            assert_eq!(h.names_an_item_in(&value), found, "{value:?}");
        }
        // A comma inside a quoted string splits nothing, even one just
        // before the closing quote, whose rest reads like an item of a
        // name such as `;a=`.
        let h = RateLimitHeaders::new(";a=", &ratewarden_core::REFERENCE).unwrap();
        for (value, found) in [
            ("\"web,\";a=\";x\"", false),
            ("\"w\\\",\";a=\";x\"", false),
            ("\"web,\";a=\";x\", \";a=\";r=1", true),
        ] {
            let value = HeaderValue::from_str(value).unwrap();
            assert_eq!(h.names_an_item_in(&value), found, "{value:?}");
        }
    }

    #[test]
    fn remaining_never_exceeds_the_advertised_quota() {
        let bucket = PolicyConfig::new(PolicyKind::TokenBucket, 100, 1000).with_burst(200);
        let h = RateLimitHeaders::new("b", &bucket).unwrap();
        assert_eq!(h.policy(), "\"b\";q=100;w=1");
        assert_eq!(h.ratelimit(&Decision::admitted(199)), "\"b\";r=100");
        assert_eq!(h.ratelimit(&Decision::admitted(42)), "\"b\";r=42");
        let small = PolicyConfig::new(PolicyKind::Gcra, 100, 1000).with_burst(5);
        let h = RateLimitHeaders::new("g", &small).unwrap();
        assert_eq!(h.policy(), "\"g\";q=5;w=1");
        assert_eq!(h.ratelimit(&Decision::admitted(4)), "\"g\";r=4");
    }

    #[test]
    fn counts_beyond_fifteen_digits_are_clamped() {
        let max = ratewarden_core::MAX_SAFE;
        let config = PolicyConfig::new(PolicyKind::FixedWindow, max, max);
        let h = RateLimitHeaders::new("big", &config).unwrap();
        assert_eq!(h.policy(), "\"big\";q=999999999999999;w=9007199254741");
        let d = Decision::refused(Some(u64::MAX), max);
        assert_eq!(
            h.ratelimit(&d),
            "\"big\";r=999999999999999;t=999999999999999"
        );
        // Retry-After says the same clamped wait rather than the 64-bit
        // one, which is neither the true wait nor a valid `t`.
        assert_eq!(h.retry_after(&d).unwrap(), "999999999999999");
        let d = Decision::refused_exact(Some(u128::from(u64::MAX) * 1000), 0);
        assert_eq!(h.retry_after(&d).unwrap(), "999999999999999");
        assert_eq!(h.ratelimit(&d), "\"big\";r=0;t=999999999999999");
        let d = Decision::refused(Some(999_999_999_999_998_001), 0);
        assert_eq!(h.retry_after(&d).unwrap(), "999999999999999");
        let d = Decision::refused(Some(999_999_999_999_997_001), 0);
        assert_eq!(h.retry_after(&d).unwrap(), "999999999999998");
    }
}
