//! SIGTERM and SIGINT: counted, so that the bench ends in order instead of dying. The first
//! SIGTERM stops taking work (a transfer in flight gets half a second to finish, then is
//! cancelled); SIGINT or a second SIGTERM cancels what is in flight at once. Either way the
//! process deregisters its memory, closes its agent and exits 0 within a second.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kvxfer::{Transfer, XferStats};

use crate::BoxErr;

static TERMS: AtomicUsize = AtomicUsize::new(0);
static INTS: AtomicUsize = AtomicUsize::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    // Only an atomic add: async-signal-safe.
    if sig == libc::SIGINT {
        INTS.fetch_add(1, Ordering::Relaxed);
    } else {
        TERMS.fetch_add(1, Ordering::Relaxed);
    }
}

/// Installs the handlers (once, at start).
pub(crate) fn install() {
    for sig in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: a zeroed sigaction is a valid "no flags, empty mask" value; the handler
        // only touches atomics (async-signal-safe) and stays valid for the process's life.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
}

/// Whether the process was asked to stop.
pub(crate) fn stopping() -> bool {
    TERMS.load(Ordering::Relaxed) + INTS.load(Ordering::Relaxed) > 0
}

/// Whether what is in flight is to be cancelled now (SIGINT, or SIGTERM twice).
fn cancel_now() -> bool {
    INTS.load(Ordering::Relaxed) > 0 || TERMS.load(Ordering::Relaxed) > 1
}

/// What stopped the process, for its last words.
pub(crate) fn reason() -> &'static str {
    match (TERMS.load(Ordering::Relaxed), INTS.load(Ordering::Relaxed)) {
        (_, i) if i > 0 => "SIGINT",
        (t, _) if t > 1 => "a second SIGTERM",
        _ => "SIGTERM",
    }
}

/// Waits for `x`; once asked to stop, gives it until `grace` after the first signal (none on
/// SIGINT or a second SIGTERM) and then cancels it (returning once UCX and the lanes no
/// longer touch its buffers). `Ok(None)`: cancelled.
pub(crate) fn wait(mut x: Transfer) -> Result<Option<XferStats>, BoxErr> {
    const GRACE: Duration = Duration::from_millis(500);
    let mut since: Option<Instant> = None;
    loop {
        match x.wait_timeout(Duration::from_millis(20)) {
            Ok(st) => return Ok(Some(st)),
            Err(kvxfer::Error::WaitTimeout(_)) => {}
            Err(e) => return Err(e.into()),
        }
        if stopping() {
            let t = *since.get_or_insert_with(Instant::now);
            if cancel_now() || t.elapsed() >= GRACE {
                return match x.cancel() {
                    Ok(st) => Ok(Some(st)),
                    Err(kvxfer::Error::Canceled) => Ok(None),
                    Err(e) => Err(e.into()),
                };
            }
        }
    }
}
