"""Deployment: the Kubernetes manifests against the Kubernetes schemas, their wiring, the
compose file, the Dockerfile, the image's Python environment built from the Dockerfile's own
steps in a fresh venv, and two `rewa serve` replicas sharing one Redis."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib

import kubernetes_validate
import pytest
import torch
import yaml

from rewa.attention import dense_attention, make_geometry
from rewa.clients import Client, RewaError
from rewa.service.metrics import Metrics
from rewa.service.settings import Settings
from tests.service_support import (
    REDIS_URL,
    ROOT,
    PrivateRedisCluster,
    Server,
    drop_prefix,
    redis_prefix,
)

K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.30.0"


def manifests() -> list[tuple[str, dict]]:
    return [
        (f"{path.name}:{document['kind']}", document)
        for path in sorted(K8S.glob("*.yaml"))
        for document in yaml.safe_load_all(path.read_text())
    ]


def by_kind(kind: str, name: str | None = None) -> dict:
    found = [doc for _, doc in manifests() if doc["kind"] == kind]
    if name is not None:
        found = [doc for doc in found if doc["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def env_of(container: dict) -> dict[str, dict]:
    return {item["name"]: item for item in container["env"]}


# -- Kubernetes --------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "document"), manifests(), ids=[n for n, _ in manifests()])
def test_every_manifest_validates_against_the_kubernetes_schema(name, document):
    kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)


def test_the_validator_rejects_a_broken_manifest():
    broken = json.loads(json.dumps(by_kind("Deployment")))
    broken["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["port"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)
    broken = json.loads(json.dumps(by_kind("Service", "rewa")))
    broken["spec"]["prots"] = broken["spec"].pop("ports")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_the_deployment_probes_drains_and_asks_for_a_gpu():
    deployment = by_kind("Deployment", "rewa")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    routes = set(_app().openapi()["paths"])
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez" in routes
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz" in routes
    assert container["startupProbe"]["httpGet"]["path"] == "/livez"
    # The grace period covers the preStop pause and the drain timeout, with room to spare.
    pause = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pause[0] == "sleep"
    drain = float(env_of(container)["REWA_DRAIN_TIMEOUT_S"]["value"])
    assert pod["terminationGracePeriodSeconds"] > float(pause[1]) + drain
    assert pod["securityContext"]["runAsNonRoot"] is True
    # Every REWA_* variable is a setting of the service.
    fields = {f"REWA_{name.upper()}" for name in Settings.model_fields}
    assert set(env_of(container)) <= fields


def test_every_pod_meets_the_restricted_pod_security_level():
    """What the Kubernetes "restricted" Pod Security Standard requires of each pod template:
    non-root, the runtime's seccomp profile, no privilege escalation, every capability
    dropped."""
    templates = [
        document["spec"]["template"]["spec"]
        for _, document in manifests()
        if document["kind"] in ("Deployment", "StatefulSet")
    ]
    assert len(templates) == 2
    for pod in templates:
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] > 0
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        for container in pod["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
            assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]


def test_a_disruption_budget_keeps_a_replica_serving():
    budget = by_kind("PodDisruptionBudget", "rewa")
    deployment = by_kind("Deployment", "rewa")
    assert budget["spec"]["selector"] == deployment["spec"]["selector"]
    assert 0 < budget["spec"]["minAvailable"] < deployment["spec"]["replicas"]


def _app():
    from rewa.service.app import create_app

    return create_app(Settings())


def test_the_manifests_reference_each_other_consistently():
    deployment = by_kind("Deployment", "rewa")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    port_names = {port["name"] for port in container["ports"]}

    service = by_kind("Service", "rewa")
    assert service["spec"]["selector"].items() <= labels.items()
    assert {port["targetPort"] for port in service["spec"]["ports"]} <= port_names

    env = env_of(container)
    secret_ref = env["REWA_API_KEYS"]["valueFrom"]["secretKeyRef"]
    secret = by_kind("Secret", secret_ref["name"])
    assert secret_ref["key"] in secret["stringData"]

    redis_host = re.match(r"redis://([^:/]+)", env["REWA_REDIS_URL"]["value"]).group(1)
    redis_service = by_kind("Service", redis_host)
    statefulset = by_kind("StatefulSet", redis_host)
    assert statefulset["spec"]["serviceName"] == redis_service["metadata"]["name"]
    (redis_container,) = statefulset["spec"]["template"]["spec"]["containers"]
    assert redis_container["args"][:2] == ["--appendonly", "yes"]

    hpa = by_kind("HorizontalPodAutoscaler", "rewa")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "rewa",
    }
    queue_gauge = Metrics().queue_depth._name
    pod_metrics = [
        m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"
    ]
    assert pod_metrics == [queue_gauge]
    assert queue_gauge in by_kind("ConfigMap", "prometheus-adapter-rewa")["data"]["config.yaml"]

    ingress = by_kind("Ingress", "rewa")
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend["name"] == "rewa" and backend["port"]["name"] in {
        port["name"] for port in service["spec"]["ports"]
    }
    hash_by = ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/upstream-hash-by"]
    from rewa.clients.http import ROUTING_HEADER

    assert hash_by == "$http_" + ROUTING_HEADER.lower().replace("-", "_")


# -- compose -----------------------------------------------------------------------------------


def test_compose_lists_every_setting_with_a_valid_value(monkeypatch):
    compose = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())
    rewa, redis_service = compose["services"]["rewa"], compose["services"]["redis"]
    env = rewa["environment"]
    assert set(env) == {f"REWA_{name.upper()}" for name in Settings.model_fields}
    for name, value in env.items():
        monkeypatch.setenv(name, re.sub(r"\$\{[A-Z_]+:-(.*)\}", r"\1", str(value)))
    settings = Settings()  # every value parses
    assert settings.redis_url == "redis://redis:6379/0"
    assert rewa["depends_on"]["redis"]["condition"] == "service_healthy"
    command = redis_service["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    (device,) = rewa["deploy"]["resources"]["reservations"]["devices"]
    assert device["capabilities"] == ["gpu"] and device["driver"] == "nvidia"
    assert rewa["build"]["context"] == ".." and "VARIANT" in rewa["build"]["args"]
    assert float(rewa["stop_grace_period"].rstrip("s")) > settings.drain_timeout_s
    # Open by default (no API keys), so published on the loopback interface only by default.
    assert settings.api_keys == ""
    (port,) = rewa["ports"]
    assert re.sub(r"\$\{[A-Z_]+:-(.*?)\}", r"\1", port) == "127.0.0.1:8000:8000"


# -- Dockerfile --------------------------------------------------------------------------------


def dockerfile() -> list[tuple[str, str]]:
    """`(instruction, arguments)` of the Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [tuple(line.split(None, 1)) for line in lines if line and not line.startswith("#")]  # type: ignore[misc]


def test_the_dockerfile_builds_the_gpu_image_as_a_non_root_service():
    instructions = dockerfile()
    froms = [arguments for name, arguments in instructions if name == "FROM"]
    assert re.match(r"nvidia/cuda:12[\d.]*-runtime-ubuntu[\d.]+ AS base-gpu", froms[0])
    assert froms[1].endswith("AS base-cpu") and froms[-1] == "base-${VARIANT}"
    assert ("ARG", "VARIANT=gpu") in instructions
    user = [arguments for name, arguments in instructions if name == "USER"]
    assert user and user[-1] not in ("root", "0")
    (healthcheck,) = [arguments for name, arguments in instructions if name == "HEALTHCHECK"]
    assert "/livez" in healthcheck and "--fail" in healthcheck
    (entrypoint,) = [arguments for name, arguments in instructions if name == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ["rewa", "serve"]
    runs = [arguments for name, arguments in instructions if name == "RUN"]
    assert any(run.startswith("make install ") for run in runs)


def test_the_image_installs_the_requirements_before_it_copies_the_sources():
    """Editing a source file must not invalidate the layer that installs torch and FAISS."""
    instructions = dockerfile()
    deps = next(i for i, (name, a) in enumerate(instructions) if a.startswith("make deps "))
    copied_before = [
        source
        for name, arguments in instructions[:deps]
        if name == "COPY"
        for source in shlex.split(arguments)[:-1]
    ]
    assert sorted(copied_before) == ["Makefile", "pyproject.toml"]


def test_every_imported_package_is_declared():
    """Third-party modules the clients import are in pyproject's dependencies (what `pip install
    rewa` brings), those of the service in its `service` extra, and those of rewa.llm in `llm`."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    declared = {
        "clients": project["dependencies"],
        "service": project["dependencies"] + extras["service"],
        "llm": extras["llm"],
    }
    imported = {
        "clients": ("safetensors", "httpx", "numpy"),
        "service": ("fastapi_offline", "fastapi", "uvicorn", "redis", "torch", "safetensors"),
        "llm": ("transformers", "torch"),
    }
    for package, modules in imported.items():
        sources = "\n".join(p.read_text() for p in (ROOT / package).glob("*.py"))
        names = {re.split(r"[<>=\[]", requirement)[0] for requirement in declared[package]}
        for module in modules:
            assert re.search(rf"^\s*(from|import) {module}\b", sources, re.MULTILINE), module
            assert module.replace("_", "-") in names, (package, module)


def test_the_client_imports_without_the_service_or_torch():
    """`import rewa.clients` loads none of torch, fastapi, redis or uvicorn (a client-only
    install has none of them; tests/test_client.py uses a client with torch blocked)."""
    code = (
        "import sys, rewa.clients; "
        "print(sorted({m.partition('.')[0] for m in sys.modules} & "
        "{'torch', 'fastapi', 'redis', 'uvicorn', 'transformers'}))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert loaded.stdout.strip() == "[]"


def test_the_serving_core_never_imports_the_research_code():
    """rewa.research builds on rewa.attention; the service, the index and the LLM memory path
    load none of it (docs/design.md, "Layout")."""
    code = (
        "import sys, rewa.attention, rewa.index, rewa.service.app, rewa.llm; "
        "print(sorted(m for m in sys.modules if m.startswith('rewa.research')))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert loaded.stdout.strip() == "[]"
    research = subprocess.run(
        [sys.executable, "-c", "import rewa.research as r; print(len(r.__all__))"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert int(research.stdout) > 20


def copied_paths() -> list[str]:
    return [
        source
        for name, arguments in dockerfile()
        if name == "COPY"
        for source in shlex.split(arguments)[:-1]
    ]


def test_the_image_copies_every_package_and_the_dockerignore_keeps_them():
    copied = {path.rstrip("/") for path in copied_paths()}
    pyproject = (ROOT / "pyproject.toml").read_text()
    package_dirs = set(re.findall(r'"rewa\.\w+" = "(\w+)"', pyproject))
    assert package_dirs == {"attention", "index", "service", "clients", "llm", "research"}
    assert package_dirs | {"Makefile", "pyproject.toml", "README.md"} <= copied
    kept = {
        line[1:].rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    assert copied <= kept


@pytest.fixture(scope="module")
def image_environment(tmp_path_factory):
    """What the Dockerfile builds, here: its COPY sources into a fresh directory, then its
    `make install` line (VARIANT=cpu; torch from the configured index) into a fresh venv."""
    if shutil.which("make") is None:
        pytest.fail("make is missing")
    root = tmp_path_factory.mktemp("image")
    source, venv = root / "opt-rewa", root / "venv"
    source.mkdir()
    for path in copied_paths():
        origin = ROOT / path
        if origin.is_dir():
            shutil.copytree(origin, source / path, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(origin, source / path)
    makes = [a for name, a in dockerfile() if name == "RUN" and a.startswith("make ")]
    assert [shlex.split(run)[1] for run in makes] == ["deps", "install"]
    for run in makes:
        make = shlex.split(run.split("&&")[0])
        arguments = [a for a in make if not a.startswith(("VENV=", "VARIANT=", "TORCH_"))]
        command = [*arguments, f"VENV={venv}", "VARIANT=cpu"]
        finished = subprocess.run(command, cwd=source, capture_output=True, text=True, timeout=900)
        assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    return source, venv


def test_the_image_environment_installs_and_serves_from_a_fresh_venv(image_environment, tmp_path):
    source, venv = image_environment
    packages = subprocess.run(
        [venv / "bin" / "python", "-m", "pip", "list", "--format", "json"],
        capture_output=True,
        text=True,
        check=True,
    )
    installed = {p["name"].lower(): p["version"] for p in json.loads(packages.stdout)}
    assert installed["torch"].split("+")[0] == "2.13.0"
    assert "faiss-cpu" in installed and "faiss-gpu-cu12" not in installed
    assert "pytest" not in installed  # the service's requirements, not the dev extra
    # The server runs from that venv and imports rewa from the copied sources.
    where = subprocess.run(
        [venv / "bin" / "python", "-c", "import rewa.service; print(rewa.service.__file__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=True,
    )
    assert where.stdout.startswith(str(source))
    server = Server(data_dir=tmp_path / "data")
    server.command = [str(venv / "bin" / "rewa"), "serve"]
    server.start()
    try:
        _assert_serves_attention(server.url)
    finally:
        server.kill()


def _assert_serves_attention(url: str) -> None:
    generator = torch.Generator().manual_seed(3)
    keys, values = torch.randn(2, 3000, 16, generator=generator), torch.randn(2, 3000, 16)
    queries = torch.randn(2, 5, 16, generator=generator)
    with Client(url) as client:
        assert client.ready()
        context = client.create_context(2, 16, index={"kind": "ivf", "top_k": 32})
        client.upload(context["id"], keys, values, chunk_tokens=1000)
        result = client.attend(context["id"], queries, mode="exact")
        ids = client.search(context["id"], queries, top_k=4).ids
    out, lse = dense_attention(queries, keys, values, make_geometry("dot", 16))
    torch.testing.assert_close(result.out, out, rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(result.lse, lse, rtol=1e-4, atol=2e-5)
    assert ids.shape == (2, 5, 4)


# -- scale-out ---------------------------------------------------------------------------------


def test_two_replicas_share_one_redis():
    prefix = redis_prefix()
    settings = {"redis_url": REDIS_URL, "redis_prefix": prefix}
    a, b = Server(**settings).start(), Server(**settings).start()
    try:
        generator = torch.Generator().manual_seed(5)
        keys, values = torch.randn(2, 4000, 16, generator=generator), torch.randn(2, 4000, 16)
        queries = torch.randn(2, 8, 16, generator=generator)
        with Client(a.url) as through_a, Client(b.url) as through_b:
            context = through_a.create_context(2, 16, index={"kind": "ivf", "top_k": 32})
            through_a.upload(context["id"], keys, values, chunk_tokens=1500)
            assert through_b.get_context(context["id"])["n_tokens"] == 4000
            # Built on A (tail: clusters, topk: IVF), stored, loaded by B: identical results.
            results = {}
            for mode in ("exact", "tail", "topk"):
                from_a = through_a.attend(context["id"], queries, mode=mode, return_topk=3)
                from_b = through_b.attend(context["id"], queries, mode=mode, return_topk=3)
                for field in ("out", "lse", "ids", "weights"):
                    assert torch.equal(getattr(from_a, field), getattr(from_b, field)), (
                        mode,
                        field,
                    )
                results[mode] = from_b

            # A delete through B is seen by A, which had the context loaded.
            doomed = through_a.create_context(2, 16)
            through_a.upload(doomed["id"], keys[:, :100], values[:, :100])
            through_a.attend(doomed["id"], queries, mode="exact")
            through_b.delete_context(doomed["id"])
            for call in (
                lambda: through_a.get_context(doomed["id"]),
                lambda: through_a.attend(doomed["id"], queries, mode="exact"),
            ):
                with pytest.raises(RewaError) as missing:
                    call()
                assert missing.value.status == 404

            # A dies; B keeps serving, the same results and new work.
            a.kill()
            for mode, expected in results.items():
                again = through_b.attend(context["id"], queries, mode=mode, return_topk=3)
                assert torch.equal(again.out, expected.out), mode
            fresh = through_b.create_context(2, 16)
            through_b.upload(fresh["id"], keys[:, :500], values[:, :500])
            assert {c["id"] for c in through_b.list_contexts()} == {context["id"], fresh["id"]}
    finally:
        a.kill()
        b.kill()
        drop_prefix(prefix)


def test_a_replica_on_redis_cluster_serves_contexts_spread_over_its_nodes():
    cluster = PrivateRedisCluster().start()
    server = Server(redis_url=cluster.url, redis_cluster="true").start()
    try:
        generator = torch.Generator().manual_seed(7)
        keys, values = torch.randn(2, 3000, 16, generator=generator), torch.randn(2, 3000, 16)
        queries = torch.randn(2, 6, 16, generator=generator)
        expected = dense_attention(queries, keys, values, make_geometry("dot", 16))
        with Client(server.url) as client:
            assert client.ready()
            contexts = [client.create_context(2, 16, index={"kind": "ivf", "top_k": 32})]
            # Twelve contexts of random ids: all on one of the three nodes once in 3^11.
            contexts += [client.create_context(2, 16) for _ in range(11)]
            # Several chunks and pieces, one transactional commit, indexes stored as blobs.
            client.upload(contexts[0]["id"], keys, values, chunk_tokens=700)
            exact = client.attend(contexts[0]["id"], queries, mode="exact")
            torch.testing.assert_close(exact.out, expected[0], rtol=1e-4, atol=2e-5)
            torch.testing.assert_close(exact.lse, expected[1], rtol=1e-4, atol=2e-5)
            for mode in ("tail", "topk"):
                assert client.attend(contexts[0]["id"], queries, mode=mode).out.shape == (2, 6, 16)
            listed = {c["id"]: c["n_tokens"] for c in client.list_contexts()}
            assert listed == {c["id"]: (3000 if c is contexts[0] else 0) for c in contexts}
            assert sum(count > 0 for count in cluster.keys_per_node()) >= 2  # really spread
            client.delete_context(contexts[0]["id"])
            with pytest.raises(RewaError) as missing:
                client.attend(contexts[0]["id"], queries, mode="exact")
            assert missing.value.status == 404
    finally:
        server.kill()
        cluster.cleanup()
