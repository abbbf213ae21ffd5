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

use super::conn::{skip_paged, sum_segments, Conn};
use super::framed::{drain_frames, FramesFailed, RECV_BYTES, SEND_BYTES};
use super::identities::{Identities, Key};
use super::mixed::{stage_pair, stream_mixed, stream_windows, Framing};
use super::shares::{PeerCharge, Shares};
use super::stream::{set_timeouts, Stop};
use crate::gate::{Admission, Gate, Limits, Verdict};
use crate::lane::api::LaneCtx;
use crate::memory::Pins;
use crate::staging::pool::{ChunkPair, DeviceStaging};
use kvxfer_proto::error::{Error, Result, Side};
use kvxfer_proto::lane::{LaneTarget, TargetEvent};
use kvxfer_proto::lane_seal::{seal_record, LaneOpening, Opened};
use kvxfer_proto::paged::{resolve_paged, Paged, ResolvedPaged};
use kvxfer_proto::session::{Psk, StaticKey, SEED};
use kvxfer_proto::types::{LaneInfo, MemKind, RegionId, RegionSpan};
use kvxfer_proto::wire::lane::{Segment, Table, K_WRITE, SECRET_LEN};

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

/// An initiator's hello, from its accept to its proof of the lane secret (a real peer sends
/// it at once; a silent or trickling client is dropped after this).
const HELLO_DEADLINE: Duration = Duration::from_secs(5);
/// Connections that have not proven the lane secret yet; the oldest is dropped for a new one.
const PENDING: usize = 256;

/// A connection at the gate until its hello proved the lane secret: the target's core, fed
/// the hello, then handed to a serving thread as it is. With a shared secret the hello comes
/// out of a sealed opening ([`LaneOpening`]), and the session goes to the serving thread too.
struct Hello {
    t: LaneTarget,
    /// The core's clock.
    t0: Instant,
    /// With a shared secret: the Noise opening the hello must come through.
    opening: Option<LaneOpening>,
    /// The initiator seals the data too (its opening's mode).
    sealed_data: bool,
    /// With a secret: the static key the initiator proved.
    proved: Option<Key>,
    /// Whose key each name is.
    ids: Arc<Identities>,
    /// This target takes only initiators that seal the data ([`crate::AgentConfig::lane_encryption`]).
    require_sealed_data: bool,
}

impl Hello {
    /// Feeds the opened hello to the core, as the core asks for its parts.
    fn feed(&mut self, mut hello: &[u8]) -> Verdict {
        while let Some(n) = self.t.want().filter(|_| self.t.peer().is_none()) {
            if n > hello.len() {
                break;
            }
            self.t.on_bytes(&hello[..n], self.t0.elapsed());
            hello = &hello[n..];
            if self.t.is_closed() {
                return Verdict::Refuse("a bad hello or a wrong lane secret".into());
            }
        }
        let Some(peer) = self.t.peer().filter(|_| hello.is_empty()) else {
            self.t.refuse("a sealed hello of the wrong length");
            return Verdict::Refuse("a sealed hello of the wrong length".into());
        };
        // The name is the one whose metadata carried the key the handshake proved.
        if let Some(key) = &self.proved {
            if let Err(why) = self.ids.check(peer, key) {
                self.t.refuse(&why);
                return Verdict::Refuse(why);
            }
        }
        if self.require_sealed_data && !self.sealed_data {
            let why = "this target takes only sealed data (lane_encryption): set it on the \
                       initiator too";
            self.t.refuse(why);
            return Verdict::Refuse(why.into());
        }
        Verdict::Admit
    }
}

impl Admission for Hello {
    fn want(&self) -> usize {
        if let Some(o) = self.opening.as_ref().filter(|o| o.want() > 0) {
            return o.want();
        }
        if self.opening.as_ref().is_some_and(LaneOpening::is_closed) {
            return 0;
        }
        if self.t.peer().is_some() || self.t.is_closed() || self.opening.is_some() {
            return 0;
        }
        self.t.want().unwrap_or(0)
    }

    fn on_bytes(&mut self, b: &[u8], _now: Duration) -> Verdict {
        if let Some(o) = self.opening.as_mut() {
            return match o.on_bytes(b) {
                Opened::More => Verdict::More,
                Opened::Refused(why) => Verdict::Refuse(why),
                Opened::Hello {
                    hello,
                    sealed_data,
                    key,
                } => {
                    self.sealed_data = sealed_data;
                    self.proved = Some(key);
                    self.feed(&hello)
                }
            };
        }
        self.t.on_bytes(b, self.t0.elapsed());
        if self.t.peer().is_some() {
            // The welcome stays queued for the serving thread.
            return Verdict::Admit;
        }
        if self.t.is_closed() {
            return Verdict::Refuse("a bad hello or a wrong lane secret".into());
        }
        Verdict::More
    }

    fn take_output(&mut self) -> Vec<u8> {
        let mut out = self
            .opening
            .as_mut()
            .map(LaneOpening::take_output)
            .unwrap_or_default();
        // Before it is admitted the core only speaks to refuse: its welcome with the reason
        // (sealed, once there is a session).
        if self.t.is_closed() {
            let plain = self.opening.is_none();
            while let Some(ev) = self.t.poll_event() {
                if let TargetEvent::Transmit(b) = ev {
                    match self.opening.as_mut().and_then(LaneOpening::session) {
                        Some(s) => seal_record(s, &b, &mut out),
                        None if plain => out.extend_from_slice(&b),
                        None => {}
                    }
                }
            }
        }
        out
    }

    fn expired(&self, _now: Duration) -> bool {
        self.t.peer().is_none() && self.t0.elapsed() > HELLO_DEADLINE
    }
}

impl Server {
    /// Starts the target on `ip`, answering sealed openings as `key` and taking a hello's
    /// name only from the initiator whose key `ids` gives that name.
    pub(crate) fn start(
        ip: std::net::IpAddr,
        ctx: Arc<LaneCtx>,
        name: &str,
        key: &StaticKey,
        ids: Arc<Identities>,
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
                sealed_data: false,
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
            let t = std::thread::Builder::new()
                .name(format!("kvxfer-lane-{nm}-conn"))
                .spawn(move || {
                    let _slot = slot;
                    serve(c, sh, h, st2, &f2, &shares)
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
) {
    let peer = c.peer_addr().map(|a| a.to_string()).unwrap_or_default();
    let c = match hello.opening.take().map(LaneOpening::into_session) {
        None => Conn::open(c),
        Some(Some(session)) => Conn::sealed(c, session, hello.sealed_data, ctx.budget.clone()),
        Some(None) => {
            log::info!("kvxfer: TCP lane peer {peer}: admitted without its session (a bug)");
            let _ = c.shutdown(std::net::Shutdown::Both);
            return;
        }
    };
    if let Err(e) = serve_inner(&c, &ctx, hello, &stop, fence, shares) {
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
