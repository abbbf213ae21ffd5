//! Each peer's share of what a TCP lane target serves: its connections and its requests'
//! budget charges. However many connections one peer opens, or however large the tables it
//! announces (and then stalls on), it holds at most [`MAX_CONNS_PER_PEER`] connections and
//! half the budget, so that another peer always finds the other half.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::budget::{Charge, MemoryBudget};
use kvxfer_proto::error::{Error, Result};

/// Connections one peer may have served at once: stripes for its largest transfers, both
/// directions, and room to reconnect.
pub(crate) const MAX_CONNS_PER_PEER: usize = 128;

/// What each peer holds at a target.
#[derive(Debug)]
pub(crate) struct Shares {
    budget: MemoryBudget,
    by_peer: Mutex<HashMap<String, Share>>,
}

#[derive(Debug, Default)]
struct Share {
    conns: usize,
    charged: u64,
    /// Of `charged`, the bytes of its connections' windows.
    windows: u64,
}

impl Shares {
    pub(crate) fn new(budget: MemoryBudget) -> Arc<Shares> {
        Arc::new(Shares {
            budget,
            by_peer: Mutex::default(),
        })
    }

    /// The most one peer's requests may hold: half the budget (no cap when unlimited).
    pub(crate) fn cap(&self) -> u64 {
        match self.budget.limit() {
            u64::MAX => u64::MAX,
            l => l / 2,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Share>> {
        self.by_peer.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A connection of `peer`, counted until the slot drops; refused past
    /// [`MAX_CONNS_PER_PEER`].
    pub(crate) fn connect(self: &Arc<Self>, peer: &str) -> std::result::Result<ConnSlot, String> {
        let mut g = self.lock();
        let s = g.entry(peer.to_string()).or_default();
        if s.conns >= MAX_CONNS_PER_PEER {
            return Err(format!(
                "peer {peer:?} has {} TCP lane connections served here, the most one peer may",
                s.conns
            ));
        }
        s.conns += 1;
        Ok(ConnSlot {
            shares: self.clone(),
            peer: peer.to_string(),
        })
    }

    /// Charges `bytes` of `peer`'s request to the budget (waiting up to `wait` for memory),
    /// after checking that the peer's requests, with this one, stay within its share.
    pub(crate) fn charge(
        self: &Arc<Self>,
        peer: &str,
        bytes: u64,
        what: &str,
        wait: Duration,
    ) -> Result<PeerCharge> {
        {
            let mut g = self.lock();
            let s = g.entry(peer.to_string()).or_default();
            if s.charged.saturating_add(bytes) > self.cap() {
                return Err(Error::OutOfMemory(format!(
                    "{what} of peer {peer:?} needs {bytes} bytes; its requests hold {} here, and \
                     one peer may hold at most {} (half the budget of {})",
                    s.charged,
                    self.cap(),
                    self.budget.limit()
                )));
            }
            // Reserved before the wait, so that two requests of one peer cannot both pass.
            s.charged += bytes;
        }
        // Returned to the share on drop, whether the budget's charge comes or not.
        let mut held = PeerCharge {
            shares: self.clone(),
            peer: peer.to_string(),
            bytes,
            window: 0,
            _charge: None,
        };
        held._charge = Some(self.budget.charge(bytes, what, wait)?);
        Ok(held)
    }

    /// Charges a window of `bytes` for a connection of `peer`, only if it leaves the
    /// requests their room: a peer's windows take at most a quarter of its share, and all
    /// peers' at most a quarter of the budget (none waits: a window refused is the socket).
    pub(crate) fn charge_window(self: &Arc<Self>, peer: &str, bytes: u64) -> Result<PeerCharge> {
        {
            let mut g = self.lock();
            let all: u64 = g.values().map(|s| s.windows).sum();
            let s = g.entry(peer.to_string()).or_default();
            let limit = self.budget.limit();
            if limit != u64::MAX && (s.windows + bytes > self.cap() / 4 || all + bytes > limit / 4)
            {
                return Err(Error::OutOfMemory(format!(
                    "a window for peer {peer:?} ({bytes} bytes): its windows hold {} here, all \
                     peers' {all}, of at most a quarter of its share ({}) and of the budget \
                     ({limit})",
                    s.windows,
                    self.cap()
                )));
            }
            s.windows += bytes;
        }
        let held = self.charge(peer, bytes, "a TCP lane window", Duration::ZERO);
        let mut g = self.lock();
        match held {
            Ok(mut h) => {
                h.window = bytes;
                Ok(h)
            }
            Err(e) => {
                if let Some(s) = g.get_mut(peer) {
                    s.windows = s.windows.saturating_sub(bytes);
                }
                Err(e)
            }
        }
    }

    fn release(&self, peer: &str, conns: usize, bytes: u64, window: u64) {
        let mut g = self.lock();
        if let Some(s) = g.get_mut(peer) {
            s.conns = s.conns.saturating_sub(conns);
            s.charged = s.charged.saturating_sub(bytes);
            s.windows = s.windows.saturating_sub(window);
            if s.conns == 0 && s.charged == 0 {
                g.remove(peer);
            }
        }
    }
}

/// One served connection of a peer, counted until dropped.
#[derive(Debug)]
pub(crate) struct ConnSlot {
    shares: Arc<Shares>,
    peer: String,
}

impl Drop for ConnSlot {
    fn drop(&mut self) {
        self.shares.release(&self.peer, 1, 0, 0);
    }
}

/// A peer's request charge: the budget's charge and the peer's share, released on drop.
#[derive(Debug)]
pub(crate) struct PeerCharge {
    shares: Arc<Shares>,
    peer: String,
    bytes: u64,
    /// Of `bytes`, a window's.
    window: u64,
    _charge: Option<Charge>,
}

impl Drop for PeerCharge {
    fn drop(&mut self) {
        self.shares.release(
            &self.peer,
            0,
            std::mem::take(&mut self.bytes),
            std::mem::take(&mut self.window),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_peer_holds_at_most_half_the_budget() {
        let s = Shares::new(MemoryBudget::new(100));
        let a = s.charge("a", 40, "t", Duration::ZERO).unwrap();
        let e = s.charge("a", 20, "t", Duration::ZERO).unwrap_err();
        assert!(e.to_string().contains("at most 50"), "{e}");
        // Another peer finds the other half.
        let b = s.charge("b", 50, "t", Duration::ZERO).unwrap();
        drop(a);
        let a2 = s.charge("a", 50, "t", Duration::ZERO);
        assert!(a2.is_ok());
        drop((a2, b));
        assert!(s.lock().is_empty());
    }

    #[test]
    fn a_refused_budget_charge_returns_the_share() {
        let s = Shares::new(MemoryBudget::new(100));
        let _a = s.charge("a", 50, "t", Duration::ZERO).unwrap();
        let _b = s.charge("b", 40, "t", Duration::ZERO).unwrap();
        // b's share has room, the budget has not.
        assert!(s.charge("b", 10, "t", Duration::ZERO).is_ok());
        assert!(s.charge("c", 20, "t", Duration::ZERO).is_err());
        assert!(s.lock().get("c").is_none());
    }

    #[test]
    fn windows_take_at_most_a_quarter_of_a_share_and_of_the_budget() {
        let s = Shares::new(MemoryBudget::new(1600));
        // A peer's share is 800: windows of 100 up to 200.
        let a1 = s.charge_window("a", 100).unwrap();
        let a2 = s.charge_window("a", 100).unwrap();
        assert!(
            s.charge_window("a", 100).is_err(),
            "past a quarter of a's share"
        );
        // Its requests still find the rest of the share.
        let r = s.charge("a", 600, "t", Duration::ZERO).unwrap();
        drop(r);
        let b1 = s.charge_window("b", 100).unwrap();
        let b2 = s.charge_window("b", 100).unwrap();
        assert!(
            s.charge_window("c", 100).is_err(),
            "past a quarter of the budget"
        );
        drop((a1, b1));
        let c = s.charge_window("c", 100).unwrap();
        drop((a2, b2, c));
        assert!(s.lock().is_empty());
        // Unlimited: no cap.
        let u = Shares::new(MemoryBudget::unlimited());
        let w: Vec<_> = (0..64)
            .map(|_| u.charge_window("a", 4 << 20).unwrap())
            .collect();
        assert_eq!(w.len(), 64);
    }

    #[test]
    fn connections_per_peer_are_capped() {
        let s = Shares::new(MemoryBudget::unlimited());
        let slots: Vec<ConnSlot> = (0..MAX_CONNS_PER_PEER)
            .map(|_| s.connect("a").unwrap())
            .collect();
        assert!(s.connect("a").is_err());
        assert!(s.connect("b").is_ok());
        drop(slots);
        assert!(s.connect("a").is_ok());
        assert_eq!(s.cap(), u64::MAX);
    }
}
