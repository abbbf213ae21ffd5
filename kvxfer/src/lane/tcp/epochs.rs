//! What this agent, as an initiator, learned of each lane target's fences: the target's fence
//! count for this agent ([`kvxfer_proto::wire::lane::W_FENCED`]), one per target incarnation
//! (its lane secret), so that a peer's links rebuilt for the same incarnation keep it. A
//! transfer is queued under the count learned then; only what is queued after a refusal
//! taught a higher count may be written after that fence.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use kvxfer_proto::wire::lane::SECRET_LEN;

/// The learned fence counts, per lane target incarnation.
#[derive(Default)]
pub(crate) struct FenceViews {
    views: Mutex<HashMap<[u8; SECRET_LEN], Arc<AtomicU64>>>,
}

impl FenceViews {
    /// The count learned of the target with lane secret `secret` (shared with every link to
    /// it). Entries no link holds any more are dropped here.
    pub(crate) fn of(&self, secret: [u8; SECRET_LEN]) -> Arc<AtomicU64> {
        let mut g = self.views.lock().unwrap_or_else(|e| e.into_inner());
        g.retain(|s, v| *s == secret || Arc::strong_count(v) > 1);
        g.entry(secret).or_default().clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    #[test]
    fn a_rebuilt_link_keeps_what_was_learned_and_unused_entries_go() {
        let v = FenceViews::default();
        let a = v.of([1; SECRET_LEN]);
        a.store(3, Ordering::Release);
        assert_eq!(v.of([1; SECRET_LEN]).load(Ordering::Acquire), 3);
        let b = v.of([2; SECRET_LEN]);
        assert_eq!(b.load(Ordering::Acquire), 0);
        drop(a);
        // The first target's links are gone: its entry goes at the next lookup.
        let _ = v.of([2; SECRET_LEN]);
        assert_eq!(v.views.lock().unwrap().len(), 1);
    }
}
