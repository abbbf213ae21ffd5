"""The disaggregating proxy (python/e2e/proxy.py) against two stand-in engines: the prefill
engine gets the client's request with max_tokens 1 and do_remote_decode, the decode engine the
client's request with exactly the kv_transfer_params the prefill engine returned, and the
client the decode engine's answer; a prefill answer without params is a 502 naming it."""

import http.server
import json
import os
import sys
import threading
import urllib.error
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "e2e"))
import proxy  # noqa: E402


def _engine(answer):
    seen = []

    class H(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.path, body))
            out = json.dumps(answer(body)).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *a):
            return

    s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=s.serve_forever, daemon=True).start()
    return s, seen, f"http://127.0.0.1:{s.server_address[1]}"


def _post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def test_a_request_travels_prefill_then_decode_with_the_handoff_untouched():
    handoff = {"do_remote_prefill": True, "do_remote_decode": False, "kvxfer_handoff": '{"request":"r"}', "kvxfer_seal": "ab" * 32}
    pre, pre_seen, pre_url = _engine(lambda b: {"choices": [{"text": "x"}], "kv_transfer_params": handoff})
    dec, dec_seen, dec_url = _engine(lambda b: {"choices": [{"text": "the answer"}]})
    p = proxy.serve(0, pre_url, dec_url)
    threading.Thread(target=p.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{p.server_address[1]}/v1/completions"
    out = _post(url, {"model": "m", "prompt": "hello", "max_tokens": 16})
    assert out == {"choices": [{"text": "the answer"}]}
    (path, first), = pre_seen
    assert path == "/v1/completions" and first["max_tokens"] == 1 and first["prompt"] == "hello"
    assert first["kv_transfer_params"] == {"do_remote_decode": True}
    (path, second), = dec_seen
    assert second["max_tokens"] == 16 and second["kv_transfer_params"] == handoff
    # A prefill engine that returns no handoff: the client hears why, nothing reaches decode.
    bad, _, bad_url = _engine(lambda b: {"choices": [{"text": "x"}]})
    q = proxy.serve(0, bad_url, dec_url)
    threading.Thread(target=q.serve_forever, daemon=True).start()
    try:
        _post(f"http://127.0.0.1:{q.server_address[1]}/v1/completions", {"prompt": "p"})
        raise AssertionError("a prefill answer without kv_transfer_params went through")
    except urllib.error.HTTPError as e:
        assert e.code == 502 and b"no kv_transfer_params" in e.read()
    assert len(dec_seen) == 1
    for s in (pre, dec, bad, p, q):
        s.shutdown()
