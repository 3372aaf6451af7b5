"""The hostile-input corpus (tests/hostile_corpus.py) against real servers on both stores, with
API keys: no response >= 500, no process death, no request answered after more than 10 s; a
context accepted at creation is then filled and attended in every mode without a 5xx either;
and concurrent hostile clients leave the committed context unchanged."""

from __future__ import annotations

import threading

import httpx
import pytest
import torch

from tests.hostile_corpus import KEY, Case, corpus
from tests.service_support import (
    REDIS_URL,
    Server,
    attend,
    create_context,
    drop_prefix,
    encode,
    redis_prefix,
    upload,
)

H, N, D = 2, 64, 8
REQUEST_TIMEOUT_S = 10.0
CORPUS = corpus()
MODES = ("exact", "topk", "tail")


class Target:
    """A server on one store with a committed context, a second context and an open upload."""

    def __init__(self, store: str) -> None:
        self.prefix = redis_prefix() if store == "redis" else None
        settings = {"api_keys": KEY, "max_queries_per_request": 65536}
        if self.prefix:
            settings |= {"redis_url": REDIS_URL, "redis_prefix": self.prefix}
        self.server = Server(**settings).start()
        self.client = self.server.client(KEY, timeout=REQUEST_TIMEOUT_S)
        generator = torch.Generator().manual_seed(3)
        self.keys = torch.randn(H, N, D, generator=generator)
        self.values = torch.randn(H, N, D, generator=generator)
        self.context = create_context(self.client, head_dim=D)["id"]
        upload(self.client, self.context, self.keys, self.values)
        self.other = create_context(self.client, head_dim=D)["id"]
        self.upload = self.client.post(f"/v1/contexts/{self.context}/uploads").json()["upload_id"]
        self.queries = torch.randn(H, 3, D, generator=generator)
        self.reference = attend(self.client, self.context, self.queries, mode="exact")[:2]

    def close(self) -> None:
        self.client.close()
        self.server.kill()
        if self.prefix:
            drop_prefix(self.prefix)


@pytest.fixture(scope="module", params=["embedded", "redis"])
def target(request):
    target = Target(request.param)
    yield target
    target.close()


def _send(target: Target, case: Case) -> httpx.Response:
    path = case.path.format(context=target.context, upload=target.upload, other=target.other)
    headers = dict(case.headers)
    if case.authorized:
        headers.setdefault("Authorization", f"Bearer {KEY}")
    with httpx.Client(base_url=target.server.url, timeout=REQUEST_TIMEOUT_S) as client:
        return client.request(
            case.method, path, json=case.json, content=case.content, headers=headers,
            params=case.params,
        )  # fmt: skip


def _use(target: Target, context_id: str) -> list[tuple[str, int, str]]:
    """Fill an accepted context, attend in every mode, delete it: the statuses >= 500."""
    failures = []
    client = target.client
    try:
        upload(client, context_id, torch.randn(H, 40, D), torch.randn(H, 40, D))
    except AssertionError as error:  # upload() asserts success; a 4xx here names the defect
        return [("upload", 0, str(error)[:300])]
    for mode in MODES:
        response = client.post(
            f"/v1/contexts/{context_id}/attend",
            json={"queries": encode(torch.randn(H, 2, D)), "mode": mode},
        )
        if response.status_code >= 500:
            failures.append((mode, response.status_code, response.text[:300]))
    client.delete(f"/v1/contexts/{context_id}")
    return failures


@pytest.mark.parametrize("case", CORPUS, ids=[case.name for case in CORPUS])
def test_a_hostile_request_gets_no_5xx(target, case):
    response = _send(target, case)
    assert response.status_code < 500, response.text[:500]
    if case.authorized is False:
        assert response.status_code == 401, response.text[:300]
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"type", "message", "param"} and error["message"]
    if case.then_use and response.status_code == 201:
        assert _use(target, response.json()["id"]) == []
    assert target.server.process.poll() is None, target.server.output()[-3000:]


def test_the_corpus_is_large():
    assert len(CORPUS) >= 300


def test_concurrent_hostile_clients_change_nothing(target):
    """Eight clients send the corpus at once; afterwards the server is up and the committed
    context answers exactly as before."""
    cases = [case for case in CORPUS if not case.then_use and case.method != "DELETE"]
    statuses: list[int] = []
    lock = threading.Lock()

    def client(offset: int) -> None:
        for case in cases[offset::8]:
            status = _send(target, case).status_code
            with lock:
                statuses.append(status)

    threads = [threading.Thread(target=client, args=(offset,)) for offset in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert len(statuses) == len(cases) and max(statuses) < 500
    assert target.server.process.poll() is None
    out, lse, _ = attend(target.client, target.context, target.queries, mode="exact")
    torch.testing.assert_close(out, target.reference[0], rtol=0, atol=0)
    torch.testing.assert_close(lse, target.reference[1], rtol=0, atol=0)
