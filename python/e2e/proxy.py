"""A minimal disaggregating proxy for vLLM's OpenAI server with KvxferConnector, standard
library only: how a request travels from the prefill engine to the decode engine.

    client --POST /v1/completions--> proxy
        proxy --same body, max_tokens 1, kv_transfer_params {"do_remote_decode": true}--> prefill
        prefill answers; its choice carries kv_transfer_params (kvxfer_handoff, and with a
        secret kvxfer_seal): the prefill engine holds the prompt's KV blocks for the decode side
        proxy --the client's body, kv_transfer_params = what prefill returned--> decode
        decode loads the KV (only what its prefix cache lacks) and generates; its answer goes back

The proxy never reads or changes the handoff: with a secret the decode side acts only on a
handoff whose seal verifies, so an edited one fails that request alone. Same flow as vLLM's
NixlConnector proxies (`do_remote_decode` / `do_remote_prefill`).

    python python/e2e/proxy.py --port 8000 --prefill http://10.0.0.1:8100 --decode http://10.0.0.2:8200

with the engines started as, e.g.

    vllm serve MODEL --port 8100 --kv-transfer-config \\
      '{"kv_connector":"KvxferConnector","kv_connector_module_path":"kvxfer_vllm","kv_role":"kv_producer"}'
    vllm serve MODEL --port 8200 --kv-transfer-config \\
      '{"kv_connector":"KvxferConnector","kv_connector_module_path":"kvxfer_vllm","kv_role":"kv_consumer"}'
"""

import argparse
import http.server
import json
import urllib.request

ROUTES = ("/v1/completions", "/v1/chat/completions")


def post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def disaggregate(prefill: str, decode: str, path: str, body: dict, timeout: float = 600.0) -> dict:
    """One request through both engines: prefill computes the prompt's KV and hands it over
    (one token, the params it returns), decode loads it and generates."""
    first = dict(body, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    first.pop("max_completion_tokens", None)
    if "min_tokens" in first:
        first["min_tokens"] = 0
    out = post(prefill + path, first, timeout)
    params = out.get("kv_transfer_params")
    if params is None and out.get("choices"):
        params = out["choices"][0].get("kv_transfer_params")
    if not isinstance(params, dict):
        raise ValueError(f"the prefill engine returned no kv_transfer_params: {str(out)[:200]}")
    return post(decode + path, dict(body, kv_transfer_params=params), timeout)


def serve(port: int, prefill: str, decode: str) -> http.server.ThreadingHTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - the stdlib's name
            if self.path not in ROUTES:
                self.send_error(404, "only /v1/completions and /v1/chat/completions")
                return
            try:
                n = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(n) or b"{}")
                reply = json.dumps(disaggregate(prefill, decode, self.path, body)).encode()
                self.send_response(200)
            except Exception as e:  # noqa: BLE001 - the client gets the error, the proxy goes on
                reply = json.dumps({"error": f"{type(e).__name__}: {e}"}).encode()
                self.send_response(502)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args):
            return

    return http.server.ThreadingHTTPServer(("0.0.0.0", port), Handler)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--prefill", required=True, help="the prefill engine's base URL")
    ap.add_argument("--decode", required=True, help="the decode engine's base URL")
    a = ap.parse_args()
    serve(a.port, a.prefill.rstrip("/"), a.decode.rstrip("/")).serve_forever()


if __name__ == "__main__":
    main()
