//! The shared window's byte movers ([`kvxfer_proto::wire::lane_window`]): a sealed lane
//! connection between two processes of one host moves its data through two rings in a memory
//! file both map, two copies at memory speed instead of a trip through the kernel's TCP
//! stack, while the target still checks every request against the grants and every control
//! byte stays sealed on the socket.
//!
//! Each side keeps its own counts and reads the other's only through the pure checks, so a
//! peer that scribbles on the window ends the connection and reaches no memory but the
//! window's. A side waiting for room or bytes sleeps on the other's counter (a futex in the
//! shared file) at most [`TICK`] at a time, then asks its caller whether to go on, and looks
//! at the socket: a peer that died or closed ends the wait at once.

use std::cell::Cell;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use super::stream::{Ctl, Stop, TICK};
use crate::lane::shm_handover::{HandOver, Serves, Tickets};
use crate::memory::{HostBuffer, RegionTable};
use kvxfer_proto::error::{Error, Result};
use kvxfer_proto::wire::lane_window::{
    readable, ring_data, ring_header, run_at, writable, CONSUMED, CONSUMED_SEQ, CONSUMED_WAIT,
    PRODUCED, PRODUCED_SEQ, PRODUCED_WAIT, RING_TO_INITIATOR, RING_TO_TARGET, WINDOW_BYTES,
};

/// Bytes put or taken between two publications of a count: the other side starts on them
/// while this one copies the next.
const STEP: usize = 256 << 10;
/// Bytes moved between two looks at the socket (a connection closed under a stream stops
/// within this much).
const CHECK_BYTES: usize = 1 << 20;
/// Waits in a row that found nothing moved before each further one sleeps a millisecond.
const IDLE_WAKES: u32 = 64;

/// One side's view of a connection's window.
pub(super) struct Window {
    /// The target's own memory file, which lives as long as the window.
    _own: Option<HostBuffer>,
    /// The initiator's mapping of the file handed over, unmapped on drop.
    mapped: Option<*mut u8>,
    base: *mut u8,
    /// The ring this side writes and the one it reads.
    tx: usize,
    rx: usize,
    /// This side's own counts, never read back from the window.
    produced: Cell<u64>,
    consumed: Cell<u64>,
    /// The other side's counts as last seen (they only grow).
    seen_consumed: Cell<u64>,
    seen_produced: Cell<u64>,
    /// Bytes moved since the socket was last looked at.
    unchecked: Cell<usize>,
    /// Waits in a row that found nothing moved.
    idle_wakes: Cell<u32>,
    /// The window's charge to the budget, held while it lives.
    _held: Box<dyn Send>,
    _counted: crate::live::Counted,
}

// SAFETY: the mapping belongs to this struct alone (its own memory file, or its own mapping of
// the peer's); the shared words are only touched atomically and the rings only copied; one
// connection thread uses it at a time.
unsafe impl Send for Window {}

impl Drop for Window {
    fn drop(&mut self) {
        if let Some(p) = self.mapped {
            // SAFETY: the mapping made in `map`, of WINDOW_BYTES, unmapped only here.
            unsafe { libc::munmap(p.cast(), WINDOW_BYTES) };
        }
    }
}

impl Window {
    /// The target's window: a sealed memory file of [`WINDOW_BYTES`] (its charge `held`), and
    /// its descriptor for the hand-over.
    pub(super) fn create(held: impl Send + 'static) -> Result<(Window, OwnedFd)> {
        let mut buf = HostBuffer::new(WINDOW_BYTES)?;
        let fd = buf
            .file()
            .ok_or_else(|| {
                Error::OutOfMemory("the lane window needs a memory file (memfd)".into())
            })?
            .try_clone()
            .map_err(|e| Error::io("the lane window's descriptor", e))?;
        let base = buf.as_mut_slice().as_mut_ptr();
        Ok((
            Window::new(
                (Some(buf), None),
                base,
                RING_TO_INITIATOR,
                RING_TO_TARGET,
                Box::new(held),
            ),
            fd,
        ))
    }

    /// The initiator's view of the window a target handed over as `fd`: a sealed memory file
    /// of this user of exactly [`WINDOW_BYTES`], or refused.
    pub(super) fn map(fd: OwnedFd, held: impl Send + 'static) -> Result<Window> {
        crate::memory::check_sealed_file(&fd, WINDOW_BYTES as u64, "the lane window")?;
        // SAFETY: an all-zero stat is a valid value to be overwritten by fstat.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fd is open; st is a valid out pointer.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0
            || st.st_size as u64 != WINDOW_BYTES as u64
        {
            return Err(Error::InvalidArgument(format!(
                "the lane window holds {} bytes, not {WINDOW_BYTES}",
                st.st_size
            )));
        }
        let p = crate::memory::map_shared(&fd, WINDOW_BYTES, true, "the lane window")?;
        Ok(Window::new(
            (None, Some(p)),
            p,
            RING_TO_TARGET,
            RING_TO_INITIATOR,
            Box::new(held),
        ))
    }

    fn new(
        (own, mapped): (Option<HostBuffer>, Option<*mut u8>),
        base: *mut u8,
        tx: usize,
        rx: usize,
        held: Box<dyn Send>,
    ) -> Window {
        Window {
            _own: own,
            mapped,
            base,
            tx,
            rx,
            produced: Cell::new(0),
            consumed: Cell::new(0),
            seen_consumed: Cell::new(0),
            seen_produced: Cell::new(0),
            unchecked: Cell::new(0),
            idle_wakes: Cell::new(0),
            _held: held,
            _counted: crate::live::Counted::lane_window(),
        }
    }

    fn u64_at(&self, ring: usize, off: usize) -> &AtomicU64 {
        // SAFETY: ring_header(ring) + off lies in the header page (ring < 2, off < 256) and is
        // 8-aligned in a page-aligned mapping of WINDOW_BYTES that lives as long as &self; the
        // word is only accessed atomically.
        unsafe { &*self.base.add(ring_header(ring) + off).cast::<AtomicU64>() }
    }

    fn u32_at(&self, ring: usize, off: usize) -> &AtomicU32 {
        // SAFETY: as u64_at, 4-aligned.
        unsafe { &*self.base.add(ring_header(ring) + off).cast::<AtomicU32>() }
    }

    /// Puts all of `b` into this side's ring, waiting for room as the reader takes.
    pub(super) fn send(&self, sock: &TcpStream, b: &[u8], ctl: &mut Ctl<'_>) -> Result<(), Stop> {
        let r = self.tx;
        let mut done = 0usize;
        while done < b.len() {
            let seq = self.u32_at(r, CONSUMED_SEQ).load(Ordering::SeqCst);
            let consumed = self.u64_at(r, CONSUMED).load(Ordering::SeqCst);
            let room = writable(consumed, self.produced.get(), self.seen_consumed.get())
                .map_err(out_of_step)?;
            self.seen_consumed.set(consumed);
            if room == 0 {
                self.wait(sock, r, CONSUMED_SEQ, CONSUMED_WAIT, seq, ctl)?;
                continue;
            }
            let n = (b.len() - done).min(room as usize).min(STEP);
            let mut put = 0;
            while put < n {
                let (off, k) = run_at(self.produced.get() + put as u64, (n - put) as u64);
                // SAFETY: [off, off + k) lies in ring r's data (run_at stops at its end) of
                // the mapping, which lives as long as &self; the reader does not touch these
                // bytes until `produced` says they are in (writable's check).
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        b[done + put..].as_ptr(),
                        self.base.add(ring_data(r) + off),
                        k,
                    )
                };
                put += k;
            }
            self.produced.set(self.produced.get() + n as u64);
            self.publish(
                r,
                PRODUCED,
                PRODUCED_SEQ,
                PRODUCED_WAIT,
                self.produced.get(),
            );
            done += n;
            self.still_open(sock, n)?;
            if done < b.len() {
                ctl(true)?;
            }
        }
        Ok(())
    }

    /// Takes exactly `b.len()` bytes from the other side's ring, waiting for them.
    pub(super) fn recv(
        &self,
        sock: &TcpStream,
        b: &mut [u8],
        ctl: &mut Ctl<'_>,
    ) -> Result<(), Stop> {
        let r = self.rx;
        let mut done = 0usize;
        while done < b.len() {
            let seq = self.u32_at(r, PRODUCED_SEQ).load(Ordering::SeqCst);
            let produced = self.u64_at(r, PRODUCED).load(Ordering::SeqCst);
            let ready = readable(produced, self.consumed.get(), self.seen_produced.get())
                .map_err(out_of_step)?;
            self.seen_produced.set(produced);
            if ready == 0 {
                self.wait(sock, r, PRODUCED_SEQ, PRODUCED_WAIT, seq, ctl)?;
                continue;
            }
            let n = (b.len() - done).min(ready as usize).min(STEP);
            let mut got = 0;
            while got < n {
                let (off, k) = run_at(self.consumed.get() + got as u64, (n - got) as u64);
                // SAFETY: [off, off + k) lies in ring r's data of the mapping, which lives as
                // long as &self; the writer put these bytes in before publishing `produced`
                // (readable's check) and does not reuse them until `consumed` says so. A
                // hostile writer may change them meanwhile: they are only copied, as bytes.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        self.base.add(ring_data(r) + off),
                        b[done + got..].as_mut_ptr(),
                        k,
                    )
                };
                got += k;
            }
            self.consumed.set(self.consumed.get() + n as u64);
            self.publish(
                r,
                CONSUMED,
                CONSUMED_SEQ,
                CONSUMED_WAIT,
                self.consumed.get(),
            );
            done += n;
            self.still_open(sock, n)?;
            if done < b.len() {
                ctl(true)?;
            }
        }
        Ok(())
    }

    /// Every [`CHECK_BYTES`] moved, whether the socket is still open: a connection a fence
    /// or a shutdown closed moves no more through its window, as it would move no more
    /// through its socket.
    fn still_open(&self, sock: &TcpStream, n: usize) -> Result<(), Stop> {
        self.idle_wakes.set(0);
        let since = self.unchecked.get() + n;
        if since < CHECK_BYTES {
            self.unchecked.set(since);
            return Ok(());
        }
        self.unchecked.set(0);
        if closed(sock) {
            return Err(Stop::Eof);
        }
        Ok(())
    }

    /// Publishes `count` in ring `r`'s word `at`, bumps its counter and wakes a sleeper.
    fn publish(&self, r: usize, at: usize, seq: usize, waiting: usize, count: u64) {
        self.u64_at(r, at).store(count, Ordering::SeqCst);
        let word = self.u32_at(r, seq);
        word.fetch_add(1, Ordering::SeqCst);
        if self.u32_at(r, waiting).swap(0, Ordering::SeqCst) != 0 {
            futex_wake(word);
        }
    }

    /// Sleeps until the other side bumps ring `r`'s counter `seq` past `seen` or [`TICK`]
    /// passes, then asks `ctl` whether to go on; a closed socket ends the wait.
    fn wait(
        &self,
        sock: &TcpStream,
        r: usize,
        seq: usize,
        waiting: usize,
        seen: u32,
        ctl: &mut Ctl<'_>,
    ) -> Result<(), Stop> {
        let word = self.u32_at(r, seq);
        self.u32_at(r, waiting).store(1, Ordering::SeqCst);
        if word.load(Ordering::SeqCst) == seen {
            futex_wait(word, seen);
        }
        // Woken or not, nothing has moved yet: the caller's clocks run, and a closed socket
        // ends the wait. A peer that bumps the counter without putting bytes in wakes this
        // side for nothing: past a few such wakes in a row, each costs a millisecond's sleep,
        // so it cannot make this thread spin until its stall limit ends the connection.
        let idle = self.idle_wakes.get() + 1;
        self.idle_wakes.set(idle);
        if idle > IDLE_WAKES {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        if closed(sock) {
            return Err(Stop::Eof);
        }
        ctl(false)
    }

    /// Moves `pieces` through the rings, as [`super::stream::stream_pieces`] does through the
    /// socket; once `fence` is set, no further step moves.
    ///
    /// # Safety
    /// Every piece is host memory valid for this direction (readable to send, writable to
    /// receive) and not freed or deregistered until the call returns.
    pub(super) unsafe fn pieces(
        &self,
        sock: &TcpStream,
        send: bool,
        pieces: &[(u64, u64)],
        fence: Option<&AtomicBool>,
        ctl: &mut Ctl<'_>,
    ) -> Result<(), Stop> {
        for &(a, l) in pieces.iter().filter(|p| p.1 > 0) {
            let mut off = 0u64;
            while off < l {
                if fence.is_some_and(|f| f.load(Ordering::Acquire)) {
                    return Err(Stop::Abort(Error::Canceled));
                }
                let k = (l - off).min(STEP as u64 * 4) as usize;
                let p = (a + off) as *mut u8;
                if send {
                    // SAFETY: the piece is readable host memory for its length (this
                    // function's contract).
                    self.send(sock, unsafe { std::slice::from_raw_parts(p, k) }, ctl)?;
                } else {
                    // SAFETY: the piece is writable host memory for its length, not aliased
                    // by any Rust reference while this call holds it (this function's
                    // contract).
                    self.recv(sock, unsafe { std::slice::from_raw_parts_mut(p, k) }, ctl)?;
                }
                off += k as u64;
            }
        }
        Ok(())
    }
}

/// A target's desk for windows: the Unix socket that hands each to the initiator holding its
/// ticket (the shm lane's hand-over, serving tickets).
pub(super) struct WindowDesk {
    handover: HandOver,
    tickets: Arc<Tickets>,
}

impl WindowDesk {
    pub(super) fn start(agent: &str, regions: Arc<RegionTable>) -> Result<WindowDesk> {
        let tickets: Arc<Tickets> = Arc::default();
        let handover = HandOver::start(agent, regions, Serves::Windows(tickets.clone()))?;
        Ok(WindowDesk { handover, tickets })
    }

    /// The socket's name, for an offer.
    pub(super) fn socket(&self) -> [u8; 16] {
        self.handover.info().socket
    }

    pub(super) fn tickets(&self) -> &Tickets {
        &self.tickets
    }
}

fn out_of_step(why: String) -> Stop {
    Stop::Abort(Error::InvalidArgument(format!("lane window: {why}")))
}

/// Sleeps while `word` holds `seen`, at most [`TICK`] (a wake-up, a change or the time-out
/// end it; so does a signal).
fn futex_wait(word: &AtomicU32, seen: u32) {
    let ts = libc::timespec {
        tv_sec: TICK.as_secs() as libc::time_t,
        tv_nsec: TICK.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is an aligned u32 in a shared mapping that outlives the call; FUTEX_WAIT
    // (not private: the other process waits and wakes on the same file page) only reads it
    // and sleeps at most `ts`.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            seen,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        )
    };
}

/// Wakes whoever sleeps on `word`.
fn futex_wake(word: &AtomicU32) {
    // SAFETY: `word` is an aligned u32 in a shared mapping that outlives the call; FUTEX_WAKE
    // does not touch it.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        )
    };
}

/// Whether the peer closed the connection (or its process died): the socket says so without
/// a byte being read.
fn closed(sock: &TcpStream) -> bool {
    let mut p = libc::pollfd {
        fd: sock.as_raw_fd(),
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one valid pollfd for the call; a zero time-out only looks.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n > 0 && p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::MemoryBudget;
    use std::net::{TcpListener, TcpStream};
    use std::time::Duration;

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (a, b)
    }

    fn charge() -> crate::budget::Charge {
        MemoryBudget::unlimited()
            .try_charge(WINDOW_BYTES as u64, "test")
            .unwrap()
    }

    fn go(_: bool) -> std::result::Result<(), Stop> {
        Ok(())
    }

    #[test]
    fn bytes_cross_both_ways_in_order_whatever_the_cuts() {
        let (target, fd) = Window::create(charge()).unwrap();
        let initiator = Window::map(fd, charge()).unwrap();
        let (sa, sb) = pair();
        let data: Vec<u8> = (0..9_000_000u32).map(|i| (i % 253) as u8).collect();
        std::thread::scope(|s| {
            let d = &data;
            let sa = &sa;
            s.spawn(move || {
                // Cuts that straddle the ring's end and the steps.
                let mut at = 0;
                for (i, len) in [1usize, 3 << 20, 7, 1 << 20, 5_000_000]
                    .iter()
                    .cycle()
                    .enumerate()
                {
                    if at == d.len() || i > 100 {
                        break;
                    }
                    let n = (*len).min(d.len() - at);
                    initiator.send(sa, &d[at..at + n], &mut go).unwrap();
                    at += n;
                }
                let mut back = vec![0u8; 1 << 20];
                initiator.recv(sa, &mut back, &mut go).unwrap();
                assert!(back.iter().all(|&b| b == 0x5a));
            });
            let mut got = vec![0u8; data.len()];
            let mut at = 0;
            for len in [2_500_000usize, 13, 4 << 20].iter().cycle() {
                if at == got.len() {
                    break;
                }
                let n = (*len).min(got.len() - at);
                target.recv(&sb, &mut got[at..at + n], &mut go).unwrap();
                at += n;
            }
            assert!(got == data, "the bytes arrived changed or out of order");
            target.send(&sb, &[0x5a; 1 << 20], &mut go).unwrap();
        });
    }

    #[test]
    fn a_count_out_of_step_ends_the_connection_and_a_closed_peer_ends_the_wait() {
        let (target, fd) = Window::create(charge()).unwrap();
        let initiator = Window::map(fd, charge()).unwrap();
        let (sa, sb) = pair();
        // The initiator claims more than the ring holds.
        initiator
            .u64_at(RING_TO_TARGET, PRODUCED)
            .store(u64::MAX / 2, Ordering::SeqCst);
        let mut b = [0u8; 8];
        let r = target.recv(&sb, &mut b, &mut go);
        assert!(
            matches!(&r, Err(Stop::Abort(Error::InvalidArgument(w))) if w.contains("out of step")),
            "{:?}",
            r.err().map(|_| ())
        );
        // Nothing comes and the peer goes: the wait ends with the close, not a stall.
        let (target, fd) = Window::create(charge()).unwrap();
        let _initiator = Window::map(fd, charge()).unwrap();
        drop(sa);
        let t0 = std::time::Instant::now();
        let r = target.recv(&sb, &mut b, &mut go);
        assert!(matches!(r, Err(Stop::Eof)));
        assert!(t0.elapsed() < Duration::from_secs(2));
    }

    /// A peer that bumps the counter a reader sleeps on, and never puts a byte in, gets at
    /// most a wake-up a millisecond out of it (past the first few), and the reader's clocks
    /// keep running: its caller ends the wait.
    #[test]
    fn wakes_for_nothing_neither_spin_the_reader_nor_stop_its_clock() {
        let (target, fd) = Window::create(charge()).unwrap();
        let initiator = Window::map(fd, charge()).unwrap();
        let (_sa, sb) = pair();
        let stop = &AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(move || {
                let w = initiator.u32_at(RING_TO_TARGET, PRODUCED_SEQ);
                while !stop.load(Ordering::Relaxed) {
                    w.fetch_add(1, Ordering::SeqCst);
                    futex_wake(w);
                }
            });
            let t0 = std::time::Instant::now();
            let mut calls = 0u32;
            let mut ctl = |_moved: bool| -> std::result::Result<(), Stop> {
                calls += 1;
                if t0.elapsed() > Duration::from_millis(300) {
                    return Err(Stop::Abort(Error::Canceled));
                }
                Ok(())
            };
            let mut b = [0u8; 8];
            let r = target.recv(&sb, &mut b, &mut ctl);
            stop.store(true, Ordering::Relaxed);
            assert!(matches!(r, Err(Stop::Abort(Error::Canceled))));
            // About 300 sleeps of a millisecond and the first free wakes.
            assert!(calls < 1000, "{calls} wakes in 300 ms: the reader spun");
        });
    }

    /// The desk hands a window only to the asker presenting its ticket, once, from a socket
    /// of the process the initiator expects.
    #[test]
    fn a_window_is_handed_once_and_only_for_its_ticket() {
        use crate::lane::shm_handover::take_window;
        let desk = WindowDesk::start("t", Arc::default()).unwrap();
        let (target, fd) = Window::create(charge()).unwrap();
        let ticket = desk.tickets().offer(fd).unwrap().unwrap();
        let me = std::process::id();
        let mut wrong = ticket;
        wrong[31] ^= 1;
        let r = take_window(desk.socket(), wrong, me);
        assert!(r.is_err(), "a wrong ticket was handed the window");
        let r = take_window(desk.socket(), ticket, me + 1);
        assert!(
            r.is_err(),
            "taken from a socket of another process than expected"
        );
        let fd = take_window(desk.socket(), ticket, me).unwrap();
        let initiator = Window::map(fd, charge()).unwrap();
        assert!(
            take_window(desk.socket(), ticket, me).is_err(),
            "a ticket served twice"
        );
        assert!(
            !desk.tickets().withdraw(&ticket),
            "still on offer once taken"
        );
        // And it is the target's window.
        let (sa, sb) = pair();
        initiator.send(&sa, b"hello", &mut go).unwrap();
        let mut b = [0u8; 5];
        target.recv(&sb, &mut b, &mut go).unwrap();
        assert_eq!(&b, b"hello");
    }

    #[test]
    fn a_file_of_another_size_or_unsealed_is_not_mapped() {
        let small = HostBuffer::new(4096).unwrap();
        let fd = small.file().unwrap().try_clone().unwrap();
        assert!(Window::map(fd, charge()).is_err());
    }
}
