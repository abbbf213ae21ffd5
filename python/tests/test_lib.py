"""The ctypes bindings against the real libkvxfer (KVXFER_LIB, as CI sets it), no vLLM: what a
caller of the C ABI sees for settings and errors."""

import os
import socket
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

if not os.environ.get("KVXFER_LIB"):
    pytest.skip("KVXFER_LIB is not set (scripts/test.sh sets it to the debug build)", allow_module_level=True)

from kvxfer_vllm import lib as kx  # noqa: E402


def test_the_handshake_time_out_is_a_setting():
    # A peer that accepts and says nothing: connect gives up after the configured time, typed.
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    a = kx.Agent(f"hs-{os.getpid()}", "tcp", "lo", handshake_timeout_ms=300)
    try:
        t0 = time.monotonic()
        with pytest.raises(kx.KvxferError) as e:
            a.connect(f"127.0.0.1:{port}")
        took = time.monotonic() - t0
        assert 0.3 <= took < 2.5, took
        assert "timed out after 300ms" in str(e.value)
    finally:
        a.close()
        srv.close()


def test_a_zero_handshake_time_out_is_refused():
    with pytest.raises(kx.KvxferError) as e:
        kx.Agent(f"hs0-{os.getpid()}", "tcp", "lo", handshake_timeout_ms=0)
    assert e.value.status == kx.KVX_INVALID_ARGUMENT


def test_lane_encryption_needs_a_secret_and_then_connects():
    # Without a secret there is no key to seal the data with: refused at once, typed.
    with pytest.raises(kx.KvxferError) as e:
        kx.Agent(f"le0-{os.getpid()}", "tcp", "lo", lane_encryption=True)
    assert e.value.status == kx.KVX_INVALID_ARGUMENT
    assert "secret" in str(e.value)
    b = kx.Agent(f"le-b-{os.getpid()}", "tcp", "lo", secret=b"s", lane_encryption=True)
    a = kx.Agent(f"le-a-{os.getpid()}", "tcp", "lo", secret=b"s", lane_encryption=True)
    try:
        assert a.connect(b.listen()) == b.name
    finally:
        a.close()
        b.close()


def test_every_status_has_its_name():
    lib = kx.Lib.get()
    for value, name in kx.STATUS_NAMES.items():
        assert lib.L.kvx_status_name(value).decode() == name
    assert lib.L.kvx_status_name(4_000_000_000).decode() == "KVX_UNKNOWN"


@pytest.mark.parametrize(
    "shape",
    [
        (2**31, 8, 1, 8, 0),
        (2**20, 8, 1, 8, 0),
        (1, 2**31, 1, 2**31, 0),
        (8, 2**32 - 1, 1, 2**32 - 1, 0),
        (8, 8, 2**31, 8, 0),
        (2**32, 8, 1, 8, 0),
        (-1, 8, 1, 8, 0),
        ("8", 8, 1, 8, 0),
    ],
)
def test_hostile_tp_shapes_are_refused_typed_at_once(shape):
    # A handoff names the prefill TP: no shape may abort the process or take seconds.
    t0 = time.monotonic()
    with pytest.raises(kx.KvxferError) as e:
        kx.tp_plan(*shape)
    assert e.value.status == kx.KVX_INVALID_ARGUMENT
    assert time.monotonic() - t0 < 1.0


_UNDER_2_GIB = r"""
import os, resource, sys, time
sys.path.insert(0, sys.argv[1])
limit = 2 << 30
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
from kvxfer_vllm import lib as kx
shapes = [(2**31, 8, 1, 8, 0), (2**20, 8, 1, 8, 0), (1, 2**31, 1, 2**31, 0),
          (8, 2**32 - 1, 1, 2**32 - 1, 0), (8, 8, 2**31, 8, 0), (2**32 - 1,) * 5]
for shape in shapes:
    t0 = time.monotonic()
    try:
        kx.tp_plan(*shape)
        sys.exit(f"{shape}: planned")
    except kx.KvxferError as e:
        assert e.status == kx.KVX_INVALID_ARGUMENT, (shape, e)
    took = time.monotonic() - t0
    assert took < 0.05, (shape, took)
assert len(kx.tp_plan(kx.KVX_MAX_TP, 65536, 1, 65536, 0)) == kx.KVX_MAX_TP
print("ok", len(shapes))
"""


def test_hostile_tp_shapes_answer_typed_under_a_2_gib_address_space():
    # Where a plan sized by the shape aborted the process (SIGABRT on a 3 GB allocation).
    import subprocess

    here = os.path.join(os.path.dirname(__file__), "..")
    r = subprocess.run([sys.executable, "-c", _UNDER_2_GIB, here], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok 6", (r.returncode, r.stdout, r.stderr)


def test_the_largest_allowed_tp_plans():
    reads = kx.tp_plan(kx.KVX_MAX_TP, 64, 1, 64, 0)
    assert len(reads) == kx.KVX_MAX_TP
    assert all(r.readers == 1 for r in reads)


def test_seals_verify_and_refuse_every_edit_typed():
    secret = b"open sesame"
    text = b'{"request": "r-1", "blocks": [3, 4]}'
    seal = kx.seal_bytes(secret, text)
    assert len(seal) == 32
    kx.verify_bytes(secret, text, seal)
    for what, args in {
        "an edited text": (secret, text.replace(b"3", b"5"), seal),
        "another secret": (b"open sesame!", text, seal),
        "a cut seal": (secret, text, seal[:31]),
        "no seal": (secret, text, b""),
    }.items():
        with pytest.raises(kx.KvxferError) as e:
            kx.verify_bytes(*args)
        assert e.value.status == kx.KVX_AUTH, what
    with pytest.raises(kx.KvxferError) as e:
        kx.seal_bytes(b"", text)
    assert e.value.status_name == "KVX_INVALID_ARGUMENT"


def test_a_handoff_sealed_by_the_c_abi_carries_its_seal():
    import json

    h = {"v": 1, "request": "r-1", "producer": "p", "side_channel": None, "blocks": [1, 2], "tokens": 32,
         "compat": "00000000000000ff", "kv_heads": 2, "num_blocks": 16, "layers": [[0, 0], [0, 4096]],
         "mode": "pull", "grant": "ab" * 16}
    sealed = json.loads(kx.seal_handoff(b"open sesame", json.dumps(h).encode()))
    assert len(sealed["seal"]) == 64 and sealed["grant"] == h["grant"]
    assert {k: sealed[k] for k in h if k != "side_channel"} == {k: h[k] for k in h if k != "side_channel"}
    with pytest.raises(kx.KvxferError) as e:
        kx.seal_handoff(b"open sesame", b'{"v": 1}')
    assert e.value.status_name == "KVX_INVALID_ARGUMENT"
