"""Hyperbolic cone attention (docs/mathematics.md 2, seed 002): shadow cones in the Poincare
half-space, infinite setting. A point is `u = (u_x, u_y)`, horizontal `u_x in R^{d-1}`, height `u_y
> 0`; the logit of a pair is `-gamma * h`, `h` the height of the root of the lowest cone holding
both (their least common ancestor). With `D = ||u_x - v_x||`:

- umbral (radius `r` around each point): `h = max(u_y, v_y, D / (2 sinh r) + (u_y + v_y) / 2)`;
- penumbral (horosphere light source at height `r`), `a = sqrt(r^2 - u_y^2)`,
  `b = sqrt(r^2 - v_y^2)`: a common cone exists iff `D <= a` or `(D - a)^2 + v_y^2 < r^2`; then
  `h = max(u_y, v_y, sqrt(r^2 - ((a + b - D) / 2)^2))`, else
  `h = sqrt(((D^2 + u_y^2 - v_y^2) / (2 D))^2 + v_y^2)` (the paper's `-gamma h`, not the public
  code's `-gamma h^2`).

Maps from R^d (the witness): umbral `psi(x) = (x_{:-1} e^t, e^t)`, penumbral
`xi(x) = (x_{:-1} h s, h s)` with `s = sigmoid(t)`, light-source height `h <= r` (points stay
below it), `t = x_d / height_scale`.

Cone scores are not a metric and no lift ranks keys exactly: `lift` gives *candidate* vectors
(`exact_lift = False`): horizontal coordinates and height scaled so that their L2 distance
approximates `h - (u_y + v_y) / 2` (umbral: `(x / (2 sinh r), y / 2)`; penumbral `(x, y)`), and
`band_coordinate` (log height) lets an index search keys of similar heights together, where that
approximation ranks well. Candidates are always re-scored exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from .geometry import DomainError, Geometry, Lift, Role, check_role, per_head
from .numerics import gram_squared_distance, safe_norm, safe_sqrt

ConeKind = Literal["penumbral", "umbral"]
DEFAULT_RADIUS = {"penumbral": 1.0, "umbral": 0.1}  # the authors' settings (seed 002 sec. 9)


def umbral_height(
    distance: torch.Tensor, u_y: torch.Tensor, v_y: torch.Tensor, r: torch.Tensor
) -> torch.Tensor:
    """Height of the lowest umbral cone holding u and v (broadcasting; `r` the ball radius)."""
    meet = distance / (2 * torch.sinh(r)) + (u_y + v_y) / 2
    return torch.maximum(torch.maximum(u_y, v_y), meet)


def penumbral_height(
    distance: torch.Tensor, u_y: torch.Tensor, v_y: torch.Tensor, r: torch.Tensor
) -> torch.Tensor:
    """Height of the lowest penumbral cone holding u and v, or of the lowest light source for
    which one exists (broadcasting; `r` the light-source height, heights below it)."""
    r2 = r * r
    a = safe_sqrt(r2 - u_y * u_y)
    b = safe_sqrt(r2 - v_y * v_y)
    exists = (distance <= a) | ((distance - a).square() + v_y * v_y < r2)
    # r^2 - ((a + b - D) / 2)^2 without cancellation: with r - a = u_y^2 / (r + a) (likewise b),
    # (a + b - D) / 2 = r - s and r^2 - (r - s)^2 = s (2r - s), for
    # s = (u_y^2 / (r + a) + v_y^2 / (r + b) + D) / 2 (docs/mathematics.md 2).
    s = (u_y * u_y / (r + a) + v_y * v_y / (r + b) + distance) / 2
    inside = safe_sqrt(s * (2 * r - s))
    inside = torch.maximum(torch.maximum(u_y, v_y), inside)
    # Outside, D > a >= 0; the placeholder keeps the unused branch (and its gradient) finite.
    apart = torch.where(exists, torch.ones_like(distance), distance)
    centre = (apart.square() + u_y * u_y - v_y * v_y) / (2 * apart)
    outside = safe_sqrt(centre.square() + v_y * v_y)
    return torch.where(exists, inside, outside)


def _per_head_values(value: float | Sequence[float], heads: int, name: str) -> torch.Tensor:
    values = torch.as_tensor(value, dtype=torch.get_default_dtype()).flatten()
    if values.numel() == 1:
        values = values.expand(heads).clone()
    if values.numel() != heads:
        raise ValueError(f"expected one {name} or one per head ({heads}), got {values.numel()}")
    if not bool((values > 0).all()) or not bool(values.isfinite().all()):
        raise ValueError(f"expected positive finite {name}, got {values.tolist()}")
    return values


class Cone(Geometry):
    """Cone attention, `kind` `"penumbral"` or `"umbral"`.

    Args:
        r: per-head cone parameter (one value or one per head): the light-source height
            (penumbral, default 1) or the ball radius (umbral, default 0.1).
        gamma: per-head logit scale (`-gamma * h`), learnable unless `learn_gamma=False`.
        light_height: penumbral map height `h` (default `r`; at most `r`).
        height_scale: divides the height coordinate `x_d` before the map (default 1; the
            authors' code uses `d` for umbral).
    """

    exact_lift = False

    def __init__(
        self,
        dim: int,
        heads: int = 1,
        kind: ConeKind = "penumbral",
        r: float | Sequence[float] | None = None,
        gamma: float | Sequence[float] = 1.0,
        learn_gamma: bool = True,
        light_height: float | Sequence[float] | None = None,
        height_scale: float = 1.0,
    ) -> None:
        super().__init__(dim, heads)
        if kind not in DEFAULT_RADIUS:
            raise ValueError(f"expected kind 'penumbral' or 'umbral', got {kind!r}")
        if dim < 2:
            raise ValueError(
                f"cone attention needs dim >= 2 (d - 1 horizontal + 1 height), got {dim}"
            )
        if not (height_scale > 0 and math.isfinite(height_scale)):
            raise ValueError(f"expected a positive height_scale, got {height_scale}")
        self.kind = kind
        self.height_scale = float(height_scale)
        radius = _per_head_values(DEFAULT_RADIUS[kind] if r is None else r, heads, "r")
        self.register_buffer("r", radius)
        if kind == "umbral":
            if light_height is not None:
                raise ValueError("light_height applies to penumbral cones only")
            self.register_buffer("light_height", None)
        else:
            height = (
                radius
                if light_height is None
                else _per_head_values(light_height, heads, "light_height")
            )
            if bool((height > radius).any()):
                raise ValueError(
                    f"expected light_height <= r (points must stay below the light source), got "
                    f"{height.tolist()} and r = {radius.tolist()}"
                )
            self.register_buffer("light_height", height)
        log_gamma = _per_head_values(gamma, heads, "gamma").log()
        if learn_gamma:
            self.log_gamma = nn.Parameter(log_gamma)
        else:
            self.register_buffer("log_gamma", log_gamma)

    @property
    def gamma(self) -> torch.Tensor:
        return self.log_gamma.exp()

    def witness(self, x: torch.Tensor) -> torch.Tensor:
        """`(x_h y, y)` with the height `y = exp(x_d / height_scale)` (umbral) or
        `light_height sigmoid(x_d / height_scale)` (penumbral). Raises `DomainError` where an
        umbral height overflows the dtype (squared witness norms must stay finite)."""
        t = x[..., -1:] / self.height_scale
        if self.kind == "umbral":
            y = t.exp()
        else:
            y = per_head(self.light_height.to(x.dtype)) * torch.sigmoid(t)
        witness = torch.cat([x[..., :-1] * y, y], dim=-1)
        if self.kind == "umbral" and not bool(torch.isfinite(witness.square().sum(-1)).all()):
            limit = 0.5 * math.log(torch.finfo(witness.dtype).max)
            raise DomainError(
                f"umbral cone: height coordinates x_d / height_scale up to "
                f"{float(t.detach().max()):.4g} overflow {witness.dtype} (witnesses are "
                f"x * exp(x_d / height_scale)); keep x_d / height_scale below about "
                f"{limit:.0f} minus the log of the other coordinates, or raise height_scale"
            )
        return witness

    def height(self, distance: torch.Tensor, u_y: torch.Tensor, v_y: torch.Tensor) -> torch.Tensor:
        """Cone-root heights from horizontal distances and the two heights (broadcasting)."""
        r = per_head(self.r.to(distance.dtype))
        if self.kind == "umbral":
            return umbral_height(distance, u_y, v_y, r)
        return penumbral_height(distance, u_y, v_y, r)

    def _scale(self, dtype: torch.dtype) -> torch.Tensor:
        return per_head(-self.gamma.to(dtype))

    def score(self, qw: torch.Tensor, kw: torch.Tensor) -> torch.Tensor:
        distance = safe_sqrt(gram_squared_distance(qw[..., :-1], kw[..., :-1]))
        heights = self.height(distance, qw[..., -1:], kw[..., -1].unsqueeze(-2))
        return heights * self._scale(heights.dtype)

    def score_at(self, qw: torch.Tensor, kw: torch.Tensor) -> torch.Tensor:
        distance = safe_norm(qw[..., :-1].unsqueeze(-2) - kw[..., :-1])
        heights = self.height(distance, qw[..., -1:], kw[..., -1])
        return heights * self._scale(heights.dtype)

    def lift(self, w: torch.Tensor, role: Role) -> list[Lift]:
        """Candidate vectors, not an exact lift (see the module docstring)."""
        check_role(role)
        if self.kind == "umbral":
            horizontal = w[..., :-1] / per_head(2 * torch.sinh(self.r.to(w.dtype)))
            return [Lift(torch.cat([horizontal, w[..., -1:] / 2], dim=-1), "l2")]
        return [Lift(w, "l2")]

    def band_coordinate(self, w: torch.Tensor) -> torch.Tensor:
        """Log height of witnesses `(..., N, d)` -> `(..., N)`: keys of one band have similar
        heights, where the candidate lift ranks them almost as the cone score does."""
        return w[..., -1].log()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, kind={self.kind}, height_scale={self.height_scale:g}"
