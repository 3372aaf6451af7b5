"""Sparse attention over given candidates, O(N K d) (docs/mathematics.md 6): exact logits on each
query's candidate keys, the top K of them, softmax, `(out, lse)`.

Candidates are key indices `(..., nq, C)` in a padded fixed-width layout, `-1` marking padding.
Duplicates within a row are ignored after their first occurrence. Work is chunked over queries
so that at most about `chunk_elements` gathered elements are alive at once; with gradients
enabled each chunk is checkpointed and recomputed in the backward pass, so memory stays bounded
there too. (`budget`, everywhere in rewa, is the fraction of keys a tail query reads.)
"""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

from .allocator import retain_freed_memory
from .geometry import Geometry, check_attention_inputs
from .numerics import compute_dtype

CHUNK_ELEMENTS = 1 << 22
"""Gathered elements (queries x candidates x dim) per chunk: 16 MiB in float32, below glibc's
largest mmap threshold so that chunk buffers are reused (docs/benchmark-notes.md,
"Measurements behind code choices")."""


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    geometry: Geometry,
    candidates: torch.Tensor,
    top_k: int,
    *,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each query over the `top_k` best of its candidate keys.

    Args:
        q: queries `(..., nq, d)`; k: keys `(..., nk, d)`; v: values `(..., nk, dv)`; the batch
            dimensions of q, k, v and candidates must be equal (heads are batch dimensions).
        geometry: any `Geometry` with `dim == d`.
        candidates: int64 key indices `(..., nq, C)`, `-1` for padding.
        top_k: K, the number of best-scoring candidates attended per query.
        chunk_elements: gathered elements per chunk of queries (memory, not accuracy: every
            candidate is scored whatever its value).

    Returns:
        `out (..., nq, dv)`, `lse (..., nq)`: the log-partition over the K attended keys. A query
        without any valid candidate gets `(0, -inf)`.
    """
    _check_inputs(q, k, v, geometry, candidates, top_k)
    if q.device.type == "cpu":
        retain_freed_memory()
    dtype = compute_dtype(q.dtype)
    qw = geometry.witness(q.to(dtype))
    kw = geometry.witness(k.to(dtype))
    flat_keys = kw.reshape(-1, *kw.shape[-2:])
    flat_values = v.to(dtype).reshape(-1, *v.shape[-2:])
    rows = _unique_per_row(candidates)
    if rows.shape[-1] == 0:  # no query has a candidate (a context of a key or two, say)
        rows = rows.new_full((*rows.shape[:-1], 1), -1)
    n_queries, width = rows.shape[-2], rows.shape[-1]
    per_query = width * max(kw.shape[-1], v.shape[-1]) * flat_keys.shape[0]
    chunk = max(1, chunk_elements // per_query)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (qw, kw, flat_values))
    outs, lses = [], []
    for start in range(0, max(n_queries, 1), chunk):  # one empty chunk for no queries
        part = slice(start, min(start + chunk, n_queries))
        args = (qw[..., part, :], flat_keys, flat_values, rows[..., part, :], geometry, top_k)
        if needs_grad:
            out, lse = checkpoint(_attend_chunk, *args, use_reentrant=False)
        else:
            out, lse = _attend_chunk(*args)
        outs.append(out)
        lses.append(lse)
    out = geometry.output_map(torch.cat(outs, dim=-2))
    return out.to(q.dtype), torch.cat(lses, dim=-1)


def _check_inputs(q, k, v, geometry, candidates, top_k) -> None:
    check_attention_inputs(q, k, v, geometry)
    if not (q.shape[:-2] == k.shape[:-2] == v.shape[:-2] == candidates.shape[:-2]):
        raise ValueError(
            "expected equal batch dimensions for q, k, v and candidates, got "
            f"{tuple(q.shape[:-2])}, {tuple(k.shape[:-2])}, {tuple(v.shape[:-2])} and "
            f"{tuple(candidates.shape[:-2])}"
        )
    if candidates.shape[-2] != q.shape[-2]:
        raise ValueError(
            f"expected one candidate row per query ({q.shape[-2]}), got {candidates.shape[-2]}"
        )
    if candidates.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"expected integer candidate indices, got {candidates.dtype}")
    if candidates.numel() and (candidates.max() >= k.shape[-2] or candidates.min() < -1):
        raise ValueError(
            f"candidate indices must lie in [-1, {k.shape[-2] - 1}], got "
            f"[{candidates.min().item()}, {candidates.max().item()}]"
        )
    if top_k < 1:
        raise ValueError(f"expected top_k >= 1, got {top_k}")


def _unique_per_row(candidates: torch.Tensor) -> torch.Tensor:
    """Replace repeated indices within a row by -1 (padding)."""
    candidates = candidates.long()
    ordered, order = candidates.sort(dim=-1)
    repeated = torch.zeros_like(ordered, dtype=torch.bool)
    repeated[..., 1:] = ordered[..., 1:] == ordered[..., :-1]
    ordered = ordered.masked_fill(repeated, -1)
    return torch.empty_like(candidates).scatter_(-1, order, ordered)


def _attend_chunk(
    qw: torch.Tensor,
    flat_keys: torch.Tensor,
    flat_values: torch.Tensor,
    rows: torch.Tensor,
    geometry: Geometry,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """qw `(*batch, c, w)`, rows `(*batch, c, C)`; keys `(B, nk, w)` and values `(B, nk, dv)`
    with the batch flattened to B for gathering."""
    batch_shape = rows.shape[:-2]
    # Sizes spelled out, not -1: a chunk of no queries has no elements to infer them from.
    flat_rows = rows.reshape(math.prod(batch_shape), *rows.shape[-2:])
    valid = flat_rows >= 0
    index = flat_rows.clamp_min(0)
    gathered = _gather_rows(flat_keys, index).reshape(
        *batch_shape, *index.shape[-2:], flat_keys.shape[-1]
    )
    logits = geometry.score_at(qw, gathered).reshape(index.shape)
    logits = logits.masked_fill(~valid, float("-inf"))
    best, position = logits.topk(min(top_k, logits.shape[-1]), dim=-1)
    out, lse = attend_scored(best, index.gather(-1, position), flat_values)
    return out.reshape(*batch_shape, *out.shape[-2:]), lse.reshape(*batch_shape, lse.shape[-1])


def attend_scored(
    logits: torch.Tensor, ids: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over keys already scored: logits and key ids `(B, c, K)` (`-inf` for
    padding; padded ids may be anything in range), values `(B, nk, dv)` -> `(out (B, c, dv),
    lse (B, c))`; a row with no finite logit gets `(0, -inf)`. Rows go in blocks whose
    gathered values hold about `CHUNK_ELEMENTS` numbers: gathering all at once spends much of
    the time in first-touch page faults (docs/benchmark-notes.md, "Measurements behind code
    choices")."""
    block = max(1, CHUNK_ELEMENTS // max(1, ids.shape[-1] * values.shape[-1]))
    outs, lses = [], []
    retain_freed_memory()
    for start in range(0, max(ids.shape[-2], 1), block):  # one empty block for no rows
        rows = slice(start, start + block)
        chosen = _gather_rows(values, ids[:, rows].clamp_min(0))
        out, lse = softmax_attend(logits[:, rows].unsqueeze(-2), chosen)
        outs.append(out.squeeze(-2))
        lses.append(lse.squeeze(-1))
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


def softmax_attend(logits: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(softmax(logits) @ values, logsumexp(logits))` for logits `(..., n, K)` and values
    `(..., K, dv)`, with one exponential per logit; `-inf` logits are masked keys, and a row
    with no finite logit gets `(0, -inf)`."""
    top = logits.amax(-1, keepdim=True)
    shift = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(logits - shift)
    total = weights.sum(-1)
    seen = total > 0
    out = (weights @ values) / torch.where(seen, total, 1).unsqueeze(-1)
    lse = torch.where(seen, shift.squeeze(-1) + total.log(), float("-inf"))
    return out, lse


def _gather_rows(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`table (B, n, w)` rows at `index (B, c, C)` -> `(B, c, C, w)`, through one `index_select`
    on the flattened table (several times faster than advanced indexing on CPU)."""
    batch, n, width = table.shape
    offsets = (torch.arange(batch, device=index.device) * n).view(-1, 1, 1)
    flat = table.reshape(batch * n, width).index_select(0, (index + offsets).flatten())
    return flat.view(*index.shape, width)
