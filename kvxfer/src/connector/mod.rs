//! The connector engines call: a prefill worker's [`Producer`] hands a request's KV over, a
//! decode worker's [`Consumer`] takes it in. Shaped after vLLM's `KVConnectorBase_V1` worker
//! side, engine-agnostic:
//!
//! | vLLM | kvxfer |
//! |---|---|
//! | `register_kv_caches` | register the cache with the [`Agent`](crate::Agent), describe it with a [`KvLayout`](crate::layout::KvLayout) |
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
//! expired handoff fails with [`Error::Handoff`](crate::Error::Handoff).
//!
//! Control messages ([`kvxfer_proto::wire::connector`], typed) travel as kvxfer notifications
//! (JSON after a `KXCP` or `KXCC` tag) on queues of their own: the agent's notifications stay
//! the user's. What each side answers and when a lease ends is decided by the pure cores in
//! [`kvxfer_proto::connector`]; this module is their shell (threads, transfers, budget,
//! telemetry), in `producer` and `consumer`.

// Unsafe code only where engine memory is named (`api`: `CacheTensor::new`), registered
// (`over_agent`) or copied (`in_process::copy`); every other file forbids it.

mod api;
mod config;
pub mod conformance;
mod consumer;
mod in_process;
mod over_agent;
mod producer;
mod shell;

pub use api::{
    CacheTensor, KvCaches, KvConnector, KvConsumer, KvProducer, LayerTensors, LoadFailure,
};
pub use config::ConnectorConfig;
pub use consumer::Consumer;
pub use in_process::InProcessConnector;
pub use kvxfer_proto::lifecycle::{FreeReason, Freed};
pub use kvxfer_proto::wire::connector::{Handoff, Mode};
pub use over_agent::AgentConnector;
pub use producer::Producer;
