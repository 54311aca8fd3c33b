//! Speed workloads: the in-memory store, governor's keyed GCRA and a bare
//! hash map, on the same pre-generated key sequences and threads.
//!
//! Time source: every contender takes a supplied time, read from a shared
//! atomic counter of milliseconds on each decision (the store through
//! `now_ms`, governor through its `FakeRelativeClock`, the bare map through
//! `now_ms`). The first thread advances it by 1 ms every 4,096 decisions
//! (every decision, in `hot-key-every-ms`), so windows roll over during a
//! run without a system clock call in the loop.

use std::cell::RefCell;
use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use governor::clock::FakeRelativeClock;
use governor::middleware::NoOpMiddleware;
use governor::nanos::Nanos;
use governor::state::keyed::DashMapStateStore;
use governor::{Quota, RateLimiter};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Zipf};
use ratewarden_core::policy::Policy;
use ratewarden_core::{MemoryOptions, MemoryStore};
use rustc_hash::FxHashMap;

/// Decisions between two 1 ms steps of the supplied time, in every
/// workload but `hot-key-every-ms` (which steps it on every decision).
pub const DECISIONS_PER_MS: usize = 4096;

/// Something that decides one request of cost 1 per call.
pub trait Contender {
    /// Decides a request for `key`; true when admitted.
    fn check(&self, key: u64) -> bool;
    /// Moves the supplied time on by 1 ms.
    fn tick(&self);
    /// Keys held now.
    fn entries_tracked(&self) -> usize;
}

/// The in-memory store under one policy, with the supplied time.
pub struct Store<P: Policy> {
    store: MemoryStore<P>,
    now_ms: AtomicU64,
}

impl<P: Policy> Store<P> {
    /// A store for `policy` holding up to `max_keys` keys, its time at 1 ms.
    pub fn new(policy: P, max_keys: usize) -> Self {
        // The default store's shard count whatever `--keys` is: a small
        // store would pick fewer shards, and the threaded rows would then
        // measure fewer locks than a store of a million keys has.
        let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
        let shards = (cores * 4).max(16);
        let options = MemoryOptions {
            // Room for a shard's worth of keys in every shard, however few
            // keys the run has: the keys fall into shards by a randomly
            // seeded hash, and a handful over 16 shards would fill one whose
            // share of `max_keys` is two.
            max_keys: max_keys.max(shards * MemoryOptions::MIN_KEYS_PER_AUTO_SHARD),
            shards,
        };
        Store {
            store: MemoryStore::new(policy, options),
            now_ms: AtomicU64::new(1),
        }
    }
}

impl<P: Policy> Contender for Store<P> {
    #[inline]
    fn check(&self, key: u64) -> bool {
        match self
            .store
            .decide(key, self.now_ms.load(Ordering::Relaxed), 1)
        {
            Ok(d) => d.allowed,
            // The runs stay far below `max_keys`, so an error is a bug in
            // the run itself: stop loudly rather than time it.
            Err(e) => panic!("the benchmark's store failed: {e}"),
        }
    }

    fn tick(&self) {
        self.now_ms.fetch_add(1, Ordering::Relaxed);
    }

    fn entries_tracked(&self) -> usize {
        self.store.entries_tracked()
    }
}

/// governor's keyed GCRA limiter (its default `DashMap` store and hasher)
/// with the same quota, on its `FakeRelativeClock`.
pub struct Governor {
    limiter: RateLimiter<u64, DashMapStateStore<u64>, FakeRelativeClock, NoOpMiddleware<Nanos>>,
    clock: FakeRelativeClock,
}

impl Governor {
    /// `limit` per `window_ms` with a burst of `limit`, as `gcra` is
    /// configured in the reference.
    pub fn new(limit: u32, window_ms: u64) -> Result<Self> {
        let Some(burst) = NonZeroU32::new(limit) else {
            bail!("governor needs a limit of at least 1")
        };
        let period = Duration::from_millis(window_ms) / limit;
        let Some(quota) = Quota::with_period(period) else {
            bail!("governor needs a non-zero period")
        };
        let clock = FakeRelativeClock::default();
        clock.advance(Duration::from_millis(1));
        let limiter = RateLimiter::new(
            quota.allow_burst(burst),
            DashMapStateStore::default(),
            clock.clone(),
        );
        Ok(Governor { limiter, clock })
    }
}

impl Contender for Governor {
    #[inline]
    fn check(&self, key: u64) -> bool {
        self.limiter.check_key(&key).is_ok()
    }

    fn tick(&self) {
        self.clock.advance(Duration::from_millis(1));
    }

    fn entries_tracked(&self) -> usize {
        self.limiter.len()
    }
}

/// The floor: a bare single-threaded `HashMap<u64, (u64, u32, u32)>` with
/// FxHash running the `sliding-window-counter` formula, with no locks, no
/// input checks, no capacity bound and no retry time.
pub struct Baseline {
    map: RefCell<FxHashMap<u64, (u64, u32, u32)>>,
    now_ms: std::cell::Cell<u64>,
    limit: u64,
    window_ms: u64,
}

impl Baseline {
    /// `limit` per `window_ms`.
    pub fn new(limit: u64, window_ms: u64) -> Self {
        Baseline {
            map: RefCell::default(),
            now_ms: std::cell::Cell::new(1),
            limit,
            window_ms,
        }
    }
}

impl Contender for Baseline {
    #[inline]
    fn check(&self, key: u64) -> bool {
        let now = self.now_ms.get();
        let w = self.window_ms;
        let mut map = self.map.borrow_mut();
        let e = map.entry(key).or_insert_with(|| (now - now % w, 0, 0));
        window_counter(self.limit, w, now, e)
    }

    fn tick(&self) {
        self.now_ms.set(self.now_ms.get() + 1);
    }

    fn entries_tracked(&self) -> usize {
        self.map.borrow().len()
    }
}

/// The `sliding-window-counter` formula on `(window start, previous,
/// current)`, as bare as it gets: admits (counting the request) or
/// refuses, rolling the window first when `now` has left it. `now` is not
/// before the window start `e.0`.
#[inline(always)]
fn window_counter(limit: u64, w: u64, now: u64, e: &mut (u64, u32, u32)) -> bool {
    // The floor should be as fast as the formula allows: most requests
    // fall in the recorded window, which needs no division to find.
    if now - e.0 >= w {
        let window = now - now % w;
        e.1 = if window == e.0 + w { e.2 } else { 0 };
        e.2 = 0;
        e.0 = window;
    }
    let weight = w - (now - e.0);
    // 32-bit division when the operands fit (they do in the reference
    // configuration), as the store's policies do.
    let carried = match (u32::try_from(u64::from(e.1) * weight), u32::try_from(w)) {
        (Ok(n), Ok(d)) => u64::from(n / d),
        _ => u64::from(e.1) * weight / w,
    };
    if carried + u64::from(e.2) < limit {
        e.2 += 1;
        true
    } else {
        false
    }
}

/// The machine's ceiling for threads: the `sliding-window-counter` formula
/// on a fixed-size open-addressing table of atomics, sized for the keys it
/// will see, where deciding a known key touches nothing but that key's own
/// slot (a compare-and-swap on its packed state). It never grows, never
/// forgets a key, checks no input and hashes without a key, so it is not a
/// limiter; what it shows is how much a second thread can add on this
/// machine when no cache line is shared between decisions.
pub struct AtomicBaseline {
    /// `(key, packed state)` word pairs; key [`ATOMIC_EMPTY`] marks a free
    /// slot, state 0 a key with no request counted yet.
    slots: Box<[AtomicU64]>,
    mask: usize,
    len: AtomicUsize,
    now_ms: AtomicU64,
    limit: u64,
    window_ms: u64,
}

/// The key word of a free slot in [`AtomicBaseline`]; the key 0 itself is
/// not supported (the bench's key sets never hold it).
const ATOMIC_EMPTY: u64 = 0;

/// Bits of the previous and current counts in [`AtomicBaseline`]'s packed
/// state; the window start takes the rest.
const ATOMIC_COUNT_BITS: u32 = 12;

impl AtomicBaseline {
    /// `limit` per `window_ms`, with room for `keys` keys at a load of at
    /// most one half.
    pub fn new(limit: u64, window_ms: u64, keys: usize) -> Result<Self> {
        if limit >= 1 << ATOMIC_COUNT_BITS {
            bail!(
                "the atomic baseline counts at most {} per window",
                (1 << ATOMIC_COUNT_BITS) - 1
            );
        }
        let slots = (keys.max(1) * 2).next_power_of_two();
        Ok(AtomicBaseline {
            slots: (0..slots * 2).map(|_| AtomicU64::new(0)).collect(),
            mask: slots - 1,
            len: AtomicUsize::new(0),
            now_ms: AtomicU64::new(1),
            limit,
            window_ms,
        })
    }

    fn pack(e: (u64, u32, u32)) -> u64 {
        debug_assert!(
            e.0 < 1 << (64 - 2 * ATOMIC_COUNT_BITS),
            "a window start past the packed field"
        );
        (e.0 << (2 * ATOMIC_COUNT_BITS)) | (u64::from(e.1) << ATOMIC_COUNT_BITS) | u64::from(e.2)
    }

    fn unpack(packed: u64) -> (u64, u32, u32) {
        let mask = (1 << ATOMIC_COUNT_BITS) - 1;
        (
            packed >> (2 * ATOMIC_COUNT_BITS),
            ((packed >> ATOMIC_COUNT_BITS) & mask) as u32,
            (packed & mask) as u32,
        )
    }

    /// The slot index holding `key`, claiming a free one for a new key.
    #[inline]
    fn slot_of(&self, key: u64) -> usize {
        debug_assert_ne!(
            key, ATOMIC_EMPTY,
            "the atomic baseline does not take the key 0"
        );
        // FxHash's multiplier, top bits: unkeyed, like the bare map's.
        let mut i = (key.wrapping_mul(0x517c_c1b7_2722_0a95) >> 32) as usize & self.mask;
        for _ in 0..=self.mask {
            let word = &self.slots[2 * i];
            match word.load(Ordering::Acquire) {
                k if k == key => return i,
                ATOMIC_EMPTY => match word.compare_exchange(
                    ATOMIC_EMPTY,
                    key,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                ) {
                    Ok(_) => {
                        self.len.fetch_add(1, Ordering::Relaxed);
                        return i;
                    }
                    Err(k) if k == key => return i,
                    Err(_) => {}
                },
                _ => {}
            }
            i = (i + 1) & self.mask;
        }
        panic!("the atomic baseline is full: it was sized for fewer keys than it was given");
    }
}

impl Contender for AtomicBaseline {
    #[inline]
    fn check(&self, key: u64) -> bool {
        let now = self.now_ms.load(Ordering::Relaxed);
        let w = self.window_ms;
        let state = &self.slots[2 * self.slot_of(key) + 1];
        let mut current = state.load(Ordering::Acquire);
        loop {
            let mut e = if current == 0 {
                (now - now % w, 0, 0)
            } else {
                Self::unpack(current)
            };
            // Another thread may have read a later time and rolled the
            // window first: decide at the recorded window's time then.
            let admitted = window_counter(self.limit, w, now.max(e.0), &mut e);
            let new = Self::pack(e);
            if new == current {
                return admitted;
            }
            match state.compare_exchange_weak(current, new, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return admitted,
                Err(seen) => current = seen,
            }
        }
    }

    fn tick(&self) {
        self.now_ms.fetch_add(1, Ordering::Relaxed);
    }

    fn entries_tracked(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }
}

/// `n` distinct, well-spread keys: a bijective mix of `0..n`, so the same
/// `n` always gives the same keys.
pub fn key_set(n: usize) -> Vec<u64> {
    (0..n as u64).map(splitmix64).collect()
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// `len` keys drawn uniformly from `keys`.
pub fn uniform_sequence(keys: &[u64], len: usize, seed: u64) -> Vec<u64> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..len)
        .map(|_| keys[rng.random_range(0..keys.len())])
        .collect()
}

/// `len` keys drawn from `keys` by Zipf's law with exponent `s` (rank 1 is
/// `keys[0]`).
pub fn zipf_sequence(keys: &[u64], len: usize, s: f64, seed: u64) -> Vec<u64> {
    let mut rng = StdRng::seed_from_u64(seed);
    let zipf = Zipf::new(keys.len() as f64, s).expect("a non-empty key set and s >= 0");
    (0..len)
        .map(|_| keys[(zipf.sample(&mut rng) as usize - 1).min(keys.len() - 1)])
        .collect()
}

/// Decides every key once, untimed, so a later run finds them all.
pub fn insert_all<C: Contender>(c: &C, keys: &[u64]) {
    for &k in keys {
        black_box(c.check(k));
    }
}

/// Runs `sequence` once on one thread, moving the supplied time on by
/// 1 ms every `decisions_per_ms` decisions, and returns nanoseconds per
/// decision.
pub fn run_single<C: Contender>(c: &C, sequence: &[u64], decisions_per_ms: usize) -> f64 {
    let decisions_per_ms = decisions_per_ms.max(1);
    let start = Instant::now();
    for (i, &key) in sequence.iter().enumerate() {
        if i % decisions_per_ms == 0 {
            c.tick();
        }
        black_box(c.check(black_box(key)));
    }
    start.elapsed().as_nanos() as f64 / sequence.len().max(1) as f64
}

/// Runs one sequence per thread at once and returns wall-clock
/// nanoseconds per decision over all threads (so decisions per second is
/// the aggregate throughput).
///
/// Each worker reads the clock itself, right after the barrier and after
/// its last decision, and the wall time runs from the earliest start to the
/// latest end. A clock read by the spawning thread would be wrong whenever
/// there are more threads than free cores: that thread can be scheduled
/// after the workers have finished, and the run then reads close to 0 ns.
pub fn run_threads<C: Contender + Sync>(c: &C, sequences: &[Vec<u64>]) -> f64 {
    let total: usize = sequences.iter().map(Vec::len).sum();
    let barrier = std::sync::Barrier::new(sequences.len());
    let spans: Vec<(Instant, Instant)> = std::thread::scope(|scope| {
        let handles: Vec<_> = sequences
            .iter()
            .enumerate()
            .map(|(t, sequence)| {
                let barrier = &barrier;
                scope.spawn(move || {
                    barrier.wait();
                    let start = Instant::now();
                    for (i, &key) in sequence.iter().enumerate() {
                        if t == 0 && i % DECISIONS_PER_MS == 0 {
                            c.tick();
                        }
                        black_box(c.check(black_box(key)));
                    }
                    (start, Instant::now())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a benchmark thread panicked"))
            .collect()
    });
    wall_span(&spans).as_nanos() as f64 / total.max(1) as f64
}

/// The time from the earliest start to the latest end of `spans` (zero for
/// none).
fn wall_span(spans: &[(Instant, Instant)]) -> Duration {
    let start = spans.iter().map(|s| s.0).min();
    let end = spans.iter().map(|s| s.1).max();
    match (start, end) {
        (Some(start), Some(end)) => end.saturating_duration_since(start),
        _ => Duration::ZERO,
    }
}

/// The median of `values` (the mean of the middle two for an even count).
pub fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    match n {
        0 => f64::NAN,
        _ if n % 2 == 1 => values[n / 2],
        _ => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ratewarden_core::{FixedWindow, SlidingWindowCounter};

    #[test]
    fn key_sets_are_distinct_and_sequences_reproducible() {
        let keys = key_set(10_000);
        let distinct: std::collections::HashSet<_> = keys.iter().collect();
        assert_eq!(distinct.len(), 10_000);
        assert_eq!(
            uniform_sequence(&keys, 100, 1),
            uniform_sequence(&keys, 100, 1)
        );
        let zipf = zipf_sequence(&keys, 10_000, 1.0, 2);
        assert_eq!(zipf, zipf_sequence(&keys, 10_000, 1.0, 2));
        // Rank 1 takes about 1 / H(10,000) ~ 10% of a Zipf(1.0) draw.
        let top = zipf.iter().filter(|&&k| k == keys[0]).count();
        assert!((700..1400).contains(&top), "{top}");
    }

    #[test]
    fn the_wall_span_runs_from_the_first_start_to_the_last_end() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        // Staggered workers: the span is not any one worker's own time.
        let spans = [
            (t0 + ms(5), t0 + ms(20)),
            (t0, t0 + ms(10)),
            (t0 + ms(2), t0 + ms(30)),
        ];
        assert_eq!(wall_span(&spans), ms(30));
        assert_eq!(wall_span(&[]), Duration::ZERO);
    }

    /// A contender that takes at least 1 ms per decision.
    struct Slow;

    impl Contender for Slow {
        fn check(&self, _key: u64) -> bool {
            std::thread::sleep(Duration::from_millis(1));
            true
        }
        fn tick(&self) {}
        fn entries_tracked(&self) -> usize {
            0
        }
    }

    #[test]
    fn thread_runs_count_the_time_the_workers_spent() {
        // More threads than the machine's cores are likely to be free, each
        // asleep for 10 ms at least: the wall time cannot be under 10 ms,
        // whenever the spawning thread gets to run.
        let sequences = vec![vec![1u64; 10]; 8];
        let ns = run_threads(&Slow, &sequences);
        assert!(ns * 80.0 >= 10_000_000.0, "{ns} ns per decision");
    }

    #[test]
    fn a_store_for_a_few_keys_takes_them_all_however_they_hash() {
        // Each store's hasher is seeded anew: twenty stores try twenty
        // splits of ten keys over the shards.
        for _ in 0..20 {
            let store = Store::new(FixedWindow::new(100, 1000).unwrap(), 10);
            for key in 1..=10 {
                assert!(store.check(key), "key {key}");
            }
            assert_eq!(store.entries_tracked(), 10);
        }
    }

    #[test]
    fn contenders_agree_on_a_fresh_key_budget() {
        // All three admit exactly the limit for a key at one instant.
        let store = Store::new(SlidingWindowCounter::new(100, 1000).unwrap(), 1 << 10);
        let governor = Governor::new(100, 1000).unwrap();
        let baseline = Baseline::new(100, 1000);
        let atomic = AtomicBaseline::new(100, 1000, 1 << 10).unwrap();
        for c in [&store as &dyn Contender, &governor, &baseline, &atomic] {
            let admitted = (0..150).filter(|_| c.check(42)).count();
            assert_eq!(admitted, 100);
            assert_eq!(c.entries_tracked(), 1);
        }
    }

    #[test]
    fn the_baseline_runs_the_window_counter_formula() {
        let baseline = Baseline::new(10, 10);
        let policy = SlidingWindowCounter::new(10, 10).unwrap();
        let mut state = policy.new_state(1);
        for step in 0..200 {
            for _ in 0..3 {
                let now = baseline.now_ms.get();
                assert_eq!(
                    baseline.check(5),
                    policy.decide(&mut state, now, 1).allowed,
                    "{step}"
                );
            }
            baseline.tick();
        }
    }

    #[test]
    fn the_atomic_baseline_runs_the_window_counter_formula() {
        // Three keys whose requests interleave, so that slots are claimed
        // and probed past; each must follow the policy's own decisions.
        let atomic = AtomicBaseline::new(10, 10, 3).unwrap();
        let policy = SlidingWindowCounter::new(10, 10).unwrap();
        let mut states = [1, 2, 3].map(|_| policy.new_state(1));
        for step in 0..200 {
            for (key, state) in [5u64, 6, 7].iter().zip(&mut states) {
                for _ in 0..(*key as usize - 3) {
                    let now = atomic.now_ms.load(Ordering::Relaxed);
                    assert_eq!(
                        atomic.check(*key),
                        policy.decide(state, now, 1).allowed,
                        "key {key}, step {step}"
                    );
                }
            }
            atomic.tick();
        }
        assert_eq!(atomic.entries_tracked(), 3);
        assert!(AtomicBaseline::new(4096, 1000, 1).is_err());
    }

    #[test]
    fn the_atomic_baseline_counts_every_racing_admission() {
        // Four threads race for one key's budget and insert the same new
        // keys at once: exactly the limit gets in, and each key is held
        // once.
        let atomic = AtomicBaseline::new(100, 1000, 1_001).unwrap();
        let keys = key_set(1_000);
        let admitted: usize = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..4)
                .map(|_| {
                    scope.spawn(|| {
                        for &k in &keys {
                            atomic.check(k);
                        }
                        (0..100).filter(|_| atomic.check(u64::MAX)).count()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).sum()
        });
        assert_eq!(admitted, 100);
        assert_eq!(atomic.entries_tracked(), 1_001);
    }

    #[test]
    fn the_atomic_baseline_takes_a_time_before_the_window_it_holds() {
        // One thread rolled the key into the window at 1000 ms; another,
        // which read the time a moment earlier (999 ms), decides next.
        let atomic = AtomicBaseline::new(2, 1000, 1).unwrap();
        atomic.now_ms.store(1000, Ordering::Relaxed);
        assert!(atomic.check(9));
        atomic.now_ms.store(999, Ordering::Relaxed);
        assert!(atomic.check(9));
        assert!(
            !atomic.check(9),
            "both requests count in the window at 1000 ms"
        );
    }

    #[test]
    fn medians() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
    }
}
