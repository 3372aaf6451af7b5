"""Mixture of geometries, GeometricTransformerLayer, the geometric curriculum and Riemannian
gradients (docs/mathematics.md 8)."""

import geoopt
import pytest
import torch
from torch import nn

from rewa.attention import GEOMETRIES, GeometricAttention, expmap
from rewa.research import (
    CURRICULUM_PHASES,
    GeometricCurriculum,
    GeometricTransformerLayer,
    GeometryMixture,
    RiemannAttention,
    RiemannianSGD,
    component_group,
    riemannian_gradient,
)

from .support import TOLERANCES

F64 = TOLERANCES[torch.float64]


def test_mixture_gate_sums_to_one_and_weighs_every_expert():
    mixture = GeometryMixture(
        16, 2, ["dot", {"name": "poincare"}, GeometricAttention(16, 2, "sphere")], gate_hidden=8
    ).double()
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    gate = mixture.gate(x)
    assert gate.shape == (3, 5, 3)
    torch.testing.assert_close(gate.sum(-1), torch.ones(3, 5, dtype=torch.float64), **F64)
    assert bool((gate > 0).all())
    expected = sum(gate[..., i : i + 1] * expert(x) for i, expert in enumerate(mixture.experts))
    torch.testing.assert_close(mixture(x), expected, **F64)
    assert [type(e.geometry).__name__ for e in mixture.experts] == [
        "DotProduct",
        "PoincareBall",
        "Sphere",
    ]


def test_mixture_argument_errors():
    with pytest.raises(ValueError, match="at least one expert"):
        GeometryMixture(8, 2, [])
    with pytest.raises(ValueError, match="needs a 'name'"):
        GeometryMixture(8, 2, [{"kappa": 0.1}])
    with pytest.raises(ValueError, match="unknown geometry"):
        GeometryMixture(8, 2, ["klein"])


def _tiny_model(attention: nn.Module | None = None, geometry: str = "dot") -> nn.ModuleDict:
    torch.manual_seed(0)
    layer = GeometricTransformerLayer(32, 2, geometry, attention=attention, mlp_hidden=64)
    return nn.ModuleDict(
        {"tokens": nn.Embedding(8, 32), "positions": nn.Embedding(8, 32), "layer": layer,
         "head": nn.Linear(32, 8)}
    )  # fmt: skip


def _train_copy_first_token(model: nn.ModuleDict, steps: int = 60, **layer_kwargs):
    """Every position must predict the sequence's first token: information has to move through
    attention. Returns the first and the last loss."""
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 8, (64, 8), generator=generator)
    target = tokens[:, :1].expand(-1, 8)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        hidden = model["tokens"](tokens) + model["positions"].weight
        logits = model["head"](model["layer"](hidden, **layer_kwargs))
        loss = nn.functional.cross_entropy(logits.reshape(-1, 8), target.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses[0], losses[-1]


GRID = torch.stack(torch.meshgrid(torch.arange(2.0), torch.arange(4.0), indexing="ij"), -1)

LAYER_ATTENTIONS = {
    "riemann_so2_locality": (
        lambda: RiemannAttention(32, 2, locality_sigma=4.0, learn_sigma=True),
        {},
    ),
    "riemann_so4": (
        lambda: RiemannAttention(32, 2, transport="so4", axes="learnable"),
        {"positions": GRID.reshape(-1, 2)},
    ),
    "mixture": (lambda: GeometryMixture(32, 2, ["dot", "poincare", {"name": "cone"}]), {}),
}


@pytest.mark.parametrize("name", sorted(GEOMETRIES) + sorted(LAYER_ATTENTIONS))
def test_transformer_layer_trains_with_every_geometry(name):
    """Loss falls by half in 60 steps with every registered geometry, RiemannFormer attention
    (1-D and 2-D) and a mixture of geometries."""
    layer_kwargs = {}
    if name in LAYER_ATTENTIONS:
        build, layer_kwargs = LAYER_ATTENTIONS[name]
        model = _tiny_model(build())
    else:
        model = _tiny_model(geometry=name)
    first, last = _train_copy_first_token(model, **layer_kwargs)
    assert last < first / 2, (first, last)


def test_transformer_layer_post_norm_and_masks():
    layer = GeometricTransformerLayer(16, 2, "euclidean", norm_first=False).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    causal = layer(x, causal=True)
    # with a causal mask, the first token's output ignores later tokens
    changed = x.clone()
    changed[:, 1:] += 1
    torch.testing.assert_close(layer(changed, causal=True)[:, 0], causal[:, 0], **F64)
    expected_attention = layer.attention(x, causal=True)
    h = layer.attention_norm(x + expected_attention)
    torch.testing.assert_close(causal, layer.mlp_norm(h + layer.mlp(h)), **F64)


def _product_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), GeometricAttention(16, 2, "product"), nn.LayerNorm(16))


def test_curriculum_freezes_exactly_the_named_groups_per_phase():
    model = _product_model()
    curriculum = GeometricCurriculum(model)
    assert set(curriculum.groups) == {"base", "sphere", "euclidean", "hyperbolic"}
    by_group = {
        group: {id(p) for p in parameters} for group, parameters in curriculum.groups.items()
    }
    expected_frozen = [{"euclidean", "hyperbolic"}, {"hyperbolic"}, set(), set()]
    for index, phase in enumerate(CURRICULUM_PHASES):
        groups = curriculum.enter(index, lr=1e-3)
        assert curriculum.frozen(index) == expected_frozen[index]
        assert curriculum.frozen(phase.name) == expected_frozen[index]
        for group, ids in by_group.items():
            trainable = group not in expected_frozen[index]
            for name, parameter in model.named_parameters():
                if id(parameter) in ids:
                    assert parameter.requires_grad == trainable, (phase.name, name)
        assert {g["group"] for g in groups} == set(by_group) - expected_frozen[index]
        assert all(g["lr"] == pytest.approx(1e-3 * phase.lr_scale) for g in groups)
    assert [p.lr_scale for p in CURRICULUM_PHASES] == [1.0, 0.1, 0.1, 1.0]


def test_curriculum_groups_and_errors():
    assert component_group("1.geometry.maps.sphere") == "sphere"
    assert component_group("1.geometry.raw_weights.hyperbolic") == "hyperbolic"
    assert component_group("1.q_proj.weight") == "base"
    curriculum = GeometricCurriculum(_product_model())
    with pytest.raises(ValueError, match="unknown phase"):
        curriculum.enter("warmup", 1e-3)
    with pytest.raises(ValueError, match=r"phase in \[0, 3\]"):
        curriculum.enter(4, 1e-3)


def test_a_phase_trains_only_its_groups():
    model = _product_model()
    curriculum = GeometricCurriculum(model)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.SGD(curriculum.enter("spherical", lr=0.1))
    model(torch.randn(4, 6, 8)).square().sum().backward()
    optimizer.step()
    for name, parameter in model.named_parameters():
        moved = not torch.equal(parameter, before[name])
        assert moved == (component_group(name) in ("base", "sphere")), name


@pytest.mark.parametrize("kappa", [-1.0, -0.3, 0.5])
def test_riemannian_gradient_and_expmap_match_geoopt(kappa):
    manifold = geoopt.Stereographic(k=torch.tensor(kappa, dtype=torch.float64))
    x = manifold.projx(torch.randn(5, 4, dtype=torch.float64) * 0.3)
    grad = torch.randn(5, 4, dtype=torch.float64)
    torch.testing.assert_close(
        riemannian_gradient(x, grad, kappa), manifold.egrad2rgrad(x, grad), **F64
    )
    u = torch.randn(5, 4, dtype=torch.float64) * 0.2
    torch.testing.assert_close(expmap(x, u, kappa), manifold.expmap(x, u), **F64)


def test_poincare_riemannian_gradient_has_the_quarter():
    x = torch.tensor([[0.6, 0.0]], dtype=torch.float64)
    grad = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
    torch.testing.assert_close(riemannian_gradient(x, grad), (0.64**2 / 4) * grad, **F64)


def test_riemannian_sgd_moves_a_ball_point_to_its_target_and_stays_inside():
    target = torch.tensor([0.9, -0.3], dtype=torch.float64)
    point = nn.Parameter(torch.tensor([-0.8, 0.5], dtype=torch.float64))
    optimizer = RiemannianSGD([point], lr=0.3)
    ball = geoopt.PoincareBall()
    for _ in range(200):
        optimizer.zero_grad()
        ball.dist(point, target).square().backward()
        optimizer.step()
        assert point.detach().norm() < 1
    assert ball.dist(point.detach(), target) < 1e-6
    with pytest.raises(ValueError, match="lr > 0"):
        RiemannianSGD([point], lr=0.0)
