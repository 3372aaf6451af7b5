"""Sparse O(N K d) attention against dense attention and existing sparse / LSH attention.

One process, the same data for every method, one head, d = 64, K = 64, no gradient, on the
`clustered` and `overlapping` (dot product) and `tree` (Poincare) data sets of
benchmarks/data.py:

- `rewa-ivf`: `retrieval_attention` at its defaults, end to end (index build included): a
  FAISS IVF index (nprobe 8), attention over every key of the probed lists;
  `rewa-ivf-nprobe4` visits 4 lists.
- `rewa-ivf-top64`: the same index, exact top K over the probed lists (`top_k=64`).
- `rewa-lsh`: composite LSH at its defaults, attention over every candidate.
- `sdpa`: torch's scaled_dot_product_attention (dense, dot product).
- `faiss-knn`: attention as Unlimiformer does it: exact flat inner-product search of the top K
  keys, softmax over them.
- `reformer-lsh-{1,4,8}`: reformer-pytorch's LSHAttention (bucket size 64, 1/4/8 hash rounds).

Accuracy is measured on 2048 fixed queries against the exact dense attention of the same
attention function: the data set's geometry for rewa; dot-product attention for sdpa and
faiss-knn; reformer's own shared-QK function (queries attend to normalised copies of the
sequence, attention to self masked) for reformer. `dense_entropy` is the median entropy (nats)
of the data set's exact dense attention rows. Recall fields are null where a method exposes no
candidate set (reformer). Each method runs once per size; Numba's one-time load for the IVF
shortlist is paid before the first (docs/indexes.md, "The probes' shortlist").

    .venv/bin/python benchmarks/sparse.py                  # N in 8192, 32768, 131072
    .venv/bin/python benchmarks/sparse.py --sizes 8192 --out /tmp/sparse
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import faiss
import numpy as np
import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.data import CLUSTERED_QUERY_SCALE, DATASETS, AttentionData, clustered
from benchmarks.measure import measure
from rewa.attention import DotProduct, Geometry, dense_attention, make_geometry
from rewa.index import (
    KeyClusters,
    build_index,
    dense_entropy,
    exact_topk,
    largest,
    lsh_attention,
    mass_recall,
    output_error,
    retrieval_attention,
    retrieval_candidates,
    summary,
    topk_recall,
)
from rewa.index.ivf_blocks import probed_keys, supports_ivf_blocks

DEFAULT_SIZES = [8192, 32768, 131072]
K = 64
SAMPLE = 2048
RESULTS = Path(__file__).resolve().parent / "results"


def rewa_method(kind: str, top_k: int | None = None, **options) -> Callable:
    """`retrieval_attention` end to end (index build included; `options` are the index's);
    returns the index as well so that the candidate sets of the measured queries can be read
    afterwards, untimed."""

    def run(data: AttentionData, geometry: Geometry):
        index = build_index(data.k, geometry, kind, **options)
        out, _ = retrieval_attention(data.q, data.k, data.v, geometry, top_k=top_k, index=index)
        return out, index

    return run


def candidate_rows(index, geometry: Geometry, q: torch.Tensor) -> torch.Tensor:
    """The candidate set each query was attended over: every key of its probed IVF lists, or
    the LSH candidates."""
    with torch.no_grad():
        qw = geometry.witness(q)
        if supports_ivf_blocks(index):
            return probed_keys(index, qw)
        return retrieval_candidates(q, index, index.ntotal, per_query=K).indices


def sdpa(data: AttentionData, geometry: Geometry):
    out = F.scaled_dot_product_attention(data.q[None, None], data.k[None, None], data.v[None, None])
    return out[0, 0], None


def faiss_knn(data: AttentionData, geometry: Geometry):
    """Unlimiformer's retrieval: exact inner-product kNN from a flat index, softmax over top K."""
    index = faiss.IndexFlatIP(data.k.shape[1])
    index.add(np.ascontiguousarray(data.k.numpy()))
    scores, ids = index.search(np.ascontiguousarray(data.q.numpy()), K)
    weights = torch.softmax(torch.from_numpy(scores) / math.sqrt(data.k.shape[1]), dim=-1)
    ids = torch.from_numpy(ids)
    out = (weights.unsqueeze(-2) @ data.v[ids]).squeeze(-2)
    return out, ids


def reformer_method(rounds: int):
    def run(data: AttentionData, geometry: Geometry):
        from reformer_pytorch.reformer_pytorch import LSHAttention

        torch.manual_seed(0)
        attention = LSHAttention(bucket_size=64, n_hashes=rounds, causal=False)
        out, _, _ = attention(data.q[None], data.v[None])
        return out[0], None

    return run


def reformer_reference(data: AttentionData, rows: torch.Tensor) -> torch.Tensor:
    """Exact dense attention of reformer's shared-QK function for the sampled queries."""
    keys = F.normalize(data.q, dim=-1)
    logits = data.q[rows] @ keys.T / math.sqrt(data.q.shape[1])
    logits[torch.arange(len(rows)), rows] = -5e4  # reformer's TOKEN_SELF_ATTN_VALUE
    return torch.softmax(logits, dim=-1) @ data.v


METHODS: dict[str, Callable] = {
    "rewa-ivf": rewa_method("ivf"),
    "rewa-ivf-nprobe4": rewa_method("ivf", nprobe=4),
    "rewa-ivf-top64": rewa_method("ivf", top_k=K),
    "rewa-lsh": rewa_method("lsh"),
    "sdpa": sdpa,
    "faiss-knn": faiss_knn,
    "reformer-lsh-1": reformer_method(1),
    "reformer-lsh-4": reformer_method(4),
    "reformer-lsh-8": reformer_method(8),
}


def compile_loops() -> None:
    """The compiled loops' one-time load (Numba's, once per process: the IVF shortlist's and
    the LSH walk's) paid before any measurement, as a long-lived process pays it once, not by
    the first run it would serve (what it costs: docs/indexes.md, "The probes' shortlist")."""
    largest.compile_ahead((np.float32,))
    lsh_attention.compile_ahead((np.float32,))


def run(sizes: list[int], datasets: list[str], methods: list[str]) -> list[dict]:
    compile_loops()
    records = []
    for dataset in datasets:
        for n in sizes:
            rows = torch.arange(min(SAMPLE, n))
            data = DATASETS[dataset](n)
            geometry = data.geometry()
            dot = DotProduct(data.q.shape[1])
            sample_q = data.q[rows]
            references = {}
            with torch.no_grad():
                for name, g in (("geometry", geometry), ("dot", dot)):
                    out, lse = dense_attention(sample_q, data.k, data.v, g)
                    references[name] = (out, lse, exact_topk(sample_q, data.k, g, K), g)
                entropy = dense_entropy(sample_q, data.k, geometry).median().item()
            for method in methods:
                with torch.no_grad():
                    (out, candidates), seconds, peak = measure(
                        partial(METHODS[method], data, geometry)
                    )
                record = {
                    "method": method,
                    "dataset": dataset,
                    "n": n,
                    "d": data.q.shape[1],
                    "k": K,
                    "seconds": round(seconds, 4),
                    "peak_rss_bytes": peak,
                    "dense_entropy": round(entropy, 4),
                }
                record.update(quality(method, data, out, candidates, rows, references))
                records.append(record)
                print(json.dumps(record), flush=True)
    return records


def quality(method, data, out, candidates, rows, references) -> dict:
    if method.startswith("reformer"):
        error = output_error(out[rows], reformer_reference(data, rows))
        return {"topk_recall": None, "mass_recall": None, **errors(error)}
    ref_out, ref_lse, exact, g = references["geometry" if method.startswith("rewa") else "dot"]
    if candidates is None:  # dense attention reads every key
        return {"topk_recall": 1.0, "mass_recall": 1.0, **errors(output_error(out[rows], ref_out))}
    if isinstance(candidates, torch.Tensor):
        sample = candidates[rows]
    else:
        sample = candidate_rows(candidates, g, data.q[rows])
    return {
        "topk_recall": round(topk_recall(sample, exact).mean().item(), 4),
        "mass_recall": round(
            mass_recall(data.q[rows], data.k, g, sample, ref_lse).median().item(), 4
        ),
        **errors(output_error(out[rows], ref_out)),
    }


def errors(error: torch.Tensor) -> dict:
    stats = summary(error)
    return {"err_median": round(stats["median"], 5), "err_p99": round(stats["p99"], 5)}


# -- the seed mechanisms (issue 8) ------------------------------------------------------------

MECHANISM_N = 32768
MECHANISM_QUERIES = 4096
MECHANISM_SAMPLE = 1024
GRADES = [0.25 * (i % 8) for i in range(64)]  # eight grade levels, 0 to 1.75
TAIL_BUDGET = 0.05
# Temperatures are chosen so that dense attention is concentrated as on a trained head (median
# entropy 1.3 to 3.2 nats over 32768 keys): with diffuse attention any top K is inaccurate
# whatever its recall, which would say nothing about the candidate search.
MECHANISMS: dict[str, tuple[dict, list[str]]] = {
    "cone-penumbral": ({"name": "cone", "kind": "penumbral", "gamma": 24.0}, ["flat", "ivf"]),
    "cone-umbral": ({"name": "cone", "kind": "umbral", "height_scale": 8.0}, ["flat", "ivf"]),
    "graded-lgt-scores": (
        {"name": "graded", "variant": "scores", "grades": GRADES, "scale": 0.25},
        ["ivf", "lsh", "tail"],
    ),
    "graded-egt-queries-keys": (
        {"name": "graded", "kind": "exponential", "variant": "queries_keys", "grades": GRADES},
        ["ivf", "lsh", "tail"],
    ),
    "random-features": (
        {"name": "random_features", "features": 256, "sigma": 4.0, "tau_init": 0.02},
        ["ivf", "lsh", "tail"],
    ),
    "operator": ({"name": "operator", "m": 8, "tau_init": 2.0}, ["ivf", "lsh", "tail"]),
    "operator-low-rank": (
        {"name": "operator", "m": 16, "rank": 4, "tau_init": 16.0},
        ["ivf", "lsh", "tail"],
    ),
}


def run_mechanisms(n: int = MECHANISM_N) -> list[dict]:
    """Every seed mechanism on `clustered` keys and values (unscaled queries drawn from the same
    clusters): dense exact attention and rewa's sparse attention (index build included) over the
    same 4096 queries; recall and mass recall of the candidate sets and the output error against
    the dense result on the first 1024."""
    compile_loops()
    data = clustered(n)
    queries = data.q[:MECHANISM_QUERIES] / CLUSTERED_QUERY_SCALE
    sample = queries[:MECHANISM_SAMPLE]
    records = []
    for mechanism, (spec, methods) in MECHANISMS.items():
        options = {key: value for key, value in spec.items() if key != "name"}
        geometry = make_geometry(spec["name"], data.k.shape[1], **options)
        with torch.no_grad():
            (dense_out, dense_lse), seconds, peak = measure(
                partial(dense_attention, queries, data.k, data.v, geometry)
            )
            exact = exact_topk(sample, data.k, geometry, K)
            entropy = dense_entropy(sample, data.k, geometry).median().item()
        base = {"mechanism": mechanism, "geometry": spec, "n": n, "queries": len(queries), "k": K}
        records.append(
            {
                **base,
                "method": "dense",
                "seconds": round(seconds, 4),
                "build_seconds": 0.0,
                "peak_rss_bytes": peak,
                "dense_entropy": round(entropy, 4),
                "topk_recall": 1.0,
                "mass_recall": 1.0,
                "err_median": 0.0,
                "err_p99": 0.0,
            }
        )
        print(json.dumps(records[-1]), flush=True)
        for kind in methods:
            if kind == "tail":
                records.append(_tail_record(base, data, queries, geometry, dense_out, entropy))
                print(json.dumps(records[-1]), flush=True)
                continue
            with torch.no_grad():
                index, build_seconds, _ = measure(partial(build_index, data.k, geometry, kind))
                (out, _), attend_seconds, peak = measure(
                    partial(
                        retrieval_attention, queries, data.k, data.v, geometry, top_k=K, index=index
                    )
                )
                rows = candidate_rows(index, geometry, sample)
                mass = mass_recall(sample, data.k, geometry, rows, dense_lse[:MECHANISM_SAMPLE])
            record = {
                **base,
                "method": f"rewa-{kind}",
                "seconds": round(build_seconds + attend_seconds, 4),
                "build_seconds": round(build_seconds, 4),
                "peak_rss_bytes": peak,
                "dense_entropy": round(entropy, 4),
                "topk_recall": round(topk_recall(rows, exact).mean().item(), 4),
                "mass_recall": round(mass.median().item(), 4),
                **errors(output_error(out[:MECHANISM_SAMPLE], dense_out[:MECHANISM_SAMPLE])),
            }
            records.append(record)
            print(json.dumps(record), flush=True)
    return records


def _tail_record(base, data, queries, geometry, dense_out, entropy) -> dict:
    """Cluster-tail attention reading 5 % of the keys exactly (at 2 % it visits about one of the
    64 default clusters here, and `clustered` has 128 true clusters) and estimating the rest:
    the answer to diffuse attention, where the top K hold little of the mass. Candidate recall
    does not apply (it reads whole clusters)."""

    def build() -> KeyClusters:
        return KeyClusters.build(geometry.witness(data.k), data.v, geometry)

    with torch.no_grad():
        clusters, build_seconds, _ = measure(build)
        (out, _), attend_seconds, peak = measure(
            partial(
                retrieval_attention,
                queries,
                data.k,
                data.v,
                geometry,
                index=clusters,
                tail=True,
                budget=TAIL_BUDGET,
            )
        )
    return {
        **base,
        "method": "rewa-tail",
        "seconds": round(build_seconds + attend_seconds, 4),
        "build_seconds": round(build_seconds, 4),
        "peak_rss_bytes": peak,
        "dense_entropy": round(entropy, 4),
        "topk_recall": None,
        "mass_recall": None,
        **errors(output_error(out[:MECHANISM_SAMPLE], dense_out[:MECHANISM_SAMPLE])),
    }


def plot_mechanisms(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mechanisms = list(dict.fromkeys(r["mechanism"] for r in records))
    methods = sorted({r["method"] for r in records} - {"dense"})
    fig, axes = plt.subplots(1, 3, figsize=(20, 5.5))
    width = 0.8 / len(methods)
    for slot, method in enumerate(methods):
        x = np.arange(len(mechanisms)) + (slot - (len(methods) - 1) / 2) * width
        recall, error, speedup = [], [], []
        for mechanism in mechanisms:
            rows = {r["method"]: r for r in records if r["mechanism"] == mechanism}
            found = rows.get(method)
            recall.append(found["topk_recall"] or 0 if found else 0)
            error.append(found["err_median"] if found else 0)
            speedup.append(rows["dense"]["seconds"] / found["seconds"] if found else 0)
        for ax, values in zip(axes, (recall, error, speedup), strict=True):
            ax.bar(x, values, width, label=method)
    titles = (
        f"top-{K} recall of the candidates (tail: n/a)",
        "median relative output error vs dense",
        "dense seconds / rewa seconds (index build included)",
    )
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xticks(np.arange(len(mechanisms)), mechanisms, rotation=20, fontsize=8)
        ax.set_title(f"{title}\nN = {records[0]['n']}, {records[0]['queries']} queries", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    axes[2].axhline(1.0, color="black", linewidth=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot(records: list[dict], path: Path) -> None:
    """Time against N (top) and recall against time at the largest N (bottom), one column per
    data set; each method keeps one colour in every panel, and one legend outside the panels
    covers them all."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = sorted({r["dataset"] for r in records})
    methods = [m for m in METHODS if any(r["method"] == m for r in records)]
    colours = dict(zip(methods, plt.get_cmap("tab10").colors, strict=False))
    fig, axes = plt.subplots(2, len(datasets), figsize=(6 * len(datasets) + 2.5, 9),
                             squeeze=False, layout="constrained")  # fmt: skip
    largest = max(r["n"] for r in records)
    for column, dataset in enumerate(datasets):
        rows = [r for r in records if r["dataset"] == dataset]
        for method in methods:
            series = sorted((r for r in rows if r["method"] == method), key=lambda r: r["n"])
            if not series:
                continue
            axes[0][column].loglog([r["n"] for r in series], [r["seconds"] for r in series],
                                   marker="o", color=colours[method], label=method)  # fmt: skip
            last = next(r for r in series if r["n"] == largest)
            if last["topk_recall"] is not None:
                axes[1][column].scatter(last["seconds"], last["topk_recall"],
                                        color=colours[method], label=method)  # fmt: skip
        axes[0][column].set(xlabel="tokens N", ylabel="seconds (end to end)",
                            title=f"{dataset}: time (K = {K}, d = 64)")  # fmt: skip
        axes[1][column].set(xscale="log", xlabel="seconds (end to end)",
                            ylabel=f"top-{K} recall of the candidates",
                            title=f"{dataset}: recall and time at N = {largest}")  # fmt: skip
        axes[1][column].xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        for ax in axes[:, column]:
            ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right upper", fontsize=8,
               title="reformer: no candidate set,\nso no recall", title_fontsize=7)  # fmt: skip
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=DEFAULT_SIZES)
    parser.add_argument(
        "--datasets", nargs="+", default=["clustered", "overlapping", "tree"], choices=DATASETS
    )
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--replot", action="store_true", help="redraw the PNG from the JSON")
    parser.add_argument(
        "--part",
        choices=["all", "baselines", "mechanisms"],
        default="all",
        help="baselines (sparse.json) and/or the seed mechanisms at N = 32768 "
        "(sparse_mechanisms.json)",
    )
    parser.add_argument("--mechanism-size", type=int, default=MECHANISM_N)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        plot(json.loads((args.out / "sparse.json").read_text()), args.out / "sparse.png")
        mechanisms = json.loads((args.out / "sparse_mechanisms.json").read_text())
        plot_mechanisms(mechanisms, args.out / "sparse_mechanisms.png")
        return
    if args.part in ("all", "baselines"):
        records = run(args.sizes, args.datasets, args.methods)
        (args.out / "sparse.json").write_text(json.dumps(records, indent=1) + "\n")
        plot(records, args.out / "sparse.png")
        print(f"wrote {args.out / 'sparse.json'} and {args.out / 'sparse.png'}")
    if args.part in ("all", "mechanisms"):
        records = run_mechanisms(args.mechanism_size)
        (args.out / "sparse_mechanisms.json").write_text(json.dumps(records, indent=1) + "\n")
        plot_mechanisms(records, args.out / "sparse_mechanisms.png")
        print(f"wrote {args.out / 'sparse_mechanisms.json'} and sparse_mechanisms.png")
    print("reproduce: .venv/bin/python benchmarks/sparse.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
