//! What an agent reports about its memory: Prometheus text and the staging counters.
#![forbid(unsafe_code)]

use std::sync::atomic::Ordering;

use super::state::AgentState;
use crate::staging::pool::StagingStats;

/// The agent's memory in Prometheus text format: its budget (limit, used, peak, waits),
/// the device staging chunks (bytes, in use, peaks, waits) once allocated, dropped
/// notifications, the peer table (loaded, evicted, refused) and the UCX fence (initiators
/// taken in, refused, refusals unsaid). Labelled with the agent's name.
pub(crate) fn prometheus(st: &AgentState) -> String {
    use std::fmt::Write;
    let n = st.name.replace(['\\', '"', '\n'], "_");
    let b = &st.budget;
    let mut o = String::new();
    let mut gauge = |name: &str, help: &str, kind: &str, v: u64| {
        let _ = writeln!(o, "# HELP {name} {help}");
        let _ = writeln!(o, "# TYPE {name} {kind}");
        let _ = writeln!(o, "{name}{{agent=\"{n}\"}} {v}");
    };
    if b.limit() != u64::MAX {
        gauge(
            "kvxfer_budget_limit_bytes",
            "Memory the agent may allocate.",
            "gauge",
            b.limit(),
        );
    }
    gauge(
        "kvxfer_budget_used_bytes",
        "Memory charged now.",
        "gauge",
        b.used(),
    );
    gauge(
        "kvxfer_budget_peak_bytes",
        "Most memory charged at once.",
        "gauge",
        b.peak(),
    );
    gauge(
        "kvxfer_budget_waits_total",
        "Charges that waited for memory (backpressure).",
        "counter",
        b.waits(),
    );
    gauge(
        "kvxfer_notifications_dropped_total",
        "Notifications dropped on a full queue.",
        "counter",
        st.channels.user.dropped(),
    );
    gauge(
        "kvxfer_peers_loaded",
        "Peers in the agent's table now.",
        "gauge",
        st.peers.read().unwrap_or_else(|e| e.into_inner()).len() as u64,
    );
    gauge(
        "kvxfer_peers_evicted_total",
        "Idle peers evicted to make room for a newcomer.",
        "counter",
        st.peers_evicted.load(Ordering::Relaxed),
    );
    gauge(
        "kvxfer_peers_refused_total",
        "Peers refused: the table was full and none was idle.",
        "counter",
        st.peers_refused.load(Ordering::Relaxed),
    );
    let ucx = st.cmds.engine_counts();
    gauge(
        "kvxfer_ucx_fence_peers",
        "UCX initiators that announced themselves and are told of deregistrations (the UCX \
         fence).",
        "gauge",
        ucx.peers.load(Ordering::Relaxed),
    );
    gauge(
        "kvxfer_ucx_fence_refused_total",
        "UCX initiators' announcements not taken in: the fence's table full, or the process \
         short of file descriptors.",
        "counter",
        ucx.refused.load(Ordering::Relaxed),
    );
    gauge(
        "kvxfer_ucx_fence_refusals_unsaid_total",
        "Of those, the ones the initiator was not told of (no endpoint to it could be spared): \
         its UCX transfers wait until their deadline.",
        "counter",
        ucx.unanswered.load(Ordering::Relaxed),
    );
    gauge(
        "kvxfer_ucx_am_batch_peak_bytes",
        "The most active-message bytes (notifications, UCX fence messages) the UCX engine held \
         copied at once before handling them: at most 1 MiB plus one progress call's worth.",
        "gauge",
        ucx.am_batch_peak.load(Ordering::Relaxed),
    );
    gauge(
        "kvxfer_lane_windows",
        "TCP lane connections to or from a same-host peer whose data goes through a shared \
         window, in this process (both ends count).",
        "gauge",
        crate::live::live().lane_windows as u64,
    );
    if let Some(st) = staging_stats(st) {
        gauge(
            "kvxfer_staging_bytes",
            "Pinned host chunks for device memory (allocated once).",
            "gauge",
            st.bytes,
        );
        gauge(
            "kvxfer_staging_chunks_in_use",
            "Staging chunks held by transfers now.",
            "gauge",
            st.in_use as u64,
        );
        gauge(
            "kvxfer_staging_chunks_peak",
            "Most staging chunks held at once (either pool).",
            "gauge",
            st.peak_initiator.max(st.peak_target) as u64,
        );
        gauge(
            "kvxfer_staging_waits_total",
            "Transfers that waited for staging chunks.",
            "counter",
            st.waits,
        );
    }
    o
}

/// Counters of the device staging chunks, once allocated.
pub(crate) fn staging_stats(st: &AgentState) -> Option<StagingStats> {
    st.staging.existing().map(|s| s.stats())
}
