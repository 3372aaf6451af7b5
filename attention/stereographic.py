"""kappa-stereographic model: one family for every curvature, continuous across kappa = 0
(docs/mathematics.md 1.3, after seed 004; conventions of geoopt's `Stereographic` manifold).

Pure tensor functions first, then the `KappaStereographic` geometry that holds a per-head
curvature. `kappa` arguments broadcast against the norms the functions take: against `x[..., :1]`
for the maps that return points (`mobius_add`, `expmap0`, `logmap0`, `project`), and against
the result for the scalar functions (`dist`, `distance_matrix`).

kappa < 0 is the Poincare ball of radius 1/sqrt(-kappa), kappa > 0 the stereographic projection
of the sphere of radius 1/sqrt(kappa), kappa = 0 Euclidean space with distance 2 ||x - y||.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from .geometry import (
    DistanceGeometry,
    DistanceTerm,
    Lift,
    NearPairs,
    Role,
    TemperatureKind,
    check_role,
    per_head,
)
from .numerics import (
    acosh1p,
    artanh_eps,
    boundary_eps,
    gram_operands,
    refine_near_pairs,
    safe_norm,
    safe_sqrt,
    tiny,
)

SERIES_LIMIT = 1e-2
"""|kappa| x^2 below which the Taylor series in kappa is used (truncation error ~ 1e-12)."""

Branch = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _by_curvature(
    x: torch.Tensor, k: torch.Tensor, series: Branch, negative: Branch, positive: Branch
) -> torch.Tensor:
    """Evaluate a curvature-indexed function `f_k(x)` element by element.

    `series(x, k)` is used where |k| x^2 < SERIES_LIMIT (always at k = 0), `negative(x, s)` and
    `positive(x, s)` with `s = sqrt(|k|)` elsewhere. Every branch sees harmless inputs where it is
    not selected, so no NaN or inf leaks into gradients through `torch.where`. When no gradient
    with respect to `k` is needed and `k` has one strict sign everywhere, only the closed form runs
    (exact in value; the series exists for d/dk near 0 and for k = 0 itself).
    """
    k = torch.as_tensor(k, dtype=x.dtype, device=x.device)
    sign = _fixed_sign(k)
    if sign < 0:
        return negative(x, (-k).sqrt())
    if sign > 0:
        return positive(x, k.sqrt())
    x, k = torch.broadcast_tensors(x, k)
    small = (k * x.square()).abs() < SERIES_LIMIT
    neg = (k < 0) & ~small
    pos = (k > 0) & ~small
    zeros = torch.zeros_like(x)
    ones = torch.ones_like(k)
    value = series(torch.where(small, x, zeros), torch.where(small, k, zeros))
    value_neg = negative(torch.where(neg, x, zeros), torch.where(neg, -k, ones).sqrt())
    value_pos = positive(torch.where(pos, x, zeros), torch.where(pos, k, ones).sqrt())
    return torch.where(neg, value_neg, torch.where(pos, value_pos, value))


def _fixed_sign(k: torch.Tensor) -> int:
    """-1 or 1 when `k` has that strict sign everywhere and needs no gradient (closed forms are
    then exact), else 0 (element-wise branches with the series near 0)."""
    if k.requires_grad and torch.is_grad_enabled():
        return 0
    if bool((k < 0).all()):
        return -1
    return 1 if bool((k > 0).all()) else 0


def _horner(z: torch.Tensor, coefficients: Sequence[float]) -> torch.Tensor:
    result = torch.full_like(z, coefficients[-1])
    for c in reversed(coefficients[:-1]):
        result = result * z + c
    return result


_TAN_SERIES = (1.0, 1 / 3, 2 / 15, 17 / 315, 62 / 2835, 1382 / 155925)
_ARTAN_SERIES = (1.0, -1 / 3, 1 / 5, -1 / 7, 1 / 9, -1 / 11)
_ARSIN_SERIES = (1.0, 1 / 6, 3 / 40, 5 / 112, 35 / 1152, 63 / 2816)


def tan_k(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """tanh(sqrt(-k) x)/sqrt(-k) (k<0), x (k=0), tan(sqrt(k) x)/sqrt(k) (k>0)."""
    return _by_curvature(
        x,
        k,
        lambda x, k: x * _horner(k * x.square(), _TAN_SERIES),
        lambda x, s: torch.tanh(s * x) / s,
        lambda x, s: torch.tan(s * x) / s,
    )


def artan_k(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The inverse of `tan_k`."""
    limit = 1 - artanh_eps(x.dtype)
    return _by_curvature(
        x,
        k,
        lambda x, k: x * _horner(k * x.square(), _ARTAN_SERIES),
        lambda x, s: torch.atanh((s * x).clamp(-limit, limit)) / s,
        lambda x, s: torch.atan(s * x) / s,
    )


def arsin_k(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """arsinh(sqrt(-k) x)/sqrt(-k) (k<0), x (k=0), arcsin(sqrt(k) x)/sqrt(k) (k>0)."""
    return _by_curvature(
        x,
        k,
        lambda x, k: x * _horner(k * x.square(), _ARSIN_SERIES),
        lambda x, s: torch.asinh(s * x) / s,
        lambda x, s: torch.asin((s * x).clamp(-1.0, 1.0)) / s,
    )


def mobius_add(x: torch.Tensor, y: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """`x (+)_k y` along the last axis (docs/mathematics.md 1.3)."""
    x2 = x.square().sum(-1, keepdim=True)
    y2 = y.square().sum(-1, keepdim=True)
    xy = (x * y).sum(-1, keepdim=True)
    numerator = (1 - 2 * k * xy - k * y2) * x + (1 + k * x2) * y
    denominator = 1 - 2 * k * xy + k.square() * x2 * y2
    return numerator / denominator.clamp_min(tiny(x.dtype))


def project(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Clip norms to (1 - eps)/sqrt(-k) where k < 0 (eps 1e-5, `numerics.boundary_eps`); identity
    where k >= 0."""
    k = torch.as_tensor(k, dtype=x.dtype, device=x.device)
    norm = safe_norm(x, keepdim=True)
    negative = k < 0
    max_norm = (1 - boundary_eps(x.dtype)) / torch.where(negative, -k, torch.ones_like(k)).sqrt()
    outside = negative & (norm > max_norm)
    return torch.where(outside, x * (max_norm / norm), x)


def expmap0(u: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Exponential map at the origin: `tan_k(||u||) u / ||u||`."""
    norm = safe_norm(u, keepdim=True)
    return u * (tan_k(norm, k) / norm)


def expmap(x: torch.Tensor, u: torch.Tensor, k: float | torch.Tensor) -> torch.Tensor:
    """The exponential map at `x` of tangent vectors `u`:
    `x (+)_k tan_k(lambda_x ||u|| / 2) u / ||u||`, `lambda_x = 2 / (1 + k ||x||^2)`."""
    k = torch.as_tensor(k, dtype=x.dtype, device=x.device)
    conformal = 2 / (1 + k * x.square().sum(-1, keepdim=True))
    norm = safe_norm(u, keepdim=True)
    return mobius_add(x, tan_k(conformal * norm / 2, k) * (u / norm), k)


def logmap0(y: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Logarithmic map at the origin: `artan_k(||y||) y / ||y||`."""
    norm = safe_norm(y, keepdim=True)
    return y * (artan_k(norm, k) / norm)


def dist(x: torch.Tensor, y: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Geodesic distance between points paired along the last axis.

    Computed as `2 arsin_k(||x - y|| / sqrt((1 + k|x|^2)(1 + k|y|^2)))`, which equals
    `2 artan_k(||(-x) (+)_k y||)` (docs/mathematics.md 1.3) and keeps full relative accuracy for
    close points because the difference is taken before any cancellation.
    """
    chord = safe_norm(x - y) * _conformal_factor(x, k) * _conformal_factor(y, k)
    return 2 * arsin_k(chord, k)


def distance_matrix(
    x: torch.Tensor, y: torch.Tensor, k: torch.Tensor, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """`scale *` distances `(..., n, m)` between `x (..., n, d)` and `y (..., m, d)` from one
    matrix product: the squared conformal chord `|x - y|^2 / ((1 + k|x|^2)(1 + k|y|^2))` is a
    weighted squared distance, with the curvature factor of `_distance_from_weighted_chord`
    folded into the key weights (no extra pass over the result). `k` and `scale` broadcast
    against the `(..., n, m)` result (per head: `(H, 1, 1)`)."""
    k = torch.as_tensor(k, dtype=x.dtype, device=x.device)
    sign = _fixed_sign(k)
    weights = _chord_weights(x, y, k, sign)
    x_aug, y_aug = gram_operands(x, y, *weights)
    chord = refine_near_pairs(x_aug @ y_aug.transpose(-1, -2), x, y, *weights)
    return _distance_from_weighted_chord(chord, k, sign, scale)


def _chord_weights(
    x: torch.Tensor, y: torch.Tensor, k: torch.Tensor, sign: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column weights `(..., n)`, `(..., m)` of the squared distances whose products are
    `_chord_weight(k, sign)` times the squared conformal chords."""
    row_k = _as_column(k)
    x_weight = _conformal_factor(x, row_k).square()
    y_weight = _conformal_factor(y, row_k).square() * _chord_weight(row_k, sign)
    return x_weight, y_weight


def _weighted_chord_operands(
    x: torch.Tensor, y: torch.Tensor, k: torch.Tensor, sign: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Augmented vectors whose inner products are `_chord_weight(k, sign)` times the squared
    conformal chords."""
    return gram_operands(x, y, *_chord_weights(x, y, k, sign))


def distance_term(x: torch.Tensor, y: torch.Tensor, k: torch.Tensor) -> DistanceTerm | None:
    """`distance_matrix(x, y, k)` in product form, for a curvature with one strict sign or zero
    everywhere and no gradient in `k`; None otherwise (mixed signs need the element-wise
    `arsin_k`)."""
    k = torch.as_tensor(k, dtype=x.dtype, device=x.device)
    sign = _fixed_sign(k)
    if sign == 0 and ((k.requires_grad and torch.is_grad_enabled()) or bool((k != 0).any())):
        return None
    weights = _chord_weights(x, y, k, sign)
    operands = gram_operands(x, y, *weights)
    near = NearPairs(x, y, *weights)
    if sign < 0:
        return DistanceTerm(*operands, ("acosh1p",), 1 / (-k).sqrt(), near)
    if sign > 0:
        return DistanceTerm(*operands, ("arcsin_of_root",), 2 / k.sqrt(), near)
    return DistanceTerm(*operands, ("sqrt",), 2.0, near)


def distance_from_squared_chord(
    squared_chord: torch.Tensor, k: torch.Tensor, scale: torch.Tensor | float | None = None
) -> torch.Tensor:
    """`scale * 2 arsin_k(chord)` from the squared conformal chord (negative rounding noise
    counts as 0); `k` broadcasts against it."""
    k = torch.as_tensor(k, dtype=squared_chord.dtype, device=squared_chord.device)
    sign = _fixed_sign(k)
    return _distance_from_weighted_chord(squared_chord * _chord_weight(k, sign), k, sign, scale)


def _chord_weight(k: torch.Tensor, sign: int) -> torch.Tensor | float:
    """The factor `_distance_from_weighted_chord` expects on the squared chord: `2|k|` (k < 0),
    `k` (k > 0), 1 (mixed signs, or a gradient in k)."""
    if sign < 0:
        return -2 * k
    return k if sign > 0 else 1.0


def _distance_from_weighted_chord(
    v: torch.Tensor, k: torch.Tensor, sign: int, scale: torch.Tensor | float | None
) -> torch.Tensor:
    """`scale * 2 arsin_k(chord)` from `v = _chord_weight(k, sign) * chord^2`.

    For a curvature of one strict sign that needs no gradient the closed form runs directly on
    `v`: `arccosh(1 + v)/sqrt(-k)` (docs/mathematics.md 1.4's form, v = 2|k| chord^2) for k < 0,
    `2 arcsin(sqrt(v))/sqrt(k)` (v = k chord^2) for k > 0 (the dense-attention hot path);
    otherwise the element-wise `arsin_k` with its series near 0.
    """
    factor = 1.0 if scale is None else scale
    if sign < 0:
        return acosh1p(v) * (factor / (-k).sqrt())
    if sign > 0:
        return torch.asin(safe_sqrt(v).clamp_max(1.0)) * (2 * factor / k.sqrt())
    return arsin_k(safe_sqrt(v), k) * (2 * factor)


def _as_column(k: torch.Tensor) -> torch.Tensor:
    """Per-head `k` shaped `(H, 1, 1)` for an `(..., H, n, m)` result, reshaped to `(H, 1)` for the
    `(..., H, n)` row norms; scalars unchanged."""
    k = torch.as_tensor(k)
    return k.squeeze(-1) if k.dim() >= 2 else k


def _conformal_factor(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """`1/sqrt(1 + k |x|^2)` along the last axis (no keepdim)."""
    return (1 + k * x.square().sum(-1)).clamp_min(tiny(x.dtype)).rsqrt()


def chord_lift(w: torch.Tensor, k: torch.Tensor, role: Role) -> Lift:
    """Exact inner-product lift for every curvature, including k = 0 and mixed signs per head.

    With `c = 1 + k|p|^2`: queries `(-(1 - k|q|^2)/c_q, 2q/c_q)`, keys `(2|p|^2/c_p, 2p/c_p)`.
    Their inner product is `2|q|^2/c_q - 2 chord(q, p)^2`, so ranking keys by it descending is
    ranking by `d_k` ascending. It is the hyperboloid (k<0) or sphere (k>0) lift of
    docs/mathematics.md 1.3 with the constant 1 removed, which keeps it well conditioned as k -> 0.
    `k` broadcasts against `w[..., :1]`.
    """
    check_role(role)
    squared = w.square().sum(-1, keepdim=True)
    c = 1 + k * squared
    first = -(1 - k * squared) / c if role == "query" else 2 * squared / c
    return Lift(torch.cat([first, 2 * w / c], dim=-1), "ip")


def squared_chord_from_similarity(
    qw: torch.Tensor, similarity: torch.Tensor, k: torch.Tensor
) -> torch.Tensor:
    """The squared conformal chord from the `chord_lift` inner product `2|q|^2/c_q - 2 chord^2`
    with queries `(..., nq, d)` and similarities `(..., nq, M)`; `k` broadcasts against the
    queries' `(..., nq, 1)` norms."""
    squared = qw.square().sum(-1, keepdim=True)
    return (squared / (1 + k * squared) - similarity / 2).clamp_min(0)


MAX_CURVATURE = 1e6
"""The largest |kappa| accepted (a ball or sphere of radius 1e-3); beyond it float32 witnesses
and lifts overflow."""


def _curvature_tensor(kappa: float | Sequence[float] | torch.Tensor, heads: int) -> torch.Tensor:
    value = torch.as_tensor(kappa, dtype=torch.get_default_dtype()).flatten()
    if not bool(torch.isfinite(value).all()) or bool((value.abs() > MAX_CURVATURE).any()):
        raise ValueError(
            f"kappa: expected finite curvatures with |kappa| <= {MAX_CURVATURE:g}, got {kappa!r}"
        )
    if value.numel() == 1:
        return value.expand(heads).clone()
    if value.numel() != heads:
        raise ValueError(f"expected 1 or {heads} curvature values, got {value.numel()}")
    return value.clone()


class KappaStereographic(DistanceGeometry):
    """Unified-curvature attention (seed 004): witnesses `project(expmap0(x))`, logits
    `-d_k(q, k)^p / tau` with a per-head curvature that may be learned across 0.

    Args:
        kappa: initial curvature, one value or one per head.
        learnable_kappa: make the curvature a parameter.
    """

    def __init__(
        self,
        dim: int,
        heads: int = 1,
        kappa: float | Sequence[float] | torch.Tensor = 0.0,
        learnable_kappa: bool = True,
        power: int = 1,
        temperature: TemperatureKind = "scaled_exp",
        tau_init: float | None = None,
    ) -> None:
        super().__init__(dim, heads, power, temperature, tau_init)
        value = _curvature_tensor(kappa, heads)
        if learnable_kappa:
            self.kappa = nn.Parameter(value)
        else:
            self.register_buffer("kappa", value)

    def curvature(self) -> torch.Tensor:
        """The per-head curvature, shape `(heads,)`."""
        return self.kappa

    def _k(self, like: torch.Tensor) -> torch.Tensor:
        return per_head(self.kappa).to(like.dtype)

    def witness(self, x: torch.Tensor) -> torch.Tensor:
        k = self._k(x)
        return project(expmap0(x, k), k)

    def distance_matrix(
        self, qw: torch.Tensor, kw: torch.Tensor, scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        return distance_matrix(qw, kw, self._k(qw), scale)

    def distance(self, xw: torch.Tensor, yw: torch.Tensor) -> torch.Tensor:
        return dist(xw, yw, self._k(xw))

    def distance_terms(self, qw: torch.Tensor, kw: torch.Tensor) -> list[DistanceTerm] | None:
        term = distance_term(qw, kw, self._k(qw))
        return None if term is None else [term]

    def distance_from_similarity(self, qw: torch.Tensor, similarity: torch.Tensor) -> torch.Tensor:
        k = self._k(qw)
        return distance_from_squared_chord(squared_chord_from_similarity(qw, similarity, k), k)

    def lift(self, w: torch.Tensor, role: Role) -> list[Lift]:
        return [chord_lift(w, self._k(w), role)]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, learnable_kappa={isinstance(self.kappa, nn.Parameter)}"
