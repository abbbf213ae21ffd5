//! Connector handoffs arrive through the engine's router from another process.
#![no_main]
use kvxfer_proto::wire::connector::Handoff;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = Handoff::decode(data) {
        assert_eq!(Handoff::decode(&h.encode()).ok(), Some(h));
    }
});
