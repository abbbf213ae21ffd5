"""ctypes bindings to libkvxfer (include/kvxfer.h). Every call checks its status and raises
KvxferError with the library's last-error message."""

import ctypes
import ctypes.util
import os
from ctypes import (
    POINTER,
    Structure,
    c_char,
    c_char_p,
    c_int32,
    c_size_t,
    c_uint8,
    c_uint32,
    c_uint64,
    c_void_p,
)

# Statuses (enum kvx_status); python/tests/test_header.py checks them against the header.
KVX_OK = 0
KVX_NULL_PARAMETER = 1
KVX_INVALID_ARGUMENT = 2
KVX_METADATA = 3
KVX_OUT_OF_BOUNDS = 4
KVX_UNKNOWN_PEER = 5
KVX_PEER_FAILED = 6
KVX_BUSY = 7
KVX_DEADLINE = 8
KVX_TIMEOUT = 9
KVX_CANCELED = 10
KVX_OUT_OF_MEMORY = 11
KVX_IO = 12
KVX_UCX = 13
KVX_HANDOFF = 14
KVX_SHUTDOWN = 15
KVX_PANIC = 16
KVX_BUFFER_TOO_SMALL = 17
KVX_NOT_FOUND = 18
KVX_IN_PROGRESS = 19
KVX_STALE = 20
KVX_DEREGISTERED = 21
KVX_INVALID_HANDLE = 22
KVX_CUDA = 23
KVX_NAME_CONFLICT = 24
KVX_AUTH = 25
KVX_TRANSPORT_MISMATCH = 26
KVX_FENCED = 27
KVX_ERROR = 28
KVX_PEER_LIMIT = 29

STATUS_NAMES = {v: k for k, v in list(globals().items()) if k.startswith("KVX_")}

# Limits of kvx_tp_plan (the header's KVX_MAX_TP, KVX_MAX_KV_HEADS).
KVX_MAX_TP = 4096
# kvx_layout.packing (the header's KVX_PACKING_*).
KVX_PACKING_SEPARATE, KVX_PACKING_FUSED, KVX_PACKING_LATENT, KVX_PACKING_STATE = 0, 1, 2, 3
# A slot a cache group does not hold (the header's KVX_NO_BLOCK), and the most groups.
KVX_NO_BLOCK = 0xFFFFFFFF
KVX_MAX_GROUPS = 64
KVX_MAX_KV_HEADS = 65536


class KvxferError(RuntimeError):
    def __init__(self, status, name, message):
        super().__init__(f"{name}: {message}")
        self.status = status
        self.status_name = name


class StatePart(Structure):
    """kvx_state_part: one state tensor of a recurrent-state page."""
    _c_name_ = "kvx_state_part"
    _fields_ = [
        ("rows", c_uint32),
        ("segments", c_uint32),
        ("per_unit", POINTER(c_uint64)),
        ("channel_bytes", c_uint64),
    ]


class Layout(Structure):
    _c_name_ = "kvx_layout"
    _fields_ = [
        ("layers", c_uint32),
        ("kv_heads", c_uint32),
        ("head_dim", c_uint32),
        ("dtype_bytes", c_uint32),
        ("block_tokens", c_uint32),
        ("num_blocks", c_uint64),
        ("packing", c_uint32),
        ("hnd", c_uint32),
        ("state_parts", POINTER(StatePart)),
        ("state_parts_len", c_uint32),
        ("state_padding", c_uint64),
        ("pad_per_head", c_uint64),
    ]


class LayerBase(Structure):
    _c_name_ = "kvx_layer_base"
    _fields_ = [
        ("k_region", c_uint32),
        ("k_offset", c_uint64),
        ("v_region", c_uint32),
        ("v_offset", c_uint64),
    ]


class ConnectorConfig(Structure):
    _c_name_ = "kvx_connector_config"
    _fields_ = [
        ("mode", c_uint32),
        ("lease_ms", c_uint64),
        ("heartbeat_ms", c_uint64),
        ("readers", c_uint32),
        ("heads_start", c_uint64),
        ("heads_end", c_uint64),
        ("budget_bytes", c_uint64),
        ("budget_wait_ms", c_uint64),
    ]


class CacheTensor(Structure):
    _c_name_ = "kvx_cache_tensor"
    _fields_ = [("k", c_void_p), ("k_len", c_uint64), ("v", c_void_p), ("v_len", c_uint64)]


class TpRead(Structure):
    """kvx_tp_read: what a decode rank loads from one prefill rank (kvx_tp_plan)."""
    _c_name_ = "kvx_tp_read"

    _fields_ = [
        ("producer_rank", c_uint32),
        ("readers", c_uint32),
        ("remote_heads_start", c_uint64),
        ("remote_heads_end", c_uint64),
        ("local_heads_start", c_uint64),
        ("local_heads_end", c_uint64),
    ]

    @property
    def moves(self):
        """Whether heads move (else the decode rank only acknowledges this prefill rank)."""
        return self.remote_heads_end > self.remote_heads_start


class RequestStats(Structure):
    _c_name_ = "kvx_request_stats"
    _fields_ = [
        ("bytes_moved", c_uint64),
        ("bytes_skipped", c_uint64),
        ("descriptors", c_uint64),
        ("post_ns", c_uint64),
        ("transfer_ns", c_uint64),
        ("handoff_ns", c_uint64),
    ]


# Every function of libkvxfer these bindings call: (result, arguments), as ctypes types.
# python/tests/test_header.py checks each against include/kvxfer.h (the C header cbindgen
# writes from the Rust source), so the two cannot drift apart unnoticed.
_st = c_uint32  # kvx_status
SIGNATURES = {
    "kvx_version": (c_char_p, []),
    "kvx_last_error": (c_size_t, [POINTER(c_char), c_size_t]),
    "kvx_status_name": (c_char_p, [_st]),
    "kvx_agent_new": (_st, [c_char_p, c_char_p, c_char_p, c_uint64, POINTER(c_void_p)]),
    "kvx_agent_config_new": (_st, [c_char_p, POINTER(c_void_p)]),
    "kvx_agent_config_free": (None, [c_void_p]),
    "kvx_agent_config_set_transport": (_st, [c_void_p, c_char_p]),
    "kvx_agent_config_set_net_devices": (_st, [c_void_p, c_char_p]),
    "kvx_agent_config_set_secret": (_st, [c_void_p, POINTER(c_uint8), c_size_t]),
    "kvx_agent_config_set_lane_encryption": (_st, [c_void_p, c_int32]),
    "kvx_agent_config_set_ucx_tcp": (_st, [c_void_p, c_int32]),
    "kvx_agent_config_set_ucx_emulated_shm": (_st, [c_void_p, c_int32]),
    "kvx_agent_config_set_strict": (_st, [c_void_p, c_int32]),
    "kvx_agent_config_set_lanes": (_st, [c_void_p, c_int32]),
    "kvx_agent_config_set_device_lane": (_st, [c_void_p, c_int32]),
    "kvx_agent_config_set_gpu_path": (_st, [c_void_p, c_char_p]),
    "kvx_agent_config_set_compression": (_st, [c_void_p, c_char_p]),
    "kvx_agent_config_set_staging": (_st, [c_void_p, c_size_t, c_size_t]),
    "kvx_agent_config_set_budget": (_st, [c_void_p, c_uint64]),
    "kvx_agent_config_set_handshake_timeout": (_st, [c_void_p, c_uint64]),
    "kvx_agent_new_with": (_st, [c_void_p, POINTER(c_void_p)]),
    "kvx_agent_free": (None, [c_void_p]),
    "kvx_agent_listen": (_st, [c_void_p, c_char_p, POINTER(c_char), c_size_t, POINTER(c_size_t)]),
    "kvx_agent_connect": (_st, [c_void_p, c_char_p, POINTER(c_char), c_size_t, POINTER(c_size_t)]),
    "kvx_agent_register": (_st, [c_void_p, c_void_p, c_size_t, c_int32, POINTER(c_void_p)]),
    "kvx_agent_register_shared": (_st, [c_void_p, c_void_p, c_size_t, c_int32, POINTER(POINTER(c_char)), c_size_t, POINTER(c_void_p)]),
    "kvx_agent_deregister": (_st, [c_void_p, c_void_p]),
    "kvx_region_id": (c_uint32, [c_void_p]),
    "kvx_region_free": (None, [c_void_p]),
    "kvx_layout_compat_hash": (c_uint64, [POINTER(Layout), POINTER(LayerBase)]),
    "kvx_producer_new": (_st, [c_void_p, POINTER(Layout), POINTER(LayerBase), POINTER(ConnectorConfig), c_char_p, POINTER(c_void_p)]),
    "kvx_producer_free": (None, [c_void_p]),
    "kvx_producer_publish": (_st, [c_void_p, c_char_p, POINTER(c_uint32), c_size_t, c_uint64, c_uint32, POINTER(c_uint8), c_size_t, POINTER(c_size_t)]),
    "kvx_producer_publish_granted": (_st, [c_void_p, c_char_p, POINTER(c_uint8), c_size_t, POINTER(c_uint32), c_size_t, c_uint64, c_uint32, POINTER(c_uint8), c_size_t, POINTER(c_size_t)]),
    "kvx_handoff_seal": (_st, [POINTER(c_uint8), c_size_t, POINTER(c_uint8), c_size_t, POINTER(c_uint8), c_size_t, POINTER(c_size_t)]),
    "kvx_handoff_seal_bytes": (_st, [POINTER(c_uint8), c_size_t, POINTER(c_uint8), c_size_t, POINTER(c_uint8)]),
    "kvx_handoff_verify_bytes": (_st, [POINTER(c_uint8), c_size_t, POINTER(c_uint8), c_size_t, POINTER(c_uint8), c_size_t]),
    "kvx_producer_layer_done": (_st, [c_void_p, c_char_p, c_uint32]),
    "kvx_producer_abort": (_st, [c_void_p, c_char_p]),
    "kvx_producer_next_freed": (_st, [c_void_p, c_uint64, POINTER(c_char), c_size_t, POINTER(c_size_t), POINTER(c_uint32), c_size_t, POINTER(c_size_t), POINTER(c_uint32)]),
    "kvx_producer_metrics": (_st, [c_void_p, POINTER(c_char), c_size_t, POINTER(c_size_t)]),
    "kvx_agent_metrics": (_st, [c_void_p, POINTER(c_char), c_size_t, POINTER(c_size_t)]),
    "kvx_consumer_new": (_st, [c_void_p, POINTER(Layout), POINTER(LayerBase), POINTER(ConnectorConfig), POINTER(c_void_p)]),
    "kvx_consumer_free": (None, [c_void_p]),
    "kvx_consumer_start_load": (_st, [c_void_p, POINTER(c_uint8), c_size_t, POINTER(c_uint32), c_size_t]),
    "kvx_consumer_start_load_with": (_st, [c_void_p, POINTER(c_uint8), c_size_t, POINTER(c_uint32), c_size_t, POINTER(TpRead)]),
    "kvx_discovery_etcd": (_st, [c_char_p, c_char_p, c_uint64, POINTER(c_void_p)]),
    "kvx_discovery_publish": (_st, [c_void_p, c_void_p]),
    "kvx_discovery_watch": (_st, [c_void_p, c_void_p]),
    "kvx_discovery_resolve": (_st, [c_void_p, c_void_p, c_char_p]),
    "kvx_discovery_free": (None, [c_void_p]),
    "kvx_tp_plan": (_st, [c_uint32, c_uint32, c_uint32, c_uint32, c_uint32, POINTER(TpRead), c_size_t, POINTER(c_size_t)]),
    "kvx_consumer_wait_layer": (_st, [c_void_p, c_char_p, c_uint32, c_uint64]),
    "kvx_consumer_wait": (_st, [c_void_p, c_char_p, c_uint64]),
    "kvx_consumer_next_finished": (_st, [c_void_p, POINTER(c_char), c_size_t, POINTER(c_size_t), POINTER(RequestStats)]),
    "kvx_consumer_next_failed": (_st, [c_void_p, POINTER(c_char), c_size_t, POINTER(c_size_t), POINTER(c_uint32), c_size_t, POINTER(c_size_t)]),
    "kvx_connector_over_agent": (_st, [c_void_p, c_char_p, POINTER(c_void_p)]),
    "kvx_connector_in_process": (_st, [POINTER(c_void_p)]),
    "kvx_connector_free": (None, [c_void_p]),
    "kvx_connector_producer": (_st, [c_void_p, POINTER(Layout), POINTER(CacheTensor), c_int32, POINTER(ConnectorConfig), POINTER(c_void_p)]),
    "kvx_connector_consumer": (_st, [c_void_p, POINTER(Layout), POINTER(CacheTensor), c_int32, POINTER(ConnectorConfig), POINTER(c_void_p)]),
    "kvx_consumer_metrics": (_st, [c_void_p, POINTER(c_char), c_size_t, POINTER(c_size_t)]),
    "kvx_connector_producer_groups": (_st, [c_void_p, POINTER(Layout), POINTER(POINTER(CacheTensor)), c_size_t, c_int32, POINTER(ConnectorConfig), POINTER(c_void_p)]),
    "kvx_connector_consumer_groups": (_st, [c_void_p, POINTER(Layout), POINTER(POINTER(CacheTensor)), c_size_t, c_int32, POINTER(ConnectorConfig), POINTER(c_void_p)]),
    "kvx_producer_publish_groups": (_st, [c_void_p, c_char_p, POINTER(c_uint8), c_size_t, POINTER(POINTER(c_uint32)), POINTER(c_size_t), c_size_t, c_uint64, c_uint32, POINTER(c_uint8), c_size_t, POINTER(c_size_t)]),
    "kvx_consumer_start_load_groups": (_st, [c_void_p, POINTER(c_uint8), c_size_t, POINTER(POINTER(c_uint32)), POINTER(c_size_t), c_size_t, POINTER(TpRead)]),
    "kvx_live": (_st, [POINTER(c_size_t)] * 4),
}


def _find():
    p = os.environ.get("KVXFER_LIB")
    if p:
        return p
    here = os.path.join(os.path.dirname(__file__), "libkvxfer.so")
    if os.path.exists(here):
        return here
    return ctypes.util.find_library("kvxfer") or "libkvxfer.so"


class Lib:
    """The loaded library (one per process)."""

    _instance = None

    @classmethod
    def get(cls):
        if cls._instance is None:
            cls._instance = Lib(_find())
        return cls._instance

    def __init__(self, path):
        self.path = path
        try:
            L = ctypes.CDLL(path)
        except OSError as e:
            source = "KVXFER_LIB" if os.environ.get("KVXFER_LIB") else "the bundled library"
            raise ImportError(
                f"kvxfer: cannot load libkvxfer ({source}: {path}): {e}. Install the plugin with "
                "`pip install <kvxfer checkout>/python` (it builds and bundles libkvxfer.so; "
                "needs cargo, pkg-config, libclang-dev and libucx-dev), or set KVXFER_LIB to a "
                "built libkvxfer.so (cargo build --release -p kvxfer-capi)."
            ) from e
        self.L = L
        for name, (res, args) in SIGNATURES.items():
            f = getattr(L, name)
            f.restype = res
            f.argtypes = args

    def version(self):
        return self.L.kvx_version().decode()

    def last_error(self):
        buf = ctypes.create_string_buffer(4096)
        self.L.kvx_last_error(buf, len(buf))
        return buf.value.decode(errors="replace")

    def check(self, status, ok=(KVX_OK,)):
        if status in ok:
            return status
        name = self.L.kvx_status_name(status).decode()
        raise KvxferError(status, name, self.last_error())

    def text(self, fn, *args, cap=4096):
        """Calls a function that writes text to (buf, cap, out_len), growing the buffer."""
        while True:
            buf = ctypes.create_string_buffer(cap)
            n = c_size_t(0)
            s = fn(*args, buf, cap, ctypes.byref(n))
            if s == KVX_BUFFER_TOO_SMALL:
                cap = n.value + 1
                continue
            self.check(s)
            return buf.raw[: n.value].decode()


class Agent:
    """One kvxfer agent, configured through the C ABI's config builder (nothing is passed
    through environment variables). ``secret`` (bytes), ``lane_encryption`` (with a secret,
    the TCP lane's data sealed too), ``ucx_tcp`` (let UCX use its own TCP transport too: trusted
    peers and networks only, a failing peer can abort this process; refused with a secret),
    ``ucx_emulated_shm`` (with ``lanes`` off, let UCX older than 1.22 carry shared-memory WRITEs,
    which it emulates through the target's receive FIFO: a writer killed mid-WRITE wedges the
    target; refused without it there), ``strict``, ``lanes``, ``device_lane`` (same-host
    GPU memory through CUDA IPC, on by default), ``gpu_path``
    ("auto", "direct", "staged"), ``staging`` ((chunks, chunk_bytes)), ``compression``
    ("auto", "on", "off") and ``handshake_timeout_ms`` (each step of ``connect``'s handshake;
    default 10,000) are optional."""

    def __init__(self, name, transport="auto", net_devices=None, budget_bytes=0, *, secret=None,
                 strict=False, lanes=True, gpu_path=None, staging=None, compression=None,
                 handshake_timeout_ms=None, lane_encryption=False, ucx_tcp=False,
                 device_lane=True, ucx_emulated_shm=False):
        self.lib = Lib.get()
        L = self.lib.L
        cfg = c_void_p()
        self.lib.check(L.kvx_agent_config_new(name.encode(), ctypes.byref(cfg)))
        try:
            self.lib.check(L.kvx_agent_config_set_transport(cfg, transport.encode()))
            if net_devices:
                self.lib.check(L.kvx_agent_config_set_net_devices(cfg, net_devices.encode()))
            if budget_bytes:
                self.lib.check(L.kvx_agent_config_set_budget(cfg, budget_bytes))
            if secret:
                buf = (c_uint8 * len(secret)).from_buffer_copy(secret)
                self.lib.check(L.kvx_agent_config_set_secret(cfg, buf, len(secret)))
            if lane_encryption:
                self.lib.check(L.kvx_agent_config_set_lane_encryption(cfg, 1))
            if ucx_tcp:
                self.lib.check(L.kvx_agent_config_set_ucx_tcp(cfg, 1))
            if ucx_emulated_shm:
                self.lib.check(L.kvx_agent_config_set_ucx_emulated_shm(cfg, 1))
            if strict:
                self.lib.check(L.kvx_agent_config_set_strict(cfg, 1))
            if not lanes:
                self.lib.check(L.kvx_agent_config_set_lanes(cfg, 0))
            if not device_lane:
                self.lib.check(L.kvx_agent_config_set_device_lane(cfg, 0))
            if gpu_path:
                self.lib.check(L.kvx_agent_config_set_gpu_path(cfg, str(gpu_path).encode()))
            if staging:
                self.lib.check(L.kvx_agent_config_set_staging(cfg, int(staging[0]), int(staging[1])))
            if compression:
                self.lib.check(L.kvx_agent_config_set_compression(cfg, str(compression).encode()))
            if handshake_timeout_ms is not None:
                self.lib.check(L.kvx_agent_config_set_handshake_timeout(cfg, int(handshake_timeout_ms)))
            h = c_void_p()
            self.lib.check(L.kvx_agent_new_with(cfg, ctypes.byref(h)))
        finally:
            L.kvx_agent_config_free(cfg)
        self.h = h
        self.name = name
        self.regions = []

    def listen(self, addr="127.0.0.1:0"):
        return self.lib.text(self.lib.L.kvx_agent_listen, self.h, addr.encode(), cap=128)

    def connect(self, addr):
        return self.lib.text(self.lib.L.kvx_agent_connect, self.h, addr.encode(), cap=512)

    def register(self, ptr, nbytes, cuda_device=-1, lane_only=False):
        """Registers ``nbytes`` at ``ptr``. ``lane_only``: shared with no peer, so only a
        connector's grants open it, on kvxfer's TCP lane (no UCX key, no shm handle, no device
        export; device memory staged through pinned chunks)."""
        r = c_void_p()
        if lane_only:
            self.lib.check(
                self.lib.L.kvx_agent_register_shared(self.h, c_void_p(ptr), nbytes, cuda_device, None, 0, ctypes.byref(r))
            )
        else:
            self.lib.check(self.lib.L.kvx_agent_register(self.h, c_void_p(ptr), nbytes, cuda_device, ctypes.byref(r)))
        self.regions.append(r)
        return self.lib.L.kvx_region_id(r)

    def metrics(self):
        return self.lib.text(self.lib.L.kvx_agent_metrics, self.h, cap=16384)

    def close(self):
        if self.h:
            for r in self.regions:
                self.lib.L.kvx_agent_deregister(self.h, r)
                self.lib.L.kvx_region_free(r)
            self.regions = []
            self.lib.L.kvx_agent_free(self.h)
            self.h = None


class Discovery:
    """Agents published in etcd and found by name (libkvxfer built with the etcd feature)."""

    def __init__(self, endpoints, namespace="/kvxfer", ttl_ms=0):
        self.lib = Lib.get()
        h = c_void_p()
        self.lib.check(self.lib.L.kvx_discovery_etcd(endpoints.encode(), namespace.encode(), ttl_ms, ctypes.byref(h)))
        self.h = h

    def publish(self, agent):
        self.lib.check(self.lib.L.kvx_discovery_publish(self.h, agent.h))

    def watch(self, agent):
        self.lib.check(self.lib.L.kvx_discovery_watch(self.h, agent.h))

    def resolve(self, agent, name):
        self.lib.check(self.lib.L.kvx_discovery_resolve(self.h, agent.h, name.encode()))

    def close(self):
        if self.h:
            self.lib.L.kvx_discovery_free(self.h)
            self.h = None


def _bytes(b):
    return (c_uint8 * len(b)).from_buffer_copy(b) if b else None


def seal_bytes(secret, data):
    """The 32-byte seal of ``data`` under ``secret``: a scheduler seals the handoff it wrote."""
    lib = Lib.get()
    out = (c_uint8 * 32)()
    lib.check(lib.L.kvx_handoff_seal_bytes(_bytes(secret), len(secret), _bytes(data), len(data), out))
    return bytes(out)


def verify_bytes(secret, data, seal):
    """Raises ``KvxferError`` (``KVX_AUTH``) unless ``seal`` is ``data``'s seal under ``secret``."""
    lib = Lib.get()
    lib.check(lib.L.kvx_handoff_verify_bytes(_bytes(secret), len(secret), _bytes(data), len(data), _bytes(seal), len(seal)))


def seal_handoff(secret, handoff):
    """``handoff`` (a libkvxfer handoff's JSON bytes) sealed under ``secret``."""
    lib = Lib.get()
    cap = len(handoff) + 256
    while True:
        buf = (c_uint8 * cap)()
        n = c_size_t(0)
        s = lib.L.kvx_handoff_seal(_bytes(secret), len(secret), _bytes(handoff), len(handoff), buf, cap, ctypes.byref(n))
        if s == KVX_BUFFER_TOO_SMALL:
            cap = n.value
            continue
        lib.check(s)
        return bytes(buf[: n.value])


def live():
    """What libkvxfer holds in this process now: agents not freed, regions registered, UCX
    memory registrations, peers' regions mapped. All zero once every object is closed."""
    lib = Lib.get()
    n = [c_size_t(0) for _ in range(4)]
    lib.check(lib.L.kvx_live(*[ctypes.byref(x) for x in n]))
    keys = ("agents", "regions", "ucx_registrations", "peer_mappings")
    return dict(zip(keys, (x.value for x in n)))


def tp_plan(prefill_tp, prefill_kv_heads, decode_tp, decode_kv_heads, decode_rank):
    """What decode rank ``decode_rank`` loads from which prefill ranks (``TpRead`` list, in
    prefill rank order); ``KvxferError`` naming both sides' shapes when the heads cannot split."""
    lib = Lib.get()
    args = (prefill_tp, prefill_kv_heads, decode_tp, decode_kv_heads, decode_rank)
    for v in args:
        # ctypes would wrap an out-of-range value into a uint32_t: refuse it here, typed.
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 32:
            raise KvxferError(KVX_INVALID_ARGUMENT, "KVX_INVALID_ARGUMENT", f"tp_plan: {v!r} is not a uint32")
    # Sized from the checked value: the library refuses more than KVX_MAX_TP prefill ranks.
    cap = max(1, min(prefill_tp, KVX_MAX_TP))
    while True:
        out = (TpRead * cap)()
        n = c_size_t(0)
        s = lib.L.kvx_tp_plan(prefill_tp, prefill_kv_heads, decode_tp, decode_kv_heads, decode_rank, out, cap, ctypes.byref(n))
        if s == KVX_BUFFER_TOO_SMALL and n.value > cap:
            cap = n.value
            continue
        lib.check(s)
        return [TpRead.from_buffer_copy(out[i]) for i in range(n.value)]


def layout_struct(layers, kv_heads, head_dim, dtype_bytes, block_tokens, num_blocks, packing, hnd, bases, state=None, pad_per_head=0):
    """A kvx_layout and its layer bases; ``packing`` is one of the KVX_PACKING_* constants.
    ``state``: a recurrent-state page's ``(parts, padding per unit)``, each part ``(rows,
    per_unit, channel_bytes)`` (``kv_heads`` then counts its split units). ``pad_per_head``:
    bytes after each block, per head (vLLM's padded attention pages in a hybrid model)."""
    lay = Layout(layers, kv_heads, head_dim, dtype_bytes, block_tokens, num_blocks, packing, 1 if hnd else 0)
    lay.pad_per_head = pad_per_head
    if state is not None:
        parts, padding = state
        arr = (StatePart * len(parts))()
        keep = []
        for i, (rows, per_unit, channel_bytes) in enumerate(parts):
            segs = (c_uint64 * len(per_unit))(*per_unit)
            keep.append(segs)
            arr[i] = StatePart(rows, len(per_unit), ctypes.cast(segs, POINTER(c_uint64)), channel_bytes)
        lay.state_parts = ctypes.cast(arr, POINTER(StatePart))
        lay.state_parts_len = len(parts)
        lay.state_padding = padding
        # The arrays live as long as the layout.
        lay._keep = (arr, keep)
    arr = (LayerBase * layers)()
    for i, (kr, ko, vr, vo) in enumerate(bases):
        arr[i] = LayerBase(kr, ko, 0xFFFFFFFF if vr is None else vr, vo)
    return lay, arr


def config_struct(mode="pull", lease_ms=0, heartbeat_ms=0, readers=0, heads=None, budget_bytes=0):
    c = ConnectorConfig()
    c.mode = 1 if mode == "push" else 0
    c.lease_ms = lease_ms
    c.heartbeat_ms = heartbeat_ms
    c.readers = readers
    if heads:
        c.heads_start, c.heads_end = heads
    c.budget_bytes = budget_bytes
    return c


def _block_lists(groups):
    """Arrays of each group's blocks (kept alive by the caller), their pointers and counts."""
    arrays = [(c_uint32 * max(1, len(b)))(*b) for b in groups]
    ptrs = (POINTER(c_uint32) * len(groups))(*[ctypes.cast(a, POINTER(c_uint32)) for a in arrays])
    counts = (c_size_t * len(groups))(*[len(b) for b in groups])
    return arrays, ptrs, counts


def tensors_struct(tensors):
    """Per layer (k_ptr, k_len) for a fused layout, or (k_ptr, k_len, v_ptr, v_len)."""
    arr = (CacheTensor * len(tensors))()
    for i, t in enumerate(tensors):
        k, kl, v, vl = (tuple(t) + (None, 0))[:4]
        arr[i] = CacheTensor(c_void_p(k), kl, c_void_p(v) if v else None, vl)
    return arr


class Connector:
    """An implementation of kvxfer's connector traits (libkvxfer's kvx_connector): producers
    and consumers it makes are driven by the same Producer / Consumer calls whichever it is."""

    def __init__(self, lib, h):
        self.lib, self.h = lib, h

    @classmethod
    def over_agent(cls, agent, side_channel=None):
        h = c_void_p()
        agent.lib.check(agent.lib.L.kvx_connector_over_agent(agent.h, side_channel.encode() if side_channel else None, ctypes.byref(h)))
        return cls(agent.lib, h)

    @classmethod
    def in_process(cls):
        lib = Lib.get()
        h = c_void_p()
        lib.check(lib.L.kvx_connector_in_process(ctypes.byref(h)))
        return cls(lib, h)

    def _make(self, fn, layout, tensors, cuda_device, cfg):
        arr = tensors_struct(tensors)
        h = c_void_p()
        self.lib.check(fn(self.h, ctypes.byref(layout), arr, cuda_device, ctypes.byref(cfg), ctypes.byref(h)))
        return h

    def producer(self, layout, tensors, cfg, cuda_device=-1):
        return Producer.wrap(self.lib, self._make(self.lib.L.kvx_connector_producer, layout, tensors, cuda_device, cfg))

    def consumer(self, layout, tensors, cfg, cuda_device=-1):
        return Consumer.wrap(self.lib, self._make(self.lib.L.kvx_connector_consumer, layout, tensors, cuda_device, cfg))

    def _make_groups(self, fn, groups, cuda_device, cfg):
        """``groups``: (layout, tensors) per cache group, in the engine's order."""
        layouts = (Layout * len(groups))(*[g[0] for g in groups])
        arrays = [tensors_struct(g[1]) for g in groups]
        ptrs = (POINTER(CacheTensor) * len(groups))(*[ctypes.cast(a, POINTER(CacheTensor)) for a in arrays])
        h = c_void_p()
        self.lib.check(fn(self.h, layouts, ptrs, len(groups), cuda_device, ctypes.byref(cfg), ctypes.byref(h)))
        return h

    def producer_groups(self, groups, cfg, cuda_device=-1):
        return Producer.wrap(self.lib, self._make_groups(self.lib.L.kvx_connector_producer_groups, groups, cuda_device, cfg))

    def consumer_groups(self, groups, cfg, cuda_device=-1):
        return Consumer.wrap(self.lib, self._make_groups(self.lib.L.kvx_connector_consumer_groups, groups, cuda_device, cfg))

    def close(self):
        if self.h is not None:
            self.lib.L.kvx_connector_free(self.h)
            self.h = None


class Producer:
    @classmethod
    def wrap(cls, lib, h):
        p = cls.__new__(cls)
        p.lib, p.h = lib, h
        return p

    def __init__(self, agent, layout, bases, cfg, side_channel=None):
        self.lib = agent.lib
        h = c_void_p()
        self.lib.check(
            self.lib.L.kvx_producer_new(
                agent.h, ctypes.byref(layout), bases, ctypes.byref(cfg),
                side_channel.encode() if side_channel else None, ctypes.byref(h),
            )
        )
        self.h = h

    def publish(self, request, blocks, tokens, layers_done, grant=None):
        """Holds ``blocks`` of ``request``; returns the handoff (bytes). ``grant`` (16 bytes):
        the one the scheduler put into the handoff it wrote, else a fresh one."""
        arr = (c_uint32 * len(blocks))(*blocks)
        cap = 4096 + 16 * len(blocks)
        while True:
            buf = (c_uint8 * cap)()
            n = c_size_t(0)
            if grant is None:
                s = self.lib.L.kvx_producer_publish(self.h, request.encode(), arr, len(blocks), tokens, layers_done, buf, cap, ctypes.byref(n))
            else:
                g = _bytes(grant)
                s = self.lib.L.kvx_producer_publish_granted(self.h, request.encode(), g, len(grant), arr, len(blocks), tokens, layers_done, buf, cap, ctypes.byref(n))
            if s == KVX_BUFFER_TOO_SMALL:
                cap = n.value
                continue
            self.lib.check(s)
            return bytes(buf[: n.value])

    def publish_groups(self, request, groups, tokens, layers_done, grant=None):
        """``publish`` for a cache of several groups: ``groups[g]`` are group g's blocks
        (``KVX_NO_BLOCK`` where it holds none)."""
        arrays, ptrs, counts = _block_lists(groups)
        g = _bytes(grant) if grant is not None else None
        cap = 4096 + 16 * sum(len(b) for b in groups) + 512 * len(groups)
        while True:
            buf = (c_uint8 * cap)()
            n = c_size_t(0)
            s = self.lib.L.kvx_producer_publish_groups(
                self.h, request.encode(), g, len(grant) if grant is not None else 0, ptrs, counts, len(groups),
                tokens, layers_done, buf, cap, ctypes.byref(n),
            )
            if s == KVX_BUFFER_TOO_SMALL:
                cap = n.value
                continue
            self.lib.check(s)
            return bytes(buf[: n.value])

    def layer_done(self, request, layer):
        self.lib.check(self.lib.L.kvx_producer_layer_done(self.h, request.encode(), layer))

    def abort(self, request):
        self.lib.check(self.lib.L.kvx_producer_abort(self.h, request.encode()))

    def next_freed(self, timeout_ms=0):
        """(request, blocks, reason) or None; reason 0 acked, 1 aborted, 2 expired, 3 held for
        the longest time a request may be."""
        name_cap, blocks_cap = 256, 4096
        while True:
            name = ctypes.create_string_buffer(name_cap)
            nl = c_size_t(0)
            blocks = (c_uint32 * blocks_cap)()
            nb = c_size_t(0)
            reason = c_uint32(0)
            s = self.lib.L.kvx_producer_next_freed(self.h, timeout_ms, name, name_cap, ctypes.byref(nl), blocks, blocks_cap, ctypes.byref(nb), ctypes.byref(reason))
            if s == KVX_NOT_FOUND:
                return None
            if s == KVX_BUFFER_TOO_SMALL:
                name_cap, blocks_cap = max(name_cap, nl.value + 1), max(blocks_cap, nb.value)
                continue
            self.lib.check(s)
            return name.raw[: nl.value].decode(), list(blocks[: nb.value]), reason.value

    def metrics(self):
        return self.lib.text(self.lib.L.kvx_producer_metrics, self.h, cap=16384)

    def close(self):
        if self.h:
            self.lib.L.kvx_producer_free(self.h)
            self.h = None


class Consumer:
    @classmethod
    def wrap(cls, lib, h):
        c = cls.__new__(cls)
        c.lib, c.h = lib, h
        return c

    def __init__(self, agent, layout, bases, cfg):
        self.lib = agent.lib
        h = c_void_p()
        self.lib.check(self.lib.L.kvx_consumer_new(agent.h, ctypes.byref(layout), bases, ctypes.byref(cfg), ctypes.byref(h)))
        self.h = h

    def start_load(self, handoff, local_blocks, read=None):
        """Loads ``handoff`` into ``local_blocks``; ``read``: a ``TpRead`` of ``tp_plan`` (the
        heads to move and where, and the readers to declare), else every head."""
        hb = (c_uint8 * len(handoff)).from_buffer_copy(handoff)
        arr = (c_uint32 * len(local_blocks))(*local_blocks)
        ref = ctypes.byref(read) if read is not None else None
        self.lib.check(self.lib.L.kvx_consumer_start_load_with(self.h, hb, len(handoff), arr, len(local_blocks), ref))

    def start_load_groups(self, handoff, groups, read=None):
        """``start_load`` for a cache of several groups: ``groups[g]`` are group g's local
        blocks (``KVX_NO_BLOCK`` where nothing is to land)."""
        hb = (c_uint8 * len(handoff)).from_buffer_copy(handoff)
        arrays, ptrs, counts = _block_lists(groups)
        ref = ctypes.byref(read) if read is not None else None
        self.lib.check(self.lib.L.kvx_consumer_start_load_groups(self.h, hb, len(handoff), ptrs, counts, len(groups), ref))

    def wait(self, request, timeout_ms=0):
        self.lib.check(self.lib.L.kvx_consumer_wait(self.h, request.encode(), timeout_ms))

    def wait_layer(self, request, layer, timeout_ms=0):
        self.lib.check(self.lib.L.kvx_consumer_wait_layer(self.h, request.encode(), layer, timeout_ms))

    def next_finished(self):
        name = ctypes.create_string_buffer(1024)
        n = c_size_t(0)
        st = RequestStats()
        s = self.lib.L.kvx_consumer_next_finished(self.h, name, 1024, ctypes.byref(n), ctypes.byref(st))
        if s == KVX_NOT_FOUND:
            return None
        self.lib.check(s)
        return name.raw[: n.value].decode(), {f: getattr(st, f) for f, _ in RequestStats._fields_}

    def next_failed(self):
        name = ctypes.create_string_buffer(1024)
        n = c_size_t(0)
        blocks = (c_uint32 * 65536)()
        nb = c_size_t(0)
        s = self.lib.L.kvx_consumer_next_failed(self.h, name, 1024, ctypes.byref(n), blocks, 65536, ctypes.byref(nb))
        if s == KVX_NOT_FOUND:
            return None
        self.lib.check(s)
        return name.raw[: n.value].decode(), list(blocks[: nb.value]), self.lib.last_error()

    def metrics(self):
        return self.lib.text(self.lib.L.kvx_consumer_metrics, self.h, cap=16384)

    def close(self):
        if self.h:
            self.lib.L.kvx_consumer_free(self.h)
            self.h = None

