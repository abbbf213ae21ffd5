//! The vocabulary every layer shares: region ids and spans, memory kinds, directions, lanes,
//! transports, the device-memory path, and the host and lane identities carried in metadata.
//! Plain data: no I/O, no behaviour beyond parsing and display.

/// Default staging of an agent's device memory: 8 chunks of 4 MiB (32 MiB), half for the
/// transfers it starts, half for those its peers start.
pub const DEFAULT_STAGING_CHUNKS: usize = 8;
/// See [`DEFAULT_STAGING_CHUNKS`].
pub const DEFAULT_STAGING_CHUNK_BYTES: usize = 4 << 20;

/// Identifies a registered region within one agent. Carried in metadata.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RegionId(pub u32);

/// What the bounds check needs to know of a region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegionSpan {
    /// Its id.
    pub id: RegionId,
    /// Base address (in the owner's address space).
    pub base: u64,
    /// Length in bytes.
    pub len: u64,
    /// Host or device memory.
    pub kind: MemKind,
}

/// Where memory lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemKind {
    /// Host (CPU) memory.
    Host,
    /// CUDA device memory on the given device ordinal.
    Cuda(u32),
}

/// Which memory file backs a memfd-backed region: a same-host peer is handed the file by the
/// owner's socket (`wire::shm_fds`) and maps it only if its device and inode are these.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShmHandle {
    /// The descriptor number in the owner process (for logs; nothing opens it by number).
    pub fd: u32,
    /// `st_dev` of the file.
    pub dev: u64,
    /// `st_ino` of the file.
    pub ino: u64,
}

/// Which host and process an agent runs in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostInfo {
    /// `/proc/sys/kernel/random/boot_id`: equal on one host, for one boot.
    pub boot_id: [u8; 16],
    /// Inode of the pid namespace (pids are only meaningful inside one).
    pub pid_ns: u64,
    /// The owner's pid.
    pub pid: u32,
}

/// The agent's TCP stream lane: where to connect and what to present.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaneInfo {
    /// Listening address.
    pub addr: std::net::SocketAddr,
    /// Capability a peer presents in its hello (like an rkey: who has the metadata may write).
    pub secret: [u8; 16],
    /// The agent's static X25519 public key: with a shared secret, a lane handshake proves
    /// its private half, so a lane session names this agent only if it holds it.
    pub key: [u8; 32],
}

/// Direction of a transfer, seen from the initiator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum XferOp {
    /// Pull: remote memory into local memory (`ucp_get_nbx`).
    Read,
    /// Push: local memory into remote memory (`ucp_put_nbx`).
    Write,
}

impl std::fmt::Display for XferOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            XferOp::Read => "read",
            XferOp::Write => "write",
        })
    }
}

/// Which lane a transfer took, for telemetry and tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Lane {
    /// UCX one-sided operations.
    Ucx,
    /// Mapped shared memory, copied by kvxfer's copy threads.
    Shm,
    /// kvxfer's TCP stream lane.
    Tcp,
    /// Same-host GPU memory opened through CUDA IPC, moved by batched device copies.
    Device,
}

impl std::fmt::Display for Lane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Lane::Ucx => "ucx",
            Lane::Shm => "shm",
            Lane::Tcp => "tcp",
            Lane::Device => "device",
        })
    }
}

/// Which UCX transports an agent may use. Names map to `UCX_TLS`; RDMA (`rc`, `ud`, `dc`) and
/// CUDA (`cuda_copy`, `cuda_ipc`) go through [`Transport::Custom`] with the same code path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Transport {
    /// TCP sockets only.
    Tcp,
    /// Shared memory inside one host: posix / sysv / cma (UCX's `sm`).
    Shm,
    /// Whatever UCX finds best.
    Auto,
    /// A `UCX_TLS` value, e.g. `"rc,sm"`.
    Custom(String),
}

impl Transport {
    /// The `UCX_TLS` value.
    pub fn ucx_tls(&self) -> String {
        match self {
            Transport::Tcp => "tcp".into(),
            Transport::Shm => "sm".into(),
            Transport::Auto => "all".into(),
            Transport::Custom(s) => s.clone(),
        }
    }

    /// Checks a `UCX_TLS` list's names against the transports UCX knows (a leading `^`
    /// excludes, as in `UCX_TLS`): a typo is an error naming the known ones here, not a
    /// `ucp_init` failure later.
    pub fn check(&self) -> std::result::Result<(), String> {
        let Transport::Custom(list) = self else {
            return Ok(());
        };
        let body = list.strip_prefix('^').unwrap_or(list);
        let unknown: Vec<&str> = body
            .split(',')
            .map(str::trim)
            .filter(|n| !UCX_TRANSPORTS.contains(n))
            .collect();
        if unknown.is_empty() {
            return Ok(());
        }
        Err(format!(
            "unknown transport {} in {list:?}: use tcp, shm or auto, or a UCX_TLS list of {}",
            unknown
                .iter()
                .map(|n| format!("{n:?}"))
                .collect::<Vec<_>>()
                .join(", "),
            UCX_TRANSPORTS.join(", ")
        ))
    }

    /// Parses `tcp`, `shm`, `auto`, or any other string as a `UCX_TLS` list.
    pub fn parse(s: &str) -> Transport {
        match s {
            "tcp" => Transport::Tcp,
            "shm" | "sm" => Transport::Shm,
            "auto" | "all" => Transport::Auto,
            other => Transport::Custom(other.to_string()),
        }
    }
}

/// The transport names a `UCX_TLS` list may hold (UCX 1.13 to 1.23: aliases and transports).
pub const UCX_TRANSPORTS: &[&str] = &[
    "all",
    "auto",
    "self",
    "tcp",
    "sm",
    "shm",
    "mm",
    "posix",
    "sysv",
    "xpmem",
    "cma",
    "knem",
    "ib",
    "rc",
    "rc_v",
    "rc_x",
    "rc_verbs",
    "rc_mlx5",
    "ud",
    "ud_v",
    "ud_x",
    "ud_verbs",
    "ud_mlx5",
    "dc",
    "dc_x",
    "dc_mlx5",
    "srd",
    "gga",
    "rdmacm",
    "sockcm",
    "cuda",
    "cuda_copy",
    "cuda_ipc",
    "gdr_copy",
    "rocm",
    "rocm_copy",
    "rocm_ipc",
    "ze_copy",
    "ze_ipc",
];

/// How device (GPU) memory moves.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GpuPath {
    /// Direct where the loaded UCX has CUDA transports (`cuda_copy`/`cuda_ipc`, and GPUDirect
    /// RDMA where the NIC allows), staged otherwise.
    #[default]
    Auto,
    /// UCX moves device memory itself; registration fails if it cannot.
    Direct,
    /// Device memory moves through bounded pinned host chunks over kvxfer's TCP lane, each end
    /// copying its own device memory on a copy queue (a CUDA stream).
    Staged,
}

impl GpuPath {
    /// Parses `auto`, `direct` or `staged`.
    pub fn parse(s: &str) -> Option<GpuPath> {
        match s {
            "auto" => Some(GpuPath::Auto),
            "direct" => Some(GpuPath::Direct),
            "staged" => Some(GpuPath::Staged),
            _ => None,
        }
    }
}

impl std::fmt::Display for GpuPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            GpuPath::Auto => "auto",
            GpuPath::Direct => "direct",
            GpuPath::Staged => "staged",
        })
    }
}

/// What kind of allocation device memory lies in, as the driver says at registration: what
/// decides which paths can reach it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DeviceAlloc {
    /// `cuMemAlloc` / `cudaMalloc` (PyTorch's default caching allocator): shareable through
    /// legacy CUDA IPC (UCX's cuda_ipc, kvxfer's device lane).
    Plain,
    /// A virtual-memory allocation (`cuMemCreate` + `cuMemMap`: PyTorch's
    /// `expandable_segments`): kvxfer's device lane opens it through a file descriptor.
    Virtual,
    /// Stream-ordered pool memory (`cuMemAllocAsync`: PyTorch's `backend:cudaMallocAsync`):
    /// no other process can open it; it takes the staged path.
    Pool,
}

impl std::fmt::Display for DeviceAlloc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DeviceAlloc::Plain => "plain",
            DeviceAlloc::Virtual => "virtual",
            DeviceAlloc::Pool => "pool",
        })
    }
}

/// What the agent knows about a peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerInfo {
    /// The peer's name.
    pub name: String,
    /// Regions in its table.
    pub regions: usize,
    /// Transports UCX selected for the connection (empty before the first connection).
    pub transports: String,
    /// Why the connection last failed, if it did.
    pub failed: Option<String>,
    /// How device memory moves between the two agents: `None` where neither has device
    /// memory registered, [`GpuPath::Direct`] where UCX reaches all of it, else
    /// [`GpuPath::Staged`].
    pub gpu_path: Option<GpuPath>,
    /// kvxfer's lanes open towards the peer, in the order a transfer tries them (the first
    /// that carries a transfer moves it, else UCX): for example `[Shm, Device, Tcp]` for a
    /// same-host peer.
    pub lanes: Vec<Lane>,
}

/// The path of device memory: `policy`, the engine's name if UCX can reach its memory at all
/// (CUDA), whether the loaded UCX has CUDA memory support, and whether the transport list
/// lets UCX use its CUDA transports (`Auto` = all, or a custom list naming them; `tcp` and
/// `shm` leave them out).
pub fn choose_gpu_path(
    policy: GpuPath,
    ucx_visible: Option<&str>,
    ucx_has_cuda: bool,
    transport: &Transport,
    ucx_version: &str,
) -> std::result::Result<GpuPath, String> {
    let tls_cuda = match transport {
        Transport::Auto => true,
        Transport::Custom(l) => l
            .split(',')
            .map(str::trim)
            .any(|x| x.starts_with("cuda") || x == "all" || x == "gdr_copy"),
        Transport::Tcp | Transport::Shm => false,
    };
    let direct_ok = ucx_visible.is_some() && ucx_has_cuda && tls_cuda;
    match policy {
        GpuPath::Staged => Ok(GpuPath::Staged),
        GpuPath::Auto if direct_ok => Ok(GpuPath::Direct),
        GpuPath::Auto => Ok(GpuPath::Staged),
        GpuPath::Direct if direct_ok => Ok(GpuPath::Direct),
        GpuPath::Direct => Err(format!(
            "the direct path was forced, but {}; or use GpuPath::Staged",
            match (ucx_visible, ucx_has_cuda) {
                (None, _) => "UCX cannot reach this engine's device memory".to_string(),
                (Some(_), false) => format!(
                    "UCX {ucx_version} reports no CUDA transports (a build without \
                     cuda_copy/cuda_ipc, such as Debian's, or a CUDA module that did not load: \
                     see `ucx_info -d`); use a CUDA-aware UCX (KVXFER_UCX=wheel)"
                ),
                (Some(_), true) => format!(
                    "the transport {:?} leaves out UCX's CUDA transports: use Transport::Auto \
                     or a list naming cuda_copy / cuda_ipc",
                    transport.ucx_tls()
                ),
            }
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_path_follows_policy_engine_ucx_and_transport() {
        let v = "1.22.0";
        let c = |p, vis, has, t: Transport| choose_gpu_path(p, vis, has, &t, v);
        let cuda = Some("cuda");
        let rdma = || Transport::Custom("rc,cuda_copy,gdr_copy".into());
        assert!(rdma().check().is_ok());
        assert!(Transport::parse("^cma,tcp").check().is_ok());
        let e = Transport::parse("tpc").check().unwrap_err();
        assert!(
            e.contains("\"tpc\"") && e.contains("tcp, shm or auto"),
            "{e}"
        );
        use GpuPath::{Auto, Direct, Staged};
        // (policy, UCX-visible engine, UCX has CUDA, transport, path): auto is direct only
        // where UCX can reach the memory, has CUDA, and may use it; staged is always possible
        // here (the lane and pools are checked after).
        let table = [
            (Auto, cuda, true, Transport::Auto, Direct),
            (Auto, cuda, true, rdma(), Direct),
            (Auto, cuda, true, Transport::Tcp, Staged),
            (Auto, cuda, true, Transport::Shm, Staged),
            (Auto, cuda, false, Transport::Auto, Staged),
            (Auto, None, true, Transport::Auto, Staged),
            (Staged, cuda, true, Transport::Auto, Staged),
            (Direct, cuda, true, Transport::Auto, Direct),
        ];
        for (p, vis, has, t, want) in table {
            assert_eq!(
                c(p, vis, has, t.clone()),
                Ok(want),
                "{p} {vis:?} {has} {t:?}"
            );
        }
        // Forced direct: each impossibility names itself.
        let e = c(GpuPath::Direct, cuda, false, Transport::Auto).unwrap_err();
        assert!(
            e.contains("no CUDA transports") && e.contains("1.22.0"),
            "{e}"
        );
        let e = c(GpuPath::Direct, cuda, true, Transport::Tcp).unwrap_err();
        assert!(e.contains("leaves out"), "{e}");
        let e = c(GpuPath::Direct, None, true, Transport::Auto).unwrap_err();
        assert!(e.contains("cannot reach"), "{e}");
    }
}
