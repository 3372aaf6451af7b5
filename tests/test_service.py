"""The HTTP service against real `rewa serve` processes: the full lifecycle on the embedded
store and on a real Redis server, results equal to the library's, auth, probes, metrics and
the OpenAPI document."""

from __future__ import annotations

import re
import socket
import time

import httpx
import pytest
import torch
from safetensors.torch import load, save

from rewa.attention import GeometricAttention, dense_attention, make_geometry, merge_attention
from rewa.index import (
    ClusterHeads,
    KeyClusters,
    LocalMemory,
    build_index,
    causal_tail_attention,
    retrieval_attention,
    sealed_keys,
    tail_attention_heads,
)
from rewa.index.tail.measured import measured_rows
from rewa.service.routes import _params, attend_batch_key
from rewa.service.schemas import AttendOptions
from rewa.service.settings import Settings
from tests.service_support import (
    REDIS_URL,
    Server,
    attend,
    create_context,
    decode,
    drop_prefix,
    encode,
    redis_prefix,
    upload,
)

H, N, D = 2, 3000, 16


@pytest.fixture(scope="module", params=["embedded", "redis"])
def server(request, tmp_path_factory):
    if request.param == "embedded":
        settings = {"data_dir": tmp_path_factory.mktemp("data")}
    else:
        prefix = redis_prefix()
        settings = {"redis_url": REDIS_URL, "redis_prefix": prefix, "redis_piece_bytes": 65536}
    running = Server(**settings).start()
    yield running
    running.kill()
    if request.param == "redis":
        drop_prefix(settings["redis_prefix"])


@pytest.fixture(scope="module")
def data():
    generator = torch.Generator().manual_seed(7)
    keys = torch.randn(H, N, D, generator=generator)
    values = torch.randn(H, N, D, generator=generator)
    queries = torch.randn(H, 5, D, generator=generator)
    return keys, values, queries


def test_top_k_is_also_read_under_its_old_name_k(server, data):
    """`top_k` (keys attended, ids searched) was called `k` in 0.1: requests and stored
    records that say `k` still work, and the service answers `top_k`."""
    keys, values, queries = data
    with server.client() as client:
        context = create_context(client, index={"kind": "flat", "k": 8})
        assert context["index"]["top_k"] == 8 and "k" not in context["index"]
        upload(client, context["id"], keys, values)
        current = attend(client, context["id"], queries, mode="topk", top_k=4)
        legacy = attend(client, context["id"], queries, mode="topk", k=4)
        torch.testing.assert_close(legacy[0], current[0])
        torch.testing.assert_close(legacy[1], current[1])
        default = attend(client, context["id"], queries, mode="topk")  # the context's 8 keys
        assert not torch.allclose(default[1], current[1])
        search = f"/v1/contexts/{context['id']}/search"
        found = client.post(search, json={"queries": encode(queries), "k": 3}).json()
        assert decode(found["ids"]).shape == (H, 5, 3)
        both = client.post(search, json={"queries": encode(queries), "k": 3, "top_k": 3})
        assert both.status_code == 422, both.text
        client.delete(f"/v1/contexts/{context['id']}")


def test_a_record_stored_with_k_gives_its_top_k():
    record = {"n_tokens": 100, "index": {"kind": "ivf", "k": 12, "window": 0, "sinks": 0,
                                         "budget": 0.02, "options": {}}}  # fmt: skip
    params = _params(AttendOptions(), record, Settings(), "topk", None)
    assert params.top_k == 12


def test_full_lifecycle_matches_the_library(server, data):
    keys, values, queries = data
    geometry = make_geometry("dot", D)
    with server.client() as client:
        context = create_context(client, name="doc", index={"kind": "ivf", "top_k": 32})
        assert (context["n_tokens"], context["version"]) == (0, 0)
        committed = upload(client, context["id"], keys, values, chunk=700, binary=False)
        assert (committed["n_tokens"], committed["version"]) == (N, 1)
        listed = client.get("/v1/contexts").json()["contexts"]
        assert context["id"] in [c["id"] for c in listed]
        assert client.get(f"/v1/contexts/{context['id']}").json()["n_tokens"] == N

        # exact == dense attention; topk == retrieval attention over the same IVF index;
        # tail (the default) == the library's cluster-tail attention. The indexes hold the
        # 2048 keys of the full segment; the open segment's 952 are read exactly.
        out, lse, body = attend(client, context["id"], queries, mode="exact")
        expected = dense_attention(queries, keys, values, geometry)
        torch.testing.assert_close(out, expected[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse, expected[1], rtol=1e-5, atol=1e-5)
        assert body["mode"] == "exact" and body["version"] == 1
        out_exact_flag, _, _ = attend(client, context["id"], queries, exact=True)
        torch.testing.assert_close(out_exact_flag, out)

        out, lse, _ = attend(client, context["id"], queries, mode="topk")
        out_tail, lse_tail, body = attend(client, context["id"], queries)
        assert body["mode"] == "tail"
        sealed = sealed_keys(N)
        assert sealed == 2048
        for head in range(H):
            k, v = keys[head, :sealed], values[head, :sealed]
            recent = dense_attention(queries[head], keys[head, sealed:], values[head, sealed:],
                                     geometry)  # fmt: skip
            index = build_index(k, geometry, "ivf")
            ref = merge_attention(
                retrieval_attention(queries[head], k, v, geometry, top_k=32, index=index), recent
            )
            torch.testing.assert_close(out[head], ref[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lse[head], ref[1], rtol=1e-5, atol=1e-5)
            clusters = KeyClusters.build(geometry.witness(k), v, geometry)
            ref = merge_attention(
                retrieval_attention(queries[head], k, v, geometry, index=clusters, tail=True),
                recent,
            )
            torch.testing.assert_close(out_tail[head], ref[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lse_tail[head], ref[1], rtol=1e-5, atol=1e-5)

        # return_topk: the best ids with their attention weights under exact attention.
        _, lse, body = attend(client, context["id"], queries, mode="exact", return_topk=4)
        ids, weights = decode(body["ids"]), decode(body["weights"])
        logits = geometry.score(queries, keys)
        best = logits.topk(4, dim=-1)
        torch.testing.assert_close(ids, best.indices)
        torch.testing.assert_close(weights, torch.exp(best.values - lse.unsqueeze(-1)))

        # search: exact top K ids and logits.
        response = client.post(
            f"/v1/contexts/{context['id']}/search",
            json={"queries": encode(queries), "top_k": 5, "exact": True},
        )
        assert response.status_code == 200, response.text
        found = response.json()
        torch.testing.assert_close(decode(found["ids"]), logits.topk(5, dim=-1).indices)
        torch.testing.assert_close(
            decode(found["scores"]), logits.topk(5, dim=-1).values, rtol=1e-5, atol=1e-5
        )

        # Appending a second upload makes version 2 with every token.
        more_keys, more_values = torch.randn(H, 100, D), torch.randn(H, 100, D)
        committed = upload(client, context["id"], more_keys, more_values)
        assert (committed["n_tokens"], committed["version"]) == (N + 100, 2)
        all_keys = torch.cat([keys, more_keys], dim=1)
        all_values = torch.cat([values, more_values], dim=1)
        out, lse, body = attend(client, context["id"], queries, mode="exact")
        expected = dense_attention(queries, all_keys, all_values, geometry)
        torch.testing.assert_close(out, expected[0], rtol=1e-5, atol=1e-5)
        assert body["version"] == 2

        # Delete: gone from get, list and attend.
        assert client.delete(f"/v1/contexts/{context['id']}").status_code == 200
        assert client.get(f"/v1/contexts/{context['id']}").status_code == 404
        listed = client.get("/v1/contexts").json()["contexts"]
        assert context["id"] not in [c["id"] for c in listed]
        response = client.post(
            f"/v1/contexts/{context['id']}/attend", json={"queries": encode(queries)}
        )
        assert response.status_code == 404
        assert response.json()["error"]["type"] == "not_found"


@pytest.mark.parametrize("geometry_spec", [{"name": "poincare"}, {"name": "sphere"}])
def test_self_attention_and_search_for_distance_geometries(server, data, geometry_spec):
    keys, values, _ = data
    geometry = make_geometry(geometry_spec["name"], D)
    with server.client() as client:
        context = create_context(client, geometry=geometry_spec, index={"kind": "flat"})
        upload(client, context["id"], keys[:, :600] * 0.1, values[:, :600])
        k, v = keys[:, :600] * 0.1, values[:, :600]
        # Causal exact self-attention of rows [100, 200), the stored keys as queries.
        response = client.post(
            f"/v1/contexts/{context['id']}/self-attention",
            json={"start": 100, "end": 200, "causal": True, "mode": "exact"},
        )
        assert response.status_code == 200, response.text
        body = response.json()
        mask = torch.arange(600) <= torch.arange(100, 200).unsqueeze(-1)
        expected = dense_attention(k[:, 100:200], k, v, geometry, mask=mask)
        torch.testing.assert_close(decode(body["out"]), expected[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(decode(body["lse"]), expected[1], rtol=1e-4, atol=1e-5)
        # Causal tail: what the library's causal_tail_attention computes, head by head (here
        # within the first segment, so exact as well).
        response = client.post(
            f"/v1/contexts/{context['id']}/self-attention",
            json={"start": 100, "end": 200, "causal": True, "mode": "tail", "budget": 0.1},
        )
        assert response.status_code == 200, response.text
        tail_out = decode(response.json()["out"])
        for h in range(H):
            expected = causal_tail_attention(
                k[h, 100:200], k[h], v[h], geometry, torch.arange(100, 200), budget=0.1
            )
            torch.testing.assert_close(tail_out[h], expected[0], rtol=1e-4, atol=1e-5)
        exact = dense_attention(k[:, 100:200], k, v, geometry, mask=mask)
        torch.testing.assert_close(tail_out, exact[0], rtol=1e-4, atol=1e-5)
        # With explicit queries, non-causal, topk over the flat index with every key: exact.
        queries = torch.randn(H, 7, D) * 0.1
        response = client.post(
            f"/v1/contexts/{context['id']}/self-attention",
            json={"queries": encode(queries), "start": 10, "mode": "topk", "top_k": 600},
        )
        assert response.status_code == 200, response.text
        expected = dense_attention(queries, k, v, geometry)
        torch.testing.assert_close(
            decode(response.json()["out"]), expected[0], rtol=1e-4, atol=1e-5
        )
        # Search returns distances for distance geometries.
        response = client.post(
            f"/v1/contexts/{context['id']}/search", json={"queries": encode(queries), "top_k": 3}
        )
        found = response.json()
        ids = decode(found["ids"])
        distance = geometry.distance(
            geometry.witness(queries).unsqueeze(-2),
            geometry.witness(torch.stack([k[h][ids[h]] for h in range(H)])),
        )
        torch.testing.assert_close(decode(found["distances"]), distance, rtol=1e-4, atol=1e-5)
        client.delete(f"/v1/contexts/{context['id']}")


@pytest.mark.parametrize(
    "geometry_spec",
    [
        {"name": "cone", "kind": "penumbral", "r": 1.5, "gamma": 2.0},
        {"name": "cone", "kind": "umbral", "height_scale": 4.0},
        {"name": "graded", "kind": "exponential", "variant": "values", "grades": 0.5},
        {"name": "random_features", "features": 64, "sigma": 4.0},
        {"name": "operator", "m": 4, "rank": 2},
    ],
)
def test_seed_mechanisms_through_the_service(server, data, geometry_spec):
    """Cone, graded, random-feature and operator contexts: exact and topk (every key) equal the
    library; cone defaults to topk and refuses tail and LSH; graded values need value_dim = d."""
    keys, values, queries = data
    k, v = keys[:, :400], values[:, :400, :D]
    options = {key: value for key, value in geometry_spec.items() if key != "name"}
    geometry = make_geometry(geometry_spec["name"], D, **options)
    expected = dense_attention(queries, k, v, geometry)
    cone = geometry_spec["name"] == "cone"
    with server.client() as client:
        context = create_context(
            client, geometry=geometry_spec, value_dim=D, index={"kind": "flat", "top_k": 400}
        )
        upload(client, context["id"], k, v)
        url = f"/v1/contexts/{context['id']}/attend"
        for request in ({"mode": "exact"}, {"mode": "topk"}, {}):
            response = client.post(url, json={"queries": encode(queries), **request})
            assert response.status_code == 200, response.text
            body = response.json()
            if not request:  # the default mode: tail, or topk where there is no estimate
                assert body["mode"] == ("topk" if cone else "tail")
                if not cone:
                    continue
            torch.testing.assert_close(decode(body["out"]), expected[0], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(decode(body["lse"]), expected[1], rtol=1e-4, atol=1e-4)
        if cone:
            response = client.post(url, json={"queries": encode(queries), "mode": "tail"})
            assert response.status_code == 400
            assert response.json()["error"]["param"] == "mode"
            response = client.post(
                "/v1/contexts",
                json={
                    "geometry": geometry_spec,
                    "heads": H,
                    "head_dim": D,
                    "index": {"kind": "lsh"},
                },
            )
            assert response.status_code == 400
            assert response.json()["error"]["param"] == "index.kind"
        client.delete(f"/v1/contexts/{context['id']}")
        if geometry_spec.get("variant") == "values":
            response = client.post(
                "/v1/contexts",
                json={"geometry": geometry_spec, "heads": H, "head_dim": D, "value_dim": 3},
            )
            assert response.status_code == 400 and "value dim" in response.text
            small = {"q": encode(queries[:, :2]), "k": encode(k[:, :5]), "v": encode(v[:, :5, :3])}
            response = client.post("/v1/attend", json={"geometry": geometry_spec, **small})
            assert response.status_code == 400
            assert response.json()["error"]["param"] == "v"


def test_stateless_attention_equals_dense_attention(server):
    q, k, v = torch.randn(3, 4, 8), torch.randn(3, 50, 8), torch.randn(3, 50, 6)
    geometry = make_geometry("poincare", 8)
    with server.client() as client:
        response = client.post(
            "/v1/attend",
            json={
                "geometry": {"name": "poincare"},
                "q": encode(q * 0.2),
                "k": encode(k * 0.2),
                "v": encode(v),
                "causal": True,
            },
        )
    assert response.status_code == 200, response.text
    expected = dense_attention(q * 0.2, k * 0.2, v, geometry, causal=True)
    torch.testing.assert_close(decode(response.json()["out"]), expected[0], rtol=1e-5, atol=1e-5)


def test_probes_metrics_and_docs(server):
    with server.client() as client:
        assert client.get("/livez").json() == {"status": "ok"}
        ready = client.get("/readyz")
        assert ready.status_code == 200 and ready.json()["device"] == "cpu"
        metrics = client.get("/metrics").text
        for name in ("rewa_requests_total", "rewa_queue_depth", "rewa_batch_queries"):
            assert name in metrics
        for name in ("rewa_jobs_waiting", "rewa_jobs_running", "rewa_queue_wait_seconds"):
            assert name in metrics
        for page in ("/docs", "/redoc"):  # offline: every script and style sheet is ours
            html = client.get(page).text
            assets = re.findall(r'(?:src|href)="([^"]+)"', html)
            assert assets and all(asset.startswith("/") for asset in assets), assets
            for asset in assets:
                assert client.get(asset).status_code == 200, asset
        paths = client.get("/openapi.json").json()["paths"]
        assert "/v1/contexts/{context_id}/attend" in paths
        assert "/v1/contexts/{context_id}/uploads/{upload_id}/chunks" in paths


def test_the_openapi_document_lists_the_errors_and_the_bearer_scheme(server):
    keyed = Server(api_keys="alpha").start()
    try:
        with keyed.client() as client:
            document = client.get("/openapi.json").json()
    finally:
        keyed.kill()
    assert document["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    error_ref = {"$ref": "#/components/schemas/ErrorBody"}
    compute = {"400", "401", "404", "408", "409", "413", "415", "422", "429", "503"}
    expected = {
        ("post", "/v1/contexts"): {"400", "401", "408", "413", "415", "422", "503"},
        ("get", "/v1/contexts/{context_id}"): {"401", "404", "503"},
        ("post", "/v1/contexts/{context_id}/attend"): compute,
        ("post", "/v1/contexts/{context_id}/search"): compute,
        ("post", "/v1/contexts/{context_id}/self-attention"): compute,
        ("post", "/v1/attend"): {"400", "401", "408", "413", "415", "422", "429"},
    }
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            if not path.startswith("/v1/"):
                continue
            assert operation["security"] == [{"HTTPBearer": []}], (method, path)
            errors = {code for code in operation["responses"] if code >= "400"}
            assert "401" in errors, (method, path)
            if (method, path) in expected:
                assert errors == expected[(method, path)], (method, path)
            for code in errors:
                schema = operation["responses"][code]["content"]["application/json"]["schema"]
                assert schema == error_ref, (method, path, code)
    assert "HTTPValidationError" not in document["components"]["schemas"]
    # An open service (no REWA_API_KEYS) declares no scheme and no 401.
    with server.client() as client:
        open_document = client.get("/openapi.json").json()
    assert "securitySchemes" not in open_document["components"]
    for operations in open_document["paths"].values():
        for operation in operations.values():
            assert "security" not in operation and "401" not in operation["responses"]


def test_api_keys_namespace_contexts():
    server = Server(api_keys="alpha,beta").start()
    try:
        with server.client("alpha") as alpha, server.client("beta") as beta:
            context = create_context(alpha)
            assert alpha.get(f"/v1/contexts/{context['id']}").status_code == 200
            # Another key never sees it: 404, not 403, and not in its list.
            assert beta.get(f"/v1/contexts/{context['id']}").status_code == 404
            assert beta.delete(f"/v1/contexts/{context['id']}").status_code == 404
            assert beta.get("/v1/contexts").json()["contexts"] == []
        with server.client() as anonymous, server.client("gamma") as wrong:
            for client in (anonymous, wrong):
                response = client.get("/v1/contexts")
                assert response.status_code == 401
                assert response.json()["error"]["param"] == "Authorization"
            assert anonymous.get("/livez").status_code == 200  # probes stay open
            assert anonymous.get("/readyz").status_code == 200
    finally:
        server.kill()


def test_the_authorization_header_is_parsed_strictly():
    """Exactly `Bearer <key>` (the scheme case-insensitive, RFC 7235): a second space, another
    scheme, a key prefix or a key with characters outside RFC 6750's b64token are 401 (leading
    and trailing whitespace never reach the server: HTTP strips it)."""
    server = Server(api_keys="alpha,beta").start()
    try:
        accepted = ["Bearer alpha", "bearer alpha", "BEARER beta"]
        refused = [
            "bearer  alpha",
            "Bearer  alpha",
            "Bearer\talpha",
            "Basic alpha",
            "Bearer alph",
            "Bearer alphaa",
            "Bearer alpha,beta",
            "alpha",
            "Bearer",
        ]
        for header in accepted + refused:
            response = httpx.get(
                server.url + "/v1/contexts", headers={"Authorization": header}, timeout=30
            )
            assert response.status_code == (200 if header in accepted else 401), header
        # The key is checked before the body is read: a client without one that announces a
        # large body and sends none is refused at once (not held until the body times out).
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as connection:
            connection.sendall(
                b"POST /v1/contexts HTTP/1.1\r\nHost: test\r\nContent-Type: application/json"
                b"\r\nContent-Length: 100000000\r\n\r\n"
            )
            assert connection.recv(4096).startswith(b"HTTP/1.1 401")
    finally:
        server.kill()


def test_a_commit_builds_the_index_in_the_background_and_a_client_can_wait_for_it(server, data):
    keys, values, queries = data
    with server.client() as client:
        context = create_context(client, index={"kind": "ivf", "top_k": 32})
        url = f"/v1/contexts/{context['id']}/index"
        response = client.post(url)
        assert response.status_code == 409  # nothing committed yet
        committed = upload(client, context["id"], keys, values)
        deadline = time.monotonic() + 60
        while True:  # REWA_BUILD_ON_COMMIT: the default mode's index, built in the background
            state = client.get(url).json()
            if state["built"] == ["tail"] or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert state == {"context_id": context["id"], "version": committed["version"],
                         "loaded": True, "built": ["tail"], "building": [],
                         "sealed_tokens": 2048, "seconds": None, "audit": None}  # fmt: skip
        # Waiting for another mode: the request answers once it is built.
        response = client.post(url, json={"modes": ["topk", "tail"]})
        assert response.status_code == 200, response.text
        built = response.json()
        assert built["built"] == ["tail", "topk"] and built["seconds"] >= 0
        out, _, _ = attend(client, context["id"], queries, mode="tail", budget=1.0)
        expected = dense_attention(queries, keys, values, make_geometry("dot", D))
        torch.testing.assert_close(out, expected[0], rtol=1e-4, atol=1e-5)
        for body, param in (({"modes": ["sideways"]}, "modes.0"), ({"modes": []}, "modes")):
            response = client.post(url, json=body)
            assert response.status_code == 422, response.text
            assert response.json()["error"]["param"] == param
        assert client.get("/v1/contexts/no-such-context/index").status_code == 404
        client.delete(f"/v1/contexts/{context['id']}")
        cone = create_context(client, geometry={"name": "cone"}, index={"kind": "flat"})
        upload(client, cone["id"], keys[:, :50] * 0.1, values[:, :50])
        response = client.post(f"/v1/contexts/{cone['id']}/index", json={"modes": ["tail"]})
        assert response.status_code == 400 and response.json()["error"]["param"] == "mode"
        response = client.post(f"/v1/contexts/{cone['id']}/index")  # its default: topk
        assert response.status_code == 200 and response.json()["built"] == ["topk"]
        client.delete(f"/v1/contexts/{cone['id']}")


def test_a_measured_tail_answers_its_measured_queries_exactly(server, data):
    """`measured_queries` (index/tail/measured.py) over HTTP: attend and self-attention answer as
    the library does, the measured rows exactly; topk and exact refuse it."""
    keys, values, _ = data
    geometry = make_geometry("dot", D)
    queries = torch.randn(H, 40, D, generator=torch.Generator().manual_seed(11))
    with server.client() as client:
        context = create_context(client)
        upload(client, context["id"], keys, values)
        response = client.post(f"/v1/contexts/{context['id']}/index", json={"modes": ["tail"]})
        assert response.status_code == 200, response.text
        out, lse, body = attend(client, context["id"], queries, measured_queries=4)
        assert body["mode"] == "tail"
        sealed = sealed_keys(N)
        heads = ClusterHeads.stacked([
            KeyClusters.build(geometry.witness(keys[h, :sealed]), values[h, :sealed], geometry)
            for h in range(H)
        ])  # fmt: skip
        indexed = tail_attention_heads(queries, heads, budget=0.02, measured_queries=4)
        recent = dense_attention(queries, keys[:, sealed:], values[:, sealed:], geometry)
        expected = merge_attention(indexed, recent)
        torch.testing.assert_close(out, expected[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse, expected[1], rtol=1e-5, atol=1e-5)
        rows = measured_rows(40, 4, queries.device)
        exact = dense_attention(queries, keys, values, geometry)
        torch.testing.assert_close(out[:, rows], exact[0][:, rows], rtol=1e-5, atol=1e-5)
        plain, _, _ = attend(client, context["id"], queries)
        assert not torch.allclose(plain[:, rows], out[:, rows], rtol=1e-5, atol=1e-5)

        # Self-attention of rows [0, 100), the stored keys as queries: rows 0, 33, 66, 99 exact.
        url = f"/v1/contexts/{context['id']}/self-attention"
        response = client.post(url, json={"start": 0, "end": 100, "measured_queries": 4})
        assert response.status_code == 200, response.text
        found = decode(response.json()["out"])
        exact = dense_attention(keys[:, :100], keys, values, geometry)[0]
        rows = measured_rows(100, 4, queries.device)
        torch.testing.assert_close(found[:, rows], exact[:, rows], rtol=1e-5, atol=1e-5)

        # Causal tail takes it per segment (one segment here, its own keys read exactly).
        response = client.post(url, json={"start": 100, "end": 200, "causal": True,
                                          "mode": "tail", "measured_queries": 4})  # fmt: skip
        assert response.status_code == 200, response.text
        exact = dense_attention(keys[:, :200], keys[:, :200], values[:, :200], geometry,
                                causal=True)[0][:, 100:]  # fmt: skip
        torch.testing.assert_close(decode(response.json()["out"]), exact, rtol=1e-5, atol=1e-5)

        for request, path in (
            ({"queries": encode(queries), "mode": "topk", "measured_queries": 4}, "attend"),
            ({"queries": encode(queries), "exact": True, "measured_queries": 1}, "attend"),
        ):  # fmt: skip
            response = client.post(f"/v1/contexts/{context['id']}/{path}", json=request)
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == "measured_queries"
        response = client.post(
            f"/v1/contexts/{context['id']}/attend",
            json={"queries": encode(queries), "measured_queries": -1},
        )
        assert response.status_code == 422
        assert response.json()["error"]["param"] == "measured_queries"
        client.delete(f"/v1/contexts/{context['id']}")


def test_measured_attends_are_never_merged_with_others():
    record = {"index": {"kind": "ivf"}, "n_tokens": 5000}
    plain = _params(AttendOptions(), record, Settings(), "tail", None)
    measured = _params(AttendOptions(measured_queries=8), record, Settings(), "tail", None)
    assert measured.measured_queries == 8 and plain.measured_queries == 0
    assert attend_batch_key("ns", "c", 1, None, plain) == ("ns", "c", 1, None, plain)
    assert attend_batch_key("ns", "c", 1, None, measured) is None


def test_attend_speaks_safetensors_both_ways_and_answers_as_json_does(server, data):
    keys, values, queries = data
    with server.client() as client:
        context = create_context(client)
        upload(client, context["id"], keys, values, chunk=1500)
        path = f"/v1/contexts/{context['id']}/attend"
        options = '{"mode": "tail", "return_topk": 3}'
        binary = {"Content-Type": "application/x-safetensors"}
        both = {**binary, "Accept": "application/x-safetensors"}

        out, lse, body = attend(client, context["id"], queries, mode="tail", return_topk=3)
        for dtype in (torch.float32, torch.bfloat16):
            sent = save({"queries": queries.to(dtype)}, metadata={"options": options})
            answer = client.post(path, content=sent, headers=both)
            assert answer.status_code == 200, answer.text
            assert answer.headers["content-type"] == "application/x-safetensors"
            assert answer.headers["x-rewa-mode"] == "tail"
            assert int(answer.headers["x-rewa-version"]) == body["version"]
            assert "compute;dur=" in answer.headers["server-timing"]
            tensors = load(answer.content)
            assert set(tensors) == {"out", "lse", "ids", "weights"}
            if dtype == torch.float32:
                torch.testing.assert_close(tensors["out"], out, rtol=0, atol=0)
                torch.testing.assert_close(tensors["lse"], lse, rtol=0, atol=0)
                assert torch.equal(tensors["ids"], decode(body["ids"]))
        # A safetensors request without that Accept is answered in JSON.
        sent = save({"queries": queries}, metadata={"options": options})
        as_json = client.post(path, content=sent, headers=binary).json()
        torch.testing.assert_close(decode(as_json["out"]), out, rtol=0, atol=0)

        def error(content, headers=binary):
            answer = client.post(path, content=content, headers=headers)
            return answer.status_code, answer.json()["error"]

        status, why = error(b"\x05\x00")
        assert status == 400 and why["param"] == "body"
        status, why = error(save({"keys": queries}))
        assert status == 400 and "queries" in why["message"]
        status, why = error(save({"queries": queries[:1]}))
        assert status == 400 and why["param"] == "queries.shape"
        status, why = error(save({"queries": queries.double()}))
        assert status == 400 and why["param"] == "body.queries.dtype"
        status, why = error(save({"queries": torch.full_like(queries, float("nan"))}))
        assert status == 400 and why["param"] == "body.queries"
        status, why = error(save({"queries": queries}, metadata={"options": '{"budget": 7}'}))
        assert status == 422 and why["param"] == "budget"  # as in a JSON body
        status, why = error(save({"queries": queries}, metadata={"options": "{"}))
        assert status == 400
        status, why = error(b"queries", {"Content-Type": "text/plain"})
        assert status == 415 and why["param"] == "Content-Type"


def _trained_product_layer() -> GeometricAttention:
    """A 4-head layer sharing one product-manifold geometry, trained a few steps so that its
    maps, weights and temperature are no longer the seeded ones."""
    torch.manual_seed(1)
    layer = GeometricAttention(64, 4, make_geometry("product", D, heads=1))
    optimizer = torch.optim.Adam(layer.parameters(), lr=0.05)
    x = torch.randn(2, 32, 64)
    for _ in range(5):
        loss = (layer(x) - x.flip(1)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return layer.eval()


def test_a_context_with_a_trained_geometry_computes_what_the_trained_layer_computes(server):
    layer = _trained_product_layer()
    state = layer.geometry.state_dict()
    seeded = make_geometry("product", D).state_dict()
    assert any(not torch.equal(state[name], seeded[name]) for name in state)
    with torch.no_grad():
        x = torch.randn(1, 2500, 64, generator=torch.Generator().manual_seed(2))  # 2048 sealed
        q, k, v = (
            layer._split_heads(proj(x))[0] for proj in (layer.q_proj, layer.k_proj, layer.v_proj)
        )
        expected = layer.attend(q[:, :6], k, v)
    sent = save({name: tensor.contiguous() for name, tensor in state.items()})
    binary = {"Content-Type": "application/x-safetensors"}
    with server.client() as client:
        context = create_context(client, geometry={"name": "product"}, heads=4)
        path = f"/v1/contexts/{context['id']}/geometry-state"
        assert client.get(path).status_code == 204
        answer = client.put(path, content=sent, headers=binary)
        assert answer.status_code == 200, answer.text
        assert load(client.get(path).content).keys() == state.keys()
        upload(client, context["id"], k, v, chunk=500)
        out, lse, _ = attend(client, context["id"], q[:, :6], mode="exact")
        torch.testing.assert_close(out, expected[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse, expected[1], rtol=1e-5, atol=1e-5)
        # The sparse modes too: the service's index is built with the trained geometry.
        local = LocalMemory(4, D, geometry=layer.geometry, mode="tail")
        local.append(k, v)
        out, lse, _ = attend(client, context["id"], q[:, :6], mode="tail")
        torch.testing.assert_close(out, local.attend(q[:, :6])[0], rtol=1e-5, atol=1e-5)

        # After a commit the state is fixed; a wrong state is refused naming what differs.
        assert client.put(path, content=sent, headers=binary).status_code == 409
        fresh = create_context(client, geometry={"name": "product"}, heads=4)
        path = f"/v1/contexts/{fresh['id']}/geometry-state"
        wrong = {
            "a state of other shapes": save({**state, "maps.sphere": torch.zeros(4, D, 8)}),
            "a missing entry": save({n: t for n, t in state.items() if n != "temperature.raw"}),
            "an extra entry": save({**state, "bias": torch.zeros(1)}),
            "not safetensors": b"\x00" * 12,
        }
        for why, content in wrong.items():
            answer = client.put(path, content=content, headers=binary)
            assert answer.status_code == 400, why
            assert answer.json()["error"]["param"] == "body", why
        assert client.put(path, json={"state": 1}).status_code == 415
        assert client.get(path).status_code == 204


def test_a_multi_layer_document_is_uploaded_appended_attended_by_layer_and_deleted_whole(server):
    layers, heads, n = 3, 2, 2100
    generator = torch.Generator().manual_seed(9)
    keys = torch.randn(layers * heads, n + 1, D, generator=generator)
    values = torch.randn(layers * heads, n + 1, D, generator=generator)
    queries = torch.randn(heads, 4, D, generator=generator)
    geometry = make_geometry("dot", D)
    with server.client() as client:
        document = create_context(client, heads=heads, layers=layers)
        assert (document["heads"], document["layers"]) == (heads, layers)
        upload(client, document["id"], keys[:, :n], values[:, :n], chunk=700, binary=False)
        appended = upload(client, document["id"], keys[:, n:], values[:, n:])  # one token
        assert (appended["n_tokens"], appended["version"]) == (n + 1, 2)
        for layer in range(layers):
            mine = slice(layer * heads, (layer + 1) * heads)
            k, v = keys[mine], values[mine]
            out, lse, _ = attend(client, document["id"], queries, mode="exact", layer=layer)
            expected = dense_attention(queries, k, v, geometry)
            torch.testing.assert_close(out, expected[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lse, expected[1], rtol=1e-5, atol=1e-5)
            out, _, _ = attend(client, document["id"], queries, layer=layer)  # tail
            sealed = slice(0, sealed_keys(n + 1))  # 2048, the same as version 1's
            for head in range(heads):
                ks, vs = k[head, sealed], v[head, sealed]
                clusters = KeyClusters.build(geometry.witness(ks), vs, geometry)
                tail = merge_attention(
                    retrieval_attention(queries[head], ks, vs, geometry, index=clusters, tail=True),
                    dense_attention(queries[head], k[head, 2048:], v[head, 2048:], geometry),
                )
                torch.testing.assert_close(out[head], tail[0], rtol=1e-5, atol=1e-5)
            found = client.post(
                f"/v1/contexts/{document['id']}/search",
                json={"queries": encode(queries), "top_k": 3, "exact": True, "layer": layer},
            ).json()
            best = torch.stack([(queries[h] @ k[h].T).topk(3).indices for h in range(heads)])
            assert torch.equal(decode(found["ids"]), best)
            rows = client.post(
                f"/v1/contexts/{document['id']}/self-attention",
                json={"start": n - 3, "causal": True, "exact": True, "layer": layer},
            ).json()
            expected = dense_attention(k[:, n - 3 :], k, v, geometry, causal=True)
            torch.testing.assert_close(decode(rows["out"]), expected[0], rtol=1e-5, atol=1e-5)

        path = f"/v1/contexts/{document['id']}/attend"
        for layer in (None, 3):
            body = {"queries": encode(queries), **({} if layer is None else {"layer": layer})}
            answer = client.post(path, json=body)
            assert answer.status_code == 400 and answer.json()["error"]["param"] == "layer"
        single = create_context(client, heads=heads)
        upload(client, single["id"], keys[:heads], values[:heads])
        path = f"/v1/contexts/{single['id']}/attend"
        assert client.post(path, json={"queries": encode(queries), "layer": 0}).status_code == 200
        answer = client.post(path, json={"queries": encode(queries), "layer": 1})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "layer"
        for context in (document, single):
            assert client.delete(f"/v1/contexts/{context['id']}").status_code == 200
            assert client.get(f"/v1/contexts/{context['id']}").status_code == 404
