//! A test-only lane between agents of one process: the proof that a lane is one file and one
//! registration line in [`super::start`] (the agent, the metadata codec and the other lanes
//! do not change). It carries host-memory transfers between agents whose names start with
//! [`PREFIX`], copying straight between their registered regions (they share an address
//! space), each remote range checked against the target's region table first; the
//! notification goes after the data, as on every lane. Peers find it through an entry of its
//! own in the metadata ([`LANE_MEMORY`]: a token naming the target), as a network lane would
//! advertise its address. Built for kvxfer's unit tests only.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use super::api::{LaneCtx, LaneKind, LaneSetup, PeerLane, Query};
use crate::transfer::{Job, NoteCarrier};
use kvxfer_proto::error::Error;
use kvxfer_proto::types::{Lane, MemKind, XferOp};
use kvxfer_proto::wire::metadata::{LaneEntry, Metadata};

/// Agents whose names start with this run the lane.
pub(crate) const PREFIX: &str = "kvx-memlane-";
/// The lane's id in metadata (from the range no released lane uses).
pub(crate) const LANE_MEMORY: u8 = 0xf0;

/// Transfers the lane carried in this process.
pub(crate) static CARRIED: AtomicUsize = AtomicUsize::new(0);

/// The targets of this process, by the token their metadata advertises.
fn targets() -> &'static Mutex<HashMap<u64, Weak<LaneCtx>>> {
    static T: OnceLock<Mutex<HashMap<u64, Weak<LaneCtx>>>> = OnceLock::new();
    T.get_or_init(Mutex::default)
}

pub(crate) struct MemoryLane {
    token: u64,
    notifier: NoteCarrier,
}

impl MemoryLane {
    pub(crate) fn start(setup: &LaneSetup) -> Option<Box<dyn LaneKind>> {
        if !setup.name.starts_with(PREFIX) {
            return None;
        }
        let token = u64::from_le_bytes(crate::random::bytes().ok()?);
        let mut t = targets().lock().unwrap_or_else(|e| e.into_inner());
        t.insert(token, Arc::downgrade(&setup.ctx));
        Some(Box::new(MemoryLane {
            token,
            notifier: setup.notifier.clone(),
        }))
    }
}

impl LaneKind for MemoryLane {
    fn name(&self) -> &'static str {
        "memory"
    }

    fn advertise(&self) -> Option<LaneEntry> {
        Some(LaneEntry {
            lane: LANE_MEMORY,
            body: self.token.to_le_bytes().to_vec(),
        })
    }

    fn open(&self, meta: &Metadata) -> Option<Arc<dyn PeerLane>> {
        let entry = meta.lanes.iter().find(|e| e.lane == LANE_MEMORY)?;
        let token = u64::from_le_bytes(entry.body.as_slice().try_into().ok()?);
        let t = targets().lock().unwrap_or_else(|e| e.into_inner());
        let target = t.get(&token)?.clone();
        Some(Arc::new(MemoryPeer {
            target,
            notifier: self.notifier.clone(),
        }))
    }

    fn stop(&self) {
        targets()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.token);
    }
}

struct MemoryPeer {
    target: Weak<LaneCtx>,
    notifier: NoteCarrier,
}

impl PeerLane for MemoryPeer {
    fn lane(&self) -> Lane {
        Lane::Shm
    }

    fn carries(&self, q: &Query<'_>) -> bool {
        !q.device && !q.host_unmapped
    }

    fn submit(&self, job: Job) {
        let Some(target) = self.target.upgrade() else {
            let why = "the target agent is gone".to_string();
            return job.finish(Err(lane_failed(&job, why)));
        };
        for o in job.plan.ops() {
            if target
                .regions
                .containing(o.remote, o.len, MemKind::Host)
                .is_none()
            {
                let why = format!("{:#x}+{} is not registered at the target", o.remote, o.len);
                return job.finish(Err(lane_failed(&job, why)));
            }
            let (local, remote) = (o.local as *mut u8, o.remote as *mut u8);
            // SAFETY: the local range lies in a registered region pinned by the job; the remote
            // one in a region of the target agent's table (checked above), in this process's
            // address space (both agents run here); `copy` tolerates overlap.
            unsafe {
                match job.op {
                    XferOp::Write => std::ptr::copy(local, remote, o.len as usize),
                    XferOp::Read => std::ptr::copy(remote, local, o.len as usize),
                }
            }
        }
        CARRIED.fetch_add(1, Ordering::Relaxed);
        let stats = job.stats(Lane::Shm, job.started.elapsed());
        if job.notification.is_none() {
            return job.finish(Ok(stats));
        }
        job.pins.release();
        if let Err(e) = (self.notifier)(job.notification_carrier(stats)) {
            job.finish(Err(e));
        }
    }
}

fn lane_failed(job: &Job, why: String) -> Error {
    Error::LaneFailed {
        agent: job.peer.clone(),
        lane: "memory",
        why,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{CARRIED, LANE_MEMORY, PREFIX};
    use crate::agent::{Agent, AgentConfig};
    use crate::memory::HostBuffer;
    use kvxfer_proto::descriptor::Desc;
    use kvxfer_proto::types::Transport;

    #[test]
    fn a_lane_added_in_one_file_carries_both_directions() {
        let agent = |n: &str| {
            let cfg = AgentConfig::new(format!("{PREFIX}{n}-{}", std::process::id()))
                .transport(Transport::Tcp)
                .net_devices("lo");
            Agent::new(cfg).unwrap()
        };
        let (a, b) = (agent("a"), agent("b"));
        let ra = a.register(HostBuffer::new(1 << 16).unwrap()).unwrap();
        let rb = b.register(HostBuffer::new(1 << 16).unwrap()).unwrap();
        ra.write(0, &[0x5a; 4096]).unwrap();
        rb.write(8192, &[0xa5; 4096]).unwrap();
        let peer = a.connect(b.listen("127.0.0.1:0").unwrap()).unwrap();
        // It advertised itself in an entry of its own, beside the TCP lane's.
        let meta = kvxfer_proto::wire::metadata::Metadata::decode(
            &b.metadata().unwrap(),
            kvxfer_proto::wire::metadata::DEFAULT_COMPAT,
        )
        .unwrap();
        assert!(meta.lanes.iter().any(|e| e.lane == LANE_MEMORY));
        assert!(meta.tcp_lane().is_some());
        let before = CARRIED.load(std::sync::atomic::Ordering::Relaxed);
        let l = a.prep_local(&[Desc::new(ra.id(), 0, 4096)]).unwrap();
        let r = a
            .prep_remote(&peer, &[Desc::new(rb.id(), 0, 4096)])
            .unwrap();
        a.write(&l, &r)
            .notify(b"landed")
            .start()
            .unwrap()
            .wait()
            .unwrap();
        let n = b.wait_notification(Duration::from_secs(5)).unwrap();
        assert_eq!(n.payload, b"landed");
        let mut got = vec![0u8; 4096];
        rb.read(0, &mut got).unwrap();
        assert!(got.iter().all(|&x| x == 0x5a), "the WRITE did not land");
        let l = a.prep_local(&[Desc::new(ra.id(), 8192, 4096)]).unwrap();
        let r = a
            .prep_remote(&peer, &[Desc::new(rb.id(), 8192, 4096)])
            .unwrap();
        a.read(&l, &r).start().unwrap().wait().unwrap();
        ra.read(8192, &mut got).unwrap();
        assert!(got.iter().all(|&x| x == 0xa5), "the READ did not land");
        let carried = CARRIED.load(std::sync::atomic::Ordering::Relaxed) - before;
        assert_eq!(
            carried, 2,
            "the memory lane carried {carried} of 2 transfers"
        );
    }
}
