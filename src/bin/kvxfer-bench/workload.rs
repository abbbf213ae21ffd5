//! What one point of a sweep moves: buffers (host, simulated or CUDA device memory), block
//! placement, byte patterns and their verification, the agents' configuration.

use std::sync::Arc;

use kvxfer::staging::{CopyEngine, SimulatedDevice, StagingShape};
use kvxfer::{Agent, AgentConfig, HostBuffer, MemKind, MemoryBudget, Region, Share, Transport};
use rand::seq::SliceRandom;
use rand::SeedableRng;

use crate::cli::{Args, CudaAlloc, MemArg, Op, Placement};
use crate::BoxErr;

/// One point of a sweep.
#[derive(Clone, Debug)]
pub(crate) struct Case {
    pub(crate) op: Op,
    pub(crate) transport: String,
    pub(crate) blocks: u64,
    pub(crate) block_size: u64,
    pub(crate) placement: Placement,
    pub(crate) compress: kvxfer::Compression,
}

impl Case {
    /// Slots on the wire per request, and in all.
    pub(crate) fn total_blocks(&self, conc: u64) -> u64 {
        self.blocks * conc.max(1)
    }
}

/// A process's device memory: the copy engine, and for the simulated device the device.
#[derive(Clone)]
pub(crate) struct Device {
    pub(crate) engine: Arc<dyn CopyEngine>,
    pub(crate) sim: Option<SimulatedDevice>,
}

pub(crate) fn device(args: &Args) -> Result<Option<Device>, BoxErr> {
    match args.memory {
        MemArg::Host | MemArg::Thp => Ok(None),
        MemArg::Sim => {
            let sim = SimulatedDevice::new();
            Ok(Some(Device {
                engine: sim.engine(),
                sim: Some(sim),
            }))
        }
        #[cfg(feature = "cuda")]
        MemArg::Cuda => {
            kvxfer::cuda::probe(args.device)?;
            Ok(Some(Device {
                engine: Arc::new(kvxfer::cuda::CudaCopyEngine::new()),
                sim: None,
            }))
        }
        #[cfg(not(feature = "cuda"))]
        MemArg::Cuda => Err("--memory cuda needs kvxfer-bench built with --features cuda".into()),
    }
}

/// A registered KV buffer, host or device, and how to reach its bytes from the host.
pub(crate) struct Buf {
    pub(crate) region: Region,
    pub(crate) dev: Option<(Device, u32)>,
    /// Device memory the bench allocated; freed only after [`Buf::release`].
    alloc: Option<PlainDeviceAlloc>,
}

impl Buf {
    pub(crate) fn new(
        agent: &Agent,
        dev: &Option<Device>,
        args: &Args,
        len: usize,
        share: Share,
    ) -> Result<Buf, BoxErr> {
        let Some(d) = dev else {
            let b = match args.memory {
                MemArg::Thp => HostBuffer::huge(len)?,
                _ => HostBuffer::new(len)?,
            };
            return Ok(Buf {
                region: agent.register_shared(b, share)?,
                dev: None,
                alloc: None,
            });
        };
        let (region, alloc) = match &d.sim {
            Some(sim) => {
                let addr = sim.alloc(len)?;
                // SAFETY: the simulated allocation lives as long as the device, which `Buf`
                // holds past the registration (deregistered before the device goes).
                let r = unsafe {
                    agent.register_raw_shared(
                        addr as *mut u8,
                        len,
                        MemKind::Cuda(args.device),
                        share,
                    )
                }?;
                (r, None)
            }
            None => cuda_region(agent, args.device, len, args.cuda_alloc, share)?,
        };
        Ok(Buf {
            region,
            dev: Some((d.clone(), args.device)),
            alloc,
        })
    }

    /// Deregisters the region, then frees device memory the bench allocated.
    pub(crate) fn release(mut self, agent: &Agent) -> kvxfer::Result<()> {
        agent.deregister(&self.region)?;
        if let Some(a) = &mut self.alloc {
            a.deregistered();
        }
        Ok(())
    }

    pub(crate) fn write(&self, off: u64, data: &[u8]) -> kvxfer::Result<()> {
        match &self.dev {
            None => self.region.write(off, data),
            Some((d, dev)) => {
                check(&self.region, off, data.len())?;
                let mut q = d.engine.queue(*dev)?;
                // SAFETY: the range lies inside the registered device region (checked); `data`
                // lives until the sync below.
                unsafe { q.to_device(data.as_ptr(), self.region.addr() + off, data.len()) }?;
                q.sync()
            }
        }
    }

    pub(crate) fn read(&self, off: u64, out: &mut [u8]) -> kvxfer::Result<()> {
        match &self.dev {
            None => self.region.read(off, out),
            Some((d, dev)) => {
                check(&self.region, off, out.len())?;
                let mut q = d.engine.queue(*dev)?;
                // SAFETY: as in write; `out` is not touched until the sync.
                unsafe { q.to_host(self.region.addr() + off, out.as_mut_ptr(), out.len()) }?;
                q.sync()
            }
        }
    }
}

pub(crate) fn check(r: &Region, off: u64, len: usize) -> kvxfer::Result<()> {
    if off.checked_add(len as u64).is_none_or(|e| e > r.len()) {
        return Err(kvxfer::Error::InvalidArgument(format!(
            "[{off}, +{len}) outside a region of {} bytes",
            r.len()
        )));
    }
    Ok(())
}

/// A cuMemAlloc allocation, freed on drop once its region is deregistered
/// ([`Buf::release`]); left allocated otherwise (an error path: the process ends soon).
#[cfg(feature = "cuda")]
pub(crate) struct PlainDeviceAlloc {
    ctx: std::sync::Arc<cudarc::driver::CudaContext>,
    ptr: cudarc::driver::sys::CUdeviceptr,
    /// A virtual-memory allocation: its handle and mapped size.
    vmm: Option<(cudarc::driver::sys::CUmemGenericAllocationHandle, usize)>,
    deregistered: bool,
}

#[cfg(feature = "cuda")]
impl Drop for PlainDeviceAlloc {
    fn drop(&mut self) {
        use cudarc::driver::sys;
        if !self.deregistered || self.ctx.bind_to_thread().is_err() {
            return;
        }
        match self.vmm {
            // SAFETY: mapped, reserved and created by vmm_alloc in this context, undone once
            // here, after the agent deregistered the region over it.
            Some((h, size)) => unsafe {
                let _ = sys::cuMemUnmap(self.ptr, size);
                let _ = sys::cuMemAddressFree(self.ptr, size);
                let _ = sys::cuMemRelease(h);
            },
            None => {
                // SAFETY: ptr came from malloc_sync in this context and is freed only here,
                // after the agent deregistered the region over it (register_raw's contract).
                let _ = unsafe { cudarc::driver::result::free_sync(self.ptr) };
            }
        }
    }
}

/// `len` bytes (rounded up to the allocation granularity) of virtual memory on `device`,
/// created shareable as a POSIX file descriptor, reserved, mapped and made read-write: what
/// PyTorch's expandable segments allocate.
#[cfg(feature = "cuda")]
fn vmm_alloc(
    ctx: std::sync::Arc<cudarc::driver::CudaContext>,
    device: u32,
    len: usize,
) -> Result<PlainDeviceAlloc, BoxErr> {
    use cudarc::driver::sys;
    let location = sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: device as i32,
    };
    // SAFETY: an all-zero property is valid (no flags); the fields that matter are set next.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes =
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location = location;
    let mut gran = 0usize;
    // SAFETY: valid pointers.
    unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut gran,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    }
    .result()?;
    let size = len.next_multiple_of(gran.max(1));
    let mut h: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: valid pointers; the context is current (the caller bound it).
    unsafe { sys::cuMemCreate(&mut h, size, &prop, 0) }.result()?;
    let mut ptr: sys::CUdeviceptr = 0;
    // SAFETY: valid out pointer.
    if let Err(e) = unsafe { sys::cuMemAddressReserve(&mut ptr, size, 0, 0, 0) }.result() {
        // SAFETY: created above, released once.
        let _ = unsafe { sys::cuMemRelease(h) };
        return Err(e.into());
    }
    let guard = PlainDeviceAlloc {
        ctx,
        ptr,
        vmm: Some((h, size)),
        deregistered: true, // nothing registered over it yet: undo on any error below
    };
    // SAFETY: the reserved range and the allocation are both `size` bytes.
    unsafe { sys::cuMemMap(ptr, size, 0, h, 0) }.result()?;
    let access = sys::CUmemAccessDesc {
        location,
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: the range was just mapped; one descriptor.
    unsafe { sys::cuMemSetAccess(ptr, size, &access, 1) }.result()?;
    let mut guard = guard;
    guard.deregistered = false;
    Ok(guard)
}

#[cfg(feature = "cuda")]
impl PlainDeviceAlloc {
    /// The region over it is deregistered: drop may free it.
    fn deregistered(&mut self) {
        self.deregistered = true;
    }
}

/// Without the `cuda` feature no device memory is allocated.
#[cfg(not(feature = "cuda"))]
pub(crate) enum PlainDeviceAlloc {}

#[cfg(not(feature = "cuda"))]
impl PlainDeviceAlloc {
    fn deregistered(&mut self) {
        match *self {}
    }
}

/// The device's primary context, retained for the whole process. Each case of a sweep makes
/// a new agent; had the previous case's buffers released the primary context (cudarc
/// releases it with its last `CudaContext`), it would stay current on this thread after its
/// destruction, and the next agent's UCX init (the cuda_copy memory domain sets flags on the
/// current context) crashed inside libcuda (seen on an H200, driver 580, UCX 1.22).
#[cfg(feature = "cuda")]
fn process_context(device: u32) -> Result<std::sync::Arc<cudarc::driver::CudaContext>, BoxErr> {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex, OnceLock};
    static CTX: OnceLock<Mutex<HashMap<u32, Arc<cudarc::driver::CudaContext>>>> = OnceLock::new();
    let mut m = CTX
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(c) = m.get(&device) {
        return Ok(c.clone());
    }
    let c = cudarc::driver::CudaContext::new(device as usize)?;
    m.insert(device, c.clone());
    Ok(c)
}

/// Device memory for --memory cuda: cuMemAlloc (plain) like PyTorch's caching allocator, or
/// cudarc's stream-ordered pool (which CUDA IPC cannot export: UCX then moves it by software
/// emulation over its host transports).
#[cfg(feature = "cuda")]
pub(crate) fn cuda_region(
    agent: &Agent,
    device: u32,
    len: usize,
    alloc: CudaAlloc,
    share: Share,
) -> Result<(Region, Option<PlainDeviceAlloc>), BoxErr> {
    let ctx = process_context(device)?;
    if alloc == CudaAlloc::Pool {
        let buf = ctx.default_stream().alloc_zeros::<u8>(len)?;
        return Ok((agent.register_shared(buf, share)?, None));
    }
    ctx.bind_to_thread()?;
    let guard = if alloc == CudaAlloc::Vmm {
        vmm_alloc(ctx, device, len)?
    } else {
        // SAFETY: the context is current on this thread (bound above); the new allocation
        // is owned by the guard below and zeroed before any use.
        let ptr = unsafe { cudarc::driver::result::malloc_sync(len) }?;
        PlainDeviceAlloc {
            ctx,
            ptr,
            vmm: None,
            deregistered: false,
        }
    };
    let ptr = guard.ptr;
    // SAFETY: ptr is a live allocation of len bytes in this context.
    unsafe { cudarc::driver::result::memset_d8_sync(ptr, 0, len) }?;
    // SAFETY: the guard frees the allocation only after Buf::release has deregistered the
    // region (register_raw's contract); on any other path it is never freed.
    let region =
        unsafe { agent.register_raw_shared(ptr as *mut u8, len, MemKind::Cuda(device), share) }?;
    Ok((region, Some(guard)))
}

#[cfg(not(feature = "cuda"))]
pub(crate) fn cuda_region(
    _: &Agent,
    _: u32,
    _: usize,
    _: CudaAlloc,
    _: Share,
) -> Result<(Region, Option<PlainDeviceAlloc>), BoxErr> {
    Err("--memory cuda needs kvxfer-bench built with --features cuda".into())
}

/// This process's agent name in `role` (`init` or `peer`).
pub(crate) fn agent_name(args: &Args, role: &str) -> String {
    match (&args.name, args.serve) {
        (Some(n), _) => n.clone(),
        // The peer of --etcd: the name the initiator's --peer looks for.
        (None, true) => args.peer.clone(),
        (None, false) => format!("bench-{role}-{}", std::process::id()),
    }
}

pub(crate) fn agent_config(
    args: &Args,
    transport: &str,
    role: &str,
    local_peer: bool,
) -> Result<AgentConfig, BoxErr> {
    let staging = StagingShape::new(args.staging_chunks, (args.staging_chunk_kib << 10) as usize)?;
    let mut c = AgentConfig::new(agent_name(args, role))
        .transport(Transport::parse(transport))
        .busy_poll(args.busy_poll)
        .stripes(args.stripes)
        .lanes(!args.ucx_only)
        .ucx_tcp(args.ucx_only)
        .ucx_emulated_shm(args.ucx_only)
        .device_lane(!args.no_device_lane)
        .lane_window(!args.no_lane_window)
        .gpu_path(args.gpu_path)
        .peer_failure(if args.no_peer_failure {
            Some(false)
        } else {
            None
        })
        .staging(staging)
        .max_op_bytes(args.max_op)
        .budget(match args.budget_mib {
            0 => MemoryBudget::unlimited(),
            m => MemoryBudget::new(m << 20),
        });
    if args.compress_threads > 0 {
        c = c.compress_threads(args.compress_threads);
    }
    if let Some(s) = &args.secret {
        c = c
            .secret(s.as_bytes().to_vec())
            .lane_encryption(args.lane_encryption);
    }
    Ok(match (&args.net_devices, local_peer) {
        (Some(d), _) => c.net_devices(d.clone()),
        (None, true) => c.net_devices("lo"),
        (None, false) => c,
    })
}

/// Slot of the k-th block on each side.
pub(crate) fn placement(p: Placement, n: u64, seed: u64) -> (Vec<u64>, Vec<u64>) {
    let mut l: Vec<u64> = (0..n).collect();
    let mut r = l.clone();
    if p == Placement::Random {
        l.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
        r.shuffle(&mut rand::rngs::StdRng::seed_from_u64(
            seed ^ 0x9e37_79b9_7f4a_7c15,
        ));
    }
    (l, r)
}

/// A data seed with this bit set asks for KV-like blocks ([`crate::kvdata`]), not random ones.
pub(crate) const KV_DATA: u64 = 1 << 63;

/// Deterministic content of block k for a data seed: both processes can compute it.
pub(crate) fn pattern(seed: u64, k: u64, out: &mut [u8]) {
    if seed & KV_DATA != 0 {
        return crate::kvdata::kv_block(seed & !KV_DATA, k, out);
    }
    let mut x = seed ^ (k.wrapping_mul(0x9e37_79b9_7f4a_7c15)) ^ 0xd1b5_4a32_d192_ed03;
    for c in out.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        c.copy_from_slice(&b[..c.len()]);
    }
}

pub(crate) fn fill(r: &Buf, slots: &[u64], bs: u64, seed: u64) -> kvxfer::Result<()> {
    let mut buf = vec![0u8; bs as usize];
    for (k, &s) in slots.iter().enumerate() {
        pattern(seed, k as u64, &mut buf);
        r.write(s * bs, &buf)?;
    }
    Ok(())
}

pub(crate) fn clear(r: &Buf) -> kvxfer::Result<()> {
    let zero = vec![0u8; 1 << 20];
    let mut off = 0;
    while off < r.region.len() {
        let n = (r.region.len() - off).min(zero.len() as u64);
        r.write(off, &zero[..n as usize])?;
        off += n;
    }
    Ok(())
}

pub(crate) fn verify(r: &Buf, slots: &[u64], bs: u64, seed: u64) -> kvxfer::Result<bool> {
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
