"""Pieces sized by probes (`KeyClusters.build`'s default, `probed_pieces=True`;
index/tail/probe.py): a head's pieces are halved where its own keys, asked as queries, show the
tail estimate missing and halving mending it; elsewhere the build is the one without probes
(`probed_pieces=False`)."""

from dataclasses import fields

import pytest
import torch

from rewa.attention import dense_attention, make_geometry
from rewa.index import KeyClusters, LocalMemory, tail_attention, tail_attention_with_reads
from rewa.index.clusters import MIN_PROBED_KEYS
from rewa.index.measures import output_error
from rewa.index.tail import probe as probe_module
from rewa.index.tail.probe import PROBE_QUERIES, SCREEN_QUERIES, probe_error, screen_error
from rewa.service.embedded_store import EmbeddedStore
from rewa.service.engine import Engine
from rewa.service.settings import Settings

D = 16


def _head(n: int, scale: float, seed: int = 0):
    """Keys around `n / 512` centres, `scale` times as long (larger: sharper attention when keys
    are asked as queries), and values linear in the keys."""
    generator = torch.Generator().manual_seed(seed)
    centres = torch.randn(max(1, n // 512), D, generator=generator, dtype=torch.float64)
    labels = torch.randint(len(centres), (n,), generator=generator)
    k = (centres[labels] + torch.randn(n, D, generator=generator, dtype=torch.float64)) * scale
    mixing = torch.randn(D, D, generator=generator, dtype=torch.float64)
    return k, k @ mixing


def _assert_same(mine: KeyClusters, theirs: KeyClusters) -> None:
    for field in fields(KeyClusters):
        if field.name != "geometry":
            a, b = getattr(mine, field.name), getattr(theirs, field.name)
            assert a.shape == b.shape and torch.equal(a, b), field.name


@pytest.fixture
def dot():
    return make_geometry("dot", D).double()


def test_a_sharp_head_gets_pieces_of_half_the_size_and_a_smaller_probe_error(dot):
    k, v = _head(MIN_PROBED_KEYS, scale=2.0)
    default = KeyClusters.build(k, v, dot, probed_pieces=False)
    probed = KeyClusters.build(k, v, dot)
    assert int(probed.max_keys) == int(default.max_keys) // 2
    assert screen_error(default) > probe_module.SCREEN_TOLERANCE
    assert probe_error(default) > probe_module.PROBE_TOLERANCE
    assert probe_error(probed) <= probe_module.PROBE_GAIN * probe_error(default)
    # The halved pieces are those a build asked for that size gives.
    _assert_same(probed, KeyClusters.build(k, v, dot, max_cluster_keys=int(probed.max_keys)))
    # Real queries aimed at keys gain as the probes did.
    generator = torch.Generator().manual_seed(1)
    rows = torch.randint(len(k), (256,), generator=generator)
    q = k[rows] + 0.1 * torch.randn(256, D, generator=generator, dtype=torch.float64)
    reference = dense_attention(q, k, v, dot)[0]
    errors = [
        output_error(tail_attention(q, clusters)[0], reference).quantile(0.95)
        for clusters in (default, probed)
    ]
    assert errors[1] < 0.8 * errors[0]


def test_a_diffuse_head_keeps_the_default_pieces(dot):
    k, v = _head(MIN_PROBED_KEYS, scale=0.3)
    probed = KeyClusters.build(k, v, dot)
    assert screen_error(probed) <= probe_module.SCREEN_TOLERANCE
    _assert_same(probed, KeyClusters.build(k, v, dot, probed_pieces=False))


def test_a_head_past_the_screen_within_the_tolerance_keeps_the_default_pieces(dot, monkeypatch):
    # The screen lets the sharp head through to the decision; a tolerance above its probe error
    # keeps its pieces.
    k, v = _head(MIN_PROBED_KEYS, scale=2.0)
    default = KeyClusters.build(k, v, dot, probed_pieces=False)
    assert screen_error(default) > probe_module.SCREEN_TOLERANCE
    monkeypatch.setattr(probe_module, "PROBE_TOLERANCE", probe_error(default) * 1.01)
    _assert_same(KeyClusters.build(k, v, dot), default)


def test_a_head_within_the_screen_is_not_probed_further(dot, monkeypatch):
    calls = []
    monkeypatch.setattr(probe_module, "probe_error", lambda *args: calls.append(1) or 1.0)
    monkeypatch.setattr(probe_module, "SCREEN_TOLERANCE", 10.0)
    k, v = _head(MIN_PROBED_KEYS, scale=2.0)
    _assert_same(KeyClusters.build(k, v, dot), KeyClusters.build(k, v, dot, probed_pieces=False))
    assert calls == []


def test_halved_pieces_that_do_not_mend_the_error_are_not_kept(dot, monkeypatch):
    # Halving that does not mend the screen's error is not taken to the decision's probes.
    k, v = _head(MIN_PROBED_KEYS, scale=2.0)
    calls = []
    monkeypatch.setattr(probe_module, "probe_error", lambda *args: calls.append(1) or 1.0)
    monkeypatch.setattr(probe_module, "PROBE_GAIN", 0.0)
    _assert_same(KeyClusters.build(k, v, dot), KeyClusters.build(k, v, dot, probed_pieces=False))
    assert calls == []


def test_halved_pieces_that_mend_the_screen_but_not_the_probes_are_not_kept(dot, monkeypatch):
    k, v = _head(MIN_PROBED_KEYS, scale=2.0)
    errors = iter([1.0, 0.9])  # the decision's probes: the halved pieces at 0.9 of the first
    monkeypatch.setattr(probe_module, "probe_error", lambda *args: next(errors))
    _assert_same(KeyClusters.build(k, v, dot), KeyClusters.build(k, v, dot, probed_pieces=False))
    assert next(errors, None) is None


def test_small_contexts_and_explicit_sizes_are_not_probed(dot, monkeypatch):
    calls = []
    monkeypatch.setattr(probe_module, "screen_error", lambda *args: calls.append(1) or 1.0)
    monkeypatch.setattr(probe_module, "probe_error", lambda *args: calls.append(1) or 1.0)
    k, v = _head(MIN_PROBED_KEYS - 1, scale=2.0)
    _assert_same(KeyClusters.build(k, v, dot), KeyClusters.build(k, v, dot, probed_pieces=False))
    k, v = _head(MIN_PROBED_KEYS, scale=2.0)
    for options in ({"max_cluster_keys": 128}, {"n_clusters": 40}):
        _assert_same(
            KeyClusters.build(k, v, dot, **options),
            KeyClusters.build(k, v, dot, probed_pieces=False, **options),
        )
    assert calls == []


def test_the_decision_reads_the_trained_keys_only_so_extend_equals_a_build(dot):
    # 1000 keys past the trained prefix: the probes and their pieces come from the prefix, and
    # the keys appended later join the halved pieces, as a build over all of them places them.
    k, v = _head(MIN_PROBED_KEYS + 1000, scale=2.0)
    whole = KeyClusters.build(k, v, dot)
    trained = KeyClusters.build(k[:MIN_PROBED_KEYS], v[:MIN_PROBED_KEYS], dot)
    unprobed = KeyClusters.build(k, v, dot, probed_pieces=False)
    assert int(whole.max_keys) == int(trained.max_keys) < int(unprobed.max_keys)
    grown = trained
    for start in range(MIN_PROBED_KEYS, len(k), 400):
        grown = grown.extend(k[start : start + 400], v[start : start + 400])
    assert int(grown.max_keys) == int(whole.max_keys) and torch.equal(grown.order, whole.order)
    torch.testing.assert_close(grown.value_cross, whole.value_cross, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("geometry", ["dot", "poincare"])
def test_the_probe_error_is_tail_attention_of_the_keys_as_queries(geometry):
    # The probes are key witnesses; a geometry whose witness map is not idempotent (Poincare)
    # must not map them twice.
    g = make_geometry(geometry, D).double()
    k, v = _head(8192, scale=0.1)
    clusters = KeyClusters.build(g.witness(k), v, g)
    assert torch.equal(probe_module.screen_probes(clusters), clusters.keys_w[
        clusters.positions(torch.linspace(0, len(k) - 1, SCREEN_QUERIES).round().long())
    ])  # fmt: skip
    for count, quantile, measured in (
        (SCREEN_QUERIES, 0.95, screen_error),
        (PROBE_QUERIES, 0.99, probe_error),
    ):
        rows = torch.linspace(0, len(k) - 1, count).round().long()
        result = tail_attention_with_reads(k[rows], clusters, budget=probe_module.PROBE_BUDGET)
        error = output_error(result.out, dense_attention(k[rows], k, v, g)[0])
        assert measured(clusters) == pytest.approx(error.quantile(quantile).item(), rel=1e-6)


def test_a_local_memory_builds_and_extends_its_clusters_with_the_probes():
    k, v = (t.float() for t in _head(MIN_PROBED_KEYS + 600, scale=2.0))
    g = make_geometry("dot", D)
    memory = LocalMemory(1, D, open_segment=0, exact_while_building=0)
    memory.append(k[None, :MIN_PROBED_KEYS], v[None, :MIN_PROBED_KEYS])
    memory.attend(k[None, :4])  # builds
    built = KeyClusters.build(k[:MIN_PROBED_KEYS], v[:MIN_PROBED_KEYS], g)
    assert int(built.max_keys) < int(KeyClusters.build(k, v, g, probed_pieces=False).max_keys)
    _assert_same(memory._indexes[0], built)
    memory.append(k[None, MIN_PROBED_KEYS:], v[None, MIN_PROBED_KEYS:])
    memory.attend(k[None, :4])  # extends (and waits for it)
    whole = KeyClusters.build(k, v, g)
    assert int(memory._indexes[0].max_keys) == int(whole.max_keys)
    assert torch.equal(memory._indexes[0].order, whole.order)
    unprobed = LocalMemory(1, D, open_segment=0, probed_pieces=False)
    unprobed.append(k[None], v[None])
    unprobed.attend(k[None, :4])
    _assert_same(unprobed._indexes[0], KeyClusters.build(k, v, g, probed_pieces=False))


def test_the_service_engine_stores_probed_and_unprobed_clusters_apart(tmp_path):
    k, v = (t.float() for t in _head(MIN_PROBED_KEYS, scale=2.0))
    store = EmbeddedStore(tmp_path)
    index = {"kind": "flat", "top_k": 16, "window": 0, "sinks": 0, "budget": 0.02, "options": {}}
    info = {"id": "a", "name": "a", "geometry": {"name": "dot"}, "heads": 1, "head_dim": D,
            "value_dim": D, "dtype": "float32", "index": index}  # fmt: skip
    store.create("ns", info)
    upload = store.begin_upload("ns", "a")
    store.add_chunk("ns", "a", upload, k.numpy().tobytes() + v.numpy().tobytes(), len(k))
    record = store.commit("ns", "a", upload, 10**6)
    g = make_geometry("dot", D)
    name = f"clusters{KeyClusters.FORMAT}{{}}-v1-n{len(k)}-h0.npz"
    for probed, expected in ((True, "-probed"), (False, "")):
        engine = Engine(store, device=torch.device("cpu"), cache_bytes=1 << 30,
                        store_indexes=True, open_segment=0, probed_pieces=probed)  # fmt: skip
        loaded = engine.context("ns", record)
        engine.build_indexes(loaded, ["tail"])
        _assert_same(loaded.clusters[0], KeyClusters.build(k, v, g, probed_pieces=probed))
        assert store.get_blob("ns", "a", name.format(expected)) is not None
    # The replica without the probes built its own clusters: the two differ.
    assert int(loaded.clusters[0].max_keys) > int(KeyClusters.build(k, v, g).max_keys)


def test_the_service_reads_the_option_from_the_environment(monkeypatch):
    assert Settings().probed_pieces is True
    monkeypatch.setenv("REWA_PROBED_PIECES", "false")
    assert Settings().probed_pieces is False
