//! A peer killed with SIGKILL in the middle of a transfer (READ and WRITE, over kvxfer's TCP
//! lane and over UCX): the initiator gets a typed error well before its deadline, its memory
//! is released, it keeps serving another peer, and a restarted peer with the same name
//! reconnects (the stale metadata is replaced).

#![allow(clippy::unwrap_used)] // Tests fail loudly on purpose.

mod common;

use std::net::SocketAddr;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use kvxfer::{Agent, AgentConfig, Desc, Error, HostBuffer, RegionId, Transport, XferOp};

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
}

impl Path {
    fn parse(s: &str) -> Path {
        match s {
            "TcpLane" => Path::TcpLane,
            _ => Path::UcxShm,
        }
    }

    fn config(self, name: String) -> AgentConfig {
        let c = AgentConfig::new(name).net_devices("lo");
        match self {
            Path::TcpLane => c.transport(Transport::Tcp),
            Path::UcxShm => c.transport(Transport::Shm).lanes(false),
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
    let (lanes, transport) = match path {
        Path::TcpLane => (true, "tcp"),
        Path::UcxShm => (false, "shm"),
    };
    let mut target = Peer::start_on(&format!("target-{tag}"), "host", lanes, transport);
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
    // Open on Debian's UCX 1.13: after a writer is killed, the target serves no new peer over
    // shared memory (its first WRITE missed a 10 s deadline, 2 runs of 2; run in this
    // process, it was served and then aborted when its worker went, ucp_request.c:684, 3 of
    // 3). Likely the target's receive FIFO: a sender reserves a slot (uct_mm_ep's CAS on the
    // head) and marks it written later; killed in between, the slot is never marked and
    // the reader waits on it for good. The 1.22 wheel passes this; CI runs both.
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
