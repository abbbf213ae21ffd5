//! The UCX backend: `raw` wraps each `ucp_*` call (the only module that names `kvxfer_sys`;
//! the others use its aliases); `handle` owns each UCX handle (RAII); `driver` is the progress
//! engine that owns every UCX object on one thread, with `endpoint` (peers), `transfer`
//! (posting, flush, notification) and `fence` (deregistrations reaching every UCX peer, its
//! state in `fence_state`) as its parts.
pub(crate) mod driver;
mod endpoint;
mod fence;
pub(crate) mod fence_state;
mod handle;
pub(crate) mod raw;
mod transfer;
