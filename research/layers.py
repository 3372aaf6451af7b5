"""Building blocks for training models with any geometry: the mixture of geometries
(docs/mathematics.md 8) and `GeometricTransformerLayer`, a compact pre-norm encoder block."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from rewa.attention import GeometricAttention, Geometry

ExpertSpec = str | dict[str, Any] | Geometry | nn.Module


class GeometryMixture(nn.Module):
    """Mixture of geometries: experts with different geometries and a per-token gate,
    `gate = softmax(MLP(x))`, `out = sum_k gate_k expert_k` (docs/mathematics.md 8).

    Args:
        embed_dim, num_heads: as `GeometricAttention`.
        experts: one entry per expert: a geometry name, a dict `{"name": ..., **options}`, a
            `Geometry` (built for `head_dim` and `num_heads`), or any attention module mapping
            `(B, N, E)` to `(B, N, E)`.
        gate_hidden: hidden width of the gate MLP.
        head_dim: per-head width of experts built here (default E / H).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        experts: Sequence[ExpertSpec],
        *,
        gate_hidden: int = 32,
        head_dim: int | None = None,
    ) -> None:
        super().__init__()
        if len(experts) < 1:
            raise ValueError("a mixture needs at least one expert")
        self.experts = nn.ModuleList(
            [_expert(spec, embed_dim, num_heads, head_dim) for spec in experts]
        )
        self.gate_mlp = nn.Sequential(
            nn.Linear(embed_dim, gate_hidden), nn.GELU(), nn.Linear(gate_hidden, len(experts))
        )

    def gate(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token expert weights `(..., N, experts)`, summing to 1."""
        return torch.softmax(self.gate_mlp(x), dim=-1)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        causal: bool = False,
        **attention_kwargs: Any,
    ) -> torch.Tensor:
        gate = self.gate(query)
        out = 0
        for index, expert in enumerate(self.experts):
            part = expert(query, key, value, mask=mask, causal=causal, **attention_kwargs)
            out = out + gate[..., index : index + 1] * part
        return out


def _expert(spec: ExpertSpec, embed_dim: int, num_heads: int, head_dim: int | None) -> nn.Module:
    if isinstance(spec, str | Geometry):
        return GeometricAttention(embed_dim, num_heads, spec, head_dim=head_dim)
    if isinstance(spec, dict):
        options = dict(spec)
        if "name" not in options:
            raise ValueError(f"an expert given as a dict needs a 'name', got {sorted(options)}")
        name = options.pop("name")
        return GeometricAttention(
            embed_dim, num_heads, name, head_dim=head_dim, geometry_options=options
        )
    if isinstance(spec, nn.Module):
        return spec
    raise TypeError(f"expected an expert name, dict, Geometry or module, got {type(spec)}")


class GeometricTransformerLayer(nn.Module):
    """An encoder block: `x + attention(norm(x))`, then `x + MLP(norm(x))` (pre-norm; post-norm
    with `norm_first=False`).

    Args:
        embed_dim, num_heads: model width and heads.
        geometry: a geometry name or `Geometry` for a `GeometricAttention` (ignored when
            `attention` is given).
        attention: any attention module called as `attention(x, mask=..., causal=...,
            **attention_kwargs)`: `GeometricAttention`, `RiemannAttention`, `GeometryMixture`.
        head_dim, geometry_options: for the `GeometricAttention` built here.
        mlp_hidden: hidden width of the MLP (default 4 E).
        dropout: after attention, inside and after the MLP.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        geometry: str | Geometry = "dot",
        *,
        attention: nn.Module | None = None,
        head_dim: int | None = None,
        geometry_options: dict[str, Any] | None = None,
        mlp_hidden: int | None = None,
        dropout: float = 0.0,
        norm_first: bool = True,
    ) -> None:
        super().__init__()
        if attention is None:
            attention = GeometricAttention(
                embed_dim, num_heads, geometry, head_dim=head_dim, geometry_options=geometry_options
            )
        self.attention = attention
        hidden = 4 * embed_dim if mlp_hidden is None else mlp_hidden
        self.mlp = nn.Sequential(
            nn.Linear(embed_dim, hidden),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, embed_dim),
        )
        self.attention_norm = nn.LayerNorm(embed_dim)
        self.mlp_norm = nn.LayerNorm(embed_dim)
        self.dropout = nn.Dropout(dropout)
        self.norm_first = norm_first

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        causal: bool = False,
        **attention_kwargs: Any,
    ) -> torch.Tensor:
        """`x (B, N, E)` -> `(B, N, E)`; `attention_kwargs` (e.g. `positions`) go to the
        attention module."""
        if self.norm_first:
            h = self.attention(self.attention_norm(x), mask=mask, causal=causal, **attention_kwargs)
            x = x + self.dropout(h)
            return x + self.dropout(self.mlp(self.mlp_norm(x)))
        h = self.attention(x, mask=mask, causal=causal, **attention_kwargs)
        x = self.attention_norm(x + self.dropout(h))
        return self.mlp_norm(x + self.dropout(self.mlp(x)))
