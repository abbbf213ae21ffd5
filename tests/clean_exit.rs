//! Clean exits: kvxfer-bench's peer and initiator, and the two-process examples (disagg,
//! engine), exit 0 within a second of SIGTERM, also in the middle of transfers, with their
//! memory deregistered and their agents closed (each says what is left of kvxfer in it:
//! nothing); SIGINT (or a second SIGTERM) cancels a transfer in flight at once, safely: the
//! bench peer goes on serving the next initiator, bytes verified.
#![allow(clippy::unwrap_used)] // Tests fail loudly on purpose.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// What a process that stopped in order says is left of kvxfer in it.
const NOTHING_LEFT: &str =
    "left: 0 agents, 0 regions registered, 0 UCX registrations, 0 peer mappings, 0 lane windows";

/// One test at a time: each times an exit against a one-second bound on two cores.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn bench() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvxfer-bench"))
}

/// A peer serving sessions until stopped; its control address.
fn peer(transport: &str) -> (Proc, String) {
    let mut c = bench()
        .args(["--listen", "127.0.0.1:0", "--transport", transport])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(c.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    let ctl = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("ctl="))
        .unwrap()
        .to_string();
    std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
    (Proc(c), ctl)
}

fn signal(p: &Proc, sig: i32) {
    // SAFETY: kill(2) on our own child's pid; no memory is involved.
    unsafe { libc::kill(p.0.id() as i32, sig) };
}

/// Waits for `p` to exit; its status and how long it took.
fn exit_of(p: &mut Proc, within: Duration) -> (std::process::ExitStatus, Duration) {
    let t = Instant::now();
    loop {
        if let Some(st) = p.0.try_wait().unwrap() {
            return (st, t.elapsed());
        }
        assert!(
            t.elapsed() < within,
            "still running {within:?} after the signal"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// An initiator against `ctl` moving 64 MiB per transfer for many iterations (long enough
/// to be stopped in the middle); stderr kept.
fn long_initiator(ctl: &str, transport: &str) -> Proc {
    Proc(
        bench()
            .args(["--connect", ctl, "--transport", transport, "--op", "write"])
            .args([
                "--blocks",
                "2048",
                "--block-size",
                "32768",
                "--iters",
                "100000",
            ])
            .args(["--warmup", "0", "--json"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    )
}

fn stderr_of(p: &mut Proc) -> String {
    let mut s = String::new();
    std::io::Read::read_to_string(p.0.stderr.as_mut().unwrap(), &mut s).unwrap();
    s
}

#[test]
fn sigterm_and_sigint_end_every_bench_process_in_order() {
    let _one = serial();
    for transport in ["tcp", "shm"] {
        let (mut p, ctl) = peer(transport);
        for (sig, name) in [(libc::SIGTERM, "SIGTERM"), (libc::SIGINT, "SIGINT")] {
            let mut i = long_initiator(&ctl, transport);
            // In the middle of its transfers.
            std::thread::sleep(Duration::from_millis(1500));
            signal(&i, sig);
            let (st, t) = exit_of(&mut i, Duration::from_secs(1));
            let said = stderr_of(&mut i);
            assert!(
                st.success(),
                "{transport} initiator after {name}: {st}: {said}"
            );
            assert!(said.contains(&format!("stopped by {name}")), "{said}");
            assert!(said.contains(NOTHING_LEFT), "{said}");
            println!(
                "{transport}: initiator exited 0 {t:?} after {name}: {}",
                said.trim()
            );
        }
        // The peer serves the next initiator as if nothing happened: bytes verified.
        let out = bench()
            .args([
                "--connect",
                &ctl,
                "--transport",
                transport,
                "--op",
                "read,write",
            ])
            .args([
                "--blocks",
                "256",
                "--block-size",
                "32768",
                "--iters",
                "2",
                "--json",
            ])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{text}");
        assert_eq!(text.matches("\"verified\":true").count(), 2, "{text}");
        // The peer itself, idle: SIGTERM, exit 0 within a second.
        signal(&p, libc::SIGTERM);
        let (st, t) = exit_of(&mut p, Duration::from_secs(1));
        assert!(st.success(), "{transport} peer: {st}");
        println!("{transport}: peer exited 0 {t:?} after SIGTERM");
    }
}

#[test]
fn a_peer_stopped_mid_transfer_fails_its_initiator_typed_and_exits_0() {
    let _one = serial();
    let (mut p, ctl) = peer("tcp");
    let mut i = long_initiator(&ctl, "tcp");
    std::thread::sleep(Duration::from_millis(1500));
    signal(&p, libc::SIGTERM);
    let (st, t) = exit_of(&mut p, Duration::from_secs(1));
    assert!(st.success(), "peer: {st}");
    // The initiator learns it from the lane or the control connection, and says so.
    let (ist, _) = exit_of(&mut i, Duration::from_secs(15));
    let said = stderr_of(&mut i);
    assert!(!ist.success(), "{said}");
    assert!(said.contains("kvxfer-bench:"), "{said}");
    println!(
        "peer exited 0 {t:?} after SIGTERM mid-transfer; its initiator: {}",
        said.trim()
    );
}

/// The two-process examples, stopped in the middle of their handoffs: the parent (which
/// passes the signal on to its child worker) and the child exit 0 within a second, both
/// saying nothing of kvxfer is left in them.
#[test]
fn the_examples_stop_in_order_mid_handoff() {
    let _one = serial();
    let runs: [(&str, &[&str]); 3] = [
        (
            "disagg",
            &[
                "--requests",
                "1000000",
                "--concurrency",
                "2",
                "--mode",
                "pull",
            ],
        ),
        (
            "disagg",
            &[
                "--requests",
                "1000000",
                "--concurrency",
                "2",
                "--mode",
                "push",
            ],
        ),
        (
            "engine",
            &[
                "--requests",
                "1000000",
                "--prompt-tokens",
                "1024",
                "--layer-ms",
                "2",
            ],
        ),
    ];
    for (name, args) in runs {
        for (sig, sname) in [(libc::SIGTERM, "SIGTERM"), (libc::SIGINT, "SIGINT")] {
            let mut p = Proc(
                Command::new(common::example(name))
                    .args(args)
                    .stdout(Stdio::null())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap(),
            );
            // Well into its handoffs (the workers start and connect in well under this).
            std::thread::sleep(Duration::from_millis(2500));
            signal(&p, sig);
            let (st, t) = exit_of(&mut p, Duration::from_secs(1));
            let said = stderr_of(&mut p);
            assert!(st.success(), "{name} {args:?} after {sname}: {st}: {said}");
            assert_eq!(said.matches(NOTHING_LEFT).count(), 2, "{name}: {said}");
            assert!(said.contains(&format!("stopped by {sname}")), "{said}");
            println!("{name} {args:?}: exited 0 {t:?} after {sname}");
        }
    }
}
