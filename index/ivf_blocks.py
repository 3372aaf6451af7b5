"""Exact top-K attention over the cells of a FAISS IVF index, scored in dense blocks.

FAISS IVF keeps its coarse quantizer and inverted lists; instead of scanning every (query, list)
pair one query at a time and then gathering the winners again to score them, each list's keys
are scored against all the queries that probe it in one dense `geometry.score` block (a matrix
product for the dot product). Each block keeps its top K per query; the per-query results merge
into the exact top K over the probed lists, with their exact logits (`ivf_block_topk`).

`ivf_block_attention` attends to every key of the probed lists instead: a softmax per block, and
the blocks of one query merged exactly (docs/mathematics.md 7). No top-K selection and no gather:
matrix products and one exponential per score, and at least the accuracy of top K over the same
lists. These are the paths `retrieval_attention` takes for a single-lift geometry indexed with IVF.
"""

from __future__ import annotations

import torch

from rewa.attention import Geometry, merge_attention
from rewa.attention.sparse import softmax_attend

from .faiss_index import GeometryIndex


def supports_ivf_blocks(index: object) -> bool:
    """True for a `GeometryIndex` with one IVF part (every geometry but the product)."""
    return (
        isinstance(index, GeometryIndex)
        and index.settings.kind == "ivf"
        and len(index.parts) == 1
        and index.parts[0].device == "cpu"
    )


def _probe_pairs(index: GeometryIndex, queries_w: torch.Tensor):
    """Lists, probes `(nq, nprobe)`, and the (query, probe) pairs grouped by list."""
    part = index.parts[0]
    lists = part.lists(queries_w.device)
    (query_lift,) = index.geometry.lift(queries_w, "query")
    probes = part.probe(query_lift.vectors)
    pair_cell = probes.flatten()
    pair_order = pair_cell.argsort(stable=True)
    cells = torch.arange(len(lists) + 1, device=pair_cell.device)
    bounds = torch.searchsorted(pair_cell[pair_order], cells).tolist()
    return lists, probes, pair_order, bounds


def ivf_block_attention(
    index: GeometryIndex,
    queries_w: torch.Tensor,
    values: torch.Tensor,
    *,
    keys_w: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(out (nq, dv), lse (nq,))` of each query over every key of the IVF lists it probes;
    with `positions`, keys after a query's position are excluded (causal).
    `keys_w` are the key witnesses to score (default: the indexed ones, which carry no
    gradient); pass witnesses computed under autograd for gradients to the keys."""
    geometry: Geometry = index.geometry
    lists, probes, pair_order, bounds = _probe_pairs(index, queries_w)
    n_queries, nprobe = probes.shape
    order = torch.cat(lists)
    keys_w = index.keys if keys_w is None else keys_w
    list_keys, list_values = keys_w[order], values[order]  # contiguous per list
    list_bounds = [0, *torch.tensor([len(ids) for ids in lists]).cumsum(0).tolist()]
    outs = values.new_zeros(n_queries * nprobe, values.shape[-1])
    lses = queries_w.new_full((n_queries * nprobe,), float("-inf"))
    for cell in range(len(lists)):
        start, stop = bounds[cell], bounds[cell + 1]
        first, last = list_bounds[cell], list_bounds[cell + 1]
        if start == stop or first == last:
            continue
        pairs = pair_order[start:stop]
        queries = pairs // nprobe
        logits = geometry.score(queries_w[queries], list_keys[first:last])
        if positions is not None:
            late = order[first:last] > positions[queries].unsqueeze(-1)
            logits = logits.masked_fill(late, float("-inf"))
        outs[pairs], lses[pairs] = softmax_attend(logits, list_values[first:last])
    parts = list(
        zip(
            outs.view(n_queries, nprobe, -1).unbind(1),
            lses.view(n_queries, nprobe).unbind(1),
            strict=True,
        )
    )
    return merge_attention(*parts)


def ivf_block_topk(
    index: GeometryIndex,
    queries_w: torch.Tensor,
    top_k: int,
    *,
    keys_w: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact logits and key ids `(nq, top_k)` of each query's best keys among the IVF lists it
    probes (`-inf` / `-1` where fewer exist). With `positions`, keys after a query's position are
    excluded (causal); `keys_w` as in `ivf_block_attention`."""
    geometry: Geometry = index.geometry
    keys_w = index.keys if keys_w is None else keys_w
    lists, probes, pair_order, bounds = _probe_pairs(index, queries_w)
    n_queries, nprobe = probes.shape
    best = queries_w.new_full((n_queries, nprobe, top_k), float("-inf"))
    ids = torch.full((n_queries, nprobe, top_k), -1, dtype=torch.long, device=queries_w.device)
    for cell, keys in enumerate(lists):
        start, stop = bounds[cell], bounds[cell + 1]
        if start == stop or keys.numel() == 0:
            continue
        pairs = pair_order[start:stop]
        queries, slots = pairs // nprobe, pairs % nprobe
        logits = geometry.score(queries_w[queries], keys_w[keys])
        if positions is not None:
            logits = logits.masked_fill(keys > positions[queries].unsqueeze(-1), float("-inf"))
        values, where = logits.topk(min(top_k, keys.numel()), dim=-1, sorted=False)
        best[queries, slots, : values.shape[-1]] = values
        ids[queries, slots, : values.shape[-1]] = keys[where]
    merged, where = best.flatten(1).topk(min(top_k, nprobe * top_k), dim=-1)
    chosen = ids.flatten(1).gather(-1, where)
    return merged, chosen.masked_fill(torch.isinf(merged), -1)


def probed_keys(index: GeometryIndex, queries_w: torch.Tensor) -> torch.Tensor:
    """Every key of the lists each query probes, `(nq, C)` padded with -1 (for measuring the
    candidate set of `ivf_block_attention`)."""
    lists, probes, _, _ = _probe_pairs(index, queries_w)
    rows = [torch.cat([lists[c] for c in row.tolist()]) for row in probes]
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), width), -1, dtype=torch.long, device=queries_w.device)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out
