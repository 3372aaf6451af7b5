"""kappa-stereographic maps against geoopt's independent implementation (docs/mathematics.md
1.3)."""

import geoopt.manifolds.stereographic.math as geo
import pytest
import torch

from rewa.attention import stereographic
from tests.support import TOLERANCES

KAPPAS = [-2.0, -1.0, -0.1, -1e-4, 0.0, 1e-4, 0.1, 1.0, 2.0]
DTYPES = [torch.float32, torch.float64]


def points(kappa: float, dtype: torch.dtype, n: int = 64, dim: int = 6) -> torch.Tensor:
    """Points well inside the domain: expmap0 of tangent vectors of norm <= 0.9 / sqrt(|k|)."""
    g = torch.Generator().manual_seed(7)
    u = torch.randn(n, dim, generator=g, dtype=torch.float64)
    radius = 0.9 / max(abs(kappa), 1.0) ** 0.5 * torch.rand(n, 1, generator=g, dtype=torch.float64)
    u = u / u.norm(dim=-1, keepdim=True) * radius
    return geo.expmap0(u, k=torch.tensor(kappa, dtype=torch.float64)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kappa", KAPPAS)
def test_dist_matches_geoopt(kappa, dtype):
    x, y = points(kappa, dtype), points(kappa, dtype).roll(1, 0)
    k = torch.tensor(kappa, dtype=dtype)
    torch.testing.assert_close(
        stereographic.dist(x, y, k), geo.dist(x, y, k=k), **TOLERANCES[dtype]
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kappa", KAPPAS)
def test_distance_matrix_matches_geoopt(kappa, dtype):
    x, y = points(kappa, dtype, n=16), points(kappa, dtype, n=24)
    k = torch.tensor(kappa, dtype=dtype)
    expected = geo.dist(x.unsqueeze(1), y.unsqueeze(0), k=k)
    # The dense path expands |x - y|^2 through a Gram matrix: float32 keeps an absolute error of
    # about sqrt(eps) on coincident points, so it is held to a looser absolute tolerance.
    tolerance = TOLERANCES[dtype] if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-3}
    torch.testing.assert_close(stereographic.distance_matrix(x, y, k), expected, **tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kappa", KAPPAS)
def test_mobius_add_matches_geoopt(kappa, dtype):
    x, y = points(kappa, dtype), points(kappa, dtype).roll(3, 0)
    k = torch.tensor(kappa, dtype=dtype)
    expected = geo.mobius_add(x, y, k=k)
    torch.testing.assert_close(stereographic.mobius_add(x, y, k), expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kappa", KAPPAS)
def test_expmap0_and_logmap0_match_geoopt(kappa, dtype):
    g = torch.Generator().manual_seed(3)
    u = torch.randn(64, 6, generator=g, dtype=dtype) * 0.2
    k = torch.tensor(kappa, dtype=dtype)
    torch.testing.assert_close(
        stereographic.expmap0(u, k), geo.expmap0(u, k=k), **TOLERANCES[dtype]
    )
    y = points(kappa, dtype)
    torch.testing.assert_close(
        stereographic.logmap0(y, k), geo.logmap0(y, k=k), **TOLERANCES[dtype]
    )


@pytest.mark.parametrize("kappa", KAPPAS)
def test_dist_equals_the_mobius_form(kappa):
    """The chord form used for speed and accuracy equals 2 artan_k(||(-x) (+)_k y||)."""
    x, y = points(kappa, torch.float64), points(kappa, torch.float64).roll(5, 0)
    k = torch.tensor(kappa, dtype=torch.float64)
    mobius_form = 2 * stereographic.artan_k(stereographic.mobius_add(-x, y, k).norm(dim=-1), k)
    torch.testing.assert_close(
        stereographic.dist(x, y, k), mobius_form, **TOLERANCES[torch.float64]
    )
