//! The TCP lane window's decoders and checks as a hostile peer drives them: an offer and an
//! answer from its bytes (what decodes encodes to the same bytes), and the other side's
//! counts as a window shows them: whatever they say, a reader is never told more than the
//! ring holds, a writer never more room than it has, and a run never leaves the ring.
#![no_main]
use kvxfer_proto::wire::lane_window::{
    decode_ack, readable, run_at, writable, WindowOffer, OFFER_LEN, RING_BYTES,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() >= OFFER_LEN {
        let mut b = [0u8; OFFER_LEN];
        b.copy_from_slice(&data[..OFFER_LEN]);
        if let Ok(o) = WindowOffer::decode(&b) {
            assert_eq!(o.encode(), b);
        }
    }
    if let Some(&a) = data.first() {
        let _ = decode_ack(a);
    }
    if data.len() >= 24 {
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&data[8 * i..8 * i + 8]);
            u64::from_le_bytes(w)
        };
        let (theirs, mine, seen) = (word(0), word(1), word(2));
        if let Ok(n) = readable(theirs, mine, seen) {
            assert!(n <= RING_BYTES as u64 && theirs >= seen);
        }
        if let Ok(n) = writable(theirs, mine, seen) {
            assert!(n <= RING_BYTES as u64 && theirs <= mine && theirs >= seen);
        }
        let (off, k) = run_at(mine, theirs);
        assert!(off + k <= RING_BYTES && k as u64 <= theirs);
    }
});
