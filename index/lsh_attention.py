"""Attention over every composite LSH candidate in one compiled pass per query, for geometries
whose logit is a scaled inner product of two witnesses (docs/indexes.md, "Attention over the
LSH candidates").

`retrieval_attention` with an LSH index and `top_k=None` attends to every key that shares a
bucket with the query in any table. Through `build_candidates` and `sparse_attention` that
meant, per query, a row of `tables x bucket_limit` (3072) slots sorted twice to drop repeats,
and every candidate's key and value row gathered into a copy before the products: at 131,072
keys about 2000 distinct candidates per query, and the self-attention took several times
dense attention's time. Here a compiled loop walks each query's bucket ranges in the sorted
tables, marks the keys it has seen in a stamp array (no sort), scores each new key in place
and adds its value row to the query's sums: the keys and values are read once, never copied.

Applies (`fused_lsh_applies`) on the CPU, without autograd, for a geometry with one product
term and no element-wise stage (`Geometry.score_terms`: the dot product, graded and random-
feature attention); every other case goes through the candidate sets. Numba compiles the loop
on first use and caches it on disk, as the tail's loops (`index/tail/kernel.py`)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch

from rewa.attention import Geometry
from rewa.attention.numerics import compute_dtype

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
    if any(t.device.type != "cpu" for t in (q, k, v)):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return False
    if any(p.requires_grad for p in geometry.parameters()) and torch.is_grad_enabled():
        return False
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
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries `(nq, d)` over every candidate of `index` (the keys sharing a
    bucket with the query in any table, at most `bucket_limit` per bucket), each once; with
    `positions` (causal), none after the query's position. The keys and answer of
    `build_candidates` followed by `sparse_attention` over every candidate: `(out (nq, dv),
    lse (nq,))`, a query with no key `(0, -inf)`. Call only where `fused_lsh_applies`."""
    dtype = compute_dtype(q.dtype)
    with torch.no_grad():
        qw, kw = geometry.witness(q.to(dtype)), index.keys.to(dtype)
        queries, keys, weight = _inner_product_term(geometry, qw, kw)
        first, last = index.bucket_ranges(qw)
        admitted = index.admitted_buckets()
    n_queries = q.shape[0]
    queries = np.ascontiguousarray(queries.numpy())
    keys = np.ascontiguousarray(keys.numpy())
    values = np.ascontiguousarray(v.detach().to(dtype).numpy())
    weight = values.dtype.type(weight)  # the loop's products stay in the context's dtype
    causal = positions is not None
    spots = positions.numpy().astype(np.int64) if causal else np.zeros(n_queries, np.int64)
    arrays = (index.order.numpy(), admitted.numpy(), first.numpy(), last.numpy())
    out = np.zeros((n_queries, values.shape[1]), values.dtype)
    lse = np.full(n_queries, -np.inf, values.dtype)
    loop = _compiled(_bucket_sums)
    # One call per thread: the more queries a call holds, the more of them share each bucket.
    per_call = -(-n_queries // max(1, torch.get_num_threads()))
    calls = [slice(start, start + per_call) for start in range(0, n_queries, per_call)]
    order, admitted, first, last = arrays

    def run(rows: slice) -> None:
        loop(
            queries[rows], keys, values, order, admitted, first[rows], last[rows],
            index.bucket_limit, weight, spots[rows], causal, out[rows], lse[rows],
        )  # fmt: skip

    spread(run, calls)
    result = geometry.output_map(torch.from_numpy(out))
    return result.to(q.dtype), torch.from_numpy(lse)


def _bucket_sums(
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
) -> None:
    """Softmax attention of each query i over its candidates: in table t the keys
    `order[t, first[i, t]:last[i, t]]`, at most `bucket_limit` of them, each counted in the
    first table that yields it (key j came from an earlier table s when `admitted[j, s] ==
    first[i, s]` and that range is not empty) and, when `causal`, none after `positions[i]`;
    logits `weight * <queries[i], keys[j]>`. Writes `out[i]` (`softmax @ values`, given as
    zeros) and `lse[i]` (given as -inf, left so where no key). Run compiled: `_compiled`.

    Table by table, the queries that share a bucket are taken together, so that the bucket's
    keys, values and `admitted` rows are read from memory once for all of them; each query
    keeps an online softmax (its largest logit so far, the sums relative to it) across
    tables."""
    n_queries, dim = queries.shape
    n_tables, value_dim = order.shape[0], values.shape[1]
    own = np.empty((n_queries, n_tables), np.int32)  # first[i, t], -2 where the range is empty
    for i in range(n_queries):
        for t in range(n_tables):
            own[i, t] = first[i, t] if last[i, t] > first[i, t] else -2
    peak = np.full(n_queries, -np.inf, out.dtype)
    total = np.zeros(n_queries, out.dtype)
    logits = np.empty(bucket_limit, out.dtype)
    found = np.empty(bucket_limit, np.int64)
    for t in range(n_tables):
        by_bucket = np.argsort(own[:, t])  # the order within a bucket changes no sum
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


@functools.cache
def _compiled(loop: Callable) -> Callable:
    """`loop` compiled by Numba, without the GIL; Numba is imported here, on first use."""
    import numba

    return numba.njit(nogil=True, cache=True, fastmath={"reassoc", "contract"})(loop)


def compile_ahead(dtypes: tuple[type, ...] = (np.float32, np.float64)) -> None:
    """Compiles the loop for contexts of `dtypes` now, into Numba's cache (the image does it
    when it is built, so that a server's first LSH attention compiles nothing)."""
    for dtype in dtypes:
        rows, table = np.ones((1, 2), dtype), np.zeros((1, 1), np.int64)
        _compiled(_bucket_sums)(
            rows, rows, rows, table, np.zeros((1, 1), np.int32), table, table + 1, 1, 1.0,
            np.zeros(1, np.int64), False, np.zeros((1, 2), dtype), np.full(1, -np.inf, dtype),
        )  # fmt: skip
