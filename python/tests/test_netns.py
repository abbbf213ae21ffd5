"""A handoff between a prefill and a decode engine in two network namespaces joined by a veth
pair (198.18.9.1 <-> 198.18.9.2, names prefixed kvx): each side's plugin is configured with
only its veth device ("net_devices"), the prefill side advertises that device's address in the
handoff, and the decode side, which has no other route to it, loads the blocks through it.
Bytes are compared block by block (SHA-256 per layer). Needs root and iproute2; skips
otherwise. The namespaces are removed at the end, pass or fail."""

import json
import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def sh(*args):
    return subprocess.run(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


@pytest.fixture
def namespaces():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network-namespace tests need root and iproute2 (ip)")
    tag = f"{os.getpid() % 100000}"
    a, b, la, lb = f"kvx{tag}pa", f"kvx{tag}pb", f"kvx{tag}px", f"kvx{tag}py"
    try:
        steps = [
            ["ip", "netns", "add", a],
            ["ip", "netns", "add", b],
            ["ip", "link", "add", la, "netns", a, "type", "veth", "peer", "name", lb, "netns", b],
            ["ip", "-n", a, "addr", "add", "198.18.9.1/24", "dev", la],
            ["ip", "-n", b, "addr", "add", "198.18.9.2/24", "dev", lb],
            ["ip", "-n", a, "link", "set", la, "up"],
            ["ip", "-n", b, "link", "set", lb, "up"],
            ["ip", "-n", a, "link", "set", "lo", "up"],
            ["ip", "-n", b, "link", "set", "lo", "up"],
        ]
        for s in steps:
            r = sh(*s)
            assert r.returncode == 0, f"{' '.join(s)}: {r.stderr}"
        yield a, b, la, lb
    finally:
        sh("ip", "netns", "del", a)
        sh("ip", "netns", "del", b)


def test_handoff_between_engines_in_two_network_namespaces(namespaces):
    a, b, la, lb = namespaces
    py = sys.executable
    side = os.path.join(HERE, "netns_side.py")
    pre = subprocess.Popen(
        ["ip", "netns", "exec", a, py, side, "--role", "prefill", "--dev", la],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    dec = None
    try:
        first = json.loads(pre.stdout.readline())
        params = first["params"]
        handoff = json.loads(params["kvxfer_handoff"])
        # What the decode side is told to reach: the prefill side's veth address, nothing else.
        assert handoff["side_channel"].startswith("198.18.9.1:"), handoff["side_channel"]
        assert all(r["side_channel"].startswith("198.18.9.1:") for r in handoff["ranks"])
        dec = subprocess.Popen(
            ["ip", "netns", "exec", b, py, side, "--role", "decode", "--dev", lb],
            stdout=subprocess.PIPE,
            stdin=subprocess.PIPE,
            text=True,
        )
        out, _ = dec.communicate(json.dumps(params) + "\n", timeout=120)
        got = json.loads(out.strip().splitlines()[-1])
        assert got["received"] and got["errors"] == [], got
        assert len(got["local"]) == len(first["blocks"]) == 5
        assert got["digests"] == first["digests"]
        assert got["stats"]["loads"] == 1 and got["stats"]["bytes_moved"] > 0, got["stats"]
        sent = json.loads(pre.stdout.readline())
        assert sent == {"sent": True}, sent
        assert pre.wait(timeout=60) == 0
    finally:
        for p in (pre, dec):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
