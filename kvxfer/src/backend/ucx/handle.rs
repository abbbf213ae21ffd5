//! Owners of UCX handles over [`raw`] (cudarc's safe layer over its result layer): each value
//! owns one handle, keeps its parent alive with an `Rc`, and releases the handle on drop, so no
//! error path destroys a handle by hand and no handle outlives its parent. They are `!Send`
//! (the `Rc`s): they live on the progress thread, moved there once inside the engine.
//!
//! Order rules UCX sets, and where they are kept:
//! - memory handles and workers before their context: their `Rc<Context>`;
//! - endpoints and remote keys before their worker: their `Rc<Worker>`;
//! - a remote key after the operations that use it and, on a graceful close, before its
//!   endpoint: the engine drops a peer's keys first (see `Engine::close_peer`); on a forced
//!   close it keeps them with the close's [`Request`] until that completes.

use std::ffi::{c_void, CStr};
use std::ptr::NonNull;
use std::rc::Rc;
use std::sync::{Arc, RwLock};

use super::raw::{self, Posted};
use kvxfer_proto::error::UcsStatus;

/// A UCP context (`ucp_init` / `ucp_cleanup`).
#[derive(Debug)]
pub(crate) struct Context {
    h: raw::ucp_context_h,
}

impl Context {
    /// `ucp_init` with `settings`; the error names the call that failed.
    pub(crate) fn new(
        settings: &[(String, String)],
        name: &CStr,
    ) -> Result<Rc<Context>, (String, UcsStatus)> {
        raw::context_new(settings, name).map(|h| Rc::new(Context { h }))
    }

    /// The memory types this context supports.
    pub(crate) fn memory_types(&self) -> u64 {
        // SAFETY: the context is live while self is.
        unsafe { raw::context_memory_types(self.h) }
    }

    /// Maps `[addr, addr+len)` (`ucp_mem_map`, told the memory type of device memory).
    ///
    /// # Safety
    /// 1. The memory stays valid until the returned handle is dropped or unmapped.
    pub(crate) unsafe fn map(
        self: &Rc<Self>,
        addr: *mut u8,
        len: usize,
        cuda: bool,
    ) -> Result<MemHandle, UcsStatus> {
        // SAFETY: the context is live; the caller upholds the memory's validity (1).
        let h = unsafe { raw::mem_map(self.h, addr, len, cuda) }?;
        Ok(MemHandle {
            h: Some(h),
            ctx: self.clone(),
            _live: crate::live::Counted::ucx_registration(),
        })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: cleaned up once, here; every worker and memory handle holds an Rc of this
        // context, so none is left.
        unsafe { raw::context_destroy(self.h) }
    }
}

/// A memory registration (`ucp_mem_map` / `ucp_mem_unmap`).
#[derive(Debug)]
pub(crate) struct MemHandle {
    /// None once unmapped.
    h: Option<raw::ucp_mem_h>,
    ctx: Rc<Context>,
    _live: crate::live::Counted,
}

impl MemHandle {
    /// The packed remote key of this registration.
    pub(crate) fn rkey(&self) -> Result<Vec<u8>, UcsStatus> {
        let h = self.h.unwrap_or(std::ptr::null_mut());
        // SAFETY: the handle is live (unmapping consumes self) and belongs to `ctx`.
        unsafe { raw::rkey_pack(self.ctx.h, h) }
    }

    /// Unmaps now, reporting UCX's status (dropping unmaps and only logs a failure).
    pub(crate) fn unmap(mut self) -> Result<(), UcsStatus> {
        match self.h.take() {
            // SAFETY: the handle is live and unmapped once (taken out of self).
            Some(h) => unsafe { raw::mem_unmap(self.ctx.h, h) },
            None => Ok(()),
        }
    }
}

impl Drop for MemHandle {
    fn drop(&mut self) {
        if let Some(h) = self.h.take() {
            // SAFETY: the handle is live and unmapped once, here (taken out of self).
            if let Err(s) = unsafe { raw::mem_unmap(self.ctx.h, h) } {
                log::warn!("kvxfer: ucp_mem_unmap: {s}");
            }
        }
    }
}

/// A UCP worker (`ucp_worker_create` / `ucp_worker_destroy`) and the slot other threads wake
/// it through.
#[derive(Debug)]
pub(crate) struct Worker {
    h: raw::ucp_worker_h,
    slot: Arc<RwLock<Option<WorkerPtr>>>,
    _ctx: Rc<Context>,
}

impl Worker {
    /// A worker of `ctx`, with wakeup events.
    pub(crate) fn new(ctx: &Rc<Context>) -> Result<Rc<Worker>, UcsStatus> {
        // SAFETY: the context is live (its Rc).
        let h = unsafe { raw::worker_new(ctx.h) }?;
        Ok(Rc::new(Worker {
            h,
            slot: Arc::new(RwLock::new(Some(WorkerPtr(h)))),
            _ctx: ctx.clone(),
        }))
    }

    /// The raw handle, for calls on this (the engine's) thread.
    pub(crate) fn as_ptr(&self) -> raw::ucp_worker_h {
        self.h
    }

    /// A waker for other threads; it does nothing once the worker is gone.
    pub(crate) fn waker(&self) -> WorkerWaker {
        WorkerWaker {
            worker: self.slot.clone(),
        }
    }

    /// An endpoint to the worker at `addr`; `err_arg` is passed to `err_cb` on failure.
    pub(crate) fn connect(
        self: &Rc<Self>,
        addr: &[u8],
        err_cb: raw::ErrCb,
        err_arg: *mut c_void,
        peer_failure: bool,
    ) -> Result<Endpoint, UcsStatus> {
        // SAFETY: the worker is live and used by this thread only (its Rc is !Send); err_arg
        // is a plain token, not a pointer, and err_cb accepts any endpoint.
        let h = unsafe { raw::ep_new(self.h, addr, err_cb, err_arg, peer_failure) }?;
        Ok(Endpoint {
            h: Some(h),
            worker: self.clone(),
        })
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Other threads stop signalling before the worker goes (they hold the read lock while
        // they signal).
        *self.slot.write().unwrap_or_else(|e| e.into_inner()) = None;
        // SAFETY: destroyed once, here; every endpoint and key holds an Rc of this worker, so
        // none is left; no other thread can reach it (slot cleared).
        unsafe { raw::worker_destroy(self.h) }
    }
}

/// Wakes the engine from any thread (`ucp_worker_signal`), valid until the worker is gone.
#[derive(Debug)]
pub(crate) struct WorkerWaker {
    worker: Arc<RwLock<Option<WorkerPtr>>>,
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct WorkerPtr(raw::ucp_worker_h);
// SAFETY: the pointer is only used for ucp_worker_signal, which UCX documents as thread-safe,
// and only while the RwLock holds Some (the worker's Drop takes the write lock and sets None
// before destroying it).
unsafe impl Send for WorkerPtr {}
// SAFETY: as above; shared access only ever calls ucp_worker_signal.
unsafe impl Sync for WorkerPtr {}

impl WorkerWaker {
    pub(crate) fn wake(&self) {
        let g = self.worker.read().unwrap_or_else(|e| e.into_inner());
        if let Some(w) = *g {
            // SAFETY: Some means the worker is live (see WorkerPtr); signal is thread-safe.
            if let Err(s) = unsafe { raw::worker_signal(w.0) } {
                log::warn!("ucp_worker_signal failed: {s}");
            }
        }
    }
}

/// An endpoint (`ucp_ep_create` / `ucp_ep_close_nbx`). Close it with [`Endpoint::close`];
/// dropping one that was not closed closes it forcibly.
#[derive(Debug)]
pub(crate) struct Endpoint {
    h: Option<raw::ucp_ep_h>,
    worker: Rc<Worker>,
}

impl Endpoint {
    /// The raw handle, for operations on this (the engine's) thread.
    pub(crate) fn as_ptr(&self) -> raw::ucp_ep_h {
        self.h.unwrap_or(std::ptr::null_mut())
    }

    /// Unpacks a peer's packed remote key for this endpoint.
    pub(crate) fn unpack(&self, packed: &[u8]) -> Result<Rkey, UcsStatus> {
        // SAFETY: the endpoint is live and used by this thread only.
        let h = unsafe { raw::rkey_unpack(self.as_ptr(), packed) }?;
        Ok(Rkey {
            h,
            _worker: self.worker.clone(),
        })
    }

    /// Closes the endpoint (`force`: outstanding operations complete with an error). A
    /// pending close is a [`Request`] to progress until done.
    pub(crate) fn close(mut self, force: bool) -> Result<Option<Request>, UcsStatus> {
        let Some(h) = self.h.take() else {
            return Ok(None);
        };
        // SAFETY: the endpoint is live and closed once (taken out of self).
        match unsafe { raw::ep_close(h, force) }? {
            Posted::Done => Ok(None),
            Posted::Pending(r) => Ok(Some(Request {
                h: r,
                _worker: self.worker.clone(),
            })),
        }
    }

    /// Details of the endpoint's lanes (`ucp_ep_print_info`).
    pub(crate) fn info(&self) -> String {
        // SAFETY: the endpoint is live on this thread.
        unsafe { raw::ep_info(self.as_ptr()) }
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        if let Some(h) = self.h.take() {
            // SAFETY: the endpoint is live and closed once, here; a pending close request is
            // freed at once (UCX releases it when the close completes).
            match unsafe { raw::ep_close(h, true) } {
                // SAFETY: the request is live and freed once, never used after.
                Ok(Posted::Pending(r)) => unsafe { raw::request_free(r) },
                Ok(Posted::Done) => {}
                Err(s) => log::debug!("kvxfer: ucp_ep_close_nbx: {s}"),
            }
        }
    }
}

/// An unpacked remote key (`ucp_ep_rkey_unpack` / `ucp_rkey_destroy`).
#[derive(Debug)]
pub(crate) struct Rkey {
    h: raw::ucp_rkey_h,
    _worker: Rc<Worker>,
}

impl Rkey {
    /// The raw handle, for operations on this (the engine's) thread.
    pub(crate) fn as_ptr(&self) -> raw::ucp_rkey_h {
        self.h
    }
}

impl Drop for Rkey {
    fn drop(&mut self) {
        // SAFETY: destroyed once, here; the engine drops a key only when no operation using
        // it is outstanding (module docs).
        unsafe { raw::rkey_destroy(self.h) }
    }
}

/// A UCX request the engine waits on (an endpoint close); freed on drop.
#[derive(Debug)]
pub(crate) struct Request {
    h: NonNull<c_void>,
    _worker: Rc<Worker>,
}

impl Request {
    /// Whether UCX has completed it.
    pub(crate) fn done(&self) -> bool {
        // SAFETY: the request is live (freed only in Drop).
        let s = unsafe { raw::request_status(self.h) };
        s != UcsStatus::INPROGRESS
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        // SAFETY: the request is live, freed once, here; UCX releases an unfinished one when
        // it completes.
        unsafe { raw::request_free(self.h) }
    }
}
