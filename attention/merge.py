"""Exact merging of attention over disjoint key sets (docs/mathematics.md 7)."""

from __future__ import annotations

import torch


def merge_attention(*parts: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine `(out, lse)` results computed over disjoint key sets into the result over their
    union: `lse = logaddexp(l1, l2, ...)`, `out = sum_i o_i exp(l_i - lse)`.

    Each `out` is `(..., nq, dv)` and each `lse` `(..., nq)`; a part whose row saw no key has
    `lse = -inf` and contributes nothing. Rows that saw no key in any part stay `(0, -inf)`.
    """
    if not parts:
        raise ValueError("merge_attention needs at least one (out, lse) pair")
    # Two parts (a decode step merges several such pairs) in fewer operations than a stack.
    if len(parts) == 2:
        lse = torch.logaddexp(parts[0][1], parts[1][1])
    else:
        lse = torch.logsumexp(torch.stack([part_lse for _, part_lse in parts]), dim=0)
    finite = lse.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    out = None
    for part_out, part_lse in parts:
        weight = torch.exp(part_lse - finite).unsqueeze(-1).to(part_out.dtype)
        out = part_out * weight if out is None else out.addcmul_(part_out, weight)
    return out, lse


def merge_stacked(
    out: torch.Tensor, lse: torch.Tensor, dim: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """`merge_attention` of parts stacked along `dim`: `out (..., P, ..., dv)` and
    `lse (..., P, ...)` with the parts on axis `dim` of `lse` (a non-negative axis; the same axis
    of `out`), in a few operations however many parts there are."""
    total = torch.logsumexp(lse, dim=dim)
    finite = total.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    weights = torch.exp(lse - finite.unsqueeze(dim)).unsqueeze(-1).to(out.dtype)
    return (out * weights).sum(dim), total
