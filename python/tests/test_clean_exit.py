"""Clean exits of an engine process using the plugin: vLLM's engine processes turn SIGTERM
and SIGINT into SystemExit; a process with a KvxferConnector worker (an agent, its side
channel, the KV caches registered, loads in flight through libkvxfer) then has nothing of
libkvxfer left registered or mapped (kx.live()) within a second, whether or not vLLM called the
connector's shutdown(), and exits 0."""

import os
import signal
import subprocess
import sys
import time

import pytest

ENGINE = r"""
import atexit, os, signal, sys, time
sys.path.insert(0, sys.argv[1])

# Registered first, so it runs last at exit: what is left once the plugin closed its part.
@atexit.register
def _left():
    from kvxfer_vllm import lib as kx
    print("LEFT", kx.live(), time.monotonic(), flush=True)

# As vLLM's engine core does (vllm/v1/engine/core.py): the signals become SystemExit.
def _handler(signum, frame):
    raise SystemExit()
signal.signal(signal.SIGTERM, _handler)
signal.signal(signal.SIGINT, _handler)

import torch
import helpers as h
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from kvxfer_vllm import KvxferConnector
from kvxfer_vllm import lib as kx

vc = h.vllm_config(extra={"transport": "tcp", "net_devices": "lo"})
_, caches, kv = h.kv_caches()
worker = KvxferConnector(vc, KVConnectorRole.WORKER, kv)
worker.register_kv_caches(caches)

# Loads through libkvxfer in a loop (two agents over TCP, 64 MiB per handoff), so that one is
# in flight when the signal comes; closed at exit like the worker.
layers, heads, head_dim, bs, nb = 2, 8, 128, 16, 128
src = torch.ones((layers, nb, heads, bs, 2 * head_dim), dtype=torch.bfloat16)
dst = torch.zeros_like(src)
per_layer = nb * heads * bs * 2 * head_dim * 2
lay, _ = kx.layout_struct(layers, heads, head_dim, 2, bs, nb, kx.KVX_PACKING_FUSED, False, [(0, 0, None, 0)] * layers)
cfg = kx.config_struct(heartbeat_ms=20)
pa, da = kx.Agent("clean-exit-p", "tcp", "lo"), kx.Agent("clean-exit-d", "tcp", "lo")
side = pa.listen()
pc, dc = kx.Connector.over_agent(pa, side), kx.Connector.over_agent(da)
prod = pc.producer(lay, [(src[i].data_ptr(), per_layer) for i in range(layers)], cfg)
cons = dc.consumer(lay, [(dst[i].data_ptr(), per_layer) for i in range(layers)], cfg)

@atexit.register
def _close():
    for x in (cons, prod, dc, pc, da, pa):
        x.close()

print("READY", flush=True)
k = 0
while True:
    k += 1
    handoff = prod.publish(f"r-{k}", list(range(nb)), nb * bs, layers)
    cons.start_load(handoff, list(range(nb)))
    cons.wait(f"r-{k}", 20000)
    cons.next_finished()
    prod.next_freed(20000)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_an_engine_process_exits_0_in_order_with_nothing_left(tmp_path, sig):
    script = tmp_path / "engine.py"
    script.write_text(ENGINE)
    p = subprocess.Popen(
        [sys.executable, str(script), os.path.dirname(__file__)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = p.stdout.readline()
        assert line.strip() == "READY", (line, p.stderr.read() if p.poll() is not None else "")
        time.sleep(1.0)  # handoffs in flight
        t0 = time.monotonic()
        p.send_signal(sig)
        rc = p.wait(timeout=10)
        took = time.monotonic() - t0
        out, err = p.communicate()
    finally:
        if p.poll() is None:
            p.kill()
    left = [l.rsplit(" ", 1) for l in out.splitlines() if l.startswith("LEFT")]
    assert rc == 0, (rc, out, err[-3000:])
    assert len(left) == 1, (out, err[-3000:])
    what, at = left[0]
    assert what == "LEFT {'agents': 0, 'regions': 0, 'ucx_registrations': 0, 'peer_mappings': 0}", out
    # The plugin's part, from the signal to nothing left (CLOCK_MONOTONIC is the machine's):
    # within a second. The interpreter's teardown after it is torch's and vLLM's (2.2 s here
    # for a process that only imported them and built a config, without kvxfer).
    closed = float(at) - t0
    name = signal.Signals(sig).name
    assert closed < 1.0, f"nothing left only {closed:.2f} s after {name}"
    print(f"{name}: nothing of libkvxfer left {closed * 1000:.0f} ms after it; exited 0 after {took:.2f} s")
