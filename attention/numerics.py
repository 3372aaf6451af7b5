"""Numerically careful helpers shared by every geometry.

Everything that needs a per-dtype guard lives here once: safe square roots and norms whose
gradients stay finite at zero, the inverse softplus used to initialise effective weights, and the
dtype used for accumulation when inputs arrive in half precision.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal, NamedTuple

import torch

_TINY = {torch.float64: 1e-300, torch.float32: 1e-30}
_BOUNDARY_EPS = {torch.float64: 1e-5, torch.float32: 1e-5}
_ARTANH_EPS = {torch.float64: 1e-15, torch.float32: 1e-7}


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype used for distances, softmax and accumulation: float32 for half inputs."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def tiny(dtype: torch.dtype) -> float:
    """Smallest value a squared norm is clamped to before a square root."""
    return _TINY[compute_dtype(dtype)]


def boundary_eps(dtype: torch.dtype) -> float:
    """Relative margin kept from the Poincare-ball boundary (docs/mathematics.md 1.3): 1e-5 in
    both dtypes (4e-3 in float32 made float32 attention differ from float64's by half)."""
    return _BOUNDARY_EPS[compute_dtype(dtype)]


def artanh_eps(dtype: torch.dtype) -> float:
    """How close to 1 the argument of artanh may come."""
    return _ARTANH_EPS[compute_dtype(dtype)]


_EXP_FLOOR = {torch.float64: -690.0, torch.float32: -64.0}


def exp_of_shifted_(shifted: torch.Tensor, may_be_masked: bool) -> torch.Tensor:
    """`exp` in place of logits already shifted by their row maximum (so <= 0), floored first at
    -64 (float32; -690 in float64): exp's underflow path (results below 1e-38) is slow on CPU,
    and so are products with subnormal weights, which made dense attention over sharply
    peaked rows many times slower (docs/benchmark-notes.md, "Measurements behind code
    choices"). A floored term weighs at most 1.6e-28 against the row maximum's 1, far below
    float32 resolution for any number of keys. Masked entries (-inf) stay exactly 0 when
    `may_be_masked`."""
    return _floored_exp_(shifted, may_be_masked, 1.0, torch.Tensor.exp_)


def exp2_of_shifted_(shifted: torch.Tensor, may_be_masked: bool) -> torch.Tensor:
    """`exp_of_shifted_` for logits in base-2 units: `2^x` in place, with the same floor in
    nats."""
    return _floored_exp_(shifted, may_be_masked, math.log2(math.e), torch.Tensor.exp2_)


def _floored_exp_(
    shifted: torch.Tensor,
    may_be_masked: bool,
    unit: float,
    exp_: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    blocked = torch.isneginf(shifted) if may_be_masked else None
    exp_(shifted.clamp_min_(_EXP_FLOOR[compute_dtype(shifted.dtype)] * unit))
    return shifted if blocked is None else shifted.masked_fill_(blocked, 0.0)


def safe_sqrt(x: torch.Tensor) -> torch.Tensor:
    """sqrt(max(x, tiny)): the value of sqrt for x >= 0, a zero gradient at and below 0."""
    return x.clamp_min(tiny(x.dtype)).sqrt()


def safe_norm(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """Euclidean norm along `dim` with a finite (zero) gradient at the zero vector."""
    return safe_sqrt(x.pow(2).sum(dim=dim, keepdim=keepdim))


def gram_squared_distance(
    x: torch.Tensor,
    y: torch.Tensor,
    x_weight: torch.Tensor | None = None,
    y_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """`w_x[i] w_y[j] ||x_i - y_j||^2` for `x (..., n, d)`, `y (..., m, d)` -> `(..., n, m)`,
    unclamped (rounding can leave tiny negative values). Weights `(..., n)`, `(..., m)` optional.

    One matrix product of the augmented vectors of `gram_operands` (the Gram expansion FAISS and
    cdist use, with the norms folded into the product): exact in float64, an absolute error of
    about eps * (|x|^2 + |y|^2) * w_x * w_y in float32.
    """
    xa, ya = gram_operands(x, y, x_weight, y_weight)
    return refine_near_pairs(xa @ ya.transpose(-1, -2), x, y, x_weight, y_weight)


NEAR_TOLERANCE = 1e4
"""`refine_near_pairs` recomputes a Gram-expanded squared distance below this many times its
rounding bound `eps (|x|^2 + |y|^2)`: beyond it the expansion keeps a relative accuracy of about
1e-4 or better, below it the direct difference is used."""
WEIGHT_SPREAD = 4.0
"""Column weights whose largest is more than this times their smallest are divided out before a
tile's rows are screened for near pairs (`NearScreens`)."""
REFINE_CHUNK = 1 << 18
"""Pairs recomputed per gather (bounds the memory of the worst case, every pair near)."""


def refine_near_pairs(
    squared: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    x_weight: torch.Tensor | None = None,
    y_weight: torch.Tensor | None = None,
    factor: float = 1.0,
) -> torch.Tensor:
    """`squared (..., n, m)`, the weighted squared distances `factor w_x[i] w_y[j] |x_i - y_j|^2`
    computed by a Gram expansion, with its near pairs recomputed from `x_i - y_j`.

    The expansion `|x|^2 + |y|^2 - 2<x, y>` has an absolute error of about
    `eps (|x|^2 + |y|^2)`: for nearly coincident points it is all error (a self-distance of
    0.12 at the float32 Poincare radius, gradients off by the size of the gradient itself).
    Entries below `NEAR_TOLERANCE` times that bound are recomputed directly (differentiably),
    so every entry keeps its relative accuracy; far pairs, almost all of them in attention, keep
    the single matrix product (docs/mathematics.md, "Fused dense attention").

    The work is the screen (`NearScreens`, per row and column), `screened_row_minima` (one
    pass over the matrix), `near_pairs` (only in rows that may hold one) and
    `with_pairs_recomputed`; a fused kernel may compute the minima in its own pass."""
    screens = NearScreens(x, y, x_weight, y_weight, factor, squared.dtype)
    screen = screens.tile(squared.shape, slice(None), slice(None))
    row_min = screened_row_minima(squared.detach(), screen.column_scale)
    index = near_pairs(squared.detach(), row_min, screen)
    if index is None:
        return squared
    return with_pairs_recomputed(squared, index, x, y, x_weight, y_weight, factor)


class NearScreen(NamedTuple):
    """How to find the rows of a squared-distance matrix `(..., n, m)` that may hold a near
    pair (`near_pairs`): a row may where its smallest entry times `column_scale (..., m)` (None:
    1) is at most `row_bound (..., n)`. An entry is near where it is at most
    `scale (x2[i] + y2[j]) x_weight[i] y_weight[j]`: squared norms and weights' sizes,
    `(..., n)` and `(..., m)`."""

    column_scale: torch.Tensor | None
    row_bound: torch.Tensor
    scale: float
    x2: torch.Tensor
    y2: torch.Tensor
    x_weight: torch.Tensor
    y_weight: torch.Tensor


class NearScreens:
    """The screens (`NearScreen`) of the entries below `NEAR_TOLERANCE` times their rounding
    bound `eps factor |w_x[i] w_y[j]| (|x_i|^2 + |y_j|^2)`, for the tiles of one matrix
    `(..., N, M)` of `factor w_x[i] w_y[j] |x_i - y_j|^2` (a whole matrix is one tile): a row's
    bound is its largest rounding bound over the tile's columns, after
    dividing out the column weights where they differ by more than `WEIGHT_SPREAD` (as a
    product with their reciprocals, a division costing several times more on CPUs; the bound is
    widened by a few roundings for the two results that may differ by one). The squared norms
    and weights' sizes are computed once, each column tile's maxima once, so a tile costs a few
    operations on its rows (O(n))."""

    @torch.no_grad()
    def __init__(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        x_weight: torch.Tensor | None,
        y_weight: torch.Tensor | None,
        factor: float,
        dtype: torch.dtype,
    ) -> None:
        self.eps = torch.finfo(dtype).eps
        self.scale = NEAR_TOLERANCE * self.eps * factor
        self.x2 = x.square().sum(-1)
        self.y2 = y.square().sum(-1)
        self.x_weight = torch.ones_like(self.x2) if x_weight is None else x_weight.abs()
        self.y_weight = torch.ones_like(self.y2) if y_weight is None else y_weight.abs()
        self._columns: dict[tuple, _ColumnTile] = {}

    @torch.no_grad()
    def tile(self, shape: torch.Size, rows: slice, cols: slice) -> NearScreen:
        """The screen of the tile `(..., rows, cols)`, of shape `shape (..., n, m)`."""
        batch, (n, m) = shape[:-2], shape[-2:]
        x2 = self.x2[..., rows].expand(*batch, n)
        xw = self.x_weight[..., rows].expand(*batch, n)
        columns = self._column_tile(batch, m, cols)
        row_bound = self.scale * xw * (x2 * columns.x2_factor + columns.offset) * columns.widen
        return NearScreen(
            columns.column_scale, row_bound, self.scale, x2, columns.y2, xw, columns.y_weight
        )

    def _column_tile(self, batch: torch.Size, m: int, cols: slice) -> _ColumnTile:
        """The column tile's part of the screen, computed on first use."""
        key = (cols.start, cols.stop, tuple(batch))
        if key not in self._columns:
            y2 = self.y2[..., cols].expand(*batch, m)
            yw = self.y_weight[..., cols].expand(*batch, m)
            if bool((yw.amax(-1) > WEIGHT_SPREAD * yw.amin(-1)).any()):
                # Column weights of very different sizes (conformal factors near the Poincare
                # boundary) would make every row a candidate: compare each row's smallest
                # s_ij / w_y[j] instead.
                largest = y2.amax(-1, keepdim=True)
                entry = _ColumnTile(y2, yw, yw.reciprocal(), 1.0, largest, 1 + 4 * self.eps)
            else:
                largest = (yw.amax(-1, keepdim=True), (yw * y2).amax(-1, keepdim=True))
                entry = _ColumnTile(y2, yw, None, *largest, 1.0)
            self._columns[key] = entry
        return self._columns[key]


class _ColumnTile(NamedTuple):
    """A column tile's part of `NearScreens.tile`: its squared norms and weights' sizes
    `(..., m)`, the column scale (None where the weights are even), and the row bound's terms,
    `scale w_x (x2 x2_factor + offset) widen`."""

    y2: torch.Tensor
    y_weight: torch.Tensor
    column_scale: torch.Tensor | None
    x2_factor: torch.Tensor | float
    offset: torch.Tensor
    widen: float


def screened_row_minima(squared: torch.Tensor, column_scale: torch.Tensor | None) -> torch.Tensor:
    """Each row's smallest entry of `squared` times `column_scale` (`NearScreen`)."""
    if column_scale is None:
        return squared.amin(-1)
    return (squared * column_scale.unsqueeze(-2)).amin(-1)


@torch.no_grad()
def near_pairs(
    squared: torch.Tensor, row_min: torch.Tensor, screen: NearScreen
) -> tuple[torch.Tensor, ...] | None:
    """The index of the entries of `squared (..., n, m)` below `NEAR_TOLERANCE` times their
    rounding bound (`NearScreens`), or None: only the rows whose screened minimum `row_min`
    is within `screen.row_bound` are compared entry by entry, so the usual case, no near pair,
    costs nothing beyond the minima."""
    rows = (row_min <= screen.row_bound).nonzero(as_tuple=True)
    if rows[0].numel() == 0:
        return None
    row_batch, row = rows[:-1], rows[-1]
    x2, y2, xw, yw = screen.x2, screen.y2, screen.x_weight, screen.y_weight
    bound = (x2[rows].unsqueeze(-1) + y2[row_batch]) * (xw[rows].unsqueeze(-1) * yw[row_batch])
    near, column = (squared[rows] <= screen.scale * bound).nonzero(as_tuple=True)
    if near.numel() == 0:
        return None
    return (*(part[near] for part in row_batch), row[near], column)


def with_pairs_recomputed(
    squared: torch.Tensor,
    index: tuple[torch.Tensor, ...],
    x: torch.Tensor,
    y: torch.Tensor,
    x_weight: torch.Tensor | None = None,
    y_weight: torch.Tensor | None = None,
    factor: float = 1.0,
) -> torch.Tensor:
    """`squared` with the entries at `index` recomputed as `factor w_x[i] w_y[j] |x_i - y_j|^2`
    (differentiably, a copy)."""
    batch = squared.shape[:-2]
    n, m = squared.shape[-2:]
    xs = x.expand(*batch, n, x.shape[-1])
    ys = y.expand(*batch, m, y.shape[-1])
    x_weights = None if x_weight is None else x_weight.expand(*batch, n)
    y_weights = None if y_weight is None else y_weight.expand(*batch, m)
    values = []
    for start in range(0, index[0].numel(), REFINE_CHUNK):
        part = tuple(i[start : start + REFINE_CHUNK] for i in index)
        rows, cols = (*part[:-2], part[-2]), (*part[:-2], part[-1])
        value = (xs[rows] - ys[cols]).square().sum(-1) * factor
        if x_weights is not None:
            value = value * x_weights[rows]
        if y_weights is not None:
            value = value * y_weights[cols]
        values.append(value)
    return squared.index_put(index, torch.cat(values).to(squared.dtype))


def gram_operands(
    x: torch.Tensor,
    y: torch.Tensor,
    x_weight: torch.Tensor | None = None,
    y_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Augmented vectors `w_x (-2x, |x|^2, 1)` `(..., n, d + 2)` and `w_y (y, 1, |y|^2)`
    `(..., m, d + 2)` whose inner products are the weighted squared distances."""
    x2 = x.square().sum(-1, keepdim=True)
    y2 = y.square().sum(-1, keepdim=True)
    xa = torch.cat([-2 * x, x2, torch.ones_like(x2)], dim=-1)
    ya = torch.cat([y, torch.ones_like(y2), y2], dim=-1)
    if x_weight is not None:
        xa = xa * x_weight.unsqueeze(-1)
    if y_weight is not None:
        ya = ya * y_weight.unsqueeze(-1)
    return xa, ya


def safe_sqrt_(x: torch.Tensor) -> torch.Tensor:
    """`safe_sqrt` in place (no gradient)."""
    return x.clamp_min_(tiny(x.dtype)).sqrt_()


def inverse_softplus(y: float) -> float:
    """The raw value whose softplus is `y` (> 0)."""
    if y <= 0:
        raise ValueError(f"inverse_softplus expects a positive value, got {y}")
    return y + math.log(-math.expm1(-y))


def acosh1p(v: torch.Tensor) -> torch.Tensor:
    """`arccosh(1 + v)` for `v >= 0` (negative rounding noise counts as 0), as
    `log1p(v + sqrt(v (v + 2)))`: full relative accuracy down to v = 0, a finite gradient there,
    and only vectorised kernels (`torch.acosh` and `torch.asinh` are not vectorised on CPU and
    cost 5-10x more; this is the cost that dominates dense hyperbolic attention)."""
    v = v.clamp_min(tiny(v.dtype))
    return torch.log1p(v + (v * (v + 2)).sqrt())


def acosh1p_(v: torch.Tensor) -> torch.Tensor:
    """`acosh1p` in place (no gradient; one temporary of the same size)."""
    v.clamp_min_(tiny(v.dtype))
    root = torch.add(v, 2).mul_(v).sqrt_()
    return v.add_(root).log1p_()


def arcsin_of_root_(v: torch.Tensor) -> torch.Tensor:
    """`arcsin(sqrt(clamp(v, tiny, 1)))` in place (no gradient): the sphere's half angle from its
    squared half chord, and the same map for positive curvature."""
    return v.clamp_(tiny(v.dtype), 1.0).sqrt_().asin_()


def clamp_to_zero_(x: torch.Tensor) -> torch.Tensor:
    """Negative rounding noise of a squared distance set to 0, in place."""
    return x.clamp_min_(0)


Stage = Literal["clamp_to_zero", "sqrt", "arcsin_of_root", "acosh1p", "square"]

STAGES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "clamp_to_zero": clamp_to_zero_,
    "sqrt": safe_sqrt_,
    "arcsin_of_root": arcsin_of_root_,
    "acosh1p": acosh1p_,
    "square": torch.Tensor.square_,
}
"""The element-wise stages a fused attention kernel applies to a matrix product, by name (the
CUDA kernel compiles the same names into its loop: attention/cuda_kernel.py)."""


def apply_stages_(x: torch.Tensor, stages: tuple[Stage, ...]) -> torch.Tensor:
    """Apply the named `STAGES` to `x` in place, in order."""
    for stage in stages:
        x = STAGES[stage](x)
    return x


def combine_terms_(
    products: list[torch.Tensor],
    stages: list[tuple[Stage, ...]],
    weights: list[torch.Tensor | float],
) -> torch.Tensor:
    """The logits `sum_i weights[i] * stages[i](products[i])` of a product form, computed in place
    in the products."""
    logits = None
    for product, term_stages, weight in zip(products, stages, weights, strict=True):
        value = apply_stages_(product, term_stages)
        if logits is None:
            logits = value if _is_one(weight) else value.mul_(weight)
        elif _is_one(weight):
            logits.add_(value)
        else:
            logits.addcmul_(value, torch.as_tensor(weight, dtype=value.dtype))
    return logits


def _is_one(weight: torch.Tensor | float) -> bool:
    return isinstance(weight, float | int) and weight == 1
