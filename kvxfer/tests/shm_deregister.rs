//! Deregistration on the shm lane (issue 34, part 4): once its owner has deregistered a
//! region, a same-host peer that mapped it refuses to move data into or out of it, typed
//! (`LaneFailed`, "deregistered"), instead of writing into memory the owner gave up and
//! reporting success; one whose transfer was under way when it happened fails it typed once
//! it ends. One process and two, 20 runs each.
#![allow(clippy::unwrap_used)] // Tests fail loudly on purpose.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

use kvxfer::{Agent, Desc, Error, HostBuffer, Lane, RegionId, XferOp};

const LEN: usize = 1 << 20;
const RUNS: u32 = 20;

#[path = "support/same_host.rs"]
mod same_host;
use same_host::agent;

/// `a`'s `op` of `len` bytes between a fresh local buffer and region `id` of `peer`.
fn go(a: &Agent, peer: &str, id: u32, len: usize, op: XferOp) -> Result<Lane, Error> {
    let buf = a.register(HostBuffer::new(len).unwrap()).unwrap();
    let l = a.prep_local(&[Desc::new(buf.id(), 0, len as u64)]).unwrap();
    let r = a.prep_remote(peer, &[Desc::new(RegionId(id), 0, len as u64)])?;
    let out = a
        .transfer_all(op, &l, &r, None, Some(Duration::from_secs(10)))
        .and_then(|t| t.wait())
        .map(|s| s.lane);
    a.deregister(&buf).unwrap();
    out
}

/// Refused typed: by the shm lane (the owner's registration page says the region is gone), or,
/// for a peer the owner told (kept on its side channel, or announced to its UCX engine), before
/// any lane.
fn refused(r: &Result<Lane, Error>) -> bool {
    matches!(r, Err(Error::LaneFailed { lane: "shm", ref why, .. }) if why.contains("deregistered"))
        || matches!(r, Err(Error::Deregistered { .. }))
}

#[test]
fn a_deregistered_region_is_refused_to_a_same_host_peer_in_one_process() {
    let owner = agent("owner");
    let regions: Vec<_> = (0..RUNS)
        .map(|_| owner.register(HostBuffer::new(LEN).unwrap()).unwrap())
        .collect();
    let a = agent("peer");
    let peer = a.load_remote_metadata(&owner.metadata().unwrap()).unwrap();
    for r in &regions {
        let id = r.id().0;
        assert_eq!(go(&a, &peer, id, LEN, XferOp::Write).unwrap(), Lane::Shm);
        owner.deregister(r).unwrap();
        for op in [XferOp::Write, XferOp::Read] {
            let after = go(&a, &peer, id, LEN, op);
            assert!(
                refused(&after),
                "run {id}: {op:?} after deregistration: {after:?}"
            );
        }
    }
    // The others' regions are untouched: a fresh one moves.
    let fresh = owner.register(HostBuffer::new(LEN).unwrap()).unwrap();
    let peer = a.load_remote_metadata(&owner.metadata().unwrap()).unwrap();
    assert_eq!(
        go(&a, &peer, fresh.id().0, LEN, XferOp::Read).unwrap(),
        Lane::Shm
    );
}

/// The owner in its own process (run by the test below; ignored otherwise): `RUNS` regions,
/// a listener whose address it prints, then for each id read on stdin it deregisters that
/// region and says so.
#[test]
#[ignore = "an owner's own process, started by the tests here"]
fn owner_child() {
    if std::env::var("KVX_SHM_OWNER").is_err() {
        return;
    }
    let b = agent("owner-elsewhere");
    let regions: Vec<_> = (0..RUNS)
        .map(|_| b.register(HostBuffer::new(LEN).unwrap()).unwrap())
        .collect();
    println!("SIDE {}", b.listen("127.0.0.1:0").unwrap());
    for line in std::io::stdin().lines() {
        let id: u32 = line.unwrap().trim().parse().unwrap();
        let r = regions.iter().find(|r| r.id().0 == id).unwrap();
        b.deregister(r).unwrap();
        println!("GONE {id}");
    }
}

#[test]
fn a_deregistered_region_is_refused_to_a_same_host_peer_in_another_process() {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "owner_child", "--ignored", "--nocapture"])
        .env("KVX_SHM_OWNER", "1")
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
                "the owner said nothing"
            );
            if let Some(i) = l.find(want) {
                return l[i + want.len()..].trim().to_string();
            }
        }
    };
    let side: std::net::SocketAddr = said("SIDE ").parse().unwrap();
    let a = agent("peer-here");
    let peer = a.connect(side).unwrap();
    for id in 0..RUNS {
        assert_eq!(go(&a, &peer, id, LEN, XferOp::Write).unwrap(), Lane::Shm);
        writeln!(to, "{id}").unwrap();
        assert_eq!(said("GONE "), id.to_string());
        for op in [XferOp::Write, XferOp::Read] {
            let after = go(&a, &peer, id, LEN, op);
            assert!(
                refused(&after),
                "run {id}: {op:?} after deregistration: {after:?}"
            );
        }
    }
    drop(to);
    let _ = child.kill();
    let _ = child.wait();
}

/// Deregistration while a peer's 64 MiB WRITE or READ is under way, 20 runs each: the
/// transfer either ended before (`Ok`) or fails typed; never a crash, never another error.
#[test]
fn a_deregistration_during_a_peers_transfer_fails_it_typed_or_lets_it_finish() {
    const BIG: usize = 64 << 20;
    let owner = agent("owner-busy");
    let a = agent("peer-busy");
    let buf = a.register(HostBuffer::new(BIG).unwrap()).unwrap();
    let l = a.prep_local(&[Desc::new(buf.id(), 0, BIG as u64)]).unwrap();
    let (mut ok, mut before, mut during) = (0, 0, 0);
    for run in 0..RUNS {
        for op in [XferOp::Write, XferOp::Read] {
            let r = owner.register(HostBuffer::new(BIG).unwrap()).unwrap();
            let peer = a.load_remote_metadata(&owner.metadata().unwrap()).unwrap();
            let rd = a
                .prep_remote(&peer, &[Desc::new(r.id(), 0, BIG as u64)])
                .unwrap();
            let moving = std::thread::scope(|s| {
                let t = s.spawn(|| {
                    a.transfer_all(op, &l, &rd, None, Some(Duration::from_secs(10)))
                        .and_then(|t| t.wait())
                        .map(|s| s.lane)
                });
                std::thread::sleep(Duration::from_millis(u64::from(run % 8)));
                owner.deregister(&r).unwrap();
                t.join().unwrap()
            });
            match moving {
                Ok(Lane::Shm) => ok += 1,
                Err(Error::LaneFailed { ref why, .. }) if why.contains("deregistered before") => {
                    before += 1
                }
                // The owner told this peer over the UCX fence (it announced itself when it
                // loaded the metadata), and it refused the region itself.
                Err(Error::Deregistered { region }) if region == r.id().0 => before += 1,
                Err(Error::LaneFailed { ref why, .. }) if why.contains("deregistered during") => {
                    during += 1
                }
                m => panic!("run {run}: {op:?} across a deregistration: {m:?}"),
            }
        }
    }
    eprintln!(
        "{} transfers across a deregistration: {ok} ended first, {before} refused before they \
         began, {during} failed typed once they ended",
        2 * RUNS
    );
    assert_eq!(ok + before + during, 2 * RUNS);
    // A 64 MiB copy into fresh pages takes longer than the longest wait here (7 ms), so some
    // were cut: an `Ok` for those would be a success into memory the owner gave up.
    assert!(during > 0, "no transfer was under way at a deregistration");
}
