"""Connections: stalled clients are closed or answered 408 instead of being held forever,
keep-alive connections survive error responses (a 500 included), and 405 names every allowed
method. Raw sockets, so that what happens to the connection itself is visible."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import uvicorn
from fastapi import APIRouter

from rewa.service.app import create_app
from rewa.service.server import server_config
from rewa.service.settings import Settings
from tests.service_support import Server, free_port

TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def served():
    server = Server(
        header_timeout_s=TIMEOUT_S, body_idle_timeout_s=TIMEOUT_S, body_timeout_s=3 * TIMEOUT_S
    ).start()
    yield server
    server.kill()


def _connect(port: int) -> socket.socket:
    connection = socket.create_connection(("127.0.0.1", port), timeout=20)
    return connection


def _read_response(connection: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = connection.recv(65536)
        assert chunk, f"the connection closed mid-response: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, value = line.split(":", 1)
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = connection.recv(65536)
        assert chunk
        body += chunk
    return status, headers, body


def _closed_within(connection: socket.socket, seconds: float) -> bool:
    """True when the server closes the connection (EOF) within `seconds`."""
    connection.settimeout(seconds)
    try:
        while True:
            if connection.recv(65536) == b"":
                return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def _request(method: str, path: str, body: bytes = b"", content_type: str = "application/json"):
    head = f"{method} {path} HTTP/1.1\r\nHost: test\r\n"
    if body or method in ("POST", "PUT"):
        head += f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


def test_a_connection_that_sends_nothing_is_closed(served):
    with _connect(served.port) as connection:
        assert _closed_within(connection, 10 * TIMEOUT_S)


def test_a_request_head_sent_byte_by_byte_is_cut_off(served):
    """A slowloris client: each byte arrives before any idle timeout, the head never ends."""
    with _connect(served.port) as connection:
        started = time.monotonic()
        closed = False
        for byte in b"GET /livez HTTP/1.1\r\nHost: test\r\nX-Slow: " + b"a" * 200:
            try:
                connection.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            if _closed_within(connection, 0.1):
                closed = True
                break
            if time.monotonic() - started > 10 * TIMEOUT_S:
                break
        assert closed


def test_a_stalled_body_gets_408_and_the_server_goes_on(served):
    with _connect(served.port) as connection:
        head = _request("POST", "/v1/contexts", b"x" * 100)
        connection.sendall(head[: len(head) - 90])  # the head and 10 of 100 body bytes
        status, headers, body = _read_response(connection)
        assert status == 408
        assert b'"param":"body"' in body.replace(b" ", b"")
        assert headers.get("connection") == "close"
    with _connect(served.port) as connection:
        connection.sendall(_request("GET", "/livez"))
        assert _read_response(connection)[0] == 200


def test_a_body_trickled_slower_than_the_total_timeout_gets_408(served):
    with _connect(served.port) as connection:
        head = _request("POST", "/v1/contexts", b"x" * 100)
        body_start = len(head) - 100
        connection.sendall(head[:body_start])
        status = None
        for index in range(100):  # one byte every half idle timeout: never idle long enough
            try:
                connection.sendall(head[body_start + index : body_start + index + 1])
            except (BrokenPipeError, ConnectionResetError):
                break
            connection.settimeout(TIMEOUT_S / 2)
            try:
                status = _read_response(connection)[0]
                break
            except TimeoutError:
                continue
        assert status == 408


def test_keep_alive_survives_client_errors_and_405_names_every_method(served):
    with _connect(served.port) as connection:
        connection.sendall(_request("GET", "/v1/contexts/no-such-context"))
        assert _read_response(connection)[0] == 404
        connection.sendall(_request("POST", "/v1/contexts", b"{not json"))
        assert _read_response(connection)[0] == 400
        connection.sendall(_request("PUT", "/v1/contexts", b"{}"))
        status, headers, _ = _read_response(connection)
        assert status == 405 and headers["allow"] == "GET, POST"
        connection.sendall(_request("PATCH", "/v1/contexts/some-id"))
        status, headers, _ = _read_response(connection)
        assert status == 405 and headers["allow"] == "GET, DELETE"
        connection.sendall(_request("GET", "/livez"))
        assert _read_response(connection)[0] == 200


@pytest.fixture(scope="module")
def served_with_a_bug():
    """The application with one route that fails unexpectedly, under `rewa serve`'s uvicorn
    configuration, in a thread."""
    settings = Settings(port=free_port(), header_timeout_s=TIMEOUT_S)
    app = create_app(settings)
    bug = APIRouter()

    @bug.get("/bug")
    async def failing_route():
        raise RuntimeError("a bug")

    app.include_router(bug)
    config = server_config(settings, app)
    config.log_level = "critical"
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    yield settings.port
    server.should_exit = True
    thread.join(30)


def test_keep_alive_survives_a_500(served_with_a_bug):
    with _connect(served_with_a_bug) as connection:
        connection.sendall(_request("GET", "/bug"))
        status, _, body = _read_response(connection)
        assert status == 500
        assert b"internal error: RuntimeError" in body
        connection.sendall(_request("GET", "/livez"))  # the same connection
        assert _read_response(connection)[0] == 200
