"""Exact dense attention for any geometry, tiled over queries and keys with an online softmax.

The forward pass is fused (docs/mathematics.md, "Fused dense attention"): a geometry's logits in
product form (`Geometry.score_terms`) cost one matrix product and a few in-place element-wise
stages per tile, with the softmax in base 2; on CUDA one Triton kernel does it all
(attention/cuda_kernel.py). Memory is O(q_chunk x k_chunk) per batch element in the forward pass
and in the backward pass, which recomputes each tile's logits through `Geometry.score` under
autograd instead of storing them (as FlashAttention does), so a 131072-token self-attention fits
in a few hundred MB. Gradients reach queries, keys, values and every learnable parameter of the
geometry.
"""

from __future__ import annotations

import math

import torch

from . import cpu_kernel, cuda_kernel
from .allocator import retain_freed_memory
from .dot import DotProduct
from .geometry import Geometry, ScoreTerm, check_attention_inputs
from .numerics import (
    NearScreen,
    NearScreens,
    Stage,
    combine_terms_,
    compute_dtype,
    exp2_of_shifted_,
    exp_of_shifted_,
    near_pairs,
    refine_near_pairs,
    screened_row_minima,
    with_pairs_recomputed,
)

DEFAULT_CHUNKS = {"cpu": (None, 1024), "cuda": (2048, 8192)}
"""Tile sizes `(q_chunk, k_chunk)` by device type: on GPUs large tiles, as each tile costs a few
kernel launches; on CPUs tiles of `CPU_TILE_ELEMENTS` logits over the batch (`cpu_query_chunk`)."""
CPU_TILE_ELEMENTS = 1 << 21
"""Logits in one CPU tile, all batch elements together (8 MB in float32): smaller tiles split
into operations too small for the threads to share well, larger ones fall out of the cache
(docs/benchmark-notes.md, "Dense tiles on the CPU (issue 27)")."""
LOG2E = math.log2(math.e)
_SDPA_DTYPES = {
    "cpu": (torch.float32, torch.float64),
    "cuda": (torch.float32, torch.float16, torch.bfloat16),
}


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    geometry: Geometry,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    *,
    q_chunk: int | None = None,
    k_chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax attention `(out, lse)` under `geometry`.

    Args:
        q: queries `(..., Nq, d)`.
        k: keys `(..., Nk, d)`.
        v: values `(..., Nk, dv)`.
        geometry: any `Geometry`; its `dim` must equal `d`.
        mask: optional, broadcastable to `(..., Nq, Nk)`: boolean (True = attend) or float
            (added to the logits).
        causal: query i attends key j only if `j <= i + Nk - Nq` (aligned bottom-right, so
            queries that continue a stored context see all of it; equal to SDPA when Nq = Nk).
        q_chunk, k_chunk: tile sizes (default: `DEFAULT_CHUNKS` of the device; on CPUs
            `cpu_query_chunk` of the batch). On CUDA, float32
            inputs without a user mask run in one fused kernel (attention/cuda_kernel.py)
            instead, for every geometry with a product form.

    Returns:
        `out (..., Nq, dv)` in the dtype of `q` and `lse (..., Nq)` (float32 for half inputs),
        the natural-log partition function of each query's logits. A query that may attend no
        key gets `out = 0`, `lse = -inf`.
    """
    default_q_chunk, default_k_chunk = DEFAULT_CHUNKS.get(q.device.type, DEFAULT_CHUNKS["cuda"])
    k_chunk = default_k_chunk if k_chunk is None else k_chunk
    batch = _checked_batch(q, k, v, geometry, mask, q_chunk, k_chunk)
    if mask is not None and mask.dim() < 2:
        mask = mask.reshape(1, -1)
    q = _with_output_batch(q, k, batch, mask)
    if _sdpa_applies(q, k, v, geometry, mask, causal):
        return _fused_dot_product(q, k, v, geometry.scale, causal)
    if q_chunk is None:
        q_chunk = default_q_chunk or cpu_query_chunk(math.prod(batch), k_chunk)
    dtype = compute_dtype(q.dtype)
    qw = geometry.witness(q.to(dtype))
    kw = geometry.witness(k.to(dtype))
    out, lse = _tiled(qw, kw, v.to(dtype), geometry, mask, causal, q_chunk, k_chunk)
    return geometry.output_map(out).to(q.dtype), lse


def witness_attention(
    qw: torch.Tensor, kw: torch.Tensor, v: torch.Tensor, geometry: Geometry
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention `(out, lse)` of query witnesses `(..., nq, d_w)` over key witnesses
    `(..., nk, d_w)` and values `(..., nk, dv)` of one shape and dtype, no mask, before the
    geometry's output map: what `dense_attention` computes after its witness maps, for callers
    that keep witnesses (the tail's clusters). The dot product's witnesses are its vectors and
    take the fused kernel; every other geometry, the tiles."""
    if _sdpa_applies(qw, kw, v, geometry, None, False):
        return _fused_dot_product(qw, kw, v, geometry.scale, False)
    q_chunk, k_chunk = DEFAULT_CHUNKS.get(qw.device.type, DEFAULT_CHUNKS["cuda"])
    batch = torch.broadcast_shapes(qw.shape[:-2], kw.shape[:-2], v.shape[:-2])
    q_chunk = q_chunk or cpu_query_chunk(math.prod(batch), k_chunk)
    return _tiled(qw, kw, v, geometry, None, False, q_chunk, k_chunk)


def _tiled(qw, kw, v, geometry, mask, causal, q_chunk, k_chunk):
    """`_TiledAttention` over witnesses, with the geometry's trainable parameters."""
    if qw.device.type == "cpu":
        retain_freed_memory()
    params = [p for p in geometry.parameters() if p.requires_grad]
    return _TiledAttention.apply(qw, kw, v, mask, causal, geometry, q_chunk, k_chunk, *params)


def cpu_query_chunk(batch: int, k_chunk: int) -> int:
    """Queries per CPU tile: the power of two in [64, 2048] nearest below `CPU_TILE_ELEMENTS`
    logits for `batch` batch elements and tiles of `k_chunk` keys."""
    rows = max(1, CPU_TILE_ELEMENTS // max(1, batch * k_chunk))
    return min(2048, max(64, 1 << (rows.bit_length() - 1)))


def _checked_batch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    geometry: Geometry,
    mask: torch.Tensor | None,
    q_chunk: int | None,
    k_chunk: int,
) -> torch.Size:
    """The inputs' broadcast batch shape, once they are checked (a clear error for each fault)."""
    check_attention_inputs(q, k, v, geometry)
    if mask is None and q.shape[:-2] == k.shape[:-2] == v.shape[:-2]:
        batch = q.shape[:-2]  # nothing to broadcast (torch.broadcast_shapes costs more)
    else:
        batch = _broadcast_batch(q, k, v, mask)
    if mask is not None and not (mask.dtype == torch.bool or mask.is_floating_point()):
        raise TypeError(f"expected a boolean or floating-point mask, got {mask.dtype}")
    if (q_chunk is not None and q_chunk < 1) or k_chunk < 1:
        raise ValueError(f"expected positive chunk sizes, got {q_chunk} and {k_chunk}")
    return batch


def _with_output_batch(
    q: torch.Tensor, k: torch.Tensor, batch: torch.Size, mask: torch.Tensor | None
) -> torch.Tensor:
    """`q` expanded to the output's batch shape where values (`batch`) or the mask have batch
    dimensions that q and k lack: the tiles' logits, the broadcast of q and k, then take them
    too (a view; the logits of the added batch elements are computed again)."""
    if mask is not None and mask.dim() > 2:
        batch = torch.broadcast_shapes(batch, mask.shape[:-2])
    if torch.broadcast_shapes(q.shape[:-2], k.shape[:-2]) == batch:
        return q
    return q.expand(*batch, *q.shape[-2:])


def _broadcast_batch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Size:
    """The broadcast batch shape of the inputs and the mask, or a clear error."""
    try:
        batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        if mask is not None:
            torch.broadcast_shapes(mask.shape, (*batch, q.shape[-2], k.shape[-2]))
    except RuntimeError as error:
        raise ValueError(f"q, k, v and mask batch shapes do not broadcast: {error}") from None
    return batch


def _sdpa_applies(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    geometry: Geometry,
    mask: torch.Tensor | None,
    causal: bool,
) -> bool:
    """PyTorch's fused kernels return the same `(out, lse)` for the plain dot-product geometry
    on inputs of one shape and dtype: the CPU flash-attention kernel (float32, float64) and the
    CUDA memory-efficient one (float32, float16, bfloat16); use them there."""
    dtypes = _SDPA_DTYPES.get(q.device.type, ())
    return (
        type(geometry) is DotProduct
        and mask is None
        and q.shape[:-2] == k.shape[:-2] == v.shape[:-2]
        and v.shape[-1] == q.shape[-1]
        and q.dtype == k.dtype == v.dtype
        and q.dtype in dtypes
        and q.shape[-2] > 0
        and k.shape[-2] > 0
        and (not causal or q.shape[-2] == k.shape[-2])
    )


def _fused_dot_product(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused kernel on inputs flattened to its `(B, 1, N, d)` layout."""
    batch = q.shape[:-2]
    flat = [t.reshape(math.prod(batch), 1, *t.shape[-2:]) for t in (q, k, v)]
    if q.device.type == "cuda":
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            *flat, None, True, is_causal=causal, scale=scale
        )[:2]
        lse = lse[..., : q.shape[-2]]  # the kernel pads its lse rows to a multiple of 32
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            *flat, is_causal=causal, scale=scale
        )
    return out.reshape(*batch, *out.shape[-2:]), lse.reshape(*batch, lse.shape[-1])


def _key_limit(causal: bool, q_end: int, n_keys: int, offset: int) -> int:
    """Number of leading keys any query of a tile ending at `q_end` may see."""
    return min(n_keys, q_end + offset) if causal else n_keys


def _masks_tile(
    mask: torch.Tensor | None, causal: bool, rows: slice, cols: slice, offset: int
) -> bool:
    """Whether `_mask_tile` changes a tile: a user mask, or a causal tile that reaches past a
    query's position."""
    return mask is not None or (causal and cols.stop - 1 > rows.start + offset)


def _mask_tile(
    logits: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    rows: slice,
    cols: slice,
    offset: int,
    unit: float = 1.0,
) -> torch.Tensor:
    """Apply the user mask and the causal mask to one tile of logits (in units of `1/unit`
    nats: a float mask is multiplied by `unit`)."""
    if mask is not None:
        tile = mask[
            ...,
            rows if mask.shape[-2] > 1 else slice(None),
            cols if mask.shape[-1] > 1 else slice(None),
        ]
        if tile.dtype == torch.bool:
            logits = logits.masked_fill(~tile, float("-inf"))
        else:
            logits = logits.add(tile.to(logits.dtype), alpha=unit)
    if _masks_tile(None, causal, rows, cols, offset):
        query = torch.arange(rows.start, rows.stop, device=logits.device).unsqueeze(-1)
        key = torch.arange(cols.start, cols.stop, device=logits.device)
        logits = logits.masked_fill(key > query + offset, float("-inf"))
    return logits


def _base2_terms(terms: list[ScoreTerm] | None) -> list[ScoreTerm] | None:
    """The terms with `log2(e)` folded into their weights, for logits in base-2 units: the
    linear terms' weights into their queries, the others' as tensors of the queries' dtype and
    device (made once here, not per tile)."""
    if terms is None:
        return None
    return [
        ScoreTerm(term.queries * (term.weight * LOG2E), term.keys)
        if not term.stages
        else term._replace(
            weight=torch.as_tensor(
                term.weight * LOG2E, dtype=term.queries.dtype, device=term.queries.device
            )
        )
        for term in terms
    ]


def _tile_logits(
    qw: torch.Tensor,
    kw: torch.Tensor,
    geometry: Geometry,
    terms: list[ScoreTerm] | None,
    compiled: _CompiledTiles | None,
    rows: slice,
    cols: slice,
) -> torch.Tensor:
    """Logits of one tile in base-2 units (`log2(e)` times the geometry's): from the product
    form (`_base2_terms`) when the geometry has one (`_combined_logits`), else from
    `geometry.score`."""
    if terms is None:
        return geometry.score(qw[..., rows, :], kw[..., cols, :]).mul_(LOG2E)
    return _combined_logits(_tile_products(terms, rows, cols), terms, compiled, rows, cols)


def _tile_products(terms: list[ScoreTerm], rows: slice, cols: slice) -> list[torch.Tensor]:
    """One matrix product per term of the product form, for one tile."""
    return [
        term.queries[..., rows, :] @ term.keys[..., cols, :].transpose(-1, -2) for term in terms
    ]


def _combined_logits(
    products: list[torch.Tensor],
    terms: list[ScoreTerm],
    compiled: _CompiledTiles | None,
    rows: slice,
    cols: slice,
) -> torch.Tensor:
    """The terms' element-wise work on a tile's `products` (`combine_terms_`; compiled where
    the call's tiles are (`compiled`) and the kernel is ready: `_compiled_tile`)."""
    if compiled is not None:
        logits = _compiled_tile(products, compiled, rows, cols)
        if logits is not None:
            return logits
    products = [
        product if term.near is None else refine_near_pairs(product, *term.near.rows(rows, cols))
        for product, term in zip(products, terms, strict=True)
    ]
    return combine_terms_(products, [term.stages for term in terms], [t.weight for t in terms])


def _tile_step(
    qw: torch.Tensor,
    kw: torch.Tensor,
    geometry: Geometry,
    terms: list[ScoreTerm] | None,
    mask: torch.Tensor | None,
    causal: bool,
    rows: slice,
    cols: slice,
    offset: int,
    running_max: torch.Tensor,
    compiled: _CompiledTiles | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One key tile of the online softmax (`softmax_step`) from the tile's logits. Where the
    call's tiles are compiled (`compiled`), a tile of a product form that no mask touches runs
    the logits and the softmax step as one kernel where it is ready (`_compiled_tile`), other
    tiles as two (the logits' and the step's)."""
    masked = mask is not None or causal
    if (
        terms is not None
        and compiled is not None
        and not _masks_tile(mask, causal, rows, cols, offset)
    ):
        products = _tile_products(terms, rows, cols)
        step = _compiled_tile(products, compiled, rows, cols, (running_max, masked))
        if step is not None:
            return step
        # Uncompiled while the kernel compiles: starting the two-kernel path's compilations too
        # would cost their time and memory for kernels unmasked tiles never use.
        logits = _combined_logits(products, terms, None, rows, cols)
        return softmax_step(logits, running_max, masked)
    logits = _tile_logits(qw, kw, geometry, terms, compiled, rows, cols)
    logits = _mask_tile(logits, mask, causal, rows, cols, offset, LOG2E)
    return _softmax_step(logits, running_max, masked, compiled is not None)


def _compiled_tile(
    products: list[torch.Tensor],
    compiled: _CompiledTiles,
    rows: slice,
    cols: slice,
    softmax: tuple[torch.Tensor, bool] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """`combine_terms_` of the call's terms (`compiled.terms`) compiled
    (attention/cpu_kernel.py), with the near-pair screen's row
    minima (`numerics.screened_row_minima`) computed by the same kernel: the logits, or where
    `softmax` gives the running maximum and whether logits may be masked, the online-softmax
    step of them (`softmax_step`) from the same kernel. A tile with near pairs (rare: nearly
    coincident points) has them recomputed and is combined again. None where the kernel is not
    ready (its compilation then starts)."""
    shape = torch.broadcast_shapes(*(product.shape for product in products))
    batch = shape[:-2]
    dtype = products[0].dtype
    terms = compiled.terms
    tile_screens = [None if s is None else s.tile(shape, rows, cols) for s in compiled.screens]
    stages = [term.stages for term in terms]
    weights = compiled.weights(batch)
    scales = compiled.column_scales(tile_screens, shape, cols)
    operands = (_flat_products(products, shape), stages, weights, scales)
    key = cpu_kernel.signature(stages, dtype)
    function = _combine_and_screen
    if softmax is not None:
        running_max, may_be_masked = softmax
        operands += (running_max.reshape(-1, shape[-2]), may_be_masked)
        key = ("combine_softmax_step", may_be_masked, *key)
        function = _combine_softmax_and_screen
    kernel = cpu_kernel.compiled(function, key, *operands)
    if kernel is None:
        return None
    result, minima = kernel(*operands)
    refined = False
    for i, (screen, term) in enumerate(zip(tile_screens, terms, strict=True)):
        if screen is None:
            continue
        index = near_pairs(products[i].expand(shape), minima[i].reshape(*batch, -1), screen)
        if index is not None:
            near = term.near.rows(rows, cols)
            products[i] = with_pairs_recomputed(products[i].expand(shape), index, *near)
            refined = True
    if refined:
        result = kernel(_flat_products(products, shape), *operands[1:])[0]
    if softmax is None:
        return result.reshape(shape)
    weights_tile, row_sums, new_max, rescale = result
    return (
        weights_tile.reshape(shape),
        *(part.reshape(*batch, shape[-2]) for part in (row_sums, new_max, rescale)),
    )


class _CompiledTiles:
    """What the compiled tiles of one call share: each term's near-pair screens
    (`numerics.NearScreens`, None for a term without near pairs), its weight and each column
    tile's column scales in the kernels' layout, made once per call (or column tile) instead
    of per tile."""

    def __init__(self, terms: list[ScoreTerm]) -> None:
        self.terms = terms
        self.screens = [
            None if term.near is None else NearScreens(*term.near, term.queries.dtype)
            for term in terms
        ]
        self._weights: dict[torch.Size, list[torch.Tensor]] = {}
        self._column_scales: dict[tuple, list[torch.Tensor | None]] = {}

    def weights(self, batch: torch.Size) -> list[torch.Tensor]:
        """The terms' weights for a tile of batch shape `batch`, `(prod(batch), 1, 1)` each."""
        if batch not in self._weights:
            self._weights[batch] = [
                _tile_layout(torch.as_tensor(t.weight, dtype=t.queries.dtype), batch, 1)
                for t in self.terms
            ]
        return self._weights[batch]

    def column_scales(
        self, tile_screens: list[NearScreen | None], shape: torch.Size, cols: slice
    ) -> list[torch.Tensor | None]:
        """The tile screens' column scales (`_flat_column_scale`, None for a term without near
        pairs) for a tile of `shape` over the key columns `cols`: a column tile's are the same
        for every query tile."""
        key = (cols.start, cols.stop, shape[:-2])
        if key not in self._column_scales:
            self._column_scales[key] = [
                None if s is None else _flat_column_scale(s, shape) for s in tile_screens
            ]
        return self._column_scales[key]


def _flat_products(products: list[torch.Tensor], shape: torch.Size) -> list[torch.Tensor]:
    """The products broadcast to the tile's `shape`, in the compiled kernels' layout
    `(prod(batch), n, m)`."""
    return [product.expand(shape).reshape(-1, *shape[-2:]) for product in products]


def _flat_column_scale(screen: NearScreen, shape: torch.Size) -> torch.Tensor:
    """The screen's column scale (1 where it has none) in the compiled tiles' layout
    `(batch, 1, m)`."""
    scale = screen.column_scale
    if scale is None:
        scale = screen.row_bound.new_ones(shape[-1])
    return _tile_layout(scale.unsqueeze(-2), shape[:-2], shape[-1])


def _tile_layout(values: torch.Tensor, batch: torch.Size, columns: int) -> torch.Tensor:
    """`values`, broadcasting against `(*batch, 1, columns)`, as a contiguous
    `(prod(batch), 1, columns)` tensor: the layout of the compiled kernels' operands (stride-0
    operands made them several times slower)."""
    return values.expand(*batch, 1, columns).reshape(-1, 1, columns).contiguous()


def _combine_and_screen(
    products: list[torch.Tensor],
    stages: list[tuple[Stage, ...]],
    weights: list[torch.Tensor],
    column_scales: list[torch.Tensor | None],
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """`combine_terms_` leaving its inputs as they are (a compiled function that wrote into its
    inputs would spend a pass writing them back), and the near-pair screen's row minima of
    each product that has a column scale: what `cpu_kernel` compiles."""
    minima = [
        None if scale is None else screened_row_minima(product, scale.squeeze(-2))
        for product, scale in zip(products, column_scales, strict=True)
    ]
    logits = combine_terms_([product.clone() for product in products], stages, weights)
    return logits, minima


def _combine_softmax_and_screen(
    products: list[torch.Tensor],
    stages: list[tuple[Stage, ...]],
    weights: list[torch.Tensor],
    column_scales: list[torch.Tensor | None],
    running_max: torch.Tensor,
    may_be_masked: bool,
) -> tuple[tuple[torch.Tensor, ...], list[torch.Tensor | None]]:
    """`_combine_and_screen` and then `softmax_step` of its logits: what `cpu_kernel` compiles
    for a tile that no mask touches (one kernel call instead of two)."""
    logits, minima = _combine_and_screen(products, stages, weights, column_scales)
    return softmax_step(logits, running_max, may_be_masked), minima


def softmax_step(
    logits: torch.Tensor, running_max: torch.Tensor, may_be_masked: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One key tile of the online softmax in base 2, in place in `logits`: the tile's weights
    `2^(logits - shift)`, their row sums, the new running maximum and the factor
    `2^(running_max - shift)` that rescales what earlier tiles summed (`shift` is the new
    maximum, or 0 in rows where nothing is visible yet)."""
    new_max = torch.maximum(running_max, logits.amax(-1))
    shift = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))
    weights = exp2_of_shifted_(logits.sub_(shift.unsqueeze(-1)), may_be_masked)
    return weights, weights.sum(-1), new_max, torch.exp2(running_max - shift)


def _softmax_step(
    logits: torch.Tensor, running_max: torch.Tensor, may_be_masked: bool, compile_tiles: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`softmax_step`, compiled where `compile_tiles` and the kernel is ready."""
    if compile_tiles:
        key = ("softmax_step", may_be_masked, logits.dtype)
        operands = (logits, running_max, may_be_masked)
        kernel = cpu_kernel.compiled(_softmax_step_copy, key, *operands)
        if kernel is not None:
            return kernel(*operands)
    return softmax_step(logits, running_max, may_be_masked)


def _softmax_step_copy(
    logits: torch.Tensor, running_max: torch.Tensor, may_be_masked: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`softmax_step` leaving `logits` as it is (compiled: `_combine_and_screen`)."""
    return softmax_step(logits.clone(), running_max, may_be_masked)


def _tiled_forward(
    qw: torch.Tensor,
    kw: torch.Tensor,
    v: torch.Tensor,
    geometry: Geometry,
    terms: list[ScoreTerm] | None,
    mask: torch.Tensor | None,
    causal: bool,
    q_chunk: int,
    k_chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The online softmax over key tiles, from base-2 `terms` (`_base2_terms`) or else
    `geometry.score`, in base 2 (`exp2` costs half of `exp` on CPUs, as in
    FlashAttention); `lse` is returned in nats."""
    n_queries, n_keys = qw.shape[-2], kw.shape[-2]
    offset = n_keys - n_queries
    batch = torch.broadcast_shapes(qw.shape[:-2], kw.shape[:-2], v.shape[:-2])
    out = qw.new_zeros(*batch, n_queries, v.shape[-1])
    lse = qw.new_full((*batch, n_queries), float("-inf"))
    n_logits = math.prod(batch) * n_queries * n_keys
    stages = None if terms is None else [term.stages for term in terms]
    compiled = _CompiledTiles(terms) if cpu_kernel.applies(qw, stages, n_logits) else None
    for q_start in range(0, n_queries, q_chunk):
        rows = slice(q_start, min(q_start + q_chunk, n_queries))
        running_max = qw.new_full((*batch, rows.stop - rows.start), float("-inf"))
        total = torch.zeros_like(running_max)
        acc = qw.new_zeros(*batch, rows.stop - rows.start, v.shape[-1])
        for k_start in range(0, _key_limit(causal, rows.stop, n_keys, offset), k_chunk):
            cols = slice(k_start, min(k_start + k_chunk, n_keys))
            step = _tile_step(
                qw, kw, geometry, terms, mask, causal, rows, cols, offset, running_max, compiled
            )  # fmt: skip
            weights, row_sums, running_max, rescale = step
            total = total * rescale + row_sums
            acc = acc * rescale.unsqueeze(-1) + weights @ v[..., cols, :]
        seen = total > 0
        out[..., rows, :] = acc / torch.where(seen, total, torch.ones_like(total)).unsqueeze(-1)
        base2_lse = running_max + total.log2()
        lse[..., rows] = torch.where(seen, base2_lse / LOG2E, lse[..., rows])
    return out, lse


class _TiledAttention(torch.autograd.Function):
    """Tiled attention whose backward recomputes each tile's logits under autograd and pushes
    `dL/dlogits = P * (dO V^T - rowsum(dO * O) + dL/dlse)` through them."""

    @staticmethod
    def forward(ctx, qw, kw, v, mask, causal, geometry, q_chunk, k_chunk, *params):
        terms = _base2_terms(geometry.score_terms(qw, kw))
        if cuda_kernel.applies(qw, terms, mask):
            out, lse = cuda_kernel.fused_attention(terms, v, causal)
        else:
            out, lse = _tiled_forward(qw, kw, v, geometry, terms, mask, causal, q_chunk, k_chunk)
        ctx.save_for_backward(qw, kw, v, out, lse, *params)
        ctx.mask, ctx.causal, ctx.geometry = mask, causal, geometry
        ctx.q_chunk, ctx.k_chunk = q_chunk, k_chunk
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        qw, kw, v, out, lse, *params = ctx.saved_tensors
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        need_params = ctx.needs_input_grad[8:]
        grad_q = torch.zeros_like(qw) if need_q else None
        grad_k = torch.zeros_like(kw) if need_k else None
        grad_v = torch.zeros_like(v) if need_v else None
        grad_params = [
            torch.zeros_like(p) if need else None
            for p, need in zip(params, need_params, strict=True)
        ]
        targets = [p for p, need in zip(params, need_params, strict=True) if need]

        n_queries, n_keys = qw.shape[-2], kw.shape[-2]
        offset = n_keys - n_queries
        finite_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        delta = (grad_out * out).sum(-1) - grad_lse
        may_be_masked = ctx.mask is not None or ctx.causal
        for q_start in range(0, n_queries, ctx.q_chunk):
            rows = slice(q_start, min(q_start + ctx.q_chunk, n_queries))
            for k_start in range(0, _key_limit(ctx.causal, rows.stop, n_keys, offset), ctx.k_chunk):
                cols = slice(k_start, min(k_start + ctx.k_chunk, n_keys))
                q_tile = qw[..., rows, :].detach().requires_grad_(need_q)
                k_tile = kw[..., cols, :].detach().requires_grad_(need_k)
                with torch.enable_grad():
                    logits = ctx.geometry.score(q_tile, k_tile)
                masked = _mask_tile(logits.detach(), ctx.mask, ctx.causal, rows, cols, offset)
                probs = exp_of_shifted_(masked - finite_lse[..., rows].unsqueeze(-1), may_be_masked)
                g_out = grad_out[..., rows, :]
                if need_v:
                    grad_v[..., cols, :] += (probs.transpose(-1, -2) @ g_out).sum_to_size(
                        grad_v[..., cols, :].shape
                    )
                inputs = [t for t, need in ((q_tile, need_q), (k_tile, need_k)) if need]
                inputs += targets
                if not inputs:
                    continue
                grad_logits = probs * (
                    g_out @ v[..., cols, :].transpose(-1, -2) - delta[..., rows].unsqueeze(-1)
                )
                grads = iter(torch.autograd.grad(logits, inputs, grad_logits, allow_unused=True))
                if need_q:
                    grad_q[..., rows, :] += next(grads)
                if need_k:
                    grad_k[..., cols, :] += next(grads)
                for i, need in enumerate(need_params):
                    if need:
                        g = next(grads)
                        if g is not None:
                            grad_params[i] += g
        return (grad_q, grad_k, grad_v, None, None, None, None, None, *grad_params)
