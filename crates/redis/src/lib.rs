//! The Redis store: every policy of `ratewarden-core` as one atomic Lua
//! script, with decisions identical to the in-memory store's, on a single
//! Redis node or on Redis Cluster.
//!
//! Each script touches exactly one Redis key, which holds the whole state of
//! one limiter key, so a script never spans two cluster slots. Scripts are
//! called by `EVALSHA`, and with their text (`EVAL`) when Redis answers
//! `NOSCRIPT`. Their arithmetic is exact over SPEC's whole range
//! (`0 ..= 2^53 - 1`): Lua
//! numbers are doubles, so products that may pass `2^53` are done on
//! numbers split into 24-bit limbs, and small values take a plain fast path.
//!
//! [`RedisStore`] decides `(key, now_ms, cost)`, one at a time or many per
//! round trip; [`RedisLimiter`] implements [`ratewarden_core::Limiter`] on it
//! with a timeout on every call and a failure policy. See `docs/redis.md`.
//!
//! ```no_run
//! # async fn demo() -> Result<(), ratewarden_core::StoreError> {
//! use ratewarden_core::REFERENCE;
//! use ratewarden_redis::{RedisOptions, RedisStore};
//! let store = RedisStore::connect("redis://127.0.0.1:6379", REFERENCE, RedisOptions::default()).await?;
//! // `None`: the script reads Redis TIME, one clock for the whole fleet.
//! let decision = store.decide(42, None, 1).await?;
//! assert!(decision.allowed);
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod down;
mod io;
mod limiter;
mod store;
#[cfg(feature = "test-support")]
pub mod test_support;
mod tls;
mod url;

pub use limiter::{Checked, FailureCounts, RedisLimiter, RedisTime};
pub use store::{
    cluster_enabled, escape_key_part, is_refused_key, is_unresolved_host, key_glob, key_name,
    unix_socket_problem, RedisOptions, RedisStore, MAX_BATCH,
};
pub use tls::check_tls_files;
pub use url::{
    is_cluster_url, is_redis_like_url, is_store_url, quoted_or_hidden, redact_url, url_error,
    url_form_error,
};
