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
use rand_distr::{Binomial, Distribution, Exp, Pareto, Poisson};

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

/// The most requests one draw may generate, whatever its seed: callers
/// bound the expected count by [`MAX_REQUESTS`], but a draw can land far
/// above its mean (a `poisson-bursts` burst holds 0.6 times the limit
/// however rare bursts are, so one early burst of a large limit can hold
/// more than the whole run's mean), and memory must stay bounded. A
/// quarter above the bound on the mean, so that a draw near that bound
/// (whose count strays from its mean by a few thousand) is not stopped.
pub const MAX_GENERATED: usize = MAX_REQUESTS as usize / 4 * 5;

/// A draw went past [`MAX_GENERATED`] requests, and was stopped there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooManyRequests;

/// The requests of a draw, at most `cap` of them.
struct Sink {
    requests: Vec<Request>,
    cap: usize,
}

impl Sink {
    /// Adds `request`, unless `cap` are held already.
    fn push(&mut self, request: Request) -> Result<(), TooManyRequests> {
        if self.requests.len() >= self.cap {
            return Err(TooManyRequests);
        }
        self.requests.push(request);
        Ok(())
    }
}

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
    /// they were generated in, so the list is fully determined by the seed);
    /// stopped past [`MAX_GENERATED`].
    pub fn generate(self, p: &ShapeParams) -> Result<Vec<Request>, TooManyRequests> {
        self.generate_at_most(p, MAX_GENERATED)
    }

    /// [`Shape::generate`], stopped past `cap` requests.
    fn generate_at_most(
        self,
        p: &ShapeParams,
        cap: usize,
    ) -> Result<Vec<Request>, TooManyRequests> {
        let mut rng = StdRng::seed_from_u64(p.seed);
        // Rates are in requests per millisecond.
        let limit_rate = p.limit as f64 / p.window_ms as f64;
        let mut out = Sink {
            requests: Vec::new(),
            cap,
        };
        match self {
            Shape::Steady08 => {
                poisson_process(&mut rng, 0, 0.8 * limit_rate, p.duration_ms, &mut out)?
            }
            Shape::Steady2 => {
                poisson_process(&mut rng, 0, 2.0 * limit_rate, p.duration_ms, &mut out)?
            }
            Shape::BoundaryAttack => boundary_attack(p, &mut out)?,
            Shape::PoissonBursts => poisson_bursts(&mut rng, p, limit_rate, &mut out)?,
            Shape::HeavyTailKeys => heavy_tail_keys(&mut rng, p, limit_rate, &mut out)?,
        }
        let mut out = out.requests;
        out.sort_by_key(|r| r.at_ms);
        Ok(out)
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

/// Poisson arrivals for `key` at `rate_per_ms` in `0..end_ms`, added to
/// `out`.
fn poisson_process(
    rng: &mut StdRng,
    key: u64,
    rate_per_ms: f64,
    end_ms: u64,
    out: &mut Sink,
) -> Result<(), TooManyRequests> {
    if rate_per_ms <= 0.0 || !rate_per_ms.is_finite() {
        return Ok(());
    }
    let gap = Exp::new(rate_per_ms).expect("a positive, finite rate");
    let mut t = 0.0;
    loop {
        t += gap.sample(rng);
        if t >= end_ms as f64 {
            return Ok(());
        }
        out.push(Request {
            key,
            at_ms: t as u64,
        })?;
    }
}

/// `limit` requests at the last millisecond before the edge of windows
/// 1, 5, 9, ... and `limit` more at the edge itself: a fixed window admits
/// both, twice the limit within two milliseconds. Four windows between
/// attacks let every policy recover fully before the next one.
fn boundary_attack(p: &ShapeParams, out: &mut Sink) -> Result<(), TooManyRequests> {
    let period = p.window_ms.saturating_mul(4);
    let mut edge = p.window_ms;
    while edge < p.duration_ms {
        for at_ms in [edge - 1, edge] {
            for _ in 0..p.limit {
                out.push(Request { key: 0, at_ms })?;
            }
        }
        edge = edge.saturating_add(period);
    }
    Ok(())
}

/// Bursts start as a Poisson process, one per window on average; a burst
/// holds a Poisson-distributed number of requests (mean 0.6 times the
/// limit) placed uniformly over a twentieth of the window.
fn poisson_bursts(
    rng: &mut StdRng,
    p: &ShapeParams,
    limit_rate: f64,
    out: &mut Sink,
) -> Result<(), TooManyRequests> {
    let mut starts = Sink {
        requests: Vec::new(),
        cap: out.cap,
    };
    poisson_process(
        rng,
        0,
        limit_rate / p.limit.max(1) as f64,
        p.duration_ms,
        &mut starts,
    )?;
    let size = Poisson::new((0.6 * p.limit as f64).max(0.1)).expect("a positive mean");
    let spread_ms = (p.window_ms / 20).max(1);
    for start in starts.requests {
        let n = size.sample(rng) as u64;
        burst(rng, start.at_ms, n, spread_ms, p.duration_ms, out)?;
    }
    Ok(())
}

/// Adds the requests of one burst of `n`, placed uniformly in
/// `start_ms..start_ms + spread_ms`, that fall before `end_ms`.
///
/// A burst of at most [`MAX_GENERATED`] (any that a draw could hold
/// whole) is drawn request by request, as it always was, so every draw
/// that succeeded before gives the same requests, whatever its cap. A
/// larger one that crosses the end draws only the requests kept: their
/// count binomial (each of the `n` falls before the end with the share of
/// the spread that does) and their times uniform over that share, so that
/// the work is bounded by what is kept, not by a burst of billions most of
/// which fall past the end. A burst wholly before the end that the cap
/// cannot hold is refused before any draw.
fn burst<R: Rng + ?Sized>(
    rng: &mut R,
    start_ms: u64,
    n: u64,
    spread_ms: u64,
    end_ms: u64,
    out: &mut Sink,
) -> Result<(), TooManyRequests> {
    let room = (out.cap - out.requests.len()) as u64;
    let inside_ms = end_ms.saturating_sub(start_ms).min(spread_ms);
    if inside_ms == spread_ms && n > room {
        return Err(TooManyRequests);
    }
    if n <= MAX_GENERATED as u64 || inside_ms == spread_ms {
        for _ in 0..n {
            let at_ms = start_ms + rng.random_range(0..spread_ms);
            if at_ms < end_ms {
                out.push(Request { key: 0, at_ms })?;
            }
        }
        return Ok(());
    }
    let share = inside_ms as f64 / spread_ms as f64;
    let kept = Binomial::new(n, share)
        .expect("a share between 0 and 1")
        .sample(rng);
    if kept > room {
        return Err(TooManyRequests);
    }
    for _ in 0..kept {
        let at_ms = start_ms + rng.random_range(0..inside_ms);
        out.push(Request { key: 0, at_ms })?;
    }
    Ok(())
}

/// Each key's rate is Pareto-distributed with shape 1.16 (the "80/20"
/// shape) and scale a hundredth of the limit's rate, capped at five times
/// the limit so one key cannot dominate the run's length.
fn heavy_tail_keys(
    rng: &mut StdRng,
    p: &ShapeParams,
    limit_rate: f64,
    out: &mut Sink,
) -> Result<(), TooManyRequests> {
    let Ok(rates) = Pareto::new(HEAVY_TAIL_SCALE * limit_rate, HEAVY_TAIL_SHAPE) else {
        // A limit of 0 (a zero rate): no key offers anything.
        return Ok(());
    };
    for key in 0..HEAVY_TAIL_KEYS {
        let rate = rates.sample(rng).min(5.0 * limit_rate);
        poisson_process(rng, key, rate, p.duration_ms, out)?;
    }
    Ok(())
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

    /// A draw far above its mean is stopped at the cap, not held whole:
    /// one burst holds about 0.6 times the limit however rare bursts are.
    /// The same draw under a cap it fits is whole.
    #[test]
    fn a_draw_past_the_cap_is_stopped() {
        let p = ShapeParams {
            limit: 10_000,
            window_ms: 20_000,
            duration_ms: 1_000,
            seed: 0,
        };
        // A seed whose draw has a burst well within the run: most have
        // none in a twentieth of a window (the mean is 300 requests).
        let (seed, whole) = (0..200)
            .find_map(|seed| {
                let p = ShapeParams { seed, ..p };
                let drawn = Shape::PoissonBursts.generate(&p).unwrap();
                (drawn.len() > 500).then_some((seed, drawn))
            })
            .expect("a seed with a burst");
        let p = ShapeParams { seed, ..p };
        assert!(
            Shape::PoissonBursts.expected_requests(&p) < 500.0,
            "the mean is below the cap"
        );
        assert_eq!(
            Shape::PoissonBursts.generate_at_most(&p, 500),
            Err(TooManyRequests)
        );
        assert_eq!(
            Shape::PoissonBursts.generate_at_most(&p, whole.len()),
            Ok(whole)
        );
    }

    /// A seeded generator that counts the words drawn from it.
    struct Counting {
        inner: StdRng,
        words: u64,
    }

    impl rand::RngCore for Counting {
        fn next_u32(&mut self) -> u32 {
            self.words += 1;
            self.inner.next_u32()
        }
        fn next_u64(&mut self) -> u64 {
            self.words += 1;
            self.inner.next_u64()
        }
        fn fill_bytes(&mut self, dst: &mut [u8]) {
            self.words += dst.len().div_ceil(8) as u64;
            self.inner.fill_bytes(dst)
        }
    }

    /// A burst far above the cap that mostly falls past the end draws
    /// only what it keeps (a limit of 33 billion made a burst of about 20
    /// billion, drawn one by one for minutes, to keep a few percent); one
    /// wholly before the end is refused without a draw.
    #[test]
    fn a_burst_past_the_cap_draws_only_what_it_keeps() {
        let mut rng = Counting {
            inner: StdRng::seed_from_u64(86),
            words: 0,
        };
        let mut out = Sink {
            requests: Vec::new(),
            cap: 10_000,
        };
        // 100 million requests over 100 million ms, of which those in the
        // first 1,000 ms are kept: about 1,000.
        burst(&mut rng, 0, 100_000_000, 100_000_000, 1_000, &mut out).unwrap();
        let kept = out.requests.len() as u64;
        assert!((800..1_200).contains(&kept), "{kept}");
        assert!(out.requests.iter().all(|r| r.at_ms < 1_000));
        assert!(rng.words < 10 * kept, "{} words for {kept}", rng.words);

        rng.words = 0;
        let mut out = Sink {
            requests: Vec::new(),
            cap: 10_000,
        };
        assert_eq!(
            burst(&mut rng, 0, 100_000_000, 100, 1_000, &mut out),
            Err(TooManyRequests)
        );
        assert_eq!(rng.words, 0);
    }

    #[test]
    fn shapes_are_reproducible_from_the_seed_and_differ_between_seeds() {
        for shape in Shape::ALL {
            let a = shape.generate(&params(7)).unwrap();
            assert_eq!(a, shape.generate(&params(7)).unwrap(), "{shape}");
            if shape != Shape::BoundaryAttack {
                assert_ne!(a, shape.generate(&params(8)).unwrap(), "{shape}");
            }
        }
    }

    #[test]
    fn shapes_are_sorted_and_inside_the_duration() {
        for shape in Shape::ALL {
            let requests = shape.generate(&params(1)).unwrap();
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
        let slow = Shape::Steady08.generate(&params(3)).unwrap().len();
        let fast = Shape::Steady2.generate(&params(3)).unwrap().len();
        assert!((1400..1800).contains(&slow), "{slow}");
        assert!((3700..4300).contains(&fast), "{fast}");
    }

    #[test]
    fn boundary_attack_puts_a_full_budget_either_side_of_an_edge() {
        let requests = Shape::BoundaryAttack.generate(&params(0)).unwrap();
        let at = |t| requests.iter().filter(|r| r.at_ms == t).count();
        assert_eq!((at(999), at(1000)), (100, 100));
        assert_eq!((at(4999), at(5000)), (100, 100));
        assert_eq!(requests.len(), 5 * 200);
    }

    #[test]
    fn heavy_tail_keys_spread_over_many_keys_with_a_heavy_tail() {
        let requests = Shape::HeavyTailKeys.generate(&params(5)).unwrap();
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
            let got = shape.generate(&p).unwrap().len() as f64;
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
            assert!(shape.generate(&p).unwrap().is_empty(), "{shape}");
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
