//! Chaos through the connector: KV-shaped handoffs from a prefill worker process to a decode
//! worker process, pull or push, partial and full, while a driver (this process) SIGKILLs and
//! restarts either worker, SIGSTOPs either past its lease, and (with `--netns`) cuts and
//! restores the link between them. Every completed load is checked byte for byte; every
//! failed load must come back typed, with its blocks; at the end no block is held on the
//! prefill side, no request is stuck, and no worker's RSS grew by 32 MiB beyond what its
//! 64 MiB memory budget holds, in any incarnation (a killed one measured just before its
//! kill, the survivors at the end).
//!
//! ```text
//! cargo run --release --example chaos -- --seconds 60 --mode pull
//! cargo run --release --example chaos -- --seconds 60 --mode push --transport shm
//! sudo target/.../examples/chaos --seconds 60 --netns      # the workers in two namespaces
//! cargo run --release --example chaos -- --seconds 120 --hostile   # and a hostile peer
//! ```
//!
//! Requests are 4 blocks of Qwen3-0.6B KV (7.3 MB), partial (a cached prefix of 0-3 blocks)
//! or full, 4 in flight. The driver talks to its workers over their stdin and stdout (which
//! reach into a namespace), the workers to each other only through kvxfer. Prints one JSON
//! line of figures; exits 1 if anything was lost.

#![allow(clippy::unwrap_used, clippy::expect_used)] // An example: fail loudly.

#[path = "../common/hello.rs"]
mod hello;
#[path = "../common/hex.rs"]
mod hex;
#[path = "../common/kv_cache.rs"]
mod kv_cache;

mod driver;
mod hostile;
mod net;
mod workers;

use std::time::Duration;

use kvxfer::connector::{ConnectorConfig, Mode};

/// Blocks per request.
const PER_SLOT: u64 = 4;
/// Requests in flight.
const SLOTS: usize = 4;
/// The producer's lease.
const LEASE: Duration = Duration::from_secs(2);
/// Tokens per request.
const TOKENS: u64 = PER_SLOT * 16;

/// The command line, for every role.
#[derive(Clone)]
struct Args {
    role: String,
    seconds: u64,
    mode: Mode,
    transport: String,
    seed: u64,
    /// Driver: run the workers in two network namespaces and cut the link between them.
    netns: bool,
    /// Driver: a hostile peer floods the prefill worker meanwhile (`hostile.rs`).
    hostile: bool,
    /// Both workers share this secret: sealed lanes, sealed handoffs, and in-host (transport
    /// `shm`) the TCP lane's windows.
    secret: Option<String>,
    /// The workers' caches open only through grants (`Share::Only(vec![])`): every handoff on
    /// the TCP lane, in-host through its window with a secret.
    lane_only: bool,
    /// With a secret in one host: the TCP lane's data on the socket, not through windows.
    no_lane_window: bool,
    /// Worker: the address its side channel binds.
    bind: String,
    /// Worker: the network device its transports use.
    dev: String,
}

fn parse() -> Args {
    let mut a = Args {
        role: "driver".into(),
        seconds: 30,
        mode: Mode::Pull,
        transport: "tcp".into(),
        seed: 1,
        netns: false,
        hostile: false,
        secret: None,
        lane_only: false,
        no_lane_window: false,
        bind: "127.0.0.1".into(),
        dev: "lo".into(),
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
            "--netns" => a.netns = true,
            "--hostile" => a.hostile = true,
            "--secret" => a.secret = Some(v()),
            "--lane-only" => a.lane_only = true,
            "--no-lane-window" => a.no_lane_window = true,
            "--bind" => a.bind = v(),
            "--dev" => a.dev = v(),
            _ => panic!(
                "usage: chaos [--seconds N] [--mode pull|push] [--transport tcp|shm] [--seed S] \
                 [--netns] [--hostile] [--secret S] [--lane-only] [--no-lane-window]"
            ),
        }
    }
    a
}

fn cfg(mode: Mode) -> ConnectorConfig {
    ConnectorConfig::default()
        .mode(mode)
        .lease(LEASE)
        .heartbeat(Duration::from_millis(200))
}

fn mode_name(m: Mode) -> &'static str {
    if m == Mode::Pull {
        "pull"
    } else {
        "push"
    }
}

/// Resident memory of process `pid` (`self` for this one), bytes.
fn rss(pid: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/statm"))
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .unwrap_or(0)
        * 4096
}

fn main() {
    // The workers' kvxfer logs on stderr with RUST_LOG (off by default).
    let _ = env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("off"))
        .try_init();
    let a = parse();
    match a.role.as_str() {
        "prefill" => workers::prefill(&a),
        "decode" => workers::decode(&a),
        _ => driver::run(&a),
    }
}
