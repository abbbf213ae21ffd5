//! Notifications as they arrive from peers (UCX active messages, TCP lane).
#![no_main]
use kvxfer_proto::wire::metadata::MAX_NAME;
use kvxfer_proto::wire::notify::{decode, encode, MAX_NOTIFICATION};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Some(n) = decode(data) {
        assert!(!n.from.is_empty() && n.from.len() <= MAX_NAME);
        assert!(n.payload.len() <= MAX_NOTIFICATION);
        assert_eq!(encode(&n.from, &n.payload), data);
    }
});
