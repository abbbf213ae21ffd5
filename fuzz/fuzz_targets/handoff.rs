//! Connector handoffs arrive through the engine's router from another process: decoded, then
//! checked against a seal, which must refuse every one that the key did not seal.
#![no_main]
use kvxfer_proto::handoff_seal::HandoffKey;
use kvxfer_proto::wire::connector::Handoff;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let key = HandoffKey::new(b"fuzz secret");
    if let Ok(h) = Handoff::decode(data) {
        assert_eq!(Handoff::decode(&h.encode()).ok(), Some(h.clone()));
        // Fuzz bytes do not carry this key's seal (a forgery would be a break of HMAC).
        assert!(key.verify(&h).is_err());
        let mut sealed = h;
        key.seal(&mut sealed);
        let back = Handoff::decode(&sealed.encode()).unwrap();
        assert!(key.verify(&back).is_ok());
    }
    let _ = key.verify_bytes(data, data.get(..32).unwrap_or_default());
});
