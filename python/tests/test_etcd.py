"""Discovery through a real etcd from the vLLM plugin ("discovery" in kv_connector_extra_config):
each worker publishes itself and watches the namespace, so the decode worker has the prefill
worker loaded before the handoff arrives and never dials the side channel the handoff names
(made unreachable here). Needs a libkvxfer built with the etcd feature (scripts/test.sh builds
it so) and Debian's etcd-server; skips without an etcd binary."""

import base64
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import helpers as h  # noqa: E402

import torch  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_certs(d):
    """A CA and a certificate for 127.0.0.1 it signed (openssl), in `d`."""
    sh = (
        "set -e; openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=kvx-test-ca -keyout ca.key -out ca.pem; "
        "openssl req -newkey rsa:2048 -nodes -subj /CN=127.0.0.1 -keyout server.key -out server.csr; "
        "printf 'subjectAltName=IP:127.0.0.1\\n' > san.ext; "
        "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 -extfile san.ext -out server.pem"
    )
    subprocess.run(["sh", "-c", sh], cwd=d, check=True, capture_output=True)
    return os.path.join(d, "server.pem"), os.path.join(d, "server.key"), os.path.join(d, "ca.pem")


@pytest.fixture(params=["open", "etcd-auth", "tls"])
def etcd(request):
    """(client URL, mode, CA file or None) of a fresh etcd."""
    if shutil.which("etcd") is None:
        pytest.skip("no etcd binary (apt-get install etcd-server)")
    mode = request.param
    if mode == "tls" and shutil.which("openssl") is None:
        pytest.skip("no openssl binary")
    d = tempfile.mkdtemp(prefix="kvx-etcd-")
    client, peer = free_port(), free_port()
    scheme = "https" if mode == "tls" else "http"
    url, purl = f"{scheme}://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    tls, ca = [], None
    if mode == "tls":
        cert, key, ca = make_certs(d)
        tls = ["--cert-file", cert, "--key-file", key]
    p = subprocess.Popen(
        ["etcd", "--name", "kvx", "--data-dir", os.path.join(d, "data"), "--listen-client-urls", url, "--advertise-client-urls", url,
         "--listen-peer-urls", purl, "--initial-advertise-peer-urls", purl, "--initial-cluster", f"kvx={purl}", *tls],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        end = time.time() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", client), timeout=0.2).close()
                break
            except OSError:
                assert time.time() < end, "etcd did not come up"
                time.sleep(0.1)
        time.sleep(0.3)
        yield url, mode, ca
    finally:
        p.kill()
        p.wait()
        shutil.rmtree(d, ignore_errors=True)


def enable_auth(url, ns):
    """etcd's own authentication on, through its JSON gateway: a root user, and a user "kvx"
    that may read and write the namespace only."""

    def call(path, body):
        req = urllib.request.Request(f"{url}/v3/{path}", data=json.dumps(body).encode(), method="POST")
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read() or b"{}")

    b64 = lambda b: base64.b64encode(b).decode()  # noqa: E731
    end = ns.encode()[:-1] + bytes([ns.encode()[-1] + 1])
    call("auth/user/add", {"name": "root", "password": "root-pw"})
    call("auth/user/grant", {"user": "root", "role": "root"})
    call("auth/role/add", {"name": "kvx"})
    call("auth/role/grant", {"name": "kvx", "perm": {"permType": "READWRITE", "key": b64(ns.encode()), "range_end": b64(end)}})
    call("auth/user/add", {"name": "kvx", "password": "kvx-pw"})
    call("auth/user/grant", {"user": "kvx", "role": "kvx"})
    call("auth/enable", {})


def test_workers_find_each_other_through_etcd_not_the_side_channel(etcd):
    url, mode, ca = etcd
    ns = f"/kvx-plugin-{os.getpid()}"
    disc = url.replace("http://", "etcd://").replace("https://", "etcds://")
    extra = {"transport": "tcp", "net_devices": "lo", "discovery": disc, "namespace": ns}
    if mode == "etcd-auth":
        enable_auth(url, ns)
        extra.update(etcd_user="kvx", etcd_password="kvx-pw")
    if mode == "tls":
        extra.update(etcd_ca=ca)
    pre, caches, s = h.prefill_engine(extra, f"etcd-pre-{os.getpid()}", 3)
    params, remote = h.prefill(s, [pre], "e-1", 70)

    # The decode worker starts after the prefill worker published: its watch loads it.
    dec, dcaches, vd, dkv = h.decode_worker(extra, f"etcd-dec-{os.getpid()}")
    # A side channel nobody can reach (TEST-NET-1): the load must not need it.
    hd = json.loads(params["kvxfer_handoff"])
    hd["side_channel"] = "192.0.2.1:9"
    for r in hd["ranks"]:
        r["side_channel"] = "192.0.2.1:9"
    params = dict(params, kvxfer_handoff=json.dumps(hd))
    sd = h.scheduler(vd, dkv)
    sd.add_request(h.request("e-dec", 70, params, max_tokens=4))
    out = sd.schedule()
    local = out.kv_connector_metadata.loads["e-dec"][1][0]
    dec.bind_connector_metadata(out.kv_connector_metadata)
    t0 = time.time()
    dec.start_load_kv(None)
    dec.clear_connector_metadata()
    got = h.received(dec, {"e-dec"})
    assert "e-dec" in got and dec.get_block_ids_with_load_errors() == set()
    for name, t in dcaches.items():
        for lb, rb in zip(local, remote):
            assert torch.equal(t[lb].view(torch.int16), caches[name][rb].view(torch.int16)), (name, lb, rb)
    print(f"loaded through etcd discovery in {time.time() - t0:.3f} s; the side channel named was unreachable")
    dec.shutdown()
    pre.shutdown()
