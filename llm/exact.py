"""The exact part of a memory-backed attention: `(out, lse)` of queries over keys held in the
process (a layer's window and sinks, a window of an encoder, a document's staged tokens), by
the library's `dense_attention` under the dot geometry with the model's logit scale."""

from __future__ import annotations

import functools

import torch

from rewa.attention import Geometry, dense_attention, make_geometry


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
    float32; `visible` `(m, n)`: which keys each query may see (all when None)."""
    geometry = dot_geometry(queries.shape[-1], float(scale))
    return dense_attention(queries.float(), keys.float(), values.float(), geometry, mask=visible)
