import math

import pytest
import torch

from rewa.attention import GEOMETRIES, dense_attention, make_geometry
from rewa.attention.allocator import retain_freed_memory
from rewa.attention.numerics import acosh1p, exp_of_shifted_, inverse_softplus


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


def test_exp_of_shifted_floors_underflow_and_keeps_masked_entries_zero():
    shifted = torch.tensor([0.0, -10.0, -100.0, float("-inf")])
    weights = exp_of_shifted_(shifted.clone(), may_be_masked=True)
    assert weights[0] == 1 and weights[3] == 0
    assert weights[1].item() == pytest.approx(math.exp(-10), rel=1e-6)
    assert 0 < weights[2].item() <= math.exp(-64) * 1.0001  # floored, never subnormal
    # Sharply peaked rows (logit gaps of hundreds) still give the exact softmax.
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 16, 8, generator=generator) for _ in range(3))
    sharp = make_geometry("dot", 8, scale=40.0)
    out, lse = dense_attention(q, k, v, sharp, causal=True, k_chunk=4)
    logits = (q.double() @ k.double().transpose(-1, -2)) * 40.0
    logits = logits.masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1).float())
    torch.testing.assert_close(out, (torch.softmax(logits, -1) @ v.double()).float())
