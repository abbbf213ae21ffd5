//! A hostile peer beside the workers (`--hostile`), aimed at the prefill worker's current
//! side channel and TCP lane: HELLOs under a new name every 20 ms, their connections held
//! (the oldest of 256 let go); TCP-lane connections that announce a 900,000-segment table
//! and stall (16 held); and garbage on the side channel. The good handoffs must go on as
//! before, nothing lost, the prefill worker's RSS flat.
//!
//! In `scripts/chaos.sh` (TCP, pull and push) and CI (`tests/chaos.rs`). The stalled lane
//! requests are what a worker's RSS grows by: with no memory budget (the library's default)
//! they grew it by 206 MiB in 60 s; with the workers' 64 MiB budget the hostile peer holds
//! at most its share (half), refused past it, and nothing grows beyond what the budget holds.
//! `KVX_HOSTILE` names the attacks to run (default all): `hellos`, `stalls`, `garbage`.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvxfer::{Agent, AgentConfig, Transport};
use kvxfer_proto::wire::lane::{Hello, RequestHeader, K_WRITE, WELCOME_FIXED_LEN};
use kvxfer_proto::wire::metadata::Metadata;
use kvxfer_proto::wire::side_channel::META;

use crate::hello::hello_as;

/// The prefill worker's TCP lane (address, credential), learned from a loaded HELLO's answer.
type LaneSeen = Mutex<Option<(SocketAddr, [u8; 16])>>;

/// What the hostile peer did, for the run's figures.
#[derive(Default)]
pub struct Counts {
    pub loaded: u64,
    pub refused: u64,
    pub stalls: u64,
    pub garbage: u64,
}

/// Runs the three attacks against `target()` (the prefill worker's side channel now) until
/// `stop`.
pub fn run(
    target: Arc<dyn Fn() -> Option<SocketAddr> + Send + Sync>,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<Counts> {
    std::thread::spawn(move || {
        let counts = Arc::new(Mutex::new(Counts::default()));
        // The lane (address, credential) learned from the last loaded HELLO's answer.
        let lane: Arc<LaneSeen> = Arc::default();
        // KVX_HOSTILE names the attacks to run (default all): hellos, stalls, garbage.
        let only = std::env::var("KVX_HOSTILE").unwrap_or_default();
        let on = |k: &str| only.is_empty() || only.split(',').any(|x| x == k);
        let (h_on, s_on, g_on) = (on("hellos"), on("stalls"), on("garbage"));
        let threads = [
            {
                let (t, s, c, l) = (target.clone(), stop.clone(), counts.clone(), lane.clone());
                std::thread::spawn(move || {
                    if h_on {
                        hellos(&*t, &s, &c, &l)
                    }
                })
            },
            {
                let (s, c, l) = (stop.clone(), counts.clone(), lane.clone());
                std::thread::spawn(move || {
                    if s_on {
                        stalls(&s, &c, &l)
                    }
                })
            },
            {
                let (t, s, c) = (target.clone(), stop.clone(), counts.clone());
                std::thread::spawn(move || {
                    if g_on {
                        garbage(&*t, &s, &c)
                    }
                })
            },
        ];
        for t in threads {
            let _ = t.join();
        }
        Arc::try_unwrap(counts)
            .map(|m| m.into_inner().unwrap())
            .unwrap_or_default()
    })
}

fn hellos(
    target: &(dyn Fn() -> Option<SocketAddr> + Send + Sync),
    stop: &AtomicBool,
    counts: &Mutex<Counts>,
    lane: &LaneSeen,
) {
    // A real agent's metadata, renamed each time: every HELLO is a new peer.
    let src = Agent::new(
        AgentConfig::new("chaos-hostile")
            .transport(Transport::Tcp)
            .net_devices("lo"),
    )
    .unwrap();
    let meta = src.metadata().unwrap();
    let mut held = VecDeque::new();
    let mut k = 0u64;
    while !stop.load(Ordering::Acquire) {
        std::thread::sleep(Duration::from_millis(20));
        let Some(side) = target() else { continue };
        k += 1;
        let Ok((s, kind, p)) = hello_as(
            side,
            &meta,
            src.compat(),
            &format!("hostile-{k}"),
            0x4000_0000 + k,
        ) else {
            counts.lock().unwrap().refused += 1;
            continue;
        };
        if kind == META {
            counts.lock().unwrap().loaded += 1;
            if let Some(l) = Metadata::decode(&p, src.compat())
                .ok()
                .and_then(|m| m.tcp_lane())
            {
                *lane.lock().unwrap() = Some((l.addr, l.secret));
            }
        } else {
            counts.lock().unwrap().refused += 1;
        }
        held.push_back(s);
        if held.len() > 256 {
            held.pop_front();
        }
    }
}

fn stalls(stop: &AtomicBool, counts: &Mutex<Counts>, lane: &LaneSeen) {
    let mut held = VecDeque::new();
    while !stop.load(Ordering::Acquire) {
        std::thread::sleep(Duration::from_millis(200));
        let Some((addr, secret)) = *lane.lock().unwrap() else {
            continue;
        };
        let Ok(mut c) = TcpStream::connect_timeout(&addr, Duration::from_secs(1)) else {
            continue;
        };
        let _ = c.set_read_timeout(Some(Duration::from_secs(2)));
        let hello = Hello {
            name: "hostile-lane",
            secret,
            epoch: 0,
        }
        .encode();
        let mut w = [0u8; WELCOME_FIXED_LEN];
        if c.write_all(&hello)
            .and_then(|()| c.read_exact(&mut w))
            .is_err()
        {
            continue;
        }
        let mut h = Vec::new();
        RequestHeader {
            kind: K_WRITE,
            id: 1,
            nsegs: 900_000,
            notif_len: 0,
            frames: None,
            paged: false,
        }
        .encode(&mut h);
        if c.write_all(&h).is_ok() {
            counts.lock().unwrap().stalls += 1;
            held.push_back(c);
            if held.len() > 16 {
                held.pop_front();
            }
        }
    }
}

fn garbage(
    target: &(dyn Fn() -> Option<SocketAddr> + Send + Sync),
    stop: &AtomicBool,
    counts: &Mutex<Counts>,
) {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    while !stop.load(Ordering::Acquire) {
        std::thread::sleep(Duration::from_millis(50));
        let Some(side) = target() else { continue };
        let Ok(mut s) = TcpStream::connect_timeout(&side, Duration::from_secs(1)) else {
            continue;
        };
        let bytes: Vec<u8> = (0..64)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let _ = s.write_all(&bytes);
        counts.lock().unwrap().garbage += 1;
    }
}
