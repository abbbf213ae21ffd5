//! An agent's configuration, set once at [`Agent::new`](super::Agent::new).
#![forbid(unsafe_code)]

use std::sync::Arc;

use crate::budget::MemoryBudget;
use crate::device::copy::CopyEngine;
use crate::lane::tcp::settings::{Compressing, Striping};
use kvxfer_proto::compress::planes::Transform;
use kvxfer_proto::compress::policy::Compression;
use kvxfer_proto::types::{
    GpuPath, Transport, DEFAULT_STAGING_CHUNKS, DEFAULT_STAGING_CHUNK_BYTES,
};
pub use kvxfer_proto::wire::metadata::DEFAULT_COMPAT;

/// Configuration of an [`Agent`](super::Agent): [`AgentConfig::new`] and the setters, then
/// [`Agent::new`](super::Agent::new).
///
/// ```
/// use std::time::Duration;
/// use kvxfer::{AgentConfig, MemoryBudget, Transport};
///
/// let cfg = AgentConfig::new("decode-0")
///     .transport(Transport::Tcp)
///     .net_devices("lo")
///     .budget(MemoryBudget::new(256 << 20))
///     .handshake_timeout(Duration::from_secs(3))
///     .secret(b"one per deployment".to_vec());
/// assert_eq!(cfg.transport, Transport::Tcp);
/// assert_eq!(cfg.handshake_timeout, Duration::from_secs(3));
/// let agent = kvxfer::Agent::new(cfg)?;
/// assert_eq!(agent.name(), "decode-0");
/// # Ok::<(), kvxfer::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct AgentConfig {
    /// Unique name among the agents that talk to each other.
    pub name: String,
    /// Transports UCX may use.
    pub transport: Transport,
    /// `UCX_NET_DEVICES` (e.g. `"lo"`, `"eth0"`); `None` leaves UCX's default.
    pub net_devices: Option<String>,
    /// Compatibility hash peers must share (the connector derives it from the KV layout).
    pub compat: u64,
    /// Spin on `ucp_worker_progress` instead of sleeping on the worker's event fd.
    pub busy_poll: bool,
    /// Split operations longer than this (0: never).
    pub max_op_bytes: u64,
    /// Extra UCX settings (names without the `UCX_` prefix), applied last.
    pub ucx: Vec<(String, String)>,
    /// UCX peer-failure detection (`UCP_ERR_HANDLING_MODE_PEER`). UCX then refuses transports
    /// that cannot detect a dead peer, which in UCX 1.13-1.22 excludes every shared-memory
    /// transport (RMA falls back to emulation over TCP). Default (`None`): on, except for
    /// [`Transport::Shm`] and where UCX's TCP transport is left out ([`AgentConfig::ucx_tcp`]:
    /// without it UCX has no transport that detects a dead peer; the lanes and the transfer
    /// deadlines notice one). A [`Transport::Custom`] list of shared-memory transports only
    /// (e.g. `"posix,cma"`) must set `Some(false)` itself, or UCX finds no usable lane.
    pub peer_failure: Option<bool>,
    /// With lanes on: let UCX use its own TCP transport. UCX over TCP authenticates nobody,
    /// and its emulated RMA reads or writes whatever address a message names, so a process
    /// that reaches its port can read or overwrite registered memory or crash the agent. It
    /// is therefore left out of [`AgentConfig::transport`] unless this opts in (trusted
    /// network only; logged at start), with or without a secret: kvxfer's TCP lane carries
    /// host memory, staged device memory and notifications instead, and a peer UCX cannot
    /// reach is loaded lane-only. With lanes off UCX is all there is, and keeps TCP
    /// (SECURITY.md).
    pub ucx_tcp: bool,
    /// kvxfer's own lanes next to UCX (kvxfer's shm and TCP lanes): mapped shared memory towards a
    /// peer on the same host with [`Transport::Shm`] and [`Transport::Auto`], and a zero-copy
    /// TCP stream with [`Transport::Tcp`]. On by default; off forces every byte through UCX.
    pub lanes: bool,
    /// Threads that copy for the shared-memory lane (default: up to 4, one per core).
    pub copy_threads: usize,
    /// Address the TCP lane listens on and advertises. Default: 127.0.0.1 with
    /// [`Transport::Shm`] (every peer is on this host); otherwise the first IPv4 address of
    /// the first of `net_devices`, else of the first interface that is up and not loopback,
    /// else 127.0.0.1.
    pub lane_addr: Option<std::net::IpAddr>,
    /// Memory the agent may allocate for itself (stream-lane request buffers, on both ends);
    /// share it with the connector's to bound a worker as a whole. Default: unlimited.
    pub budget: MemoryBudget,
    /// A shared secret: every peer must hold it. It keys a Noise handshake
    /// (`Noise_NNpsk0_25519_ChaChaPoly_BLAKE2s`) on the side channel, whose metadata both ways
    /// and any refusal are encrypted and authenticated under the session it makes, and one on
    /// every TCP lane connection (`Noise_IKpsk1`, with the target's lane credential and each
    /// side's static key: a lane serves only peers this agent loaded, under the name whose
    /// metadata carried the key the initiator proved), whose control messages are then sealed
    /// the same way. A connector's producer seals its handoffs under it, and its consumer
    /// loads only sealed ones. `None`: open, for a trusted network only.
    /// `SECURITY.md` says what it does not protect yet.
    pub secret: Option<Vec<u8>>,
    /// With a [`AgentConfig::secret`]: the blocks' bytes on the TCP lane travel sealed too
    /// (AES-256-GCM under the connection's session, records of 1 MiB, after any
    /// compression), both the data this agent sends and the data it asks for. As a target it
    /// then refuses initiators that would send or take data in the clear. Off (the default):
    /// the data travels as it is, inside a trusted network; control is sealed either way.
    /// Without a secret it has no effect (`Agent::new` refuses it). In-host lanes are
    /// unaffected. docs/perf/README.md "Encryption" gives its cost.
    pub lane_encryption: bool,
    /// Strict transport: a peer connection whose UCX transports or kvxfer lane do not match
    /// [`AgentConfig::transport`] fails with [`Error::TransportMismatch`](kvxfer_proto::error::Error::TransportMismatch) instead of falling
    /// back silently (for example to TCP when shared memory was asked for).
    pub strict: bool,
    /// How device memory moves (forced or chosen per registration, see [`GpuPath`]).
    pub gpu_path: GpuPath,
    /// The device copy engine. Default: CUDA with the `cuda` feature, none without.
    /// `kvxfer::staging::SimulatedDevice` stands in for a GPU on machines without one.
    pub copy_engine: Option<Arc<dyn CopyEngine>>,
    /// Staging for device memory on the staged path: chunk count (half for transfers this
    /// agent starts, half for its peers') and chunk size. Allocated once, at the first
    /// device registration that needs it, from [`AgentConfig::budget`].
    pub staging: (usize, usize),
    /// TCP connections one transfer of the TCP lane is striped over (transfers of 16 MiB or
    /// more, in host memory): for links one core cannot fill. On a 2-core host over loopback,
    /// the KV-shaped READ of 8,344 random blocks took 142 ms over one connection (1.67x a
    /// plain TCP stream), 87 ms over 2 and 4 (medians of 3 alternated rounds); see docs/perf/README.md
    /// "Striping". Default 4, the best measured there; over 1 GbE one connection already runs
    /// at line rate and 4 are as fast. [`Agent::fence_inbound`](super::Agent::fence_inbound)
    /// covers every stripe. Per peer: [`AgentConfig::peer_stripes`].
    pub stripes: usize,
    /// Per-peer overrides of [`AgentConfig::stripes`], by agent name.
    pub peer_stripes: Vec<(String, usize)>,
    /// Whether TCP-lane transfers travel compressed (docs/perf/README.md, "Compression"): `Auto` (the
    /// default) compresses a transfer of 4 MiB or more only where the link is measured slower
    /// than the codec makes worthwhile (compress rate x ratio on this host and this data), so
    /// never over loopback; `On` always; `Off` never. Per peer:
    /// [`AgentConfig::peer_compression`].
    pub compression: Compression,
    /// Per-peer overrides of [`AgentConfig::compression`], by agent name.
    pub peer_compression: Vec<(String, Compression)>,
    /// Link rates (bytes per second) to peers, by agent name, taken instead of measuring.
    pub link_rates: Vec<(String, f64)>,
    /// How compressed frames split values: bf16 (the default: exponent and sign-mantissa
    /// planes) or any 16-bit type (high and low bytes; fp16 KV).
    pub compress_transform: Transform,
    /// Threads coding one compressed transfer (each about 1 GB/s of raw bytes on the
    /// bench's KV; the policy counts them). Default: a quarter of the CPUs, 1 to 4.
    pub compress_threads: usize,
    /// How long this agent's TCP lane target waits for a peer that moves no byte in the middle
    /// of a message (its hello, a request, the data) before dropping the connection; the clock
    /// restarts whenever bytes move, so a long transfer that flows is never cut. Between
    /// requests a peer may stay silent. Default 30 s.
    pub lane_stall: std::time::Duration,
    /// How long [`Agent::connect`](super::Agent::connect) waits for each step of the side
    /// channel's handshake (the TCP connection, then every read and write) before it fails
    /// with a typed time-out. Default 10 s; a busy peer across a slow link may need more, a
    /// health check less.
    pub handshake_timeout: std::time::Duration,
}

impl AgentConfig {
    /// Defaults for an agent named `name`: any transport, event-driven progress.
    pub fn new(name: impl Into<String>) -> Self {
        AgentConfig {
            name: name.into(),
            transport: Transport::Auto,
            net_devices: None,
            compat: DEFAULT_COMPAT,
            busy_poll: false,
            max_op_bytes: 0,
            ucx: Vec::new(),
            peer_failure: None,
            lanes: true,
            lane_encryption: false,
            ucx_tcp: false,
            copy_threads: std::thread::available_parallelism()
                .map(|n| n.get().min(4))
                .unwrap_or(2),
            lane_addr: None,
            budget: MemoryBudget::unlimited(),
            secret: None,
            strict: false,
            gpu_path: GpuPath::Auto,
            copy_engine: None,
            staging: (DEFAULT_STAGING_CHUNKS, DEFAULT_STAGING_CHUNK_BYTES),
            stripes: 4,
            peer_stripes: Vec::new(),
            compression: Compression::Auto,
            peer_compression: Vec::new(),
            link_rates: Vec::new(),
            compress_transform: Transform::Bf16,
            compress_threads: std::thread::available_parallelism()
                .map(|n| (n.get() / 4).clamp(1, 4))
                .unwrap_or(1),
            lane_stall: std::time::Duration::from_secs(30),
            handshake_timeout: std::time::Duration::from_secs(10),
        }
    }

    /// Sets how long each step of [`Agent::connect`](super::Agent::connect)'s handshake may
    /// wait (see [`AgentConfig::handshake_timeout`]); at least 1 ms.
    pub fn handshake_timeout(mut self, d: std::time::Duration) -> Self {
        self.handshake_timeout = d.max(std::time::Duration::from_millis(1));
        self
    }

    /// Sets how long the TCP lane target waits for a stalled peer (see
    /// [`AgentConfig::lane_stall`]); at least one socket tick (100 ms).
    pub fn lane_stall(mut self, d: std::time::Duration) -> Self {
        self.lane_stall = d.max(std::time::Duration::from_millis(100));
        self
    }

    /// Sets whether TCP-lane transfers are compressed (see [`AgentConfig::compression`]).
    pub fn compression(mut self, c: Compression) -> Self {
        self.compression = c;
        self
    }

    /// Sets compression for transfers to the agent named `peer`.
    pub fn peer_compression(mut self, peer: impl Into<String>, c: Compression) -> Self {
        self.peer_compression.push((peer.into(), c));
        self
    }

    /// Codes a compressed transfer on `n` threads (see [`AgentConfig::compress_threads`]).
    pub fn compress_threads(mut self, n: usize) -> Self {
        self.compress_threads = n.max(1);
        self
    }

    /// Takes `bytes_per_s` as the link rate to `peer` instead of measuring it.
    pub fn link_rate(mut self, peer: impl Into<String>, bytes_per_s: f64) -> Self {
        self.link_rates.push((peer.into(), bytes_per_s));
        self
    }

    /// Stripes a TCP-lane transfer over `n` connections (see [`AgentConfig::stripes`]).
    pub fn stripes(mut self, n: usize) -> Self {
        self.stripes = n.max(1);
        self
    }

    /// Stripes TCP-lane transfers to the agent named `peer` over `n` connections.
    pub fn peer_stripes(mut self, peer: impl Into<String>, n: usize) -> Self {
        self.peer_stripes.push((peer.into(), n.max(1)));
        self
    }

    /// Requires peers to prove a shared secret (see [`AgentConfig::secret`]).
    pub fn secret(mut self, s: impl Into<Vec<u8>>) -> Self {
        self.secret = Some(s.into());
        self
    }

    /// Seals the blocks' bytes on the TCP lane too ([`AgentConfig::lane_encryption`]).
    pub fn lane_encryption(mut self, on: bool) -> Self {
        self.lane_encryption = on;
        self
    }

    /// Strict transport mode.
    pub fn strict(mut self, on: bool) -> Self {
        self.strict = on;
        self
    }

    /// Lets UCX use its own TCP transport next to the lanes ([`AgentConfig::ucx_tcp`]).
    pub fn ucx_tcp(mut self, on: bool) -> Self {
        self.ucx_tcp = on;
        self
    }

    /// Whether UCX's TCP transport is left out ([`AgentConfig::ucx_tcp`]).
    pub(crate) fn ucx_tcp_off(&self) -> bool {
        self.lanes && !self.ucx_tcp
    }

    /// The transports UCX may use: [`AgentConfig::transport`] without TCP where
    /// [`AgentConfig::ucx_tcp_off`].
    pub(crate) fn ucx_transport(&self) -> Transport {
        if !self.ucx_tcp_off() {
            return self.transport.clone();
        }
        match &self.transport {
            // Every byte takes the sealed lane; UCX keeps only its loopback to this process.
            Transport::Tcp => Transport::Custom("self".into()),
            Transport::Shm => Transport::Shm,
            Transport::Auto => Transport::Custom("^tcp".into()),
            Transport::Custom(l) => match l.strip_prefix('^') {
                Some(ex) if ex.split(',').any(|x| x.trim() == "tcp") => self.transport.clone(),
                Some(ex) => Transport::Custom(format!("^{ex},tcp")),
                None if l.split(',').any(|x| x.trim() == "all") => Transport::Custom("^tcp".into()),
                None => {
                    let kept: Vec<&str> = l
                        .split(',')
                        .map(str::trim)
                        .filter(|x| !x.is_empty() && *x != "tcp")
                        .collect();
                    Transport::Custom(if kept.is_empty() {
                        "self".into()
                    } else {
                        kept.join(",")
                    })
                }
            },
        }
    }

    /// UCX peer-failure detection: `Some(on)` forces it, `None` picks the default (see
    /// [`AgentConfig::peer_failure`]).
    pub fn peer_failure(mut self, on: Option<bool>) -> Self {
        self.peer_failure = on;
        self
    }

    /// Forces or frees the path of device memory.
    pub fn gpu_path(mut self, p: GpuPath) -> Self {
        self.gpu_path = p;
        self
    }

    /// Sets the device copy engine.
    pub fn copy_engine(mut self, e: Arc<dyn CopyEngine>) -> Self {
        self.copy_engine = Some(e);
        self
    }

    /// Sets the device staging: `chunks` chunks of `chunk_bytes`.
    pub fn staging(mut self, chunks: usize, chunk_bytes: usize) -> Self {
        self.staging = (chunks, chunk_bytes);
        self
    }

    /// Sets the memory budget.
    pub fn budget(mut self, b: MemoryBudget) -> Self {
        self.budget = b;
        self
    }

    /// Turns kvxfer's own lanes on or off (off: UCX moves every byte).
    pub fn lanes(mut self, on: bool) -> Self {
        self.lanes = on;
        self
    }

    /// Sets the address of the TCP lane.
    pub fn lane_addr(mut self, ip: std::net::IpAddr) -> Self {
        self.lane_addr = Some(ip);
        self
    }

    /// Sets the transport.
    pub fn transport(mut self, t: Transport) -> Self {
        self.transport = t;
        self
    }

    /// Sets `UCX_NET_DEVICES`.
    pub fn net_devices(mut self, d: impl Into<String>) -> Self {
        self.net_devices = Some(d.into());
        self
    }

    /// Sets the compatibility hash.
    pub fn compat(mut self, h: u64) -> Self {
        self.compat = h;
        self
    }

    /// Busy-polls for the lowest latency (one core spins).
    pub fn busy_poll(mut self, on: bool) -> Self {
        self.busy_poll = on;
        self
    }

    /// Adds a UCX setting.
    pub fn ucx_setting(mut self, k: impl Into<String>, v: impl Into<String>) -> Self {
        self.ucx.push((k.into(), v.into()));
        self
    }

    /// The compression part of the configuration, for the agent's state.
    pub(super) fn compressing(&self) -> Compressing {
        Compressing::new(
            self.compression,
            self.peer_compression.clone(),
            self.link_rates.clone(),
            self.compress_transform,
            self.compress_threads,
        )
    }

    /// The striping part of the configuration, for the agent's state.
    pub(super) fn striping(&self) -> Striping {
        Striping::new(self.stripes, self.peer_stripes.clone())
    }

    /// Whether the transports UCX gets ([`AgentConfig::ucx_transport`]) include ones named
    /// `prefix*` (`tcp`, `cuda`).
    pub(crate) fn may_use(&self, prefix: &str) -> bool {
        match &self.ucx_transport() {
            Transport::Auto => true,
            Transport::Tcp => prefix == "tcp",
            Transport::Shm => false,
            Transport::Custom(l) => match l.strip_prefix('^') {
                Some(excluded) => !excluded.split(',').any(|x| x.trim().starts_with(prefix)),
                None => l
                    .split(',')
                    .map(str::trim)
                    .any(|x| x.starts_with(prefix) || x == "all"),
            },
        }
    }

    pub(super) fn ucx_settings(&self) -> Vec<(String, String)> {
        self.ucx_settings_under(|k| std::env::var_os(k).is_some())
    }

    /// The settings, given which `UCX_*` variables the environment sets.
    fn ucx_settings_under(&self, in_env: impl Fn(&str) -> bool) -> Vec<(String, String)> {
        let mut v = vec![("TLS".to_string(), self.ucx_transport().ucx_tls())];
        // kvxfer registers its regions explicitly; UCX's registration cache only serves
        // implicit registrations, and its default limits are infinite (memory grows with
        // every buffer UCX ever saw). Bounded here; `AgentConfig::ucx` overrides.
        if ["rc", "ud", "dc", "ib"].iter().any(|t| self.may_use(t)) {
            // Only where IB transports may be used: UCX warns about settings no transport
            // of the context consumed.
            v.push(("?IB_RCACHE_MAX_SIZE".into(), "4G".into()));
            v.push(("?IB_RCACHE_MAX_REGIONS".into(), "65536".into()));
        }
        // NIXL's default: with the rendezvous threshold at "auto", UCX >= 1.15 (protocols v2)
        // emulates ucp_put over TCP with active messages; at "inf" it posts zero-copy puts
        // (UCX 1.22, KV-shaped WRITE over tcp/lo: 8,344 blocks 334-385 ms -> 133 ms, one region
        // 313-377 ms -> 90-102 ms). kvxfer's own notifications are small eager messages, so
        // nothing of kvxfer needs rendezvous. A user's own UCX_RNDV_THRESH wins.
        if !in_env("UCX_RNDV_THRESH") {
            v.push(("RNDV_THRESH".into(), "inf".into()));
        }
        // READ of device memory inside a host: UCX 1.22's cuda_ipc leaves get_zcopy off on
        // platforms it rates slower ("auto"), and ucp_get then falls back to software
        // emulation over its host transports. H200, UCX 1.22 wheel, 273 MB KV-shaped, random
        // blocks, same run: direct READ 709.7 ms with "auto", 69.5 ms with "y". Only where
        // UCX may use its CUDA transports; a user's own setting wins; "?": UCX builds without
        // the cuda module do not know it.
        if self.may_use("cuda") && !in_env("UCX_CUDA_IPC_ENABLE_GET_ZCOPY") {
            v.push(("?CUDA_IPC_ENABLE_GET_ZCOPY".into(), "y".into()));
        }
        // UCX's TCP transport sends at most TX_SEG_SIZE (8 KiB) per active-message fragment.
        // Every RMA over TCP that UCX emulates with active messages (all of them in UCX 1.13,
        // every GET in 1.22) was cut into 5 fragments per 32 KiB KV block; 64 KiB (its
        // receive segment's default) sends a block whole. KV-shaped 273 MB over tcp/lo,
        // alternated runs against UCX_TCP_TX_SEG_SIZE=8K: UCX 1.13 WRITE random 177-184 ->
        // 86-88 ms, READ random 158-181 -> 74-76 ms, WRITE one region 150-153 -> 89-124 ms
        // (its READ of one region turned bimodal: 57-61 or 180-197 ms per iteration, against
        // ~130 ms); UCX 1.22 READ random 153-156 -> 73-75 ms (its WRITE is zero-copy:
        // unchanged); peak RSS unchanged at concurrency 4.
        // Spelled "TX_SEG_SIZE" for UCX 1.13 (which applies its cached transport settings
        // without the "TCP_" prefix, and warns about the prefixed name as unused) and
        // "TCP_TX_SEG_SIZE" for 1.22 (which refuses the bare one).
        if self.may_use("tcp") && !in_env("UCX_TCP_TX_SEG_SIZE") {
            v.push(("TX_SEG_SIZE|TCP_TX_SEG_SIZE".into(), "64K".into()));
        }
        if let Some(d) = &self.net_devices {
            v.push(("NET_DEVICES".into(), d.clone()));
        }
        v.extend(self.ucx.iter().cloned());
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ucx_loses_its_tcp_transport_unless_opted_in_or_lanes_are_off() {
        let tls = |t: Transport, secret: bool, ucx_tcp: bool, lanes: bool| {
            let mut c = AgentConfig::new("t")
                .transport(t)
                .ucx_tcp(ucx_tcp)
                .lanes(lanes);
            if secret {
                c = c.secret(b"s".to_vec());
            }
            setting(&c, "TLS", |_| false).unwrap()
        };
        let custom = |l: &str| Transport::Custom(l.into());
        for (t, want) in [
            (Transport::Tcp, "self"),
            (Transport::Auto, "^tcp"),
            (Transport::Shm, "sm"),
            (custom("rc,tcp"), "rc"),
            (custom("tcp"), "self"),
            (custom("^cuda_ipc"), "^cuda_ipc,tcp"),
            (custom("^tcp,cma"), "^tcp,cma"),
            (custom("all"), "^tcp"),
        ] {
            // With a secret or without: the lanes carry what TCP would.
            assert_eq!(tls(t.clone(), true, false, true), want, "{t:?}");
            assert_eq!(tls(t.clone(), false, false, true), want, "{t:?}");
            // The opt-in, or lanes off (nothing else carries): as asked.
            assert_eq!(tls(t.clone(), true, true, true), t.ucx_tls(), "{t:?}");
            assert_eq!(tls(t.clone(), false, true, true), t.ucx_tls(), "{t:?}");
            assert_eq!(tls(t.clone(), true, false, false), t.ucx_tls(), "{t:?}");
            assert_eq!(tls(t.clone(), false, false, false), t.ucx_tls(), "{t:?}");
        }
    }

    /// The value kvxfer gives the setting `key`, given which `UCX_*` variables are set.
    fn setting(c: &AgentConfig, key: &str, in_env: impl Fn(&str) -> bool) -> Option<String> {
        c.ucx_settings_under(in_env)
            .into_iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v)
    }

    #[test]
    fn rendezvous_threshold_defaults_to_inf_unless_the_user_sets_it() {
        let c = AgentConfig::new("a").transport(Transport::Tcp);
        assert_eq!(
            setting(&c, "RNDV_THRESH", |_| false).as_deref(),
            Some("inf")
        );
        assert_eq!(setting(&c, "RNDV_THRESH", |k| k == "UCX_RNDV_THRESH"), None);
        // AgentConfig::ucx_setting comes last, so it wins over the default too.
        let c = c.ucx_setting("RNDV_THRESH", "64k");
        let v = c.ucx_settings_under(|_| false);
        assert_eq!(
            v.last().map(|(k, v)| (k.as_str(), v.as_str())),
            Some(("RNDV_THRESH", "64k"))
        );
    }

    #[test]
    fn ib_registration_cache_is_bounded_where_ucx_may_use_ib() {
        let none = |_: &str| false;
        for t in [
            Transport::Auto,
            Transport::parse("rc,sm"),
            Transport::parse("^tcp"),
        ] {
            let c = AgentConfig::new("a").transport(t);
            assert_eq!(
                setting(&c, "?IB_RCACHE_MAX_SIZE", none).as_deref(),
                Some("4G")
            );
        }
        for t in [Transport::Tcp, Transport::Shm, Transport::parse("tcp,sm")] {
            let c = AgentConfig::new("a").transport(t);
            assert_eq!(setting(&c, "?IB_RCACHE_MAX_SIZE", none), None);
        }
    }

    #[test]
    fn cuda_ipc_get_is_on_where_ucx_may_use_cuda_unless_the_user_sets_it() {
        let get = |c: &AgentConfig, env: &dyn Fn(&str) -> bool| {
            setting(c, "?CUDA_IPC_ENABLE_GET_ZCOPY", env)
        };
        let none = |_: &str| false;
        for t in [Transport::Auto, Transport::parse("cuda_ipc,cuda_copy,tcp")] {
            let c = AgentConfig::new("a").transport(t);
            assert_eq!(get(&c, &none).as_deref(), Some("y"));
            assert_eq!(get(&c, &|k| k == "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"), None);
        }
        for t in [Transport::Tcp, Transport::Shm, Transport::parse("rc,sm")] {
            assert_eq!(get(&AgentConfig::new("a").transport(t), &none), None);
        }
    }

    #[test]
    fn tcp_segments_hold_a_kv_block_where_ucx_may_use_tcp_unless_the_user_sets_it() {
        let seg = |c: &AgentConfig, env: &dyn Fn(&str) -> bool| {
            setting(c, "TX_SEG_SIZE|TCP_TX_SEG_SIZE", env)
        };
        let none = |_: &str| false;
        for t in [
            Transport::Tcp,
            Transport::Auto,
            Transport::parse("tcp,sm"),
            Transport::parse("^rc"),
        ] {
            let c = AgentConfig::new("a").transport(t).ucx_tcp(true);
            assert_eq!(seg(&c, &none).as_deref(), Some("64K"));
            assert_eq!(seg(&c, &|k| k == "UCX_TCP_TX_SEG_SIZE"), None);
        }
        for t in [
            Transport::Shm,
            Transport::parse("rc,sm"),
            Transport::parse("^tcp"),
        ] {
            assert_eq!(seg(&AgentConfig::new("a").transport(t), &none), None);
        }
    }
}
