//! A peer that stops responding (SIGSTOP) mid-transfer: the initiator gets a typed Deadline
//! error in time, never hangs, and its memory is released (deregister succeeds afterwards).

#![allow(clippy::unwrap_used)] // Tests fail loudly on purpose.

mod common;
#[path = "../examples/common/stopped.rs"]
mod stopped;
use stopped::stopped;

use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, Instant};

use kvxfer::{Agent, AgentConfig, Desc, Error, HostBuffer, Transport, XferOp};

const LEN: u64 = 256 << 20;

#[test]
fn stopped_peer_hits_the_deadline_not_a_hang_tcp_lane() {
    stopped_peer(true);
}

#[test]
fn stopped_peer_hits_the_deadline_not_a_hang_ucx() {
    stopped_peer(false);
}

fn stopped_peer(lanes: bool) {
    // Without lanes both ends move every byte through UCX (with lanes, UCX's TCP is off).
    let ucx_only: &[&str] = if lanes { &[] } else { &["--ucx-only"] };
    let (mut child, ready) = common::spawn_peer(
        Command::new(env!("CARGO_BIN_EXE_kvxfer-bench")).args(
            ["--listen", "127.0.0.1:0", "--transport", "tcp"]
                .iter()
                .chain(ucx_only),
        ),
    );
    let pid = child.id() as i32;
    let mut control = common::Control::connect(common::ctl_addr(&ready));
    let mut cmd = |c: &str| control.cmd(c);
    let side: SocketAddr = cmd(&format!("SETUP 1 {LEN} contiguous 1")).parse().unwrap();
    let rid = kvxfer::RegionId(cmd("REGION").parse().unwrap());

    let agent = Agent::new(
        AgentConfig::new(format!("deadline-{}", std::process::id()))
            .transport(Transport::Tcp)
            .lanes(lanes)
            .ucx_tcp(!lanes)
            .net_devices("lo")
            .deregister_wait(Duration::from_millis(300)),
    )
    .unwrap();
    let region = agent
        .register(HostBuffer::new(LEN as usize).unwrap())
        .unwrap();
    let spare = agent.register(HostBuffer::new(4096).unwrap()).unwrap();
    let peer = agent.connect(side).unwrap();
    let local = agent.prep_local(&[Desc::new(region.id(), 0, LEN)]).unwrap();
    let remote = agent.prep_remote(&peer, &[Desc::new(rid, 0, LEN)]).unwrap();
    // Warm the connection so that wireup is not what the deadline catches.
    agent
        .transfer_all(
            XferOp::Write,
            &local,
            &remote,
            None,
            Some(Duration::from_secs(60)),
        )
        .unwrap()
        .wait()
        .unwrap();

    // SAFETY: kill(2) has no memory preconditions; pid is our own child.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    stopped(pid);
    let t = Instant::now();
    let deadline = Duration::from_millis(500);
    let r = agent
        .transfer_all(XferOp::Write, &local, &remote, None, Some(deadline))
        .unwrap()
        .wait();
    let took = t.elapsed();
    assert!(matches!(r, Err(Error::Deadline { .. })), "{r:?}");
    assert!(
        took < Duration::from_secs(10),
        "deadline of {deadline:?} took {took:?}"
    );

    // A deadline that expires while the transfer is still posting (more operations than one
    // posting batch, peer still stopped): posting stops, what was posted is flushed by the
    // forced close, and the error says how far it got.
    const BLOCK: u64 = 32 * 1024;
    let n = LEN / BLOCK;
    let ld: Vec<Desc> = (0..n)
        .map(|i| Desc::new(region.id(), i * BLOCK, BLOCK))
        .collect();
    let rd: Vec<Desc> = (0..n)
        .rev()
        .map(|i| Desc::new(rid, i * BLOCK, BLOCK))
        .collect();
    let lb = agent.prep_local(&ld).unwrap();
    let rb = agent.prep_remote(&peer, &rd).unwrap();
    let t = Instant::now();
    let r = agent
        .transfer_all(XferOp::Write, &lb, &rb, None, Some(Duration::ZERO))
        .unwrap()
        .wait();
    let took = t.elapsed();
    match r {
        Err(Error::Deadline {
            posted_ops, ops, ..
        }) => {
            assert_eq!(ops, n as usize);
            assert!(
                posted_ops < ops,
                "posting was not cut short: {posted_ops}/{ops}"
            );
        }
        other => panic!("expected Deadline, got {other:?}"),
    }
    assert!(took < Duration::from_secs(10), "took {took:?}");
    // UCX no longer touches the buffer here. Over the TCP lane the peer writes only through
    // this agent's target: deregistration succeeds. Over UCX the stopped peer holds the
    // region's key and cannot confirm it no longer uses it: the region stays registered
    // (Busy) until it does, once it runs again.
    assert_eq!(region.inflight(), 0);
    if !lanes {
        let t = Instant::now();
        let e = agent.deregister(&region).unwrap_err();
        assert!(matches!(e, Error::Busy { inflight: 1, .. }), "{e}");
        assert!(
            t.elapsed() >= Duration::from_millis(300),
            "{:?}",
            t.elapsed()
        );
        // Having let one wait run out, the stopped peer is not waited for again (a shutdown
        // deregistering many regions would wait for it once per region).
        let t = Instant::now();
        let e = agent.deregister(&spare).unwrap_err();
        assert!(matches!(e, Error::Busy { inflight: 1, .. }), "{e}");
        assert!(
            t.elapsed() < Duration::from_millis(200),
            "{:?}",
            t.elapsed()
        );
    }
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    // Running again, it answers what it was told; then both regions go.
    let t = Instant::now();
    for r in [&region, &spare] {
        loop {
            match agent.deregister(r) {
                Ok(()) => break,
                Err(Error::Busy { .. }) if t.elapsed() < Duration::from_secs(10) => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => panic!("after SIGCONT: {e}"),
            }
        }
    }
    let _ = child.kill();
    let _ = child.wait();
}
