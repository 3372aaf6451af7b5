"""Cluster-tail attention (docs/mathematics.md 6, "Tail estimate"): exact attention over the keys of
the clusters a query visits, an estimate of every cluster it does not visit, merged exactly
(docs/mathematics.md 7).

The stages, one module each:

- `estimate`: every cluster's estimated log-mass and value-shift terms (`estimate_clusters`);
- `selection`: the clusters each query reads exactly within its budget (`select_clusters`);
- `exact`: the attention over the keys of those clusters;
- `calibration`: each query's estimate fitted to the exact mass of what it read (`calibrated`);
- `unread`: the estimate of every other cluster, values shifted by the cross-covariances.

`tail_attention` (one head) and `tail_attention_heads` (several heads in one call) run them in
that order and answer `(out, lse)`, as every attention function does; `tail_attention_with_reads`
and `tail_attention_heads_with_reads` answer a `TailAttention`, which adds the keys each query
read."""

from __future__ import annotations

import math
from typing import NamedTuple, TypedDict, Unpack

import numpy as np
import torch

from rewa.attention import merge_attention
from rewa.attention.allocator import retain_freed_memory
from rewa.attention.sparse import softmax_attend

from ..clusters import ClusterHeads, KeyClusters
from .calibration import calibrated
from .decode import compiled_step_applies, decode_step
from .estimate import ClusterEstimate, estimate_clusters
from .exact import _largest_logit_estimate, _visited_apart
from .fixed_step import fixed_shape_step, fixed_shape_step_applies
from .measured import measured_shrinkage
from .selection import ordinary_averages, select_clusters, walk_widths
from .unread import _tail_estimate, shift_dtype

__all__ = [
    "ClusterEstimate",
    "TailAttention",
    "TailOptions",
    "calibrated",
    "default_query_block",
    "estimate_clusters",
    "select_clusters",
    "shift_dtype",
    "tail_attention",
    "tail_attention_heads",
    "tail_attention_heads_with_reads",
    "tail_attention_with_reads",
    "witness_tail_attention",
]


class TailAttention(NamedTuple):
    """Tail attention's answer with its cost: `out (..., nq, dv)`, `lse (..., nq)` and
    `keys_read (..., nq)`, the keys each query read exactly (the clusters it visited, the
    `always` keys); the leading axis is the heads' for `tail_attention_heads_with_reads`."""

    out: torch.Tensor
    lse: torch.Tensor
    keys_read: torch.Tensor


class TailOptions(TypedDict, total=False):
    """The options every tail-attention function takes, with their defaults: `budget` (0.02),
    the fraction of all keys a query reads exactly; `tail` (True), whether every other
    cluster's estimate is merged in; `always` (None), key ids every query reads exactly (window
    and sinks); `query_block` (None: `default_query_block`), queries per pass;
    `measured_queries` (0), how many of the call's queries per head are answered by exact
    attention over every key to fit how far each head's answers move toward the tail estimate
    (`measured.py`; with `tail` only). `witness_tail_attention` holds the defaults."""

    budget: float
    tail: bool
    always: torch.Tensor | None
    query_block: int | None
    measured_queries: int


# A pass over a block of queries keeps several (heads x queries, clusters) tables; the default
# block holds up to this many of their elements, within [MIN_QUERY_BLOCK, MAX_QUERY_BLOCK]
# queries (docs/indexes.md, "Queries per pass").
QUERY_BLOCK_ELEMENTS = 1 << 23
MIN_QUERY_BLOCK, MAX_QUERY_BLOCK = 1024, 4096


def default_query_block(n_heads: int, n_clusters: int) -> int:
    """Queries per pass of tail attention over `n_heads` heads of at most `n_clusters`
    clusters: as many as keep a `(heads x queries, clusters)` table within
    `QUERY_BLOCK_ELEMENTS`, at least 1024 and at most 4096. Larger passes share each visited
    cluster's products among more queries."""
    fitting = QUERY_BLOCK_ELEMENTS // max(1, n_heads * n_clusters)
    return min(MAX_QUERY_BLOCK, max(MIN_QUERY_BLOCK, fitting))


def tail_attention(
    q: torch.Tensor, clusters: KeyClusters, **options: Unpack[TailOptions]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention `(out (nq, dv), lse (nq,))` of ambient queries `(nq, d)` over a clustered
    context: exact over the clusters each query visits (`select_clusters`, within `budget`, a
    fraction of all keys) and over the key ids `always` (window and sinks,
    shared by every query); with `tail`, every other cluster's estimate (`tail.estimate`) is
    merged in, and `lse` estimates the full log-partition. `tail=False` is exact-only sparse
    attention over the same keys (`TailOptions`).

    Gradients reach the queries (the clustered keys and statistics are constants).
    `tail_attention_heads` does the same for several heads at once; `tail_attention_with_reads`
    also answers the keys each query read.
    """
    out, lse, _ = tail_attention_with_reads(q, clusters, **options)
    return out, lse


def tail_attention_with_reads(
    q: torch.Tensor, clusters: KeyClusters, **options: Unpack[TailOptions]
) -> TailAttention:
    """`tail_attention` with the keys each query read exactly, `keys_read (nq,)`."""
    if q.dim() != 2 or q.shape[-1] != clusters.geometry.dim:
        raise ValueError(f"expected queries (nq, {clusters.geometry.dim}), got {tuple(q.shape)}")
    heads = ClusterHeads.stacked([clusters])
    result = tail_attention_heads_with_reads(q.unsqueeze(0), heads, **options)
    return TailAttention(*(t[0] for t in result))


def tail_attention_heads(
    q: torch.Tensor, heads: ClusterHeads, **options: Unpack[TailOptions]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`tail_attention` of the queries `(H, nq, d)` of H heads over those heads' clusters
    (`ClusterHeads`; head h's queries read head h's keys): `(out (H, nq, dv), lse (H, nq))`.

    The estimate, the selection, the calibration and the tail are computed for every head in
    one pass (batched matrix products over the head axis, one selection over the heads'
    queries), the exact part per head; a decode step (a few queries per head) costs a fixed
    number of operations instead of that number per head. `always` (key ids) holds for every
    head."""
    out, lse, _ = tail_attention_heads_with_reads(q, heads, **options)
    return out, lse


def tail_attention_heads_with_reads(
    q: torch.Tensor, heads: ClusterHeads, **options: Unpack[TailOptions]
) -> TailAttention:
    """`tail_attention_heads` with the keys each query of each head read exactly,
    `keys_read (H, nq)`."""
    geometry = heads.geometry
    if q.dim() != 3 or q.shape[0] != heads.n_heads or q.shape[-1] != geometry.dim:
        raise ValueError(
            f"expected queries ({heads.n_heads}, nq, {geometry.dim}), got {tuple(q.shape)}"
        )
    if q.device.type == "cpu":
        # Megabyte-sized (queries, clusters) temporaries, allocated and freed on every call.
        retain_freed_memory()
    qw = geometry.witness(q.to(heads.heads[0].keys_w.dtype))
    return witness_tail_attention(qw, heads, **options)


def witness_tail_attention(
    qw: torch.Tensor,
    heads: ClusterHeads,
    *,
    budget: float = 0.02,
    tail: bool = True,
    always: torch.Tensor | None = None,
    query_block: int | None = None,
    measured_queries: int = 0,
) -> TailAttention:
    """`tail_attention_heads_with_reads` of query witnesses `(H, nq, d_w)` (the geometry's
    `witness` of the queries, in the clusters' dtype), for callers that hold witnesses: the
    clusters' own keys as queries (`probe.py`)."""
    geometry = heads.geometry
    if not 0 <= budget <= 1:
        raise ValueError(f"expected a budget between 0 and 1 (a fraction of keys), got {budget}")
    if query_block is None:
        query_block = default_query_block(heads.n_heads, heads.n_clusters)
    elif query_block < 1:
        raise ValueError(f"expected a query_block of at least 1 query, got {query_block}")
    if measured_queries < 0:
        raise ValueError(f"expected measured_queries >= 0, got {measured_queries}")
    measured = tail and measured_queries > 0
    n_heads, n_keys = heads.n_heads, heads.heads[0].n_keys
    if qw.shape[1] == 0:
        # No query reads a key: `(H, 0, dv)` and `(H, 0)`, still on the queries' autograd graph.
        empty = qw[..., :1].expand(-1, -1, heads.heads[0].values.shape[-1])
        reads = torch.zeros(n_heads, 0, dtype=torch.long, device=qw.device)
        return TailAttention(geometry.output_map(empty), qw[..., 0], reads)
    if budget * n_keys > 0 and compiled_step_applies(qw, heads, always, tail, measured_queries):
        return TailAttention(*decode_step(qw, heads, budget * n_keys))
    if always is not None and always.numel() > 0:
        always = always.unique()
        if always.min() < 0 or always.max() >= n_keys:
            raise ValueError(f"expected always ids in [0, {n_keys}), got {always.tolist()[:8]}")
    n_always = 0 if always is None else len(always)
    budget_keys = budget * n_keys - n_always
    if fixed_shape_step_applies(qw, heads, tail, budget_keys, n_always, measured_queries):
        return TailAttention(*fixed_shape_step(qw, heads, budget_keys, always))
    is_always = [None] * n_heads  # or per head a flag per sorted position: read outside clusters
    counts = heads.counts
    if n_always:
        counts, is_always, always_keys, always_values = _always_read(heads, always)
    exact_read = heads.exact_read
    # Each head's walk width, from its own clusters (as in a call of its own).
    head_widths = walk_widths(ordinary_averages(counts, exact_read), budget_keys, heads.n_clusters)
    outs, lses, reads, read_outs = [], [], [], []
    for start in range(0, qw.shape[1], query_block):
        block = qw[:, start : start + query_block]
        n_queries = block.shape[1]
        estimate = estimate_clusters(block, heads, counts)
        rows = estimate.rows()
        row_counts, row_exact = (_per_row(t, n_queries) for t in (counts, exact_read))
        pair_query, pair_cluster = select_clusters(
            rows.log_mass, row_counts, budget_keys, row_exact, np.repeat(head_widths, n_queries)
        )
        pair_counts = row_counts.expand_as(rows.log_mass)[pair_query, pair_cluster]
        reference = _largest_logit_estimate(rows.log_mass, pair_counts, pair_query, pair_cluster)
        # The clusters read by every query (outliers) apart: they calibrate nothing.
        outlying = row_exact.expand_as(rows.log_mass)[pair_query, pair_cluster]
        ordinary = ~outlying
        ordinary_query, ordinary_cluster = pair_query[ordinary], pair_cluster[ordinary]
        parts = _visited_apart(
            block, heads, pair_query, pair_cluster, outlying, is_always, reference
        )
        visited = parts[0]
        if n_always:
            scores = geometry.score(block, always_keys)
            parts.append(tuple(t.flatten(0, 1) for t in softmax_attend(scores, always_values)))
        if measured:
            # The keys read alone, for the fit; the answer below merges the same parts in the
            # same order as without a measurement, so its lse is tail's to the bit.
            read_outs.append(merge_attention(*parts)[0].view(n_heads, n_queries, -1))
        if tail:
            log_mass = calibrated(rows, ordinary_query, ordinary_cluster, visited[1].detach())
            unvisited = log_mass.index_put(
                (pair_query, pair_cluster), log_mass.new_tensor(-math.inf)
            )
            read_lse = torch.stack([lse for _, lse in parts]).logsumexp(0).detach()
            parts.append(
                _tail_estimate(
                    heads,
                    unvisited.view(estimate.log_mass.shape),
                    estimate.shift_terms,
                    read_lse.view(n_heads, n_queries),
                )
            )
        out, lse = merge_attention(*parts)
        outs.append(out.view(n_heads, n_queries, -1))
        lses.append(lse.view(n_heads, n_queries))
        read = pair_counts.new_zeros(n_heads * n_queries).index_add_(0, pair_query, pair_counts)
        reads.append(read.view(n_heads, n_queries) + n_always)
    out, lse, read = (torch.cat(t, dim=1) for t in (outs, lses, reads))
    if measured:
        read_out = torch.cat(read_outs, dim=1)
        out, lse, read = measured_shrinkage(qw, heads, read_out, (out, lse), read, measured_queries)
    return TailAttention(geometry.output_map(out), lse, read)


def _per_row(stacked: torch.Tensor, n_queries: int) -> torch.Tensor:
    """A per-head `(H, C)` table as the rows of the heads' queries: `(C,)` for one head (the
    same for every row), else `(H * nq, C)`."""
    if stacked.shape[0] == 1:
        return stacked[0]
    return stacked.unsqueeze(1).expand(-1, n_queries, -1).flatten(0, 1)


def _always_read(heads: ClusterHeads, always: torch.Tensor):
    """For key ids `always` (unique, in range) read exactly by every query of every head: the
    cluster sizes without them `(H, C)`, per head a flag per sorted position, and their key
    witnesses `(H, n, d_w)` and values `(H, n, dv)`."""
    counts, flags, keys, values = heads.counts.clone(), [], [], []
    for head, clusters in enumerate(heads.heads):
        positions = clusters.positions(always)
        is_always = torch.zeros(clusters.n_keys, dtype=torch.bool, device=positions.device)
        is_always[positions] = True
        flags.append(is_always)
        # Those keys are read exactly, so the estimates of their clusters leave them out.
        cluster = torch.searchsorted(clusters.offsets, positions, right=True) - 1
        removed = torch.bincount(cluster, minlength=clusters.n_clusters).to(counts.dtype)
        counts[head, : clusters.n_clusters] -= removed
        keys.append(clusters.keys_w[positions])
        values.append(clusters.values[positions])
    return counts, flags, torch.stack(keys), torch.stack(values)
