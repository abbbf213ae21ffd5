//! The initiator's side of the control connection, the peer process it starts, and the
//! peers' memory figures from /proc.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::cli::{Args, MemArg};
use crate::BoxErr;

pub(crate) struct Ctl {
    pub(crate) rd: BufReader<TcpStream>,
    pub(crate) wr: TcpStream,
}

impl Ctl {
    pub(crate) fn cmd(&mut self, c: &str) -> Result<String, BoxErr> {
        writeln!(self.wr, "{c}")?;
        let mut l = String::new();
        if self.rd.read_line(&mut l)? == 0 {
            return Err(format!("peer closed the control connection after {c:?}").into());
        }
        let l = l.trim().to_string();
        match l.strip_prefix("OK") {
            Some(rest) => Ok(rest.trim().to_string()),
            None => Err(format!("peer answered {l:?} to {c:?}").into()),
        }
    }
}

pub(crate) struct Peer(pub(crate) Child);
impl Drop for Peer {
    fn drop(&mut self) {
        // Normally it exits on QUIT (or when the control connection closes); give it a second,
        // then make sure it never outlives us.
        let end = Instant::now() + Duration::from_secs(1);
        while let Ok(None) = self.0.try_wait() {
            if Instant::now() >= end {
                let _ = self.0.kill();
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = self.0.wait();
    }
}

pub(crate) fn spawn_peer(args: &Args, transport: &str) -> Result<(Peer, SocketAddr), BoxErr> {
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args([
        "--listen",
        "127.0.0.1:0",
        "--once",
        "--transport",
        transport,
    ]);
    if let Some(d) = &args.net_devices {
        cmd.args(["--net-devices", d]);
    }
    if args.busy_poll {
        cmd.arg("--busy-poll");
    }
    if args.ucx_only {
        cmd.arg("--ucx-only");
    }
    if args.no_peer_failure {
        cmd.arg("--no-peer-failure");
    }
    if args.no_device_lane {
        cmd.arg("--no-device-lane");
    }
    cmd.args([
        "--memory",
        match args.memory {
            MemArg::Host => "host",
            MemArg::Thp => "thp",
            MemArg::Sim => "sim",
            MemArg::Cuda => "cuda",
        },
        "--device",
        &args.device.to_string(),
        "--gpu-path",
        &args.gpu_path.to_string(),
        "--cuda-alloc",
        args.cuda_alloc.name(),
        "--staging-chunks",
        &args.staging_chunks.to_string(),
        "--staging-chunk-kib",
        &args.staging_chunk_kib.to_string(),
        "--compress-threads",
        &args.compress_threads.to_string(),
    ]);
    if let Some(s) = &args.secret {
        cmd.args(["--secret", s]);
        if args.lane_encryption {
            cmd.arg("--lane-encryption");
        }
    }
    let mut child = cmd.stdout(Stdio::piped()).stdin(Stdio::null()).spawn()?;
    let out = child.stdout.take().ok_or("no stdout from peer")?;
    let peer = Peer(child);
    let mut l = String::new();
    BufReader::new(out).read_line(&mut l)?;
    let ctl = l
        .split_whitespace()
        .find_map(|w| w.strip_prefix("ctl="))
        .ok_or_else(|| format!("peer did not start: {l:?}"))?
        .parse()?;
    Ok((peer, ctl))
}

/// Resident set size of a process, bytes.
pub(crate) fn rss(pid: u32) -> u64 {
    proc_status_bytes(pid, "VmRSS:")
}

/// Peak resident set size (VmHWM) of a process, bytes.
pub(crate) fn rss_peak(pid: u32) -> u64 {
    proc_status_bytes(pid, "VmHWM:")
}

/// A `kB` field of /proc/PID/status, in bytes (0 if unreadable).
pub(crate) fn proc_status_bytes(pid: u32, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .unwrap_or(0)
        * 1024
}
