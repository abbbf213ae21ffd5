//! The TCP lane target's stall clock, through a real socket with a 1 s limit: a write whose
//! data trickles in for longer than the limit lands whole, and so does a read whose initiator
//! drains it slowly (the clock restarts whenever bytes move); a write whose data stops, and a
//! read whose initiator stops reading, are dropped once the limit passes, not before, with
//! nothing delivered, and the target goes on serving.

#![allow(clippy::unwrap_used)] // Tests fail loudly on purpose.

#[path = "support/lane_client.rs"]
mod lane_client;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use kvxfer::{Agent, AgentConfig, HostBuffer, Region, Transport};
use kvxfer_proto::wire::lane::{ReplyHeader, RequestHeader, Segment, K_DATA, K_READ, K_WRITE};

const STALL: Duration = Duration::from_secs(1);
const LEN: usize = 32 << 20;

fn target(tag: &str) -> (Agent, Region) {
    let _ = env_logger::builder().is_test(true).try_init();
    let b = Agent::new(
        AgentConfig::new(format!("stall-{tag}-{}", std::process::id()))
            .transport(Transport::Tcp)
            .net_devices("lo")
            .lane_stall(STALL),
    )
    .unwrap();
    let r = b.register(HostBuffer::new(LEN).unwrap()).unwrap();
    (b, r)
}

/// A request's header and its one segment: `len` bytes at the start of `region`.
fn request(kind: u8, id: u64, region: u32, len: u64) -> Vec<u8> {
    let mut b = Vec::new();
    RequestHeader {
        kind,
        id,
        nsegs: 1,
        notif_len: 0,
        frames: None,
        paged: false,
    }
    .encode(&mut b);
    Segment {
        region,
        offset: 0,
        len,
    }
    .encode(&mut b);
    b
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn snapshot(r: &Region, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    r.read(0, &mut v).unwrap();
    v
}

/// Reads until the peer closes; returns the bytes read and when the close came.
fn until_closed(c: &mut TcpStream, within: Duration) -> (usize, Instant) {
    c.set_read_timeout(Some(within)).unwrap();
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0;
    loop {
        match c.read(&mut buf) {
            Ok(0) => return (n, Instant::now()),
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                return (n, Instant::now())
            }
            Err(e) => panic!("the target kept a stalled connection open: {e}"),
        }
    }
}

#[test]
fn a_write_that_trickles_for_longer_than_the_limit_lands_whole() {
    let (b, r) = target("wtrickle");
    let mut c = lane_client::connect(&b);
    let len = 2 << 20;
    let data = pattern(len, 7);
    c.write_all(&request(K_WRITE, 1, r.id().0, len as u64))
        .unwrap();
    // 128 KiB every 150 ms: 2.4 s of data, gaps longer than the socket tick.
    let t0 = Instant::now();
    for piece in data.chunks(128 << 10) {
        c.write_all(piece).unwrap();
        std::thread::sleep(Duration::from_millis(150));
    }
    assert!(t0.elapsed() > 2 * STALL);
    let (status, msg) = lane_client::write(&mut c, 1, &[]);
    assert_eq!((status, msg.as_str()), (0, ""), "the trickled write");
    assert!(snapshot(&r, len) == data, "the trickled bytes");
}

#[test]
fn a_read_drained_slowly_for_longer_than_the_limit_arrives_whole() {
    let (b, r) = target("rtrickle");
    let data = pattern(LEN, 3);
    r.write(0, &data).unwrap();
    let mut c = lane_client::connect(&b);
    c.write_all(&request(K_READ, 2, r.id().0, LEN as u64))
        .unwrap();
    let mut h = [0u8; kvxfer_proto::wire::lane::REPLY_FIXED_LEN];
    c.read_exact(&mut h).unwrap();
    let rh = ReplyHeader::read(&h);
    assert_eq!((rh.kind, rh.id, rh.status), (K_DATA, 2, 0));
    let mut msg = vec![0u8; rh.msg_len];
    c.read_exact(&mut msg).unwrap();
    // 2 MiB every 200 ms: 3.2 s for 32 MiB, the target's sends blocked in between.
    let t0 = Instant::now();
    let mut got = vec![0u8; LEN];
    for piece in got.chunks_mut(2 << 20) {
        std::thread::sleep(Duration::from_millis(200));
        c.read_exact(piece).unwrap();
    }
    assert!(t0.elapsed() > 2 * STALL);
    assert!(got == data, "the slowly drained bytes");
}

#[test]
fn a_write_whose_data_stops_is_dropped_after_the_limit_and_nothing_is_delivered() {
    let (b, r) = target("wstop");
    let before = snapshot(&r, LEN);
    let mut c = lane_client::connect(&b);
    let len = 2 << 20;
    let mut req = request(K_WRITE, 3, r.id().0, len as u64);
    req.extend_from_slice(&pattern(len / 4, 9));
    c.write_all(&req).unwrap();
    let quiet = Instant::now();
    let (_, closed) = until_closed(&mut c, 4 * STALL);
    let waited = closed - quiet;
    println!("dropped {waited:?} after the data stopped (limit {STALL:?})");
    assert!(
        waited >= STALL,
        "dropped after {waited:?}, before the limit"
    );
    assert!(waited < 3 * STALL, "dropped only after {waited:?}");
    assert!(b.try_notification().is_none());
    // Only what arrived may have landed; the target serves the next connection.
    let after = snapshot(&r, LEN);
    assert!(
        after[len / 4..] == before[len / 4..],
        "bytes that never came"
    );
    let mut c = lane_client::connect(&b);
    let data = pattern(len, 1);
    let mut req = request(K_WRITE, 4, r.id().0, len as u64);
    req.extend_from_slice(&data);
    let (status, msg) = lane_client::write(&mut c, 4, &req);
    assert_eq!((status, msg.as_str()), (0, ""));
    assert!(snapshot(&r, len) == data);
}

#[test]
fn a_read_whose_initiator_stops_reading_is_dropped_after_the_limit() {
    let (b, r) = target("rstop");
    let mut c = lane_client::connect(&b);
    c.write_all(&request(K_READ, 5, r.id().0, LEN as u64))
        .unwrap();
    // Read nothing: the target's sends block once the socket buffers are full.
    std::thread::sleep(3 * STALL);
    let (n, _) = until_closed(&mut c, 4 * STALL);
    assert!(
        n < LEN,
        "{n} bytes: the whole read arrived, the stall was never seen"
    );
    // The target still serves.
    let mut c = lane_client::connect(&b);
    let len = 1 << 20;
    let data = pattern(len, 5);
    let mut req = request(K_WRITE, 6, r.id().0, len as u64);
    req.extend_from_slice(&data);
    let (status, msg) = lane_client::write(&mut c, 6, &req);
    assert_eq!((status, msg.as_str()), (0, ""));
    assert!(snapshot(&r, len) == data);
}
