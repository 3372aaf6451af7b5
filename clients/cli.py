"""The `rewa` command line: `serve`, and a client of a running service (`contexts`, `upload`,
`attend`, `search`, `bench`). The client commands talk to `--url` (default `REWA_URL`, else
http://127.0.0.1:8000) with `--api-key` (default `REWA_API_KEY`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ARRAY_SUFFIXES = (".npy", ".npz", ".safetensors")


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        _serve(args)
        return
    from .http import Client, RewaError

    try:
        with Client(args.url, api_key=args.api_key, timeout=args.timeout) as client:
            COMMANDS[args.command](client, args)
    except (RewaError, ValueError, OSError, KeyError) as error:
        print(f"rewa {args.command}: {error}", file=sys.stderr)
        raise SystemExit(1) from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rewa", description="rewa: geometric retrieval attention")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the HTTP service (settings: REWA_* variables)")
    serve.add_argument("--host", help="default: REWA_HOST or 127.0.0.1")
    serve.add_argument("--port", type=int, help="default: REWA_PORT or 8000")

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=os.environ.get("REWA_URL", "http://127.0.0.1:8000"))
    common.add_argument("--api-key", default=os.environ.get("REWA_API_KEY"))
    common.add_argument("--timeout", type=float, default=300.0, help="seconds per request")

    contexts = commands.add_parser("contexts", parents=[common], help="list, show, delete")
    actions = contexts.add_subparsers(dest="action", required=True)
    actions.add_parser("ls", parents=[common], help="list the contexts")
    for action, text in (("show", "show one context (JSON)"), ("rm", "delete a context")):
        sub = actions.add_parser(action, parents=[common], help=text)
        sub.add_argument("context_id")

    upload = commands.add_parser(
        "upload", parents=[common], help="upload keys and values from .npy, .npz, .safetensors"
    )
    upload.add_argument("file", type=Path, help="keys (.npy) or keys and values (.npz, ...)")
    upload.add_argument("--values", type=Path, help="values (.npy) when FILE holds the keys")
    upload.add_argument("--keys-name", default="keys", help="array name in .npz/.safetensors")
    upload.add_argument("--values-name", default="values")
    upload.add_argument("--context", help="append to this context (else create one)")
    upload.add_argument("--geometry", default="dot", help="new context: geometry name or JSON")
    upload.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    upload.add_argument("--index", help="new context: index settings as JSON")
    upload.add_argument("--name", help="new context: a name")
    upload.add_argument("--chunk-tokens", type=int, default=8192)
    upload.add_argument("--quiet", action="store_true", help="no progress bar")

    attend = commands.add_parser("attend", parents=[common], help="attend queries from a file")
    attend.add_argument("context_id")
    attend.add_argument("queries", type=Path, help="(heads, n, head_dim) .npy (or .npz queries)")
    attend.add_argument("--mode", choices=["tail", "topk", "exact"])
    attend.add_argument("--top-k", type=int, help="topk mode: keys attended per query")
    attend.add_argument("--budget", type=float)
    attend.add_argument("--return-topk", type=int)
    attend.add_argument(
        "--measured-queries", type=int, help="tail mode: queries per head answered exactly"
    )
    attend.add_argument("--out", type=Path, help=".npz with out, lse (and ids, weights)")
    attend.add_argument("--json", action="store_true", help="a JSON summary instead of a table")

    search = commands.add_parser("search", parents=[common], help="top-K keys of queries")
    search.add_argument("context_id")
    search.add_argument("queries", type=Path)
    search.add_argument("--top-k", type=int, default=10, help="ids per query")
    search.add_argument("--exact", action="store_true")
    search.add_argument("--out", type=Path, help=".npz with ids, scores (and distances)")
    search.add_argument("--json", action="store_true", help="every id as JSON, not a table")

    bench = commands.add_parser(
        "bench", parents=[common], help="decode-style load on a temporary random context"
    )
    bench.add_argument("--tokens", type=int, default=16384)
    bench.add_argument("--heads", type=int, default=8)
    bench.add_argument("--head-dim", type=int, default=64)
    bench.add_argument("--clients", type=int, default=8)
    bench.add_argument("--requests", type=int, default=20, help="per client")
    bench.add_argument("--mode", choices=["tail", "topk", "exact"], default="tail")
    return parser


def _serve(args: argparse.Namespace) -> None:
    if args.host:
        os.environ["REWA_HOST"] = args.host
    if args.port is not None:
        os.environ["REWA_PORT"] = str(args.port)
    try:
        from rewa.service.server import serve as run_server
    except ImportError as error:  # a client-only install: `pip install rewa`
        raise SystemExit(
            f"rewa serve needs the service's requirements ({error.name} is missing): "
            "pip install 'rewa[service,cpu]', or `make serve` in a checkout"
        ) from None
    run_server()


# -- files ------------------------------------------------------------------------------------


def load_arrays(path: Path, names: tuple[str, ...]) -> list[np.ndarray]:
    """The arrays `names` of a .npz or .safetensors file (a .npy file holds one array)."""
    if path.suffix not in ARRAY_SUFFIXES:
        raise ValueError(f"{path}: expected one of {list(ARRAY_SUFFIXES)}, got {path.suffix!r}")
    if path.suffix == ".npy":
        return [np.load(path, allow_pickle=False)]
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as archive:
            return [_named(archive, name, path) for name in names]
    from safetensors.numpy import load_file  # here: only this command needs it

    return [_named(load_file(str(path)), name, path) for name in names]


def _named(arrays: Any, name: str, path: Path) -> np.ndarray:
    if name not in arrays:
        raise ValueError(f"{path}: no array {name!r} (it has {sorted(arrays.keys())})")
    return np.asarray(arrays[name])


def _queries(path: Path) -> np.ndarray:
    return load_arrays(path, ("queries",))[0]


def _save(path: Path | None, **arrays: Any) -> None:
    if path is not None:
        np.savez(path, **{name: value for name, value in arrays.items() if value is not None})


def _progress_bar(label: str):
    """A progress callback drawing `label [#####     ] done/total` on stderr."""

    def draw(done: int, total: int) -> None:
        filled = int(30 * done / max(total, 1))
        bar = "#" * filled + " " * (30 - filled)
        end = "\n" if done >= total else ""
        print(f"\r{label} [{bar}] {done}/{total} tokens", end=end, file=sys.stderr, flush=True)

    return draw


# -- commands ---------------------------------------------------------------------------------


def contexts_command(client, args: argparse.Namespace) -> None:
    if args.action == "ls":
        print(f"{'id':<34} {'name':<16} {'geometry':<12} {'heads':>5} {'dim':>4} {'tokens':>9}")
        for context in client.list_contexts():
            print(
                f"{context['id']:<34} {context['name'] or '-':<16} "
                f"{context['geometry']['name']:<12} {context['heads']:>5} "
                f"{context['head_dim']:>4} {context['n_tokens']:>9}"
            )
    elif args.action == "show":
        print(json.dumps(client.get_context(args.context_id), indent=1))
    else:
        client.delete_context(args.context_id)
        print(f"deleted {args.context_id}")


def upload_command(client, args: argparse.Namespace) -> None:
    if args.values is not None:
        if args.file.suffix != ".npy" or args.values.suffix != ".npy":
            raise ValueError("--values pairs two .npy files (keys FILE, values --values)")
        (keys,), (values,) = load_arrays(args.file, ()), load_arrays(args.values, ())
    elif args.file.suffix == ".npy":
        raise ValueError("a .npy file holds the keys only: give the values with --values")
    else:
        keys, values = load_arrays(args.file, (args.keys_name, args.values_name))
    if keys.ndim != 3 or values.ndim != 3:
        raise ValueError(
            f"expected keys and values (heads, tokens, dim), got {keys.shape} and {values.shape}"
        )
    context_id = args.context
    if context_id is None:
        geometry = json.loads(args.geometry) if args.geometry.startswith("{") else args.geometry
        context = client.create_context(
            keys.shape[0],
            keys.shape[2],
            geometry=geometry,
            value_dim=values.shape[2],
            dtype=args.dtype,
            index=json.loads(args.index) if args.index else None,
            name=args.name,
        )
        context_id = context["id"]
    progress = None if args.quiet else _progress_bar(f"upload {context_id}")
    context = client.upload(
        context_id, keys, values, chunk_tokens=args.chunk_tokens, progress=progress
    )
    print(
        json.dumps(
            {"id": context_id, "n_tokens": context["n_tokens"], "version": context["version"]}
        )
    )


SHOWN_ROWS = 20  # (head, query) rows a table prints; --out keeps them all
SHOWN_IDS = 8  # ids per row a table prints


def attend_command(client, args: argparse.Namespace) -> None:
    result = client.attend(
        args.context_id,
        _queries(args.queries),
        mode=args.mode,
        top_k=args.top_k,
        budget=args.budget,
        return_topk=args.return_topk,
        measured_queries=args.measured_queries,
    )
    _save(args.out, out=result.out, lse=result.lse, ids=result.ids, weights=result.weights)
    if args.json:
        summary = {"mode": result.mode, "version": result.version,
                   "out_shape": list(result.out.shape), "saved": _saved(args.out)}  # fmt: skip
        print(json.dumps(summary))
        return
    heads, n, dv = result.out.shape
    print(f"context {args.context_id}, version {result.version}, mode {result.mode}: "
          f"out ({heads}, {n}, {dv}), lse ({heads}, {n})")  # fmt: skip
    print(f"{'head':>4} {'query':>5} {'lse':>10} {'|out|':>10}" + ("  best ids (weight)"
          if result.ids is not None else ""))  # fmt: skip
    norms = np.linalg.norm(np.asarray(result.out, dtype=np.float64), axis=-1)
    for head, query in _shown_rows(heads, n):
        line = f"{head:>4} {query:>5} {float(result.lse[head, query]):>10.4f} "
        line += f"{norms[head, query]:>10.4f}"
        if result.ids is not None:
            pairs = zip(result.ids[head, query], result.weights[head, query], strict=True)
            line += "  " + _shown_ids(f"{int(i)} ({float(w):.3f})" for i, w in pairs if i >= 0)
        print(line)
    print(_saved_line(args.out, "out, lse" + (", ids, weights" if result.ids is not None else "")))


def search_command(client, args: argparse.Namespace) -> None:
    result = client.search(args.context_id, _queries(args.queries), args.top_k, exact=args.exact)
    _save(args.out, ids=result.ids, scores=result.scores, distances=result.distances)
    if args.json:
        print(json.dumps({"ids": result.ids.tolist(), "version": result.version,
                          "saved": _saved(args.out)}))  # fmt: skip
        return
    heads, n, k = result.ids.shape
    print(f"context {args.context_id}, version {result.version}: the best {k} keys of {n} "
          f"queries x {heads} heads")  # fmt: skip
    print(f"{'head':>4} {'query':>5}  ids (logit)")
    for head, query in _shown_rows(heads, n):
        pairs = zip(result.ids[head, query], result.scores[head, query], strict=True)
        shown = _shown_ids(f"{int(i)} ({float(s):.3f})" for i, s in pairs if i >= 0)
        print(f"{head:>4} {query:>5}  {shown}")
    print(_saved_line(args.out, "ids, scores" + (", distances" if result.distances is not None
                                                  else "")))  # fmt: skip


def _shown_rows(heads: int, n: int):
    """The first `SHOWN_ROWS` (head, query) pairs, then a line saying how many are left out."""
    for row in range(min(heads * n, SHOWN_ROWS)):
        yield divmod(row, n)
    if heads * n > SHOWN_ROWS:
        print(f"... {heads * n - SHOWN_ROWS} more rows")


def _shown_ids(items) -> str:
    items = list(items)
    more = f"  +{len(items) - SHOWN_IDS} more" if len(items) > SHOWN_IDS else ""
    return "  ".join(items[:SHOWN_IDS]) + more


def _saved(path: Path | None) -> str | None:
    return None if path is None else str(path)


def _saved_line(path: Path | None, arrays: str) -> str:
    if path is None:
        return f"(not saved: --out FILE.npz saves {arrays} in full)"
    return f"saved {arrays} to {path}"


def bench_command(client, args: argparse.Namespace) -> None:
    """Create a random context, send decode requests (heads x 1 query) from `clients` threads,
    print latency percentiles and throughput as JSON, delete the context."""
    from .http import Client

    generator = np.random.default_rng(0)
    shape = (args.heads, args.tokens, args.head_dim)
    keys = generator.standard_normal(shape, dtype=np.float32)
    values = generator.standard_normal(shape, dtype=np.float32)
    context = client.create_context(args.heads, args.head_dim, name="rewa-bench")
    try:
        start = time.perf_counter()
        client.upload(context["id"], keys, values)
        upload_seconds = time.perf_counter() - start
        queries = generator.standard_normal((args.heads, 1, args.head_dim), dtype=np.float32)
        client.attend(context["id"], queries, mode=args.mode)  # warm-up: load, build
        latencies: list[float] = []
        lock = threading.Lock()

        def run_client() -> None:
            own = []
            with Client(client.url, api_key=args.api_key, timeout=args.timeout) as mine:
                for _ in range(args.requests):
                    begin = time.perf_counter()
                    mine.attend(context["id"], queries, mode=args.mode)
                    own.append(time.perf_counter() - begin)
            with lock:
                latencies.extend(own)

        threads = [threading.Thread(target=run_client) for _ in range(args.clients)]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - start
    finally:
        client.delete_context(context["id"])
    if len(latencies) != args.clients * args.requests:
        raise ValueError(f"{args.clients * args.requests - len(latencies)} requests failed")
    milliseconds = np.array(latencies) * 1000
    print(
        json.dumps(
            {
                "mode": args.mode,
                "tokens": args.tokens,
                "clients": args.clients,
                "upload_s": round(upload_seconds, 3),
                "p50_ms": round(float(np.percentile(milliseconds, 50)), 2),
                "p99_ms": round(float(np.percentile(milliseconds, 99)), 2),
                "requests_per_s": round(len(latencies) / elapsed, 1),
            }
        )
    )


COMMANDS = {
    "contexts": contexts_command,
    "upload": upload_command,
    "attend": attend_command,
    "search": search_command,
    "bench": bench_command,
}


if __name__ == "__main__":
    main()
