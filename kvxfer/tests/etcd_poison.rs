//! Discovery that an etcd writer cannot poison (issue 37), against a real etcd with the shared
//! secret set, the attacker a plain etcd client without it: a deleted key or region update is
//! put back by its live owner within a TTL; an old incarnation's sealed value, replayed under
//! no lease, the attacker's lease or even the old lease's id granted again, is never loaded;
//! two agents' values swapped heal both. Without the `etcd` feature this file is empty;
//! without an etcd binary it says SKIP.
#![cfg(feature = "etcd")]
#![allow(clippy::unwrap_used)] // Tests fail loudly on purpose.

use std::sync::Arc;
use std::time::{Duration, Instant};

#[path = "support/etcd_server.rs"]
mod etcd_server;

use etcd_client::{Client, GetOptions, LeaseGrantOptions, PutOptions};
use etcd_server::Etcd;
use kvxfer::registry::{Discovery, EtcdConfig, EtcdDiscovery};
use kvxfer::{Agent, AgentConfig, Desc, Error, HostBuffer, RegionId, Transport, XferOp};

const LEN: usize = 64 << 10;
const TTL: Duration = Duration::from_secs(2);
const SECRET: &[u8] = b"deployment secret";

fn agent(name: &str) -> Arc<Agent> {
    let cfg = AgentConfig::new(name)
        .transport(Transport::Tcp)
        .net_devices("lo")
        .secret(SECRET);
    Arc::new(Agent::new(cfg).unwrap())
}

fn discovery(url: &str, ns: &str) -> Arc<EtcdDiscovery> {
    EtcdDiscovery::connect(EtcdConfig::new(&[url], ns).ttl(TTL)).unwrap()
}

/// An agent with one region of `fill`, published and watching (so that it loads readers).
struct Published {
    agent: Arc<Agent>,
    disc: Arc<EtcdDiscovery>,
    _region: kvxfer::Region,
}

fn publish(url: &str, ns: &str, name: &str, fill: u8) -> Published {
    let agent = agent(name);
    let region = agent.register(HostBuffer::new(LEN).unwrap()).unwrap();
    region.write(0, &vec![fill; LEN]).unwrap();
    let disc = discovery(url, ns);
    disc.publish(&agent).unwrap();
    disc.watch(&agent).unwrap();
    Published {
        agent,
        disc,
        _region: region,
    }
}

/// The attacker: a plain etcd client.
struct Attacker {
    rt: tokio::runtime::Runtime,
    c: Client,
}

impl Attacker {
    fn new(url: &str) -> Attacker {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let c = rt.block_on(Client::connect([url], None)).unwrap();
        Attacker { rt, c }
    }

    /// (value, lease) of `key`.
    fn get(&mut self, key: &str) -> Option<(Vec<u8>, i64)> {
        let r = self.rt.block_on(self.c.get(key, None)).unwrap();
        r.kvs().first().map(|kv| (kv.value().to_vec(), kv.lease()))
    }

    fn keys(&mut self, prefix: &str) -> Vec<String> {
        let opts = GetOptions::new().with_prefix().with_keys_only();
        let r = self.rt.block_on(self.c.get(prefix, Some(opts))).unwrap();
        r.kvs()
            .iter()
            .map(|kv| String::from_utf8_lossy(kv.key()).into_owned())
            .collect()
    }

    fn delete(&mut self, key: &str) {
        self.rt.block_on(self.c.delete(key, None)).unwrap();
    }

    /// Puts `value` at `key`, under `lease` (0: none).
    fn put(&mut self, key: &str, value: &[u8], lease: i64) {
        let opts = (lease != 0).then(|| PutOptions::new().with_lease(lease));
        self.rt.block_on(self.c.put(key, value, opts)).unwrap();
    }

    /// A lease of its own; with `id`, that id (etcd takes any id not in use).
    fn lease(&mut self, id: Option<i64>) -> i64 {
        let opts = id.map(|i| LeaseGrantOptions::new().with_id(i));
        self.rt.block_on(self.c.lease_grant(60, opts)).unwrap().id()
    }
}

fn until(within: Duration, what: &str, mut f: impl FnMut() -> bool) -> Duration {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < within, "{what}: not within {within:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
    t0.elapsed()
}

/// What `hub` reads from `name`'s region 0 (its first byte, all bytes equal).
fn read_fill(hub: &Agent, local: &kvxfer::Region, name: &str) -> kvxfer::Result<u8> {
    let l = hub.prep_local(&[Desc::new(local.id(), 0, LEN as u64)])?;
    let r = hub.prep_remote(name, &[Desc::new(RegionId(0), 0, LEN as u64)])?;
    hub.transfer_all(XferOp::Read, &l, &r, None, Some(Duration::from_secs(5)))?
        .wait()?;
    let mut b = vec![0u8; LEN];
    local.read(0, &mut b)?;
    assert!(b.iter().all(|&x| x == b[0]), "mixed bytes from {name}");
    Ok(b[0])
}

/// A fresh agent that resolves `name` through etcd and reads its region 0.
fn fresh_read(url: &str, ns: &str, me: &str, name: &str) -> kvxfer::Result<u8> {
    let a = agent(me);
    let local = a.register(HostBuffer::new(LEN).unwrap())?;
    let d = discovery(url, ns);
    // A sealed lane serves only peers its agent loaded: publish, so that `name` loads us.
    d.publish(&a)?;
    d.resolve(&a, name)?;
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match read_fill(&a, &local, name) {
            Err(Error::LaneFailed { .. }) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            r => return r,
        }
    }
}

#[test]
fn a_deleted_key_or_update_is_put_back_within_a_ttl() {
    let Some(etcd) = Etcd::start() else { return };
    let url = etcd.url();
    let ns = format!("/kvx-heal-{}", std::process::id());
    let a = publish(&url, &ns, "heal-a", 0x41);
    let late = a.agent.register(HostBuffer::new(LEN).unwrap()).unwrap();
    a.disc.refresh(&a.agent).unwrap();
    let mut x = Attacker::new(&url);
    let base = format!("{ns}/agents/heal-a");
    let update = x
        .keys(&format!("{ns}/regions/heal-a/"))
        .pop()
        .expect("the late region's update");
    let (want_base, lease) = x.get(&base).unwrap();
    let (want_update, _) = x.get(&update).unwrap();
    for key in [&base, &update] {
        x.delete(key);
        let want = if *key == base {
            &want_base
        } else {
            &want_update
        };
        let t = until(TTL, &format!("{key} put back"), || {
            x.get(key) == Some((want.clone(), lease))
        });
        println!("{key} deleted: put back after {t:?} (TTL {TTL:?})");
    }
    assert!(a.disc.healed() >= 2, "healed {}", a.disc.healed());
    assert_eq!(
        fresh_read(&url, &ns, "heal-reader", "heal-a").unwrap(),
        0x41
    );
    drop(late);
}

#[test]
fn old_values_replayed_or_swapped_are_never_loaded_and_heal() {
    let Some(etcd) = Etcd::start() else { return };
    let url = etcd.url();
    let ns = format!("/kvx-replay-{}", std::process::id());
    let mut x = Attacker::new(&url);
    let key = format!("{ns}/agents/rp-a");
    // An incarnation that published, then left (its lease revoked with it).
    let (old, old_lease) = {
        let a1 = publish(&url, &ns, "rp-a", 0x11);
        let v = x.get(&key).unwrap();
        drop(a1);
        v
    };
    until(TTL, "the old incarnation's key gone", || {
        x.get(&key).is_none()
    });
    // Replayed with no one alive under the name: under no lease, and under a lease of the
    // attacker's. No reader loads it.
    for lease in [0, x.lease(None)] {
        x.put(&key, &old, lease);
        let e = fresh_read(&url, &ns, "rp-reader", "rp-a").unwrap_err();
        assert!(matches!(e, Error::Auth { .. }), "lease {lease}: {e}");
        println!("old value replayed under lease {lease:#x}: {e}");
    }
    // A new incarnation takes the name over (nothing valid holds it), and a second agent.
    let a2 = publish(&url, &ns, "rp-a", 0x22);
    let b = publish(&url, &ns, "rp-b", 0x33);
    let kb = format!("{ns}/agents/rp-b");
    let (va, la) = x.get(&key).unwrap();
    let (vb, lb) = x.get(&kb).unwrap();
    // A watcher that has both loaded, to see that it never loads the old incarnation.
    let w = agent("rp-watcher");
    let wd = discovery(&url, &ns);
    wd.publish(&w).unwrap();
    wd.watch(&w).unwrap();
    until(TTL, "the watcher loads rp-a", || {
        w.peer_epoch("rp-a") == Some(a2.agent.epoch())
    });
    // Swapped, with their leases: neither opens under the other's key; both are put back.
    x.put(&key, &vb, lb);
    x.put(&kb, &va, la);
    let t = until(TTL, "both values put back", || {
        x.get(&key) == Some((va.clone(), la)) && x.get(&kb) == Some((vb.clone(), lb))
    });
    println!("values of rp-a and rp-b swapped: both put back after {t:?}");
    // The old value under the old lease's id, granted again (etcd takes any free id): it
    // opens, but its incarnation is dead; the live one puts its value back.
    let again = x.lease(Some(old_lease));
    assert_eq!(again, old_lease);
    x.put(&key, &old, old_lease);
    let t0 = Instant::now();
    let mut seen_old = false;
    while t0.elapsed() < Duration::from_secs(1) {
        seen_old |= w.peer_epoch("rp-a") != Some(a2.agent.epoch());
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(!seen_old, "the watcher loaded the old incarnation");
    assert_eq!(x.get(&key), Some((va.clone(), la)), "the old value stayed");
    for (name, fill) in [("rp-a", 0x22), ("rp-b", 0x33)] {
        assert_eq!(
            fresh_read(&url, &ns, &format!("rp-c-{name}"), name).unwrap(),
            fill
        );
    }
    assert!(a2.disc.healed() >= 2 && b.disc.healed() >= 1);
}

/// An agent without a secret (the churn and size cases need values that decode).
fn open_agent(name: &str) -> Arc<Agent> {
    let cfg = AgentConfig::new(name)
        .transport(Transport::Tcp)
        .net_devices("lo");
    Arc::new(Agent::new(cfg).unwrap())
}

#[test]
fn a_namespace_larger_than_a_response_lists_and_watches_recover() {
    let Some(mut etcd) = Etcd::start() else {
        return;
    };
    let url = etcd.url();
    let ns = format!("/kvx-big-{}", std::process::id());
    let n = open_agent("big-n");
    let nd = discovery(&url, &ns);
    nd.publish(&n).unwrap();
    // An agent's own notes are small and few.
    assert!(nd.note(&n, "blob", &vec![b'x'; 65 << 10]).is_err());
    for i in 0..64 {
        nd.note(&n, &format!("n-{i}"), b"small").unwrap();
    }
    assert!(nd.note(&n, "n-64", b"small").is_err());
    nd.note(&n, "n-3", b"replaced").unwrap();
    let mut x = Attacker::new(&url);
    // Four 1.2 MiB notes written by someone else: 4.9 MB in the namespace, over the client's
    // 4 MiB response limit (a watcher lists no notes now).
    for i in 0..4 {
        x.put(
            &format!("{ns}/notes/big-n/blob-{i}"),
            &vec![b'x'; 1_200_000],
            0,
        );
    }
    // Four values over the watcher's limit under agents' keys (4.8 MB of agents alone): the
    // listing takes them in pages, and none is opened.
    for i in 0..4 {
        x.put(&format!("{ns}/agents/huge-{i}"), &vec![7u8; 1_200_000], 0);
    }
    let w = open_agent("big-w");
    let wd = discovery(&url, &ns);
    let t0 = Instant::now();
    wd.watch(&w).unwrap();
    println!("a watcher joined a 9.7 MB namespace in {:?}", t0.elapsed());
    assert!(w.peer_epoch("big-n").is_some(), "big-n not loaded");
    assert!(
        w.peer_epoch("huge").is_none(),
        "the oversized value was loaded"
    );
    // etcd restarts: the watch breaks, the watcher lists again and finds a newcomer.
    etcd.stop();
    std::thread::sleep(Duration::from_millis(300));
    etcd.run();
    let m = open_agent("big-m");
    let md = discovery(&url, &ns);
    md.publish(&m).unwrap();
    let t = until(
        Duration::from_secs(20),
        "the newcomer found after etcd came back",
        || w.peer_epoch("big-m") == Some(m.epoch()),
    );
    println!("etcd restarted: the newcomer found after {t:?}");
    // 3,000 put-and-delete cycles of valid updates of names that never publish: nothing is
    // left waiting (before: an entry per name, 1.7 MB of RSS).
    let mut x = Attacker::new(&url);
    let update = kvxfer_proto::wire::metadata::RegionMeta {
        id: RegionId(0),
        kind: kvxfer::MemKind::Host,
        base: 0x1000,
        len: 4096,
        rkey: vec![1; 8],
        shm: None,
    }
    .encode();
    let keys: Vec<String> = (0..3000)
        .map(|i| format!("{ns}/regions/ghost-{i}/0000000000000001/0"))
        .collect();
    let mut most = 0;
    for chunk in keys.chunks(100) {
        for k in chunk {
            x.put(k, &update, 0);
        }
        most = most.max(wd.watch_counts().pending_updates);
        for k in chunk {
            x.delete(k);
        }
    }
    until(Duration::from_secs(10), "nothing left waiting", || {
        let c = wd.watch_counts();
        c.pending_updates == 0 && c.pending_agents == 0
    });
    println!(
        "3,000 put-and-delete cycles: at most {most} updates waiting, 0 after; {:?}",
        wd.watch_counts()
    );
    assert!(most <= 4096);
}

#[test]
fn a_port_that_only_accepts_connections_does_not_hold_a_name() {
    let Some(etcd) = Etcd::start() else { return };
    let url = etcd.url();
    let ns = format!("/kvx-squat-{}", std::process::id());
    let mut x = Attacker::new(&url);
    let key = format!("{ns}/agents/sq-a");
    // An incarnation that published and left; its value and lease id are on record.
    let (old, old_lease, old_lane) = {
        let a1 = publish(&url, &ns, "sq-a", 0x51);
        let (v, l) = x.get(&key).unwrap();
        let meta = kvxfer_proto::wire::metadata::Metadata::decode(
            &a1.agent.metadata().unwrap(),
            a1.agent.compat(),
        )
        .unwrap();
        (v, l, meta.tcp_lane().unwrap().addr)
    };
    until(TTL, "the old incarnation's key gone", || {
        x.get(&key).is_none()
    });
    // Something else now listens on the old lane's port and accepts every connection; the
    // old value is replayed under the old lease's id, granted again (so it opens).
    let squatter = std::net::TcpListener::bind(old_lane).unwrap();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for c in squatter.incoming().flatten() {
            held.push(c);
        }
    });
    assert_eq!(x.lease(Some(old_lease)), old_lease);
    x.put(&key, &old, old_lease);
    // The name's new incarnation starts: the squatter proves nothing, so it is not a live
    // holder (before: "is taken by a live agent" because the port accepted a connection).
    let t0 = Instant::now();
    let a2 = publish(&url, &ns, "sq-a", 0x52);
    println!(
        "a replayed value whose lane port a squatter holds: the new incarnation published in {:?}",
        t0.elapsed()
    );
    assert_ne!(x.get(&key).unwrap().0, old);
    assert_eq!(fresh_read(&url, &ns, "sq-reader", "sq-a").unwrap(), 0x52);
    // The live incarnation proves itself: a third one of the name is refused.
    let a3 = agent("sq-a");
    let e = discovery(&url, &ns).publish(&a3).unwrap_err();
    assert!(matches!(e, Error::NameConflict { .. }), "{e}");
    drop(a2);
}

#[test]
fn etcd_with_authentication_on_works_end_to_end() {
    let Some(etcd) = Etcd::start() else { return };
    let url = etcd.url();
    let ns = format!("/kvx-auth-{}", std::process::id());
    // etcd's own authentication: a root user, and a user "kvx" that may read and write only
    // the deployment's namespace.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut c = Client::connect([url.as_str()], None).await.unwrap();
        c.user_add("root", "root-pw", None).await.unwrap();
        c.user_grant_role("root", "root").await.unwrap();
        c.role_add("kvx").await.unwrap();
        let perm = etcd_client::Permission::read_write(ns.as_str()).with_prefix();
        c.role_grant_permission("kvx", perm).await.unwrap();
        c.user_add("kvx", "kvx-pw", None).await.unwrap();
        c.user_grant_role("kvx", "kvx").await.unwrap();
        c.auth_enable().await.unwrap();
    });
    let with_user = url.replace("http://", "http://kvx:kvx-pw@");
    let member = |name: &str, fill: u8| {
        let a = agent(name);
        let r = a.register(HostBuffer::new(LEN).unwrap()).unwrap();
        r.write(0, &vec![fill; LEN]).unwrap();
        let d = EtcdDiscovery::connect(EtcdConfig::new(&[&with_user], &ns).ttl(TTL)).unwrap();
        d.publish(&a).unwrap();
        d.watch(&a).unwrap();
        (a, d, r)
    };
    let (a, _ad, _ar) = member("auth-a", 0x61);
    let (b, _bd, _br) = member("auth-b", 0x62);
    let local = b.register(HostBuffer::new(LEN).unwrap()).unwrap();
    until(Duration::from_secs(5), "auth-b reads auth-a", || {
        read_fill(&b, &local, "auth-a").ok() == Some(0x61)
    });
    // The healing works under the user too.
    let mut admin = rt.block_on(async {
        let o = etcd_client::ConnectOptions::new().with_user("root", "root-pw");
        Client::connect([url.as_str()], Some(o)).await.unwrap()
    });
    let key = format!("{ns}/agents/auth-a");
    rt.block_on(admin.delete(key.as_str(), None)).unwrap();
    until(TTL, "auth-a's key put back", || {
        rt.block_on(admin.get(key.as_str(), None)).unwrap().count() == 1
    });
    // Without the user, or with a wrong password, nothing is published or read: typed.
    let x = agent("auth-x");
    match EtcdDiscovery::connect(EtcdConfig::new(&[&url], &ns).ttl(TTL)) {
        Ok(d) => {
            let e = d.publish(&x).unwrap_err();
            assert!(matches!(e, Error::Registry { .. }), "{e}");
            println!("no user: {e}");
        }
        Err(e) => println!("no user: {e}"),
    }
    let wrong = url.replace("http://", "http://kvx:wrong@");
    let e = EtcdDiscovery::connect(EtcdConfig::new(&[&wrong], &ns).ttl(TTL)).unwrap_err();
    assert!(matches!(e, Error::Registry { .. }), "{e}");
    assert!(
        !e.to_string().contains("wrong"),
        "the password is in the error: {e}"
    );
    println!("wrong password: {e}");
    drop(a);
}

#[test]
fn etcd_over_tls_works_end_to_end() {
    let Some(etcd) = Etcd::start_tls() else {
        return;
    };
    let url = etcd.url();
    let ca = etcd.ca().unwrap();
    let ns = format!("/kvx-tls-{}", std::process::id());
    // Through a discovery URL, as C and the plugin give it.
    let disc = kvxfer::registry::DiscoveryConfig::parse(
        &format!(
            "{}?ca={}",
            url.replace("https://", "etcds://"),
            ca.display()
        ),
        &ns,
        TTL,
    )
    .unwrap();
    let cfg = |name: &str| {
        AgentConfig::new(name)
            .transport(Transport::Tcp)
            .net_devices("lo")
            .secret(SECRET)
    };
    let a = kvxfer::registry::join(cfg("tls-a"), disc.clone()).unwrap();
    let r = a.register(HostBuffer::new(LEN).unwrap()).unwrap();
    r.write(0, &vec![0x71; LEN]).unwrap();
    let b = kvxfer::registry::join(cfg("tls-b"), disc).unwrap();
    let local = b.register(HostBuffer::new(LEN).unwrap()).unwrap();
    let t = until(Duration::from_secs(10), "tls-b reads tls-a", || {
        read_fill(b.agent(), &local, "tls-a").ok() == Some(0x71)
    });
    println!("two agents found each other through etcd over TLS; read after {t:?}");
    // Plain HTTP to a TLS etcd, or TLS without its CA: refused, typed.
    let plain = url.replace("https://", "http://");
    assert!(EtcdDiscovery::connect(EtcdConfig::new(&[&plain], &ns)).is_err());
    let e = EtcdDiscovery::connect(EtcdConfig::new(&[&url], &ns)).unwrap_err();
    assert!(matches!(e, Error::Registry { .. }), "{e}");
    println!("without the CA: {e}");
}
