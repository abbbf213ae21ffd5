//! Stopping in order on SIGTERM and SIGINT, for the processes that opt in with [`install`]
//! (kvxfer-bench, the examples, C callers through `kvx_stop_signals_install`): the signals
//! are counted, and the process's loops ask [`requested`] and end. The first SIGTERM stops
//! taking work, and a transfer in flight gets a grace to finish ([`wait`]); SIGINT or a
//! second SIGTERM cancels what is in flight at once ([`cancel_now`]). The process then drops
//! its agents, which deregisters its memory, and exits 0 ([`crate::live::live`] shows what is
//! left: nothing).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Once;
use std::time::{Duration, Instant};

use crate::transfer::{Transfer, XferStats};
use kvxfer_proto::error::{Error, Result};

static TERMS: AtomicUsize = AtomicUsize::new(0);
static INTS: AtomicUsize = AtomicUsize::new(0);
static INSTALL: Once = Once::new();

extern "C" fn on_signal(sig: libc::c_int) {
    // Only an atomic add: async-signal-safe.
    if sig == libc::SIGINT {
        INTS.fetch_add(1, Ordering::Relaxed);
    } else {
        TERMS.fetch_add(1, Ordering::Relaxed);
    }
}

/// Installs the SIGTERM and SIGINT handlers (once; later calls do nothing). They replace the
/// process's: call it only where kvxfer's caller owns the process's signals.
pub fn install() {
    INSTALL.call_once(|| {
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
    });
}

/// Whether the process was asked to stop.
pub fn requested() -> bool {
    TERMS.load(Ordering::Relaxed) + INTS.load(Ordering::Relaxed) > 0
}

/// Whether what is in flight is to be cancelled now (SIGINT, or SIGTERM twice).
pub fn cancel_now() -> bool {
    INTS.load(Ordering::Relaxed) > 0 || TERMS.load(Ordering::Relaxed) > 1
}

/// What asked the process to stop, for its last words; `None` if nothing did.
pub fn reason() -> Option<&'static str> {
    match (TERMS.load(Ordering::Relaxed), INTS.load(Ordering::Relaxed)) {
        (0, 0) => None,
        (_, i) if i > 0 => Some("SIGINT"),
        (t, _) if t > 1 => Some("a second SIGTERM"),
        _ => Some("SIGTERM"),
    }
}

/// How long a transfer in flight may go on after the first SIGTERM.
pub const GRACE: Duration = Duration::from_millis(500);

/// Waits with `wait` (called again and again with a short timeout while it returns
/// [`Error::WaitTimeout`]) until what it waits for ends: `Ok(true)`, or its error. Once the
/// process is asked to stop, it gets [`GRACE`] from then (none after SIGINT or a second
/// SIGTERM), and then `Ok(false)`: the caller cancels it.
pub fn wait_with(mut wait: impl FnMut(Duration) -> Result<()>) -> Result<bool> {
    let mut since: Option<Instant> = None;
    loop {
        match wait(Duration::from_millis(20)) {
            Ok(()) => return Ok(true),
            Err(Error::WaitTimeout(_)) => {}
            Err(e) => return Err(e),
        }
        if requested() {
            let t = *since.get_or_insert_with(Instant::now);
            if cancel_now() || t.elapsed() >= GRACE {
                return Ok(false);
            }
        }
    }
}

/// Waits for `x` as [`wait_with`] does, then cancels it if asked to stop, returning once
/// nothing touches its buffers any more. `Ok(None)`: cancelled.
pub fn wait(mut x: Transfer) -> Result<Option<XferStats>> {
    let mut done = None;
    if wait_with(|t| x.wait_timeout(t).map(|s| done = Some(s)))? {
        return Ok(done);
    }
    match x.cancel() {
        Ok(st) => Ok(Some(st)),
        Err(Error::Canceled) => Ok(None),
        Err(e) => Err(e),
    }
}
