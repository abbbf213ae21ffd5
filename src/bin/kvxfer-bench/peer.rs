//! The peer process: it registers its buffer and answers control commands; and its side of
//! the plain TCP reference stream.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};

use std::sync::Arc;

use kvxfer::cgroup_memory_limit;
use kvxfer::{Agent, Share};

use crate::cli::{Args, Placement};
use crate::control::rss_peak;
use crate::registry::Registry;
use crate::workload::{agent_config, clear, device, fill, placement, verify, Buf, Device};
use crate::BoxErr;

/// The peer: registers its buffer, answers control commands line by line.
pub(crate) fn serve(args: &Args, addr: SocketAddr) -> Result<(), BoxErr> {
    let ctl = TcpListener::bind(addr)?;
    let local = addr.ip().is_loopback();
    let transport = args.transport.first().cloned().unwrap_or("tcp".into());
    let dev = device(args)?;
    let mut cfg = agent_config(args, &transport, "peer", local)?;
    if let Some(d) = &dev {
        cfg = cfg.copy_engine(d.engine.clone());
    }
    let agent = Arc::new(Agent::new(cfg)?);
    let ip = ctl.local_addr()?.ip();
    let reg = Registry::connect(args)?;
    let side = match &reg {
        Some(r) => {
            r.publish(&agent, ctl.local_addr()?)?;
            None
        }
        None => Some(agent.listen(SocketAddr::new(ip, 0))?),
    };
    let side_s = side.map_or("etcd".to_string(), |s| s.to_string());
    println!(
        "KVXFER-BENCH READY ctl={} side={side_s} agent={} pid={}",
        ctl.local_addr()?,
        agent.name(),
        std::process::id()
    );
    std::io::stdout().flush()?;
    let mut state = PeerState {
        region: None,
        slots: Vec::new(),
        bs: 0,
    };
    ctl.set_nonblocking(true)?;
    loop {
        let s = match ctl.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if kvxfer::stop::requested() {
                    return close(&agent, &mut state);
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        s.set_nonblocking(false)?;
        let at = Session {
            ip,
            side: &side_s,
            reg: reg.as_ref(),
        };
        if let Err(e) = session(&agent, s, &at, &mut state, args, &dev) {
            eprintln!("kvxfer-bench peer: session ended: {e}");
        }
        if args.once || kvxfer::stop::requested() {
            return close(&agent, &mut state);
        }
    }
}

/// Deregisters the peer's buffer before the agent closes (asked to stop, or done).
fn close(agent: &Agent, st: &mut PeerState) -> Result<(), BoxErr> {
    if let Some(r) = st.region.take() {
        r.release(agent)?;
    }
    Ok(())
}

pub(crate) struct PeerState {
    pub(crate) region: Option<Buf>,
    pub(crate) slots: Vec<u64>,
    pub(crate) bs: u64,
}

/// Where the peer is: its IP, what it tells the initiator to load its metadata from (a side
/// channel address, or "etcd"), and its etcd registry.
pub(crate) struct Session<'a> {
    pub(crate) ip: std::net::IpAddr,
    pub(crate) side: &'a str,
    pub(crate) reg: Option<&'a Registry>,
}

pub(crate) fn session(
    agent: &Agent,
    s: TcpStream,
    at: &Session<'_>,
    st: &mut PeerState,
    args: &Args,
    dev: &Option<Device>,
) -> Result<(), BoxErr> {
    let PeerState { region, slots, bs } = st;
    // Reads wake up every 100 ms to see whether the process was asked to stop.
    s.set_read_timeout(Some(std::time::Duration::from_millis(100)))?;
    let mut rd = BufReader::new(s.try_clone()?);
    let mut wr = s;
    let mut line = String::new();
    loop {
        line.clear();
        loop {
            match rd.read_line(&mut line) {
                Ok(0) => return Ok(()), // The initiator went away.
                Ok(_) => break,
                // A partial line stays in `line`; the rest follows.
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    if kvxfer::stop::requested() {
                        return Ok(());
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
        let w: Vec<&str> = line.split_whitespace().collect();
        let reply = match w.as_slice() {
            ["SETUP", blocks, block_size, placement_s, seed, share @ ..] if share.len() <= 1 => {
                // None or "-": for every peer; else the one initiator the buffer is shared
                // with.
                let share = match share.first() {
                    None | Some(&"-") => Share::AllPeers,
                    Some(name) => Share::Only(vec![name.to_string()]),
                };
                let blocks: u64 = blocks.parse()?;
                *bs = block_size.parse()?;
                let p = match *placement_s {
                    "random" => Placement::Random,
                    _ => Placement::Contiguous,
                };
                *slots = placement(p, blocks, seed.parse()?).1;
                if let Some(r) = region.take() {
                    r.release(agent)?;
                }
                // Under a memory limit, refuse what cannot fit now, not at the OOM killer.
                if let Some(limit) = cgroup_memory_limit() {
                    if let Err(e) = agent.budget().check_fits(blocks * *bs, RESERVE, limit) {
                        writeln!(wr, "ERR {e}")?;
                        continue;
                    }
                }
                *region = Some(Buf::new(agent, dev, args, (blocks * *bs) as usize, share)?);
                if let Some(r) = at.reg {
                    r.refresh(agent)?;
                }
                format!("OK {}", at.side)
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
            ["TCPREF", bytes, dir, rounds, span @ ..] => {
                let l = TcpListener::bind(SocketAddr::new(at.ip, 0))?;
                let port = l.local_addr()?.port();
                let (bytes, rounds): (u64, usize) = (bytes.parse()?, rounds.parse()?);
                // The buffer streamed into or from: 1 MiB, cache-hot (iperf3 -l 1M), or as
                // large as the transfer (the same memory traffic as a KV transfer).
                let span: usize = match span {
                    [s] => s.parse()?,
                    _ => TCP_REF_CHUNK,
                };
                let inbound = *dir == "in";
                std::thread::spawn(move || {
                    if let Err(e) = tcp_ref_serve(l, bytes, inbound, rounds, span) {
                        eprintln!("kvxfer-bench peer: TCP reference: {e}");
                    }
                });
                format!("OK {port}")
            }
            ["RSS"] => format!("OK {}", rss_peak(std::process::id())),
            // What this side's codec did and the process's CPU time (ns), for per-GB costs.
            ["CODEC"] => format!("OK {}", crate::codec_report::local_line(agent)),
            // Peak RSS, kvxfer's budget (peak, limit), the cgroup's limit (0: none).
            ["MEM"] => format!(
                "OK {} {} {} {}",
                rss_peak(std::process::id()),
                agent.budget().peak(),
                agent.budget().limit(),
                cgroup_memory_limit().unwrap_or(0)
            ),
            ["QUIT"] => {
                writeln!(wr, "OK")?;
                return Ok(());
            }
            _ => format!("ERR unknown command {:?}", line.trim()),
        };
        writeln!(wr, "{reply}")?;
    }
}

/// Memory the peer keeps for itself besides its buffers and kvxfer's budget (code, heap, UCX).
const RESERVE: u64 = 256 << 20;

/// Size of each write and read of the plain TCP reference (iperf3 -l 1M).
pub(crate) const TCP_REF_CHUNK: usize = 1 << 20;

/// The peer's end of the plain TCP reference: per round, receive `bytes` and answer one byte
/// (inbound), or on one byte send `bytes` (outbound), in calls of up to 1 MiB that walk a
/// buffer of `span` bytes (touched before the first round).
pub(crate) fn tcp_ref_serve(
    l: TcpListener,
    bytes: u64,
    inbound: bool,
    rounds: usize,
    span: usize,
) -> std::io::Result<()> {
    let (mut s, _) = l.accept()?;
    s.set_nodelay(true)?;
    let mut buf = vec![3u8; span.max(TCP_REF_CHUNK)];
    for _ in 0..rounds {
        let mut at = 0usize;
        let mut left = bytes;
        if inbound {
            while left > 0 {
                let (w, n) = window(&mut buf, &mut at, left);
                let n = s.read(&mut w[..n])?;
                if n == 0 {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
                at += n;
                left -= n as u64;
            }
            s.write_all(&[1])?;
        } else {
            let mut go = [0u8; 1];
            s.read_exact(&mut go)?;
            while left > 0 {
                let (w, n) = window(&mut buf, &mut at, left);
                s.write_all(&w[..n])?;
                at += n;
                left -= n as u64;
            }
        }
    }
    Ok(())
}

/// The next window of a reference stream's buffer, from `at` (wrapping to the start when
/// fewer than 1 MiB are left in it): the slice and how many bytes of it the call moves.
pub(crate) fn window<'a>(buf: &'a mut [u8], at: &mut usize, left: u64) -> (&'a mut [u8], usize) {
    if buf.len() - *at < TCP_REF_CHUNK {
        *at = 0;
    }
    let n = left.min(TCP_REF_CHUNK as u64) as usize;
    (&mut buf[*at..], n)
}
