//! A peer killed with SIGKILL in the middle of a transfer (READ and WRITE, over kvxfer's TCP
//! lane and over UCX): the initiator gets a typed error well before its deadline, its memory
//! is released, it keeps serving another peer, and a restarted peer with the same name
//! reconnects (the stale metadata is replaced).

#![allow(clippy::unwrap_used)] // Tests fail loudly on purpose.

mod common;

use std::net::SocketAddr;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use kvxfer::{Agent, AgentConfig, Desc, Error, HostBuffer, Lane, RegionId, Transport, XferOp};

const LEN: u64 = 512 << 20;
const BLOCK: u64 = 32 << 10;

struct Peer {
    child: Child,
    control: common::Control,
    side: SocketAddr,
    region: RegionId,
}

impl Peer {
    /// A peer; without `lanes` every byte goes through UCX on both ends (with lanes, UCX's
    /// TCP is off).
    fn start(name: &str, memory: &str, lanes: bool) -> Peer {
        Peer::start_on(name, memory, lanes, "tcp")
    }

    /// A peer on transport `transport` (`tcp`, `shm`).
    fn start_on(name: &str, memory: &str, lanes: bool, transport: &str) -> Peer {
        let ucx_only: &[&str] = if lanes { &[] } else { &["--ucx-only"] };
        let (child, ready) = common::spawn_peer(
            Command::new(env!("CARGO_BIN_EXE_kvxfer-bench")).args(
                [
                    "--listen",
                    "127.0.0.1:0",
                    "--transport",
                    transport,
                    "--name",
                    name,
                    "--memory",
                    memory,
                ]
                .iter()
                .chain(ucx_only),
            ),
        );
        let mut p = Peer {
            child,
            control: common::Control::connect(common::ctl_addr(&ready)),
            side: "127.0.0.1:1".parse().unwrap(),
            region: RegionId(0),
        };
        p.side = p
            .cmd(&format!("SETUP {} {BLOCK} random 1", LEN / BLOCK))
            .parse()
            .unwrap();
        p.region = RegionId(p.cmd("REGION").parse().unwrap());
        p
    }

    fn cmd(&mut self, c: &str) -> String {
        self.control.cmd(c)
    }

    fn kill(&mut self) {
        // SAFETY: kill(2) has no memory preconditions; the pid is our own child's.
        let r = unsafe { libc::kill(self.child.id() as i32, libc::SIGKILL) };
        assert_eq!(r, 0);
        let _ = self.child.wait();
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `device`: both ends hold (simulated) device memory, moved on the staged path.
fn scenario(lanes: bool, op: XferOp, device: bool) {
    let tag = format!(
        "{}-{op}-{}{}",
        if lanes { "lane" } else { "ucx" },
        std::process::id(),
        if device { "-dev" } else { "" }
    );
    let dev = kvxfer::staging::SimulatedDevice::new();
    let mut cfg = AgentConfig::new(format!("survivor-{tag}"))
        .transport(Transport::Tcp)
        .lanes(lanes)
        .ucx_tcp(!lanes)
        .net_devices("lo");
    if device {
        cfg = cfg.copy_engine(dev.engine());
    }
    let agent = Agent::new(cfg).unwrap();
    let region = if device {
        let addr = dev.alloc(LEN as usize).unwrap();
        // SAFETY: the simulated allocation lives as long as `dev`, past the agent.
        unsafe { agent.register_raw(addr as *mut u8, LEN as usize, kvxfer::MemKind::Cuda(0)) }
            .unwrap()
    } else {
        agent
            .register(HostBuffer::new(LEN as usize).unwrap())
            .unwrap()
    };
    let memory = if device { "sim" } else { "host" };
    let name = format!("victim-{tag}");
    let mut victim = Peer::start(&name, memory, lanes);
    let mut other = Peer::start(&format!("bystander-{tag}"), memory, lanes);
    assert_eq!(agent.connect(victim.side).unwrap(), name);
    let bystander = agent.connect(other.side).unwrap();
    let n = LEN / BLOCK;
    let ld: Vec<Desc> = (0..n)
        .map(|i| Desc::new(region.id(), i * BLOCK, BLOCK))
        .collect();
    let local = agent.prep_local(&ld).unwrap();
    let remote_of = |r: RegionId| -> Vec<Desc> {
        (0..n)
            .rev()
            .map(|i| Desc::new(r, i * BLOCK, BLOCK))
            .collect()
    };
    let rl = agent.prep_remote(&name, &remote_of(victim.region)).unwrap();

    // Kill the target while 512 MiB are on their way.
    let deadline = Duration::from_secs(30);
    let x = agent
        .transfer_all(op, &local, &rl, None, Some(deadline))
        .unwrap();
    std::thread::sleep(Duration::from_millis(20));
    let t = Instant::now();
    victim.kill();
    let r = x.wait();
    let took = t.elapsed();
    eprintln!(
        "{tag}: after SIGKILL: {:?} in {took:?}",
        r.as_ref().map(|s| s.bytes)
    );
    match &r {
        Err(Error::PeerFailed { .. } | Error::LaneFailed { .. } | Error::Deadline { .. }) => {}
        Ok(_) => {} // finished before the kill landed: allowed, rare
        Err(e) => panic!("untyped failure: {e:?}"),
    }
    assert!(
        took < Duration::from_secs(20),
        "error took {took:?} (deadline {deadline:?})"
    );
    assert_eq!(
        region.inflight(),
        0,
        "memory still pinned after the failure"
    );
    if device {
        assert_eq!(
            agent.staging_stats().unwrap().in_use,
            0,
            "staging chunks still held after the failure"
        );
    }

    // The bystander is served as before.
    let bl = agent
        .prep_remote(&bystander, &remote_of(other.region))
        .unwrap();
    agent
        .transfer_all(op, &local, &bl, None, Some(deadline))
        .unwrap()
        .wait()
        .unwrap();

    // The victim restarts with the same name: new metadata replaces the stale one; lists
    // prepared against the dead one are refused, fresh ones work.
    let mut again = Peer::start(&name, memory, lanes);
    assert_eq!(agent.connect(again.side).unwrap(), name);
    let e = agent
        .transfer_all(op, &local, &rl, None, Some(deadline))
        .and_then(|x| x.wait())
        .unwrap_err();
    assert!(matches!(e, Error::StalePeer { .. }), "{e}");
    let rl2 = agent.prep_remote(&name, &remote_of(again.region)).unwrap();
    agent
        .transfer_all(op, &local, &rl2, None, Some(deadline))
        .unwrap()
        .wait()
        .unwrap();
    let _ = again.cmd("QUIT");
    let _ = other.cmd("QUIT");
    agent.deregister(&region).unwrap();
}

#[test]
fn sigkill_mid_write_over_the_tcp_lane() {
    scenario(true, XferOp::Write, false);
}

#[test]
fn sigkill_mid_read_over_the_tcp_lane() {
    scenario(true, XferOp::Read, false);
}

#[test]
fn sigkill_mid_write_over_ucx() {
    scenario(false, XferOp::Write, false);
}

#[test]
fn sigkill_mid_read_over_ucx() {
    scenario(false, XferOp::Read, false);
}

#[test]
fn sigkill_mid_write_of_staged_device_memory() {
    scenario(true, XferOp::Write, true);
}

#[test]
fn sigkill_mid_read_of_staged_device_memory() {
    scenario(true, XferOp::Read, true);
}

/// How the initiator of [`initiator_sigkill`] reaches its target.
#[derive(Clone, Copy, Debug)]
enum Path {
    /// kvxfer's TCP lane (the default).
    TcpLane,
    /// UCX over shared memory, lanes off.
    UcxShm,
    /// Lanes on towards a same-host target whose memory kvxfer's shm lane does not cover
    /// (private, as an engine's tensors): what UCX carries by default in-host.
    SameHost,
}

impl Path {
    fn parse(s: &str) -> Path {
        match s {
            "TcpLane" => Path::TcpLane,
            "SameHost" => Path::SameHost,
            _ => Path::UcxShm,
        }
    }

    fn config(self, name: String) -> AgentConfig {
        let c = AgentConfig::new(name).net_devices("lo");
        match self {
            Path::TcpLane => c.transport(Transport::Tcp),
            // Opted in: on UCX 1.13 the writer's death wedges the target (below).
            Path::UcxShm => c
                .transport(Transport::Shm)
                .lanes(false)
                .ucx_emulated_shm(true),
            Path::SameHost => c.transport(Transport::Shm),
        }
    }
}

/// The initiator's half of [`initiator_sigkill`]: a process of its own, so that the test can
/// kill it mid-transfer. Runs only when the test sets `KVX_PD_SIDE`.
#[test]
#[ignore = "started by initiator_sigkill"]
fn initiator_child() {
    use std::io::Write;
    let Ok(side) = std::env::var("KVX_PD_SIDE") else {
        return;
    };
    let rid = RegionId(std::env::var("KVX_PD_REGION").unwrap().parse().unwrap());
    let op = match std::env::var("KVX_PD_OP").unwrap().as_str() {
        "Read" => XferOp::Read,
        _ => XferOp::Write,
    };
    let path = Path::parse(&std::env::var("KVX_PD_PATH").unwrap());
    if std::env::var_os("KVX_PD_AFTER").is_some() {
        return serve_after(side.parse().unwrap(), rid, path);
    }
    let agent = Agent::new(path.config(format!("doomed-{}", std::process::id()))).unwrap();
    let region = agent
        .register(HostBuffer::new(LEN as usize).unwrap())
        .unwrap();
    let peer = agent.connect(side.parse::<SocketAddr>().unwrap()).unwrap();
    let n = LEN / BLOCK;
    let ld: Vec<Desc> = (0..n)
        .map(|i| Desc::new(region.id(), i * BLOCK, BLOCK))
        .collect();
    let rd: Vec<Desc> = (0..n).map(|i| Desc::new(rid, i * BLOCK, BLOCK)).collect();
    let l = agent.prep_local(&ld).unwrap();
    let r = agent.prep_remote(&peer, &rd).unwrap();
    let x = agent.transfer_all(op, &l, &r, None, None).unwrap();
    println!("KVX STARTED");
    std::io::stdout().flush().unwrap();
    let _ = x.wait();
    // Killed before this, or soon after.
    std::thread::sleep(Duration::from_secs(60));
}

/// The next peer of [`initiator_sigkill`]: WRITE and READ four blocks to the target, then
/// say so (its process may then end as it will; the test judges that).
fn serve_after(side: SocketAddr, rid: RegionId, path: Path) {
    use std::io::Write;
    let agent = Agent::new(path.config(format!("after-{}", std::process::id()))).unwrap();
    let region = agent
        .register(HostBuffer::new(BLOCK as usize * 4).unwrap())
        .unwrap();
    let peer = agent.connect(side).unwrap();
    let d: Vec<Desc> = (0..4)
        .map(|i| Desc::new(region.id(), i * BLOCK, BLOCK))
        .collect();
    let rd: Vec<Desc> = (0..4).map(|i| Desc::new(rid, i * BLOCK, BLOCK)).collect();
    let l = agent.prep_local(&d).unwrap();
    let r = agent.prep_remote(&peer, &rd).unwrap();
    for op in [XferOp::Write, XferOp::Read] {
        let s = agent
            .transfer_all(op, &l, &r, None, Some(Duration::from_secs(10)))
            .unwrap()
            .wait()
            .unwrap();
        assert_eq!(s.bytes, 4 * BLOCK, "{op}");
        if matches!(path, Path::SameHost) {
            // Where UCX would emulate it through the target's FIFO, a WRITE takes the TCP
            // lane (the shm lane does not cover the target's private memory).
            let by_lane = op == XferOp::Write && common::ucx_1_13().is_some();
            let want = if by_lane { Lane::Tcp } else { Lane::Ucx };
            assert_eq!(s.lane, want, "{op} to a same-host peer's private memory");
        }
    }
    println!("KVX AFTER served");
    std::io::stdout().flush().unwrap();
}

/// [`initiator_child`] in a process of its own towards `target`: the initiator to kill, or
/// (`after`) the next peer, which [`serve_after`]s.
fn peer_process(target: &Peer, op: XferOp, path: Path, after: bool) -> Child {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["initiator_child", "--exact", "--ignored", "--nocapture"])
        .env("KVX_PD_SIDE", target.side.to_string())
        .env("KVX_PD_REGION", target.region.0.to_string())
        .env("KVX_PD_OP", format!("{op:?}"))
        .env("KVX_PD_PATH", format!("{path:?}"))
        .stdout(std::process::Stdio::piped());
    if after {
        c.env("KVX_PD_AFTER", "1");
    }
    c.spawn().unwrap()
}

/// User and system CPU time of process `pid`, in clock ticks (proc(5): fields 14 and 15).
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // The command name (field 2) may hold spaces; the fields after it are counted from its ')'.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

/// An initiator SIGKILLed while its 512 MiB transfer is under way, three times at different
/// points: the target (a kvxfer-bench process) lives on, serves the next initiator both ways
/// and, idle again, does not spin.
/// (UCX's own TCP transport fails this for READ on UCX 1.13 and 1.22, and for WRITE on 1.13:
/// the target aborts in `ucp_request.inl`, "unexpected error: Endpoint timeout". It is off
/// unless opted in, and `AgentConfig::check` refuses lanes off with tcp without the opt-in.)
fn initiator_sigkill(op: XferOp, path: Path) {
    use std::io::BufRead;
    let tag = format!("{op}-{path:?}-{}", std::process::id()).to_lowercase();
    let (lanes, transport, memory) = match path {
        Path::TcpLane => (true, "tcp", "host"),
        Path::UcxShm => (false, "shm", "host"),
        Path::SameHost => (true, "shm", "thp"),
    };
    let mut target = Peer::start_on(&format!("target-{tag}"), memory, lanes, transport);
    for round in 0..3 {
        let mut child = peer_process(&target, op, path, false);
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut l = String::new();
        while !l.contains("KVX STARTED") {
            l.clear();
            assert!(
                out.read_line(&mut l).unwrap() > 0,
                "the initiator ended early"
            );
        }
        std::thread::sleep(Duration::from_millis(20 + 60 * round));
        // SAFETY: kill(2) has no memory preconditions; the pid is our own child's.
        assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGKILL) }, 0);
        let _ = child.wait();
        std::thread::sleep(Duration::from_millis(500));
        let gone = target.child.try_wait().unwrap();
        assert!(
            gone.is_none(),
            "{tag} round {round}: the target ended ({gone:?}) after its initiator was killed"
        );
    }
    // It still serves, both ways, a peer in a process of its own (see below).
    let mut after = peer_process(&target, op, path, true);
    let mut out = String::new();
    std::io::Read::read_to_string(&mut after.stdout.take().unwrap(), &mut out).unwrap();
    let ended = after.wait().unwrap();
    assert!(
        out.contains("KVX AFTER served"),
        "{tag}: the next peer was not served ({ended:?}): {out}"
    );
    assert!(ended.success(), "{tag}: the served peer ended {ended:?}");
    // Alive, and not spinning: after all this the target is idle. (Where UCX stays "busy"
    // for good, the wedged target below, the progress loop spun a core until it slept
    // between such rounds with no transfer of its own: 500 of 500 ticks in 5 s, then 33.)
    let gone = target.child.try_wait().unwrap();
    assert!(gone.is_none(), "{tag}: the target ended ({gone:?})");
    let ticks = cpu_ticks(target.child.id());
    std::thread::sleep(Duration::from_secs(2));
    let used = cpu_ticks(target.child.id()) - ticks;
    assert!(
        used < 100,
        "{tag}: the idle target used {used} CPU ticks in 2 s (200: a core)"
    );
    let _ = target.cmd("QUIT");
}

#[test]
fn initiator_sigkilled_mid_write_over_the_tcp_lane() {
    initiator_sigkill(XferOp::Write, Path::TcpLane);
}

#[test]
fn initiator_sigkilled_mid_read_over_the_tcp_lane() {
    initiator_sigkill(XferOp::Read, Path::TcpLane);
}

#[test]
fn initiator_sigkilled_mid_write_over_ucx_shm() {
    // Debian's UCX 1.13 emulates a WRITE into user memory with active messages through the
    // target's shared-memory receive FIFO (UCX_PROTO_INFO: "software emulation |
    // sysv/memory"). A writer killed between reserving a slot (uct_mm_ep's CAS on the head)
    // and marking it written leaves the target waiting on that slot for good: it serves no
    // new peer over shared memory (its first WRITE missed a 10 s deadline, 2 runs of 2).
    // With the lanes off, that is what `ucx_emulated_shm` opts into (both ends here, the
    // bench's --ucx-only too), and Agent::new refuses it otherwise; with the lanes on, such a
    // WRITE takes a lane (the tests of private memory below). The 1.22 wheel moves it by CMA
    // and passes this; CI runs both.
    if let Some(v) = common::ucx_1_13() {
        eprintln!("skipped: UCX {v}: a writer's death wedges the shm target (open, see above)");
        return;
    }
    initiator_sigkill(XferOp::Write, Path::UcxShm);
}

#[test]
fn initiator_sigkilled_mid_read_over_ucx_shm() {
    initiator_sigkill(XferOp::Read, Path::UcxShm);
}

#[test]
fn initiator_sigkilled_mid_write_to_private_memory_in_host() {
    initiator_sigkill(XferOp::Write, Path::SameHost);
}

#[test]
fn initiator_sigkilled_mid_read_of_private_memory_in_host() {
    initiator_sigkill(XferOp::Read, Path::SameHost);
}

/// Lanes off with shared memory among the transports, on a UCX that emulates shared-memory
/// WRITEs through the target's FIFO (1.13), are refused unless opted in: a writer's death
/// would wedge its target (above). On the 1.22 wheel nothing is refused.
#[test]
fn lanes_off_with_shared_memory_need_the_opt_in_where_ucx_emulates_writes() {
    let emulates = common::ucx_1_13().is_some();
    for t in [
        Transport::Shm,
        Transport::Auto,
        Transport::Custom("posix,cma".into()),
    ] {
        let cfg = |opt_in: bool| {
            AgentConfig::new(format!("lanes-off-{}", std::process::id()))
                .transport(t.clone())
                .lanes(false)
                .peer_failure(Some(false))
                .ucx_emulated_shm(opt_in)
        };
        match Agent::new(cfg(false)) {
            Err(Error::InvalidArgument(m)) if emulates => {
                assert!(m.contains("ucx_emulated_shm"), "{t:?}: {m}");
                assert!(m.contains("receive FIFO"), "{t:?}: {m}");
                assert!(!m.contains("  "), "{t:?}: runs of spaces in {m:?}");
            }
            Ok(_) if !emulates => {}
            other => panic!(
                "{t:?}, UCX {}: lanes off without the opt-in gave {:?}",
                Agent::ucx_build_version(),
                other.map(|_| ())
            ),
        }
        Agent::new(cfg(true)).unwrap_or_else(|e| panic!("{t:?} opted in: {e}"));
    }
    // Lanes on: nothing to opt into.
    Agent::new(
        AgentConfig::new(format!("lanes-on-{}", std::process::id())).transport(Transport::Shm),
    )
    .unwrap();
}
