//! Metadata exchange over a TCP side channel; no server needed. This file is the connecting
//! end; the listening end is `listener` (the handshake in `kvxfer_proto::acceptor`).
//!
//! Frames (`kvxfer_proto::wire::side_channel`) are `u32 length (LE) | u8 kind | payload`. The
//! connecting agent sends `HELLO(metadata)`; the listener decodes it (strictly, compatibility
//! hash first), loads it, and answers `META(its metadata)`, or `ERROR(text)` and closes.
//! Every read has a timeout, so a silent or slow peer cannot hold a thread forever.
//!
//! With a shared secret (`AgentConfig::secret`) a Noise handshake bound to it comes first
//! (`kvxfer_proto::session`), and the metadata both ways (region table, keys, lane
//! credentials) and any refusal are sealed under the session it makes:
//!
//! ```text
//! client: NOISE1(psk, e)            listener: NOISE2(e, ee)
//! client: HELLO(sealed metadata)    listener: META(sealed metadata) or ERROR(sealed text)
//! ```
//!
//! A listener with a secret refuses a plain HELLO; a client with a secret refuses a listener
//! that cannot answer the handshake, and any sealed frame that fails to open.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use crate::side_channel::SideChannel;
use crate::subscriptions::Subscriptions;

use kvxfer_proto::error::{Error, Result};
use kvxfer_proto::session::{Initiator, Psk, SEED};
use kvxfer_proto::updates::Updates;
use kvxfer_proto::wire::metadata::Metadata;
use kvxfer_proto::wire::side_channel::{
    check_preamble, encode_frame, read_frame, ERROR, HELLO, META, NOISE1, NOISE2, PREAMBLE,
};

/// Connects to `addr`, sends our metadata, loads the peer's, and keeps the connection for
/// updates both ways. Returns the peer's name. Each step (the connection, every read and
/// write) waits at most `timeout` ([`crate::AgentConfig::handshake_timeout`]).
pub(crate) fn exchange(
    shared: &Arc<SideChannel>,
    subs: &Arc<Subscriptions>,
    addr: SocketAddr,
    timeout: Duration,
) -> Result<String> {
    let who = addr.to_string();
    let mut s = TcpStream::connect_timeout(&addr, timeout)
        .map_err(|e| Error::io(format!("connecting to {who}"), e))?;
    setup(&s, &who, timeout)?;
    preamble(&mut s, &who, timeout)?;
    let mut session = None;
    if let Some(secret) = &shared.secret {
        let (init, first) = Initiator::start(
            &Psk::side_channel(secret),
            crate::random::bytes::<SEED>()?,
            &who,
        )?;
        write_frame(&mut s, NOISE1, &first)?;
        let (kind, p) = read_frame(&mut s, &who).map_err(|e| waited(e, &who, timeout))?;
        match kind {
            NOISE2 => session = Some(init.finish(&p)?),
            ERROR => return Err(refusal(shared, &who, &p)),
            k => {
                return Err(Error::Auth {
                    peer: who,
                    why: format!("frame kind {k}, expected the handshake's answer"),
                })
            }
        }
    }
    let generation = subs.generation();
    let mine = (shared.local)()?;
    let hello = match session.as_mut() {
        Some(session) => session.seal(&mine),
        None => mine,
    };
    write_frame(&mut s, HELLO, &hello)?;
    let (kind, payload) = read_frame(&mut s, &who).map_err(|e| waited(e, &who, timeout))?;
    let payload = match session.as_mut() {
        Some(session) => session.open(&payload)?,
        None => payload,
    };
    match kind {
        META => {
            let meta =
                Metadata::decode(&payload, shared.compat).map_err(|err| Error::Metadata {
                    source_desc: who.clone(),
                    err,
                })?;
            let epoch = meta.epoch;
            let name = (shared.on_peer)(meta)?;
            let updates = Updates::new(&who, &name, epoch, shared.compat, session);
            subs.keep(shared, s, updates, generation, timeout);
            Ok(name)
        }
        ERROR => Err(refusal(shared, &who, &payload)),
        k => Err(Error::Protocol {
            peer: who,
            why: format!("frame kind {k}, expected META"),
        }),
    }
}

/// The listener's refusal (`text`, opened when sealed) as a typed error: authentication,
/// a name taken by a live agent, or a protocol refusal.
fn refusal(shared: &SideChannel, who: &str, text: &[u8]) -> Error {
    let why = String::from_utf8_lossy(text).into_owned();
    if why.contains("authentication") || why.contains("shared secret") || why.contains("handshake")
    {
        Error::Auth {
            peer: who.to_string(),
            why: format!("listener refused: {why}"),
        }
    } else if let Some(rest) = why.split_once("is taken by a live agent: ") {
        // The listener already holds another live agent of this agent's name.
        Error::NameConflict {
            name: rest
                .0
                .trim_start_matches("agent name ")
                .trim()
                .trim_matches('"')
                .to_string(),
            why: format!("{} (the listener {who} refused this agent)", rest.1),
        }
    } else if let Some((agent, rest)) = why
        .strip_prefix("peer table of ")
        .and_then(|r| r.split_once(" is full: "))
    {
        // The listener's peer table is full and none of its peers was idle.
        Error::PeerLimit {
            agent: agent.trim_matches('"').to_string(),
            why: format!("{rest} (the listener {who} refused this agent)"),
        }
    } else {
        let ours = if why.contains("no transport in common") {
            format!(
                "; that was the listener speaking: this connecting agent offers {:?}",
                shared.transport
            )
        } else {
            String::new()
        };
        Error::Protocol {
            peer: who.to_string(),
            why: format!("peer refused: {why}{ours}"),
        }
    }
}

/// Sends this side's preamble and checks the other's (both send first, so neither waits).
fn preamble(s: &mut TcpStream, who: &str, timeout: Duration) -> Result<()> {
    s.write_all(&PREAMBLE)
        .map_err(|e| Error::io(format!("writing the side-channel preamble to {who}"), e))?;
    let mut got = [0u8; PREAMBLE.len()];
    s.read_exact(&mut got).map_err(|e| {
        waited(
            Error::io(format!("reading the side-channel preamble from {who}"), e),
            who,
            timeout,
        )
    })?;
    check_preamble(&got, who)
}

/// A read that ran out of time says so, and after how long, instead of the OS's "Resource
/// temporarily unavailable"; a peer that closed says that.
fn waited(e: Error, who: &str, timeout: Duration) -> Error {
    match e {
        Error::Io { source, .. }
            if matches!(
                source.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            Error::Protocol {
                peer: who.to_string(),
                why: format!(
                    "timed out after {timeout:?} waiting for the side-channel handshake (the \
                     peer accepted and said nothing; AgentConfig::handshake_timeout sets how \
                     long)"
                ),
            }
        }
        Error::Io { source, .. } if source.kind() == std::io::ErrorKind::UnexpectedEof => {
            Error::Protocol {
                peer: who.to_string(),
                why: "closed the connection during the side-channel handshake".into(),
            }
        }
        e => e,
    }
}

fn setup(s: &TcpStream, who: &str, timeout: Duration) -> Result<()> {
    s.set_read_timeout(Some(timeout))
        .and_then(|_| s.set_write_timeout(Some(timeout)))
        .and_then(|_| s.set_nodelay(true))
        .map_err(|e| Error::io(format!("configuring socket to {who}"), e))
}

fn write_frame(s: &mut TcpStream, kind: u8, payload: &[u8]) -> Result<()> {
    s.write_all(&encode_frame(kind, payload))
        .map_err(|e| Error::io("writing a side-channel frame", e))
}
