//! Connector control messages, as they arrive from peers inside notifications.
#![no_main]
use kvxfer_proto::wire::connector::{ToConsumer, ToProducer};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // Whatever decodes re-encodes to a message that decodes to the same value.
    if let Ok(m) = ToProducer::decode(data) {
        assert_eq!(ToProducer::decode(&m.encode()), Ok(m));
    }
    if let Ok(m) = ToConsumer::decode(data) {
        assert_eq!(ToConsumer::decode(&m.encode()), Ok(m));
    }
});
