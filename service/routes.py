"""The data routes: contexts, uploads, attend, search, self-attention and stateless attention.

Every input is checked before anything is written: a rejected request changes nothing. Store
calls run in threads (the Redis client blocks); compute goes through the batcher to the device
worker."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import logging
import time
from collections.abc import Callable, Iterator
from typing import Annotated, Any, TypeVar

import torch
from fastapi import APIRouter, Depends, Request, Response
from pydantic import BaseModel, ValidationError

from rewa.attention import GEOMETRIES, DomainError, Geometry
from rewa.index import CompositeLSH, IndexSettings
from rewa.index.retrieval import empty_index

from . import wire
from .auth import namespace_of
from .batcher import Job, Overloaded, merged_payload
from .engine import GEOMETRY_STATE, AttendParams, Engine, geometry_of, load_geometry_state
from .errors import ApiError, invalid, validation_error
from .schemas import (
    AttendOptions,
    AttendRequest,
    AttendResponse,
    ChunkBody,
    ContextCreate,
    ContextInfo,
    ContextList,
    ErrorBody,
    IndexBuildRequest,
    IndexSpec,
    IndexState,
    SearchRequest,
    SearchResponse,
    SelfAttentionRequest,
    SelfAttentionResponse,
    StatelessAttendRequest,
    StatelessAttendResponse,
    UploadInfo,
)
from .store import (
    ContextRecord,
    ContextStore,
    NotFound,
    Segment,
    StoreUnavailable,
    TooLarge,
    new_id,
    stored_heads,
)

logger = logging.getLogger(__name__)

# Operation ids are the route functions' names (the OpenAPI links below refer to them).
router = APIRouter(prefix="/v1", generate_unique_id_function=lambda route: route.name)
OCTET_STREAM = "application/octet-stream"


Namespace = Depends(namespace_of)

ERROR_DESCRIPTIONS = {
    400: "a parameter or tensor is invalid (the message names it)",
    401: "missing or unknown API key (only when REWA_API_KEYS is set)",
    404: "no such context or upload in the caller's namespace",
    408: "the request body stalled (REWA_BODY_TIMEOUT_S, REWA_BODY_IDLE_TIMEOUT_S)",
    409: "the context has no committed tokens yet",
    413: "over a size limit (REWA_MAX_BODY_BYTES, REWA_MAX_TOKENS_PER_CONTEXT, ...)",
    415: "the body is not JSON (or, for chunks, raw bytes)",
    422: "the body does not match the schema",
    429: "the device queue is full or the request could not start in time; see Retry-After",
    503: "the store is unreachable; see Retry-After",
}
STORE, BODY = (401, 503), (400, 408, 413, 415, 422)


REF = "#/components/schemas/{model}"


def _component_refs(schema: dict) -> dict:
    """A model's JSON schema whose nested models are referenced from the document's components
    (where FastAPI already put them), without a local `$defs`."""
    return {key: value for key, value in schema.items() if key != "$defs"}


def links(status: int, parameters: dict[str, str], *operations: str) -> dict[int, dict]:
    """OpenAPI links from a response's fields to the operations that take them (clients and
    stateful API testers follow them)."""
    return {
        status: {
            "links": {
                operation: {"operationId": operation, "parameters": parameters}
                for operation in operations
            }
        }
    }


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for the error statuses a route returns, each with `ErrorBody`."""
    return {
        status: {"model": ErrorBody, "description": ERROR_DESCRIPTIONS[status]}
        for status in sorted(set(statuses))
    }


# -- helpers ----------------------------------------------------------------------------------


T = TypeVar("T")


def _store_of(request: Request) -> ContextStore:
    return request.app.state.store


def _engine_of(request: Request) -> Engine:
    return request.app.state.engine


# The app's store and engine, as route parameters (FastAPI dependencies).
Store = Annotated[ContextStore, Depends(_store_of)]
Compute = Annotated[Engine, Depends(_engine_of)]


async def _stored(call: Callable[..., T], *args) -> T:
    """A store method's answer, called in a thread, its errors mapped to API errors."""
    try:
        return await asyncio.to_thread(call, *args)
    except NotFound as error:
        param = "context_id" if error.what == "context" else "upload_id"
        raise ApiError(404, str(error), param) from None
    except TooLarge as error:
        raise ApiError(413, str(error), "tokens") from None
    except StoreUnavailable as error:
        raise ApiError(503, str(error), headers={"Retry-After": "1"}) from None


async def _compute(request: Request, response: Response, job: Job, background=False) -> Any:
    """Run a job on the device worker; its queue wait and compute time go into `Server-Timing`.
    `background`: as a background job (`Batcher.background`: when no request waits, without
    admission bounds), for a request that waits for index builds by nature."""
    batcher = request.app.state.batcher
    with _compute_errors():
        result = await (batcher.background(job) if background else batcher.submit(job))
    response.headers.append(
        "Server-Timing",
        f"queue;dur={job.queue_seconds * 1000:.1f}, compute;dur={job.compute_seconds * 1000:.1f}",
    )
    return result


@contextlib.contextmanager
def _compute_errors() -> Iterator[None]:
    """A device job's or an index build's failures as the API errors they mean."""
    try:
        yield
    except Overloaded as error:
        why = (
            "the device queue is full (REWA_QUEUE_SIZE)"
            if error.reason == "queue_full"
            else "the request could not start within REWA_MAX_QUEUE_WAIT_S"
        )
        raise ApiError(
            429,
            f"{why}; retry after the seconds in Retry-After",
            headers={"Retry-After": str(error.retry_after)},
        ) from None
    except StoreUnavailable as error:
        raise ApiError(503, str(error), headers={"Retry-After": "1"}) from None
    except NotFound as error:
        raise ApiError(404, str(error), "context_id") from None
    except DomainError as error:  # the request's or the context's vectors overflow its geometry
        raise ApiError(400, str(error)) from None


def _info(record: ContextRecord) -> ContextInfo:
    return ContextInfo(**{key: value for key, value in record.items() if key != "segments"})


def _settings(request: Request):
    return request.app.state.settings


def _parse(model: type[BaseModel], raw: bytes) -> BaseModel:
    """Validate a JSON body read by hand, with the same errors as FastAPI's."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as error:
        raise validation_error(error.errors()) from None


def _check_top_k(param: str, top_k: int, n_tokens: int, max_k: int) -> None:
    if top_k > max_k:
        raise invalid(param, f"at most {max_k} (REWA_MAX_K)", top_k)
    if top_k > n_tokens:
        raise invalid(param, f"at most the context's {n_tokens} tokens", top_k)


def _queries(payload: wire.TensorPayload, record: ContextRecord, settings, param: str = "queries"):
    queries = wire.decode(payload, param, (record["heads"], None, record["head_dim"]))
    _check_queries(queries, record, settings, param)
    return queries


def _check_queries(queries: torch.Tensor, record: ContextRecord, settings, param: str = "queries"):
    """Raise unless `queries` is `(heads, n >= 1, head_dim)` within the request limit."""
    expected = (record["heads"], None, record["head_dim"])
    wire.check_shape(f"{param}.shape", tuple(queries.shape), expected)
    if queries.numel() // record["head_dim"] > settings.max_queries_per_request:
        raise ApiError(
            413,
            f"{param}: at most {settings.max_queries_per_request} heads x queries per request "
            f"(REWA_MAX_QUERIES_PER_REQUEST), got {queries.shape[0]} x {queries.shape[1]}",
            param,
        )


def _layer(layer: int | None, record: ContextRecord) -> int | None:
    """The layer a query names: required, and below `layers`, for a multi-layer context; absent
    (or 0) otherwise, which is None: the whole context."""
    layers = record.get("layers", 1)
    if layers == 1:
        if layer not in (None, 0):
            raise invalid("layer", "absent or 0 (the context has one layer)", layer)
        return None
    if layer is None or layer >= layers:
        raise invalid("layer", f"a layer in [0, {layers}) (the context has {layers})", layer)
    return layer


def _loaded(engine, namespace: str, record: ContextRecord, layer: int | None):
    """The loaded context, or the layer of it a query names (on the device worker)."""
    loaded = engine.context(namespace, record)
    return loaded if layer is None else engine.layer(loaded, layer)


def _mode(mode: str | None, exact: bool, default: str, record: ContextRecord) -> str:
    """The requested mode; without one, `default` (tail) where the context's geometry has an
    exact lift, else topk (cone attention has no cluster-tail estimate)."""
    if exact and mode not in (None, "exact"):
        raise invalid("exact", f"false when mode is {mode!r} (exact=true means mode=exact)", True)
    name = record["geometry"]["name"]
    estimable = GEOMETRIES[name].exact_lift
    if mode == "tail" and not estimable:
        raise invalid(
            "mode",
            f"exact or topk for geometry {name!r} (it has no exact lift, hence no cluster-tail "
            f"estimate)",
            mode,
        )
    if exact:
        return "exact"
    if mode is None and default == "tail" and not estimable:
        return "topk"
    return mode or default


def _params(
    body, record: ContextRecord, settings, mode: str, return_topk: int | None
) -> AttendParams:
    """The request's settings over the context's. A window of `2 n + 1` positions already covers
    all `n` keys from any query position in `[0, n]` (centred or causal), and `n` sinks are every
    key, so larger values are cut to those: the same attention, with memory bounded by the
    context instead of the request."""
    index = IndexSpec.model_validate(record["index"])
    n_tokens = record["n_tokens"]
    if body.top_k is not None:
        _check_top_k("top_k", body.top_k, n_tokens, settings.max_k)
    if return_topk is not None:
        _check_top_k("return_topk", return_topk, n_tokens, settings.max_k)
    measured_queries = body.measured_queries or 0
    if measured_queries and mode != "tail":
        raise invalid("measured_queries", f"0 in {mode} mode (tail mode only)", measured_queries)
    return AttendParams(
        mode=mode,
        top_k=body.top_k if body.top_k is not None else min(index.top_k, n_tokens),
        budget=body.budget if body.budget is not None else index.budget,
        window=min(body.window if body.window is not None else index.window, 2 * n_tokens + 1),
        sinks=min(body.sinks if body.sinks is not None else index.sinks, n_tokens),
        return_topk=return_topk,
        measured_queries=measured_queries,
    )


def attend_batch_key(
    namespace: str, context_id: str, version: int, layer: int | None, params: AttendParams
) -> tuple | None:
    """The key under which attends are merged into one call (`batcher.Job.key`): the same
    context version, layer and parameters; None (never merged) for a measured tail attend,
    whose factor is fitted over its own queries and must not depend on another client's."""
    if params.measured_queries:
        return None
    return (namespace, context_id, version, layer, params)


async def _committed(store: ContextStore, namespace: str, context_id: str) -> ContextRecord:
    record = await _stored(store.get, namespace, context_id)
    if record["n_tokens"] == 0:
        raise ApiError(
            409, f"context {context_id!r} has no committed tokens yet; upload and commit first"
        )
    return record


def check_geometry(spec: dict, head_dim: int, param: str = "geometry") -> Geometry:
    """The geometry of a request's spec; any failure to build it, or options under which it
    maps ordinary vectors to non-finite witnesses, logits or lifts (a temperature of 1e-300, a
    cone radius of 1e9), is a 400 naming the field. Such options once passed creation and
    failed later, in the index build (a FAISS exception ended the process)."""
    try:
        geometry = geometry_of(spec, head_dim)
        problem = _probe(json.dumps(spec, sort_keys=True), head_dim)
    except Exception as error:  # any failure on client-chosen options is the client's 400
        raise ApiError(400, f"{param}: {error}", param) from None
    if problem:
        raise ApiError(400, f"{param}: these options give {problem}", param)
    return geometry


PROBE_SCALES = (0.0, 0.1, 1.0, 10.0)


@functools.lru_cache(maxsize=256)
def _probe(spec: str, head_dim: int) -> str | None:
    """`probe_geometry` of a spec's (JSON) geometry. It takes milliseconds, so results are kept
    per spec: a client sending stateless requests with one geometry pays once."""
    return probe_geometry(geometry_of(json.loads(spec), head_dim), head_dim)


def probe_geometry(geometry: Geometry, head_dim: int) -> str | None:
    """What goes wrong when `geometry` scores and lifts random vectors of norms 0 to ~30 (None:
    nothing)."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for scale in PROBE_SCALES:
            x = torch.randn(1, 8, head_dim, generator=generator) * scale
            norm = f"input norm ~{scale * head_dim**0.5:.3g}"
            witnesses = geometry.witness(x)
            if not bool(torch.isfinite(witnesses).all()):
                return f"non-finite witnesses at {norm}"
            if not bool(torch.isfinite(geometry.score(witnesses, witnesses)).all()):
                return f"non-finite logits at {norm}"
            if geometry.exact_lift:
                roles = ("query", "key")
                coordinates = [lift.vectors for r in roles for lift in geometry.lift(witnesses, r)]
            else:
                coordinates = [geometry.band_coordinate(witnesses)]
            if any(t is not None and not bool(torch.isfinite(t).all()) for t in coordinates):
                return f"non-finite index coordinates at {norm}"
    return None


def check_value_dim(geometry: Geometry, value_dim: int, param: str) -> None:
    """A 400 where the geometry maps outputs and needs a particular value dim (graded values:
    value_dim = head_dim)."""
    try:
        geometry.output_map(torch.zeros(1, value_dim))
    except ValueError as error:
        raise ApiError(400, f"{param}: {error}", param) from None


def _check_index_kind(geometry: Geometry, kind: str) -> None:
    if kind == "lsh" and not geometry.exact_lift:
        raise invalid(
            "index.kind",
            f"flat, ivf or hnsw for {type(geometry).__name__} (no exact lift to hash; FAISS "
            f"indexes search height bands)",
            kind,
        )


def _check_index_options(geometry: Geometry, kind: str, options: dict) -> None:
    """Option names, then values, with the code that will build the index (`empty_index`)."""
    accepted = (
        set(inspect.signature(CompositeLSH.__init__).parameters) - {"self", "geometry"}
        if kind == "lsh"
        else set(IndexSettings.__dataclass_fields__) - {"kind"}
    )
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise invalid("index.options", f"a subset of {sorted(accepted)} for {kind!r}", unknown)
    try:
        empty_index(geometry, kind, options)
    except (TypeError, ValueError) as error:
        raise ApiError(400, f"index.options: {error}", "index.options") from None


# -- contexts ---------------------------------------------------------------------------------


@router.post(
    "/contexts",
    status_code=201,
    response_model=ContextInfo,
    tags=["contexts"],
    responses={
        **errors(*STORE, *BODY),
        **links(
            201,
            {"context_id": "$response.body#/id"},
            "get_context",
            "delete_context",
            "begin_upload",
            "attend",
            "search",
            "self_attention",
            "get_index_state",
            "build_index",
        ),
    },
)
async def create_context(body: ContextCreate, store: Store, namespace: str = Namespace):
    """Create an empty context (no tokens, version 0)."""
    geometry = check_geometry(body.geometry.model_dump(), body.head_dim)
    check_value_dim(geometry, body.value_dim or body.head_dim, "value_dim")
    _check_index_kind(geometry, body.index.kind)
    _check_index_options(geometry, body.index.kind, body.index.options)
    info = {
        "id": new_id(),
        "name": body.name,
        "geometry": body.geometry.model_dump(),
        "heads": body.heads,
        "layers": body.layers,
        "head_dim": body.head_dim,
        "value_dim": body.value_dim or body.head_dim,
        "dtype": body.dtype,
        "index": body.index.model_dump(),
    }
    return _info(await _stored(store.create, namespace, info))


@router.get("/contexts", response_model=ContextList, tags=["contexts"], responses=errors(*STORE))
async def list_contexts(store: Store, namespace: str = Namespace):
    records = await _stored(store.list, namespace)
    return ContextList(contexts=[_info(record) for record in records])


@router.get(
    "/contexts/{context_id}",
    response_model=ContextInfo,
    tags=["contexts"],
    responses=errors(*STORE, 404),
)
async def get_context(context_id: str, store: Store, namespace: str = Namespace):
    return _info(await _stored(store.get, namespace, context_id))


@router.delete("/contexts/{context_id}", tags=["contexts"], responses=errors(*STORE, 404))
async def delete_context(
    context_id: str, store: Store, engine: Compute, namespace: str = Namespace
):
    await _stored(store.delete, namespace, context_id)
    engine.forget(namespace, context_id)
    return {"deleted": context_id}


GEOMETRY_STATE_BODY = {
    "requestBody": {
        "required": True,
        # One media type declared (schemathesis cannot generate application/x-safetensors
        # bodies, and filtering them failed its health check); both are accepted.
        "content": {OCTET_STREAM: {"schema": {"type": "string", "format": "binary"}}},
        "description": "the geometry's state_dict (float tensors) as a safetensors file, e.g. "
        f"of a trained GeometricAttention's geometry; Content-Type {OCTET_STREAM} or "
        f"{wire.SAFETENSORS}",
    }
}


@router.put(
    "/contexts/{context_id}/geometry-state",
    tags=["contexts"],
    responses=errors(*STORE, *BODY, 404, 409, 415),
    openapi_extra=GEOMETRY_STATE_BODY,
)
async def put_geometry_state(
    context_id: str, request: Request, store: Store, engine: Compute, namespace: str = Namespace
):
    """Give the context's geometry trained parameters (a safetensors state dict of a geometry
    of the context's spec), so that the service computes what the trained module computes in
    process. Only before the first commit: the indexes of committed tokens depend on it."""
    record = await _stored(store.get, namespace, context_id)
    if record["n_tokens"] > 0:
        raise ApiError(
            409,
            f"context {context_id!r} has committed tokens; its geometry state can be set only "
            "before the first commit",
        )
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type not in (wire.SAFETENSORS, OCTET_STREAM):
        raise ApiError(
            415,
            f"Content-Type: expected {wire.SAFETENSORS} or {OCTET_STREAM}, got "
            f"{content_type or 'nothing'}",
            "Content-Type",
        )
    raw = await request.body()
    tensors, _ = wire.read_safetensors(raw)
    try:
        geometry = load_geometry_state(geometry_of(record["geometry"], record["head_dim"]), tensors)
    except ValueError as error:
        raise invalid("body", "the state_dict of the context's geometry", str(error)) from None
    problem = probe_geometry(geometry, record["head_dim"])
    if problem:
        raise ApiError(400, f"body: this state gives {problem}", "body")
    await _stored(store.put_blob, namespace, context_id, GEOMETRY_STATE, raw)
    engine.forget(namespace, context_id)
    return {"context_id": context_id, "entries": sorted(tensors)}


@router.get(
    "/contexts/{context_id}/geometry-state",
    tags=["contexts"],
    responses={
        200: {"content": {wire.SAFETENSORS: {"schema": {"type": "string", "format": "binary"}}}},
        204: {"description": "no state: the geometry is the spec's, built from the fixed seed"},
        **errors(*STORE, 404),
    },
)
async def get_geometry_state(context_id: str, store: Store, namespace: str = Namespace):
    """The context's geometry state as set (safetensors); 204 when it has none."""
    await _stored(store.get, namespace, context_id)
    blob = await _stored(store.get_blob, namespace, context_id, GEOMETRY_STATE)
    if blob is None:
        return Response(status_code=204)
    return Response(blob, media_type=wire.SAFETENSORS)


# -- uploads ----------------------------------------------------------------------------------


def _upload_info(context_id: str, upload_id: str, chunks: list[Segment]) -> UploadInfo:
    return UploadInfo(
        upload_id=upload_id,
        context_id=context_id,
        chunks=len(chunks),
        n_tokens=sum(chunk["tokens"] for chunk in chunks),
    )


@router.post(
    "/contexts/{context_id}/uploads",
    status_code=201,
    response_model=UploadInfo,
    tags=["uploads"],
    responses={
        **errors(*STORE, 404),
        **links(
            201,
            {"context_id": "$response.body#/context_id", "upload_id": "$response.body#/upload_id"},
            "get_upload",
            "add_chunk",
            "commit_upload",
            "abort_upload",
        ),
    },
)
async def begin_upload(context_id: str, store: Store, namespace: str = Namespace):
    """Open an upload: chunks appended to it become visible together, at commit."""
    upload_id = await _stored(store.begin_upload, namespace, context_id)
    return _upload_info(context_id, upload_id, [])


@router.get(
    "/contexts/{context_id}/uploads/{upload_id}",
    response_model=UploadInfo,
    tags=["uploads"],
    responses=errors(*STORE, 404),
)
async def get_upload(context_id: str, upload_id: str, store: Store, namespace=Namespace):
    chunks = await _stored(store.upload, namespace, context_id, upload_id)
    return _upload_info(context_id, upload_id, chunks)


@router.post(
    "/contexts/{context_id}/uploads/{upload_id}/chunks",
    response_model=UploadInfo,
    tags=["uploads"],
    responses=errors(*STORE, *BODY, 404),
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {
                    "schema": _component_refs(ChunkBody.model_json_schema(ref_template=REF))
                },
                OCTET_STREAM: {"schema": {"type": "string", "format": "binary"}},
            },
            "description": "JSON keys and values, or raw bytes: keys (heads, tokens, head_dim) "
            "then values (heads, tokens, value_dim), in the context's dtype, with ?tokens=n; "
            "a multi-layer context's heads are layers x heads, layer 0's first",
        }
    },
)
async def add_chunk(
    context_id: str,
    upload_id: str,
    request: Request,
    store: Store,
    tokens: int | None = None,
    namespace: str = Namespace,
):
    """Append keys and values for the next tokens to an open upload."""
    record = await _stored(store.get, namespace, context_id)
    chunks = await _stored(store.upload, namespace, context_id, upload_id)
    heads, d, dv = stored_heads(record), record["head_dim"], record["value_dim"]
    dtype = record["dtype"]
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    raw = await request.body()
    if content_type == OCTET_STREAM:
        if tokens is None or tokens < 1:
            raise invalid("tokens", "a query parameter tokens >= 1 with a raw body", tokens)
        itemsize = wire.FLOAT_DTYPES[dtype].itemsize
        split = heads * tokens * d * itemsize
        keys = wire.from_bytes(raw[:split], dtype, (heads, tokens, d), "body (keys)")
        values = wire.from_bytes(raw[split:], dtype, (heads, tokens, dv), "body (values)")
        n = tokens
    elif content_type == "application/json":
        body = _parse(ChunkBody, raw)
        keys = wire.decode(body.keys, "keys", (heads, None, d), (dtype,))
        n = keys.shape[1]
        values = wire.decode(body.values, "values", (heads, n, dv), (dtype,))
    else:
        raise ApiError(
            415,
            f"Content-Type: expected application/json or {OCTET_STREAM}, got "
            f"{content_type or 'nothing'}",
            "Content-Type",
        )
    pending = sum(chunk["tokens"] for chunk in chunks)
    limit = _settings(request).max_tokens_per_context
    if record["n_tokens"] + pending + n > limit:
        raise ApiError(
            413,
            f"tokens: the context would hold {record['n_tokens'] + pending + n} tokens; at most "
            f"{limit} (REWA_MAX_TOKENS_PER_CONTEXT)",
            "tokens",
        )
    data = keys.contiguous().view(torch.uint8).numpy().tobytes()
    data += values.contiguous().view(torch.uint8).numpy().tobytes()
    chunks = await _stored(store.add_chunk, namespace, context_id, upload_id, data, n)
    return _upload_info(context_id, upload_id, chunks)


@router.post(
    "/contexts/{context_id}/uploads/{upload_id}/commit",
    response_model=ContextInfo,
    tags=["uploads"],
    responses=errors(*STORE, 404, 413),
)
async def commit_upload(
    context_id: str, upload_id: str, request: Request, store: Store, namespace=Namespace
):
    """Append the upload's tokens to the context atomically (version + 1). With
    `REWA_BUILD_ON_COMMIT` the new version is loaded and its default mode's index built (or
    extended from the previous version's) in the background, on the build thread; an attend
    that comes first is answered all the same (docs/indexes.md, "Builds in the background")."""
    limit = _settings(request).max_tokens_per_context
    record = await _stored(store.commit, namespace, context_id, upload_id, limit)
    if _settings(request).build_on_commit:
        _in_background(request.app, _build(request.app, namespace, record, _default_modes(record)))
    return _info(record)


def _default_modes(record: ContextRecord) -> list[str]:
    """The mode an attend without one uses (tail, or topk for a geometry without a lift)."""
    return [_mode(None, False, "tail", record)]


def _in_background(app, coroutine) -> None:
    """Run a coroutine as a task the app keeps a reference to until it ends."""
    tasks = app.state.background_tasks
    task = asyncio.get_running_loop().create_task(coroutine)
    tasks.add(task)
    task.add_done_callback(tasks.discard)


def _build_job(
    engine, namespace: str, record: ContextRecord, modes: list[str], replaceable: bool = True
) -> Job:
    """A device job that loads the record's version and starts the builds of the modes'
    indexes on the engine's build thread; its result is their futures. A `replaceable` one is
    dropped, while it waits, for a later commit's build of the same context."""

    def run(_):
        return engine.start_builds(engine.context(namespace, record), modes)

    replaces = (namespace, record["id"]) if replaceable else None
    return Job(key=None, payload=None, size=1, run=run, replaces=replaces)


async def _await_builds(builds: list) -> None:
    """Wait, off the event loop's thread, for the builds `_build_job` started."""
    await asyncio.gather(*(asyncio.wrap_future(build) for build in builds))


async def _build(app, namespace: str, record: ContextRecord, modes: list[str]) -> float | None:
    """`_build_job` when no request is waiting (`Batcher.background`), then its builds: the
    seconds they took, None if a later commit's build replaced it or it failed."""
    start = time.perf_counter()
    try:
        builds = await app.state.batcher.background(
            _build_job(app.state.engine, namespace, record, modes)
        )
        if builds is None:
            return None
        await _await_builds(builds)
        return time.perf_counter() - start
    except Exception:  # a store or device failure: the first attend reports it instead
        logger.exception("background index build of %s v%s failed", record["id"], record["version"])
        return None


@router.get(
    "/contexts/{context_id}/index",
    response_model=IndexState,
    tags=["contexts"],
    responses=errors(*STORE, 404),
)
async def get_index_state(
    context_id: str, store: Store, engine: Compute, namespace: str = Namespace
):
    """What this replica holds of the context's latest version (loaded, indexes built)."""
    record = await _stored(store.get, namespace, context_id)
    state = engine.index_state(namespace, record)
    audit = await _stored(engine.audit_report, namespace, record)  # reads the settled heads
    return IndexState(context_id=context_id, version=record["version"], audit=audit, **state)


@router.post(
    "/contexts/{context_id}/index",
    response_model=IndexState,
    tags=["contexts"],
    responses=errors(*STORE, *BODY, 404, 409),
)
async def build_index(
    context_id: str,
    request: Request,
    response: Response,
    store: Store,
    engine: Compute,
    body: IndexBuildRequest | None = None,
    namespace: str = Namespace,
):
    """Load the latest version and build the modes' indexes now, answering when they are
    built (a client waits for them so that its first attend does not pay the build). It runs
    as a background job: after the commit's own build when that one has started (then it only
    finds the indexes built), and never refused for waiting, however long that build takes."""
    record = await _committed(store, namespace, context_id)
    modes = (body.modes if body and body.modes else None) or _default_modes(record)
    for mode in modes:
        _mode(mode, False, "tail", record)  # tail for a geometry without a lift: 400
    job = _build_job(engine, namespace, record, sorted(set(modes)), replaceable=False)
    start = time.perf_counter()
    builds = await _compute(request, response, job, background=True)
    with _compute_errors():
        await _await_builds(builds)
    seconds = time.perf_counter() - start
    state = engine.index_state(namespace, record)
    audit = await _stored(engine.audit_report, namespace, record)  # reads the settled heads
    return IndexState(
        context_id=context_id, version=record["version"], seconds=seconds, audit=audit, **state
    )


@router.delete(
    "/contexts/{context_id}/uploads/{upload_id}",
    tags=["uploads"],
    responses=errors(*STORE, 404),
)
async def abort_upload(context_id: str, upload_id: str, store: Store, namespace=Namespace):
    await _stored(store.abort, namespace, context_id, upload_id)
    return {"aborted": upload_id}


# -- queries ----------------------------------------------------------------------------------


def _binary_body(description: str) -> dict:
    """The OpenAPI request body of a route that takes JSON or a safetensors body."""
    return {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {
                    "schema": _component_refs(AttendRequest.model_json_schema(ref_template=REF))
                },
                wire.SAFETENSORS: {"schema": {"type": "string", "format": "binary"}},
            },
            "description": description,
        }
    }


async def _attend_body(request: Request, record: ContextRecord, settings):
    """`(options, queries)` of an attend body: JSON (`AttendRequest`), or safetensors (a
    `queries` tensor and the other fields as JSON in the metadata entry `options`)."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    raw = await request.body()
    if content_type == "application/json":
        body = _parse(AttendRequest, raw)
        return body, _queries(body.queries, record, settings)
    if content_type == wire.SAFETENSORS:
        tensors, metadata = wire.read_safetensors(raw)
        if set(tensors) != {"queries"}:
            raise invalid("body", "one tensor, named queries", sorted(tensors))
        options = _parse(AttendOptions, metadata.get("options", "{}").encode())
        queries = tensors["queries"].to(torch.float32)
        _check_queries(queries, record, settings)
        return options, queries
    raise ApiError(
        415,
        f"Content-Type: expected application/json or {wire.SAFETENSORS}, got "
        f"{content_type or 'nothing'}",
        "Content-Type",
    )


def _wants_safetensors(request: Request) -> bool:
    return wire.SAFETENSORS in request.headers.get("accept", "").lower()


@router.post(
    "/contexts/{context_id}/attend",
    response_model=AttendResponse,
    tags=["attention"],
    responses={
        200: {"content": {wire.SAFETENSORS: {"schema": {"type": "string", "format": "binary"}}}},
        **errors(*STORE, *BODY, 404, 409, 415, 429),
    },
    openapi_extra=_binary_body(
        f"JSON, or {wire.SAFETENSORS}: a tensor queries (heads, n, head_dim), float32, float16 "
        f"or bfloat16, and the other fields as a JSON object in the metadata entry options. "
        f"With Accept: {wire.SAFETENSORS} the answer is safetensors too (out, lse, and with "
        f"return_topk ids and weights; mode and version in X-Rewa-Mode and X-Rewa-Version)."
    ),
)
async def attend(
    context_id: str,
    request: Request,
    response: Response,
    store: Store,
    engine: Compute,
    namespace: str = Namespace,
):
    """Attention of queries `(heads, n, head_dim)` over the stored context: `out` `(heads, n,
    value_dim)` and `lse` `(heads, n)`; `mode` exact (dense), topk (sparse over the index's
    top K) or tail (sparse plus the cluster-tail estimate; the default)."""
    settings = _settings(request)
    record = await _committed(store, namespace, context_id)
    body, queries = await _attend_body(request, record, settings)
    layer = _layer(body.layer, record)
    mode = _mode(body.mode, body.exact, "tail", record)
    params = _params(body, record, settings, mode, body.return_topk)

    def run(batch: list[Job]):
        loaded = _loaded(engine, namespace, record, layer)
        return engine.attend(loaded, merged_payload(batch), params)

    key = attend_batch_key(namespace, context_id, record["version"], layer, params)
    result = await _compute(
        request,
        response,
        Job(key=key, payload=queries, size=queries.shape[0] * queries.shape[1], run=run),
    )
    if _wants_safetensors(request):
        headers = {
            "X-Rewa-Mode": mode,
            "X-Rewa-Version": str(record["version"]),
            "Server-Timing": response.headers["Server-Timing"],
        }
        content = wire.write_safetensors(result, {"mode": mode})
        return Response(content, media_type=wire.SAFETENSORS, headers=headers)
    return AttendResponse(
        out=wire.encode(result["out"]),
        lse=wire.encode(result["lse"]),
        mode=mode,
        version=record["version"],
        ids=wire.encode(result["ids"]) if "ids" in result else None,
        weights=wire.encode(result["weights"]) if "weights" in result else None,
    )


@router.post(
    "/contexts/{context_id}/search",
    response_model=SearchResponse,
    tags=["attention"],
    responses=errors(*STORE, *BODY, 404, 409, 429),
)
async def search(
    context_id: str,
    body: SearchRequest,
    request: Request,
    response: Response,
    store: Store,
    engine: Compute,
    namespace: str = Namespace,
):
    """Each query's top K keys: ids, logits and (distance geometries) distances."""
    settings = _settings(request)
    record = await _committed(store, namespace, context_id)
    queries = _queries(body.queries, record, settings)
    layer = _layer(body.layer, record)
    _check_top_k("top_k", body.top_k, record["n_tokens"], settings.max_k)

    def run(_):
        loaded = _loaded(engine, namespace, record, layer)
        return engine.search(loaded, queries, body.top_k, body.exact)

    result = await _compute(
        request, response, Job(key=None, payload=None, size=queries.numel(), run=run)
    )
    return SearchResponse(
        ids=wire.encode(result["ids"]),
        scores=wire.encode(result["scores"]),
        distances=wire.encode(result["distances"]) if "distances" in result else None,
        version=record["version"],
    )


@router.post(
    "/contexts/{context_id}/self-attention",
    response_model=SelfAttentionResponse,
    tags=["attention"],
    responses=errors(*STORE, *BODY, 404, 409, 429),
)
async def self_attention(
    context_id: str,
    body: SelfAttentionRequest,
    request: Request,
    response: Response,
    store: Store,
    engine: Compute,
    namespace: str = Namespace,
):
    """Rows `[start, end)` of the stored context attend over it (long-document encoding);
    `causal`: row i sees keys up to i."""
    settings = _settings(request)
    record = await _committed(store, namespace, context_id)
    n_tokens = record["n_tokens"]
    if body.queries is not None:
        if body.end is not None:
            raise invalid("end", "no end with queries (their count sets it)", body.end)
        queries = _queries(body.queries, record, settings)
        end = body.start + queries.shape[1]
    else:
        queries = None
        end = body.end if body.end is not None else n_tokens
    if not body.start < end <= n_tokens:
        raise invalid("end", f"start < end <= {n_tokens} (the context's tokens)", end)
    if end - body.start > settings.max_self_attention_rows:
        raise ApiError(
            413,
            f"end: at most {settings.max_self_attention_rows} rows per request "
            f"(REWA_MAX_SELF_ATTENTION_ROWS); page with start and end, got {end - body.start}",
            "end",
        )
    layer = _layer(body.layer, record)
    mode = _mode(body.mode, body.exact, "topk" if body.causal else "tail", record)
    params = _params(body, record, settings, mode, None)
    start = body.start

    def run(_):
        loaded = _loaded(engine, namespace, record, layer)
        rows = loaded.keys[:, start:end] if queries is None else queries
        positions = torch.arange(start, end, device=loaded.keys.device)
        return engine.attend(loaded, rows, params, positions=positions, causal=body.causal)

    result = await _compute(
        request, response, Job(key=None, payload=None, size=end - start, run=run)
    )
    return SelfAttentionResponse(
        out=wire.encode(result["out"]),
        lse=wire.encode(result["lse"]),
        mode=mode,
        version=record["version"],
        start=start,
        end=end,
    )


@router.post(
    "/attend",
    response_model=StatelessAttendResponse,
    tags=["attention"],
    responses=errors(401, *BODY, 429),
)
async def stateless_attend(
    body: StatelessAttendRequest,
    request: Request,
    response: Response,
    engine: Compute,
    _=Namespace,
):
    """Exact attention over small inline q `(heads, nq, d)`, k `(heads, nk, d)`, v `(heads, nk,
    dv)`; nothing is stored."""
    settings = _settings(request)
    q = wire.decode(body.q, "q", (None, None, None))
    heads, _, d = q.shape
    k = wire.decode(body.k, "k", (heads, None, d))
    v = wire.decode(body.v, "v", (heads, k.shape[1], None))
    if k.shape[1] > settings.max_stateless_tokens:
        raise ApiError(
            413,
            f"k: at most {settings.max_stateless_tokens} keys in a stateless request "
            f"(REWA_MAX_STATELESS_TOKENS); store a context instead, got {k.shape[1]}",
            "k",
        )
    if q.numel() // d > settings.max_queries_per_request:
        raise ApiError(413, f"q: at most {settings.max_queries_per_request} heads x queries", "q")
    geometry = check_geometry(body.geometry.model_dump(), d)
    check_value_dim(geometry, v.shape[-1], "v")

    def run(_):
        return engine.stateless(geometry, q, k, v, body.causal)

    result = await _compute(
        request, response, Job(key=None, payload=None, size=q.numel() // d, run=run)
    )
    return StatelessAttendResponse(out=wire.encode(result["out"]), lse=wire.encode(result["lse"]))
