"""One side of the network-namespace handoff test (test_netns.py), run inside a namespace with
`ip netns exec`: a prefill or a decode "engine" (the real vLLM Scheduler and a KvxferConnector
worker over caches laid out by vLLM's own create_kv_cache_views), talking only through the
veth device named by --dev. Prints one JSON line: what it published or loaded, with a SHA-256
of every block of every layer it holds for the request."""

import argparse
import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import helpers as h  # noqa: E402

import torch  # noqa: E402


def digests(caches, blocks):
    return [[hashlib.sha256(t[b].contiguous().view(torch.uint8).numpy().tobytes()).hexdigest() for b in blocks] for t in caches.values()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=["prefill", "decode"], required=True)
    ap.add_argument("--dev", required=True)
    a = ap.parse_args()
    extra = {"transport": "tcp", "net_devices": a.dev}
    if a.role == "prefill":
        vc = h.vllm_config(role="kv_producer", extra=extra, engine_id="netns-prefill")
        raw, caches, kv = h.kv_caches()
        g = torch.Generator().manual_seed(5)
        raw.copy_(torch.randint(-128, 127, raw.shape, dtype=torch.int8, generator=g))
        w = h.worker(vc, kv, 0)
        w.register_kv_caches(caches)
        s = h.scheduler(vc, kv)
        s.connector.set_xfer_handshake_metadata({0: w.get_handshake_metadata()})
        params, blocks = h.prefill(s, [w], "ns-1", 70)
        print(json.dumps({"params": params, "blocks": blocks, "digests": digests(caches, blocks)}), flush=True)
        sent = False
        end = time.time() + 60
        while time.time() < end and not sent:
            got, _ = w.get_finished({"ns-1"})
            sent = bool(got and "ns-1" in got)
            time.sleep(0.01)
        print(json.dumps({"sent": sent}), flush=True)
        w.shutdown()
    else:
        params = json.loads(sys.stdin.readline())
        vc = h.vllm_config(role="kv_consumer", extra=extra, engine_id="netns-decode")
        _, caches, kv = h.kv_caches()
        w = h.worker(vc, kv, 0)
        w.register_kv_caches(caches)
        s = h.scheduler(vc, kv)
        s.add_request(h.request("ns-dec", 70, params, max_tokens=4))
        so = s.schedule()
        local = so.kv_connector_metadata.loads["ns-dec"][1][0]
        w.bind_connector_metadata(so.kv_connector_metadata)
        w.start_load_kv(None)
        w.clear_connector_metadata()
        done = False
        end = time.time() + 60
        while time.time() < end and not done:
            _, rv = w.get_finished(set())
            done = bool(rv and "ns-dec" in rv)
            time.sleep(0.01)
        st = w.get_kv_connector_stats()
        print(
            json.dumps(
                {
                    "received": done,
                    "errors": sorted(w.get_block_ids_with_load_errors()),
                    "local": local,
                    "digests": digests(caches, local),
                    "stats": st.data if st else None,
                }
            ),
            flush=True,
        )
        w.shutdown()


if __name__ == "__main__":
    main()
