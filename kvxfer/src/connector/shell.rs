//! What the producer's and the consumer's shells share: locking, waiting, receiving control
//! messages, charging request state to the budget, adding up transfer figures.
#![forbid(unsafe_code)]

use std::sync::{Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::budget::{Charge, MemoryBudget};
use kvxfer_proto::error::{Error, Result};
use kvxfer_proto::wire::notify::Notification;

use super::carrier::{Carrier, Moved};

/// Bytes of request state charged per descriptor.
pub(crate) const STATE_BYTES_PER_DESC: u64 = 160;
/// Fixed bytes charged per request.
pub(crate) const STATE_BYTES_FIXED: u64 = 4096;

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Waits on `cv` up to `timeout` until `ready` returns `Some` for the state in `m` (checked
/// first, then after every wake-up); `None` when the time ran out. The one deadline loop of
/// the connector's blocking calls.
pub(crate) fn wait_until<T, R>(
    m: &Mutex<T>,
    cv: &Condvar,
    timeout: Duration,
    mut ready: impl FnMut(&mut T) -> Option<R>,
) -> Option<R> {
    let end = Instant::now() + timeout;
    let mut st = lock(m);
    loop {
        if let Some(r) = ready(&mut st) {
            return Some(r);
        }
        let now = Instant::now();
        if now >= end {
            return None;
        }
        st = cv
            .wait_timeout(st, end - now)
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
}

/// What a request's moves added up to. `busy` is the wall time during which at least one of
/// them was in flight: layers overlap, so it is not the sum of their durations.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Figures {
    pub(crate) bytes: u64,
    pub(crate) descs: u64,
    /// Posting, summed over the moves (posts do not overlap: one thread posts them).
    pub(crate) post: Duration,
    pub(crate) busy: Duration,
    busy_since: Option<Instant>,
}

impl Figures {
    /// A move is posted: the request is busy from now if it was not.
    pub(crate) fn posted(&mut self) {
        self.busy_since.get_or_insert_with(Instant::now);
    }

    /// A move finished (its figures `m`, or none when it failed); `idle`: none of the
    /// request's is in flight any more.
    pub(crate) fn finished(&mut self, m: Option<&Moved>, idle: bool) {
        if let Some(m) = m {
            self.bytes += m.bytes;
            self.descs += m.descs;
            self.post += m.post;
        }
        if idle {
            if let Some(t) = self.busy_since.take() {
                self.busy += t.elapsed();
            }
        }
    }
}

pub(crate) fn state_charge(
    budget: &MemoryBudget,
    descs: u64,
    what: &str,
    wait: Duration,
) -> Result<Charge> {
    budget.charge(STATE_BYTES_FIXED + descs * STATE_BYTES_PER_DESC, what, wait)
}

/// One turn of a shell's control loop: waits for a control message (1 ms while `busy` with
/// transfers in flight, else 10 ms), then hands every queued one to `handle`.
pub(crate) fn take_control(
    carrier: &dyn Carrier,
    busy: bool,
    mut handle: impl FnMut(Notification),
) {
    let wait = if busy {
        Duration::from_millis(1)
    } else {
        Duration::from_millis(10)
    };
    if let Some(n) = carrier.recv(wait) {
        handle(n);
        while let Some(n) = carrier.try_recv() {
            handle(n);
        }
    }
}

/// Starts a shell's thread, called `name`, running `body`.
pub(crate) fn spawn_thread(
    name: String,
    body: impl FnOnce() + Send + 'static,
) -> Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(name)
        .spawn(body)
        .map_err(|e| Error::io("spawning a connector thread", e))
}

/// Wakes a shell's thread (its state says stop) and waits for it to end.
pub(crate) fn join_thread(cv: &Condvar, thread: &mut Option<JoinHandle<()>>) {
    cv.notify_all();
    if let Some(t) = thread.take() {
        let _ = t.join();
    }
}
