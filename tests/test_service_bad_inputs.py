"""Every bad input gets a 4xx in the one error shape, naming the field, and changes nothing
that was committed."""

from __future__ import annotations

import base64

import httpx
import pytest
import torch

from tests.service_support import Server, attend, create_context, decode, encode, upload

H, N, D = 2, 300, 8
MAX_BODY = 1 << 20
MAX_TOKENS = 1000


@pytest.fixture(scope="module")
def served():
    server = Server(max_body_bytes=MAX_BODY, max_tokens_per_context=MAX_TOKENS).start()
    client = server.client()
    generator = torch.Generator().manual_seed(5)
    keys, values = (
        torch.randn(H, N, D, generator=generator),
        torch.randn(H, N, D, generator=generator),
    )
    context = create_context(client, head_dim=D)
    upload(client, context["id"], keys, values, chunk=150)
    upload_id = client.post(f"/v1/contexts/{context['id']}/uploads").json()["upload_id"]
    yield server, client, context["id"], upload_id
    client.close()
    server.kill()


def _tensor(shape, dtype=torch.float32, fill=None):
    tensor = torch.randn(*shape).to(dtype) if fill is None else torch.full(shape, fill)
    return encode(tensor)


def _payload(dtype="float32", shape=(H, 3, D), data=None):
    raw = torch.randn(*shape).numpy().tobytes() if data is None else data
    return {"dtype": dtype, "shape": list(shape), "data": base64.b64encode(raw).decode()}


GOOD_QUERIES = _tensor((H, 3, D))
ATTEND, SEARCH, SELF = "attend", "search", "self-attention"
CHUNKS = "uploads/{upload}/chunks"

# (case, method, route under the context (or an absolute path), request options, status, param)
CASES = [
    ("wrong head dim", "POST", ATTEND, {"json": {"queries": _tensor((H, 3, D + 1))}}, 400,
     "queries.shape"),
    ("wrong heads", "POST", ATTEND, {"json": {"queries": _tensor((H + 1, 3, D))}}, 400,
     "queries.shape"),
    ("2-d queries", "POST", ATTEND, {"json": {"queries": _tensor((3, D))}}, 400, "queries.shape"),
    ("integer dtype", "POST", ATTEND, {"json": {"queries": _tensor((H, 3, D), torch.int64)}},
     400, "queries.dtype"),
    ("unknown dtype", "POST", ATTEND, {"json": {"queries": _payload(dtype="float8")}}, 400,
     "queries.dtype"),
    ("shape and bytes disagree", "POST", ATTEND,
     {"json": {"queries": _payload(data=b"\0" * 12)}}, 400, "queries"),
    ("NaN", "POST", ATTEND, {"json": {"queries": _tensor((H, 3, D), fill=float("nan"))}}, 400,
     "queries"),
    ("Inf", "POST", SEARCH, {"json": {"queries": _tensor((H, 3, D), fill=float("inf"))}}, 400,
     "queries"),
    ("empty queries", "POST", ATTEND, {"json": {"queries": _payload(shape=(H, 0, D), data=b"")}},
     400, "queries.shape"),
    ("malformed base64", "POST", ATTEND,
     {"json": {"queries": {"dtype": "float32", "shape": [H, 1, D], "data": "%%%not base64"}}},
     400, "queries.data"),
    ("malformed JSON", "POST", ATTEND,
     {"content": b'{"queries": ', "headers": {"Content-Type": "application/json"}}, 400, "body"),
    ("wrong content type", "POST", ATTEND,
     {"content": b"queries", "headers": {"Content-Type": "text/plain"}}, 415, "Content-Type"),
    ("missing field", "POST", ATTEND, {"json": {}}, 422, "queries"),
    ("unknown field", "POST", ATTEND, {"json": {"queries": GOOD_QUERIES, "topk": 3}}, 422,
     "topk"),
    ("unknown mode", "POST", ATTEND, {"json": {"queries": GOOD_QUERIES, "mode": "fast"}}, 422,
     "mode"),
    ("exact with another mode", "POST", ATTEND,
     {"json": {"queries": GOOD_QUERIES, "exact": True, "mode": "topk"}}, 400, "exact"),
    ("budget out of range", "POST", ATTEND, {"json": {"queries": GOOD_QUERIES, "budget": 2}},
     422, "budget"),
    ("K larger than the context", "POST", ATTEND,
     {"json": {"queries": GOOD_QUERIES, "mode": "topk", "top_k": N + 1}}, 400, "top_k"),
    ("K over the limit", "POST", SEARCH, {"json": {"queries": GOOD_QUERIES, "top_k": 4096}}, 400,
     "top_k"),
    ("K under its old name k", "POST", SEARCH, {"json": {"queries": GOOD_QUERIES, "k": 4096}},
     400, "top_k"),
    ("return_topk larger than the context", "POST", ATTEND,
     {"json": {"queries": GOOD_QUERIES, "return_topk": N + 1}}, 400, "return_topk"),
    ("self-attention rows out of range", "POST", SELF, {"json": {"start": 5, "end": N + 1}},
     400, "end"),
    ("unknown context", "POST", "/v1/contexts/no-such-context/attend",
     {"json": {"queries": GOOD_QUERIES}}, 404, "context_id"),
    ("unknown upload", "POST", "uploads/no-such-upload/commit", {}, 404, "upload_id"),
    ("chunk with the wrong dtype", "POST", CHUNKS,
     {"json": {"keys": _tensor((H, 4, D), torch.float16), "values": _tensor((H, 4, D))}}, 400,
     "keys.dtype"),
    ("chunk values of another length", "POST", CHUNKS,
     {"json": {"keys": _tensor((H, 4, D)), "values": _tensor((H, 5, D))}}, 400, "values.shape"),
    ("chunk with Inf", "POST", CHUNKS,
     {"json": {"keys": _tensor((H, 4, D), fill=float("inf")), "values": _tensor((H, 4, D))}},
     400, "keys"),
    ("raw chunk without tokens", "POST", CHUNKS,
     {"content": b"\0" * 64, "headers": {"Content-Type": "application/octet-stream"}}, 400,
     "tokens"),
    ("raw chunk of the wrong length", "POST", CHUNKS,
     {"content": b"\0" * 64, "params": {"tokens": 3},
      "headers": {"Content-Type": "application/octet-stream"}}, 400, "body (keys)"),
    ("too many tokens", "POST", CHUNKS,
     {"json": {"keys": _tensor((H, MAX_TOKENS, D)), "values": _tensor((H, MAX_TOKENS, D))}},
     413, "tokens"),
    ("oversized body", "POST", ATTEND,
     {"content": b" " * (MAX_BODY + 1), "headers": {"Content-Type": "application/json"}}, 413,
     "body"),
    ("unknown geometry", "POST", "/v1/contexts",
     {"json": {"geometry": {"name": "klein"}, "heads": 1, "head_dim": 4}}, 400, "geometry"),
    ("unknown geometry option", "POST", "/v1/contexts",
     {"json": {"geometry": {"name": "dot", "curvature": 1}, "heads": 1, "head_dim": 4}}, 400,
     "geometry"),
    ("geometry parameter out of range", "POST", "/v1/contexts",
     {"json": {"geometry": {"name": "sphere", "tau_init": -1}, "heads": 1, "head_dim": 4}}, 400,
     "geometry"),
    ("zero heads", "POST", "/v1/contexts",
     {"json": {"geometry": {"name": "dot"}, "heads": 0, "head_dim": 4}}, 422, "heads"),
    ("unknown index option", "POST", "/v1/contexts",
     {"json": {"geometry": {"name": "dot"}, "heads": 1, "head_dim": 4,
               "index": {"kind": "ivf", "options": {"nlists": 4}}}}, 400, "index.options"),
    ("stateless geometry with non-finite logits", "POST", "/v1/attend",
     {"json": {"geometry": {"name": "euclidean", "tau_init": 1e-300}, "q": _tensor((1, 2, 4)),
               "k": _tensor((1, 5, 4)), "v": _tensor((1, 5, 4))}}, 400, "geometry"),
    ("stateless values of another length", "POST", "/v1/attend",
     {"json": {"geometry": {"name": "dot"}, "q": _tensor((1, 2, 4)), "k": _tensor((1, 5, 4)),
               "v": _tensor((1, 6, 4))}}, 400, "v.shape"),
]  # fmt: skip


def _snapshot(client, context_id):
    info = client.get(f"/v1/contexts/{context_id}").json()
    out, lse, _ = attend(client, context_id, torch.ones(H, 2, D), mode="exact")
    return info, out, lse


@pytest.mark.parametrize(
    ("method", "route", "options", "status", "param"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_bad_input_is_a_clean_4xx_and_changes_nothing(
    served, method, route, options, status, param
):
    server, client, context_id, upload_id = served
    before = _snapshot(client, context_id)
    contexts_before = client.get("/v1/contexts").json()["contexts"]
    path = route if route.startswith("/") else f"/v1/contexts/{context_id}/{route}"
    path = path.format(upload=upload_id)
    response = httpx.request(method, server.url + path, timeout=60, **options)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"type", "message", "param"}
    assert error["param"] == param, error
    assert error["message"]
    after = _snapshot(client, context_id)
    assert after[0] == before[0]
    torch.testing.assert_close(after[1], before[1], rtol=0, atol=0)
    torch.testing.assert_close(after[2], before[2], rtol=0, atol=0)
    assert client.get("/v1/contexts").json()["contexts"] == contexts_before
    upload_state = client.get(f"/v1/contexts/{context_id}/uploads/{upload_id}").json()
    assert upload_state["n_tokens"] == 0  # the open upload received nothing


# (kind, option, value): every value is refused when the context is created, by the code that
# builds the index, so none reaches FAISS (an HNSW degree of 0 ended the process in a FAISS
# assertion at the first topk attend) or fails later as a 500.
BAD_INDEX_OPTIONS = [
    ("hnsw", "hnsw_m", 0),
    ("hnsw", "hnsw_m", 1),
    ("hnsw", "hnsw_m", 100000),
    ("hnsw", "ef_search", 0),
    ("hnsw", "hnsw_m", "abc"),
    ("ivf", "nlist", -5),
    ("ivf", "nlist", 0),
    ("ivf", "nlist", "abc"),
    ("ivf", "nlist", 2.5),
    ("ivf", "nprobe", 0),
    ("ivf", "nprobe", True),
    ("ivf", "train_points_per_list", 0),
    ("ivf", "ip_as_l2", "yes"),
    ("ivf", "bands", 0),
    ("flat", "bands", -1),
    ("lsh", "tables", 0),
    ("lsh", "tables", 10**9),
    ("lsh", "bits", "x"),
    ("lsh", "bits", 0),
    ("lsh", "bits", 64),
    ("lsh", "bucket_limit", -1),
    ("lsh", "grid_hashes", 0),
    ("lsh", "grid_width", 0),
    ("lsh", "grid_width", "inf"),
    ("lsh", "band", -1.0),
    ("lsh", "seed", -3),
]


@pytest.mark.parametrize(("kind", "option", "value"), BAD_INDEX_OPTIONS)
def test_bad_index_option_values_are_refused_at_creation(served, kind, option, value):
    _, client, _, _ = served
    before = client.get("/v1/contexts").json()["contexts"]
    body = {
        "geometry": {"name": "euclidean"},
        "heads": 1,
        "head_dim": 4,
        "index": {"kind": kind, "options": {option: value}},
    }
    response = client.post("/v1/contexts", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "index.options"
    assert option in error["message"]
    assert client.get("/v1/contexts").json()["contexts"] == before


@pytest.mark.parametrize("kappa", ["1e308", "-1e308", "1e7", "[0.5, 1e999]"])
def test_curvatures_that_overflow_are_refused_at_creation(served, kappa):
    """1e999 parses as an infinite float; each of these made the index build fail later."""
    _, client, _, _ = served
    before = client.get("/v1/contexts").json()["contexts"]
    body = f'{{"geometry": {{"name": "kappa", "kappa": {kappa}}}, "heads": 2, "head_dim": 4}}'
    response = client.post(
        "/v1/contexts", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "geometry" and "kappa" in error["message"]
    assert client.get("/v1/contexts").json()["contexts"] == before


@pytest.mark.parametrize(
    ("kind", "options"),
    [("hnsw", {"hnsw_m": 2, "ef_search": 1}), ("ivf", {"nlist": 100000, "nprobe": 65536})],
)
def test_extreme_legal_index_options_attend(served, kind, options):
    """The smallest HNSW graph, and more IVF lists than keys (capped at the number of keys)."""
    _, client, _, _ = served
    context = create_context(client, head_dim=D, index={"kind": kind, "options": options})
    generator = torch.Generator().manual_seed(6)
    keys, values = (torch.randn(H, 200, D, generator=generator) for _ in range(2))
    upload(client, context["id"], keys, values)
    out, lse, _ = attend(client, context["id"], torch.randn(H, 5, D), mode="topk")
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert client.get("/livez").status_code == 200


@pytest.mark.parametrize("route", [ATTEND, SELF])
@pytest.mark.parametrize("mode", ["tail", "topk"])
def test_windows_and_sinks_beyond_the_context_read_every_key(served, route, mode):
    """A window of 10^18 was an 8e18-byte allocation (500); now it reads every key, as a
    window of 2 N + 1 does (in tail mode: exact attention)."""
    _, client, context_id, _ = served
    queries = {"queries": encode(torch.randn(H, 4, D, generator=torch.Generator().manual_seed(7)))}
    if route == SELF:
        queries = {"start": 10, "end": 14}
    url = f"/v1/contexts/{context_id}/{route}"
    results = []
    reference = {"mode": "exact"} if mode == "tail" else {"mode": mode, "window": 2 * N + 1}
    for options in (reference, {"mode": mode, "window": 10**18}, {"mode": mode, "sinks": 10**18}):
        response = client.post(url, json={**queries, **options})
        assert response.status_code == 200, response.text
        results.append([decode(response.json()[name]) for name in ("out", "lse")])
    expected = results[0]
    for out, lse in results[1:]:
        torch.testing.assert_close(out, expected[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(lse, expected[1], rtol=1e-4, atol=1e-5)
