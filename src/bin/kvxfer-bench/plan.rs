//! `kvxfer-bench plan`: handoff time and memory from a model, a prompt, a link.

use kvxfer::layout::KvGeometry;

use kvxfer::Compression;
use kvxfer_proto::compress::codec::{decode_frame, Decoder, Encoder};
use kvxfer_proto::compress::frame::CHUNK;
use kvxfer_proto::compress::planes::Transform;
use kvxfer_proto::compress::policy::{
    decide, predict, CodecRates, Decision, Estimates, Prediction,
};

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
    let z = compression(p, &g, r.moved_bytes * p.concurrency.max(1), link)?;
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
                "compress_ratio": z.as_ref().map(|z| z.rates.ratio),
                "compress_encode_bytes_per_s": z.as_ref().map(|z| z.rates.encode),
                "compress_decode_bytes_per_s": z.as_ref().map(|z| z.rates.decode),
                "compress_source": z.as_ref().map(|z| z.source.clone()),
                "handoff_all_compressed_s": z.as_ref().map(|z| z.predicted.compressed.as_secs_f64()),
                "auto_compresses": z.as_ref().map(|z| z.auto),
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
    if let Some(z) = &z {
        println!(
            "compressed   {:.3} s for {} at once ({}: ratio {:.3}, encode {:.0} MB/s on {} thread(s), decode {:.0} MB/s on one); auto {}",
            z.predicted.compressed.as_secs_f64(),
            p.concurrency,
            z.source,
            z.rates.ratio,
            z.rates.encode / 1e6,
            p.compress_threads.max(1),
            z.rates.decode / 1e6,
            if z.auto { "compresses" } else { "sends raw" }
        );
    }
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

/// What compression would do to the handoff.
struct Compressed {
    rates: CodecRates,
    source: String,
    predicted: Prediction,
    auto: bool,
}

/// The codec's rates (given, or measured here on 16 MiB of synthetic KV of this dtype) and the
/// handoff of `bytes` compressed; None for a dtype the transforms do not split (fp8, fp32).
fn compression(
    p: &PlanArgs,
    g: &kvxfer::layout::KvGeometry,
    bytes: u64,
    link: f64,
) -> Result<Option<Compressed>, BoxErr> {
    let (rates, source) = match p.compress_ratio {
        Some(ratio) => (
            CodecRates {
                ratio,
                encode: p.encode_mbps.unwrap_or(f64::INFINITY) * 1e6,
                decode: p.decode_mbps.unwrap_or(f64::INFINITY) * 1e6,
            },
            "given".to_string(),
        ),
        None => {
            if g.dtype.bytes() != 2 {
                return Ok(None);
            }
            let t = if g.dtype == kvxfer::layout::KvDtype::Bf16 {
                Transform::Bf16
            } else {
                Transform::Bytes2
            };
            (measure(t)?, "measured here on synthetic KV".to_string())
        }
    };
    let threads = p.compress_threads.max(1) as f64;
    let rates = CodecRates {
        encode: rates.encode * threads,
        ..rates
    };
    let predicted = predict(bytes, link, &rates);
    let est = Estimates {
        link: Some(link),
        codec: Some(rates),
        since_raw: 0,
    };
    let auto = decide(Compression::Auto, bytes, &est).0 == Decision::Compress;
    Ok(Some(Compressed {
        rates,
        source,
        predicted,
        auto,
    }))
}

/// One thread's encode and decode rates and the ratio on 16 MiB of `kvdata` blocks.
fn measure(t: Transform) -> Result<CodecRates, BoxErr> {
    let block = 32 << 10;
    let mut raw = vec![0u8; 16 << 20];
    for (k, b) in raw.chunks_mut(block).enumerate() {
        // Spread over the request's layers and K/V (block k of 8,344).
        crate::kvdata::kv_block(1, (k as u64 * 16) % 8344, b);
    }
    // A first pass warms the buffers (page faults are not the codec's); the second is timed.
    let mut wire = Vec::new();
    for c in raw.chunks(CHUNK) {
        Encoder::new(t)?.encode(c, &mut wire)?;
    }
    wire.clear();
    let mut e = Encoder::new(t)?;
    for c in raw.chunks(CHUNK) {
        e.encode(c, &mut wire)?;
    }
    let mut d = Decoder::new()?;
    let t0 = std::time::Instant::now();
    let (mut at, mut left) = (0, raw.len() as u64);
    while at < wire.len() {
        let (out, n) = decode_frame(&mut d, &wire[at..], left)?;
        left -= out.len() as u64;
        at += n;
    }
    let dec = t0.elapsed().as_secs_f64();
    Ok(CodecRates {
        ratio: e.tally.ratio(),
        encode: e.tally.rate().unwrap_or(f64::INFINITY),
        decode: raw.len() as f64 / dec.max(1e-9),
    })
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
