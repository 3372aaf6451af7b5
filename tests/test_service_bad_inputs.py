"""Every bad input gets a 4xx in the one error shape, naming the field, and changes nothing
that was committed."""

from __future__ import annotations

import base64

import httpx
import pytest
import torch

from tests.service_support import Server, attend, create_context, encode, upload

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
     {"json": {"queries": GOOD_QUERIES, "mode": "topk", "k": N + 1}}, 400, "k"),
    ("K over the limit", "POST", SEARCH, {"json": {"queries": GOOD_QUERIES, "k": 4096}}, 400,
     "k"),
    ("return_topk larger than the context", "POST", ATTEND,
     {"json": {"queries": GOOD_QUERIES, "return_topk": N + 1}}, 400, "return_topk"),
    ("causal tail", "POST", SELF, {"json": {"causal": True, "mode": "tail", "end": 10}}, 400,
     "mode"),
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
