"""`retrieval_attention`: build or reuse an index over the keys, gather each query's candidates
(index neighbours, a local window, sink positions; causally filtered), attend exactly over the
top K of them (docs/mathematics.md 6); with IVF, score whole lists in dense blocks
(`ivf_blocks`); with clusters (`KeyClusters`), visit the most massive clusters exactly and
estimate the rest (`tail`)."""

from __future__ import annotations

import io
from typing import Literal

import numpy as np
import torch

from rewa.attention import Geometry, dense_attention, sparse_attention
from rewa.attention.numerics import compute_dtype
from rewa.attention.sparse import attend_scored

from .bands import BandedIndex
from .candidates import CandidateSet, build_candidates, query_positions
from .causal import causal_tail_attention
from .clusters import KeyClusters
from .faiss_index import GeometryIndex, IndexSettings
from .ivf_blocks import ivf_block_attention, ivf_block_topk, supports_ivf_blocks
from .lsh import CompositeLSH
from .lsh_attention import fused_lsh_applies, lsh_attention
from .protocol import KeyIndex
from .tail import tail_attention


def build_index(
    k: torch.Tensor,
    geometry: Geometry,
    method: Literal["ivf", "flat", "hnsw", "lsh"] = "ivf",
    **options,
) -> KeyIndex:
    """Index the witnesses of keys `(n, d)`: FAISS on the geometry's lifts (`"ivf"`, `"flat"`,
    `"hnsw"`; options are `IndexSettings` fields) or composite LSH (`"lsh"`; options are
    `CompositeLSH` arguments)."""
    with torch.no_grad():
        kw = geometry.witness(k)
    index = empty_index(geometry, method, options)
    index.add(kw)
    return index


def empty_index(geometry: Geometry, method: str, options: dict) -> KeyIndex:
    """The index `build_index` fills, before any key: what checks a method's option values
    (ValueError or TypeError naming the option)."""
    if method == "lsh":
        return CompositeLSH(geometry, **options)
    if method in ("ivf", "flat", "hnsw"):
        settings = IndexSettings(kind=method, **options)
        exact = geometry.exact_lift
        return GeometryIndex(geometry, settings) if exact else BandedIndex(geometry, settings)
    raise ValueError(f"expected method 'ivf', 'flat', 'hnsw' or 'lsh', got {method!r}")


INDEX_FORMAT = "rewa-index-1"


def index_to_bytes(index: KeyIndex) -> bytes:
    """A built index (FAISS, height-banded or LSH) as an `.npz` archive, without its keys."""
    buffer = io.BytesIO()
    np.savez(buffer, format=np.array([INDEX_FORMAT, type(index).__name__]), **index.state())
    return buffer.getvalue()


def index_from_bytes(
    data: bytes,
    k: torch.Tensor,
    geometry: Geometry,
    method: Literal["ivf", "flat", "hnsw", "lsh"] = "ivf",
    **options,
) -> KeyIndex:
    """Restore `index_to_bytes` output for the same keys, geometry, method and options as the
    `build_index` call that built it (nothing is trained or added again)."""
    index = empty_index(geometry, method, options)
    with np.load(io.BytesIO(data), allow_pickle=False) as archive:
        state = {name: archive[name] for name in archive.files}
    marker = state.pop("format", np.array([]))
    if marker.tolist() != [INDEX_FORMAT, type(index).__name__]:
        raise ValueError(
            f"expected a stored {type(index).__name__} ({INDEX_FORMAT}), got {marker.tolist()}"
        )
    with torch.no_grad():
        index.restore(geometry.witness(k), state)
    return index


def retrieval_candidates(
    q: torch.Tensor,
    index: KeyIndex,
    n_keys: int,
    *,
    per_query: int = 64,
    window: int = 0,
    sinks: int = 0,
    causal: bool = False,
    positions: torch.Tensor | None = None,
) -> CandidateSet:
    """Candidates of queries `(nq, d)` from `index`, unioned with window and sinks."""
    with torch.no_grad():
        qw = index.geometry.witness(q)
        found = index.candidates(qw, per_query)
    if positions is None:
        positions = query_positions(q.shape[0], n_keys)
    return build_candidates(
        [found], n_keys, positions=positions, window=window, sinks=sinks, causal=causal
    )


def retrieval_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    geometry: Geometry,
    *,
    top_k: int | None = None,
    index: KeyIndex | KeyClusters | Literal["ivf", "flat", "hnsw", "lsh", "clusters"] = "ivf",
    per_query: int | None = None,
    window: int = 0,
    sinks: int = 0,
    causal: bool = False,
    positions: torch.Tensor | None = None,
    query_block: int = 8192,
    tail: bool = False,
    budget: float = 0.02,
    measured_queries: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention of queries `(nq, d)` over keys `(nk, d)` and values `(nk, dv)`.

    Self-attention over a sequence: pass the same sequence's q, k, v (`nq == nk`, query i at
    position i), usually with `causal=True` and a window. External memory: queries separate from
    the stored keys (positions default to after the keys). `index` is a method name (an index is
    built) or an index already built over these keys with `build_index` (reused).
    Candidate sets are built for blocks of `query_block` queries at a time, which bounds their
    memory.

    `top_k=None` (the default) attends to every candidate: with an IVF index, every key of the
    lists a query probes; `top_k=K`, to the best K of them. With an IVF index over a
    single-lift geometry (and no window or sinks) each IVF list is scored against all the
    queries probing it in one dense block (`ivf_blocks`). Every probed key is the default
    because it is both more accurate and cheaper than the best K of the same keys: selecting
    K costs more than attending to them all (docs/indexes.md, "Every probed key or the best
    K"). `per_query` (a FAISS index's neighbours per query) defaults to `top_k`, else 64.
    With `causal=True` a query that read no key at or before its position attends exactly over
    the keys it may see (`_visible_keys_where_none_was_read`).

    With `index="clusters"` (or a `KeyClusters` built over these keys and values) each query
    reads the keys of its most massive clusters up to `budget` (a fraction of all keys) plus the
    window (the last `window` keys) and the first `sinks` keys exactly (`tail_attention`;
    `top_k` is not used); `tail=True` adds the estimate of every other cluster, so that `lse`
    estimates the full log-partition. With `causal=True` a query at position p reads its own
    segment of keys up to p exactly and estimates the keys before it from clusters of exactly
    those keys (`causal_tail_attention`; a `KeyClusters` passed in is not used then).
    `measured_queries` is tail attention's option (index/tail/measured.py), clusters only.

    Returns `(out, lse)` as `sparse_attention`; gradients reach q, k, v and the geometry.
    With no queries or no keys there is nothing to read: dense attention's answer (empty, or
    0 and `lse = -inf` per query), no index built.
    """
    if q.dim() != 2 or k.dim() != 2:
        raise ValueError(
            f"retrieval_attention takes one head: q (nq, d) and k (nk, d), got {tuple(q.shape)} "
            f"and {tuple(k.shape)}"
        )
    if q.shape[0] == 0 or k.shape[0] == 0:
        # Nothing to read: dense attention checks the inputs and answers without an index, on
        # the autograd graph (no queries: `(0, dv)` and `(0,)`; no keys: 0 and -inf per query).
        return dense_attention(q, k, v, geometry)
    clustered = index == "clusters" or isinstance(index, KeyClusters)
    if measured_queries and not clustered:
        raise ValueError("measured_queries needs index='clusters' or a KeyClusters (tail)")
    if clustered:
        out, lse = _cluster_attention(
            q,
            k,
            v,
            geometry,
            index,
            budget=budget,
            tail=tail,
            window=window,
            sinks=sinks,
            causal=causal,
            positions=positions,
            measured_queries=measured_queries,
        )
        # The clusters compute in their own dtype; `out` comes back in the queries', as on
        # every other path (`sparse_attention`), `lse` in the computing one.
        return out.to(q.dtype), lse
    if tail:
        raise ValueError("tail=True needs index='clusters' or a KeyClusters")
    if isinstance(index, str):
        index = build_index(k, geometry, index)
    elif index.ntotal != k.shape[0]:
        raise ValueError(f"the index holds {index.ntotal} keys but {k.shape[0]} were given")
    if positions is None:
        positions = query_positions(q.shape[0], k.shape[0], q.device)
    if supports_ivf_blocks(index) and window == 0 and sinks == 0:
        if top_k is None and _probes_every_list(index):
            return _every_key_attention(q, k, v, geometry, positions if causal else None)
        out, lse = _ivf_list_attention(
            q, k, v, geometry, index, top_k, positions if causal else None
        )
    elif not (window or sinks) and fused_lsh_applies(index, geometry, q, k, v):
        out, lse = lsh_attention(
            q, k, v, geometry, index, top_k=top_k, positions=positions if causal else None
        )
    else:
        out, lse = _candidate_attention(
            q, k, v, geometry, index, top_k=top_k, per_query=per_query, window=window,
            sinks=sinks, causal=causal, positions=positions, query_block=query_block,
        )  # fmt: skip
    if causal:
        out, lse = _visible_keys_where_none_was_read(q, k, v, geometry, positions, out, lse)
    return out, lse


def _visible_keys_where_none_was_read(q, k, v, geometry, positions, out, lse):
    """A causal call's answer with every query that read no key (`lse` -inf: none of its
    candidates or probed lists' keys lies at or before its position) attending exactly over the
    keys it may see, `[0, position]`, which it would otherwise answer 0 for. Such queries are
    early ones whose index neighbours all come after them, where queries and keys differ (a
    prefill's); their prefixes are short (docs/indexes.md, "Causal queries that read no key")."""
    empty = torch.isneginf(lse.detach()).nonzero().squeeze(-1)
    if len(empty) == 0:
        return out, lse
    seen = positions[empty]
    last = int(seen.max()) + 1
    exact_out, exact_lse = _every_key_attention(q[empty], k[:last], v[:last], geometry, seen)
    out = out.index_put((empty,), exact_out.to(out.dtype))
    lse = lse.index_put((empty,), exact_lse.to(lse.dtype))
    return out, lse


def _probes_every_list(index: GeometryIndex) -> bool:
    """Whether every query probes every list of a single-lift IVF index (`nprobe` at least its
    lists: a context of fewer than 2304 keys at the defaults)."""
    ivf = index.parts[0].index
    return ivf.nprobe >= ivf.nlist


def _every_key_attention(q, k, v, geometry, positions):
    """`retrieval_attention` where every list is probed: exact attention over every key
    (`dense_attention`; with `positions`, causal), which the probed lists would give less their
    least massive lists (`IndexSettings.probe_mass`), at a fraction of the cost (docs/
    indexes.md, "Every list probed")."""
    mask = None
    if positions is not None:
        mask = torch.arange(k.shape[0], device=k.device) <= positions.unsqueeze(-1)
    return dense_attention(q, k, v, geometry, mask)


def _ivf_list_attention(q, k, v, geometry, index, top_k, positions):
    """`retrieval_attention` through an IVF index's lists scored in dense blocks (`ivf_blocks`):
    the top K of the probed lists' keys, or (`top_k=None`) every one of them; `positions`:
    causal. Memory is bounded per IVF list here, so every query goes through in one pass.
    Half-precision inputs are computed in float32 (`compute_dtype`) and `out` returned in their
    dtype, as `sparse_attention` does."""
    dtype = compute_dtype(q.dtype)
    qw, v = geometry.witness(q.to(dtype)), v.to(dtype)
    # The indexed witnesses carry no gradient; fresh ones are needed only for autograd.
    kw = geometry.witness(k.to(dtype)) if torch.is_grad_enabled() else index.keys.to(dtype)
    if top_k is None:
        out, lse = ivf_block_attention(index, qw, v, keys_w=kw, positions=positions)
    else:
        logits, ids = ivf_block_topk(index, qw, top_k, keys_w=kw, positions=positions)
        out, lse = (t[0] for t in attend_scored(logits[None], ids[None], v[None]))
    return geometry.output_map(out).to(q.dtype), lse


def _candidate_attention(
    q, k, v, geometry, index, *, top_k, per_query, window, sinks, causal, positions, query_block
):
    """`retrieval_attention` over candidate sets (the index's, the window's and the sinks'),
    built for `query_block` queries at a time: sparse attention over their top K, or (`top_k`
    None) every candidate."""
    outs, lses = [], []
    for start in range(0, q.shape[0], query_block):
        block = slice(start, start + query_block)
        candidates = retrieval_candidates(
            q[block],
            index,
            k.shape[0],
            per_query=per_query or top_k or 64,
            window=window,
            sinks=sinks,
            causal=causal,
            positions=positions[block],
        )
        width = max(candidates.indices.shape[-1], 1)
        out, lse = sparse_attention(q[block], k, v, geometry, candidates.indices, top_k or width)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def _cluster_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    geometry: Geometry,
    clusters: KeyClusters | str,
    *,
    budget: float,
    tail: bool,
    window: int,
    sinks: int,
    causal: bool,
    positions: torch.Tensor | None,
    measured_queries: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`retrieval_attention` over a clustered context (`tail_attention`, or
    `causal_tail_attention`)."""
    if causal:
        if positions is None:
            positions = query_positions(q.shape[0], k.shape[0], q.device)
        return causal_tail_attention(
            q, k, v, geometry, positions, budget=budget, tail=tail, window=window, sinks=sinks,
            measured_queries=measured_queries,
        )  # fmt: skip
    if isinstance(clusters, str):
        with torch.no_grad():
            clusters = KeyClusters.build(geometry.witness(k), v, geometry)
    elif clusters.n_keys != k.shape[0]:
        raise ValueError(f"the clusters hold {clusters.n_keys} keys but {k.shape[0]} were given")
    always = window_and_sinks(k.shape[0], window, sinks, k.device)
    return tail_attention(
        q, clusters, budget=budget, tail=tail, always=always, measured_queries=measured_queries
    )


def window_and_sinks(n_keys: int, window: int, sinks: int, device: torch.device) -> torch.Tensor:
    """The ids of the first `sinks` and the last `window` of `n_keys` keys (tail attention's
    `always`: read exactly by every query)."""
    return torch.cat(
        [
            torch.arange(min(sinks, n_keys), device=device),
            torch.arange(max(n_keys - window, 0), n_keys, device=device),
        ]
    )
