//! The decisions behind both interfaces: matching, the store call with its
//! timeout and failure policy, several descriptors in one request, reloads
//! and housekeeping.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use ratewarden_core::{
    Clock, Decision, FailurePolicy, Housekeeping, LocalLimiter, LogGate, MonotonicClock,
    StoreError, StoreErrorKind, MAX_SAFE,
};

use crate::config::{ConfigSource, ServeFailurePolicy, ServerSettings};
use crate::metrics::{Metrics, Outcome};
use crate::rules::{LimitOverride, MatchError, Matched, Rule, RuleSet};
use crate::store::StoreFactory;

/// The most descriptors one request may carry.
pub const MAX_DESCRIPTORS: usize = 64;

/// How long a reload waits for the configuration file's read. A read that
/// blocks (a pipe no one writes to, a hung network mount) cannot be
/// stopped, but the reload can stop waiting for it: it fails, and a later
/// SIGHUP (once the reloads before it have each given up, one at a time)
/// reads the file afresh, rather than every later reload waiting for ever
/// behind the first. A start, `serve --check` and `ratewarden key` wait as
/// long.
pub const RELOAD_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// The most reads of the configuration file left blocked: past it, a
/// reload starts no other (each holds a thread, of a pool the store's
/// connections need too) and says to restart.
const MAX_BLOCKED_READS: usize = 4;

/// The most entries one descriptor may carry.
pub const MAX_ENTRIES: usize = 32;

/// One descriptor of a request, as both interfaces deliver it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DescriptorRequest {
    /// The entries, in order.
    pub entries: Vec<(String, String)>,
    /// What the descriptor costs. Above 2^53 - 1 (more than any limit) it
    /// never fits: the descriptor is refused with no wait.
    pub cost: u64,
    /// The descriptor's own limit, replacing the configured rule's (see
    /// [`RuleSet::match_override`]).
    pub limit: Option<LimitOverride>,
}

/// What one descriptor got.
#[derive(Debug, Clone)]
pub struct DescriptorOutcome {
    /// The rule it matched, if any; `None` is unlimited.
    pub rule: Option<Arc<Rule>>,
    /// The decision by the rule's policy (for a shadow rule, what it would
    /// have been); admitted with nothing known when no rule matched.
    pub decision: Decision,
    /// Whether the descriptor lets the request through: the decision,
    /// except that shadow rules and unmatched descriptors always do.
    pub allowed: bool,
    /// When the store failed and the failure policy decided, the kind of
    /// the failure (`capacity_exhausted` for a full in-memory store).
    pub failure: Option<StoreErrorKind>,
    /// Whether the descriptor reached an `unlimited = true` node: matched,
    /// and never limited (`rule` is then `None`).
    pub unlimited: bool,
    /// Whether the store failed under `failure_policy = "error"`: nothing
    /// was decided (the decision stands in as a refusal, so that the
    /// request's other descriptors consume nothing), and unless another
    /// descriptor refuses the request, it fails. A shadow rule's fails no
    /// request, as its refusals refuse none.
    pub unanswered: bool,
}

impl DescriptorOutcome {
    /// Whether the store failed and the failure policy decided.
    pub fn by_failure_policy(&self) -> bool {
        self.failure.is_some()
    }
}

/// Why a request is left unanswered, as a message for its client: the
/// first of its enforcing descriptors whose store failed under
/// `failure_policy = "error"` (named by its index among `descriptors`,
/// else the request is a key's). `None` when every descriptor was
/// answered, or when one refuses the request, which is then refused
/// whatever the others would have said.
pub fn unanswered(outcomes: &[DescriptorOutcome], descriptors: bool) -> Option<String> {
    if outcomes.iter().any(|o| !o.allowed && !o.unanswered) {
        return None;
    }
    let (i, o) = outcomes
        .iter()
        .enumerate()
        .find(|(_, o)| o.unanswered && o.rule.as_ref().is_some_and(|r| !r.spec.shadow))?;
    let rule = o.rule.as_ref().map_or("", |r| r.spec.name.as_str());
    let kind = o.failure.map_or("unknown", StoreErrorKind::name);
    let what = if descriptors {
        format!("descriptor {i}")
    } else {
        "the key".to_owned()
    };
    Some(format!(
        "the store failed ({kind}) deciding {what} (rule {rule:?}), and \
         failure_policy = \"error\" leaves the decision to the caller"
    ))
}

/// A request that cannot be decided, with what to change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadRequest(pub String);

impl std::fmt::Display for BadRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<MatchError> for BadRequest {
    fn from(e: MatchError) -> Self {
        BadRequest(e.to_string())
    }
}

/// The shared state of a running server.
pub struct Service {
    rules: ArcSwap<RuleSet>,
    settings: ServerSettings,
    source: ConfigSource,
    factory: Arc<dyn StoreFactory>,
    /// The metrics of every rule and interface.
    pub metrics: Arc<Metrics>,
    reload_lock: tokio::sync::Mutex<()>,
    /// Reads of the configuration file under way, those a reload stopped
    /// waiting for included (see [`RELOAD_READ_TIMEOUT`]).
    reads_under_way: Arc<std::sync::atomic::AtomicUsize>,
    /// The gates' and the failure timestamps' clock.
    clock: MonotonicClock,
    /// One line a second for each warning repeated on every request.
    error_log: LogGate,
    /// Whether a store failure was logged and no call has succeeded since:
    /// the next success says so, so that the log shows the end of an
    /// outage as well as its start.
    failure_logged: AtomicBool,
    /// When the last store call failed (`now_ms`): the success announced
    /// must come a second after it, or a key that keeps failing beside
    /// others that succeed would flip the log every second.
    last_failure_ms: std::sync::atomic::AtomicU64,
    domain_log: LogGate,
    override_log: LogGate,
}

impl std::fmt::Debug for Service {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Service")
            .field("settings", &self.settings)
            .field("store", &self.factory.describe())
            .finish()
    }
}

impl Service {
    /// Builds the service from an already loaded configuration; `source`
    /// is where reloads read from.
    pub async fn with_config(
        config: crate::config::Config,
        source: ConfigSource,
        factory: Arc<dyn StoreFactory>,
    ) -> anyhow::Result<Self> {
        let metrics = Arc::new(Metrics::default());
        let settings = config.server.clone();
        let rules = RuleSet::build(config, factory.as_ref(), None, &metrics).await?;
        rules.warn_of_closed_rules();
        Ok(Service {
            rules: ArcSwap::from_pointee(rules),
            settings,
            source,
            factory,
            metrics,
            reload_lock: tokio::sync::Mutex::new(()),
            reads_under_way: Arc::default(),
            clock: MonotonicClock::new(),
            error_log: LogGate::new(1000),
            failure_logged: AtomicBool::new(false),
            last_failure_ms: Default::default(),
            domain_log: LogGate::new(1000),
            override_log: LogGate::new(1000),
        })
    }

    /// Whether the store answers now (see [`StoreFactory::probe`]): what
    /// `GET /readyz` reports.
    pub async fn probe_store(&self) -> anyhow::Result<()> {
        self.factory.probe().await
    }

    /// The settings the server started with.
    pub fn settings(&self) -> &ServerSettings {
        &self.settings
    }

    /// The rules in force now.
    pub fn rules(&self) -> Arc<RuleSet> {
        self.rules.load_full()
    }

    /// The store's description, for logs.
    pub fn store_description(&self) -> String {
        self.factory.describe()
    }

    /// Reads the configuration again and swaps it in. Requests in flight
    /// finish on the rules they started with; rules whose identity and
    /// policy are unchanged keep their limiters, and so their counts. On an
    /// error the rules in force stay, and the error is returned.
    pub async fn reload(&self) -> Result<(), String> {
        self.reload_within(RELOAD_READ_TIMEOUT).await
    }

    /// [`Service::reload`], waiting for the file's read at most
    /// `read_timeout`.
    async fn reload_within(&self, read_timeout: Duration) -> Result<(), String> {
        let _one_at_a_time = self.reload_lock.lock().await;
        let result = async {
            let mut config = self.read_config(read_timeout).await?;
            if config.server != self.settings {
                // The running server keeps its settings (limiters are built
                // with them too); the file's apply at the next start.
                let changed = self.settings.changed(&config.server).join(", ");
                config.server = self.settings.clone();
                tracing::warn!(
                    "the [server] or [redis] settings changed ({changed}); they take effect at \
                     the next start, not on reload"
                );
            }
            let current = self.rules.load_full();
            let rules =
                RuleSet::build(config, self.factory.as_ref(), Some(&current), &self.metrics)
                    .await
                    .map_err(|e| format!("{e:#}"))?;
            let count = rules.rules().len();
            rules.warn_of_closed_rules();
            self.rules.store(Arc::new(rules));
            // Keys the replaced stores forgot for new ones are counted
            // at housekeeping: count them now, before those stores go
            // (taken from the kept ones too, which is only earlier; a
            // request in flight on the replaced rules may still forget
            // some after this, uncounted).
            let pending: usize = memory_stores(&current)
                .iter()
                .map(|local| local.store().take_forgotten_for_new_keys())
                .sum();
            self.metrics.forgotten(0, pending);
            // The rules the reload replaced, unless requests in flight
            // still hold them, leave /metrics now (and those still held,
            // at the next scrape or reload).
            drop(current);
            self.metrics.forget_dead_rules();
            Ok::<_, String>(count)
        }
        .await;
        self.metrics.reload(result.is_ok());
        match result {
            Ok(count) => {
                tracing::info!(rules = count, "configuration reloaded");
                Ok(())
            }
            Err(e) => {
                tracing::error!(
                    "configuration reload failed, keeping the previous configuration: {e}"
                );
                Err(e)
            }
        }
    }

    /// The configuration file, read on a thread of its own, waited for at
    /// most `timeout`.
    async fn read_config(&self, timeout: Duration) -> Result<crate::config::Config, String> {
        use std::sync::atomic::AtomicUsize;
        let file = self.source.path.as_ref().map_or_else(
            || "the configuration".to_owned(),
            |p| p.display().to_string(),
        );
        let under_way = self.reads_under_way.load(Ordering::Relaxed);
        if under_way >= MAX_BLOCKED_READS {
            return Err(format!(
                "{under_way} earlier reads of {file} are still blocked, each holding a thread, so \
                 this reload starts no other; restart serve once the file reads again"
            ));
        }
        /// Counts a read from its start to its end, however it ends.
        struct UnderWay(Arc<AtomicUsize>);
        impl Drop for UnderWay {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::Relaxed);
            }
        }
        self.reads_under_way.fetch_add(1, Ordering::Relaxed);
        let counted = UnderWay(Arc::clone(&self.reads_under_way));
        let source = self.source.clone();
        let read = tokio::task::spawn_blocking(move || {
            let _counted = counted;
            source.load()
        });
        match tokio::time::timeout(timeout, read).await {
            Ok(Ok(loaded)) => loaded.map_err(|e| e.to_string()),
            Ok(Err(e)) => Err(format!("reading {file} failed: {e}")),
            Err(_) => Err(format!(
                "reading {file} did not finish within {} ms (a pipe no one writes to, or a hung \
                 network mount?); the next SIGHUP reads it afresh",
                timeout.as_millis()
            )),
        }
    }

    /// Forgets idle keys of every in-memory store, at most
    /// `housekeeping_max_scanned` keys looked at per rule, and counts them
    /// with those that full stores forgot on their own since the last pass.
    pub fn housekeeping(&self) -> Housekeeping {
        let mut done = Housekeeping::default();
        for local in &memory_stores(&self.rules.load_full()) {
            let now_ms = local.clock().now_ms();
            let pass = local
                .store()
                .forget_idle(now_ms, self.settings.housekeeping_max_scanned);
            done.scanned += pass.scanned;
            done.forgotten += pass.forgotten;
            done.forgotten_for_new_keys += pass.forgotten_for_new_keys;
        }
        self.metrics
            .forgotten(done.forgotten, done.forgotten_for_new_keys);
        done
    }

    /// Keys held per rule in memory, for `/metrics`; the overrides of one
    /// rule share its name (suffixed `.override`), and their keys are
    /// summed under it.
    pub fn keys_tracked(&self) -> Vec<(String, usize)> {
        let rules = self.rules.load();
        let mut out: Vec<(String, usize)> = rules
            .rules()
            .iter()
            .filter_map(|r| {
                // A networked store's keys are not here; under the `local`
                // failure policy its in-memory twin's are.
                r.local
                    .as_ref()
                    .or(r.failover.as_ref())
                    .map(|l| (r.spec.name.clone(), l.store().entries_tracked()))
            })
            .collect();
        let mut overrides: std::collections::BTreeMap<String, usize> = Default::default();
        for r in rules.override_rules() {
            if let Some(l) = r.local.as_ref().or(r.failover.as_ref()) {
                *overrides.entry(r.spec.name.clone()).or_default() += l.store().entries_tracked();
            }
        }
        out.extend(overrides);
        out
    }

    /// Decides a `key` request.
    pub async fn check_key(&self, key: &str, cost: u64) -> Result<DescriptorOutcome, BadRequest> {
        check_cost(cost)?;
        let rules = self.rules.load_full();
        let matched = rules.match_key(key, self.settings.key_hash)?;
        let decision = self.take(&matched, cost).await;
        Ok(self.finish(Some(matched.rule), decision, true))
    }

    /// Decides a request of several descriptors in `domain`.
    ///
    /// Descriptors that reach the same count (one rule, one key) are decided
    /// once, at their summed cost, and each gets that decision. With more
    /// than one enforcing (matched, not shadow) descriptor, every
    /// one is first checked at cost 0, which records nothing. If any would
    /// refuse, only those are decided for real (a refusal changes no count)
    /// and the others consume nothing; one whose check the store fails is
    /// answered by the failure policy, with no take (under `local`, its
    /// twin is checked first too). Otherwise each is taken in turn until
    /// one refuses. A concurrent request on the same keys between the check
    /// and the take (or a store failing the take) can still make a later
    /// descriptor refuse after earlier ones took their cost, and a refusal
    /// decided for real can admit after all when its window rolled over
    /// since its check; a refused request that consumed is counted in
    /// `ratewarden_partial_consumptions_total`.
    pub async fn check_descriptors(
        &self,
        domain: &str,
        descriptors: &[DescriptorRequest],
    ) -> Result<Vec<DescriptorOutcome>, BadRequest> {
        check_descriptor_request(domain, descriptors)?;
        let rules = self.rules.load_full();
        if !rules.knows_domain(domain) {
            // As envoyproxy/ratelimit answers it: no limit for any
            // descriptor. An error would make Envoy with failure_mode_deny
            // refuse all traffic over a typo in its domain; the warning and
            // the counter make the typo visible instead.
            self.metrics.unknown_domain();
            if self.log_now(&self.domain_log) {
                let shown: String = domain.chars().take(100).collect();
                tracing::warn!(
                    domain = %shown.escape_debug(),
                    "a request named a domain the configuration has no [[domains]] entry for \
                     (and there is no [fallback]): every descriptor is unlimited"
                );
            }
            return Ok(descriptors
                .iter()
                .map(|_| self.finish(None, (Decision::admitted(0), None), false))
                .collect());
        }
        // Descriptors of one request that reach the same count (one rule,
        // one key) are one decision at their summed cost: Envoy sends such
        // duplicates when, say, route and virtual host both rate-limit on
        // remote_address. Checked one by one, each would fit the budget and
        // the second take would refuse after the first consumed.
        let mut matches = Vec::with_capacity(descriptors.len());
        for d in descriptors {
            let (m, ignored) = rules
                .match_with_limit(
                    domain,
                    &d.entries,
                    d.limit,
                    self.settings.limit_overrides,
                    &self.factory,
                    &self.metrics,
                )
                .await;
            if let Some(why) = ignored {
                self.limit_override_ignored(why);
            }
            matches.push(m);
        }
        // An override has a rule of its own, so it is a group of its own.
        let mut groups: Vec<(Matched, u64)> = Vec::new();
        let mut group_of: Vec<Option<usize>> = Vec::with_capacity(descriptors.len());
        {
            // By the rule's identity, not its address: an override whose
            // limiter could not be made is a new `Rule` at every match.
            let mut index: HashMap<(String, u64), usize> = HashMap::new();
            for (d, m) in descriptors.iter().zip(matches) {
                let Some(m) = m else {
                    group_of.push(None);
                    continue;
                };
                let g = *index.entry((m.rule.id.clone(), m.key)).or_insert_with(|| {
                    groups.push((m.clone(), 0));
                    groups.len() - 1
                });
                groups[g].1 = groups[g].1.saturating_add(d.cost);
                group_of.push(Some(g));
            }
        }
        let enforcing: Vec<usize> = (0..groups.len())
            .filter(|&g| !groups[g].0.rule.spec.shadow)
            .collect();

        let mut decided: Vec<Option<(Decision, Option<StoreErrorKind>)>> = vec![None; groups.len()];
        // Whether a group's decision is its own (taken, or refused for its
        // cost) rather than a cost-0 check left standing because another
        // descriptor refused the request: only its own is counted in the
        // metrics.
        let mut own = vec![false; groups.len()];
        for (g, (m, cost)) in groups.iter().enumerate() {
            // No limit exceeds 2^53 - 1, so a larger cost never fits: it is
            // refused with no wait, as a cost above the limit is, without
            // asking the store to take it (it takes no such cost). An error
            // instead would void every other descriptor's limit in the
            // request. What is left comes from a cost-0 check, as for any
            // refusal; a store that fails it is counted and logged as any
            // failure is, and the refusal stands (with 0 left).
            if *cost > MAX_SAFE {
                let refused = match self.call(m, 0).await {
                    Ok(d) => Decision::refused(None, d.remaining),
                    Err(e) => self.answer_failure(m, &e, *cost).0,
                };
                decided[g] = Some((refused, None));
                own[g] = true;
            }
        }
        // Shadow descriptors are always taken, whatever the others decide,
        // and they decide nothing of the request: taken all at once,
        // alongside the enforcing descriptors' checks and takes, so that a
        // store that does not answer costs them one timeout in all, not
        // one each after the request's own.
        let shadows: Vec<usize> = (0..groups.len())
            .filter(|&g| groups[g].0.rule.spec.shadow && decided[g].is_none())
            .collect();
        let groups_ref = &groups;
        let shadow_takes = futures_util::future::join_all(
            shadows
                .iter()
                .map(|&g| async move { (g, self.take(&groups_ref[g].0, groups_ref[g].1).await) }),
        );
        let enforce = async {
            // The cost-0 checks that found room, which stand for their
            // descriptors when another refuses the request.
            let mut peeks: Vec<Option<Decision>> = vec![None; groups.len()];
            if enforcing.len() > 1 {
                let mut blocked = Vec::new();
                // The checks the store did not answer, by group.
                let mut unchecked: Vec<Option<StoreError>> = vec![None; groups.len()];
                // All at once: they record nothing, so their order does not
                // matter, and a request waits for its slowest check rather
                // than for the sum of them (one timeout, not one per
                // descriptor, when the store does not answer).
                let checks = futures_util::future::join_all(
                    enforcing
                        .iter()
                        .filter(|&&g| decided[g].is_none())
                        .map(|&g| async move { (g, self.call(&groups_ref[g].0, 0).await) }),
                )
                .await;
                let mut checked: Vec<Option<Result<Decision, StoreError>>> =
                    (0..groups.len()).map(|_| None).collect();
                for (g, check) in checks {
                    checked[g] = Some(check);
                }
                for &g in &enforcing {
                    let Some(check) = checked[g].take() else {
                        blocked.push(g);
                        continue;
                    };
                    let (m, cost) = &groups[g];
                    // A peek of a key the embedded store does not hold is
                    // answered even when the key's shard is full, where the
                    // take would fail for want of room: decided for real
                    // first (below), so that the failure comes before any
                    // other descriptor is charged.
                    let no_room = *cost > 0
                        && m.rule
                            .local
                            .as_ref()
                            .is_some_and(|l| !l.store().has_room_for(m.key));
                    match check {
                        Ok(d) if d.allowed && d.remaining >= *cost && !no_room => {
                            peeks[g] = Some(d)
                        }
                        // A refusal is decided for real below, and a failing
                        // store by the failure policy.
                        Ok(_) => blocked.push(g),
                        Err(e) => {
                            unchecked[g] = Some(e);
                            blocked.push(g);
                        }
                    }
                }
                // First the refusals the checks found, decided for real (a
                // refusal changes no count).
                for &g in &blocked {
                    if decided[g].is_none() && unchecked[g].is_none() {
                        let (m, cost) = &groups[g];
                        own[g] = true;
                        decided[g] = Some(self.take(m, *cost).await);
                    }
                }
                // Then the checks the store did not answer. Such a store is
                // sent no take: a frozen or overloaded Redis runs what it was
                // sent when it answers again, and would charge the request
                // whatever it was answered here. The failure policy answers,
                // as for a failed take; once the request is refused, as for a
                // check (no cost on a `local` twin, and no decision of the
                // rule's), so that the refused request consumes nothing.
                let mut refused = blocked
                    .iter()
                    .any(|&g| decided[g].is_some_and(|(d, _)| !d.allowed));
                // Under `local` the failure policy takes from in-memory twins,
                // so those are checked first too: a request that one twin
                // refuses takes nothing from the others. The one that refuses
                // is decided for real (a refusal changes no count).
                let no_room: Vec<bool> = (0..groups.len())
                    .map(|g| {
                        unchecked[g].is_some() && self.twin_would_refuse(&groups[g].0, groups[g].1)
                    })
                    .collect();
                refused |= no_room.contains(&true);
                for &g in &blocked {
                    if let Some(e) = unchecked[g].take() {
                        let (m, cost) = &groups[g];
                        let answer = if refused && !no_room[g] {
                            self.answer_failure(m, &e, 0)
                        } else {
                            own[g] = true;
                            self.answer_failure(m, &e, *cost)
                        };
                        refused |= !answer.0.allowed;
                        decided[g] = Some(answer);
                    }
                }
                if blocked
                    .iter()
                    .any(|&g| decided[g].is_some_and(|(d, _)| !d.allowed))
                {
                    for &g in &enforcing {
                        if decided[g].is_none() {
                            decided[g] = peeks[g].map(|d| (d, None));
                        }
                    }
                }
            }
            let mut refused = enforcing
                .iter()
                .any(|&g| decided[g].is_some_and(|(d, _)| !d.allowed));
            // Whether a decision took its cost from a count: the store's, or
            // under `local` a twin's (`open` admits taking nothing).
            let local =
                self.settings.failure_policy == ServeFailurePolicy::Decide(FailurePolicy::Local);
            let took = |cost: u64, (d, failed): (Decision, Option<StoreErrorKind>)| {
                cost > 0 && d.allowed && (failed.is_none() || local)
            };
            let mut consumed = false;
            for (g, (m, cost)) in groups.iter().enumerate() {
                if let Some(decision) = decided[g] {
                    // Decided above for real: a refusal's take can still
                    // admit, when a window rolled over or a bucket refilled
                    // since its check.
                    consumed |= own[g] && !m.rule.spec.shadow && took(*cost, decision);
                    continue;
                }
                let shadow = m.rule.spec.shadow;
                if shadow {
                    // Taken alongside (below).
                    continue;
                }
                // A take of nothing is what its check was: a cost-0 decision
                // at the same time, so the check stands for it (one store call
                // fewer for a request that only reads its counts).
                if *cost == 0 && !refused {
                    if let Some(check) = peeks[g] {
                        decided[g] = Some((check, None));
                        own[g] = true;
                        continue;
                    }
                }
                if refused {
                    // Refused already (checked first, or by a take before this
                    // one, which a concurrent request or a failing store can
                    // make refuse): what is left stands at its check, and
                    // takes nothing.
                    decided[g] = peeks[g].map(|d| (d, None));
                    debug_assert!(decided[g].is_some(), "checked, as one of several");
                    continue;
                }
                let (d, failed) = self.take(m, *cost).await;
                consumed |= took(*cost, (d, failed));
                refused |= !d.allowed;
                decided[g] = Some((d, failed));
                own[g] = true;
            }
            (refused, consumed)
        };
        let (shadow_taken, (refused, consumed)) =
            futures_util::future::join(shadow_takes, enforce).await;
        for (g, taken) in shadow_taken {
            decided[g] = Some(taken);
            own[g] = true;
        }
        if refused && consumed {
            self.metrics.partial_consumption();
        }
        Ok(group_of
            .into_iter()
            .zip(descriptors)
            .map(|(g, d)| match g.and_then(|g| decided[g].map(|d| (g, d))) {
                Some((g, decision)) => {
                    // Counted once per group: one count sent twice is one
                    // decision.
                    let record = std::mem::take(&mut own[g]);
                    self.finish(Some(Arc::clone(&groups[g].0.rule)), decision, record)
                }
                None => DescriptorOutcome {
                    unlimited: g.is_none() && rules.is_unlimited(domain, &d.entries),
                    ..self.finish(None, (Decision::admitted(0), None), false)
                },
            })
            .collect())
    }

    /// The outcome of one descriptor; `record` counts its decision in the
    /// rule's metrics.
    fn finish(
        &self,
        rule: Option<Arc<Rule>>,
        (decision, failure): (Decision, Option<StoreErrorKind>),
        record: bool,
    ) -> DescriptorOutcome {
        let unanswered = failure.is_some_and(|kind| kind != StoreErrorKind::CorruptState)
            && self.settings.failure_policy == ServeFailurePolicy::Error;
        let allowed = match &rule {
            Some(r) => {
                // Left unanswered, it is no decision of the rule's.
                if record && !unanswered {
                    let outcome = match (decision.allowed, r.spec.shadow) {
                        (true, _) => Outcome::Allowed,
                        (false, true) => Outcome::ShadowRefused,
                        (false, false) => Outcome::Refused,
                    };
                    r.metrics.record(outcome);
                }
                decision.allowed || r.spec.shadow
            }
            None => true,
        };
        DescriptorOutcome {
            rule,
            decision,
            allowed,
            failure,
            unlimited: false,
            unanswered,
        }
    }

    /// One store call, bounded by the store timeout.
    async fn call(&self, m: &Matched, cost: u64) -> Result<Decision, StoreError> {
        let timeout = Duration::from_millis(self.settings.store_timeout_ms);
        match tokio::time::timeout(timeout, m.rule.limiter.check(m.key, cost)).await {
            Ok(result) => result,
            Err(_) => Err(StoreError::new(
                StoreErrorKind::Timeout,
                format!(
                    "no answer within store_timeout_ms = {}",
                    self.settings.store_timeout_ms
                ),
            )),
        }
    }

    /// Decides a descriptor for real; a failing store's request goes to the
    /// failure policy. The kind is the failure's, when the failure policy
    /// decided.
    async fn take(&self, m: &Matched, cost: u64) -> (Decision, Option<StoreErrorKind>) {
        match self.call(m, cost).await {
            Ok(d) => {
                // A load first: the rest only after a logged failure.
                if self.failure_logged.load(Ordering::Relaxed)
                    && self
                        .clock
                        .now_ms()
                        .saturating_sub(self.last_failure_ms.load(Ordering::Relaxed))
                        >= 1000
                    && self.failure_logged.swap(false, Ordering::Relaxed)
                {
                    // The failures and this recovery are the store's, for
                    // every rule: the rule named is the one whose call came
                    // first, not one that failed.
                    tracing::info!(
                        first_rule = %crate::one_line(&m.rule.spec.name),
                        failures_not_logged = self.error_log.take_held(),
                        "store calls succeed again, with no failure for a second, after the \
                         failures logged above (first_rule: the rule of the first call that \
                         succeeded)"
                    );
                }
                (d, None)
            }
            Err(e) => self.answer_failure(m, &e, cost),
        }
    }

    /// What the failure policy answers a request of `cost` whose store
    /// failed with `e`; counted and logged. The kind is the failure's, when
    /// the failure policy decided.
    fn answer_failure(
        &self,
        m: &Matched,
        e: &StoreError,
        cost: u64,
    ) -> (Decision, Option<StoreErrorKind>) {
        m.rule.metrics.store_error(e.kind());
        self.last_failure_ms
            .store(self.clock.now_ms(), Ordering::Relaxed);
        if let Some(refused) = m.rule.spec.policy.refused_whatever_the_state(cost) {
            self.log_store_error(&m.rule, e, self.settings.failure_policy);
            return (refused, None);
        }
        let closed = || m.rule.spec.policy.refused_while_failing();
        let policy = match self.settings.failure_policy {
            // A corrupt key fails on every request until it is
            // deleted: left to the caller (Envoy's default lets
            // requests through), its limit would be lifted for good.
            // It is refused, as under `open`.
            ServeFailurePolicy::Error if e.kind() == StoreErrorKind::CorruptState => {
                FailurePolicy::FailClosed
            }
            ServeFailurePolicy::Error => {
                self.metrics.failure_unanswered();
                self.log_store_error(&m.rule, e, ServeFailurePolicy::Error);
                return (closed(), Some(e.kind()));
            }
            // A corrupt key is refused under `open` too (and logged,
            // and counted).
            ServeFailurePolicy::Decide(policy) => policy.answering(e.kind()),
        };
        let decision = match policy {
            // Nothing is known of the budget: report none left, so a
            // client that reads `remaining` slows down.
            FailurePolicy::FailOpen => Decision::admitted(0),
            FailurePolicy::FailClosed => closed(),
            FailurePolicy::Local => {
                let local = m.rule.failover.as_ref().or(m.rule.local.as_ref());
                match local.map(|l| l.check_now(m.key, cost)) {
                    Some(Ok(d)) => d,
                    // The local limiter cannot decide either (on the
                    // embedded store it is the store that failed, full
                    // of keys): refused as under `closed`, with a wait,
                    // never as a request no wait admits.
                    _ => closed(),
                }
            }
        };
        self.metrics.failure_decision(policy, decision.allowed);
        self.log_store_error(&m.rule, e, ServeFailurePolicy::Decide(policy));
        (decision, Some(e.kind()))
    }

    /// Whether, under `local`, the failure policy would refuse `cost` on
    /// `m`'s key now, found by a cost-0 check of the rule's in-memory twin
    /// (which records nothing). Only `local` takes from a count while the
    /// store fails: `open` admits and `closed` and `error` refuse, taking
    /// nothing, so under them this is false and the order of the answers
    /// costs nothing.
    fn twin_would_refuse(&self, m: &Matched, cost: u64) -> bool {
        if self.settings.failure_policy != ServeFailurePolicy::Decide(FailurePolicy::Local) {
            return false;
        }
        if m.rule
            .spec
            .policy
            .refused_whatever_the_state(cost)
            .is_some()
        {
            return true;
        }
        let local = m.rule.failover.as_ref().or(m.rule.local.as_ref());
        !matches!(
            local.map(|l| l.check_now(m.key, 0)),
            Some(Ok(d)) if d.allowed && d.remaining >= cost
        )
    }

    /// Logs a store failure, at most one line a second: a store that is
    /// down fails every request, and the metrics count them all.
    fn log_store_error(&self, rule: &Rule, e: &StoreError, policy: ServeFailurePolicy) {
        if let Some(held) = self.error_log.pass(self.clock.now_ms()) {
            // A full in-memory store is announced as over, like an outage,
            // once a second has passed without a failure: known keys
            // succeed throughout, but the held-back count would otherwise
            // wait for the next full store, maybe hours later.
            self.failure_logged.store(true, Ordering::Relaxed);
            // Where the store's advice is set here, and the span it
            // speaks of. Housekeeping more often would not help: a full
            // store looks through itself every few new keys anyway.
            let hint = if e.is_capacity_exhausted() {
                match rule.spec.policy.idle_until_forgettable_ms() {
                    Some(ms) => format!(
                        " (in ratewarden serve: [server] max_keys; a key of this rule still \
                         counts up to {ms} ms after its last request)"
                    ),
                    None => " (in ratewarden serve: [server] max_keys; a key of this rule \
                             that spent anything counts for good, as its limit of 0 never \
                             refills)"
                        .to_owned(),
                }
            } else {
                String::new()
            };
            // Every rule shares the one line a second: say how many
            // failures, of any rule, it stands for.
            tracing::warn!(
                rule = %crate::one_line(&rule.spec.name),
                failure_policy = %policy,
                failures_not_logged = held,
                "store failed: {e}{hint}"
            );
        }
    }

    /// Counts and logs (at most once a second) a descriptor whose `limit`
    /// override is ignored because of `why`: envoyproxy/ratelimit would
    /// apply it, this server applies the configured rule, and that must not
    /// go unnoticed.
    pub fn limit_override_ignored(&self, why: &str) {
        self.metrics.limit_override_ignored();
        if let Some(held) = self.override_log.pass(self.clock.now_ms()) {
            tracing::warn!(
                overrides_not_logged = held,
                "a request carried a descriptor limit override (RateLimitDescriptor.limit) that is \
                 ignored because of {why}; the configured rule applies"
            );
        }
    }

    /// Whether a warning repeated on every request may be logged now: at
    /// most once a second per gate (the metrics count every occurrence).
    fn log_now(&self, gate: &LogGate) -> bool {
        gate.pass(self.clock.now_ms()).is_some()
    }
}

fn check_cost(cost: u64) -> Result<(), BadRequest> {
    if cost > MAX_SAFE {
        return Err(BadRequest(format!(
            "cost is {cost}, above the largest allowed 9007199254740991 (2^53 - 1); send a smaller cost"
        )));
    }
    Ok(())
}

/// What is wrong with a request of `descriptors` in `domain` before any
/// is matched (an empty domain, too many descriptors or entries), as the
/// service refuses it; `ratewarden key` refuses the same.
pub fn check_descriptor_request(
    domain: &str,
    descriptors: &[DescriptorRequest],
) -> Result<(), BadRequest> {
    if domain.is_empty() {
        return Err(BadRequest(
            "domain is empty; name the domain the descriptors belong to".into(),
        ));
    }
    if descriptors.is_empty() {
        return Err(BadRequest(
            "descriptors is empty; send at least one descriptor".into(),
        ));
    }
    if descriptors.len() > MAX_DESCRIPTORS {
        return Err(BadRequest(format!(
            "{} descriptors sent; at most {MAX_DESCRIPTORS} are allowed in one request",
            descriptors.len()
        )));
    }
    for (i, d) in descriptors.iter().enumerate() {
        if d.entries.is_empty() {
            return Err(BadRequest(format!(
                "descriptors[{i}] has no entries; give at least one key and value"
            )));
        }
        if d.entries.len() > MAX_ENTRIES {
            return Err(BadRequest(format!(
                "descriptors[{i}] has {} entries; at most {MAX_ENTRIES} are allowed",
                d.entries.len()
            )));
        }
    }
    Ok(())
}

/// The in-memory stores of `rules`: the embedded store's limiters, the
/// `local` failure policy's twins, those of the overrides made so far.
fn memory_stores(rules: &RuleSet) -> Vec<LocalLimiter> {
    let made = rules.rules().iter().cloned().chain(rules.override_rules());
    made.flat_map(|rule| rule.local.clone().into_iter().chain(rule.failover.clone()))
        .chain(rules.unmade_override_failovers())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::store::StoreUrl;
    use ratewarden_core::{BoxFuture, Limiter};
    use std::sync::atomic::AtomicU64;

    async fn service(text: &str) -> Service {
        let config = Config::parse(text, "t.toml").unwrap();
        let factory = crate::factory_for(&StoreUrl::Memory, &config.server).unwrap();
        Service::with_config(config, ConfigSource { path: None }, factory)
            .await
            .unwrap()
    }

    /// Reloads whose reads block fail at their timeout; past
    /// MAX_BLOCKED_READS still blocked, a reload starts no other read and
    /// says so. (Each reload here waits 50 ms for its read, not 10 s.)
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn reads_left_blocked_are_bounded() {
        use std::os::unix::fs::OpenOptionsExt;
        let path = std::env::temp_dir().join(format!(
            "ratewarden-blocked-reads-{}.toml",
            std::process::id()
        ));
        let _ = std::fs::remove_file(&path);
        let made = std::process::Command::new("mkfifo")
            .arg(&path)
            .status()
            .unwrap();
        assert!(made.success());
        let mut s = service("[keys]\nlimit = 5\nwindow_ms = 1000\n").await;
        s.source = ConfigSource {
            path: Some(path.clone()),
        };
        let within = Duration::from_millis(50);
        for _ in 0..MAX_BLOCKED_READS {
            let e = s.reload_within(within).await.unwrap_err();
            assert!(e.contains("did not finish within 50 ms"), "{e}");
        }
        let e = s.reload_within(within).await.unwrap_err();
        assert!(
            e.contains("4 earlier reads of") && e.contains("restart serve"),
            "{e}"
        );
        assert_eq!(
            metric(&s, "ratewarden_config_reloads_total{result=\"failed\"}"),
            5
        );
        // Unblock the reads (each opens the pipe for reading; a writer
        // that opens and closes it lets those waiting finish, reading
        // nothing), so that the test's threads end: again until none is
        // left, since a read's thread may reach the pipe only later.
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while s.reads_under_way.load(Ordering::Relaxed) > 0 {
            assert!(std::time::Instant::now() < deadline, "reads still blocked");
            // Without blocking when no read waits yet (O_NONBLOCK, on
            // Linux: the open then fails, and is made again).
            let writer = std::fs::OpenOptions::new()
                .write(true)
                .custom_flags(0o4000)
                .open(&path);
            drop(writer);
            std::thread::sleep(Duration::from_millis(10));
        }
        std::fs::remove_file(&path).unwrap();
    }

    /// The value of the metric `series` (its name and labels) that `s`
    /// renders; a series it does not render fails the test.
    fn metric(s: &Service, series: &str) -> u64 {
        let text = s.metrics.render(&[]);
        let prefix = format!("{series} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&prefix)?.parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no series {series}: {text}"))
    }

    /// What is left of the count of `key` = `value` in domain `api`, as
    /// a check (cost 0) finds it.
    async fn left(s: &Service, key: &str, value: &str) -> u64 {
        let check = s
            .check_descriptors("api", &[d(&[(key, value)], 0)])
            .await
            .unwrap();
        check[0].decision.remaining
    }

    fn d(entries: &[(&str, &str)], cost: u64) -> DescriptorRequest {
        DescriptorRequest {
            entries: entries
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            cost,
            limit: None,
        }
    }

    const TWO: &str = r#"
[[domains]]
domain = "api"
[[domains.descriptors]]
key = "a"
limit = 10
window_ms = 3600000
[[domains.descriptors]]
key = "b"
limit = 2
window_ms = 3600000
[[domains.descriptors]]
key = "s"
limit = 1
window_ms = 3600000
shadow = true
"#;

    #[tokio::test]
    async fn a_refused_descriptor_consumes_nothing_from_the_others() {
        let s = service(TWO).await;
        for _ in 0..2 {
            let out = s
                .check_descriptors("api", &[d(&[("a", "x")], 1), d(&[("b", "y")], 1)])
                .await
                .unwrap();
            assert!(out.iter().all(|o| o.allowed));
        }
        let out = s
            .check_descriptors("api", &[d(&[("a", "x")], 1), d(&[("b", "y")], 1)])
            .await
            .unwrap();
        assert!(out[0].allowed);
        assert!(!out[1].allowed);
        // "a" still has 8 left: the refused request took nothing from it.
        assert_eq!(left(&s, "a", "x").await, 8);
    }

    /// `ratewarden_decisions_total` counts decisions made: not the cost-0
    /// check of a descriptor whose request another descriptor refused, and
    /// one count sent twice in a request once.
    #[tokio::test]
    async fn metrics_count_each_decision_once() {
        let s = service(TWO).await;
        let count = |rule: &str, outcome: &str| {
            metric(
                &s,
                &format!("ratewarden_decisions_total{{rule=\"{rule}\",outcome=\"{outcome}\"}}"),
            )
        };
        let both = [d(&[("a", "x")], 1), d(&[("b", "y")], 2)];
        s.check_descriptors("api", &both).await.unwrap();
        assert_eq!(
            (count("api.a", "allowed"), count("api.b", "allowed")),
            (1, 1)
        );
        // "b" is spent: the request is refused, and "a" decides nothing.
        let out = s.check_descriptors("api", &both).await.unwrap();
        assert!(out[0].allowed && !out[1].allowed);
        assert_eq!(
            (count("api.a", "allowed"), count("api.b", "refused")),
            (1, 1)
        );
        let twice = [d(&[("a", "z")], 1), d(&[("a", "z")], 1)];
        s.check_descriptors("api", &twice).await.unwrap();
        assert_eq!(count("api.a", "allowed"), 2);
    }

    #[tokio::test]
    async fn a_cost_above_every_limit_refuses_its_descriptor_only() {
        let s = service(TWO).await;
        let long = "v".repeat(100_000);
        for cost in [MAX_SAFE + 1, u64::MAX] {
            let out = s
                .check_descriptors(
                    "api",
                    &[
                        d(&[("a", "x")], 1),
                        d(&[("b", &long)], cost),
                        d(&[("s", "z")], cost),
                    ],
                )
                .await
                .unwrap();
            assert!(out[0].allowed);
            assert!(!out[1].allowed);
            assert_eq!(out[1].decision.retry_after_ms, None, "it never fits");
            assert!(out[2].allowed && !out[2].decision.allowed, "shadow");
        }
        // The refused requests took nothing from "a"; a long value is just a
        // value, counted like any other.
        let out = s
            .check_descriptors("api", &[d(&[("a", "x")], 0), d(&[("b", &long)], 2)])
            .await
            .unwrap();
        assert_eq!(out[0].decision.remaining, 10);
        assert!(out[1].allowed);
    }

    #[tokio::test]
    async fn one_count_twice_in_a_request_is_one_decision() {
        let s = service("[[domains]]\ndomain = \"api\"\n[[domains.descriptors]]\nkey = \"c\"\nlimit = 3\nwindow_ms = 3600000\n").await;
        let one = d(&[("c", "x")], 1);
        for _ in 0..2 {
            assert!(
                s.check_descriptors("api", std::slice::from_ref(&one))
                    .await
                    .unwrap()[0]
                    .allowed
            );
        }
        // 1 left: twice the descriptor costs 2, refused, and takes nothing.
        let out = s
            .check_descriptors("api", &[one.clone(), one.clone()])
            .await
            .unwrap();
        assert!(out.iter().all(|o| !o.allowed && o.decision.remaining == 1));
        let out = s
            .check_descriptors("api", std::slice::from_ref(&one))
            .await
            .unwrap();
        assert!(out[0].allowed);
        assert_eq!(out[0].decision.remaining, 0);
    }

    #[tokio::test]
    async fn shadow_rules_count_but_never_refuse() {
        let s = service(TWO).await;
        for i in 0..3 {
            let out = s
                .check_descriptors("api", &[d(&[("s", "z")], 1)])
                .await
                .unwrap();
            assert!(out[0].allowed);
            assert_eq!(out[0].decision.allowed, i == 0);
        }
    }

    /// The bounds on one request: 64 descriptors of 32 entries are
    /// decided, one more of either is refused, naming the bound.
    #[tokio::test]
    async fn a_request_holds_at_most_64_descriptors_of_32_entries() {
        let s = service(TWO).await;
        let entries: Vec<(String, String)> = (0..MAX_ENTRIES)
            .map(|i| (format!("k{i}"), "v".to_owned()))
            .collect();
        let entries: Vec<(&str, &str)> = entries.iter().map(|(k, v)| (&**k, &**v)).collect();
        let full = vec![d(&entries, 1); MAX_DESCRIPTORS];
        assert_eq!(s.check_descriptors("api", &full).await.unwrap().len(), 64);
        let mut more = full.clone();
        more.push(d(&[("a", "x")], 1));
        let e = s.check_descriptors("api", &more).await.unwrap_err().0;
        assert!(
            e.starts_with("65 descriptors sent; at most 64 are allowed"),
            "{e}"
        );
        let mut wide = full;
        wide[3].entries.push(("k32".to_owned(), "v".to_owned()));
        let e = s.check_descriptors("api", &wide).await.unwrap_err().0;
        assert!(
            e.starts_with("descriptors[3] has 33 entries; at most 32 are allowed"),
            "{e}"
        );
    }

    #[tokio::test]
    async fn unmatched_descriptors_are_unlimited_and_bad_input_is_named() {
        let s = service(TWO).await;
        let out = s
            .check_descriptors("api", &[d(&[("nope", "x")], 5)])
            .await
            .unwrap();
        assert!(out[0].allowed && out[0].rule.is_none());
        // An unknown domain, or an empty entry key, limits nothing.
        let out = s
            .check_descriptors("web", &[d(&[("a", "x")], 1), d(&[("", "x")], 1)])
            .await
            .unwrap();
        assert!(out.iter().all(|o| o.allowed && o.rule.is_none()));
        assert!(s
            .metrics
            .render(&[])
            .contains("\nratewarden_unknown_domain_total 1\n"));
        let out = s
            .check_descriptors("api", &[d(&[("", "x")], 1)])
            .await
            .unwrap();
        assert!(out[0].allowed && out[0].rule.is_none());
        assert!(s
            .check_descriptors("api", &[])
            .await
            .unwrap_err()
            .0
            .contains("descriptors is empty"));
        assert!(s
            .check_descriptors("api", &[d(&[], 1)])
            .await
            .unwrap_err()
            .0
            .contains("no entries"));
        assert!(s.check_key("k", 1).await.unwrap_err().0.contains("[keys]"));
    }

    #[tokio::test]
    async fn housekeeping_forgets_idle_keys() {
        let s = service("[keys]\npolicy = \"fixed-window\"\nlimit = 5\nwindow_ms = 1\n").await;
        for i in 0..10 {
            s.check_key(&format!("k{i}"), 1).await.unwrap();
        }
        assert_eq!(s.keys_tracked(), vec![("keys".to_owned(), 10)]);
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert_eq!(s.housekeeping().forgotten, 10);
        assert_eq!(s.keys_tracked(), vec![("keys".to_owned(), 0)]);
    }

    /// Keys a full store forgets to make room are counted too, at the next
    /// housekeeping pass: on a store that fills, they are most of them.
    #[tokio::test]
    async fn keys_forgotten_for_new_ones_are_counted() {
        let s = service(
            "[server]\nmax_keys = 2\n[keys]\npolicy = \"fixed-window\"\nlimit = 5\nwindow_ms = 20\n",
        )
        .await;
        s.check_key("a", 1).await.unwrap();
        s.check_key("b", 1).await.unwrap();
        tokio::time::sleep(Duration::from_millis(25)).await;
        // Full: "c" is let in by forgetting "a" and "b", idle for a window.
        assert!(s.check_key("c", 1).await.unwrap().decision.allowed);
        let done = s.housekeeping();
        assert_eq!(done.forgotten_for_new_keys, 2);
        let text = s.metrics.render(&[]);
        assert!(
            text.contains("ratewarden_keys_forgotten_total{by=\"new_key\"} 2\n"),
            "{text}"
        );
        assert!(
            text.contains(&format!(
                "ratewarden_keys_forgotten_total{{by=\"housekeeping\"}} {}\n",
                done.forgotten
            )),
            "{text}"
        );
    }

    /// A reload that replaces a rule's store counts the keys that store
    /// forgot for new ones, which would have left with it before the next
    /// housekeeping pass.
    #[tokio::test]
    async fn keys_forgotten_for_new_ones_by_a_replaced_store_are_counted() {
        let rule = |limit: u64| {
            format!(
                "[server]\nmax_keys = 2\n[keys]\npolicy = \"fixed-window\"\nlimit = {limit}\n\
                 window_ms = 20\n"
            )
        };
        let file = std::env::temp_dir().join(format!(
            "ratewarden-forgotten-at-reload-{}.toml",
            std::process::id()
        ));
        std::fs::write(&file, rule(5)).unwrap();
        let mut s = service(&rule(5)).await;
        s.source = ConfigSource {
            path: Some(file.clone()),
        };
        s.check_key("a", 1).await.unwrap();
        s.check_key("b", 1).await.unwrap();
        tokio::time::sleep(Duration::from_millis(25)).await;
        assert!(s.check_key("c", 1).await.unwrap().decision.allowed);
        // A new limit: a new store, the old one dropped.
        std::fs::write(&file, rule(6)).unwrap();
        s.reload().await.unwrap();
        std::fs::remove_file(&file).unwrap();
        assert_eq!(s.check_key("c", 1).await.unwrap().decision.remaining, 5);
        assert_eq!(s.housekeeping().forgotten_for_new_keys, 0);
        assert_eq!(
            metric(&s, "ratewarden_keys_forgotten_total{by=\"new_key\"}"),
            2
        );
    }

    /// A store that fails every call with `kind` (but cost-0 checks, when
    /// `checks` is set, which find room), counting the calls that would
    /// take something (a frozen Redis would run them later).
    struct Broken {
        config: ratewarden_core::PolicyConfig,
        kind: StoreErrorKind,
        checks: bool,
        takes: Arc<AtomicU64>,
    }

    impl Limiter for Broken {
        fn config(&self) -> &ratewarden_core::PolicyConfig {
            &self.config
        }

        fn check(&self, _key: u64, cost: u64) -> BoxFuture<'_, Result<Decision, StoreError>> {
            if cost == 0 && self.checks {
                return Box::pin(std::future::ready(Ok(Decision::admitted(
                    self.config.limit,
                ))));
            }
            if cost > 0 {
                self.takes.fetch_add(1, Ordering::Relaxed);
            }
            let e = StoreError::new(self.kind, "down");
            Box::pin(std::future::ready(Err(e)))
        }
    }

    /// Shadow descriptors are taken all at once, alongside the enforcing
    /// descriptor's take: a store that does not answer costs the request
    /// one timeout, not one more for each shadow rule. (Three takes meet
    /// at one barrier, which only takes made together pass.)
    #[tokio::test]
    async fn shadow_descriptors_are_taken_alongside_the_others() {
        let config = r#"
[[domains]]
domain = "api"
[[domains.descriptors]]
key = "a"
limit = 10
window_ms = 3600000
[[domains.descriptors]]
key = "s"
limit = 11
window_ms = 3600000
shadow = true
[[domains.descriptors]]
key = "t"
limit = 12
window_ms = 3600000
shadow = true
"#;
        let s = all_at_once(config, 3, true).await;
        let request = [
            d(&[("a", "x")], 1),
            d(&[("s", "y")], 1),
            d(&[("t", "z")], 1),
        ];
        let out = tokio::time::timeout(
            Duration::from_secs(10),
            s.check_descriptors("api", &request),
        )
        .await
        .expect("the three takes are made together")
        .unwrap();
        assert!(out.iter().all(|o| o.allowed), "{out:?}");
    }

    /// The limiter `make` gives a rule by its configuration, else the
    /// memory store's.
    struct TestFactory<F>(F);

    impl<F> StoreFactory for TestFactory<F>
    where
        F: Fn(&ratewarden_core::PolicyConfig) -> Option<Arc<dyn Limiter>> + Send + Sync + 'static,
    {
        fn describe(&self) -> String {
            "test".into()
        }

        fn build<'a>(
            &'a self,
            rule_id: &'a str,
            config: &'a ratewarden_core::PolicyConfig,
        ) -> BoxFuture<'a, anyhow::Result<crate::store::BuiltLimiter>> {
            Box::pin(async move {
                match (self.0)(config) {
                    Some(limiter) => Ok(crate::store::BuiltLimiter {
                        limiter,
                        local: None,
                    }),
                    None => {
                        let memory = crate::store::MemoryFactory {
                            options: ratewarden_core::MemoryOptions::default(),
                        };
                        memory.build(rule_id, config).await
                    }
                }
            })
        }
    }

    /// A service on `config` whose rules decide on what `make` gives them
    /// (the memory store where it gives nothing).
    async fn service_on<F>(config: &str, make: F) -> Service
    where
        F: Fn(&ratewarden_core::PolicyConfig) -> Option<Arc<dyn Limiter>> + Send + Sync + 'static,
    {
        let config = Config::parse(config, "t.toml").unwrap();
        Service::with_config(
            config,
            ConfigSource { path: None },
            Arc::new(TestFactory(make)),
        )
        .await
        .unwrap()
    }

    /// The memory store for rules whose limit is not in `broken`, and for
    /// those whose limit is, a store that fails with `kind` (but answers
    /// checks when `checks` is set); with the count of takes sent to them.
    async fn partly_broken(
        config: &str,
        broken: &'static [u64],
        kind: StoreErrorKind,
        checks: bool,
    ) -> (Service, Arc<AtomicU64>) {
        let takes = Arc::new(AtomicU64::new(0));
        let sent = Arc::clone(&takes);
        let service = service_on(config, move |config| {
            broken.contains(&config.limit).then(|| {
                Arc::new(Broken {
                    config: *config,
                    kind,
                    checks,
                    takes: Arc::clone(&sent),
                }) as Arc<dyn Limiter>
            })
        })
        .await;
        (service, takes)
    }

    /// A cost above every limit is refused whatever the store says; a
    /// store that fails the check for what is left is still counted (and
    /// logged) as a store failure, as every failure is.
    #[tokio::test]
    async fn a_cost_above_every_limit_on_a_failing_store_counts_the_failure() {
        let text = format!("[server]\nfailure_policy = \"open\"\n{TWO}");
        let (s, _) = partly_broken(&text, &[2], StoreErrorKind::Timeout, false).await;
        let out = s
            .check_descriptors("api", &[d(&[("b", "y")], MAX_SAFE + 1)])
            .await
            .unwrap();
        assert!(!out[0].allowed && !out[0].unanswered, "{out:?}");
        assert_eq!(out[0].decision.retry_after_ms, None, "it never fits");
        assert_eq!(
            metric(
                &s,
                "ratewarden_store_errors_total{rule=\"api.b\",kind=\"timeout\"}"
            ),
            1
        );
    }

    /// Under `failure_policy = "error"` a descriptor whose store fails is
    /// left unanswered, so the request fails, and the request's other
    /// descriptors consume nothing; a shadow rule's failure fails no
    /// request.
    #[tokio::test]
    async fn under_the_error_policy_a_failing_store_leaves_the_request_unanswered() {
        let text = format!("[server]\nfailure_policy = \"error\"\n{TWO}");
        // `b` and the shadow rule `s`.
        let (s, _) = partly_broken(&text, &[2, 1], StoreErrorKind::Backend, false).await;

        let out = s
            .check_descriptors("api", &[d(&[("a", "x")], 1), d(&[("b", "y")], 1)])
            .await
            .unwrap();
        assert!(!out[0].unanswered && out[1].unanswered, "{out:?}");
        assert_eq!(
            unanswered(&out, true).unwrap(),
            "the store failed (backend) deciding descriptor 1 (rule \"api.b\"), and \
             failure_policy = \"error\" leaves the decision to the caller"
        );
        // `a` took nothing.
        assert_eq!(left(&s, "a", "x").await, 10);

        // The shadow rule's failure: answered, and `a` takes its cost.
        let out = s
            .check_descriptors("api", &[d(&[("a", "x")], 1), d(&[("s", "z")], 1)])
            .await
            .unwrap();
        assert!(unanswered(&out, true).is_none(), "{out:?}");
        assert!(out.iter().all(|o| o.allowed) && out[1].by_failure_policy());
        assert_eq!(out[0].decision.remaining, 9);

        assert_eq!(
            metric(
                &s,
                "ratewarden_failure_policy_decisions_total{policy=\"error\",outcome=\"unanswered\"}"
            ),
            2
        );
        // Not a decision of the rule's, nor the shadow rule's.
        for rule in ["api.b", "api.s"] {
            for outcome in ["refused", "shadow_refused"] {
                let series =
                    format!("ratewarden_decisions_total{{rule=\"{rule}\",outcome=\"{outcome}\"}}");
                assert_eq!(metric(&s, &series), 0, "{series}");
            }
        }

        // A descriptor that refuses answers the request, whatever the
        // failing store would have said: refused (`a` has 9 left).
        let out = s
            .check_descriptors("api", &[d(&[("a", "x")], 10), d(&[("b", "y")], 1)])
            .await
            .unwrap();
        assert!(unanswered(&out, true).is_none(), "{out:?}");
        assert!(!out[0].allowed && !out[0].unanswered && out[1].unanswered);
    }

    /// No take is sent to a store that did not answer a descriptor's
    /// check: a frozen Redis would run it when it thaws, charging the
    /// request whatever it was answered. The failure policy answers.
    #[tokio::test]
    async fn a_store_that_did_not_answer_the_check_is_sent_no_take() {
        for policy in ["open", "closed", "error"] {
            let text = format!("[server]\nfailure_policy = \"{policy}\"\n{TWO}");
            // `a` and `b`.
            let (s, takes) = partly_broken(&text, &[10, 2], StoreErrorKind::Timeout, false).await;
            let out = s
                .check_descriptors("api", &[d(&[("a", "x")], 1), d(&[("b", "y")], 1)])
                .await
                .unwrap();
            let allowed = policy == "open";
            assert!(
                out.iter().all(|o| o.allowed == allowed),
                "{policy}: {out:?}"
            );
            assert_eq!(takes.load(Ordering::Relaxed), 0, "{policy}");
            assert_eq!(
                unanswered(&out, true).is_some(),
                policy == "error",
                "{policy}"
            );
            // Each descriptor's failure is counted, once.
            for rule in ["api.a", "api.b"] {
                let series =
                    format!("ratewarden_store_errors_total{{rule=\"{rule}\",kind=\"timeout\"}}");
                assert_eq!(metric(&s, &series), 1, "{policy}: {series}");
            }
        }
    }

    /// Once a take refuses the request (a failing store's, under `closed`),
    /// the descriptors after it take nothing: they stand at their checks.
    #[tokio::test]
    async fn descriptors_after_a_refused_take_take_nothing() {
        let text = format!("[server]\nfailure_policy = \"closed\"\n{TWO}");
        // `a` answers its check, then fails its take.
        let (s, takes) = partly_broken(&text, &[10], StoreErrorKind::Timeout, true).await;
        let out = s
            .check_descriptors("api", &[d(&[("a", "x")], 1), d(&[("b", "y")], 1)])
            .await
            .unwrap();
        assert!(!out[0].allowed && out[0].by_failure_policy(), "{out:?}");
        assert_eq!(takes.load(Ordering::Relaxed), 1);
        // `b` still has its 2, shown as its check found them.
        assert!(out[1].allowed && out[1].decision.remaining == 2, "{out:?}");
        assert_eq!(left(&s, "b", "y").await, 2);
    }

    /// Under `local`, a descriptor whose check the store failed is decided
    /// on the local twin; but when another descriptor refuses the request,
    /// only as a check, so the refused request consumes nothing there.
    #[tokio::test]
    async fn a_refused_request_consumes_nothing_on_a_local_twin() {
        let text = format!("[server]\nfailure_policy = \"local\"\n{TWO}");
        // `a`'s store fails; `b` (2) is spent first.
        let (s, _) = partly_broken(&text, &[10], StoreErrorKind::Timeout, false).await;
        assert!(
            s.check_descriptors("api", &[d(&[("b", "y")], 2)])
                .await
                .unwrap()[0]
                .allowed
        );
        let out = s
            .check_descriptors("api", &[d(&[("a", "x")], 1), d(&[("b", "y")], 1)])
            .await
            .unwrap();
        assert!(
            out[0].allowed && out[0].by_failure_policy() && !out[1].allowed,
            "{out:?}"
        );
        assert_eq!(left(&s, "a", "x").await, 10);
        // Standing as a check: no decision of the rule's (only the later
        // check is one).
        assert_eq!(
            metric(
                &s,
                "ratewarden_decisions_total{rule=\"api.a\",outcome=\"allowed\"}"
            ),
            1
        );
    }

    /// Under `local`, when the store fails every check, the twins are
    /// checked first too: a request one twin refuses takes nothing from
    /// the twins of the descriptors before it, as on the store.
    #[tokio::test]
    async fn a_refused_request_takes_nothing_from_the_twins_before_the_refusal() {
        let text = format!("[server]\nfailure_policy = \"local\"\n{TWO}");
        // `a` (10) and `b` (2) both fail; `b`'s twin is spent first.
        let (s, _) = partly_broken(&text, &[10, 2], StoreErrorKind::Timeout, false).await;
        let spent = s
            .check_descriptors("api", &[d(&[("b", "y")], 2)])
            .await
            .unwrap();
        assert!(
            spent[0].allowed && spent[0].by_failure_policy(),
            "{spent:?}"
        );
        for _ in 0..3 {
            let out = s
                .check_descriptors("api", &[d(&[("a", "x")], 1), d(&[("b", "y")], 1)])
                .await
                .unwrap();
            assert!(out[0].allowed && !out[1].allowed, "{out:?}");
            assert_eq!(out[0].decision.remaining, 10, "{out:?}");
        }
        assert_eq!(left(&s, "a", "x").await, 10);
        assert_eq!(metric(&s, "ratewarden_partial_consumptions_total"), 0);
        // Each refusal is `b`'s own; `a` stood at its check.
        for (rule, outcome, n) in [("api.a", "allowed", 1), ("api.b", "refused", 3)] {
            let series =
                format!("ratewarden_decisions_total{{rule=\"{rule}\",outcome=\"{outcome}\"}}");
            assert_eq!(metric(&s, &series), n, "{series}");
        }
    }

    /// A store whose checks find no room and whose takes admit, as when a
    /// window rolls over between the two.
    struct Rolled(ratewarden_core::PolicyConfig);

    impl Limiter for Rolled {
        fn config(&self) -> &ratewarden_core::PolicyConfig {
            &self.0
        }

        fn check(&self, _key: u64, cost: u64) -> BoxFuture<'_, Result<Decision, StoreError>> {
            let d = if cost == 0 {
                Decision::admitted(0)
            } else {
                Decision::admitted(self.0.limit - cost)
            };
            Box::pin(std::future::ready(Ok(d)))
        }
    }

    /// A descriptor whose check found no room is decided for real; when
    /// its take admits after all (a window rolled over since the check)
    /// and another descriptor refuses the request, the request consumed:
    /// a partial consumption, counted.
    #[tokio::test]
    async fn a_refusal_whose_take_admits_is_a_partial_consumption() {
        // `a` (10) rolls over between check and take; `b` (2) is spent.
        let s = service_on(TWO, |config| {
            (config.limit == 10).then(|| Arc::new(Rolled(*config)) as Arc<dyn Limiter>)
        })
        .await;
        let spent = s
            .check_descriptors("api", &[d(&[("b", "y")], 2)])
            .await
            .unwrap();
        assert!(spent[0].allowed, "{spent:?}");
        let out = s
            .check_descriptors("api", &[d(&[("a", "x")], 1), d(&[("b", "y")], 1)])
            .await
            .unwrap();
        assert!(out[0].allowed && !out[1].allowed, "{out:?}");
        assert_eq!(metric(&s, "ratewarden_partial_consumptions_total"), 1);
    }

    /// A store whose checks find room and whose takes refuse, as when
    /// another request spends the budget between the two.
    struct Outrun(ratewarden_core::PolicyConfig);

    impl Limiter for Outrun {
        fn config(&self) -> &ratewarden_core::PolicyConfig {
            &self.0
        }

        fn check(&self, _key: u64, cost: u64) -> BoxFuture<'_, Result<Decision, StoreError>> {
            let d = if cost == 0 {
                Decision::admitted(self.0.limit)
            } else {
                Decision::refused(Some(1000), 0)
            };
            Box::pin(std::future::ready(Ok(d)))
        }
    }

    /// A descriptor the failure policy admitted (`open`) took no count, so
    /// a refusal after it is no partial consumption.
    #[tokio::test]
    async fn an_admission_by_the_failure_policy_consumes_nothing() {
        let text = format!("[server]\nfailure_policy = \"open\"\n{TWO}");
        // `a` (limit 10) fails every call, `b` (limit 2) is outrun.
        let s = service_on(&text, |config| {
            Some(if config.limit == 10 {
                Arc::new(Broken {
                    config: *config,
                    kind: StoreErrorKind::Timeout,
                    checks: false,
                    takes: Arc::new(AtomicU64::new(0)),
                }) as Arc<dyn Limiter>
            } else {
                Arc::new(Outrun(*config))
            })
        })
        .await;
        let out = s
            .check_descriptors("api", &[d(&[("a", "x")], 1), d(&[("b", "y")], 1)])
            .await
            .unwrap();
        assert!(
            out[0].allowed && out[0].by_failure_policy() && !out[1].allowed,
            "{out:?}"
        );
        assert_eq!(metric(&s, "ratewarden_partial_consumptions_total"), 0);
    }

    /// Two copies of one override whose limiter cannot be made are one
    /// count, decided once at their summed cost: under `local`, 2 on a
    /// limit of 1 is refused, and the twin keeps its 1.
    #[tokio::test]
    async fn copies_of_an_override_that_cannot_be_made_are_one_count() {
        let (s, _) = override_service("local", true).await;
        let out = s
            .check_descriptors("api", &[over(&[("a", "x")], 1), over(&[("a", "x")], 1)])
            .await
            .unwrap();
        assert!(out.iter().all(|o| !o.allowed), "{out:?}");
        let alone = s
            .check_descriptors(
                "api",
                &[DescriptorRequest {
                    cost: 0,
                    ..over(&[("a", "x")], 1)
                }],
            )
            .await
            .unwrap();
        assert_eq!(alone[0].decision.remaining, 1);
        // One failure for the pair, one for the check after.
        assert_eq!(
            metric(
                &s,
                "ratewarden_store_errors_total{rule=\"api.a.override\",kind=\"backend\"}"
            ),
            2
        );
    }

    /// A store whose checks (cost 0), and its takes too when `takes` is
    /// set, answer only once `barrier` has as many waiting as it has
    /// parties, and which admits.
    struct AllAtOnce {
        config: ratewarden_core::PolicyConfig,
        barrier: Arc<tokio::sync::Barrier>,
        takes: bool,
    }

    impl Limiter for AllAtOnce {
        fn config(&self) -> &ratewarden_core::PolicyConfig {
            &self.config
        }

        fn check(&self, _key: u64, cost: u64) -> BoxFuture<'_, Result<Decision, StoreError>> {
            let limit = self.config.limit;
            let barrier = Arc::clone(&self.barrier);
            let waits = cost == 0 || self.takes;
            Box::pin(async move {
                if waits {
                    barrier.wait().await;
                }
                Ok(Decision::admitted(limit.saturating_sub(cost)))
            })
        }
    }

    /// A service on `config` whose every rule decides on an [`AllAtOnce`]
    /// store, the rules sharing one barrier of `parties`.
    async fn all_at_once(config: &str, parties: usize, takes: bool) -> Service {
        let barrier = Arc::new(tokio::sync::Barrier::new(parties));
        service_on(config, move |config| {
            Some(Arc::new(AllAtOnce {
                config: *config,
                barrier: Arc::clone(&barrier),
                takes,
            }) as Arc<dyn Limiter>)
        })
        .await
    }

    /// A store that counts its calls and admits them all.
    struct Counting {
        config: ratewarden_core::PolicyConfig,
        calls: Arc<AtomicU64>,
    }

    impl Limiter for Counting {
        fn config(&self) -> &ratewarden_core::PolicyConfig {
            &self.config
        }

        fn check(&self, _key: u64, cost: u64) -> BoxFuture<'_, Result<Decision, StoreError>> {
            self.calls.fetch_add(1, Ordering::Relaxed);
            let d = Decision::admitted(self.config.limit - cost);
            Box::pin(std::future::ready(Ok(d)))
        }
    }

    /// A request that only reads its counts (every cost 0) is answered by
    /// its checks: one store call per descriptor, and a decision each.
    #[tokio::test]
    async fn a_request_of_cost_0_is_answered_by_its_checks() {
        let calls = Arc::new(AtomicU64::new(0));
        let counted = Arc::clone(&calls);
        let s = service_on(TWO, move |config| {
            Some(Arc::new(Counting {
                config: *config,
                calls: Arc::clone(&counted),
            }) as Arc<dyn Limiter>)
        })
        .await;
        let out = s
            .check_descriptors("api", &[d(&[("a", "x")], 0), d(&[("b", "y")], 0)])
            .await
            .unwrap();
        assert!(out.iter().all(|o| o.allowed), "{out:?}");
        assert_eq!(calls.load(Ordering::Relaxed), 2);
        for rule in ["api.a", "api.b"] {
            let series =
                format!("ratewarden_decisions_total{{rule=\"{rule}\",outcome=\"allowed\"}}");
            assert_eq!(metric(&s, &series), 1, "{series}");
        }
    }

    /// A request's descriptors are checked at once: here each check
    /// answers only once the other is asked too, so checks one after the
    /// other would time out (and be refused, under `closed`).
    #[tokio::test]
    async fn a_requests_checks_are_asked_at_once() {
        let s = all_at_once(TWO, 2, false).await;
        let out = s
            .check_descriptors("api", &[d(&[("a", "x")], 1), d(&[("b", "y")], 1)])
            .await
            .unwrap();
        assert!(
            out.iter().all(|o| o.allowed && !o.by_failure_policy()),
            "{out:?}"
        );
    }

    /// A key holding state the store cannot read fails on every request:
    /// under `error` it is refused, as under `open`, rather than left to a
    /// caller whose default admits it, for good.
    #[tokio::test]
    async fn under_the_error_policy_a_corrupt_key_is_refused() {
        let text = format!("[server]\nfailure_policy = \"error\"\n{TWO}");
        let (s, _) = partly_broken(&text, &[2], StoreErrorKind::CorruptState, false).await;
        let out = s
            .check_descriptors("api", &[d(&[("b", "y")], 1)])
            .await
            .unwrap();
        assert!(unanswered(&out, true).is_none(), "{out:?}");
        assert!(!out[0].allowed && out[0].by_failure_policy(), "{out:?}");
    }

    /// A memory store whose override limiters count their making, and
    /// cannot be made while `fail` is set (as a Redis that refuses the
    /// connection).
    struct OverrideFactory {
        memory: crate::store::MemoryFactory,
        made: AtomicU64,
        fail: std::sync::atomic::AtomicBool,
    }

    impl StoreFactory for OverrideFactory {
        fn describe(&self) -> String {
            "test".into()
        }

        fn build<'a>(
            &'a self,
            rule_id: &'a str,
            config: &'a ratewarden_core::PolicyConfig,
        ) -> ratewarden_core::BoxFuture<'a, anyhow::Result<crate::store::BuiltLimiter>> {
            Box::pin(async move {
                if !rule_id.contains("override") {
                    return self.memory.build(rule_id, config).await;
                }
                // Lets concurrent requests reach the making at once.
                tokio::time::sleep(Duration::from_millis(20)).await;
                if self.fail.load(Ordering::Relaxed) {
                    anyhow::bail!("connection refused");
                }
                self.made.fetch_add(1, Ordering::Relaxed);
                let built = self.memory.build(rule_id, config).await?;
                // As a networked store: no in-memory limiter.
                Ok(crate::store::BuiltLimiter {
                    limiter: built.limiter,
                    local: None,
                })
            })
        }
    }

    async fn override_service(policy: &str, fail: bool) -> (Arc<Service>, Arc<OverrideFactory>) {
        let text = format!("[server]\nfailure_policy = \"{policy}\"\n{TWO}");
        let config = Config::parse(&text, "t.toml").unwrap();
        let factory = Arc::new(OverrideFactory {
            memory: crate::store::MemoryFactory {
                options: ratewarden_core::MemoryOptions::default(),
            },
            made: AtomicU64::new(0),
            fail: std::sync::atomic::AtomicBool::new(fail),
        });
        let service = Service::with_config(config, ConfigSource { path: None }, factory.clone())
            .await
            .unwrap();
        (Arc::new(service), factory)
    }

    fn over(entries: &[(&str, &str)], limit: u64) -> DescriptorRequest {
        DescriptorRequest {
            limit: Some(LimitOverride {
                limit,
                window_ms: 3_600_000,
            }),
            ..d(entries, 1)
        }
    }

    /// Many requests asking for one new override at once make its limiter
    /// once, and share its count.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_requests_make_an_override_once() {
        let (s, factory) = override_service("closed", false).await;
        let tasks: Vec<_> = (0..16)
            .map(|_| {
                let s = Arc::clone(&s);
                tokio::spawn(async move {
                    s.check_descriptors("api", &[over(&[("a", "x")], 10)])
                        .await
                        .unwrap()[0]
                        .allowed
                })
            })
            .collect();
        let mut allowed = 0;
        for t in tasks {
            allowed += usize::from(t.await.unwrap());
        }
        assert_eq!(allowed, 10);
        assert_eq!(factory.made.load(Ordering::Relaxed), 1);
    }

    /// An override whose limiter cannot be made is decided by the failure
    /// policy, as a rule whose store fails; the making is tried again on
    /// the next request.
    #[tokio::test]
    async fn an_override_whose_limiter_cannot_be_made_gets_the_failure_policy() {
        for (policy, allowed) in [
            ("open", [true, true]),
            ("closed", [false, false]),
            ("local", [true, false]),
        ] {
            let (s, factory) = override_service(policy, true).await;
            for expected in allowed {
                let o = &s
                    .check_descriptors("api", &[over(&[("a", "x")], 1)])
                    .await
                    .unwrap()[0];
                assert!(o.by_failure_policy(), "{policy}");
                assert_eq!(o.allowed, expected, "{policy}");
                assert_eq!(o.rule.as_ref().unwrap().spec.name, "api.a.override");
            }
            let text = s.metrics.render(&[]);
            assert!(
                text.contains(
                    "ratewarden_store_errors_total{rule=\"api.a.override\",kind=\"backend\"} 2\n"
                ),
                "{text}"
            );
            factory.fail.store(false, Ordering::Relaxed);
            let o = &s
                .check_descriptors("api", &[over(&[("a", "x")], 1)])
                .await
                .unwrap()[0];
            assert!(!o.by_failure_policy() && o.allowed, "{policy}");
            assert_eq!(factory.made.load(Ordering::Relaxed), 1);
        }
    }

    #[tokio::test]
    async fn a_full_store_gets_the_failure_policy() {
        // Under `local` on the embedded store the local limiter is the
        // store that is full: it refuses as `closed` does, with a wait.
        for (policy, allowed) in [("open", true), ("closed", false), ("local", false)] {
            let text = format!(
                "[server]\nmax_keys = 1\nfailure_policy = \"{policy}\"\n[keys]\nlimit = 5\nwindow_ms = 3600000\n"
            );
            let s = service(&text).await;
            let mut failed = 0;
            for i in 0..200 {
                let o = s.check_key(&format!("k{i}"), 1).await.unwrap();
                if o.by_failure_policy() {
                    failed += 1;
                    assert_eq!(o.decision.allowed, allowed, "{policy}");
                    assert_eq!(o.allowed, allowed, "{policy}");
                    if !allowed {
                        assert_eq!(o.decision.retry_after_ms, Some(1000));
                    }
                }
            }
            // The store is far smaller than 200 keys: they overflow it.
            assert!(failed > 0, "{policy}");
            // A cost above the limit needs no room to be refused: no
            // budget ever admits it, whatever the failure policy says, and
            // the full store answers it with no error.
            let o = s.check_key("k-costly", 6).await.unwrap();
            assert!(!o.allowed && !o.decision.allowed, "{policy}");
            assert_eq!(o.decision.retry_after_ms, None, "{policy}");
            assert!(!o.by_failure_policy(), "{policy}");
            let text = s.metrics.render(&[]);
            assert!(text.contains(&format!(
                "ratewarden_store_errors_total{{rule=\"keys\",kind=\"capacity_exhausted\"}} {failed}\n"
            )), "{text}");
        }
    }
}
