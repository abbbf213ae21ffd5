//! The two workers. Each reads commands on stdin and answers on stdout, one line each, tagged
//! with the request they are about; a closed stdin (the driver is gone) ends the worker.
//!
//! prefill: `REQ <req> <slot>` -> `H <req> <handoff hex>` | `E <req> <error>`; `HELD` -> `HELD <n>`
//! decode:  `LOAD <req> <slot> <cached> <handoff hex>` -> `R <req> <outcome> <ms> <blocks> <kind>`;
//!          `STATE` -> `STATE <loads in progress>`
//! both:    `BUDGET` -> `BUDGET <bytes of its memory budget in use>`

use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvxfer::connector::{Consumer, Handoff, LoadFailure, Producer};
use kvxfer::{Agent, AgentConfig, MemoryBudget, Share, Transport};

/// Each worker's memory budget: a hostile peer may hold half of it (its share), and what
/// the driver allows a worker's RSS to grow by is measured beyond what the budget holds.
const BUDGET: u64 = 64 << 20;

use crate::hex::{hex, unhex};
use crate::kv_cache::{cache_shared, fill_or_check, slot_blocks_of};
use crate::{cfg, Args, LEASE, PER_SLOT, SLOTS, TOKENS};

/// Lines to the driver, whole, from any thread.
#[derive(Clone)]
struct Out(Arc<Mutex<std::io::Stdout>>);

impl Out {
    fn say(&self, line: &str) {
        let mut o = self.0.lock().unwrap();
        // The driver gone: nothing to tell.
        let _ = writeln!(o, "{line}").and_then(|()| o.flush());
    }
}

/// How the workers' caches are shared: for all peers, or only through grants.
fn share(a: &Args) -> Share {
    if a.lane_only {
        Share::Only(Vec::new())
    } else {
        Share::AllPeers
    }
}

fn agent(name: &str, a: &Args) -> Arc<Agent> {
    let mut c = AgentConfig::new(name)
        .transport(Transport::parse(&a.transport))
        .net_devices(&a.dev)
        .budget(MemoryBudget::new(BUDGET))
        .lane_window(!a.no_lane_window);
    if let Some(s) = &a.secret {
        c = c.secret(s.as_bytes().to_vec());
    }
    Arc::new(Agent::new(c).unwrap())
}

/// The prefill worker: publishes each request it is asked for into its slot's blocks, once
/// the request that used them before was freed (acknowledged, or its lease ran out).
/// A worker: serves until its stdin closes (SIGTERM first, from the driver at the end),
/// then drops what it holds of kvxfer and says what is left: nothing.
pub fn prefill(a: &Args) {
    kvxfer::stop::install();
    serve_prefill(a);
    left();
}

/// See [`prefill`].
pub fn decode(a: &Args) {
    kvxfer::stop::install();
    serve_decode(a);
    left();
}

fn left() {
    let mut o = std::io::stdout();
    let _ = writeln!(o, "LEFT {}", kvxfer::live::live()).and_then(|()| o.flush());
}

fn serve_prefill(a: &Args) {
    let ag = agent("chaos-prefill", a);
    let (region, layout) = cache_shared(&ag, SLOTS, PER_SLOT, share(a));
    let side = ag.listen((a.bind.as_str(), 0)).unwrap();
    let producer =
        Arc::new(Producer::new(ag.clone(), layout.clone(), cfg(a.mode), Some(side)).unwrap());
    let out = Out(Arc::new(Mutex::new(std::io::stdout())));
    out.say(&format!("READY side={side}"));
    let (region, layout) = (Arc::new(region), Arc::new(layout));
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        match line.split_whitespace().collect::<Vec<_>>().as_slice() {
            ["REQ", req, slot] => {
                let (req, slot): (u64, usize) = (req.parse().unwrap(), slot.parse().unwrap());
                let (producer, region, layout, out) = (
                    producer.clone(),
                    region.clone(),
                    layout.clone(),
                    out.clone(),
                );
                std::thread::spawn(move || {
                    let blocks = slot_blocks_of(slot, PER_SLOT);
                    if let Some(prev) = req.checked_sub(SLOTS as u64) {
                        let _ = producer.wait_freed(&format!("req-{prev}"), LEASE * 2);
                    }
                    fill_or_check(&region, &layout, req, 0..blocks.len(), &blocks, false);
                    let nl = layout.layers.len();
                    out.say(
                        &match producer.publish(&format!("req-{req}"), &blocks, TOKENS, nl) {
                            Ok(h) => format!("H {req} {}", hex(&h.encode())),
                            Err(e) => format!("E {req} {e}"),
                        },
                    );
                });
            }
            ["HELD"] => out.say(&format!("HELD {}", producer.held())),
            ["BUDGET"] => out.say(&format!("BUDGET {}", ag.budget().used())),
            _ => {}
        }
    }
}

/// The decode worker: loads each handoff it is given into its slot's blocks (after a cached
/// prefix it writes itself), then checks every byte, or checks the failure names the blocks.
fn serve_decode(a: &Args) {
    let ag = agent("chaos-decode", a);
    let (region, layout) = cache_shared(&ag, SLOTS, PER_SLOT, share(a));
    let consumer = Arc::new(Consumer::new(ag.clone(), layout.clone(), cfg(a.mode)).unwrap());
    let out = Out(Arc::new(Mutex::new(std::io::stdout())));
    out.say("READY");
    let (region, layout) = (Arc::new(region), Arc::new(layout));
    let failures = Arc::new(Mutex::new(HashMap::new()));
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        match line.split_whitespace().collect::<Vec<_>>().as_slice() {
            ["LOAD", req, slot, cached, h] => {
                let (req, slot, cached): (u64, usize, usize) = (
                    req.parse().unwrap(),
                    slot.parse().unwrap(),
                    cached.parse().unwrap(),
                );
                let h = unhex(h).and_then(|b| Handoff::decode(&b).ok());
                let (consumer, region, layout, out, failures) = (
                    consumer.clone(),
                    region.clone(),
                    layout.clone(),
                    out.clone(),
                    failures.clone(),
                );
                std::thread::spawn(move || {
                    let l = Load {
                        consumer: &consumer,
                        region: &region,
                        layout: &layout,
                        failures: &failures,
                    };
                    let (outcome, ms, blocks, kind) = match h {
                        Some(h) => l.run(req, slot, cached, &h),
                        None => ("untyped", 0, 0, "a handoff that does not decode".into()),
                    };
                    out.say(&format!("R {req} {outcome} {ms} {blocks} {kind}"));
                });
            }
            ["STATE"] => out.say(&format!("STATE {}", consumer.in_progress())),
            ["BUDGET"] => out.say(&format!("BUDGET {}", ag.budget().used())),
            _ => {}
        }
    }
}

struct Load<'a> {
    consumer: &'a Consumer,
    region: &'a kvxfer::Region,
    layout: &'a kvxfer::layout::KvLayout,
    /// Failures taken from the consumer that belong to other loads.
    failures: &'a Mutex<HashMap<String, LoadFailure>>,
}

impl Load<'_> {
    /// One load: its outcome, how long it took to end (ms), the blocks a failure named, and
    /// the kind of error.
    fn run(
        &self,
        req: u64,
        slot: usize,
        cached: usize,
        h: &Handoff,
    ) -> (&'static str, u64, usize, String) {
        let blocks = slot_blocks_of(slot, PER_SLOT);
        // Partial or full: the cached prefix is already here.
        fill_or_check(self.region, self.layout, req, 0..cached, &blocks, false);
        let t = Instant::now();
        if let Err(e) = self.consumer.start_load(h, &blocks[cached..]) {
            return ("refused", 0, 0, kind(&e));
        }
        // A load ends, completed or failed, on its own: waiting is only for it.
        let mut r = self.consumer.wait(&h.request, LEASE * 5);
        while matches!(r, Err(kvxfer::Error::WaitTimeout(_)))
            && t.elapsed() < Duration::from_secs(60)
        {
            r = self.consumer.wait(&h.request, LEASE * 5);
        }
        let ms = t.elapsed().as_millis() as u64;
        if std::env::var("CHAOS_DEBUG").is_ok() {
            eprintln!("chaos decode: req {req}: {ms} ms {r:?}");
        }
        match r {
            Err(kvxfer::Error::WaitTimeout(_)) => ("stuck", ms, 0, String::new()),
            Ok(()) => {
                let _ = self.consumer.take_stats(&h.request);
                let good = fill_or_check(
                    self.region,
                    self.layout,
                    req,
                    0..blocks.len(),
                    &blocks,
                    true,
                );
                if !good {
                    // Whose bytes are there instead: an earlier request of this slot's?
                    let whose: Vec<String> = (0..blocks.len())
                        .map(|k| {
                            (0..=8u64)
                                .map(|back| req.saturating_sub(back * SLOTS as u64))
                                .find(|&r| {
                                    fill_or_check(
                                        self.region,
                                        self.layout,
                                        r,
                                        k..k + 1,
                                        &blocks,
                                        true,
                                    )
                                })
                                .map_or("?".to_string(), |r| format!("req {r}"))
                        })
                        .collect();
                    eprintln!(
                        "chaos decode: req {req} (cached {cached}) completed with wrong bytes; its blocks hold {whose:?}"
                    );
                }
                (
                    if good { "verified" } else { "bad_bytes" },
                    ms,
                    0,
                    String::new(),
                )
            }
            Err(e) => {
                // A failed load names its blocks (the ones it was to load). Failures queue in
                // order; take them all, keep the others'.
                let f = {
                    let mut g = self.failures.lock().unwrap();
                    for f in self.consumer.take_failed() {
                        g.insert(f.request.clone(), f);
                    }
                    g.remove(&h.request)
                };
                match f {
                    Some(f) if f.invalid_blocks == blocks[cached..] => {
                        ("failed", ms, f.invalid_blocks.len(), kind(&e))
                    }
                    f => {
                        eprintln!(
                            "chaos: {}: {e} without its blocks {:?}: {f:?}",
                            h.request,
                            &blocks[cached..]
                        );
                        ("untyped", ms, 0, kind(&e))
                    }
                }
            }
        }
    }
}

/// An error's kind: its text after the request's name, short, on one line.
fn kind(e: &kvxfer::Error) -> String {
    let t = e.to_string();
    let k = t.split_once(": ").map_or(t.as_str(), |(_, rest)| rest);
    // Epochs, addresses and deadlines differ from fault to fault; the kind does not.
    let k: Vec<&str> = k
        .split_whitespace()
        .map(|w| {
            if w.bytes().any(|b| b.is_ascii_digit()) {
                "*"
            } else {
                w
            }
        })
        .collect();
    k.join(" ").chars().take(60).collect()
}
