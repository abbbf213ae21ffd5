//! Deployment planning: from a model's KV geometry, a prompt length, a concurrency and a link,
//! the bytes a handoff moves, how long it takes, the host memory workers need, and whether
//! disaggregation can pay off at all. Pure arithmetic; `kvxfer-bench plan` prints it.

use crate::layout::KvGeometry;

/// What to plan for.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanInput {
    /// The model's KV geometry.
    pub geometry: KvGeometry,
    /// Prompt tokens per request.
    pub prompt_tokens: u64,
    /// Requests handed off at the same time over one link.
    pub concurrency: u64,
    /// Link throughput in bytes per second (measured by `kvxfer-bench`, or nominal).
    pub link_bytes_per_s: f64,
    /// Tokens per paged block.
    pub block_tokens: u64,
    /// Prefix tokens the decode side already holds (prefix cache hit): not moved.
    pub cached_tokens: u64,
    /// Prefill throughput of one prefill worker in tokens/s, if known.
    pub prefill_tokens_per_s: Option<f64>,
}

/// The plan.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// KV bytes per token.
    pub bytes_per_token: u64,
    /// KV bytes of one request's prompt.
    pub request_bytes: u64,
    /// Bytes actually moved per request (prompt minus the cached prefix, whole blocks).
    pub moved_bytes: u64,
    /// Descriptors per request (one per block, layer and K/V).
    pub descriptors: u64,
    /// Bytes per descriptor.
    pub block_bytes: u64,
    /// Seconds one handoff takes alone on the link.
    pub handoff_s: f64,
    /// Seconds until the last of `concurrency` simultaneous handoffs is done (they share it).
    pub handoff_all_s: f64,
    /// Host memory one worker needs to hold `concurrency` requests' KV unbounded.
    pub host_bytes: u64,
    /// Host memory one worker needs for KV in GPU memory on the staged path: the fixed pool of
    /// pinned chunks, whatever the concurrency (the default staging; none on the direct path).
    pub gpu_staging_bytes: u64,
    /// Seconds to prefill one prompt, if the prefill throughput is known.
    pub prefill_s: Option<f64>,
    /// Prefill tokens/s the link can carry (above this, handoffs queue up).
    pub link_tokens_per_s: f64,
    /// Plain-language verdicts.
    pub notes: Vec<String>,
}

/// Computes the plan.
pub fn plan(i: &PlanInput) -> Plan {
    let g = &i.geometry;
    let bpt = g.bytes_per_token();
    let bt = i.block_tokens.max(1);
    let request_bytes = bpt * i.prompt_tokens;
    // Only whole blocks past the cached prefix move.
    let cached_blocks = i.cached_tokens.min(i.prompt_tokens) / bt;
    let moved_blocks = g.blocks(i.prompt_tokens, bt) - cached_blocks;
    let block_bytes = g.block_bytes(bt);
    let moved_bytes = moved_blocks * block_bytes * g.layers * 2;
    let descriptors = moved_blocks * g.layers * 2;
    let link = i.link_bytes_per_s.max(1.0);
    let handoff_s = moved_bytes as f64 / link;
    let conc = i.concurrency.max(1);
    let handoff_all_s = handoff_s * conc as f64;
    let host_bytes = g.blocks(i.prompt_tokens, bt) * block_bytes * g.layers * 2 * conc;
    let prefill_s = i
        .prefill_tokens_per_s
        .filter(|t| *t > 0.0)
        .map(|t| i.prompt_tokens as f64 / t);
    let link_tokens_per_s = link / bpt as f64;
    let mut notes = Vec::new();
    match (prefill_s, i.prefill_tokens_per_s) {
        (Some(p), Some(tps)) => {
            if handoff_s >= p {
                notes.push(format!(
                    "disaggregation cannot pay off: moving the KV ({:.3} s) takes longer than \
                     computing it ({p:.3} s); prefill on the decode worker or get a faster link",
                    handoff_s
                ));
            } else {
                notes.push(format!(
                    "the handoff adds {:.0}% to time-to-first-token ({:.3} s on top of {p:.3} s \
                     of prefill)",
                    100.0 * handoff_s / p,
                    handoff_s
                ));
            }
            if link_tokens_per_s < tps {
                notes.push(format!(
                    "the link carries {link_tokens_per_s:.0} prefill tokens/s but one prefill \
                     worker makes {tps:.0}: handoffs queue and the prefill worker's memory grows \
                     unless bounded; use a faster link or fewer prefill workers per link"
                ));
            }
        }
        _ => notes.push(
            "give --prefill-tokens-per-s to compare the handoff with prefill time".to_string(),
        ),
    }
    let gpu_staging_bytes =
        (crate::types::DEFAULT_STAGING_CHUNKS * crate::types::DEFAULT_STAGING_CHUNK_BYTES) as u64;
    notes.push(format!(
        "KV in GPU memory: the staged path holds {} MiB of pinned host chunks per worker at any \
         concurrency, the direct path none; a host mirror of the KV (NixlConnector's \
         kv_buffer_device=cpu) would hold the {} MB above",
        gpu_staging_bytes >> 20,
        host_bytes / 1_000_000
    ));
    if i.cached_tokens > 0 {
        notes.push(format!(
            "prefix cache: {} of {} blocks are already on the decode side and do not move",
            cached_blocks,
            g.blocks(i.prompt_tokens, bt)
        ));
    }
    Plan {
        bytes_per_token: bpt,
        request_bytes,
        moved_bytes,
        descriptors,
        block_bytes,
        handoff_s,
        handoff_all_s,
        host_bytes,
        gpu_staging_bytes,
        prefill_s,
        link_tokens_per_s,
        notes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen(link: f64) -> PlanInput {
        PlanInput {
            geometry: KvGeometry::preset("qwen3-0.6b").unwrap(),
            prompt_tokens: 2371,
            concurrency: 4,
            link_bytes_per_s: link,
            block_tokens: 16,
            cached_tokens: 0,
            prefill_tokens_per_s: None,
        }
    }

    #[test]
    fn one_gbe_handoff_matches_the_measured_deployment() {
        // 117 MB/s over 1 GbE: the deployment measured 2.3-2.5 s per request.
        let p = plan(&qwen(117e6));
        assert_eq!(p.bytes_per_token, 114_688);
        assert_eq!(p.request_bytes, 271_925_248);
        assert_eq!(p.moved_bytes, 273_416_192); // 149 whole blocks
        assert_eq!(p.descriptors, 8344);
        assert!((p.handoff_s - 2.337).abs() < 0.01, "{}", p.handoff_s);
        assert!((p.handoff_all_s - 4.0 * p.handoff_s).abs() < 1e-9);
        assert_eq!(p.host_bytes, 4 * 273_416_192);
        // GPU KV on the staged path: a fixed pool, not concurrency x KV.
        assert_eq!(p.gpu_staging_bytes, 32 << 20);
        assert!(p
            .notes
            .iter()
            .any(|n| n.contains("staged path holds 32 MiB")));
    }

    #[test]
    fn verdicts() {
        // Fast prefill, slow link: cannot pay off.
        let mut i = qwen(117e6);
        i.prefill_tokens_per_s = Some(20_000.0);
        let p = plan(&i);
        assert!(p.notes[0].contains("cannot pay off"), "{:?}", p.notes);
        assert!(p.notes.iter().any(|n| n.contains("queue")));
        // Fast link: pays off.
        i.link_bytes_per_s = 10e9;
        let p = plan(&i);
        assert!(p.notes[0].contains("adds"), "{:?}", p.notes);
        assert!(!p.notes.iter().any(|n| n.contains("queue")));
    }

    #[test]
    fn prefix_hit_moves_only_missing_blocks() {
        let mut i = qwen(1e9);
        i.cached_tokens = 2032; // 127 of 149 blocks
        let p = plan(&i);
        assert_eq!(p.descriptors, 22 * 56);
        assert_eq!(p.moved_bytes, 22 * 56 * 32 * 1024);
        assert!(p.notes.iter().any(|n| n.contains("127 of 149")));
    }
}
