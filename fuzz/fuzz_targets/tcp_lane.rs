//! The TCP lane's target side: hello, request header, segment table.
#![no_main]
use kvxfer_proto::wire::lane::{
    parse_hello, parse_request_header, parse_segments, RequestHeader, Segment, HEADER_LEN,
    HELLO_FIXED_LEN, K_READ, K_WRITE, SEG_LEN,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() >= HELLO_FIXED_LEN {
        let _ = parse_hello(data[..HELLO_FIXED_LEN].try_into().unwrap());
    }
    if data.len() >= HEADER_LEN {
        if let Ok(h) = parse_request_header(data[..HEADER_LEN].try_into().unwrap()) {
            assert!(h.kind == K_WRITE || h.kind == K_READ);
            let mut b = Vec::new();
            RequestHeader { ..h }.encode(&mut b);
            assert_eq!(b, &data[..HEADER_LEN]);
            let rest = &data[HEADER_LEN..];
            let n = (h.nsegs * SEG_LEN).min(rest.len() / SEG_LEN * SEG_LEN);
            let segs = parse_segments(&rest[..n]).unwrap();
            assert_eq!(segs.len(), n / SEG_LEN);
            let mut again = Vec::new();
            for (region, offset, len) in segs {
                Segment { region, offset, len }.encode(&mut again);
            }
            assert_eq!(again, &rest[..n]);
        }
        let _ = parse_segments(&data[HEADER_LEN..]);
    }
});
