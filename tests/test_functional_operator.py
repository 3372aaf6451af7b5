"""Random-feature (functional) and operator attention (docs/mathematics.md 4) against direct float64
implementations of their formulas; exact lifts; sparse == dense; gradients; the Hoeffding bound
of random features; low-rank Hilbert-Schmidt distances equal full ones."""

from __future__ import annotations

import math

import pytest
import torch

from rewa.attention import (
    Operator,
    RandomFeatures,
    dense_attention,
    make_geometry,
    path_score,
    path_score_low_rank,
    sparse_attention,
)
from rewa.attention.geometry import lift_similarity
from rewa.index import KeyClusters, tail_attention

DIM = 6


def _data(n_queries=5, n_keys=40, dim=DIM, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(n_queries, dim, generator=generator, dtype=torch.float64)
    k = torch.randn(n_keys, dim, generator=generator, dtype=torch.float64)
    v = torch.randn(n_keys, 3, generator=generator, dtype=torch.float64)
    return q, k, v


GEOMETRIES = {
    "random_features": lambda: RandomFeatures(DIM, features=64, sigma=1.5, tau_init=0.2),
    "operator": lambda: Operator(DIM, m=4, tau_init=2.0),
    "operator_low_rank": lambda: Operator(DIM, m=5, rank=2, tau_init=2.0),
}


def test_random_feature_logits_follow_the_formula():
    g = RandomFeatures(DIM, features=10, sigma=0.7, tau_init=0.3).double()
    q, k, _ = _data()
    omega = g.frequencies.double()
    tau = g.temperature().item()
    assert abs(tau - 0.3) < 1e-6
    expected = torch.zeros(q.shape[0], k.shape[0], dtype=torch.float64)
    for i in range(q.shape[0]):
        for j in range(k.shape[0]):
            total = 0.0
            for w in omega:
                total += math.cos(w @ q[i]) * math.cos(w @ k[j])
                total += math.sin(w @ q[i]) * math.sin(w @ k[j])
            expected[i, j] = (2 / 10) * total / tau
    torch.testing.assert_close(g.logits(q, k), expected, rtol=1e-10, atol=1e-10)
    # The frequencies are N(0, sigma^-2 I).
    wide = RandomFeatures(DIM, features=20000, sigma=0.5)
    assert abs(wide.frequencies.std().item() - 2.0) < 0.05


def test_random_features_satisfy_the_hoeffding_bound():
    features, pairs, sigma = 4096, 10_000, 1.0
    g = RandomFeatures(4, features=features, sigma=sigma).double()
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(pairs, 4, generator=generator, dtype=torch.float64) * 0.6
    y = x + torch.randn(pairs, 4, generator=generator, dtype=torch.float64) * 0.6
    estimate = (g.witness(x) * g.witness(y)).sum(-1)
    kernel = torch.exp(-(x - y).square().sum(-1) / (2 * sigma**2))
    error = (estimate - kernel).abs()
    for threshold in (0.03, 0.05, 0.08):
        bound = 2 * math.exp(-features * threshold**2 / 4)
        assert (error > threshold).double().mean().item() <= bound, threshold
    assert error.mean() < 0.03  # and the estimate is close on average


def test_operator_logits_follow_the_formula():
    g = Operator(DIM, m=3, tau_init=1.5).double()
    q, k, _ = _data()
    projection = g.projection.detach()
    tau = g.temperature().item()
    expected = torch.zeros(q.shape[0], k.shape[0], dtype=torch.float64)
    for i in range(q.shape[0]):
        a_q = (projection @ q[i]).reshape(3, 3)
        for j in range(k.shape[0]):
            a_k = (projection @ k[j]).reshape(3, 3)
            expected[i, j] = -(torch.linalg.matrix_norm(a_q - a_k, "fro") ** 2) / tau
    torch.testing.assert_close(g.logits(q, k), expected, rtol=1e-10, atol=1e-10)


def test_low_rank_hilbert_schmidt_distance_equals_the_full_one():
    g = Operator(DIM, m=7, rank=3).double()
    q, k, _ = _data()
    qw, kw = g.witness(q), g.witness(k)
    a_q, a_k = g.operators(qw), g.operators(kw)  # (n, 7, 7), built here for the check only
    full = (a_q.unsqueeze(1) - a_k.unsqueeze(0)).square().sum((-1, -2))
    torch.testing.assert_close(g.squared_distance_matrix(qw, kw), full, rtol=1e-10, atol=1e-10)
    gathered = kw[torch.arange(40).reshape(5, 8)]
    torch.testing.assert_close(
        g.score_at(qw, gathered), g.score(qw, kw).gather(-1, torch.arange(40).reshape(5, 8))
    )
    torch.testing.assert_close(g.distance(qw[0], kw[3]), full[0, 3].sqrt())


def test_path_scores_low_rank_equal_full():
    generator = torch.Generator().manual_seed(4)
    u1, v1, u2, v2 = (torch.randn(5, 2, generator=generator, dtype=torch.float64) for _ in "1234")
    relations = [torch.randn(5, 5, generator=generator, dtype=torch.float64) for _ in range(3)]
    a1, a2 = u1 @ v1.T, u2 @ v2.T
    full = path_score(a1, relations, a2)
    expected = torch.trace(a1 @ relations[0] @ relations[1] @ relations[2] @ a2.T)
    torch.testing.assert_close(full, expected)
    torch.testing.assert_close(path_score_low_rank((u1, v1), relations, (u2, v2)), expected)
    # No hop: the HS inner product.
    torch.testing.assert_close(path_score(a1, [], a2), (a1 * a2).sum())


@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_lifts_are_exact(name):
    g = GEOMETRIES[name]().double()
    q, k, _ = _data()
    qw, kw = g.witness(q), g.witness(k)
    (query_lift,), (key_lift,) = g.lift(qw, "query"), g.lift(kw, "key")
    similarity = lift_similarity(query_lift, key_lift)
    torch.testing.assert_close(
        sum(g.similarity_logits(qw, [similarity])), g.score(qw, kw), rtol=1e-9, atol=1e-9
    )
    assert torch.equal(similarity.argsort(-1), g.score(qw, kw).argsort(-1))


@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_sparse_and_tail_equal_dense_with_every_key(name):
    g = GEOMETRIES[name]().double()
    q, k, v = _data()
    expected = dense_attention(q, k, v, g)
    every = torch.arange(40).expand(5, 40)
    sparse = sparse_attention(q, k, v, g, every, 40)
    with torch.no_grad():
        clusters = KeyClusters.build(g.witness(k), v, g, n_clusters=4)
        tail = tail_attention(q, clusters, budget=1.0)
    for out, lse in (sparse, tail):
        torch.testing.assert_close(out, expected[0], rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(lse, expected[1], rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_gradients_are_finite_for_every_parameter(name):
    g = GEOMETRIES[name]().double()
    q, k, v = (t.requires_grad_() for t in _data())
    out, lse = dense_attention(q, k, v, g)
    (out.square().sum() + lse.sum()).backward()
    for tensor in (q, k, v, *g.parameters()):
        assert tensor.grad is not None and torch.isfinite(tensor.grad).all()


def test_the_registry_builds_them_and_rejects_bad_parameters():
    assert isinstance(make_geometry("random_features", 8, features=32), RandomFeatures)
    assert make_geometry("operator", 8, m=4, rank=2).rank == 2
    for name, options in [
        ("random_features", {"features": 7}),
        ("random_features", {"sigma": 0.0}),
        ("operator", {"m": 4, "rank": 5}),
        ("operator", {"tau_init": -1.0}),
    ]:
        with pytest.raises(ValueError):
            make_geometry(name, 8, **options)
