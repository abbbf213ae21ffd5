//! Registration: how memory becomes a region, and who may reach it. A region shared with
//! named peers only is published with no UCX key, no shared-memory handle and no address, so
//! it moves only on kvxfer's TCP lane, whose target checks every request against the share set
//! with the peer's name its lane session proved (`kvxfer_proto::grants`).
#![forbid(unsafe_code)]

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::handle::Agent;
use crate::backend::ucx::driver::{Cmd, MEMORY_TYPES};
use crate::backend::ucx::raw;
use crate::memory::{Memory, Region, RegionInner};
use kvxfer_proto::error::{Error, Result};
use kvxfer_proto::types::{choose_gpu_path, DeviceAlloc, GpuPath, MemKind, RegionId};
use kvxfer_proto::wire::lane_entries::LANE_TCP;

/// Who may read and write a registered region.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum Share {
    /// Every peer this agent authenticated (or, without a secret, every peer): what
    /// [`Agent::register`] gives. UCX and the shm lane may carry it.
    #[default]
    AllPeers,
    /// Only these peers (none: no peer; this agent's own transfers still use it). The region
    /// moves only on the TCP lane, whose target checks each request; naming peers needs a
    /// secret, which makes their names proven rather than claimed.
    Only(Vec<String>),
}

impl Agent {
    /// Registers owned memory (page-aligned buffers, memory maps, and with the `cuda` feature
    /// cudarc device buffers); the agent keeps it alive.
    pub fn register(&self, mem: impl Into<Memory>) -> Result<Region> {
        let mut mem = mem.into();
        let (p, len) = mem.raw_parts();
        let kind = mem.kind();
        self.register_inner(p, len, kind, Some(mem), None)
    }

    /// Registers owned memory, as [`Agent::register`], shared as `with` says.
    ///
    /// With [`Share::Only`], peers learn the region (its id and size) but get no UCX key, no
    /// shared-memory handle and no device export for it: transfers of it take the TCP lane
    /// (in-host too; device memory staged through pinned chunks at both ends), and a
    /// peer outside the set is refused there (`LaneFailed`, "is not among the peers region N
    /// is shared with"), nothing moved. Errors: `InvalidArgument` for named peers without a
    /// secret or with lanes off; for device memory, what the staged path needs (the TCP lane,
    /// its staging chunks within the budget).
    pub fn register_shared(&self, mem: impl Into<Memory>, with: Share) -> Result<Region> {
        let only = self.share_set(with)?;
        let mut mem = mem.into();
        let (p, len) = mem.raw_parts();
        let kind = mem.kind();
        self.register_inner(p, len, kind, Some(mem), only)
    }

    /// The peers a region shared as `with` is open to (`None`: all), checked.
    pub(super) fn share_set(&self, with: Share) -> Result<Option<Vec<String>>> {
        Ok(match with {
            Share::AllPeers => None,
            Share::Only(peers) => {
                if !peers.is_empty() && self.shared.secret.is_none() {
                    return Err(Error::InvalidArgument(
                        "sharing a region with named peers needs a secret \
                         (AgentConfig::secret): without one a peer's name is only a claim"
                            .into(),
                    ));
                }
                if !peers.is_empty() && self.shared.lanes.is_empty() {
                    return Err(Error::InvalidArgument(
                        "a region shared with named peers moves only on kvxfer's TCP lane, \
                         and the lanes are off (AgentConfig::lanes)"
                            .into(),
                    ));
                }
                Some(peers)
            }
        })
    }

    /// Drops `region`'s share set (deregistered, or never registered).
    pub(crate) fn forget_share(&self, region: u32) {
        self.shared
            .grants
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .forget(region);
    }
    /// `only`: shared with these peers only ([`Share::Only`]): no UCX key, no shm handle, no
    /// device export.
    pub(super) fn register_inner(
        &self,
        ptr: *mut u8,
        len: usize,
        kind: MemKind,
        backing: Option<Memory>,
        only: Option<Vec<String>>,
    ) -> Result<Region> {
        if len == 0 {
            return Err(Error::InvalidArgument("registering 0 bytes".into()));
        }
        let alloc = match kind {
            MemKind::Host => None,
            MemKind::Cuda(d) => self.shared.staging.engine(d)?.allocation(d, ptr as u64)?,
        };
        if let (Some(_), MemKind::Cuda(d)) = (&only, kind) {
            // Moved only by the TCP lane's target, which stages it through pinned chunks
            // after checking the share set and the grants: those chunks, now.
            self.staged_ready(d)?;
        }
        let ucx_mapped = only.is_none()
            && match kind {
                MemKind::Host => true,
                MemKind::Cuda(d) => {
                    let direct = self.device_path(d)? == GpuPath::Direct;
                    if direct && alloc == Some(DeviceAlloc::Pool) {
                        self.pool_memory_staged(d)?;
                        false
                    } else {
                        direct
                    }
                }
            };
        let restricted = only.is_some();
        let id = RegionId(self.shared.next_region.fetch_add(1, Ordering::Relaxed));
        let shm = backing
            .as_ref()
            .and_then(Memory::shm_handle)
            .filter(|_| only.is_none());
        if let Some(peers) = only {
            // In the table before any peer can learn of the region.
            self.shared
                .grants
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .share_only(id.0, peers);
        }
        let inner = Arc::new(RegionInner {
            shm,
            id,
            addr: ptr as u64,
            len: len as u64,
            kind,
            alloc,
            ucx_mapped,
            restricted,
            _backing: backing,
            inflight: crate::memory::AtomicU32::new(0),
            registered: crate::memory::AtomicBool::new(false),
        });
        // In the table before the engine can put it into metadata, unregistered until the
        // engine has mapped it (lanes refuse it meanwhile).
        self.shared.regions.insert(inner.clone());
        if let Err(e) = self.shared.cmds.call(|reply| Cmd::Register {
            region: inner.clone(),
            reply,
        }) {
            self.shared.regions.remove(id);
            self.forget_share(id.0);
            return Err(e);
        }
        self.shared.subs.changed();
        Ok(Region { inner })
    }

    /// Pool memory on a device whose path is direct: UCX cannot open it in another process
    /// and would move it by emulation over its host transports (240-800 ms a 273 MB request,
    /// measured), so it takes the staged path, said in the log; refused typed where the user
    /// asked for the direct path or for no silent fallback (`strict`).
    fn pool_memory_staged(&self, device: u32) -> Result<()> {
        let why = "pool memory (cuMemAllocAsync; PyTorch's backend:cudaMallocAsync) cannot be \
                   opened by another process, and UCX would move it by emulation over its host \
                   transports (240-800 ms a 273 MB request): allocate the KV cache with \
                   cudaMalloc (PyTorch's default) or expandable segments";
        if self.shared.gpu_path == GpuPath::Direct || self.strict {
            return Err(Error::Cuda {
                device,
                why: format!("{why}, or let it take the staged path (gpu_path auto, strict off)"),
            });
        }
        self.staged_ready(device)?;
        log::warn!("kvxfer: {why}; it takes the staged path (pinned chunks over the TCP lane)");
        Ok(())
    }

    /// The staged path's needs on `device`: the TCP lane, and the staging chunks, allocated
    /// now from the budget or the registration fails.
    fn staged_ready(&self, device: u32) -> Result<()> {
        if !self.shared.advertised.iter().any(|e| e.lane == LANE_TCP) {
            return Err(Error::Cuda {
                device,
                why: "the staged path moves device memory over kvxfer's TCP lane, which is \
                      off (AgentConfig::lanes(false))"
                    .into(),
            });
        }
        self.shared.staging.pools(device)?;
        Ok(())
    }

    /// The path device memory of `device` takes here ([`GpuPath::Direct`] or
    /// [`GpuPath::Staged`]); a typed error where it can take none.
    fn device_path(&self, device: u32) -> Result<GpuPath> {
        let engine = self.shared.staging.engine(device)?;
        engine.check_device(device)?;
        let path = choose_gpu_path(
            self.shared.gpu_path,
            engine.ucx_visible().then_some(engine.name()),
            raw::supports_cuda(MEMORY_TYPES.load(Ordering::Relaxed)),
            &self.shared.transport,
            &self.shared.ucx_version,
        )
        .map_err(|why| Error::Cuda { device, why })?;
        if path == GpuPath::Staged {
            self.staged_ready(device)?;
        }
        Ok(path)
    }
}
