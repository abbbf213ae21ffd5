//! The side channel as a byte stream: frames, then the HELLO payload as metadata.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut r = std::io::Cursor::new(data);
    while let Ok((kind, payload)) = kvxfer::fuzzing::read_frame(&mut r, "fuzz") {
        assert!(!payload.is_empty() || kind <= u8::MAX);
        let _ = kvxfer::metadata::Metadata::decode(&payload, kvxfer::DEFAULT_COMPAT);
    }
});
