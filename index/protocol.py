"""The interface every search index of rewa implements (docs/indexes.md, "One index protocol").

A search index holds the witnesses of one head's keys and finds each query's candidate keys:
`GeometryIndex` (FAISS flat, IVF or HNSW on a geometry's exact lifts), `BandedIndex` (height
bands, for cones) and `CompositeLSH`. `build_index` is the one place that turns a method name
into one; callers use only the methods below, never the index's type.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
import torch

from rewa.attention import Geometry


@runtime_checkable
class KeyIndex(Protocol):
    """A search index over one head's key witnesses `(n, d_w)`."""

    geometry: Geometry

    @property
    def ntotal(self) -> int:
        """How many keys are indexed."""
        ...

    def add(self, keys_w: torch.Tensor) -> None:
        """Index key witnesses `(n, d_w)`, replacing what was indexed before."""
        ...

    def extend(self, keys_w: torch.Tensor) -> None:
        """Index the witnesses of the grown context, whose first `ntotal` are the ones indexed:
        the result answers as `add(keys_w)` on a fresh index."""
        ...

    def candidates(self, queries_w: torch.Tensor, k: int) -> torch.Tensor:
        """Candidate key ids `(nq, C)` per query, `-1` padded (duplicates allowed): a nearest-
        neighbour index's `k` nearest per component, an LSH index's bucket mates (whose count
        its tables fix; `k` is not used)."""
        ...

    def search(self, queries_w: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(logits, ids)` of shape `(nq, k)`: the best `k` candidates by exact logit,
        descending, `-inf` / `-1` where fewer exist."""
        ...

    def state(self) -> dict[str, np.ndarray]:
        """What `restore` needs besides the key witnesses, as named arrays."""
        ...

    def restore(self, keys_w: torch.Tensor, state: dict[str, np.ndarray]) -> None:
        """Load `state()` output for the same key witnesses (nothing is trained or added)."""
        ...
