//! Hostile and slow clients on every listening socket (the side channel and the TCP lane):
//! hundreds of connections that say nothing, clients that send a byte every 100 ms, clients
//! that send a valid header announcing a 16 MiB message and stall; meanwhile a real peer
//! connects and moves verified bytes, over TCP and in-host, and the agent's threads and file
//! descriptors stay bounded. A silent client is dropped after the handshake deadline.
#![allow(clippy::unwrap_used)] // Tests fail loudly on purpose.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer::{Agent, AgentConfig, Desc, HostBuffer, RegionId, Transport, XferOp};
use kvxfer_proto::wire::metadata::Metadata;
use kvxfer_proto::wire::side_channel::{FRAME_HEADER_LEN, HELLO, MAX_FRAME, PREAMBLE};

const LEN: usize = 1 << 20;

/// One test at a time: each counts the process's threads and sockets.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn count(dir: &str) -> usize {
    std::fs::read_dir(dir).unwrap().count()
}

/// kvxfer's threads in this process (they are all named "kvxfer-..."; the test's clients are
/// not).
fn kvxfer_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|c| c.starts_with("kvxfer"))
        .count()
}

fn agent(name: &str, t: Transport) -> Agent {
    Agent::new(AgentConfig::new(name).transport(t).net_devices("lo")).unwrap()
}

/// `b` connects to `side`, reads and writes `a`'s region (filled with `fill`): the handshake's
/// time, and the transfers', bytes verified.
fn real_peer(b: &Agent, side: SocketAddr, fill: u8) -> (Duration, Duration) {
    let t = Instant::now();
    let name = b.connect(side).unwrap();
    let handshake = t.elapsed();
    let local = b.register(HostBuffer::new(LEN).unwrap()).unwrap();
    let l = b
        .prep_local(&[Desc::new(local.id(), 0, LEN as u64)])
        .unwrap();
    let r = b
        .prep_remote(&name, &[Desc::new(RegionId(0), 0, LEN as u64)])
        .unwrap();
    let t = Instant::now();
    b.transfer_all(XferOp::Read, &l, &r, None, Some(Duration::from_secs(10)))
        .unwrap()
        .wait()
        .unwrap();
    let mut got = vec![0u8; LEN];
    local.read(0, &mut got).unwrap();
    assert!(got.iter().all(|&x| x == fill), "READ bytes");
    local.write(0, &vec![fill ^ 0xff; LEN]).unwrap();
    b.transfer_all(XferOp::Write, &l, &r, None, Some(Duration::from_secs(10)))
        .unwrap()
        .wait()
        .unwrap();
    let moved = t.elapsed();
    b.deregister(&local).unwrap();
    (handshake, moved)
}

/// A client that sends `bytes` one at a time, every 100 ms, until told to stop.
fn trickle(to: SocketAddr, bytes: Vec<u8>, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let Ok(mut s) = TcpStream::connect(to) else {
            return;
        };
        for b in bytes.iter().cycle() {
            if stop.load(Ordering::Acquire) || s.write_all(&[*b]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    })
}

#[test]
fn idle_slow_and_stalled_clients_delay_no_peer() {
    let _one = serial();
    for transport in [Transport::Tcp, Transport::Shm] {
        let a = agent(&format!("hz-a-{transport:?}"), transport.clone());
        let region = a.register(HostBuffer::new(LEN).unwrap()).unwrap();
        region.write(0, &vec![0x5c; LEN]).unwrap();
        let side = a.listen("127.0.0.1:0").unwrap();
        let lane = Metadata::decode(&a.metadata().unwrap(), a.compat())
            .unwrap()
            .tcp_lane()
            .unwrap()
            .addr;

        // The same peer's work with nobody else around, for comparison.
        let b0 = agent(&format!("hz-b0-{transport:?}"), transport.clone());
        let (h0, m0) = real_peer(&b0, side, 0x5c);
        drop(b0);
        region.write(0, &vec![0x5c; LEN]).unwrap();

        let (threads0, fds0) = (kvxfer_threads(), count("/proc/self/fd"));
        // 600 connections that say nothing (over the gates' 256 pending each: the oldest
        // are dropped), 300 at each socket.
        let mut idle = Vec::new();
        for i in 0..600 {
            let to = if i % 2 == 0 { side } else { lane };
            idle.push(TcpStream::connect(to).unwrap());
        }
        // Stalled: a valid start, then a header announcing the largest message, then nothing.
        let mut stalled = Vec::new();
        for _ in 0..10 {
            let mut s = TcpStream::connect(side).unwrap();
            let mut b = PREAMBLE.to_vec();
            b.extend_from_slice(&(MAX_FRAME as u32).to_le_bytes());
            b.push(HELLO);
            assert_eq!(b.len(), PREAMBLE.len() + FRAME_HEADER_LEN);
            s.write_all(&b).unwrap();
            stalled.push(s);
            let mut s = TcpStream::connect(lane).unwrap();
            s.write_all(b"KVXT\x01\x00\xff\x00").unwrap(); // a hello announcing a 255-byte name
            stalled.push(s);
        }
        // Slow: a byte every 100 ms.
        let stop = Arc::new(AtomicBool::new(false));
        let mut slow = Vec::new();
        for _ in 0..10 {
            slow.push(trickle(side, PREAMBLE.to_vec(), stop.clone()));
            slow.push(trickle(lane, b"KVXT\x01\x00".to_vec(), stop.clone()));
        }
        std::thread::sleep(Duration::from_millis(300));
        let threads = kvxfer_threads().saturating_sub(threads0);
        // The clients' own sockets (a trickling client whose connection was closed holds none).
        let fds = count("/proc/self/fd").saturating_sub(fds0 + idle.len() + stalled.len());

        let b = agent(&format!("hz-b-{transport:?}"), transport.clone());
        let (h, m) = real_peer(&b, side, 0x5c);
        println!(
            "{transport:?}: with 600 idle, 20 stalled and 20 slow clients: handshake {h:?} \
             (alone {h0:?}), 2 MiB moved and verified in {m:?} (alone {m0:?}); the agent gained \
             {threads} threads and holds {fds} of the clients' sockets (gates bound 256 each)"
        );
        // Before the gates, one silent client held the side channel for 10 s each.
        assert!(h < Duration::from_secs(2), "handshake took {h:?}");
        assert!(threads <= 4, "{threads} threads for hostile clients");
        assert!(fds <= 2 * 256 + 40, "{fds} sockets held");

        // The dropped and the expired are closed by the agent: the oldest idle client reads
        // EOF (dropped for newer ones), and after the deadline so does a stalled one.
        let mut buf = [0u8; 64];
        idle[0]
            .set_read_timeout(Some(Duration::from_secs(2)))
            .unwrap();
        let n = read_to_eof(&mut idle[0], &mut buf);
        assert!(n.is_some(), "the oldest idle client was not dropped");
        stalled[0]
            .set_read_timeout(Some(Duration::from_secs(8)))
            .unwrap();
        let t = Instant::now();
        assert!(
            read_to_eof(&mut stalled[0], &mut buf).is_some(),
            "a stalled client was kept"
        );
        println!(
            "{transport:?}: a stalled client closed by the agent {:?} later",
            t.elapsed()
        );
        stop.store(true, Ordering::Release);
        for t in slow {
            t.join().unwrap();
        }
    }
}

/// Reads until EOF (what the agent sent first, e.g. its preamble, is skipped); `None` when the
/// connection stayed open past the read timeout.
fn read_to_eof(s: &mut TcpStream, buf: &mut [u8]) -> Option<()> {
    loop {
        match s.read(buf) {
            Ok(0) => return Some(()),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Some(()),
            Err(_) => return None,
        }
    }
}

/// The listening TCP sockets this process holds: (inode, port).
fn listening() -> Vec<(u64, u16)> {
    let mine: std::collections::HashSet<u64> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy().into_owned();
            l.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok()
        })
        .collect();
    let mut out = Vec::new();
    for f in ["/proc/self/net/tcp", "/proc/self/net/tcp6"] {
        for line in std::fs::read_to_string(f)
            .unwrap_or_default()
            .lines()
            .skip(1)
        {
            let w: Vec<&str> = line.split_whitespace().collect();
            // local_address rem_address st ... inode (the 10th column)
            if w.len() > 9 && w[3] == "0A" {
                let port = u16::from_str_radix(w[1].rsplit(':').next().unwrap(), 16).unwrap();
                let inode: u64 = w[9].parse().unwrap();
                if mine.contains(&inode) {
                    out.push((inode, port));
                }
            }
        }
    }
    out
}

/// UCX's own listening socket (its TCP transport's, which peers' endpoints connect to; kvxfer
/// makes no UCX listener of its own): idle, garbage-sending and trickling clients neither
/// crash the process nor keep a real peer from connecting and moving bytes over UCX.
#[test]
fn ucx_own_tcp_socket_survives_idle_garbage_and_slow_clients() {
    let _one = serial();
    let before: Vec<u64> = listening().into_iter().map(|l| l.0).collect();
    // UCX carries the bytes (no kvxfer lane).
    let mk = |n: &str| {
        Agent::new(
            AgentConfig::new(n)
                .transport(Transport::Tcp)
                .lanes(false)
                .ucx_tcp(true)
                .net_devices("lo"),
        )
        .unwrap()
    };
    let a = mk("hz-ucx-a");
    let region = a.register(HostBuffer::new(LEN).unwrap()).unwrap();
    region.write(0, &vec![0x3a; LEN]).unwrap();
    let side = a.listen("127.0.0.1:0").unwrap();
    let ucx: Vec<SocketAddr> = listening()
        .into_iter()
        .filter(|l| !before.contains(&l.0) && l.1 != side.port())
        .map(|l| SocketAddr::from(([127, 0, 0, 1], l.1)))
        .collect();
    println!("UCX listens on {ucx:?}");
    let b0 = mk("hz-ucx-b0");
    let (h0, m0) = real_peer(&b0, side, 0x3a);
    drop(b0);
    region.write(0, &vec![0x3a; LEN]).unwrap();
    let fds0 = count("/proc/self/fd");
    let mut held = Vec::new();
    let stop = Arc::new(AtomicBool::new(false));
    let mut slow = Vec::new();
    for &to in &ucx {
        for _ in 0..200 {
            if let Ok(s) = TcpStream::connect(to) {
                held.push(s);
            }
        }
        for k in 0..10u8 {
            if let Ok(mut s) = TcpStream::connect(to) {
                let _ = s.write_all(&[0xff ^ k; 4096]);
                held.push(s);
            }
        }
        for _ in 0..10 {
            slow.push(trickle(to, vec![0x01, 0x00, 0x00, 0x00], stop.clone()));
        }
    }
    std::thread::sleep(Duration::from_millis(500));
    let b = mk("hz-ucx-b");
    let (h, m) = real_peer(&b, side, 0x3a);
    let fds = count("/proc/self/fd").saturating_sub(fds0 + held.len());
    println!(
        "UCX's socket with 200 idle, 10 garbage and 10 slow clients: handshake {h:?} (alone \
         {h0:?}), 2 MiB over UCX moved and verified in {m:?} (alone {m0:?}); the process holds \
         {fds} sockets for them"
    );
    assert!(h < Duration::from_secs(2), "handshake took {h:?}");
    assert!(m < Duration::from_secs(10), "transfers took {m:?}");
    stop.store(true, Ordering::Release);
    for t in slow {
        t.join().unwrap();
    }
}
