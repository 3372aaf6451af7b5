"""Dot-product attention, the standard transformer (docs/mathematics.md 1.6): `logit = <q, k> /
sqrt(d)`."""

from __future__ import annotations

import math

import torch

from .geometry import Geometry, Lift, Role, ScoreTerm, check_role


class DotProduct(Geometry):
    """`logit = scale * <q, k>`, `scale = 1/sqrt(d)` unless given. Lift: identity, inner product."""

    def __init__(self, dim: int, heads: int = 1, scale: float | None = None) -> None:
        super().__init__(dim, heads)
        self.scale = 1 / math.sqrt(dim) if scale is None else float(scale)

    def score(self, qw: torch.Tensor, kw: torch.Tensor) -> torch.Tensor:
        return (qw @ kw.transpose(-1, -2)) * self.scale

    def score_terms(self, qw: torch.Tensor, kw: torch.Tensor) -> list[ScoreTerm]:
        return [ScoreTerm(qw, kw, (), self.scale)]

    def score_at(self, qw: torch.Tensor, kw: torch.Tensor) -> torch.Tensor:
        return (kw @ qw.unsqueeze(-1)).squeeze(-1) * self.scale

    def similarity_logits(
        self, qw: torch.Tensor, similarities: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        (similarity,) = similarities
        return [similarity * self.scale]

    def lift(self, w: torch.Tensor, role: Role) -> list[Lift]:
        check_role(role)
        return [Lift(w, "ip")]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scale={self.scale:.6g}"
