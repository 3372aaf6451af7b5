"""Admission under a burst: 32 clients send one slow request each at the same moment (exact
self-attention of 4096 rows over a 16384-token Poincare context, 2 heads, d = 16) to a real
`rewa serve`, once with the default `REWA_MAX_QUEUE_WAIT_S` (5 s) and once without a time
bound (admission by count only, as before). Per request: the status, the latency the client
saw, and the queue wait and compute time the server reported (`Server-Timing`).

Records `{"max_queue_wait_s", "clients", "accepted", "refused", "queue_p50_ms",
"queue_max_ms", "latency_p50_ms", "latency_max_ms", "refused_latency_max_ms",
"compute_p50_ms"}` in `benchmarks/results/admission.json`, and a PNG of every request's latency.

    .venv/bin/python benchmarks/admission.py
    .venv/bin/python benchmarks/admission.py --clients 3 --tokens 2048 --out /tmp/admission
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.service import start_server, stop_server

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
HEADS, DIM, TOKENS, ROWS = 2, 16, 16384, 4096
UNBOUNDED_S = 1e9


def make_context(url: str, tokens: int, rows: int) -> str:
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(HEADS, tokens, DIM, generator=generator) * 0.1
    values = torch.randn(HEADS, tokens, DIM, generator=generator)
    with httpx.Client(base_url=url, timeout=600) as client:
        context = client.post(
            "/v1/contexts",
            json={"geometry": {"name": "poincare"}, "heads": HEADS, "head_dim": DIM},
        ).json()["id"]
        upload = client.post(f"/v1/contexts/{context}/uploads").json()["upload_id"]
        client.post(
            f"/v1/contexts/{context}/uploads/{upload}/chunks",
            params={"tokens": tokens},
            content=keys.numpy().tobytes() + values.numpy().tobytes(),
            headers={"Content-Type": "application/octet-stream"},
        ).raise_for_status()
        client.post(f"/v1/contexts/{context}/uploads/{upload}/commit").raise_for_status()
        # Warm-up: the first exact call pays one-time costs.
        client.post(
            f"/v1/contexts/{context}/self-attention",
            json={"start": 0, "end": rows, "mode": "exact"},
        ).raise_for_status()
    return context


def burst(url: str, context: str, clients: int, rows: int) -> list[dict]:
    results: list[dict] = []
    lock = threading.Lock()
    go = threading.Event()

    def client() -> None:
        with httpx.Client(base_url=url, timeout=600) as session:
            go.wait()
            started = time.perf_counter()
            response = session.post(
                f"/v1/contexts/{context}/self-attention",
                json={"start": 0, "end": rows, "mode": "exact"},
            )
            latency = time.perf_counter() - started
        timing = dict(re.findall(r"(\w+);dur=([\d.]+)", response.headers.get("Server-Timing", "")))
        with lock:
            results.append(
                {
                    "status": response.status_code,
                    "latency_ms": latency * 1000,
                    "queue_ms": float(timing.get("queue", "nan")),
                    "compute_ms": float(timing.get("compute", "nan")),
                }
            )

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    go.set()
    for thread in threads:
        thread.join(600)
    return results


def summary(results: list[dict], max_queue_wait_s: float, clients: int) -> dict:
    accepted = [r for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] == 429]
    assert len(accepted) + len(refused) == len(results), {r["status"] for r in results}
    return {
        "max_queue_wait_s": None if max_queue_wait_s >= UNBOUNDED_S else max_queue_wait_s,
        "clients": clients,
        "accepted": len(accepted),
        "refused": len(refused),
        "queue_p50_ms": statistics.median(r["queue_ms"] for r in accepted),
        "queue_max_ms": max(r["queue_ms"] for r in accepted),
        "latency_p50_ms": statistics.median(r["latency_ms"] for r in accepted),
        "latency_max_ms": max(r["latency_ms"] for r in accepted),
        "refused_latency_max_ms": max((r["latency_ms"] for r in refused), default=None),
        "compute_p50_ms": statistics.median(r["compute_ms"] for r in accepted),
        "latencies_ms": sorted(round(r["latency_ms"], 1) for r in results),
        "statuses": sorted(r["status"] for r in results),
    }


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    for record in records:
        label = (
            "no time bound"
            if record["max_queue_wait_s"] is None
            else f"REWA_MAX_QUEUE_WAIT_S = {record['max_queue_wait_s']:g} s"
        )
        latencies = [ms / 1000 for ms in record["latencies_ms"]]
        axis.plot(range(1, len(latencies) + 1), latencies, marker="o", label=label)
    axis.set_xlabel("request (sorted by latency)")
    axis.set_ylabel("seconds until answered (200 or 429)")
    axis.set_title(f"{records[0]['clients']} slow requests at once")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=TOKENS, help="context length")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rows = min(ROWS, args.tokens)  # every request attends these rows to all tokens
    records = []
    with tempfile.TemporaryDirectory() as data_dir:
        for max_queue_wait_s in (5.0, UNBOUNDED_S):
            process, url = start_server(
                data_dir,
                batching=False,
                settings={
                    "REWA_MAX_QUEUE_WAIT_S": str(max_queue_wait_s),
                    "REWA_QUEUE_SIZE": "256",
                },
            )
            try:
                context = make_context(url, args.tokens, rows)
                results = burst(url, context, args.clients, rows)
                records.append(summary(results, max_queue_wait_s, args.clients))
                print(json.dumps({k: v for k, v in records[-1].items() if k != "latencies_ms"}))
            finally:
                stop_server(process)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "admission.json").write_text(json.dumps(records, indent=1) + "\n")
    plot(records, args.out / "admission.png")
    print("reproduce: .venv/bin/python benchmarks/admission.py")


if __name__ == "__main__":
    main()
