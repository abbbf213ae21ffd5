//! The transfer state machine on the engine thread: post operations in bounded batches, flush,
//! send the notification, complete the caller's handle; deadlines tear down the endpoint.

use std::ffi::c_void;
use std::time::{Duration, Instant};

use super::driver::{
    on_send_done, push_event, Active, Engine, Event, Phase, AM_NOTIFY, POST_BATCH,
};
use super::handle::{Endpoint, Rkey};
use super::raw::{self, Posted};
use crate::transfer::Job;
use kvxfer_proto::error::{Error, UcsStatus};
use kvxfer_proto::types::{Lane, XferOp};

impl Engine {
    pub(super) fn start(&mut self, job: Box<Job>) {
        let fail = |job: Box<Job>, e: Error| job.finish(Err(e));
        let token = match self.names.get(&job.peer) {
            Some(&t) => t,
            None => {
                let e = Error::UnknownPeer {
                    agent: job.peer.clone(),
                };
                return fail(job, e);
            }
        };
        if token != job.token {
            let e = Error::StalePeer {
                agent: job.peer.clone(),
                prepared: job.token,
                current: token,
            };
            return fail(job, e);
        }
        for r in job.pins.regions() {
            if !self.regions.contains_key(&r.id.0) {
                let e = Error::Deregistered { region: r.id.0 };
                return fail(job, e);
            }
        }
        if let Err(e) = self.ensure_ep(token).and_then(|()| self.announce(token)) {
            return fail(job, e);
        }
        if let Some(p) = self.peers.get_mut(&token) {
            p.jobs += 1;
            // A same-host peer's process is watched while transfers to it are in flight.
            self.watching |= p.process.is_some();
        }
        let deadline_at = job.deadline.map(|d| job.started + d);
        self.active.insert(
            job.id,
            Active {
                job,
                next: 0,
                phase: Phase::Posting,
                error: None,
                canceled: false,
                posted_at: None,
                deadline_at,
            },
        );
    }

    /// Posts up to POST_BATCH operations of each transfer in the posting phase; posts the
    /// flush of those that are fully posted (or stopped). True if anything was posted.
    pub(super) fn post_batches(&mut self) -> bool {
        if !self.active.values().any(|a| a.phase == Phase::Posting) {
            return false;
        }
        let mut did = false;
        // Nothing is posted to a peer before it welcomed this agent's announcement (the UCX
        // fence); a transfer stopped posts nothing more and goes to its flush.
        let ids: Vec<u64> = self
            .active
            .iter()
            .filter(|(_, a)| a.phase == Phase::Posting)
            .filter(|(_, a)| {
                a.canceled
                    || a.error.is_some()
                    || self.welcomed(a.job.token)
                    || self.peers.get(&a.job.token).is_none_or(|p| p.ep.is_none())
            })
            .map(|(&id, _)| id)
            .collect();
        for id in ids {
            did = true;
            let Some(a) = self.active.get_mut(&id) else {
                continue;
            };
            let Some(p) = self.peers.get(&a.job.token) else {
                continue;
            };
            let Some(ep) = p.ep.as_ref().map(Endpoint::as_ptr) else {
                a.error.get_or_insert(Error::PeerFailed {
                    agent: p.name.clone(),
                    status: p.failed.unwrap_or(raw::status(-25)),
                });
                // close_peer moves every posting transfer of the peer to its flush before it
                // closes the endpoint, so a posting transfer without one has posted nothing:
                // UCX holds none of its buffers, finish at once.
                let a = self.active.remove(&id);
                if let Some(a) = a {
                    self.finish(a, UcsStatus::OK);
                }
                continue;
            };
            let write = a.job.op == XferOp::Write;
            // Queued before the peer's WELCOME, for a region it let go before that.
            if a.next == 0 && !p.gone_slots.is_empty() && a.error.is_none() {
                // Sorted (made in slot order): a binary search per operation.
                let gone = |k: &u32| p.gone_slots.binary_search(k).is_ok();
                if let Some(k) = a.job.plan.slots(true).find(gone) {
                    let region = p.meta.regions.get(k as usize).map_or(0, |r| r.id.0);
                    a.error = Some(Error::Deregistered { region });
                }
            }
            let stop = a.canceled || a.error.is_some();
            if !stop {
                let end = (a.next + POST_BATCH).min(a.job.plan.ops().len());
                for o in &a.job.plan.ops()[a.next..end] {
                    let Some(rkey) = p.rkeys[o.rslot as usize].as_ref().map(Rkey::as_ptr) else {
                        // Staged device memory: the agent routes it to the TCP lane; never
                        // hand UCX a region it cannot reach.
                        a.error = Some(Error::InvalidArgument(format!(
                            "region slot {} of {:?} is staged device memory, which UCX cannot reach",
                            o.rslot, p.name
                        )));
                        break;
                    };
                    // SAFETY: ep/rkey live on this thread; the local range was bounds-checked
                    // against a registered region pinned by this job (inflight) until the
                    // flush below completes; the remote range was checked against the peer's
                    // region table for this token, whose rkeys these are.
                    match unsafe { raw::rma(write, ep, o.local, o.len, o.remote, rkey) } {
                        Ok(Posted::Done) => {}
                        Ok(Posted::Pending(req)) => {
                            // SAFETY: live request, freed once; UCX releases it when done and
                            // the flush reports completion.
                            unsafe { raw::request_free(req) }
                        }
                        Err(status) => {
                            // A dead or unreachable peer is the peer's failure, not UCX's.
                            a.error = Some(if is_peer_failure(status) {
                                Error::PeerFailed {
                                    agent: p.name.clone(),
                                    status,
                                }
                            } else {
                                Error::Ucx {
                                    op: if write { "ucp_put_nbx" } else { "ucp_get_nbx" },
                                    status,
                                }
                            });
                            break;
                        }
                    }
                }
                a.next = end;
            }
            if a.next >= a.job.plan.ops().len() || a.canceled || a.error.is_some() {
                post_flush(a, id, ep);
            }
        }
        did
    }

    /// Fails transfers past their deadline by tearing down the peer's endpoint (the only way
    /// to make UCX give up posted RMA), and gives up on those that UCX has not let go of
    /// [`ABANDON_AFTER`] later; returns the earliest pending deadline.
    pub(super) fn check_deadlines(&mut self) -> Option<Instant> {
        let now = Instant::now();
        let mut next: Option<Instant> = None;
        let mut expired = Vec::new();
        let mut stuck = Vec::new();
        // Same-host peers whose process exited (UCX's shared memory never says so): each
        // watched peer's pidfd is looked at once a WATCH_PERIOD, only while it has transfers.
        let mut dead: Vec<u64> = Vec::new();
        if self.watching && now >= self.watched_at + WATCH_PERIOD {
            self.watched_at = now;
            let mut still = false;
            for (&t, p) in &self.peers {
                if let Some(pr) = p.process.as_ref().filter(|_| p.jobs > 0) {
                    if pr.exited() {
                        dead.push(t);
                    } else {
                        still = true;
                    }
                }
            }
            self.watching = still;
        }
        if self.watching {
            let at = self.watched_at + WATCH_PERIOD;
            next = Some(at);
        }
        for (&id, a) in &self.active {
            if dead.contains(&a.job.token) {
                continue;
            }
            if let Some(d) = a.deadline_at {
                if d <= now && a.error.is_none() {
                    expired.push(id);
                } else if a.error.is_none() {
                    next = Some(next.map_or(d, |n: Instant| n.min(d)));
                } else if self.peer_failure {
                    // UCX completes a force-closed endpoint's operations with errors.
                } else if d + ABANDON_AFTER <= now {
                    stuck.push(id);
                } else {
                    let at = d + ABANDON_AFTER;
                    next = Some(next.map_or(at, |n: Instant| n.min(at)));
                }
            }
        }
        for id in stuck {
            self.abandon(id);
        }
        for token in dead {
            if let Some(p) = self.peers.get_mut(&token) {
                p.failed.get_or_insert(raw::status(-25));
            }
            let ids: Vec<u64> = self
                .active
                .iter()
                .filter(|(_, a)| a.job.token == token)
                .map(|(&id, _)| id)
                .collect();
            for &id in &ids {
                if let Some(a) = self.active.get_mut(&id) {
                    a.error.get_or_insert_with(|| Error::PeerFailed {
                        agent: a.job.peer.clone(),
                        status: raw::status(-25), // UCS_ERR_CONNECTION_RESET
                    });
                }
            }
            log::warn!(
                "kvxfer: a same-host peer's process has exited: {} transfer(s) to it fail",
                ids.len()
            );
            self.close_peer(token, true);
            // Nobody will complete what the dead process left outstanding.
            for id in ids {
                self.abandon(id);
            }
        }
        for id in expired {
            let Some(a) = self.active.get_mut(&id) else {
                continue;
            };
            a.error = Some(Error::Deadline {
                agent: a.job.peer.clone(),
                deadline: a.job.deadline.unwrap_or_default(),
                posted_ops: a.next,
                ops: a.job.plan.ops().len(),
            });
            let token = a.job.token;
            // In any phase: close_peer first ends the posting of every transfer on the peer
            // with a flush, then force-closes, which completes those flushes with an error.
            log::warn!(
                "kvxfer: transfer {id} to {:?} missed its deadline; closing the endpoint",
                a.job.peer
            );
            if let Some(p) = self.peers.get_mut(&token) {
                p.failed = Some(raw::status(-20)); // UCS_ERR_TIMED_OUT
            }
            self.close_peer(token, true);
        }
        next
    }
}

/// How long after its deadline a transfer whose endpoint was force-closed may still wait for
/// UCX to complete it, without peer-failure detection (shared memory: no UCX transport that
/// serves it detects a dead peer): a force-close then does not complete what a dead peer's
/// operations left outstanding, and they would hold the transfer forever. With detection on,
/// UCX completes them with errors itself, so nothing is given up there (and no buffer
/// leaked): that path stays as it was.
pub(super) const ABANDON_AFTER: Duration = Duration::from_millis(250);

/// How often the processes of same-host peers with transfers in flight are looked at.
const WATCH_PERIOD: Duration = Duration::from_millis(20);

impl Engine {
    /// Completes transfer `id` with its error without UCX's word that it is done: its
    /// buffers, its notification and its plan stay with the process (leaked, as at shutdown),
    /// since an operation UCX still holds may touch them; a late callback finds no transfer.
    fn abandon(&mut self, id: u64) {
        let Some(a) = self.active.remove(&id) else {
            return;
        };
        let e = a.error.unwrap_or(Error::Canceled);
        log::warn!(
            "kvxfer: UCX did not complete transfer {id} to {:?} ({e}); it fails now, and its \
             buffers stay pinned (deregistering them is Busy)",
            a.job.peer
        );
        a.job.pins.leak();
        a.job.state.complete(Err(e));
        self.stuck = true;
        let token = a.job.token;
        Box::leak(a.job);
        self.job_gone(token);
    }
}

/// Ends a transfer's posting phase: posts the flush whose callback (`on_send_done`) completes
/// it once every operation posted before it has completed on `ep`.
pub(super) fn post_flush(a: &mut Active, id: u64, ep: raw::ucp_ep_h) {
    a.posted_at = Some(a.job.started.elapsed());
    a.phase = Phase::Flushing;
    // SAFETY: ep is live and used on this (the engine) thread only; the user data is the job
    // id, not a pointer, so a late callback cannot dangle.
    match unsafe { raw::ep_flush(ep, on_send_done, id as *mut c_void) } {
        // on_send_done reports completion and frees the request.
        Ok(Posted::Pending(_)) => {}
        Ok(Posted::Done) => push_event(Event::Done {
            job: id,
            status: UcsStatus::OK,
        }),
        Err(status) => push_event(Event::Done { job: id, status }),
    }
}

/// Statuses that mean the peer or the path to it is gone (UCS_ERR_UNREACHABLE,
/// UCS_ERR_CONNECTION_RESET, UCS_ERR_ENDPOINT_TIMEOUT).
fn is_peer_failure(s: UcsStatus) -> bool {
    matches!(s.code(), -6 | -25 | -80)
}

impl Engine {
    /// A transfer's flush (or notification) completed with `status`.
    pub(super) fn step(&mut self, id: u64, status: UcsStatus) {
        let Some(a) = self.active.get_mut(&id) else {
            return;
        };
        let ok = status.is_ok() && a.error.is_none() && !a.canceled;
        if a.phase == Phase::Flushing && ok && a.job.notification.is_some() {
            if let Some(via) = a.job.note_via.clone() {
                // The data is in place; the notification goes the way the agent chose.
                if let Some(a) = self.active.remove(&id) {
                    let stats = a.job.stats(Lane::Ucx, a.posted_at.unwrap_or_default());
                    a.job.pins.release();
                    if let Err(e) = via(a.job.notification_carrier(stats)) {
                        a.job.finish(Err(e));
                    }
                    self.job_gone(a.job.token);
                }
                return;
            }
        }
        if a.phase == Phase::Flushing && ok {
            if let Some(n) = a.job.notification.as_deref() {
                let ep = self
                    .peers
                    .get(&a.job.token)
                    .and_then(|p| p.ep.as_ref().map(Endpoint::as_ptr));
                if let Some(ep) = ep {
                    a.phase = Phase::Notifying;
                    // SAFETY: ep live on this thread; `n` is owned by the job, which stays in
                    // `active` until this send's callback; user data is the job id.
                    match unsafe { raw::am_send(ep, AM_NOTIFY, n, on_send_done, id as *mut c_void) }
                    {
                        // on_send_done reports completion and frees the request.
                        Ok(Posted::Pending(_)) => return,
                        Ok(Posted::Done) => {}
                        Err(s) => {
                            a.error = Some(Error::Ucx {
                                op: "ucp_am_send_nbx",
                                status: s,
                            });
                        }
                    }
                }
            }
        }
        if let Some(a) = self.active.remove(&id) {
            self.finish(a, status);
        }
    }

    pub(super) fn finish(&mut self, a: Active, status: UcsStatus) {
        let job = a.job;
        let token = job.token;
        let peer_failed = self.peers.get(&token).and_then(|p| p.failed);
        let result = if let Some(e) = a.error {
            Err(e)
        } else if a.canceled {
            Err(Error::Canceled)
        } else if !status.is_ok() {
            // The endpoint's own failure says more than the CANCELED its close produced.
            Err(Error::PeerFailed {
                agent: job.peer.clone(),
                status: peer_failed.unwrap_or(status),
            })
        } else if let Some(mut s) = job.lane_stats.clone() {
            s.duration = job.started.elapsed();
            Ok(s)
        } else {
            Ok(job.stats(Lane::Ucx, a.posted_at.unwrap_or_default()))
        };
        job.finish(result);
        self.job_gone(token);
    }

    /// A job of peer entry `token` is done with the engine: a retired peer closes after its
    /// last one.
    fn job_gone(&mut self, token: u64) {
        if let Some(p) = self.peers.get_mut(&token) {
            p.jobs = p.jobs.saturating_sub(1);
            if p.retired && p.jobs == 0 {
                self.close_peer(token, false);
                self.peers.remove(&token);
            }
        }
    }
}
