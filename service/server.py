"""`rewa serve`: the application under uvicorn, with a graceful drain on SIGTERM (uvicorn stops
accepting connections, lets in-flight requests finish for up to `REWA_DRAIN_TIMEOUT_S`, then
exits), and timeouts for connections that stall.

uvicorn closes a connection that stays idle between requests (`REWA_KEEP_ALIVE_S`), but not one
that never completes its request head: a client that opens a connection and sends nothing, or
one header byte at a time, holds it forever. `HeadTimeoutProtocol` closes such a connection
after `REWA_HEADER_TIMEOUT_S`. Bodies are bounded in time by `app.BodyGuard`."""

from __future__ import annotations

import asyncio
import functools

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .app import create_app
from .settings import Settings


class HeadTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing the connection when no complete request head arrived
    within `header_timeout` seconds of the connection opening or of the last response."""

    def __init__(self, *args, header_timeout: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self._head_timer: asyncio.TimerHandle | None = None
        self._answered_cycle = None  # the cycle of the last complete response (None: no request)

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and self.cycle is not self._answered_cycle:
            self._disarm()  # a new request head arrived

    def on_response_complete(self) -> None:
        self._answered_cycle = self.cycle
        self._arm()
        super().on_response_complete()

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def server_config(settings: Settings, app=None) -> uvicorn.Config:
    """uvicorn's configuration of `rewa serve` (`app`: default `create_app(settings)`)."""
    return uvicorn.Config(
        app if app is not None else create_app(settings),
        host=settings.host,
        port=settings.port,
        http=functools.partial(HeadTimeoutProtocol, header_timeout=settings.header_timeout_s),
        timeout_keep_alive=settings.keep_alive_s,
        timeout_graceful_shutdown=settings.drain_timeout_s,
        log_level="info",
    )


def serve(settings: Settings | None = None) -> None:
    server = uvicorn.Server(server_config(settings or Settings()))
    server.run()
    if not server.started:
        raise SystemExit(3)  # uvicorn.run's exit status when start-up failed
