"""Nothing committed is lost and nothing uncommitted is seen: server restarts (embedded store
under REWA_DATA_DIR), SIGKILL in the middle of an upload (Redis), a Redis outage (503, then
recovery) and a graceful drain on SIGTERM."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch

from rewa.attention import dense_attention, make_geometry
from tests.service_support import (
    REDIS_URL,
    PrivateRedis,
    Server,
    attend,
    create_context,
    drop_prefix,
    encode,
    redis_prefix,
    upload,
)

H, D = 2, 16


def _context_data(n=2000, seed=3):
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(H, n, D, generator=generator),
        torch.randn(H, n, D, generator=generator),
        torch.randn(H, 4, D, generator=generator),
    )


def _assert_intact(client, context_id, keys, values, queries, version):
    info = client.get(f"/v1/contexts/{context_id}").json()
    assert (info["n_tokens"], info["version"]) == (keys.shape[1], version)
    out, lse, _ = attend(client, context_id, queries, mode="exact")
    expected = dense_attention(queries, keys, values, make_geometry("dot", D))
    torch.testing.assert_close(out, expected[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, expected[1], rtol=1e-5, atol=1e-5)


def test_embedded_store_survives_a_restart_and_drops_uncommitted_uploads(tmp_path):
    keys, values, queries = _context_data()
    server = Server(data_dir=tmp_path).start()
    with server.client() as client:
        context = create_context(client)
        upload(client, context["id"], keys, values)
        # An upload that is never committed.
        open_upload = client.post(f"/v1/contexts/{context['id']}/uploads").json()["upload_id"]
        extra = torch.randn(H, 10, D)
        response = client.post(
            f"/v1/contexts/{context['id']}/uploads/{open_upload}/chunks",
            json={"keys": encode(extra), "values": encode(extra)},
        )
        assert response.status_code == 200
    assert server.terminate()
    restarted = Server(data_dir=tmp_path).start()
    try:
        with restarted.client() as client:
            _assert_intact(client, context["id"], keys, values, queries, version=1)
            response = client.get(f"/v1/contexts/{context['id']}/uploads/{open_upload}")
            assert response.status_code == 404
        leftovers = list((tmp_path / "public" / context["id"] / "chunks").glob("*"))
        assert len(leftovers) == 2  # the two committed chunks; the uncommitted one is gone
    finally:
        restarted.kill()


def test_redis_store_sigkill_mid_upload_keeps_the_committed_version():
    keys, values, queries = _context_data()
    prefix = redis_prefix()
    settings = {"redis_url": REDIS_URL, "redis_prefix": prefix, "redis_piece_bytes": 65536}
    server = Server(**settings).start()
    try:
        with server.client() as client:
            context = create_context(client)
            upload(client, context["id"], keys, values)
            open_upload = client.post(f"/v1/contexts/{context['id']}/uploads").json()["upload_id"]
            big = torch.randn(H, 100_000, D)
            raw = big.numpy().tobytes() * 2
        failures = []

        def send_big_chunk():
            try:
                httpx.post(
                    f"{server.url}/v1/contexts/{context['id']}/uploads/{open_upload}/chunks",
                    params={"tokens": 100_000},
                    content=raw,
                    headers={"Content-Type": "application/octet-stream"},
                    timeout=60,
                )
            except httpx.TransportError as error:
                failures.append(error)

        sender = threading.Thread(target=send_big_chunk)
        sender.start()
        time.sleep(0.3)
        server.kill()  # SIGKILL while the chunk is in flight
        sender.join(60)
        restarted = Server(**settings).start()
        try:
            with restarted.client() as client:
                _assert_intact(client, context["id"], keys, values, queries, version=1)
                # The open upload holds the whole chunk or none of it; committing it now
                # appends exactly that, and the new version reads back whole.
                info = client.get(f"/v1/contexts/{context['id']}/uploads/{open_upload}").json()
                assert info["n_tokens"] in (0, 100_000)
                response = client.post(f"/v1/contexts/{context['id']}/uploads/{open_upload}/commit")
                assert response.status_code == 200, response.text
                if info["n_tokens"]:
                    keys, values = torch.cat([keys, big], dim=1), torch.cat([values, big], dim=1)
                _assert_intact(client, context["id"], keys, values, queries, version=2)
        finally:
            restarted.kill()
    finally:
        server.kill()
        drop_prefix(prefix)


def test_redis_outage_gives_503_and_recovers():
    keys, values, queries = _context_data(n=500)
    private = PrivateRedis().start()
    server = Server(redis_url=private.url).start()
    try:
        with server.client(timeout=30) as client:
            context = create_context(client)
            upload(client, context["id"], keys, values)
            private.stop()
            ready = client.get("/readyz")
            assert ready.status_code == 503
            assert ready.json()["error"]["type"] == "unavailable"
            for method, path, body in [
                ("GET", "/v1/contexts", None),
                ("GET", f"/v1/contexts/{context['id']}", None),
                ("POST", f"/v1/contexts/{context['id']}/attend", {"queries": encode(queries)}),
                ("POST", "/v1/contexts", {"geometry": {"name": "dot"}, "heads": 1, "head_dim": 4}),
            ]:
                response = client.request(method, path, json=body)
                assert response.status_code == 503, (path, response.text)
                assert response.json()["error"]["type"] == "unavailable"
                assert response.headers["Retry-After"] == "1"
            private.start()  # same port, same append-only file
            assert client.get("/readyz").status_code == 200
            _assert_intact(client, context["id"], keys, values, queries, version=1)
    finally:
        server.kill()
        private.cleanup()


@pytest.mark.parametrize("store", ["embedded", "redis"])
def test_sigterm_drains_in_flight_requests(store, tmp_path):
    prefix = redis_prefix()
    settings = (
        {"data_dir": tmp_path}
        if store == "embedded"
        else {"redis_url": REDIS_URL, "redis_prefix": prefix}
    )
    # No background index build, and no queue-time bound (0.5-2.5 s each, the fourth request
    # may start near REWA_MAX_QUEUE_WAIT_S's default 5 s): this test is about draining.
    server = Server(
        **settings, batching="false", build_on_commit="false", max_queue_wait_s="120"
    ).start()
    keys, values, _ = _context_data(n=16384)
    try:
        with server.client() as client:
            context = create_context(client, geometry={"name": "poincare"})
            upload(client, context["id"], keys * 0.1, values, chunk=8192)
        results = []

        def slow_request():
            # Exact Poincare self-attention of 4096 rows over 16384 keys, 2 heads; the four
            # requests run one after another on the device worker.
            response = httpx.post(
                f"{server.url}/v1/contexts/{context['id']}/self-attention",
                json={"start": 0, "end": 4096, "mode": "exact"},
                timeout=60,
            )
            results.append(response.status_code)

        workers = [threading.Thread(target=slow_request) for _ in range(4)]
        for worker in workers:
            worker.start()
        time.sleep(0.3)
        assert len(results) < 4  # requests are still in flight when SIGTERM arrives
        assert server.terminate(timeout=60)
        for worker in workers:
            worker.join(60)
        assert results == [200] * 4  # every in-flight request finished
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{server.url}/livez", timeout=2)  # and then nothing is admitted
    finally:
        server.kill()
        drop_prefix(prefix)
