//! The UCX fence against a hostile owner (issue 34): an owner that speaks raw UCX to a kvxfer
//! initiator and sends it what it likes. A REFUSED for an entry it welcomed already (or for
//! a token never drawn) changes nothing; a closed entry of the initiator's costs it at most
//! one endpoint made for the owner, whatever the owner sends: a flood of GONEs naming it is
//! answered once (GONE_ACK and BYE), and the rest are dropped.
//!
//! The owner is this test binary again (`hostile_owner_child`): one UCX worker over shared
//! memory, driven by lines on its stdin. It presents a real agent's metadata (its regions'
//! keys) under its own name and worker address.
#![allow(clippy::unwrap_used)] // Tests fail loudly on purpose.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

#[path = "support/raw_ucx.rs"]
mod raw_ucx;

use kvxfer::{Agent, AgentConfig, Desc, HostBuffer, RegionId, Transport, XferOp};
use kvxfer_proto::wire::metadata::Metadata;
use kvxfer_proto::wire::ucx_fence::{FenceMsg, Refusal};
use raw_ucx::{hex, unhex, RawUcx, GOT};

const LEN: usize = 1 << 16;

fn config(name: &str) -> AgentConfig {
    AgentConfig::new(name)
        .transport(Transport::Shm)
        .lanes(false)
        .ucx_emulated_shm(true)
}

/// The hostile owner's process, and the lines it says.
struct Hostile {
    child: Child,
    tell: ChildStdin,
    says: BufReader<ChildStdout>,
}

impl Hostile {
    /// `how`: `1`, or `gone-first` (a GONE for its region before the WELCOME).
    fn start(how: &str) -> Hostile {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "hostile_owner_child", "--ignored", "--nocapture"])
            .env("KVX_HOSTILE_OWNER", how)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let tell = child.stdin.take().unwrap();
        let says = BufReader::new(child.stdout.take().unwrap());
        Hostile { child, tell, says }
    }

    /// The next line starting with `prefix`, less the prefix.
    fn said(&mut self, prefix: &str) -> String {
        let mut l = String::new();
        loop {
            l.clear();
            assert!(
                self.says.read_line(&mut l).unwrap() > 0,
                "the hostile owner ended before saying {prefix:?}"
            );
            if let Some(rest) = l.trim_end().strip_prefix(prefix) {
                return rest.to_string();
            }
        }
    }

    /// Metadata for the hostile owner, named `name`: a real agent's (its wire form, its
    /// compat) with the hostile process's worker address and its one region (its base and
    /// key), so that a kvxfer initiator loads it as any owner's.
    fn metadata(&mut self, name: &str) -> Metadata {
        let real = Agent::new(config("real")).unwrap();
        let _r = real.register(HostBuffer::new(LEN).unwrap()).unwrap();
        let mut meta = Metadata::decode(&real.metadata().unwrap(), real.compat()).unwrap();
        meta.name = name.into();
        meta.epoch ^= 0x5eed;
        meta.worker_addr = unhex(&self.said("WORKER "));
        let region = self.said("REGION ");
        let (base, rkey) = region.split_once(' ').unwrap();
        meta.regions.truncate(1);
        meta.regions[0].base = base.parse().unwrap();
        meta.regions[0].rkey = unhex(rkey);
        meta.regions[0].shm = None;
        meta
    }

    fn tell(&mut self, line: &str) {
        writeln!(self.tell, "{line}").unwrap();
        self.tell.flush().unwrap();
    }
}

impl Drop for Hostile {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An owner serving a region of `LEN` bytes of 0x5a and a good peer prepared to READ it
/// whole into its own region (both over UCX's shared memory).
struct OwnerAndGood {
    owner: Agent,
    r: kvxfer::Region,
    good: Agent,
    local: kvxfer::Region,
    l: kvxfer::PreparedLocal,
    rr: kvxfer::PreparedRemote,
}

impl OwnerAndGood {
    fn new() -> OwnerAndGood {
        let owner = Agent::new(config("owner")).unwrap();
        let r = owner.register(HostBuffer::new(LEN).unwrap()).unwrap();
        r.write(0, &vec![0x5a; LEN]).unwrap();
        let good = Agent::new(config("good")).unwrap();
        let local = good.register(HostBuffer::new(LEN).unwrap()).unwrap();
        let oname = good
            .load_remote_metadata(&owner.metadata().unwrap())
            .unwrap();
        let l = good
            .prep_local(&[Desc::new(local.id(), 0, LEN as u64)])
            .unwrap();
        let rr = good
            .prep_remote(&oname, &[Desc::new(r.id(), 0, LEN as u64)])
            .unwrap();
        OwnerAndGood {
            owner,
            r,
            good,
            local,
            l,
            rr,
        }
    }
}

/// An owner that welcomed an initiator says REFUSED after all: ignored. The initiator
/// closes its entry, and the owner sends 200 GONEs for it: the initiator answers the first (a GONE_ACK and a BYE, over an endpoint made for them) and
/// drops the rest, and still serves its other peers.
#[test]
fn a_hostile_owners_late_refusals_and_gone_floods_change_nothing() {
    let mut hostile = Hostile::start("1");
    let meta = hostile.metadata("hostile");
    let a = Agent::new(config("initiator")).unwrap();
    let local = a.register(HostBuffer::new(LEN).unwrap()).unwrap();
    let name = a.load_remote_metadata(&meta.encode()).unwrap();
    // Connecting announces the initiator (HELLO); the hostile owner welcomes it.
    a.peer_info(&name).unwrap();
    let hello = hostile.said("HELLO ");
    eprintln!("the hostile owner got a HELLO: {hello}");
    // A READ posts only after the WELCOME: the entry is welcomed once it is done.
    let l = a
        .prep_local(&[Desc::new(local.id(), 0, LEN as u64)])
        .unwrap();
    let rr = a
        .prep_remote(&name, &[Desc::new(RegionId(0), 0, LEN as u64)])
        .unwrap();
    a.transfer_all(XferOp::Read, &l, &rr, None, Some(Duration::from_secs(10)))
        .unwrap()
        .wait()
        .unwrap();
    let mut bytes = vec![0u8; LEN];
    local.read(0, &mut bytes).unwrap();
    assert!(
        bytes.iter().all(|&b| b == 0x77),
        "READ bytes from the hostile owner"
    );
    // A REFUSED for an entry already welcomed (and for tokens never drawn) changes nothing:
    // the next READ posts at once.
    hostile.tell("REFUSE");
    hostile.said("REFUSED");
    std::thread::sleep(Duration::from_millis(100));
    local.write(0, &vec![0; LEN]).unwrap();
    let again = a
        .transfer_all(XferOp::Read, &l, &rr, None, Some(Duration::from_secs(5)))
        .and_then(|x| x.wait());
    assert!(
        again.is_ok(),
        "a READ after REFUSEDs for a welcomed entry: {again:?}"
    );
    local.read(0, &mut bytes).unwrap();
    assert!(
        bytes.iter().all(|&b| b == 0x77),
        "READ bytes after the REFUSEDs"
    );
    // Closed with nothing in flight: BYE, and the entry remembered for one answer.
    a.remove_peer(&name).unwrap();
    hostile.tell("GONE 200");
    let got = hostile.said("GOT ");
    eprintln!("after 200 GONEs for the closed entry, the hostile owner got: {got}");
    let mut w = got.split(' ').map(|n| n.parse::<usize>().unwrap());
    let (acks, byes) = (w.next().unwrap(), w.next().unwrap());
    assert_eq!(acks, 1, "GONE_ACKs for one closed entry (BYEs {byes})");
    assert!(byes <= 2, "{byes} BYEs for one closed entry");
    // The initiator still serves a good owner.
    let good = Agent::new(config("good")).unwrap();
    let g = good.register(HostBuffer::new(LEN).unwrap()).unwrap();
    g.write(0, &vec![0x33; LEN]).unwrap();
    let gname = a.load_remote_metadata(&good.metadata().unwrap()).unwrap();
    let gr = a
        .prep_remote(&gname, &[Desc::new(g.id(), 0, LEN as u64)])
        .unwrap();
    a.transfer_all(XferOp::Read, &l, &gr, None, Some(Duration::from_secs(10)))
        .unwrap()
        .wait()
        .unwrap();
    local.read(0, &mut bytes).unwrap();
    assert!(
        bytes.iter().all(|&b| b == 0x33),
        "READ bytes from the good owner"
    );
}

/// An owner that was deregistering a region when this initiator's HELLO came sends its
/// GONE before the WELCOME, on the same endpoint. The initiator refuses the region from then
/// on and answers the GONE once welcomed (a GONE_ACK needs the WELCOME's `ack`): the
/// owner's deregistration does not wait for it to its deadline and end `Busy`. Before, the
/// initiator dropped that answer (seen in CI as a 10 s `Busy` in `ucx_deregister`'s reload
/// test).
#[test]
fn a_gone_before_the_welcome_is_answered_once_welcomed() {
    let mut hostile = Hostile::start("gone-first");
    let meta = hostile.metadata("owner");
    let a = Agent::new(config("initiator")).unwrap();
    let local = a.register(HostBuffer::new(LEN).unwrap()).unwrap();
    let name = a.load_remote_metadata(&meta.encode()).unwrap();
    a.peer_info(&name).unwrap();
    hostile.said("HELLO ");
    let early = hostile.said("EARLY_ACK ");
    eprintln!("a GONE before the WELCOME: GONE_ACKs {early}");
    let acks: usize = early.split(' ').next().unwrap().parse().unwrap();
    assert_eq!(
        acks, 1,
        "GONE_ACKs for a GONE that came before the WELCOME: {early}"
    );
    // And the region is refused from then on.
    let l = a
        .prep_local(&[Desc::new(local.id(), 0, LEN as u64)])
        .unwrap();
    let refused = a
        .prep_remote(&name, &[Desc::new(RegionId(0), 0, LEN as u64)])
        .and_then(|rr| a.transfer_all(XferOp::Read, &l, &rr, None, Some(Duration::from_secs(5))))
        .and_then(|x| x.wait());
    assert!(
        matches!(refused, Err(kvxfer::Error::Deregistered { region: 0 })),
        "a READ of the region its GONE named: {refused:?}"
    );
}

/// A HELLO naming a good peer's worker and a process that has exited: the owner takes it in
/// over the endpoint back it keeps for the good peer, and drops it at the next HELLO (the
/// process is gone); the good peer's entry keeps that endpoint, so a deregistration still
/// tells it, waits for its answer, and the good peer refuses the region from then on.
#[test]
fn a_hello_naming_a_good_peers_worker_and_an_exited_process_leaves_that_peer_fenced() {
    let OwnerAndGood {
        owner,
        r,
        good,
        local: _local,
        l,
        rr,
    } = OwnerAndGood::new();
    let read = || {
        good.transfer_all(XferOp::Read, &l, &rr, None, Some(Duration::from_secs(10)))
            .and_then(|x| x.wait())
    };
    read().unwrap();
    // A process that has exited, for the HELLO to name.
    let mut exited = Command::new("true").spawn().unwrap();
    let pid = exited.id();
    exited.wait().unwrap();
    let om = Metadata::decode(&owner.metadata().unwrap(), owner.compat()).unwrap();
    let gm = Metadata::decode(&good.metadata().unwrap(), good.compat()).unwrap();
    let host = om.host.unwrap();
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "hostile_initiator_child",
            "--ignored",
            "--nocapture",
        ])
        .env(
            "KVX_HOSTILE_HELLO",
            format!(
                "{} {} {pid} {} {}",
                hex(&om.worker_addr),
                hex(&gm.worker_addr),
                hex(&host.boot_id),
                host.pid_ns
            ),
        )
        .stderr(Stdio::inherit())
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("SENT"),
        "the hostile initiator: {out:?}"
    );
    // The owner deregisters: the good peer is told and answers; it then refuses the region.
    let t = Instant::now();
    owner.deregister(&r).unwrap();
    eprintln!("deregistered in {:?}", t.elapsed());
    let again = read();
    eprintln!("the good peer's READ of the deregistered region: {again:?}");
    assert!(
        matches!(again, Err(kvxfer::Error::Deregistered { .. })),
        "the good peer was not told of the deregistration: {again:?}"
    );
}

fn metric(a: &Agent, name: &str) -> u64 {
    let text = a.prometheus();
    text.lines()
        .find(|l| l.starts_with(&format!("{name}{{")))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("{name} not in\n{text}"))
}

/// The largest fence message a peer may send (a WELCOME naming the most gone regions).
const FLOOD_MSG: usize = kvxfer_proto::wire::ucx_fence::MAX_ENCODED;

/// A raw UCX peer floods an owner's worker with the largest fence messages it takes
/// (garbage of 524 KB, 300 of them): the owner's engine copies them out of UCX a batch at
/// a time (1 MiB, plus what one progress call delivers) and handles each batch before it
/// takes more, so what a peer makes it hold stays bounded however fast it sends. A good
/// peer's READs go on during the flood and after it.
#[test]
fn a_flood_of_the_largest_fence_messages_is_held_a_batch_at_a_time() {
    let OwnerAndGood {
        owner,
        r: _r,
        good,
        local,
        l,
        rr,
    } = OwnerAndGood::new();
    let read = || {
        let t = Instant::now();
        good.transfer_all(XferOp::Read, &l, &rr, None, Some(Duration::from_secs(10)))
            .and_then(|x| x.wait())
            .map(|_| t.elapsed())
    };
    let quiet: Vec<Duration> = (0..20).map(|_| read().unwrap()).collect();
    let om = Metadata::decode(&owner.metadata().unwrap(), owner.compat()).unwrap();
    let mut flood = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "hostile_flood_child", "--ignored", "--nocapture"])
        .env("KVX_HOSTILE_FLOOD", format!("{} 300", hex(&om.worker_addr)))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut during = Vec::new();
    while flood.try_wait().unwrap().is_none() {
        during.push(read().unwrap());
    }
    let mut out = String::new();
    flood
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    assert!(out.contains("SENT 300"), "the flood: {out}");
    let after = read().unwrap();
    let mut s = vec![0u8; LEN];
    local.read(0, &mut s).unwrap();
    s.dedup();
    assert_eq!(s, [0x5a], "the good peer's READ brought other bytes");
    let median = |v: &mut Vec<Duration>| {
        v.sort();
        v.get(v.len() / 2).copied()
    };
    let peak = metric(&owner, "kvxfer_ucx_am_batch_peak_bytes");
    eprintln!(
        "good READs of 64 KiB: quiet median {:?}, during the flood {:?} ({} of them), after \
         {after:?}; the most held at once: {peak} bytes",
        median(&mut quiet.clone()),
        median(&mut during),
        during.len()
    );
    // The flood arrived (its messages were copied, then dropped as malformed)...
    assert!(peak >= FLOOD_MSG as u64, "no flood message came: {peak}");
    // ...and at most a batch of them, and what one progress call brings, was held at once.
    assert!(
        peak <= (1 << 20) + 2 * FLOOD_MSG as u64,
        "{peak} bytes of active messages held at once"
    );
}

/// The flooding peer's process (run by the test above; ignored otherwise): `n` fence
/// messages of the largest size, garbage past their magic, to the worker named.
#[test]
#[ignore = "the hostile flooder's own process, started by the tests here"]
fn hostile_flood_child() {
    let Ok(spec) = std::env::var("KVX_HOSTILE_FLOOD") else {
        return;
    };
    let (worker, n) = spec.split_once(' ').unwrap();
    let n: usize = n.parse().unwrap();
    let ucx = RawUcx::new();
    let ep = ucx.connect(&unhex(worker));
    let mut msg = vec![0u8; FLOOD_MSG];
    msg[..3].copy_from_slice(b"KF\xee");
    for _ in 0..n {
        ucx.send_bytes(ep, raw_ucx::AM_FENCE, &msg);
    }
    ucx.progress_for(Duration::from_millis(100));
    println!("SENT {n}");
}

/// The hostile initiator's process (run by the test above; ignored otherwise): to the
/// owner's worker, a HELLO naming the good peer's worker and the exited process, then, once
/// the owner's pidfd poll is due again, a HELLO of its own, and its BYE once welcomed.
#[test]
#[ignore = "the hostile initiator's own process, started by the tests here"]
fn hostile_initiator_child() {
    use kvxfer_proto::types::HostInfo;
    let Ok(spec) = std::env::var("KVX_HOSTILE_HELLO") else {
        return;
    };
    let mut w = spec.split(' ');
    let owner = unhex(w.next().unwrap());
    let good = unhex(w.next().unwrap());
    let pid: u32 = w.next().unwrap().parse().unwrap();
    let boot_id: [u8; 16] = unhex(w.next().unwrap()).try_into().unwrap();
    let pid_ns: u64 = w.next().unwrap().parse().unwrap();
    let ucx = RawUcx::new();
    let ep = ucx.connect(&owner);
    ucx.send(
        ep,
        FenceMsg::Hello {
            token: 0x11a5,
            name: "liar".into(),
            host: Some(HostInfo {
                boot_id,
                pid_ns,
                pid,
            }),
            worker: good,
        },
    );
    ucx.progress_for(Duration::from_millis(100));
    ucx.send(
        ep,
        FenceMsg::Hello {
            token: 0x11a6,
            name: "next".into(),
            host: None,
            worker: ucx.address(),
        },
    );
    // Its own entry says BYE once welcomed, so that the owner waits for nobody silent.
    let ack = ucx.wait_for(Duration::from_secs(10), |m| match m {
        FenceMsg::Welcome {
            token: 0x11a6, ack, ..
        } => Some(ack),
        _ => None,
    });
    ucx.send(ep, FenceMsg::Bye { ack });
    ucx.progress_for(Duration::from_millis(100));
    println!("SENT");
}

/// The hostile owner's process (run by [`Hostile::start`]; ignored otherwise): says its
/// worker's address (`WORKER`) and region (`REGION base rkey`), answers the first HELLO
/// with a WELCOME (`HELLO token`), on `REFUSE` sends REFUSEDs for that token and others
/// (`REFUSED`), then on `GONE n` sends n GONEs for that token, waits a second, and says how
/// many GONE_ACKs and BYEs came (`GOT acks byes`).
#[test]
#[ignore = "the hostile owner's own process, started by the tests here"]
fn hostile_owner_child() {
    if std::env::var("KVX_HOSTILE_OWNER").is_err() {
        return;
    }
    // SAFETY: fcntl on this process's own stdin; no memory is passed.
    unsafe {
        let fl = libc::fcntl(0, libc::F_GETFL);
        libc::fcntl(0, libc::F_SETFL, fl | libc::O_NONBLOCK);
    }
    let ucx = RawUcx::new();
    println!("WORKER {}", hex(&ucx.address()));
    // Its one region (the initiator READs it, once welcomed).
    let (base, rkey) = ucx.region(LEN, 0x77);
    println!("REGION {base} {}", hex(&rkey));
    std::io::stdout().flush().unwrap();
    // The first HELLO.
    let (token, initiator) = ucx.wait_for(Duration::from_secs(30), |m| match m {
        FenceMsg::Hello { token, worker, .. } => Some((token, worker)),
        _ => None,
    });
    let ep = ucx.connect(&initiator);
    let ack = 0xac4_0000_u64;
    let gone_first = std::env::var("KVX_HOSTILE_OWNER").is_ok_and(|v| v == "gone-first");
    if gone_first {
        // As a real owner does for a deregistration under way when the HELLO came.
        ucx.send(ep, FenceMsg::Gone { token, region: 0 });
        // Time for the initiator to answer it before the WELCOME comes (the race CI hit).
        ucx.progress_for(Duration::from_millis(200));
    }
    ucx.send(
        ep,
        FenceMsg::Welcome {
            token,
            ack,
            gone: Vec::new(),
        },
    );
    println!("HELLO {token:x}");
    std::io::stdout().flush().unwrap();
    if gone_first {
        let t = Instant::now();
        let acked = |m: &Vec<u8>| matches!(FenceMsg::decode(m), Some(FenceMsg::GoneAck { ack: a, region: 0 }) if a == ack);
        while t.elapsed() < Duration::from_secs(5) && !GOT.lock().unwrap().iter().any(acked) {
            ucx.progress_for(Duration::from_millis(1));
        }
        let n = GOT.lock().unwrap().iter().filter(|m| acked(m)).count();
        println!("EARLY_ACK {n} after {:?}", t.elapsed());
        std::io::stdout().flush().unwrap();
    }
    // Progress (the initiator's READs, its BYE) until told; REFUSEs meanwhile.
    let mut line = Vec::new();
    let n: usize = loop {
        ucx.progress_for(Duration::from_millis(1));
        let mut b = [0u8; 64];
        match std::io::stdin().read(&mut b) {
            Ok(0) => return,
            Ok(k) => line.extend_from_slice(&b[..k]),
            Err(_) => {}
        }
        let Some(end) = line.iter().position(|&c| c == b'\n') else {
            continue;
        };
        let cmd = String::from_utf8_lossy(&line[..end]).to_string();
        line.drain(..=end);
        if cmd == "REFUSE" {
            // For the welcomed entry, for tokens never drawn, and with each reason.
            for t in [token, token ^ 1, 0, u64::MAX] {
                for why in [Refusal::Full, Refusal::Descriptors] {
                    ucx.send(ep, FenceMsg::Refused { token: t, why });
                }
            }
            println!("REFUSED");
            std::io::stdout().flush().unwrap();
            continue;
        }
        break cmd.strip_prefix("GONE ").unwrap().parse().unwrap();
    };
    let before = GOT.lock().unwrap().len();
    for _ in 0..n {
        ucx.send(ep, FenceMsg::Gone { token, region: 0 });
    }
    ucx.progress_for(Duration::from_secs(1));
    let after = GOT.lock().unwrap().split_off(before);
    let acks = after
        .iter()
        .filter(
            |m| matches!(FenceMsg::decode(m), Some(FenceMsg::GoneAck { ack: a, .. }) if a == ack),
        )
        .count();
    let byes = after
        .iter()
        .filter(|m| matches!(FenceMsg::decode(m), Some(FenceMsg::Bye { ack: a }) if a == ack))
        .count();
    println!("GOT {acks} {byes}");
    std::io::stdout().flush().unwrap();
    // Kept alive until the test ends (stdin closes or the process is killed).
    loop {
        ucx.progress_for(Duration::from_millis(10));
        if matches!(std::io::stdin().read(&mut [0u8; 1]), Ok(0)) {
            return;
        }
    }
}
