"""The unit sphere `S^{n-1}` (docs/mathematics.md 1.2): witness `x / max(||x||, eps)`, distance
`arccos<a, b>` computed as `2 atan2(||a - b||, ||a + b||)`, lift the witness with inner product."""

from __future__ import annotations

import math

import torch

from .geometry import DistanceGeometry, DistanceTerm, Lift, NearPairs, Role, check_role
from .numerics import refine_near_pairs, safe_norm, safe_sqrt

NORM_EPS = 1e-12


def normalize(x: torch.Tensor) -> torch.Tensor:
    """`x / max(||x||, eps)` along the last axis."""
    return x / safe_norm(x, keepdim=True).clamp_min(NORM_EPS)


def dist(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Great-circle distance between unit vectors paired along the last axis; exact and with
    finite gradients at 0 and pi (no arccos, no clamp)."""
    return 2 * torch.atan2(safe_norm(a - b), safe_norm(a + b))


def distance_matrix(
    a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """`scale *` great-circle distances `(..., n, m)` between unit vectors `a (..., n, d)` and
    `b (..., m, d)`: `2 arcsin(h)` with the squared half chord `h^2 = (1 - <a, b>) / 2` taken
    from one product of the augmented vectors of `half_chord_operands`. The same value as
    `2 atan2(||a - b||, ||a + b||)`, with finite gradients and only vectorised kernels."""
    a_aug, b_aug = half_chord_operands(a, b)
    factor = 2.0 if scale is None else 2.0 * scale
    # The squared half chord is |a - b|^2 / 4 for unit vectors: near pairs are recomputed so.
    squared = refine_near_pairs(a_aug @ b_aug.transpose(-1, -2), a, b, factor=0.25)
    return _arcsin_of_half_chord(squared) * factor


def half_chord_operands(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(-a/2, 1/2)` and `(b, 1)`, whose inner product is the squared half chord
    `(1 - <a, b>) / 2` of unit vectors."""
    half = torch.full_like(a[..., :1], 0.5)
    return torch.cat([-0.5 * a, half], dim=-1), torch.cat([b, torch.ones_like(b[..., :1])], dim=-1)


def distance_term(a: torch.Tensor, b: torch.Tensor) -> DistanceTerm:
    """`distance_matrix(a, b)` in product form."""
    near = NearPairs(a, b, factor=0.25)
    return DistanceTerm(*half_chord_operands(a, b), ("arcsin_of_root",), 2.0, near)


def _arcsin_of_half_chord(squared_half_chord: torch.Tensor) -> torch.Tensor:
    """`arcsin(min(sqrt(h^2), 1))`. At antipodal points (h = 1, where the distance has a cone
    singularity) the gradient is cut to 0: arcsin's derivative is infinite there, and an
    infinite or NaN gradient would poison every parameter (seen with 2-dimensional sphere
    components of a product geometry in training)."""
    half_chord = safe_sqrt(squared_half_chord)
    inside = half_chord < 1.0
    angle = torch.asin(torch.where(inside, half_chord, torch.zeros_like(half_chord)))
    return torch.where(inside, angle, torch.full_like(angle, math.pi / 2))


def distance_from_cosine(cosine: torch.Tensor) -> torch.Tensor:
    """`arccos` as `2 arcsin(sqrt((1 - cos) / 2))` (vectorised; cosines beyond 1 count as 1)."""
    return 2 * _arcsin_of_half_chord((1 - cosine) / 2)


class Sphere(DistanceGeometry):
    """Logits `-arccos(<q/|q|, k/|k|>)^p / tau`."""

    def witness(self, x: torch.Tensor) -> torch.Tensor:
        return normalize(x)

    def distance_matrix(
        self, qw: torch.Tensor, kw: torch.Tensor, scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        return distance_matrix(qw, kw, scale)

    def distance(self, xw: torch.Tensor, yw: torch.Tensor) -> torch.Tensor:
        return dist(xw, yw)

    def distance_terms(self, qw: torch.Tensor, kw: torch.Tensor) -> list[DistanceTerm]:
        return [distance_term(qw, kw)]

    def distance_from_similarity(self, qw: torch.Tensor, similarity: torch.Tensor) -> torch.Tensor:
        return distance_from_cosine(similarity)

    def lift(self, w: torch.Tensor, role: Role) -> list[Lift]:
        check_role(role)
        return [Lift(w, "ip")]
