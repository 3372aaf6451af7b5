"""Causal tail attention on the `text` data against exact causal attention, one process.

Every head of MiniLM layer 5 over the standard library's sources (`benchmarks/text_data.py`,
131072 tokens, head dim 32, the model's scaled dot product). Per head:

- accuracy: 1024 random rows attend causally (row i over keys `[0, i]`) with
  `causal_tail_attention` (defaults: segments of 16384, 2 % of the earlier keys and at least
  2048 read exactly) and against the same rows' exact causal attention; recorded: median and p99
  relative output error, median absolute lse error. For comparison, the non-causal tail error of
  the same rows over the whole context (`tail_attention`, 2 %), the target causal tail is held to;
- speed (on `--timed-heads` heads): causal self-attention of all rows, `causal_tail_attention`
  against exact causal `dense_attention` (PyTorch's fused kernel), interleaved, the fastest of
  `--rounds` after a warm-up (`measure.best_times`).

Records `{"head", "causal": {...}, "noncausal": {...}, "causal_seconds", "dense_seconds"}` in
`benchmarks/results/causal_tail.json` and a PNG.

    .venv/bin/python benchmarks/causal_tail.py
    .venv/bin/python benchmarks/causal_tail.py --data overlapping --n 32768 --out /tmp/causal
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.data import DATASETS
from benchmarks.measure import best_times
from benchmarks.text_data import DEFAULT_LAYER, text_projections
from rewa.attention import dense_attention, make_geometry
from rewa.index import KeyClusters, causal_tail_attention, quality, tail_attention

RESULTS = Path(__file__).resolve().parent / "results"
BUDGET = 0.02
ROWS = 1024


def accuracy(q, k, v, geometry, rows) -> dict:
    n = k.shape[0]
    visible = torch.arange(n) <= rows.unsqueeze(-1)
    reference = dense_attention(q[rows], k, v, geometry, mask=visible)
    out, lse = causal_tail_attention(q[rows], k, v, geometry, rows, budget=BUDGET)
    causal = quality(out, lse, *reference)
    whole = dense_attention(q[rows], k, v, geometry)
    clusters = KeyClusters.build(geometry.witness(k), v, geometry)
    out, lse = tail_attention(q[rows], clusters, budget=BUDGET)
    return {"causal": causal, "noncausal": quality(out, lse, *whole)}


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4), layout="constrained")
    heads = [r["head"] for r in records]
    for key, colour, shift in (("causal", "tab:blue", -0.2), ("noncausal", "tab:gray", 0.2)):
        axis.bar([h + shift for h in heads], [r[key]["err_p99"] for r in records], 0.4,
                 color=colour, alpha=0.35, label=f"{key} tail, p99")  # fmt: skip
        axis.bar([h + shift for h in heads], [r[key]["err_median"] for r in records], 0.4,
                 color=colour, label=f"{key} tail, median")  # fmt: skip
    axis.axhline(0.05, color="black", linestyle=":", linewidth=1, label="target median 0.05")
    axis.axhline(0.15, color="black", linestyle="--", linewidth=1, label="target p99 0.15")
    axis.set_xticks(heads)
    axis.set_xlabel(f"MiniLM layer {DEFAULT_LAYER} head")
    axis.set_ylabel("relative output error")
    axis.set_title(f"Causal tail at {BUDGET:.0%} of earlier keys vs exact causal attention",
                   fontsize=10)  # fmt: skip
    axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="text", choices=["text", *DATASETS])
    parser.add_argument("--n", type=int, default=131072)
    parser.add_argument("--timed-heads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.data == "text":
        q, k, v = text_projections(args.n, layer=DEFAULT_LAYER)
        geometry = make_geometry("dot", q.shape[-1])
    else:  # one head of a synthetic data set
        data = DATASETS[args.data](args.n)
        q, k, v = data.q[None], data.k[None], data.v[None]
        geometry = data.geometry()
    rows = torch.randperm(args.n, generator=torch.Generator().manual_seed(0))[:ROWS].sort()[0]
    positions = torch.arange(args.n)
    records = []
    for head in range(q.shape[0]):
        with torch.no_grad():
            record = {"data": args.data, "head": head, "n": args.n, "budget": BUDGET}
            record |= accuracy(q[head], k[head], v[head], geometry, rows)
            if head < args.timed_heads:
                args_head = (q[head], k[head], v[head], geometry)
                seconds = best_times({
                    "causal": lambda a=args_head: causal_tail_attention(*a, positions),
                    "dense": lambda a=args_head: dense_attention(*a, causal=True),
                }, args.rounds)  # fmt: skip
                record |= {"causal_seconds": seconds["causal"], "dense_seconds": seconds["dense"]}
        print(json.dumps(record), flush=True)
        records.append(record)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "causal_tail.json").write_text(json.dumps(records, indent=1) + "\n")
    plot(records, args.out / "causal_tail.png")
    print("reproduce: .venv/bin/python benchmarks/causal_tail.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
