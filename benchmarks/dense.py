"""Exact dense attention: rewa's geometries against PyTorch's scaled_dot_product_attention.

One process, the same data for every method, one head, d = 64, no gradient, on the CPU. For each
N and thread count, every method runs once first (`first_call_seconds`; where that call starts
the compilation of a geometry's CPU tiles, attention/cpu_kernel.py, it runs uncompiled, and the
script then waits for the compilation, `compile_wait_seconds`; Inductor's cache starts empty
unless TORCHINDUCTOR_CACHE_DIR is set), then the fastest of `--rounds` interleaved rounds counts
(the machine's speed drifts; interleaving keeps the ratios fair). Records `{"method",
"geometry", "n", "d", "threads", "seconds", "vs_sdpa", "first_call_seconds",
"compile_wait_seconds", "cpu"}` in `benchmarks/results/dense.json` and plots
`benchmarks/results/dense.png`.

Methods: `sdpa` (torch.nn.functional.scaled_dot_product_attention); `rewa` (dense_attention with
each geometry at its defaults, fused: docs/mathematics.md "Fused dense attention"; for `dot` it
dispatches to PyTorch's fused kernel); `rewa-tiled` (the dot product forced through rewa's own
tiled kernel by an all-zero additive mask).

    .venv/bin/python benchmarks/dense.py              # N in 8192, 32768; 1 and all threads
    .venv/bin/python benchmarks/dense.py --sizes 4096 --threads 1 --out /tmp/dense
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.measure import cpu_description
from rewa.attention import Geometry, cpu_kernel, dense_attention, make_geometry

GEOMETRIES = ["dot", "euclidean", "sphere", "poincare", "kappa", "product"]
DEFAULT_SIZES = [8192, 32768]
RESULTS = Path(__file__).resolve().parent / "results"


def methods(d: int) -> list[tuple[str, str, Geometry | None, torch.Tensor | None]]:
    """(method, geometry name, geometry, mask) for every measured configuration."""
    rows: list[tuple[str, str, Geometry | None, torch.Tensor | None]] = [
        ("sdpa", "dot", None, None)
    ]
    rows += [("rewa", name, make_geometry(name, d), None) for name in GEOMETRIES]
    rows.append(("rewa-tiled", "dot", make_geometry("dot", d), torch.zeros(1, 1)))
    return rows


def attend(q, k, v, geometry: Geometry | None, mask: torch.Tensor | None) -> torch.Tensor:
    if geometry is None:
        return F.scaled_dot_product_attention(q, k, v)
    return dense_attention(q, k, v, geometry, mask=mask)[0]


def run(sizes: list[int], thread_counts: list[int], rounds: int, d: int = 64) -> list[dict]:
    records = []
    cpu = cpu_description()
    configurations = methods(d)
    for threads in thread_counts:
        torch.set_num_threads(threads)
        for n in sizes:
            generator = torch.Generator().manual_seed(n)
            q, k, v = (torch.randn(1, 1, n, d, generator=generator) for _ in range(3))
            best = [float("inf")] * len(configurations)
            first, compiling = [], []
            with torch.no_grad():
                for _, _, geometry, mask in configurations:  # first call, not among the rounds
                    start = time.perf_counter()
                    attend(q, k, v, geometry, mask)
                    first.append(time.perf_counter() - start)
                    start = time.perf_counter()
                    cpu_kernel.wait()
                    compiling.append(time.perf_counter() - start)
                for _ in range(rounds):
                    for i, (_, _, geometry, mask) in enumerate(configurations):
                        start = time.perf_counter()
                        attend(q, k, v, geometry, mask)
                        best[i] = min(best[i], time.perf_counter() - start)
            for (method, name, _, _), seconds, first_seconds, compile_seconds in zip(
                configurations, best, first, compiling, strict=True
            ):
                record = {
                    "method": method,
                    "geometry": name,
                    "n": n,
                    "d": d,
                    "threads": threads,
                    "seconds": round(seconds, 4),
                    "vs_sdpa": round(seconds / best[0], 3),
                    "first_call_seconds": round(first_seconds, 4),
                    "compile_wait_seconds": round(compile_seconds, 4),
                    "cpu": cpu,
                }
                records.append(record)
                print(json.dumps(record), flush=True)
    return records


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    thread_counts = sorted({r["threads"] for r in records})
    sizes = sorted({r["n"] for r in records})
    series = [(m, g) for m, g, _, _ in methods(64) if m != "sdpa"]
    fig, axes = plt.subplots(1, len(thread_counts), figsize=(6.5 * len(thread_counts) + 1.5, 5),
                             layout="constrained")  # fmt: skip
    axes = [axes] if len(thread_counts) == 1 else list(axes)
    width = 0.8 / len(series)
    colours = plt.get_cmap("tab10")
    for ax, threads in zip(axes, thread_counts, strict=True):
        for i, (method, geometry) in enumerate(series):
            ratios = [
                next(
                    (
                        r["vs_sdpa"]
                        for r in records
                        if (r["method"], r["geometry"], r["n"], r["threads"])
                        == (method, geometry, n, threads)
                    ),
                    0.0,
                )
                for n in sizes
            ]
            label = geometry if method == "rewa" else f"{geometry} ({method})"
            positions = [j + i * width for j in range(len(sizes))]
            ax.bar(positions, ratios, width, label=label, color=colours(i))
        ax.axhline(1.0, color="black", linewidth=1, label="SDPA")
        ax.axhline(1.5, color="grey", linestyle=":", linewidth=1, label="goal 1.5x")
        ax.axhline(3.0, color="grey", linestyle="--", linewidth=1, label="target 3x")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sizes))], [str(n) for n in sizes])
        ax.set(xlabel="tokens N (self-attention, d = 64, one head)", ylabel="time / SDPA time")
        plural = "thread" if threads == 1 else "threads"
        ax.set_title(f"Exact dense attention, CPU, {threads} {plural}", fontsize=10)
    # One legend outside the panels: inside, it hid the tallest bars.
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right upper", fontsize=7)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=DEFAULT_SIZES)
    parser.add_argument(
        "--threads", type=int, nargs="+", help="thread counts (default: 1 and all of them)"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--replot", action="store_true", help="redraw the PNG from the JSON")
    args = parser.parse_args()
    if args.replot:
        plot(json.loads((args.out / "dense.json").read_text()), args.out / "dense.png")
        return
    thread_counts = args.threads or sorted({1, torch.get_num_threads()})
    # The first calls compile from scratch, as in a fresh installation, unless the caller
    # chose Inductor's cache directory.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="rewa-inductor-"))
    args.out.mkdir(parents=True, exist_ok=True)
    records = run(args.sizes, thread_counts, args.rounds)
    (args.out / "dense.json").write_text(json.dumps(records, indent=1) + "\n")
    plot(records, args.out / "dense.png")
    for r in records:
        if r["method"] != "sdpa":
            print(
                f"N={r['n']} threads={r['threads']} {r['method']:10s} {r['geometry']:10s} "
                f"{r['seconds']:8.3f} s = {r['vs_sdpa']:.2f}x SDPA"
            )
    print(f"wrote {args.out / 'dense.json'} and {args.out / 'dense.png'}")
    print("reproduce: .venv/bin/python benchmarks/dense.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
