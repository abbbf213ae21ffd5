//! Cross-host behaviour on one machine: two network namespaces joined by a veth pair (addresses
//! in 198.18.0.0/15, names prefixed `kvx`) with a 1 Gbit/s token bucket, kvxfer-bench's peer in
//! one and the initiator in the other, bytes verified over kvxfer's TCP lane and over UCX.
//! Needs root and iproute2; says so and skips otherwise. Everything is removed on drop.

#![allow(clippy::unwrap_used)] // Tests fail loudly on purpose.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

struct Net {
    a: String,
    b: String,
    la: String,
    lb: String,
}

fn sh(args: &[&str]) -> bool {
    Command::new(args[0])
        .args(&args[1..])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

impl Net {
    fn new(tag: &str) -> Option<Net> {
        Net::with_rate(tag, "1gbit")
    }

    fn with_rate(tag: &str, rate: &str) -> Option<Net> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 || !sh(&["ip", "-V"]) || !sh(&["tc", "-V"]) {
            eprintln!("SKIP: network-namespace tests need root and iproute2 (ip, tc)");
            return None;
        }
        let id = format!("{}{tag}", std::process::id() % 100_000);
        let n = Net {
            a: format!("kvx{id}a"),
            b: format!("kvx{id}b"),
            la: format!("kvx{id}x"),
            lb: format!("kvx{id}y"),
        };
        let lb = n.lb.clone();
        let ok = sh(&["ip", "netns", "add", &n.a])
            && sh(&["ip", "netns", "add", &n.b])
            && sh(&[
                "ip", "link", "add", &n.la, "netns", &n.a, "type", "veth", "peer", "name", &lb,
                "netns", &n.b,
            ])
            && sh(&[
                "ip",
                "-n",
                &n.a,
                "addr",
                "add",
                "198.19.7.1/24",
                "dev",
                &n.la,
            ])
            && sh(&["ip", "-n", &n.b, "addr", "add", "198.19.7.2/24", "dev", &lb])
            && sh(&["ip", "-n", &n.a, "link", "set", &n.la, "up"])
            && sh(&["ip", "-n", &n.b, "link", "set", &lb, "up"])
            && sh(&[
                "ip", "netns", "exec", &n.a, "tc", "qdisc", "add", "dev", &n.la, "root", "tbf",
                "rate", rate, "burst", "256kb", "latency", "50ms",
            ])
            && sh(&[
                "ip", "netns", "exec", &n.b, "tc", "qdisc", "add", "dev", &lb, "root", "tbf",
                "rate", rate, "burst", "256kb", "latency", "50ms",
            ]);
        assert!(ok, "setting up namespaces {} / {} failed", n.a, n.b);
        n.wait_up(&lb);
        Some(n)
    }
}

impl Net {
    fn wait_up(&self, lb: &str) {
        // The kernel's link watch reports the veth carrier up to a second later; UCX (and
        // anything else) skips an interface that is not running yet.
        let up = |ns: &str, dev: &str| {
            Command::new("ip")
                .args([
                    "netns",
                    "exec",
                    ns,
                    "cat",
                    &format!("/sys/class/net/{dev}/operstate"),
                ])
                .output()
                .is_ok_and(|o| o.stdout.starts_with(b"up"))
        };
        let t = std::time::Instant::now();
        while !(up(&self.a, &self.la) && up(&self.b, lb)) {
            assert!(t.elapsed().as_secs() < 10, "veth carrier did not come up");
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        sh(&["ip", "netns", "del", &self.a]);
        sh(&["ip", "netns", "del", &self.b]);
    }
}

fn across(tag: &str, extra: &[&str], want_lane: &str) {
    let Some(net) = Net::new(tag) else { return };
    let bench = env!("CARGO_BIN_EXE_kvxfer-bench");
    let (mut peer, ready) = common::spawn_peer(
        Command::new("ip")
            .args([
                "netns",
                "exec",
                &net.b,
                bench,
                "--listen",
                "198.19.7.2:0",
                "--transport",
                "tcp",
            ])
            .args(extra),
    );
    let ctl = common::field(&ready, "ctl=").to_string();
    let out = Command::new("ip")
        .args([
            "netns",
            "exec",
            &net.a,
            bench,
            "--connect",
            &ctl,
            "--transport",
            "tcp",
        ])
        .args([
            "--op",
            "write,read",
            "--blocks",
            "512",
            "--block-size",
            "16384",
            "--iters",
            "1",
        ])
        .args(["--warmup", "0", "--json"])
        .args(extra)
        .output()
        .unwrap();
    common::kill_bench(&ready);
    let _ = peer.kill();
    let _ = peer.wait();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    for j in lines {
        assert_eq!(j["verified"], true, "{j}");
        assert_eq!(j["lane"], want_lane, "{j}");
        assert_eq!(j["bytes"], 512 * 16384);
    }
    drop(net);
}

#[test]
fn tcp_lane_across_namespaces() {
    across("t", &[], "tcp");
}

#[test]
fn ucx_tcp_across_namespaces() {
    across("u", &["--ucx-only"], "ucx");
}

/// The initiator of the link-cut scenario. It runs as a child process of `link_cut` (this test
/// binary re-executed inside the namespace with `ip netns exec`, so that UCX sees the
/// namespace's devices); in a normal test run it does nothing.
#[test]
#[ignore = "the initiator half of link_cut_*, started by them inside a namespace"]
fn link_cut_child() {
    use kvxfer::{Agent, AgentConfig, Desc, Error, HostBuffer, RegionId, Transport, XferOp};
    use std::io::Write;
    use std::time::{Duration, Instant};
    let Ok(ctl) = std::env::var("KVX_LINKCUT_CTL") else {
        return;
    };
    let dev = std::env::var("KVX_LINKCUT_DEV").unwrap();
    let lanes = std::env::var("KVX_LINKCUT_LANES").unwrap() == "1";
    const LEN: u64 = 64 << 20;
    const BLOCK: u64 = 1 << 20;
    let s = std::net::TcpStream::connect(ctl.as_str()).unwrap();
    let mut rd = BufReader::new(s.try_clone().unwrap());
    let mut wr = s;
    let mut cmd = |c: &str| {
        writeln!(wr, "{c}").unwrap();
        let mut l = String::new();
        rd.read_line(&mut l).unwrap();
        assert!(l.starts_with("OK"), "{c}: {l}");
        l[2..].trim().to_string()
    };
    let side: std::net::SocketAddr = cmd(&format!("SETUP {} {BLOCK} contiguous 1", LEN / BLOCK))
        .parse()
        .unwrap();
    let rid = RegionId(cmd("REGION").parse().unwrap());
    let agent = Agent::new(
        AgentConfig::new(format!("cut-{}", std::process::id()))
            .transport(Transport::Tcp)
            .lanes(lanes)
            .ucx_tcp(!lanes)
            .net_devices(dev),
    )
    .unwrap();
    let region = agent
        .register(HostBuffer::new(LEN as usize).unwrap())
        .unwrap();
    let peer = agent.connect(side).unwrap();
    let n = LEN / BLOCK;
    let ld: Vec<Desc> = (0..n)
        .map(|i| Desc::new(region.id(), i * BLOCK, BLOCK))
        .collect();
    let rdesc: Vec<Desc> = (0..n)
        .rev()
        .map(|i| Desc::new(rid, i * BLOCK, BLOCK))
        .collect();
    let l = agent.prep_local(&ld).unwrap();
    let r = agent.prep_remote(&peer, &rdesc).unwrap();
    let x = agent
        .transfer_all(XferOp::Write, &l, &r, None, Some(Duration::from_secs(4)))
        .unwrap();
    println!("KVX STARTED");
    std::io::stdout().flush().unwrap();
    let t = Instant::now();
    let res = x.wait();
    let typed = matches!(
        res,
        Err(Error::Deadline { .. } | Error::PeerFailed { .. } | Error::LaneFailed { .. })
    );
    println!(
        "KVX RESULT typed={} ms={} pinned={} what={:?}",
        typed as u8,
        t.elapsed().as_millis(),
        region.inflight(),
        res.map(|s| s.bytes)
    );
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap(); // the link is up again
    let t0 = Instant::now();
    let again = loop {
        let r1 = agent
            .transfer(
                XferOp::Write,
                &l,
                &[0, 1],
                &r,
                &[0, 1],
                None,
                Some(Duration::from_secs(5)),
            )
            .and_then(|x| x.wait());
        if r1.is_ok() || t0.elapsed() > Duration::from_secs(30) {
            break r1.map(|s| s.bytes);
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    println!("KVX RECOVERED {:?} ms={}", again, t0.elapsed().as_millis());
    let _ = cmd("QUIT");
}

fn link_cut(tag: &str, lanes: bool) {
    use std::io::Write;
    use std::time::Duration;
    // 200 Mbit/s: 64 MiB take about 2.7 s, time enough to cut the link in the middle.
    let Some(net) = Net::with_rate(tag, "200mbit") else {
        return;
    };
    let bench = env!("CARGO_BIN_EXE_kvxfer-bench");
    let (mut peer, ready) = common::spawn_peer(
        Command::new("ip")
            .args([
                "netns",
                "exec",
                &net.b,
                bench,
                "--listen",
                "198.19.7.2:0",
                "--transport",
                "tcp",
            ])
            .args(["--net-devices", &net.lb])
            // Without lanes both ends move every byte through UCX (with lanes UCX's TCP is
            // off).
            .args(if lanes { &[][..] } else { &["--ucx-only"][..] }),
    );
    let ctl = common::field(&ready, "ctl=").to_string();
    let mut child = Command::new("ip")
        .args(["netns", "exec", &net.a])
        .arg(std::env::current_exe().unwrap())
        .args([
            "link_cut_child",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("KVX_LINKCUT_CTL", &ctl)
        .env("KVX_LINKCUT_DEV", &net.la)
        .env("KVX_LINKCUT_LANES", if lanes { "1" } else { "0" })
        .stdout(Stdio::piped())
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut stdin = child.stdin.take().unwrap();
    let next = |out: &mut BufReader<std::process::ChildStdout>, prefix: &str| -> String {
        let mut l = String::new();
        loop {
            l.clear();
            assert!(
                out.read_line(&mut l).unwrap() > 0,
                "child ended before {prefix}"
            );
            // libtest prints "test link_cut_child ... " before the test's own output.
            if let Some(i) = l.find(prefix) {
                return l[i + prefix.len()..].trim().to_string();
            }
        }
    };
    next(&mut out, "KVX STARTED");
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        sh(&["ip", "-n", &net.a, "link", "set", &net.la, "down"]),
        "link down"
    );
    let res = next(&mut out, "KVX RESULT ");
    assert!(
        sh(&["ip", "-n", &net.a, "link", "set", &net.la, "up"]),
        "link up"
    );
    net.wait_up(&net.lb);
    writeln!(stdin, "up").unwrap();
    let rec = next(&mut out, "KVX RECOVERED ");
    let _ = child.wait();
    // The serving side lived through the cut (no UCX fatal error, no panic) and served the
    // transfer after it.
    let served_on = peer.try_wait().unwrap();
    common::kill_bench(&ready);
    let _ = peer.kill();
    let _ = peer.wait();
    eprintln!(
        "link cut ({}): {res}; after link up: {rec}",
        if lanes { "tcp lane" } else { "ucx" }
    );
    assert!(
        res.contains("typed=1"),
        "untyped result after the link cut: {res}"
    );
    assert!(res.contains("pinned=0"), "memory still pinned: {res}");
    let ms: u64 = res
        .split("ms=")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(ms < 8000, "the error took {ms} ms");
    assert!(
        rec.starts_with("Ok(2097152)"),
        "no recovery after the link came back: {rec}"
    );
    assert!(
        served_on.is_none(),
        "the serving kvxfer-bench ended ({served_on:?}) after the link cut"
    );
    drop(net);
}

#[test]
fn link_cut_mid_transfer_tcp_lane() {
    link_cut("c", true);
}

#[test]
fn link_cut_mid_transfer_ucx() {
    // UCX 1.13's emulated RMA over TCP aborts the serving process once the cut connection
    // fails ("unexpected error: Endpoint timeout" from ucp_put_handler, in every run measured);
    // its TCP transport is off unless opted in (`AgentConfig::ucx_tcp`), as kvxfer-bench
    // --ucx-only does. CI runs this against the 1.22 wheel too, which survives the cut.
    if let Some(v) = common::ucx_1_13() {
        eprintln!("skipped: UCX {v} aborts the serving side of a cut UCX-over-TCP link");
        return;
    }
    link_cut("d", false);
}
