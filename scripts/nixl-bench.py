#!/usr/bin/env python3
"""NIXL reference for kvxfer-bench: the same KV-shaped request between two processes.

8,344 blocks x 32 KiB (Qwen3-0.6B, 2,371 tokens = 273,416,192 B) at random slots on both sides,
or one region, READ and WRITE, over UCX with UCX_TLS set per transport (tcp or shm). Each
iteration is timed from posting to NIXL's DONE; bytes are verified after the timed runs.

Setup (no GPU needed for DRAM):
    python3 -m venv /tmp/nixlvenv && /tmp/nixlvenv/bin/pip install numpy
    /tmp/nixlvenv/bin/pip install --no-deps nixl-cu12==1.5.1
    /tmp/nixlvenv/bin/python scripts/nixl-bench.py --transport tcp --op write,read

Prints one JSON line per (op, placement, transport), with the median, min and max in ms and the
UCX version NIXL loaded.
"""

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

BLOCKS = 8344
BLOCK = 32768
# NIXL needs peer-failure handling, which UCX's mm transports lack: its shm path is cma for
# RMA with tcp for active messages.
PROG = os.environ.get("NIXL_BENCH_PROG_THREAD", "1") == "1"
TLS = {"tcp": "tcp", "shm": "sm,tcp"}


def pattern(n_blocks, block, seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(0, 255, size=n_blocks * block, dtype=np.uint8)


def slots(n, seed, random):
    import numpy as np

    s = np.arange(n)
    if random:
        np.random.default_rng(seed).shuffle(s)
    return s


def env(transport):
    if os.environ.get("NIXL_BENCH_NO_THP") == "1":
        # numpy madvises large arrays for transparent huge pages; kvxfer's memfd-backed
        # buffers are shmem, which this host keeps on 4 KiB pages: compare like with like.
        import numpy as np

        np._core.multiarray._set_madvise_hugepage(False)
    os.environ["UCX_TLS"] = TLS[transport]
    os.environ.setdefault("UCX_NET_DEVICES", "lo")


def target(conn, transport, blocks, block):
    env(transport)
    import numpy as np
    from nixl_cu12._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("target", nixl_agent_config(enable_prog_thread=PROG, backends=["UCX"]))
    buf = np.zeros(blocks * block, dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), buf.ctypes.data))
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            sys.stdout.flush()
            os._exit(0)
        if msg[0] == "fill":  # content for a READ: data block k at remote slot rs[k]
            _, rs, seed = msg
            data = pattern(blocks, block, seed).reshape(blocks, block)
            v = buf.reshape(blocks, block)
            v[rs] = data
            conn.send("ok")
        elif msg[0] == "clear":
            buf[:] = 0
            conn.send("ok")
        elif msg[0] == "verify":  # after a WRITE
            _, rs, seed = msg
            data = pattern(blocks, block, seed).reshape(blocks, block)
            conn.send(bool((buf.reshape(blocks, block)[rs] == data).all()))


def ucx_version():
    try:
        with open("/proc/self/maps") as f:
            libs = {line.split()[-1] for line in f if "libucp" in line}
        return ", ".join(sorted(os.path.basename(x) for x in libs)) or "unknown"
    except OSError:
        return "unknown"


def run(args, transport):
    env(transport)
    import numpy as np
    from nixl_cu12._api import nixl_agent, nixl_agent_config

    parent, child = mp.Pipe()
    p = mp.get_context("spawn").Process(
        target=target, args=(child, transport, args.blocks, args.block_size)
    )
    p.start()
    meta, raddr = parent.recv()
    agent = nixl_agent("initiator", nixl_agent_config(enable_prog_thread=PROG, backends=["UCX"]))
    n, bs = args.blocks, args.block_size
    buf = np.zeros(n * bs, dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    peer = agent.add_remote_agent(meta)
    out = []
    for placement in args.placement.split(","):
        rnd = placement == "random"
        ls = slots(n, args.seed, rnd)
        rs = slots(n, args.seed ^ 0x5EED, rnd)
        if placement == "single":
            local = [(buf.ctypes.data, n * bs, 0)]
            remote = [(raddr, n * bs, 0)]
        else:
            local = [(buf.ctypes.data + int(s) * bs, bs, 0) for s in ls]
            remote = [(raddr + int(s) * bs, bs, 0) for s in rs]
        ld = agent.get_xfer_descs(local, "DRAM")
        rd = agent.get_xfer_descs(remote, "DRAM")
        for op in args.op.split(","):
            data = pattern(n, bs, args.seed).reshape(n, bs)
            if op == "write":
                buf.reshape(n, bs)[ls] = data
                parent.send(("clear",))
            else:
                buf[:] = 0
                parent.send(("fill", rs, args.seed))
            parent.recv()
            times = []
            for i in range(args.warmup + args.iters):
                h = agent.initialize_xfer(op.upper(), ld, rd, peer, b"kvx")
                t0 = time.perf_counter()
                st = agent.transfer(h)
                while st == "PROC":
                    st = agent.check_xfer_state(h)
                dt = time.perf_counter() - t0
                if st != "DONE":
                    raise RuntimeError(f"NIXL transfer ended {st}")
                agent.release_xfer_handle(h)
                if i >= args.warmup:
                    times.append(dt * 1e3)
            if op == "write":
                parent.send(("verify", rs, args.seed))
                ok = parent.recv()
            else:
                ok = bool((buf.reshape(n, bs)[ls] == data).all())
            rec = {
                "impl": "nixl-1.5.1",
                "ucx": ucx_version(),
                "op": op,
                "placement": placement,
                "transport": transport,
                "bytes": n * bs,
                "descs": len(local),
                "median_ms": round(statistics.median(times), 2),
                "min_ms": round(min(times), 2),
                "max_ms": round(max(times), 2),
                "verified": ok,
            }
            out.append(rec)
            print(json.dumps(rec), flush=True)
    parent.send(("stop",))
    p.join()
    # NIXL 1.5.1's agent teardown at interpreter exit can end the process with a signal after
    # every result is out (seen as exit code -11/-6): leave without it.
    sys.stdout.flush()
    os._exit(0 if all(r["verified"] for r in out) else 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--transport", default="tcp")
    ap.add_argument("--op", default="write,read")
    ap.add_argument("--placement", default="random,single")
    ap.add_argument("--blocks", type=int, default=BLOCKS)
    ap.add_argument("--block-size", type=int, default=BLOCK)
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()
    for t in args.transport.split(";"):
        # Each transport in its own process: UCX reads UCX_TLS once per process.
        p = mp.get_context("spawn").Process(target=run, args=(args, t))
        p.start()
        p.join()
        if p.exitcode:
            raise SystemExit(p.exitcode)


if __name__ == "__main__":
    main()
