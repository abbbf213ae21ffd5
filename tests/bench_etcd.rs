//! `kvxfer-bench --etcd URL` on both sides, against a real etcd (feature `etcd`; Debian's
//! `etcd-server`, on free ports): the peer publishes itself and its control address, the
//! initiator finds both by the peer's name (no --listen / --connect, no side channel) and
//! moves verified bytes, READ and WRITE, over TCP and shared memory, through kvxfer's lanes
//! and through UCX alone; a peer name nobody published is a clear error.
#![cfg(feature = "etcd")]
#![allow(clippy::unwrap_used)] // Tests fail loudly on purpose.

#[path = "../kvxfer/tests/support/etcd_server.rs"]
mod etcd_server;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

struct Peer(Child);

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn peer(url: &str, ns: &str, name: &str, extra: &[&str]) -> Peer {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvxfer-bench"))
        .args(["--etcd", url, "--serve", "--namespace", ns, "--name", name])
        .args(extra)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(c.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert!(
        line.contains("READY") && line.contains("side=etcd"),
        "{line}"
    );
    std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
    Peer(c)
}

fn bench(url: &str, ns: &str, name: &str, args: &[&str]) -> Result<Vec<serde_json::Value>, String> {
    let out = Command::new(env!("CARGO_BIN_EXE_kvxfer-bench"))
        .args(["--etcd", url, "--namespace", ns, "--peer", name])
        .args(args)
        .args(["--json", "--iters", "2", "--warmup", "1", "--blocks", "512"])
        .args(["--block-size", "16384"])
        .output()
        .unwrap();
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect())
}

#[test]
fn bench_finds_its_peer_through_etcd() {
    let Some(etcd) = etcd_server::Etcd::start() else {
        return;
    };
    let url = etcd.url();
    let ns = format!("/kvx-bench-{}", std::process::id());
    for (transport, extra) in [
        ("tcp", &[][..]),
        ("auto", &[][..]),
        ("tcp", &["--ucx-only"][..]),
    ] {
        let _p = peer(&url, &ns, "bench-peer", extra);
        let mut args = vec!["--transport", transport, "--op", "read,write"];
        args.extend_from_slice(extra);
        let rows = bench(&url, &ns, "bench-peer", &args).unwrap();
        assert_eq!(rows.len(), 2, "{rows:?}");
        for j in &rows {
            assert_eq!(j["verified"], true, "{j}");
            assert_eq!(j["bytes"], 512 * 16384, "{j}");
        }
        println!(
            "--etcd, {transport} {extra:?}: {}",
            rows.iter()
                .map(|j| format!("{} via {} verified", j["op"], j["lane"]))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let e = bench(&url, &ns, "nobody", &[]).unwrap_err();
    assert!(e.contains("no kvxfer-bench peer \"nobody\" in etcd"), "{e}");
    println!("unknown peer: {}", e.trim());
}
