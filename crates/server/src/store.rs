//! Where counts live: a factory that makes one limiter per rule.
//!
//! The server only ever holds `Arc<dyn Limiter>`, so a store is pluggable by
//! writing a [`StoreFactory`]. The embedded store is [`MemoryFactory`]; a
//! networked store provides its own factory.

use std::fmt;
use std::sync::Arc;

use ratewarden_core::{Limiter, LocalLimiter, MemoryOptions, PolicyConfig};

/// A limiter made for one rule.
#[derive(Clone)]
pub struct BuiltLimiter {
    /// The limiter every request of the rule goes through.
    pub limiter: Arc<dyn Limiter>,
    /// The in-memory limiter behind it, when it is one, so the server's
    /// housekeeping timer can forget its idle keys.
    pub local: Option<LocalLimiter>,
}

impl fmt::Debug for BuiltLimiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BuiltLimiter")
            .field("config", self.limiter.config())
            .finish()
    }
}

/// Makes the limiter for each rule.
pub trait StoreFactory: Send + Sync {
    /// A short description for logs (`memory`, `redis://host:port`).
    fn describe(&self) -> String;

    /// A limiter for `config`. `rule_id` is the rule's identity: a store
    /// that shares one key space between rules can use it as a prefix, but
    /// keys reaching the limiter already include it in their hash.
    fn build(&self, rule_id: &str, config: &PolicyConfig) -> anyhow::Result<BuiltLimiter>;
}

/// The embedded in-memory store: one sharded table per rule, bounded to
/// `max_keys` keys.
#[derive(Debug, Clone, Copy)]
pub struct MemoryFactory {
    /// Options of every rule's store.
    pub options: MemoryOptions,
}

impl StoreFactory for MemoryFactory {
    fn describe(&self) -> String {
        format!("memory (at most {} keys per rule)", self.options.max_keys)
    }

    fn build(&self, _rule_id: &str, config: &PolicyConfig) -> anyhow::Result<BuiltLimiter> {
        let local = LocalLimiter::new(*config, self.options)?;
        Ok(BuiltLimiter {
            limiter: Arc::new(local.clone()),
            local: Some(local),
        })
    }
}

/// What `--store` names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreUrl {
    /// The embedded in-memory store.
    Memory,
    /// A single Redis server, `redis://host:port/db`.
    Redis(String),
    /// A Redis Cluster, `redis-cluster://host:port,host:port`.
    RedisCluster(String),
}

impl std::str::FromStr for StoreUrl {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s == "memory" {
            Ok(StoreUrl::Memory)
        } else if s.starts_with("redis://") || s.starts_with("rediss://") {
            Ok(StoreUrl::Redis(s.to_owned()))
        } else if s.starts_with("redis-cluster://") {
            Ok(StoreUrl::RedisCluster(s.to_owned()))
        } else {
            Err(format!(
                "unknown store {s:?}; use memory, redis://host:port or redis-cluster://host:port,host:port"
            ))
        }
    }
}
