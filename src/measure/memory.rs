//! Bytes per key, measured as the growth of resident memory in a fresh
//! process that inserts the keys and nothing else.
//!
//! A fresh process per contender keeps one contender's freed memory from
//! flattering the next. The keys are generated before the first reading,
//! so only the store's own growth (tables, per-key allocations, allocator
//! overhead) is counted. Linux only: it reads `/proc/self/status`.

use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use super::speed::{insert_all, key_set, Contender, Governor, Store};
use super::{check_size, contender_policy, MAX_KEYS, REFERENCE_LIMIT, REFERENCE_WINDOW_MS};
use ratewarden_core::{
    FixedWindow, Gcra, PolicyKind, SlidingLog, SlidingWindowCounter, TokenBucket,
};

/// What the child process reports.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Footprint {
    /// Resident-memory growth divided by the keys inserted.
    pub bytes_per_key: f64,
    /// Keys the store held afterwards.
    pub entries_tracked: usize,
}

/// Resident memory of this process, in bytes.
fn resident_bytes() -> Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")
        .context("reading /proc/self/status (memory is measured on Linux only)")?;
    let line = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .context("no VmRSS line in /proc/self/status")?;
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("unreadable line `{line}`"))?;
    Ok(kib * 1024)
}

fn grow<C: Contender>(make: impl FnOnce() -> C, keys: &[u64]) -> Result<Footprint> {
    let before = resident_bytes()?;
    let contender = make();
    insert_all(&contender, keys);
    let after = resident_bytes()?;
    let entries_tracked = contender.entries_tracked();
    // Keep the store alive until after the reading.
    drop(contender);
    Ok(Footprint {
        bytes_per_key: after.saturating_sub(before) as f64 / keys.len().max(1) as f64,
        entries_tracked,
    })
}

/// Measures `contender` (a registry name or `governor`) in this process;
/// the hidden `bench-memory` subcommand calls it.
pub fn measure_here(contender: &str, keys: usize) -> Result<Footprint> {
    check_size("--keys", keys, MAX_KEYS)?;
    let key_list = key_set(keys);
    let (l, w) = (REFERENCE_LIMIT, REFERENCE_WINDOW_MS);
    // Room for every key: the point is the footprint, not the bound.
    let max_keys = keys.max(1) * 2;
    if contender == "governor" {
        return grow(
            || Governor::new(l as u32, w).expect("the reference quota is valid"),
            &key_list,
        );
    }
    let kind: PolicyKind = contender_policy(contender)?;
    let err = "the reference configuration is valid";
    match kind {
        PolicyKind::FixedWindow => grow(
            || Store::new(FixedWindow::new(l, w).expect(err), max_keys),
            &key_list,
        ),
        PolicyKind::SlidingWindowCounter => grow(
            || Store::new(SlidingWindowCounter::new(l, w).expect(err), max_keys),
            &key_list,
        ),
        PolicyKind::SlidingLog => grow(
            || Store::new(SlidingLog::new(l, w).expect(err), max_keys),
            &key_list,
        ),
        PolicyKind::TokenBucket => grow(
            || Store::new(TokenBucket::new(l, w, None).expect(err), max_keys),
            &key_list,
        ),
        PolicyKind::Gcra => grow(
            || Store::new(Gcra::new(l, w, None).expect(err), max_keys),
            &key_list,
        ),
    }
}

/// Measures `contender` in a fresh copy of this program.
pub fn measure_in_child(contender: &str, keys: usize) -> Result<Footprint> {
    // On Linux, this process's own program, even once its path holds
    // another file or none (`cargo build` replacing it mid-run), where
    // current_exe's path would start that other file, or nothing.
    #[cfg(target_os = "linux")]
    let exe = std::path::PathBuf::from("/proc/self/exe");
    #[cfg(not(target_os = "linux"))]
    let exe = std::env::current_exe()
        .context("finding this program to measure memory in a fresh process")?;
    let mut child = Command::new(exe)
        .args([
            "bench-memory",
            "--contender",
            contender,
            "--keys",
            &keys.to_string(),
            "--while-stdin-open",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting the memory measurement process")?;
    // The pipe's end is held until the child has ended: once this process
    // is gone (killed alone, `kill -INT PID`, where a terminal's Ctrl-C
    // reaches both), it closes and the child stops rather than fill
    // memory for nobody.
    let _held = child.stdin.take();
    let output = child
        .wait_with_output()
        .context("waiting for the memory measurement process")?;
    if !output.status.success() {
        let said = String::from_utf8_lossy(&output.stderr);
        let said = said.trim();
        #[cfg(unix)]
        let killed = std::os::unix::process::ExitStatusExt::signal(&output.status) == Some(9);
        #[cfg(not(unix))]
        let killed = false;
        let hint = if killed {
            format!(
                ", most likely from the kernel's out-of-memory killer: give --keys fewer than \
                 {keys}"
            )
        } else {
            String::new()
        };
        bail!(
            "measuring memory of {contender} with {keys} keys failed: its process ended with \
             {}{hint}{}{said}",
            output.status,
            if said.is_empty() { "" } else { ": " },
        );
    }
    serde_json::from_slice(&output.stdout).context("reading the memory measurement")
}
