"""The HTTP service under load: upload time of a 131072-token context (8 heads, d = 64) and
decode-style attend requests (8 heads x 1 query) from 1, 8 and 32 concurrent clients, with
batching on and off, sparse (`tail`, the default mode) and exact.

Each configuration runs against a real `rewa serve` process (embedded store under a temporary
REWA_DATA_DIR; the batching-off server is a second process over the same directory). Clients
are threads of this process with one HTTP connection each, on the same 2-core machine as the
server, so they compete with it for CPU. Every client sends a fixed number of requests after a
warm-up; latency is per request as the client sees it. Records: `{"mode", "clients",
"batching", "exact", "p50_ms", "p99_ms", "requests_per_s", "server_cpu_ms_per_request",
"client_cpu_ms_per_request"}` (CPU time of the server process and of the clients' process
over the measured requests, divided by their number) plus one `{"mode": "upload", "seconds",
"tokens", "bytes"}`, in `benchmarks/results/service.json`, and a PNG.

The audit's cost (docs/service.md, "The audit"): two more servers with batching over the same
directory, one with `REWA_AUDIT_EVERY=64` and one without, are loaded in turn, client count by
client count, with `AUDIT_REQUESTS` tail requests per client (enough for audited rows at one in
64; `--audit-requests`), in two passes over the client counts: the first pays for the cuts the
audit makes, the second runs after them; records `{"mode": "audit", "pass", "audit_every",
"clients", "requests", ...,
"audited_rows", "skipped_calls", "cuts", "settled_heads"}` (the rows the audit answered
exactly during the measurement, the calls whose rows it skipped and the heads it cut again,
from the server's metrics, and the heads settled by then: halved, and not mended by it).

    .venv/bin/python benchmarks/service.py
    .venv/bin/python benchmarks/service.py --tokens 16384 --requests 10 --out /tmp/service
    .venv/bin/python benchmarks/service.py --sparse-threads 2 --out /tmp/service-2-threads
    .venv/bin/python benchmarks/service.py --clients 1 8 --out /tmp/service-few-clients
"""

from __future__ import annotations

import argparse
import base64
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import torch

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
HEADS, DIM = 8, 64
CHUNK_TOKENS = 8192
CLIENT_COUNTS = [1, 8, 32]
AUDIT_EVERY = 64  # the audit measured: one query row in this many (docs/service.md)
AUDIT_REQUESTS = 128  # tail requests per client in the audit's measurement


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(
    data_dir: str,
    batching: bool,
    sparse_threads: int | None = None,
    settings: dict[str, str] | None = None,
) -> tuple[subprocess.Popen, str]:
    """A `rewa serve` process over `data_dir`; `settings`: more `REWA_*` variables."""
    port = free_port()
    env = {
        **os.environ,
        "REWA_PORT": str(port),
        "REWA_DATA_DIR": data_dir,
        "REWA_BATCHING": "true" if batching else "false",
        "REWA_QUEUE_SIZE": "1024",
        **(settings or {}),
    }
    if sparse_threads is not None:
        env["REWA_SPARSE_THREADS"] = str(sparse_threads)
    process = subprocess.Popen(
        [sys.executable, "-m", "rewa.clients.cli", "serve"],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/livez", timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError("the server did not start")


def stop_server(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    process.wait(60)


def upload(url: str, tokens: int) -> tuple[str, float, int]:
    """Create the context and upload random keys and values as raw chunks; `(id, seconds,
    bytes)`."""
    generator = torch.Generator().manual_seed(0)
    with httpx.Client(base_url=url, timeout=600) as client:
        context = client.post(
            "/v1/contexts",
            json={"geometry": {"name": "dot"}, "heads": HEADS, "head_dim": DIM},
        ).json()
        chunks = [
            (
                torch.randn(HEADS, n, DIM, generator=generator),
                torch.randn(HEADS, n, DIM, generator=generator),
            )
            for n in [min(CHUNK_TOKENS, tokens - s) for s in range(0, tokens, CHUNK_TOKENS)]
        ]
        bodies = [k.numpy().tobytes() + v.numpy().tobytes() for k, v in chunks]
        start = time.perf_counter()
        upload_id = client.post(f"/v1/contexts/{context['id']}/uploads").json()["upload_id"]
        for (k, _), body in zip(chunks, bodies, strict=True):
            response = client.post(
                f"/v1/contexts/{context['id']}/uploads/{upload_id}/chunks",
                params={"tokens": k.shape[1]},
                content=body,
                headers={"Content-Type": "application/octet-stream"},
            )
            response.raise_for_status()
        client.post(f"/v1/contexts/{context['id']}/uploads/{upload_id}/commit").raise_for_status()
        seconds = time.perf_counter() - start
    return context["id"], seconds, sum(len(body) for body in bodies)


def wait_for_index(url: str, context_id: str) -> None:
    """Until the server has the context's tail clusters: the first server builds them in the
    background after the commit, the second (another process over the same directory) when it
    first loads the context. Without the wait, the warm-up's first attend queues behind that
    build (past REWA_MAX_QUEUE_WAIT_S), and the measured attends may read every key exactly
    while it runs (`EXACT_WHILE_BUILDING`)."""
    with httpx.Client(base_url=url, timeout=600) as client:
        client.post(f"/v1/contexts/{context_id}/index", json={"modes": ["tail"]}).raise_for_status()


def decode_request(generator: torch.Generator) -> dict:
    queries = torch.randn(HEADS, 1, DIM, generator=generator)
    return {
        "dtype": "float32",
        "shape": [HEADS, 1, DIM],
        "data": base64.b64encode(queries.numpy().tobytes()).decode(),
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux `/proc`)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def load(
    url: str, context_id: str, clients: int, requests: int, exact: bool, server_pid: int
) -> dict:
    """Each client sends `requests` attend requests back to back; latencies, throughput and
    the CPU time per request of the server process and of this (the clients') process."""
    latencies: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(clients + 1)

    def client_loop(number: int) -> None:
        generator = torch.Generator().manual_seed(number)
        bodies = [{"queries": decode_request(generator), "exact": exact} for _ in range(requests)]
        own = []
        with httpx.Client(base_url=url, timeout=120) as client:
            client.get("/livez")
            barrier.wait()
            for body in bodies:
                start = time.perf_counter()
                response = client.post(f"/v1/contexts/{context_id}/attend", json=body)
                own.append(time.perf_counter() - start)
                if response.status_code != 200:
                    with lock:
                        failures.append(response.text[:200])
        with lock:
            latencies.extend(own)

    threads = [threading.Thread(target=client_loop, args=(n,)) for n in range(clients)]
    for thread in threads:
        thread.start()
    barrier.wait()
    start = time.perf_counter()
    server_start, clients_start = cpu_seconds(server_pid), time.process_time()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    server_cpu = cpu_seconds(server_pid) - server_start
    clients_cpu = time.process_time() - clients_start
    if failures:
        raise RuntimeError(f"{len(failures)} requests failed, e.g. {failures[0]}")
    values = np.array(latencies) * 1000
    return {
        "p50_ms": float(np.percentile(values, 50)),
        "p99_ms": float(np.percentile(values, 99)),
        "requests_per_s": len(latencies) / elapsed,
        "server_cpu_ms_per_request": server_cpu * 1000 / len(latencies),
        "client_cpu_ms_per_request": clients_cpu * 1000 / len(latencies),
    }


def audit_counts(url: str, context_id: str) -> tuple[int, int, int, int]:
    """`(rows audited so far, calls whose rows were skipped, heads cut, heads settled)` of a
    server: its errors observed (`rewa_audit_error`, one per head and row) over the context's
    heads, its counters, and the heads its audit settled (halved, and not mended by it). The
    errors an audit report keeps are no count: a head's are forgotten when the audit cuts it."""
    with httpx.Client(base_url=url, timeout=60) as client:
        state = client.get(f"/v1/contexts/{context_id}/index").raise_for_status().json()
        metrics = client.get("/metrics").raise_for_status().text
    heads = state["audit"] or []
    errors = _metric(metrics, "rewa_audit_error_count")
    rows = round(errors / len(heads)) if heads else 0
    skipped = round(_metric(metrics, "rewa_audits_skipped_total"))
    cuts = round(_metric(metrics, "rewa_audit_cuts_total"))
    return rows, skipped, cuts, sum(head["settled"] for head in heads)


def _metric(metrics: str, name: str) -> float:
    """The sum of the samples of `name` in a Prometheus text exposition (0 when none)."""
    return sum(
        float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(name + " ")
    )


def run_audit(
    data_dir: str,
    context_id: str,
    sparse_threads: int | None,
    client_counts: list[int],
    requests: int,
) -> list[dict]:
    """`requests` tail requests per client against a server auditing one row in `AUDIT_EVERY`
    and one not, in turn per client count, in two passes: the second after the audit's
    cuts of the first (module docstring)."""
    records = []
    servers = {
        every: start_server(data_dir, True, sparse_threads, {"REWA_AUDIT_EVERY": str(every)})
        for every in (0, AUDIT_EVERY)
    }
    try:
        for process, url in servers.values():
            wait_for_index(url, context_id)
            load(url, context_id, 1, 3, False, process.pid)
        for measured_pass, clients in itertools.product((1, 2), client_counts):
            for every, (process, url) in servers.items():
                before = audit_counts(url, context_id)
                measured = load(url, context_id, clients, requests, False, process.pid)
                after = audit_counts(url, context_id)
                record = {"mode": "audit", "pass": measured_pass, "audit_every": every}
                record["clients"] = clients
                record |= {"requests": requests * clients, **measured}
                record["audited_rows"] = after[0] - before[0]
                record["skipped_calls"] = after[1] - before[1]
                record["cuts"] = after[2] - before[2]
                record["settled_heads"] = after[3]
                records.append(record)
                print(json.dumps(record), flush=True)
    finally:
        for process, _ in servers.values():
            stop_server(process)
    return records


def run(
    tokens: int,
    requests: int,
    sparse_threads: int | None,
    client_counts: list[int],
    audit_requests: int = AUDIT_REQUESTS,
) -> list[dict]:
    records = []
    with tempfile.TemporaryDirectory(prefix="rewa-bench-") as data_dir:
        for batching in (True, False):
            process, url = start_server(data_dir, batching, sparse_threads)
            try:
                if batching:
                    context_id, seconds, size = upload(url, tokens)
                    records.append(
                        {"mode": "upload", "seconds": seconds, "tokens": tokens, "bytes": size}
                    )
                    print(json.dumps(records[-1]), flush=True)
                wait_for_index(url, context_id)
                for exact in (False, True):
                    # Warm-up (the index is built: `wait_for_index`).
                    load(url, context_id, 1, 3, exact, process.pid)
                    for clients in client_counts:
                        measured = load(url, context_id, clients, requests, exact, process.pid)
                        record = {
                            "mode": "exact" if exact else "tail",
                            "clients": clients,
                            "batching": batching,
                            "exact": exact,
                            **measured,
                        }
                        records.append(record)
                        print(json.dumps(record), flush=True)
            finally:
                stop_server(process)
        records += run_audit(data_dir, context_id, sparse_threads, client_counts, audit_requests)
    return records


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for exact in (False, True):
        for batching in (True, False):
            rows = sorted(
                (r for r in records if r.get("exact") == exact and r.get("batching") == batching),
                key=lambda r: r["clients"],
            )
            label = f"{'exact' if exact else 'tail'}, batching {'on' if batching else 'off'}"
            clients = [r["clients"] for r in rows]
            left.plot(clients, [r["requests_per_s"] for r in rows], marker="o", label=label)
            right.plot(clients, [r["p99_ms"] for r in rows], marker="o", label=label)
    audits = {(r["pass"], r["audit_every"]) for r in records if r["mode"] == "audit"}
    for measured_pass, every in sorted(audits):
        rows = [
            r
            for r in records
            if r["mode"] == "audit" and r["pass"] == measured_pass and r["audit_every"] == every
        ]
        audit = "off" if not every else f"1 in {every}"
        label = f"tail, audit {audit} (their own run, pass {measured_pass})"
        clients = [r["clients"] for r in rows]
        left.plot(clients, [r["requests_per_s"] for r in rows], "--", marker="x", label=label)
        right.plot(clients, [r["p99_ms"] for r in rows], "--", marker="x", label=label)
    for axis, title in ((left, "throughput (requests/s)"), (right, "p99 latency (ms)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent clients")
        axis.set_title(title)
        axis.legend(fontsize=7)
    right.axhline(250, color="grey", linewidth=0.8)
    figure.suptitle("decode-style attend, 131072-token context, 8 heads x 1 query, d = 64")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--requests", type=int, default=20, help="per client")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--sparse-threads", type=int, default=None, help="REWA_SPARSE_THREADS of the servers"
    )
    parser.add_argument(
        "--clients", type=int, nargs="+", default=CLIENT_COUNTS, help="concurrent clients"
    )
    parser.add_argument(
        "--audit-requests",
        type=int,
        default=AUDIT_REQUESTS,
        help="per client, in the audit's measurement",
    )
    args = parser.parse_args()
    records = run(
        args.tokens, args.requests, args.sparse_threads, args.clients, args.audit_requests
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "service.json").write_text(json.dumps(records, indent=1))
    plot(records, args.out / "service.png")


if __name__ == "__main__":
    main()
