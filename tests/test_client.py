"""`rewa.clients` against a live `rewa serve`: every method of `Client` and `AsyncClient`,
error mapping, retries on 429 / 503 (a stub server), the CLI commands end to end, and
`RemoteMemory` merged with local attention equal to dense attention."""

from __future__ import annotations

import asyncio
import http.server
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch

from rewa.attention import dense_attention, make_geometry
from rewa.clients import (
    AsyncClient,
    Client,
    InlineResult,
    RemoteMemory,
    RewaConnectionError,
    RewaError,
    ShardedMemory,
    cli,
    merge_attention,
)
from rewa.index import exact_topk
from tests.service_support import Server, free_port

H, N, D = 2, 1200, 16


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = Server(data_dir=tmp_path_factory.mktemp("data")).start()
    yield running
    running.kill()


@pytest.fixture(scope="module")
def data():
    generator = torch.Generator().manual_seed(11)
    keys = torch.randn(H, N, D, generator=generator)
    values = torch.randn(H, N, D, generator=generator)
    queries = torch.randn(H, 4, D, generator=generator)
    return keys, values, queries


def _close(actual, expected, atol=2e-5):
    torch.testing.assert_close(torch.as_tensor(actual), expected, rtol=1e-4, atol=atol)


def test_the_client_covers_every_endpoint_and_matches_the_library(server, data):
    keys, values, queries = data
    geometry = make_geometry("dot", D)
    with Client(server.url) as client:
        assert client.livez() and client.ready()
        context = client.create_context(H, D, name="doc", index={"kind": "flat", "top_k": 32})
        assert context["n_tokens"] == 0
        assert context["id"] in [c["id"] for c in client.list_contexts()]
        # Small chunks travel as JSON, large ones as raw bytes; numpy and torch both go in.
        seen = []
        first_keys, first_values = keys[:, :200].numpy(), values[:, :200].numpy()
        client.upload(context["id"], first_keys, first_values, chunk_tokens=100,
                      progress=lambda done, total: seen.append((done, total)))  # fmt: skip
        assert seen == [(100, 200), (200, 200)]
        committed = client.upload(context["id"], keys[:, 200:], values[:, 200:], chunk_tokens=600)
        assert (committed["n_tokens"], committed["version"]) == (N, 2)
        assert client.get_context(context["id"])["n_tokens"] == N

        expected_out, expected_lse = dense_attention(queries, keys, values, geometry)
        result = client.attend(context["id"], queries, exact=True, return_topk=5)
        assert isinstance(result.out, torch.Tensor) and result.mode == "exact"
        _close(result.out, expected_out)
        _close(result.lse, expected_lse)
        best = torch.stack([exact_topk(queries[h], keys[h], geometry, 5) for h in range(H)])
        assert torch.equal(result.ids, best)
        as_numpy = client.attend(context["id"], queries.numpy(), mode="exact")
        assert isinstance(as_numpy.out, np.ndarray)
        _close(as_numpy.out, expected_out)
        tail = client.attend(context["id"], queries)  # the default mode
        assert tail.mode == "tail" and tail.out.shape == (H, 4, D)

        found = client.search(context["id"], queries, 5, exact=True)
        assert torch.equal(found.ids, best) and found.version == 2
        state = client.build_index(context["id"], ["topk"])
        assert state["version"] == 2 and "topk" in state["built"]
        assert client.index_state(context["id"])["built"] == state["built"]

        rows = client.self_attention(context["id"], start=10, end=20, exact=True)
        expected_rows = dense_attention(keys[:, 10:20], keys, values, geometry)
        _close(rows.out, expected_rows[0])
        _close(rows.lse, expected_rows[1])

        small_q, small_k, small_v = queries, keys[:, :50], values[:, :50]
        inline = client.attend_inline(small_q, small_k, small_v, geometry="dot")
        assert isinstance(inline, InlineResult)
        expected_small = dense_attention(small_q, small_k, small_v, geometry)
        _close(inline.out, expected_small[0])
        _close(inline.lse, expected_small[1])
        out, lse = inline  # the pair, as before
        assert out is inline.out and lse is inline.lse

        upload_id = client.begin_upload(context["id"])
        client.add_chunk(context["id"], upload_id, keys[:, :10], values[:, :10])
        assert client.get_upload(context["id"], upload_id)["n_tokens"] == 10
        client.abort_upload(context["id"], upload_id)
        assert client.get_context(context["id"])["n_tokens"] == N
        assert "rewa_requests_total" in client.metrics()

        client.delete_context(context["id"])
        with pytest.raises(RewaError) as missing:
            client.get_context(context["id"])
        assert missing.value.status == 404 and missing.value.param == "context_id"


def test_the_async_client_has_the_same_methods(server, data):
    keys, values, queries = data
    geometry = make_geometry("dot", D)

    async def scenario():
        async with AsyncClient(server.url) as client:
            assert await client.livez()
            context = await client.create_context(H, D)
            await client.upload(context["id"], keys, values, chunk_tokens=500)
            results = await asyncio.gather(
                *(client.attend(context["id"], queries, exact=True) for _ in range(4))
            )
            await client.delete_context(context["id"])
            return results

    expected_out, _ = dense_attention(queries, keys, values, geometry)
    for result in asyncio.run(scenario()):
        _close(result.out, expected_out)


def test_every_endpoint_is_a_declared_method_with_its_signature_and_result_type():
    """Client and AsyncClient declare every endpoint in their class bodies (what editors and
    type checkers read): each method shows the endpoint's parameters, documentation and the
    type of its result, and the async one is a coroutine function."""
    import ast
    import inspect

    from rewa.clients import http

    tree = ast.parse(Path(http.__file__).read_text())
    declared = {
        node.name: {t.id for item in node.body if isinstance(item, ast.Assign)
                    for t in item.targets if isinstance(t, ast.Name)}
        for node in tree.body if isinstance(node, ast.ClassDef)
    }  # fmt: skip
    assert len(http.OPERATIONS) == 21
    for name in http.OPERATIONS:
        assert name in declared["Client"] and name in declared["AsyncClient"], name
        operation = inspect.signature(getattr(http._Operations, name))
        result = str(operation.return_annotation)
        assert result.startswith("Operation[") and result != "Operation[Any]", name
        for client in (Client, AsyncClient):
            method = inspect.signature(getattr(client("http://127.0.0.1:1"), name))
            assert list(method.parameters.values()) == list(operation.parameters.values())[1:]
            assert method.return_annotation == result.removeprefix("Operation[")[:-1]
            assert getattr(client, name).__doc__ == getattr(http._Operations, name).__doc__
        assert inspect.iscoroutinefunction(getattr(AsyncClient, name))
    assert inspect.signature(Client.attend).return_annotation == "AttendResult"


def test_errors_carry_the_servers_body_and_a_failed_upload_leaves_nothing(server, data):
    keys, values, queries = data
    with Client(server.url) as client:
        context = client.create_context(H, D)
        with pytest.raises(RewaError) as wrong_values:
            client.upload(context["id"], keys, values[:, :, :8], chunk_tokens=400)
        assert wrong_values.value.status == 400
        assert "values" in wrong_values.value.param
        assert "expected" in wrong_values.value.message
        assert client.get_context(context["id"])["n_tokens"] == 0
        client.upload(context["id"], keys, values)
        with pytest.raises(RewaError) as wrong_dim:
            client.attend(context["id"], queries[:, :, :8])
        assert wrong_dim.value.status == 400 and wrong_dim.value.type is not None
        with pytest.raises(RewaError, match="404"):
            client.attend("no-such-context", queries)
        client.delete_context(context["id"])
    nobody = Client(f"http://127.0.0.1:{free_port()}", retries=1, backoff=0.01)
    with nobody, pytest.raises(RewaConnectionError):
        nobody.livez()


class _Scripted(http.server.BaseHTTPRequestHandler):
    """Answers `script` in order: (status, headers); then 200."""

    script: ClassVar[list] = []
    seen: ClassVar[list] = []
    routing: ClassVar[list] = []

    def do_GET(self):
        self.seen.append(time.monotonic())
        self.routing.append((self.path, self.headers.get("X-Rewa-Context")))
        status, headers = self.script.pop(0) if self.script else (200, {})
        body = json.dumps(
            {"status": "ok"} if status == 200 else {"error": {"type": "busy", "message": "m"}}
        ).encode()
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def scripted():
    stub = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
    thread = threading.Thread(target=stub.serve_forever, daemon=True)
    thread.start()
    _Scripted.script, _Scripted.seen, _Scripted.routing = [], [], []
    yield f"http://127.0.0.1:{stub.server_address[1]}", _Scripted
    stub.shutdown()


def test_429_and_503_are_retried_after_retry_after(scripted):
    url, handler = scripted
    handler.script = [(429, {"Retry-After": "0.5"}), (503, {}), (200, {})]
    with Client(url, backoff=0.05) as client:
        assert client.livez()
    assert len(handler.seen) == 3
    assert handler.seen[1] - handler.seen[0] >= 0.45  # waited what Retry-After said
    handler.script, handler.seen = [(429, {"Retry-After": "0"})] * 3, []
    with Client(url, retries=2) as client, pytest.raises(RewaError) as busy:
        client.livez()
    assert busy.value.status == 429 and busy.value.type == "busy" and len(handler.seen) == 3

    async def asynchronous():
        async with AsyncClient(url, backoff=0.01) as client:
            return await client.livez()

    handler.script, handler.seen = [(503, {"Retry-After": "0"}), (200, {})], []
    assert asyncio.run(asynchronous()) and len(handler.seen) == 2


def test_requests_on_a_context_carry_its_id_as_a_routing_key(scripted):
    url, handler = scripted
    with Client(url) as client:
        client.livez()
        client.get_context("ctx-1")
    assert handler.routing == [("/livez", None), ("/v1/contexts/ctx-1", "ctx-1")]


def test_remote_memory_merged_with_local_attention_is_dense_attention(server, data):
    keys, values, queries = data
    geometry = make_geometry("dot", D)
    window = 100  # the local model holds the last 100 tokens, the service the rest
    with Client(server.url) as client:
        context = client.create_context(H, D)
        client.upload(context["id"], keys[:, :-window], values[:, :-window])
        memory = RemoteMemory(client, context["id"], mode="exact")
        local = dense_attention(queries, keys[:, -window:], values[:, -window:], geometry)
        out, lse = merge_attention(local, memory(queries))
        client.delete_context(context["id"])
    expected_out, expected_lse = dense_attention(queries, keys, values, geometry)
    _close(out, expected_out)
    _close(lse, expected_lse)


def test_a_context_sharded_over_two_contexts_merges_to_dense_attention(server, data):
    keys, values, queries = data
    cut = 700
    with Client(server.url) as client:
        shards = []
        for part in (slice(0, cut), slice(cut, N)):
            context = client.create_context(H, D)
            client.upload(context["id"], keys[:, part], values[:, part])
            shards.append(RemoteMemory(client, context["id"], mode="exact"))
        out, lse = ShardedMemory(shards)(queries)
        one_shard = ShardedMemory(shards[:1])(queries)
        for shard in shards:
            client.delete_context(shard.context_id)
    expected_out, expected_lse = dense_attention(queries, keys, values, make_geometry("dot", D))
    _close(out, expected_out)
    _close(lse, expected_lse)
    assert not torch.allclose(one_shard[1], expected_lse, atol=1e-3)  # both shards matter
    with pytest.raises(ValueError, match="at least one shard"):
        ShardedMemory([])


def _cli(capsys, *argv) -> str:
    cli.main(list(argv))
    return capsys.readouterr().out


def test_the_cli_commands_end_to_end(server, data, tmp_path, capsys):
    from safetensors.numpy import save_file

    keys, values, queries = (t.numpy() for t in data)
    url = ("--url", server.url)
    np.savez(tmp_path / "context.npz", keys=keys, values=values)
    created = json.loads(_cli(capsys, "upload", str(tmp_path / "context.npz"), *url, "--quiet"))
    assert created["n_tokens"] == N
    context_id = created["id"]
    assert context_id in _cli(capsys, "contexts", "ls", *url)
    assert json.loads(_cli(capsys, "contexts", "show", context_id, *url))["n_tokens"] == N
    # Append from a pair of .npy files and from .safetensors, with the progress bar.
    np.save(tmp_path / "k.npy", keys[:, :100])
    np.save(tmp_path / "v.npy", values[:, :100])
    argv = ("upload", str(tmp_path / "k.npy"), "--values", str(tmp_path / "v.npy"))
    assert json.loads(_cli(capsys, *argv, "--context", context_id, *url))["n_tokens"] == N + 100
    # (safetensors writes the buffer of a non-contiguous array as if it were contiguous)
    first = {"keys": keys[:, :50].copy(), "values": values[:, :50].copy()}
    save_file(first, str(tmp_path / "c.safetensors"))
    cli.main(["upload", str(tmp_path / "c.safetensors"), "--context", context_id, *url])
    printed = capsys.readouterr()
    assert json.loads(printed.out)["n_tokens"] == N + 150
    assert "] 50/50 tokens" in printed.err  # the progress bar, at its end

    np.save(tmp_path / "q.npy", queries)
    argv = ("attend", context_id, str(tmp_path / "q.npy"), "--mode", "exact")
    _cli(capsys, *argv, "--out", str(tmp_path / "out.npz"), *url)
    all_keys = np.concatenate([keys, keys[:, :100], keys[:, :50]], axis=1)
    all_values = np.concatenate([values, values[:, :100], values[:, :50]], axis=1)
    expected = dense_attention(
        torch.from_numpy(queries),
        torch.from_numpy(all_keys),
        torch.from_numpy(all_values),
        make_geometry("dot", D),
    )
    with np.load(tmp_path / "out.npz") as saved:
        _close(saved["out"], expected[0])
        _close(saved["lse"], expected[1])
    # --measured-queries reaches the server, which takes it in tail mode only.
    measured = ("attend", context_id, str(tmp_path / "q.npy"), "--measured-queries", "4")
    _cli(capsys, *measured, "--out", str(tmp_path / "m.npz"), *url)
    with np.load(tmp_path / "m.npz") as saved:
        _close(saved["out"], expected[0])  # the open segment's keys only: read exactly
    with pytest.raises(SystemExit):
        cli.main([*measured, "--mode", "topk", *url])
    assert "measured_queries" in capsys.readouterr().err
    found = json.loads(_cli(capsys, "search", context_id, str(tmp_path / "q.npy"), "--top-k", "3",
                            "--exact", "--json", *url))  # fmt: skip
    assert np.array(found["ids"]).shape == (H, 4, 3)
    best = exact_topk(torch.from_numpy(queries[0, 0]).unsqueeze(0),
                      torch.from_numpy(all_keys[0]), make_geometry("dot", D), 3)  # fmt: skip
    assert found["ids"][0][0] == best[0].tolist()
    # Tables a person reads: every row of this small result, ids with their logits or weights.
    table = _cli(capsys, "search", context_id, str(tmp_path / "q.npy"), "--top-k", "3", "--exact",
                 *url).splitlines()  # fmt: skip
    assert table[0].endswith("the best 3 keys of 4 queries x 2 heads") and len(table) == 2 + 8 + 1
    assert table[2].split()[:3] == ["0", "0", str(best[0, 0].item())]
    assert table[-1].startswith("(not saved: --out FILE.npz")
    table = _cli(capsys, *argv, "--return-topk", "2", *url).splitlines()
    assert "mode exact" in table[0] and "best ids (weight)" in table[1]
    lse = float(table[2].split()[2])
    assert abs(lse - expected[1][0, 0].item()) < 1e-3
    summary = json.loads(_cli(capsys, *argv, "--json", "--out", str(tmp_path / "o.npz"), *url))
    assert summary["saved"] == str(tmp_path / "o.npz") and summary["out_shape"] == [H, 4, D]

    bench = json.loads(_cli(capsys, "bench", "--tokens", "1024", "--heads", "2", "--head-dim",
                            "16", "--clients", "2", "--requests", "3", *url))  # fmt: skip
    assert bench["requests_per_s"] > 0 and bench["p50_ms"] <= bench["p99_ms"]
    assert _cli(capsys, "contexts", "rm", context_id, *url).startswith("deleted")
    with pytest.raises(SystemExit):
        cli.main(["contexts", "show", context_id, *url])
    assert "404" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["upload", str(tmp_path / "k.npy"), *url])
    assert "--values" in capsys.readouterr().err


def test_the_documented_client_example_runs(server):
    text = (Path(__file__).resolve().parent.parent / "docs" / "client.md").read_text()
    example = re.search(r"# Client and command line\n.*?```python\n(.*?)```", text, re.S)
    namespace: dict = {}
    exec(example.group(1), namespace)
    out, lse = namespace["remote_attention"](server.url)
    assert out.shape == (8, 1, 64) and lse.shape == (8, 1)
    assert np.isfinite(out).all() and np.isfinite(lse).all()


def test_both_wires_give_the_same_answers(server, data):
    keys, values, queries = data
    with Client(server.url) as binary, Client(server.url, wire="json") as as_json:
        context = binary.create_context(H, D)
        binary.upload(context["id"], keys, values)
        for inputs in (queries, queries.numpy()):
            a = binary.attend(context["id"], inputs, mode="topk", return_topk=4)
            b = as_json.attend(context["id"], inputs, mode="topk", return_topk=4)
            assert type(a.out) is type(b.out) is type(inputs)
            assert (a.mode, a.version) == (b.mode, b.version) == ("topk", 1)
            for name in ("out", "lse", "ids", "weights"):
                assert np.array_equal(np.asarray(getattr(a, name)), np.asarray(getattr(b, name)))
        # A measured tail attend (its options in the safetensors metadata, or in the JSON):
        # queries 0 and 3 of each head answered exactly.
        binary.build_index(context["id"], ["tail"])
        a = binary.attend(context["id"], queries, measured_queries=2)
        b = as_json.attend(context["id"], queries, measured_queries=2)
        assert torch.equal(a.out, b.out) and a.mode == "tail"
        exact = dense_attention(queries, keys, values, make_geometry("dot", D))
        _close(a.out[:, [0, 3]], exact[0][:, [0, 3]])
        rows = binary.self_attention(context["id"], start=0, end=10, measured_queries=10)
        _close(rows.out, dense_attention(keys[:, :10], keys, values, make_geometry("dot", D))[0])
        binary.delete_context(context["id"])
    with pytest.raises(ValueError, match="wire"):
        Client(server.url, wire="msgpack")


def test_a_context_is_created_with_a_geometry_state_or_not_at_all(server, data):
    keys, values, queries = data
    geometry = make_geometry("product", D)
    with torch.no_grad():
        for parameter in geometry.parameters():
            parameter.mul_(1.5)
    with Client(server.url) as client:
        memory = RemoteMemory.create(
            client, H, D, geometry="product", mode="exact", geometry_state=geometry.state_dict()
        )
        state = client.get_geometry_state(memory.context_id, as_torch=True)
        assert all(torch.equal(state[n], t) for n, t in geometry.state_dict().items())
        memory.append(keys, values)
        out, lse = memory.attend(queries)
        expected = dense_attention(queries, keys, values, geometry)
        _close(out, expected[0])
        _close(lse, expected[1])
        memory.close()
        before = {c["id"] for c in client.list_contexts()}
        with pytest.raises(RewaError) as refused:
            client.create_context(H, D, geometry="product", geometry_state={"maps.sphere": keys})
        assert refused.value.status == 400
        assert {c["id"] for c in client.list_contexts()} == before  # deleted again
        plain = client.create_context(H, D)
        assert client.get_geometry_state(plain["id"]) is None
        client.delete_context(plain["id"])


TORCH_FREE_SESSION = """
import sys
sys.modules["torch"] = None  # any import of torch now fails
import numpy as np
from rewa.clients import Client
keys, values, queries = (np.load(sys.argv[2])[name] for name in ("keys", "values", "queries"))
answers = {}
for dtype in ("float32", "bfloat16"):
    for wire in ("safetensors", "json"):
        with Client(sys.argv[1], wire=wire) as client:
            context = client.create_context(2, 16, dtype=dtype)
            client.upload(context["id"], keys, values, chunk_tokens=100)  # JSON and raw chunks
            found = client.attend(context["id"], queries, mode="exact")
            answers[f"{dtype}-{wire}-out"], answers[f"{dtype}-{wire}-lse"] = found.out, found.lse
            answers[f"{dtype}-{wire}-ids"] = client.search(context["id"], queries, top_k=3).ids
            assert client.get_geometry_state(context["id"]) is None
            client.delete_context(context["id"])
assert "torch" not in {name.partition(".")[0] for name, m in sys.modules.items() if m}
np.savez(sys.argv[3], **answers)
"""


def test_the_client_works_without_torch(server, data, tmp_path):
    keys, values = data[0][:, :700].numpy(), data[1][:, :700].numpy()
    queries = data[2].numpy()
    np.savez(tmp_path / "inputs.npz", keys=keys, values=values, queries=queries)
    subprocess.run(
        [sys.executable, "-c", TORCH_FREE_SESSION, server.url, tmp_path / "inputs.npz",
         tmp_path / "answers.npz"],
        check=True, timeout=120,
    )  # fmt: skip
    answers = np.load(tmp_path / "answers.npz")
    geometry = make_geometry("dot", D)
    for dtype in (torch.float32, torch.bfloat16):
        k, v = (torch.from_numpy(a).to(dtype).float() for a in (keys, values))
        out, lse = dense_attention(torch.from_numpy(queries), k, v, geometry)
        q = torch.from_numpy(queries)
        ids = torch.stack([exact_topk(q[h], k[h], geometry, 3) for h in range(H)])
        name = "float32" if dtype == torch.float32 else "bfloat16"
        for wire in ("safetensors", "json"):
            _close(answers[f"{name}-{wire}-out"], out)
            _close(answers[f"{name}-{wire}-lse"], lse)
            assert np.array_equal(answers[f"{name}-{wire}-ids"], ids.numpy())
