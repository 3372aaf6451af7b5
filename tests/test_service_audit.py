"""The service's audit (`REWA_AUDIT_EVERY`; docs/service.md, "The audit"): one query row in
`audit_every` of a non-causal sparse attend, counted per context and layer, is also answered
exactly and its error kept per head; a tail head whose 99th percentile passes the target gets
pieces of half the size, a choice kept in the store, which every later version, extension and
replica follows. The heads are test_audit.py's: head 0 sharp (its tail answers miss the default
target), head 1 diffuse (far within it)."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from pydantic import ValidationError

from rewa.attention import dense_attention, make_geometry
from rewa.clients import Client, RemoteMemory
from rewa.index import KeyClusters, tail_attention_heads
from rewa.index.audit import AUDIT_TARGET, AUDITS_WAITING
from rewa.index.measures import output_error
from rewa.llm import RemoteDocument
from rewa.service import engine as engine_module
from rewa.service.embedded_store import EmbeddedStore
from rewa.service.engine import AUDITED_PIECES, AttendParams, Engine
from rewa.service.metrics import Metrics
from rewa.service.settings import Settings
from tests.service_support import (
    REDIS_URL,
    Server,
    attend,
    create_context,
    drop_prefix,
    redis_prefix,
    upload,
)
from tests.test_audit import D, N, _assert_same, _queries, _sharp_and_diffuse

TAIL = AttendParams(mode="tail", top_k=16, budget=0.02, window=0, sinks=0)
TOPK = AttendParams(mode="topk", top_k=16, budget=0.02, window=0, sinks=0)
GEOMETRY = make_geometry("dot", D)


def _commit(store, name, keys, values, layers=1):
    """Commit keys and values `(stored heads, n, D)` as a new context (or its next version)."""
    if name not in {record["id"] for record in store.list("ns")}:
        index = {"kind": "flat", "top_k": 16, "window": 0, "sinks": 0, "budget": 0.02}
        info = {"id": name, "name": name, "geometry": {"name": "dot"}, "head_dim": D,
                "heads": keys.shape[0] // layers, "value_dim": D, "dtype": "float32",
                "index": {**index, "options": {}}}  # fmt: skip
        if layers > 1:
            info["layers"] = layers
        store.create("ns", info)
    upload_id = store.begin_upload("ns", name)
    data = keys.contiguous().numpy().tobytes() + values.contiguous().numpy().tobytes()
    store.add_chunk("ns", name, upload_id, data, keys.shape[1])
    return store.commit("ns", name, upload_id, 10**6)


def _engine(store, **options) -> Engine:
    """Every key indexed (`open_segment=0`), attends wait for their build, pieces of the
    default size unless the audit chose one."""
    options = {"open_segment": 0, "exact_while_building": 0, "probed_pieces": False} | options
    return Engine(store, device=torch.device("cpu"), cache_bytes=1 << 30, store_indexes=False,
                  **options)  # fmt: skip


def _audited(**options):
    """test_audit.py's two heads committed as the context "c" of a new store, an engine over it
    (`_engine(store, **options)`) and the loaded context: `(keys, values, engine, loaded)`."""
    keys, values = _sharp_and_diffuse()
    store = EmbeddedStore()
    engine = _engine(store, **options)
    return keys, values, engine, engine.context("ns", _commit(store, "c", keys, values))


def _default_clusters(keys, values) -> KeyClusters:
    return KeyClusters.build(keys, values, GEOMETRY, probed_pieces=False)


def _default_pieces(keys, values) -> int:
    return int(_default_clusters(keys, values).max_keys)


def _wait_for_cut(engine: Engine, name: str = "c") -> None:
    """Wait for the audit thread, then for the cut it started."""
    engine.wait_for_audits()
    engine._recuts[("ns", name)].result()


def test_a_tail_head_whose_audit_misses_is_cut_and_the_choice_kept_in_the_store():
    keys, values, engine, loaded = _audited(audit_every=2, audit_window=128)
    record = loaded.record
    queries = _queries(keys, 256)
    out = engine.attend(loaded, queries, TAIL)["out"]  # a full window of 128 errors per head
    exact, _ = dense_attention(queries[:, ::2], keys, values, GEOMETRY)
    errors = output_error(out[:, ::2], exact).double()
    assert errors[0].quantile(0.99) > AUDIT_TARGET >= errors[1].quantile(0.99)
    _wait_for_cut(engine)
    default = _default_pieces(keys[0], values[0])
    assert engine.audited_pieces("ns", "c") == {0: default // 2}
    halved = KeyClusters.build(keys[0], values[0], GEOMETRY, max_cluster_keys=default // 2)
    _assert_same(loaded.clusters[0], halved)
    _assert_same(loaded.clusters[1], _default_clusters(keys[1], values[1]))
    report = engine.audit_report("ns", record)
    diffuse = _default_pieces(keys[1], values[1])
    assert [row["max_keys"] for row in report] == [default // 2, diffuse]
    assert report[0]["audited"] == 0  # its errors measured the pieces before
    assert report[1]["audited"] == 128
    assert report[1]["err_p99"] == pytest.approx(errors[1].quantile(0.99).item(), abs=1e-6)
    assert report[1]["err_median"] == pytest.approx(errors[1].quantile(0.5).item(), abs=1e-6)
    # The cut pieces answer at once, as tail attention over them does, and err less.
    again = engine.attend(loaded, queries, TAIL)["out"]
    stacked = loaded.layer_heads[(0, 2)]
    expected, _ = tail_attention_heads(queries, stacked, budget=0.02)
    torch.testing.assert_close(again, expected, rtol=1e-5, atol=1e-6)
    after = output_error(again[0, ::2], exact[0]).double().quantile(0.99)
    assert after < 0.8 * errors[0].quantile(0.99)


def test_later_versions_and_replicas_follow_the_size_the_audit_chose():
    keys, values = _sharp_and_diffuse(N + 500)
    store = EmbeddedStore()
    record = _commit(store, "c", keys[:, :N], values[:, :N])
    audited = _engine(store, audit_every=2, audit_window=128)
    audited.attend(audited.context("ns", record), _queries(keys[:, :N], 256), TAIL)
    _wait_for_cut(audited)
    halved = _default_pieces(keys[0, :N], values[0, :N]) // 2
    # A replica that does not audit builds that head's pieces at the size chosen.
    replica = _engine(store)
    replica.build_indexes(replica.context("ns", record), ["tail"])
    _assert_same(
        replica.context("ns", record).clusters[0],
        KeyClusters.build(keys[0, :N], values[0, :N], GEOMETRY, max_cluster_keys=halved),
    )
    # Appended tokens: the audited engine extends its cut pieces, the replica too; both hold
    # what a build over every key at that size holds.
    record = _commit(store, "c", keys[:, N:], values[:, N:])
    whole = KeyClusters.build(keys[0], values[0], GEOMETRY, max_cluster_keys=halved)
    for engine in (audited, replica):
        loaded = engine.context("ns", record)
        engine.build_indexes(loaded, ["tail"])
        assert int(loaded.clusters[0].max_keys) == halved
        assert torch.equal(loaded.clusters[0].order, whole.order)
        _assert_same(loaded.clusters[1], _default_clusters(keys[1], values[1]))


@pytest.mark.parametrize("chosen", ["smaller", "larger"])
def test_a_version_cut_before_the_choice_is_cut_anew_when_it_extends(chosen):
    """A replica holding clusters of the default size when another chose a smaller one builds
    that head anew at its next extension (extending would keep the larger pieces); so too when
    the other chose a larger one (a head whose halving did not mend it goes back)."""
    keys, values = _sharp_and_diffuse(N + 500)
    store = EmbeddedStore()
    record = _commit(store, "c", keys[:, :N], values[:, :N])
    engine = _engine(store)
    engine.build_indexes(engine.context("ns", record), ["tail"])
    default = _default_pieces(keys[0, :N], values[0, :N])
    assert int(engine.context("ns", record).clusters[0].max_keys) == default
    size = default // 4 if chosen == "smaller" else default * 2
    store.put_blob("ns", "c", AUDITED_PIECES, json.dumps({"0": size}).encode())
    record = _commit(store, "c", keys[:, N:], values[:, N:])
    loaded = engine.context("ns", record)
    engine.build_indexes(loaded, ["tail"])
    expected = KeyClusters.build(
        keys[0], values[0], GEOMETRY, max_cluster_keys=size, probed_pieces=False
    )
    _assert_same(loaded.clusters[0], expected)
    assert int(loaded.clusters[1].max_keys) == _default_pieces(keys[1], values[1])


def test_the_errors_of_answers_from_pieces_cut_since_are_not_kept():
    """Rows answered by the pieces before a cut and audited after it do not enter the cut
    head's new window; the other head keeps them."""
    keys, values, engine, loaded = _audited(audit_every=2, audit_target=10.0)
    queries = _queries(keys, 256)
    auditing = threading.Event()
    engine._auditor.submit(auditing.wait)  # the audit waits
    engine.attend(loaded, queries, TAIL)  # 128 rows of each head handed over
    half = _default_pieces(keys[0], values[0]) // 2
    engine._cut_again(("ns", "c"), 0, half)  # a cut, meanwhile
    assert int(loaded.clusters[0].max_keys) == half
    auditing.set()
    engine.wait_for_audits()
    assert [row["audited"] for row in engine.audit_report("ns", loaded.record)] == [0, 128]
    engine.attend(loaded, queries, TAIL)  # answered by the halved pieces: kept
    engine.wait_for_audits()
    assert [row["audited"] for row in engine.audit_report("ns", loaded.record)] == [128, 256]


def test_a_head_whose_halving_does_not_mend_it_goes_back_and_is_settled():
    """Random keys and values, as in benchmarks/service.py: the answers average many random
    values and lie near zero, so the relative errors are large at any piece size. Each head is
    halved once, misses as much, goes back to its pieces (the store keeps that size, larger
    than the halved one) and is settled."""
    generator = torch.Generator().manual_seed(3)
    keys, values = torch.randn(2, 2, 32768, D, generator=generator)
    queries = torch.randn(2, 4096, D, generator=generator)
    store = EmbeddedStore()
    engine = _engine(store, audit_every=2)
    loaded = engine.context("ns", _commit(store, "c", keys, values))
    default = [_default_pieces(keys[head], values[head]) for head in range(2)]
    cuts = []
    for chunk in queries.split(512, dim=1):
        engine.attend(loaded, chunk, TAIL)
        _wait_for_cut(engine)
        cuts.append([int(clusters.max_keys) for clusters in loaded.clusters])
    assert [default[0] // 2, default[1]] in cuts and [default[0], default[1] // 2] in cuts
    report = engine.audit_report("ns", loaded.record)
    assert [row["settled"] for row in report] == [True, True]
    assert [row["max_keys"] for row in report] == default
    assert engine.audited_pieces("ns", "c") == {0: default[0], 1: default[1]}
    expected = KeyClusters.build(
        keys[0], values[0], GEOMETRY, max_cluster_keys=default[0], probed_pieces=False
    )
    _assert_same(loaded.clusters[0], expected)
    # The store keeps them settled: another process halves neither.
    assert engine.settled_heads("ns", "c") == [0, 1]
    replica = _engine(store, audit_every=2)
    assert [row["settled"] for row in replica.audit_report("ns", loaded.record)] == [True, True]
    other = replica.context("ns", loaded.record)
    for chunk in queries.split(512, dim=1):
        replica.attend(other, chunk, TAIL)
    replica.wait_for_audits()
    assert ("ns", "c") not in replica._recuts
    assert [int(clusters.max_keys) for clusters in other.clusters] == default


def test_the_layers_of_a_document_are_audited_apart():
    """One query per call, alternating between two layers: each layer counts its own rows (a
    count shared by the document would audit layer 0 alone), and layer 1's sharp head is the
    stored head that is cut, before its window is full (a window of 64 surely misses once two
    of its errors do)."""
    sharp_and_diffuse, values = _sharp_and_diffuse()
    keys, values = sharp_and_diffuse.flip(0), values.flip(0)  # layer 0 diffuse, layer 1 sharp
    store = EmbeddedStore()
    record = _commit(store, "doc", keys, values, layers=2)
    engine = _engine(store, audit_every=2, audit_window=64)
    document = engine.context("ns", record)
    queries = _queries(keys, 128)
    for row in range(128):
        for layer in (0, 1):
            view = engine.layer(document, layer)
            engine.attend(view, queries[layer : layer + 1, row : row + 1], TAIL)
            engine.wait_for_audits()  # none skipped
    _wait_for_cut(engine, "doc")
    halved = _default_pieces(keys[1], values[1]) // 2
    assert engine.audited_pieces("ns", "doc") == {1: halved}
    assert int(document.clusters[1].max_keys) == halved
    report = engine.audit_report("ns", record)
    # Layer 0's window is full; layer 1's errors were forgotten at its cut, which came before
    # its 64th audited row, and only the halved pieces' errors are kept since.
    assert report[0]["audited"] == 64 and 0 < report[1]["audited"] < 64
    assert [row["max_keys"] for row in report] == [_default_pieces(keys[0], values[0]), halved]


def test_topk_is_audited_and_never_cut_causal_attends_are_not_audited():
    keys, values, engine, loaded = _audited(audit_every=2, audit_window=128, audit_target=1e-12)
    store, record = engine.store, loaded.record
    queries = _queries(keys, 256)
    out = engine.attend(loaded, queries, TOPK)["out"]
    exact, _ = dense_attention(queries[:, ::2], keys, values, GEOMETRY)
    engine.wait_for_audits()
    report = engine.audit_report("ns", record)
    for head in range(2):
        errors = output_error(out[head, ::2], exact[head]).double()
        assert report[head]["err_p99"] == pytest.approx(errors.quantile(0.99).item(), abs=1e-6)
    assert engine._recuts == {} and engine.audited_pieces("ns", "c") == {}
    causal = _engine(store, audit_every=1)
    loaded = causal.context("ns", record)
    positions = torch.arange(N - 8, N)
    causal.attend(loaded, queries[:, :8], TAIL, positions=positions, causal=True)
    assert [row["audited"] for row in causal.audit_report("ns", record)] == [0, 0]
    assert _engine(store).audit_report("ns", record) is None  # no audit


def test_a_cut_that_fails_keeps_the_old_pieces_and_is_tried_again(monkeypatch):
    keys, values, engine, loaded = _audited(audit_every=2, audit_window=128)
    store = engine.store
    queries = _queries(keys, 256)
    default = _default_pieces(keys[0], values[0])
    with monkeypatch.context() as patch:

        def unavailable(*args):
            raise ConnectionError("the store is down")

        patch.setattr(store, "put_blob", unavailable)
        engine.attend(loaded, queries, TAIL)  # answered; the cut starts, and fails
        with pytest.raises(ConnectionError):
            _wait_for_cut(engine)
    assert int(loaded.clusters[0].max_keys) == default
    assert engine.audited_pieces("ns", "c") == {}
    engine.attend(loaded, queries, TAIL)  # still missing: the cut starts again
    _wait_for_cut(engine)
    assert int(loaded.clusters[0].max_keys) == default // 2


def test_answers_do_not_wait_for_the_audit_and_rows_beyond_its_queue_are_skipped():
    metrics = Metrics()
    keys, values, engine, loaded = _audited(audit_every=1, audit_target=100.0, metrics=metrics)
    record = loaded.record
    queries = _queries(keys, 11)
    release = threading.Event()
    engine._auditor.submit(release.wait)  # the audit thread held
    answers = [engine.attend(loaded, queries[:, i : i + 1], TAIL)["out"] for i in range(11)]
    assert metrics.audits_skipped._value.get() == 11 - AUDITS_WAITING
    assert [row["audited"] for row in engine.audit_report("ns", record)] == [0, 0]
    release.set()
    engine.wait_for_audits()
    report = engine.audit_report("ns", record)
    assert [row["audited"] for row in report] == [AUDITS_WAITING] * 2
    # The rows audited are the first ones handed over, their errors those of the answers given.
    audited = slice(0, AUDITS_WAITING)
    exact, _ = dense_attention(queries[:, audited], keys, values, GEOMETRY)
    errors = output_error(torch.cat(answers, dim=1)[:, audited], exact).double()
    assert metrics.audit_errors._sum.get() == pytest.approx(errors.sum().item(), abs=1e-5)
    for head in range(2):
        assert report[head]["err_p99"] == pytest.approx(
            errors[head].quantile(0.99).item(), abs=1e-6
        )


def test_an_audit_that_fails_is_logged_and_the_next_rows_are_audited(monkeypatch, caplog):
    keys, _, engine, loaded = _audited(audit_every=1, audit_target=100.0)
    record = loaded.record
    queries = _queries(keys, 2)

    def failing(*args):
        raise RuntimeError("no memory for the audit")

    with monkeypatch.context() as patch:
        patch.setattr(engine_module, "audited_errors", failing)
        answer = engine.attend(loaded, queries[:, :1], TAIL)["out"]
        engine.wait_for_audits()
    assert "the audit of ('ns', 'c', 1) failed" in caplog.text
    assert "no memory for the audit" in caplog.text
    assert answer.isfinite().all()  # the answer was given all the same
    assert [row["audited"] for row in engine.audit_report("ns", record)] == [0, 0]
    engine.attend(loaded, queries[:, 1:], TAIL)
    engine.wait_for_audits()
    assert [row["audited"] for row in engine.audit_report("ns", record)] == [1, 1]


def test_bad_audit_options_are_refused():
    store = EmbeddedStore()
    for options, message in (
        ({"audit_every": -1}, "audit_every >= 0"),
        ({"audit_window": 0}, "window"),
        ({"audit_target": 0.0}, "audit_target > 0"),
        ({"audit_target": float("nan")}, "audit_target > 0"),
    ):
        with pytest.raises(ValueError, match=message):
            _engine(store, **options)
    for variable in ("REWA_AUDIT_EVERY", "REWA_AUDIT_WINDOW", "REWA_AUDIT_TARGET"):
        bad = "-1" if variable != "REWA_AUDIT_WINDOW" else "0"
        with pytest.raises(ValidationError):
            Settings(_env_file=None, **{variable.removeprefix("REWA_").lower(): bad})


def test_replicas_on_redis_share_the_choice_and_report_their_audits():
    """Two `rewa serve` processes on one Redis: the one that audits cuts the sharp head; the
    other, auditing with a target no head misses, builds its pieces at the size chosen, and
    both report their audits and metrics."""
    keys, values = _sharp_and_diffuse()
    queries = _queries(keys, 256)
    prefix = redis_prefix()
    shared = {"redis_url": REDIS_URL, "redis_prefix": prefix, "open_segment": 0}
    auditor = Server(**shared, audit_every=2, audit_window=128)
    other = Server(**shared, audit_every=4, audit_window=64, audit_target=100)
    plain = Server(**shared)
    try:
        auditor.start(), other.start()
        with auditor.client() as a, other.client() as b:
            context = create_context(a)
            upload(a, context["id"], keys, values)
            attend(a, context["id"], queries, budget=0.02)
            default = _default_pieces(keys[0], values[0])
            state = _polled(a, context["id"], lambda audit: audit[0]["max_keys"] == default // 2)
            assert state["audit"][0] == {"audited": 0, "err_median": None, "err_p99": None,
                                         "settled": False, "max_keys": default // 2}  # fmt: skip
            assert state["audit"][1]["audited"] == 128
            assert "rewa_audit_cuts_total 1.0" in a.get("/metrics").text
            built = b.post(f"/v1/contexts/{context['id']}/index", json={"modes": ["tail"]})
            assert built.status_code == 200, built.text
            assert [row["max_keys"] for row in built.json()["audit"]] == [
                default // 2,
                _default_pieces(keys[1], values[1]),
            ]
            attend(b, context["id"], queries, budget=0.02)
            state = _polled(b, context["id"], lambda audit: audit[0]["audited"] > 0)
            assert [row["audited"] for row in state["audit"]] == [64, 64]
            assert "rewa_audit_error_count 128.0" in b.get("/metrics").text
            with Client(other.url) as client:  # the memory's view of the same
                assert RemoteMemory(client, context["id"]).audit_report() == state["audit"]
                # A multi-layer document's layers report their own heads.
                document = RemoteDocument(client, [0, 1], budget=0.02)
                layers = [document.memory(layer, 2, D, D, 1.0) for layer in (0, 1)]
                for layer in layers:
                    layer.append(keys, values)  # committed once both layers spilled
                layers[1].attend(queries[:, :16])
                state = _polled(b, document.context_id, lambda audit: audit[2]["audited"] > 0)
                assert [row["audited"] for row in state["audit"]] == [0, 0, 4, 4]
                assert layers[1].audit_report() == state["audit"][2:]
                assert layers[0].audit_report() == state["audit"][:2]
        # A replica that does not audit: the memory says so.
        plain.start()
        with Client(plain.url) as client, pytest.raises(ValueError, match="does not audit"):
            RemoteMemory(client, context["id"]).audit_report()
    finally:
        for server in (auditor, other, plain):
            server.kill()
        drop_prefix(prefix)


def _polled(client, context_id: str, done, timeout: float = 60.0) -> dict:
    """The context's index state once `done(its audit)` holds (the audit and the cuts run on
    the server's threads, after the answer), or the last one after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        state = client.get(f"/v1/contexts/{context_id}/index").json()
        if done(state["audit"]) or time.monotonic() > deadline:
            return state
        time.sleep(0.1)
