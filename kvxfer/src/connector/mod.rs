//! The connector engines call: a prefill worker's [`Producer`] hands a request's KV over, a
//! decode worker's [`Consumer`] takes it in. Shaped after vLLM's `KVConnectorBase_V1` worker
//! side, engine-agnostic:
//!
//! | vLLM | kvxfer |
//! |---|---|
//! | `register_kv_caches` | register the cache with the [`Agent`], describe it with a [`KvLayout`] |
//! | `request_finished` → `kv_transfer_params` | [`Producer::publish`] → [`Handoff`] (bytes) |
//! | `save_kv_layer` | [`Producer::layer_done`] |
//! | `get_finished` (sending) | [`Producer::take_freed`] |
//! | `start_load_kv` | [`Consumer::start_load`] |
//! | `wait_for_layer_load` | [`Consumer::wait_layer`] |
//! | `get_finished` (receiving), `get_block_ids_with_load_errors` | [`Consumer::take_finished`], [`Consumer::take_failed`] |
//!
//! **Pull** (default, as vLLM's NixlConnector): the consumer asks for a lease, READs the blocks
//! it lacks layer by layer as the producer reports them done, and acknowledges. **Push**: the
//! consumer names its blocks and the producer WRITEs each layer into them as soon as it is
//! done; each layer's notification arrives after its data. Either way only the blocks the
//! consumer lacks move (a cached prefix stays), and a producer frees blocks on the last
//! reader's acknowledgement, on abort or on lease expiry ([`kvxfer_proto::lifecycle`]). A pull
//! consumer bounds each read by the lease it was granted, so it never reads freed blocks: an
//! expired handoff fails with [`Error::Handoff`].
//!
//! Control messages ([`kvxfer_proto::wire::connector`], typed) travel as kvxfer notifications
//! (JSON after a `KXCP` or `KXCC` tag) on queues of their own: the agent's notifications stay
//! the user's. What each side answers and when a lease ends is decided by the pure cores in
//! [`kvxfer_proto::connector`]; this module is their shell (threads, transfers, budget,
//! telemetry), in `producer` and `consumer`.

#![forbid(unsafe_code)]

mod consumer;
mod producer;

use std::ops::Range;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

pub use consumer::{Consumer, LoadFailure};
pub use kvxfer_proto::wire::connector::{Handoff, Mode};
pub use producer::Producer;

use crate::agent::Agent;
use crate::budget::{Charge, MemoryBudget};
use crate::transfer::XferStats;
use kvxfer_proto::error::Result;

/// Bytes of request state charged per descriptor.
const STATE_BYTES_PER_DESC: u64 = 160;
/// Fixed bytes charged per request.
const STATE_BYTES_FIXED: u64 = 4096;

/// Connector settings.
#[derive(Clone, Debug)]
pub struct ConnectorConfig {
    /// Pull or push.
    pub mode: Mode,
    /// Producer: how long blocks stay held without a heartbeat.
    pub lease: Duration,
    /// Consumer: how often it renews the lease while loading.
    pub heartbeat: Duration,
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
            readers: 1,
            heads: None,
            budget: MemoryBudget::unlimited(),
            budget_wait: Duration::from_secs(60),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Sends a control message (already encoded); failures are logged (the peer's lease logic
/// covers lost ones).
fn send(agent: &Agent, peer: &str, msg: &[u8]) {
    match agent.notify(peer, msg) {
        Ok(t) => drop(t), // completes on its own
        Err(e) => log::warn!("kvxfer connector: message to {peer:?} not sent: {e}"),
    }
}

fn state_charge(budget: &MemoryBudget, descs: u64, what: &str, wait: Duration) -> Result<Charge> {
    budget.charge(STATE_BYTES_FIXED + descs * STATE_BYTES_PER_DESC, what, wait)
}

fn add_stats(
    bytes: &mut u64,
    descs: &mut u64,
    post: &mut Duration,
    xfer: &mut Duration,
    s: &XferStats,
) {
    *bytes += s.bytes;
    *descs += s.descs as u64;
    *post += s.post_time;
    *xfer += s.duration;
}
