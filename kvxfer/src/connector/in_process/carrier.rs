//! The in-process carrier: control messages handed to the peer's inbox in the [`Hub`], a
//! layer's blocks copied between the two caches by this end's mover thread (so the shell's
//! lock, which engine calls take, is never held across a memcpy).
#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use super::copy::copy;
use super::hub::{End, Hub};
use crate::connector::carrier::{Carrier, InFlight, LayerMove, Moved};
use crate::connector::shell::lock;
use kvxfer_proto::connector::load_descs;
use kvxfer_proto::descriptor::Desc;
use kvxfer_proto::error::{Error, Result};
use kvxfer_proto::handoff_seal::HandoffKey;
use kvxfer_proto::layout::KvLayout;
use kvxfer_proto::wire::connector::{Grant, Handoff};
use kvxfer_proto::wire::notify::Notification;

/// A copy's outcome, set once by the mover.
#[derive(Default)]
struct Outcome {
    result: Mutex<Option<Result<Moved>>>,
    set: Condvar,
    cancelled: AtomicBool,
}

/// A copy queued on or done by the mover.
struct LocalMove(Arc<Outcome>);

impl InFlight for LocalMove {
    fn is_done(&self) -> bool {
        lock(&self.0.result).is_some()
    }

    fn wait(self: Box<Self>) -> Result<Moved> {
        let mut r = lock(&self.0.result);
        loop {
            if let Some(r) = r.take() {
                return r;
            }
            r = self.0.set.wait(r).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn cancel(self: Box<Self>) {
        self.0.cancelled.store(true, Ordering::Release);
        // A copy already running finishes (it is one layer's memcpy); then nothing touches
        // the caches for it.
        let _ = self.wait();
    }
}

/// One layer to copy from `src`'s caches into `dst`'s, then `note` for `dst`.
struct Copy {
    src: Arc<End>,
    src_descs: Vec<Desc>,
    dst: Arc<End>,
    dst_descs: Vec<Desc>,
    note: Option<Notification>,
    outcome: Arc<Outcome>,
}

impl Copy {
    fn run(self) {
        let r = if self.outcome.cancelled.load(Ordering::Acquire) {
            Err(Error::Canceled)
        } else {
            copy(
                &self.src.mem,
                &self.src_descs,
                &self.dst.mem,
                &self.dst_descs,
            )
            .map(|bytes| Moved {
                bytes,
                descs: self.src_descs.len() as u64,
                post: Duration::ZERO,
            })
        };
        // The note reaches its peer after the data, as an agent's notification does.
        if let (Ok(_), Some(n)) = (&r, self.note) {
            self.dst.deliver(n);
        }
        *lock(&self.outcome.result) = Some(r);
        self.outcome.set.notify_all();
    }
}

/// One end of an in-process connector as its shell's carrier.
pub(super) struct InProcessCarrier {
    name: String,
    hub: Arc<Hub>,
    end: Arc<End>,
    queue: Mutex<Option<Sender<Copy>>>,
    mover: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for InProcessCarrier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InProcessCarrier")
            .field("name", &self.name)
            .finish()
    }
}

impl InProcessCarrier {
    /// Joins `hub` as `name` with `end`, and starts the mover.
    pub(super) fn new(hub: &Arc<Hub>, name: String, end: End) -> Result<InProcessCarrier> {
        let (tx, rx) = channel::<Copy>();
        let mover = std::thread::Builder::new()
            .name(format!("kvxfer-mover-{name}"))
            .spawn(move || rx.into_iter().for_each(Copy::run))
            .map_err(|e| Error::io("spawning the in-process mover", e))?;
        let end = Arc::new(end);
        hub.join(&name, &end);
        Ok(InProcessCarrier {
            name,
            hub: hub.clone(),
            end,
            queue: Mutex::new(Some(tx)),
            mover: Mutex::new(Some(mover)),
        })
    }

    fn peer(&self, name: &str) -> Result<Arc<End>> {
        self.hub.end(name).ok_or_else(|| Error::UnknownPeer {
            agent: name.to_string(),
        })
    }

    fn queue(&self, c: Copy) -> Result<Box<dyn InFlight>> {
        let outcome = c.outcome.clone();
        let sent = lock(&self.queue).as_ref().map(|q| q.send(c).is_ok());
        if sent != Some(true) {
            return Err(Error::InvalidArgument(format!(
                "{}: the connector end is closed",
                self.name
            )));
        }
        Ok(Box::new(LocalMove(outcome)))
    }
}

impl Carrier for InProcessCarrier {
    fn name(&self) -> &str {
        &self.name
    }

    fn epoch(&self) -> u64 {
        0
    }

    fn side_channel(&self) -> Option<SocketAddr> {
        None
    }

    fn handoff_key(&self) -> Option<HandoffKey> {
        // One process: no secret, nothing to seal against.
        None
    }

    // One process: no peer reaches the cache but through the hub, which the shells drive.
    fn restrict(&self, _layout: &KvLayout, _on: bool) {}

    fn grant(&self, _: Grant, _: &str, _: bool, _: &KvLayout, _: &[u32]) -> Result<()> {
        Ok(())
    }

    fn revoke(&self, _grant: &Grant) {}

    fn send(&self, to: &str, msg: &[u8]) -> bool {
        match self.hub.end(to) {
            Some(e) => {
                e.deliver(Notification {
                    from: self.name.clone(),
                    payload: msg.to_vec(),
                });
                true
            }
            // As a message into a dead peer's queue would be lost.
            None => false,
        }
    }

    fn recv(&self, wait: Duration) -> Option<Notification> {
        self.end.recv(wait)
    }

    fn try_recv(&self) -> Option<Notification> {
        self.end.try_recv()
    }

    fn reach(&self, h: &Handoff) -> Result<()> {
        self.peer(&h.producer).map(drop)
    }

    fn peer_epoch(&self, peer: &str) -> Option<u64> {
        self.hub.end(peer).map(|_| 0)
    }

    fn read(&self, producer: &str, m: &LayerMove<'_>, _: Duration) -> Result<Box<dyn InFlight>> {
        let (dst_descs, src_descs) = load_descs(
            m.local,
            m.remote,
            m.heads,
            m.local_blocks,
            m.remote_blocks,
            m.layer..m.layer + 1,
        )?;
        self.queue(Copy {
            src: self.peer(producer)?,
            src_descs,
            dst: self.end.clone(),
            dst_descs,
            note: None,
            outcome: Arc::default(),
        })
    }

    fn write(
        &self,
        reader: &str,
        m: &LayerMove<'_>,
        note: &[u8],
        _: Duration,
    ) -> Result<Box<dyn InFlight>> {
        let layers = m.layer..m.layer + 1;
        let src_descs = m
            .local
            .descs(m.local_blocks, layers.clone(), m.heads.local.clone())?;
        let dst_descs = m
            .remote
            .descs(m.remote_blocks, layers, m.heads.remote.clone())?;
        self.queue(Copy {
            src: self.end.clone(),
            src_descs,
            dst: self.peer(reader)?,
            dst_descs,
            note: Some(Notification {
                from: self.name.clone(),
                payload: note.to_vec(),
            }),
            outcome: Arc::default(),
        })
    }

    fn fence(&self, _: &str) -> usize {
        // A push is the producer's mover copying one layer at a time; this end cannot stop
        // the copies already queued there (the agent's TCP lane can). Counted as none.
        0
    }

    fn close(&self) {
        self.hub.leave(&self.name);
        // The mover runs what is queued, then ends.
        drop(lock(&self.queue).take());
        if let Some(t) = lock(&self.mover).take() {
            let _ = t.join();
        }
        // Peers may still hold this end: none copies from or into the engine's memory after
        // this.
        self.end.mem.retire();
    }
}

impl Drop for InProcessCarrier {
    fn drop(&mut self) {
        self.close();
    }
}
