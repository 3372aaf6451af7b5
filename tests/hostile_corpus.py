"""The hostile-input corpus of tests/test_service_hostile.py: requests a hostile or careless
client sends (bad option values for every geometry and index kind, sizes, encodings, paths,
authentication). Each `Case` is one request; `then_use` cases create a context that, when the
service accepts it, is then filled and attended in every mode (a value accepted at creation
must never fail later)."""

from __future__ import annotations

import base64
import inspect
from dataclasses import dataclass, field
from typing import Any

from rewa.attention import GEOMETRIES, Geometry
from rewa.index import CompositeLSH, IndexSettings

H, D = 2, 8
KEY = "hostile-key"


@dataclass
class Case:
    name: str
    method: str
    path: str  # {context} and {upload} are filled in
    json: Any = None
    content: bytes | None = None
    headers: dict[str, str | bytes] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    authorized: bool = True
    then_use: bool = False  # a context creation: when accepted, fill it and attend


def payload(shape, dtype="float32", data: bytes | None = None, itemsize: int = 4) -> dict:
    """A tensor payload; `data` defaults to zeros of the right length (NaN-free)."""
    count = 1
    for size in shape:
        count *= max(size, 0)
    raw = b"\0" * (count * itemsize) if data is None else data
    return {"dtype": dtype, "shape": list(shape), "data": base64.b64encode(raw).decode()}


# Values no option expects; some are legal for some options (then the context must work).
HOSTILE_VALUES: list[Any] = [
    "x", "", -1, 0, 10**9, 10**30, -1e308, 1e308, 1e-320, True, None, [], {}, [1, "a"],
    {"nested": {"deeper": [1]}},
]  # fmt: skip


def _geometry_options(cls: type) -> list[str]:
    names: list[str] = []
    for klass in cls.__mro__:
        if klass is Geometry:
            break
        for parameter in inspect.signature(klass.__init__).parameters.values():
            keyword = parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
            if keyword and parameter.name not in ("self", "dim", "heads", *names):
                names.append(parameter.name)
    return names


def _create(name: str, geometry: dict, index: dict | None = None, **extra) -> Case:
    body = {"geometry": geometry, "heads": H, "head_dim": D, **extra}
    if index is not None:
        body["index"] = index
    return Case(name, "POST", "/v1/contexts", json=body, then_use=True)


def geometry_cases() -> list[Case]:
    cases = []
    for geometry, cls in sorted(GEOMETRIES.items()):
        for option in _geometry_options(cls):
            for value in HOSTILE_VALUES:
                spec = {"name": geometry, option: value}
                cases.append(_create(f"geometry {geometry}.{option}={value!r}", spec))
    cases.append(_create("geometry without a name", {"kappa": 1}))
    cases.append(_create("geometry name a number", {"name": 5}))
    cases.append(_create("kappa per head of the wrong length", {"name": "kappa", "kappa": [1] * 7}))
    return cases


def index_cases() -> list[Case]:
    cases = []
    kinds = {
        "lsh": set(inspect.signature(CompositeLSH.__init__).parameters) - {"self", "geometry"},
        **{kind: set(IndexSettings.__dataclass_fields__) - {"kind"} for kind in ("ivf", "hnsw")},
        "flat": {"bands"},
    }
    for kind, options in sorted(kinds.items()):
        for option in sorted(options):
            for value in HOSTILE_VALUES:
                index = {"kind": kind, "options": {option: value}}
                cases.append(
                    _create(f"index {kind}.{option}={value!r}", {"name": "euclidean"}, index)
                )
    for field_name, value in [("k", 0), ("k", 10**6), ("window", -1), ("budget", 0),
                              ("budget", 2), ("sinks", 10**18), ("window", 10**18),
                              ("kind", "annoy"), ("budget", 1e-300)]:  # fmt: skip
        index = {"kind": "ivf", field_name: value}
        cases.append(_create(f"index {field_name}={value!r}", {"name": "dot"}, index))
    return cases


def size_cases() -> list[Case]:
    attend = "/v1/contexts/{context}/attend"
    self_attention = "/v1/contexts/{context}/self-attention"
    queries = payload((H, 2, D))
    cases = [
        Case("heads 10^9", "POST", "/v1/contexts",
             json={"geometry": {"name": "dot"}, "heads": 10**9, "head_dim": D}),
        Case("head_dim 10^9", "POST", "/v1/contexts",
             json={"geometry": {"name": "dot"}, "heads": 1, "head_dim": 10**9}),
        Case("value_dim 10^9", "POST", "/v1/contexts",
             json={"geometry": {"name": "dot"}, "heads": 1, "head_dim": 4, "value_dim": 10**9}),
        Case("name of 10^5 characters", "POST", "/v1/contexts",
             json={"geometry": {"name": "dot"}, "heads": 1, "head_dim": 4, "name": "n" * 10**5}),
        Case("queries shape of 10^12 elements", "POST", attend,
             json={"queries": payload((H, 10**12, D), data=b"")}),
        Case("queries shape with a negative size", "POST", attend,
             json={"queries": payload((H, -2, D), data=b"")}),
        Case("queries shape whose product overflows int64", "POST", attend,
             json={"queries": payload((2**40, 2**40, 2**40), data=b"")}),
        Case("queries of 4 dimensions", "POST", attend, json={"queries": payload((1, H, 2, D))}),
        Case("queries of 0 dimensions", "POST", attend, json={"queries": payload(())}),
        Case("too many queries", "POST", attend, json={"queries": payload((H, 40000, D))}),
        Case("k 10^18", "POST", attend, json={"queries": queries, "mode": "topk", "k": 10**18}),
        Case("k -1", "POST", attend, json={"queries": queries, "mode": "topk", "k": -1}),
        Case("return_topk 10^18", "POST", attend, json={"queries": queries, "return_topk": 10**18}),
        Case("budget 1e-300", "POST", attend, json={"queries": queries, "budget": 1e-300}),
        Case("budget NaN", "POST", attend,
             content=b'{"queries": ' + _json(queries) + b', "budget": NaN}'),
        Case("window 1e300 as a float", "POST", attend, json={"queries": queries, "window": 1e300}),
        Case("window 10^30", "POST", attend, json={"queries": queries, "window": 10**30}),
        Case("self-attention start 10^18", "POST", self_attention, json={"start": 10**18}),
        Case("self-attention end 10^18", "POST", self_attention, json={"end": 10**18}),
        Case("self-attention start after end", "POST", self_attention,
             json={"start": 20, "end": 10}),
        Case("self-attention start -1", "POST", self_attention, json={"start": -1}),
        Case("self-attention queries and end", "POST", self_attention,
             json={"queries": queries, "end": 5}),
        Case("self-attention queries past the end", "POST", self_attention,
             json={"queries": queries, "start": 10**6}),
        Case("search k 10^9", "POST", "/v1/contexts/{context}/search",
             json={"queries": queries, "k": 10**9}),
        Case("stateless 10^6 keys announced", "POST", "/v1/attend",
             json={"geometry": {"name": "dot"}, "q": payload((1, 1, 4)),
                   "k": payload((1, 10**6, 4), data=b""), "v": payload((1, 10**6, 4), data=b"")}),
        Case("stateless of different heads", "POST", "/v1/attend",
             json={"geometry": {"name": "dot"}, "q": payload((2, 1, 4)), "k": payload((1, 3, 4)),
                   "v": payload((1, 3, 4))}),
        Case("stateless with a huge geometry", "POST", "/v1/attend",
             json={"geometry": {"name": "random_features", "features": 10**9},
                   "q": payload((1, 1, 4)), "k": payload((1, 3, 4)), "v": payload((1, 3, 4))}),
        Case("raw chunk tokens 10^12", "POST", "/v1/contexts/{context}/uploads/{upload}/chunks",
             content=b"\0" * 64, params={"tokens": 10**12},
             headers={"Content-Type": "application/octet-stream"}),
        Case("raw chunk tokens -5", "POST", "/v1/contexts/{context}/uploads/{upload}/chunks",
             content=b"\0" * 64, params={"tokens": -5},
             headers={"Content-Type": "application/octet-stream"}),
        Case("raw chunk tokens not a number", "POST",
             "/v1/contexts/{context}/uploads/{upload}/chunks", content=b"\0" * 64,
             params={"tokens": "many"}, headers={"Content-Type": "application/octet-stream"}),
        Case("chunk of 0 tokens", "POST", "/v1/contexts/{context}/uploads/{upload}/chunks",
             json={"keys": payload((H, 0, D), data=b""), "values": payload((H, 0, D), data=b"")}),
    ]  # fmt: skip
    return cases


def _json(value: Any) -> bytes:
    import json

    return json.dumps(value).encode()


def encoding_cases() -> list[Case]:
    attend = "/v1/contexts/{context}/attend"
    json_type = {"Content-Type": "application/json"}
    good = payload((H, 2, D))
    return [
        Case("deeply nested JSON", "POST", attend, content=b"[" * 100000 + b"]" * 100000,
             headers=json_type),
        Case("deeply nested JSON object", "POST", "/v1/contexts",
             content=b'{"a":' * 50000 + b"1" + b"}" * 50000, headers=json_type),
        Case("number with 10^5 digits", "POST", attend,
             content=b'{"queries": ' + _json(good) + b', "k": ' + b"9" * 100000 + b"}",
             headers=json_type),
        Case("exponent 1e999999", "POST", attend,
             content=b'{"queries": ' + _json(good) + b', "budget": 1e999999}', headers=json_type),
        Case("invalid UTF-8", "POST", attend, content=b'{"queries": "\xff\xfe"}',
             headers=json_type),
        Case("UTF-16 body", "POST", attend, content='{"queries": 1}'.encode("utf-16"),
             headers=json_type),
        Case("NUL bytes in JSON", "POST", attend, content=b'{"queries\0": 1}', headers=json_type),
        Case("empty JSON body", "POST", attend, content=b"", headers=json_type),
        Case("JSON null body", "POST", attend, content=b"null", headers=json_type),
        Case("JSON array body", "POST", attend, content=b"[1, 2]", headers=json_type),
        Case("JSON string body", "POST", attend, content=b'"queries"', headers=json_type),
        Case("duplicate keys", "POST", attend,
             content=b'{"queries": ' + _json(good) + b', "queries": 5}', headers=json_type),
        Case("base64 with whitespace", "POST", attend,
             json={"queries": {**good, "data": " " + good["data"]}}),
        Case("base64url alphabet", "POST", attend,
             json={"queries": {**good, "data": good["data"].replace("A", "-")}}),
        Case("base64 without padding", "POST", attend,
             json={"queries": payload((H, 1, 3), data=b"\0" * (H * 3 * 4 - 1))}),
        Case("data of the wrong length", "POST", attend,
             json={"queries": payload((H, 2, D), data=b"\0" * 7)}),
        Case("dtype int64 queries", "POST", attend,
             json={"queries": payload((H, 2, D), dtype="int64", itemsize=8)}),
        Case("dtype float64 queries", "POST", attend,
             json={"queries": payload((H, 2, D), dtype="float64", itemsize=8)}),
        Case("dtype of another case", "POST", attend,
             json={"queries": {**good, "dtype": "FLOAT32"}}),
        Case("dtype a list", "POST", attend, json={"queries": {**good, "dtype": ["float32"]}}),
        Case("shape of strings", "POST", attend, json={"queries": {**good, "shape": ["2", 2, 8]}}),
        Case("shape of floats", "POST", attend, json={"queries": {**good, "shape": [2.5, 2, 8]}}),
        Case("shape of booleans", "POST", attend,
             json={"queries": {**good, "shape": [True, 2, 8]}}),
        Case("payload a list of floats", "POST", attend, json={"queries": [[[0.0] * D] * 2] * H}),
        Case("payload with an extra field", "POST", attend,
             json={"queries": {**good, "order": "F"}}),
        Case("float16 NaN bits", "POST", "/v1/contexts/{context}/uploads/{upload}/chunks",
             json={"keys": payload((H, 1, D), data=b"\xff\x7f" * (H * D * 2)),
                   "values": payload((H, 1, D))}),
        Case("XML body", "POST", attend, content=b"<queries/>",
             headers={"Content-Type": "application/xml"}),
        Case("form body", "POST", attend, content=b"queries=1",
             headers={"Content-Type": "application/x-www-form-urlencoded"}),
        Case("JSON with a charset parameter", "POST", attend, content=_json({"queries": 1}),
             headers={"Content-Type": "application/json; charset=latin-1"}),
        Case("gzip content encoding", "POST", attend, content=b"\x1f\x8b\x08\x00garbage",
             headers={"Content-Type": "application/json", "Content-Encoding": "gzip"}),
    ]  # fmt: skip


def path_cases() -> list[Case]:
    ids = ["..%2F..%2Fetc%2Fpasswd", "%00", "a" * 5000, "%E2%98%83", "*", "%2e%2e",
           "00000000000000000000000000000000", "{context}%00", "-1", "null"]  # fmt: skip
    cases = []
    for identifier in ids:
        cases += [
            Case(f"get context {identifier[:20]!r}", "GET", f"/v1/contexts/{identifier}"),
            Case(f"delete context {identifier[:20]!r}", "DELETE", f"/v1/contexts/{identifier}"),
            Case(f"attend context {identifier[:20]!r}", "POST",
                 f"/v1/contexts/{identifier}/attend", json={"queries": payload((H, 1, D))}),
            Case(f"commit upload {identifier[:20]!r}", "POST",
                 f"/v1/contexts/{{context}}/uploads/{identifier}/commit"),
        ]  # fmt: skip
    cases += [
        Case("unknown route", "GET", "/v1/nothing-here"),
        Case("unknown version", "GET", "/v2/contexts"),
        Case("method not allowed", "PATCH", "/v1/contexts"),
        Case("TRACE", "TRACE", "/v1/contexts"),
        Case("double slashes", "GET", "//v1//contexts"),
        Case("query string flood", "GET", "/v1/contexts",
             params={f"p{i}": "x" for i in range(500)}),
        Case("upload of another context", "POST", "/v1/contexts/{other}/uploads/{upload}/commit"),
    ]  # fmt: skip
    return cases


def auth_cases() -> list[Case]:
    headers = [
        {}, {"Authorization": ""}, {"Authorization": "Bearer"},
        {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"},
        {"Authorization": f"Bearer {KEY[:-1]}"}, {"Authorization": f"Bearer  {KEY}"},
        {"Authorization": "Bearer " + "a" * 10000},
        {"Authorization": "Bearer \u00e9t\u00e9".encode()},
        {"Authorization": f"Bearer {KEY},{KEY}"},
    ]  # fmt: skip
    cases = []
    for number, header in enumerate(headers):
        for method, path in [("GET", "/v1/contexts"), ("GET", "/v1/contexts/{context}"),
                             ("POST", "/v1/contexts/{context}/attend"),
                             ("DELETE", "/v1/contexts/{context}")]:  # fmt: skip
            cases.append(
                Case(f"auth {number} {method} {path}", method, path, headers=dict(header),
                     json={} if method == "POST" else None, authorized=False)
            )  # fmt: skip
    return cases


def corpus() -> list[Case]:
    return (
        geometry_cases()
        + index_cases()
        + size_cases()
        + encoding_cases()
        + path_cases()
        + (auth_cases())
    )
