//! Notifications as they arrive from peers (UCX active messages, TCP lane).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Some(n) = kvxfer::notify::decode(data) {
        assert!(!n.from.is_empty() && n.from.len() <= kvxfer::metadata::MAX_NAME);
        assert!(n.payload.len() <= kvxfer::notify::MAX_NOTIFICATION);
    }
});
