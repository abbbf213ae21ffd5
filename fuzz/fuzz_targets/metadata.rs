//! Peer metadata: any bytes, with the right and a wrong compatibility hash.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = kvxfer::metadata::Metadata::peek_name(data);
    if let Ok(m) = kvxfer::metadata::Metadata::decode(data, kvxfer::DEFAULT_COMPAT) {
        // Whatever decodes re-encodes to the same bytes and decodes to the same value.
        let b = m.encode();
        assert_eq!(b, data);
        assert_eq!(kvxfer::metadata::Metadata::decode(&b, kvxfer::DEFAULT_COMPAT).ok(), Some(m));
    }
});
