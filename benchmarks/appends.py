"""Single-token appends to a 128k-token context, in the engine the service runs (embedded store,
CPU): each step commits one token and attends one query per head right after it, in `tail` and
`topk` (IVF) modes, with the defaults a user gets.

- `extended`: the engine as it is, with its defaults: the new version is made from the cached
  one (the new token read and appended; the indexes passed on, or extended when the open
  segment fills, `docs/indexes.md`, "The open segment"). The context starts `appends / 2`
  tokens short of `--tokens`, so that one of the appends fills a segment (at the default
  131072). Its extension runs on the engine's build thread while the following steps are
  timed, which answer from the earlier index until it is done (`docs/indexes.md`, "Builds in
  the background"; `steps_while_building` counts them).
- `rebuilt`: what every append cost before: the new version loaded and indexed from scratch (a
  fresh engine whose attend waits for the build), measured on fewer steps, interleaved with the
  extended ones.
- `exact`: dense attention of the same query over the same version, for scale.

At every rebuilt step the extended engine's answer once its indexes are built (untimed) is
compared with the rebuilt one (largest difference of `out` recorded; the tests check equality).
Records `{"mode", "tokens", "heads", "head_dim", "appends", "extended_p50_ms",
"extended_p90_ms", "extended_max_ms", "steps_while_building", "rebuilt_p50_ms",
"exact_p50_ms", "speedup", "max_out_difference"}` in `benchmarks/results/appends.json`, and a
PNG.

    .venv/bin/python benchmarks/appends.py
    .venv/bin/python benchmarks/appends.py --tokens 32768 --appends 20 --out /tmp/appends
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rewa.service.embedded_store import EmbeddedStore
from rewa.service.engine import AttendParams, Engine

RESULTS = Path(__file__).resolve().parent / "results"
HEADS, DIM = 4, 64


def create(store: EmbeddedStore, kind: str) -> None:
    store.create("bench", {
        "id": kind, "name": None, "geometry": {"name": "dot"}, "heads": HEADS, "head_dim": DIM,
        "value_dim": DIM, "dtype": "float32",
        "index": {"kind": kind, "top_k": 64, "window": 0, "sinks": 0, "budget": 0.02,
                  "options": {}},
    })  # fmt: skip


def commit(store, context_id, keys, values, start, stop) -> dict:
    upload = store.begin_upload("bench", context_id)
    data = keys[:, start:stop].numpy().tobytes() + values[:, start:stop].numpy().tobytes()
    store.add_chunk("bench", context_id, upload, data, stop - start)
    return store.commit("bench", context_id, upload, 1 << 30)


def engine(store, **options) -> Engine:
    return Engine(
        store, device=torch.device("cpu"), cache_bytes=1 << 34, store_indexes=False, **options
    )


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, (time.perf_counter() - start) * 1e3


def run(mode: str, tokens: int, appends: int, rebuild_every: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    # Topic-clustered keys (benchmarks/data.py `clustered`), one mixture component per 256.
    centres = torch.randn(HEADS, tokens // 256, DIM, generator=generator)
    labels = torch.randint(tokens // 256, (HEADS, tokens + appends), generator=generator)
    keys = centres.gather(1, labels.unsqueeze(-1).expand(-1, -1, DIM))
    keys = keys + 0.6 * torch.randn(keys.shape, generator=generator)
    values = torch.randn(HEADS, tokens + appends, DIM, generator=generator)
    store, kind = EmbeddedStore(), "ivf"
    create(store, kind)
    params = AttendParams(mode=mode, top_k=64, budget=0.02, window=0, sinks=0)
    exact = AttendParams(mode="exact", top_k=64, budget=0.02, window=0, sinks=0)
    live = engine(store)
    first = tokens - appends // 2
    record = commit(store, kind, keys, values, 0, first)
    query = keys[:, :1] * 4.0
    live.build_indexes(live.context("bench", record), [mode])  # the first build
    live.attend(live.context("bench", record), query, params)  # the process's first attend
    extended, rebuilt, dense, difference, while_building = [], [], [], 0.0, 0
    for step in range(appends):
        n = first + step
        query = keys[:, n : n + 1] * 4.0

        def append_and_attend(n=n, query=query):
            record = commit(store, kind, keys, values, n, n + 1)
            return record, live.attend(live.context("bench", record), query, params)

        (record, answer), ms = timed(append_and_attend)
        extended.append(ms)
        while_building += mode not in live.index_state("bench", record)["built"]
        _, ms = timed(lambda r=record, q=query: live.attend(live.context("bench", r), q, exact))
        dense.append(ms)
        if step % rebuild_every == 0:
            fresh = engine(store, exact_while_building=0)
            expected, ms = timed(
                lambda f=fresh, r=record, q=query: f.attend(f.context("bench", r), q, params)
            )
            rebuilt.append(ms)
            live.build_indexes(live.context("bench", record), [mode])
            answer = live.attend(live.context("bench", record), query, params)
            difference = max(difference, (expected["out"] - answer["out"]).abs().max().item())
        print(f"{mode} step {step}: extended {extended[-1]:.1f} ms", flush=True)
    deciles = statistics.quantiles(extended, n=10)
    return {
        "mode": mode, "tokens": tokens, "heads": HEADS, "head_dim": DIM, "appends": appends,
        "extended_p50_ms": statistics.median(extended), "extended_p90_ms": deciles[-1],
        "extended_max_ms": max(extended), "steps_while_building": while_building,
        "rebuilt_p50_ms": statistics.median(rebuilt), "exact_p50_ms": statistics.median(dense),
        "speedup": statistics.median(rebuilt) / statistics.median(extended),
        "max_out_difference": difference, "extended_ms": extended,
    }  # fmt: skip


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4), layout="constrained")
    labels = [r["mode"] for r in records]
    x = range(len(records))
    width = 0.27
    bars = [("extended_p50_ms", "append + attend (extended)", "tab:blue"),
            ("rebuilt_p50_ms", "append + attend (rebuilt, before)", "tab:orange"),
            ("exact_p50_ms", "exact attention of the same query", "tab:gray")]  # fmt: skip
    for i, (field, label, colour) in enumerate(bars):
        axis.bar([j + (i - 1) * width for j in x], [r[field] for r in records], width,
                 label=label, color=colour)  # fmt: skip
    axis.set_xticks(list(x), labels)
    axis.set_yscale("log")
    axis.set_ylabel("ms per step (p50)")
    first = records[0]
    axis.set_title(
        f"One-token appends to a {first['tokens']}-token context, {first['heads']} heads, "
        f"d = {first['head_dim']}",
        fontsize=10,
    )
    axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--appends", type=int, default=40)
    parser.add_argument("--rebuild-every", type=int, default=8)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    records = [
        run(mode, args.tokens, args.appends, args.rebuild_every) for mode in ("tail", "topk")
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "appends.json").write_text(json.dumps(records, indent=1) + "\n")
    plot(records, args.out / "appends.png")
    print(json.dumps([{k: v for k, v in r.items() if k != "extended_ms"} for r in records]))
    print("reproduce: .venv/bin/python benchmarks/appends.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
