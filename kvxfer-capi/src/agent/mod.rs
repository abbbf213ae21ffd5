//! Agents: creation (from a `kvx_agent_config` or the environment), the side channel,
//! metadata.

use std::ffi::c_char;
use std::sync::Arc;

use kvxfer_core::registry::{join, DiscoveryConfig};
use kvxfer_core::staging::{StagingShape, DEFAULT_STAGING_CHUNKS, DEFAULT_STAGING_CHUNK_BYTES};
use kvxfer_core::{Agent, AgentConfig, GpuPath, MemoryBudget, Transport};

use crate::error::{fail, guard, Fail};
use crate::ffi::{
    free_handle, handle, handle_mut, new_handle, null, put, put_str, try_cstr, try_slice,
};
use crate::{kvx_agent, kvx_agent_config, kvx_status, KVX_MAX_ADDRESS, KVX_MAX_NAME};

/// Creates an agent. `transport`: "tcp", "shm", "auto" or a UCX_TLS list; `net_devices` may be
/// NULL (UCX's default), e.g. "lo" or "eth0". `budget_bytes` 0: unlimited.
///
/// Device memory (a library built with the `cuda` feature) follows the environment:
/// `KVXFER_GPU_PATH` = `auto` (default: direct where UCX has CUDA transports, else staged),
/// `direct` or `staged`; `KVXFER_STAGING_CHUNKS` and `KVXFER_STAGING_CHUNK_BYTES` size the
/// staging pool (default 8 x 4 MiB, charged to the budget at the first device registration).
///
/// `kvx_agent_config_new` and `kvx_agent_new_with` set every option, these included, without
/// the environment; this function stays for existing callers.
///
/// # Safety
/// Strings are NULL or NUL-terminated; `out` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_new(
    name: *const c_char,
    transport: *const c_char,
    net_devices: *const c_char,
    budget_bytes: u64,
    out: *mut *mut kvx_agent,
) -> kvx_status {
    guard("kvx_agent_new", || {
        let name = try_cstr!(name, "name");
        let transport = try_cstr!(transport, "transport");
        if out.is_null() {
            return Err(null("out"));
        }
        let mut cfg = AgentConfig::new(name).transport(Transport::parse(transport));
        if !net_devices.is_null() {
            cfg = cfg.net_devices(try_cstr!(net_devices, "net_devices"));
        }
        if budget_bytes > 0 {
            cfg = cfg.budget(MemoryBudget::new(budget_bytes));
        }
        cfg = gpu_env(cfg)?;
        let a = Agent::new(cfg)?;
        let h = new_handle(kvx_agent {
            inner: Arc::new(a),
            _published: None,
        });
        // SAFETY: out non-NULL and valid per the contract.
        unsafe { *out = h };
        Ok(())
    })
}

/// Applies KVXFER_GPU_PATH, KVXFER_STAGING_CHUNKS and KVXFER_STAGING_CHUNK_BYTES.
fn gpu_env(mut cfg: AgentConfig) -> kvxfer_core::Result<AgentConfig> {
    if let Ok(v) = std::env::var("KVXFER_GPU_PATH") {
        let p = kvxfer_core::GpuPath::parse(v.trim()).ok_or_else(|| {
            kvxfer_core::Error::InvalidArgument(format!(
                "KVXFER_GPU_PATH={v:?}: auto, direct or staged"
            ))
        })?;
        cfg = cfg.gpu_path(p);
    }
    let num = |k: &str, d: usize| -> kvxfer_core::Result<usize> {
        match std::env::var(k) {
            Ok(v) => v.trim().parse().map_err(|_| {
                kvxfer_core::Error::InvalidArgument(format!(
                    "{k}={v:?}: a number of bytes or chunks"
                ))
            }),
            Err(_) => Ok(d),
        }
    };
    let shape = StagingShape::new(
        num("KVXFER_STAGING_CHUNKS", DEFAULT_STAGING_CHUNKS)?,
        num("KVXFER_STAGING_CHUNK_BYTES", DEFAULT_STAGING_CHUNK_BYTES)?,
    )?;
    Ok(cfg.staging(shape))
}

/// Creates an agent configuration for an agent named `name`, with the Rust `AgentConfig`'s
/// defaults: transport `auto`, lanes on, no secret, not strict, GPU path `auto`, staging 8 x
/// 4 MiB, unlimited budget. Set what differs with `kvx_agent_config_set_*`, create agents with
/// `kvx_agent_new_with`, free it with `kvx_agent_config_free`. Nothing is read from the
/// environment.
///
/// # Safety
/// `name` is NULL or NUL-terminated; `out` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_config_new(
    name: *const c_char,
    out: *mut *mut kvx_agent_config,
) -> kvx_status {
    guard("kvx_agent_config_new", || {
        let name = try_cstr!(name, "name");
        if out.is_null() {
            return Err(null("out"));
        }
        let h = new_handle(kvx_agent_config {
            inner: AgentConfig::new(name),
            discovery: None,
        });
        // SAFETY: out non-NULL and valid per the contract.
        unsafe { *out = h };
        Ok(())
    })
}

/// Destroys a configuration (NULL is ignored). Agents created from it are not affected.
///
/// # Safety
/// `c` is NULL or from `kvx_agent_config_new`, not freed before.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_config_free(c: *mut kvx_agent_config) {
    // SAFETY: per this function's contract; free_handle refuses what is not live.
    unsafe { free_handle(c, "kvx_agent_config_free") }
}

/// Applies `f` to the configuration behind `c` (checked by `handle_mut`), inside the panic
/// boundary; on an error the configuration is left as it was.
fn with_config(
    fname: &str,
    c: *mut kvx_agent_config,
    f: impl FnOnce(AgentConfig) -> Result<AgentConfig, Fail>,
) -> kvx_status {
    guard(fname, || {
        let c = handle_mut(c, "config")?;
        let cfg = std::mem::replace(&mut c.inner, AgentConfig::new("-"));
        // On an error the configuration is restored unchanged.
        let keep = cfg.clone();
        match f(cfg) {
            Ok(n) => {
                c.inner = n;
                Ok(())
            }
            Err(e) => {
                c.inner = keep;
                Err(e)
            }
        }
    })
}

/// Sets the transports: "tcp", "shm", "auto" or a UCX_TLS list ("rc,sm", "cuda_copy,tcp").
///
/// # Safety
/// `c` is a live config not used by another thread during the call; `transport` is NULL or
/// NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_config_set_transport(
    c: *mut kvx_agent_config,
    transport: *const c_char,
) -> kvx_status {
    with_config("kvx_agent_config_set_transport", c, |cfg| {
        Ok(cfg.transport(Transport::parse(try_cstr!(transport, "transport"))))
    })
}

/// Sets `UCX_NET_DEVICES` (e.g. "eth0", "mlx5_0:1"); NULL restores UCX's default. The TCP lane
/// listens on the first device's address.
///
/// # Safety
/// As `kvx_agent_config_set_transport`.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_config_set_net_devices(
    c: *mut kvx_agent_config,
    devices: *const c_char,
) -> kvx_status {
    with_config("kvx_agent_config_set_net_devices", c, |cfg| {
        Ok(match devices.is_null() {
            true => cfg.default_net_devices(),
            false => cfg.net_devices(try_cstr!(devices, "devices")),
        })
    })
}

/// Sets where the agent publishes itself and finds peers by name: `url` "etcd://host:2379"
/// (several endpoints comma-separated; "etcd://user:password@host:2379" with etcd's own
/// authentication on; "etcds://host:2379?ca=/path/ca.pem" over TLS), the namespace `ns` (a key prefix starting with '/', one
/// per deployment), leases of `ttl_ms` (0: 10 s); `url` NULL removes it. `kvx_agent_new_with`
/// then connects to etcd (an unreachable one is an error creating no agent), publishes the
/// agent and loads every agent of the namespace as they come and go, for the agent's life.
/// Needs a library built with the `etcd` feature (else `kvx_agent_new_with` says so).
///
/// # Safety
/// `c` is a live config not used by another thread during the call; `url` NULL or
/// NUL-terminated; `ns` NUL-terminated when `url` is not NULL.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_config_set_discovery(
    c: *mut kvx_agent_config,
    url: *const c_char,
    ns: *const c_char,
    ttl_ms: u64,
) -> kvx_status {
    guard("kvx_agent_config_set_discovery", || {
        let c = handle_mut(c, "config")?;
        // Parsed whole before anything changes: a failed call leaves the configuration as it was.
        c.discovery = match url.is_null() {
            true => None,
            false => {
                let ttl =
                    std::time::Duration::from_millis(if ttl_ms == 0 { 10_000 } else { ttl_ms });
                let (url, ns) = (try_cstr!(url, "url"), try_cstr!(ns, "ns"));
                Some(DiscoveryConfig::parse(url, ns, ttl)?)
            }
        };
        Ok(())
    })
}

/// Sets the shared secret (`len` bytes; `len` 0 removes it): every peer must hold it; it keys
/// a Noise handshake on the side channel and on every TCP-lane connection, and every control
/// message after it is encrypted and authenticated; notifications then travel only over the
/// sealed lane, whose handshake proves each agent's own static key (a lane serves only peers
/// this agent loaded); a producer seals its handoffs and a consumer loads only sealed ones
/// (`kvx_handoff_seal`). What it does not protect yet (the shm lane and UCX are not checked
/// against grants; bulk data unless `kvx_agent_config_set_lane_encryption`) is in
/// SECURITY.md, kvxfer's threat model.
///
/// # Safety
/// `c` is a live config not used by another thread during the call; `secret` is valid for
/// `len` bytes (or anything when `len` is 0).
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_config_set_secret(
    c: *mut kvx_agent_config,
    secret: *const u8,
    len: usize,
) -> kvx_status {
    with_config("kvx_agent_config_set_secret", c, |cfg| {
        let s = try_slice!(secret, len, "secret");
        Ok(match s.is_empty() {
            true => cfg.no_secret(),
            false => cfg.secret(s),
        })
    })
}

/// With a secret: the blocks' bytes on the TCP lane are sealed too (`on` non-zero;
/// AES-256-GCM under the connection's session), and as a target the agent refuses initiators
/// that would send or take data in the clear. Off by default (the data then travels in the
/// clear, for a trusted network); `kvx_agent_new` fails with `KVX_INVALID_ARGUMENT` when it is
/// on without a secret.
///
/// # Safety
/// `c` is a live config not used by another thread during the call.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_config_set_lane_encryption(
    c: *mut kvx_agent_config,
    on: i32,
) -> kvx_status {
    with_config("kvx_agent_config_set_lane_encryption", c, |cfg| {
        Ok(cfg.lane_encryption(on != 0))
    })
}

/// Lets UCX use its own TCP transport (`on` non-zero; trusted peers and network only,
/// logged at start). UCX over TCP authenticates nobody, its emulated RMA reads or writes
/// whatever address a message names, and a peer whose connection fails while this agent
/// serves its READ over it aborts this process inside UCX. It is left out by default, lanes
/// on or off: kvxfer's TCP lane carries the bytes and the notifications, and peers UCX cannot
/// reach are loaded lane-only. With a secret set, the agent refuses it (`kvx_agent_new`:
/// `KVX_INVALID_ARGUMENT`); without it, lanes off with tcp among the transports are refused.
///
/// # Safety
/// `c` is a live config not used by another thread during the call.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_config_set_ucx_tcp(
    c: *mut kvx_agent_config,
    on: i32,
) -> kvx_status {
    with_config("kvx_agent_config_set_ucx_tcp", c, |cfg| {
        Ok(cfg.ucx_tcp(on != 0))
    })
}

/// WRITEs over UCX's shared memory with the lanes off (`on` non-zero) where UCX emulates them
/// (older than 1.22): through the target's shared-memory receive FIFO, which a writer killed
/// mid-WRITE leaves waiting for good (the target then serves no UCX shared-memory peer).
/// Without it, an agent with the lanes off and shared memory among its transports is refused
/// on such a UCX (`KVX_INVALID_ARGUMENT`). No effect with the lanes on, or on UCX 1.22 and
/// later.
///
/// # Safety
/// `c` is a live config not used by another thread during the call.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_config_set_ucx_emulated_shm(
    c: *mut kvx_agent_config,
    on: i32,
) -> kvx_status {
    with_config("kvx_agent_config_set_ucx_emulated_shm", c, |cfg| {
        Ok(cfg.ucx_emulated_shm(on != 0))
    })
}

/// Strict transport (`on` non-zero): a transfer to a peer whose transports fell back from
/// what was asked (shared memory asked, TCP selected) fails with `KVX_INVALID_ARGUMENT`, the
/// last error naming both, instead of running on the fallback.
///
/// # Safety
/// `c` is a live config not used by another thread during the call.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_config_set_strict(
    c: *mut kvx_agent_config,
    on: i32,
) -> kvx_status {
    with_config("kvx_agent_config_set_strict", c, |cfg| {
        Ok(cfg.strict(on != 0))
    })
}

/// kvxfer's own shm and TCP lanes next to UCX (`on` non-zero, the default); 0 sends every
/// byte through UCX (and leaves device memory only the direct path).
///
/// # Safety
/// `c` is a live config not used by another thread during the call.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_config_set_lanes(
    c: *mut kvx_agent_config,
    on: i32,
) -> kvx_status {
    with_config(
        "kvx_agent_config_set_lanes",
        c,
        |cfg| Ok(cfg.lanes(on != 0)),
    )
}

/// The device lane (`on` non-zero, the default, with transport "shm" or "auto"): a same-host
/// peer's GPU memory opened through CUDA IPC and moved by batched device copies; 0 leaves
/// device memory to UCX (direct) or the staged path.
///
/// # Safety
/// `c` is a live config not used by another thread during the call.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_config_set_device_lane(
    c: *mut kvx_agent_config,
    on: i32,
) -> kvx_status {
    with_config("kvx_agent_config_set_device_lane", c, |cfg| {
        Ok(cfg.device_lane(on != 0))
    })
}

/// How device memory moves: "auto" (direct where the loaded UCX has CUDA transports, else
/// staged), "direct" or "staged".
///
/// # Safety
/// As `kvx_agent_config_set_transport`.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_config_set_gpu_path(
    c: *mut kvx_agent_config,
    path: *const c_char,
) -> kvx_status {
    with_config("kvx_agent_config_set_gpu_path", c, |cfg| {
        let s = try_cstr!(path, "path");
        let p = GpuPath::parse(s).ok_or_else(|| {
            fail(
                kvx_status::KVX_INVALID_ARGUMENT,
                format!("gpu path {s:?}: auto, direct or staged"),
            )
        })?;
        Ok(cfg.gpu_path(p))
    })
}

/// TCP-lane compression: "auto" (the default: compress a transfer where the measured link is
/// slower than the codec makes worthwhile), "on" or "off".
///
/// # Safety
/// As `kvx_agent_config_set_transport`.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_config_set_compression(
    c: *mut kvx_agent_config,
    mode: *const c_char,
) -> kvx_status {
    with_config("kvx_agent_config_set_compression", c, |cfg| {
        let s = try_cstr!(mode, "mode");
        let m: kvxfer_core::Compression = s
            .parse()
            .map_err(|e: String| fail(kvx_status::KVX_INVALID_ARGUMENT, e))?;
        Ok(cfg.compression(m))
    })
}

/// Takes `bytes_per_s` as the link rate to the agent named `peer` (for compression's `auto`)
/// instead of measuring it.
///
/// # Safety
/// `c` is a live config not used by another thread during the call; `peer` is a
/// NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_config_set_link_rate(
    c: *mut kvx_agent_config,
    peer: *const c_char,
    bytes_per_s: f64,
) -> kvx_status {
    with_config("kvx_agent_config_set_link_rate", c, |cfg| {
        let p = try_cstr!(peer, "peer");
        if !(bytes_per_s.is_finite() && bytes_per_s > 0.0) {
            return Err(fail(
                kvx_status::KVX_INVALID_ARGUMENT,
                format!("link rate {bytes_per_s}: a positive number of bytes per second"),
            ));
        }
        Ok(cfg.link_rate(p, bytes_per_s))
    })
}

/// The staging of device memory on the staged path: `chunks` pinned host chunks of
/// `chunk_bytes` (half for transfers the agent starts, half for its peers'), allocated once at
/// the first device registration and charged to the budget.
/// At least 4 chunks of at least 4 KiB (`KVX_INVALID_ARGUMENT` otherwise, the configuration
/// unchanged).
///
/// # Safety
/// `c` is a live config not used by another thread during the call.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_config_set_staging(
    c: *mut kvx_agent_config,
    chunks: usize,
    chunk_bytes: usize,
) -> kvx_status {
    with_config("kvx_agent_config_set_staging", c, |cfg| {
        Ok(cfg.staging(StagingShape::new(chunks, chunk_bytes)?))
    })
}

/// The memory budget the agent charges its own buffers to (`bytes` 0: unlimited).
///
/// # Safety
/// `c` is a live config not used by another thread during the call.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_config_set_budget(
    c: *mut kvx_agent_config,
    bytes: u64,
) -> kvx_status {
    with_config("kvx_agent_config_set_budget", c, |cfg| {
        Ok(cfg.budget(match bytes {
            0 => MemoryBudget::unlimited(),
            b => MemoryBudget::new(b),
        }))
    })
}

/// Sets how long each step of `kvx_agent_connect`'s handshake (the TCP connection, then every
/// read and write) may wait, in milliseconds (default 10,000); 0 is `KVX_INVALID_ARGUMENT`.
///
/// # Safety
/// `c` is a live config not used by another thread during the call.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_config_set_handshake_timeout(
    c: *mut kvx_agent_config,
    ms: u64,
) -> kvx_status {
    with_config("kvx_agent_config_set_handshake_timeout", c, |cfg| {
        if ms == 0 {
            return Err(fail(
                kvx_status::KVX_INVALID_ARGUMENT,
                "a handshake time-out of 0 ms",
            ));
        }
        Ok(cfg.handshake_timeout(std::time::Duration::from_millis(ms)))
    })
}

/// Sets how many peers the agent keeps loaded at once (default 1,024). Past it, or when the
/// process's free file descriptors would fall under the reserve (an eighth of
/// `RLIMIT_NOFILE`, at least 64), the peer unused for longest is evicted if it has been idle
/// for the peer idle time; else the newcomer is refused with `KVX_PEER_LIMIT`. 0 is
/// `KVX_INVALID_ARGUMENT`.
///
/// # Safety
/// `c` is a live config not used by another thread during the call.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_config_set_max_peers(
    c: *mut kvx_agent_config,
    n: u32,
) -> kvx_status {
    with_config("kvx_agent_config_set_max_peers", c, |cfg| {
        if n == 0 {
            return Err(fail(kvx_status::KVX_INVALID_ARGUMENT, "a cap of 0 peers"));
        }
        Ok(cfg.max_peers(n as usize))
    })
}

/// Sets how long a peer must have been unused before a newcomer may evict it from a full
/// peer table, in milliseconds (default 60,000).
///
/// # Safety
/// `c` is a live config not used by another thread during the call.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_config_set_peer_idle(
    c: *mut kvx_agent_config,
    ms: u64,
) -> kvx_status {
    with_config("kvx_agent_config_set_peer_idle", c, |cfg| {
        Ok(cfg.peer_idle(std::time::Duration::from_millis(ms)))
    })
}

/// Sets how long `kvx_agent_deregister` waits, in milliseconds (default 10,000), for each
/// peer that UCX reaches (kept on the side channel, or announced to the UCX engine) to
/// confirm that nothing of its touches the region any more; past it the region stays registered (`KVX_BUSY`). Also how
/// long this agent, told of a peer's deregistration, waits for its own transfers first.
///
/// # Safety
/// `c` is a live config not used by another thread during the call.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_config_set_deregister_wait(
    c: *mut kvx_agent_config,
    ms: u64,
) -> kvx_status {
    with_config("kvx_agent_config_set_deregister_wait", c, |cfg| {
        Ok(cfg.deregister_wait(std::time::Duration::from_millis(ms)))
    })
}

/// Adds a UCX setting (a name without the `UCX_` prefix, e.g. "RNDV_THRESH"), applied last.
///
/// # Safety
/// `c` is a live config not used by another thread during the call; `key` and `value` are
/// NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_config_set_ucx(
    c: *mut kvx_agent_config,
    key: *const c_char,
    value: *const c_char,
) -> kvx_status {
    with_config("kvx_agent_config_set_ucx", c, |cfg| {
        Ok(cfg.ucx_setting(try_cstr!(key, "key"), try_cstr!(value, "value")))
    })
}

/// Creates an agent from a configuration (which stays the caller's, reusable).
///
/// # Safety
/// `c` is a live config; `out` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_new_with(
    c: *const kvx_agent_config,
    out: *mut *mut kvx_agent,
) -> kvx_status {
    guard("kvx_agent_new_with", || {
        let c = handle(c, "config")?;
        if out.is_null() {
            return Err(null("out"));
        }
        let h = match &c.discovery {
            None => kvx_agent {
                inner: Arc::new(Agent::new(c.inner.clone())?),
                _published: None,
            },
            Some(d) => {
                let m = join(c.inner.clone(), d.clone())?;
                kvx_agent {
                    inner: m.agent().clone(),
                    _published: Some(m),
                }
            }
        };
        let h = new_handle(h);
        // SAFETY: out non-NULL and valid per the contract.
        unsafe { *out = h };
        Ok(())
    })
}

/// Destroys an agent (NULL is ignored). Transfers in flight finish first; handles made from it
/// (regions, lists, transfers, producers, consumers) stay valid to free.
///
/// # Safety
/// `a` is NULL or from `kvx_agent_new`, not freed before.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_free(a: *mut kvx_agent) {
    // SAFETY: per this function's contract; free_handle refuses what is not live.
    unsafe { free_handle(a, "kvx_agent_free") }
}

/// A call whose work cannot be undone checks its output first, before any side effect: a
/// NULL `buf` or `out_len` is refused, and `cap < need` fails with `KVX_BUFFER_TOO_SMALL`
/// and `need` in `out_len`.
fn early_room<T>(buf: *mut T, cap: usize, need: usize, out_len: *mut usize) -> Result<(), Fail> {
    if out_len.is_null() {
        return Err(null("out_len"));
    }
    if buf.is_null() {
        return Err(null("buf"));
    }
    if cap < need {
        // SAFETY: out_len checked non-NULL; valid per the caller's contract.
        unsafe { *out_len = need };
        return Err(fail(
            kvx_status::KVX_BUFFER_TOO_SMALL,
            format!("the buffer holds {cap} bytes; {need} are needed, checked before any work"),
        ));
    }
    Ok(())
}

/// Listens for peers' metadata exchange on `addr` ("127.0.0.1:0" picks a port); writes the
/// bound address (text, NUL-terminated) to `buf`. `cap` must be at least `KVX_MAX_ADDRESS`,
/// checked before anything is bound: a failed call listens on nothing.
///
/// # Safety
/// `a` is a live agent; `addr` NUL-terminated; `buf` valid for `cap` bytes; `out_len` valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_listen(
    a: *const kvx_agent,
    addr: *const c_char,
    buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> kvx_status {
    guard("kvx_agent_listen", || {
        let a = handle(a, "agent")?;
        let addr = try_cstr!(addr, "addr"); // a host name or an IP address, and a port
        early_room(buf, cap, KVX_MAX_ADDRESS, out_len)?;
        let bound = a.inner.listen(addr)?.to_string();
        // SAFETY: as above.
        unsafe { put_str(&bound, buf, cap, out_len) }
    })
}

/// Exchanges metadata with the peer listening at `addr`; writes its name (NUL-terminated) to
/// `buf`. `cap` must be at least `KVX_MAX_NAME + 1`, checked before connecting: a failed
/// call meets no peer.
///
/// # Safety
/// As `kvx_agent_listen`.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_connect(
    a: *const kvx_agent,
    addr: *const c_char,
    buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> kvx_status {
    guard("kvx_agent_connect", || {
        let a = handle(a, "agent")?;
        let addr = try_cstr!(addr, "addr"); // a host name or an IP address, and a port
        early_room(buf, cap, KVX_MAX_NAME + 1, out_len)?;
        let name = a.inner.connect(addr)?;
        // SAFETY: as above.
        unsafe { put_str(&name, buf, cap, out_len) }
    })
}

/// This agent's metadata, for a peer's `kvx_agent_load_metadata`.
///
/// # Safety
/// `a` live; `buf` valid for `cap` bytes; `out_len` valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_metadata(
    a: *const kvx_agent,
    buf: *mut u8,
    cap: usize,
    out_len: *mut usize,
) -> kvx_status {
    guard("kvx_agent_metadata", || {
        let a = handle(a, "agent")?;
        let m = a.inner.metadata()?;
        // SAFETY: as above.
        unsafe { put(&m, buf, cap, out_len) }
    })
}

/// Loads a peer's metadata; writes the peer's name to `name_buf`.
///
/// # Safety
/// `a` live; `md` valid for `len` bytes; `name_buf` valid for `cap` bytes; `out_len` valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_load_metadata(
    a: *const kvx_agent,
    md: *const u8,
    len: usize,
    name_buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> kvx_status {
    guard("kvx_agent_load_metadata", || {
        let a = handle(a, "agent")?;
        let md = try_slice!(md, len, "metadata");
        early_room(name_buf, cap, KVX_MAX_NAME + 1, out_len)?;
        let name = a.inner.load_remote_metadata(md)?;
        // SAFETY: as above.
        unsafe { put_str(&name, name_buf, cap, out_len) }
    })
}

// What an agent does, after its own functions, in the header's order (cbindgen writes the
// functions in declaration order; blank lines keep rustfmt from sorting these).
pub(crate) mod region;

pub(crate) mod transfer;

mod budget;
