//! The lane's target: a listener, one thread per connection, each request checked against
//! this agent's registered regions and pinned while the stream reads into or sends from them.

use std::io::Read;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::stream::{
    drain, recv_buf, recv_first, send_buf, set_timeouts, stage_pair, stream_mixed, sum_segments,
    Stop,
};
use crate::lane::LaneCtx;
use crate::memory::Pins;
use crate::staging::pool::DeviceStaging;
use kvxfer_proto::error::{Error, Result};
use kvxfer_proto::types::{LaneInfo, MemKind};
use kvxfer_proto::wire::lane::{
    encode_reply, encode_welcome, parse_hello, parse_hello_rest, parse_request_header,
    parse_segments, request_id, RequestHeader, HEADER_LEN, HELLO_FIXED_LEN, K_ACK, K_DATA, K_WRITE,
    SECRET_LEN, SEG_LEN,
};

/// A peer that sends nothing for this long in the middle of a message is dropped.
const STALL: Duration = Duration::from_secs(30);

/// The lane's listener and its connections.
pub(crate) struct Server {
    info: LaneInfo,
    stop: Arc<AtomicBool>,
    fd: i32,
    accept: Option<JoinHandle<()>>,
    conns: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl Server {
    pub(crate) fn start(ip: std::net::IpAddr, ctx: Arc<LaneCtx>, name: &str) -> Result<Server> {
        let l = TcpListener::bind(SocketAddr::new(ip, 0))
            .map_err(|e| Error::io(format!("binding the TCP lane on {ip}"), e))?;
        let addr = l
            .local_addr()
            .map_err(|e| Error::io("querying the TCP lane address", e))?;
        let mut secret = [0u8; SECRET_LEN];
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
                    let (st2, sh) = (st.clone(), ctx.clone());
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

/// Bytes the target holds per segment once resolved (address and length).
const PIECE_BYTES: usize = 16;

/// Checks `segs` against the registered regions and pins them. Returns the pieces
/// (addresses) and, where any piece is device memory, the device of each piece.
fn resolve_segs(ctx: &LaneCtx, segs: &[(u32, u64, u64)]) -> Result<Resolved, String> {
    let regions = ctx.regions.read();
    let mut pins = Pins::default();
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
        if pins.add(r).is_err() {
            return Err(format!("segment #{k}: region {id} is being deregistered"));
        }
        pieces.push((r.addr + off, len));
    }
    Ok((pins, pieces, devs))
}

/// Pins, pieces and their devices (empty: all host).
type Resolved = (Pins, Vec<(u64, u64)>, Vec<Option<u32>>);

/// The target's staging for a request with device pieces: Ok(None) when it has none.
fn target_stage(ctx: &LaneCtx, devs: &[Option<u32>]) -> Result<Option<Arc<DeviceStaging>>, String> {
    match devs.iter().flatten().next() {
        None => Ok(None),
        Some(&d) => ctx
            .staging
            .pools(d)
            .map(Some)
            .map_err(|e| format!("staging device memory: {e}")),
    }
}

/// How long a target waits for staging chunks before refusing a request.
const STAGE_WAIT: Duration = Duration::from_secs(10);

fn serve(c: TcpStream, ctx: Arc<LaneCtx>, secret: [u8; SECRET_LEN], stop: Arc<AtomicBool>) {
    let peer = c.peer_addr().map(|a| a.to_string()).unwrap_or_default();
    if let Err(e) = serve_inner(&c, &ctx, secret, &stop) {
        match e {
            Stop::Eof => log::debug!("kvxfer: TCP lane peer {peer} closed"),
            Stop::Io(e) => log::info!("kvxfer: TCP lane peer {peer}: {e}"),
            Stop::Abort(e) => log::info!("kvxfer: TCP lane peer {peer} dropped: {e}"),
        }
    }
}

fn serve_inner(
    c: &TcpStream,
    ctx: &LaneCtx,
    secret: [u8; SECRET_LEN],
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
    let mut h = [0u8; HELLO_FIXED_LEN];
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
    let mut rest = vec![0u8; name_len + SECRET_LEN];
    recv_buf(c, &mut rest, &mut || ctl(false, &mut last))?;
    let (name, presented) = parse_hello_rest(&rest, name_len)
        .ok_or_else(|| Stop::Abort(Error::InvalidArgument("short hello".into())))?;
    if presented != secret {
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
        let mut hdr = [0u8; HEADER_LEN];
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
                let id = request_id(&hdr);
                let _ = reply(c, K_ACK, id, 1, &why, &mut || ctl(false, &mut last));
                return Err(Stop::Abort(Error::InvalidArgument(why)));
            }
        };
        // The segment table and the resolved pieces, charged to this agent's budget: a peer
        // cannot make the target allocate past it. No room within STALL: refuse and drop
        // the connection (the table cannot be skipped without reading it).
        let charge = ctx.budget.charge(
            (nsegs * SEG_LEN + nsegs * PIECE_BYTES) as u64,
            "TCP lane request",
            STALL,
        );
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
        let mut raw = vec![0u8; nsegs * SEG_LEN];
        recv_buf(c, &mut raw, &mut || ctl(false, &mut last))?;
        let segs = parse_segments(&raw).map_err(|w| Stop::Abort(Error::InvalidArgument(w)))?;
        drop(raw);
        let mut resolved = resolve_segs(ctx, &segs);
        let total: u64 = segs.iter().fold(0u64, |a, s| a.saturating_add(s.2));
        // Device pieces: the staging pools and two target chunks, or a refusal.
        let stage = match &resolved {
            Ok((_, _, devs)) => match target_stage(ctx, devs) {
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
                        deliver(ctx, &name, &note);
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
                        deliver(ctx, &name, &note);
                    }
                }
                Err(why) => reply(c, K_DATA, id, 1, &why, &mut || ctl(false, &mut last))?,
            }
        }
    }
}

fn deliver(ctx: &LaneCtx, name: &str, note: &[u8]) {
    match kvxfer_proto::wire::notify::decode(note) {
        Some(n) if n.from == name => ctx.channels.deliver(n),
        Some(n) => log::warn!(
            "kvxfer: TCP lane notification claims to be from {:?} on {name:?}'s connection; dropped",
            n.from
        ),
        None => log::warn!("kvxfer: malformed TCP lane notification from {name:?} dropped"),
    }
}

fn welcome(c: &TcpStream, status: u8, msg: &str) -> Result<(), Stop> {
    use std::io::Write;
    (&*c)
        .write_all(&encode_welcome(status, msg))
        .map_err(Stop::Io)
}

fn reply(
    c: &TcpStream,
    kind: u8,
    id: u64,
    status: u8,
    msg: &str,
    ctl: &mut dyn FnMut() -> Result<(), Stop>,
) -> Result<(), Stop> {
    send_buf(c, &encode_reply(kind, id, status, msg), ctl)
}
