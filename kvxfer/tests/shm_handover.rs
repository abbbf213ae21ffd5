//! The shm lane takes memory files only as handed over (issue 34, part 3): a same-host peer's
//! socket gives them with `SCM_RIGHTS`, to an asker of the same user (`SO_PEERCRED`) that
//! presents the token from the peer's metadata; the asker takes them only from the process
//! the metadata names, and maps only sealed memfds of its user, read-only until a WRITE.
//! Each test below says which of these checks it is about.
#![allow(clippy::unwrap_used)] // Tests fail loudly on purpose.

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::{SocketAddr, UnixListener};
use std::process::Command;
use std::time::Duration;

use kvxfer::{Agent, Desc, HostBuffer, RegionId, XferOp};
use kvxfer_proto::types::ShmHandle;
use kvxfer_proto::wire::lane_entries::{shm_of, LaneEntry, ShmLaneInfo, LANE_SHM};
use kvxfer_proto::wire::metadata::Metadata;
use kvxfer_proto::wire::shm_fds::{FdAsk, FdEntry, FdFrame};

const LEN: usize = 1 << 20;

/// One test at a time: they count the process's mappings.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[path = "support/fds.rs"]
mod fds;
use fds::send_fds;
#[path = "support/same_host.rs"]
mod same_host;
use same_host::agent;

fn meta_of(a: &Agent) -> Metadata {
    Metadata::decode(&a.metadata().unwrap(), a.compat()).unwrap()
}

/// A WRITE of 1 MiB of 0x22 from a fresh agent `victim` into region 0 of the peer `meta`
/// describes: the peer mappings it made, and the transfer's lane or error.
fn write_into(meta: &Metadata) -> (usize, Result<kvxfer::Lane, kvxfer::Error>) {
    let a = agent("victim");
    let before = kvxfer::live::live().peer_mappings;
    let peer = a.load_remote_metadata(&meta.encode()).unwrap();
    let mapped = kvxfer::live::live().peer_mappings - before;
    let src = a.register(HostBuffer::new(LEN).unwrap()).unwrap();
    src.write(0, &vec![0x22u8; LEN]).unwrap();
    let l = a.prep_local(&[Desc::new(src.id(), 0, LEN as u64)]).unwrap();
    let r = a
        .prep_remote(&peer, &[Desc::new(RegionId(0), 0, LEN as u64)])
        .unwrap();
    let moved = a
        .transfer_all(XferOp::Write, &l, &r, None, Some(Duration::from_secs(10)))
        .and_then(|t| t.wait())
        .map(|s| s.lane);
    (mapped, moved)
}

/// The pid check: metadata whose socket and token are the peer's own but whose pid names
/// another process (here a `sleep`) gets nothing handed over, so nothing mapped; the WRITE
/// goes by another lane.
#[test]
fn a_peer_naming_another_pid_gets_nothing_mapped() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut other = Command::new("sleep").arg("60").spawn().unwrap();
    let b = agent("claimer");
    let _region = b.register(HostBuffer::new(LEN).unwrap()).unwrap();
    let honest = meta_of(&b);
    let (mapped, lane) = write_into(&honest);
    assert_eq!(
        (mapped, lane.as_ref().ok()),
        (1, Some(&kvxfer::Lane::Shm)),
        "the honest metadata: {lane:?}"
    );
    let mut lying = honest;
    lying.host.as_mut().unwrap().pid = other.id();
    let (mapped, lane) = write_into(&lying);
    let _ = other.kill();
    let _ = other.wait();
    eprintln!(
        "metadata naming pid {}: {mapped} mapped, WRITE {lane:?}",
        other.id()
    );
    assert_eq!(mapped, 0, "a socket of another pid handed its files over");
    assert_ne!(lane.ok(), Some(kvxfer::Lane::Shm));
}

/// A socket of this process that hands over `file` as region 0, to one asker; with `drip`,
/// one byte of its answer at a time, that long apart.
fn impostor(
    file: std::fs::File,
    drip: Option<Duration>,
) -> (ShmLaneInfo, std::thread::JoinHandle<()>) {
    let info = ShmLaneInfo {
        socket: *b"kvx-test-impost\0",
        token: [7; 32],
    };
    let addr = SocketAddr::from_abstract_name(info.socket_name().as_bytes()).unwrap();
    let l = UnixListener::bind_addr(&addr).unwrap();
    let t = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut ask = [0u8; 37];
        s.read_exact(&mut ask).unwrap();
        let frame = FdFrame::Batch(vec![FdEntry {
            region: 0,
            len: LEN as u64,
        }]);
        let Some(gap) = drip else {
            send_fds(&s, &frame.encode(), &[file.as_raw_fd()]);
            s.write_all(&FdFrame::End.encode()).unwrap();
            let _ = s.read(&mut [0u8; 1]);
            return;
        };
        let mut bytes = frame.encode();
        bytes.extend(FdFrame::End.encode());
        send_fds(&s, &bytes[..1], &[file.as_raw_fd()]);
        for b in &bytes[1..] {
            std::thread::sleep(gap);
            if s.write_all(&[*b]).is_err() {
                return;
            }
        }
    });
    (info, t)
}

/// The memfd and seal checks: a socket of the right process (this one) that hands over a
/// file on disk, or an unsealed memfd, gets nothing mapped, and the WRITE does not land in
/// the file.
#[test]
fn a_handed_over_file_that_is_not_a_sealed_memfd_is_not_mapped() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!("kvx-shm-handover-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("precious");
    std::fs::write(&path, vec![0x11u8; LEN]).unwrap();
    // SAFETY: memfd_create takes a NUL-terminated name and flags; returns a new fd or -1.
    let raw = unsafe { libc::memfd_create(c"kvx-unsealed".as_ptr(), 0) };
    assert!(raw >= 0);
    // SAFETY: raw is a fresh descriptor nothing else owns.
    let unsealed: std::fs::File = unsafe { std::os::fd::FromRawFd::from_raw_fd(raw) };
    unsealed.set_len(LEN as u64).unwrap();

    let b = agent("claimer");
    let _region = b.register(HostBuffer::new(LEN).unwrap()).unwrap();
    for (what, file) in [
        (
            "a file on disk",
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .unwrap(),
        ),
        ("an unsealed memfd", unsealed.try_clone().unwrap()),
    ] {
        let st = file.metadata().unwrap();
        let (info, server) = impostor(file, None);
        let mut meta = meta_of(&b);
        meta.lanes.retain(|e| e.lane != LANE_SHM);
        meta.lanes.push(LaneEntry::shm(&info));
        meta.host.as_mut().unwrap().pid = std::process::id();
        meta.regions[0].shm = Some(ShmHandle {
            fd: 0,
            dev: st.dev(),
            ino: st.ino(),
        });
        let (mapped, lane) = write_into(&meta);
        server.join().unwrap();
        eprintln!("{what} handed over: {mapped} mapped, WRITE {lane:?}");
        assert_eq!(mapped, 0, "{what} was mapped");
        assert_ne!(lane.ok(), Some(kvxfer::Lane::Shm));
    }
    let on_disk = std::fs::read(&path).unwrap();
    let mut in_memfd = vec![0u8; LEN];
    std::os::unix::fs::FileExt::read_exact_at(&unsealed, &mut in_memfd, 0).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        on_disk.iter().all(|&x| x == 0x11),
        "the WRITE landed in the file"
    );
    assert!(
        in_memfd.iter().all(|&x| x == 0),
        "the WRITE landed in the memfd"
    );
}

/// The first frame's kind and count the socket `info` answers `token` with, as `uid` (None:
/// this process's own). The other user's asker is a forked child that sets its uid and only
/// makes system calls; its exit status is the answer's kind.
fn ask(info: &ShmLaneInfo, token: [u8; 32], uid: Option<u32>) -> (u8, u16) {
    let name = info.socket_name();
    let ask = FdAsk { token }.encode();
    // SAFETY: an all-zero sockaddr_un is valid; the abstract name (a leading NUL) is copied
    // in below, well inside sun_path.
    let mut sa: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    sa.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, s) in sa.sun_path[1..].iter_mut().zip(name.bytes()) {
        *d = s as libc::c_char;
    }
    let sa_len = (std::mem::size_of::<libc::sa_family_t>() + 1 + name.len()) as libc::socklen_t;
    let talk = || -> (u8, u16) {
        let mut head = [0u8; 3];
        // SAFETY: plain system calls on a socket this closure opens and closes, with
        // buffers that live across them; no allocation (a forked child may run this).
        unsafe {
            let s = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
            if s < 0
                || libc::connect(s, (&sa as *const libc::sockaddr_un).cast(), sa_len) != 0
                || libc::write(s, ask.as_ptr().cast(), ask.len()) != ask.len() as isize
                || libc::read(s, head.as_mut_ptr().cast(), 3) != 3
            {
                return (0, 0);
            }
            libc::close(s);
        }
        (head[0], u16::from_le_bytes([head[1], head[2]]))
    };
    let Some(uid) = uid else {
        return talk();
    };
    // SAFETY: the child makes only async-signal-safe system calls (setuid, socket, connect,
    // write, read, close, _exit) on memory prepared before the fork.
    unsafe {
        let pid = libc::fork();
        assert!(pid >= 0);
        if pid == 0 {
            if libc::setuid(uid) != 0 {
                libc::_exit(100);
            }
            libc::_exit(i32::from(talk().0));
        }
        let mut status = 0;
        libc::waitpid(pid, &mut status, 0);
        assert!(libc::WIFEXITED(status));
        (libc::WEXITSTATUS(status) as u8, 0)
    }
}

/// The token check: an asker of this user with the wrong token is refused (kind 3) and
/// handed no descriptor; the right token gets a batch (kind 1) of two: the registration page
/// and the one region.
#[test]
fn a_wrong_token_is_refused() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let b = agent("owner");
    let _region = b.register(HostBuffer::new(LEN).unwrap()).unwrap();
    let info = shm_of(&meta_of(&b).lanes).unwrap();
    let mut wrong = info.token;
    wrong[31] ^= 1;
    // The registration page and the one region.
    assert_eq!(ask(&info, info.token, None), (1, 2), "the right token");
    let (kind, _) = ask(&info, wrong, None);
    assert_eq!(kind, 3, "the wrong token got frame kind {kind}");
}

/// The user check: an asker of another user (uid 65534), with the right token, is refused.
/// Needs root to take another uid; otherwise says so and checks nothing.
#[test]
fn an_asker_of_another_user_is_refused() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIP: not root, so no asker of another user can be made");
        return;
    }
    let b = agent("owner");
    let _region = b.register(HostBuffer::new(LEN).unwrap()).unwrap();
    let info = shm_of(&meta_of(&b).lanes).unwrap();
    let (kind, _) = ask(&info, info.token, Some(65534));
    assert_ne!(kind, 100, "the child could not take uid 65534");
    assert_eq!(
        kind, 3,
        "uid 65534 with the right token got frame kind {kind}"
    );
    assert_eq!(ask(&info, info.token, None).0, 1, "this user's asker");
}

/// The permissions of this process's mappings of the file with inode `ino`.
fn mappings_of(ino: u64) -> Vec<String> {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.split_whitespace().nth(4) == Some(&ino.to_string()))
        .map(|l| l.split_whitespace().nth(1).unwrap().to_string())
        .collect()
}

/// Read-only until written: a peer that only READs a region maps it read-only (a stray store
/// through it would fault, not land); its first WRITE makes that mapping writable.
#[test]
fn a_region_only_read_is_mapped_read_only() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let b = agent("owner");
    let _region = b.register(HostBuffer::new(LEN).unwrap()).unwrap();
    let meta = meta_of(&b);
    let ino = meta.regions[0].shm.unwrap().ino;
    let a = agent("reader");
    let peer = a.load_remote_metadata(&meta.encode()).unwrap();
    let dst = a.register(HostBuffer::new(LEN).unwrap()).unwrap();
    let l = a.prep_local(&[Desc::new(dst.id(), 0, LEN as u64)]).unwrap();
    let r = a
        .prep_remote(&peer, &[Desc::new(RegionId(0), 0, LEN as u64)])
        .unwrap();
    let go = |op| {
        a.transfer_all(op, &l, &r, None, Some(Duration::from_secs(10)))
            .and_then(|t| t.wait())
            .unwrap()
            .lane
    };
    assert_eq!(go(XferOp::Read), kvxfer::Lane::Shm);
    let after_read = mappings_of(ino);
    assert_eq!(go(XferOp::Write), kvxfer::Lane::Shm);
    let after_write = mappings_of(ino);
    eprintln!("the owner's and the reader's mappings: after a READ {after_read:?}, after a WRITE {after_write:?}");
    assert_eq!(after_read.len(), 2, "{after_read:?}");
    assert!(after_read.iter().any(|p| p == "r--s"), "{after_read:?}");
    assert!(after_write.iter().all(|p| p == "rw-s"), "{after_write:?}");
}

/// The hand-over's deadline: a socket of the right process that answers one byte every
/// 300 ms (each byte well inside a per-read timeout; 18 bytes take 5.4 s) is cut once the
/// whole hand-over has taken 2 s, so a peer's load (and whatever waits for it) is not held
/// for as long as the socket likes.
#[test]
fn a_socket_dripping_its_answer_is_cut_at_the_hand_over_deadline() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // SAFETY: memfd_create takes a NUL-terminated name and flags; returns a new fd or -1.
    let raw = unsafe { libc::memfd_create(c"kvx-drip".as_ptr(), 0) };
    assert!(raw >= 0);
    // SAFETY: raw is a fresh descriptor nothing else owns.
    let file: std::fs::File = unsafe { std::os::fd::FromRawFd::from_raw_fd(raw) };
    let b = agent("dripper");
    let _region = b.register(HostBuffer::new(LEN).unwrap()).unwrap();
    let (info, server) = impostor(file, Some(Duration::from_millis(300)));
    let mut meta = meta_of(&b);
    meta.lanes.retain(|e| e.lane != LANE_SHM);
    meta.lanes.push(LaneEntry::shm(&info));
    meta.host.as_mut().unwrap().pid = std::process::id();
    let a = agent("victim");
    let t = std::time::Instant::now();
    a.load_remote_metadata(&meta.encode()).unwrap();
    let took = t.elapsed();
    server.join().unwrap();
    eprintln!("a dripping hand-over held the load for {took:?}");
    assert!(
        took < Duration::from_millis(3500),
        "the load waited {took:?} for a dripping socket"
    );
}
