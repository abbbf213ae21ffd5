//! The watching side of etcd discovery: a namespace's agents and their region updates listed
//! (in pages, at one revision), then followed on one watch stream; what appears or changes is
//! loaded into the agent, what goes is retired, and a broken or compacted watch lists again.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use etcd_client::{Client, EventType, KeyValue, WatchOptions};

use super::assembly::{Assembly, Key, Layout};
use super::listing::{list, MAX_VALUE};
use super::own_keys::decode_base;
use super::seal::open;
use crate::agent::Agent;
use kvxfer_proto::error::Error;
use kvxfer_proto::wire::metadata::{Metadata, RegionMeta};

/// What a watcher holds and refused: `EtcdDiscovery::watch_counts`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct WatchCounts {
    /// Agents assembled from the namespace.
    pub agents: usize,
    /// Region updates waiting for their agent's base (at most 4,096).
    pub pending_updates: usize,
    /// Incarnations (name and epoch) those updates are of.
    pub pending_agents: usize,
    /// Region updates not kept because that many were waiting.
    pub updates_dropped: u64,
    /// New agents not loaded past `EtcdConfig::max_agents`.
    pub agents_refused: u64,
}

/// A region update's agent, epoch and region; `None` (logged) when it does not open or decode.
pub(super) fn decode_region(
    agent: &Agent,
    layout: &Layout,
    kv: &KeyValue,
) -> Option<(String, u64, RegionMeta)> {
    let key = String::from_utf8_lossy(kv.key());
    let Some(Key::Region { name, epoch, .. }) = layout.parse(&key) else {
        return None;
    };
    let r = open(agent.secret(), &key, kv.lease(), kv.value()).and_then(|b| {
        RegionMeta::decode(&b).map_err(|err| Error::Metadata {
            source_desc: format!("etcd key {key}"),
            err,
        })
    });
    match r {
        Ok(r) => Some((name, epoch, r)),
        Err(e) => {
            log::warn!("kvxfer: region update {key} not used: {e}");
            None
        }
    }
}

/// Lists the namespace into `asm`; returns the revision seen, and per agent (but `agent`
/// itself) the metadata to load. Agents known to `asm` whose keys went are retired.
pub(super) async fn load_all(
    layout: &Layout,
    mut c: Client,
    agent: &Arc<Agent>,
    asm: &mut Assembly,
) -> Result<(i64, HashMap<String, Metadata>, Vec<String>), (&'static str, etcd_client::Error)> {
    // Agents, then their updates at the same revision; never the notes (not metadata, and
    // as large as anyone makes them).
    let (agents, rev) = list(&mut c, &layout.agents(), 0)
        .await
        .map_err(|e| ("listing agents", e))?;
    let (regions, _) = list(&mut c, &layout.regions(), rev)
        .await
        .map_err(|e| ("listing region updates", e))?;
    let mut load = HashMap::new();
    let mut names = HashSet::new();
    // What is waiting for its base is rebuilt from the listing.
    asm.forget_early();
    for kv in agents.iter().chain(&regions) {
        if let Some((name, change)) = apply(agent, layout, asm, kv, EventType::Put) {
            names.insert(name.clone());
            if let Change::Load(m) = change {
                load.insert(name, *m);
            }
        }
    }
    let gone = asm.relisted(&names);
    Ok((rev, load, gone))
}

/// What one key's put or delete means for an agent.
enum Change {
    /// Its assembled metadata changed: load this (boxed: it dwarfs the other variants).
    Load(Box<Metadata>),
    /// Its base key went (its lease ended): retire it.
    Gone,
    /// Nothing to do now.
    Nothing,
}

/// Applies one key's put or delete to `asm`: the agent it concerns, and what changed for it.
/// Keys of `agent` itself and keys that do not open or decode (logged) are skipped.
fn apply(
    agent: &Agent,
    layout: &Layout,
    asm: &mut Assembly,
    kv: &KeyValue,
    ev: EventType,
) -> Option<(String, Change)> {
    let key = String::from_utf8_lossy(kv.key()).into_owned();
    let k = layout.parse(&key)?;
    let name = match &k {
        Key::Agent(n) | Key::Region { name: n, .. } => n.clone(),
    };
    if name == agent.name() {
        return None;
    }
    if kv.value().len() > MAX_VALUE {
        log::warn!(
            "kvxfer: etcd key {key} not used: its value is {} bytes, more than {MAX_VALUE}",
            kv.value().len()
        );
        return None;
    }
    let m = match (k, ev) {
        (Key::Agent(_), EventType::Delete) => {
            asm.agent_gone(&name);
            return Some((name, Change::Gone));
        }
        (Key::Agent(_), EventType::Put) => match decode_base(agent, kv) {
            Ok(m) if m.name == name => {
                let loaded = asm.base(m);
                if loaded.is_none() {
                    log::warn!(
                        "kvxfer: agent {name:?} from etcd not loaded: this watcher holds its \
                         cap of agents already ({} refused)",
                        asm.refused_agents
                    );
                }
                loaded
            }
            Ok(m) => {
                log::warn!(
                    "kvxfer: etcd key {key} holds agent {:?}: not loaded",
                    m.name
                );
                None
            }
            Err(e) => {
                log::warn!("kvxfer: agent {name:?} from etcd not loaded: {e}");
                None
            }
        },
        (Key::Region { .. }, EventType::Put) => {
            decode_region(agent, layout, kv).and_then(|(n, e, r)| asm.region(&n, e, r))
        }
        (Key::Region { epoch, id, .. }, EventType::Delete) => asm.region_gone(&name, epoch, id),
    };
    Some((
        name,
        m.map_or(Change::Nothing, |m| Change::Load(Box::new(m))),
    ))
}

/// The watch task's counts into `counts`.
pub(super) fn count(counts: &Mutex<WatchCounts>, asm: &Assembly) {
    *counts.lock().unwrap_or_else(|e| e.into_inner()) = WatchCounts {
        agents: asm.agents(),
        pending_updates: asm.early_len(),
        pending_agents: asm.early_agents(),
        updates_dropped: asm.dropped_early,
        agents_refused: asm.refused_agents,
    };
}

/// Loads `m` into `agent` (logged when refused).
pub(super) fn load(agent: &Agent, m: &Metadata) {
    if let Err(e) = agent.load_remote_metadata(&m.encode()) {
        log::warn!("kvxfer: agent {:?} from etcd not loaded: {e}", m.name);
    }
}

/// Retires the agents `gone` in `agent`: their transfers fail with `PeerFailed`.
fn retire(agent: &Agent, gone: &[String]) {
    for name in gone {
        if agent.retire_peer(name).is_ok() {
            log::info!("kvxfer: agent {name:?} left etcd (lease ended): retired");
        }
    }
}

/// Follows the namespace from revision `rev`: loads what appears or changes, retires what
/// goes; starts over (listing again, retiring what went meanwhile) when the watch breaks.
pub(super) async fn watch_loop(
    layout: Layout,
    c: Client,
    agent: Weak<Agent>,
    mut rev: i64,
    mut asm: Assembly,
    counts: Arc<Mutex<WatchCounts>>,
) {
    loop {
        let Some(a) = agent.upgrade() else { return };
        let opts = WatchOptions::new()
            .with_prefix()
            .with_start_revision(rev + 1);
        // Agents and their updates on one stream; never the notes.
        let stream = match c.clone().watch(layout.agents(), Some(opts.clone())).await {
            Ok((mut w, s)) => w.watch(layout.regions(), Some(opts)).await.map(|()| (w, s)),
            Err(e) => Err(e),
        };
        drop(a);
        if let Ok((_watcher, mut stream)) = stream {
            while let Ok(Some(resp)) = stream.message().await {
                if resp.canceled() {
                    // Compacted past our revision (or refused): list again.
                    break;
                }
                let Some(a) = agent.upgrade() else { return };
                let mut load_now: Vec<Metadata> = Vec::new();
                let mut gone: Vec<String> = Vec::new();
                for ev in resp.events() {
                    let Some(kv) = ev.kv() else { continue };
                    rev = rev.max(kv.mod_revision());
                    match apply(&a, &layout, &mut asm, kv, ev.event_type()) {
                        Some((name, Change::Gone)) => gone.push(name),
                        Some((_, Change::Load(m))) => load_now.push(*m),
                        _ => {}
                    }
                }
                count(&counts, &asm);
                // Loading talks to the engine and may probe a peer: off the runtime.
                let _ = tokio::task::spawn_blocking(move || {
                    for m in &load_now {
                        load(&a, m);
                    }
                    retire(&a, &gone);
                })
                .await;
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        // The watch broke (etcd gone or compacted): list again once etcd answers.
        let Some(a) = agent.upgrade() else { return };
        if let Ok((r, load_now, gone)) = load_all(&layout, c.clone(), &a, &mut asm).await {
            rev = r;
            count(&counts, &asm);
            let _ = tokio::task::spawn_blocking(move || {
                for m in load_now.values() {
                    load(&a, m);
                }
                retire(&a, &gone);
            })
            .await;
        }
    }
}
