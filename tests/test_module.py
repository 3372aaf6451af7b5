"""GeometricAttention: multi-head, SDPA-shaped core, projections, any geometry, trainable."""

import pytest
import torch
from torch.nn import functional as F

from rewa.attention import GeometricAttention, KappaStereographic, dense_attention, make_geometry
from tests.support import GEOMETRY_NAMES


@pytest.mark.parametrize("name", GEOMETRY_NAMES)
def test_forward_equals_projections_around_dense_attention(name):
    module = GeometricAttention(32, 4, geometry=name).double()
    x = torch.randn(2, 10, 32, dtype=torch.float64)
    context = torch.randn(2, 14, 32, dtype=torch.float64)
    out, lse = module(x, context, need_lse=True)
    assert out.shape == (2, 10, 32) and lse.shape == (2, 4, 10)

    def heads(t):
        return t.view(2, -1, 4, 8).transpose(1, 2)

    q, k, v = heads(module.q_proj(x)), heads(module.k_proj(context)), heads(module.v_proj(context))
    expected, expected_lse = dense_attention(q, k, v, module.geometry)
    expected = module.out_proj(expected.transpose(1, 2).reshape(2, 10, 32))
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(lse, expected_lse)


def test_dot_geometry_matches_scaled_dot_product_attention():
    module = GeometricAttention(32, 4, geometry="dot")
    q, k, v = (torch.randn(2, 4, 50, 8) for _ in range(3))
    out, _ = module.attend(q, k, v, causal=True)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))


@pytest.mark.parametrize("name", GEOMETRY_NAMES)
def test_every_parameter_receives_a_gradient(name):
    module = GeometricAttention(16, 2, geometry=name)
    x = torch.randn(3, 12, 16)
    module(x, causal=True).square().mean().backward()
    for param_name, param in module.named_parameters():
        assert param.grad is not None, f"{param_name} got no gradient"
        assert torch.isfinite(param.grad).all(), f"{param_name} has a non-finite gradient"


def test_learnable_curvature_moves_under_training():
    module = GeometricAttention(16, 2, geometry="kappa", geometry_options={"kappa": [0.0, -0.5]})
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-2)
    x, target = torch.randn(4, 12, 16), torch.randn(4, 12, 16)
    losses = []
    for _ in range(30):
        optimizer.zero_grad()
        loss = F.mse_loss(module(x), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert module.geometry.kappa[0].item() != 0.0  # crossed away from 0 with finite gradients


def test_geometry_instance_and_masks():
    geometry = KappaStereographic(8, heads=4, kappa=-1.0)
    module = GeometricAttention(32, 4, geometry=geometry)
    x = torch.randn(2, 6, 32)
    padding = torch.tensor([[True] * 6, [True] * 4 + [False] * 2]).view(2, 1, 1, 6)
    out = module(x, mask=padding)
    alone = module(x[1:, :4], mask=None)
    torch.testing.assert_close(out[1:, :4], alone, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"embed_dim": 30, "num_heads": 4}, "not divisible"),
        ({"geometry": make_geometry("sphere", 4)}, "dim 8"),
        ({"geometry": "hyperbolic"}, "unknown geometry"),
        ({"geometry": "sphere", "geometry_options": {"curvature": 1}}, "unknown option"),
        ({"geometry": make_geometry("sphere", 8), "geometry_options": {"power": 2}}, "by name"),
    ],
)
def test_configuration_errors_are_clear(kwargs, match):
    arguments = {"embed_dim": 32, "num_heads": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        GeometricAttention(**arguments)
