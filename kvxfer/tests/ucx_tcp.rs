//! UCX's own TCP transport is off by default (`AgentConfig::ucx_tcp` opts back in, never with a
//! secret): an agent listens on its side channel and its TCP lane only, and garbage sent
//! to each reads nothing, writes nothing and stops nothing. One test in its own binary: it counts the
//! listening sockets this process opens, which other tests would change.

#![allow(clippy::unwrap_used)] // Tests fail loudly on purpose.

use std::collections::HashSet;
use std::io::{Read, Write};
use std::time::Duration;

use kvxfer::{Agent, AgentConfig, Desc, HostBuffer, Transport, XferOp};

/// The TCP ports this process listens on.
fn listening() -> HashSet<u16> {
    let mine: HashSet<String> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| {
            let s = l.to_string_lossy().into_owned();
            Some(s.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
        })
        .collect();
    let mut ports = HashSet::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(t) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in t.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // local_address st ... inode: state 0A is LISTEN.
            if f.len() > 9 && f[3] == "0A" && mine.contains(f[9]) {
                let port = f[1].rsplit(':').next().unwrap();
                ports.insert(u16::from_str_radix(port, 16).unwrap());
            }
        }
    }
    ports
}

fn agent(name: &str, t: Transport, secret: bool, ucx_tcp: bool) -> Agent {
    let mut c = AgentConfig::new(format!("{name}-{}", std::process::id()))
        .transport(t)
        .net_devices("lo")
        .ucx_tcp(ucx_tcp);
    if secret {
        c = c.secret(b"open sesame".to_vec());
    }
    Agent::new(c).unwrap()
}

/// With a secret, no configuration brings UCX's TCP listener back: the opt-in and lanes off
/// with tcp are refused at `Agent::new`, before anything listens; lanes off with UCX left to
/// choose get UCX without TCP. (Called from the one test
/// of this binary: another test running beside it would open listeners.)
fn a_secret_refuses_every_way_to_ucx_over_tcp() {
    let before = listening();
    for (t, lanes, ucx_tcp) in [
        (Transport::Tcp, true, true),
        (Transport::Auto, true, true),
        (Transport::Tcp, false, false),
        (Transport::Tcp, false, true),
        (Transport::Auto, false, true),
    ] {
        let c = AgentConfig::new(format!("ports-s-{}", std::process::id()))
            .transport(t.clone())
            .net_devices("lo")
            .lanes(lanes)
            .ucx_tcp(ucx_tcp)
            .secret(b"open sesame".to_vec());
        match Agent::new(c) {
            Err(kvxfer::Error::InvalidArgument(m)) => {
                assert!(m.contains("authenticates nobody"), "{m}")
            }
            Err(e) => panic!("{t:?} lanes {lanes} ucx_tcp {ucx_tcp}: {e:?}"),
            Ok(_) => panic!("{t:?} lanes {lanes} ucx_tcp {ucx_tcp}: UCX over TCP with a secret"),
        }
    }
    assert!(listening().difference(&before).next().is_none());
    // Lanes off and UCX left to choose: it goes without TCP, so nothing listens.
    let quiet = Agent::new(
        AgentConfig::new(format!("ports-q-{}", std::process::id()))
            .transport(Transport::Auto)
            .net_devices("lo")
            .lanes(false)
            .ucx_emulated_shm(true)
            .secret(b"open sesame".to_vec()),
    )
    .unwrap();
    assert!(
        listening().difference(&before).next().is_none(),
        "lanes off with a secret: UCX listens on TCP"
    );
    drop(quiet);
}

#[test]
fn nothing_listens_for_ucx_over_tcp_unless_opted_in() {
    a_secret_refuses_every_way_to_ucx_over_tcp();
    for (t, secret, ucx_tcp, want) in [
        // With the opt-in, UCX's TCP listener is there too.
        (Transport::Tcp, false, true, 3),
        (Transport::Tcp, true, false, 2),
        (Transport::Auto, true, false, 2),
        (Transport::Tcp, false, false, 2),
        (Transport::Auto, false, false, 2),
    ] {
        let tag = format!("{t:?}-{secret}-{ucx_tcp}").to_lowercase();
        let before = listening();
        let b = agent(&format!("ports-b-{tag}"), t.clone(), secret, ucx_tcp);
        let rb = b.register(HostBuffer::new(1 << 16).unwrap()).unwrap();
        rb.write(0, &[0x6d; 1 << 16]).unwrap();
        let side = b.listen("127.0.0.1:0").unwrap();
        let ports: Vec<u16> = listening().difference(&before).copied().collect();
        assert_eq!(
            ports.len(),
            want,
            "{tag}: the agent listens on {ports:?} (side channel {side})"
        );
        if ucx_tcp {
            continue;
        }
        // A process without the secret (or the lane credential) dials every one of them with garbage and a plain lane
        // hello: nothing of b's memory comes back.
        for port in &ports {
            for probe in [vec![0xA5u8; 4096], b"KVXT\x02\x00\x01\x00x".to_vec()] {
                let mut s = std::net::TcpStream::connect(("127.0.0.1", *port)).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
                let _ = s.write_all(&probe);
                let mut back = Vec::new();
                let _ = s.read_to_end(&mut back);
                assert!(
                    !back.windows(16).any(|w| w == [0x6d; 16]),
                    "{tag}: port {port} served b's memory"
                );
            }
        }
        // A UCX-over-TCP process holding b's metadata (its worker address) reaches nothing.
        let f = Agent::new(
            AgentConfig::new(format!("ports-f-{tag}-{}", std::process::id()))
                .transport(Transport::Tcp)
                .net_devices("lo")
                .lanes(false)
                .ucx_tcp(true),
        )
        .unwrap();
        assert!(
            f.load_remote_metadata(&b.metadata().unwrap()).is_err(),
            "{tag}: a UCX-over-TCP process reached b's worker"
        );
        drop(f);
        // b is alive and serves a peer (with the secret where b has one) over its lane, and
        // the notification follows there.
        let a = agent(&format!("ports-a-{tag}"), t.clone(), secret, false);
        let ra = a.register(HostBuffer::new(1 << 16).unwrap()).unwrap();
        let peer = a.connect(side).unwrap();
        let l = a.prep_local(&[Desc::new(ra.id(), 0, 1 << 16)]).unwrap();
        let r = a
            .prep_remote(&peer, &[Desc::new(rb.id(), 0, 1 << 16)])
            .unwrap();
        let st = a
            .transfer_all(
                XferOp::Read,
                &l,
                &r,
                Some(b"read"),
                Some(Duration::from_secs(10)),
            )
            .unwrap()
            .wait()
            .unwrap();
        assert_ne!(st.lane, kvxfer::Lane::Ucx, "{tag}");
        let mut got = vec![0u8; 1 << 16];
        ra.read(0, &mut got).unwrap();
        assert!(got.iter().all(|&x| x == 0x6d), "{tag}: the read landed");
        let n = b.wait_notification(Duration::from_secs(5)).unwrap();
        assert_eq!(n.from, a.name());
    }
}
