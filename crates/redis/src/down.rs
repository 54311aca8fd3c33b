//! The masters of a Redis Cluster found down, so that calls for their
//! slots fail at once instead of going to the cluster connection.
//!
//! A master whose process is down (killed, crashed, restarting) on a host
//! that still answers refuses connections, and redis-rs (1.8) then fails a
//! call for its slots within milliseconds, as long as few such calls are
//! under way. Many at once stall the whole connection: a failed call makes
//! the client reread its slot map, and while it does it answers no call, of
//! any master; with many calls under way the reread can wait for ever for
//! the lock on the client's connections (instrumented: it never got it), so
//! the stall lasts until a new connection replaces the old. Measured on a
//! loopback cluster of three masters with one killed and no replica: rounds
//! of 300 calls (200 ms timeout), a third of them for the dead master's
//! keys, decided 0 to 45 of the other masters' 201 per round, for as long
//! as the master stayed down; a new connection stalled at the next round. A
//! store that knows the master is down does not send those calls: they fail
//! at once, and the other masters' keys are decided.
//!
//! A host that is gone (powered off, cut off, or a container deleted with
//! its address) stalls the connection too, once the client's connection to
//! it is lost (as when its process died before it went): each call for its
//! slots has the client try to connect, and each try waits out its time.
//! Measured the same way, with the port neither accepting nor refusing
//! connections, every other master's key timed out, in every round, for as
//! long as it stayed away, and no new connection was taken in place of the
//! old (see `no_master_hangs`). While the client's connection to it stays
//! open, only the calls for its slots time out.
//!
//! So a master is taken for down while it refuses a TCP connection (its
//! host says so: nothing listens on the port), or while two connections
//! in a row neither succeed nor are refused within the probe's time, which
//! is the time the client itself gives a node's connection: it cannot
//! connect to such a master either. One lost packet is not enough: the
//! second connection is tried at once, with a first packet of its own. A
//! host name (where nodes announce names, not IP addresses) is resolved
//! first, within four times the probe's time: a name server slower than
//! that marks no master, since the client's connections to it need no
//! name; a name that no longer resolves counts as a failed connection. A
//! master that is slow or hung accepts connections (its kernel does), so
//! it is not taken for down, unless it stays hung until its queue of
//! connections to accept is full; its calls time out anyway. A failed call
//! (timed out, or a dropped connection) has every master of the slot map
//! probed, at most one round per [`QUIET_CHECK_INTERVAL`] while no master
//! is down and one per [`CHECK_INTERVAL`] while one is. A call not sent,
//! and a `ping` (which makes no call for their slots: serve's readiness
//! store only pings), has the masters found down probed again, so they are
//! probed as long as calls for their slots or pings come, and what a ping
//! says of a master comes from a probe of its own, never from a mark
//! alone; the slot map is read again with each
//! round: their slots are sent again as soon as they accept connections,
//! or as soon as the cluster names other masters for them (a replica that
//! took over), then on a new connection (see [`DownMasters::check`]).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use redis::cluster_async::ClusterConnection;

use crate::store::{ask_slot_map, key_slot, slot_ranges, SlotRange};

/// The least time between two rounds of probes and two reads of the slot
/// map while a master is down: at most four of each a second, however many
/// calls fail.
const CHECK_INTERVAL: Duration = Duration::from_millis(250);

/// The least time between two rounds while no master is down: calls that
/// time out for another reason (a hung master, an overloaded cluster) have
/// every master probed at most once a second. A master that goes down is
/// found by the first round after it, so at most this late.
const QUIET_CHECK_INTERVAL: Duration = Duration::from_secs(1);

/// The most probes of a round under way at once: a cluster of hundreds of
/// masters is probed a part at a time.
const PROBES_AT_ONCE: usize = 64;

/// Which masters a round of [`DownMasters::check`] probes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Probe {
    /// Every master of the slot map: after a call that failed. Not the
    /// failed call's master only: when a master goes down, the calls it
    /// stalls time out with the others' at the same moment, and the first
    /// failure to come is as likely to be another master's.
    Every,
    /// The masters found down: after a call not sent to one, so that its
    /// slots are sent again once it accepts connections, without probing
    /// the masters that are up as long as it stays down.
    Down,
}

/// The masters of a cluster found down, shared by every store on one
/// connection (see the module's documentation).
pub(crate) struct DownMasters {
    state: Mutex<State>,
    /// Whether any master is down now: read without the lock on every
    /// call, which is all a call costs while every master is up.
    any_down: AtomicBool,
    /// The most a probe's TCP connection may take: a master that neither
    /// accepts nor refuses within it, twice, is down.
    probe_timeout: Duration,
    /// The most reading the slot map may take.
    read_timeout: Duration,
    /// How long a map that replaces a down master waits for a new
    /// connection to take it (see [`DownMasters::check`]) before it is
    /// taken anyway: a new connection can be refused for as long as
    /// another master hangs (see `no_master_hangs`), and the old
    /// connection then serves the new master's slots after its own read.
    renew_wait: Duration,
}

/// A master's address, as the slot map names it.
pub(crate) type Address = (String, u16);

/// Why a master is taken for down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Down {
    /// It refused a TCP connection: nothing listens on its port.
    Refuses,
    /// Two TCP connections in a row neither succeeded nor were refused
    /// within the probe's time: its host is gone or cut off.
    Unreachable,
}

/// What a TCP connection to a master met within a probe's time.
enum Reach {
    Accepted,
    Refused,
    /// Neither within the time, or another failure (no route to the host,
    /// a name that no longer resolves).
    Failed,
    /// Its name took longer than four times the probe's time to resolve:
    /// this says nothing of the master, since the client's connections to
    /// it were made before and need no name (a slow name server is no host
    /// gone).
    Unknown,
}

/// Tries a TCP connection to `address` within `timeout`, once its name is
/// resolved (at once for an IP address, as cluster nodes announce by
/// default; within four times `timeout`, the whole `connect_timeout_ms`,
/// for a host name).
async fn reach(address: &Address, timeout: Duration) -> Reach {
    let resolving = tokio::net::lookup_host((address.0.as_str(), address.1));
    let addresses: Vec<std::net::SocketAddr> =
        match tokio::time::timeout(timeout * 4, resolving).await {
            Ok(Ok(addresses)) => addresses.collect(),
            Ok(Err(_)) => return Reach::Failed,
            Err(_) => return Reach::Unknown,
        };
    let connecting = tokio::net::TcpStream::connect(&addresses[..]);
    match tokio::time::timeout(timeout, connecting).await {
        Ok(Ok(_)) => Reach::Accepted,
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => Reach::Refused,
        Ok(Err(_)) | Err(_) => Reach::Failed,
    }
}

/// Whether the master at `address` is down (see the module's
/// documentation): it refuses a TCP connection within `timeout`, or fails
/// two in a row (the second tried at once).
async fn probe(address: &Address, timeout: Duration) -> Option<Down> {
    for _ in 0..2 {
        match reach(address, timeout).await {
            Reach::Accepted | Reach::Unknown => return None,
            Reach::Refused => return Some(Down::Refuses),
            Reach::Failed => {}
        }
    }
    Some(Down::Unreachable)
}

/// Whether the node at `address` (a master's, of a slot map) refuses a
/// TCP connection within `timeout` (it is down, rather than hung or out of
/// reach); `None` (a map that names no address) is not.
pub(crate) async fn refuses_connections(address: Option<&Address>, timeout: Duration) -> bool {
    match address {
        Some(address) => matches!(reach(address, timeout).await, Reach::Refused),
        None => false,
    }
}

#[derive(Default)]
struct State {
    /// The cluster's slot map as last read, sorted by first slot: at most
    /// `MAX_SLOT_RANGES`.
    map: Vec<SlotRange>,
    /// The masters of `map` found down when last probed, and why.
    down: HashMap<Address, Down>,
    /// Whether a round of probes is under way, and when the last began.
    probing: bool,
    last_probe: Option<Instant>,
    /// Whether a failed call asked for every master to be probed since the
    /// last round that did: the next round does, whatever starts it, so
    /// that calls not sent to one master down, which start a round as soon
    /// as one may start, cannot keep another from being found.
    every_wanted: bool,
    /// Whether the map is being read again.
    reading: bool,
    /// When a map read afresh was first found to replace a master found
    /// down, while no new connection has taken one since.
    replaced_since: Option<Instant>,
}

impl State {
    /// The range of `map` that holds `slot`, if any.
    fn range_of(&self, slot: u16) -> Option<&SlotRange> {
        // Sorted by first slot, the ranges apart (take_map).
        let after = self.map.partition_point(|range| range.first <= slot);
        let range = self.map.get(after.checked_sub(1)?)?;
        (slot <= range.last).then_some(range)
    }

    /// Starts a round of probes at `now` for a call that asks for `which`,
    /// unless one is under way or began too recently: the masters to probe,
    /// and whether to read the map again (unless a read is under way).
    fn start_round(&mut self, which: Probe, now: Instant) -> Option<(HashSet<Address>, bool)> {
        self.every_wanted |= which == Probe::Every;
        let interval = if self.down.is_empty() {
            QUIET_CHECK_INTERVAL
        } else {
            CHECK_INTERVAL
        };
        if self.probing
            || self
                .last_probe
                .is_some_and(|t| now.duration_since(t) < interval)
        {
            return None;
        }
        self.probing = true;
        self.last_probe = Some(now);
        let masters = if std::mem::take(&mut self.every_wanted) {
            self.map.iter().filter_map(|r| r.master.clone()).collect()
        } else {
            self.down.keys().cloned().collect()
        };
        let read = !self.reading;
        self.reading = true;
        Some((masters, read))
    }

    /// Whether `map` no longer names a master found down: a replica took
    /// over its slots, or it left the cluster.
    fn replaces_a_down_master(&self, map: &[SlotRange]) -> bool {
        let named: HashSet<&Address> = map.iter().filter_map(|r| r.master.as_ref()).collect();
        self.down.keys().any(|address| !named.contains(address))
    }

    /// A slot map read afresh on the old connection at `now`: taken, unless
    /// it replaces a master found down and no new connection has had
    /// `renew_wait` to take a map since the first such read (see
    /// [`DownMasters::check`]). Whether a new connection is wanted.
    fn offer_map(&mut self, map: Vec<SlotRange>, now: Instant, renew_wait: Duration) -> bool {
        let waited = |since: Instant| now.duration_since(since) >= renew_wait;
        if !self.replaces_a_down_master(&map) || self.replaced_since.is_some_and(waited) {
            self.take_map(map);
            return false;
        }
        self.replaced_since.get_or_insert(now);
        true
    }

    /// Takes a slot map read afresh: the masters it no longer names are
    /// forgotten (a replica took over their slots, or they left).
    fn take_map(&mut self, mut map: Vec<SlotRange>) {
        map.sort_by_key(|range| range.first);
        let named: HashSet<&Address> = map.iter().filter_map(|r| r.master.as_ref()).collect();
        self.down.retain(|address, _| named.contains(address));
        self.map = map;
        self.replaced_since = None;
    }
}

impl DownMasters {
    /// No master known down; `map`: the slot map, when one was read.
    pub(crate) fn new(
        map: Vec<SlotRange>,
        probe_timeout: Duration,
        read_timeout: Duration,
        renew_wait: Duration,
    ) -> Self {
        let mut state = State::default();
        state.take_map(map);
        DownMasters {
            state: Mutex::new(state),
            any_down: AtomicBool::new(false),
            probe_timeout,
            read_timeout,
            renew_wait,
        }
    }

    /// The state, and on release `any_down` made to agree with it.
    fn state(&self) -> StateGuard<'_> {
        StateGuard {
            state: self.state.lock().unwrap_or_else(PoisonError::into_inner),
            any_down: &self.any_down,
        }
    }

    /// A slot map read afresh (by a new connection).
    pub(crate) fn set_map(&self, map: Vec<SlotRange>) {
        self.state().take_map(map);
    }

    /// Masters that a new connection found refusing connections while it
    /// checked every master of the map last set (see `no_master_hangs`):
    /// down, as a probe finds them, before the connection is taken, so
    /// that no call for their slots reaches it. Many such calls would
    /// stall it, and a probe started at the same time can end after it is
    /// in place.
    pub(crate) fn found_refusing(&self, masters: Vec<Address>) {
        let mut state = self.state();
        let State { map, down, .. } = &mut *state;
        let named: HashSet<&Address> = map.iter().filter_map(|r| r.master.as_ref()).collect();
        for master in masters {
            if named.contains(&master) {
                down.insert(master, Down::Refuses);
            }
        }
    }

    /// Whether any master is down now: otherwise [`DownMasters::refusing`]
    /// refuses nothing.
    pub(crate) fn any_down(&self) -> bool {
        self.any_down.load(Ordering::Relaxed)
    }

    /// The slot map as last read.
    pub(crate) fn map(&self) -> Vec<SlotRange> {
        self.state().map.clone()
    }

    /// Whether the master at `address` refuses a TCP connection now, within
    /// the probe's time: for what a message says of it. Not whether it was
    /// found down when last probed: a store whose calls had no master
    /// probed since (one that only pings, as serve's readiness store)
    /// keeps that mark while the master is back, and then hangs.
    pub(crate) async fn refuses(&self, address: &Address) -> bool {
        refuses_connections(Some(address), self.probe_timeout).await
    }

    /// When the master of the Redis key `name`, as the slot map last read
    /// names it, is down now (see [`DownMasters::refuses`]): the master,
    /// and that it refuses connections, for an error.
    pub(crate) async fn down_master_of(&self, name: &[u8]) -> Option<String> {
        let range = self.state().range_of(key_slot(name))?.clone();
        let address = range.master.as_ref()?;
        self.refuses(address)
            .await
            .then(|| format!("the master of slots {range} refuses connections (it is down)"))
    }

    /// Whether the master at `address` was found down when last probed.
    pub(crate) fn is_down(&self, address: &Address) -> bool {
        self.any_down() && self.state().down.contains_key(address)
    }

    /// Whether the master at `address` was found unreachable (its host
    /// gone) when last probed: a second probe would wait out its time
    /// twice, where one of a master that refuses connections ends at once.
    pub(crate) fn is_unreachable(&self, address: &Address) -> bool {
        self.any_down() && self.state().down.get(address) == Some(&Down::Unreachable)
    }

    /// The slot range of the Redis key `name`, with its master as the
    /// slot map last read names it.
    pub(crate) fn range_of_key(&self, name: &[u8]) -> Option<SlotRange> {
        self.state().range_of(key_slot(name)).cloned()
    }

    /// The slot range of the Redis key `name` when its master is down (a
    /// call for it must not be sent), and what was found of the master,
    /// for the call's error.
    pub(crate) fn refusing(&self, name: &[u8]) -> Option<(SlotRange, String)> {
        if !self.any_down() {
            return None;
        }
        let slot = key_slot(name);
        let state = self.state();
        let range = state.range_of(slot)?;
        let why = match state.down.get(range.master.as_ref()?)? {
            Down::Refuses => "refuses connections (it is down)".to_owned(),
            Down::Unreachable => format!(
                "could not be connected to twice in a row, each within {} ms (its host is gone \
                 or cut off)",
                self.probe_timeout.as_millis()
            ),
        };
        Some((range.clone(), why))
    }

    /// Probes masters in the background (see [`Probe`]), and reads the slot
    /// map again on the connection `conn` gives. At most one probe round
    /// per [`CHECK_INTERVAL`] (per [`QUIET_CHECK_INTERVAL`] while no master
    /// is down), one map read at a time; never makes the caller wait.
    ///
    /// A map in which another master serves a down master's slots is not
    /// taken at once: `renew` is called instead, to start a new
    /// connection, and the map that connection reads is taken when it
    /// replaces the old (see [`DownMasters::set_map`]). The old
    /// connection's own map still names the dead master, and the first
    /// call for its slots has it read its map again, during which it
    /// answers no call of any master: measured with 100 callers on a busy
    /// cluster of three masters with a replica each, every caller timed
    /// out (200 ms) one to four times in a row, in half the runs, when
    /// the promoted replica's slots were sent again on the old
    /// connection. Until the new connection is in place those slots still
    /// fail at once, as they did while their master was down; past
    /// `renew_wait` without one, the map is taken anyway.
    pub(crate) fn check(
        self: &Arc<Self>,
        which: Probe,
        conn: impl FnOnce() -> ClusterConnection,
        renew: impl FnOnce() + Send + 'static,
    ) {
        let Some((masters, read)) = self.state().start_round(which, Instant::now()) else {
            return;
        };
        // Both before anything else can fail, so that neither flag is left
        // set.
        let probing = Ending(Arc::clone(self), |state| state.probing = false);
        let reading = read.then(|| Ending(Arc::clone(self), |state| state.reading = false));
        tokio::spawn(async move {
            let down = &probing.0;
            let probe_timeout = down.probe_timeout;
            let probes = masters.into_iter().map(|master| async move {
                let found = probe(&master, probe_timeout).await;
                (master, found)
            });
            let results: Vec<(Address, Option<Down>)> = futures_util::stream::iter(probes)
                .buffer_unordered(PROBES_AT_ONCE)
                .collect()
                .await;
            let mut state = down.state();
            let State {
                map,
                down: found_down,
                ..
            } = &mut *state;
            // A master a map read meanwhile no longer names is left out.
            let named: HashSet<&Address> = map.iter().filter_map(|r| r.master.as_ref()).collect();
            for (master, found) in results {
                match found {
                    Some(why) if named.contains(&master) => {
                        found_down.insert(master, why);
                    }
                    _ => {
                        found_down.remove(&master);
                    }
                }
            }
            drop(state);
            drop(probing);
        });
        let Some(reading) = reading else {
            return;
        };
        let conn = conn();
        let known = self.map();
        // For a replica that took a down master's slots. Apart from the
        // probes: a connection stalled by calls for a down master answers
        // nothing until it is replaced, reading the map included.
        tokio::spawn(async move {
            let down = &reading.0;
            let read = tokio::time::timeout(down.read_timeout, ask_slot_map(&conn, &known)).await;
            if let Ok(Ok(reply)) = read {
                if let Ok(map) = slot_ranges(&reply) {
                    let wants_renewal =
                        down.state().offer_map(map, Instant::now(), down.renew_wait);
                    if wants_renewal {
                        renew();
                    }
                }
            }
            drop(reading);
        });
    }
}

/// Ends a background task's part of the state (its second field) however
/// the task ends, cancelled too (when the runtime shuts down), so that a
/// later failure can start another.
struct Ending(Arc<DownMasters>, fn(&mut State));

impl Drop for Ending {
    fn drop(&mut self) {
        (self.1)(&mut self.0.state());
    }
}

/// [`DownMasters`]'s state, locked.
struct StateGuard<'a> {
    state: std::sync::MutexGuard<'a, State>,
    any_down: &'a AtomicBool,
}

impl std::ops::Deref for StateGuard<'_> {
    type Target = State;
    fn deref(&self) -> &State {
        &self.state
    }
}

impl std::ops::DerefMut for StateGuard<'_> {
    fn deref_mut(&mut self) -> &mut State {
        &mut self.state
    }
}

impl Drop for StateGuard<'_> {
    fn drop(&mut self) {
        self.any_down
            .store(!self.state.down.is_empty(), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(first: u16, last: u16, port: u16) -> SlotRange {
        SlotRange {
            first,
            last,
            master: Some(("127.0.0.1".to_owned(), port)),
            id: format!("node-{port}"),
        }
    }

    /// A key name whose slot is `slot`: the store's own names never carry
    /// a hash tag, these do.
    fn name_in(slot: u16) -> Vec<u8> {
        (0u32..)
            .map(|n| format!("{{{n}}}"))
            .find(|name| key_slot(name.as_bytes()) == slot)
            .expect("every slot has a tag")
            .into_bytes()
    }

    fn down_masters(map: Vec<SlotRange>) -> DownMasters {
        DownMasters::new(
            map,
            Duration::from_millis(10),
            Duration::from_millis(10),
            Duration::from_secs(2),
        )
    }

    /// A master is down when its port refuses a connection, or when two
    /// in a row neither succeed nor are refused; one that accepts is up.
    #[tokio::test]
    async fn a_probe_tells_a_port_that_refuses_or_is_silent_from_one_that_accepts() {
        use std::net::{Ipv4Addr, TcpListener};
        let timeout = Duration::from_millis(200);
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind");
        let address: Address = (
            "127.0.0.1".to_owned(),
            listener.local_addr().unwrap().port(),
        );
        assert_eq!(probe(&address, timeout).await, None);
        // By name: each address it resolves to is tried (`localhost` may
        // name ::1 first, where nothing listens).
        let by_name: Address = ("localhost".to_owned(), address.1);
        assert_eq!(probe(&by_name, timeout).await, None);
        // Past its queue of connections to accept (never accepted here),
        // a port is silent: Linux drops a new connection's first packet.
        let queued = crate::test_support::fill_accept_queue(&listener);
        let started = Instant::now();
        assert_eq!(probe(&address, timeout).await, Some(Down::Unreachable));
        assert!(started.elapsed() >= 2 * timeout, "tried twice");
        assert!(!refuses_connections(Some(&address), timeout).await);
        drop((listener, queued));
        assert_eq!(probe(&address, timeout).await, Some(Down::Refuses));
        assert!(refuses_connections(Some(&address), timeout).await);
        assert!(!refuses_connections(None, timeout).await);
    }

    #[test]
    fn a_slot_is_found_in_a_map_out_of_order_and_with_gaps() {
        let down = down_masters(vec![
            range(10_000, 16_383, 3),
            range(0, 4_999, 1),
            range(5_001, 9_999, 2),
        ]);
        let state = down.state();
        let port = |slot| {
            state
                .range_of(slot)
                .and_then(|r| r.master.as_ref())
                .map(|m| m.1)
        };
        assert_eq!(port(0), Some(1));
        assert_eq!(port(4_999), Some(1));
        assert_eq!(port(5_000), None);
        assert_eq!(port(5_001), Some(2));
        assert_eq!(port(9_999), Some(2));
        assert_eq!(port(10_000), Some(3));
        assert_eq!(port(16_383), Some(3));
        assert_eq!(down_masters(Vec::new()).state().range_of(0), None);
    }

    #[test]
    fn calls_not_sent_to_a_down_master_do_not_keep_others_from_being_probed() {
        let down = down_masters(vec![range(0, 8_191, 1), range(8_192, 16_383, 2)]);
        let mut state = down.state();
        state
            .down
            .insert(("127.0.0.1".to_owned(), 1), Down::Refuses);
        let start = Instant::now();
        let at = |ms| start + Duration::from_millis(ms);
        let ports = |round: Option<(HashSet<Address>, bool)>| {
            let mut ports: Vec<u16> = round.expect("a round").0.iter().map(|a| a.1).collect();
            ports.sort();
            ports
        };
        // Calls not sent probe the master that is down only; the first
        // round reads the map again, the next ones while that read lasts
        // do not.
        let first = state.start_round(Probe::Down, at(0));
        assert!(first.as_ref().is_some_and(|(_, read)| *read));
        assert_eq!(ports(first), [1]);
        state.probing = false;
        // A call that failed meanwhile starts no round of its own...
        assert!(state.start_round(Probe::Every, at(100)).is_none());
        // ...but the next round, started by a call not sent, probes all.
        assert_eq!(ports(state.start_round(Probe::Down, at(250))), [1, 2]);
        state.probing = false;
        assert_eq!(ports(state.start_round(Probe::Down, at(500))), [1]);
        // One round at a time.
        assert!(state.start_round(Probe::Every, at(1_000)).is_none());
        state.probing = false;
        // While no master is down, at most one round a second.
        state.down.clear();
        assert!(state.start_round(Probe::Every, at(1_400)).is_none());
        assert_eq!(ports(state.start_round(Probe::Every, at(1_500))), [1, 2]);
    }

    #[test]
    fn only_a_down_masters_keys_are_refused_until_a_map_names_another() {
        let down = down_masters(vec![range(0, 8_191, 1), range(8_192, 16_383, 2)]);
        let refused_range = |slot| down.refusing(&name_in(slot)).map(|(range, _)| range);
        assert_eq!(refused_range(0), None);
        down.state()
            .down
            .insert(("127.0.0.1".to_owned(), 1), Down::Refuses);
        assert_eq!(refused_range(0), Some(range(0, 8_191, 1)));
        assert_eq!(refused_range(8_191), Some(range(0, 8_191, 1)));
        assert_eq!(refused_range(8_192), None);
        assert!(down.is_down(&("127.0.0.1".to_owned(), 1)));
        assert!(!down.is_down(&("127.0.0.1".to_owned(), 2)));
        // A replica took the down master's slots.
        down.set_map(vec![range(0, 8_191, 3), range(8_192, 16_383, 2)]);
        assert!(down.state().down.is_empty());
        assert_eq!(refused_range(0), None);
    }

    /// A map read on the old connection that gives a down master's slots
    /// to another master is not taken while a new connection may still
    /// take it (the old one would stall every call to read its own map
    /// again); the new connection's map is, and so is the old one's once
    /// the new has had its time. A map that replaces no down master is
    /// taken at once.
    #[test]
    fn a_map_replacing_a_down_master_waits_for_a_new_connection() {
        let down = down_masters(vec![range(0, 8_191, 1), range(8_192, 16_383, 2)]);
        let wait = Duration::from_secs(2);
        let start = Instant::now();
        let at = |ms| start + Duration::from_millis(ms);
        let promoted = || vec![range(0, 8_191, 3), range(8_192, 16_383, 2)];
        let moved = vec![
            range(0, 99, 2),
            range(100, 8_191, 1),
            range(8_192, 16_383, 2),
        ];
        let mut state = down.state();
        assert!(!state.offer_map(moved.clone(), at(0), wait));
        assert_eq!(state.map.len(), 3, "taken: no master is down");
        state
            .down
            .insert(("127.0.0.1".to_owned(), 1), Down::Refuses);
        // A master down keeps its place in a map that still names it.
        assert!(!state.offer_map(moved, at(0), wait));
        assert!(state
            .range_of(100)
            .is_some_and(|r| r.master.as_ref().unwrap().1 == 1));
        assert!(state.offer_map(promoted(), at(0), wait));
        assert!(state.offer_map(promoted(), at(1_999), wait));
        assert_eq!(state.down.len(), 1, "still down, the map not taken");
        assert!(state
            .range_of(100)
            .is_some_and(|r| r.master.as_ref().unwrap().1 == 1));
        // The new connection did not come: the map is taken anyway.
        assert!(!state.offer_map(promoted(), at(2_000), wait));
        assert!(state.down.is_empty());
        assert!(state
            .range_of(0)
            .is_some_and(|r| r.master.as_ref().unwrap().1 == 3));
        // Another master down later waits its own full time.
        state
            .down
            .insert(("127.0.0.1".to_owned(), 2), Down::Refuses);
        let without_2 = vec![range(0, 8_191, 3), range(8_192, 16_383, 4)];
        assert!(state.offer_map(without_2.clone(), at(5_000), wait));
        assert!(state.offer_map(without_2.clone(), at(6_999), wait));
        drop(state);
        // The new connection's map is taken, and the wait ends with it.
        down.set_map(without_2);
        let state = down.state();
        assert!(state.down.is_empty());
        assert!(state.replaced_since.is_none());
        assert!(state
            .range_of(8_192)
            .is_some_and(|r| r.master.as_ref().unwrap().1 == 4));
    }

    /// A master a new connection found refusing is down at once, its keys
    /// refused as a probe's finding makes them; one the map does not name
    /// is left out.
    #[test]
    fn masters_a_new_connection_found_refusing_are_down_if_the_map_names_them() {
        let down = down_masters(vec![range(0, 8_191, 1), range(8_192, 16_383, 2)]);
        assert!(!down.any_down());
        down.found_refusing(vec![
            ("127.0.0.1".to_owned(), 2),
            ("127.0.0.1".to_owned(), 9),
        ]);
        assert!(down.any_down());
        let (range_refused, why) = down.refusing(&name_in(9_000)).expect("refused");
        assert_eq!(range_refused, range(8_192, 16_383, 2));
        assert!(why.contains("refuses connections"), "{why}");
        assert_eq!(down.refusing(&name_in(0)), None);
        assert!(!down.is_down(&("127.0.0.1".to_owned(), 9)));
    }
}
