"""The exact part of tail attention: each query's attention over the keys of the clusters it
visits (`selection.select_clusters`), one product per visited cluster against its keys in
place, merged per query (docs/mathematics.md 7)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

import numpy as np
import torch

from rewa.attention import DotProduct, Geometry
from rewa.attention.geometry import TileLogits, records_grad
from rewa.attention.sparse import softmax_attend

from ..block_scoring import block_scorer
from ..clusters import ClusterHeads, KeyClusters
from .kernel import dot_product_sums, few_visitors
from .threads import one_blas_thread

KEY_BLOCK = 128  # keys per block of the exact part
QUERY_GROUP = 32  # queries per (group, block) slice of the exact part


def _largest_logit_estimate(
    log_mass: torch.Tensor,
    pair_counts: torch.Tensor,
    pair_query: torch.Tensor,
    pair_cluster: torch.Tensor,
) -> torch.Tensor:
    """Per query, the largest estimated log-mean-exp of the logits over its visited clusters
    `(nq,)` (`-inf` where it visits none; `pair_counts` the visited clusters' sizes): a few
    nats below its largest logit, a common reference for the exponentials of
    `_shared_reference_attention`."""
    log_mean = log_mass[pair_query, pair_cluster] - pair_counts.log()
    reference = log_mass.new_full((log_mass.shape[0],), float("-inf"))
    return reference.scatter_reduce(0, pair_query, log_mean, reduce="amax")


def _visited_apart(
    qw: torch.Tensor,
    heads: ClusterHeads,
    pair_query: torch.Tensor,
    pair_cluster: torch.Tensor,
    apart: torch.Tensor,
    is_always: list[torch.Tensor | None],
    reference: torch.Tensor,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`_visited_heads` of the pairs not flagged `apart` and, when there are any, of those
    flagged, as two results `(out (H * nq, dv), lse (H * nq,))`, in one call: each head's
    queries are taken twice, rows `[0, nq)` for the pairs not apart and `[nq, 2 nq)` for the
    others, so both go through one loop over the visited clusters."""
    if not apart.any():
        return [_visited_heads(qw, heads, pair_query, pair_cluster, is_always, reference)]
    n_heads, n_queries = qw.shape[:2]
    head, query = pair_query.div(n_queries, rounding_mode="floor"), pair_query % n_queries
    rows = head * 2 * n_queries + apart * n_queries + query
    order = rows.argsort(stable=True)
    twice = reference.view(n_heads, 1, n_queries).expand(-1, 2, -1).flatten()
    out, lse = _visited_heads(
        qw.repeat(1, 2, 1), heads, rows[order], pair_cluster[order], is_always, twice
    )
    out, lse = out.view(n_heads, 2, n_queries, -1), lse.view(n_heads, 2, n_queries)
    return [(out[:, part].flatten(0, 1), lse[:, part].flatten()) for part in (0, 1)]


def _visited_heads(
    qw: torch.Tensor,
    heads: ClusterHeads,
    pair_query: torch.Tensor,
    pair_cluster: torch.Tensor,
    is_always: list[torch.Tensor | None],
    reference: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_visited_attention` of the heads' queries `(H, nq, d_w)`, the pairs' queries numbered
    as rows `head * nq + query` (ascending, as `select_clusters` gives them): `(out (H * nq,
    dv), lse (H * nq,))`. On the CPU, when the queries need no gradient, one loop covers the
    visited clusters of every head (`_shared_reference_attention`); a head with a query whose
    sum over- or underflowed, and every head elsewhere, goes through `_visited_attention` on
    its own."""
    n_heads, n_queries = qw.shape[:2]
    if n_heads == 1:
        return _visited_attention(
            qw[0], heads.heads[0], pair_query, pair_cluster, is_always[0], reference
        )
    shared = (
        qw.device.type == "cpu" and not records_grad(heads.geometry, qw) and pair_query.numel() > 0
    )
    if shared:
        out, lse, failed = _shared_reference_attention(
            qw.flatten(0, 1), heads.heads, pair_query, pair_cluster, is_always, reference
        )
        visiting = torch.zeros_like(failed).index_fill_(0, pair_query, True)
        redo = (failed & visiting).view(n_heads, n_queries).any(1).nonzero().squeeze(-1).tolist()
        if not redo:
            return out, lse
        out, lse = out.view(n_heads, n_queries, -1).clone(), lse.view(n_heads, n_queries).clone()
    else:
        out = qw.new_zeros(n_heads, n_queries, heads.heads[0].values.shape[-1])
        lse = qw.new_full((n_heads, n_queries), float("-inf"))
        redo = list(range(n_heads))
    bounds = torch.arange(n_heads + 1, device=pair_query.device) * n_queries
    ends = torch.searchsorted(pair_query, bounds).tolist()
    for head in redo:
        clusters, pairs = heads.heads[head], slice(ends[head], ends[head + 1])
        out[head], lse[head] = _visited_attention(
            qw[head],
            clusters,
            pair_query[pairs] - head * n_queries,
            pair_cluster[pairs],
            is_always[head],
            reference[head * n_queries : (head + 1) * n_queries],
        )
    return out.flatten(0, 1), lse.flatten(0, 1)


def _visited_attention(
    qw: torch.Tensor,
    clusters: KeyClusters,
    pair_query: torch.Tensor,
    pair_cluster: torch.Tensor,
    is_always: torch.Tensor | None,
    reference: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention `(out, lse)` of each query over the keys of its visited clusters (the
    `(query, cluster)` pairs), leaving out the keys flagged `is_always` (read elsewhere).

    On the CPU each visited cluster's keys are read in place; for queries that need no gradient
    and with a `reference` per query (`_largest_logit_estimate`), the exponentials of all of a
    query's clusters share it (`_shared_reference_attention`), and the queries whose sums over-
    or underflow it are done again by the general path: one partial `(out, lse)` per pair
    (`_per_cluster_partials`), merged per query (`_merge_partials`). On a GPU, where each
    kernel launch costs more than the work of a cluster, one batched product covers every
    cluster (`_blocked_partials`), merged the same way."""
    n_queries = qw.shape[0]
    if pair_query.numel() == 0:
        return (
            clusters.values.new_zeros(n_queries, clusters.values.shape[-1]),
            qw.new_full((n_queries,), float("-inf")),
        )
    if qw.device.type == "cuda":
        return _merge_partials(
            n_queries, *_blocked_partials(qw, clusters, pair_query, pair_cluster, is_always)
        )
    if reference is None or records_grad(clusters.geometry, qw):
        return _merge_partials(
            n_queries, *_per_cluster_partials(qw, clusters, pair_query, pair_cluster, is_always)
        )
    out, lse, failed = _shared_reference_attention(
        qw, [clusters], pair_query, pair_cluster, [is_always], reference
    )
    again = failed[pair_query]
    if again.any():
        partials = _per_cluster_partials(
            qw, clusters, pair_query[again], pair_cluster[again], is_always
        )
        out_again, lse_again = _merge_partials(n_queries, *partials)
        out = torch.where(failed.unsqueeze(-1), out_again, out)
        lse = torch.where(failed, lse_again, lse)
    return out, lse


def _shared_reference_attention(
    qw: torch.Tensor,
    heads: list[KeyClusters],
    pair_query: torch.Tensor,
    pair_cluster: torch.Tensor,
    is_always: list[torch.Tensor | None],
    reference: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(out, lse, failed)` per query, for queries that need no gradient: every weight of
    query q is `exp(l - reference_q)`, so the sums of all its clusters add up directly, with no
    softmax per cluster and no merge. Per visited cluster: one product for the logits minus
    the reference (the reference enters as the product's bias), one in-place `exp`, one
    product with the values, one row sum; then one sum per query over its clusters. For the
    dot product with few queries per visited cluster (a decode step's) a compiled loop does it
    instead, with each query's largest logit so far as the reference
    (`kernel.dot_product_sums`).

    Exact as long as the reference is within the float range of the query's largest logit
    (always, in the compiled loop); `failed` flags the queries whose sum overflowed or came out
    too small to keep the precision of its largest term (below `tiny / eps`; queries that
    visit nothing have 0 and are flagged too). Several heads' queries `qw` `(H * nq, d_w)`
    (rows `head * nq + query`) go through one loop over all their visited clusters. How far
    the estimate's reference lies from the largest visited logit, as measured:
    docs/library.md, "Cluster-tail attention"."""
    geometry = heads[0].geometry
    if isinstance(geometry, DotProduct) and few_visitors(pair_query, heads):
        queries, _ = block_scorer(geometry, qw)
        out, weight, reference = dot_product_sums(
            queries, heads, pair_query, pair_cluster, is_always
        )
    else:
        out, weight = _cluster_product_sums(
            qw, heads, pair_query, pair_cluster, is_always, reference
        )
    finfo = torch.finfo(weight.dtype)
    # A sum of 0 is an underflow too, unless the query visited no key outside `is_always`
    # (the general path then finds that out, at the cost of redoing the query).
    failed = ~((weight >= finfo.tiny / finfo.eps) & torch.isfinite(weight))
    out = out / torch.where(weight > 0, weight, 1).unsqueeze(-1)
    return out, reference + weight.log(), failed


def _cluster_product_sums(
    qw: torch.Tensor,
    heads: list[KeyClusters],
    pair_query: torch.Tensor,
    pair_cluster: torch.Tensor,
    is_always: list[torch.Tensor | None],
    reference: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_shared_reference_attention`'s sums `sum exp(l - reference) v` `(rows, dv)` and `sum
    exp(l - reference)` `(rows,)` by matrix products: one per visited cluster against its keys
    in place, for the queries that visit it (numpy's for the dot product)."""
    n_rows = qw.shape[0]
    rows, runs = _runs_by_cluster(heads, n_rows // len(heads), pair_query, pair_cluster)
    has_always = _clusters_with_always(heads, is_always)
    geometry = heads[0].geometry
    queries, score = block_scorer(geometry, qw)
    queries = queries.index_select(0, rows)
    bias = reference.neg()[rows].unsqueeze(-1)
    value_dim = heads[0].values.shape[-1]
    weighted_values = heads[0].values.new_empty(len(rows), value_dim)
    weight_sums = heads[0].values.new_empty(len(rows))
    if isinstance(geometry, DotProduct):
        _dot_product_sums(
            queries, heads, runs, bias, is_always, has_always, weighted_values, weight_sums
        )
    else:
        for _, runs_of_head in itertools.groupby(runs, key=lambda run: run[0]):
            head_runs = list(runs_of_head)
            logits = _head_tile_logits(geometry, queries, heads, head_runs)
            for (head, cluster, part, keys), tile in zip(head_runs, logits, strict=True):
                clusters = heads[head]
                if tile is None:
                    weights = score(queries[part], clusters.keys_w[keys], bias[part])
                else:
                    weights = tile.add_(bias[part])
                if (head, cluster) in has_always:
                    weights = weights.masked_fill_(is_always[head][keys], float("-inf"))
                weights = weights.exp_()
                torch.mm(weights, clusters.values[keys], out=weighted_values[part])
                torch.sum(weights, dim=-1, out=weight_sums[part])
    out = _rows_added(weighted_values.new_zeros(n_rows, value_dim), rows, weighted_values)
    return out, weight_sums.new_zeros(n_rows).index_add_(0, rows, weight_sums)


def _head_tile_logits(
    geometry: Geometry,
    queries: torch.Tensor,
    heads: list[KeyClusters],
    head_runs: list[tuple[int, int, slice, slice]],
) -> Iterable[torch.Tensor | None]:
    """For one head's runs, each visited cluster's logits (without the bias) from one product
    form (`TileLogits`) of the head's query rows against its visited clusters' keys, gathered
    once: per cluster its products and in-place stages, instead of `score` making the
    operands and near-pair screens of every cluster anew (docs/benchmark-notes.md, "Block
    logits from the product form"). Lazily, one tile per run; None for every run where the
    geometry has no product form (then `score` per cluster)."""
    clusters = heads[head_runs[0][0]]
    first, last = head_runs[0][2].start, head_runs[-1][2].stop
    key_slices = [keys for _, _, _, keys in head_runs]
    gathered = torch.cat([torch.arange(k.start, k.stop) for k in key_slices])
    tiles = TileLogits.of(geometry, queries[first:last], clusters.keys_w.index_select(0, gathered))
    if tiles is None:
        return [None] * len(head_runs)
    return _tiles_of_runs(tiles, head_runs, first)


def _tiles_of_runs(
    tiles: TileLogits, head_runs: list[tuple[int, int, slice, slice]], first: int
) -> Iterator[torch.Tensor]:
    """`tiles.tile` of each run in turn: its rows (from `first`) against its keys' place among
    the gathered keys."""
    start = 0
    for _, _, part, keys in head_runs:
        size = keys.stop - keys.start
        yield tiles.tile(slice(part.start - first, part.stop - first), slice(start, start + size))
        start += size


def _dot_product_sums(
    queries: torch.Tensor,
    heads: list[KeyClusters],
    runs: list[tuple[int, int, slice, slice]],
    bias: torch.Tensor,
    is_always: list[torch.Tensor | None],
    has_always: set[tuple[int, int]],
    weighted_values: torch.Tensor,
    weight_sums: torch.Tensor,
) -> None:
    """`_shared_reference_attention`'s loop for the dot product (`queries` already scaled), in
    numpy on the tensors' memory: the loop runs four small operations per visited cluster, and
    a numpy call costs a few microseconds less than a PyTorch one (measured in
    docs/benchmark-notes.md, "Tail attention on sharp heads")."""
    keys_w = [clusters.keys_w.numpy() for clusters in heads]
    values = [clusters.values.numpy() for clusters in heads]
    queries, bias = queries.numpy(), bias.numpy()
    sums, totals = weighted_values.numpy(), weight_sums.numpy()
    flagged = [None if flags is None else flags.numpy() for flags in is_always]
    # Overflows are the caller's to detect (`failed`), as with PyTorch's silent infinities.
    with np.errstate(over="ignore", invalid="ignore"), one_blas_thread():
        for head, cluster, part, keys in runs:
            weights = np.matmul(queries[part], keys_w[head][keys].T)
            weights += bias[part]
            if (head, cluster) in has_always:
                weights[:, flagged[head][keys]] = -np.inf
            np.exp(weights, out=weights)
            np.matmul(weights, values[head][keys], out=sums[part])
            # the ufunc's reduce: `np.sum`'s Python wrapper cost 11 us per call, the reduce 4
            np.add.reduce(weights, axis=1, out=totals[part])


def _clusters_with_always(
    heads: list[KeyClusters], is_always: list[torch.Tensor | None]
) -> set[tuple[int, int]]:
    """The `(head, cluster)`s holding keys flagged `is_always`."""
    found = set()
    for head, (clusters, flags) in enumerate(zip(heads, is_always, strict=True)):
        if flags is not None:
            flagged = flags.nonzero().squeeze(-1)
            cluster = torch.searchsorted(clusters.offsets, flagged, right=True) - 1
            found.update((head, c) for c in cluster.tolist())
    return found


def _per_cluster_partials(
    qw: torch.Tensor,
    clusters: KeyClusters,
    pair_query: torch.Tensor,
    pair_cluster: torch.Tensor,
    is_always: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One partial per pair: for each visited cluster, the scores of the queries visiting it
    against its keys (a slice of the sorted keys, no copy), softmax, values. Differentiable."""
    rows, runs = _runs_by_cluster([clusters], qw.shape[0], pair_query, pair_cluster)
    has_always = _clusters_with_always([clusters], [is_always])
    queries, score = block_scorer(clusters.geometry, qw)
    queries = queries.index_select(0, rows)
    outs, lses = [], []
    for _, cluster, part, keys in runs:
        logits = score(queries[part], clusters.keys_w[keys])
        if (0, cluster) in has_always:
            # Rows may have no key left: softmax_attend handles them.
            logits = logits.masked_fill(is_always[keys], float("-inf"))
            out, lse = softmax_attend(logits, clusters.values[keys])
        else:
            out, lse = _finite_softmax_attend(logits, clusters.values[keys])
        outs.append(out)
        lses.append(lse)
    return rows, torch.cat(outs), torch.cat(lses)


def _runs_by_cluster(
    heads: list[KeyClusters], n_queries: int, pair_query: torch.Tensor, pair_cluster: torch.Tensor
) -> tuple[torch.Tensor, list[tuple[int, int, slice, slice]]]:
    """The pairs' queries sorted by head and cluster `rows` (a pair's query is the row `head *
    n_queries + query`), and per visited cluster `(head, cluster, part, keys)`: the slice of
    `rows` visiting it and its slice of the head's sorted keys."""
    width = max(clusters.n_clusters for clusters in heads)
    visit = pair_cluster if len(heads) == 1 else pair_query // n_queries * width + pair_cluster
    order = visit.argsort(stable=True)
    rows, visit = pair_query[order], visit[order]
    visited, visits = torch.unique_consecutive(visit, return_counts=True)
    offsets = [clusters.offsets.tolist() for clusters in heads]
    runs, first = [], 0
    for code, count in zip(visited.tolist(), visits.tolist(), strict=True):
        head, cluster = divmod(code, width)
        keys = slice(offsets[head][cluster], offsets[head][cluster + 1])
        runs.append((head, cluster, slice(first, first + count), keys))
        first += count
    return rows, runs


def _finite_softmax_attend(
    logits: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`softmax_attend` for logits that are all finite, with PyTorch's fused softmax: the
    log-partition is `max_j l_j - log max_j w_j` (the largest weight is at least 1/n, so its
    logarithm is well conditioned), two read-only passes instead of logsumexp's four."""
    weights = torch.softmax(logits, dim=-1)
    lse = logits.amax(-1) - weights.amax(-1).log()
    return weights @ values, lse


def _blocked_partials(
    qw: torch.Tensor,
    clusters: KeyClusters,
    pair_query: torch.Tensor,
    pair_cluster: torch.Tensor,
    is_always: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Partials from one batched product, a fixed number of tensor operations whatever the
    number of queries and clusters.

    Clusters are cut into blocks of `KEY_BLOCK` consecutive keys; the queries visiting a block
    form groups of at most `QUERY_GROUP`; every (group, block) is one slice of the batched
    product, with the block's keys gathered once for the whole group."""
    device = qw.device
    lengths = clusters.offsets.diff()
    blocks_per_cluster = (lengths + KEY_BLOCK - 1) // KEY_BLOCK
    first_block = blocks_per_cluster.cumsum(0) - blocks_per_cluster
    # (query, block) items: every block of every visited cluster.
    item_count = blocks_per_cluster[pair_cluster]
    item_pair = torch.repeat_interleave(torch.arange(len(pair_query), device=device), item_count)
    within = torch.arange(len(item_pair), device=device) - _starts(item_count)[item_pair]
    item_cluster = pair_cluster[item_pair]
    item_block = first_block[item_cluster] + within
    item_query = pair_query[item_pair]
    # Group the items of each block into groups of at most QUERY_GROUP queries.
    order = item_block.argsort(stable=True)
    item_block, item_query, item_cluster = item_block[order], item_query[order], item_cluster[order]
    blocks, per_block = torch.unique_consecutive(item_block, return_counts=True)
    group_size = min(QUERY_GROUP, int(per_block.max()))
    rank_in_block = torch.arange(len(item_block), device=device) - torch.repeat_interleave(
        _starts(per_block), per_block
    )
    groups_per_block = (per_block + group_size - 1) // group_size
    group_of_item = (
        torch.repeat_interleave(_starts(groups_per_block), per_block) + rank_in_block // group_size
    )
    n_groups = int(groups_per_block.sum())
    group_query = torch.full((n_groups, group_size), -1, dtype=torch.long, device=device)
    group_query[group_of_item, rank_in_block % group_size] = item_query
    group_block = torch.repeat_interleave(blocks, groups_per_block)
    group_cluster = torch.zeros(n_groups, dtype=torch.long, device=device)
    group_cluster[group_of_item] = item_cluster
    # Keys of each group's block: (n_groups, KEY_BLOCK) sorted positions, padding masked.
    start = clusters.offsets[group_cluster] + (group_block - first_block[group_cluster]) * KEY_BLOCK
    key_position = start.unsqueeze(-1) + torch.arange(KEY_BLOCK, device=device)
    key_valid = key_position < clusters.offsets[group_cluster + 1].unsqueeze(-1)
    key_position = key_position.clamp_max(clusters.n_keys - 1)
    if is_always is not None:
        key_valid = key_valid & ~is_always[key_position]
    query_valid = group_query >= 0
    logits = clusters.geometry.score(
        _rows(qw, group_query.clamp_min(0)), _rows(clusters.keys_w, key_position)
    )  # (n_groups, group_size, KEY_BLOCK)
    logits = logits.masked_fill(~key_valid.unsqueeze(1), float("-inf"))
    group_out, group_lse = softmax_attend(logits, _rows(clusters.values, key_position))
    return group_query[query_valid], group_out[query_valid], group_lse[query_valid]


def _rows(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`table[index]` for a 2-D table through one `index_select` (several times faster than
    advanced indexing on the CPU)."""
    return table.index_select(0, index.flatten()).view(*index.shape, table.shape[-1])


def _merge_partials(
    n_queries: int, rows: torch.Tensor, partial_out: torch.Tensor, partial_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial `(out, lse)` rows of the queries `rows` per query (docs/mathematics.md 7) with
    scatter operations; queries without a partial get `(0, -inf)`."""
    lse = partial_lse.new_full((n_queries,), float("-inf"))
    best = lse.scatter_reduce(0, rows, partial_lse, reduce="amax")
    reference = torch.where(torch.isfinite(best), best, torch.zeros_like(best))
    scale = torch.exp(partial_lse - reference[rows])
    total = partial_lse.new_zeros(n_queries).index_add_(0, rows, scale)
    out = partial_out.new_zeros(n_queries, partial_out.shape[-1])
    out = _rows_added(out, rows, partial_out * scale.unsqueeze(-1))
    seen = total > 0
    out = out / torch.where(seen, total, 1).unsqueeze(-1)
    lse = torch.where(seen, reference + total.log(), float("-inf"))
    return out, lse


def _rows_added(table: torch.Tensor, rows: torch.Tensor, added: torch.Tensor) -> torch.Tensor:
    """`table` with each row of `added` `(m, dv)` summed into its row `rows[i]`, in place.

    `index_put_` with `accumulate`, not `index_add_`: with two threads on a 2-core CPU,
    `index_add_` of a few rows into a small table took up to milliseconds per call, where
    `index_put_` takes microseconds (docs/benchmark-notes.md, "Tail attention on sharp heads").
    """
    return table.index_put_((rows,), added, accumulate=True)


def _starts(counts: torch.Tensor) -> torch.Tensor:
    """Exclusive prefix sums: where each run of a run-length encoding starts."""
    return counts.cumsum(0) - counts
