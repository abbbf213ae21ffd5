//! The listening end of the side-channel handshake as a state machine, with no I/O: the
//! shell reads exactly [`SideChannelAcceptor::want`] bytes at a time and passes them in,
//! sends what [`SideChannelAcceptor::take_output`] gives, and, once a client's HELLO has
//! arrived (and, with a shared secret, opened under the Noise session its handshake made),
//! loads the metadata and gives the answer back, sealed under that session. The clock is the
//! caller's: [`SideChannelAcceptor::expired`] says when the whole handshake ran past its
//! deadline, however the bytes trickled in; so is the randomness (the ephemeral key's seed).
//!
//! Frames are those of [`crate::wire::side_channel`], the session [`crate::session`].

use std::time::Duration;

use crate::error::Error;
use crate::session::{Psk, Session, HANDSHAKE_LEN, SEED};
use crate::wire::side_channel::{
    check_preamble, encode_frame, ERROR, FRAME_HEADER_LEN, HELLO, LEN_BYTES, MAX_FRAME, META,
    NOISE1, NOISE2, PREAMBLE,
};

/// What the shell does after [`SideChannelAcceptor::on_bytes`].
#[derive(Debug)]
pub enum Step {
    /// Read `want()` bytes more.
    More,
    /// The client's metadata (opened under the session, with a secret): load it, then
    /// [`SideChannelAcceptor::answer`].
    Hello(Vec<u8>),
    /// The client was refused (an ERROR frame is queued for it): send the output, close.
    Refused(Error),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    Preamble,
    Header,
    Payload {
        kind: u8,
        len: usize,
    },
    /// The HELLO was handed to the shell; waiting for its answer.
    Loading,
    Done,
}

/// One accepted connection's handshake.
#[derive(Debug)]
pub struct SideChannelAcceptor {
    who: String,
    /// The secret and the ephemeral key's seed, until the client's handshake uses them.
    secret: Option<(Vec<u8>, [u8; SEED])>,
    /// The session, once the handshake is done.
    session: Option<Session>,
    state: State,
    out: Vec<u8>,
    deadline: Duration,
}

impl SideChannelAcceptor {
    /// A connection from `who` accepted at `now`, to finish its handshake by `now + limit`;
    /// `seed` fresh from a random source (the listener's ephemeral key, used with a secret).
    /// Its preamble is queued.
    pub fn new(
        who: &str,
        secret: Option<&[u8]>,
        seed: [u8; SEED],
        now: Duration,
        limit: Duration,
    ) -> SideChannelAcceptor {
        SideChannelAcceptor {
            who: who.to_string(),
            secret: secret.map(|s| (s.to_vec(), seed)),
            session: None,
            state: State::Preamble,
            out: PREAMBLE.to_vec(),
            deadline: now + limit,
        }
    }

    /// Bytes the shell reads next (exactly); 0 when it reads nothing more.
    pub fn want(&self) -> usize {
        match &self.state {
            State::Preamble => PREAMBLE.len(),
            State::Header => FRAME_HEADER_LEN,
            State::Payload { len, .. } => *len,
            State::Loading | State::Done => 0,
        }
    }

    /// Whether the handshake ran past its deadline at `now` (while it still waits on the
    /// client).
    pub fn expired(&self, now: Duration) -> bool {
        !matches!(self.state, State::Loading | State::Done) && now >= self.deadline
    }

    /// Bytes to send to the client now.
    pub fn take_output(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.out)
    }

    /// Whether the handshake is over (refused or answered): close once the output is sent.
    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// The `want()` bytes the shell read.
    pub fn on_bytes(&mut self, b: &[u8]) -> Step {
        if b.len() != self.want() {
            return self.refuse(
                "internal",
                Error::InvalidArgument(format!("{} bytes given, {} wanted", b.len(), self.want())),
            );
        }
        match self.state.clone() {
            State::Preamble => {
                let mut got = [0u8; PREAMBLE.len()];
                got.copy_from_slice(b);
                if let Err(e) = check_preamble(&got, &self.who) {
                    // Not a kvxfer client: nothing it would read; close.
                    self.state = State::Done;
                    return Step::Refused(e);
                }
                self.state = State::Header;
                Step::More
            }
            State::Header => {
                let len = u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize;
                if len == 0 || len > MAX_FRAME {
                    let e = self.protocol(format!("frame of {len} bytes (limit {MAX_FRAME})"));
                    return self.refuse("bad frame", e);
                }
                let kind = b[LEN_BYTES];
                // Refuse what cannot be right before reading its payload.
                let secured = self.secret.is_some() || self.session.is_some();
                match (secured, self.session.is_some(), kind) {
                    (true, false, NOISE1) if len - 1 == HANDSHAKE_LEN => {}
                    (true, false, NOISE1) => {
                        let e = self.auth("a handshake message of the wrong size");
                        return self.refuse("bad handshake", e);
                    }
                    (true, false, _) => {
                        let e = self.auth("the peer sent no authentication");
                        return self.refuse("authentication required", e);
                    }
                    (true, true, HELLO) if len > 1 => {}
                    (true, true, k) => {
                        let e = self.protocol(format!("frame kind {k}, expected HELLO"));
                        return self.refuse("expected HELLO", e);
                    }
                    (false, _, NOISE1) => {
                        let e =
                            self.auth("the peer wants a shared secret this agent does not have");
                        return self.refuse("this agent has no shared secret", e);
                    }
                    (false, _, HELLO) => {}
                    (false, _, k) => {
                        let e = self.protocol(format!("frame kind {k}, expected HELLO"));
                        return self.refuse("expected HELLO", e);
                    }
                }
                if len == 1 {
                    // An empty HELLO (no secret): no metadata to decode; the loader says so.
                    return self.payload(kind, &[]);
                }
                self.state = State::Payload { kind, len: len - 1 };
                Step::More
            }
            State::Payload { kind, .. } => self.payload(kind, b),
            State::Loading | State::Done => Step::More,
        }
    }

    fn payload(&mut self, kind: u8, p: &[u8]) -> Step {
        if kind == NOISE1 {
            let Some((secret, seed)) = self.secret.take() else {
                let e = self.protocol("a second handshake".into());
                return self.refuse("expected HELLO", e);
            };
            return match Session::respond(&Psk::side_channel(&secret), seed, p, &self.who) {
                Ok((session, answer)) => {
                    self.out.extend_from_slice(&encode_frame(NOISE2, &answer));
                    self.session = Some(session);
                    self.state = State::Header;
                    Step::More
                }
                Err(e) => self.refuse("authentication failed", e),
            };
        }
        let hello = match self.session.as_mut() {
            Some(session) => match session.open(p) {
                Ok(m) => m,
                Err(e) => return self.refuse("authentication failed", e),
            },
            None => p.to_vec(),
        };
        self.state = State::Loading;
        Step::Hello(hello)
    }

    /// The shell's answer to [`Step::Hello`]: this agent's metadata, or why the client's was
    /// refused (sent to it as text).
    pub fn answer(&mut self, r: std::result::Result<Vec<u8>, String>) {
        if self.state != State::Loading {
            return;
        }
        let (kind, body) = match r {
            Ok(meta) => (META, meta),
            Err(why) => (ERROR, why.into_bytes()),
        };
        self.send(kind, &body);
        self.state = State::Done;
    }

    /// The session the handshake made (with a secret), once the answer is taken: the
    /// connection's later frames ([`crate::updates`]) are sealed under it. `None` without a
    /// secret, or before the handshake is done.
    pub fn into_session(self) -> Option<Session> {
        match self.state {
            State::Done => self.session,
            _ => None,
        }
    }

    /// Queues a frame, sealed once a session exists.
    fn send(&mut self, kind: u8, body: &[u8]) {
        let f = match self.session.as_mut() {
            Some(session) => encode_frame(kind, &session.seal(body)),
            None => encode_frame(kind, body),
        };
        self.out.extend_from_slice(&f);
    }

    fn refuse(&mut self, text: &str, e: Error) -> Step {
        self.send(ERROR, text.as_bytes());
        self.state = State::Done;
        Step::Refused(e)
    }

    fn auth(&self, why: &str) -> Error {
        Error::Auth {
            peer: self.who.clone(),
            why: why.to_string(),
        }
    }

    fn protocol(&self, why: String) -> Error {
        Error::protocol(&self.who, why)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    use crate::error::Result;
    use crate::wire::side_channel::read_frame;

    const LIMIT: Duration = Duration::from_secs(5);

    /// The client's side, for tests of the shell: the bytes a client sends for `meta` (after a
    /// preamble), without a secret.
    fn plain_hello(meta: &[u8]) -> Vec<u8> {
        let mut b = PREAMBLE.to_vec();
        b.extend_from_slice(&encode_frame(HELLO, meta));
        b
    }

    /// Reads frames from `b` (after a preamble): for tests.
    fn split_frames(mut b: &[u8]) -> Result<Vec<(u8, Vec<u8>)>> {
        let mut v = Vec::new();
        if b.starts_with(&PREAMBLE) {
            b = &b[PREAMBLE.len()..];
        }
        while !b.is_empty() {
            v.push(read_frame(&mut b, "test")?);
        }
        Ok(v)
    }

    /// Feeds `bytes` the way the shell does (exactly `want()` at a time); the steps.
    fn feed(a: &mut SideChannelAcceptor, mut bytes: &[u8]) -> Vec<Step> {
        let mut steps = Vec::new();
        while a.want() > 0 && bytes.len() >= a.want() {
            let n = a.want();
            steps.push(a.on_bytes(&bytes[..n]));
            bytes = &bytes[n..];
        }
        steps
    }

    #[test]
    fn a_plain_hello_is_handed_over_and_answered() {
        let mut a = SideChannelAcceptor::new("c", None, [1; SEED], Duration::ZERO, LIMIT);
        assert_eq!(a.take_output(), PREAMBLE);
        let steps = feed(&mut a, &plain_hello(b"their metadata"));
        assert!(
            matches!(steps.last(), Some(Step::Hello(m)) if m == b"their metadata"),
            "{steps:?}"
        );
        assert_eq!(a.want(), 0);
        assert!(!a.expired(LIMIT * 2), "loading is the shell's time");
        a.answer(Ok(b"mine".to_vec()));
        assert!(a.is_done());
        assert_eq!(
            split_frames(&a.take_output()).unwrap(),
            [(META, b"mine".to_vec())]
        );
    }

    /// The client's handshake through the acceptor: the client's session, or the acceptor's
    /// refusal.
    fn handshake(a: &mut SideChannelAcceptor, client_secret: &[u8]) -> Option<Session> {
        let (init, first) = crate::session::Initiator::start(
            &crate::session::Psk::side_channel(client_secret),
            [3; SEED],
            "l",
        )
        .unwrap();
        let mut b = PREAMBLE.to_vec();
        b.extend_from_slice(&encode_frame(NOISE1, &first));
        let steps = feed(a, &b);
        let out = split_frames(&a.take_output()).unwrap();
        match steps.last() {
            Some(Step::More) => {
                assert_eq!(out[0].0, NOISE2);
                Some(init.finish(&out[0].1).unwrap())
            }
            Some(Step::Refused(Error::Auth { .. })) => {
                assert_eq!(out, [(ERROR, b"authentication failed".to_vec())]);
                None
            }
            s => panic!("{s:?}"),
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "X25519 takes minutes under Miri")]
    fn with_a_secret_everything_after_the_handshake_is_sealed() {
        let secret = b"s3cret";
        let mut a = SideChannelAcceptor::new("c", Some(secret), [2; SEED], Duration::ZERO, LIMIT);
        let mut client = handshake(&mut a, secret).unwrap();
        let sealed = client.seal(b"meta");
        let steps = feed(&mut a, &encode_frame(HELLO, &sealed));
        assert!(
            matches!(steps.last(), Some(Step::Hello(m)) if m == b"meta"),
            "{steps:?}"
        );
        a.answer(Ok(b"mine".to_vec()));
        let out = split_frames(&a.take_output()).unwrap();
        assert_eq!(out[0].0, META);
        assert_ne!(out[0].1, b"mine", "sealed, not in the clear");
        assert_eq!(client.open(&out[0].1).unwrap(), b"mine");

        // A wrong secret: refused at the handshake, nothing sealed sent.
        let mut a = SideChannelAcceptor::new("c", Some(secret), [2; SEED], Duration::ZERO, LIMIT);
        assert!(handshake(&mut a, b"guess").is_none());
        assert!(a.is_done());

        // A changed HELLO: refused, the refusal sealed.
        let mut a = SideChannelAcceptor::new("c", Some(secret), [2; SEED], Duration::ZERO, LIMIT);
        let mut client = handshake(&mut a, secret).unwrap();
        let mut sealed = client.seal(b"meta");
        sealed[5] ^= 1;
        let steps = feed(&mut a, &encode_frame(HELLO, &sealed));
        assert!(
            matches!(steps.last(), Some(Step::Refused(Error::Auth { .. }))),
            "{steps:?}"
        );
        let out = split_frames(&a.take_output()).unwrap();
        assert_eq!(client.open(&out[0].1).unwrap(), b"authentication failed");

        // A plain HELLO after the handshake is not a sealed one.
        let mut a = SideChannelAcceptor::new("c", Some(secret), [2; SEED], Duration::ZERO, LIMIT);
        handshake(&mut a, secret).unwrap();
        let steps = feed(&mut a, &encode_frame(HELLO, b"plain metadata"));
        assert!(matches!(
            steps.last(),
            Some(Step::Refused(Error::Auth { .. }))
        ));
    }

    #[test]
    fn what_cannot_be_right_is_refused_before_its_payload() {
        type Case<'a> = (Option<&'a [u8]>, Vec<u8>, &'a str);
        let cases: [Case<'_>; 6] = [
            (
                None,
                b"GET / HTTP/1.1\r\n".to_vec(),
                "not a kvxfer side channel",
            ),
            (None, [0xff; FRAME_HEADER_LEN].to_vec(), "limit"),
            (None, encode_frame(META, b"x"), "expected HELLO"),
            (Some(b"s"), encode_frame(HELLO, b"x"), "no authentication"),
            (Some(b"s"), encode_frame(NOISE1, &[0; 10]), "wrong size"),
            (
                None,
                encode_frame(NOISE1, &[0; HANDSHAKE_LEN]),
                "shared secret this agent does not have",
            ),
        ];
        for (secret, bytes, says) in cases {
            let mut a = SideChannelAcceptor::new("c", secret, [0; SEED], Duration::ZERO, LIMIT);
            let mut b = PREAMBLE.to_vec();
            if bytes.starts_with(b"GET") {
                b = bytes.clone();
            } else {
                b.extend_from_slice(&bytes);
            }
            // Only the header is needed to refuse.
            let steps = feed(&mut a, &b[..b.len().min(PREAMBLE.len() + FRAME_HEADER_LEN)]);
            match steps.last() {
                Some(Step::Refused(e)) => assert!(e.to_string().contains(says), "{e}"),
                s => panic!("{says}: {s:?}"),
            }
            assert!(a.is_done() && a.want() == 0);
        }
    }

    #[test]
    fn the_deadline_counts_the_whole_handshake() {
        let mut a = SideChannelAcceptor::new("c", None, [0; SEED], Duration::from_secs(1), LIMIT);
        let b = plain_hello(b"m");
        // One byte a second would never finish: the deadline is from the accept.
        feed(&mut a, &b[..PREAMBLE.len()]);
        assert!(!a.expired(Duration::from_secs(5)));
        assert!(a.expired(Duration::from_secs(6)));
    }

    proptest::proptest! {
        #[test]
        fn any_bytes_end_in_a_step_never_a_panic(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..256),
            secret in proptest::prelude::any::<bool>(),
        ) {
            let s: Option<&[u8]> = if secret { Some(b"k") } else { None };
            let mut a = SideChannelAcceptor::new("fuzz", s, [9; SEED], Duration::ZERO, LIMIT);
            let mut b = PREAMBLE.to_vec();
            b.extend_from_slice(&bytes);
            for step in feed(&mut a, &b) {
                if let Step::Hello(_) = step {
                    a.answer(Err("no".into()));
                }
            }
            let _ = a.take_output();
        }
    }
}
