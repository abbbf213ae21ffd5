//! An agent's own keys in etcd: what it put there (its base metadata, its region updates and
//! its notes, the sealed ones bound to its lease), and the check that puts back, under its
//! lease, any of them that vanished or changed while it lives. A delete of its key, a value
//! swapped in from another agent's key or replayed from an old incarnation, or an update
//! removed, is undone at the next event the agent's watch of its keys sees (within
//! milliseconds), and at the latest at the lease task's next round (a third of the TTL).
//!
//! One exception: a value of another incarnation of this name that proves itself alive (it
//! opens under the secret and the lease etcd holds it with, and its holder answers) means this
//! agent was taken over; it stops putting its keys back rather than fight a live agent.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use etcd_client::{Client, GetOptions, KeyValue, PutOptions, Txn, TxnOp, WatchOptions};

use super::assembly::{Key, Layout};
use super::seal::open;
use crate::agent::Agent;
use crate::lane::tcp::liveness::answers_as;
use kvxfer_proto::error::{Error, Result};
use kvxfer_proto::wire::metadata::Metadata;

/// What this agent has in etcd.
pub(super) struct Published {
    /// The lease every key hangs on.
    pub(super) lease: i64,
    /// The base as published.
    pub(super) base: Metadata,
    /// The base's metadata plus the updates: what a watcher assembles.
    pub(super) now: Metadata,
    /// Every key this agent put, with the exact value: what a heal restores.
    pub(super) values: BTreeMap<String, Vec<u8>>,
    /// Another live incarnation of the name holds the key: heal no more.
    pub(super) superseded: bool,
}

/// An agent's base metadata from a key's value: opened under the lease etcd holds it with.
pub(super) fn decode_base(agent: &Agent, kv: &KeyValue) -> Result<Metadata> {
    let key = String::from_utf8_lossy(kv.key());
    let bytes = open(agent.secret(), &key, kv.lease(), kv.value())?;
    Metadata::decode(&bytes, agent.compat()).map_err(|err| Error::Metadata {
        source_desc: format!("etcd key {key}"),
        err,
    })
}

/// Whether the incarnation whose metadata a key holds still answers on its TCP lane: with a
/// secret, proven on the lane's sealed opening against that incarnation's key, never because
/// a port accepts a connection ([`answers_as`]).
/// It blocks (a connection and an answer, a second each at most): called from the etcd
/// runtime's tasks, it hands the runtime's worker to another thread meanwhile, so that the
/// lease and watch tasks go on.
pub(super) fn holder_alive(agent: &Agent, m: Option<&Metadata>) -> bool {
    let Some(l) = m.and_then(|m| m.tcp_lane()) else {
        return false;
    };
    let ask = || answers_as(&l, agent.secret(), agent.name(), Duration::from_secs(1));
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(ask)
        }
        _ => ask(),
    }
}

/// Whether `key` is one of `agent`'s (its base, an update of any of its epochs, or a key it
/// put).
fn is_mine(layout: &Layout, agent: &Agent, p: &Published, key: &str) -> bool {
    match layout.parse(key) {
        Some(Key::Agent(n)) | Some(Key::Region { name: n, .. }) => n == agent.name(),
        None => p.values.contains_key(key),
    }
}

/// Puts back what of `p` etcd no longer holds as put, and deletes updates of this
/// incarnation it did not put. Returns how many keys it mended; `Err` when etcd did not
/// answer, or this agent was taken over (then `p.superseded`).
pub(super) async fn reconcile(
    layout: &Layout,
    c: &mut Client,
    agent: &Agent,
    p: &mut Published,
) -> std::result::Result<usize, String> {
    if p.superseded {
        return Err("taken over by another live incarnation".into());
    }
    let name = agent.name();
    let base_key = layout.agent(name);
    let mut found: HashMap<String, KeyValue> = HashMap::new();
    let prefix = Some(GetOptions::new().with_prefix());
    let mut ranges = vec![
        (base_key.clone(), None),
        (layout.regions_of(name, p.base.epoch), prefix.clone()),
    ];
    // Notes: each is read by its own key (a prefix would also take another name's).
    for k in p.values.keys().filter(|k| **k != base_key) {
        if layout.parse(k).is_none() {
            ranges.push((k.clone(), None));
        }
    }
    for (k, opts) in ranges {
        let r = c.get(k, opts).await.map_err(|e| e.to_string())?;
        for kv in r.kvs() {
            found.insert(String::from_utf8_lossy(kv.key()).into_owned(), kv.clone());
        }
    }
    let as_put = |k: &str, v: &[u8]| {
        found
            .get(k)
            .is_some_and(|kv| kv.value() == v && kv.lease() == p.lease)
    };
    if let Some(kv) = found.get(&base_key).filter(|_| {
        !as_put(
            &base_key,
            p.values.get(&base_key).map_or(&[][..], |v| v.as_slice()),
        )
    }) {
        let theirs = decode_base(agent, kv).ok();
        let other_live = theirs.as_ref().is_some_and(|m| {
            m.name == name && m.epoch != p.base.epoch && holder_alive(agent, Some(m))
        });
        if other_live {
            p.superseded = true;
            log::error!(
                "kvxfer: {name:?}: etcd key {base_key} holds another live incarnation (epoch \
                 {:#018x}); this one ({:#018x}) no longer puts its keys back",
                theirs.map_or(0, |m| m.epoch),
                p.base.epoch
            );
            return Err("taken over by another live incarnation".into());
        }
    }
    let opts = Some(PutOptions::new().with_lease(p.lease));
    let mut ops = Vec::new();
    let mut mended = Vec::new();
    for (k, v) in &p.values {
        if !as_put(k, v) {
            ops.push(TxnOp::put(k.clone(), v.clone(), opts.clone()));
            mended.push(k.clone());
        }
    }
    for k in found.keys() {
        let ours_epoch = matches!(layout.parse(k), Some(Key::Region { name: n, epoch, .. })
            if n == name && epoch == p.base.epoch);
        if ours_epoch && !p.values.contains_key(k) {
            ops.push(TxnOp::delete(k.clone(), None));
            mended.push(k.clone());
        }
    }
    if ops.is_empty() {
        return Ok(0);
    }
    c.txn(Txn::new().and_then(ops))
        .await
        .map_err(|e| e.to_string())?;
    log::warn!(
        "kvxfer: {name:?}: etcd keys changed or removed by someone else, put back: {}",
        mended.join(", ")
    );
    Ok(mended.len())
}

/// Watches the namespace for changes to `agent`'s own keys and mends them
/// ([`reconcile`]); counts the keys mended in `healed`. Runs until the agent goes.
pub(super) async fn heal_loop(
    layout: Layout,
    c: Client,
    agent: Weak<Agent>,
    published: Arc<tokio::sync::Mutex<Option<Published>>>,
    healed: Arc<AtomicU64>,
) {
    loop {
        let Some(a) = agent.upgrade() else { return };
        // Its base key, the updates (of every name: a prefix of its own would miss none of
        // its epochs), and its notes; one stream.
        let prefix = Some(WatchOptions::new().with_prefix());
        let watch = async {
            let (mut w, s) = c.clone().watch(layout.agent(a.name()), None).await?;
            w.watch(layout.regions(), prefix.clone()).await?;
            w.watch(layout.notes_of(a.name()), prefix.clone()).await?;
            Ok::<_, etcd_client::Error>((w, s))
        };
        let stream = watch.await;
        drop(a);
        if let Ok((_watcher, mut stream)) = stream {
            while let Ok(Some(resp)) = stream.message().await {
                if resp.canceled() {
                    break;
                }
                let Some(a) = agent.upgrade() else { return };
                let mut g = published.lock().await;
                let Some(p) = g.as_mut() else { continue };
                // Only a change to this agent's keys that it did not make itself.
                let foreign = resp.events().iter().filter_map(|ev| ev.kv()).any(|kv| {
                    let k = String::from_utf8_lossy(kv.key());
                    is_mine(&layout, &a, p, &k)
                        && !(p.values.get(k.as_ref()).map(|v| v.as_slice()) == Some(kv.value())
                            && kv.lease() == p.lease)
                });
                if foreign {
                    if let Ok(n) = reconcile(&layout, &mut c.clone(), &a, p).await {
                        healed.fetch_add(n as u64, Ordering::Relaxed);
                    }
                }
            }
        }
        // The watch broke (etcd gone or compacted): look once etcd answers, then watch again.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let Some(a) = agent.upgrade() else { return };
        let mut g = published.lock().await;
        if let Some(p) = g.as_mut() {
            if let Ok(n) = reconcile(&layout, &mut c.clone(), &a, p).await {
                healed.fetch_add(n as u64, Ordering::Relaxed);
            }
        }
    }
}
