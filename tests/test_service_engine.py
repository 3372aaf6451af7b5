"""The engine in-process: the LRU cache under its memory budget, indexes built once per
context version and shared through the store, and the device choice."""

from __future__ import annotations

import threading

import pytest
import torch

from rewa.attention import dense_attention, make_geometry, merge_attention
from rewa.index import OPEN_SEGMENT, KeyClusters, retrieval_attention, tail_attention
from rewa.index.tail.decode import COMPILED_STEP_ROWS
from rewa.service import engine as engine_module
from rewa.service.embedded_store import EmbeddedStore
from rewa.service.engine import AttendParams, Engine, intra_op_threads, resolve_device

H, N, D = 2, 600, 8
SEGMENT = 256  # the indexes hold the first 512 of the N keys; the other 88 are read exactly


def _committed_record(store, name, seed, geometry=None, kind="flat", options=None):
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(H, N, D, generator=generator)
    values = torch.randn(H, N, D, generator=generator)
    index = {
        "kind": kind,
        "top_k": 16,
        "window": 0,
        "sinks": 0,
        "budget": 0.1,
        "options": options or {},
    }
    info = {
        "id": name,
        "name": name,
        "geometry": geometry or {"name": "dot"},
        "heads": H,
        "head_dim": D,
        "value_dim": D,
        "dtype": "float32",
        "index": index,
    }
    store.create("ns", info)
    upload = store.begin_upload("ns", name)
    store.add_chunk("ns", name, upload, keys.numpy().tobytes() + values.numpy().tobytes(), N)
    return store.commit("ns", name, upload, 10**6)


def _engine(store, cache_bytes=1 << 30, store_indexes=False, **options) -> Engine:
    """An engine whose attends wait for their index's build (unless `exact_while_building`
    says otherwise), so that answers do not depend on when a build ends."""
    options = {"open_segment": SEGMENT, "exact_while_building": 0, **options}
    return Engine(store, device=torch.device("cpu"), cache_bytes=cache_bytes,
                  store_indexes=store_indexes, **options)  # fmt: skip


def test_the_cache_evicts_the_least_recently_used_context_over_budget():
    store = EmbeddedStore()
    first, second = _committed_record(store, "a", 1), _committed_record(store, "b", 2)
    one_context = 2 * H * N * D * 4
    engine = _engine(store, cache_bytes=one_context)
    loaded = engine.context("ns", first)
    assert engine.context("ns", first) is loaded  # a hit
    engine.context("ns", second)
    assert engine.cached_bytes() == one_context  # "a" was evicted
    assert engine.context("ns", first) is not loaded  # loaded again


def test_clusters_are_built_once_and_shared_through_the_store(tmp_path):
    store = EmbeddedStore(tmp_path)
    record = _committed_record(store, "a", 3)
    params = AttendParams(mode="tail", top_k=16, budget=0.1, window=0, sinks=0)
    queries = torch.randn(H, 4, D)
    engine = _engine(store, store_indexes=True)
    result = engine.attend(engine.context("ns", record), queries, params)
    name = f"clusters{KeyClusters.FORMAT}-probed-v1-n512-h0.npz"  # the default: probed pieces
    assert store.get_blob("ns", "a", name) is not None
    # Another replica on the same store loads the clusters instead of rebuilding them.
    other = _engine(EmbeddedStore(tmp_path), store_indexes=True)
    loaded = other.context("ns", record)
    other.build_indexes(loaded, ["tail"])
    clusters, original = loaded.clusters, engine.context("ns", record).clusters
    for mine, theirs in zip(clusters, original, strict=True):
        assert torch.equal(mine.order, theirs.order)
    again = other.attend(loaded, queries, params)
    torch.testing.assert_close(again["out"], result["out"])
    torch.testing.assert_close(again["lse"], result["lse"])


def test_intra_op_threads_are_set_inside_the_block_and_restored_after_it():
    before = torch.get_num_threads()
    with intra_op_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError, match="inside"), intra_op_threads(1):
        raise RuntimeError("inside")
    assert torch.get_num_threads() == before
    with intra_op_threads(0):  # 0: the setting as it is
        assert torch.get_num_threads() == before


@pytest.mark.parametrize(
    ("mode", "n_queries"), [("tail", 3), ("tail", COMPILED_STEP_ROWS + 1), ("topk", 3)]
)
def test_sparse_attention_runs_on_sparse_threads_and_builds_on_one_thread(
    monkeypatch, mode, n_queries
):
    """An attend's sparse call runs on `sparse_threads` (a decode step's compiled tail
    attention, a few queries per head, on the caller's setting), the index it waits for is
    built on the build thread, which runs PyTorch on one thread (`background_threads`); the
    caller's setting is restored."""
    store = EmbeddedStore()
    record = _committed_record(store, "a", 5)
    params = AttendParams(mode=mode, top_k=16, budget=0.1, window=0, sinks=0)
    queries = torch.randn(H, n_queries, D)
    before = 2  # set below, so that it differs from sparse_threads on any machine
    seen = {"attention": [], "clusters": [], "index": []}

    def spy(name, function):
        def wrapped(*args, **kwargs):
            seen[name].append(torch.get_num_threads())
            return function(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(engine_module, "retrieval_attention", spy("attention", retrieval_attention))
    monkeypatch.setattr(
        engine_module, "tail_attention_heads", spy("attention", engine_module.tail_attention_heads)
    )
    monkeypatch.setattr(KeyClusters, "build", spy("clusters", KeyClusters.build))
    monkeypatch.setattr(engine_module, "build_index", spy("index", engine_module.build_index))
    reference = _engine(store)
    expected = reference.attend(reference.context("ns", record), queries, params)
    for name in seen:
        seen[name].clear()
    engine = _engine(store, sparse_threads=1)
    with intra_op_threads(before):
        result = engine.attend(engine.context("ns", record), queries, params)
        assert torch.get_num_threads() == before
    # Tail attention takes every head in one call, top-K one head per call.
    step = mode == "tail" and n_queries <= COMPILED_STEP_ROWS
    assert seen["attention"] == [before if step else 1] * (1 if mode == "tail" else H)
    built = seen["clusters"] if mode == "tail" else seen["index"]
    assert built == [1] * H
    torch.testing.assert_close(result["out"], expected["out"])
    torch.testing.assert_close(result["lse"], expected["lse"])


def test_the_device_is_cuda_only_when_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize(
    ("geometry", "kind", "options"),
    [
        ({"name": "dot"}, "ivf", {"nlist": 8}),
        ({"name": "poincare"}, "hnsw", {}),
        ({"name": "product"}, "lsh", {"tables": 8}),
        ({"name": "euclidean"}, "lsh", {"tables": 8}),
        ({"name": "cone", "kind": "umbral"}, "flat", {"bands": 3}),
    ],
)
def test_search_indexes_are_built_once_and_shared_through_the_store(
    tmp_path, monkeypatch, geometry, kind, options
):
    store = EmbeddedStore(tmp_path)
    record = _committed_record(store, "a", 4, geometry, kind, options)
    params = AttendParams(mode="topk", top_k=16, budget=0.1, window=0, sinks=0)
    queries = torch.randn(H, 5, D)
    engine = _engine(store, store_indexes=True)
    result = engine.attend(engine.context("ns", record), queries, params)
    found = engine.search(engine.context("ns", record), queries, 8, exact=False)
    blob = store.get_blob("ns", "a", f"{kind}-v1-n512-h1.npz")
    assert blob is not None
    other = _engine(EmbeddedStore(tmp_path), store_indexes=True)
    built = []
    monkeypatch.setattr("rewa.service.engine.build_index", lambda *a, **k: built.append(a))
    loaded = other.context("ns", record)
    again = other.attend(loaded, queries, params)
    found_again = other.search(loaded, queries, 8, exact=False)
    assert built == []  # loaded from the store, not rebuilt
    torch.testing.assert_close(again["out"], result["out"])
    torch.testing.assert_close(again["lse"], result["lse"])
    assert torch.equal(found_again["ids"], found["ids"])


def test_appends_extend_the_cached_version_with_the_answers_of_a_fresh_load():
    """Single-token commits: each new version is made from the cached one (buffers appended;
    the indexes passed on while the open segment of the default 2048 tokens fills, extended when
    it fills at 4096 keys, across a retraining) and answers exactly as a version loaded and
    indexed from scratch."""
    store = EmbeddedStore()
    generator = torch.Generator().manual_seed(5)
    n0, appends = 4090, 10
    keys = torch.randn(H, n0 + appends, D, generator=generator)
    values = torch.randn(H, n0 + appends, D, generator=generator)
    info = {"id": "grow", "name": None, "geometry": {"name": "dot"}, "heads": H, "head_dim": D,
            "value_dim": D, "dtype": "float32",
            "index": {"kind": "ivf", "top_k": 16, "window": 0, "sinks": 0, "budget": 0.05,
                      "options": {}}}  # fmt: skip
    store.create("ns", info)

    def commit(start, stop):
        upload = store.begin_upload("ns", "grow")
        data = keys[:, start:stop].numpy().tobytes() + values[:, start:stop].numpy().tobytes()
        store.add_chunk("ns", "grow", upload, data, stop - start)
        return store.commit("ns", "grow", upload, 10**6)

    engine = _engine(store, open_segment=OPEN_SEGMENT)
    queries = torch.randn(H, 5, D, generator=generator)
    every_mode = [
        AttendParams(mode=mode, top_k=16, budget=0.05, window=0, sinks=0, return_topk=4)
        for mode in ("tail", "topk", "exact")
    ]
    record = commit(0, n0)
    for params in every_mode:
        engine.attend(engine.context("ns", record), queries, params)
    earlier = engine.context("ns", record)
    for n in range(n0, n0 + appends):
        record = commit(n, n + 1)
        loaded = engine.context("ns", record)
        assert loaded.sealed == (2048 if n + 1 < 4096 else 4096)
        passed_on = loaded.sealed == earlier.sealed
        if passed_on:
            assert loaded.clusters is earlier.clusters
            assert loaded.search_indexes["ivf"] is earlier.search_indexes["ivf"]
        else:  # extended by this version's build, the earlier version's answering meanwhile
            assert loaded.clusters is None and "ivf" not in loaded.search_indexes
            assert loaded.earlier is earlier
        engine.build_indexes(loaded, ["tail", "topk"])
        assert not loaded.builds if passed_on else set(loaded.builds) == {"tail", "topk"}
        assert (loaded.clusters is earlier.clusters) == passed_on
        assert loaded.earlier is None  # every index built: the earlier version is let go
        earlier = loaded
        assert [key[2] for key in engine._cache] == [record["version"]]
        torch.testing.assert_close(loaded.keys, keys[:, : n + 1], rtol=0, atol=0)
        fresh = _engine(store, open_segment=OPEN_SEGMENT)
        for params in every_mode:
            got = engine.attend(loaded, queries, params)
            expected = fresh.attend(fresh.context("ns", record), queries, params)
            assert torch.equal(got["ids"], expected["ids"]), (n, params.mode)
            for name in ("out", "lse", "weights"):
                torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6)


def test_an_append_after_the_cached_version_was_evicted_loads_afresh():
    store = EmbeddedStore()
    record = _committed_record(store, "a", 7)
    engine = _engine(store)
    engine.context("ns", record)
    engine.forget("ns", "a")
    upload = store.begin_upload("ns", "a")
    store.add_chunk("ns", "a", upload, torch.ones(2 * H * D).numpy().tobytes(), 1)
    record = store.commit("ns", "a", upload, 10**6)
    loaded = engine.context("ns", record)
    assert loaded.n_tokens == N + 1 and loaded.clusters is None
    assert torch.equal(loaded.keys[:, -1], torch.ones(H, D))


def test_the_open_segment_is_read_exactly_and_merged_with_the_indexed_keys():
    """The indexes hold the first 512 keys (two segments of 256); every query reads the other
    88 exactly. Tail and topk equal the library over the sealed keys merged with dense
    attention over the rest; topk reading every sealed key (k >= 512) is dense attention, causal
    rows on both sides of the seal included; return_topk ranks the open segment's keys too."""
    store = EmbeddedStore()
    record = _committed_record(store, "a", 11)
    generator = torch.Generator().manual_seed(12)
    keys, values = _stored(store, record)
    geometry = make_geometry("dot", D)
    queries = torch.randn(H, 4, D, generator=generator)
    engine = _engine(store)
    loaded = engine.context("ns", record)
    assert loaded.sealed == 512
    recent = dense_attention(queries, keys[:, 512:], values[:, 512:], geometry)
    tail = AttendParams(mode="tail", top_k=16, budget=0.1, window=0, sinks=0)
    got = engine.attend(loaded, queries, tail)
    for head in range(H):
        clusters = KeyClusters.build(geometry.witness(keys[head, :512]), values[head, :512],
                                     geometry)  # fmt: skip
        expected = merge_attention(
            tail_attention(queries[head], clusters, budget=0.1),
            (recent[0][head], recent[1][head]),
        )
        torch.testing.assert_close(got["out"][head], expected[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["lse"][head], expected[1], rtol=1e-5, atol=1e-6)
    every = AttendParams(mode="topk", top_k=1024, budget=0.1, window=0, sinks=0, return_topk=5)
    got = engine.attend(loaded, queries, every)
    dense = dense_attention(queries, keys, values, geometry)
    torch.testing.assert_close(got["out"], dense[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["lse"], dense[1], rtol=1e-5, atol=1e-6)
    best = (queries @ keys.transpose(1, 2)).topk(5)
    assert (best.indices >= 512).any()  # the open segment's keys are among the best
    assert torch.equal(got["ids"], best.indices)
    rows = torch.arange(500, 530)  # 12 rows before the seal, 18 after
    got = engine.attend(loaded, keys[:, rows], every, positions=rows, causal=True)
    causal = dense_attention(keys[:, rows], keys[:, :530], values[:, :530], geometry, causal=True)
    torch.testing.assert_close(got["out"], causal[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["lse"], causal[1], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="segment"):
        _engine(store, open_segment=-1)


def _stored(store, record) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of a committed record, as the engine reads them."""
    loaded = _engine(store, open_segment=0).context("ns", record)
    return loaded.keys, loaded.values


def _held_builds(monkeypatch) -> threading.Event:
    """Make every index build of the engine wait until the returned event is set."""
    release = threading.Event()
    for name in ("_build_clusters", "_build_search", "_extend"):
        original = getattr(Engine, name)

        def held(self, *args, _original=original):
            assert release.wait(30), "the test never released the build"
            return _original(self, *args)

        monkeypatch.setattr(Engine, name, held)
    return release


def test_an_attend_does_not_wait_for_a_build_it_reads_what_is_not_indexed_exactly(monkeypatch):
    """While a fresh version's index is being built, a small attend reads every key exactly;
    once built, the index answers. The index state says which modes are being built."""
    store = EmbeddedStore()
    record = _committed_record(store, "a", 21)
    keys, values = _stored(store, record)
    geometry = make_geometry("dot", D)
    queries = torch.randn(H, 4, D, generator=torch.Generator().manual_seed(22))
    release = _held_builds(monkeypatch)
    engine = _engine(store, exact_while_building=H * 4 * N)
    loaded = engine.context("ns", record)
    for mode in ("tail", "topk"):
        params = AttendParams(mode=mode, top_k=16, budget=0.1, window=0, sinks=0, return_topk=3)
        got = engine.attend(loaded, queries, params)
        dense = dense_attention(queries, keys, values, geometry)
        torch.testing.assert_close(got["out"], dense[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["lse"], dense[1], rtol=1e-5, atol=1e-6)
        assert torch.equal(got["ids"], (queries @ keys.transpose(1, 2)).topk(3).indices)
    state = engine.index_state("ns", record)
    assert state["built"] == [] and state["building"] == ["tail", "topk"]
    release.set()
    engine.build_indexes(loaded, ["tail", "topk"])
    assert engine.index_state("ns", record)["built"] == ["tail", "topk"]
    tail = AttendParams(mode="tail", top_k=16, budget=0.1, window=0, sinks=0)
    got = engine.attend(loaded, queries, tail)
    expected = _engine(store).attend(_engine(store).context("ns", record), queries, tail)
    torch.testing.assert_close(got["out"], expected["out"], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got["out"], dense_attention(queries, keys, values, geometry)[0])


def test_while_a_filled_segment_is_indexed_the_earlier_index_answers(monkeypatch):
    """A commit that fills a segment: until the new version's index is extended, its attends
    read the earlier version's index over the keys it holds and the rest exactly; an attend
    whose exact part would exceed `exact_while_building` waits for the extension instead."""
    store = EmbeddedStore()
    record = _committed_record(store, "a", 23)  # 600 keys: 512 indexed
    geometry = make_geometry("dot", D)
    queries = torch.randn(H, 4, D, generator=torch.Generator().manual_seed(24))
    engine = _engine(store, exact_while_building=H * 4 * 300)
    params = AttendParams(mode="tail", top_k=16, budget=0.1, window=0, sinks=0)
    earlier = engine.context("ns", record)
    engine.build_indexes(earlier, ["tail"])
    upload = store.begin_upload("ns", "a")
    extra = torch.randn(2, H, 200, D, generator=torch.Generator().manual_seed(25)).numpy()
    store.add_chunk("ns", "a", upload, extra[0].tobytes() + extra[1].tobytes(), 200)
    record = store.commit("ns", "a", upload, 10**6)
    release = _held_builds(monkeypatch)
    loaded = engine.context("ns", record)
    assert (earlier.sealed, loaded.sealed) == (512, 768) and loaded.earlier is earlier
    got = engine.attend(loaded, queries, params)
    recent = dense_attention(queries, loaded.keys[:, 512:], loaded.values[:, 512:], geometry)
    for head in range(H):
        expected = merge_attention(
            tail_attention(queries[head], earlier.clusters[head], budget=0.1),
            (recent[0][head], recent[1][head]),
        )
        torch.testing.assert_close(got["out"][head], expected[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["lse"][head], expected[1], rtol=1e-5, atol=1e-6)
    assert loaded.clusters is None
    # 16 queries per head would read 288 keys exactly: more pairs than allowed, so it waits.
    threading.Timer(0.2, release.set).start()
    many = torch.randn(H, 16, D, generator=torch.Generator().manual_seed(26))
    got = engine.attend(loaded, many, params)
    assert loaded.clusters is not None and loaded.earlier is None
    fresh = _engine(store)
    expected = fresh.attend(fresh.context("ns", record), many, params)
    torch.testing.assert_close(got["out"], expected["out"], rtol=1e-5, atol=1e-6)


def test_a_failed_build_is_reported_by_the_next_attend_and_started_again(monkeypatch):
    store = EmbeddedStore()
    record = _committed_record(store, "a", 27)
    engine = _engine(store, exact_while_building=1 << 30)
    loaded = engine.context("ns", record)
    queries = torch.randn(H, 4, D)
    params = AttendParams(mode="topk", top_k=16, budget=0.1, window=0, sinks=0)

    def broken(*_):
        raise RuntimeError("the device fell over")

    original = Engine._build_search
    monkeypatch.setattr(Engine, "_build_search", broken)
    (build,) = engine.start_builds(loaded, ["topk"])
    with pytest.raises(RuntimeError, match="fell over"):
        build.result()
    with pytest.raises(RuntimeError, match="fell over"):
        engine.attend(loaded, queries, params)
    monkeypatch.setattr(Engine, "_build_search", original)
    engine.attend(loaded, queries, params)  # starts the build again
    engine.build_indexes(loaded, ["topk"])
    assert engine.index_state("ns", record)["built"] == ["topk"]
    with pytest.raises(ValueError, match="exact_while_building"):
        _engine(store, exact_while_building=-1)
