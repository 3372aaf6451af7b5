"""Property tests over shapes, curvature signs and tilings (hypothesis)."""

import itertools
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rewa.attention import dense_attention, merge_attention
from rewa.attention import stereographic as ks
from tests import reference
from tests.support import GEOMETRY_NAMES, build_geometry

FAST = settings(max_examples=40, deadline=None)

curvatures = st.one_of(
    st.just(0.0),
    st.floats(min_value=1e-12, max_value=3.0).flatmap(lambda m: st.sampled_from([m, -m])),
)


@FAST
@given(
    name=st.sampled_from(GEOMETRY_NAMES),
    batch=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    n_queries=st.integers(1, 20),
    n_keys=st.integers(1, 20),
    value_dim=st.integers(1, 4),
    q_chunk=st.integers(1, 8),
    k_chunk=st.integers(1, 8),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_tiled_attention_equals_naive_for_any_shape_and_tiling(
    name, batch, n_queries, n_keys, value_dim, q_chunk, k_chunk, causal, seed
):
    torch.manual_seed(seed)
    g = build_geometry(name, 4)
    q = torch.randn(*batch, n_queries, 4, dtype=torch.float64)
    k = torch.randn(*batch, n_keys, 4, dtype=torch.float64)
    v = torch.randn(*batch, n_keys, value_dim, dtype=torch.float64)
    out, lse = dense_attention(q, k, v, g, causal=causal, q_chunk=q_chunk, k_chunk=k_chunk)
    allowed = None
    if causal:
        allowed = torch.ones(n_queries, n_keys, dtype=torch.bool).tril(n_keys - n_queries)
    expected_out, expected_lse = reference.dense_softmax_attention(g.logits(q, k), v, allowed)
    torch.testing.assert_close(out, expected_out, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-9, atol=1e-11)


@FAST
@given(kappa=curvatures, seed=st.integers(0, 2**16))
def test_kappa_distance_is_a_metric(kappa, seed):
    """Symmetric, zero exactly on the diagonal, and the triangle inequality, for any curvature."""
    torch.manual_seed(seed)
    k = torch.tensor(kappa, dtype=torch.float64)
    radius = 0.9 / math.sqrt(abs(kappa)) if kappa < 0 else 3.0
    x = ks.project(torch.randn(3, 12, 5, dtype=torch.float64) * radius / 3, k)
    d_xy, d_yx = ks.dist(x[0], x[1], k), ks.dist(x[1], x[0], k)
    torch.testing.assert_close(d_xy, d_yx, rtol=1e-9, atol=1e-12)
    assert ks.dist(x[0], x[0], k).abs().max() < 1e-7
    assert (d_xy <= ks.dist(x[0], x[2], k) + ks.dist(x[2], x[1], k) + 1e-9).all()


@FAST
@given(
    cuts=st.lists(st.integers(1, 29), min_size=1, max_size=4, unique=True),
    seed=st.integers(0, 2**16),
)
def test_merging_any_partition_of_the_keys_equals_the_whole(cuts, seed):
    torch.manual_seed(seed)
    g = build_geometry("poincare", 4)
    q, k = torch.randn(6, 4, dtype=torch.float64), torch.randn(30, 4, dtype=torch.float64)
    v = torch.randn(30, 2, dtype=torch.float64)
    bounds = [0, *sorted(cuts), 30]
    parts = [dense_attention(q, k[a:b], v[a:b], g) for a, b in itertools.pairwise(bounds)]
    merged_out, merged_lse = merge_attention(*reversed(parts))
    out, lse = dense_attention(q, k, v, g)
    torch.testing.assert_close(merged_out, out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(merged_lse, lse, rtol=1e-10, atol=1e-12)
