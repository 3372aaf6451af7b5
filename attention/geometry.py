"""The `Geometry` interface every attention mechanism implements, and its shared parts.

A geometry maps ambient vectors to witnesses, scores query witnesses against key witnesses (dense
or on gathered candidates), and knows an exact *lift* that turns "best score under this geometry"
into an ordinary L2 or inner-product search (docs/mathematics.md 1).

Shapes: inputs are `(..., N, d)` with heads as batch dimensions. A geometry built with `heads=H`
holds per-head parameters of shape `(H,)` and expects the head axis third from the end of dense
logits, i.e. inputs `(..., H, N, d)`; with `heads=1` its parameters broadcast against anything.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from .numerics import (
    NearScreens,
    Stage,
    combine_terms_,
    inverse_softplus,
    near_pairs,
    screened_row_minima,
    with_pairs_recomputed,
)

Metric = Literal["l2", "ip"]
Role = Literal["query", "key"]
_TERM_DTYPES = (torch.float32, torch.float64)
"""Dtypes `Geometry.score_from_terms` computes in (half precision goes through `score`)."""


class DomainError(ValueError):
    """Inputs outside the range a geometry can represent in their dtype (an overflow that would
    otherwise turn into NaN attention silently)."""


class Lift(NamedTuple):
    """Vectors whose L2 distance (`metric="l2"`, smaller is better) or inner product
    (`metric="ip"`, larger is better) ranks keys exactly as the geometry's score does."""

    vectors: torch.Tensor
    metric: Metric


class NearPairs(NamedTuple):
    """What a term's product is, for recomputing its near pairs: `factor w_x[i] w_y[j]
    |x_i - y_j|^2` (`numerics.refine_near_pairs`), with `x (..., nq, d)`, `y (..., nk, d)`,
    weights `(..., nq)`, `(..., nk)` or None."""

    x: torch.Tensor
    y: torch.Tensor
    x_weight: torch.Tensor | None = None
    y_weight: torch.Tensor | None = None
    factor: float = 1.0

    def rows(self, rows: slice, cols: slice) -> NearPairs:
        """The pairs of one tile."""
        return NearPairs(
            self.x[..., rows, :],
            self.y[..., cols, :],
            None if self.x_weight is None else self.x_weight[..., rows],
            None if self.y_weight is None else self.y_weight[..., cols],
            self.factor,
        )


class ScoreTerm(NamedTuple):
    """One term of a geometry's dense logits in product form (docs/mathematics.md, "Fused dense
    attention"): the logits are the sum over the geometry's terms of
    `weight * stages(queries @ keys^T)`.

    `queries (..., nq, e)` and `keys (..., nk, e)` are augmented witnesses computed once per call;
    `stages` names element-wise functions of `numerics.STAGES`, applied in order (none: the
    product itself); `weight` is a number or a per-head tensor broadcasting as in
    `Geometry.score`; `near`, for a product that is a weighted squared distance, says how to
    recompute its near pairs before the stages. Forward only: attention kernels recompute
    gradients through `score`."""

    queries: torch.Tensor
    keys: torch.Tensor
    stages: tuple[Stage, ...] = ()
    weight: torch.Tensor | float = 1.0
    near: NearPairs | None = None


class DistanceTerm(NamedTuple):
    """A distance matrix in product form: `factor * stages(queries @ keys^T)`, `factor` a number
    or per-head tensor broadcasting against the `(..., nq, nk)` distances."""

    queries: torch.Tensor
    keys: torch.Tensor
    stages: tuple[Stage, ...]
    factor: torch.Tensor | float = 1.0
    near: NearPairs | None = None


def distance_logit_term(term: DistanceTerm, weight: torch.Tensor, power: int) -> ScoreTerm:
    """The score term `weight * distance^power` of a distance term; `weight` (per head, usually
    `-1/tau` or `-w/tau`) and the distance's factor fold into one multiplication."""
    if power == 1:
        return ScoreTerm(term.queries, term.keys, term.stages, weight * term.factor, term.near)
    stages = (*term.stages, "square")
    return ScoreTerm(term.queries, term.keys, stages, weight * term.factor**2, term.near)


class TileLogits:
    """A geometry's logits of queries `(..., nq, d_w)` against keys `(..., nk, d_w)`, tile by
    tile, from its product form (`Geometry.score_terms`) made once for all of them: a tile costs
    one matrix product per term, its near pairs (found by screens also made once,
    `numerics.NearScreens`) and the stages and weights in place. Block-sparse attention scores
    many small tiles of the same queries and keys (tail attention's visited clusters), where
    making each tile's operands and screens anew cost more than its products. Without
    autograd only (`of`)."""

    def __init__(self, terms: list[ScoreTerm]) -> None:
        self.terms = terms
        self.screens = [
            None if term.near is None else NearScreens(*term.near, term.queries.dtype)
            for term in terms
        ]
        # The largest near-pair bound of any entry (`NearScreens`): a tile whose smallest
        # entry lies above it has no near pair, and skips its screen (most tiles).
        self.largest_bounds = [
            None if s is None else float(s.scale * _largest_near_bound(s)) for s in self.screens
        ]

    @classmethod
    def of(cls, geometry: Geometry, qw: torch.Tensor, kw: torch.Tensor) -> TileLogits | None:
        """The tiles of `geometry`'s logits of `qw` against `kw`; None where autograd would
        record them, the witnesses are not float32 or float64 (half precision goes through
        `score`), the geometry has no product form, or a term's products broadcast to another
        shape than the others' (its weights per head against witnesses without a head axis):
        the terms cannot be summed in place then."""
        if qw.dtype not in _TERM_DTYPES or kw.dtype != qw.dtype or records_grad(geometry, qw, kw):
            return None
        terms = geometry.score_terms(qw, kw)
        if terms is None:
            return None
        products = {torch.broadcast_shapes(t.queries.shape[:-2], t.keys.shape[:-2]) for t in terms}
        logits = {_term_batch_shape(term) for term in terms}
        return cls(terms) if len(products) == 1 and logits == products else None

    def tile(self, rows: slice, cols: slice) -> torch.Tensor:
        """The logits `(..., rows, cols)` as a new tensor: the same as `Geometry.score` of those
        queries and keys."""
        products = [
            term.queries[..., rows, :] @ term.keys[..., cols, :].transpose(-1, -2)
            for term in self.terms
        ]
        for i, (screens, term) in enumerate(zip(self.screens, self.terms, strict=True)):
            if screens is None or products[i].numel() == 0:
                continue
            if products[i].amin().item() > self.largest_bounds[i]:
                continue
            screen = screens.tile(products[i].shape, rows, cols)
            row_min = screened_row_minima(products[i], screen.column_scale)
            index = near_pairs(products[i], row_min, screen)
            if index is not None:
                near = term.near.rows(rows, cols)
                products[i] = with_pairs_recomputed(products[i], index, *near)
        return combine_terms_(
            products, [t.stages for t in self.terms], [t.weight for t in self.terms]
        )


def _largest_near_bound(screens: NearScreens) -> torch.Tensor:
    """An upper bound of `(x2[i] + y2[j]) x_weight[i] y_weight[j]` over every entry."""
    if screens.x2.numel() == 0 or screens.y2.numel() == 0:
        return screens.x2.new_zeros(())
    largest = screens.x2.amax() + screens.y2.amax()
    return largest * screens.x_weight.amax() * screens.y_weight.amax()


def _term_batch_shape(term: ScoreTerm) -> torch.Size:
    """The batch shape of a term's logits, its weight's broadcasting included."""
    batch = torch.broadcast_shapes(term.queries.shape[:-2], term.keys.shape[:-2])
    weight = torch.as_tensor(term.weight).shape
    return torch.broadcast_shapes((*batch, 1, 1), weight)[:-2]


def lift_similarity(query: Lift, key: Lift) -> torch.Tensor:
    """Dense similarities `(..., nq, nk)` of lifted queries and keys: the inner product
    (`"ip"`) or the negated squared L2 distance (`"l2"`); larger is better in both."""
    if query.metric != key.metric:
        raise ValueError(f"lifts of different metrics: {query.metric!r} and {key.metric!r}")
    inner = query.vectors @ key.vectors.transpose(-1, -2)
    if query.metric == "ip":
        return inner
    squared_q = query.vectors.square().sum(-1, keepdim=True)
    squared_k = key.vectors.square().sum(-1).unsqueeze(-2)
    return 2 * inner - squared_q - squared_k


def records_grad(module: nn.Module, *tensors: torch.Tensor) -> bool:
    """Whether autograd would record an operation on `tensors` and `module`'s parameters (a
    geometry's trainable temperature enters every logit)."""
    if not torch.is_grad_enabled():
        return False
    return any(t.requires_grad for t in tensors) or any(
        p.requires_grad for p in module.parameters()
    )


def per_head(param: torch.Tensor) -> torch.Tensor:
    """View a per-head parameter `(H,)` so it broadcasts against `(..., H, a, b)`.

    With one head the parameter becomes a scalar and broadcasts against any shape.
    """
    return param.reshape(()) if param.numel() == 1 else param.reshape(-1, 1, 1)


def check_attention_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, geometry: Geometry
) -> None:
    """Shapes and dtypes every attention function expects: floating `q (..., Nq, d)`,
    `k (..., Nk, d)`, `v (..., Nk, dv)` with `d` the geometry's dim."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() < 2:
            raise ValueError(f"expected {name} of shape (..., N, d), got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"expected a floating-point {name}, got {t.dtype}")
    if q.shape[-1] != geometry.dim or k.shape[-1] != geometry.dim:
        raise ValueError(
            f"expected q and k with last dimension {geometry.dim} (the geometry's dim), "
            f"got {q.shape[-1]} and {k.shape[-1]}"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"expected as many values as keys, got {v.shape[-2]} and {k.shape[-2]}")


def check_role(role: str) -> None:
    if role not in ("query", "key"):
        raise ValueError(f"expected role 'query' or 'key', got {role!r}")


class Geometry(nn.Module):
    """Base class. Subclasses implement `score`, `score_at` and `lift`; `witness` defaults to the
    identity.

    Args:
        dim: ambient (head) dimension `d` of queries and keys.
        heads: number of heads whose parameters this geometry holds.
    """

    exact_lift: bool = True
    """False when `lift` only proposes candidates: the score is not a function of one lift
    similarity (cone attention). Indexes then search `band_coordinate` bands, and cluster-tail
    estimation (`similarity_logits`) is not available."""

    def __init__(self, dim: int, heads: int = 1) -> None:
        super().__init__()
        if dim < 1:
            raise ValueError(f"expected dim >= 1, got {dim}")
        if heads < 1:
            raise ValueError(f"expected heads >= 1, got {heads}")
        self.dim = dim
        self.heads = heads

    def witness(self, x: torch.Tensor) -> torch.Tensor:
        """Map ambient vectors `(..., N, d)` to witnesses `(..., N, d_w)`."""
        return x

    def score(self, qw: torch.Tensor, kw: torch.Tensor) -> torch.Tensor:
        """Dense logits `(..., nq, nk)` from query witnesses `(..., nq, d_w)` and key witnesses
        `(..., nk, d_w)`, as a new tensor (attention kernels may overwrite it)."""
        raise NotImplementedError

    def score_terms(self, qw: torch.Tensor, kw: torch.Tensor) -> list[ScoreTerm] | None:
        """The dense logits of `score` in product form (`ScoreTerm`), for fused attention
        kernels; None (the default) when the geometry has none, and kernels call `score` per
        tile instead."""
        return None

    def score_from_terms(self, qw: torch.Tensor, kw: torch.Tensor) -> torch.Tensor | None:
        """`score` from its product form, where autograd records nothing (`TileLogits`, the
        whole matrix as one tile): one matrix product per term, then the element-wise stages
        in place, where `score` makes a new tensor per operation. The same logits; on a CPU
        each matrix-sized tensor costs a pass and, where the allocator hands back fresh memory,
        its page faults (docs/benchmark-notes.md, "Block logits from the product form"). None
        where `TileLogits.of` gives none; the caller then computes `score` as usual."""
        tiles = TileLogits.of(self, qw, kw)
        return None if tiles is None else tiles.tile(slice(None), slice(None))

    def score_at(self, qw: torch.Tensor, kw: torch.Tensor) -> torch.Tensor:
        """Logits `(..., nq, C)` of each query `(..., nq, d_w)` against its own gathered
        candidates `(..., nq, C, d_w)`."""
        raise NotImplementedError

    def lift(self, w: torch.Tensor, role: Role) -> list[Lift]:
        """Exact lifts of witnesses for an L2 or inner-product index. Queries and keys may lift
        differently (`role`). A product geometry returns one lift per component."""
        raise NotImplementedError

    def similarity_logits(
        self, qw: torch.Tensor, similarities: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """The logit as a function of the lift similarities (`lift_similarity`): given query
        witnesses `(..., nq, d_w)` and one similarity tensor `(..., nq, M)` per lift (any M
        values per query, e.g. one per key), the terms `(..., nq, M)`, one per lift, whose sum
        is the logit. Every logit depends on a key only through these similarities, which is
        what lets per-cluster statistics in lift space estimate unread keys (docs/mathematics.md 6,
        tail)."""
        raise NotImplementedError

    def band_coordinate(self, w: torch.Tensor) -> torch.Tensor | None:
        """For a geometry without an exact lift: a value per witness `(..., N)` such that keys
        with close values are ranked well by the candidate lift; None (the default) otherwise."""
        return None

    def output_map(self, out: torch.Tensor) -> torch.Tensor:
        """A linear map applied to the attention output `(..., nq, dv)`, the same for every
        key (graded values: `sum_j a_ij M v_j = M sum_j a_ij v_j`); the identity by default.
        Every attention function applies it once, after merging."""
        return out

    def logits(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Dense logits `(..., nq, nk)` from ambient queries and keys."""
        return self.score(self.witness(q), self.witness(k))

    def logits_at(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Logits `(..., nq, C)` from ambient queries `(..., nq, d)` and gathered ambient keys
        `(..., nq, C, d)`. The witness map sees the keys as `(..., nq * C, d)`, so per-head
        parameters keep their axis third from the end."""
        kw = self.witness(k.flatten(-3, -2)).unflatten(-2, k.shape[-3:-1])
        return self.score_at(self.witness(q), kw)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, heads={self.heads}"


class ScaledExpTemperature(nn.Module):
    """`tau = exp(lambda) * sqrt(d)` per head, `lambda` initialised to 0 (seed 004,
    docs/mathematics.md 1.3)."""

    def __init__(self, heads: int, dim: int) -> None:
        super().__init__()
        self.log_scale = nn.Parameter(torch.zeros(heads))
        self.sqrt_dim = math.sqrt(dim)

    def forward(self) -> torch.Tensor:
        return self.log_scale.exp() * self.sqrt_dim


class SoftplusTemperature(nn.Module):
    """`tau = softplus(raw)` per head, initialised to `init` (docs/mathematics.md 1.5)."""

    def __init__(self, heads: int, init: float = 1.0) -> None:
        super().__init__()
        self.raw = nn.Parameter(torch.full((heads,), inverse_softplus(init)))

    def forward(self) -> torch.Tensor:
        return F.softplus(self.raw)


TemperatureKind = Literal["scaled_exp", "softplus"]


def make_temperature(
    kind: TemperatureKind, heads: int, dim: int, init: float | None = None
) -> nn.Module:
    """Build a temperature module: `"scaled_exp"` (exp(lambda) sqrt(d); `init`, if given, sets
    the initial tau) or `"softplus"` (softplus(raw); `init` defaults to 1)."""
    if kind == "scaled_exp":
        module = ScaledExpTemperature(heads, dim)
        if init is not None:
            if init <= 0:
                raise ValueError(f"expected a positive initial temperature, got {init}")
            module.log_scale.data.fill_(math.log(init / math.sqrt(dim)))
        return module
    if kind == "softplus":
        return SoftplusTemperature(heads, 1.0 if init is None else init)
    raise ValueError(f"expected temperature 'scaled_exp' or 'softplus', got {kind!r}")


class DistanceGeometry(Geometry):
    """A geometry whose logits are `-distance^power / tau`.

    Subclasses implement `distance_matrix` (dense, Gram-based) and `distance` (pairwise along the
    last axis, exact formulas for gathered candidates).

    Args:
        power: 1 or 2, the exponent `p` of the distance in the logit.
        temperature: `"scaled_exp"` (default) or `"softplus"`.
        tau_init: initial temperature (default: sqrt(d) for scaled_exp, 1 for softplus).
    """

    def __init__(
        self,
        dim: int,
        heads: int = 1,
        power: int = 1,
        temperature: TemperatureKind = "scaled_exp",
        tau_init: float | None = None,
    ) -> None:
        super().__init__(dim, heads)
        if power not in (1, 2):
            raise ValueError(f"expected power 1 or 2, got {power}")
        self.power = power
        self.temperature = make_temperature(temperature, heads, dim, tau_init)

    def distance_matrix(
        self, qw: torch.Tensor, kw: torch.Tensor, scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Distances `(..., nq, nk)` between witnesses, multiplied by `scale` (a per-head factor
        folded into the computation's last multiplication) when given."""
        raise NotImplementedError

    def distance(self, xw: torch.Tensor, yw: torch.Tensor) -> torch.Tensor:
        """Distances between witnesses paired along the last axis (broadcasting)."""
        raise NotImplementedError

    def distance_terms(self, qw: torch.Tensor, kw: torch.Tensor) -> list[DistanceTerm] | None:
        """`distance_matrix` in product form, one term per summand; None when there is none."""
        return None

    def score_terms(self, qw: torch.Tensor, kw: torch.Tensor) -> list[ScoreTerm] | None:
        terms = self.distance_terms(qw, kw)
        if terms is None:
            return None
        weight = per_head(-1 / self.temperature()).to(qw.dtype)
        return [distance_logit_term(term, weight, self.power) for term in terms]

    def score(self, qw: torch.Tensor, kw: torch.Tensor) -> torch.Tensor:
        logits = self.score_from_terms(qw, kw)
        if logits is not None:
            return logits
        inverse_tau = per_head(1 / self.temperature())
        if self.power == 2:
            return self.distance_matrix(qw, kw, inverse_tau.sqrt()).square().neg()
        return self.distance_matrix(qw, kw, -inverse_tau)

    def score_at(self, qw: torch.Tensor, kw: torch.Tensor) -> torch.Tensor:
        dist = self.distance(qw.unsqueeze(-2), kw)
        if self.power == 2:
            dist = dist.square()
        return dist * per_head(-1 / self.temperature())

    def distance_from_similarity(self, qw: torch.Tensor, similarity: torch.Tensor) -> torch.Tensor:
        """Distances `(..., nq, M)` from the lift similarity `(..., nq, M)` to queries
        `(..., nq, d_w)` (values outside the similarity's range are clamped into it)."""
        raise NotImplementedError

    def similarity_logits(
        self, qw: torch.Tensor, similarities: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        (similarity,) = similarities
        dist = self.distance_from_similarity(qw, similarity)
        if self.power == 2:
            dist = dist.square()
        return [dist * per_head(-1 / self.temperature())]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, power={self.power}"
