//! The side channel as a byte stream: frames, then the HELLO payload as metadata.
#![no_main]
use kvxfer_proto::wire::metadata::{Metadata, DEFAULT_COMPAT};
use kvxfer_proto::wire::side_channel::{encode_frame, read_frame};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut r = std::io::Cursor::new(data);
    let mut at = 0usize;
    while let Ok((kind, payload)) = read_frame(&mut r, "fuzz") {
        // The frame re-encodes to the bytes it was read from.
        let end = r.position() as usize;
        assert_eq!(encode_frame(kind, &payload), &data[at..end]);
        at = end;
        let _ = Metadata::decode(&payload, DEFAULT_COMPAT);
    }
});
