"""The HTTP clients of the rewa service: `Client` (blocking) and `AsyncClient` (asyncio), on
httpx.

Every endpoint is written once, as a generator in `_Operations` that yields `_Request`s and
receives the responses; `Client` and `AsyncClient` only send what it yields, so both have the
same methods with the same arguments and results.

Tensors go in as numpy arrays or torch tensors (any float dtype; sent in float32, or in the
context's dtype for uploads) and come back as torch tensors when the input was one, else as
numpy arrays. The module needs numpy, httpx and safetensors only: torch is imported when the
caller's tensors are torch tensors. Upload chunks of more than `BINARY_THRESHOLD` bytes travel
as raw `application/octet-stream` bodies, smaller ones as base64 JSON.

Failures raise `RewaError` (the server's `{"error": {"type", "message", "param"}}` and status)
or its subclass `RewaConnectionError` (no response). 429 and 503 answers, and connections that
could not be opened, are retried up to `retries` times, waiting what `Retry-After` says or else
`backoff * 2^attempt` seconds (at most `max_backoff`)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import inspect
import itertools
import json
import time
import types
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass, field
from typing import Any, Concatenate, Generic, NamedTuple, ParamSpec, TypedDict, TypeVar

import httpx
import numpy as np
from safetensors.numpy import load as safetensors_load
from safetensors.numpy import save as safetensors_save

BINARY_THRESHOLD = 64 * 1024
# How attend requests and answers travel: safetensors bodies, or base64 tensors inside JSON.
WIRES = ("safetensors", "json")
SAFETENSORS = "application/x-safetensors"
DEFAULT_URL = "http://127.0.0.1:8000"
RETRY_STATUSES = (429, 503)
# Sent with every request on one context (its id), so that a load balancer can hash on it and
# keep each context on one replica's cache (deploy/k8s/ingress.yaml).
ROUTING_HEADER = "X-Rewa-Context"


class RewaError(Exception):
    """An error answer of the service: `status`, and the error body's `type`, `message` and
    `param` (the offending field); `body` is the whole decoded body."""

    def __init__(self, status: int | None, body: Any) -> None:
        error = body.get("error", {}) if isinstance(body, dict) else {}
        self.status = status
        self.body = body
        self.type = error.get("type")
        self.message = error.get("message", str(body))
        self.param = error.get("param")
        where = f" (param {self.param})" if self.param else ""
        super().__init__(f"{status} {self.type}: {self.message}{where}")


class RewaConnectionError(RewaError):
    """No answer: the connection failed or timed out."""

    def __init__(self, error: Exception) -> None:
        super().__init__(None, {"error": {"type": "connection", "message": str(error)}})


# -- tensors ----------------------------------------------------------------------------------
# numpy only: torch is imported when the caller's tensors are torch tensors, never before, so
# that the client installs and imports with numpy, httpx and safetensors alone.

_NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16}
# How each wire dtype is read into numpy; bfloat16 as its raw 16 bits (numpy has no bfloat16).
_WIRE_DTYPES = {**_NUMPY_DTYPES, "float64": np.float64, "int64": np.int64, "bfloat16": np.uint16}


def is_torch(tensor: Any) -> bool:
    return type(tensor).__module__.partition(".")[0] == "torch"


def to_array(tensor: Any, dtype: str = "float32") -> np.ndarray:
    """A contiguous numpy array of `tensor` (numpy array or torch tensor) in `dtype`; for
    bfloat16, its raw bits as uint16."""
    if is_torch(tensor):
        import torch

        tensor = tensor.detach().to("cpu")
        if dtype == "bfloat16":
            bits = tensor.to(torch.bfloat16).contiguous().view(torch.int16)
            return bits.numpy().view(np.uint16)
        return np.ascontiguousarray(tensor.to(getattr(torch, dtype)).numpy())
    if dtype == "bfloat16":
        return bfloat16_bits(np.asarray(tensor))
    return np.ascontiguousarray(tensor, dtype=_NUMPY_DTYPES[dtype])


def bfloat16_bits(array: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (to nearest, ties to even), as uint16 bits."""
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def from_bfloat16_bits(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def encode_tensor(tensor: Any, dtype: str = "float32") -> dict:
    """`{"dtype", "shape", "data"}` of a numpy array or torch tensor, sent as `dtype`."""
    return _encoded(to_array(tensor, dtype), dtype)


def _encoded(array: np.ndarray, dtype: str) -> dict:
    """`{"dtype", "shape", "data"}` of an array already in `dtype` (`to_array`)."""
    data = base64.b64encode(array.tobytes()).decode("ascii")
    return {"dtype": dtype, "shape": list(array.shape), "data": data}


def as_result(array: np.ndarray, as_torch: bool, bfloat16_bits: bool = False) -> Any:
    """A received array as the caller gets it: a torch tensor when its input was one, else
    numpy. `bfloat16_bits`: the array holds bfloat16 as uint16 bits (base64 JSON), kept as
    bfloat16 in torch and widened to float32 in numpy (which has no bfloat16)."""
    if as_torch:
        import torch

        tensor = torch.from_numpy(array)
        return tensor.view(torch.bfloat16) if bfloat16_bits else tensor
    return from_bfloat16_bits(array) if bfloat16_bits else array


def decode_tensor(payload: dict | None, as_torch: bool) -> Any:
    """The tensor of a response's `{"dtype", "shape", "data"}` (None stays None)."""
    if payload is None:
        return None
    raw = bytearray(base64.b64decode(payload["data"]))
    array = np.frombuffer(raw, dtype=_WIRE_DTYPES[payload["dtype"]])
    shaped = array.reshape(tuple(payload["shape"]))
    return as_result(shaped, as_torch, bfloat16_bits=payload["dtype"] == "bfloat16")


# -- results ----------------------------------------------------------------------------------


@dataclass
class AttendResult:
    """`out (heads, n, value_dim)`, `lse (heads, n)`; with `return_topk`, the best `ids` and
    their attention `weights` `(heads, n, R)`."""

    out: Any
    lse: Any
    mode: str
    version: int
    ids: Any = None
    weights: Any = None


class InlineResult(NamedTuple):
    """`attend_inline`'s answer, `out (heads, nq, dv)` and `lse (heads, nq)`; it unpacks as the
    pair `out, lse`."""

    out: Any
    lse: Any


@dataclass
class SearchResult:
    """Each query's top K `ids`, logits `scores` and, for distance geometries, `distances`."""

    ids: Any
    scores: Any
    version: int
    distances: Any = None


@dataclass
class _Request:
    method: str
    path: str
    json: Any = None
    content: bytes | None = None
    params: dict = field(default_factory=dict)
    headers: dict = field(default_factory=dict)
    retry: bool = True  # on 429 / 503
    accept: tuple[int, ...] = ()  # error statuses returned instead of raised

    def arguments(self) -> dict:
        headers = dict(self.headers)
        parts = self.path.split("/")
        if parts[:3] == ["", "v1", "contexts"] and len(parts) > 3:
            headers[ROUTING_HEADER] = parts[3]
        arguments: dict[str, Any] = {"params": self.params, "headers": headers}
        if self.json is not None:
            arguments["json"] = self.json
        if self.content is not None:
            arguments["content"] = self.content
        return arguments


T = TypeVar("T")
P = ParamSpec("P")
# An endpoint: yields requests, receives their responses, returns its result (a `T`).
Operation = Generator[_Request, httpx.Response, T]


class ContextInfo(TypedDict):
    """A context as the service describes it (a plain dict)."""

    id: str
    name: str | None
    geometry: dict[str, Any]
    heads: int
    layers: int
    head_dim: int
    value_dim: int
    dtype: str
    index: dict[str, Any]
    n_tokens: int
    version: int
    created_at: float
    updated_at: float


class IndexState(TypedDict):
    """What the answering replica holds of a context's latest version (a plain dict)."""

    context_id: str
    version: int
    loaded: bool
    built: list[str]
    building: list[str]
    sealed_tokens: int | None
    seconds: float | None
    audit: list[dict[str, Any]] | None


class UploadInfo(TypedDict):
    """An open upload (a plain dict)."""

    upload_id: str
    context_id: str
    chunks: int
    n_tokens: int


def _settings(**options: Any) -> dict:
    """The request fields that were given (None: the context's default)."""
    return {name: value for name, value in options.items() if value is not None}


def _attend_result(found: dict, as_torch: bool) -> AttendResult:
    return AttendResult(
        out=decode_tensor(found["out"], as_torch),
        lse=decode_tensor(found["lse"], as_torch),
        mode=found["mode"],
        version=found["version"],
        ids=decode_tensor(found.get("ids"), as_torch),
        weights=decode_tensor(found.get("weights"), as_torch),
    )


class _Operations:
    """Every endpoint, as a generator of requests (module docstring)."""

    # -- probes -----------------------------------------------------------------------------

    def livez(self) -> Operation[bool]:
        """`True` when the process answers."""
        response = yield _Request("GET", "/livez")
        return response.json()["status"] == "ok"

    def ready(self) -> Operation[bool]:
        """`True` when the server is ready (store reachable), `False` on 503; not retried."""
        response = yield _Request("GET", "/readyz", retry=False, accept=(503,))
        return response.status_code == 200

    def metrics(self) -> Operation[str]:
        """The Prometheus metrics text."""
        response = yield _Request("GET", "/metrics")
        return response.text

    # -- contexts ---------------------------------------------------------------------------

    def create_context(
        self,
        heads: int,
        head_dim: int,
        *,
        geometry: str | dict = "dot",
        value_dim: int | None = None,
        dtype: str = "float32",
        index: dict | None = None,
        name: str | None = None,
        geometry_state: dict | None = None,
        layers: int = 1,
    ) -> Operation[ContextInfo]:
        """Create an empty context; `geometry` is a name or `{"name", **options}`, `index`
        the index settings (`kind`, `top_k`, `window`, `sinks`, `budget`, `options`);
        `geometry_state` a trained geometry's `state_dict()` (`set_geometry_state`). With
        `layers` > 1, a multi-layer document: its tokens carry `layers x heads` heads (layer
        0's first) and every query names its `layer`."""
        spec = {"name": geometry} if isinstance(geometry, str) else dict(geometry)
        body = {"geometry": spec, "heads": heads, "head_dim": head_dim, "dtype": dtype}
        body |= _settings(value_dim=value_dim, index=index, name=name)
        if layers != 1:
            body["layers"] = layers
        response = yield _Request("POST", "/v1/contexts", json=body)
        context = response.json()
        if geometry_state is not None:
            try:
                yield from _Operations.set_geometry_state(self, context["id"], geometry_state)
            except Exception:
                with contextlib.suppress(RewaError):  # no half-made context left behind
                    yield from _Operations.delete_context(self, context["id"])
                raise
        return context

    def list_contexts(self) -> Operation[list[ContextInfo]]:
        response = yield _Request("GET", "/v1/contexts")
        return response.json()["contexts"]

    def get_context(self, context_id: str) -> Operation[ContextInfo]:
        response = yield _Request("GET", f"/v1/contexts/{context_id}")
        return response.json()

    def delete_context(self, context_id: str) -> Operation[None]:
        yield _Request("DELETE", f"/v1/contexts/{context_id}")

    def index_state(self, context_id: str) -> Operation[IndexState]:
        """What the replica that answers holds of the latest version: `{"loaded", "built",
        "building", "sealed_tokens", "audit"}` (modes built, modes being built; per head what
        its audit measured, None when it does not audit)."""
        response = yield _Request("GET", f"/v1/contexts/{context_id}/index")
        return response.json()

    def build_index(self, context_id: str, modes: list[str] | None = None) -> Operation[IndexState]:
        """Build the modes' indexes of the latest version now (default: the context's default
        mode) and return the index state once they are built."""
        body = {"modes": modes} if modes else None
        response = yield _Request("POST", f"/v1/contexts/{context_id}/index", json=body)
        return response.json()

    def set_geometry_state(self, context_id: str, state: dict) -> Operation[dict[str, Any]]:
        """Give the context's geometry trained parameters: `state` is the `state_dict()` of a
        geometry of the context's spec (torch tensors or numpy arrays). Only before the first
        commit."""
        tensors = {name: to_array(tensor) for name, tensor in state.items()}
        path = f"/v1/contexts/{context_id}/geometry-state"
        headers = {"Content-Type": SAFETENSORS}
        response = yield _Request("PUT", path, content=safetensors_save(tensors), headers=headers)
        return response.json()

    def get_geometry_state(
        self, context_id: str, *, as_torch: bool = False
    ) -> Operation[dict[str, Any] | None]:
        """The context's geometry state (numpy arrays, or torch tensors), or None when it has
        none."""
        path = f"/v1/contexts/{context_id}/geometry-state"
        response = yield _Request("GET", path)
        if response.status_code == 204:
            return None
        state = safetensors_load(response.content)
        return {name: as_result(array, as_torch) for name, array in state.items()}

    # -- uploads ----------------------------------------------------------------------------

    def begin_upload(self, context_id: str) -> Operation[str]:
        """Open an upload; returns its id."""
        response = yield _Request("POST", f"/v1/contexts/{context_id}/uploads")
        return response.json()["upload_id"]

    def add_chunk(
        self, context_id: str, upload_id: str, keys: Any, values: Any, dtype: str = "float32"
    ) -> Operation[UploadInfo]:
        """Append keys `(heads, n, head_dim)` and values `(heads, n, value_dim)`, sent in
        `dtype` (the context's); raw bytes above `BINARY_THRESHOLD`, else JSON."""
        keys, values = to_array(keys, dtype), to_array(values, dtype)
        path = f"/v1/contexts/{context_id}/uploads/{upload_id}/chunks"
        if keys.nbytes + values.nbytes > BINARY_THRESHOLD:
            request = _Request(
                "POST",
                path,
                content=keys.tobytes() + values.tobytes(),
                params={"tokens": keys.shape[1]},
                headers={"Content-Type": "application/octet-stream"},
            )
        else:
            body = {"keys": _encoded(keys, dtype), "values": _encoded(values, dtype)}
            request = _Request("POST", path, json=body)
        response = yield request
        return response.json()

    def get_upload(self, context_id: str, upload_id: str) -> Operation[UploadInfo]:
        response = yield _Request("GET", f"/v1/contexts/{context_id}/uploads/{upload_id}")
        return response.json()

    def commit_upload(self, context_id: str, upload_id: str) -> Operation[ContextInfo]:
        """Make the upload's tokens visible, atomically; returns the context."""
        path = f"/v1/contexts/{context_id}/uploads/{upload_id}/commit"
        response = yield _Request("POST", path)
        return response.json()

    def abort_upload(self, context_id: str, upload_id: str) -> Operation[None]:
        yield _Request("DELETE", f"/v1/contexts/{context_id}/uploads/{upload_id}")

    def upload(
        self,
        context_id: str,
        keys: Any,
        values: Any,
        *,
        chunk_tokens: int = 8192,
        progress: Callable[[int, int], None] | None = None,
    ) -> Operation[ContextInfo]:
        """Append keys `(heads, N, head_dim)` and values `(heads, N, value_dim)` in chunks of
        `chunk_tokens` and commit them as one new version; returns the context. On any failure
        the upload is aborted (nothing of it becomes visible) and the error raised.
        `progress(tokens_sent, total)` after every chunk."""
        if chunk_tokens < 1:
            raise ValueError(f"expected chunk_tokens >= 1, got {chunk_tokens}")
        # `_Operations.` explicitly: on a client, `self.get_context` is the sending method.
        context = yield from _Operations.get_context(self, context_id)
        upload_id = yield from _Operations.begin_upload(self, context_id)
        total = keys.shape[1]
        try:
            for start in range(0, total, chunk_tokens):
                end = min(start + chunk_tokens, total)
                yield from _Operations.add_chunk(
                    self,
                    context_id,
                    upload_id,
                    keys[:, start:end],
                    values[:, start:end],
                    context["dtype"],
                )
                if progress is not None:
                    progress(end, total)
            return (yield from _Operations.commit_upload(self, context_id, upload_id))
        except Exception:
            with contextlib.suppress(RewaError):  # if not, the upload expires on its own
                yield from _Operations.abort_upload(self, context_id, upload_id)
            raise

    # -- attention --------------------------------------------------------------------------

    def attend(
        self,
        context_id: str,
        queries: Any,
        *,
        mode: str | None = None,
        exact: bool = False,
        top_k: int | None = None,
        budget: float | None = None,
        window: int | None = None,
        sinks: int | None = None,
        return_topk: int | None = None,
        layer: int | None = None,
        measured_queries: int | None = None,
    ) -> Operation[AttendResult]:
        """Attention of queries `(heads, n, head_dim)` over the stored context (`layer`: the
        layer of a multi-layer document): an
        `AttendResult`. `mode` tail (the server's default), topk or exact; `measured_queries`
        (tail mode): that many queries per head answered exactly, the others moved toward the
        keys read by a factor fitted on them. With the client's
        `wire` safetensors (the default) queries and answer travel as safetensors bodies, else
        as base64 JSON."""
        options = {"exact": exact} | _settings(
            mode=mode,
            top_k=top_k,
            budget=budget,
            window=window,
            sinks=sinks,
            return_topk=return_topk,
            layer=layer,
            measured_queries=measured_queries,
        )
        path = f"/v1/contexts/{context_id}/attend"
        if self.wire == "json":
            body = {"queries": encode_tensor(queries), **options}
            response = yield _Request("POST", path, json=body)
            return _attend_result(response.json(), is_torch(queries))
        content = safetensors_save(
            {"queries": to_array(queries)}, metadata={"options": json.dumps(options)}
        )
        headers = {"Content-Type": SAFETENSORS, "Accept": SAFETENSORS}
        response = yield _Request("POST", path, content=content, headers=headers)
        tensors = safetensors_load(response.content)
        as_torch = is_torch(queries)
        found = {name: as_result(array, as_torch) for name, array in tensors.items()}
        return AttendResult(
            out=found["out"],
            lse=found["lse"],
            mode=response.headers["X-Rewa-Mode"],
            version=int(response.headers["X-Rewa-Version"]),
            ids=found.get("ids"),
            weights=found.get("weights"),
        )

    def search(
        self,
        context_id: str,
        queries: Any,
        top_k: int = 10,
        *,
        exact: bool = False,
        layer: int | None = None,
    ) -> Operation[SearchResult]:
        """Each query's `top_k` best keys: a `SearchResult`."""
        body = {"queries": encode_tensor(queries), "top_k": top_k, "exact": exact}
        body |= _settings(layer=layer)
        response = yield _Request("POST", f"/v1/contexts/{context_id}/search", json=body)
        found, as_torch = response.json(), is_torch(queries)
        return SearchResult(
            ids=decode_tensor(found["ids"], as_torch),
            scores=decode_tensor(found["scores"], as_torch),
            version=found["version"],
            distances=decode_tensor(found.get("distances"), as_torch),
        )

    def self_attention(
        self,
        context_id: str,
        *,
        queries: Any = None,
        start: int = 0,
        end: int | None = None,
        causal: bool = False,
        mode: str | None = None,
        exact: bool = False,
        top_k: int | None = None,
        budget: float | None = None,
        window: int | None = None,
        sinks: int | None = None,
        layer: int | None = None,
        measured_queries: int | None = None,
    ) -> Operation[AttendResult]:
        """Rows `[start, end)` of the stored context attend over it (`queries` for those rows,
        or the stored keys): an `AttendResult`. `measured_queries` as for `attend` (causal:
        per segment)."""
        body: dict[str, Any] = {"start": start, "causal": causal, "exact": exact}
        if queries is not None:
            body["queries"] = encode_tensor(queries)
        body |= _settings(
            end=end, mode=mode, top_k=top_k, budget=budget, window=window, sinks=sinks,
            layer=layer, measured_queries=measured_queries,
        )  # fmt: skip
        path = f"/v1/contexts/{context_id}/self-attention"
        response = yield _Request("POST", path, json=body)
        return _attend_result(response.json(), is_torch(queries))

    def attend_inline(
        self, q: Any, k: Any, v: Any, *, geometry: str | dict = "dot", causal: bool = False
    ) -> Operation[InlineResult]:
        """Stateless exact attention over small inline `q (heads, nq, d)`, `k (heads, nk, d)`,
        `v (heads, nk, dv)`: an `InlineResult` (`out`, `lse`)."""
        spec = {"name": geometry} if isinstance(geometry, str) else dict(geometry)
        body = {
            "geometry": spec,
            "q": encode_tensor(q),
            "k": encode_tensor(k),
            "v": encode_tensor(v),
            "causal": causal,
        }
        response = yield _Request("POST", "/v1/attend", json=body)
        found, as_torch = response.json(), is_torch(q)
        return InlineResult(
            decode_tensor(found["out"], as_torch), decode_tensor(found["lse"], as_torch)
        )


OPERATIONS = [
    name for name, value in vars(_Operations).items() if callable(value) and name[0] != "_"
]


class _Blocking(Generic[P, T]):
    """A `Client` method made from an `_Operations` generator: the same parameters and
    documentation (editors and type checkers see them, through `P`), its result `T` returned."""

    def __init__(self, operation: Callable[Concatenate[Any, P], Operation[T]]) -> None:
        def function(client: Client, *args: Any, **kwargs: Any) -> Any:
            return client._run(operation(client, *args, **kwargs))

        self.function = _as_method(function, operation)

    def __get__(self, client: Client | None, owner: type | None = None) -> Callable[P, T]:
        return self.function if client is None else types.MethodType(self.function, client)


class _Awaitable(Generic[P, T]):
    """An `AsyncClient` method made from an `_Operations` generator: the same parameters and
    documentation, its result `T` awaited."""

    def __init__(self, operation: Callable[Concatenate[Any, P], Operation[T]]) -> None:
        async def function(client: AsyncClient, *args: Any, **kwargs: Any) -> Any:
            return await client._run(operation(client, *args, **kwargs))

        self.function = _as_method(function, operation)

    def __get__(
        self, client: AsyncClient | None, owner: type | None = None
    ) -> Callable[P, Awaitable[T]]:
        return self.function if client is None else types.MethodType(self.function, client)


def _as_method(function: Callable[..., Any], operation: Callable[..., Any]) -> Callable[..., Any]:
    """`function` named and documented as `operation`, with its signature but returning what
    the operation's generator returns (`Operation[X]` -> `X`)."""
    functools.update_wrapper(function, operation)
    signature = inspect.signature(operation)
    result = str(signature.return_annotation).removeprefix("Operation[").removesuffix("]")
    function.__signature__ = signature.replace(return_annotation=result)  # type: ignore[attr-defined]
    return function


class _Base(_Operations):
    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        api_key: str | None = None,
        timeout: float = 60.0,
        retries: int = 5,
        backoff: float = 0.2,
        max_backoff: float = 10.0,
        wire: str = "safetensors",
    ) -> None:
        if retries < 0:
            raise ValueError(f"expected retries >= 0, got {retries}")
        if wire not in WIRES:
            raise ValueError(f"expected wire in {WIRES}, got {wire!r}")
        self.wire = wire
        self.url = url.rstrip("/")
        self.retries = retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout

    def _wait(self, attempt: int, response: httpx.Response | None) -> float:
        """Seconds before retry `attempt` (0-based): `Retry-After` when the server gave one."""
        if response is not None:
            try:
                return min(float(response.headers["Retry-After"]), self.max_backoff)
            except (KeyError, ValueError):
                pass
        return min(self.backoff * 2**attempt, self.max_backoff)

    def _after(
        self, request: _Request, attempt: int, outcome: httpx.Response | Exception
    ) -> httpx.Response | float:
        """After attempt `attempt` (0-based) got `outcome` (a response, or the transport error):
        the response to return, or the seconds to wait before the next attempt; raises
        `RewaError` for an error answer or a failure not worth retrying."""
        if isinstance(outcome, Exception):
            connect = isinstance(outcome, (httpx.ConnectError, httpx.ConnectTimeout))
            if connect and attempt < self.retries:  # nothing was sent: safe to retry
                return self._wait(attempt, None)
            raise RewaConnectionError(outcome) from None
        status = outcome.status_code
        if status in RETRY_STATUSES and request.retry and attempt < self.retries:
            return self._wait(attempt, outcome)
        if status < 400 or status in request.accept:
            return outcome
        raise _error(outcome)


def _error(response: httpx.Response) -> RewaError:
    try:
        body = response.json()
    except ValueError:
        body = {"error": {"type": "http", "message": response.text[:500]}}
    return RewaError(response.status_code, body)


class Client(_Base):
    """Blocking client (module docstring); use as a context manager or call `close()`."""

    def __init__(self, url: str = DEFAULT_URL, **options: Any) -> None:
        super().__init__(url, **options)
        self.http = httpx.Client(base_url=self.url, headers=self.headers, timeout=self.timeout)

    def _send(self, request: _Request) -> httpx.Response:
        for attempt in itertools.count():
            try:
                outcome = self.http.request(request.method, request.path, **request.arguments())
            except httpx.TransportError as error:
                outcome = error
            after = self._after(request, attempt, outcome)
            if isinstance(after, httpx.Response):
                return after
            time.sleep(after)
        raise AssertionError("unreachable")

    def _run(self, operation: Operation[T]) -> T:
        try:
            request = next(operation)
            while True:
                try:
                    response = self._send(request)
                except RewaError as error:
                    request = operation.throw(error)
                else:
                    request = operation.send(response)
        except StopIteration as done:
            return done.value

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # Every endpoint (`_Operations`), blocking.
    livez = _Blocking(_Operations.livez)
    ready = _Blocking(_Operations.ready)
    metrics = _Blocking(_Operations.metrics)
    create_context = _Blocking(_Operations.create_context)
    list_contexts = _Blocking(_Operations.list_contexts)
    get_context = _Blocking(_Operations.get_context)
    delete_context = _Blocking(_Operations.delete_context)
    index_state = _Blocking(_Operations.index_state)
    build_index = _Blocking(_Operations.build_index)
    set_geometry_state = _Blocking(_Operations.set_geometry_state)
    get_geometry_state = _Blocking(_Operations.get_geometry_state)
    begin_upload = _Blocking(_Operations.begin_upload)
    add_chunk = _Blocking(_Operations.add_chunk)
    get_upload = _Blocking(_Operations.get_upload)
    commit_upload = _Blocking(_Operations.commit_upload)
    abort_upload = _Blocking(_Operations.abort_upload)
    upload = _Blocking(_Operations.upload)
    attend = _Blocking(_Operations.attend)
    search = _Blocking(_Operations.search)
    self_attention = _Blocking(_Operations.self_attention)
    attend_inline = _Blocking(_Operations.attend_inline)


class AsyncClient(_Base):
    """asyncio client with the same methods as `Client`, each awaited; use as an async
    context manager or await `aclose()`."""

    def __init__(self, url: str = DEFAULT_URL, **options: Any) -> None:
        super().__init__(url, **options)
        self.http = httpx.AsyncClient(base_url=self.url, headers=self.headers, timeout=self.timeout)

    async def _send(self, request: _Request) -> httpx.Response:
        for attempt in itertools.count():
            try:
                outcome = await self.http.request(
                    request.method, request.path, **request.arguments()
                )
            except httpx.TransportError as error:
                outcome = error
            after = self._after(request, attempt, outcome)
            if isinstance(after, httpx.Response):
                return after
            await asyncio.sleep(after)
        raise AssertionError("unreachable")

    async def _run(self, operation: Operation[T]) -> T:
        try:
            request = next(operation)
            while True:
                try:
                    response = await self._send(request)
                except RewaError as error:
                    request = operation.throw(error)
                else:
                    request = operation.send(response)
        except StopIteration as done:
            return done.value

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.aclose()

    # Every endpoint (`_Operations`), awaited.
    livez = _Awaitable(_Operations.livez)
    ready = _Awaitable(_Operations.ready)
    metrics = _Awaitable(_Operations.metrics)
    create_context = _Awaitable(_Operations.create_context)
    list_contexts = _Awaitable(_Operations.list_contexts)
    get_context = _Awaitable(_Operations.get_context)
    delete_context = _Awaitable(_Operations.delete_context)
    index_state = _Awaitable(_Operations.index_state)
    build_index = _Awaitable(_Operations.build_index)
    set_geometry_state = _Awaitable(_Operations.set_geometry_state)
    get_geometry_state = _Awaitable(_Operations.get_geometry_state)
    begin_upload = _Awaitable(_Operations.begin_upload)
    add_chunk = _Awaitable(_Operations.add_chunk)
    get_upload = _Awaitable(_Operations.get_upload)
    commit_upload = _Awaitable(_Operations.commit_upload)
    abort_upload = _Awaitable(_Operations.abort_upload)
    upload = _Awaitable(_Operations.upload)
    attend = _Awaitable(_Operations.attend)
    search = _Awaitable(_Operations.search)
    self_attention = _Awaitable(_Operations.self_attention)
    attend_inline = _Awaitable(_Operations.attend_inline)
