"""Pipeline parallelism through the real vLLM 0.33 objects: a prefill deployment of PP 2 (each
stage a worker holding its half of the layers) hands a request to a decode deployment of PP 2.
The prefill scheduler takes the workers' handshake metadata by (stage, TP rank)
(set_xfer_handshake_metadata_pp_aware), the handoff lists every stage's ranks, each stage
publishes its layers, and decode stage q loads from prefill stage q; bytes are compared layer
by layer. Another PP size on the decode side is refused naming both."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import helpers as h  # noqa: E402

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

import kvxfer_vllm.connector as cm  # noqa: E402

EXTRA = {"transport": "tcp", "net_devices": "lo"}


def _stage_worker(vc, kv, stage, caches):
    saved = cm._pp_rank
    cm._pp_rank = lambda: stage
    try:
        w = cm.KvxferConnector(vc, KVConnectorRole.WORKER, kv)
    finally:
        cm._pp_rank = saved
    w.register_kv_caches(caches)
    return w


def _deployment(role, pp, engine, seed=None):
    """`pp` stages, stage s holding layer s of the model (LAYERS = pp here)."""
    vc = h.vllm_config(role=role, extra=dict(EXTRA), engine_id=engine)
    vc.parallel_config.pipeline_parallel_size = pp
    raw, caches, kv = h.kv_caches()
    if seed is not None:
        raw.copy_(torch.randint(-128, 127, raw.shape, dtype=torch.int8, generator=torch.Generator().manual_seed(seed)))
    names = list(caches)
    per = len(names) // pp
    workers = [_stage_worker(vc, kv, s, {n: caches[n] for n in names[s * per:(s + 1) * per]}) for s in range(pp)]
    return vc, kv, caches, workers


def test_stage_q_loads_from_stage_q():
    assert h.LAYERS == 2
    pvc, pkv, caches, pre = _deployment("kv_producer", 2, f"pp-pre-{os.getpid()}", seed=9)
    sp = h.scheduler(pvc, pkv)
    sp.connector.set_xfer_handshake_metadata_pp_aware({(s, 0): w.get_handshake_metadata() for s, w in enumerate(pre)})
    params, remote = h.prefill(sp, pre, "pp-1", 70)
    hd = json.loads(params["kvxfer_handoff"])
    assert len(hd["stages"]) == 2 and hd["stages"][1]["ranks"][0]["producer"].endswith("-pp1tp0"), hd["stages"]

    dvc, dkv, dcaches, dec = _deployment("kv_consumer", 2, f"pp-dec-{os.getpid()}")
    sd = h.scheduler(dvc, dkv)
    sd.add_request(h.request("pp-d", 70, dict(params), max_tokens=2))
    out = sd.schedule()
    local = out.kv_connector_metadata.loads["pp-d"][1][0]
    for w in dec:
        h.start_loads(w, out)
    for w in dec:
        assert "pp-d" in h.received(w, {"pp-d"})
        assert w.get_block_ids_with_load_errors() == set()
    for name in dcaches:
        for lb, rb in zip(local, remote):
            assert torch.equal(dcaches[name][lb].view(torch.int16), caches[name][rb].view(torch.int16)), (name, lb, rb)
    # Each stage moved its own layer only.
    block = h.BLOCK * h.KV_HEADS * 2 * h.HEAD * 2
    for w in dec:
        assert w.get_kv_connector_stats().data["bytes_moved"] == len(local) * block
    # Every prefill stage frees on its acknowledgement.
    for w in pre:
        assert h.sent(w, "pp-1")
    for w in dec + pre:
        w.shutdown()


def test_another_pp_size_is_refused_naming_both():
    pvc, pkv, _, pre = _deployment("kv_producer", 2, f"pp2-pre-{os.getpid()}", seed=10)
    sp = h.scheduler(pvc, pkv)
    sp.connector.set_xfer_handshake_metadata_pp_aware({(s, 0): w.get_handshake_metadata() for s, w in enumerate(pre)})
    params, _ = h.prefill(sp, pre, "pp-2", 40)
    h.refused_load(params, "pp-d2", 40, ["prefill PP 2, decode PP 1"])
    for w in pre:
        w.shutdown()
