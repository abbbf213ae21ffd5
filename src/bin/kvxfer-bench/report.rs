//! Rows of the table (or JSON lines), medians, the progress bar.

use std::time::{Duration, Instant};

use crate::workload::Case;

pub(crate) struct Row {
    pub(crate) case: Case,
    pub(crate) lane: String,
    pub(crate) transports: String,
    pub(crate) bytes: u64,
    pub(crate) ops: usize,
    pub(crate) iters: usize,
    pub(crate) median: f64,
    pub(crate) min: f64,
    pub(crate) max: f64,
    pub(crate) gbps: f64,
    pub(crate) verified: bool,
    pub(crate) memcpy_ms: Option<f64>,
    pub(crate) tcp_ms: Option<f64>,
    /// The plain TCP stream walking buffers the size of the transfer.
    pub(crate) tcp_mem_ms: Option<f64>,
    /// A line on what compression did, when the run compressed.
    pub(crate) codec: Option<String>,
    pub(crate) json: serde_json::Value,
}

pub(crate) fn print_header(reference: bool) {
    print!(
        "{:<6} {:<10} {:<10} {:<18} {:>12} {:>6} {:>6} {:>9} {:>9} {:>9} {:>7}",
        "op",
        "placement",
        "lane",
        "ucx transports",
        "bytes",
        "descs",
        "ops",
        "median_ms",
        "min_ms",
        "max_ms",
        "GB/s"
    );
    if reference {
        print!(
            " {:>9} {:>8} {:>9} {:>6} {:>10} {:>9}",
            "memcpy_ms", "x_memcpy", "tcp_ms", "x_tcp", "tcpmem_ms", "x_tcpmem"
        );
    }
    println!(" {:>8}", "verified");
}

pub(crate) fn print_row(r: &Row, reference: bool) {
    print!(
        "{:<6} {:<10} {:<10} {:<18} {:>12} {:>6} {:>6} {:>9.2} {:>9.2} {:>9.2} {:>7.2}",
        format!("{:?}", r.case.op).to_lowercase(),
        r.case.placement.name(),
        r.lane,
        r.transports,
        r.bytes,
        r.case.blocks,
        r.ops,
        r.median,
        r.min,
        r.max,
        r.gbps
    );
    if reference {
        let f = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.2}"));
        print!(
            " {:>9} {:>8} {:>9} {:>6} {:>10} {:>9}",
            f(r.memcpy_ms),
            f(r.memcpy_ms.map(|m| r.median / m)),
            f(r.tcp_ms),
            f(r.tcp_ms.map(|t| r.median / t)),
            f(r.tcp_mem_ms),
            f(r.tcp_mem_ms.map(|t| r.median / t))
        );
    }
    println!(" {:>8}", r.verified);
    if let Some(c) = &r.codec {
        println!("       {c}");
    }
    let _ = r.iters;
}

pub(crate) fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Shows a progress bar on a terminal once a run has taken more than a second.
pub(crate) struct Progress {
    pub(crate) on: bool,
    pub(crate) t0: Instant,
    pub(crate) shown: bool,
}

impl Progress {
    pub(crate) fn new(on: bool) -> Self {
        Progress {
            on,
            t0: Instant::now(),
            shown: false,
        }
    }
    pub(crate) fn tick(&mut self, done: usize, total: usize, what: &str) {
        if !self.on || self.t0.elapsed() < Duration::from_secs(1) {
            return;
        }
        let w = 30;
        let k = done * w / total.max(1);
        eprint!(
            "\r[{}{}] {done}/{total} {what}   ",
            "#".repeat(k),
            " ".repeat(w - k)
        );
        self.shown = true;
    }
    pub(crate) fn end(&self) {
        if self.shown {
            eprint!("\r{}\r", " ".repeat(60));
        }
    }
}
