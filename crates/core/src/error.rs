//! Errors: a configuration that can never be valid, and a store that failed.
//!
//! A refused request is not an error; it is a [`Decision`](crate::Decision).

use std::fmt;

/// A policy configuration that cannot be used, with what to change.
///
/// Non-exhaustive: a later version may tell more cases apart.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConfigError {
    /// `window_ms` was 0; a window must last at least one millisecond.
    ZeroWindow,
    /// A number lies outside `0 ..= 2^53 - 1`.
    OutOfRange {
        /// The field's name, as the configuration spells it.
        field: &'static str,
        /// The value given.
        value: u128,
    },
    /// The policy name is not one of the registry's.
    UnknownPolicy {
        /// The name given.
        name: String,
    },
    /// `burst` was given to a policy that has no bucket.
    BurstNotAllowed {
        /// The registry name of the policy.
        policy: &'static str,
    },
    /// A name that is not one of a setting's choices (a failure policy, a
    /// key hash).
    UnknownName {
        /// What the name is for, e.g. `failure policy`.
        setting: &'static str,
        /// The name given.
        name: String,
        /// The names taken, e.g. `open, closed, local`.
        choices: &'static str,
    },
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::ZeroWindow => {
                write!(
                    f,
                    "window_ms is 0: a window must last at least 1 ms; set window_ms to 1 or more"
                )
            }
            ConfigError::OutOfRange { field, value } => write!(
                f,
                "{field} is {value}, above the largest allowed value 9007199254740991 (2^53 - 1); \
                 use a smaller {field}"
            ),
            ConfigError::UnknownPolicy { name } => write!(
                f,
                "unknown policy {name:?}; use one of: {}",
                crate::PolicyKind::ALL
                    .iter()
                    .map(|k| k.name())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            ConfigError::BurstNotAllowed { policy } => write!(
                f,
                "burst is given for {policy}, which has no bucket; remove burst, \
                 or use token-bucket or gcra"
            ),
            ConfigError::UnknownName {
                setting,
                name,
                choices,
            } => write!(f, "unknown {setting} {name:?}; use one of: {choices}"),
        }
    }
}

impl std::error::Error for ConfigError {}

/// A configuration refused where a store is built is the caller's input
/// refused: `?` carries it into a function that returns [`StoreError`].
///
/// ```
/// use ratewarden_core::{PolicyConfig, PolicyKind, StoreError, StoreErrorKind};
/// fn build() -> Result<(), StoreError> {
///     PolicyConfig::new(PolicyKind::FixedWindow, 10, 0).build()?;
///     Ok(())
/// }
/// let e = build().unwrap_err();
/// assert_eq!(e.kind(), StoreErrorKind::InvalidInput);
/// assert!(e.detail().contains("window_ms is 0"));
/// ```
impl From<ConfigError> for StoreError {
    fn from(e: ConfigError) -> Self {
        StoreError::new(StoreErrorKind::InvalidInput, e.to_string())
    }
}

/// What kind of failure a [`StoreError`] is, so that a caller can choose to
/// fail open, fail closed or fall back without parsing messages.
///
/// Non-exhaustive: a later store may fail in a new way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StoreErrorKind {
    /// The store did not answer within the configured timeout. The request
    /// may or may not have been applied.
    Timeout,
    /// The connection to the store was lost or could not be made. On a
    /// cluster, also: the node holding the key cannot be reached (it is
    /// down, or a failover is under way).
    ConnectionDropped,
    /// The key's part of the store (a memory store's shard) holds its
    /// maximum number of keys and found none to forget when it last looked
    /// through them, so it cannot track a new one that the request would
    /// admit: the request was not decided
    /// (never silently admitted). A request that admits nothing on a new
    /// key (a peek, or a cost above the limit or burst) gets a new key's
    /// answer instead, with nothing kept.
    CapacityExhausted,
    /// The state stored under the key is not valid state for the policy.
    CorruptState,
    /// The input is invalid, and stays so however often it is retried: a
    /// request's `now_ms` or `cost` out of range, or, from a store's
    /// constructor (`RedisStore::connect`), its configuration, options or
    /// URL.
    InvalidInput,
    /// The store answered with an error of its own.
    Backend,
}

impl StoreErrorKind {
    /// Every kind, in the order declared (a slice: a later kind must not
    /// change its type).
    pub const ALL: &'static [StoreErrorKind] = &[
        StoreErrorKind::Timeout,
        StoreErrorKind::ConnectionDropped,
        StoreErrorKind::CapacityExhausted,
        StoreErrorKind::CorruptState,
        StoreErrorKind::InvalidInput,
        StoreErrorKind::Backend,
    ];

    /// The kind's name in snake case, as metrics label it and
    /// [`Display`](fmt::Display) writes it: `timeout`, `connection_dropped`,
    /// `capacity_exhausted`, `corrupt_state`, `invalid_input`, `backend`.
    pub const fn name(self) -> &'static str {
        match self {
            StoreErrorKind::Timeout => "timeout",
            StoreErrorKind::ConnectionDropped => "connection_dropped",
            StoreErrorKind::CapacityExhausted => "capacity_exhausted",
            StoreErrorKind::CorruptState => "corrupt_state",
            StoreErrorKind::InvalidInput => "invalid_input",
            StoreErrorKind::Backend => "backend",
        }
    }
}

impl fmt::Display for StoreErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A store failed to decide a request. The request was not decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreError {
    kind: StoreErrorKind,
    detail: String,
}

impl StoreError {
    /// An error of `kind` with a message for people.
    pub fn new(kind: StoreErrorKind, detail: impl Into<String>) -> Self {
        StoreError {
            kind,
            detail: detail.into(),
        }
    }

    /// What kind of failure this is.
    pub fn kind(&self) -> StoreErrorKind {
        self.kind
    }

    /// The message for people.
    pub fn detail(&self) -> &str {
        &self.detail
    }

    /// The store did not answer in time; the request may have been applied.
    pub fn is_timeout(&self) -> bool {
        self.kind == StoreErrorKind::Timeout
    }

    /// The connection to the store is gone.
    pub fn is_connection_dropped(&self) -> bool {
        self.kind == StoreErrorKind::ConnectionDropped
    }

    /// The store is full of keys.
    pub fn is_capacity_exhausted(&self) -> bool {
        self.kind == StoreErrorKind::CapacityExhausted
    }

    /// The request carried a value that can never be decided.
    pub fn is_invalid_input(&self) -> bool {
        self.kind == StoreErrorKind::InvalidInput
    }

    /// Worth retrying soon: the store did not answer (a timeout, a dropped
    /// connection, a failure of its own) and may once it is reachable
    /// again. Not a full in-memory store ([`is_capacity_exhausted`]),
    /// which has room again only as keys fall idle and are forgotten
    /// (`MemoryStore::forget_idle`), so a prompt retry meets the same
    /// error; nor corrupt state or invalid input, which stay wrong however
    /// often they are retried.
    ///
    /// [`is_capacity_exhausted`]: StoreError::is_capacity_exhausted
    pub fn is_transient(&self) -> bool {
        matches!(
            self.kind,
            StoreErrorKind::Timeout | StoreErrorKind::ConnectionDropped | StoreErrorKind::Backend
        )
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            StoreErrorKind::Timeout => "store timeout",
            StoreErrorKind::ConnectionDropped => "store connection dropped",
            StoreErrorKind::CapacityExhausted => "store capacity exhausted",
            StoreErrorKind::CorruptState => "corrupt state in store",
            StoreErrorKind::InvalidInput => "invalid input",
            StoreErrorKind::Backend => "store error",
        };
        write!(f, "{kind}: {}", self.detail)
    }
}

impl std::error::Error for StoreError {}

/// Checks a request's numbers against SPEC's range (`0 ..= 2^53 - 1`)
/// before any decision, as every store does: an
/// [`StoreErrorKind::InvalidInput`] naming the number that is out of it.
///
/// ```
/// use ratewarden_core::{check_request, MAX_SAFE};
/// assert!(check_request(MAX_SAFE, MAX_SAFE).is_ok());
/// let e = check_request(0, MAX_SAFE + 1).unwrap_err();
/// assert_eq!(e.detail(), "cost is 9007199254740992, above 2^53 - 1 (9007199254740991)");
/// ```
pub fn check_request(now_ms: u64, cost: u64) -> Result<(), StoreError> {
    if now_ms > crate::MAX_SAFE {
        return Err(StoreError::new(
            StoreErrorKind::InvalidInput,
            format!("now_ms is {now_ms}, above 2^53 - 1 (9007199254740991)"),
        ));
    }
    if cost > crate::MAX_SAFE {
        return Err(StoreError::new(
            StoreErrorKind::InvalidInput,
            format!("cost is {cost}, above 2^53 - 1 (9007199254740991)"),
        ));
    }
    Ok(())
}
