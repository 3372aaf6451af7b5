"""Float64 reference implementations written directly from the formulas of docs/mathematics.md,
independent of the library's numerics (no series, no Gram expansions, no fused forms)."""

from __future__ import annotations

import math

import torch


def euclidean(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (x - y).pow(2).sum(-1).sqrt()


def sphere(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a = a / a.norm(dim=-1, keepdim=True)
    b = b / b.norm(dim=-1, keepdim=True)
    return torch.arccos((a * b).sum(-1).clamp(-1, 1))


def poincare(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """docs/mathematics.md 1.4: arccosh(1 + 2||u - v||^2 / ((1 - ||u||^2)(1 - ||v||^2)))."""
    num = 2 * (u - v).pow(2).sum(-1)
    den = (1 - u.pow(2).sum(-1)) * (1 - v.pow(2).sum(-1))
    return torch.arccosh(1 + num / den)


def mobius_add(x: torch.Tensor, y: torch.Tensor, k: float) -> torch.Tensor:
    """docs/mathematics.md 1.3 Mobius addition."""
    xy = (x * y).sum(-1, keepdim=True)
    x2 = x.pow(2).sum(-1, keepdim=True)
    y2 = y.pow(2).sum(-1, keepdim=True)
    num = (1 - 2 * k * xy - k * y2) * x + (1 + k * x2) * y
    return num / (1 - 2 * k * xy + k * k * x2 * y2)


def artan_k(x: torch.Tensor, k: float) -> torch.Tensor:
    if k < 0:
        return torch.atanh(math.sqrt(-k) * x) / math.sqrt(-k)
    if k > 0:
        return torch.atan(math.sqrt(k) * x) / math.sqrt(k)
    return x


def tan_k(x: torch.Tensor, k: float) -> torch.Tensor:
    if k < 0:
        return torch.tanh(math.sqrt(-k) * x) / math.sqrt(-k)
    if k > 0:
        return torch.tan(math.sqrt(k) * x) / math.sqrt(k)
    return x


def kappa(x: torch.Tensor, y: torch.Tensor, k: float) -> torch.Tensor:
    """docs/mathematics.md 1.3: d_k(x, y) = 2 artan_k(||(-x) (+)_k y||)."""
    return 2 * artan_k(mobius_add(-x, y, k).norm(dim=-1), k)


def expmap0(u: torch.Tensor, k: float) -> torch.Tensor:
    n = u.norm(dim=-1, keepdim=True)
    return tan_k(n, k) * u / n


def dense_softmax_attention(
    logits: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Naive attention from a full logit matrix; rows with no allowed key give (0, -inf)."""
    if allowed is not None:
        logits = logits.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(logits, -1)
    weights = torch.exp(logits - lse.unsqueeze(-1)).nan_to_num(0.0)
    return weights @ v, lse
