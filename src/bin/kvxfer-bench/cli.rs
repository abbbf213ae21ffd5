//! Command-line arguments.

use std::net::SocketAddr;

use clap::{Parser, Subcommand, ValueEnum};
use kvxfer::{Compression, GpuPath};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum Op {
    Read,
    Write,
}

/// Where each side's KV buffer lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum CudaAlloc {
    /// cuMemAlloc.
    Plain,
    /// cuMemAllocAsync (the stream-ordered pool).
    Pool,
    /// cuMemCreate + cuMemMap, shareable as a file descriptor (PyTorch's expandable
    /// segments).
    Vmm,
}

impl CudaAlloc {
    /// The name on the command line and in the JSON report.
    pub(crate) fn name(self) -> &'static str {
        match self {
            CudaAlloc::Plain => "plain",
            CudaAlloc::Pool => "pool",
            CudaAlloc::Vmm => "vmm",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum MemArg {
    /// Host memory (memfd-backed).
    Host,
    /// Host memory on transparent huge pages (`HostBuffer::huge`: private, so kvxfer's
    /// shared-memory lane does not cover it).
    Thp,
    /// Simulated device memory (reached only through a copy engine): the staged path on a
    /// machine without a GPU.
    Sim,
    /// CUDA device memory (needs the `cuda` feature, a driver and a GPU).
    Cuda,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum Placement {
    /// Blocks at random slots on both sides (a paged KV cache).
    Random,
    /// Blocks at consecutive slots (kvxfer coalesces them).
    Contiguous,
    /// One descriptor covering all the bytes.
    Single,
}

impl Placement {
    pub(crate) fn name(self) -> &'static str {
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
pub(crate) struct Args {
    #[command(subcommand)]
    pub(crate) cmd: Option<Cmd>,
    /// READ (pull from the peer) and/or WRITE (push to the peer), comma-separated.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "write")]
    pub(crate) op: Vec<Op>,
    /// tcp, shm, auto, or a UCX_TLS list in quotes (e.g. "rc,sm"); several separated by ';'.
    #[arg(long, value_delimiter = ';', default_value = "tcp")]
    pub(crate) transport: Vec<String>,
    /// Blocks (descriptors) per request, comma-separated. Default: Qwen3-0.6B, 2,371 tokens =
    /// 149 blocks x 28 layers x 2 (K, V).
    #[arg(long, value_delimiter = ',', default_value = "8344")]
    pub(crate) blocks: Vec<u64>,
    /// Bytes per block, comma-separated. Default: 16 tokens x 8 KV heads x 128 x bf16.
    #[arg(long, value_delimiter = ',', default_value = "32768")]
    pub(crate) block_size: Vec<u64>,
    /// A model preset (e.g. qwen3-0.6b, llama-3-8b): sets --blocks and --block-size from its
    /// KV geometry and --tokens.
    #[arg(long)]
    pub(crate) model: Option<String>,
    /// Prompt tokens with --model.
    #[arg(long, default_value_t = 2371)]
    pub(crate) tokens: u64,
    /// Where the blocks sit in each side's buffer, comma-separated.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "random")]
    pub(crate) placement: Vec<Placement>,
    /// Requests in flight at once (each its own blocks).
    #[arg(long, default_value_t = 1)]
    pub(crate) concurrency: u64,
    /// Measured iterations.
    #[arg(long, default_value_t = 5)]
    pub(crate) iters: usize,
    /// Unmeasured iterations first.
    #[arg(long, default_value_t = 2)]
    pub(crate) warmup: usize,
    /// Also measure, in the same run, memcpy of the same bytes and a plain TCP stream of the
    /// same bytes between the same two endpoints, and print kvxfer's time as a ratio to each.
    #[arg(long)]
    pub(crate) reference: bool,
    /// Print JSON lines (one per run) instead of the table.
    #[arg(long)]
    pub(crate) json: bool,
    /// Split operations longer than this many bytes (0: never).
    #[arg(long, default_value_t = 0)]
    pub(crate) max_op: u64,
    /// UCX_NET_DEVICES (default "lo" when the peer is started locally).
    #[arg(long)]
    pub(crate) net_devices: Option<String>,
    /// Spin instead of sleeping on the worker's event fd.
    #[arg(long)]
    pub(crate) busy_poll: bool,
    /// TCP connections one TCP-lane transfer (16 MiB or more) is striped over (the library's
    /// default, 4).
    #[arg(long, default_value_t = 4)]
    pub(crate) stripes: usize,
    /// Move every byte through UCX (kvxfer's shared-memory and TCP stream lanes off), its own
    /// TCP transport opted in (`AgentConfig::ucx_tcp`: trusted peers only; a peer that dies
    /// while this process serves its READ over it aborts this process inside UCX), and on a
    /// UCX older than 1.22 its emulated shared-memory WRITEs (`AgentConfig::ucx_emulated_shm`:
    /// a writer killed mid-WRITE leaves its target serving no UCX shared-memory peer again).
    #[arg(long)]
    pub(crate) ucx_only: bool,
    /// Describe each request in the paged form (`Agent::transfer_paged`: one entry of block
    /// indices) instead of one descriptor per block; the TCP lane carries it as it is.
    #[arg(long)]
    pub(crate) paged: bool,
    /// Serve as the peer: listen for a kvxfer-bench --connect on ADDR (port 0 allowed).
    #[arg(long)]
    pub(crate) listen: Option<SocketAddr>,
    /// Agent name (default: bench-<role>-<pid>); a restarted peer can keep its name.
    #[arg(long)]
    pub(crate) name: Option<String>,
    /// With --listen: exit after the first initiator's session (used for the peer the bench
    /// starts itself); without it the peer serves sessions until killed.
    #[arg(long, hide = true)]
    pub(crate) once: bool,
    /// Run against a peer started with --listen at this control address.
    #[arg(long)]
    pub(crate) connect: Option<SocketAddr>,
    /// Find the other process through etcd at URL (e.g. http://10.0.0.5:2379) instead of
    /// --listen / --connect: with --serve this process is the peer, else it runs against the
    /// peer named by --peer. Needs a build with the `etcd` feature.
    #[arg(long, value_name = "URL", conflicts_with_all = ["listen", "connect"])]
    pub(crate) etcd: Option<String>,
    /// With --etcd: serve as the peer.
    #[arg(long, requires = "etcd")]
    pub(crate) serve: bool,
    /// With --etcd: the peer's agent name (the --name it was started with).
    #[arg(long, default_value = "kvxfer-bench-peer")]
    pub(crate) peer: String,
    /// With --etcd: the namespace of both processes' keys.
    #[arg(long, default_value = "/kvxfer-bench")]
    pub(crate) namespace: String,
    /// Soak: this many transfers alternating READ and WRITE (after the warm-up), every 100th
    /// verified byte for byte, RSS of both processes reported (JSON fields `soak_*`).
    #[arg(long, default_value_t = 0)]
    pub(crate) soak: usize,
    /// Clear the destination before every timed iteration and verify it byte for byte after
    /// (neither timed): `verified` then speaks for every iteration, not the last.
    #[arg(long, conflicts_with = "soak")]
    pub(crate) verify_each: bool,
    /// Seed for placement and data.
    #[arg(long, default_value_t = 42)]
    pub(crate) seed: u64,
    /// What the blocks hold: random bytes, or bf16 KV from the generative model of
    /// `kvdata.rs` (synthetic: no model's weights can be had here), laid out as Qwen3-0.6B.
    #[arg(long, value_enum, default_value = "random")]
    pub(crate) data: DataArg,
    /// TCP-lane compression, comma-separated (each a case): off, on, auto (compress where the
    /// measured link is slower than the codec makes worthwhile).
    #[arg(long, value_delimiter = ',', default_value = "auto", value_parser = parse_compression)]
    pub(crate) compress: Vec<Compression>,
    /// Threads coding one compressed transfer, on both sides (0: the library's default, a
    /// quarter of the CPUs, 1 to 4).
    #[arg(long, default_value_t = 0)]
    pub(crate) compress_threads: usize,
    /// A shared secret for both agents (`AgentConfig::secret`): the side channel and the TCP
    /// lane's control are then sealed. The peer the bench starts gets it too.
    #[arg(long)]
    pub(crate) secret: Option<String>,
    /// With --secret: the TCP lane's data is sealed too (`AgentConfig::lane_encryption`).
    #[arg(long, requires = "secret")]
    pub(crate) lane_encryption: bool,
    /// With --secret: the peer registers its buffer shared with this initiator only
    /// (`Share::Only`): no UCX key, shared-memory handle or device export, so it moves only
    /// on the TCP lane, whose target checks the share set (device memory staged at both
    /// ends). What a grant-only KV cache costs.
    #[arg(long, requires = "secret")]
    pub(crate) shared_only: bool,
    /// With --secret, between two processes of one host: the TCP lane's data through the
    /// socket instead of a shared window. The bench turns windows on otherwise
    /// (`AgentConfig::lane_window(true)`; the library's default is off).
    #[arg(long)]
    pub(crate) no_lane_window: bool,
    /// Where both sides' KV buffers live.
    #[arg(long, value_enum, default_value = "host")]
    pub(crate) memory: MemArg,
    /// CUDA device with --memory cuda.
    #[arg(long, default_value_t = 0)]
    pub(crate) device: u32,
    /// Path of device memory: auto, direct (UCX moves VRAM) or staged (pinned host chunks).
    #[arg(long, default_value = "auto", value_parser = parse_gpu_path)]
    pub(crate) gpu_path: GpuPath,
    /// Device staging: chunks of --staging-chunk-kib (half for each direction of initiative).
    #[arg(long, default_value_t = kvxfer::staging::DEFAULT_STAGING_CHUNKS)]
    pub(crate) staging_chunks: usize,
    /// UCX without peer-failure detection (it then may use transports that cannot detect a
    /// dead peer: shared memory, cuda_ipc); a dead peer is then only noticed by deadlines.
    #[arg(long)]
    pub(crate) no_peer_failure: bool,
    /// How --memory cuda is allocated: plain (cuMemAlloc, as PyTorch's caching allocator
    /// does; UCX's cuda_ipc can map it in a peer process), pool (cudarc's default,
    /// cuMemAllocAsync from the stream-ordered pool, which legacy CUDA IPC cannot export) or
    /// vmm (virtual memory shareable as a file descriptor, as PyTorch's expandable segments).
    #[arg(long, value_enum, default_value = "plain")]
    pub(crate) cuda_alloc: CudaAlloc,
    /// Turn the device lane off (same-host GPU memory then moves over UCX's cuda_ipc on the
    /// direct path, or staged): the comparison rows of scripts/gpu-check.sh.
    #[arg(long)]
    pub(crate) no_device_lane: bool,
    /// Device staging chunk size, KiB.
    #[arg(long, default_value_t = (kvxfer::staging::DEFAULT_STAGING_CHUNK_BYTES >> 10) as u64)]
    pub(crate) staging_chunk_kib: u64,
    /// kvxfer's memory budget on both sides, MiB (0: unlimited). Under a cgroup memory limit
    /// the peer refuses a SETUP whose buffers, this budget and a 256 MiB reserve do not fit.
    #[arg(long, default_value_t = 256)]
    pub(crate) budget_mib: u64,
}

pub(crate) fn parse_compression(s: &str) -> Result<Compression, String> {
    s.parse()
}

/// What the bench's blocks hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum DataArg {
    /// Random bytes (incompressible).
    Random,
    /// Synthetic bf16 KV (see `kvdata.rs`).
    Kv,
}

pub(crate) fn parse_gpu_path(s: &str) -> Result<GpuPath, String> {
    GpuPath::parse(s).ok_or_else(|| format!("{s:?}: auto, direct or staged"))
}

#[derive(Subcommand, Debug, Clone)]
pub(crate) enum Cmd {
    /// Plan a deployment: KV bytes per request, handoff time, host memory, and whether
    /// disaggregation can pay off.
    Plan(PlanArgs),
}

#[derive(Parser, Debug, Clone)]
pub(crate) struct PlanArgs {
    /// Model preset (qwen3-0.6b, qwen3-8b, qwen3-32b, llama-3-8b, llama-3-70b, mistral-7b).
    #[arg(long, conflicts_with = "config")]
    pub(crate) model: Option<String>,
    /// A Hugging Face config.json instead of a preset.
    #[arg(long)]
    pub(crate) config: Option<std::path::PathBuf>,
    /// KV cache dtype override (bf16, fp16, fp32, fp8).
    #[arg(long)]
    pub(crate) kv_dtype: Option<String>,
    /// Prompt tokens per request.
    #[arg(long, default_value_t = 2371)]
    pub(crate) prompt_tokens: u64,
    /// Prefix tokens already cached on the decode side.
    #[arg(long, default_value_t = 0)]
    pub(crate) cached_tokens: u64,
    /// Requests handed off at once over one link.
    #[arg(long, default_value_t = 1)]
    pub(crate) concurrency: u64,
    /// Link throughput in Gbit/s.
    #[arg(long, conflicts_with = "bench_json")]
    pub(crate) link_gbps: Option<f64>,
    /// A `kvxfer-bench --json` line (file) whose measured throughput is the link.
    #[arg(long)]
    pub(crate) bench_json: Option<std::path::PathBuf>,
    /// Tokens per paged block.
    #[arg(long, default_value_t = 16)]
    pub(crate) block_tokens: u64,
    /// Prefill throughput of one prefill worker (tokens/s), to judge whether the handoff pays.
    #[arg(long)]
    pub(crate) prefill_tokens_per_s: Option<f64>,
    /// Compression's ratio (raw/wire) to plan with, instead of measuring the codec here on
    /// synthetic KV (`kvxfer-bench --data kv`).
    #[arg(long)]
    pub(crate) compress_ratio: Option<f64>,
    /// One thread's encode rate, MB/s, with --compress-ratio (else measured here).
    #[arg(long, requires = "compress_ratio")]
    pub(crate) encode_mbps: Option<f64>,
    /// One thread's decode rate, MB/s, with --compress-ratio (else measured here).
    #[arg(long, requires = "compress_ratio")]
    pub(crate) decode_mbps: Option<f64>,
    /// Threads coding one transfer (the agent's `compress_threads`): the encode rate scales
    /// with them; decoding is one thread.
    #[arg(long, default_value_t = 1)]
    pub(crate) compress_threads: usize,
    /// Print JSON.
    #[arg(long)]
    pub(crate) json: bool,
}
