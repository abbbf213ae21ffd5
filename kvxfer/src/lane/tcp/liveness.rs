//! Whether the incarnation a piece of metadata describes is alive, asked of its TCP lane. With a
//! shared secret the answer is a proof: the lane's sealed opening (`Noise_IKpsk1`) against the
//! static key that incarnation's metadata carries completes only if the answering process holds
//! that key's private half, which was drawn for that incarnation and never leaves it. So a
//! port that merely accepts connections (another process listening where an old incarnation
//! listened, or a squatter an etcd writer pointed a forged value at) is not taken for it.
//! Without a secret nothing can be proven, but the lane's open hello with the credential that
//! incarnation's metadata carries must be welcomed: a port another process reuses (a restarted
//! agent's side channel, say) does not pass for it. A network peer that read the credential can
//! still answer for it (SECURITY.md says what that lets an etcd writer or a network peer do).

use std::net::TcpStream;
use std::time::{Duration, Instant};

use super::stream::{recv_buf, send_buf, set_timeouts, Stop};
use kvxfer_proto::session::{Initiator, Psk, StaticKey, HANDSHAKE_LEN, SEED};
use kvxfer_proto::types::LaneInfo;
use kvxfer_proto::wire::lane::{
    parse_welcome, Hello, SEALED_MAGIC, WELCOME_FIXED_LEN, W_FENCED, W_OK,
};

/// Whether the holder of `lane` answers as the incarnation that advertised it, within
/// `timeout`: with `secret`, by completing the sealed opening against `lane.key` (the proof);
/// without, by welcoming an open hello (as `me`) that presents `lane.secret`.
pub(crate) fn answers_as(
    lane: &LaneInfo,
    secret: Option<&[u8]>,
    me: &str,
    timeout: Duration,
) -> bool {
    let Ok(sock) = TcpStream::connect_timeout(&lane.addr, timeout) else {
        return false;
    };
    let Some(secret) = secret else {
        return match welcomed(&sock, lane, me, timeout) {
            Ok(()) => true,
            Err(why) => {
                log::info!(
                    "kvxfer: {} accepts connections but did not welcome the lane credential \
                     its metadata names: {why}",
                    lane.addr
                );
                false
            }
        };
    };
    match prove(&sock, lane, secret, timeout) {
        Ok(()) => true,
        Err(why) => {
            log::info!(
                "kvxfer: {} accepts connections but did not prove it holds the lane key its \
                 metadata names: {why}",
                lane.addr
            );
            false
        }
    }
}

/// The stream control that stops a question once `timeout` has passed since `t0`.
fn within(t0: Instant, timeout: Duration) -> impl FnMut(bool) -> Result<(), Stop> {
    move |_moved| {
        if t0.elapsed() > timeout {
            Err(Stop::Eof)
        } else {
            Ok(())
        }
    }
}

/// Why a question's I/O stopped, in words.
fn said(s: Stop) -> String {
    match s {
        Stop::Io(e) => e.to_string(),
        Stop::Eof => "no answer".to_string(),
        Stop::Abort(e) => e.to_string(),
    }
}

/// An open hello presenting `lane.secret`, and the welcome read: the credential accepted
/// (welcomed, or told a fence count, which only follows an accepted credential).
fn welcomed(sock: &TcpStream, lane: &LaneInfo, me: &str, timeout: Duration) -> Result<(), String> {
    set_timeouts(sock).map_err(|e| e.to_string())?;
    let mut ctl = within(Instant::now(), timeout);
    let hello = Hello {
        name: me,
        secret: lane.secret,
        epoch: 0,
    }
    .encode();
    send_buf(sock, &hello, &mut ctl).map_err(said)?;
    let mut w = [0u8; WELCOME_FIXED_LEN];
    recv_buf(sock, &mut w, &mut ctl).map_err(said)?;
    match parse_welcome(&w).0 {
        W_OK | W_FENCED => Ok(()),
        s => Err(format!("welcome status {s}")),
    }
}

/// The first half of a sealed opening, and the holder's answer checked.
fn prove(
    sock: &TcpStream,
    lane: &LaneInfo,
    secret: &[u8],
    timeout: Duration,
) -> Result<(), String> {
    set_timeouts(sock).map_err(|e| e.to_string())?;
    let psk = Psk::lane(secret, &lane.secret);
    // A key of its own for this one question: the answer proves the holder's key, not ours.
    let me = StaticKey::from_seed(crate::random::bytes().map_err(|e| e.to_string())?);
    let seed: [u8; SEED] = crate::random::bytes().map_err(|e| e.to_string())?;
    let who = lane.addr.to_string();
    let (init, first) =
        Initiator::start_keyed(&psk, &me, &lane.key, seed, &who).map_err(|e| e.to_string())?;
    let mut ctl = within(Instant::now(), timeout);
    let mut opening = SEALED_MAGIC.to_vec();
    opening.extend_from_slice(&first);
    send_buf(sock, &opening, &mut ctl).map_err(said)?;
    let mut answer = [0u8; HANDSHAKE_LEN];
    recv_buf(sock, &mut answer, &mut ctl).map_err(said)?;
    init.finish(&answer).map(|_| ()).map_err(|e| e.to_string())
}
