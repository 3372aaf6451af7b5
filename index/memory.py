"""`LocalMemory`: an attention memory in the calling process, with the interface of the service's
remote memory (`rewa.clients.RemoteMemory`): `append(keys, values)` adds tokens, `attend(queries)`
returns `(out, lse)` over every token appended so far, `close()` frees it. A pipeline picks the
process-local or the shared remote memory by which one it constructs (docs/llm.md).

It computes what the service's engine computes for a context of the same geometry and mode (the
same `tail_attention_heads` and `retrieval_attention` calls, the same defaults), without the
store, the HTTP request or the device queue: keys and values live in buffers with spare
capacity, and the index of the mode (clusters for `tail`, the search index for `topk`) is built
at the first attend and extended by later appends (`KeyClusters.extend`, `LiftIndex.extend`;
docs/indexes.md, "Appends").

As in the service, the index holds the tokens of the full segments of `open_segment` tokens
(`growth.sealed_keys`); those of the open last segment are read exactly by every query and
merged with the index's answer (docs/mathematics.md 7, docs/indexes.md "The open segment"), and
the index is extended when a segment fills. Extending costs time per cluster the new keys join,
not per key (docs/indexes.md), so a decoding model that spills a few hundred tokens at a time
pays it once per segment instead of once per spill. `open_segment=0` indexes every token."""

from __future__ import annotations

from typing import Literal

import torch

from rewa.attention import Geometry, dense_attention, make_geometry, merge_attention

from .clusters import ClusterHeads, KeyClusters
from .growth import OPEN_SEGMENT, appended, sealed_keys
from .retrieval import build_index, retrieval_attention
from .tail import tail_attention_heads

MODES = ("tail", "topk", "exact")
INITIAL_CAPACITY = 1024


class LocalMemory:
    """Keys `(heads, n, head_dim)` and values `(heads, n, value_dim)` of one sequence, attended
    by queries `(heads, m, head_dim)` (head h of the queries reads head h of the memory).

    `geometry` is a geometry name with `geometry_options`, or a `Geometry` (a trained one, used
    as it is). `mode`: `tail` (clusters read within `budget`, a fraction of the keys, and every
    other cluster estimated), `topk` (the `top_k` best keys of an `index` of that kind) or `exact`
    (dense attention). `open_segment`: the size of the segments the index takes whole; the
    tokens of the last, open one are read exactly (module docstring). The memory holds float32
    tensors on `device`."""

    def __init__(
        self,
        heads: int,
        head_dim: int,
        *,
        value_dim: int | None = None,
        geometry: str | Geometry = "dot",
        mode: Literal["tail", "topk", "exact"] = "tail",
        budget: float = 0.02,
        top_k: int = 64,
        index: str = "ivf",
        open_segment: int = OPEN_SEGMENT,
        device: torch.device | str = "cpu",
        **geometry_options,
    ) -> None:
        if heads < 1 or head_dim < 1:
            raise ValueError(f"expected heads >= 1 and head_dim >= 1, got {heads}, {head_dim}")
        if mode not in MODES:
            raise ValueError(f"expected mode in {MODES}, got {mode!r}")
        if not 0 < budget <= 1:
            raise ValueError(f"expected a budget in (0, 1] (a fraction of keys), got {budget}")
        if top_k < 1:
            raise ValueError(f"expected top_k >= 1, got {top_k}")
        if open_segment < 0:
            raise ValueError(
                f"expected open_segment >= 0 (0: index every token), got {open_segment}"
            )
        if isinstance(geometry, str):
            geometry = make_geometry(geometry, head_dim, **geometry_options)
        elif geometry_options:
            raise ValueError("geometry options go with a geometry name, not a Geometry")
        if geometry.dim != head_dim:
            raise ValueError(f"the geometry's dim is {geometry.dim}, the head_dim {head_dim}")
        self.heads, self.head_dim = heads, head_dim
        self.value_dim = value_dim or head_dim
        self.device = torch.device(device)
        self.geometry = geometry.to(self.device)
        self.mode, self.budget, self.top_k, self.index_kind = mode, budget, top_k, index
        self.open_segment = open_segment
        self._key_buffer = torch.empty(heads, INITIAL_CAPACITY, head_dim, device=self.device)
        self._value_buffer = torch.empty(
            heads, INITIAL_CAPACITY, self.value_dim, device=self.device
        )
        self._n_tokens = 0
        self._indexes: list | None = None  # per head: KeyClusters (tail) or a search index
        self._cluster_heads: ClusterHeads | None = None  # tail: the heads' clusters, stacked
        self._indexed = 0  # tokens the indexes hold

    @property
    def n_tokens(self) -> int:
        return self._n_tokens

    @property
    def keys(self) -> torch.Tensor:
        return self._key_buffer[:, : self._n_tokens]

    @property
    def values(self) -> torch.Tensor:
        return self._value_buffer[:, : self._n_tokens]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add tokens: keys `(heads, n, head_dim)`, values `(heads, n, value_dim)`."""
        expected_k = (self.heads, keys.shape[1] if keys.dim() == 3 else -1, self.head_dim)
        if keys.dim() != 3 or tuple(keys.shape) != expected_k:
            raise ValueError(
                f"expected keys (heads={self.heads}, n, head_dim={self.head_dim}), got "
                f"{tuple(keys.shape)}"
            )
        if tuple(values.shape) != (self.heads, keys.shape[1], self.value_dim):
            raise ValueError(
                f"expected values ({self.heads}, {keys.shape[1]}, {self.value_dim}), got "
                f"{tuple(values.shape)}"
            )
        keys = keys.detach().to(self.device, torch.float32)
        values = values.detach().to(self.device, torch.float32)
        if not (torch.isfinite(keys).all() and torch.isfinite(values).all()):
            raise ValueError("keys and values must be finite")
        used = self._n_tokens
        self._key_buffer = appended(self._key_buffer, used, keys)
        self._value_buffer = appended(self._value_buffer, used, values)
        self._n_tokens = used + keys.shape[1]

    @torch.no_grad()
    def attend(self, queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of queries `(heads, m, head_dim)` over every token appended: `out (heads,
        m, value_dim)`, `lse (heads, m)`, float32 on the memory's device."""
        if (
            queries.dim() != 3
            or queries.shape[0] != self.heads
            or queries.shape[2] != self.head_dim
        ):
            raise ValueError(
                f"expected queries (heads={self.heads}, m, head_dim={self.head_dim}), got "
                f"{tuple(queries.shape)}"
            )
        if self._n_tokens == 0:
            raise ValueError("attend on an empty memory: append tokens first")
        q = queries.detach().to(self.device, torch.float32)
        if self.mode == "exact":
            return dense_attention(q, self.keys, self.values, self.geometry)
        indexes = self._current_indexes()
        parts = []
        if self.mode == "tail" and indexes:
            parts.append(tail_attention_heads(q, self._cluster_heads, budget=self.budget))
        elif indexes:
            heads = [self._topk_head(q[head], head, indexes[head]) for head in range(self.heads)]
            parts.append(tuple(torch.stack(part) for part in zip(*heads, strict=True)))
        if self._indexed < self._n_tokens or not parts:  # the open segment, read exactly
            recent = slice(self._indexed, self._n_tokens)
            parts.append(
                dense_attention(
                    q, self._key_buffer[:, recent], self._value_buffer[:, recent], self.geometry
                )
            )
        return merge_attention(*parts) if len(parts) > 1 else parts[0]

    __call__ = attend

    def close(self) -> None:
        """Free the tensors and indexes (the memory is empty afterwards)."""
        self._key_buffer = self._key_buffer[:, :0]
        self._value_buffer = self._value_buffer[:, :0]
        self._n_tokens = self._indexed = 0
        self._indexes = self._cluster_heads = None

    def _topk_head(self, q, head, index):
        k, v = self._key_buffer[head, : self._indexed], self._value_buffer[head, : self._indexed]
        return retrieval_attention(q, k, v, self.geometry, top_k=self.top_k, index=index)

    def _current_indexes(self) -> list:
        """The mode's index of every head over the first `_indexed` tokens, the sealed ones
        (`sealed_keys`): built at the first attend that has any, then extended when a segment
        fills; [] while none is sealed."""
        sealed = sealed_keys(self._n_tokens, self.open_segment)
        if sealed == 0 or (self._indexes is not None and sealed == self._indexed):
            return self._indexes or []
        witness = self.geometry.witness
        keys, values = self._key_buffer[:, :sealed], self._value_buffer[:, :sealed]
        if self._indexes is None:
            if self.mode == "tail":
                self._indexes = [
                    KeyClusters.build(witness(keys[h]), values[h], self.geometry)
                    for h in range(self.heads)
                ]
            else:
                self._indexes = [
                    build_index(keys[h], self.geometry, self.index_kind) for h in range(self.heads)
                ]
        elif self.mode == "tail":
            new = slice(self._indexed, sealed)
            self._indexes = [
                clusters.extend(witness(keys[h, new]), values[h, new])
                for h, clusters in enumerate(self._indexes)
            ]
        else:
            for h, index in enumerate(self._indexes):
                index.extend(witness(keys[h]))
        if self.mode == "tail":
            self._cluster_heads = ClusterHeads.stacked(self._indexes)
        self._indexed = sealed
        return self._indexes

    def __repr__(self) -> str:
        return (
            f"LocalMemory(heads={self.heads}, head_dim={self.head_dim}, "
            f"value_dim={self.value_dim}, mode={self.mode!r}, n_tokens={self._n_tokens})"
        )
