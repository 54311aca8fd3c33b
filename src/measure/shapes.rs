//! Seeded, reproducible traffic shapes for the accuracy table and
//! `ratewarden simulate`.
//!
//! A shape is a list of requests `(key, at_ms)`, each of cost 1, sorted by
//! time. The same shape, parameters and seed give the same list on every
//! run of the same build: the generator is `rand`'s seeded `StdRng`, and the
//! floating-point draws only place requests in time; every decision made on
//! them stays integer-only.

use std::fmt;
use std::str::FromStr;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Exp, Pareto, Poisson};

/// The traffic shapes, by their names on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Shape {
    /// One key, Poisson arrivals at 0.8 times the limit.
    Steady08,
    /// One key, Poisson arrivals at twice the limit.
    Steady2,
    /// One key: a full budget in the last millisecond before a window edge
    /// and again in the first millisecond after it, every fourth window.
    BoundaryAttack,
    /// One key: bursts arriving as a Poisson process (one per window on
    /// average), each a Poisson-sized number of requests spread over a
    /// twentieth of the window.
    PoissonBursts,
    /// 10,000 keys, each a Poisson process whose rate is drawn from a Pareto
    /// distribution (a few keys far above the limit, most far below).
    HeavyTailKeys,
}

/// The parameters every shape is generated from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShapeParams {
    /// The policy limit the shape is scaled to, per `window_ms`.
    pub limit: u64,
    /// The policy window the shape is scaled to.
    pub window_ms: u64,
    /// How long the traffic lasts; requests fall in `0..duration_ms`.
    pub duration_ms: u64,
    /// The random seed.
    pub seed: u64,
}

/// One request of cost 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// The key the request is made for.
    pub key: u64,
    /// When the request is made.
    pub at_ms: u64,
}

/// The number of keys of [`Shape::HeavyTailKeys`].
pub const HEAVY_TAIL_KEYS: u64 = 10_000;

/// The most requests a shape may be asked for, by its expected count:
/// 20 million requests hold 320 MB, and each policy compared keeps a
/// decision per request and decides them all.
pub const MAX_REQUESTS: u64 = 20_000_000;

/// Each key's rate in [`Shape::HeavyTailKeys`] is Pareto-distributed with
/// this shape and a scale of [`HEAVY_TAIL_SCALE`] times the limit's rate.
const HEAVY_TAIL_SHAPE: f64 = 1.16;
const HEAVY_TAIL_SCALE: f64 = 0.01;

impl Shape {
    /// Every shape, in the table's order.
    pub const ALL: [Shape; 5] = [
        Shape::Steady08,
        Shape::Steady2,
        Shape::BoundaryAttack,
        Shape::PoissonBursts,
        Shape::HeavyTailKeys,
    ];

    /// The shape's name on the command line and in the table.
    pub const fn name(self) -> &'static str {
        match self {
            Shape::Steady08 => "steady-0.8x",
            Shape::Steady2 => "steady-2x",
            Shape::BoundaryAttack => "boundary-attack",
            Shape::PoissonBursts => "poisson-bursts",
            Shape::HeavyTailKeys => "heavy-tail-keys",
        }
    }

    /// Whether the shape draws random numbers (the boundary attack is
    /// the same for every seed).
    pub const fn is_seeded(self) -> bool {
        !matches!(self, Shape::BoundaryAttack)
    }

    /// How many requests the shape generates for `p`: the boundary
    /// attack's exact count, the other shapes' mean (the heavy tail's
    /// without its cap, so never below the mean). What callers bound by
    /// [`MAX_REQUESTS`] before generating.
    pub fn expected_requests(self, p: &ShapeParams) -> f64 {
        // Requests per window at the limit's rate, over the duration.
        let windows = p.duration_ms as f64 / p.window_ms as f64;
        let at_limit = p.limit as f64 * windows;
        match self {
            Shape::Steady08 => 0.8 * at_limit,
            Shape::Steady2 => 2.0 * at_limit,
            Shape::BoundaryAttack => {
                // Edges at window_ms, 5 window_ms, 9 window_ms, ... below
                // the duration.
                let edges = match p.duration_ms.checked_sub(p.window_ms) {
                    Some(after_first) if after_first > 0 => {
                        (after_first - 1) / p.window_ms.saturating_mul(4) + 1
                    }
                    _ => 0,
                };
                2.0 * p.limit as f64 * edges as f64
            }
            // One burst per window, of 0.6 times the limit on average.
            Shape::PoissonBursts => 0.6 * at_limit,
            Shape::HeavyTailKeys => {
                let pareto_mean = HEAVY_TAIL_SCALE * HEAVY_TAIL_SHAPE / (HEAVY_TAIL_SHAPE - 1.0);
                HEAVY_TAIL_KEYS as f64 * pareto_mean * at_limit
            }
        }
    }

    /// Generates the shape's requests, sorted by time (ties keep the order
    /// they were generated in, so the list is fully determined by the seed).
    pub fn generate(self, p: &ShapeParams) -> Vec<Request> {
        let mut rng = StdRng::seed_from_u64(p.seed);
        // Rates are in requests per millisecond.
        let limit_rate = p.limit as f64 / p.window_ms as f64;
        let mut out = match self {
            Shape::Steady08 => poisson_process(&mut rng, 0, 0.8 * limit_rate, 0, p.duration_ms),
            Shape::Steady2 => poisson_process(&mut rng, 0, 2.0 * limit_rate, 0, p.duration_ms),
            Shape::BoundaryAttack => boundary_attack(p),
            Shape::PoissonBursts => poisson_bursts(&mut rng, p, limit_rate),
            Shape::HeavyTailKeys => heavy_tail_keys(&mut rng, p, limit_rate),
        };
        out.sort_by_key(|r| r.at_ms);
        out
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Shape {
    type Err = String;

    fn from_str(name: &str) -> Result<Self, String> {
        Shape::ALL
            .into_iter()
            .find(|s| s.name() == name)
            .ok_or_else(|| {
                let known: Vec<&str> = Shape::ALL.iter().map(|s| s.name()).collect();
                format!(
                    "unknown shape `{name}`; choose one of: {}",
                    known.join(", ")
                )
            })
    }
}

/// Poisson arrivals for `key` at `rate_per_ms` in `start_ms..end_ms`.
fn poisson_process(
    rng: &mut StdRng,
    key: u64,
    rate_per_ms: f64,
    start_ms: u64,
    end_ms: u64,
) -> Vec<Request> {
    let mut out = Vec::new();
    if rate_per_ms <= 0.0 || !rate_per_ms.is_finite() {
        return out;
    }
    let gap = Exp::new(rate_per_ms).expect("a positive, finite rate");
    let mut t = start_ms as f64;
    loop {
        t += gap.sample(rng);
        if t >= end_ms as f64 {
            return out;
        }
        out.push(Request {
            key,
            at_ms: t as u64,
        });
    }
}

/// `limit` requests at the last millisecond before the edge of windows
/// 1, 5, 9, ... and `limit` more at the edge itself: a fixed window admits
/// both, twice the limit within two milliseconds. Four windows between
/// attacks let every policy recover fully before the next one.
fn boundary_attack(p: &ShapeParams) -> Vec<Request> {
    let mut out = Vec::new();
    let period = p.window_ms.saturating_mul(4);
    let mut edge = p.window_ms;
    while edge < p.duration_ms {
        for at_ms in [edge - 1, edge] {
            out.extend((0..p.limit).map(|_| Request { key: 0, at_ms }));
        }
        edge = edge.saturating_add(period);
    }
    out
}

/// Bursts start as a Poisson process, one per window on average; a burst
/// holds a Poisson-distributed number of requests (mean 0.6 times the
/// limit) placed uniformly over a twentieth of the window.
fn poisson_bursts(rng: &mut StdRng, p: &ShapeParams, limit_rate: f64) -> Vec<Request> {
    let starts = poisson_process(rng, 0, limit_rate / p.limit.max(1) as f64, 0, p.duration_ms);
    let size = Poisson::new((0.6 * p.limit as f64).max(0.1)).expect("a positive mean");
    let spread_ms = (p.window_ms / 20).max(1);
    let mut out = Vec::new();
    for start in starts {
        let n = size.sample(rng) as u64;
        for _ in 0..n {
            let at_ms = start.at_ms + rng.random_range(0..spread_ms);
            if at_ms < p.duration_ms {
                out.push(Request { key: 0, at_ms });
            }
        }
    }
    out
}

/// Each key's rate is Pareto-distributed with shape 1.16 (the "80/20"
/// shape) and scale a hundredth of the limit's rate, capped at five times
/// the limit so one key cannot dominate the run's length.
fn heavy_tail_keys(rng: &mut StdRng, p: &ShapeParams, limit_rate: f64) -> Vec<Request> {
    let Ok(rates) = Pareto::new(HEAVY_TAIL_SCALE * limit_rate, HEAVY_TAIL_SHAPE) else {
        // A limit of 0 (a zero rate): no key offers anything.
        return Vec::new();
    };
    let mut out = Vec::new();
    for key in 0..HEAVY_TAIL_KEYS {
        let rate = rates.sample(rng).min(5.0 * limit_rate);
        out.extend(poisson_process(rng, key, rate, 0, p.duration_ms));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(seed: u64) -> ShapeParams {
        ShapeParams {
            limit: 100,
            window_ms: 1000,
            duration_ms: 20_000,
            seed,
        }
    }

    #[test]
    fn shapes_are_reproducible_from_the_seed_and_differ_between_seeds() {
        for shape in Shape::ALL {
            let a = shape.generate(&params(7));
            assert_eq!(a, shape.generate(&params(7)), "{shape}");
            if shape != Shape::BoundaryAttack {
                assert_ne!(a, shape.generate(&params(8)), "{shape}");
            }
        }
    }

    #[test]
    fn shapes_are_sorted_and_inside_the_duration() {
        for shape in Shape::ALL {
            let requests = shape.generate(&params(1));
            assert!(!requests.is_empty(), "{shape}");
            assert!(
                requests.windows(2).all(|w| w[0].at_ms <= w[1].at_ms),
                "{shape}"
            );
            assert!(requests.iter().all(|r| r.at_ms < 20_000), "{shape}");
        }
    }

    #[test]
    fn steady_rates_are_near_their_multiple_of_the_limit() {
        // 20 windows of 100: 1600 and 4000 expected; a Poisson count's
        // standard deviation is its square root (40 and 63).
        let slow = Shape::Steady08.generate(&params(3)).len();
        let fast = Shape::Steady2.generate(&params(3)).len();
        assert!((1400..1800).contains(&slow), "{slow}");
        assert!((3700..4300).contains(&fast), "{fast}");
    }

    #[test]
    fn boundary_attack_puts_a_full_budget_either_side_of_an_edge() {
        let requests = Shape::BoundaryAttack.generate(&params(0));
        let at = |t| requests.iter().filter(|r| r.at_ms == t).count();
        assert_eq!((at(999), at(1000)), (100, 100));
        assert_eq!((at(4999), at(5000)), (100, 100));
        assert_eq!(requests.len(), 5 * 200);
    }

    #[test]
    fn heavy_tail_keys_spread_over_many_keys_with_a_heavy_tail() {
        let requests = Shape::HeavyTailKeys.generate(&params(5));
        let mut per_key = std::collections::HashMap::new();
        for r in &requests {
            *per_key.entry(r.key).or_insert(0u64) += 1;
        }
        assert!(per_key.len() > 5_000 && per_key.keys().all(|&k| k < HEAVY_TAIL_KEYS));
        let mut counts: Vec<u64> = per_key.into_values().collect();
        counts.sort_unstable();
        let median = counts[counts.len() / 2];
        let top = *counts.last().unwrap();
        // The busiest key is capped at five times the limit over 20 s.
        assert!(
            top > 50 * median && top <= 11_000,
            "median {median}, top {top}"
        );
    }

    #[test]
    fn expected_counts_match_what_the_shapes_generate() {
        // 200 windows: the steady shapes land within a few percent of
        // their means, and the bursts (200 of them, each of a random
        // size) within 15%; the heavy tail's estimate (without the cap)
        // is above what it generates, never below.
        let p = ShapeParams {
            duration_ms: 200_000,
            ..params(11)
        };
        for shape in Shape::ALL {
            let expected = shape.expected_requests(&p);
            let got = shape.generate(&p).len() as f64;
            match shape {
                Shape::BoundaryAttack => assert_eq!(got, expected),
                Shape::HeavyTailKeys => {
                    assert!(got <= expected && got > 0.5 * expected, "{got} {expected}")
                }
                Shape::PoissonBursts => {
                    assert!((got / expected - 1.0).abs() < 0.15, "{got} {expected}")
                }
                _ => assert!(
                    (got / expected - 1.0).abs() < 0.05,
                    "{shape}: {got} {expected}"
                ),
            }
        }
        // Boundary attacks at 1000 and 5000 ms: none before the first
        // edge, one for a duration just past it, two just past 5000.
        let attacks = |duration_ms| {
            Shape::BoundaryAttack.expected_requests(&ShapeParams {
                duration_ms,
                ..params(0)
            }) / 200.0
        };
        assert_eq!((attacks(1000), attacks(1001)), (0.0, 1.0));
        assert_eq!((attacks(5000), attacks(5001)), (1.0, 2.0));
    }

    #[test]
    fn a_zero_limit_generates_nothing_and_does_not_panic() {
        let p = ShapeParams {
            limit: 0,
            ..params(1)
        };
        for shape in Shape::ALL {
            assert!(shape.generate(&p).is_empty(), "{shape}");
            assert_eq!(shape.expected_requests(&p), 0.0, "{shape}");
        }
    }

    #[test]
    fn unknown_shapes_are_refused_with_the_known_names() {
        let err = "sawtooth".parse::<Shape>().unwrap_err();
        assert!(
            err.contains("sawtooth") && err.contains("boundary-attack"),
            "{err}"
        );
    }
}
