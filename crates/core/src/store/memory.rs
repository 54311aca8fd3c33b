//! The embedded, concurrent in-memory store.
//!
//! Keys are spread over shards, each a hash table with its own lock. A
//! decision on a known key whose state packs into 64 bits (see below for
//! which do) decides on the state it reads from the key's slot and writes
//! the new state with one compare-and-swap on that slot, deciding again if
//! another thread wrote first; a decision that changes nothing writes nothing. While one
//! thread decides, it reaches the slot under the shard's lock, whose
//! cache line then stays in its core. While several do, each reaches it
//! without the lock, through its own view of the shard's array
//! (`views.rs`), so the only cache line a decision writes is its key's,
//! and threads deciding different keys do not slow each other down. New
//! keys, keys
//! forgotten, shards whose states stopped packing, and every change to a
//! table's structure go through the shard's lock (see `table.rs` for the
//! rules that let the two meet). A key under a flood of refusals is
//! pinned: its state moves out of its slot into the shard's `RefusedKey`,
//! where every thread reads it from one cache line and repeats of a
//! refusal are answered from a memo, and only the lock holder writes it.
//! Every decision on a key is linearizable: at its compare-and-swap, at
//! its read of the state when it writes nothing, or under the lock.
//!
//! A key is hashed once, with a keyed, per-store randomly seeded hash
//! (foldhash): the bits pick the shard and the slot, and an attacker who
//! chooses keys cannot predict which collide (no hash flooding). Its
//! `quality` form, not `fast`: for a `u64` the fast form is one folded
//! multiply, and with some seeds consecutive keys (1 to 20,000) sat 17 to
//! 40 slots from home on average in a shard, against about 2, in about one
//! store in twenty (`keys_sit_near_their_home_slots` failed 2 runs of 40,
//! and none of 80 with the extra multiply of `quality`, which costs 0 to
//! 11 per cent in measured medians: docs/bench.md, "Hash flooding").
//!
//! Memory per key: a shard keeps `(u64 key, u64 packed state)` pairs, 16
//! bytes, in a flat open-addressing table (`table.rs`) rebuilt 9/16 full
//! and grown at 13/16, so a key costs 20 to 29 bytes as the table fills
//! (forgetting keys can leave it a little over a quarter full before it
//! shrinks: up to 64 bytes per key held), while every state fits the
//! 64-bit layout its policy chose from the configuration
//! ([`Policy::pack`]). At wall-clock times (until the year 2100) that is
//! every state of `fixed-window` up to 4,194,303 per window; of
//! `sliding-window-counter` up to 65,535 per second or 262,143 per minute
//! (limits of 2,048 or more store the window's index rather than its
//! start); of `token-bucket` while `burst * window_ms / gcd(limit,
//! window_ms)` stays below 2^22 (1,000 per minute: 60,000); and of `gcra`
//! up to a limit of 4,194,303 (while `burst * window_ms` stays far below
//! 2^64). For the reference configuration (100 per 1000 ms) they pack
//! every time below 2^47 ms (over 4,000 years). Decisions unpack, decide
//! on the wide state and pack again, so they are the same either way. The
//! first state of a shard that does not fit turns that shard, once, into a
//! SwissTable of `(u64 key, state)` with the wide states, which adds one
//! control byte per slot and keeps its load between 7/16 and 7/8 as it
//! grows (a sweep can leave it down to a quarter of 7/8 before it shrinks,
//! to room for twice the keys left), and decides under its lock. A state
//! is 16 bytes for `fixed-window` and `gcra`, 24 for
//! `sliding-window-counter` and `token-bucket`, and 40 for `sliding-log`
//! (which never packs) plus its log's buffer, 16 bytes for each entry it
//! has room for, room for at least 4 once it holds one (a key of one entry
//! measured some 160 to 185 bytes in all, the allocator's share and the
//! table's load included: 183 for a million such keys), in a
//! store of one policy
//! (`MemoryStore<FixedWindow>`); in a store built from a [`PolicyConfig`]
//! ([`MemoryStore::for_config`], `LocalLimiter`), whose state is
//! [`AnyState`](crate::registry::AnyState), every wide state takes the
//! largest, 40 bytes: 49 bytes a slot with its key and control byte, so
//! 56 to 112 bytes a key in a wide store by the table's load (about 103
//! measured).
//! `ratewarden bench` measures the bytes per key. While more than one
//! thread decides, each keeps its own handle on the arrays it decided in
//! (so that a decision writes no shared memory): an array a sweep or a
//! growth replaced is freed once every such thread has decided on the
//! store again (or through another store's handles, for a store dropped),
//! or exited, so a pool whose threads fall idle after a busy spell holds
//! the arrays it last used, even after `forget_idle`, until they do.
//!
//! The store holds at most [`MemoryOptions::max_keys`] keys, rounded up to
//! a multiple of its shard count ([`MemoryStore::max_keys`]). It forgets
//! keys only in [`MemoryStore::forget_idle`], an explicit call with a bound,
//! and when a full shard needs room (below), and only keys whose forgetting
//! cannot change a decision at or after the time it is given (docs/SPEC.md,
//! "open points", says where that departs from SPEC "Memory": a request
//! stamped earlier and decided later): the library starts no
//! threads. When a new key arrives at a full shard,
//! the store first forgets that shard's idle keys (at most once per
//! millisecond of `now_ms`, and, in a shard of more than 256 keys, only
//! once a new key or a millisecond per 256 keys held has come since the
//! shard was last swept, so that a flood of new keys at a full store costs
//! each request a bounded share of a sweep); if the shard is still full a
//! request that would admit gets
//! [`StoreErrorKind::CapacityExhausted`] and is never silently admitted
//! (one that admits nothing, a peek or a cost no state admits, is answered
//! as a new key's, and nothing is kept).

use std::hash::BuildHasher;
use std::sync::atomic::{fence, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use foldhash::quality::RandomState;
use hashbrown::HashTable;
use spin::mutex::{SpinMutex, SpinMutexGuard};

use super::table::{PackedTable, Replaced, DEAD, EMPTY, PINNED};
use super::views::{self, StoreViews};
use super::Store;
use crate::error::check_request;
use crate::policy::Policy;
use crate::registry::{AnyPolicy, PolicyConfig};
use crate::{ConfigError, Decision, StoreError, StoreErrorKind, MAX_SAFE};

/// The keys of a full shard one new key, or one millisecond, pays for
/// sweeping (see `ShardTable::new_keys_since_sweep`): a shard of up to
/// this many keys is swept for every new key (once per millisecond of
/// `now_ms`), a shard of 65,536 once per 256 new keys or 256 ms.
const FULL_SWEEP_KEYS_PER_NEW_KEY: usize = 256;

/// The most a request's time may lie before its shard last forgot a key
/// for the request to be taken as one in flight across the forgetting (its
/// thread read the clock, then waited for a core or for the lock), and
/// decided as at the forgetting's time (see `MemoryStore::decide_other`).
/// A request from further back comes from another clock than the
/// forgetting's, or a clock stepped back, and keeps its own time: moved
/// that far, a new key would count as from the future. A second, whatever
/// the window: how long a request is in flight has nothing to do with it.
const MAX_IN_FLIGHT_MS: u64 = 1000;

/// The largest power of two at most `n` (`n >= 1`).
const fn prev_power_of_two(n: usize) -> usize {
    1 << (usize::BITS - 1 - n.leading_zeros())
}

/// Limits and layout of a [`MemoryStore`].
///
/// With serde, `{"max_keys": N, "shards": N}`; a field left out takes its
/// [`Default`] value, and a field it does not know is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MemoryOptions {
    /// The most keys the store holds at once, split evenly over the
    /// shards: each holds `max_keys / shards`, rounded up, at least 1, so
    /// the store holds up to `shards - 1` more than this when it does not
    /// divide evenly ([`MemoryStore::max_keys`] gives the figure). A
    /// request that would admit on a new key whose shard is full gets
    /// [`StoreErrorKind::CapacityExhausted`], so a store can also fill a
    /// little before that figure in all. One that admits nothing (a peek,
    /// or a cost above the limit or burst) is answered as a new key's, and
    /// nothing is kept.
    pub max_keys: usize,
    /// Number of shards, rounded up to a power of two, at most 65,536; 0
    /// picks four per available core (at least 16), but no more than give
    /// each shard 1,024 keys (a small store gets fewer shards, down to one
    /// below 2,048 keys, where it holds `max_keys` keys exactly).
    pub shards: usize,
}

impl MemoryOptions {
    /// The fewest keys per shard when the store picks its shard count
    /// (`shards: 0`): with fewer, shards fill unevenly and a store refuses
    /// new keys well before `max_keys` in all.
    pub const MIN_KEYS_PER_AUTO_SHARD: usize = 1024;
}

impl Default for MemoryOptions {
    /// 4,194,304 keys (2^22) and automatic sharding: about 84 MiB when
    /// full of packed states; when they stop packing (see the module's
    /// docs), about 200 MiB for a `MemoryStore<FixedWindow>` and 400 MiB
    /// for a store built from a `PolicyConfig`. Measured in one fresh
    /// process: its resident memory (`/proc/self/statm`) before and after
    /// deciding new keys at `now_ms` 1.8e12 until the store refused them
    /// (a 5,000-per-second `sliding-window-counter`, packed and, before
    /// its index layout, wide; a 2^40-per-second `fixed-window`, wide).
    fn default() -> Self {
        MemoryOptions {
            max_keys: 1 << 22,
            shards: 0,
        }
    }
}

/// What one [`MemoryStore::forget_idle`] call did, and what full shards
/// did since the call before it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
// Read, not built, by users: a later field must not break them.
#[non_exhaustive]
pub struct Housekeeping {
    /// Keys looked at.
    pub scanned: usize,
    /// Keys forgotten.
    pub forgotten: usize,
    /// Keys forgotten by full shards looking for room for a new key, since
    /// the previous `forget_idle` call (not in `forgotten`). On a store
    /// that fills, this is where most forgetting happens: a full shard
    /// looks through itself every few new keys, before housekeeping does.
    pub forgotten_for_new_keys: usize,
}

/// The in-memory store for one policy. Cloning is cheap: clones share the
/// same keys (one budget), through a reference-counted pointer.
///
/// Time is passed in; the store holds at most [`MemoryStore::max_keys`]
/// keys (`max_keys`, rounded up to a multiple of the shards) and forgets
/// them only when asked, or when a full shard needs room:
///
/// ```
/// use ratewarden_core::{MemoryOptions, MemoryStore, PolicyConfig, PolicyKind};
/// // 2 per second, fixed windows, at most 3 keys.
/// let config = PolicyConfig::new(PolicyKind::FixedWindow, 2, 1000);
/// let options = MemoryOptions { max_keys: 3, shards: 0 };
/// let store = MemoryStore::for_config(&config, options).unwrap();
///
/// assert!(store.decide(7, 0, 1).unwrap().allowed);
/// assert!(store.decide(7, 10, 1).unwrap().allowed);
/// let refused = store.decide(7, 20, 1).unwrap(); // a value, not an error
/// assert_eq!((refused.allowed, refused.retry_after_ms), (false, Some(980)));
///
/// // Two more keys fill the store; a fourth is an error while all three
/// // still count, never a silent admit.
/// store.decide(8, 20, 1).unwrap();
/// store.decide(9, 20, 1).unwrap();
/// assert!(store.decide(10, 30, 1).unwrap_err().is_capacity_exhausted());
///
/// // A window later none of them counts: forget_idle drops them (a
/// // timer would call it with a small bound, over and over).
/// let swept = store.forget_idle(1000, 1024);
/// assert_eq!((swept.scanned, swept.forgotten), (3, 3));
/// assert_eq!(store.entries_tracked(), 0);
/// ```
pub struct MemoryStore<P: Policy = AnyPolicy> {
    inner: Arc<Inner<P>>,
}

impl<P: Policy> Clone for MemoryStore<P> {
    fn clone(&self) -> Self {
        MemoryStore {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<P: Policy> std::fmt::Debug for MemoryStore<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("shards", &self.inner.shards.len())
            .field("max_keys_per_shard", &self.inner.max_keys_per_shard)
            .field("entries_tracked", &self.entries_tracked())
            .finish()
    }
}

struct Inner<P: Policy> {
    policy: P,
    hasher: RandomState,
    shards: Box<[Shard<P::State>]>,
    shard_mask: usize,
    max_keys_per_shard: usize,
    /// Written by every `forget_idle` call, so apart from what decisions
    /// read.
    sweep_cursor: Padded<AtomicUsize>,
    /// Keys forgotten to make room for new ones since `forget_idle` last
    /// took the count; written only by a full shard's sweep.
    forgotten_for_new_keys: Padded<AtomicUsize>,
    /// How many keys the shards hold, changed under a shard's lock where a
    /// key is stored or forgotten (a new key, a sweep; never by a decision
    /// on a known key): so that counting the keys, and finding a store
    /// empty, takes no shard's lock. A server with thousands of rules has
    /// a store for each, most of them empty, and counts them all for every
    /// metrics scrape and housekeeping pass.
    keys: Padded<AtomicUsize>,
    /// Read by every lock-free decision, written only when an array is
    /// retired.
    views: Padded<StoreViews>,
}

/// A value on cache lines of its own.
#[repr(align(128))]
struct Padded<T>(T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// One shard, on its own cache line so that two cores locking neighbouring
/// shards do not contend for one line.
///
/// The lock is a spin lock: taking it is one atomic read-modify-write and
/// releasing it a plain store, where a parking mutex needs a second
/// read-modify-write to release (it must check for sleeping waiters). The
/// lock is taken only by new keys, wide shards and housekeeping, and held
/// for a few dozen nanoseconds (longer only to replace an array), so
/// waiting is rare and short; a waiter that keeps failing yields its core
/// (see [`Shard::lock`]) so that a holder that was preempted can finish.
#[repr(align(64))]
struct Shard<S> {
    table: SpinMutex<ShardTable<S>>,
    refused: RefusedKey,
}

/// The shard's pinned key, a key under a flood of refusals: its packed
/// state, readable without the lock, with the last refusal decided for it.
///
/// A key over its limit is refused again and again, and a refusal usually
/// leaves the state as it was (same window, nothing refilled). Such a
/// refusal needs no write: a reader takes a consistent snapshot of the
/// key's state here, decides on it, and if the decision is a refusal that
/// leaves the state unchanged, that decision is exactly the one the locked
/// path would have made at the instant of the snapshot (linearizable
/// there). Anything else (an admission, a rolled window, a refilled bucket,
/// a snapshot torn by a writer) goes through the lock. This answers a
/// flood's repeats from one cache line per shard, shared by every thread,
/// without the lock, the thread's view or the probe.
///
/// Pinning is what keeps the snapshot true while other keys are decided
/// without the lock: the pinned key's slot holds [`PINNED`] instead of its
/// state, so a decision that finds the slot goes to the lock, and only a
/// lock holder changes the state (here). A lock holder pins a key by
/// swapping its state for `PINNED` and then holding it here, and unpins it
/// by clearing this entry and then putting the state back in the slot;
/// between the two steps every reader goes to the lock.
///
/// A flood repeats the same request within one millisecond: a decision is
/// a pure function of (state, `now_ms`, cost), so the snapshot also carries
/// the refusal last decided on this very state (the memo) with its
/// `now_ms` and cost, and an identical request takes it as it is, without
/// deciding again.
///
/// Coherence: only a holder of the shard's lock writes here. It updates
/// the entry (dropping the memo) whenever it changes the held key's state,
/// and unpins the key whenever states stop being packed, keys are
/// forgotten or the array is replaced; a memo is only written for the
/// state it was decided on (checked by the sequence number under the
/// lock). A seqlock with atomic fields (`seq` odd while written) gives
/// readers consistent snapshots with no unsafe code.
#[repr(align(64))]
#[derive(Default)]
struct RefusedKey {
    seq: AtomicU64,
    /// [`HELD`], [`MEMO`] and [`MEMO_RETRY`] bits.
    flags: AtomicU64,
    key: AtomicU64,
    packed: AtomicU64,
    memo_now_ms: AtomicU64,
    memo_cost: AtomicU64,
    memo_retry_ms: AtomicU64,
    memo_remaining: AtomicU64,
}

/// A key is held.
const HELD: u64 = 1;
/// The held key has a memo.
const MEMO: u64 = 2;
/// The memo's `retry_after_ms` is `Some(memo_retry_ms)`, not `None`.
const MEMO_RETRY: u64 = 4;

/// What a reader saw of the held key: its packed state, the sequence
/// number it was read at, and the memo if it is for this very request.
struct Snapshot {
    seq: u64,
    packed: u64,
    memo: Option<Decision>,
}

impl RefusedKey {
    /// The held state of `key`, if it is the key held and no write was in
    /// progress, with the memo when it was decided at `now_ms` for `cost`.
    #[inline]
    fn read(&self, key: u64, now_ms: u64, cost: u64) -> Option<Snapshot> {
        let seq = self.seq.load(Ordering::Acquire);
        let flags = self.flags.load(Ordering::Relaxed);
        let held_key = self.key.load(Ordering::Relaxed);
        // Most requests are for other keys: they leave here, having read
        // two fields. Leaving early is always safe (the lock decides).
        if flags & HELD == 0 || held_key != key {
            return None;
        }
        let packed = self.packed.load(Ordering::Relaxed);
        let memo_now_ms = self.memo_now_ms.load(Ordering::Relaxed);
        let memo_cost = self.memo_cost.load(Ordering::Relaxed);
        let memo_retry_ms = self.memo_retry_ms.load(Ordering::Relaxed);
        let memo_remaining = self.memo_remaining.load(Ordering::Relaxed);
        // Orders the field reads before the second read of `seq` (the
        // seqlock reader's protocol with atomic fields).
        fence(Ordering::Acquire);
        // A torn or in-progress write: the flags and key read above may
        // belong to it, so nothing read here is used.
        if self.seq.load(Ordering::Relaxed) != seq || seq & 1 != 0 {
            return None;
        }
        let memo = (flags & MEMO != 0 && memo_now_ms == now_ms && memo_cost == cost).then(|| {
            let retry = (flags & MEMO_RETRY != 0).then_some(memo_retry_ms);
            Decision::refused(retry, memo_remaining)
        });
        Some(Snapshot { seq, packed, memo })
    }

    /// The key held and its state; only for a lock holder.
    fn held(&self) -> Option<(u64, u64)> {
        (self.flags.load(Ordering::Relaxed) & HELD != 0).then(|| {
            (
                self.key.load(Ordering::Relaxed),
                self.packed.load(Ordering::Relaxed),
            )
        })
    }

    /// Holds `key` with `packed` and no memo; only for a lock holder.
    fn hold(&self, key: u64, packed: u64) {
        self.write(|| {
            self.key.store(key, Ordering::Relaxed);
            self.packed.store(packed, Ordering::Relaxed);
            self.flags.store(HELD, Ordering::Relaxed);
        });
    }

    /// Adds the memo `refusal` of a request at `now_ms` for `cost`, decided
    /// on the state read at sequence number `seq`, if nothing was written
    /// since; only for a lock holder. A wait longer than `u64::MAX` ms is
    /// not memoized (each repeat is decided again on the snapshot).
    fn memoize(&self, seq: u64, now_ms: u64, cost: u64, refusal: &Decision) {
        if self.seq.load(Ordering::Relaxed) != seq || refusal.retry_after_wide_ms() != [0, 0] {
            return;
        }
        self.write(|| {
            self.memo_now_ms.store(now_ms, Ordering::Relaxed);
            self.memo_cost.store(cost, Ordering::Relaxed);
            self.memo_retry_ms
                .store(refusal.retry_after_ms.unwrap_or(0), Ordering::Relaxed);
            self.memo_remaining
                .store(refusal.remaining, Ordering::Relaxed);
            let retry = if refusal.retry_after_ms.is_some() {
                MEMO_RETRY
            } else {
                0
            };
            self.flags.store(HELD | MEMO | retry, Ordering::Relaxed);
        });
    }

    /// Drops the key held, if any; only for a lock holder.
    fn clear(&self) {
        if self.flags.load(Ordering::Relaxed) & HELD != 0 {
            self.write(|| self.flags.store(0, Ordering::Relaxed));
        }
    }

    /// Runs `fields` (relaxed stores) as one seqlock write.
    #[inline]
    fn write(&self, fields: impl FnOnce()) {
        let seq = self.seq.load(Ordering::Relaxed);
        self.seq.store(seq.wrapping_add(1), Ordering::Relaxed);
        // Orders the odd `seq` before the field writes.
        fence(Ordering::Release);
        fields();
        self.seq.store(seq.wrapping_add(2), Ordering::Release);
    }
}

impl<S> Shard<S> {
    /// Spins briefly, then yields between attempts.
    #[inline]
    fn lock(&self) -> SpinMutexGuard<'_, ShardTable<S>> {
        if let Some(guard) = self.table.try_lock() {
            return guard;
        }
        self.lock_contended()
    }

    #[cold]
    fn lock_contended(&self) -> SpinMutexGuard<'_, ShardTable<S>> {
        for _ in 0..128 {
            if !self.table.is_locked() {
                if let Some(guard) = self.table.try_lock() {
                    return guard;
                }
            }
            std::hint::spin_loop();
        }
        loop {
            std::thread::yield_now();
            if let Some(guard) = self.table.try_lock() {
                return guard;
            }
        }
    }
}

struct ShardTable<S> {
    entries: Entries<S>,
    /// [`views::thread_mark`] of the thread that last decided a known key
    /// here under the lock, and [`StoreViews::quiet`] then: another thread
    /// since the views were last turned off turns them on.
    last_thread: (usize, u64),
    /// The key last refused here under the lock without a change: refused
    /// twice in a row, it is pinned.
    last_refused: Option<u64>,
    /// The `now_ms` of this shard's last sweep, by a full shard making room
    /// or by [`MemoryStore::forget_idle`]: a full shard is swept at most
    /// once per millisecond of `now_ms`.
    last_sweep_ms: Option<u64>,
    /// The latest `now_ms` at which a sweep of this shard forgot a key
    /// (0: none has). A new key's request stamped before it is decided as
    /// at this time (see `MemoryStore::decide_other`).
    forgot_at_ms: u64,
    /// New keys that came to this shard (stored or refused) since it was
    /// last swept. A sweep looks at every key of the shard under its lock,
    /// milliseconds for a large one, so a full shard is swept again only
    /// once one new key, or one millisecond of `now_ms`, per
    /// [`FULL_SWEEP_KEYS_PER_NEW_KEY`] keys it holds has come: a flood of
    /// new keys at a full store pays that share of a sweep per request,
    /// not a whole sweep each (which, taking longer than the millisecond
    /// bound, it had), and a trickle waits no longer than the time bound.
    new_keys_since_sweep: usize,
}

/// A shard's keys: packed states while every one fits in 64 bits, wide
/// states from the first one that does not (see the module's notes).
enum Entries<S> {
    Packed(PackedTable),
    Wide(HashTable<(u64, S)>),
}

impl<S> Entries<S> {
    fn len(&self) -> usize {
        match self {
            Entries::Packed(t) => t.len(),
            Entries::Wide(t) => t.len(),
        }
    }
}

/// A request, as the out-of-line part of the locked path takes it.
#[derive(Clone, Copy)]
struct Request {
    key: u64,
    hash: u64,
    now_ms: u64,
    cost: u64,
}

/// Why a decision on a packed state could not be made in place.
enum NotInPlace {
    /// The key was forgotten, or its array retired.
    Dead,
    /// The key is pinned: its state is in the shard's [`RefusedKey`].
    Pinned,
    /// The new state does not pack.
    Wide,
}

impl MemoryStore<AnyPolicy> {
    /// A store for a configuration of the registry, validated here.
    pub fn for_config(config: &PolicyConfig, options: MemoryOptions) -> Result<Self, ConfigError> {
        Ok(MemoryStore::new(config.build()?, options))
    }
}

impl<P: Policy> MemoryStore<P> {
    /// A store deciding every key under `policy`.
    pub fn new(policy: P, options: MemoryOptions) -> Self {
        let wanted = if options.shards == 0 {
            let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
            // Every shard fills on its own: with few keys per shard, one
            // fills while the store as a whole is far from max_keys.
            let fits = (options.max_keys / MemoryOptions::MIN_KEYS_PER_AUTO_SHARD).max(1);
            (cores * 4).max(16).min(prev_power_of_two(fits))
        } else {
            options.shards
        };
        // At most 2^16 shards: the shard index is taken from hash bits 32..48.
        let shards = wanted.clamp(1, 1 << 16).next_power_of_two();
        let max_keys_per_shard = options.max_keys.div_ceil(shards).max(1);
        // A policy that cannot pack even a new key's state (the log) starts
        // wide rather than widening every shard on its first key.
        let packs = pack(&policy, &policy.new_state(0)).is_some();
        MemoryStore {
            inner: Arc::new(Inner {
                policy,
                hasher: RandomState::default(),
                shards: (0..shards)
                    .map(|_| Shard {
                        refused: RefusedKey::default(),
                        table: SpinMutex::new(ShardTable {
                            entries: if packs {
                                Entries::Packed(PackedTable::default())
                            } else {
                                Entries::Wide(HashTable::new())
                            },
                            last_sweep_ms: None,
                            forgot_at_ms: 0,
                            new_keys_since_sweep: 0,
                            last_thread: (0, 0),
                            last_refused: None,
                        }),
                    })
                    .collect(),
                shard_mask: shards - 1,
                max_keys_per_shard,
                sweep_cursor: Padded(AtomicUsize::new(0)),
                forgotten_for_new_keys: Padded(AtomicUsize::new(0)),
                keys: Padded(AtomicUsize::new(0)),
                views: Padded(StoreViews::new(shards)),
            }),
        }
    }

    /// The policy every key is decided by.
    pub fn policy(&self) -> &P {
        &self.inner.policy
    }

    /// The most keys this store holds (rounded up to a multiple of the
    /// shard count).
    pub fn max_keys(&self) -> usize {
        self.inner
            .max_keys_per_shard
            .saturating_mul(self.inner.shards.len())
    }

    /// Decides a request of `cost` for `key` at `now_ms`.
    ///
    /// Errors: `now_ms` or `cost` above `2^53 - 1` (invalid input), or a
    /// request that would admit on a new key whose shard is full of keys
    /// that could not be forgotten when it was last swept (capacity
    /// exhausted). A request on a new key that admits nothing (a peek, or
    /// a cost above the limit or burst) is answered as a new key's even
    /// then, and nothing is kept.
    ///
    /// `now_ms` is every key's clock, not this key's alone: a new key on a
    /// full shard has the shard swept at `now_ms` (SPEC, "Memory"), so a
    /// time far ahead of the others' forgets keys that are not idle by
    /// theirs, whose next requests then start afresh. Give every call of
    /// one store times from one clock (as [`LocalLimiter`] does); a time
    /// taken from a client is no such clock.
    ///
    /// [`LocalLimiter`]: crate::LocalLimiter
    #[inline(always)]
    pub fn decide(&self, key: u64, now_ms: u64, cost: u64) -> Result<Decision, StoreError> {
        // The range check inline, its error (which formats a message) out
        // of line: every request pays for the comparison only.
        if now_ms > MAX_SAFE || cost > MAX_SAFE {
            check_request(now_ms, cost)?;
        }
        let inner = &*self.inner;
        let (hash, index) = inner.locate(key);
        let shard = &inner.shards[index];
        // A flood's refusal that changes nothing, decided on the pinned
        // key's snapshot (see `RefusedKey`): taken from the memo when this
        // very request was decided last.
        match shard.refused.read(key, now_ms, cost) {
            Some(Snapshot {
                memo: Some(refusal),
                ..
            }) => return Ok(refusal),
            Some(snapshot) => {
                return self.decide_snapshot(index, snapshot, hash, key, now_ms, cost);
            }
            None => {}
        }
        // A known key, decided in place through this thread's view, when
        // more than one thread decides (see `views.rs`). The key `EMPTY`
        // has no slot.
        if key != EMPTY && inner.views.enabled() {
            let policy = &inner.policy;
            let lock_free = inner.views.decide(index, packed_hash(hash), key, |cell| {
                decide_packed(policy, cell, now_ms, cost)
                    .ok()
                    .map(|(decision, unchanged)| (decision, unchanged.is_some()))
            });
            if let Some((decision, pin)) = lock_free {
                if pin {
                    self.pin(index, hash, key);
                }
                return Ok(decision);
            }
        }
        self.decide_locked(index, hash, key, now_ms, cost)
    }

    /// Decides on the pinned key's snapshot, and returns that decision if
    /// it is a refusal that leaves the state unchanged; otherwise decides
    /// under the lock. Out of line: a refused key's first repeat comes
    /// here once, and the memo answers the rest, so the callers' inlined
    /// paths need not carry it.
    #[inline(never)]
    fn decide_snapshot(
        &self,
        index: usize,
        snapshot: Snapshot,
        hash: u64,
        key: u64,
        now_ms: u64,
        cost: u64,
    ) -> Result<Decision, StoreError> {
        let policy = &self.inner.policy;
        let shard = &self.inner.shards[index];
        let mut state = policy.unpack(snapshot.packed);
        let decision = policy.decide(&mut state, now_ms, cost);
        if !decision.allowed && pack(policy, &state) == Some(snapshot.packed) {
            // Memoized for the identical requests of a flood, when the
            // lock is free: never waited for.
            if let Some(_guard) = shard.table.try_lock() {
                shard.refused.memoize(snapshot.seq, now_ms, cost, &decision);
            }
            return Ok(decision);
        }
        self.decide_locked(index, hash, key, now_ms, cost)
    }

    /// Pins `key`, a flood's target (see `RefusedKey`), in place of the
    /// shard's pinned key, if the lock is free (never waited for) and the
    /// key is still packed and alive.
    #[cold]
    #[inline(never)]
    fn pin(&self, index: usize, hash: u64, key: u64) {
        let shard = &self.inner.shards[index];
        let Some(guard) = shard.table.try_lock() else {
            return;
        };
        if let Entries::Packed(entries) = &guard.entries {
            self.pin_locked(shard, entries, hash, key);
        }
    }

    /// [`MemoryStore::pin`] for a lock holder.
    #[cold]
    #[inline(never)]
    fn pin_locked(&self, shard: &Shard<P::State>, entries: &PackedTable, hash: u64, key: u64) {
        self.inner.unpin(shard, entries);
        if let Some(cell) = entries.cell(packed_hash(hash), key) {
            let packed = cell.load(Ordering::Acquire);
            // Readers that find `PINNED` go to the lock, held here until
            // the key is held.
            if packed != DEAD
                && cell
                    .compare_exchange(packed, PINNED, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
            {
                shard.refused.hold(key, packed);
            }
        }
    }

    /// [`MemoryStore::decide`] under the shard's lock: every decision
    /// while one thread decides, and otherwise a new key, a key forgotten,
    /// the pinned key, a key of a wide shard, or a key this thread had no
    /// view for (the view is then taken, for the next decision). The
    /// commonest, a known key whose state stays packed, is decided here,
    /// inline in the caller (no call, no registers saved); everything else
    /// is out of line, in [`MemoryStore::decide_under_lock`].
    #[inline(always)]
    fn decide_locked(
        &self,
        index: usize,
        hash: u64,
        key: u64,
        now_ms: u64,
        cost: u64,
    ) -> Result<Decision, StoreError> {
        let inner = &*self.inner;
        let policy = &inner.policy;
        let shard = &inner.shards[index];
        let mut guard = shard.lock();
        let table = &mut *guard;
        let seen = (views::thread_mark(), inner.views.quiet());
        if table.last_thread != seen {
            if table.last_thread.1 == seen.1 && table.last_thread.0 != 0 {
                inner.views.enable();
            }
            table.last_thread = seen;
        }
        // Why the key's packed state, when it has one, was not decided in
        // place: the rest of the locked path starts from there.
        let mut found = None;
        if let Entries::Packed(entries) = &table.entries {
            if let Some(cell) = entries.cell(packed_hash(hash), key) {
                // Readers without the lock may update this state too: the
                // same compare-and-swap decides here.
                match decide_packed(policy, cell, now_ms, cost) {
                    Ok((decision, unchanged)) => {
                        if unchanged.is_some() && !decision.allowed {
                            if table.last_refused == Some(key) {
                                self.pin_locked(shard, entries, hash, key);
                            } else {
                                table.last_refused = Some(key);
                            }
                        }
                        if inner.views.enabled() {
                            inner.views.keep(index, entries.slots());
                        }
                        return Ok(decision);
                    }
                    Err(why) => found = Some(why),
                }
            }
        }
        let request = Request {
            key,
            hash,
            now_ms,
            cost,
        };
        self.decide_under_lock(index, guard, request, found)
    }

    /// The rest of [`MemoryStore::decide_locked`], out of line, with the
    /// lock held; offers the shard's array to this thread's view.
    #[inline(never)]
    fn decide_under_lock(
        &self,
        index: usize,
        mut guard: SpinMutexGuard<'_, ShardTable<P::State>>,
        request: Request,
        found: Option<NotInPlace>,
    ) -> Result<Decision, StoreError> {
        let shard = &self.inner.shards[index];
        let decision = self.decide_other(shard, &mut guard, request, found);
        if let Entries::Packed(table) = &guard.entries {
            if self.inner.views.enabled() {
                self.inner.views.keep(index, table.slots());
            }
        }
        decision
    }

    /// Decides what [`MemoryStore::decide_locked`] did not: a new key, a
    /// key forgotten, the pinned key, a key of a wide shard, a state that
    /// stops packing. `found` says why the key's packed state was not
    /// decided in place (`None`: it has none). A dead or pinned state
    /// stays so while the lock is held, so it is not looked up again.
    fn decide_other(
        &self,
        shard: &Shard<P::State>,
        table: &mut ShardTable<P::State>,
        request: Request,
        found: Option<NotInPlace>,
    ) -> Result<Decision, StoreError> {
        let Request {
            key,
            hash,
            now_ms,
            cost,
        } = request;
        let inner = &*self.inner;
        let policy = &inner.policy;
        match found {
            // No packed state, or forgotten: decided as a new key
            // (or a wide one), below.
            None | Some(NotInPlace::Dead) => {}
            Some(NotInPlace::Pinned) => {
                let (held, packed) = shard.refused.held().expect("a pinned key is held");
                debug_assert_eq!(held, key);
                let mut state = policy.unpack(packed);
                let decision = policy.decide(&mut state, now_ms, cost);
                if let Some(packed) = pack(policy, &state) {
                    shard.refused.hold(key, packed);
                    return Ok(decision);
                }
                // The new state does not pack: the shard widens
                // (below), and the wide state decides again, as
                // the held one did: it is the same state.
                inner.widen(shard, &mut table.entries);
            }
            // Every state of the shard goes wide first (exactly,
            // so no decision changes); the wide state is decided
            // below.
            Some(NotInPlace::Wide) => inner.widen(shard, &mut table.entries),
        }
        if let Entries::Wide(entries) = &mut table.entries {
            if let Some((_, state)) = entries.find_mut(hash, |e| e.0 == key) {
                return Ok(policy.decide(state, now_ms, cost));
            }
        }
        // A new key is stored even when its first request was a peek or a
        // refusal, while there is room: that request still recorded a time,
        // and a later request from before it must be decided at that time.
        table.new_keys_since_sweep = table.new_keys_since_sweep.saturating_add(1);
        if table.entries.len() >= inner.max_keys_per_shard {
            let held = table.entries.len();
            let paid_for = table
                .new_keys_since_sweep
                .saturating_mul(FULL_SWEEP_KEYS_PER_NEW_KEY)
                >= held
                // Or time has: a shard is looked through again at least
                // once per `held / 256` ms however few new keys come, so
                // idle keys are not kept from a new one for long.
                || table.last_sweep_ms.is_some_and(|t| {
                    now_ms.saturating_sub(t).saturating_mul(FULL_SWEEP_KEYS_PER_NEW_KEY as u64)
                        >= held as u64
                });
            // Once per millisecond: `!=` rather than `>`, so that a clock
            // stepped back (or a `forget_idle` ahead of the decisions)
            // does not hold sweeps off until time catches up; what pays
            // for them still bounds how often they run.
            if paid_for && table.last_sweep_ms != Some(now_ms) {
                let forgotten = inner.sweep(shard, table, now_ms);
                if forgotten > 0 {
                    inner
                        .forgotten_for_new_keys
                        .fetch_add(forgotten, Ordering::Relaxed);
                }
            }
        }
        // A request stamped just before this shard last forgot a key may
        // be that key's, in flight across the forgetting (its thread read
        // the clock first, the sweep took the lock first): at its own time
        // the forgotten state might have refused it. At the forgetting's
        // time the forgotten state decides as a new key's (that is what
        // let it be forgotten), so the request is decided there: a new
        // key's answer is the same at any time, and only the time its
        // state records moves, by as long as the request was in flight.
        // A request from further back than MAX_IN_FLIGHT_MS keeps its own.
        let in_flight =
            table.forgot_at_ms > now_ms && table.forgot_at_ms - now_ms <= MAX_IN_FLIGHT_MS;
        let at_ms = if in_flight {
            table.forgot_at_ms
        } else {
            now_ms
        };
        let mut state = policy.new_state(at_ms);
        let decision = policy.decide(&mut state, at_ms, cost);
        debug_assert!(
            at_ms == now_ms || {
                let mut own = policy.new_state(now_ms);
                policy.decide(&mut own, now_ms, cost) == decision
            }
        );
        if table.entries.len() >= inner.max_keys_per_shard {
            // No room for the key's state. A request that admits nothing
            // (a peek, or a cost no state admits) is still answered, as a
            // new key's: its state would record only a time, for requests
            // stepping back before it. One that admits needs its state to
            // count what it admitted.
            if cost == 0 || !decision.allowed {
                return Ok(decision);
            }
            return Err(StoreError::new(
                StoreErrorKind::CapacityExhausted,
                format!(
                    "the in-memory store's shard for this key is full ({}; the \
                     store holds at most {} over {}) and none of them had been idle long \
                     enough to be forgotten when it was last looked through; raise max_keys \
                     above the distinct keys seen in the time a key still counts after its \
                     last request",
                    match inner.max_keys_per_shard {
                        1 => "1 key".to_owned(),
                        n => format!("{n} keys"),
                    },
                    self.max_keys(),
                    match inner.shards.len() {
                        1 => "1 shard".to_owned(),
                        n => format!("{n} shards"),
                    }
                ),
            ));
        }
        inner.put_new(shard, &mut table.entries, hash, key, state);
        Ok(decision)
    }

    /// Whether a request for `key` that admits would find a place now: the
    /// store holds the key, or the key's shard is not full. A request that
    /// admits nothing (a peek) is answered for a key not held even in a full
    /// shard, as a new key's, where one that admits fails
    /// ([`StoreErrorKind::CapacityExhausted`]): a caller that checks many
    /// keys with peeks before it decides them for real (a request whose
    /// descriptors must all admit before any is charged) asks this after
    /// each peek, so that it does not charge one key and then find no
    /// room for the next. Another thread may fill or free the shard after.
    pub fn has_room_for(&self, key: u64) -> bool {
        let inner = &*self.inner;
        let (hash, index) = inner.locate(key);
        let table = inner.shards[index].lock();
        if table.entries.len() < inner.max_keys_per_shard {
            return true;
        }
        match &table.entries {
            // A forgotten key's cell is DEAD; a pinned key (PINNED) is held.
            Entries::Packed(entries) => entries
                .cell(packed_hash(hash), key)
                .is_some_and(|cell| cell.load(Ordering::Acquire) != DEAD),
            Entries::Wide(entries) => entries.find(hash, |e| e.0 == key).is_some(),
        }
    }

    /// How many keys the store holds now (while other threads store or
    /// forget keys, as of some instant of the call), without taking any
    /// shard's lock.
    pub fn entries_tracked(&self) -> usize {
        self.inner.keys.load(Ordering::Relaxed)
    }

    /// The count of keys that full shards forgot on their own to make room
    /// for new ones since the previous call (of this or
    /// [`MemoryStore::forget_idle`], which takes it too), without looking
    /// at any key: for a caller about to drop the store, whose count would
    /// otherwise leave with it.
    pub fn take_forgotten_for_new_keys(&self) -> usize {
        self.inner.forgotten_for_new_keys.swap(0, Ordering::Relaxed)
    }

    /// Forgets keys whose forgetting cannot change any later decision at or
    /// after `now_ms`: pass the clock the decisions use. A key the store
    /// no longer holds whose request is stamped up to a second before
    /// `now_ms` (a request in flight across the forgetting) is decided as at
    /// `now_ms`, where the forgotten state decided as a new key's, so what
    /// it admits counts from there (a key never seen included: the store
    /// does not keep which keys it forgot). Looks at whole shards in turn
    /// until at least `max_scanned` keys have been looked at (or every
    /// shard once). Each call resumes where the last one stopped, so a
    /// timer calling it with a small bound sweeps the whole store over
    /// several calls, holding one shard's lock at a time: for as long as
    /// that shard takes to scan, whatever the bound (a shard of 235,000
    /// keys, as a store of 16 shards near its default `max_keys` has,
    /// took some 5 ms on a 2-core machine). More shards
    /// ([`MemoryOptions::shards`]) make each hold shorter. It also takes the count of keys that full
    /// shards forgot on their own since the previous call
    /// ([`Housekeeping::forgotten_for_new_keys`]), so that a caller can
    /// count all forgetting. A `now_ms` past 2^53 - 1, which no decision
    /// takes ([`MemoryStore::decide`] refuses it), forgets nothing: every
    /// key would look idle at such a time, and a mistaken clock (a time in
    /// ns, `u64::MAX` for "later") would empty the store. (A time in µs is
    /// below 2^53 until the year 2255: a valid time, it cannot be told.)
    pub fn forget_idle(&self, now_ms: u64, max_scanned: usize) -> Housekeeping {
        let inner = &*self.inner;
        let mut done = Housekeeping {
            forgotten_for_new_keys: self.take_forgotten_for_new_keys(),
            ..Housekeeping::default()
        };
        // An empty store has nothing to forget: its shards are not locked
        // (a key stored meanwhile is idle at `now_ms` no sooner than the
        // next call).
        if now_ms > MAX_SAFE || inner.keys.load(Ordering::Relaxed) == 0 {
            return done;
        }
        for _ in 0..inner.shards.len() {
            let index = inner.sweep_cursor.fetch_add(1, Ordering::Relaxed) & inner.shard_mask;
            let shard = &inner.shards[index];
            let mut table = shard.lock();
            done.scanned += table.entries.len();
            done.forgotten += inner.sweep(shard, &mut table, now_ms);
            if done.scanned >= max_scanned {
                break;
            }
        }
        done
    }
}

/// `state` packed, when it fits and is neither [`PINNED`] nor [`DEAD`]
/// (the two values the store reserves, the largest two; such a rare state
/// is kept wide instead). A state packing to `PINNED` and stored as one
/// would read back as a pinned key that nothing holds.
#[inline(always)]
fn pack<P: Policy>(policy: &P, state: &P::State) -> Option<u64> {
    const { assert!(PINNED == DEAD - 1) };
    policy.pack(state).filter(|&packed| packed < PINNED)
}

/// Decides on the packed state in `cell` and writes the new state there
/// with a compare-and-swap, deciding again on the state another thread
/// wrote first. A decision that leaves the state as it was writes nothing
/// (linearizable at its read) and returns that state. Nothing is written
/// when the key is dead or pinned, or its new state does not pack.
#[inline(always)]
fn decide_packed<P: Policy>(
    policy: &P,
    cell: &AtomicU64,
    now_ms: u64,
    cost: u64,
) -> Result<(Decision, Option<u64>), NotInPlace> {
    let mut packed = cell.load(Ordering::Acquire);
    loop {
        if packed == DEAD {
            return Err(NotInPlace::Dead);
        }
        if packed == PINNED {
            return Err(NotInPlace::Pinned);
        }
        let mut state = policy.unpack(packed);
        let decision = policy.decide(&mut state, now_ms, cost);
        let new = pack(policy, &state).ok_or(NotInPlace::Wide)?;
        if new == packed {
            return Ok((decision, Some(packed)));
        }
        match cell.compare_exchange_weak(packed, new, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return Ok((decision, None)),
            Err(seen) => packed = seen,
        }
    }
}

/// The hash a packed table places a key by: the store's hash with the
/// shard's bits (32..48, the same for every key of a shard) rotated to the
/// bottom, because the table places keys by the high bits.
#[inline]
fn packed_hash(hash: u64) -> u64 {
    hash.rotate_right(32)
}

impl<P: Policy> Inner<P> {
    /// The hash of `key`, and the index of the shard that holds it. Bits
    /// 32..48 pick the shard: a wide shard's SwissTable uses the low bits
    /// for the slot and the top seven for its control bytes, and a packed
    /// shard's table all but these (see `packed_hash`).
    #[inline(always)]
    fn locate(&self, key: u64) -> (u64, usize) {
        let hash = self.hasher.hash_one(key);
        (hash, (hash >> 32) as usize & self.shard_mask)
    }

    fn packed_hash_of(&self, key: u64) -> u64 {
        packed_hash(self.hasher.hash_one(key))
    }

    /// Tells the views when `replaced` says an array was retired.
    fn retired(&self, replaced: Replaced) {
        if replaced.0 {
            self.views.retired();
        }
    }

    /// Unpins the shard's pinned key, if any (see `RefusedKey`): its
    /// entry is cleared first, so that no reader decides on the snapshot
    /// once the slot can change again. Only for a lock holder.
    fn unpin(&self, shard: &Shard<P::State>, entries: &PackedTable) {
        if let Some((key, packed)) = shard.refused.held() {
            shard.refused.clear();
            let cell = entries
                .cell(self.packed_hash_of(key), key)
                .expect("a pinned key has a cell");
            debug_assert_eq!(cell.load(Ordering::Relaxed), PINNED);
            cell.store(packed, Ordering::Release);
        }
    }

    /// Stores `state` for `key`, which has no live state, packed when it
    /// fits and the shard is still packed, else wide (widening the shard
    /// first).
    fn put_new(
        &self,
        shard: &Shard<P::State>,
        entries: &mut Entries<P::State>,
        hash: u64,
        key: u64,
        state: P::State,
    ) {
        self.keys.fetch_add(1, Ordering::Relaxed);
        if let Entries::Packed(table) = entries {
            if let Some(packed) = pack(&self.policy, &state) {
                if table.is_full() {
                    // The array is about to be replaced.
                    self.unpin(shard, table);
                }
                let replaced =
                    table.put_new(packed_hash(hash), key, packed, |k| self.packed_hash_of(k));
                self.retired(replaced);
                return;
            }
            self.widen(shard, entries);
        }
        if let Entries::Wide(table) = entries {
            table.insert_unique(hash, (key, state), |e| self.hasher.hash_one(e.0));
        }
    }

    /// Turns a packed shard into a wide one, once: every state is unpacked
    /// exactly, so no decision changes, and the packed array is retired
    /// (its readers go to the lock). It costs one pass over the shard,
    /// which holds at most `max_keys_per_shard` keys.
    #[cold]
    fn widen(&self, shard: &Shard<P::State>, entries: &mut Entries<P::State>) {
        if let Entries::Packed(table) = entries {
            self.unpin(shard, table);
            let all = table.drain();
            let mut wide = HashTable::with_capacity(all.len());
            for (key, packed) in all {
                wide.insert_unique(
                    self.hasher.hash_one(key),
                    (key, self.policy.unpack(packed)),
                    |e| self.hasher.hash_one(e.0),
                );
            }
            *entries = Entries::Wide(wide);
            self.views.retired();
        }
    }

    /// Forgets the keys of `table` forgettable at `now_ms`, and returns how
    /// many it forgot.
    fn sweep(
        &self,
        shard: &Shard<P::State>,
        table: &mut ShardTable<P::State>,
        now_ms: u64,
    ) -> usize {
        // Whatever swept, the time and new keys that pay for the next
        // sweep of a full shard count from here. The time is this sweep's,
        // not the latest seen: one call of `forget_idle` with a time far
        // ahead of the decisions' must not hold off the next sweep until
        // they reach it (the next one with their time undoes it).
        table.new_keys_since_sweep = 0;
        table.last_sweep_ms = Some(now_ms);
        let before = table.entries.len();
        self.forget(shard, &mut table.entries, now_ms);
        let forgotten = before - table.entries.len();
        if forgotten > 0 {
            table.forgot_at_ms = table.forgot_at_ms.max(now_ms);
            self.keys.fetch_sub(forgotten, Ordering::Relaxed);
        }
        forgotten
    }

    /// Forgets the keys of `entries` forgettable at `now_ms`.
    fn forget(&self, shard: &Shard<P::State>, entries: &mut Entries<P::State>, now_ms: u64) {
        let policy = &self.policy;
        let hasher = &self.hasher;
        // Give memory back after a large sweep, keeping room to grow.
        match entries {
            Entries::Packed(entries) => {
                // The pinned key's state is judged like any other.
                self.unpin(shard, entries);
                let replaced = entries.retain(
                    |packed| !policy.is_forgettable(&policy.unpack(packed), now_ms),
                    |k| self.packed_hash_of(k),
                );
                self.retired(replaced);
            }
            Entries::Wide(entries) => {
                entries.retain(|(_, state)| !policy.is_forgettable(state, now_ms));
                // `shrink_to` reallocates only when a table with room for
                // twice the keys left has fewer buckets than this one, so
                // when the sweep left at most a quarter of its room (7/8
                // of its buckets) holding keys. It counts buckets, not
                // `capacity()`: a removed key whose slot stays marked
                // deleted does not give its room back to `capacity()`, and
                // sweeping a full table down to a fifth of its keys can
                // leave `capacity()` under four times the keys left. Small
                // tables (room for 64 keys) are kept unless emptied.
                let len = entries.len();
                let room = if len == 0 { 0 } else { (len * 2).max(64) };
                entries.shrink_to(room, |e| hasher.hash_one(e.0));
            }
        }
    }
}

impl<P: Policy> Store for MemoryStore<P> {
    fn decide(&self, key: u64, now_ms: u64, cost: u64) -> Result<Decision, StoreError> {
        MemoryStore::decide(self, key, now_ms, cost)
    }

    fn entries_tracked(&self) -> usize {
        MemoryStore::entries_tracked(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{FixedWindow, PolicyKind, SlidingLog, SlidingWindowCounter, MAX_SAFE};

    #[test]
    fn threads_deciding_one_key_admit_exactly_the_limit() {
        // Four threads race for one key's budget, each compare-and-swap on
        // its state; every admission is counted once, so exactly the limit
        // gets in.
        let store = MemoryStore::new(
            FixedWindow::new(1000, 1000).unwrap(),
            MemoryOptions::default(),
        );
        let admitted: usize = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..4)
                .map(|_| {
                    let store = store.clone();
                    scope.spawn(move || {
                        (0..600)
                            .filter(|_| store.decide(9, 5, 1).unwrap().allowed)
                            .count()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).sum()
        });
        assert_eq!(admitted, 1000);
        assert_eq!(store.decide(9, 5, 0).unwrap().remaining, 0);
    }

    /// Decisions that write nothing (refusals, from the state or the
    /// memo) and those that write race through window rollovers; every
    /// window still admits exactly its limit, with the `remaining` values
    /// of a serial history.
    #[test]
    fn lock_free_refusals_never_refuse_what_a_write_would_admit() {
        const LIMIT: u64 = 50;
        const THREADS: usize = 4;
        const ROUNDS: u64 = 300;
        let store = MemoryStore::new(
            FixedWindow::new(LIMIT, 10).unwrap(),
            MemoryOptions::default(),
        );
        // Time moves on by 1 ms between rounds, when every thread waits at
        // the barrier, so no thread decides with a time older than the
        // store's (that would be decided in the later window, by the
        // clock-regression rule, and blur the per-window count).
        let barrier = std::sync::Barrier::new(THREADS);
        let mut windows = vec![Vec::new(); (ROUNDS / 10) as usize];
        std::thread::scope(|scope| {
            let handles: Vec<_> = (0..THREADS)
                .map(|_| {
                    let (store, barrier) = (store.clone(), &barrier);
                    scope.spawn(move || {
                        let mut admitted = Vec::new();
                        // A panic is held until the last round: a thread
                        // that left the barrier would leave the others
                        // waiting at it for ever instead of failing.
                        let mut failed = None;
                        for now in 0..ROUNDS {
                            barrier.wait();
                            if failed.is_some() {
                                continue;
                            }
                            let round =
                                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                                    for _ in 0..400 {
                                        let d = store.decide(7, now, 1).unwrap();
                                        if d.allowed {
                                            admitted.push((now / 10, d.remaining));
                                        }
                                    }
                                }));
                            failed = round.err();
                        }
                        if let Some(panic) = failed {
                            std::panic::resume_unwind(panic);
                        }
                        admitted
                    })
                })
                .collect();
            for h in handles {
                for (window, remaining) in h.join().unwrap() {
                    windows[window as usize].push(remaining);
                }
            }
        });
        let serial: Vec<u64> = (0..LIMIT).collect();
        for (window, mut remaining) in windows.into_iter().enumerate() {
            remaining.sort_unstable();
            assert_eq!(remaining, serial, "window {window}");
        }
    }

    /// A forgotten key must not stay readable through a thread's view: a
    /// request from before the sweep (the clock stepped back) is then
    /// decided as a new key's, as docs/SPEC.md ("open points") says, not on
    /// the old state (nor on the memo of a refusal of it).
    #[test]
    fn forgetting_a_refused_key_forgets_it_everywhere() {
        let store = MemoryStore::new(FixedWindow::new(2, 10).unwrap(), MemoryOptions::default());
        for _ in 0..2 {
            assert!(store.decide(3, 5, 1).unwrap().allowed);
        }
        assert!(!store.decide(3, 5, 1).unwrap().allowed);
        // Refused twice in a row: pinned; then decided on the snapshot
        // and memoized.
        assert!(!store.decide(3, 6, 1).unwrap().allowed);
        assert!(!store.decide(3, 6, 1).unwrap().allowed);
        assert!(!store.decide(3, 6, 1).unwrap().allowed);
        assert!(shard_of(&store, 3).refused.held().is_some());
        assert_eq!(store.forget_idle(10, usize::MAX).forgotten, 1);
        assert!(store.decide(3, 6, 1).unwrap().allowed);
    }

    /// The shard holding `key`.
    fn shard_of<P: Policy>(store: &MemoryStore<P>, key: u64) -> &Shard<P::State> {
        &store.inner.shards[store.inner.locate(key).1]
    }

    /// A key refused twice in a row by one thread is pinned; its later
    /// requests are decided on its snapshot, or under the lock when they
    /// write, exactly as before; another flooded key of the shard takes
    /// the pin, and the first goes back to its slot with its state.
    #[test]
    fn a_flooded_key_is_pinned_and_unpinned_without_losing_a_count() {
        // Under the lock, and through the views.
        for viewed in [false, true] {
            flood_pin_and_unpin(viewed);
        }
    }

    fn flood_pin_and_unpin(viewed: bool) {
        let options = MemoryOptions {
            max_keys: 1 << 10,
            shards: 1,
        };
        let store = MemoryStore::new(FixedWindow::new(2, 10).unwrap(), options);
        if viewed {
            store.inner.views.enable();
        }
        let held = |store: &MemoryStore<FixedWindow>| shard_of(store, 1).refused.held();
        for key in [1, 2] {
            assert!(store.decide(key, 5, 2).unwrap().allowed);
        }
        assert_eq!(
            store.decide(1, 5, 1).unwrap(),
            Decision::refused(Some(5), 0)
        );
        assert_eq!(held(&store), None);
        assert_eq!(
            store.decide(1, 5, 1).unwrap(),
            Decision::refused(Some(5), 0)
        );
        assert_eq!(held(&store).map(|h| h.0), Some(1));
        // From the snapshot, then from its memo; another time or cost is
        // decided afresh.
        for _ in 0..2 {
            assert_eq!(
                store.decide(1, 5, 1).unwrap(),
                Decision::refused(Some(5), 0)
            );
        }
        assert_eq!(
            store.decide(1, 6, 1).unwrap(),
            Decision::refused(Some(4), 0)
        );
        assert_eq!(store.decide(1, 6, 3).unwrap(), Decision::refused(None, 0));
        // A write (a new window) goes through the lock and stays pinned.
        assert_eq!(store.decide(1, 10, 1).unwrap(), Decision::admitted(1));
        assert_eq!(held(&store).map(|h| h.0), Some(1));
        assert_eq!(store.decide(1, 10, 1).unwrap(), Decision::admitted(0));
        // Key 2, flooded, takes the pin; key 1's state is back in its
        // slot, with both admissions counted.
        for _ in 0..2 {
            assert_eq!(
                store.decide(2, 6, 1).unwrap(),
                Decision::refused(Some(4), 0)
            );
        }
        assert_eq!(held(&store).map(|h| h.0), Some(2));
        assert_eq!(
            store.decide(1, 11, 1).unwrap(),
            Decision::refused(Some(9), 0)
        );
        assert_eq!(store.decide(1, 12, 0).unwrap().remaining, 0);
        // New keys grow the array: the pinned key is unpinned first, and
        // keeps its count.
        for key in 3..40 {
            store.decide(key, 10, 1).unwrap();
        }
        assert_eq!(store.decide(2, 9, 0).unwrap(), Decision::admitted(0));
        assert_eq!(store.entries_tracked(), 39);
    }

    /// The views are on only while more than one thread decides: a second
    /// thread turns them on, and a thread left alone turns them off again.
    /// Decisions are the same throughout.
    #[test]
    fn views_are_on_while_threads_share_the_store() {
        let options = MemoryOptions {
            max_keys: 1 << 10,
            shards: 1,
        };
        let store = MemoryStore::new(FixedWindow::new(1000, 1 << 40).unwrap(), options);
        assert!(store.decide(1, 0, 1).unwrap().allowed);
        assert!(!store.inner.views.enabled());
        std::thread::scope(|scope| {
            scope.spawn(|| assert!(store.decide(2, 0, 1).unwrap().allowed));
        });
        assert!(store.inner.views.enabled());
        for _ in 0..super::views::VIEWED_DECISIONS_PER_CHECK {
            assert_eq!(store.decide(1, 0, 0).unwrap().remaining, 999);
        }
        assert!(!store.inner.views.enabled());
        assert_eq!(store.decide(1, 0, 1).unwrap().remaining, 998);
        assert!(!store.inner.views.enabled());
    }

    /// More stores on one thread than it keeps views of: each keeps its
    /// own budget, and a dropped store's arrays are let go by the views.
    #[test]
    fn views_of_many_stores_stay_apart() {
        let stores: Vec<_> = (0..40)
            .map(|_| MemoryStore::new(FixedWindow::new(3, 10).unwrap(), MemoryOptions::default()))
            .collect();
        for store in &stores {
            store.inner.views.enable();
        }
        for round in 0..4 {
            for store in &stores {
                let decision = store.decide(7, 0, 1).unwrap();
                assert_eq!(decision.allowed, round < 3, "round {round}");
            }
        }
        // The last store used is in this thread's views.
        let slots = stores[39]
            .inner
            .shards
            .iter()
            .find_map(|s| match &s.lock().entries {
                Entries::Packed(t) if t.len() == 1 => Some(t.slots().clone()),
                _ => None,
            })
            .unwrap();
        // Held by the store, this thread's view and this test.
        assert_eq!(Arc::strong_count(&slots), 3);
        drop(stores);
        // Any decision makes the thread let go of dropped stores' views.
        let other = MemoryStore::new(FixedWindow::new(3, 10).unwrap(), MemoryOptions::default());
        other.inner.views.enable();
        other.decide(1, 0, 1).unwrap();
        assert_eq!(Arc::strong_count(&slots), 1);
    }

    #[test]
    fn the_refused_key_is_read_only_when_whole_and_held() {
        let refused = RefusedKey::default();
        assert!(refused.read(1, 0, 1).is_none());
        refused.hold(1, 42);
        let seen = refused.read(1, 0, 1).unwrap();
        assert_eq!((seen.packed, seen.memo), (42, None));
        assert!(refused.read(2, 0, 1).is_none());
        assert_eq!(refused.held(), Some((1, 42)));
        // A memo answers only the request it was decided for.
        let refusal = Decision::refused(Some(7), 3);
        refused.memoize(seen.seq, 5, 1, &refusal);
        assert_eq!(refused.read(1, 5, 1).unwrap().memo, Some(refusal));
        assert_eq!(refused.read(1, 6, 1).unwrap().memo, None);
        assert_eq!(refused.read(1, 5, 2).unwrap().memo, None);
        let never = Decision::refused(None, 0);
        let seq = refused.read(1, 5, 9).unwrap().seq;
        refused.memoize(seq, 5, 9, &never);
        assert_eq!(refused.read(1, 5, 9).unwrap().memo, Some(never));
        // A memo for a state read before a later write is not written.
        refused.hold(1, 43);
        refused.memoize(seen.seq, 5, 1, &refusal);
        let now_held = refused.read(1, 5, 1).unwrap();
        assert_eq!((now_held.packed, now_held.memo), (43, None));
        // A write in progress (odd sequence) is never read.
        refused.seq.fetch_add(1, Ordering::Relaxed);
        assert!(refused.read(1, 5, 1).is_none());
        refused.seq.fetch_add(1, Ordering::Relaxed);
        refused.clear();
        assert!(refused.read(1, 5, 1).is_none());
        assert_eq!(refused.held(), None);
    }

    #[test]
    fn clones_share_one_budget() {
        let store = MemoryStore::new(FixedWindow::new(2, 1000).unwrap(), MemoryOptions::default());
        let other = store.clone();
        assert!(store.decide(1, 0, 1).unwrap().allowed);
        assert!(other.decide(1, 0, 1).unwrap().allowed);
        assert!(!store.decide(1, 0, 1).unwrap().allowed);
        assert!(other.decide(2, 0, 1).unwrap().allowed);
    }

    #[test]
    fn requests_out_of_range_are_errors() {
        let store = MemoryStore::for_config(&crate::REFERENCE, MemoryOptions::default()).unwrap();
        let err = store.decide(1, MAX_SAFE + 1, 1).unwrap_err();
        assert!(
            err.is_invalid_input() && err.to_string().contains("now_ms"),
            "{err}"
        );
        let err = store.decide(1, 0, MAX_SAFE + 1).unwrap_err();
        assert!(
            err.is_invalid_input() && err.to_string().contains("cost"),
            "{err}"
        );
        assert_eq!(store.entries_tracked(), 0);
    }

    /// Regression: a refused first request used to leave no state, so a
    /// later request from before it was decided in an older window than
    /// the one the refusal had recorded.
    #[test]
    fn a_refused_first_request_records_its_window() {
        let store = MemoryStore::new(FixedWindow::new(3, 6).unwrap(), MemoryOptions::default());
        assert!(!store.decide(2, 18, 4).unwrap().allowed);
        assert_eq!(store.entries_tracked(), 1);
        // Decided at 18 (window 18), not at 2 (window 0)...
        assert!(store.decide(2, 2, 1).unwrap().allowed);
        // ...so at 6 the cost admitted at "2" is still counted.
        assert_eq!(store.decide(2, 6, 0).unwrap().remaining, 2);
    }

    /// A request stamped before a key was forgotten and decided after (its
    /// thread read the clock before the sweep, and took the lock after)
    /// is decided as at the forgetting's time: what it admits counts in
    /// the window where the key starts again, so the windows' total stays
    /// exact. Decided at its own time on a new key, it was one admission
    /// more in a window already full, and the window it started counted
    /// the in-flight requests after it again.
    #[test]
    fn a_request_in_flight_across_a_forgetting_counts_where_the_key_starts_again() {
        let one_shard = MemoryOptions {
            shards: 1,
            ..MemoryOptions::default()
        };
        let fixed = MemoryStore::new(FixedWindow::new(1, 1000).unwrap(), one_shard);
        assert!(fixed.decide(7, 500, 1).unwrap().allowed);
        assert!(!fixed.decide(7, 999, 1).unwrap().allowed);
        assert!(fixed.decide(9, 0, 1).unwrap().allowed);
        assert_eq!(fixed.forget_idle(1000, usize::MAX).forgotten, 2);
        // In flight since 0, the earliest a request to a key forgotten at
        // 1000 can be: counted from 1000 too.
        assert!(fixed.decide(9, 0, 1).unwrap().allowed);
        assert!(!fixed.decide(9, 1000, 1).unwrap().allowed);
        // In flight from 999: admitted, as a new key is, counted from 1000.
        assert!(fixed.decide(7, 999, 1).unwrap().allowed);
        assert!(!fixed.decide(7, 1000, 1).unwrap().allowed);
        assert!(!fixed.decide(7, 999, 1).unwrap().allowed);
        // A key the shard never held, stamped before the forgetting, has
        // the answer it would have at its own time; it too is counted from
        // the forgetting's time.
        let fresh = fixed.decide(8, 10, 1).unwrap();
        let mut own = fixed.policy().new_state(10);
        assert_eq!(fresh, fixed.policy().decide(&mut own, 10, 1));
        assert!(!fixed.decide(8, 1999, 1).unwrap().allowed);

        // A sliding log never holds more than its limit within a window
        // of the times it records.
        let log = MemoryStore::new(SlidingLog::new(1, 1000).unwrap(), one_shard);
        assert!(log.decide(1, 0, 1).unwrap().allowed);
        assert_eq!(log.forget_idle(1000, usize::MAX).forgotten, 1);
        assert!(log.decide(1, 600, 1).unwrap().allowed);
        let refused = log.decide(1, 1500, 1).unwrap();
        assert!(!refused.allowed);
        assert_eq!(refused.retry_after_ms, Some(500));

        // A full shard making room for a new key forgets the same way.
        let small = MemoryStore::new(
            FixedWindow::new(1, 1000).unwrap(),
            MemoryOptions {
                max_keys: 2,
                shards: 1,
            },
        );
        assert!(small.decide(7, 500, 1).unwrap().allowed);
        assert!(small.decide(9, 500, 1).unwrap().allowed);
        assert!(small.decide(8, 1000, 1).unwrap().allowed);
        assert!(small.decide(7, 999, 1).unwrap().allowed);
        assert!(!small.decide(7, 1000, 1).unwrap().allowed);

        // A request more than MAX_IN_FLIGHT_MS before the forgetting is no
        // request in flight (the forgetting ran on another clock): decided,
        // and counted, at its own time.
        let other_clock = MemoryStore::new(FixedWindow::new(1, 1000).unwrap(), one_shard);
        assert!(other_clock.decide(1, 0, 1).unwrap().allowed);
        assert_eq!(other_clock.forget_idle(5000, usize::MAX).forgotten, 1);
        assert!(
            other_clock
                .decide(2, 5000 - MAX_IN_FLIGHT_MS - 1, 1)
                .unwrap()
                .allowed
        );
        assert!(other_clock.decide(2, 5000, 1).unwrap().allowed);
        // Windows of a millisecond have requests in flight too.
        let fine = MemoryStore::new(FixedWindow::new(1, 1).unwrap(), one_shard);
        assert!(fine.decide(1, 0, 1).unwrap().allowed);
        assert_eq!(fine.forget_idle(5, usize::MAX).forgotten, 1);
        assert!(fine.decide(1, 0, 1).unwrap().allowed);
        assert!(!fine.decide(1, 5, 1).unwrap().allowed);
    }

    #[test]
    fn forget_idle_keeps_every_key_that_still_counts() {
        let store = MemoryStore::new(
            SlidingWindowCounter::new(5, 1000).unwrap(),
            MemoryOptions::default(),
        );
        for key in 0..100 {
            store.decide(key, 500, 1).unwrap();
        }
        store.decide(7, 1500, 1).unwrap();
        // At 1999 every key still carries into the trailing window.
        let kept = store.forget_idle(1999, usize::MAX);
        assert_eq!((kept.scanned, kept.forgotten), (100, 0));
        // At 2000 the keys last written in window 0 have left it; key 7,
        // written in window 1000, still carries.
        let swept = store.forget_idle(2000, usize::MAX);
        assert_eq!(swept.forgotten, 99);
        assert_eq!(store.entries_tracked(), 1);
        assert_eq!(store.decide(7, 2000, 0).unwrap().remaining, 4);
    }

    /// A time no decision takes forgets no key that still counts.
    #[test]
    fn forget_idle_past_2_pow_53_forgets_nothing() {
        let store = MemoryStore::new(FixedWindow::new(5, 1000).unwrap(), MemoryOptions::default());
        for _ in 0..5 {
            assert!(store.decide(1, 100, 1).unwrap().allowed);
        }
        for now_ms in [MAX_SAFE + 1, u64::MAX] {
            assert_eq!(store.forget_idle(now_ms, usize::MAX).forgotten, 0);
        }
        assert!(!store.decide(1, 200, 1).unwrap().allowed);
        // 2^53 - 1 is a time a decision takes: there the key is idle.
        assert_eq!(store.forget_idle(MAX_SAFE, usize::MAX).forgotten, 1);
    }

    #[test]
    fn forgetting_for_new_keys_is_reported_by_the_next_forget_idle() {
        let store = MemoryStore::new(
            FixedWindow::new(5, 10).unwrap(),
            MemoryOptions {
                max_keys: 4,
                shards: 1,
            },
        );
        for key in 0..4 {
            assert!(store.decide(key, 0, 1).unwrap().allowed);
        }
        // Full, and nothing idle yet: refused.
        assert!(store.decide(4, 9, 1).is_err());
        // A window later every key is forgettable: the full shard forgets
        // them all to make room, before any housekeeping.
        assert!(store.decide(4, 10, 1).unwrap().allowed);
        assert_eq!(store.entries_tracked(), 1);
        let first = store.forget_idle(10, usize::MAX);
        assert_eq!((first.forgotten, first.forgotten_for_new_keys), (0, 4));
        // Taken once.
        assert_eq!(store.forget_idle(10, usize::MAX).forgotten_for_new_keys, 0);
    }

    #[test]
    fn forget_idle_is_bounded_per_call() {
        let options = MemoryOptions {
            max_keys: 1 << 20,
            shards: 16,
        };
        let store = MemoryStore::new(FixedWindow::new(5, 10).unwrap(), options);
        for key in 0..1600 {
            store.decide(key, 0, 1).unwrap();
        }
        let first = store.forget_idle(10, 1);
        assert!(first.scanned >= 1 && first.scanned < 1600, "{first:?}");
        let mut total = first.forgotten;
        for _ in 0..15 {
            total += store.forget_idle(10, 1).forgotten;
        }
        assert_eq!(total, 1600);
        assert_eq!(store.entries_tracked(), 0);
    }

    /// The store's count of its keys is what its shards hold, counted
    /// under their locks, through new keys, full shards forgetting to make
    /// room, housekeeping and a shard turning wide; and housekeeping of an
    /// empty store locks no shard.
    #[test]
    fn the_key_count_is_the_shards_keys() {
        let held = |store: &MemoryStore| -> usize {
            let inner = &store.inner;
            inner.shards.iter().map(|s| s.lock().entries.len()).sum()
        };
        for policy in PolicyKind::ALL {
            let options = MemoryOptions {
                max_keys: 256,
                shards: 4,
            };
            let store =
                MemoryStore::for_config(&PolicyConfig::new(policy, 3, 1000), options).unwrap();
            let cursor = || store.inner.sweep_cursor.load(Ordering::Relaxed);
            let before = cursor();
            assert_eq!(store.forget_idle(0, 1).scanned, 0);
            assert_eq!(
                cursor(),
                before,
                "{policy}: an empty store's shards were visited"
            );
            // Keys and costs from a fixed sequence, times moving on so
            // that keys fall idle; full shards forget to make room.
            let mut x = 0x9e37_79b9_7f4a_7c15_u64;
            for step in 0..20_000u64 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let now_ms = step / 4;
                let _ = store.decide(x % 1_000, now_ms, x % 5);
                if step % 997 == 0 {
                    store.forget_idle(now_ms, 64);
                }
                if step % 101 == 0 {
                    assert_eq!(store.entries_tracked(), held(&store), "{policy} at {step}");
                }
            }
            // A time past what most packed states hold turns a shard wide,
            // with its keys (the log is wide from the start).
            store.decide(1_001, 1 << 50, 1).unwrap();
            assert_eq!(store.entries_tracked(), held(&store), "{policy} at 2^50");
            store.forget_idle(MAX_SAFE, usize::MAX);
            assert_eq!((store.entries_tracked(), held(&store)), (0, 0), "{policy}");
            let before = cursor();
            store.forget_idle(MAX_SAFE, usize::MAX);
            assert_eq!(
                cursor(),
                before,
                "{policy}: an emptied store's shards were visited"
            );
        }
    }

    /// A full shard is swept for a new key only once enough new keys, or
    /// enough milliseconds, have come since its last sweep to pay for
    /// looking at all of its keys: a flood of new keys at a full store
    /// does not scan the shard for each, and idle keys are not kept from
    /// new ones for long.
    #[test]
    fn a_full_shard_is_swept_once_new_keys_or_time_have_paid_for_it() {
        // 4,096 keys: 16 new keys or 16 ms pay for a sweep.
        let keys = 16 * FULL_SWEEP_KEYS_PER_NEW_KEY;
        let filled = || {
            let options = MemoryOptions {
                max_keys: keys,
                shards: 1,
            };
            let store = MemoryStore::for_config(
                &PolicyConfig::new(PolicyKind::FixedWindow, 10, 1000),
                options,
            )
            .unwrap();
            for key in 0..keys as u64 {
                store.decide(key, 0, 1).unwrap();
            }
            store
        };
        let full = || {
            let store = filled();
            // The first new key at the full shard sweeps it (the keys
            // filling it paid), and finds nothing idle yet: every key is
            // idle from 1000 ms on.
            let err = store.decide(keys as u64, 999, 1).unwrap_err();
            assert!(err.is_capacity_exhausted(), "{err}");
            assert!(err.to_string().contains("when it was last looked through"));
            store
        };
        let new = |i: usize| (keys + 1 + i) as u64;
        let refused = |store: &MemoryStore, key: u64, now_ms: u64| {
            let err = store.decide(key, now_ms, 1).unwrap_err();
            assert!(err.is_capacity_exhausted(), "{key} at {now_ms}: {err}");
            assert_eq!(store.entries_tracked(), keys);
        };
        // Paid by new keys: the 16th since the sweep sweeps, 1 ms later.
        let store = full();
        for i in 0..15 {
            refused(&store, new(i), 1000);
        }
        assert!(store.decide(new(15), 1000, 1).unwrap().allowed);
        assert_eq!(store.entries_tracked(), 1);
        // Paid by time: 16 ms after the sweep, whatever came between.
        let store = full();
        for (i, now_ms) in (1000..1014).enumerate() {
            refused(&store, new(i), now_ms);
        }
        assert!(store.decide(new(14), 1015, 1).unwrap().allowed);
        assert_eq!(store.entries_tracked(), 1);
        // A sweep by forget_idle counts as one: time pays for the next from
        // there, as after a sweep for a new key.
        let store = filled();
        let swept = store.forget_idle(999, usize::MAX);
        assert_eq!((swept.scanned, swept.forgotten), (keys, 0));
        refused(&store, new(0), 1000);
        assert!(store.decide(new(1), 1015, 1).unwrap().allowed);
        // A sweep at a time ahead of the decisions' (a forget_idle on
        // another clock, or a clock stepped back) does not hold the next
        // one off until the decisions reach that time.
        let store = filled();
        assert_eq!(store.forget_idle(10_500, usize::MAX).forgotten, keys);
        for key in 0..keys as u64 {
            store.decide(key, 9_000, 1).unwrap();
        }
        // Every key is idle from 10,000 ms; the keys filling the shard
        // paid for a sweep, and it runs at 10,000, before 10,500.
        assert!(store.decide(new(0), 10_000, 1).unwrap().allowed);
        assert_eq!(store.entries_tracked(), 1);
    }

    #[test]
    fn a_full_store_refuses_new_keys_with_an_error_never_an_admit() {
        let options = MemoryOptions {
            max_keys: 4,
            shards: 1,
        };
        let store = MemoryStore::for_config(
            &PolicyConfig::new(PolicyKind::FixedWindow, 10, 1000),
            options,
        )
        .unwrap();
        for key in 0..4 {
            store.decide(key, 0, 1).unwrap();
        }
        let err = store.decide(99, 1, 1).unwrap_err();
        assert!(err.is_capacity_exhausted(), "{err}");
        assert!(err.to_string().contains("max_keys"), "{err}");
        // What admits nothing needs no room: a peek is answered as a new
        // key's, and so is a cost no state admits, with no state kept.
        let peek = store.decide(98, 1, 0).unwrap();
        assert!(peek.allowed && peek.remaining == 10, "{peek:?}");
        let never = store.decide(97, 1, 11).unwrap();
        assert!(
            !never.allowed && never.retry_after_ms.is_none(),
            "{never:?}"
        );
        assert_eq!(store.entries_tracked(), 4);
        // Known keys are still decided.
        assert!(store.decide(0, 2, 1).unwrap().allowed);
        // Once the window has passed the full shard forgets its idle keys
        // and takes the new one.
        assert!(store.decide(99, 1000, 1).unwrap().allowed);
        assert_eq!(store.entries_tracked(), 1);
    }

    /// A full shard has room for the keys it holds (key 0, kept beside
    /// the array, too), and none for another, which a peek does not change.
    #[test]
    fn has_room_for_tells_held_keys_from_new_ones_in_a_full_shard() {
        let options = MemoryOptions {
            max_keys: 2,
            shards: 1,
        };
        let packed = MemoryStore::new(FixedWindow::new(5, 1000).unwrap(), options);
        let wide =
            MemoryStore::for_config(&PolicyConfig::new(PolicyKind::SlidingLog, 5, 1000), options)
                .unwrap();
        let check = |decide: &dyn Fn(u64, u64, u64) -> bool, room: &dyn Fn(u64) -> bool| {
            assert!(room(0) && room(7));
            assert!(decide(0, 100, 1) && decide(7, 100, 1));
            assert!(room(0) && room(7));
            assert!(!room(8));
            // A peek of a key not held is answered, and makes no room.
            assert!(decide(8, 100, 0));
            assert!(!room(8));
        };
        check(&|k, t, c| packed.decide(k, t, c).unwrap().allowed, &|k| {
            packed.has_room_for(k)
        });
        check(&|k, t, c| wide.decide(k, t, c).unwrap().allowed, &|k| {
            wide.has_room_for(k)
        });
        // A key refused twice in a row is pinned beside the table: held.
        for _ in 0..3 {
            assert!(!packed.decide(7, 100, 5).unwrap().allowed);
        }
        assert!(packed.has_room_for(7));
    }

    /// Keys that counted nothing (peeks, refusals of a cost above the
    /// limit) take places while the store has room, and give them up to
    /// the first key that counts: under every policy, at once.
    #[test]
    fn keys_that_counted_nothing_make_room_for_one_that_counts() {
        let options = MemoryOptions {
            max_keys: 4,
            shards: 1,
        };
        for policy in PolicyKind::ALL {
            let config = PolicyConfig::new(policy, 5, 1000);
            let store = MemoryStore::for_config(&config, options).unwrap();
            for key in 0..2 {
                assert!(store.decide(key, 100, 0).unwrap().allowed, "{config}");
            }
            for key in 2..4 {
                assert!(!store.decide(key, 100, 6).unwrap().allowed, "{config}");
            }
            let d = store.decide(4, 100, 1);
            assert!(d.as_ref().is_ok_and(|d| d.allowed), "{config}: {d:?}");
        }
    }

    /// A small store picks few shards, so that one shard does not fill
    /// while the store is far from max_keys: it holds max_keys exactly.
    #[test]
    fn a_small_store_with_automatic_shards_holds_max_keys_exactly() {
        let config = PolicyConfig::new(PolicyKind::FixedWindow, 10, 1000);
        for max_keys in [1, 100, 1023, 3000] {
            let options = MemoryOptions {
                max_keys,
                shards: 0,
            };
            let store = MemoryStore::for_config(&config, options).unwrap();
            let shards = store.inner.shards.len();
            let floor = MemoryOptions::MIN_KEYS_PER_AUTO_SHARD;
            assert!(shards * floor <= max_keys.max(floor));
            if max_keys < floor {
                assert_eq!(store.max_keys(), max_keys, "{max_keys}");
                for key in 0..max_keys as u64 {
                    store.decide(key, 0, 1).unwrap();
                }
                let err = store.decide(u64::MAX, 0, 1).unwrap_err();
                assert!(err.is_capacity_exhausted(), "{err}");
                let held = match max_keys {
                    1 => "1 key".to_owned(),
                    n => format!("{n} keys"),
                };
                assert!(
                    err.to_string().contains(&format!(
                        "full ({held}; the store holds at most {max_keys} over 1 shard)"
                    )),
                    "{err}"
                );
            }
        }
        // The default keeps four shards per core, at least 16.
        let store = MemoryStore::for_config(&config, MemoryOptions::default()).unwrap();
        assert!(store.inner.shards.len() >= 16);
        // No overflow at the extreme.
        let options = MemoryOptions {
            max_keys: usize::MAX,
            shards: 0,
        };
        let store = MemoryStore::for_config(&config, options).unwrap();
        assert_eq!(store.max_keys(), usize::MAX);
    }

    /// A state whose packing is one of the store's reserved values
    /// (`PINNED`, `DEAD`) is kept wide and decided as the policy does:
    /// each sequence here once drove a state to pack to `PINNED`, which
    /// the store then read as a pinned key and panicked on.
    #[test]
    fn states_that_pack_to_a_reserved_value_decide_as_the_policy_does() {
        let cases: [(PolicyConfig, &[(u64, u64)]); 6] = [
            (
                PolicyConfig::new(PolicyKind::FixedWindow, 4_294_967_294, 1),
                &[(4_294_967_295, 4_294_967_294), (4_294_967_295, 0)],
            ),
            (
                PolicyConfig::new(PolicyKind::TokenBucket, 1, 1).with_burst(4_294_967_294),
                &[(4_294_967_295, 0), (4_294_967_295, 0)],
            ),
            (
                PolicyConfig::new(PolicyKind::Gcra, 2048, 1),
                &[(MAX_SAFE, 2046), (MAX_SAFE, 0)],
            ),
            (
                PolicyConfig::new(PolicyKind::SlidingWindowCounter, 255, 257),
                &[
                    (281_474_976_710_398, 255),
                    (281_474_976_710_911, 254),
                    (281_474_976_710_911, 0),
                ],
            ),
            // The window-index layout (12-bit counts, 40-bit index): both
            // counts full in the last index, the previous window's count
            // carrying nothing at the window's last millisecond.
            (
                PolicyConfig::new(PolicyKind::SlidingWindowCounter, 4095, 4096),
                &[
                    (4_503_599_627_362_304, 4095),
                    (4_503_599_627_370_495, 4095),
                    (4_503_599_627_370_495, 0),
                ],
            ),
            // The level in units of gcd(2, 2) = 2: a full bucket of
            // 2^23 - 1 units refilled at the last of 41 bits of time.
            (
                PolicyConfig::new(PolicyKind::TokenBucket, 2, 2).with_burst((1 << 23) - 1),
                &[(2_199_023_255_551, 0), (2_199_023_255_551, 1)],
            ),
        ];
        for (config, steps) in cases {
            let store = MemoryStore::for_config(&config, MemoryOptions::default()).unwrap();
            let policy = config.build().unwrap();
            let mut state = policy.new_state(steps[0].0);
            // The sequence does reach a reserved packing: the test still
            // tests what it names.
            let mut reserved = false;
            for &(now, cost) in steps {
                let expected = policy.decide(&mut state, now, cost);
                reserved |= policy.pack(&state).is_some_and(|p| p >= PINNED);
                assert_eq!(
                    store.decide(1, now, cost).unwrap(),
                    expected,
                    "{config} at {now}"
                );
            }
            assert!(reserved, "{config}: no state packed to a reserved value");
        }
    }

    /// Packed shards decide as the bare policy does, and a state that
    /// stops fitting (a large count or a late time) widens its shard
    /// without changing any decision, before or after.
    #[test]
    fn packed_and_widened_shards_decide_as_the_policy_does() {
        use crate::registry::AnyState;
        use std::collections::HashMap;
        let configs = [
            PolicyConfig::new(PolicyKind::FixedWindow, 100, 1000),
            PolicyConfig::new(PolicyKind::SlidingWindowCounter, 100, 1000),
            // 2 x 31 count bits leave 2 bits for the window index:
            // widens at 12 ms.
            PolicyConfig::new(PolicyKind::SlidingWindowCounter, 1 << 30, 3),
            PolicyConfig::new(PolicyKind::FixedWindow, 1 << 40, 7),
            PolicyConfig::new(PolicyKind::TokenBucket, 100, 1000),
            PolicyConfig::new(PolicyKind::TokenBucket, 1 << 20, 1 << 30),
            PolicyConfig::new(PolicyKind::Gcra, 100, 1000),
            PolicyConfig::new(PolicyKind::Gcra, MAX_SAFE, 3),
            PolicyConfig::new(PolicyKind::SlidingLog, 5, 10),
        ];
        for config in configs {
            let options = MemoryOptions {
                max_keys: 1 << 10,
                shards: 4,
            };
            let store = MemoryStore::for_config(&config, options).unwrap();
            let policy = config.build().unwrap();
            let mut states: HashMap<u64, AnyState> = HashMap::new();
            let mut now = 0u64;
            let mut x = 0x2545_f491_4f6c_dd1d_u64;
            for step in 0..4000 {
                // A small xorshift walk: keys 0..40, time mostly forward
                // with jumps past 2^50 ms late in the run, costs up to the
                // limit and beyond.
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let key = x % 40;
                now = match (x >> 8) % 16 {
                    0 if step > 3000 => now.max(1 << 50) + (x >> 20) % 5000,
                    1 => now.saturating_sub((x >> 20) % 50),
                    _ => now + (x >> 20) % 7,
                }
                .min(MAX_SAFE);
                let cost = match (x >> 12) % 4 {
                    0 => (x >> 24) % (config.limit + 2),
                    _ => (x >> 24) % 3,
                };
                let state = states.entry(key).or_insert_with(|| policy.new_state(now));
                let expected = policy.decide(state, now, cost);
                let real = store.decide(key, now, cost).unwrap();
                assert_eq!(real, expected, "{config} step {step} key {key} at {now}");
            }
            assert_eq!(store.entries_tracked(), states.len());
            // Every configuration met a state that did not fit, but those
            // whose every state packs below 2^53 ms: `fixed-window` with 7
            // count bits, `gcra` whose scaled time fits 64 bits.
            let wide = store
                .inner
                .shards
                .iter()
                .filter(|s| matches!(s.lock().entries, Entries::Wide(_)))
                .count();
            let always_packs = config == PolicyConfig::new(PolicyKind::Gcra, 100, 1000)
                || config == PolicyConfig::new(PolicyKind::FixedWindow, 100, 1000);
            assert_eq!(wide == 0, always_packs, "{config}: {wide} wide shards");
        }
    }

    /// Only a refusal that leaves the state unchanged is a sign of a flood:
    /// a key that is only peeked at (admitted, nothing changed) does not
    /// take the shard's pin from the key that is flooded, whose repeats
    /// keep being answered from the pinned snapshot.
    #[test]
    fn a_key_only_peeked_at_does_not_take_the_pin() {
        let options = MemoryOptions {
            max_keys: 1 << 10,
            shards: 1,
        };
        let store = MemoryStore::new(FixedWindow::new(1, 10).unwrap(), options);
        let held = || shard_of(&store, 1).refused.held().map(|h| h.0);
        for key in [1, 2] {
            assert!(store.decide(key, 0, 1).unwrap().allowed);
        }
        for _ in 0..2 {
            assert!(!store.decide(1, 0, 1).unwrap().allowed);
        }
        assert_eq!(held(), Some(1));
        for _ in 0..3 {
            assert_eq!(store.decide(2, 1, 0).unwrap(), Decision::admitted(0));
        }
        assert_eq!(held(), Some(1));
    }

    /// A sweep that forgets nothing leaves no time behind it: a new key's
    /// request stamped before that sweep is decided at its own time, not
    /// moved forward as a request in flight across a forgetting would be.
    #[test]
    fn a_sweep_that_forgets_nothing_moves_no_request_in_time() {
        let one_shard = MemoryOptions {
            shards: 1,
            ..MemoryOptions::default()
        };
        let store = MemoryStore::new(FixedWindow::new(1, 1000).unwrap(), one_shard);
        // Key 1 counts in the window 1000..2000: nothing to forget at 1500.
        assert!(store.decide(1, 1500, 1).unwrap().allowed);
        assert_eq!(store.forget_idle(1500, usize::MAX).forgotten, 0);
        // Key 2, new, at 800: its admission counts in the window 0..1000,
        // so the window from 1000 on still has its one admission.
        assert!(store.decide(2, 800, 1).unwrap().allowed);
        assert!(store.decide(2, 1000, 1).unwrap().allowed);
        assert!(!store.decide(2, 1000, 1).unwrap().allowed);
    }

    /// The capacity of shard `index`'s wide table.
    fn wide_capacity<P: Policy>(store: &MemoryStore<P>, index: usize) -> usize {
        match &store.inner.shards[index].lock().entries {
            Entries::Wide(t) => t.capacity(),
            Entries::Packed(_) => panic!("shard {index} is packed"),
        }
    }

    /// The bytes a wide shard's table has allocated: unlike its
    /// `capacity()`, which drops by one for each key removed where its
    /// slot must stay marked deleted, this changes only when the table is
    /// reallocated.
    fn wide_allocation_bytes<P: Policy>(store: &MemoryStore<P>, index: usize) -> usize {
        match &store.inner.shards[index].lock().entries {
            Entries::Wide(t) => t.allocation_size(),
            Entries::Packed(_) => panic!("shard {index} is packed"),
        }
    }

    /// After a sweep a wide shard left at most a quarter full gives memory
    /// back, keeping room for twice the keys it still holds; one left more
    /// than a quarter full keeps its allocation, so that a shard whose keys
    /// come and go is not reallocated at every sweep.
    #[test]
    fn a_wide_shard_shrinks_at_a_quarter_full_or_less_and_keeps_room_to_grow() {
        let options = MemoryOptions {
            max_keys: 1 << 12,
            shards: 1,
        };
        // A sliding log never packs: its shard is wide from the start.
        let store = MemoryStore::new(SlidingLog::new(5, 1000).unwrap(), options);
        for key in 0..1000 {
            store.decide(key, 0, 1).unwrap();
        }
        let full = wide_capacity(&store, 0);
        assert!(full >= 1000);
        // 100 keys stay, far below a quarter: the table shrinks, to room
        // for 200.
        for key in 0..100 {
            store.decide(key, 5000, 1).unwrap();
        }
        assert_eq!(store.forget_idle(5000, usize::MAX).forgotten, 900);
        let shrunk = wide_capacity(&store, 0);
        assert!(shrunk < full && shrunk >= 200, "{full} -> {shrunk}");
        // One key more than a quarter stays: the table keeps its
        // allocation.
        assert!(shrunk > 128 && shrunk.is_multiple_of(4), "{shrunk}");
        let allocated = wide_allocation_bytes(&store, 0);
        let quarter = (shrunk / 4) as u64;
        for key in 0..=quarter {
            store.decide(key, 10_000, 1).unwrap();
        }
        assert_eq!(
            store.forget_idle(10_000, usize::MAX).forgotten,
            99 - quarter as usize
        );
        assert_eq!(store.entries_tracked(), quarter as usize + 1);
        assert_eq!(wide_allocation_bytes(&store, 0), allocated);
        // Exactly a quarter stays: it shrinks.
        for key in 0..quarter {
            store.decide(key, 15_000, 1).unwrap();
        }
        assert_eq!(store.forget_idle(15_000, usize::MAX).forgotten, 1);
        assert!(wide_allocation_bytes(&store, 0) < allocated);
        assert!(wide_capacity(&store, 0) >= 2 * quarter as usize);
    }

    /// A wide shard swept from full down to a fifth of its keys gives
    /// memory back. Most keys removed from a full SwissTable leave their
    /// slot marked deleted, which lowers `capacity()` as if the room were
    /// still taken (to about 1,500 of 3,584 here), so a shrink judged by
    /// `capacity()` kept the whole allocation.
    #[test]
    fn a_wide_shard_swept_from_full_gives_memory_back() {
        let options = MemoryOptions {
            max_keys: 1 << 14,
            shards: 1,
        };
        let store = MemoryStore::new(SlidingLog::new(5, 1000).unwrap(), options);
        let mut keys = 0;
        // Fill the table to its last free slot (3,584 keys in 4,096
        // slots), past any size whose growth leaves free room.
        while keys < 3000 || store.entries_tracked() < wide_capacity(&store, 0) {
            store.decide(keys, 0, 1).unwrap();
            keys += 1;
        }
        let allocated = wide_allocation_bytes(&store, 0);
        let kept = keys / 5;
        for key in 0..kept {
            store.decide(key, 5000, 1).unwrap();
        }
        assert_eq!(
            store.forget_idle(5000, usize::MAX).forgotten as u64,
            keys - kept
        );
        let after = wide_allocation_bytes(&store, 0);
        assert!(after < allocated, "{allocated} bytes -> {after}");
        assert!(wide_capacity(&store, 0) >= 2 * kept as usize);
        for key in 0..kept {
            assert!(store.decide(key, 5000, 1).unwrap().allowed, "{key}");
        }
    }

    /// A shard's array replaced by another thread is let go by this
    /// thread's views at its next decision through them, on any shard of
    /// the store: a thread deciding only other shards' keys does not keep
    /// the retired array alive.
    #[test]
    fn a_retired_array_is_let_go_by_the_views_of_other_threads() {
        let options = MemoryOptions {
            max_keys: 1 << 10,
            shards: 2,
        };
        let store = MemoryStore::new(FixedWindow::new(10, 1000).unwrap(), options);
        store.inner.views.enable();
        let shard = |key: u64| store.inner.locate(key).1;
        // Key 0 is `EMPTY`, kept beside the array: the keys start at 1.
        let keys_of = |index: usize| (1..).filter(move |&key| shard(key) == index);
        let (a, b) = (keys_of(0).next().unwrap(), keys_of(1).next().unwrap());
        for key in [a, b, a, b] {
            assert!(store.decide(key, 0, 1).unwrap().allowed);
        }
        let slots = |index: usize| match &store.inner.shards[index].lock().entries {
            Entries::Packed(t) => t.slots().clone(),
            Entries::Wide(_) => panic!("shard {index} is wide"),
        };
        let first = slots(0);
        // Held by the shard, this thread's view and this test.
        assert_eq!(Arc::strong_count(&first), 3);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                for key in keys_of(0).skip(1).take(200) {
                    assert!(store.decide(key, 0, 1).unwrap().allowed);
                }
            });
        });
        assert!(!Arc::ptr_eq(&first, &slots(0)));
        assert!(store.inner.views.enabled());
        assert_eq!(store.decide(b, 0, 1).unwrap(), Decision::admitted(7));
        assert_eq!(Arc::strong_count(&first), 1);
    }

    /// Keys spread over a packed shard's array: on average a key sits
    /// within a few slots of its home, as linear probing at the table's
    /// load gives (about 2.2 slots at its most, 13/16). A hash that put
    /// keys together would still decide every request right, but each
    /// lookup would walk a run as long as the shard's keys.
    #[test]
    fn keys_sit_near_their_home_slots() {
        const KEYS: u64 = 20_000;
        let options = MemoryOptions {
            max_keys: 1 << 16,
            shards: 4,
        };
        let store = MemoryStore::new(FixedWindow::new(10, 1000).unwrap(), options);
        for key in 1..=KEYS {
            assert!(store.decide(key, 0, 1).unwrap().allowed);
        }
        for index in 0..4 {
            let table = store.inner.shards[index].lock();
            let Entries::Packed(table) = &table.entries else {
                panic!("shard {index} is wide");
            };
            let slots = table.slots();
            let n = slots.len();
            let (mut keys, mut displaced) = (0, 0);
            for key in 1..=KEYS {
                if std::ptr::eq(shard_of(&store, key), &store.inner.shards[index]) {
                    let hash = store.inner.packed_hash_of(key);
                    let at = crate::store::table::find(slots, hash, key).unwrap();
                    displaced += (at + n - crate::store::table::home(hash, n)) % n;
                    keys += 1;
                }
            }
            assert!(keys > 4000, "shard {index} holds {keys} keys");
            let mean = displaced as f64 / keys as f64;
            assert!(
                mean < 8.0,
                "shard {index}: {mean} slots from home on average"
            );
        }
    }

    #[test]
    fn debug_shows_the_layout_and_the_keys_held() {
        let options = MemoryOptions {
            max_keys: 10,
            shards: 2,
        };
        let store = MemoryStore::new(FixedWindow::new(2, 10).unwrap(), options);
        store.decide(1, 0, 1).unwrap();
        assert_eq!(
            format!("{store:?}"),
            "MemoryStore { shards: 2, max_keys_per_shard: 5, entries_tracked: 1 }"
        );
    }

    /// Through the `Store` trait (what the benches drive), the store
    /// decides and counts its keys as it does through its own methods.
    #[test]
    fn the_store_trait_answers_as_the_store_does() {
        let store = MemoryStore::new(FixedWindow::new(2, 10).unwrap(), MemoryOptions::default());
        let dynamic: &dyn Store = &store;
        assert_eq!(dynamic.entries_tracked(), 0);
        for key in [1, 2, 1] {
            assert!(dynamic.decide(key, 0, 1).unwrap().allowed);
        }
        assert_eq!(
            dynamic.decide(1, 0, 1).unwrap(),
            Decision::refused(Some(10), 0)
        );
        assert_eq!(dynamic.entries_tracked(), 2);
    }
}
