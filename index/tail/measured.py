"""The estimate of the unread clusters weighed by a measurement: a few of a call's queries per
head answered exactly, and each head's answers moved from the keys read toward the tail
estimate by the one factor that fits those exact answers best (docs/indexes.md, "Measured
shrinkage of the tail").

Tail attention's answer is the exact answer over the keys read, `o_r`, moved by the estimate of
the clusters left unread: `o_t = o_r + s_u (o_u - o_r)`, `s_u` the unread share of the mass. On
sharp heads the estimated values `o_u` of the unread clusters lie too far from `o_r`, and the
answer overshoots (docs/benchmark-notes.md, "The tail estimate shrunk by a measurement (issue
25)"). With `measured_queries = m`, m of the call's queries per head (evenly spaced) are
answered by exact attention over every key, and each head's answers become `o_r + beta (o_t -
o_r)` with the `beta` in [0, 1] of least squared error on those m queries: `beta = 1` is the
tail answer, `beta = 0` the exact answer over the keys read (top-K), so on the measured queries
the answer is never worse than either. The measured queries get their exact answers."""

from __future__ import annotations

import torch

from rewa.attention import witness_attention

from ..clusters import ClusterHeads


def measured_rows(n_queries: int, measured_queries: int, device: torch.device) -> torch.Tensor:
    """The rows of the queries answered exactly, `(min(m, nq),)`: evenly spaced, first and last
    included (at least one row apart, so distinct), so the same call measures the same
    queries."""
    count = min(measured_queries, n_queries)
    if count == 0:
        return torch.zeros(0, dtype=torch.long, device=device)
    return torch.linspace(0, n_queries - 1, count, device=device).round().long()


def exact_answers(
    queries_w: torch.Tensor, heads: ClusterHeads
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention `(out (H, m, dv), lse (H, m))` of the query witnesses `(H, m, d_w)` over
    every key of their head (`witness_attention`: the fused kernel for the dot product)."""
    answers = [
        witness_attention(queries_w[head], clusters.keys_w, clusters.values, heads.geometry)
        for head, clusters in enumerate(heads.heads)
    ]
    return tuple(torch.stack(parts) for parts in zip(*answers, strict=True))


def fitted_shrinkage(
    read_out: torch.Tensor, tail_out: torch.Tensor, exact_out: torch.Tensor
) -> torch.Tensor:
    """Per head `(H,)`, the `beta` in [0, 1] that minimises `sum |read + beta (tail - read) -
    exact|^2` over the measured rows (each `(H, m, dv)`); 1 where the tail moves no answer."""
    with torch.no_grad():
        moved = (tail_out - read_out).flatten(1)
        missed = (exact_out - read_out).flatten(1)
        norm = moved.square().sum(-1)
        beta = (moved * missed).sum(-1) / torch.where(norm > 0, norm, 1)
        return torch.where(norm > 0, beta.clamp(0, 1), 1.0)


def measured_shrinkage(
    queries_w: torch.Tensor,
    heads: ClusterHeads,
    read_out: torch.Tensor,
    tail: tuple[torch.Tensor, torch.Tensor],
    keys_read: torch.Tensor,
    measured_queries: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(out (H, nq, dv), lse (H, nq), keys_read (H, nq))`: the tail answers `tail` moved
    toward the exact answers over the keys read, `read_out`, by each head's fitted factor, and
    the measured rows answered exactly (lse included; they read every key)."""
    tail_out, tail_lse = tail
    rows = measured_rows(queries_w.shape[1], measured_queries, queries_w.device)
    if len(rows) == 0:
        return tail_out, tail_lse, keys_read
    exact_out, exact_lse = exact_answers(queries_w[:, rows], heads)
    beta = fitted_shrinkage(read_out[:, rows], tail_out[:, rows], exact_out)
    out = read_out + beta.to(read_out.dtype).view(-1, 1, 1) * (tail_out - read_out)
    out = out.index_copy(1, rows, exact_out.to(out.dtype))
    lse = tail_lse.index_copy(1, rows, exact_lse.to(tail_lse.dtype))
    all_keys = torch.tensor([c.n_keys for c in heads.heads], device=keys_read.device)
    read = keys_read.index_copy(
        1, rows, all_keys.to(keys_read.dtype).view(-1, 1).expand(-1, len(rows))
    )
    return out, lse, read
