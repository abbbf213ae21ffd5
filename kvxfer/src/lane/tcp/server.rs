//! The lane's target: a listener behind a [`Gate`] (hellos checked side by side, each with a
//! deadline, the unproven ones bounded), one thread per connection that proved the lane
//! secret, each request checked against this agent's registered regions and pinned while the
//! stream reads into or sends from them.

use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::admission::{Hello, HELLO_DEADLINE};
use super::conn::{skip_paged, sum_segments, Conn};
use super::framed::{drain_frames, FramesFailed, RECV_BYTES, SEND_BYTES};
use super::identities::Identities;
use super::mixed::{stage_pair, stream_mixed, stream_windows, Framing};
use super::shares::{PeerCharge, Shares};
use super::stream::{set_timeouts, Stop};
use super::window::{Window, WindowDesk};
use crate::gate::{Admission, Gate, Limits};
use crate::lane::api::LaneCtx;
use crate::memory::Pins;
use crate::staging::pool::{ChunkPair, DeviceStaging};
use kvxfer_proto::error::{Error, Result, Side};
use kvxfer_proto::lane::{LaneTarget, TargetEvent};
use kvxfer_proto::lane_seal::LaneOpening;
use kvxfer_proto::paged::{resolve_paged, Paged, ResolvedPaged};
use kvxfer_proto::session::{Psk, StaticKey, SEED};
use kvxfer_proto::types::{LaneInfo, MemKind, RegionId, RegionSpan};
use kvxfer_proto::wire::lane::{DataMode, Segment, Table, K_WRITE, SECRET_LEN};
use kvxfer_proto::wire::lane_window::{decode_ack, WindowOffer, WINDOW_BYTES};

/// How long a request waits for its table's budget before it is refused.
const BUDGET_WAIT: Duration = Duration::from_secs(30);

/// The lane's listener and its connections.
pub(crate) struct Server {
    info: LaneInfo,
    stop: Arc<AtomicBool>,
    gate: Option<Gate>,
    conns: Arc<Mutex<Conns>>,
}

/// The serving connections, and how many times each peer was fenced (its epoch): a hello that
/// names an older epoch (its transfer was queued before the initiator learned of the last
/// fence) is refused with the count, however late it connected. Both under one lock, so that
/// no admission slips between a fence and its check.
#[derive(Default)]
struct Conns {
    served: Vec<Served>,
    fenced: std::collections::HashMap<String, u64>,
}

/// A connection's serving thread, its socket (shut down to stop the thread at once, even in
/// the middle of a stream), the peer that proved the secret on it, and its fence (set: the
/// thread moves no further byte into memory).
struct Served {
    thread: JoinHandle<()>,
    sock: Option<TcpStream>,
    peer: String,
    fence: Arc<AtomicBool>,
}

/// Connections that have not proven the lane secret yet; the oldest is dropped for a new one.
const PENDING: usize = 256;

impl Server {
    /// Starts the target on `ip`, answering sealed openings as `key` and taking a hello's
    /// name only from the initiator whose key `ids` gives that name.
    ///
    /// `window`: with a secret, offer same-host initiators in window mode a window to move the
    /// data through ([`kvxfer_proto::wire::lane_window`]).
    pub(crate) fn start(
        ip: std::net::IpAddr,
        ctx: Arc<LaneCtx>,
        name: &str,
        key: &StaticKey,
        ids: Arc<Identities>,
        window: bool,
    ) -> Result<Server> {
        let l = TcpListener::bind(SocketAddr::new(ip, 0))
            .map_err(|e| Error::io(format!("binding the TCP lane on {ip}"), e))?;
        let addr = l
            .local_addr()
            .map_err(|e| Error::io("querying the TCP lane address", e))?;
        let secret: [u8; SECRET_LEN] = crate::random::bytes()?;
        let info = LaneInfo {
            addr,
            secret,
            key: key.public(),
        };
        let key = key.clone();
        let stop = Arc::new(AtomicBool::new(false));
        let conns: Arc<Mutex<Conns>> = Arc::default();
        let (st, cs, nm) = (stop.clone(), conns.clone(), name.to_string());
        let stall = ctx.stall;
        let psk = ctx.secret.as_deref().map(|s| Psk::lane(s, &secret));
        let require_sealed_data = ctx.seal_data;
        let shares = Shares::new(ctx.budget.clone());
        let desk = match (window, &ctx.secret) {
            (true, Some(_)) => Some(Arc::new(WindowDesk::start(name, ctx.regions.clone())?)),
            _ => None,
        };
        let open = move |who: SocketAddr, _now: Duration| {
            let t0 = Instant::now();
            let opening = match &psk {
                Some(psk) => {
                    let seed = crate::random::bytes::<SEED>()?;
                    let who = who.to_string();
                    Some(LaneOpening::new(psk.clone(), key.clone(), seed, &who))
                }
                None => None,
            };
            Ok(Hello {
                t: LaneTarget::new(secret, stall, t0.elapsed()),
                t0,
                opening,
                mode: DataMode::Clear,
                require_sealed_data,
                proved: None,
                ids: ids.clone(),
            })
        };
        // Only a connection that proved the lane secret gets a thread of its own.
        let admit = move |c: TcpStream, mut h: Hello| {
            let (st2, sh) = (st.clone(), ctx.clone());
            let sock = c.try_clone().ok();
            let peer = h.t.peer().unwrap_or_default().to_string();
            let mut g = cs.lock().unwrap_or_else(|e| e.into_inner());
            let epoch = g.fenced.get(&peer).copied().unwrap_or(0);
            if h.t.epoch() < epoch {
                // Its transfer was queued before the peer learned of the fence: told the
                // count (for what it queues next), and closed.
                log::info!(
                    "kvxfer: TCP lane: a connection of fenced peer {peer:?} (epoch {} < {epoch}) refused",
                    h.t.epoch()
                );
                h.t.refuse_fenced(epoch);
                refuse(&c, &mut h);
                return;
            }
            let slot = match shares.connect(&peer) {
                Ok(s) => s,
                Err(why) => {
                    log::warn!("kvxfer: TCP lane: a connection refused: {why}");
                    let _ = c.shutdown(std::net::Shutdown::Both);
                    return;
                }
            };
            let fence = Arc::new(AtomicBool::new(false));
            let f2 = fence.clone();
            let shares = shares.clone();
            let desk = desk.clone();
            let t = std::thread::Builder::new()
                .name(format!("kvxfer-lane-{nm}-conn"))
                .spawn(move || {
                    let _slot = slot;
                    serve(c, sh, h, st2, &f2, &shares, desk.as_deref())
                });
            if let Ok(thread) = t {
                g.served.retain(|s| !s.thread.is_finished());
                g.served.push(Served {
                    thread,
                    sock,
                    peer,
                    fence,
                });
            }
        };
        let gate = Gate::start(
            l,
            &format!("kvxfer-lane-{name}"),
            Limits {
                pending: PENDING,
                bytes: 1 << 20,
            },
            open,
            admit,
        )?;
        Ok(Server {
            info,
            stop,
            gate: Some(gate),
            conns,
        })
    }

    pub(crate) fn info(&self) -> LaneInfo {
        self.info
    }

    /// Fences `peer`'s writes: its connections are closed and their threads waited for, and
    /// its epoch counted up, so that once this returns nothing it sent before (queued in a
    /// socket, at the gate, or mid-stream) and no transfer it queued before it learns of the
    /// fence (however late its connection opens) is written into memory. Returns the
    /// connections closed.
    pub(crate) fn fence(&self, peer: &str) -> usize {
        let mine: Vec<Served> = {
            let mut g = self.conns.lock().unwrap_or_else(|e| e.into_inner());
            *g.fenced.entry(peer.to_string()).or_default() += 1;
            let (mine, rest) = std::mem::take(&mut g.served)
                .into_iter()
                .partition(|s| s.peer == peer);
            g.served = rest;
            mine
        };
        for s in &mine {
            s.fence.store(true, Ordering::Release);
            if let Some(c) = &s.sock {
                let _ = c.shutdown(std::net::Shutdown::Both);
            }
        }
        let n = mine.len();
        for s in mine {
            let _ = s.thread.join();
        }
        n
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        self.gate.take();
        let conns =
            std::mem::take(&mut self.conns.lock().unwrap_or_else(|e| e.into_inner()).served);
        // A connection in the middle of a stream never times out: closing its socket ends
        // the stream (the peer's transfer fails typed) and the thread with it.
        for s in &conns {
            s.fence.store(true, Ordering::Release);
            if let Some(c) = &s.sock {
                let _ = c.shutdown(std::net::Shutdown::Both);
            }
        }
        for s in conns {
            let _ = s.thread.join();
        }
    }
}

/// Sends a refused hello its welcome (best effort, bounded), then closes the connection.
fn refuse(mut c: &TcpStream, h: &mut Hello) {
    let _ = c.set_write_timeout(Some(Duration::from_secs(1)));
    let _ = c.write_all(&h.take_output());
    let _ = c.shutdown(std::net::Shutdown::Both);
}

/// Who a request's table is resolved for: the peer the lane session named, reading or
/// writing. A restricted region opens only inside the grants that peer holds.
struct Access<'a> {
    peer: &'a str,
    write: bool,
}

/// Checks `segs` against the registered regions and the grants of `who`, and pins them.
/// Returns the pieces (addresses) and, where any piece is device memory, the device of each
/// piece.
fn resolve_segs(ctx: &LaneCtx, segs: &[Segment], who: &Access<'_>) -> Result<Resolved, String> {
    let regions = ctx.regions.read();
    let grants = ctx.grants.read().unwrap_or_else(|e| e.into_inner());
    let grants = grants.access(who.peer, who.write);
    let mut pins = Pins::default();
    let mut pieces: Vec<(u64, u64)> = Vec::with_capacity(segs.len());
    let mut devs: Vec<Option<u32>> = Vec::new();
    for (k, s) in segs.iter().enumerate() {
        let (id, off, len) = (s.region, s.offset, s.len);
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
        grants
            .check(id, off, len)
            .map_err(|e| format!("segment #{k}: {e}"))?;
        if pins.add(r).is_err() {
            return Err(format!("segment #{k}: region {id} is being deregistered"));
        }
        pieces.push((r.addr + off, len));
    }
    Ok(Resolved {
        _pins: pins,
        data: Data::Flat(pieces),
        devs,
    })
}

/// Checks a paged table's entries against the registered regions (each block inside its
/// region, the largest index deciding: nothing is expanded) and, in a restricted region, each
/// block against the grants of `who`; pins the regions.
fn resolve_entries(ctx: &LaneCtx, entries: &[Paged], who: &Access<'_>) -> Result<Resolved, String> {
    let regions = ctx.regions.read();
    let table = ctx.grants.read().unwrap_or_else(|e| e.into_inner());
    let grants = table.access(who.peer, who.write);
    for (k, e) in entries.iter().enumerate() {
        let id = e.region.0;
        if !table.is_restricted(id) {
            grants
                .check_share(id)
                .map_err(|why| format!("entry #{k}: {why}"))?;
            continue;
        }
        for &b in e.blocks.iter() {
            let off = u64::from(b)
                .checked_mul(e.stride)
                .and_then(|o| o.checked_add(e.offset))
                .ok_or_else(|| format!("entry #{k}: block {b} lies past the address space"))?;
            grants
                .check(id, off, e.block_len)
                .map_err(|why| format!("entry #{k}: {why}"))?;
        }
    }
    let mut pins = Pins::default();
    let mut spans: Vec<RegionSpan> = Vec::new();
    let mut devs: Vec<Option<u32>> = Vec::new();
    for (k, e) in entries.iter().enumerate() {
        let id = e.region.0;
        if spans.iter().any(|s| s.id.0 == id) {
            continue;
        }
        let r = regions
            .get(&id)
            .ok_or_else(|| format!("entry #{k}: region {id} is not registered"))?;
        if pins.add(r).is_err() {
            return Err(format!("entry #{k}: region {id} is being deregistered"));
        }
        spans.push(RegionSpan {
            id: RegionId(id),
            base: r.addr,
            len: r.len,
            kind: r.kind,
        });
        devs.push(match r.kind {
            MemKind::Host => None,
            MemKind::Cuda(d) => Some(d),
        });
    }
    let list = resolve_paged(Side::Local, entries, &spans).map_err(|e| match e {
        Error::OutOfBounds {
            index,
            region,
            offset,
            len,
            region_len,
            ..
        } => format!(
            "entry #{index}: block [{offset}, +{len}) is outside region {region} of {region_len} bytes"
        ),
        Error::ZeroLength { index, .. } => format!("entry #{index}: blocks of 0 bytes"),
        e => e.to_string(),
    })?;
    if devs.iter().all(Option::is_none) {
        devs.clear();
    }
    Ok(Resolved {
        _pins: pins,
        data: Data::Paged(list),
        devs,
    })
}

/// A resolved request: its pins, where its data goes, and the devices (per piece of a flat
/// table, per region slot of a paged one; empty: all host).
struct Resolved {
    /// Held: the regions stay registered while the data moves.
    _pins: Pins,
    data: Data,
    devs: Vec<Option<u32>>,
}

/// Where a request's data goes: its pieces, or its paged entries walked a window at a time.
enum Data {
    Flat(Vec<(u64, u64)>),
    Paged(Vec<ResolvedPaged>),
}

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

fn serve(
    c: TcpStream,
    ctx: Arc<LaneCtx>,
    mut hello: Hello,
    stop: Arc<AtomicBool>,
    fence: &AtomicBool,
    shares: &Arc<Shares>,
    desk: Option<&WindowDesk>,
) {
    let peer = c.peer_addr().map(|a| a.to_string()).unwrap_or_default();
    let mut c = match hello.opening.take().map(LaneOpening::into_session) {
        None => Conn::open(c),
        Some(Some(session)) => Conn::sealed(
            c,
            session,
            hello.mode == DataMode::Sealed,
            ctx.budget.clone(),
        ),
        Some(None) => {
            log::info!("kvxfer: TCP lane peer {peer}: admitted without its session (a bug)");
            let _ = c.shutdown(std::net::Shutdown::Both);
            return;
        }
    };
    let offered = if hello.mode == DataMode::Window {
        offer_window(&mut c, &mut hello, desk, shares, &stop)
    } else {
        Ok(())
    };
    if let Err(e) = offered.and_then(|()| serve_inner(&c, &ctx, hello, &stop, fence, shares)) {
        match e {
            Stop::Eof => log::debug!("kvxfer: TCP lane peer {peer} closed"),
            Stop::Io(e) => log::info!("kvxfer: TCP lane peer {peer}: {e}"),
            Stop::Abort(e) => log::info!("kvxfer: TCP lane peer {peer} dropped: {e}"),
        }
    }
    // The server keeps a clone of the socket (to fence it) until it prunes finished threads:
    // shut it down now, so that a dropped peer sees the close at once.
    c.shutdown();
}

fn serve_inner(
    c: &Conn,
    ctx: &LaneCtx,
    hello: Hello,
    stop: &AtomicBool,
    fence: &AtomicBool,
    shares: &Arc<Shares>,
) -> Result<(), Stop> {
    set_timeouts(c.sock())?;
    let Hello { mut t, t0, .. } = hello;
    // The request's budget charge, held until the core releases the request (not while the
    // connection idles after it), within its peer's share.
    let mut _charge: Option<PeerCharge> = None;
    loop {
        match step(c, ctx, &mut t, t0, stop, fence, None)? {
            Flow::Go => {}
            Flow::Admit(table_bytes) => {
                _charge = None;
                let peer = t.peer().unwrap_or_default().to_string();
                match shares.charge(&peer, table_bytes, "TCP lane request", BUDGET_WAIT) {
                    Ok(ch) => {
                        _charge = Some(ch);
                        t.admitted(Ok(()));
                    }
                    Err(e) => t.admitted(Err(e.to_string())),
                }
            }
            Flow::Resolve(table, write) => {
                // The pieces, their staging, their chunks: held until the core releases them.
                let total = table.total();
                // Who asks: the name the lane session gave, checked against its grants.
                let who = Access {
                    peer: t.peer().unwrap_or_default(),
                    write,
                };
                let mut resolved = match &table {
                    Table::Flat(segs) => resolve_segs(ctx, segs, &who),
                    Table::Paged(p) => resolve_entries(ctx, &p.entries, &who),
                };
                drop(table);
                let stage = match &resolved {
                    Ok(r) => match target_stage(ctx, &r.devs) {
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
                        let p = stage_pair(st, false, STAGE_WAIT, &mut |moved| {
                            tick(&mut t, t0, stop, moved)
                        })?;
                        if p.is_none() {
                            resolved =
                                Err(format!("all staging chunks stayed busy for {STAGE_WAIT:?}"));
                        }
                        p
                    }
                    None => None,
                };
                t.resolved(resolved.as_ref().map(|_| ()).map_err(Clone::clone), total);
                let pieces = resolved.as_ref().ok().map(|r| Pieces {
                    data: &r.data,
                    devs: &r.devs,
                    stage: stage.as_deref().zip(pair.as_ref()),
                });
                while step(c, ctx, &mut t, t0, stop, fence, pieces.as_ref())? != Flow::Released {}
                drop(pair);
                drop(resolved);
                _charge = None;
            }
            Flow::Released => _charge = None,
        }
    }
}

/// After the welcome of a connection in window mode: a window for its data, charged to the
/// peer's share and offered by a one-time ticket on `desk`'s socket, or none (no desk, no
/// room); the connection moves its data through the window once the initiator says it
/// took it. An initiator that says so without having taken it is dropped.
fn offer_window(
    c: &mut Conn,
    hello: &mut Hello,
    desk: Option<&WindowDesk>,
    shares: &Arc<Shares>,
    stop: &AtomicBool,
) -> Result<(), Stop> {
    let t0 = Instant::now();
    let mut ctl = |_moved: bool| -> Result<(), Stop> {
        if stop.load(Ordering::Acquire) {
            return Err(Stop::Abort(Error::Shutdown));
        }
        if t0.elapsed() > HELLO_DEADLINE {
            return Err(Stop::Abort(Error::InvalidArgument(
                "no answer to the window offer in time".into(),
            )));
        }
        Ok(())
    };
    // The welcome the core queued goes first.
    while let Some(ev) = hello.t.poll_event() {
        match ev {
            TargetEvent::Transmit(b) => c.send(&b, &mut ctl)?,
            TargetEvent::Accepted { name } => {
                log::debug!("kvxfer: TCP lane peer {name:?} accepted (window mode)")
            }
            _ => {
                return Err(Stop::Abort(Error::InvalidArgument(
                    "a request before the window offer (a bug)".into(),
                )))
            }
        }
    }
    let peer = hello.t.peer().unwrap_or_default().to_string();
    let made = desk.and_then(|d| {
        let held = shares
            .charge_window(&peer, WINDOW_BYTES as u64)
            .map_err(|e| log::info!("kvxfer: no lane window for {peer:?}: {e}"))
            .ok()?;
        let (w, fd) = Window::create(held)
            .map_err(|e| log::info!("kvxfer: no lane window for {peer:?}: {e}"))
            .ok()?;
        let ticket = d.tickets().offer(fd).ok().flatten()?;
        Some((w, ticket, d))
    });
    let Some((w, ticket, d)) = made else {
        return c.send(&WindowOffer::None.encode(), &mut ctl);
    };
    let offer = WindowOffer::Window {
        socket: d.socket(),
        ticket,
    };
    c.send(&offer.encode(), &mut ctl)?;
    let mut ack = [0u8; 1];
    let answered = c.recv(&mut ack, &mut ctl);
    let untaken = d.tickets().withdraw(&ticket);
    answered?;
    match decode_ack(ack[0]) {
        Ok(true) if untaken => Err(Stop::Abort(Error::protocol(
            &peer,
            "says it took its lane window, which is still on offer",
        ))),
        Ok(true) => {
            c.set_window(w);
            Ok(())
        }
        Ok(false) => Ok(()),
        Err(why) => Err(Stop::Abort(Error::protocol(&peer, why))),
    }
}

/// A request's resolved data, its devices and the staging chunks for device pieces.
struct Pieces<'a> {
    data: &'a Data,
    devs: &'a [Option<u32>],
    stage: Option<(&'a DeviceStaging, &'a ChunkPair<'a>)>,
}

/// What the connection loop does after a step.
#[derive(Debug, PartialEq, Eq)]
enum Flow {
    Go,
    /// Charge this many bytes, then answer the core.
    Admit(u64),
    /// Resolve this table (of a write: `true`) and hold it until released.
    Resolve(Table, bool),
    /// The core released the current request's pieces.
    Released,
}

/// One event of the core, or one read of control bytes when it has none.
fn step(
    c: &Conn,
    ctx: &LaneCtx,
    t: &mut LaneTarget,
    t0: Instant,
    stop: &AtomicBool,
    fence: &AtomicBool,
    pieces: Option<&Pieces<'_>>,
) -> Result<Flow, Stop> {
    let Some(ev) = t.poll_event() else {
        let Some(n) = t.want() else {
            return Err(Stop::Abort(Error::InvalidArgument(
                "the lane protocol stopped without closing (a bug)".into(),
            )));
        };
        let mut buf = vec![0u8; n];
        if t.idle() {
            // Between requests only shutdown ends the wait; once a byte arrived, the stall
            // clock runs.
            c.recv_first(&mut buf, &mut |moved| tick(t, t0, stop, moved))?;
        } else {
            c.recv(&mut buf, &mut |moved| tick(t, t0, stop, moved))?;
        }
        t.on_bytes(&buf, t0.elapsed());
        return Ok(Flow::Go);
    };
    let peer = t.peer().unwrap_or_default().to_string();
    let mut ctl = |moved| tick(t, t0, stop, moved);
    match ev {
        TargetEvent::Transmit(b) => c.send(&b, &mut ctl)?,
        TargetEvent::Accepted { name } => log::debug!("kvxfer: TCP lane peer {name:?} accepted"),
        TargetEvent::Admit {
            table_bytes,
            header,
        } => {
            (ctx.peer_used)(&peer);
            // Compressed data: the frame buffers and planes, charged with the table.
            let codec = if header.frames.is_some() {
                RECV_BYTES.max(SEND_BYTES * ctx.compress_threads.max(1) as u64)
            } else {
                0
            };
            return Ok(Flow::Admit(table_bytes + codec));
        }
        TargetEvent::SkipSegments { nsegs } => {
            let total = sum_segments(c, nsegs, &mut ctl)?;
            t.skipped(total);
        }
        TargetEvent::SkipPaged { bytes } => {
            let total = skip_paged(c, bytes, &mut ctl)?;
            t.skipped(total);
        }
        TargetEvent::Resolve { table, header } => {
            return Ok(Flow::Resolve(table, header.kind == K_WRITE))
        }
        TargetEvent::ReceiveData { frames } | TargetEvent::SendData { frames } => {
            let send = matches!(ev, TargetEvent::SendData { .. });
            let p = pieces.ok_or_else(|| {
                Stop::Abort(Error::InvalidArgument("data without pieces (a bug)".into()))
            })?;
            let framing = frames.map(|transform| Framing {
                transform,
                peer: &peer,
                threads: ctx.compress_threads,
            });
            // SAFETY: the pieces (or the paged entries' blocks) were resolved against this
            // agent's registered regions, whose kinds `devs` gives, and the resolution's pins
            // hold them registered until the core releases them (after this data).
            let r = unsafe {
                match p.data {
                    Data::Flat(pieces) => stream_mixed(
                        c,
                        send,
                        pieces,
                        p.devs,
                        p.stage,
                        framing,
                        Some(fence),
                        &mut ctl,
                    ),
                    Data::Paged(list) => stream_windows(
                        c,
                        send,
                        list,
                        p.devs,
                        p.stage,
                        framing,
                        Some(fence),
                        &mut ctl,
                    ),
                }
            };
            match r {
                Ok(tally) if frames.is_some() && send => ctx.codec.encoded(&tally),
                Ok(tally) if frames.is_some() => ctx.codec.decoded(&tally),
                Ok(_) => {}
                Err(FramesFailed::Stop(s)) => return Err(s),
                Err(FramesFailed::Corrupt { left, error }) => {
                    // The frame arrived whole: the rest is drained and the write refused.
                    log::info!("kvxfer: TCP lane peer {peer}: compressed data refused: {error}");
                    drain_frames(c, left, &peer, &mut ctl)?;
                    t.data_failed(format!("compressed data: {error}"));
                    return Ok(Flow::Go);
                }
            }
            t.data_done();
        }
        TargetEvent::Drain { bytes, frames } => {
            match frames {
                Some(_) => drain_frames(c, bytes, &peer, &mut ctl)?,
                None => c.drain_data(bytes, &mut ctl)?,
            }
            t.data_done();
        }
        TargetEvent::Release => return Ok(Flow::Released),
        TargetEvent::Deliver(n) => ctx.channels.deliver(n),
        TargetEvent::Close { why } => return Err(Stop::Abort(Error::InvalidArgument(why))),
    }
    Ok(Flow::Go)
}

/// The byte movers' [`Ctl`](super::stream::Ctl): called after every socket time-out and between batches. Shutdown
/// ends the connection, and so does a peer that moved no byte mid-message for the stall limit;
/// bytes that moved (`moved`) restart that clock.
fn tick(t: &mut LaneTarget, t0: Instant, stop: &AtomicBool, moved: bool) -> Result<(), Stop> {
    if stop.load(Ordering::Acquire) {
        return Err(Stop::Abort(Error::Shutdown));
    }
    let now = t0.elapsed();
    if moved {
        t.progress(now);
    }
    t.handle_timeout(now);
    if t.is_closed() {
        return Err(Stop::Abort(Error::InvalidArgument(
            "peer stalled mid-message".into(),
        )));
    }
    Ok(())
}
