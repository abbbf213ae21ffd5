//! Deregistration while a peer's UCX transfer touches the region (issue 34, part 4), with
//! kvxfer's lanes off so that UCX carries everything (shared memory and UCX's own TCP). UCX's
//! emulated RMA checks no key on the target: before, `deregister` returned `Ok` while a peer
//! still wrote, the memory went, and the owner died with SIGSEGV in `ucp_put_handler` (11 of
//! 11 runs). Now the owner tells every peer kept on its side channel, each refuses the region
//! from then on and answers once its transfers in flight to the owner have ended, and only
//! then does `deregister` return and the memory go. One process and two, WRITE and READ,
//! shared memory and TCP, 20 runs each: no crash; every transfer ends `Ok` or refused typed.
//! The same over kvxfer's TCP lane (lanes on), whose target pins a region while a request
//! uses it: there `deregister` is `Busy` until the transfer ends, and a later one is refused
//! by the target.
//!
//! The `by_hand` cases give the peer the owner's metadata by hand (`load_remote_metadata`,
//! as the etcd path does) instead of over the side channel: the owner then reaches it only
//! through the UCX fence (the peer announced itself over UCX before its first RMA). Before
//! that fence such a peer was never told.
#![allow(clippy::unwrap_used)] // Tests fail loudly on purpose.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[path = "../../examples/common/stopped.rs"]
mod stopped;
use stopped::stopped;

use kvxfer::{Agent, AgentConfig, Desc, Error, HostBuffer, RegionId, Transport, XferOp};

const BIG: usize = 16 << 20;
const RUNS: u32 = 20;

/// An agent for `mode`: "shm" and "tcp" are UCX's (lanes off), "lane" kvxfer's TCP lane.
fn agent(name: &str, mode: &str) -> Agent {
    Agent::new(config(name, mode)).unwrap()
}

fn config(name: &str, mode: &str) -> AgentConfig {
    let t = if mode == "shm" {
        Transport::Shm
    } else {
        Transport::Tcp
    };
    AgentConfig::new(name)
        .transport(t)
        .net_devices("lo")
        .lanes(mode == "lane")
        .ucx_tcp(mode == "tcp")
        .ucx_emulated_shm(mode != "lane")
}

/// `owner` deregisters `r`; returns how many times it was `Busy` first (a TCP-lane request
/// in flight pins the region; over UCX the fence waits instead, so never).
fn deregister(owner: &Agent, r: &kvxfer::Region, mode: &str) -> u32 {
    let t0 = Instant::now();
    let mut busy = 0;
    loop {
        match owner.deregister(r) {
            Ok(()) => return busy,
            Err(Error::Busy { .. }) if mode == "lane" && t0.elapsed() < Duration::from_secs(20) => {
                busy += 1;
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => panic!("{mode}: deregister: {e}"),
        }
    }
}

/// Refused typed: by the peer itself (its owner told it), or by the TCP lane's target.
fn refused(r: &kvxfer::Result<()>, id: u32) -> bool {
    matches!(r, Err(Error::Deregistered { region }) if *region == id)
        || matches!(r, Err(Error::LaneFailed { lane: "tcp", why, .. })
            if why.contains("not registered") || why.contains("being deregistered"))
}

/// `a`'s `op` of the whole of `peer`'s region `id` with `l`.
fn go(a: &Agent, l: &kvxfer::PreparedLocal, peer: &str, id: u32, op: XferOp) -> kvxfer::Result<()> {
    let r = a.prep_remote(peer, &[Desc::new(RegionId(id), 0, BIG as u64)])?;
    a.transfer_all(op, l, &r, None, Some(Duration::from_secs(20)))?
        .wait()
        .map(|_| ())
}

/// The next `op` on `peer`'s deregistered region `id` is refused, typed.
fn refused_after(a: &Agent, l: &kvxfer::PreparedLocal, peer: &str, id: u32, op: XferOp) {
    let after = go(a, l, peer, id, op);
    assert!(
        refused(&after, id),
        "{op:?} on region {id} after its deregistration: {after:?}"
    );
}

/// A peer named `name` connected to the owner's side channel at `side`, with a buffer of
/// [`BIG`] bytes of its own: the agent, the owner's name as it knows it, the buffer and the
/// buffer's prepared list.
fn reader(
    name: &str,
    mode: &str,
    side: std::net::SocketAddr,
) -> (Agent, String, kvxfer::Region, kvxfer::PreparedLocal) {
    let a = agent(name, mode);
    let peer = a.connect(side).unwrap();
    let buf = a.register(HostBuffer::new(BIG).unwrap()).unwrap();
    let l = a.prep_local(&[Desc::new(buf.id(), 0, BIG as u64)]).unwrap();
    (a, peer, buf, l)
}

/// Waits until `peer`'s region `id` is known to `a` (its registration travels as an update).
fn known(a: &Agent, peer: &str, id: u32) {
    let t0 = Instant::now();
    while a
        .prep_remote(peer, &[Desc::new(RegionId(id), 0, BIG as u64)])
        .is_err()
    {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "region {id} never reached the peer"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// `moving` on a thread of its own while, a moment later (varied by `run`), `meanwhile` runs
/// and `owner` deregisters `r` and lets its memory go: what `moving` returned, how long the
/// deregistration took and how many times it was `Busy` first.
fn across(
    owner: &Agent,
    r: kvxfer::Region,
    mode: &str,
    run: u32,
    moving: impl FnOnce() -> kvxfer::Result<()> + Send,
    meanwhile: impl FnOnce(),
) -> (kvxfer::Result<()>, Duration, u32) {
    std::thread::scope(|s| {
        let h = s.spawn(moving);
        std::thread::sleep(Duration::from_micros(u64::from(run % 8) * 300));
        meanwhile();
        let t0 = Instant::now();
        let busy = deregister(owner, &r, mode);
        let waited = t0.elapsed();
        // The memory goes now: a peer still writing would crash this process.
        drop(r);
        (h.join().unwrap(), waited, busy)
    })
}

/// What a run saw: the transfer across the deregistration ended `Ok`, or was refused typed
/// before it began; the deregistration's time.
#[derive(Default)]
struct Tally {
    ok: u32,
    refused: u32,
    busy: u32,
    waited: Vec<Duration>,
}

impl Tally {
    fn take(&mut self, name: &str, id: u32, r: kvxfer::Result<()>, waited: Duration, busy: u32) {
        match r {
            Ok(()) => self.ok += 1,
            ref e if refused(e, id) => self.refused += 1,
            Err(e) => panic!("{name}: a transfer across a deregistration: {e:?}"),
        }
        self.busy += busy;
        self.waited.push(waited);
    }

    fn report(&mut self, name: &str) {
        self.waited.sort();
        let n = self.waited.len();
        eprintln!(
            "{name}: {} transfers across a deregistration: {} ended Ok, {} refused before they \
             began; deregister took median {:?}, longest {:?} ({} Busy answers on the way)",
            n,
            self.ok,
            self.refused,
            self.waited[n / 2],
            self.waited[n - 1],
            self.busy
        );
        assert_eq!(self.ok + self.refused, n as u32);
        // Some deregistrations came while a 16 MiB transfer was under way and waited for it.
        assert!(self.ok > 0, "{name}: no transfer was under way");
    }
}

/// A peer that loads the owner's metadata `meta` by hand, with a buffer of [`BIG`] bytes of
/// its own (as [`reader`]).
fn reader_by_hand(
    name: &str,
    mode: &str,
    meta: &[u8],
) -> (Agent, String, kvxfer::Region, kvxfer::PreparedLocal) {
    let a = agent(name, mode);
    let peer = a.load_remote_metadata(meta).unwrap();
    let buf = a.register(HostBuffer::new(BIG).unwrap()).unwrap();
    let l = a.prep_local(&[Desc::new(buf.id(), 0, BIG as u64)]).unwrap();
    (a, peer, buf, l)
}

fn one_process(t: &str, by_hand: bool) {
    let _ = env_logger::builder().is_test(true).try_init();
    let owner = agent(&format!("own-{t}"), t);
    let (a, peer, _buf, l) = if by_hand {
        reader_by_hand(&format!("peer-{t}"), t, &owner.metadata().unwrap())
    } else {
        let side = owner.listen("127.0.0.1:0").unwrap();
        reader(&format!("peer-{t}"), t, side)
    };
    let mut tally = Tally::default();
    for run in 0..RUNS {
        for op in [XferOp::Write, XferOp::Read] {
            let r = owner.register(HostBuffer::new(BIG).unwrap()).unwrap();
            let id = r.id().0;
            if by_hand {
                a.load_remote_metadata(&owner.metadata().unwrap()).unwrap();
            }
            known(&a, &peer, id);
            let (moved, waited, busy) =
                across(&owner, r, t, run, || go(&a, &l, &peer, id, op), || {});
            tally.take(t, id, moved, waited, busy);
            refused_after(&a, &l, &peer, id, op);
        }
    }
    let how = if by_hand { ", loaded by hand" } else { "" };
    tally.report(&format!("one process, {t}{how}"));
}

#[test]
fn deregistration_during_a_peers_ucx_transfer_in_one_process_shm() {
    one_process("shm", false);
}

#[test]
fn deregistration_during_a_peers_ucx_transfer_in_one_process_tcp() {
    one_process("tcp", false);
}

#[test]
fn deregistration_during_a_peers_tcp_lane_transfer_in_one_process() {
    one_process("lane", false);
}

#[test]
fn deregistration_during_a_ucx_transfer_of_a_peer_loaded_by_hand_in_one_process_shm() {
    one_process("shm", true);
}

#[test]
fn deregistration_during_a_ucx_transfer_of_a_peer_loaded_by_hand_in_one_process_tcp() {
    one_process("tcp", true);
}

/// The owner in its own process (ignored in a normal run): `reg` registers a region and
/// prints its id; `dereg ID` deregisters it, lets the memory go and prints how long it took.
#[test]
#[ignore = "an owner's own process, started by the tests here"]
fn owner_child() {
    let Ok(t) = std::env::var("KVX_UCX_OWNER") else {
        return;
    };
    let b = agent(&format!("owner-elsewhere-{t}"), &t);
    // By hand: no side channel; the metadata is printed after each registration.
    let by_hand = std::env::var("KVX_UCX_BY_HAND").is_ok();
    if by_hand {
        println!("META {}", hex(&b.metadata().unwrap()));
    } else {
        println!("SIDE {}", b.listen("127.0.0.1:0").unwrap());
    }
    let mut held = Vec::new();
    for line in std::io::stdin().lines() {
        let line = line.unwrap();
        match line.split_whitespace().collect::<Vec<_>>().as_slice() {
            ["reg"] => {
                let r = b.register(HostBuffer::new(BIG).unwrap()).unwrap();
                if by_hand {
                    println!("META {}", hex(&b.metadata().unwrap()));
                }
                println!("REG {}", r.id().0);
                held.push(r);
            }
            ["dereg", id] => {
                let id: u32 = id.parse().unwrap();
                let i = held.iter().position(|r| r.id().0 == id).unwrap();
                let r = held.swap_remove(i);
                let t0 = Instant::now();
                let busy = deregister(&b, &r, &t);
                let us = t0.elapsed().as_micros();
                drop(r);
                println!("GONE {id} {us} {busy}");
            }
            _ => panic!("unknown command {line:?}"),
        }
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn two_processes(t: &str, by_hand: bool) {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", "owner_child", "--ignored", "--nocapture"])
        .env("KVX_UCX_OWNER", t);
    if by_hand {
        cmd.env("KVX_UCX_BY_HAND", "1");
    }
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut to = child.stdin.take().unwrap();
    let mut from = BufReader::new(child.stdout.take().unwrap());
    let mut said = |want: &str| -> String {
        loop {
            let mut l = String::new();
            assert!(
                from.read_line(&mut l).unwrap() > 0,
                "the owner ended (crashed?) before it said {want:?}"
            );
            if let Some(i) = l.find(want) {
                return l[i + want.len()..].trim().to_string();
            }
        }
    };
    let (a, peer, _buf, l) = if by_hand {
        reader_by_hand(&format!("peer-here-{t}"), t, &unhex(&said("META ")))
    } else {
        let side: std::net::SocketAddr = said("SIDE ").parse().unwrap();
        reader(&format!("peer-here-{t}"), t, side)
    };
    let mut tally = Tally::default();
    for run in 0..RUNS {
        for op in [XferOp::Write, XferOp::Read] {
            writeln!(to, "reg").unwrap();
            if by_hand {
                a.load_remote_metadata(&unhex(&said("META "))).unwrap();
            }
            let id: u32 = said("REG ").parse().unwrap();
            known(&a, &peer, id);
            let (moved, gone) = std::thread::scope(|s| {
                let t = s.spawn(|| go(&a, &l, &peer, id, op));
                std::thread::sleep(Duration::from_micros(u64::from(run % 8) * 300));
                writeln!(to, "dereg {id}").unwrap();
                let gone = said("GONE ");
                (t.join().unwrap(), gone)
            });
            let w: Vec<u64> = gone
                .split_whitespace()
                .skip(1)
                .map(|x| x.parse().unwrap())
                .collect();
            tally.take(t, id, moved, Duration::from_micros(w[0]), w[1] as u32);
            refused_after(&a, &l, &peer, id, op);
        }
    }
    drop(to);
    let status = child.wait().unwrap();
    assert!(status.success(), "the owner process: {status:?}");
    let how = if by_hand { ", loaded by hand" } else { "" };
    tally.report(&format!("two processes, {t}{how}"));
}

#[test]
fn deregistration_during_a_peers_ucx_transfer_in_two_processes_shm() {
    two_processes("shm", false);
}

#[test]
fn deregistration_during_a_peers_ucx_transfer_in_two_processes_tcp() {
    two_processes("tcp", false);
}

#[test]
fn deregistration_during_a_peers_tcp_lane_transfer_in_two_processes() {
    two_processes("lane", false);
}

#[test]
fn deregistration_during_a_ucx_transfer_of_a_peer_loaded_by_hand_in_two_processes_shm() {
    two_processes("shm", true);
}

#[test]
fn deregistration_during_a_ucx_transfer_of_a_peer_loaded_by_hand_in_two_processes_tcp() {
    two_processes("tcp", true);
}

/// A deregistration that this agent's own transfer makes `Busy` tells no peer: the peer goes
/// on using the region, which stays registered, until a later deregistration succeeds.
///
/// UCX over TCP, so a 16 MiB put cannot finish inside `transfer_all` (over shared memory
/// with CMA it can, and then `Ok` is the right answer). A deregistration that still
/// succeeds must have found the transfer done; it is counted, and a fresh region taken.
#[test]
fn a_deregistration_busy_with_a_local_transfer_tells_no_peer() {
    let owner = agent("own-busy", "tcp");
    let side = owner.listen("127.0.0.1:0").unwrap();
    let (a, peer, buf, l) = reader("peer-busy", "tcp", side);
    let peer_of_owner = a.name().to_string();
    known(&owner, &peer_of_owner, buf.id().0);
    let orr = owner
        .prep_remote(&peer_of_owner, &[Desc::new(buf.id(), 0, BIG as u64)])
        .unwrap();
    let (mut busy, mut finished_first) = (0, 0);
    let mut region = None;
    for _ in 0..3 * RUNS {
        if busy == RUNS {
            break;
        }
        let r = region.take().unwrap_or_else(|| {
            let r = owner.register(HostBuffer::new(BIG).unwrap()).unwrap();
            known(&a, &peer, r.id().0);
            r
        });
        let id = r.id().0;
        // The owner's own WRITE out of the region pins it.
        let ol = owner
            .prep_local(&[Desc::new(r.id(), 0, BIG as u64)])
            .unwrap();
        let t = owner
            .transfer_all(
                XferOp::Write,
                &ol,
                &orr,
                None,
                Some(Duration::from_secs(20)),
            )
            .unwrap();
        match owner.deregister(&r) {
            Err(e) => {
                assert!(matches!(e, Error::Busy { .. }), "{e}");
                busy += 1;
                t.wait().unwrap();
                // Not told: the peer still reads the region.
                go(&a, &l, &peer, id, XferOp::Read).unwrap();
                region = Some(r);
            }
            Ok(()) => {
                // Only a finished transfer may let it through (its pins go just before
                // its handle hears); removing the pin check makes every answer `Ok`.
                t.wait().unwrap();
                finished_first += 1;
                refused_after(&a, &l, &peer, id, XferOp::Read);
            }
        }
    }
    eprintln!("busy {busy}, finished before the deregistration {finished_first}");
    assert_eq!(busy, RUNS, "{finished_first} transfers finished first");
    let r = region.expect("the last busy region");
    let id = r.id().0;
    owner.deregister(&r).unwrap();
    refused_after(&a, &l, &peer, id, XferOp::Read);
}

/// A deregistration racing this agent's own transfers: either they pin the region first and
/// it is `Busy` with no peer told (the peer still reads it), or the deregistration takes it
/// first and they are refused (`Deregistered`); never told peers and then `Busy`. (Before,
/// a transfer pinning the region while peers were being told made it `Busy` after they had
/// been told: the peer then refused a region that stayed registered.)
#[test]
fn a_deregistration_racing_local_transfers_is_busy_before_telling_peers() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let owner = Arc::new(agent("own-race", "tcp"));
    let side = owner.listen("127.0.0.1:0").unwrap();
    let (a, peer, buf, l) = reader("peer-race", "tcp", side);
    let peer_of_owner = a.name().to_string();
    known(&owner, &peer_of_owner, buf.id().0);
    let (mut busy, mut refused_local) = (0u32, 0u32);
    for _ in 0..RUNS {
        let r = owner.register(HostBuffer::new(BIG).unwrap()).unwrap();
        let id = r.id().0;
        known(&a, &peer, id);
        let stop = Arc::new(AtomicBool::new(false));
        // Local WRITEs out of the region, back to back, until the deregistration went through.
        let hammer = {
            let (owner, stop, rid, to) =
                (owner.clone(), stop.clone(), r.id(), peer_of_owner.clone());
            let bid = buf.id();
            std::thread::spawn(move || {
                let (mut refused, mut n) = (0u32, 0u64);
                let ol = owner.prep_local(&[Desc::new(rid, 0, BIG as u64)]);
                let Ok(ol) = ol else { return 1 };
                let orr = owner
                    .prep_remote(&to, &[Desc::new(bid, 0, BIG as u64)])
                    .unwrap();
                while !stop.load(Ordering::Acquire) {
                    // A gap between transfers for the deregistration to find, varied so that
                    // the next transfer sometimes comes while the peers are being told.
                    n += 1;
                    std::thread::sleep(Duration::from_micros(50 * (n % 8)));
                    match owner.transfer_all(
                        XferOp::Write,
                        &ol,
                        &orr,
                        None,
                        Some(Duration::from_secs(20)),
                    ) {
                        Ok(t) => {
                            if let Err(e) = t.wait() {
                                assert!(matches!(e, Error::Deregistered { .. }), "{e}");
                                refused += 1;
                            }
                        }
                        Err(e) => {
                            assert!(matches!(e, Error::Deregistered { .. }), "{e}");
                            refused += 1;
                        }
                    }
                }
                refused
            })
        };
        std::thread::sleep(Duration::from_millis(2));
        loop {
            match owner.deregister(&r) {
                Ok(()) => break,
                Err(Error::Busy { .. }) => {
                    busy += 1;
                    // Not told: the peer still reads the region.
                    let got = go(&a, &l, &peer, id, XferOp::Read);
                    assert!(got.is_ok(), "Busy after the peer was told: {got:?}");
                }
                Err(e) => panic!("{e}"),
            }
        }
        stop.store(true, Ordering::Release);
        refused_local += hammer.join().unwrap();
        let after = go(&a, &l, &peer, id, XferOp::Read);
        assert!(refused(&after, id), "{after:?}");
    }
    eprintln!("busy answers {busy}, local transfers refused {refused_local}");
    assert!(busy > 0, "no deregistration met a local transfer");
}

/// A peer in its own process (ignored in a normal run): loads the owner's metadata from
/// `KVX_UCX_META` by hand, reads region `KVX_UCX_REGION` once over UCX (so it announced
/// itself), says `READY`, and waits for its stdin to close.
#[test]
#[ignore = "a peer's own process, started by the tests here"]
fn peer_child() {
    let (Ok(t), Ok(meta), Ok(id)) = (
        std::env::var("KVX_UCX_PEER"),
        std::env::var("KVX_UCX_META"),
        std::env::var("KVX_UCX_REGION"),
    ) else {
        return;
    };
    let (a, peer, _buf, l) = reader_by_hand(&format!("peer-child-{t}"), &t, &unhex(&meta));
    go(&a, &l, &peer, id.parse().unwrap(), XferOp::Read).unwrap();
    println!("READY");
    let _ = std::io::stdin().lines().count();
}

/// A peer that loaded the owner's metadata by hand and then stops (SIGSTOP) cannot answer
/// the UCX fence: the owner's deregistration is `Busy` once its wait has run out, typed, and
/// the region stays registered; the next one is `Busy` at once (not waited for again). Once
/// the peer is killed, the owner finds it gone (its process on this host, or its endpoint)
/// and deregisters.
fn stopped_then_killed_peer(t: &str) {
    let _ = env_logger::builder().is_test(true).try_init();
    let wait = Duration::from_millis(500);
    let owner = Agent::new(config(&format!("own-stopped-{t}"), t).deregister_wait(wait)).unwrap();
    let r = owner.register(HostBuffer::new(BIG).unwrap()).unwrap();
    let r2 = owner.register(HostBuffer::new(BIG).unwrap()).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "peer_child", "--ignored", "--nocapture"])
        .env("KVX_UCX_PEER", t)
        .env("KVX_UCX_META", hex(&owner.metadata().unwrap()))
        .env("KVX_UCX_REGION", r.id().0.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut from = BufReader::new(child.stdout.take().unwrap());
    loop {
        let mut l = String::new();
        assert!(
            from.read_line(&mut l).unwrap() > 0,
            "the peer ended before READY"
        );
        if l.contains("READY") {
            break;
        }
    }
    let pid = child.id() as i32;
    // SAFETY: kill with a pid of a child this test started and has not reaped.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    stopped(pid);
    let t0 = Instant::now();
    let e = owner.deregister(&r).unwrap_err();
    let first = t0.elapsed();
    assert!(matches!(e, Error::Busy { .. }), "{t}: {e}");
    assert!(
        first >= wait && first < wait * 4,
        "{t}: Busy after {first:?}"
    );
    let t1 = Instant::now();
    let e = owner.deregister(&r2).unwrap_err();
    let second = t1.elapsed();
    assert!(matches!(e, Error::Busy { .. }), "{t}: {e}");
    assert!(
        second < wait / 2,
        "{t}: a silent peer waited for again ({second:?})"
    );
    eprintln!("{t}: a stopped peer: Busy after {first:?}, then at once ({second:?})");
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    let _ = child.wait();
    let t2 = Instant::now();
    loop {
        match owner.deregister(&r) {
            Ok(()) => break,
            Err(Error::Busy { .. }) if t2.elapsed() < Duration::from_secs(30) => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => panic!("{t}: deregister after the peer died: {e}"),
        }
    }
    eprintln!("{t}: the dead peer let go after {:?}", t2.elapsed());
    owner.deregister(&r2).unwrap();
}

#[test]
fn a_stopped_peer_loaded_by_hand_keeps_the_region_busy_until_it_dies_shm() {
    stopped_then_killed_peer("shm");
}

#[test]
fn a_stopped_peer_loaded_by_hand_keeps_the_region_busy_until_it_dies_tcp() {
    stopped_then_killed_peer("tcp");
}

/// A peer that reloads the owner's metadata while its transfer is under way (here an older
/// copy, as a stale discovery record would give it: the reload makes a new view of the same
/// incarnation) still answers the owner's deregistration only once that transfer has ended:
/// the fence is kept across the views of one incarnation. Before, the new view knew nothing
/// in flight and answered at once, and the owner let the memory go under the transfer.
fn a_reload_during_a_transfer(t: &str) {
    let _ = env_logger::builder().is_test(true).try_init();
    let owner = agent(&format!("own-reload-{t}"), t);
    let (a, peer, _buf, l) =
        reader_by_hand(&format!("peer-reload-{t}"), t, &owner.metadata().unwrap());
    let mut tally = Tally::default();
    for run in 0..RUNS {
        for op in [XferOp::Write, XferOp::Read] {
            let r = owner.register(HostBuffer::new(BIG).unwrap()).unwrap();
            let id = r.id().0;
            let older = owner.metadata().unwrap();
            let x = owner.register(HostBuffer::new(4096).unwrap()).unwrap();
            a.load_remote_metadata(&owner.metadata().unwrap()).unwrap();
            // Under way (posted against the view loaded just now) before the reload.
            let rd = a
                .prep_remote(&peer, &[Desc::new(RegionId(id), 0, BIG as u64)])
                .unwrap();
            let xfer = a
                .transfer_all(op, &l, &rd, None, Some(Duration::from_secs(20)))
                .unwrap();
            // Not an extension of what it holds: a new view of the same incarnation.
            let reload = || {
                a.load_remote_metadata(&older).unwrap();
            };
            let (moved, waited, busy) =
                across(&owner, r, t, run, || xfer.wait().map(|_| ()), reload);
            tally.take(t, id, moved, waited, busy);
            owner.deregister(&x).unwrap();
        }
    }
    tally.report(&format!("reloaded during the transfer, {t}"));
}

#[test]
fn a_reload_during_a_ucx_transfer_keeps_it_fenced_shm() {
    a_reload_during_a_transfer("shm");
}

#[test]
fn a_reload_during_a_ucx_transfer_keeps_it_fenced_tcp() {
    a_reload_during_a_transfer("tcp");
}

/// A peer that forgets its owner (`remove_peer`) right after loading it by hand, often before
/// the owner's WELCOME has come, and holds no other endpoint to it: the owner must not count
/// it as a user it waits for. Its BYE goes over an endpoint made for it once the WELCOME
/// comes, so each of the owner's deregistrations returns at once, not `Busy` after its wait.
fn forgotten_before_the_welcome(t: &str) {
    let _ = env_logger::builder().is_test(true).try_init();
    let wait = Duration::from_millis(500);
    let owner = Agent::new(config(&format!("own-bye-{t}"), t).deregister_wait(wait)).unwrap();
    let a = agent(&format!("peer-bye-{t}"), t);
    let mut took = Vec::new();
    for round in 0..RUNS {
        let r = owner.register(HostBuffer::new(1 << 16).unwrap()).unwrap();
        let peer = a.load_remote_metadata(&owner.metadata().unwrap()).unwrap();
        a.remove_peer(&peer).unwrap();
        // The WELCOME and the BYE on their way.
        std::thread::sleep(Duration::from_millis(50));
        let t0 = Instant::now();
        let got = owner.deregister(&r);
        let d = t0.elapsed();
        assert!(
            got.is_ok() && d < wait,
            "{t}, round {round}: deregister {got:?} after {d:?}"
        );
        took.push(d);
    }
    took.sort();
    eprintln!(
        "{t}: {RUNS} rounds of load, forget, deregister: deregister median {:?}, longest {:?}",
        took[took.len() / 2],
        took[took.len() - 1]
    );
}

#[test]
fn a_peer_forgotten_before_the_welcome_keeps_no_deregistration_waiting_shm() {
    forgotten_before_the_welcome("shm");
}

#[test]
fn a_peer_forgotten_before_the_welcome_keeps_no_deregistration_waiting_tcp() {
    forgotten_before_the_welcome("tcp");
}
