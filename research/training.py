"""Training aids (docs/mathematics.md 8): the geometric curriculum (seed 000 Alg. 7) and Riemannian
gradients for parameters that live on a kappa-stereographic ball."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from rewa.attention import stereographic

COMPONENT_GROUPS = ("base", "sphere", "euclidean", "hyperbolic")


@dataclass(frozen=True)
class Phase:
    """One curriculum phase: the parameter groups that train, and their learning-rate factor."""

    name: str
    trainable: frozenset[str]
    lr_scale: float


CURRICULUM_PHASES = (
    Phase("spherical", frozenset({"base", "sphere"}), 1.0),
    Phase("euclidean", frozenset({"base", "sphere", "euclidean"}), 0.1),
    Phase("hyperbolic", frozenset(COMPONENT_GROUPS), 0.1),
    Phase("joint", frozenset(COMPONENT_GROUPS), 1.0),
)
"""Seed 000 Alg. 7: spherical base; + Euclidean at lr x 0.1; + hyperbolic (still x 0.1); joint.
Phase 1 freezes the Euclidean and hyperbolic parameters where the seed sets `a = c = 0`:
softplus weights cannot reach 0, and zeroing them would leave no gradient to unfreeze."""


def component_group(parameter_name: str) -> str:
    """The curriculum group of a parameter by name: a product geometry's map or weight of a
    component (`maps.sphere`, `raw_weights.hyperbolic`, ...) belongs to that component;
    everything else (projections, MLPs, norms, temperatures) is `"base"`."""
    for component in ("sphere", "euclidean", "hyperbolic"):
        if f"maps.{component}" in parameter_name or f"raw_weights.{component}" in parameter_name:
            return component
    return "base"


class GeometricCurriculum:
    """Freeze and unfreeze a model's parameter groups phase by phase.

    `enter(phase, lr)` sets `requires_grad` on every parameter of the model (trainable groups of
    the phase on, the rest off) and returns optimizer parameter groups for the trainable ones,
    with `lr * phase.lr_scale`: build a new optimizer (or replace its param groups) per phase.

    Args:
        model: any module.
        phases: the phases (default `CURRICULUM_PHASES`).
        classify: parameter name -> group (default `component_group`).
    """

    def __init__(
        self,
        model: nn.Module,
        phases: Iterable[Phase] = CURRICULUM_PHASES,
        classify: Callable[[str], str] = component_group,
    ) -> None:
        self.phases = tuple(phases)
        self.groups: dict[str, list[nn.Parameter]] = {}
        for name, parameter in model.named_parameters():
            self.groups.setdefault(classify(name), []).append(parameter)

    def phase(self, phase: int | str) -> Phase:
        if isinstance(phase, str):
            for candidate in self.phases:
                if candidate.name == phase:
                    return candidate
            raise ValueError(f"unknown phase {phase!r}; expected one of {self.names}")
        if not 0 <= phase < len(self.phases):
            raise ValueError(f"expected a phase in [0, {len(self.phases) - 1}], got {phase}")
        return self.phases[phase]

    @property
    def names(self) -> list[str]:
        return [phase.name for phase in self.phases]

    def frozen(self, phase: int | str) -> set[str]:
        """The model's groups that the phase freezes."""
        return set(self.groups) - self.phase(phase).trainable

    def enter(self, phase: int | str, lr: float) -> list[dict]:
        selected = self.phase(phase)
        param_groups = []
        for group, parameters in self.groups.items():
            trainable = group in selected.trainable
            for parameter in parameters:
                parameter.requires_grad_(trainable)
            if trainable:
                param_groups.append(
                    {"params": parameters, "lr": lr * selected.lr_scale, "group": group}
                )
        return param_groups


def riemannian_gradient(
    x: torch.Tensor, euclidean_gradient: torch.Tensor, kappa: float | torch.Tensor = -1.0
) -> torch.Tensor:
    """The Riemannian gradient of a point `x (..., d)` of the kappa-stereographic model:
    `((1 + kappa ||x||^2)^2 / 4) grad_E`, i.e. `grad_E / lambda_x^2`; on the Poincare ball
    (kappa = -1) `((1 - ||x||^2)^2 / 4) grad_E` (docs/mathematics.md 8; seed 000 eq. 105 omits the
    1/4)."""
    kappa = torch.as_tensor(kappa, dtype=x.dtype, device=x.device)
    factor = (1 + kappa * x.square().sum(-1, keepdim=True)).square() / 4
    return factor * euclidean_gradient


class RiemannianSGD(torch.optim.Optimizer):
    """Riemannian SGD for parameters that are points of a kappa-stereographic ball (rows along
    the last axis): `x <- project(expmap_x(-lr grad_R))` with `grad_R = riemannian_gradient`."""

    def __init__(self, params, lr: float, kappa: float = -1.0) -> None:
        if lr <= 0:
            raise ValueError(f"expected lr > 0, got {lr}")
        super().__init__(params, {"lr": lr, "kappa": kappa})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            kappa = torch.tensor(group["kappa"])
            for parameter in group["params"]:
                if parameter.grad is None:
                    continue
                k = kappa.to(parameter.dtype)
                direction = riemannian_gradient(parameter, parameter.grad, k) * -group["lr"]
                parameter.copy_(
                    stereographic.project(stereographic.expmap(parameter, direction, k), k)
                )
        return loss
