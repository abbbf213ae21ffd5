//! `kvxfer-bench plan`: handoff time and memory from a model, a prompt, a link.

use kvxfer::layout::KvGeometry;

use crate::cli::PlanArgs;
use crate::BoxErr;

pub(crate) fn plan(p: &PlanArgs) -> Result<(), BoxErr> {
    let mut g = match (&p.model, &p.config) {
        (_, Some(path)) => KvGeometry::from_hf_config(
            &path.display().to_string(),
            &std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?,
        )?,
        (Some(m), None) => KvGeometry::preset(m)?,
        (None, None) => KvGeometry::preset("qwen3-0.6b")?,
    };
    if let Some(d) = &p.kv_dtype {
        g.dtype = kvxfer::layout::KvDtype::parse(d)?;
    }
    let (link, link_src) = match (&p.link_gbps, &p.bench_json) {
        (Some(gb), _) => (gb * 1e9 / 8.0, format!("{gb} Gbit/s (given)")),
        (None, Some(f)) => {
            let s = std::fs::read_to_string(f).map_err(|e| format!("{}: {e}", f.display()))?;
            let line = s
                .lines()
                .rev()
                .find(|l| l.trim_start().starts_with('{'))
                .ok_or("no JSON line in --bench-json")?;
            let j: serde_json::Value = serde_json::from_str(line)?;
            let gbps = j["gbps"].as_f64().ok_or("no \"gbps\" in --bench-json")?;
            (
                gbps * 1e9,
                format!(
                    "{gbps:.3} GB/s measured ({} {} {})",
                    j["op"].as_str().unwrap_or("?"),
                    j["transport_requested"].as_str().unwrap_or("?"),
                    j["lane"].as_str().unwrap_or("?")
                ),
            )
        }
        (None, None) => return Err("give --link-gbps or --bench-json".into()),
    };
    if link <= 0.0 || !link.is_finite() {
        return Err("the link throughput must be positive".into());
    }
    let input = kvxfer::planning::PlanInput {
        geometry: g.clone(),
        prompt_tokens: p.prompt_tokens,
        concurrency: p.concurrency,
        link_bytes_per_s: link,
        block_tokens: p.block_tokens,
        cached_tokens: p.cached_tokens,
        prefill_tokens_per_s: p.prefill_tokens_per_s,
    };
    let r = kvxfer::planning::plan(&input);
    if p.json {
        println!(
            "{}",
            serde_json::json!({
                "model": g.name,
                "layers": g.layers, "kv_heads": g.kv_heads, "head_dim": g.head_dim,
                "dtype_bytes": g.dtype.bytes(),
                "prompt_tokens": p.prompt_tokens,
                "cached_tokens": p.cached_tokens,
                "concurrency": p.concurrency,
                "link_bytes_per_s": link,
                "bytes_per_token": r.bytes_per_token,
                "request_bytes": r.request_bytes,
                "moved_bytes": r.moved_bytes,
                "descriptors": r.descriptors,
                "block_bytes": r.block_bytes,
                "handoff_s": r.handoff_s,
                "handoff_all_s": r.handoff_all_s,
                "host_bytes": r.host_bytes,
                "gpu_staging_bytes": r.gpu_staging_bytes,
                "prefill_s": r.prefill_s,
                "link_tokens_per_s": r.link_tokens_per_s,
                "notes": r.notes,
            })
        );
        return Ok(());
    }
    println!(
        "model        {} ({} layers x 2 x {} KV heads x {} x {} B)",
        g.name,
        g.layers,
        g.kv_heads,
        g.head_dim,
        g.dtype.bytes()
    );
    println!("KV / token   {} B", r.bytes_per_token);
    let blocks = g.blocks(p.prompt_tokens, p.block_tokens);
    println!(
        "request      {} tokens = {} ({} blocks x {} B per layer and K/V = {} descriptors)",
        p.prompt_tokens,
        human(r.request_bytes),
        blocks,
        r.block_bytes,
        blocks * 2 * g.layers
    );
    if p.cached_tokens > 0 {
        println!(
            "moved        {} in {} descriptors (the cached prefix stays)",
            human(r.moved_bytes),
            r.descriptors
        );
    }
    println!("link         {link_src}");
    println!(
        "handoff      {:.3} s per request; {:.3} s for {} at once",
        r.handoff_s, r.handoff_all_s, p.concurrency
    );
    if let Some(s) = r.prefill_s {
        println!("prefill      {s:.3} s per request");
    }
    println!(
        "host memory  {} per worker to hold {} request(s) at once",
        human(r.host_bytes),
        p.concurrency
    );
    println!("link carries {:.0} prefill tokens/s", r.link_tokens_per_s);
    for n in &r.notes {
        println!("note         {n}");
    }
    Ok(())
}

pub(crate) fn human(b: u64) -> String {
    let b = b as f64;
    if b >= 1e9 {
        format!("{:.2} GB", b / 1e9)
    } else if b >= 1e6 {
        format!("{:.1} MB", b / 1e6)
    } else {
        format!("{:.0} KB", b / 1e3)
    }
}
