//! The agent's memory budget.

use crate::error::guard;
use crate::ffi::handle;
use crate::{kvx_agent, kvx_status};

/// The agent's memory budget: limit (UINT64_MAX: unlimited), bytes in use, peak.
///
/// # Safety
/// `a` live; outputs valid (each may be NULL).
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_budget(
    a: *const kvx_agent,
    limit: *mut u64,
    used: *mut u64,
    peak: *mut u64,
) -> kvx_status {
    guard("kvx_agent_budget", || {
        let a = handle(a, "agent")?;
        let b = a.inner.budget();
        // SAFETY: each output NULL or valid.
        unsafe {
            if let Some(p) = limit.as_mut() {
                *p = b.limit();
            }
            if let Some(p) = used.as_mut() {
                *p = b.used();
            }
            if let Some(p) = peak.as_mut() {
                *p = b.peak();
            }
        }
        Ok(())
    })
}
