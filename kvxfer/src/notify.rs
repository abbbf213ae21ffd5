//! Notifications: small messages a peer receives only after the data of the transfer that
//! carried them has landed (sent as a UCX active message after the transfer's flush).
#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use kvxfer_proto::error::{Error, Result};

pub use kvxfer_proto::wire::notify::Notification;
use kvxfer_proto::wire::notify::Recipient;

/// Most undelivered notifications kept; older ones beyond this are counted as dropped.
pub(crate) const MAX_QUEUED: usize = 65_536;

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
    /// Queues a received notification for its recipient.
    pub(crate) fn deliver(&self, n: Notification) {
        match n.recipient() {
            Recipient::User => self.user.push(n),
            Recipient::Producer => self.producer.push(n),
            Recipient::Consumer => self.consumer.push(n),
        }
    }
}

/// A bounded queue of received notifications with blocking waits.
#[derive(Debug, Default)]
pub(crate) struct Inbox {
    q: Mutex<(VecDeque<Notification>, u64)>,
    cv: Condvar,
}

impl Inbox {
    pub(crate) fn push(&self, n: Notification) {
        let mut g = self.q.lock().unwrap_or_else(|e| e.into_inner());
        if g.0.len() >= MAX_QUEUED {
            g.0.pop_front();
            g.1 += 1;
            log::warn!("notification queue full ({MAX_QUEUED}); oldest dropped");
        }
        g.0.push_back(n);
        drop(g);
        self.cv.notify_all();
    }

    pub(crate) fn try_pop(&self) -> Option<Notification> {
        self.q
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .0
            .pop_front()
    }

    pub(crate) fn drain(&self) -> Vec<Notification> {
        self.q
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .0
            .drain(..)
            .collect()
    }

    pub(crate) fn dropped(&self) -> u64 {
        self.q.lock().unwrap_or_else(|e| e.into_inner()).1
    }

    pub(crate) fn wait(&self, timeout: Duration) -> Result<Notification> {
        let end = Instant::now() + timeout;
        let mut g = self.q.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(n) = g.0.pop_front() {
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
}
