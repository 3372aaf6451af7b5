"""The Poincare ball `B^p` (docs/mathematics.md 1.4): the kappa = -1 case of the kappa-stereographic
family, witness `project(expmap0(x))`, distance
`arccosh(1 + 2||u - v||^2 / ((1 - ||u||^2)(1 - ||v||^2)))`."""

from __future__ import annotations

from .geometry import TemperatureKind
from .stereographic import KappaStereographic


class PoincareBall(KappaStereographic):
    """Hyperbolic attention with fixed curvature -1: logits `-d_H(q, k)^p / tau`."""

    def __init__(
        self,
        dim: int,
        heads: int = 1,
        power: int = 1,
        temperature: TemperatureKind = "scaled_exp",
        tau_init: float | None = None,
    ) -> None:
        super().__init__(
            dim,
            heads,
            kappa=-1.0,
            learnable_kappa=False,
            power=power,
            temperature=temperature,
            tau_init=tau_init,
        )
