//! What a new user trips over first, each asserted on its meaning (not a full string): a
//! transport typo, a zero-length descriptor, a wait with nothing to wait for, a port that is
//! not kvxfer, a peer that accepts and says nothing, a shared-memory agent meeting a TCP one.

#![allow(clippy::unwrap_used)] // Tests fail loudly on purpose.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::time::{Duration, Instant};

use kvxfer::{Agent, AgentConfig, Desc, Error, HostBuffer, Transport};

fn agent(name: &str, t: Transport) -> Agent {
    let name = format!("{name}-{}", std::process::id());
    Agent::new(AgentConfig::new(name).transport(t).net_devices("lo")).unwrap()
}

#[test]
fn a_transport_typo_names_the_known_transports() {
    let e = Agent::new(AgentConfig::new("typo").transport(Transport::parse("tpc"))).unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
    assert!(
        text.contains("\"tpc\"") && text.contains("tcp, shm or auto"),
        "{text}"
    );
    assert!(!text.contains("ucp_init"), "{text}");
}

#[test]
fn a_ucx_start_failure_names_what_was_asked_and_what_the_host_has() {
    // UCX itself says only "No such device (-14)".
    // With UCX's TCP left out (the default) the TCP lane refuses the name itself.
    let e = Agent::new(
        AgentConfig::new("no-dev")
            .transport(Transport::Tcp)
            .net_devices("kvx-none"),
    )
    .unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
    assert!(
        text.contains("kvx-none") && text.contains("lo (127.0.0.1)"),
        "{text}"
    );
    let e = Agent::new(
        AgentConfig::new("no-dev")
            .transport(Transport::Tcp)
            .ucx_tcp(true)
            .net_devices("kvx-none"),
    )
    .unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, Error::UcxSetup { .. }), "{e:?}");
    assert!(
        text.contains("\"tcp\"") && text.contains("kvx-none") && text.contains("lo (127.0.0.1)"),
        "{text}"
    );
    let e = Agent::new(AgentConfig::new("no-rdma").transport(Transport::parse("rc"))).unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, Error::UcxSetup { .. }), "{e:?}");
    assert!(
        text.contains("\"rc\"") && text.contains("InfiniBand"),
        "{text}"
    );
}

#[test]
fn a_zero_length_descriptor_says_zero_length() {
    let a = agent("zero", Transport::Tcp);
    let r = a.register(HostBuffer::new(4096).unwrap()).unwrap();
    let e = a.prep_local(&[Desc::new(r.id(), 0, 0)]).unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("zero length") && !text.contains("outside"),
        "{text}"
    );
}

#[test]
fn waiting_for_a_notification_does_not_speak_of_a_transfer() {
    let a = agent("quiet", Transport::Tcp);
    let e = a.wait_notification(Duration::from_millis(20)).unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, Error::WaitTimeout(_)), "{e:?}");
    assert!(
        !text.contains("transfer") && text.contains("20ms"),
        "{text}"
    );
}

#[test]
fn a_port_that_is_not_kvxfer_is_named_as_such() {
    // An HTTP server as real ones are: it answers once it has read the request line (up to its
    // line end), then closes. Before the side channel's preamble ended its line, such a server
    // waited for more and the connect waited out the whole handshake time-out.
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let t = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut line = Vec::new();
        let mut b = [0u8; 1];
        while !line.ends_with(b"\n") && s.read(&mut b).unwrap_or(0) == 1 {
            line.push(b[0]);
        }
        let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n");
    });
    let a = agent("http", Transport::Tcp);
    let t0 = Instant::now();
    let e = a.connect(addr).unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("not a kvxfer side channel") && text.contains("HTTP/1.1"),
        "{text}"
    );
    assert!(!text.contains("bytes (limit"), "{text}");
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "named after {:?}, not at its first bytes",
        t0.elapsed()
    );
    t.join().unwrap();
}

#[test]
fn a_peer_that_accepts_and_says_nothing_times_out_and_says_so() {
    // The 10 s default is checked where the configuration's fields are visible
    // (agent/config.rs, `defaults_are_the_documented_ones`).
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let t = std::thread::spawn(move || {
        let (s, _) = l.accept().unwrap();
        std::thread::sleep(Duration::from_secs(3));
        drop(s);
    });
    let name = format!("silent-{}", std::process::id());
    let cfg = AgentConfig::new(name)
        .transport(Transport::Tcp)
        .net_devices("lo")
        .handshake_timeout(Duration::from_millis(500));
    let a = Agent::new(cfg).unwrap();
    let t0 = Instant::now();
    let e = a.connect(addr).unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("timed out after 500ms") && text.contains("handshake_timeout"),
        "{text}"
    );
    assert!(!text.contains("os error 11"), "{text}");
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(500) && took < Duration::from_millis(2500),
        "{took:?} for a 500 ms time-out"
    );
    t.join().unwrap();
}

#[test]
fn a_shared_memory_agent_meeting_a_tcp_agent_names_both_transports() {
    // With UCX's TCP opted in both sides expect UCX to connect them (without it, a peer UCX
    // cannot reach is loaded lane-only, and the lanes carry).
    let ucx = |name: &str, t: Transport| {
        let name = format!("{name}-{}", std::process::id());
        let c = AgentConfig::new(name).transport(t).net_devices("lo");
        Agent::new(c.ucx_tcp(true)).unwrap()
    };
    let shm = ucx("tr-shm", Transport::Shm);
    let tcp = ucx("tr-tcp", Transport::Tcp);
    let ra = shm.register(HostBuffer::new(4096).unwrap()).unwrap();
    let rb = tcp.register(HostBuffer::new(4096).unwrap()).unwrap();
    let addr = tcp.listen("127.0.0.1:0").unwrap();
    let r = shm.connect(addr).and_then(|peer| {
        let l = shm.prep_local(&[Desc::new(ra.id(), 0, 4096)])?;
        let rr = shm.prep_remote(&peer, &[Desc::new(rb.id(), 0, 4096)])?;
        shm.transfer_all(
            kvxfer::XferOp::Write,
            &l,
            &rr,
            None,
            Some(Duration::from_secs(5)),
        )?
        .wait()
    });
    let e = r.unwrap_err();
    let text = e.to_string();
    println!("{text}");
    assert!(
        text.contains("transport") && text.contains("shm") && text.contains("tcp"),
        "{text}"
    );
    assert!(!text.contains("Destination is unreachable"), "{text}");
}

/// The other UCX than the one this test was built against, where it is on this machine:
/// Debian's for a build against the 1.22 wheel, the wheel's for a build against Debian's.
fn other_ucx_libdir() -> Option<std::path::PathBuf> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let built = Agent::ucx_build_version();
    let dir = if built.starts_with("1.13") {
        root.join(".ucx/1.22.0/libucx/lib")
    } else {
        std::path::PathBuf::from("/usr/lib/x86_64-linux-gnu")
    };
    dir.join("libucp.so.0").exists().then_some(dir)
}

#[test]
fn an_agent_on_another_ucx_than_its_build_is_a_clear_error() {
    if std::env::var_os("KVX_FIRST_HOUR_CHILD").is_some() {
        match Agent::new(AgentConfig::new("mismatch").transport(Transport::Tcp)) {
            Ok(a) => println!("AGENT OK on UCX {}", a.ucx_version()),
            Err(e) => println!("AGENT ERROR {e}"),
        }
        return;
    }
    let Some(dir) = other_ucx_libdir() else {
        println!("SKIP: no second UCX here to load against this build");
        return;
    };
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "an_agent_on_another_ucx_than_its_build_is_a_clear_error",
        ])
        .args(["--nocapture", "--test-threads=1"])
        .env("KVX_FIRST_HOUR_CHILD", "1")
        .env("LD_LIBRARY_PATH", &dir)
        .env("UCX_LOG_LEVEL", "error")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find_map(|l| l.find("AGENT ").map(|i| &l[i..]))
        .unwrap_or("");
    println!("{line}");
    if line.starts_with("AGENT OK") {
        // The loader kept the build's UCX (an rpath it honours over LD_LIBRARY_PATH): the
        // other half of the rule, downstream binaries find the UCX they were built with.
        assert!(
            line.contains(Agent::ucx_build_version().rsplit_once('.').unwrap().0),
            "{line}"
        );
        return;
    }
    assert!(
        line.contains("built against UCX") && line.contains("loaded UCX"),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn ucx_does_not_print_errors_that_kvxfer_reports_typed() {
    // The transport-mismatch case in a child without UCX_LOG_LEVEL: UCX logs an ERROR there
    // ("no active messages transport"), which must reach `log`, not stderr.
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_shared_memory_agent_meeting_a_tcp_agent_names_both_transports",
        ])
        .args(["--nocapture", "--test-threads=1"])
        .env_remove("UCX_LOG_LEVEL")
        .output()
        .unwrap();
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{all}");
    assert!(all.contains("no transport in common"), "{all}");
    assert!(!all.contains("UCX  ERROR"), "UCX printed on stderr:\n{all}");
}

#[test]
fn a_host_name_is_an_address() {
    let a = agent("named-a", Transport::Tcp);
    let b = agent("named-b", Transport::Tcp);
    let addr = a.listen("localhost:0").unwrap();
    assert!(addr.ip().is_loopback(), "{addr}");
    assert_eq!(
        b.connect(format!("localhost:{}", addr.port())).unwrap(),
        a.name()
    );
    let e = b.connect("no-such-host.invalid:1").unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
    assert!(e.to_string().contains("does not resolve"), "{e}");
}

#[test]
fn sourcing_ucx_env_leaves_the_users_target_dir_alone() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let probe = |pre: &str| {
        let out = std::process::Command::new("bash")
            .arg("-c")
            .arg(format!(
                "{pre} source scripts/ucx-env.sh >/dev/null 2>&1; echo \"[${{CARGO_TARGET_DIR-unset}}]\""
            ))
            .current_dir(&root)
            .env_remove("CARGO_TARGET_DIR")
            .env_remove("KVXFER_SPLIT_TARGET")
            .env("KVXFER_UCX", "system")
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    assert_eq!(probe(""), "[unset]");
    assert_eq!(probe("export CARGO_TARGET_DIR=/tmp/mine;"), "[/tmp/mine]");
    assert!(probe("KVXFER_SPLIT_TARGET=1").ends_with("target/ucx-system]"));
}
