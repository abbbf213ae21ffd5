//! Transfers described in the paged form ([`kvxfer_proto::paged`]): one entry per layer and
//! tensor instead of one descriptor per block, resolved against the local region table and
//! the peer's, paired into runs, and planned once.
#![forbid(unsafe_code)]

use std::time::{Duration, Instant};

use super::handle::Agent;
use super::prepared::PreparedLocal;
use crate::transfer::{Transfer, Work};
use kvxfer_proto::error::{Result, Side};
use kvxfer_proto::paged::{plan_paged, resolve_paged, Paged};
use kvxfer_proto::types::{MemKind, XferOp};
use kvxfer_proto::wire::notify::check_payload;

impl Agent {
    /// Starts a transfer between `local[i]` and `remote[i]` (the peer's regions), block by
    /// block, each pair holding as many blocks of the same length; notification and deadline
    /// as for [`Agent::transfer`]. What [`KvLayout::paged`](kvxfer_proto::layout::KvLayout::paged)
    /// describes: a request's blocks once per layer and tensor, not once per block.
    pub fn transfer_paged(
        &self,
        op: XferOp,
        peer: &str,
        local: &[Paged],
        remote: &[Paged],
        notification: Option<&[u8]>,
        deadline: Option<Duration>,
    ) -> Result<Transfer> {
        let t0 = Instant::now();
        check_payload(notification)?;
        let (regions, spans) = self.local_regions(local.iter().map(|p| p.region))?;
        let l = resolve_paged(Side::Local, local, &spans)?;
        let (token, r, remote_dev) = {
            let peers = self.shared.peers.read().unwrap_or_else(|e| e.into_inner());
            let view = peers.get(peer).ok_or_else(|| self.shared.missing(peer))?;
            let r = resolve_paged(Side::Remote, remote, &view.spans)?;
            let dev = r
                .iter()
                .any(|e| view.spans[e.slot as usize].kind != MemKind::Host);
            (view.token, r, dev)
        };
        let plan = plan_paged(l, r)?;
        // Device memory takes the routes that stage or map it, which post from a list.
        let plan = if remote_dev || regions.iter().any(|r| r.kind != MemKind::Host) {
            Work::Flat(plan.expand(self.shared.max_op))
        } else {
            Work::Paged(plan)
        };
        let local = PreparedLocal {
            entries: Vec::new(),
            regions,
        };
        self.submit(op, &local, peer, token, plan, notification, deadline, t0)
    }
}
