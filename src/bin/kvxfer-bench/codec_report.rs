//! What compression did in a run: bytes on the wire against raw bytes, and the CPU each side
//! spent, in all and coding, per GB moved (this process and the peer, from its `CODEC`).

use kvxfer::{Agent, Compression, XferStats};

use crate::cli::DataArg;
use crate::control::Ctl;
use crate::BoxErr;

/// The measured iterations' transfers.
#[derive(Default)]
pub(crate) struct CodecRun {
    raw: u64,
    wire: u64,
    transfers: usize,
    compressed: usize,
}

impl CodecRun {
    pub(crate) fn add(&mut self, s: &XferStats) {
        self.raw += s.bytes;
        self.wire += s.wire_bytes;
        self.transfers += 1;
        self.compressed += usize::from(s.wire_bytes != s.bytes);
    }

    fn ratio(&self) -> f64 {
        if self.wire == 0 {
            1.0
        } else {
            self.raw as f64 / self.wire as f64
        }
    }

    /// Adds the figures to the run's JSON line.
    pub(crate) fn report(
        &self,
        j: &mut serde_json::Value,
        mode: Compression,
        data: DataArg,
        cpu: Option<&CpuUse>,
    ) {
        j["compress"] = format!("{mode:?}").to_lowercase().into();
        j["data"] = format!("{data:?}").to_lowercase().into();
        j["wire_bytes_per_transfer"] = (self.wire / self.transfers.max(1) as u64).into();
        j["compressed_transfers"] = self.compressed.into();
        j["ratio"] = self.ratio().into();
        if let Some(c) = cpu {
            let gb = self.raw as f64 / 1e9;
            if gb > 0.0 {
                j["cpu_ms_per_gb_self"] = (c.self_cpu_ns as f64 / 1e6 / gb).into();
                j["cpu_ms_per_gb_peer"] = c.peer_cpu_ns.map(|n| n as f64 / 1e6 / gb).into();
                j["codec_ms_per_gb_self"] = (c.self_codec_ns as f64 / 1e6 / gb).into();
                j["codec_ms_per_gb_peer"] = c.peer_codec_ns.map(|n| n as f64 / 1e6 / gb).into();
            }
        }
    }

    /// One line for the table: when any transfer was compressed, or `always`.
    pub(crate) fn summary(&self, cpu: Option<&CpuUse>, always: bool) -> Option<String> {
        if self.compressed == 0 && !always {
            return None;
        }
        let gb = self.raw as f64 / 1e9;
        let per_gb =
            |ns: Option<u64>| ns.map_or("-".into(), |n| format!("{:.0}", n as f64 / 1e6 / gb));
        let mut l = format!(
            "{} {}/{} transfers: ratio {:.3} ({:.1} MB on the wire per transfer)",
            if self.compressed > 0 {
                "compressed"
            } else {
                "raw"
            },
            self.compressed,
            self.transfers,
            self.ratio(),
            self.wire as f64 / self.transfers.max(1) as f64 / 1e6
        );
        if let Some(c) = cpu {
            l += &format!(
                "; CPU ms/GB here {} (coding, wall {}), peer {} (coding, wall {})",
                per_gb(Some(c.self_cpu_ns)),
                per_gb(Some(c.self_codec_ns)),
                per_gb(c.peer_cpu_ns),
                per_gb(c.peer_codec_ns)
            );
        }
        Some(l)
    }
}

/// This process's CPU time (user and system), ns.
fn cpu_ns() -> u64 {
    let Ok(s) = std::fs::read_to_string("/proc/self/stat") else {
        return 0;
    };
    // Fields after the command name (which may hold spaces): state is field 3, utime 14.
    let rest = s.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<u64> = rest
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|x| x.parse().ok())
        .collect();
    // SAFETY: sysconf reads a constant of the system.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    f.iter().sum::<u64>() * 1_000_000_000 / hz
}

/// The `CODEC` answer: coding time (encode + decode, ns) and process CPU time (ns).
pub(crate) fn local_line(agent: &Agent) -> String {
    let t = agent.codec_totals();
    format!(
        "{} {}",
        (t.encoded.busy + t.decoded.busy).as_nanos(),
        cpu_ns()
    )
}

/// CPU time and coding time of both sides at the start of the measured iterations.
pub(crate) struct CpuClock {
    own: (u64, u64),
    peer: Option<(u64, u64)>,
}

/// What both sides spent during the measured iterations.
pub(crate) struct CpuUse {
    self_cpu_ns: u64,
    self_codec_ns: u64,
    peer_cpu_ns: Option<u64>,
    peer_codec_ns: Option<u64>,
}

fn own(agent: &Agent) -> (u64, u64) {
    let t = agent.codec_totals();
    (
        (t.encoded.busy + t.decoded.busy).as_nanos() as u64,
        cpu_ns(),
    )
}

fn peer(ctl: &mut Ctl) -> Option<(u64, u64)> {
    // A peer of an older build has no CODEC command: its side is left out.
    let l = ctl.cmd("CODEC").ok()?;
    let v: Vec<u64> = l
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    Some((*v.first()?, *v.get(1)?))
}

impl CpuClock {
    pub(crate) fn start(agent: &Agent, ctl: &mut Ctl) -> Result<CpuClock, BoxErr> {
        Ok(CpuClock {
            own: own(agent),
            peer: peer(ctl),
        })
    }

    pub(crate) fn stop(self, agent: &Agent, ctl: &mut Ctl) -> Result<CpuUse, BoxErr> {
        let now = own(agent);
        let p = peer(ctl);
        let d = |a: (u64, u64), b: (u64, u64)| (b.0.saturating_sub(a.0), b.1.saturating_sub(a.1));
        let pd = self.peer.zip(p).map(|(a, b)| d(a, b));
        let o = d(self.own, now);
        Ok(CpuUse {
            self_cpu_ns: o.1,
            self_codec_ns: o.0,
            peer_cpu_ns: pd.map(|x| x.1),
            peer_codec_ns: pd.map(|x| x.0),
        })
    }
}
