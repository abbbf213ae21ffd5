//! The UCX backend: `raw` wraps each `ucp_*` call (the only module that names `kvxfer_sys`;
//! the others use its aliases); `handle` owns each UCX handle (RAII); `driver` is the progress
//! engine that owns every UCX object on one thread, with `endpoint` (peers) and `transfer`
//! (posting, flush, notification) as its parts.
pub(crate) mod driver;
mod endpoint;
mod handle;
pub(crate) mod raw;
mod transfer;
