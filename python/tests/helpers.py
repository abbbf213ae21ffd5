"""Builds real vLLM 0.33 objects on CPU without weights or a tokenizer: a VllmConfig for a
tiny Qwen3 (hand-written config.json), a KVCacheConfig, the real Scheduler, and KV cache
tensors laid out by vLLM's own create_kv_cache_views."""

import json
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402

LAYERS = 2
KV_HEADS = 2
HEAD = 64
BLOCK = 16

QWEN3_TINY = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD,
    "num_hidden_layers": LAYERS,
    "vocab_size": 1000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def model_dir():
    d = os.path.join(tempfile.gettempdir(), f"kvxfer-tiny-qwen3-{os.getuid()}")
    os.makedirs(d, exist_ok=True)
    p = os.path.join(d, "config.json")
    if not os.path.exists(p):
        with open(p, "w") as f:
            json.dump(QWEN3_TINY, f)
    return d


def vllm_config(role="kv_both", extra=None, engine_id=None, prefix_caching=True, tp=1, load_failure_policy=None, block=BLOCK, mamba_align=False):
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    mc = ModelConfig(model=model_dir(), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=512)
    kt = KVTransferConfig(
        kv_connector="KvxferConnector",
        kv_connector_module_path="kvxfer_vllm",
        kv_role=role,
        kv_connector_extra_config=extra or {"transport": "tcp", "net_devices": "lo"},
        **({"engine_id": engine_id} if engine_id else {}),
        **({"kv_load_failure_policy": load_failure_policy} if load_failure_policy else {}),
    )
    vc = VllmConfig(
        model_config=mc,
        cache_config=CacheConfig(block_size=block, enable_prefix_caching=prefix_caching),
        device_config=DeviceConfig("cpu"),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=512, max_num_seqs=8, max_model_len=512, is_encoder_decoder=False
        ),
        kv_transfer_config=kt,
    )
    # Tensor parallelism as the workers of a TP deployment see it (the processes of the ranks
    # are the test's own: no torch.distributed here).
    vc.parallel_config.tensor_parallel_size = tp
    if mamba_align:
        # What vLLM sets for a hybrid model with prefix caching on (MambaModelConfig): the
        # state checkpointed at block boundaries, prefills chunked there.
        vc.cache_config.mamba_cache_mode = "align"
        vc.cache_config.mamba_block_size = block
    return vc


def layer_names():
    return [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def kv_cache_config(num_blocks=64, layout="LBNHC", kv_heads=KV_HEADS, block=BLOCK, dtype=None, head=HEAD):
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )

    spec = FullAttentionSpec(block_size=block, num_kv_heads=kv_heads, head_size=head, dtype=dtype or torch.bfloat16)
    page = spec.page_size_bytes
    names = layer_names()
    tensor = KVCacheTensor(
        size=page * num_blocks * LAYERS,
        layers=names,
        layer_stride=page * num_blocks,
        block_stride=page,
    )
    cfg = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )
    try:
        cfg.kv_cache_layout = layout
    except Exception:
        pass
    return cfg, spec, tensor


def kv_caches(num_blocks=64, layout="LBNHC", kv_heads=KV_HEADS, block=BLOCK, dtype=None, head=HEAD):
    """Per-layer views [B, H, N, 2*head] (bf16, or `dtype`) over one flat buffer, by vLLM's own
    code; `kv_heads`: a tensor-parallel rank's share; `block`: tokens a block."""
    from vllm.v1.kv_cache_interface import create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    cfg, spec, tensor = kv_cache_config(num_blocks, layout, kv_heads, block, dtype, head)
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    views = create_kv_cache_views(raw, spec, num_blocks, KVCacheLayout[layout], tensor)
    return raw, dict(zip(layer_names(), views)), cfg


SW_WINDOW = 32  # tokens: a sliding window of 2 blocks


def hma_layer_names():
    """A gpt-oss / Gemma-style model of 4 layers: full attention on the even ones, a sliding
    window on the odd ones."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    return names[0::2], names[1::2]


def hma_caches(num_blocks=64, layout="LBNHC"):
    """What vLLM's hybrid allocator makes for that model: two KV cache groups (full
    attention, sliding window) overlaid on one allocation (layer i of each group on the same
    bytes; a block belongs to one group at a time), the per-layer views by vLLM's own code,
    and the KVCacheConfig."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        SlidingWindowSpec,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    common = dict(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.bfloat16)
    specs = (FullAttentionSpec(**common), SlidingWindowSpec(**common, sliding_window=SW_WINDOW))
    page = specs[0].page_size_bytes
    full, window = hma_layer_names()
    size = page * num_blocks * len(full)
    tensors = [
        KVCacheTensor(size=size, layers=names, layer_stride=page * num_blocks, block_stride=page)
        for names in (full, window)
    ]
    cfg = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec(full, specs[0]), KVCacheGroupSpec(window, specs[1])],
    )
    try:
        cfg.kv_cache_layout = layout
    except Exception:
        pass
    raw = torch.zeros(size, dtype=torch.int8)
    views = {}
    for spec, t in zip(specs, tensors):
        views.update(zip(t.layers, create_kv_cache_views(raw, spec, num_blocks, KVCacheLayout[layout], t)))
    return raw, views, cfg


CONV_DIM, CONV_ROWS = 96, 3  # a Mamba2 conv state: x 32 (2 heads of 16), B 32, C 32
SSM = (2, 16, 32)  # SSM state: (heads, head_dim, d_state), float32


def hybrid_layer_names():
    """A Mamba2 hybrid of 4 layers (Jamba / Qwen3-Next style): attention on the even ones,
    recurrent state on the odd ones."""
    return ["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"], ["model.layers.1.mixer", "model.layers.3.mixer"]


def hybrid_caches(num_blocks=64, tp=1, attn_padded=False, raw_state=False, state_first=False, align=False):
    """What vLLM's hybrid allocator makes for that model: a full-attention group and a
    MambaSpec group (conv bf16 and SSM f32 state, padded to the attention page) overlaid on
    one allocation; the attention views by vLLM's create_kv_cache_views, the state views as
    vLLM's model runner makes them (each state tensor strided by the page, back to back from
    the page's start); and the KVCacheConfig. `tp`: a rank's share of a TP `tp` deployment
    (heads, conv channels and SSM heads divided; the conv state in vLLM's configured layout,
    SD (state_len, dim) by default). `attn_padded`: four times the SSM state size, so that the
    state page is the larger and vLLM pads the attention page up to it instead. `raw_state`: each
    state layer's cache as vLLM 0.32's CPU runner hands it to a connector, one byte tensor
    [blocks, 1, 1, state bytes] a page apart, instead of its list of state tensors. `state_first`:
    the state group is group 0 (vLLM's order for a Qwen3-Next, whose first layer is GDN).
    `align`: the state group in vLLM's "align" mode (prefix caching over the state)."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        MambaSpec,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    attn = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS // tp, head_size=HEAD, dtype=torch.bfloat16)
    page = attn.page_size_bytes
    conv = (CONV_DIM // tp, CONV_ROWS) if is_conv_state_dim_first() else (CONV_ROWS, CONV_DIM // tp)
    ssm = (SSM[0] // tp, SSM[1], SSM[2] * (4 if attn_padded else 1))
    mode = dict(mamba_cache_mode="align") if align else {}
    mamba = MambaSpec(block_size=BLOCK, shapes=(conv, ssm), dtypes=(torch.bfloat16, torch.float32), **mode)
    if attn_padded:
        assert mamba.page_size_bytes > page
        page = mamba.page_size_bytes
        attn = FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=KV_HEADS // tp, head_size=HEAD, dtype=torch.bfloat16, page_size_padded=page
        )
    else:
        mamba = MambaSpec(block_size=BLOCK, shapes=(conv, ssm), dtypes=(torch.bfloat16, torch.float32), page_size_padded=page, **mode)
    assert mamba.page_size_bytes == page == attn.page_size_bytes
    full, state = hybrid_layer_names()
    size = page * num_blocks * len(full)
    tensors = [KVCacheTensor(size=size, layers=names, layer_stride=page * num_blocks, block_stride=page) for names in (full, state)]
    cfg = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec(full, attn), KVCacheGroupSpec(state, mamba)][:: -1 if state_first else 1],
    )
    raw = torch.zeros(size, dtype=torch.int8)
    views = dict(zip(full, create_kv_cache_views(raw, attn, num_blocks, KVCacheLayout["LBNHC"], tensors[0])))
    for j, name in enumerate(state):
        base, parts = j * page * num_blocks, []
        if raw_state:
            n = mamba.state_content_size_bytes
            views[name] = torch.as_strided(raw, (num_blocks, 1, 1, n), (page, n, n, 1), base)
            continue
        for shape, dtype in zip(mamba.shapes, mamba.dtypes):
            es = torch.tensor([], dtype=dtype).element_size()
            flat = raw[base:].view(dtype)
            inner = torch.empty((num_blocks, *shape)).stride()[1:]
            parts.append(torch.as_strided(flat, (num_blocks, *shape), (page // es, *inner)))
            base += int(torch.tensor(shape).prod()) * es
        views[name] = parts
    return raw, views, cfg


MLA_LATENT = 96  # kv_lora_rank 64 + qk_rope_head_dim 32, as DeepSeek's 512 + 64 scaled down


def mla_caches(num_blocks=64):
    """An MLA model's per-layer caches as vLLM's MLA backends take them: [B, N, latent] (bf16,
    no head dimension, K and V one latent) over one flat buffer, layer after layer."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=MLA_LATENT, dtype=torch.bfloat16)
    page = spec.page_size_bytes
    assert page == BLOCK * MLA_LATENT * 2, page
    raw = torch.zeros(page * num_blocks * LAYERS, dtype=torch.int8)
    per = raw.view(torch.bfloat16).view(LAYERS, num_blocks, BLOCK, MLA_LATENT)
    return raw, dict(zip(layer_names(), per.unbind(0)))


def mla_vllm_caches(num_blocks=64):
    """An MLA model's caches as vLLM 0.33 makes them: an MLAAttentionSpec group, one 4D view
    [B, 1, N, latent] a layer by vLLM's create_kv_cache_views, and the KVCacheConfig."""
    from vllm.v1.kv_cache_interface import (
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        MLAAttentionSpec,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=MLA_LATENT, dtype=torch.bfloat16)
    page = spec.page_size_bytes
    names = layer_names()
    tensor = KVCacheTensor(size=page * num_blocks * LAYERS, layers=names, layer_stride=page * num_blocks, block_stride=page)
    cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[tensor], kv_cache_groups=[KVCacheGroupSpec(names, spec)])
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    views = create_kv_cache_views(raw, spec, num_blocks, KVCacheLayout["LBNHC"], tensor)
    return raw, dict(zip(names, views)), cfg


def scheduler(vllm_cfg, kv_cfg):
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    vllm_cfg.cache_config.num_gpu_blocks = kv_cfg.num_blocks
    return Scheduler(
        vllm_config=vllm_cfg,
        kv_cache_config=kv_cfg,
        structured_output_manager=StructuredOutputManager(vllm_cfg),
        block_size=vllm_cfg.cache_config.block_size,
        log_stats=True,
    )


def request(req_id, n_tokens, params=None, max_tokens=1, hash_block=None):
    """A request of `n_tokens` prompt tokens (3, 4, ...: prompts share prefixes); with
    `hash_block`, hashed in blocks of that many tokens as vLLM's engine core does, so that its
    full blocks enter the prefix cache."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=max_tokens)
    if params is not None:
        sp.extra_args = {"kv_transfer_params": params}
    kwargs = dict(request_id=req_id, prompt_token_ids=list(range(3, 3 + n_tokens)), sampling_params=sp, pooling_params=None)
    if hash_block is not None:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        fn = get_hash_fn_by_name("sha256")
        init_none_hash(fn)
        kwargs["block_hasher"] = get_request_block_hasher(hash_block, fn)
    try:
        r = Request(**kwargs)
    except TypeError:
        r = Request(**kwargs, eos_token_id=2)
    if params is not None:
        r.kv_transfer_params = params
    return r


def heads_of(tp, rank, kv_heads=KV_HEADS):
    """The model's KV heads a rank of a TP `tp` deployment holds, as vLLM splits them (one
    replicated head per rank when there are fewer heads than ranks)."""
    per = max(1, kv_heads // tp)
    rep = tp // kv_heads if tp > kv_heads else 1
    first = rank // rep * per
    return list(range(first, first + per))


def worker(vc, kv, rank):
    """A KvxferConnector worker of TP rank `rank` (what vLLM's parallel state would say)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    import kvxfer_vllm.connector as cm

    saved = cm._rank
    cm._rank = lambda: rank
    try:
        return cm.KvxferConnector(vc, KVConnectorRole.WORKER, kv)
    finally:
        cm._rank = saved


def prefill(sched, workers, req_id, n_tokens, hash_block=None):
    """A prefill engine's steps for request `req_id`: scheduled (in chunks where vLLM splits
    the prompt), its one token sampled once the prompt is computed, finished with a handoff;
    then the next step's metadata broadcast to every worker (rank), which publishes the
    blocks. Returns the handoff params and the prompt's blocks. `hash_block`: as `request`."""
    sched.add_request(request(req_id, n_tokens, {"do_remote_decode": True}, max_tokens=1, hash_block=hash_block))
    for _ in range(64):
        so = sched.schedule()
        r = sched.requests[req_id]
        # A chunk short of the prompt samples nothing (vLLM discards its token).
        done = r.num_computed_tokens >= r.num_prompt_tokens
        eco = sched.update_from_output(so, model_output(so, sampled=5 if done else None))
        outs = [o for v in eco.values() for o in v.outputs]
        if outs:
            params = outs[0].kv_transfer_params
            break
    else:
        raise AssertionError(f"{req_id}: no output in 64 steps")
    bs = sched.vllm_config.cache_config.block_size
    blocks = list(sched.kv_cache_manager.get_block_ids(req_id)[0])[: -(-n_tokens // bs)]
    so2 = sched.schedule()
    for w in workers:
        w.bind_connector_metadata(so2.kv_connector_metadata)
        w.start_load_kv(None)
        w.clear_connector_metadata()
    return params, blocks


def model_output(sched_out, sampled=None, kv=None):
    """What the model runner would return for a scheduled step: one sampled token per request
    (none with `sampled` None) and the connector's output."""
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(sched_out.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[sampled] if sampled is not None else [] for _ in ids],
        kv_connector_output=kv,
    )


def prefill_engine(extra, engine_id, seed, caches_of=None):
    """A one-rank prefill engine: its worker connector with registered caches filled from
    `seed`, the caches, and its scheduler holding the worker's handshake metadata.
    `caches_of`: what makes the caches (`kv_caches`, or `hma_caches`)."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvxfer_vllm import KvxferConnector

    vp = vllm_config(role="kv_producer", extra=dict(extra), engine_id=engine_id)
    raw, caches, kv = (caches_of or kv_caches)()
    raw.copy_(torch.randint(-128, 127, raw.shape, dtype=torch.int8, generator=torch.Generator().manual_seed(seed)))
    pre = KvxferConnector(vp, KVConnectorRole.WORKER, kv)
    pre.register_kv_caches(caches)
    sched = scheduler(vp, kv)
    sched.connector.set_xfer_handshake_metadata({0: pre.get_handshake_metadata()})
    return pre, caches, sched


def decode_worker(extra, engine_id, load_failure_policy=None, caches_of=None):
    """A one-rank decode engine's worker connector with registered (zeroed) caches: the
    connector, the caches, and the config and KV spec its scheduler is made from."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvxfer_vllm import KvxferConnector

    vd = vllm_config(role="kv_consumer", extra=dict(extra), engine_id=engine_id, load_failure_policy=load_failure_policy)
    _, dcaches, dkv = (caches_of or kv_caches)()
    dec = KvxferConnector(vd, KVConnectorRole.WORKER, dkv)
    dec.register_kv_caches(dcaches)
    return dec, dcaches, vd, dkv


def start_loads(worker_, sched_out):
    """A scheduled step's connector metadata given to `worker_`, which starts its loads."""
    worker_.bind_connector_metadata(sched_out.kv_connector_metadata)
    worker_.start_load_kv(None)
    worker_.clear_connector_metadata()


def sent(worker_, req, timeout=30):
    """Whether the prefill worker `worker_` reports `req` sent (its blocks freed) within
    `timeout` seconds."""
    import time

    end = time.time() + timeout
    while time.time() < end:
        got, _ = worker_.get_finished({req})
        if got and req in got:
            return True
        time.sleep(0.01)
    return False


def refused_load(params, req, tokens, words):
    """A one-rank decode engine (one KV cache group, TP 1, PP 1) given `params`: the plan of
    the load raises ValueError naming every one of `words`, the request ends received with all
    its blocks reported invalid, and nothing is written."""
    import json

    dec, dcaches, vd, dkv = decode_worker({"transport": "tcp", "net_devices": "lo"}, f"refuse-{req}-{os.getpid()}")
    sd = scheduler(vd, dkv)
    sd.add_request(request(req, tokens, dict(params), max_tokens=2))
    out = sd.schedule()
    local = out.kv_connector_metadata.loads[req][1][0]
    try:
        dec._plan_load(json.loads(params["kvxfer_handoff"]), True)
        raise AssertionError(f"{req}: the load was planned")
    except ValueError as e:
        assert all(w in str(e) for w in words), (words, str(e))
    start_loads(dec, out)
    assert req in received(dec, {req})
    assert dec.get_block_ids_with_load_errors() == set(local) and local
    assert torch.count_nonzero(torch.stack([t.view(torch.int16) for t in dcaches.values()])) == 0
    dec.shutdown()


def received(worker_, want, timeout=30):
    """The requests `worker_` reports received (get_finished) until `want` are all among them
    or `timeout` seconds pass."""
    import time

    got = set()
    end = time.time() + timeout
    while time.time() < end and not set(want) <= got:
        _, rv = worker_.get_finished(set())
        got |= rv or set()
        time.sleep(0.01)
    return got
