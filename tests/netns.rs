//! Cross-host behaviour on one machine: two network namespaces joined by a veth pair (addresses
//! in 198.18.0.0/15, names prefixed `kvx`) with a 1 Gbit/s token bucket, kvxfer-bench's peer in
//! one and the initiator in the other, bytes verified over kvxfer's TCP lane and over UCX.
//! Needs root and iproute2; says so and skips otherwise. Everything is removed on drop.

#![allow(clippy::unwrap_used)] // Tests fail loudly on purpose.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

struct Net {
    a: String,
    b: String,
    la: String,
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
        };
        let lb = format!("kvx{id}y");
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
                "rate", "1gbit", "burst", "256kb", "latency", "50ms",
            ])
            && sh(&[
                "ip", "netns", "exec", &n.b, "tc", "qdisc", "add", "dev", &lb, "root", "tbf",
                "rate", "1gbit", "burst", "256kb", "latency", "50ms",
            ]);
        assert!(ok, "setting up namespaces {} / {} failed", n.a, n.b);
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
        while !(up(&n.a, &n.la) && up(&n.b, &lb)) {
            assert!(t.elapsed().as_secs() < 10, "veth carrier did not come up");
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        Some(n)
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
    let mut peer = Command::new("ip")
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
        .args(extra)
        .stdout(Stdio::piped())
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let mut ready = String::new();
    BufReader::new(peer.stdout.take().unwrap())
        .read_line(&mut ready)
        .unwrap();
    let ctl = ready
        .split_whitespace()
        .find_map(|w| w.strip_prefix("ctl="))
        .unwrap_or_else(|| panic!("peer did not start: {ready:?}"))
        .to_string();
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
