//! The TCP lane's window between two processes of one host (here two agents of one process,
//! which take the same path: the target's hand-over socket, a one-time ticket, a sealed
//! memory file): with a secret and clear data, a region shared with named peers only moves
//! through it, bytes intact both ways, the target still checking the share set for every
//! request; with `lane_window(false)` the data stays on the socket; nothing is left when the
//! agents go. One test in this binary: it counts the process's windows.
#![allow(clippy::unwrap_used)] // Tests fail loudly on purpose.

use std::time::Duration;

use kvxfer::{Agent, AgentConfig, Desc, Error, HostBuffer, Lane, Share, Transport, XferOp};
use rand::{RngCore, SeedableRng};

const LEN: usize = 64 << 20;

fn agent(name: &str, window: bool) -> Agent {
    Agent::new(
        AgentConfig::new(format!("{name}-{}", std::process::id()))
            .transport(Transport::Auto)
            .net_devices("lo")
            .secret(b"open sesame".to_vec())
            .lane_window(window),
    )
    .unwrap()
}

fn windows() -> usize {
    kvxfer::live::live().lane_windows
}

/// `a`'s `op` of all of `peer`'s region `rid` with a fresh buffer filled with `fill`: the lane
/// or the error, and the buffer's bytes after.
fn go(
    a: &Agent,
    peer: &str,
    rid: kvxfer::RegionId,
    op: XferOp,
    fill: &[u8],
) -> (kvxfer::Result<Lane>, Vec<u8>) {
    let mine = a.register(HostBuffer::new(LEN).unwrap()).unwrap();
    mine.write(0, fill).unwrap();
    let l = a
        .prep_local(&[Desc::new(mine.id(), 0, LEN as u64)])
        .unwrap();
    let r = a
        .prep_remote(peer, &[Desc::new(rid, 0, LEN as u64)])
        .unwrap();
    let got = a
        .transfer_all(op, &l, &r, None, Some(Duration::from_secs(20)))
        .and_then(|t| t.wait())
        .map(|s| s.lane);
    let mut b = vec![0u8; LEN];
    mine.read(0, &mut b).unwrap();
    a.deregister(&mine).unwrap();
    (got, b)
}

#[test]
fn a_shared_only_region_moves_through_the_window_and_stays_checked() {
    let mut data = vec![0u8; LEN];
    rand::rngs::StdRng::seed_from_u64(7).fill_bytes(&mut data);
    assert_eq!(windows(), 0);
    for window in [true, false] {
        let owner = agent(&format!("win-owner-{window}"), true);
        let reader = agent(&format!("win-reader-{window}"), window);
        let other = agent(&format!("win-other-{window}"), window);
        let region = owner
            .register_shared(
                HostBuffer::new(LEN).unwrap(),
                Share::Only(vec![reader.name().to_string()]),
            )
            .unwrap();
        region.write(0, &data).unwrap();
        let side = owner.listen("127.0.0.1:0").unwrap();
        let to_owner = reader.connect(side).unwrap();

        // READ it, then WRITE it back reversed: over the TCP lane, bytes intact.
        let (got, b) = go(&reader, &to_owner, region.id(), XferOp::Read, &[]);
        assert_eq!(got.unwrap(), Lane::Tcp, "window {window}");
        assert!(b == data, "window {window}: the READ's bytes differ");
        let back: Vec<u8> = data.iter().rev().copied().collect();
        let (got, _) = go(&reader, &to_owner, region.id(), XferOp::Write, &back);
        assert_eq!(got.unwrap(), Lane::Tcp);
        let mut now = vec![0u8; LEN];
        region.read(0, &mut now).unwrap();
        assert!(now == back, "window {window}: the WRITE's bytes differ");
        // Both ends of each connection hold one while it is pooled; none without windows.
        let held = windows();
        if window {
            assert!(held >= 2 && held.is_multiple_of(2), "{held} windows held");
        } else {
            assert_eq!(held, 0);
        }

        // Another peer with the secret, same host: refused by the target's share check,
        // whatever its connection moves data through.
        let to_owner = other.connect(side).unwrap();
        let (got, b) = go(&other, &to_owner, region.id(), XferOp::Read, &[]);
        assert!(
            matches!(&got, Err(Error::LaneFailed { why, .. })
                if why.contains("is not among the peers")),
            "window {window}: {got:?}"
        );
        assert!(b.iter().all(|&x| x == 0), "bytes reached the other peer");
        drop((reader, other, owner));
        assert_eq!(windows(), 0, "windows left after the agents went");
    }
}
