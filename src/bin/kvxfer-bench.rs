//! kvxfer-bench: moves KV-shaped data between two processes (or hosts) and reports throughput.
//!
//! With no arguments it moves one Qwen3-0.6B request (2,371 tokens: 8,344 blocks x 32 KiB =
//! 273,416,192 B at random block slots on both sides) to a peer process it starts itself,
//! verifies the bytes, and prints a table.
//!
//! Two hosts: run `kvxfer-bench --listen 0.0.0.0:0` on one (it prints its control address),
//! and `kvxfer-bench --connect HOST:PORT` on the other.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use kvxfer::{Agent, AgentConfig, Desc, HostBuffer, Region, Transport, XferOp};
use rand::seq::SliceRandom;
use rand::SeedableRng;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Op {
    Read,
    Write,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Placement {
    Random,
    Contiguous,
}

#[derive(Parser, Debug, Clone)]
#[command(
    name = "kvxfer-bench",
    about = "Measure KV transfer throughput between two kvxfer agents"
)]
struct Args {
    /// READ (pull from the peer) or WRITE (push to the peer).
    #[arg(long, value_enum, default_value = "write")]
    op: Op,
    /// tcp, shm, auto, or a UCX_TLS list (e.g. "rc,sm").
    #[arg(long, default_value = "tcp")]
    transport: String,
    /// Number of blocks (descriptors). Default: Qwen3-0.6B, 2,371 tokens = 149 blocks x 28
    /// layers x 2 (K, V).
    #[arg(long, default_value_t = 8344)]
    blocks: u64,
    /// Bytes per block. Default: 16 tokens x 8 KV heads x 128 x bf16.
    #[arg(long, default_value_t = 32768)]
    block_size: u64,
    /// Where the blocks sit in each side's buffer.
    #[arg(long, value_enum, default_value = "random")]
    placement: Placement,
    /// Measured iterations.
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// Unmeasured iterations first.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Print one JSON object instead of the table.
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
    /// Serve as the peer: listen for a kvxfer-bench --connect on ADDR (port 0 allowed).
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Run against a peer started with --listen at this control address.
    #[arg(long)]
    connect: Option<SocketAddr>,
    /// Move every byte through UCX (kvxfer's shared-memory and TCP stream lanes off).
    #[arg(long)]
    ucx_only: bool,
    /// Seed for placement and data.
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

fn main() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("error")).init();
    let args = Args::parse();
    let r = if let Some(addr) = args.listen {
        serve(&args, addr)
    } else {
        run(&args)
    };
    if let Err(e) = r {
        eprintln!("kvxfer-bench: {e}");
        std::process::exit(1);
    }
}

type BoxErr = Box<dyn std::error::Error>;

fn agent_config(args: &Args, role: &str, local_peer: bool) -> AgentConfig {
    let mut c = AgentConfig::new(format!("bench-{role}-{}", std::process::id()))
        .transport(Transport::parse(&args.transport))
        .busy_poll(args.busy_poll)
        .lanes(!args.ucx_only);
    c.max_op_bytes = args.max_op;
    match (&args.net_devices, local_peer) {
        (Some(d), _) => c.net_devices(d.clone()),
        (None, true) => c.net_devices("lo"),
        (None, false) => c,
    }
}

/// Slot of the k-th block on each side.
fn placement(args: &Args) -> (Vec<u64>, Vec<u64>) {
    let mut l: Vec<u64> = (0..args.blocks).collect();
    let mut r = l.clone();
    if args.placement == Placement::Random {
        l.shuffle(&mut rand::rngs::StdRng::seed_from_u64(args.seed));
        r.shuffle(&mut rand::rngs::StdRng::seed_from_u64(
            args.seed ^ 0x9e37_79b9_7f4a_7c15,
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

fn fill(r: &Region, slots: &[u64], bs: u64, seed: u64) -> kvxfer::Result<()> {
    let mut buf = vec![0u8; bs as usize];
    for (k, &s) in slots.iter().enumerate() {
        pattern(seed, k as u64, &mut buf);
        r.write(s * bs, &buf)?;
    }
    Ok(())
}

fn clear(r: &Region) -> kvxfer::Result<()> {
    let zero = vec![0u8; 1 << 20];
    let mut off = 0;
    while off < r.len() {
        let n = (r.len() - off).min(zero.len() as u64);
        r.write(off, &zero[..n as usize])?;
        off += n;
    }
    Ok(())
}

fn verify(r: &Region, slots: &[u64], bs: u64, seed: u64) -> kvxfer::Result<bool> {
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

/// The peer: registers its buffer, answers control commands line by line.
fn serve(args: &Args, addr: SocketAddr) -> Result<(), BoxErr> {
    let ctl = TcpListener::bind(addr)?;
    let local = addr.ip().is_loopback();
    let mut agent = Agent::new(agent_config(args, "peer", local))?;
    let side = agent.listen(SocketAddr::new(ctl.local_addr()?.ip(), 0))?;
    println!("KVXFER-BENCH READY ctl={} side={side}", ctl.local_addr()?);
    std::io::stdout().flush()?;
    let (s, _) = ctl.accept()?;
    let mut rd = BufReader::new(s.try_clone()?);
    let mut wr = s;
    let mut region: Option<Region> = None;
    let mut slots: Vec<u64> = Vec::new();
    let mut bs = 0;
    let mut line = String::new();
    loop {
        line.clear();
        if rd.read_line(&mut line)? == 0 {
            return Ok(()); // The initiator went away.
        }
        let w: Vec<&str> = line.split_whitespace().collect();
        let reply = match w.as_slice() {
            ["SETUP", blocks, block_size, placement_s, seed] => {
                let a = Args {
                    blocks: blocks.parse()?,
                    block_size: block_size.parse()?,
                    placement: if *placement_s == "random" {
                        Placement::Random
                    } else {
                        Placement::Contiguous
                    },
                    seed: seed.parse()?,
                    ..args.clone()
                };
                bs = a.block_size;
                slots = placement(&a).1;
                if let Some(r) = region.take() {
                    agent.deregister(&r)?;
                }
                region =
                    Some(agent.register(HostBuffer::new((a.blocks * a.block_size) as usize)?)?);
                format!("OK {side}")
            }
            ["FILL", seed] => match &region {
                Some(r) => {
                    fill(r, &slots, bs, seed.parse()?)?;
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
                Some(r) => format!("OK {}", verify(r, &slots, bs, seed.parse()?)?),
                None => "ERR no SETUP".into(),
            },
            ["REGION"] => match &region {
                Some(r) => format!("OK {}", r.id().0),
                None => "ERR no SETUP".into(),
            },
            ["QUIT"] => {
                writeln!(wr, "OK")?;
                return Ok(());
            }
            _ => format!("ERR unknown command {:?}", line.trim()),
        };
        writeln!(wr, "{reply}")?;
    }
}

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

fn spawn_peer(args: &Args) -> Result<(Peer, SocketAddr), BoxErr> {
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args(["--listen", "127.0.0.1:0", "--transport", &args.transport]);
    if let Some(d) = &args.net_devices {
        cmd.args(["--net-devices", d]);
    }
    if args.busy_poll {
        cmd.arg("--busy-poll");
    }
    if args.ucx_only {
        cmd.arg("--ucx-only");
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

fn run(args: &Args) -> Result<(), BoxErr> {
    if args.blocks == 0 || args.block_size == 0 || args.iters == 0 {
        return Err("--blocks, --block-size and --iters must be > 0".into());
    }
    let (_peer, ctl_addr, local) = match args.connect {
        Some(a) => (None, a, a.ip().is_loopback()),
        None => {
            let (p, a) = spawn_peer(args)?;
            (Some(p), a, true)
        }
    };
    let s = TcpStream::connect(ctl_addr)?;
    let mut ctl = Ctl {
        rd: BufReader::new(s.try_clone()?),
        wr: s,
    };
    let placement_s = match args.placement {
        Placement::Random => "random",
        Placement::Contiguous => "contiguous",
    };
    let side: SocketAddr = ctl
        .cmd(&format!(
            "SETUP {} {} {placement_s} {}",
            args.blocks, args.block_size, args.seed
        ))?
        .parse()?;
    let agent = Agent::new(agent_config(args, "init", local))?;
    let bytes = args.blocks * args.block_size;
    let region = agent.register(HostBuffer::new(bytes as usize)?)?;
    let peer = agent.connect(side)?;
    let rid = kvxfer::RegionId(ctl.cmd("REGION")?.parse()?);
    let (lslots, rslots) = placement(args);
    let bs = args.block_size;
    let ld: Vec<Desc> = lslots
        .iter()
        .map(|&s| Desc::new(region.id(), s * bs, bs))
        .collect();
    let rd: Vec<Desc> = rslots.iter().map(|&s| Desc::new(rid, s * bs, bs)).collect();
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
    preps.sort_by(f64::total_cmp);
    let prep_ms = preps[preps.len() / 2];
    let (local_list, remote_list) = (local_list.ok_or("no list")?, remote_list.ok_or("no list")?);

    let data_seed = args.seed.wrapping_add(1);
    let op = match args.op {
        Op::Write => {
            fill(&region, &lslots, bs, data_seed)?;
            ctl.cmd("CLEAR")?;
            XferOp::Write
        }
        Op::Read => {
            ctl.cmd(&format!("FILL {data_seed}"))?;
            clear(&region)?;
            XferOp::Read
        }
    };
    let mut times = Vec::with_capacity(args.iters);
    let mut ops = 0;
    let mut lane = kvxfer::Lane::Ucx;
    let mut post_ms = Vec::new();
    let total = args.warmup + args.iters;
    let progress = !args.json && std::io::IsTerminal::is_terminal(&std::io::stderr());
    for i in 0..total {
        let t = Instant::now();
        let st = agent
            .transfer_all(
                op,
                &local_list,
                &remote_list,
                None,
                Some(Duration::from_secs(600)),
            )?
            .wait()?;
        let dt = t.elapsed();
        ops = st.ops;
        lane = st.lane;
        if i >= args.warmup {
            times.push(dt.as_secs_f64() * 1e3);
            post_ms.push(st.post_time.as_secs_f64() * 1e3);
        }
        if progress {
            eprint!("\r{}/{} iterations", i + 1, total);
        }
    }
    if progress {
        eprintln!();
    }
    let verified = match op {
        XferOp::Write => ctl.cmd(&format!("VERIFY {data_seed}"))? == "true",
        XferOp::Read => verify(&region, &lslots, bs, data_seed)?,
    };
    let info = agent.peer_info(&peer)?;
    let _ = ctl.cmd("QUIT");
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let (min, max) = (times[0], times[times.len() - 1]);
    post_ms.sort_by(f64::total_cmp);
    let gbps = bytes as f64 / (median / 1e3) / 1e9;
    let ucx = agent.ucx_version().to_string();
    if args.json {
        let j = serde_json::json!({
            "op": format!("{op}"),
            "transport": info.transports,
            "lane": lane.to_string(),
            "transport_requested": args.transport,
            "ucx_version": ucx,
            "bytes": bytes,
            "descriptors": args.blocks,
            "ops": ops,
            "placement": placement_s,
            "iterations": args.iters,
            "median_ms": median,
            "min_ms": min,
            "max_ms": max,
            "gbps": gbps,
            "post_ms_median": post_ms[post_ms.len() / 2],
            "prep_ms": prep_ms,
            "verified": verified,
        });
        println!("{j}");
    } else {
        println!(
            "{:<6} {:<22} {:<8} {:>12} {:>6} {:>6} {:>5} {:>9} {:>9} {:>9} {:>7} {:>8}",
            "op",
            "transport",
            "ucx",
            "bytes",
            "descs",
            "ops",
            "iters",
            "median_ms",
            "min_ms",
            "max_ms",
            "GB/s",
            "verified"
        );
        println!(
            "{:<6} {:<22} {:<8} {:>12} {:>6} {:>6} {:>5} {:>9.2} {:>9.2} {:>9.2} {:>7.2} {:>8}",
            op.to_string(),
            info.transports,
            ucx,
            bytes,
            args.blocks,
            ops,
            args.iters,
            median,
            min,
            max,
            gbps,
            verified
        );
    }
    if !verified {
        return Err("bytes did not verify".into());
    }
    Ok(())
}
