//! Descriptor lists resolved once, for transfers by index.
#![forbid(unsafe_code)]

use std::sync::Arc;

use crate::memory::RegionInner;
use kvxfer_proto::descriptor::Resolved;

/// Local descriptors resolved once ([`Agent::prep_local`](super::Agent::prep_local)).
#[derive(Clone)]
pub struct PreparedLocal {
    pub(crate) entries: Vec<Resolved>,
    pub(crate) regions: Vec<Arc<RegionInner>>,
}

impl std::fmt::Debug for PreparedLocal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedLocal")
            .field("descs", &self.entries.len())
            .field("regions", &self.regions.len())
            .finish()
    }
}

impl PreparedLocal {
    /// Number of descriptors.
    pub fn len(&self) -> usize {
        self.entries.len()
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// A peer's descriptors resolved once ([`Agent::prep_remote`](super::Agent::prep_remote)).
#[derive(Clone, Debug)]
pub struct PreparedRemote {
    pub(crate) peer: String,
    pub(crate) token: u64,
    pub(crate) entries: Vec<Resolved>,
}

impl PreparedRemote {
    /// Number of descriptors.
    pub fn len(&self) -> usize {
        self.entries.len()
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
    /// The peer.
    pub fn peer(&self) -> &str {
        &self.peer
    }
}
