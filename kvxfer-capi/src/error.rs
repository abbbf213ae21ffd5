//! Statuses, the thread-local last error, and the panic boundary around every exported body.

use std::cell::RefCell;
use std::ffi::c_char;
use std::panic::{catch_unwind, AssertUnwindSafe};

use kvxfer_core::Error;

use crate::kvx_status;

thread_local! {
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
}

pub(crate) fn set_error(msg: String) {
    LAST_ERROR.with(|e| *e.borrow_mut() = msg);
}

/// A failed call: its status and the message for `kvx_last_error`.
pub(crate) struct Fail(pub(crate) kvx_status, pub(crate) String);

impl From<Error> for Fail {
    fn from(e: Error) -> Fail {
        Fail(status_of(&e), e.to_string())
    }
}

pub(crate) fn status_of(e: &Error) -> kvx_status {
    use kvx_status::*;
    match e {
        Error::Ucx { .. } | Error::UcxVersion { .. } => KVX_UCX,
        Error::Metadata { .. } => KVX_METADATA,
        Error::UnknownRegion { .. }
        | Error::OutOfBounds { .. }
        | Error::ZeroLength { .. }
        | Error::BadIndex { .. }
        | Error::LengthMismatch { .. } => KVX_OUT_OF_BOUNDS,
        Error::UnknownPeer { .. } => KVX_UNKNOWN_PEER,
        Error::StalePeer { .. } => KVX_STALE,
        Error::PeerFailed { .. }
        | Error::LaneFailed { .. }
        | Error::Fenced { .. }
        | Error::NoCommonTransport { .. }
        | Error::Frame { .. } => KVX_PEER_FAILED,
        Error::Handoff { .. } => KVX_HANDOFF,
        Error::Busy { .. } => KVX_BUSY,
        Error::Deregistered { .. } => KVX_DEREGISTERED,
        Error::Deadline { .. } => KVX_DEADLINE,
        Error::WaitTimeout(_) => KVX_TIMEOUT,
        Error::Canceled => KVX_CANCELED,
        Error::InvalidArgument(_) => KVX_INVALID_ARGUMENT,
        Error::OutOfMemory(_) => KVX_OUT_OF_MEMORY,
        Error::Io { .. } | Error::Protocol { .. } | Error::Registry { .. } => KVX_IO,
        Error::Shutdown => KVX_SHUTDOWN,
        Error::Cuda { .. } => KVX_CUDA,
        Error::NameConflict { .. } => KVX_NAME_CONFLICT,
        _ => KVX_INVALID_ARGUMENT,
    }
}

pub(crate) fn fail(s: kvx_status, msg: impl Into<String>) -> Fail {
    Fail(s, msg.into())
}

/// Runs `f` inside the panic boundary; records the error message on failure.
pub(crate) fn guard(name: &str, f: impl FnOnce() -> Result<(), Fail>) -> kvx_status {
    // Every call starts with no error recorded: a message read after a success is never an
    // older call's (a call that succeeds with a message, as `kvx_consumer_next_failed`,
    // sets it itself).
    LAST_ERROR.with(|e| e.borrow_mut().clear());
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => kvx_status::KVX_OK,
        Ok(Err(Fail(s, m))) => {
            set_error(format!("{name}: {m}"));
            s
        }
        Err(p) => {
            let why = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            set_error(format!("{name}: kvxfer panicked (a bug): {why}"));
            kvx_status::KVX_PANIC
        }
    }
}

/// Copies the calling thread's last error message (NUL-terminated, truncated to `cap`) into
/// `buf`; returns its full length without the NUL. 0: no error recorded.
///
/// # Safety
/// `buf` is valid for writes of `cap` bytes, or NULL with `cap` 0.
#[no_mangle]
pub unsafe extern "C" fn kvx_last_error(buf: *mut c_char, cap: usize) -> usize {
    let r = catch_unwind(|| {
        LAST_ERROR.with(|e| {
            let e = e.borrow();
            if !buf.is_null() && cap > 0 {
                let n = e.len().min(cap - 1);
                // SAFETY: buf valid for cap bytes; n + 1 <= cap.
                unsafe {
                    std::ptr::copy_nonoverlapping(e.as_ptr(), buf.cast(), n);
                    *buf.add(n) = 0;
                }
            }
            e.len()
        })
    });
    r.unwrap_or(0)
}

/// A static name for a status (e.g. "KVX_BUSY").
#[no_mangle]
pub extern "C" fn kvx_status_name(s: kvx_status) -> *const c_char {
    use kvx_status::*;
    let n: &'static str = match s {
        KVX_OK => "KVX_OK\0",
        KVX_NULL_PARAMETER => "KVX_NULL_PARAMETER\0",
        KVX_INVALID_ARGUMENT => "KVX_INVALID_ARGUMENT\0",
        KVX_METADATA => "KVX_METADATA\0",
        KVX_OUT_OF_BOUNDS => "KVX_OUT_OF_BOUNDS\0",
        KVX_UNKNOWN_PEER => "KVX_UNKNOWN_PEER\0",
        KVX_PEER_FAILED => "KVX_PEER_FAILED\0",
        KVX_BUSY => "KVX_BUSY\0",
        KVX_DEADLINE => "KVX_DEADLINE\0",
        KVX_TIMEOUT => "KVX_TIMEOUT\0",
        KVX_CANCELED => "KVX_CANCELED\0",
        KVX_OUT_OF_MEMORY => "KVX_OUT_OF_MEMORY\0",
        KVX_IO => "KVX_IO\0",
        KVX_UCX => "KVX_UCX\0",
        KVX_HANDOFF => "KVX_HANDOFF\0",
        KVX_SHUTDOWN => "KVX_SHUTDOWN\0",
        KVX_PANIC => "KVX_PANIC\0",
        KVX_BUFFER_TOO_SMALL => "KVX_BUFFER_TOO_SMALL\0",
        KVX_NOT_FOUND => "KVX_NOT_FOUND\0",
        KVX_IN_PROGRESS => "KVX_IN_PROGRESS\0",
        KVX_STALE => "KVX_STALE\0",
        KVX_DEREGISTERED => "KVX_DEREGISTERED\0",
        KVX_INVALID_HANDLE => "KVX_INVALID_HANDLE\0",
        KVX_CUDA => "KVX_CUDA\0",
        KVX_NAME_CONFLICT => "KVX_NAME_CONFLICT\0",
    };
    n.as_ptr().cast()
}
