"""The CUDA paths against PyTorch's SDPA on one GPU, in one process, interleaved.

- `dense`: exact self-attention of each geometry (the fused kernel of attention/cuda_kernel.py;
  the dot product through SDPA's own kernel) and SDPA, float32, one head, d = 64, N in 8192,
  32768 and 131072; fastest of 5 interleaved rounds.
- `sparse`: 131072-token self-attention with `retrieval_attention` at its defaults (IVF index,
  every key of the probed lists, index build included; the lists trained on the GPU, in
  PyTorch unless a GPU build of FAISS is installed) on the `clustered` data set, against SDPA
  over the same tensors; top-64 recall, attention-mass recall and output error on 2048
  queries; fastest of 3 interleaved rounds, with the build's and the attention's own times.
- `decode`: one decode step of one layer over 131072 keys: 32 query heads over 8 key/value heads
  (4 queries per key/value head), d = 128, `tail_attention_heads` (every head in one call, as
  the service calls it) at 1 % of the keys over cluster statistics built beforehand (untimed;
  the build's time is recorded), against SDPA over the same keys; median of 50 interleaved
  steps, and the output error against exact attention. The tail step three ways: `tail`, the
  default (the fixed-shape step replayed as a CUDA graph, index/tail/fixed_step.py),
  `tail-eager` (the same operations launched one by one) and `tail-batched` (the batched
  stages).

Writes `benchmarks/results/gpu-<device>.json` (every record names the device too) and
`gpu-<device>.png`, e.g. `gpu-nvidia-h200.json`.

    python benchmarks/gpu.py                      # needs CUDA
    python benchmarks/gpu.py --sections dense --sizes 8192 --out /tmp/gpu
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from unittest.mock import patch

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.data import clustered
from benchmarks.sparse import K, candidate_rows, errors
from rewa.attention import dense_attention, make_geometry
from rewa.index import (
    ClusterHeads,
    KeyClusters,
    build_index,
    exact_topk,
    mass_recall,
    output_error,
    retrieval_attention,
    topk_recall,
)
from rewa.index.tail import fixed_step as fixed_step_module
from rewa.index.tail import tail_attention_heads

RESULTS = Path(__file__).resolve().parent / "results"
CUDA = torch.device("cuda")
DENSE_GEOMETRIES = ["dot", "euclidean", "sphere", "poincare", "kappa", "product"]
DEFAULT_SIZES = [8192, 32768, 131072]
SAMPLE = 2048


def seconds(fn: Callable[[], object]) -> float:
    """Wall seconds of `fn()` with the GPU's queue drained before and after."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def fastest(methods: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """The fastest of `rounds` interleaved rounds of every method (after one untimed call)."""
    for fn in methods.values():
        fn()
    best = dict.fromkeys(methods, float("inf"))
    for _ in range(rounds):
        for name, fn in methods.items():
            best[name] = min(best[name], seconds(fn))
    return best


def dense_records(sizes: list[int], d: int = 64) -> list[dict]:
    geometries = {name: make_geometry(name, d).to(CUDA) for name in DENSE_GEOMETRIES}
    records = []
    for n in sizes:
        generator = torch.Generator(device=CUDA).manual_seed(n)
        q, k, v = (torch.randn(1, 1, n, d, device=CUDA, generator=generator) for _ in range(3))
        methods = {"sdpa": lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v)}
        for name, geometry in geometries.items():
            methods[name] = lambda q=q, k=k, v=v, g=geometry: dense_attention(q, k, v, g)
        with torch.no_grad():
            best = fastest(methods, rounds=5)
        for name, value in best.items():
            records.append(
                {
                    "section": "dense",
                    "method": name,
                    "n": n,
                    "d": d,
                    "seconds": round(value, 6),
                    "vs_sdpa": round(value / best["sdpa"], 3),
                }
            )
            print(json.dumps(records[-1]), flush=True)
    return records


def sparse_records(n: int = 131072) -> list[dict]:
    data = clustered(n)
    geometry = data.geometry().to(CUDA)
    q, k, v = (t.to(CUDA) for t in (data.q, data.k, data.v))
    outputs = {}
    attend_seconds = []

    def rewa() -> None:
        index = build_index(k, geometry, "ivf")
        torch.cuda.synchronize()
        built = time.perf_counter()
        outputs["rewa-ivf"] = retrieval_attention(q, k, v, geometry, index=index)[0]
        torch.cuda.synchronize()
        attend_seconds.append(time.perf_counter() - built)
        outputs["index"] = index

    def sdpa() -> None:
        outputs["sdpa"] = F.scaled_dot_product_attention(
            q[None, None], k[None, None], v[None, None]
        )

    with torch.no_grad():
        best = fastest({"sdpa": sdpa, "rewa-ivf": rewa}, rounds=3)
        attend = min(attend_seconds)
        rows = torch.arange(SAMPLE, device=CUDA)
        reference, reference_lse = dense_attention(q[rows], k, v, geometry)
        exact = exact_topk(q[rows], k, geometry, K)
        sample = candidate_rows(outputs["index"], geometry, q[rows]).to(CUDA)
        quality = {
            "topk_recall": round(topk_recall(sample, exact).float().mean().item(), 4),
            "mass_recall": round(
                mass_recall(q[rows], k, geometry, sample, reference_lse).median().item(), 4
            ),
            **errors(output_error(outputs["rewa-ivf"][rows], reference).cpu()),
        }
    records = []
    for name, value in best.items():
        record = {"section": "sparse", "method": name, "n": n, "d": data.q.shape[1], "k": K}
        record |= {"seconds": round(value, 6), "vs_sdpa": round(value / best["sdpa"], 3)}
        if name == "rewa-ivf":
            record |= {"attend_seconds": round(attend, 6), **quality}
        records.append(record)
        print(json.dumps(record), flush=True)
    return records


def decode_records(
    n: int = 131072, d: int = 128, kv_heads: int = 8, group: int = 4, budget: float = 0.01
) -> list[dict]:
    geometry = make_geometry("dot", d).to(CUDA)
    data = [clustered(n, d=d, seed=head) for head in range(kv_heads)]
    keys = torch.stack([h.k for h in data]).to(CUDA)  # (kv_heads, n, d)
    values = torch.stack([h.v for h in data]).to(CUDA)
    steps = 50
    queries = torch.stack([h.q[: steps * group] for h in data]).to(CUDA)  # (kv_heads, ...)
    with torch.no_grad():
        torch.cuda.synchronize()
        start = time.perf_counter()
        clusters = [
            KeyClusters.build(geometry.witness(keys[h]), values[h], geometry)
            for h in range(kv_heads)
        ]
        torch.cuda.synchronize()
        build_seconds = time.perf_counter() - start
    heads = ClusterHeads.stacked(clusters)

    def step_queries(step: int) -> torch.Tensor:
        return queries[:, step * group : (step + 1) * group]  # (kv_heads, group, d)

    def tail_step(step: int) -> torch.Tensor:
        return tail_attention_heads(step_queries(step), heads, budget=budget)[0]

    def sdpa_step(step: int) -> torch.Tensor:
        return F.scaled_dot_product_attention(step_queries(step)[None], keys[None], values[None])

    # The tail step three ways: the default (the fixed-shape step replayed as a CUDA graph),
    # the same operations launched one by one, and the batched stages.
    settings = {
        "tail": {},
        "tail-eager": {"USE_GRAPHS": False},
        "tail-batched": {"FIXED_STEP_ROWS": 0},
    }
    methods = {"sdpa": sdpa_step} | dict.fromkeys(settings, tail_step)
    times = {name: [] for name in methods}
    outputs = {}

    def set_for(name: str):
        """The fixed-shape step's settings of method `name`, for the block."""
        values = settings.get(name)
        return patch.multiple(fixed_step_module, **values) if values else contextlib.nullcontext()

    with torch.no_grad():
        for name, fn in methods.items():  # untimed first calls (the graph's capture)
            with set_for(name):
                outputs[name] = fn(0)
        for step in range(steps):
            for name, fn in methods.items():
                with set_for(name):
                    times[name].append(seconds(lambda fn=fn, step=step: fn(step)))
        exact = dense_attention(step_queries(0), keys, values, geometry)[0]
    median = {name: statistics.median(values) for name, values in times.items()}
    records = []
    for name, value in median.items():
        record = {
            "section": "decode",
            "method": name,
            "n": n,
            "d": d,
            "query_heads": kv_heads * group,
            "kv_heads": kv_heads,
            "seconds_per_layer": round(value, 6),
            "vs_sdpa": round(value / median["sdpa"], 3),
        }
        if name != "sdpa":
            error = output_error(outputs[name].flatten(0, 1), exact.flatten(0, 1)).cpu()
            record |= {"budget": budget, "build_seconds": round(build_seconds, 3), **errors(error)}
        records.append(record)
        print(json.dumps(record), flush=True)
    return records


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    device = records[0]["device"] if records else "GPU"
    fig, (dense, other) = plt.subplots(1, 2, figsize=(13, 5))
    dense_rows = [r for r in records if r["section"] == "dense" and r["method"] != "sdpa"]
    sizes = sorted({r["n"] for r in dense_rows})
    methods = [m for m in DENSE_GEOMETRIES if any(r["method"] == m for r in dense_rows)]
    width = 0.8 / max(len(methods), 1)
    for i, method in enumerate(methods):
        ratios = [
            next((r["vs_sdpa"] for r in dense_rows if r["method"] == method and r["n"] == n), 0)
            for n in sizes
        ]
        dense.bar([j + i * width for j in range(len(sizes))], ratios, width, label=method)
    dense.axhline(1.0, color="black", linewidth=1, label="SDPA")
    dense.axhline(1.5, color="grey", linestyle="--", linewidth=1, label="target 1.5x SDPA")
    dense.set_xticks([j + 0.4 - width / 2 for j in range(len(sizes))], [str(n) for n in sizes])
    dense.set(xlabel="tokens N (self-attention, d = 64)", ylabel="time / SDPA time")
    dense.set_title(f"Exact dense attention, float32, {device}", fontsize=10)
    dense.legend(fontsize=8, ncol=2)
    labels, ratios = [], []
    for r in records:
        if r["section"] in ("sparse", "decode") and r["method"] != "sdpa":
            labels.append(f"{r['section']} {r['method']}\nN={r['n']}")
            ratios.append(r["vs_sdpa"])
    other.bar(range(len(labels)), ratios, color="tab:blue")
    other.axhline(1.0, color="black", linewidth=1, label="SDPA")
    other.set_xticks(range(len(labels)), labels, fontsize=8)
    other.set(ylabel="time / SDPA time")
    other.set_title("Sparse self-attention and one tail decode step", fontsize=10)
    other.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


SECTIONS = {"dense": dense_records, "sparse": sparse_records, "decode": decode_records}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS))
    parser.add_argument("--sizes", type=int, nargs="+", default=DEFAULT_SIZES)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py needs a CUDA device")
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    stem = "gpu-" + re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    records = []
    for section in args.sections:
        try:
            rows = dense_records(args.sizes) if section == "dense" else SECTIONS[section]()
        except Exception:  # one failed section still leaves the others' numbers
            traceback.print_exc()
            continue
        records += [{"device": device, **row} for row in rows]
        # written after every section, so that a run cut short keeps what it measured
        (args.out / f"{stem}.json").write_text(json.dumps(records, indent=1) + "\n")
    plot(records, args.out / f"{stem}.png")
    print(f"wrote {args.out / stem}.json and .png")
    print("reproduce: python benchmarks/gpu.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
