//! A request's data over the stream whatever its memory and its form: host pieces straight
//! from and into memory, device pieces through staging chunks, each raw or as compressed
//! frames.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::conn::Conn;
use super::framed::{recv_frames, send_frames, FramesFailed};
use super::stream::{Ctl, Stop, TICK};
use crate::staging::pool::{ChunkPair, DeviceStaging};
use kvxfer_proto::compress::codec::CodecTally;
use kvxfer_proto::compress::planes::Transform;
use kvxfer_proto::error::Error;
use kvxfer_proto::paged::{ResolvedPaged, Windows, WINDOW_BLOCKS};

/// The data travels as frames split by `transform`; `peer` names the sender in errors.
#[derive(Clone, Copy, Debug)]
pub(super) struct Framing<'a> {
    pub(super) transform: Transform,
    pub(super) peer: &'a str,
    /// Threads coding a sent stream.
    pub(super) threads: usize,
}

/// Host pieces, raw or framed.
///
/// # Safety
/// Every piece is host memory valid for this direction until the call returns.
unsafe fn host(
    s: &Conn,
    send: bool,
    pieces: &[(u64, u64)],
    framing: Option<Framing<'_>>,
    fence: Option<&AtomicBool>,
    ctl: &mut Ctl<'_>,
) -> Result<CodecTally, FramesFailed> {
    match framing {
        // SAFETY: the pieces are valid host memory for this direction (this function's
        // contract).
        None => unsafe { s.pieces(send, pieces, fence, ctl) }
            .map(|()| CodecTally::default())
            .map_err(FramesFailed::Stop),
        Some(f) if send => {
            // SAFETY: as above; readable, since this side sends.
            unsafe { send_frames(s, pieces, f.transform, f.threads, fence, ctl) }
                .map_err(FramesFailed::Stop)
        }
        // SAFETY: as above; writable, since this side receives.
        Some(f) => unsafe { recv_frames(s, pieces, f.peer, fence, ctl) },
    }
}

/// Like [`Conn::pieces`], with pieces of device memory (`devs[k]` is the device of piece k,
/// `devs` empty: all host) moved through the two staging chunks of `stage`, and the data as
/// frames where `framing` says so. Returns what the codec did (nothing when raw).
///
/// A frame that fails its check in host memory leaves the stream in step
/// ([`FramesFailed::Corrupt`] counts the raw bytes still to come); one in a staging chunk
/// ends the connection.
///
/// # Safety
/// Every piece is valid memory of its kind (host, or device `devs[k]`) for this direction,
/// pinned against deregistration, until the call returns.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn stream_mixed(
    s: &Conn,
    send: bool,
    pieces: &[(u64, u64)],
    devs: &[Option<u32>],
    stage: Option<(&DeviceStaging, &ChunkPair<'_>)>,
    framing: Option<Framing<'_>>,
    fence: Option<&AtomicBool>,
    ctl: &mut Ctl<'_>,
) -> Result<CodecTally, FramesFailed> {
    if devs.iter().all(Option::is_none) {
        // SAFETY: all pieces are host memory (no device), valid per this function's contract.
        return unsafe { host(s, send, pieces, framing, fence, ctl) };
    }
    let mut tally = CodecTally::default();
    let mut i = 0;
    while i < pieces.len() {
        let d = devs[i];
        let mut j = i + 1;
        while j < pieces.len() && devs[j] == d {
            j += 1;
        }
        match (d, stage) {
            (None, _) => {
                // SAFETY: host pieces, valid per this function's contract.
                match unsafe { host(s, send, &pieces[i..j], framing, fence, ctl) } {
                    Ok(t) => tally.add(&t),
                    Err(FramesFailed::Corrupt { left, error }) => {
                        let later: u64 = pieces[j..].iter().map(|p| p.1).sum();
                        return Err(FramesFailed::Corrupt {
                            left: left + later,
                            error,
                        });
                    }
                    Err(e) => return Err(e),
                }
            }
            (Some(_), None) => {
                return Err(FramesFailed::Stop(Stop::Abort(Error::InvalidArgument(
                    "device memory without staging chunks".into(),
                ))))
            }
            (Some(dev), Some((st, pair))) => {
                let mut stop: Option<Stop> = None;
                let mut net = |buf: &mut [u8]| {
                    let piece = [(buf.as_mut_ptr() as u64, buf.len() as u64)];
                    let r = if fence.is_some_and(|f| f.load(Ordering::Acquire)) {
                        Err(Stop::Abort(Error::Canceled))
                    } else {
                        match framing {
                            None if send => s.send_data(buf, ctl),
                            None => s.recv_data(buf, ctl),
                            // SAFETY: the staging chunk is a buffer this closure borrows
                            // mutably for the call.
                            Some(_) => match unsafe { host(s, send, &piece, framing, None, ctl) } {
                                Ok(t) => {
                                    tally.add(&t);
                                    Ok(())
                                }
                                Err(FramesFailed::Stop(e)) => Err(e),
                                Err(FramesFailed::Corrupt { error, .. }) => {
                                    Err(Stop::Abort(Error::Frame {
                                        peer: framing.map(|f| f.peer).unwrap_or("").to_string(),
                                        source: error,
                                    }))
                                }
                            },
                        }
                    };
                    r.map_err(|e| {
                        stop = Some(e);
                        Error::Canceled
                    })
                };
                let engine = st.engine().as_ref();
                // SAFETY: these pieces are device memory of `dev` (this function's contract).
                let r = unsafe {
                    crate::staging::pipeline::stream_device(
                        engine,
                        dev,
                        pair,
                        send,
                        &pieces[i..j],
                        &mut net,
                    )
                };
                if let Some(st) = stop {
                    return Err(FramesFailed::Stop(st));
                }
                r.map_err(|e| FramesFailed::Stop(Stop::Abort(e)))?;
            }
        }
        i = j;
    }
    Ok(tally)
}

/// A paged request's data: [`stream_mixed`] over one window of `list`'s blocks at a time
/// ([`Windows`]: both ends cut the same windows), so that only a window's pieces are ever
/// expanded. `slot_devs[s]` is the device of the regions in slot `s` (empty: all host).
///
/// # Safety
/// Every block of `list` is valid memory of its slot's kind for this direction, pinned against
/// deregistration, until the call returns.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn stream_windows(
    s: &Conn,
    send: bool,
    list: &[ResolvedPaged],
    slot_devs: &[Option<u32>],
    stage: Option<(&DeviceStaging, &ChunkPair<'_>)>,
    framing: Option<Framing<'_>>,
    fence: Option<&AtomicBool>,
    ctl: &mut Ctl<'_>,
) -> Result<CodecTally, FramesFailed> {
    let total: u64 = list
        .iter()
        .map(|e| e.block_len * e.blocks.len() as u64)
        .sum();
    let device = slot_devs.iter().any(Option::is_some);
    let mut w = Windows::default();
    let mut pieces = Vec::with_capacity(WINDOW_BLOCKS);
    let mut slots = Vec::with_capacity(WINDOW_BLOCKS);
    let mut devs = Vec::new();
    let mut done = 0u64;
    let mut tally = CodecTally::default();
    loop {
        pieces.clear();
        slots.clear();
        devs.clear();
        let n = w.next(list, &mut pieces, &mut slots);
        if n == 0 {
            return Ok(tally);
        }
        if device {
            devs.extend(
                slots
                    .iter()
                    .map(|&s| slot_devs.get(s as usize).copied().flatten()),
            );
        }
        // SAFETY: the window's pieces are blocks of `list`, valid per this function's contract;
        // `devs` gives their kinds.
        match unsafe { stream_mixed(s, send, &pieces, &devs, stage, framing, fence, ctl) } {
            Ok(t) => tally.add(&t),
            Err(FramesFailed::Corrupt { left, error }) => {
                return Err(FramesFailed::Corrupt {
                    left: left + (total - done - n),
                    error,
                })
            }
            Err(e) => return Err(e),
        }
        done += n;
    }
}

/// Two staging chunks from `pool` (initiator or target side), waiting in ticks so that `ctl`
/// can end the wait; None after `max`.
pub(super) fn stage_pair<'a>(
    st: &'a DeviceStaging,
    initiator: bool,
    max: Duration,
    ctl: &mut Ctl<'_>,
) -> Result<Option<ChunkPair<'a>>, Stop> {
    let t0 = Instant::now();
    loop {
        if let Some(p) = st.pair(initiator, TICK) {
            return Ok(Some(p));
        }
        ctl(false)?;
        if t0.elapsed() >= max {
            return Ok(None);
        }
    }
}
