"""Tensor parallelism through the real vLLM 0.33.0 objects: a prefill deployment of TP `p` in a
child process (one KvxferConnector worker per rank, each its own agent, and the real Scheduler
fed every rank's handshake metadata) hands a request to a decode deployment of TP `d` in this
process (one worker per rank and the real Scheduler). Caches are laid out by vLLM's own
create_kv_cache_views with each rank's share of the KV heads, in both layouts (NHD and HND).
Every decode rank's loaded blocks are compared with the model's heads it holds; every prefill
rank reports the request sent (freed on the decode ranks' acknowledgements)."""

import multiprocessing as mp
import os
import sys
import time
import traceback

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import helpers as h  # noqa: E402

import torch  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

LAYOUTS = ["LBNHC", "LBHNC"]
TOKENS = 70  # 5 blocks of 16




def _load_on_every_rank(workers, out, req):
    """A scheduled step's loads started on every decode rank, each waited for."""
    for w in workers:
        h.start_loads(w, out)
    end = time.time() + 60
    done = set()
    while time.time() < end and len(done) < len(workers):
        for rank, w in enumerate(workers):
            _, rv = w.get_finished(set())
            if rv and req in rv:
                done.add(rank)
        time.sleep(0.01)
    assert done == set(range(len(workers))), f"ranks {done} of {len(workers)} received"


def _truth(seed):
    """The model's KV per layer, every head: [blocks, KV_HEADS, BLOCK, 2*HEAD] bf16 bits."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-30000, 30000, (64, h.KV_HEADS, h.BLOCK, 2 * h.HEAD), dtype=torch.int16, generator=g) for _ in range(h.LAYERS)]


def _prefill(conn, tp, layouts, engine):
    try:
        out = {}
        keep = []
        for layout in layouts:
            vc = h.vllm_config(role="kv_producer", engine_id=f"{engine}-{layout}", tp=tp)
            truth = _truth(7)
            workers = []
            for rank in range(tp):
                raw, caches, kv = h.kv_caches(layout=layout, kv_heads=len(h.heads_of(tp, rank)))
                for i, t in enumerate(caches.values()):
                    t.view(torch.int16).copy_(truth[i][:, h.heads_of(tp, rank)])
                w = h.worker(vc, kv, rank)
                w.register_kv_caches(caches)
                workers.append(w)
                keep.append((raw, caches))
            _, _, kv0 = h.kv_caches(layout=layout, kv_heads=len(h.heads_of(tp, 0)))
            s = h.scheduler(vc, kv0)
            s.connector.set_xfer_handshake_metadata({r: w.get_handshake_metadata() for r, w in enumerate(workers)})
            req = f"pre-{layout}"
            # vLLM broadcasts each step's metadata to every rank.
            params, blocks = h.prefill(s, workers, req, TOKENS)
            out[layout] = (params, blocks, truth, workers, req)
        conn.send({k: v[:3] for k, v in out.items()})
        # Serve until every rank's blocks were acknowledged by every decode rank reading them.
        sent = {}
        end = time.time() + 60
        while time.time() < end and len(sent) < len(out) * tp:
            for layout, (_, _, _, workers, req) in out.items():
                for rank, w in enumerate(workers):
                    got, _ = w.get_finished({req})
                    if got and req in got:
                        sent[(layout, rank)] = True
            time.sleep(0.01)
        conn.send(("sent", sorted(sent)))
        for _, (_, _, _, workers, _) in out.items():
            for w in workers:
                w.shutdown()
    except Exception:
        conn.send(("error", traceback.format_exc()))


@pytest.mark.parametrize("ptp,dtp", [(2, 2), (2, 1), (1, 2), (4, 1)], ids=["tp2-to-tp2", "tp2-to-tp1", "tp1-to-tp2", "gqa-tp4-to-tp1"])
def test_tensor_parallel_handoff_both_layouts(ptp, dtp):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_prefill, args=(child, ptp, LAYOUTS, f"kvx-tp-{ptp}{dtp}-{os.getpid()}"))
    p.start()
    msg = parent.recv()
    assert not (isinstance(msg, tuple) and msg[0] == "error"), msg[1]
    for layout in LAYOUTS:
        params, remote_blocks, truth = msg[layout]
        vc = h.vllm_config(role="kv_consumer", engine_id=f"kvx-dec-{layout}-{os.getpid()}", tp=dtp)
        ranks = []
        for rank in range(dtp):
            raw, caches, kv = h.kv_caches(layout=layout, kv_heads=len(h.heads_of(dtp, rank)))
            w = h.worker(vc, kv, rank)
            w.register_kv_caches(caches)
            ranks.append((w, raw, caches))
        _, _, kv0 = h.kv_caches(layout=layout, kv_heads=len(h.heads_of(dtp, 0)))
        s = h.scheduler(vc, kv0)
        r = h.request(f"dec-{layout}", TOKENS, dict(params), max_tokens=4)
        s.add_request(r)
        out = s.schedule()
        assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        local = out.kv_connector_metadata.loads[r.request_id][1][0]
        assert len(local) == len(remote_blocks) == 5
        _load_on_every_rank([w for w, _, _ in ranks], out, r.request_id)
        per_head_block = h.BLOCK * 2 * h.HEAD * 2
        for rank, (w, _, caches) in enumerate(ranks):
            assert w.get_block_ids_with_load_errors() == set(), (layout, rank)
            mine = h.heads_of(dtp, rank)
            for i, t in enumerate(caches.values()):
                for lb, rb in zip(local, remote_blocks):
                    want = truth[i][rb][mine]
                    assert torch.equal(t[lb].view(torch.int16), want), (layout, rank, i, lb, rb)
                # Blocks the load did not name stay untouched (zero).
                others = [b for b in range(64) if b not in local]
                assert torch.count_nonzero(t[others].view(torch.int16)) == 0, (layout, rank, i)
            st = w.get_kv_connector_stats()
            assert st.data["loads"] == 1 and st.data["failed"] == 0, st.data
            assert st.data["bytes_moved"] == 5 * h.LAYERS * len(mine) * per_head_block, st.data
            w.shutdown()
    sent = parent.recv()
    assert sent[0] == "sent", sent
    # Every prefill rank, in both layouts, freed on acknowledgement (none left to expire).
    assert sorted(sent[1]) == sorted((lay, rank) for lay in LAYOUTS for rank in range(ptp)), sent
    p.join(30)


def _handoff_from(tp, shape_over=None):
    """A handoff as a TP `tp` prefill deployment's scheduler makes it (from its workers'
    real templates), with its shape changed by `shape_over`."""
    import json

    vc = h.vllm_config(role="kv_producer", tp=tp)
    workers = []
    for rank in range(tp):
        _, caches, kv = h.kv_caches(kv_heads=len(h.heads_of(tp, rank)))
        w = h.worker(vc, kv, rank)
        w.register_kv_caches(caches)
        workers.append((w, caches))
    _, _, kv0 = h.kv_caches(kv_heads=len(h.heads_of(tp, 0)))
    s = h.scheduler(vc, kv0)
    s.connector.set_xfer_handshake_metadata({r: w.get_handshake_metadata() for r, (w, _) in enumerate(workers)})
    params, _ = h.prefill(s, [w for w, _ in workers], "pre-bad", 40)
    hd = json.loads(params["kvxfer_handoff"])
    hd["shape"].update(shape_over or {})
    params["kvxfer_handoff"] = json.dumps(hd)
    return params, workers


@pytest.mark.parametrize(
    "dtp,over,words",
    [
        (3, {}, ["do not split over TP 3", "prefill TP 1 over 2 KV heads", "decode TP 3 over 2 KV heads"]),
        (1, {"hnd": True}, ["differ in hnd", "prefill TP 1 over 2 KV heads", "HND", "NHD"]),
        (1, {"kv_heads_total": 4}, ["different models", "4 KV heads", "2 KV heads"]),
    ],
    ids=["heads-do-not-split", "layouts-differ", "other-model"],
)
def test_a_geometry_that_cannot_work_fails_the_load_naming_both_sides(dtp, over, words):
    """Refused before anything moves, with both sides' shapes in the error; the request's
    blocks are reported invalid and the request received (vLLM recomputes it), never left
    waiting or filled with the wrong heads."""
    import json

    params, producers = _handoff_from(1, over)
    vc = h.vllm_config(role="kv_consumer", tp=dtp)
    _, caches, kv = h.kv_caches(kv_heads=max(1, h.KV_HEADS // dtp))
    w = h.worker(vc, kv, 0)
    w.register_kv_caches(caches)
    s = h.scheduler(vc, kv)
    r = h.request("dec-bad", 40, dict(params), max_tokens=2)
    s.add_request(r)
    out = s.schedule()
    local = out.kv_connector_metadata.loads["dec-bad"][1][0]
    w.bind_connector_metadata(out.kv_connector_metadata)
    with pytest.raises(ValueError) as e:
        w._plan_load(json.loads(params["kvxfer_handoff"]), True)
    w.start_load_kv(None)
    for word in words:
        assert word in str(e.value), (word, str(e.value))
    _, rv = w.get_finished(set())
    assert rv == {"dec-bad"}
    assert w.get_block_ids_with_load_errors() == set(local) and local
    assert w.get_kv_connector_stats().data["failed"] == 1
    assert torch.count_nonzero(torch.stack([t.view(torch.int16) for t in caches.values()])) == 0
    w.shutdown()
    for p, _ in producers:
        p.shutdown()


def _prefill_mla(conn, tp, engine):
    """A TP `tp` prefill deployment of an MLA model: every rank holds the whole latent (each
    its own pattern here, so a decode rank's bytes say which rank it read)."""
    try:
        vc = h.vllm_config(role="kv_producer", engine_id=engine, tp=tp)
        _, _, kv0 = h.kv_caches()
        truths, workers, keep = [], [], []
        for rank in range(tp):
            g = torch.Generator().manual_seed(70 + rank)
            raw, caches = h.mla_caches()
            truth = [torch.randint(-30000, 30000, tuple(t.shape), dtype=torch.int16, generator=g) for t in caches.values()]
            for t, want in zip(caches.values(), truth):
                t.view(torch.int16).copy_(want)
            w = h.worker(vc, kv0, rank)
            w.register_kv_caches(caches)
            workers.append(w)
            truths.append(truth)
            keep.append((raw, caches))
        s = h.scheduler(vc, kv0)
        s.connector.set_xfer_handshake_metadata({r: w.get_handshake_metadata() for r, w in enumerate(workers)})
        params, blocks = h.prefill(s, workers, "pre-mla", TOKENS)
        conn.send((params, blocks, truths))
        sent = set()
        end = time.time() + 60
        while time.time() < end and len(sent) < tp:
            for rank, w in enumerate(workers):
                got, _ = w.get_finished({"pre-mla"})
                if got and "pre-mla" in got:
                    sent.add(rank)
            time.sleep(0.01)
        conn.send(("sent", sorted(sent)))
        for w in workers:
            w.shutdown()
    except Exception:
        conn.send(("error", traceback.format_exc()))


@pytest.mark.parametrize("ptp,dtp", [(2, 1), (1, 2), (2, 2)], ids=["mla-tp2-to-tp1", "mla-tp1-to-tp2", "mla-tp2-to-tp2"])
def test_mla_caches_move_whole_from_one_prefill_rank_per_decode_rank(ptp, dtp):
    """MLA caches ([blocks, block_size, latent], no head dimension, replicated over TP): each
    decode rank reads the whole latent once, from prefill rank (its rank mod the prefill TP),
    and every prefill rank is freed on acknowledgement, read or not."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_prefill_mla, args=(child, ptp, f"kvx-mla-{ptp}{dtp}-{os.getpid()}"))
    p.start()
    msg = parent.recv()
    assert not (isinstance(msg, tuple) and msg[0] == "error"), msg[1]
    params, remote_blocks, truths = msg
    vc = h.vllm_config(role="kv_consumer", engine_id=f"kvx-mla-dec-{os.getpid()}", tp=dtp)
    _, _, kv0 = h.kv_caches()
    ranks = []
    for rank in range(dtp):
        raw, caches = h.mla_caches()
        w = h.worker(vc, kv0, rank)
        w.register_kv_caches(caches)
        ranks.append((w, raw, caches))
    s = h.scheduler(vc, kv0)
    r = h.request("dec-mla", TOKENS, dict(params), max_tokens=4)
    s.add_request(r)
    out = s.schedule()
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    local = out.kv_connector_metadata.loads[r.request_id][1][0]
    assert len(local) == len(remote_blocks) == 5
    _load_on_every_rank([w for w, _, _ in ranks], out, r.request_id)
    block_bytes = h.BLOCK * h.MLA_LATENT * 2
    for rank, (w, _, caches) in enumerate(ranks):
        assert w.get_block_ids_with_load_errors() == set(), rank
        truth = truths[rank % ptp]
        for i, t in enumerate(caches.values()):
            for lb, rb in zip(local, remote_blocks):
                assert torch.equal(t[lb].view(torch.int16), truth[i][rb]), (rank, i, lb, rb)
            others = [b for b in range(64) if b not in local]
            assert torch.count_nonzero(t[others].view(torch.int16)) == 0, (rank, i)
        st = w.get_kv_connector_stats()
        # The whole latent once: not once per prefill rank, not split.
        assert st.data["bytes_moved"] == 5 * h.LAYERS * block_bytes, st.data
        w.shutdown()
    sent = parent.recv()
    assert sent == ("sent", list(range(ptp))), sent
    p.join(30)


def test_an_mla_cache_does_not_load_into_an_attention_cache():
    """A prefill side of MLA caches and a decode side of attention caches hold different
    models: refused before anything moves, naming both shapes."""
    import json

    vc = h.vllm_config(role="kv_producer")
    _, caches = h.mla_caches()
    _, _, kv0 = h.kv_caches()
    p = h.worker(vc, kv0, 0)
    p.register_kv_caches(caches)
    s = h.scheduler(vc, kv0)
    s.connector.set_xfer_handshake_metadata({0: p.get_handshake_metadata()})
    params, _ = h.prefill(s, [p], "pre-mix", 40)
    dvc = h.vllm_config(role="kv_consumer")
    _, dcaches, kv = h.kv_caches()
    w = h.worker(dvc, kv, 0)
    w.register_kv_caches(dcaches)
    with pytest.raises(ValueError) as e:
        w._plan_load(json.loads(params["kvxfer_handoff"]), True)
    assert "MLA latent" in str(e.value) and "NHD" in str(e.value), str(e.value)
    w.shutdown()
    p.shutdown()


def test_mla_caches_as_vllm_makes_them_move_as_latents():
    """vLLM's own MLA views are 4D [blocks, 1, block_size, latent]: registered as latents
    (the spec says MLA), not as one attention head of half the latent, so a decode side reads
    the whole latent with the TP plan of one head (a real engine's load failed on this
    "reading heads 0..4 of the producer's 1"); bytes compared."""
    extra = {"transport": "tcp", "net_devices": "lo"}
    pre, pcaches, s = h.prefill_engine(extra, f"mla4d-pre-{os.getpid()}", 41, caches_of=h.mla_vllm_caches)
    assert pre._shape["mla"] is True and pre._shape["kv_heads_total"] == 1, pre._shape
    params, remote = h.prefill(s, [pre], "mla4d-1", TOKENS)
    dec, dcaches, vd, dkv = h.decode_worker(extra, f"mla4d-dec-{os.getpid()}", caches_of=h.mla_vllm_caches)
    assert dec.kv_heads_total == 1
    sd = h.scheduler(vd, dkv)
    r = h.request("mla4d-dec", TOKENS, dict(params), max_tokens=2)
    sd.add_request(r)
    out = sd.schedule()
    (local,) = out.kv_connector_metadata.loads["mla4d-dec"][1]
    h.start_loads(dec, out)
    assert "mla4d-dec" in h.received(dec, {"mla4d-dec"})
    assert dec.get_block_ids_with_load_errors() == set()
    for name in h.layer_names():
        for lb, rb in zip(local, remote[-len(local):]):
            assert torch.equal(dcaches[name][lb].view(torch.int16), pcaches[name][rb].view(torch.int16)), (name, lb)
    dec.shutdown()
    pre.shutdown()
