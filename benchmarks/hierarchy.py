"""Which attention geometry represents a hierarchy best at a given head dimension? A miniature of
seed 000 sec. 8.1.2 (hierarchical expressivity) and seed 002 sec. 5.2 (cone attention at low
dimensions), sized for this 2-core CPU.

Task, "closest relative": a random tree (depth `--depth`, every internal node with 2 or 3
children, one tree per seed) whose leaves are the vocabulary. An example is a query leaf `u`
and `--candidates` other leaves, exactly one of which has the deepest lowest common ancestor
with `u`; the model must point at it. Training examples are drawn afresh every step; accuracy
is measured on 4096 held-out examples (the same for every model of a seed).

Model, the same for every geometry: leaf embeddings (width 32, plus a learned query marker) ->
one `GeometricTransformerLayer` (1 head of dimension `head_dim`, the geometry under test) ->
LayerNorm -> a pointer head: the same geometry's logits between the projected query token and
the projected candidates (`GeometricAttention`'s q/k projections, `head_dim` wide), trained
with cross-entropy over the candidates. Both attention modules use the geometry's defaults
(umbral / penumbral cone; graded: linear grades on scores, learnable; kappa: learned from 0).
Parameter budgets are equal within a head dimension: the MLP's hidden width is raised until
each model has the largest count among the geometries (within one MLP unit, 65 parameters).

Records: `{"geometry", "head_dim", "seed", "accuracy", "learned", "parameters", "final_loss",
"seconds"}` in `benchmarks/results/hierarchy.json`, and accuracy against head dimension (mean
and range over seeds) in `hierarchy.png`.

    .venv/bin/python benchmarks/hierarchy.py
    .venv/bin/python benchmarks/hierarchy.py --head-dims 4 8 --seeds 0 --out /tmp/hierarchy
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rewa.attention import GeometricAttention
from rewa.research import GeometricTransformerLayer

RESULTS = Path(__file__).resolve().parent / "results"
EMBED_DIM = 32
BASE_MLP_HIDDEN = 64
TEST_EXAMPLES = 4096

GEOMETRIES: dict[str, tuple[str, dict[str, Any]]] = {
    "dot": ("dot", {}),
    "euclidean": ("euclidean", {}),
    "sphere": ("sphere", {}),
    "poincare": ("poincare", {}),
    "product": ("product", {}),
    "kappa": ("kappa", {"kappa": 0.0, "learnable_kappa": True}),
    "umbral": ("cone", {"kind": "umbral"}),
    "penumbral": ("cone", {"kind": "penumbral"}),
    "graded": ("graded", {}),
}
SHARPNESS_GRID = (0.25, 1.0, 4.0)
"""Multipliers of each geometry's initial logit scale tried in the pilot."""


def geometry_options(name: str, head_dim: int, sharpness: float) -> tuple[str, dict[str, Any]]:
    """The registry name and options of `name` with its initial logit scale multiplied by
    `sharpness`: `scale` for dot and graded, `1 / tau_init` for distance geometries (default
    tau sqrt(d), product 1), `gamma` for cones (default 1). Temperatures and gamma stay
    learnable; only their starting point changes."""
    geometry, options = GEOMETRIES[name]
    options = dict(options)
    if geometry in ("dot", "graded"):
        options["scale"] = sharpness / math.sqrt(head_dim)
    elif geometry == "product":
        options["tau_init"] = 1.0 / sharpness
    elif geometry == "cone":
        options["gamma"] = sharpness
    else:
        options["tau_init"] = math.sqrt(head_dim) / sharpness
    return geometry, options


def random_tree(depth: int, rng: np.random.Generator) -> np.ndarray:
    """Ancestor paths `(leaves, depth + 1)` (node ids from the root down) of a random tree whose
    internal nodes have 2 or 3 children and whose leaves all sit at `depth`."""
    paths = [[0]]
    next_id = 1
    for _ in range(depth):
        grown = []
        for path in paths:
            for _ in range(int(rng.integers(2, 4))):
                grown.append([*path, next_id])
                next_id += 1
        paths = grown
    return np.array(paths)


def lca_depths(paths: np.ndarray) -> np.ndarray:
    """`(L, L)` depth of the lowest common ancestor of every pair of leaves (root = 0)."""
    shared = (paths[:, None, :] == paths[None, :, :]).cumprod(-1)
    return shared.sum(-1) - 1


def sample_examples(
    lca: np.ndarray, n: int, candidates: int, rng: np.random.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`n` examples: query leaves `(n,)`, distinct candidate leaves `(n, candidates)` other than
    the query, and the index of the unique candidate with the deepest LCA with the query."""
    leaves = len(lca)
    queries, rows = [], []
    kept = 0
    while kept < n:
        u = rng.integers(0, leaves, 2 * n)
        c = rng.integers(0, leaves, (2 * n, candidates))
        ordered = np.sort(np.concatenate([u[:, None], c], 1), 1)
        distinct = (np.diff(ordered, axis=1) != 0).all(1)
        depth = lca[u[:, None], c]
        unique_best = (depth == depth.max(1, keepdims=True)).sum(1) == 1
        keep = distinct & unique_best
        queries.append(u[keep])
        rows.append(c[keep])
        kept += int(keep.sum())
    u = np.concatenate(queries)[:n]
    c = np.concatenate(rows)[:n]
    answer = lca[u[:, None], c].argmax(1)
    return torch.from_numpy(u), torch.from_numpy(c), torch.from_numpy(answer)


class ClosestRelativeModel(nn.Module):
    """Leaf embeddings -> one encoder layer -> a pointer head, all under one geometry."""

    def __init__(
        self, leaves: int, head_dim: int, geometry: str, options: dict, mlp_hidden: int
    ) -> None:
        super().__init__()
        self.leaves = nn.Embedding(leaves, EMBED_DIM)
        self.query_marker = nn.Parameter(torch.zeros(EMBED_DIM))
        self.layer = GeometricTransformerLayer(
            EMBED_DIM, 1, geometry, head_dim=head_dim, geometry_options=options,
            mlp_hidden=mlp_hidden,
        )  # fmt: skip
        self.norm = nn.LayerNorm(EMBED_DIM)
        self.pointer = GeometricAttention(
            EMBED_DIM, 1, geometry, head_dim=head_dim, geometry_options=options
        )
        del self.pointer.v_proj, self.pointer.out_proj  # only its q/k projections and geometry

    def forward(self, query: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """Logits `(n, candidates)` over the candidates."""
        tokens = torch.cat(
            [(self.leaves(query) + self.query_marker).unsqueeze(1), self.leaves(candidates)], 1
        )
        hidden = self.norm(self.layer(tokens))
        q = self.pointer._split_heads(self.pointer.q_proj(hidden[:, :1]))
        k = self.pointer._split_heads(self.pointer.k_proj(hidden[:, 1:]))
        return self.pointer.geometry.logits(q, k)[:, 0, 0]


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def matched_mlp_hidden(leaves: int, head_dim: int) -> dict[str, int]:
    """Per geometry, the MLP width that brings its parameter count up to the largest count
    among the geometries at `BASE_MLP_HIDDEN` (within one MLP unit)."""
    counts = {
        name: parameter_count(
            ClosestRelativeModel(
                leaves, head_dim, *geometry_options(name, head_dim, 1.0), BASE_MLP_HIDDEN
            )
        )
        for name in GEOMETRIES
    }
    budget = max(counts.values())
    per_unit = 2 * EMBED_DIM + 1
    return {name: BASE_MLP_HIDDEN + (budget - count) // per_unit for name, count in counts.items()}


def learned_parameters(model: ClosestRelativeModel) -> dict[str, Any]:
    """What each geometry learned, for the layer's and the pointer's attention."""
    summary = {}
    geometries = {"layer": model.layer.attention.geometry, "pointer": model.pointer.geometry}
    for where, geometry in geometries.items():
        values: dict[str, Any] = {}
        with torch.no_grad():
            if hasattr(geometry, "temperature"):
                values["tau"] = geometry.temperature().tolist()
            if hasattr(geometry, "curvature"):
                values["kappa"] = geometry.curvature().tolist()
            if hasattr(geometry, "diagnostics"):
                values.update(
                    {k: v for k, v in geometry.diagnostics().items() if k != "kappa_eff_note"}
                )
            if hasattr(geometry, "gamma"):
                values["gamma"] = geometry.gamma.tolist()
            if hasattr(geometry, "grades"):
                weights = geometry.weights()
                values["grade_weight_min_max"] = [weights.min().item(), weights.max().item()]
        summary[where] = values
    return summary


def train_and_evaluate(task: dict[str, Any]) -> dict[str, Any]:
    """One model: train on fresh examples, evaluate on the seed's held-out examples."""
    torch.set_num_threads(1)
    seed, head_dim, name = task["seed"], task["head_dim"], task["geometry"]
    paths = random_tree(task["depth"], np.random.default_rng(seed))
    lca = lca_depths(paths)
    test_rng = np.random.default_rng(10_000 + seed)
    test = sample_examples(lca, TEST_EXAMPLES, task["candidates"], test_rng)
    train_rng = np.random.default_rng(seed + 1)
    torch.manual_seed(seed)
    geometry, options = geometry_options(name, head_dim, task["sharpness"])
    model = ClosestRelativeModel(len(paths), head_dim, geometry, options, task["mlp_hidden"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=task["lr"])
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, task["steps"])
    start = time.perf_counter()
    loss = torch.tensor(math.nan)
    for _ in range(task["steps"]):
        batch = sample_examples(lca, task["batch"], task["candidates"], train_rng)
        query, candidates, answer = batch
        loss = nn.functional.cross_entropy(model(query, candidates), answer)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    with torch.no_grad():
        accuracy = (model(test[0], test[1]).argmax(1) == test[2]).float().mean().item()
    return {
        "geometry": name,
        "head_dim": head_dim,
        "seed": seed,
        "accuracy": accuracy,
        "learned": learned_parameters(model),
        "parameters": parameter_count(model),
        "final_loss": loss.item(),
        "seconds": time.perf_counter() - start,
        "leaves": len(paths),
        "sharpness": task["sharpness"],
    }


def tasks_for(args: argparse.Namespace, seeds, head_dims, sharpness: dict[str, list[float]]):
    tasks = []
    for seed in seeds:
        leaves = len(random_tree(args.depth, np.random.default_rng(seed)))
        for head_dim in head_dims:
            hidden = matched_mlp_hidden(leaves, head_dim)
            for name in args.geometries:
                for value in sharpness[name]:
                    tasks.append(
                        {"seed": seed, "head_dim": head_dim, "geometry": name,
                         "depth": args.depth, "candidates": args.candidates, "steps": args.steps,
                         "batch": args.batch, "lr": args.lr, "mlp_hidden": hidden[name],
                         "sharpness": value}
                    )  # fmt: skip
    return tasks


def run_tasks(tasks: list[dict], workers: int) -> list[dict]:
    records = []
    with ProcessPoolExecutor(workers) as pool:
        for record in pool.map(train_and_evaluate, tasks):
            print(
                f"{record['geometry']:>10} d={record['head_dim']:<3} seed={record['seed']:<3} "
                f"sharpness={record['sharpness']:<4} accuracy={record['accuracy']:.3f} "
                f"({record['seconds']:.1f} s)",
                flush=True,
            )
            records.append(record)
    return records


def choose_sharpness(pilot: list[dict]) -> dict[str, float]:
    """Per geometry, the initial logit-scale multiplier with the best pilot accuracy."""
    best: dict[str, dict] = {}
    for record in pilot:
        name = record["geometry"]
        if name not in best or record["accuracy"] > best[name]["accuracy"]:
            best[name] = record
    return {name: record["sharpness"] for name, record in best.items()}


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    names = list(dict.fromkeys(r["geometry"] for r in records))
    for name in names:
        rows = [r for r in records if r["geometry"] == name]
        dims = sorted({r["head_dim"] for r in rows})
        by_dim = [[r["accuracy"] for r in rows if r["head_dim"] == d] for d in dims]
        means = [float(np.mean(a)) for a in by_dim]
        low = [m - min(a) for m, a in zip(means, by_dim, strict=True)]
        high = [max(a) - m for m, a in zip(means, by_dim, strict=True)]
        ax.errorbar(dims, means, yerr=[low, high], marker="o", capsize=3, label=name)
    chance = 1 / records[0].get("candidates", 8) if records else 0
    ax.axhline(chance, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("head dimension")
    ax.set_ylabel("held-out accuracy (mean, range over seeds)")
    ax.set_title("Closest relative in a random tree")
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--geometries", nargs="+", default=list(GEOMETRIES), choices=list(GEOMETRIES)
    )
    parser.add_argument("--head-dims", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--candidates", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--pilot-seed", type=int, default=100)
    parser.add_argument("--pilot-head-dim", type=int, default=8)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--replot", action="store_true", help="redraw the PNG from the JSON")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        plot(json.loads((args.out / "hierarchy.json").read_text()), args.out / "hierarchy.png")
        return
    start = time.perf_counter()
    grid = {name: list(SHARPNESS_GRID) for name in args.geometries}
    pilot = run_tasks(tasks_for(args, [args.pilot_seed], [args.pilot_head_dim], grid), args.workers)
    chosen = choose_sharpness(pilot)
    print(f"pilot (seed {args.pilot_seed}, head dim {args.pilot_head_dim}) chose {chosen}")
    grid = {name: [chosen[name]] for name in args.geometries}
    records = run_tasks(tasks_for(args, args.seeds, args.head_dims, grid), args.workers)
    for record in pilot + records:
        record["candidates"] = args.candidates
    (args.out / "hierarchy_pilot.json").write_text(json.dumps(pilot, indent=1) + "\n")
    (args.out / "hierarchy.json").write_text(json.dumps(records, indent=1) + "\n")
    plot(records, args.out / "hierarchy.png")
    seconds = time.perf_counter() - start
    print(f"wrote hierarchy.json, hierarchy_pilot.json and .png to {args.out} in {seconds:.0f} s")
    print("reproduce: .venv/bin/python benchmarks/hierarchy.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
