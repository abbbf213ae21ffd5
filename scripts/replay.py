#!/usr/bin/env python3
"""Replay of the motivating deployment: prefill and decode workers in two processes
(examples/disagg), Qwen3-0.6B-shaped caches (2,371-token prompts = 273 MB of KV), the prefill's
compute modelled as a sleep (a GPU spends it, not this CPU), every block's stamps checked
outside the timed window, over the grid prefix-hit x concurrency x transport.

    scripts/replay.py [--out DIR] [--compute-ms 100] [--hits 0.857,0.4,0.2,0]
                      [--conc 1,4,8] [--transports shm,tcp] [--check stamp|full]

Writes DIR/replay.jsonl (one line per point, the example's JSON), DIR/replay.md (the table)
and DIR/replay.svg (handoff p50 and p99 against concurrency, one line per prefix hit and
transport, beside the seed deployment's figures). Needs the example built:
    cargo build --release --example disagg   (scripts/ucx-env.sh sourced)
"""

import argparse
import json
import os
import subprocess
import sys

SEED_INHOST_MS = 250.0  # NIXL over UCX/TCP inside one server, per 272 MB handoff
SEED_1GBE_MS = (2300.0, 2500.0)  # across 1 GbE


def run_point(exe, transport, hit, conc, compute_ms, check, requests):
    cmd = [
        exe, "--transport", transport, "--prefix-hit", str(hit), "--concurrency", str(conc),
        "--requests", str(requests), "--compute-ms", str(compute_ms), "--check", check,
        "--budget-mib", "512", "--json",
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        sys.exit(f"replay: {' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-2000:]}")
    line = [l for l in p.stdout.splitlines() if l.startswith("{")][-1]
    return json.loads(line)


def svg(points, path):
    import math

    W, H, L, R, T, B = 760, 460, 70, 230, 30, 50
    xs = sorted({p["concurrency"] for p in points})
    ys = [p["handoff_ms_p99"] for p in points] + [p["handoff_ms_median"] for p in points]
    ys += [SEED_INHOST_MS, *SEED_1GBE_MS]
    lo = 10 ** math.floor(math.log10(max(min(ys), 0.1)))
    hi = 10 ** math.ceil(math.log10(max(ys)))

    def X(c):
        i = xs.index(c)
        return L + (W - L - R) * (i / max(1, len(xs) - 1))

    def Y(v):
        v = max(v, lo)
        return T + (H - T - B) * (1 - (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo)))

    colors = ["#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d", "#666"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{L}" y="18" font-size="14">kvxfer handoff of a 2,371-token Qwen3-0.6B prompt (273 MB full) vs concurrency</text>']
    d = math.log10(lo)
    while d <= math.log10(hi) + 1e-9:
        v = 10 ** d
        out.append(f'<line x1="{L}" x2="{W-R}" y1="{Y(v):.1f}" y2="{Y(v):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{L-6}" y="{Y(v)+4:.1f}" text-anchor="end">{v:g} ms</text>')
        d += 1
    for c in xs:
        out.append(f'<text x="{X(c):.1f}" y="{H-B+18}" text-anchor="middle">{c}</text>')
    out.append(f'<text x="{(L+W-R)/2}" y="{H-12}" text-anchor="middle">requests handed off concurrently</text>')
    # The seed deployment's figures.
    out.append(f'<line x1="{L}" x2="{W-R}" y1="{Y(SEED_INHOST_MS):.1f}" y2="{Y(SEED_INHOST_MS):.1f}" stroke="black" stroke-dasharray="2,3"/>')
    out.append(f'<text x="{W-R+6}" y="{Y(SEED_INHOST_MS)+4:.1f}">seed: NIXL in-host ~250 ms</text>')
    y1, y2 = Y(SEED_1GBE_MS[1]), Y(SEED_1GBE_MS[0])
    out.append(f'<rect x="{L}" y="{y1:.1f}" width="{W-L-R}" height="{max(1, y2-y1):.1f}" fill="#bbb" opacity="0.5"/>')
    out.append(f'<text x="{W-R+6}" y="{y1+4:.1f}">seed: 1 GbE 2.3-2.5 s</text>')
    series = sorted({(p["transport"], p["prefix_hit"]) for p in points}, key=lambda s: (s[0], -s[1]))
    for i, (t, h) in enumerate(series):
        col = colors[i % len(colors)]
        pts = sorted((p for p in points if p["transport"] == t and p["prefix_hit"] == h), key=lambda p: p["concurrency"])
        for key, dash in (("handoff_ms_median", ""), ("handoff_ms_p99", ' stroke-dasharray="5,3"')):
            path_d = " ".join(f'{"M" if j == 0 else "L"}{X(p["concurrency"]):.1f},{Y(p[key]):.1f}' for j, p in enumerate(pts))
            out.append(f'<path d="{path_d}" fill="none" stroke="{col}" stroke-width="2"{dash}/>')
        for p in pts:
            out.append(f'<circle cx="{X(p["concurrency"]):.1f}" cy="{Y(p["handoff_ms_median"]):.1f}" r="3" fill="{col}"/>')
        ly = T + 40 + 16 * i
        out.append(f'<line x1="{W-R+6}" x2="{W-R+26}" y1="{ly}" y2="{ly}" stroke="{col}" stroke-width="2"/>')
        out.append(f'<text x="{W-R+30}" y="{ly+4}">{t}, prefix hit {h:g}</text>')
    ly = T + 40 + 16 * len(series) + 8
    out.append(f'<text x="{W-R+6}" y="{ly}">solid: p50, dashed: p99</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="target/replay")
    ap.add_argument("--exe", default=os.path.join(os.environ.get("CARGO_TARGET_DIR", "target"), "release/examples/disagg"))
    ap.add_argument("--compute-ms", type=float, default=100.0)
    ap.add_argument("--hits", default="0.857,0.4,0.2,0")
    ap.add_argument("--conc", default="1,4,8")
    ap.add_argument("--transports", default="shm,tcp")
    ap.add_argument("--check", default="stamp")
    ap.add_argument("--rounds", type=int, default=4, help="requests per slot")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    points = []
    with open(os.path.join(a.out, "replay.jsonl"), "w") as jf:
        for t in a.transports.split(","):
            for h in (float(x) for x in a.hits.split(",")):
                for c in (int(x) for x in a.conc.split(",")):
                    p = run_point(a.exe, t, h, c, a.compute_ms, a.check, max(8, a.rounds * c))
                    points.append(p)
                    jf.write(json.dumps(p) + "\n")
                    jf.flush()
                    print(f"{t} hit {h:g} conc {c}: p50 {p['handoff_ms_median']:.1f} ms p99 {p['handoff_ms_p99']:.1f} ms", file=sys.stderr)
    rows = ["| transport | prefix hit | concurrency | MB moved / request | handoff p50 ms | p99 ms | loads in flight | link GB/s | p50 / (in-flight bytes / rate alone) | peak RSS beyond caches MiB (decode / prefill) | verified |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        alone = next((q for q in points if q["transport"] == p["transport"] and q["prefix_hit"] == p["prefix_hit"] and q["concurrency"] == 1), None)
        per_req = p["bytes_moved"] / p["requests"]
        ratio = ""
        if alone and alone["link_bytes_per_s"] > 0:
            ideal_ms = p["loads_in_flight_mean"] * per_req / alone["link_bytes_per_s"] * 1e3
            ratio = f"{p['handoff_ms_median'] / ideal_ms:.2f}"
        rows.append(f"| {p['transport']} | {p['prefix_hit']:g} | {p['concurrency']} | {per_req/1e6:.1f} | {p['handoff_ms_median']:.1f} | {p['handoff_ms_p99']:.1f} | {p['loads_in_flight_mean']:.2f} | {p['link_bytes_per_s']/1e9:.2f} | {ratio} | {p['peak_rss_extra_decode_mib']:.0f} / {p['peak_rss_extra_prefill_mib']:.0f} | {p['verified']} |")
    table = "\n".join(rows)
    with open(os.path.join(a.out, "replay.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    svg(points, os.path.join(a.out, "replay.svg"))
    print(f"wrote {a.out}/replay.jsonl, replay.md, replay.svg", file=sys.stderr)


if __name__ == "__main__":
    main()
