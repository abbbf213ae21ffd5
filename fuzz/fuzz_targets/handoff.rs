//! Connector handoffs arrive through the engine's router from another process.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = kvxfer::connector::Handoff::decode(data) {
        assert_eq!(kvxfer::connector::Handoff::decode(&h.encode()).ok(), Some(h));
    }
});
