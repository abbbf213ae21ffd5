//! Whether the incarnation a piece of metadata describes is alive, asked of its TCP lane. With a
//! shared secret the answer is a proof: the lane's sealed opening (`Noise_IKpsk1`) against the
//! static key that incarnation's metadata carries completes only if the answering process holds
//! that key's private half, which was drawn for that incarnation and never leaves it. So a
//! port that merely accepts connections (another process listening where an old incarnation
//! listened, or a squatter an etcd writer pointed a forged value at) is not taken for it.
//! Without a secret nothing can be proven: a connection accepted at the address is all there is
//! (SECURITY.md says what that lets an etcd writer or a network peer do).

use std::net::TcpStream;
use std::time::{Duration, Instant};

use super::stream::{recv_buf, send_buf, set_timeouts, Stop};
use kvxfer_proto::session::{Initiator, Psk, StaticKey, HANDSHAKE_LEN, SEED};
use kvxfer_proto::types::LaneInfo;
use kvxfer_proto::wire::lane::SEALED_MAGIC;

/// Whether the holder of `lane` answers as the incarnation that advertised it, within
/// `timeout`: with `secret`, by completing the sealed opening against `lane.key` (the proof);
/// without, by accepting a connection.
pub(crate) fn answers_as(lane: &LaneInfo, secret: Option<&[u8]>, timeout: Duration) -> bool {
    let Ok(sock) = TcpStream::connect_timeout(&lane.addr, timeout) else {
        return false;
    };
    let Some(secret) = secret else {
        return true;
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
    let t0 = Instant::now();
    let mut ctl = |_moved: bool| -> Result<(), Stop> {
        if t0.elapsed() > timeout {
            Err(Stop::Eof)
        } else {
            Ok(())
        }
    };
    let mut opening = SEALED_MAGIC.to_vec();
    opening.extend_from_slice(&first);
    let io = |s: Stop| match s {
        Stop::Io(e) => e.to_string(),
        Stop::Eof => "no answer".to_string(),
        Stop::Abort(e) => e.to_string(),
    };
    send_buf(sock, &opening, &mut ctl).map_err(io)?;
    let mut answer = [0u8; HANDSHAKE_LEN];
    recv_buf(sock, &mut answer, &mut ctl).map_err(io)?;
    init.finish(&answer).map(|_| ()).map_err(|e| e.to_string())
}
