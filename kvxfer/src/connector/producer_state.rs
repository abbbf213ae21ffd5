//! What a producer's calls, its thread and its push writes share: the requests it holds
//! (and, of each, the push targets it writes), behind one lock. The shell that runs them is
//! `producer.rs`; the writes are `push.rs`'s.
#![forbid(unsafe_code)]

use std::collections::{HashMap, VecDeque};
use std::sync::{Condvar, Mutex};
use std::time::Instant;

use super::carrier::{Carrier, InFlight};
use super::config::ConnectorConfig;
use super::shell::Figures;
use crate::budget::Charge;
use crate::telemetry::Telemetry;
use kvxfer_proto::connector::ProducerCore;
use kvxfer_proto::groups::CacheGroups;
use kvxfer_proto::layout::KvLayout;
use kvxfer_proto::lifecycle::{FreeReason, Freed};
use kvxfer_proto::wire::connector::{Grant, Mode};

/// One push consumer's progress through a request.
pub(super) struct PushTarget {
    pub(super) reader: String,
    /// The consumer's cache as its push request described it, per group.
    pub(super) local: Vec<KvLayout>,
    /// Per group, the producer's blocks and the consumer's they go to, paired.
    pub(super) pairs: Vec<(Vec<u32>, Vec<u32>)>,
    /// Per group, this producer's cache in the consumer's smaller blocks, where the two
    /// block sizes differ ([`kvxfer_proto::block_size::split`]); `pairs` count in those.
    pub(super) views: Vec<Option<KvLayout>>,
    /// Bytes of the producer's blocks the consumer holds already (its cached prefix).
    pub(super) skipped: u64,
    pub(super) posted: usize,
    pub(super) inflight: Vec<(usize, Box<dyn InFlight>)>,
    pub(super) landed: usize,
    pub(super) figures: Figures,
    pub(super) failed: bool,
    pub(super) _charge: Charge,
}

/// The shell's side of a held request (the protocol's side is in the core).
pub(super) struct HeldRequest {
    /// Per cache group.
    pub(super) blocks: Vec<Vec<u32>>,
    /// The request's tokens, as published: how far its blocks reach.
    pub(super) tokens: u64,
    pub(super) pushes: Vec<PushTarget>,
    pub(super) published: Instant,
    /// The handoff's grant: what its readers are opened under.
    pub(super) grant: Grant,
}

pub(super) struct ProducerState {
    pub(super) core: ProducerCore,
    pub(super) requests: HashMap<String, HeldRequest>,
    pub(super) freed: VecDeque<Freed>,
    pub(super) stop: bool,
}

impl ProducerState {
    /// A request's blocks are free: the shell forgets it, the engine may take the blocks. A
    /// pull request every reader acknowledged counts as served, one that expired as failed
    /// (a push request was counted when its writes landed).
    pub(super) fn record_freed(
        &mut self,
        f: Freed,
        tel: &Telemetry,
        mode: Mode,
        carrier: &dyn Carrier,
    ) {
        if let Some(r) = self.requests.remove(&f.request) {
            // Closed before the engine may reuse the blocks.
            revoke_groups(carrier, &r.grant, r.blocks.len());
            match f.reason {
                FreeReason::Acked if mode == Mode::Pull => tel.served(r.published.elapsed()),
                FreeReason::Expired | FreeReason::HoldLimit => tel.failed(),
                _ => {}
            }
        }
        self.freed.push_back(f);
    }
}

/// Ends what `grant` opened of each of a request's `groups` cache groups.
pub(super) fn revoke_groups(carrier: &dyn Carrier, grant: &Grant, groups: usize) {
    for g in 0..groups {
        carrier.revoke(&grant.for_group(g));
    }
}

/// What the engine's calls and the producer's thread share.
pub(super) struct ProducerShared {
    pub(super) carrier: Box<dyn Carrier>,
    pub(super) groups: CacheGroups,
    pub(super) cfg: ConnectorConfig,
    pub(super) st: Mutex<ProducerState>,
    pub(super) cv: Condvar,
    pub(super) t0: Instant,
    pub(super) tel: Telemetry,
}
