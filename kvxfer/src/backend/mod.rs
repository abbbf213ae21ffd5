//! Transport backends: UCX (`ucx`). kvxfer's own lanes (`crate::lane`) move bytes too, beside
//! it; the agent's `route` chooses between them per transfer.
pub(crate) mod ucx;
