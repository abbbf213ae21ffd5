"""A hybrid model's recurrent state (Mamba2 conv and SSM state, vLLM's MambaSpec group) beside
its attention, through the real vLLM 0.33 objects: the state group registers as one page a
block, the prefill side stops one prompt token short (its state is h(N-1), as vLLM's
NixlConnector does), the decode side loads N-1 tokens of attention and the request's state
page, and recomputes token N once. Bytes compared per layer: both state tensors and the
attention blocks; nothing else written. vLLM's CPU backend runs no Mamba2 model here, so this
is the plugin's path with the shapes vLLM gives it."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import helpers as h  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

import kvxfer_vllm.lib as kx  # noqa: E402

TOKENS = 100
EXTRA = {"transport": "tcp", "net_devices": "lo"}


def _bytes(t):
    return t.contiguous().view(torch.uint8)


def _engines(tag, attn_padded=False, raw_state=False, state_first=False, align=False):
    """A prefill engine and a decode engine of a hybrid model: without prefix caching, or
    (`align`) with it, the state group in vLLM's "align" mode as vLLM then sets it."""
    caches = lambda: h.hybrid_caches(attn_padded=attn_padded, raw_state=raw_state, state_first=state_first, align=align)  # noqa: E731
    import helpers

    saved = helpers.vllm_config

    def configured(*a, **k):
        # vLLM refuses prefix caching over Mamba state outside its "align" mode.
        return saved(*a, **dict(k, prefix_caching=align, mamba_align=align))

    helpers.vllm_config = configured
    try:
        pre, pcaches, s = h.prefill_engine(EXTRA, f"{tag}-pre-{os.getpid()}", 21, caches_of=caches)
        dec, dcaches, vd, dkv = h.decode_worker(EXTRA, f"{tag}-dec-{os.getpid()}", caches_of=caches)
        sd = h.scheduler(vd, dkv)
    finally:
        helpers.vllm_config = saved
    return pre, pcaches, s, dec, dcaches, sd


def _padding_of(view):
    """The bytes after each block's data in an attention view whose blocks are padded (vLLM's
    page_size_padded): [blocks, padding elements]."""
    data = view[0].numel()
    pad = view.stride(0) - data
    return torch.as_strided(view, (view.shape[0], pad), (view.stride(0), 1), view.storage_offset() + data)


def _parts(cache):
    """A state layer's tensors (one, for a raw page)."""
    return cache if isinstance(cache, (list, tuple)) else [cache]


# attn_padded: the state page is the larger, and vLLM pads each attention page up to it (vLLM's
# page_size_padded): blocks move without their padding. raw_state: state caches as vLLM 0.32's
# CPU runner gives them (one byte tensor a layer).
@pytest.mark.parametrize("attn_padded,raw_state", [(False, False), (True, False), (False, True)])
def test_state_pages_move_beside_attention_and_the_last_token_is_recomputed(attn_padded, raw_state):
    pre, pcaches, s, dec, dcaches, sd = _engines(f"hyb{int(attn_padded)}{int(raw_state)}", attn_padded, raw_state)
    assert pre._shape["groups"][0]["state"] is True and pre._shape["state"] is False
    params, _ = h.prefill(s, [pre], "hyb-1", TOKENS)
    hd = json.loads(params["kvxfer_handoff"])
    # The prefill stopped one token short: 99 tokens, 7 attention blocks, one state page.
    assert hd["tokens"] == TOKENS - 1, hd["tokens"]
    attn_remote, state_remote = hd["blocks"], hd["group_blocks"][0]
    assert len(attn_remote) == 7 and len(state_remote) == 1, hd

    r = h.request("hyb-dec", TOKENS, dict(params), max_tokens=4)
    sd.add_request(r)
    out = sd.schedule()
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    attn_local, state_local = out.kv_connector_metadata.loads["hyb-dec"][1]
    assert len(attn_local) == 7 and len(state_local) == 1, (attn_local, state_local)
    # The decode side computes token N itself: it loads N-1.
    assert sd.connector.get_num_new_matched_tokens(h.request("probe", TOKENS, dict(params)), 0) == (TOKENS - 1, True)
    h.start_loads(dec, out)
    assert "hyb-dec" in h.received(dec, {"hyb-dec"})
    assert dec.get_block_ids_with_load_errors() == set()
    full, state = h.hybrid_layer_names()
    for name in state:
        (lb,), (rb,) = state_local, state_remote
        for got, want in zip(_parts(dcaches[name]), _parts(pcaches[name])):
            # Bytes, not values (random bytes hold NaNs).
            assert torch.equal(_bytes(got[lb]), _bytes(want[rb])), (name, lb, rb)
        others = [b for b in range(64) if b != lb and b not in attn_local]
        for got in _parts(dcaches[name]):
            assert all(torch.count_nonzero(_bytes(got[b])) == 0 for b in others), name
    for name in full:
        for lb, rb in zip(attn_local, attn_remote):
            assert torch.equal(dcaches[name][lb].view(torch.int16), pcaches[name][rb].view(torch.int16)), (name, lb, rb)
        if attn_padded:
            # The prefill's padding holds its fill: a load that moved it would show.
            assert torch.count_nonzero(_bytes(_padding_of(pcaches[name]))) > 0, name
            # Groups share the memory (vLLM's hybrid allocator): the state page loaded into
            # block lb lies over that block's attention page and padding.
            (lb,) = state_local
            pads = _padding_of(dcaches[name])
            assert all(torch.count_nonzero(_bytes(pads[b])) == 0 for b in range(64) if b != lb), name
    page = 16 * h.KV_HEADS * 2 * h.HEAD * 2
    state_page = h.CONV_DIM * h.CONV_ROWS * 2 + 4 * h.SSM[0] * h.SSM[1] * h.SSM[2] * 4 if attn_padded else page
    want = len(attn_local) * len(full) * page + len(state) * state_page
    st = dec.get_kv_connector_stats().data
    assert st["bytes_moved"] == want, (st, want)
    assert h.sent(pre, "hyb-1")
    dec.shutdown()
    pre.shutdown()


# state_first: the state group is group 0, as vLLM orders a Qwen3-Next's (its page, group 0's
# shape, then differs with the TP size).
@pytest.mark.parametrize("attn_padded,state_first", [(False, False), (True, False), (False, True)])
def test_a_state_page_splits_by_channel_across_tp(attn_padded, state_first):
    """Prefill TP 1 to decode TP 2, rank 1: the plugin describes the page as vLLM's Mamba2
    state splits (conv x, B, C and the SSM heads, in units of the channels' gcd), and the rank
    reads attention head 1 and, in the same fraction, the second half of x, of B, of C and of
    the SSM heads, each into its own page; nothing else of the page."""
    pre, pcaches, s, _, _, _ = _engines(f"hybsplit{int(attn_padded)}{int(state_first)}", attn_padded, state_first=state_first)
    params, _ = h.prefill(s, [pre], "hybsplit-1", TOKENS)
    hd = json.loads(params["kvxfer_handoff"])
    vc = h.vllm_config(role="kv_consumer", extra=dict(EXTRA), engine_id=f"hybsplit-dec-{os.getpid()}", tp=2, prefix_caching=False)
    _, dcaches, dkv = h.hybrid_caches(tp=2, attn_padded=attn_padded, state_first=state_first)
    dec = h.worker(vc, dkv, 1)
    dec.register_kv_caches(dcaches)
    assert dec._shape["groups"][0]["kv_heads"] == 1 and pre._shape["groups"][0]["kv_heads"] == 2
    (part, read), = dec._plan_load(hd, True)
    assert (read.remote_heads_start, read.remote_heads_end, read.local_heads_start) == (1, 2, 0)
    if state_first:
        (state_remote,), attn_remote = hd["blocks"], hd["group_blocks"][0]
    else:
        attn_remote, (state_remote,) = hd["blocks"], hd["group_blocks"][0]
    attn_local, state_local = [3, 4, 5, 6, 7, 8, 9], 11
    local = [[state_local], attn_local] if state_first else [attn_local, [state_local]]
    dec.consumer.start_load_groups(json.dumps(part).encode(), local, read)
    dec.consumer.wait(part["request"], 20000)
    full, state = h.hybrid_layer_names()
    for name in full:
        for lb, rb in zip(attn_local, attn_remote):
            assert torch.equal(_bytes(dcaches[name][lb][0]), _bytes(pcaches[name][rb][1])), (name, lb)
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    x = h.CONV_DIM // 3  # x, B and C are equal here
    for name in state:
        (dconv, dssm), (pconv, pssm) = dcaches[name], pcaches[name]
        dc, pc = dconv[state_local], pconv[state_remote]
        if is_conv_state_dim_first():
            dc, pc = dc.t(), pc.t()
        # Rows of (state_len, dim): this rank's half of each sub-projection.
        for seg in range(3):
            mine, theirs = dc[:, seg * x // 2 : (seg + 1) * x // 2], pc[:, seg * x + x // 2 : (seg + 1) * x]
            assert torch.equal(_bytes(mine), _bytes(theirs)), (name, seg)
        half = pssm.shape[1] // 2
        assert torch.equal(_bytes(dssm[state_local][:half]), _bytes(pssm[state_remote][half:])), name
        others = [b for b in range(64) if b not in (state_local, *attn_local)]
        assert all(torch.count_nonzero(_bytes(t[b])) == 0 for t in dcaches[name] for b in others), name
    dec.shutdown()
    pre.shutdown()


def test_a_prefix_hit_of_attention_alone_loads_the_rest_and_the_lagging_state():
    """vLLM's setting for a hybrid model with prefix caching ("align": the state checkpointed
    at block boundaries, a prefill chunked there). The decode engine served a first request:
    its attention blocks are in its prefix cache, but no state checkpoint is (it loaded the
    state and computed token N alone). A second request sharing that prefix is a divergent hit:
    96 tokens of attention, none of state. kvxfer declares supports_divergent_local_hybrid_hits,
    so vLLM keeps the attention hit, and the load moves only the attention blocks after it and
    the request's state page (h(N-1)), which restores the lagging state. Bytes checked, the
    cached blocks not written, and the bytes moved counted."""
    from vllm.v1.outputs import KVConnectorOutput

    pre, pcaches, s, dec, dcaches, sd = _engines("hyal", align=True)
    assert sd.connector.supports_divergent_local_hybrid_hits
    full, state = h.hybrid_layer_names()

    def load(req, n):
        params, _ = h.prefill(s, [pre], req, n, hash_block=h.BLOCK)
        hd = json.loads(params["kvxfer_handoff"])
        r = h.request(req + "-d", n, dict(params), max_tokens=2, hash_block=h.BLOCK)
        sd.add_request(r)
        out = sd.schedule()
        assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        attn_local, state_local = out.kv_connector_metadata.loads[req + "-d"][1]
        dec.get_kv_connector_stats()  # what came before (each call takes what is new)
        h.start_loads(dec, out)
        assert req + "-d" in h.received(dec, {req + "-d"})
        assert dec.get_block_ids_with_load_errors() == set()
        moved = dec.get_kv_connector_stats().data["bytes_moved"]
        # The state page the prefill ended with, into the decode side's.
        (lb,), rb = state_local, hd["group_blocks"][0][-1]
        for name in state:
            for got, want in zip(dcaches[name], pcaches[name]):
                assert torch.equal(_bytes(got[lb]), _bytes(want[rb])), (req, name)
        # The attention blocks loaded: the prefill's last ones, paired from the end.
        attn_remote = hd["blocks"][len(hd["blocks"]) - len(attn_local):]
        for name in full:
            for a, b in zip(attn_local, attn_remote):
                assert torch.equal(_bytes(dcaches[name][a]), _bytes(pcaches[name][b])), (req, name, a)
        # The decode engine computes token N and finishes: its full blocks enter its cache.
        sd.update_from_output(out, h.model_output(out, kv=KVConnectorOutput(finished_recving={req + "-d"})))
        for _ in range(2):
            o = sd.schedule()
            sd.update_from_output(o, h.model_output(o, sampled=7))
        assert r.is_finished(), r.status
        return attn_local, moved

    page = 16 * h.KV_HEADS * 2 * h.HEAD * 2
    first, moved1 = load("hyal-1", 100)
    assert len(first) == 7 and moved1 == 7 * len(full) * page + len(state) * page, (first, moved1)
    snapshot = {(n, b): _bytes(dcaches[n][b]).clone() for n in full for b in first[:6]}
    # 150 tokens sharing the first 100: the decode side holds 6 full blocks of attention (96
    # tokens) and no state at 96; the prefill stops at 149. 53 tokens: 4 blocks, and the state.
    second, moved2 = load("hyal-2", 150)
    assert len(second) == 4, second
    assert moved2 == 4 * len(full) * page + len(state) * page, moved2
    # The 6 cached blocks (the first request's first 6) were not written.
    for name in full:
        for b in first[:6]:
            assert b not in second
            assert torch.equal(_bytes(dcaches[name][b]), snapshot[name, b]), (name, b)
    assert h.sent(pre, "hyal-2")
    dec.shutdown()
    pre.shutdown()
