//! What a watcher makes of a namespace's keys, with no I/O: the keys' layout, and the peers'
//! metadata assembled from a base value and the updates published after it.
//!
//! Keys under a namespace `ns`:
//!
//! ```text
//! <ns>/agents/<name>                        the agent's metadata when it (re)published
//! <ns>/regions/<name>/<epoch:016x>/<id>     one region registered after that (RegionMeta)
//! <ns>/notes/<name>/<what>                  a note of the agent's (not metadata; not parsed)
//! ```
//!
//! A registration after publishing is one small put, not the whole blob again; every key of
//! an agent hangs on its lease. Updates of an epoch other than the base's are an old
//! incarnation's leftovers (or a new one's, ahead of its base) and are never applied to it.
#![forbid(unsafe_code)]

use std::collections::{BTreeMap, HashMap, HashSet};

use kvxfer_proto::wire::metadata::{Metadata, RegionMeta};

/// What a key of the namespace names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Key {
    /// An agent's base metadata.
    Agent(String),
    /// A region an agent registered after publishing.
    Region { name: String, epoch: u64, id: u32 },
}

/// The key layout of one namespace.
#[derive(Clone, Debug)]
pub(super) struct Layout {
    ns: String,
}

impl Layout {
    pub(super) fn new(ns: &str) -> Layout {
        Layout {
            ns: ns.trim_end_matches('/').to_string(),
        }
    }

    /// Every agent's base key starts with this.
    pub(super) fn agents(&self) -> String {
        format!("{}/agents/", self.ns)
    }

    /// Every region update's key starts with this.
    pub(super) fn regions(&self) -> String {
        format!("{}/regions/", self.ns)
    }

    /// The notes of `name` (and of any name that starts with `name/`).
    pub(super) fn notes_of(&self, name: &str) -> String {
        format!("{}/notes/{name}/", self.ns)
    }

    pub(super) fn agent(&self, name: &str) -> String {
        format!("{}/agents/{name}", self.ns)
    }

    /// The prefix of the updates of `name`'s incarnation `epoch`.
    pub(super) fn regions_of(&self, name: &str, epoch: u64) -> String {
        format!("{}/regions/{name}/{epoch:016x}/", self.ns)
    }

    pub(super) fn region(&self, name: &str, epoch: u64, id: u32) -> String {
        format!("{}{id}", self.regions_of(name, epoch))
    }

    /// A note an agent attaches to its name (e.g. a tool's control address).
    pub(super) fn note(&self, name: &str, what: &str) -> String {
        format!("{}/notes/{name}/{what}", self.ns)
    }

    /// What `key` names; `None` for a key of another layout.
    pub(super) fn parse(&self, key: &str) -> Option<Key> {
        let rest = key.strip_prefix(&self.ns)?.strip_prefix('/')?;
        if let Some(name) = rest.strip_prefix("agents/") {
            return (!name.is_empty()).then(|| Key::Agent(name.to_string()));
        }
        // The name may hold '/': take the epoch and id from the right.
        let rest = rest.strip_prefix("regions/")?;
        let mut it = rest.rsplitn(3, '/');
        let id = it.next()?.parse().ok()?;
        let epoch = u64::from_str_radix(it.next()?, 16).ok()?;
        let name = it.next().filter(|n| !n.is_empty())?;
        Some(Key::Region {
            name: name.to_string(),
            epoch,
            id,
        })
    }
}

#[derive(Debug)]
struct Entry {
    base: Metadata,
    /// Updates of `base.epoch`, by region id.
    added: BTreeMap<u32, RegionMeta>,
}

impl Entry {
    fn merged(&self) -> Metadata {
        let mut m = self.base.clone();
        for r in self.added.values() {
            if !m.regions.iter().any(|x| x.id == r.id) {
                m.regions.push(r.clone());
            }
        }
        m
    }
}

/// The most region updates a watcher keeps waiting for their base, in all: keys of names that
/// never publish a base (an etcd writer's churn) cannot grow it further.
pub(super) const MAX_EARLY: usize = 4096;

/// The most agents a watcher assembles by default; past it a new name is not loaded.
pub(super) const DEFAULT_MAX_AGENTS: usize = 4096;

/// The peers of a namespace as a watcher assembles them. Each method returns the metadata to
/// load now, if the change makes any.
#[derive(Debug)]
pub(super) struct Assembly {
    peers: HashMap<String, Entry>,
    /// Updates seen before their base (a watch may deliver them in one batch, either order),
    /// at most [`MAX_EARLY`] in all; an entry goes with its last update.
    early: HashMap<(String, u64), BTreeMap<u32, RegionMeta>>,
    early_len: usize,
    max_agents: usize,
    /// Updates not kept (past [`MAX_EARLY`]) and new agents not loaded (past the cap).
    pub(super) dropped_early: u64,
    pub(super) refused_agents: u64,
}

impl Default for Assembly {
    fn default() -> Assembly {
        Assembly::new(DEFAULT_MAX_AGENTS)
    }
}

impl Assembly {
    /// An empty assembly of at most `max_agents` agents.
    pub(super) fn new(max_agents: usize) -> Assembly {
        Assembly {
            peers: HashMap::new(),
            early: HashMap::new(),
            early_len: 0,
            max_agents,
            dropped_early: 0,
            refused_agents: 0,
        }
    }

    /// Agents assembled.
    pub(super) fn agents(&self) -> usize {
        self.peers.len()
    }

    /// Region updates waiting for their base.
    pub(super) fn early_len(&self) -> usize {
        self.early_len
    }

    /// Incarnations with updates waiting for their base.
    pub(super) fn early_agents(&self) -> usize {
        self.early.len()
    }

    /// Drops every update waiting for its base (a listing brings back those still in etcd).
    pub(super) fn forget_early(&mut self) {
        self.early.clear();
        self.early_len = 0;
    }

    fn drop_early_of(&mut self, name: &str) {
        let mut n = 0;
        self.early.retain(|(k, _), v| {
            let keep = k != name;
            if !keep {
                n += v.len();
            }
            keep
        });
        self.early_len -= n;
    }

    /// An agent's base metadata was put: a new incarnation drops the old one's updates.
    /// `None` for a new agent past the cap (counted).
    pub(super) fn base(&mut self, base: Metadata) -> Option<Metadata> {
        let name = base.name.clone();
        if !self.peers.contains_key(&name) && self.peers.len() >= self.max_agents {
            self.refused_agents += 1;
            self.drop_early_of(&name);
            return None;
        }
        let mut added = self
            .early
            .remove(&(name.clone(), base.epoch))
            .unwrap_or_default();
        self.early_len -= added.len();
        if let Some(old) = self.peers.remove(&name) {
            if old.base.epoch == base.epoch {
                added.extend(old.added);
            }
        }
        self.drop_early_of(&name);
        let e = Entry { base, added };
        let m = e.merged();
        self.peers.insert(name, e);
        Some(m)
    }

    /// A region update of `name`'s incarnation `epoch`.
    pub(super) fn region(&mut self, name: &str, epoch: u64, r: RegionMeta) -> Option<Metadata> {
        match self.peers.get_mut(name) {
            Some(e) if e.base.epoch == epoch => {
                e.added.insert(r.id.0, r);
                Some(e.merged())
            }
            // No base yet, or another incarnation's: held until a base of `epoch` comes (an
            // old incarnation's leftovers are dropped with the next base, never applied).
            _ => {
                let key = (name.to_string(), epoch);
                let known = self
                    .early
                    .get(&key)
                    .is_some_and(|v| v.contains_key(&r.id.0));
                if !known && self.early_len >= MAX_EARLY {
                    self.dropped_early += 1;
                    return None;
                }
                if self
                    .early
                    .entry(key)
                    .or_default()
                    .insert(r.id.0, r)
                    .is_none()
                {
                    self.early_len += 1;
                }
                None
            }
        }
    }

    /// A region update was deleted (the agent deregistered it).
    pub(super) fn region_gone(&mut self, name: &str, epoch: u64, id: u32) -> Option<Metadata> {
        let key = (name.to_string(), epoch);
        if let Some(v) = self.early.get_mut(&key) {
            if v.remove(&id).is_some() {
                self.early_len -= 1;
            }
            if v.is_empty() {
                self.early.remove(&key);
            }
        }
        let e = self.peers.get_mut(name).filter(|e| e.base.epoch == epoch)?;
        e.added.remove(&id)?;
        Some(e.merged())
    }

    /// An agent's base key was deleted (its lease ended): true if it was known.
    pub(super) fn agent_gone(&mut self, name: &str) -> bool {
        self.drop_early_of(name);
        self.peers.remove(name).is_some()
    }

    /// After listing the namespace again: the known agents whose base key is not in `names`
    /// (deleted while the watch was broken), forgotten here and returned.
    pub(super) fn relisted(&mut self, names: &HashSet<String>) -> Vec<String> {
        let gone: Vec<String> = self
            .peers
            .keys()
            .filter(|n| !names.contains(*n))
            .cloned()
            .collect();
        for n in &gone {
            self.agent_gone(n);
        }
        gone
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use kvxfer_proto::types::{MemKind, RegionId};

    fn region(id: u32) -> RegionMeta {
        RegionMeta {
            id: RegionId(id),
            kind: MemKind::Host,
            base: 0x1000 * u64::from(id + 1),
            len: 4096,
            rkey: vec![id as u8; 8],
            shm: None,
        }
    }

    fn meta(name: &str, epoch: u64, ids: &[u32]) -> Metadata {
        Metadata {
            name: name.into(),
            compat: 1,
            worker_addr: vec![1, 2, 3],
            epoch,
            host: None,
            lanes: Vec::new(),
            regions: ids.iter().map(|&i| region(i)).collect(),
        }
    }

    fn ids(m: &Metadata) -> Vec<u32> {
        m.regions.iter().map(|r| r.id.0).collect()
    }

    #[test]
    fn keys_parse_back_to_what_made_them() {
        let l = Layout::new("/ns/");
        assert_eq!(l.agent("p0"), "/ns/agents/p0");
        assert_eq!(l.parse("/ns/agents/p0"), Some(Key::Agent("p0".into())));
        assert_eq!(l.parse("/ns/agents/a/b"), Some(Key::Agent("a/b".into())));
        let k = l.region("a/b", 0xfeed, 7);
        assert_eq!(k, "/ns/regions/a/b/000000000000feed/7");
        assert_eq!(
            l.parse(&k),
            Some(Key::Region {
                name: "a/b".into(),
                epoch: 0xfeed,
                id: 7
            })
        );
        for foreign in [
            "/other/agents/x",
            "/ns/agents/",
            "/ns/regions/x/zz/1",
            "/ns/regions/x/1/y",
            "/ns/regions/1/2",
            "/ns/else/x",
            "/nsx/agents/x",
        ] {
            assert_eq!(l.parse(foreign), None, "{foreign}");
        }
    }

    #[test]
    fn updates_add_regions_to_the_base_of_their_epoch_only() {
        let mut a = Assembly::default();
        assert_eq!(ids(&a.base(meta("p", 5, &[0])).unwrap()), [0]);
        assert_eq!(ids(&a.region("p", 5, region(1)).unwrap()), [0, 1]);
        assert_eq!(ids(&a.region("p", 5, region(2)).unwrap()), [0, 1, 2]);
        // Deregistered: the update's key is deleted.
        assert_eq!(ids(&a.region_gone("p", 5, 1).unwrap()), [0, 2]);
        assert!(a.region_gone("p", 5, 1).is_none());
        // The same incarnation re-publishing its base keeps its updates.
        assert_eq!(ids(&a.base(meta("p", 5, &[0])).unwrap()), [0, 2]);
        // Another epoch's update is not applied to this one.
        assert!(a.region("p", 9, region(3)).is_none());
        // A restart: the old updates are dropped; the new one's early update (seen before its
        // base) is applied with it.
        assert_eq!(ids(&a.base(meta("p", 9, &[0])).unwrap()), [0, 3]);
    }

    #[test]
    fn an_update_before_its_base_waits_for_it() {
        let mut a = Assembly::default();
        assert!(a.region("q", 2, region(4)).is_none());
        assert_eq!(ids(&a.base(meta("q", 2, &[0])).unwrap()), [0, 4]);
        // A base listing a region also sent as update keeps it once.
        assert_eq!(ids(&a.region("q", 2, region(0)).unwrap()), [0, 4]);
    }

    #[test]
    fn updates_of_names_that_never_publish_leave_nothing_and_are_capped() {
        let mut a = Assembly::default();
        // Put-and-delete churn of unknown names: nothing is left (before: an empty entry
        // per name stayed for good).
        for i in 0..3000 {
            let n = format!("ghost-{i}");
            assert!(a.region(&n, 1, region(0)).is_none());
            assert!(a.region_gone(&n, 1, 0).is_none());
        }
        assert_eq!((a.early.len(), a.early_len()), (0, 0));
        // Without deletes, at most MAX_EARLY are kept; a base still takes its own.
        for i in 0..(MAX_EARLY + 100) {
            a.region(&format!("ghost-{i}"), 1, region(0));
        }
        assert_eq!(a.early_len(), MAX_EARLY);
        assert_eq!(a.dropped_early, 100);
        assert_eq!(ids(&a.base(meta("ghost-7", 1, &[])).unwrap()), [0]);
        assert_eq!(a.early_len(), MAX_EARLY - 1);
        a.forget_early();
        assert_eq!((a.early.len(), a.early_len()), (0, 0));
    }

    #[test]
    fn agents_past_the_cap_are_not_loaded() {
        let mut a = Assembly::new(2);
        assert!(a.base(meta("a", 1, &[0])).is_some());
        assert!(a.base(meta("b", 1, &[0])).is_some());
        assert!(a.base(meta("c", 1, &[0])).is_none());
        assert_eq!(a.refused_agents, 1);
        // A known agent's restart is not a new agent.
        assert!(a.base(meta("a", 2, &[0])).is_some());
        assert!(a.agent_gone("b"));
        assert!(a.base(meta("c", 1, &[0])).is_some());
    }

    #[test]
    fn agents_gone_while_the_watch_was_broken_are_found_on_relist() {
        let mut a = Assembly::default();
        a.base(meta("a", 1, &[0]));
        a.base(meta("b", 2, &[0]));
        a.base(meta("c", 3, &[0]));
        assert!(a.agent_gone("c"));
        assert!(!a.agent_gone("c"));
        let present: HashSet<String> = ["a".to_string()].into();
        assert_eq!(a.relisted(&present), ["b".to_string()]);
        assert!(a.relisted(&present).is_empty());
        assert!(a.region("b", 2, region(1)).is_none(), "b was forgotten");
    }
}
