"""Support for the service tests: real `rewa serve` processes (uvicorn) on free ports, a real
Redis server, and small helpers to move tensors over HTTP."""

from __future__ import annotations

import base64
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import redis
import torch

from rewa.service import wire

REDIS_URL = os.environ.get("REWA_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """A `rewa serve` subprocess with the given `REWA_*` settings. Unless told otherwise its
    attends wait for the index builds they need (`exact_while_building=0`), so that the tests
    comparing answers with the library's do not depend on when a build ends; the default is
    tested on its own (test_service.py)."""

    def __init__(self, **settings) -> None:
        settings.setdefault("exact_while_building", 0)
        self.port = settings.pop("port", None) or free_port()
        self.settings = {f"REWA_{key.upper()}": str(value) for key, value in settings.items()}
        self.process: subprocess.Popen | None = None
        self.command = [sys.executable, "-m", "rewa.clients.cli", "serve"]
        handle, name = tempfile.mkstemp(prefix="rewa-server-", suffix=".log")
        os.close(handle)
        self.log_path = Path(name)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60) -> Server:
        env = {**os.environ, **self.settings, "REWA_PORT": str(self.port)}
        env.setdefault("REWA_HOST", "127.0.0.1")
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command,
                env=env,
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited early:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/livez", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"the server did not start:\n{self.output()}")

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self, timeout: float = 30) -> bool:
        """SIGTERM; True when the process then shut down gracefully (uvicorn drains, runs the
        shutdown, logs "Finished server process" and re-raises the signal, so the exit status
        is -SIGTERM)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        status = self.process.wait(timeout)
        return status in (0, -signal.SIGTERM) and "Finished server process" in self.output()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def client(self, api_key: str | None = None, timeout: float = 120) -> httpx.Client:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)


def redis_prefix() -> str:
    """A fresh key prefix, so tests sharing the Redis server never see each other's keys."""
    return f"rewa-test-{uuid.uuid4().hex[:12]}"


def drop_prefix(prefix: str) -> None:
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        client.delete(*keys)


class PrivateRedis:
    """A redis-server of our own on a free port (for outage tests), with its data in a
    temporary directory (append-only file on, so a restart keeps what was committed)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.directory = tempfile.mkdtemp(prefix="rewa-redis-")
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> PrivateRedis:
        executable = shutil.which("redis-server")
        assert executable, "redis-server is missing: run `make redis`"
        self.process = subprocess.Popen(
            [
                executable,
                "--bind", "127.0.0.1",
                "--port", str(self.port),
                "--dir", self.directory,
                "--appendonly", "yes",
                "--appendfsync", "always",
                "--save", "",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        client = redis.Redis.from_url(self.url)
        for _ in range(100):
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("the private redis-server did not start")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


class PrivateRedisCluster:
    """A Redis Cluster of our own: `masters` redis-server processes in cluster mode on free
    ports, no replicas, every slot assigned (`redis-cli --cluster create`)."""

    def __init__(self, masters: int = 3) -> None:
        self.ports = [_free_cluster_port() for _ in range(masters)]
        self.directory = tempfile.mkdtemp(prefix="rewa-redis-cluster-")
        self.processes: list[subprocess.Popen] = []

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def start(self, timeout: float = 30) -> PrivateRedisCluster:
        server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        assert server and cli, "redis-server / redis-cli are missing: run `make redis`"
        for port in self.ports:
            node = Path(self.directory) / str(port)
            node.mkdir()
            arguments = ["--bind", "127.0.0.1", "--port", str(port), "--dir", str(node)]
            arguments += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
            arguments += ["--appendonly", "no", "--save", ""]
            self.processes.append(
                subprocess.Popen(
                    [server, *arguments], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
            )
        for port in self.ports:
            _wait_for_redis(f"redis://127.0.0.1:{port}/0", timeout)
        nodes = [f"127.0.0.1:{port}" for port in self.ports]
        subprocess.run(
            [cli, "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=timeout,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = [redis.Redis(port=port).cluster("info") for port in self.ports]
            if all(state.get("cluster_state") == "ok" for state in states):
                return self
            time.sleep(0.1)
        raise RuntimeError("the private Redis Cluster did not become ready")

    def keys_per_node(self) -> list[int]:
        return [redis.Redis(port=port).dbsize() for port in self.ports]

    def cleanup(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait(10)
        shutil.rmtree(self.directory, ignore_errors=True)


def _free_cluster_port() -> int:
    """A free port p below 55536 whose cluster bus port p + 10000 is free too."""
    for _ in range(1000):
        port = random.randrange(20000, 30000)
        try:
            with socket.socket() as first, socket.socket() as bus:
                first.bind(("127.0.0.1", port))
                bus.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair for a Redis Cluster node")


def _wait_for_redis(url: str, timeout: float) -> None:
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            client.ping()
            return
        except redis.ConnectionError:
            time.sleep(0.05)
    raise RuntimeError(f"redis-server at {url} did not start")


# -- tensors over HTTP -----------------------------------------------------------------------


def encode(tensor: torch.Tensor) -> dict:
    return wire.encode(tensor)


def decode(payload: dict) -> torch.Tensor:
    return wire.from_bytes(
        base64.b64decode(payload["data"]),
        payload["dtype"],
        tuple(payload["shape"]),
        "response",
    )


def create_context(client: httpx.Client, **spec) -> dict:
    body = {"geometry": {"name": "dot"}, "heads": 2, "head_dim": 16, **spec}
    response = client.post("/v1/contexts", json=body)
    assert response.status_code == 201, response.text
    return response.json()


def upload(
    client: httpx.Client,
    context_id: str,
    keys: torch.Tensor,
    values: torch.Tensor,
    chunk: int = 1000,
    binary: bool = True,
) -> dict:
    """Upload `(H, N, d)` keys and values in chunks (alternating JSON and raw bodies unless
    `binary`), commit, and return the committed context."""
    upload_id = client.post(f"/v1/contexts/{context_id}/uploads").json()["upload_id"]
    for number, start in enumerate(range(0, keys.shape[1], chunk)):
        k, v = keys[:, start : start + chunk], values[:, start : start + chunk]
        path = f"/v1/contexts/{context_id}/uploads/{upload_id}/chunks"
        if binary or number % 2:
            raw = k.contiguous().numpy().tobytes() + v.contiguous().numpy().tobytes()
            response = client.post(
                path,
                params={"tokens": k.shape[1]},
                content=raw,
                headers={"Content-Type": "application/octet-stream"},
            )
        else:
            response = client.post(path, json={"keys": encode(k), "values": encode(v)})
        assert response.status_code == 200, response.text
    response = client.post(f"/v1/contexts/{context_id}/uploads/{upload_id}/commit")
    assert response.status_code == 200, response.text
    return response.json()


def attend(client: httpx.Client, context_id: str, queries: torch.Tensor, **options):
    response = client.post(
        f"/v1/contexts/{context_id}/attend", json={"queries": encode(queries), **options}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    return decode(body["out"]), decode(body["lse"]), body
