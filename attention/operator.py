"""Operator attention (docs/mathematics.md 4, seed 000 sec. 6): every vector becomes an operator
`A_x = reshape(U x, m, m)` and the logit is `-||A_q - A_k||_HS^2 / tau`, the squared
Hilbert-Schmidt (Frobenius) distance.

- Full form: the witness is `vec(A_x) = U x` (m^2 values); the HS distance is the L2 distance
  of witnesses, so the lift is L2 on them.
- Low-rank form (`rank = r`): `A_x = U_x V_x^T` with `U_x = reshape(P x, m, r)` and
  `V_x = reshape(Q x, m, r)`; the witness is `(vec U_x, vec V_x)` (2 m r values) and every HS
  inner product comes from r x r products, `<A, B>_HS = sum_ab (U_A^T U_B)_ab (V_A^T V_B)_ab`,
  so no m x m matrix is ever built to score. The exact lift is still `vec(A_x)` (an index over
  operators needs their m^2 coordinates); only `lift` builds it.
- `path_score`: the multi-hop score `tr(A_1 R_1 ... R_t A_2^T)` (seed 000 sec. 6.4).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .geometry import Geometry, Lift, Role, ScoreTerm, SoftplusTemperature, check_role, per_head
from .numerics import gram_operands, gram_squared_distance, safe_sqrt


def hs_inner_low_rank(
    u_a: torch.Tensor, v_a: torch.Tensor, u_b: torch.Tensor, v_b: torch.Tensor
) -> torch.Tensor:
    """`<U_a V_a^T, U_b V_b^T>_HS` for factors `(..., m, r)` (broadcast), from r x r products."""
    return ((u_a.transpose(-1, -2) @ u_b) * (v_a.transpose(-1, -2) @ v_b)).sum((-1, -2))


def hs_gram_low_rank(
    u_q: torch.Tensor, v_q: torch.Tensor, u_k: torch.Tensor, v_k: torch.Tensor
) -> torch.Tensor:
    """Dense `<A_q,i, A_k,j>_HS` `(..., nq, nk)` for factors `(..., n, m, r)`: one `(nq, m) @
    (m, nk)` product per pair of factor columns (r^2 of them), memory O(nq nk)."""
    rank = u_q.shape[-1]
    gram = None
    for a in range(rank):
        for b in range(rank):
            term = (u_q[..., a] @ u_k[..., b].transpose(-1, -2)) * (
                v_q[..., a] @ v_k[..., b].transpose(-1, -2)
            )
            gram = term if gram is None else gram + term
    return gram


class Operator(Geometry):
    """Operator attention with `m x m` operators (full, `rank=None`) or rank-`r` factors; the
    projections are learnable (initialised from `seed`), the temperature a learnable softplus
    per head initialised to `tau_init`."""

    def __init__(
        self,
        dim: int,
        heads: int = 1,
        m: int = 8,
        rank: int | None = None,
        tau_init: float = 1.0,
        seed: int = 0,
    ) -> None:
        super().__init__(dim, heads)
        if m < 1:
            raise ValueError(f"expected m >= 1, got {m}")
        if rank is not None and not 1 <= rank <= m:
            raise ValueError(f"expected 1 <= rank <= m = {m} (or None for full), got {rank}")
        if not tau_init > 0:
            raise ValueError(f"expected a positive initial temperature, got {tau_init}")
        self.m, self.rank = m, rank
        generator = torch.Generator().manual_seed(seed)
        rows = m * m if rank is None else 2 * m * rank
        scale = 1 / math.sqrt(dim) if rank is None else 1 / math.sqrt(dim * math.sqrt(rank))
        self.projection = nn.Parameter(torch.randn(rows, dim, generator=generator) * scale)
        self.temperature = SoftplusTemperature(heads, tau_init)

    def witness(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.projection.to(x.dtype).T

    def factors(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Low-rank witnesses `(..., 2 m r)` -> `(U (..., m, r), V (..., m, r))`."""
        half = self.m * self.rank
        shape = (*w.shape[:-1], self.m, self.rank)
        return w[..., :half].reshape(shape), w[..., half:].reshape(shape)

    def operators(self, w: torch.Tensor) -> torch.Tensor:
        """The operators `(..., m, m)` of witnesses (built only for lifts and tests)."""
        if self.rank is None:
            return w.reshape(*w.shape[:-1], self.m, self.m)
        u, v = self.factors(w)
        return u @ v.transpose(-1, -2)

    def squared_distance(self, xw: torch.Tensor, yw: torch.Tensor) -> torch.Tensor:
        """`||A_x - A_y||_HS^2` along the last axis (broadcast)."""
        if self.rank is None:
            return (xw - yw).square().sum(-1)
        u_x, v_x = self.factors(xw)
        u_y, v_y = self.factors(yw)
        squared = (
            hs_inner_low_rank(u_x, v_x, u_x, v_x)
            + hs_inner_low_rank(u_y, v_y, u_y, v_y)
            - 2 * hs_inner_low_rank(u_x, v_x, u_y, v_y)
        )
        return squared.clamp_min(0)

    def distance(self, xw: torch.Tensor, yw: torch.Tensor) -> torch.Tensor:
        """The Hilbert-Schmidt distance along the last axis."""
        return safe_sqrt(self.squared_distance(xw, yw))

    def squared_distance_matrix(self, qw: torch.Tensor, kw: torch.Tensor) -> torch.Tensor:
        """Dense `||A_q,i - A_k,j||_HS^2` `(..., nq, nk)`."""
        if self.rank is None:
            return gram_squared_distance(qw, kw).clamp_min(0)
        u_q, v_q = self.factors(qw)
        u_k, v_k = self.factors(kw)
        norms_q = hs_inner_low_rank(u_q, v_q, u_q, v_q).unsqueeze(-1)
        norms_k = hs_inner_low_rank(u_k, v_k, u_k, v_k).unsqueeze(-2)
        return (norms_q + norms_k - 2 * hs_gram_low_rank(u_q, v_q, u_k, v_k)).clamp_min(0)

    def _inverse_tau(self) -> torch.Tensor:
        return per_head(1 / self.temperature())

    def score(self, qw: torch.Tensor, kw: torch.Tensor) -> torch.Tensor:
        logits = self.score_from_terms(qw, kw)
        if logits is not None:
            return logits
        return self.squared_distance_matrix(qw, kw) * -self._inverse_tau()

    def score_terms(self, qw: torch.Tensor, kw: torch.Tensor) -> list[ScoreTerm] | None:
        """Full rank: the Gram expansion of the flattened operators; low rank: None."""
        if self.rank is not None:
            return None
        weight = -self._inverse_tau().to(qw.dtype)
        return [ScoreTerm(*gram_operands(qw, kw), ("clamp_to_zero",), weight)]

    def score_at(self, qw: torch.Tensor, kw: torch.Tensor) -> torch.Tensor:
        return self.squared_distance(qw.unsqueeze(-2), kw) * -self._inverse_tau()

    def similarity_logits(
        self, qw: torch.Tensor, similarities: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        (similarity,) = similarities  # -||vec A_q - vec A_k||^2
        return [similarity * self._inverse_tau()]

    def lift(self, w: torch.Tensor, role: Role) -> list[Lift]:
        check_role(role)
        return [Lift(self.operators(w).flatten(-2), "l2")]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, m={self.m}, rank={self.rank}"


def path_score(
    start: torch.Tensor, relations: list[torch.Tensor], end: torch.Tensor
) -> torch.Tensor:
    """Multi-hop score `tr(A_start R_1 ... R_t A_end^T)` of operators `(..., m, m)`."""
    product = start
    for relation in relations:
        product = product @ relation
    return (product * end).sum((-1, -2))


def path_score_low_rank(
    start: tuple[torch.Tensor, torch.Tensor],
    relations: list[torch.Tensor],
    end: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """`path_score` for low-rank operators `A = U V^T` given as factors `(U, V)` `(..., m, r)`:
    `tr(U_1 V_1^T R V_2 U_2^T) = tr((V_1^T R V_2)(U_2^T U_1))`, carried through r x m products."""
    (u_start, v_start), (u_end, v_end) = start, end
    carried = v_start.transpose(-1, -2)  # (..., r, m)
    for relation in relations:
        carried = carried @ relation
    inner = carried @ v_end  # (..., r, r)
    # tr(X Y) = sum(X * Y^T), and (U_2^T U_1)^T = U_1^T U_2.
    return (inner * (u_start.transpose(-1, -2) @ u_end)).sum((-1, -2))
