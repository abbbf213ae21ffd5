//! Peers: loading metadata, creating endpoints and unpacking rkeys lazily, retiring replaced
//! peers once their transfers finish, and closing endpoints (forcibly on failure).

use std::ffi::c_void;

use super::driver::{on_ep_error, Engine, LoadedPeer, Peer, Phase};

use super::handle::{Endpoint, Rkey};
use super::transfer::post_flush;
use kvxfer_proto::error::{Error, Result, UcsStatus};
use kvxfer_proto::types::PeerInfo;
use kvxfer_proto::wire::metadata::{Metadata, RegionMeta};

impl Engine {
    /// Loads a peer's metadata: a new entry (the old one of the same name retired), nothing
    /// when the same peer handshakes again, or the same entry grown when the peer only
    /// registered regions since (the lists prepared against it stay valid). Connects now, so
    /// that errors in the address show up at load time.
    pub(super) fn load_peer(&mut self, meta: Metadata) -> LoadedPeer {
        if let Some(&t) = self.names.get(&meta.name) {
            let p = &self.peers[&t];
            if p.meta == meta && p.failed.is_none() {
                return LoadedPeer {
                    token: None,
                    connected: Ok(()),
                };
            }
            if p.failed.is_none() && meta.extends(&p.meta) {
                if let Ok(()) = self.grow(t, meta.clone()) {
                    return LoadedPeer {
                        token: Some(t),
                        connected: Ok(()),
                    };
                }
            }
            self.retire(t);
        }
        let token = self.next_token;
        self.next_token += 1;
        let name = meta.name.clone();
        // Opened before anything of the peer is used: the pidfd is that process.
        let process = (!self.peer_failure && crate::host::same_host_elsewhere(meta.host))
            .then(|| meta.host.map(|h| crate::host::PeerProcess::open(h.pid)))
            .flatten();
        self.peers.insert(
            token,
            Peer {
                name: name.clone(),
                meta,
                ep: None,
                rkeys: Vec::new(),
                failed: None,
                transports: String::new(),
                jobs: 0,
                retired: false,
                process,
                announced: Default::default(),
                gone_slots: Vec::new(),
            },
        );
        self.names.insert(name, token);
        LoadedPeer {
            token: Some(token),
            connected: self.ensure_ep(token),
        }
    }

    /// Takes `meta`, which extends peer `token`'s metadata: unpacks the new regions' keys on
    /// its endpoint (when it has one). On an error the entry is unchanged.
    fn grow(&mut self, token: u64, meta: Metadata) -> Result<()> {
        let p = self
            .peers
            .get_mut(&token)
            .ok_or_else(|| Error::UnknownPeer {
                agent: meta.name.clone(),
            })?;
        if let Some(ep) = &p.ep {
            let mut added = Vec::new();
            for r in &meta.regions[p.meta.regions.len()..] {
                added.push(unpack(ep, &p.name, r)?);
            }
            p.rkeys.extend(added);
        }
        p.meta = meta;
        Ok(())
    }

    /// What the engine knows of a peer; connects if not connected yet. The transports are
    /// queried now: UCX's lanes are final only after wireup.
    pub(super) fn peer_info(&mut self, name: String) -> Result<PeerInfo> {
        let Some(t) = self.names.get(&name).copied() else {
            return Err(Error::UnknownPeer { agent: name });
        };
        let connected = self.ensure_ep(t);
        let Some(p) = self.peers.get_mut(&t) else {
            return Err(Error::UnknownPeer { agent: name });
        };
        if let Some(ep) = &p.ep {
            let info = ep.info();
            log::debug!("kvxfer: endpoint to {:?}:\n{info}", p.name);
            p.transports = parse_transports(&info);
        }
        Ok(PeerInfo {
            name: p.name.clone(),
            regions: p.meta.regions.len(),
            transports: p.transports.clone(),
            failed: connected.err().map(|e| e.to_string()),
            gpu_path: None,
            lanes: Vec::new(),
        })
    }

    /// Creates the endpoint and unpacks the rkeys if not done yet.
    pub(super) fn ensure_ep(&mut self, token: u64) -> Result<()> {
        let worker = self.worker.clone();
        let peer_failure = self.peer_failure;
        let p = self
            .peers
            .get_mut(&token)
            .ok_or_else(|| Error::UnknownPeer {
                agent: format!("#{token}"),
            })?;
        if p.ep.is_some() {
            return Ok(());
        }
        if self.self_only {
            return Err(Error::PeerFailed {
                agent: p.name.clone(),
                // UCS_ERR_UNREACHABLE, as UCX itself would answer.
                status: super::raw::status(-6),
            });
        }
        // The error arg is a plain token (no pointer); on_ep_error accepts any endpoint.
        let ep = worker
            .connect(
                &p.meta.worker_addr,
                on_ep_error,
                token as *mut c_void,
                peer_failure,
            )
            .map_err(|status| Error::PeerFailed {
                agent: p.name.clone(),
                status,
            })?;
        // On an error below, the keys unpacked so far are destroyed (dropped first, declared
        // after the endpoint), then the endpoint is closed by its drop.
        let mut rkeys = Vec::with_capacity(p.meta.regions.len());
        for r in &p.meta.regions {
            rkeys.push(unpack(&ep, &p.name, r)?);
        }
        let info = ep.info();
        log::debug!("kvxfer: endpoint to {:?}:\n{info}", p.name);
        p.transports = parse_transports(&info);
        log::info!("kvxfer: connected to {:?} over {}", p.name, p.transports);
        p.ep = Some(ep);
        p.rkeys = rkeys;
        p.failed = None;
        // Announced at once (the UCX fence), so that its WELCOME is likely in by the first
        // transfer, and an owner that meanwhile deregisters waits for this entry, not for
        // one this replaced. A failed send is tried again by the first transfer.
        if let Err(e) = self.announce(token) {
            log::debug!("kvxfer: announcing this agent to a peer: {e}");
        }
        Ok(())
    }

    /// Marks a peer as replaced; it is closed once its transfers complete.
    pub(super) fn retire(&mut self, token: u64) {
        if let Some(p) = self.peers.get_mut(&token) {
            p.retired = true;
            if p.jobs == 0 {
                self.close_peer(token, false);
                self.peers.remove(&token);
            }
        }
    }

    /// Closes a peer's endpoint.
    ///
    /// Graceful (`force == false`): only when none of the peer's transfers is outstanding, so
    /// the rkeys are destroyed first, as `ucp_rkey_destroy` asks (after the operations using
    /// them are flushed, before the endpoint goes).
    ///
    /// Forced (peer failure, deadline, shutdown): every transfer still posting on the peer gets
    /// its flush now, so each posted operation is covered by a callback; then
    /// `UCP_EP_CLOSE_FLAG_FORCE` completes the outstanding operations with an error. The rkeys
    /// are destroyed only once that close has completed: an operation still queued inside UCX
    /// may use its rkey until then. (UCX's rkey keeps no pointer to the endpoint, so destroying
    /// it after the endpoint is the safe side of the two rules here.)
    pub(super) fn close_peer(&mut self, token: u64, force: bool) {
        // A new endpoint announces itself again.
        self.forget_announcement(token, !force);
        let Some(p) = self.peers.get_mut(&token) else {
            return;
        };
        let Some(ep) = p.ep.take() else {
            return;
        };
        let rkeys = std::mem::take(&mut p.rkeys);
        let name = p.name.clone();
        let failed = p.failed.unwrap_or(UcsStatus::CANCELED);
        let keep = if force {
            for (&id, a) in self
                .active
                .iter_mut()
                .filter(|(_, a)| a.job.token == token && a.phase == Phase::Posting)
            {
                if a.next < a.job.plan.ops().len() {
                    // Partly posted: its flush may still succeed, but the data is incomplete.
                    a.error.get_or_insert(Error::PeerFailed {
                        agent: name.clone(),
                        status: failed,
                    });
                }
                post_flush(a, id, ep.as_ptr());
            }
            rkeys
        } else {
            // No operation is outstanding: the keys go before the endpoint.
            drop(rkeys);
            Vec::new()
        };
        match ep.close(force) {
            Ok(Some(req)) => self.closing.push((req, keep)),
            Ok(None) => {}
            Err(s) => log::debug!("ucp_ep_close_nbx({name}): {s}"),
        }
    }

    /// Frees completed endpoint-close requests and the rkeys that waited for them.
    pub(super) fn reap_closing(&mut self) {
        self.closing.retain(|(req, _)| !req.done());
    }
}

/// The transports of the endpoint's lanes, in lane order, from `ucp_ep_print_info` output
/// (lines like `lane[1]:  4:cma/memory.0 md[4] -> ... rma_bw#0`); `(rma)` marks a transport
/// that carries an RMA lane.
pub(super) fn parse_transports(info: &str) -> String {
    let mut out: Vec<(&str, bool)> = Vec::new();
    for line in info.lines() {
        let mut words = line.trim_start_matches(['#', ' ']).split_whitespace();
        if !words.next().is_some_and(|w| w.starts_with("lane[")) {
            continue;
        }
        // "4:cma/memory.0": resource index, transport, device.
        let Some(tl) = words
            .next()
            .and_then(|r| r.split_once(':'))
            .and_then(|(_, r)| r.split('/').next())
        else {
            continue;
        };
        let rma = line.contains("rma");
        match out.iter_mut().find(|(t, _)| *t == tl) {
            Some(e) => e.1 |= rma,
            None => out.push((tl, rma)),
        }
    }
    let names: Vec<String> = out
        .iter()
        .map(|&(t, rma)| {
            if rma {
                format!("{t}(rma)")
            } else {
                t.to_string()
            }
        })
        .collect();
    names.join(",")
}

/// Region `r`'s key of peer `name`, unpacked on `ep`; `None` for staged device memory and
/// regions shared with named peers only (UCX cannot reach them, kvxfer's TCP lane carries
/// them).
fn unpack(ep: &Endpoint, name: &str, r: &RegionMeta) -> Result<Option<Rkey>> {
    if r.rkey.is_empty() {
        return Ok(None);
    }
    ep.unpack(&r.rkey)
        .map(Some)
        .map_err(|status| Error::Metadata {
            source_desc: format!("agent {name:?}"),
            err: kvxfer_proto::error::MetadataError::Invalid {
                field: "rkey",
                why: format!("region {}: ucp_ep_rkey_unpack: {status}", r.id.0),
            },
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transports_from_ep_info() {
        let info = "#\n# UCP endpoint\n#\n#               peer: <no debug data>\n#                 lane[0]:  1:posix/memory.0 md[1]           -> md[1]/posix/sysdev[255] am am_bw#0\n#                 lane[1]:  4:cma/memory.0 md[4]             -> md[4]/cma/sysdev[255] rma_bw#0\n";
        assert_eq!(parse_transports(info), "posix,cma(rma)");
        let tcp = "lane[0]:  0:tcp/lo.0 md[0] -> md[0]/tcp am keepalive wireup\n\
                   lane[1]:  1:tcp/lo.0 md[0] -> md[0]/tcp rma_bw#0\n";
        assert_eq!(parse_transports(tcp), "tcp(rma)");
        assert_eq!(parse_transports("garbage\nlane[0]:\n"), "");
    }
}
