//! The naive reference model: SPEC's rules written as plainly as possible,
//! with different state from the real policies (every window's count kept
//! in a map, the log as a plain list of requests), `retry_after_ms` found by
//! searching time and `remaining` by searching cost. Slow on purpose; only
//! the closed forms of the real policies are fast.

use std::collections::BTreeMap;

use ratewarden_core::{Decision, PolicyConfig, PolicyKind};

/// How far the searches may look before concluding "never".
const STEP_SEARCH_LIMIT_MS: u128 = 200_000;

#[derive(Debug, Clone, Default)]
struct KeyModel {
    /// fixed-window and sliding-window-counter: admitted cost per window
    /// start, for every window ever touched.
    windows: BTreeMap<u64, u64>,
    /// Window start (window policies), newest entry (log) or last refill
    /// (bucket): the recorded time of the clock-regression rule.
    recorded_ms: Option<u64>,
    /// sliding-log: every admitted request still inside the window.
    log: Vec<(u64, u64)>,
    /// token-bucket: tokens * W; gcra: tat.
    level: u128,
}

/// A store of naive keys under one configuration.
#[derive(Debug, Clone)]
pub struct Naive {
    config: PolicyConfig,
    keys: BTreeMap<u64, KeyModel>,
}

impl Naive {
    pub fn new(config: PolicyConfig) -> Self {
        Naive {
            config,
            keys: BTreeMap::new(),
        }
    }

    /// Decides a request; the wait and the remaining budget are found by
    /// search.
    pub fn decide(&mut self, key: u64, now_ms: u64, cost: u64) -> Decision {
        let model = self.keys.get(&key).cloned();
        let c = self.config;
        let mut state = model.unwrap_or_else(|| fresh(&c, now_ms));
        let admitted = apply(&c, &mut state, now_ms, cost);
        let remaining = largest_admissible(&c, &state, now_ms);
        let decision = if admitted {
            Decision::admitted(remaining)
        } else {
            let before = self
                .keys
                .get(&key)
                .cloned()
                .unwrap_or_else(|| fresh(&c, now_ms));
            Decision::refused(search_retry(&c, &before, now_ms, cost), remaining)
        };
        self.keys.insert(key, state);
        decision
    }
}

fn fresh(c: &PolicyConfig, now_ms: u64) -> KeyModel {
    let mut m = KeyModel::default();
    match c.policy {
        PolicyKind::TokenBucket => {
            m.level = u128::from(c.effective_burst()) * u128::from(c.window_ms);
            m.recorded_ms = Some(now_ms);
        }
        PolicyKind::Gcra => m.level = 0,
        _ => {}
    }
    m
}

/// Whether a request is admitted, updating the model as SPEC's pseudo-code
/// does (refusals and peeks included).
fn apply(c: &PolicyConfig, m: &mut KeyModel, now_ms: u64, cost: u64) -> bool {
    let (l, w) = (u128::from(c.limit), u128::from(c.window_ms));
    let cost_w = u128::from(cost);
    match c.policy {
        PolicyKind::FixedWindow | PolicyKind::SlidingWindowCounter => {
            let now = m.recorded_ms.map_or(now_ms, |r| now_ms.max(r));
            let window = now / c.window_ms * c.window_ms;
            m.recorded_ms = Some(window);
            let current = u128::from(*m.windows.get(&window).unwrap_or(&0));
            let estimate = if c.policy == PolicyKind::FixedWindow {
                current
            } else {
                let previous = if window >= c.window_ms {
                    u128::from(*m.windows.get(&(window - c.window_ms)).unwrap_or(&0))
                } else {
                    0
                };
                let elapsed = u128::from(now - window);
                previous * (w - elapsed) / w + current
            };
            let ok = estimate + cost_w <= l;
            if ok {
                *m.windows.entry(window).or_insert(0) += cost;
            }
            ok
        }
        PolicyKind::SlidingLog => {
            // The recorded time is the newest entry still in the log: SPEC
            // drops older entries as it counts, and a dropped entry no
            // longer records anything.
            let newest = m.log.last().map(|(s, _)| *s);
            let now = newest.map_or(now_ms, |r| now_ms.max(r));
            m.log.retain(|(s, _)| u128::from(*s) + w > u128::from(now));
            let used: u128 = m.log.iter().map(|(_, c)| u128::from(*c)).sum();
            let ok = used + cost_w <= l;
            if ok && cost > 0 {
                m.log.push((now, cost));
            }
            m.recorded_ms = m.log.last().map(|(s, _)| *s);
            ok
        }
        PolicyKind::TokenBucket => {
            let last = m.recorded_ms.unwrap_or(now_ms);
            let now = now_ms.max(last);
            let cap = u128::from(c.effective_burst()) * w;
            m.level = (m.level + u128::from(now - last) * l).min(cap);
            m.recorded_ms = Some(now);
            let ok = m.level >= cost_w * w;
            if ok {
                m.level -= cost_w * w;
            }
            ok
        }
        PolicyKind::Gcra => {
            let cap = u128::from(c.effective_burst()) * w;
            let now_l = u128::from(now_ms) * l;
            let base = m.level.max(now_l);
            let ok = base - now_l + cost_w * w <= cap;
            if ok {
                m.level = base + cost_w * w;
            }
            ok
        }
    }
}

fn admits(c: &PolicyConfig, m: &KeyModel, now_ms: u64, cost: u64) -> bool {
    apply(c, &mut m.clone(), now_ms, cost)
}

/// The largest cost admitted at `now_ms` without changing `m`: binary
/// search, admission being monotone in cost at one instant.
fn largest_admissible(c: &PolicyConfig, m: &KeyModel, now_ms: u64) -> u64 {
    let top = if c.policy.has_burst() {
        c.effective_burst()
    } else {
        c.limit
    };
    if !admits(c, m, now_ms, 0) {
        return 0;
    }
    let (mut lo, mut hi) = (0u64, top);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if admits(c, m, now_ms, mid) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

/// The smallest `d >= 1` at which the same request is admitted with no
/// other traffic, by stepping time one millisecond at a time; where the
/// numbers are too large to step, by binary search over stretches of time
/// in which admission can only go from refused to admitted (a whole window
/// for the sliding-window counter, all of time for the others).
fn search_retry(c: &PolicyConfig, m: &KeyModel, now_ms: u64, cost: u64) -> Option<u64> {
    let horizon = retry_horizon(c, m, now_ms);
    if horizon <= STEP_SEARCH_LIMIT_MS {
        return (1..=horizon as u64).find(|d| admits(c, m, now_ms + d, cost));
    }
    let admits_at = |d: u128| {
        admits(
            c,
            m,
            (u128::from(now_ms) + d).min(u128::from(u64::MAX)) as u64,
            cost,
        )
    };
    let mut segments = vec![(1u128, horizon)];
    if c.policy == PolicyKind::SlidingWindowCounter {
        let w = u128::from(c.window_ms);
        let now = u128::from(now_ms);
        // Windows are counted from the time the request is decided at,
        // which a clock regression moves up to the recorded time.
        let base = now.max(u128::from(m.recorded_ms.unwrap_or(0)));
        segments.clear();
        let mut start = 1;
        for k in 1..=3u128 {
            let edge = (base / w + k) * w - now;
            segments.push((start, edge - 1));
            start = edge;
        }
        segments.push((start, horizon));
    }
    for (lo, hi) in segments {
        if lo > hi || !admits_at(hi) {
            continue;
        }
        let (mut lo, mut hi) = (lo, hi);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if admits_at(mid) {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        return Some(u64::try_from(lo).unwrap_or(u64::MAX));
    }
    None
}

/// A time past which waiting longer cannot help: every window has
/// emptied, every log entry left, or the bucket refilled completely.
fn retry_horizon(c: &PolicyConfig, m: &KeyModel, now_ms: u64) -> u128 {
    let w = u128::from(c.window_ms);
    let regression = u128::from(m.recorded_ms.map_or(0, |r| r.saturating_sub(now_ms)));
    match c.policy {
        PolicyKind::TokenBucket | PolicyKind::Gcra => {
            let cap = u128::from(c.effective_burst()) * w;
            if c.limit == 0 {
                return 1;
            }
            let spent = if c.policy == PolicyKind::Gcra {
                m.level
                    .saturating_sub(u128::from(now_ms) * u128::from(c.limit))
            } else {
                cap
            };
            regression + spent.max(cap).div_ceil(u128::from(c.limit)) + 1
        }
        _ => regression + 3 * w + 1,
    }
}
