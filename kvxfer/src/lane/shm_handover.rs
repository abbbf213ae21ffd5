//! The shm lane's hand-over of memory files (`kvxfer_proto::wire::shm_fds`): the owner's
//! Unix socket gives a same-host peer of its own user the descriptors of its memfd-backed
//! regions with `SCM_RIGHTS`; the peer takes them only from the process its metadata names.
//! Nothing is opened through `/proc/<pid>/fd/<n>`, so no claim of a pid or a descriptor
//! number reaches a file.
//!
//! The socket is abstract (it vanishes with the process) and named at random; who may ask is
//! decided by the kernel's word on the asker (`SO_PEERCRED`: the same user) and by the token,
//! which travels only in metadata (sealed under a shared secret).

use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::device::copy::Exported;
use crate::memory::RegionInner;
use crate::memory::RegionTable;
use kvxfer_proto::error::{Error, Result};
use kvxfer_proto::types::MemKind;
use kvxfer_proto::wire::lane_entries::ShmLaneInfo;
use kvxfer_proto::wire::shm_fds::{
    alive_word, control_slot, DeviceEntry, DeviceHandle, FdAsk, FdEntry, FdFrame, FrameHead,
    ASK_LEN, CONTROL_REGION, CONTROL_WORDS, HEADER_LEN, MAX_BATCH, MAX_DEVICE_BATCH,
};

/// How long either end waits for the other's bytes, all of them together: a hand-over is a
/// few small frames, so a side that drips them one byte at a time is cut at this point
/// rather than holding a load (or a serving thread) for as long as it likes.
const IO_TIMEOUT: Duration = Duration::from_secs(2);
/// Askers served at once; past it a new one is closed at once (its side falls back to the
/// TCP lane or UCX), so a stalled asker holds one thread for at most [`IO_TIMEOUT`].
const MAX_ASKERS: usize = 16;

/// What a hand-over socket gives an asker besides the registration page.
#[derive(Clone)]
pub(crate) enum Serves {
    /// The memory files of memfd-backed host regions (the shm lane).
    HostFiles,
    /// The exported allocations of device regions (the device lane), from its exporter
    /// (which exports each region once and keeps it).
    Devices(Exporter),
    /// The TCP lane's windows: each to the one asker presenting its ticket, once, instead
    /// of the token (no registration page).
    Windows(Arc<Tickets>),
}

/// Windows offered to same-host initiators and not taken yet, by one-time ticket.
#[derive(Default)]
pub(crate) struct Tickets {
    open: Mutex<Vec<([u8; 32], OwnedFd, Instant)>>,
}

/// How long an offered window waits to be taken.
const TICKET_LIFE: Duration = Duration::from_secs(5);
/// Windows waiting to be taken at most (one per connection being opened).
const MAX_TICKETS: usize = 256;

impl Tickets {
    /// Offers `fd` under a fresh ticket (expired ones dropped first); None when too many wait.
    pub(crate) fn offer(&self, fd: OwnedFd) -> Result<Option<[u8; 32]>> {
        let ticket = crate::random::bytes::<32>()?;
        let mut g = self.open.lock().unwrap_or_else(|e| e.into_inner());
        g.retain(|(_, _, at)| at.elapsed() < TICKET_LIFE);
        if g.len() >= MAX_TICKETS {
            return Ok(None);
        }
        g.push((ticket, fd, Instant::now()));
        Ok(Some(ticket))
    }

    /// The window offered under `ticket`, taken (compared in constant time with each).
    fn take(&self, ticket: &[u8; 32]) -> Option<OwnedFd> {
        let mut g = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let at = g.iter().position(|(t, _, at)| {
            let diff = t.iter().zip(ticket).fold(0u8, |d, (a, b)| d | (a ^ b));
            diff == 0 && at.elapsed() < TICKET_LIFE
        })?;
        Some(g.swap_remove(at).1)
    }

    /// Withdraws the offer under `ticket` (the initiator declined, or went): whether it was
    /// still on offer (not taken).
    pub(crate) fn withdraw(&self, ticket: &[u8; 32]) -> bool {
        self.take(ticket).is_some()
    }
}

/// Exports a device region for the device lane's socket (None: it is not exportable).
pub(crate) type Exporter = Arc<dyn Fn(&RegionInner) -> Option<Arc<Exported>> + Send + Sync>;

/// What a peer's socket handed over: memory files, or exported device allocations (a
/// descriptor with each file handle), and the registration page among the files.
#[derive(Default)]
pub(crate) struct Handed {
    pub(crate) files: Vec<(FdEntry, OwnedFd)>,
    pub(crate) devices: Vec<(DeviceEntry, Option<OwnedFd>)>,
}

/// The owner's side: the socket, its thread, and the registration page.
pub(crate) struct HandOver {
    info: ShmLaneInfo,
    fd: RawFd,
    stop: Arc<AtomicBool>,
    thread: Mutex<Option<JoinHandle<()>>>,
    control: Arc<Control>,
}

/// The registration page (`kvxfer_proto::wire::shm_fds`): a sealed memfd this agent maps
/// writable and hands to peers, who map it read-only.
pub(crate) struct Control {
    fd: OwnedFd,
    words: *const AtomicU64,
}

// SAFETY: `words` points into a shared mapping owned by this struct, accessed only through
// atomics; the mapping lives until drop.
unsafe impl Send for Control {}
// SAFETY: as above.
unsafe impl Sync for Control {}

impl Control {
    fn new() -> Result<Control> {
        let len = CONTROL_WORDS * 8;
        // SAFETY: the name is a NUL-terminated literal; flags are valid.
        let raw = unsafe {
            libc::memfd_create(
                c"kvxfer-registered".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if raw < 0 {
            return Err(Error::io(
                "memfd_create (registration page)",
                std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: raw is a fresh descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: fd is a memfd of ours; ftruncate sizes it (zeroed).
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(Error::io(
                "sizing the registration page",
                std::io::Error::last_os_error(),
            ));
        }
        // Our own file, just sized to `len` bytes.
        let p = crate::memory::map_shared(&fd, len, true, "the registration page")?;
        // Its size is final, and (where the kernel has F_SEAL_FUTURE_WRITE, 5.1+) nobody
        // maps it writable after this mapping: a peer cannot forge a word.
        // SAFETY: fd is open; F_ADD_SEALS takes an int of seal flags.
        unsafe {
            libc::fcntl(
                fd.as_raw_fd(),
                libc::F_ADD_SEALS,
                crate::memory::SEALS | libc::F_SEAL_FUTURE_WRITE,
            );
            libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, crate::memory::SEALS);
        }
        Ok(Control {
            fd,
            words: p.cast(),
        })
    }

    fn word(&self, id: u32) -> &AtomicU64 {
        // SAFETY: control_slot < CONTROL_WORDS, inside the mapping, which lives as long as
        // &self; the words are only accessed atomically.
        unsafe { &*self.words.add(control_slot(id)) }
    }

    /// Region `id` is handed over: peers may use it (until [`Control::gone`]).
    fn alive(&self, id: u32) {
        self.word(id).store(alive_word(id), Ordering::SeqCst);
    }

    /// Region `id` is deregistered: peers refuse transfers into or out of it.
    pub(crate) fn gone(&self, id: u32) {
        let _ =
            self.word(id)
                .compare_exchange(alive_word(id), 0, Ordering::SeqCst, Ordering::SeqCst);
    }
}

impl Drop for Control {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped only here.
        unsafe { libc::munmap(self.words as *mut libc::c_void, CONTROL_WORDS * 8) };
    }
}

impl HandOver {
    /// Binds a socket of a fresh random name and serves `regions`' memory files on it.
    pub(crate) fn start(
        agent: &str,
        regions: Arc<RegionTable>,
        serves: Serves,
    ) -> Result<HandOver> {
        let token = crate::random::bytes::<32>()?;
        let (listener, info) = loop {
            let socket = crate::random::bytes::<16>()?;
            let info = ShmLaneInfo { socket, token };
            let addr = SocketAddr::from_abstract_name(info.socket_name().as_bytes())
                .map_err(|e| Error::io("naming the shm lane's socket", e))?;
            match UnixListener::bind_addr(&addr) {
                Ok(l) => break (l, info),
                // Taken (by chance, or by someone who guessed 128 random bits): another.
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => continue,
                Err(e) => return Err(Error::io("binding the shm lane's socket", e)),
            }
        };
        let fd = listener.as_raw_fd();
        let stop = Arc::new(AtomicBool::new(false));
        let control = Arc::new(Control::new()?);
        let thread = std::thread::Builder::new()
            .name(format!("kvx-shm-give-{agent}"))
            .spawn({
                let (stop, control) = (stop.clone(), control.clone());
                move || serve(listener, token, regions, control, stop, serves)
            })
            .map_err(|e| Error::io("starting the shm lane's hand-over thread", e))?;
        Ok(HandOver {
            info,
            fd,
            stop,
            thread: Mutex::new(Some(thread)),
            control,
        })
    }

    /// Region `id` was deregistered: peers that mapped it refuse to use it from now on.
    pub(crate) fn gone(&self, id: u32) {
        self.control.gone(id);
    }

    /// What the agent's metadata tells peers.
    pub(crate) fn info(&self) -> ShmLaneInfo {
        self.info
    }

    /// Stops serving; the thread is waited for (askers in flight end on their own).
    pub(crate) fn stop(&self) {
        let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            return;
        };
        self.stop.store(true, Ordering::SeqCst);
        // SAFETY: fd is the listener's, owned by the thread until it returns (joined below);
        // shutting a listening socket down wakes its accept with an error.
        unsafe { libc::shutdown(self.fd, libc::SHUT_RDWR) };
        let _ = t.join();
    }
}

impl Drop for HandOver {
    fn drop(&mut self) {
        self.stop();
    }
}

fn serve(
    listener: UnixListener,
    token: [u8; 32],
    regions: Arc<RegionTable>,
    control: Arc<Control>,
    stop: Arc<AtomicBool>,
    serves: Serves,
) {
    let busy = Arc::new(AtomicUsize::new(0));
    for conn in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(conn) = conn else {
            // EMFILE and the like: the asker is closed; the next may fare better.
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        if busy.fetch_add(1, Ordering::SeqCst) >= MAX_ASKERS {
            busy.fetch_sub(1, Ordering::SeqCst);
            continue;
        }
        let (mine, regions, control) = (busy.clone(), regions.clone(), control.clone());
        let serves = serves.clone();
        let spawned = std::thread::Builder::new()
            .name("kvx-shm-give".into())
            .spawn(move || {
                if let Err(e) = give(conn, &token, &regions, &control, &serves) {
                    log::info!("kvxfer: shm lane hand-over refused: {e}");
                }
                mine.fetch_sub(1, Ordering::SeqCst);
            });
        if spawned.is_err() {
            // The closure went with the failed spawn, its count not dropped.
            busy.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// The kernel's word on who is at the other end of `s`: pid and uid.
fn peer_cred(s: &UnixStream) -> Result<(u32, u32)> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: a live socket; cred and len are valid out pointers of the sizes stated.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(Error::io("SO_PEERCRED", std::io::Error::last_os_error()));
    }
    Ok((cred.pid as u32, cred.uid))
}

fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

/// Serves one asker: its user checked, its token checked (in constant time), then the
/// registration page and the memory files of every registered memfd-backed host region, in
/// batches, and the end.
fn give(
    mut s: UnixStream,
    token: &[u8; 32],
    regions: &RegionTable,
    control: &Control,
    serves: &Serves,
) -> Result<()> {
    let deadline = Instant::now() + IO_TIMEOUT;
    s.set_write_timeout(Some(IO_TIMEOUT))
        .map_err(|e| Error::io("shm hand-over timeouts", e))?;
    let (pid, uid) = peer_cred(&s)?;
    if uid != euid() {
        let why = format!(
            "the asker (pid {pid}) runs as uid {uid}, this agent as {}",
            euid()
        );
        let _ = s.write_all(&FdFrame::Refused(why.clone()).encode());
        return Err(Error::InvalidArgument(why));
    }
    let mut ask = [0u8; ASK_LEN];
    // Descriptors an asker sends along are closed when `sent` drops.
    let mut sent = Vec::new();
    recv_with_fds(&s, &mut ask, &mut sent, deadline)
        .map_err(|e| Error::io(format!("reading pid {pid}'s ask"), e))?;
    let ask = FdAsk::decode(&ask).map_err(|why| Error::protocol(format!("pid {pid}"), why))?;
    if let Serves::Windows(tickets) = serves {
        let Some(fd) = tickets.take(&ask.token) else {
            let _ = s.write_all(&FdFrame::Refused("no such window".into()).encode());
            return Err(Error::InvalidArgument(format!(
                "pid {pid} presented no ticket of a window on offer"
            )));
        };
        let entry = FdEntry {
            region: 0,
            len: kvxfer_proto::wire::lane_window::WINDOW_BYTES as u64,
        };
        send_with_fds(&s, &FdFrame::Batch(vec![entry]).encode(), &[fd.as_raw_fd()])
            .map_err(|e| Error::io(format!("handing pid {pid} its window"), e))?;
        s.write_all(&FdFrame::End.encode())
            .map_err(|e| Error::io(format!("ending pid {pid}'s hand-over"), e))?;
        return Ok(());
    }
    let diff = ask
        .token
        .iter()
        .zip(token)
        .fold(0u8, |d, (a, b)| d | (a ^ b));
    if diff != 0 {
        let why = format!("pid {pid} presented the wrong token");
        let _ = s.write_all(&FdFrame::Refused("wrong token".into()).encode());
        return Err(Error::InvalidArgument(why));
    }
    // The regions held (their memory, and so their descriptors, live while the Arcs do).
    let held: Vec<_> = regions
        .read()
        .values()
        .filter(|r| match serves {
            Serves::HostFiles => r.kind == MemKind::Host && r.shm.is_some(),
            Serves::Devices(_) => r.kind != MemKind::Host,
            Serves::Windows(_) => false,
        })
        .cloned()
        .collect();
    // Device exports, held while they are sent.
    let mut exports: Vec<(DeviceEntry, Arc<Exported>)> = Vec::new();
    // Each region's word is set, then `registered` looked at again: a deregistration clears
    // `registered` and then the word, so in every order a region gone is not left alive.
    let mut files: Vec<(FdEntry, RawFd)> = vec![(
        FdEntry {
            region: CONTROL_REGION,
            len: (CONTROL_WORDS * 8) as u64,
        },
        control.fd.as_raw_fd(),
    )];
    for r in &held {
        control.alive(r.id.0);
        if !r.registered.load(Ordering::SeqCst) {
            control.gone(r.id.0);
            continue;
        }
        if let Serves::Devices(export) = serves {
            if let Some(x) = export(r) {
                let entry = DeviceEntry {
                    region: r.id.0,
                    len: r.len,
                    offset: x.offset,
                    size: x.size,
                    handle: x.handle,
                };
                exports.push((entry, x));
            }
            continue;
        }
        if let Some(h) = r.shm {
            files.push((
                FdEntry {
                    region: r.id.0,
                    len: r.len,
                },
                h.fd as RawFd,
            ));
        }
    }
    for batch in files.chunks(MAX_BATCH) {
        let entries: Vec<FdEntry> = batch.iter().map(|(e, _)| *e).collect();
        let fds: Vec<RawFd> = batch.iter().map(|(_, fd)| *fd).collect();
        send_with_fds(&s, &FdFrame::Batch(entries).encode(), &fds)
            .map_err(|e| Error::io(format!("handing pid {pid} its descriptors"), e))?;
    }
    for batch in exports.chunks(MAX_DEVICE_BATCH) {
        let entries: Vec<DeviceEntry> = batch.iter().map(|(e, _)| *e).collect();
        let fds: Vec<RawFd> = batch
            .iter()
            .filter_map(|(_, x)| x.file.as_ref().map(AsRawFd::as_raw_fd))
            .collect();
        send_with_fds(&s, &FdFrame::Devices(entries).encode(), &fds)
            .map_err(|e| Error::io(format!("handing pid {pid} its device exports"), e))?;
    }
    s.write_all(&FdFrame::End.encode())
        .map_err(|e| Error::io(format!("ending pid {pid}'s hand-over"), e))?;
    Ok(())
}

/// Sends `bytes` with `fds` attached to their first byte.
fn send_with_fds(s: &UnixStream, bytes: &[u8], fds: &[RawFd]) -> std::io::Result<()> {
    let payload = std::mem::size_of_val(fds);
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(payload as u32) } as usize;
    let mut control = vec![0u8; space];
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    // SAFETY: an all-zero msghdr is valid; its pointers are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: msg_control holds CMSG_SPACE(payload) bytes, so the first header fits and
    // CMSG_DATA points at `payload` writable bytes inside `control`.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(payload as u32) as _;
        std::ptr::copy_nonoverlapping(fds.as_ptr().cast::<u8>(), libc::CMSG_DATA(c), payload);
    }
    // SAFETY: msg points at live iov and control buffers for the call's duration; the
    // descriptors are open (their regions are held by the caller).
    let n = unsafe { libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // The descriptors went with the first byte; the rest is plain data.
    let mut w = s;
    w.write_all(&bytes[n as usize..])
}

/// Reads exactly `buf.len()` bytes by `deadline`, keeping every descriptor that arrives with
/// them (closed on drop). Fails if the kernel cut the descriptors (`MSG_CTRUNC`).
fn recv_with_fds(
    s: &UnixStream,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
    deadline: Instant,
) -> std::io::Result<()> {
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE((MAX_BATCH * std::mem::size_of::<RawFd>()) as u32) };
    let mut control = vec![0u8; space as usize];
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("{got} of {} bytes in {IO_TIMEOUT:?}", buf.len()),
            ));
        }
        s.set_read_timeout(Some(left))?;
        let mut iov = libc::iovec {
            iov_base: buf[got..].as_mut_ptr().cast(),
            iov_len: buf.len() - got,
        };
        // SAFETY: an all-zero msghdr is valid; its pointers are set below.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = control.len() as _;
        // SAFETY: msg points at live iov and control buffers for the call's duration.
        let n = unsafe { libc::recvmsg(s.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // Whatever arrived is owned first, so that nothing leaks on any error below.
        // SAFETY: the kernel filled msg_controllen bytes of `control` with well-formed
        // headers; CMSG_NXTHDR stays inside them; an SCM_RIGHTS header's data is an array of
        // descriptors new to this process.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&msg);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                    let data = libc::CMSG_DATA(c);
                    let len = (*c).cmsg_len as usize - (data as usize - c as usize);
                    for i in 0..len / std::mem::size_of::<RawFd>() {
                        let fd = std::ptr::read_unaligned(data.cast::<RawFd>().add(i));
                        fds.push(OwnedFd::from_raw_fd(fd));
                    }
                }
                c = libc::CMSG_NXTHDR(&msg, c);
            }
        }
        if msg.msg_flags & libc::MSG_CTRUNC != 0 {
            return Err(std::io::Error::other("descriptors cut short (MSG_CTRUNC)"));
        }
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        got += n as usize;
    }
    Ok(())
}

/// The peer's side: the memory files the agent at `info` hands over, with their regions,
/// taken only if the socket's owner is process `pid` of this user. At most `max` regions
/// besides the registration page (the first, [`CONTROL_REGION`]).
pub(crate) fn take(info: &ShmLaneInfo, pid: u32, max: usize) -> Result<Handed> {
    let name = info.socket_name();
    let addr = SocketAddr::from_abstract_name(name.as_bytes())
        .map_err(|e| Error::io("naming the peer's shm socket", e))?;
    let mut s = UnixStream::connect_addr(&addr)
        .map_err(|e| Error::io(format!("connecting to the peer's shm socket {name}"), e))?;
    let deadline = Instant::now() + IO_TIMEOUT;
    s.set_write_timeout(Some(IO_TIMEOUT))
        .map_err(|e| Error::io("shm hand-over timeouts", e))?;
    let (owner, uid) = peer_cred(&s)?;
    if owner != pid || uid != euid() {
        return Err(Error::InvalidArgument(format!(
            "the shm socket {name} belongs to pid {owner} (uid {uid}), not to the peer's \
             process {pid} of uid {}: nothing taken",
            euid()
        )));
    }
    s.write_all(&FdAsk { token: info.token }.encode())
        .map_err(|e| Error::io(format!("asking {name}"), e))?;
    let mut out = Handed::default();
    loop {
        let mut head = [0u8; HEADER_LEN];
        let mut fds = Vec::new();
        recv_with_fds(&s, &mut head, &mut fds, deadline)
            .map_err(|e| Error::io(format!("reading {name}'s hand-over"), e))?;
        let head = FrameHead::decode(head).map_err(|why| Error::protocol(&name, why))?;
        let mut body = vec![0u8; head.body_len()];
        // However the sender spread them over the frame's bytes, the descriptors that came
        // with it must be as many as it names.
        recv_with_fds(&s, &mut body, &mut fds, deadline)
            .map_err(|e| Error::io(format!("reading {name}'s hand-over"), e))?;
        let frame = FdFrame::decode(head, &body).map_err(|why| Error::protocol(&name, why))?;
        if fds.len() != frame.fds() {
            return Err(Error::protocol(
                &name,
                format!(
                    "{} descriptors with a frame that names {}",
                    fds.len(),
                    frame.fds()
                ),
            ));
        }
        match frame {
            FdFrame::Batch(entries) => {
                if out.files.len() + out.devices.len() + entries.len() > max + 1 {
                    return Err(Error::InvalidArgument(format!(
                        "{name} hands over more than {max} regions"
                    )));
                }
                out.files.extend(entries.into_iter().zip(fds));
            }
            FdFrame::Devices(entries) => {
                if out.files.len() + out.devices.len() + entries.len() > max + 1 {
                    return Err(Error::InvalidArgument(format!(
                        "{name} hands over more than {max} regions"
                    )));
                }
                // The descriptors came in the order of the entries that are files.
                let mut fds = fds.into_iter();
                for e in entries {
                    let fd = match e.handle {
                        DeviceHandle::File => fds.next(),
                        DeviceHandle::Ipc(_) => None,
                    };
                    out.devices.push((e, fd));
                }
            }
            FdFrame::End => return Ok(out),
            FdFrame::Refused(why) => {
                return Err(Error::InvalidArgument(format!("{name} refused: {why}")))
            }
        }
    }
}

/// The window offered under `ticket` by the socket named `socket`, taken only if the socket's
/// owner is process `pid` of this user.
pub(crate) fn take_window(socket: [u8; 16], ticket: [u8; 32], pid: u32) -> Result<OwnedFd> {
    let info = ShmLaneInfo {
        socket,
        token: ticket,
    };
    let mut h = take(&info, pid, 0)?;
    match (h.files.pop(), h.files.is_empty() && h.devices.is_empty()) {
        (Some((e, fd)), true)
            if e.region == 0 && e.len == kvxfer_proto::wire::lane_window::WINDOW_BYTES as u64 =>
        {
            Ok(fd)
        }
        _ => Err(Error::protocol(
            info.socket_name(),
            "handed over something else than one window",
        )),
    }
}

/// A peer's registration page mapped read-only (`kvxfer_proto::wire::shm_fds`).
pub(crate) struct ControlMap {
    words: *const AtomicU64,
}

impl ControlMap {
    /// Maps the page handed over as `fd`: a memfd of this user, sealed, of the page's size.
    pub(crate) fn map(fd: OwnedFd) -> Result<ControlMap> {
        let len = CONTROL_WORDS * 8;
        // SAFETY: an all-zero stat is a valid value to be overwritten by fstat.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fd is open; st is a valid out pointer; F_GET_SEALS takes no argument.
        let (ok, seals) = unsafe {
            (
                libc::fstat(fd.as_raw_fd(), &mut st) == 0,
                libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS),
            )
        };
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        if !ok
            || seals < 0
            || seals & crate::memory::SEALS != crate::memory::SEALS
            || st.st_uid != me
            || st.st_size as usize != len
        {
            return Err(Error::InvalidArgument(format!(
                "not a sealed memfd of this user of {len} bytes (seals {seals:#x}, uid {}, {} bytes)",
                st.st_uid, st.st_size
            )));
        }
        // A sealed file of exactly `len` bytes (checked above).
        let p = crate::memory::map_shared(&fd, len, false, "a registration page")?;
        Ok(ControlMap { words: p.cast() })
    }

    /// Whether region `id` is registered now, as its owner last wrote.
    pub(crate) fn alive(&self, id: u32) -> bool {
        // SAFETY: control_slot < CONTROL_WORDS, inside the mapping, which lives as long as
        // &self; the page is only read, atomically (its owner writes it atomically).
        let w = unsafe { &*self.words.add(control_slot(id)) };
        w.load(Ordering::Acquire) == alive_word(id)
    }
}

impl Drop for ControlMap {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped only here.
        unsafe { libc::munmap(self.words as *mut libc::c_void, CONTROL_WORDS * 8) };
    }
}

// SAFETY: the page is mapped read-only, owned by the struct until drop, and only read
// through atomics.
unsafe impl Send for ControlMap {}
// SAFETY: as above.
unsafe impl Sync for ControlMap {}
