"""KvxferConnector: vLLM's KVConnectorBase_V1 over kvxfer (libkvxfer through ctypes).

Disaggregated prefill/decode, pull mode (the decode worker READs), as vLLM's NixlConnector:

* prefill engine: a request sent with ``kv_transfer_params={"do_remote_decode": True}`` and
  ``max_tokens=1`` finishes; ``request_finished`` keeps its blocks (delay-free) and returns
  ``{"do_remote_prefill": True, "kvxfer_handoff": ...}``; the worker publishes the blocks in
  the next step and reports them sent once the decode side acknowledged (or the lease ran out);
* decode engine: the request arrives with those params; ``get_num_new_matched_tokens``
  reports the prompt tokens it does not hold as loadable asynchronously;
  ``update_state_after_alloc`` records the blocks vLLM allocated for them; the worker loads
  only those (a locally cached prefix stays) and reports the request received.

Tensor parallelism: every rank is its own agent. Each prefill rank publishes a request under
``<request>#tp<rank>``; the handoff lists every prefill rank (name, side channel, heads) with
the prefill TP size and the model's KV heads; each decode rank asks libkvxfer's
``kvx_tp_plan`` which prefill ranks' heads it reads into which of its own (equal TP: rank to
rank; prefill TP 2 -> decode TP 1: both halves, each into its place; TP 1 -> TP 2: half each;
fewer KV heads than ranks: one replica read, the others only acknowledged), loads each, and
reports the request received when all are in. Every decode rank declares to each prefill rank
how many decode ranks read from it, so a prefill rank frees the blocks after the last one. A
geometry that cannot work (heads that do not split over a TP size, a different model, another
layout, block size, head size or dtype) fails the load with an error naming both sides'
shapes, and the request's blocks are reported invalid, never silently wrong.

Supported caches: vLLM 0.33's per-layer views ``[num_blocks, num_kv_heads, block_size,
2*head_size]`` with K and V packed in the last dimension, physical order NHD
(``KVCacheLayout.LBNHC``, the default) or HND (``LBHNC``); MLA models' ``[num_blocks,
block_size, latent]`` views (no head dimension, the same latent on every TP rank: each decode
rank reads it once, from prefill rank ``rank % prefill_tp``); one KV cache group, host (CPU)
tensors or device tensors with a libkvxfer built with ``--features cuda``. Device tensors are
registered as device memory and never mirrored in host memory (what
``kv_buffer_device=cpu`` does in NixlConnector): UCX moves them directly where it has CUDA
transports, else they stream through a fixed pool of pinned chunks. ``kv_connector_extra_config``:
``transport`` (default "auto"), ``net_devices``, ``host`` (side channel address; default the
first net device's IPv4 address, else 127.0.0.1), ``port``, ``lease_ms``, ``budget_mib``, ``rundir``, ``metrics_file`` (Prometheus text written
after every change, for a textfile collector), ``gpu_path`` (device tensors: ``auto``,
``direct`` through a CUDA-aware UCX, or ``staged`` through pinned host chunks charged to
``budget_mib``; ``kv_buffer_device: "cpu"`` in the transfer config means ``staged``),
``staging_chunks`` and ``staging_chunk_kib`` (that pool's size, default 8 x
4096 KiB), ``secret`` (a shared secret keying the Noise handshakes of the side channel and
of every TCP-lane connection, and sealing each handoff the scheduler writes: the decode side
loads none whose ``kvxfer_seal`` does not verify; SECURITY.md says what it protects and what
not yet),
``lane_encryption`` (with ``secret``: the KV bytes on the TCP lane are encrypted too),
``lane_only_cache`` (on by default with a ``secret``: host or GPU caches published with no
UCX key, no shared-memory handle and no device export, so a peer reads only the blocks
granted to it on every path; every handoff then takes kvxfer's TCP lane, in-host too,
staged for GPU caches; ``false`` gives same-host workers that
trust each other the shm and device lanes back), ``ucx_tcp`` (let UCX use its own, unauthenticated TCP transport too; off by default, lanes
on or off; trusted peers and networks only: a peer that fails while it serves that peer's
READ aborts the worker inside UCX; refused with a ``secret``), ``strict`` (refuse a silent transport fallback), ``discovery`` (``etcd://host:2379``: workers publish
themselves in etcd and load each other before any handoff; ``namespace``,
``discovery_ttl_ms``; with etcd's own authentication on, ``etcd_user`` and ``etcd_password``,
or ``etcd://user:password@host:2379``; over TLS, ``etcd_ca`` (the CA's PEM file) or
``etcds://host:2379?ca=PATH``), ``compression`` (the TCP lane's: ``auto``, the default, compresses a
handoff where the measured link is slower than the codec makes worthwhile; ``on``; ``off``),
``handshake_timeout_ms`` (how long each step of meeting a peer on its side channel may wait;
default 10,000). Every option goes to the agent through the C ABI's
config builder, none through environment variables.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from . import lib as kx

try:
    from vllm.logger import init_logger

    logger = init_logger(__name__)
except Exception:  # pragma: no cover
    import logging

    logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


@dataclass
class KvxferConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, per step."""

    # decode side: vLLM request id -> (handoff bytes, local block ids per KV cache group,
    # report as received, the handoff's seal as the client passed it: hex, or None)
    loads: dict[str, tuple[bytes, list[list[int]], bool, str | None]] = field(default_factory=dict)
    # prefill side: vLLM request id -> (block ids per group, prompt tokens, the handoff's grant)
    publishes: dict[str, tuple[list[list[int]], int, bytes]] = field(default_factory=dict)


@dataclass
class KvxferConnectorStats(KVConnectorStats):
    """Per-interval transfer figures (bytes moved / skipped, loads, failures)."""

    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self):
        self.data = {"loads": 0, "failed": 0, "bytes_moved": 0, "bytes_skipped": 0, "handoff_s": 0.0}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        d = dict(self.data)
        d["handoff_s_avg"] = d["handoff_s"] / d["loads"] if d["loads"] else 0.0
        return d

    def is_empty(self) -> bool:
        return self.data["loads"] == 0 and self.data["failed"] == 0


@dataclass
class KvxferHandshakeMetadata(KVConnectorHandshakeMetadata):
    """What a worker tells its scheduler after registering its caches (vLLM carries it from
    every worker to the scheduler: no shared folder): the producer's name and side channel,
    and the cache's shape that goes into every handoff."""

    template: dict[str, Any]


def iface_ipv4(name: str) -> str | None:
    """The IPv4 address of network interface `name` (Linux), or None."""
    import fcntl
    import socket
    import struct

    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        req = struct.pack("256s", name[:15].encode())
        return socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24])  # SIOCGIFADDR
    except OSError:
        return None
    finally:
        s.close()


def gpu_path_for(kv_buffer_device: str | None, extra: dict[str, Any]) -> str | None:
    """The agent's GPU path: "gpu_path" if set; else ``kv_buffer_device: "cpu"`` (NixlConnector's
    host-buffer setting, which the motivating deployments used) maps to kvxfer's staged path,
    whose pinned chunks are bounded and charged to the budget, never a host mirror of the whole
    cache; else kvxfer's default (direct where UCX has CUDA transports)."""
    if extra.get("gpu_path"):
        return str(extra["gpu_path"])
    if (kv_buffer_device or "").lower() == "cpu":
        return "staged"
    return None


def _advertised_host(extra: dict[str, Any]) -> str:
    """Where the side channel listens, which is what every handoff advertises: "host" if set,
    else the address of the first of "net_devices" (so a decode engine on another host can
    reach it), else loopback (one host only, said in the log)."""
    if extra.get("host"):
        return str(extra["host"])
    for dev in str(extra.get("net_devices") or "").split(","):
        addr = iface_ipv4(dev.split(":")[0].strip()) if dev.strip() else None
        if addr:
            return addr
    logger.warning(
        "kvxfer: no \"host\" and no net_devices with an IPv4 address: the side channel listens "
        "on 127.0.0.1, which only engines on this host can reach"
    )
    return "127.0.0.1"


class KvxferPromMetrics(KVConnectorPromMetrics):
    """kvxfer's figures in vLLM's own Prometheus registry (served on vLLM's /metrics), per
    engine: loads, failed loads, bytes moved and skipped (a cached prefix), handoff seconds."""

    # stats key -> (metric name, help)
    COUNTERS = {
        "loads": ("vllm:kvxfer_loads_total", "KV handoffs loaded by the decode side."),
        "failed": ("vllm:kvxfer_load_failures_total", "KV handoffs that failed (their blocks reported invalid)."),
        "bytes_moved": ("vllm:kvxfer_bytes_moved_total", "KV bytes moved over the wire."),
        "bytes_skipped": ("vllm:kvxfer_bytes_skipped_total", "KV bytes not moved: the decode side held them (prefix cache)."),
        "handoff_s": ("vllm:kvxfer_handoff_seconds_total", "Seconds from load start to load done, summed."),
    }

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            k: self._counter_cls(name=n, documentation=d, labelnames=self._labelnames)
            for k, (n, d) in self.COUNTERS.items()
        }
        self._children: dict[tuple[int, str], Any] = {}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for k, v in (transfer_stats_data or {}).items():
            c = self._counters.get(k)
            if c is None or not v:
                continue
            child = self._children.get((engine_idx, k))
            if child is None:
                child = c.labels(*self.per_engine_labelvalues[engine_idx])
                self._children[(engine_idx, k)] = child
            child.inc(v)


# What a handoff carries of each prefill rank: one libkvxfer handoff's producer part. "epoch"
# (the rank's incarnation) lets a decode rank fail a load at once when that prefill rank
# restarted; templates of a libkvxfer without it lack it.
RANK_KEYS = ("producer", "side_channel", "compat", "kv_heads", "num_blocks", "layers", "epoch", "groups")
# What two sides' caches must agree on in each KV cache group after the first.
GROUP_SHAPE_KEYS = ("kv_heads", "head_size", "hnd", "mla", "state")


def _strides_are(t: torch.Tensor, start: int, want: tuple[int, ...]) -> bool:
    """Whether dimensions ``start..`` of ``t`` have strides ``want``, where a dimension of
    size 1 may have any (it is never stepped)."""
    return all(n == 1 or s == w for n, s, w in zip(t.shape[start:], t.stride()[start:], want))


# vLLM's null block (a sliding window's blocks before it): kvxfer's "no block here".
NULL_BLOCK = 0


def _group_blocks(blocks: Any, block_size: int, tokens: int | None = None) -> list[int]:
    """One KV cache group's block ids as libkvxfer takes them: vLLM's null block as
    KVX_NO_BLOCK, and (with `tokens`) only the prompt's blocks."""
    b = [kx.KVX_NO_BLOCK if x == NULL_BLOCK else int(x) for x in blocks]
    return b[: -(-tokens // block_size)] if tokens is not None else b
# The longest kvxfer_handoff text taken from a client (a TP-8 handoff of a 128k-token prompt
# is under 200 KiB).
MAX_HANDOFF_TEXT = 4 << 20


def _last_held(blocks: list[int]) -> list[int]:
    """A recurrent-state group's blocks as a load pairs them: its last held block alone
    (the state after the prompt), none when it holds none."""
    held = [b for b in blocks if b != kx.KVX_NO_BLOCK]
    return held[-1:]


def _state_groups(cfg: Any) -> set[int]:
    """The KV cache groups of `cfg` that hold recurrent state (vLLM's MambaSpec: Mamba,
    Mamba2, GDN, short conv)."""
    groups = getattr(cfg, "kv_cache_groups", None) or []
    return {g for g, spec in enumerate(groups) if "Mamba" in type(spec.kv_cache_spec).__name__}


def _state_split(spec: Any, page: int, tp: int) -> dict[str, Any]:
    """A MambaSpec page as kvxfer splits it across TP (``kx.layout_struct``'s ``state``): the
    conv state's sub-projections (Mamba2 x, B, C; GDN Q, K, V; Mamba1 x) and the SSM state's
    heads, in split units (the gcd of this rank's channel counts, so each part's channels per
    unit are the same on every TP size). vLLM's NixlConnector derives the same split
    (``derive_mamba_conv_split``). A kind or shape this does not know: ``{}`` (the page moves
    whole, between equal TP sizes only)."""
    import math

    try:
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
        from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum as K

        (conv, ssm), (cdt, sdt) = spec.shapes[:2], spec.dtypes[:2]
        kind = spec.mamba_type
        if getattr(spec, "tp_replicated", False) or len(spec.shapes) != 2 or len(conv) != 2 or len(ssm) < 2:
            return {}
        ds = is_conv_state_dim_first()
        dim, rows = (conv[0], conv[1]) if ds else (conv[1], conv[0])
        ces, ses = (torch.tensor([], dtype=d).element_size() for d in (cdt, sdt))
        if kind == K.MAMBA1:
            dims = (dim,)
        elif kind == K.MAMBA2:
            x = ssm[0] * ssm[1]
            dims = (x, (dim - x) // 2, (dim - x) // 2)
        elif kind == K.GDN_ATTN:
            v = ssm[0] * ssm[1]
            dims = ((dim - v) // 2, (dim - v) // 2, v)
        else:
            return {}
        if sum(dims) != dim or min(dims) <= 0:
            return {}
        units = math.gcd(*dims, ssm[0])
        conv_part = (1, [d // units for d in dims], rows * ces) if ds else (rows, [d // units for d in dims], ces)
        ssm_part = (1, [ssm[0] // units], math.prod(ssm[1:]) * ses)
        used = dim * rows * ces + math.prod(ssm) * ses
        # The padding to the attention page shrinks with the TP size as the state does: per
        # unit, or the page does not split.
        if used > page or (page - used) % units:
            return {}
        return dict(heads=units, parts=([conv_part, ssm_part], (page - used) // units))
    except Exception:  # noqa: BLE001 - a vLLM without these helpers: the page moves whole
        return {}


def _params(request: "Request") -> dict[str, Any] | None:
    """A request's kv_transfer_params when it is a JSON object; a client's value of any other
    type is no params (never an exception in vLLM's scheduler)."""
    p = getattr(request, "kv_transfer_params", None)
    return p if isinstance(p, dict) else None


def _remote_prefill(p: dict[str, Any] | None) -> bool:
    """Whether the client asks for a remote prefill with a kvxfer handoff."""
    return bool(p) and bool(p.get("do_remote_prefill")) and p.get("kvxfer_handoff") is not None


def _handoff_text(value: Any) -> bytes:
    """The handoff's bytes as the client sent them: a string as it is, any other JSON value
    as its JSON text (the worker then refuses it, and the request fails alone), b"" past
    MAX_HANDOFF_TEXT or when it is no JSON at all."""
    if not isinstance(value, str):
        try:
            value = json.dumps(value)
        except (TypeError, ValueError):
            return b""
    if len(value) > MAX_HANDOFF_TEXT:
        return b""
    return value.encode("utf-8", "replace")


def _checked_handoff(h: Any) -> dict[str, Any]:
    """`h` (a client's JSON) as a handoff whose fields this plugin reads have their types and
    ranges; ValueError naming the first that does not."""
    if not isinstance(h, dict):
        raise ValueError(f"the handoff is a JSON {type(h).__name__}, not an object")
    if not isinstance(h.get("request"), str):
        raise ValueError("the handoff's request is not a string")
    ranks = h.get("ranks")
    if ranks is not None:
        if not isinstance(ranks, list) or not 1 <= len(ranks) <= kx.KVX_MAX_TP or not all(isinstance(r, dict) for r in ranks):
            raise ValueError(f"the handoff's ranks are not 1 to {kx.KVX_MAX_TP} objects")
    tp = h.get("tp", len(ranks) if ranks else 1)
    if isinstance(tp, bool) or not isinstance(tp, int) or not 1 <= tp <= kx.KVX_MAX_TP:
        raise ValueError(f"the handoff's tp {tp!r} is not 1 to {kx.KVX_MAX_TP}")
    if ranks and tp != len(ranks):
        raise ValueError(f"the handoff's tp {tp} does not match its {len(ranks)} ranks")
    shape = h.get("shape")
    if shape is not None and not isinstance(shape, dict):
        raise ValueError("the handoff's shape is not an object")
    if shape and not isinstance(shape.get("layers", []), list):
        raise ValueError("the handoff's shape.layers is not a list")
    heads = (shape or {}).get("kv_heads_total")
    if heads is not None and (isinstance(heads, bool) or not isinstance(heads, int) or not 0 < heads <= kx.KVX_MAX_KV_HEADS):
        raise ValueError(f"the handoff's shape.kv_heads_total {heads!r} is not 1 to {kx.KVX_MAX_KV_HEADS}")
    gb = h.get("group_blocks")
    if gb is not None and (not isinstance(gb, list) or not 1 <= len(gb) < kx.KVX_MAX_GROUPS or not all(isinstance(b, list) for b in gb)):
        raise ValueError(f"the handoff's group_blocks are not 1 to {kx.KVX_MAX_GROUPS - 1} lists")
    stages = h.get("stages")
    if stages is not None and (not isinstance(stages, list) or not 2 <= len(stages) <= kx.KVX_MAX_TP or not all(isinstance(x, dict) for x in stages)):
        raise ValueError(f"the handoff's stages are not 2 to {kx.KVX_MAX_TP} objects")
    return h


def _tp_size(vllm_config: "VllmConfig") -> int:
    try:
        return int(vllm_config.parallel_config.tensor_parallel_size)
    except Exception:  # pragma: no cover
        return 1


def _total_kv_heads(vllm_config: "VllmConfig") -> int:
    return int(vllm_config.model_config.get_total_num_kv_heads())


def _shape(t: dict[str, Any]) -> str:
    """A side's cache shape, for refusals that name both sides."""
    return (
        f"TP {t.get('tp', 1)} over {t.get('kv_heads_total', t.get('kv_heads'))} KV heads "
        f"({t.get('kv_heads')} per rank), {len(t.get('layers', []))} layers, head size "
        f"{t.get('head_size')}, {t.get('dtype_bytes')}-byte elements, {t.get('block_size')}-token "
        f"blocks, {'MLA latent' if t.get('mla') else 'HND' if t.get('hnd') else 'NHD'}"
    )


def _rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except Exception:  # not initialised (tests, single process)
        return 0


def _pp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_pp_group

        return get_pp_group().rank_in_group
    except Exception:  # not initialised (tests, single process)
        return 0


def _pp_size(vllm_config: "VllmConfig") -> int:
    try:
        return int(vllm_config.parallel_config.pipeline_parallel_size)
    except Exception:  # pragma: no cover
        return 1


def _rundir(extra: dict[str, Any]) -> str:
    d = extra.get("rundir") or os.path.join("/tmp", f"kvxfer-{os.getuid()}")
    os.makedirs(d, exist_ok=True)
    return d


# Connectors alive in this process: an engine that stops in order (vLLM's engine processes
# turn SIGTERM into SystemExit) closes them at exit, so the process ends with nothing of
# libkvxfer left registered or mapped (`kx.live()`), whether or not vLLM called shutdown().
_ALIVE: "weakref.WeakSet[KvxferConnector]" = weakref.WeakSet()


@atexit.register
def _shutdown_alive() -> None:
    for c in list(_ALIVE):
        try:
            c.shutdown()
        except Exception:  # pragma: no cover - best effort at exit
            pass


class KvxferConnector(KVConnectorBase_V1, SupportsHMA):
    # Tokens it loads come from another engine's KV (vLLM's cache-hit metrics by tier).
    _cache_hit_source = CacheHitSource.P2P

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return True

    def __init__(
        self,
        vllm_config: "VllmConfig",
        role: KVConnectorRole,
        kv_cache_config: "KVCacheConfig | None" = None,
    ):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = vllm_config.kv_transfer_config
        self._tc = tc
        self.engine_id = tc.engine_id
        self.extra = dict(tc.kv_connector_extra_config or {})
        self.kv_role = tc.kv_role
        self.block_size = vllm_config.cache_config.block_size
        self.rank = _rank()
        self.tp_size = _tp_size(vllm_config)
        # Pipeline parallelism: each stage's workers hold its layers; a request is published
        # and loaded stage by stage, stage q of the decode side from stage q of the prefill side.
        self.pp_rank = _pp_rank()
        self.pp_size = _pp_size(vllm_config)
        self._where = f"tp{self.rank}" if self.pp_size == 1 else f"pp{self.pp_rank}tp{self.rank}"
        self._stages: list[list[dict[str, Any]]] = []
        self.kv_heads_total = _total_kv_heads(vllm_config)
        # Only with an explicit "rundir" are templates also written to (and read from) files.
        self.template_path = (
            os.path.join(_rundir(self.extra), f"{self.engine_id}-tp{self.rank}.json")
            if self.extra.get("rundir")
            else None
        )
        self._handshake: KvxferHandshakeMetadata | None = None
        self._templates: dict[int, dict[str, Any]] = {}
        # scheduler side
        self._template: dict[str, Any] | None = None
        self._pending_loads: dict[str, tuple[bytes, list[int], bool, str | None]] = {}
        self._pending_publishes: dict[str, tuple[list[int], int, bytes]] = {}
        # The deployment's shared secret: it keys the agents' handshakes and seals handoffs.
        self._secret = str(self.extra["secret"]).encode() if self.extra.get("secret") else None
        # worker side
        self._lock = threading.Lock()
        self.agent: kx.Agent | None = None
        self.producer: kx.Producer | None = None
        self.consumer: kx.Consumer | None = None
        self.discovery: kx.Discovery | None = None
        self.num_layers = 0
        self.num_groups = 1
        self._by_handoff: dict[str, str] = {}  # handoff request -> local request id
        # local request id -> (handoff requests still loading, local blocks, any part failed)
        self._parts: dict[str, tuple[set[str], list[int], bool]] = {}
        self._shape: dict[str, Any] | None = None
        self._silent: set[str] = set()
        self._finished_seen: set[str] = set()
        self._freed_unreported: set[str] = set()
        self._load_errors: set[int] = set()
        self._failed_now: set[str] = set()  # failed before or while starting: report received
        self._stats = KvxferConnectorStats()
        # KV cache groups of recurrent state (Mamba, GDN): their page moves whole, and the
        # decode side recomputes the prompt's last token (a state cannot take it twice).
        self._state_groups = _state_groups(kv_cache_config)
        _ALIVE.add(self)

    # ------------------------------------------------------------------ scheduler side

    def _backoff(self) -> int:
        """Prompt tokens the decode side recomputes rather than loads: 1 with recurrent
        state (the prefill stops one token short, so its state is h(N-1) and the decode
        side's first step takes token N once), else 0 (attention KV of the last token is
        loaded and recomputed alike)."""
        return 1 if self._state_groups else 0

    def on_new_request(self, request: "Request") -> None:
        """Prefill side, with recurrent state: the request stops one prompt token short
        (vLLM's NixlConnector does the same), once, and samples one token."""
        p = _params(request)
        back = self._backoff()
        if not back or not p or not p.get("do_remote_decode") or p.get("_kvxfer_truncated"):
            return
        ids = request.prompt_token_ids
        if ids is None or request.num_prompt_tokens <= back:
            return
        del ids[-back:]
        del request._all_token_ids[-back:]
        request.num_prompt_tokens -= back
        request.max_tokens = 1
        p["_kvxfer_truncated"] = True

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        if _remote_prefill(_params(request)):
            n = len(request.prompt_token_ids or [])
            count = (n - self._backoff() if n > self._backoff() else n) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        p = _params(request)
        if p is None or not _remote_prefill(p):
            return
        # A client's values: whatever their types, the worker checks them and fails this
        # request alone.
        handoff = _handoff_text(p.get("kvxfer_handoff"))
        seal = p.get("kvxfer_seal")
        if num_external_tokens > 0:
            # Every KV cache group's blocks (a sliding window's null blocks move nothing).
            groups = blocks.get_unhashed_block_ids_all_groups()
            local = [_group_blocks(g, self.block_size) for g in groups] if groups else [[]]
            local = [_last_held(b) if i in self._state_groups else b for i, b in enumerate(local)]
            self._pending_loads[request.request_id] = (handoff, local, True, seal)
        else:
            # Everything is cached locally: nothing moves, but the producer may free.
            self._pending_loads[request.request_id] = (handoff, [], False, seal)
        p["do_remote_prefill"] = False

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KvxferConnectorMetadata(loads=self._pending_loads, publishes=self._pending_publishes)
        self._pending_loads = {}
        self._pending_publishes = {}
        return meta

    def request_finished(self, request: "Request", block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        """vLLM without its hybrid allocator: one KV cache group's blocks."""
        blocks = list(block_ids[0]) if block_ids and isinstance(block_ids[0], (list, tuple)) else list(block_ids or [])
        return self.request_finished_all_groups(request, (blocks,))

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """Every KV cache group's blocks of a finished prefill (``SupportsHMA``): each group
        moves its own, a sliding window's null blocks (outside the window) not at all."""
        from vllm.v1.request import RequestStatus

        p = _params(request)
        if not p or not p.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None
        if not block_ids or not any(len(b) for b in block_ids):
            return False, None
        ranks = self._rank_templates()
        t = ranks[0]
        ngroups = 1 + len(t.get("groups", []))
        if len(block_ids) != ngroups:
            raise ValueError(f"kvxfer: blocks of {len(block_ids)} KV cache groups for caches of {ngroups}")
        tokens = len(request.prompt_token_ids or [])
        sizes = [t["block_size"]] + [g["block_size"] for g in t.get("groups", [])]
        # Only the prompt's blocks hold KV (a sampled token may have opened one more).
        per_group = [_group_blocks(b, bs, tokens) for b, bs in zip(block_ids, sizes)]
        # A state group's request state is its last block (vLLM's "none" and "align" modes).
        per_group = [_last_held(b) if i in self._state_groups else b for i, b in enumerate(per_group)]
        blocks = per_group[0]
        grant = os.urandom(16)
        handoff = {
            "v": 1,
            "request": request.request_id,
            "producer": t["producer"],
            "side_channel": t["side_channel"],
            "blocks": blocks,
            "tokens": tokens,
            "compat": t["compat"],
            "kv_heads": t["kv_heads"],
            "num_blocks": t["num_blocks"],
            "layers": t["layers"],
            "mode": "pull",
            # The request's capability: the prefill ranks answer only lease calls with it.
            "grant": grant.hex(),
            # Tensor parallelism: every prefill rank, and the shape they share.
            "tp": len(ranks),
            "ranks": [
                {k: r[k] for k in RANK_KEYS if k in r}
                for r in ranks
            ],
            "shape": {k: t.get(k) for k in ("tp", "kv_heads_total", "kv_heads", "head_size", "dtype_bytes", "block_size", "hnd", "mla")}
            | {"layers": t["layers"], "tp": len(ranks)}
            | ({"groups": [{k: g[k] for k in GROUP_SHAPE_KEYS} for g in t["groups"]]} if t.get("groups") else {}),
        }
        if ngroups > 1:
            handoff["v"] = 2
            handoff["group_blocks"] = per_group[1:]
        if len(self._stages) > 1:
            # Pipeline parallelism: every stage's ranks and shape (stage 0's are also above).
            handoff["stages"] = [
                {
                    "ranks": [{k: r[k] for k in RANK_KEYS if k in r} for r in stage],
                    "shape": {k: stage[0].get(k) for k in ("tp", "kv_heads_total", "kv_heads", "head_size", "dtype_bytes", "block_size", "hnd", "mla")}
                    | {"layers": stage[0]["layers"], "tp": len(stage)},
                }
                for stage in self._stages
            ]
        self._pending_publishes[request.request_id] = (per_group, tokens, grant)
        text = json.dumps(handoff)
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "kvxfer_handoff": text,
        }
        if self._secret:
            # The client passes the handoff on: the decode side acts on it only if this
            # seal over its exact text verifies.
            params["kvxfer_seal"] = kx.seal_bytes(self._secret, text.encode()).hex()
        return True, params

    def get_loaded_kv_cache_group_ids(self, request: "Request") -> tuple[int, ...]:
        """Every KV cache group: a load moves the request's own blocks of each (a sliding
        window's too), not only the prefix-cacheable ones."""
        cfg = getattr(self, "_kv_cache_config", None)
        return tuple(range(len(cfg.kv_cache_groups))) if cfg is not None else (0,)

    def _rank_templates(self) -> list[dict[str, Any]]:
        """Every prefill rank's template, by rank: from vLLM's handshake metadata, else (with
        an explicit "rundir") from the workers' files."""
        if not self._templates and self.template_path is not None:
            d = os.path.dirname(self.template_path)
            for r in range(self.tp_size):
                with open(os.path.join(d, f"{self.engine_id}-tp{r}.json")) as f:
                    self._templates[r] = json.load(f)
        if not self._templates:
            raise RuntimeError(
                "kvxfer: no handshake metadata from the workers yet (vLLM passes it with "
                "set_xfer_handshake_metadata once they registered their caches)"
            )
        ranks = sorted(self._templates)
        if ranks != list(range(len(ranks))):
            raise RuntimeError(f"kvxfer: handshake metadata from ranks {ranks}, not 0..{len(ranks) - 1}")
        return [self._templates[r] for r in ranks]

    def _worker_template(self) -> dict[str, Any]:
        return self._rank_templates()[0]

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]) -> None:
        """Scheduler side: the workers' templates by (pipeline stage, TP rank). Every stage
        publishes its layers of a request; the handoff lists each stage's ranks, and decode
        stage q loads from prefill stage q (the two sides must split the layers alike)."""
        stages: dict[int, dict[int, KVConnectorHandshakeMetadata]] = {}
        for (pp, tp), m in metadata.items():
            stages.setdefault(pp, {})[tp] = m
        if sorted(stages) != list(range(len(stages))):
            raise ValueError(f"kvxfer: handshake metadata from pipeline stages {sorted(stages)}, not 0..{len(stages) - 1}")
        self.set_xfer_handshake_metadata(stages[0])
        self._stages = []
        for pp in sorted(stages):
            tps = {r: m.template for r, m in stages[pp].items() if isinstance(m, KvxferHandshakeMetadata)}
            if sorted(tps) != list(range(len(tps))) or len(tps) != len(stages[0]):
                raise ValueError(f"kvxfer: pipeline stage {pp} has TP ranks {sorted(tps)}, stage 0 {sorted(stages[0])}")
            self._stages.append([tps[r] for r in sorted(tps)])

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """Scheduler side: the workers' templates, by TP rank (from vLLM's handshake)."""
        templates = {r: m.template for r, m in metadata.items() if isinstance(m, KvxferHandshakeMetadata)}
        if templates:
            first = templates[min(templates)]
            for r, t in templates.items():
                if _shape(t) != _shape(first) or t["compat"] != first["compat"]:
                    raise ValueError(f"kvxfer: worker ranks disagree: rank {min(templates)}: {_shape(first)}; rank {r}: {_shape(t)}")
            self._template = first
            self._templates = templates

    # ------------------------------------------------------------------ worker side

    def _group_names(self, kv_caches: dict[str, torch.Tensor]) -> list[list[str]]:
        """The layers of each KV cache group, in vLLM's group order (one group when vLLM
        gave no config or one group)."""
        cfg = getattr(self, "_kv_cache_config", None)
        specs = cfg.kv_cache_groups if cfg is not None else []
        groups = [list(g.layer_names) for g in specs]
        if len(groups) <= 1:
            return [list(kv_caches)]
        missing = sorted(n for g in groups for n in g if n not in kv_caches)
        if missing:
            raise ValueError(f"kvxfer: KV cache groups name layers without caches: {missing[:4]}")
        return groups

    @staticmethod
    def _cache_shape(first: torch.Tensor, mla: bool = False, state: bool = False, page: int | None = None) -> dict[str, Any]:
        """The shape of one group's per-layer views: attention ``[blocks, heads, block_size,
        2*head_size]`` (K and V in the last dimension, NHD or HND strides), MLA ``[blocks,
        block_size, latent]`` (no head dimension, no V; the same latent on every TP rank), or
        recurrent state: a list of state tensors ``[blocks, ...]`` (conv, SSM) over one page a
        block, back to back from the page's start (vLLM's MambaSpec views)."""
        if isinstance(first, (list, tuple)):
            return KvxferConnector._state_shape(list(first))
        if state and isinstance(first, torch.Tensor) and KvxferConnector._is_raw_page(first):
            return KvxferConnector._raw_state_shape(first)
        if not isinstance(first, torch.Tensor):
            raise ValueError(
                f"kvxfer: a layer's cache is a {type(first).__name__}, not a tensor or a list of "
                "state tensors"
            )
        if first.dim() == 4 and mla and first.shape[1] == 1:
            # vLLM's own MLA views are 4D [blocks, 1, block_size, latent] (create_kv_cache_views):
            # the KV cache spec, not the rank of the tensor, says the last dimension is a latent.
            nb, _, bs, c = first.shape
            shape = dict(heads=1, packing=kx.KVX_PACKING_LATENT, hnd=False, head_size=c)
            inner = _strides_are(first, 2, (c, 1))
        elif first.dim() == 3:
            nb, bs, c = first.shape
            shape = dict(heads=1, packing=kx.KVX_PACKING_LATENT, hnd=False, head_size=c)
            inner = _strides_are(first, 1, (c, 1))
        elif first.dim() == 4:
            nb, heads, bs, c = first.shape
            if c % 2:
                raise ValueError(f"kvxfer: last dimension {c} is not 2*head_size")
            hnd = first.stride()[1] > first.stride()[2]
            shape = dict(heads=heads, packing=kx.KVX_PACKING_FUSED, hnd=hnd, head_size=c // 2)
            inner = _strides_are(first, 1, (bs * c, c, 1) if hnd else (c, heads * c, 1))
        else:
            raise ValueError(
                "kvxfer: expected [blocks, heads, block_size, 2*head_size] attention views or "
                f"[blocks, block_size, latent] MLA views, got {tuple(first.shape)}"
            )
        # A block's elements lie together; the block may be followed by padding (vLLM pads a
        # hybrid model's attention page up to its state page: page_size_padded), which the
        # library knows per head, the way it stays when the TP size changes. Only the spec's
        # own padded page: a stride of several layers' pages (a block-outermost layout) is not
        # padding, and a layer's region would run past its tensor.
        es = first.element_size()
        pad = (first.stride()[0] - shape["heads"] * bs * c) * es
        padded_page = pad > 0 and page is not None and first.stride()[0] * es == page
        if not inner or pad < 0 or pad % shape["heads"] or (pad and not padded_page):
            raise ValueError(
                "kvxfer: KV cache blocks are not contiguous per layer; use a layer-compact "
                f"layout (VLLM_KV_CACHE_LAYOUT=LBNHC or LBHNC); strides {first.stride()} for "
                f"{tuple(first.shape)}"
            )
        return shape | dict(nb=nb, bs=bs, es=es, block_bytes=first.stride()[0] * es, pad_per_head=pad // shape["heads"])

    @staticmethod
    def _is_raw_page(t: torch.Tensor) -> bool:
        """Bytes ``[blocks, 1, ..., 1, n]``: a state page as raw memory, never an attention
        view (whose heads and tokens are not all 1, and whose dtype is the KV's)."""
        return t.dtype in (torch.int8, torch.uint8) and t.dim() >= 2 and all(x == 1 for x in t.shape[1:-1])

    @staticmethod
    def _raw_state_shape(t: torch.Tensor) -> dict[str, Any]:
        """A recurrent-state layer's cache as vLLM's CPU runner hands it to a connector: one
        byte tensor ``[blocks, 1, 1, state bytes]`` a page apart (the page padded to the
        attention page), the state tensors back to back from each page's start."""
        nb, page = t.shape[0], t.stride()[0] * t.element_size()
        # Its other dimensions are 1 (_is_raw_page): the bytes of a page are the last one's.
        if not _strides_are(t, t.dim() - 1, (1,)) or t.shape[-1] * t.element_size() > page:
            raise ValueError(f"kvxfer: a recurrent-state layer's cache {tuple(t.shape)} (strides {t.stride()}) is not one page a block")
        return dict(heads=1, packing=kx.KVX_PACKING_STATE, hnd=False, head_size=page, nb=nb, bs=1, es=1, block_bytes=page, state=True)

    @staticmethod
    def _state_shape(tensors: list[Any]) -> dict[str, Any]:
        """A recurrent-state layer's tensors as one page a block: registered from the first
        tensor's start, moved whole (one split unit a rank: between TP sizes such a page is
        refused, not split)."""
        if not tensors or not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in tensors):
            raise ValueError("kvxfer: a recurrent-state layer's cache is not a list of [blocks, ...] tensors")
        first = tensors[0]
        nb, page = first.shape[0], first.stride()[0] * first.element_size()
        for t in tensors:
            off = t.data_ptr() - first.data_ptr()
            if t.shape[0] != nb or t.stride()[0] * t.element_size() != page:
                raise ValueError(f"kvxfer: state tensors of another block count or page: {tuple(t.shape)}")
            if not 0 <= off or off + t[0].numel() * t.element_size() > page or not t[0].is_contiguous():
                raise ValueError("kvxfer: a state tensor lies outside its page, or is not contiguous in it")
        return dict(heads=1, packing=kx.KVX_PACKING_STATE, hnd=False, head_size=page, nb=nb, bs=1, es=1, block_bytes=page, state=True)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        names = list(kv_caches)
        if not names:
            raise ValueError("kvxfer: no KV caches to register")
        group_names = self._group_names(kv_caches)
        # What was registered, by group (read by tests that compare the bytes of blocks).
        self._kv_caches, self._group_layers = kv_caches, group_names
        cfg = getattr(self, "_kv_cache_config", None)
        specs = [cfg.kv_cache_groups[g].kv_cache_spec if cfg is not None and g < len(cfg.kv_cache_groups) else None for g in range(len(group_names))]
        shapes = [
            self._cache_shape(
                kv_caches[g[0]],
                mla="MLA" in type(spec).__name__,
                state=i in self._state_groups,
                page=getattr(spec, "page_size_bytes", None),
            )
            for i, (g, spec) in enumerate(zip(group_names, specs))
        ]
        for g, sh in enumerate(shapes):
            if sh.get("state") and cfg is not None and g < len(cfg.kv_cache_groups):
                # The page's parts, where the model's kind says how TP splits them.
                sh.update(_state_split(cfg.kv_cache_groups[g].kv_cache_spec, sh["head_size"], self.tp_size))
            if bool(sh.get("state")) != (g in self._state_groups):
                # What vLLM's spec says a group holds and what its caches are must agree: state
                # pages are never moved as attention blocks, nor the reverse.
                kind = "recurrent state (MambaSpec)" if g in self._state_groups else "attention"
                c0 = kv_caches[group_names[g][0]]
                got = [tuple(t.shape) for t in c0] if isinstance(c0, (list, tuple)) else (tuple(c0.shape), c0.stride(), c0.dtype)
                raise ValueError(
                    f"kvxfer: KV cache group {g} holds {kind}, but its caches are "
                    f"{'state tensors' if sh.get('state') else 'attention views'} ({group_names[g][0]}: {got})"
                )
        if any(sh["packing"] == kx.KVX_PACKING_LATENT for sh in shapes):
            # One latent per token whatever the config's num_key_value_heads says, held whole
            # by every rank: the TP plan then reads it once per decode rank, from one prefill
            # rank (spread over them), and only acknowledges the other prefill ranks.
            self.kv_heads_total = 1
        first = kv_caches[group_names[0][0]]
        first = first[0] if isinstance(first, (list, tuple)) else first
        ex = self.extra
        name = f"kvxfer-{self.engine_id}-{self._where}"
        budget = int(ex.get("budget_mib", 0)) << 20
        staging = None
        if "staging_chunks" in ex or "staging_chunk_kib" in ex:
            staging = (int(ex.get("staging_chunks", 8)), int(ex.get("staging_chunk_kib", 4096)) << 10)
        self.agent = kx.Agent(
            name,
            ex.get("transport", "auto"),
            ex.get("net_devices"),
            budget,
            secret=str(ex["secret"]).encode() if ex.get("secret") else None,
            lane_encryption=bool(ex.get("lane_encryption", False)),
            ucx_tcp=bool(ex.get("ucx_tcp", False)),
            strict=bool(ex.get("strict", False)),
            gpu_path=gpu_path_for(self._tc.kv_buffer_device, ex),
            staging=staging,
            compression=ex.get("compression"),
            handshake_timeout_ms=ex.get("handshake_timeout_ms"),
        )
        side = self.agent.listen(f"{_advertised_host(ex)}:{int(ex.get('port', 0))}")
        device = first.device
        cuda = device.index if device.type == "cuda" else -1
        # With a secret the caches open only through grants unless the deployment says its
        # same-host workers trust each other (lane_only_cache false).
        lane_only = bool(ex.get("lane_only_cache", bool(ex.get("secret"))))
        self.lane_only_cache = lane_only
        # vLLM's hybrid allocator lays layers of different groups over one tensor: each
        # piece of memory is registered once.
        regions: dict[int, tuple[int, int]] = {}
        groups = []
        for g, (gnames, sh) in enumerate(zip(group_names, shapes)):
            def lead(x: Any) -> torch.Tensor:
                # A state layer's page starts at its first tensor's block 0.
                return x[0] if isinstance(x, (list, tuple)) else x

            gfirst = lead(kv_caches[gnames[0]])
            bases, tensors = [], []
            for n in gnames:
                t = lead(kv_caches[n])
                if sh.get("state"):
                    self._cache_shape(kv_caches[n], state=True)
                es = t.element_size() if not sh.get("state") else sh["es"]  # a page: bytes
                if t.shape != gfirst.shape or t.stride() != gfirst.stride() or es != sh["es"]:
                    raise ValueError(f"kvxfer: layer {n} has another shape or layout than its group's first")
                length = sh["nb"] * sh["block_bytes"]
                rid, have = regions.get(t.data_ptr(), (None, 0))
                if rid is None:
                    rid = self.agent.register(t.data_ptr(), length, cuda, lane_only=lane_only)
                    regions[t.data_ptr()] = (rid, length)
                elif have < length:
                    raise ValueError(f"kvxfer: layer {n} overlaps another group's tensor of another size")
                bases.append((rid, 0, None, 0))
                tensors.append((t.data_ptr(), length))
            layout, lbases = kx.layout_struct(
                len(gnames), sh["heads"], sh["head_size"], sh["es"], sh["bs"], sh["nb"], sh["packing"], sh["hnd"], bases, sh.get("parts"),
                sh.get("pad_per_head", 0),
            )
            compat = self.agent.lib.L.kvx_layout_compat_hash(layout, lbases)
            groups.append((layout, lbases, tensors, bases, compat))
        self.num_layers = sum(len(g) for g in group_names)
        self.num_groups = len(groups)
        cfg = kx.config_struct(lease_ms=int(ex.get("lease_ms", 0)), budget_bytes=budget)
        # Through the connector traits (kvx_connector): the tensors lie in the regions just
        # registered, which the agent's connector uses as they are.
        conn = kx.Connector.over_agent(self.agent, side)
        try:
            made = [(g[0], g[2]) for g in groups]
            if self.kv_role in ("kv_producer", "kv_both"):
                self.producer = conn.producer_groups(made, cfg, cuda)
            if self.kv_role in ("kv_consumer", "kv_both"):
                self.consumer = conn.consumer_groups(made, cfg, cuda)
        finally:
            conn.close()
        # Discovery through etcd: this worker published under its name, every other worker of
        # the namespace loaded before any handoff names it (no side-channel handshake then).
        disc = str(ex.get("discovery") or "")
        if disc:
            # etcds://host:2379?ca=PATH (or etcd_ca): TLS, etcd's certificate signed by that CA.
            scheme = "https://" if disc.startswith("etcds://") or ex.get("etcd_ca") else "http://"
            endpoints = ",".join(scheme + e.split("://", 1)[-1] for e in disc.split(","))
            if ex.get("etcd_ca"):
                endpoints += f"?ca={ex['etcd_ca']}"
            user = ex.get("etcd_user")
            if user:
                # etcd's own authentication (also accepted as etcd://user:password@host).
                endpoints = endpoints.replace("http://", f"http://{user}:{ex.get('etcd_password', '')}@", 1)
            self.discovery = kx.Discovery(endpoints, str(ex.get("namespace", "/kvxfer")), int(ex.get("discovery_ttl_ms", 0)))
            self.discovery.publish(self.agent)
            self.discovery.watch(self.agent)
        sh0 = shapes[0]
        tmpl = {
            "producer": name,
            "side_channel": side,
            "compat": f"{groups[0][4]:016x}",
            "kv_heads": sh0["heads"],
            "num_blocks": sh0["nb"],
            "layers": [[b[0], b[1]] for b in groups[0][3]],
            "hnd": sh0["hnd"],
            "tp": self.tp_size,
            "kv_heads_total": self.kv_heads_total,
            "head_size": sh0["head_size"],
            "dtype_bytes": sh0["es"],
            "block_size": sh0["bs"],
            "mla": sh0["packing"] == kx.KVX_PACKING_LATENT,
            "state": bool(sh0.get("state")),
        }
        if len(groups) > 1:
            # The other KV cache groups (hybrid allocator): each its layout and shape.
            tmpl["groups"] = [
                {
                    "compat": f"{g[4]:016x}",
                    "kv_heads": sh["heads"],
                    "num_blocks": sh["nb"],
                    "layers": [[b[0], b[1]] for b in g[3]],
                    "head_size": sh["head_size"],
                    "block_size": sh["bs"],
                    "hnd": sh["hnd"],
                    "mla": sh["packing"] == kx.KVX_PACKING_LATENT,
                    "state": bool(sh.get("state")),
                }
                for g, sh in zip(groups[1:], shapes[1:])
            ]
        self._shape = tmpl
        self._handshake = KvxferHandshakeMetadata(tmpl)
        if self.template_path is not None:
            tmp = self.template_path + f".{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(tmpl, f)
            os.replace(tmp, self.template_path)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        """Worker side: what vLLM hands to the scheduler (set_xfer_handshake_metadata)."""
        return self._handshake

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvxferConnectorMetadata)
        for req, (blocks, tokens, grant) in meta.publishes.items():
            if self.producer is None:
                raise RuntimeError("kvxfer: a publish reached a worker without the producer role")
            self.producer.publish_groups(f"{req}#{self._where}", blocks, tokens, self.num_layers, grant=grant)
        for req, (handoff, local_groups, report, seal) in meta.loads.items():
            # Every group's blocks, for what a failure leaves invalid.
            local = [b for g in local_groups for b in g if b != kx.KVX_NO_BLOCK]
            if self.consumer is None:
                raise RuntimeError("kvxfer: a load reached a worker without the consumer role")
            with self._lock:
                if not report:
                    self._silent.add(req)
            try:
                # With a secret, no field of a handoff is acted on (no address dialled, no
                # block read) unless the prefill scheduler's seal over its text verifies.
                self._check_seal(handoff, seal)
                parts = self._plan_load(_checked_handoff(json.loads(handoff)), bool(local))
            except Exception as e:  # noqa: BLE001 - a client's input: whatever fails, fails this request alone
                logger.error("kvxfer: cannot load %s: %s: %s", req, type(e).__name__, e)
                self._fail_whole(req, local)
                continue
            with self._lock:
                # A handoff already being loaded for another request (a client sent it twice):
                # this request fails alone; the other keeps its load and its report.
                busy = sorted(h["request"] for h, _ in parts if h["request"] in self._by_handoff)
                if not busy:
                    self._parts[req] = ({p[0]["request"] for p in parts}, list(local), False)
                    for h, _ in parts:
                        self._by_handoff[h["request"]] = req
            if busy:
                logger.error("kvxfer: cannot load %s: its handoff %s is being loaded for another request", req, busy)
                self._fail_whole(req, local)
                continue
            for h, read in parts:
                try:
                    part = json.dumps(h).encode()
                    if self._secret:
                        # Built from a handoff whose seal verified: sealed for libkvxfer,
                        # which loads only sealed handoffs when a secret is set.
                        part = kx.seal_handoff(self._secret, part)
                    moved = local_groups if read.moves and local else [[] for _ in range(self.num_groups)]
                    self.consumer.start_load_groups(part, moved, read)
                except Exception as e:  # noqa: BLE001 - this part fails, the others go on
                    logger.error("kvxfer: load of %s from %r failed to start: %s", req, h.get("producer"), e)
                    with self._lock:
                        self._part_done(h["request"], failed=True)

    def _check_seal(self, handoff: bytes, seal: str | None) -> None:
        """Raises ValueError unless, with a secret, `seal` is the prefill scheduler's seal of
        `handoff`; without a secret every handoff is believed (a trusted network only)."""
        if not self._secret:
            return
        if not seal:
            raise ValueError("the handoff carries no kvxfer_seal (a secret is set: only sealed handoffs load)")
        # A client's value: its type and size are checked before anything is decoded.
        if not isinstance(seal, str) or len(seal) != 64:
            raise ValueError("the handoff's kvxfer_seal is not 32 bytes of hex")
        try:
            kx.verify_bytes(self._secret, handoff, bytes.fromhex(seal))
        except (kx.KvxferError, ValueError, TypeError) as e:
            raise ValueError(f"the handoff's seal does not verify (edited, or sealed under another secret): {e}") from e

    def _plan_load(self, h: dict[str, Any], moves: bool) -> list[tuple[dict[str, Any], "kx.TpRead"]]:
        """The loads this rank makes for handoff `h`: one per prefill rank its TP plan names,
        each a libkvxfer handoff of that rank's published request."""
        stages = h.get("stages")
        if stages is not None or self.pp_size > 1:
            n = len(stages) if isinstance(stages, list) else 1
            if n != self.pp_size:
                raise ValueError(
                    f"prefill PP {n}, decode PP {self.pp_size}: the two sides' pipeline stages must "
                    "split the layers alike (stage q loads from stage q)"
                )
            if stages is not None:
                stage = stages[self.pp_rank]
                if not isinstance(stage, dict) or not isinstance(stage.get("ranks"), list) or not isinstance(stage.get("shape"), dict):
                    raise ValueError(f"the handoff's stage {self.pp_rank} is not an object of ranks and shape")
                h = dict(h, ranks=stage["ranks"], shape=stage["shape"], tp=len(stage["ranks"]))
        ranks = h.get("ranks") or [{k: h[k] for k in RANK_KEYS if k in h}]
        theirs = h.get("shape") or {}
        mine = self._shape or {}
        if theirs:
            # Block sizes may differ: libkvxfer maps one onto the other where the layout lets
            # it (NHD), and refuses naming both where not.
            same_tp = (theirs.get("tp") or 1) == self.tp_size
            # Group 0 may be a state group (vLLM puts a Qwen3-Next's GDN layers first): its page
            # shrinks with the TP size, and the library checks it against the plan.
            page_varies = bool(mine.get("state")) and not same_tp
            for k in ("head_size", "dtype_bytes", "hnd", "mla"):
                if k == "head_size" and page_varies:
                    continue
                if k in theirs and theirs[k] != mine.get(k):
                    raise ValueError(f"the two sides' caches differ in {k}: prefill {_shape(theirs)}; decode {_shape(mine)}")
            tg, mg = theirs.get("groups") or [], mine.get("groups") or []
            if len(tg) != len(mg):
                raise ValueError(f"the two sides have {1 + len(tg)} and {1 + len(mg)} KV cache groups: prefill {_shape(theirs)}; decode {_shape(mine)}")
            for i, (a, b) in enumerate(zip(tg, mg), start=1):
                # Heads (or state units) per rank, and a state page's size, differ with the TP
                # size: then the library checks each group's against the plan.
                varies = ("kv_heads", "head_size") if isinstance(a, dict) and a.get("state") else ("kv_heads",)
                keys = [k for k in GROUP_SHAPE_KEYS if same_tp or k not in varies]
                diff = [k for k in keys if isinstance(a, dict) and k in a and a[k] != b.get(k)]
                if not isinstance(a, dict) or diff:
                    raise ValueError(f"the two sides' KV cache group {i} differs in {diff or 'its shape'}: prefill {a!r}; decode {b!r}")
            if len(theirs.get("layers", [])) != len(mine.get("layers", [])):
                raise ValueError(f"the two sides' caches differ in layers: prefill {_shape(theirs)}; decode {_shape(mine)}")
        ptp = int(h.get("tp", len(ranks)))
        pheads = int(theirs.get("kv_heads_total") or ranks[0]["kv_heads"] * ptp)
        try:
            plan = kx.tp_plan(ptp, pheads, self.tp_size, self.kv_heads_total, self.rank)
        except kx.KvxferError as e:
            raise ValueError(f"{e} (prefill {_shape(theirs) if theirs else f'TP {ptp}'}; decode {_shape(mine)})") from e
        out = []
        for read in plan:
            r = ranks[read.producer_rank]
            part = {k: h[k] for k in ("v", "blocks", "tokens", "mode")}
            if "grant" in h:
                part["grant"] = h["grant"]
            part.update({k: r[k] for k in RANK_KEYS if k in r})
            # The other KV cache groups: the blocks the handoff names with that rank's layouts.
            layouts = part.pop("groups", None) or []
            gb = h.get("group_blocks") or []
            if len(gb) != len(layouts):
                raise ValueError(f"the handoff names blocks of {1 + len(gb)} KV cache groups for prefill caches of {1 + len(layouts)}")
            if gb:
                part["v"] = 2
                part["groups"] = [
                    {"blocks": b, **{k: g[k] for k in ("compat", "kv_heads", "num_blocks", "layers")}}
                    for b, g in zip(gb, layouts)
                ]
            # The request as that prefill rank published it (tensor-parallel prefill ranks
            # publish under their rank; a handoff of the first release carries no "ranks").
            where = f"pp{self.pp_rank}tp{read.producer_rank}" if stages is not None else f"tp{read.producer_rank}"
            part["request"] = f"{h['request']}#{where}" if h.get("ranks") else h["request"]
            out.append((part, read))
        return out

    def _fail_whole(self, req: str, local: list[int]) -> None:
        with self._lock:
            self._load_errors.update(local)
            self._stats.data["failed"] += 1
            self._silent.discard(req)
            self._failed_now.add(req)

    def _part_done(self, handoff_req: str, failed: bool, stats: dict[str, Any] | None = None) -> str | None:
        """One load of a request ended; returns the local request when it was the last."""
        req = self._by_handoff.pop(handoff_req, None)
        if req is None or req not in self._parts:
            return None
        pending, local, any_failed = self._parts[req]
        pending.discard(handoff_req)
        any_failed = any_failed or failed
        if stats is not None:
            self._stats.data["bytes_moved"] += stats["bytes_moved"]
            self._stats.data["bytes_skipped"] += stats["bytes_skipped"]
            self._stats.data["handoff_s"] = self._stats.data["handoff_s"] + stats["handoff_ns"] / 1e9
        if failed:
            self._load_errors.update(local)
        if pending:
            self._parts[req] = (pending, local, any_failed)
            return None
        del self._parts[req]
        self._stats.data["failed" if any_failed else "loads"] += 1
        if any_failed:
            self._silent.discard(req)
            self._failed_now.add(req)
        return req

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads are asynchronous: vLLM schedules a request only after get_finished reported it.
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        # The prefill side publishes whole requests when they finish (request_finished).
        return

    def wait_for_save(self):
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving, failed = self._collect(finished_req_ids)
        recving |= failed
        return (sending or None), (recving or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """What vLLM 0.33's workers ask: sends done, loads done, and which of those loads
        failed (also among the received, as vLLM wants; their blocks are reported invalid
        too). A failed load here is always a whole request, so ``failed_recving`` and the
        invalid blocks agree under both of vLLM's load-failure policies."""
        sending, recving, failed = self._collect(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving | failed, failed_recving=failed
        )

    def _collect(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """Sends done; loads done; loads failed (each request reported once)."""
        sending: set[str] = set()
        recving: set[str] = set()
        failed: set[str] = set()
        with self._lock:
            self._finished_seen |= set(finished_req_ids)
            if self.producer is not None:
                while (f := self.producer.next_freed()) is not None:
                    name = f[0]
                    suffix = f"#{self._where}"
                    self._freed_unreported.add(name[: -len(suffix)] if name.endswith(suffix) else name)
                ready = self._freed_unreported & self._finished_seen
                sending |= ready
                self._freed_unreported -= ready
                self._finished_seen -= ready
            if self.consumer is not None:
                while (d := self.consumer.next_finished()) is not None:
                    req = self._part_done(d[0], failed=False, stats=d[1])
                    if req is None:
                        continue
                    if req in self._silent:
                        self._silent.discard(req)
                    else:
                        recving.add(req)
                while (fl := self.consumer.next_failed()) is not None:
                    logger.warning("kvxfer: load of %s failed (%d blocks invalid): %s", fl[0], len(fl[1]), fl[2])
                    self._part_done(fl[0], failed=True)
                failed = self._failed_now
                self._failed_now = set()
        if (sending or recving or failed) and self.extra.get("metrics_file"):
            self._write_metrics()
        return sending, recving - failed, failed

    def _write_metrics(self):
        path = self.extra["metrics_file"]
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(self.prometheus_text())
        os.replace(tmp, path)

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            e, self._load_errors = self._load_errors, set()
        return e

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        with self._lock:
            if self._stats.is_empty():
                return None
            s, self._stats = self._stats, KvxferConnectorStats()
        return s

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        """``LBHNC`` (vLLM's HND): each layer's blocks together, and inside a block each KV
        head's tokens together, so a decode rank of another TP size reads its heads of a block
        as one piece per layer (NHD would cut them per token). ``register_kv_caches`` takes
        either layer-compact layout; a backend that cannot give this one makes vLLM warn and
        choose another. MLA caches have no head dimension: no preference (``None``)."""
        mc = getattr(vllm_config, "model_config", None)
        if mc is None or getattr(mc, "use_mla", False):
            return None
        return "LBHNC"

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config) -> bool:
        """No: sleep mode frees the KV cache and maps new memory at wake-up, and kvxfer has no
        ``unregister_kv_caches``/``restore_kv_caches`` yet: it would keep the freed memory
        registered, and a peer could go on reading it. vLLM then refuses the combination at
        start ("does not support sleep mode") instead of serving wrong KV."""
        return False

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KvxferPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KvxferConnectorStats(data=dict(data)) if data else KvxferConnectorStats()

    def prometheus_text(self) -> str:
        """libkvxfer's telemetry in Prometheus text format (both roles)."""
        out = self.agent.metrics() if self.agent is not None else ""
        if self.producer is not None:
            out += self.producer.metrics()
        if self.consumer is not None:
            out += self.consumer.metrics()
        return out

    def shutdown(self):
        for x in (self.consumer, self.producer):
            if x is not None:
                x.close()
        self.consumer = self.producer = None
        if self.discovery is not None:
            self.discovery.close()
            self.discovery = None
        if self.agent is not None:
            self.agent.close()
            self.agent = None
