"""Candidate search for a geometry without an exact lift (cone attention, docs/mathematics.md 2):
keys are split into bands of similar `Geometry.band_coordinate` (for cones, log height), each band
gets its own FAISS index over the geometry's candidate lift, a query searches every band, and the
union is re-scored exactly. Within a band the candidate lift ranks keys almost as the score does;
across bands it does not, which is why bands are searched separately rather than pooled."""

from __future__ import annotations

import numpy as np
import torch

from rewa.attention import Geometry

from .candidates import best_candidates
from .faiss_index import GeometryIndex, IndexSettings


class BandedIndex:
    """`settings.bands` equal-count bands of the key witnesses' band coordinate, one
    `GeometryIndex` (of `settings.kind`) per band. Interface as `GeometryIndex`."""

    def __init__(
        self, geometry: Geometry, settings: IndexSettings | None = None, device: str | None = None
    ):
        if geometry.exact_lift:
            raise ValueError(f"{type(geometry).__name__} has an exact lift; use GeometryIndex")
        self.geometry = geometry
        self.settings = settings or IndexSettings()
        if self.settings.bands < 1:
            raise ValueError(f"expected bands >= 1, got {self.settings.bands}")
        self.device = device
        self.members: list[torch.Tensor] = []  # global key ids of each band
        self.parts: list[GeometryIndex] = []
        self.keys: torch.Tensor | None = None

    @property
    def ntotal(self) -> int:
        return 0 if self.keys is None else self.keys.shape[0]

    def add(self, keys_w: torch.Tensor) -> None:
        """Index key witnesses `(n, d_w)`: rank them by band coordinate, cut into equal bands."""
        self.keys = keys_w
        order = self.geometry.band_coordinate(keys_w).argsort()
        bands = min(self.settings.bands, max(keys_w.shape[0], 1))
        self.members = [ids for ids in order.tensor_split(bands) if ids.numel()]
        self.parts = []
        for ids in self.members:
            part = GeometryIndex(self.geometry, self.settings, self.device)
            part.add(keys_w[ids])
            self.parts.append(part)

    def extend(self, keys_w: torch.Tensor) -> None:
        """Index the witnesses of the grown context: rebuilt, since equal-count bands move
        with every new key."""
        self.add(keys_w)

    def candidates(self, queries_w: torch.Tensor, k: int) -> torch.Tensor:
        """Each band's k nearest keys under the candidate lift: `(nq, k * bands)`, -1 padded."""
        found = []
        for ids, part in zip(self.members, self.parts, strict=True):
            local = part.candidates(queries_w, k)
            found.append(ids.to(local.device)[local.clamp_min(0)].masked_fill(local < 0, -1))
        return torch.cat(found, dim=-1)

    def search(self, queries_w: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(D, I)`: the k best candidates of all bands by exact logit, descending."""
        return best_candidates(
            self.geometry, queries_w, self.keys, self.candidates(queries_w, k), k
        )

    def state(self) -> dict[str, np.ndarray]:
        """Each band's key ids and FAISS indexes."""
        arrays = {}
        for band, (ids, part) in enumerate(zip(self.members, self.parts, strict=True)):
            arrays[f"members{band}"] = ids.cpu().numpy()
            arrays.update({f"band{band}_{name}": a for name, a in part.state().items()})
        return arrays

    def restore(self, keys_w: torch.Tensor, state: dict[str, np.ndarray]) -> None:
        """Load `state()` output for the same key witnesses."""
        self.keys = keys_w
        self.members, self.parts = [], []
        bands = sum(name.startswith("members") for name in state)
        for band in range(bands):
            ids = torch.from_numpy(state[f"members{band}"]).to(keys_w.device)
            prefix = f"band{band}_"
            part = GeometryIndex(self.geometry, self.settings, self.device)
            part.restore(
                keys_w[ids],
                {name[len(prefix) :]: a for name, a in state.items() if name.startswith(prefix)},
            )
            self.members.append(ids)
            self.parts.append(part)
