//! One lane connection as the lane's protocol code sees it: control messages (hello,
//! requests, tables, notifications, replies) and data (the blocks' bytes, their frames, their
//! staging chunks). Without a shared secret both go through the socket as they are. With one,
//! the connection carries a Noise session ([`kvxfer_proto::lane_seal`]): every control byte
//! travels in sealed records, and the data travels sealed too or as it is, as the initiator's
//! data mode says. A record is opened whole before a byte of it is used, so that changed bytes
//! never reach the protocol core or the registered memory.

use std::cell::RefCell;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};

use super::stream::{self, Ctl, Stop};
use super::window::Window;
use crate::budget::{Charge, MemoryBudget};
use kvxfer_proto::error::Error;
use kvxfer_proto::lane_seal::{record_len, record_size, seal_record_to, MAX_RECORD};
use kvxfer_proto::session::Session;
use kvxfer_proto::wire::lane::{paged_total, Segment, RECORD_LEN_BYTES, RECORD_PLAIN, SEG_LEN};

/// Bytes a sealed connection's buffers reach at most: the opened plaintext, a sealed record,
/// and the gathered data of a record.
pub(super) const SEALED_BYTES: u64 = (2 * RECORD_PLAIN + MAX_RECORD) as u64;
/// Records up to this size (hellos, headers, notifications, replies) are not charged, as the
/// open lane's own small buffers are not; the first larger one charges [`SEALED_BYTES`] for
/// the rest of the connection.
const SMALL_RECORD: usize = 64 << 10;
/// How long a large record waits for its charge before the connection fails.
const CHARGE_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// A lane connection: its socket and, with a shared secret, its session.
pub(super) struct Conn {
    sock: TcpStream,
    seal: Option<RefCell<Sealer>>,
    sealed_data: bool,
    /// Between two processes of one host: the window the data goes through instead.
    window: Option<Window>,
}

/// A session's record state: what was opened and not read yet, and the buffers reused for
/// every record.
struct Sealer {
    session: Session,
    /// Opened plaintext: `plain[pos..end]` is still to be read. The buffers only grow (no
    /// clearing or zeroing per record).
    plain: Vec<u8>,
    pos: usize,
    end: usize,
    /// A record's sealed bytes, in or out.
    wire: Vec<u8>,
    /// Gathered plaintext of sealed data.
    gather: Vec<u8>,
    /// Where the buffers are charged, and the charge once one grew past [`SMALL_RECORD`].
    budget: MemoryBudget,
    held: Option<Charge>,
}

impl Conn {
    /// A connection without a session (no shared secret): everything as it is.
    pub(super) fn open(sock: TcpStream) -> Conn {
        Conn {
            sock,
            seal: None,
            sealed_data: false,
            window: None,
        }
    }

    /// A connection under `session`; `sealed_data`: the data is sealed too; its record
    /// buffers are charged to `budget`.
    pub(super) fn sealed(
        sock: TcpStream,
        session: Session,
        sealed_data: bool,
        budget: MemoryBudget,
    ) -> Conn {
        Conn {
            sock,
            seal: Some(RefCell::new(Sealer {
                session,
                plain: Vec::new(),
                pos: 0,
                end: 0,
                wire: Vec::new(),
                gather: Vec::new(),
                budget,
                held: None,
            })),
            sealed_data,
            window: None,
        }
    }

    /// From now on the data goes through `w` (a sealed connection with clear data only: the
    /// window is its two ends' alone).
    pub(super) fn set_window(&mut self, w: Window) {
        debug_assert!(self.seal.is_some() && !self.sealed_data);
        self.window = Some(w);
    }

    /// The socket (for its options and its address).
    pub(super) fn sock(&self) -> &TcpStream {
        &self.sock
    }

    /// Closes both directions (a stream in the middle of a message ends with it).
    pub(super) fn shutdown(&self) {
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
    }

    /// Sends a control message.
    pub(super) fn send(&self, b: &[u8], ctl: &mut Ctl<'_>) -> Result<(), Stop> {
        match &self.seal {
            None => stream::send_buf(&self.sock, b, ctl),
            Some(s) => s.borrow_mut().send(&self.sock, b, None, ctl),
        }
    }

    /// Receives a control message.
    pub(super) fn recv(&self, b: &mut [u8], ctl: &mut Ctl<'_>) -> Result<(), Stop> {
        match &self.seal {
            None => stream::recv_buf(&self.sock, b, ctl),
            Some(s) => s.borrow_mut().recv(&self.sock, b, false, None, ctl),
        }
    }

    /// Like [`Conn::recv`], for the first bytes of a message that may be long in coming
    /// ([`stream::recv_first`]).
    pub(super) fn recv_first(&self, b: &mut [u8], ctl: &mut Ctl<'_>) -> Result<(), Stop> {
        match &self.seal {
            None => stream::recv_first(&self.sock, b, ctl),
            Some(s) => s.borrow_mut().recv(&self.sock, b, true, None, ctl),
        }
    }

    /// The sealer when the data is sealed; with clear data, checks that no opened control
    /// byte is left unread (the data would be out of step with it).
    fn data_sealer(&self) -> Result<Option<std::cell::RefMut<'_, Sealer>>, Stop> {
        match &self.seal {
            Some(s) if self.sealed_data => Ok(Some(s.borrow_mut())),
            Some(s) if s.borrow().pos < s.borrow().end => Err(Stop::Abort(Error::InvalidArgument(
                "lane data began inside a control record (out of step)".into(),
            ))),
            _ => Ok(None),
        }
    }

    /// Moves the bytes of `pieces` as data: sent from them when `send`, received into them
    /// otherwise ([`stream::stream_pieces`]); once `fence` is set, no further batch moves.
    ///
    /// # Safety
    /// Every piece is host memory valid for this direction (readable to send, writable to
    /// receive) and not freed or deregistered until the call returns.
    pub(super) unsafe fn pieces(
        &self,
        send: bool,
        pieces: &[(u64, u64)],
        fence: Option<&AtomicBool>,
        ctl: &mut Ctl<'_>,
    ) -> Result<(), Stop> {
        let Some(mut s) = self.data_sealer()? else {
            if let Some(w) = &self.window {
                // SAFETY: this function's contract.
                return unsafe { w.pieces(&self.sock, send, pieces, fence, ctl) };
            }
            // SAFETY: this function's contract.
            return unsafe { stream::stream_pieces(&self.sock, send, pieces, fence, ctl) };
        };
        if send {
            // SAFETY: the pieces are readable (this function's contract).
            unsafe { s.send_pieces(&self.sock, pieces, fence, ctl) }
        } else {
            for &(a, l) in pieces.iter().filter(|p| p.1 > 0) {
                // SAFETY: the piece is writable host memory for its length, not aliased by
                // any Rust reference while this call holds it (this function's contract).
                let b = unsafe { std::slice::from_raw_parts_mut(a as *mut u8, l as usize) };
                s.recv(&self.sock, b, false, fence, ctl)?;
            }
            Ok(())
        }
    }

    /// Sends a buffer of data (a frame, a staging chunk).
    pub(super) fn send_data(&self, b: &[u8], ctl: &mut Ctl<'_>) -> Result<(), Stop> {
        match self.data_sealer()? {
            None => match &self.window {
                Some(w) => w.send(&self.sock, b, ctl),
                None => stream::send_buf(&self.sock, b, ctl),
            },
            Some(mut s) => s.send(&self.sock, b, None, ctl),
        }
    }

    /// Receives a buffer of data.
    pub(super) fn recv_data(&self, b: &mut [u8], ctl: &mut Ctl<'_>) -> Result<(), Stop> {
        match self.data_sealer()? {
            None => match &self.window {
                Some(w) => w.recv(&self.sock, b, ctl),
                None => stream::recv_buf(&self.sock, b, ctl),
            },
            Some(mut s) => s.recv(&self.sock, b, false, None, ctl),
        }
    }

    /// Reads and discards `n` bytes of data (a refused request's).
    pub(super) fn drain_data(&self, mut n: u64, ctl: &mut Ctl<'_>) -> Result<(), Stop> {
        let mut scratch = vec![0u8; 64 * 1024];
        while n > 0 {
            let k = n.min(scratch.len() as u64) as usize;
            self.recv_data(&mut scratch[..k], ctl)?;
            n -= k as u64;
        }
        Ok(())
    }
}

impl Sealer {
    /// Charges the buffers before a record of `plain` bytes makes them grow past
    /// [`SMALL_RECORD`].
    fn room(&mut self, plain: usize) -> Result<(), Stop> {
        if plain > SMALL_RECORD && self.held.is_none() {
            let c = self
                .budget
                .charge(SEALED_BYTES, "TCP lane sealed records", CHARGE_WAIT)
                .map_err(Stop::Abort)?;
            self.held = Some(c);
        }
        Ok(())
    }

    /// Seals `b` as records of at most [`RECORD_PLAIN`] bytes and sends them.
    fn send(
        &mut self,
        sock: &TcpStream,
        b: &[u8],
        fence: Option<&AtomicBool>,
        ctl: &mut Ctl<'_>,
    ) -> Result<(), Stop> {
        for chunk in b.chunks(RECORD_PLAIN) {
            self.send_record(sock, chunk, fence, ctl)?;
        }
        Ok(())
    }

    fn send_record(
        &mut self,
        sock: &TcpStream,
        plain: &[u8],
        fence: Option<&AtomicBool>,
        ctl: &mut Ctl<'_>,
    ) -> Result<(), Stop> {
        if fence.is_some_and(|f| f.load(Ordering::Acquire)) {
            return Err(Stop::Abort(Error::Canceled));
        }
        self.room(plain.len())?;
        grow(&mut self.wire, record_size(plain.len()));
        let n = seal_record_to(&mut self.session, plain, &mut self.wire);
        stream::send_buf(sock, &self.wire[..n], ctl)
    }

    /// Gathers the bytes of `pieces` a record at a time, seals and sends them.
    ///
    /// # Safety
    /// Every piece is memory readable for its length until the call returns.
    unsafe fn send_pieces(
        &mut self,
        sock: &TcpStream,
        pieces: &[(u64, u64)],
        fence: Option<&AtomicBool>,
        ctl: &mut Ctl<'_>,
    ) -> Result<(), Stop> {
        let total: u64 = pieces.iter().map(|p| p.1).sum();
        self.room(total.min(RECORD_PLAIN as u64) as usize)?;
        let mut g = std::mem::take(&mut self.gather);
        g.clear();
        let mut r = Ok(());
        'pieces: for &(a, l) in pieces {
            let mut off = 0u64;
            while off < l {
                let take = (l - off).min((RECORD_PLAIN - g.len()) as u64) as usize;
                // SAFETY: [a + off, +take) lies inside the piece, readable per this
                // function's contract.
                let src = unsafe { std::slice::from_raw_parts((a + off) as *const u8, take) };
                g.extend_from_slice(src);
                off += take as u64;
                if g.len() == RECORD_PLAIN {
                    r = self
                        .send_record(sock, &g, fence, ctl)
                        .and_then(|()| ctl(true));
                    g.clear();
                    if r.is_err() {
                        break 'pieces;
                    }
                }
            }
        }
        if r.is_ok() && !g.is_empty() {
            r = self.send_record(sock, &g, fence, ctl);
        }
        self.gather = g;
        r
    }

    /// Fills `b` from opened records, reading and opening the next one whenever those are
    /// used up. `first`: the first bytes of a message, whose wait only shutdown ends.
    fn recv(
        &mut self,
        sock: &TcpStream,
        b: &mut [u8],
        first: bool,
        fence: Option<&AtomicBool>,
        ctl: &mut Ctl<'_>,
    ) -> Result<(), Stop> {
        let mut got = 0;
        while got < b.len() {
            if self.pos == self.end {
                if fence.is_some_and(|f| f.load(Ordering::Acquire)) {
                    return Err(Stop::Abort(Error::Canceled));
                }
                if got > 0 {
                    ctl(true)?;
                }
                self.read_record(sock, first && got == 0, ctl)?;
                continue;
            }
            let k = (b.len() - got).min(self.end - self.pos);
            b[got..got + k].copy_from_slice(&self.plain[self.pos..self.pos + k]);
            got += k;
            self.pos += k;
        }
        Ok(())
    }

    fn read_record(
        &mut self,
        sock: &TcpStream,
        first: bool,
        ctl: &mut Ctl<'_>,
    ) -> Result<(), Stop> {
        let mut prefix = [0u8; RECORD_LEN_BYTES];
        if first {
            stream::recv_first(sock, &mut prefix, ctl)?;
        } else {
            stream::recv_buf(sock, &mut prefix, ctl)?;
        }
        let who = || sock.peer_addr().map(|a| a.to_string()).unwrap_or_default();
        let n = record_len(&prefix, MAX_RECORD, who).map_err(Stop::Abort)?;
        self.room(n)?;
        grow(&mut self.wire, n);
        grow(&mut self.plain, n);
        stream::recv_buf(sock, &mut self.wire[..n], ctl)?;
        match self.session.open_to(&self.wire[..n], &mut self.plain) {
            Ok(r) => {
                (self.pos, self.end) = (r.start, r.end);
                Ok(())
            }
            Err(e) => {
                // What the failed open left is unauthenticated: none of it is ever read.
                (self.pos, self.end) = (0, 0);
                Err(Stop::Abort(e))
            }
        }
    }
}

/// `v` at least `n` bytes long (zeroed only where it grows).
fn grow(v: &mut Vec<u8>, n: usize) {
    if v.len() < n {
        v.resize(n, 0);
    }
}

/// Segments read per call while skipping a refused request's table.
const SKIP_SEGS: usize = 3276;

/// Reads a segment table of `n` entries in fixed-size chunks and returns the sum of lengths.
pub(super) fn sum_segments(c: &Conn, n: usize, ctl: &mut Ctl<'_>) -> Result<u64, Stop> {
    let mut chunk = vec![0u8; SEG_LEN * SKIP_SEGS];
    let mut left = n;
    let mut total = 0u64;
    while left > 0 {
        let k = left.min(SKIP_SEGS);
        c.recv(&mut chunk[..k * SEG_LEN], ctl)?;
        for s in chunk[..k * SEG_LEN].chunks_exact(SEG_LEN) {
            let mut a = [0u8; SEG_LEN];
            a.copy_from_slice(s);
            total = total.saturating_add(Segment::read(&a).len);
        }
        left -= k;
    }
    Ok(total)
}

/// Reads a refused request's paged table of `n` bytes in fixed-size chunks and returns the
/// total it starts with.
pub(super) fn skip_paged(c: &Conn, n: usize, ctl: &mut Ctl<'_>) -> Result<u64, Stop> {
    let mut chunk = vec![0u8; (SEG_LEN * SKIP_SEGS).min(n)];
    let mut left = n;
    let mut total = None;
    while left > 0 {
        let k = left.min(chunk.len());
        c.recv(&mut chunk[..k], ctl)?;
        if total.is_none() {
            // The header checked that a paged table holds at least its fixed part.
            let mut t = [0u8; 8];
            t.copy_from_slice(&chunk[..8]);
            total = Some(paged_total(&t));
        }
        left -= k;
    }
    Ok(total.unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvxfer_proto::session::{Initiator, Psk, StaticKey, SEED};

    /// Two connected sockets with one session's ends.
    fn pair(sealed_data: bool) -> (Conn, Conn) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        stream::set_timeouts(&a).unwrap();
        stream::set_timeouts(&b).unwrap();
        let psk = Psk::lane(b"s", b"l");
        let (ik, rk) = (
            StaticKey::from_seed([3; SEED]),
            StaticKey::from_seed([4; SEED]),
        );
        let (i, first) = Initiator::start_keyed(&psk, &ik, &rk.public(), [1; SEED], "b").unwrap();
        let (rs, answer, _) = Session::respond_keyed(&psk, &rk, [2; SEED], &first, "a").unwrap();
        let is = i.finish(&answer).unwrap();
        (
            Conn::sealed(a, is, sealed_data, MemoryBudget::unlimited()),
            Conn::sealed(b, rs, sealed_data, MemoryBudget::unlimited()),
        )
    }

    fn go(_: bool) -> Result<(), Stop> {
        Ok(())
    }

    #[test]
    fn control_and_data_cross_sealed_in_any_cut() {
        for sealed_data in [false, true] {
            let (a, b) = pair(sealed_data);
            let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
            let d2 = data.clone();
            let t = std::thread::spawn(move || {
                a.send(b"header", &mut go).ok().unwrap();
                let p = [
                    (d2.as_ptr() as u64, 1_000_000),
                    (d2.as_ptr() as u64 + 1_000_000, 2_000_000),
                ];
                // SAFETY: the pieces lie inside d2, alive for the call.
                unsafe { a.pieces(true, &p, None, &mut go) }.ok().unwrap();
                a.send(b"note", &mut go).ok().unwrap();
            });
            let mut h = [0u8; 6];
            b.recv_first(&mut h, &mut go).ok().unwrap();
            assert_eq!(&h, b"header");
            let mut got = vec![0u8; data.len()];
            let p = [
                (got.as_mut_ptr() as u64, 7),
                (got.as_mut_ptr() as u64 + 7, data.len() as u64 - 7),
            ];
            // SAFETY: the pieces lie inside `got`, alive for the call.
            unsafe { b.pieces(false, &p, None, &mut go) }.ok().unwrap();
            assert!(got == data);
            let mut n = [0u8; 4];
            b.recv(&mut n, &mut go).ok().unwrap();
            assert_eq!(&n, b"note");
            t.join().unwrap();
        }
    }

    #[test]
    fn a_changed_record_is_refused_and_lands_nowhere() {
        let (a, b) = pair(true);
        let mut w = Vec::new();
        {
            let mut s = a.seal.as_ref().unwrap().borrow_mut();
            w.resize(record_size(100), 0);
            seal_record_to(&mut s.session, &[7u8; 100], &mut w);
        }
        w[20] ^= 1;
        use std::io::Write;
        (&a.sock).write_all(&w).unwrap();
        let mut got = vec![0u8; 100];
        let p = [(got.as_mut_ptr() as u64, 100)];
        // SAFETY: the piece lies inside `got`.
        let r = unsafe { b.pieces(false, &p, None, &mut go) };
        assert!(matches!(r, Err(Stop::Abort(Error::Auth { .. }))));
        assert!(
            got.iter().all(|&x| x == 0),
            "no byte of a changed record lands"
        );
    }
}
