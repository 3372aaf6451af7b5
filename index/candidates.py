"""Candidate sets (docs/mathematics.md 6): the union of index candidates, a local window and sink
positions, causally filtered and de-duplicated, in a padded fixed-width layout for vectorised
attention."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from rewa.attention import Geometry

CHUNK_ELEMENTS = 1 << 22
"""`best_candidates` scores blocks of queries whose gathered keys hold about this many numbers
(16 MiB in float32): one block for all queries gathers gigabytes, and the time goes to memory
traffic (docs/benchmark-notes.md, "Measurements behind code choices")."""


@dataclass(frozen=True)
class CandidateSet:
    """Key indices `(..., nq, C)` per query, `-1` marking padding; valid entries first, unique,
    in ascending order."""

    indices: torch.Tensor

    @property
    def mask(self) -> torch.Tensor:
        """True where an entry is a real candidate."""
        return self.indices >= 0

    @property
    def counts(self) -> torch.Tensor:
        """Number of candidates per query `(..., nq)`."""
        return self.mask.sum(-1)


def query_positions(
    n_queries: int, n_keys: int, device: torch.device | None = None
) -> torch.Tensor:
    """Positions of queries in the key sequence, aligned bottom-right as in `dense_attention`:
    query i sits at key position `i + n_keys - n_queries` (self-attention: position i)."""
    return torch.arange(n_queries, device=device) + (n_keys - n_queries)


def window_candidates(positions: torch.Tensor, window: int, causal: bool) -> torch.Tensor:
    """`(nq, W)` key positions around each query: the W positions ending at the query when
    causal, else W positions centred on it (out-of-range positions are filtered later)."""
    offsets = torch.arange(window, device=positions.device)
    offsets = offsets - (window - 1) if causal else offsets - window // 2
    return positions.unsqueeze(-1) + offsets


def build_candidates(
    sources: list[torch.Tensor],
    n_keys: int,
    *,
    positions: torch.Tensor | None = None,
    window: int = 0,
    sinks: int = 0,
    causal: bool = False,
) -> CandidateSet:
    """Union candidate sources into one padded, de-duplicated `CandidateSet`.

    Args:
        sources: index candidates, each `(..., nq, c_i)` int64 with `-1` for none.
        n_keys: number of stored keys; indices outside `[0, n_keys)` are dropped.
        positions: query positions `(nq,)` in the key sequence (default: bottom-right aligned,
            see `query_positions`); needed for the window and for causal filtering.
        window: W, keys around each query that are always candidates.
        sinks: S, the first S keys, always candidates.
        causal: drop candidates after the query's position.
    """
    if not sources and window == 0 and sinks == 0:
        raise ValueError("build_candidates needs at least one source, a window or sinks")
    reference = sources[0] if sources else None
    n_queries = reference.shape[-2] if reference is not None else positions.shape[-1]
    if positions is None:
        device = reference.device if reference is not None else None
        positions = query_positions(n_queries, n_keys, device)
    batch = reference.shape[:-2] if reference is not None else ()
    parts = [s.long() for s in sources]
    if window > 0:
        parts.append(window_candidates(positions, window, causal).expand(*batch, n_queries, window))
    if sinks > 0:
        sink = torch.arange(min(sinks, n_keys), device=positions.device)
        parts.append(sink.expand(*batch, n_queries, sink.shape[0]))
    merged = torch.cat(parts, dim=-1)
    invalid = (merged < 0) | (merged >= n_keys)
    if causal:
        invalid |= merged > positions.unsqueeze(-1)
    return _compact(merged.masked_fill(invalid, -1))


def _compact(indices: torch.Tensor) -> CandidateSet:
    """Sort each row, drop repeats and padding to the end, trim to the widest row."""
    big = torch.iinfo(indices.dtype).max
    ordered = indices.masked_fill(indices < 0, big).sort(dim=-1).values
    repeated = torch.zeros_like(ordered, dtype=torch.bool)
    repeated[..., 1:] = ordered[..., 1:] == ordered[..., :-1]
    ordered = ordered.masked_fill(repeated, big).sort(dim=-1).values
    width = int((ordered != big).sum(-1).max().item()) if ordered.numel() else 0
    ordered = ordered[..., :width]
    return CandidateSet(ordered.masked_fill(ordered == big, -1))


def best_candidates(
    geometry: Geometry, queries_w: torch.Tensor, keys_w: torch.Tensor, rows: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-score candidate rows `(nq, C)` (-1 padded, repeats allowed: several LSH tables or
    lifts may propose one key) exactly and keep each query's k best distinct keys: `(D, I)` of
    shape `(nq, k)`, logits descending, `-inf` / `-1` where fewer exist."""
    chunk = max(1, CHUNK_ELEMENTS // max(1, rows.shape[-1] * keys_w.shape[-1]))
    if rows.shape[-2] > chunk:  # blocks of queries: the gathered keys stay in cache
        parts = [
            best_candidates(
                geometry, queries_w[..., start : start + chunk, :], keys_w,
                rows[..., start : start + chunk, :], k,
            )
            for start in range(0, rows.shape[-2], chunk)
        ]  # fmt: skip
        width = max(logits.shape[-1] for logits, _ in parts)
        padded = [
            (F.pad(logits, (0, width - logits.shape[-1]), value=float("-inf")),
             F.pad(ids, (0, width - ids.shape[-1]), value=-1))
            for logits, ids in parts
        ]  # fmt: skip
        return torch.cat([p[0] for p in padded], -2), torch.cat([p[1] for p in padded], -2)
    rows = _compact(rows).indices
    logits = geometry.score_at(queries_w, keys_w[rows.clamp_min(0)])
    logits = logits.masked_fill(rows < 0, float("-inf"))
    best, position = logits.topk(min(k, logits.shape[-1]), dim=-1)
    return best, rows.gather(-1, position).masked_fill(torch.isinf(best), -1)
