//! The side channel after its handshake, with no I/O. Both ends keep the connection, and each
//! sends its metadata again (an [`UPDATE`] frame, sealed under the handshake's session with a
//! secret) whenever it registers a region, so that a region registered after `connect` reaches
//! the peers connected already, as the etcd path publishes it. An update is taken only as the
//! agent the handshake loaded: the same name and incarnation, from this connection; a
//! restart or another name takes a handshake of its own.
//!
//! A deregistration is fenced over the same connection: the owner sends [`GONE`] with the
//! region's id, the peer stops using it, waits for what it has in flight to the owner, and
//! answers [`GONE_ACK`]; the owner's `deregister` returns once every kept peer answered
//! (UCX's emulated RMA checks no key on the target, so only the peer can stop its own puts).

use crate::error::{Error, Result};
use crate::session::Session;
use crate::wire::metadata::Metadata;
use crate::wire::side_channel::{encode_frame, GONE, GONE_ACK, UPDATE};

/// What a kept connection's frame carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Pushed {
    /// The peer's metadata again: its regions changed.
    Metadata(Metadata),
    /// The peer deregisters its region of this id: stop using it and answer.
    Gone(u32),
    /// The peer no longer touches this agent's region of this id.
    GoneAck(u32),
}

/// One connection's update phase, as either end holds it.
#[derive(Debug)]
pub struct Updates {
    /// Where the connection goes, for errors.
    who: String,
    /// The agent the handshake loaded, and its incarnation.
    peer: String,
    epoch: u64,
    /// The compatibility hash its metadata must carry.
    compat: u64,
    /// The handshake's session (with a secret).
    session: Option<Session>,
}

impl Updates {
    /// The phase after a handshake with `who` that loaded the agent `peer` of incarnation
    /// `epoch`, under `session` (with a secret).
    pub fn new(
        who: &str,
        peer: &str,
        epoch: u64,
        compat: u64,
        session: Option<Session>,
    ) -> Updates {
        Updates {
            who: who.to_string(),
            peer: peer.to_string(),
            epoch,
            compat,
            session,
        }
    }

    /// The agent on the other end.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// The frame that carries this agent's encoded metadata `meta`.
    pub fn frame(&mut self, meta: &[u8]) -> Vec<u8> {
        match self.session.as_mut() {
            Some(s) => encode_frame(UPDATE, &s.seal(meta)),
            None => encode_frame(UPDATE, meta),
        }
    }

    /// The frame that tells the peer this agent deregisters region `id`.
    pub fn gone_frame(&mut self, id: u32) -> Vec<u8> {
        self.frame_of(GONE, &id.to_le_bytes())
    }

    /// The frame that answers the peer's [`GONE`] of region `id`.
    pub fn ack_frame(&mut self, id: u32) -> Vec<u8> {
        self.frame_of(GONE_ACK, &id.to_le_bytes())
    }

    fn frame_of(&mut self, kind: u8, plain: &[u8]) -> Vec<u8> {
        match self.session.as_mut() {
            Some(s) => encode_frame(kind, &s.seal(plain)),
            None => encode_frame(kind, plain),
        }
    }

    /// The peer's frame of `kind`, opened (with a secret): its metadata (decoded strictly and
    /// checked to be the agent this connection loaded), or a deregistration or its answer.
    /// Any error ends the connection.
    pub fn on_frame(&mut self, kind: u8, payload: &[u8]) -> Result<Pushed> {
        if ![UPDATE, GONE, GONE_ACK].contains(&kind) {
            return Err(Error::protocol(
                &self.who,
                format!("frame kind {kind}, expected UPDATE, GONE or GONE_ACK"),
            ));
        }
        let opened;
        let plain = match self.session.as_mut() {
            Some(s) => {
                opened = s.open(payload)?;
                &opened[..]
            }
            None => payload,
        };
        if kind != UPDATE {
            let id = <[u8; 4]>::try_from(plain)
                .map(u32::from_le_bytes)
                .map_err(|_| {
                    Error::protocol(&self.who, format!("a {}-byte region id", plain.len()))
                })?;
            return Ok(if kind == GONE {
                Pushed::Gone(id)
            } else {
                Pushed::GoneAck(id)
            });
        }
        let meta = Metadata::decode(plain, self.compat).map_err(|err| Error::Metadata {
            source_desc: format!("{} (update)", self.who),
            err,
        })?;
        if meta.name != self.peer || meta.epoch != self.epoch {
            return Err(Error::protocol(
                &self.who,
                format!(
                    "an update names agent {:?} epoch {:#018x}; this connection loaded {:?} epoch \
                 {:#018x} (another agent or a restart takes a handshake of its own)",
                    meta.name, meta.epoch, self.peer, self.epoch
                ),
            ));
        }
        Ok(Pushed::Metadata(meta))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::{Initiator, Psk, SEED};
    use crate::types::{MemKind, RegionId};
    use crate::wire::metadata::RegionMeta;
    use crate::wire::side_channel::read_frame;

    const COMPAT: u64 = 42;

    fn meta(name: &str, epoch: u64, regions: u32) -> Metadata {
        Metadata {
            name: name.into(),
            compat: COMPAT,
            worker_addr: vec![1, 2, 3],
            epoch,
            host: None,
            lanes: Vec::new(),
            regions: (0..regions)
                .map(|i| RegionMeta {
                    id: RegionId(i),
                    kind: MemKind::Host,
                    base: 0x1000 * u64::from(i + 1),
                    len: 4096,
                    rkey: vec![i as u8; 8],
                    shm: None,
                })
                .collect(),
        }
    }

    /// Both ends of a connection whose handshake loaded agent "a" epoch 7, sealed.
    fn sealed_pair() -> (Updates, Updates) {
        let psk = Psk::side_channel(b"s");
        let (init, first) = Initiator::start(&psk, [1; SEED], "l").unwrap();
        let (resp, answer) = Session::respond(&psk, [2; SEED], &first, "c").unwrap();
        let client = init.finish(&answer).unwrap();
        (
            Updates::new("l", "me", 0, COMPAT, Some(client)),
            Updates::new("c", "a", 7, COMPAT, Some(resp)),
        )
    }

    /// The one frame `f` holds.
    fn one(f: &[u8]) -> (u8, Vec<u8>) {
        read_frame(&mut &f[..], "test").unwrap()
    }

    #[test]
    fn an_update_of_the_loaded_agent_is_taken_and_another_is_refused() {
        let mut tx = Updates::new("l", "me", 0, COMPAT, None);
        let mut rx = Updates::new("c", "a", 7, COMPAT, None);
        let grown = meta("a", 7, 3);
        let (k, p) = one(&tx.frame(&grown.encode()));
        assert_eq!(rx.on_frame(k, &p).unwrap(), Pushed::Metadata(grown));
        for (bad, what) in [
            (meta("b", 7, 3), "another name"),
            (meta("a", 8, 3), "another incarnation"),
        ] {
            let (k, p) = one(&tx.frame(&bad.encode()));
            let e = rx.on_frame(k, &p).unwrap_err();
            assert!(matches!(e, Error::Protocol { .. }), "{what}: {e}");
        }
        let e = rx
            .on_frame(crate::wire::side_channel::META, &p)
            .unwrap_err();
        assert!(matches!(e, Error::Protocol { .. }), "{e}");
        let mut other = meta("a", 7, 1);
        other.compat = COMPAT + 1;
        let (k, p) = one(&tx.frame(&other.encode()));
        assert!(matches!(rx.on_frame(k, &p), Err(Error::Metadata { .. })));
    }

    #[test]
    #[cfg_attr(miri, ignore = "X25519 takes minutes under Miri")]
    fn a_sealed_update_opens_only_under_its_session_and_in_order() {
        let (mut tx, mut rx) = sealed_pair();
        let m = meta("a", 7, 2);
        let f1 = one(&tx.frame(&m.encode()));
        let f2 = one(&tx.frame(&meta("a", 7, 3).encode()));
        assert_ne!(f1.1, m.encode(), "sealed");
        assert_eq!(rx.on_frame(f1.0, &f1.1).unwrap(), Pushed::Metadata(m));
        // Replayed or tampered: refused.
        assert!(matches!(rx.on_frame(f1.0, &f1.1), Err(Error::Auth { .. })));
        let mut t = f2.1.clone();
        t[3] ^= 1;
        assert!(rx.on_frame(f2.0, &t).is_err());
    }

    #[test]
    #[cfg_attr(miri, ignore = "X25519 takes minutes under Miri")]
    fn deregistrations_and_their_answers_travel_sealed_and_in_order() {
        let (mut tx, mut rx) = sealed_pair();
        let g = one(&tx.gone_frame(7));
        let a = one(&tx.ack_frame(9));
        assert_eq!(rx.on_frame(g.0, &g.1).unwrap(), Pushed::Gone(7));
        assert!(rx.on_frame(g.0, &g.1).is_err(), "a replayed GONE");
        assert_eq!(rx.on_frame(a.0, &a.1).unwrap(), Pushed::GoneAck(9));
        // In the clear, a region id is exactly four bytes.
        let mut plain = Updates::new("c", "a", 7, COMPAT, None);
        let (k, _) = one(&Updates::new("l", "me", 0, COMPAT, None).gone_frame(3));
        assert_eq!(
            plain.on_frame(k, &3u32.to_le_bytes()).unwrap(),
            Pushed::Gone(3)
        );
        assert!(matches!(
            plain.on_frame(k, &[1, 2, 3]),
            Err(Error::Protocol { .. })
        ));
        assert!(plain.on_frame(99, &[0; 4]).is_err());
    }

    #[test]
    fn metadata_extends_only_by_regions_appended_to_the_same_incarnation() {
        let old = meta("a", 7, 2);
        assert!(meta("a", 7, 3).extends(&old));
        assert!(!old.extends(&old), "nothing new");
        assert!(!meta("a", 7, 1).extends(&old), "a region went");
        assert!(!meta("a", 8, 3).extends(&old), "a restart");
        let mut moved = meta("a", 7, 3);
        moved.regions[0].base += 1;
        assert!(!moved.extends(&old), "a region changed");
        let mut w = meta("a", 7, 3);
        w.worker_addr.push(9);
        assert!(!w.extends(&old), "another worker");
    }
}
