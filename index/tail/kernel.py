"""Tail attention's loops on the CPU, compiled by Numba: a decode step's exact part and value
shift, and the element-wise part of the dot product's estimate.

The exact part for the dot product (`dot_product_sums`): per head, one loop over the visited
clusters that reads each cluster's keys and values once in place
and adds every visiting query's exponentials straight into that query's sums, kept relative
to the query's largest logit so far (an online softmax, exact whatever the logits' range).

A decode step visits about a hundred clusters per layer, a few queries each. As a few numpy
calls per cluster, the calls' own cost was a large part of the exact part, and the Python loop
held the GIL, so the two cores could not share it. Compiled without the GIL, each head's loop
runs as one call and the heads are spread over PyTorch's number of threads. With many queries
per cluster a matrix product per cluster is faster (`few_visitors` decides; measured in
docs/benchmark-notes.md, "The exact part compiled").

The value shift of a few queries (`value_shift_sums`, any geometry): per head, one loop over
the clusters whose shift is kept, reading each cluster's key-value cross-covariance once in
place for all the queries, where matrix products would first gather the kept clusters' (a
copy) and then read them again (docs/benchmark-notes.md, "The value shift compiled").

The dot product's estimate (`dot_product_estimate`, any number of queries): after its three
matrix products, the variance, tilt, log-mass, floor and slope of every (query, cluster) in one
pass over the products, where PyTorch's operations took a dozen passes over `(nq, nc)` tables
(docs/benchmark-notes.md, "The estimate in one pass").

Numba compiles each loop on the first call of each dtype and caches it on disk (its cache
directory, `NUMBA_CACHE_DIR`)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..clusters import KeyClusters
from ..compiled import compiled_loop
from .threads import spread

# The most (query, cluster) pairs per cluster on average for which the compiled loop runs;
# with more queries per cluster (a prefill's), a matrix product per cluster shares each key
# among them faster (docs/benchmark-notes.md, "The exact part compiled").
MAX_VISITORS = 8


def few_visitors(pair_query: torch.Tensor, heads: list[KeyClusters]) -> bool:
    """Whether the pairs visit the heads' clusters `MAX_VISITORS` times or fewer on average
    (over all their clusters, or as many as there are pairs): the compiled loop's case."""
    n_pairs = pair_query.numel()
    n_clusters = sum(clusters.n_clusters for clusters in heads)
    return n_pairs <= MAX_VISITORS * min(n_pairs, n_clusters)


# How many rows ahead of the row it reads the exact part's loop asks for the rows of keys and
# values (`prefetch_row`; docs/benchmark-notes.md, "Prefetching the rows of the exact part").
PREFETCH_ROWS = 4


def prefetch_row(array: np.ndarray, row: int) -> None:
    """A hint that `array[row]` (2-d) will be read soon: compiled, a prefetch of each of its
    cache lines (`prefetch.py`); in Python, nothing."""


def _head_sums(
    queries: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    offsets: np.ndarray,
    pair_query: np.ndarray,
    pair_cluster: np.ndarray,
    skipped: np.ndarray,
    out: np.ndarray,
    weight: np.ndarray,
    peak: np.ndarray,
) -> None:
    """For every key k of every cluster c of each pair `(q, c)`, but the keys flagged `skipped`
    (empty: none): adds `exp(l - peak[q]) v` to `out[q]` and `exp(l - peak[q])` to
    `weight[q]`, `l = <q, k>`, where `peak[q]` is the largest logit so far (an online softmax:
    a larger logit rescales the row's sums to itself, no exponential exceeds 1). A cluster's
    keys are read once for all the queries that visit it (`fastmath` lets the dot products be
    reordered into vector lanes, as BLAS orders them). Run compiled: `_compiled`."""
    order = np.argsort(pair_cluster, kind="mergesort")
    n_pairs, dim, value_dim = len(order), keys.shape[1], values.shape[1]
    visiting = np.empty(n_pairs, np.int64)
    exponentials = np.empty(n_pairs, out.dtype)
    has_skipped = len(skipped) > 0
    start = 0
    while start < n_pairs:
        cluster = pair_cluster[order[start]]
        end = start + 1
        while end < n_pairs and pair_cluster[order[end]] == cluster:
            end += 1
        m = end - start
        for i in range(m):
            visiting[i] = pair_query[order[start + i]]
        last = offsets[cluster + 1]
        # The rows PREFETCH_ROWS ahead, in this cluster and then the next one visited.
        following = pair_cluster[order[end]] if end < n_pairs else cluster
        skip_to = offsets[following] - last if following != cluster else 0
        stop = offsets[following + 1] if following != cluster else last
        for key in range(offsets[cluster], last):
            ahead = key + PREFETCH_ROWS
            if ahead >= last:
                ahead += skip_to
            if ahead < stop:
                prefetch_row(keys, ahead)
                prefetch_row(values, ahead)
            if has_skipped and skipped[key]:
                continue
            for i in range(m):
                row = visiting[i]
                logit = queries[row, 0] * keys[key, 0]
                for t in range(1, dim):
                    logit += queries[row, t] * keys[key, t]
                if logit > peak[row]:
                    rescale = np.exp(peak[row] - logit)
                    weight[row] *= rescale
                    for t in range(value_dim):
                        out[row, t] *= rescale
                    peak[row] = logit
                exponentials[i] = np.exp(logit - peak[row])
                weight[row] += exponentials[i]
            for i in range(m):
                row, w = visiting[i], exponentials[i]
                for t in range(value_dim):
                    out[row, t] += w * values[key, t]
        start = end


def _compiled(loop: Callable) -> Callable:
    """`loop` (`_head_sums`, `_head_shift`, the decode step's) compiled (`compiled_loop`), with
    `prefetch_row`'s compiled form registered first (importing `prefetch` imports Numba)."""
    from . import prefetch  # noqa: F401 (registers prefetch_row's compiled form)

    return compiled_loop(loop)


def dot_product_sums(
    queries: torch.Tensor,
    heads: list[KeyClusters],
    pair_query: torch.Tensor,
    pair_cluster: torch.Tensor,
    is_always: list[torch.Tensor | None],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For the heads' queries `(H * nq, d)` (rows `head * nq + query`, scaled) and the pairs
    `(row, cluster)` in ascending rows: per row its largest logit `peak` `(H * nq,)` (`-inf`
    where it read no key) and the sums `sum exp(l - peak) v` `(H * nq, dv)` and `sum exp(l -
    peak)` `(H * nq,)` over the keys of its visited clusters, but those flagged `is_always`
    (read elsewhere): `(sums, weight, peak)`. No autograd; CPU float32 or float64 tensors."""
    n_rows, n_heads = queries.shape[0], len(heads)
    per_head = n_rows // n_heads
    out = queries.new_zeros(n_rows, heads[0].values.shape[-1])
    weight = queries.new_zeros(n_rows)
    peak = queries.new_full((n_rows,), float("-inf"))
    bounds = torch.arange(n_heads + 1) * per_head
    bounds = torch.searchsorted(pair_query.contiguous(), bounds).tolist()
    rows, clusters = pair_query.numpy(), pair_cluster.numpy()
    calls = []
    for head, keys in enumerate(heads):
        first, last = bounds[head], bounds[head + 1]
        if first == last:
            continue
        own = slice(head * per_head, (head + 1) * per_head)
        flags = is_always[head]
        calls.append((
            queries[own].numpy(), keys.keys_w.numpy(), keys.values.numpy(), keys.offsets.numpy(),
            rows[first:last] - head * per_head, clusters[first:last],
            np.zeros(0, np.bool_) if flags is None else flags.numpy(),
            out[own].numpy(), weight[own].numpy(), peak[own].numpy(),
        ))  # fmt: skip
    head_sums = _compiled(_head_sums)
    spread(lambda arguments: head_sums(*arguments), calls)
    return out, weight, peak


def compile_ahead(dtypes: tuple[type, ...] = (np.float32, np.float64)) -> None:
    """Compiles the loops for contexts of `dtypes` (float32 and float64) now, into Numba's cache
    (the image does it when it is built, so that a server's first decode step does not)."""
    for dtype in dtypes:
        keys, values = np.ones((2, 2), dtype), np.ones((2, 3), dtype)
        pairs = np.zeros(1, np.int64)
        out, weight = np.zeros((1, 3), dtype), np.zeros(1, dtype)
        peak = np.full(1, -np.inf, dtype)
        offsets = np.array([0, 2], np.int64)
        for skipped in (np.zeros(0, np.bool_), np.zeros(2, np.bool_)):
            _compiled(_head_sums)(
                keys[:1], keys, values, offsets, pairs, pairs, skipped, out, weight, peak
            )
        cross = np.ones((1, 2, 3), dtype)
        _compiled(_head_shift)(keys[:1], keys[:1], keys[:1], pairs, cross, 0, out)
        table, radius = np.ones((1, 2), dtype), np.ones(2, dtype)
        _compiled(_estimate_rows)(
            table, table, np.ones((1, 3, 2), dtype), np.ones(1, dtype), radius, radius, 1.0,
            table.copy(), table.copy(), table.copy(),
        )  # fmt: skip


def _head_shift(
    weights: np.ndarray,
    slope: np.ndarray,
    features: np.ndarray,
    columns: np.ndarray,
    cross: np.ndarray,
    start: int,
    out: np.ndarray,
) -> None:
    """Adds one lift's value shift `sum_c w_qc g_qc Cov_c(b_i, v)^T a_q` over the clusters
    `columns` to `out[q]` `(nq, dv)`, for weights and slopes `(nq, nc)`, the lift's query
    features `a` `(nq, D_i)` and the cross-covariances `(nc, D, dv)`, the lift's rows
    `start : start + D_i`: each cluster's rows are read once, for all the queries. Run
    compiled: `_compiled`."""
    n_queries, width, value_dim = features.shape[0], features.shape[1], cross.shape[2]
    coefficient = np.empty(n_queries, out.dtype)
    for cluster in columns:
        for q in range(n_queries):
            coefficient[q] = weights[q, cluster] * slope[q, cluster]
        for i in range(width):
            row = start + i
            for q in range(n_queries):
                scale = coefficient[q] * features[q, i]
                if scale != 0:
                    for t in range(value_dim):
                        out[q, t] += scale * cross[cluster, row, t]


def value_shift_sums(
    heads: list[KeyClusters],
    weights: torch.Tensor,
    kept: torch.Tensor,
    shift_terms: list[tuple[torch.Tensor, torch.Tensor]],
    out: torch.Tensor,
) -> None:
    """Adds every head's value shift into `out` `(H, nq, dv)`: for the weights `(H, nq, C)` of
    the heads' clusters, those `kept` `(H, C)`, and per lift the slopes `(H, nq, C)` and query
    features `(H, nq, D_i)` (`estimate.ClusterEstimate.shift_terms`), `sum_c w_c sum_i g_ic
    Cov_c(b_i, v)^T a_i` over the kept clusters. Each kept cluster's cross-covariance is read
    once in place (not gathered), the heads spread over PyTorch's number of threads. No
    autograd; CPU float32 or float64 tensors of one dtype."""
    head_shift = _compiled(_head_shift)
    weights_np, kept_np = weights.numpy(), kept.numpy()
    terms = [(slope.numpy(), features.numpy()) for slope, features in shift_terms]

    def shift(head: int) -> None:
        columns = np.flatnonzero(kept_np[head, : heads[head].n_clusters])
        cross, start = heads[head].value_cross.numpy(), 0
        for slope, features in terms:
            # Contiguous rows (a lift's features are a slice of every lift's): one compiled
            # version serves every call.
            head_shift(
                *(np.ascontiguousarray(t[head]) for t in (weights_np, slope, features)),
                columns, cross, start, out[head].numpy(),
            )  # fmt: skip
            start += features.shape[-1]

    spread(shift, range(len(heads)))


# Queries per item of `dot_product_estimate` spread over the threads.
ESTIMATE_ROWS_PER_ITEM = 128


def _estimate_rows(
    mean: np.ndarray,
    variance: np.ndarray,
    projection: np.ndarray,
    norm: np.ndarray,
    radius: np.ndarray,
    log_count: np.ndarray,
    scale: float,
    log_mass: np.ndarray,
    floor: np.ndarray,
    slope: np.ndarray,
) -> None:
    """`estimate._dot_product_estimate` and what `estimate._estimate_heads` makes of it, for
    the rows of one head: from the similarities' means `(nq, nc)`, the variances' diagonal
    part `(nq, nc)` and the projections on the factors `(nq, r, nc)`, with the queries' norms
    `(nq,)`, the clusters' radii and log-counts `(nc,)`, writes the `log_mass`, `floor` and
    `slope` `(nq, nc)`, in the order of the PyTorch operations it replaces (equal to them up
    to rounding: multiplies and adds may fuse). Run compiled: `_compiled`."""
    n_queries, n_clusters = mean.shape
    rank = projection.shape[1]
    tiny = np.finfo(mean.dtype).tiny
    total = np.empty(n_clusters, mean.dtype)
    for q in range(n_queries):
        # Loops over the clusters innermost, so that they run in vector lanes.
        for c in range(n_clusters):
            total[c] = variance[q, c]
        for r in range(rank):
            for c in range(n_clusters):
                total[c] += projection[q, r, c] * projection[q, r, c]
        half_width = norm[q]
        for c in range(n_clusters):
            tilt = min(scale * total[c], half_width * radius[c])
            log_mass[q, c] = (mean[q, c] + 0.5 * tilt) * scale + log_count[c]
            floor[q, c] = log_count[c] + mean[q, c] * scale
            slope[q, c] = tilt / max(total[c], tiny)


def dot_product_estimate(
    mean: torch.Tensor,
    variance: torch.Tensor,
    projection: torch.Tensor,
    norm: torch.Tensor,
    radius: torch.Tensor,
    log_counts: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(log_mass, floor, slope)` `(H, nq, C)` of the dot product's estimate from the heads'
    similarity means and diagonal variances `(H, nq, C)`, projections `(H, nq, r, C)`, query
    norms `(H, nq)`, radii and log-counts `(H, C)` (`_estimate_rows`), the rows spread over
    PyTorch's number of threads. No autograd; CPU float32 or float64 tensors of one dtype."""
    n_heads, n_queries = mean.shape[:2]
    outputs = [torch.empty_like(mean) for _ in range(3)]
    tables = (mean, variance, projection, norm, radius, log_counts)
    arrays = [t.contiguous().numpy() for t in tables]
    written = [t.numpy() for t in outputs]
    estimate_rows = _compiled(_estimate_rows)

    def rows(item: tuple[int, int]) -> None:
        head, start = item
        own = slice(start, start + ESTIMATE_ROWS_PER_ITEM)
        mean_h, variance_h, projection_h, norm_h, radius_h, log_count_h = (t[head] for t in arrays)
        estimate_rows(
            mean_h[own], variance_h[own], projection_h[own], norm_h[own], radius_h, log_count_h,
            scale, *(t[head, own] for t in written),
        )  # fmt: skip

    items = [(h, s) for h in range(n_heads) for s in range(0, n_queries, ESTIMATE_ROWS_PER_ITEM)]
    spread(rows, items)
    return tuple(outputs)
