"""RiemannFormer (docs/mathematics.md 5): PaTE rotations, SO(4) generators, metric scaling and
locality focusing against float64 references built from their formulas in docs/mathematics.md."""

import math

import pytest
import torch

from rewa.attention import DotProduct, make_geometry
from rewa.research import (
    LocalityBias,
    MetricScaling,
    ParallelTransport,
    RiemannAttention,
    isoclinic_generators,
    riemann_attention,
)

from .support import TOLERANCES

F64 = TOLERANCES[torch.float64]


def _transport(kind: str, axes: str = "fixed", heads: int = 1, dim: int = 8) -> ParallelTransport:
    transport = ParallelTransport(dim, heads, kind, axes=axes, base=50.0).double()
    if axes != "fixed":  # move learnable axes away from their initial values
        with torch.no_grad():
            transport.left_axes.copy_(torch.randn_like(transport.left_axes))
            transport.right_axes.copy_(torch.randn_like(transport.right_axes))
    return transport


def _positions(kind: str, n: int) -> torch.Tensor:
    return torch.randn(n, dtype=torch.float64) * 5 if kind == "so2" else torch.randn(n, 2) * 5


def _relative_logits(transport, q, k, pq, pk) -> torch.Tensor:
    return transport(q, pq) @ transport(k, pk).transpose(-1, -2)


@pytest.mark.parametrize(
    ("kind", "axes", "heads"),
    [("so2", "fixed", 1), ("so4", "fixed", 1), ("so4", "shared", 1), ("so4", "learnable", 3)],
)
def test_pate_inner_products_depend_only_on_position_differences(kind, axes, heads):
    transport = _transport(kind, axes, heads)
    q = torch.randn(heads, 6, 8, dtype=torch.float64)
    k = torch.randn(heads, 9, 8, dtype=torch.float64)
    pq, pk = _positions(kind, 6).double(), _positions(kind, 9).double()
    shift = torch.tensor(3.7, dtype=torch.float64) if kind == "so2" else torch.tensor([-2.5, 4.1])
    logits = _relative_logits(transport, q, k, pq, pk)
    shifted = _relative_logits(transport, q, k, pq + shift.double(), pk + shift.double())
    torch.testing.assert_close(shifted, logits, **F64)
    # <R(p_i) q, R(p_j) k> == <q, R(p_j - p_i) k> for every pair
    differences = pk.unsqueeze(0) - pq.unsqueeze(1)  # (6, 9) or (6, 9, 2)
    flat = differences.reshape(54, *differences.shape[2:])
    per_pair = transport.matrix(flat).reshape(-1, 6, 9, 8, 8).expand(heads, 6, 9, 8, 8)
    relative = torch.einsum("hid,hijde,hje->hij", q, per_pair, k)
    torch.testing.assert_close(relative, logits, **F64)
    assert not torch.allclose(logits, q @ k.transpose(-1, -2))  # the rotation does something


def test_so2_pairs_rotate_by_position_times_frequency():
    transport = ParallelTransport(4, kind="so2", base=100.0).double()
    matrix = transport.matrix(torch.tensor([2.0], dtype=torch.float64))[0]
    expected = torch.zeros(4, 4, dtype=torch.float64)
    for block, theta in enumerate((1.0, 100.0 ** (-0.5))):
        c, s = math.cos(2 * theta), math.sin(2 * theta)
        expected[2 * block : 2 * block + 2, 2 * block : 2 * block + 2] = torch.tensor(
            [[c, -s], [s, c]], dtype=torch.float64
        )
    torch.testing.assert_close(matrix, expected, **F64)


def test_isoclinic_generators_commute_and_square_to_minus_identity():
    left, right = isoclinic_generators()
    eye = torch.eye(4, dtype=torch.float64)
    for a in range(3):
        torch.testing.assert_close(left[a] @ left[a], -eye, **F64)
        torch.testing.assert_close(right[a] @ right[a], -eye, **F64)
        torch.testing.assert_close(left[a].T, -left[a], **F64)  # skew: they generate SO(4)
        for b in range(3):
            torch.testing.assert_close(left[a] @ right[b], right[b] @ left[a], **F64)
    # left generators follow the quaternion rule i j = k; right ones the reversed order
    torch.testing.assert_close(left[0] @ left[1], left[2], **F64)
    torch.testing.assert_close(right[0] @ right[1], -right[2], **F64)


@pytest.mark.parametrize(("kind", "axes"), [("so2", "fixed"), ("so4", "learnable")])
def test_every_rotation_is_orthogonal_with_determinant_one(kind, axes):
    transport = _transport(kind, axes, heads=2)
    matrices = transport.matrix(_positions(kind, 7).double()).reshape(-1, 8, 8)
    eye = torch.eye(8, dtype=torch.float64).expand_as(matrices)
    torch.testing.assert_close(matrices.transpose(-1, -2) @ matrices, eye, **F64)
    torch.testing.assert_close(
        torch.linalg.det(matrices), torch.ones(len(matrices), dtype=torch.float64), **F64
    )


def test_so4_block_is_the_product_of_left_and_right_exponentials():
    transport = _transport("so4", "learnable", heads=1, dim=8)
    left, right = isoclinic_generators()
    a, c = transport.axes()
    position = torch.tensor([[1.3, -0.4]], dtype=torch.float64)
    matrix = transport.matrix(position)[0]
    theta = transport.frequencies()
    for block in range(2):
        generator_left = torch.einsum("a,aij->ij", a[0, block], left)
        generator_right = torch.einsum("a,aij->ij", c[0, block], right)
        expected = torch.linalg.matrix_exp(
            1.3 * theta[block] * generator_left
        ) @ torch.linalg.matrix_exp(-0.4 * theta[block] * generator_right)
        rows = slice(4 * block, 4 * block + 4)
        torch.testing.assert_close(matrix[rows, rows], expected, **F64)


def test_so4_needs_dimension_divisible_by_four():
    with pytest.raises(ValueError, match="divisible by 4"):
        ParallelTransport(6, kind="so4")
    with pytest.raises(ValueError, match="divisible by 4"):
        RiemannAttention(12, 2, transport="so4")  # head_dim 6
    with pytest.raises(ValueError, match="divisible by 2"):
        ParallelTransport(5, kind="so2")
    with pytest.raises(ValueError, match="grid positions"):
        RiemannAttention(16, 2, transport="so4")(torch.randn(1, 3, 16))
    with pytest.raises(ValueError, match=r"positions of shape \(3, 2\)"):
        RiemannAttention(16, 2, transport="so4")(torch.randn(1, 3, 16), positions=torch.ones(3))


def _reference(q, k, v, logits_of, s_q=None, s_k=None, sigma=None, pq=None, pk=None, allowed=None):
    """`out_i = s_i sum_j a_ij Lambda_ij s_j v_j` term by term in float64 (docs/mathematics.md
    5)."""
    logits = logits_of(q, k)
    if allowed is not None:
        logits = logits.masked_fill(~allowed, -math.inf)
    weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    if sigma is not None:
        squared = (pq.unsqueeze(-2) - pk.unsqueeze(-3)).square().sum(-1)
        weights = weights * torch.exp(-squared / (2 * sigma**2))
    if s_q is not None:
        weights = s_q.unsqueeze(-1) * weights * s_k.unsqueeze(-2)
    return weights @ v, torch.logsumexp(logits, -1)


@pytest.mark.parametrize("path", ["dense", "sparse"])
@pytest.mark.parametrize("parts", ["scaling", "locality", "both"])
def test_metric_scaling_and_locality_focusing_equal_their_formulas(path, parts):
    heads, nq, nk, d = 2, 5, 12, 8
    geometry = make_geometry("poincare", d, heads).double()
    q = torch.randn(heads, nq, d, dtype=torch.float64) * 0.5
    k = torch.randn(heads, nk, d, dtype=torch.float64) * 0.5
    v = torch.randn(heads, nk, 3, dtype=torch.float64)
    s_q = torch.rand(heads, nq, dtype=torch.float64) * 2
    s_k = torch.rand(heads, nk, dtype=torch.float64) * 2
    pq = torch.randn(nq, 2, dtype=torch.float64) * 3
    pk = torch.randn(nk, 2, dtype=torch.float64) * 3
    sigma = torch.tensor([1.5, 4.0], dtype=torch.float64)
    scaling = parts in ("scaling", "both")
    locality = parts in ("locality", "both")
    kwargs = {"query_scale": s_q, "key_scale": s_k} if scaling else {}
    if locality:
        kwargs |= {
            "locality": LocalityBias(geometry, sigma, position_dim=2).double(),
            "query_positions": pq,
            "key_positions": pk,
        }
    allowed = None
    if path == "sparse":
        candidates = torch.stack([torch.randperm(nk)[:7] for _ in range(heads * nq)])
        candidates = candidates.reshape(heads, nq, 7)
        candidates[0, 0, -2:] = -1  # padding
        kwargs["candidates"] = candidates
        hits = torch.zeros(heads, nq, nk, dtype=torch.long)
        hits.scatter_add_(-1, candidates.clamp_min(0), (candidates >= 0).long())
        allowed = hits > 0
    out, lse = riemann_attention(q, k, v, geometry, **kwargs)
    expected, expected_lse = _reference(
        q,
        k,
        v,
        geometry.logits,
        s_q if scaling else None,
        s_k if scaling else None,
        sigma.double().view(-1, 1, 1) if locality else None,
        pq,
        pk,
        allowed,
    )
    torch.testing.assert_close(out, expected, **F64)
    torch.testing.assert_close(lse, expected_lse, **F64)


def test_locality_focusing_with_causal_mask_and_gradients_reach_sigma():
    geometry = DotProduct(4).double()
    locality = LocalityBias(geometry, torch.tensor(2.0, dtype=torch.float64), learn_sigma=True)
    q = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(6, 4, dtype=torch.float64)
    v = torch.randn(6, 4, dtype=torch.float64)
    positions = torch.arange(6, dtype=torch.float64)
    out, _ = riemann_attention(
        q, k, v, geometry, locality=locality, query_positions=positions,
        key_positions=positions, causal=True,
    )  # fmt: skip
    allowed = torch.ones(6, 6, dtype=torch.bool).tril()
    expected, _ = _reference(
        q, k, v, geometry.logits, sigma=2.0, pq=positions[:, None], pk=positions[:, None],
        allowed=allowed,
    )  # fmt: skip
    torch.testing.assert_close(out, expected, **F64)
    out.square().sum().backward()
    assert locality.log_sigma.grad is not None and locality.log_sigma.grad.abs().sum() > 0
    assert torch.isfinite(q.grad).all()


def test_far_keys_focus_to_zero_without_nans():
    geometry = DotProduct(4).double()
    locality = LocalityBias(geometry, 0.01).double()
    q, k, v = (torch.randn(3, 4, dtype=torch.float64) for _ in range(3))
    out, lse = riemann_attention(
        q, k, v, geometry, locality=locality,
        query_positions=torch.tensor([0.0, 1e3, 2e3], dtype=torch.float64),
        key_positions=torch.tensor([5e3, 6e3, 7e3], dtype=torch.float64),
    )  # fmt: skip
    assert torch.equal(out, torch.zeros_like(out)) and torch.isfinite(lse).all()


def test_metric_scaling_module_is_bounded_by_sqrt_alpha():
    scaling = MetricScaling(8, 3, alpha=9.0)
    s = scaling(torch.randn(2, 5, 8) * 100)
    assert s.shape == (2, 3, 5)
    assert bool((s >= 0).all()) and bool((s <= 3.0).all())
    x = torch.randn(5, 8)
    expected = 3.0 * torch.sigmoid(x @ scaling.proj.weight.T + scaling.proj.bias)
    torch.testing.assert_close(scaling(x), expected.T)


def test_riemann_attention_module_composes_transport_scaling_and_focusing():
    torch.manual_seed(3)
    module = RiemannAttention(
        16, 2, "dot", transport="so4", axes="learnable", locality_sigma=2.5, learn_sigma=True
    ).double()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    positions = torch.randn(2, 6, 2, dtype=torch.float64)
    out, lse = module(x, positions=positions, need_lse=True)
    split = module._split_heads
    q = module.transport(split(module.q_proj(x)), positions.unsqueeze(1))
    k = module.transport(split(module.k_proj(x)), positions.unsqueeze(1))
    v = split(module.v_proj(x))
    s = module.scaling(x)
    heads_out, expected_lse = _reference(
        q, k, v, module.geometry.logits, s, s, module.locality.sigma().double().view(-1, 1, 1),
        positions.unsqueeze(1), positions.unsqueeze(1),
    )  # fmt: skip
    expected = module.out_proj(heads_out.transpose(-2, -3).flatten(-2))
    torch.testing.assert_close(out, expected, **F64)
    torch.testing.assert_close(lse, expected_lse, **F64)
    out.sum().backward()
    for name in ("left_axes", "right_axes"):
        assert getattr(module.transport, name).grad.abs().sum() > 0, name
    assert module.scaling.proj.weight.grad.abs().sum() > 0
    assert module.locality.log_sigma.grad.abs().sum() > 0


def test_riemann_attention_argument_errors():
    geometry = DotProduct(4)
    q = torch.randn(3, 4)
    with pytest.raises(ValueError, match="both query_scale and key_scale"):
        riemann_attention(q, q, q, geometry, query_scale=torch.ones(3))
    with pytest.raises(ValueError, match="query_positions and key_positions"):
        riemann_attention(q, q, q, geometry, locality=LocalityBias(geometry, 1.0))
    with pytest.raises(ValueError, match="wrap the geometry"):
        riemann_attention(
            q, q, q, geometry, locality=LocalityBias(DotProduct(4), 1.0),
            query_positions=torch.zeros(3), key_positions=torch.zeros(3),
        )  # fmt: skip
    with pytest.raises(ValueError, match="positive sigma"):
        LocalityBias(geometry, -1.0)
    with pytest.raises(TypeError, match="no lift"):
        LocalityBias(geometry, 1.0).lift(q, "key")
