//! The memory store's table of packed states: `(u64 key, u64 state)` pairs
//! in one flat array, open addressing with linear probing.
//!
//! Why not a SwissTable (hashbrown): a SwissTable's capacity is a power of
//! two and it grows by doubling at 7/8 full, so between doublings its load
//! falls to 7/16 and a key costs up to 38 bytes (16 for the pair, one
//! control byte, over the load). This table takes any capacity, keeps its
//! load between [`MIN_LOAD`] and [`MAX_LOAD`], and has no control bytes:
//! 20 to 29 bytes per key. A lookup that hits reads the pair at the key's
//! home slot or a few slots on, usually one cache line, where a SwissTable
//! reads a control group and then the slot, two.
//!
//! Layout rules, the invariants every method keeps:
//! - a slot holds a key or is empty; an empty slot holds [`EMPTY`] as its
//!   key (the key `EMPTY` itself lives in `empty_key_state`, beside the
//!   array);
//! - a key lies at its home slot or after it, with no empty slot between
//!   (linear probing, wrapping at the end of the array);
//! - at least one slot is always empty (the load never reaches 1), so every
//!   probe ends.
//!
//! The table never hashes: callers pass each key's hash, and a function
//! that recomputes it when the table is rebuilt.

/// The key an empty slot holds. Any value would do; zero lets a new array
/// come from zeroed memory.
const EMPTY: u64 = 0;

/// The table grows when an insert would take it past this load
/// (numerator over [`LOAD_DENOMINATOR`]): 13/16. Linear probing's expected
/// probe for a hit is `(1 + 1 / (1 - load)) / 2` slots, 3.2 at this load.
const MAX_LOAD: usize = 13;

/// Growth and shrinking rebuild the table at this load: 9/16, a growth of
/// about 1.44x.
const MIN_LOAD: usize = 9;

const LOAD_DENOMINATOR: usize = 16;

/// The smallest array the table allocates.
const MIN_SLOTS: usize = 8;

/// How a probe of part of the array ended.
enum Probe {
    /// The key is at this index of the part.
    Found(usize),
    /// An empty slot came first: the key is not in the table.
    Absent,
    /// The part ended first: the probe goes on from the array's start.
    Wrapped,
}

/// Keys with their packed 64-bit states; see the module's notes.
#[derive(Debug, Default)]
pub(crate) struct PackedTable {
    slots: Vec<(u64, u64)>,
    /// Keys in `slots` (the key `EMPTY` is counted apart).
    len_in_slots: usize,
    empty_key_state: Option<u64>,
}

impl PackedTable {
    /// Keys held.
    pub(crate) fn len(&self) -> usize {
        self.len_in_slots + usize::from(self.empty_key_state.is_some())
    }

    /// Slots allocated.
    #[cfg(test)]
    pub(crate) fn slots(&self) -> usize {
        self.slots.len()
    }

    /// The home slot of `hash` in an array of `n` slots: the high bits of
    /// the hash, scaled to `n` by a multiplication (Lemire's "fast range"),
    /// so that `n` need not be a power of two.
    #[inline]
    fn home(hash: u64, n: usize) -> usize {
        ((u128::from(hash) * n as u128) >> 64) as usize
    }

    /// The state of `key`, whose hash is `hash`, for update in place.
    #[inline]
    pub(crate) fn find_mut(&mut self, hash: u64, key: u64) -> Option<&mut u64> {
        if key == EMPTY {
            return self.empty_key_state.as_mut();
        }
        let n = self.slots.len();
        if n == 0 {
            return None;
        }
        // The probe walks from the home slot to the end, then from the
        // start: two slice iterations, with no bounds check or wrap test
        // per slot. It ends: at least one slot is empty.
        let home = Self::home(hash, n);
        let at = match Self::probe(&self.slots[home..], key) {
            Probe::Found(i) => home + i,
            Probe::Absent => return None,
            Probe::Wrapped => match Self::probe(&self.slots[..home], key) {
                Probe::Found(i) => i,
                Probe::Absent => return None,
                Probe::Wrapped => unreachable!("the table always has an empty slot"),
            },
        };
        Some(&mut self.slots[at].1)
    }

    /// Looks for `key` in `slots`, in order, up to the first empty slot.
    #[inline(always)]
    fn probe(slots: &[(u64, u64)], key: u64) -> Probe {
        for (i, slot) in slots.iter().enumerate() {
            if slot.0 == key {
                return Probe::Found(i);
            }
            if slot.0 == EMPTY {
                return Probe::Absent;
            }
        }
        Probe::Wrapped
    }

    /// Inserts `key` (not in the table) with `state`. `rehash` gives the
    /// hash of any key held, for when the table grows.
    pub(crate) fn insert_new(
        &mut self,
        hash: u64,
        key: u64,
        state: u64,
        rehash: impl Fn(u64) -> u64,
    ) {
        if key == EMPTY {
            debug_assert!(self.empty_key_state.is_none());
            self.empty_key_state = Some(state);
            return;
        }
        if (self.len_in_slots + 1) * LOAD_DENOMINATOR > self.slots.len() * MAX_LOAD {
            self.rebuild(Self::slots_for(self.len_in_slots + 1), &rehash);
        }
        Self::place(&mut self.slots, hash, key, state);
        self.len_in_slots += 1;
    }

    /// Puts a key not in `slots` at the first empty slot from its home.
    #[inline]
    fn place(slots: &mut [(u64, u64)], hash: u64, key: u64, state: u64) {
        let n = slots.len();
        let mut i = Self::home(hash, n);
        while slots[i].0 != EMPTY {
            i += 1;
            if i == n {
                i = 0;
            }
        }
        slots[i] = (key, state);
    }

    /// The array size that holds `len` keys at [`MIN_LOAD`].
    fn slots_for(len: usize) -> usize {
        (len * LOAD_DENOMINATOR)
            .div_ceil(MIN_LOAD)
            .max(MIN_SLOTS)
            // Always one empty slot, whatever the rounding.
            .max(len + 1)
    }

    /// Moves every key into a new array of `n` slots.
    #[cold]
    fn rebuild(&mut self, n: usize, rehash: &impl Fn(u64) -> u64) {
        debug_assert!(n > self.len_in_slots);
        let old = std::mem::replace(&mut self.slots, vec![(EMPTY, 0); n]);
        for (key, state) in old {
            if key != EMPTY {
                Self::place(&mut self.slots, rehash(key), key, state);
            }
        }
    }

    /// Keeps only the keys for which `keep(state)` holds, in place, then
    /// gives memory back when the table has become mostly empty.
    pub(crate) fn retain(
        &mut self,
        mut keep: impl FnMut(u64) -> bool,
        rehash: impl Fn(u64) -> u64,
    ) {
        if let Some(state) = self.empty_key_state {
            if !keep(state) {
                self.empty_key_state = None;
            }
        }
        let n = self.slots.len();
        if self.len_in_slots == 0 {
            return;
        }
        // Walk the array once, starting just after an empty slot, taking
        // each key out and putting it back (or dropping it). A key kept at
        // slot j lies in a run of full slots that started after the walk's
        // first empty slot, so putting it back lands it at its home or
        // after, at or before j, and every key already walked keeps an
        // unbroken run from its home: the layout rules hold at every step.
        let start = (0..n)
            .find(|&i| self.slots[i].0 == EMPTY)
            .expect("the table always has an empty slot");
        let mut removed = 0;
        for step in 1..=n {
            let j = (start + step) % n;
            let (key, state) = self.slots[j];
            if key == EMPTY {
                continue;
            }
            self.slots[j] = (EMPTY, 0);
            if keep(state) {
                Self::place(&mut self.slots, rehash(key), key, state);
            } else {
                removed += 1;
            }
        }
        self.len_in_slots -= removed;
        // Shrink once a quarter of the slots or fewer hold keys, back to
        // the rebuilt load, so a table that grew for a burst of keys
        // returns the memory.
        if n > MIN_SLOTS && self.len_in_slots * 4 <= n {
            let smaller = Self::slots_for(self.len_in_slots);
            if smaller < n {
                self.rebuild(smaller, &rehash);
            }
        }
    }

    /// Takes every key and state out, leaving the table empty.
    pub(crate) fn drain(&mut self) -> impl Iterator<Item = (u64, u64)> {
        let slots = std::mem::take(&mut self.slots);
        self.len_in_slots = 0;
        let empty_key = self.empty_key_state.take().map(|state| (EMPTY, state));
        slots
            .into_iter()
            .filter(|&(key, _)| key != EMPTY)
            .chain(empty_key)
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

    #[derive(Debug, Clone)]
    enum Op {
        Decide(u64, u64),
        Retain(u64),
    }

    fn ops() -> impl Strategy<Value = Vec<Op>> {
        prop::collection::vec(
            prop_oneof![
                8 => (prop_oneof![0u64..64, any::<u64>()], any::<u64>()).prop_map(|(k, v)| Op::Decide(k, v)),
                1 => (1u64..5).prop_map(Op::Retain),
            ],
            0..600,
        )
    }

    /// Runs `ops` on the table and on a `HashMap`: "decide" updates a
    /// key's state (inserting it when new); "retain" keeps the states not
    /// divisible by its argument. Both must hold the same keys and states
    /// after every step, and the layout rules must hold.
    fn check(ops: &[Op], hash: fn(u64) -> u64) -> Result<(), TestCaseError> {
        let mut table = PackedTable::default();
        let mut model: HashMap<u64, u64> = HashMap::new();
        for op in ops {
            match *op {
                Op::Decide(key, state) => {
                    match table.find_mut(hash(key), key) {
                        Some(s) => {
                            prop_assert_eq!(model.get(&key), Some(&*s));
                            *s = state;
                        }
                        None => {
                            prop_assert!(!model.contains_key(&key));
                            table.insert_new(hash(key), key, state, hash);
                        }
                    }
                    model.insert(key, state);
                }
                Op::Retain(d) => {
                    table.retain(|s| s % d != 0, hash);
                    model.retain(|_, s| *s % d != 0);
                }
            }
            prop_assert_eq!(table.len(), model.len());
            check_layout(&table, hash)?;
        }
        for (&key, &state) in &model {
            prop_assert_eq!(table.find_mut(hash(key), key).copied(), Some(state));
        }
        let mut drained: Vec<_> = table.drain().collect();
        let mut expected: Vec<_> = model.into_iter().collect();
        drained.sort_unstable();
        expected.sort_unstable();
        prop_assert_eq!(drained, expected);
        prop_assert_eq!(table.len(), 0);
        Ok(())
    }

    fn check_layout(table: &PackedTable, hash: fn(u64) -> u64) -> Result<(), TestCaseError> {
        let n = table.slots.len();
        if n == 0 {
            prop_assert_eq!(table.len_in_slots, 0);
            return Ok(());
        }
        let full = table.slots.iter().filter(|s| s.0 != EMPTY).count();
        prop_assert_eq!(full, table.len_in_slots);
        prop_assert!(full < n, "no empty slot");
        prop_assert!(
            full * LOAD_DENOMINATOR <= n * MAX_LOAD,
            "{full} keys in {n} slots"
        );
        for (i, &(key, _)) in table.slots.iter().enumerate() {
            if key == EMPTY {
                continue;
            }
            // Every slot from the key's home to the key is full.
            let mut j = PackedTable::home(hash(key), n);
            while j != i {
                prop_assert!(table.slots[j].0 != EMPTY, "gap before key {key} at {i}");
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
            table.insert_new(good(key), key, key, good);
            let load = table.len() as f64 / table.slots() as f64;
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
            table.insert_new(good(key), key, key, good);
        }
        let big = table.slots();
        table.retain(|state| state <= 100, good);
        assert_eq!(table.len(), 100);
        assert!(table.slots() * 10 < big, "{} of {big}", table.slots());
        for key in 1..=100u64 {
            assert_eq!(table.find_mut(good(key), key).copied(), Some(key));
        }
        table.retain(|_| false, good);
        assert_eq!(table.len(), 0);
        assert_eq!(table.find_mut(good(1), 1), None);
    }

    #[test]
    fn the_empty_marker_is_a_key_like_any_other() {
        let mut table = PackedTable::default();
        assert_eq!(table.find_mut(good(EMPTY), EMPTY), None);
        table.insert_new(good(EMPTY), EMPTY, 5, good);
        table.insert_new(good(1), 1, 6, good);
        assert_eq!(table.len(), 2);
        *table.find_mut(good(EMPTY), EMPTY).unwrap() = 7;
        assert_eq!(table.find_mut(good(1), 1).copied(), Some(6));
        let mut all: Vec<_> = table.drain().collect();
        all.sort_unstable();
        assert_eq!(all, vec![(EMPTY, 7), (1, 6)]);
    }
}
