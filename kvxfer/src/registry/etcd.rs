//! Discovery through etcd (feature `etcd`), with the maintained `etcd-client` crate (etcd's v3
//! gRPC API over tonic; the same client Dynamo's Rust runtime uses), on a runtime of its own
//! so the rest of kvxfer stays synchronous.
//!
//! Keys (see `assembly`): `<namespace>/agents/<name>` holds the agent's metadata (its epoch
//! inside) as it was when published, and `<namespace>/regions/<name>/<epoch>/<id>` each region
//! registered since (an update: one small put, not the whole blob again), all attached to one
//! lease of `ttl` that a task keeps alive. A worker that dies stops renewing: its keys are
//! deleted within the TTL and every watcher retires the peer (its transfers fail with
//! `PeerFailed`). Publishing a name whose key holds another epoch takes it over only when that
//! incarnation is gone (its TCP lane no longer answers); else it is [`Error::NameConflict`].
//! Watchers load every other agent's metadata when it appears or changes (prefetch: no
//! handshake on the hot path). If etcd goes away, loaded peers keep working; the lease task
//! re-publishes (new lease) and the watch lists the namespace again when etcd is back,
//! retiring the agents whose keys went meanwhile.

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, DeleteOptions, GetOptions, PutOptions, Txn, TxnOp,
    TxnOpResponse,
};
use tokio::runtime::Runtime;
use tokio::task::JoinHandle;

use super::api::Discovery;
use super::assembly::{Assembly, Layout};
use super::config::EtcdUser;
use super::own_keys::{decode_base, heal_loop, holder_alive, reconcile, Published};
use super::seal::seal;
use super::watch::{count, decode_region, load, load_all, watch_loop, WatchCounts};
use crate::agent::Agent;
use kvxfer_proto::error::{Error, Result};
use kvxfer_proto::wire::metadata::Metadata;

/// Where etcd is and how agents are kept there: [`EtcdConfig::new`], then the fields or
/// [`EtcdConfig::ttl`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct EtcdConfig {
    /// Endpoints, e.g. `http://10.0.0.5:2379`.
    pub endpoints: Vec<String>,
    /// Prefix of every key (one per deployment).
    pub namespace: String,
    /// Lease TTL: how long a dead agent's key outlives it (at least 1 s; etcd counts seconds).
    pub ttl: Duration,
    /// How long connecting (and each call) may take.
    pub timeout: Duration,
    /// etcd's own authentication, if it is on (also taken from an endpoint's
    /// `user:password@`). Without it, anyone who reaches etcd can write the namespace: with a
    /// shared secret set, what they write is never loaded (sealed values), but they can still
    /// delete keys (which their owners put back) and fill etcd.
    pub user: Option<EtcdUser>,
    /// The CA certificate (a PEM file) that signed etcd's server certificate: with it, the
    /// endpoints (`https://`) are reached over TLS (also taken from an endpoint's `?ca=PATH`).
    pub tls_ca: Option<std::path::PathBuf>,
    /// The most agents a watcher loads from the namespace; past it a new name is not loaded
    /// (logged, counted in [`WatchCounts::agents_refused`]). Default 4,096.
    pub max_agents: usize,
}

impl EtcdConfig {
    /// Endpoints `endpoints`, namespace `namespace`, a 10 s lease, 3 s timeouts. An endpoint
    /// `http://user:password@host:port` gives the user (etcd's own authentication).
    pub fn new(endpoints: &[&str], namespace: &str) -> EtcdConfig {
        let (mut user, mut tls_ca) = (None, None);
        let endpoints = endpoints
            .iter()
            .map(|e| {
                let (e, ca) = match e.split_once("?ca=") {
                    Some((e, ca)) => (e, Some(std::path::PathBuf::from(ca))),
                    None => (*e, None),
                };
                tls_ca = tls_ca.take().or(ca);
                let (e, u) = EtcdUser::split_url(e);
                user = user.take().or(u);
                e
            })
            .collect();
        EtcdConfig {
            endpoints,
            user,
            tls_ca,
            namespace: namespace.trim_end_matches('/').to_string(),
            ttl: Duration::from_secs(10),
            timeout: Duration::from_secs(3),
            max_agents: super::assembly::DEFAULT_MAX_AGENTS,
        }
    }

    /// Sets the user of etcd's own authentication.
    pub fn user(mut self, user: EtcdUser) -> EtcdConfig {
        self.user = Some(user);
        self
    }

    /// Sets the lease TTL.
    pub fn ttl(mut self, ttl: Duration) -> EtcdConfig {
        self.ttl = ttl;
        self
    }

    fn layout(&self) -> Layout {
        Layout::new(&self.namespace)
    }
}

/// The most notes one agent attaches ([`EtcdDiscovery::note`]): a note is for a tool's
/// address or a small record, never for data (watchers never list notes).
const MAX_NOTES: usize = 64;
/// The largest note, bytes.
const MAX_NOTE: usize = 64 << 10;

/// Notes attached to an agent's name: (key, value).
type Notes = Mutex<Vec<(String, Vec<u8>)>>;

/// Discovery through etcd. See the module docs.
pub struct EtcdDiscovery {
    cfg: EtcdConfig,
    client: Client,
    /// The lease the published agent holds now (0: none yet), shared with its lease task.
    lease: Arc<std::sync::atomic::AtomicI64>,
    /// Notes attached to the published agent's name: put again with every new lease.
    notes: Arc<Notes>,
    /// What the published agent has in etcd; the lease task and `refresh` bring it up to date.
    published: Arc<tokio::sync::Mutex<Option<Published>>>,
    /// Keys of the published agent put back after someone else changed or removed them.
    healed: Arc<std::sync::atomic::AtomicU64>,
    /// The watch task's counts, after each batch of events.
    counts: Arc<Mutex<WatchCounts>>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
    // Last: the runtime shuts down after the tasks were aborted.
    rt: Runtime,
}

impl std::fmt::Debug for EtcdDiscovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdDiscovery")
            .field("endpoints", &self.cfg.endpoints)
            .field("namespace", &self.cfg.namespace)
            .finish()
    }
}

fn etcd_err(cfg: &EtcdConfig, what: &str, e: impl std::fmt::Display) -> Error {
    Error::Registry {
        endpoints: cfg.endpoints.join(","),
        why: format!("{what}: {e}"),
    }
}

impl EtcdDiscovery {
    /// Connects to etcd; an etcd that does not answer within `cfg.timeout` is an error naming
    /// the endpoints.
    pub fn connect(cfg: EtcdConfig) -> Result<Arc<EtcdDiscovery>> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kvxfer-etcd")
            .enable_all()
            .build()
            .map_err(|e| Error::io("starting the etcd runtime", e))?;
        let mut opts = ConnectOptions::new()
            .with_connect_timeout(cfg.timeout)
            .with_timeout(cfg.timeout);
        if let Some(u) = &cfg.user {
            opts = opts.with_user(u.name.clone(), u.password().to_string());
        }
        if let Some(ca) = &cfg.tls_ca {
            let pem = std::fs::read(ca).map_err(|e| {
                Error::io(format!("reading etcd's CA certificate {}", ca.display()), e)
            })?;
            let tls = etcd_client::TlsOptions::new()
                .ca_certificate(etcd_client::Certificate::from_pem(pem));
            opts = opts.with_tls(tls);
        }
        let client = rt.block_on(async {
            let mut c = Client::connect(cfg.endpoints.clone(), Some(opts)).await?;
            c.status().await?;
            Ok::<_, etcd_client::Error>(c)
        });
        let client = client.map_err(|e| {
            let what = if e.to_string().contains("authentication failed") {
                "the user was refused"
            } else {
                "unreachable"
            };
            etcd_err(&cfg, what, e)
        })?;
        Ok(Arc::new(EtcdDiscovery {
            cfg,
            client,
            lease: Arc::default(),
            notes: Arc::default(),
            published: Arc::default(),
            healed: Arc::default(),
            counts: Arc::default(),
            tasks: Mutex::new(Vec::new()),
            rt,
        }))
    }

    /// Attaches a note `what` = `value` to the agent published through `self` (e.g. a tool's
    /// control address): held by the agent's lease, so it goes when the agent does, and put
    /// again when the agent re-publishes. Notes are not sealed: put nothing secret in one. At
    /// most 64 notes an agent, of at most 64 KiB each (`InvalidArgument` past either).
    pub fn note(&self, agent: &Agent, what: &str, value: &[u8]) -> Result<()> {
        let key = self.cfg.layout().note(agent.name(), what);
        if value.len() > MAX_NOTE || what.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "note {what:?}: {} bytes (at most {MAX_NOTE}, and a name)",
                value.len()
            )));
        }
        {
            let mut notes = self.notes.lock().unwrap_or_else(|e| e.into_inner());
            notes.retain(|(k, _)| *k != key);
            if notes.len() >= MAX_NOTES {
                return Err(Error::InvalidArgument(format!(
                    "note {what:?}: agent {:?} has {MAX_NOTES} notes already",
                    agent.name()
                )));
            }
            notes.push((key.clone(), value.to_vec()));
        }
        let lease = self.lease.load(std::sync::atomic::Ordering::Acquire);
        if lease == 0 {
            return Err(Error::InvalidArgument(format!(
                "note {what:?}: publish agent {:?} first (a note hangs on its lease)",
                agent.name()
            )));
        }
        let mut c = self.client.clone();
        self.rt.block_on(async {
            // Under the record's lock: the heal task sees the note and its value together.
            let mut g = self.published.lock().await;
            c.put(
                key.clone(),
                value,
                Some(PutOptions::new().with_lease(lease)),
            )
            .await
            .map_err(|e| etcd_err(&self.cfg, "putting a note", e))?;
            if let Some(p) = g.as_mut().filter(|p| p.lease == lease) {
                p.values.insert(key, value.to_vec());
            }
            Ok(())
        })
    }

    /// What the watcher holds and refused, as of its last batch of events.
    pub fn watch_counts(&self) -> WatchCounts {
        *self.counts.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How many of the published agent's keys were put back after someone else changed or
    /// removed them (a delete, a swapped or replayed value, an update removed).
    pub fn healed(&self) -> u64 {
        self.healed.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The note `what` of agent `name`, if it has one.
    pub fn read_note(&self, name: &str, what: &str) -> Result<Option<Vec<u8>>> {
        let mut c = self.client.clone();
        let r = self
            .rt
            .block_on(c.get(self.cfg.layout().note(name, what), None))
            .map_err(|e| etcd_err(&self.cfg, "reading a note", e))?;
        Ok(r.kvs().first().map(|kv| kv.value().to_vec()))
    }

    /// Publishes `agent`'s changes since it was published (registrations, as updates) now,
    /// rather than at the lease task's next round (a third of the TTL): for a caller that
    /// registered memory and is about to tell a peer to use it.
    pub fn refresh(&self, agent: &Agent) -> Result<()> {
        let now = Metadata::decode(&agent.metadata()?, agent.compat()).map_err(|err| {
            Error::Metadata {
                source_desc: "this agent's own metadata".into(),
                err,
            }
        })?;
        self.rt.block_on(async {
            let mut g = self.published.lock().await;
            let p = g.as_mut().ok_or_else(|| {
                Error::InvalidArgument(format!("agent {:?} is not published", agent.name()))
            })?;
            if p.now == now {
                return Ok(());
            }
            if update(&self.cfg, self.client.clone(), agent, p, now).await {
                Ok(())
            } else {
                Err(etcd_err(
                    &self.cfg,
                    "publishing an update",
                    "etcd did not take it",
                ))
            }
        })
    }

    /// Runs `task` until `self` drops.
    fn keep(&self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        let t = self.rt.spawn(task);
        self.tasks.lock().unwrap_or_else(|e| e.into_inner()).push(t);
    }
}

impl Drop for EtcdDiscovery {
    fn drop(&mut self) {
        for t in self
            .tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            t.abort();
        }
        // A clean exit: the agent's keys go now (revoking the lease), so peers retire it at
        // once instead of a TTL later. Not from inside another runtime (it cannot block there;
        // the lease then runs out).
        let lease = self.lease.load(std::sync::atomic::Ordering::Acquire);
        if lease != 0 && tokio::runtime::Handle::try_current().is_err() {
            let mut c = self.client.clone();
            // The timer is made inside the runtime (it needs its reactor).
            let _ = self.rt.block_on(async move {
                tokio::time::timeout(Duration::from_secs(1), c.lease_revoke(lease)).await
            });
        }
    }
}

impl Discovery for EtcdDiscovery {
    fn publish(&self, agent: &Arc<Agent>) -> Result<()> {
        let published = self.rt.block_on(publish_once(
            &self.cfg,
            self.client.clone(),
            agent,
            &self.notes,
        ))?;
        self.lease
            .store(published.lease, std::sync::atomic::Ordering::Release);
        *self.published.blocking_lock() = Some(published);
        self.keep(lease_loop(
            Ctx {
                cfg: self.cfg.clone(),
                c: self.client.clone(),
                lease: self.lease.clone(),
                notes: self.notes.clone(),
                published: self.published.clone(),
                healed: self.healed.clone(),
            },
            Arc::downgrade(agent),
        ));
        self.keep(heal_loop(
            self.cfg.layout(),
            self.client.clone(),
            Arc::downgrade(agent),
            self.published.clone(),
            self.healed.clone(),
        ));
        Ok(())
    }

    fn watch(&self, agent: &Arc<Agent>) -> Result<()> {
        let mut asm = Assembly::new(self.cfg.max_agents);
        let (rev, load_now, _) = self
            .rt
            .block_on(load_all(
                &self.cfg.layout(),
                self.client.clone(),
                agent,
                &mut asm,
            ))
            .map_err(|(what, e)| etcd_err(&self.cfg, what, e))?;
        for m in load_now.values() {
            load(agent, m);
        }
        count(&self.counts, &asm);
        self.keep(watch_loop(
            self.cfg.layout(),
            self.client.clone(),
            Arc::downgrade(agent),
            rev,
            asm,
            self.counts.clone(),
        ));
        Ok(())
    }

    fn resolve(&self, agent: &Agent, name: &str) -> Result<()> {
        let layout = self.cfg.layout();
        let mut c = self.client.clone();
        let base = self
            .rt
            .block_on(c.get(layout.agent(name), None))
            .map_err(|e| etcd_err(&self.cfg, "reading an agent", e))?;
        let kv = base.kvs().first().ok_or_else(|| Error::UnknownPeer {
            agent: name.to_string(),
        })?;
        let base = decode_base(agent, kv)?;
        let updates = self
            .rt
            .block_on(c.get(
                layout.regions_of(name, base.epoch),
                Some(GetOptions::new().with_prefix()),
            ))
            .map_err(|e| etcd_err(&self.cfg, "reading an agent's updates", e))?;
        let mut asm = Assembly::default();
        let Some(mut meta) = asm.base(base) else {
            return Err(Error::UnknownPeer {
                agent: name.to_string(),
            });
        };
        for kv in updates.kvs() {
            if let Some((n, epoch, r)) = decode_region(agent, &layout, kv) {
                meta = asm.region(&n, epoch, r).unwrap_or(meta);
            }
        }
        agent.load_remote_metadata(&meta.encode()).map(|_| ())
    }
}

/// Puts `agent`'s metadata under a new lease (and drops this incarnation's older updates, now
/// in the base), unless another live incarnation holds the name.
async fn publish_once(
    cfg: &EtcdConfig,
    mut c: Client,
    agent: &Agent,
    notes: &Notes,
) -> Result<Published> {
    let layout = cfg.layout();
    let key = layout.agent(agent.name());
    let plain = agent.metadata()?;
    let ours = Metadata::decode(&plain, agent.compat()).map_err(|err| Error::Metadata {
        source_desc: "this agent's own metadata".into(),
        err,
    })?;
    let ttl = i64::try_from(cfg.ttl.as_secs().max(1)).unwrap_or(i64::MAX);
    let lease = c
        .lease_grant(ttl, None)
        .await
        .map_err(|e| etcd_err(cfg, "granting a lease", e))?
        .id();
    let meta = seal(agent.secret(), &key, lease, &plain)?;
    let notes: Vec<(String, Vec<u8>)> = notes.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let ops = || {
        let opts = Some(PutOptions::new().with_lease(lease));
        let mut ops = vec![
            TxnOp::put(key.clone(), meta.clone(), opts.clone()),
            TxnOp::delete(
                layout.regions_of(agent.name(), ours.epoch),
                Some(DeleteOptions::new().with_prefix()),
            ),
        ];
        for (k, v) in &notes {
            ops.push(TxnOp::put(k.clone(), v.clone(), opts.clone()));
        }
        ops
    };
    let done = || {
        let mut values: std::collections::BTreeMap<String, Vec<u8>> =
            notes.iter().cloned().collect();
        values.insert(key.clone(), meta.clone());
        Published {
            lease,
            base: ours.clone(),
            now: ours.clone(),
            values,
            superseded: false,
        }
    };
    for _ in 0..3 {
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
            .and_then(ops())
            .or_else([TxnOp::get(key.clone(), None)]);
        let r = c
            .txn(txn)
            .await
            .map_err(|e| etcd_err(cfg, "publishing", e))?;
        if r.succeeded() {
            return Ok(done());
        }
        let Some(TxnOpResponse::Get(g)) = r.op_responses().into_iter().next() else {
            continue;
        };
        let Some(kv) = g.kvs().first() else { continue };
        let theirs = decode_base(agent, kv).ok();
        if theirs.as_ref().is_some_and(|m| m.epoch != ours.epoch)
            && holder_alive(agent, theirs.as_ref())
        {
            let _ = c.lease_revoke(lease).await;
            return Err(Error::NameConflict {
                name: agent.name().to_string(),
                why: format!(
                    "etcd key {key} is held by epoch {:#018x}, which still answers (this is \
                     epoch {:#018x}; give each agent its own name)",
                    theirs.map_or(0, |m| m.epoch),
                    ours.epoch
                ),
            });
        }
        // Ours (a re-publish), or a gone incarnation's key not expired yet: take it over, as
        // long as nobody changed it since we looked.
        let txn = Txn::new()
            .when([Compare::mod_revision(
                key.clone(),
                CompareOp::Equal,
                kv.mod_revision(),
            )])
            .and_then(ops());
        let r = c
            .txn(txn)
            .await
            .map_err(|e| etcd_err(cfg, "publishing", e))?;
        if r.succeeded() {
            return Ok(done());
        }
    }
    Err(etcd_err(cfg, "publishing", "the key kept changing"))
}

/// Brings etcd from `p.now` to the agent's metadata `now`: registrations since are put as
/// updates and deregistered updates deleted; any other change (a region of the base
/// deregistered, a new lane) re-puts the base. Returns false when etcd did not take it.
async fn update(
    cfg: &EtcdConfig,
    mut c: Client,
    agent: &Agent,
    p: &mut Published,
    now: Metadata,
) -> bool {
    let layout = cfg.layout();
    let same_agent = Metadata {
        regions: Vec::new(),
        ..now.clone()
    } == Metadata {
        regions: Vec::new(),
        ..p.base.clone()
    };
    let base_kept = p.base.regions.iter().all(|r| now.regions.contains(r));
    if !same_agent || !base_kept {
        return match publish_again(cfg, c, agent, p.lease, &now).await {
            Ok(v) => {
                // The updates are in the base now, and their keys gone.
                let regions = layout.regions_of(agent.name(), now.epoch);
                p.values.retain(|k, _| !k.starts_with(&regions));
                p.values.insert(layout.agent(agent.name()), v);
                p.base = now.clone();
                p.now = now;
                true
            }
            Err(e) => {
                log::warn!("kvxfer: {:?}: metadata not re-published: {e}", agent.name());
                false
            }
        };
    }
    let opts = Some(PutOptions::new().with_lease(p.lease));
    let mut ops = Vec::new();
    let mut puts = Vec::new();
    let mut deletes = Vec::new();
    for r in now.regions.iter().filter(|r| !p.now.regions.contains(r)) {
        let key = layout.region(agent.name(), now.epoch, r.id.0);
        match seal(agent.secret(), &key, p.lease, &r.encode()) {
            Ok(v) => {
                puts.push((key.clone(), v.clone()));
                ops.push(TxnOp::put(key, v, opts.clone()));
            }
            Err(e) => {
                log::warn!("kvxfer: region {} not published: {e}", r.id.0);
                return false;
            }
        }
    }
    for r in p.now.regions.iter().filter(|r| !now.regions.contains(r)) {
        let key = layout.region(agent.name(), now.epoch, r.id.0);
        deletes.push(key.clone());
        ops.push(TxnOp::delete(key, None));
    }
    if !ops.is_empty() && c.txn(Txn::new().and_then(ops)).await.is_err() {
        return false;
    }
    for k in deletes {
        p.values.remove(&k);
    }
    p.values.extend(puts);
    p.now = now;
    true
}

/// Re-puts the base under the lease held, dropping the updates (now in the base); returns the
/// value put.
async fn publish_again(
    cfg: &EtcdConfig,
    mut c: Client,
    agent: &Agent,
    lease: i64,
    now: &Metadata,
) -> Result<Vec<u8>> {
    let layout = cfg.layout();
    let key = layout.agent(agent.name());
    let v = seal(agent.secret(), &key, lease, &now.encode())?;
    let txn = Txn::new().and_then([
        TxnOp::put(key, v.clone(), Some(PutOptions::new().with_lease(lease))),
        TxnOp::delete(
            layout.regions_of(agent.name(), now.epoch),
            Some(DeleteOptions::new().with_prefix()),
        ),
    ]);
    c.txn(txn)
        .await
        .map(|_| v)
        .map_err(|e| etcd_err(cfg, "publishing", e))
}

/// What the lease task shares with its `EtcdDiscovery`.
struct Ctx {
    cfg: EtcdConfig,
    c: Client,
    lease: Arc<std::sync::atomic::AtomicI64>,
    notes: Arc<Notes>,
    published: Arc<tokio::sync::Mutex<Option<Published>>>,
    healed: Arc<std::sync::atomic::AtomicU64>,
}

/// Keeps the lease alive; re-publishes (new lease, notes again) when it was lost or etcd came
/// back; puts new registrations as updates.
async fn lease_loop(ctx: Ctx, agent: Weak<Agent>) {
    let Ctx { cfg, c, .. } = &ctx;
    let period = (cfg.ttl / 3).max(Duration::from_millis(200));
    loop {
        tokio::time::sleep(period).await;
        let Some(a) = agent.upgrade() else { return };
        let mut g = ctx.published.lock().await;
        let Some(p) = g.as_mut() else { return };
        let lease = p.lease;
        let alive = async {
            let (mut keeper, mut stream) = c.clone().lease_keep_alive(lease).await?;
            keeper.keep_alive().await?;
            Ok::<_, etcd_client::Error>(stream.message().await?.is_some_and(|r| r.ttl() > 0))
        };
        let ok = matches!(tokio::time::timeout(cfg.timeout, alive).await, Ok(Ok(true)));
        if !ok {
            match publish_once(cfg, c.clone(), &a, &ctx.notes).await {
                Ok(again) => {
                    ctx.lease
                        .store(again.lease, std::sync::atomic::Ordering::Release);
                    log::info!(
                        "kvxfer: {:?} published again in etcd (lease lost or etcd back)",
                        a.name()
                    );
                    *p = again;
                }
                Err(e) => log::warn!("kvxfer: {:?} not published in etcd: {e}", a.name()),
            }
            continue;
        }
        let now = a
            .metadata()
            .ok()
            .and_then(|b| Metadata::decode(&b, a.compat()).ok());
        if let Some(now) = now.filter(|m| *m != p.now) {
            update(cfg, c.clone(), &a, p, now).await;
        }
        // Whatever the heal task's watch missed is mended here, within a third of the TTL.
        if let Ok(n) = reconcile(&cfg.layout(), &mut c.clone(), &a, p).await {
            ctx.healed
                .fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
        }
    }
}
