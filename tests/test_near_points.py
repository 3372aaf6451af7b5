"""Distances and attention for nearly coincident points (docs/mathematics.md, "Fused dense
attention"): the Gram expansion used by dense attention cancels there, so its near pairs are
recomputed from the differences (`numerics.refine_near_pairs`). Float64 distances against 50-digit
mpmath, boundary of the float64 Poincare ball included; float32 attention and its gradients
against float64 (near-coincident keys; `randn` inputs whose witnesses reach the Poincare
boundary); overflow of umbral cones; per-head parameters at the default dtype."""

from __future__ import annotations

import copy

import mpmath
import pytest
import torch

from rewa.attention import DomainError, dense_attention, make_geometry, numerics
from rewa.attention.stereographic import project

mpmath.mp.dps = 50
D = 16
SEPARATIONS = [0.0, 1e-12, 1e-9, 1e-6, 1e-3, 0.1]


def _mp_vector(row: torch.Tensor) -> list:
    return [mpmath.mpf(float(value)) for value in row.detach()]


def _mp_squared_difference(x: list, y: list):
    return sum((a - b) ** 2 for a, b in zip(x, y, strict=True))


def _mp_distance(name: str, x: list, y: list, kappa: float = 0.0):
    """The geodesic distance between two witnesses, in 50 digits."""
    if name == "euclidean":
        return mpmath.sqrt(_mp_squared_difference(x, y))
    if name == "sphere":  # between the directions of x and y
        nx, ny = (mpmath.sqrt(sum(v**2 for v in p)) for p in (x, y))
        chord = mpmath.sqrt(_mp_squared_difference([a / nx for a in x], [b / ny for b in y]))
        return 2 * mpmath.asin(min(chord / 2, mpmath.mpf(1)))
    k = mpmath.mpf(kappa)
    conformal = [1 + k * sum(v**2 for v in p) for p in (x, y)]
    chord = mpmath.sqrt(_mp_squared_difference(x, y) / (conformal[0] * conformal[1]))
    if k < 0:
        return 2 * mpmath.asinh(mpmath.sqrt(-k) * chord) / mpmath.sqrt(-k)
    return 2 * mpmath.asin(mpmath.sqrt(k) * chord) / mpmath.sqrt(k)


def _near_witnesses(geometry, radius: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Query witnesses and keys displaced from each by the SEPARATIONS, float64."""
    generator = torch.Generator().manual_seed(4)
    directions = torch.randn(3, D, dtype=torch.float64, generator=generator)
    base = geometry.witness(directions / directions.norm(dim=-1, keepdim=True) * radius)
    steps = torch.randn(len(SEPARATIONS), D, dtype=torch.float64, generator=generator)
    steps = steps / steps.norm(dim=-1, keepdim=True)
    scale = torch.tensor(SEPARATIONS, dtype=torch.float64).unsqueeze(-1)
    keys = (base.unsqueeze(1) + scale * steps).reshape(-1, D)
    if type(geometry).__name__ == "Sphere":
        keys = keys / keys.norm(dim=-1, keepdim=True)
    if hasattr(geometry, "kappa"):  # keys pushed out of the ball come back to its radius
        keys = project(keys, geometry.kappa.detach())
    return base, keys


@pytest.mark.parametrize(
    ("name", "options", "radius"),
    [
        ("euclidean", {}, 3.0),
        ("sphere", {}, 1.0),
        ("poincare", {}, 0.5),
        ("poincare", {}, 50.0),  # witnesses on the float64 projection radius 1 - 1e-5
        ("kappa", {"kappa": 0.7}, 0.5),
        ("kappa", {"kappa": -2.0}, 0.3),
    ],
)
def test_float64_distances_of_near_points_match_mpmath(name, options, radius):
    geometry = make_geometry(name, D, **options).double()
    queries, keys = _near_witnesses(geometry, radius)
    distances = geometry.distance_matrix(queries, keys)
    kappa = float(geometry.kappa.detach()) if hasattr(geometry, "kappa") else 0.0
    for i in range(queries.shape[0]):
        x = _mp_vector(queries[i])
        for j in range(keys.shape[0]):
            expected = _mp_distance(name, x, _mp_vector(keys[j]), kappa)
            error = abs(mpmath.mpf(float(distances[i, j].detach())) - expected)
            assert error <= 1e-10 * max(1, expected), (i, j, float(distances[i, j]), expected)
    diagonal = geometry.distance_matrix(queries, queries).diagonal()
    assert bool((diagonal < 1e-100).all())  # a point's distance to itself is 0


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("euclidean", {}),
        ("sphere", {}),
        ("poincare", {}),
        ("kappa", {"kappa": 1.0}),
        ("kappa", {"kappa": -0.5}),
        ("product", {}),
    ],
)
def test_float32_attention_with_near_coincident_keys_matches_float64(name, options):
    """Each query has a key 1e-4 from it: float32 gradients were off by 0.3-0.7 of the
    largest gradient (the Gram expansion is all rounding there); now within 1e-2."""
    generator = torch.Generator().manual_seed(8)
    q = torch.randn(1, 32, D, dtype=torch.float64, generator=generator) * 0.3
    k = torch.randn(1, 64, D, dtype=torch.float64, generator=generator) * 0.3
    step = torch.randn(32, D, dtype=torch.float64, generator=generator)
    k[0, :32] = q[0] + 1e-4 * step / step.norm(dim=-1, keepdim=True)  # 1e-4 from its query
    v = torch.randn(1, 64, D, dtype=torch.float64, generator=generator)
    q, k, v = (tensor.float().double() for tensor in (q, k, v))  # the same inputs in both
    torch.manual_seed(1)
    geometry = make_geometry(name, D, **options)
    results = []
    for dtype, module in ((torch.float32, geometry), (torch.float64, _copy_double(geometry))):
        qq, kk = q.to(dtype).requires_grad_(), k.to(dtype).requires_grad_()
        out, _ = dense_attention(qq, kk, v.to(dtype), module)
        out.square().sum().backward()
        results.append((out.detach().double(), qq.grad.double(), kk.grad.double()))
    (out32, *grads32), (out64, *grads64) = results
    assert float((out32 - out64).abs().max()) <= 1e-5 * float(out64.abs().max())
    for grad32, grad64 in zip(grads32, grads64, strict=True):
        assert float((grad32 - grad64).abs().max()) <= 1e-2 * float(grad64.abs().max())


def _copy_double(geometry):
    return copy.deepcopy(geometry).double()


@pytest.mark.parametrize("d", [16, 64])
@pytest.mark.parametrize(
    ("name", "options"),
    [("poincare", {}), ("kappa", {"kappa": -0.3}), ("kappa", {"kappa": 1.0}), ("product", {})],
)
def test_float32_attention_on_randn_inputs_matches_float64(name, options, d):
    """`torch.randn` inputs reach tangent norms of 4-8: with float32's old boundary margin
    (4e-3) their witnesses sat on one sphere and the output was a median 32 % (Poincare, d =
    16), 18 % (kappa = -0.3, d = 64) and 2.5-27 % (product) away from float64's; now at most
    4.4e-4 (`pytest -s` prints the medians)."""
    generator = torch.Generator().manual_seed(d)
    q, k, v = (
        torch.randn(1, n, d, generator=generator).double() for n in (128, 256, 256)
    )  # float32-representable, so both dtypes see the same inputs
    torch.manual_seed(1)
    geometry = make_geometry(name, d, **options)
    with torch.no_grad():
        out32, _ = dense_attention(q.float(), k.float(), v.float(), geometry)
        out64, _ = dense_attention(q, k, v, _copy_double(geometry))
    relative = (out32.double() - out64).norm(dim=-1) / out64.norm(dim=-1)
    print(f"\n{name} {options} d={d}: median float32-float64 difference {relative.median():.2e}")
    assert float(relative.median()) <= 1e-3


def test_an_umbral_height_that_overflows_is_a_domain_error_not_nan():
    geometry = make_geometry("cone", 4, kind="umbral")
    x = torch.randn(1, 5, 4)
    x[0, 2, -1] = 100.0  # exp(100) overflows float32
    with pytest.raises(DomainError, match="x_d / height_scale up to 100"):
        dense_attention(x, x, x, geometry)
    x[0, 2, -1] = 30.0
    out, lse = dense_attention(x, x, x, geometry)
    assert bool(torch.isfinite(out).all() and torch.isfinite(lse).all())


def test_per_head_parameters_are_made_in_the_default_dtype():
    """Built under float64, a curvature of 0.1 or a cone radius of 0.3 is 0.1 and 0.3, not
    their float32 roundings."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        kappa = make_geometry("kappa", 4, heads=2, kappa=[0.1, -0.3])
        cone = make_geometry("cone", 4, heads=2, r=0.3, gamma=[0.7, 1.1])
    finally:
        torch.set_default_dtype(previous)
    assert kappa.kappa.tolist() == [0.1, -0.3]
    assert cone.r.tolist() == [0.3, 0.3]
    assert torch.allclose(cone.gamma, torch.tensor([0.7, 1.1], dtype=torch.float64), 0, 1e-15)


@pytest.mark.parametrize("weights", ["none", "even", "spread"])
def test_tile_screens_find_every_near_pair_of_the_matrix(weights):
    """`NearScreens` screens the tiles of one matrix from norms and weights computed once: over
    every tile (uneven ones at the edges included), the entries it lets `near_pairs` find are
    exactly those below `NEAR_TOLERANCE` times their rounding bound, computed here for the
    whole matrix from its definition. With column weights spread over more than
    `WEIGHT_SPREAD`, the tiles compare `s_ij / w_y[j]` (a column scale)."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(2, 70, 6, generator=generator, dtype=torch.float64)
    y = torch.randn(2, 90, 6, generator=generator, dtype=torch.float64)
    x[:, 5], x[:, 40], x[1, 66] = y[:, 7], y[:, 88] + 1e-9, y[1, 30]  # near pairs, 3 tiles
    x_weight = y_weight = None
    if weights != "none":
        x_weight = torch.rand(2, 70, generator=generator, dtype=torch.float64) + 0.5
        y_weight = torch.rand(2, 90, generator=generator, dtype=torch.float64) + 0.5
        if weights == "spread":
            y_weight[:, ::3] *= 50
    squared = (x.unsqueeze(-2) - y.unsqueeze(-3)).square().sum(-1)  # the direct difference
    if weights != "none":
        squared = squared * x_weight.unsqueeze(-1) * y_weight.unsqueeze(-2)
    scale = numerics.NEAR_TOLERANCE * torch.finfo(torch.float64).eps * 0.5
    bound = x.square().sum(-1).unsqueeze(-1) + y.square().sum(-1).unsqueeze(-2)
    if weights != "none":
        bound = bound * x_weight.unsqueeze(-1) * y_weight.unsqueeze(-2)
    expected = (squared <= scale * bound).nonzero().tolist()
    assert len(expected) == 5

    screens = numerics.NearScreens(x, y, x_weight, y_weight, 0.5, torch.float64)
    found = []
    for row_start in range(0, 70, 32):
        for col_start in range(0, 90, 40):
            rows, cols = slice(row_start, row_start + 32), slice(col_start, col_start + 40)
            tile = squared[:, rows, cols]
            screen = screens.tile(tile.shape, rows, cols)
            assert (screen.column_scale is not None) == (weights == "spread")
            minima = numerics.screened_row_minima(tile, screen.column_scale)
            index = numerics.near_pairs(tile, minima, screen)
            if index is not None:
                batch, row, col = (part.tolist() for part in index)
                pairs = zip(batch, row, col, strict=True)
                found += [[b, r + row_start, c + col_start] for b, r, c in pairs]
    assert sorted(found) == sorted(expected)
