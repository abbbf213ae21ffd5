//! The side channel's listening end: handshakes run side by side at the [`Gate`] (an event
//! loop, each with a deadline, the pending ones bounded), and a client whose HELLO arrived
//! (opened under its Noise session, with a secret) is loaded and answered by a small pool of loader
//! threads, so that neither a silent client nor a slow load holds up another peer.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::gate::{Admission, Gate, Limits, Verdict};
use crate::side_channel::SideChannel;
use crate::subscriptions::Subscriptions;
use kvxfer_proto::acceptor::{SideChannelAcceptor, Step};
use kvxfer_proto::error::{Error, Result};
use kvxfer_proto::session::SEED;
use kvxfer_proto::updates::Updates;
use kvxfer_proto::wire::metadata::Metadata;

/// A client's whole handshake, from its accept to its HELLO (a few milliseconds for a real
/// peer; a silent or trickling client is dropped after this).
pub(crate) const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(5);
/// Handshakes in progress at once; the oldest is dropped for a new one.
const PENDING: usize = 256;
/// Bytes buffered across them (a HELLO may carry up to 16 MiB of metadata).
const PENDING_BYTES: usize = 64 << 20;
/// Threads that load clients' metadata and answer.
const LOADERS: usize = 2;
/// Admitted clients waiting for a loader; more are refused (closed).
const QUEUED: usize = 64;
/// How long a loader waits to send its answer.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);

/// A handshake at the gate: the acceptor, and the HELLO's metadata once it came.
struct Handshake {
    acceptor: SideChannelAcceptor,
    hello: Option<Vec<u8>>,
}

impl Admission for Handshake {
    fn want(&self) -> usize {
        self.acceptor.want()
    }

    fn on_bytes(&mut self, b: &[u8], _now: Duration) -> Verdict {
        match self.acceptor.on_bytes(b) {
            Step::More => Verdict::More,
            Step::Hello(m) => {
                self.hello = Some(m);
                Verdict::Admit
            }
            Step::Refused(e) => Verdict::Refuse(e.to_string()),
        }
    }

    fn take_output(&mut self) -> Vec<u8> {
        self.acceptor.take_output()
    }

    fn expired(&self, now: Duration) -> bool {
        self.acceptor.expired(now)
    }
}

/// A listening side channel: its gate and its loaders, stopped on drop.
pub(crate) struct Listener {
    gate: Option<Gate>,
    loaders: Vec<JoinHandle<()>>,
}

impl Listener {
    /// Listens on `addr`; a connection whose handshake loaded its peer is kept for updates,
    /// each later step waiting at most `timeout`.
    pub(crate) fn start(
        shared: Arc<SideChannel>,
        subs: Arc<Subscriptions>,
        addr: SocketAddr,
        timeout: Duration,
    ) -> Result<Listener> {
        let l = TcpListener::bind(addr).map_err(|e| Error::io(format!("binding {addr}"), e))?;
        let (tx, rx) = sync_channel::<(TcpStream, Handshake)>(QUEUED);
        let rx = Arc::new(Mutex::new(rx));
        let mut loaders = Vec::new();
        for i in 0..LOADERS {
            let (rx, sh, subs) = (rx.clone(), shared.clone(), subs.clone());
            let t = std::thread::Builder::new()
                .name(format!("kvxfer-sc-load{i}-{}", shared.name))
                .spawn(move || load_loop(&rx, &sh, &subs, timeout))
                .map_err(|e| Error::io("spawning a side-channel loader", e))?;
            loaders.push(t);
        }
        let secret = shared.secret.clone();
        let open = move |who: SocketAddr, now: Duration| {
            Ok(Handshake {
                acceptor: SideChannelAcceptor::new(
                    &who.to_string(),
                    secret.as_deref(),
                    crate::random::bytes::<SEED>()?,
                    now,
                    HANDSHAKE_DEADLINE,
                ),
                hello: None,
            })
        };
        let gate = Gate::start(
            l,
            &format!("kvxfer-listen-{}", shared.name),
            Limits {
                pending: PENDING,
                bytes: PENDING_BYTES,
            },
            open,
            move |s, h| hand_over(&tx, s, h),
        )?;
        Ok(Listener {
            gate: Some(gate),
            loaders,
        })
    }

    pub(crate) fn addr(&self) -> SocketAddr {
        self.gate
            .as_ref()
            .map_or(SocketAddr::from(([0, 0, 0, 0], 0)), Gate::addr)
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        // The gate (and with it the loaders' queue) first: the loaders then run dry and end.
        self.gate.take();
        for t in self.loaders.drain(..) {
            let _ = t.join();
        }
    }
}

fn hand_over(tx: &SyncSender<(TcpStream, Handshake)>, s: TcpStream, h: Handshake) {
    match tx.try_send((s, h)) {
        Ok(()) => {}
        Err(TrySendError::Full((s, _))) => {
            log::warn!(
                "kvxfer side channel: {} clients wait for a loader (limit {QUEUED}): {:?} \
                 refused",
                QUEUED,
                s.peer_addr().ok()
            );
        }
        Err(TrySendError::Disconnected(_)) => {}
    }
}

fn load_loop(
    rx: &Mutex<Receiver<(TcpStream, Handshake)>>,
    shared: &Arc<SideChannel>,
    subs: &Arc<Subscriptions>,
    timeout: Duration,
) {
    loop {
        let next = rx.lock().unwrap_or_else(|e| e.into_inner()).recv();
        let Ok((s, h)) = next else { return };
        let who = s
            .peer_addr()
            .map_or_else(|_| "a client".to_string(), |a| a.to_string());
        if let Err(e) = answer(shared, subs, s, h, timeout) {
            log::warn!("kvxfer side channel: {who}: {e}");
        }
    }
}

/// Loads the client's metadata and answers it (META, or ERROR with the reason); keeps the
/// connection of a client it loaded, for updates both ways.
fn answer(
    shared: &Arc<SideChannel>,
    subs: &Arc<Subscriptions>,
    mut s: TcpStream,
    mut h: Handshake,
    timeout: Duration,
) -> Result<()> {
    let who = s
        .peer_addr()
        .map_or_else(|_| "a client".to_string(), |a| a.to_string());
    let hello = h.hello.take().unwrap_or_default();
    let mut epoch = 0;
    let loaded = Metadata::decode(&hello, shared.compat)
        .map_err(|err| Error::Metadata {
            source_desc: who.clone(),
            err,
        })
        .and_then(|m| {
            epoch = m.epoch;
            (shared.on_peer)(m)
        });
    let generation = subs.generation();
    let r = match &loaded {
        Ok(_) => (shared.local)().map_err(|e| e.to_string()),
        Err(Error::Metadata { err, .. }) => Err(format!("metadata refused: {err}")),
        Err(e) => Err(e.to_string()),
    };
    h.acceptor.answer(r);
    s.set_write_timeout(Some(ANSWER_TIMEOUT))
        .map_err(|e| Error::io(format!("configuring socket to {who}"), e))?;
    std::io::Write::write_all(&mut s, &h.acceptor.take_output())
        .map_err(|e| Error::io(format!("answering {who}"), e))?;
    let name = loaded?;
    let updates = Updates::new(&who, &name, epoch, shared.compat, h.acceptor.into_session());
    subs.keep(shared, s, updates, generation, timeout);
    Ok(())
}
