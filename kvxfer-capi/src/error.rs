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

/// The status of every error, variant by variant (a new variant of the library's `Error` maps
/// to `KVX_ERROR` until it is given a status of its own here).
pub(crate) fn status_of(e: &Error) -> kvx_status {
    use kvx_status::*;
    match e {
        Error::Ucx { .. } | Error::UcxVersion { .. } | Error::UcxSetup { .. } => KVX_UCX,
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
        | Error::NoCommonTransport { .. }
        | Error::Frame { .. } => KVX_PEER_FAILED,
        Error::Fenced { .. } => KVX_FENCED,
        Error::Auth { .. } => KVX_AUTH,
        Error::TransportMismatch { .. } => KVX_TRANSPORT_MISMATCH,
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
        Error::PeerLimit { .. } => KVX_PEER_LIMIT,
        // `Error` is non-exhaustive: a variant added later is still an error, never success
        // or a misleading "invalid argument".
        _ => KVX_ERROR,
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

/// Every status, in value order (0, 1, ...).
const STATUSES: [kvx_status; 30] = {
    use kvx_status::*;
    [
        KVX_OK,
        KVX_NULL_PARAMETER,
        KVX_INVALID_ARGUMENT,
        KVX_METADATA,
        KVX_OUT_OF_BOUNDS,
        KVX_UNKNOWN_PEER,
        KVX_PEER_FAILED,
        KVX_BUSY,
        KVX_DEADLINE,
        KVX_TIMEOUT,
        KVX_CANCELED,
        KVX_OUT_OF_MEMORY,
        KVX_IO,
        KVX_UCX,
        KVX_HANDOFF,
        KVX_SHUTDOWN,
        KVX_PANIC,
        KVX_BUFFER_TOO_SMALL,
        KVX_NOT_FOUND,
        KVX_IN_PROGRESS,
        KVX_STALE,
        KVX_DEREGISTERED,
        KVX_INVALID_HANDLE,
        KVX_CUDA,
        KVX_NAME_CONFLICT,
        KVX_AUTH,
        KVX_TRANSPORT_MISMATCH,
        KVX_FENCED,
        KVX_ERROR,
        KVX_PEER_LIMIT,
    ]
};

/// A static name for a status (e.g. "KVX_BUSY"); "KVX_UNKNOWN" for a value that is no status.
/// Takes the integer, so that any value a caller passes is defined behaviour.
#[no_mangle]
pub extern "C" fn kvx_status_name(s: u32) -> *const c_char {
    let n = STATUSES
        .get(s as usize)
        .map_or("KVX_UNKNOWN\0", |&s| status_name(s));
    n.as_ptr().cast()
}

/// The NUL-terminated name of `s`.
fn status_name(s: kvx_status) -> &'static str {
    use kvx_status::*;
    match s {
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
        KVX_AUTH => "KVX_AUTH\0",
        KVX_TRANSPORT_MISMATCH => "KVX_TRANSPORT_MISMATCH\0",
        KVX_FENCED => "KVX_FENCED\0",
        KVX_ERROR => "KVX_ERROR\0",
        KVX_PEER_LIMIT => "KVX_PEER_LIMIT\0",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_status_is_named_by_its_value() {
        for (i, &s) in STATUSES.iter().enumerate() {
            assert_eq!(s as usize, i, "STATUSES is in value order");
            let p = kvx_status_name(i as u32);
            // SAFETY: kvx_status_name returns a static NUL-terminated string.
            let name = unsafe { std::ffi::CStr::from_ptr(p) }.to_str().unwrap();
            assert_eq!(format!("{name}\0"), status_name(s));
            assert_eq!(name, format!("{s:?}"), "the name is the enumerator's");
        }
        // SAFETY: as above.
        let unknown = unsafe { std::ffi::CStr::from_ptr(kvx_status_name(u32::MAX)) };
        assert_eq!(unknown.to_str().unwrap(), "KVX_UNKNOWN");
    }

    #[test]
    fn security_errors_have_their_own_statuses() {
        let auth = Error::Auth {
            peer: "127.0.0.1:1".into(),
            why: "bad proof".into(),
        };
        assert_eq!(status_of(&auth), kvx_status::KVX_AUTH);
        let mismatch = Error::TransportMismatch {
            agent: "b".into(),
            wanted: "shm".into(),
            got: "tcp".into(),
        };
        assert_eq!(status_of(&mismatch), kvx_status::KVX_TRANSPORT_MISMATCH);
        let fenced = Error::Fenced {
            agent: "d".into(),
            epoch: 2,
        };
        assert_eq!(status_of(&fenced), kvx_status::KVX_FENCED);
        assert_eq!(status_of(&Error::Shutdown), kvx_status::KVX_SHUTDOWN);
    }
}
