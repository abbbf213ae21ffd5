//! The UCX fence on the engine thread (messages: `kvxfer_proto::wire::ucx_fence`; the
//! owner's bookkeeping: `kvxfer_proto::ucx_fence::FenceTable`). UCX's emulated RMA checks no
//! key on the target, so a deregistration must reach every peer whose puts and gets may touch
//! the memory, however that peer loaded this agent's metadata (side channel, by hand, etcd).
//!
//! As an initiator, the engine announces itself to a peer (HELLO over the peer's endpoint)
//! before its first RMA there, and posts nothing to it until the peer's WELCOME; a GONE from
//! the peer goes to the agent (which refuses the region and waits for its UCX transfers to the
//! peer to end, `region_gone_at`) and its answer comes back as [`Cmd::FenceAnswer`] to be
//! sent as GONE_ACK. As an owner, it makes an endpoint back to each initiator that announced
//! itself, and on [`Cmd::Fence`] tells them all and answers once each confirmed, failed, or
//! the wait ran out.
//!
//! [`Cmd::Fence`]: super::driver::Cmd::Fence
//! [`Cmd::FenceAnswer`]: super::driver::Cmd::FenceAnswer

use std::collections::HashMap;
use std::ffi::c_void;
use std::ptr::NonNull;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::driver::{on_ep_error, Engine, Peer, Phase};
use super::fence_state::{
    Announced, Back, FenceReply, GoneNotice, User, AM_FENCE, MAX_GONE_QUEUED, MAX_REFUSING,
    MAX_USERS, USER_BIT,
};
use super::handle::{Endpoint, Request};
use super::raw::{self, Posted};
use crate::host::PeerProcess;
use kvxfer_proto::error::{Error, Result, UcsStatus};
use kvxfer_proto::ucx_fence::{Hello, UserId};
use kvxfer_proto::wire::ucx_fence::{add_to_ranges, in_ranges, FenceMsg, Refusal};

/// How often a deregistration waiting for same-host initiators looks at their processes.
const PROCESS_POLL: Duration = Duration::from_millis(20);
/// How long a count of the process's descriptors is trusted (plus what the fence opened).
const FD_RECOUNT: Duration = Duration::from_millis(100);

/// Completion of a fence message's send: frees the message and the request.
unsafe extern "C" fn on_fence_sent(
    req: *mut c_void,
    _status: raw::ucs_status_t,
    user: *mut c_void,
) {
    if !user.is_null() {
        // SAFETY: `user` is the Box leaked by `send` for this request, taken back once, here.
        drop(unsafe { Box::from_raw(user as *mut Vec<u8>) });
    }
    if let Some(req) = NonNull::new(req) {
        // SAFETY: UCX passes the live request this callback completes; freed once, here.
        unsafe { raw::request_free(req) };
    }
}

/// Sends `msg` over `ep`; the bytes live until UCX is done with them.
fn send(ep: &Endpoint, msg: &FenceMsg) -> std::result::Result<(), UcsStatus> {
    let data = Box::new(msg.encode());
    let slice: *const [u8] = data.as_slice();
    let user = Box::into_raw(data);
    // SAFETY: ep is live on this (the engine's) thread; the bytes are the Box's heap buffer,
    // which stays put until on_fence_sent frees it (or below, when the send is done or failed).
    match unsafe {
        raw::am_send(
            ep.as_ptr(),
            AM_FENCE,
            &*slice,
            on_fence_sent,
            user as *mut c_void,
        )
    } {
        Ok(Posted::Pending(_)) => Ok(()),
        r => {
            // SAFETY: no callback will run for a send that completed at once or failed: the
            // Box is taken back once, here.
            drop(unsafe { Box::from_raw(user) });
            r.map(|_| ())
        }
    }
}

impl Engine {
    /// As an initiator: announces this agent to peer `token` (its endpoint made) unless done.
    /// Called for every transfer: costs one lookup once announced.
    pub(super) fn announce(&mut self, token: u64) -> Result<()> {
        let Some(p) = self.peers.get_mut(&token) else {
            return Ok(());
        };
        let Some(ep) = p.ep.as_ref() else {
            return Ok(());
        };
        if p.announced != Announced::No {
            return Ok(());
        }
        let mine = u64::from_le_bytes(crate::random::bytes()?);
        send(
            ep,
            &FenceMsg::Hello {
                token: mine,
                name: self.name.clone(),
                host: self.fence.host,
                worker: self.worker_addr.clone(),
            },
        )
        .map_err(|status| Error::PeerFailed {
            agent: p.name.clone(),
            status,
        })?;
        log::debug!(
            "kvxfer: announced to {:?} (entry {token}, token {mine:x})",
            p.name
        );
        p.announced = Announced::Sent {
            token: mine,
            acks_due: Vec::new(),
        };
        self.fence.tokens.insert(mine, token);
        Ok(())
    }

    /// A fence message arrived.
    pub(super) fn fence_message(&mut self, bytes: &[u8]) {
        match FenceMsg::decode(bytes) {
            Some(FenceMsg::Hello {
                token,
                name,
                host,
                worker,
            }) => self.take_in(token, name, host, worker),
            Some(FenceMsg::Welcome { token, ack, gone }) => self.welcome(token, ack, &gone),
            Some(FenceMsg::Gone { token, region }) => {
                let peer = self.fence.tokens.get(&token).copied();
                let Some((peer, p)) = peer.and_then(|t| self.peers.get(&t).map(|p| (t, p))) else {
                    return self.gone_for_closed(token, region);
                };
                let notice = GoneNotice {
                    peer,
                    name: p.name.clone(),
                    region,
                };
                if self.fence.gone.try_send(notice).is_err() {
                    log::warn!(
                        "kvxfer: {:?} deregisters region {region}: {MAX_GONE_QUEUED} such \
                         notices queued already, not answered",
                        p.name
                    );
                }
            }
            Some(FenceMsg::GoneAck { ack, region }) => {
                if !self.fence.table.gone_ack(ack, region) {
                    log::debug!("kvxfer: a GONE_ACK with a token this agent never drew, dropped");
                }
            }
            Some(FenceMsg::Bye { ack }) => {
                if let Some(user) = self.fence.table.bye(ack) {
                    self.drop_user(user, false);
                }
            }
            Some(FenceMsg::Refused { token, why }) => self.refused(token, why),
            None => log::warn!(
                "kvxfer: a malformed UCX fence message ({} bytes) dropped",
                bytes.len()
            ),
        }
    }

    /// As an initiator: peer `token`'s WELCOME. Its regions it lists as gone went before
    /// this agent announced itself, and no GONE will come for them: the transfers queued
    /// for them are refused (`gone_slots`), and the agent is told, as of a GONE, so that it
    /// refuses later ones itself.
    fn welcome(&mut self, token: u64, ack: u64, gone: &[(u32, u32)]) {
        let Some(peer) = self.fence.tokens.get(&token).copied() else {
            // An entry closed before its WELCOME came: the owner forgets it now, and so does
            // this agent (each closed entry costs at most one endpoint made for it).
            if let Some((None, worker)) = self.fence.closed.remove(&token) {
                self.send_to_owner(&worker, &[FenceMsg::Bye { ack }]);
            }
            return;
        };
        let Some(p) = Self::waiting_for_answer(&mut self.peers, peer, token, "WELCOME") else {
            return;
        };
        log::debug!("kvxfer: welcomed by {:?} (entry {peer})", p.name);
        let was = std::mem::replace(&mut p.announced, Announced::Welcomed { token, ack });
        let acks_due = match was {
            Announced::Sent { acks_due, .. } => acks_due,
            _ => Vec::new(),
        };
        // GONEs that came first (deregistrations under way when it took this agent in),
        // answered already: their GONE_ACKs go now, on the endpoint the WELCOME answered.
        for region in acks_due {
            let sent =
                p.ep.as_ref()
                    .map(|ep| send(ep, &FenceMsg::GoneAck { ack, region }));
            if let Some(Err(status)) = sent {
                log::warn!("kvxfer: GONE_ACK to {:?}: {status}", p.name);
            }
        }
        p.gone_slots = (0u32..)
            .zip(&p.meta.regions)
            .filter(|(_, r)| in_ranges(gone, r.id.0))
            .map(|(k, _)| k)
            .collect();
        for &k in &p.gone_slots {
            let region = p.meta.regions[k as usize].id.0;
            let notice = GoneNotice {
                peer,
                name: p.name.clone(),
                region,
            };
            if self.fence.gone.try_send(notice).is_err() {
                log::warn!("kvxfer: {:?} let region {region} go: not queued", p.name);
            }
        }
    }

    /// Entry `peer`, where it still waits for the answer to its HELLO `token` (`what` names
    /// the answer that came, for the log): an answer to an older HELLO, or to one already
    /// answered, changes nothing.
    /// (Of the peers alone, so that the fence's state stays free to change meanwhile.)
    fn waiting_for_answer<'a>(
        peers: &'a mut HashMap<u64, Peer>,
        peer: u64,
        token: u64,
        what: &str,
    ) -> Option<&'a mut Peer> {
        let Some(p) = peers.get_mut(&peer) else {
            log::debug!("kvxfer: a {what} for entry {peer}, gone");
            return None;
        };
        if !matches!(p.announced, Announced::Sent { token: t, .. } if t == token) {
            log::debug!(
                "kvxfer: a {what} for entry {peer} in state {:?}",
                p.announced
            );
            return None;
        }
        Some(p)
    }

    /// As an initiator: peer `token` did not take this agent in. What waits to be posted to it
    /// fails now, typed; the next transfer announces this agent again.
    fn refused(&mut self, token: u64, why: Refusal) {
        let Some(peer) = self.fence.tokens.get(&token).copied() else {
            // An entry closed before its WELCOME: the owner holds nothing of it either.
            if matches!(self.fence.closed.get(&token), Some((None, _))) {
                self.fence.closed.remove(&token);
            }
            return;
        };
        let Some(p) = Self::waiting_for_answer(&mut self.peers, peer, token, "REFUSED") else {
            return;
        };
        self.fence.tokens.remove(&token);
        p.announced = Announced::No;
        let name = p.name.clone();
        let e = move || Error::PeerLimit {
            agent: name.clone(),
            why: format!(
                "its UCX engine did not take this agent in, so no UCX transfer to it may start: \
                 {why}"
            ),
        };
        log::warn!("kvxfer {}: {}", self.name, e());
        // Waiting for the WELCOME, nothing of them posted.
        for a in self.active.values_mut() {
            if a.job.token == peer && a.phase == Phase::Posting && a.next == 0 {
                a.error.get_or_insert_with(&e);
            }
        }
    }

    /// As an owner: an initiator's HELLO. An endpoint back to it, and WELCOME.
    fn take_in(
        &mut self,
        token: u64,
        name: String,
        host: Option<kvxfer_proto::types::HostInfo>,
        worker: Vec<u8>,
    ) {
        if self.self_only {
            return;
        }
        // Entries of processes that exited go first: they hold table room and descriptors
        // (their pidfds, their endpoints back) that this one may need.
        self.reap_when_due();
        let Ok(ack) = crate::random::bytes().map(u64::from_le_bytes) else {
            return;
        };
        let (user, before, reply) =
            match self.fence.table.hello(token, name, ack, self.gone_ranges()) {
                Hello::Welcome {
                    user,
                    before,
                    reply,
                } => (user, before, reply),
                Hello::Full => {
                    log::warn!(
                        "kvxfer: {MAX_USERS} UCX peers announced already: one more not taken in"
                    );
                    return self.refuse(token, &worker, Refusal::Full);
                }
            };
        // Same host, elsewhere: its process is watched (shared memory does not tell a death).
        let pid = (!self.peer_failure && crate::host::same_host_elsewhere(host))
            .then(|| host.map(|h| h.pid))
            .flatten();
        let process = pid.and_then(|pid| {
            self.fence
                .processes
                .get(&pid)
                .filter(|p| !p.exited())
                .cloned()
        });
        // What this entry would open: an endpoint back to a worker not seen yet (a socket over
        // TCP), a pidfd for a process not watched yet. Refused where that would eat into the
        // reserve the side channel, the lanes and a good peer's connect need, or into the
        // peer table's room.
        let opens = u64::from(!self.fence.back_of.contains_key(&worker))
            + u64::from(pid.is_some() && process.is_none());
        if opens > 0 && self.short_of_fds(opens, 2) {
            self.fence.table.remove(user);
            log::warn!(
                "kvxfer {}: a UCX peer not taken in: this process is short of file \
                 descriptors (a reserve is kept)",
                self.name
            );
            return self.refuse(token, &worker, Refusal::Descriptors);
        }
        let Some(back) = self.back_to(&worker) else {
            self.fence.table.remove(user);
            return;
        };
        // Deregistrations under way first: active messages on one endpoint arrive in order.
        let sent = match self.fence.backs.get(&back) {
            Some(b) => before
                .iter()
                .chain([&reply])
                .try_for_each(|m| send(&b.ep, m)),
            None => Err(raw::status(-25)),
        };
        if let Err(status) = sent {
            log::warn!("kvxfer: WELCOME to a UCX peer: {status}");
            self.fence.table.remove(user);
            self.back_failed(back);
            return;
        }
        let process = match (pid, process) {
            (Some(pid), None) => {
                let p = Rc::new(PeerProcess::open(pid));
                self.fence.processes.insert(pid, p.clone());
                Some(p)
            }
            (_, p) => p,
        };
        log::debug!(
            "kvxfer {}: UCX peer {user} taken in (back {back})",
            self.name
        );
        if let Some(b) = self.fence.backs.get_mut(&back) {
            b.users += 1;
        }
        self.fence.users.insert(user, User { back, process });
        self.fence
            .counts
            .peers
            .store(self.fence.users.len() as u64, Ordering::Relaxed);
    }

    /// As an owner: tells an initiator that its HELLO `token` was not taken in, so that its
    /// transfers fail now, typed, not at their deadline. Over the endpoint back to its
    /// worker where one is open; else over one made for the message and closed at once,
    /// where that leaves the reserve whole and fewer than [`MAX_REFUSING`] such endpoints are
    /// still closing (a flood of HELLOs from new workers costs at most that many
    /// descriptors); else unsaid, and counted.
    fn refuse(&mut self, token: u64, worker: &[u8], why: Refusal) {
        self.fence.counts.refused.fetch_add(1, Ordering::Relaxed);
        let msg = FenceMsg::Refused { token, why };
        let back = self.fence.back_of.get(worker);
        if let Some(b) = back.and_then(|b| self.fence.backs.get(b)) {
            if let Err(status) = send(&b.ep, &msg) {
                log::debug!("kvxfer: REFUSED to a UCX peer: {status}");
            }
            return;
        }
        self.fence.refusing.retain(|r| !r.done());
        if self.fence.refusing.len() >= MAX_REFUSING || self.short_of_fds(1, 1) {
            self.fence.counts.unanswered.fetch_add(1, Ordering::Relaxed);
            return;
        }
        match self.send_once(worker, &[msg]) {
            Ok(Some(req)) => self.fence.refusing.push(req),
            Ok(None) => {}
            Err(status) => {
                log::debug!("kvxfer: REFUSED to a UCX peer: {status}");
                self.fence.counts.unanswered.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Whether opening `n` descriptors more would eat into `factor` times the reserve (the
    /// fence's entries keep it twice over). Counted at most once per `FD_RECOUNT` (a walk of
    /// `/proc/self/fd`), and the count kept up to date in between with what the fence opened
    /// itself: a flood of HELLOs costs no walk each.
    fn short_of_fds(&mut self, n: u64, factor: u64) -> bool {
        let now = Instant::now();
        let fds = match self.fence.fds {
            Some((at, fds)) if now < at + FD_RECOUNT => fds,
            _ => {
                let fds = crate::fd_limit::fds();
                self.fence.fds = Some((now, fds));
                fds
            }
        };
        let Some(mut fds) = fds else {
            return false;
        };
        // Twice the reserve for an entry: the reserve itself, and as much again for the peer
        // table, whose loads (8 descriptors each) must still find room past the reserve.
        if fds.short_of(n, factor) {
            return true;
        }
        fds.open += n;
        self.fence.fds = self.fence.fds.map(|(at, _)| (at, Some(fds)));
        false
    }

    /// The endpoint back to `worker`: the one its earlier entries use, or a new one.
    fn back_to(&mut self, worker: &[u8]) -> Option<u64> {
        if let Some(&b) = self.fence.back_of.get(worker) {
            return Some(b);
        }
        if self.fence.backs.len() >= MAX_USERS {
            let idle: Vec<u64> = self
                .fence
                .backs
                .iter()
                .filter(|(_, b)| b.users == 0)
                .map(|(&id, _)| id)
                .collect();
            for b in idle {
                self.close_back(b, false);
            }
        }
        let id = self.fence.next_back;
        let ep = match self.worker.connect(
            worker,
            on_ep_error,
            (USER_BIT | id) as *mut c_void,
            self.peer_failure,
        ) {
            Ok(ep) => ep,
            Err(status) => {
                log::warn!(
                    "kvxfer: an endpoint back to a UCX peer that announced itself: {status}"
                );
                return None;
            }
        };
        self.fence.next_back += 1;
        self.fence.back_of.insert(worker.to_vec(), id);
        self.fence.backs.insert(
            id,
            Back {
                ep,
                worker: worker.to_vec(),
                users: 0,
            },
        );
        Some(id)
    }

    /// An endpoint back to initiators failed: every entry using it is gone.
    pub(super) fn back_failed(&mut self, back: u64) {
        let users: Vec<UserId> = self
            .fence
            .users
            .iter()
            .filter(|(_, u)| u.back == back)
            .map(|(&id, _)| id)
            .collect();
        // Closed first (forced): the entries below then find it gone.
        self.close_back(back, true);
        for user in users {
            self.drop_user(user, true);
        }
    }

    /// This agent's regions that initiators must not reach: deregistered, or being so.
    fn gone_ranges(&self) -> Vec<(u32, u32)> {
        let mut r = self.fence.deregistered.clone();
        for &id in &self.fence.going {
            add_to_ranges(&mut r, id);
        }
        r
    }

    /// Region `id` was deregistered: no longer going; gone for good where UCX reached it
    /// (`mapped`). One UCX never mapped (staged device memory, lane-only) is the lanes'
    /// to refuse, and left out of what a WELCOME says.
    pub(super) fn fence_forget(&mut self, id: u32, mapped: bool) {
        self.fence.going.remove(&id);
        if mapped {
            add_to_ranges(&mut self.fence.deregistered, id);
        }
    }

    /// As an initiator: the agent answered a GONE of peer `peer` for `region` (nothing of it
    /// touches the region any more).
    pub(super) fn fence_answer(&mut self, peer: u64, region: u32) {
        let Some(p) = self.peers.get_mut(&peer) else {
            return;
        };
        if let Announced::Sent { acks_due, .. } = &mut p.announced {
            // Its GONE came before the WELCOME: answered once that comes (with its `ack`).
            if acks_due.len() < MAX_GONE_QUEUED && !acks_due.contains(&region) {
                acks_due.push(region);
            }
            return;
        }
        let (&Announced::Welcomed { ack, .. }, Some(ep)) = (&p.announced, p.ep.as_ref()) else {
            log::debug!("kvxfer: no GONE_ACK from entry {peer} ({:?})", p.announced);
            return;
        };
        if let Err(status) = send(ep, &FenceMsg::GoneAck { ack, region }) {
            log::warn!("kvxfer: GONE_ACK to {:?}: {status}", p.name);
        }
    }

    /// Whether peer `token` may be posted to: it welcomed this agent's announcement.
    pub(super) fn welcomed(&self, token: u64) -> bool {
        self.peers
            .get(&token)
            .is_some_and(|p| matches!(p.announced, Announced::Welcomed { .. }))
    }

    /// Peer `token`'s endpoint is being closed: its announcement means nothing any more. A
    /// graceful close (nothing in flight) says BYE first, so that the peer stops waiting for
    /// this agent's answers; a failed endpoint cannot.
    pub(super) fn forget_announcement(&mut self, token: u64, graceful: bool) {
        let Some(p) = self.peers.get_mut(&token) else {
            return;
        };
        if let Announced::Sent { token: t, .. } | Announced::Welcomed { token: t, .. } = p.announced
        {
            self.fence.tokens.remove(&t);
        }
        // Remembered (closed with nothing in flight), so that a GONE for it is answered, and
        // one not welcomed yet says BYE once its WELCOME comes.
        let known = match p.announced {
            Announced::Welcomed { token: t, ack } => Some((t, Some(ack))),
            Announced::Sent { token: t, .. } => Some((t, None)),
            Announced::No => None,
        };
        if let (Some((t, ack)), true) = (known, graceful) {
            if let (Some(ack), Some(ep)) = (ack, &p.ep) {
                if let Err(status) = send(ep, &FenceMsg::Bye { ack }) {
                    log::debug!("kvxfer: BYE to {:?}: {status}", p.name);
                }
            }
            let worker = p.meta.worker_addr.clone();
            self.fence.closed.insert(t, (ack, worker));
            self.fence.closed_order.push_back(t);
            while self.fence.closed_order.len() > MAX_USERS {
                if let Some(old) = self.fence.closed_order.pop_front() {
                    self.fence.closed.remove(&old);
                }
            }
        }
        if let Some(p) = self.peers.get_mut(&token) {
            p.announced = Announced::No;
        }
    }

    /// A GONE for an entry of this agent closed with nothing in flight: nothing of it touches
    /// the region, answered at once over any endpoint to the same owner, with a BYE after it
    /// (its first was lost) so that the owner forgets the entry, as this agent then does: a
    /// closed entry costs at most one endpoint made for it, whatever an owner sends. Any other
    /// token (never drawn here, or forgotten) is dropped.
    fn gone_for_closed(&mut self, token: u64, region: u32) {
        let Some((ack, _)) = self.fence.closed.get(&token) else {
            log::debug!("kvxfer: a GONE with a token this agent never drew, dropped");
            return;
        };
        // Not welcomed yet: its BYE, once the WELCOME comes, answers for it.
        if let Some(ack) = *ack {
            if let Some((_, worker)) = self.fence.closed.remove(&token) {
                let msgs = [FenceMsg::GoneAck { ack, region }, FenceMsg::Bye { ack }];
                self.send_to_owner(&worker, &msgs);
            }
        }
    }

    /// Sends `msg` over any endpoint of this agent's to the owner at `worker`, else over one
    /// made for it and closed at once (gracefully: the message goes first). Without it, an
    /// entry closed before its WELCOME came, with no other endpoint to the owner, could never
    /// say BYE, and the owner would wait for it at every deregistration (`Busy`).
    fn send_to_owner(&mut self, worker: &[u8], msgs: &[FenceMsg]) {
        let send_all = |ep: &Endpoint| {
            for msg in msgs {
                if let Err(status) = send(ep, msg) {
                    log::debug!("kvxfer: {msg:?} for a closed entry: {status}");
                }
            }
        };
        let ep = self
            .peers
            .values()
            .filter(|p| p.meta.worker_addr == worker)
            .find_map(|p| p.ep.as_ref());
        if let Some(ep) = ep {
            return send_all(ep);
        }
        match self.send_once(worker, msgs) {
            Ok(Some(req)) => self.closing.push((req, Vec::new())),
            Ok(None) => {}
            Err(status) => log::debug!("kvxfer: {msgs:?} for a closed entry: {status}"),
        }
    }

    /// Sends `msgs` over an endpoint to `worker` made for them, closed at once (gracefully:
    /// the messages go first); the close still under way, if any.
    fn send_once(
        &mut self,
        worker: &[u8],
        msgs: &[FenceMsg],
    ) -> std::result::Result<Option<Request>, UcsStatus> {
        // Error argument 0: no peer's token (they start at 1), so a failure reaches nobody.
        let ep =
            self.worker
                .connect(worker, on_ep_error, std::ptr::null_mut(), self.peer_failure)?;
        for msg in msgs {
            if let Err(status) = send(&ep, msg) {
                log::debug!("kvxfer: {msg:?} to a UCX peer: {status}");
            }
        }
        ep.close(false)
    }

    /// As an owner: region `region` is being deregistered. Tells every initiator; `reply`
    /// gets the ones that did not confirm within `wait` once it is over.
    pub(super) fn fence_start(&mut self, region: u32, wait: Duration, reply: FenceReply) {
        self.reap_dead_users();
        self.fence.going.insert(region);
        let now = self.fence.clock.elapsed();
        let (id, sends) = self.fence.table.start(region, now, wait);
        for (user, msg) in sends {
            let sent = self
                .fence
                .users
                .get(&user)
                .and_then(|u| self.fence.backs.get(&u.back))
                .map(|b| send(&b.ep, &msg));
            if !matches!(sent, Some(Ok(()))) {
                log::info!(
                    "kvxfer {}: GONE to UCX peer {user}: {sent:?}: dropped",
                    self.name
                );
                // Its endpoint is broken: it is gone, and touches nothing.
                self.drop_user(user, true);
            }
        }
        self.fence.waits.insert(id, (region, reply));
        self.poll_fences();
    }

    /// Answers the deregistrations that are over; returns when to look again.
    pub(super) fn poll_fences(&mut self) -> Option<Instant> {
        if self.fence.waits.is_empty() {
            return None;
        }
        self.reap_when_due();
        for (id, unconfirmed) in self.fence.table.poll(self.fence.clock.elapsed()) {
            if let Some((region, reply)) = self.fence.waits.remove(&id) {
                if !unconfirmed.is_empty() {
                    // It stays registered (`Busy`): live again for initiators to come.
                    // (Those told refuse it for good, as over the side channel.)
                    self.fence.going.remove(&region);
                }
                // Named as they said (the deregistration counts the peers that did not
                // answer by name, once each whichever way they were told).
                let names = unconfirmed
                    .iter()
                    .map(|u| self.fence.table.name(*u).unwrap_or("?").to_string())
                    .collect();
                let _ = reply.send(Ok(names));
            }
        }
        let next = self.fence.table.next_deadline()?;
        let at = self.fence.clock + next;
        Some(at.min(Instant::now() + PROCESS_POLL))
    }

    /// [`Engine::reap_dead_users`], at most once a `PROCESS_POLL`.
    fn reap_when_due(&mut self) {
        let now = Instant::now();
        if self.fence.reaped_at.is_none_or(|t| now >= t + PROCESS_POLL) {
            self.fence.reaped_at = Some(now);
            self.reap_dead_users();
        }
    }

    /// Initiators on this host whose process exited are gone (shared memory does not say so).
    /// Each process is looked at once, however many entries name it (a HELLO flood naming
    /// one process makes a thousand), now that HELLOs call this too.
    fn reap_dead_users(&mut self) {
        let mut exited: HashMap<*const PeerProcess, bool> = HashMap::new();
        let dead: Vec<UserId> = self
            .fence
            .users
            .iter()
            .filter(|(_, u)| {
                u.process
                    .as_ref()
                    .is_some_and(|p| *exited.entry(Rc::as_ptr(p)).or_insert_with(|| p.exited()))
            })
            .map(|(&id, _)| id)
            .collect();
        for user in dead {
            log::info!("kvxfer {}: UCX peer {user}'s process exited", self.name);
            self.drop_user(user, true);
        }
    }

    /// Forgets an entry; its endpoint back goes with the last entry using it (`force` where
    /// the entry failed).
    fn drop_user(&mut self, user: UserId, force: bool) {
        self.fence.table.remove(user);
        let Some(u) = self.fence.users.remove(&user) else {
            return;
        };
        self.fence
            .counts
            .peers
            .store(self.fence.users.len() as u64, Ordering::Relaxed);
        // The process's pidfd goes with its last entry (the map holds one reference).
        if let Some(p) = u.process {
            let watched = self.fence.processes.get(&p.pid());
            if Rc::strong_count(&p) == 2 && watched.is_some_and(|w| Rc::ptr_eq(w, &p)) {
                self.fence.processes.remove(&p.pid());
            }
        }
        if let Some(b) = self.fence.backs.get_mut(&u.back) {
            b.users = b.users.saturating_sub(1);
        }
        // A failed entry's endpoint back goes now, unless other entries still use it: a
        // HELLO names its process and its worker as it likes, and one naming a process that
        // exited and another's worker must not take that worker's entries with it. An idle
        // one stays for the initiator's next entry (closing it and making another to the
        // same worker lost the first message on the new one, on UCX 1.13's TCP), until there
        // are too many.
        if force && self.fence.backs.get(&u.back).is_some_and(|b| b.users == 0) {
            self.close_back(u.back, true);
        }
    }

    /// Closes an endpoint back (`force` where it failed, or at shutdown).
    fn close_back(&mut self, back: u64, force: bool) {
        let Some(b) = self.fence.backs.remove(&back) else {
            return;
        };
        self.fence.back_of.remove(&b.worker);
        // Graceful when nothing failed: what was sent on it (a GONE) still goes.
        match b.ep.close(force) {
            Ok(Some(req)) => self.closing.push((req, Vec::new())),
            Ok(None) => {}
            Err(status) => log::debug!("kvxfer: closing an endpoint to a UCX peer: {status}"),
        }
    }

    /// At shutdown: every initiator's endpoint closed, every deregistration answered.
    pub(super) fn close_fence(&mut self) {
        let users: Vec<UserId> = self.fence.users.keys().copied().collect();
        for u in users {
            self.drop_user(u, true);
        }
        let backs: Vec<u64> = self.fence.backs.keys().copied().collect();
        for b in backs {
            self.close_back(b, true);
        }
        // Endpoints that said REFUSED: their closes are waited for with the others.
        let refusing = std::mem::take(&mut self.fence.refusing);
        self.closing
            .extend(refusing.into_iter().map(|r| (r, Vec::new())));
        for (_, (_, reply)) in self.fence.waits.drain() {
            let _ = reply.send(Err(Error::Shutdown));
        }
    }
}
