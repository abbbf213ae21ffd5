//! Starting a planned transfer: the local regions a description names, the route (one of
//! kvxfer's lanes or UCX), the pins, and the job handed to its lane.
#![forbid(unsafe_code)]

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::handle::Agent;
use super::prepared::PreparedLocal;
use super::route::{check_strict, route, Route};
use crate::host::same_boot_elsewhere;
use crate::memory::{Pins, RegionInner};
use crate::transfer::{Job, Transfer, Work, XferState};
use kvxfer_proto::error::{Error, Result, Side};
use kvxfer_proto::types::{RegionId, RegionSpan, XferOp};
use kvxfer_proto::wire::notify::encode;

impl Agent {
    /// The registered regions `ids` names (each once, in order of first mention), and their
    /// spans; an unknown one fails with the index of its first mention.
    pub(super) fn local_regions(
        &self,
        ids: impl Iterator<Item = RegionId>,
    ) -> Result<(Vec<Arc<RegionInner>>, Vec<RegionSpan>)> {
        let regions = self.shared.regions.read();
        let mut table: Vec<Arc<RegionInner>> = Vec::new();
        let mut spans: Vec<RegionSpan> = Vec::new();
        // Only the regions the list names go into the prepared table.
        for (index, id) in ids.enumerate() {
            if spans.iter().any(|s| s.id == id) {
                continue;
            }
            let r = regions.get(&id.0).ok_or(Error::UnknownRegion {
                side: Side::Local,
                index,
                region: id.0,
            })?;
            spans.push(RegionSpan {
                id: r.id,
                base: r.addr,
                len: r.len,
                kind: r.kind,
            });
            table.push(r.clone());
        }
        Ok((table, spans))
    }

    /// Routes and starts the transfer `plan` between `local`'s regions and the peer's regions
    /// of entry `token`. A paged plan stays paged on the TCP lane, which carries that form;
    /// the other lanes post from a list and get the flat form.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn submit(
        &self,
        op: XferOp,
        local: &PreparedLocal,
        peer: &str,
        token: u64,
        plan: Work,
        notification: Option<&[u8]>,
        deadline: Option<Duration>,
        t0: Instant,
    ) -> Result<Transfer> {
        let view = self
            .shared
            .peers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(peer)
            .filter(|v| v.token == token)
            .cloned();
        if let Some(v) = &view {
            v.touch(self.shared.now());
        }
        if view.is_none() {
            // Gone (its key vanished): fail now, typed, without a trip to the engine.
            if let e @ Error::PeerFailed { .. } = self.shared.missing(peer) {
                return Err(e);
            }
        }
        let lane_notes = self.shared.lane_notes() && notification.is_some();
        let (route, local_dev) = if lane_notes && plan.op_count() == 0 {
            // A notification alone: over the sealed lane, whatever carries data.
            (Route::Lane(self.shared.note_lane(peer)?), Vec::new())
        } else {
            let by_lane = op == XferOp::Write
                && self.shared.shm_writes_by_lane
                && view
                    .as_ref()
                    .is_some_and(|v| same_boot_elsewhere(self.shared.host, v.host));
            route(local, &plan, view.as_deref(), peer, by_lane)?
        };
        if self.strict && matches!(route, Route::Ucx) {
            check_strict(&self.shared, peer)?;
        }
        let paged_ok = matches!(&route, Route::Lane(l) if l.takes_paged());
        let plan = match plan {
            Work::Paged(p) if !paged_ok || !local_dev.is_empty() => {
                Work::Flat(p.expand(self.shared.max_op))
            }
            w => w,
        };
        // Pin the local regions the plan uses: deregistering them now fails with Busy.
        let mut used = vec![false; local.regions.len()];
        for s in plan.slots(false) {
            used[s as usize] = true;
        }
        let pins = Pins::acquire(
            local
                .regions
                .iter()
                .zip(&used)
                .filter(|(_, &u)| u)
                .map(|(r, _)| r.clone())
                .collect(),
        )?;
        let id = self.shared.next_xfer.fetch_add(1, Ordering::Relaxed);
        let state = Arc::new(XferState::default());
        let job = Job {
            id,
            op,
            peer: peer.to_string(),
            token,
            plan,
            pins,
            notification: notification.map(|n| encode(&self.shared.name, n)),
            deadline,
            started: t0,
            state: state.clone(),
            lane_stats: None,
            note_via: (lane_notes && matches!(route, Route::Ucx))
                .then(|| self.shared.notes.clone()),
            local_dev,
        };
        // A region its owner deregistered is refused on every route; a UCX transfer is
        // recorded (under the same lock, held until it is posted) so that a deregistration
        // told after this check waits for it.
        let fence = view.as_ref().map(|v| v.fence.clone());
        let mut fenced = fence
            .as_ref()
            .map(|f| f.lock().unwrap_or_else(|e| e.into_inner()));
        if let Some(f) = fenced.as_deref().filter(|f| f.any_gone) {
            let spans = view.as_ref().map_or(&[][..], |v| &v.spans[..]);
            let gone = |k: u32| spans.get(k as usize).is_some_and(|s| f.is_gone(s.id.0));
            if let Some(k) = job.plan.slots(true).find(|&k| gone(k)) {
                let region = spans[k as usize].id.0;
                log::info!("kvxfer: {peer:?} deregistered its region {region}: refused");
                return Err(Error::Deregistered { region });
            }
        }
        match route {
            Route::Lane(l) => {
                // The lanes' targets refuse a deregistered region themselves: only the check
                // above needs the lock.
                drop(fenced);
                l.submit(job)
            }
            // On error the job was dropped with the channel; the engine never saw it.
            Route::Ucx => {
                self.shared.cmds.post(job)?;
                if let Some(f) = fenced.as_deref_mut() {
                    f.record(state.clone());
                }
            }
        }
        Ok(Transfer {
            state,
            id,
            cancel: self.shared.canceller.clone(),
        })
    }
}
