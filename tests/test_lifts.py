"""Ranking keys by the lifted metric equals ranking them by the geometry (docs/mathematics.md 1.x
"Lift")."""

import pytest
import torch

from rewa.attention import KappaStereographic, Lift, ProductGeometry, euclidean, sphere
from rewa.attention import stereographic as st
from tests.support import GEOMETRY_NAMES, build_geometry


def lifted_scores(query: Lift, key: Lift) -> torch.Tensor:
    """Larger is better under the lift's metric: inner product, or negated L2 distance."""
    assert query.metric == key.metric
    if query.metric == "ip":
        return query.vectors @ key.vectors.transpose(-1, -2)
    return -torch.cdist(query.vectors, key.vectors)


def assert_same_ranking(scores: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.equal(scores.argsort(-1, descending=True), expected.argsort(-1, descending=True))


@pytest.mark.parametrize("name", [n for n in GEOMETRY_NAMES if "product" not in n])
def test_single_lift_ranks_like_the_logits(name):
    g = build_geometry(name, 8)
    q, k = torch.randn(20, 8, dtype=torch.float64), torch.randn(300, 8, dtype=torch.float64)
    qw, kw = g.witness(q), g.witness(k)
    (query,), (key,) = g.lift(qw, "query"), g.lift(kw, "key")
    assert_same_ranking(lifted_scores(query, key), g.score(qw, kw))


@pytest.mark.parametrize("kappa", [-2.0, -1.0, -1e-3, -1e-9, 0.0, 1e-9, 1e-3, 0.5, 2.0])
def test_chord_lift_is_exact_for_every_curvature(kappa):
    g = KappaStereographic(8, kappa=kappa).double()
    q, k = torch.randn(20, 8, dtype=torch.float64), torch.randn(300, 8, dtype=torch.float64) * 2
    qw, kw = g.witness(q), g.witness(k)
    (query,), (key,) = g.lift(qw, "query"), g.lift(kw, "key")
    assert_same_ranking(lifted_scores(query, key), g.score(qw, kw))


def test_chord_lift_with_mixed_curvature_signs_per_head():
    g = KappaStereographic(8, heads=3, kappa=[-1.0, 0.0, 1.0]).double()
    q, k = torch.randn(3, 10, 8, dtype=torch.float64), torch.randn(3, 200, 8, dtype=torch.float64)
    qw, kw = g.witness(q), g.witness(k)
    (query,), (key,) = g.lift(qw, "query"), g.lift(kw, "key")
    assert_same_ranking(lifted_scores(query, key), g.score(qw, kw))


@pytest.mark.parametrize("name", ["product", "adaptive_product"])
def test_product_lifts_rank_each_component_exactly(name):
    g = build_geometry(name, 8)
    assert isinstance(g, ProductGeometry)
    q, k = torch.randn(20, 8, dtype=torch.float64), torch.randn(300, 8, dtype=torch.float64)
    qw, kw = g.witness(q), g.witness(k)
    parts_q, parts_k = g.split(qw), g.split(kw)
    lifts = zip(g.lift(qw, "query"), g.lift(kw, "key"), g.present, strict=True)
    minus_one = torch.tensor(-1.0, dtype=torch.float64)
    distance = {
        "euclidean": euclidean.distance_matrix,
        "sphere": sphere.distance_matrix,
        "hyperbolic": lambda x, y: st.distance_matrix(x, y, minus_one),
    }
    for query, key, component in lifts:
        expected = -distance[component](parts_q[component], parts_k[component])
        assert_same_ranking(lifted_scores(query, key), expected)


def test_lift_rejects_an_unknown_role():
    with pytest.raises(ValueError, match="role"):
        build_geometry("sphere", 4).lift(torch.randn(3, 4, dtype=torch.float64), "value")
