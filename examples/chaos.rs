//! Chaos through the connector: KV-shaped handoffs between a prefill worker (a child process)
//! and this decode worker while a driver SIGKILLs and restarts the prefill worker and
//! SIGSTOPs it past its lease. Every completed load is checked byte for byte; every failed
//! load must come back typed, with its blocks; at the end no block is held on the prefill
//! side, no request is stuck, and the decode worker's RSS is flat.
//!
//! ```text
//! cargo run --release --example chaos -- --seconds 60 --mode pull
//! cargo run --release --example chaos -- --seconds 60 --mode push --transport shm
//! ```
//!
//! Requests are 4 blocks of Qwen3-0.6B KV (7.3 MB), partial (a cached prefix of 0-3 blocks)
//! or full, 4 in flight. Prints one JSON line of figures; exits 1 if anything was lost.

#![allow(clippy::unwrap_used, clippy::expect_used)] // An example: fail loudly.

#[path = "common/hex.rs"]
mod hex;
use hex::{hex, unhex};
#[path = "common/kv_cache.rs"]
mod kv_cache;

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kv_cache::{cache_of, fill_or_check, slot_blocks_of};
use kvxfer::connector::{ConnectorConfig, Consumer, Handoff, Mode, Producer};
use kvxfer::{Agent, AgentConfig, Transport};

const PER_SLOT: u64 = 4;
const SLOTS: usize = 4;
const LEASE: Duration = Duration::from_secs(2);
const TOKENS: u64 = PER_SLOT * 16;

struct Args {
    role: String,
    seconds: u64,
    mode: Mode,
    transport: String,
    seed: u64,
}

fn parse() -> Args {
    let mut a = Args {
        role: "decode".into(),
        seconds: 30,
        mode: Mode::Pull,
        transport: "tcp".into(),
        seed: 1,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().expect("a value");
        match k.as_str() {
            "--role" => a.role = v(),
            "--seconds" => a.seconds = v().parse().unwrap(),
            "--mode" => {
                a.mode = if v() == "push" {
                    Mode::Push
                } else {
                    Mode::Pull
                }
            }
            "--transport" => a.transport = v(),
            "--seed" => a.seed = v().parse().unwrap(),
            _ => panic!(
                "usage: chaos [--seconds N] [--mode pull|push] [--transport tcp|shm] [--seed S]"
            ),
        }
    }
    a
}

fn agent(name: &str, transport: &str) -> Agent {
    Agent::new(
        AgentConfig::new(name)
            .transport(Transport::parse(transport))
            .net_devices("lo"),
    )
    .unwrap()
}

fn cfg(mode: Mode) -> ConnectorConfig {
    ConnectorConfig {
        mode,
        lease: LEASE,
        heartbeat: Duration::from_millis(200),
        ..Default::default()
    }
}

/// The prefill worker: publishes each request it is asked for; answers HELD with the blocks
/// its producer still holds.
fn prefill(a: &Args) {
    let ag = Arc::new(agent("chaos-prefill", &a.transport));
    let (region, layout) = cache_of(&ag, SLOTS, PER_SLOT);
    let side = ag.listen("127.0.0.1:0").unwrap();
    let producer =
        Arc::new(Producer::new(ag.clone(), layout.clone(), cfg(a.mode), Some(side)).unwrap());
    let ctl = TcpListener::bind("127.0.0.1:0").unwrap();
    println!("READY ctl={} side={side}", ctl.local_addr().unwrap());
    std::io::stdout().flush().unwrap();
    let (region, layout) = (Arc::new(region), Arc::new(layout));
    for s in ctl.incoming() {
        let Ok(s) = s else { continue };
        let (producer, region, layout) = (producer.clone(), region.clone(), layout.clone());
        std::thread::spawn(move || {
            let mut rd = BufReader::new(s.try_clone().unwrap());
            let mut wr = s;
            let mut line = String::new();
            while rd.read_line(&mut line).unwrap_or(0) > 0 {
                let w: Vec<String> = line.split_whitespace().map(String::from).collect();
                line.clear();
                let reply = match w.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
                    ["REQ", req, slot] => {
                        let (req, slot): (u64, usize) =
                            (req.parse().unwrap(), slot.parse().unwrap());
                        let blocks = slot_blocks_of(slot, PER_SLOT);
                        // The slot's blocks are reused once the request before was freed (by
                        // its acknowledgement, or its lease).
                        if let Some(prev) = req.checked_sub(SLOTS as u64) {
                            let _ = producer.wait_freed(&format!("req-{prev}"), LEASE * 2);
                        }
                        fill_or_check(&region, &layout, req, 0..blocks.len(), &blocks, false);
                        match producer.publish(
                            &format!("req-{req}"),
                            &blocks,
                            TOKENS,
                            layout.layers.len(),
                        ) {
                            Ok(h) => hex(&h.encode()),
                            Err(e) => format!("ERR {e}"),
                        }
                    }
                    ["HELD"] => producer.held().to_string(),
                    _ => return,
                };
                if writeln!(wr, "{reply}").is_err() {
                    return;
                }
            }
        });
    }
}

/// The prefill worker as the driver sees it.
struct Prefill {
    child: Child,
    ctl: SocketAddr,
}

fn start_prefill(a: &Args, decode: &Agent) -> Prefill {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--role", "prefill", "--transport", &a.transport])
        .args(["--mode", if a.mode == Mode::Pull { "pull" } else { "push" }])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut l = String::new();
    out.read_line(&mut l).unwrap();
    let get = |k: &str| -> SocketAddr {
        l.split_whitespace()
            .find_map(|w| w.strip_prefix(k))
            .unwrap_or_else(|| panic!("prefill said {l:?}"))
            .parse()
            .unwrap()
    };
    let (ctl, side) = (get("ctl="), get("side="));
    // A restart: the decode worker learns the new incarnation (its epoch) and drops the old.
    decode.connect(side).unwrap();
    Prefill { child, ctl }
}

fn rss() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .unwrap_or(0)
        * 4096
}

#[derive(Default)]
struct Tally {
    /// Loads refused at their start (typed; nothing touched).
    refused: AtomicU64,
    /// Loads that neither completed nor failed within a minute.
    stuck: AtomicU64,
    /// The longest a load took to end, ms.
    longest_ms: AtomicU64,
    /// The kinds of errors seen, with counts.
    errors: Mutex<std::collections::BTreeMap<String, u64>>,
    completed: AtomicU64,
    verified: AtomicU64,
    failed: AtomicU64,
    failed_blocks: AtomicU64,
    untyped: AtomicU64,
    bad_bytes: AtomicU64,
    no_handoff: AtomicU64,
    kills: AtomicU64,
    stops: AtomicU64,
}

impl Tally {
    /// Counts an error by its kind (its text after the request's name).
    fn note(&self, e: &kvxfer::Error) {
        let t = e.to_string();
        let kind: String = t
            .split_once(": ")
            .map_or(t.as_str(), |(_, rest)| rest)
            .chars()
            .take(60)
            .collect();
        *self.errors.lock().unwrap().entry(kind).or_default() += 1;
    }
}

fn decode(a: &Args) {
    let ag = Arc::new(agent("chaos-decode", &a.transport));
    let (region, layout) = cache_of(&ag, SLOTS, PER_SLOT);
    let consumer = Arc::new(Consumer::new(ag.clone(), layout.clone(), cfg(a.mode)).unwrap());
    let prefill = Arc::new(Mutex::new(start_prefill(a, &ag)));
    let (region, layout) = (Arc::new(region), Arc::new(layout));
    let tally = Arc::new(Tally::default());
    let failures = Arc::new(Mutex::new(std::collections::HashMap::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let rss0 = Arc::new(AtomicU64::new(0));
    let t0 = Instant::now();
    let workers: Vec<_> = (0..SLOTS)
        .map(|slot| {
            let failures = failures.clone();
            let (consumer, region, layout, prefill, tally, stop, rss0) = (
                consumer.clone(),
                region.clone(),
                layout.clone(),
                prefill.clone(),
                tally.clone(),
                stop.clone(),
                rss0.clone(),
            );
            let seed = a.seed;
            std::thread::spawn(move || {
                let blocks = slot_blocks_of(slot, PER_SLOT);
                let mut conn: Option<(SocketAddr, BufReader<TcpStream>, TcpStream)> = None;
                let mut k = 0u64;
                while !stop.load(Ordering::Acquire) {
                    // Requests go to the slot whose blocks they use: req % SLOTS == slot, and
                    // the one before in this slot is req - SLOTS.
                    let req = k * SLOTS as u64 + slot as u64;
                    k += 1;
                    if req == 400 {
                        rss0.store(rss(), Ordering::Release);
                    }
                    let ctl = prefill.lock().unwrap().ctl;
                    if conn.as_ref().is_none_or(|c| c.0 != ctl) {
                        conn = TcpStream::connect(ctl)
                            .ok()
                            .map(|s| (ctl, BufReader::new(s.try_clone().unwrap()), s));
                    }
                    let Some((_, rd, wr)) = conn.as_mut() else {
                        tally.no_handoff.fetch_add(1, Ordering::Relaxed);
                        std::thread::sleep(Duration::from_millis(50));
                        continue;
                    };
                    let mut line = String::new();
                    let tq = Instant::now();
                    let asked = writeln!(wr, "REQ {req} {slot}").is_ok();
                    let h = (asked && rd.read_line(&mut line).unwrap_or(0) > 0)
                        .then(|| unhex(line.trim()).and_then(|b| Handoff::decode(&b).ok()))
                        .flatten();
                    let Some(h) = h else {
                        // The prefill worker died or stopped answering before it published.
                        tally.no_handoff.fetch_add(1, Ordering::Relaxed);
                        conn = None;
                        continue;
                    };
                    // Partial or full: a cached prefix of 0..PER_SLOT blocks, already here.
                    let cached =
                        ((req ^ seed).wrapping_mul(0x9e37_79b9) >> 7) as usize % PER_SLOT as usize;
                    fill_or_check(&region, &layout, req, 0..cached, &blocks, false);
                    let tl = Instant::now();
                    // Refused at the start (the handoff expired while the prefill worker was
                    // stopped, say): typed, and nothing of the blocks to load was touched.
                    if let Err(e) = consumer.start_load(&h, &blocks[cached..]) {
                        tally.refused.fetch_add(1, Ordering::Relaxed);
                        tally.note(&e);
                        continue;
                    }
                    // A load ends, completed or failed, on its own: waiting is only for it.
                    let mut r = consumer.wait(&h.request, LEASE * 5);
                    while matches!(r, Err(kvxfer::Error::WaitTimeout(_)))
                        && tl.elapsed() < Duration::from_secs(60)
                    {
                        r = consumer.wait(&h.request, LEASE * 5);
                    }
                    tally
                        .longest_ms
                        .fetch_max(tl.elapsed().as_millis() as u64, Ordering::Relaxed);
                    if matches!(r, Err(kvxfer::Error::WaitTimeout(_))) {
                        tally.stuck.fetch_add(1, Ordering::Relaxed);
                    }
                    if std::env::var("CHAOS_DEBUG").is_ok() {
                        eprintln!(
                            "req {req}: handoff after {:?}, load {:?} {r:?}",
                            tl.duration_since(tq),
                            tl.elapsed()
                        );
                    }
                    match r {
                        Ok(()) => {
                            tally.completed.fetch_add(1, Ordering::Relaxed);
                            let _ = consumer.take_stats(&h.request);
                            if fill_or_check(&region, &layout, req, 0..blocks.len(), &blocks, true)
                            {
                                tally.verified.fetch_add(1, Ordering::Relaxed);
                            } else {
                                tally.bad_bytes.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        Err(e) => {
                            tally.failed.fetch_add(1, Ordering::Relaxed);
                            tally.note(&e);
                            // A failed load names its blocks (the ones it was to load).
                            // Failures queue in order; take them all, keep the others'.
                            let f = {
                                let mut g = failures.lock().unwrap();
                                for f in consumer.take_failed() {
                                    g.insert(f.request.clone(), f);
                                }
                                g.remove(&h.request)
                            };
                            match f {
                                Some(f) if f.invalid_blocks == blocks[cached..] => {
                                    tally.failed_blocks.fetch_add(
                                        f.invalid_blocks.len() as u64,
                                        Ordering::Relaxed,
                                    );
                                }
                                f => {
                                    eprintln!(
                                        "chaos: {}: {e} without its blocks {:?}: {f:?}",
                                        h.request,
                                        &blocks[cached..]
                                    );
                                    tally.untyped.fetch_add(1, Ordering::Relaxed);
                                }
                            }
                        }
                    }
                }
            })
        })
        .collect();

    // The driver: a fault every 1-3 s.
    let mut x = a.seed | 1;
    let end = t0 + Duration::from_secs(a.seconds);
    while Instant::now() < end {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        std::thread::sleep(Duration::from_millis(1000 + x % 2000));
        let mut p = prefill.lock().unwrap();
        if (x >> 11).is_multiple_of(2) {
            let _ = p.child.kill();
            let _ = p.child.wait();
            *p = start_prefill(a, &ag);
            tally.kills.fetch_add(1, Ordering::Relaxed);
        } else {
            let pid = p.child.id() as i32;
            drop(p);
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(pid, libc::SIGSTOP) };
            std::thread::sleep(LEASE + Duration::from_secs(1));
            // SAFETY: as above.
            unsafe { libc::kill(pid, libc::SIGCONT) };
            tally.stops.fetch_add(1, Ordering::Relaxed);
        }
    }
    stop.store(true, Ordering::Release);
    let stuck_until = Instant::now() + LEASE * 10;
    for w in workers {
        while !w.is_finished() && Instant::now() < stuck_until {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(w.is_finished(), "a request is stuck");
        w.join().unwrap();
    }
    // Nothing held on the prefill side once the leases ran out.
    std::thread::sleep(LEASE + Duration::from_millis(500));
    let ctl = prefill.lock().unwrap().ctl;
    let s = TcpStream::connect(ctl).unwrap();
    let mut rd = BufReader::new(s.try_clone().unwrap());
    let mut wr = s;
    writeln!(wr, "HELD").unwrap();
    let mut held = String::new();
    rd.read_line(&mut held).unwrap();
    let held: u64 = held.trim().parse().unwrap();
    let in_progress = consumer.in_progress();
    let t = |c: &AtomicU64| c.load(Ordering::Relaxed);
    let (rss_a, rss_b) = (rss0.load(Ordering::Acquire), rss());
    println!(
        "{{\"seconds\":{},\"mode\":\"{:?}\",\"transport\":\"{}\",\"handoffs\":{},\"refused_at_start\":{},\"completed\":{},\"verified\":{},\"bad_bytes\":{},\"failed\":{},\"failed_blocks\":{},\"failed_untyped\":{},\"stuck\":{},\"longest_load_ms\":{},\"no_handoff\":{},\"sigkills\":{},\"sigstops\":{},\"held_at_end\":{held},\"in_progress_at_end\":{in_progress},\"rss_mib_at_400\":{:.1},\"rss_mib_end\":{:.1}}}",
        t0.elapsed().as_secs(),
        a.mode,
        a.transport,
        t(&tally.completed) + t(&tally.failed) + t(&tally.refused),
        t(&tally.refused),
        t(&tally.completed),
        t(&tally.verified),
        t(&tally.bad_bytes),
        t(&tally.failed),
        t(&tally.failed_blocks),
        t(&tally.untyped),
        t(&tally.stuck),
        t(&tally.longest_ms),
        t(&tally.no_handoff),
        t(&tally.kills),
        t(&tally.stops),
        rss_a as f64 / (1 << 20) as f64,
        rss_b as f64 / (1 << 20) as f64,
    );
    for (kind, n) in tally.errors.lock().unwrap().iter() {
        eprintln!("chaos: {n} x {kind}");
    }
    let mut p = prefill.lock().unwrap();
    let _ = p.child.kill();
    let _ = p.child.wait();
    let lost =
        t(&tally.bad_bytes) + t(&tally.untyped) + t(&tally.stuck) + held + in_progress as u64;
    if lost > 0 || t(&tally.verified) == 0 {
        eprintln!("chaos: something was lost");
        std::process::exit(1);
    }
}

fn main() {
    let a = parse();
    if a.role == "prefill" {
        prefill(&a);
    } else {
        decode(&a);
    }
}
