"""Exact dense attention against a naive float64 softmax, for every geometry (docs/mathematics.md 1,
7)."""

import math

import pytest
import torch
from torch.nn import functional as F

from benchmarks.measure import current_rss_bytes, peak_rss_bytes, reset_peak_rss
from rewa.attention import (
    DotProduct,
    cpu_kernel,
    dense_attention,
    merge_attention,
    witness_attention,
)
from rewa.attention.dense import cpu_query_chunk
from tests import reference
from tests.support import GEOMETRY_NAMES, build_geometry

F64 = {"rtol": 1e-10, "atol": 1e-12}


def inputs(nq=23, nk=37, d=8, dv=5, batch=(2, 3)):
    q = torch.randn(*batch, nq, d, dtype=torch.float64)
    k = torch.randn(*batch, nk, d, dtype=torch.float64)
    v = torch.randn(*batch, nk, dv, dtype=torch.float64)
    return q, k, v


def naive(q, k, v, geometry, allowed=None):
    return reference.dense_softmax_attention(geometry.logits(q, k), v, allowed)


@pytest.mark.parametrize("name", GEOMETRY_NAMES)
@pytest.mark.parametrize("chunks", [(4, 5), (512, 4096)])
def test_equals_naive_softmax(name, chunks):
    g = build_geometry(name, 8, heads=3)
    q, k, v = inputs()
    out, lse = dense_attention(q, k, v, g, q_chunk=chunks[0], k_chunk=chunks[1])
    expected_out, expected_lse = naive(q, k, v, g)
    torch.testing.assert_close(out, expected_out, **F64)
    torch.testing.assert_close(lse, expected_lse, **F64)


@pytest.mark.parametrize("name", GEOMETRY_NAMES)
@pytest.mark.parametrize("nq", [37, 12])
def test_causal_is_aligned_bottom_right(name, nq):
    g = build_geometry(name, 8, heads=3)
    q, k, v = inputs(nq=nq, nk=37)
    allowed = torch.ones(nq, 37, dtype=torch.bool).tril(37 - nq)
    out, lse = dense_attention(q, k, v, g, causal=True, q_chunk=5, k_chunk=7)
    expected_out, expected_lse = naive(q, k, v, g, allowed)
    torch.testing.assert_close(out, expected_out, **F64)
    torch.testing.assert_close(lse, expected_lse, **F64)


@pytest.mark.parametrize("name", GEOMETRY_NAMES)
def test_boolean_and_additive_masks(name):
    g = build_geometry(name, 8, heads=3)
    q, k, v = inputs()
    allowed = torch.rand(2, 1, 23, 37) > 0.3
    out, lse = dense_attention(q, k, v, g, mask=allowed, q_chunk=6, k_chunk=8)
    expected_out, expected_lse = naive(q, k, v, g, allowed)
    torch.testing.assert_close(out, expected_out, **F64)
    torch.testing.assert_close(lse, expected_lse, **F64)

    bias = torch.randn(23, 37, dtype=torch.float64)
    out, lse = dense_attention(q, k, v, g, mask=bias, q_chunk=6, k_chunk=8)
    expected_out, expected_lse = reference.dense_softmax_attention(g.logits(q, k) + bias, v)
    torch.testing.assert_close(out, expected_out, **F64)
    torch.testing.assert_close(lse, expected_lse, **F64)


def test_key_padding_mask_and_fully_masked_rows():
    g = build_geometry("poincare", 8)
    q, k, v = inputs(batch=(2,))
    padding = torch.ones(2, 1, 37, dtype=torch.bool)
    padding[1, :, 30:] = False
    out, lse = dense_attention(q, k, v, g, mask=padding, q_chunk=8, k_chunk=8)
    expected_out, _ = naive(q[1:], k[1:, :30], v[1:, :30], g)
    torch.testing.assert_close(out[1:], expected_out, **F64)

    nothing = torch.zeros(23, 37, dtype=torch.bool)
    nothing[::2] = True
    out, lse = dense_attention(q, k, v, g, mask=nothing, q_chunk=8, k_chunk=8)
    assert torch.equal(out[:, 1::2], torch.zeros_like(out[:, 1::2]))
    assert torch.isneginf(lse[:, 1::2]).all() and torch.isfinite(lse[:, ::2]).all()


@pytest.mark.parametrize("name", GEOMETRY_NAMES)
def test_merging_the_two_halves_equals_the_whole(name):
    g = build_geometry(name, 8, heads=3)
    q, k, v = inputs()
    whole = dense_attention(q, k, v, g)
    first = dense_attention(q, k[..., :15, :], v[..., :15, :], g)
    second = dense_attention(q, k[..., 15:, :], v[..., 15:, :], g)
    merged = merge_attention(first, second)
    torch.testing.assert_close(merged[0], whole[0], **F64)
    torch.testing.assert_close(merged[1], whole[1], **F64)


def test_merge_handles_parts_that_saw_no_key():
    out = torch.randn(4, 3, dtype=torch.float64)
    lse = torch.randn(4, dtype=torch.float64)
    empty = (torch.zeros(4, 3, dtype=torch.float64), torch.full((4,), -math.inf))
    merged_out, merged_lse = merge_attention((out, lse), empty)
    torch.testing.assert_close(merged_out, out)
    torch.testing.assert_close(merged_lse, lse)
    none_out, none_lse = merge_attention(empty, empty)
    assert torch.equal(none_out, empty[0]) and torch.isneginf(none_lse).all()
    with pytest.raises(ValueError):
        merge_attention()


@pytest.mark.parametrize("shape", [(300, 16), (3, 300, 16)])
def test_fused_dot_product_path_takes_any_leading_shape(shape):
    q, k, v = (torch.randn(*shape) for _ in range(3))
    out, lse = dense_attention(q, k, v, DotProduct(16))
    tiled_out, tiled_lse = dense_attention(q, k, v, DotProduct(16), mask=torch.zeros(1, 1))
    torch.testing.assert_close(out, tiled_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, tiled_lse, rtol=1e-5, atol=1e-5)


def test_one_dimensional_key_mask():
    g = build_geometry("sphere", 8)
    q, k, v = inputs(batch=(2,))
    keep = torch.arange(37) % 3 > 0
    out, lse = dense_attention(q, k, v, g, mask=keep, q_chunk=8, k_chunk=8)
    expected_out, expected_lse = naive(q, k[:, keep], v[:, keep], g)
    torch.testing.assert_close(out, expected_out, **F64)
    torch.testing.assert_close(lse, expected_lse, **F64)


def test_dot_product_fast_path_equals_sdpa_and_the_tiled_kernel():
    q, k, v = (torch.randn(2, 4, 300, 16) for _ in range(3))
    g = DotProduct(16)
    out, lse = dense_attention(q, k, v, g, causal=True)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    logits = (q @ k.transpose(-1, -2) / 4).masked_fill(
        ~torch.ones(300, 300, dtype=torch.bool).tril(), -math.inf
    )
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1))
    mask = torch.ones(300, 300, dtype=torch.bool).tril()  # a mask forces the tiled kernel
    tiled_out, tiled_lse = dense_attention(q, k, v, g, mask=mask, q_chunk=64, k_chunk=64)
    torch.testing.assert_close(tiled_out, out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tiled_lse, lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["dot", "poincare", "product"])
def test_half_precision_inputs_accumulate_in_float32(name, dtype):
    g = build_geometry(name, 8).float()
    q, k, v = (t.float() for t in inputs(batch=(2,)))
    out, lse = dense_attention(q.to(dtype), k.to(dtype), v.to(dtype), g)
    assert out.dtype == dtype and lse.dtype == torch.float32
    expected_out, expected_lse = dense_attention(
        q.to(dtype).float(), k.to(dtype).float(), v.to(dtype).float(), g
    )
    torch.testing.assert_close(out.float(), expected_out, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-4, atol=1e-4)


def test_memory_stays_bounded_by_the_tile():
    """A 16384-token self-attention holds tiles, never the N x N logits (1 GiB in float32): the
    peak resident memory grows by far less than that."""
    g = build_geometry("sphere", 16).float()
    q, k, v = (torch.randn(16384, 16) for _ in range(3))
    with torch.no_grad():
        dense_attention(q, k, v, g, q_chunk=256, k_chunk=1024)
    # The first call may start compiling the tiles (attention/cpu_kernel.py): the compiler's
    # memory is not the call's, so the measured call starts after it has finished.
    assert cpu_kernel.wait(timeout=300)
    reset_peak_rss()
    baseline = current_rss_bytes()
    with torch.no_grad():
        dense_attention(q, k, v, g, q_chunk=256, k_chunk=1024)
    growth = peak_rss_bytes() - baseline
    assert growth < 128 * 2**20, f"peak RSS grew by {growth / 2**20:.0f} MiB"


def test_cpu_tiles_hold_a_fixed_number_of_logits_over_the_batch():
    assert [cpu_query_chunk(batch, 1024) for batch in (1, 2, 8, 12, 64, 4096)] == [
        2048, 1024, 256, 128, 64, 64,
    ]  # fmt: skip
    assert cpu_query_chunk(3, 2048) == 256  # 2^21 / 6144 = 341, the power of two below
    # The default tiles (here 2048 x 1024 for one head, 3 query and 5 key tiles) and the
    # given ones compute the same attention.
    g = build_geometry("poincare", 8).double()
    q, k, v = (torch.randn(5000, 8, dtype=torch.float64) * 0.2 for _ in range(3))
    with torch.no_grad():
        tiled = dense_attention(q, k, v, g)
        expected = dense_attention(q, k, v, g, q_chunk=5000, k_chunk=5000)
    torch.testing.assert_close(tiled, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"q": torch.randn(4, 7)}, ValueError, "last dimension 8"),
        ({"v": torch.randn(5, 3)}, ValueError, "as many values as keys"),
        ({"mask": torch.ones(3, 4, 5, dtype=torch.bool)}, ValueError, "broadcast"),
        ({"mask": torch.ones(4, 6, dtype=torch.int64)}, TypeError, "boolean or floating"),
        ({"q": torch.ones(4, 8, dtype=torch.int64)}, TypeError, "floating-point q"),
        ({"q_chunk": 0}, ValueError, "positive chunk"),
    ],
)
def test_bad_inputs_raise_clear_errors(kwargs, error, match):
    g = build_geometry("euclidean", 8).float()
    arguments = {"q": torch.randn(4, 8), "k": torch.randn(6, 8), "v": torch.randn(6, 3)}
    arguments.update(kwargs)
    options = {key: arguments.pop(key) for key in ("mask", "q_chunk") if key in arguments}
    with pytest.raises(error, match=match):
        dense_attention(arguments["q"], arguments["k"], arguments["v"], g, **options)


@pytest.mark.parametrize("name", ["dot", "product"])
@pytest.mark.parametrize(
    ("q_batch", "k_batch", "v_batch", "mask_batch"),
    [
        ((1, 3), (1, 3), (2, 3), None),  # values with a batch dimension q and k lack
        ((3,), (1, 3), (2, 1, 1), None),
        ((1, 3), (1, 3), (1, 3), (2, 1)),  # a mask with one
        ((2, 3), (1, 3), (1, 3), (2, 3)),
    ],
)
def test_inputs_broadcast_over_their_batch_dimensions(name, q_batch, k_batch, v_batch, mask_batch):
    """q, k, v and the mask broadcast against each other, whichever has a batch dimension the
    others lack: the attention of the expanded inputs."""
    g = build_geometry(name, 8, heads=3)
    q = torch.randn(*q_batch, 11, 8, dtype=torch.float64)
    k = torch.randn(*k_batch, 13, 8, dtype=torch.float64)
    v = torch.randn(*v_batch, 13, 5, dtype=torch.float64)
    mask = None if mask_batch is None else torch.rand(*mask_batch, 11, 13) > 0.3
    batch = torch.broadcast_shapes(q_batch, k_batch, v_batch, mask_batch or ())
    out, lse = dense_attention(q, k, v, g, mask=mask, q_chunk=4, k_chunk=5)
    expanded = [t.expand(*batch, *t.shape[-2:]) for t in (q, k, v)]
    allowed = None if mask is None else mask.expand(*batch, 11, 13)
    expected_out, expected_lse = naive(*expanded, g, allowed)
    assert out.shape == (*batch, 11, 5) and lse.shape == (*batch, 11)
    torch.testing.assert_close(out, expected_out, **F64)
    torch.testing.assert_close(lse, expected_lse, **F64)


def test_gradients_reach_inputs_that_broadcast():
    """Values with a batch dimension that q and k lack: q's and k's gradients sum over it, as
    autograd does for the naive attention of the expanded inputs."""
    g = build_geometry("product", 8, heads=3)
    leaves = [
        torch.randn(1, 3, 11, 8, dtype=torch.float64),
        torch.randn(1, 3, 13, 8, dtype=torch.float64),
        torch.randn(2, 3, 13, 5, dtype=torch.float64),
    ]

    def gradients(attend):
        inputs = [t.clone().requires_grad_() for t in leaves]
        out, lse = attend(*inputs)
        (out.square().sum() + lse.sin().sum()).backward()
        return [t.grad for t in inputs]

    got = gradients(lambda q, k, v: dense_attention(q, k, v, g, q_chunk=4, k_chunk=5))
    expected = gradients(lambda q, k, v: naive(q.expand(2, 3, 11, 8), k.expand(2, 3, 13, 8), v, g))
    for value, reference_value in zip(got, expected, strict=True):
        torch.testing.assert_close(value, reference_value, **F64)


@pytest.mark.parametrize("name", GEOMETRY_NAMES)
@pytest.mark.parametrize("causal", [False, True])
def test_no_queries_give_empty_answers_on_the_autograd_graph(name, causal):
    """The dot product's fused kernel takes no empty query set: such a call takes the tiles
    (values as wide as the keys, the shapes the fused kernel would take)."""
    g = build_geometry(name, 8, heads=3)
    q = torch.randn(2, 3, 0, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 3, 5, 8, dtype=torch.float64) for _ in range(2))
    out, lse = dense_attention(q, k, v, g, causal=causal)
    assert out.shape == (2, 3, 0, 8) and lse.shape == (2, 3, 0)
    (out.sum() + lse.sum()).backward()
    assert q.grad.shape == q.shape


@pytest.mark.parametrize("name", GEOMETRY_NAMES)
def test_attention_over_witnesses_is_dense_attention_before_the_output_map(name):
    geometry = build_geometry(name, 8)
    generator = torch.Generator().manual_seed(4)
    q = 0.5 * torch.randn(2, 9, 8, generator=generator, dtype=torch.float64)
    k = 0.5 * torch.randn(2, 300, 8, generator=generator, dtype=torch.float64)
    v = torch.randn(2, 300, 8, generator=generator, dtype=torch.float64)
    out, lse = dense_attention(q, k, v, geometry)
    found, found_lse = witness_attention(geometry.witness(q), geometry.witness(k), v, geometry)
    torch.testing.assert_close(geometry.output_map(found), out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(found_lse, lse, rtol=1e-10, atol=1e-10)
