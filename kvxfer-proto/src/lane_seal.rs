//! The opening of a sealed TCP lane on its target, as a pure state machine: the initiator's
//! `"KVXN" | Noise IK handshake` (PSK: [`Psk::lane`]), the answer, then the first sealed record
//! (`mode u8 | hello`), whose hello goes on to [`crate::lane::LaneTarget`]. Nothing of the
//! hello is read before the handshake proved that the initiator holds the deployment's
//! secret, this target's lane credential and the private half of the static key it names
//! ([`Opened::Hello::key`]: the shell accepts the hello's name only if that peer's metadata
//! carried this key). Every record after it is `len u32 | sealed` ([`seal_record`],
//! [`record_len`]).

use crate::error::{Error, Result};
use crate::session::{sealed_len, Psk, Session, StaticKey, KEYED_FIRST_LEN, PUBLIC_KEY_LEN, SEED};
use crate::wire::lane::{
    hello_rest_len, DataMode, HELLO_FIXED_LEN, RECORD_LEN_BYTES, RECORD_PLAIN, SEALED_MAGIC,
};
use crate::wire::metadata::MAX_NAME;

/// Bytes the initiator opens with: the magic and its handshake message.
pub const OPENING_LEN: usize = SEALED_MAGIC.len() + KEYED_FIRST_LEN;
/// Most sealed bytes of one record.
pub const MAX_RECORD: usize = sealed_len(RECORD_PLAIN);
/// Most sealed bytes of the first record (a mode byte and the longest hello).
pub const MAX_HELLO_RECORD: usize = sealed_len(1 + HELLO_FIXED_LEN + hello_rest_len(MAX_NAME));

/// Bytes of the record of a `plain`-byte message.
pub const fn record_size(plain: usize) -> usize {
    RECORD_LEN_BYTES + sealed_len(plain)
}

/// Appends the record of `plain` (at most [`RECORD_PLAIN`] bytes) to `out`.
pub fn seal_record(s: &mut Session, plain: &[u8], out: &mut Vec<u8>) {
    let at = out.len();
    out.resize(at + record_size(plain.len()), 0);
    seal_record_to(s, plain, &mut out[at..]);
}

/// Writes the record of `plain` (at most [`RECORD_PLAIN`] bytes) into the first
/// [`record_size`] bytes of `out` (a buffer the caller reuses); returns that size.
pub fn seal_record_to(s: &mut Session, plain: &[u8], out: &mut [u8]) -> usize {
    debug_assert!(plain.len() <= RECORD_PLAIN);
    let n = s.seal_to(plain, &mut out[RECORD_LEN_BYTES..]);
    out[..RECORD_LEN_BYTES].copy_from_slice(&(n as u32).to_le_bytes());
    RECORD_LEN_BYTES + n
}

/// The sealed length a record's prefix states, within `max`; else [`Error::Auth`] naming
/// `who()` (a record longer than any sender makes is a changed or foreign stream).
pub fn record_len(
    prefix: &[u8; RECORD_LEN_BYTES],
    max: usize,
    who: impl FnOnce() -> String,
) -> Result<usize> {
    let n = u32::from_le_bytes(*prefix) as usize;
    if n == 0 || n > max {
        return Err(Error::Auth {
            peer: who(),
            why: format!("a sealed record of {n} bytes (limit {max})"),
        });
    }
    Ok(n)
}

/// Where the opening is.
#[derive(Debug)]
enum State {
    /// Waiting for the magic and the handshake.
    Handshake,
    /// Waiting for the first record's length.
    RecordLen,
    /// Waiting for the first record's sealed bytes.
    Record(usize),
    /// The hello arrived; the session is the shell's.
    Done,
    /// Refused: the connection closes.
    Closed,
}

/// What an opening step gave.
#[derive(Debug, PartialEq, Eq)]
pub enum Opened {
    /// Read [`LaneOpening::want`] more bytes.
    More,
    /// The initiator proved the keys and sent its hello (to feed to the lane core) and its
    /// data mode.
    Hello {
        /// The lane hello's bytes.
        hello: Vec<u8>,
        /// How the initiator moves the data.
        mode: DataMode,
        /// The static public key the initiator proved it holds: the hello's name is its
        /// only if that peer's metadata carried this key.
        key: [u8; PUBLIC_KEY_LEN],
    },
    /// Refused (nothing to answer: the initiator did not prove the keys); why, for the log.
    Refused(String),
}

/// A sealed lane's opening on its target.
pub struct LaneOpening {
    psk: Psk,
    key: StaticKey,
    remote: Option<[u8; PUBLIC_KEY_LEN]>,
    seed: Option<[u8; SEED]>,
    who: String,
    state: State,
    session: Option<Session>,
    out: Vec<u8>,
}

impl std::fmt::Debug for LaneOpening {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LaneOpening")
            .field("who", &self.who)
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

impl LaneOpening {
    /// An opening whose initiator must prove `psk`, answered as `key` (this target's static
    /// key); `seed` is fresh randomness (this side's ephemeral key); `who` names the
    /// connection in errors.
    pub fn new(psk: Psk, key: StaticKey, seed: [u8; SEED], who: &str) -> LaneOpening {
        LaneOpening {
            psk,
            key,
            remote: None,
            seed: Some(seed),
            who: who.to_string(),
            state: State::Handshake,
            session: None,
            out: Vec::new(),
        }
    }

    /// Bytes to read next (0: none, done or closed).
    pub fn want(&self) -> usize {
        match self.state {
            State::Handshake => OPENING_LEN,
            State::RecordLen => RECORD_LEN_BYTES,
            State::Record(n) => n,
            State::Done | State::Closed => 0,
        }
    }

    /// Whether it was refused.
    pub fn is_closed(&self) -> bool {
        matches!(self.state, State::Closed)
    }

    /// The `want()` bytes read.
    pub fn on_bytes(&mut self, b: &[u8]) -> Opened {
        match std::mem::replace(&mut self.state, State::Closed) {
            State::Handshake => {
                if b.len() != OPENING_LEN || &b[..SEALED_MAGIC.len()] != SEALED_MAGIC {
                    return Opened::Refused(
                        "not a sealed lane opening (an initiator without the shared secret?)"
                            .into(),
                    );
                }
                let Some(seed) = self.seed.take() else {
                    return Opened::Refused("a second handshake".into());
                };
                let first = &b[SEALED_MAGIC.len()..];
                match Session::respond_keyed(&self.psk, &self.key, seed, first, &self.who) {
                    Ok((s, answer, remote)) => {
                        self.session = Some(s);
                        self.remote = Some(remote);
                        self.out.extend_from_slice(&answer);
                        self.state = State::RecordLen;
                        Opened::More
                    }
                    Err(e) => Opened::Refused(e.to_string()),
                }
            }
            State::RecordLen => {
                let Ok(prefix) = <[u8; RECORD_LEN_BYTES]>::try_from(b) else {
                    return Opened::Refused("a short record length".into());
                };
                match record_len(&prefix, MAX_HELLO_RECORD, || self.who.clone()) {
                    Ok(n) => {
                        self.state = State::Record(n);
                        Opened::More
                    }
                    Err(e) => Opened::Refused(e.to_string()),
                }
            }
            State::Record(n) if b.len() == n => {
                let Some(s) = self.session.as_mut() else {
                    return Opened::Refused("a record before the handshake (a bug)".into());
                };
                let plain = match s.open(b) {
                    Ok(p) => p,
                    Err(e) => return Opened::Refused(e.to_string()),
                };
                let Some(mode) = plain.first().copied().and_then(DataMode::of) else {
                    return Opened::Refused(format!("an unknown data mode {:?}", plain.first()));
                };
                let Some(key) = self.remote else {
                    return Opened::Refused("a record before the handshake (a bug)".into());
                };
                self.state = State::Done;
                Opened::Hello {
                    hello: plain[1..].to_vec(),
                    mode,
                    key,
                }
            }
            State::Record(_) => Opened::Refused("a short record".into()),
            State::Done | State::Closed => Opened::Refused("bytes after the opening".into()),
        }
    }

    /// What to send the initiator now (its handshake answer).
    pub fn take_output(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.out)
    }

    /// The session, for sealing (a refusal's welcome, then every message); `None` before the
    /// handshake completed.
    pub fn session(&mut self) -> Option<&mut Session> {
        self.session.as_mut()
    }

    /// The session, once the hello arrived.
    pub fn into_session(self) -> Option<Session> {
        match self.state {
            State::Done => self.session,
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::session::Initiator;
    use crate::wire::lane::{Hello, MODE_SEALED_DATA};

    /// The target's static key.
    fn target() -> StaticKey {
        StaticKey::from_seed([3; SEED])
    }

    /// The initiator's static key.
    fn me() -> StaticKey {
        StaticKey::from_seed([4; SEED])
    }

    fn opening(secret: &[u8], lane: &[u8]) -> (Initiator, Vec<u8>) {
        let psk = Psk::lane(secret, lane);
        let (i, first) =
            Initiator::start_keyed(&psk, &me(), &target().public(), [7; SEED], "t").unwrap();
        let mut b = SEALED_MAGIC.to_vec();
        b.extend_from_slice(&first);
        (i, b)
    }

    fn hello_record(s: &mut Session, mode: u8) -> Vec<u8> {
        let mut plain = vec![mode];
        plain.extend_from_slice(
            &Hello {
                name: "init",
                secret: [9; 16],
                epoch: 3,
            }
            .encode(),
        );
        let mut r = Vec::new();
        seal_record(s, &plain, &mut r);
        r
    }

    #[test]
    #[cfg_attr(miri, ignore = "X25519 takes minutes under Miri")]
    fn an_initiator_with_both_keys_opens_and_its_hello_comes_out_sealed() {
        let mut o = LaneOpening::new(Psk::lane(b"s", b"lane-1"), target(), [8; SEED], "i");
        let (i, first) = opening(b"s", b"lane-1");
        assert_eq!(o.want(), OPENING_LEN);
        assert_eq!(o.on_bytes(&first), Opened::More);
        let mut s = i.finish(&o.take_output()).unwrap();
        let rec = hello_record(&mut s, MODE_SEALED_DATA);
        assert!(
            !rec.windows(4).any(|w| w == b"init"),
            "the name travels sealed"
        );
        assert_eq!(o.on_bytes(&rec[..4]), Opened::More);
        assert_eq!(o.want(), rec.len() - 4);
        match o.on_bytes(&rec[4..]) {
            Opened::Hello { hello, mode, key } => {
                assert_eq!(mode, DataMode::Sealed);
                assert_eq!(key, me().public(), "the initiator's proven key comes out");
                assert_eq!(&hello[..4], b"KVXT");
            }
            other => panic!("{other:?}"),
        }
        // Both ends share the session: what the target seals, the initiator opens.
        let mut t = o.into_session().unwrap();
        let mut r = Vec::new();
        seal_record(&mut t, b"welcome", &mut r);
        assert_eq!(s.open(&r[4..]).unwrap(), b"welcome");
    }

    #[test]
    #[cfg_attr(miri, ignore = "X25519 takes minutes under Miri")]
    fn a_wrong_secret_lane_credential_or_plain_hello_is_refused_before_any_hello() {
        for (secret, lane) in [(&b"x"[..], &b"lane-1"[..]), (b"s", b"lane-2")] {
            let mut o = LaneOpening::new(Psk::lane(b"s", b"lane-1"), target(), [8; SEED], "i");
            let (_, first) = opening(secret, lane);
            assert!(matches!(o.on_bytes(&first), Opened::Refused(_)));
            assert!(o.take_output().is_empty(), "nothing answers a failed proof");
            assert_eq!(o.want(), 0);
        }
        // An initiator that takes another key for the target's.
        let mut o = LaneOpening::new(Psk::lane(b"s", b"lane-1"), target(), [8; SEED], "i");
        let (_, first) = Initiator::start_keyed(
            &Psk::lane(b"s", b"lane-1"),
            &me(),
            &me().public(),
            [7; SEED],
            "t",
        )
        .unwrap();
        let mut b = SEALED_MAGIC.to_vec();
        b.extend_from_slice(&first);
        assert!(matches!(o.on_bytes(&b), Opened::Refused(_)));
        // A side-channel handshake under the same secret is not a lane's.
        let mut o = LaneOpening::new(Psk::lane(b"s", b"lane-1"), target(), [8; SEED], "i");
        let (_, hs) = Initiator::start(&Psk::side_channel(b"s"), [7; SEED], "t").unwrap();
        let mut b = SEALED_MAGIC.to_vec();
        b.extend_from_slice(&hs);
        b.resize(OPENING_LEN, 0);
        assert!(matches!(o.on_bytes(&b), Opened::Refused(_)));
        // The plain hello of an initiator without a secret.
        let mut o = LaneOpening::new(Psk::lane(b"s", b"lane-1"), target(), [8; SEED], "i");
        let mut plain = Hello {
            name: "init",
            secret: [9; 16],
            epoch: 0,
        }
        .encode();
        plain.resize(OPENING_LEN, 0);
        assert!(matches!(o.on_bytes(&plain), Opened::Refused(_)));
    }

    #[test]
    #[cfg_attr(miri, ignore = "X25519 takes minutes under Miri")]
    fn a_changed_oversized_or_unknown_mode_first_record_is_refused() {
        let run = |edit: &dyn Fn(&mut Vec<u8>), mode: u8| {
            let mut o = LaneOpening::new(Psk::lane(b"s", b"l"), target(), [8; SEED], "i");
            let (i, first) = opening(b"s", b"l");
            o.on_bytes(&first);
            let mut s = i.finish(&o.take_output()).unwrap();
            let mut rec = hello_record(&mut s, mode);
            edit(&mut rec);
            match o.on_bytes(&rec[..4]) {
                Opened::More => o.on_bytes(&rec[4..]),
                r => r,
            }
        };
        assert!(matches!(run(&|r| r[9] ^= 1, 0), Opened::Refused(_)));
        assert!(matches!(
            run(&|r| r[..4].copy_from_slice(&u32::MAX.to_le_bytes()), 0),
            Opened::Refused(_)
        ));
        assert!(matches!(run(&|_| {}, 7), Opened::Refused(_)));
        assert!(matches!(
            run(&|_| {}, 0),
            Opened::Hello {
                mode: DataMode::Clear,
                ..
            }
        ));
    }

    proptest::proptest! {
        #[test]
        #[cfg_attr(miri, ignore = "X25519 takes minutes under Miri")]
        fn an_opening_never_panics(chunks in proptest::collection::vec(
            proptest::collection::vec(proptest::prelude::any::<u8>(), 0..80), 0..4)) {
            let mut o = LaneOpening::new(Psk::lane(b"s", b"l"), target(), [8; SEED], "i");
            for c in chunks {
                let _ = o.on_bytes(&c);
            }
        }
    }
}
