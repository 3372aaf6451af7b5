"""The FastAPI application: `create_app(settings)` wires the store, the engine, the batcher
and the metrics, and installs the probes, the error handlers and the body-size limit. The data
routes live in `routes.py`."""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers, MutableHeaders

from .auth import Authentication, namespaces_for
from .batcher import Batcher
from .embedded_store import EmbeddedStore
from .engine import Engine, resolve_device
from .errors import ApiError, error_response, install_error_handlers, logger
from .metrics import Metrics
from .redis_store import RedisStore
from .routes import router
from .schemas import ErrorBody
from .settings import Settings
from .store import ContextStore, StoreUnavailable
from .wire import SAFETENSORS


def make_store(settings: Settings) -> ContextStore:
    if settings.redis_url:
        return RedisStore(
            settings.redis_url,
            prefix=settings.redis_prefix,
            cluster=settings.redis_cluster,
            piece_bytes=settings.redis_piece_bytes,
            upload_ttl_s=settings.upload_ttl_s,
        )
    return EmbeddedStore(settings.data_dir)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    metrics = Metrics()
    store = make_store(settings)
    device = resolve_device(settings.device)
    engine = Engine(
        store,
        device=device,
        cache_bytes=settings.cache_bytes,
        store_indexes=settings.store_indexes,
        sparse_threads=settings.sparse_threads,
        open_segment=settings.open_segment,
        exact_while_building=settings.exact_while_building,
        probed_pieces=settings.probed_pieces,
        audit_every=settings.audit_every,
        audit_window=settings.audit_window,
        audit_target=settings.audit_target,
        metrics=metrics,
    )
    batcher = Batcher(
        batching=settings.batching,
        max_queries=settings.batch_max_queries,
        max_wait_ms=settings.batch_max_wait_ms,
        queue_size=settings.queue_size,
        max_queue_wait_s=settings.max_queue_wait_s,
        metrics=metrics,
    )

    @asynccontextmanager
    async def lifespan(running: FastAPI):
        await batcher.start()
        yield
        # Background index builds still queued are dropped: a later attend builds instead.
        for task in list(running.state.background_tasks):
            task.cancel()
        await batcher.stop()
        engine.close()

    # /docs and /redoc with their scripts served by the service itself (no CDN: it works offline).
    app = FastAPIOffline(
        title="rewa",
        summary="Long-context sparse retrieval attention over geometric witness spaces",
        version="0.2.0",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.store = store
    app.state.engine = engine
    app.state.batcher = batcher
    app.state.metrics = metrics
    app.state.background_tasks = set()
    namespaces = namespaces_for(settings.api_key_list())
    install_error_handlers(app)
    app.include_router(router)
    _install_probes(app, store, engine, metrics)
    _document_only_real_errors(app, authenticated=bool(namespaces))
    # The last added runs first: authentication, body guard, content type, metrics, then
    # unexpected errors right around the routes.
    app.add_middleware(UnexpectedErrors)
    app.add_middleware(RequestMetrics, metrics=metrics)
    app.add_middleware(ContentTypeCheck)
    app.add_middleware(
        BodyGuard,
        limit=settings.max_body_bytes,
        timeout=settings.body_timeout_s,
        idle_timeout=settings.body_idle_timeout_s,
    )
    app.add_middleware(Authentication, keys=namespaces)
    return app


def _document_only_real_errors(app: FastAPI, authenticated: bool) -> None:
    """FastAPI lists a 422 with its own `HTTPValidationError` schema under every route with a
    parameter, even where no 422 can happen and although the service answers 422 in its own
    error shape. The routes declare their real errors (`routes.errors`); those default entries
    are removed from the OpenAPI document. Without API keys (an open service) the Bearer scheme
    and the 401s are removed too."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            document = generate()
            for operations in document["paths"].values():
                for operation in operations.values():
                    response = operation.get("responses", {}).get("422", {})
                    schema = response.get("content", {}).get("application/json", {}).get("schema")
                    if schema == {"$ref": "#/components/schemas/HTTPValidationError"}:
                        del operation["responses"]["422"]
                    if not authenticated:
                        operation.pop("security", None)
                        operation.get("responses", {}).pop("401", None)
            schemas = document.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            if not authenticated:
                document.get("components", {}).pop("securitySchemes", None)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi


def _install_probes(app: FastAPI, store: ContextStore, engine: Engine, metrics: Metrics):
    @app.get("/livez", tags=["probes"])
    async def livez() -> dict:
        """The process is up."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["probes"], responses={503: {"model": ErrorBody}})
    async def readyz() -> JSONResponse:
        """The store is reachable and the device usable."""
        try:
            await asyncio.to_thread(store.ping)
        except StoreUnavailable as error:
            return error_response(ApiError(503, str(error)))
        return JSONResponse({"status": "ready", "device": str(engine.device)})

    @app.get(
        "/metrics",
        tags=["probes"],
        response_class=Response,
        responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}},
    )
    async def prometheus() -> Response:
        """Prometheus metrics."""
        metrics.cached_bytes.set(engine.cached_bytes())
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)


class RequestMetrics:
    """Request counts and latency per route and status, and a `Server-Timing` header. A pure
    ASGI middleware: Starlette's `BaseHTTPMiddleware` (`@app.middleware`) runs every request
    through an extra task group and a streamed response, which cost more server CPU per
    decode-sized request than the attention itself."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = 500

        async def timed_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                elapsed_ms = (time.perf_counter() - start) * 1000
                MutableHeaders(scope=message).append("Server-Timing", f"total;dur={elapsed_ms:.1f}")
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        finally:
            path = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.requests.labels(path, str(status)).inc()
            self.metrics.latency.labels(path).observe(time.perf_counter() - start)


class ContentTypeCheck:
    """415 for a request body that is not JSON (or, for upload chunks, raw bytes; for attend,
    safetensors; for a geometry state, safetensors, also as raw bytes)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] in ("POST", "PUT", "PATCH"):
            headers = Headers(scope=scope)
            has_body = headers.get("content-length", "0") != "0" or "transfer-encoding" in headers
            content_type = headers.get("content-type", "").split(";")[0].strip().lower()
            accepted = ["application/json"]
            if scope["path"].endswith("/chunks"):
                accepted.append("application/octet-stream")
            elif scope["path"].endswith("/attend") and scope["path"] != "/v1/attend":
                accepted.append(SAFETENSORS)
            elif scope["path"].endswith("/geometry-state"):
                accepted = [SAFETENSORS, "application/octet-stream"]
            if has_body and content_type not in accepted:
                error = ApiError(
                    415,
                    f"Content-Type: expected {' or '.join(accepted)}, got "
                    f"{content_type or 'nothing'}",
                    "Content-Type",
                )
                return await error_response(error)(scope, receive, send)
        return await self.app(scope, receive, send)


class BodyGuard:
    """Reads the whole request body before the routes see it, bounded in size and time: 413 for
    a body over `limit` bytes (at once from Content-Length, or while reading a body sent
    without one), 408 for a body that stalls `idle_timeout` seconds or is not complete within
    `timeout` seconds (slow senders cannot hold a request open). The routes then read the
    buffered body."""

    def __init__(self, app, limit: int, timeout: float, idle_timeout: float) -> None:
        self.app = app
        self.limit = limit
        self.timeout = timeout
        self.idle_timeout = idle_timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = ApiError(
            413, f"the request body exceeds {self.limit} bytes (REWA_MAX_BODY_BYTES)", "body"
        )
        headers = Headers(scope=scope)
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await error_response(too_large)(scope, receive, send)
        if length in (None, "0") and "transfer-encoding" not in headers:
            return await self.app(scope, receive, send)
        messages, total = [], 0
        deadline = time.monotonic() + self.timeout
        while True:
            wait = min(self.idle_timeout, deadline - time.monotonic())
            try:
                message = await asyncio.wait_for(receive(), max(wait, 0))
            except TimeoutError:
                stalled = ApiError(
                    408,
                    f"the request body did not arrive in time (REWA_BODY_TIMEOUT_S "
                    f"{self.timeout:g} s, REWA_BODY_IDLE_TIMEOUT_S {self.idle_timeout:g} s)",
                    "body",
                    headers={"Connection": "close"},
                )
                return await error_response(stalled)(scope, receive, send)
            messages.append(message)
            if message["type"] != "http.request":
                break
            total += len(message.get("body", b""))
            if total > self.limit:
                return await error_response(too_large)(scope, receive, send)
            if not message.get("more_body", False):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        return await self.app(scope, replay, send)


class UnexpectedErrors:
    """A 500 in the one error shape for an exception no handler knows (a bug). Unlike an
    `exception_handler(Exception)`, which Starlette runs in its outermost middleware and then
    re-raises so that the server drops the connection, this answers and returns: the client's
    keep-alive connection survives."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except Exception as error:
            logger.exception("unhandled error")
            if started:  # too late for a clean answer: let the server close the connection
                raise
            failure = ApiError(500, f"internal error: {type(error).__name__}")
            await error_response(failure)(scope, receive, send)
