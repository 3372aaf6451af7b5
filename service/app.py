"""The FastAPI application: `create_app(settings)` wires the store, the engine, the batcher
and the metrics, and installs the probes, the error handlers and the body-size limit. The data
routes live in `routes.py`."""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers, MutableHeaders

from .auth import namespaces_for
from .batcher import Batcher
from .embedded_store import EmbeddedStore
from .engine import Engine, resolve_device
from .errors import ApiError, error_response, install_error_handlers
from .metrics import Metrics
from .redis_store import RedisStore
from .routes import router
from .settings import Settings
from .store import ContextStore, StoreUnavailable


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
        metrics=metrics,
    )
    batcher = Batcher(
        batching=settings.batching,
        max_queries=settings.batch_max_queries,
        max_wait_ms=settings.batch_max_wait_ms,
        queue_size=settings.queue_size,
        metrics=metrics,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await batcher.start()
        yield
        await batcher.stop()

    app = FastAPI(
        title="rewa",
        summary="Long-context sparse retrieval attention over geometric witness spaces",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.store = store
    app.state.engine = engine
    app.state.batcher = batcher
    app.state.metrics = metrics
    app.state.namespaces = namespaces_for(settings.api_key_list())
    install_error_handlers(app)
    app.include_router(router)
    _install_probes(app, store, engine, metrics)
    # The last added runs first: body limit, content type, then metrics around the routes.
    app.add_middleware(RequestMetrics, metrics=metrics)
    app.add_middleware(ContentTypeCheck)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    return app


def _install_probes(app: FastAPI, store: ContextStore, engine: Engine, metrics: Metrics):
    @app.get("/livez", tags=["probes"])
    async def livez() -> dict:
        """The process is up."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["probes"])
    async def readyz() -> JSONResponse:
        """The store is reachable and the device usable."""
        try:
            await asyncio.to_thread(store.ping)
        except StoreUnavailable as error:
            return error_response(ApiError(503, str(error)))
        return JSONResponse({"status": "ready", "device": str(engine.device)})

    @app.get("/metrics", tags=["probes"])
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
    """415 for a request body that is not JSON (or, for upload chunks, raw bytes)."""

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
            if has_body and content_type not in accepted:
                error = ApiError(
                    415,
                    f"Content-Type: expected {' or '.join(accepted)}, got "
                    f"{content_type or 'nothing'}",
                    "Content-Type",
                )
                return await error_response(error)(scope, receive, send)
        return await self.app(scope, receive, send)


class BodyLimit:
    """413 for request bodies over `limit` bytes: at once from Content-Length, or while
    reading a body sent without one (it is buffered up to the limit)."""

    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = ApiError(
            413, f"the request body exceeds {self.limit} bytes (REWA_MAX_BODY_BYTES)", "body"
        )
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit() or int(length) > self.limit:
                return await error_response(too_large)(scope, receive, send)
            return await self.app(scope, receive, send)
        messages, total = [], 0
        while True:
            message = await receive()
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
