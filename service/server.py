"""`rewa serve`: the application under uvicorn, with a graceful drain on SIGTERM (uvicorn stops
accepting connections, lets in-flight requests finish for up to `REWA_DRAIN_TIMEOUT_S`, then
exits)."""

from __future__ import annotations

import uvicorn

from .app import create_app
from .settings import Settings


def serve(settings: Settings | None = None) -> None:
    settings = settings or Settings()
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        timeout_graceful_shutdown=settings.drain_timeout_s,
        log_level="info",
    )
