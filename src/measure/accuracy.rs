//! Accuracy against the exact `sliding-log`, and the series
//! `ratewarden simulate` draws.

use std::collections::{HashMap, VecDeque};

use anyhow::{Context, Result};
use ratewarden_core::{MemoryOptions, MemoryStore, PolicyConfig, PolicyKind};

use super::shapes::Request;

/// How one policy's decisions compare with the exact log on one shape.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Accuracy {
    /// Requests decided.
    pub requests: u64,
    /// Requests admitted by the policy.
    pub admitted: u64,
    /// Requests the policy admitted and the log refused.
    pub false_admits: u64,
    /// Requests the policy refused and the log admitted.
    pub false_rejects: u64,
    /// The most requests of one key admitted in any `window_ms`
    /// consecutive milliseconds, divided by `limit`.
    pub max_in_window_ratio: f64,
}

impl Accuracy {
    /// False admits as a percentage of all requests.
    pub fn false_admit_pct(&self) -> f64 {
        pct(self.false_admits, self.requests)
    }

    /// False rejects as a percentage of all requests.
    pub fn false_reject_pct(&self) -> f64 {
        pct(self.false_rejects, self.requests)
    }
}

fn pct(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        100.0 * part as f64 / whole as f64
    }
}

/// A store for the reference configuration shape: `limit` per `window_ms`,
/// burst equal to the limit for the buckets.
pub fn store_for(kind: PolicyKind, limit: u64, window_ms: u64) -> Result<MemoryStore> {
    let config = PolicyConfig::new(kind, limit, window_ms);
    // Room for every key of the largest shape, with headroom.
    let options = MemoryOptions {
        max_keys: 1 << 20,
        shards: 0,
    };
    MemoryStore::for_config(&config, options)
        .with_context(|| format!("configuring {kind} with limit {limit} per {window_ms} ms"))
}

/// Every decision of `kind` on `requests`, in order.
pub fn decisions(
    kind: PolicyKind,
    limit: u64,
    window_ms: u64,
    requests: &[Request],
) -> Result<Vec<bool>> {
    let store = store_for(kind, limit, window_ms)?;
    requests
        .iter()
        .map(|r| {
            store
                .decide(r.key, r.at_ms, 1)
                .map(|d| d.allowed)
                .with_context(|| format!("{kind} deciding key {} at {} ms", r.key, r.at_ms))
        })
        .collect()
}

/// Compares `policy`'s decisions with the exact log's (`reference`, the
/// decisions of `sliding-log` on the same requests).
pub fn compare(
    requests: &[Request],
    policy: &[bool],
    reference: &[bool],
    limit: u64,
    window_ms: u64,
) -> Accuracy {
    let mut acc = Accuracy {
        requests: requests.len() as u64,
        admitted: 0,
        false_admits: 0,
        false_rejects: 0,
        max_in_window_ratio: 0.0,
    };
    for (&mine, &exact) in policy.iter().zip(reference) {
        acc.admitted += u64::from(mine);
        acc.false_admits += u64::from(mine && !exact);
        acc.false_rejects += u64::from(!mine && exact);
    }
    let most = max_in_window(requests, policy, window_ms);
    acc.max_in_window_ratio = if limit == 0 {
        0.0
    } else {
        most as f64 / limit as f64
    };
    acc
}

/// The most admitted requests of one key within any `window_ms`
/// consecutive milliseconds (`t - window_ms < at <= t`).
pub fn max_in_window(requests: &[Request], admitted: &[bool], window_ms: u64) -> u64 {
    let mut recent: HashMap<u64, VecDeque<u64>> = HashMap::new();
    let mut most = 0;
    for (r, _) in requests.iter().zip(admitted).filter(|(_, &a)| a) {
        let times = recent.entry(r.key).or_default();
        while times.front().is_some_and(|&t| r.at_ms - t >= window_ms) {
            times.pop_front();
        }
        times.push_back(r.at_ms);
        most = most.max(times.len() as u64);
    }
    most
}

/// One time bucket of a simulation, for one policy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Point {
    /// The bucket's start.
    pub start_ms: u64,
    /// The bucket's end (exclusive): `bucket_ms` after its start, or the
    /// end of the run for a last bucket cut short.
    pub end_ms: u64,
    /// Requests offered in the bucket.
    pub offered: u64,
    /// Requests admitted in the bucket.
    pub admitted: u64,
    /// The highest count of admitted requests of the busiest key in the
    /// trailing `window_ms`, over the bucket.
    pub trailing_count: u64,
}

impl Point {
    /// Requests offered in the bucket, as a rate per second of the
    /// bucket's own length.
    pub fn offered_per_sec(&self) -> f64 {
        self.per_sec(self.offered)
    }

    /// Requests admitted in the bucket, as a rate per second of the
    /// bucket's own length.
    pub fn admitted_per_sec(&self) -> f64 {
        self.per_sec(self.admitted)
    }

    // One division of whole numbers, so that a rate that is whole prints
    // whole (adding a fraction per request would print 400.00000000000006).
    fn per_sec(&self, count: u64) -> f64 {
        (count as f64 * 1000.0) / (self.end_ms - self.start_ms) as f64
    }
}

/// The series of one policy over a shape, in buckets of `bucket_ms`.
/// The trailing-window count is that of the key with the most requests
/// (the only key, for the single-key shapes).
pub fn series(
    requests: &[Request],
    admitted: &[bool],
    window_ms: u64,
    duration_ms: u64,
    bucket_ms: u64,
) -> Vec<Point> {
    let buckets = duration_ms.div_ceil(bucket_ms) as usize;
    let mut points: Vec<Point> = (0..buckets as u64)
        .map(|i| Point {
            start_ms: i * bucket_ms,
            end_ms: ((i + 1) * bucket_ms).min(duration_ms),
            offered: 0,
            admitted: 0,
            trailing_count: 0,
        })
        .collect();
    let busiest = busiest_key(requests);
    let mut trailing: VecDeque<u64> = VecDeque::new();
    for (r, &a) in requests.iter().zip(admitted) {
        let Some(point) = points.get_mut((r.at_ms / bucket_ms) as usize) else {
            continue;
        };
        point.offered += 1;
        if a {
            point.admitted += 1;
        }
        if a && Some(r.key) == busiest {
            while trailing.front().is_some_and(|&t| r.at_ms - t >= window_ms) {
                trailing.pop_front();
            }
            trailing.push_back(r.at_ms);
            point.trailing_count = point.trailing_count.max(trailing.len() as u64);
        }
    }
    // A bucket without an admission still carries what the window holds at
    // its start: recompute the count there from the admitted times.
    let times: Vec<u64> = requests
        .iter()
        .zip(admitted)
        .filter(|(r, &a)| a && Some(r.key) == busiest)
        .map(|(r, _)| r.at_ms)
        .collect();
    for p in &mut points {
        let upto = times.partition_point(|&t| t <= p.start_ms);
        let from = times.partition_point(|&t| t + window_ms <= p.start_ms);
        p.trailing_count = p.trailing_count.max((upto - from) as u64);
    }
    points
}

fn busiest_key(requests: &[Request]) -> Option<u64> {
    let mut counts: HashMap<u64, u64> = HashMap::new();
    for r in requests {
        *counts.entry(r.key).or_default() += 1;
    }
    // Ties go to the smallest key, so the choice does not depend on the
    // map's iteration order.
    counts
        .into_iter()
        .max_by_key(|&(k, n)| (n, std::cmp::Reverse(k)))
        .map(|(k, _)| k)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::measure::shapes::{Shape, ShapeParams};

    fn run(kind: PolicyKind, shape: Shape) -> Accuracy {
        let p = ShapeParams {
            limit: 100,
            window_ms: 1000,
            duration_ms: 20_000,
            seed: 11,
        };
        let requests = shape.generate(&p).unwrap();
        let exact = decisions(PolicyKind::SlidingLog, 100, 1000, &requests).unwrap();
        let mine = decisions(kind, 100, 1000, &requests).unwrap();
        compare(&requests, &mine, &exact, 100, 1000)
    }

    #[test]
    fn the_log_is_exact_on_every_shape() {
        for shape in Shape::ALL {
            let acc = run(PolicyKind::SlidingLog, shape);
            assert_eq!((acc.false_admits, acc.false_rejects), (0, 0), "{shape}");
            assert!(acc.max_in_window_ratio <= 1.0, "{shape}: {acc:?}");
        }
    }

    #[test]
    fn fixed_window_admits_twice_the_limit_across_an_edge() {
        let acc = run(PolicyKind::FixedWindow, Shape::BoundaryAttack);
        assert_eq!(acc.max_in_window_ratio, 2.0);
        // Each attack: the log refuses the 100 after the edge; the fixed
        // window admits them. Half the requests are false admits.
        assert_eq!(acc.false_admits * 2, acc.requests);
        assert_eq!(acc.false_rejects, 0);
    }

    #[test]
    fn the_window_counter_holds_the_boundary_attack_to_the_limit() {
        let acc = run(PolicyKind::SlidingWindowCounter, Shape::BoundaryAttack);
        assert_eq!(acc.max_in_window_ratio, 1.0);
        assert_eq!((acc.false_admits, acc.false_rejects), (0, 0));
    }

    #[test]
    fn metrics_count_each_kind_of_disagreement() {
        let requests: Vec<Request> = [0, 1, 2, 3].map(|at_ms| Request { key: 1, at_ms }).to_vec();
        let acc = compare(
            &requests,
            &[true, true, false, true],
            &[true, false, true, true],
            2,
            10,
        );
        assert_eq!(
            (
                acc.requests,
                acc.admitted,
                acc.false_admits,
                acc.false_rejects
            ),
            (4, 3, 1, 1)
        );
        assert!((acc.false_admit_pct() - 25.0).abs() < 1e-9);
        assert_eq!(acc.max_in_window_ratio, 1.5);
        // A window of 2 ms holds at most two of the admitted times 0, 1, 3.
        assert_eq!(max_in_window(&requests, &[true, true, false, true], 2), 2);
    }

    #[test]
    fn series_count_offered_and_admitted_per_bucket() {
        let requests: Vec<Request> = [0, 0, 5, 12]
            .map(|at_ms| Request { key: 3, at_ms })
            .to_vec();
        let points = series(&requests, &[true, false, true, true], 10, 20, 10);
        assert_eq!(points.len(), 2);
        // Three offered and two admitted in 10 ms: 300 and 200 per second.
        assert_eq!(points[0].offered_per_sec(), 300.0);
        assert_eq!(points[0].admitted_per_sec(), 200.0);
        assert_eq!(points[0].trailing_count, 2);
        // At 12 the admission at 0 has left the window (12 - 0 >= 10).
        assert_eq!(points[1].trailing_count, 2);
    }

    #[test]
    fn a_last_bucket_cut_short_is_a_rate_over_its_own_length() {
        let requests: Vec<Request> = [0, 10, 11].map(|at_ms| Request { key: 3, at_ms }).to_vec();
        // 12 ms in buckets of 10: the second bucket is 10..12, 2 ms long.
        let points = series(&requests, &[true, true, false], 10, 12, 10);
        assert_eq!((points[1].start_ms, points[1].end_ms), (10, 12));
        assert_eq!(points[1].offered_per_sec(), 1000.0);
        assert_eq!(points[1].admitted_per_sec(), 500.0);
        // A rate that is whole prints whole: 6 requests in 15 ms.
        let requests: Vec<Request> = (0..6).map(|at_ms| Request { key: 3, at_ms }).collect();
        let points = series(&requests, &[true; 6], 300, 15, 15);
        assert_eq!(points[0].offered_per_sec().to_string(), "400");
    }
}
