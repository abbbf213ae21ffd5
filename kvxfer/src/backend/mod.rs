//! Transport backends: UCX (`ucx`) and its section of the configuration (`settings`).
//! kvxfer's own lanes (`crate::lane`) move bytes too, beside it; the agent's `route` chooses
//! between them per transfer.
pub(crate) mod settings;
pub(crate) mod ucx;
