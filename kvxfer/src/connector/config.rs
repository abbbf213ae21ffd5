//! The connector's settings.
#![forbid(unsafe_code)]

use std::ops::Range;
use std::time::Duration;

use crate::budget::MemoryBudget;
use kvxfer_proto::wire::connector::Mode;

/// Connector settings: [`ConnectorConfig::default`] and the setters (or the fields, which are
/// public to read and write; new ones may come, so it is built from its default).
///
/// ```
/// use std::time::Duration;
/// use kvxfer::connector::{ConnectorConfig, Mode};
///
/// let cfg = ConnectorConfig::default()
///     .mode(Mode::Push)
///     .readers(2)
///     .lease(Duration::from_secs(10));
/// assert_eq!(cfg.readers, 2);
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ConnectorConfig {
    /// Pull or push.
    pub mode: Mode,
    /// Producer: how long blocks stay held without a heartbeat.
    pub lease: Duration,
    /// Consumer: how often it renews the lease while loading.
    pub heartbeat: Duration,
    /// Producer: the longest any request's blocks are held from its publication, whatever the
    /// heartbeats (then freed with [`FreeReason::HoldLimit`]; at least the lease). Default
    /// 15 minutes: a layer-wise load of a long prompt at 1 GbE fits.
    ///
    /// [`FreeReason::HoldLimit`]: kvxfer_proto::lifecycle::FreeReason::HoldLimit
    pub max_hold: Duration,
    /// Producer: how many requests one reader may be reading at once (it heartbeated and
    /// has not acknowledged); past it, its first call for another request is refused
    /// (`LeaseError::PeerShare`). Default 1,024.
    pub peer_requests: usize,
    /// Producer: the bytes of the cache one reader's requests may keep held together, a hard
    /// limit (a reader that holds nothing may still take one request of any size). Default
    /// (`None`): a fair share of half the cache, which binds only while another reader holds
    /// blocks too: a lone decode worker loading many requests is never refused for bytes,
    /// and one that reads slowly or heartbeats without end cannot hold more than half the
    /// prefill engine's cache from the others.
    pub peer_bytes: Option<u64>,
    /// Producer: readers per request (2 for two decode ranks each reading half the heads).
    pub readers: usize,
    /// Consumer: which of the producer's KV heads it reads (default: all). Its own layout
    /// holds exactly that many heads; the producer's layout must be HND for a strict subset to
    /// be one descriptor per block.
    pub heads: Option<Range<u64>>,
    /// Every byte of request state and lists is charged here.
    pub budget: MemoryBudget,
    /// How long a request waits for budget before it fails.
    pub budget_wait: Duration,
}

impl Default for ConnectorConfig {
    fn default() -> Self {
        ConnectorConfig {
            mode: Mode::Pull,
            lease: Duration::from_secs(30),
            heartbeat: Duration::from_secs(1),
            max_hold: kvxfer_proto::lifecycle::DEFAULT_MAX_HOLD,
            peer_requests: kvxfer_proto::lifecycle::DEFAULT_PEER_REQUESTS,
            peer_bytes: None,
            readers: 1,
            heads: None,
            budget: MemoryBudget::unlimited(),
            budget_wait: Duration::from_secs(60),
        }
    }
}

impl ConnectorConfig {
    /// Sets [`ConnectorConfig::mode`](#structfield.mode).
    pub fn mode(mut self, m: Mode) -> Self {
        self.mode = m;
        self
    }

    /// Sets [`ConnectorConfig::lease`](#structfield.lease).
    pub fn lease(mut self, d: Duration) -> Self {
        self.lease = d;
        self
    }

    /// Sets [`ConnectorConfig::heartbeat`](#structfield.heartbeat).
    pub fn heartbeat(mut self, d: Duration) -> Self {
        self.heartbeat = d;
        self
    }

    /// Sets [`ConnectorConfig::max_hold`](#structfield.max_hold).
    pub fn max_hold(mut self, d: Duration) -> Self {
        self.max_hold = d;
        self
    }

    /// Sets [`ConnectorConfig::peer_requests`](#structfield.peer_requests) and
    /// [`ConnectorConfig::peer_bytes`](#structfield.peer_bytes).
    pub fn peer_share(mut self, requests: usize, bytes: Option<u64>) -> Self {
        self.peer_requests = requests;
        self.peer_bytes = bytes;
        self
    }

    /// Sets [`ConnectorConfig::readers`](#structfield.readers).
    pub fn readers(mut self, n: usize) -> Self {
        self.readers = n;
        self
    }

    /// Sets [`ConnectorConfig::heads`](#structfield.heads).
    pub fn heads(mut self, h: Range<u64>) -> Self {
        self.heads = Some(h);
        self
    }

    /// Sets [`ConnectorConfig::budget`](#structfield.budget).
    pub fn budget(mut self, b: MemoryBudget) -> Self {
        self.budget = b;
        self
    }

    /// Sets [`ConnectorConfig::budget_wait`](#structfield.budget_wait).
    pub fn budget_wait(mut self, d: Duration) -> Self {
        self.budget_wait = d;
        self
    }
}
