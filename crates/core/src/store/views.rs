//! Each thread's views of the memory stores' packed tables: how a decision
//! on a known key reaches the key's slot without taking the shard's lock.
//!
//! A shard's array of slots is shared through an `Arc`; a reader needs a
//! clone of it that stays valid while it probes and updates a slot. Taking
//! the lock or cloning the `Arc` per decision writes a shared cache line
//! (the lock word, the reference count), and that line then moves between
//! the cores on about half of all decisions: two threads deciding
//! different keys go little faster than one. So each thread keeps its own
//! clones, per store and shard, and reuses them while the store's `epoch`
//! (bumped whenever any of its shards retires an array) is the one they
//! were taken at. A decision then writes nothing shared but the key's own
//! state.
//!
//! A view is only ever a shortcut. A retired array's states are all dead,
//! a pinned key's slot sends its reader to the lock, and a key missing
//! from a stale array is looked for again under the lock, so a stale view
//! (the epoch moved on while it was used) costs a locked decision, never a
//! wrong one. The views are used only while more than one thread decides
//! ([`StoreViews::enabled`]).
//!
//! What a view keeps alive: the arrays it holds, until the thread next
//! decides through it (a new epoch drops them), decides through the views
//! of any store after the store is dropped (`STORES_DROPPED` tells every
//! thread to look; a decision on a store whose views are off does not
//! look), or has used [`MAX_VIEWS`] other stores since. A thread that
//! never decides through a view again holds them until it exits: arrays
//! retired by a sweep or a growth, and those of a store dropped since
//! (measured: 41 MB of two threads' views of 2,097,152 keys stayed after
//! `forget_idle` forgot them all and the store was dropped, until the
//! threads exited). Reaching another thread's views, or holding the
//! arrays weakly, would write shared memory on every decision, which is
//! what the views are for avoiding.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use super::table::{self, Slots};
use crate::Decision;

/// The most stores a thread keeps views of; the least recently used goes.
const MAX_VIEWS: usize = 32;

/// Decisions a thread makes through its view of a store before it turns
/// the store's views off, to learn whether it still needs them (see
/// [`StoreViews::enabled`]).
pub(crate) const VIEWED_DECISIONS_PER_CHECK: u32 = 1 << 16;

/// Bumped whenever a store is dropped, so that threads drop their views of
/// it at their next decision.
static STORES_DROPPED: AtomicU64 = AtomicU64::new(0);

/// Gives each store its own identity for the views.
static NEXT_STORE_ID: AtomicU64 = AtomicU64::new(1);

/// What the views know of one store: created with it, dropped with it.
#[derive(Debug)]
pub(crate) struct StoreViews {
    id: u64,
    /// Whether decisions try the views first.
    enabled: AtomicBool,
    /// Bumped whenever a thread turns the views off, so that a shard locked
    /// by another thread before then is no sign that one still decides.
    quiet: AtomicU64,
    /// Bumped whenever one of the store's shards retires an array.
    epoch: AtomicU64,
    /// Alive while the store is: views hold it weakly to tell.
    alive: Option<Arc<()>>,
    shards: usize,
}

impl StoreViews {
    pub(crate) fn new(shards: usize) -> Self {
        StoreViews {
            id: NEXT_STORE_ID.fetch_add(1, Ordering::Relaxed),
            enabled: AtomicBool::new(false),
            quiet: AtomicU64::new(0),
            epoch: AtomicU64::new(0),
            alive: Some(Arc::new(())),
            shards,
        }
    }

    /// Whether decisions should try the views before the lock.
    ///
    /// A view costs a thread-local lookup on every decision; the lock
    /// costs one read-modify-write of a line that stays in the core's
    /// cache while one thread decides, and a trip between the cores for
    /// about half the decisions when two do. So the views are on
    /// only while more than one thread decides: the locked path turns them
    /// on when it sees a shard locked by another thread than the last
    /// since the views were last turned off ([`StoreViews::quiet`]), and
    /// each thread turns them off again after
    /// [`VIEWED_DECISIONS_PER_CHECK`] decisions through them, so that a
    /// store left to one thread goes back to the lock (another thread still
    /// deciding turns them on again within a few decisions). Either way
    /// every decision is the same: the views are a shortcut, never the
    /// state.
    #[inline(always)]
    pub(crate) fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    /// How many times the views were turned off.
    #[inline(always)]
    pub(crate) fn quiet(&self) -> u64 {
        self.quiet.load(Ordering::Relaxed)
    }

    /// Turns the views on (see [`StoreViews::enabled`]).
    #[cold]
    pub(crate) fn enable(&self) {
        self.enabled.store(true, Ordering::Relaxed);
    }

    /// Tells every thread that the store's views are stale; call after a
    /// shard retired an array (under that shard's lock).
    pub(crate) fn retired(&self) {
        self.epoch.fetch_add(1, Ordering::Release);
    }

    /// Decides a request for `key` (not `EMPTY`), whose hash is `hash`,
    /// on this thread's view of shard `shard`: `decide` decides on the
    /// key's state cell and says whether the state is unchanged. Returns
    /// the decision, and whether the key should be pinned (see
    /// `memory.rs`): a refusal that changed nothing, of the key this
    /// thread last saw refused, is the sign of a flood. `None` sends
    /// the caller to the lock: no view of the shard, the key not in it,
    /// or `decide` gave up.
    #[inline(always)]
    pub(crate) fn decide(
        &self,
        shard: usize,
        hash: u64,
        key: u64,
        decide: impl FnOnce(&AtomicU64) -> Option<(Decision, bool)>,
    ) -> Option<(Decision, bool)> {
        // The decision leaves the thread-local closure in whole words: a
        // `Decision` returned through it was assembled from byte and word
        // stores and copied out with wider loads, which stalled on store
        // forwarding for longer than the whole lock-free decision took.
        let mut out = Words::default();
        let decided = VIEWS
            .try_with(|views| {
                // Busy only if a decision were made inside another one:
                // never, but a locked decision is the safe answer.
                let Ok(mut views) = views.try_borrow_mut() else {
                    return false;
                };
                let Some(view) = views.find(self) else {
                    return false;
                };
                view.decisions += 1;
                if view.decisions == VIEWED_DECISIONS_PER_CHECK {
                    view.decisions = 0;
                    self.quiet.fetch_add(1, Ordering::Relaxed);
                    self.enabled.store(false, Ordering::Relaxed);
                }
                let Some(Some(slots)) = view.tables.get(shard) else {
                    return false;
                };
                let Some(index) = table::find(slots, hash, key) else {
                    return false;
                };
                let Some((decision, unchanged)) = decide(table::state(slots, index)) else {
                    return false;
                };
                out = Words::from(decision);
                if unchanged && !decision.allowed {
                    out.pin = u64::from(view.last_refused.replace(key) == Some(key));
                }
                true
            })
            .unwrap_or(false);
        decided.then(|| (out.into(), out.pin != 0))
    }

    /// Keeps `slots`, shard `shard`'s current array (read under its lock),
    /// in this thread's view, unless the view holds it already.
    pub(crate) fn keep(&self, shard: usize, slots: &Slots) {
        let _ = VIEWS.try_with(|views| {
            if let Ok(mut views) = views.try_borrow_mut() {
                if let Some(view) = views.find(self) {
                    if let Some(table) = view.tables.get_mut(shard) {
                        if !table.as_ref().is_some_and(|t| Arc::ptr_eq(t, slots)) {
                            *table = Some(Arc::clone(slots));
                        }
                    }
                }
            }
        });
    }
}

impl Drop for StoreViews {
    fn drop(&mut self) {
        // The liveness token goes first, so that a thread told to look
        // finds this store dead.
        self.alive = None;
        STORES_DROPPED.fetch_add(1, Ordering::Release);
    }
}

/// A [`Decision`] and the pin flag as words.
#[derive(Default, Clone, Copy)]
struct Words {
    allowed: u64,
    has_retry: u64,
    retry_after_ms: u64,
    retry_after_wide_ms: [u64; 2],
    remaining: u64,
    pin: u64,
}

impl From<Decision> for Words {
    #[inline(always)]
    fn from(d: Decision) -> Self {
        Words {
            allowed: u64::from(d.allowed),
            has_retry: u64::from(d.retry_after_ms.is_some()),
            retry_after_ms: d.retry_after_ms.unwrap_or(0),
            retry_after_wide_ms: d.retry_after_wide_ms(),
            remaining: d.remaining,
            pin: 0,
        }
    }
}

impl From<Words> for Decision {
    #[inline(always)]
    fn from(w: Words) -> Self {
        Decision::from_parts(
            w.allowed != 0,
            (w.has_retry != 0).then_some(w.retry_after_ms),
            w.remaining,
            w.retry_after_wide_ms,
        )
    }
}

/// One thread's view of one store.
struct View {
    store: u64,
    alive: Weak<()>,
    epoch: u64,
    /// Per shard: the array last seen, if the shard is packed.
    tables: Box<[Option<Slots>]>,
    /// The key last refused without a change, through this view.
    last_refused: Option<u64>,
    /// Decisions through this view since it last turned the views off.
    decisions: u32,
}

/// One thread's views, the most recently used first.
struct Views {
    dropped_seen: u64,
    list: Vec<View>,
}

/// This thread's mark: the address of a thread-local, distinct among the
/// threads alive at once, so that a shard can tell whether the thread
/// locking it is the one that locked it last.
#[inline(always)]
pub(crate) fn thread_mark() -> usize {
    MARK.with(|mark| std::ptr::from_ref(mark) as usize)
}

thread_local! {
    static MARK: u8 = const { 0 };
    static VIEWS: RefCell<Views> = const {
        RefCell::new(Views {
            dropped_seen: 0,
            list: Vec::new(),
        })
    };
}

impl Views {
    /// The view of `store`, current for its epoch, made if need be.
    #[inline(always)]
    fn find(&mut self, store: &StoreViews) -> Option<&mut View> {
        let dropped = STORES_DROPPED.load(Ordering::Acquire);
        if dropped != self.dropped_seen {
            self.forget_dropped(dropped);
        }
        if self.list.first().is_none_or(|v| v.store != store.id) {
            self.bring_forward(store)?;
        }
        let view = self.list.first_mut()?;
        let epoch = store.epoch.load(Ordering::Acquire);
        if view.epoch != epoch {
            view.epoch = epoch;
            view.tables.iter_mut().for_each(|t| *t = None);
        }
        Some(view)
    }

    #[cold]
    fn forget_dropped(&mut self, dropped: u64) {
        self.dropped_seen = dropped;
        self.list.retain(|v| v.alive.strong_count() > 0);
    }

    /// Moves `store`'s view to the front, making it if there is none.
    #[cold]
    fn bring_forward(&mut self, store: &StoreViews) -> Option<()> {
        match self.list.iter().position(|v| v.store == store.id) {
            Some(at) => self.list[..=at].rotate_right(1),
            None => {
                let view = View {
                    store: store.id,
                    alive: Arc::downgrade(store.alive.as_ref()?),
                    epoch: store.epoch.load(Ordering::Acquire),
                    tables: (0..store.shards).map(|_| None).collect(),
                    last_refused: None,
                    decisions: 0,
                };
                self.list.truncate(MAX_VIEWS - 1);
                self.list.insert(0, view);
            }
        }
        Some(())
    }
}
