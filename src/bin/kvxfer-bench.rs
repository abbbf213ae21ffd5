//! kvxfer-bench: moves KV-shaped data between two processes (or hosts) and reports throughput,
//! with references measured in the same run; and `kvxfer-bench plan` turns a model, a prompt
//! length, a concurrency and a link into handoff time and memory.
//!
//! With no arguments it moves one Qwen3-0.6B request (2,371 tokens: 8,344 blocks x 32 KiB =
//! 273,416,192 B at random block slots on both sides) to a peer process it starts itself,
//! verifies the bytes, and prints a table. `--op`, `--transport`, `--blocks`, `--block-size`
//! and `--placement` take comma-separated lists: the bench runs every combination (a sweep).
//!
//! Two hosts: run `kvxfer-bench --listen 0.0.0.0:0` on one (it prints its control address),
//! and `kvxfer-bench --connect HOST:PORT` on the other.

use std::io::{BufRead, BufReader, IsTerminal, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand, ValueEnum};
use kvxfer::layout::KvGeometry;
use kvxfer::staging::{CopyEngine, SimulatedDevice};
use kvxfer::{Agent, AgentConfig, Desc, GpuPath, HostBuffer, MemKind, Region, Transport, XferOp};
use rand::seq::SliceRandom;
use rand::SeedableRng;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Op {
    Read,
    Write,
}

/// Where each side's KV buffer lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum MemArg {
    /// Host memory (memfd-backed).
    Host,
    /// Simulated device memory (reached only through a copy engine): the staged path on a
    /// machine without a GPU.
    Sim,
    /// CUDA device memory (needs the `cuda` feature, a driver and a GPU).
    Cuda,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Placement {
    /// Blocks at random slots on both sides (a paged KV cache).
    Random,
    /// Blocks at consecutive slots (kvxfer coalesces them).
    Contiguous,
    /// One descriptor covering all the bytes.
    Single,
}

impl Placement {
    fn name(self) -> &'static str {
        match self {
            Placement::Random => "random",
            Placement::Contiguous => "contiguous",
            Placement::Single => "single",
        }
    }
}

#[derive(Parser, Debug, Clone)]
#[command(
    name = "kvxfer-bench",
    about = "Measure KV transfer throughput between two kvxfer agents",
    args_conflicts_with_subcommands = true
)]
struct Args {
    #[command(subcommand)]
    cmd: Option<Cmd>,
    /// READ (pull from the peer) and/or WRITE (push to the peer), comma-separated.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "write")]
    op: Vec<Op>,
    /// tcp, shm, auto, or a UCX_TLS list in quotes (e.g. "rc,sm"); several separated by ';'.
    #[arg(long, value_delimiter = ';', default_value = "tcp")]
    transport: Vec<String>,
    /// Blocks (descriptors) per request, comma-separated. Default: Qwen3-0.6B, 2,371 tokens =
    /// 149 blocks x 28 layers x 2 (K, V).
    #[arg(long, value_delimiter = ',', default_value = "8344")]
    blocks: Vec<u64>,
    /// Bytes per block, comma-separated. Default: 16 tokens x 8 KV heads x 128 x bf16.
    #[arg(long, value_delimiter = ',', default_value = "32768")]
    block_size: Vec<u64>,
    /// A model preset (e.g. qwen3-0.6b, llama-3-8b): sets --blocks and --block-size from its
    /// KV geometry and --tokens.
    #[arg(long)]
    model: Option<String>,
    /// Prompt tokens with --model.
    #[arg(long, default_value_t = 2371)]
    tokens: u64,
    /// Where the blocks sit in each side's buffer, comma-separated.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "random")]
    placement: Vec<Placement>,
    /// Requests in flight at once (each its own blocks).
    #[arg(long, default_value_t = 1)]
    concurrency: u64,
    /// Measured iterations.
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// Unmeasured iterations first.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Also measure, in the same run, memcpy of the same bytes and a plain TCP stream of the
    /// same bytes between the same two endpoints, and print kvxfer's time as a ratio to each.
    #[arg(long)]
    reference: bool,
    /// Print JSON lines (one per run) instead of the table.
    #[arg(long)]
    json: bool,
    /// Split operations longer than this many bytes (0: never).
    #[arg(long, default_value_t = 0)]
    max_op: u64,
    /// UCX_NET_DEVICES (default "lo" when the peer is started locally).
    #[arg(long)]
    net_devices: Option<String>,
    /// Spin instead of sleeping on the worker's event fd.
    #[arg(long)]
    busy_poll: bool,
    /// Move every byte through UCX (kvxfer's shared-memory and TCP stream lanes off).
    #[arg(long)]
    ucx_only: bool,
    /// Serve as the peer: listen for a kvxfer-bench --connect on ADDR (port 0 allowed).
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Agent name (default: bench-<role>-<pid>); a restarted peer can keep its name.
    #[arg(long)]
    name: Option<String>,
    /// With --listen: exit after the first initiator's session (used for the peer the bench
    /// starts itself); without it the peer serves sessions until killed.
    #[arg(long, hide = true)]
    once: bool,
    /// Run against a peer started with --listen at this control address.
    #[arg(long)]
    connect: Option<SocketAddr>,
    /// Soak: this many transfers alternating READ and WRITE (after the warm-up), every 100th
    /// verified byte for byte, RSS of both processes reported (JSON fields `soak_*`).
    #[arg(long, default_value_t = 0)]
    soak: usize,
    /// Seed for placement and data.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Where both sides' KV buffers live.
    #[arg(long, value_enum, default_value = "host")]
    memory: MemArg,
    /// CUDA device with --memory cuda.
    #[arg(long, default_value_t = 0)]
    device: u32,
    /// Path of device memory: auto, direct (UCX moves VRAM) or staged (pinned host chunks).
    #[arg(long, default_value = "auto", value_parser = parse_gpu_path)]
    gpu_path: GpuPath,
    /// Device staging: chunks of --staging-chunk-kib (half for each direction of initiative).
    #[arg(long, default_value_t = kvxfer::staging::DEFAULT_STAGING_CHUNKS)]
    staging_chunks: usize,
    /// UCX without peer-failure detection (it then may use transports that cannot detect a
    /// dead peer: shared memory, cuda_ipc); a dead peer is then only noticed by deadlines.
    #[arg(long)]
    no_peer_failure: bool,
    /// Device staging chunk size, KiB.
    #[arg(long, default_value_t = (kvxfer::staging::DEFAULT_STAGING_CHUNK_BYTES >> 10) as u64)]
    staging_chunk_kib: u64,
}

fn parse_gpu_path(s: &str) -> Result<GpuPath, String> {
    GpuPath::parse(s).ok_or_else(|| format!("{s:?}: auto, direct or staged"))
}

#[derive(Subcommand, Debug, Clone)]
enum Cmd {
    /// Plan a deployment: KV bytes per request, handoff time, host memory, and whether
    /// disaggregation can pay off.
    Plan(PlanArgs),
}

#[derive(Parser, Debug, Clone)]
struct PlanArgs {
    /// Model preset (qwen3-0.6b, qwen3-8b, qwen3-32b, llama-3-8b, llama-3-70b, mistral-7b).
    #[arg(long, conflicts_with = "config")]
    model: Option<String>,
    /// A Hugging Face config.json instead of a preset.
    #[arg(long)]
    config: Option<std::path::PathBuf>,
    /// KV cache dtype override (bf16, fp16, fp32, fp8).
    #[arg(long)]
    kv_dtype: Option<String>,
    /// Prompt tokens per request.
    #[arg(long, default_value_t = 2371)]
    prompt_tokens: u64,
    /// Prefix tokens already cached on the decode side.
    #[arg(long, default_value_t = 0)]
    cached_tokens: u64,
    /// Requests handed off at once over one link.
    #[arg(long, default_value_t = 1)]
    concurrency: u64,
    /// Link throughput in Gbit/s.
    #[arg(long, conflicts_with = "bench_json")]
    link_gbps: Option<f64>,
    /// A `kvxfer-bench --json` line (file) whose measured throughput is the link.
    #[arg(long)]
    bench_json: Option<std::path::PathBuf>,
    /// Tokens per paged block.
    #[arg(long, default_value_t = 16)]
    block_tokens: u64,
    /// Prefill throughput of one prefill worker (tokens/s), to judge whether the handoff pays.
    #[arg(long)]
    prefill_tokens_per_s: Option<f64>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

type BoxErr = Box<dyn std::error::Error>;

fn main() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("error")).init();
    let args = Args::parse();
    let r = match (&args.cmd, args.listen) {
        (Some(Cmd::Plan(p)), _) => plan(p),
        (None, Some(addr)) => serve(&args, addr),
        (None, None) => sweep(&args),
    };
    if let Err(e) = r {
        eprintln!("kvxfer-bench: {e}");
        std::process::exit(1);
    }
}

// ---------------------------------------------------------------------------------------------
// plan
// ---------------------------------------------------------------------------------------------

fn plan(p: &PlanArgs) -> Result<(), BoxErr> {
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

fn human(b: u64) -> String {
    let b = b as f64;
    if b >= 1e9 {
        format!("{:.2} GB", b / 1e9)
    } else if b >= 1e6 {
        format!("{:.1} MB", b / 1e6)
    } else {
        format!("{:.0} KB", b / 1e3)
    }
}

// ---------------------------------------------------------------------------------------------
// workload
// ---------------------------------------------------------------------------------------------

/// One point of a sweep.
#[derive(Clone, Debug)]
struct Case {
    op: Op,
    transport: String,
    blocks: u64,
    block_size: u64,
    placement: Placement,
}

impl Case {
    /// Slots on the wire per request, and in all.
    fn total_blocks(&self, conc: u64) -> u64 {
        self.blocks * conc.max(1)
    }
}

/// A process's device memory: the copy engine, and for the simulated device the device.
#[derive(Clone)]
struct Device {
    engine: Arc<dyn CopyEngine>,
    sim: Option<SimulatedDevice>,
}

fn device(args: &Args) -> Result<Option<Device>, BoxErr> {
    match args.memory {
        MemArg::Host => Ok(None),
        MemArg::Sim => {
            let sim = SimulatedDevice::new();
            Ok(Some(Device {
                engine: sim.engine(),
                sim: Some(sim),
            }))
        }
        #[cfg(feature = "cuda")]
        MemArg::Cuda => {
            kvxfer::cuda::probe(args.device)?;
            Ok(Some(Device {
                engine: Arc::new(kvxfer::cuda::CudaCopyEngine::new()),
                sim: None,
            }))
        }
        #[cfg(not(feature = "cuda"))]
        MemArg::Cuda => Err("--memory cuda needs kvxfer-bench built with --features cuda".into()),
    }
}

/// A registered KV buffer, host or device, and how to reach its bytes from the host.
struct Buf {
    region: Region,
    dev: Option<(Device, u32)>,
}

impl Buf {
    fn new(agent: &Agent, dev: &Option<Device>, args: &Args, len: usize) -> Result<Buf, BoxErr> {
        let Some(d) = dev else {
            return Ok(Buf {
                region: agent.register(HostBuffer::new(len)?)?,
                dev: None,
            });
        };
        let region = match &d.sim {
            Some(sim) => {
                let addr = sim.alloc(len)?;
                // SAFETY: the simulated allocation lives as long as the device, which `Buf`
                // holds past the registration (deregistered before the device goes).
                unsafe { agent.register_raw(addr as *mut u8, len, MemKind::Cuda(args.device)) }?
            }
            None => cuda_region(agent, args.device, len)?,
        };
        Ok(Buf {
            region,
            dev: Some((d.clone(), args.device)),
        })
    }

    fn write(&self, off: u64, data: &[u8]) -> kvxfer::Result<()> {
        match &self.dev {
            None => self.region.write(off, data),
            Some((d, dev)) => {
                check(&self.region, off, data.len())?;
                let mut q = d.engine.queue(*dev)?;
                // SAFETY: the range lies inside the registered device region (checked); `data`
                // lives until the sync below.
                unsafe { q.to_device(data.as_ptr(), self.region.addr() + off, data.len()) }?;
                q.sync()
            }
        }
    }

    fn read(&self, off: u64, out: &mut [u8]) -> kvxfer::Result<()> {
        match &self.dev {
            None => self.region.read(off, out),
            Some((d, dev)) => {
                check(&self.region, off, out.len())?;
                let mut q = d.engine.queue(*dev)?;
                // SAFETY: as in write; `out` is not touched until the sync.
                unsafe { q.to_host(self.region.addr() + off, out.as_mut_ptr(), out.len()) }?;
                q.sync()
            }
        }
    }
}

fn check(r: &Region, off: u64, len: usize) -> kvxfer::Result<()> {
    if off.checked_add(len as u64).is_none_or(|e| e > r.len()) {
        return Err(kvxfer::Error::InvalidArgument(format!(
            "[{off}, +{len}) outside a region of {} bytes",
            r.len()
        )));
    }
    Ok(())
}

#[cfg(feature = "cuda")]
fn cuda_region(agent: &Agent, device: u32, len: usize) -> Result<Region, BoxErr> {
    let ctx = cudarc::driver::CudaContext::new(device as usize)?;
    let buf = ctx.default_stream().alloc_zeros::<u8>(len)?;
    Ok(agent.register(buf)?)
}

#[cfg(not(feature = "cuda"))]
fn cuda_region(_: &Agent, _: u32, _: usize) -> Result<Region, BoxErr> {
    Err("--memory cuda needs kvxfer-bench built with --features cuda".into())
}

fn agent_config(args: &Args, transport: &str, role: &str, local_peer: bool) -> AgentConfig {
    let name = args
        .name
        .clone()
        .unwrap_or_else(|| format!("bench-{role}-{}", std::process::id()));
    let mut c = AgentConfig::new(name)
        .transport(Transport::parse(transport))
        .busy_poll(args.busy_poll)
        .lanes(!args.ucx_only)
        .gpu_path(args.gpu_path)
        .peer_failure(if args.no_peer_failure {
            Some(false)
        } else {
            None
        })
        .staging(args.staging_chunks, (args.staging_chunk_kib << 10) as usize);
    c.max_op_bytes = args.max_op;
    match (&args.net_devices, local_peer) {
        (Some(d), _) => c.net_devices(d.clone()),
        (None, true) => c.net_devices("lo"),
        (None, false) => c,
    }
}

/// Slot of the k-th block on each side.
fn placement(p: Placement, n: u64, seed: u64) -> (Vec<u64>, Vec<u64>) {
    let mut l: Vec<u64> = (0..n).collect();
    let mut r = l.clone();
    if p == Placement::Random {
        l.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
        r.shuffle(&mut rand::rngs::StdRng::seed_from_u64(
            seed ^ 0x9e37_79b9_7f4a_7c15,
        ));
    }
    (l, r)
}

/// Deterministic content of block k for a data seed: both processes can compute it.
fn pattern(seed: u64, k: u64, out: &mut [u8]) {
    let mut x = seed ^ (k.wrapping_mul(0x9e37_79b9_7f4a_7c15)) ^ 0xd1b5_4a32_d192_ed03;
    for c in out.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        c.copy_from_slice(&b[..c.len()]);
    }
}

fn fill(r: &Buf, slots: &[u64], bs: u64, seed: u64) -> kvxfer::Result<()> {
    let mut buf = vec![0u8; bs as usize];
    for (k, &s) in slots.iter().enumerate() {
        pattern(seed, k as u64, &mut buf);
        r.write(s * bs, &buf)?;
    }
    Ok(())
}

fn clear(r: &Buf) -> kvxfer::Result<()> {
    let zero = vec![0u8; 1 << 20];
    let mut off = 0;
    while off < r.region.len() {
        let n = (r.region.len() - off).min(zero.len() as u64);
        r.write(off, &zero[..n as usize])?;
        off += n;
    }
    Ok(())
}

fn verify(r: &Buf, slots: &[u64], bs: u64, seed: u64) -> kvxfer::Result<bool> {
    let mut want = vec![0u8; bs as usize];
    let mut got = vec![0u8; bs as usize];
    for (k, &s) in slots.iter().enumerate() {
        pattern(seed, k as u64, &mut want);
        r.read(s * bs, &mut got)?;
        if want != got {
            return Ok(false);
        }
    }
    Ok(true)
}

// ---------------------------------------------------------------------------------------------
// peer
// ---------------------------------------------------------------------------------------------

/// The peer: registers its buffer, answers control commands line by line.
fn serve(args: &Args, addr: SocketAddr) -> Result<(), BoxErr> {
    let ctl = TcpListener::bind(addr)?;
    let local = addr.ip().is_loopback();
    let transport = args.transport.first().cloned().unwrap_or("tcp".into());
    let dev = device(args)?;
    let mut cfg = agent_config(args, &transport, "peer", local);
    if let Some(d) = &dev {
        cfg = cfg.copy_engine(d.engine.clone());
    }
    let mut agent = Agent::new(cfg)?;
    let ip = ctl.local_addr()?.ip();
    let side = agent.listen(SocketAddr::new(ip, 0))?;
    println!(
        "KVXFER-BENCH READY ctl={} side={side} pid={}",
        ctl.local_addr()?,
        std::process::id()
    );
    std::io::stdout().flush()?;
    let mut state = PeerState {
        region: None,
        slots: Vec::new(),
        bs: 0,
    };
    loop {
        let (s, _) = ctl.accept()?;
        if let Err(e) = session(&mut agent, s, ip, side, &mut state, args, &dev) {
            eprintln!("kvxfer-bench peer: session ended: {e}");
        }
        if args.once {
            return Ok(());
        }
    }
}

struct PeerState {
    region: Option<Buf>,
    slots: Vec<u64>,
    bs: u64,
}

fn session(
    agent: &mut Agent,
    s: TcpStream,
    ip: std::net::IpAddr,
    side: SocketAddr,
    st: &mut PeerState,
    args: &Args,
    dev: &Option<Device>,
) -> Result<(), BoxErr> {
    let PeerState { region, slots, bs } = st;
    let mut rd = BufReader::new(s.try_clone()?);
    let mut wr = s;
    let mut line = String::new();
    loop {
        line.clear();
        if rd.read_line(&mut line)? == 0 {
            return Ok(()); // The initiator went away.
        }
        let w: Vec<&str> = line.split_whitespace().collect();
        let reply = match w.as_slice() {
            ["SETUP", blocks, block_size, placement_s, seed] => {
                let blocks: u64 = blocks.parse()?;
                *bs = block_size.parse()?;
                let p = match *placement_s {
                    "random" => Placement::Random,
                    _ => Placement::Contiguous,
                };
                *slots = placement(p, blocks, seed.parse()?).1;
                if let Some(r) = region.take() {
                    agent.deregister(&r.region)?;
                }
                *region = Some(Buf::new(agent, dev, args, (blocks * *bs) as usize)?);
                format!("OK {side}")
            }
            ["FILL", seed] => match &region {
                Some(r) => {
                    fill(r, slots, *bs, seed.parse()?)?;
                    "OK".into()
                }
                None => "ERR no SETUP".into(),
            },
            ["CLEAR"] => match &region {
                Some(r) => {
                    clear(r)?;
                    "OK".into()
                }
                None => "ERR no SETUP".into(),
            },
            ["VERIFY", seed] => match &region {
                Some(r) => format!("OK {}", verify(r, slots, *bs, seed.parse()?)?),
                None => "ERR no SETUP".into(),
            },
            ["REGION"] => match &region {
                Some(r) => format!("OK {}", r.region.id().0),
                None => "ERR no SETUP".into(),
            },
            ["TCPREF", bytes, dir, rounds] => {
                let l = TcpListener::bind(SocketAddr::new(ip, 0))?;
                let port = l.local_addr()?.port();
                let (bytes, rounds): (u64, usize) = (bytes.parse()?, rounds.parse()?);
                let inbound = *dir == "in";
                std::thread::spawn(move || {
                    if let Err(e) = tcp_ref_serve(l, bytes, inbound, rounds) {
                        eprintln!("kvxfer-bench peer: TCP reference: {e}");
                    }
                });
                format!("OK {port}")
            }
            ["RSS"] => format!("OK {}", rss_peak(std::process::id())),
            ["QUIT"] => {
                writeln!(wr, "OK")?;
                return Ok(());
            }
            _ => format!("ERR unknown command {:?}", line.trim()),
        };
        writeln!(wr, "{reply}")?;
    }
}

/// Size of each write and read of the plain TCP reference (iperf3 -l 1M).
const TCP_REF_CHUNK: usize = 1 << 20;

/// The peer's end of the plain TCP reference: per round, receive `bytes` and answer one byte
/// (inbound), or on one byte send `bytes` (outbound).
fn tcp_ref_serve(l: TcpListener, bytes: u64, inbound: bool, rounds: usize) -> std::io::Result<()> {
    let (mut s, _) = l.accept()?;
    s.set_nodelay(true)?;
    let mut buf = vec![0u8; TCP_REF_CHUNK];
    for _ in 0..rounds {
        if inbound {
            let mut left = bytes;
            while left > 0 {
                let n = s.read(&mut buf[..left.min(TCP_REF_CHUNK as u64) as usize])?;
                if n == 0 {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
                left -= n as u64;
            }
            s.write_all(&[1])?;
        } else {
            let mut go = [0u8; 1];
            s.read_exact(&mut go)?;
            let mut left = bytes;
            while left > 0 {
                let n = left.min(TCP_REF_CHUNK as u64) as usize;
                s.write_all(&buf[..n])?;
                left -= n as u64;
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// initiator
// ---------------------------------------------------------------------------------------------

struct Ctl {
    rd: BufReader<TcpStream>,
    wr: TcpStream,
}

impl Ctl {
    fn cmd(&mut self, c: &str) -> Result<String, BoxErr> {
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

struct Peer(Child);
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

fn spawn_peer(args: &Args, transport: &str) -> Result<(Peer, SocketAddr), BoxErr> {
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
    cmd.args([
        "--memory",
        match args.memory {
            MemArg::Host => "host",
            MemArg::Sim => "sim",
            MemArg::Cuda => "cuda",
        },
        "--device",
        &args.device.to_string(),
        "--gpu-path",
        &args.gpu_path.to_string(),
        "--staging-chunks",
        &args.staging_chunks.to_string(),
        "--staging-chunk-kib",
        &args.staging_chunk_kib.to_string(),
    ]);
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
fn rss(pid: u32) -> u64 {
    proc_status_bytes(pid, "VmRSS:")
}

/// Peak resident set size (VmHWM) of a process, bytes.
fn rss_peak(pid: u32) -> u64 {
    proc_status_bytes(pid, "VmHWM:")
}

/// A `kB` field of /proc/PID/status, in bytes (0 if unreadable).
fn proc_status_bytes(pid: u32, key: &str) -> u64 {
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

fn cases(args: &Args) -> Result<Vec<Case>, BoxErr> {
    let (blocks, sizes) = match &args.model {
        Some(m) => {
            let g = KvGeometry::preset(m)?;
            (
                vec![g.descriptors(args.tokens, 16)],
                vec![g.block_bytes(16)],
            )
        }
        None => (args.blocks.clone(), args.block_size.clone()),
    };
    let mut v = Vec::new();
    for t in &args.transport {
        for &op in &args.op {
            for &p in &args.placement {
                for &b in &blocks {
                    for &s in &sizes {
                        if b == 0 || s == 0 {
                            return Err("--blocks and --block-size must be > 0".into());
                        }
                        v.push(Case {
                            op,
                            transport: t.trim().to_string(),
                            blocks: b,
                            block_size: s,
                            placement: p,
                        });
                    }
                }
            }
        }
    }
    Ok(v)
}

fn sweep(args: &Args) -> Result<(), BoxErr> {
    if args.iters == 0 || args.concurrency == 0 {
        return Err("--iters and --concurrency must be > 0".into());
    }
    let cases = cases(args)?;
    if !args.json {
        print_header(args.reference);
    }
    let mut failed = false;
    for c in &cases {
        let r = run(args, c)?;
        if args.json {
            println!("{}", r.json);
        } else {
            print_row(&r, args.reference);
        }
        failed |= !r.verified;
    }
    if failed {
        return Err("bytes did not verify".into());
    }
    Ok(())
}

struct Row {
    case: Case,
    lane: String,
    transports: String,
    bytes: u64,
    ops: usize,
    iters: usize,
    median: f64,
    min: f64,
    max: f64,
    gbps: f64,
    verified: bool,
    memcpy_ms: Option<f64>,
    tcp_ms: Option<f64>,
    json: serde_json::Value,
}

fn print_header(reference: bool) {
    print!(
        "{:<6} {:<10} {:<10} {:<18} {:>12} {:>6} {:>6} {:>9} {:>9} {:>9} {:>7}",
        "op",
        "placement",
        "lane",
        "ucx transports",
        "bytes",
        "descs",
        "ops",
        "median_ms",
        "min_ms",
        "max_ms",
        "GB/s"
    );
    if reference {
        print!(
            " {:>9} {:>8} {:>9} {:>6}",
            "memcpy_ms", "x_memcpy", "tcp_ms", "x_tcp"
        );
    }
    println!(" {:>8}", "verified");
}

fn print_row(r: &Row, reference: bool) {
    print!(
        "{:<6} {:<10} {:<10} {:<18} {:>12} {:>6} {:>6} {:>9.2} {:>9.2} {:>9.2} {:>7.2}",
        format!("{:?}", r.case.op).to_lowercase(),
        r.case.placement.name(),
        r.lane,
        r.transports,
        r.bytes,
        r.case.blocks,
        r.ops,
        r.median,
        r.min,
        r.max,
        r.gbps
    );
    if reference {
        let f = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.2}"));
        print!(
            " {:>9} {:>8} {:>9} {:>6}",
            f(r.memcpy_ms),
            f(r.memcpy_ms.map(|m| r.median / m)),
            f(r.tcp_ms),
            f(r.tcp_ms.map(|t| r.median / t))
        );
    }
    println!(" {:>8}", r.verified);
    let _ = r.iters;
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Shows a progress bar on a terminal once a run has taken more than a second.
struct Progress {
    on: bool,
    t0: Instant,
    shown: bool,
}

impl Progress {
    fn new(on: bool) -> Self {
        Progress {
            on,
            t0: Instant::now(),
            shown: false,
        }
    }
    fn tick(&mut self, done: usize, total: usize, what: &str) {
        if !self.on || self.t0.elapsed() < Duration::from_secs(1) {
            return;
        }
        let w = 30;
        let k = done * w / total.max(1);
        eprint!(
            "\r[{}{}] {done}/{total} {what}   ",
            "#".repeat(k),
            " ".repeat(w - k)
        );
        self.shown = true;
    }
    fn end(&self) {
        if self.shown {
            eprint!("\r{}\r", " ".repeat(60));
        }
    }
}

fn run(args: &Args, case: &Case) -> Result<Row, BoxErr> {
    let conc = args.concurrency;
    let (_peer, ctl_addr, local) = match args.connect {
        Some(a) => (None, a, a.ip().is_loopback()),
        None => {
            let (p, a) = spawn_peer(args, &case.transport)?;
            (Some(p), a, true)
        }
    };
    let s = TcpStream::connect(ctl_addr)?;
    let mut ctl = Ctl {
        rd: BufReader::new(s.try_clone()?),
        wr: s,
    };
    let n = case.total_blocks(conc);
    let bs = case.block_size;
    // "single" is one descriptor per request over contiguous slots.
    let slot_placement = match case.placement {
        Placement::Random => Placement::Random,
        _ => Placement::Contiguous,
    };
    let side: SocketAddr = ctl
        .cmd(&format!(
            "SETUP {n} {bs} {} {}",
            slot_placement.name(),
            args.seed
        ))?
        .parse()?;
    let dev = device(args)?;
    let mut cfg = agent_config(args, &case.transport, "init", local);
    if let Some(d) = &dev {
        cfg = cfg.copy_engine(d.engine.clone());
    }
    let agent = Agent::new(cfg)?;
    let bytes_all = n * bs;
    let buf = Buf::new(&agent, &dev, args, bytes_all as usize)?;
    let region = buf.region.clone();
    let peer = agent.connect(side)?;
    let rid = kvxfer::RegionId(ctl.cmd("REGION")?.parse()?);
    let (lslots, rslots) = placement(slot_placement, n, args.seed);
    let (ld, rd): (Vec<Desc>, Vec<Desc>) = if case.placement == Placement::Single {
        let per = case.blocks * bs;
        (0..conc)
            .map(|r| {
                (
                    Desc::new(region.id(), r * per, per),
                    Desc::new(rid, r * per, per),
                )
            })
            .unzip()
    } else {
        lslots
            .iter()
            .zip(&rslots)
            .map(|(&l, &r)| {
                (
                    Desc::new(region.id(), l * bs, bs),
                    Desc::new(rid, r * bs, bs),
                )
            })
            .unzip()
    };
    // Building the lists is cheap and the peer may still be busy mapping our memory: time
    // it a few times and keep the median.
    let mut preps = Vec::new();
    let (mut local_list, mut remote_list) = (None, None);
    for _ in 0..5 {
        let t = Instant::now();
        local_list = Some(agent.prep_local(&ld)?);
        remote_list = Some(agent.prep_remote(&peer, &rd)?);
        preps.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let prep_ms = median(&mut preps);
    let (local_list, remote_list) = (local_list.ok_or("no list")?, remote_list.ok_or("no list")?);
    let per_req = ld.len() / conc as usize;
    let sel: Vec<Vec<usize>> = (0..conc as usize)
        .map(|r| (r * per_req..(r + 1) * per_req).collect())
        .collect();

    let data_seed = args.seed.wrapping_add(1);
    if args.soak > 0 {
        // Both sides hold the same blocks: READs and WRITEs keep them equal, so any byte a
        // transfer puts in the wrong place shows up in the periodic checks.
        fill(&buf, &lslots, bs, data_seed)?;
        ctl.cmd(&format!("FILL {data_seed}"))?;
    }
    let op = match case.op {
        _ if args.soak > 0 => XferOp::Write,
        Op::Write => {
            fill(&buf, &lslots, bs, data_seed)?;
            ctl.cmd("CLEAR")?;
            XferOp::Write
        }
        Op::Read => {
            ctl.cmd(&format!("FILL {data_seed}"))?;
            clear(&buf)?;
            XferOp::Read
        }
    };
    let mut times = Vec::with_capacity(args.iters);
    let mut ops = 0;
    let mut lane = kvxfer::Lane::Ucx;
    let mut post_ms = Vec::new();
    let total = args.warmup + if args.soak > 0 { args.soak } else { args.iters };
    let mut bar = Progress::new(!args.json && std::io::stderr().is_terminal());
    let peer_pid = _peer.as_ref().map(|p| p.0.id());
    let (mut rss10, mut checks, mut bad_checks) = ((0u64, 0u64), 0usize, 0usize);
    for i in 0..total {
        let op = if args.soak > 0 && i % 2 == 1 {
            XferOp::Read
        } else {
            op
        };
        let t = Instant::now();
        let xs = sel
            .iter()
            .map(|s| {
                agent.transfer(
                    op,
                    &local_list,
                    s,
                    &remote_list,
                    s,
                    None,
                    Some(Duration::from_secs(600)),
                )
            })
            .collect::<kvxfer::Result<Vec<_>>>()?;
        let mut post = 0f64;
        ops = 0;
        for x in xs {
            let st = x.wait()?;
            ops += st.ops;
            lane = st.lane;
            post = post.max(st.post_time.as_secs_f64() * 1e3);
        }
        let dt = t.elapsed();
        if i >= args.warmup {
            times.push(dt.as_secs_f64() * 1e3);
            post_ms.push(post);
        }
        bar.tick(i + 1, total, "iterations");
        if args.soak > 0 {
            let k = i + 1 - args.warmup.min(i + 1);
            if k == 10 {
                rss10 = (rss(std::process::id()), peer_pid.map_or(0, rss));
            }
            if k > 0 && k.is_multiple_of(100) {
                checks += 1;
                let ok = match op {
                    XferOp::Write => ctl.cmd(&format!("VERIFY {data_seed}"))? == "true",
                    XferOp::Read => verify(&buf, &lslots, bs, data_seed)?,
                };
                bad_checks += usize::from(!ok);
            }
        }
    }
    bar.end();
    let soak_rss_end = (rss(std::process::id()), peer_pid.map_or(0, rss));
    let verified = match op {
        XferOp::Write => ctl.cmd(&format!("VERIFY {data_seed}"))? == "true",
        XferOp::Read => verify(&buf, &lslots, bs, data_seed)?,
    };
    let info = agent.peer_info(&peer)?;
    let peer_rss_peak: u64 = ctl.cmd("RSS")?.parse().unwrap_or(0);
    let self_rss_peak = rss_peak(std::process::id());
    let (memcpy_ms, tcp_ms) = if args.reference {
        (
            Some(memcpy_ref(bytes_all, args.iters)?),
            Some(tcp_ref(&mut ctl, ctl_addr, bytes_all, op, args.iters)?),
        )
    } else {
        (None, None)
    };
    let _ = ctl.cmd("QUIT");
    let mut sorted = times.clone();
    let med = median(&mut sorted);
    let (min, max) = (sorted[0], sorted[sorted.len() - 1]);
    let gbps = bytes_all as f64 / (med / 1e3) / 1e9;
    let ucx = agent.ucx_version().to_string();
    let mut j = serde_json::json!({
        "op": format!("{op}"),
        "lane": lane.to_string(),
        "transport": info.transports,
        "transport_requested": case.transport,
        "ucx_version": ucx,
        "bytes": bytes_all,
        "block_size": bs,
        "descriptors": case.blocks,
        "concurrency": conc,
        "ops": ops,
        "placement": case.placement.name(),
        "iterations": args.iters,
        "median_ms": med,
        "min_ms": min,
        "max_ms": max,
        "times_ms": times,
        "gbps": gbps,
        "post_ms_median": median(&mut post_ms),
        "prep_ms": prep_ms,
        "verified": verified,
        "memory": format!("{:?}", args.memory).to_lowercase(),
        "gpu_path": info.gpu_path.map(|p| p.to_string()),
        "rss_peak_self_mib": self_rss_peak as f64 / (1 << 20) as f64,
        "rss_peak_peer_mib": peer_rss_peak as f64 / (1 << 20) as f64,
    });
    if let Some(st) = agent.staging_stats() {
        j["staging_mib"] = (st.bytes as f64 / (1 << 20) as f64).into();
        j["staging_waits"] = st.waits.into();
    }
    if args.soak > 0 {
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        j["soak_transfers"] = args.soak.into();
        j["soak_checks"] = checks.into();
        j["soak_bad_checks"] = bad_checks.into();
        j["soak_rss_self_mib_after10"] = mib(rss10.0).into();
        j["soak_rss_self_mib_end"] = mib(soak_rss_end.0).into();
        j["soak_rss_peer_mib_after10"] = mib(rss10.1).into();
        j["soak_rss_peer_mib_end"] = mib(soak_rss_end.1).into();
        j["verified"] = (verified && bad_checks == 0).into();
    }
    if let (Some(m), Some(t)) = (memcpy_ms, tcp_ms) {
        j["memcpy_ms"] = m.into();
        j["tcp_ms"] = t.into();
        j["x_memcpy"] = (med / m).into();
        j["x_tcp"] = (med / t).into();
    }
    Ok(Row {
        case: case.clone(),
        lane: match info.gpu_path {
            Some(p) => format!("{lane}/{p}"),
            None => lane.to_string(),
        },
        transports: info.transports,
        bytes: bytes_all,
        ops,
        iters: args.iters,
        median: med,
        min,
        max,
        gbps,
        verified,
        memcpy_ms,
        tcp_ms,
        json: j,
    })
}

/// Median time of one memcpy of `bytes` between two fresh page-aligned buffers (after one
/// unmeasured copy that faults the pages in).
fn memcpy_ref(bytes: u64, iters: usize) -> Result<f64, BoxErr> {
    let mut a = HostBuffer::new(bytes as usize)?;
    let mut b = HostBuffer::new(bytes as usize)?;
    a.as_mut_slice().fill(7);
    let mut t = Vec::new();
    for i in 0..=iters {
        let t0 = Instant::now();
        b.as_mut_slice().copy_from_slice(a.as_slice());
        std::hint::black_box(b.as_slice()[bytes as usize / 2]);
        if i > 0 {
            t.push(t0.elapsed().as_secs_f64() * 1e3);
        }
    }
    Ok(median(&mut t))
}

/// Median time of a plain TCP stream of `bytes` (1 MiB writes and reads, like `iperf3 -l 1M`)
/// between this process and the peer, in the direction the transfer moves data; one
/// unmeasured round first.
fn tcp_ref(
    ctl: &mut Ctl,
    ctl_addr: SocketAddr,
    bytes: u64,
    op: XferOp,
    iters: usize,
) -> Result<f64, BoxErr> {
    let inbound = op == XferOp::Write; // data flows into the peer
    let rounds = iters + 1;
    let port: u16 = ctl
        .cmd(&format!(
            "TCPREF {bytes} {} {rounds}",
            if inbound { "in" } else { "out" }
        ))?
        .parse()?;
    let mut s = TcpStream::connect(SocketAddr::new(ctl_addr.ip(), port))?;
    s.set_nodelay(true)?;
    let mut buf = vec![5u8; TCP_REF_CHUNK];
    let mut t = Vec::new();
    for i in 0..rounds {
        let t0 = Instant::now();
        if inbound {
            let mut left = bytes;
            while left > 0 {
                let n = left.min(TCP_REF_CHUNK as u64) as usize;
                s.write_all(&buf[..n])?;
                left -= n as u64;
            }
            let mut ack = [0u8; 1];
            s.read_exact(&mut ack)?;
        } else {
            s.write_all(&[1])?;
            let mut left = bytes;
            while left > 0 {
                let n = s.read(&mut buf[..left.min(TCP_REF_CHUNK as u64) as usize])?;
                if n == 0 {
                    return Err("TCP reference: peer closed".into());
                }
                left -= n as u64;
            }
        }
        if i > 0 {
            t.push(t0.elapsed().as_secs_f64() * 1e3);
        }
    }
    Ok(median(&mut t))
}
