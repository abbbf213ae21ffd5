//! Finding agents by name through etcd: `kvx_discovery_*`. Present in every build; a library
//! built without the `etcd` feature refuses `kvx_discovery_etcd` with a message saying how to
//! build one that has it.

use std::ffi::c_char;

#[cfg(feature = "etcd")]
use kvxfer_core::registry::{EtcdConfig, EtcdDiscovery};

#[cfg(not(feature = "etcd"))]
use crate::error::fail;
use crate::error::guard;
#[cfg(feature = "etcd")]
use crate::ffi::new_handle;
use crate::ffi::{free_handle, handle, null, try_cstr};
use crate::{kvx_agent, kvx_discovery, kvx_status};

/// Connects to etcd at `endpoints` (comma-separated URLs, e.g. "http://10.0.0.5:2379"; with
/// etcd's own authentication on, "http://user:password@10.0.0.5:2379"; over TLS,
/// "https://10.0.0.5:2379?ca=/path/ca.pem", the CA that signed etcd's certificate) for the
/// namespace `ns`
/// (a key prefix, one per deployment), agents' leases lasting `ttl_ms` (0: 10 s). An etcd that
/// does not answer, or refuses the user, is an error naming it (never the password); a
/// library built without the `etcd` feature says so.
///
/// # Safety
/// `endpoints`, `ns` NUL-terminated; `out` valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_discovery_etcd(
    endpoints: *const c_char,
    ns: *const c_char,
    ttl_ms: u64,
    out: *mut *mut kvx_discovery,
) -> kvx_status {
    guard("kvx_discovery_etcd", || {
        if out.is_null() {
            return Err(null("out"));
        }
        let endpoints = try_cstr!(endpoints, "endpoints");
        let ns = try_cstr!(ns, "ns");
        #[cfg(feature = "etcd")]
        {
            let eps: Vec<&str> = endpoints.split(',').map(str::trim).collect();
            let mut cfg = EtcdConfig::new(&eps, ns);
            if ttl_ms > 0 {
                cfg = cfg.ttl(std::time::Duration::from_millis(ttl_ms));
            }
            let d = EtcdDiscovery::connect(cfg)?;
            let h = kvx_discovery { inner: d };
            // SAFETY: out non-NULL, valid per the contract.
            unsafe { *out = new_handle(h) };
            Ok(())
        }
        #[cfg(not(feature = "etcd"))]
        {
            let _ = (endpoints, ns, ttl_ms);
            Err(fail(
                kvx_status::KVX_INVALID_ARGUMENT,
                "this libkvxfer was built without etcd discovery: build it with \
                 `cargo build -p kvxfer-capi --features etcd` (needs protoc)",
            ))
        }
    })
}

/// Makes `agent` findable by its name (after registering its memory; later registrations are
/// published too) for as long as `d` lives.
///
/// # Safety
/// `d`, `agent` live.
#[no_mangle]
pub unsafe extern "C" fn kvx_discovery_publish(
    d: *const kvx_discovery,
    agent: *const kvx_agent,
) -> kvx_status {
    guard("kvx_discovery_publish", || {
        let d = handle(d, "discovery")?;
        let a = handle(agent, "agent")?;
        d.inner.publish(&a.inner)?;
        Ok(())
    })
}

/// Loads every agent of the namespace into `agent` now, and those that appear or change
/// later; removes those that go (etcd only).
///
/// # Safety
/// `d`, `agent` live.
#[no_mangle]
pub unsafe extern "C" fn kvx_discovery_watch(
    d: *const kvx_discovery,
    agent: *const kvx_agent,
) -> kvx_status {
    guard("kvx_discovery_watch", || {
        let d = handle(d, "discovery")?;
        let a = handle(agent, "agent")?;
        Ok(d.inner.watch(&a.inner)?)
    })
}

/// Loads the agent named `name` into `agent`.
///
/// # Safety
/// `d`, `agent` live; `name` NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kvx_discovery_resolve(
    d: *const kvx_discovery,
    agent: *const kvx_agent,
    name: *const c_char,
) -> kvx_status {
    guard("kvx_discovery_resolve", || {
        let d = handle(d, "discovery")?;
        let a = handle(agent, "agent")?;
        let name = try_cstr!(name, "name");
        d.inner.resolve(&a.inner, name)?;
        Ok(())
    })
}

/// Frees a discovery handle: its agents stay loaded; they are no longer kept published.
///
/// # Safety
/// `d` live or NULL.
#[no_mangle]
pub unsafe extern "C" fn kvx_discovery_free(d: *mut kvx_discovery) {
    // SAFETY: per this function's contract; free_handle refuses what is not live.
    unsafe { free_handle(d, "kvx_discovery_free") }
}
