//! Connector telemetry: per-request figures, aggregate counters and histograms, rendered as
//! Prometheus text (serve it from any HTTP endpoint the engine already has; no server here).
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::time::Duration;

/// What one request's handoff did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestStats {
    /// The request.
    pub request: String,
    /// Bytes moved over the wire.
    pub bytes_moved: u64,
    /// Bytes not moved because the other side already held them (prefix cache).
    pub bytes_skipped: u64,
    /// Descriptors transferred.
    pub descriptors: u64,
    /// Time spent posting the transfers (sum over layers).
    pub post_time: Duration,
    /// Time the transfers ran (sum over layers).
    pub transfer_time: Duration,
    /// From start of the load (or publication) to done.
    pub handoff_time: Duration,
}

const BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
];

#[derive(Debug, Default, Clone)]
struct Hist {
    counts: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Hist {
    fn observe(&mut self, v: f64) {
        for (i, b) in BUCKETS.iter().enumerate() {
            if v <= *b {
                self.counts[i] += 1;
            }
        }
        self.count += 1;
        self.sum += v;
    }
}

#[derive(Debug, Default)]
struct Agg {
    ok: u64,
    failed: u64,
    bytes_moved: u64,
    bytes_skipped: u64,
    descriptors: u64,
    handoff: Hist,
    transfer: Hist,
    post: Hist,
    /// Producer: what each reader keeps held (requests, bytes); only readers holding some.
    peers: BTreeMap<String, PeerHeld>,
    share_refused: u64,
}

/// What one reader keeps held on a producer: requests it is reading and their bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PeerHeld {
    /// Requests.
    pub requests: u64,
    /// Their bytes (blocks times the bytes of a block over every layer).
    pub bytes: u64,
}

/// Aggregates of a connector (producer or consumer).
#[derive(Debug)]
pub struct Telemetry {
    role: &'static str,
    agg: Mutex<Agg>,
}

impl Telemetry {
    /// Empty aggregates for a connector of role `role` (`"producer"`, `"consumer"`): what an
    /// implementation of the connector traits returns from `telemetry()`.
    pub fn new(role: &'static str) -> Telemetry {
        Telemetry {
            role,
            agg: Mutex::new(Agg::default()),
        }
    }

    /// Counts a completed handoff.
    pub fn record(&self, s: &RequestStats) {
        let mut a = self.agg.lock().unwrap_or_else(|e| e.into_inner());
        a.ok += 1;
        a.bytes_moved += s.bytes_moved;
        a.bytes_skipped += s.bytes_skipped;
        a.descriptors += s.descriptors;
        a.handoff.observe(s.handoff_time.as_secs_f64());
        a.transfer.observe(s.transfer_time.as_secs_f64());
        a.post.observe(s.post_time.as_secs_f64());
    }

    /// Counts a handoff this side served without moving its bytes itself (a pull producer's:
    /// its consumers read them), `handoff_time` from publication to the last reader's
    /// acknowledgement. No bytes or transfer times are counted: the readers have those.
    pub fn served(&self, handoff_time: Duration) {
        let mut a = self.agg.lock().unwrap_or_else(|e| e.into_inner());
        a.ok += 1;
        a.handoff.observe(handoff_time.as_secs_f64());
    }

    /// Counts a failed handoff.
    pub fn failed(&self) {
        self.agg.lock().unwrap_or_else(|e| e.into_inner()).failed += 1;
    }

    /// Producer: `peer` now holds `held` (zero: nothing, and it leaves the metrics).
    pub fn peer_held(&self, peer: &str, held: PeerHeld) {
        let mut a = self.agg.lock().unwrap_or_else(|e| e.into_inner());
        if held.requests == 0 {
            a.peers.remove(peer);
        } else {
            a.peers.insert(peer.to_string(), held);
        }
    }

    /// Producer: a reader's call was refused past its share ([`PeerShare`]).
    ///
    /// [`PeerShare`]: kvxfer_proto::lifecycle::PeerShare
    pub fn share_refused(&self) {
        self.agg
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .share_refused += 1;
    }

    /// Producer: what each reader holds now, by name.
    pub fn peers_held(&self) -> Vec<(String, PeerHeld)> {
        let a = self.agg.lock().unwrap_or_else(|e| e.into_inner());
        a.peers.iter().map(|(k, v)| (k.clone(), *v)).collect()
    }

    /// Producer: readers' calls refused past their share, so far.
    pub fn shares_refused(&self) -> u64 {
        self.agg
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .share_refused
    }

    /// Totals: (requests done, requests failed, bytes moved, bytes skipped).
    pub fn totals(&self) -> (u64, u64, u64, u64) {
        let a = self.agg.lock().unwrap_or_else(|e| e.into_inner());
        (a.ok, a.failed, a.bytes_moved, a.bytes_skipped)
    }

    /// Prometheus text exposition format (version 0.0.4).
    pub fn prometheus(&self) -> String {
        let a = self.agg.lock().unwrap_or_else(|e| e.into_inner());
        let r = self.role;
        let mut o = String::new();
        let _ = writeln!(o, "# HELP kvxfer_requests_total Handoffs by result.");
        let _ = writeln!(o, "# TYPE kvxfer_requests_total counter");
        let _ = writeln!(
            o,
            "kvxfer_requests_total{{role=\"{r}\",result=\"ok\"}} {}",
            a.ok
        );
        let _ = writeln!(
            o,
            "kvxfer_requests_total{{role=\"{r}\",result=\"failed\"}} {}",
            a.failed
        );
        for (name, help, v) in [
            (
                "kvxfer_bytes_moved_total",
                "KV bytes moved over the wire.",
                a.bytes_moved,
            ),
            (
                "kvxfer_bytes_skipped_total",
                "KV bytes not moved: already cached.",
                a.bytes_skipped,
            ),
            (
                "kvxfer_descriptors_total",
                "Descriptors transferred.",
                a.descriptors,
            ),
        ] {
            let _ = writeln!(o, "# HELP {name} {help}");
            let _ = writeln!(o, "# TYPE {name} counter");
            let _ = writeln!(o, "{name}{{role=\"{r}\"}} {v}");
        }
        for (name, help, h) in [
            (
                "kvxfer_handoff_seconds",
                "Start of load to done, per request.",
                &a.handoff,
            ),
            (
                "kvxfer_transfer_seconds",
                "Transfer time per request.",
                &a.transfer,
            ),
            ("kvxfer_post_seconds", "Posting time per request.", &a.post),
        ] {
            let _ = writeln!(o, "# HELP {name} {help}");
            let _ = writeln!(o, "# TYPE {name} histogram");
            for (b, c) in BUCKETS.iter().zip(h.counts) {
                let _ = writeln!(o, "{name}_bucket{{role=\"{r}\",le=\"{b}\"}} {c}");
            }
            let _ = writeln!(o, "{name}_bucket{{role=\"{r}\",le=\"+Inf\"}} {}", h.count);
            let _ = writeln!(o, "{name}_sum{{role=\"{r}\"}} {}", h.sum);
            let _ = writeln!(o, "{name}_count{{role=\"{r}\"}} {}", h.count);
        }
        if r == "producer" {
            let name = "kvxfer_share_refused_total";
            let _ = writeln!(o, "# HELP {name} Readers' calls refused past their share.");
            let _ = writeln!(o, "# TYPE {name} counter");
            let _ = writeln!(o, "{name}{{role=\"{r}\"}} {}", a.share_refused);
            for (name, help, of) in [
                (
                    "kvxfer_peer_requests_held",
                    "Requests a reader is reading from this producer.",
                    (|h: &PeerHeld| h.requests) as fn(&PeerHeld) -> u64,
                ),
                (
                    "kvxfer_peer_bytes_held",
                    "Bytes of this producer's cache a reader keeps held.",
                    |h: &PeerHeld| h.bytes,
                ),
            ] {
                let _ = writeln!(o, "# HELP {name} {help}");
                let _ = writeln!(o, "# TYPE {name} gauge");
                for (peer, h) in &a.peers {
                    let peer = label(peer);
                    let _ = writeln!(o, "{name}{{role=\"{r}\",peer=\"{peer}\"}} {}", of(h));
                }
            }
        }
        o
    }
}

/// A Prometheus label value: backslash, quote and newline escaped (a peer's name is its own).
fn label(v: &str) -> String {
    let mut o = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => o.push_str("\\\\"),
            '"' => o.push_str("\\\""),
            '\n' => o.push_str("\\n"),
            c => o.push(c),
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prometheus_text() {
        let t = Telemetry::new("consumer");
        t.record(&RequestStats {
            request: "r".into(),
            bytes_moved: 100,
            bytes_skipped: 900,
            descriptors: 3,
            post_time: Duration::from_micros(10),
            transfer_time: Duration::from_millis(20),
            handoff_time: Duration::from_millis(30),
        });
        t.failed();
        let p = t.prometheus();
        assert!(p.contains("kvxfer_requests_total{role=\"consumer\",result=\"ok\"} 1"));
        assert!(p.contains("kvxfer_requests_total{role=\"consumer\",result=\"failed\"} 1"));
        assert!(p.contains("kvxfer_bytes_skipped_total{role=\"consumer\"} 900"));
        assert!(p.contains("kvxfer_handoff_seconds_bucket{role=\"consumer\",le=\"0.025\"} 0"));
        assert!(p.contains("kvxfer_handoff_seconds_bucket{role=\"consumer\",le=\"0.05\"} 1"));
        assert!(p.contains("kvxfer_handoff_seconds_count{role=\"consumer\"} 1"));
        assert_eq!(t.totals(), (1, 1, 100, 900));
        assert!(!p.contains("kvxfer_peer_requests_held"), "producer only");
    }

    #[test]
    fn per_peer_holds_in_prometheus_text() {
        let t = Telemetry::new("producer");
        let held = |requests, bytes| PeerHeld { requests, bytes };
        t.peer_held("dec-0", held(3, 3 << 20));
        t.peer_held("ev\"il\n", held(1, 10));
        t.share_refused();
        let p = t.prometheus();
        assert!(p.contains("kvxfer_peer_requests_held{role=\"producer\",peer=\"dec-0\"} 3"));
        assert!(p.contains("kvxfer_peer_bytes_held{role=\"producer\",peer=\"dec-0\"} 3145728"));
        assert!(p.contains("peer=\"ev\\\"il\\n\"} 1"), "{p}");
        assert!(p.contains("kvxfer_share_refused_total{role=\"producer\"} 1"));
        t.peer_held("dec-0", held(0, 0));
        assert_eq!(t.peers_held(), vec![("ev\"il\n".to_string(), held(1, 10))]);
    }
}
