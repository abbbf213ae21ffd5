//! The TCP stream lane: one connection per (initiator, target) pair, zero-copy on both ends.
//!
//! ```text
//! hello    initiator → target  "KVXT" | version u16 | name_len u16 | name | secret [16]
//! welcome  target → initiator  status u8 | msg_len u16 | msg
//! request  initiator → target  kind u8 (1 write, 2 read) | id u64 | nsegs u32 | notif_len u32
//!                              | { region u32 | offset u64 | len u64 }*nsegs
//!                              | write: the data, then the notification
//!                              | read:  the notification
//! reply    target → initiator  kind u8 (3 ack, 4 data) | id u64 | status u8 | msg_len u16 | msg
//!                              | data (read, status 0): the requested bytes in order
//! ```
//!
//! The target checks every segment against its own registered regions and pins them while
//! it reads into them or sends from them (deregistering fails with `Busy` meanwhile). A
//! refused write is drained so that the stream stays in step. Notifications are delivered on
//! the target after the data (write) or after the data left (read).

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::agent::Shared;
use crate::backend::ucx::driver::Job;
use crate::descriptor::RegionSpan;
use crate::error::{Error, Result};
use crate::memory::{MemKind, RegionInner};
use crate::metadata::LaneInfo;
use crate::staging::{ChunkPair, DeviceStaging};
use crate::transfer::{XferOp, XferStats};

const MAGIC: &[u8; 4] = b"KVXT";
const VERSION: u16 = 1;
const K_WRITE: u8 = 1;
const K_READ: u8 = 2;
const K_ACK: u8 = 3;
const K_DATA: u8 = 4;
/// Most segments in one request (20 MiB of header).
pub(crate) const MAX_SEGS: usize = 1 << 20;
/// How often blocked socket calls come back to check cancel, deadline and shutdown.
const TICK: Duration = Duration::from_millis(100);
/// A peer that sends nothing for this long in the middle of a message is dropped.
const STALL: Duration = Duration::from_secs(30);
/// iovecs per readv/writev (IOV_MAX is 1024 on Linux).
const IOV_MAX: usize = 1024;
/// Bytes per readv/writev: about 1 MiB per call measured best on loopback (fewer calls
/// do not help; larger batches only delay the first bytes).
const BATCH_BYTES: u64 = 1 << 20;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// A parsed request header.
#[derive(Debug, PartialEq, Eq)]
pub struct RequestHeader {
    /// 1 write, 2 read.
    pub kind: u8,
    /// Initiator's transfer id.
    pub id: u64,
    /// Segments that follow.
    pub nsegs: usize,
    /// Notification bytes that follow.
    pub notif_len: usize,
}

/// Parses and bounds-checks a request header (17 bytes).
pub fn parse_request_header(hdr: &[u8; 17]) -> std::result::Result<RequestHeader, String> {
    let kind = hdr[0];
    let id = u64::from_le_bytes(hdr[1..9].try_into().unwrap_or_default());
    let nsegs = u32::from_le_bytes(hdr[9..13].try_into().unwrap_or_default()) as usize;
    let nlen = u32::from_le_bytes(hdr[13..17].try_into().unwrap_or_default()) as usize;
    if (kind != K_WRITE && kind != K_READ)
        || nsegs > MAX_SEGS
        || nlen > crate::notify::MAX_NOTIFICATION + 2 + crate::metadata::MAX_NAME
    {
        return Err(format!(
            "malformed request kind {kind} nsegs {nsegs} notification {nlen}"
        ));
    }
    Ok(RequestHeader {
        kind,
        id,
        nsegs,
        notif_len: nlen,
    })
}

/// Parses a segment table: `(region, offset, len)` per 20 bytes; trailing bytes are an error.
pub fn parse_segments(raw: &[u8]) -> std::result::Result<Vec<(u32, u64, u64)>, String> {
    if !raw.len().is_multiple_of(20) {
        return Err(format!("segment table of {} bytes", raw.len()));
    }
    Ok(raw
        .chunks_exact(20)
        .map(|s| {
            (
                u32::from_le_bytes(s[0..4].try_into().unwrap_or_default()),
                u64::from_le_bytes(s[4..12].try_into().unwrap_or_default()),
                u64::from_le_bytes(s[12..20].try_into().unwrap_or_default()),
            )
        })
        .collect())
}

/// Parses the fixed part of a hello (8 bytes): the name length that follows, if valid.
pub fn parse_hello(h: &[u8; 8]) -> std::result::Result<usize, String> {
    let name_len = u16::from_le_bytes([h[6], h[7]]) as usize;
    if &h[..4] != MAGIC || u16::from_le_bytes([h[4], h[5]]) != VERSION {
        return Err("bad magic or version".into());
    }
    if name_len == 0 || name_len > crate::metadata::MAX_NAME {
        return Err(format!("name of {name_len} bytes"));
    }
    Ok(name_len)
}

/// Why an I/O loop stopped early.
enum Stop {
    Io(std::io::Error),
    Eof,
    Abort(Error),
}

impl From<std::io::Error> for Stop {
    fn from(e: std::io::Error) -> Self {
        Stop::Io(e)
    }
}

fn set_timeouts(s: &TcpStream) -> std::io::Result<()> {
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
/// `send`, `readv` into them otherwise. `ctl` is asked after each time-out whether to go on.
///
/// # Safety
/// Every piece is host memory valid for this direction (readable to send, writable to
/// receive) and not freed or deregistered until the call returns.
unsafe fn stream_pieces(
    s: &TcpStream,
    send: bool,
    pieces: &[(u64, u64)],
    ctl: &mut dyn FnMut() -> Result<(), Stop>,
) -> Result<(), Stop> {
    let fd = s.as_raw_fd();
    let mut i = 0usize;
    let mut off = 0u64;
    let mut iov: Vec<libc::iovec> = Vec::with_capacity(64);
    while i < pieces.len() && pieces[i].1 == 0 {
        i += 1;
    }
    while i < pieces.len() {
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
            iov.push(libc::iovec {
                iov_base: (a + o) as *mut libc::c_void,
                iov_len: (l - o) as usize,
            });
            bytes += l - o;
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
                ctl()?;
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
    }
    Ok(())
}

/// Like [`stream_pieces`], with pieces of device memory (`devs[k]` is the device of piece k,
/// `devs` empty: all host) moved through the two staging chunks of `stage`.
///
/// # Safety
/// Every piece is valid memory of its kind (host, or device `devs[k]`) for this direction,
/// pinned against deregistration, until the call returns.
unsafe fn stream_mixed(
    s: &TcpStream,
    send: bool,
    pieces: &[(u64, u64)],
    devs: &[Option<u32>],
    stage: Option<(&DeviceStaging, &ChunkPair<'_>)>,
    ctl: &mut dyn FnMut() -> Result<(), Stop>,
) -> Result<(), Stop> {
    if devs.iter().all(Option::is_none) {
        // SAFETY: all pieces are host memory (no device), valid per this function's contract.
        return unsafe { stream_pieces(s, send, pieces, ctl) };
    }
    let mut i = 0;
    while i < pieces.len() {
        let d = devs[i];
        let mut j = i + 1;
        while j < pieces.len() && devs[j] == d {
            j += 1;
        }
        match (d, stage) {
            // SAFETY: host pieces, valid per this function's contract.
            (None, _) => unsafe { stream_pieces(s, send, &pieces[i..j], ctl) }?,
            (Some(_), None) => {
                return Err(Stop::Abort(Error::InvalidArgument(
                    "device memory without staging chunks".into(),
                )))
            }
            (Some(dev), Some((st, pair))) => {
                let mut stop: Option<Stop> = None;
                let mut net = |buf: &mut [u8]| {
                    let r = if send {
                        send_buf(s, buf, ctl)
                    } else {
                        recv_buf(s, buf, ctl)
                    };
                    r.map_err(|e| {
                        stop = Some(e);
                        Error::Canceled
                    })
                };
                let engine = st.engine().as_ref();
                // SAFETY: these pieces are device memory of `dev` (this function's contract).
                let r = unsafe {
                    crate::staging::stream_device(engine, dev, pair, send, &pieces[i..j], &mut net)
                };
                if let Some(st) = stop {
                    return Err(st);
                }
                r.map_err(Stop::Abort)?;
            }
        }
        i = j;
    }
    Ok(())
}

/// Two staging chunks from `pool` (initiator or target side), waiting in ticks so that `ctl`
/// can end the wait; None after `max`.
fn stage_pair<'a>(
    st: &'a DeviceStaging,
    initiator: bool,
    max: Duration,
    ctl: &mut dyn FnMut() -> Result<(), Stop>,
) -> Result<Option<ChunkPair<'a>>, Stop> {
    let t0 = Instant::now();
    loop {
        if let Some(p) = st.pair(initiator, TICK) {
            return Ok(Some(p));
        }
        ctl()?;
        if t0.elapsed() >= max {
            return Ok(None);
        }
    }
}

fn send_buf(
    s: &TcpStream,
    b: &[u8],
    ctl: &mut dyn FnMut() -> Result<(), Stop>,
) -> Result<(), Stop> {
    // SAFETY: `b` is a borrowed slice, readable for the whole call.
    unsafe { stream_pieces(s, true, &[(b.as_ptr() as u64, b.len() as u64)], ctl) }
}

fn recv_buf(
    s: &TcpStream,
    b: &mut [u8],
    ctl: &mut dyn FnMut() -> Result<(), Stop>,
) -> Result<(), Stop> {
    // SAFETY: `b` is a mutably borrowed slice, writable for the whole call.
    unsafe { stream_pieces(s, false, &[(b.as_mut_ptr() as u64, b.len() as u64)], ctl) }
}

// ---------------------------------------------------------------------------------------------
// Target side
// ---------------------------------------------------------------------------------------------

/// The lane's listener and its connections.
pub(crate) struct Server {
    info: LaneInfo,
    stop: Arc<AtomicBool>,
    fd: i32,
    accept: Option<JoinHandle<()>>,
    conns: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl Server {
    pub(crate) fn start(ip: std::net::IpAddr, shared: Weak<Shared>, name: &str) -> Result<Server> {
        let l = TcpListener::bind(SocketAddr::new(ip, 0))
            .map_err(|e| Error::io(format!("binding the TCP lane on {ip}"), e))?;
        let addr = l
            .local_addr()
            .map_err(|e| Error::io("querying the TCP lane address", e))?;
        let mut secret = [0u8; 16];
        getrandom(&mut secret)?;
        let info = LaneInfo { addr, secret };
        let stop = Arc::new(AtomicBool::new(false));
        let conns: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let fd = l.as_raw_fd();
        let (st, cs, nm) = (stop.clone(), conns.clone(), name.to_string());
        let accept = std::thread::Builder::new()
            .name(format!("kvxfer-lane-{name}"))
            .spawn(move || {
                for c in l.incoming() {
                    if st.load(Ordering::Acquire) {
                        return;
                    }
                    let Ok(c) = c else { continue };
                    let (st2, sh) = (st.clone(), shared.clone());
                    let t = std::thread::Builder::new()
                        .name(format!("kvxfer-lane-{nm}-conn"))
                        .spawn(move || serve(c, sh, secret, st2));
                    if let Ok(t) = t {
                        let mut g = cs.lock().unwrap_or_else(|e| e.into_inner());
                        g.retain(|h| !h.is_finished());
                        g.push(t);
                    }
                }
            })
            .map_err(|e| Error::io("spawning the TCP lane thread", e))?;
        Ok(Server {
            info,
            stop,
            fd,
            accept: Some(accept),
            conns,
        })
    }

    pub(crate) fn info(&self) -> LaneInfo {
        self.info
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // SAFETY: fd is the listener, still open (owned by the accept thread, joined below);
        // shutdown wakes the blocked accept.
        unsafe { libc::shutdown(self.fd, libc::SHUT_RDWR) };
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
        let conns = std::mem::take(&mut *self.conns.lock().unwrap_or_else(|e| e.into_inner()));
        for t in conns {
            let _ = t.join();
        }
    }
}

fn getrandom(b: &mut [u8]) -> Result<()> {
    let mut f =
        std::fs::File::open("/dev/urandom").map_err(|e| Error::io("opening /dev/urandom", e))?;
    f.read_exact(b)
        .map_err(|e| Error::io("reading /dev/urandom", e))
}

/// Pins of the regions a request touches; released on drop.
struct Pins(Vec<Arc<RegionInner>>);

impl Drop for Pins {
    fn drop(&mut self) {
        for r in &self.0 {
            r.inflight.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Checks `segs` against the registered regions and pins them. Returns the pieces
/// (addresses) and, where any piece is device memory, the device of each piece.
fn resolve_segs(shared: &Shared, segs: &[(u32, u64, u64)]) -> Result<Resolved, String> {
    let regions = shared.regions.read().unwrap_or_else(|e| e.into_inner());
    let mut pins = Pins(Vec::new());
    let mut pieces = Vec::with_capacity(segs.len());
    let mut devs: Vec<Option<u32>> = Vec::new();
    for (k, &(id, off, len)) in segs.iter().enumerate() {
        let r = regions
            .get(&id)
            .ok_or_else(|| format!("segment #{k}: region {id} is not registered"))?;
        if let MemKind::Cuda(d) = r.kind {
            if devs.is_empty() {
                devs = vec![None; segs.len()];
            }
            devs[k] = Some(d);
        }
        match off.checked_add(len) {
            Some(end) if end <= r.len => {}
            _ => {
                return Err(format!(
                    "segment #{k}: [{off}, +{len}) is outside region {id} of {} bytes",
                    r.len
                ))
            }
        }
        if !pins.0.iter().any(|p| Arc::ptr_eq(p, r)) {
            // Raise, then check: pairs with the engine's deregister (clear, then check).
            r.inflight.fetch_add(1, Ordering::SeqCst);
            pins.0.push(r.clone());
            if !r.registered.load(Ordering::SeqCst) {
                return Err(format!("segment #{k}: region {id} is being deregistered"));
            }
        }
        pieces.push((r.addr + off, len));
    }
    Ok((pins, pieces, devs))
}

/// Pins, pieces and their devices (empty: all host).
type Resolved = (Pins, Vec<(u64, u64)>, Vec<Option<u32>>);

/// The target's staging for a request with device pieces: Ok(None) when it has none.
fn target_stage(sh: &Shared, devs: &[Option<u32>]) -> Result<Option<Arc<DeviceStaging>>, String> {
    match devs.iter().flatten().next() {
        None => Ok(None),
        Some(&d) => sh
            .staging
            .pools(d)
            .map(Some)
            .map_err(|e| format!("staging device memory: {e}")),
    }
}

/// How long a target waits for staging chunks before refusing a request.
const STAGE_WAIT: Duration = Duration::from_secs(10);

fn serve(c: TcpStream, shared: Weak<Shared>, secret: [u8; 16], stop: Arc<AtomicBool>) {
    let peer = c.peer_addr().map(|a| a.to_string()).unwrap_or_default();
    if let Err(e) = serve_inner(&c, &shared, secret, &stop) {
        match e {
            Stop::Eof => log::debug!("kvxfer: TCP lane peer {peer} closed"),
            Stop::Io(e) => log::info!("kvxfer: TCP lane peer {peer}: {e}"),
            Stop::Abort(e) => log::info!("kvxfer: TCP lane peer {peer} dropped: {e}"),
        }
    }
}

fn serve_inner(
    c: &TcpStream,
    shared: &Weak<Shared>,
    secret: [u8; 16],
    stop: &AtomicBool,
) -> Result<(), Stop> {
    set_timeouts(c)?;
    // While idle between requests only shutdown ends the wait; inside a message a silent peer
    // is dropped after STALL.
    let mut last = Instant::now();
    let ctl = |idle: bool, last: &mut Instant| -> Result<(), Stop> {
        if stop.load(Ordering::Acquire) {
            return Err(Stop::Abort(Error::Shutdown));
        }
        if !idle && last.elapsed() > STALL {
            return Err(Stop::Abort(Error::InvalidArgument(
                "peer stalled mid-message".into(),
            )));
        }
        Ok(())
    };
    // Hello.
    let mut h = [0u8; 8];
    recv_buf(c, &mut h, &mut || ctl(false, &mut last))?;
    let name_len = match parse_hello(&h) {
        Ok(n) => n,
        Err(why) => {
            let _ = welcome(c, 1, &format!("bad hello: {why}"));
            return Err(Stop::Abort(Error::InvalidArgument(format!(
                "bad hello: {why}"
            ))));
        }
    };
    let mut rest = vec![0u8; name_len + 16];
    recv_buf(c, &mut rest, &mut || ctl(false, &mut last))?;
    let name = String::from_utf8_lossy(&rest[..name_len]).into_owned();
    if rest[name_len..] != secret {
        let _ = welcome(
            c,
            1,
            "wrong lane secret: load this agent's current metadata",
        );
        return Err(Stop::Abort(Error::InvalidArgument(format!(
            "{name:?} presented a wrong secret"
        ))));
    }
    welcome(c, 0, "")?;
    loop {
        // Request header.
        let mut hdr = [0u8; 17];
        last = Instant::now();
        recv_first(c, &mut hdr, &mut |started| {
            if started {
                ctl(false, &mut last)
            } else {
                ctl(true, &mut last)
            }
        })?;
        let RequestHeader {
            kind,
            id,
            nsegs,
            notif_len: nlen,
        } = match parse_request_header(&hdr) {
            Ok(h) => h,
            Err(why) => {
                let id = u64::from_le_bytes(hdr[1..9].try_into().unwrap_or_default());
                let _ = reply(c, K_ACK, id, 1, &why, &mut || ctl(false, &mut last));
                return Err(Stop::Abort(Error::InvalidArgument(why)));
            }
        };
        // The segment table and the resolved pieces, charged to this agent's budget: a peer
        // cannot make the target allocate past it. No room within STALL: refuse and drop
        // the connection (the table cannot be skipped without reading it).
        let Some(sh0) = shared.upgrade() else {
            return Err(Stop::Abort(Error::Shutdown));
        };
        let charge = sh0
            .budget
            .charge((nsegs * 20 + nsegs * 16) as u64, "TCP lane request", STALL);
        drop(sh0);
        let _charge = match charge {
            Ok(c) => c,
            Err(e) => {
                // Skip the request without holding it: sum the segment lengths as the table
                // streams by, drain the data and notification, refuse, stay in step.
                let total = sum_segments(c, nsegs, &mut || ctl(false, &mut last))?;
                if kind == K_WRITE {
                    drain(c, total.saturating_add(nlen as u64), &mut || {
                        ctl(false, &mut last)
                    })?;
                    reply(c, K_ACK, id, 1, &e.to_string(), &mut || {
                        ctl(false, &mut last)
                    })?;
                } else {
                    drain(c, nlen as u64, &mut || ctl(false, &mut last))?;
                    reply(c, K_DATA, id, 1, &e.to_string(), &mut || {
                        ctl(false, &mut last)
                    })?;
                }
                continue;
            }
        };
        let mut raw = vec![0u8; nsegs * 20];
        recv_buf(c, &mut raw, &mut || ctl(false, &mut last))?;
        let segs = parse_segments(&raw).map_err(|w| Stop::Abort(Error::InvalidArgument(w)))?;
        drop(raw);
        let Some(sh) = shared.upgrade() else {
            return Err(Stop::Abort(Error::Shutdown));
        };
        let mut resolved = resolve_segs(&sh, &segs);
        let total: u64 = segs.iter().fold(0u64, |a, s| a.saturating_add(s.2));
        // Device pieces: the staging pools and two target chunks, or a refusal.
        let stage = match &resolved {
            Ok((_, _, devs)) => match target_stage(&sh, devs) {
                Ok(s) => s,
                Err(why) => {
                    resolved = Err(why);
                    None
                }
            },
            Err(_) => None,
        };
        let pair = match &stage {
            Some(st) => {
                let p = stage_pair(st, false, STAGE_WAIT, &mut || ctl(false, &mut last))?;
                if p.is_none() {
                    resolved = Err(format!("all staging chunks stayed busy for {STAGE_WAIT:?}"));
                }
                p
            }
            None => None,
        };
        let st = stage.as_deref().zip(pair.as_ref());
        if kind == K_WRITE {
            let err = match &resolved {
                Ok((_pins, pieces, devs)) => {
                    // SAFETY: the pieces were resolved against this agent's registered regions,
                    // whose kinds `devs` gives, and `_pins` holds them registered.
                    unsafe {
                        stream_mixed(c, false, pieces, devs, st, &mut || ctl(false, &mut last))
                    }?;
                    None
                }
                Err(why) => {
                    drain(c, total, &mut || ctl(false, &mut last))?;
                    Some(why.clone())
                }
            };
            drop(pair);
            drop(resolved);
            let mut note = vec![0u8; nlen];
            recv_buf(c, &mut note, &mut || ctl(false, &mut last))?;
            match err {
                None => {
                    if nlen > 0 {
                        deliver(&sh, &name, &note);
                    }
                    reply(c, K_ACK, id, 0, "", &mut || ctl(false, &mut last))?;
                }
                Some(why) => reply(c, K_ACK, id, 1, &why, &mut || ctl(false, &mut last))?,
            }
        } else {
            let mut note = vec![0u8; nlen];
            recv_buf(c, &mut note, &mut || ctl(false, &mut last))?;
            match resolved {
                Ok((pins, pieces, devs)) => {
                    reply(c, K_DATA, id, 0, "", &mut || ctl(false, &mut last))?;
                    // SAFETY: as for a write: resolved, kinds in `devs`, held by `pins`.
                    unsafe {
                        stream_mixed(c, true, &pieces, &devs, st, &mut || ctl(false, &mut last))
                    }?;
                    drop(pair);
                    drop(pins);
                    if nlen > 0 {
                        deliver(&sh, &name, &note);
                    }
                }
                Err(why) => reply(c, K_DATA, id, 1, &why, &mut || ctl(false, &mut last))?,
            }
        }
    }
}

/// Like recv_buf, but tells `ctl` whether any byte of the message has arrived yet.
fn recv_first(
    c: &TcpStream,
    b: &mut [u8],
    ctl: &mut dyn FnMut(bool) -> Result<(), Stop>,
) -> Result<(), Stop> {
    let mut got = 0usize;
    let mut r: &TcpStream = c;
    while got < b.len() {
        match r.read(&mut b[got..]) {
            Ok(0) => return Err(Stop::Eof),
            Ok(n) => got += n,
            Err(e) if would_block(&e) => ctl(got > 0)?,
            Err(e) => return Err(Stop::Io(e)),
        }
    }
    Ok(())
}

/// Reads a segment table of `n` entries in fixed-size chunks and returns the sum of lengths.
fn sum_segments(
    c: &TcpStream,
    n: usize,
    ctl: &mut dyn FnMut() -> Result<(), Stop>,
) -> Result<u64, Stop> {
    let mut chunk = vec![0u8; 20 * 3276];
    let mut left = n;
    let mut total = 0u64;
    while left > 0 {
        let k = left.min(3276);
        recv_buf(c, &mut chunk[..k * 20], ctl)?;
        for s in chunk[..k * 20].chunks_exact(20) {
            total =
                total.saturating_add(u64::from_le_bytes(s[12..20].try_into().unwrap_or_default()));
        }
        left -= k;
    }
    Ok(total)
}

fn drain(c: &TcpStream, mut n: u64, ctl: &mut dyn FnMut() -> Result<(), Stop>) -> Result<(), Stop> {
    let mut scratch = vec![0u8; 64 * 1024];
    while n > 0 {
        let k = n.min(scratch.len() as u64) as usize;
        recv_buf(c, &mut scratch[..k], ctl)?;
        n -= k as u64;
    }
    Ok(())
}

fn deliver(sh: &Shared, name: &str, note: &[u8]) {
    match crate::notify::decode(note) {
        Some(n) if n.from == name => sh.deliver(n),
        Some(n) => log::warn!(
            "kvxfer: TCP lane notification claims to be from {:?} on {name:?}'s connection; dropped",
            n.from
        ),
        None => log::warn!("kvxfer: malformed TCP lane notification from {name:?} dropped"),
    }
}

fn welcome(c: &TcpStream, status: u8, msg: &str) -> Result<(), Stop> {
    let mut b = vec![status];
    b.extend_from_slice(&(msg.len() as u16).to_le_bytes());
    b.extend_from_slice(msg.as_bytes());
    (&*c).write_all(&b).map_err(Stop::Io)
}

fn reply(
    c: &TcpStream,
    kind: u8,
    id: u64,
    status: u8,
    msg: &str,
    ctl: &mut dyn FnMut() -> Result<(), Stop>,
) -> Result<(), Stop> {
    let msg = &msg.as_bytes()[..msg.len().min(u16::MAX as usize)];
    let mut b = Vec::with_capacity(12 + msg.len());
    b.push(kind);
    b.extend_from_slice(&id.to_le_bytes());
    b.push(status);
    b.extend_from_slice(&(msg.len() as u16).to_le_bytes());
    b.extend_from_slice(msg);
    send_buf(c, &b, ctl)
}

// ---------------------------------------------------------------------------------------------
// Initiator side
// ---------------------------------------------------------------------------------------------

struct LinkJob {
    job: Job,
}

struct LinkInner {
    peer: String,
    me: String,
    info: LaneInfo,
    spans: Vec<RegionSpan>,
    budget: crate::MemoryBudget,
    staging: Arc<crate::staging::StagingCell>,
    q: Mutex<(VecDeque<LinkJob>, bool)>,
    cv: Condvar,
}

/// The initiator's side of the lane to one peer: a queue served in order by one thread.
pub(crate) struct Link {
    inner: Arc<LinkInner>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Link {
    pub(crate) fn new(
        me: &str,
        peer: &str,
        info: LaneInfo,
        spans: Vec<RegionSpan>,
        budget: crate::MemoryBudget,
        staging: Arc<crate::staging::StagingCell>,
    ) -> Link {
        Link {
            inner: Arc::new(LinkInner {
                peer: peer.to_string(),
                me: me.to_string(),
                info,
                spans,
                budget,
                staging,
                q: Mutex::new((VecDeque::new(), false)),
                cv: Condvar::new(),
            }),
            thread: Mutex::new(None),
        }
    }

    /// Queues `job` (its local regions pinned by the caller).
    pub(crate) fn submit(&self, job: Job) {
        {
            let mut g = self.inner.q.lock().unwrap_or_else(|e| e.into_inner());
            g.0.push_back(LinkJob { job });
        }
        self.inner.cv.notify_one();
        let mut t = self.thread.lock().unwrap_or_else(|e| e.into_inner());
        if t.is_none() {
            let inner = self.inner.clone();
            match std::thread::Builder::new()
                .name(format!("kvxfer-link-{}", self.inner.peer))
                .spawn(move || link_loop(inner))
            {
                Ok(h) => *t = Some(h),
                Err(e) => {
                    let mut g = self.inner.q.lock().unwrap_or_else(|e| e.into_inner());
                    for j in g.0.drain(..) {
                        finish(
                            &j.job,
                            Err(Error::io(
                                "spawning the TCP lane thread",
                                std::io::Error::new(e.kind(), e.to_string()),
                            )),
                        );
                    }
                }
            }
        }
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.inner.q.lock().unwrap_or_else(|e| e.into_inner()).1 = true;
        self.inner.cv.notify_all();
        // The thread finishes the queued jobs (each bounded by its deadline or the peer's
        // liveness) and exits; it is not joined here to keep drops on callers' threads short.
    }
}

fn finish(job: &Job, r: Result<XferStats>) {
    for reg in &job.regions {
        reg.inflight.fetch_sub(1, Ordering::AcqRel);
    }
    job.state.complete(r);
}

fn link_loop(inner: Arc<LinkInner>) {
    let mut conn: Option<TcpStream> = None;
    loop {
        let j = {
            let mut g = inner.q.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if let Some(j) = g.0.pop_front() {
                    break j;
                }
                if g.1 {
                    return;
                }
                g = inner.cv.wait(g).unwrap_or_else(|e| e.into_inner());
            }
        };
        let job = &j.job;
        let r = run_job(&inner, &mut conn, job);
        if r.is_err() {
            // The stream may be mid-message: start over on the next job.
            if let Some(c) = conn.take() {
                let _ = c.shutdown(std::net::Shutdown::Both);
            }
        }
        finish(job, r);
    }
}

fn lane_err(inner: &LinkInner, why: impl Into<String>) -> Error {
    Error::LaneFailed {
        agent: inner.peer.clone(),
        lane: "tcp",
        why: why.into(),
    }
}

fn connect(inner: &LinkInner) -> Result<TcpStream> {
    let c = TcpStream::connect_timeout(&inner.info.addr, CONNECT_TIMEOUT)
        .map_err(|e| lane_err(inner, format!("connecting to {}: {e}", inner.info.addr)))?;
    set_timeouts(&c).map_err(|e| lane_err(inner, format!("socket options: {e}")))?;
    let mut h = Vec::with_capacity(8 + inner.me.len() + 16);
    h.extend_from_slice(MAGIC);
    h.extend_from_slice(&VERSION.to_le_bytes());
    h.extend_from_slice(&(inner.me.len() as u16).to_le_bytes());
    h.extend_from_slice(inner.me.as_bytes());
    h.extend_from_slice(&inner.info.secret);
    let t0 = Instant::now();
    let mut ctl = || -> Result<(), Stop> {
        if t0.elapsed() > CONNECT_TIMEOUT {
            Err(Stop::Abort(Error::InvalidArgument(
                "hello timed out".into(),
            )))
        } else {
            Ok(())
        }
    };
    let r = send_buf(&c, &h, &mut ctl).and_then(|_| {
        let mut w = [0u8; 3];
        recv_buf(&c, &mut w, &mut ctl)?;
        let mut msg = vec![0u8; u16::from_le_bytes([w[1], w[2]]) as usize];
        recv_buf(&c, &mut msg, &mut ctl)?;
        Ok((w[0], String::from_utf8_lossy(&msg).into_owned()))
    });
    match r {
        Ok((0, _)) => Ok(c),
        Ok((_, msg)) => Err(lane_err(inner, format!("refused: {msg}"))),
        Err(s) => Err(stop_err(inner, s, "hello")),
    }
}

fn stop_err(inner: &LinkInner, s: Stop, what: &str) -> Error {
    match s {
        Stop::Abort(e) => e,
        Stop::Eof => lane_err(inner, format!("peer closed the connection during {what}")),
        Stop::Io(e) => lane_err(inner, format!("{what}: {e}")),
    }
}

fn run_job(inner: &LinkInner, conn: &mut Option<TcpStream>, job: &Job) -> Result<XferStats> {
    let deadline_at = job.deadline.map(|d| job.started + d);
    let ops = job.plan.ops.len();
    let check = || -> Result<(), Stop> {
        if job.state.is_canceled() {
            return Err(Stop::Abort(Error::Canceled));
        }
        if deadline_at.is_some_and(|d| Instant::now() >= d) {
            return Err(Stop::Abort(Error::Deadline {
                agent: job.peer.clone(),
                deadline: job.deadline.unwrap_or_default(),
                // The stream lane does not count operations as it goes.
                posted_ops: 0,
                ops,
            }));
        }
        Ok(())
    };
    check().map_err(|s| stop_err(inner, s, "start"))?;
    for r in &job.regions {
        if !r.registered.load(Ordering::SeqCst) {
            return Err(Error::Deregistered { region: r.id.0 });
        }
    }
    if conn.is_none() {
        *conn = Some(connect(inner)?);
    }
    let c = conn
        .as_ref()
        .ok_or_else(|| lane_err(inner, "no connection"))?;
    // Segments in the target's terms, and the local pieces.
    let note = job.notification.as_deref().unwrap_or(&[]);
    // The request header and the piece list, charged to the agent's budget (waits while
    // other transfers hold it, up to the deadline or a minute).
    let wait = deadline_at.map_or(Duration::from_secs(60), |d| {
        d.saturating_duration_since(Instant::now())
    });
    let _charge =
        inner
            .budget
            .charge((17 + ops * 20 + ops * 16) as u64, "TCP lane request", wait)?;
    let mut hdr = Vec::with_capacity(17 + ops * 20);
    hdr.push(if job.op == XferOp::Write {
        K_WRITE
    } else {
        K_READ
    });
    hdr.extend_from_slice(&job.id.to_le_bytes());
    hdr.extend_from_slice(&(ops as u32).to_le_bytes());
    hdr.extend_from_slice(&(note.len() as u32).to_le_bytes());
    let mut pieces = Vec::with_capacity(ops);
    for o in &job.plan.ops {
        let span = inner
            .spans
            .get(o.rslot as usize)
            .ok_or_else(|| lane_err(inner, format!("remote slot {} unknown", o.rslot)))?;
        hdr.extend_from_slice(&span.id.0.to_le_bytes());
        hdr.extend_from_slice(&(o.remote - span.base).to_le_bytes());
        hdr.extend_from_slice(&o.len.to_le_bytes());
        pieces.push((o.local, o.len));
    }
    if ops > MAX_SEGS {
        return Err(Error::InvalidArgument(format!(
            "{ops} operations in one transfer, the TCP lane takes {MAX_SEGS}"
        )));
    }
    let mut ctl = check;
    // Local device memory: two chunks of this agent's initiator pool, taken before the request
    // goes out (a transfer holding chunks never waits for more).
    let stage = match job.local_dev.iter().flatten().next() {
        Some(&d) => Some(inner.staging.pools(d)?),
        None => None,
    };
    let pair = match &stage {
        Some(st) => stage_pair(st, true, Duration::MAX, &mut ctl)
            .map_err(|s| stop_err(inner, s, "waiting for staging chunks"))?,
        None => None,
    };
    let st = stage.as_deref().zip(pair.as_ref());
    let posted_at;
    if job.op == XferOp::Write {
        send_buf(c, &hdr, &mut ctl).map_err(|s| stop_err(inner, s, "request"))?;
        // SAFETY: the pieces come from the job's plan, bounds-checked against its local
        // regions (kinds in `local_dev`), which the job pins until it finishes.
        unsafe { stream_mixed(c, true, &pieces, &job.local_dev, st, &mut ctl) }
            .map_err(|s| stop_err(inner, s, "sending data"))?;
        send_buf(c, note, &mut ctl).map_err(|s| stop_err(inner, s, "notification"))?;
        posted_at = job.started.elapsed();
        read_reply(inner, c, K_ACK, job.id, &mut ctl)?;
    } else {
        hdr.extend_from_slice(note);
        send_buf(c, &hdr, &mut ctl).map_err(|s| stop_err(inner, s, "request"))?;
        posted_at = job.started.elapsed();
        read_reply(inner, c, K_DATA, job.id, &mut ctl)?;
        let t_hdr = job.started.elapsed();
        // SAFETY: as for a write.
        unsafe { stream_mixed(c, false, &pieces, &job.local_dev, st, &mut ctl) }
            .map_err(|s| stop_err(inner, s, "receiving data"))?;
        log::debug!(
            "kvxfer: read {}: request sent {posted_at:?}, reply {t_hdr:?}, data {:?}",
            job.id,
            job.started.elapsed()
        );
    }
    Ok(XferStats {
        peer: job.peer.clone(),
        op: job.op,
        bytes: job.plan.bytes,
        descs: job.plan.descs,
        ops,
        post_time: posted_at,
        duration: job.started.elapsed(),
        lane: super::Lane::Tcp,
    })
}

fn read_reply(
    inner: &LinkInner,
    c: &TcpStream,
    kind: u8,
    id: u64,
    ctl: &mut dyn FnMut() -> Result<(), Stop>,
) -> Result<()> {
    let mut h = [0u8; 12];
    recv_buf(c, &mut h, ctl).map_err(|s| stop_err(inner, s, "waiting for the reply"))?;
    let mut msg = vec![0u8; u16::from_le_bytes([h[10], h[11]]) as usize];
    recv_buf(c, &mut msg, ctl).map_err(|s| stop_err(inner, s, "reading the reply"))?;
    let got_id = u64::from_le_bytes(h[1..9].try_into().unwrap_or_default());
    if h[0] != kind || got_id != id {
        return Err(lane_err(
            inner,
            format!(
                "reply kind {} id {got_id}, expected kind {kind} id {id}",
                h[0]
            ),
        ));
    }
    if h[9] != 0 {
        return Err(lane_err(
            inner,
            format!("peer refused: {}", String::from_utf8_lossy(&msg)),
        ));
    }
    Ok(())
}
