//! The TCP lane as an agent holds it: its target (the server every peer's links connect to)
//! and what it opens towards each peer (a link), with the lane's own settings and state.
#![forbid(unsafe_code)]

use std::sync::{Arc, Mutex};

use super::dial::Sealing;
use super::epochs::FenceViews;
use super::identities::{Identities, Key};
use super::link::{Compressor, Link, LinkSetup};
use super::server::Server;
use super::settings::{Compressing, Striping};
use crate::budget::MemoryBudget;
use crate::codec_meter::CodecMeter;
use crate::lane::api::{LaneKind, LaneSetup, PeerLane, Query};
use crate::staging::pool::StagingCell;
use crate::transfer::Job;
use kvxfer_proto::error::Result;
use kvxfer_proto::session::{Psk, StaticKey};
use kvxfer_proto::types::{HostInfo, Lane, LaneInfo, Transport};
use kvxfer_proto::wire::lane_entries::LaneEntry;
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
    /// This agent's static key (the handshakes prove it; its metadata carries the public half).
    key: StaticKey,
    /// Each loaded peer's key: the target takes a hello's name only with it.
    ids: Arc<Identities>,
    /// This host and process, and whether a same-host peer's connections take a window.
    host: Option<HostInfo>,
    window: bool,
    /// Bytes of windows this agent's links hold.
    windows: Arc<std::sync::atomic::AtomicU64>,
}

impl TcpLane {
    /// Starts the lane's target on the setup's address.
    pub(crate) fn start(setup: &LaneSetup) -> Result<TcpLane> {
        let key = StaticKey::from_seed(crate::random::bytes()?);
        let ids: Arc<Identities> = Arc::default();
        let server = Server::start(
            setup.bind,
            setup.ctx.clone(),
            &setup.name,
            &key,
            ids.clone(),
            window_on(setup),
        )?;
        Ok(TcpLane {
            name: setup.name.clone(),
            info: server.info(),
            server: Mutex::new(Some(server)),
            host_memory: setup.transport == Transport::Tcp,
            budget: setup.ctx.budget.clone(),
            staging: setup.ctx.staging.clone(),
            striping: setup.config.tcp.striping.clone(),
            compressing: setup.config.tcp.compressing.clone(),
            codec: setup.ctx.codec.clone(),
            fence_views: FenceViews::default(),
            secret: setup.ctx.secret.clone(),
            seal_data: setup.ctx.seal_data,
            key,
            ids,
            host: setup.host,
            window: window_on(setup),
            windows: Arc::default(),
        })
    }
}

/// Whether this agent's connections with same-host peers take windows: on in its
/// configuration, and its transports allow shared memory in-host (with `tcp` alone, in-host
/// traffic stays on TCP, as asked).
fn window_on(setup: &LaneSetup) -> bool {
    setup.config.tcp.window && matches!(setup.transport, Transport::Shm | Transport::Auto)
}

impl TcpLane {
    /// The peer's process, where its connections may take a window: it runs on this host
    /// (same boot, same pid namespace) and windows are on.
    fn window_to(&self, meta: &Metadata) -> Option<u32> {
        let (me, them) = (self.host.as_ref()?, meta.host.as_ref()?);
        (self.window && me.boot_id == them.boot_id && me.pid_ns == them.pid_ns).then_some(them.pid)
    }
}

impl LaneKind for TcpLane {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn advertise(&self) -> Option<LaneEntry> {
        Some(LaneEntry::tcp(&self.info))
    }

    fn open(&self, meta: &Metadata) -> Option<Arc<dyn PeerLane>> {
        let info = meta.tcp_lane()?;
        let c = &self.compressing;
        let link = Link::new(LinkSetup {
            me: &self.name,
            peer: &meta.name,
            info,
            spans: meta.regions.iter().map(|r| r.span()).collect(),
            budget: self.budget.clone(),
            staging: self.staging.clone(),
            stripes: self.striping.of(&meta.name),
            comp: Compressor {
                policy: c.of(&meta.name),
                transform: c.transform,
                meter: self.codec.clone(),
                threads: c.threads,
            },
            view: self.fence_views.of(info.secret),
            seal: self.secret.as_deref().map(|s| Sealing {
                psk: Psk::lane(s, &info.secret),
                sealed_data: self.seal_data,
                window: self.window_to(meta),
                windows: self.windows.clone(),
                key: self.key.clone(),
            }),
        });
        self.ids.learn(&meta.name, info.key);
        Some(Arc::new(TcpPeer {
            link,
            host_memory: self.host_memory,
            _known: Known {
                ids: self.ids.clone(),
                peer: meta.name.clone(),
                key: info.key,
            },
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
    /// The peer's lane identity, held for as long as this lane (forgotten on drop).
    _known: Known,
}

/// A loaded peer's name and key in the target's [`Identities`], until its incarnation goes.
struct Known {
    ids: Arc<Identities>,
    peer: String,
    key: Key,
}

impl Drop for Known {
    fn drop(&mut self) {
        self.ids.forget(&self.peer, &self.key);
    }
}

impl PeerLane for TcpPeer {
    fn lane(&self) -> Lane {
        Lane::Tcp
    }

    fn carries(&self, q: &Query<'_>) -> bool {
        if q.device {
            !q.ucx_reaches
        } else {
            self.host_memory || q.host_unmapped || q.host_write_by_lane
        }
    }

    fn takes_paged(&self) -> bool {
        true
    }

    fn submit(&self, job: Job) {
        self.link.submit(job);
    }
}
