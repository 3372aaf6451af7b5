"""Causal tail attention (index/causal.py): exact where every key is read, each query sees
nothing after its position, the estimate holds on diffuse data, and the service accepts it."""

from __future__ import annotations

import pytest
import torch

from rewa.attention import dense_attention, make_geometry, merge_attention
from rewa.index import (
    KeyClusters,
    causal_tail_attention,
    output_error,
    retrieval_attention,
    tail_attention,
)
from rewa.index.causal import MIN_KEYS_READ
from rewa.index.tail.measured import measured_rows


def _diffuse(n, d=16, seed=0):
    """Broad, overlapping topics: attention spread over many keys (where tail is meant to be)."""
    generator = torch.Generator().manual_seed(seed)
    centres = torch.randn(max(1, n // 1024), d, generator=generator) * 0.5
    labels = torch.randint(len(centres), (n,), generator=generator)
    k = centres[labels] + 0.5 * torch.randn(n, d, generator=generator)
    q = (centres[labels] + 0.5 * torch.randn(n, d, generator=generator)) * 0.5
    # Values carry their topic (and noise), so outputs are far from 0 and relative errors mean
    # something.
    topic_values = torch.randn(len(centres), d, generator=generator)
    return q, k, topic_values[labels] + torch.randn(n, d, generator=generator)


@pytest.mark.parametrize("geometry", ["dot", "euclidean", "sphere"])
def test_a_full_budget_is_exact_causal_attention(geometry):
    g = make_geometry(geometry, 16)
    q, k, v = _diffuse(3000)
    positions = torch.arange(3000)
    with torch.no_grad():
        out, lse = causal_tail_attention(q, k, v, g, positions, budget=1.0, segment=700)
        expected = dense_attention(q, k, v, g, causal=True)
    torch.testing.assert_close((out, lse), expected, rtol=1e-4, atol=1e-4)


def test_measured_queries_of_each_segment_are_exact():
    # Segments of 3000 among 10,000 keys: the ones after the first read 2048 of the keys before
    # them (plain tail is not exact there). How the other rows move: tests/test_tail_measured.py.
    g = make_geometry("dot", 16)
    q, k, v = _diffuse(10_000)
    positions = torch.arange(10_000)
    with torch.no_grad():
        every = causal_tail_attention(q, k, v, g, positions, segment=3000, measured_queries=3000)
        out, _ = causal_tail_attention(q, k, v, g, positions, segment=3000, measured_queries=4)
        tail, _ = causal_tail_attention(q, k, v, g, positions, segment=3000)
        expected = dense_attention(q, k, v, g, causal=True)
    torch.testing.assert_close(every, expected, rtol=1e-4, atol=1e-4)  # every query measured
    for start, size in ((3000, 3000), (6000, 3000), (9000, 1000)):  # four of each segment
        measured = measured_rows(size, 4, q.device) + start
        torch.testing.assert_close(out[measured], expected[0][measured], rtol=1e-4, atol=1e-4)
        assert not torch.allclose(tail[measured], expected[0][measured], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[:3000], tail[:3000])  # the first segment reads itself only


@pytest.mark.parametrize("geometry", ["dot", "poincare"])
def test_every_row_in_order_reads_its_segment_causally_as_rows_out_of_order_do(geometry):
    # Rows that are their segments' positions in order take the causal block; the same rows
    # given in reverse take the masked one. Both must give the same answers.
    g = make_geometry(geometry, 16)
    q, k, v = _diffuse(2500)
    q, k = q * 0.1, k * 0.1
    positions = torch.arange(2500)
    backwards = positions.flip(0)
    with torch.no_grad():
        out, lse = causal_tail_attention(q, k, v, g, positions, segment=700)
        out_b, lse_b = causal_tail_attention(q[backwards], k, v, g, backwards, segment=700)
    torch.testing.assert_close((out, lse), (out_b.flip(0), lse_b.flip(0)), rtol=1e-5, atol=1e-5)


def test_no_query_sees_a_later_key():
    """Changing every key after a query's position leaves its answer unchanged (queries at
    scattered positions, given out of order)."""
    g = make_geometry("dot", 16)
    q, k, v = _diffuse(5000)
    positions = torch.tensor([4999, 17, 2047, 2048, 4096, 300, 3333])
    rows = q[positions]
    with torch.no_grad():
        out, lse = causal_tail_attention(rows, k, v, g, positions, segment=1024)
        for row, at in enumerate(positions.tolist()):
            k2, v2 = k.clone(), v.clone()
            k2[at + 1 :] = torch.randn_like(k2[at + 1 :]) * 10
            v2[at + 1 :] = 100.0
            again = causal_tail_attention(rows[row : row + 1], k2, v2, g, positions[row : row + 1],
                                          segment=1024)  # fmt: skip
            torch.testing.assert_close(again[0][0], out[row], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(again[1][0], lse[row], rtol=1e-5, atol=1e-5)


def test_a_segment_reads_itself_exactly_and_estimates_the_clusters_of_the_keys_before_it():
    """Queries of one segment: their own keys up to each query exactly, merged with tail
    attention over `KeyClusters` built from exactly the keys before the segment (here reached
    by extending segment by segment), at the budget or `MIN_KEYS_READ` keys."""
    g = make_geometry("dot", 16)
    q, k, v = _diffuse(20480)
    start, positions = 16384, torch.arange(16384, 20480, 97)
    with torch.no_grad():
        out, lse = causal_tail_attention(q[positions], k, v, g, positions, segment=4096)
        clusters = KeyClusters.build(k[:start], v[:start], g)
        fraction = max(0.02, MIN_KEYS_READ / start)
        earlier = tail_attention(q[positions], clusters, budget=fraction)
        own = [dense_attention(q[p : p + 1], k[start : p + 1], v[start : p + 1], g)
               for p in positions.tolist()]  # fmt: skip
        own = (torch.cat([o for o, _ in own]), torch.cat([s for _, s in own]))
        expected = merge_attention(own, earlier)
    torch.testing.assert_close((out, lse), expected, rtol=1e-5, atol=1e-5)


def test_the_estimate_is_close_on_diffuse_data_and_the_tail_helps():
    g = make_geometry("dot", 16)
    n = 24576
    q, k, v = _diffuse(n)
    positions = torch.arange(n // 2, n, 41)  # queries with at least 12k keys before them
    with torch.no_grad():
        reference, reference_lse = dense_attention(q, k, v, g, causal=True)
        out, lse = causal_tail_attention(q[positions], k, v, g, positions, segment=4096)
        exact_only, _ = causal_tail_attention(
            q[positions], k, v, g, positions, segment=4096, tail=False
        )
    error = output_error(out, reference[positions])
    assert error.median() < 0.05 and error.quantile(0.99) < 0.15
    assert output_error(exact_only, reference[positions]).median() > 2 * error.median()
    assert (lse - reference_lse[positions]).abs().median() < 0.01


@pytest.mark.parametrize(
    "reach", [{"window": 4096}, {"sinks": 4096}, {"window": 1000, "sinks": 3096}]
)
def test_sinks_and_window_before_the_segment_are_read_exactly(reach):
    """Sinks and a window that together cover every key before the segment leave nothing to
    estimate: the answer is exact, with no budget at all."""
    g = make_geometry("dot", 16)
    q, k, v = _diffuse(8192)
    positions = torch.arange(4096, 8192, 37)
    with torch.no_grad():
        reference = dense_attention(q, k, v, g, causal=True)
        out, lse = causal_tail_attention(
            q[positions], k, v, g, positions, budget=0.0, segment=4096, **reach
        )
        estimated, _ = causal_tail_attention(
            q[positions], k, v, g, positions, budget=0.0, segment=4096
        )
    torch.testing.assert_close(out, reference[0][positions], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lse, reference[1][positions], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(estimated, reference[0][positions], rtol=1e-4, atol=1e-5)


def test_gradients_reach_queries_keys_and_values():
    g = make_geometry("dot", 8)
    q, k, v = (t[:600, :8].clone().requires_grad_() for t in _diffuse(600))
    out, lse = causal_tail_attention(q, k, v, g, torch.arange(600), segment=256)
    (out.sum() + lse.sum()).backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (q, k, v))


def test_retrieval_attention_routes_causal_clusters_here():
    g = make_geometry("dot", 16)
    q, k, v = _diffuse(2000)
    with torch.no_grad():
        got = retrieval_attention(q, k, v, g, index="clusters", causal=True, tail=True)
        expected = causal_tail_attention(q, k, v, g, torch.arange(2000))
        # measured_queries goes through, causal (per segment) and not (over the clusters given).
        measured = retrieval_attention(q, k, v, g, index="clusters", causal=True, tail=True,
                                       measured_queries=8)  # fmt: skip
        measured_here = causal_tail_attention(q, k, v, g, torch.arange(2000), measured_queries=8)
        clusters = KeyClusters.build(g.witness(k), v, g)
        shrunk = retrieval_attention(q, k, v, g, index=clusters, tail=True, measured_queries=8)
        shrunk_here = tail_attention(q, clusters, budget=0.02, measured_queries=8)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(measured, measured_here)
    torch.testing.assert_close(shrunk, shrunk_here)
    assert not torch.allclose(shrunk[0], tail_attention(q, clusters, budget=0.02)[0])


def test_bad_inputs_are_refused():
    g = make_geometry("dot", 16)
    q, k, v = _diffuse(100)
    with pytest.raises(ValueError, match="positions in"):
        causal_tail_attention(q[:2], k, v, g, torch.tensor([0, 100]))
    with pytest.raises(ValueError, match="one position per query"):
        causal_tail_attention(q[:2], k, v, g, torch.tensor([0]))
    with pytest.raises(ValueError, match="segment"):
        causal_tail_attention(q[:2], k, v, g, torch.tensor([0, 1]), segment=0)
    with pytest.raises(ValueError, match="window and sinks"):
        causal_tail_attention(q[:2], k, v, g, torch.tensor([0, 1]), window=-1)
    with pytest.raises(ValueError, match="measured_queries"):
        causal_tail_attention(q[:2], k, v, g, torch.tensor([0, 1]), measured_queries=-1)
    with pytest.raises(ValueError, match="measured_queries needs"):
        retrieval_attention(q[:2], k, v, g, index="flat", measured_queries=4)
    # A geometry without an exact lift, refused whatever the context's length (one shorter
    # than a segment needs no clusters, and was answered).
    with pytest.raises(ValueError, match="no exact lift"):
        causal_tail_attention(q[:2], k, v, make_geometry("cone", 16), torch.tensor([0, 1]))
