//! The process: stopping in order on SIGTERM and SIGINT, and what is left of kvxfer in it.

use std::ffi::c_int;

use crate::error::guard;
use crate::kvx_status;

/// Installs kvxfer's SIGTERM and SIGINT handlers (once; later calls do nothing), replacing
/// the process's: they only count the signals, which `kvx_stop_requested` reads. For a
/// program that owns its signals and wants to stop in order: finish or cancel what is in
/// flight, free its handles, and exit 0.
#[no_mangle]
pub extern "C" fn kvx_stop_signals_install() {
    kvxfer_core::stop::install();
}

/// 0: not asked to stop; 1: asked to stop (a first SIGTERM: take no new work, give what is
/// in flight a short grace, about 500 ms); 2: cancel what is in flight now (SIGINT, or a
/// second SIGTERM).
#[no_mangle]
pub extern "C" fn kvx_stop_requested() -> c_int {
    if kvxfer_core::stop::cancel_now() {
        2
    } else {
        c_int::from(kvxfer_core::stop::requested())
    }
}

/// What kvxfer holds in this process now: agents not freed, regions registered, memory
/// registrations held with UCX, peers' regions mapped by the shared-memory lane. All zero
/// once every handle is freed. Each output may be NULL.
///
/// # Safety
/// Outputs NULL or valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_live(
    agents: *mut usize,
    regions: *mut usize,
    ucx_registrations: *mut usize,
    peer_mappings: *mut usize,
) -> kvx_status {
    guard("kvx_live", || {
        let l = kvxfer_core::live::live();
        // SAFETY: each output NULL or valid.
        unsafe {
            for (p, v) in [
                (agents, l.agents),
                (regions, l.regions),
                (ucx_registrations, l.ucx_registrations),
                (peer_mappings, l.peer_mappings),
            ] {
                if let Some(p) = p.as_mut() {
                    *p = v;
                }
            }
        }
        Ok(())
    })
}
