"""The attend wire: base64 JSON against safetensors bodies.

1. Codec cost per answer size: what the server does to send an attend answer (`out (H, n, dv)`,
   `lse (H, n)`; JSON: `wire.encode` of both and the response model's JSON; safetensors:
   `wire.write_safetensors`) plus what the client does to read it (JSON: parse and
   `decode_tensor`; safetensors: `safetensors.torch.load`), in process, best of interleaved
   rounds.
2. One decode-sized attend end to end over HTTP (32 query heads as 8 heads x 4 queries, d = 128,
   a 16384-token context, exact mode so that the attention itself is the same small cost): the
   median round trip of `Client(wire="json")` and `Client(wire="safetensors")`, interleaved.

Records `benchmarks/results/wire.json` and a PNG.

    .venv/bin/python benchmarks/wire.py
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.measure import best_times
from rewa.clients import Client
from rewa.clients.http import decode_tensor
from rewa.service import wire
from rewa.service.schemas import AttendResponse
from tests.service_support import Server

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = [(32, 1, 128), (32, 64, 128), (8, 8192, 128)]


def json_round(out: torch.Tensor, lse: torch.Tensor) -> None:
    body = AttendResponse(out=wire.encode(out), lse=wire.encode(lse), mode="tail", version=1)
    found = json.loads(body.model_dump_json())
    decode_tensor(found["out"], True), decode_tensor(found["lse"], True)


def safetensors_round(out: torch.Tensor, lse: torch.Tensor) -> None:
    load(wire.write_safetensors({"out": out, "lse": lse}, {"mode": "tail"}))


def codec(rounds: int) -> list[dict]:
    records = []
    for shape in SHAPES:
        out, lse = torch.randn(shape), torch.randn(shape[:2])
        best = best_times(
            {
                "json": functools.partial(json_round, out, lse),
                "safetensors": functools.partial(safetensors_round, out, lse),
            },
            rounds,
        )
        records.append(
            {
                "what": "encode + decode",
                "shape": list(shape),
                "json_ms": best["json"] * 1e3,
                "safetensors_ms": best["safetensors"] * 1e3,
            }
        )
        print(records[-1], flush=True)
    return records


def round_trip(requests: int) -> dict:
    server = Server().start()
    try:
        generator = torch.Generator().manual_seed(0)
        keys = torch.randn(8, 16384, 128, generator=generator)
        values = torch.randn(8, 16384, 128, generator=generator)
        queries = torch.randn(8, 4, 128, generator=generator)
        clients = {
            wire_name: Client(server.url, wire=wire_name) for wire_name in ("json", "safetensors")
        }
        context = clients["json"].create_context(8, 128)
        clients["json"].upload(context["id"], keys, values)
        times: dict[str, list[float]] = {name: [] for name in clients}
        for step in range(requests + 5):
            for name, client in clients.items():
                start = time.perf_counter()
                client.attend(context["id"], queries, mode="exact")
                if step >= 5:  # warm-up
                    times[name].append(time.perf_counter() - start)
        for client in clients.values():
            client.close()
    finally:
        server.kill()
    return {
        "what": "attend over HTTP (exact, 16384 tokens)",
        "shape": [8, 4, 128],
        "json_ms": statistics.median(times["json"]) * 1e3,
        "safetensors_ms": statistics.median(times["safetensors"]) * 1e3,
    }


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{r['what']}\n{tuple(r['shape'])}" for r in records]
    x = torch.arange(len(records)).float()
    ax.bar(x - 0.2, [r["json_ms"] for r in records], 0.4, label="base64 JSON", color="tab:gray")
    ax.bar(x + 0.2, [r["safetensors_ms"] for r in records], 0.4, label="safetensors",
           color="tab:blue")  # fmt: skip
    ax.set_xticks(x.tolist(), labels, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("ms")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--out", type=Path, default=RESULTS / "wire")
    args = parser.parse_args()
    records = codec(args.rounds)
    records.append(round_trip(args.requests))
    print(records[-1], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(records, indent=2) + "\n")
    plot(records, args.out.with_suffix(".png"))
    print(f"wrote {args.out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
