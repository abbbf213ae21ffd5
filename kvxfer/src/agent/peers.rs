//! The agent's table of peers: loading a peer's metadata (the lanes built for it, the engine's
//! entry, the caller-side view for bounds checks), and what the agent reports about a peer.
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::state::{AgentState, PeerView};
use crate::backend::ucx::driver::{Cmd, LoadedPeer};
use crate::lane::api::PeerLanes;
use crate::lane::tcp::liveness::answers_as;
use kvxfer_proto::error::{Error, Result};
use kvxfer_proto::peer_table::{admit, Admission, PeerUse};
use kvxfer_proto::types::{GpuPath, HostInfo, Lane, MemKind, PeerInfo, RegionSpan};
use kvxfer_proto::wire::metadata::Metadata;

/// Loads a decoded peer's metadata: builds its lanes (or keeps those built for the same
/// metadata, so that a peer's memory is never mapped twice), has the engine load it, and
/// records the caller-side view. Returns the peer's name.
pub(crate) fn load_decoded(st: &AgentState, meta: Metadata) -> Result<String> {
    if meta.name == st.name {
        return Err(Error::InvalidArgument(format!(
            "peer metadata carries this agent's own name {:?}",
            meta.name
        )));
    }
    let name = meta.name.clone();
    let _serial = st.load_lock.lock().unwrap_or_else(|e| e.into_inner());
    another_incarnation(st, &meta)?;
    make_room(st, &name)?;
    let sum = meta_sum(&meta);
    // The same metadata again (a second handshake): keep the lanes already built.
    let existing = st
        .peers
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .get(&name)
        .filter(|v| v.meta_sum == sum)
        .map(|v| v.lanes.clone());
    let lanes = match existing {
        Some(l) => l,
        None => build_lanes(st, &meta),
    };
    let spans: Vec<RegionSpan> = meta.regions.iter().map(|r| r.span()).collect();
    let unmapped: Vec<bool> = meta.regions.iter().map(|r| r.rkey.is_empty()).collect();
    let (epoch, lane, host) = (meta.epoch, meta.tcp_lane(), meta.host);
    let lane_addr = lane.map(|l| l.addr);
    let worker_addr = meta.worker_addr.clone();
    let LoadedPeer { token, connected } = st.cmds.call(|reply| Cmd::LoadPeer { meta, reply })?;
    // UCX's TCP transport left out: a peer no other UCX transport reaches is loaded lane-only
    // when it has a TCP lane (its device memory then moves staged over it too).
    let unreachable =
        matches!(&connected, Err(Error::PeerFailed { status, .. }) if status.code() == -6);
    let lane_only = st.ucx_tcp_off && unreachable && lanes.0.iter().any(|l| l.lane() == Lane::Tcp);
    let connected = if lane_only {
        log::info!("kvxfer: {name:?} loaded lane-only (UCX's TCP transport is off)");
        Ok(())
    } else {
        connected
    };
    let unmapped = if lane_only {
        vec![true; unmapped.len()]
    } else {
        unmapped
    };
    if let Some(v) = st
        .peers
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .get(&name)
    {
        // The same metadata again (an update that changed nothing): still a sign of life.
        v.touch(st.now());
    }
    if let Some(token) = token {
        st.gone
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&name);
        let mut peers = st.peers.write().unwrap_or_else(|e| e.into_inner());
        // The same incarnation keeps what its deregistrations fence: the regions it gave up,
        // and the UCX transfers posted against its earlier views (a reload that did not only
        // grow it makes a new view while they may still be in flight).
        let fence = peers
            .get(&name)
            .filter(|v| v.token == token || (epoch != 0 && v.epoch == epoch))
            .map(|v| v.fence.clone())
            .unwrap_or_default();
        peers.insert(
            name.clone(),
            Arc::new(PeerView {
                token,
                host_unmapped: !lane_only
                    && spans
                        .iter()
                        .zip(&unmapped)
                        .any(|(s, &u)| s.kind == MemKind::Host && u),
                spans,
                lanes,
                unmapped,
                meta_sum: sum,
                epoch,
                lane_addr,
                lane,
                host,
                worker_addr,
                ucx: !lane_only,
                used_ms: AtomicU64::new(u64::try_from(st.now().as_millis()).unwrap_or(u64::MAX)),
                fence,
            }),
        );
    }
    connected.map(|()| name.clone()).map_err(|e| match e {
        // UCS_ERR_UNREACHABLE: none of our transports reaches the peer's worker address.
        Error::PeerFailed { status, .. } if status.code() == -6 => Error::NoCommonTransport {
            agent: name,
            ours: st.transport.ucx_tls(),
        },
        e => e,
    })
}

/// Room in the peer table for `name`, not loaded yet ([`kvxfer_proto::peer_table`]): the
/// least recently used peer idle long enough is evicted (its endpoint, kept connection,
/// lanes and mappings go), or, with none, `name` is refused with [`Error::PeerLimit`].
/// Called under the load lock, so that two loads cannot both take the last place.
fn make_room(st: &AgentState, name: &str) -> Result<()> {
    let known = |n: &str| {
        st.peers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(n)
    };
    if known(name) {
        return Ok(());
    }
    // Outside the table's lock: a walk of /proc/self/fd, once per new peer (the load lock
    // keeps any other load from adding one meanwhile).
    let fds = crate::fd_limit::fds();
    let decision = {
        let g = st.peers.read().unwrap_or_else(|e| e.into_inner());
        let loaded: Vec<PeerUse<'_>> = g
            .iter()
            .map(|(n, v)| PeerUse {
                name: n,
                last_used: v.last_used(),
            })
            .collect();
        match admit(&st.peer_limits, fds, &loaded, st.now()) {
            Admission::Admit => return Ok(()),
            Admission::Evict(v) => Ok(v.to_string()),
            Admission::Refuse(why) => Err(why),
        }
    };
    match decision {
        Ok(victim) => {
            log::info!(
                "kvxfer {}: peer table full: evicting {victim:?}, the least recently used, for {name:?}",
                st.name
            );
            st.peers_evicted.fetch_add(1, Ordering::Relaxed);
            match remove_peer(st, &victim) {
                Err(Error::UnknownPeer { .. }) => Ok(()),
                r => r,
            }
        }
        Err(why) => {
            st.peers_refused.fetch_add(1, Ordering::Relaxed);
            log::warn!(
                "kvxfer {}: {name:?} refused: peer table full: {why}",
                st.name
            );
            Err(Error::PeerLimit {
                agent: st.name.clone(),
                why,
            })
        }
    }
}

/// How long a lane listener of the incarnation already loaded gets to answer when another
/// agent offers its name.
const PROBE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

/// `meta` names a loaded peer with another epoch: a restart (the incarnation before is gone:
/// its state, lanes, mapped memory and keys, is dropped here, and transfers prepared for it
/// fail as stale) or a second live agent with the name (refused, typed). The one before is
/// alive when its TCP lane still accepts connections at an address the newcomer does not
/// also claim; with no lane to ask (lanes off), when it ran on this host in another process
/// than the newcomer's and that process still exists. Without a lane, two agents of one name
/// on two other hosts, or one after the other in one process, are taken as a restart.
fn another_incarnation(st: &AgentState, meta: &Metadata) -> Result<()> {
    let Some(old) = st
        .peers
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .get(&meta.name)
        .cloned()
    else {
        return Ok(());
    };
    let conflict = |why: String| Error::NameConflict {
        name: meta.name.clone(),
        why,
    };
    // Names and epochs are claims: every HELLO answer shows an agent's epoch, so the same
    // epoch is taken as the same incarnation only from where that incarnation is.
    if old.epoch != 0 && meta.epoch == old.epoch {
        let same_lane = old.lane_addr == meta.tcp_lane().map(|l| l.addr);
        let same_process = old.host.map(|h| (h.boot_id, h.pid_ns, h.pid))
            == meta.host.map(|h| (h.boot_id, h.pid_ns, h.pid));
        // Lane address and process are easy to copy from the real metadata; the worker address
        // is where UCX traffic would go, so an impostor must change it to receive anything.
        if same_lane && same_process && old.worker_addr == meta.worker_addr {
            return Ok(());
        }
        return Err(conflict(format!(
            "epoch {:#018x} is loaded here from {}; metadata with the same epoch came from {} \
             (the same epoch from another worker, lane address or process is not a restart)",
            old.epoch,
            old.lane_addr
                .map_or("no lane".to_string(), |a| a.to_string()),
            meta.tcp_lane()
                .map_or("no lane".to_string(), |l| l.addr.to_string()),
        )));
    }
    if old.epoch != 0 && meta.epoch == 0 {
        return Err(conflict(format!(
            "epoch {:#018x} is loaded here; metadata without an epoch cannot replace it",
            old.epoch
        )));
    }
    if old.epoch == 0 {
        // An agent that named no epoch (written by hand): replaced as before.
        return Ok(());
    }
    let new_lane = meta.tcp_lane().map(|l| l.addr);
    let alive = match old.lane_addr {
        Some(a) if Some(a) != new_lane => {
            // With a secret, proven: a port that only accepts connections is not the old
            // incarnation.
            old.lane
                .is_some_and(|l| answers_as(&l, st.secret.as_deref(), &st.name, PROBE_TIMEOUT))
        }
        // The newcomer listens where the old one did: the old one's socket is gone.
        Some(_) => false,
        None => process_alive_elsewhere(st, old.host, meta.host),
    };
    if alive {
        return Err(conflict(format!(
            "epoch {:#018x} is loaded here and still answers at {}; epoch {:#018x} offers \
                 the same name (give each agent its own name, e.g. one per rank)",
            old.epoch,
            old.lane_addr
                .map_or("its lane".to_string(), |a| a.to_string()),
            meta.epoch
        )));
    }
    log::info!(
        "kvxfer: peer {:?} restarted (epoch {:#018x} -> {:#018x}): dropping the old one's lanes, \
         mappings and keys",
        meta.name,
        old.epoch,
        meta.epoch
    );
    remove_peer(st, &meta.name)
}

/// Whether the process of an incarnation without a lane, `old`, is a live process of this host
/// (same boot, same PID namespace) other than the newcomer's.
fn process_alive_elsewhere(st: &AgentState, old: Option<HostInfo>, new: Option<HostInfo>) -> bool {
    let (Some(old), Some(me)) = (old, st.host) else {
        return false;
    };
    let same_host = old.boot_id == me.boot_id && old.pid_ns == me.pid_ns;
    let same_process =
        new.is_some_and(|n| n.boot_id == old.boot_id && n.pid_ns == old.pid_ns && n.pid == old.pid);
    same_host && !same_process && std::path::Path::new(&format!("/proc/{}", old.pid)).exists()
}

/// The lanes towards a newly loaded peer: each of the agent's lanes that reaches it, in the
/// agent's order.
fn build_lanes(st: &AgentState, meta: &Metadata) -> PeerLanes {
    let mut names: Vec<&str> = Vec::new();
    let lanes = st
        .lanes
        .iter()
        .filter_map(|l| l.open(meta).inspect(|_| names.push(l.name())))
        .collect();
    log::debug!(
        "kvxfer {}: lanes towards {:?}: {names:?}",
        st.name,
        meta.name
    );
    PeerLanes(lanes)
}

/// What the agent knows about a peer (connects if not connected yet).
pub(crate) fn peer_info(st: &AgentState, name: &str) -> Result<PeerInfo> {
    let mut info = st.cmds.call(|reply| Cmd::PeerInfo {
        name: name.to_string(),
        reply,
    })?;
    info.gpu_path = gpu_path(st, name);
    if let Some(v) = st.peers.read().unwrap_or_else(|e| e.into_inner()).get(name) {
        info.lanes = v.lanes.0.iter().map(|l| l.lane()).collect();
    }
    Ok(info)
}

/// Forgets a peer: the engine retires its entry, then the caller-side view goes.
pub(crate) fn remove_peer(st: &AgentState, name: &str) -> Result<()> {
    st.cmds.call(|reply| Cmd::RemovePeer {
        name: name.to_string(),
        reply,
    })?;
    st.peers
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .remove(name);
    st.subs.drop_peer(name);
    Ok(())
}

/// Forgets a peer that is gone: transfers to it fail with `PeerFailed` from now on, until a
/// new incarnation is loaded. A peer not loaded is marked gone all the same.
pub(crate) fn retire_peer(st: &AgentState, name: &str) -> Result<()> {
    st.gone
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(name.to_string());
    match remove_peer(st, name) {
        Err(Error::UnknownPeer { .. }) => Ok(()),
        r => r,
    }
}

/// How device memory moves between this agent and the peer `name`: `None` where neither
/// side has device memory registered, `Staged` where any of it is out of UCX's reach.
fn gpu_path(st: &AgentState, name: &str) -> Option<GpuPath> {
    let mut device = false;
    let mut staged = false;
    for r in st.regions.read().values() {
        if r.kind != MemKind::Host {
            device = true;
            staged |= !r.ucx_mapped;
        }
    }
    if let Some(v) = st.peers.read().unwrap_or_else(|e| e.into_inner()).get(name) {
        for (s, &u) in v.spans.iter().zip(&v.unmapped) {
            if s.kind != MemKind::Host {
                device = true;
                staged |= u;
            }
        }
    }
    device.then_some(if staged {
        GpuPath::Staged
    } else {
        GpuPath::Direct
    })
}

fn meta_sum(m: &Metadata) -> u64 {
    m.encode().iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Peer `name` tells this agent it deregisters its region `id`: transfers touching it are
/// refused from now on, and this waits (up to `wait`) for this agent's UCX transfers to the
/// peer that were in flight to end. Returns whether they did: nothing of this agent's touches
/// the region any more, and the peer may let its memory go.
pub(crate) fn region_gone_at(st: &AgentState, name: &str, id: u32, wait: Duration) -> bool {
    let view = st
        .peers
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .get(name)
        .cloned();
    let Some(view) = view else { return true };
    let in_flight = {
        let mut f = view.fence.lock().unwrap_or_else(|e| e.into_inner());
        f.gone.insert(id);
        f.any_gone = true;
        f.ucx.retain(|s| !s.is_done());
        f.pruned = f.ucx.len();
        f.ucx.clone()
    };
    let deadline = Instant::now() + wait;
    while in_flight.iter().any(|s| !s.is_done()) {
        if Instant::now() >= deadline {
            log::warn!(
                "kvxfer: {name:?} deregisters region {id}: this agent's UCX transfers to it did \
                 not end within {wait:?}; not answered"
            );
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    true
}
