//! The door of every kvxfer listening socket (the side channel, the TCP lane): one thread with
//! an event loop (`poll(2)`) that accepts connections and runs their handshakes side by side
//! until each is admitted, refused, or out of time, so that a client that connects and says
//! nothing, or sends a byte a second, or opens hundreds of connections, delays nobody else.
//!
//! Bounds: at most `pending` connections in handshake, and no more than a quarter of the
//! process's descriptor limit (the oldest is dropped to admit a new one), each with a deadline for its whole handshake, and at most `bytes` buffered across
//! them (the connection holding the most is dropped first). Nothing here allocates per byte a
//! client announces, only per byte it sends. Out of descriptors, a waiting connection is
//! shed through a spare one (`fd_limit::Spare`) instead of spinning on the backlog. What a handshake means is the caller's
//! [`Admission`]: a pure state machine fed exactly the bytes it wants. An admitted
//! connection is handed over, blocking again, to the caller's `admit`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvxfer_proto::error::{Error, Result};

/// One connection's handshake, as the gate drives it.
pub(crate) trait Admission: Send + 'static {
    /// Bytes to read next (exactly); 0 while the handshake reads nothing more.
    fn want(&self) -> usize;
    /// The `want()` bytes read, at `now` (since the gate started).
    fn on_bytes(&mut self, b: &[u8], now: Duration) -> Verdict;
    /// Bytes to send now.
    fn take_output(&mut self) -> Vec<u8>;
    /// Whether the handshake ran out of time at `now`.
    fn expired(&self, now: Duration) -> bool;
}

/// What the gate does with a connection after its bytes.
#[derive(Debug)]
pub(crate) enum Verdict {
    /// Keep reading.
    More,
    /// Send the output, then hand the connection to `admit`.
    Admit,
    /// Send the output (best effort), then close; the reason is logged.
    Refuse(String),
}

/// The gate's bounds.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// Connections in handshake at once.
    pub(crate) pending: usize,
    /// Bytes buffered across them.
    pub(crate) bytes: usize,
}

/// A listening socket's gate thread; stopped and joined on drop.
pub(crate) struct Gate {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

struct Conn<A> {
    s: TcpStream,
    who: SocketAddr,
    a: A,
    /// Bytes read towards `a.want()`.
    buf: Vec<u8>,
    out: Vec<u8>,
    end: End,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum End {
    Open,
    /// Flush, then admit.
    Admit,
    /// Flush (best effort), then close.
    Close,
}

/// How often the gate looks at its stop flag when nothing happens.
const TICK: Duration = Duration::from_millis(100);
/// Bytes read from one connection per wake-up.
const READ_CHUNK: usize = 64 << 10;

impl Gate {
    /// Serves `l` on a thread named `name`: `open(peer, now)` makes each connection's
    /// handshake, `admit(stream, handshake)` takes the admitted ones.
    pub(crate) fn start<A, O, F>(
        l: TcpListener,
        name: &str,
        limits: Limits,
        open: O,
        admit: F,
    ) -> Result<Gate>
    where
        A: Admission,
        O: Fn(SocketAddr, Duration) -> Result<A> + Send + 'static,
        F: FnMut(TcpStream, A) + Send + 'static,
    {
        let addr = l
            .local_addr()
            .map_err(|e| Error::io("querying a listening address", e))?;
        l.set_nonblocking(true)
            .map_err(|e| Error::io("making a listener non-blocking", e))?;
        let stop = Arc::new(AtomicBool::new(false));
        let st = stop.clone();
        let thread = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || run(l, limits, open, admit, &st))
            .map_err(|e| Error::io(format!("spawning {name}"), e))?;
        Ok(Gate {
            addr,
            stop,
            thread: Some(thread),
        })
    }

    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run<A, O, F>(l: TcpListener, limits: Limits, open: O, mut admit: F, stop: &AtomicBool)
where
    A: Admission,
    O: Fn(SocketAddr, Duration) -> Result<A>,
    F: FnMut(TcpStream, A),
{
    let t0 = Instant::now();
    // Handshakes hold a descriptor each: at most a quarter of the process's.
    let limits = Limits {
        pending: crate::fd_limit::nofile().map_or(limits.pending, |n| {
            limits
                .pending
                .min(usize::try_from(n / 4).unwrap_or(usize::MAX).max(8))
        }),
        ..limits
    };
    let mut spare = crate::fd_limit::Spare::new();
    let mut conns: Vec<Conn<A>> = Vec::new();
    let mut chunk = vec![0u8; READ_CHUNK];
    // Rebuilt every wake-up (the connections change), allocated once.
    let mut fds: Vec<libc::pollfd> = Vec::new();
    while !stop.load(Ordering::Acquire) {
        fds.clear();
        fds.push(libc::pollfd {
            fd: l.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        });
        for c in &conns {
            let mut ev = 0;
            if c.end == End::Open && c.a.want() > 0 {
                ev |= libc::POLLIN;
            }
            if !c.out.is_empty() {
                ev |= libc::POLLOUT;
            }
            fds.push(libc::pollfd {
                fd: c.s.as_raw_fd(),
                events: ev,
                revents: 0,
            });
        }
        // SAFETY: `fds` is a live, initialised array of `fds.len()` pollfd structs for the
        // duration of the call; poll(2) only writes their `revents`.
        let n = unsafe {
            libc::poll(
                fds.as_mut_ptr(),
                fds.len() as libc::nfds_t,
                TICK.as_millis() as i32,
            )
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                log::warn!("kvxfer gate: poll: {e}");
                std::thread::sleep(Duration::from_millis(10));
            }
            continue;
        }
        let now = t0.elapsed();
        // Existing connections first (their indices match `fds[1..]`).
        for (c, p) in conns.iter_mut().zip(&fds[1..]) {
            if p.revents & (libc::POLLERR | libc::POLLNVAL) != 0 {
                c.end = End::Close;
                c.out.clear();
                continue;
            }
            if p.revents & libc::POLLOUT != 0 {
                flush(c);
            }
            if p.revents & (libc::POLLIN | libc::POLLHUP) != 0 && c.end == End::Open {
                read_some(c, &mut chunk, now);
            }
        }
        if fds[0].revents & libc::POLLIN != 0 {
            accept_all(&l, &mut conns, limits, &open, now, &mut spare);
        }
        // Expired handshakes, then the byte bound.
        for c in conns.iter_mut().filter(|c| c.end == End::Open) {
            if c.a.expired(now) {
                log::info!(
                    "kvxfer: {} did not finish its handshake in time: dropped",
                    c.who
                );
                c.end = End::Close;
                c.out.clear();
            }
        }
        let mut held: usize = conns.iter().map(|c| c.buf.len() + c.out.len()).sum();
        while held > limits.bytes {
            let Some(big) = conns
                .iter_mut()
                .filter(|c| !(c.end == End::Close && c.out.is_empty()))
                .max_by_key(|c| c.buf.len() + c.out.len())
            else {
                break;
            };
            log::info!(
                "kvxfer: {} holds {} handshake bytes, over the gate's {}: dropped",
                big.who,
                big.buf.len() + big.out.len(),
                limits.bytes
            );
            held -= big.buf.len() + big.out.len();
            big.buf = Vec::new();
            big.out = Vec::new();
            big.end = End::Close;
        }
        // Hand over or close what is finished.
        let mut i = 0;
        while i < conns.len() {
            let c = &conns[i];
            let flushed = c.out.is_empty();
            match c.end {
                End::Admit if flushed => {
                    let c = conns.remove(i);
                    if c.s.set_nonblocking(false).is_ok() {
                        admit(c.s, c.a);
                    }
                }
                End::Close if flushed => {
                    conns.remove(i);
                }
                _ => i += 1,
            }
        }
    }
}

fn accept_all<A, O>(
    l: &TcpListener,
    conns: &mut Vec<Conn<A>>,
    limits: Limits,
    open: &O,
    now: Duration,
    spare: &mut crate::fd_limit::Spare,
) where
    A: Admission,
    O: Fn(SocketAddr, Duration) -> Result<A>,
{
    loop {
        let (s, who) = match l.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
            Err(e) if crate::fd_limit::exhausted(&e) => {
                // Out of descriptors: the waiting connection is shed (closed at once) rather
                // than left in the backlog, where the listener would stay readable and this
                // loop spin; what is pending keeps going.
                if spare.shed(l) {
                    log::warn!("kvxfer gate: out of file descriptors: a connection was shed");
                } else {
                    log::warn!("kvxfer gate: accept: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                    return;
                }
                continue;
            }
            Err(e) => {
                log::warn!("kvxfer gate: accept: {e}");
                return;
            }
        };
        if s.set_nonblocking(true).is_err() {
            continue;
        }
        let _ = s.set_nodelay(true);
        let mut a = match open(who, now) {
            Ok(a) => a,
            Err(e) => {
                log::warn!("kvxfer gate: {who}: {e}");
                continue;
            }
        };
        // Full: the oldest handshake still open makes room (an idle flood cannot lock the
        // door; a real peer's handshake takes milliseconds, so it is rarely the oldest).
        if conns.len() >= limits.pending {
            let oldest = conns.iter().position(|c| c.end == End::Open).unwrap_or(0);
            let c = conns.remove(oldest);
            log::info!(
                "kvxfer: {} handshakes pending (the limit): dropped the oldest, {}",
                limits.pending,
                c.who
            );
        }
        let out = a.take_output();
        let mut c = Conn {
            s,
            who,
            a,
            buf: Vec::new(),
            out,
            end: End::Open,
        };
        flush(&mut c);
        conns.push(c);
    }
}

/// Reads what has arrived, feeding the handshake each time it has the bytes it wants.
fn read_some<A: Admission>(c: &mut Conn<A>, chunk: &mut [u8], now: Duration) {
    loop {
        let want = c.a.want();
        if want == 0 || c.end != End::Open {
            return;
        }
        let room = (want - c.buf.len()).min(chunk.len());
        match c.s.read(&mut chunk[..room]) {
            Ok(0) => {
                c.end = End::Close;
                c.out.clear();
                return;
            }
            Ok(n) => {
                c.buf.extend_from_slice(&chunk[..n]);
                if c.buf.len() == want {
                    let b = std::mem::take(&mut c.buf);
                    let v = c.a.on_bytes(&b, now);
                    c.out.extend_from_slice(&c.a.take_output());
                    match v {
                        Verdict::More => {}
                        Verdict::Admit => c.end = End::Admit,
                        Verdict::Refuse(why) => {
                            log::info!("kvxfer: {} refused: {why}", c.who);
                            c.end = End::Close;
                        }
                    }
                    flush(c);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => {
                c.end = End::Close;
                c.out.clear();
                return;
            }
        }
    }
}

/// Writes what the socket takes now.
fn flush<A>(c: &mut Conn<A>) {
    while !c.out.is_empty() {
        match c.s.write(&c.out) {
            Ok(0) => break,
            Ok(n) => {
                c.out.drain(..n);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => {
                c.out.clear();
                c.end = End::Close;
                return;
            }
        }
    }
}
