"""Finite, correct gradients everywhere in the domain (docs/mathematics.md 1.3): across kappa = 0,
at the projection boundary, at distance 0, and through the tiled attention's recomputing
backward."""

import math

import pytest
import torch

from rewa.attention import KappaStereographic, dense_attention, stereographic
from rewa.attention.numerics import boundary_eps
from tests import reference
from tests.support import GEOMETRY_NAMES, build_geometry

GRAD_KAPPAS = [0.0] + [sign * 10.0**e for e in range(-15, 1) for sign in (-1, 1)]
DTYPES = [torch.float32, torch.float64]


def assert_finite_grads(*tensors):
    for t in tensors:
        assert t.grad is not None, "no gradient reached an input"
        assert torch.isfinite(t.grad).all(), f"non-finite gradient: {t.grad}"


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def inside_points(kappa: float, dtype: torch.dtype, n: int = 16) -> torch.Tensor:
    radius = 0.5 / max(abs(kappa), 1.0) ** 0.5
    x = torch.randn(n, 5, dtype=torch.float64)
    return (x / x.norm(dim=-1, keepdim=True) * radius * torch.rand(n, 1, dtype=torch.float64)).to(
        dtype
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kappa", GRAD_KAPPAS)
def test_distance_gradients_are_finite_in_points_and_curvature(kappa, dtype):
    x, y = leaf(inside_points(kappa, dtype)), leaf(inside_points(kappa, dtype))
    k = leaf(torch.tensor(kappa, dtype=dtype))
    (stereographic.dist(x, y, k).sum() + stereographic.distance_matrix(x, y, k).sum()).backward()
    assert_finite_grads(x, y, k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kappa", GRAD_KAPPAS)
def test_maps_have_finite_gradients(kappa, dtype):
    u = leaf(torch.randn(16, 5, dtype=dtype) * 0.3)
    k = leaf(torch.tensor(kappa, dtype=dtype))
    y = stereographic.project(stereographic.expmap0(u, k), k)
    stereographic.logmap0(y, k).sum().backward()
    assert_finite_grads(u, k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kappa", [k for k in GRAD_KAPPAS if k < 0])
def test_gradients_at_the_projection_boundary(kappa, dtype):
    k = leaf(torch.tensor(kappa, dtype=dtype))
    far = torch.randn(8, 5, dtype=dtype) * 10 / math.sqrt(-kappa)
    x = leaf(far)
    on_boundary = stereographic.project(x, k)
    limit = (1 - boundary_eps(dtype)) / math.sqrt(-kappa)
    torch.testing.assert_close(
        on_boundary.norm(dim=-1), torch.full((8,), limit, dtype=dtype), rtol=1e-5, atol=0
    )
    distances = stereographic.dist(on_boundary, on_boundary.roll(1, 0), k)
    matrix = stereographic.distance_matrix(on_boundary, on_boundary, k)
    (distances.sum() + matrix.sum()).backward()
    assert_finite_grads(x, k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kappa", GRAD_KAPPAS)
def test_identical_points_have_distance_zero_and_finite_gradients(kappa, dtype):
    x = leaf(inside_points(kappa, dtype))
    k = leaf(torch.tensor(kappa, dtype=dtype))
    distances = stereographic.dist(x, x, k)
    assert distances.abs().max() < 1e-6
    (distances.sum() + stereographic.distance_matrix(x, x, k).diagonal().sum()).backward()
    assert_finite_grads(x, k)


@pytest.mark.parametrize("name", ["euclidean", "sphere", "poincare", "product"])
def test_every_distance_geometry_is_differentiable_at_identical_points(name):
    g = build_geometry(name, 6)
    x = leaf(torch.randn(4, 6, dtype=torch.float64))
    (g.logits(x, x).sum() + g.logits_at(x, x.unsqueeze(-2)).sum()).backward()
    assert_finite_grads(x)
    for p in g.parameters():
        assert p.grad is None or torch.isfinite(p.grad).all()


def test_curvature_gradient_is_continuous_across_zero():
    """d d_k / dk at -1e-15, 0 and 1e-15 agree with the analytic value at 0 (series branch) and
    with the closed forms just outside the series region."""
    x, y = inside_points(0.0, torch.float64), inside_points(0.0, torch.float64)
    grads = []
    for kappa in (-1e-15, 0.0, 1e-15):
        k = leaf(torch.tensor(kappa, dtype=torch.float64))
        stereographic.dist(x, y, k).sum().backward()
        grads.append(k.grad.item())
    assert grads[0] == pytest.approx(grads[1], rel=1e-9) and grads[2] == pytest.approx(grads[1])
    # Central differences on the exact formula of docs/mathematics.md at +-1e-3 (closed forms on
    # both sides).
    h = 1e-3
    slope = (reference.kappa(x, y, h).sum() - reference.kappa(x, y, -h).sum()) / (2 * h)
    assert grads[1] == pytest.approx(slope.item(), rel=1e-5)


def naive_attention(q, k, v, geometry, allowed=None):
    return reference.dense_softmax_attention(geometry.logits(q, k), v, allowed)


@pytest.mark.parametrize("name", GEOMETRY_NAMES)
@pytest.mark.parametrize("causal", [False, True])
def test_tiled_backward_matches_autograd_of_naive_attention(name, causal):
    """Gradients of out and lse reach q, k, v and every geometry parameter, equal to autograd
    through the naive float64 computation, with several tiles per axis."""
    heads = 2
    g = build_geometry(name, 6, heads=heads)
    q = leaf(torch.randn(2, heads, 11, 6, dtype=torch.float64))
    k = leaf(torch.randn(2, heads, 13, 6, dtype=torch.float64))
    v = leaf(torch.randn(2, heads, 13, 3, dtype=torch.float64))
    out_weight = torch.randn(2, heads, 11, 3, dtype=torch.float64)
    lse_weight = torch.randn(2, heads, 11, dtype=torch.float64)
    allowed = torch.ones(11, 13, dtype=torch.bool).tril(2) if causal else None

    def loss(out, lse):
        return (out * out_weight).sum() + (lse * lse_weight).sum()

    inputs = [q, k, v, *g.parameters()]
    out, lse = dense_attention(q, k, v, g, causal=causal, q_chunk=4, k_chunk=5)
    tiled = torch.autograd.grad(loss(out, lse), inputs, allow_unused=True)
    ref_out, ref_lse = naive_attention(q, k, v, g, allowed)
    naive = torch.autograd.grad(loss(ref_out, ref_lse), inputs, allow_unused=True)
    for got, expected in zip(tiled, naive, strict=True):
        if expected is None:
            assert got is None or torch.count_nonzero(got) == 0
        else:
            torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("name", ["euclidean", "sphere", "poincare", "kappa"])
def test_gradcheck_of_dense_attention(name):
    g = build_geometry(name, 4)
    q = leaf(torch.randn(5, 4, dtype=torch.float64) * 0.5)
    k = leaf(torch.randn(7, 4, dtype=torch.float64) * 0.5)
    v = leaf(torch.randn(7, 2, dtype=torch.float64))
    assert torch.autograd.gradcheck(
        lambda q, k, v: dense_attention(q, k, v, g, q_chunk=2, k_chunk=3), (q, k, v)
    )


@pytest.mark.parametrize("kappa", GRAD_KAPPAS)
def test_attention_gradient_in_curvature_is_finite(kappa):
    g = KappaStereographic(6, kappa=kappa).double()
    q, k = torch.randn(9, 6, dtype=torch.float64), torch.randn(9, 6, dtype=torch.float64)
    v = torch.randn(9, 3, dtype=torch.float64)
    out, lse = dense_attention(q, k, v, g, causal=True, q_chunk=4, k_chunk=4)
    (out.sum() + lse.sum()).backward()
    assert torch.isfinite(g.kappa.grad).all() and torch.isfinite(g.temperature.log_scale.grad).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", ["sphere", "product"])
def test_antipodal_sphere_points_have_finite_gradients(name, dtype):
    """Antipodal witnesses (h = 1 in the half-chord arcsin) happen in training with a
    2-dimensional sphere component; their gradient is cut to 0 instead of inf / NaN."""
    options = (
        {"euclidean_dim": 1, "sphere_dim": 2, "hyperbolic_dim": 1} if name == "product" else {}
    )
    geometry = build_geometry(name, 4, **options).to(dtype)
    if name == "product":
        with torch.no_grad():  # the sphere map takes the first two coordinates
            geometry.maps["sphere"].zero_()
            geometry.maps["sphere"][0, 0, 0] = geometry.maps["sphere"][0, 1, 1] = 1.0
    q = torch.tensor([[1.0, 0.5, 0.3, -0.2]], dtype=dtype)
    antipode = -2 * q if name == "sphere" else torch.cat([-2 * q[:, :2], q[:, 2:] + 0.1], -1)
    k = torch.cat([antipode, torch.tensor([[0.5, 0.5, 0.2, 0.1]], dtype=dtype)])
    q.requires_grad_(True)
    k.requires_grad_(True)
    out, _ = dense_attention(q, k, torch.randn(2, 3, dtype=dtype), geometry)
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
    for parameter in geometry.parameters():
        assert parameter.grad is None or torch.isfinite(parameter.grad).all()
    if name == "sphere":  # the value stays exact: distance pi
        expected = torch.tensor(-math.pi / geometry.temperature().item(), dtype=dtype)
        torch.testing.assert_close(geometry.logits(q, k)[0, 0], expected)
