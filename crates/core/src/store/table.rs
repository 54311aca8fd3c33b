//! The memory store's table of packed states: `(u64 key, u64 state)` pairs
//! of atomics in one flat array, open addressing with linear probing,
//! which readers search and update without a lock while one writer at a
//! time (the shard's lock holder) adds keys, forgets them and replaces the
//! array.
//!
//! Why not a SwissTable (hashbrown): a SwissTable's capacity is a power of
//! two and it grows by doubling at 7/8 full, so between doublings its load
//! falls to 7/16 and a key costs up to 38 bytes (16 for the pair, one
//! control byte, over the load). This table takes any capacity, is
//! rebuilt at [`MIN_LOAD`] and grown at [`MAX_LOAD`], and has no control
//! bytes: 20 to 29 bytes per key as it fills. (Forgetting keys empties
//! slots without a rebuild until a quarter or fewer hold live keys, so a
//! table that forgot most of its keys holds up to 64 bytes per key left.)
//! A lookup that hits reads the pair at the key's home slot or a few slots
//! on, usually one cache line, where a SwissTable
//! reads a control group and then the slot, two. And a SwissTable cannot
//! be read while it is written.
//!
//! Layout rules, the invariants every method keeps:
//! - a slot holds a key or is empty; an empty slot holds [`EMPTY`] as its
//!   key (the key `EMPTY` itself has a cell beside the array, used only
//!   under the lock);
//! - a slot's key, once written, never changes while the array is the
//!   table's (a key is never moved or replaced in place): a reader that
//!   found a key's slot may update that slot's state until the array is
//!   retired. Forgetting a key writes [`DEAD`] as its state and leaves the
//!   key; the slot is reclaimed when the array is replaced, and only the
//!   same key may live in it again meanwhile;
//! - an array that is replaced (growth, shrinking, widening) is retired:
//!   every state in it is swapped for [`DEAD`] as it is copied, so any
//!   later update through it fails and its reader goes to the lock;
//! - a key lies at its home slot or after it, with no empty slot between
//!   (linear probing, wrapping at the end of the array);
//! - at least one slot is always empty (the load never reaches 1), so every
//!   probe ends.
//!
//! The table never hashes: callers pass each key's hash, and a function
//! that recomputes it when the array is replaced.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The key an empty slot holds. Any value would do; zero is what a new
/// slot starts with.
pub(crate) const EMPTY: u64 = 0;

/// The state of a forgotten key or of any key in a retired array: not a
/// state (the memory store never stores a packed state equal to it), so
/// no update expecting a real state can succeed on it.
pub(crate) const DEAD: u64 = u64::MAX;

/// The state of a key pinned by the memory store: its state is kept
/// elsewhere, under the lock, and the cell says so to every reader that
/// finds it. Not a state either. The table's own methods that move or
/// judge states (replacing the array, forgetting) never meet it: the
/// store unpins before calling them.
pub(crate) const PINNED: u64 = u64::MAX - 1;

/// The table grows when an insert would take it past this load
/// (numerator over [`LOAD_DENOMINATOR`]): 13/16. Linear probing's expected
/// probe for a hit is `(1 + 1 / (1 - load)) / 2` slots, 3.2 at this load.
/// Forgotten keys' slots count until the array is replaced.
const MAX_LOAD: usize = 13;

/// Growth and shrinking rebuild the table at this load: 9/16, a growth of
/// about 1.44x.
const MIN_LOAD: usize = 9;

const LOAD_DENOMINATOR: usize = 16;

/// The smallest array the table allocates.
const MIN_SLOTS: usize = 8;

/// One key and its packed state.
#[derive(Debug, Default)]
pub(crate) struct Slot {
    key: AtomicU64,
    state: AtomicU64,
}

/// An array of slots, shared by the table and its readers.
pub(crate) type Slots = Arc<[Slot]>;

/// How a probe of part of the array ended.
enum Probe {
    /// The key is at this index of the part.
    Found(usize),
    /// An empty slot came first: the key is not in the array.
    Absent,
    /// The part ended first: the probe goes on from the array's start.
    Wrapped,
}

/// The home slot of `hash` in an array of `n` slots: the high bits of the
/// hash, scaled to `n` by a multiplication (Lemire's "fast range"), so
/// that `n` need not be a power of two.
#[inline]
pub(crate) fn home(hash: u64, n: usize) -> usize {
    ((u128::from(hash) * n as u128) >> 64) as usize
}

/// The index of `key` (not [`EMPTY`]), whose hash is `hash`, in `slots`.
/// Safe to call without the lock, on any array of the table, current or
/// retired.
#[inline(always)]
pub(crate) fn find(slots: &[Slot], hash: u64, key: u64) -> Option<usize> {
    debug_assert_ne!(key, EMPTY);
    let n = slots.len();
    if n == 0 {
        return None;
    }
    // The probe walks from the home slot to the end, then from the start:
    // two slice iterations, with no bounds check or wrap test per slot.
    let home = home(hash, n);
    let at = match probe(&slots[home..], key) {
        Probe::Found(i) => home + i,
        Probe::Absent => return None,
        Probe::Wrapped => match probe(&slots[..home], key) {
            Probe::Found(i) => i,
            // `Wrapped` twice cannot happen (an array always keeps an
            // empty slot); either way the key is not there.
            Probe::Absent | Probe::Wrapped => return None,
        },
    };
    Some(at)
}

/// The state cell of the slot at `index` (from [`find`]); its value is
/// [`DEAD`] if the key was forgotten or the array retired.
#[inline(always)]
pub(crate) fn state(slots: &[Slot], index: usize) -> &AtomicU64 {
    &slots[index].state
}

/// Looks for `key` in `slots`, in order, up to the first empty slot.
#[inline(always)]
fn probe(slots: &[Slot], key: u64) -> Probe {
    for (i, slot) in slots.iter().enumerate() {
        // Acquire: pairs with the release that published the key, after
        // its first state.
        let held = slot.key.load(Ordering::Acquire);
        if held == key {
            return Probe::Found(i);
        }
        if held == EMPTY {
            return Probe::Absent;
        }
    }
    Probe::Wrapped
}

/// Keys with their packed 64-bit states; see the module's notes. Every
/// method takes `&mut self`: the table's one writer holds the shard's
/// lock, while readers hold clones of [`PackedTable::slots`].
#[derive(Debug)]
pub(crate) struct PackedTable {
    slots: Slots,
    /// Slots whose state is live.
    live_in_slots: usize,
    /// Slots whose key was forgotten ([`DEAD`] state), not yet reclaimed.
    dead_in_slots: usize,
    /// The state of the key `EMPTY`, [`DEAD`] when it has none.
    empty_key_state: AtomicU64,
}

impl Default for PackedTable {
    fn default() -> Self {
        PackedTable {
            slots: Arc::new([]),
            live_in_slots: 0,
            dead_in_slots: 0,
            empty_key_state: AtomicU64::new(DEAD),
        }
    }
}

/// Whether a method replaced the table's array, retiring the one readers
/// may hold.
#[must_use]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Replaced(pub(crate) bool);

impl PackedTable {
    /// Keys held.
    pub(crate) fn len(&self) -> usize {
        self.live_in_slots + usize::from(self.empty_key_state.load(Ordering::Relaxed) != DEAD)
    }

    /// The current array, for readers.
    pub(crate) fn slots(&self) -> &Slots {
        &self.slots
    }

    /// The state cell of `key`, whose hash is `hash`, if the key has one;
    /// its value is [`DEAD`] when the key was forgotten. Readers without
    /// the lock may update a live state in it at any time.
    #[inline]
    pub(crate) fn cell(&self, hash: u64, key: u64) -> Option<&AtomicU64> {
        if key == EMPTY {
            return Some(&self.empty_key_state);
        }
        find(&self.slots, hash, key).map(|at| state(&self.slots, at))
    }

    /// Whether [`PackedTable::put_new`] of a key without a cell would
    /// replace the array.
    pub(crate) fn is_full(&self) -> bool {
        (self.live_in_slots + self.dead_in_slots + 1) * LOAD_DENOMINATOR
            > self.slots.len() * MAX_LOAD
    }

    /// Stores `state` (not [`DEAD`] or [`PINNED`]) for `key`, which has no
    /// live state: in the cell it was forgotten in, or in a new slot.
    /// `rehash` gives the hash of any key held, for when the array is
    /// replaced.
    pub(crate) fn put_new(
        &mut self,
        hash: u64,
        key: u64,
        state: u64,
        rehash: impl Fn(u64) -> u64,
    ) -> Replaced {
        debug_assert!(state != DEAD && state != PINNED);
        if let Some(cell) = self.cell(hash, key) {
            debug_assert_eq!(cell.load(Ordering::Relaxed), DEAD);
            // No reader updates a dead state, so a plain store is enough;
            // release, for readers that find it.
            cell.store(state, Ordering::Release);
            if key != EMPTY {
                self.dead_in_slots -= 1;
                self.live_in_slots += 1;
            }
            return Replaced(false);
        }
        let replaced = self.is_full();
        if replaced {
            self.rebuild(Self::slots_for(self.live_in_slots + 1), &rehash);
        }
        Self::place(&self.slots, hash, key, state);
        self.live_in_slots += 1;
        Replaced(replaced)
    }

    /// Puts a key not in `slots` at the first empty slot from its home:
    /// the state first, then the key, released, so that a reader finding
    /// the key finds the state.
    fn place(slots: &[Slot], hash: u64, key: u64, state: u64) {
        let n = slots.len();
        let mut i = home(hash, n);
        while slots[i].key.load(Ordering::Relaxed) != EMPTY {
            i += 1;
            if i == n {
                i = 0;
            }
        }
        slots[i].state.store(state, Ordering::Relaxed);
        slots[i].key.store(key, Ordering::Release);
    }

    /// The array size that holds `len` keys at [`MIN_LOAD`].
    fn slots_for(len: usize) -> usize {
        (len * LOAD_DENOMINATOR)
            .div_ceil(MIN_LOAD)
            .max(MIN_SLOTS)
            // Always one empty slot, whatever the rounding.
            .max(len + 1)
    }

    /// Moves every live key into a new array of `n` slots, retiring the
    /// old one: each state is swapped for [`DEAD`] as it is taken, so an
    /// update racing with the move either lands before the swap (and is
    /// moved) or fails.
    #[cold]
    fn rebuild(&mut self, n: usize, rehash: &impl Fn(u64) -> u64) {
        debug_assert!(n > self.live_in_slots);
        let new: Slots = (0..n).map(|_| Slot::default()).collect();
        let mut live = 0;
        for slot in self.slots.iter() {
            let key = slot.key.load(Ordering::Relaxed);
            if key == EMPTY {
                continue;
            }
            let state = slot.state.swap(DEAD, Ordering::AcqRel);
            debug_assert_ne!(state, PINNED, "the store unpins before a rebuild");
            if state != DEAD {
                Self::place(&new, rehash(key), key, state);
                live += 1;
            }
        }
        debug_assert_eq!(live, self.live_in_slots);
        self.slots = new;
        self.live_in_slots = live;
        self.dead_in_slots = 0;
    }

    /// Forgets the keys whose state fails `keep`, then gives memory back
    /// when the table has become mostly empty. A state that changes while
    /// it is looked at is looked at again: only the state replaced by
    /// [`DEAD`] is judged.
    pub(crate) fn retain(
        &mut self,
        mut keep: impl FnMut(u64) -> bool,
        rehash: impl Fn(u64) -> u64,
    ) -> Replaced {
        // The empty key's cell is not a slot: forgetting it changes no count.
        Self::forget_unless(&self.empty_key_state, &mut keep);
        let mut forgotten = 0;
        for slot in self.slots.iter() {
            if slot.key.load(Ordering::Relaxed) != EMPTY
                && Self::forget_unless(&slot.state, &mut keep)
            {
                forgotten += 1;
            }
        }
        self.live_in_slots -= forgotten;
        self.dead_in_slots += forgotten;
        // Shrink once a quarter of the slots or fewer hold live keys, back
        // to the rebuilt load, so a table that grew for a burst of keys
        // returns the memory.
        let n = self.slots.len();
        if n > MIN_SLOTS && self.live_in_slots * 4 <= n {
            let smaller = Self::slots_for(self.live_in_slots);
            if smaller < n {
                self.rebuild(smaller, &rehash);
                return Replaced(true);
            }
        }
        Replaced(false)
    }

    /// Swaps the live state in `cell` for [`DEAD`] unless `keep` holds for
    /// it; whether it did.
    fn forget_unless(cell: &AtomicU64, keep: &mut impl FnMut(u64) -> bool) -> bool {
        let mut state = cell.load(Ordering::Acquire);
        debug_assert_ne!(state, PINNED, "the store unpins before forgetting");
        while state != DEAD && !keep(state) {
            match cell.compare_exchange_weak(state, DEAD, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return true,
                Err(seen) => state = seen,
            }
        }
        false
    }

    /// Takes every key and live state out, retiring the array and leaving
    /// the table empty.
    pub(crate) fn drain(&mut self) -> Vec<(u64, u64)> {
        let mut all = Vec::with_capacity(self.len());
        let empty_key = self.empty_key_state.swap(DEAD, Ordering::AcqRel);
        debug_assert_ne!(empty_key, PINNED, "the store unpins before draining");
        if empty_key != DEAD {
            all.push((EMPTY, empty_key));
        }
        for slot in self.slots.iter() {
            let key = slot.key.load(Ordering::Relaxed);
            if key != EMPTY {
                let state = slot.state.swap(DEAD, Ordering::AcqRel);
                debug_assert_ne!(state, PINNED, "the store unpins before draining");
                if state != DEAD {
                    all.push((key, state));
                }
            }
        }
        *self = PackedTable::default();
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    /// A deliberately poor hash for the tests: few distinct homes, so runs
    /// are long and wrap around the end of the array.
    fn clumpy(key: u64) -> u64 {
        (key % 7).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (key % 3) << 63
    }

    fn good(key: u64) -> u64 {
        key.wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(29) ^ key
    }

    /// The array grows only when an insert would pass `MAX_LOAD`: it
    /// fills to exactly 13/16 first.
    #[test]
    fn a_table_fills_to_exactly_max_load() {
        let mut table = PackedTable::default();
        table.rebuild(16, &good);
        for key in 1..=12u64 {
            assert!(!table.put_new(good(key), key, key, good).0);
        }
        assert!(!table.is_full(), "13 of 16 is not past 13/16");
        assert!(!table.put_new(good(13), 13, 13, good).0);
        assert_eq!(table.slots().len(), 16);
        assert!(table.is_full());
    }

    /// A sweep keeps the array while more than a quarter of its slots
    /// hold live keys: rebuilding retires it, which sends every reader
    /// without the lock back to it.
    #[test]
    fn a_sweep_keeps_the_array_above_a_quarter_live() {
        let mut table = PackedTable::default();
        for key in 1..=1000u64 {
            let _ = table.put_new(good(key), key, key, good);
        }
        let before = Arc::clone(table.slots());
        assert!(!table.retain(|state| state <= 500, good).0);
        assert!(Arc::ptr_eq(&before, table.slots()));
        assert_eq!(table.len(), 500);
    }

    fn get(table: &PackedTable, hash: fn(u64) -> u64, key: u64) -> Option<u64> {
        table
            .cell(hash(key), key)
            .map(|cell| cell.load(Ordering::Relaxed))
            .filter(|&state| state != DEAD)
    }

    #[derive(Debug, Clone)]
    enum Op {
        Decide(u64, u64),
        Retain(u64),
    }

    fn ops() -> impl Strategy<Value = Vec<Op>> {
        prop::collection::vec(
            prop_oneof![
                8 => (prop_oneof![0u64..64, any::<u64>()], 0..DEAD).prop_map(|(k, v)| Op::Decide(k, v)),
                1 => (1u64..5).prop_map(Op::Retain),
            ],
            0..600,
        )
    }

    /// Runs `ops` on the table and on a `HashMap`: "decide" updates a
    /// key's state (putting it when new or forgotten); "retain" keeps the
    /// states not divisible by its argument. Both must hold the same keys
    /// and states after every step, and the layout rules must hold. An
    /// array the table retires must hold only dead states.
    fn check(ops: &[Op], hash: fn(u64) -> u64) -> Result<(), TestCaseError> {
        let mut table = PackedTable::default();
        let mut model: HashMap<u64, u64> = HashMap::new();
        for op in ops {
            let before = table.slots().clone();
            let replaced = match *op {
                Op::Decide(key, state) => {
                    let live = table
                        .cell(hash(key), key)
                        .filter(|cell| cell.load(Ordering::Relaxed) != DEAD);
                    prop_assert_eq!(live.is_some(), model.contains_key(&key));
                    let replaced = match live {
                        Some(cell) => {
                            prop_assert_eq!(model.get(&key), Some(&cell.load(Ordering::Relaxed)));
                            cell.store(state, Ordering::Relaxed);
                            Replaced(false)
                        }
                        None => table.put_new(hash(key), key, state, hash),
                    };
                    model.insert(key, state);
                    replaced
                }
                Op::Retain(d) => {
                    model.retain(|_, s| *s % d != 0);
                    table.retain(|s| s % d != 0, hash)
                }
            };
            prop_assert_eq!(replaced.0, !Arc::ptr_eq(&before, table.slots()));
            if replaced.0 {
                prop_assert!(before.iter().all(|s| s.key.load(Ordering::Relaxed) == EMPTY
                    || s.state.load(Ordering::Relaxed) == DEAD));
            }
            prop_assert_eq!(table.len(), model.len());
            check_layout(&table, hash)?;
        }
        for (&key, &state) in &model {
            prop_assert_eq!(get(&table, hash, key), Some(state));
        }
        let mut drained = table.drain();
        let mut expected: Vec<_> = model.into_iter().collect();
        drained.sort_unstable();
        expected.sort_unstable();
        prop_assert_eq!(drained, expected);
        prop_assert_eq!(table.len(), 0);
        Ok(())
    }

    fn check_layout(table: &PackedTable, hash: fn(u64) -> u64) -> Result<(), TestCaseError> {
        let slots = table.slots();
        let n = slots.len();
        if n == 0 {
            prop_assert_eq!(table.live_in_slots + table.dead_in_slots, 0);
            return Ok(());
        }
        let key_at = |i: usize| slots[i].key.load(Ordering::Relaxed);
        let full: Vec<usize> = (0..n).filter(|&i| key_at(i) != EMPTY).collect();
        let dead = full
            .iter()
            .filter(|&&i| slots[i].state.load(Ordering::Relaxed) == DEAD)
            .count();
        prop_assert_eq!(full.len() - dead, table.live_in_slots);
        prop_assert_eq!(dead, table.dead_in_slots);
        prop_assert!(full.len() < n, "no empty slot");
        prop_assert!(
            full.len() * LOAD_DENOMINATOR <= n * MAX_LOAD,
            "{} keys in {n} slots",
            full.len()
        );
        for &i in &full {
            let key = key_at(i);
            // Every slot from the key's home to the key is full, and the
            // key is in no other slot.
            let mut j = home(hash(key), n);
            while j != i {
                prop_assert!(key_at(j) != EMPTY, "gap before key {key} at {i}");
                prop_assert!(key_at(j) != key, "key {key} twice");
                j = (j + 1) % n;
            }
        }
        Ok(())
    }

    proptest! {
        #[test]
        fn the_table_holds_what_a_hash_map_holds(ops in ops()) {
            check(&ops, good)?;
        }

        #[test]
        fn long_wrapping_runs_keep_the_layout(ops in ops()) {
            check(&ops, clumpy)?;
        }
    }

    #[test]
    fn load_stays_between_the_bounds_as_the_table_grows() {
        let mut table = PackedTable::default();
        for key in 1..=100_000u64 {
            let _ = table.put_new(good(key), key, key, good);
            let load = table.len() as f64 / table.slots().len() as f64;
            assert!(load <= MAX_LOAD as f64 / 16.0, "{key}: {load}");
            if key > 64 {
                assert!(load >= 0.5, "{key}: {load}");
            }
        }
    }

    #[test]
    fn retain_gives_memory_back() {
        let mut table = PackedTable::default();
        for key in 1..=10_000u64 {
            let _ = table.put_new(good(key), key, key, good);
        }
        let big = table.slots().len();
        assert_eq!(table.retain(|state| state <= 100, good), Replaced(true));
        assert_eq!(table.len(), 100);
        assert!(
            table.slots().len() * 10 < big,
            "{} of {big}",
            table.slots().len()
        );
        for key in 1..=100u64 {
            assert_eq!(get(&table, good, key), Some(key));
        }
        let _ = table.retain(|_| false, good);
        assert_eq!(table.len(), 0);
        assert_eq!(get(&table, good, 1), None);
    }

    /// A forgotten key keeps its slot, dead, until the array is replaced;
    /// the same key coming back takes that slot again.
    #[test]
    fn a_forgotten_key_comes_back_in_its_own_slot() {
        let mut table = PackedTable::default();
        for key in 1..=8u64 {
            let _ = table.put_new(good(key), key, key, good);
        }
        let slots = table.slots().clone();
        assert_eq!(table.retain(|state| state != 3, good), Replaced(false));
        let cell = table.cell(good(3), 3).unwrap();
        assert_eq!(cell.load(Ordering::Relaxed), DEAD);
        assert_eq!((table.len(), table.dead_in_slots), (7, 1));
        assert_eq!(table.put_new(good(3), 3, 30, good), Replaced(false));
        assert!(Arc::ptr_eq(&slots, table.slots()));
        assert_eq!(get(&table, good, 3), Some(30));
        assert_eq!((table.len(), table.dead_in_slots), (8, 0));
    }

    /// A reader holding a retired array finds its keys dead there, and an
    /// update expecting the state it read fails.
    #[test]
    fn a_retired_array_refuses_every_update() {
        let mut table = PackedTable::default();
        let _ = table.put_new(good(1), 1, 10, good);
        let held = table.slots().clone();
        let cell = state(&held, find(&held, good(1), 1).unwrap());
        let seen = cell.load(Ordering::Relaxed);
        let mut key = 2;
        while !table.put_new(good(key), key, key, good).0 {
            key += 1;
        }
        assert_eq!(
            cell.compare_exchange(seen, 11, Ordering::AcqRel, Ordering::Acquire),
            Err(DEAD)
        );
        assert_eq!(get(&table, good, 1), Some(10));
    }

    #[test]
    fn the_empty_marker_is_a_key_like_any_other() {
        let mut table = PackedTable::default();
        assert_eq!(get(&table, good, EMPTY), None);
        let _ = table.put_new(good(EMPTY), EMPTY, 5, good);
        let _ = table.put_new(good(1), 1, 6, good);
        assert_eq!(table.len(), 2);
        table
            .cell(good(EMPTY), EMPTY)
            .unwrap()
            .store(7, Ordering::Relaxed);
        assert_eq!(get(&table, good, 1), Some(6));
        let _ = table.retain(|state| state != 7, good);
        assert_eq!((table.len(), get(&table, good, EMPTY)), (1, None));
        let _ = table.put_new(good(EMPTY), EMPTY, 8, good);
        let mut all = table.drain();
        all.sort_unstable();
        assert_eq!(all, vec![(EMPTY, 8), (1, 6)]);
        assert_eq!(table.len(), 0);
    }
}
