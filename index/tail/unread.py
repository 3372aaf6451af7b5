"""The estimate of the clusters a query did not read, merged with what it read: their
estimated log-masses (`estimate.estimate_clusters`, calibrated) summed, and their values'
softmax-weighted means shifted by the key-value cross-covariances.

Values: with `g = Delta / var` (the effective slope; `= scale` for an untruncated dot product),
the cluster's softmax-weighted value is `m_c + sum_i g_i Cov(v, s_i)`, the exponentially
tilted mean of jointly Gaussian `(s, v)`: docs/mathematics.md 6's first-order `m_c + C_c^T q /
sqrt(d)`, with the full key-value cross-covariance `Cov(v, s_i) = Cov(b, v)^T a_i`. Summed over
clusters with the tail weights w, the shift is `sum_i a_i^T (sum_c w_c g_ic Cov_c(b_i, v))`: one
`(nq, nc) @ (nc, D_i dv)` matrix product per lift, no `(nq, nc, .)` tensor; it runs in
bfloat16 for float32 contexts on a CUDA GPU that multiplies it natively (`shift_dtype`)."""

from __future__ import annotations

import numpy as np
import torch

from ..clusters import ClusterHeads, KeyClusters
from .kernel import value_shift_sums
from .threads import cpu_workers, one_blas_thread

SHIFT_NEGLIGIBLE = 1e-3  # the weight share of the clusters the value shift leaves out
GATHER_SHARE = 3  # the shift gathers the clusters it keeps when they are under 1 / this share
PARALLEL_SHIFT_BYTES = 4 << 20  # cross-covariances read above which the shift uses every thread
NUMPY_SHIFT_ROWS = 16  # the most query rows of a shift product that numpy computes
# The most queries per head whose value shift runs compiled (`kernel.value_shift_sums`): a
# decode step's; with more, the products are faster
# (docs/benchmark-notes.md, "The value shift compiled").
COMPILED_SHIFT_ROWS = 8


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
    cross-covariances are most of the statistics' memory). For a decode step's few queries a
    compiled loop reads each kept cluster's cross-covariance once in place instead
    (`_compiled_shift_applies`)."""
    peak, weights, total, kept = unread_weights(log_mass, read_lse, shift_shares(heads))
    out = weights @ heads.value_mean
    dtype = shift_dtype(weights.dtype, weights.device)
    if _compiled_shift_applies(weights, dtype, shift_terms):
        value_shift_sums(heads.heads, weights, kept, shift_terms, out)
    else:
        _add_value_shift(heads, weights, kept, shift_terms, dtype, out)
    out = out / torch.where(total > 0, total, 1).unsqueeze(-1)
    return out.flatten(0, 1), (peak.squeeze(-1) + total.log()).flatten(0, 1)


def unread_weights(
    log_mass: torch.Tensor, read_lse: torch.Tensor | None, shares: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The unread clusters' weights from their `log_mass` `(H, nq, C)`: `(peak (H, nq, 1),
    weights (H, nq, C) relative to the peak (rows of only -inf give 0), total (H, nq), kept
    (H, C))`, `kept` the clusters the value shift reads, those whose weight is at least
    `shares` `(H, 1, 1)` (`shift_shares`) of some query's whole mass (theirs plus `read_lse`
    `(H, nq)`, the log-mass of the keys it read exactly, if given)."""
    peak = log_mass.amax(-1, keepdim=True)
    peak = torch.where(torch.isfinite(peak), peak, 0)
    weights = (log_mass - peak).exp_()
    total = weights.sum(-1)
    whole = total if read_lse is None else total + (read_lse - peak.squeeze(-1)).exp()
    kept = (weights >= whole.unsqueeze(-1) * shares).any(1)
    return peak, weights, total, kept


def shift_shares(heads: ClusterHeads) -> torch.Tensor:
    """Per head `(H, 1, 1)`, `SHIFT_NEGLIGIBLE / nc`: the share of a query's whole mass below
    which the value shift leaves a cluster of that head out."""
    counts = heads.counts
    clusters = torch.tensor(heads.head_clusters, dtype=counts.dtype, device=counts.device)
    return (SHIFT_NEGLIGIBLE / clusters).view(-1, 1, 1)


def _add_value_shift(
    heads: ClusterHeads,
    weights: torch.Tensor,
    kept: torch.Tensor,
    shift_terms: list[tuple[torch.Tensor, torch.Tensor]],
    dtype: torch.dtype,
    out: torch.Tensor,
) -> None:
    """Adds every head's value shift into `out` `(H, nq, dv)` by matrix products in `dtype`,
    per head and lift (`_value_shift_products`, `_matrix_products`); the arguments are those
    of `kernel.value_shift_sums`."""
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


def _compiled_shift_applies(
    weights: torch.Tensor, dtype: torch.dtype, shift_terms: list[tuple[torch.Tensor, torch.Tensor]]
) -> bool:
    """Whether the value shift runs compiled (`kernel.value_shift_sums`): on the CPU, in the
    context's float32 or float64 (`shift_dtype` keeps it), without autograd, for at most
    `COMPILED_SHIFT_ROWS` queries per head (a decode step's)."""
    tensors = [weights, *(t for term in shift_terms for t in term)]
    return (
        weights.device.type == "cpu"
        and weights.dtype in (torch.float32, torch.float64)
        and dtype == weights.dtype
        and weights.shape[1] <= COMPILED_SHIFT_ROWS
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
    )


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
    """`a @ b` for each pair. Products of at most `NUMPY_SHIFT_ROWS` rows (a decode step's
    queries) on the CPU without autograd go to numpy's BLAS, on one thread per product, the
    products spread over PyTorch's number of threads when they read more than
    `PARALLEL_SHIFT_BYTES`: PyTorch's product of a few rows by a wide matrix ran slower than
    numpy's, and numpy's BLAS on two threads leaves them spinning after the call, which
    slowed the PyTorch operations that follow by milliseconds on a two-core machine. Products
    of more rows are compute-bound, and PyTorch's threads do them faster (docs/
    benchmark-notes.md, "The value shift of a decode step")."""
    if not pairs:
        return []
    if any(
        t.device.type != "cpu" or t.dtype not in (torch.float32, torch.float64) or t.requires_grad
        for pair in pairs
        for t in pair
    ) or any(a.shape[0] > NUMPY_SHIFT_ROWS for a, _ in pairs):
        return [a @ b for a, b in pairs]
    arrays = [(a.numpy(), b.numpy()) for a, b in pairs]
    with one_blas_thread():
        if sum(b.nbytes for _, b in arrays) < PARALLEL_SHIFT_BYTES or len(arrays) == 1:
            found = [np.matmul(a, b) for a, b in arrays]
        else:
            found = list(cpu_workers().map(lambda pair: np.matmul(*pair), arrays))
    return [torch.from_numpy(product) for product in found]


def shift_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype of the value shift's matrix product for a float `dtype` context on `device`:
    bfloat16 for float32 on a CUDA GPU that multiplies it natively, else `dtype` itself
    (float64 stays exact).

    The shift is a first-order correction of the estimated clusters' value means, so
    bfloat16's 8-bit mantissa costs it a relative 2^-8 or so of a term that is itself a
    fraction of the output. On the CPU the shift stays in the context's dtype even where the
    CPU multiplies bfloat16 (AMX, AVX-512 BF16): a decode step's compiled shift computes it
    in that dtype, and a query's answer must not depend on whether it came alone or in a
    batch (docs/benchmark-notes.md, "The value shift in the context's dtype on the CPU")."""
    if dtype == torch.float32 and device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return dtype
