//! A raw UCX worker over shared memory that speaks the UCX fence's messages as a hostile
//! peer would (no kvxfer agent behind it), for tests that play such a peer in a process of
//! their own. Included with `#[path]` (a test binary each).
#![allow(dead_code)] // Each test binary uses part of it.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvxfer_proto::wire::ucx_fence::FenceMsg;

/// `b` in hex, as the tests hand addresses and keys to their child processes.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

/// The bytes of `s`, written by [`hex`].
pub fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap())
        .collect()
}

/// The fence's active-message id (`backend/ucx/fence_state.rs`).
pub const AM_FENCE: u32 = 0x4b59;

/// Fence messages this process's worker received, in order.
pub static GOT: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());

unsafe extern "C" fn record_am(
    _arg: *mut std::ffi::c_void,
    _header: *const std::ffi::c_void,
    _header_len: usize,
    data: *mut std::ffi::c_void,
    len: usize,
    _param: *const kvxfer_sys::ucp_am_recv_param_t,
) -> kvxfer_sys::ucs_status_t {
    if !data.is_null() {
        // SAFETY: UCX passes `len` readable bytes at `data` for the callback's duration (eager
        // messages: the initiator sends every fence message so).
        let b = unsafe { std::slice::from_raw_parts(data as *const u8, len) };
        GOT.lock().unwrap().push(b.to_vec());
    }
    kvxfer_sys::ucs_status_t::UCS_OK
}

/// A raw UCX worker over shared memory that records the fence messages it gets ([`GOT`]).
/// Lives as long as the process.
pub struct RawUcx {
    ctx: kvxfer_sys::ucp_context_h,
    worker: kvxfer_sys::ucp_worker_h,
}

// bindgen's constant types differ between UCX versions (as in `raw.rs`).
#[allow(clippy::unnecessary_cast)]
impl RawUcx {
    pub fn new() -> RawUcx {
        use kvxfer_sys as sys;
        use std::ptr;
        // SAFETY: plain UCX calls in order, each on live handles made here; every out pointer
        // is a live local; the config strings outlive the calls that read them.
        unsafe {
            let mut cfg: *mut sys::ucp_config_t = ptr::null_mut();
            assert_eq!(
                sys::ucp_config_read(ptr::null(), ptr::null(), &mut cfg),
                sys::ucs_status_t::UCS_OK
            );
            let (k, v) = (c"TLS", c"sm");
            assert_eq!(
                sys::ucp_config_modify(cfg, k.as_ptr(), v.as_ptr()),
                sys::ucs_status_t::UCS_OK
            );
            let params = sys::ucp_params_t {
                field_mask: sys::UCP_PARAM_FIELD_FEATURES as u64,
                features: (sys::UCP_FEATURE_AM | sys::UCP_FEATURE_RMA) as u64,
                ..Default::default()
            };
            let mut ctx: sys::ucp_context_h = ptr::null_mut();
            assert_eq!(
                sys::ucp_init(&params, cfg, &mut ctx),
                sys::ucs_status_t::UCS_OK
            );
            sys::ucp_config_release(cfg);
            let wp = sys::ucp_worker_params_t {
                field_mask: sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE as u64,
                thread_mode: sys::UCS_THREAD_MODE_SINGLE,
                ..Default::default()
            };
            let mut worker: sys::ucp_worker_h = ptr::null_mut();
            assert_eq!(
                sys::ucp_worker_create(ctx, &wp, &mut worker),
                sys::ucs_status_t::UCS_OK
            );
            // Every fence message is recorded (UCX 1.13 crashes on an id with no handler).
            let hp = sys::ucp_am_handler_param_t {
                field_mask: (sys::UCP_AM_HANDLER_PARAM_FIELD_ID
                    | sys::UCP_AM_HANDLER_PARAM_FIELD_CB) as u64,
                id: AM_FENCE,
                cb: Some(record_am),
                ..Default::default()
            };
            assert_eq!(
                sys::ucp_worker_set_am_recv_handler(worker, &hp),
                sys::ucs_status_t::UCS_OK
            );
            RawUcx { ctx, worker }
        }
    }

    /// The worker's address.
    pub fn address(&self) -> Vec<u8> {
        use kvxfer_sys as sys;
        let mut attr = sys::ucp_worker_attr_t {
            field_mask: sys::UCP_WORKER_ATTR_FIELD_ADDRESS as u64,
            ..Default::default()
        };
        // SAFETY: the worker is live; the address is copied (`address_length` bytes, as
        // ucp_worker_query returned them) before it is released, once.
        unsafe {
            assert_eq!(
                sys::ucp_worker_query(self.worker, &mut attr),
                sys::ucs_status_t::UCS_OK
            );
            let a =
                std::slice::from_raw_parts(attr.address as *const u8, attr.address_length).to_vec();
            sys::ucp_worker_release_address(self.worker, attr.address);
            a
        }
    }

    /// An endpoint to the worker at `addr`.
    pub fn connect(&self, addr: &[u8]) -> kvxfer_sys::ucp_ep_h {
        use kvxfer_sys as sys;
        let ep_params = sys::ucp_ep_params_t {
            field_mask: sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS as u64,
            address: addr.as_ptr() as *const sys::ucp_address_t,
            ..Default::default()
        };
        let mut ep: sys::ucp_ep_h = std::ptr::null_mut();
        // SAFETY: the worker is live; `addr` outlives the call, which copies what it needs.
        let made = unsafe { sys::ucp_ep_create(self.worker, &ep_params, &mut ep) };
        assert_eq!(made, sys::ucs_status_t::UCS_OK);
        ep
    }

    /// Sends `msg` over `ep` (eager) and progresses until it is out.
    pub fn send(&self, ep: kvxfer_sys::ucp_ep_h, msg: FenceMsg) {
        self.send_bytes(ep, AM_FENCE, &msg.encode());
    }

    /// Sends `b` as active message `id` over `ep` (eager) and progresses until it is out.
    pub fn send_bytes(&self, ep: kvxfer_sys::ucp_ep_h, id: u32, b: &[u8]) {
        use kvxfer_sys as sys;
        let p = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS as u32,
            flags: sys::UCP_AM_SEND_FLAG_EAGER as u32,
            ..Default::default()
        };
        // SAFETY: `ep` is a live endpoint of this worker; `b` lives until the request
        // completes (progressed here) or the send completed at once; the request is freed
        // once.
        unsafe {
            let req = sys::ucp_am_send_nbx(
                ep,
                id,
                std::ptr::null(),
                0,
                b.as_ptr() as *const std::ffi::c_void,
                b.len(),
                &p,
            );
            assert!(!sys::ucs_ptr_is_err(req), "{:?}", sys::ucs_ptr_status(req));
            if sys::ucs_ptr_is_ptr(req) {
                while sys::ucp_request_check_status(req) == sys::ucs_status_t::UCS_INPROGRESS {
                    sys::ucp_worker_progress(self.worker);
                }
                sys::ucp_request_free(req);
            }
        }
    }

    /// Progresses until a fence message received so far makes `f` say something, and
    /// returns that; panics after `within` (a hostile process must not outlive its test).
    pub fn wait_for<T>(&self, within: Duration, f: impl Fn(FenceMsg) -> Option<T>) -> T {
        let t = Instant::now();
        loop {
            self.progress_for(Duration::from_millis(1));
            let got = GOT
                .lock()
                .unwrap()
                .iter()
                .find_map(|m| FenceMsg::decode(m).and_then(&f));
            if let Some(x) = got {
                return x;
            }
            assert!(t.elapsed() < within, "nothing awaited came in {within:?}");
        }
    }

    pub fn progress_for(&self, d: Duration) {
        let t = Instant::now();
        while t.elapsed() < d {
            // SAFETY: the worker is live, used on this thread only.
            unsafe { kvxfer_sys::ucp_worker_progress(self.worker) };
        }
    }

    /// A region of `len` bytes of `fill`, mapped for the process's life: its base and
    /// packed remote key.
    pub fn region(&self, len: usize, fill: u8) -> (u64, Vec<u8>) {
        use kvxfer_sys as sys;
        use std::ptr;
        let region: &'static mut [u8] = Vec::leak(vec![fill; len]);
        let mp = sys::ucp_mem_map_params_t {
            field_mask: (sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH)
                as u64,
            address: region.as_mut_ptr() as *mut std::ffi::c_void,
            length: len,
            ..Default::default()
        };
        let mut memh: sys::ucp_mem_h = ptr::null_mut();
        let mut rkey: *mut std::ffi::c_void = ptr::null_mut();
        let mut rkey_len = 0usize;
        // SAFETY: the context is live; the memory is leaked (valid for the process's life);
        // the packed key is copied (`rkey_len` bytes) before it is released, once.
        unsafe {
            assert_eq!(
                sys::ucp_mem_map(self.ctx, &mp, &mut memh),
                sys::ucs_status_t::UCS_OK
            );
            assert_eq!(
                sys::ucp_rkey_pack(self.ctx, memh, &mut rkey, &mut rkey_len),
                sys::ucs_status_t::UCS_OK
            );
            let k = std::slice::from_raw_parts(rkey as *const u8, rkey_len).to_vec();
            sys::ucp_rkey_buffer_release(rkey);
            (region.as_ptr() as u64, k)
        }
    }
}
