"""Tail attention with a measurement (`measured_queries`, index/tail/measured.py): the measured
queries answered exactly, every other answer moved from the keys read toward the tail estimate
by its head's fitted factor, never beyond either end; unchanged without it."""

import pytest
import torch

from rewa.attention import dense_attention
from rewa.index import ClusterHeads, KeyClusters, tail_attention_heads_with_reads
from rewa.index.tail import measured as measured_module
from tests.support import build_geometry

HEADS, N_KEYS, DIM, VALUE_DIM, N_QUERIES = 2, 3000, 8, 5, 200


def _context(geometry, seed=0):
    """Keys of two heads around 40 centres each, clustered; queries near the keys, the second
    head's sharper than the first's."""
    generator = torch.Generator().manual_seed(seed)
    centres = torch.randn(HEADS, 40, DIM, generator=generator, dtype=torch.float64)
    labels = torch.randint(40, (HEADS, N_KEYS), generator=generator)
    keys = centres.gather(1, labels.unsqueeze(-1).expand(-1, -1, DIM))
    keys = keys + 0.4 * torch.randn(keys.shape, generator=generator, dtype=torch.float64)
    values = torch.randn(HEADS, N_KEYS, VALUE_DIM, generator=generator, dtype=torch.float64)
    rows = torch.randint(N_KEYS, (HEADS, N_QUERIES), generator=generator)
    queries = keys.gather(1, rows.unsqueeze(-1).expand(-1, -1, DIM))
    queries = queries * torch.tensor([1.0, 3.0], dtype=torch.float64).view(-1, 1, 1)
    with torch.no_grad():
        heads = ClusterHeads.stacked([
            KeyClusters.build(geometry.witness(keys[h]), values[h], geometry, n_clusters=30)
            for h in range(HEADS)
        ])  # fmt: skip
    return queries, keys, values, heads


def test_the_factor_is_the_least_squares_fit_within_zero_and_one():
    generator = torch.Generator().manual_seed(1)
    read = torch.randn(3, 6, 4, generator=generator, dtype=torch.float64)
    tail = read + torch.randn(3, 6, 4, generator=generator, dtype=torch.float64)
    moved = tail - read
    exact = torch.stack([read[0] + 0.3 * moved[0], read[1] + 2.0 * moved[1], read[2] - moved[2]])
    beta = measured_module.fitted_shrinkage(read, tail, exact)
    torch.testing.assert_close(beta, torch.tensor([0.3, 1.0, 0.0], dtype=torch.float64))
    # A head whose estimate moves no answer keeps the tail answer (which is the read one).
    assert measured_module.fitted_shrinkage(read, read, exact).tolist() == [1.0, 1.0, 1.0]


def test_the_measured_rows_are_spread_over_the_call():
    rows = measured_module.measured_rows(1000, 5, torch.device("cpu"))
    assert rows.tolist() == [0, 250, 500, 749, 999]
    assert measured_module.measured_rows(3, 32, torch.device("cpu")).tolist() == [0, 1, 2]
    assert measured_module.measured_rows(10, 0, torch.device("cpu")).numel() == 0


@pytest.mark.parametrize("name", ["dot", "sphere"])
def test_measured_answers_are_exact_and_the_rest_move_by_each_heads_fitted_factor(name):
    geometry = build_geometry(name, DIM)
    queries, keys, values, heads = _context(geometry)
    options = {"budget": 0.05}
    tail = tail_attention_heads_with_reads(queries, heads, **options)
    read = tail_attention_heads_with_reads(queries, heads, tail=False, **options)
    found = tail_attention_heads_with_reads(queries, heads, measured_queries=16, **options)
    rows = measured_module.measured_rows(N_QUERIES, 16, queries.device)
    exact_out, exact_lse = dense_attention(queries, keys, values, geometry)
    torch.testing.assert_close(found.out[:, rows], exact_out[:, rows], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(found.lse[:, rows], exact_lse[:, rows], rtol=1e-9, atol=1e-9)
    assert (found.keys_read[:, rows] == N_KEYS).all()
    others = torch.ones(N_QUERIES, dtype=torch.bool)
    others[rows] = False
    assert torch.equal(found.keys_read[:, others], tail.keys_read[:, others])
    assert torch.equal(found.lse[:, others], tail.lse[:, others])
    for head in range(HEADS):
        # out = read + beta (tail - read) with the head's one beta in [0, 1].
        moved = (tail.out[head, others] - read.out[head, others]).flatten()
        taken = (found.out[head, others] - read.out[head, others]).flatten()
        beta = (moved @ taken) / (moved @ moved)
        assert 0 <= beta <= 1
        torch.testing.assert_close(taken, beta * moved, rtol=1e-9, atol=1e-12)

        # On the measured rows the fit is no worse than either end.
        def error(out, head=head):
            return (out[head, rows] - exact_out[head, rows]).square().sum()

        fitted = read.out + beta * (tail.out - read.out)
        assert error(fitted) <= min(error(tail.out), error(read.out)) * (1 + 1e-9)


def test_no_measurement_leaves_tail_attention_unchanged_and_top_k_ignores_it():
    geometry = build_geometry("dot", DIM)
    queries, _, _, heads = _context(geometry)
    plain = tail_attention_heads_with_reads(queries, heads, budget=0.05)
    zero = tail_attention_heads_with_reads(queries, heads, budget=0.05, measured_queries=0)
    assert all(torch.equal(a, b) for a, b in zip(plain, zero, strict=True))
    top_k = tail_attention_heads_with_reads(queries, heads, budget=0.05, tail=False)
    measured = tail_attention_heads_with_reads(
        queries, heads, budget=0.05, tail=False, measured_queries=8
    )
    assert all(torch.equal(a, b) for a, b in zip(top_k, measured, strict=True))


def test_a_decode_step_measured_is_answered_exactly():
    geometry = build_geometry("dot", DIM)
    queries, keys, values, heads = _context(geometry)
    step = queries[:, :2]
    found = tail_attention_heads_with_reads(step, heads, budget=0.05, measured_queries=4)
    exact_out, exact_lse = dense_attention(step, keys, values, geometry)
    torch.testing.assert_close(found.out, exact_out, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(found.lse, exact_lse, rtol=1e-9, atol=1e-9)


def test_gradients_reach_the_queries_through_the_measurement():
    geometry = build_geometry("dot", DIM)
    queries, _, _, heads = _context(geometry)
    queries = queries[:, :40].clone().requires_grad_(True)
    out, _, _ = tail_attention_heads_with_reads(queries, heads, budget=0.05, measured_queries=4)
    out.square().sum().backward()
    assert queries.grad is not None and torch.isfinite(queries.grad).all()
    assert (queries.grad.abs().sum(-1) > 0).all()


def test_a_negative_measurement_is_refused():
    geometry = build_geometry("dot", DIM)
    queries, _, _, heads = _context(geometry)
    with pytest.raises(ValueError, match="measured_queries"):
        tail_attention_heads_with_reads(queries, heads, measured_queries=-1)
