//! Keys: unsigned integers. String keys are hashed.
//!
//! The default hash is **mix32**, MurmurHash3 x86_32 with seed 0 over the
//! key's UTF-8 bytes, as SPEC fixes it, so every port maps a string to the
//! same key. Two strings with one hash share one count (`user:21620` and
//! `user:32611` collide).
//!
//! How many collide: among `n` distinct strings a `b`-bit hash gives about
//! `n^2 / 2^(b+1)` colliding pairs. For a million keys that is about 116
//! pairs with mix32 (`10^12 / 2^33`), and about `2.7e-8` with the 64-bit
//! [`xxh3_64`] (`10^12 / 2^65`): a deployment with that many keys wants
//! [`KeyHash::Xxh3_64`].
//!
//! Colliding on purpose: both hashes are public and unkeyed (they must be,
//! to be portable), and neither is a cryptographic hash. Where a client
//! chooses the key material (a header's value, an address within its own
//! network), it can search for a string whose hash equals *another*
//! client's key and spend that client's budget. Against mix32 such a search
//! takes seconds (2^32 tries at most, and mix32 can be inverted step by step
//! to build one faster). Where clients choose key material, use
//! [`KeyHash::Xxh3_64`]: a search by trial costs about 2^64 tries. That
//! raises the cost of an attack; it does not prove that no colliding string
//! can be crafted, since xxh3 is not designed to resist that.

use std::io::Cursor;

/// MurmurHash3 x86_32 with seed 0 over `key`'s UTF-8 bytes.
///
/// ```
/// use ratewarden_core::mix32;
/// assert_eq!(mix32(""), 0);
/// assert_eq!(mix32("hello"), 0x248b_fa47);
/// assert_eq!(mix32("user:21620"), mix32("user:32611"));
/// ```
pub fn mix32(key: &str) -> u32 {
    // Reading from an in-memory cursor cannot fail.
    murmur3::murmur3_32(&mut Cursor::new(key.as_bytes()), 0).unwrap_or(0)
}

/// XXH3-64 with seed 0 over `key`'s UTF-8 bytes: the hash for key spaces too
/// large for mix32.
///
/// ```
/// use ratewarden_core::xxh3_64;
/// assert_ne!(xxh3_64("user:21620"), xxh3_64("user:32611"));
/// ```
pub fn xxh3_64(key: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(key.as_bytes())
}

/// Which hash turns a string key into an integer key.
///
/// With serde it is its name, as in configuration files: `"mix32"` or
/// `"xxh3-64"`.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize,
)]
pub enum KeyHash {
    /// [`mix32`]: SPEC's default, portable, 32 bits.
    #[default]
    #[serde(rename = "mix32")]
    Mix32,
    /// [`xxh3_64`]: 64 bits, for millions of keys and wherever clients
    /// choose key material.
    #[serde(rename = "xxh3-64")]
    Xxh3_64,
}

impl KeyHash {
    /// The integer key for `key`.
    pub fn hash(self, key: &str) -> u64 {
        match self {
            KeyHash::Mix32 => u64::from(mix32(key)),
            KeyHash::Xxh3_64 => xxh3_64(key),
        }
    }

    /// The hash's name in configurations: `mix32` or `xxh3-64`.
    pub const fn name(self) -> &'static str {
        match self {
            KeyHash::Mix32 => "mix32",
            KeyHash::Xxh3_64 => "xxh3-64",
        }
    }
}

impl std::fmt::Display for KeyHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// ```
/// use ratewarden_core::KeyHash;
/// assert_eq!("xxh3-64".parse::<KeyHash>().unwrap(), KeyHash::Xxh3_64);
/// assert_eq!(KeyHash::Mix32.to_string(), "mix32");
/// let err = "xxh3".parse::<KeyHash>().unwrap_err();
/// assert_eq!(err.to_string(), r#"unknown key hash "xxh3"; use one of: mix32, xxh3-64"#);
/// ```
impl std::str::FromStr for KeyHash {
    type Err = crate::ConfigError;

    fn from_str(s: &str) -> Result<Self, crate::ConfigError> {
        match s {
            "mix32" => Ok(KeyHash::Mix32),
            "xxh3-64" => Ok(KeyHash::Xxh3_64),
            other => Err(crate::ConfigError::UnknownName {
                setting: "key hash",
                name: other.to_owned(),
                choices: "mix32, xxh3-64",
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mix32_known_values() {
        assert_eq!(mix32(""), 0);
        assert_eq!(mix32("hello"), 0x248bfa47);
        assert_eq!(
            mix32("The quick brown fox jumps over the lazy dog"),
            0x2e4ff723
        );
        assert_eq!(mix32("user:42"), 3349586805);
        assert_eq!(mix32("ключ"), 2589532226);
        assert_eq!(mix32("user:21620"), 2051118272);
        assert_eq!(mix32("user:32611"), 2051118272);
    }

    #[test]
    fn key_hash_selects_the_hash() {
        assert_eq!(KeyHash::Mix32.hash("hello"), 0x248bfa47);
        assert_eq!(KeyHash::Xxh3_64.hash("hello"), xxh3_64("hello"));
        assert_ne!(
            KeyHash::Xxh3_64.hash("user:21620"),
            KeyHash::Xxh3_64.hash("user:32611")
        );
    }
}
