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
    lse = torch.logsumexp(torch.stack([part_lse for _, part_lse in parts]), dim=0)
    finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    out = sum(
        part_out * torch.exp(part_lse - finite).unsqueeze(-1).to(part_out.dtype)
        for part_out, part_lse in parts
    )
    return out, lse
