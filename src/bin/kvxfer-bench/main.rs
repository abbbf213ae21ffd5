//! kvxfer-bench: moves KV-shaped data between two processes (or hosts) and reports throughput,
//! with references measured in the same run; and `kvxfer-bench plan` turns a model, a prompt
//! length, a concurrency and a link into handoff time and memory.
//!
//! With no arguments it moves one Qwen3-0.6B request (2,371 tokens: 8,344 blocks x 32 KiB =
//! 273,416,192 B at random block slots on both sides) to a peer process it starts itself,
//! verifies the bytes, and prints a table. `--op`, `--transport`, `--blocks`, `--block-size`
//! and `--placement` take comma-separated lists: the bench runs every combination (a sweep).
//!
//! Two hosts: run `kvxfer-bench --listen 0.0.0.0:0` on one (it prints its control address),
//! and `kvxfer-bench --connect HOST:PORT` on the other; or, through etcd (feature `etcd`),
//! `kvxfer-bench --etcd URL --serve` on one and `kvxfer-bench --etcd URL` on the other.
//!
//! Modules: `cli` (arguments), `plan`, `workload` (buffers, placement, patterns), `peer` (the
//! peer process), `control` (starting and driving it), `sweep` (cases and runs), `report`
//! (rows, medians), `reference` (memcpy and plain TCP, same run).

mod cli;
mod codec_report;
mod control;
mod kvdata;
mod peer;
mod plan;
mod reference;
mod registry;
mod report;
mod sweep;
mod workload;

use clap::Parser;

use crate::cli::{Args, Cmd};
use crate::peer::serve;
use crate::plan::plan;
use crate::sweep::sweep;

pub(crate) type BoxErr = Box<dyn std::error::Error>;

fn main() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("error")).init();
    let args = Args::parse();
    kvxfer::stop::install();
    let r = match (&args.cmd, args.listen) {
        (Some(Cmd::Plan(p)), _) => plan(p),
        (None, Some(addr)) => serve(&args, addr),
        (None, None) if args.serve => args
            .etcd
            .as_deref()
            .map_or(Err("--serve needs --etcd".into()), registry::ip_towards)
            .and_then(|ip| serve(&args, std::net::SocketAddr::new(ip, 0))),
        (None, None) => sweep(&args),
    };
    if kvxfer::stop::requested() {
        // Asked to stop: what was in flight finished or was cancelled, memory deregistered,
        // the agent closed. An order, not a failure.
        eprintln!(
            "kvxfer-bench: stopped by {}{}; left: {}",
            kvxfer::stop::reason().unwrap_or("a signal"),
            r.err().map_or(String::new(), |e| format!(" ({e})")),
            kvxfer::live::live()
        );
        return;
    }
    if let Err(e) = r {
        eprintln!("kvxfer-bench: {e}");
        std::process::exit(1);
    }
}
