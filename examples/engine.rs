//! A small inference engine pair bound to kvxfer's connector traits, in two processes: what an
//! engine author wires up, and the figures they need to see.
//!
//! The prefill engine (this process) has a paged KV cache (Qwen3-0.6B-shaped: 28 layers, one
//! fused K+V tensor per layer, 16-token blocks of 64 KiB per layer), a scheduler that admits
//! requests while blocks are free, and a worker loop whose "forward pass" writes a pattern
//! into each layer's blocks and sleeps (the time a GPU would spend, off the CPU), telling the
//! connector as each layer is done. The decode engine (a child process) admits each handoff,
//! finds the prefix it already holds in its own cache, loads only the missing blocks layer by
//! layer while its "attention" waits per layer, and checks every byte after the timed window.
//!
//! ```text
//! cargo run --release --example engine -- --requests 8 --prompt-tokens 1024 --prefix-hit 0.5
//! ```
//!
//! Options: `--requests N`, `--prompt-tokens T`, `--prefix-hit F` (share of a prompt's blocks
//! the decode side holds), `--concurrency C` (requests in prefill at once), `--layer-ms M` (a
//! layer's compute time), `--transport tcp|shm|auto`.

#![allow(clippy::unwrap_used)] // An example: errors end it with a message.

#[path = "common/hex.rs"]
mod hex;
use hex::{hex, unhex};
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer::connector::{
    AgentConnector, CacheTensor, ConnectorConfig, Handoff, KvCaches, KvConnector, KvConsumer,
    KvProducer, LayerTensors,
};
use kvxfer::layout::{KvGeometry, KvOrder, KvPacking};
use kvxfer::{Agent, AgentConfig, HostBuffer, MemKind, Transport};

const BLOCK_TOKENS: u64 = 16;

struct Opts {
    requests: usize,
    prompt_tokens: u64,
    prefix_hit: f64,
    concurrency: usize,
    layer_ms: u64,
    transport: String,
}

fn opts() -> Opts {
    let mut o = Opts {
        requests: 8,
        prompt_tokens: 1024,
        prefix_hit: 0.5,
        concurrency: 2,
        layer_ms: 1,
        transport: "tcp".into(),
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i + 1 < args.len() {
        let v = &args[i + 1];
        match args[i].as_str() {
            "--requests" => o.requests = v.parse().unwrap(),
            "--prompt-tokens" => o.prompt_tokens = v.parse().unwrap(),
            "--prefix-hit" => o.prefix_hit = v.parse().unwrap(),
            "--concurrency" => o.concurrency = v.parse().unwrap(),
            "--layer-ms" => o.layer_ms = v.parse().unwrap(),
            "--transport" => o.transport = v.clone(),
            "--role" => {}
            a => panic!("unknown option {a}"),
        }
        i += 2;
    }
    o
}

/// The engine's paged KV cache: one fused tensor per layer and a free list of blocks.
struct PagedCache {
    layers: Vec<HostBuffer>,
    block_bytes: usize,
    free: Vec<u32>,
}

impl PagedCache {
    fn new(g: &KvGeometry, blocks: u64) -> PagedCache {
        let block_bytes = 2 * g.block_bytes(BLOCK_TOKENS) as usize;
        let layers = (0..g.layers)
            .map(|_| HostBuffer::new(blocks as usize * block_bytes).unwrap())
            .collect();
        PagedCache {
            layers,
            block_bytes,
            free: (0..blocks as u32).rev().collect(),
        }
    }

    /// What the connector registers (the engine keeps `self` alive and its buffers unmoved
    /// while the connector's producer or consumer lives).
    fn caches(&mut self, g: &KvGeometry) -> KvCaches {
        let n = (self.layers[0].len() / self.block_bytes) as u64;
        let layers = self
            .layers
            .iter_mut()
            .map(|b| {
                let s = b.as_mut_slice();
                LayerTensors {
                    // SAFETY: the buffers live in this cache, which outlives the connector
                    // objects built over it (dropped first at the end of each role).
                    k: unsafe { CacheTensor::new(s.as_mut_ptr(), s.len(), MemKind::Host) },
                    v: None,
                }
            })
            .collect();
        KvCaches {
            geometry: g.clone(),
            block_tokens: BLOCK_TOKENS,
            num_blocks: n,
            packing: KvPacking::Fused,
            order: KvOrder::Nhd,
            layers,
            state: None,
            pad_per_head: 0,
        }
    }

    fn alloc(&mut self, n: usize) -> Option<Vec<u32>> {
        (self.free.len() >= n).then(|| self.free.split_off(self.free.len() - n))
    }

    fn release(&mut self, blocks: &[u32]) {
        self.free.extend_from_slice(blocks);
    }

    fn block(&mut self, layer: usize, b: u32) -> &mut [u8] {
        let o = b as usize * self.block_bytes;
        &mut self.layers[layer].as_mut_slice()[o..o + self.block_bytes]
    }
}

/// The KV a "forward pass" computes: a function of the request, the layer and the block's
/// position in the prompt (not of where the block sits in a cache).
fn kv_byte(req: u32, layer: usize, pos: usize, i: usize) -> u8 {
    (req as usize * 131 + layer * 17 + pos * 7 + i) as u8
}

fn compute(cache: &mut PagedCache, req: u32, layer: usize, blocks: &[u32]) {
    for (pos, &b) in blocks.iter().enumerate() {
        for (i, x) in cache.block(layer, b).iter_mut().enumerate() {
            *x = kv_byte(req, layer, pos, i);
        }
    }
}

/// Stopped by a signal: the last line on stderr, with what is left of kvxfer (nothing, once
/// the connector objects and the agent are dropped).
fn stopped(who: &str) {
    eprintln!(
        "engine {who}: stopped by {}; left: {}",
        kvxfer::stop::reason().unwrap_or("a signal"),
        kvxfer::live::live()
    );
}

fn main() {
    // SIGTERM/SIGINT end the engines in order (a load in flight is given a grace, then left
    // to the connector's drop, which cancels it and waits).
    kvxfer::stop::install();
    let o = opts();
    let role = std::env::args().skip_while(|a| a != "--role").nth(1);
    let g = KvGeometry::preset("qwen3-0.6b").unwrap();
    let transport = Transport::parse(&o.transport);
    let per_req = g.blocks(o.prompt_tokens, BLOCK_TOKENS) as usize;
    if role.as_deref() == Some("decode") {
        decode(&o, &g, transport, per_req);
    } else {
        prefill(&o, &g, transport, per_req);
    }
}

fn prefill(o: &Opts, g: &KvGeometry, transport: Transport, per_req: usize) {
    let mut cache = PagedCache::new(g, (per_req * o.concurrency) as u64);
    let agent = Arc::new(
        Agent::new(
            AgentConfig::new("engine-prefill")
                .transport(transport)
                .net_devices("lo"),
        )
        .unwrap(),
    );
    let side = agent.listen("127.0.0.1:0").unwrap();
    let conn: Box<dyn KvConnector> = Box::new(AgentConnector::new(agent.clone(), Some(side)));
    let producer: Box<dyn KvProducer> = conn
        .producer(&cache.caches(g), &ConnectorConfig::default())
        .unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(std::env::args().skip(1))
        .args(["--role", "decode"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut to_decode = child.stdin.take().unwrap();
    let from_decode = BufReader::new(child.stdout.take().unwrap());
    let reports = std::thread::spawn(move || {
        from_decode
            .lines()
            .map_while(Result::ok)
            .collect::<Vec<String>>()
    });
    println!(
        "prefill: {} requests of {} tokens ({} blocks, {:.1} MB of KV each), prefix hit {}, \
         concurrency {}, {} ms per layer, over {}",
        o.requests,
        o.prompt_tokens,
        per_req,
        (per_req * cache.block_bytes * g.layers as usize) as f64 / 1e6,
        o.prefix_hit,
        o.concurrency,
        o.layer_ms,
        o.transport
    );
    // The scheduler: admit while blocks are free; a request's blocks come back when the
    // connector reports them freed (the decode side's acknowledgement).
    let t0 = Instant::now();
    let mut next = 0u32;
    let mut in_flight = 0usize;
    let mut freed = 0usize;
    while freed < o.requests && !kvxfer::stop::requested() {
        while (next as usize) < o.requests
            && in_flight < o.concurrency
            && !kvxfer::stop::requested()
        {
            let Some(blocks) = cache.alloc(per_req) else {
                break;
            };
            let req = format!("req-{next}");
            // Layer-wise: published before the forward pass, layers handed over as done.
            let h = producer.publish(&req, &blocks, o.prompt_tokens, 0).unwrap();
            let prefix = (per_req as f64 * o.prefix_hit) as usize;
            writeln!(to_decode, "{next} {prefix} {}", hex(&h.encode())).unwrap();
            to_decode.flush().unwrap();
            for layer in 0..g.layers as usize {
                // The forward pass yields to a stopping process between layers.
                if kvxfer::stop::requested() {
                    break;
                }
                compute(&mut cache, next, layer, &blocks);
                std::thread::sleep(Duration::from_millis(o.layer_ms));
                producer.layer_done(&req, layer).unwrap();
            }
            next += 1;
            in_flight += 1;
        }
        if let Some(f) = producer.next_freed(Duration::from_millis(20)) {
            cache.release(&f.blocks);
            in_flight -= 1;
            freed += 1;
        }
    }
    drop(to_decode);
    if kvxfer::stop::requested() {
        // The forward pass stopped: the decode engine's loads in flight wait for layers that
        // will not come, so it is told to cancel them at once (SIGINT), not to give a grace.
        // SAFETY: kill(2) on our own child, not yet waited for.
        unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
        let _ = reports.join();
        let status = child.wait().unwrap();
        drop((producer, conn, agent));
        stopped("prefill");
        std::process::exit(if status.success() { 0 } else { 1 });
    }
    let lines = reports.join().unwrap();
    let status = child.wait().unwrap();
    let elapsed = t0.elapsed();
    println!(
        "{:<8} {:>11} {:>12} {:>12}  result",
        "request", "handoff ms", "moved MB", "skipped MB"
    );
    let mut failed = 0;
    let mut times = Vec::new();
    let (mut moved, mut skipped) = (0.0, 0.0);
    for l in &lines {
        let f: Vec<&str> = l.splitn(5, ' ').collect();
        if f.len() < 5 {
            continue;
        }
        println!(
            "{:<8} {:>11} {:>12} {:>12}  {}",
            f[0], f[1], f[2], f[3], f[4]
        );
        if f[4] != "verified" {
            failed += 1;
        }
        times.push(f[1].parse::<f64>().unwrap_or(f64::NAN));
        moved += f[2].parse::<f64>().unwrap_or(0.0);
        skipped += f[3].parse::<f64>().unwrap_or(0.0);
    }
    times.sort_by(f64::total_cmp);
    println!(
        "prefill: {} handoffs in {:.2} s, {moved:.1} MB moved, {skipped:.1} MB skipped (cached), \
         median handoff {:.1} ms, {} failed; producer holds {}; decode exited {}",
        lines.len(),
        elapsed.as_secs_f64(),
        times.get(times.len() / 2).copied().unwrap_or(f64::NAN),
        failed,
        producer.held(),
        status
    );
    drop(producer);
    drop(conn);
    if failed > 0 || lines.len() != o.requests || !status.success() {
        std::process::exit(1);
    }
}

fn decode(o: &Opts, g: &KvGeometry, transport: Transport, per_req: usize) {
    let mut cache = PagedCache::new(g, (per_req * o.requests.min(8)) as u64);
    let agent = Arc::new(
        Agent::new(
            AgentConfig::new("engine-decode")
                .transport(transport)
                .net_devices("lo"),
        )
        .unwrap(),
    );
    let conn: Box<dyn KvConnector> = Box::new(AgentConnector::new(agent, None));
    let consumer: Box<dyn KvConsumer> = conn
        .consumer(&cache.caches(g), &ConnectorConfig::default())
        .unwrap();
    let mut out = std::io::stdout().lock();
    for line in std::io::stdin().lock().lines().map_while(Result::ok) {
        let mut it = line.split(' ');
        let (req, prefix, h) = (
            it.next().unwrap().parse::<u32>().unwrap(),
            it.next().unwrap().parse::<usize>().unwrap(),
            Handoff::decode(&unhex(it.next().unwrap()).unwrap()).unwrap(),
        );
        let blocks = cache.alloc(per_req).expect("decode cache full");
        // The prefix cache: these blocks' KV was computed here before (same prompt prefix).
        for layer in 0..g.layers as usize {
            compute(&mut cache, req, layer, &blocks[..prefix]);
        }
        if kvxfer::stop::requested() {
            cache.release(&blocks);
            break;
        }
        let missing = &blocks[prefix..];
        let result = consumer.start_load(&h, missing).and_then(|()| {
            // The forward pass: attention of each layer waits for that layer only.
            for layer in 0..g.layers as usize {
                wait_or_stop(|t| consumer.wait_layer(&h.request, layer, t))?;
            }
            wait_or_stop(|t| consumer.wait(&h.request, t))
        });
        if kvxfer::stop::requested() {
            break;
        }
        // Outside the timed window: every byte of every block, prefix and loaded.
        let verdict = match result {
            Ok(()) => {
                // A stopping process does not finish checking (nothing is reported).
                let ok = (0..g.layers as usize).all(|layer| {
                    kvxfer::stop::requested()
                        || blocks.iter().enumerate().all(|(pos, &b)| {
                            cache
                                .block(layer, b)
                                .iter()
                                .enumerate()
                                .all(|(i, &x)| x == kv_byte(req, layer, pos, i))
                        })
                });
                if ok {
                    "verified".to_string()
                } else {
                    "WRONG BYTES".to_string()
                }
            }
            Err(e) => {
                let f = consumer.next_failed();
                format!(
                    "FAILED: {e} (invalid blocks: {})",
                    f.map_or(0, |f| f.invalid_blocks.len())
                )
            }
        };
        if kvxfer::stop::requested() {
            break;
        }
        let st = consumer.next_finished();
        let (ms, moved, skipped) = st.map_or((f64::NAN, 0, 0), |s| {
            (
                s.handoff_time.as_secs_f64() * 1e3,
                s.bytes_moved,
                s.bytes_skipped,
            )
        });
        writeln!(
            out,
            "{} {ms:.1} {:.1} {:.1} {verdict}",
            h.request,
            moved as f64 / 1e6,
            skipped as f64 / 1e6
        )
        .unwrap();
        out.flush().unwrap();
        cache.release(&blocks);
    }
    drop(consumer);
    drop(conn);
    if kvxfer::stop::requested() {
        stopped("decode");
    }
}

/// Waits with `wait` ([`kvxfer::stop::wait_with`]); once the process is asked to stop, what
/// it waits for gets a grace (none after SIGINT), then counts as cancelled.
fn wait_or_stop(wait: impl Fn(Duration) -> kvxfer::Result<()>) -> kvxfer::Result<()> {
    match kvxfer::stop::wait_with(wait)? {
        true => Ok(()),
        false => Err(kvxfer::Error::Canceled),
    }
}
