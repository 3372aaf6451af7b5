import math

import pytest
import torch

from rewa.attention import GEOMETRIES, make_geometry
from rewa.attention.allocator import retain_freed_memory
from rewa.attention.numerics import acosh1p, inverse_softplus


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_every_registered_geometry_builds_with_its_options(name):
    g = make_geometry(name, 8, heads=2)
    assert g.dim == 8 and g.heads == 2


def test_registry_errors_name_what_is_accepted():
    with pytest.raises(ValueError, match=r"unknown geometry 'cones'.*'dot'"):
        make_geometry("cones", 8)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['kappa'\].*'power'"):
        make_geometry("sphere", 8, kappa=1.0)
    with pytest.raises(ValueError, match="power 1 or 2"):
        make_geometry("euclidean", 8, power=3)


def test_acosh1p_is_accurate_and_differentiable_at_zero():
    """Against 2 asinh(sqrt(v/2)), which equals arccosh(1 + v) without rounding 1 + v."""
    v = torch.logspace(-12, 6, 200, dtype=torch.float64)
    exact = 2 * torch.asinh((v / 2).sqrt())
    torch.testing.assert_close(acosh1p(v), exact, rtol=1e-12, atol=0)
    torch.testing.assert_close(acosh1p(v.float()).double(), exact, rtol=1e-6, atol=0)
    assert acosh1p(torch.zeros(1, dtype=torch.float64)).item() < 1e-140
    leaf = torch.zeros(3, requires_grad=True)
    acosh1p(leaf).sum().backward()
    assert torch.isfinite(leaf.grad).all()


def test_inverse_softplus():
    for y in (1e-3, 0.25, 1.0, 7.0):
        assert math.log1p(math.exp(inverse_softplus(y))) == pytest.approx(y)
    with pytest.raises(ValueError):
        inverse_softplus(0.0)


def test_allocator_tuning_applies_on_glibc():
    assert retain_freed_memory() is True
