"""The estimate of each query calibrated against the clusters it read exactly (docs/
mathematics.md 6, "Calibration against the keys read")."""

from __future__ import annotations

import torch

from .estimate import ClusterEstimate

CALIBRATION_STEPS = 4  # Newton steps of `calibrated`: alpha within 1e-4 (MiniLM)


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
    if not alpha.requires_grad:
        return torch.lerp(log_mass, floor, alpha.unsqueeze(-1)).nan_to_num_(-inf, inf, -inf)
    # Under autograd the lerp's gradient to alpha has a NaN at every such entry (their
    # difference, -inf - -inf): those entries are kept out of it.
    finite = torch.isfinite(log_mass) & torch.isfinite(floor)
    zero = torch.zeros_like(log_mass)
    blended = torch.lerp(
        torch.where(finite, log_mass, zero), torch.where(finite, floor, zero), alpha.unsqueeze(-1)
    )
    return torch.where(finite, blended, log_mass.detach().nan_to_num(-inf, inf, -inf))


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
