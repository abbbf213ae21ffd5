//! The sweep: every combination of the comma-separated options is one case, run against a
//! peer and printed as a row.

use std::io::{BufReader, IsTerminal};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use kvxfer::layout::KvGeometry;
use kvxfer::paged::Paged;
use kvxfer::{Agent, Desc, Share, XferOp};

use crate::cli::{Args, DataArg, Op, Placement};
use crate::codec_report::{CodecRun, CpuClock};
use crate::control::{rss, rss_peak, spawn_peer, Ctl};
use crate::peer::TCP_REF_CHUNK;
use crate::reference::{memcpy_ref, tcp_ref};
use crate::registry::Registry;
use crate::report::{median, print_header, print_row, Progress, Row};
use crate::workload::{
    agent_config, agent_name, clear, device, fill, placement, verify, Buf, Case, KV_DATA,
};
use crate::BoxErr;

pub(crate) fn cases(args: &Args) -> Result<Vec<Case>, BoxErr> {
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
                        for &compress in &args.compress {
                            v.push(Case {
                                op,
                                transport: t.trim().to_string(),
                                blocks: b,
                                block_size: s,
                                placement: p,
                                compress,
                            });
                        }
                    }
                }
            }
        }
    }
    Ok(v)
}

pub(crate) fn sweep(args: &Args) -> Result<(), BoxErr> {
    if args.iters == 0 || args.concurrency == 0 {
        return Err("--iters and --concurrency must be > 0".into());
    }
    let cases = cases(args)?;
    if !args.json {
        print_header(args.reference);
    }
    let mut failed = false;
    for c in &cases {
        if kvxfer::stop::requested() {
            return Ok(());
        }
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

pub(crate) fn run(args: &Args, case: &Case) -> Result<Row, BoxErr> {
    let conc = args.concurrency;
    let reg = Registry::connect(args)?;
    let (_peer, ctl_addr, local) = match (args.connect, &reg) {
        (Some(a), _) => (None, a, a.ip().is_loopback()),
        (None, Some(r)) => {
            let a = r.control(&args.peer)?;
            (None, a, a.ip().is_loopback())
        }
        (None, None) => {
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
    // The peer's side channel address, or "etcd": its metadata is there.
    let share = if args.shared_only {
        agent_name(args, "init")
    } else {
        "-".to_string()
    };
    let side = ctl.cmd(&format!(
        "SETUP {n} {bs} {} {} {share}",
        slot_placement.name(),
        args.seed
    ))?;
    let dev = device(args)?;
    let mut cfg = agent_config(args, &case.transport, "init", local)?.compression(case.compress);
    if let Some(d) = &dev {
        cfg = cfg.copy_engine(d.engine.clone());
    }
    let agent = Agent::new(cfg)?;
    let bytes_all = n * bs;
    let buf = Buf::new(&agent, &dev, args, bytes_all as usize, Share::AllPeers)?;
    let region = buf.region.clone();
    let peer = match &reg {
        Some(r) => {
            r.resolve(&agent, &args.peer)?;
            args.peer.clone()
        }
        None => agent.connect(side.parse::<SocketAddr>()?)?,
    };
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
    // --paged: each request as one entry per side, its block indices (a single region: one
    // block of the request's bytes).
    let paged: Vec<(Vec<Paged>, Vec<Paged>)> = if !args.paged {
        Vec::new()
    } else {
        let entry = |id: kvxfer::RegionId, slots: &[u64], len: u64| Paged {
            region: id,
            offset: 0,
            block_len: len,
            stride: len,
            blocks: slots.iter().map(|&s| s as u32).collect(),
        };
        (0..conc as usize)
            .map(|r| {
                if case.placement == Placement::Single {
                    let per = case.blocks * bs;
                    let one = [r as u64];
                    (
                        vec![entry(region.id(), &one, per)],
                        vec![entry(rid, &one, per)],
                    )
                } else {
                    let k = r * per_req..(r + 1) * per_req;
                    (
                        vec![entry(region.id(), &lslots[k.clone()], bs)],
                        vec![entry(rid, &rslots[k], bs)],
                    )
                }
            })
            .collect()
    };

    let data_seed =
        args.seed.wrapping_add(1) & !KV_DATA | if args.data == DataArg::Kv { KV_DATA } else { 0 };
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
    // The initiator's device submissions per timed iteration (copies, launches).
    let mut subs: Vec<u64> = Vec::new();
    let total = args.warmup + if args.soak > 0 { args.soak } else { args.iters };
    let mut bar = Progress::new(!args.json && std::io::stderr().is_terminal());
    let peer_pid = _peer.as_ref().map(|p| p.0.id());
    let (mut rss10, mut checks, mut bad_checks) = ((0u64, 0u64), 0usize, 0usize);
    let mut codec = CodecRun::default();
    let mut clock: Option<CpuClock> = None;
    for i in 0..total {
        if kvxfer::stop::requested() {
            break;
        }
        if i == args.warmup {
            clock = Some(CpuClock::start(&agent, &mut ctl)?);
        }
        let op = if args.soak > 0 && i % 2 == 1 {
            XferOp::Read
        } else {
            op
        };
        if args.verify_each {
            match op {
                XferOp::Write => {
                    ctl.cmd("CLEAR")?;
                }
                XferOp::Read => clear(&buf)?,
            }
        }
        let subs0 = dev.as_ref().map_or(0, |d| d.engine.submissions());
        let t = Instant::now();
        let deadline = Some(Duration::from_secs(600));
        let xs = if args.paged {
            paged
                .iter()
                .map(|(l, r)| agent.transfer_paged(op, &peer, l, r, None, deadline))
                .collect::<kvxfer::Result<Vec<_>>>()?
        } else {
            sel.iter()
                .map(|s| agent.transfer(op, &local_list, s, &remote_list, s, None, deadline))
                .collect::<kvxfer::Result<Vec<_>>>()?
        };
        let mut post = 0f64;
        ops = 0;
        for x in xs {
            // Asked to stop: in flight finishes within the grace, else is cancelled.
            let Some(st) = kvxfer::stop::wait(x)? else {
                continue;
            };
            ops += st.ops;
            lane = st.lane;
            if i >= args.warmup {
                codec.add(&st);
            }
            post = post.max(st.post_time.as_secs_f64() * 1e3);
        }
        let dt = t.elapsed();
        if i >= args.warmup {
            times.push(dt.as_secs_f64() * 1e3);
            post_ms.push(post);
            subs.push(dev.as_ref().map_or(0, |d| d.engine.submissions()) - subs0);
        }
        if args.verify_each {
            checks += 1;
            let ok = match op {
                XferOp::Write => ctl.cmd(&format!("VERIFY {data_seed}"))? == "true",
                XferOp::Read => verify(&buf, &lslots, bs, data_seed)?,
            };
            bad_checks += usize::from(!ok);
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
    let cpu = match clock {
        Some(c) => Some(c.stop(&agent, &mut ctl)?),
        None => None,
    };
    if kvxfer::stop::requested() {
        let _ = ctl.cmd("QUIT");
        return Err(format!("after {} of {total} transfers", times.len()).into());
    }
    let soak_rss_end = (rss(std::process::id()), peer_pid.map_or(0, rss));
    let verified = match op {
        XferOp::Write => ctl.cmd(&format!("VERIFY {data_seed}"))? == "true",
        XferOp::Read => verify(&buf, &lslots, bs, data_seed)?,
    };
    let info = agent.peer_info(&peer)?;
    let mem: Vec<u64> = ctl
        .cmd("MEM")?
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    let peer_rss_peak = mem.first().copied().unwrap_or(0);
    let self_rss_peak = rss_peak(std::process::id());
    let (memcpy_ms, tcp_ms, tcp_mem_ms) = if args.reference {
        // Plain TCP through a cache-hot 1 MiB buffer, and through buffers the transfer's size.
        let mut tcp = |span| tcp_ref(&mut ctl, ctl_addr, bytes_all, op, args.iters, span);
        (
            Some(memcpy_ref(bytes_all, args.iters)?),
            Some(tcp(TCP_REF_CHUNK)?),
            Some(tcp(bytes_all as usize)?),
        )
    } else {
        (None, None, None)
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
        "shared_only": args.shared_only,
        "lane_windows": kvxfer::live::live().lane_windows,
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
        "cuda_alloc": (args.memory == crate::cli::MemArg::Cuda)
            .then(|| args.cuda_alloc.name()),
        "gpu_path": info.gpu_path.map(|p| p.to_string()),
        "device_alloc": region.device_alloc().map(|k| k.to_string()),
        "lanes": info.lanes.iter().map(|l| l.to_string()).collect::<Vec<_>>(),
        "rss_peak_self_mib": self_rss_peak as f64 / (1 << 20) as f64,
        "rss_peak_peer_mib": peer_rss_peak as f64 / (1 << 20) as f64,
        "budget_peak_self_mib": agent.budget().peak() as f64 / (1 << 20) as f64,
        "budget_peak_peer_mib": mem.get(1).copied().unwrap_or(0) as f64 / (1 << 20) as f64,
        "memory_limit_peer_mib": mem.get(3).copied().unwrap_or(0) as f64 / (1 << 20) as f64,
    });
    codec.report(&mut j, case.compress, args.data, cpu.as_ref());
    if let Some(st) = agent.staging_stats() {
        j["staging_mib"] = (st.bytes as f64 / (1 << 20) as f64).into();
        j["staging_waits"] = st.waits.into();
    }
    if dev.is_some() {
        // Per request: what one transfer cost the initiator's device in submissions, and
        // the time of each (the transfer's median over them).
        let mut per = subs.clone();
        per.sort_unstable();
        let n = per.get(per.len() / 2).copied().unwrap_or(0);
        j["submissions"] = n.into();
        if n > 0 {
            j["us_per_submission"] = (med * 1e3 / n as f64).into();
        }
    }
    if args.verify_each {
        j["verified_iterations"] = checks.into();
        j["verified"] = (verified && bad_checks == 0 && checks >= times.len()).into();
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
    if let (Some(m), Some(t), Some(tm)) = (memcpy_ms, tcp_ms, tcp_mem_ms) {
        j["memcpy_ms"] = m.into();
        j["tcp_ms"] = t.into();
        j["tcp_mem_ms"] = tm.into();
        j["x_memcpy"] = (med / m).into();
        j["x_tcp"] = (med / t).into();
        j["x_tcp_mem"] = (med / tm).into();
    }
    // Deregistered before the memory goes (the agent would otherwise unmap it at its drop,
    // after the bench freed it).
    buf.release(&agent)?;
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
        tcp_mem_ms,
        // The line for raw runs too when compression is being compared.
        codec: codec.summary(
            cpu.as_ref(),
            args.data == DataArg::Kv || args.compress.len() > 1,
        ),
        json: j,
    })
}
