//! An agent's configuration, set once at [`Agent::new`](super::Agent::new).
#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::Duration;

use crate::backend::settings::{may_use_shm_fifo, shm_writes_emulated, UcxConfig};
use crate::budget::MemoryBudget;
use crate::device::copy::CopyEngine;
use crate::lane::config::LaneConfig;
use crate::staging::settings::{StagingConfig, StagingShape};
use kvxfer_proto::compress::planes::Transform;
use kvxfer_proto::compress::policy::Compression;
use kvxfer_proto::error::{Error, Result};
use kvxfer_proto::peer_table::PeerLimits;
use kvxfer_proto::types::{GpuPath, Transport};
pub use kvxfer_proto::wire::metadata::DEFAULT_COMPAT;
use kvxfer_proto::wire::metadata::MAX_NAME;

/// Configuration of an [`Agent`](super::Agent): [`AgentConfig::new`] and the setters, then
/// [`Agent::new`](super::Agent::new), which checks it as a whole. Its sections belong to the
/// parts that read them (UCX, each lane, the device staging, security); this is the one
/// builder over them, used by Rust, the C ABI and the vLLM plugin alike.
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
/// assert_eq!(cfg.name(), "decode-0");
/// let agent = kvxfer::Agent::new(cfg)?;
/// assert_eq!(agent.name(), "decode-0");
/// # Ok::<(), kvxfer::Error>(())
/// ```
#[derive(Clone, Debug)]
#[must_use = "a configuration does nothing until Agent::new takes it"]
pub struct AgentConfig {
    pub(crate) name: String,
    pub(crate) transport: Transport,
    pub(crate) compat: u64,
    pub(crate) strict: bool,
    pub(crate) handshake_timeout: Duration,
    pub(crate) deregister_wait: Duration,
    pub(crate) budget: MemoryBudget,
    pub(crate) security: SecurityConfig,
    pub(crate) ucx: UcxConfig,
    pub(crate) lanes: LaneConfig,
    pub(crate) staging: StagingConfig,
    pub(crate) peers: PeerLimits,
}

/// Security's section: the deployment's secret and whether lane data is sealed too.
#[derive(Clone, Debug, Default)]
pub(crate) struct SecurityConfig {
    pub(crate) secret: Option<Vec<u8>>,
    pub(crate) lane_encryption: bool,
}

impl SecurityConfig {
    fn check(&self) -> Result<()> {
        if self.secret.as_ref().is_some_and(Vec::is_empty) {
            return Err(Error::InvalidArgument(
                "an empty secret proves nothing: give a secret of at least 1 byte, or none".into(),
            ));
        }
        if self.lane_encryption && self.secret.is_none() {
            return Err(Error::InvalidArgument(
                "lane_encryption needs a shared secret (AgentConfig::secret) to key it".into(),
            ));
        }
        Ok(())
    }
}

impl AgentConfig {
    /// Defaults for an agent named `name`: any transport, lanes on, no secret, not strict,
    /// event-driven progress, an unlimited budget, GPU path auto, staging 8 x 4 MiB.
    pub fn new(name: impl Into<String>) -> Self {
        AgentConfig {
            name: name.into(),
            transport: Transport::Auto,
            compat: DEFAULT_COMPAT,
            strict: false,
            handshake_timeout: Duration::from_secs(10),
            deregister_wait: Duration::from_secs(10),
            budget: MemoryBudget::unlimited(),
            security: SecurityConfig::default(),
            ucx: UcxConfig::default(),
            lanes: LaneConfig::default(),
            staging: StagingConfig::default(),
            peers: PeerLimits::default(),
        }
    }

    /// The agent's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Checks what no single setter can: the name, the transport list, the secret's use.
    /// [`Agent::new`](super::Agent::new) calls it; each section's own values are checked
    /// where they are set.
    pub(crate) fn check(&self) -> Result<()> {
        if self.name.is_empty()
            || self.name.len() > MAX_NAME
            || self.name.chars().any(char::is_control)
        {
            return Err(Error::InvalidArgument(format!(
                "agent name {:?}: 1..={} printable characters",
                self.name, MAX_NAME
            )));
        }
        self.transport.check().map_err(Error::InvalidArgument)?;
        self.security.check()?;
        // UCX's TCP transport is off unless opted in, lanes or not: with the lanes off and
        // tcp named, nothing would carry what was asked for.
        if !self.lanes.on && !self.ucx.tcp && names_tcp(&self.transport) {
            return Err(Error::InvalidArgument(format!(
                "agent {:?}: lanes off with tcp among the transports ({}) leaves TCP to UCX's \
                 own transport, which is off unless ucx_tcp opts in: it authenticates nobody, \
                 and a peer whose connection fails while this agent serves its READ over it \
                 aborts this process (UCX 1.13 and 1.22: \"unexpected error: Endpoint \
                 timeout\"). Keep the lanes on (kvxfer's TCP lane carries TCP), name \
                 transports without tcp, or opt in with ucx_tcp (trusted peers and network \
                 only; never with a secret)",
                self.name,
                self.transport.ucx_tls()
            )));
        }
        // A secret promises that nobody without it reads or writes this agent's memory. UCX
        // over TCP cannot keep that: it accepts anyone who reaches its port and its emulated
        // RMA serves any address a message names (SECURITY.md). So it never listens here.
        if self.security.secret.is_some() && self.may_use("tcp") {
            return Err(Error::InvalidArgument(format!(
                "agent {:?}: a secret and UCX's own TCP transport ({}) do not go together: UCX \
                 over TCP authenticates nobody and reads or writes any address a message \
                 names. Leave the lanes on and ucx_tcp off (kvxfer's sealed TCP lane carries \
                 TCP), or with lanes off name transports without tcp (shm)",
                self.name,
                if self.ucx.tcp { "ucx_tcp" } else { "lanes off" }
            )));
        }
        Ok(())
    }

    /// Checks what needs the UCX loaded (`version`): lanes off with shared memory where UCX
    /// emulates WRITEs over it ([`AgentConfig::ucx_emulated_shm`]) need the opt-in.
    pub(crate) fn check_ucx(&self, version: &str) -> Result<()> {
        if !self.lanes.on
            && !self.ucx.emulated_shm
            && may_use_shm_fifo(&self.transport)
            && shm_writes_emulated(version)
        {
            return Err(Error::InvalidArgument(format!(
                "agent {:?}: lanes off with shared memory among the transports ({}) leave \
                 same-host WRITEs to UCX {version}, which emulates them with active messages \
                 through the target's shared-memory receive FIFO: a writer killed mid-WRITE \
                 leaves that FIFO waiting for good, and the target (this agent, or a peer \
                 this one writes to) serves no UCX shared-memory peer again. Keep the lanes \
                 on (kvxfer's lanes carry same-host WRITEs), use UCX 1.22 or later, or opt in \
                 with ucx_emulated_shm (writers that do not die mid-WRITE only)",
                self.name,
                self.transport.ucx_tls()
            )));
        }
        Ok(())
    }

    /// Whether UCX's TCP transport is left out ([`AgentConfig::ucx_tcp`]).
    pub(crate) fn ucx_tcp_off(&self) -> bool {
        self.ucx.tcp_off()
    }

    /// Whether the transports UCX gets include ones named `prefix*` (`tcp`, `cuda`).
    pub(crate) fn may_use(&self, prefix: &str) -> bool {
        self.ucx.may_use(&self.transport, prefix)
    }

    /// Transports UCX may use.
    pub fn transport(mut self, t: Transport) -> Self {
        self.transport = t;
        self
    }

    /// `UCX_NET_DEVICES` (e.g. `"lo"`, `"eth0"`); `None` leaves UCX's default.
    pub fn net_devices(mut self, d: impl Into<String>) -> Self {
        self.ucx.net_devices = Some(d.into());
        self
    }

    /// Leaves `UCX_NET_DEVICES` to UCX's default again (undoes [`AgentConfig::net_devices`]).
    pub fn default_net_devices(mut self) -> Self {
        self.ucx.net_devices = None;
        self
    }

    /// Compatibility hash peers must share (the connector derives it from the KV layout).
    pub fn compat(mut self, h: u64) -> Self {
        self.compat = h;
        self
    }

    /// Spin on `ucp_worker_progress` instead of sleeping on the worker's event fd.
    pub fn busy_poll(mut self, on: bool) -> Self {
        self.ucx.busy_poll = on;
        self
    }

    /// Split operations longer than this (0: never).
    pub fn max_op_bytes(mut self, n: u64) -> Self {
        self.ucx.max_op_bytes = n;
        self
    }

    /// Extra UCX settings (names without the `UCX_` prefix), applied last.
    pub fn ucx_setting(mut self, k: impl Into<String>, v: impl Into<String>) -> Self {
        self.ucx.extra.push((k.into(), v.into()));
        self
    }

    /// UCX peer-failure detection (`UCP_ERR_HANDLING_MODE_PEER`). UCX then refuses transports
    /// that cannot detect a dead peer, which in UCX 1.13-1.22 excludes every shared-memory
    /// transport (RMA falls back to emulation over TCP). Default (`None`): on, except for
    /// [`Transport::Shm`] and where UCX's TCP transport is left out ([`AgentConfig::ucx_tcp`]:
    /// without it UCX has no transport that detects a dead peer; the lanes and the transfer
    /// deadlines notice one). A [`Transport::Custom`] list of shared-memory transports only
    /// (e.g. `"posix,cma"`) must set `Some(false)` itself, or UCX finds no usable lane.
    pub fn peer_failure(mut self, on: Option<bool>) -> Self {
        self.ucx.peer_failure = on;
        self
    }

    /// Let UCX use its own TCP transport. UCX over TCP authenticates nobody, and its
    /// emulated RMA reads or writes whatever address a message names, so a process that
    /// reaches its port can read or overwrite registered memory or crash the agent; and a
    /// peer whose connection fails while this agent serves its READ (on UCX 1.13 its WRITE
    /// too) aborts this process inside UCX (UCX 1.13 and 1.22: "unexpected error: Endpoint
    /// timeout"; `tests/peer_death.rs`). It is therefore left out of
    /// [`AgentConfig::transport`], lanes on or off, unless this opts in (trusted peers and
    /// network only; logged at start): kvxfer's TCP lane carries host memory, staged device
    /// memory and notifications instead, and a peer UCX cannot reach is loaded lane-only.
    /// Lanes off with tcp named among the transports and no opt-in is refused by
    /// `Agent::new` (`InvalidArgument`); so is the opt-in with a secret, so nothing listens
    /// for UCX over TCP there (SECURITY.md).
    pub fn ucx_tcp(mut self, on: bool) -> Self {
        self.ucx.tcp = on;
        self
    }

    /// Let UCX carry WRITEs over shared memory with the lanes off, where it emulates them
    /// (UCX older than 1.22; measured on 1.13): active messages through the target's
    /// shared-memory receive FIFO, which all same-host senders share. A writer killed
    /// between reserving a slot and marking it written leaves the target waiting on that
    /// slot for good: it serves no UCX shared-memory peer again, and their transfers fail at
    /// their deadline (`tests/peer_death.rs`). Without this, `Agent::new` refuses lanes off
    /// with shared memory among the transports on such a UCX (`InvalidArgument`). With the
    /// lanes on nothing is needed: a WRITE to a same-host peer that UCX would emulate takes
    /// kvxfer's shm lane, or its TCP lane for memory the shm lane does not cover (an
    /// engine's tensors). No effect on UCX 1.22 and later.
    pub fn ucx_emulated_shm(mut self, on: bool) -> Self {
        self.ucx.emulated_shm = on;
        self
    }

    /// kvxfer's own lanes next to UCX (kvxfer's shm and TCP lanes): mapped shared memory towards a
    /// peer on the same host with [`Transport::Shm`] and [`Transport::Auto`], and a zero-copy
    /// TCP stream with [`Transport::Tcp`]. On by default; off forces every byte through UCX.
    pub fn lanes(mut self, on: bool) -> Self {
        self.lanes.on = on;
        self
    }

    /// The device lane (on by default, with [`Transport::Shm`] and [`Transport::Auto`]): a
    /// same-host peer's GPU memory opened through CUDA IPC and moved by batched device copies,
    /// a paged request in one submission. Off: device memory moves over UCX (direct) or the
    /// staged path, as before it existed (for comparisons).
    pub fn device_lane(mut self, on: bool) -> Self {
        self.lanes.device = on;
        self
    }

    /// Threads that copy for the shared-memory lane (default: up to 4, one per core).
    ///
    /// At least 1.
    pub fn copy_threads(mut self, n: usize) -> Self {
        self.lanes.shm.copy_threads = n.max(1);
        self
    }

    /// Address the TCP lane listens on and advertises. Default: 127.0.0.1 with
    /// [`Transport::Shm`] (every peer is on this host); otherwise the first IPv4 address of
    /// the first of `net_devices`, else of the first interface that is up and not loopback,
    /// else 127.0.0.1.
    pub fn lane_addr(mut self, ip: std::net::IpAddr) -> Self {
        self.lanes.tcp.addr = Some(ip);
        self
    }

    /// Memory the agent may allocate for itself (stream-lane request buffers, on both ends);
    /// share it with the connector's to bound a worker as a whole. Default: unlimited.
    pub fn budget(mut self, b: MemoryBudget) -> Self {
        self.budget = b;
        self
    }

    /// A shared secret: every peer must hold it. It keys a Noise handshake
    /// (`Noise_NNpsk0_25519_ChaChaPoly_BLAKE2s`) on the side channel, whose metadata both ways
    /// and any refusal are encrypted and authenticated under the session it makes, and one on
    /// every TCP lane connection (`Noise_IKpsk1`, with the target's lane credential and each
    /// side's static key: a lane serves only peers this agent loaded, under the name whose
    /// metadata carried the key the initiator proved), whose control messages are then sealed
    /// the same way. A connector's producer seals its handoffs under it, and its consumer
    /// loads only sealed ones. `None`: open, for a trusted network only.
    /// `SECURITY.md` says what it does not protect yet.
    ///
    /// An empty secret is refused by `Agent::new`: it would prove nothing.
    pub fn secret(mut self, s: impl Into<Vec<u8>>) -> Self {
        self.security.secret = Some(s.into());
        self
    }

    /// Removes the secret again (undoes [`AgentConfig::secret`]): open, for a trusted network.
    pub fn no_secret(mut self) -> Self {
        self.security.secret = None;
        self
    }

    /// With a [`AgentConfig::secret`]: the blocks' bytes on the TCP lane travel sealed too
    /// (AES-256-GCM under the connection's session, records of 1 MiB, after any
    /// compression), both the data this agent sends and the data it asks for. As a target it
    /// then refuses initiators that would send or take data in the clear. Off (the default):
    /// the data travels as it is, inside a trusted network; control is sealed either way.
    /// Without a secret it has no effect (`Agent::new` refuses it). In-host lanes are
    /// unaffected. docs/perf/README.md "Encryption" gives its cost.
    pub fn lane_encryption(mut self, on: bool) -> Self {
        self.security.lane_encryption = on;
        self
    }

    /// Strict transport: a peer connection whose UCX transports or kvxfer lane do not match
    /// [`AgentConfig::transport`] fails with [`Error::TransportMismatch`](kvxfer_proto::error::Error::TransportMismatch) instead of falling
    /// back silently (for example to TCP when shared memory was asked for).
    pub fn strict(mut self, on: bool) -> Self {
        self.strict = on;
        self
    }

    /// How device memory moves (forced or chosen per registration, see [`GpuPath`]).
    pub fn gpu_path(mut self, p: GpuPath) -> Self {
        self.staging.gpu_path = p;
        self
    }

    /// The device copy engine. Default: CUDA with the `cuda` feature, none without.
    /// `kvxfer::staging::SimulatedDevice` stands in for a GPU on machines without one.
    pub fn copy_engine(mut self, e: Arc<dyn CopyEngine>) -> Self {
        self.staging.copy_engine = Some(e);
        self
    }

    /// Staging for device memory on the staged path: chunk count (half for transfers this
    /// agent starts, half for its peers') and chunk size. Allocated once, at the first
    /// device registration that needs it, from [`AgentConfig::budget`].
    ///
    /// [`StagingShape::new`] checks the shape where it is made.
    pub fn staging(mut self, shape: StagingShape) -> Self {
        self.staging.shape = shape;
        self
    }

    /// TCP connections one transfer of the TCP lane is striped over (transfers of 16 MiB or
    /// more, in host memory): for links one core cannot fill. On a 2-core host over loopback,
    /// the KV-shaped READ of 8,344 random blocks took 142 ms over one connection (1.67x a
    /// plain TCP stream), 87 ms over 2 and 4 (medians of 3 alternated rounds); see docs/perf/README.md
    /// "Striping". Default 4, the best measured there; over 1 GbE one connection already runs
    /// at line rate and 4 are as fast. [`Agent::fence_inbound`](super::Agent::fence_inbound)
    /// covers every stripe. Per peer: [`AgentConfig::peer_stripes`].
    pub fn stripes(mut self, n: usize) -> Self {
        self.lanes.tcp.striping.default = n.max(1);
        self
    }

    /// Per-peer overrides of [`AgentConfig::stripes`], by agent name.
    pub fn peer_stripes(mut self, peer: impl Into<String>, n: usize) -> Self {
        self.lanes
            .tcp
            .striping
            .per_peer
            .push((peer.into(), n.max(1)));
        self
    }

    /// Whether TCP-lane transfers travel compressed (docs/perf/README.md, "Compression"): `Auto` (the
    /// default) compresses a transfer of 4 MiB or more only where the link is measured slower
    /// than the codec makes worthwhile (compress rate x ratio on this host and this data), so
    /// never over loopback; `On` always; `Off` never. Per peer:
    /// [`AgentConfig::peer_compression`].
    pub fn compression(mut self, c: Compression) -> Self {
        self.lanes.tcp.compressing.default = c;
        self
    }

    /// Per-peer overrides of [`AgentConfig::compression`], by agent name.
    pub fn peer_compression(mut self, peer: impl Into<String>, c: Compression) -> Self {
        self.lanes.tcp.compressing.per_peer.push((peer.into(), c));
        self
    }

    /// Link rates (bytes per second) to peers, by agent name, taken instead of measuring.
    pub fn link_rate(mut self, peer: impl Into<String>, bytes_per_s: f64) -> Self {
        self.lanes
            .tcp
            .compressing
            .link_rates
            .push((peer.into(), bytes_per_s));
        self
    }

    /// How compressed frames split values: bf16 (the default: exponent and sign-mantissa
    /// planes) or any 16-bit type (high and low bytes; fp16 KV).
    pub fn compress_transform(mut self, t: Transform) -> Self {
        self.lanes.tcp.compressing.transform = t;
        self
    }

    /// Threads coding one compressed transfer (each about 1 GB/s of raw bytes on the
    /// bench's KV; the policy counts them). Default: a quarter of the CPUs, 1 to 4.
    ///
    /// At least 1.
    pub fn compress_threads(mut self, n: usize) -> Self {
        self.lanes.tcp.compressing.threads = n.max(1);
        self
    }

    /// How long this agent's TCP lane target waits for a peer that moves no byte in the middle
    /// of a message (its hello, a request, the data) before dropping the connection; the clock
    /// restarts whenever bytes move, so a long transfer that flows is never cut. Between
    /// requests a peer may stay silent. Default 30 s.
    ///
    /// At least one socket tick (100 ms).
    pub fn lane_stall(mut self, d: Duration) -> Self {
        self.lanes.tcp.stall = d.max(Duration::from_millis(100));
        self
    }

    /// With a [`AgentConfig::secret`], the data in the clear and a transport that allows
    /// shared memory in-host (`Shm`, `Auto`): the TCP lane's connections between two
    /// processes of one host move the data through a window of shared memory
    /// (4 MiB a connection, charged to both budgets) instead of the socket, while the
    /// target still checks each request and every control byte stays sealed; what a region
    /// shared with named peers only, or a connector cache that only grants open, moves over
    /// in-host. Off by default (opt-in while a push-mode chaos finding is open: see
    /// SECURITY.md); off, the data goes on the socket. A target offers a window only to the
    /// initiator whose session proved its key, by a one-time ticket.
    pub fn lane_window(mut self, on: bool) -> Self {
        self.lanes.tcp.window = on;
        self
    }

    /// Peers loaded at once (default 1,024). Past it, or when loading one more would leave
    /// fewer file descriptors free than the reserve (an eighth of `RLIMIT_NOFILE`, at least
    /// 64), the peer unused for longest is evicted if it has been idle for
    /// [`AgentConfig::peer_idle`]; else the newcomer is refused with
    /// [`Error::PeerLimit`]. An evicted peer's endpoint, kept connection, lanes and mappings
    /// go; a transfer to it then fails with [`Error::UnknownPeer`] until it connects again.
    ///
    /// At least 1.
    pub fn max_peers(mut self, n: usize) -> Self {
        self.peers.max_peers = n.max(1);
        self
    }

    /// How long [`Agent::deregister`](super::Agent::deregister) waits for each peer that UCX
    /// reaches (kept on the side channel, or announced to the UCX engine) to confirm that
    /// nothing of its touches the region any more (its UCX transfers to this agent in flight have ended), and how
    /// long this agent, told of a peer's deregistration, waits for its own before it answers.
    /// Past it the region stays registered (`Busy`). Default 10 s.
    pub fn deregister_wait(mut self, d: Duration) -> Self {
        self.deregister_wait = d;
        self
    }

    /// How long a peer must have been unused (no transfer or notification to it, no update
    /// from it) before a newcomer may evict it from a full table (default 60 s).
    pub fn peer_idle(mut self, d: Duration) -> Self {
        self.peers.idle = d;
        self
    }

    /// How long [`Agent::connect`](super::Agent::connect) waits for each step of the side
    /// channel's handshake (the TCP connection, then every read and write) before it fails
    /// with a typed time-out. Default 10 s; a busy peer across a slow link may need more, a
    /// health check less.
    ///
    /// At least 1 ms.
    pub fn handshake_timeout(mut self, d: Duration) -> Self {
        self.handshake_timeout = d.max(Duration::from_millis(1));
        self
    }
}

/// Whether `t` names UCX's TCP transport itself (`Transport::Auto` and `all` leave the
/// choice to UCX, which then goes without it).
fn names_tcp(t: &Transport) -> bool {
    match t {
        Transport::Tcp => true,
        Transport::Custom(l) => !l.starts_with('^') && l.split(',').any(|x| x.trim() == "tcp"),
        Transport::Auto | Transport::Shm => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_documented_ones() {
        let c = AgentConfig::new("d");
        assert_eq!(c.handshake_timeout, Duration::from_secs(10));
        assert_eq!(c.lanes.tcp.stall, Duration::from_secs(30));
        assert_eq!(c.lanes.tcp.striping.of("anyone"), 4);
        assert_eq!(c.staging.shape, StagingShape::new(8, 4 << 20).unwrap());
        assert!(c.lanes.on && !c.ucx.tcp && c.security.secret.is_none());
        assert!((1..=4).contains(&c.lanes.shm.copy_threads));
        assert!((1..=4).contains(&c.lanes.tcp.compressing.threads));
        assert_eq!(c.peers, PeerLimits::default());
    }

    #[test]
    fn the_setters_fill_the_sections_that_read_them() {
        let c = AgentConfig::new("d")
            .stripes(0)
            .peer_stripes("p", 2)
            .compress_threads(0)
            .lane_stall(Duration::ZERO)
            .handshake_timeout(Duration::ZERO)
            .net_devices("lo")
            .max_op_bytes(7)
            .max_peers(0)
            .peer_idle(Duration::from_millis(5))
            .ucx_tcp(true);
        assert_eq!(c.peers.max_peers, 1);
        assert_eq!(c.peers.idle, Duration::from_millis(5));
        assert_eq!(c.lanes.tcp.striping.of("q"), 1);
        assert_eq!(c.lanes.tcp.striping.of("p"), 2);
        assert_eq!(c.lanes.tcp.compressing.threads, 1);
        assert_eq!(c.lanes.tcp.stall, Duration::from_millis(100));
        assert_eq!(c.handshake_timeout, Duration::from_millis(1));
        assert_eq!(c.ucx.net_devices.as_deref(), Some("lo"));
        assert_eq!(c.ucx.max_op_bytes, 7);
        assert!(!c.ucx_tcp_off());
        assert_eq!(c.default_net_devices().ucx.net_devices, None);
    }

    #[test]
    fn the_whole_is_checked_once_at_agent_new() {
        let bad = |c: AgentConfig| matches!(c.check(), Err(Error::InvalidArgument(_)));
        assert!(AgentConfig::new("ok").check().is_ok());
        assert!(bad(AgentConfig::new("")));
        assert!(bad(AgentConfig::new("a\nb")));
        assert!(bad(AgentConfig::new("x".repeat(MAX_NAME + 1))));
        assert!(bad(AgentConfig::new("a").secret(Vec::new())));
        assert!(bad(AgentConfig::new("a").lane_encryption(true)));
        assert!(AgentConfig::new("a")
            .secret(b"s".to_vec())
            .lane_encryption(true)
            .check()
            .is_ok());
        assert!(bad(AgentConfig::new("a")
            .secret(b"s".to_vec())
            .no_secret()
            .lane_encryption(true)));
        assert!(bad(
            AgentConfig::new("a").transport(Transport::parse("tcp,nope"))
        ));
    }

    #[test]
    fn a_secret_never_lets_ucx_listen_on_tcp() {
        let secret = |c: AgentConfig| c.secret(b"s".to_vec()).check();
        let refused = |c: AgentConfig| {
            let e = secret(c).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
            assert!(e.to_string().contains("authenticates nobody"), "{e}");
        };
        refused(AgentConfig::new("a").ucx_tcp(true));
        refused(
            AgentConfig::new("a")
                .transport(Transport::Auto)
                .ucx_tcp(true),
        );
        for t in [Transport::Tcp, Transport::parse("rc,tcp")] {
            refused(AgentConfig::new("a").transport(t).lanes(false));
        }
        // What keeps TCP away from UCX: the lanes (the default), or no tcp asked for.
        for t in [Transport::Tcp, Transport::Auto, Transport::Shm] {
            assert!(secret(AgentConfig::new("a").transport(t)).is_ok());
        }
        for t in [
            Transport::Shm,
            Transport::parse("^tcp"),
            Transport::parse("rc,sm"),
            // Lanes off leave UCX's TCP out too unless opted in.
            Transport::Auto,
        ] {
            assert!(secret(AgentConfig::new("a").transport(t).lanes(false)).is_ok());
        }
        // Without a secret, the opt-in stands (trusted network only, logged at start).
        assert!(AgentConfig::new("a").ucx_tcp(true).check().is_ok());
        assert!(AgentConfig::new("a").lanes(false).check().is_ok());
        assert!(AgentConfig::new("a")
            .transport(Transport::Tcp)
            .lanes(false)
            .ucx_tcp(true)
            .check()
            .is_ok());
    }

    #[test]
    fn lanes_off_never_hand_tcp_to_ucx_unasked() {
        for t in [
            Transport::Tcp,
            Transport::parse("tcp"),
            Transport::parse("rc,tcp"),
        ] {
            let e = AgentConfig::new("a")
                .transport(t.clone())
                .lanes(false)
                .check()
                .unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{t:?}: {e:?}");
            assert!(e.to_string().contains("aborts this process"), "{t:?}: {e}");
        }
        for t in [
            Transport::Auto,
            Transport::Shm,
            Transport::parse("all"),
            Transport::parse("^tcp"),
            Transport::parse("rc,sm"),
        ] {
            let c = AgentConfig::new("a").transport(t.clone()).lanes(false);
            assert!(c.check().is_ok(), "{t:?}");
            assert!(c.ucx_tcp_off() && !c.may_use("tcp"), "{t:?}");
        }
    }
}
