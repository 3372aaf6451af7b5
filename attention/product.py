"""Geometric REWA: the product manifold `R^m x S^n x B^p` (docs/mathematics.md 1.5; seed 000,
sec. 4).

Witness `w = (w_R, w_S, w_H)` from three linear maps followed by the identity, the sphere
normalisation and `project(expmap0(.))` into the unit Poincare ball.
`d_M = a d_R^p + b d_S^p + c d_H^p` (`p = 1` by default, the formula of docs/mathematics.md; `p = 2`
gives the squared geodesic distance of the weighted product metric), logits `-d_M / tau`.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from . import euclidean, sphere, stereographic
from .geometry import (
    DistanceTerm,
    Geometry,
    Lift,
    Role,
    ScoreTerm,
    TemperatureKind,
    check_role,
    distance_logit_term,
    make_temperature,
    per_head,
)
from .numerics import inverse_softplus, safe_sqrt

COMPONENTS = ("euclidean", "sphere", "hyperbolic")
KAPPA_EFF_NOTE = "heuristic (seed 000 Cor. 4.8): (c - b) / (a + b + c)"


def _component_distance_matrix(
    name: str, x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    if name == "euclidean":
        return euclidean.distance_matrix(x, y, scale)
    if name == "sphere":
        return sphere.distance_matrix(x, y, scale)
    return stereographic.distance_matrix(x, y, torch.tensor(-1.0, dtype=x.dtype), scale)


def _component_distance_term(name: str, x: torch.Tensor, y: torch.Tensor) -> DistanceTerm:
    if name == "euclidean":
        return euclidean.distance_term(x, y)
    if name == "sphere":
        return sphere.distance_term(x, y)
    return stereographic.distance_term(x, y, torch.tensor(-1.0, dtype=x.dtype))


def _component_distance(name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if name == "euclidean":
        return euclidean.dist(x, y)
    if name == "sphere":
        return sphere.dist(x, y)
    return stereographic.dist(x, y, torch.tensor(-1.0, dtype=x.dtype))


class ProductGeometry(Geometry):
    """Product-manifold attention with learned non-negative weights `(a, b, c) = softplus(raw)`.

    Args:
        dim: ambient head dimension `d`.
        euclidean_dim, sphere_dim, hyperbolic_dim: `m`, `n`, `p`; any may be 0 (component absent).
            Defaults: d/4, d/2 and the rest.
        power: 1 (docs/mathematics.md 1.5) or 2, the exponent of each component distance.
        temperature: `"softplus"` (default, docs/mathematics.md 1.5) or `"scaled_exp"` (1.3).
        tau_init: initial temperature (default 1 for softplus, sqrt(d) for scaled_exp).

    The raw weights start where the effective weights are `(1/sqrt(m), 1, 1/sqrt(p))`.
    """

    def __init__(
        self,
        dim: int,
        heads: int = 1,
        euclidean_dim: int | None = None,
        sphere_dim: int | None = None,
        hyperbolic_dim: int | None = None,
        power: int = 1,
        temperature: TemperatureKind = "softplus",
        tau_init: float | None = None,
    ) -> None:
        super().__init__(dim, heads)
        m = dim // 4 if euclidean_dim is None else euclidean_dim
        n = dim // 2 if sphere_dim is None else sphere_dim
        p = dim - dim // 4 - dim // 2 if hyperbolic_dim is None else hyperbolic_dim
        if min(m, n, p) < 0 or m + n + p == 0:
            raise ValueError(
                f"expected non-negative component dims with a positive sum, got (m, n, p) = "
                f"({m}, {n}, {p})"
            )
        if power not in (1, 2):
            raise ValueError(f"expected power 1 or 2, got {power}")
        self.sizes = {"euclidean": m, "sphere": n, "hyperbolic": p}
        self.power = power
        self.maps = nn.ParameterDict(
            {
                name: nn.Parameter(torch.randn(heads, dim, size) / math.sqrt(dim))
                for name, size in self.sizes.items()
                if size > 0
            }
        )
        initial = {
            "euclidean": 1 / math.sqrt(max(m, 1)),
            "sphere": 1.0,
            "hyperbolic": 1 / math.sqrt(max(p, 1)),
        }
        self.raw_weights = nn.ParameterDict(
            {
                name: nn.Parameter(torch.full((heads,), inverse_softplus(initial[name])))
                for name in self.present
            }
        )
        self.temperature = make_temperature(temperature, heads, dim, tau_init)

    @property
    def present(self) -> list[str]:
        """Names of the components with a positive dimension, in witness order."""
        return [name for name in COMPONENTS if self.sizes[name] > 0]

    @property
    def witness_dim(self) -> int:
        return sum(self.sizes.values())

    def _map(self, x: torch.Tensor, name: str) -> torch.Tensor:
        weight = self.maps[name].to(x.dtype)
        return x @ weight[0] if self.heads == 1 else x @ weight

    def witness(self, x: torch.Tensor) -> torch.Tensor:
        parts = []
        for name in self.present:
            z = self._map(x, name)
            if name == "sphere":
                z = sphere.normalize(z)
            elif name == "hyperbolic":
                k = torch.tensor(-1.0, dtype=z.dtype, device=z.device)
                z = stereographic.project(stereographic.expmap0(z, k), k)
            parts.append(z)
        return torch.cat(parts, dim=-1)

    def split(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """The component witnesses of `w`, by name."""
        sizes = [self.sizes[name] for name in self.present]
        return dict(zip(self.present, w[..., : sum(sizes)].split(sizes, dim=-1), strict=True))

    def weights(self) -> dict[str, torch.Tensor]:
        """Effective per-head weights `a, b, c` (zero for an absent component)."""
        device = next(iter(self.raw_weights.values())).device
        zero = torch.zeros(self.heads, device=device)
        return {
            name: F.softplus(self.raw_weights[name]) if name in self.raw_weights else zero
            for name in COMPONENTS
        }

    def score(self, qw: torch.Tensor, kw: torch.Tensor) -> torch.Tensor:
        """Each component's weight and the temperature fold into that component's last
        multiplication, `-(w/tau) d` (p = 1) or `-(sqrt(w/tau) d)^2` (p = 2), then a sum
        (without autograd, from the product form: `Geometry.score_from_terms`)."""
        logits = self.score_from_terms(qw, kw)
        if logits is not None:
            return logits
        q_parts, k_parts = self.split(qw), self.split(kw)
        weights = self._weights_for(qw)
        inverse_tau = per_head(1 / self.temperature())
        total = None
        for name in self.present:
            if self.power == 1:
                scale = -weights[name] * inverse_tau
            else:
                scale = safe_sqrt(weights[name] * inverse_tau)
            term = _component_distance_matrix(name, q_parts[name], k_parts[name], scale)
            if self.power == 2:
                term = term.square().neg()
            total = term if total is None else total + term
        return total

    def score_terms(self, qw: torch.Tensor, kw: torch.Tensor) -> list[ScoreTerm]:
        """One term per component, `-(w/tau) d^p`."""
        q_parts, k_parts = self.split(qw), self.split(kw)
        weights = self._weights_for(qw)
        inverse_tau = per_head(1 / self.temperature()).to(qw.dtype)
        return [
            distance_logit_term(
                _component_distance_term(name, q_parts[name], k_parts[name]),
                -weights[name] * inverse_tau,
                self.power,
            )
            for name in self.present
        ]

    def score_at(self, qw: torch.Tensor, kw: torch.Tensor) -> torch.Tensor:
        q_parts, k_parts = self.split(qw.unsqueeze(-2)), self.split(kw)
        weights = self._weights_for(qw)
        total = 0
        for name in self.present:
            value = _component_distance(name, q_parts[name], k_parts[name])
            total = total + weights[name] * (value.square() if self.power == 2 else value)
        return total * per_head(-1 / self.temperature())

    def similarity_logits(
        self, qw: torch.Tensor, similarities: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """One term per present component, `-w d^p / tau`, from its lift similarity."""
        q_parts = self.split(qw)
        weights = self._weights_for(qw)
        inverse_tau = per_head(-1 / self.temperature())
        terms = []
        for name, similarity in zip(self.present, similarities, strict=True):
            if name == "euclidean":
                dist = safe_sqrt(-similarity)
            elif name == "sphere":
                dist = sphere.distance_from_cosine(similarity)
            else:
                k = torch.tensor(-1.0, dtype=qw.dtype, device=qw.device)
                squared_chord = stereographic.squared_chord_from_similarity(
                    q_parts[name], similarity, k
                )
                dist = stereographic.distance_from_squared_chord(squared_chord, k)
            terms.append(weights[name] * (dist.square() if self.power == 2 else dist) * inverse_tau)
        return terms

    def _weights_for(self, qw: torch.Tensor) -> dict[str, torch.Tensor]:
        """Weights broadcasting against `(..., nq, nk)` or `(..., nq, C)` distances."""
        return {name: per_head(w).to(qw.dtype) for name, w in self.weights().items()}

    def lift(self, w: torch.Tensor, role: Role) -> list[Lift]:
        """One exact lift per present component, in witness order: L2 (euclidean), inner product
        (sphere), the chord inner product of the unit ball (hyperbolic)."""
        check_role(role)
        parts = self.split(w)
        lifts = []
        for name in self.present:
            if name == "euclidean":
                lifts.append(Lift(parts[name], "l2"))
            elif name == "sphere":
                lifts.append(Lift(parts[name], "ip"))
            else:
                k = torch.tensor(-1.0, dtype=w.dtype, device=w.device)
                lifts.append(stereographic.chord_lift(parts[name], k, role))
        return lifts

    def diagnostics(self) -> dict[str, list[float] | str]:
        """Per-head effective weights `a, b, c` and the kappa_eff heuristic."""
        with torch.no_grad():
            w = self.weights()
            a, b, c = w["euclidean"], w["sphere"], w["hyperbolic"]
            kappa_eff = (c - b) / (a + b + c)
        return {
            "a": a.tolist(),
            "b": b.tolist(),
            "c": c.tolist(),
            "kappa_eff": kappa_eff.tolist(),
            "kappa_eff_note": KAPPA_EFF_NOTE,
        }

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, sizes={self.sizes}, power={self.power}"


class AdaptiveProductGeometry(ProductGeometry):
    """Adaptive geometry (seed 000 sec. 10.3.3): per-query-token weights
    `(a_i, b_i, c_i) = softmax(MLP(x_i))`, `d_ij = a_i d_R + b_i d_S + c_i d_H`.

    The witness carries the token's weights in three trailing columns (zero for absent
    components), so a query witness knows its own geometry; key witnesses carry them unused.
    """

    def __init__(self, dim: int, heads: int = 1, hidden: int = 32, **kwargs) -> None:
        super().__init__(dim, heads, **kwargs)
        del self.raw_weights
        self.gate = nn.Sequential(
            nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, len(self.present))
        )

    def token_weights(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token weights `(..., N, 3)` in the order (euclidean, sphere, hyperbolic)."""
        gate = torch.softmax(self.gate.to(x.dtype)(x), dim=-1)
        columns = iter(gate.unbind(-1))
        zero = torch.zeros_like(gate[..., 0])
        return torch.stack([next(columns) if self.sizes[n] > 0 else zero for n in COMPONENTS], -1)

    def witness(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([super().witness(x), self.token_weights(x)], dim=-1)

    def score_terms(self, qw: torch.Tensor, kw: torch.Tensor) -> None:
        """None: the weights differ per query, so tiles are scored by `score`."""
        return None

    def _weights_for(self, qw: torch.Tensor) -> dict[str, torch.Tensor]:
        columns = qw[..., -3:].unsqueeze(-1)
        return {name: columns[..., i, :] for i, name in enumerate(COMPONENTS)}

    def weights(self) -> dict[str, torch.Tensor]:
        raise TypeError("AdaptiveProductGeometry has per-token weights: use token_weights(x)")

    def diagnostics(self, x: torch.Tensor | None = None) -> dict[str, list[float] | str]:
        """Mean per-token weights over `x` (ambient vectors) and the kappa_eff heuristic."""
        if x is None:
            raise TypeError("AdaptiveProductGeometry.diagnostics needs tokens x to weigh")
        with torch.no_grad():
            mean = self.token_weights(x).reshape(-1, 3).mean(0)
            a, b, c = mean.tolist()
        return {
            "a": [a],
            "b": [b],
            "c": [c],
            "kappa_eff": [(c - b) / (a + b + c)],
            "kappa_eff_note": KAPPA_EFF_NOTE,
        }
