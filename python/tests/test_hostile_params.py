"""Request intake that fails alone (issue 37, part 5): a client's ``kv_transfer_params`` of
any JSON type, and every field of a real handoff replaced by a value of every JSON type, go
through vLLM 0.33's real scheduler and a real decode worker. Nothing raises out of
``schedule()`` or ``start_load_kv``; every such request ends (loaded or failed, its blocks
reported invalid); and a real request beside them loads its KV bit for bit. No secret: the
worker's own checks are what is tested (with a secret the seal refuses every edit first)."""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import helpers as h  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

EXTRA = {"transport": "tcp", "net_devices": "lo"}
# One value of every JSON type, and the edges of the numbers a handoff carries.
VALUES = [None, True, False, 0, -1, 2**31, 2**64, 1.5, "", "x" * 300, [], [1, "a"], {}, {"a": [None]}]
TOKENS = 16  # one block a request


def _mutations(handoff_text):
    """Every field of the handoff (top level, each rank's, the shape's) set to each of VALUES,
    by name: the params a client would send."""
    base = json.loads(handoff_text)
    out = {}
    for v_i, v in enumerate(VALUES):
        for k in base:
            hd = json.loads(handoff_text)
            hd[k] = v
            out[f"top-{k}-{v_i}"] = hd
        for k in base.get("ranks", [{}])[0]:
            hd = json.loads(handoff_text)
            hd["ranks"][0][k] = v
            out[f"rank-{k}-{v_i}"] = hd
        for k in base.get("shape") or {}:
            hd = json.loads(handoff_text)
            hd["shape"][k] = v
            out[f"shape-{k}-{v_i}"] = hd
    return {n: {"do_remote_prefill": True, "kvxfer_handoff": json.dumps(hd)} for n, hd in out.items()}


def _odd_params():
    """kv_transfer_params whose fields are of the wrong type: the flag or the handoff of every
    JSON type. (The params themselves are an object: vLLM's API validates that, and its own
    scheduler calls ``.get`` on them before any connector sees them.)"""
    out = {}
    for v_i, v in enumerate(VALUES):
        out[f"handoff-{v_i}"] = {"do_remote_prefill": True, "kvxfer_handoff": v}
        out[f"flag-{v_i}"] = {"do_remote_prefill": v, "kvxfer_handoff": "{}"}
        out[f"text-{v_i}"] = {"do_remote_prefill": True, "kvxfer_handoff": json.dumps(v)}
    out["huge-text"] = {"do_remote_prefill": True, "kvxfer_handoff": "[" * (5 << 20)}
    return out


def test_any_kv_transfer_params_fail_alone_and_the_engine_keeps_serving():
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import RequestStatus

    pid = os.getpid()
    pre, caches, s = h.prefill_engine(EXTRA, f"odd-pre-{pid}", 7)
    victim, _ = h.prefill(s, [pre], "victim", TOKENS)

    dec, dcaches, vd, dkv = h.decode_worker(EXTRA, f"odd-dec-{pid}")
    sd = h.scheduler(vd, dkv)

    cases = list(_odd_params().items()) + list(_mutations(victim["kvxfer_handoff"]).items())
    assert len(cases) > 350, len(cases)
    # (Counted now: the scheduler clears the flag of a request it takes.)
    remote = [n for n, p in cases if p.get("do_remote_prefill") and p.get("kvxfer_handoff") is not None]
    loaded = failed = 0
    # In rounds the decode cache holds (64 blocks, one a request).
    for at in range(0, len(cases), 48):
        batch = dict(cases[at:at + 48])
        for name, params in batch.items():
            sd.add_request(h.request(name, TOKENS, params, max_tokens=2))
        out = sd.schedule()  # raises nothing, whatever the params
        loads = out.kv_connector_metadata.loads
        h.start_loads(dec, out)  # raises nothing either
        got = h.received(dec, set(loads), timeout=60)
        assert got == set(loads), f"round {at}: never ended: {set(loads) - got}"
        errors = dec.get_block_ids_with_load_errors()
        round_failed = {r for r, v in loads.items() if {b for g in v[1] for b in g} & errors}
        failed += len(round_failed)
        loaded += len(loads) - len(round_failed)
        # As the engine does: the workers' report reaches the scheduler, then the requests
        # end (their blocks free for the next round).
        kv_out = KVConnectorOutput(finished_recving=got, invalid_block_ids=errors)
        sd.update_from_output(out, h.model_output(out, kv=kv_out))
        sd.finish_requests(list(batch), RequestStatus.FINISHED_ABORTED)
        assert sd.kv_cache_manager.block_pool.get_num_free_blocks() >= 60, f"round {at}: blocks held"
    st = dec.get_kv_connector_stats()
    print(f"{len(cases)} hostile requests: {loaded} loaded, {failed} failed; stats {st.data}")
    # Every request that asked for a remote prefill with a handoff of any kind ended loaded
    # or failed; the rest (a false flag, no handoff) were computed locally, never loaded.
    assert loaded + failed == len(remote) == len(cases) - 7, (loaded, failed, len(remote))
    assert failed > 0 and st.data["failed"] == failed, st.data

    # The engine still serves: a real request (published now: the rounds outlast a lease)
    # loads its KV bit for bit.
    real, remote = h.prefill(s, [pre], "real", TOKENS)
    sd.add_request(h.request("dec-real", TOKENS, dict(real), max_tokens=2))
    out = sd.schedule()
    loads = out.kv_connector_metadata.loads
    h.start_loads(dec, out)
    got = h.received(dec, {"dec-real"})
    assert "dec-real" in got
    errors = dec.get_block_ids_with_load_errors()
    assert not set(loads["dec-real"][1][0]) & errors, (errors, dec.get_kv_connector_stats().data)
    for name, t in dcaches.items():
        for lb, rb in zip(loads["dec-real"][1][0], remote):
            assert torch.equal(t[lb].view(torch.int16), caches[name][rb].view(torch.int16)), (name, lb, rb)
    dec.shutdown()
    pre.shutdown()


@pytest.mark.parametrize("report", ["get_finished", "get_transfer_results"])
@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_failed_load_follows_vllms_load_failure_policy(policy, report):
    """kv_load_failure_policy, as vLLM's scheduler applies it to what kvxfer reports (the
    request received, its blocks invalid; through get_transfer_results, as vLLM 0.33's
    workers ask, also in failed_recving): "fail" ends the request with an error; "recompute"
    schedules its whole prompt for local prefill. Another request loads either way."""
    import json

    from vllm.v1.engine import FinishReason
    from vllm.v1.outputs import KVConnectorOutput

    pid = os.getpid()
    pre, caches, s = h.prefill_engine(EXTRA, f"pol-pre-{policy}-{report}-{pid}", 3)
    good, remote = h.prefill(s, [pre], "pol-good", TOKENS)
    other, _ = h.prefill(s, [pre], "pol-other", TOKENS)
    # A client's edit: blocks the producer never published for this request.
    hd = json.loads(other["kvxfer_handoff"])
    hd["blocks"] = [b + 1 for b in hd["blocks"]]
    bad = dict(other, kvxfer_handoff=json.dumps(hd))

    dec, dcaches, vd, dkv = h.decode_worker(EXTRA, f"pol-dec-{policy}-{report}-{pid}", load_failure_policy=policy)
    sd = h.scheduler(vd, dkv)
    sd.add_request(h.request("dec-bad", TOKENS, bad, max_tokens=2))
    sd.add_request(h.request("dec-good", TOKENS, dict(good), max_tokens=2))
    out = sd.schedule()
    loads = out.kv_connector_metadata.loads
    assert set(loads) == {"dec-bad", "dec-good"}
    h.start_loads(dec, out)
    got, failed = set(), set()
    end = time.time() + 30
    while time.time() < end and len(got) < 2:
        if report == "get_finished":
            _, rv = dec.get_finished(set())
            got |= rv or set()
        else:
            r = dec.get_transfer_results(set())
            got |= r.finished_recving
            failed |= r.failed_recving
        time.sleep(0.01)
    assert got == {"dec-bad", "dec-good"}, got
    if report == "get_transfer_results":
        assert failed == {"dec-bad"}, failed
    errors = dec.get_block_ids_with_load_errors()
    assert errors == set(loads["dec-bad"][1][0]) and errors, errors
    # The workers' report reaches the scheduler, as the engine passes it on.
    kv_out = KVConnectorOutput(finished_recving=got, failed_recving=failed, invalid_block_ids=errors)
    eco = sd.update_from_output(out, h.model_output(out, kv=kv_out))
    ended = {o.request_id: o.finish_reason for v in eco.values() for o in v.outputs if o.finish_reason is not None}
    out2 = sd.schedule()
    if policy == "fail":
        assert ended == {"dec-bad": FinishReason.ERROR}, ended
        assert "dec-bad" not in out2.num_scheduled_tokens
    else:
        assert ended == {}, ended
        # Recomputed here: its whole prompt scheduled for this engine's own prefill.
        assert out2.num_scheduled_tokens.get("dec-bad") == TOKENS, out2.num_scheduled_tokens
    # The good request loaded its KV either way, and is scheduled to decode.
    assert "dec-good" in out2.num_scheduled_tokens
    for name, t in dcaches.items():
        for lb, rb in zip(loads["dec-good"][1][0], remote):
            assert torch.equal(t[lb].view(torch.int16), caches[name][rb].view(torch.int16)), (name, lb, rb)
    dec.shutdown()
    pre.shutdown()
