//! The configuration compiled for matching: descriptor trees of rules, each
//! rule with its limiter.
//!
//! A reload builds a new [`RuleSet`] and keeps the limiter (and so the
//! counts) of every rule whose identity and policy configuration are
//! unchanged; only new or changed rules start from empty counts. Limit
//! overrides are kept likewise while the rule they stand in for keeps what
//! they take from it.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use anyhow::Context as _;
use ratewarden_core::{
    xxh3_64, BoxFuture, Clock, Decision, KeyHash, Limiter, LocalLimiter, MonotonicClock,
    PolicyConfig, StoreError, StoreErrorKind, REFERENCE,
};

use crate::config::{Config, DescriptorSpec, RuleSpec, ServerSettings};
use crate::metrics::{Metrics, RuleMetrics};
use crate::store::StoreFactory;

/// One configured limit, ready to decide.
pub struct Rule {
    /// The rule's identity: its place in the configuration. Counts are
    /// keyed by it, so two rules never share a count.
    pub id: String,
    /// Name, policy and shadow flag.
    pub spec: RuleSpec,
    /// The limiter on the configured store.
    pub limiter: Arc<dyn Limiter>,
    /// The in-memory limiter behind `limiter`, when it is one (for
    /// housekeeping).
    pub local: Option<LocalLimiter>,
    /// The limiter that decides while the store fails, under the `local`
    /// failure policy on a networked store.
    pub failover: Option<LocalLimiter>,
    /// The rule's counters.
    pub metrics: Arc<RuleMetrics>,
    /// The override entry a rule made for one request stands for, held so
    /// that the entry is not dropped while the request decides.
    _held_override: Option<Arc<OverrideEntry>>,
}

impl fmt::Debug for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rule")
            .field("id", &self.id)
            .field("spec", &self.spec)
            .finish()
    }
}

#[derive(Debug, Default)]
struct Level {
    exact: HashMap<(String, String), Node>,
    /// Nodes whose value ends in `*`: key, the value's prefix, and the
    /// node; longest prefix first, so the most specific match wins.
    prefix: Vec<(String, String, Node)>,
    any: HashMap<String, Node>,
}

#[derive(Debug)]
struct Node {
    rule: Option<Arc<Rule>>,
    unlimited: bool,
    children: Level,
}

/// A compiled configuration.
#[derive(Debug)]
pub struct RuleSet {
    /// The configuration it was compiled from.
    pub config: Config,
    keys: Option<Arc<Rule>>,
    fallback: Option<Arc<Rule>>,
    domains: HashMap<String, Level>,
    all: Vec<Arc<Rule>>,
    overrides: Overrides,
}

/// What a descriptor matched.
#[derive(Debug, Clone)]
pub struct Matched {
    /// The rule.
    pub rule: Arc<Rule>,
    /// The integer key of the count: the rule identity and the descriptor's
    /// values, hashed together.
    pub key: u64,
}

/// Why a request cannot be matched at all.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MatchError {
    /// A `key` request, but the configuration has no `[keys]` rule.
    NoKeysRule,
}

impl fmt::Display for MatchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MatchError::NoKeysRule => f.write_str(
                "the configuration has no [keys] rule for key requests; send domain and descriptors, \
                 or add a [keys] table to the configuration",
            ),
        }
    }
}

impl std::error::Error for MatchError {}

/// Joins parts so that distinct lists of parts give distinct strings: each
/// part is written as its length in bytes, `:`, then the part itself. A
/// separator alone would not do, since a value may contain it: with one,
/// the value `"v\x1fk2\x1fv2"` read the same as two entries.
fn compose<'a>(parts: impl IntoIterator<Item = &'a str>) -> String {
    let mut s = String::new();
    for part in parts {
        s.push_str(&part.len().to_string());
        s.push(':');
        s.push_str(part);
    }
    s
}

/// The count key of a descriptor decided by the rule `rule_id`. A rule on
/// the descriptor's path through the tree (`domain` `None`) takes the
/// values only, since the path fixes the domain and the keys; a rule off
/// it (the fallback's, or an override's outside the tree) takes the
/// domain and every key and value.
///
/// Always the 64-bit XXH3 of the composed string, whatever `key_hash`
/// says. The client chooses the values, and with an unkeyed 32-bit hash it
/// could search out a value whose key is a victim's in seconds and share
/// the victim's budget; a targeted 64-bit collision takes about 2^64
/// tries. The composition is this service's own, so no port needs to
/// agree on the hash.
fn count_key(rule_id: &str, domain: Option<&str>, entries: &[(String, String)]) -> u64 {
    let composed = match domain {
        None => compose(std::iter::once(rule_id).chain(entries.iter().map(|(_, v)| v.as_str()))),
        Some(domain) => compose(
            [rule_id, domain]
                .into_iter()
                .chain(entries.iter().flat_map(|(k, v)| [k.as_str(), v.as_str()])),
        ),
    };
    xxh3_64(&composed)
}

impl RuleSet {
    /// Compiles `config`, building a limiter with `factory` for each rule
    /// unless `previous` has one for the same identity and policy.
    pub async fn build(
        config: Config,
        factory: &dyn StoreFactory,
        previous: Option<&RuleSet>,
        metrics: &Metrics,
    ) -> anyhow::Result<RuleSet> {
        let old: HashMap<&str, &Arc<Rule>> = previous
            .map(|p| p.all.iter().map(|r| (r.id.as_str(), r)).collect())
            .unwrap_or_default();
        let local_failover = config.server.failure_policy.is_local();
        let mut limiters = HashMap::new();
        for (id, spec) in rule_ids(&config) {
            let parts = match old.get(id.as_str()) {
                // Redis names keys by the effective burst too, so both
                // stores keep a rule's counts across such a reload.
                Some(o) if o.spec.policy.decides_alike(&spec.policy) => {
                    (Arc::clone(&o.limiter), o.local.clone(), o.failover.clone())
                }
                _ => {
                    let built = factory.build(&id, &spec.policy).await.with_context(|| {
                        format!("cannot make the limiter of rule {:?}", spec.name)
                    })?;
                    // A networked store under the `local` failure policy
                    // needs an in-memory twin to decide while it is away;
                    // the memory store is its own.
                    let failover = match (&built.local, local_failover) {
                        (None, true) => Some(LocalLimiter::new(
                            spec.policy,
                            config.server.memory_options(),
                        )?),
                        _ => None,
                    };
                    (built.limiter, built.local, failover)
                }
            };
            limiters.insert(id, parts);
        }
        let mut b = Builder {
            limiters,
            metrics,
            all: Vec::new(),
        };
        let keys = config
            .keys
            .as_ref()
            .map(|spec| b.rule("keys".to_owned(), spec));
        let fallback = config
            .fallback
            .as_ref()
            .map(|spec| b.rule("fallback".to_owned(), spec));
        let mut domains = HashMap::with_capacity(config.domains.len());
        for d in &config.domains {
            domains.insert(
                d.domain.clone(),
                b.level(&domain_id(&d.domain), &d.descriptors),
            );
        }
        let all = b.all;
        let mut set = RuleSet {
            config,
            keys,
            fallback,
            domains,
            all,
            overrides: Overrides::default(),
        };
        if let Some(p) = previous {
            // The entries kept below carry their last uses on the previous
            // set's clocks: the new set goes on with them.
            set.overrides.clock = p.overrides.clock;
            let order = std::sync::atomic::Ordering::Relaxed;
            set.overrides
                .uses
                .store(p.overrides.uses.load(order), order);
            set.overrides
                .min_idle_ms
                .store(p.overrides.min_idle_ms.load(order), order);
            // Overrides whose rule keeps its identity, name, policy and
            // shadow flag would be made again just as they are: keep them,
            // and their counts, as unchanged rules keep their limiters. So
            // too those whose limiter could not be made yet: under the
            // `local` failure policy their twin holds counts.
            let kept: Vec<_> = p
                .overrides
                .entries
                .lock()
                .values()
                .filter(|e| {
                    // The override takes only these from its rule.
                    set.base_spec(&e.base_id).is_some_and(|b| {
                        (&b.name, b.shadow, b.policy.policy)
                            == (
                                &e.base_spec.name,
                                e.base_spec.shadow,
                                e.base_spec.policy.policy,
                            )
                    })
                })
                .cloned()
                .collect();
            let mut map = set.overrides.entries.lock();
            for e in kept {
                map.insert(e.id.clone(), e);
            }
        }
        Ok(set)
    }

    /// Every rule, for housekeeping and metrics.
    pub fn rules(&self) -> &[Arc<Rule>] {
        &self.all
    }

    /// The names of the enforcing rules that admit no request that costs
    /// anything, ever: a limit of 0 (a burst of 0 for the buckets). A valid
    /// way to close a route, but also what someone who meant "no limit"
    /// writes, so `serve` warns of them at start and at each reload. (An
    /// Envoy descriptor that carries its own limit is decided by that.)
    pub fn closed_rules(&self) -> Vec<&str> {
        self.all
            .iter()
            .filter(|r| !r.spec.shadow && r.spec.policy.capacity() == 0)
            .map(|r| r.spec.name.as_str())
            .collect()
    }

    /// Warns of [`RuleSet::closed_rules`], if any.
    pub fn warn_of_closed_rules(&self) {
        let closed = self.closed_rules();
        if !closed.is_empty() {
            tracing::warn!(
                // A name may hold a line break (one of its own, or a
                // descriptor value's it defaults to): kept on one line.
                rules = %crate::one_line(&closed.join(", ")),
                "these rules admit no request that costs anything, ever (a limit of 0, or a \
                 burst of 0), unless an Envoy descriptor carries its own limit; if that is not \
                 meant, give them a limit (a descriptor that should have none can say \
                 `unlimited = true` instead)"
            );
        }
    }

    /// Whether the domain is configured, or a fallback rule covers it.
    pub fn knows_domain(&self, domain: &str) -> bool {
        self.domains.contains_key(domain) || self.fallback.is_some()
    }

    /// The rule and count key for a `key` request: the key string, after
    /// the rule's identity, hashed with the configured `key_hash`.
    pub fn match_key(&self, key: &str, hash: KeyHash) -> Result<Matched, MatchError> {
        let rule = self.keys.as_ref().ok_or(MatchError::NoKeysRule)?;
        // The identity is the fixed "keys", so one separator is unambiguous.
        Ok(Matched {
            rule: Arc::clone(rule),
            key: hash.hash(&format!("{}\u{1f}{key}", rule.id)),
        })
    }

    /// Whether a descriptor's entries reach an `unlimited = true` node of
    /// the domain's tree: matched, and never limited.
    pub fn is_unlimited(&self, domain: &str, entries: &[(String, String)]) -> bool {
        self.domains
            .get(domain)
            .and_then(|level| walk(level, entries))
            .is_some_and(|n| n.unlimited)
    }

    /// The rule a descriptor's entries match, as envoyproxy/ratelimit
    /// matches them: entry by entry down the domain's tree, a node with the
    /// entry's key and value first, else the node with the key and any
    /// value; the rule is the one on the node the last entry reaches. A
    /// descriptor no rule matches falls to the fallback rule, if any.
    ///
    /// The count key is the rule's identity and the entries' values (the
    /// path through the tree fixes their keys; the fallback's also takes the
    /// domain and the keys), composed unambiguously and hashed with XXH3-64.
    pub fn match_descriptor(&self, domain: &str, entries: &[(String, String)]) -> Option<Matched> {
        if let Some(level) = self.domains.get(domain) {
            let node = walk(level, entries);
            if node.is_some_and(|n| n.unlimited) {
                // Matched and never limited: not the fallback's either.
                return None;
            }
            if let Some(rule) = node.and_then(|n| n.rule.as_ref()) {
                return Some(Matched {
                    rule: Arc::clone(rule),
                    key: count_key(&rule.id, None, entries),
                });
            }
        }
        let rule = self.fallback.as_ref()?;
        Some(Matched {
            rule: Arc::clone(rule),
            key: count_key(&rule.id, Some(domain), entries),
        })
    }
}

/// The most distinct override configurations (base rule, limit, window) one
/// [`RuleSet`] holds limiters for at once. Clients choose overrides, and
/// each configuration is a limiter of its own (on Redis, a script load and
/// a store on the shared connection; in memory, a table), so
/// their number is bounded. A new override past the bound takes the place
/// of the least recently used one that has gone unused for
/// [`OVERRIDE_MIN_IDLE_MS`], holds no count and serves no request, which
/// changes no decision; when none can make room, the configured rule
/// applies.
pub const MAX_OVERRIDES: usize = 256;

/// The most entries a key's log may hold under a `sliding-log` rule's
/// override, `min(limit, window_ms)`, unless the rule's own may hold more:
/// a log is read and written whole by every decision, so a caller free to
/// choose a limit of 2^53 for a year grew one key by up to 16 bytes a
/// millisecond, held for a year, and every call on it slowed Redis for
/// every rule. 10,000 entries are about 160 KB a key.
pub const MAX_OVERRIDE_LOG_ENTRIES: u64 = 10_000;

/// A descriptor's own limit: Envoy's `RateLimitDescriptor.limit`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LimitOverride {
    /// Permits per window: the override's `requests_per_unit`.
    pub limit: u64,
    /// The window: the override's unit, in ms.
    pub window_ms: u64,
}

/// How a descriptor with a limit override is decided.
#[derive(Debug, Clone)]
pub enum OverrideMatch {
    /// By the override's own rule and count key.
    Applied(Matched),
    /// Not at all: the override is ignored, for the reason given, and the
    /// configured rule applies.
    Ignored(&'static str),
}

/// How long an override must have gone unused before a new one may take
/// its place: on Redis each override made is a script load, and without
/// this more than [`MAX_OVERRIDES`] overrides in turn would load one a
/// request.
pub const OVERRIDE_MIN_IDLE_MS: u64 = 10_000;

/// The limiters of the overrides a [`RuleSet`] has seen, by override
/// identity. Entries are made on first use and live as long as the set,
/// unless a new one needs the place of one that holds nothing.
struct Overrides {
    entries: parking_lot::Mutex<HashMap<String, Arc<OverrideEntry>>>,
    /// Uses so far, the order of `OverrideEntry::last_use`.
    uses: std::sync::atomic::AtomicU64,
    /// The clock of `OverrideEntry::last_use_ms`.
    clock: MonotonicClock,
    /// [`OVERRIDE_MIN_IDLE_MS`], but in tests.
    min_idle_ms: std::sync::atomic::AtomicU64,
}

impl Default for Overrides {
    fn default() -> Self {
        Overrides {
            entries: Default::default(),
            uses: Default::default(),
            clock: MonotonicClock::new(),
            min_idle_ms: OVERRIDE_MIN_IDLE_MS.into(),
        }
    }
}

impl Overrides {
    /// Drops the least recently used entry that holds nothing, to make room
    /// for a new one; false when every entry holds something.
    fn evict_one(&self, map: &mut HashMap<String, Arc<OverrideEntry>>) -> bool {
        let now_ms = self.clock.now_ms();
        let min_idle_ms = self.min_idle_ms.load(std::sync::atomic::Ordering::Relaxed);
        let victim = map
            .iter()
            .filter(|(_, e)| e.holds_nothing(now_ms, min_idle_ms))
            .min_by_key(|(_, e)| e.last_use.load(std::sync::atomic::Ordering::Relaxed))
            .map(|(id, _)| id.clone());
        victim.is_some_and(|id| map.remove(&id).is_some())
    }
}

impl fmt::Debug for Overrides {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Overrides")
            .field("entries", &self.entries.lock().len())
            .finish()
    }
}

/// One override configuration.
struct OverrideEntry {
    id: String,
    spec: RuleSpec,
    /// The identity and spec of the rule the override stands in for: a
    /// reload keeps the entry, and its counts, while both are unchanged.
    base_id: String,
    base_spec: RuleSpec,
    metrics: Arc<RuleMetrics>,
    /// The in-memory twin deciding under the `local` failure policy, made
    /// on first need; kept here rather than with the limiter so that it
    /// also decides (and counts) while the store's limiter cannot be made.
    failover: std::sync::OnceLock<Option<LocalLimiter>>,
    /// The rule, made once however many requests ask at the same time; a
    /// failed attempt leaves it empty and the next request tries again.
    rule: tokio::sync::OnceCell<Arc<Rule>>,
    /// `Overrides::uses` at the entry's last use.
    last_use: std::sync::atomic::AtomicU64,
    /// `Overrides::now_ms` at the entry's last use.
    last_use_ms: std::sync::atomic::AtomicU64,
}

impl OverrideEntry {
    /// Whether dropping the entry, unused for `min_idle_ms`, can change no
    /// later decision: no request or other rule set holds it (a request
    /// clones an entry under the map's lock, which the caller holds, and
    /// keeps it until it holds the entry's rule, or, while the store's
    /// limiter cannot be made, a rule that holds the entry; a reload clones
    /// entries under the previous set's lock), no request holds its rule,
    /// and no count lives in it. An in-memory limiter holds counts until
    /// housekeeping forgets its keys as idle; a Redis limiter keeps them in
    /// Redis, where a limiter made again for the same override finds them;
    /// the `local` failure policy's twin holds counts of its own while
    /// Redis fails. The cheap tests come first: the last looks into every
    /// shard of the stores.
    fn holds_nothing(self: &Arc<Self>, now_ms: u64, min_idle_ms: u64) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        if Arc::strong_count(self) > 1
            || now_ms.saturating_sub(self.last_use_ms.load(Relaxed)) < min_idle_ms
            || self
                .rule
                .get()
                .is_some_and(|rule| Arc::strong_count(rule) > 1)
        {
            return false;
        }
        let empty = |l: &LocalLimiter| l.store().entries_tracked() == 0;
        self.failover.get().into_iter().flatten().all(empty)
            && self
                .rule
                .get()
                .is_none_or(|rule| rule.local.iter().chain(rule.failover.iter()).all(empty))
    }

    fn failover(&self, settings: &ServerSettings) -> Option<LocalLimiter> {
        self.failover
            .get_or_init(|| LocalLimiter::new(self.spec.policy, settings.memory_options()).ok())
            .clone()
    }
}

/// The limiter of an override whose store limiter could not be made (a
/// Redis connection refused): every call fails, so the failure policy
/// decides, as for a rule whose store fails.
struct Unavailable {
    config: PolicyConfig,
    kind: StoreErrorKind,
    detail: String,
}

impl Limiter for Unavailable {
    fn config(&self) -> &PolicyConfig {
        &self.config
    }

    fn check(&self, _key: u64, _cost: u64) -> BoxFuture<'_, Result<Decision, StoreError>> {
        let e = StoreError::new(self.kind, self.detail.clone());
        Box::pin(std::future::ready(Err(e)))
    }
}

/// What an override takes from the configuration: the identity, name,
/// policy and shadow flag of the rule it stands in for.
struct OverrideBase<'a> {
    id: std::borrow::Cow<'a, str>,
    name: std::borrow::Cow<'a, str>,
    spec: &'a RuleSpec,
    /// Whether the path through the tree fixes the entries' keys (a
    /// matched rule); otherwise the domain and keys go into the count key,
    /// as the fallback's do.
    on_path: bool,
}

/// The rule an override stands in for when no configured rule matches and
/// there is no fallback: the reference policy, never shadow.
static REFERENCE_SPEC: std::sync::LazyLock<RuleSpec> = std::sync::LazyLock::new(|| RuleSpec {
    name: String::new(),
    policy: REFERENCE,
    shadow: false,
});

impl RuleSet {
    /// The rule and count key of a descriptor that carries `limit` or
    /// none, as the service decides it: the override's own when
    /// `overrides` (`[server] limit_overrides`) lets the service take one
    /// and it is taken (see [`RuleSet::match_override`]), else the
    /// descriptor's rule's, with why the override was ignored.
    pub async fn match_with_limit(
        &self,
        domain: &str,
        entries: &[(String, String)],
        limit: Option<LimitOverride>,
        overrides: bool,
        factory: &Arc<dyn StoreFactory>,
        metrics: &Metrics,
    ) -> (Option<Matched>, Option<&'static str>) {
        let Some(over) = limit else {
            return (self.match_descriptor(domain, entries), None);
        };
        if !overrides {
            let why = "limit_overrides = false in [server]: this server takes no caller's limit";
            return (self.match_descriptor(domain, entries), Some(why));
        }
        match self
            .match_override(domain, entries, over, factory, metrics)
            .await
        {
            Some(OverrideMatch::Applied(m)) => (Some(m), None),
            Some(OverrideMatch::Ignored(why)) => {
                (self.match_descriptor(domain, entries), Some(why))
            }
            None => (None, None),
        }
    }

    /// The rule and count key of a descriptor carrying a limit `over`ride,
    /// as envoyproxy/ratelimit applies one: in any known domain, whatever
    /// the tree holds for the descriptor (a rule, no rule, an unlimited
    /// node). The override keeps the policy, shadow flag and name (suffixed
    /// `.override`) of the rule that matches, else of the fallback, else
    /// takes the reference policy; its limit and window replace the rule's,
    /// and a bucket's burst is the override's limit. Its counts are its
    /// own: the identity is the rule's, the limit and the window composed,
    /// and the key composes the descriptor as the rule's key does.
    ///
    /// `None` for a domain neither configured nor covered by a fallback:
    /// unlimited, as without the override. The limiter is made with
    /// `factory` on first use; if that fails the returned rule's store
    /// fails every call, so the failure policy decides.
    pub async fn match_override(
        &self,
        domain: &str,
        entries: &[(String, String)],
        over: LimitOverride,
        factory: &Arc<dyn StoreFactory>,
        metrics: &Metrics,
    ) -> Option<OverrideMatch> {
        let base = self.override_base(domain, entries)?;
        let limit = over.limit.to_string();
        let window = over.window_ms.to_string();
        let id = compose([base.id.as_ref(), "override", &limit, &window]);
        let entry = {
            let mut map = self.overrides.entries.lock();
            match map.get(&id).cloned() {
                Some(e) => e,
                None if map.len() >= MAX_OVERRIDES && !self.overrides.evict_one(&mut map) => {
                    // The text names the bound.
                    const _: () = assert!(MAX_OVERRIDES == 256);
                    return Some(OverrideMatch::Ignored(
                        "the bound of 256 distinct overrides held at once, none of which can make \
                         room (each used in the last 10 s, in use, or holding counts): clients \
                         send more distinct limits than that; have them send fewer, or configure \
                         the limits as descriptors of their own",
                    ));
                }
                None => {
                    // The rule's burst was sized for its own limit: the
                    // bucket's capacity is the override's limit.
                    let policy =
                        PolicyConfig::new(base.spec.policy.policy, over.limit, over.window_ms);
                    if policy.build().is_err() {
                        return Some(OverrideMatch::Ignored("an override no policy accepts"));
                    }
                    let log_entries = |c: &PolicyConfig| {
                        (c.policy == ratewarden_core::PolicyKind::SlidingLog)
                            .then(|| c.limit.min(c.window_ms))
                    };
                    if log_entries(&policy).is_some_and(|entries| {
                        entries > MAX_OVERRIDE_LOG_ENTRIES
                            && entries > log_entries(&base.spec.policy).unwrap_or(0)
                    }) {
                        // The text names the bound.
                        const _: () = assert!(MAX_OVERRIDE_LOG_ENTRIES == 10_000);
                        return Some(OverrideMatch::Ignored(
                            "a sliding-log override whose key's log could hold more than 10,000 \
                             entries (min(limit, window_ms)), past the rule's own: every decision \
                             reads and writes the whole log; configure such limits as rules of \
                             their own, or with sliding-window-counter",
                        ));
                    }
                    let spec = RuleSpec {
                        name: format!("{}.override", base.name),
                        policy,
                        shadow: base.spec.shadow,
                    };
                    let e = Arc::new(OverrideEntry {
                        id: id.clone(),
                        base_id: base.id.clone().into_owned(),
                        base_spec: base.spec.clone(),
                        metrics: metrics.rule(&spec.name),
                        spec,
                        failover: std::sync::OnceLock::new(),
                        rule: tokio::sync::OnceCell::new(),
                        last_use: Default::default(),
                        last_use_ms: Default::default(),
                    });
                    map.insert(id, Arc::clone(&e));
                    e
                }
            }
        };
        let use_now = self
            .overrides
            .uses
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        entry
            .last_use
            .store(use_now, std::sync::atomic::Ordering::Relaxed);
        entry.last_use_ms.store(
            self.overrides.clock.now_ms(),
            std::sync::atomic::Ordering::Relaxed,
        );
        // Waited for within one store call's time, as every store call is
        // bounded: a Redis that does not answer would otherwise hold the
        // request for its connect timeout (a second by default), past
        // Envoy's own timeout, whose failure_mode_deny then answers instead
        // of the failure policy. The making goes on in a task of its own
        // (itself bounded by the connect timeout), so that a store slower
        // to make a limiter than to answer one call still gets it made, for
        // a later request; one that fails leaves the entry for the next
        // request to try again.
        let within = std::time::Duration::from_millis(self.config.server.store_timeout_ms);
        let made = match entry.rule.get() {
            Some(rule) => Ok(Ok(Arc::clone(rule))),
            None => {
                let making = {
                    let entry = Arc::clone(&entry);
                    let factory = Arc::clone(factory);
                    let settings = self.config.server.clone();
                    tokio::spawn(async move {
                        entry
                            .rule
                            .get_or_try_init(|| {
                                Self::make_override(&entry, factory.as_ref(), &settings)
                            })
                            .await
                            .map(Arc::clone)
                    })
                };
                match tokio::time::timeout(within, making).await {
                    Ok(Ok(made)) => Ok(made),
                    Ok(Err(failed)) => Ok(Err(anyhow::anyhow!("{failed}"))),
                    Err(elapsed) => Err(elapsed),
                }
            }
        };
        let unmade = |kind, detail| {
            Arc::new(Rule {
                id: entry.id.clone(),
                spec: entry.spec.clone(),
                limiter: Arc::new(Unavailable {
                    config: entry.spec.policy,
                    kind,
                    detail,
                }),
                local: None,
                failover: (self.config.server.failure_policy.is_local())
                    .then(|| entry.failover(&self.config.server))
                    .flatten(),
                metrics: Arc::clone(&entry.metrics),
                // While a request decides on the twin, the entry (and so the
                // twin's counts) must not be dropped to make room.
                _held_override: Some(Arc::clone(&entry)),
            })
        };
        let rule = match made {
            Ok(Ok(rule)) => rule,
            Ok(Err(e)) => unmade(
                // Redis away or slow is said as the rules' calls say it
                // (`connection_dropped`, `timeout`); anything else the
                // store refused at making (a key or a password refused,
                // which making classes as the URL's to change) is a
                // `backend` failure of this call, as a rule's is.
                match e
                    .downcast_ref::<crate::store::StoreFailure>()
                    .map(|f| f.kind)
                {
                    Some(kind @ (StoreErrorKind::ConnectionDropped | StoreErrorKind::Timeout)) => {
                        kind
                    }
                    _ => StoreErrorKind::Backend,
                },
                format!("cannot make the limiter of the override: {e:#}"),
            ),
            Err(_) => unmade(
                StoreErrorKind::Timeout,
                format!(
                    "cannot make the limiter of the override: the store did not load its \
                     script and answer within store_timeout_ms ({} ms)",
                    within.as_millis()
                ),
            ),
        };
        let key = count_key(&rule.id, (!base.on_path).then_some(domain), entries);
        Some(OverrideMatch::Applied(Matched { rule, key }))
    }

    async fn make_override(
        entry: &OverrideEntry,
        factory: &dyn StoreFactory,
        settings: &ServerSettings,
    ) -> anyhow::Result<Arc<Rule>> {
        let built = factory.build(&entry.id, &entry.spec.policy).await?;
        // As for rules: a networked store under the `local` failure policy
        // needs the in-memory twin; the memory store is its own.
        let failover = match &built.local {
            None if settings.failure_policy.is_local() => entry.failover(settings),
            _ => None,
        };
        Ok(Arc::new(Rule {
            id: entry.id.clone(),
            spec: entry.spec.clone(),
            limiter: built.limiter,
            local: built.local,
            failover,
            metrics: Arc::clone(&entry.metrics),
            // Kept in the entry: holding the entry would be a cycle.
            _held_override: None,
        }))
    }

    /// The spec of the rule an override with base identity `id` stands in
    /// for in this set, if any: as [`Self::override_base`] finds bases.
    fn base_spec(&self, id: &str) -> Option<&RuleSpec> {
        if let Some(rule) = self.all.iter().find(|r| r.id == id) {
            return Some(&rule.spec);
        }
        let reference = self.fallback.is_none()
            && self
                .config
                .domains
                .iter()
                .any(|d| domain_id(&d.domain) == id);
        reference.then_some(&*REFERENCE_SPEC)
    }

    fn override_base(
        &self,
        domain: &str,
        entries: &[(String, String)],
    ) -> Option<OverrideBase<'_>> {
        let level = self.domains.get(domain);
        if let Some(rule) = level
            .and_then(|l| walk(l, entries))
            .and_then(|n| n.rule.as_ref())
        {
            return Some(OverrideBase {
                id: rule.id.as_str().into(),
                name: rule.spec.name.as_str().into(),
                spec: &rule.spec,
                on_path: true,
            });
        }
        if let Some(rule) = &self.fallback {
            return Some(OverrideBase {
                id: rule.id.as_str().into(),
                name: rule.spec.name.as_str().into(),
                spec: &rule.spec,
                on_path: false,
            });
        }
        level?;
        Some(OverrideBase {
            id: domain_id(domain).into(),
            name: domain.to_owned().into(),
            spec: &REFERENCE_SPEC,
            on_path: false,
        })
    }

    /// The `local` failure policy's twins of the overrides whose limiters
    /// could not be made (Redis away), for housekeeping: their idle keys
    /// are forgotten as any others, so that the override can make room.
    pub fn unmade_override_failovers(&self) -> Vec<LocalLimiter> {
        self.overrides
            .entries
            .lock()
            .values()
            .filter(|e| !e.rule.initialized())
            .filter_map(|e| e.failover.get().cloned().flatten())
            .collect()
    }

    /// The rules of the overrides whose limiters are made, for
    /// housekeeping and metrics.
    pub fn override_rules(&self) -> Vec<Arc<Rule>> {
        self.overrides
            .entries
            .lock()
            .values()
            .filter_map(|e| e.rule.get().cloned())
            .collect()
    }
}

/// The node a descriptor's entries reach, if they stay on the tree. At each
/// level, as envoyproxy/ratelimit looks: the node with the entry's key and
/// exact value, else the node whose value is a prefix ending in `*` (the
/// longest such prefix), else the node with the key alone.
fn walk<'a>(mut level: &'a Level, entries: &[(String, String)]) -> Option<&'a Node> {
    let mut node = None;
    for (k, v) in entries {
        // The lookup by (key, value) needs owned strings in the tuple; the
        // clone is of two short strings per entry.
        let found = level
            .exact
            .get(&(k.clone(), v.clone()))
            .or_else(|| {
                level
                    .prefix
                    .iter()
                    .find(|(pk, p, _)| pk == k && v.starts_with(p.as_str()))
                    .map(|(_, _, n)| n)
            })
            .or_else(|| level.any.get(k))?;
        level = &found.children;
        node = Some(found);
    }
    node
}

fn domain_id(domain: &str) -> String {
    compose(["domain", domain])
}

/// A node's identity: its parent's, its key, and its value (`=` and the
/// value) or `*` for any value; composed, so no configured string can make
/// two nodes' identities equal.
fn node_id(parent_id: &str, node: &DescriptorSpec) -> String {
    match &node.value {
        Some(v) => compose([parent_id, &node.key, &format!("={v}")]),
        None => compose([parent_id, &node.key, "*"]),
    }
}

/// Every rule of `config` with its identity.
fn rule_ids(config: &Config) -> Vec<(String, &RuleSpec)> {
    fn walk<'a>(
        parent_id: &str,
        nodes: &'a [DescriptorSpec],
        out: &mut Vec<(String, &'a RuleSpec)>,
    ) {
        for n in nodes {
            let id = node_id(parent_id, n);
            if let Some(spec) = &n.rule {
                out.push((id.clone(), spec));
            }
            walk(&id, &n.children, out);
        }
    }
    let mut out = Vec::new();
    if let Some(spec) = &config.keys {
        out.push(("keys".to_owned(), spec));
    }
    if let Some(spec) = &config.fallback {
        out.push(("fallback".to_owned(), spec));
    }
    for d in &config.domains {
        walk(&domain_id(&d.domain), &d.descriptors, &mut out);
    }
    out
}

type LimiterParts = (Arc<dyn Limiter>, Option<LocalLimiter>, Option<LocalLimiter>);

struct Builder<'a> {
    limiters: HashMap<String, LimiterParts>,
    metrics: &'a Metrics,
    all: Vec<Arc<Rule>>,
}

impl Builder<'_> {
    fn rule(&mut self, id: String, spec: &RuleSpec) -> Arc<Rule> {
        let (limiter, local, failover) = self
            .limiters
            .get(&id)
            .cloned()
            .expect("every rule's limiter was built before the tree");
        let metrics = self.metrics.rule(&spec.name);
        let rule = Arc::new(Rule {
            id,
            spec: spec.clone(),
            limiter,
            local,
            failover,
            metrics,
            _held_override: None,
        });
        self.all.push(Arc::clone(&rule));
        rule
    }

    fn level(&mut self, parent_id: &str, nodes: &[DescriptorSpec]) -> Level {
        let mut level = Level::default();
        for n in nodes {
            let id = node_id(parent_id, n);
            let rule = n.rule.as_ref().map(|spec| self.rule(id.clone(), spec));
            let children = self.level(&id, &n.children);
            let node = Node {
                rule,
                unlimited: n.unlimited,
                children,
            };
            match &n.value {
                Some(v) if v.ends_with('*') => {
                    let prefix = v[..v.len() - 1].to_owned();
                    level.prefix.push((n.key.clone(), prefix, node));
                }
                Some(v) => {
                    level.exact.insert((n.key.clone(), v.clone()), node);
                }
                None => {
                    level.any.insert(n.key.clone(), node);
                }
            };
        }
        level.prefix.sort_by_key(|p| std::cmp::Reverse(p.1.len()));
        level
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryFactory;
    use ratewarden_core::MemoryOptions;

    fn build(config: Config, previous: Option<&RuleSet>, metrics: &Metrics) -> RuleSet {
        let factory = memory_factory();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        runtime
            .block_on(RuleSet::build(config, &factory, previous, metrics))
            .unwrap()
    }

    fn memory_factory() -> MemoryFactory {
        MemoryFactory {
            options: MemoryOptions::default(),
        }
    }

    /// The rule set of `text`, built on `factory` after `previous`.
    async fn built(
        text: &str,
        factory: &dyn StoreFactory,
        previous: Option<&RuleSet>,
        metrics: &Metrics,
    ) -> RuleSet {
        RuleSet::build(
            Config::parse(text, "t").unwrap(),
            factory,
            previous,
            metrics,
        )
        .await
        .unwrap()
    }

    fn set(text: &str) -> RuleSet {
        build(
            Config::parse(text, "t.toml").unwrap(),
            None,
            &Metrics::default(),
        )
    }

    fn entries(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    const TREE: &str = r#"
[[domains]]
domain = "api"

[[domains.descriptors]]
key = "remote_address"
limit = 5
window_ms = 1000

[[domains.descriptors]]
key = "path"
limit = 50
window_ms = 1000

[[domains.descriptors]]
key = "path"
value = "/login"
limit = 2
window_ms = 1000

[[domains.descriptors.descriptors]]
key = "user"
name = "login-per-user"
limit = 1
window_ms = 1000
"#;

    #[test]
    fn rules_that_admit_nothing_are_named() {
        let s = set(r#"
[keys]
limit = 0
window_ms = 1000

[[domains]]
domain = "api"

[[domains.descriptors]]
key = "a"
policy = "token-bucket"
limit = 10
burst = 0
window_ms = 1000

[[domains.descriptors]]
key = "b"
limit = 0
window_ms = 1000
shadow = true

[[domains.descriptors]]
key = "c"
policy = "gcra"
limit = 0
burst = 1
window_ms = 1000

[[domains.descriptors]]
key = "d"
limit = 1
window_ms = 1000
"#);
        // A shadow rule refuses nothing, and a bucket with a burst admits
        // that burst even when it never refills.
        let mut closed = s.closed_rules();
        closed.sort();
        assert_eq!(closed, ["api.a", "keys"]);
        assert!(set(TREE).closed_rules().is_empty());
    }

    #[test]
    fn descriptors_match_value_before_any_value_and_nest() {
        let s = set(TREE);
        let name = |e: &[(&str, &str)]| {
            s.match_descriptor("api", &entries(e))
                .map(|m| m.rule.spec.name.clone())
        };
        assert_eq!(
            name(&[("remote_address", "1.2.3.4")]).as_deref(),
            Some("api.remote_address")
        );
        assert_eq!(name(&[("path", "/other")]).as_deref(), Some("api.path"));
        assert_eq!(
            name(&[("path", "/login")]).as_deref(),
            Some("api.path_/login")
        );
        assert_eq!(
            name(&[("path", "/login"), ("user", "ann")]).as_deref(),
            Some("login-per-user")
        );
        // A nested descriptor reached through the any-value node: none
        // configured there, so no rule.
        assert_eq!(name(&[("path", "/other"), ("user", "ann")]), None);
        assert_eq!(name(&[("unknown", "x")]), None);
        assert_eq!(name(&[("remote_address", "1.2.3.4"), ("extra", "x")]), None);
        assert!(s.knows_domain("api"));
        assert!(!s.knows_domain("web"));
        // No configured key is empty, so an empty entry key matches nothing.
        assert_eq!(name(&[("", "x")]), None);
        assert_eq!(
            s.match_key("k", KeyHash::Mix32).unwrap_err(),
            MatchError::NoKeysRule
        );
    }

    #[test]
    fn wildcards_unlimited_nodes_and_empty_values_match_as_in_envoyproxy() {
        let s = set(r#"
[fallback]
limit = 1
window_ms = 1000
[[domains]]
domain = "api"
[[domains.descriptors]]
key = "path"
limit = 1
window_ms = 1000
[[domains.descriptors]]
key = "path"
value = "/api/*"
name = "api"
limit = 1
window_ms = 1000
[[domains.descriptors]]
key = "path"
value = "/api/v2/*"
name = "v2"
limit = 1
window_ms = 1000
[[domains.descriptors]]
key = "path"
value = "/api/v2/health"
name = "health"
limit = 1
window_ms = 1000
[[domains.descriptors]]
key = "internal"
unlimited = true
"#);
        let m = |e: &[(&str, &str)]| s.match_descriptor("api", &entries(e));
        let name = |e: &[(&str, &str)]| m(e).map(|m| m.rule.spec.name.clone());
        assert_eq!(
            name(&[("path", "/api/v2/health")]).as_deref(),
            Some("health")
        );
        assert_eq!(name(&[("path", "/api/v2/x")]).as_deref(), Some("v2"));
        assert_eq!(name(&[("path", "/api/v1")]).as_deref(), Some("api"));
        assert_eq!(name(&[("path", "/other")]).as_deref(), Some("api.path"));
        assert_eq!(name(&[("path", "/api/*")]).as_deref(), Some("api"));
        // Each value under a wildcard keeps its own count.
        assert_ne!(
            m(&[("path", "/api/a")]).unwrap().key,
            m(&[("path", "/api/b")]).unwrap().key
        );
        // Matched and unlimited: neither a rule nor the fallback.
        assert!(m(&[("internal", "x")]).is_none());
        assert_eq!(name(&[("other", "x")]).as_deref(), Some("fallback"));
    }

    #[test]
    fn different_values_and_rules_get_different_keys() {
        let s = set(TREE);
        let key = |e: &[(&str, &str)]| s.match_descriptor("api", &entries(e)).unwrap().key;
        assert_ne!(
            key(&[("remote_address", "a")]),
            key(&[("remote_address", "b")])
        );
        assert_eq!(
            key(&[("remote_address", "a")]),
            key(&[("remote_address", "a")])
        );
        assert_ne!(
            key(&[("path", "/login")]),
            key(&[("path", "/login"), ("user", "/login")])
        );
    }

    #[test]
    fn a_value_holding_a_separator_aliases_no_other_descriptor() {
        let s = set("[fallback]\nlimit = 1\nwindow_ms = 1000\n");
        let key =
            |domain: &str, e: &[(&str, &str)]| s.match_descriptor(domain, &entries(e)).unwrap().key;
        assert_ne!(
            key("d", &[("k", "v\u{1f}k2\u{1f}v2")]),
            key("d", &[("k", "v"), ("k2", "v2")])
        );
        assert_ne!(
            key("d\u{1f}k", &[("v", "w")]),
            key("d", &[("k\u{1f}v", "w")])
        );
        assert_ne!(
            key("d", &[("k", "1:x")]),
            key("d", &[("k", ""), ("1", "x")])
        );
        assert_ne!(compose(["ab", "c"]), compose(["a", "bc"]));
        assert_ne!(compose(["1:a"]), compose(["", "a"]));
    }

    /// SPEC's key hash, mix32 (the core's default, and `key_hash = "mix32"`
    /// here), has 32 bits: among some 10^5 values two collide. Descriptor
    /// counts never use it (they always use xxh3-64, whatever `key_hash`
    /// says), so those two values keep their own counts.
    #[test]
    fn values_colliding_under_mix32_keep_their_own_counts() {
        let s = set(TREE);
        let rule = s
            .match_descriptor("api", &entries(&[("remote_address", "x")]))
            .unwrap()
            .rule;
        let mut seen = HashMap::new();
        let (a, b) = (0..1_000_000u32)
            .map(|i| format!("10.{}.{}.{}", i >> 16, (i >> 8) & 255, i & 255))
            .find_map(|v| {
                let h = KeyHash::Mix32.hash(&compose([rule.id.as_str(), v.as_str()]));
                seen.insert(h, v.clone()).map(|old| (old, v))
            })
            .expect("32 bits collide within a million values");
        let key = |v: &str| {
            s.match_descriptor("api", &entries(&[("remote_address", v)]))
                .unwrap()
                .key
        };
        assert_ne!(key(&a), key(&b), "{a} and {b}");
    }

    #[test]
    fn reload_keeps_limiters_of_unchanged_rules() {
        let metrics = Metrics::default();
        let first = build(Config::parse(TREE, "t").unwrap(), None, &metrics);
        let changed = TREE.replace("limit = 50", "limit = 60");
        let second = build(
            Config::parse(&changed, "t").unwrap(),
            Some(&first),
            &metrics,
        );
        let find = |s: &RuleSet, name: &str| {
            s.rules()
                .iter()
                .find(|r| r.spec.name == name)
                .unwrap()
                .limiter
                .clone()
        };
        assert!(Arc::ptr_eq(
            &find(&first, "api.remote_address"),
            &find(&second, "api.remote_address")
        ));
        assert!(Arc::ptr_eq(
            &find(&first, "login-per-user"),
            &find(&second, "login-per-user")
        ));
        assert!(!Arc::ptr_eq(
            &find(&first, "api.path"),
            &find(&second, "api.path")
        ));
    }

    #[tokio::test]
    async fn reload_keeps_overrides_of_unchanged_rules() {
        let factory: Arc<dyn StoreFactory> = Arc::new(memory_factory());
        let metrics = Metrics::default();
        async fn override_limiter(
            s: &RuleSet,
            e: &[(&str, &str)],
            factory: &Arc<dyn StoreFactory>,
            metrics: &Metrics,
        ) -> Arc<dyn Limiter> {
            let over = LimitOverride {
                limit: 1,
                window_ms: 3_600_000,
            };
            match s
                .match_override("api", &entries(e), over, factory, metrics)
                .await
            {
                Some(OverrideMatch::Applied(m)) => m.rule.limiter.clone(),
                other => panic!("{other:?}"),
            }
        }
        let first = built(TREE, factory.as_ref(), None, &metrics).await;
        let login = [("path", "/login")];
        let any = [("path", "/other")];
        let none = [("nothing", "x")];
        let before = [
            override_limiter(&first, &login, &factory, &metrics).await,
            override_limiter(&first, &any, &factory, &metrics).await,
            override_limiter(&first, &none, &factory, &metrics).await,
        ];
        // A new limit on api.path changes nothing the override takes; a new
        // policy on the login rule does.
        let changed = TREE.replace("limit = 50", "limit = 60").replace(
            "value = \"/login\"\n",
            "value = \"/login\"\npolicy = \"gcra\"\n",
        );
        let second = built(&changed, factory.as_ref(), Some(&first), &metrics).await;
        assert!(!Arc::ptr_eq(
            &before[0],
            &override_limiter(&second, &login, &factory, &metrics).await
        ));
        assert!(Arc::ptr_eq(
            &before[1],
            &override_limiter(&second, &any, &factory, &metrics).await
        ));
        assert!(Arc::ptr_eq(
            &before[2],
            &override_limiter(&second, &none, &factory, &metrics).await
        ));
        assert_eq!(
            override_limiter(&second, &login, &factory, &metrics)
                .await
                .config()
                .policy,
            ratewarden_core::PolicyKind::Gcra
        );
    }

    /// An override of `limit` an hour on domain `api`'s `/login` rule: its
    /// match, or `None` when it is ignored.
    async fn login_override(
        set: &RuleSet,
        limit: u64,
        factory: &Arc<dyn StoreFactory>,
        metrics: &Metrics,
    ) -> Option<Matched> {
        let over = LimitOverride {
            limit,
            window_ms: 3_600_000,
        };
        let login = entries(&[("path", "/login")]);
        match set
            .match_override("api", &login, over, factory, metrics)
            .await
        {
            Some(OverrideMatch::Applied(m)) => Some(m),
            Some(OverrideMatch::Ignored(_)) => None,
            None => panic!("api is a configured domain"),
        }
    }

    #[tokio::test]
    async fn a_new_override_takes_the_place_of_one_that_holds_nothing() {
        let factory: Arc<dyn StoreFactory> = Arc::new(memory_factory());
        let metrics = Metrics::default();
        let set = built(TREE, factory.as_ref(), None, &metrics).await;
        let find = |limit| login_override(&set, limit, &factory, &metrics);
        let spend = |m: Matched| async move { m.rule.limiter.check(m.key, 1).await.unwrap() };
        let held = |limit: u64| {
            set.overrides
                .entries
                .lock()
                .values()
                .any(|e| e.spec.policy.limit == limit)
        };
        // The bound's worth of overrides, none holding a count yet.
        for limit in 1..=MAX_OVERRIDES as u64 {
            find(limit).await.unwrap();
        }
        // None has been idle for OVERRIDE_MIN_IDLE_MS: a new one is ignored
        // rather than close a connection that was just made.
        assert!(find(1000).await.is_none());
        set.overrides
            .min_idle_ms
            .store(0, std::sync::atomic::Ordering::Relaxed);
        // Override 1 is used again and counts a request; override 2 is
        // now the least recently used.
        assert!(spend(find(1).await.unwrap()).await.allowed);
        // A new one takes override 2's place, not 1's (which holds a
        // count) nor 256's (used after 2): 1's count is kept.
        let newcomer = find(1000).await.unwrap();
        assert!(!held(2) && held(256) && held(1));
        assert!(!spend(find(1).await.unwrap()).await.allowed);
        assert!(spend(newcomer).await.allowed);
        assert_eq!(set.overrides.entries.lock().len(), MAX_OVERRIDES);
        // An override held by a request in flight is not dropped either.
        let in_flight = find(3).await.unwrap();
        for limit in 4..=MAX_OVERRIDES as u64 {
            spend(find(limit).await.unwrap()).await;
        }
        // Every override now holds a count or is in use: past the bound,
        // a new one is ignored.
        assert!(find(2).await.is_none());
        drop(in_flight);
        // Override 3, idle and empty, makes room.
        assert!(find(2).await.is_some());
    }

    /// A reload keeps its overrides with their last uses: the new set
    /// reads them on the old set's clock, so an override idle before the
    /// reload can still make room after it.
    #[tokio::test]
    async fn a_reload_keeps_how_long_its_overrides_were_idle() {
        let factory: Arc<dyn StoreFactory> = Arc::new(memory_factory());
        let metrics = Metrics::default();
        let first = built(TREE, factory.as_ref(), None, &metrics).await;
        first
            .overrides
            .min_idle_ms
            .store(50, std::sync::atomic::Ordering::Relaxed);
        for limit in 1..=MAX_OVERRIDES as u64 {
            assert!(login_override(&first, limit, &factory, &metrics)
                .await
                .is_some());
        }
        tokio::time::sleep(std::time::Duration::from_millis(60)).await;
        let second = built(TREE, factory.as_ref(), Some(&first), &metrics).await;
        drop(first);
        assert_eq!(second.overrides.entries.lock().len(), MAX_OVERRIDES);
        assert!(login_override(&second, 1000, &factory, &metrics)
            .await
            .is_some());
    }

    /// Makes the limiters of the configured rules, but none for an
    /// override: a Redis that went away after the start.
    struct OverridesUnavailable(MemoryFactory);

    impl StoreFactory for OverridesUnavailable {
        fn describe(&self) -> String {
            "memory, no overrides".to_owned()
        }

        fn build<'a>(
            &'a self,
            rule_id: &'a str,
            config: &'a PolicyConfig,
        ) -> BoxFuture<'a, anyhow::Result<crate::store::BuiltLimiter>> {
            if rule_id.contains("override") {
                Box::pin(async { Err(anyhow::anyhow!("connection refused")) })
            } else {
                self.0.build(rule_id, config)
            }
        }
    }

    /// While an override's limiter cannot be made, the `local` failure
    /// policy's twin counts; a request deciding on it holds the entry, so
    /// a new override cannot take its place and lose the count.
    #[tokio::test]
    async fn an_override_deciding_on_its_twin_keeps_its_place() {
        let factory: Arc<dyn StoreFactory> = Arc::new(OverridesUnavailable(memory_factory()));
        let metrics = Metrics::default();
        let text = format!("[server]\nfailure_policy = \"local\"\n{TREE}");
        let set = built(&text, factory.as_ref(), None, &metrics).await;
        set.overrides
            .min_idle_ms
            .store(0, std::sync::atomic::Ordering::Relaxed);
        let find = |limit| login_override(&set, limit, &factory, &metrics);
        let twin_decides = |m: Matched| {
            let twin = m.rule.failover.clone().expect("the local policy's twin");
            twin.check_now(m.key, 1).unwrap().allowed
        };
        // The request for override 1 has its rule, and has not decided yet.
        let first = find(1).await.unwrap();
        for limit in 2..=MAX_OVERRIDES as u64 {
            find(limit).await.unwrap();
        }
        assert_eq!(set.unmade_override_failovers().len(), MAX_OVERRIDES);
        // Override 1 is the least recently used, but in use: 2 makes room.
        find(1000).await.unwrap();
        assert!(twin_decides(first));
        // Override 1 kept its place, and its count: limit 1 is spent.
        assert!(!twin_decides(find(1).await.unwrap()));
    }

    #[test]
    fn the_reference_covers_every_domain() {
        let s = build(Config::reference(), None, &Metrics::default());
        assert!(s.knows_domain("anything"));
        let m = s
            .match_descriptor("anything", &entries(&[("a", "b")]))
            .unwrap();
        assert_eq!(m.rule.spec.name, "fallback");
        let a = s
            .match_descriptor("d1", &entries(&[("a", "b")]))
            .unwrap()
            .key;
        let b = s
            .match_descriptor("d2", &entries(&[("a", "b")]))
            .unwrap()
            .key;
        assert_ne!(a, b);
        assert_eq!(
            s.match_key("user:1", KeyHash::Mix32)
                .unwrap()
                .rule
                .spec
                .name,
            "keys"
        );
    }

    /// A descriptor reaching an `unlimited = true` node is known as such
    /// (a gRPC answer then reports no limit); one reaching a rule, or
    /// nothing, or in a domain not configured, is not.
    #[test]
    fn only_descriptors_reaching_an_unlimited_node_are_unlimited() {
        let text =
            format!("{TREE}\n[[domains.descriptors]]\nkey = \"internal\"\nunlimited = true\n");
        let s = set(&text);
        let unlimited = |domain: &str, e: &[(&str, &str)]| s.is_unlimited(domain, &entries(e));
        assert!(unlimited("api", &[("internal", "x")]));
        assert!(!unlimited("api", &[("path", "/login")]));
        assert!(!unlimited("api", &[("unknown", "x")]));
        assert!(!unlimited("web", &[("internal", "x")]));
    }

    /// Keeps the `rules` field of every warning logged on this thread.
    struct WarningsSeen(Arc<parking_lot::Mutex<Vec<String>>>);

    impl tracing::Subscriber for WarningsSeen {
        fn register_callsite(
            &self,
            _: &'static tracing::Metadata<'static>,
        ) -> tracing::subscriber::Interest {
            tracing::subscriber::Interest::sometimes()
        }

        fn enabled(&self, metadata: &tracing::Metadata<'_>) -> bool {
            *metadata.level() == tracing::Level::WARN
        }

        fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
            tracing::span::Id::from_u64(1)
        }

        fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}

        fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}

        fn event(&self, event: &tracing::Event<'_>) {
            struct Rules(String);
            impl tracing::field::Visit for Rules {
                fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn fmt::Debug) {
                    if field.name() == "rules" {
                        self.0 = format!("{value:?}");
                    }
                }
            }
            let mut rules = Rules(String::new());
            event.record(&mut rules);
            self.0.lock().push(rules.0);
        }

        fn enter(&self, _: &tracing::span::Id) {}

        fn exit(&self, _: &tracing::span::Id) {}
    }

    /// `serve` warns of the rules that admit nothing, by name, at start and
    /// at each reload; a configuration without one warns of nothing.
    #[test]
    fn closed_rules_are_warned_of_by_name_and_only_they() {
        let warnings = |s: &RuleSet| {
            let seen = Arc::new(parking_lot::Mutex::new(Vec::new()));
            tracing::subscriber::with_default(WarningsSeen(Arc::clone(&seen)), || {
                s.warn_of_closed_rules()
            });
            let seen = seen.lock().clone();
            seen
        };
        let closed = set("[fallback]\nlimit = 0\nwindow_ms = 1000\n");
        assert_eq!(warnings(&closed), ["fallback"]);
        assert!(warnings(&set(TREE)).is_empty());
    }

    #[test]
    fn debug_shows_each_rule_and_how_many_overrides_a_set_holds() {
        let s = set(TREE);
        let rule = &s.rules()[0];
        assert_eq!(
            format!("{rule:?}"),
            format!("Rule {{ id: {:?}, spec: {:?} }}", rule.id, rule.spec)
        );
        let text = format!("{s:?}");
        assert!(
            text.contains("overrides: Overrides { entries: 0 }"),
            "{text}"
        );
    }

    /// An override whose limiter cannot be made still has the override's
    /// own policy as its limiter's configuration, not a default one.
    #[tokio::test]
    async fn an_override_whose_limiter_cannot_be_made_keeps_its_policy() {
        let factory: Arc<dyn StoreFactory> = Arc::new(OverridesUnavailable(memory_factory()));
        let metrics = Metrics::default();
        let set = built(TREE, factory.as_ref(), None, &metrics).await;
        let m = login_override(&set, 3, &factory, &metrics).await.unwrap();
        let config = *m.rule.limiter.config();
        assert_eq!((config.limit, config.window_ms), (3, 3_600_000));
        assert!(m.rule.limiter.check(m.key, 1).await.is_err());
    }

    /// A store that takes 300 ms to make each limiter.
    struct SlowToMake(MemoryFactory);

    impl StoreFactory for SlowToMake {
        fn describe(&self) -> String {
            "slow to make".to_owned()
        }

        fn build<'a>(
            &'a self,
            rule_id: &'a str,
            config: &'a PolicyConfig,
        ) -> BoxFuture<'a, anyhow::Result<crate::store::BuiltLimiter>> {
            Box::pin(async move {
                tokio::time::sleep(std::time::Duration::from_millis(300)).await;
                self.0.build(rule_id, config).await
            })
        }
    }

    /// A request waits for an override's limiter at most one store
    /// timeout, and the failure policy answers it as a timeout; the making
    /// goes on, so that a store slower to make a limiter than to answer a
    /// call still gets the override made for a later request.
    #[tokio::test]
    async fn an_override_slow_to_make_is_made_for_a_later_request() {
        let factory: Arc<dyn StoreFactory> = Arc::new(SlowToMake(memory_factory()));
        let metrics = Metrics::default();
        let text = format!("[server]\nstore_timeout_ms = 100\n{TREE}");
        let set = built(&text, factory.as_ref(), None, &metrics).await;
        let first = login_override(&set, 3, &factory, &metrics).await.unwrap();
        let e = first.rule.limiter.check(first.key, 1).await.unwrap_err();
        assert_eq!(e.kind(), StoreErrorKind::Timeout, "{e}");
        // Made about 300 ms in (a busy machine may take longer): later
        // requests find it, rather than each starting a making cut short.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let d = loop {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            let later = login_override(&set, 3, &factory, &metrics).await.unwrap();
            if let Ok(d) = later.rule.limiter.check(later.key, 1).await {
                break d;
            }
            assert!(std::time::Instant::now() < deadline, "never made");
        };
        assert_eq!((d.allowed, d.remaining), (true, 2));
    }

    /// A store in another process, as the rules see it: its limiters have
    /// no in-memory store behind them.
    struct Networked(MemoryFactory);

    impl StoreFactory for Networked {
        fn describe(&self) -> String {
            "networked".to_owned()
        }

        fn build<'a>(
            &'a self,
            rule_id: &'a str,
            config: &'a PolicyConfig,
        ) -> BoxFuture<'a, anyhow::Result<crate::store::BuiltLimiter>> {
            Box::pin(async move {
                let built = self.0.build(rule_id, config).await?;
                Ok(crate::store::BuiltLimiter {
                    limiter: built.limiter,
                    local: None,
                })
            })
        }
    }

    /// An override on a networked store gets the in-memory twin that the
    /// `local` failure policy decides on while the store is away, as a
    /// configured rule does, and none under another failure policy.
    #[tokio::test]
    async fn an_override_on_a_networked_store_has_a_twin_only_under_the_local_policy() {
        let factory: Arc<dyn StoreFactory> = Arc::new(Networked(memory_factory()));
        let metrics = Metrics::default();
        for (policy, twin) in [("local", true), ("closed", false)] {
            let text = format!("[server]\nfailure_policy = \"{policy}\"\n{TREE}");
            let set = built(&text, factory.as_ref(), None, &metrics).await;
            let m = login_override(&set, 1, &factory, &metrics).await.unwrap();
            assert!(m.rule.local.is_none());
            assert_eq!(m.rule.failover.is_some(), twin, "{policy}");
        }
    }

    /// Housekeeping and metrics reach every override whose limiter is made.
    #[tokio::test]
    async fn the_rules_of_made_overrides_are_listed() {
        let factory: Arc<dyn StoreFactory> = Arc::new(memory_factory());
        let metrics = Metrics::default();
        let set = built(TREE, factory.as_ref(), None, &metrics).await;
        assert!(set.override_rules().is_empty());
        for limit in [1, 2] {
            login_override(&set, limit, &factory, &metrics)
                .await
                .unwrap();
        }
        let mut limits: Vec<_> = set
            .override_rules()
            .iter()
            .map(|r| (r.spec.name.clone(), r.spec.policy.limit))
            .collect();
        limits.sort();
        let name = "api.path_/login.override".to_owned();
        assert_eq!(limits, [(name.clone(), 1), (name, 2)]);
    }

    /// An override of the fallback counts apart per domain and per entry
    /// key, as the fallback itself does: no path through a tree fixes them.
    #[tokio::test]
    async fn an_override_of_the_fallback_counts_apart_per_domain_and_entry_key() {
        let factory: Arc<dyn StoreFactory> = Arc::new(memory_factory());
        let metrics = Metrics::default();
        let text = "[fallback]\nlimit = 1\nwindow_ms = 1000\n";
        let set = built(text, factory.as_ref(), None, &metrics).await;
        let over = LimitOverride {
            limit: 1,
            window_ms: 3_600_000,
        };
        let mut keys = Vec::new();
        for (domain, e) in [
            ("d1", [("k", "v")]),
            ("d2", [("k", "v")]),
            ("d1", [("j", "v")]),
        ] {
            match set
                .match_override(domain, &entries(&e), over, &factory, &metrics)
                .await
            {
                Some(OverrideMatch::Applied(m)) => {
                    assert_eq!(m.rule.spec.name, "fallback.override");
                    keys.push(m.key);
                }
                other => panic!("{other:?}"),
            }
        }
        assert_ne!(keys[0], keys[1]);
        assert_ne!(keys[0], keys[2]);
    }

    /// An override made for the reference policy (a descriptor no rule
    /// matches, no fallback) is not kept by a reload that adds a fallback:
    /// the same descriptor's override now stands in for the fallback, so
    /// the old one would never be used again.
    #[tokio::test]
    async fn a_reload_adding_a_fallback_drops_the_overrides_of_the_reference() {
        let factory: Arc<dyn StoreFactory> = Arc::new(memory_factory());
        let metrics = Metrics::default();
        let first = built(TREE, factory.as_ref(), None, &metrics).await;
        let over = LimitOverride {
            limit: 1,
            window_ms: 3_600_000,
        };
        let none = entries(&[("nothing", "x")]);
        let made = first
            .match_override("api", &none, over, &factory, &metrics)
            .await;
        assert!(matches!(made, Some(OverrideMatch::Applied(_))), "{made:?}");
        let text = format!("[fallback]\nlimit = 1\nwindow_ms = 1000\n{TREE}");
        let second = built(&text, factory.as_ref(), Some(&first), &metrics).await;
        assert_eq!(second.overrides.entries.lock().len(), 0);
    }

    /// Two domains configuring the same descriptor have two rules, each
    /// with its own limiter and counts.
    #[test]
    fn the_same_descriptor_in_two_domains_keeps_two_counts() {
        let domain = |name: &str| {
            format!(
                "[[domains]]\ndomain = \"{name}\"\n\
                 [[domains.descriptors]]\nkey = \"k\"\nlimit = 1\nwindow_ms = 1000\n"
            )
        };
        let s = set(&format!("{}{}", domain("a"), domain("b")));
        let m = |d: &str| s.match_descriptor(d, &entries(&[("k", "v")])).unwrap();
        let (a, b) = (m("a"), m("b"));
        assert_ne!(a.rule.id, b.rule.id);
        assert!(!Arc::ptr_eq(&a.rule.limiter, &b.rule.limiter));
        assert_ne!(a.key, b.key);
    }

    /// A value without a trailing `*` matches that value only: neither a
    /// longer value nor one differing in its last character.
    #[test]
    fn an_exact_value_matches_only_itself() {
        let s = set(TREE);
        let name = |v: &str| {
            s.match_descriptor("api", &entries(&[("path", v)]))
                .map(|m| m.rule.spec.name.clone())
        };
        assert_eq!(name("/login").as_deref(), Some("api.path_/login"));
        for other in ["/logiX", "/login/x", "/logi"] {
            assert_eq!(name(other).as_deref(), Some("api.path"), "{other}");
        }
    }
}
