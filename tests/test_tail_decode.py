"""The compiled decode step (`rewa.index.tail.decode`): for the dot product on the CPU with a few
queries per head it answers in place of the batched stages, with their answers (out, lse and
keys read) for every budget, dtype and number of queries it takes, heads of different cluster
counts and outlier clusters included; everywhere else the batched stages answer."""

import functools

import pytest
import torch

from rewa.attention import make_geometry
from rewa.index import ClusterHeads, KeyClusters, LocalMemory, tail_attention_heads_with_reads
from rewa.index import tail as tail_module
from rewa.index.tail import decode as decode_module

HEADS, DIM, VALUE_DIM = 3, 16, 12


@functools.cache
def _stack(dtype, n_keys=3000):
    """Keys of `HEADS` heads around 20 centres each, a few far out (outlier clusters), clustered
    into pieces of a different size per head (built once per dtype; no test changes them), and
    the centres."""
    generator = torch.Generator().manual_seed(0)
    geometry = make_geometry("dot", DIM).to(dtype)
    centres = torch.randn(HEADS, 20, DIM, generator=generator, dtype=dtype)
    labels = torch.randint(20, (HEADS, n_keys), generator=generator)
    keys = centres.gather(1, labels.unsqueeze(-1).expand(-1, -1, DIM))
    keys = keys + 0.4 * torch.randn(keys.shape, generator=generator, dtype=dtype)
    keys[:, :6] *= 8
    values = torch.randn(HEADS, n_keys, VALUE_DIM, generator=generator, dtype=dtype)
    with torch.no_grad():
        clusters = [
            KeyClusters.build(keys[h], values[h], geometry, max_cluster_keys=60 + 40 * h)
            for h in range(HEADS)
        ]
    heads = ClusterHeads.stacked(clusters)
    assert len(set(heads.head_clusters)) == HEADS  # padded columns are exercised
    assert heads.exact_read.any(1).all()  # so are outlier clusters
    return heads, centres


def _queries(centres, n_queries, seed=1, scale=2.0):
    """Queries near the centres, scaled up (sharp)."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(centres.shape[1], (HEADS, n_queries), generator=generator)
    near = centres.gather(1, labels.unsqueeze(-1).expand(-1, -1, DIM))
    return scale * near + 0.3 * torch.randn(near.shape, generator=generator, dtype=near.dtype)


def _counted(monkeypatch) -> list:
    """The calls of the compiled step, counted."""
    calls, step = [], tail_module.decode_step
    monkeypatch.setattr(tail_module, "decode_step", lambda *a: calls.append(1) or step(*a))
    return calls


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n_queries", [1, 4, decode_module.COMPILED_STEP_ROWS])
@pytest.mark.parametrize("budget", [0.002, 0.01, 0.05, 0.3, 1.0])
def test_the_compiled_step_equals_the_batched_stages(monkeypatch, dtype, n_queries, budget):
    heads, centres = _stack(dtype)
    queries = _queries(centres, n_queries)
    calls = _counted(monkeypatch)
    with torch.no_grad():
        found = tail_attention_heads_with_reads(queries, heads, budget=budget)
        assert len(calls) == 1
        monkeypatch.setattr(decode_module, "COMPILED_STEP_ROWS", 0)
        expected = tail_attention_heads_with_reads(queries, heads, budget=budget)
    assert len(calls) == 1  # the batched stages answered the second call
    assert torch.equal(found.keys_read, expected.keys_read)
    tolerance = 1e-10 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(found.lse, expected.lse, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(found.out, expected.out, rtol=tolerance, atol=tolerance)
    assert found.out.dtype == found.lse.dtype == dtype
    if budget < 1.0:
        assert (found.keys_read < heads.heads[0].n_keys).all()  # clusters were estimated


def test_a_budget_below_every_cluster_reads_each_querys_most_massive(monkeypatch):
    """A budget smaller than any cluster still reads each query's most massive cluster (and
    nothing else), in the compiled step as in the batched stages."""
    heads, centres = _stack(torch.float64)
    queries = _queries(centres, 3)
    smallest = float(heads.counts[heads.counts > 0].min())
    budget = 0.5 * smallest / heads.heads[0].n_keys
    with torch.no_grad():
        found = tail_attention_heads_with_reads(queries, heads, budget=budget)
        monkeypatch.setattr(decode_module, "COMPILED_STEP_ROWS", 0)
        expected = tail_attention_heads_with_reads(queries, heads, budget=budget)
        log_mass = tail_module.estimate_clusters(queries, heads, heads.counts).log_mass
    ordinary = log_mass.masked_fill(heads.exact_read.unsqueeze(1), float("-inf"))
    most_massive = heads.counts.gather(1, ordinary.argmax(-1))
    assert torch.equal(found.keys_read, most_massive.to(found.keys_read.dtype))
    assert torch.equal(found.keys_read, expected.keys_read)
    torch.testing.assert_close(found.out, expected.out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(found.lse, expected.lse, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "case", ["more-queries", "gradient", "always", "exact-only", "sphere", "no-budget"]
)
def test_the_batched_stages_answer_what_the_step_does_not_take(monkeypatch, case):
    heads, centres = _stack(torch.float64)
    n_queries = decode_module.COMPILED_STEP_ROWS + 1 if case == "more-queries" else 2
    queries = _queries(centres, n_queries)
    options = {"budget": 0.0 if case == "no-budget" else 0.02}
    if case == "always":
        options["always"] = torch.arange(5)
    if case == "exact-only":
        options["tail"] = False
    if case == "gradient":
        queries.requires_grad_(True)
    if case == "sphere":
        geometry = make_geometry("sphere", DIM).double()
        with torch.no_grad():
            heads = ClusterHeads.stacked([
                KeyClusters.build(geometry.witness(c.keys_w), c.values, geometry)
                for c in heads.heads
            ])  # fmt: skip
    calls = _counted(monkeypatch)
    found = tail_attention_heads_with_reads(queries, heads, **options)
    assert not calls
    assert torch.isfinite(found.lse).all()
    if case == "gradient":
        found.out.sum().backward()
        assert queries.grad is not None and torch.isfinite(queries.grad).all()


def test_a_decoding_memory_takes_the_step_with_the_batched_answers(monkeypatch):
    """`LocalMemory` in tail mode, a decode step's 4 query rows per head: the compiled step
    answers, and equals the batched stages."""
    generator = torch.Generator().manual_seed(3)
    centres = torch.randn(2, 30, DIM, generator=generator)
    labels = torch.randint(30, (2, 6000), generator=generator)
    keys = centres.gather(1, labels.unsqueeze(-1).expand(-1, -1, DIM))
    keys = keys + 0.5 * torch.randn(keys.shape, generator=generator)
    memory = LocalMemory(2, DIM, value_dim=VALUE_DIM, budget=0.01, open_segment=0)
    memory.append(keys, torch.randn(2, 6000, VALUE_DIM, generator=generator))
    queries = 3 * centres[:, :4] + 0.2 * torch.randn(2, 4, DIM, generator=generator)
    calls = _counted(monkeypatch)
    found = memory.attend(queries)
    assert len(calls) == 1
    monkeypatch.setattr(decode_module, "COMPILED_STEP_ROWS", 0)
    expected = memory.attend(queries)
    torch.testing.assert_close(found[0], expected[0], rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(found[1], expected[1], rtol=2e-5, atol=2e-5)
