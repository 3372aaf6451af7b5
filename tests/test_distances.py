"""Every geometry's logits, dense (`score`) and on gathered candidates (`score_at`), against
float64 references written from the formulas of docs/mathematics.md."""

import math

import pytest
import torch
from torch.nn import functional as F

from rewa.attention import (
    DotProduct,
    Euclidean,
    KappaStereographic,
    PoincareBall,
    ProductGeometry,
    Sphere,
)
from tests import reference
from tests.support import TOLERANCES

F64 = TOLERANCES[torch.float64]
DIM = 8


def inside(n: int) -> torch.Tensor:
    """Ambient points whose witnesses stay well inside every domain (the float64 references lose
    digits at the projection boundary, where float32 and float64 also project differently)."""
    return torch.randn(n, DIM, dtype=torch.float64) * 0.3


def pairwise(fn, x, y):
    """Apply a paired reference distance to every (query, key) pair -> (nq, nk)."""
    return fn(x.unsqueeze(-2), y.unsqueeze(-3))


def gathered(keys: torch.Tensor, n_queries: int) -> torch.Tensor:
    """Every key as a candidate of every query: (nq, C, d)."""
    return keys.unsqueeze(0).expand(n_queries, *keys.shape)


def check_both_paths(geometry, q, k, expected):
    torch.testing.assert_close(geometry.logits(q, k), expected, **F64)
    torch.testing.assert_close(geometry.logits_at(q, gathered(k, q.shape[0])), expected, **F64)


def test_dot_product_logits():
    q, k = torch.randn(5, DIM, dtype=torch.float64), torch.randn(7, DIM, dtype=torch.float64)
    check_both_paths(DotProduct(DIM), q, k, q @ k.T / math.sqrt(DIM))


@pytest.mark.parametrize("power", [1, 2])
def test_euclidean_logits(power):
    g = Euclidean(DIM, power=power).double()
    q, k = torch.randn(5, DIM, dtype=torch.float64), torch.randn(7, DIM, dtype=torch.float64)
    tau = math.sqrt(DIM)
    check_both_paths(g, q, k, -(pairwise(reference.euclidean, q, k) ** power) / tau)


@pytest.mark.parametrize("power", [1, 2])
def test_sphere_logits(power):
    g = Sphere(DIM, power=power).double()
    q, k = torch.randn(5, DIM, dtype=torch.float64), torch.randn(7, DIM, dtype=torch.float64)
    check_both_paths(g, q, k, -(pairwise(reference.sphere, q, k) ** power) / math.sqrt(DIM))


def test_sphere_distance_is_exact_near_zero_and_pi():
    """The atan2 form keeps full accuracy where arccos(clamp(.)) loses it (docs/mathematics.md
    1.2)."""
    from rewa.attention import sphere

    a = F.normalize(torch.randn(DIM, dtype=torch.float64), dim=0)
    direction = F.normalize(torch.randn(DIM, dtype=torch.float64), dim=0)
    direction = direction - (direction @ a) * a
    direction = direction / direction.norm()
    for angle in (1e-7, 1e-4, math.pi - 1e-6):
        b = math.cos(angle) * a + math.sin(angle) * direction
        assert sphere.dist(a, b).item() == pytest.approx(angle, rel=1e-8)
        assert sphere.dist(a.float(), b.float()).item() == pytest.approx(angle, rel=2e-3, abs=1e-6)


def test_poincare_logits_equal_the_arccosh_formula():
    g = PoincareBall(DIM).double()
    q, k = torch.randn(5, DIM, dtype=torch.float64), torch.randn(7, DIM, dtype=torch.float64)
    qw, kw = g.witness(q), g.witness(k)
    assert qw.norm(dim=-1).max() < 1 and kw.norm(dim=-1).max() < 1
    expected = -pairwise(reference.poincare, qw, kw) / math.sqrt(DIM)
    torch.testing.assert_close(g.score(qw, kw), expected, **F64)
    torch.testing.assert_close(g.score_at(qw, gathered(kw, 5)), expected, **F64)


def test_poincare_witness_is_project_of_expmap0():
    g = PoincareBall(DIM).double()
    x = torch.randn(20, DIM, dtype=torch.float64) * 3
    expected = reference.expmap0(x, -1.0)
    norms = expected.norm(dim=-1, keepdim=True)
    expected = torch.where(norms > 1 - 1e-5, expected / norms * (1 - 1e-5), expected)
    torch.testing.assert_close(g.witness(x), expected, **F64)


@pytest.mark.parametrize("kappa", [-1.5, -0.3, 0.0, 0.3, 1.5])
@pytest.mark.parametrize("power", [1, 2])
def test_kappa_logits_equal_the_mobius_formula(kappa, power):
    g = KappaStereographic(DIM, kappa=kappa, power=power).double()
    q, k = inside(5), inside(7)
    qw, kw = g.witness(q), g.witness(k)
    actual_kappa = g.kappa.item()  # the float32-initialised parameter, cast to float64
    distances = pairwise(lambda x, y: reference.kappa(x, y, actual_kappa), qw, kw)
    expected = -(distances**power) / math.sqrt(DIM)
    torch.testing.assert_close(g.score(qw, kw), expected, **F64)
    torch.testing.assert_close(g.score_at(qw, gathered(kw, 5)), expected, **F64)


def test_kappa_per_head_curvatures():
    kappas = [-1.0, 0.0, 0.5]
    g = KappaStereographic(DIM, heads=3, kappa=kappas).double()
    q = torch.randn(2, 3, 5, DIM, dtype=torch.float64)
    k = torch.randn(2, 3, 7, DIM, dtype=torch.float64)
    logits = g.logits(q, k)
    for h, kappa in enumerate(kappas):
        single = KappaStereographic(DIM, kappa=kappa).double()
        torch.testing.assert_close(logits[:, h], single.logits(q[:, h], k[:, h]), **F64)


@pytest.mark.parametrize("power", [1, 2])
def test_product_logits_are_the_weighted_sum(power):
    g = ProductGeometry(DIM, euclidean_dim=3, sphere_dim=4, hyperbolic_dim=2, power=power).double()
    q, k = torch.randn(5, DIM, dtype=torch.float64), torch.randn(7, DIM, dtype=torch.float64)
    parts_q, parts_k = g.split(g.witness(q)), g.split(g.witness(k))
    w = g.weights()
    d_r = pairwise(reference.euclidean, parts_q["euclidean"], parts_k["euclidean"])
    d_s = pairwise(reference.sphere, parts_q["sphere"], parts_k["sphere"])
    d_h = pairwise(reference.poincare, parts_q["hyperbolic"], parts_k["hyperbolic"])
    d_m = w["euclidean"] * d_r**power + w["sphere"] * d_s**power + w["hyperbolic"] * d_h**power
    check_both_paths(g, q, k, -d_m / g.temperature())


def test_float32_dense_logits_track_float64():
    """Away from the projection margin, which differs by dtype (docs/mathematics.md 1.3)."""
    for g in (Euclidean(DIM), Sphere(DIM), PoincareBall(DIM), KappaStereographic(DIM, kappa=0.7)):
        q, k = inside(64).float(), inside(96).float()
        expected = g.double().logits(q.double(), k.double())
        torch.testing.assert_close(g.float().logits(q, k).double(), expected, rtol=1e-4, atol=1e-3)
