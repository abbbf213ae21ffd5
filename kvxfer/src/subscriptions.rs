//! The side channel's connections kept after their handshake (the protocol is
//! `kvxfer_proto::updates`): one per peer, a thread each, that sends this agent's metadata
//! again once it registered a region and loads the peer's updates, as the agent the handshake
//! loaded. A region registered after `connect` so reaches the peers connected already, on
//! both ends, without a reconnect (the etcd path publishes its own).
//!
//! Bounded: at most [`MAX_KEPT`] connections (one per peer name: a newer handshake replaces
//! the older), every update frame charged to the agent's budget while it is read and loaded,
//! and a peer that breaks the protocol loses its connection and nothing else.
//!
//! Deregistrations are fenced here ([`Subscriptions::fence_region`]): every kept peer is told
//! (`GONE`), refuses the region from then on, and answers (`GONE_ACK`) once its UCX transfers
//! to this agent that were in flight have ended; `deregister` lets the memory go only then.

use std::collections::{HashMap, HashSet};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::budget::MemoryBudget;
use crate::side_channel::SideChannel;
use kvxfer_proto::error::{Error, Result};
use kvxfer_proto::updates::{Pushed, Updates};
use kvxfer_proto::wire::side_channel::{frame_header, FRAME_HEADER_LEN};

/// Connections kept at once; past it a new handshake's connection is closed (its peer is
/// loaded all the same, only without later updates).
pub(crate) const MAX_KEPT: usize = 1024;
/// How often a kept connection's thread looks for a change of this agent's regions while
/// its peer is silent.
const POLL: Duration = Duration::from_millis(50);

/// The connections an agent keeps, and the generation of its regions.
#[derive(Debug)]
pub(crate) struct Subscriptions {
    /// Bumped by every registration. A deregistration is not pushed: peers that go on using
    /// the region are refused by the target, and at a process's exit, when its caches are
    /// deregistered, pushing them would make every peer reload and reconnect while both
    /// sides stop.
    generation: AtomicU64,
    budget: MemoryBudget,
    kept: Mutex<Kept>,
    /// Deregistrations waited for and their answers.
    fences: Mutex<Fences>,
    /// Signalled on every answer and every connection that ends.
    answered: Condvar,
}

/// Deregistrations in progress, by (connection, region).
#[derive(Debug, Default)]
struct Fences {
    /// Asked and not answered yet.
    asked: HashSet<(u64, u32)>,
    /// Answered, for `fence_region` to take.
    answered: HashSet<(u64, u32)>,
    /// Connections that let a deregistration's wait run out: the next ones do not wait for
    /// them (a stopped peer would hold every region of a shutdown for the whole wait), until
    /// they answer anything.
    silent: HashSet<u64>,
}

/// The writing half of a kept connection: the socket and the session that seals its frames
/// (shared by its thread and a deregistration).
struct Tx {
    s: TcpStream,
    updates: Updates,
}

#[derive(Debug, Default)]
struct Kept {
    by_peer: HashMap<String, Conn>,
    next: u64,
    closed: bool,
}

/// One kept connection: a handle to shut it down, its writing half, its thread.
struct Conn {
    id: u64,
    stream: TcpStream,
    tx: Arc<Mutex<Tx>>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn").field("id", &self.id).finish()
    }
}

fn lock_tx(tx: &Mutex<Tx>) -> MutexGuard<'_, Tx> {
    tx.lock().unwrap_or_else(|e| e.into_inner())
}

impl Conn {
    /// Shuts the connection down; its thread then ends on its own (its next read fails).
    fn shut(self) {
        let _ = self.stream.shutdown(Shutdown::Both);
    }

    fn close(mut self) {
        let _ = self.stream.shutdown(Shutdown::Both);
        if let Some(t) = self.thread.take() {
            // Never join oneself (a connection replaced from its own thread's load).
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

impl Subscriptions {
    pub(crate) fn new(budget: MemoryBudget) -> Subscriptions {
        Subscriptions {
            generation: AtomicU64::new(0),
            budget,
            kept: Mutex::default(),
            fences: Mutex::default(),
            answered: Condvar::new(),
        }
    }

    /// This agent deregisters region `id`: tells every kept peer that `concerned` names and
    /// waits, up to `wait`, for each to answer that nothing of its touches the region any more
    /// (or for its connection to end: that peer is gone). Returns the peers that did not
    /// answer.
    pub(crate) fn fence_region(
        &self,
        id: u32,
        wait: Duration,
        concerned: impl Fn(&str) -> bool,
    ) -> Vec<String> {
        let conns: Vec<(u64, String, Arc<Mutex<Tx>>)> = self
            .lock()
            .by_peer
            .iter()
            .map(|(p, c)| (c.id, p.clone(), c.tx.clone()))
            .collect();
        let conns: Vec<_> = conns.into_iter().filter(|(_, p, _)| concerned(p)).collect();
        let mut waiting: Vec<(u64, String)> = Vec::new();
        let mut silent: Vec<String> = Vec::new();
        for (cid, peer, tx) in conns {
            self.fence_lock().asked.insert((cid, id));
            let mut t = lock_tx(&tx);
            let frame = t.updates.gone_frame(id);
            // A connection that cannot take it is broken: its peer is gone.
            if t.s.write_all(&frame).is_err() {
                self.fence_lock().asked.remove(&(cid, id));
            } else if self.fence_lock().silent.contains(&cid) {
                // Told (it learns when it runs again), but not waited for: it let an earlier
                // wait run out.
                self.fence_lock().asked.remove(&(cid, id));
                silent.push(peer);
            } else {
                waiting.push((cid, peer));
            }
        }
        let deadline = Instant::now() + wait;
        let mut f = self.fence_lock();
        loop {
            let live: HashSet<u64> = self.lock().by_peer.values().map(|c| c.id).collect();
            waiting.retain(|(cid, _)| live.contains(cid) && !f.answered.remove(&(*cid, id)));
            let now = Instant::now();
            if waiting.is_empty() || now >= deadline {
                break;
            }
            f = self
                .answered
                .wait_timeout(f, (deadline - now).min(POLL))
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
        for (cid, _) in &waiting {
            f.asked.remove(&(*cid, id));
            f.silent.insert(*cid);
        }
        drop(f);
        waiting.into_iter().map(|(_, p)| p).chain(silent).collect()
    }

    fn answer(&self, conn: u64, id: u32) {
        let mut f = self.fence_lock();
        f.silent.remove(&conn);
        if f.asked.remove(&(conn, id)) {
            f.answered.insert((conn, id));
        }
        drop(f);
        self.answered.notify_all();
    }

    fn fence_lock(&self) -> MutexGuard<'_, Fences> {
        self.fences.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// This agent registered a region: every kept connection sends its metadata again.
    pub(crate) fn changed(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// The generation of this agent's regions; read before taking the metadata a handshake
    /// sends, so that a change in between is sent again.
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Keeps `s`, whose handshake loaded `updates.peer()` after sending this agent's metadata
    /// of generation `sent`: a thread sends later changes and loads the peer's updates.
    pub(crate) fn keep(
        self: &Arc<Self>,
        shared: &Arc<SideChannel>,
        s: TcpStream,
        updates: Updates,
        sent: u64,
        timeout: Duration,
    ) {
        let peer = updates.peer().to_string();
        let peer_name = peer.clone();
        let mut k = self.lock();
        if k.closed || (k.by_peer.len() >= MAX_KEPT && !k.by_peer.contains_key(&peer)) {
            drop(k);
            log::warn!(
                "kvxfer side channel: {} connections kept (limit {MAX_KEPT}): {peer:?} gets no \
                 updates of this agent's regions",
                MAX_KEPT
            );
            let _ = s.shutdown(Shutdown::Both);
            return;
        }
        let Ok(handle) = s.try_clone() else { return };
        let Ok(writer) = s.try_clone() else { return };
        let tx = Arc::new(Mutex::new(Tx { s: writer, updates }));
        k.next += 1;
        let id = k.next;
        let (subs, sh, tx2) = (self.clone(), shared.clone(), tx.clone());
        let spawned = std::thread::Builder::new()
            .name(format!("kvxfer-sub-{}", shared.name))
            .spawn(move || {
                let who = s
                    .peer_addr()
                    .map_or_else(|_| "a peer".to_string(), |a| a.to_string());
                let mut run = Run {
                    subs: &subs,
                    shared: &sh,
                    s,
                    tx: tx2,
                    conn: id,
                    peer: peer_name,
                    sent,
                    timeout,
                    who,
                };
                if let Err(e) = run.serve() {
                    log::info!(
                        "kvxfer side channel: updates with {:?} at {} ended: {e}",
                        run.peer,
                        run.who
                    );
                }
                subs.forget(&run.peer, id);
            });
        let Ok(thread) = spawned else { return };
        let old = k.by_peer.insert(
            peer,
            Conn {
                id,
                stream: handle,
                tx,
                thread: Some(thread),
            },
        );
        drop(k);
        if let Some(old) = old {
            old.close();
        }
    }

    /// Closes `peer`'s connection (the peer was removed, retired or evicted). Not joined: the
    /// caller may hold the agent's load lock, which that thread's last update may be waiting
    /// for.
    pub(crate) fn drop_peer(&self, peer: &str) {
        let c = self.lock().by_peer.remove(peer);
        if let Some(c) = c {
            c.shut();
        }
    }

    /// Closes every connection and keeps no new one (the agent is going).
    pub(crate) fn close(&self) {
        let all: Vec<Conn> = {
            let mut k = self.lock();
            k.closed = true;
            k.by_peer.drain().map(|(_, c)| c).collect()
        };
        for c in all {
            c.close();
        }
    }

    /// A connection's thread ended: its entry goes unless a newer one took the name.
    fn forget(&self, peer: &str, id: u64) {
        let mut k = self.lock();
        if k.by_peer.get(peer).is_some_and(|c| c.id == id) {
            k.by_peer.remove(peer);
        }
        drop(k);
        let mut f = self.fence_lock();
        f.silent.remove(&id);
        f.asked.retain(|(c, _)| *c != id);
        f.answered.retain(|(c, _)| *c != id);
        drop(f);
        // A deregistration waiting for this peer's answer waits no more.
        self.answered.notify_all();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Kept> {
        self.kept.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One kept connection's thread.
struct Run<'a> {
    subs: &'a Subscriptions,
    shared: &'a SideChannel,
    s: TcpStream,
    tx: Arc<Mutex<Tx>>,
    /// This connection's id in [`Kept`], and the peer the handshake loaded.
    conn: u64,
    peer: String,
    /// The generation of the metadata the peer has.
    sent: u64,
    timeout: Duration,
    who: String,
}

impl Run<'_> {
    /// Sends changes and loads updates until the connection ends or fails.
    fn serve(&mut self) -> Result<()> {
        self.s
            .set_write_timeout(Some(self.timeout))
            .map_err(|e| self.io("configuring the connection to", e))?;
        loop {
            let g = self.subs.generation();
            if g != self.sent {
                let meta = (self.shared.local)()?;
                let mut t = lock_tx(&self.tx);
                let frame = t.updates.frame(&meta);
                t.s.write_all(&frame)
                    .map_err(|e| self.io("sending an update to", e))?;
                drop(t);
                self.sent = g;
            }
            self.read_timeout(POLL)?;
            match self.s.peek(&mut [0u8; 1]) {
                Ok(0) => return Ok(()),
                Ok(_) => self.take_update()?,
                // Interrupted: a socket with a receive time-out fails its wait with EINTR when
                // the process is stopped and continued (signal(7)), handler or not; the stream
                // is fine.
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock
                            | std::io::ErrorKind::TimedOut
                            | std::io::ErrorKind::Interrupted
                    ) => {}
                Err(e) => return Err(self.io("reading from", e)),
            }
        }
    }

    fn read_timeout(&self, d: Duration) -> Result<()> {
        self.s
            .set_read_timeout(Some(d))
            .map_err(|e| self.io("configuring the connection to", e))
    }

    fn io(&self, what: &str, e: std::io::Error) -> Error {
        Error::io(format!("{what} {}", self.who), e)
    }

    /// Reads one update (charged to the budget while it is read and loaded) and loads it.
    fn take_update(&mut self) -> Result<()> {
        self.read_timeout(self.timeout)?;
        let mut h = [0u8; FRAME_HEADER_LEN];
        self.s
            .read_exact(&mut h)
            .map_err(|e| self.io("reading an update header from", e))?;
        let (kind, n) = frame_header(&h, &self.who)?;
        let _charge = self
            .subs
            .budget
            .try_charge(n as u64, "a peer's metadata update")?;
        let mut payload = vec![0u8; n];
        self.s
            .read_exact(&mut payload)
            .map_err(|e| self.io("reading an update from", e))?;
        let pushed = lock_tx(&self.tx).updates.on_frame(kind, &payload)?;
        drop(payload);
        match pushed {
            Pushed::Metadata(meta) => (self.shared.on_peer)(meta).map(|_| ()),
            Pushed::Gone(id) => {
                // Answered only once nothing of this agent's touches the region.
                if (self.shared.on_gone)(&self.peer, id) {
                    let mut t = lock_tx(&self.tx);
                    let frame = t.updates.ack_frame(id);
                    t.s.write_all(&frame)
                        .map_err(|e| self.io("answering a deregistration of", e))?;
                }
                Ok(())
            }
            Pushed::GoneAck(id) => {
                self.subs.answer(self.conn, id);
                Ok(())
            }
        }
    }
}
