"""Attention over every composite LSH candidate in one compiled pass (index/lsh_attention.py):
the same keys and answers as the candidate sets (`build_candidates`, then `sparse_attention`
over every candidate), and the cases that go through the candidate sets instead."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from benchmarks.data import clustered
from rewa.attention import DotProduct, Euclidean, make_geometry, sparse_attention
from rewa.index import CompositeLSH, build_candidates, build_index, retrieval_attention
from rewa.index import retrieval as retrieval_module
from rewa.index.candidates import best_candidates
from rewa.index.lsh_attention import fused_lsh_applies, lsh_attention


def clustered_data(n, nq, d, seed, dtype=torch.float32):
    """`clustered` keys and values and its first `nq` queries, in `dtype`."""
    data = clustered(n, d, seed)
    return SimpleNamespace(q=data.q[:nq].to(dtype), k=data.k.to(dtype), v=data.v.to(dtype))


def by_candidate_sets(q, k, v, geometry, index, positions=None, top_k=None):
    """The reference: every candidate of `index.candidates` (or the `top_k` best), repeats
    dropped, attended by `sparse_attention`."""
    with torch.no_grad():
        found = index.candidates(geometry.witness(q))
        causal = positions is not None
        candidates = build_candidates([found], k.shape[0], positions=positions, causal=causal)
        width = max(candidates.indices.shape[-1], 1)
        return sparse_attention(q, k, v, geometry, candidates.indices, top_k or width)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bucket_limit", [3, 48])
def test_every_candidate_once_as_the_candidate_sets(dtype, bucket_limit):
    """Clustered keys collide with a query in many tables: each must count once, and only the
    `bucket_limit` keys a bucket yields (3: most buckets are cut)."""
    data = clustered_data(n=2048, nq=300, d=16, seed=3, dtype=dtype)
    geometry = DotProduct(16)
    index = build_index(data.k, geometry, "lsh", bucket_limit=bucket_limit)
    with torch.no_grad():
        out, lse = lsh_attention(data.q, data.k, data.v, geometry, index)
    expected_out, expected_lse = by_candidate_sets(data.q, data.k, data.v, geometry, index)
    tolerance = 2e-5 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(out, expected_out, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(lse, expected_lse.to(lse.dtype), rtol=tolerance, atol=tolerance)
    assert out.dtype == dtype


@pytest.mark.parametrize("top_k", [1, 16, 4000])
def test_the_best_k_candidates_as_the_candidate_sets(top_k):
    """`top_k` beyond every query's number of candidates (4000 > 64 x 48) reads them all."""
    data = clustered_data(n=2048, nq=200, d=16, seed=9)
    geometry = DotProduct(16)
    index = build_index(data.k, geometry, "lsh")
    with torch.no_grad():
        out, lse = lsh_attention(data.q, data.k, data.v, geometry, index, top_k=top_k)
    expected_out, expected_lse = by_candidate_sets(
        data.q, data.k, data.v, geometry, index, top_k=top_k
    )
    torch.testing.assert_close(out, expected_out, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(lse, expected_lse, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("k", [1, 10, 4000])
def test_search_ranks_the_candidates_as_best_candidates(k):
    """`CompositeLSH.search` by the compiled walk: the logits and keys that scoring the
    candidate sets gives, `-inf` / `-1` in the columns a query has no candidate for."""
    data = clustered_data(n=2048, nq=100, d=16, seed=10)
    geometry = DotProduct(16)
    index = build_index(data.k, geometry, "lsh")
    with torch.no_grad():
        qw = geometry.witness(data.q)
        logits, ids = index.search(qw, k)
        expected_logits, expected_ids = best_candidates(
            geometry, qw, index.keys, index.candidates(qw), k
        )
    assert logits.shape == ids.shape == (100, k)
    width = expected_ids.shape[1]
    # The same keys; their order may differ where two logits differ by a rounding.
    torch.testing.assert_close(logits[:, :width], expected_logits, rtol=2e-5, atol=2e-5)
    assert torch.equal(ids[:, :width].sort().values, expected_ids.sort().values)
    assert torch.all(ids[:, width:] == -1) and torch.isneginf(logits[:, width:]).all()


def test_causal_self_attention_drops_the_keys_after_each_query():
    data = clustered_data(n=1500, nq=1500, d=16, seed=4)
    k = data.k
    q = k + 0.1 * torch.randn_like(k)  # self-attention: query i near key i
    geometry = DotProduct(16)
    index = build_index(k, geometry, "lsh")
    positions = torch.arange(k.shape[0])
    with torch.no_grad():
        out, lse = lsh_attention(q, k, data.v, geometry, index, positions=positions)
    expected_out, expected_lse = by_candidate_sets(q, k, data.v, geometry, index, positions)
    torch.testing.assert_close(out, expected_out, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(lse, expected_lse, rtol=2e-5, atol=2e-5)
    with torch.no_grad():
        best = lsh_attention(q, k, data.v, geometry, index, top_k=8, positions=positions)
    expected = by_candidate_sets(q, k, data.v, geometry, index, positions, top_k=8)
    torch.testing.assert_close(best, expected, rtol=2e-5, atol=2e-5)
    # Query 0 may read key 0 only, if any: its answer is key 0's value or nothing.
    assert torch.isneginf(lse[0]) or torch.allclose(out[0], data.v[0], atol=1e-6)


def test_queries_with_no_candidate_answer_zero_and_minus_infinity():
    """With 16 bits per table and 40 keys most buckets are empty: queries far from every key
    share none."""
    geometry = DotProduct(8)
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(40, 8, generator=generator)
    queries = torch.randn(64, 8, generator=generator)
    index = CompositeLSH(geometry, tables=2, bits=16)
    index.add(keys)
    values = torch.randn(40, 5, generator=generator)
    with torch.no_grad():
        out, lse = lsh_attention(queries, keys, values, geometry, index)
    expected_out, expected_lse = by_candidate_sets(queries, keys, values, geometry, index)
    empty = torch.isneginf(expected_lse)
    assert 0 < empty.sum() < len(queries)  # both kinds of query are checked
    assert torch.equal(torch.isneginf(lse), empty) and torch.all(out[empty] == 0)
    torch.testing.assert_close(out, expected_out, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(lse[~empty], expected_lse[~empty], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("threads", [2, 3])
def test_the_answer_is_the_same_on_any_number_of_threads(threads):
    """The queries are split into one call per thread; a query's sums do not depend on which
    others share its call."""
    data = clustered_data(n=1024, nq=257, d=16, seed=5)
    geometry = DotProduct(16)
    index = build_index(data.k, geometry, "lsh")
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with torch.no_grad():
            alone = lsh_attention(data.q, data.k, data.v, geometry, index)
        torch.set_num_threads(threads)
        with torch.no_grad():
            split = lsh_attention(data.q, data.k, data.v, geometry, index)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(alone[0], split[0]) and torch.equal(alone[1], split[1])


def test_admitted_buckets_name_exactly_each_querys_candidates():
    data = clustered_data(n=600, nq=50, d=8, seed=6)
    geometry = DotProduct(8)
    index = build_index(data.k, geometry, "lsh", bucket_limit=4)
    with torch.no_grad():
        qw = geometry.witness(data.q)
        first, last = index.bucket_ranges(qw)
        candidates = index.candidates(qw)
    admitted = index.admitted_buckets()
    assert admitted.shape == (600, index.tables) and admitted.dtype == torch.int32
    for query in range(50):
        own = torch.where(last[query] > first[query], first[query], -2)
        named = (admitted == own.to(torch.int32)).any(dim=1).nonzero().squeeze(-1)
        listed = candidates[query][candidates[query] >= 0].unique()
        assert torch.equal(named, listed)
    # Made once and kept, then made again for keys added anew.
    assert index.admitted_buckets() is admitted
    index.add(geometry.witness(data.k[:100]))
    assert index.admitted_buckets().shape == (100, index.tables)


@pytest.mark.parametrize(
    "name, options",
    [("graded", {"variant": "queries_keys"}), ("random_features", {"features": 32})],
)
def test_other_inner_product_geometries_go_through_the_compiled_pass(name, options):
    torch.manual_seed(7)
    geometry = make_geometry(name, 16, **options)
    q, k, v = torch.randn(100, 16), torch.randn(800, 16), torch.randn(800, 16)
    index = build_index(k, geometry, "lsh")
    with torch.no_grad():
        assert fused_lsh_applies(index, geometry, q, k, v)
        out, lse = lsh_attention(q, k, v, geometry, index)
    expected_out, expected_lse = by_candidate_sets(q, k, v, geometry, index)
    torch.testing.assert_close(out, expected_out, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(lse, expected_lse, rtol=2e-5, atol=2e-5)


def test_retrieval_attention_takes_the_compiled_pass_only_where_it_applies(monkeypatch):
    """An LSH index, every candidate or a `top_k`, no window or sinks, no gradient asked: the
    compiled pass, with the candidate sets' answer. A window, a gradient or a geometry with a
    distance stage (Euclidean) go through the candidate sets."""
    data = clustered_data(n=1024, nq=64, d=16, seed=8)
    geometry = DotProduct(16)
    index = build_index(data.k, geometry, "lsh")
    calls = []
    original = retrieval_module.lsh_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(retrieval_module, "lsh_attention", counted)
    with torch.no_grad():
        out, _ = retrieval_attention(data.q, data.k, data.v, geometry, index=index)
    assert calls == [1]
    expected = by_candidate_sets(data.q, data.k, data.v, geometry, index)
    torch.testing.assert_close(out, expected[0], rtol=2e-5, atol=2e-5)
    with torch.no_grad():
        best, _ = retrieval_attention(data.q, data.k, data.v, geometry, index=index, top_k=16)
        assert calls == [1, 1]
        expected = by_candidate_sets(data.q, data.k, data.v, geometry, index, top_k=16)
        torch.testing.assert_close(best, expected[0], rtol=2e-5, atol=2e-5)
        retrieval_attention(data.q, data.k, data.v, geometry, index=index, window=8)
    q = data.q.clone().requires_grad_()
    out, _ = retrieval_attention(q, data.k, data.v, geometry, index=index)
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all() and calls == [1, 1]
    euclidean = Euclidean(16)
    euclidean_index = build_index(data.k, euclidean, "lsh")
    assert not fused_lsh_applies(euclidean_index, euclidean, data.q, data.k, data.v)
    with torch.no_grad():
        retrieval_attention(data.q, data.k, data.v, euclidean, index=euclidean_index)
    assert calls == [1, 1]
    flat = build_index(data.k, geometry, "flat")
    assert not fused_lsh_applies(flat, geometry, data.q, data.k, data.v)


def test_search_of_no_queries_and_of_half_precision_witnesses():
    data = clustered_data(n=512, nq=20, d=8, seed=11)
    geometry = DotProduct(8)
    index = build_index(data.k, geometry, "lsh")
    with torch.no_grad():
        logits, ids = index.search(torch.zeros(0, 8), 5)
        assert logits.shape == ids.shape == (0, 5)
        half_logits, half_ids = index.search(data.q.half(), 5)
        full_logits, full_ids = index.search(data.q.half().float(), 5)
    assert half_logits.dtype == torch.float32
    torch.testing.assert_close(half_logits, full_logits)
    assert torch.equal(half_ids, full_ids)
