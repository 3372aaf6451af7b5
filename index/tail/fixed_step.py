"""A decode step's tail attention for the dot product on a CUDA GPU: every stage in tensor
operations of shapes fixed by the clusters, the budget and the number of `always` keys, captured
once as a CUDA graph and replayed (docs/indexes.md, "The decode step on a GPU").

Through the batched stages of `tail_attention_heads` a decode step on a GPU is bound by kernel
launches and by the host reading tensors (`nonzero`, `.item()`, sizes that depend on the data),
not by arithmetic (docs/benchmark-notes.md, "The CUDA paths on an H200 (issue 27)"). Here the
stages compute the same quantities with no shape and no branch that depends on a tensor's
values:

- estimate: `estimate._estimate_heads`, as the batched stages call it;
- selection: `selection.select_clusters`'s walk, as a mask over its candidates (each head's
  walk width of them, the rows padded to the widest head's with candidates never taken; plus the
  outlier clusters, `exact_read`, right after the first) instead of a list of pairs;
- exact part: each query's keys as `slots` positions, the keys of its chosen clusters one after
  another (`n_slots`: the most its chosen clusters can span), gathered and attended with a
  mask; the outlier clusters' keys apart, as `exact._visited_apart` keeps them, and the `always`
  keys in a part of their own, as the batched stages read them;
- calibration: `calibration.calibrated`'s Newton steps over the `(rows, clusters)` tables,
  masked to the ordinary clusters each query read;
- unread: `unread._tail_estimate`, the value shift over every cluster with the ones it leaves
  out at weight 0, the cross-covariances stacked once (in `shift_dtype`).

The parts are merged as `merge_attention` merges them. `fixed_shape_step` answers as the batched
stages do, up to the order of floating-point sums (tests/test_tail_fixed_step.py on the CPU,
tests/test_cuda.py on a GPU)."""

from __future__ import annotations

import math
import threading
import warnings
from typing import NamedTuple

import numpy as np
import torch

from rewa.attention import DotProduct, merge_attention
from rewa.attention.geometry import records_grad
from rewa.attention.sparse import softmax_attend

from ..clusters import ClusterHeads
from .calibration import CALIBRATION_STEPS
from .estimate import _estimate_heads
from .selection import _most_massive, ordinary_averages, walk_widths
from .unread import shift_dtype, shift_shares, unread_weights

# The most queries per head a fixed step answers: a decode step's few (grouped-query attention
# included); blocks of more go through the batched stages, whose selection lists pairs.
FIXED_STEP_ROWS = 16
# The most key elements (rows x slots x dimension) the gathered exact part may hold: 256 MiB in
# float32. A larger budget goes through the batched stages, which read the keys in place.
MAX_GATHERED_ELEMENTS = 1 << 26
# Whether a fixed step on a CUDA GPU is captured as a CUDA graph and replayed; off, it runs its
# operations one by one (the same answers).
USE_GRAPHS = True
_GRAPHS_LOCK = threading.Lock()


class _Stacked(NamedTuple):
    """What the fixed step reads of `ClusterHeads`, made once per clusters (in `derived`):

    - `keys` `(H, n, d)`, `values` `(H, n, dv)`: the heads' sorted keys and values (views for one
      head, copies for several);
    - `offsets` `(H, C + 1)`: each cluster's first sorted position, padding clusters at `n`;
    - `position` `(H, n)`: each key id's sorted position;
    - `forced` `(H, F)`: each head's outlier clusters in ascending order, padded with ordinary
      clusters (read as size 0: never) to the most of any head, F;
    - `value_cross` `(H, C, D dv)`: the key-value cross-covariances in `shift_dtype`;
    - `shift_share` `(H, 1, 1)`: `unread.shift_shares`;
    - `averages` `(H,)`: each head's average size of an ordinary cluster (as `select_clusters`
      computes it)."""

    keys: torch.Tensor
    values: torch.Tensor
    offsets: torch.Tensor
    position: torch.Tensor
    forced: torch.Tensor
    value_cross: torch.Tensor
    shift_share: torch.Tensor
    averages: np.ndarray


def fixed_shape_step_applies(
    qw: torch.Tensor,
    heads: ClusterHeads,
    tail: bool,
    budget_keys: float,
    n_always: int = 0,
    measured_queries: int = 0,
) -> bool:
    """Whether `fixed_shape_step` answers for query witnesses `(H, nq, d)`: the dot product on
    a CUDA GPU in float32 or float64, at most `FIXED_STEP_ROWS` queries per head, a budget of
    more than 0 keys besides the `n_always` keys every query reads, a gathered exact part within
    `MAX_GATHERED_ELEMENTS`, without autograd, `tail=False` or `measured_queries` (index/tail/
    measured.py: the batched stages)."""
    if not (
        type(heads.geometry) is DotProduct
        and qw.device.type == "cuda"
        and heads.counts.dtype in (torch.float32, torch.float64)
        and qw.shape[1] <= FIXED_STEP_ROWS
        and tail
        and not measured_queries
        and budget_keys > 0
        and not records_grad(heads.geometry, qw)
    ):
        return False
    slots = n_slots(_largest(heads), budget_keys, n_always)
    return qw.shape[0] * qw.shape[1] * slots * qw.shape[2] <= MAX_GATHERED_ELEMENTS


def n_slots(largest: int, budget_keys: float, n_always: int = 0) -> int:
    """The most key positions a query's chosen clusters span within `budget_keys`: the budget,
    or the `largest` cluster's size (the most massive is read whatever its size, and then
    nothing else fits), and the `n_always` keys among them, which are read apart."""
    return max(int(budget_keys), largest, 1) + n_always


def _largest(heads: ClusterHeads) -> int:
    """The size of the largest cluster of `heads`, found once and kept in `heads.derived`."""
    key = f"{__name__}.largest"
    if key not in heads.derived:
        heads.derived[key] = int(heads.counts.max())
    return heads.derived[key]


def fixed_shape_step(
    qw: torch.Tensor, heads: ClusterHeads, budget_keys: float, always: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tail attention of the query witnesses `(H, nq, d)` over `heads` within `budget_keys` keys
    per query (more than 0), besides the key ids `always` (unique, in range; read exactly by
    every query): `(out (H, nq, dv), lse (H, nq), keys_read (H, nq))`, the same answers as the
    batched stages (module docstring).

    On a CUDA GPU (with `USE_GRAPHS`) the step's operations are captured as a CUDA graph at the
    first call of each query shape, number of `always` keys, budget and walk widths, and replayed
    at the next ones; the graphs are kept with the clusters. With `always` keys, their clusters'
    sizes and the walk's widths (from the average sizes) are found before the graph, one wait for
    the GPU per call."""
    if budget_keys <= 0:
        raise ValueError(f"expected a positive budget of keys, got {budget_keys}")
    stacked = _stacked(heads)
    qw = qw.to(heads.counts.dtype)
    counts, positions, averages = None, None, stacked.averages  # counts None: heads.counts
    if always is not None and always.numel() > 0:
        # The always keys' sorted positions per head, and the cluster sizes without them.
        positions = stacked.position[:, always.to(qw.device)]
        cluster = torch.searchsorted(stacked.offsets, positions, right=True) - 1
        removed = torch.zeros_like(heads.counts).scatter_add_(
            1, cluster, torch.ones_like(positions, dtype=heads.counts.dtype)
        )
        counts = heads.counts - removed
        averages = ordinary_averages(counts, heads.exact_read)
    widths = walk_widths(averages, budget_keys, heads.n_clusters)
    inputs = (qw, counts, positions)
    if qw.device.type != "cuda" or not USE_GRAPHS:
        return _step(heads, stacked, budget_keys, _walk_limits(widths, qw), *inputs)
    n_always = 0 if positions is None else positions.shape[1]
    with _GRAPHS_LOCK:
        graphs = heads.derived.setdefault(f"{__name__}.graphs", {})
        key = (tuple(qw.shape), n_always, budget_keys, tuple(widths.tolist()))
        if key not in graphs:
            # The walk's mask is made once per graph, which keeps it (it reads it).
            graphs[key] = _captured(heads, stacked, budget_keys, _walk_limits(widths, qw), inputs)
        if graphs[key] is None:  # the capture failed: the operations one by one
            return _step(heads, stacked, budget_keys, _walk_limits(widths, qw), *inputs)
        graph, static_inputs, outputs, _ = graphs[key]
        # One replay at a time: the graph reads its input tensors and writes its outputs in
        # place, so the caller keeps copies, queued on the stream before the next replay.
        for static, given in zip(static_inputs, inputs, strict=True):
            if static is not None:
                static.copy_(given)
        graph.replay()
        return tuple(t.clone() for t in outputs)


def _captured(heads, stacked, budget_keys, walk, inputs):
    """`_step` captured as a CUDA graph for inputs of the shapes of `inputs`: `(graph, the
    inputs it reads, the outputs it writes, walk)`, or None (with a warning) where the capture
    fails. Two calls on a side stream first, as PyTorch's graph capture asks (they set up the
    libraries' workspaces)."""
    static_inputs = tuple(None if t is None else t.clone() for t in inputs)
    device = inputs[0].device
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            _step(heads, stacked, budget_keys, walk, *static_inputs)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            outputs = _step(heads, stacked, budget_keys, walk, *static_inputs)
    except RuntimeError as error:
        warnings.warn(
            f"tail attention's decode step could not be captured as a CUDA graph ({error}); "
            "it runs its operations one by one",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return graph, static_inputs, outputs, walk  # the graph reads walk's mask


def _stacked(heads: ClusterHeads) -> _Stacked:
    """The `_Stacked` of `heads`, made at the first call and kept in `heads.derived`."""
    found = heads.derived.get(__name__)
    if found is not None:
        return found
    n_clusters = heads.n_clusters
    clusters = heads.heads
    if len(clusters) == 1:
        keys, values = clusters[0].keys_w.unsqueeze(0), clusters[0].values.unsqueeze(0)
    else:
        keys = torch.stack([c.keys_w for c in clusters])
        values = torch.stack([c.values for c in clusters])
    n_keys = keys.shape[1]
    offsets = heads.counts.new_full((heads.n_heads, n_clusters + 1), n_keys, dtype=torch.long)
    for head, c in enumerate(clusters):
        offsets[head, : c.n_clusters + 1] = c.offsets
    exact_read = heads.exact_read
    n_forced = int(exact_read.sum(-1).max())
    # Each head's flagged clusters first, in ascending order (as `select_clusters` orders them).
    forced = (~exact_read).to(torch.uint8).argsort(dim=-1, stable=True)[:, :n_forced]
    position = torch.empty(heads.n_heads, n_keys, dtype=torch.long, device=keys.device)
    for head, c in enumerate(clusters):
        position[head, c.order] = torch.arange(n_keys, device=keys.device)
    dtype = shift_dtype(heads.counts.dtype, keys.device)
    cross = keys.new_zeros(
        heads.n_heads, n_clusters, math.prod(clusters[0].value_cross.shape[1:]), dtype=dtype
    )
    for head, c in enumerate(clusters):
        cross[head, : c.n_clusters] = c.value_cross.flatten(1).to(dtype)
    found = heads.derived[__name__] = _Stacked(
        keys=keys,
        values=values,
        offsets=offsets,
        position=position,
        forced=forced,
        value_cross=cross,
        shift_share=shift_shares(heads),
        averages=ordinary_averages(heads.counts, exact_read),
    )
    return found


def _step(heads, stacked, budget_keys, walk, qw, counts, positions):
    """The stages on fixed shapes (module docstring): `(out, lse, keys_read)` of the queries
    `qw` `(H, nq, d)` with the clusters' sizes `counts` `(H, C)` without the always keys (None:
    `heads.counts`) and the always keys' sorted positions `positions` `(H, A)` or None."""
    n_heads, n_queries = qw.shape[:2]
    counts = heads.counts if counts is None else counts
    estimate = _estimate_heads(qw, heads, counts)
    rows = estimate.rows()
    n_clusters = rows.log_mass.shape[-1]
    candidates, sizes, forced = _candidates(rows.log_mass, heads, stacked, counts, walk, n_queries)
    taken = _walk(sizes, budget_keys)
    read = sizes * taken  # each candidate's keys read, 0 if not taken
    # The key positions each taken candidate spans, the always keys among them included.
    spans = read
    if positions is not None:
        spans = _per_row(heads.counts, n_queries).gather(1, candidates) * taken
    n_always = 0 if positions is None else positions.shape[1]
    slots = n_slots(_largest(heads), budget_keys, n_always)
    parts = _exact_parts(qw, heads, stacked, candidates, spans, forced, slots, positions)
    if positions is not None:
        parts.append(_always_part(qw, heads, stacked, positions))
    taken_flags = _flags(candidates, taken, n_clusters)
    ordinary = _flags(candidates, taken & ~forced, n_clusters)
    log_mass = _calibrated(rows.log_mass, rows.floor, ordinary, parts[0][1])
    unread = log_mass.masked_fill(taken_flags, -math.inf).view(n_heads, n_queries, -1)
    (slope, a), *_ = estimate.shift_terms
    read_lse = torch.stack([lse for _, lse in parts]).logsumexp(0).view(n_heads, n_queries)
    parts.append(_unread(heads, stacked, unread, slope, a, read_lse))
    out, lse = merge_attention(*parts)
    shape = (n_heads, n_queries)
    return out.view(*shape, -1), lse.view(shape), (read.sum(-1) + n_always).view(shape)


def _candidates(log_mass, heads, stacked, counts, walk, n_queries):
    """Each row's candidates in the walk's order `(rows, L)`, their sizes in `counts` `(rows,
    L)` and whether each is an outlier cluster `(rows, L)` (`select_clusters`): the most massive
    ordinary clusters, as many as the widest head's walk looks at (`walk`, `_walk_limits`; a
    row's beyond its own head's width at size 0, never taken), with the outlier clusters right
    after the first."""
    width, beyond = walk
    exact_read = _per_row(heads.exact_read, n_queries)
    best = _most_massive(log_mass.masked_fill(exact_read, -math.inf), width)
    row_counts = _per_row(counts, n_queries)
    sizes = row_counts.masked_fill(exact_read, 0).gather(1, best)
    if beyond is not None:
        sizes = sizes.masked_fill(beyond, 0)
    is_forced = torch.zeros_like(best, dtype=torch.bool)
    if stacked.forced.shape[1]:
        forced = _per_row(stacked.forced, n_queries)
        forced_sizes = row_counts.gather(1, forced) * exact_read.gather(1, forced)
        best = torch.cat([best[:, :1], forced, best[:, 1:]], dim=1)
        sizes = torch.cat([sizes[:, :1], forced_sizes, sizes[:, 1:]], dim=1)
        flagged = torch.ones_like(forced, dtype=torch.bool)
        is_forced = torch.cat([is_forced[:, :1], flagged, is_forced[:, 1:]], dim=1)
    return best, sizes, is_forced


def _walk_limits(widths: np.ndarray, qw: torch.Tensor) -> tuple[int, torch.Tensor | None]:
    """The walk's candidates per row of the queries `qw` `(H, nq, d)`, for each head's walk
    width `widths` `(H,)`: the widest head's width, and which of each row's candidates lie
    beyond its own head's width `(H * nq, width)` on the queries' device (None where no head's
    width is narrower). Made before a CUDA graph is captured: the graph reads the mask."""
    width = int(widths.max())
    if (widths == width).all():
        return width, None
    row_widths = torch.from_numpy(np.repeat(widths, qw.shape[1])).unsqueeze(-1)
    return width, (torch.arange(width) >= row_widths).to(qw.device)


def _walk(sizes: torch.Tensor, budget_keys: float) -> torch.Tensor:
    """`select_clusters`'s walk over the candidates' sizes `(rows, L)`: whether each is read,
    the first whatever its size, each other if it still fits in the budget (sizes 0 never).
    Three operations per candidate (a size of 0 made infinite never fits)."""
    fitting = torch.where(sizes > 0, sizes, math.inf)
    remaining = budget_keys - sizes[:, 0]
    taken = [sizes[:, 0] > 0]
    for column in range(1, sizes.shape[1]):
        fits = fitting[:, column] <= remaining
        remaining = remaining - torch.where(fits, sizes[:, column], 0)
        taken.append(fits)
    return torch.stack(taken, dim=1)


def _exact_parts(qw, heads, stacked, candidates, spans, forced, slots, positions):
    """The exact attention of each query over the keys of the candidates it reads, ordinary and
    outlier clusters apart: `[(out (rows, dv), lse (rows,))] * 2` (`(0, -inf)` where a query read
    nothing in a part). Slot s of a row holds the key at position s of its chosen clusters' key
    positions (`spans` each) laid one after another; the always keys among them (`positions`)
    are left out, read apart."""
    n_heads, n_queries, dim = qw.shape
    n_rows, width = candidates.shape
    spans = spans.long()
    ends = spans.cumsum(1)  # (rows, L): where each candidate's keys end among the slots
    slot = torch.arange(slots, device=qw.device).expand(n_rows, -1).contiguous()
    which = torch.searchsorted(ends, slot, right=True)  # the candidate holding each slot
    filled = which < width
    which = which.clamp_max(width - 1)
    cluster = candidates.gather(1, which)
    within = slot - (ends.gather(1, which) - spans.gather(1, which))
    first = _per_row(stacked.offsets, n_queries).gather(1, cluster)
    n_keys = stacked.keys.shape[1]
    head = _row_heads(n_heads, n_queries, qw.device).unsqueeze(-1)
    position = torch.where(filled, first + within, 0) + head * n_keys
    if positions is not None:
        is_always = torch.zeros(n_heads, n_keys, dtype=torch.bool, device=qw.device)
        is_always.scatter_(1, positions, True)
        filled = filled & ~is_always.flatten()[position]
    keys = stacked.keys.flatten(0, 1)[position]  # (rows, slots, d)
    values = stacked.values.flatten(0, 1)[position]  # (rows, slots, dv)
    queries = qw.reshape(n_rows, dim, 1)
    logits = (keys @ queries).squeeze(-1) * heads.geometry.scale
    outlying = forced.gather(1, which)
    parts = torch.stack([filled & ~outlying, filled & outlying])  # (2, rows, slots)
    logits = logits.expand(2, -1, -1).masked_fill(~parts, -math.inf)
    # Normalised by the log-sum-exp, not by `softmax_attend`'s peak and sum: half as many
    # operations, each one a kernel of the replayed graph.
    lse = logits.logsumexp(-1)
    weights = (logits - lse.nan_to_num(0.0, 0.0, 0.0).unsqueeze(-1)).exp()
    out = (weights.unsqueeze(2) @ values).squeeze(2)
    return [(out[0], lse[0]), (out[1], lse[1])]


def _always_part(qw, heads, stacked, positions):
    """Exact attention `(out (rows, dv), lse (rows,))` of every head's queries over its always
    keys (sorted `positions` `(H, A)`), as the batched stages read them."""
    dim, value_dim = stacked.keys.shape[-1], stacked.values.shape[-1]
    keys = stacked.keys.gather(1, positions.unsqueeze(-1).expand(-1, -1, dim))
    values = stacked.values.gather(1, positions.unsqueeze(-1).expand(-1, -1, value_dim))
    out, lse = softmax_attend(heads.geometry.score(qw, keys), values)
    return out.flatten(0, 1), lse.flatten(0, 1)


def _row_heads(n_heads: int, n_queries: int, device: torch.device) -> torch.Tensor:
    """Each row's head `(H * nq,)`."""
    return torch.arange(n_heads, device=device).view(-1, 1).expand(-1, n_queries).flatten()


def _flags(candidates: torch.Tensor, chosen: torch.Tensor, n_clusters: int) -> torch.Tensor:
    """`(rows, C)`: whether each cluster is among a row's `chosen` candidates (the padding of the
    outlier clusters may repeat a cluster, never a chosen one)."""
    flags = chosen.new_zeros(chosen.shape[0], n_clusters, dtype=torch.int32)
    return flags.scatter_add_(1, candidates, chosen.to(torch.int32)) > 0


def _calibrated(log_mass, floor, ordinary, target):
    """`calibration.calibrated` with the pairs as a mask `ordinary` `(rows, C)`."""
    excess = torch.where(ordinary, log_mass - floor, 0)
    floor_read = torch.where(ordinary, floor, -math.inf)
    tiny = torch.finfo(log_mass.dtype).tiny
    alpha = log_mass.new_zeros(log_mass.shape[0], 1)
    for _ in range(CALIBRATION_STEPS):
        values = floor_read + (1 - alpha) * excess
        peak = values.amax(-1, keepdim=True)
        peak = torch.where(torch.isfinite(peak), peak, 0)
        weights = (values - peak).exp()
        total = weights.sum(-1, keepdim=True)
        slope = (weights * excess).sum(-1, keepdim=True) / torch.where(total > 0, total, 1)
        value = peak + total.log()
        step = (value - target.unsqueeze(-1)) / slope.clamp_min(tiny)
        alpha = torch.where(value > target.unsqueeze(-1), alpha + step, alpha).clamp(0, 1)
    alpha = torch.where(torch.isfinite(target.unsqueeze(-1)), alpha, 0)
    inf = math.inf
    return torch.lerp(log_mass, floor, alpha).nan_to_num_(-inf, inf, -inf)


def _unread(heads, stacked, log_mass, slope, a, read_lse):
    """`unread._tail_estimate` of the unread clusters' `log_mass` `(H, nq, C)`: `(out (H * nq,
    dv), lse (H * nq,))`, the value shift over every cluster (those it leaves out at weight 0)."""
    peak, weights, total, kept = unread_weights(log_mass, read_lse, stacked.shift_share)
    out = weights @ heads.value_mean
    cross = stacked.value_cross
    shifted = (weights * kept.unsqueeze(1) * slope).to(cross.dtype) @ cross
    shifted = shifted.view(*a.shape, -1).to(out.dtype)  # (H, nq, D, dv)
    out = out + (a.unsqueeze(2) @ shifted).squeeze(2)
    out = out / torch.where(total > 0, total, 1).unsqueeze(-1)
    return out.flatten(0, 1), (peak.squeeze(-1) + total.log()).flatten(0, 1)


def _per_row(stacked: torch.Tensor, n_queries: int) -> torch.Tensor:
    """A per-head `(H, ...)` table as the rows of the heads' queries `(H * nq, ...)`."""
    return stacked.unsqueeze(1).expand(-1, n_queries, *stacked.shape[1:]).flatten(0, 1)
