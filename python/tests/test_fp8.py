"""FP8 KV caches as vLLM 0.33 lays them out with per-token-head scales (`fp8_per_token_head`):
each head's K and V content padded by one float32 scale, `[blocks, heads, block_size,
2*(head_size+4)]` of float8_e4m3fn, the scales read through strided float32 views of the pad
bytes (vLLM's TritonAttentionImpl._ensure_scale_caches). The caches register as 1-byte
elements and a load moves each block's values and its scales together: both compared, and the
scales of blocks that did not move stay untouched."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import helpers as h  # noqa: E402

import torch  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

TOKENS = 70
EXTRA = {"transport": "tcp", "net_devices": "lo"}
PAD = 4  # one float32 scale per head and token, in fp8 elements


def _fp8_caches():
    return h.kv_caches(dtype=torch.float8_e4m3fn, head=h.HEAD + PAD)


def _scales(view):
    """The per-token-head K and V scales of `view` [B, H, N, 2*(hs+pad)], as float32 bytes."""
    hs = view.shape[-1] // 2 - PAD
    u8 = view.view(torch.uint8)
    return torch.cat([u8[..., hs : hs + PAD], u8[..., 2 * hs + PAD :]], dim=-1)


def test_fp8_blocks_move_with_their_per_token_head_scales():
    pre, pcaches, s = h.prefill_engine(EXTRA, f"fp8-pre-{os.getpid()}", 31, caches_of=_fp8_caches)
    assert pre._shape["dtype_bytes"] == 1 and pre._shape["head_size"] == h.HEAD + PAD, pre._shape
    params, remote = h.prefill(s, [pre], "fp8-1", TOKENS)
    dec, dcaches, vd, dkv = h.decode_worker(EXTRA, f"fp8-dec-{os.getpid()}", caches_of=_fp8_caches)
    sd = h.scheduler(vd, dkv)
    r = h.request("fp8-dec", TOKENS, dict(params), max_tokens=2)
    sd.add_request(r)
    out = sd.schedule()
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (local,) = out.kv_connector_metadata.loads["fp8-dec"][1]
    h.start_loads(dec, out)
    assert "fp8-dec" in h.received(dec, {"fp8-dec"})
    for name in h.layer_names():
        d, p = dcaches[name].view(torch.uint8), pcaches[name].view(torch.uint8)
        for lb, rb in zip(local, remote[-len(local) :]):
            assert torch.equal(d[lb], p[rb]), (name, lb, rb)
            assert torch.equal(_scales(dcaches[name][lb]), _scales(pcaches[name][rb])), (name, lb)
            assert torch.count_nonzero(_scales(dcaches[name][lb])) > 0
        rest = [b for b in range(64) if b not in local]
        assert torch.count_nonzero(_scales(dcaches[name][rest])) == 0, name
    assert h.sent(pre, "fp8-1")
    dec.shutdown()
    pre.shutdown()
