"""Exact dense attention: rewa's geometries against PyTorch's scaled_dot_product_attention.

One process, the same data for every method, one head, d = 64, no gradient. Records
`{"method", "geometry", "n", "d", "seconds", "peak_rss_bytes"}` in
`benchmarks/results/dense.json` and plots `benchmarks/results/dense.png`.

Methods: `sdpa` (torch.nn.functional.scaled_dot_product_attention); `rewa` (dense_attention with
each geometry; for `dot` it dispatches to PyTorch's fused kernel); `rewa-tiled` (the dot product
forced through rewa's own tiled kernel by an all-zero additive mask).

    .venv/bin/python benchmarks/dense.py              # N in 4096, 16384, 65536, 131072
    .venv/bin/python benchmarks/dense.py --sizes 4096 --out /tmp/dense
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.measure import measure
from rewa.attention import Geometry, dense_attention, make_geometry

GEOMETRIES = ["dot", "euclidean", "sphere", "poincare", "product"]
DEFAULT_SIZES = [4096, 16384, 65536, 131072]
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


def run(sizes: list[int], d: int = 64) -> list[dict]:
    records = []
    configurations = methods(d)
    warm = torch.randn(1, 1, 1024, d)
    with torch.no_grad():
        for _, _, geometry, mask in configurations:  # one-time initialisation, not timed
            attend(warm, warm, warm, geometry, mask)
    for n in sizes:
        generator = torch.Generator().manual_seed(n)
        q, k, v = (torch.randn(1, 1, n, d, generator=generator) for _ in range(3))
        for method, name, geometry, mask in configurations:
            with torch.no_grad():
                _, seconds, peak = measure(partial(attend, q, k, v, geometry, mask))
            record = {
                "method": method,
                "geometry": name,
                "n": n,
                "d": d,
                "seconds": round(seconds, 4),
                "peak_rss_bytes": peak,
            }
            records.append(record)
            print(json.dumps(record), flush=True)
    return records


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (times, ratios) = plt.subplots(1, 2, figsize=(12, 5))
    series = sorted({(r["method"], r["geometry"]) for r in records})
    sdpa = {r["n"]: r["seconds"] for r in records if r["method"] == "sdpa"}
    for method, geometry in series:
        rows = sorted(
            (r for r in records if (r["method"], r["geometry"]) == (method, geometry)),
            key=lambda r: r["n"],
        )
        label = f"{method} {geometry}" if method != "sdpa" else "SDPA"
        ns = [r["n"] for r in rows]
        times.loglog(ns, [r["seconds"] for r in rows], marker="o", label=label)
        if method != "sdpa":
            ratios.semilogx(
                ns, [r["seconds"] / sdpa[r["n"]] for r in rows], marker="o", label=label
            )
    times.set(
        xlabel="tokens N (self-attention, d = 64, one head)",
        ylabel="seconds",
        title="Exact dense attention, CPU",
    )
    ratios.axhline(1.5, color="grey", linestyle="--", linewidth=1, label="dot target 1.5x")
    ratios.axhline(3.0, color="black", linestyle="--", linewidth=1, label="distance target 3x")
    ratios.set(xlabel="tokens N", ylabel="time / SDPA time", title="Relative to SDPA")
    for ax in (times, ratios):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=DEFAULT_SIZES)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    records = run(args.sizes)
    (args.out / "dense.json").write_text(json.dumps(records, indent=1) + "\n")
    plot(records, args.out / "dense.png")
    largest = max(args.sizes)
    sdpa = next(r["seconds"] for r in records if r["method"] == "sdpa" and r["n"] == largest)
    for r in records:
        if r["n"] == largest and r["method"] != "sdpa":
            print(
                f"N={largest} {r['method']:10s} {r['geometry']:10s} {r['seconds']:8.2f} s "
                f"= {r['seconds'] / sdpa:.2f}x SDPA, peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB"
            )
    print(f"wrote {args.out / 'dense.json'} and {args.out / 'dense.png'}")
    print("reproduce: .venv/bin/python benchmarks/dense.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
