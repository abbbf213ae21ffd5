//! Where the producers and consumers of one in-process connector find each other by name,
//! and hand each other control messages.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use super::copy::Caches;
use crate::connector::shell::lock;
use kvxfer_proto::wire::connector::{ToConsumer, ToProducer};

/// A producer as the hub and consumers reach it.
pub(super) trait ProducerEnd: Send + Sync {
    /// A control message from consumer `from`.
    fn deliver(&self, from: &str, msg: ToProducer);
    /// Its caches.
    fn mem(&self) -> &Caches;
}

/// A consumer as the hub and producers reach it.
pub(super) trait ConsumerEnd: Send + Sync {
    /// A control message from producer `from`.
    fn deliver(&self, from: &str, msg: ToConsumer);
    /// Its caches.
    fn mem(&self) -> &Caches;
}

/// Where producers and consumers of one connector find each other by name.
#[derive(Debug, Default)]
pub(super) struct Hub {
    next: AtomicU64,
    pub(super) producers: Mutex<HashMap<String, Weak<dyn ProducerEnd>>>,
    pub(super) consumers: Mutex<HashMap<String, Weak<dyn ConsumerEnd>>>,
}

impl Hub {
    pub(super) fn name(&self, role: &str) -> String {
        format!(
            "in-process-{role}-{}",
            self.next.fetch_add(1, Ordering::Relaxed)
        )
    }

    pub(super) fn producer(&self, name: &str) -> Option<Arc<dyn ProducerEnd>> {
        lock(&self.producers).get(name).and_then(Weak::upgrade)
    }

    pub(super) fn consumer(&self, name: &str) -> Option<Arc<dyn ConsumerEnd>> {
        lock(&self.consumers).get(name).and_then(Weak::upgrade)
    }

    /// Hands `msg` from consumer `from` to producer `to`; false when there is no such producer
    /// (it was dropped), as a message into a dead peer's queue would be lost.
    pub(super) fn to_producer(&self, to: &str, from: &str, msg: ToProducer) -> bool {
        match self.producer(to) {
            Some(p) => {
                p.deliver(from, msg);
                true
            }
            None => false,
        }
    }

    /// Queues `msg` from producer `from` for consumer `to` (dropped when it is gone).
    pub(super) fn to_consumer(&self, to: &str, from: &str, msg: ToConsumer) {
        if let Some(c) = self.consumer(to) {
            c.deliver(from, msg);
        }
    }
}
