//! Disaggregated serving in two processes: this process plays a decode worker and starts a
//! prefill worker as a child. Both hold Qwen3-0.6B-shaped paged KV caches in host memory
//! (28 layers, 8 KV heads, head dim 128, bf16, 16-token blocks), registered with kvxfer.
//!
//! For every request the prefill worker "computes" its KV (a deterministic pattern per request,
//! block, layer and K/V), publishes a handoff, and the decode worker loads it through the
//! connector: it already holds the first `floor(--prefix-hit x 149)` blocks (it writes them
//! itself, as a prefix cache would have), so only the missing blocks move. The decode worker
//! then checks every byte of all the request's blocks.
//!
//! ```text
//! cargo run --release --example disagg -- --requests 8 --prefix-hit 0.857 --concurrency 8 \
//!     --budget-mib 512 --transport tcp --json
//! ```
//!
//! Prints per-request handoff time and bytes moved vs skipped, then totals and the peak RSS of
//! each process beyond its registered caches; `--json` ends with one JSON line.

#![allow(clippy::unwrap_used, clippy::expect_used)] // An example: fail loudly.

#[path = "common/hex.rs"]
mod hex;
use hex::{hex, unhex};
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvxfer::connector::{ConnectorConfig, Consumer, Handoff, Mode, Producer};
use kvxfer::layout::{Kv, KvLayout};
use kvxfer::{Agent, AgentConfig, MemoryBudget, Region, Transport};

#[path = "common/kv_cache.rs"]
mod kv_cache;

use kv_cache::{
    blocks_per_request, cache, fill_or_check, pattern, slot_blocks, stamp_or_check, TOKENS,
};

struct Args {
    role: String,
    requests: usize,
    prefix_hit: f64,
    concurrency: usize,
    budget_mib: u64,
    transport: String,
    mode: Mode,
    layer_wise: bool,
    json: bool,
    ctl: Option<SocketAddr>,
    /// The prefill's compute per request, spent asleep (a GPU spends it, not this CPU).
    compute_ms: f64,
    /// Stamps at both ends of every block instead of every byte ([`stamp_or_check`]).
    stamp: bool,
}

fn usage() -> ! {
    eprintln!(
        "usage: disagg [--requests N] [--prefix-hit F] [--concurrency C] [--budget-mib M]\n\
         \x20             [--transport tcp|shm] [--mode pull|push] [--layer-wise] [--json]\n\
         \x20             [--compute-ms MS] [--check full|stamp]"
    );
    std::process::exit(2)
}

fn parse() -> Args {
    let mut a = Args {
        role: "decode".into(),
        requests: 4,
        prefix_hit: 0.0,
        concurrency: 1,
        budget_mib: 512,
        transport: "tcp".into(),
        mode: Mode::Pull,
        layer_wise: false,
        json: false,
        ctl: None,
        compute_ms: 0.0,
        stamp: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().unwrap_or_else(|| usage());
        match k.as_str() {
            "--role" => a.role = v(),
            "--requests" => a.requests = v().parse().unwrap_or_else(|_| usage()),
            "--prefix-hit" => a.prefix_hit = v().parse().unwrap_or_else(|_| usage()),
            "--concurrency" => a.concurrency = v().parse().unwrap_or_else(|_| usage()),
            "--budget-mib" => a.budget_mib = v().parse().unwrap_or_else(|_| usage()),
            "--transport" => a.transport = v(),
            "--mode" => {
                a.mode = match v().as_str() {
                    "pull" => Mode::Pull,
                    "push" => Mode::Push,
                    _ => usage(),
                }
            }
            "--layer-wise" => a.layer_wise = true,
            "--json" => a.json = true,
            "--ctl" => a.ctl = Some(v().parse().unwrap_or_else(|_| usage())),
            "--compute-ms" => a.compute_ms = v().parse().unwrap_or_else(|_| usage()),
            "--check" => {
                a.stamp = match v().as_str() {
                    "full" => false,
                    "stamp" => true,
                    _ => usage(),
                }
            }
            _ => usage(),
        }
    }
    if !(0.0..=1.0).contains(&a.prefix_hit)
        || a.concurrency == 0
        || a.requests == 0
        || !(a.compute_ms >= 0.0 && a.compute_ms.is_finite())
    {
        usage();
    }
    a
}

fn peak_rss() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap_or(0)
        * 1024
}

fn agent(name: &str, transport: &str) -> Agent {
    Agent::new(
        AgentConfig::new(format!("{name}-{}", std::process::id()))
            .transport(Transport::parse(transport))
            .net_devices("lo"),
    )
    .unwrap()
}

fn connector_cfg(a: &Args) -> ConnectorConfig {
    ConnectorConfig::default()
        .mode(a.mode)
        .budget(MemoryBudget::new(a.budget_mib << 20))
}

/// Bytes of the caches this process has in its RSS: its own, and with the shared-memory lane
/// the peer's it maps (both are memfd-backed and fully touched).
fn cache_rss(own: u64, peer: u64, transport: &str) -> u64 {
    own + if transport == "shm" || transport == "auto" {
        peer
    } else {
        0
    }
}

/// Done, or stopped by a signal: what is left of kvxfer in this process (nothing, once it has
/// dropped its connector, caches and agent), for the last line on stderr.
fn stopped(who: &str) {
    eprintln!(
        "disagg {who}: {}; left: {}",
        kvxfer::stop::reason().map_or("done".to_string(), |r| format!("stopped by {r}")),
        kvxfer::live::live()
    );
}

fn prefill(a: &Args) {
    let extra = serve_prefill(a);
    // Ended by its decode worker closing the control connections, or by a signal: either
    // way, what is left of kvxfer in it (nothing).
    stopped("prefill");
    println!("PEAK_EXTRA {extra}");
}

/// The prefill worker until its decode worker closes the control connections (or a signal
/// stops it); its peak RSS beyond the caches.
fn serve_prefill(a: &Args) -> u64 {
    let ag = agent("prefill", &a.transport);
    let (region, layout) = cache(&ag, a.concurrency);
    let side = ag.listen("127.0.0.1:0").unwrap();
    let ag = Arc::new(ag);
    let producer =
        Arc::new(Producer::new(ag.clone(), layout.clone(), connector_cfg(a), Some(side)).unwrap());
    let ctl = TcpListener::bind("127.0.0.1:0").unwrap();
    println!("READY ctl={} side={side}", ctl.local_addr().unwrap());
    std::io::stdout().flush().unwrap();
    let region = Arc::new(region);
    let layout = Arc::new(layout);
    let mut threads = Vec::new();
    for _ in 0..a.concurrency {
        let (s, _) = ctl.accept().unwrap();
        let (producer, region, layout) = (producer.clone(), region.clone(), layout.clone());
        let (layer_wise, stamp) = (a.layer_wise, a.stamp);
        let compute = Duration::from_secs_f64(a.compute_ms / 1e3);
        threads.push(std::thread::spawn(move || {
            // Woken every 100 ms to see whether the process is stopping.
            s.set_read_timeout(Some(Duration::from_millis(100)))
                .unwrap();
            let mut rd = BufReader::new(s.try_clone().unwrap());
            let mut wr = s;
            let mut line = String::new();
            let mut prev: Option<String> = None;
            loop {
                line.clear();
                let got = loop {
                    match rd.read_line(&mut line) {
                        Ok(n) => break n,
                        Err(_) if kvxfer::stop::requested() => break 0,
                        Err(e)
                            if e.kind() == std::io::ErrorKind::WouldBlock
                                || e.kind() == std::io::ErrorKind::TimedOut => {}
                        Err(_) => break 0,
                    }
                };
                if got == 0 {
                    return;
                }
                let w: Vec<&str> = line.split_whitespace().collect();
                let (req, slot): (u64, usize) = match w.as_slice() {
                    ["REQ", r, s] => (r.parse().unwrap(), s.parse().unwrap()),
                    _ => return,
                };
                // The slot's blocks are reused once the previous request's were freed.
                if let Some(p) = prev.take() {
                    let t = Instant::now();
                    while let Err(e) = producer.wait_freed(&p, Duration::from_millis(100)) {
                        assert!(t.elapsed() < Duration::from_secs(120), "{p}: {e}");
                        if kvxfer::stop::requested() {
                            return;
                        }
                    }
                }
                let blocks = slot_blocks(slot);
                let name = format!("req-{req}");
                let n = blocks.len();
                if layer_wise {
                    // Publish first, then "compute" layer by layer.
                    let h = producer.publish(&name, &blocks, TOKENS, 0).unwrap();
                    writeln!(wr, "{}", hex(&h.encode())).unwrap();
                    for layer in 0..layout.layers.len() {
                        let one = KvLayout {
                            layers: vec![layout.layers[layer]],
                            ..(*layout).clone()
                        };
                        fill_layer(&region, &one, layer as u64, req, &blocks);
                        std::thread::sleep(compute / layout.layers.len() as u32);
                        producer.layer_done(&name, layer).unwrap();
                    }
                } else {
                    if stamp {
                        stamp_or_check(&region, &layout, req, 0..n, &blocks, false);
                    } else {
                        fill_or_check(&region, &layout, req, 0..n, &blocks, false);
                    }
                    std::thread::sleep(compute);
                    let h = producer
                        .publish(&name, &blocks, TOKENS, layout.layers.len())
                        .unwrap();
                    writeln!(wr, "{}", hex(&h.encode())).unwrap();
                }
                prev = Some(name);
            }
        }));
    }
    for t in threads {
        t.join().unwrap();
    }
    peak_rss().saturating_sub(cache_rss(region.len(), region.len(), &a.transport))
}

/// Waits for the load of `request`; `false` once stopped ([`kvxfer::stop::wait_with`]: a
/// grace after SIGTERM, none after SIGINT), a pull load then cancelled (a push load is left to
/// end with the process).
fn wait_or_stop(consumer: &Consumer, request: &str) -> bool {
    match kvxfer::stop::wait_with(|t| consumer.wait(request, t)) {
        Ok(done) => {
            if !done {
                let _ = consumer.cancel(request);
            }
            done
        }
        // The prefill worker, stopping too, ended the load: part of stopping.
        Err(_) if kvxfer::stop::requested() => false,
        Err(e) => panic!("{request}: {e}"),
    }
}

fn fill_layer(region: &Region, one: &KvLayout, layer: u64, req: u64, blocks: &[u32]) {
    let mut buf = vec![0u8; one.block_bytes() as usize];
    let mut d = Vec::new();
    for kv in [Kv::K, Kv::V] {
        for (k, &b) in blocks.iter().enumerate() {
            d.clear();
            one.block_descs(0, kv, b, 0..one.geometry.kv_heads, &mut d)
                .unwrap();
            pattern(req, k as u64, layer, kv, &mut buf);
            region.write(d[0].offset, &buf).unwrap();
        }
    }
}

fn decode(a: &Args) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--role", "prefill", "--transport", &a.transport])
        .args(["--concurrency", &a.concurrency.to_string()])
        .args(["--budget-mib", &a.budget_mib.to_string()])
        .args(["--mode", if a.mode == Mode::Pull { "pull" } else { "push" }])
        .args(["--compute-ms", &a.compute_ms.to_string()])
        .args(["--check", if a.stamp { "stamp" } else { "full" }])
        .args(if a.layer_wise {
            &["--layer-wise"][..]
        } else {
            &[][..]
        })
        .stdout(Stdio::piped())
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut l = String::new();
    out.read_line(&mut l).unwrap();
    let mut words = l.split_whitespace();
    let (ready, ctl, side) = (words.next(), words.next(), words.next());
    assert_eq!(ready, Some("READY"), "prefill did not start: {l:?}");
    let ctl: SocketAddr = ctl
        .and_then(|w| w.strip_prefix("ctl="))
        .unwrap()
        .parse()
        .unwrap();
    let side: SocketAddr = side
        .and_then(|w| w.strip_prefix("side="))
        .unwrap()
        .parse()
        .unwrap();

    let ag = Arc::new(agent("decode", &a.transport));
    let (region, layout) = cache(&ag, a.concurrency);
    let consumer = Arc::new(Consumer::new(ag.clone(), layout.clone(), connector_cfg(a)).unwrap());
    // Workers meet at startup (metadata both ways; in-host, each maps the other's cache once),
    // not on the first request.
    ag.connect(side).unwrap();
    let region = Arc::new(region);
    let layout = Arc::new(layout);
    let n = blocks_per_request() as usize;
    // Prefix caches hold whole blocks: the decode worker holds the first floor(F x blocks)
    // of the request's 149 blocks.
    let cached = (a.prefix_hit * n as f64).floor() as usize;
    let next = Arc::new(Mutex::new(0usize));
    let results = Arc::new(Mutex::new(Vec::new()));
    let verified = Arc::new(Mutex::new(true));
    let t0 = Instant::now();
    let workers: Vec<_> = (0..a.concurrency)
        .map(|slot| {
            let (consumer, region, layout, next, results, verified) = (
                consumer.clone(),
                region.clone(),
                layout.clone(),
                next.clone(),
                results.clone(),
                verified.clone(),
            );
            let total = a.requests;
            let stamp = a.stamp;
            let fill = move |region: &Region, layout: &KvLayout, req, ks, blocks: &[u32], check| {
                if stamp {
                    stamp_or_check(region, layout, req, ks, blocks, check)
                } else {
                    fill_or_check(region, layout, req, ks, blocks, check)
                }
            };
            std::thread::spawn(move || {
                let s = TcpStream::connect(ctl).unwrap();
                let mut rd = BufReader::new(s.try_clone().unwrap());
                let mut wr = s;
                let blocks = slot_blocks(slot);
                loop {
                    if kvxfer::stop::requested() {
                        return;
                    }
                    let req = {
                        let mut g = next.lock().unwrap();
                        if *g >= total {
                            return;
                        }
                        *g += 1;
                        *g as u64 - 1
                    };
                    // The decode side's prefix cache already holds the first `cached` blocks.
                    fill(&region, &layout, req, 0..cached, &blocks, false);
                    writeln!(wr, "REQ {req} {slot}").unwrap();
                    let mut line = String::new();
                    let got = rd.read_line(&mut line).unwrap_or(0);
                    // The prefill worker, stopping, closed the connection.
                    if got == 0 && kvxfer::stop::requested() {
                        return;
                    }
                    let h = Handoff::decode(&unhex(line.trim()).unwrap()).unwrap();
                    let t = Instant::now();
                    if let Err(e) = consumer.start_load(&h, &blocks[cached..]) {
                        // The prefill worker, stopping too, is gone: part of stopping.
                        assert!(kvxfer::stop::requested(), "{}: {e}", h.request);
                        return;
                    }
                    // Stopping: the load ended or was cancelled; nothing is left to report.
                    if !wait_or_stop(&consumer, &h.request) || kvxfer::stop::requested() {
                        return;
                    }
                    let ms = t.elapsed().as_secs_f64() * 1e3;
                    // The window of this load, for the link's busy time and loads in flight.
                    let span = (
                        t.duration_since(t0).as_secs_f64(),
                        t0.elapsed().as_secs_f64(),
                    );
                    // Checked outside the timed window.
                    let ok = fill(&region, &layout, req, 0..n, &blocks, true);
                    if !ok {
                        *verified.lock().unwrap() = false;
                    }
                    let st: Vec<_> = consumer.take_stats(&h.request).into_iter().collect();
                    results.lock().unwrap().push((req, ms, ok, st, span));
                }
            })
        })
        .collect();
    // Asked to stop: the prefill worker is told at once, as this process was (SIGINT cancels
    // at once), so that neither waits on the other.
    let mut told = 0;
    while !workers.iter().all(|w| w.is_finished()) {
        let sig = match (kvxfer::stop::requested(), kvxfer::stop::cancel_now()) {
            (_, true) => libc::SIGINT,
            (true, false) => libc::SIGTERM,
            _ => 0,
        };
        if sig != 0 && sig != told {
            // SAFETY: kill(2) on our own child, not yet waited for.
            unsafe { libc::kill(child.id() as i32, sig) };
            told = sig;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    for w in workers {
        w.join().unwrap();
    }
    let wall = t0.elapsed();
    drop(consumer);
    if kvxfer::stop::requested() {
        // In order: the loads ended or were cancelled, the connector is gone; the caches and
        // the agent go now, and the prefill worker ends as its control connections closed.
        drop((region, ag));
        let mut line = String::new();
        while out.read_line(&mut line).unwrap_or(0) > 0 {
            line.clear();
        }
        let st = child.wait().unwrap();
        stopped("decode");
        std::process::exit(if st.success() { 0 } else { 1 });
    }
    // Ask the prefill worker for its peak: closing the control connections ends it.
    let mut extra_prefill = 0u64;
    let mut line = String::new();
    while out.read_line(&mut line).unwrap_or(0) > 0 {
        if let Some(v) = line.trim().strip_prefix("PEAK_EXTRA ") {
            extra_prefill = v.parse().unwrap_or(0);
        }
        line.clear();
    }
    let _ = child.wait();
    let extra_decode =
        peak_rss().saturating_sub(cache_rss(region.len(), region.len(), &a.transport));

    let per_block = layout.block_bytes() * layout.layers.len() as u64 * 2;
    let full = per_block * n as u64;
    let res = results.lock().unwrap();
    let mut stats: Vec<kvxfer::RequestStats> = res.iter().flat_map(|r| r.3.clone()).collect();
    stats.sort_by(|a, b| a.request.cmp(&b.request));
    let moved: u64 = stats.iter().map(|s| s.bytes_moved).sum();
    let skipped: u64 = stats.iter().map(|s| s.bytes_skipped).sum();
    let mut times: Vec<f64> = res.iter().map(|r| r.1).collect();
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let p99 = times[((times.len() as f64 * 0.99).ceil() as usize).clamp(1, times.len()) - 1];
    // The link's busy time: the union of the loads' windows; loads in flight: their summed
    // time over it.
    let mut spans: Vec<(f64, f64)> = res.iter().map(|r| r.4).collect();
    spans.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (mut busy, mut end) = (0.0f64, f64::MIN);
    for &(s, e) in &spans {
        if s > end {
            busy += e - s;
        } else if e > end {
            busy += e - end;
        }
        end = end.max(e);
    }
    let in_flight = times.iter().sum::<f64>() / 1e3 / busy.max(1e-9);
    let link_bytes_per_s = moved as f64 / busy.max(1e-9);
    let verified = *verified.lock().unwrap() && res.len() == a.requests;
    if !a.json {
        println!(
            "{:<10} {:>10} {:>14} {:>14} {:>8}",
            "request", "handoff_ms", "bytes_moved", "bytes_skipped", "verified"
        );
    }
    let mut rows: Vec<_> = res.iter().collect();
    rows.sort_by_key(|r| r.0);
    for r in &rows {
        let (m, s) = r.3.iter().fold((0, 0), |acc, s| {
            (acc.0 + s.bytes_moved, acc.1 + s.bytes_skipped)
        });
        if !a.json {
            println!(
                "req-{:<6} {:>10.2} {:>14} {:>14} {:>8}",
                r.0, r.1, m, s, r.2
            );
        }
    }
    let extra = extra_prefill.max(extra_decode);
    let summary = format!(
        "{} requests x {} B, prefix hit {:.3} ({} of {} blocks cached): moved {} B ({:.1}% of full), \
         skipped {} B; handoff median {:.2} ms, p99 {:.2} ms; {:.2} loads in flight, link {:.2} GB/s \
         while busy; wall {:.2} s; peak RSS beyond caches: decode {:.1} MiB, \
         prefill {:.1} MiB; budget {} MiB; verified {}",
        a.requests,
        full,
        a.prefix_hit,
        cached,
        n,
        moved,
        100.0 * moved as f64 / (full * a.requests as u64) as f64,
        skipped,
        median,
        p99,
        in_flight,
        link_bytes_per_s / 1e9,
        wall.as_secs_f64(),
        extra_decode as f64 / (1 << 20) as f64,
        extra_prefill as f64 / (1 << 20) as f64,
        a.budget_mib,
        verified
    );
    if a.json {
        eprintln!("{summary}");
        println!(
            "{}",
            serde_json::json!({
                "verified": verified,
                "requests": a.requests,
                "concurrency": a.concurrency,
                "transport": a.transport,
                "mode": if a.mode == Mode::Pull { "pull" } else { "push" },
                "prefix_hit": a.prefix_hit,
                "bytes_full": full * a.requests as u64,
                "bytes_moved": moved,
                "bytes_skipped": skipped,
                "moved_fraction": moved as f64 / (full * a.requests as u64) as f64,
                "handoff_ms_median": median,
                "handoff_ms_p99": p99,
                "handoff_ms": times,
                "loads_in_flight_mean": in_flight,
                "link_busy_s": busy,
                "link_bytes_per_s": link_bytes_per_s,
                "wall_s": wall.as_secs_f64(),
                "compute_ms": a.compute_ms,
                "check": if a.stamp { "stamp" } else { "full" },
                "peak_rss_extra_decode_mib": extra_decode as f64 / (1 << 20) as f64,
                "peak_rss_extra_prefill_mib": extra_prefill as f64 / (1 << 20) as f64,
                "peak_rss_extra_mib": extra as f64 / (1 << 20) as f64,
                "budget_mib": a.budget_mib,
            })
        );
    } else {
        println!("{summary}");
    }
    if !verified {
        std::process::exit(1);
    }
}

fn main() {
    kvxfer::stop::install();
    let a = parse();
    if a.role == "prefill" {
        prefill(&a);
    } else {
        decode(&a);
    }
}
