//! Memory that can be registered: owned page-aligned host buffers, memory maps, and (through an
//! `unsafe` call on the agent) an engine's raw pointers. A [`Region`] is a registered piece of
//! memory; its bytes stay valid until the last handle and every transfer using it are gone.

use std::collections::HashMap;
use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::Ordering;

// The pin handshake's flags: loom's under `--cfg loom` (scripts/sanitizers.sh loom), which
// explores every interleaving of `Pins::add` against `RegionInner::retire`.
#[cfg(loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicBool, AtomicU32};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{fence, AtomicBool, AtomicU32};
use std::sync::{Arc, RwLock, RwLockReadGuard};

use kvxfer_proto::error::{Error, Result};
use kvxfer_proto::types::{DeviceAlloc, MemKind, RegionId, ShmHandle};

/// An owned, page-aligned, zero-filled host allocation.
///
/// It is backed by an anonymous memory file (`memfd_create`) mapped shared, so that an agent
/// on the same host can map it too and move bytes with plain copies, one pass, no kernel
/// round trip per block. Where memfd is not available it falls back to an anonymous mapping.
///
/// ```
/// use kvxfer::HostBuffer;
/// let mut b = HostBuffer::new(10_000)?; // mapped in whole pages
/// assert_eq!(b.len(), 10_000);
/// assert_eq!(b.as_slice().as_ptr() as usize % 4096, 0);
/// b.as_mut_slice()[..3].copy_from_slice(b"kv!");
/// assert_eq!(&b.as_slice()[..3], b"kv!");
/// // Registered with an agent, it is read and written through its `Region` instead.
/// # Ok::<(), kvxfer::Error>(())
/// ```
pub struct HostBuffer {
    ptr: NonNull<u8>,
    len: usize,
    map_len: usize,
    fd: Option<std::os::fd::OwnedFd>,
}

// SAFETY: HostBuffer uniquely owns its mapping (like Box<[u8]>); the pointer is never shared
// except through &self/&mut self borrows, so moving it across threads is sound.
unsafe impl Send for HostBuffer {}
// SAFETY: &HostBuffer only gives out shared access (&[u8]); mutation needs &mut.
unsafe impl Sync for HostBuffer {}

/// The seals of a host buffer's memory file: its size is fixed, for good.
pub(crate) const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// A fresh shared mapping of the first `len` bytes of the file `fd` (read-only, or read-write
/// with `writable`), which the caller checked to hold them. `what` names it in the error.
pub(crate) fn map_shared(
    fd: &std::os::fd::OwnedFd,
    len: usize,
    writable: bool,
    what: &str,
) -> Result<*mut u8> {
    use std::os::fd::AsRawFd;
    let prot = if writable {
        libc::PROT_READ | libc::PROT_WRITE
    } else {
        libc::PROT_READ
    };
    // SAFETY: a new mapping of len bytes of a file at least that long (the caller's check);
    // no existing memory of this process is affected.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            prot,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(Error::io(
            format!("mapping {what}"),
            std::io::Error::last_os_error(),
        ));
    }
    Ok(p.cast())
}

/// Checks a memory file a same-host peer handed over before it is mapped: a memfd (F_GET_SEALS
/// fails on any other file) whose size is sealed (a mapping of it cannot fault past a shrunk
/// end), owned by this user, of at least `len` bytes. `what` names it in the error.
pub(crate) fn check_sealed_file(fd: &std::os::fd::OwnedFd, len: u64, what: &str) -> Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: an all-zero stat is a valid value to be overwritten by fstat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fd is open; st is a valid out pointer.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(Error::io(
            format!("fstat {what}"),
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: fd is open; F_GET_SEALS takes no argument.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 {
        return Err(Error::InvalidArgument(format!(
            "{what} is not a memory file (memfd): refused"
        )));
    }
    if seals & SEALS != SEALS {
        return Err(Error::InvalidArgument(format!(
            "{what} is a memory file whose size is not sealed (seals {seals:#x}): refused"
        )));
    }
    // SAFETY: geteuid has no preconditions.
    if st.st_uid != unsafe { libc::geteuid() } {
        return Err(Error::InvalidArgument(format!(
            "{what} belongs to uid {}, not this process's: refused",
            st.st_uid
        )));
    }
    if (st.st_size as u64) < len {
        return Err(Error::InvalidArgument(format!(
            "{what} holds {} bytes, fewer than the {len} it is said to",
            st.st_size
        )));
    }
    Ok(())
}

impl HostBuffer {
    /// Allocates `len` zeroed bytes aligned to the page size.
    pub fn new(len: usize) -> Result<Self> {
        use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
        let map_len = rounded_len(len, page_size())?;
        // SAFETY: the name is a NUL-terminated literal; flags are valid.
        let raw = unsafe {
            libc::memfd_create(
                c"kvxfer-kv".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        let fd = if raw >= 0 {
            // SAFETY: raw is a fresh descriptor owned by nobody else.
            let fd = unsafe { OwnedFd::from_raw_fd(raw) };
            // SAFETY: fd is a valid memfd; map_len fits in off_t on 64-bit Linux.
            if unsafe { libc::ftruncate(fd.as_raw_fd(), map_len as libc::off_t) } != 0 {
                return Err(Error::OutOfMemory(format!(
                    "sizing a {len}-byte memory file: {}",
                    std::io::Error::last_os_error()
                )));
            }
            // Its size is final: a same-host peer that maps it can never be made to fault
            // past a shrunk end (SIGBUS), and the shm lane maps only files sealed so.
            // SAFETY: fd is a valid memfd made with MFD_ALLOW_SEALING; F_ADD_SEALS takes an int.
            if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, SEALS) } != 0 {
                return Err(Error::io(
                    "sealing a memory file",
                    std::io::Error::last_os_error(),
                ));
            }
            Some(fd)
        } else {
            None
        };
        let (flags, f) = match &fd {
            Some(fd) => (libc::MAP_SHARED, fd.as_raw_fd()),
            None => (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1),
        };
        let ptr = map_fresh(len, map_len, flags, f)?;
        Ok(HostBuffer {
            ptr,
            len,
            map_len,
            fd,
        })
    }

    /// Allocates `len` zeroed bytes on transparent huge pages: a private anonymous mapping
    /// aligned to 2 MiB and advised `MADV_HUGEPAGE` (honoured where the kernel's THP mode is
    /// `always` or `madvise`). The kernel walks one page table entry per 2 MiB instead of 512,
    /// which speeds the kernel's copies through it (UCX's `cma` and TCP). It is private, so a
    /// same-host peer cannot map it: kvxfer's shared-memory lane does not cover it, and
    /// transfers of it take the TCP lane or UCX.
    pub fn huge(len: usize) -> Result<Self> {
        const HUGE: usize = 2 << 20;
        let map_len = rounded_len(len, HUGE)?;
        let over = map_len
            .checked_add(HUGE)
            .ok_or_else(|| Error::InvalidArgument(format!("host buffer of {len} bytes")))?;
        let p: *mut libc::c_void =
            map_fresh(len, over, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1)?
                .as_ptr()
                .cast();
        let base = p as usize;
        let start = base.next_multiple_of(HUGE);
        let (head, tail) = (start - base, base + over - (start + map_len));
        // SAFETY: [base, start) and [start + map_len, base + over) are the unaligned ends of
        // the mapping just made, which nothing uses; the aligned middle stays mapped.
        unsafe {
            if head > 0 {
                libc::munmap(p, head);
            }
            if tail > 0 {
                libc::munmap((start + map_len) as *mut libc::c_void, tail);
            }
            // Advice only: where THP is off the buffer stays on small pages.
            libc::madvise(start as *mut libc::c_void, map_len, libc::MADV_HUGEPAGE);
        }
        let ptr = NonNull::new(start as *mut u8)
            .ok_or_else(|| Error::OutOfMemory(format!("mapping {len} bytes: NULL")))?;
        Ok(HostBuffer {
            ptr,
            len,
            map_len,
            fd: None,
        })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: empty buffers cannot be made.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Whether a process on the same host can map this buffer (it is memfd-backed).
    pub fn is_shareable(&self) -> bool {
        self.fd.is_some()
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is a live mapping of at least len initialised (zeroed) bytes owned by
        // self, borrowed shared for the lifetime of &self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len()) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in as_slice, and &mut self guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len()) }
    }

    fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The sealed memory file behind the buffer (none for a private mapping).
    pub(crate) fn file(&self) -> Option<&std::os::fd::OwnedFd> {
        self.fd.as_ref()
    }

    pub(crate) fn shm_handle(&self) -> Option<ShmHandle> {
        use std::os::fd::AsRawFd;
        let fd = self.fd.as_ref()?;
        // SAFETY: an all-zero stat is a valid value to be overwritten by fstat.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fd is open (owned by self); st is a valid out pointer.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return None;
        }
        Some(ShmHandle {
            fd: fd.as_raw_fd() as u32,
            dev: st.st_dev,
            ino: st.st_ino,
        })
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: ptr/map_len is the mapping made in new(), unmapped only here.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.map_len) };
    }
}

impl fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostBuffer")
            .field("ptr", &self.ptr)
            .field("len", &self.len())
            .finish()
    }
}

/// Memory that an agent can register and then owns.
#[derive(Debug)]
#[non_exhaustive]
pub enum Memory {
    /// An owned host allocation.
    Host(HostBuffer),
    /// A writable memory map (a file, or anonymous / shared memory).
    Mmap(memmap2::MmapMut),
    /// A cudarc device buffer (feature `cuda`), registered as [`MemKind::Cuda`] of its
    /// context's device.
    #[cfg(feature = "cuda")]
    Cuda(cudarc::driver::CudaSlice<u8>),
}

#[cfg(feature = "cuda")]
impl From<cudarc::driver::CudaSlice<u8>> for Memory {
    fn from(s: cudarc::driver::CudaSlice<u8>) -> Self {
        Memory::Cuda(s)
    }
}

impl From<HostBuffer> for Memory {
    fn from(b: HostBuffer) -> Self {
        Memory::Host(b)
    }
}

impl From<memmap2::MmapMut> for Memory {
    fn from(m: memmap2::MmapMut) -> Self {
        Memory::Mmap(m)
    }
}

impl Memory {
    pub(crate) fn shm_handle(&self) -> Option<ShmHandle> {
        match self {
            Memory::Host(b) => b.shm_handle(),
            Memory::Mmap(_) => None,
            #[cfg(feature = "cuda")]
            Memory::Cuda(_) => None,
        }
    }

    pub(crate) fn kind(&self) -> MemKind {
        match self {
            #[cfg(feature = "cuda")]
            Memory::Cuda(s) => MemKind::Cuda(s.context().ordinal() as u32),
            _ => MemKind::Host,
        }
    }

    pub(crate) fn raw_parts(&mut self) -> (*mut u8, usize) {
        match self {
            Memory::Host(b) => (b.as_ptr(), b.len()),
            Memory::Mmap(m) => (m.as_mut_ptr(), m.len()),
            #[cfg(feature = "cuda")]
            Memory::Cuda(s) => {
                use cudarc::driver::DevicePtr;
                let (p, _sync) = s.device_ptr(s.stream());
                (p as *mut u8, s.len())
            }
        }
    }
}

pub(crate) struct RegionInner {
    pub(crate) id: RegionId,
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) kind: MemKind,
    /// What kind of allocation device memory lies in, where the copy engine can tell.
    pub(crate) alloc: Option<DeviceAlloc>,
    /// Registered with UCX (it has a memory handle and a remote key). False for device memory
    /// on the staged path, which only kvxfer's TCP lane moves, through staging chunks.
    pub(crate) ucx_mapped: bool,
    /// Shared with named peers only ([`Share::Only`](crate::agent::Share)): no UCX key, no
    /// shm handle, no device export and no address in the metadata; only the TCP lane, whose
    /// target checks the share set and the grants, moves it.
    pub(crate) restricted: bool,
    /// Owned backing memory; None for memory registered through a raw pointer.
    pub(crate) _backing: Option<Memory>,
    /// How a same-host peer maps it (memfd-backed host buffers).
    pub(crate) shm: Option<ShmHandle>,
    /// Transfers posted and not yet completed by UCX that use this region.
    pub(crate) inflight: AtomicU32,
    pub(crate) registered: AtomicBool,
}

impl RegionInner {
    /// The deregistration half of the pin handshake: clears `registered`, then looks at
    /// `inflight` (both SeqCst, paired with [`Pins`], which raises `inflight` and then checks
    /// `registered`), so that either a pinning thread sees the region gone or this sees it in
    /// use. On `Busy` the region stays registered.
    pub(crate) fn retire(&self) -> Result<()> {
        let region = self.id.0;
        if !self.registered.swap(false, Ordering::SeqCst) {
            return Err(Error::Deregistered { region });
        }
        // Store-then-load on two locations (Dekker): the fence orders them for any memory
        // model, not only for SeqCst accesses (and lets loom check it).
        fence(Ordering::SeqCst);
        let inflight = self.inflight.load(Ordering::SeqCst);
        if inflight > 0 {
            self.registered.store(true, Ordering::SeqCst);
            return Err(Error::Busy { region, inflight });
        }
        Ok(())
    }

    /// Undoes a [`retire`](Self::retire) whose deregistration could not finish (a peer did not
    /// confirm it stopped using the region): pins succeed again.
    pub(crate) fn unretire(&self) {
        self.registered.store(true, Ordering::SeqCst);
    }
}

/// Pins on registered regions: while held, deregistering any of them fails with `Busy`. The
/// only implementation of the pin half of the handshake ([`RegionInner::retire`] is the other):
/// raise `inflight`, then check `registered`. Released once, by [`Pins::release`] or on drop.
#[derive(Default)]
pub(crate) struct Pins {
    regions: Vec<Arc<RegionInner>>,
    released: AtomicBool,
}

impl Pins {
    /// Pins every region of `regions` (each once), or none: the id of the first that is being
    /// deregistered is the error.
    pub(crate) fn acquire(regions: Vec<Arc<RegionInner>>) -> Result<Pins> {
        let mut p = Pins::default();
        for r in regions {
            p.add(&r)
                .map_err(|()| Error::Deregistered { region: r.id.0 })?;
        }
        Ok(p)
    }

    /// Pins one more region (no-op when already pinned here); `Err` when it is being
    /// deregistered (it stays in the set, released with the rest).
    pub(crate) fn add(&mut self, r: &Arc<RegionInner>) -> std::result::Result<(), ()> {
        if self.regions.iter().any(|p| Arc::ptr_eq(p, r)) {
            return Ok(());
        }
        r.inflight.fetch_add(1, Ordering::SeqCst);
        self.regions.push(r.clone());
        // The other half of the handshake's fence (see `RegionInner::retire`).
        fence(Ordering::SeqCst);
        if r.registered.load(Ordering::SeqCst) {
            Ok(())
        } else {
            Err(())
        }
    }

    /// The pinned regions.
    pub(crate) fn regions(&self) -> &[Arc<RegionInner>] {
        &self.regions
    }

    /// Drops the pins (once; later calls do nothing). The regions' memory stays alive while
    /// this value holds them.
    pub(crate) fn release(&self) {
        if self.released.swap(true, Ordering::AcqRel) {
            return;
        }
        for r in &self.regions {
            r.inflight.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Keeps the pins and the memory for the life of the process: for buffers UCX may still
    /// touch when the engine gives up on them (shutdown with operations outstanding).
    pub(crate) fn leak(&self) {
        self.released.store(true, Ordering::Release);
        std::mem::forget(self.regions.clone());
    }
}

impl Drop for Pins {
    fn drop(&mut self) {
        self.release();
    }
}

/// The agent's registered regions by id. The agent writes it (after the engine has mapped a
/// region, and after it has unmapped one); `prep_local`, peer info and the TCP lane's target
/// read it.
#[derive(Default)]
pub(crate) struct RegionTable(RwLock<HashMap<u32, Arc<RegionInner>>>);

impl Drop for RegionTable {
    fn drop(&mut self) {
        let left = self.0.read().unwrap_or_else(|e| e.into_inner()).len();
        crate::live::regions_changed(false, left);
    }
}

impl RegionTable {
    pub(crate) fn insert(&self, r: Arc<RegionInner>) {
        let new = self
            .0
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(r.id.0, r)
            .is_none();
        crate::live::regions_changed(true, usize::from(new));
    }

    pub(crate) fn remove(&self, id: RegionId) {
        let had = self
            .0
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id.0)
            .is_some();
        crate::live::regions_changed(false, usize::from(had));
    }

    /// The registered region of kind `kind` that holds `[addr, addr+len)`, and the offset of
    /// `addr` in it (the lowest id when several do).
    pub(crate) fn containing(&self, addr: u64, len: u64, kind: MemKind) -> Option<(RegionId, u64)> {
        self.read()
            .values()
            .filter(|r| {
                r.kind == kind
                    && r.registered.load(Ordering::SeqCst)
                    && addr >= r.addr
                    && addr.saturating_add(len) <= r.addr + r.len
            })
            .map(|r| (r.id, addr - r.addr))
            .min_by_key(|(id, _)| id.0)
    }

    /// A read view of the table (hold it briefly: registration waits for it).
    pub(crate) fn read(&self) -> RwLockReadGuard<'_, HashMap<u32, Arc<RegionInner>>> {
        self.0.read().unwrap_or_else(|e| e.into_inner())
    }
}

/// A registered region of memory. Cloning gives another handle to the same registration.
///
/// Obtained from [`Agent::register`](crate::Agent::register) (owned memory) or
/// [`Agent::register_raw`](crate::Agent::register_raw) (an engine's memory); released with
/// [`Agent::deregister`](crate::Agent::deregister), which fails with
/// [`Error::Busy`] while a transfer uses it. Owned memory stays allocated while any handle or
/// transfer holds it.
#[derive(Clone)]
pub struct Region {
    pub(crate) inner: Arc<RegionInner>,
}

impl fmt::Debug for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Region")
            .field("id", &self.inner.id)
            .field("addr", &format_args!("{:#x}", self.inner.addr))
            .field("len", &self.inner.len)
            .field("kind", &self.inner.kind)
            .field("inflight", &self.inflight())
            .finish()
    }
}

impl Region {
    /// Its id, as descriptors and peers name it.
    pub fn id(&self) -> RegionId {
        self.inner.id
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.inner.len
    }

    /// True when the region has no bytes (never, registration refuses that).
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// Base address.
    pub fn addr(&self) -> u64 {
        self.inner.addr
    }

    /// Host or device.
    pub fn kind(&self) -> MemKind {
        self.inner.kind
    }

    /// For device memory, what kind of allocation it lies in (where the copy engine can
    /// tell), which decided its path at registration: pool memory takes the staged path.
    pub fn device_alloc(&self) -> Option<DeviceAlloc> {
        self.inner.alloc
    }

    /// Transfers in flight that use this region.
    pub fn inflight(&self) -> u32 {
        self.inner.inflight.load(Ordering::Acquire)
    }

    /// Whether the region is still registered.
    pub fn is_registered(&self) -> bool {
        self.inner.registered.load(Ordering::Acquire)
    }

    /// Copies `data` into the region at `offset`. Host memory only. Bytes a peer writes at the
    /// same time are unspecified, as with any shared memory; no transfer should target them.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.check_host(offset, data.len())?;
        // SAFETY: check_host proved [offset, offset+len) lies in this host region, which is
        // valid for the life of self.inner; data cannot overlap it (it is a Rust borrow of
        // other memory or, if it points into the region, ptr::copy handles overlap).
        unsafe {
            std::ptr::copy(
                data.as_ptr(),
                (self.inner.addr + offset) as *mut u8,
                data.len(),
            )
        };
        Ok(())
    }

    /// Copies bytes from the region at `offset` into `out`. Host memory only.
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        self.check_host(offset, out.len())?;
        // SAFETY: as in write(); out is an exclusive borrow of other memory.
        unsafe {
            std::ptr::copy(
                (self.inner.addr + offset) as *const u8,
                out.as_mut_ptr(),
                out.len(),
            )
        };
        Ok(())
    }

    /// The region's bytes.
    ///
    /// # Safety
    /// 1. The region must be host memory.
    /// 2. No transfer (local or a peer's) may write these bytes while the slice lives.
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: the caller upholds 1-2; the region is valid while self.inner lives.
        unsafe { std::slice::from_raw_parts(self.inner.addr as *const u8, self.inner.len as usize) }
    }

    /// The region's bytes, mutably.
    ///
    /// # Safety
    /// 1. The region must be host memory.
    /// 2. No transfer (local or a peer's) may read or write these bytes while the slice lives,
    ///    and no other slice of this region may exist.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_slice(&self) -> &mut [u8] {
        // SAFETY: the caller upholds 1-2; the region is valid while self.inner lives.
        unsafe {
            std::slice::from_raw_parts_mut(self.inner.addr as *mut u8, self.inner.len as usize)
        }
    }

    fn check_host(&self, offset: u64, len: usize) -> Result<()> {
        if self.inner.kind != MemKind::Host {
            return Err(Error::InvalidArgument(format!(
                "region {} is {:?} memory, not host",
                self.inner.id.0, self.inner.kind
            )));
        }
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.inner.len => Ok(()),
            _ => Err(Error::OutOfBounds {
                side: kvxfer_proto::error::Side::Local,
                index: 0,
                region: self.inner.id.0,
                offset,
                len: len as u64,
                region_len: self.inner.len,
            }),
        }
    }
}

/// `len` (non-zero) rounded up to a multiple of `unit`.
fn rounded_len(len: usize, unit: usize) -> Result<usize> {
    if len == 0 {
        return Err(Error::InvalidArgument("host buffer of 0 bytes".into()));
    }
    len.checked_add(unit - 1)
        .map(|l| l / unit * unit)
        .ok_or_else(|| Error::InvalidArgument(format!("host buffer of {len} bytes")))
}

/// A fresh read-write mapping of `map_len` bytes (for a buffer of `len`) of the file `fd`, or
/// anonymous memory with `fd` -1.
fn map_fresh(
    len: usize,
    map_len: usize,
    flags: libc::c_int,
    fd: libc::c_int,
) -> Result<NonNull<u8>> {
    // SAFETY: a fresh mapping of map_len bytes (non-zero: a rounded non-zero length) of the
    // caller's own file or anonymous memory; no existing memory is affected.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            map_len,
            libc::PROT_READ | libc::PROT_WRITE,
            flags,
            fd,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(Error::OutOfMemory(format!(
            "mapping {len} bytes of host memory: {}",
            std::io::Error::last_os_error()
        )));
    }
    NonNull::new(p.cast::<u8>())
        .ok_or_else(|| Error::OutOfMemory(format!("mapping {len} bytes: NULL")))
}

/// The system page size.
pub fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_buffer_is_page_aligned_and_zeroed() {
        let mut b = HostBuffer::new(10_000).unwrap();
        assert_eq!(b.as_slice().as_ptr() as usize % page_size(), 0);
        assert!(b.as_slice().iter().all(|&x| x == 0));
        b.as_mut_slice()[9_999] = 7;
        assert_eq!(b.as_slice()[9_999], 7);
        assert!(HostBuffer::new(0).is_err());
    }

    #[test]
    fn huge_buffer_is_2mib_aligned_zeroed_private_and_freed() {
        for len in [2, 3 << 20, 4 << 20] {
            let mut b = HostBuffer::huge(len).unwrap();
            assert_eq!(b.as_slice().as_ptr() as usize % (2 << 20), 0, "{len}");
            assert_eq!(b.len(), len);
            assert!(b.as_slice().iter().all(|&x| x == 0));
            b.as_mut_slice()[len - 1] = 9;
            b.as_mut_slice()[0] = 8;
            assert_eq!((b.as_slice()[0], b.as_slice()[len - 1]), (8, 9));
            assert!(!b.is_shareable() && b.shm_handle().is_none());
        }
        assert!(HostBuffer::huge(0).is_err());
        // Dropped buffers give their mappings back: many of them do not add up.
        for _ in 0..64 {
            drop(HostBuffer::huge(64 << 20).unwrap());
        }
    }
}

/// The pin handshake under loom: every interleaving of a transfer pinning a region against
/// its deregistration. Never both: a pin that saw the region registered, and a retire that
/// saw it unused (that would free memory a transfer is about to touch).
#[cfg(test)]
#[cfg(loom)]
mod loom_model {
    use super::*;

    fn region() -> Arc<RegionInner> {
        Arc::new(RegionInner {
            id: RegionId(7),
            addr: 0x1000,
            len: 4096,
            kind: MemKind::Host,
            alloc: None,
            ucx_mapped: true,
            restricted: false,
            _backing: None,
            shm: None,
            inflight: AtomicU32::new(0),
            registered: AtomicBool::new(true),
        })
    }

    #[test]
    fn a_pin_and_a_retire_never_both_win() {
        loom::model(|| {
            let r = region();
            let r2 = r.clone();
            let pin = loom::thread::spawn(move || {
                let mut p = Pins::default();
                let ok = p.add(&r2).is_ok();
                (ok, p)
            });
            let retired = r.retire().is_ok();
            let (pinned, p) = pin.join().unwrap();
            assert!(!(pinned && retired), "a pinned region was deregistered");
            // Whoever lost backs off cleanly: a busy retire left it registered.
            if !retired {
                assert!(r.registered.load(Ordering::SeqCst) || !pinned);
            }
            drop(p);
            assert_eq!(r.inflight.load(Ordering::SeqCst), 0, "a pin leaked");
        });
    }

    #[test]
    fn a_released_pin_lets_the_next_retire_win() {
        loom::model(|| {
            let r = region();
            let r2 = r.clone();
            let t = loom::thread::spawn(move || {
                let mut p = Pins::default();
                let _ = p.add(&r2);
                p.release();
                p.release(); // Released once, however often asked.
            });
            t.join().unwrap();
            assert!(r.retire().is_ok());
        });
    }
}
