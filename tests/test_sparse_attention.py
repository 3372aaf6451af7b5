"""Sparse attention over candidates (docs/mathematics.md 6): exactness, top-K semantics,
gradients."""

import pytest
import torch

from rewa.attention import dense_attention, sparse_attention
from tests.support import GEOMETRY_NAMES, build_geometry


def all_keys(batch, n_queries, n_keys):
    return torch.arange(n_keys).expand(*batch, n_queries, n_keys).clone()


@pytest.mark.parametrize("name", GEOMETRY_NAMES)
def test_equals_dense_when_every_key_is_a_candidate(name):
    g = build_geometry(name, 8, heads=3)
    q = torch.randn(2, 3, 11, 8, dtype=torch.float64)
    k = torch.randn(2, 3, 29, 8, dtype=torch.float64)
    v = torch.randn(2, 3, 29, 5, dtype=torch.float64)
    out, lse = sparse_attention(q, k, v, g, all_keys((2, 3), 11, 29), top_k=29, chunk_elements=500)
    expected_out, expected_lse = dense_attention(q, k, v, g)
    torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, expected_out, rtol=1e-12, atol=1e-12)


def test_top_k_keeps_the_best_candidates_only():
    g = build_geometry("poincare", 6)
    q = torch.randn(7, 6, dtype=torch.float64)
    k = torch.randn(40, 6, dtype=torch.float64)
    v = torch.randn(40, 3, dtype=torch.float64)
    out, lse = sparse_attention(q, k, v, g, all_keys((), 7, 40), top_k=5)
    logits = g.logits(q, k)
    best = logits.topk(5, dim=-1).indices
    allowed = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, best, True)
    expected_out, expected_lse = dense_attention(q, k, v, g, mask=allowed)
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(lse, expected_lse)


def test_padding_and_duplicates_are_ignored():
    g = build_geometry("sphere", 6)
    q, k = torch.randn(4, 6, dtype=torch.float64), torch.randn(10, 6, dtype=torch.float64)
    v = torch.randn(10, 2, dtype=torch.float64)
    rows = torch.tensor([[3, 3, 7, -1], [-1, -1, -1, -1], [0, 9, 9, 9], [5, -1, 2, 5]])
    out, lse = sparse_attention(q, k, v, g, rows, top_k=8)
    for i, keep in enumerate([[3, 7], [], [0, 9], [2, 5]]):
        if not keep:
            assert torch.equal(out[i], torch.zeros(2, dtype=torch.float64))
            assert torch.isneginf(lse[i])
            continue
        expected_out, expected_lse = dense_attention(q[i : i + 1], k[keep], v[keep], g)
        torch.testing.assert_close(out[i], expected_out[0])
        torch.testing.assert_close(lse[i], expected_lse[0])


@pytest.mark.parametrize("name", ["dot", "euclidean", "poincare", "kappa", "product"])
def test_gradcheck(name):
    g = build_geometry(name, 4)
    q = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(9, 3, dtype=torch.float64, requires_grad=True)
    rows = torch.stack([torch.randperm(9)[:6] for _ in range(5)])
    assert torch.autograd.gradcheck(
        lambda q, k, v: sparse_attention(q, k, v, g, rows, top_k=4, chunk_elements=40), (q, k, v)
    )


def test_gradients_reach_geometry_parameters_through_checkpointed_chunks():
    g = build_geometry("kappa", 6)
    q, k, v = torch.randn(30, 6), torch.randn(50, 6), torch.randn(50, 2)
    rows = torch.stack([torch.randperm(50)[:20] for _ in range(30)])
    out, lse = sparse_attention(q, k, v, g.float(), rows, top_k=8, chunk_elements=500)
    (out.sum() + lse.sum()).backward()
    assert g.kappa.grad is not None and torch.isfinite(g.kappa.grad).all()


def test_bad_candidates_raise_clear_errors():
    g = build_geometry("dot", 4).float()
    q, k, v = torch.randn(3, 4), torch.randn(5, 4), torch.randn(5, 2)
    with pytest.raises(ValueError, match=r"\[-1, 4\]"):
        sparse_attention(q, k, v, g, torch.tensor([[0, 5]] * 3), top_k=2)
    with pytest.raises(ValueError, match="one candidate row per query"):
        sparse_attention(q, k, v, g, torch.tensor([[0, 1]] * 2), top_k=2)
    with pytest.raises(TypeError, match="integer"):
        sparse_attention(q, k, v, g, torch.zeros(3, 2), top_k=2)
    with pytest.raises(ValueError, match="top_k"):
        sparse_attention(q, k, v, g, torch.tensor([[0, 1]] * 3), top_k=0)


def test_attend_scored_in_row_blocks_equals_one_block(monkeypatch):
    """Blocks of rows (bounded value gathers) give what one block gives, padded and empty rows
    included."""
    from rewa.attention import sparse as sparse_module

    generator = torch.Generator().manual_seed(2)
    values = torch.randn(2, 50, 6, generator=generator)
    logits = torch.randn(2, 23, 9, generator=generator)
    ids = torch.randint(0, 50, (2, 23, 9), generator=generator)
    logits[0, 3, 4:] = float("-inf")  # padding
    logits[1, 7] = float("-inf")  # nothing to attend to
    whole = sparse_module.attend_scored(logits, ids, values)
    monkeypatch.setattr(sparse_module, "CHUNK_ELEMENTS", 9 * 6 * 5)  # 5 rows a block
    blocked = sparse_module.attend_scored(logits, ids, values)
    torch.testing.assert_close(blocked[0], whole[0], rtol=0, atol=0)
    torch.testing.assert_close(blocked[1], whole[1], rtol=0, atol=0)
    assert float(whole[1][1, 7]) == float("-inf") and bool((whole[0][1, 7] == 0).all())


@pytest.mark.parametrize("name", ["dot", "poincare"])
def test_no_queries_and_no_candidates_answer_without_error(name):
    """No queries: empty `(.., 0, dv)` and `(.., 0)`, on the autograd graph; candidate rows of
    width 0 (a context whose index found nothing): every query gets `(0, -inf)`."""
    g = build_geometry(name, 6, heads=2)
    k, v = torch.randn(2, 9, 6, dtype=torch.float64), torch.randn(2, 9, 4, dtype=torch.float64)
    q = torch.randn(2, 0, 6, dtype=torch.float64, requires_grad=True)
    out, lse = sparse_attention(q, k, v, g, torch.zeros(2, 0, 3, dtype=torch.long), top_k=3)
    assert out.shape == (2, 0, 4) and lse.shape == (2, 0)
    (out.sum() + lse.sum()).backward()
    assert q.grad.shape == q.shape
    q = torch.randn(2, 5, 6, dtype=torch.float64)
    out, lse = sparse_attention(q, k, v, g, torch.zeros(2, 5, 0, dtype=torch.long), top_k=3)
    assert out.shape == (2, 5, 4) and torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()
