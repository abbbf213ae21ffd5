//! Producer-side block lifecycle as a pure state machine; the clock is passed in.
//!
//! A published request's blocks are held under a lease. Every reader (a consumer rank; two for
//! heterogeneous tensor parallelism) renews the lease with heartbeats while it reads, and
//! acknowledges when done. Blocks are freed when the last reader acknowledged, on abort, or when
//! the lease expires. A reader is only ever told "go" with the time its lease has left, so it
//! can bound its reads to finish before the blocks can be freed; after expiry every call for the
//! request fails with [`LeaseError::Expired`] (or `Unknown` once forgotten).

use std::collections::{HashMap, HashSet};
use std::time::Duration;

/// The most readers one request may have (the largest tensor-parallel size,
/// [`crate::tp::MAX_TP`]): a declaration of more is refused, so that what one request's
/// bookkeeping holds is bounded whatever its readers send.
pub const MAX_READERS: usize = crate::tp::MAX_TP as usize;

/// Why a request's blocks were freed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FreeReason {
    /// Every reader acknowledged.
    Acked,
    /// The producer aborted the request.
    Aborted,
    /// No heartbeat or acknowledgement within the lease.
    Expired,
    /// Held for the longest time any request may be, whatever the heartbeats
    /// ([`Ledger::with_max_hold`]): a reader that stalls, or a peer that heartbeats without
    /// end, cannot keep the engine's blocks.
    HoldLimit,
}

/// The default ceiling on how long a request's blocks are held: a layer-wise load of a long
/// prompt at the slowest supported link (a 40 GB request at 1 GbE takes about 330 s) fits.
pub const DEFAULT_MAX_HOLD: Duration = Duration::from_secs(900);

/// The most requests one reader may be reading from a producer at once, by default (a decode
/// worker loads at most its running batch at a time; vLLM's largest default batch is 1,024).
pub const DEFAULT_PEER_REQUESTS: usize = 1024;

/// How much of a producer's cache one reader may keep held: what it is reading now (it
/// heartbeated and has not acknowledged). Past it, the reader's first call for another request
/// is refused with [`LeaseError::PeerShare`] and changes nothing, so one peer that heartbeats
/// without end cannot pin more than its share of the engine's blocks. A reader that holds
/// nothing may always take one request, however large: the share never makes a request
/// unreadable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerShare {
    /// Requests one reader may be reading at once.
    pub requests: usize,
    /// Blocks those requests may hold together.
    pub blocks: u64,
    /// The block limit holds only while another reader holds blocks too: a fair share
    /// among readers, which never refuses a lone reader (one decode worker loading many
    /// requests at once is the normal 1P1D case). `false`: a hard limit.
    pub fair: bool,
}

impl PeerShare {
    /// No limit.
    pub const UNLIMITED: PeerShare = PeerShare {
        requests: usize::MAX,
        blocks: u64::MAX,
        fair: false,
    };
}

/// What one reader keeps held now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PeerHold {
    /// Requests it is reading.
    pub requests: usize,
    /// Their blocks.
    pub blocks: u64,
}

/// Blocks the engine may reuse.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Freed {
    /// The request.
    pub request: String,
    /// Its blocks.
    pub blocks: Vec<u32>,
    /// Why.
    pub reason: FreeReason,
}

/// A lease call refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LeaseError {
    /// The request's lease ran out and its blocks were freed.
    #[error("handoff of request {0:?} expired; its blocks were freed")]
    Expired(String),
    /// The producer never published this request (or forgot it long ago).
    #[error("request {0:?} is not held by this producer")]
    Unknown(String),
    /// The producer aborted the request.
    #[error("request {0:?} was aborted by the producer")]
    Aborted(String),
    /// More readers than the request was published for.
    #[error("request {request:?} takes {expected} readers; {reader:?} would be one more")]
    TooManyReaders {
        /// The request.
        request: String,
        /// Readers it was published for.
        expected: usize,
        /// The reader refused.
        reader: String,
    },
    /// A consumer's call did not carry the grant the request was published with: it was
    /// not given the handoff (or edited it).
    #[error("request {request:?}: {reader:?} did not present the request's grant")]
    NotGranted {
        /// The request.
        request: String,
        /// The consumer refused.
        reader: String,
    },
    /// A reader declared more readers than any request may have ([`MAX_READERS`]).
    #[error("request {request:?}: {reader:?} declares {declared} readers, more than {limit}")]
    TooManyDeclared {
        /// The request.
        request: String,
        /// Readers declared.
        declared: usize,
        /// [`MAX_READERS`].
        limit: usize,
        /// The reader refused.
        reader: String,
    },
    /// A reader declared another count of readers than the request already has.
    #[error(
        "request {request:?} has {expected} readers; {reader:?} declares {declared} (the \
         consumer ranks' tensor-parallel plans disagree)"
    )]
    ReadersMismatch {
        /// The request.
        request: String,
        /// Readers it has.
        expected: usize,
        /// Readers declared.
        declared: usize,
        /// The reader refused.
        reader: String,
    },
    /// The reader already holds its share of this producer's cache ([`PeerShare`]).
    #[error(
        "request {request:?}: {reader:?} is reading {} requests of {} blocks here; one more \
         of {blocks} blocks is past its share of {} requests and {} blocks",
        held.requests, held.blocks, share.requests, share.blocks
    )]
    PeerShare {
        /// The request.
        request: String,
        /// The reader refused.
        reader: String,
        /// What it holds.
        held: PeerHold,
        /// The request's blocks.
        blocks: u64,
        /// Its share.
        share: PeerShare,
    },
}

#[derive(Debug)]
struct Hold {
    blocks: Vec<u32>,
    readers: usize,
    /// Readers seen and readers done: sets, so that a message costs the same whatever the
    /// number of names before it; each at most `readers` (at most [`MAX_READERS`]) long.
    seen: HashSet<String>,
    acked: HashSet<String>,
    until: Duration,
    /// Publication plus the ceiling: no heartbeat renews past it.
    ceiling: Duration,
}

/// The ledger of held requests.
#[derive(Debug)]
pub struct Ledger {
    lease: Duration,
    max_hold: Duration,
    held: HashMap<String, Hold>,
    /// Ended requests (for precise errors), bounded.
    ended: HashMap<String, FreeReason>,
    ended_order: std::collections::VecDeque<String>,
    pending: Vec<Freed>,
    share: PeerShare,
    /// What each reader keeps held: one entry per reader reading something (at most
    /// [`MAX_READERS`] a request), gone when it holds nothing.
    pins: HashMap<String, PeerHold>,
    /// Readers whose hold changed since [`Ledger::take_hold_changes`].
    changed: HashSet<String>,
}

/// How many ended requests the ledger remembers for error messages.
const ENDED_MEMORY: usize = 4096;

impl Ledger {
    /// A ledger whose leases last `lease` from publication or the last heartbeat.
    pub fn new(lease: Duration) -> Ledger {
        Ledger {
            lease,
            max_hold: DEFAULT_MAX_HOLD,
            held: HashMap::new(),
            ended: HashMap::new(),
            ended_order: Default::default(),
            pending: Vec::new(),
            share: PeerShare::UNLIMITED,
            pins: HashMap::new(),
            changed: HashSet::new(),
        }
    }

    /// This ledger with `share` as every reader's share ([`PeerShare`]).
    pub fn with_share(mut self, share: PeerShare) -> Ledger {
        self.share = share;
        self
    }

    /// This ledger with a ceiling of `max_hold` on how long any request is held from its
    /// publication, whatever the heartbeats (at least the lease).
    pub fn with_max_hold(mut self, max_hold: Duration) -> Ledger {
        self.max_hold = max_hold.max(self.lease);
        self
    }

    /// The lease length.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// Holds `blocks` of `request` for `readers` readers from `now`. Publishing a request
    /// again replaces its blocks and restarts its lease.
    pub fn hold(&mut self, request: &str, blocks: Vec<u32>, readers: usize, now: Duration) {
        self.ended.remove(request);
        let old = self.held.insert(
            request.to_string(),
            Hold {
                blocks,
                readers: readers.clamp(1, MAX_READERS),
                seen: HashSet::new(),
                acked: HashSet::new(),
                until: now + self.lease,
                ceiling: now + self.max_hold,
            },
        );
        if let Some(old) = old {
            self.unpin_readers(&old);
        }
    }

    fn refuse(&self, request: &str) -> LeaseError {
        match self.ended.get(request) {
            Some(FreeReason::Expired | FreeReason::HoldLimit) => {
                LeaseError::Expired(request.to_string())
            }
            Some(FreeReason::Aborted) => LeaseError::Aborted(request.to_string()),
            Some(FreeReason::Acked) | None => LeaseError::Unknown(request.to_string()),
        }
    }

    /// A reader declares how many readers the request has (its tensor-parallel plan counts
    /// them): the first declaration, before any reader is seen, sets the count (it overrides
    /// the one published); a later one must agree. Call before the reader's heartbeat or ack.
    pub fn declare(
        &mut self,
        request: &str,
        reader: &str,
        readers: usize,
        now: Duration,
    ) -> Result<(), LeaseError> {
        self.expire_one(request, now);
        let Some(h) = self.held.get_mut(request) else {
            return Err(self.refuse(request));
        };
        if readers > MAX_READERS {
            return Err(LeaseError::TooManyDeclared {
                request: request.to_string(),
                declared: readers,
                limit: MAX_READERS,
                reader: reader.to_string(),
            });
        }
        let readers = readers.max(1);
        let first = h.seen.is_empty() && h.acked.is_empty();
        let known = h.seen.contains(reader) || h.acked.contains(reader);
        if first {
            h.readers = readers;
        } else if readers != h.readers && !known {
            return Err(LeaseError::ReadersMismatch {
                request: request.to_string(),
                expected: h.readers,
                declared: readers,
                reader: reader.to_string(),
            });
        }
        Ok(())
    }

    /// A reader's heartbeat: renews the lease (never past the request's ceiling) and returns
    /// the time it has left. Expired leases are not revived, and a reader that has
    /// acknowledged renews nothing.
    pub fn heartbeat(
        &mut self,
        request: &str,
        reader: &str,
        now: Duration,
    ) -> Result<Duration, LeaseError> {
        self.expire_one(request, now);
        let lease = self.lease;
        let Some(h) = self.held.get_mut(request) else {
            return Err(self.refuse(request));
        };
        if h.acked.contains(reader) {
            return Ok(h.until.saturating_sub(now));
        }
        if !h.seen.contains(reader) {
            if h.seen.len() >= h.readers {
                return Err(LeaseError::TooManyReaders {
                    request: request.to_string(),
                    expected: h.readers,
                    reader: reader.to_string(),
                });
            }
            let blocks = h.blocks.len() as u64;
            let held = self.pins.get(reader).copied().unwrap_or_default();
            let share = self.share;
            let others = self.pins.len() > usize::from(held.requests > 0);
            let over_blocks = held.blocks.saturating_add(blocks) > share.blocks;
            if held.requests > 0
                && (held.requests >= share.requests || over_blocks && (others || !share.fair))
            {
                return Err(LeaseError::PeerShare {
                    request: request.to_string(),
                    reader: reader.to_string(),
                    held,
                    blocks,
                    share,
                });
            }
            h.seen.insert(reader.to_string());
            let p = self.pins.entry(reader.to_string()).or_default();
            p.requests += 1;
            p.blocks += blocks;
            self.changed.insert(reader.to_string());
        }
        h.until = (now + lease).min(h.ceiling);
        Ok(h.until.saturating_sub(now))
    }

    /// Time left on the lease, or why there is none.
    pub fn remaining(&mut self, request: &str, now: Duration) -> Result<Duration, LeaseError> {
        self.expire_one(request, now);
        match self.held.get(request) {
            Some(h) => Ok(h.until.saturating_sub(now)),
            None => Err(self.refuse(request)),
        }
    }

    /// A reader is done. Returns the freed blocks once the last reader acknowledged.
    pub fn ack(
        &mut self,
        request: &str,
        reader: &str,
        now: Duration,
    ) -> Result<Option<Freed>, LeaseError> {
        self.expire_one(request, now);
        let Some(h) = self.held.get_mut(request) else {
            return Err(self.refuse(request));
        };
        if !h.acked.contains(reader) {
            if h.acked.len() >= h.readers {
                return Err(LeaseError::TooManyReaders {
                    request: request.to_string(),
                    expected: h.readers,
                    reader: reader.to_string(),
                });
            }
            h.acked.insert(reader.to_string());
            if h.seen.contains(reader) {
                let blocks = h.blocks.len() as u64;
                unpin(&mut self.pins, &mut self.changed, reader, blocks);
            }
        }
        if h.acked.len() >= h.readers {
            return Ok(self.end(request, FreeReason::Acked));
        }
        Ok(None)
    }

    /// The producer gives up on a request (e.g. the client went away).
    pub fn abort(&mut self, request: &str) -> Option<Freed> {
        self.end(request, FreeReason::Aborted)
    }

    /// Frees every request whose lease ended by `now`.
    pub fn tick(&mut self, now: Duration) -> Vec<Freed> {
        let expired: Vec<String> = self
            .held
            .iter()
            .filter(|(_, h)| h.until <= now)
            .map(|(k, _)| k.clone())
            .collect();
        expired
            .into_iter()
            .filter_map(|r| {
                let reason = self.reason_at(&r, now);
                self.end(&r, reason)
            })
            .collect()
    }

    /// Why a request whose lease ended by `now` ended: its ceiling, or no heartbeat.
    fn reason_at(&self, request: &str, now: Duration) -> FreeReason {
        match self.held.get(request) {
            Some(h) if h.ceiling <= now => FreeReason::HoldLimit,
            _ => FreeReason::Expired,
        }
    }

    /// The earliest lease end, for scheduling the next tick.
    pub fn next_expiry(&self) -> Option<Duration> {
        self.held.values().map(|h| h.until).min()
    }

    /// Requests held now.
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// What `reader` keeps held now.
    pub fn peer_hold(&self, reader: &str) -> PeerHold {
        self.pins.get(reader).copied().unwrap_or_default()
    }

    /// The readers whose hold changed since the last call, with what they hold now (zero
    /// for one that holds nothing any more): for per-peer metrics.
    pub fn take_hold_changes(&mut self) -> Vec<(String, PeerHold)> {
        let changed = std::mem::take(&mut self.changed);
        changed
            .into_iter()
            .map(|r| {
                let h = self.peer_hold(&r);
                (r, h)
            })
            .collect()
    }

    /// Returns what `h`'s readers that have not acknowledged keep held.
    fn unpin_readers(&mut self, h: &Hold) {
        let blocks = h.blocks.len() as u64;
        for r in h.seen.iter().filter(|r| !h.acked.contains(*r)) {
            unpin(&mut self.pins, &mut self.changed, r, blocks);
        }
    }

    fn expire_one(&mut self, request: &str, now: Duration) {
        if self.held.get(request).is_some_and(|h| h.until <= now) {
            // Freed by expiry; the caller reports it through `tick` or the error.
            let reason = self.reason_at(request, now);
            if let Some(f) = self.end(request, reason) {
                self.pending.push(f);
            }
        }
    }

    /// Frees found by calls other than `tick` (expiry noticed during a heartbeat or ack).
    pub fn take_pending(&mut self) -> Vec<Freed> {
        std::mem::take(&mut self.pending)
    }

    fn end(&mut self, request: &str, reason: FreeReason) -> Option<Freed> {
        let h = self.held.remove(request)?;
        self.unpin_readers(&h);
        self.ended.insert(request.to_string(), reason);
        self.ended_order.push_back(request.to_string());
        while self.ended_order.len() > ENDED_MEMORY {
            if let Some(old) = self.ended_order.pop_front() {
                if !self.held.contains_key(&old) {
                    self.ended.remove(&old);
                }
            }
        }
        Some(Freed {
            request: request.to_string(),
            blocks: h.blocks,
            reason,
        })
    }
}

/// `reader` no longer holds one request of `blocks` blocks.
fn unpin(
    pins: &mut HashMap<String, PeerHold>,
    changed: &mut HashSet<String>,
    reader: &str,
    blocks: u64,
) {
    if let Some(p) = pins.get_mut(reader) {
        p.requests = p.requests.saturating_sub(1);
        p.blocks = p.blocks.saturating_sub(blocks);
        if p.requests == 0 {
            pins.remove(reader);
        }
        changed.insert(reader.to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// One hostile call: (what, request index, reader index, declared readers, seconds).
    fn call() -> impl Strategy<Value = (u8, u8, u16, u32, u8)> {
        (
            0u8..6,
            0u8..6,
            0u16..2000,
            prop_oneof![0u32..4, Just(u32::MAX)],
            0u8..3,
        )
    }

    /// What each reader holds, counted again from the held requests.
    fn recount(l: &Ledger) -> HashMap<String, PeerHold> {
        let mut m: HashMap<String, PeerHold> = HashMap::new();
        for h in l.held.values() {
            for r in h.seen.iter().filter(|r| !h.acked.contains(*r)) {
                let p = m.entry(r.clone()).or_default();
                p.requests += 1;
                p.blocks += h.blocks.len() as u64;
            }
        }
        m
    }

    proptest! {
        /// Any run of calls from many readers keeps what the ledger holds bounded (per
        /// request at most its readers, at most MAX_READERS; per reader at most its share)
        /// and its per-reader accounting exact, whatever the order.
        #[test]
        fn hostile_runs_keep_the_ledger_bounded_and_its_shares_exact(
            calls in proptest::collection::vec(call(), 1..400),
        ) {
            let share = PeerShare { requests: 3, blocks: 20, fair: false };
            let mut l = Ledger::new(s(2)).with_max_hold(s(6)).with_share(share);
            let mut now = s(0);
            for (what, req, reader, declared, dt) in calls {
                now += s(u64::from(dt));
                let (r, who) = (format!("r{req}"), format!("peer-{reader}"));
                match what {
                    0 => l.hold(&r, vec![u32::from(req); usize::from(req) + 1], 1, now),
                    1 => { let _ = l.declare(&r, &who, declared as usize, now); }
                    2 | 3 => { let _ = l.heartbeat(&r, &who, now); }
                    4 => { let _ = l.ack(&r, &who, now); }
                    _ => { let _ = l.tick(now); }
                }
                l.take_pending();
                for h in l.held.values() {
                    prop_assert!(h.readers <= MAX_READERS);
                    prop_assert!(h.seen.len() <= h.readers && h.acked.len() <= h.readers);
                    prop_assert!(h.until <= h.ceiling);
                }
                prop_assert!(l.ended.len() <= ENDED_MEMORY && l.ended_order.len() <= ENDED_MEMORY + 1);
                let want = recount(&l);
                prop_assert_eq!(&l.pins, &want);
                for p in l.pins.values() {
                    prop_assert!(p.requests >= 1 && p.requests <= share.requests);
                    prop_assert!(p.requests == 1 || p.blocks <= share.blocks);
                }
            }
        }
    }

    fn s(x: u64) -> Duration {
        Duration::from_secs(x)
    }

    #[test]
    fn heartbeats_without_end_stop_at_the_ceiling() {
        let mut l = Ledger::new(s(2)).with_max_hold(s(10));
        l.hold("r", vec![4, 5], 1, s(0));
        // A heartbeat every second for 20 s: renewed up to the ceiling, never past it.
        let mut freed = Vec::new();
        for t in 1..=20 {
            if let Ok(left) = l.heartbeat("r", "d0", s(t)) {
                assert!(s(t) + left <= s(10), "renewed past the ceiling at {t} s");
            }
            freed.extend(l.tick(s(t)));
            freed.extend(l.take_pending());
        }
        assert_eq!(freed.len(), 1);
        assert_eq!(freed[0].reason, FreeReason::HoldLimit);
        assert!(matches!(
            l.heartbeat("r", "d0", s(21)),
            Err(LeaseError::Expired(_))
        ));
    }

    #[test]
    fn a_reader_that_acknowledged_cannot_extend_the_lease() {
        let mut l = Ledger::new(s(2));
        l.hold("r", vec![1], 2, s(0));
        l.heartbeat("r", "d0", s(0)).unwrap();
        assert!(l.ack("r", "d0", s(0)).unwrap().is_none());
        // d0 is done; its heartbeats no longer renew. The other reader never comes.
        for t in 1..4 {
            let _ = l.heartbeat("r", "d0", s(t));
        }
        let f = l.tick(s(4));
        let f: Vec<_> = f.into_iter().chain(l.take_pending()).collect();
        assert_eq!(f.len(), 1, "held past its lease by a reader that was done");
        assert_eq!(f[0].reason, FreeReason::Expired);
    }

    #[test]
    fn a_declaration_beyond_the_limit_is_refused_and_changes_nothing() {
        let mut l = Ledger::new(s(10));
        l.hold("squat", vec![1], 1, s(0));
        let e = l
            .declare("squat", "hostile", u32::MAX as usize, s(0))
            .unwrap_err();
        assert!(
            matches!(
                e,
                LeaseError::TooManyDeclared {
                    limit: MAX_READERS,
                    ..
                }
            ),
            "{e:?}"
        );
        // The real reader's declaration of 1 still sets the count, and its ack frees.
        l.declare("squat", "dec", 1, s(0)).unwrap();
        l.heartbeat("squat", "dec", s(1)).unwrap();
        assert!(l.ack("squat", "dec", s(1)).unwrap().is_some());
    }

    #[test]
    // Timed, and sized for native speed: Miri would take minutes and miss the bound.
    #[cfg_attr(miri, ignore)]
    fn a_flood_of_reader_names_costs_linear_time_and_bounded_memory() {
        // The most readers allowed, then 40,000 names: each message is a set lookup, and at
        // most MAX_READERS names are kept. (Before: two lists scanned per message; 40,000
        // names took 6.6 s of the producer's core.)
        let mut l = Ledger::new(s(10));
        l.hold("r", vec![1], 1, s(0));
        l.declare("r", "first", MAX_READERS, s(0)).unwrap();
        let t0 = std::time::Instant::now();
        let mut refused = 0;
        for i in 0..40_000 {
            let name = format!("reader-{i}");
            if l.heartbeat("r", &name, s(1)).is_err() {
                refused += 1;
            }
        }
        assert_eq!(refused, 40_000 - MAX_READERS);
        assert_eq!(l.held["r"].seen.len(), MAX_READERS);
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(2),
            "{:?} for 40,000 messages",
            t0.elapsed()
        );
    }

    #[test]
    fn one_peer_pins_no_more_than_its_share_of_requests() {
        // A peer given 50 requests heartbeats each without end: it holds 16, the share; its
        // calls for the others are refused, change nothing, and those expire at their lease.
        let share = PeerShare {
            requests: 16,
            blocks: u64::MAX,
            fair: false,
        };
        let mut l = Ledger::new(s(2)).with_share(share);
        for i in 0..50 {
            l.hold(&format!("r{i}"), vec![i; 8], 1, s(0));
        }
        l.hold("good", vec![99], 1, s(0));
        let mut refused = 0;
        for t in 0..3 {
            for i in 0..50 {
                match l.heartbeat(&format!("r{i}"), "hog", s(t)) {
                    Ok(_) => {}
                    Err(LeaseError::PeerShare { held, .. }) => {
                        assert_eq!(held.requests, 16);
                        refused += 1;
                    }
                    Err(LeaseError::Expired(_)) => {}
                    Err(e) => panic!("{e:?}"),
                }
            }
        }
        assert!(refused >= 34, "{refused} refusals");
        assert_eq!(
            l.peer_hold("hog"),
            PeerHold {
                requests: 16,
                blocks: 128
            }
        );
        // The refused requests lapsed at their lease; the 16 the hog holds are still held.
        let freed: Vec<_> = l.tick(s(3)).into_iter().chain(l.take_pending()).collect();
        assert_eq!(freed.iter().filter(|f| f.request != "good").count(), 34);
        // Another peer is not charged for the hog: its request reads and frees.
        l.hold("good", vec![99], 1, s(3));
        l.heartbeat("good", "dec", s(3)).unwrap();
        assert!(l.ack("good", "dec", s(3)).unwrap().is_some());
        // The hog's acknowledgements give its share back.
        for i in 0..16 {
            assert!(l.ack(&format!("r{i}"), "hog", s(3)).unwrap().is_some());
        }
        assert_eq!(l.peer_hold("hog"), PeerHold::default());
        assert!(l.pins.is_empty(), "{:?}", l.pins);
    }

    #[test]
    fn the_share_in_blocks_admits_one_request_of_any_size() {
        let share = PeerShare {
            requests: 100,
            blocks: 150,
            fair: false,
        };
        let mut l = Ledger::new(s(10)).with_share(share);
        l.hold("huge", (0..400).collect(), 1, s(0));
        l.hold("a", (0..100).collect(), 1, s(0));
        l.hold("b", (0..100).collect(), 1, s(0));
        // A reader that holds nothing may take a request larger than its share ...
        l.heartbeat("huge", "d", s(0)).unwrap();
        // ... but nothing more while it holds it.
        let e = l.heartbeat("a", "d", s(0)).unwrap_err();
        assert!(
            matches!(e, LeaseError::PeerShare { blocks: 100, .. }),
            "{e:?}"
        );
        assert!(e.to_string().contains("past its share"), "{e}");
        assert!(l.ack("huge", "d", s(1)).unwrap().is_some());
        l.heartbeat("a", "d", s(1)).unwrap();
        assert!(matches!(
            l.heartbeat("b", "d", s(1)),
            Err(LeaseError::PeerShare { .. })
        ));
        // Expiry, abort and republication give the share back too.
        assert!(l.abort("a").is_some());
        l.heartbeat("b", "d", s(1)).unwrap();
        l.hold("b", (0..10).collect(), 1, s(2));
        assert_eq!(l.peer_hold("d"), PeerHold::default());
        l.heartbeat("b", "d", s(2)).unwrap();
        assert_eq!(l.peer_hold("d").blocks, 10);
        l.tick(s(20));
        assert_eq!(l.peer_hold("d"), PeerHold::default());
        let changes = l.take_hold_changes();
        assert_eq!(changes, vec![("d".to_string(), PeerHold::default())]);
    }

    #[test]
    fn a_fair_share_binds_only_while_another_reader_holds_blocks() {
        let share = PeerShare {
            requests: 100,
            blocks: 10,
            fair: true,
        };
        let mut l = Ledger::new(s(10)).with_share(share);
        for i in 0..6 {
            l.hold(&format!("r{i}"), vec![i; 8], 1, s(0));
        }
        // Alone, "d" may hold 24 blocks past its 10.
        for i in 0..3 {
            l.heartbeat(&format!("r{i}"), "d", s(0)).unwrap();
        }
        // Once "e" holds blocks too, "d" gets nothing more; "e" is within its share.
        l.heartbeat("r3", "e", s(0)).unwrap();
        assert!(matches!(
            l.heartbeat("r4", "d", s(0)),
            Err(LeaseError::PeerShare { .. })
        ));
        assert!(
            matches!(
                l.heartbeat("r4", "e", s(0)),
                Err(LeaseError::PeerShare { .. })
            ),
            "8 + 8 blocks is past e's 10 too, while d holds some"
        );
        assert!(l.ack("r3", "e", s(1)).unwrap().is_some());
        l.heartbeat("r4", "d", s(1)).unwrap();
    }

    #[test]
    fn ack_frees_after_the_only_reader() {
        let mut l = Ledger::new(s(10));
        l.hold("r1", vec![1, 2, 3], 1, s(0));
        assert_eq!(l.heartbeat("r1", "d0", s(1)).unwrap(), s(10));
        let f = l.ack("r1", "d0", s(2)).unwrap().unwrap();
        assert_eq!((f.blocks, f.reason), (vec![1, 2, 3], FreeReason::Acked));
        assert_eq!(l.held(), 0);
        assert!(matches!(
            l.heartbeat("r1", "d0", s(3)),
            Err(LeaseError::Unknown(_))
        ));
    }

    #[test]
    fn two_readers_free_after_the_last() {
        let mut l = Ledger::new(s(10));
        l.hold("r", vec![7], 2, s(0));
        l.heartbeat("r", "rank0", s(1)).unwrap();
        l.heartbeat("r", "rank1", s(1)).unwrap();
        assert!(matches!(
            l.heartbeat("r", "rank2", s(1)),
            Err(LeaseError::TooManyReaders { expected: 2, .. })
        ));
        assert_eq!(l.ack("r", "rank0", s(2)).unwrap(), None);
        assert_eq!(
            l.ack("r", "rank0", s(2)).unwrap(),
            None,
            "a repeated ack counts once"
        );
        assert_eq!(l.held(), 1);
        let f = l.ack("r", "rank1", s(3)).unwrap().unwrap();
        assert_eq!(f.reason, FreeReason::Acked);
    }

    #[test]
    fn declared_readers_override_the_published_count_and_must_agree() {
        let mut l = Ledger::new(s(10));
        l.hold("r", vec![1], 1, s(0));
        l.declare("r", "rank0", 2, s(1)).unwrap();
        l.heartbeat("r", "rank0", s(1)).unwrap();
        assert!(matches!(
            l.declare("r", "rank1", 3, s(1)),
            Err(LeaseError::ReadersMismatch {
                expected: 2,
                declared: 3,
                ..
            })
        ));
        l.declare("r", "rank1", 2, s(1)).unwrap();
        assert_eq!(l.ack("r", "rank0", s(2)).unwrap(), None);
        assert!(l.ack("r", "rank1", s(2)).unwrap().is_some());
        assert!(matches!(
            l.declare("gone", "rank0", 2, s(2)),
            Err(LeaseError::Unknown(_))
        ));
    }

    #[test]
    fn expiry_frees_and_heartbeats_renew() {
        let mut l = Ledger::new(s(10));
        l.hold("a", vec![1], 1, s(0));
        l.hold("b", vec![2], 1, s(0));
        assert_eq!(l.next_expiry(), Some(s(10)));
        // a's reader keeps it alive; b has none.
        l.heartbeat("a", "d", s(8)).unwrap();
        assert_eq!(l.remaining("a", s(9)).unwrap(), s(9));
        let f = l.tick(s(10));
        assert_eq!(f.len(), 1);
        assert_eq!(
            (f[0].request.as_str(), f[0].reason),
            ("b", FreeReason::Expired)
        );
        assert!(matches!(
            l.heartbeat("b", "d", s(11)),
            Err(LeaseError::Expired(_))
        ));
        assert!(matches!(
            l.ack("b", "d", s(11)),
            Err(LeaseError::Expired(_))
        ));
        // a expires at 18 without more heartbeats; a late heartbeat does not revive it.
        assert!(matches!(
            l.heartbeat("a", "d", s(18)),
            Err(LeaseError::Expired(_))
        ));
        let p = l.take_pending();
        assert_eq!((p.len(), p[0].reason), (1, FreeReason::Expired));
        assert!(l.tick(s(100)).is_empty(), "freed once");
    }

    #[test]
    fn abort_and_republish() {
        let mut l = Ledger::new(s(10));
        l.hold("r", vec![1, 2], 1, s(0));
        let f = l.abort("r").unwrap();
        assert_eq!(f.reason, FreeReason::Aborted);
        assert!(l.abort("r").is_none());
        assert!(matches!(
            l.remaining("r", s(1)),
            Err(LeaseError::Aborted(_))
        ));
        l.hold("r", vec![3], 1, s(2));
        assert_eq!(l.remaining("r", s(2)).unwrap(), s(10));
        assert!(matches!(
            l.remaining("nope", s(2)),
            Err(LeaseError::Unknown(_))
        ));
    }
}
