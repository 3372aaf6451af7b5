"""How index builds and sparse attention grow with the context, at the defaults a user gets.

For N = 16384, 32768, ..., 1048576 keys (d = 64, one head) of `clustered` and `overlapping`
(benchmarks/data.py), 4096 queries attend to the N keys, one process, no gradient:

- `ivf`: `build_index(k, g, "ivf")` (FAISS IVF, `default_lists(P)` lists trained on the
  trained prefix P: P / 256 up to 131072 keys, sqrt(2 P) beyond; nprobe 8), then
  `retrieval_attention` at its defaults (every key of the probed lists); top-64 recall and
  attention-mass recall of the probed keys, and the median and p99 relative output error
  against exact attention, on 256 queries;
- `tail`: `KeyClusters.build` (N / 512 clusters), then `tail_attention` at 2 % of the keys;
  median and p99 relative output error against exact attention on 256 queries;
- `sdpa`: PyTorch's scaled_dot_product_attention of the same 4096 queries over all N keys, 512
  queries at a time (its CPU path materialises the attention matrix).

Builds and attends are timed three times and their medians recorded (one run at a time is
noisy on a shared machine); SDPA runs once. Each record: `{"dataset", "n", "method",
"build_seconds", "attend_seconds", "total_seconds", "peak_rss_bytes", ...quality}`;
`per_doubling` in the report is a size's total over the previous size's. Written to
`benchmarks/results/scaling.json` with a PNG.

    .venv/bin/python benchmarks/scaling.py
    .venv/bin/python benchmarks/scaling.py --sizes 16384 32768 --out /tmp/scaling
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.data import DATASETS
from benchmarks.measure import peak_rss_bytes, reset_peak_rss
from rewa.attention import dense_attention
from rewa.index import (
    KeyClusters,
    build_index,
    exact_topk,
    mass_recall,
    output_error,
    retrieval_attention,
    summary,
    tail_attention,
    topk_recall,
)
from rewa.index.ivf_blocks import probed_keys

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = [1 << p for p in range(14, 21)]
QUERIES, CHECKED, TOP_K, BUDGET = 4096, 256, 64, 0.02
REPEATS = 3  # builds and attends: the median of 3 runs, SDPA (the reference) runs once
SDPA_BLOCK = 512


def blocked_sdpa(q, k, v, scale: float) -> torch.Tensor:
    """SDPA in blocks of `SDPA_BLOCK` queries: on the CPU its attention matrix is materialised,
    (4096 x 1M) floats would not fit in memory."""
    return torch.cat([
        F.scaled_dot_product_attention(block[None], k[None], v[None], scale=scale)[0]
        for block in q.split(SDPA_BLOCK)
    ])  # fmt: skip


def timed(fn, repeats: int = 1):
    """`fn()`'s last result and its median time over `repeats` calls (only the last result is
    kept alive)."""
    seconds = []
    for _ in range(repeats):
        result = None  # the previous run's result is freed before the next one starts
        start = time.perf_counter()
        result = fn()
        seconds.append(time.perf_counter() - start)
    return result, statistics.median(seconds)


def measure(dataset: str, n: int) -> list[dict]:
    data = DATASETS[dataset](n)
    g = data.geometry()
    q, k, v = data.q[:QUERIES], data.k, data.v
    checked = q[:CHECKED]
    base = {"dataset": dataset, "n": n, "queries": QUERIES}
    reference_out, reference_lse = dense_attention(checked, k, v, g)
    exact = exact_topk(checked, k, g, TOP_K)
    records = []

    reset_peak_rss()
    index, build = timed(lambda: build_index(k, g, "ivf"), REPEATS)
    _, attend = timed(lambda: retrieval_attention(q, k, v, g, index=index), REPEATS)
    out, _ = retrieval_attention(checked, k, v, g, index=index)
    error = summary(output_error(out, reference_out))
    candidates = probed_keys(index, g.witness(checked))
    records.append(base | {
        "method": "ivf", "build_seconds": build, "attend_seconds": attend,
        "total_seconds": build + attend, "peak_rss_bytes": peak_rss_bytes(),
        "topk_recall": topk_recall(candidates, exact).mean().item(),
        "mass_recall": mass_recall(checked, k, g, candidates, reference_lse).mean().item(),
        "err_median": error["median"], "err_p99": error["p99"],
    })  # fmt: skip
    index = None  # freed before the next method

    reset_peak_rss()
    clusters, build = timed(lambda: KeyClusters.build(g.witness(k), v, g), REPEATS)
    _, attend = timed(lambda: tail_attention(q, clusters, budget=BUDGET), REPEATS)
    out, _ = tail_attention(checked, clusters, budget=BUDGET)
    error = summary(output_error(out, reference_out))
    records.append(base | {
        "method": "tail", "build_seconds": build, "attend_seconds": attend,
        "total_seconds": build + attend, "peak_rss_bytes": peak_rss_bytes(),
        "err_median": error["median"], "err_p99": error["p99"],
    })  # fmt: skip
    clusters = None

    reset_peak_rss()
    _, attend = timed(lambda: blocked_sdpa(q, k, v, g.scale))
    records.append(base | {
        "method": "sdpa", "build_seconds": 0.0, "attend_seconds": attend,
        "total_seconds": attend, "peak_rss_bytes": peak_rss_bytes(),
    })  # fmt: skip
    for record in records:
        print(json.dumps(record), flush=True)
    return records


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    datasets = sorted({r["dataset"] for r in records})
    figure, axes = plt.subplots(1, len(datasets), figsize=(5 * len(datasets), 4),
                                layout="constrained", squeeze=False)  # fmt: skip
    styles = {"ivf": ("tab:blue", "o"), "tail": ("tab:green", "s"), "sdpa": ("tab:gray", "^")}
    for axis, dataset in zip(axes[0], datasets, strict=True):
        for method, (colour, marker) in styles.items():
            rows = [r for r in records if r["dataset"] == dataset and r["method"] == method]
            sizes = [r["n"] for r in rows]
            label = "sdpa" if method == "sdpa" else f"{method} build + attend"
            axis.plot(sizes, [r["total_seconds"] for r in rows], marker=marker, color=colour,
                      label=label)  # fmt: skip
            if method != "sdpa":
                axis.plot(sizes, [r["build_seconds"] for r in rows], marker=marker,
                          color=colour, linestyle=":", label=f"{method} build")  # fmt: skip
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("keys N")
        axis.set_ylabel(f"seconds ({QUERIES} queries)")
        axis.set_title(dataset, fontsize=10)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=SIZES)
    parser.add_argument("--datasets", nargs="+", default=["clustered", "overlapping"])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.manual_seed(0)
    records = []
    with torch.no_grad():
        for dataset in args.datasets:
            for n in args.sizes:
                records.extend(measure(dataset, n))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scaling.json").write_text(json.dumps(records, indent=1) + "\n")
    plot(records, args.out / "scaling.png")
    print("reproduce: .venv/bin/python benchmarks/scaling.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
