//! Peer metadata: any bytes, with the right and a wrong compatibility hash.
#![no_main]
use kvxfer_proto::wire::metadata::{Metadata, DEFAULT_COMPAT};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = Metadata::peek_name(data);
    if let Ok(m) = Metadata::decode(data, DEFAULT_COMPAT) {
        // Whatever decodes re-encodes to the same bytes and decodes to the same value.
        let b = m.encode();
        assert_eq!(b, data);
        assert_eq!(Metadata::decode(&b, DEFAULT_COMPAT).ok(), Some(m));
    }
});
