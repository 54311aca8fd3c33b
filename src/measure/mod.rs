//! Measurement: speed, memory and accuracy of the policies on the
//! in-memory store, beside governor, for `ratewarden bench` and
//! `ratewarden simulate`.

pub mod accuracy;
pub mod memory;
pub mod shapes;
pub mod speed;

use anyhow::{anyhow, Result};
use ratewarden_core::PolicyKind;
use serde::Serialize;

/// The reference limit: `REFERENCE` is 100 per 1000 ms.
pub const REFERENCE_LIMIT: u64 = 100;
/// The reference window.
pub const REFERENCE_WINDOW_MS: u64 = 1000;

/// The most distinct keys a bench run takes: the speed table's contenders
/// hold them all at once, about 450 bytes per key together (7.5 GB at
/// this bound).
pub const MAX_KEYS: usize = 1 << 24;

/// Checks a size given by `flag`: between 1 and `max`, else an error that
/// names the flag and its range.
pub fn check_size(flag: &str, value: usize, max: usize) -> Result<()> {
    anyhow::ensure!(
        (1..=max).contains(&value),
        "{flag} must be between 1 and {max}, not {value}"
    );
    Ok(())
}

/// Looks a policy up by registry name, with an error listing the names.
pub fn contender_policy(name: &str) -> Result<PolicyKind> {
    name.parse::<PolicyKind>().map_err(|_| {
        let known: Vec<&str> = PolicyKind::ALL.iter().map(|k| k.name()).collect();
        anyhow!(
            "unknown policy `{name}`; choose one of: {}",
            known.join(", ")
        )
    })
}

/// One row of the bench table: `policy` (a registry name, `governor`,
/// `baseline-hashmap` or `baseline-atomic`), `workload`, and the columns
/// that apply.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Row {
    /// A registry name, `governor`, `baseline-hashmap` or `baseline-atomic`.
    pub policy: String,
    /// A speed workload or an accuracy shape.
    pub workload: String,
    /// Median nanoseconds per decision over the repetitions (wall clock
    /// over all threads for the threaded workload).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ns_per_decision: Option<f64>,
    /// Decisions per second at that median.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decisions_per_sec: Option<f64>,
    /// How the speed rows get time: `supplied` (every contender reads a
    /// millisecond counter the benchmark advances; no system clock call).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub time_source: Option<&'static str>,
    /// Threads deciding at once.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub threads: Option<usize>,
    /// Keys held after the run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub entries_tracked: Option<usize>,
    /// Resident-memory growth per key for the workload's key count,
    /// measured in a fresh process.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes_per_key: Option<f64>,
    /// Requests in the accuracy shape.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub requests: Option<u64>,
    /// Requests admitted where the exact log refused, in percent of all.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub false_admit_pct: Option<f64>,
    /// Requests refused where the exact log admitted, in percent of all.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub false_reject_pct: Option<f64>,
    /// The most admitted for one key in any window, over the limit.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_in_window_ratio: Option<f64>,
}
