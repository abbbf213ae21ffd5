//! CUDA memory shared with same-host peers (feature `cuda`), for the device lane: what kind
//! of allocation a region lies in, its export (a legacy IPC handle for `cuMemAlloc` memory, a
//! POSIX file descriptor for a virtual-memory allocation made shareable, such as PyTorch's
//! expandable segments), and a peer's export opened here, closed on drop. Pool memory
//! (`cuMemAllocAsync`) is refused with what to change: its default pools are not shareable,
//! and UCX would emulate it over TCP (240-800 ms a request, measured).

use std::ffi::c_void;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext};
use kvxfer_proto::error::{Error, Result};
use kvxfer_proto::types::DeviceAlloc;
use kvxfer_proto::wire::shm_fds::{DeviceHandle, IPC_HANDLE_LEN};

use super::copy::{Exported, Opened};

fn err(device: u32, what: &str, e: cudarc::driver::DriverError) -> Error {
    Error::Cuda {
        device,
        why: format!("{what}: {e:?}"),
    }
}

/// The kind of allocation `addr` lies in (the context bound by the caller).
fn kind_at(device: u32, addr: u64) -> Result<DeviceAlloc> {
    let mut pool: *mut c_void = std::ptr::null_mut();
    // SAFETY: the attribute's value is a CUmemoryPool (a pointer); `pool` is a valid out
    // pointer of that size.
    let r = unsafe {
        sys::cuPointerGetAttribute(
            (&mut pool as *mut *mut c_void).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
            addr,
        )
    }
    .result();
    if r.is_ok() && !pool.is_null() {
        return Ok(DeviceAlloc::Pool);
    }
    let mut legacy: i32 = 0;
    // SAFETY: the attribute's value is an int (a boolean); `legacy` is a valid out pointer.
    unsafe {
        sys::cuPointerGetAttribute(
            (&mut legacy as *mut i32).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
            addr,
        )
    }
    .result()
    .map_err(|e| err(device, "cuPointerGetAttribute (is it device memory?)", e))?;
    Ok(if legacy != 0 {
        DeviceAlloc::Plain
    } else {
        DeviceAlloc::Virtual
    })
}

/// The kind of allocation `addr` of `device` lies in.
pub(crate) fn allocation(ctx: &Arc<CudaContext>, device: u32, addr: u64) -> Result<DeviceAlloc> {
    ctx.bind_to_thread()
        .map_err(|e| err(device, "cuCtxSetCurrent", e))?;
    kind_at(device, addr)
}

/// Exports the allocation holding `[addr, addr+len)` for a same-host peer.
pub(crate) fn export(ctx: &Arc<CudaContext>, device: u32, addr: u64, len: u64) -> Result<Exported> {
    ctx.bind_to_thread()
        .map_err(|e| err(device, "cuCtxSetCurrent", e))?;
    let (mut base, mut size) = (0u64, 0usize);
    // SAFETY: valid out pointers.
    unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, addr) }
        .result()
        .map_err(|e| err(device, "cuMemGetAddressRange", e))?;
    if addr + len > base + size as u64 {
        return Err(Error::Cuda {
            device,
            why: format!(
                "[{addr:#x}, +{len}) spans more than one allocation (the first ends at {:#x}): \
                 register each allocation as its own region",
                base + size as u64
            ),
        });
    }
    match kind_at(device, addr)? {
        DeviceAlloc::Plain => {
            // SAFETY: an all-zero handle is a valid value to be overwritten.
            let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
            // SAFETY: valid out pointer; base is the allocation's start.
            unsafe { sys::cuIpcGetMemHandle(&mut h, base) }
                .result()
                .map_err(|e| err(device, "cuIpcGetMemHandle", e))?;
            let mut bytes = [0u8; IPC_HANDLE_LEN];
            for (b, c) in bytes.iter_mut().zip(h.reserved.iter()) {
                *b = *c as u8;
            }
            Ok(Exported {
                handle: DeviceHandle::Ipc(bytes),
                file: None,
                offset: addr - base,
                size: size as u64,
            })
        }
        DeviceAlloc::Virtual => {
            let mut handle: sys::CUmemGenericAllocationHandle = 0;
            // SAFETY: valid out pointer; addr is mapped device memory (checked above).
            unsafe { sys::cuMemRetainAllocationHandle(&mut handle, addr as *mut c_void) }
                .result()
                .map_err(|e| err(device, "cuMemRetainAllocationHandle", e))?;
            let mut fd: i32 = -1;
            // SAFETY: valid out pointer of the POSIX handle type's size (an int).
            let r = unsafe {
                sys::cuMemExportToShareableHandle(
                    (&mut fd as *mut i32).cast(),
                    handle,
                    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    0,
                )
            }
            .result();
            // SAFETY: retained above, released once.
            let _ = unsafe { sys::cuMemRelease(handle) };
            r.map_err(|e| Error::Cuda {
                device,
                why: format!(
                    "a virtual-memory allocation not created shareable as a file descriptor \
                     (cuMemExportToShareableHandle: {e:?}): create it with \
                     requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR"
                ),
            })?;
            // SAFETY: the driver made a new descriptor for this process.
            let file = unsafe { OwnedFd::from_raw_fd(fd) };
            Ok(Exported {
                handle: DeviceHandle::File,
                file: Some(file),
                offset: addr - base,
                size: size as u64,
            })
        }
        _ => pool_refused(device),
    }
}

/// Pool memory: no other process opens it (its default pools are not shareable).
fn pool_refused(device: u32) -> Result<Exported> {
    Err(Error::Cuda {
        device,
        why: "pool memory (cuMemAllocAsync; PyTorch's backend:cudaMallocAsync) cannot be \
              shared with another process: allocate the KV cache with cudaMalloc (PyTorch's \
              default allocator) or expandable segments"
            .into(),
    })
}

/// A peer's allocation opened through a legacy IPC handle.
struct IpcOpened {
    ctx: Arc<CudaContext>,
    base: u64,
}

impl Opened for IpcOpened {
    fn base(&self) -> u64 {
        self.base
    }
}

impl Drop for IpcOpened {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: opened by cuIpcOpenMemHandle, closed only here, after every copy using
            // it (the device lane holds this while a transfer runs).
            let _ = unsafe { sys::cuIpcCloseMemHandle(self.base) };
        }
    }
}

/// A peer's virtual-memory allocation imported and mapped here.
struct VirtualOpened {
    ctx: Arc<CudaContext>,
    base: u64,
    size: usize,
    handle: sys::CUmemGenericAllocationHandle,
}

impl Opened for VirtualOpened {
    fn base(&self) -> u64 {
        self.base
    }
}

impl Drop for VirtualOpened {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: mapped, reserved and imported in `open`, undone once here in reverse.
            unsafe {
                let _ = sys::cuMemUnmap(self.base, self.size);
                let _ = sys::cuMemAddressFree(self.base, self.size);
                let _ = sys::cuMemRelease(self.handle);
            }
        }
    }
}

/// Opens a peer's exported allocation of `size` bytes on `device`.
pub(crate) fn open(
    ctx: &Arc<CudaContext>,
    device: u32,
    handle: &DeviceHandle,
    file: Option<&OwnedFd>,
    size: u64,
) -> Result<Box<dyn Opened>> {
    ctx.bind_to_thread()
        .map_err(|e| err(device, "cuCtxSetCurrent", e))?;
    match (handle, file) {
        (DeviceHandle::Ipc(bytes), _) => {
            // SAFETY: an all-zero handle is a valid value, filled below.
            let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
            for (c, b) in h.reserved.iter_mut().zip(bytes.iter()) {
                *c = *b as _;
            }
            let mut base: sys::CUdeviceptr = 0;
            // SAFETY: valid out pointer; the driver checks the handle.
            unsafe {
                sys::cuIpcOpenMemHandle_v2(
                    &mut base,
                    h,
                    sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                )
            }
            .result()
            .map_err(|e| err(device, "cuIpcOpenMemHandle (a peer's allocation)", e))?;
            let opened = IpcOpened {
                ctx: ctx.clone(),
                base,
            };
            // The size is the peer's word: copies past the allocation's real end would fault
            // the device (and this process's context with it). The driver's word decides.
            let (mut b, mut real) = (0u64, 0usize);
            // SAFETY: valid out pointers; base was just opened.
            unsafe { sys::cuMemGetAddressRange_v2(&mut b, &mut real, base) }
                .result()
                .map_err(|e| err(device, "cuMemGetAddressRange (a peer's allocation)", e))?;
            if b != base || (real as u64) < size {
                return Err(Error::Cuda {
                    device,
                    why: format!(
                        "a peer's allocation opened at {base:#x} holds {real} bytes from \
                         {b:#x}, its hand-over said {size}: refused"
                    ),
                });
            }
            Ok(Box::new(opened))
        }
        (DeviceHandle::File, Some(fd)) => {
            let size = size as usize;
            let mut h: sys::CUmemGenericAllocationHandle = 0;
            // SAFETY: valid out pointer; the POSIX handle is passed as the descriptor's value
            // (the driver dups what it keeps).
            unsafe {
                sys::cuMemImportFromShareableHandle(
                    &mut h,
                    fd.as_raw_fd() as usize as *mut c_void,
                    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                )
            }
            .result()
            .map_err(|e| err(device, "cuMemImportFromShareableHandle", e))?;
            let mut base: sys::CUdeviceptr = 0;
            // SAFETY: valid out pointer; size is the exporter's allocation size (a multiple
            // of its granularity).
            if let Err(e) = unsafe { sys::cuMemAddressReserve(&mut base, size, 0, 0, 0) }.result() {
                // SAFETY: imported above, released once.
                let _ = unsafe { sys::cuMemRelease(h) };
                return Err(err(device, "cuMemAddressReserve", e));
            }
            let opened = VirtualOpened {
                ctx: ctx.clone(),
                base,
                size,
                handle: h,
            };
            // SAFETY: the reserved range is `size` bytes, the allocation too.
            unsafe { sys::cuMemMap(base, size, 0, h, 0) }
                .result()
                .map_err(|e| err(device, "cuMemMap", e))?;
            let access = sys::CUmemAccessDesc {
                location: sys::CUmemLocation {
                    type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                    id: device as i32,
                },
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            // SAFETY: the range was just mapped; one descriptor.
            unsafe { sys::cuMemSetAccess(base, size, &access, 1) }
                .result()
                .map_err(|e| err(device, "cuMemSetAccess", e))?;
            Ok(Box::new(opened))
        }
        (DeviceHandle::File, None) => Err(Error::Cuda {
            device,
            why: "a file handle without its descriptor".into(),
        }),
    }
}
