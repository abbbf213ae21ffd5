//! The listening end of the side-channel handshake as a state machine, with no I/O: the
//! shell reads exactly [`SideChannelAcceptor::want`] bytes at a time and passes them in,
//! sends what [`SideChannelAcceptor::take_output`] gives, and, once a client's HELLO has
//! arrived (and, with a shared secret, its proof checked), loads the metadata and gives the
//! answer back. The clock is the caller's: [`SideChannelAcceptor::expired`] says when the
//! whole handshake ran past its deadline, however the bytes trickled in.
//!
//! Frames and proofs are those of [`crate::wire::side_channel`].

use std::time::Duration;

use crate::error::Error;
use crate::wire::side_channel::{
    check_preamble, encode_frame, mac, mac_ok, AUTH1, AUTH2, ERROR, FRAME_HEADER_LEN, HELLO,
    LEN_BYTES, MAC, MAX_FRAME, META, NONCE, PREAMBLE, ROLE_CLIENT, ROLE_SERVER,
};

/// What the shell does after [`SideChannelAcceptor::on_bytes`].
#[derive(Debug)]
pub enum Step {
    /// Read `want()` bytes more.
    More,
    /// The client's metadata (its proof checked): load it, then [`SideChannelAcceptor::answer`].
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
    secret: Option<Vec<u8>>,
    /// The listener's nonce (used with a secret).
    nonce: [u8; NONCE],
    /// The client's nonce, once its AUTH1 came.
    client_nonce: Option<[u8; NONCE]>,
    state: State,
    out: Vec<u8>,
    deadline: Duration,
}

impl SideChannelAcceptor {
    /// A connection from `who` accepted at `now`, to finish its handshake by `now + limit`;
    /// `nonce` fresh from a random source (the listener's half of the proof). Its preamble is
    /// queued.
    pub fn new(
        who: &str,
        secret: Option<&[u8]>,
        nonce: [u8; NONCE],
        now: Duration,
        limit: Duration,
    ) -> SideChannelAcceptor {
        SideChannelAcceptor {
            who: who.to_string(),
            secret: secret.map(<[u8]>::to_vec),
            nonce,
            client_nonce: None,
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
                match (&self.secret, self.client_nonce, kind) {
                    (Some(_), None, AUTH1) if len - 1 == NONCE => {}
                    (Some(_), None, AUTH1) => {
                        return self.refuse("bad AUTH1", self.auth("AUTH1 of the wrong size"))
                    }
                    (Some(_), None, _) => {
                        return self.refuse(
                            "authentication required",
                            self.auth("the peer sent no authentication"),
                        )
                    }
                    (Some(_), Some(_), HELLO) if len > MAC => {}
                    (Some(_), Some(_), _) => {
                        return self.refuse(
                            "authentication failed",
                            self.auth("the peer did not prove the shared secret"),
                        )
                    }
                    (None, _, AUTH1) => {
                        return self.refuse(
                            "this agent has no shared secret",
                            self.auth("the peer wants a shared secret this agent does not have"),
                        )
                    }
                    (None, _, HELLO) => {}
                    (None, _, k) => {
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
        match (self.secret.clone(), self.client_nonce, kind) {
            (Some(secret), None, AUTH1) => {
                let mut nc = [0u8; NONCE];
                nc.copy_from_slice(p);
                self.client_nonce = Some(nc);
                let mut m = self.nonce.to_vec();
                m.extend_from_slice(&mac(&secret, ROLE_SERVER, &nc, &self.nonce));
                self.out.extend_from_slice(&encode_frame(AUTH2, &m));
                self.state = State::Header;
                Step::More
            }
            (Some(secret), Some(nc), HELLO) => {
                if !mac_ok(&secret, ROLE_CLIENT, &self.nonce, &nc, &p[..MAC]) {
                    return self.refuse(
                        "authentication failed",
                        self.auth("the peer did not prove the shared secret"),
                    );
                }
                self.state = State::Loading;
                Step::Hello(p[MAC..].to_vec())
            }
            _ => {
                self.state = State::Loading;
                Step::Hello(p.to_vec())
            }
        }
    }

    /// The shell's answer to [`Step::Hello`]: this agent's metadata, or why the client's was
    /// refused (sent to it as text).
    pub fn answer(&mut self, r: std::result::Result<Vec<u8>, String>) {
        if self.state != State::Loading {
            return;
        }
        let f = match r {
            Ok(meta) => encode_frame(META, &meta),
            Err(why) => encode_frame(ERROR, why.as_bytes()),
        };
        self.out.extend_from_slice(&f);
        self.state = State::Done;
    }

    fn refuse(&mut self, text: &str, e: Error) -> Step {
        self.out
            .extend_from_slice(&encode_frame(ERROR, text.as_bytes()));
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
        Error::Protocol {
            peer: self.who.clone(),
            why,
        }
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
        let mut a = SideChannelAcceptor::new("c", None, [1; NONCE], Duration::ZERO, LIMIT);
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

    #[test]
    fn with_a_secret_both_proofs_are_checked() {
        let secret = b"s3cret";
        let mut a = SideChannelAcceptor::new("c", Some(secret), [2; NONCE], Duration::ZERO, LIMIT);
        a.take_output();
        let nc = [3u8; NONCE];
        let mut b = PREAMBLE.to_vec();
        b.extend_from_slice(&encode_frame(AUTH1, &nc));
        assert!(feed(&mut a, &b).iter().all(|s| matches!(s, Step::More)));
        let f = split_frames(&a.take_output()).unwrap();
        assert_eq!(f[0].0, AUTH2);
        let (ns, m) = f[0].1.split_at(NONCE);
        assert!(mac_ok(secret, ROLE_SERVER, &nc, ns, m));
        let mut hello = mac(secret, ROLE_CLIENT, ns, &nc).to_vec();
        hello.extend_from_slice(b"meta");
        let steps = feed(&mut a, &encode_frame(HELLO, &hello));
        assert!(
            matches!(steps.last(), Some(Step::Hello(m)) if m == b"meta"),
            "{steps:?}"
        );

        // A wrong proof.
        let mut a = SideChannelAcceptor::new("c", Some(secret), [2; NONCE], Duration::ZERO, LIMIT);
        feed(&mut a, &b);
        let mut bad = [0u8; MAC].to_vec();
        bad.extend_from_slice(b"meta");
        let steps = feed(&mut a, &encode_frame(HELLO, &bad));
        assert!(
            matches!(steps.last(), Some(Step::Refused(Error::Auth { .. }))),
            "{steps:?}"
        );
        assert!(a.is_done());
    }

    #[test]
    fn what_cannot_be_right_is_refused_before_its_payload() {
        type Case<'a> = (Option<&'a [u8]>, Vec<u8>, &'a str);
        let cases: [Case<'_>; 5] = [
            (
                None,
                b"GET / HTTP/1.1\r\n".to_vec(),
                "not a kvxfer side channel",
            ),
            (None, [0xff; FRAME_HEADER_LEN].to_vec(), "limit"),
            (None, encode_frame(META, b"x"), "expected HELLO"),
            (Some(b"s"), encode_frame(HELLO, b"x"), "no authentication"),
            (
                None,
                encode_frame(AUTH1, &[0; NONCE]),
                "shared secret this agent does not have",
            ),
        ];
        for (secret, bytes, says) in cases {
            let mut a = SideChannelAcceptor::new("c", secret, [0; NONCE], Duration::ZERO, LIMIT);
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
        let mut a = SideChannelAcceptor::new("c", None, [0; NONCE], Duration::from_secs(1), LIMIT);
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
            let mut a = SideChannelAcceptor::new("fuzz", s, [9; NONCE], Duration::ZERO, LIMIT);
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
