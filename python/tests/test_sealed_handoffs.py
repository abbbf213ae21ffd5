"""Handoffs are untrusted input (issue 33): with a secret ("secret" in
kv_connector_extra_config) the prefill scheduler seals the handoff it writes
(``kvxfer_seal``), and the decode side acts on no field of one a client edited. Real vLLM
schedulers and connector workers in one process, over TCP on loopback."""

import json
import os
import socket
import sys

sys.path.insert(0, os.path.dirname(__file__))
import helpers as h  # noqa: E402

import torch  # noqa: E402

EXTRA = {"transport": "tcp", "net_devices": "lo", "secret": "open sesame"}


def _edits(params, victim, listener):
    """The client's edits of `params` (each a new params dict), by name: toward its own
    listener, or toward `victim`'s KV (its blocks, its grant, its whole handoff)."""
    def edited(fn):
        hd = json.loads(params["kvxfer_handoff"])
        fn(hd)
        return dict(params, kvxfer_handoff=json.dumps(hd))

    def side(hd):
        hd["side_channel"] = listener
        for r in hd["ranks"]:
            r["side_channel"] = listener

    def epoch(hd):
        for r in hd["ranks"]:
            r["epoch"] = "%016x" % (int(r.get("epoch", "0"), 16) ^ 1)

    theirs = json.loads(victim["kvxfer_handoff"])
    out = {
        "side-channel": edited(side),
        "blocks": edited(lambda hd: hd.update(blocks=theirs["blocks"])),
        "epoch": edited(epoch),
        "grant": edited(lambda hd: hd.update(grant=theirs["grant"])),
        # The victim's whole handoff under this one's seal.
        "swapped": dict(params, kvxfer_handoff=victim["kvxfer_handoff"]),
    }
    unsealed = dict(params)
    del unsealed["kvxfer_seal"]
    out["unsealed"] = unsealed
    # A seal that is not a string of 64 hex digits.
    out["seal-not-hex"] = dict(params, kvxfer_seal=12345)
    return out


def test_edited_kv_transfer_params_fail_alone_and_dial_nothing():
    pid = os.getpid()
    pre, caches, s = h.prefill_engine(EXTRA, f"seal-pre-{pid}", 5)
    real, remote = h.prefill(s, [pre], "real", 40)
    other, _ = h.prefill(s, [pre], "other", 40)
    assert real["kvxfer_seal"] and other["kvxfer_seal"] != real["kvxfer_seal"]
    assert json.loads(real["kvxfer_handoff"])["grant"] != json.loads(other["kvxfer_handoff"])["grant"]

    # The client runs a listener and points edited handoffs at it.
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(8)
    lsock.settimeout(0.5)
    listener = "127.0.0.1:%d" % lsock.getsockname()[1]
    edits = _edits(other, real, listener)

    dec, dcaches, vd, dkv = h.decode_worker(EXTRA, f"seal-dec-{pid}")
    sd = h.scheduler(vd, dkv)
    for name, params in edits.items():
        sd.add_request(h.request(f"edit-{name}", 40, params, max_tokens=4))
    sd.add_request(h.request("dec-real", 40, dict(real), max_tokens=4))
    out = sd.schedule()
    loads = out.kv_connector_metadata.loads
    assert set(loads) == {f"edit-{n}" for n in edits} | {"dec-real"}, set(loads)
    h.start_loads(dec, out)
    got = h.received(dec, set(loads))
    assert got == set(loads), got
    # Every edited request failed: its blocks, and only its, reported invalid.
    edited_blocks = {b for r, v in loads.items() if r != "dec-real" for g in v[1] for b in g}
    errors = dec.get_block_ids_with_load_errors()
    assert errors == edited_blocks, (errors, edited_blocks)
    st = dec.get_kv_connector_stats()
    assert st.data["loads"] == 1 and st.data["failed"] == len(edits), st.data
    # No edited handoff made the decode worker dial the client's listener.
    try:
        c, _ = lsock.accept()
        c.close()
        raise AssertionError("an edited handoff made the decode worker connect to the client's listener")
    except socket.timeout:
        pass
    lsock.close()
    # The real request's KV landed; nothing was written into the edited requests' blocks.
    local = loads["dec-real"][1][0]
    for name, t in dcaches.items():
        for lb, rb in zip(local, remote):
            assert torch.equal(t[lb].view(torch.int16), caches[name][rb].view(torch.int16)), (name, lb, rb)
        assert torch.count_nonzero(t[sorted(edited_blocks)].view(torch.int16)) == 0, name
    dec.shutdown()
    pre.shutdown()


def test_lane_only_caches_load_through_grants_on_the_tcp_lane():
    """``lane_only_cache``: both caches are published with no UCX key and no shared-memory
    handle (kvxfer's ``kvx_agent_register_shared`` with no peer), so in one host, where the shm
    lane would carry the handoff, it takes the TCP lane, whose target checks the decode
    worker's grant (kvxfer/tests/shares.rs shows another peer refused). The bytes land."""
    pid = os.getpid()
    extra = {"transport": "auto", "net_devices": "lo", "secret": "open sesame", "lane_only_cache": True}
    pre, caches, s = h.prefill_engine(extra, f"lo-pre-{pid}", 7)
    real, remote = h.prefill(s, [pre], "lo-real", 40)

    dec, dcaches, vd, dkv = h.decode_worker(extra, f"lo-dec-{pid}")
    sd = h.scheduler(vd, dkv)
    sd.add_request(h.request("lo-dec", 40, dict(real), max_tokens=4))
    out = sd.schedule()
    local = out.kv_connector_metadata.loads["lo-dec"][1][0]
    h.start_loads(dec, out)
    got = h.received(dec, {"lo-dec"})
    assert got == {"lo-dec"}, got
    assert dec.get_block_ids_with_load_errors() == set()
    assert dec.get_kv_connector_stats().data["loads"] == 1
    for name, t in dcaches.items():
        for lb, rb in zip(local, remote):
            assert torch.equal(t[lb].view(torch.int16), caches[name][rb].view(torch.int16)), (name, lb, rb)
    dec.shutdown()
    pre.shutdown()



def test_a_secret_makes_the_caches_grant_only_by_default():
    """With a ``secret`` and no ``lane_only_cache`` key the caches are registered to open only
    through grants (``kvx_agent_register_shared`` with no peer: no UCX key, no shm handle,
    no device export); ``lane_only_cache: false`` keeps them open to every authenticated
    peer; without a secret they stay open (names would be claims). A handoff loads in each
    case, bytes checked."""
    pid = os.getpid()
    for secret, lane_only, expect in ((True, None, True), (True, False, False), (False, None, False)):
        extra = {"transport": "auto", "net_devices": "lo"}
        if secret:
            extra["secret"] = "open sesame"
        if lane_only is not None:
            extra["lane_only_cache"] = lane_only
        tag = f"def-{secret}-{lane_only}-{pid}"
        pre, caches, s = h.prefill_engine(extra, f"pre-{tag}", 11)
        assert pre.lane_only_cache is expect, (secret, lane_only)
        real, remote = h.prefill(s, [pre], f"r-{tag}", 40)
        dec, dcaches, vd, dkv = h.decode_worker(extra, f"dec-{tag}")
        assert dec.lane_only_cache is expect
        sd = h.scheduler(vd, dkv)
        sd.add_request(h.request(f"d-{tag}", 40, dict(real), max_tokens=4))
        out = sd.schedule()
        local = out.kv_connector_metadata.loads[f"d-{tag}"][1][0]
        h.start_loads(dec, out)
        assert h.received(dec, {f"d-{tag}"}) == {f"d-{tag}"}
        for name, t in dcaches.items():
            for lb, rb in zip(local, remote):
                assert torch.equal(t[lb].view(torch.int16), caches[name][rb].view(torch.int16)), (name, lb, rb)
        dec.shutdown()
        pre.shutdown()
