"""Causal tail attention (docs/indexes.md, "Causal tail"): a query at position p attends over the
keys `[0, p]`. The keys are cut into segments of `segment` positions; the query reads the keys of
its own segment up to p exactly (a masked dense block) and sees the keys before its segment
through tail attention over a `KeyClusters` of them (the clusters it visits exactly within
`budget`, the others estimated). The two parts merge exactly by their log-sum-exps
(docs/mathematics.md 7).

Segments are visited in order and the clusters of the keys before segment j + 1 are those of
segment j's extended with segment j's keys (`KeyClusters.extend`), so every query sees the
clusters a build over exactly its earlier keys would give.
"""

from __future__ import annotations

import torch

from rewa.attention import Geometry, dense_attention, merge_attention

from .clusters import KeyClusters, check_clusterable
from .tail import tail_attention

# Positions per segment (docs/indexes.md, "Causal tail"): a query reads up to a segment of keys
# exactly, and the clusters are extended once per segment.
DEFAULT_SEGMENT = 16384
# Keys read exactly from before the segment, at least: two clusters at their largest (512 keys
# by default, up to twice that before the trained prefix doubles, `growth`). A budget fraction of
# a short prefix holds less than one cluster, and then every cluster is only estimated (on the
# MiniLM heads of benchmarks/causal_tail.py, head 9: p99 error 0.24 with 1024, docs/indexes.md).
MIN_KEYS_READ = 2048


def causal_tail_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    geometry: Geometry,
    positions: torch.Tensor,
    *,
    budget: float = 0.02,
    tail: bool = True,
    window: int = 0,
    sinks: int = 0,
    segment: int = DEFAULT_SEGMENT,
    measured_queries: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(out (nq, dv), lse (nq,))` of queries `(nq, d)` at `positions` `(nq,)` over keys
    `(nk, d)` and values `(nk, dv)`, query i seeing keys `[0, positions[i]]`. `budget` is the
    fraction of the keys before a query's segment that it reads exactly (at least
    `MIN_KEYS_READ` of them); `tail=False` leaves the unread clusters out. The first `sinks`
    keys, and the `window` keys before a query's segment (its window reaches there at most),
    are read exactly besides. `measured_queries`: that many queries of each segment answered
    exactly over the keys before it, fitting the others' shrinkage toward the keys read
    (`tail_attention`'s option, index/tail/measured.py). Gradients reach q, and k and v through
    the exact part."""
    if q.dim() != 2 or k.dim() != 2 or v.dim() != 2 or k.shape[0] != v.shape[0]:
        raise ValueError(
            f"expected q (nq, d), k (nk, d), v (nk, dv), got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if positions.shape != q.shape[:1]:
        raise ValueError(f"expected one position per query, got {tuple(positions.shape)}")
    if segment < 1:
        raise ValueError(f"expected a segment of at least one key, got {segment}")
    if window < 0 or sinks < 0:
        raise ValueError(f"expected window and sinks >= 0, got {window} and {sinks}")
    if measured_queries < 0:
        raise ValueError(f"expected measured_queries >= 0, got {measured_queries}")
    # Before any segment: a context shorter than one segment would need no clusters and pass.
    check_clusterable(geometry)
    n_keys = k.shape[0]
    if q.shape[0] == 0:
        return v.new_zeros(0, v.shape[-1]), q.new_zeros(0)
    if int(positions.min()) < 0 or int(positions.max()) >= n_keys:
        raise ValueError(f"expected positions in [0, {n_keys}) (a key at each position)")
    with torch.no_grad():
        keys_w = geometry.witness(k)
    segment_of = positions // segment
    outs, lses, rows_done = [], [], []
    earlier: KeyClusters | None = None
    for index in segment_of.unique().tolist():  # ascending
        rows = (segment_of == index).nonzero().squeeze(-1)
        start, at = index * segment, positions[rows]
        stop = int(at.max()) + 1
        part = _own_segment(q[rows], k[start:stop], v[start:stop], geometry, at - start)
        if start > 0:
            with torch.no_grad():
                if earlier is None:
                    earlier = KeyClusters.build(keys_w[:start], v[:start].detach(), geometry)
                else:
                    added = slice(earlier.n_keys, start)
                    earlier = earlier.extend(keys_w[added], v[added].detach())
            fraction = min(1.0, max(budget, MIN_KEYS_READ / start))
            always = torch.cat(
                [
                    torch.arange(min(sinks, start), device=k.device),
                    torch.arange(max(start - window, 0), start, device=k.device),
                ]
            )
            estimate = tail_attention(
                q[rows], earlier, budget=fraction, tail=tail, always=always,
                measured_queries=measured_queries,
            )  # fmt: skip
            part = merge_attention(part, estimate)
        outs.append(part[0])
        lses.append(part[1])
        rows_done.append(rows)
    where = torch.cat(rows_done).argsort()
    return torch.cat(outs)[where], torch.cat(lses)[where]


def _own_segment(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, geometry: Geometry, at: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of queries `(m, d)` at positions `at` `(m,)` (counted from the
    segment's first key) over the segment's keys up to theirs. When the queries are the
    segment's last m positions in order, as in self-attention and prefill, this is
    bottom-right-aligned causal attention (PyTorch's fused kernel for the dot product,
    docs/indexes.md, "Causal tail"); otherwise a masked dense block."""
    n_keys = k.shape[0]
    if torch.equal(at, torch.arange(n_keys - at.shape[0], n_keys, device=at.device)):
        return dense_attention(q, k, v, geometry, causal=True)
    visible = torch.arange(n_keys, device=k.device) <= at.unsqueeze(-1)
    return dense_attention(q, k, v, geometry, mask=visible)
