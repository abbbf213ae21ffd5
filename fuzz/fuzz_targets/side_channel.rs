//! The side channel as a byte stream: frames, then the HELLO payload as metadata; the same
//! bytes fed to the listener's handshake (with and without a secret), as the gate does; and
//! the bytes opened as a sealed message of an established session, and taken as a Noise
//! handshake message by a responder and as the answer by an initiator.
#![no_main]
use kvxfer_proto::acceptor::{SideChannelAcceptor, Step};
use kvxfer_proto::session::{Initiator, Psk, Session};
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
    for secret in [None, Some(&b"k"[..])] {
        let mut a = SideChannelAcceptor::new(
            "fuzz",
            secret,
            [7; 32],
            Default::default(),
            Default::default(),
        );
        let mut rest = data;
        while a.want() > 0 && rest.len() >= a.want() {
            let (now, later) = rest.split_at(a.want());
            rest = later;
            if let Step::Hello(m) = a.on_bytes(now) {
                let _ = Metadata::decode(&m, DEFAULT_COMPAT);
                a.answer(Err("refused".into()));
            }
        }
        let _ = a.take_output();
    }
    // Sealed input: never opens (a forgery), never panics.
    if let Ok((init, first)) = Initiator::start(&Psk::side_channel(b"k"), [1; 32], "fuzz") {
        if let Ok((mut responder, answer)) = Session::respond(&Psk::side_channel(b"k"), [2; 32], &first, "fuzz") {
            assert!(responder.open(data).is_err());
            if let Ok(mut initiator) = init.finish(&answer) {
                assert!(initiator.open(data).is_err());
            }
        }
    }
    let _ = Session::respond(&Psk::side_channel(b"k"), [3; 32], data, "fuzz");
    if let Ok((init, _)) = Initiator::start(&Psk::side_channel(b"k"), [4; 32], "fuzz") {
        let _ = init.finish(data);
    }
});
