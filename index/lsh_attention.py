"""Attention over every composite LSH candidate in one compiled pass, for geometries whose
logit is a scaled inner product of two witnesses (docs/indexes.md, "Attention over the LSH
candidates").

`retrieval_attention` with an LSH index and `top_k=None` attends to every key that shares a
bucket with the query in any table. Through `build_candidates` and `sparse_attention` that
meant, per query, a row of `tables x bucket_limit` (3072) slots sorted twice to drop repeats,
and every candidate's key and value row gathered into a copy before the products. Here a
compiled loop goes table by table; the queries that share a bucket are taken together and read
its keys and values in place, once for all of them; a key is counted in the first table that
yields it (`CompositeLSH.admitted_buckets`), and each query keeps an online softmax across
tables.

Applies (`fused_lsh_applies`) on the CPU, without autograd, for a geometry with one product
term and no element-wise stage (`Geometry.score_terms`: the dot product, graded and random-
feature attention); every other case goes through the candidate sets. Numba compiles the loop
on first use and caches it on disk, as the tail's loops (`index/tail/kernel.py`)."""

from __future__ import annotations

import numpy as np
import torch

from rewa.attention import Geometry
from rewa.attention.geometry import records_grad
from rewa.attention.numerics import compute_dtype
from rewa.attention.sparse import attend_scored

from .compiled import compiled_loop
from .lsh import CompositeLSH
from .tail.threads import spread


def _inner_product_term(geometry: Geometry, qw: torch.Tensor, kw: torch.Tensor):
    """`(queries, keys, weight)` when the geometry's logits are `weight * <queries, keys>` (one
    `ScoreTerm`, no stages, no near-pair correction, one weight), else None."""
    terms = geometry.score_terms(qw, kw)
    if terms is None or len(terms) != 1:
        return None
    (term,) = terms
    if term.stages or term.near is not None:
        return None
    weight = term.weight
    if isinstance(weight, torch.Tensor):
        if weight.numel() != 1:
            return None
        weight = weight.item()
    return term.queries, term.keys, float(weight)


def fused_lsh_applies(
    index: object, geometry: Geometry, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> bool:
    """Whether `lsh_attention` answers for these inputs: an LSH index, CPU tensors, no
    gradient asked, and a geometry whose logit is one scaled inner product."""
    if not isinstance(index, CompositeLSH) or index.order is None:
        return False
    if any(t.device.type != "cpu" for t in (q, k, v, index.order)):
        return False
    if records_grad(geometry, q, k, v):
        return False
    return inner_product_geometry(geometry)


def inner_product_geometry(geometry: Geometry) -> bool:
    """Whether the geometry's logit is one scaled inner product of two witnesses (what the
    compiled loop computes)."""
    with torch.no_grad():
        probe = geometry.witness(torch.zeros(1, geometry.dim))
        return _inner_product_term(geometry, probe, probe) is not None


def lsh_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    geometry: Geometry,
    index: CompositeLSH,
    *,
    top_k: int | None = None,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries `(nq, d)` over every candidate of `index` (the keys sharing a
    bucket with the query in any table, at most `bucket_limit` per bucket), each once, or over
    the `top_k` of them with the largest logits; with `positions` (causal), none after the
    query's position. The keys and answer of `build_candidates` followed by `sparse_attention`:
    `(out (nq, dv), lse (nq,))`, a query with no key `(0, -inf)`. Call only where
    `fused_lsh_applies`."""
    dtype = compute_dtype(q.dtype)
    with torch.no_grad():
        qw, kw = geometry.witness(q.to(dtype)), geometry.witness(k.to(dtype))
    values = v.detach().to(dtype)
    if top_k is not None:
        logits, ids = lsh_best(index, geometry, qw, kw, top_k, positions=positions)
        out, lse = (t[0] for t in attend_scored(logits[None], ids[None], values[None]))
    else:
        out = values.new_zeros(q.shape[0], v.shape[1])
        lse = values.new_full((q.shape[0],), float("-inf"))
        no_best = (
            np.zeros((q.shape[0], 0), out.numpy().dtype),
            np.zeros((q.shape[0], 0), np.int64),
        )
        _walk(
            index, geometry, qw, kw, values.numpy(), positions, out.numpy(), lse.numpy(), *no_best
        )
    return geometry.output_map(out).to(q.dtype), lse


def lsh_best(
    index: CompositeLSH,
    geometry: Geometry,
    queries_w: torch.Tensor,
    keys_w: torch.Tensor,
    k: int,
    *,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` distinct candidates of `index` with the largest logits per query, from the
    witnesses: `(logits, ids)` of shape `(nq, k)`, logits descending, `-inf` / `-1` where fewer
    exist (`CompositeLSH.search`'s answer, through `best_candidates`); with `positions`, none
    after the query's position. Call only where `fused_lsh_applies`."""
    dtype = compute_dtype(queries_w.dtype)  # half-precision witnesses ranked in float32
    queries_w, keys_w = queries_w.to(dtype), keys_w.to(dtype)
    n_queries = queries_w.shape[0]
    best = torch.full((n_queries, k), float("-inf"), dtype=dtype)
    best_ids = torch.full((n_queries, k), -1, dtype=torch.int64)
    unused = np.zeros((1, 1), best.numpy().dtype)  # no values, no sums: the loop only ranks
    sums = (np.zeros((n_queries, 1), unused.dtype), np.zeros(n_queries, unused.dtype))
    _walk(index, geometry, queries_w, keys_w, unused, positions, *sums, best.numpy(),
          best_ids.numpy())  # fmt: skip
    best, order = best.sort(dim=-1, descending=True)
    return best, best_ids.gather(-1, order).masked_fill(torch.isinf(best), -1)


def _walk(
    index, geometry, queries_w, keys_w, values, positions, out, lse, best_logits, best_ids
) -> None:
    """`_bucket_walk` over the queries in one call per thread (the more queries a call holds,
    the more of them share each bucket), writing `out` and `lse` or, when they have columns,
    `best_logits` and `best_ids` (numpy arrays, one row per query)."""
    with torch.no_grad():
        queries, keys, weight = _inner_product_term(geometry, queries_w, keys_w)
        first, last = index.bucket_ranges(queries_w)
        admitted = index.admitted_buckets()
    n_queries = queries_w.shape[0]
    queries = np.ascontiguousarray(queries.numpy())
    keys = np.ascontiguousarray(keys.numpy())
    values = np.ascontiguousarray(values)
    weight = keys.dtype.type(weight)  # the loop's products stay in the context's dtype
    causal = positions is not None
    spots = positions.numpy().astype(np.int64) if causal else np.zeros(n_queries, np.int64)
    order, admitted, first, last = (t.numpy() for t in (index.order, admitted, first, last))
    loop = compiled_loop(_bucket_walk)
    per_call = max(1, -(-n_queries // max(1, torch.get_num_threads())))

    def run(start: int) -> None:
        rows = slice(start, start + per_call)
        loop(
            queries[rows], keys, values, order, admitted, first[rows], last[rows],
            index.bucket_limit, weight, spots[rows], causal, out[rows], lse[rows],
            best_logits[rows], best_ids[rows],
        )  # fmt: skip

    spread(run, range(0, n_queries, per_call))


def _bucket_walk(
    queries: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    order: np.ndarray,
    admitted: np.ndarray,
    first: np.ndarray,
    last: np.ndarray,
    bucket_limit: int,
    weight: float,
    positions: np.ndarray,
    causal: bool,
    out: np.ndarray,
    lse: np.ndarray,
    best: np.ndarray,
    best_ids: np.ndarray,
) -> None:
    """Each query i's candidates: in table t the keys `order[t, first[i, t]:last[i, t]]`, at
    most `bucket_limit` of them, each counted in the first table that yields it (key j came
    from an earlier table s when `admitted[j, s] == first[i, s]` and that range is not empty)
    and, when `causal`, none after `positions[i]`; logits `weight * <queries[i], keys[j]>`.

    Without columns in `best`: softmax attention over them, `out[i]` (`softmax @ values`,
    given as zeros) and `lse[i]` (given as -inf, left so where no key). With k columns: the k
    largest logits in `best[i]` (given as -inf, in no order) and their keys in `best_ids[i]`.
    Run compiled: `compiled_loop`.

    Table by table, the queries that share a bucket are taken together, so that the bucket's
    keys, values and `admitted` rows are read from memory once for all of them; each query
    keeps an online softmax (its largest logit so far, the sums relative to it) or its k
    largest (and which of them is the least) across tables."""
    n_queries, dim = queries.shape
    n_tables, value_dim = order.shape[0], values.shape[1]
    ranked = best.shape[1] > 0
    own = np.empty((n_queries, n_tables), np.int32)  # first[i, t], -2 where the range is empty
    for i in range(n_queries):
        for t in range(n_tables):
            own[i, t] = first[i, t] if last[i, t] > first[i, t] else -2
    peak = np.full(n_queries, -np.inf, keys.dtype)
    total = np.zeros(n_queries, keys.dtype)
    least = np.zeros(n_queries, np.int64)  # the column of best[i]'s smallest logit
    logits = np.empty(bucket_limit, keys.dtype)
    found = np.empty(bucket_limit, np.int64)
    for t in range(n_tables):
        by_bucket = np.argsort(own[:, t])  # the order within a bucket changes no answer
        group = 0
        while group < n_queries:
            bucket = own[by_bucket[group], t]
            end = group + 1
            while end < n_queries and own[by_bucket[end], t] == bucket:
                end += 1
            if bucket >= 0:
                stop = min(last[by_bucket[group], t], bucket + bucket_limit)
                for member in range(group, end):
                    i = by_bucket[member]
                    query, earlier = queries[i], own[i]
                    count, top = 0, peak[i]
                    for slot in range(bucket, stop):
                        key = order[t, slot]
                        if causal and key > positions[i]:
                            continue
                        rows = admitted[key]
                        repeats = 0
                        for s in range(t):
                            repeats += rows[s] == earlier[s]
                        if repeats > 0:
                            continue
                        row = keys[key]
                        product = query[0] * row[0]
                        for c in range(1, dim):
                            product += query[c] * row[c]
                        logits[count] = weight * product
                        found[count] = key
                        top = max(top, logits[count])
                        count += 1
                    if ranked:
                        for j in range(count):
                            if logits[j] > best[i, least[i]]:
                                best[i, least[i]] = logits[j]
                                best_ids[i, least[i]] = found[j]
                                lowest = 0
                                for column in range(1, best.shape[1]):
                                    if best[i, column] < best[i, lowest]:
                                        lowest = column
                                least[i] = lowest
                        continue
                    if count == 0:
                        continue
                    if top > peak[i]:
                        rescale = np.exp(peak[i] - top)
                        total[i] *= rescale
                        for c in range(value_dim):
                            out[i, c] *= rescale
                        peak[i] = top
                    sums = np.zeros(value_dim, out.dtype)  # fresh: known not to alias `values`
                    for j in range(count):
                        share = np.exp(logits[j] - peak[i])
                        total[i] += share
                        row = values[found[j]]
                        for c in range(value_dim):
                            sums[c] += share * row[c]
                    for c in range(value_dim):
                        out[i, c] += sums[c]
            group = end
    for i in range(n_queries):
        if total[i] > 0:
            for c in range(value_dim):
                out[i, c] /= total[i]
            lse[i] = peak[i] + np.log(total[i])


def compile_ahead(dtypes: tuple[type, ...] = (np.float32, np.float64)) -> None:
    """Compiles the loop for contexts of `dtypes` now, into Numba's cache (the image does it
    when it is built, so that a server's first LSH attention or search compiles nothing)."""
    for dtype in dtypes:
        rows, table = np.ones((1, 2), dtype), np.zeros((1, 1), np.int64)
        for columns in (0, 1):
            compiled_loop(_bucket_walk)(
                rows, rows, rows, table, np.zeros((1, 1), np.int32), table, table + 1, 1,
                dtype(1), np.zeros(1, np.int64), False, np.zeros((1, 2), dtype),
                np.full(1, -np.inf, dtype), np.full((1, columns), -np.inf, dtype),
                np.full((1, columns), -1, np.int64),
            )  # fmt: skip
