//! The connector engines call, as traits an engine binds to: the prefill side
//! ([`KvProducer`]) hands a request's KV over, the decode side ([`KvConsumer`]) takes it in,
//! and a [`KvConnector`] registers an engine's caches ([`KvCaches`]) and makes either. Two
//! implementations: [`AgentConnector`] (kvxfer's [`Agent`](crate::Agent): UCX and kvxfer's
//! lanes, across processes and hosts; its [`Producer`] and [`Consumer`]) and
//! [`InProcessConnector`] (memcpy within one process). Both pass the [`conformance`] suite,
//! which a third party's implementation can run too. The mapping to vLLM's
//! `KVConnectorBase_V1` and SGLang's disaggregation is in the `api` table below.
//!
//! An engine binding, whole (the in-process connector here; an [`AgentConnector`] over an
//! agent in each worker process is the same code):
//!
//! ```
//! use std::time::Duration;
//! use kvxfer::connector::*;
//! use kvxfer::layout::{KvGeometry, KvOrder, KvPacking};
//!
//! /// The engine's paged cache (one fused K+V tensor per layer) as the connector sees it.
//! fn caches(mem: &mut [Vec<u8>], g: &KvGeometry, blocks: u64) -> KvCaches {
//!     let layers = mem.iter_mut().map(|t| LayerTensors {
//!         // SAFETY: the engine keeps `mem` alive and unmoved while the connector lives.
//!         k: unsafe { CacheTensor::new(t.as_mut_ptr(), t.len(), kvxfer::MemKind::Host) },
//!         v: None,
//!     });
//!     KvCaches { geometry: g.clone(), block_tokens: 16, num_blocks: blocks,
//!         packing: KvPacking::Fused, order: KvOrder::Nhd, layers: layers.collect(), state: None,
//!         pad_per_head: 0 }
//! }
//! /// Prefill worker, forward pass done: publish the blocks, send the handoff with the request.
//! fn prefill_done(p: &dyn KvProducer, req: &str, blocks: &[u32], tokens: u64) -> kvxfer::Result<Vec<u8>> {
//!     Ok(p.publish(req, blocks, tokens, 28)?.encode())
//! }
//! /// Decode worker, request admitted: load only the blocks its prefix cache lacks.
//! fn admit(c: &dyn KvConsumer, handoff: &[u8], missing: &[u32]) -> kvxfer::Result<()> {
//!     let h = Handoff::decode(handoff)?;
//!     c.start_load(&h, missing)?;
//!     c.wait(&h.request, Duration::from_secs(10)) // or wait_layer, layer by layer
//! }
//! # fn main() -> kvxfer::Result<()> {
//! let g = KvGeometry::preset("qwen3-0.6b")?; // 28 layers, 8 KV heads of 128
//! let tensor = vec![0u8; 8 * 2 * g.block_bytes(16) as usize]; // 8 blocks of K+V
//! let (mut prefill_mem, mut decode_mem) = (vec![tensor.clone(); 28], vec![tensor; 28]);
//! prefill_mem[3][2 * 65536..3 * 65536].fill(7); // layer 3, block 2: "computed" KV
//! let conn: Box<dyn KvConnector> = Box::new(InProcessConnector::new());
//! let cfg = ConnectorConfig::default();
//! let p = conn.producer(&caches(&mut prefill_mem, &g, 8), &cfg)?;
//! let c = conn.consumer(&caches(&mut decode_mem, &g, 8), &cfg)?;
//! let handoff = prefill_done(&*p, "req-1", &[0, 1, 2], 48)?;
//! admit(&*c, &handoff, &[5])?; // blocks 0 and 1 are a cached prefix here
//! assert!(decode_mem[3][5 * 65536..6 * 65536].iter().all(|&b| b == 7));
//! assert_eq!(p.wait_freed("req-1", Duration::from_secs(10))?.blocks, [0, 1, 2]);
//! # drop((c, p)); Ok(()) }
//! ```
//!
//! **Pull** (default, as vLLM's NixlConnector): the consumer asks for a lease, READs the blocks
//! it lacks layer by layer as the producer reports them done, and acknowledges. **Push**: the
//! consumer names its blocks and the producer WRITEs each layer into them as soon as it is
//! done; each layer's notification arrives after its data. Either way only the blocks the
//! consumer lacks move (a cached prefix stays), and a producer frees blocks on the last
//! reader's acknowledgement, on abort or on lease expiry ([`kvxfer_proto::lifecycle`]). A pull
//! consumer bounds each read by the lease it was granted, so it never reads freed blocks: an
//! expired handoff fails with [`Error::Handoff`](crate::Error::Handoff); one whose producer
//! stops renewing the lease fails too, never waits forever.
//!
//! Over an agent, control messages ([`kvxfer_proto::wire::connector`], typed) travel as
//! kvxfer notifications (JSON after a `KXCP` or `KXCC` tag) on queues of their own: the
//! agent's notifications stay the user's. What each side answers and when a lease ends is
//! decided by the pure cores in [`kvxfer_proto::connector`], for both implementations. One
//! shell (threads, budget, telemetry) runs them, [`Producer`] and [`Consumer`], for both: it
//! reaches peers through a carrier (`carrier`: send, receive, move a layer), the agent's
//! (`agent_carrier`) or the in-process one (`in_process`).

// Unsafe code only where engine memory is named (`api`: `CacheTensor::new`), registered
// (`over_agent`) or copied (`in_process::copy`); every other file forbids it.

mod agent_carrier;
mod api;
mod carrier;
mod config;
pub mod conformance;
mod consumer;
mod in_process;
mod load_plan;
mod over_agent;
mod producer;
mod producer_state;
mod push;
mod shell;

pub use api::{
    CacheTensor, KvCaches, KvConnector, KvConsumer, KvProducer, LayerTensors, LoadFailure, LoadSpec,
};
pub use config::ConnectorConfig;
pub use consumer::Consumer;
pub use in_process::InProcessConnector;
pub use kvxfer_proto::groups::{MAX_GROUPS, NO_BLOCK};
pub use kvxfer_proto::handoff_seal::{HandoffKey, SealError};
pub use kvxfer_proto::lifecycle::{FreeReason, Freed};
pub use kvxfer_proto::tp::{plan as tp_plan, HeadMap, TpRead, TpSide, MAX_KV_HEADS, MAX_TP};
pub use kvxfer_proto::wire::connector::{Grant, Handoff, Mode, GRANT_LEN};
pub use over_agent::AgentConnector;
pub use producer::Producer;
