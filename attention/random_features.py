"""Functional attention with random Fourier features (docs/mathematics.md 4, seed 000 sec. 5):
`phi(x) = sqrt(2/D) [cos(omega_i . x); sin(omega_i . x)]` with `D/2` frequencies
`omega_i ~ N(0, sigma^-2 I)`, logit `phi(q) . phi(k) / tau`. `phi(x) . phi(y)` is an unbiased
estimate of the Gaussian kernel `exp(-||x - y||^2 / (2 sigma^2))` (Hoeffding:
`P(|error| > e) <= 2 exp(-D e^2 / 4)`). The witness is `phi(x)`; the lift is the inner product
on it, exact by construction."""

from __future__ import annotations

import math

import torch

from .geometry import Geometry, Lift, Role, ScoreTerm, SoftplusTemperature, check_role, per_head


def fourier_features(x: torch.Tensor, frequencies: torch.Tensor) -> torch.Tensor:
    """`sqrt(2/D) [cos(x W^T), sin(x W^T)]` for `x (..., d)` and frequencies `W (D/2, d)`."""
    angles = x @ frequencies.T
    scale = math.sqrt(2 / (2 * frequencies.shape[0]))
    return torch.cat([angles.cos(), angles.sin()], dim=-1) * scale


class RandomFeatures(Geometry):
    """Random-feature attention: `features` (D, even) Fourier features of bandwidth `sigma`,
    drawn once from `seed` and shared by the heads; a learnable softplus temperature per head
    initialised to `tau_init`."""

    def __init__(
        self,
        dim: int,
        heads: int = 1,
        features: int = 256,
        sigma: float = 1.0,
        tau_init: float = 0.1,
        seed: int = 0,
    ) -> None:
        super().__init__(dim, heads)
        if features < 2 or features % 2:
            raise ValueError(f"expected an even number of features >= 2, got {features}")
        if not sigma > 0:
            raise ValueError(f"expected sigma > 0, got {sigma}")
        if not tau_init > 0:
            raise ValueError(f"expected a positive initial temperature, got {tau_init}")
        self.features, self.sigma = features, float(sigma)
        generator = torch.Generator().manual_seed(seed)
        frequencies = torch.randn(features // 2, dim, generator=generator) / sigma
        self.register_buffer("frequencies", frequencies)
        self.temperature = SoftplusTemperature(heads, tau_init)

    def witness(self, x: torch.Tensor) -> torch.Tensor:
        return fourier_features(x, self.frequencies.to(x.dtype))

    def _inverse_tau(self) -> torch.Tensor:
        return per_head(1 / self.temperature())

    def score(self, qw: torch.Tensor, kw: torch.Tensor) -> torch.Tensor:
        return (qw @ kw.transpose(-1, -2)) * self._inverse_tau()

    def score_terms(self, qw: torch.Tensor, kw: torch.Tensor) -> list[ScoreTerm]:
        return [ScoreTerm(qw, kw, (), self._inverse_tau().to(qw.dtype))]

    def score_at(self, qw: torch.Tensor, kw: torch.Tensor) -> torch.Tensor:
        return (kw @ qw.unsqueeze(-1)).squeeze(-1) * self._inverse_tau()

    def similarity_logits(
        self, qw: torch.Tensor, similarities: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        (similarity,) = similarities
        return [similarity * self._inverse_tau()]

    def lift(self, w: torch.Tensor, role: Role) -> list[Lift]:
        check_role(role)
        return [Lift(w, "ip")]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, features={self.features}, sigma={self.sigma:g}"
