//! The driver: starts the two workers, sends each slot's requests through them (a handoff
//! from the prefill worker, its load by the decode worker), injects a fault every 1-3 s, and
//! at the end checks what was lost: nothing.

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::net::Netns;
use crate::{mode_name, rss, Args, LEASE, PER_SLOT, SLOTS};

/// Answers awaited from a worker, by request (`u64::MAX`: a query of its state).
type Pending = Arc<Mutex<HashMap<u64, Sender<String>>>>;

const QUERY: u64 = u64::MAX;

/// What a worker that stopped in order says is left.
const NOTHING_LEFT: &str =
    "0 agents, 0 regions registered, 0 UCX registrations, 0 peer mappings, 0 lane windows";

/// One incarnation of a worker as the driver sees it.
struct Worker {
    child: Mutex<Child>,
    pid: u32,
    /// None once closed (the worker's cue to end).
    stdin: Mutex<Option<ChildStdin>>,
    pending: Pending,
    started: Instant,
    /// Its RSS once it ran for a while (bytes; 0 before).
    rss_first: AtomicU64,
    /// Its side channel, where it said it listens.
    side: Option<std::net::SocketAddr>,
}

impl Worker {
    fn start(cmd: &mut Command) -> Arc<Worker> {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut ready = String::new();
        out.read_line(&mut ready).unwrap();
        assert!(ready.starts_with("READY"), "a worker said {ready:?}");
        let side = ready
            .split_whitespace()
            .find_map(|w| w.strip_prefix("side="))
            .and_then(|a| a.parse().ok());
        let pending: Pending = Arc::default();
        let p = pending.clone();
        // Answers go to whoever waits for them; at its end (the worker died) every waiter
        // hears so (its sender dropped).
        std::thread::spawn(move || {
            for line in out.lines() {
                let Ok(line) = line else { break };
                let mut w = line.split_whitespace();
                let key = match w.next() {
                    Some("HELD" | "STATE" | "LEFT" | "BUDGET") => QUERY,
                    _ => w.next().and_then(|r| r.parse().ok()).unwrap_or(QUERY - 1),
                };
                if let Some(tx) = p.lock().unwrap().remove(&key) {
                    let _ = tx.send(line);
                }
            }
            p.lock().unwrap().clear();
        });
        let pid = child.id();
        let w = Worker {
            child: Mutex::new(child),
            pid,
            stdin: Mutex::new(Some(stdin)),
            pending,
            started: Instant::now(),
            rss_first: AtomicU64::new(0),
            side,
        };
        Arc::new(w)
    }

    /// Sends `line`; the answer about `key` comes on the receiver (which hears a
    /// disconnection if the worker dies first).
    fn ask(&self, key: u64, line: &str) -> Receiver<String> {
        let (tx, rx) = channel();
        self.pending.lock().unwrap().insert(key, tx);
        let sent = match self.stdin.lock().unwrap().as_mut() {
            Some(i) => writeln!(i, "{line}").is_ok(),
            None => false,
        };
        if !sent {
            self.pending.lock().unwrap().remove(&key);
        }
        rx
    }

    /// Ends the worker in order: SIGTERM and its stdin closed. Its exit status, how long it
    /// took, and what it said was left of kvxfer in it.
    fn stop(&self) -> (Option<std::process::ExitStatus>, Duration, String) {
        let left = {
            let (tx, rx) = channel();
            self.pending.lock().unwrap().insert(QUERY, tx);
            rx
        };
        let t = Instant::now();
        self.signal(libc::SIGTERM);
        self.stdin.lock().unwrap().take();
        let said = left
            .recv_timeout(Duration::from_secs(5))
            .unwrap_or_default();
        let mut c = self.child.lock().unwrap();
        let st = loop {
            match c.try_wait() {
                Ok(Some(st)) => break Some(st),
                Ok(None) if t.elapsed() < Duration::from_secs(5) => {
                    std::thread::sleep(Duration::from_millis(5))
                }
                _ => break None,
            }
        };
        (st, t.elapsed(), said)
    }

    fn kill(&self) {
        let mut c = self.child.lock().unwrap_or_else(|e| e.into_inner());
        let _ = c.kill();
        let _ = c.wait();
    }

    fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child's pid, which we have not reaped.
        unsafe { libc::kill(self.pid as i32, sig) };
    }

    fn rss(&self) -> u64 {
        rss(&self.pid.to_string())
    }

    /// How much its RSS grew since it was first measured (0 before that): in all, and
    /// beyond the bytes its memory budget holds now (a stalled peer's charged request is
    /// allowed memory).
    fn growth(&self) -> [u64; 2] {
        let first = self.rss_first.load(Ordering::Relaxed);
        if first == 0 {
            return [0, 0];
        }
        let grew = self.rss().saturating_sub(first);
        let budget = self
            .ask(QUERY, "BUDGET")
            .recv_timeout(Duration::from_secs(1))
            .ok()
            .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            .unwrap_or(0);
        [grew, grew.saturating_sub(budget)]
    }
}

/// Both workers, current incarnations, and how to start them.
struct Cluster {
    a: Args,
    net: Option<Netns>,
    prefill: Mutex<Arc<Worker>>,
    decode: Mutex<Arc<Worker>>,
    /// The most any incarnation's RSS grew beyond its budget in use before it was killed
    /// (bytes): prefill, decode.
    /// Survivors alone are too few to judge (a seed may kill a worker near the end).
    grew_most: [[AtomicU64; 2]; 2],
}

impl Cluster {
    fn command(a: &Args, net: Option<&Netns>, role: &str) -> Command {
        let exe = std::env::current_exe().unwrap();
        let exe = exe.to_str().unwrap();
        let (mut c, bind, dev) = match (net, role) {
            (Some(n), "prefill") => (Netns::exec(&n.a.0, exe), n.a.2, n.a.1.as_str()),
            (Some(n), _) => (Netns::exec(&n.b.0, exe), n.b.2, n.b.1.as_str()),
            (None, _) => (Command::new(exe), "127.0.0.1", "lo"),
        };
        c.args(["--role", role, "--transport", &a.transport]).args([
            "--mode",
            mode_name(a.mode),
            "--bind",
            bind,
            "--dev",
            dev,
        ]);
        if let Some(s) = &a.secret {
            c.args(["--secret", s]);
        }
        if a.lane_only {
            c.arg("--lane-only");
        }
        if a.no_lane_window {
            c.arg("--no-lane-window");
        }
        c
    }

    fn start(a: &Args, net: Option<Netns>) -> Cluster {
        let prefill = Worker::start(&mut Cluster::command(a, net.as_ref(), "prefill"));
        let decode = Worker::start(&mut Cluster::command(a, net.as_ref(), "decode"));
        Cluster {
            a: a.clone(),
            net,
            prefill: Mutex::new(prefill),
            decode: Mutex::new(decode),
            grew_most: Default::default(),
        }
    }

    fn restart(&self, role: &str) {
        let slot = if role == "prefill" {
            &self.prefill
        } else {
            &self.decode
        };
        let mut w = slot.lock().unwrap();
        let most = &self.grew_most[usize::from(role != "prefill")];
        for (m, g) in most.iter().zip(w.growth()) {
            m.fetch_max(g, Ordering::Relaxed);
        }
        w.kill();
        *w = Worker::start(&mut Cluster::command(&self.a, self.net.as_ref(), role));
    }
}

/// Whatever ends the driver (a panic included): the workers killed, the namespaces removed.
struct Cleanup(Arc<Cluster>);

impl Drop for Cleanup {
    fn drop(&mut self) {
        for w in [&self.0.prefill, &self.0.decode] {
            let w = w.lock().unwrap_or_else(|e| e.into_inner()).clone();
            w.signal(libc::SIGCONT);
            w.kill();
        }
        if let Some(n) = &self.0.net {
            n.remove();
        }
    }
}

#[derive(Default)]
struct Tally {
    counts: Mutex<BTreeMap<String, u64>>,
    /// The kinds of errors seen, with counts.
    errors: Mutex<BTreeMap<String, u64>>,
    longest_ms: AtomicU64,
}

impl Tally {
    fn add(&self, k: &str, n: u64) {
        *self
            .counts
            .lock()
            .unwrap()
            .entry(k.to_string())
            .or_default() += n;
    }
    fn get(&self, k: &str) -> u64 {
        self.counts.lock().unwrap().get(k).copied().unwrap_or(0)
    }
}

/// One slot's requests, until `stop`: requests `slot`, `slot + SLOTS`, ... use its blocks.
fn slot_loop(slot: usize, c: &Cluster, t: &Tally, stop: &AtomicBool, seed: u64) {
    let mut k = 0u64;
    while !stop.load(Ordering::Acquire) {
        let req = k * SLOTS as u64 + slot as u64;
        k += 1;
        let p = c.prefill.lock().unwrap().clone();
        let h = match p
            .ask(req, &format!("REQ {req} {slot}"))
            .recv_timeout(Duration::from_secs(10))
        {
            Ok(l) if l.starts_with("H ") => l.split_whitespace().nth(2).unwrap().to_string(),
            Ok(l) => {
                t.add("publish_failed", 1);
                eprintln!("chaos: {l}");
                continue;
            }
            Err(_) => {
                // The prefill worker died or stopped answering before it published.
                t.add("no_handoff", 1);
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        // Partial or full: a cached prefix of 0..PER_SLOT blocks, already at the decode side.
        let cached = ((req ^ seed).wrapping_mul(0x9e37_79b9) >> 7) as usize % PER_SLOT as usize;
        let d = c.decode.lock().unwrap().clone();
        t.add("handoffs", 1);
        let line = format!("LOAD {req} {slot} {cached} {h}");
        match d.ask(req, &line).recv_timeout(Duration::from_secs(90)) {
            Ok(r) => {
                let w: Vec<&str> = r.splitn(6, ' ').collect();
                let (outcome, ms, blocks) =
                    (w[2], w[3].parse().unwrap_or(0), w[4].parse().unwrap_or(0));
                t.add(outcome, 1);
                t.add("failed_blocks", blocks);
                t.longest_ms.fetch_max(ms, Ordering::Relaxed);
                if let Some(kind) = w.get(5).filter(|k| !k.is_empty()) {
                    *t.errors
                        .lock()
                        .unwrap()
                        .entry(format!("{outcome}: {kind}"))
                        .or_default() += 1;
                }
            }
            // The load died with its decode worker.
            Err(RecvTimeoutError::Disconnected) => t.add("died_with_decode", 1),
            Err(RecvTimeoutError::Timeout) => t.add("stuck", 1),
        }
    }
}

/// The faults, one every 1-3 s until `end`, taking turns so a short run sees each kind:
/// SIGKILL and restart, SIGSTOP past the lease and SIGCONT, of either worker, and (in
/// namespaces) a link cut shorter or longer than the lease.
fn faults(c: &Cluster, t: &Tally, seed: u64, end: Instant) {
    let mut x = seed | 1;
    let kinds: &[(&str, &str)] = &[
        ("kill", "prefill"),
        ("stop", "decode"),
        ("cut", ""),
        ("kill", "decode"),
        ("stop", "prefill"),
    ];
    let kinds = if c.net.is_some() {
        kinds.to_vec()
    } else {
        kinds.iter().copied().filter(|k| k.0 != "cut").collect()
    };
    let mut i = seed as usize;
    while Instant::now() < end {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        std::thread::sleep(Duration::from_millis(1000 + x % 2000));
        // RSS once a worker ran a while: the mark its end is compared with.
        for w in [&c.prefill, &c.decode] {
            let w = w.lock().unwrap().clone();
            if w.started.elapsed() > Duration::from_secs(4)
                && w.rss_first.load(Ordering::Relaxed) == 0
            {
                w.rss_first.store(w.rss(), Ordering::Relaxed);
            }
        }
        let (fault, role) = kinds[i % kinds.len()];
        i += 1;
        let worker = if role == "prefill" {
            &c.prefill
        } else {
            &c.decode
        };
        match fault {
            "kill" => {
                c.restart(role);
                t.add(&format!("{role}_sigkills"), 1);
            }
            "stop" => {
                let w = worker.lock().unwrap().clone();
                w.signal(libc::SIGSTOP);
                std::thread::sleep(LEASE + Duration::from_millis(500 + (x >> 30) % 1000));
                w.signal(libc::SIGCONT);
                t.add(&format!("{role}_sigstops"), 1);
            }
            _ => {
                let n = c.net.as_ref().unwrap();
                // Shorter and longer than the lease.
                let cut = Duration::from_millis(500 + (x >> 30) % 3500);
                assert!(n.cut(true), "cutting the link failed");
                std::thread::sleep(cut);
                assert!(n.cut(false), "restoring the link failed");
                t.add("link_cuts", 1);
            }
        }
    }
}

pub fn run(a: &Args) {
    let net = if a.netns {
        Some(Netns::new().unwrap_or_else(|| std::process::exit(2)))
    } else {
        None
    };
    let c = Arc::new(Cluster::start(a, net));
    let _cleanup = Cleanup(c.clone());
    let t = Arc::new(Tally::default());
    let stop = Arc::new(AtomicBool::new(false));
    let t0 = Instant::now();
    let slots: Vec<_> = (0..SLOTS)
        .map(|slot| {
            let (c, t, stop, seed) = (c.clone(), t.clone(), stop.clone(), a.seed);
            std::thread::spawn(move || slot_loop(slot, &c, &t, &stop, seed))
        })
        .collect();
    // The hostile peer follows the prefill worker through its restarts (not across
    // namespaces: it runs here).
    let hostile = (a.hostile && !a.netns).then(|| {
        let c = c.clone();
        crate::hostile::run(
            Arc::new(move || c.prefill.lock().unwrap().side),
            stop.clone(),
        )
    });
    faults(&c, &t, a.seed, t0 + Duration::from_secs(a.seconds));
    stop.store(true, Ordering::Release);
    let hostile = hostile.map(|h| h.join().unwrap());
    // Every wait of a slot is bounded (10 s for a handoff, 90 s for a load).
    for s in slots {
        s.join().unwrap();
    }
    // Nothing held on the prefill side once the leases ran out, nothing in progress.
    std::thread::sleep(LEASE + Duration::from_millis(500));
    let p = c.prefill.lock().unwrap().clone();
    let d = c.decode.lock().unwrap().clone();
    let ask = |w: &Worker, q: &str| -> u64 {
        let l = w
            .ask(QUERY, q)
            .recv_timeout(Duration::from_secs(10))
            .unwrap();
        l.split_whitespace().nth(1).unwrap().parse().unwrap()
    };
    let held = ask(&p, "HELD");
    let in_progress = ask(&d, "STATE");
    let mib = |b: u64| format!("{:.1}", b as f64 / f64::from(1 << 20));
    let rss = |w: &Worker| (mib(w.rss_first.load(Ordering::Relaxed)), mib(w.rss()));
    let ((pa, pb), (da, db)) = (rss(&p), rss(&d));
    // The most any incarnation grew beyond its budget in use, the survivors included.
    let most = |k: usize, w: &Worker| {
        let g = w.growth();
        [0, 1].map(|i| c.grew_most[k][i].load(Ordering::Relaxed).max(g[i]))
    };
    let ([pr, pg], [dr, dg]) = (most(0, &p), most(1, &d));
    let g = |k: &str| t.get(k);
    let completed = g("verified") + g("bad_bytes");
    let hostile_json = hostile.as_ref().map_or(String::new(), |h| {
        format!(
            ",\"hostile\":{{\"hellos_loaded\":{},\"hellos_refused\":{},\"lane_stalls\":{},\
             \"garbage\":{}}}",
            h.loaded, h.refused, h.stalls, h.garbage
        )
    });
    println!(
        "{{\"seconds\":{},\"mode\":\"{}\",\"transport\":\"{}\",\"netns\":{},\"handoffs\":{},\
         \"refused_at_start\":{},\"completed\":{completed},\"verified\":{},\"bad_bytes\":{},\
         \"failed\":{},\"failed_blocks\":{},\"failed_untyped\":{},\"stuck\":{},\
         \"died_with_decode\":{},\"longest_load_ms\":{},\"no_handoff\":{},\"prefill_sigkills\":{},\
         \"prefill_sigstops\":{},\"decode_sigkills\":{},\"decode_sigstops\":{},\"link_cuts\":{},\
         \"held_at_end\":{held},\"in_progress_at_end\":{in_progress},\
         \"prefill_rss_mib\":[{pa},{pb}],\"decode_rss_mib\":[{da},{db}],\
         \"rss_growth_most_mib\":[{},{}],\"rss_growth_beyond_budget_mib\":[{},{}]\
         {hostile_json}}}",
        t0.elapsed().as_secs(),
        mode_name(a.mode),
        a.transport,
        a.netns,
        g("handoffs"),
        g("refused"),
        g("verified"),
        g("bad_bytes"),
        g("failed"),
        g("failed_blocks"),
        g("untyped"),
        g("stuck"),
        g("died_with_decode"),
        t.longest_ms.load(Ordering::Relaxed),
        g("no_handoff"),
        g("prefill_sigkills"),
        g("prefill_sigstops"),
        g("decode_sigkills"),
        g("decode_sigstops"),
        g("link_cuts"),
        mib(pr),
        mib(dr),
        mib(pg),
        mib(dg),
    );
    if let Some(h) = &hostile {
        eprintln!(
            "chaos: the hostile peer's HELLOs: {} loaded, {} refused; {} stalled lane \
             requests; {} garbage connections",
            h.loaded, h.refused, h.stalls, h.garbage
        );
    }
    for (kind, n) in t.errors.lock().unwrap().iter() {
        eprintln!("chaos: {n} x {kind}");
    }
    // RSS flat: no incarnation that ran long enough to be measured (killed ones just before
    // their kill, survivors at the end) grew by 32 MiB or more beyond what its memory budget
    // held then (a leak of one request's KV, 7.3 MB, per handoff passes that within
    // seconds).
    let grew = pg.max(dg) >= 32 << 20;
    // Each survivor ends in order on SIGTERM: exit 0 within a second, nothing of kvxfer left.
    let mut unclean = 0;
    for (role, w) in [("prefill", &p), ("decode", &d)] {
        let (st, took, said) = w.stop();
        let clean = st.is_some_and(|s| s.success())
            && took < Duration::from_secs(1)
            && said.ends_with(NOTHING_LEFT);
        eprintln!("chaos: {role} worker after SIGTERM: {st:?} in {took:?}: {said:?}");
        unclean += u64::from(!clean);
    }
    let lost = g("bad_bytes") + g("untyped") + g("stuck") + held + in_progress + unclean;
    if lost > 0 || g("verified") == 0 || grew {
        eprintln!("chaos: something was lost (or a survivor's RSS grew)");
        drop(_cleanup);
        std::process::exit(1);
    }
}
