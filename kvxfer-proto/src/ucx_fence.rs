//! The owner's side of the UCX fence ([`crate::wire::ucx_fence`]) as a state machine: the
//! initiators that announced themselves before their first RMA, and the deregistrations
//! waiting for their answers. The UCX engine is its I/O shell (it sends what this returns,
//! feeds it what arrives, and passes the clock in).
//!
//! Bounded: at most `cap` initiators. Each HELLO is an entry of its own (an initiator agent
//! announces itself once per endpoint it makes, and may hold two to one owner while it
//! replaces one with its transfers still in flight); an entry goes with its BYE (its
//! endpoint closed with nothing in flight) or its failure. An initiator that let a deregistration's wait run out is *silent*: later
//! deregistrations tell it but do not wait for it, and count it as unconfirmed (the owner
//! keeps the region, `Busy`), until it answers anything or fails. Mirrors the side channel's
//! fence for the peers kept there.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use crate::wire::ucx_fence::FenceMsg;

/// An initiator's entry, by the id the table gave it.
pub type UserId = u64;
/// A deregistration in progress, by the id [`FenceTable::start`] gave it.
pub type FenceId = u64;

#[derive(Debug)]
struct User {
    /// The initiator's token (every GONE for it carries it).
    token: u64,
    /// The owner's token for it (its GONE_ACKs carry it).
    ack: u64,
    /// Its name as it says (a label).
    name: String,
    silent: bool,
}

#[derive(Debug)]
struct Pending {
    id: FenceId,
    region: u32,
    waiting: BTreeSet<UserId>,
    /// Told, not waited for (silent when told).
    unwaited: Vec<UserId>,
    deadline: Duration,
}

/// What a HELLO came to.
#[derive(Debug, PartialEq, Eq)]
pub enum Hello {
    /// Taken in: send `before`, then `reply`, to it over an endpoint to its worker address.
    Welcome {
        /// Its entry.
        user: UserId,
        /// A GONE for each deregistration under way, which waits for it too: what it queued
        /// while it waited for its WELCOME may touch those regions.
        before: Vec<FenceMsg>,
        /// The WELCOME.
        reply: FenceMsg,
    },
    /// The table is full: no answer (its transfers wait for a WELCOME until their deadline).
    Full,
}

/// The owner's initiators and its deregistrations in progress.
#[derive(Debug)]
pub struct FenceTable {
    cap: usize,
    users: HashMap<UserId, User>,
    by_ack: HashMap<u64, UserId>,
    next_user: UserId,
    pending: Vec<Pending>,
    next_fence: FenceId,
}

impl FenceTable {
    /// A table of at most `cap` initiators.
    pub fn new(cap: usize) -> FenceTable {
        FenceTable {
            cap,
            users: HashMap::new(),
            by_ack: HashMap::new(),
            next_user: 1,
            pending: Vec::new(),
            next_fence: 1,
        }
    }

    /// Initiators known.
    pub fn len(&self) -> usize {
        self.users.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.users.is_empty()
    }

    /// The initiators' ids.
    pub fn users(&self) -> impl Iterator<Item = UserId> + '_ {
        self.users.keys().copied()
    }

    /// An initiator's name, as its HELLO said.
    pub fn name(&self, user: UserId) -> Option<&str> {
        self.users.get(&user).map(|u| u.name.as_str())
    }

    /// An initiator's HELLO: `token` and `name` its own, `ack` drawn by the caller (at
    /// random) for it. The caller makes an endpoint back to its worker address.
    /// `gone`: the owner's regions deregistered or being deregistered, as its WELCOME lists
    /// them (the ones under way here are told as GONEs too).
    pub fn hello(&mut self, token: u64, name: String, ack: u64, gone: Vec<(u32, u32)>) -> Hello {
        if self.users.len() >= self.cap || self.by_ack.contains_key(&ack) {
            return Hello::Full;
        }
        let user = self.next_user;
        self.next_user += 1;
        self.by_ack.insert(ack, user);
        self.users.insert(
            user,
            User {
                token,
                ack,
                name,
                silent: false,
            },
        );
        let before = self
            .pending
            .iter_mut()
            .map(|p| {
                p.waiting.insert(user);
                FenceMsg::Gone {
                    token,
                    region: p.region,
                }
            })
            .collect();
        Hello::Welcome {
            user,
            before,
            reply: FenceMsg::Welcome { token, ack, gone },
        }
    }

    /// A BYE: believed only with an `ack` the table drew. Returns the entry it removed.
    pub fn bye(&mut self, ack: u64) -> Option<UserId> {
        let user = self.by_ack.get(&ack).copied()?;
        self.remove(user);
        Some(user)
    }

    /// A GONE_ACK: believed only with an `ack` the table drew. Returns whether it was.
    pub fn gone_ack(&mut self, ack: u64, region: u32) -> bool {
        let Some(&user) = self.by_ack.get(&ack) else {
            return false;
        };
        if let Some(u) = self.users.get_mut(&user) {
            u.silent = false;
        }
        for p in self.pending.iter_mut().filter(|p| p.region == region) {
            p.waiting.remove(&user);
        }
        true
    }

    /// An initiator failed (its endpoint, or its process, is gone): nothing of it touches
    /// anything any more.
    pub fn remove(&mut self, user: UserId) {
        if let Some(u) = self.users.remove(&user) {
            self.by_ack.remove(&u.ack);
        }
        for p in &mut self.pending {
            p.waiting.remove(&user);
            p.unwaited.retain(|u| *u != user);
        }
    }

    /// The owner deregisters `region` at `now`: what to send to whom, and the fence's id;
    /// [`FenceTable::poll`] says when it is over (at the latest at `now + wait`).
    pub fn start(
        &mut self,
        region: u32,
        now: Duration,
        wait: Duration,
    ) -> (FenceId, Vec<(UserId, FenceMsg)>) {
        let id = self.next_fence;
        self.next_fence += 1;
        let mut sends = Vec::with_capacity(self.users.len());
        let mut p = Pending {
            id,
            region,
            waiting: BTreeSet::new(),
            unwaited: Vec::new(),
            deadline: now.saturating_add(wait),
        };
        for (&user, u) in &self.users {
            sends.push((
                user,
                FenceMsg::Gone {
                    token: u.token,
                    region,
                },
            ));
            if u.silent {
                p.unwaited.push(user);
            } else {
                p.waiting.insert(user);
            }
        }
        self.pending.push(p);
        (id, sends)
    }

    /// The deregistrations over at `now`, each with the initiators that did not confirm
    /// (empty: the region may go). One whose wait ran out makes them silent.
    pub fn poll(&mut self, now: Duration) -> Vec<(FenceId, Vec<UserId>)> {
        let mut over = Vec::new();
        let mut i = 0;
        while i < self.pending.len() {
            let p = &self.pending[i];
            if p.waiting.is_empty() || now >= p.deadline {
                let p = self.pending.swap_remove(i);
                for user in &p.waiting {
                    if let Some(u) = self.users.get_mut(user) {
                        u.silent = true;
                    }
                }
                let mut unconfirmed: Vec<UserId> = p.waiting.into_iter().collect();
                unconfirmed.extend(p.unwaited);
                over.push((p.id, unconfirmed));
            } else {
                i += 1;
            }
        }
        over
    }

    /// When the next wait runs out, if one is under way.
    pub fn next_deadline(&self) -> Option<Duration> {
        self.pending.iter().map(|p| p.deadline).min()
    }

    /// Whether a deregistration waits for `user`.
    pub fn awaited(&self, user: UserId) -> bool {
        self.pending.iter().any(|p| p.waiting.contains(&user))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    fn welcome(t: &mut FenceTable, token: u64, worker: u8, ack: u64) -> UserId {
        match t.hello(token, format!("p{worker}"), ack, vec![(0, 4)]) {
            Hello::Welcome {
                user,
                reply,
                before,
                ..
            } => {
                assert_eq!(
                    reply,
                    FenceMsg::Welcome {
                        token,
                        ack,
                        gone: vec![(0, 4)]
                    }
                );
                assert!(before.is_empty());
                user
            }
            Hello::Full => panic!("full"),
        }
    }

    #[test]
    fn a_deregistration_waits_for_every_initiator_told() {
        let mut t = FenceTable::new(8);
        let a = welcome(&mut t, 100, 1, 10);
        let b = welcome(&mut t, 200, 2, 20);
        let (id, sends) = t.start(7, Duration::ZERO, S);
        let mut to: Vec<_> = sends.iter().map(|(u, m)| (*u, m.clone())).collect();
        to.sort_by_key(|(u, _)| *u);
        assert_eq!(
            to,
            vec![
                (
                    a,
                    FenceMsg::Gone {
                        token: 100,
                        region: 7
                    }
                ),
                (
                    b,
                    FenceMsg::Gone {
                        token: 200,
                        region: 7
                    }
                )
            ]
        );
        assert!(t.poll(Duration::ZERO).is_empty());
        // An answer for another region, or with a token the table never drew, counts for
        // nothing.
        assert!(t.gone_ack(10, 8));
        assert!(!t.gone_ack(100, 7));
        assert!(t.poll(Duration::ZERO).is_empty());
        assert!(t.gone_ack(10, 7));
        assert!(t.poll(Duration::ZERO).is_empty());
        assert!(t.gone_ack(20, 7));
        assert_eq!(t.poll(Duration::ZERO), vec![(id, vec![])]);
        assert_eq!(t.next_deadline(), None);
    }

    #[test]
    fn an_initiator_that_lets_the_wait_run_out_is_unconfirmed_until_it_answers() {
        let mut t = FenceTable::new(8);
        let a = welcome(&mut t, 100, 1, 10);
        let (id, _) = t.start(7, Duration::ZERO, S);
        assert_eq!(t.next_deadline(), Some(S));
        assert!(t.poll(S - Duration::from_millis(1)).is_empty());
        assert_eq!(t.poll(S), vec![(id, vec![a])]);
        // Silent: told, not waited for, unconfirmed at once.
        let (id2, sends) = t.start(8, S, S);
        assert_eq!(sends.len(), 1);
        assert!(!t.awaited(a));
        assert_eq!(t.poll(S), vec![(id2, vec![a])]);
        // It answers (late): waited for again.
        assert!(t.gone_ack(10, 7));
        let (id3, _) = t.start(9, S, S);
        assert!(t.awaited(a));
        assert!(t.gone_ack(10, 9));
        assert_eq!(t.poll(S), vec![(id3, vec![])]);
    }

    #[test]
    fn a_failed_initiator_is_not_waited_for() {
        let mut t = FenceTable::new(8);
        let a = welcome(&mut t, 100, 1, 10);
        let (id, _) = t.start(7, Duration::ZERO, S);
        t.remove(a);
        assert_eq!(t.poll(Duration::ZERO), vec![(id, vec![])]);
        assert!(t.is_empty());
        // Its ack token means nothing any more.
        assert!(!t.gone_ack(10, 7));
    }

    #[test]
    fn one_that_announces_itself_during_a_deregistration_is_told_and_waited_for() {
        let mut t = FenceTable::new(8);
        let (id, sends) = t.start(7, Duration::ZERO, S);
        assert!(sends.is_empty());
        match t.hello(100, "a".into(), 10, vec![]) {
            Hello::Welcome { before, .. } => {
                assert_eq!(
                    before,
                    vec![FenceMsg::Gone {
                        token: 100,
                        region: 7
                    }]
                );
            }
            Hello::Full => panic!("full"),
        }
        assert!(t.poll(Duration::ZERO).is_empty(), "not waited for");
        assert!(t.gone_ack(10, 7));
        assert_eq!(t.poll(Duration::ZERO), vec![(id, vec![])]);
    }

    #[test]
    fn a_bye_forgets_the_initiator_and_its_waits() {
        let mut t = FenceTable::new(8);
        let a = welcome(&mut t, 100, 1, 10);
        let (id, _) = t.start(7, Duration::ZERO, S);
        assert_eq!(t.bye(99), None, "a token the table never drew");
        assert_eq!(t.bye(10), Some(a));
        assert_eq!(t.poll(Duration::ZERO), vec![(id, vec![])]);
        assert!(t.is_empty());
    }

    #[test]
    fn the_table_is_bounded() {
        let mut t = FenceTable::new(2);
        let a = welcome(&mut t, 100, 1, 10);
        welcome(&mut t, 200, 2, 20);
        assert_eq!(t.hello(300, "c".into(), 30, vec![]), Hello::Full);
        // One that goes makes room.
        assert_eq!(t.bye(10), Some(a));
        welcome(&mut t, 300, 3, 30);
        assert_eq!(t.len(), 2);
        // An ack token drawn twice is refused rather than shared.
        let mut t = FenceTable::new(4);
        welcome(&mut t, 1, 1, 10);
        assert_eq!(t.hello(2, "b".into(), 10, vec![]), Hello::Full);
    }
}
