//! Discovery through etcd (feature `etcd`), with the maintained `etcd-client` crate (etcd's v3
//! gRPC API over tonic; the same client Dynamo's Rust runtime uses), on a runtime of its own
//! so the rest of kvxfer stays synchronous.
//!
//! Keys: `<namespace>/agents/<name>` holds the agent's metadata (its epoch inside), attached to
//! a lease of `ttl` that a task keeps alive. A worker that dies stops renewing: its key is
//! deleted within the TTL and every watcher forgets the peer. Publishing a name whose key
//! holds another epoch takes it over only when that incarnation is gone (its TCP lane no
//! longer answers); else it is [`Error::NameConflict`]. Watchers load every other agent's
//! metadata when it appears or changes (prefetch: no handshake on the hot path) and remove
//! the peer when its key goes. If etcd goes away, loaded peers keep working; the lease task
//! re-publishes (new lease) and the watch starts again when etcd is back.

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, PutOptions, Txn, TxnOp,
    TxnOpResponse, WatchOptions,
};
use tokio::runtime::Runtime;
use tokio::task::JoinHandle;

use super::api::Discovery;
use super::seal::{open, seal};
use crate::agent::Agent;
use kvxfer_proto::error::{Error, Result};
use kvxfer_proto::wire::metadata::Metadata;

/// Where etcd is and how agents are kept there.
#[derive(Clone, Debug)]
pub struct EtcdConfig {
    /// Endpoints, e.g. `http://10.0.0.5:2379`.
    pub endpoints: Vec<String>,
    /// Prefix of every key (one per deployment).
    pub namespace: String,
    /// Lease TTL: how long a dead agent's key outlives it (at least 1 s; etcd counts seconds).
    pub ttl: Duration,
    /// How long connecting (and each call) may take.
    pub timeout: Duration,
}

impl EtcdConfig {
    /// Endpoints `endpoints`, namespace `namespace`, a 10 s lease, 3 s timeouts.
    pub fn new(endpoints: &[&str], namespace: &str) -> EtcdConfig {
        EtcdConfig {
            endpoints: endpoints.iter().map(|e| e.to_string()).collect(),
            namespace: namespace.trim_end_matches('/').to_string(),
            ttl: Duration::from_secs(10),
            timeout: Duration::from_secs(3),
        }
    }

    /// Sets the lease TTL.
    pub fn ttl(mut self, ttl: Duration) -> EtcdConfig {
        self.ttl = ttl;
        self
    }

    fn key(&self, name: &str) -> String {
        format!("{}/agents/{name}", self.namespace)
    }

    fn prefix(&self) -> String {
        format!("{}/agents/", self.namespace)
    }
}

/// Discovery through etcd. See the module docs.
pub struct EtcdDiscovery {
    cfg: EtcdConfig,
    client: Client,
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
        let opts = ConnectOptions::new()
            .with_connect_timeout(cfg.timeout)
            .with_timeout(cfg.timeout);
        let client = rt.block_on(async {
            let mut c = Client::connect(cfg.endpoints.clone(), Some(opts)).await?;
            c.status().await?;
            Ok::<_, etcd_client::Error>(c)
        });
        let client = client.map_err(|e| etcd_err(&cfg, "unreachable", e))?;
        Ok(Arc::new(EtcdDiscovery {
            cfg,
            client,
            tasks: Mutex::new(Vec::new()),
            rt,
        }))
    }

    /// Loads every agent of the namespace into `agent` now and keeps doing so (and removes
    /// those whose key goes) while `self` lives.
    pub fn watch(&self, agent: &Arc<Agent>) -> Result<()> {
        let rev = self
            .rt
            .block_on(load_all(&self.cfg, self.client.clone(), agent))?;
        self.keep(watch_loop(
            self.cfg.clone(),
            self.client.clone(),
            Arc::downgrade(agent),
            rev,
        ));
        Ok(())
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
    }
}

impl Discovery for EtcdDiscovery {
    fn publish(&self, agent: &Arc<Agent>) -> Result<()> {
        let lease = self
            .rt
            .block_on(publish_once(&self.cfg, self.client.clone(), agent))?;
        self.keep(lease_loop(
            self.cfg.clone(),
            self.client.clone(),
            Arc::downgrade(agent),
            lease,
        ));
        Ok(())
    }

    fn resolve(&self, agent: &Agent, name: &str) -> Result<()> {
        let mut c = self.client.clone();
        let key = self.cfg.key(name);
        let got = self
            .rt
            .block_on(c.get(key, None))
            .map_err(|e| etcd_err(&self.cfg, "reading an agent", e))?;
        let kv = got.kvs().first().ok_or_else(|| Error::UnknownPeer {
            agent: name.to_string(),
        })?;
        let meta = open(agent.secret(), &self.cfg.key(name), kv.value())?;
        agent.load_remote_metadata(&meta).map(|_| ())
    }
}

/// Puts `agent`'s metadata under a new lease, unless another live incarnation holds the name.
async fn publish_once(cfg: &EtcdConfig, mut c: Client, agent: &Agent) -> Result<i64> {
    let key = cfg.key(agent.name());
    let meta = seal(agent.secret(), &key, &agent.metadata()?)?;
    let ttl = i64::try_from(cfg.ttl.as_secs().max(1)).unwrap_or(i64::MAX);
    let lease = c
        .lease_grant(ttl, None)
        .await
        .map_err(|e| etcd_err(cfg, "granting a lease", e))?
        .id();
    for _ in 0..3 {
        let put = TxnOp::put(
            key.clone(),
            meta.clone(),
            Some(PutOptions::new().with_lease(lease)),
        );
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
            .and_then([put])
            .or_else([TxnOp::get(key.clone(), None)]);
        let r = c
            .txn(txn)
            .await
            .map_err(|e| etcd_err(cfg, "publishing", e))?;
        if r.succeeded() {
            return Ok(lease);
        }
        let Some(TxnOpResponse::Get(g)) = r.op_responses().into_iter().next() else {
            continue;
        };
        let Some(kv) = g.kvs().first() else { continue };
        let theirs = open(agent.secret(), &key, kv.value())
            .ok()
            .and_then(|m| Metadata::decode(&m, agent.compat()).ok());
        let ours = agent.epoch();
        if theirs.as_ref().is_some_and(|m| m.epoch != ours) && holder_alive(theirs.as_ref()) {
            let _ = c.lease_revoke(lease).await;
            return Err(Error::NameConflict {
                name: agent.name().to_string(),
                why: format!(
                    "etcd key {key} is held by epoch {:#018x}, which still answers (this is \
                     epoch {ours:#018x}; give each agent its own name)",
                    theirs.map_or(0, |m| m.epoch)
                ),
            });
        }
        // Ours (a re-publish), or a gone incarnation's key not expired yet: take it over, as
        // long as nobody changed it since we looked.
        let put = TxnOp::put(
            key.clone(),
            meta.clone(),
            Some(PutOptions::new().with_lease(lease)),
        );
        let txn = Txn::new()
            .when([Compare::mod_revision(
                key.clone(),
                CompareOp::Equal,
                kv.mod_revision(),
            )])
            .and_then([put]);
        let r = c
            .txn(txn)
            .await
            .map_err(|e| etcd_err(cfg, "publishing", e))?;
        if r.succeeded() {
            return Ok(lease);
        }
    }
    Err(etcd_err(cfg, "publishing", "the key kept changing"))
}

/// Whether the incarnation whose metadata a key holds still answers on its TCP lane.
fn holder_alive(m: Option<&Metadata>) -> bool {
    m.and_then(|m| m.lane).is_some_and(|l| {
        std::net::TcpStream::connect_timeout(&l.addr, Duration::from_secs(1)).is_ok()
    })
}

/// Keeps the lease alive; re-publishes (new lease) when it was lost or etcd came back; puts
/// the metadata again when the agent's changed (new registrations).
async fn lease_loop(cfg: EtcdConfig, c: Client, agent: Weak<Agent>, mut lease: i64) {
    let period = (cfg.ttl / 3).max(Duration::from_millis(200));
    let mut last = agent.upgrade().and_then(|a| a.metadata().ok());
    loop {
        tokio::time::sleep(period).await;
        let Some(a) = agent.upgrade() else { return };
        let alive = async {
            let (mut keeper, mut stream) = c.clone().lease_keep_alive(lease).await?;
            keeper.keep_alive().await?;
            Ok::<_, etcd_client::Error>(stream.message().await?.is_some_and(|r| r.ttl() > 0))
        };
        let ok = matches!(tokio::time::timeout(cfg.timeout, alive).await, Ok(Ok(true)));
        let now = a.metadata().ok();
        if !ok {
            match publish_once(&cfg, c.clone(), &a).await {
                Ok(l) => {
                    log::info!(
                        "kvxfer: {:?} published again in etcd (lease lost or etcd back)",
                        a.name()
                    );
                    lease = l;
                    last = now;
                }
                Err(e) => log::warn!("kvxfer: {:?} not published in etcd: {e}", a.name()),
            }
        } else if let Some(m) = now.filter(|m| Some(m) != last.as_ref()) {
            // New registrations: the key carries the agent's current metadata.
            let key = cfg.key(a.name());
            let opts = Some(PutOptions::new().with_lease(lease));
            if let Ok(v) = seal(a.secret(), &key, &m) {
                if c.clone().put(key, v, opts).await.is_ok() {
                    last = Some(m);
                }
            }
        }
    }
}

/// Loads every agent of the namespace but `agent` itself; returns the revision seen.
async fn load_all(cfg: &EtcdConfig, mut c: Client, agent: &Arc<Agent>) -> Result<i64> {
    let r = c
        .get(cfg.prefix(), Some(GetOptions::new().with_prefix()))
        .await
        .map_err(|e| etcd_err(cfg, "listing agents", e))?;
    for kv in r.kvs() {
        load_one(agent, kv.key(), kv.value(), cfg);
    }
    Ok(r.header().map_or(0, |h| h.revision()))
}

fn load_one(agent: &Agent, key: &[u8], value: &[u8], cfg: &EtcdConfig) {
    let key = String::from_utf8_lossy(key);
    let name = key.strip_prefix(&cfg.prefix()).unwrap_or(&key);
    if name == agent.name() {
        return;
    }
    if let Err(e) = open(agent.secret(), &key, value).and_then(|m| agent.load_remote_metadata(&m)) {
        log::warn!("kvxfer: agent {name:?} from etcd not loaded: {e}");
    }
}

/// Follows the namespace from revision `rev`: loads what appears or changes, removes what
/// goes; starts over (listing again) when the watch breaks.
async fn watch_loop(cfg: EtcdConfig, c: Client, agent: Weak<Agent>, mut rev: i64) {
    loop {
        let Some(a) = agent.upgrade() else { return };
        let opts = WatchOptions::new()
            .with_prefix()
            .with_start_revision(rev + 1);
        let stream = c.clone().watch(cfg.prefix(), Some(opts)).await;
        drop(a);
        if let Ok((_watcher, mut stream)) = stream {
            while let Ok(Some(resp)) = stream.message().await {
                let Some(a) = agent.upgrade() else { return };
                for ev in resp.events() {
                    let Some(kv) = ev.kv() else { continue };
                    rev = rev.max(kv.mod_revision());
                    let (a2, key, value, cfg2) = (
                        a.clone(),
                        kv.key().to_vec(),
                        kv.value().to_vec(),
                        cfg.clone(),
                    );
                    let put = ev.event_type() == EventType::Put;
                    // Loading talks to the engine and may probe a peer: off the runtime.
                    let _ = tokio::task::spawn_blocking(move || {
                        if put {
                            load_one(&a2, &key, &value, &cfg2);
                        } else {
                            let name = String::from_utf8_lossy(&key);
                            let name = name.strip_prefix(&cfg2.prefix()).unwrap_or(&name);
                            if name != a2.name() && a2.remove_peer(name).is_ok() {
                                log::info!(
                                    "kvxfer: agent {name:?} left etcd (lease ended): removed"
                                );
                            }
                        }
                    })
                    .await;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        // The watch broke (etcd gone or compacted): list again once etcd answers.
        let Some(a) = agent.upgrade() else { return };
        if let Ok(r) = load_all(&cfg, c.clone(), &a).await {
            rev = r;
        }
    }
}
