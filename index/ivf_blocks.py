"""Exact top-K attention over the cells of a FAISS IVF index, scored in dense blocks.

FAISS IVF keeps its coarse quantizer and inverted lists; instead of scanning every (query, list)
pair one query at a time and then gathering the winners again to score them, each list's keys
are scored against all the queries that probe it in one dense `geometry.score` block (a matrix
product for the dot product). Each block keeps its top K per query; the per-query results merge
into the exact top K over the probed lists, with their exact logits (`ivf_block_topk`).

`ivf_block_attention` attends to every key of the probed lists instead: each block folded into
a running softmax per query, exact (docs/mathematics.md 7). No top-K selection and no gather:
matrix products and one exponential per score, more of the attention mass than the top K of the
same lists, and less time (docs/indexes.md, "Every probed key or the best K"); it is
`retrieval_attention`'s default. These are the paths `retrieval_attention` takes for a
single-lift geometry indexed with IVF.
"""

from __future__ import annotations

import torch

from rewa.attention import Geometry, merge_attention
from rewa.attention.sparse import softmax_attend

from .block_scoring import block_scorer
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
    keys_w = index.keys if keys_w is None else keys_w
    if not _needs_grad(queries_w, keys_w, values, *geometry.parameters()):
        return _running_attention(
            geometry, queries_w, keys_w, values, lists, pair_order // nprobe, bounds, positions
        )
    order = torch.cat(lists)
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


def _needs_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd would record an operation on these tensors (the inputs and the
    geometry's parameters, such as a trainable temperature, which enter every logit)."""
    return torch.is_grad_enabled() and any(tensor.requires_grad for tensor in tensors)


def _running_attention(
    geometry: Geometry,
    queries_w: torch.Tensor,
    keys_w: torch.Tensor,
    values: torch.Tensor,
    lists: list[torch.Tensor],
    pair_query: torch.Tensor,
    bounds: list[int],
    positions: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ivf_block_attention` without autograd: each list's block is folded into a running
    softmax per query (largest logit, sum of weights, weighted values; docs/mathematics.md 7)
    as it is scored, so no `(nq * nprobe, dv)` partials are kept and no merge follows. A query
    probes a list at most once, so the rows of one block are distinct queries. Each probed
    list's keys and values are gathered when it is scored: lists no query probes are never
    read, and no copy of every key is made (at 1M keys and 4096 queries that copy cost more
    than the attention)."""
    n_queries = queries_w.shape[0]
    queries_w, score = block_scorer(geometry, queries_w)
    top = queries_w.new_full((n_queries,), float("-inf"))
    total = queries_w.new_zeros(n_queries)
    out = values.new_zeros(n_queries, values.shape[-1])
    for cell, ids in enumerate(lists):
        start, stop = bounds[cell], bounds[cell + 1]
        if start == stop or ids.numel() == 0:
            continue
        queries = pair_query[start:stop]
        logits = score(queries_w.index_select(0, queries), keys_w.index_select(0, ids))
        if positions is not None:
            late = ids > positions[queries].unsqueeze(-1)
            logits = logits.masked_fill_(late, float("-inf"))
        top_before = top.index_select(0, queries)
        top_after = torch.maximum(top_before, logits.amax(-1))
        # Rows with no finite logit yet keep a reference of 0: their weights are all 0.
        reference = torch.where(torch.isfinite(top_after), top_after, 0.0)
        weights = logits.sub_(reference.unsqueeze(-1)).exp_()
        rescale = (top_before - reference).exp_().unsqueeze(-1)
        weighted = out.index_select(0, queries).mul_(rescale)
        out.index_copy_(0, queries, weighted.addmm_(weights, values.index_select(0, ids)))
        summed = total.index_select(0, queries).mul_(rescale[:, 0]).add_(weights.sum(-1))
        total.index_copy_(0, queries, summed)
        top.index_copy_(0, queries, top_after)
    seen = total > 0
    out = out / torch.where(seen, total, 1).unsqueeze(-1)
    lse = torch.where(seen, top + total.log(), float("-inf"))
    return out, lse


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
    # Each list's block fills the consecutive rows of its pairs (pairs in list order), so every
    # write is a slice; one gather at the end puts each query's nprobe rows side by side.
    best = queries_w.new_empty(n_queries * nprobe, top_k)
    id_type = torch.int32 if keys_w.shape[0] < 2**31 else torch.long  # half the bytes to gather
    ids = torch.empty(n_queries * nprobe, top_k, dtype=id_type, device=queries_w.device)
    pair_query = pair_order // nprobe
    queries_w, score = block_scorer(geometry, queries_w)
    best[: bounds[0]], ids[: bounds[0]] = float("-inf"), -1  # probes FAISS left at -1
    for cell, keys in enumerate(lists):
        start, stop = bounds[cell], bounds[cell + 1]
        if start == stop:
            continue
        kept = min(top_k, keys.numel())
        if kept < top_k:  # a list shorter than K: its rows are padded
            best[start:stop, kept:], ids[start:stop, kept:] = float("-inf"), -1
            if kept == 0:
                continue
        queries = pair_query[start:stop]
        logits = score(queries_w.index_select(0, queries), keys_w.index_select(0, keys))
        if positions is not None:
            logits = logits.masked_fill_(keys > positions[queries].unsqueeze(-1), float("-inf"))
        values, where = logits.topk(kept, dim=-1, sorted=False)
        best[start:stop, :kept] = values
        ids[start:stop, :kept] = keys[where]
    by_query = torch.empty_like(pair_order).index_copy_(
        0, pair_order, torch.arange(len(pair_order), device=pair_order.device)
    )
    best = best.index_select(0, by_query).view(n_queries, nprobe * top_k)
    ids = ids.index_select(0, by_query).view(n_queries, nprobe * top_k)
    merged, where = best.topk(min(top_k, nprobe * top_k), dim=-1)
    chosen = ids.gather(-1, where).long()
    return merged, chosen.masked_fill_(torch.isinf(merged), -1)


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
