"""Tail attention of several heads in one call (`tail_attention_heads` over `ClusterHeads`): the
same answers as one call per head, for heads with different numbers of clusters, with and
without keys read by every query, and through the fallback of a head whose shared reference
overflows; the stacked selection; and the errors of bad stacks."""

import pytest
import torch

from rewa.attention import dense_attention, make_geometry
from rewa.index import (
    ClusterHeads,
    KeyClusters,
    LocalMemory,
    tail_attention,
    tail_attention_heads,
    tail_attention_heads_with_reads,
    tail_attention_with_reads,
)
from rewa.index import tail as tail_module
from rewa.index.clusters import query_features
from rewa.index.tail import decode as decode_module
from rewa.index.tail import estimate as estimate_module
from rewa.index.tail import exact as exact_module
from rewa.index.tail import select_clusters
from rewa.index.tail import unread as unread_module
from tests.support import build_geometry

HEADS, N_KEYS, DIM, VALUE_DIM = 3, 1500, 8, 5


def _heads(geometry, dtype=torch.float64, seed=0):
    """Keys of `HEADS` heads around their own centres, clustered into pieces of different
    sizes per head (so the heads have different numbers of clusters), and queries near them."""
    generator = torch.Generator().manual_seed(seed)
    centres = torch.randn(HEADS, 12, DIM, generator=generator, dtype=dtype)
    labels = torch.randint(12, (HEADS, N_KEYS), generator=generator)
    keys = centres.gather(1, labels.unsqueeze(-1).expand(-1, -1, DIM))
    keys = keys + 0.3 * torch.randn(keys.shape, generator=generator, dtype=dtype)
    values = torch.randn(HEADS, N_KEYS, VALUE_DIM, generator=generator, dtype=dtype)
    q_labels = torch.randint(12, (HEADS, 7), generator=generator)
    queries = centres.gather(1, q_labels.unsqueeze(-1).expand(-1, -1, DIM))
    queries = 1.5 * queries + 0.3 * torch.randn(queries.shape, generator=generator, dtype=dtype)
    with torch.no_grad():
        clusters = [
            KeyClusters.build(
                geometry.witness(keys[h]), values[h], geometry, max_cluster_keys=40 + 35 * h
            )
            for h in range(HEADS)
        ]
    return queries, keys, values, clusters


@pytest.mark.parametrize("name", ["dot", "sphere", "poincare", "product"])
@pytest.mark.parametrize(
    "options",
    [{}, {"tail": False}, {"always": torch.cat([torch.arange(3), torch.arange(1450, 1500)])}],
    ids=["tail", "exact-only", "window-and-sinks"],
)
def test_heads_in_one_call_equal_one_call_per_head(name, options):
    geometry = build_geometry(name, DIM)
    queries, _, _, clusters = _heads(geometry)
    assert len({c.n_clusters for c in clusters}) == HEADS  # padding is exercised
    with torch.no_grad():
        per_head = [
            tail_attention_with_reads(queries[h], clusters[h], budget=0.05, **options)
            for h in range(HEADS)
        ]
        out, lse, keys_read = tail_attention_heads_with_reads(
            queries, ClusterHeads.stacked(clusters), budget=0.05, **options
        )
    assert out.shape == (HEADS, 7, VALUE_DIM) and lse.shape == (HEADS, 7)
    for h in range(HEADS):
        torch.testing.assert_close(out[h], per_head[h][0], rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(lse[h], per_head[h][1], rtol=1e-9, atol=1e-9)
    assert torch.equal(keys_read, torch.stack([result.keys_read for result in per_head]))
    assert (keys_read > 0).all()


@pytest.mark.parametrize("name", ["euclidean", "sphere", "poincare", "product"])
def test_the_visited_clusters_tiles_equal_their_scores(monkeypatch, name):
    # Under no_grad the exact part scores each head's visited clusters as tiles of one product
    # form over the head's rows and its visited keys gathered once (`TileLogits`); the same
    # answers as `score` per cluster, window and sink keys included.
    geometry = build_geometry(name, DIM)
    queries, _, _, clusters = _heads(geometry)
    heads = ClusterHeads.stacked(clusters)
    always = torch.cat([torch.arange(3), torch.arange(1450, 1500)])
    made = []
    tiles_of = exact_module.TileLogits.of
    monkeypatch.setattr(
        exact_module.TileLogits, "of", lambda *args: made.append(1) or tiles_of(*args)
    )
    with torch.no_grad():
        tiled = tail_attention_heads(queries, heads, budget=0.05, always=always)
        assert len(made) >= HEADS  # a product form per head, at least
        monkeypatch.setattr(exact_module.TileLogits, "of", lambda *args: None)
        scored = tail_attention_heads(queries, heads, budget=0.05, always=always)
    for got, expected in zip(tiled, scored, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["dot", "product"])
def test_the_compiled_value_shift_equals_the_products(monkeypatch, name):
    """A decode step's few queries per head take the compiled value shift (every lift of a
    product geometry, heads of different cluster counts); the numpy and PyTorch products give
    the same answers, and so does the compiled shift on one thread (the batched stages: the
    compiled decode step, which takes the dot product's, is tests/test_tail_decode.py's)."""
    monkeypatch.setattr(decode_module, "COMPILED_STEP_ROWS", 0)
    geometry = build_geometry(name, DIM)
    queries, _, _, clusters = _heads(geometry)
    assert queries.shape[1] <= unread_module.COMPILED_SHIFT_ROWS
    heads = ClusterHeads.stacked(clusters)
    compiled_calls, compiled = [], unread_module.value_shift_sums
    monkeypatch.setattr(
        unread_module, "value_shift_sums", lambda *a: compiled_calls.append(1) or compiled(*a)
    )
    with torch.no_grad():
        expected = tail_attention_heads(queries, heads, budget=0.05)
        assert compiled_calls
        previous = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one_thread = tail_attention_heads(queries, heads, budget=0.05)
        finally:
            torch.set_num_threads(previous)
        monkeypatch.setattr(unread_module, "COMPILED_SHIFT_ROWS", 0)
        by_numpy = tail_attention_heads(queries, heads, budget=0.05)
        monkeypatch.setattr(unread_module, "NUMPY_SHIFT_ROWS", 0)
        by_torch = tail_attention_heads(queries, heads, budget=0.05)
    assert len(compiled_calls) == 2
    for found in (one_thread, by_numpy, by_torch):
        torch.testing.assert_close(found[0], expected[0], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(found[1], expected[1], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", ["poincare", "dot"])
def test_a_head_whose_reference_overflows_is_redone_alone(monkeypatch, name):
    """The shared-reference loop covers every head; a head with a query whose sums overflow
    (its reference pushed 800 nats below its logits) goes through the general path alone and
    still gives the exact answer, the other heads keep theirs. The dot product's compiled loop
    keeps each query's largest logit as its reference, so no head is redone there."""
    geometry = make_geometry(name, DIM).double()
    queries, _, _, clusters = _heads(geometry)
    heads = ClusterHeads.stacked(clusters)
    with torch.no_grad():
        expected = tail_attention_heads(queries, heads, budget=0.05)
        redone = []
        original_reference = tail_module._largest_logit_estimate
        original_visited = exact_module._visited_attention

        def far_reference(*args):
            reference = original_reference(*args).clone()
            reference[7:14] -= 800.0  # head 1's queries: exp overflows float64
            return reference

        def visited(*args, **kwargs):
            redone.append(args[1])
            return original_visited(*args, **kwargs)

        monkeypatch.setattr(tail_module, "_largest_logit_estimate", far_reference)
        monkeypatch.setattr(exact_module, "_visited_attention", visited)
        out, lse = tail_attention_heads(queries, heads, budget=0.05)
    if name == "dot":
        assert not redone
    else:
        assert redone and all(clusters_redone is clusters[1] for clusters_redone in redone)
    torch.testing.assert_close(out, expected[0], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(lse, expected[1], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_compiled_estimate_equals_pytorchs(dtype, monkeypatch):
    """The dot product's estimate with its element-wise part compiled (`kernel.
    dot_product_estimate`) against the PyTorch operations it replaces, over stacked heads with
    padding, for queries whose tilt the clusters' radius caps and for queries it does not."""
    geometry = make_geometry("dot", DIM).to(dtype)
    queries, _, _, clusters = _heads(geometry, dtype)
    heads = ClusterHeads.stacked(clusters)
    queries = torch.cat([queries, 8 * queries], dim=1)  # the sharp ones are capped
    witnesses = geometry.witness(queries)
    with torch.no_grad():
        assert estimate_module._fused_applies(witnesses, geometry, _features(geometry, witnesses))
        compiled = estimate_module.estimate_clusters(witnesses, heads)
        monkeypatch.setattr(estimate_module, "_fused_applies", lambda *arguments: False)
        expected = estimate_module.estimate_clusters(witnesses, heads)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-12
    for found, wanted in (
        (compiled.log_mass, expected.log_mass),
        (compiled.floor, expected.floor),
        (compiled.shift_terms[0][0], expected.shift_terms[0][0]),
    ):
        assert found.dtype == dtype
        torch.testing.assert_close(found, wanted, rtol=tolerance, atol=tolerance)
    assert torch.equal(compiled.shift_terms[0][1], expected.shift_terms[0][1])
    # Both kinds of tilt occur among the real clusters: slope = scale (uncapped) and below.
    slope, scale = expected.shift_terms[0][0], float(geometry.scale)
    real = heads.counts.unsqueeze(1).expand_as(slope) > 0
    assert (slope[real] < 0.99 * scale).any() and (slope[real] > 0.999 * scale).any()
    assert torch.isneginf(compiled.log_mass[~real]).all()


def test_the_estimate_stays_differentiable_with_autograd_on():
    geometry = make_geometry("dot", DIM).double()
    queries, _, _, clusters = _heads(geometry)
    witnesses = geometry.witness(queries).requires_grad_()
    heads = ClusterHeads.stacked(clusters)
    assert not estimate_module._fused_applies(witnesses, geometry, _features(geometry, witnesses))
    estimate = estimate_module.estimate_clusters(witnesses, heads)
    real = heads.counts.unsqueeze(1).expand_as(estimate.log_mass) > 0
    (grad,) = torch.autograd.grad(estimate.log_mass[real].sum(), witnesses)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0


def _features(geometry, witnesses):
    return query_features(geometry.lift(witnesses, "query"))


def test_stacked_selection_equals_the_selection_of_each_head():
    geometry = make_geometry("dot", DIM).double()
    queries, _, _, clusters = _heads(geometry)
    heads = ClusterHeads.stacked(clusters)
    # Flag a different number of clusters per head as read by every query.
    exact_read = heads.exact_read.clone()
    exact_read[0, :2] = True
    exact_read[2, 5] = True
    with torch.no_grad():
        estimate = tail_module.estimate_clusters(geometry.witness(queries), heads)
    rows = estimate.rows()
    n_queries = queries.shape[1]
    counts = heads.counts.unsqueeze(1).expand(-1, n_queries, -1).flatten(0, 1)
    flags = exact_read.unsqueeze(1).expand(-1, n_queries, -1).flatten(0, 1)
    # 60 keys: some heads' most massive clusters alone exceed it (read anyway, and then no
    # flagged one fits). The second budget holds each most massive cluster and every flagged
    # one: every query reads them all. Each head's queries look as far down the estimate as in
    # a selection of their own (their head's average cluster size), so both equal one head's.
    holding = float(heads.counts.max() + (heads.counts * exact_read).sum(1).max())
    for budget in (60, holding):
        pair_row, pair_cluster = select_clusters(rows.log_mass, counts, budget, flags)
        for h, head_clusters in enumerate(clusters):
            n = head_clusters.n_clusters
            expected = select_clusters(
                estimate.log_mass[h, :, :n], heads.counts[h, :n], budget, exact_read[h, :n]
            )
            mine = (pair_row // n_queries) == h
            assert torch.equal(pair_row[mine] - h * n_queries, expected[0])
            assert torch.equal(pair_cluster[mine], expected[1])
            assert (pair_cluster[mine] < n).all()  # padding is never selected
            if budget == holding:
                read = exact_read[h, pair_cluster[mine]].sum()
                assert read == int(exact_read[h].sum()) * n_queries


def test_stacking_pads_with_empty_clusters_and_one_head_is_views():
    geometry = make_geometry("dot", DIM).double()
    _, _, _, clusters = _heads(geometry)
    heads = ClusterHeads.stacked(clusters)
    width = max(c.n_clusters for c in clusters)
    assert heads.n_clusters == width and heads.head_clusters == [c.n_clusters for c in clusters]
    for h, head_clusters in enumerate(clusters):
        n = head_clusters.n_clusters
        assert torch.equal(heads.counts[h, :n], head_clusters.counts)
        assert (heads.counts[h, n:] == 0).all() and not heads.exact_read[h, n:].any()
        assert torch.equal(heads.factor_by_rank[h, :, :, :n], head_clusters.factor.permute(1, 2, 0))
    assert heads.nbytes > 0
    one = ClusterHeads.stacked(clusters[:1])
    assert one.nbytes == 0 and one.mean.data_ptr() == clusters[0].mean.data_ptr()


def test_bad_stacks_and_queries_are_refused():
    geometry = make_geometry("dot", DIM).double()
    queries, keys, values, clusters = _heads(geometry)
    with pytest.raises(ValueError, match="at least one head"):
        ClusterHeads.stacked([])
    other = make_geometry("dot", DIM).double()
    with torch.no_grad():
        foreign = KeyClusters.build(other.witness(keys[0]), values[0], other)
        shorter = KeyClusters.build(geometry.witness(keys[0, :900]), values[0, :900], geometry)
    with pytest.raises(ValueError, match="one geometry"):
        ClusterHeads.stacked([clusters[0], foreign])
    with pytest.raises(ValueError, match="not one n"):
        ClusterHeads.stacked([clusters[0], shorter])
    heads = ClusterHeads.stacked(clusters)
    with pytest.raises(ValueError, match=r"expected queries \(3, nq, 8\)"):
        tail_attention_heads(queries[:2], heads)
    with pytest.raises(ValueError, match=r"expected queries \(3, nq, 8\)"):
        tail_attention_heads(queries[0], heads)
    with pytest.raises(ValueError, match="budget"):
        tail_attention_heads(queries, heads, budget=2.0)


def test_local_memory_attends_every_head_in_one_call(monkeypatch):
    """`LocalMemory` in tail mode answers through one `tail_attention_heads` call per attend,
    equal to a call per head over each head's clusters."""
    geometry = make_geometry("dot", DIM)
    queries, keys, values, _ = _heads(geometry, dtype=torch.float32)
    memory = LocalMemory(HEADS, DIM, value_dim=VALUE_DIM, mode="tail", budget=0.05,
                         open_segment=0)  # fmt: skip
    memory.append(keys, values)
    calls = []
    original = tail_module.tail_attention_heads

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr("rewa.index.memory.tail_attention_heads", counted)
    out, lse = memory.attend(queries)
    assert calls == [queries.shape]
    clusters = memory._indexes
    for h in range(HEADS):
        expected = tail_attention(queries[h], clusters[h], budget=0.05)
        torch.testing.assert_close(out[h], expected[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse[h], expected[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["dot", "sphere"])
def test_heads_reading_every_cluster_are_dense_attention(name):
    """At a budget of every key, each head's answer is dense attention over its keys, the
    clusters every query reads (the outliers, visited apart from the others) included."""
    geometry = build_geometry(name, DIM)
    queries, keys, values, clusters = _heads(geometry)
    assert any(c.exact_read.any() for c in clusters)
    with torch.no_grad():
        out, lse = tail_attention_heads(queries, ClusterHeads.stacked(clusters), budget=1.0)
        expected_out, expected_lse = dense_attention(queries, keys, values, geometry)
    torch.testing.assert_close(out, expected_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("tail", [True, False])
def test_no_queries_give_empty_answers_per_head(tail):
    g = make_geometry("dot", 8)
    heads = ClusterHeads.stacked([
        KeyClusters.build(g.witness(torch.randn(300, 8)), torch.randn(300, 5), g) for _ in range(2)
    ])  # fmt: skip
    q = torch.randn(2, 0, 8, requires_grad=True)
    out, lse, reads = tail_attention_heads_with_reads(q, heads, tail=tail)
    assert out.shape == (2, 0, 5) and lse.shape == (2, 0) and reads.shape == (2, 0)
    (out.sum() + lse.sum()).backward()
    assert q.grad.shape == q.shape
