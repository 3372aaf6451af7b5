"""`GeometricAttention`: multi-head attention with any geometry, shaped like
`torch.nn.functional.scaled_dot_product_attention` inside and `nn.MultiheadAttention` outside."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .dense import dense_attention
from .geometry import Geometry
from .registry import make_geometry


class GeometricAttention(nn.Module):
    """Multi-head attention: input projections to `(B, H, N, head_dim)`, exact attention under
    the geometry (heads are batch dimensions; the geometry holds per-head parameters), output
    projection.

    Args:
        embed_dim: model width E.
        num_heads: H.
        geometry: a registered name (`"dot"`, `"euclidean"`, `"sphere"`, `"poincare"`, `"kappa"`,
            `"product"`, `"adaptive_product"`) or a `Geometry` built with `dim=head_dim` and
            `heads=num_heads`.
        head_dim: per-head width (default E / H).
        bias: biases in the projections.
        geometry_options: options for a geometry given by name.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        geometry: str | Geometry = "dot",
        *,
        head_dim: int | None = None,
        bias: bool = True,
        geometry_options: dict[str, Any] | None = None,
        q_chunk: int | None = None,
        k_chunk: int | None = None,
    ) -> None:
        super().__init__()
        if head_dim is None:
            if embed_dim % num_heads:
                raise ValueError(
                    f"embed_dim {embed_dim} is not divisible by num_heads {num_heads}; "
                    "pass head_dim explicitly"
                )
            head_dim = embed_dim // num_heads
        if isinstance(geometry, str):
            geometry = make_geometry(geometry, head_dim, num_heads, **(geometry_options or {}))
        elif geometry_options:
            raise ValueError("geometry_options apply only to a geometry given by name")
        if geometry.dim != head_dim or geometry.heads not in (1, num_heads):
            raise ValueError(
                f"expected a geometry with dim {head_dim} and 1 or {num_heads} heads, got dim "
                f"{geometry.dim} and {geometry.heads} heads"
            )
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, head_dim
        self.geometry = geometry
        self.q_chunk, self.k_chunk = q_chunk, k_chunk
        inner = num_heads * head_dim
        self.q_proj = nn.Linear(embed_dim, inner, bias=bias)
        self.k_proj = nn.Linear(embed_dim, inner, bias=bias)
        self.v_proj = nn.Linear(embed_dim, inner, bias=bias)
        self.out_proj = nn.Linear(inner, embed_dim, bias=bias)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.num_heads, self.head_dim)).transpose(-2, -3)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None = None,
        causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention core on projected `(B, H, N, head_dim)` tensors -> `(out, lse)`."""
        return dense_attention(
            q, k, v, self.geometry, mask, causal, q_chunk=self.q_chunk, k_chunk=self.k_chunk
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        causal: bool = False,
        need_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`query (B, Nq, E)`, `key`/`value (B, Nk, E)` (default: self-attention) -> `(B, Nq, E)`;
        with `need_lse`, also the per-head log-partition `(B, H, Nq)`. `mask` broadcasts to
        `(B, H, Nq, Nk)` (True = attend, or additive float)."""
        q, k, v = self.project(query, key, value)
        out, lse = self.attend(q, k, v, mask, causal)
        return self.merge_heads(out, lse, need_lse)

    def project(
        self, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-head `q, k, v (B, H, N, head_dim)`; key defaults to query, value to key."""
        key = query if key is None else key
        value = key if value is None else value
        q = self._split_heads(self.q_proj(query))
        k = self._split_heads(self.k_proj(key))
        return q, k, self._split_heads(self.v_proj(value))

    def merge_heads(
        self, out: torch.Tensor, lse: torch.Tensor, need_lse: bool
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The output projection of per-head outputs `(B, H, N, head_dim)`."""
        out = self.out_proj(out.transpose(-2, -3).flatten(-2))
        return (out, lse) if need_lse else out
