//! Which lane moves a transfer: the one place a lane is chosen. It asks the peer's lanes in
//! the agent's order ([`crate::lane::start`]) and takes the first that carries the transfer;
//! UCX carries the rest.
#![forbid(unsafe_code)]

use std::sync::Arc;

use super::peers::peer_info;
use super::prepared::PreparedLocal;
use super::state::{AgentState, PeerView};
use crate::lane::api::{PeerLane, Query};
use crate::transfer::Work;
use kvxfer_proto::error::{Error, Result};
use kvxfer_proto::types::{Lane, MemKind, Transport};

/// The lane a transfer takes.
pub(crate) enum Route {
    /// UCX one-sided operations.
    Ucx,
    /// One of kvxfer's own lanes.
    Lane(Arc<dyn PeerLane>),
}

/// The route of `plan` towards `peer` (whose view is `view`, None when unknown or stale), and
/// per plan operation the device of its local memory (empty when it has none).
///
/// Device memory: UCX where it reaches every device region of the plan (direct path), else a
/// lane that stages it (the TCP lane, each end staging its own device memory). Host memory:
/// the first of the peer's lanes that carries the plan (the shm lane where it covers it, the
/// TCP lane with the TCP transport, or where `host_write_by_lane`), else UCX. One pass over
/// the plan, only where either side has device memory.
pub(crate) fn route(
    local: &PreparedLocal,
    plan: &Work,
    view: Option<&PeerView>,
    peer: &str,
    host_write_by_lane: bool,
) -> Result<(Route, Vec<Option<u32>>)> {
    let mut local_dev: Vec<Option<u32>> = Vec::new();
    let mut device = false;
    let mut unreachable = false;
    let local_has = local.regions.iter().any(|r| r.kind != MemKind::Host);
    let remote_dev = view.filter(|v| v.spans.iter().any(|s| s.kind != MemKind::Host));
    // Host memory UCX has no key for (shared with named peers only): the TCP lane's.
    let host_unmapped = (local
        .regions
        .iter()
        .any(|r| r.kind == MemKind::Host && !r.ucx_mapped)
        || view.is_some_and(|v| v.host_unmapped))
        && host_unmapped_in(local, plan, view);
    if local_has || remote_dev.is_some() {
        for o in plan.iter_ops() {
            let r = &local.regions[o.lslot as usize];
            let d = match r.kind {
                MemKind::Host => None,
                MemKind::Cuda(d) => {
                    device = true;
                    unreachable |= !r.ucx_mapped;
                    Some(d)
                }
            };
            if local_has {
                local_dev.push(d);
            }
            if let Some(v) = remote_dev {
                let k = o.rslot as usize;
                if v.spans[k].kind != MemKind::Host {
                    device = true;
                    unreachable |= v.unmapped[k];
                }
            }
        }
    }
    let Some(v) = view else {
        return Ok((Route::Ucx, local_dev));
    };
    let q = Query {
        plan,
        device,
        local_devices: &local_dev,
        ucx_reaches: device && !unreachable,
        host_unmapped,
        host_write_by_lane,
    };
    let route = match v.lanes.0.iter().find(|l| l.carries(&q)) {
        Some(l) => Route::Lane(l.clone()),
        // Loaded lane-only (UCX cannot reach it): its TCP lane carries everything.
        None if !v.ucx => match v.lanes.0.iter().find(|l| l.lane() == Lane::Tcp) {
            Some(l) => Route::Lane(l.clone()),
            None => {
                return Err(Error::InvalidArgument(format!(
                    "{peer:?} was loaded lane-only and has no TCP lane (a bug)"
                )))
            }
        },
        None if host_unmapped => {
            return Err(Error::InvalidArgument(format!(
                "the transfer touches a region shared with named peers only, which moves \
                 only over kvxfer's TCP lane, and {peer:?} has none (lanes off on either side)"
            )))
        }
        None if device && unreachable => {
            return Err(Error::InvalidArgument(format!(
                "the transfer touches staged device memory, which moves over kvxfer's TCP \
                 lane, and {peer:?} has none (lanes off on either side)"
            )))
        }
        None => Route::Ucx,
    };
    Ok((route, local_dev))
}

/// Whether an operation of `plan` touches a host region without a UCX key: a local one, or
/// one of the peer's (`view`). Only asked where such a region exists at all.
fn host_unmapped_in(local: &PreparedLocal, plan: &Work, view: Option<&PeerView>) -> bool {
    plan.iter_ops().any(|o| {
        let l = &local.regions[o.lslot as usize];
        (l.kind == MemKind::Host && !l.ucx_mapped)
            || view.is_some_and(|v| {
                let k = o.rslot as usize;
                v.spans[k].kind == MemKind::Host && v.unmapped[k]
            })
    })
}

/// Strict mode, for a transfer UCX carries: the transports UCX selected for `peer` must be
/// the kind asked for.
pub(crate) fn check_strict(st: &AgentState, peer: &str) -> Result<()> {
    {
        let t = &st.transport;
        let shm = ["posix", "sysv", "cma", "xpmem", "knem"];
        let wanted: Vec<String> = match t {
            Transport::Shm => shm.iter().map(|s| s.to_string()).collect(),
            Transport::Custom(list) => {
                let named: Vec<String> = list
                    .split(',')
                    .map(|x| x.trim().to_string())
                    .filter(|x| !x.is_empty() && x != "tcp" && x != "self")
                    .flat_map(|x| {
                        if x == "sm" || x == "shm" {
                            shm.iter().map(|s| s.to_string()).collect::<Vec<_>>()
                        } else {
                            vec![x]
                        }
                    })
                    .collect();
                if named.is_empty() {
                    return Ok(()); // only TCP asked for
                }
                named
            }
            Transport::Tcp | Transport::Auto => return Ok(()),
        };
        let info = peer_info(st, peer)?;
        let got: Vec<&str> = info
            .transports
            .split(',')
            .map(|x| x.trim().trim_end_matches("(rma)"))
            .collect();
        if got
            .iter()
            .any(|g| wanted.iter().any(|w| g.starts_with(w.as_str())))
        {
            return Ok(());
        }
        Err(Error::TransportMismatch {
            agent: peer.to_string(),
            wanted: wanted.join("|"),
            got: if info.transports.is_empty() {
                "nothing (not connected)".into()
            } else {
                info.transports
            },
        })
    }
}
