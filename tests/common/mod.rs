//! Shared by the integration tests that drive `kvxfer-bench` peer processes: start one, read
//! its READY line, talk its control protocol, stop it by its own pid.

#![allow(dead_code, clippy::unwrap_used)] // Each test file uses part of it; tests fail loudly.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};

/// Spawns `cmd` (a `kvxfer-bench --listen ...`, possibly behind `ip netns exec`) and waits
/// for its READY line. Returns the child and the line.
pub fn spawn_peer(cmd: &mut Command) -> (Child, String) {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let mut ready = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut ready)
        .unwrap();
    assert!(ready.contains("READY"), "peer did not start: {ready:?}");
    (child, ready)
}

/// A `key=value` word of the READY line.
pub fn field<'a>(ready: &'a str, key: &str) -> &'a str {
    ready
        .split_whitespace()
        .find_map(|w| w.strip_prefix(key))
        .unwrap_or_else(|| panic!("no {key} in {ready:?}"))
}

/// The peer's control address.
pub fn ctl_addr(ready: &str) -> SocketAddr {
    field(ready, "ctl=").parse().unwrap()
}

/// Kills the bench by the pid on its READY line: `ip netns exec` forks, so killing the `ip`
/// process would leave the bench running.
pub fn kill_bench(ready: &str) {
    if let Ok(pid) = field(ready, "pid=").parse::<i32>() {
        // SAFETY: kill(2) has no memory preconditions; the pid is a peer this test started.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
}

/// The peer's line-based control connection.
pub struct Control {
    rd: BufReader<TcpStream>,
    wr: TcpStream,
}

impl Control {
    pub fn connect(addr: SocketAddr) -> Control {
        let s = TcpStream::connect(addr).unwrap();
        Control {
            rd: BufReader::new(s.try_clone().unwrap()),
            wr: s,
        }
    }

    /// Sends a command; asserts an OK answer and returns what follows it.
    pub fn cmd(&mut self, c: &str) -> String {
        writeln!(self.wr, "{c}").unwrap();
        let mut l = String::new();
        self.rd.read_line(&mut l).unwrap();
        assert!(l.starts_with("OK"), "{c}: {l}");
        l[2..].trim().to_string()
    }
}

/// The example `name`'s binary (target/<profile>/examples/<name>, next to the test's
/// target/<profile>/deps/<test>), built here when `cargo test --test ...` did not build
/// the examples.
pub fn example(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().parent().unwrap();
    let p = dir.join("examples").join(name);
    if !p.exists() {
        let ok = Command::new(env!("CARGO"))
            .args(["build", "--example", name])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .unwrap()
            .success();
        assert!(ok, "building examples/{name}.rs failed");
    }
    p
}

/// Whether kvxfer was built against UCX 1.13 (Debian 12's), whose faults some tests can only
/// report: they run and assert against the 1.22 wheel, which CI runs too.
pub fn ucx_1_13() -> Option<&'static str> {
    let v = kvxfer::Agent::ucx_build_version();
    v.starts_with("1.13.").then_some(v)
}
