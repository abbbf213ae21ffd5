//! Notifications: small messages a peer receives only after the data of the transfer that
//! carried them has landed (sent as a UCX active message after the transfer's flush).
#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// Largest notification payload.
pub const MAX_NOTIFICATION: usize = 64 * 1024;
/// Most undelivered notifications kept; older ones beyond this are counted as dropped.
pub const MAX_QUEUED: usize = 65_536;

/// A notification received from a peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notification {
    /// Sending agent's name.
    pub from: String,
    /// The payload (e.g. a request id).
    pub payload: Vec<u8>,
}

/// Encodes `(from, payload)` for the wire: `u16 name_len | name | payload`.
pub(crate) fn encode(from: &str, payload: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(2 + from.len() + payload.len());
    v.extend_from_slice(&(from.len() as u16).to_le_bytes());
    v.extend_from_slice(from.as_bytes());
    v.extend_from_slice(payload);
    v
}

/// Decodes a wire notification; `None` for malformed input.
pub fn decode(b: &[u8]) -> Option<Notification> {
    let n = u16::from_le_bytes(b.get(..2)?.try_into().ok()?) as usize;
    if n == 0 || n > crate::metadata::MAX_NAME {
        return None;
    }
    let from = std::str::from_utf8(b.get(2..2 + n)?).ok()?.to_owned();
    let payload = b.get(2 + n..)?;
    if payload.len() > MAX_NOTIFICATION {
        return None;
    }
    Some(Notification {
        from,
        payload: payload.to_vec(),
    })
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
    fn roundtrip_and_garbage() {
        let b = encode("decode-1", b"req-42");
        assert_eq!(
            decode(&b),
            Some(Notification {
                from: "decode-1".into(),
                payload: b"req-42".to_vec()
            })
        );
        assert_eq!(decode(&[]), None);
        assert_eq!(decode(&[5, 0, b'a']), None);
        assert_eq!(decode(&[0, 0]), None);
        assert_eq!(decode(&[2, 0, 0xff, 0xfe]), None);
    }

    #[test]
    fn inbox_waits_and_times_out() {
        let i = Inbox::default();
        assert!(matches!(
            i.wait(Duration::from_millis(1)),
            Err(Error::WaitTimeout(_))
        ));
        i.push(Notification {
            from: "a".into(),
            payload: vec![1],
        });
        assert_eq!(i.wait(Duration::from_millis(1)).unwrap().payload, vec![1]);
    }
}
