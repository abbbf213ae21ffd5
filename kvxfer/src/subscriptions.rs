//! The side channel's connections kept after their handshake (the protocol is
//! `kvxfer_proto::updates`): one per peer, a thread each, that sends this agent's metadata
//! again once it registered a region and loads the peer's updates, as the agent the handshake
//! loaded. A region registered after `connect` so reaches the peers connected already, on
//! both ends, without a reconnect (the etcd path publishes its own).
//!
//! Bounded: at most [`MAX_KEPT`] connections (one per peer name: a newer handshake replaces
//! the older), every update frame charged to the agent's budget while it is read and loaded,
//! and a peer that breaks the protocol loses its connection and nothing else.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::budget::MemoryBudget;
use crate::side_channel::SideChannel;
use kvxfer_proto::error::{Error, Result};
use kvxfer_proto::updates::Updates;
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
}

#[derive(Debug, Default)]
struct Kept {
    by_peer: HashMap<String, Conn>,
    next: u64,
    closed: bool,
}

/// One kept connection: a handle to shut it down, its thread.
#[derive(Debug)]
struct Conn {
    id: u64,
    stream: TcpStream,
    thread: Option<JoinHandle<()>>,
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
        }
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
        k.next += 1;
        let id = k.next;
        let (subs, sh) = (self.clone(), shared.clone());
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
                    updates,
                    sent,
                    timeout,
                    who,
                };
                if let Err(e) = run.serve() {
                    log::info!(
                        "kvxfer side channel: updates with {:?} at {} ended: {e}",
                        run.updates.peer(),
                        run.who
                    );
                }
                subs.forget(run.updates.peer(), id);
            });
        let Ok(thread) = spawned else { return };
        let old = k.by_peer.insert(
            peer,
            Conn {
                id,
                stream: handle,
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
    updates: Updates,
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
                let frame = self.updates.frame(&(self.shared.local)()?);
                self.s
                    .write_all(&frame)
                    .map_err(|e| self.io("sending an update to", e))?;
                self.sent = g;
            }
            self.read_timeout(POLL)?;
            match self.s.peek(&mut [0u8; 1]) {
                Ok(0) => return Ok(()),
                Ok(_) => self.take_update()?,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
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
        let meta = self.updates.on_frame(kind, &payload)?;
        drop(payload);
        (self.shared.on_peer)(meta).map(|_| ())
    }
}
