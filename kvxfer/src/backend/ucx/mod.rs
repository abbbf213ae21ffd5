//! The UCX backend: `raw` wraps each `ucp_*` call (the only module that names `kvxfer_sys`);
//! `driver` is the progress engine that owns every UCX object on one thread.
pub(crate) mod driver;
mod endpoint;
mod handle;
pub(crate) mod raw;
mod transfer;
