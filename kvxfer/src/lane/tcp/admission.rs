//! A TCP lane connection at the gate: the target's core fed the hello (out of the sealed
//! opening with a secret) until the hello proved the lane secret, the name is the one whose
//! key the handshake proved, and the data mode is one this target takes. Only then does the
//! connection get a serving thread (`server.rs`).
#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::identities::{Identities, Key};
use crate::gate::{Admission, Verdict};
use kvxfer_proto::lane::{LaneTarget, TargetEvent};
use kvxfer_proto::lane_seal::{seal_record, LaneOpening, Opened};
use kvxfer_proto::wire::lane::DataMode;

/// An initiator's hello, from its accept to its proof of the lane secret (a real peer sends
/// it at once; a silent or trickling client is dropped after this).
pub(super) const HELLO_DEADLINE: Duration = Duration::from_secs(5);

/// A connection at the gate until its hello proved the lane secret: the target's core, fed
/// the hello, then handed to a serving thread as it is. With a shared secret the hello comes
/// out of a sealed opening ([`LaneOpening`]), and the session goes to the serving thread too.
pub(super) struct Hello {
    pub(super) t: LaneTarget,
    /// The core's clock.
    pub(super) t0: Instant,
    /// With a shared secret: the Noise opening the hello must come through.
    pub(super) opening: Option<LaneOpening>,
    /// How the initiator moves the data (its opening's mode).
    pub(super) mode: DataMode,
    /// With a secret: the static key the initiator proved.
    pub(super) proved: Option<Key>,
    /// Whose key each name is.
    pub(super) ids: Arc<Identities>,
    /// This target takes only initiators that seal the data ([`crate::AgentConfig::lane_encryption`]).
    pub(super) require_sealed_data: bool,
}

impl Hello {
    /// Feeds the opened hello to the core, as the core asks for its parts.
    fn feed(&mut self, mut hello: &[u8]) -> Verdict {
        while let Some(n) = self.t.want().filter(|_| self.t.peer().is_none()) {
            if n > hello.len() {
                break;
            }
            self.t.on_bytes(&hello[..n], self.t0.elapsed());
            hello = &hello[n..];
            if self.t.is_closed() {
                return Verdict::Refuse("a bad hello or a wrong lane secret".into());
            }
        }
        let Some(peer) = self.t.peer().filter(|_| hello.is_empty()) else {
            self.t.refuse("a sealed hello of the wrong length");
            return Verdict::Refuse("a sealed hello of the wrong length".into());
        };
        // The name is the one whose metadata carried the key the handshake proved.
        if let Some(key) = &self.proved {
            if let Err(why) = self.ids.check(peer, key) {
                self.t.refuse(&why);
                return Verdict::Refuse(why);
            }
        }
        if self.require_sealed_data && self.mode != DataMode::Sealed {
            let why = "this target takes only sealed data (lane_encryption): set it on the \
                       initiator too";
            self.t.refuse(why);
            return Verdict::Refuse(why.into());
        }
        Verdict::Admit
    }
}

impl Admission for Hello {
    fn want(&self) -> usize {
        if let Some(o) = self.opening.as_ref().filter(|o| o.want() > 0) {
            return o.want();
        }
        if self.opening.as_ref().is_some_and(LaneOpening::is_closed) {
            return 0;
        }
        if self.t.peer().is_some() || self.t.is_closed() || self.opening.is_some() {
            return 0;
        }
        self.t.want().unwrap_or(0)
    }

    fn on_bytes(&mut self, b: &[u8], _now: Duration) -> Verdict {
        if let Some(o) = self.opening.as_mut() {
            return match o.on_bytes(b) {
                Opened::More => Verdict::More,
                Opened::Refused(why) => Verdict::Refuse(why),
                Opened::Hello { hello, mode, key } => {
                    self.mode = mode;
                    self.proved = Some(key);
                    self.feed(&hello)
                }
            };
        }
        self.t.on_bytes(b, self.t0.elapsed());
        if self.t.peer().is_some() {
            // The welcome stays queued for the serving thread.
            return Verdict::Admit;
        }
        if self.t.is_closed() {
            return Verdict::Refuse("a bad hello or a wrong lane secret".into());
        }
        Verdict::More
    }

    fn take_output(&mut self) -> Vec<u8> {
        let mut out = self
            .opening
            .as_mut()
            .map(LaneOpening::take_output)
            .unwrap_or_default();
        // Before it is admitted the core only speaks to refuse: its welcome with the reason
        // (sealed, once there is a session).
        if self.t.is_closed() {
            let plain = self.opening.is_none();
            while let Some(ev) = self.t.poll_event() {
                if let TargetEvent::Transmit(b) = ev {
                    match self.opening.as_mut().and_then(LaneOpening::session) {
                        Some(s) => seal_record(s, &b, &mut out),
                        None if plain => out.extend_from_slice(&b),
                        None => {}
                    }
                }
            }
        }
        out
    }

    fn expired(&self, _now: Duration) -> bool {
        self.t.peer().is_none() && self.t0.elapsed() > HELLO_DEADLINE
    }
}
