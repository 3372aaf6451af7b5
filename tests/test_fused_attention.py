"""Fused dense attention (docs/mathematics.md, "Fused dense attention"): a geometry's product
form (`score_terms`) equals its `score`, and attention through it equals attention that scores
every tile with `score`, in value and in gradient."""

import pytest
import torch

from rewa.attention import cuda_kernel, dense_attention, merge_attention, merge_stacked
from rewa.attention.numerics import NearScreens, apply_stages_
from tests.support import FUSED, TOLERANCES, build_geometry

F64 = TOLERANCES[torch.float64]

IDS = [f"{name}-{options}" for name, options in FUSED]


def inputs(dtype, nq=67, nk=150, d=8, dv=5, batch=(2, 3), seed=0):
    generator = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(*batch, n, d, generator=generator, dtype=dtype) for n in (nq, nk))
    v = torch.randn(*batch, nk, dv, generator=generator, dtype=dtype)
    return q, k, v


def logits_from_terms(terms):
    total = 0
    for term in terms:
        product = term.queries @ term.keys.transpose(-1, -2)
        value = apply_stages_(product, term.stages)
        total = total + term.weight * value
    return total


def without_product_form(monkeypatch, geometry):
    """Make `geometry` score every tile with `score`, the path without a product form."""
    monkeypatch.setattr(type(geometry), "score_terms", lambda self, qw, kw: None)


@pytest.mark.parametrize(("name", "options"), FUSED, ids=IDS)
def test_score_terms_sum_to_the_dense_logits(name, options):
    g = build_geometry(name, 8, heads=3, **options)
    q, k, _ = inputs(torch.float64)
    with torch.no_grad():
        qw, kw = g.witness(q), g.witness(k)
        terms = g.score_terms(qw, kw)
        assert terms is not None
        torch.testing.assert_close(logits_from_terms(terms), g.score(qw, kw), **F64)


@pytest.mark.parametrize(("name", "options"), FUSED, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_forward_equals_scoring_every_tile(name, options, dtype, monkeypatch):
    g = build_geometry(name, 8, heads=3, **options).to(dtype)
    q, k, v = inputs(dtype)
    mask = torch.rand(2, 1, 67, 150, generator=torch.Generator().manual_seed(1)) > 0.2
    chunks = {"q_chunk": 16, "k_chunk": 40}
    with torch.no_grad():
        fused = [
            dense_attention(q, k, v, g, **chunks),
            dense_attention(q, k, v, g, causal=True, **chunks),
            dense_attention(q, k, v, g, mask=mask, **chunks),
        ]
        without_product_form(monkeypatch, g)
        tiled = [
            dense_attention(q, k, v, g, **chunks),
            dense_attention(q, k, v, g, causal=True, **chunks),
            dense_attention(q, k, v, g, mask=mask, **chunks),
        ]
    tolerance = F64 if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    for (out, lse), (expected_out, expected_lse) in zip(fused, tiled, strict=True):
        torch.testing.assert_close(out, expected_out, **tolerance)
        torch.testing.assert_close(lse, expected_lse, **tolerance)


@pytest.mark.parametrize(("name", "options"), FUSED, ids=IDS)
def test_gradients_equal_with_and_without_product_form(name, options, monkeypatch):
    g = build_geometry(name, 8, heads=3, **options)
    q, k, v = inputs(torch.float64, nq=31, nk=45)

    def gradients():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        params = [p for p in g.parameters() if p.requires_grad]
        for p in params:
            p.grad = None
        out, lse = dense_attention(*leaves, g, causal=True, q_chunk=8, k_chunk=16)
        (out.square().sum() + lse.sin().sum()).backward()
        return [t.grad for t in leaves] + [p.grad.clone() for p in params]

    fused = gradients()
    without_product_form(monkeypatch, g)
    tiled = gradients()
    assert len(fused) >= 3
    for grad, expected in zip(fused, tiled, strict=True):
        torch.testing.assert_close(grad, expected, **F64)


def test_mixed_curvature_signs_have_no_product_form():
    g = build_geometry("kappa", 8, heads=3, kappa=[-0.7, 0.4, 0.0])
    with torch.no_grad():
        qw = g.witness(torch.randn(3, 5, 8, dtype=torch.float64))
        assert g.score_terms(qw, qw) is None


def test_zero_curvature_being_learned_has_no_product_form():
    """With a gradient in kappa at 0 the distance needs the series of arsin_k."""
    g = build_geometry("kappa", 8, kappa=0.0, learnable_kappa=True)
    qw = g.witness(torch.randn(5, 8, dtype=torch.float64))
    assert g.score_terms(qw, qw) is None
    with torch.no_grad():
        assert g.score_terms(qw, qw) is not None


@pytest.mark.parametrize("name", ["adaptive_product", "cone"])
def test_geometries_without_product_form_score_every_tile(name):
    g = build_geometry(name, 8)
    q, k, v = inputs(torch.float64, batch=())
    with torch.no_grad():
        assert g.score_terms(g.witness(q), g.witness(k)) is None
        out, _ = dense_attention(q, k, v, g, q_chunk=16, k_chunk=40)
        weights = torch.softmax(g.logits(q, k), dim=-1)
    torch.testing.assert_close(out, weights @ v, **F64)


def test_kernel_packing_keeps_every_terms_product_and_weight():
    """The CUDA kernel's operands (attention/cuda_kernel.py): each term padded to a power of two
    of at least 16 and concatenated; one weight per term and batch row; stage codes by name."""
    g = build_geometry("product", 20, heads=3)
    q, k, _ = inputs(torch.float64, d=20, batch=(2, 3))
    with torch.no_grad():
        terms = g.score_terms(g.witness(q), g.witness(k))
        packed = cuda_kernel.pack_terms(terms, torch.Size((2, 3)))
    # Components of 5, 10 and 5 dimensions: 7, 11 and 7 columns, padded to 16 (no extras).
    assert packed.widths == (16, 16, 16) and packed.extras == (0, 0, 0)
    assert packed.codes == ((2, 0), (3, 0), (4, 0))  # sqrt, arcsin_of_root, acosh1p
    assert packed.queries.shape == (6, 67, 48) and packed.keys.shape == (6, 150, 48)
    assert packed.query_extra.shape == (6, 67, 6) and not packed.query_extra.any()
    start = 0
    for i, (term, width) in enumerate(zip(terms, packed.widths, strict=True)):
        columns = slice(start, start + width)
        product = packed.queries[..., columns] @ packed.keys[..., columns].transpose(-1, -2)
        expected = (term.queries @ term.keys.transpose(-1, -2)).reshape(6, 67, 150)
        torch.testing.assert_close(product, expected, **F64)
        weight = torch.as_tensor(term.weight).reshape(3).to(torch.float32)
        torch.testing.assert_close(packed.weights[:, i], weight.repeat(2))
        start += width
    assert packed.weights.shape == (6, cuda_kernel.MAX_TERMS)


@pytest.mark.parametrize(
    ("width", "split"), [(1, (16, 0)), (16, (16, 0)), (18, (16, 2)), (19, (32, 0)), (66, (64, 2))]
)
def test_kernel_main_blocks_are_powers_of_two_and_two_extras_at_most(width, split):
    assert cuda_kernel.split_width(width) == split


@pytest.mark.parametrize("name", ["euclidean", "sphere", "poincare", "product"])
def test_kernel_extra_columns_complete_the_products(name):
    """Width 64 (+ 1 or 2 Gram columns): the main block's product plus the rank-one products of
    the extra columns is each term's product."""
    g = build_geometry(name, 64, heads=2)
    q, k, _ = inputs(torch.float64, d=64, batch=(2,))
    with torch.no_grad():
        terms = g.score_terms(g.witness(q), g.witness(k))
        packed = cuda_kernel.pack_terms(terms, torch.Size((2,)))
    assert sum(packed.extras) > 0
    start = 0
    for slot, (term, width, extra) in enumerate(
        zip(terms, packed.widths, packed.extras, strict=True)
    ):
        main = slice(start, start + width)
        product = packed.queries[..., main] @ packed.keys[..., main].transpose(-1, -2)
        for column in range(slot * 2, slot * 2 + extra):
            product = product + (
                packed.query_extra[..., column, None] * packed.key_extra[..., None, :, column]
            )
        expected = term.queries @ term.keys.transpose(-1, -2)
        torch.testing.assert_close(product, expected.expand_as(product), **F64)
        start += width


@pytest.mark.parametrize("name", ["euclidean", "sphere", "poincare", "product"])
def test_kernel_near_operands_give_the_cpu_screen_and_the_direct_distances(name):
    """The kernel recomputes near pairs as `numerics.refine_near_pairs` does on the CPU: from
    its per-point numbers, `r0 c0 + r1 c1` is the screen's bound of every pair and
    `r2 c2 |x_i - y_j|^2` the pair's weighted squared distance (PackedTerms)."""
    g = build_geometry(name, 12, heads=3).float()
    q, k, _ = inputs(torch.float32, d=12, batch=(2, 3))
    with torch.no_grad():
        terms = g.score_terms(g.witness(q), g.witness(k))
        packed = cuda_kernel.pack_terms(terms, torch.Size((2, 3)))
    assert all(term.near is not None for term in terms)
    offset = 0
    for slot, (term, dim) in enumerate(zip(terms, packed.near_dims[: len(terms)], strict=True)):
        x, y, x_weight, y_weight, factor = term.near
        assert dim == x.shape[-1]
        r0, r1, r2 = (packed.near_rows[..., 3 * slot + i, None] for i in range(3))
        c0, c1, c2 = (packed.near_cols[..., None, :, 3 * slot + i] for i in range(3))
        screen = NearScreens(x, y, x_weight, y_weight, factor, torch.float32)
        x2, y2 = (t.expand(2, 3, -1).reshape(6, -1) for t in (screen.x2, screen.y2))
        xw, yw = (t.expand(2, 3, -1).reshape(6, -1) for t in (screen.x_weight, screen.y_weight))
        bound = (
            screen.scale
            * (x2[..., :, None] + y2[..., None, :])
            * (xw[..., :, None] * yw[..., None, :])
        )
        torch.testing.assert_close(r0 * c0 + r1 * c1, bound, rtol=1e-6, atol=0)
        xs = packed.near_queries[..., offset : offset + dim]
        ys = packed.near_keys[..., offset : offset + dim]
        direct = r2 * c2 * torch.cdist(xs.double(), ys.double()).square()
        weights = 1.0 if x_weight is None else x_weight[..., :, None] * y_weight[..., None, :]
        expected = factor * weights * torch.cdist(x.double(), y.double()).square()
        torch.testing.assert_close(direct, expected.expand(2, 3, -1, -1).reshape(6, 67, 150))
        offset += dim
    assert packed.near_queries.shape == (6, 67, offset)


def test_kernel_near_operands_are_empty_without_near_pairs():
    g = build_geometry("dot", 8)
    q, k, _ = inputs(torch.float32, d=8, batch=(2,))
    packed = cuda_kernel.pack_terms(g.score_terms(g.witness(q), g.witness(k)), torch.Size((2,)))
    assert packed.near_dims == (0, 0, 0)
    assert not packed.near_rows.any() and not packed.near_cols.any()


def test_kernel_splits_keys_only_where_query_blocks_leave_the_gpu_idle():
    # One head of 8192 queries: 128 blocks of 64 rows for 132 multiprocessors, so 5 ranges.
    assert cuda_kernel.key_splits(1, 8192, 8192, 132) == 5
    assert cuda_kernel.key_splits(8, 8192, 8192, 132) == 1  # 1024 blocks: enough
    assert cuda_kernel.key_splits(1, 32768, 32768, 132) == 2
    assert cuda_kernel.key_splits(32, 1, 131072, 132) == 17  # a decode step
    assert cuda_kernel.key_splits(1, 4, 1500, 132) == 1  # ranges of at least 1024 keys
    assert cuda_kernel.key_splits(1, 4, 0, 132) == 1


@pytest.mark.parametrize("dim", [0, 1])
def test_stacked_parts_merge_as_attention_over_their_union(dim):
    """`merge_stacked` of per-range `(out, lse)` stacked on `dim` (the kernel's key ranges on 0,
    the IVF lists of a query on 1) is `merge_attention` of the parts, rows that no range saw
    included (0, -inf)."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 12, generator=generator, dtype=torch.float64)
    logits[:, 0] = float("-inf")
    values = torch.randn(2, 12, 3, generator=generator, dtype=torch.float64)
    parts = []
    for keys in (slice(0, 4), slice(4, 8), slice(8, 12)):
        part_logits = logits[..., keys].clone()
        part_logits[1, 2] = float("-inf")  # a row one range does not see
        lse = part_logits.logsumexp(-1)
        out = torch.softmax(part_logits, -1).nan_to_num(0.0) @ values[:, keys]
        parts.append((out, lse))
    out, lse = merge_stacked(
        torch.stack([p[0] for p in parts], dim), torch.stack([p[1] for p in parts], dim), dim
    )
    expected_out, expected_lse = merge_attention(*parts)
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(lse, expected_lse)
    assert (out[:, 0] == 0).all() and torch.isneginf(lse[:, 0]).all()


def test_kernel_applies_only_to_float32_cuda_calls_without_a_user_mask(monkeypatch):
    g = build_geometry("euclidean", 8)
    qw = torch.randn(5, 8)
    terms = g.score_terms(qw, qw)
    assert not cuda_kernel.applies(qw, terms, None)  # a CPU tensor

    class FakeCuda:
        device = torch.device("cuda")
        dtype = torch.float32

    monkeypatch.setattr(cuda_kernel, "available", lambda: True)
    assert cuda_kernel.applies(FakeCuda(), terms, None)
    assert not cuda_kernel.applies(FakeCuda(), terms, torch.ones(5, 5, dtype=torch.bool))
    assert not cuda_kernel.applies(FakeCuda(), None, None)
    assert not cuda_kernel.applies(FakeCuda(), terms * 4, None)
    FakeCuda.dtype = torch.float64
    assert not cuda_kernel.applies(FakeCuda(), terms, None)
    monkeypatch.setattr(cuda_kernel, "available", lambda: False)
    FakeCuda.dtype = torch.float32
    assert not cuda_kernel.applies(FakeCuda(), terms, None)
