//! The UCX fence's messages as they arrive from peers (UCX active messages).
#![no_main]
use kvxfer_proto::wire::ucx_fence::{FenceMsg, MAX_ENCODED};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Some(m) = FenceMsg::decode(data) {
        assert!(data.len() <= MAX_ENCODED);
        assert_eq!(m.encode(), data);
    }
});
