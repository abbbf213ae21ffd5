//! The side channel's secure session: a Noise handshake bound to the shared secret, then
//! every message sealed under it.
//!
//! The pattern is `Noise_NNpsk0_25519_ChaChaPoly_BLAKE2s` through the maintained `snow`
//! crate: two ephemeral X25519 keys (forward secrecy) and a pre-shared key mixed in before
//! the first message, so that only a holder of the secret can make or answer a handshake.
//! The PSK is `HMAC-SHA256(secret, PSK_LABEL)`, which takes a secret of any length.
//!
//! ```text
//! initiator: NOISE1(psk, e)        responder: NOISE2(e, ee)
//! then each side's messages: seal() / open(), nonces counting per direction
//! ```
//!
//! A sealed message is `u32 plaintext length | plaintext`, cut into chunks of at most
//! [`CHUNK`] bytes, each sent as `u16 ciphertext length | ciphertext` (a Noise transport
//! message carries at most 65,535 bytes). The length inside the first chunk is authenticated,
//! so a message cut at a chunk boundary fails to open; every chunk spends one nonce, so a
//! replayed, reordered or foreign chunk fails too.
//!
//! The ephemeral key's randomness is the caller's (`seed`), so this stays pure and testable.

use crate::error::{Error, Result};

/// The side channel's Noise protocol name.
pub const NOISE_PARAMS: &str = "Noise_NNpsk0_25519_ChaChaPoly_BLAKE2s";
/// The TCP lane's Noise protocol name. IK: the initiator knows the target's static key (from
/// the metadata an authenticated channel delivered) and proves its own, which the target
/// finds under the name the hello gives; psk1: the first message fails without the secret.
/// AES-256-GCM, which ring runs at several GB/s a core where the CPU has AES instructions
/// (every x86-64 server and ARMv8 server core), for the bulk data
/// `AgentConfig::lane_encryption` seals.
pub const LANE_NOISE_PARAMS: &str = "Noise_IKpsk1_25519_AESGCM_BLAKE2s";
/// What the side channel's PSK is derived under (`HMAC-SHA256(secret, PSK_LABEL)`).
pub const PSK_LABEL: &[u8] = b"kvxfer side channel psk v3";
/// Bound into the handshake hash: a handshake of another protocol or version never matches.
pub const PROLOGUE: &[u8] = b"kvxfer side channel v3";
/// What a TCP lane's PSK is derived under (`HMAC-SHA256(secret, LANE_PSK_LABEL | lane
/// secret)`): the deployment's secret and the target incarnation's lane credential both.
pub const LANE_PSK_LABEL: &[u8] = b"kvxfer tcp lane psk v4";
/// The TCP lane's prologue: a side-channel handshake never completes on a lane, nor the
/// reverse.
pub const LANE_PROLOGUE: &[u8] = b"kvxfer tcp lane v4";
/// Bytes of randomness one handshake consumes (its ephemeral X25519 key).
pub const SEED: usize = 32;
/// Bytes of the first and of the second handshake message (an ephemeral key and a tag).
pub const HANDSHAKE_LEN: usize = 32 + TAG;
/// Bytes of an IK handshake's first message: the ephemeral key, the initiator's static key
/// sealed, and a tag.
pub const KEYED_FIRST_LEN: usize = 32 + 32 + TAG + TAG;
/// Bytes of an X25519 public key.
pub const PUBLIC_KEY_LEN: usize = 32;
/// Bytes of a ChaCha20-Poly1305 tag.
pub const TAG: usize = 16;
/// Largest ciphertext of one chunk (Noise's message limit).
pub const MAX_CHUNK: usize = 65_535;
/// Largest plaintext of one chunk.
pub const CHUNK: usize = MAX_CHUNK - TAG;
/// Bytes of a chunk's length prefix.
const CHUNK_LEN_BYTES: usize = 2;
/// Bytes of the plaintext length at the start of a sealed message.
const LEN_BYTES: usize = 4;

/// The sealed size of a `plain`-byte message.
pub const fn sealed_len(plain: usize) -> usize {
    let body = plain + LEN_BYTES;
    let chunks = body.div_ceil(CHUNK);
    body + chunks * (CHUNK_LEN_BYTES + TAG)
}

/// The randomness source snow asks for the ephemeral key: exactly the caller's seed, once.
struct SeededRandom {
    seed: [u8; SEED],
    used: usize,
}

impl snow::types::Random for SeededRandom {
    fn try_fill_bytes(&mut self, dest: &mut [u8]) -> std::result::Result<(), snow::Error> {
        let end = self.used + dest.len();
        if end > SEED {
            // More randomness than one handshake needs: refuse rather than repeat bytes.
            return Err(snow::Error::Rng);
        }
        dest.copy_from_slice(&self.seed[self.used..end]);
        self.used = end;
        Ok(())
    }
}

/// snow's primitives (ciphers from ring where it has them), with the caller's seed as the
/// only randomness. (snow asks `Send` of a resolver, not `Sync`: a `Cell` holds the seed
/// until the one request for it.)
struct SeededResolver {
    seed: std::cell::Cell<Option<[u8; SEED]>>,
}

impl snow::resolvers::CryptoResolver for SeededResolver {
    fn resolve_rng(&self) -> Option<Box<dyn snow::types::Random>> {
        let seed = self.seed.take()?;
        Some(Box::new(SeededRandom { seed, used: 0 }))
    }
    fn resolve_dh(&self, c: &snow::params::DHChoice) -> Option<Box<dyn snow::types::Dh>> {
        snow::resolvers::DefaultResolver.resolve_dh(c)
    }
    fn resolve_hash(&self, c: &snow::params::HashChoice) -> Option<Box<dyn snow::types::Hash>> {
        snow::resolvers::DefaultResolver.resolve_hash(c)
    }
    fn resolve_cipher(
        &self,
        c: &snow::params::CipherChoice,
    ) -> Option<Box<dyn snow::types::Cipher>> {
        // ring's ChaCha20-Poly1305 (BoringSSL's vectorised code) seals a 1 MiB lane record
        // several times faster than the portable one; Miri cannot run its assembly.
        #[cfg(not(miri))]
        if let Some(cipher) = snow::resolvers::RingResolver.resolve_cipher(c) {
            return Some(cipher);
        }
        snow::resolvers::DefaultResolver.resolve_cipher(c)
    }
}

/// An agent's static X25519 key for its TCP lane: the public half travels in its metadata
/// ([`crate::types::LaneInfo::key`]); a lane handshake proves the private half, so a lane
/// session's name is the one whose metadata carried that key, not a claim.
#[derive(Clone)]
pub struct StaticKey {
    private: [u8; SEED],
    public: [u8; PUBLIC_KEY_LEN],
}

impl std::fmt::Debug for StaticKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StaticKey")
            .field("public", &crate::wire::hex(&self.public))
            .finish_non_exhaustive()
    }
}

impl StaticKey {
    /// The key whose private half is `seed` (fresh randomness, the caller's).
    pub fn from_seed(seed: [u8; SEED]) -> StaticKey {
        use snow::resolvers::CryptoResolver;
        let mut dh = snow::resolvers::DefaultResolver
            .resolve_dh(&snow::params::DHChoice::Curve25519)
            .unwrap_or_else(|| unreachable!("snow always has X25519"));
        dh.set(&seed);
        let mut public = [0u8; PUBLIC_KEY_LEN];
        public.copy_from_slice(dh.pubkey());
        StaticKey {
            private: seed,
            public,
        }
    }

    /// The public half.
    pub fn public(&self) -> [u8; PUBLIC_KEY_LEN] {
        self.public
    }
}

/// What a handshake is for: its pre-shared key and its purpose (side channel or lane), which
/// gives the pattern, the prologue and where the key is mixed in. A handshake made for one
/// purpose (or another secret, or another lane credential) never completes as another.
#[derive(Clone)]
pub struct Psk {
    key: [u8; 32],
    /// A TCP lane's (IK, static keys) rather than the side channel's (NN).
    lane: bool,
}

impl std::fmt::Debug for Psk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Psk")
            .field("params", &self.params())
            .finish_non_exhaustive()
    }
}

impl Psk {
    /// The side channel's: `HMAC-SHA256(secret, PSK_LABEL)`.
    pub fn side_channel(secret: &[u8]) -> Psk {
        Psk {
            key: hmac(secret, &[PSK_LABEL]),
            lane: false,
        }
    }

    /// A TCP lane's towards the target whose lane credential is `lane_secret`:
    /// `HMAC-SHA256(secret, LANE_PSK_LABEL | lane_secret)`. Its handshakes take static keys
    /// ([`Initiator::start_keyed`], [`Session::respond_keyed`]).
    pub fn lane(secret: &[u8], lane_secret: &[u8]) -> Psk {
        Psk {
            key: hmac(secret, &[LANE_PSK_LABEL, lane_secret]),
            lane: true,
        }
    }

    /// The Noise protocol name.
    pub fn params(&self) -> &'static str {
        if self.lane {
            LANE_NOISE_PARAMS
        } else {
            NOISE_PARAMS
        }
    }

    fn prologue(&self) -> &'static [u8] {
        if self.lane {
            LANE_PROLOGUE
        } else {
            PROLOGUE
        }
    }

    /// Where the pattern mixes the key in: psk1 (IK) or psk0 (NN).
    fn psk_position(&self) -> u8 {
        u8::from(self.lane)
    }

    /// Bytes of its handshake's first message.
    pub fn first_len(&self) -> usize {
        if self.lane {
            KEYED_FIRST_LEN
        } else {
            HANDSHAKE_LEN
        }
    }
}

/// `HMAC-SHA256(key, parts...)`: every key kvxfer derives from the shared secret (Noise
/// PSKs, the handoff key, the etcd key) and every seal it makes over a handoff.
pub fn hmac(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    use hmac::Mac;
    hmac_state(key, parts).finalize().into_bytes().into()
}

/// The running `HMAC-SHA256(key, parts...)`, for a constant-time `verify_slice`.
pub(crate) fn hmac_state(key: &[u8], parts: &[&[u8]]) -> hmac::Hmac<sha2::Sha256> {
    use hmac::Mac;
    let mut m = <hmac::Hmac<sha2::Sha256> as Mac>::new_from_slice(key)
        .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
    for p in parts {
        m.update(p);
    }
    m
}

/// The static keys of a handshake: none (NN), this side's, and the responder's public key
/// where this side initiates an IK handshake.
#[derive(Clone, Copy, Default)]
struct Statics<'a> {
    local: Option<&'a StaticKey>,
    remote: Option<&'a [u8; PUBLIC_KEY_LEN]>,
}

fn builder_state(
    psk: &Psk,
    seed: [u8; SEED],
    initiator: bool,
    statics: Statics<'_>,
) -> Result<snow::HandshakeState> {
    let params: snow::params::NoiseParams = psk
        .params()
        .parse()
        .unwrap_or_else(|_| unreachable!("a valid Noise name"));
    let resolver = SeededResolver {
        seed: std::cell::Cell::new(Some(seed)),
    };
    let mut b = snow::Builder::with_resolver(params, Box::new(resolver))
        .prologue(psk.prologue())
        .and_then(|b| b.psk(psk.psk_position(), &psk.key))
        .map_err(|e| internal(&e))?;
    if let Some(k) = statics.local {
        b = b.local_private_key(&k.private).map_err(|e| internal(&e))?;
    }
    if let Some(r) = statics.remote {
        b = b.remote_public_key(r).map_err(|e| internal(&e))?;
    }
    if initiator {
        b.build_initiator()
    } else {
        b.build_responder()
    }
    .map_err(|e| internal(&e))
}

fn internal(e: &snow::Error) -> Error {
    Error::InvalidArgument(format!("the Noise handshake could not be set up: {e}"))
}

fn auth(who: &str, why: impl Into<String>) -> Error {
    Error::Auth {
        peer: who.to_string(),
        why: why.into(),
    }
}

/// The initiator's handshake between its first message and the answer.
pub struct Initiator {
    state: snow::HandshakeState,
    who: String,
}

impl std::fmt::Debug for Initiator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Initiator").field("who", &self.who).finish()
    }
}

impl Initiator {
    /// Starts a handshake with `who` (named in errors): the state and the first message.
    pub fn start(psk: &Psk, seed: [u8; SEED], who: &str) -> Result<(Initiator, Vec<u8>)> {
        Initiator::start_with(psk, seed, who, Statics::default())
    }

    /// Starts an IK handshake (a lane's) as `local`, with the responder whose static public
    /// key is `remote`.
    pub fn start_keyed(
        psk: &Psk,
        local: &StaticKey,
        remote: &[u8; PUBLIC_KEY_LEN],
        seed: [u8; SEED],
        who: &str,
    ) -> Result<(Initiator, Vec<u8>)> {
        let statics = Statics {
            local: Some(local),
            remote: Some(remote),
        };
        Initiator::start_with(psk, seed, who, statics)
    }

    fn start_with(
        psk: &Psk,
        seed: [u8; SEED],
        who: &str,
        statics: Statics<'_>,
    ) -> Result<(Initiator, Vec<u8>)> {
        let mut state = builder_state(psk, seed, true, statics)?;
        let mut msg = vec![0u8; psk.first_len()];
        let n = state
            .write_message(&[], &mut msg)
            .map_err(|e| internal(&e))?;
        msg.truncate(n);
        Ok((
            Initiator {
                state,
                who: who.to_string(),
            },
            msg,
        ))
    }

    /// The responder's answer: the session, or [`Error::Auth`] when the responder does not
    /// hold the secret (or the answer was changed on the way).
    pub fn finish(mut self, answer: &[u8]) -> Result<Session> {
        if answer.len() != HANDSHAKE_LEN {
            return Err(auth(
                &self.who,
                format!(
                    "a handshake answer of {} bytes, not {HANDSHAKE_LEN}",
                    answer.len()
                ),
            ));
        }
        let mut payload = [0u8; HANDSHAKE_LEN];
        self.state
            .read_message(answer, &mut payload)
            .map_err(|_| auth(&self.who, "the listener did not prove the shared secret"))?;
        Session::from_state(self.state, &self.who)
    }
}

/// An established session: seals what this side sends and opens what the other sent.
pub struct Session {
    transport: snow::TransportState,
    who: String,
    /// The first chunk's plaintext (the length, then the message's head), reused.
    first: Vec<u8>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("who", &self.who)
            .field("sent", &self.transport.sending_nonce())
            .field("received", &self.transport.receiving_nonce())
            .finish()
    }
}

impl Session {
    /// The responder's side: checks the initiator's first message (made with the same
    /// secret) and gives the session and the answer to send.
    pub fn respond(
        psk: &Psk,
        seed: [u8; SEED],
        first: &[u8],
        who: &str,
    ) -> Result<(Session, Vec<u8>)> {
        let (s, answer, _) = Session::respond_with(psk, seed, first, who, None)?;
        Ok((s, answer))
    }

    /// The responder's side of an IK handshake (a lane's) as `local`: also the static public
    /// key the initiator proved it holds.
    pub fn respond_keyed(
        psk: &Psk,
        local: &StaticKey,
        seed: [u8; SEED],
        first: &[u8],
        who: &str,
    ) -> Result<(Session, Vec<u8>, [u8; PUBLIC_KEY_LEN])> {
        let (s, answer, remote) = Session::respond_with(psk, seed, first, who, Some(local))?;
        let remote = remote.ok_or_else(|| auth(who, "no static key in the handshake"))?;
        Ok((s, answer, remote))
    }

    fn respond_with(
        psk: &Psk,
        seed: [u8; SEED],
        first: &[u8],
        who: &str,
        local: Option<&StaticKey>,
    ) -> Result<(Session, Vec<u8>, Option<[u8; PUBLIC_KEY_LEN]>)> {
        if first.len() != psk.first_len() {
            return Err(auth(
                who,
                format!(
                    "a handshake of {} bytes, not {}",
                    first.len(),
                    psk.first_len()
                ),
            ));
        }
        let statics = Statics {
            local,
            remote: None,
        };
        let mut state = builder_state(psk, seed, false, statics)?;
        let mut payload = [0u8; KEYED_FIRST_LEN];
        state
            .read_message(first, &mut payload)
            .map_err(|_| auth(who, "the peer did not prove the shared secret"))?;
        let remote = state
            .get_remote_static()
            .and_then(|r| <[u8; PUBLIC_KEY_LEN]>::try_from(r).ok());
        let mut answer = vec![0u8; HANDSHAKE_LEN];
        let n = state
            .write_message(&[], &mut answer)
            .map_err(|e| internal(&e))?;
        answer.truncate(n);
        Ok((Session::from_state(state, who)?, answer, remote))
    }

    fn from_state(state: snow::HandshakeState, who: &str) -> Result<Session> {
        Ok(Session {
            transport: state.into_transport_mode().map_err(|e| internal(&e))?,
            who: who.to_string(),
            first: Vec::new(),
        })
    }

    /// `plain`, sealed under the session ([`sealed_len`] bytes).
    pub fn seal(&mut self, plain: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(sealed_len(plain.len()));
        self.seal_into(plain, &mut out);
        out
    }

    /// Appends `plain`, sealed under the session, to `out`.
    pub fn seal_into(&mut self, plain: &[u8], out: &mut Vec<u8>) {
        let at = out.len();
        out.resize(at + sealed_len(plain.len()), 0);
        self.seal_to(plain, &mut out[at..]);
    }

    /// Seals `plain` into the first [`sealed_len`] bytes of `out`, which is at least that
    /// long (a buffer the caller reuses: nothing is cleared or zeroed per message). Returns
    /// the bytes written.
    pub fn seal_to(&mut self, plain: &[u8], out: &mut [u8]) -> usize {
        // The first chunk carries the length ahead of the plaintext; the rest are slices of it.
        let head = plain.len().min(CHUNK - LEN_BYTES);
        self.first.clear();
        self.first
            .extend_from_slice(&(plain.len() as u32).to_le_bytes());
        self.first.extend_from_slice(&plain[..head]);
        let (first, transport) = (&self.first, &mut self.transport);
        let mut at = 0;
        for chunk in std::iter::once(&first[..]).chain(plain[head..].chunks(CHUNK)) {
            let n = transport
                .write_message(chunk, &mut out[at + CHUNK_LEN_BYTES..])
                .unwrap_or_else(|e| unreachable!("a chunk within Noise's limit: {e}"));
            out[at..at + CHUNK_LEN_BYTES].copy_from_slice(&(n as u16).to_le_bytes());
            at += CHUNK_LEN_BYTES + n;
        }
        at
    }

    /// The plaintext of a message the other side sealed; [`Error::Auth`] when it was changed,
    /// cut, replayed, reordered or sealed under another session.
    pub fn open(&mut self, sealed: &[u8]) -> Result<Vec<u8>> {
        let mut out = vec![0u8; sealed.len()];
        let r = self.open_to(sealed, &mut out)?;
        out.truncate(r.end);
        Ok(out.split_off(r.start))
    }

    /// Opens `sealed` into `out`, which is at least `sealed.len()` long (a buffer the caller
    /// reuses): the plaintext is `out[returned range]`. On an error what `out` holds is
    /// unauthenticated and must not be used.
    pub fn open_to(&mut self, mut sealed: &[u8], out: &mut [u8]) -> Result<std::ops::Range<usize>> {
        let (who, transport) = (&self.who, &mut self.transport);
        let bad = |why: &str| {
            auth(
                who,
                format!("a sealed message failed its authentication ({why})"),
            )
        };
        let mut at = 0;
        while !sealed.is_empty() {
            if sealed.len() < CHUNK_LEN_BYTES {
                return Err(bad("a cut chunk header"));
            }
            let n = u16::from_le_bytes([sealed[0], sealed[1]]) as usize;
            let rest = &sealed[CHUNK_LEN_BYTES..];
            if n < TAG || n > rest.len() {
                return Err(bad("a chunk length past the message"));
            }
            let m = transport
                .read_message(&rest[..n], &mut out[at..])
                .map_err(|_| bad("a chunk did not decrypt"))?;
            at += m;
            sealed = &rest[n..];
        }
        // The length, authenticated with the first chunk, says whether chunks were cut off.
        match out[..at].get(..LEN_BYTES) {
            Some(l) if u32::from_le_bytes([l[0], l[1], l[2], l[3]]) as usize + LEN_BYTES == at => {
                Ok(LEN_BYTES..at)
            }
            _ => Err(bad("cut short, or longer than its length")),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn pair(a: &[u8], b: &[u8]) -> Result<(Session, Session)> {
        let (i, first) = Initiator::start(&Psk::side_channel(a), [1; SEED], "r")?;
        let (r, answer) = Session::respond(&Psk::side_channel(b), [2; SEED], &first, "i")?;
        Ok((i.finish(&answer)?, r))
    }

    #[test]
    #[cfg_attr(miri, ignore = "X25519 takes minutes under Miri")]
    fn messages_cross_both_ways_and_any_change_fails() {
        let (mut i, mut r) = pair(b"s", b"s").unwrap();
        for len in [0, 1, CHUNK - LEN_BYTES, CHUNK, 3 * CHUNK + 7] {
            let m: Vec<u8> = (0..len).map(|x| x as u8).collect();
            let s = i.seal(&m);
            assert_eq!(s.len(), sealed_len(len));
            assert_eq!(r.open(&s).unwrap(), m);
            let s = r.seal(&m);
            assert_eq!(i.open(&s).unwrap(), m);
        }
        // A flipped byte, anywhere.
        let s = pair(b"s", b"s").unwrap().0.seal(b"metadata");
        for at in 0..s.len() {
            let (mut i2, mut r2) = pair(b"s", b"s").unwrap();
            let mut t = i2.seal(b"metadata");
            assert_eq!(t, s, "same seeds, same bytes");
            t[at] ^= 1;
            assert!(matches!(r2.open(&t), Err(Error::Auth { .. })), "byte {at}");
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "X25519 takes minutes under Miri")]
    fn replayed_reordered_cut_and_foreign_messages_fail() {
        let (mut i, mut r) = pair(b"s", b"s").unwrap();
        let a = i.seal(b"first");
        let b = i.seal(b"second");
        assert_eq!(r.open(&a).unwrap(), b"first");
        assert!(r.open(&a).is_err(), "replayed");
        let (mut i, mut r) = pair(b"s", b"s").unwrap();
        let a = i.seal(b"first");
        let b2 = i.seal(b"second");
        assert!(r.open(&b2).is_err(), "reordered");
        let _ = (a, b);
        // Cut at a chunk boundary: the length inside the first chunk says so.
        let (mut i, mut r) = pair(b"s", b"s").unwrap();
        let big = vec![7u8; 2 * CHUNK];
        let s = i.seal(&big);
        let first_chunk = CHUNK_LEN_BYTES + MAX_CHUNK;
        assert!(r.open(&s[..first_chunk]).is_err(), "cut");
        // Sealed under another session (same secret).
        let (mut i2, _) = pair(b"s", b"s").unwrap();
        let (_, mut r3) = {
            let (ii, first) = Initiator::start(&Psk::side_channel(b"s"), [5; SEED], "r").unwrap();
            let (rr, answer) =
                Session::respond(&Psk::side_channel(b"s"), [6; SEED], &first, "i").unwrap();
            (ii.finish(&answer).unwrap(), rr)
        };
        assert!(r3.open(&i2.seal(b"x")).is_err(), "foreign session");
        assert!(r3.open(&[]).is_err(), "empty");
    }

    #[test]
    #[cfg_attr(miri, ignore = "X25519 takes minutes under Miri")]
    fn a_wrong_secret_fails_on_either_side() {
        let (_, first) = Initiator::start(&Psk::side_channel(b"right"), [1; SEED], "r").unwrap();
        let e = Session::respond(&Psk::side_channel(b"wrong"), [2; SEED], &first, "i").unwrap_err();
        assert!(e.to_string().contains("did not prove"), "{e}");
        // A responder that answers with another secret (a relay making its own answer).
        let (i, _first) = Initiator::start(&Psk::side_channel(b"right"), [1; SEED], "r").unwrap();
        let (_, other) = Initiator::start(&Psk::side_channel(b"wrong"), [3; SEED], "x").unwrap();
        let (_, answer) =
            Session::respond(&Psk::side_channel(b"wrong"), [2; SEED], &other, "i").unwrap();
        let e = i.finish(&answer).unwrap_err();
        assert!(e.to_string().contains("did not prove"), "{e}");
        // A replayed first message gets an answer its sender can never use: a relay that
        // replays it learns nothing it can open, and a second answer differs.
        let (_, first) = Initiator::start(&Psk::side_channel(b"s"), [1; SEED], "r").unwrap();
        let (_, a1) = Session::respond(&Psk::side_channel(b"s"), [2; SEED], &first, "i").unwrap();
        let (_, a2) = Session::respond(&Psk::side_channel(b"s"), [4; SEED], &first, "i").unwrap();
        assert_ne!(a1, a2);
        assert!(Session::respond(&Psk::side_channel(b"s"), [2; SEED], &first[..10], "i").is_err());
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
        #[test]
        #[cfg_attr(miri, ignore = "X25519 takes minutes under Miri")]
        fn open_never_panics(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512)) {
            let (_, mut r) = pair(b"s", b"s").unwrap();
            proptest::prop_assert!(r.open(&bytes).is_err());
            proptest::prop_assert!(Session::respond(&Psk::side_channel(b"s"), [0; SEED], &bytes, "f").is_err() || bytes.len() == HANDSHAKE_LEN);
        }
    }
}
