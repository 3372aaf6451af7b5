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

Which lists a query reads is decided from tail attention's estimate over each list's feature
moments (`list_moments`, `probes_by_mass`; docs/indexes.md, "Lists read by their estimated
mass"): it probes the `nprobe` lists of largest estimated weight per key and reads them, most
massive first, until those left hold less than `IndexSettings.probe_mass` of their estimated
total. Concentrated attention then reads one or two lists, diffuse attention all `nprobe`.
Causal calls read every probed list (a list's moments count keys after the query's position).
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field

import torch

from rewa.attention import Geometry, merge_attention, merge_stacked
from rewa.attention.geometry import records_grad
from rewa.attention.numerics import compute_dtype
from rewa.attention.sparse import softmax_attend

from . import largest
from .block_scoring import block_scorer
from .clusters import key_features, query_features
from .faiss_index import GeometryIndex, LiftIndex, faiss
from .tail.estimate import log_mean_weight

ESTIMATE_BLOCK = 8192  # queries whose probed lists are estimated at once on the CPU
# On a GPU: more queries at once (a block's tables are megabytes; fewer blocks, fewer launches).
DEVICE_ESTIMATE_BLOCK = 65536
# `_padded_list_attention` (a GPU's path): the (query, list) pairs of one list scored together,
# and the logits of one chunk of such blocks at most (elements; 2^26 are 256 MiB in float32).
PAIRS_PER_BLOCK = 128
PADDED_CHUNK_ELEMENTS = 1 << 26
BLOCK_LOGITS = 1 << 21
"""Logits of one block of `_running_attention` at most (8 MB in float32, a dense CPU tile's
size): a list that most queries probe is scored in blocks of its queries, not in one matrix
of gigabytes (docs/benchmark-notes.md, "Block logits from the product form")."""
SHORTLIST = 2  # lists estimated per probed list, picked by their keys' mean similarity


def supports_ivf_blocks(index: object) -> bool:
    """True for a `GeometryIndex` with one IVF part (every geometry but the product), on
    either FAISS device (the lists are read from it once, `LiftIndex.lists`)."""
    return (
        isinstance(index, GeometryIndex) and index.settings.kind == "ivf" and len(index.parts) == 1
    )


@dataclass
class ListMoments:
    """The feature moments of each IVF list's keys (`clusters.key_features`, the features in
    which a lift similarity is affine): `counts (nlist,)`, `mean (nlist, D)`, the per-feature
    `variance (nlist, D)` and `radius (nlist,)`, the largest `|b - mean|` in the list."""

    counts: torch.Tensor
    mean: torch.Tensor
    variance: torch.Tensor
    radius: torch.Tensor
    _search: faiss.Index | None = field(default=None, repr=False)

    @functools.cached_property
    def nonempty(self) -> torch.Tensor:
        """The lists that hold keys, ascending (the counts never change)."""
        return torch.nonzero(self.counts).squeeze(-1)

    @functools.cached_property
    def nonempty_mean(self) -> torch.Tensor:
        """The non-empty lists' mean features `(len(nonempty), D)`, which every block of
        queries' shortlist scores (gathered once)."""
        return self.mean[self.nonempty]

    def search_index(self) -> faiss.Index:
        """A flat inner-product FAISS index over the non-empty lists' mean features (ids are
        positions in `nonempty`), made on first use."""
        if self._search is None:
            means = self.nonempty_mean.detach().to("cpu", torch.float32).contiguous()
            self._search = faiss.IndexFlatIP(means.shape[-1])
            self._search.add(means.numpy())
        return self._search


_moments: weakref.WeakKeyDictionary[LiftIndex, tuple[int, ListMoments]] = (
    weakref.WeakKeyDictionary()
)


@torch.no_grad()
def list_moments(index: GeometryIndex) -> ListMoments:
    """The `ListMoments` of a single-lift IVF index, computed once per set of indexed keys (an
    `extend` changes the part's key count; `add` makes new parts)."""
    part = index.parts[0]
    cached = _moments.get(part)
    if cached is not None and cached[0] == part.ntotal:
        return cached[1]
    ids, counts = part.list_layout(index.keys.device)
    n_lists = len(counts)
    keys = index.keys.detach()
    (lift,) = index.geometry.lift(keys.to(compute_dtype(keys.dtype)), "key")  # float32 for half
    features = key_features([lift])[ids]
    label = torch.repeat_interleave(torch.arange(n_lists, device=features.device), counts)
    size = counts.clamp_min(1).to(features.dtype).unsqueeze(-1)
    mean = features.new_zeros(n_lists, features.shape[-1]).index_add_(0, label, features) / size
    centred = features - mean[label]
    variance = torch.zeros_like(mean).index_add_(0, label, centred.square()) / size
    radius = mean.new_zeros(n_lists).scatter_reduce_(
        0, label, centred.norm(dim=-1), "amax", include_self=False
    )
    moments = ListMoments(counts.to(features.dtype), mean, variance, radius)
    _moments[part] = (part.ntotal, moments)
    return moments


def prepare_list_moments(index: object) -> None:
    """Compute an index's `list_moments` now where the block paths will read them (a
    `supports_ivf_blocks` index), so that a build thread pays for them, not the first attend."""
    if supports_ivf_blocks(index):
        list_moments(index)


def shortlist(moments: ListMoments, a: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` non-empty lists whose keys' mean features have the largest inner product with
    each query's feature block `a`: `(products, lists)`, both `(nq, k)`, largest first. On the
    CPU a matrix product and each row's k largest by a compiled loop (`largest.row_largest`)
    where it takes k of the lists (`largest.applies`: a few of many), else FAISS's flat search
    (a matrix product and a heap per query, faster there than `torch.topk`); torch's top k on
    another device (docs/indexes.md, "The probes' shortlist")."""
    if a.device.type != "cpu":
        return shortlist_torch(moments, a, k)
    nonempty = moments.nonempty
    if not largest.applies(k, len(nonempty), a.dtype):
        return shortlist_faiss(moments, a, k)
    products, found = largest.row_largest(a @ moments.nonempty_mean.T, k)
    return products, nonempty[found]


def shortlist_faiss(moments: ListMoments, a: torch.Tensor, k: int):
    """`shortlist` by FAISS (float32 search, products returned in `a`'s dtype, on the CPU)."""
    queries = a.detach().to("cpu", torch.float32).contiguous().numpy()
    products, found = moments.search_index().search(queries, k)
    nonempty = moments.nonempty
    found = nonempty[torch.from_numpy(found).to(nonempty.device)]
    return torch.from_numpy(products).to(a.device, a.dtype), found


def shortlist_torch(moments: ListMoments, a: torch.Tensor, k: int):
    """`shortlist` by torch, on `a`'s device."""
    nonempty = moments.nonempty
    products, found = (a @ moments.nonempty_mean.T).topk(k)
    return products, nonempty[found]


@torch.no_grad()
def probes_by_mass(
    index: GeometryIndex, queries_w: torch.Tensor, nprobe: int, tolerance: float
) -> torch.Tensor:
    """The lists each query reads, `(nq, nprobe)` most massive first, -1 where it reads fewer.
    From the lists' moments (`list_moments`): the `SHORTLIST` x `nprobe` lists whose keys have
    the largest mean similarity to the query (`shortlist`; a logit grows with the
    similarity), of those the `nprobe` of largest estimated mean weight per key
    (`tail.estimate.log_mean_weight`, which counts the keys' spread) are probed, ranked by
    estimated mass (mean weight times keys), and the least massive are left unread while
    together they hold less than `tolerance` of the probed lists' estimated mass (the most
    massive is always read; `tolerance` 0 reads all `nprobe`)."""
    moments = list_moments(index)
    log_counts = moments.counts.clamp_min(1).log()
    shortlisted = min(SHORTLIST * nprobe, len(moments.nonempty))
    nprobe = min(nprobe, shortlisted)
    probes = []
    step = ESTIMATE_BLOCK if queries_w.device.type == "cpu" else DEVICE_ESTIMATE_BLOCK
    for start in range(0, queries_w.shape[0], step):
        block = queries_w[start : start + step].detach()
        features = query_features(index.geometry.lift(block, "query"))
        a = features.a
        mean, candidates = shortlist(moments, a, shortlisted)
        mean = mean.add_(features.c[:, :1])
        # a matrix product over every list and a gather: faster than gathering the shortlist's
        # variances per query
        variance = (a.square() @ moments.variance.T).gather(-1, candidates)
        half_width = a.norm(dim=-1, keepdim=True) * moments.radius[candidates]
        log_weight = log_mean_weight(index.geometry, block, mean, variance, half_width)
        _, probed = log_weight.topk(nprobe)
        log_mass = log_weight.add_(log_counts[candidates]).gather(-1, probed)
        ranked, order = log_mass.sort(descending=True)
        lists = candidates.gather(-1, probed.gather(-1, order))
        if tolerance > 0:
            weights = torch.softmax(ranked, dim=-1).nan_to_num_(0.0)
            unread = weights.cumsum(-1).sub_(weights) >= 1 - tolerance
            lists = lists.masked_fill_(unread, -1)
        probes.append(lists)
    return torch.cat(probes)


def _probes(index: GeometryIndex, queries_w: torch.Tensor, causal: bool = False):
    """Lists, and the lists each query reads `(nq, nprobe)` (-1: none; `probes_by_mass`, all
    `nprobe` where `causal`)."""
    lists = index.parts[0].lists(queries_w.device)
    tolerance = 0.0 if causal else index.settings.probe_mass
    return lists, probes_by_mass(index, queries_w, index.settings.nprobe, tolerance)


def _probe_pairs(index: GeometryIndex, queries_w: torch.Tensor, causal: bool = False):
    """`_probes`, and the (query, probe) pairs grouped by list."""
    lists, probes = _probes(index, queries_w, causal)
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
    keys_w = index.keys if keys_w is None else keys_w
    needs_grad = records_grad(geometry, queries_w, keys_w, values)
    if queries_w.device.type != "cpu" and not needs_grad:
        _, probes = _probes(index, queries_w, positions is not None)
        layout = index.parts[0].list_layout(queries_w.device)
        return _padded_list_attention(
            geometry, queries_w, keys_w, values, layout, probes, positions
        )
    lists, probes, pair_order, bounds = _probe_pairs(index, queries_w, positions is not None)
    n_queries, nprobe = probes.shape
    if not needs_grad:
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
    than the attention). A list's queries are scored in blocks of at most `BLOCK_LOGITS`
    logits: on `tree` (131,072 keys) one list of 1985 keys is probed by 128,070 queries."""
    n_queries = queries_w.shape[0]
    queries_w, score = block_scorer(geometry, queries_w)
    top = queries_w.new_full((n_queries,), float("-inf"))
    total = queries_w.new_zeros(n_queries)
    out = values.new_zeros(n_queries, values.shape[-1])
    for cell, ids in enumerate(lists):
        if bounds[cell] == bounds[cell + 1] or ids.numel() == 0:
            continue
        list_keys, list_values = keys_w.index_select(0, ids), values.index_select(0, ids)
        rows = max(1, BLOCK_LOGITS // ids.numel())
        for start in range(bounds[cell], bounds[cell + 1], rows):
            queries = pair_query[start : min(start + rows, bounds[cell + 1])]
            logits = score(queries_w.index_select(0, queries), list_keys)
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
            out.index_copy_(0, queries, weighted.addmm_(weights, list_values))
            summed = total.index_select(0, queries).mul_(rescale[:, 0]).add_(weights.sum(-1))
            total.index_copy_(0, queries, summed)
            top.index_copy_(0, queries, top_after)
    seen = total > 0
    out = out / torch.where(seen, total, 1).unsqueeze(-1)
    lse = torch.where(seen, top + total.log(), float("-inf"))
    return out, lse


def _padded_list_attention(
    geometry: Geometry,
    queries_w: torch.Tensor,
    keys_w: torch.Tensor,
    values: torch.Tensor,
    layout: tuple[torch.Tensor, torch.Tensor],
    probes: torch.Tensor,
    positions: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ivf_block_attention` without autograd in a few large batched operations, for a GPU,
    where `_running_attention`'s few operations per list cost more to launch than to run.

    The (query, list) pairs are grouped by list into blocks of at most `PAIRS_PER_BLOCK` pairs
    of one list; blocks ordered by their list's size are scored in chunks as one batched
    product `(blocks, pairs, keys)`, each block against its list's keys padded to the longest
    list of the chunk (`PADDED_CHUNK_ELEMENTS` logits at most). Each pair's softmax over its
    list gives `(out, lse)` per pair; a query's pairs merge as `merge_attention` merges parts
    (docs/indexes.md, "IVF lists on a GPU"). The same keys as `_running_attention`, the same
    exact attention over them."""
    device = queries_w.device
    n_queries, nprobe = probes.shape
    list_ids, sizes = layout
    n_lists = len(sizes)
    list_starts = sizes.cumsum(0) - sizes
    # The pairs of each list, and each pair's block: the lists' pairs in blocks of
    # PAIRS_PER_BLOCK, the blocks of shorter lists first.
    pair_list = probes.flatten()
    read = (pair_list >= 0) & (sizes[pair_list.clamp_min(0)] > 0)
    pairs = read.nonzero().squeeze(-1)
    pair_list = pair_list[pairs]
    by_size = torch.sort(sizes, stable=True).indices
    rank_of_list = torch.empty_like(by_size).scatter_(
        0, by_size, torch.arange(n_lists, device=device)
    )
    order = torch.sort(rank_of_list[pair_list], stable=True).indices
    pairs, pair_list = pairs[order], pair_list[order]
    pairs_per_list = torch.bincount(pair_list, minlength=n_lists)
    blocks_per_list = (pairs_per_list + PAIRS_PER_BLOCK - 1) // PAIRS_PER_BLOCK
    first_pair, first_block = (
        _starts_in_order(counts, by_size) for counts in (pairs_per_list, blocks_per_list)
    )
    rank = torch.arange(len(pairs), device=device) - first_pair[pair_list]
    pair_block = first_block[pair_list] + rank // PAIRS_PER_BLOCK
    n_blocks = int(blocks_per_list.sum())
    block_pairs = torch.full((n_blocks, PAIRS_PER_BLOCK), -1, dtype=torch.long, device=device)
    block_pairs[pair_block, rank % PAIRS_PER_BLOCK] = pairs
    block_list = torch.zeros(n_blocks, dtype=torch.long, device=device)
    block_list[pair_block] = pair_list
    block_size = sizes[block_list]
    # Chunks of consecutive blocks (ascending list size) within PADDED_CHUNK_ELEMENTS logits.
    widths = block_size.tolist()
    outs = values.new_zeros(n_queries * nprobe, values.shape[-1])
    lses = queries_w.new_full((n_queries * nprobe,), float("-inf"))
    start = 0
    while start < n_blocks:
        stop = start + 1
        while (
            stop < n_blocks
            and (stop + 1 - start) * PAIRS_PER_BLOCK * widths[stop] <= PADDED_CHUNK_ELEMENTS
        ):
            stop += 1
        width = widths[stop - 1]
        chunk_pairs = block_pairs[start:stop]
        chunk_lists = block_list[start:stop]
        slots = torch.arange(width, device=device)
        in_list = slots < sizes[chunk_lists, None]
        ids = list_ids[(list_starts[chunk_lists, None] + slots).clamp_max(len(list_ids) - 1)]
        queries = chunk_pairs.clamp_min(0) // nprobe
        logits = geometry.score(queries_w[queries], keys_w[ids])
        masked = ~in_list.unsqueeze(1)
        if positions is not None:
            masked = masked | (ids.unsqueeze(1) > positions[queries].unsqueeze(-1))
        out, lse = softmax_attend(logits.masked_fill_(masked, float("-inf")), values[ids])
        valid = chunk_pairs >= 0
        outs[chunk_pairs[valid]] = out[valid]
        lses[chunk_pairs[valid]] = lse[valid]
        start = stop
    return merge_stacked(outs.view(n_queries, nprobe, -1), lses.view(n_queries, nprobe), dim=1)


def _starts_in_order(counts: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Where each list's run starts when the runs of `counts` (per list) lie in `order`."""
    in_order = counts[order]
    return torch.empty_like(counts).scatter_(0, order, in_order.cumsum(0) - in_order)


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
    lists, probes, pair_order, bounds = _probe_pairs(index, queries_w, positions is not None)
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
    candidate set of `ivf_block_attention`, not causal)."""
    lists, probes, _, _ = _probe_pairs(index, queries_w)
    empty = lists[0].new_empty(0)
    rows = [torch.cat([empty] + [lists[c] for c in row.tolist() if c >= 0]) for row in probes]
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), width), -1, dtype=torch.long, device=queries_w.device)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out
