"""Scoring blocks of queries against slices of keys, the inner step of the block-sparse paths
(IVF lists in `ivf_blocks`, clusters in `tail.exact`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from rewa.attention import DotProduct, Geometry


def block_scorer(
    geometry: Geometry, qw: torch.Tensor
) -> tuple[torch.Tensor, Callable[..., torch.Tensor]]:
    """`(queries, score)`: the queries `qw` in the form `score(queries, keys_w, bias=None)`
    takes, and `score`: the logits of rows of those queries against a slice of keys, plus `bias`
    `(rows, 1)` if given. For the dot product the scale is folded into the queries once and the
    bias into the product, which saves a pass over every block's logits for each."""
    if isinstance(geometry, DotProduct):

        def dot_product_score(queries, keys, bias=None):
            if bias is None:
                return queries @ keys.T
            return torch.addmm(bias, queries, keys.T)

        return qw * geometry.scale, dot_product_score

    def geometry_score(queries, keys, bias=None):
        logits = geometry.score(queries, keys)
        return logits if bias is None else logits.add_(bias)

    return qw, geometry_score
