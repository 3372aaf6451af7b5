"""A decode step's tail attention for the dot product on the CPU, every stage compiled in one
loop per head (docs/indexes.md, "The decode step compiled").

A decode step asks a few queries per head. Through the stages of `tail_attention_heads`
(estimate, selection, exact part, calibration, unread estimate) each stage is a dozen PyTorch or
numpy calls on `(heads x queries, clusters)` tables of a few thousand entries, so the calls'
own cost, not the arithmetic, was most of the step (docs/benchmark-notes.md, "The decode step
compiled"). Here one
compiled function per head runs the same stages, with the same arithmetic, on that head's
clusters in place, and the heads are spread over PyTorch's number of threads (`threads.spread`;
the function releases the GIL). `tail_attention_heads_with_reads` takes this path where
`compiled_step_applies` and the batched stages everywhere else; tests/test_tail_decode.py checks
that both give the same answers.

What each stage computes is the docstring of its module: `estimate._estimate_heads` and
`_dot_product_estimate` (closed form, through the batched stages' `kernel._estimate_rows`),
`selection.select_clusters`, `exact._visited_apart` (the outlier clusters apart) with
`kernel._head_sums`, `calibration.calibrated`, `unread._tail_estimate` with
`kernel._head_shift`; the parts are merged as `merge_attention` merges them."""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch

from rewa.attention import DotProduct
from rewa.attention.geometry import records_grad

from ..clusters import ClusterHeads
from .calibration import CALIBRATION_STEPS
from .kernel import _compiled, _estimate_rows, _head_shift, _head_sums
from .kernel import compile_ahead as kernel_compile_ahead
from .selection import ordinary_averages, walk_widths
from .threads import spread
from .unread import SHIFT_NEGLIGIBLE

# The most queries per head a compiled step answers: a decode step's few (a block of more
# shares each visited cluster's products among them faster in the batched stages); 0: never.
COMPILED_STEP_ROWS = 8

# The compiled stages `_decode_head` calls, set by `_compiled_step` before it compiles it (Numba
# resolves the functions a compiled function calls when it compiles it).
_estimate_compiled = _select_compiled = _exact_compiled = None
_calibration_compiled = _unread_compiled = _merge_compiled = None
_head_sums_compiled = _head_shift_compiled = _estimate_rows_compiled = None


def compiled_step_applies(
    q: torch.Tensor,
    heads: ClusterHeads,
    always: torch.Tensor | None,
    tail: bool,
    measured_queries: int = 0,
) -> bool:
    """Whether `decode_step` answers for queries `(H, nq, d)`: the dot product on the CPU in
    float32 or float64, at most `COMPILED_STEP_ROWS` queries per head (a decode step's),
    without autograd, `always` keys, `tail=False` or `measured_queries` (index/tail/
    measured.py: the batched stages)."""
    return (
        type(heads.geometry) is DotProduct
        and q.device.type == "cpu"
        and heads.counts.dtype in (torch.float32, torch.float64)
        and q.shape[1] <= COMPILED_STEP_ROWS
        and tail
        and not measured_queries
        and (always is None or always.numel() == 0)
        and not records_grad(heads.geometry, q)
    )


class _HeadArrays(NamedTuple):
    """What the step reads of the stacked clusters, as numpy arrays made once per `ClusterHeads`
    (kept in its `derived`): per head the arguments of `_decode_head` that describe its
    clusters, and each head's average size of a cluster outside `exact_read` `(H,)` (as
    `select_clusters` averages it)."""

    per_head: list[tuple[np.ndarray, ...]]
    average_sizes: np.ndarray


def _head_arrays(heads: ClusterHeads) -> _HeadArrays:
    """The `_HeadArrays` of `heads`, made at the first call and kept in `heads.derived`."""
    found = heads.derived.get(__name__)
    if found is None:
        exact_read = heads.exact_read.numpy()
        factor = heads.factor_by_rank.numpy()  # (H, d, r, C): contiguous over the clusters
        per_head = []
        for head, clusters in enumerate(heads.heads):
            per_head.append((
                clusters.counts.numpy(), exact_read[head, : clusters.n_clusters],
                clusters.mean.numpy(), clusters.residual.numpy(),
                # One head's factors are a view in another order: copied to one layout.
                np.ascontiguousarray(factor[head]), clusters.radius.numpy(),
                clusters.value_mean.numpy(), clusters.value_cross.numpy(),
                clusters.offsets.numpy(), clusters.keys_w.numpy(), clusters.values.numpy(),
            ))  # fmt: skip
        averages = ordinary_averages(heads.counts, heads.exact_read)
        found = heads.derived[__name__] = _HeadArrays(per_head, averages)
    return found


def decode_step(
    qw: torch.Tensor, heads: ClusterHeads, budget_keys: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tail attention of the query witnesses `(H, nq, d)` over `heads` (`compiled_step_applies`)
    within `budget_keys` keys per query, more than 0: `(out (H, nq, dv), lse (H, nq),
    keys_read (H, nq))`."""
    if budget_keys <= 0:
        raise ValueError(f"expected a positive budget of keys, got {budget_keys}")
    n_heads, n_queries = qw.shape[:2]
    arrays = _head_arrays(heads)
    dtype = heads.counts.dtype
    value_dim = heads.heads[0].values.shape[-1]
    queries = qw.to(dtype).contiguous().numpy()
    out = torch.zeros(n_heads, n_queries, value_dim, dtype=dtype)
    lse = torch.full((n_heads, n_queries), float("-inf"), dtype=dtype)
    reads = torch.zeros(n_heads, n_queries, dtype=dtype)
    outputs = out.numpy(), lse.numpy(), reads.numpy()
    # As `select_clusters` makes them: each head's walk width, the budget in the counts' dtype.
    widths = walk_widths(arrays.average_sizes, budget_keys, heads.n_clusters)
    budget = np.array([budget_keys], dtype=outputs[0].dtype)
    scale = float(heads.geometry.scale)
    step = _compiled_step()

    def head_step(head: int) -> None:
        step(
            queries[head], scale, budget, int(widths[head]), CALIBRATION_STEPS, SHIFT_NEGLIGIBLE,
            *arrays.per_head[head], *(output[head] for output in outputs),
        )  # fmt: skip

    spread(head_step, range(n_heads))
    return out, lse, reads


@functools.cache
def _compiled_step():
    """`_decode_head` compiled (`kernel._compiled`), with the loops it calls."""
    global _estimate_compiled, _select_compiled, _exact_compiled
    global _calibration_compiled, _unread_compiled, _merge_compiled
    global _head_sums_compiled, _head_shift_compiled, _estimate_rows_compiled
    _head_sums_compiled = _compiled(_head_sums)
    _estimate_rows_compiled = _compiled(_estimate_rows)
    _head_shift_compiled = _compiled(_head_shift)
    _estimate_compiled = _compiled(_estimate)
    _select_compiled = _compiled(_select)
    _exact_compiled = _compiled(_exact_parts)
    _calibration_compiled = _compiled(_calibration)
    _unread_compiled = _compiled(_unread)
    _merge_compiled = _compiled(_merge)
    return _compiled(_decode_head)


def compile_ahead(dtypes: tuple[type, ...] = (np.float32, np.float64)) -> None:
    """Compiles every loop of tail attention (`kernel.compile_ahead`) and the step for contexts
    of `dtypes` (float32 and float64) now, into Numba's cache (the image does it when it is
    built, so that a server's first decode step compiles nothing)."""
    kernel_compile_ahead(dtypes)
    step = _compiled_step()
    for dtype in dtypes:
        one = np.ones((1, 2), dtype)
        step(
            one, 1.0, np.ones(1, dtype), 1, 1, 1e-3, np.ones(1, dtype), np.zeros(1, np.bool_),
            one, one, np.ones((2, 1, 1), dtype), np.ones((1, 1), dtype), one,
            np.ones((1, 2, 2), dtype), np.array([0, 1], np.int64), one, one,
            np.zeros((1, 2), dtype), np.zeros(1, dtype), np.zeros(1, dtype),
        )  # fmt: skip


def _decode_head(
    queries, scale, budget, width, calibration_steps, shift_negligible,
    counts, exact_read, mean, residual, factor, radius, value_mean, value_cross,
    offsets, keys, values, out, lse, reads,
):  # fmt: skip
    """One head's tail attention of its queries `(nq, d)` (witnesses, unscaled) over its
    clusters `(nc, ...)` (`factor` `(d, r, >= nc)`), into `out (nq, dv)`, `lse (nq,)` and
    `reads (nq,)` (module docstring). `budget`: the keys a query reads, an array of one element
    in the counts' dtype; `width`: how many of its most massive clusters a query's walk looks at."""
    n_queries, n_clusters = queries.shape[0], counts.shape[0]
    value_dim, dtype = values.shape[1], out.dtype
    log_mass = np.empty((n_queries, n_clusters), dtype)
    floor = np.empty((n_queries, n_clusters), dtype)
    slope = np.empty((n_queries, n_clusters), dtype)
    _estimate_compiled(
        queries, scale, counts, mean, residual, factor, radius, log_mass, floor, slope
    )
    chosen = np.zeros((n_queries, n_clusters), np.bool_)
    pair_query = np.empty((2, n_queries * n_clusters), np.int64)
    pair_cluster = np.empty((2, n_queries * n_clusters), np.int64)
    n_pairs = np.zeros(2, np.int64)
    _select_compiled(
        log_mass, counts, exact_read, budget, width, chosen, pair_query, pair_cluster, n_pairs,
        reads,
    )  # fmt: skip
    parts_out = np.zeros((2, n_queries, value_dim), dtype)
    parts_lse = np.empty((2, n_queries), dtype)
    _exact_compiled(
        queries * scale, keys, values, offsets, pair_query, pair_cluster, n_pairs, parts_out,
        parts_lse,
    )  # fmt: skip
    alpha = _calibration_compiled(
        log_mass, floor, pair_query[0, : n_pairs[0]], pair_cluster[0, : n_pairs[0]], parts_lse[0],
        calibration_steps,
    )  # fmt: skip
    tail_out = np.zeros((n_queries, value_dim), dtype)
    tail_lse = np.empty(n_queries, dtype)
    _unread_compiled(
        log_mass, floor, slope, alpha, chosen, counts, value_mean, value_cross, queries,
        parts_lse, shift_negligible, tail_out, tail_lse,
    )  # fmt: skip
    _merge_compiled(parts_out, parts_lse, tail_out, tail_lse, out, lse)


def _estimate(queries, scale, counts, mean, residual, factor, radius, log_mass, floor, slope):
    """Every cluster's estimate for every query, `(nq, nc)` each (estimate._estimate_heads and
    _dot_product_estimate, closed form): `log_mass`, its `floor` at zero variance and the
    value shift's `slope`. The similarities' means, the variances' diagonal part and the
    projections on the factors of rank r are made here, each row of statistics read once for
    all the queries (`factor` `(d, r, C)` contiguous over the clusters, so that the projections
    run in vector lanes); the closed form from them is the batched stages' compiled pass
    (`kernel._estimate_rows`)."""
    n_queries, dim = queries.shape
    n_clusters, rank = counts.shape[0], factor.shape[1]
    projection = np.zeros((n_queries, rank, n_clusters), log_mass.dtype)
    for t in range(dim):
        for r in range(rank):
            for q in range(n_queries):
                a = queries[q, t]
                for c in range(n_clusters):
                    projection[q, r, c] += a * factor[t, r, c]
    norm = np.empty(n_queries, log_mass.dtype)
    for q in range(n_queries):
        squares = queries[q, 0] * queries[q, 0]
        for t in range(1, dim):
            squares += queries[q, t] * queries[q, t]
        norm[q] = np.sqrt(squares)
    similarity = np.empty((n_queries, n_clusters), log_mass.dtype)
    diagonal = np.empty((n_queries, n_clusters), log_mass.dtype)
    log_count = np.empty(n_clusters, log_mass.dtype)
    for c in range(n_clusters):
        log_count[c] = np.log(counts[c]) if counts[c] > 0 else -np.inf
        for q in range(n_queries):
            mean_logit = queries[q, 0] * mean[c, 0]
            variance = queries[q, 0] * queries[q, 0] * residual[c, 0]
            for t in range(1, dim):
                mean_logit += queries[q, t] * mean[c, t]
                variance += queries[q, t] * queries[q, t] * residual[c, t]
            similarity[q, c], diagonal[q, c] = mean_logit, variance
    _estimate_rows_compiled(
        similarity, diagonal, projection, norm, radius[:, 0], log_count, scale, log_mass, floor,
        slope,
    )  # fmt: skip


def _select(
    log_mass, counts, exact_read, budget, width, chosen, pair_query, pair_cluster, n_pairs, reads
):  # fmt: skip
    """The clusters each query reads (selection.select_clusters): its `width` most massive
    outside exact_read, largest first (rounds of argmax: ties to the lower column), with the
    exact_read ones right after the first, the first always taken, each other if its keys still
    fit in the budget.
    Flags them `chosen` `(nq, nc)`, adds their sizes to `reads`, and lists them as pairs
    `(query, cluster)`: `pair_query[0]`, `pair_cluster[0]` (`n_pairs[0]` of them) outside
    exact_read, `[1]` inside (exact._visited_apart)."""
    n_queries, n_clusters = log_mass.shape
    looked = min(width, n_clusters)
    n_forced = 0
    for c in range(n_clusters):
        n_forced += exact_read[c]
    candidates = np.empty(looked + n_forced, np.int64)
    ordinary_mass = np.empty(n_clusters, log_mass.dtype)
    for q in range(n_queries):
        for c in range(n_clusters):
            ordinary_mass[c] = -np.inf if exact_read[c] else log_mass[q, c]
        for position in range(looked):
            best = 0
            for c in range(1, n_clusters):
                if ordinary_mass[c] > ordinary_mass[best]:
                    best = c
            ordinary_mass[best] = -np.inf
            # The first, then the exact_read clusters in ascending order, then the others.
            candidates[position + n_forced if position > 0 else 0] = best
        position = 1
        for c in range(n_clusters):
            if exact_read[c]:
                candidates[position] = c
                position += 1
        remaining = budget[0]
        for position in range(looked + n_forced):
            c = candidates[position]
            size = counts[c]
            if exact_read[c] and not 1 <= position <= n_forced:
                size = 0  # exact_read among the most massive: not in `ordinary_counts`
            if size > 0 and (size <= remaining or position == 0):  # the first always
                remaining -= size
                chosen[q, c] = True
                part = 1 if exact_read[c] else 0
                pair_query[part, n_pairs[part]] = q
                pair_cluster[part, n_pairs[part]] = c
                n_pairs[part] += 1
                reads[q] += counts[c]


def _exact_parts(
    scaled, keys, values, offsets, pair_query, pair_cluster, n_pairs, parts_out, parts_lse
):  # fmt: skip
    """The exact attention `(parts_out (2, nq, dv), parts_lse (2, nq))` of the scaled queries
    over the keys of their pairs, each part's apart (kernel._head_sums); `(0, -inf)` where a
    query read nothing in a part."""
    n_queries, value_dim = parts_out.shape[1], parts_out.shape[2]
    weight = np.empty(n_queries, parts_out.dtype)
    peak = np.empty(n_queries, parts_out.dtype)
    no_skip = np.zeros(0, np.bool_)
    for part in range(2):
        weight[:] = 0
        peak[:] = -np.inf
        _head_sums_compiled(
            scaled, keys, values, offsets, pair_query[part, : n_pairs[part]],
            pair_cluster[part, : n_pairs[part]], no_skip, parts_out[part], weight, peak,
        )  # fmt: skip
        for q in range(n_queries):
            parts_lse[part, q] = -np.inf
            if weight[q] > 0:
                parts_lse[part, q] = peak[q] + np.log(weight[q])
                for t in range(value_dim):
                    parts_out[part, q, t] /= weight[q]


def _calibration(log_mass, floor, pair_query, pair_cluster, target, steps):
    """Each query's `alpha` `(nq,)` (calibration.calibrated): Newton's steps towards the one in
    [0, 1] at which the estimates of its pairs, moved `alpha` of the way to their floor, sum
    to their exact log-mass `target`; 0 where they are already at or below it, and where the
    query read nothing."""
    n_queries = log_mass.shape[0]
    dtype = log_mass.dtype
    tiny = np.finfo(dtype).tiny
    alpha = np.zeros(n_queries, dtype)
    peak = np.empty(n_queries, dtype)
    total = np.empty(n_queries, dtype)
    weighted = np.empty(n_queries, dtype)
    for _ in range(steps):
        peak[:] = -np.inf
        for i in range(len(pair_query)):
            q, c = pair_query[i], pair_cluster[i]
            excess = log_mass[q, c] - floor[q, c]
            peak[q] = max(peak[q], floor[q, c] + (1 - alpha[q]) * excess)
        total[:] = 0
        weighted[:] = 0
        for i in range(len(pair_query)):
            q, c = pair_query[i], pair_cluster[i]
            excess = log_mass[q, c] - floor[q, c]
            w = np.exp(floor[q, c] + (1 - alpha[q]) * excess - peak[q])
            total[q] += w
            weighted[q] += w * excess
        for q in range(n_queries):
            if total[q] > 0 and peak[q] + np.log(total[q]) > target[q]:
                step = (peak[q] + np.log(total[q]) - target[q]) / max(weighted[q] / total[q], tiny)
                alpha[q] = min(max(alpha[q] + step, 0.0), 1.0)
    for q in range(n_queries):
        if not np.isfinite(target[q]):
            alpha[q] = 0.0
    return alpha


def _unread(
    log_mass, floor, slope, alpha, chosen, counts, value_mean, value_cross, queries, parts_lse,
    shift_negligible, tail_out, tail_lse,
):  # fmt: skip
    """The estimate `(tail_out (nq, dv), tail_lse (nq,))` of the clusters each query did not
    read (unread._tail_estimate): their calibrated log-masses, their value means, and the value
    shift (kernel._head_shift) over the clusters holding at least `shift_negligible / nc` of
    some query's whole mass (the read part's included)."""
    n_queries, n_clusters = log_mass.shape
    weights = np.empty((n_queries, n_clusters), log_mass.dtype)
    whole = np.empty(n_queries, log_mass.dtype)
    total = np.empty(n_queries, log_mass.dtype)
    for q in range(n_queries):
        peak = -np.inf
        for c in range(n_clusters):
            if chosen[q, c] or counts[c] <= 0:
                log_mass[q, c] = -np.inf
            else:
                log_mass[q, c] += alpha[q] * (floor[q, c] - log_mass[q, c])
            peak = max(peak, log_mass[q, c])
        if not np.isfinite(peak):
            peak = 0.0
        total[q] = 0
        for c in range(n_clusters):
            weights[q, c] = np.exp(log_mass[q, c] - peak)
            total[q] += weights[q, c]
            for t in range(tail_out.shape[1]):
                tail_out[q, t] += weights[q, c] * value_mean[c, t]
        whole[q] = total[q] + np.exp(parts_lse[0, q] - peak) + np.exp(parts_lse[1, q] - peak)
        tail_lse[q] = peak + np.log(total[q])
    kept = np.empty(n_clusters, np.int64)
    n_kept = 0
    for c in range(n_clusters):
        for q in range(n_queries):
            if weights[q, c] >= whole[q] * (shift_negligible / n_clusters):
                kept[n_kept] = c
                n_kept += 1
                break
    _head_shift_compiled(weights, slope, queries, kept[:n_kept], value_cross, 0, tail_out)
    for q in range(n_queries):
        if total[q] > 0:
            for t in range(tail_out.shape[1]):
                tail_out[q, t] /= total[q]


def _merge(parts_out, parts_lse, tail_out, tail_lse, out, lse):
    """`(out, lse)` of the two exact parts and the estimate together (merge_attention); `(0,
    -inf)` where all three are empty."""
    for q in range(out.shape[0]):
        top = max(max(parts_lse[0, q], parts_lse[1, q]), tail_lse[q])
        if not np.isfinite(top):
            continue
        lse[q] = top + np.log(
            np.exp(parts_lse[0, q] - top) + np.exp(parts_lse[1, q] - top)
            + np.exp(tail_lse[q] - top)
        )  # fmt: skip
        for t in range(out.shape[1]):
            out[q, t] = (
                parts_out[0, q, t] * np.exp(parts_lse[0, q] - lse[q])
                + parts_out[1, q, t] * np.exp(parts_lse[1, q] - lse[q])
                + tail_out[q, t] * np.exp(tail_lse[q] - lse[q])
            )
