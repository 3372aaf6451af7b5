"""Graded attention (docs/mathematics.md 3, seed 001): a grade vector `g in R^d` per head weights
the features, `w_j = f(g_j)`, `M = diag(w)`; linear grading (LGT) `f(g) = |g| + 1`, exponential
(EGT) `f(g) = lambda^|g|` (`= lambda^g` for the seed's `g >= 0`; the absolute value keeps the
weights >= 1 and the gradient alive when a learnable grade crosses 0), `lambda >= 1`.

Variants (seed defs. 5.13, 5.22, 6.4, 6.14):
- `"scores"`: `logit = q^T M k / sqrt(d)`, one grade vector shared by the heads;
- `"queries_keys"`: `logit = (M q)^T (M k) / sqrt(d) = q^T M^2 k / sqrt(d)`, shared grades;
- `"multi_head"`: as `"queries_keys"` with a distinct grade vector per head (def. 5.22 (3));
- `"values"`: plain dot-product logits and `out_i = sum_j a_ij M v_j = M sum_j a_ij v_j`
  (applied by `output_map`; needs value dim = d).

Exact lift: every graded logit is an inner product of a graded query with the raw key
(`M q`, `M^2 q` or `q`, against `k`), scaled; keys lift to themselves, so one key index serves any
grades. Training aids (input grading, graded positional encoding, the grade regulariser, the
head-coordination loss, lambda annealing, the graded loss and the grade learning-rate bound) are
the functions below.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch import nn
from torch.nn import functional as F

from .geometry import Geometry, Lift, Role, ScoreTerm, check_role

GradeKind = Literal["linear", "exponential"]
GradedVariant = Literal["scores", "queries_keys", "multi_head", "values"]
VARIANTS = ("scores", "queries_keys", "multi_head", "values")


def grade_weights(grades: torch.Tensor, kind: GradeKind, lam: float = 2.0) -> torch.Tensor:
    """`f(g)`: `|g| + 1` (linear) or `lam^|g|` (exponential)."""
    if kind == "linear":
        return grades.abs() + 1
    if kind == "exponential":
        return torch.exp(grades.abs() * math.log(lam))
    raise ValueError(f"expected grade kind 'linear' or 'exponential', got {kind!r}")


def _check_lambda(lam: float) -> float:
    if not (math.isfinite(lam) and lam >= 1):
        raise ValueError(f"expected lambda >= 1, got {lam}")
    return float(lam)


class Graded(Geometry):
    """Graded dot-product attention.

    Args:
        kind: `"linear"` (LGT) or `"exponential"` (EGT).
        variant: `"scores"`, `"queries_keys"`, `"multi_head"` or `"values"` (module docstring).
        lam: EGT base `lambda >= 1` (`set_lambda` changes it, e.g. by `annealed_lambda`).
        grades: initial grades, one value, `d` values, or (multi_head) `heads x d` values;
            default 0 (all weights 1: plain dot-product attention).
        learn_grades: grades are a learnable parameter (default) or a fixed buffer.
        scale: logit scale, default `1/sqrt(d)`.
    """

    def __init__(
        self,
        dim: int,
        heads: int = 1,
        kind: GradeKind = "linear",
        variant: GradedVariant = "scores",
        lam: float = 2.0,
        grades: float | Sequence | None = None,
        learn_grades: bool = True,
        scale: float | None = None,
    ) -> None:
        super().__init__(dim, heads)
        if kind not in ("linear", "exponential"):
            raise ValueError(f"expected kind 'linear' or 'exponential', got {kind!r}")
        if variant not in VARIANTS:
            raise ValueError(f"expected variant one of {list(VARIANTS)}, got {variant!r}")
        self.kind, self.variant = kind, variant
        self.lam = _check_lambda(lam)
        self.scale = 1 / math.sqrt(dim) if scale is None else float(scale)
        rows = heads if variant == "multi_head" else 1
        initial = torch.zeros(rows, dim)
        if grades is not None:
            given = torch.as_tensor(grades, dtype=torch.get_default_dtype())
            if given.numel() not in (1, dim, rows * dim):
                raise ValueError(
                    f"expected 1, {dim} or {rows * dim} initial grades for variant "
                    f"{variant!r} with {heads} heads, got {given.numel()}"
                )
            if not bool(given.isfinite().all()):
                raise ValueError("expected finite grades")
            initial = initial + given.reshape(-1, dim) if given.numel() > 1 else initial + given
        if learn_grades:
            self.grades = nn.Parameter(initial)
        else:
            self.register_buffer("grades", initial)

    def set_lambda(self, lam: float) -> None:
        """Change the EGT base (lambda annealing)."""
        self.lam = _check_lambda(lam)

    def weights(self) -> torch.Tensor:
        """`w = f(g)`, `(1, d)` or (multi_head) `(heads, d)`."""
        return grade_weights(self.grades, self.kind, self.lam)

    def _broadcast(self, weights: torch.Tensor) -> torch.Tensor:
        """Weights shaped to multiply `(..., H, N, d)` (per head) or `(..., N, d)` (shared)."""
        return weights[0] if weights.shape[0] == 1 else weights.unsqueeze(-2)

    def graded_queries(self, qw: torch.Tensor) -> torch.Tensor:
        """Queries as the logit sees them against raw keys: `M q` (scores), `M^2 q`
        (queries_keys, multi_head) or `q` (values)."""
        if self.variant == "values":
            return qw
        weights = self._broadcast(self.weights()).to(qw.dtype)
        return qw * (weights if self.variant == "scores" else weights.square())

    def score(self, qw: torch.Tensor, kw: torch.Tensor) -> torch.Tensor:
        return (self.graded_queries(qw) @ kw.transpose(-1, -2)) * self.scale

    def score_terms(self, qw: torch.Tensor, kw: torch.Tensor) -> list[ScoreTerm]:
        return [ScoreTerm(self.graded_queries(qw), kw, (), self.scale)]

    def score_at(self, qw: torch.Tensor, kw: torch.Tensor) -> torch.Tensor:
        return (kw @ self.graded_queries(qw).unsqueeze(-1)).squeeze(-1) * self.scale

    def similarity_logits(
        self, qw: torch.Tensor, similarities: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        (similarity,) = similarities
        return [similarity * self.scale]

    def lift(self, w: torch.Tensor, role: Role) -> list[Lift]:
        check_role(role)
        if role == "key":
            return [Lift(w, "ip")]
        return [Lift(self.graded_queries(w), "ip")]

    def output_map(self, out: torch.Tensor) -> torch.Tensor:
        if self.variant != "values":
            return out
        if out.shape[-1] != self.dim:
            raise ValueError(
                f"graded values need value dim = d = {self.dim} (M v), got {out.shape[-1]}"
            )
        return out * self._broadcast(self.weights()).to(out.dtype)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, kind={self.kind}, variant={self.variant}, "
            f"lam={self.lam:g}, scale={self.scale:.6g}"
        )


# -- inputs and positions ---------------------------------------------------------------------


def grade_inputs(x: torch.Tensor, weights: torch.Tensor, normalise: bool = False) -> torch.Tensor:
    """Input grading `x -> M x`, or the normalised form `M x / ||M x||` (seed def. 5.19)."""
    graded = x * weights
    return F.normalize(graded, dim=-1) if normalise else graded


def sinusoidal_encoding(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """`Pe(t, 2i) = sin(t / 10000^(2i/d))`, `Pe(t, 2i+1) = cos(...)`: `(..., dim)`."""
    t = positions.to(torch.float64).unsqueeze(-1)
    pair = torch.arange(0, dim, 2, dtype=torch.float64)
    angles = t / torch.pow(10000.0, pair / dim)
    encoding = torch.zeros(*positions.shape, dim, dtype=torch.float64)
    encoding[..., 0::2] = angles.sin()
    encoding[..., 1::2] = angles.cos()[..., : dim // 2]
    return encoding.to(torch.get_default_dtype())


def graded_positional_encoding(
    positions: torch.Tensor,
    dim: int,
    alpha: float,
    kind: GradeKind = "linear",
    lam: float = 2.0,
) -> torch.Tensor:
    """Graded positional encoding: `(1 - alpha t) Pe(t, i)` (linear, seed def. 5.21;
    docs/mathematics.md 3) or `lam^(-alpha t) Pe(t, i)` (exponential, seed sec. 6.2), emphasising
    early positions."""
    if not alpha > 0:
        raise ValueError(f"expected alpha > 0, got {alpha}")
    t = positions.to(torch.get_default_dtype()).unsqueeze(-1)
    if kind == "linear":
        factor = 1 - alpha * t
    elif kind == "exponential":
        factor = torch.exp(-alpha * t * math.log(_check_lambda(lam)))
    else:
        raise ValueError(f"expected kind 'linear' or 'exponential', got {kind!r}")
    return factor * sinusoidal_encoding(positions, dim)


# -- training aids ----------------------------------------------------------------------------


def grade_regularizer(grades: torch.Tensor, gamma: float) -> torch.Tensor:
    """`gamma * ||g||^2` (summed over every grade vector given)."""
    return gamma * grades.square().sum()


def head_coordination_loss(grades: torch.Tensor) -> torch.Tensor:
    """`sum_i ||g_i - mean_j g_j||^2` over per-head grades `(heads, d)`."""
    if grades.dim() != 2:
        raise ValueError(f"expected per-head grades (heads, d), got {tuple(grades.shape)}")
    return (grades - grades.mean(0, keepdim=True)).square().sum()


def annealed_lambda(step: int, total_steps: int, lambda_max: float) -> float:
    """`lambda_t = 1 + (lambda_max - 1) t / T`, held at `lambda_max` after step T."""
    if total_steps <= 0:
        raise ValueError(f"expected total_steps > 0, got {total_steps}")
    if step < 0:
        raise ValueError(f"expected step >= 0, got {step}")
    _check_lambda(lambda_max)
    return 1 + (lambda_max - 1) * min(step, total_steps) / total_steps


def graded_loss(
    prediction: torch.Tensor,
    target: torch.Tensor,
    weights: torch.Tensor,
    base: Callable[..., torch.Tensor] = F.mse_loss,
) -> torch.Tensor:
    """`sum_i sum_k w_k l(y_hat_ik, y_ik)` for outputs `(..., d)` and feature weights `(d,)`
    (`lam^g_k` in EGT); `base` is an elementwise loss taking `reduction="none"`."""
    per_element = base(prediction, target, reduction="none")
    return (per_element * weights).sum()


def grade_learning_rate_bound(grades: torch.Tensor, kind: GradeKind, lam: float = 2.0) -> float:
    """The largest stable learning rate for the grades: `1 / (lam^g_max ln lam)` (EGT, seed
    prop. 7.5; infinite at lam = 1) or `1 / w_max` with `w_max = |g|_max + 1` (LGT, seed
    prop. 5.41). Use a learning rate strictly below it."""
    g_max = float(grades.detach().abs().max())
    if kind == "exponential":
        lam = _check_lambda(lam)
        return math.inf if lam == 1 else 1 / (lam**g_max * math.log(lam))
    if kind == "linear":
        return 1 / (g_max + 1)
    raise ValueError(f"expected kind 'linear' or 'exponential', got {kind!r}")
