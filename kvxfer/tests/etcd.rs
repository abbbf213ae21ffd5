//! Discovery through a real etcd (Debian's `etcd-server`; `scripts/test.sh` installs it):
//! agents in separate processes find each other by name and move verified bytes; a worker
//! killed with SIGKILL is gone within its lease TTL and transfers to it fail typed; a worker
//! restarted under its name is reached at its new epoch with nothing of the old one used; a
//! second live worker taking a name is refused; etcd stopped and restarted while transfers go
//! on; etcd absent at start. etcd runs on free ports with its data in a temporary folder and
//! is stopped at the end. Without the `etcd` feature this file is empty; without an etcd
//! binary it says SKIP.
#![cfg(feature = "etcd")]
#![allow(clippy::unwrap_used)] // Tests fail loudly on purpose.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[path = "support/etcd_server.rs"]
mod etcd_server;

use etcd_server::{free_port, Etcd};
use kvxfer::registry::{join, Discovery, DiscoveryConfig, EtcdConfig, EtcdDiscovery};
use kvxfer::{Agent, AgentConfig, Desc, Error, HostBuffer, RegionId, Transport, XferOp};

const LEN: usize = 64 << 10;
const TTL: Duration = Duration::from_secs(2);

fn agent(name: &str) -> Arc<Agent> {
    Arc::new(
        Agent::new(
            AgentConfig::new(name)
                .transport(Transport::Tcp)
                .net_devices("lo"),
        )
        .unwrap(),
    )
}

fn discovery(url: &str, ns: &str) -> Arc<EtcdDiscovery> {
    EtcdDiscovery::connect(EtcdConfig::new(&[url], ns).ttl(TTL)).unwrap()
}

/// A worker process: this test binary again, running `worker_child`, driven by lines on its
/// stdin.
struct Worker {
    child: Child,
    out: BufReader<std::process::ChildStdout>,
}

impl Worker {
    /// Starts worker `name` whose region holds `fill`; waits until it is published (or says
    /// why not: `Err` with its words).
    fn start(url: &str, ns: &str, name: &str, fill: u8) -> Result<Worker, String> {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "worker_child",
                "--ignored",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env("KVX_ETCD_WORKER", format!("{url} {ns} {name} {fill}"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        // Owned at once: dropped (killed and waited for) on every path.
        let mut w = Worker { child, out };
        let line = w.line("READY ", "REFUSED ")?;
        let _ = line;
        Ok(w)
    }

    /// The rest of the first line holding `ok` (Ok) or `refused` (Err).
    fn line(&mut self, ok: &str, refused: &str) -> Result<String, String> {
        let mut line = String::new();
        loop {
            line.clear();
            if self.out.read_line(&mut line).unwrap() == 0 {
                return Err("the worker ended without a word".into());
            }
            // libtest prints "test worker_child ... " before the worker's words, on one line.
            if let Some((_, rest)) = line.split_once(ok) {
                return Ok(rest.trim().to_string());
            }
            if let Some((_, why)) = line.split_once(refused) {
                return Err(why.trim().to_string());
            }
        }
    }

    /// Sends the worker a command; its answer.
    fn ask(&mut self, cmd: &str) -> Result<String, String> {
        let stdin = self.child.stdin.as_mut().unwrap();
        writeln!(stdin, "{cmd}").unwrap();
        stdin.flush().unwrap();
        self.line("ANSWER ", "FAILED ")
    }

    fn kill(mut self) {
        // SAFETY: kill(2) on our own child's pid; no memory is involved.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGKILL) };
        let _ = self.child.wait();
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A worker: an agent with one region of `fill`, published in etcd, watching the namespace,
/// doing what its stdin says until it closes: `read NAME` (what NAME's region 0 holds, read
/// through etcd's metadata) and `register FILL` (a second region, registered after
/// publishing). Started by `Worker::start`; does nothing in a normal run.
#[test]
#[ignore = "a worker process of the etcd tests, started by them"]
fn worker_child() {
    let Ok(spec) = std::env::var("KVX_ETCD_WORKER") else {
        return;
    };
    let v: Vec<&str> = spec.split(' ').collect();
    let (url, ns, name, fill) = (v[0], v[1], v[2], v[3].parse::<u8>().unwrap());
    let a = agent(name);
    let r = a.register(HostBuffer::new(LEN).unwrap()).unwrap();
    r.write(0, &vec![fill; LEN]).unwrap();
    let local = a.register(HostBuffer::new(LEN).unwrap()).unwrap();
    let d = discovery(url, ns);
    match d.publish(&a).and_then(|()| d.watch(&a)) {
        Ok(()) => println!("READY {:#x}", a.epoch()),
        Err(e) => {
            println!("REFUSED {e}");
            return;
        }
    }
    let mut kept = Vec::new();
    for line in std::io::stdin().lines() {
        let Ok(line) = line else { return };
        let w: Vec<&str> = line.split(' ').collect();
        let answer = match w.as_slice() {
            ["read", peer] => read_fill(&a, &local, peer).map(|f| f.to_string()),
            ["read", peer, region] => {
                read_region(&a, &local, peer, RegionId(region.parse().unwrap()))
                    .map(|f| f.to_string())
            }
            ["register", f] => {
                let f = f.parse::<u8>().unwrap();
                let r = a.register(HostBuffer::new(LEN).unwrap()).unwrap();
                r.write(0, &vec![f; LEN]).unwrap();
                let id = r.id().0;
                kept.push(r);
                Ok(id.to_string())
            }
            _ => Ok(format!("unknown command {line:?}")),
        };
        match answer {
            Ok(x) => println!("ANSWER {x}"),
            Err(e) => println!("FAILED {e}"),
        }
    }
}

/// What `hub` reads from `name`'s region 0 (its first byte, all bytes checked equal).
fn read_fill(hub: &Agent, local: &kvxfer::Region, name: &str) -> kvxfer::Result<u8> {
    read_region(hub, local, name, RegionId(0))
}

/// What `hub` reads from `name`'s region `region`.
fn read_region(
    hub: &Agent,
    local: &kvxfer::Region,
    name: &str,
    region: RegionId,
) -> kvxfer::Result<u8> {
    let l = hub.prep_local(&[Desc::new(local.id(), 0, LEN as u64)])?;
    let r = hub.prep_remote(name, &[Desc::new(region, 0, LEN as u64)])?;
    hub.transfer_all(XferOp::Read, &l, &r, None, Some(Duration::from_secs(5)))?
        .wait()?;
    let mut b = vec![0u8; LEN];
    local.read(0, &mut b)?;
    assert!(b.iter().all(|&x| x == b[0]), "mixed bytes from {name}");
    Ok(b[0])
}

fn until<T>(within: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> (T, Duration) {
    let t0 = Instant::now();
    loop {
        if let Some(x) = f() {
            return (x, t0.elapsed());
        }
        assert!(t0.elapsed() < within, "{what}: not within {within:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The raw values under `prefix`, as any etcd reader sees them: key, value, mod revision.
fn raw(url: &str, prefix: &str) -> Vec<(String, Vec<u8>, i64)> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut c = etcd_client::Client::connect([url], None).await.unwrap();
        let r = c
            .get(prefix, Some(etcd_client::GetOptions::new().with_prefix()))
            .await
            .unwrap();
        r.kvs()
            .iter()
            .map(|kv| {
                (
                    String::from_utf8_lossy(kv.key()).into_owned(),
                    kv.value().to_vec(),
                    kv.mod_revision(),
                )
            })
            .collect()
    })
}

fn peer_failed(e: &Error) -> bool {
    matches!(e, Error::PeerFailed { .. })
}

#[test]
fn agents_find_each_other_by_name_through_etcd() {
    let Some(mut etcd) = Etcd::start() else {
        return;
    };
    let url = etcd.url();
    let pid = std::process::id();
    let ns = format!("/kvx-test-{pid}");
    let names: Vec<String> = (1..=4).map(|i| format!("w{i}-{pid}")).collect();
    let mut workers: Vec<Option<Worker>> = names
        .iter()
        .zip(1u8..)
        .map(|(n, f)| Some(Worker::start(&url, &ns, n, f).unwrap()))
        .collect();

    // Four agents in four processes: each reads every other one's bytes, found by name only
    // (no side channel, no address given; the watch had them loaded before the first read).
    let t0 = Instant::now();
    for (i, w) in workers.iter_mut().enumerate() {
        let w = w.as_mut().unwrap();
        for (j, (n, f)) in names.iter().zip(1u8..).enumerate() {
            if i != j {
                let got = w.ask(&format!("read {n}")).unwrap();
                assert_eq!(got, f.to_string(), "worker {} read {n}", i + 1);
            }
        }
    }
    println!(
        "4 agents in 4 processes found each other by name: 12 reads verified in {:?}",
        t0.elapsed()
    );

    // A fifth agent here: published, and watching, it has every worker loaded at once.
    let hub = agent(&format!("hub-{pid}"));
    let local = hub.register(HostBuffer::new(LEN).unwrap()).unwrap();
    let d = discovery(&url, &ns);
    d.publish(&hub).unwrap();
    d.watch(&hub).unwrap();
    for (n, f) in names.iter().zip(1u8..) {
        assert!(hub.peer_info(n).is_ok(), "{n} not loaded by the watch");
        assert_eq!(read_fill(&hub, &local, n).unwrap(), f, "{n}");
    }

    // A registration after publishing goes out as an update (one small key), not the blob
    // again, and watchers apply it.
    let base_key = format!("{ns}/agents/{}", names[0]);
    let before = raw(&url, &base_key);
    let id: u32 = workers[0]
        .as_mut()
        .unwrap()
        .ask("register 81")
        .unwrap()
        .parse()
        .unwrap();
    let (_, t) = until(Duration::from_secs(10), "the new region at the hub", || {
        (read_region(&hub, &local, &names[0], RegionId(id)).ok() == Some(81)).then_some(())
    });
    let updates = raw(&url, &format!("{ns}/regions/{}/", names[0]));
    assert_eq!(updates.len(), 1, "{updates:?}");
    assert!(
        updates[0].0.ends_with(&format!("/{id}")),
        "{}",
        updates[0].0
    );
    assert_eq!(raw(&url, &base_key), before, "the base was put again");
    let w2 = workers[1].as_mut().unwrap();
    let (_, t2) = until(Duration::from_secs(10), "the new region at w2", || {
        (w2.ask(&format!("read {} {id}", names[0])).ok().as_deref() == Some("81")).then_some(())
    });
    println!(
        "a region registered after publishing: one update key of {} bytes (the base, {} bytes, \
         untouched); read at the hub after {t:?}, at w2 after {t2:?}",
        updates[0].1.len(),
        before[0].1.len()
    );

    // A second live worker taking a taken name is refused.
    let why = Worker::start(&url, &ns, &names[1], 0x77).err().unwrap();
    assert!(why.contains("is taken by a live agent"), "{why}");
    assert_eq!(read_fill(&hub, &local, &names[1]).unwrap(), 2);
    println!("a second live {}: {why}", names[1]);

    // SIGKILL: the key goes with the lease, the watch retires the peer, its transfers fail
    // with PeerFailed, at once.
    workers[0].take().unwrap().kill();
    let (_, gone) = until(
        TTL + Duration::from_secs(4),
        "the killed worker retired",
        || read_fill(&hub, &local, &names[0]).err().filter(peer_failed),
    );
    let t = Instant::now();
    let e = read_fill(&hub, &local, &names[0]).unwrap_err();
    assert!(peer_failed(&e), "{e}");
    let fast = t.elapsed();
    assert!(raw(&url, &format!("{ns}/regions/{}/", names[0])).is_empty());
    let w3 = workers[2].as_mut().unwrap();
    let (e3, _) = until(Duration::from_secs(5), "w3 to see w1 gone", || {
        w3.ask(&format!("read {}", names[0])).err()
    });
    assert!(e3.contains("failed"), "{e3}");
    println!("SIGKILLed worker retired {gone:?} after the kill (TTL {TTL:?}); a transfer to it then fails in {fast:?}: {e}; at w3: {e3}");

    // Restarted under its name: reached at its new epoch, with new bytes; nothing of the old
    // incarnation (its late region) is used.
    workers[0] = Some(Worker::start(&url, &ns, &names[0], 0x41).unwrap());
    let (_, t) = until(Duration::from_secs(10), "the restarted worker", || {
        (read_fill(&hub, &local, &names[0]).ok() == Some(0x41)).then_some(())
    });
    let stale = read_region(&hub, &local, &names[0], RegionId(id)).unwrap_err();
    assert!(matches!(stale, Error::UnknownRegion { .. }), "{stale}");
    println!("restarted worker reached at its new epoch after {t:?}; its old region: {stale}");

    // A long pause (SIGSTOP past the TTL): the lease is lost and the key goes; once the worker
    // runs again it takes a new lease and publishes again, and the hub finds it.
    let w2pid = workers[1].as_ref().unwrap().child.id() as i32;
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(w2pid, libc::SIGSTOP) };
    let (_, t) = until(
        TTL + Duration::from_secs(4),
        "the paused worker's key to go",
        || hub.peer_info(&names[1]).is_err().then_some(()),
    );
    // SAFETY: as above.
    unsafe { libc::kill(w2pid, libc::SIGCONT) };
    let (_, back) = until(Duration::from_secs(10), "the paused worker back", || {
        (read_fill(&hub, &local, &names[1]).ok() == Some(2)).then_some(())
    });
    println!("worker paused past its TTL: removed after {t:?}; published again and reached {back:?} after SIGCONT");

    // etcd goes away: loaded peers keep working, and a worker killed meanwhile is retired
    // once etcd is back (its lease runs out there).
    etcd.stop();
    let mut reads = 0;
    for _ in 0..3 {
        assert_eq!(read_fill(&hub, &local, &names[2]).unwrap(), 3);
        assert_eq!(read_fill(&hub, &local, &names[3]).unwrap(), 4);
        reads += 2;
    }
    workers[3].take().unwrap().kill();
    std::thread::sleep(TTL);
    assert_eq!(read_fill(&hub, &local, &names[1]).unwrap(), 2);
    assert_eq!(read_fill(&hub, &local, &names[2]).unwrap(), 3);
    reads += 2;
    etcd.run();
    // Workers publish again, the watch resumes and sees a new worker.
    let w5 = format!("w5-{pid}");
    let _w5 = Worker::start(&url, &ns, &w5, 5).unwrap();
    let (_, t) = until(
        Duration::from_secs(15),
        "a worker started after etcd came back",
        || (read_fill(&hub, &local, &w5).ok() == Some(5)).then_some(()),
    );
    let (_, t3) = until(Duration::from_secs(15), "w3 published again", || {
        d.resolve(&hub, &names[2]).ok()
    });
    let (_, t4) = until(
        TTL + Duration::from_secs(15),
        "w4, killed while etcd was down, retired",
        || read_fill(&hub, &local, &names[3]).err().filter(peer_failed),
    );
    println!("etcd stopped and restarted: {reads} transfers verified while it was down; new worker reached after {t:?}; w3 found again after {t3:?}; w4 (killed meanwhile) retired after {t4:?}");
    drop(workers);
}

#[test]
fn etcd_absent_at_start_is_a_clear_error() {
    let url = format!("http://127.0.0.1:{}", free_port());
    let t0 = Instant::now();
    let e = EtcdDiscovery::connect(EtcdConfig::new(&[&url], "/x")).unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("etcd") && text.contains(&url) && text.contains("unreachable"),
        "{text}"
    );
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    println!("{text} (after {:?})", t0.elapsed());
}

/// With a shared secret, what etcd holds is useless to a reader without it: sealed (no name,
/// worker address, keys or lane secret in the clear), not loadable with another secret or
/// none, and agents that share the secret find each other and move bytes.
#[test]
fn with_a_shared_secret_metadata_in_etcd_is_sealed() {
    let Some(etcd) = Etcd::start() else { return };
    let url = etcd.url();
    let ns = format!("/kvx-sealed-{}", std::process::id());
    let with = |name: &str, secret: Option<&[u8]>| {
        let mut c = AgentConfig::new(name)
            .transport(Transport::Tcp)
            .net_devices("lo");
        if let Some(s) = secret {
            c = c.secret(s);
        }
        Arc::new(Agent::new(c).unwrap())
    };
    let a = with("sealed-a", Some(b"team secret"));
    let r = a.register(HostBuffer::new(LEN).unwrap()).unwrap();
    r.write(0, &vec![0x5a; LEN]).unwrap();
    let d = discovery(&url, &ns);
    d.publish(&a).unwrap();

    // The raw value, as any etcd reader sees it.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let raw = rt.block_on(async {
        let mut c = etcd_client::Client::connect([url.as_str()], None)
            .await
            .unwrap();
        let r = c.get(format!("{ns}/agents/sealed-a"), None).await.unwrap();
        r.kvs()[0].value().to_vec()
    });
    let plain = a.metadata().unwrap();
    assert!(raw.starts_with(b"KXSE"), "not sealed");
    assert!(
        !raw.windows(8).any(|w| w == b"sealed-a"),
        "the name is in the clear"
    );
    assert!(
        !raw.windows(32).any(|w| plain.windows(32).any(|p| p == w)),
        "plain metadata in the value"
    );

    let b = with("sealed-b", Some(b"team secret"));
    let bl = b.register(HostBuffer::new(LEN).unwrap()).unwrap();
    d.resolve(&b, "sealed-a").unwrap();
    // A sealed lane serves only peers its agent loaded (the key in their metadata proves
    // their name): a finds b through etcd too.
    d.publish(&b).unwrap();
    d.resolve(&a, "sealed-b").unwrap();
    assert_eq!(read_fill(&b, &bl, "sealed-a").unwrap(), 0x5a);
    for (name, secret) in [("sealed-c", Some(&b"another"[..])), ("sealed-d", None)] {
        let x = with(name, secret);
        let e = d.resolve(&x, "sealed-a").unwrap_err();
        assert!(matches!(e, Error::Auth { .. }), "{name}: {e}");
        assert!(x.peer_info("sealed-a").is_err(), "{name} loaded it anyway");
        println!("{name}: {e}");
    }
}

/// `kvxfer::registry::join` with a discovery configuration beside the agent's: the agent is
/// created, published and watching; memory registered afterwards reaches the other members
/// as an update.
#[test]
fn an_agent_config_with_discovery_joins_by_name() {
    let Some(etcd) = Etcd::start() else { return };
    let url = etcd.url().replace("http://", "etcd://");
    let ns = format!("/kvx-join-{}", std::process::id());
    let cfg = |name: &str| {
        AgentConfig::new(name)
            .transport(Transport::Tcp)
            .net_devices("lo")
    };
    let disc = DiscoveryConfig::parse(&url, &ns, TTL).unwrap();
    let a = join(cfg("j-a"), disc.clone()).unwrap();
    let r = a.register(HostBuffer::new(LEN).unwrap()).unwrap();
    r.write(0, &vec![0x6a; LEN]).unwrap();
    let b = join(cfg("j-b"), disc).unwrap();
    let local = b.register(HostBuffer::new(LEN).unwrap()).unwrap();
    let (_, t) = until(Duration::from_secs(10), "j-a's region at j-b", || {
        (read_fill(b.agent(), &local, "j-a").ok() == Some(0x6a)).then_some(())
    });
    println!("joined through registry::join; j-a's region read at j-b after {t:?}");
    // A clean exit revokes the lease: the peers retire it at once, not a TTL later.
    drop(a);
    let (e, t) = until(TTL / 2, "j-a retired at j-b", || {
        read_fill(b.agent(), &local, "j-a")
            .err()
            .filter(peer_failed)
    });
    println!("j-a dropped: retired at j-b after {t:?} (TTL {TTL:?}): {e}");
}

/// A peer that found the owner through etcd only (no side channel) is told of the owner's
/// deregistration over the UCX fence: a 16 MiB transfer across it ends or is refused typed,
/// the next one is refused, and the owner, which lets the memory go at once, never crashes.
/// UCX's shared memory with kvxfer's lanes off, where UCX's emulated RMA checks no key on the
/// owner (before the fence such a peer was never told).
#[test]
fn a_deregistration_reaches_a_peer_that_found_the_owner_through_etcd() {
    let Some(etcd) = Etcd::start() else { return };
    let url = etcd.url();
    let ns = format!("/kvx-fence-{}", std::process::id());
    const BIG: usize = 16 << 20;
    let ucx_only = |name: &str| {
        Arc::new(
            Agent::new(
                AgentConfig::new(name)
                    .transport(Transport::Shm)
                    .lanes(false)
                    .ucx_emulated_shm(true),
            )
            .unwrap(),
        )
    };
    let (owner, peer) = (ucx_only("f-owner"), ucx_only("f-peer"));
    let d = discovery(&url, &ns);
    for a in [&owner, &peer] {
        d.publish(a).unwrap();
        d.watch(a).unwrap();
    }
    let buf = peer.register(HostBuffer::new(BIG).unwrap()).unwrap();
    let l = peer
        .prep_local(&[Desc::new(buf.id(), 0, BIG as u64)])
        .unwrap();
    let go = |id: u32, op: XferOp| -> kvxfer::Result<()> {
        let r = peer.prep_remote("f-owner", &[Desc::new(RegionId(id), 0, BIG as u64)])?;
        peer.transfer_all(op, &l, &r, None, Some(Duration::from_secs(20)))?
            .wait()
            .map(|_| ())
    };
    let refused = |r: &kvxfer::Result<()>, id: u32| matches!(r, Err(Error::Deregistered { region }) if *region == id);
    let (mut ok, mut before) = (0, 0);
    for run in 0..10u64 {
        for op in [XferOp::Write, XferOp::Read] {
            let r = owner.register(HostBuffer::new(BIG).unwrap()).unwrap();
            let id = r.id().0;
            // Published again by the owner, loaded by the peer's watch.
            until(Duration::from_secs(10), "the region at the peer", || {
                peer.prep_remote("f-owner", &[Desc::new(RegionId(id), 0, BIG as u64)])
                    .ok()
            });
            let moved = std::thread::scope(|s| {
                let h = s.spawn(|| go(id, op));
                std::thread::sleep(Duration::from_micros((run % 8) * 300));
                owner.deregister(&r).unwrap();
                // The memory goes now: a peer still using it would crash this process.
                drop(r);
                h.join().unwrap()
            });
            match moved {
                Ok(()) => ok += 1,
                ref e if refused(e, id) => before += 1,
                Err(e) => panic!("{op:?} across a deregistration: {e}"),
            }
            let after = go(id, op);
            assert!(
                refused(&after, id),
                "{op:?} after the deregistration: {after:?}"
            );
        }
    }
    println!("through etcd only: 20 transfers across a deregistration, {ok} ended Ok, {before} refused before they began");
    assert!(ok > 0, "no transfer was under way");
}
