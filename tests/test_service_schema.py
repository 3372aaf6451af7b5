"""A bounded schemathesis run against real servers on both stores, with API keys: every
operation of the OpenAPI document is called with generated valid and invalid requests (and
stateful chains through its links), and every response must conform to the document: no 5xx,
documented statuses, content types, headers and bodies, invalid input refused, authentication
enforced. Settings: tests/schemathesis.toml."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.service_support import REDIS_URL, Server, drop_prefix, redis_prefix

CONFIG = Path(__file__).with_name("schemathesis.toml")
KEY = "schemathesis-key"
SEED = 20261123


@pytest.mark.parametrize("store", ["embedded", "redis"])
def test_every_operation_conforms_to_the_openapi_document(store):
    settings = {"api_keys": KEY}
    prefix = None
    if store == "redis":
        prefix = redis_prefix()
        settings |= {"redis_url": REDIS_URL, "redis_prefix": prefix}
    server = Server(**settings).start()
    st = shutil.which("st", path=str(Path(sys.executable).parent))
    assert st, "schemathesis is missing: run `make test`, which installs it"
    try:
        run = subprocess.run(
            [
                st, "--config-file", str(CONFIG), "run", f"{server.url}/openapi.json",
                "--checks", "all", "--exclude-checks", "ensure_resource_availability",
                "--seed", str(SEED), "--no-color",
                "--header", f"Authorization: Bearer {KEY}",
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )  # fmt: skip
        assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
        assert " passed" in run.stdout and "failure" not in run.stdout.split("SUMMARY")[-1]
        assert server.process.poll() is None  # the server is still up
    finally:
        server.kill()
        if prefix:
            drop_prefix(prefix)
