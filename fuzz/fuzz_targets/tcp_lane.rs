//! The TCP lane's target side: hello, request header, segment table or paged table.
#![no_main]
use kvxfer_proto::wire::lane::{
    encode_paged, hello_rest_len, paged_table_len, parse_hello, parse_hello_rest, parse_paged,
    parse_request_header, parse_segments, Hello, RequestHeader, Segment, HEADER_LEN,
    HELLO_FIXED_LEN, K_READ, K_WRITE, SEG_LEN,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() >= HELLO_FIXED_LEN {
        if let Ok(n) = parse_hello(data[..HELLO_FIXED_LEN].try_into().unwrap()) {
            // A whole hello with a UTF-8 name re-encodes to its bytes (epoch included).
            let end = HELLO_FIXED_LEN + hello_rest_len(n);
            if data.len() >= end && std::str::from_utf8(&data[HELLO_FIXED_LEN..][..n]).is_ok() {
                let h = parse_hello_rest(&data[HELLO_FIXED_LEN..end], n).unwrap();
                let again = Hello { name: &h.name, secret: h.secret, epoch: h.epoch }.encode();
                assert_eq!(again, &data[..end]);
            }
        }
    }
    if data.len() >= HEADER_LEN {
        if let Ok(h) = parse_request_header(data[..HEADER_LEN].try_into().unwrap()) {
            assert!(h.kind == K_WRITE || h.kind == K_READ);
            let mut b = Vec::new();
            RequestHeader { ..h }.encode(&mut b);
            assert_eq!(b, &data[..HEADER_LEN]);
            let rest = &data[HEADER_LEN..];
            if h.paged {
                // A table that parses says what it holds, and its entries survive a re-encode
                // (lists it does not use are dropped, so the bytes may differ).
                if let Ok(t) = parse_paged(&rest[..h.nsegs.min(rest.len())]) {
                    let sum: u64 = t.entries.iter().map(|e| e.bytes()).sum();
                    assert_eq!(sum, t.total);
                    let mut again = Vec::new();
                    encode_paged(&t.entries, &mut again);
                    assert_eq!(again.len(), paged_table_len(&t.entries));
                    assert_eq!(parse_paged(&again).unwrap(), t);
                }
                return;
            }
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
