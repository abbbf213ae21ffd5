//! The lane's byte movers: `writev`/`readv` straight from and into registered memory, device
//! pieces through staging chunks, and the small reads and writes of the protocol, each
//! coming back every [`TICK`] to ask its caller whether to go on. The lane's only `unsafe`
//! outside the region pins.

use std::io::Read;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use kvxfer_proto::error::Error;

/// How often blocked socket calls come back to check cancel, deadline and shutdown.
pub(super) const TICK: Duration = Duration::from_millis(100);
/// iovecs per readv/writev (IOV_MAX is 1024 on Linux).
const IOV_MAX: usize = 1024;
/// Bytes per readv/writev: about 1 MiB per call measured best on loopback (fewer calls
/// do not help; larger batches only delay the first bytes).
const BATCH_BYTES: u64 = 1 << 20;

/// What the byte movers ask whether to go on: after every socket time-out (`false`: nothing
/// moved since the last call) and after every batch that moved bytes while more remain
/// (`true`). So a cancel, a stop or a deadline takes effect within a batch while data flows,
/// and a stall clock tells a silent peer from a long transfer.
pub(super) type Ctl<'a> = dyn FnMut(bool) -> Result<(), Stop> + 'a;

/// Why an I/O loop stopped early.
#[derive(Debug)]
pub(super) enum Stop {
    Io(std::io::Error),
    Eof,
    Abort(Error),
}

impl From<std::io::Error> for Stop {
    fn from(e: std::io::Error) -> Self {
        Stop::Io(e)
    }
}

pub(super) fn set_timeouts(s: &TcpStream) -> std::io::Result<()> {
    s.set_read_timeout(Some(TICK))?;
    s.set_write_timeout(Some(TICK))?;
    s.set_nodelay(true)
}

fn would_block(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock
            | std::io::ErrorKind::TimedOut
            | std::io::ErrorKind::Interrupted
    )
}

/// Moves the bytes of `pieces` (address, length) through the socket: `writev` from them when
/// `send`, `readv` into them otherwise. `ctl` is asked after each time-out and between batches
/// whether to go on ([`Ctl`]); once `fence` is set, no further batch moves.
///
/// # Safety
/// Every piece is host memory valid for this direction (readable to send, writable to
/// receive) and not freed or deregistered until the call returns.
pub(super) unsafe fn stream_pieces(
    s: &TcpStream,
    send: bool,
    pieces: &[(u64, u64)],
    fence: Option<&AtomicBool>,
    ctl: &mut Ctl<'_>,
) -> Result<(), Stop> {
    let fd = s.as_raw_fd();
    let mut i = 0usize;
    let mut off = 0u64;
    let mut iov: Vec<libc::iovec> = Vec::with_capacity(64);
    while i < pieces.len() && pieces[i].1 == 0 {
        i += 1;
    }
    while i < pieces.len() {
        // Fenced: not one more batch moves (the agent waits for this thread to end).
        if fence.is_some_and(|f| f.load(Ordering::Acquire)) {
            return Err(Stop::Abort(Error::Canceled));
        }
        iov.clear();
        let mut k = i;
        let mut o = off;
        let mut bytes = 0u64;
        let cap = BATCH_BYTES;
        while k < pieces.len() && iov.len() < IOV_MAX && bytes < cap {
            let (a, l) = pieces[k];
            if l == o {
                k += 1;
                o = 0;
                continue;
            }
            // A piece longer than the batch is cut: one region of 273 MB in a single
            // writev/recvmsg measured slower than the same bytes in 1 MiB calls (the sender
            // holds the socket lock for the whole copy and fills the buffer with cold data).
            let take = (l - o).min(cap - bytes);
            iov.push(libc::iovec {
                iov_base: (a + o) as *mut libc::c_void,
                iov_len: take as usize,
            });
            bytes += take;
            if take < l - o {
                break;
            }
            o = 0;
            k += 1;
        }
        // SAFETY: every iovec points into a piece, valid for this direction per this
        // function's contract (pinned registered regions or borrowed buffers);
        // fd is the stream's open socket.
        let r = unsafe {
            if send {
                libc::writev(fd, iov.as_ptr(), iov.len() as libc::c_int)
            } else {
                // MSG_WAITALL: one wake-up per batch instead of one per arriving segment; the
                // receive time-out still returns what arrived so far.
                let mut m: libc::msghdr = std::mem::zeroed();
                m.msg_iov = iov.as_mut_ptr();
                m.msg_iovlen = iov.len() as _;
                libc::recvmsg(fd, &mut m, libc::MSG_WAITALL)
            }
        };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if would_block(&e) {
                ctl(false)?;
                continue;
            }
            return Err(Stop::Io(e));
        }
        if r == 0 {
            if send {
                continue;
            }
            return Err(Stop::Eof);
        }
        let mut n = r as u64;
        while n > 0 {
            let left = pieces[i].1 - off;
            if n >= left {
                n -= left;
                i += 1;
                off = 0;
            } else {
                off += n;
                n = 0;
            }
        }
        // Skip empty pieces so the loop terminates on them.
        while i < pieces.len() && pieces[i].1 == off {
            i += 1;
            off = 0;
        }
        // Between batches too, not only after time-outs: a cancel takes effect while the data
        // flows, and the target's stall clock restarts.
        if i < pieces.len() {
            ctl(true)?;
        }
    }
    Ok(())
}

pub(super) fn send_buf(s: &TcpStream, b: &[u8], ctl: &mut Ctl<'_>) -> Result<(), Stop> {
    // SAFETY: `b` is a borrowed slice, readable for the whole call.
    unsafe { stream_pieces(s, true, &[(b.as_ptr() as u64, b.len() as u64)], None, ctl) }
}

pub(super) fn recv_buf(s: &TcpStream, b: &mut [u8], ctl: &mut Ctl<'_>) -> Result<(), Stop> {
    // SAFETY: `b` is a mutably borrowed slice, writable for the whole call.
    unsafe {
        stream_pieces(
            s,
            false,
            &[(b.as_mut_ptr() as u64, b.len() as u64)],
            None,
            ctl,
        )
    }
}

/// Like recv_buf, for the first bytes of a message that may be long in coming: `ctl` is asked
/// only after time-outs, and told whether bytes arrived since its last call.
pub(super) fn recv_first(c: &TcpStream, b: &mut [u8], ctl: &mut Ctl<'_>) -> Result<(), Stop> {
    let mut got = 0usize;
    let mut moved = false;
    let mut r: &TcpStream = c;
    while got < b.len() {
        match r.read(&mut b[got..]) {
            Ok(0) => return Err(Stop::Eof),
            Ok(n) => {
                got += n;
                moved = true;
            }
            Err(e) if would_block(&e) => {
                ctl(std::mem::take(&mut moved))?;
            }
            Err(e) => return Err(Stop::Io(e)),
        }
    }
    Ok(())
}
