//! A sealed TCP lane's opening on its target (`kvxfer_proto::lane_seal::LaneOpening`), fed the
//! fuzz bytes as the gate feeds a connection: never panics, answers nothing to a handshake
//! that did not prove the keys, and never hands out a hello it did not open. The same bytes
//! as the record that follows a real handshake: never opens (a forgery).
#![no_main]
use kvxfer_proto::lane_seal::{record_len, LaneOpening, Opened, MAX_RECORD};
use kvxfer_proto::session::{Initiator, Psk, Session, StaticKey};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let psk = Psk::lane(b"k", b"lane");
    let (target_key, my_key) = (StaticKey::from_seed([3; 32]), StaticKey::from_seed([4; 32]));
    let mut o = LaneOpening::new(psk.clone(), target_key.clone(), [7; 32], "fuzz");
    let mut rest = data;
    while o.want() > 0 && rest.len() >= o.want() {
        let (now, later) = rest.split_at(o.want());
        rest = later;
        match o.on_bytes(now) {
            Opened::More => {}
            Opened::Refused(_) => assert!(o.take_output().is_empty() || o.session().is_some()),
            Opened::Hello { .. } => panic!("a hello opened from bytes no initiator sealed"),
        }
    }
    let mut prefix = [0u8; 4];
    if data.len() >= 4 {
        prefix.copy_from_slice(&data[..4]);
        let _ = record_len(&prefix, MAX_RECORD, || "fuzz".into());
    }
    let started = Initiator::start_keyed(&psk, &my_key, &target_key.public(), [1; 32], "fuzz");
    if let Ok((init, first)) = started {
        let answered = Session::respond_keyed(&psk, &target_key, [2; 32], &first, "fuzz");
        if let Ok((mut target, answer, _)) = answered {
            let mut out = vec![0u8; data.len()];
            assert!(target.open_to(data, &mut out).is_err());
            if let Ok(mut initiator) = init.finish(&answer) {
                assert!(initiator.open_to(data, &mut out).is_err());
            }
        }
    }
});
