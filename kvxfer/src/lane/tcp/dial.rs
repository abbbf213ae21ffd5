//! An initiator's connections to a TCP lane target: with a shared secret, the sealed opening
//! ([`kvxfer_proto::lane_seal`]: the Noise handshake, then every message in sealed records);
//! the hello (the lane secret, and the fence epoch its transfer was queued under), the
//! welcome, and what a refusal for a fence teaches
//! ([`kvxfer_proto::wire::lane::W_FENCED`]). After a transfer lost its connection the link
//! asks again ([`Dialer::probe`]) before it reports the failure, so that a writer whose
//! transfer a fence cut has learned the count by the time its caller queues the next one.

use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::conn::Conn;
use super::stream::{recv_buf, send_buf, set_timeouts, Ctl, Stop};
use super::window::Window;
use crate::budget::MemoryBudget;
use crate::lane::shm_handover::take_window;
use kvxfer_proto::error::{Error, Result};
use kvxfer_proto::lane::{LaneInitiator, Refusal};
use kvxfer_proto::session::{Initiator, Psk, StaticKey, HANDSHAKE_LEN, SEED};
use kvxfer_proto::types::LaneInfo;
use kvxfer_proto::wire::lane::{parse_welcome, DataMode, Hello, SEALED_MAGIC, WELCOME_FIXED_LEN};
use kvxfer_proto::wire::lane_window::{
    WindowOffer, ACK_DECLINED, ACK_MAPPED, OFFER_LEN, WINDOW_BYTES,
};

/// How long a connection and its hello may take.
pub(super) const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the reconnect after a lost connection may take (its answer only teaches).
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// How an initiator seals its lane connections (with a shared secret).
pub(crate) struct Sealing {
    /// The lane's PSK towards this target.
    pub(crate) psk: Psk,
    /// Whether the blocks' bytes are sealed too.
    pub(crate) sealed_data: bool,
    /// The target's process when it runs on this host: with clear data, the connections ask
    /// for a window to move the data through ([`kvxfer_proto::wire::lane_window`]).
    pub(crate) window: Option<u32>,
    /// Bytes of windows this agent's connections hold, all peers together: at most a quarter
    /// of its budget.
    pub(crate) windows: Arc<AtomicU64>,
    /// This agent's static key, whose public half its metadata carries.
    pub(crate) key: StaticKey,
}

/// Opens connections to one lane target.
pub(super) struct Dialer {
    me: String,
    peer: String,
    info: LaneInfo,
    /// The target's fence count for this agent, as learned from its refusals (shared by the
    /// links to the same target incarnation).
    view: Arc<AtomicU64>,
    /// With a shared secret: how the connections are sealed.
    seal: Option<Sealing>,
    /// Where a sealed connection's record buffers are charged.
    budget: MemoryBudget,
}

impl Dialer {
    pub(super) fn new(
        me: &str,
        peer: &str,
        info: LaneInfo,
        view: Arc<AtomicU64>,
        seal: Option<Sealing>,
        budget: MemoryBudget,
    ) -> Dialer {
        Dialer {
            me: me.to_string(),
            peer: peer.to_string(),
            info,
            view,
            seal,
            budget,
        }
    }

    /// The target's fence count as learned now: a transfer queued now names it.
    pub(super) fn learned(&self) -> u64 {
        self.view.load(Ordering::Acquire)
    }

    /// A connection whose hello names fence epoch `epoch`, within `timeout`. A refusal for a
    /// fence teaches this agent the target's count and is [`Error::Fenced`].
    pub(super) fn connect(&self, epoch: u64, timeout: Duration) -> Result<Conn> {
        let sock = TcpStream::connect_timeout(&self.info.addr, timeout)
            .map_err(|e| self.err(format!("connecting to {}: {e}", self.info.addr)))?;
        set_timeouts(&sock).map_err(|e| self.err(format!("socket options: {e}")))?;
        let mut h = Hello {
            name: &self.me,
            secret: self.info.secret,
            epoch,
        }
        .encode();
        let t0 = Instant::now();
        let mut ctl = |_moved: bool| -> Result<(), Stop> {
            if t0.elapsed() > timeout {
                Err(Stop::Abort(self.err(format!(
                    "no welcome in {timeout:?} (the target is stalled?)"
                ))))
            } else {
                Ok(())
            }
        };
        let mut c = match &self.seal {
            None => Conn::open(sock),
            Some(seal) => {
                let mode = match (seal.sealed_data, seal.window) {
                    (true, _) => DataMode::Sealed,
                    (false, Some(_)) => DataMode::Window,
                    (false, None) => DataMode::Clear,
                };
                h.insert(0, mode.byte());
                let c = self.open_sealed(sock, seal, &mut ctl);
                c.map_err(|s| self.stop_err(s, "the sealed opening"))?
            }
        };
        let r = c.send(&h, &mut ctl).and_then(|_| {
            let mut w = [0u8; WELCOME_FIXED_LEN];
            c.recv(&mut w, &mut ctl)?;
            let (status, epoch, msg_len) = parse_welcome(&w);
            let mut msg = vec![0u8; msg_len];
            c.recv(&mut msg, &mut ctl)?;
            Ok(LaneInitiator::welcome(status, epoch, &msg))
        });
        match r {
            Ok(Ok(())) => {
                let window = self.seal.as_ref().filter(|s| !s.sealed_data);
                if let Some(pid) = window.and_then(|s| s.window) {
                    self.take_offer(&mut c, pid, &mut ctl)
                        .map_err(|s| self.stop_err(s, "the window offer"))?;
                }
                Ok(c)
            }
            Ok(Err(Refusal::Fenced { epoch, .. })) => {
                self.view.fetch_max(epoch, Ordering::AcqRel);
                Err(Error::Fenced {
                    agent: self.peer.clone(),
                    epoch,
                })
            }
            Ok(Err(Refusal::Refused(msg))) => Err(self.err(format!("refused: {msg}"))),
            Err(s) => Err(self.stop_err(s, "the hello")),
        }
    }

    /// The target's window offer after its welcome: the window taken from its socket (owned by
    /// process `pid`), checked and mapped, charged to this agent's budget, and the answer; or
    /// declined (the data then stays on the socket).
    fn take_offer(&self, c: &mut Conn, pid: u32, ctl: &mut Ctl<'_>) -> Result<(), Stop> {
        let mut b = [0u8; OFFER_LEN];
        c.recv(&mut b, ctl)?;
        let offer =
            WindowOffer::decode(&b).map_err(|why| Stop::Abort(Error::protocol(&self.peer, why)))?;
        let WindowOffer::Window { socket, ticket } = offer else {
            return Ok(());
        };
        let windows = self
            .seal
            .as_ref()
            .map(|s| s.windows.clone())
            .unwrap_or_default();
        let taken = WindowHeld::charge(&self.budget, windows)
            .and_then(|held| Window::map(take_window(socket, ticket, pid)?, held));
        match taken {
            Ok(w) => {
                c.send(&[ACK_MAPPED], ctl)?;
                c.set_window(w);
            }
            Err(e) => {
                log::info!(
                    "kvxfer: TCP lane to {}: its window declined ({e}); the data goes on the \
                     socket",
                    self.peer
                );
                c.send(&[ACK_DECLINED], ctl)?;
            }
        }
        Ok(())
    }

    /// The Noise handshake on a new connection (this agent's static key against the one the
    /// target's metadata carried): the session, whose records carry the rest.
    fn open_sealed(
        &self,
        sock: TcpStream,
        seal: &Sealing,
        ctl: &mut Ctl<'_>,
    ) -> Result<Conn, Stop> {
        let seed: [u8; SEED] = crate::random::bytes().map_err(Stop::Abort)?;
        let (init, first) =
            Initiator::start_keyed(&seal.psk, &seal.key, &self.info.key, seed, &self.peer)
                .map_err(Stop::Abort)?;
        let mut opening = SEALED_MAGIC.to_vec();
        opening.extend_from_slice(&first);
        send_buf(&sock, &opening, ctl)?;
        let mut answer = [0u8; HANDSHAKE_LEN];
        recv_buf(&sock, &mut answer, ctl)?;
        let session = init.finish(&answer).map_err(Stop::Abort)?;
        Ok(Conn::sealed(
            sock,
            session,
            seal.sealed_data,
            self.budget.clone(),
        ))
    }

    fn stop_err(&self, s: Stop, during: &str) -> Error {
        match s {
            Stop::Abort(e) => e,
            Stop::Eof => self.err(format!("peer closed the connection during {during}")),
            Stop::Io(e) => self.err(format!("{during}: {e}")),
        }
    }

    /// Reconnects naming `epoch` after a transfer lost its connection: the connection if the
    /// target serves it (kept for the next transfer), `None` if it refused it (a fence: the
    /// count is learned) or cannot be reached.
    pub(super) fn probe(&self, epoch: u64) -> Option<Conn> {
        match self.connect(epoch, PROBE_TIMEOUT) {
            Ok(c) => Some(c),
            Err(e) => {
                log::debug!("kvxfer: TCP lane to {}: after a failure: {e}", self.peer);
                None
            }
        }
    }

    fn err(&self, why: impl Into<String>) -> Error {
        Error::LaneFailed {
            agent: self.peer.clone(),
            lane: "tcp",
            why: why.into(),
        }
    }
}

/// A window's charge at the initiator: the budget's, and its bytes among the agent's windows.
struct WindowHeld {
    windows: Arc<AtomicU64>,
    _charge: crate::budget::Charge,
}

impl WindowHeld {
    /// Charged if the agent's windows stay within a quarter of its budget (its requests keep
    /// the rest) and the budget has room now.
    fn charge(budget: &MemoryBudget, windows: Arc<AtomicU64>) -> Result<WindowHeld> {
        let w = WINDOW_BYTES as u64;
        let before = windows.fetch_add(w, Ordering::AcqRel);
        let limit = budget.limit();
        let charged = if limit != u64::MAX && before + w > limit / 4 {
            Err(Error::OutOfMemory(format!(
                "a TCP lane window: this agent's hold {before} bytes, of at most a quarter of \
                 its {limit}-byte budget"
            )))
        } else {
            budget.try_charge(w, "a TCP lane window")
        };
        match charged {
            Ok(c) => Ok(WindowHeld {
                windows,
                _charge: c,
            }),
            Err(e) => {
                windows.fetch_sub(w, Ordering::AcqRel);
                Err(e)
            }
        }
    }
}

impl Drop for WindowHeld {
    fn drop(&mut self) {
        self.windows
            .fetch_sub(WINDOW_BYTES as u64, Ordering::AcqRel);
    }
}

/// Whether a transfer failed because its connection broke (the target may have fenced it),
/// rather than by its own deadline, a cancel, or a fence already told.
pub(super) fn lost_connection(e: &Error) -> bool {
    matches!(e, Error::LaneFailed { .. } | Error::Io { .. })
}

/// Closes every connection (after a fence, none may be reused).
pub(super) fn close_all(conns: &mut [Option<Conn>]) {
    for c in conns.iter_mut().filter_map(Option::take) {
        c.shutdown();
    }
}
