"""The estimate of every cluster a query does not read (docs/mathematics.md 6, "Tail
estimate").

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
  dominates (measured in docs/library.md, "Cluster-tail attention").
  A product geometry does this per lift and adds the cross-lift cumulant
  `sum_{i<j} g_i g_j Cov(s_i, s_j)`, `g_i = Delta_i / var_i`.

Limits where the estimate is exact: a cluster of one key or of identical keys (zero variance:
`log n_c + phi(s_bar)` and `m_c`), and, for the dot product, jointly Gaussian keys and values
(`log E exp(scale s) = scale s_bar + scale^2 var / 2`); the log-partition is exact when every
cluster is visited."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rewa.attention import DotProduct, Geometry
from rewa.attention.geometry import records_grad

from ..clusters import ClusterHeads, KeyClusters, QueryFeatures, query_features
from .kernel import dot_product_estimate

HERMITE_NODES = 3


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
    fused = _fused_applies(queries_w, geometry, features)
    for i, block in enumerate(features.slices):
        a = features.a[..., block]
        mean = torch.baddbmm(features.c[..., i : i + 1], a, heads.mean[..., block].transpose(1, 2))
        # F_c^T a for every cluster in one matrix product: (nq, D) @ (D, r * nc) per head,
        # rank-major (summing over the rank is then a reduction over a middle dimension of
        # length r, not over a last dimension of length r, faster on the CPU: benchmark-notes).
        factor = heads.factor_by_rank[:, block].reshape(n_heads, a.shape[-1], -1)
        projection = (a @ factor).view(n_heads, n_queries, rank, n_clusters)
        variance = a.square() @ heads.residual[..., block].transpose(1, 2)
        if fused:
            log_mass, floor, slope = dot_product_estimate(
                mean, variance, projection, a.norm(dim=-1), heads.radius[..., i],
                log_counts.squeeze(1), float(geometry.scale),
            )  # fmt: skip
            return ClusterEstimate(log_mass, floor, [(slope, a)])  # its one lift
        # One in-place pass per rank, not square() and sum over the whole projection (faster;
        # docs/benchmark-notes.md, "Measurements behind code choices").
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


def _fused_applies(queries_w: torch.Tensor, geometry: Geometry, features: QueryFeatures) -> bool:
    """Whether the dot product's estimate runs its element-wise part compiled
    (`kernel.dot_product_estimate`): one lift, on the CPU, float32 or float64, no autograd."""
    return (
        isinstance(geometry, DotProduct)
        and len(features.slices) == 1
        and queries_w.device.type == "cpu"
        and queries_w.dtype in (torch.float32, torch.float64)
        and not records_grad(geometry, queries_w)
    )


def log_mean_weight(
    geometry: Geometry,
    queries_w: torch.Tensor,
    mean: torch.Tensor,
    variance: torch.Tensor,
    half_width: torch.Tensor,
) -> torch.Tensor:
    """`log (1/n sum_j exp(logit_j))` over a set of n keys, for a single-lift geometry, from
    each query's similarity moments to the set, `(nq, m)` each: mean, variance and the half
    width its radius allows (module docstring: closed form for the dot product, Gauss-Hermite
    otherwise). Adding `log n` gives the set's estimated log-mass."""
    if isinstance(geometry, DotProduct):
        return _dot_product_estimate(geometry.scale, mean, variance, half_width)[0][0]
    return _hermite_estimate(geometry, queries_w, [(mean, variance, half_width)])[0][0]


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
