"""The unit sphere `S^{n-1}` (SPEC 1.2): witness `x / max(||x||, eps)`, distance `arccos<a, b>`
computed as `2 atan2(||a - b||, ||a + b||)`, lift the witness with inner product."""

from __future__ import annotations

import torch

from .geometry import DistanceGeometry, Lift, Role, check_role
from .numerics import safe_norm, safe_sqrt

NORM_EPS = 1e-12


def normalize(x: torch.Tensor) -> torch.Tensor:
    """`x / max(||x||, eps)` along the last axis."""
    return x / safe_norm(x, keepdim=True).clamp_min(NORM_EPS)


def dist(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Great-circle distance between unit vectors paired along the last axis; exact and with
    finite gradients at 0 and pi (no arccos, no clamp)."""
    return 2 * torch.atan2(safe_norm(a - b), safe_norm(a + b))


def distance_matrix(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Great-circle distances `(..., n, m)` between unit vectors `a (..., n, d)`, `b (..., m, d)`
    from one Gram matrix `c`: `2 arcsin(||a - b|| / 2)` with `||a - b||^2 = 2 - 2c`, the same value
    as `2 atan2(||a - b||, ||a + b||)` with finite gradients, and vectorised on CPU."""
    half_chord = safe_sqrt(0.5 - 0.5 * (a @ b.transpose(-1, -2)))
    return 2 * torch.asin(half_chord.clamp_max(1.0))


class Sphere(DistanceGeometry):
    """Logits `-arccos(<q/|q|, k/|k|>)^p / tau`."""

    def witness(self, x: torch.Tensor) -> torch.Tensor:
        return normalize(x)

    def distance_matrix(self, qw: torch.Tensor, kw: torch.Tensor) -> torch.Tensor:
        return distance_matrix(qw, kw)

    def distance(self, xw: torch.Tensor, yw: torch.Tensor) -> torch.Tensor:
        return dist(xw, yw)

    def lift(self, w: torch.Tensor, role: Role) -> list[Lift]:
        check_role(role)
        return [Lift(w, "ip")]
