"""The fixed-shape decode step (`rewa.index.tail.fixed_step`), run here on the CPU: the same
answers as the batched stages (out, lse and keys read) for every budget, dtype and number of
queries it takes, one head or several of different cluster counts, outlier clusters included.
On a GPU it answers a decode step, replayed as a CUDA graph (tests/test_cuda.py); on the CPU
the compiled step answers instead."""

import pytest
import torch

from rewa.index import ClusterHeads, tail_attention_heads_with_reads
from rewa.index import tail as tail_module
from rewa.index.tail import decode as decode_module
from rewa.index.tail import fixed_step as fixed_module
from tests.test_tail_decode import _queries, _stack


def _batched(monkeypatch, queries, heads, budget, always=None):
    """The batched stages' answer (the compiled step turned off)."""
    with monkeypatch.context() as patch:
        patch.setattr(decode_module, "COMPILED_STEP_ROWS", 0)
        return tail_attention_heads_with_reads(queries, heads, budget=budget, always=always)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n_queries", [1, 4, fixed_module.FIXED_STEP_ROWS])
@pytest.mark.parametrize("budget", [0.002, 0.01, 0.05, 0.3, 1.0])
def test_the_fixed_step_equals_the_batched_stages(monkeypatch, dtype, n_queries, budget):
    heads, centres = _stack(dtype)
    queries = _queries(centres, n_queries)
    with torch.no_grad():
        budget_keys = budget * heads.heads[0].n_keys
        out, lse, reads = fixed_module.fixed_shape_step(queries, heads, budget_keys)
        expected = _batched(monkeypatch, queries, heads, budget)
    assert torch.equal(reads, expected.keys_read)
    tolerance = 1e-10 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(lse, expected.lse, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(out, expected.out, rtol=tolerance, atol=tolerance)
    assert out.dtype == lse.dtype == dtype
    if budget < 1.0:
        assert (reads < heads.heads[0].n_keys).all()  # clusters were estimated


@pytest.mark.parametrize("budget", [0.0004, 0.01])
def test_one_heads_fixed_step_equals_the_batched_stages(monkeypatch, budget):
    """One head's clusters (views, no padding), and a budget below its smallest cluster, where
    each query reads its most massive cluster alone."""
    heads, centres = _stack(torch.float64)
    one = ClusterHeads.stacked([heads.heads[1]])
    queries = _queries(centres, 5)[1:2]
    with torch.no_grad():
        out, lse, reads = fixed_module.fixed_shape_step(queries, one, budget * one.heads[0].n_keys)
        expected = _batched(monkeypatch, queries, one, budget)
    assert torch.equal(reads, expected.keys_read)
    torch.testing.assert_close(out, expected.out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, expected.lse, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n_queries", [1, 4])
@pytest.mark.parametrize("budget", [0.05, 0.3])
@pytest.mark.parametrize("always", ["sinks-and-window", "spread"])
def test_the_fixed_step_with_always_keys_equals_the_batched_stages(
    monkeypatch, dtype, n_queries, budget, always
):
    """Key ids every query reads exactly (a service's sinks and window, or ids spread over every
    cluster): left out of their clusters' sizes and of the slots, read apart, counted in the
    keys read, as the batched stages do."""
    heads, centres = _stack(dtype)
    n_keys = heads.heads[0].n_keys
    if always == "sinks-and-window":
        ids = torch.cat([torch.arange(4), torch.arange(n_keys - 64, n_keys)])
    else:
        ids = torch.arange(0, n_keys, 29)
    queries = _queries(centres, n_queries)
    with torch.no_grad():
        found = fixed_module.fixed_shape_step(queries, heads, budget * n_keys - len(ids), ids)
        expected = _batched(monkeypatch, queries, heads, budget, always=ids)
    out, lse, reads = found
    assert torch.equal(reads, expected.keys_read)
    tolerance = 1e-10 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(lse, expected.lse, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(out, expected.out, rtol=tolerance, atol=tolerance)


def test_the_slots_hold_every_key_a_query_reads():
    """The exact part's slots: the budget, or the largest cluster where it is larger."""
    heads, _ = _stack(torch.float64)
    largest = fixed_module._largest(heads)
    assert largest == int(heads.counts.max())
    assert fixed_module.n_slots(largest, 10.5) == largest
    assert fixed_module.n_slots(largest, largest + 100.7) == largest + 100
    # Always keys inside the chosen clusters take slots without being read there.
    assert fixed_module.n_slots(largest, largest + 100.7, n_always=9) == largest + 109


def test_the_walk_takes_the_first_candidate_and_then_what_fits():
    sizes = torch.tensor([[50.0, 30, 0, 25, 10], [200, 10, 10, 10, 10], [0, 40, 60, 1, 1]])
    taken = fixed_module._walk(sizes, budget_keys=100.0)
    expected = [[1, 1, 0, 0, 1], [1, 0, 0, 0, 0], [0, 1, 1, 0, 0]]
    assert taken.tolist() == [[bool(x) for x in row] for row in expected]


def test_on_the_cpu_the_compiled_step_answers_not_the_fixed_one(monkeypatch):
    """The fixed step is for a CUDA GPU; on the CPU the decode step is compiled
    (index/tail/decode.py)."""
    heads, centres = _stack(torch.float32)
    queries = _queries(centres, 4)
    assert not fixed_module.fixed_shape_step_applies(queries, heads, True, 30.0)
    calls = []
    step = tail_module.fixed_shape_step
    monkeypatch.setattr(tail_module, "fixed_shape_step", lambda *a: calls.append(1) or step(*a))
    with torch.no_grad():
        tail_attention_heads_with_reads(queries, heads, budget=0.01)
    assert not calls


def test_a_budget_of_no_keys_is_refused():
    heads, centres = _stack(torch.float64)
    with pytest.raises(ValueError, match="positive budget"):
        fixed_module.fixed_shape_step(_queries(centres, 1), heads, 0.0)
