//! Where the producers and consumers of one in-process connector find each other by name:
//! each is an [`End`] with an inbox of control messages and its caches.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::Duration;

use super::copy::Caches;
use crate::connector::shell::{lock, wait_until};
use kvxfer_proto::wire::notify::Notification;

/// A producer or a consumer as the hub and its peers reach it.
#[derive(Debug)]
pub(super) struct End {
    inbox: Mutex<VecDeque<Notification>>,
    arrived: Condvar,
    /// Its caches.
    pub(super) mem: Caches,
}

impl End {
    pub(super) fn new(mem: Caches) -> End {
        End {
            inbox: Mutex::new(VecDeque::new()),
            arrived: Condvar::new(),
            mem,
        }
    }

    /// Queues a control message for this end.
    pub(super) fn deliver(&self, n: Notification) {
        lock(&self.inbox).push_back(n);
        self.arrived.notify_all();
    }

    /// The next queued control message, waiting up to `wait` for one.
    pub(super) fn recv(&self, wait: Duration) -> Option<Notification> {
        wait_until(&self.inbox, &self.arrived, wait, |q| q.pop_front())
    }

    /// The next queued control message, if any.
    pub(super) fn try_recv(&self) -> Option<Notification> {
        lock(&self.inbox).pop_front()
    }
}

/// Where the ends of one connector find each other by name.
#[derive(Debug, Default)]
pub(super) struct Hub {
    next: AtomicU64,
    ends: Mutex<HashMap<String, Weak<End>>>,
}

impl Hub {
    /// A fresh name for an end of `role`.
    pub(super) fn name(&self, role: &str) -> String {
        format!(
            "in-process-{role}-{}",
            self.next.fetch_add(1, Ordering::Relaxed)
        )
    }

    pub(super) fn join(&self, name: &str, end: &Arc<End>) {
        lock(&self.ends).insert(name.to_string(), Arc::downgrade(end));
    }

    pub(super) fn leave(&self, name: &str) {
        lock(&self.ends).remove(name);
    }

    /// The end called `name`, while it lives.
    pub(super) fn end(&self, name: &str) -> Option<Arc<End>> {
        lock(&self.ends).get(name).and_then(Weak::upgrade)
    }
}
