"""Euclidean space `R^m` (docs/mathematics.md 1.1): `d(x, y) = ||x - y||`, lift the identity with
L2."""

from __future__ import annotations

import torch

from .geometry import (
    DistanceGeometry,
    DistanceTerm,
    Lift,
    NearPairs,
    Role,
    ScoreTerm,
    check_role,
    per_head,
)
from .numerics import gram_operands, gram_squared_distance, safe_norm, safe_sqrt


def dist(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """||x - y|| along the last axis (finite gradient at x = y)."""
    return safe_norm(x - y)


def distance_matrix(
    x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """`scale * ||x_i - y_j||` for `x (..., n, d)`, `y (..., m, d)` -> `(..., n, m)`."""
    distance = safe_sqrt(gram_squared_distance(x, y))
    return distance if scale is None else distance * scale


def distance_term(x: torch.Tensor, y: torch.Tensor) -> DistanceTerm:
    """`distance_matrix(x, y)` in product form: `sqrt` of the Gram expansion."""
    return DistanceTerm(*gram_operands(x, y), ("sqrt",), near=NearPairs(x, y))


class Euclidean(DistanceGeometry):
    """Logits `-||q - k||^p / tau`."""

    def distance_matrix(
        self, qw: torch.Tensor, kw: torch.Tensor, scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        return distance_matrix(qw, kw, scale)

    def score(self, qw: torch.Tensor, kw: torch.Tensor) -> torch.Tensor:
        logits = self.score_from_terms(qw, kw)
        if logits is not None:
            return logits
        if self.power == 2:
            squared = gram_squared_distance(qw, kw).clamp_min(0)
            return squared * per_head(-1 / self.temperature())
        return super().score(qw, kw)

    def distance(self, xw: torch.Tensor, yw: torch.Tensor) -> torch.Tensor:
        return dist(xw, yw)

    def distance_terms(self, qw: torch.Tensor, kw: torch.Tensor) -> list[DistanceTerm]:
        return [distance_term(qw, kw)]

    def score_terms(self, qw: torch.Tensor, kw: torch.Tensor) -> list[ScoreTerm]:
        if self.power == 2:
            weight = per_head(-1 / self.temperature()).to(qw.dtype)
            near = NearPairs(qw, kw)
            return [ScoreTerm(*gram_operands(qw, kw), ("clamp_to_zero",), weight, near)]
        return super().score_terms(qw, kw)

    def distance_from_similarity(self, qw: torch.Tensor, similarity: torch.Tensor) -> torch.Tensor:
        return safe_sqrt(-similarity)

    def lift(self, w: torch.Tensor, role: Role) -> list[Lift]:
        check_role(role)
        return [Lift(w, "l2")]
