"""A prefill engine and a decode engine of different block sizes (16 and 32 tokens, both
ways) through the real vLLM 0.33 schedulers: the decode side's blocks take the prefill side's
tokens, token for token, by libkvxfer's descriptor mapping (NHD: a block of 2n tokens is two
blocks of n back to back). A second request sharing the first one's prompt hits the decode
side's prefix cache: only the rest moves, and the cached blocks are not written. In HND, where
one size does not map onto the other, the load fails naming both sizes and the request's
blocks are reported invalid."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import helpers as h  # noqa: E402

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvxfer_vllm import KvxferConnector  # noqa: E402

EXTRA = {"transport": "tcp", "net_devices": "lo"}


def _engine(role, block, layout, seed=None):
    vc = h.vllm_config(role=role, extra=dict(EXTRA), engine_id=f"bs-{role}-{block}-{os.getpid()}", block=block)
    raw, caches, kv = h.kv_caches(layout=layout, block=block)
    if seed is not None:
        raw.copy_(torch.randint(-128, 127, raw.shape, dtype=torch.int8, generator=torch.Generator().manual_seed(seed)))
    w = KvxferConnector(vc, KVConnectorRole.WORKER, kv)
    w.register_kv_caches(caches)
    s = h.scheduler(vc, kv)
    return w, caches, s


def _same_tokens(dst, local, d, src, remote, p, tokens):
    """Token t of the prompt: at t % p of prefill block remote[t // p], and at t % d of decode
    block local[t // d - first] (the decode side holds blocks before `first` already)."""
    first = -(-tokens // d) - len(local)
    for name in dst:
        for t in range(first * d, tokens):
            got = dst[name][local[t // d - first]][:, t % d].view(torch.int16)
            want = src[name][remote[t // p]][:, t % p].view(torch.int16)
            assert torch.equal(got, want), (name, t)


def _load(dec, sd, req, tokens, params):
    bs = sd.vllm_config.cache_config.block_size
    sd.add_request(h.request(req, tokens, dict(params), max_tokens=1, hash_block=bs))
    out = sd.schedule()
    local = out.kv_connector_metadata.loads[req][1][0]
    h.start_loads(dec, out)
    assert req in h.received(dec, {req})
    return out, local


@pytest.mark.parametrize("p,d", [(16, 32), (32, 16)], ids=["16-to-32", "32-to-16"])
def test_other_block_sizes_load_token_for_token_and_a_prefix_hit_stays(p, d):
    pre, caches, sp = _engine("kv_producer", p, "LBNHC", seed=5)
    sp.connector.set_xfer_handshake_metadata({0: pre.get_handshake_metadata()})
    dec, dcaches, sd = _engine("kv_consumer", d, "LBNHC")
    params, remote = h.prefill(sp, [pre], "bs-1", 70)
    out, local = _load(dec, sd, "bs-d1", 70, params)
    assert dec.get_block_ids_with_load_errors() == set()
    assert len(local) == -(-70 // d)
    _same_tokens(dcaches, local, d, caches, remote, p, 70)
    # The decode engine finishes the request: its full blocks go to its prefix cache.
    sd.update_from_output(out, h.model_output(out, kv=KVConnectorOutput(finished_recving={"bs-d1"})))
    out2 = sd.schedule()
    sd.update_from_output(out2, h.model_output(out2, sampled=7))
    snapshot = {n: t.clone() for n, t in dcaches.items()}
    # A longer prompt sharing the first 70 tokens: the decode side holds its first full
    # blocks (64 tokens) and loads only the rest.
    params2, remote2 = h.prefill(sp, [pre], "bs-2", 130)
    out3, local2 = _load(dec, sd, "bs-d2", 130, params2)
    assert dec.get_block_ids_with_load_errors() == set()
    cached = -(-130 // d) - len(local2)
    assert cached == 64 // d, (cached, local2)
    _same_tokens(dcaches, local2, d, caches, remote2, p, 130)
    # The cached blocks were not written by the second load.
    kept = [b for b in local if b not in local2][: cached]
    for name in dcaches:
        assert torch.equal(dcaches[name][kept].view(torch.int16), snapshot[name][kept].view(torch.int16)), name
    dec.shutdown()
    pre.shutdown()


def test_other_block_sizes_in_hnd_fail_naming_both():
    pre, _, sp = _engine("kv_producer", 16, "LBHNC", seed=6)
    sp.connector.set_xfer_handshake_metadata({0: pre.get_handshake_metadata()})
    dec, dcaches, sd = _engine("kv_consumer", 32, "LBHNC")
    params, _ = h.prefill(sp, [pre], "bs-h", 70)
    sd.add_request(h.request("bs-hd", 70, dict(params), max_tokens=1))
    out = sd.schedule()
    local = out.kv_connector_metadata.loads["bs-hd"][1][0]
    h.start_loads(dec, out)
    assert "bs-hd" in h.received(dec, {"bs-hd"})
    assert dec.get_block_ids_with_load_errors() == set(local) and local
    assert torch.count_nonzero(torch.stack([t.view(torch.int16) for t in dcaches.values()])) == 0
    dec.shutdown()
    pre.shutdown()
