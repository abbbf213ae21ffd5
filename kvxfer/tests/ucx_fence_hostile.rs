//! The UCX fence against a hostile owner (issue 34): an owner that speaks raw UCX to a kvxfer
//! initiator and sends it what it likes. A REFUSED for an entry it welcomed already (or for
//! a token never drawn) changes nothing; a closed entry of the initiator's costs it at most
//! one endpoint made for the owner, whatever the owner sends: a flood of GONEs naming it is
//! answered once (GONE_ACK and BYE), and the rest are dropped.
//!
//! The owner is this test binary again (`hostile_owner_child`): one UCX worker over shared
//! memory, driven by lines on its stdin. It presents a real agent's metadata (its regions'
//! keys) under its own name and worker address.
#![allow(clippy::unwrap_used)] // Tests fail loudly on purpose.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvxfer::{Agent, AgentConfig, Desc, HostBuffer, RegionId, Transport, XferOp};
use kvxfer_proto::wire::metadata::Metadata;
use kvxfer_proto::wire::ucx_fence::{FenceMsg, Refusal};

const LEN: usize = 1 << 16;
/// The fence's active-message id (`backend/ucx/fence_state.rs`).
const AM_FENCE: u32 = 0x4b59;

fn hex(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap())
        .collect()
}

fn config(name: &str) -> AgentConfig {
    AgentConfig::new(name)
        .transport(Transport::Shm)
        .lanes(false)
}

/// The hostile owner's process, and the lines it says.
struct Hostile {
    child: Child,
    tell: ChildStdin,
    says: BufReader<ChildStdout>,
}

impl Hostile {
    fn start() -> Hostile {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "hostile_owner_child", "--ignored", "--nocapture"])
            .env("KVX_HOSTILE_OWNER", "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let tell = child.stdin.take().unwrap();
        let says = BufReader::new(child.stdout.take().unwrap());
        Hostile { child, tell, says }
    }

    /// The next line starting with `prefix`, less the prefix.
    fn said(&mut self, prefix: &str) -> String {
        let mut l = String::new();
        loop {
            l.clear();
            assert!(
                self.says.read_line(&mut l).unwrap() > 0,
                "the hostile owner ended before saying {prefix:?}"
            );
            if let Some(rest) = l.trim_end().strip_prefix(prefix) {
                return rest.to_string();
            }
        }
    }

    fn tell(&mut self, line: &str) {
        writeln!(self.tell, "{line}").unwrap();
        self.tell.flush().unwrap();
    }
}

impl Drop for Hostile {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An owner that welcomed an initiator says REFUSED after all: ignored. The initiator
/// closes its entry, and the owner sends 200 GONEs for it: the initiator answers the first (a GONE_ACK and a BYE, over an endpoint made for them) and
/// drops the rest, and still serves its other peers.
#[test]
fn a_hostile_owners_late_refusals_and_gone_floods_change_nothing() {
    // A real agent's regions and keys, presented by the hostile owner as its own.
    let real = Agent::new(config("real")).unwrap();
    let r = real.register(HostBuffer::new(LEN).unwrap()).unwrap();
    r.write(0, &vec![0x5a; LEN]).unwrap();
    let mut meta = Metadata::decode(&real.metadata().unwrap(), real.compat()).unwrap();
    let mut hostile = Hostile::start();
    meta.name = "hostile".into();
    meta.epoch ^= 0x5eed;
    meta.worker_addr = unhex(&hostile.said("WORKER "));
    let region = hostile.said("REGION ");
    let (base, rkey) = region.split_once(' ').unwrap();
    meta.regions.truncate(1);
    meta.regions[0].base = base.parse().unwrap();
    meta.regions[0].rkey = unhex(rkey);
    meta.regions[0].shm = None;
    let a = Agent::new(config("initiator")).unwrap();
    let local = a.register(HostBuffer::new(LEN).unwrap()).unwrap();
    let name = a.load_remote_metadata(&meta.encode()).unwrap();
    // Connecting announces the initiator (HELLO); the hostile owner welcomes it.
    a.peer_info(&name).unwrap();
    let hello = hostile.said("HELLO ");
    eprintln!("the hostile owner got a HELLO: {hello}");
    // A READ posts only after the WELCOME: the entry is welcomed once it is done.
    let l = a
        .prep_local(&[Desc::new(local.id(), 0, LEN as u64)])
        .unwrap();
    let rr = a
        .prep_remote(&name, &[Desc::new(RegionId(0), 0, LEN as u64)])
        .unwrap();
    a.transfer_all(XferOp::Read, &l, &rr, None, Some(Duration::from_secs(10)))
        .unwrap()
        .wait()
        .unwrap();
    let mut bytes = vec![0u8; LEN];
    local.read(0, &mut bytes).unwrap();
    assert!(
        bytes.iter().all(|&b| b == 0x77),
        "READ bytes from the hostile owner"
    );
    // A REFUSED for an entry already welcomed (and for tokens never drawn) changes nothing:
    // the next READ posts at once.
    hostile.tell("REFUSE");
    hostile.said("REFUSED");
    std::thread::sleep(Duration::from_millis(100));
    local.write(0, &vec![0; LEN]).unwrap();
    let again = a
        .transfer_all(XferOp::Read, &l, &rr, None, Some(Duration::from_secs(5)))
        .and_then(|x| x.wait());
    assert!(
        again.is_ok(),
        "a READ after REFUSEDs for a welcomed entry: {again:?}"
    );
    local.read(0, &mut bytes).unwrap();
    assert!(
        bytes.iter().all(|&b| b == 0x77),
        "READ bytes after the REFUSEDs"
    );
    // Closed with nothing in flight: BYE, and the entry remembered for one answer.
    a.remove_peer(&name).unwrap();
    hostile.tell("GONE 200");
    let got = hostile.said("GOT ");
    eprintln!("after 200 GONEs for the closed entry, the hostile owner got: {got}");
    let mut w = got.split(' ').map(|n| n.parse::<usize>().unwrap());
    let (acks, byes) = (w.next().unwrap(), w.next().unwrap());
    assert_eq!(acks, 1, "GONE_ACKs for one closed entry (BYEs {byes})");
    assert!(byes <= 2, "{byes} BYEs for one closed entry");
    // The initiator still serves a good owner.
    let good = Agent::new(config("good")).unwrap();
    let g = good.register(HostBuffer::new(LEN).unwrap()).unwrap();
    g.write(0, &vec![0x33; LEN]).unwrap();
    let gname = a.load_remote_metadata(&good.metadata().unwrap()).unwrap();
    let gr = a
        .prep_remote(&gname, &[Desc::new(g.id(), 0, LEN as u64)])
        .unwrap();
    a.transfer_all(XferOp::Read, &l, &gr, None, Some(Duration::from_secs(10)))
        .unwrap()
        .wait()
        .unwrap();
    local.read(0, &mut bytes).unwrap();
    assert!(
        bytes.iter().all(|&b| b == 0x33),
        "READ bytes from the good owner"
    );
}

/// Fence messages the hostile owner's worker received, in order.
static GOT: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());

unsafe extern "C" fn record_am(
    _arg: *mut std::ffi::c_void,
    _header: *const std::ffi::c_void,
    _header_len: usize,
    data: *mut std::ffi::c_void,
    len: usize,
    _param: *const kvxfer_sys::ucp_am_recv_param_t,
) -> kvxfer_sys::ucs_status_t {
    if !data.is_null() {
        // SAFETY: UCX passes `len` readable bytes at `data` for the callback's duration (eager
        // messages: the initiator sends every fence message so).
        let b = unsafe { std::slice::from_raw_parts(data as *const u8, len) };
        GOT.lock().unwrap().push(b.to_vec());
    }
    kvxfer_sys::ucs_status_t::UCS_OK
}

/// The hostile owner's process (run by [`Hostile::start`]; ignored otherwise): says its
/// worker's address (`WORKER`) and region (`REGION base rkey`), answers the first HELLO
/// with a WELCOME (`HELLO token`), on `REFUSE` sends REFUSEDs for that token and others
/// (`REFUSED`), then on `GONE n` sends n GONEs for that token, waits a second, and says how
/// many GONE_ACKs and BYEs came (`GOT acks byes`).
#[test]
#[ignore = "the hostile owner's own process, started by the tests here"]
// bindgen's constant types differ between UCX versions (as in `raw.rs`).
#[allow(clippy::unnecessary_cast)]
fn hostile_owner_child() {
    use kvxfer_sys as sys;
    use std::ptr;
    if std::env::var("KVX_HOSTILE_OWNER").is_err() {
        return;
    }
    // SAFETY: fcntl on this process's own stdin; no memory is passed.
    unsafe {
        let fl = libc::fcntl(0, libc::F_GETFL);
        libc::fcntl(0, libc::F_SETFL, fl | libc::O_NONBLOCK);
    }
    let progress_for = |worker: sys::ucp_worker_h, d: Duration| {
        let t = Instant::now();
        while t.elapsed() < d {
            // SAFETY: the worker is live, made below, used on this thread only.
            unsafe { sys::ucp_worker_progress(worker) };
        }
    };
    // SAFETY: plain UCX calls in order, each on live handles made here, on this thread only;
    // every out pointer is a live local; the strings and addresses outlive the calls that
    // read them; the worker's address is read (`address_length` bytes) before it is
    // released; each send's bytes live until its request completes (progressed before the
    // next send).
    unsafe {
        let mut cfg: *mut sys::ucp_config_t = ptr::null_mut();
        assert_eq!(
            sys::ucp_config_read(ptr::null(), ptr::null(), &mut cfg),
            sys::ucs_status_t::UCS_OK
        );
        let (k, v) = (c"TLS", c"sm");
        assert_eq!(
            sys::ucp_config_modify(cfg, k.as_ptr(), v.as_ptr()),
            sys::ucs_status_t::UCS_OK
        );
        let params = sys::ucp_params_t {
            field_mask: sys::UCP_PARAM_FIELD_FEATURES as u64,
            features: (sys::UCP_FEATURE_AM | sys::UCP_FEATURE_RMA) as u64,
            ..Default::default()
        };
        let mut ctx: sys::ucp_context_h = ptr::null_mut();
        assert_eq!(
            sys::ucp_init(&params, cfg, &mut ctx),
            sys::ucs_status_t::UCS_OK
        );
        sys::ucp_config_release(cfg);
        let wp = sys::ucp_worker_params_t {
            field_mask: sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE as u64,
            thread_mode: sys::UCS_THREAD_MODE_SINGLE,
            ..Default::default()
        };
        let mut worker: sys::ucp_worker_h = ptr::null_mut();
        assert_eq!(
            sys::ucp_worker_create(ctx, &wp, &mut worker),
            sys::ucs_status_t::UCS_OK
        );
        let hp = sys::ucp_am_handler_param_t {
            field_mask: (sys::UCP_AM_HANDLER_PARAM_FIELD_ID | sys::UCP_AM_HANDLER_PARAM_FIELD_CB)
                as u64,
            id: AM_FENCE,
            cb: Some(record_am),
            ..Default::default()
        };
        assert_eq!(
            sys::ucp_worker_set_am_recv_handler(worker, &hp),
            sys::ucs_status_t::UCS_OK
        );
        let mut attr = sys::ucp_worker_attr_t {
            field_mask: sys::UCP_WORKER_ATTR_FIELD_ADDRESS as u64,
            ..Default::default()
        };
        assert_eq!(
            sys::ucp_worker_query(worker, &mut attr),
            sys::ucs_status_t::UCS_OK
        );
        let mine = std::slice::from_raw_parts(attr.address as *const u8, attr.address_length);
        println!("WORKER {}", hex(mine));
        sys::ucp_worker_release_address(worker, attr.address);
        // Its one region (the initiator READs it, once welcomed), mapped for the process's life.
        let region: &'static mut [u8] = Vec::leak(vec![0x77u8; LEN]);
        let mp = sys::ucp_mem_map_params_t {
            field_mask: (sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH)
                as u64,
            address: region.as_mut_ptr() as *mut std::ffi::c_void,
            length: LEN,
            ..Default::default()
        };
        let mut memh: sys::ucp_mem_h = ptr::null_mut();
        assert_eq!(
            sys::ucp_mem_map(ctx, &mp, &mut memh),
            sys::ucs_status_t::UCS_OK
        );
        let mut rkey: *mut std::ffi::c_void = ptr::null_mut();
        let mut rkey_len = 0usize;
        assert_eq!(
            sys::ucp_rkey_pack(ctx, memh, &mut rkey, &mut rkey_len),
            sys::ucs_status_t::UCS_OK
        );
        println!(
            "REGION {} {}",
            region.as_ptr() as u64,
            hex(std::slice::from_raw_parts(rkey as *const u8, rkey_len))
        );
        sys::ucp_rkey_buffer_release(rkey);
        std::io::stdout().flush().unwrap();
        // The first HELLO.
        let (token, initiator) = loop {
            sys::ucp_worker_progress(worker);
            let hello = GOT
                .lock()
                .unwrap()
                .iter()
                .find_map(|m| match FenceMsg::decode(m) {
                    Some(FenceMsg::Hello { token, worker, .. }) => Some((token, worker)),
                    _ => None,
                });
            if let Some(h) = hello {
                break h;
            }
        };
        let ep_params = sys::ucp_ep_params_t {
            field_mask: sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS as u64,
            address: initiator.as_ptr() as *const sys::ucp_address_t,
            ..Default::default()
        };
        let mut ep: sys::ucp_ep_h = ptr::null_mut();
        assert_eq!(
            sys::ucp_ep_create(worker, &ep_params, &mut ep),
            sys::ucs_status_t::UCS_OK
        );
        let send = |msg: FenceMsg| {
            let b = msg.encode();
            let p = sys::ucp_request_param_t {
                op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS as u32,
                flags: sys::UCP_AM_SEND_FLAG_EAGER as u32,
                ..Default::default()
            };
            let req = sys::ucp_am_send_nbx(
                ep,
                AM_FENCE,
                ptr::null(),
                0,
                b.as_ptr() as *const std::ffi::c_void,
                b.len(),
                &p,
            );
            assert!(!sys::ucs_ptr_is_err(req), "{:?}", sys::ucs_ptr_status(req));
            if sys::ucs_ptr_is_ptr(req) {
                while sys::ucp_request_check_status(req) == sys::ucs_status_t::UCS_INPROGRESS {
                    sys::ucp_worker_progress(worker);
                }
                sys::ucp_request_free(req);
            }
        };
        let ack = 0xac4_0000_u64;
        send(FenceMsg::Welcome {
            token,
            ack,
            gone: Vec::new(),
        });
        println!("HELLO {token:x}");
        std::io::stdout().flush().unwrap();
        // Progress (the initiator's READs, its BYE) until told; REFUSEs meanwhile.
        let mut line = Vec::new();
        let n: usize = loop {
            progress_for(worker, Duration::from_millis(1));
            let mut b = [0u8; 64];
            match std::io::stdin().read(&mut b) {
                Ok(0) => return,
                Ok(k) => line.extend_from_slice(&b[..k]),
                Err(_) => {}
            }
            let Some(end) = line.iter().position(|&c| c == b'\n') else {
                continue;
            };
            let cmd = String::from_utf8_lossy(&line[..end]).to_string();
            line.drain(..=end);
            if cmd == "REFUSE" {
                // For the welcomed entry, for tokens never drawn, and with each reason.
                for t in [token, token ^ 1, 0, u64::MAX] {
                    for why in [Refusal::Full, Refusal::Descriptors] {
                        send(FenceMsg::Refused { token: t, why });
                    }
                }
                println!("REFUSED");
                std::io::stdout().flush().unwrap();
                continue;
            }
            break cmd.strip_prefix("GONE ").unwrap().parse().unwrap();
        };
        let before = GOT.lock().unwrap().len();
        for _ in 0..n {
            send(FenceMsg::Gone { token, region: 0 });
        }
        progress_for(worker, Duration::from_secs(1));
        let got = GOT.lock().unwrap();
        let after = &got[before..];
        let acks = after
            .iter()
            .filter(|m| matches!(FenceMsg::decode(m), Some(FenceMsg::GoneAck { ack: a, .. }) if a == ack))
            .count();
        let byes = after
            .iter()
            .filter(|m| matches!(FenceMsg::decode(m), Some(FenceMsg::Bye { ack: a }) if a == ack))
            .count();
        println!("GOT {acks} {byes}");
        std::io::stdout().flush().unwrap();
        // Kept alive until the test ends (stdin closes or the process is killed).
        loop {
            progress_for(worker, Duration::from_millis(10));
            if matches!(std::io::stdin().read(&mut [0u8; 1]), Ok(0)) {
                return;
            }
        }
    }
}
