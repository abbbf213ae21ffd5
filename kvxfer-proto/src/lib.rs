//! kvxfer's pure core: the vocabulary, the errors, descriptor resolution and planning, KV
//! layout math, the block lifecycle, link planning, tensor-parallel head mapping, and every
//! wire codec. No I/O beyond reading a frame from a byte stream, no clock in any decision
//! (callers pass `now`; the one clock read is the compression codec timing its own work for
//! the metrics, `compress::codec`), no UCX, no unsafe code: it builds and tests anywhere
//! (`cargo test -p kvxfer-proto`), and the fuzz targets depend on it alone.
//!
//! The `kvxfer` crate re-exports what its API names, each item at one path (`kvxfer::Desc`,
//! `kvxfer::layout`, `kvxfer::connector::FreeReason`, ...); the codecs and protocol cores
//! are named here.
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

pub mod acceptor;
pub mod block_size;
pub mod compress;
pub mod connector;
pub mod copy_batch;
pub mod descriptor;
pub mod error;
pub mod grants;
pub mod groups;
pub mod handoff_seal;
pub mod lane;
pub mod lane_request;
pub mod lane_seal;
pub mod layout;
pub mod lifecycle;
pub mod paged;
pub mod peer_table;
pub mod planning;
pub mod session;
pub mod state;
pub mod tp;
pub mod types;
pub mod ucx_fence;
pub mod updates;
pub mod wire;
