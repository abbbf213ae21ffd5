//! The lane's compressed data: the pieces of a transfer as the frames of
//! `kvxfer_proto::compress`, coded on a second thread while the previous frame is on the wire,
//! and on the receiving side decoded and checked (CRC-32) before a byte lands in memory.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, sync_channel};

use super::conn::Conn;
use super::stream::{Ctl, Stop};
use kvxfer_proto::compress::codec::{CodecTally, Decoder, Encoder};
use kvxfer_proto::compress::frame::{zstd_bound, FrameError, FrameHeader, CHUNK, HEADER_LEN};
use kvxfer_proto::compress::planes::Transform;
use kvxfer_proto::error::Error;

/// Frames each coding thread runs ahead of the wire at most.
const AHEAD: usize = 2;
/// Bytes a sending side holds per coding thread: its frames in the channel and on the wire,
/// the chunk and the planes being coded.
pub(crate) const SEND_BYTES: u64 =
    ((AHEAD + 2) * (HEADER_LEN + CHUNK + CHUNK / 128) + 3 * CHUNK) as u64;
/// Bytes a receiving side holds: one frame's payload, its chunk and its planes.
pub(crate) const RECV_BYTES: u64 = (HEADER_LEN + zstd_bound(CHUNK) + 3 * CHUNK) as u64;

/// A walk over (address, length) pieces, a chunk at a time.
struct Cursor<'a> {
    pieces: &'a [(u64, u64)],
    i: usize,
    off: u64,
}

impl<'a> Cursor<'a> {
    fn new(pieces: &'a [(u64, u64)]) -> Self {
        Cursor {
            pieces,
            i: 0,
            off: 0,
        }
    }

    /// Appends up to `max` bytes of the pieces, from where the walk is, to `out`.
    ///
    /// # Safety
    /// Every piece is memory readable for its length.
    unsafe fn gather(&mut self, out: &mut Vec<u8>, max: usize) {
        while out.len() < max && self.i < self.pieces.len() {
            let (a, l) = self.pieces[self.i];
            let take = (l - self.off).min((max - out.len()) as u64) as usize;
            // SAFETY: [a + off, +take) lies inside piece i, readable per this function's
            // contract.
            let src = unsafe { std::slice::from_raw_parts((a + self.off) as *const u8, take) };
            out.extend_from_slice(src);
            self.advance(take as u64);
        }
    }

    /// Copies `b` into the pieces from where the walk is.
    ///
    /// # Safety
    /// Every piece is memory writable for its length, and `b` fits in what is left of them.
    unsafe fn scatter(&mut self, mut b: &[u8]) {
        while !b.is_empty() && self.i < self.pieces.len() {
            let (a, l) = self.pieces[self.i];
            let take = (l - self.off).min(b.len() as u64) as usize;
            // SAFETY: [a + off, +take) lies inside piece i, writable per this function's
            // contract; `b` is a distinct buffer owned by the caller.
            unsafe {
                std::ptr::copy_nonoverlapping(b.as_ptr(), (a + self.off) as *mut u8, take);
            }
            b = &b[take..];
            self.advance(take as u64);
        }
    }

    /// Skips `n` bytes.
    fn advance(&mut self, mut n: u64) {
        while self.i < self.pieces.len() {
            let left = self.pieces[self.i].1 - self.off;
            if n < left {
                self.off += n;
                return;
            }
            n -= left;
            self.i += 1;
            self.off = 0;
        }
    }
}

fn frame_err(peer: &str, e: FrameError) -> Stop {
    Stop::Abort(Error::Frame {
        peer: peer.to_string(),
        source: e,
    })
}

fn codec_io(e: std::io::Error) -> Stop {
    Stop::Abort(Error::io("starting zstd", e))
}

/// Sends the bytes of `pieces` as frames split by `t`, coded by `threads` scoped threads
/// (thread j codes chunks j, j + threads, ...) while this one writes the frames in order.
/// Returns what the coding did (busy: the threads' coding time summed).
///
/// # Safety
/// Every piece is memory readable for its length until the call returns.
pub(super) unsafe fn send_frames(
    s: &Conn,
    pieces: &[(u64, u64)],
    t: Transform,
    threads: usize,
    fence: Option<&AtomicBool>,
    ctl: &mut Ctl<'_>,
) -> Result<CodecTally, Stop> {
    let k = threads.max(1);
    let stop = AtomicBool::new(false);
    std::thread::scope(|sc| {
        let stop = &stop;
        let mut rxs = Vec::with_capacity(k);
        let mut backs = Vec::with_capacity(k);
        let mut coders = Vec::with_capacity(k);
        for j in 0..k {
            let (tx, rx) = sync_channel::<std::io::Result<Vec<u8>>>(AHEAD);
            let (back_tx, back_rx) = channel::<Vec<u8>>();
            rxs.push(rx);
            backs.push(back_tx);
            let coder = std::thread::Builder::new()
                .name(format!("kvxfer-frames-{j}"))
                .spawn_scoped(sc, move || -> std::io::Result<CodecTally> {
                    let mut enc = Encoder::new(t)?;
                    let mut cur = Cursor::new(pieces);
                    cur.advance((j * CHUNK) as u64);
                    let mut chunk = Vec::with_capacity(CHUNK);
                    while !stop.load(Ordering::Acquire) {
                        chunk.clear();
                        // SAFETY: the pieces are readable until send_frames returns (its
                        // contract), and this scoped thread ends before it does.
                        unsafe { cur.gather(&mut chunk, CHUNK) };
                        if chunk.is_empty() {
                            break;
                        }
                        let mut out = back_rx.try_recv().unwrap_or_default();
                        out.clear();
                        if let Err(e) = enc.encode(&chunk, &mut out) {
                            let _ = tx.send(Err(std::io::Error::new(e.kind(), e.to_string())));
                            return Err(e);
                        }
                        if tx.send(Ok(out)).is_err() {
                            break;
                        }
                        cur.advance(((k - 1) * CHUNK) as u64);
                    }
                    Ok(enc.tally)
                });
            match coder {
                Ok(h) => coders.push(h),
                Err(e) => {
                    stop.store(true, Ordering::Release);
                    return Err(Stop::Abort(Error::io("spawning a frame coder", e)));
                }
            }
        }
        // Frame i comes from coder i % k; the first one missing is the end of the data.
        let mut r: Result<(), Stop> = Ok(());
        for i in 0.. {
            let Ok(f) = rxs[i % k].recv() else { break };
            let sent = match f {
                Err(e) => Err(codec_io(e)),
                Ok(_) if fence.is_some_and(|f| f.load(Ordering::Acquire)) => {
                    Err(Stop::Abort(Error::Canceled))
                }
                Ok(buf) => s.send_data(&buf, ctl).map(|()| {
                    let _ = backs[i % k].send(buf);
                }),
            };
            if let Err(e) = sent {
                r = Err(e);
                break;
            }
        }
        stop.store(true, Ordering::Release);
        drop(rxs);
        let mut tally = CodecTally::default();
        let mut coded: std::io::Result<()> = Ok(());
        for h in coders {
            match h.join() {
                Ok(Ok(t)) => tally.add(&t),
                Ok(Err(e)) => coded = Err(e),
                Err(_) => {
                    return Err(Stop::Abort(Error::InvalidArgument(
                        "a frame coder panicked".into(),
                    )))
                }
            }
        }
        r?;
        coded.map_err(codec_io)?;
        Ok(tally)
    })
}

/// Receives frames covering the bytes of `pieces` and writes each into them once it decoded and
/// its checksum matched. A frame that fails its check after arriving whole leaves the stream in
/// step: the error says how many raw bytes are still to come ([`FramesFailed`]).
///
/// # Safety
/// Every piece is memory writable for its length until the call returns.
pub(super) unsafe fn recv_frames(
    s: &Conn,
    pieces: &[(u64, u64)],
    peer: &str,
    fence: Option<&AtomicBool>,
    ctl: &mut Ctl<'_>,
) -> Result<CodecTally, FramesFailed> {
    let mut left: u64 = pieces.iter().map(|p| p.1).sum();
    let mut dec = Decoder::new().map_err(|e| FramesFailed::Stop(codec_io(e)))?;
    let mut cur = Cursor::new(pieces);
    let (mut payload, mut chunk) = (Vec::new(), Vec::new());
    while left > 0 {
        let mut hb = [0u8; HEADER_LEN];
        s.recv_data(&mut hb, ctl)?;
        let h = FrameHeader::decode(&hb, left).map_err(|e| frame_err(peer, e))?;
        payload.resize(h.payload_len(), 0);
        s.recv_data(&mut payload, ctl)?;
        left -= h.raw_len as u64;
        chunk.resize(h.raw_len, 0);
        if let Err(e) = dec.decode(&h, &payload, &mut chunk) {
            return Err(FramesFailed::Corrupt { left, error: e });
        }
        if fence.is_some_and(|f| f.load(Ordering::Acquire)) {
            return Err(FramesFailed::Stop(Stop::Abort(Error::Canceled)));
        }
        // SAFETY: the pieces are writable (this function's contract); the frame's raw bytes
        // fit in what is left of them (its header was checked against `left`).
        unsafe { cur.scatter(&chunk) };
    }
    Ok(dec.tally)
}

/// Why [`recv_frames`] stopped.
pub(super) enum FramesFailed {
    /// The stream broke, or was stopped.
    Stop(Stop),
    /// A frame arrived whole but did not decode to its checksum; `left` raw bytes follow.
    Corrupt { left: u64, error: FrameError },
}

impl From<Stop> for FramesFailed {
    fn from(s: Stop) -> Self {
        FramesFailed::Stop(s)
    }
}

/// Reads and discards frames covering `raw` bytes (a refused request's data).
pub(super) fn drain_frames(
    s: &Conn,
    mut raw: u64,
    peer: &str,
    ctl: &mut Ctl<'_>,
) -> Result<(), Stop> {
    while raw > 0 {
        let mut hb = [0u8; HEADER_LEN];
        s.recv_data(&mut hb, ctl)?;
        let h = FrameHeader::decode(&hb, raw).map_err(|e| frame_err(peer, e))?;
        s.drain_data(h.payload_len() as u64, ctl)?;
        raw -= h.raw_len as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cursor_gathers_and_scatters_across_pieces() {
        let src: Vec<u8> = (0..100u8).collect();
        let a = src.as_ptr() as u64;
        let pieces = [(a, 10), (a + 50, 0), (a + 20, 30), (a + 90, 10)];
        let mut cur = Cursor::new(&pieces);
        let mut out = Vec::new();
        // SAFETY: the pieces lie inside `src`.
        unsafe { cur.gather(&mut out, 25) };
        // SAFETY: as above.
        unsafe { cur.gather(&mut out, 100) };
        let want: Vec<u8> = (0..10).chain(20..50).chain(90..100).collect();
        assert_eq!(out, want);
        let mut dst = vec![0u8; 100];
        let d = dst.as_mut_ptr() as u64;
        let dp = [(d + 5, 7), (d + 60, 33)];
        let mut cur = Cursor::new(&dp);
        // SAFETY: the pieces lie inside `dst`, 40 bytes in all.
        unsafe { cur.scatter(&out[..15]) };
        // SAFETY: as above.
        unsafe { cur.scatter(&out[15..40]) };
        assert_eq!(&dst[5..12], &out[..7]);
        assert_eq!(&dst[60..93], &out[7..40]);
    }
}
