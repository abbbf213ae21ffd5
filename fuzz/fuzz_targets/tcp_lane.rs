//! The TCP lane's target side: hello, request header, segment table.
#![no_main]
use kvxfer::fuzzing::{parse_hello, parse_request_header, parse_segments};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() >= 8 {
        let _ = parse_hello(data[..8].try_into().unwrap());
    }
    if data.len() >= 17 {
        if let Ok(h) = parse_request_header(data[..17].try_into().unwrap()) {
            assert!(h.kind == 1 || h.kind == 2);
            let rest = &data[17..];
            let n = (h.nsegs * 20).min(rest.len() / 20 * 20);
            let segs = parse_segments(&rest[..n]).unwrap();
            assert_eq!(segs.len(), n / 20);
        }
        let _ = parse_segments(&data[17..]);
    }
});
