//! Which count a request spends, and the name of its key on a Redis store:
//! what an operator needs to find one client's count, to delete it (and so
//! give that client its whole budget back) or to read it.
//!
//! The service names Redis keys by hashes (of the rule's identity and of
//! the request's values), so that a key name is short and bounded whatever
//! a client sends; this module makes those names from the configuration
//! and the request, as the running service does, without a store.

use std::sync::Arc;

use ratewarden_core::PolicyConfig;

use crate::config::{unit_ms, ConfigSource};
use crate::metrics::Metrics;
use crate::rules::{LimitOverride, RuleSet};
use crate::service::{check_descriptor_request, DescriptorRequest};
use crate::store::{rule_prefix, MemoryFactory, StoreFactory};

/// A request, as `POST /v1/check` or `ShouldRateLimit` takes one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// A `key` request, decided by the `[keys]` rule.
    Key(String),
    /// One descriptor of a domain: its entries in order, and the limit
    /// it carries in place of its rule's, if any (`requests_per_unit`
    /// and unit, as `10/minute`).
    Descriptor {
        /// The domain.
        domain: String,
        /// Keys and values, in the order the request sends them.
        entries: Vec<(String, String)>,
        /// The descriptor's own limit (an override), if it carries one.
        limit: Option<LimitOverride>,
    },
}

/// The count a request spends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Count {
    /// The rule's name, as metrics and answers give it.
    pub rule: String,
    /// The policy and numbers the count is decided by.
    pub policy: PolicyConfig,
    /// Whether the rule is a shadow one (counted, never refusing).
    pub shadow: bool,
    /// The name of the count's key on a Redis store (single node or
    /// cluster alike), under the configuration's `key_prefix`.
    pub redis_key: String,
    /// Why the service ignores the limit the request carries, counting by
    /// the rule instead, when it does.
    pub ignored: Option<String>,
}

/// Reads `--limit`'s `REQUESTS_PER_UNIT/UNIT` (`10/minute`).
pub fn parse_limit(text: &str) -> Result<LimitOverride, String> {
    let usage = "write REQUESTS_PER_UNIT/UNIT, such as 10/minute, as the request carries it";
    let (limit, unit) = text
        .split_once('/')
        .ok_or_else(|| format!("{text:?} has no '/'; {usage}"))?;
    let limit = limit
        .parse::<u64>()
        .ok()
        .filter(|&n| n <= ratewarden_core::MAX_SAFE)
        .ok_or_else(|| {
            format!(
                "{limit:?} is not a whole number of requests from 0 to 2^53 - 1 (the service \
                 refuses others); {usage}"
            )
        })?;
    let window_ms = unit_ms(unit).map_err(|_| {
        format!(
            "unknown unit {unit:?}; use second, minute, hour, day, week, month (30 days) or \
             year (365 days), in any case"
        )
    })?;
    Ok(LimitOverride { limit, window_ms })
}

/// The count `request` spends under the configuration `source` names, as
/// the service decides it; an error says why it spends none (no rule
/// matches, the descriptor is unlimited, the domain is unknown) or what is
/// wrong with the configuration.
pub async fn count_of(source: &ConfigSource, request: &Request) -> anyhow::Result<Count> {
    let config = source
        .load_within(crate::service::RELOAD_READ_TIMEOUT)
        .await?;
    let settings = config.server.clone();
    // Counts are matched, not decided: the embedded store is made for
    // each rule only because a rule set holds limiters.
    let factory: Arc<dyn StoreFactory> = Arc::new(MemoryFactory {
        options: settings.memory_options(),
    });
    let metrics = Metrics::default();
    let rules = RuleSet::build(config, factory.as_ref(), None, &metrics).await?;
    let mut ignored = None;
    let matched = match request {
        Request::Key(key) if key.is_empty() => {
            anyhow::bail!("the key is empty, which the service refuses: no count is kept")
        }
        Request::Key(key) => rules.match_key(key, settings.key_hash)?,
        Request::Descriptor {
            domain,
            entries,
            limit,
        } => {
            let request = DescriptorRequest {
                entries: entries.clone(),
                cost: 1,
                limit: *limit,
            };
            check_descriptor_request(domain, std::slice::from_ref(&request))
                .map_err(|e| anyhow::anyhow!("the service refuses this request: {e}"))?;
            if !rules.knows_domain(domain) {
                anyhow::bail!(
                    "the configuration has no [[domains]] entry {domain:?} (and no [fallback]): \
                     the service limits nothing in that domain, so no count is kept"
                );
            }
            // As the service decides: a limit it ignores leaves the rule's
            // count, said on the way.
            let (matched, why) = rules
                .match_with_limit(
                    domain,
                    entries,
                    *limit,
                    settings.limit_overrides,
                    &factory,
                    &metrics,
                )
                .await;
            ignored =
                why.map(|why| format!("the service ignores the request's limit because of {why}"));
            matched.ok_or_else(|| {
                let why = if rules.is_unlimited(domain, entries) {
                    "reaches an unlimited = true entry"
                } else {
                    "matches no rule (and there is no [fallback])"
                };
                let ignored = ignored
                    .as_deref()
                    .map(|i| format!("{i}; and "))
                    .unwrap_or_default();
                anyhow::anyhow!(
                    "{ignored}the descriptor {why}: the service limits nothing for it, so no \
                     count is kept"
                )
            })?
        }
    };
    let rule = &matched.rule;
    Ok(Count {
        ignored,
        rule: rule.spec.name.clone(),
        policy: rule.spec.policy,
        shadow: rule.spec.shadow,
        redis_key: ratewarden_redis::key_name(
            &rule_prefix(&settings.key_prefix, &rule.id),
            &rule.spec.policy,
            matched.key,
        ),
    })
}
