//! Compressed frames (the TCP lane's data when compression is on): any bytes decode to an
//! error or to data whose CRC-32 matched, never a panic or an allocation past a frame's
//! bound; and what the encoder makes of the input decodes back to it.
#![no_main]
use kvxfer_proto::compress::codec::{decode_frame, Decoder, Encoder};
use kvxfer_proto::compress::planes::Transform;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut d = Decoder::new().unwrap();
    let mut at = 0;
    let left = u64::from(data.first().copied().unwrap_or(0)) << 12;
    while at < data.len() {
        match decode_frame(&mut d, &data[at..], left) {
            Ok((out, n)) => {
                assert!(n > 0 && out.len() as u64 <= left);
                at += n;
            }
            Err(_) => break,
        }
    }
    if !data.is_empty() {
        let t = Transform::from_code(data[0] % 3).unwrap();
        let mut e = Encoder::new(t).unwrap();
        let mut wire = Vec::new();
        e.encode(data, &mut wire).unwrap();
        let (back, n) = decode_frame(&mut d, &wire, data.len() as u64).unwrap();
        assert_eq!((back.as_slice(), n), (data, wire.len()));
    }
});
