"""The exact part of a memory-backed attention: `(out, lse)` of queries over keys held in the
process (a layer's window and sinks, a window of an encoder, a document's staged tokens), under
the dot geometry with the model's logit scale.

Without a mask (a decode step's newest queries see the whole window) `dense_attention` answers,
which takes PyTorch's fused kernel for the dot product (docs/benchmark-notes.md, "The decode
step compiled"). With a mask, a small part (a few queries per head over some hundred keys) is
one matrix product for the logits and `softmax_attend` (about ten operations) instead of the
library's tiled online softmax, whose per-tile bookkeeping costs more than the arithmetic at
that size (docs/benchmark-notes.md, "The value shift of a decode step"); larger ones (a
prompt's blocks) keep the tiled path, which bounds its memory by the tile."""

from __future__ import annotations

import functools

import torch

from rewa.attention import Geometry, dense_attention, make_geometry
from rewa.attention.sparse import softmax_attend

SMALL_LOGITS = 1 << 20  # the most logits (heads x queries x keys) computed in one tensor


@functools.lru_cache(maxsize=64)
def dot_geometry(head_dim: int, scale: float) -> Geometry:
    """`logit = scale * <q, k>`; one module per (head_dim, scale), shared."""
    return make_geometry("dot", head_dim, scale=scale)


def exact_part(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    visible: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of queries `(heads, m, d)` over keys and values `(heads, n, .)` in
    float32; `visible` `(m, n)`: which keys each query may see (all when None). A query that
    sees no key gets `out = 0`, `lse = -inf`."""
    queries, keys, values = queries.float(), keys.float(), values.float()
    heads, m, n = queries.shape[0], queries.shape[-2], keys.shape[-2]
    if visible is None or heads * m * n > SMALL_LOGITS:
        geometry = dot_geometry(queries.shape[-1], float(scale))
        return dense_attention(queries, keys, values, geometry, mask=visible)
    logits = torch.matmul(queries, keys.transpose(-1, -2)) * float(scale)
    if visible is not None:
        logits = logits.masked_fill(~visible, float("-inf"))
    return softmax_attend(logits, values)
