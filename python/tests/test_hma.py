"""vLLM's hybrid KV cache manager (HMA) through the real vLLM 0.33 objects: a model with
full-attention and sliding-window layers in two KV cache groups overlaid on one allocation, as
vLLM lays them out. The connector declares SupportsHMA (so vLLM keeps HMA on), the prefill
scheduler hands every group's blocks to request_finished_all_groups, and the decode side loads
each group into its own blocks: the full group's whole prompt, the window's blocks only (the
ones outside it are vLLM's null block on the prefill side and not allocated on the decode
side). Bytes are compared per group and layer."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import helpers as h  # noqa: E402

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

import kvxfer_vllm.lib as kx  # noqa: E402
from kvxfer_vllm import KvxferConnector  # noqa: E402

TOKENS = 100  # 7 blocks of 16; a 32-token window keeps the last 3 of them on the prefill side
EXTRA = {"transport": "tcp", "net_devices": "lo"}


def test_the_connector_keeps_vllms_hybrid_allocator_on():
    assert issubclass(KvxferConnector, SupportsHMA)
    vc = h.vllm_config(role="kv_consumer")
    assert vc.scheduler_config.disable_hybrid_kv_cache_manager is False


def _handoff(engine, name):
    pre, caches, s = h.prefill_engine(EXTRA, f"{engine}-pre-{os.getpid()}", 11, caches_of=h.hma_caches)
    params, _ = h.prefill(s, [pre], name, TOKENS)
    return pre, caches, params


def test_each_group_moves_its_own_blocks_and_the_window_only_its_window():
    pre, caches, params = _handoff("hma", "hma-1")
    hd = json.loads(params["kvxfer_handoff"])
    full_remote, window_remote = hd["blocks"], hd["group_blocks"][0]
    assert len(full_remote) == len(window_remote) == 7, hd
    # The window's blocks before it are vLLM's null block on the prefill side: no block.
    held = [b for b in window_remote if b != kx.KVX_NO_BLOCK]
    assert 0 < len(held) < 7, window_remote

    dec, dcaches, vd, dkv = h.decode_worker(EXTRA, f"hma-dec-{os.getpid()}", caches_of=h.hma_caches)
    sd = h.scheduler(vd, dkv)
    r = h.request("hma-dec", TOKENS, dict(params), max_tokens=4)
    sd.add_request(r)
    out = sd.schedule()
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    full_local, window_local = out.kv_connector_metadata.loads["hma-dec"][1]
    assert len(full_local) == 7 and 0 < len(window_local) <= len(held), (full_local, window_local)
    h.start_loads(dec, out)
    assert "hma-dec" in h.received(dec, {"hma-dec"})
    assert dec.get_block_ids_with_load_errors() == set()
    full, window = h.hma_layer_names()
    # vLLM's views of group 0 and group 1 are the same bytes (overlaid): each group's
    # layers are compared on its own blocks.
    for names, local, remote in ((full, full_local, full_remote), (window, window_local, window_remote)):
        pairs = list(zip(local[::-1], remote[::-1]))
        for name in names:
            for lb, rb in pairs:
                assert rb != kx.KVX_NO_BLOCK, (name, lb)
                assert torch.equal(dcaches[name][lb].view(torch.int16), caches[name][rb].view(torch.int16)), (name, lb, rb)
    moved = {b for b in full_local} | set(window_local)
    untouched = [b for b in range(1, 64) if b not in moved]
    for name in full + window:
        assert torch.count_nonzero(dcaches[name][untouched].view(torch.int16)) == 0, name
    st = dec.get_kv_connector_stats().data
    block = h.BLOCK * h.KV_HEADS * 2 * h.HEAD * 2
    want = (len(full_local) + len(window_local)) * len(full) * block
    assert st["bytes_moved"] == want, (st, want)
    # The prefill side frees both groups' blocks on the acknowledgement.
    assert h.sent(pre, "hma-1")
    dec.shutdown()
    pre.shutdown()


def test_a_decode_side_of_one_group_refuses_a_handoff_of_two():
    """Caches of other group counts hold different models: refused before anything moves,
    naming both, and the request's blocks are reported invalid."""
    pre, _, params = _handoff("hma-mix", "hma-2")
    h.refused_load(params, "hma-mix-dec", TOKENS, ["2 and 1 KV cache groups"])
    pre.shutdown()


def test_a_state_group_of_attention_views_is_refused_by_name():
    """A Mamba/GDN group whose caches are attention views (not vLLM's list of state tensors):
    refused at registration naming the group and its kind, never moved as if it were attention
    KV."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec

    from kvxfer_vllm import KvxferConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    raw, views, cfg = h.hma_caches()
    full, window = h.hma_layer_names()
    state = MambaSpec(block_size=h.BLOCK, shapes=((4, 8), (2, 8, 8)), dtypes=(torch.bfloat16, torch.float32))
    mixed = KVCacheConfig(
        num_blocks=cfg.num_blocks,
        kv_cache_tensors=cfg.kv_cache_tensors,
        kv_cache_groups=[cfg.kv_cache_groups[0], KVCacheGroupSpec(window, state)],
    )
    w = KvxferConnector(h.vllm_config(role="kv_consumer"), KVConnectorRole.WORKER, mixed)
    try:
        w.register_kv_caches(views)
        raise AssertionError("a recurrent state group of attention views was registered")
    except ValueError as e:
        assert "KV cache group 1 holds recurrent state (MambaSpec)" in str(e) and "attention views" in str(e), str(e)
    finally:
        w.shutdown()
