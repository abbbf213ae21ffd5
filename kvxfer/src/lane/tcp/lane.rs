//! The TCP lane as an agent holds it: its target (the server every peer's links connect to)
//! and what it opens towards each peer (a link), with the lane's own settings and state.
#![forbid(unsafe_code)]

use std::sync::{Arc, Mutex};

use super::epochs::FenceViews;
use super::link::{Compressor, Link};
use super::server::Server;
use super::settings::{Compressing, Striping};
use crate::budget::MemoryBudget;
use crate::codec_meter::CodecMeter;
use crate::lane::api::{LaneKind, LaneSetup, PeerLane, Query};
use crate::staging::pool::StagingCell;
use crate::transfer::Job;
use kvxfer_proto::error::Result;
use kvxfer_proto::session::Psk;
use kvxfer_proto::types::{Lane, LaneInfo, Transport};
use kvxfer_proto::wire::metadata::Metadata;

/// The TCP lane of one agent. Every agent with lanes on serves it, whatever its transport, so
/// that a GPU peer can stage into a CPU-only one.
pub(crate) struct TcpLane {
    name: String,
    server: Mutex<Option<Server>>,
    info: LaneInfo,
    /// Host memory moves here with the TCP transport; device memory UCX cannot reach, always.
    host_memory: bool,
    budget: MemoryBudget,
    staging: Arc<StagingCell>,
    striping: Striping,
    compressing: Compressing,
    codec: Arc<CodecMeter>,
    /// What the targets told of their fences of this agent.
    fence_views: FenceViews,
    /// The shared secret (the lane is sealed with it) and whether the data is sealed too.
    secret: Option<Vec<u8>>,
    seal_data: bool,
}

impl TcpLane {
    /// Starts the lane's target on the setup's address.
    pub(crate) fn start(setup: &LaneSetup) -> Result<TcpLane> {
        let server = Server::start(setup.bind, setup.ctx.clone(), &setup.name)?;
        Ok(TcpLane {
            name: setup.name.clone(),
            info: server.info(),
            server: Mutex::new(Some(server)),
            host_memory: setup.transport == Transport::Tcp,
            budget: setup.ctx.budget.clone(),
            staging: setup.ctx.staging.clone(),
            striping: setup.striping.clone(),
            compressing: setup.compressing.clone(),
            codec: setup.ctx.codec.clone(),
            fence_views: FenceViews::default(),
            secret: setup.ctx.secret.clone(),
            seal_data: setup.ctx.seal_data,
        })
    }
}

impl LaneKind for TcpLane {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn advertise(&self) -> Option<LaneInfo> {
        Some(self.info)
    }

    fn open(&self, meta: &Metadata) -> Option<Arc<dyn PeerLane>> {
        let info = meta.lane?;
        let c = &self.compressing;
        let link = Link::new(
            &self.name,
            &meta.name,
            info,
            meta.regions.iter().map(|r| r.span()).collect(),
            self.budget.clone(),
            self.staging.clone(),
            self.striping.of(&meta.name),
            Compressor {
                policy: c.of(&meta.name),
                transform: c.transform,
                meter: self.codec.clone(),
                threads: c.threads,
            },
            self.fence_views.of(info.secret),
            self.secret
                .as_deref()
                .map(|s| (Psk::lane(s, &info.secret), self.seal_data)),
        );
        Some(Arc::new(TcpPeer {
            link,
            host_memory: self.host_memory,
        }))
    }

    fn fence(&self, peer: &str) -> usize {
        let g = self.server.lock().unwrap_or_else(|e| e.into_inner());
        g.as_ref().map_or(0, |s| s.fence(peer))
    }

    fn stop(&self) {
        drop(self.server.lock().unwrap_or_else(|e| e.into_inner()).take());
    }
}

/// The TCP lane towards one peer.
struct TcpPeer {
    link: Link,
    host_memory: bool,
}

impl PeerLane for TcpPeer {
    fn lane(&self) -> Lane {
        Lane::Tcp
    }

    fn carries(&self, q: &Query<'_>) -> bool {
        if q.device {
            !q.ucx_reaches
        } else {
            self.host_memory
        }
    }

    fn takes_paged(&self) -> bool {
        true
    }

    fn submit(&self, job: Job) {
        self.link.submit(job);
    }
}
