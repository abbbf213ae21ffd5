"""The seed deployment replayed with real engines: a prefill and a decode vLLM OpenAI server
per connector (KvxferConnector, and vLLM's NixlConnector over NIXL's UCX backend on host
memory), Qwen3-0.6B-shaped KV (28 layers x 8 KV heads x 128 x bf16 = 114,688 B a token),
2,371-token prompts (272 MB of KV each), every request through the disaggregating flow of
proxy.py (prefill with ``max_tokens`` 1, then decode with the params prefill returned),
at each concurrency; one connector's engines at a time, connectors alternated by engine start
(ABAB).

What each request gives:
- ``ttft_ms``: the client's time to first token (prefill answer + decode answer, max_tokens 1:
  the decode engine's one token is the first token the user sees);
- ``decode_ms``: the decode engine's answer time, which holds the handoff (the KV load) and the
  compute of the last prompt token;
- ``local_ms``: the same prompt sent again to the decode engine alone right after, one at a time
  (its blocks are then in its prefix cache: no handoff, the same last-token compute);
  ``handoff_ms`` = ``decode_ms`` - ``local_ms`` of the same request: the load and, at
  concurrency above 1, the wait behind the other requests' loads;
- ``same_token``: whether the decode engine's token equals the prefill engine's (both greedy,
  from the same KV; a seeded model of near-uniform logits can tie, so it is counted, not
  asserted), and ``same_token_alone``: equal to the prefill engine's token for the prompt sent
  to it again alone (a first answer from a batch of several can differ by bf16 arithmetic);
- ``local_cached``: the prompt tokens the local run found cached (a handoff that left blocks
  out shows here).
The engines' peak RSS (each server's whole process tree, sampled every 0.25 s) is kept per
connector and concurrency.

The model's KV is Qwen3-0.6B's; its hidden size, MLP and vocabulary are shrunk (256, 512,
1000) so that this CPU computes a prompt in under two seconds: they change the compute, never a
byte of KV. Run through scripts/vllm-replay.sh, which builds the library, sets up the venv and,
for ``--link 1gbe``, the namespaces; this driver runs inside the decode side's namespace there.
"""

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from disagg_e2e import save_checkpoint  # noqa: E402 - shared with the end-to-end check
from proxy import post  # noqa: E402 - the proxy's client, shared

PROMPT_TOKENS = 2371
KV_BYTES_PER_TOKEN = 28 * 2 * 8 * 128 * 2  # layers x (K, V) x KV heads x head size x bf16
BLOCK = 32  # the CPU attention backend takes multiples of 32
SEED_INHOST_MS = 250.0  # NIXL over UCX/TCP inside one server, per 272 MB handoff
SEED_1GBE_MS = (2300.0, 2500.0)  # across 1 GbE


def make_model(d):
    """Qwen3 with Qwen3-0.6B's KV geometry and seeded weights, bf16, as a HF checkpoint."""
    import torch
    import transformers

    cfg = transformers.Qwen3Config(
        num_hidden_layers=28, num_key_value_heads=8, head_dim=128,  # the KV: Qwen3-0.6B's
        num_attention_heads=8, hidden_size=256, intermediate_size=512, vocab_size=1000,
        max_position_embeddings=4096, tie_word_embeddings=True, rms_norm_eps=1e-6,
        rope_theta=1e6, initializer_range=0.02, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    save_checkpoint(transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16), d)


def transfer_config(conn, role, a):
    """The engine's --kv-transfer-config and extra environment, per connector and role."""
    side = a.prefill_dev if role == "kv_producer" else a.decode_dev
    if conn == "kvxfer":
        extra = json.loads(a.kvxfer_extra.replace("{role}", role))
        if a.link == "1gbe":
            # Across namespaces of one machine the shm lane would bypass the link.
            extra.update(transport="tcp", net_devices=side)
        cfg = {"kv_connector": "KvxferConnector", "kv_connector_module_path": "kvxfer_vllm",
               "kv_role": role, "kv_connector_extra_config": extra}
        return cfg, {}
    cfg = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    env = {}
    # UCX sees one machine across namespaces (its shared memory would bypass the link), and
    # the seed deployment ran NIXL over UCX's TCP: "nixl_tcp" in-host, always across the link.
    if conn == "nixl_tcp" or a.link == "1gbe":
        env["UCX_TLS"] = "tcp,self"
        if a.link == "1gbe":
            env["UCX_NET_DEVICES"] = side
    return cfg, env


class Engine:
    """One `vllm serve` process tree in its own session (killed as a group)."""

    def __init__(self, a, conn, role, port, nixl_port, log):
        host = a.prefill_host if role == "kv_producer" else a.decode_host
        cfg, env_extra = transfer_config(conn, role, a)
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE=str(a.kv_space_gib),
                   VLLM_NIXL_SIDE_CHANNEL_PORT=str(nixl_port), VLLM_NIXL_SIDE_CHANNEL_HOST=host,
                   VLLM_CPU_OMP_THREADS_BIND=a.prefill_cpus if role == "kv_producer" else a.decode_cpus,
                   **env_extra)
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", a.model,
               "--host", host, "--port", str(port), "--block-size", str(BLOCK), "--enforce-eager",
               "--max-model-len", "4096", "--skip-tokenizer-init", "--seed", "0",
               "--enable-prompt-tokens-details", "--max-num-seqs", "8",
               "--kv-transfer-config", json.dumps(cfg)]
        if role == "kv_producer" and a.prefill_ns:
            cmd = ["ip", "netns", "exec", a.prefill_ns] + cmd
        self.name = f"{conn}-{'prefill' if role == 'kv_producer' else 'decode'}"
        self.url = f"http://{host}:{port}"
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_up(self, timeout=300):
        end = time.time() + timeout
        while time.time() < end:
            if self.proc.poll() is not None:
                sys.exit(f"replay: {self.name} exited ({self.proc.returncode}); see {self.log.name}")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=1).read()
                return
            except OSError:
                time.sleep(1)
        sys.exit(f"replay: {self.name} not up in {timeout} s; see {self.log.name}")

    def _stats(self):
        """(pid, fields after the command) of every process in the engine's session."""
        out = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[3]) == self.proc.pid:  # field 6 (session id), after pid and comm
                    out.append((pid, fields))
            except (OSError, IndexError, ValueError):
                continue
        return out

    def rss(self):
        """Resident bytes of every process in the engine's session."""
        total = 0
        for pid, _ in self._stats():
            try:
                with open(f"/proc/{pid}/statm") as f:
                    total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            except (OSError, IndexError, ValueError):
                continue
        return total

    def cpu_share(self, seconds):
        """Cores the engine's processes keep busy over `seconds` (user + system time)."""
        def ticks():
            return sum(int(f[11]) + int(f[12]) for _, f in self._stats())  # utime, stime
        t0 = ticks()
        time.sleep(seconds)
        return (ticks() - t0) / os.sysconf("SC_CLK_TCK") / seconds

    def stop(self):
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.log.close()


class RssSampler(threading.Thread):
    """Peak RSS per engine and phase."""

    def __init__(self, engines, peak):
        super().__init__(daemon=True)
        self.engines, self.phase, self.peak, self.done = engines, "start", peak, False

    def run(self):
        while not self.done:
            for e in self.engines:
                key = (self.phase, e.name)
                self.peak[key] = max(self.peak.get(key, 0), e.rss())
            time.sleep(0.25)


def completion(url, model, ids, params=None):
    body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0.0,
            "return_token_ids": True}
    if params is not None:
        body["kv_transfer_params"] = params
    t = time.perf_counter()
    out = post(url + "/v1/completions", body, 600.0)
    ms = (time.perf_counter() - t) * 1e3
    details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
    return out, ms, out["choices"][0]["token_ids"][0], details.get("cached_tokens") or 0


def disaggregated(pair, model, ids):
    prefill, decode = pair
    out, prefill_ms, p_tok, _ = completion(prefill.url, model, ids, {"do_remote_decode": True})
    params = out.get("kv_transfer_params")
    if not isinstance(params, dict):
        raise RuntimeError(f"{prefill.name} returned no kv_transfer_params")
    _, decode_ms, d_tok, _ = completion(decode.url, model, ids, params)
    return {"prefill_ms": prefill_ms, "decode_ms": decode_ms, "ttft_ms": prefill_ms + decode_ms,
            "same_token": p_tok == d_tok, "decode_token": d_tok}


def batch(fn, args_list):
    """Runs fn(*args) for each at once; returns the results in order, raising the first error."""
    out, errs = [None] * len(args_list), []

    def run(i, args):
        try:
            out[i] = fn(*args)
        except Exception as e:  # noqa: BLE001 - reported below
            errs.append(e)

    ts = [threading.Thread(target=run, args=(i, x)) for i, x in enumerate(args_list)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errs:
        raise errs[0]
    return out


def pct(xs, p):
    """Nearest-rank percentile (with few samples, p99 is the largest)."""
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, -(-len(s) * p // 100) - 1))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a directory; the model is written if empty")
    ap.add_argument("--out", required=True)
    ap.add_argument("--link", choices=("inhost", "1gbe"), default="inhost")
    ap.add_argument("--connectors", default="kvxfer,nixl")
    ap.add_argument("--conc", default="1,4")
    ap.add_argument("--sessions", type=int, default=2, help="engine starts per connector")
    ap.add_argument("--rounds", type=int, default=4, help="rounds per concurrency and session")
    ap.add_argument("--kv-space-gib", type=int, default=2)
    ap.add_argument("--kvxfer-extra", default="{}", help="more kv_connector_extra_config (JSON)")
    ap.add_argument("--prefill-host", default="127.0.0.1")
    ap.add_argument("--decode-host", default="127.0.0.1")
    ap.add_argument("--prefill-dev", default="lo")
    ap.add_argument("--decode-dev", default="lo")
    # vLLM's CPU workers bind their threads (and every thread they start, kvxfer's and NIXL's
    # included) to cores; by default every engine takes the same ones. Two servers as in a
    # deployment: the prefill engines on one set, the decode engines on another.
    ap.add_argument("--prefill-cpus", default="0")
    ap.add_argument("--decode-cpus", default="1")
    ap.add_argument("--prefill-ns", default="", help="run the prefill engines in this netns")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if not os.path.exists(os.path.join(a.model, "config.json")):
        make_model(a.model)
    conns = a.connectors.split(",")
    concs = [int(x) for x in a.conc.split(",")]
    rng = random.Random(f"replay-{a.link}")
    rows, peak, idle = [], {}, {}
    jl = open(os.path.join(a.out, f"replay-engines-{a.link}.jsonl"), "w")
    # One connector's engines at a time (an idle NIXL engine keeps two threads a worker busy,
    # which would slow the other connector's run), connectors alternated session by session.
    for session in range(a.sessions):
        for c in conns if session % 2 == 0 else conns[::-1]:
            pair = [Engine(a, c, role, 8100 + i, 5600 + i,
                           os.path.join(a.out, f"{a.link}-{c}-{role}-{session}.log"))
                    for i, role in enumerate(("kv_producer", "kv_consumer"))]
            try:
                for e in pair:
                    e.wait_up()
                for _ in range(2):  # first-request set-up (connections, kernels), not counted
                    disaggregated(pair, a.model, prompt(rng))
                time.sleep(3)
                for e in pair:  # what the connector costs while nothing is asked of it
                    idle.setdefault((c, e.name), []).append(e.cpu_share(5.0))
                sampler = RssSampler(pair, peak)
                sampler.start()
                for conc in concs:
                    sampler.phase = f"{c}/{conc}"
                    for r in range(a.rounds):
                        ids = [prompt(rng) for _ in range(conc)]
                        res = batch(lambda x: disaggregated(pair, a.model, x), [(x,) for x in ids])
                        # One at a time: the decode engine's own time for the prompt, with
                        # no handoff and no queue (a queue behind concurrent loads is the
                        # handoff's cost).
                        local = [completion(pair[1].url, a.model, x) for x in ids]
                        # The prefill engine's token again, alone (its batch of 1): where the
                        # first answer came from a batch of several, bf16 sums differ.
                        again = [completion(pair[0].url, a.model, x) for x in ids]
                        for x, l, g in zip(res, local, again):
                            x.update(connector=c, link=a.link, conc=conc, session=session, round=r,
                                     local_ms=l[1], local_cached=l[3], handoff_ms=x["decode_ms"] - l[1],
                                     same_token_alone=x.pop("decode_token") == g[2])
                            rows.append(x)
                            jl.write(json.dumps(x) + "\n")
                        jl.flush()
                sampler.done = True
                sampler.join()
            finally:
                for e in pair:
                    e.stop()
    jl.close()
    write_table(a, conns, rows, peak, idle)


def prompt(rng):
    return [rng.randrange(3, 1000) for _ in range(PROMPT_TOKENS)]


def write_table(a, conns, rows, peak, idle):
    mb = PROMPT_TOKENS * KV_BYTES_PER_TOKEN / 1e6
    lines = [
        f"Link {a.link}; {PROMPT_TOKENS}-token prompts ({mb:.0f} MB of KV each); ms, medians "
        "(p50) and nearest-rank p99 over n requests; connectors alternated by engine session "
        "(ABAB); idle: cores each engine keeps busy with nothing asked (median over sessions).",
        "",
        "| connector | conc | n | TTFT p50 | TTFT p99 | prefill p50 | decode p50 | handoff p50 "
        "| handoff p99 | local p50 | same token (alone) | cached (local) | prefill RSS peak | decode RSS peak "
        "| idle cores prefill / decode |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for conc in sorted({r["conc"] for r in rows}):
        for c in conns:
            rs = [r for r in rows if r["connector"] == c and r["conc"] == conc]
            if not rs:
                continue
            g = {k: [r[k] for r in rs] for k in rs[0]}
            pk = {role: peak.get((f"{c}/{conc}", f"{c}-{role}"), 0) / 2**20
                  for role in ("prefill", "decode")}
            lines.append(
                f"| {c} | {conc} | {len(rs)} | {statistics.median(g['ttft_ms']):.0f} "
                f"| {pct(g['ttft_ms'], 99):.0f} | {statistics.median(g['prefill_ms']):.0f} "
                f"| {statistics.median(g['decode_ms']):.0f} | {statistics.median(g['handoff_ms']):.0f} "
                f"| {pct(g['handoff_ms'], 99):.0f} | {statistics.median(g['local_ms']):.0f} "
                f"| {sum(g['same_token'])}/{len(rs)} ({sum(g['same_token_alone'])}) | {min(g['local_cached'])}-{max(g['local_cached'])} "
                f"| {pk['prefill']:.0f} MiB | {pk['decode']:.0f} MiB "
                f"| {statistics.median(idle[(c, c + '-prefill')]):.2f} / "
                f"{statistics.median(idle[(c, c + '-decode')]):.2f} |")
    seed = SEED_INHOST_MS if a.link == "inhost" else SEED_1GBE_MS
    lines += ["", f"The seed deployment (NIXL over UCX/TCP, per 272 MB handoff): {seed} ms."]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(a.out, f"replay-engines-{a.link}.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
