"""Quality of sparse attention against exact dense attention (docs/mathematics.md 6), as library
calls.

Every measure is per query; `summary` gives the median and p99. Nothing here builds an N x N
matrix: exact top-K and the dense log-partition are computed in tiles.
"""

from __future__ import annotations

import torch

from rewa.attention import Geometry


def _logit_chunks(q: torch.Tensor, k: torch.Tensor, geometry: Geometry, chunk: int):
    """Exact dense logits of `chunk` queries at a time against all keys (2-D inputs)."""
    with torch.no_grad():
        kw = geometry.witness(k)
        for s in range(0, max(q.shape[0], 1), chunk):  # one empty chunk for no queries
            yield geometry.score(geometry.witness(q[s : s + chunk]), kw)


def exact_topk(
    q: torch.Tensor, k: torch.Tensor, geometry: Geometry, top_k: int, chunk: int = 1024
) -> torch.Tensor:
    """Indices `(nq, K)` of each query's K best keys by exact logit (2-D inputs, tiled)."""
    return torch.cat(
        [logits.topk(top_k, dim=-1).indices for logits in _logit_chunks(q, k, geometry, chunk)]
    )


def topk_recall(candidates: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """`|C_i ∩ topK_exact(i)| / K` per query, from candidates `(nq, C)` (-1 padded) and the
    exact top-K indices `(nq, K)`."""
    hits = (candidates.unsqueeze(-2) == exact.unsqueeze(-1)).any(-1)
    return hits.float().mean(-1)


def mass_recall(
    q: torch.Tensor,
    k: torch.Tensor,
    geometry: Geometry,
    candidates: torch.Tensor,
    dense_lse: torch.Tensor,
) -> torch.Tensor:
    """`sum_{j in C_i} A_ij` per query, A the exact dense attention, from the candidates'
    exact logits and the dense log-partition `dense_lse (nq,)`. Each key's witness is
    computed once and gathered per query (a witness is a map of each key on its own)."""
    with torch.no_grad():
        valid = candidates >= 0
        keys_w = geometry.witness(k)[candidates.clamp_min(0)]
        logits = geometry.score_at(geometry.witness(q), keys_w)
        weights = torch.exp(logits - dense_lse.unsqueeze(-1)).masked_fill(~valid, 0.0)
        return weights.sum(-1)


def output_error(out: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """`||o_sparse - o_dense|| / ||o_dense||` per query."""
    return (out - reference).norm(dim=-1) / reference.norm(dim=-1).clamp_min(1e-30)


def dense_entropy(q: torch.Tensor, k: torch.Tensor, geometry: Geometry, chunk: int = 1024):
    """Entropy (nats) of each query's exact dense attention row (tiled over queries)."""
    parts = []
    for logits in _logit_chunks(q, k, geometry, chunk):
        weights = torch.softmax(logits, dim=-1)
        parts.append(-(weights * torch.log(weights.clamp_min(1e-30))).sum(-1))
    return torch.cat(parts)


def summary(values: torch.Tensor) -> dict[str, float]:
    """Median and 99th percentile of a per-query measure."""
    values = values.double()
    return {"median": values.median().item(), "p99": values.quantile(0.99).item()}


def quality(
    out: torch.Tensor,
    lse: torch.Tensor,
    reference_out: torch.Tensor,
    reference_lse: torch.Tensor,
    keys_read: torch.Tensor | None = None,
    n_keys: int | None = None,
) -> dict[str, float]:
    """The quality report of an approximate attention result against exact dense attention:
    median and p99 relative output error, median absolute lse error and, given the keys read
    per query, the mean fraction of keys read."""
    error = summary(output_error(out, reference_out))
    report = {
        "err_median": error["median"],
        "err_p99": error["p99"],
        "lse_abs_err_median": (lse - reference_lse).abs().double().median().item(),
    }
    if keys_read is not None:
        if n_keys is None:
            raise ValueError("keys_read needs n_keys")
        report["keys_read_frac"] = keys_read.double().mean().item() / n_keys
    return report
