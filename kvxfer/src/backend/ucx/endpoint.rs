//! Peers: loading metadata, creating endpoints and unpacking rkeys lazily, retiring replaced
//! peers once their transfers finish, and closing endpoints (forcibly on failure).

use std::ffi::c_void;
use std::sync::{Arc, Weak};

use super::driver::{on_ep_error, Engine, Peer};
use super::raw::{self, Posted};
use crate::agent::{PeerView, Shared};
use crate::descriptor::RegionSpan;
use crate::error::{Error, Result, UcsStatus};
use crate::metadata::{Metadata, RegionMeta};

impl Engine {
    pub(super) fn load_peer(&mut self, meta: Metadata, shared: &Weak<Shared>) -> Result<()> {
        if let Some(&t) = self.names.get(&meta.name) {
            let p = &self.peers[&t];
            if p.meta == meta && p.failed.is_none() {
                return Ok(()); // The same peer handshaking again.
            }
            self.retire(t);
        }
        let token = self.next_token;
        self.next_token += 1;
        let spans: Vec<RegionSpan> = meta.regions.iter().map(RegionMeta::span).collect();
        let name = meta.name.clone();
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
            },
        );
        self.names.insert(name.clone(), token);
        if let Some(s) = shared.upgrade() {
            s.peers
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .insert(name, Arc::new(PeerView { token, spans }));
        }
        // Connect now so that errors in the address show up at load time.
        self.ensure_ep(token)
    }

    /// Creates the endpoint and unpacks the rkeys if not done yet.
    pub(super) fn ensure_ep(&mut self, token: u64) -> Result<()> {
        let worker = self.worker;
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
        // SAFETY: worker live on this thread; the error arg is a plain token (no pointer);
        // on_ep_error accepts any endpoint.
        let ep = unsafe {
            raw::ep_new(
                worker,
                &p.meta.worker_addr,
                on_ep_error,
                token as *mut c_void,
                peer_failure,
            )
        }
        .map_err(|status| Error::PeerFailed {
            agent: p.name.clone(),
            status,
        })?;
        let mut rkeys = Vec::with_capacity(p.meta.regions.len());
        for r in &p.meta.regions {
            // SAFETY: ep is live on this thread.
            match unsafe { raw::rkey_unpack(ep, &r.rkey) } {
                Ok(k) => rkeys.push(k),
                Err(status) => {
                    for k in rkeys {
                        // SAFETY: k was unpacked above, unused, destroyed once before the ep.
                        unsafe { raw::rkey_destroy(k) };
                    }
                    // SAFETY: ep is live, has no operations, closed once.
                    if let Ok(Posted::Pending(req)) = unsafe { raw::ep_close(ep, true) } {
                        self.closing.push(req);
                    }
                    return Err(Error::Metadata {
                        source_desc: format!("agent {:?}", p.name),
                        err: crate::error::MetadataError::Invalid {
                            field: "rkey",
                            why: format!("region {}: ucp_ep_rkey_unpack: {status}", r.id.0),
                        },
                    });
                }
            }
        }
        // SAFETY: ep is live on this thread.
        let info = unsafe { raw::ep_info(ep) };
        log::debug!("kvxfer: endpoint to {:?}:\n{info}", p.name);
        p.transports = parse_transports(&info);
        log::info!("kvxfer: connected to {:?} over {}", p.name, p.transports);
        p.ep = Some(ep);
        p.rkeys = rkeys;
        p.failed = None;
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

    /// Destroys the rkeys and closes the endpoint of a peer (forcibly: cancels outstanding
    /// operations, whose callbacks then report an error).
    pub(super) fn close_peer(&mut self, token: u64, force: bool) {
        let Some(p) = self.peers.get_mut(&token) else {
            return;
        };
        for k in p.rkeys.drain(..) {
            // SAFETY: k is live, destroyed once, before its endpoint closes. Operations that
            // used it were posted earlier; UCX does not need the rkey after posting.
            unsafe { raw::rkey_destroy(k) };
        }
        if let Some(ep) = p.ep.take() {
            // SAFETY: ep is live, its rkeys are destroyed, closed once.
            match unsafe { raw::ep_close(ep, force) } {
                Ok(Posted::Pending(req)) => self.closing.push(req),
                Ok(Posted::Done) => {}
                Err(s) => log::debug!("ucp_ep_close_nbx({}): {s}", p.name),
            }
        }
    }

    pub(super) fn reap_closing(&mut self) {
        self.closing.retain(|&req| {
            // SAFETY: req is a live close request (freed only below).
            let s = unsafe { raw::request_status(req) };
            if s == UcsStatus::INPROGRESS {
                true
            } else {
                // SAFETY: req completed; freed once, never used again.
                unsafe { raw::request_free(req) };
                false
            }
        });
    }
}

/// Extracts the transport/device names of the endpoint's lanes from `ucp_ep_print_info`
/// output (lines like `lane[0]:  1:tcp/lo.0 md[1] ... rma_bw#0`).
pub(super) fn parse_transports(info: &str) -> String {
    let mut out: Vec<String> = Vec::new();
    for line in info.lines() {
        let l = line.trim_start_matches(['#', ' ']);
        if !l.starts_with("lane[") {
            continue;
        }
        for tok in l.split_whitespace() {
            if let Some((_, t)) = tok.split_once(':') {
                if t.contains('/') {
                    let tl = t.split('/').next().unwrap_or(t);
                    let s = if line.contains("rma") {
                        format!("{tl}(rma)")
                    } else {
                        tl.to_string()
                    };
                    if !out.contains(&s) && !out.contains(&format!("{tl}(rma)")) {
                        out.retain(|x| x != tl);
                        out.push(s);
                    }
                }
            }
        }
    }
    out.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transports_from_ep_info() {
        let info = "#\n# UCP endpoint\n#\n#               peer: <no debug data>\n#                 lane[0]:  1:posix/memory.0 md[1]           -> md[1]/posix/sysdev[255] am am_bw#0\n#                 lane[1]:  4:cma/memory.0 md[4]             -> md[4]/cma/sysdev[255] rma_bw#0\n";
        assert_eq!(parse_transports(info), "posix,cma(rma)");
    }
}
