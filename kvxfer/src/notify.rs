//! Notifications: small messages a peer receives only after the data of the transfer that
//! carried them has landed (sent as a UCX active message after the transfer's flush).
#![forbid(unsafe_code)]

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::budget::{Charge, MemoryBudget};
use kvxfer_proto::error::{Error, Result};

pub use kvxfer_proto::wire::notify::Notification;
use kvxfer_proto::wire::notify::Recipient;

/// Most undelivered notifications kept; older ones beyond this are counted as dropped.
pub(crate) const MAX_QUEUED: usize = 65_536;
/// Most bytes of undelivered notifications one inbox keeps (a peer may send 64 KiB a note, and
/// an engine that only uses the connector never drains the user's inbox): older ones beyond
/// this are dropped and counted.
pub(crate) const MAX_QUEUED_BYTES: u64 = 16 << 20;

/// What one sender may hold in one inbox: a quarter of its bytes and of its count. A sender
/// past its share has its new notifications dropped (counted), so that one peer flooding an
/// inbox nobody drains does not push out the others' (a connector's acknowledgements and
/// heartbeats).
pub(crate) const SENDER_SHARE: u64 = 4;

/// What one queued notification holds: its payload, its sender's name and the queue entry.
fn held(n: &Notification) -> u64 {
    (n.payload.len() + n.from.len() + 64) as u64
}

/// Where received notifications go: the user's queue, or the connector's producer or consumer
/// queue, by the message's tag. The UCX engine and the TCP lane's target each hold a clone and
/// deliver through it; the agent and the connector read the queues.
#[derive(Clone, Debug, Default)]
pub(crate) struct Channels {
    pub(crate) user: Arc<Inbox>,
    pub(crate) producer: Arc<Inbox>,
    pub(crate) consumer: Arc<Inbox>,
}

impl Channels {
    /// Queues whose notifications are charged to `budget` while they wait.
    pub(crate) fn new(budget: &MemoryBudget) -> Channels {
        let inbox = || Arc::new(Inbox::charged(budget.clone()));
        Channels {
            user: inbox(),
            producer: inbox(),
            consumer: inbox(),
        }
    }

    /// Queues a received notification for its recipient.
    pub(crate) fn deliver(&self, n: Notification) {
        match n.recipient() {
            Recipient::User => self.user.push(n),
            Recipient::Producer => self.producer.push(n),
            Recipient::Consumer => self.consumer.push(n),
        }
    }
}

/// A queue of received notifications with blocking waits, bounded in count and bytes, each
/// waiting notification charged to the agent's budget. Overflow drops the oldest (counted in
/// [`Inbox::dropped`] and the metrics): a sender is told nothing of a receiver's backlog, and
/// the newest messages (a connector's latest heartbeat or acknowledgement) matter most.
#[derive(Debug, Default)]
pub(crate) struct Inbox {
    q: Mutex<Queue>,
    cv: Condvar,
    budget: Option<MemoryBudget>,
}

#[derive(Debug, Default)]
struct Queue {
    items: VecDeque<(Notification, Option<Charge>)>,
    bytes: u64,
    dropped: u64,
    /// Per sender: notifications and bytes waiting.
    by_sender: HashMap<String, (usize, u64)>,
}

impl Queue {
    fn pop(&mut self) -> Option<Notification> {
        let (n, _charge) = self.items.pop_front()?;
        let size = held(&n);
        self.bytes -= size;
        if let Some(s) = self.by_sender.get_mut(&n.from) {
            s.0 -= 1;
            s.1 -= size;
            if s.0 == 0 {
                self.by_sender.remove(&n.from);
            }
        }
        Some(n)
    }

    /// Whether `from` may queue `size` more bytes within its share.
    fn within_share(&self, from: &str, size: u64) -> bool {
        let (count, bytes) = self.by_sender.get(from).copied().unwrap_or_default();
        count < MAX_QUEUED / SENDER_SHARE as usize
            && bytes + size <= MAX_QUEUED_BYTES / SENDER_SHARE
    }
}

impl Inbox {
    /// An inbox whose waiting notifications are charged to `budget`.
    pub(crate) fn charged(budget: MemoryBudget) -> Inbox {
        Inbox {
            budget: Some(budget),
            ..Inbox::default()
        }
    }

    pub(crate) fn push(&self, n: Notification) {
        let size = held(&n);
        let mut g = self.q.lock().unwrap_or_else(|e| e.into_inner());
        if size > MAX_QUEUED_BYTES / SENDER_SHARE || !g.within_share(&n.from, size) {
            g.dropped += 1;
            if g.dropped.is_power_of_two() {
                log::warn!(
                    "kvxfer: notifications from {:?} past its share of the queue ({} of the \
                     bytes and count) dropped ({} dropped in all)",
                    n.from,
                    format_args!("1/{SENDER_SHARE}"),
                    g.dropped
                );
            }
            return;
        }
        // Room by count and bytes first, then in the budget: the oldest go.
        let dropped = g.dropped;
        while !g.items.is_empty()
            && (g.items.len() >= MAX_QUEUED || g.bytes + size > MAX_QUEUED_BYTES)
        {
            g.pop();
            g.dropped += 1;
        }
        let charge = loop {
            let Some(b) = &self.budget else { break None };
            match b.try_charge(size, "a received notification") {
                Ok(c) => break Some(c),
                Err(_) if !g.items.is_empty() => {
                    g.pop();
                    g.dropped += 1;
                }
                Err(e) => {
                    // Not even alone: this one is dropped.
                    g.dropped += 1;
                    log::warn!("kvxfer: a notification from {:?} dropped: {e}", n.from);
                    return;
                }
            }
        };
        if g.dropped > dropped {
            log::warn!(
                "kvxfer: notification queue full ({} waiting, {} bytes, or the budget): {} \
                 oldest dropped",
                g.items.len(),
                g.bytes,
                g.dropped - dropped
            );
        }
        g.bytes += size;
        let s = g.by_sender.entry(n.from.clone()).or_default();
        s.0 += 1;
        s.1 += size;
        g.items.push_back((n, charge));
        drop(g);
        self.cv.notify_all();
    }

    pub(crate) fn try_pop(&self) -> Option<Notification> {
        self.q.lock().unwrap_or_else(|e| e.into_inner()).pop()
    }

    pub(crate) fn drain(&self) -> Vec<Notification> {
        let mut g = self.q.lock().unwrap_or_else(|e| e.into_inner());
        std::iter::from_fn(|| g.pop()).collect()
    }

    /// Notifications dropped for room (count, bytes or budget).
    pub(crate) fn dropped(&self) -> u64 {
        self.q.lock().unwrap_or_else(|e| e.into_inner()).dropped
    }

    pub(crate) fn wait(&self, timeout: Duration) -> Result<Notification> {
        let end = Instant::now() + timeout;
        let mut g = self.q.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(n) = g.pop() {
                return Ok(n);
            }
            let now = Instant::now();
            if now >= end {
                return Err(Error::WaitTimeout(timeout));
            }
            g = self
                .cv
                .wait_timeout(g, end - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inbox_waits_and_times_out() {
        let i = Inbox::default();
        let e = i.wait(Duration::from_millis(1)).unwrap_err();
        assert!(matches!(e, Error::WaitTimeout(_)));
        // With no transfer anywhere, the message must not speak of one.
        let text = e.to_string();
        assert!(
            text.contains("nothing happened") && !text.contains("transfer"),
            "{text}"
        );
        i.push(Notification {
            from: "a".into(),
            payload: vec![1],
        });
        assert_eq!(i.wait(Duration::from_millis(1)).unwrap().payload, vec![1]);
    }

    /// A sender of 64 KiB notes nobody reads: the inbox holds at most its byte bound and what
    /// the budget has room for, charged while they wait; the oldest go, counted; what is
    /// drained gives its charge back.
    #[test]
    fn an_undrained_inbox_is_bounded_in_bytes_and_charged_to_the_budget() {
        let budget = MemoryBudget::new(8 << 20);
        let i = Inbox::charged(budget.clone());
        // Five senders in turn: the inbox fills before any sender reaches its share.
        let note = |k: u32| Notification {
            from: format!("flood-{}", k % 5),
            payload: [k.to_le_bytes().to_vec(), vec![0u8; 64 << 10]].concat(),
        };
        for k in 0..500 {
            i.push(note(k));
        }
        let used = budget.used();
        assert!(used <= 8 << 20 && used > 7 << 20, "{used}");
        let kept = i.drain();
        assert_eq!(i.dropped(), 500 - kept.len() as u64);
        // The newest were kept, in order.
        let last = u32::from_le_bytes(kept[kept.len() - 1].payload[..4].try_into().unwrap());
        assert_eq!(last, 499);
        assert_eq!(budget.used(), 0, "drained: given back");
        // Without a budget the byte bound alone holds.
        let j = Inbox::default();
        for k in 0..500 {
            j.push(note(k));
        }
        let bytes: u64 = j.drain().iter().map(held).sum();
        assert!(bytes <= MAX_QUEUED_BYTES && bytes > MAX_QUEUED_BYTES - (65 << 10));
    }

    /// One sender flooding an undrained inbox holds at most its share; another sender's
    /// notifications, older than the flood, are still there.
    #[test]
    fn one_sender_holds_at_most_its_share() {
        let i = Inbox::charged(MemoryBudget::new(64 << 20));
        for k in 0..4u32 {
            i.push(Notification {
                from: "good".into(),
                payload: k.to_le_bytes().to_vec(),
            });
        }
        for _ in 0..2000 {
            i.push(Notification {
                from: "flood".into(),
                payload: vec![0u8; 64 << 10],
            });
        }
        let kept = i.drain();
        let good: Vec<&Notification> = kept.iter().filter(|n| n.from == "good").collect();
        assert_eq!(
            good.len(),
            4,
            "the good sender's notifications were pushed out"
        );
        let flood: u64 = kept.iter().filter(|n| n.from == "flood").map(held).sum();
        assert!(flood <= MAX_QUEUED_BYTES / SENDER_SHARE, "{flood}");
        assert!(
            flood > MAX_QUEUED_BYTES / SENDER_SHARE - (65 << 10),
            "{flood}"
        );
        assert!(i.dropped() > 1900);
        // Drained, the flood has its share again.
        i.push(Notification {
            from: "flood".into(),
            payload: vec![1],
        });
        assert_eq!(i.drain().len(), 1);
    }
}
