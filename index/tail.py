"""Cluster-tail attention (docs/mathematics.md 6, "Tail estimate"): exact attention over the keys of
the clusters a query visits, an estimate of every cluster it does not visit, merged exactly
(docs/mathematics.md 7).

Estimator (`estimate_clusters`). Within cluster c, a query's lift similarities `s` to the
cluster's keys have the exact mean `s_bar = <a, mu_c> + c` and variance `a^T Sigma_c a` (per
lift, with the cross-covariances between lifts), from the cluster's feature moments
(`clusters.KeyClusters`). Model `s` as Gaussian with those moments, truncated to the range the
cluster's radius allows (`s_bar +- |a| radius`), and integrate:

- dot product (`logit = scale * s`), in closed form, the second-order estimate of
  docs/mathematics.md 6:
  `log sum_{j in c} exp(l_j) ~ log n_c + scale s_bar + scale Delta / 2` with the tilt
  `Delta = min(scale var, |a| radius)`: `scale Delta / 2 = scale^2 var / 2`, docs/mathematics.md 6's
  `q^T Sigma q / (2 d)`, unless the bound caps it;
- every other geometry: `log n_c + log sum_k w_k exp(phi(s_k))` over the three-point
  Gauss-Hermite rule, nodes `s_k = s_bar + sqrt(var) (0, +-sqrt(3))` with weights
  `(2/3, 1/6, 1/6)` (clamped to the bound), `phi` the geometry's logit as a function of the
  similarity (`Geometry.similarity_logits`); `Delta` is the tilted mean of `s` minus `s_bar`.
  The rule matches the Gaussian's moments up to the fifth; rules with more nodes reach further
  into a Gaussian tail that real clusters do not have, and with steep logits that tail
  dominates: on `tree` (Poincare, temperature 0.06, N = 8192) eight nodes overestimated the
  log-partition by 14-28 nats, three nodes by 0.01-0.12.
  A product geometry does this per lift and adds the cross-lift cumulant
  `sum_{i<j} g_i g_j Cov(s_i, s_j)`, `g_i = Delta_i / var_i`.

Values: with `g = Delta / var` (the effective slope; `= scale` for an untruncated dot product),
the cluster's softmax-weighted value is `m_c + sum_i g_i Cov(v, s_i)`, the exponentially
tilted mean of jointly Gaussian `(s, v)`: docs/mathematics.md 6's first-order `m_c + C_c^T q /
sqrt(d)`, with the full key-value cross-covariance `Cov(v, s_i) = Cov(b, v)^T a_i`. Summed over
clusters with the tail weights w, the shift is `sum_i a_i^T (sum_c w_c g_ic Cov_c(b_i, v))`: one
`(nq, nc) @ (nc, D_i dv)` matrix product per lift, no `(nq, nc, .)` tensor; it runs in
bfloat16 for float32 contexts on hardware that multiplies bfloat16 natively (`shift_dtype`).

Limits where the estimate is exact: a cluster of one key or of identical keys (zero variance:
`log n_c + phi(s_bar)` and `m_c`), and, for the dot product, jointly Gaussian keys and values
(`log E exp(scale s) = scale s_bar + scale^2 var / 2`); the log-partition is exact when every
cluster is visited.

Which clusters a query visits: its most massive clusters by estimate (twice as many as the
budget holds at the average cluster size, plus 8), in descending order, each taken if its keys
still fit in the `budget` (a fraction of the context's keys), with the clusters flagged
`exact_read` (the outlier keys of `KeyClusters.build`) right after the most massive one: at
the smallest budgets the query's own cluster goes first (on `clustered` / sphere at 0.5 %,
putting the outliers before it raised the median error from 0.02 to 0.50).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from threadpoolctl import ThreadpoolController

from rewa.attention import DotProduct, Geometry, merge_attention
from rewa.attention.allocator import retain_freed_memory
from rewa.attention.sparse import softmax_attend

from .clusters import ClusterHeads, KeyClusters, query_features

HERMITE_NODES = 3
KEY_BLOCK = 128  # keys per block of the exact part
QUERY_GROUP = 32  # queries per (group, block) slice of the exact part
CALIBRATION_STEPS = 4  # Newton steps of `calibrated`: alpha within 1e-4 (MiniLM)
SHIFT_NEGLIGIBLE = 1e-3  # the weight share of the clusters the value shift leaves out
GATHER_SHARE = 3  # the shift gathers the clusters it keeps when they are under 1 / this share
PARALLEL_SHIFT_BYTES = 4 << 20  # cross-covariances read above which the shift uses every thread


def _hermite(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Gauss-Hermite nodes and log weights for the standard normal distribution."""
    nodes, weights = np.polynomial.hermite_e.hermegauss(HERMITE_NODES)
    log_weights = np.log(weights / weights.sum())
    return (
        torch.tensor(nodes, dtype=dtype, device=device),
        torch.tensor(log_weights, dtype=dtype, device=device),
    )


@dataclass
class ClusterEstimate:
    """A query block's estimates of every cluster (module docstring), `(nq, nc)` for one head's
    clusters or `(H, nq, C)` for `ClusterHeads`:

    - `log_mass`: the estimated `log sum_{j in c} exp(logit_j)`, `-inf` for empty clusters;
    - `floor`: the same at zero variance, `log n_c + phi(s_bar)` (for the dot product a lower
      bound, by Jensen's inequality); `calibrated` moves the estimate towards it;
    - `shift_terms`: per lift, the slope g (the shape of `log_mass`) and the query features
      `a_i` (`(..., nq, D_i)`); the cluster's softmax-weighted value is estimated as
      `value_mean_c + sum_i g_i Cov_c(b_i, v)^T a_i`.
    """

    log_mass: torch.Tensor
    floor: torch.Tensor
    shift_terms: list[tuple[torch.Tensor, torch.Tensor]]

    def head(self, head: int) -> ClusterEstimate:
        """One head's estimates of stacked ones."""
        terms = [(slope[head], a[head]) for slope, a in self.shift_terms]
        return ClusterEstimate(self.log_mass[head], self.floor[head], terms)

    def rows(self) -> ClusterEstimate:
        """Stacked estimates with the heads' queries as rows, `(H * nq, C)` (views)."""
        terms = [(slope.flatten(0, 1), a.flatten(0, 1)) for slope, a in self.shift_terms]
        return ClusterEstimate(self.log_mass.flatten(0, 1), self.floor.flatten(0, 1), terms)


def estimate_clusters(
    queries_w: torch.Tensor,
    clusters: KeyClusters | ClusterHeads,
    counts: torch.Tensor | None = None,
) -> ClusterEstimate:
    """The estimates of every cluster (`ClusterEstimate`) for query witnesses `(nq, d_w)` of one
    head's `KeyClusters`, or `(H, nq, d_w)` of `ClusterHeads` (head h's queries estimate head
    h's clusters). `counts` (`(nc,)`, or `(H, C)`) overrides the cluster sizes (e.g. with keys
    read elsewhere removed)."""
    if isinstance(clusters, KeyClusters):
        if counts is not None:
            counts = counts.unsqueeze(0)
        heads = ClusterHeads.stacked([clusters])
        return _estimate_heads(queries_w.unsqueeze(0), heads, counts).head(0)
    return _estimate_heads(queries_w, clusters, counts)


def _estimate_heads(
    queries_w: torch.Tensor, heads: ClusterHeads, counts: torch.Tensor | None
) -> ClusterEstimate:
    """`estimate_clusters` of stacked heads: batched matrix products over the head axis."""
    geometry = heads.geometry
    features = query_features(geometry.lift(queries_w, "query"))
    counts = heads.counts if counts is None else counts
    log_counts = torch.where(counts > 0, counts.clamp_min(1).log(), float("-inf")).unsqueeze(1)
    n_heads, n_queries = queries_w.shape[:2]
    n_clusters, rank = heads.n_clusters, heads.rank
    projections, moments = [], []
    for i, block in enumerate(features.slices):
        a = features.a[..., block]
        mean = torch.baddbmm(features.c[..., i : i + 1], a, heads.mean[..., block].transpose(1, 2))
        # F_c^T a for every cluster in one matrix product: (nq, D) @ (D, r * nc) per head,
        # rank-major (summing over the rank is then a reduction over a middle dimension of
        # length r, not over a last dimension of length r: 2-3x faster on the CPU at r = 4).
        factor = heads.factor_by_rank[:, block].reshape(n_heads, a.shape[-1], -1)
        projection = (a @ factor).view(n_heads, n_queries, rank, n_clusters)
        # One in-place pass per rank, not square() and sum over the whole projection: 2.5x
        # faster at (1024, 4, 257).
        variance = a.square() @ heads.residual[..., block].transpose(1, 2)
        for r in range(rank):
            variance.addcmul_(projection[:, :, r], projection[:, :, r])
        half_width = a.norm(dim=-1, keepdim=True) * heads.radius[:, None, :, i]
        projections.append(projection)
        moments.append((mean, variance, half_width))
    if isinstance(geometry, DotProduct):
        log_masses, tilts = _dot_product_estimate(geometry.scale, *moments[0])
        floors = [moments[0][0] * geometry.scale]
    else:
        log_masses, tilts = _hermite_estimate(geometry, queries_w, moments)
        floors = geometry.similarity_logits(queries_w, [mean for mean, _, _ in moments])
    # Where the variance is 0 the tilt is 0 too (both estimators), and so is the slope.
    slopes = [
        tilt / variance.clamp_min(torch.finfo(variance.dtype).tiny)
        for tilt, (_, variance, _) in zip(tilts, moments, strict=True)
    ]
    total = log_masses[0] + log_counts
    for log_mass in log_masses[1:]:
        total = total.add_(log_mass)
    for i in range(len(slopes)):
        for j in range(i + 1, len(slopes)):
            covariance = (projections[i] * projections[j]).sum(2)
            total = total + slopes[i] * slopes[j] * covariance
    floor = log_counts + sum(floors)
    blocks = [features.a[..., block] for block in features.slices]
    return ClusterEstimate(total, floor, list(zip(slopes, blocks, strict=True)))


def _dot_product_estimate(
    scale: float, mean: torch.Tensor, variance: torch.Tensor, half_width: torch.Tensor
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Closed-form `([log-mass without log n_c], [tilt Delta])` for `logit = scale * s`."""
    tilt = torch.minimum(scale * variance, half_width)
    return [torch.add(mean, tilt, alpha=0.5).mul_(scale)], [tilt]


def _hermite_estimate(
    geometry: Geometry,
    queries_w: torch.Tensor,
    moments: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per lift, `(log-mass without log n_c, tilt Delta)` by Gauss-Hermite quadrature of
    `exp(phi(s))` with `s ~ N(mean, variance)` clamped to `mean +- half_width`."""
    nodes, log_weights = _hermite(queries_w.dtype, queries_w.device)
    similarities = []
    for mean, variance, half_width in moments:
        offsets = variance.sqrt().unsqueeze(-1) * nodes
        offsets = torch.maximum(
            torch.minimum(offsets, half_width[..., None]), -half_width[..., None]
        )
        similarities.append((mean.unsqueeze(-1) + offsets, offsets))
    shape = moments[0][0].shape  # (..., nq, nc)
    terms = geometry.similarity_logits(
        queries_w, [s.reshape(*shape[:-1], -1) for s, _ in similarities]
    )
    log_masses, tilts = [], []
    for term, (_, offsets) in zip(terms, similarities, strict=True):
        weighted = term.reshape(*shape, -1) + log_weights
        log_mass = torch.logsumexp(weighted, dim=-1)
        # The softmax over the nodes, from the log-mass (torch.softmax is slow on a last
        # dimension of 3).
        tilt = (torch.exp(weighted - log_mass.unsqueeze(-1)) * offsets).sum(-1)
        log_masses.append(log_mass)
        tilts.append(tilt)
    return log_masses, tilts


def select_clusters(
    log_mass: torch.Tensor,
    counts: torch.Tensor,
    budget_keys: float,
    exact_read: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The clusters each query visits, as `(query, cluster)` pairs: its most massive clusters
    by estimate, in descending order, each taken if its keys still fit in `budget_keys`. The
    clusters flagged `exact_read` come right after each query's most massive cluster, whatever
    their estimate: read by every query whose budget holds them besides that cluster.

    `log_mass` is `(nq, nc)`; `counts` and `exact_read` are `(nc,)`, the same for every query,
    or `(nq, nc)`, a row per query (the stacked heads of `tail_attention_heads`)."""
    if budget_keys <= 0:
        empty = torch.zeros(0, dtype=torch.long, device=log_mass.device)
        return empty, empty
    n_rows = log_mass.shape[0]
    forced = None
    ordinary_counts = counts
    if exact_read is not None and exact_read.any():
        log_mass = log_mass.masked_fill(exact_read, float("-inf"))
        ordinary_counts = counts.masked_fill(exact_read, 0)
        if exact_read.dim() == 1:
            forced = exact_read.nonzero().squeeze(-1).expand(n_rows, -1)
            forced_sizes = counts[forced]
        else:
            # Each row's flagged clusters, in ascending order; rows with fewer are padded with
            # unflagged clusters of size 0 (never taken).
            n_forced = int(exact_read.sum(-1).max())
            forced = (~exact_read).to(torch.uint8).argsort(dim=-1, stable=True)[:, :n_forced]
            forced_sizes = counts.gather(1, forced) * exact_read.gather(1, forced)
    # The greedy walk looks at the most massive clusters only: twice as many as the budget
    # holds at the average cluster size, plus a few.
    average = float(ordinary_counts.sum()) / max(int((ordinary_counts > 0).sum()), 1)
    width = min(log_mass.shape[-1], 2 * int(budget_keys / max(average, 1.0)) + 8)
    best = _most_massive(log_mass, width)
    sizes = ordinary_counts[best] if ordinary_counts.dim() == 1 else ordinary_counts.gather(1, best)
    if forced is not None:
        best = torch.cat([best[:, :1], forced, best[:, 1:]], dim=1)
        sizes = torch.cat([sizes[:, :1], forced_sizes, sizes[:, 1:]], dim=1)
    if sizes.device.type == "cpu":
        # The walk is `width` steps of a few small operations each: numpy's cost 1-2 us less
        # per operation than PyTorch's.
        sizes = sizes.detach().numpy()
    chosen = sizes > 0  # overwritten column by column
    remaining = sizes[:, 0] * 0 + budget_keys
    for column in range(sizes.shape[1]):
        size = sizes[:, column]
        chosen[:, column] = (size <= remaining) & (size > 0)
        remaining = remaining - size * chosen[:, column]
    queries, slots = torch.as_tensor(chosen, device=best.device).nonzero(as_tuple=True)
    return queries, best[queries, slots]


def _most_massive(log_mass: torch.Tensor, width: int) -> torch.Tensor:
    """The columns of the `width` largest entries of each row `(nq, width)`, largest first.

    On the CPU, `width` rounds of numpy's `argmax` (ties: the lower column first), each
    masking the entry it found with `-inf`: `topk` over 1024 x 257 took 1.2-1.4 ms on this
    machine, a round 40-50 us. A row whose finite entries run out would get a masked column
    twice; then `topk` answers instead."""
    if log_mass.device.type != "cpu" or log_mass.dtype not in (torch.float32, torch.float64):
        return log_mass.topk(width, dim=-1).indices
    masses = log_mass.detach().numpy()
    remaining = masses.copy()
    n_rows, n_columns = remaining.shape
    row_starts = np.arange(n_rows) * n_columns
    flat = remaining.reshape(-1)
    best = np.empty((width, n_rows), dtype=np.int64)
    for column in range(width):
        best[column] = remaining.argmax(axis=1)
        flat[row_starts + best[column]] = -np.inf
    if np.isneginf(masses.reshape(-1)[row_starts + best[-1]]).any():
        return log_mass.topk(width, dim=-1).indices
    return torch.from_numpy(best.T)


def calibrated(
    estimate: ClusterEstimate,
    pair_query: torch.Tensor,
    pair_cluster: torch.Tensor,
    visited_lse: torch.Tensor,
    steps: int = CALIBRATION_STEPS,
) -> torch.Tensor:
    """The clusters' log-masses `(nq, nc)` with each query's variance term scaled down so that
    its estimate of the clusters it read (`(query, cluster)` pairs; not the outlier clusters,
    whose keys are the heavy-tailed ones the estimate would be worst at) matches their exact
    log-partition `visited_lse`
    (docs/mathematics.md 6, "Calibration against the keys read").

    Per query, `floor + (1 - alpha) (log_mass - floor)` with the one `alpha` in [0, 1] at which
    the log-sum-exp of the visited pairs' estimates equals `visited_lse` (Newton's method; the
    sum is convex and decreasing in `alpha`); `alpha = 0`, the estimate unchanged, where the
    estimate of the read clusters is already at or below the exact value, and where a query
    read nothing.

    Why: the second-order estimate assumes Gaussian similarities, whose upper tail is heavier
    than a cluster's (its keys are bounded). Where the logits are steep (sharp heads), it
    overestimates every cluster, read or not, by about the same fraction of its variance term
    (measured in docs/benchmark-notes.md, "Tail attention on sharp heads"). The keys a query
    read exactly are a free measurement of its own estimator's bias."""
    log_mass, floor = estimate.log_mass, estimate.floor
    if pair_query.numel() == 0:
        return log_mass
    n_queries = log_mass.shape[0]
    pair_floor = floor[pair_query, pair_cluster]
    pair_excess = log_mass[pair_query, pair_cluster] - pair_floor
    target = visited_lse.to(log_mass.dtype)
    # f(alpha) = logsumexp(floor + (1 - alpha) excess) - target is convex and decreasing in
    # alpha, so Newton's method started at 0, left of the root where f(0) > 0, climbs to the
    # root without overshooting it; queries with f(0) <= 0 keep alpha = 0.
    alpha = log_mass.new_zeros(n_queries)
    for _ in range(steps):
        value, slope = _pairs_logsumexp(
            pair_query, pair_floor + (1 - alpha[pair_query]) * pair_excess, n_queries, pair_excess
        )
        step = (value - target) / slope.clamp_min(torch.finfo(slope.dtype).tiny)
        alpha = torch.where(value > target, alpha + step, alpha).clamp(0, 1)
    # Where nothing was read the target is -inf (no pairs, no step).
    alpha = torch.where(torch.isfinite(target), alpha, torch.zeros_like(alpha))
    # Empty clusters (the padding of stacked heads) stay at -inf: their lerp of two -inf is NaN.
    inf = float("inf")
    return torch.lerp(log_mass, floor, alpha.unsqueeze(-1)).nan_to_num_(-inf, inf, -inf)


def _pairs_logsumexp(
    rows: torch.Tensor, values: torch.Tensor, n_rows: int, excess: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row `(n_rows,)`, `log sum exp(values)` over the entries `values` belonging to
    `rows` (`-inf` for rows without one), and the softmax-weighted mean of `excess` over the
    same entries (0 for rows without one): `-d/d alpha` of the first in `calibrated`."""
    peak = values.new_full((n_rows,), float("-inf")).scatter_reduce(0, rows, values, reduce="amax")
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    weights = (values - peak[rows]).exp()
    total = values.new_zeros(n_rows).index_add_(0, rows, weights)
    weighted = values.new_zeros(n_rows).index_add_(0, rows, weights * excess)
    return peak + total.log(), weighted / torch.where(total > 0, total, 1)


def tail_attention(
    q: torch.Tensor,
    clusters: KeyClusters,
    *,
    budget: float = 0.02,
    tail: bool = True,
    always: torch.Tensor | None = None,
    query_block: int = 1024,
    report: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention `(out (nq, dv), lse (nq,))` of ambient queries `(nq, d)` over a clustered
    context: exact over the clusters each query visits (`select_clusters`, within `budget`, a
    fraction of all keys) and over the key ids `always` (window and sinks,
    shared by every query); with `tail`, every other cluster's estimate (module docstring) is
    merged in, and `lse` estimates the full log-partition. `tail=False` is exact-only sparse
    attention over the same keys.

    `report`, if a dict, receives `keys_read` `(nq,)`: keys read exactly per query.
    Gradients reach the queries (the clustered keys and statistics are constants).
    `tail_attention_heads` does the same for several heads at once.
    """
    if q.dim() != 2 or q.shape[-1] != clusters.geometry.dim:
        raise ValueError(f"expected queries (nq, {clusters.geometry.dim}), got {tuple(q.shape)}")
    heads = ClusterHeads.stacked([clusters])
    out, lse = tail_attention_heads(
        q.unsqueeze(0),
        heads,
        budget=budget,
        tail=tail,
        always=always,
        query_block=query_block,
        report=report,
    )
    if report is not None:
        report["keys_read"] = report["keys_read"][0]
    return out[0], lse[0]


def tail_attention_heads(
    q: torch.Tensor,
    heads: ClusterHeads,
    *,
    budget: float = 0.02,
    tail: bool = True,
    always: torch.Tensor | None = None,
    query_block: int = 1024,
    report: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`tail_attention` of the queries `(H, nq, d)` of H heads over those heads' clusters
    (`ClusterHeads`; head h's queries read head h's keys): `(out (H, nq, dv), lse (H, nq))`.

    The estimate, the selection, the calibration and the tail are computed for every head in
    one pass (batched matrix products over the head axis, one selection over the heads'
    queries), the exact part per head; a decode step (a few queries per head) costs a fixed
    number of operations instead of that number per head. `always` (key ids) holds for every
    head; `report["keys_read"]` is `(H, nq)`."""
    geometry = heads.geometry
    if q.dim() != 3 or q.shape[0] != heads.n_heads or q.shape[-1] != geometry.dim:
        raise ValueError(
            f"expected queries ({heads.n_heads}, nq, {geometry.dim}), got {tuple(q.shape)}"
        )
    if not 0 <= budget <= 1:
        raise ValueError(f"expected a budget between 0 and 1 (a fraction of keys), got {budget}")
    if q.device.type == "cpu":
        # Megabyte-sized (queries, clusters) temporaries, allocated and freed on every call.
        retain_freed_memory()
    qw = geometry.witness(q.to(heads.heads[0].keys_w.dtype))
    n_heads, n_keys = heads.n_heads, heads.heads[0].n_keys
    is_always = [None] * n_heads  # or per head a flag per sorted position: read outside clusters
    counts = heads.counts
    if always is not None and always.numel() > 0:
        always = always.unique()
        if always.min() < 0 or always.max() >= n_keys:
            raise ValueError(f"expected always ids in [0, {n_keys}), got {always.tolist()[:8]}")
        counts, is_always, always_keys, always_values = _always_read(heads, always)
    n_always = 0 if always is None else len(always)
    budget_keys = budget * n_keys - n_always
    exact_read = heads.exact_read
    outs, lses, reads = [], [], []
    for start in range(0, qw.shape[1], query_block):
        block = qw[:, start : start + query_block]
        n_queries = block.shape[1]
        estimate = estimate_clusters(block, heads, counts)
        rows = estimate.rows()
        row_counts, row_exact = (_per_row(t, n_queries) for t in (counts, exact_read))
        pair_query, pair_cluster = select_clusters(
            rows.log_mass, row_counts, budget_keys, row_exact
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
    if report is not None:
        report["keys_read"] = torch.cat(reads, dim=1)
    return geometry.output_map(torch.cat(outs, dim=1)), torch.cat(lses, dim=1)


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
        n_keys = clusters.n_keys
        position = torch.empty_like(clusters.order)
        position[clusters.order] = torch.arange(n_keys, device=position.device)
        positions = position[always]
        is_always = torch.zeros(n_keys, dtype=torch.bool, device=positions.device)
        is_always[positions] = True
        flags.append(is_always)
        # Those keys are read exactly, so the estimates of their clusters leave them out.
        cluster = torch.searchsorted(clusters.offsets, positions, right=True) - 1
        removed = torch.bincount(cluster, minlength=clusters.n_clusters).to(counts.dtype)
        counts[head, : clusters.n_clusters] -= removed
        keys.append(clusters.keys_w[positions])
        values.append(clusters.values[positions])
    return counts, flags, torch.stack(keys), torch.stack(values)


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
    dv), lse (H * nq,))`. On the CPU without autograd one loop covers the visited clusters of
    every head (`_shared_reference_attention`); a head with a query whose sum over- or
    underflowed, and every head elsewhere, goes through `_visited_attention` on its own."""
    n_heads, n_queries = qw.shape[:2]
    if n_heads == 1:
        return _visited_attention(
            qw[0], heads.heads[0], pair_query, pair_cluster, is_always[0], reference
        )
    shared = qw.device.type == "cpu" and not torch.is_grad_enabled() and pair_query.numel() > 0
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

    On the CPU one matrix product per visited cluster reads the cluster's keys in place; without
    autograd and with a `reference` per query (`_largest_logit_estimate`), the exponentials of
    all of a query's clusters share it (`_shared_reference_attention`), and the queries whose
    sums over- or underflow it are done again by the general path: one partial `(out, lse)` per
    pair (`_per_cluster_partials`), merged per query (`_merge_partials`). On a GPU, where each
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
    if reference is None or torch.is_grad_enabled():
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
    """`(out, lse, failed)` per query, without autograd: every weight of query q is
    `exp(l - reference_q)`, so the sums of all its clusters add up directly, with no softmax
    per cluster and no merge. Per visited cluster: one product for the logits minus the
    reference (the reference enters as the product's bias), one in-place `exp`, one product
    with the values, one row sum; then one sum per query over its clusters.

    Exact as long as the reference is within the float range of the query's largest logit;
    `failed` flags the queries whose sum overflowed or came out too small to keep the
    precision of its largest term (below `tiny / eps`; queries that visit nothing have 0 and
    are flagged too). Several heads' queries `qw` `(H * nq, d_w)` (rows `head * nq + query`)
    go through one loop over all their visited clusters. How far the estimate's reference lies
    from the largest visited logit, as measured: docs/library.md, "Cluster-tail attention"."""
    geometry, n_rows = heads[0].geometry, qw.shape[0]
    rows, runs = _runs_by_cluster(heads, n_rows // len(heads), pair_query, pair_cluster)
    has_always = _clusters_with_always(heads, is_always)
    queries, score = _cluster_scorer(geometry, qw, rows)
    bias = reference.neg()[rows].unsqueeze(-1)
    value_dim = heads[0].values.shape[-1]
    weighted_values = heads[0].values.new_empty(len(rows), value_dim)
    weight_sums = heads[0].values.new_empty(len(rows))
    if isinstance(geometry, DotProduct):
        _dot_product_sums(
            queries, heads, runs, bias, is_always, has_always, weighted_values, weight_sums
        )
    else:
        for head, cluster, part, keys in runs:
            clusters = heads[head]
            weights = score(queries[part], clusters.keys_w[keys], bias[part])
            if (head, cluster) in has_always:
                weights = weights.masked_fill_(is_always[head][keys], float("-inf"))
            weights = weights.exp_()
            torch.mm(weights, clusters.values[keys], out=weighted_values[part])
            torch.sum(weights, dim=-1, out=weight_sums[part])
    out = weighted_values.new_zeros(n_rows, value_dim)
    out = _rows_added(out, rows, weighted_values)
    weight = weight_sums.new_zeros(n_rows).index_add_(0, rows, weight_sums)
    finfo = torch.finfo(weight.dtype)
    # A sum of 0 is an underflow too, unless the query visited no key outside `is_always`
    # (the general path then finds that out, at the cost of redoing the query).
    failed = ~((weight >= finfo.tiny / finfo.eps) & torch.isfinite(weight))
    out = out / torch.where(weight > 0, weight, 1).unsqueeze(-1)
    return out, reference + weight.log(), failed


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
    with np.errstate(over="ignore", invalid="ignore"):
        for head, cluster, part, keys in runs:
            weights = np.matmul(queries[part], keys_w[head][keys].T)
            weights += bias[part]
            if (head, cluster) in has_always:
                weights[:, flagged[head][keys]] = -np.inf
            np.exp(weights, out=weights)
            np.matmul(weights, values[head][keys], out=sums[part])
            np.sum(weights, axis=1, out=totals[part])


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
    queries, score = _cluster_scorer(clusters.geometry, qw, rows)
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


def _cluster_scorer(
    geometry: Geometry, qw: torch.Tensor, rows: torch.Tensor
) -> tuple[torch.Tensor, Callable[..., torch.Tensor]]:
    """`(queries, score)`: the queries `qw[rows]`, gathered once, in the form `score(queries,
    keys_w, bias=None)` takes: the logits of those queries against a slice of keys, plus `bias`
    `(len(queries), 1)` if given. For the dot product the scale is folded into the queries and
    the bias into the product (one pass over each cluster's logits fewer each)."""
    if isinstance(geometry, DotProduct):

        def dot_product_score(queries, keys, bias=None):
            if bias is None:
                return queries @ keys.T
            return torch.addmm(bias, queries, keys.T)

        return (qw * geometry.scale).index_select(0, rows), dot_product_score

    def geometry_score(queries, keys, bias=None):
        logits = geometry.score(queries, keys)
        return logits if bias is None else logits.add_(bias)

    return qw.index_select(0, rows), geometry_score


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


def _tail_estimate(
    heads: ClusterHeads,
    log_mass: torch.Tensor,
    shift_terms: list[tuple[torch.Tensor, torch.Tensor]],
    read_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(out (H * nq, dv), lse (H * nq,))` of the clusters with finite `log_mass` `(H, nq, C)`
    from their estimates (`estimate_clusters`). The value shift's matrix product, the largest of
    the estimate (`(nq, nc) @ (nc, D dv)` per head), runs in `shift_dtype`, over the clusters
    whose weight is at least `SHIFT_NEGLIGIBLE / nc` of some query's whole mass (these
    clusters' plus `read_lse` `(H, nq)`, the log-mass of the keys it read exactly, if given):
    the ones left out hold at most that fraction of any query's mass between them. Sharp
    queries (a decode step) leave out most clusters, and the product reads each cluster's
    `D x dv` cross-covariance: per head, from its own `KeyClusters` (not stacked: the
    cross-covariances are most of the statistics' memory)."""
    peak = log_mass.amax(-1, keepdim=True)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    weights = (log_mass - peak).exp_()  # unnormalised; rows of only -inf give 0
    total = weights.sum(-1)
    out = weights @ heads.value_mean
    dtype = shift_dtype(weights.dtype, weights.device)
    whole = total if read_lse is None else total + (read_lse - peak.squeeze(-1)).exp()
    head_clusters = weights.new_tensor(heads.head_clusters).view(-1, 1, 1)
    floor = whole.unsqueeze(-1) * (SHIFT_NEGLIGIBLE / head_clusters)
    kept = (weights >= floor).any(1)  # (H, C)
    products, features = [], []  # per head and lift: (weights, cross-covariances), a_i
    for head, clusters in enumerate(heads.heads):
        n = clusters.n_clusters
        terms = [(slope[head, :, :n], a[head]) for slope, a in shift_terms]
        for product, a in _value_shift_products(
            clusters, weights[head, :, :n], kept[head, :n], terms
        ):
            products.append(tuple(t.to(dtype) for t in product))
            features.append((head, a))
    for summed, (head, a) in zip(_matrix_products(products), features, strict=True):
        # sum_c w_c g_c Cov_c(b, v) per query, contracted with the query's features.
        summed = summed.view(len(a), a.shape[-1], -1).to(out.dtype)
        out[head].add_((a.unsqueeze(1) @ summed).squeeze(1))
    out = out / torch.where(total > 0, total, 1).unsqueeze(-1)
    return out.flatten(0, 1), (peak.squeeze(-1) + total.log()).flatten(0, 1)


def _value_shift_products(
    clusters: KeyClusters,
    weights: torch.Tensor,
    kept: torch.Tensor,
    shift_terms: list[tuple[torch.Tensor, torch.Tensor]],
) -> list[tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """One head's value shift `sum_c w_c sum_i g_ic Cov_c(b_i, v)^T a_i` over its clusters
    `kept` `(nc,)` (weights `(nq, nc)`; `shift_terms` per lift the slopes `(nq, nc)` and the
    features `a_i` `(nq, D_i)`), as per lift the matrix product to compute, `(w g (nq, k),
    Cov (k, D_i dv))` over k clusters, and `a_i`."""
    columns = kept.nonzero().squeeze(-1)
    if len(columns) == 0:
        return []
    value_cross, slopes = clusters.value_cross, [slope for slope, _ in shift_terms]
    if len(columns) * GATHER_SHARE < clusters.n_clusters:
        # Few clusters kept: their cross-covariances gathered (a copy: read, written and read
        # again) cost less than reading every cluster's in place.
        weights, value_cross = weights[:, columns], value_cross[columns]
        slopes = [slope[:, columns] for slope in slopes]
    elif len(columns) < clusters.n_clusters:
        # Most kept: every cluster's in place, the ones left out at weight 0.
        weights = weights * kept
    found, start = [], 0
    for slope, (_, a) in zip(slopes, shift_terms, strict=True):
        cross = value_cross[:, start : start + a.shape[-1]].reshape(len(value_cross), -1)
        found.append(((weights * slope, cross), a))
        start += a.shape[-1]
    return found


def _matrix_products(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """`a @ b` for each pair. On the CPU without autograd by numpy's BLAS, on one thread per
    product and the products spread over PyTorch's number of threads: PyTorch's product of a
    few rows (a decode step's queries) by a wide matrix ran 2-3x slower than numpy's, and
    numpy's BLAS on two threads leaves them spinning after the call, which slowed the PyTorch
    operations that follow by milliseconds on a two-core machine (docs/benchmark-notes.md,
    "The value shift of a decode step")."""
    if not pairs:
        return []
    if any(
        t.device.type != "cpu" or t.dtype not in (torch.float32, torch.float64) or t.requires_grad
        for pair in pairs
        for t in pair
    ):
        return [a @ b for a, b in pairs]
    arrays = [(a.numpy(), b.numpy()) for a, b in pairs]
    with _one_blas_thread():
        if sum(b.nbytes for _, b in arrays) < PARALLEL_SHIFT_BYTES or len(arrays) == 1:
            found = [np.matmul(a, b) for a, b in arrays]
        else:
            found = list(_cpu_workers().map(lambda pair: np.matmul(*pair), arrays))
    return [torch.from_numpy(product) for product in found]


@functools.cache
def _cpu_workers() -> ThreadPoolExecutor:
    """Threads for numpy products that release the GIL, as many as PyTorch's CPU threads."""
    return ThreadPoolExecutor(max(1, torch.get_num_threads()), thread_name_prefix="rewa-shift")


@functools.cache
def _blas_threads() -> ThreadpoolController:
    return ThreadpoolController()


def _one_blas_thread():
    """A context in which numpy's BLAS runs on one thread (PyTorch's own threads unchanged)."""
    return _blas_threads().limit(limits=1, user_api="blas")


def shift_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype of the value shift's matrix product for a float `dtype` context on `device`:
    bfloat16 for float32 where the hardware multiplies bfloat16 matrices natively (a CUDA GPU
    that supports it, a CPU with AMX tiles or AVX-512 BF16 dot products), else `dtype` itself
    (float64 stays exact).

    The shift is a first-order correction of the estimated clusters' value means, so
    bfloat16's 8-bit mantissa costs it a relative 2^-8 or so of a term that is itself a
    fraction of the output. A (1024 x 257) @ (257 x 1024) product took 2.7-5.2 ms in float32
    and 0.7-2.0 ms in bfloat16 on an AMX CPU (the machine's speed drifting), 3.0-3.7 ms and
    1.3-1.4 ms on an AVX-512 BF16 CPU without AMX."""
    if dtype != torch.float32:
        return dtype
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else dtype
    return torch.bfloat16 if device.type == "cpu" and cpu_multiplies_bfloat16() else dtype


@functools.cache
def cpu_multiplies_bfloat16() -> bool:
    """Whether this CPU has instructions that multiply bfloat16 natively (AMX tiles or AVX-512
    BF16): oneDNN then multiplies bfloat16 matrices faster than float32 ones (`shift_dtype`
    has the times measured)."""
    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in checks)
