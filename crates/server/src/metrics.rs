//! Counters and a latency histogram, rendered in the Prometheus text format.
//!
//! Per-rule counters are atomics reached through the rule itself, so the
//! request path takes no lock, but for the first request to use a limit
//! override of new numbers (its rule's series are made then); the
//! registry's lock is otherwise taken only when a configuration is
//! (re)loaded and when `/metrics` is scraped.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use ratewarden_core::{FailurePolicy, StoreErrorKind};

/// Upper bounds of the latency histogram's buckets, in microseconds: up
/// to 10 s, the longest `store_timeout_ms`, so that a slow tail (a store
/// that times out, a gRPC call that waits its deadline) is told apart
/// from +Inf.
const LATENCY_BUCKETS_US: [u64; 17] = [
    25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000,
    1_000_000, 2_500_000, 5_000_000, 10_000_000,
];

const STORE_ERROR_KINDS: &[StoreErrorKind] = StoreErrorKind::ALL;

fn kind_index(kind: StoreErrorKind) -> usize {
    STORE_ERROR_KINDS
        .iter()
        .position(|k| *k == kind)
        .unwrap_or(0)
}

/// How one descriptor's decision ended, for counting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Admitted.
    Allowed,
    /// Refused.
    Refused,
    /// Refused by a shadow rule, and so admitted.
    ShadowRefused,
}

/// The counters of one rule.
#[derive(Debug, Default)]
pub struct RuleMetrics {
    allowed: AtomicU64,
    refused: AtomicU64,
    shadow_refused: AtomicU64,
    store_errors: [AtomicU64; STORE_ERROR_KINDS.len()],
}

impl RuleMetrics {
    /// Counts a decision.
    pub fn record(&self, outcome: Outcome) {
        let counter = match outcome {
            Outcome::Allowed => &self.allowed,
            Outcome::Refused => &self.refused,
            Outcome::ShadowRefused => &self.shadow_refused,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a store failure.
    pub fn store_error(&self, kind: StoreErrorKind) {
        self.store_errors[kind_index(kind)].fetch_add(1, Ordering::Relaxed);
    }
}

/// Which interface a request came through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `POST /v1/check`.
    Http,
    /// `ShouldRateLimit`.
    Grpc,
    /// The port of its own that `--metrics` gives `GET /metrics`.
    Metrics,
}

/// Every interface, in the order their series are written.
const APIS: [Api; 3] = [Api::Http, Api::Grpc, Api::Metrics];

impl Api {
    /// The value of the `api` label.
    pub fn label(self) -> &'static str {
        match self {
            Api::Http => "http",
            Api::Grpc => "grpc",
            Api::Metrics => "metrics",
        }
    }
}

#[derive(Debug, Default)]
struct Histogram {
    buckets: [AtomicU64; LATENCY_BUCKETS_US.len()],
    count: AtomicU64,
    sum_us: AtomicU64,
}

impl Histogram {
    fn observe(&self, elapsed: Duration) {
        let us = u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX);
        if let Some(i) = LATENCY_BUCKETS_US.iter().position(|&b| us <= b) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add(us, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let mut cumulative = 0;
        for (bound, bucket) in LATENCY_BUCKETS_US.iter().zip(&self.buckets) {
            cumulative += bucket.load(Ordering::Relaxed);
            let le = *bound as f64 / 1e6;
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{le}\"}} {cumulative}");
        }
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {count}");
        let sum = self.sum_us.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{name}_sum{{{labels}}} {sum}");
        let _ = writeln!(out, "{name}_count{{{labels}}} {count}");
    }
}

/// Every metric the server exports. Cheap to share behind an `Arc`.
#[derive(Debug, Default)]
pub struct Metrics {
    rules: Mutex<BTreeMap<String, Arc<RuleMetrics>>>,
    failure_decisions: [[AtomicU64; 2]; 3],
    /// Under `failure_policy = "error"`.
    failures_unanswered: AtomicU64,
    partial_consumptions: AtomicU64,
    latency_http: Histogram,
    latency_grpc: Histogram,
    reloads_ok: AtomicU64,
    reloads_failed: AtomicU64,
    /// By housekeeping, and by full stores making room for new keys.
    forgotten: [AtomicU64; 2],
    bad_requests: [AtomicU64; APIS.len()],
    connections_refused: [AtomicU64; APIS.len()],
    unknown_domains: AtomicU64,
    limit_overrides_ignored: AtomicU64,
    grpc_deadlines_exceeded: AtomicU64,
}

impl Metrics {
    /// The counters of the rule named `name`, shared by every version of
    /// the rule across reloads.
    pub fn rule(&self, name: &str) -> Arc<RuleMetrics> {
        Arc::clone(self.rules.lock().entry(name.to_owned()).or_default())
    }

    /// Drops the counters no rule holds any more. Only live rules hold
    /// their counters besides this map: a rule a reload renamed or removed
    /// is gone once its requests in flight are, and its series go with it
    /// rather than stay in every scrape until a restart, or come back with
    /// their old totals when a later reload gives the name again. (A rule
    /// kept by a reload holds the same counters throughout.) Called at
    /// each scrape and after each reload, so that a server never scraped
    /// does not keep every name it ever had.
    pub fn forget_dead_rules(&self) {
        self.rules.lock().retain(|_, m| Arc::strong_count(m) > 1);
    }

    /// Counts a request decided by the failure policy instead of the store.
    pub fn failure_decision(&self, policy: FailurePolicy, allowed: bool) {
        let p = match policy {
            FailurePolicy::FailOpen => 0,
            FailurePolicy::FailClosed => 1,
            FailurePolicy::Local => 2,
        };
        self.failure_decisions[p][usize::from(allowed)].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a descriptor left unanswered, under `failure_policy = "error"`,
    /// because its store failed.
    pub fn failure_unanswered(&self) {
        self.failures_unanswered.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a multi-descriptor request refused although one of its
    /// descriptors consumed (a race between a check and a take, or a
    /// window that rolled over between them).
    pub fn partial_consumption(&self) {
        self.partial_consumptions.fetch_add(1, Ordering::Relaxed);
    }

    /// Records one request's time, from its arrival to its answer.
    pub fn latency(&self, api: Api, elapsed: Duration) {
        match api {
            Api::Http => self.latency_http.observe(elapsed),
            Api::Grpc => self.latency_grpc.observe(elapsed),
            // It answers no check: the histogram is of checks only.
            Api::Metrics => {}
        }
    }

    /// Counts a configuration reload.
    pub fn reload(&self, ok: bool) {
        if ok {
            &self.reloads_ok
        } else {
            &self.reloads_failed
        }
        .fetch_add(1, Ordering::Relaxed);
    }

    /// Counts keys forgotten: `by_housekeeping` in its passes, and
    /// `for_new_keys` by full stores making room.
    pub fn forgotten(&self, by_housekeeping: usize, for_new_keys: usize) {
        self.forgotten[0].fetch_add(by_housekeeping as u64, Ordering::Relaxed);
        self.forgotten[1].fetch_add(for_new_keys as u64, Ordering::Relaxed);
    }

    /// Counts a request naming a domain the configuration does not know.
    /// No domain label: the client chooses the name, and each distinct
    /// label value would be a series kept forever.
    pub fn unknown_domain(&self) {
        self.unknown_domains.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a descriptor whose `limit` override was ignored.
    pub fn limit_override_ignored(&self) {
        self.limit_overrides_ignored.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a gRPC call answered `DEADLINE_EXCEEDED` at its deadline.
    pub fn grpc_deadline_exceeded(&self) {
        self.grpc_deadlines_exceeded.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a request rejected as invalid.
    pub fn bad_request(&self, api: Api) {
        self.bad_requests[api as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a connection closed unserved because its interface held
    /// `max_connections` already.
    pub fn connection_refused(&self, api: Api) {
        self.connections_refused[api as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// The Prometheus text exposition of every metric. `keys_tracked` lists
    /// the in-memory keys held per rule.
    pub fn render(&self, keys_tracked: &[(String, usize)]) -> String {
        let mut out = String::with_capacity(4096);
        self.forget_dead_rules();
        let rules: Vec<(String, Arc<RuleMetrics>)> = {
            let rules = self.rules.lock();
            rules
                .iter()
                .map(|(k, v)| (k.clone(), Arc::clone(v)))
                .collect()
        };

        out.push_str(
            "# HELP ratewarden_decisions_total Descriptor decisions, by rule and outcome.\n",
        );
        out.push_str("# TYPE ratewarden_decisions_total counter\n");
        for (name, m) in &rules {
            let rule = escape(name);
            for (outcome, c) in [
                ("allowed", &m.allowed),
                ("refused", &m.refused),
                ("shadow_refused", &m.shadow_refused),
            ] {
                let v = c.load(Ordering::Relaxed);
                let _ = writeln!(
                    out,
                    "ratewarden_decisions_total{{rule=\"{rule}\",outcome=\"{outcome}\"}} {v}"
                );
            }
        }

        out.push_str("# HELP ratewarden_store_errors_total Store failures, by rule and kind.\n");
        out.push_str("# TYPE ratewarden_store_errors_total counter\n");
        for (name, m) in &rules {
            let rule = escape(name);
            for &kind in STORE_ERROR_KINDS {
                let v = m.store_errors[kind_index(kind)].load(Ordering::Relaxed);
                let kind = kind.name();
                let _ = writeln!(
                    out,
                    "ratewarden_store_errors_total{{rule=\"{rule}\",kind=\"{kind}\"}} {v}"
                );
            }
        }

        out.push_str(
            "# HELP ratewarden_failure_policy_decisions_total Counts answered by the failure \
             policy because the store failed (under `error`, left undecided).\n",
        );
        out.push_str("# TYPE ratewarden_failure_policy_decisions_total counter\n");
        for (i, policy) in ["open", "closed", "local"].into_iter().enumerate() {
            for (j, outcome) in ["refused", "allowed"].into_iter().enumerate() {
                let v = self.failure_decisions[i][j].load(Ordering::Relaxed);
                let _ = writeln!(
                    out,
                    "ratewarden_failure_policy_decisions_total{{policy=\"{policy}\",outcome=\"{outcome}\"}} {v}"
                );
            }
        }
        let v = self.failures_unanswered.load(Ordering::Relaxed);
        let _ = writeln!(
            out,
            "ratewarden_failure_policy_decisions_total{{policy=\"error\",outcome=\"unanswered\"}} {v}"
        );

        out.push_str(
            "# HELP ratewarden_partial_consumptions_total Multi-descriptor requests refused \
             although one of their descriptors consumed.\n",
        );
        out.push_str("# TYPE ratewarden_partial_consumptions_total counter\n");
        let _ = writeln!(
            out,
            "ratewarden_partial_consumptions_total {}",
            self.partial_consumptions.load(Ordering::Relaxed)
        );

        per_api(
            &mut out,
            "ratewarden_bad_requests_total",
            "Requests rejected as invalid.",
            &self.bad_requests,
        );
        per_api(
            &mut out,
            "ratewarden_connections_refused_total",
            "Connections closed unserved because their interface held max_connections already.",
            &self.connections_refused,
        );

        out.push_str(
            "# HELP ratewarden_unknown_domain_total Requests naming a domain that is not \
             configured (with no [fallback]), answered with no limit.\n",
        );
        out.push_str("# TYPE ratewarden_unknown_domain_total counter\n");
        let _ = writeln!(
            out,
            "ratewarden_unknown_domain_total {}",
            self.unknown_domains.load(Ordering::Relaxed)
        );

        out.push_str(
            "# HELP ratewarden_limit_overrides_ignored_total Descriptors whose limit \
             override was ignored (the configured rule applied).\n",
        );
        out.push_str("# TYPE ratewarden_limit_overrides_ignored_total counter\n");
        let _ = writeln!(
            out,
            "ratewarden_limit_overrides_ignored_total {}",
            self.limit_overrides_ignored.load(Ordering::Relaxed)
        );

        out.push_str(
            "# HELP ratewarden_grpc_deadlines_exceeded_total gRPC calls answered \
             DEADLINE_EXCEEDED at their deadline (the client's grpc-timeout, or 10 s).\n",
        );
        out.push_str("# TYPE ratewarden_grpc_deadlines_exceeded_total counter\n");
        let _ = writeln!(
            out,
            "ratewarden_grpc_deadlines_exceeded_total {}",
            self.grpc_deadlines_exceeded.load(Ordering::Relaxed)
        );

        out.push_str("# HELP ratewarden_request_duration_seconds Time from a request's arrival to its answer.\n");
        out.push_str("# TYPE ratewarden_request_duration_seconds histogram\n");
        self.latency_http.render(
            &mut out,
            "ratewarden_request_duration_seconds",
            "api=\"http\"",
        );
        self.latency_grpc.render(
            &mut out,
            "ratewarden_request_duration_seconds",
            "api=\"grpc\"",
        );

        out.push_str("# HELP ratewarden_config_reloads_total Configuration reloads, by result.\n");
        out.push_str("# TYPE ratewarden_config_reloads_total counter\n");
        let _ = writeln!(
            out,
            "ratewarden_config_reloads_total{{result=\"ok\"}} {}",
            self.reloads_ok.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "ratewarden_config_reloads_total{{result=\"failed\"}} {}",
            self.reloads_failed.load(Ordering::Relaxed)
        );

        out.push_str("# HELP ratewarden_keys_tracked Keys held by each rule's in-memory store.\n");
        out.push_str("# TYPE ratewarden_keys_tracked gauge\n");
        for (name, n) in keys_tracked {
            let _ = writeln!(
                out,
                "ratewarden_keys_tracked{{rule=\"{}\"}} {n}",
                escape(name)
            );
        }

        out.push_str(
            "# HELP ratewarden_keys_forgotten_total Idle keys forgotten from in-memory stores, \
             by housekeeping or by a full store making room for a new key.\n",
        );
        out.push_str("# TYPE ratewarden_keys_forgotten_total counter\n");
        for (by, count) in ["housekeeping", "new_key"].iter().zip(&self.forgotten) {
            let _ = writeln!(
                out,
                "ratewarden_keys_forgotten_total{{by=\"{by}\"}} {}",
                count.load(Ordering::Relaxed)
            );
        }
        out
    }
}

/// Escapes a label value as the text format requires.
fn escape(value: &str) -> String {
    let mut s = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            '"' => s.push_str("\\\""),
            '\n' => s.push_str("\\n"),
            c => s.push(c),
        }
    }
    s
}

/// Writes a counter kept per interface, with its `api` label.
fn per_api(out: &mut String, name: &str, help: &str, counts: &[AtomicU64; APIS.len()]) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} counter");
    for api in APIS {
        let count = counts[api as usize].load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}{{api=\"{}\"}} {count}", api.label());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_and_a_cumulative_histogram() {
        let m = Metrics::default();
        let r = m.rule("api.\"x\"");
        r.record(Outcome::Allowed);
        r.record(Outcome::Allowed);
        r.record(Outcome::Refused);
        r.store_error(StoreErrorKind::Timeout);
        m.failure_decision(FailurePolicy::FailOpen, true);
        m.latency(Api::Http, Duration::from_micros(30));
        m.latency(Api::Http, Duration::from_micros(2_000_000));
        let text = m.render(&[("keys".to_owned(), 3)]);
        assert!(
            text.contains(
                "ratewarden_decisions_total{rule=\"api.\\\"x\\\"\",outcome=\"allowed\"} 2\n"
            ),
            "{text}"
        );
        assert!(text.contains("outcome=\"refused\"} 1\n"), "{text}");
        assert!(text.contains("kind=\"timeout\"} 1\n"), "{text}");
        assert!(
            text.contains("policy=\"open\",outcome=\"allowed\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("{api=\"http\",le=\"0.000025\"} 0\n"),
            "{text}"
        );
        assert!(text.contains("{api=\"http\",le=\"0.00005\"} 1\n"), "{text}");
        // 2 s: past 1 s, within 2.5 s, and the last bound is 10 s.
        assert!(text.contains("{api=\"http\",le=\"1\"} 1\n"), "{text}");
        assert!(text.contains("{api=\"http\",le=\"2.5\"} 2\n"), "{text}");
        assert!(text.contains("{api=\"http\",le=\"10\"} 2\n"), "{text}");
        assert!(text.contains("{api=\"http\",le=\"+Inf\"} 2\n"), "{text}");
        assert!(
            text.contains("ratewarden_keys_tracked{rule=\"keys\"} 3\n"),
            "{text}"
        );
        assert!(Arc::ptr_eq(&r, &m.rule("api.\"x\"")));
    }
}
