"""Fused exact attention on CUDA: one Triton kernel for every geometry with a product form.

The kernel is FlashAttention's forward pass with the logit of docs/mathematics.md ("Fused dense
attention") in its inner loop: for each block of keys it computes each score term's matrix
product, applies the term's element-wise stages (`numerics.STAGES`, compiled in by name) and
weight, and folds the block into an online softmax in base 2. No `(Nq, Nk)` matrix is stored.
Near pairs of the distance terms are recomputed from `x_i - y_j` as on the CPU, in a second pass
over the keys that only row blocks holding one make (docs/mathematics.md, "Fused dense
attention"), and few query blocks are split over ranges of keys whose results merge
(`key_splits`).

The host side (`pack_terms`) splits every term's augmented operands into a main block of a
power-of-two width of at least 16 (what `tl.dot` takes; zero columns leave the products
unchanged) and at most two extra columns (the norms and ones of a Gram expansion, added as
rank-one corrections, so a 66-wide Euclidean operand costs a 64-wide product, not a 128-wide
one), and expands the per-head weights to one row per batch element. It is plain PyTorch, so it
is tested on any machine; the kernel needs CUDA and Triton (`available()`). Products run at
float32 accuracy (`INPUT_PRECISION`), never in plain TF32: the Gram expansions of the distance
geometries cancel, and TF32's 10-bit mantissa would cost them three decimal digits.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch.nn import functional as F

from .geometry import ScoreTerm
from .merge import merge_stacked
from .numerics import NearScreens, tiny

MAX_TERMS = 3
MAX_STAGES = 2
MAX_EXTRA = 2
STAGE_CODES = {"clamp_to_zero": 1, "sqrt": 2, "arcsin_of_root": 3, "acosh1p": 4, "square": 5}
INPUT_PRECISION = "tf32x3"
"""`tl.dot`'s input precision: "tf32x3" (three TF32 tensor-core products with float32's
accuracy, as cuBLAS's 3xTF32) or "ieee" (float32 on the FMA units: slower, and no closer to
float64; docs/benchmark-notes.md, "Measurements behind code choices")."""
# Key ranges (`key_splits`): programs per multiprocessor aimed at, the query block they are
# counted in, the fewest keys in a range, a range's keys a multiple of every BLOCK_N, and the
# multiprocessors assumed off CUDA (the kernel runs there only under Triton's interpreter).
SPLIT_OCCUPANCY = 4
SPLIT_QUERY_BLOCK = 64
MIN_SPLIT_KEYS = 1024
SPLIT_ALIGN = 128
SPLIT_DEFAULT_MULTIPROCESSORS = 132
EXP2_FLOOR = -64.0 * math.log2(math.e)
"""The floor of the shifted base-2 logits (`numerics.exp_of_shifted_`'s -64 nats)."""


def available() -> bool:
    """Whether Triton is importable and a CUDA device is present."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def applies(qw: torch.Tensor, terms: list[ScoreTerm] | None, mask: torch.Tensor | None) -> bool:
    """Whether the kernel computes this call: float32 CUDA witnesses, a product form of at most
    `MAX_TERMS` terms of at most `MAX_STAGES` stages each, and no user mask (causal is fine)."""
    return (
        qw.device.type == "cuda"
        and qw.dtype == torch.float32
        and mask is None
        and terms is not None
        and len(terms) <= MAX_TERMS
        and all(len(term.stages) <= MAX_STAGES for term in terms)
        and available()
    )


class PackedTerms(NamedTuple):
    """Kernel operands. Each term's augmented vectors are split into a main block of a
    power-of-two width (>= 16; zero-padded if need be) and at most `MAX_EXTRA` trailing columns
    (the norms and ones of the Gram expansions), whose products the kernel adds as rank-one
    corrections instead of padding the main block to the next power of two.

    `queries (B, nq, sum of widths)` and `keys (B, nk, ...)`: the main blocks, concatenated;
    `query_extra (B, nq, MAX_TERMS * MAX_EXTRA)` and `key_extra`: the extra columns, zero where
    unused; `weights (B, MAX_TERMS)`; `widths` and `extras` per term; `codes`: the stage codes of
    each term, 0-padded to `MAX_STAGES`.

    The near pairs of the terms that are weighted squared distances (`ScoreTerm.near`,
    `factor w_x[i] w_y[j] |x_i - y_j|^2`), recomputed in the kernel as `numerics.refine_near_pairs`
    recomputes them on the CPU (`NearPairs`): `near_queries (B, nq, sum of near_dims)` and
    `near_keys` hold the points x and y of each such term, concatenated; `near_rows (B, nq,
    3 MAX_TERMS)` and `near_cols (B, nk, 3 MAX_TERMS)` three numbers per term and point, such
    that the product s of a pair is near where `s <= r0 c0 + r1 c1` (the screen of
    `numerics.near_pairs`: `NEAR_TOLERANCE eps factor (|x|^2 + |y|^2) |w_x w_y|`) and its direct
    value is `r2 c2 |x_i - y_j|^2`; `near_dims`: each term's dimension, 0 for a term without
    near pairs."""

    queries: torch.Tensor
    keys: torch.Tensor
    query_extra: torch.Tensor
    key_extra: torch.Tensor
    weights: torch.Tensor
    widths: tuple[int, ...]
    extras: tuple[int, ...]
    codes: tuple[tuple[int, ...], ...]
    near_queries: torch.Tensor
    near_keys: torch.Tensor
    near_rows: torch.Tensor
    near_cols: torch.Tensor
    near_dims: tuple[int, ...]


def padded_width(width: int) -> int:
    """The smallest power of two >= max(width, 16)."""
    return max(16, 1 << (width - 1).bit_length())


def split_width(width: int) -> tuple[int, int]:
    """`(main, extra)`: a power-of-two main block and at most `MAX_EXTRA` extra columns when
    that covers `width` with a main block of at least 16, else `(padded_width(width), 0)`."""
    main = 1 << (width.bit_length() - 1)
    if main >= 16 and width - main <= MAX_EXTRA:
        return main, width - main
    return padded_width(width), 0


def pack_terms(terms: list[ScoreTerm], batch: torch.Size) -> PackedTerms:
    """Pack score terms over the broadcast `batch` shape for the kernel (`PackedTerms`)."""
    queries, keys, query_extra, key_extra, weights, widths, extras, codes = ([] for _ in range(8))
    for term in terms:
        width = term.queries.shape[-1]
        main, extra = split_width(width)
        for operands, extra_columns, x in (
            (queries, query_extra, term.queries),
            (keys, key_extra, term.keys),
        ):
            x = _flat(x, batch, 0)
            operands.append(F.pad(x[..., :main], (0, main - min(main, width))))
            extra_columns.append(F.pad(x[..., main : main + extra], (0, MAX_EXTRA - extra)))
        weight = torch.as_tensor(term.weight, dtype=torch.float32, device=term.queries.device)
        weights.append(weight.reshape(weight.shape[:-2] if weight.dim() >= 2 else ()))
        widths.append(main)
        extras.append(extra)
        stage_codes = [STAGE_CODES[stage] for stage in term.stages]
        codes.append(tuple(stage_codes + [0] * (MAX_STAGES - len(stage_codes))))
    n_batch = math.prod(batch)
    unused = MAX_TERMS - len(terms)
    weight_rows = torch.stack([w.expand(batch).reshape(n_batch) for w in weights], dim=-1)
    near = _pack_near(terms, batch)
    return PackedTerms(
        torch.cat(queries, dim=-1).contiguous(),
        torch.cat(keys, dim=-1).contiguous(),
        F.pad(torch.cat(query_extra, dim=-1), (0, unused * MAX_EXTRA)).contiguous(),
        F.pad(torch.cat(key_extra, dim=-1), (0, unused * MAX_EXTRA)).contiguous(),
        F.pad(weight_rows, (0, unused)).contiguous(),
        tuple(widths),
        tuple(extras),
        tuple(codes),
        *near,
    )


def _pack_near(terms: list[ScoreTerm], batch: torch.Size):
    """The near-pair operands of `PackedTerms`: `(near_queries, near_keys, near_rows, near_cols,
    near_dims)`, the screen's numbers taken from `numerics.NearScreens`."""
    n_q, n_k = terms[0].queries.shape[-2], terms[0].keys.shape[-2]
    device = terms[0].queries.device
    xs, ys, dims = [], [], []
    rows = torch.zeros(math.prod(batch), n_q, 3 * MAX_TERMS, device=device, dtype=torch.float32)
    cols = torch.zeros(math.prod(batch), n_k, 3 * MAX_TERMS, device=device, dtype=torch.float32)

    def flat(values: torch.Tensor) -> torch.Tensor:  # (..., n) -> (B, n)
        return _flat(values.unsqueeze(-1), batch, 0)[..., 0]

    for slot, term in enumerate(terms):
        if term.near is None:
            dims.append(0)
            continue
        x, y, x_weight, y_weight, factor = term.near
        x, y = x.to(torch.float32), y.to(torch.float32)
        screen = NearScreens(x, y, x_weight, y_weight, factor, torch.float32)
        x2, y2 = flat(screen.x2), flat(screen.y2)
        x_size, y_size = flat(screen.x_weight), flat(screen.y_weight)
        rows[..., 3 * slot] = screen.scale * x2 * x_size
        rows[..., 3 * slot + 1] = screen.scale * x_size
        rows[..., 3 * slot + 2] = factor * (1.0 if x_weight is None else flat(x_weight))
        cols[..., 3 * slot] = y_size
        cols[..., 3 * slot + 1] = y2 * y_size
        cols[..., 3 * slot + 2] = 1.0 if y_weight is None else flat(y_weight)
        xs.append(_flat(x, batch, 0))
        ys.append(_flat(y, batch, 0))
        dims.append(x.shape[-1])
    dims += [0] * (MAX_TERMS - len(dims))
    if not xs:  # the kernel reads none of them
        xs, ys = [rows[..., :1]], [cols[..., :1]]
    return (
        torch.cat(xs, dim=-1).contiguous(),
        torch.cat(ys, dim=-1).contiguous(),
        rows,
        cols,
        tuple(dims),
    )


def _flat(x: torch.Tensor, batch: torch.Size, pad: int) -> torch.Tensor:
    """`x (..., n, e)` expanded to `batch`, flattened to `(B, n, e + pad)`, zero-padded."""
    x = x.expand(*batch, *x.shape[-2:]).reshape(-1, *x.shape[-2:])
    return F.pad(x, (0, pad)) if pad else x


def fused_attention(
    terms: list[ScoreTerm], v: torch.Tensor, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(out, lse)` of the softmax over the logits `sum_t w_t stages_t(q_t k_t^T)` taken in base
    2 (the terms carry `log2(e)`), `lse` returned in nats; causal as in `dense_attention`."""
    batch = torch.broadcast_shapes(
        *(t.queries.shape[:-2] for t in terms), *(t.keys.shape[:-2] for t in terms), v.shape[:-2]
    )
    packed = pack_terms(terms, batch)
    n_batch, n_queries, _ = packed.queries.shape
    n_keys, dv = v.shape[-2], v.shape[-1]
    dv_padded = padded_width(dv)
    values = _flat(v.to(torch.float32), batch, dv_padded - dv).contiguous()
    splits = key_splits(n_batch, n_queries, n_keys, _multiprocessors(v.device))
    split_keys = SPLIT_ALIGN * max(1, math.ceil(n_keys / splits / SPLIT_ALIGN))
    splits = max(1, math.ceil(n_keys / split_keys))
    out = torch.empty(splits, n_batch, n_queries, dv_padded, device=v.device, dtype=torch.float32)
    lse = torch.empty(splits, n_batch, n_queries, device=v.device, dtype=torch.float32)
    widths = (*packed.widths, *([0] * (MAX_TERMS - len(packed.widths))))
    extras = (*packed.extras, *([0] * (MAX_TERMS - len(packed.extras))))
    codes = (*packed.codes, *([(0,) * MAX_STAGES] * (MAX_TERMS - len(packed.codes))))
    grid = lambda meta: (math.ceil(n_queries / meta["BLOCK_M"]), n_batch, splits)  # noqa: E731
    near_dims = packed.near_dims
    _kernel()[grid](
        packed.queries, packed.keys, packed.query_extra, packed.key_extra, values,
        packed.weights, out, lse,
        packed.near_queries, packed.near_keys, packed.near_rows, packed.near_cols,
        packed.queries.stride(0), packed.queries.stride(1),
        packed.keys.stride(0), packed.keys.stride(1),
        packed.query_extra.stride(0), packed.query_extra.stride(1),
        packed.key_extra.stride(0), packed.key_extra.stride(1),
        values.stride(0), values.stride(1),
        out.stride(1), out.stride(2), lse.stride(1), packed.weights.stride(0),
        out.stride(0), lse.stride(0),
        packed.near_queries.stride(0), packed.near_queries.stride(1),
        packed.near_keys.stride(0), packed.near_keys.stride(1),
        packed.near_rows.stride(0), packed.near_rows.stride(1),
        packed.near_cols.stride(0), packed.near_cols.stride(1),
        n_queries, n_keys, n_keys - n_queries, padded_width(n_queries), split_keys, splits,
        D0=widths[0], D1=widths[1], D2=widths[2], X0=extras[0], X1=extras[1], X2=extras[2],
        A0=codes[0][0], A1=codes[0][1], B0=codes[1][0], B1=codes[1][1],
        C0=codes[2][0], C1=codes[2][1],
        N0=near_dims[0], N1=near_dims[1], N2=near_dims[2],
        DV=dv_padded, CAUSAL=causal, TINY=tiny(torch.float32), FLOOR=EXP2_FLOOR,
        PASSES=2 if any(near_dims) else 1, PRECISION=INPUT_PRECISION,
    )  # fmt: skip
    out, lse = merge_stacked(out, lse) if splits > 1 else (out[0], lse[0])
    out = out[..., :dv].reshape(*batch, n_queries, dv)
    return out, lse.reshape(*batch, n_queries)


def key_splits(n_batch: int, n_queries: int, n_keys: int, multiprocessors: int) -> int:
    """Into how many ranges of keys the kernel splits each query block: one where the query
    blocks alone (`SPLIT_QUERY_BLOCK` rows each, times the batch) give every multiprocessor
    `SPLIT_OCCUPANCY` programs, else as many as make up the difference, with ranges of at least
    `MIN_SPLIT_KEYS` keys. Few rows (one head of a short context, a decode step) otherwise run
    on a fraction of the GPU (docs/benchmark-notes.md, "Key ranges in the CUDA kernel")."""
    programs = math.ceil(n_queries / SPLIT_QUERY_BLOCK) * n_batch
    target = SPLIT_OCCUPANCY * multiprocessors
    if programs >= target:
        return 1
    return max(1, min(math.ceil(target / programs), n_keys // MIN_SPLIT_KEYS))


_multiprocessor_counts: dict[torch.device, int] = {}


def _multiprocessors(device: torch.device) -> int:
    """The device's multiprocessors (`SPLIT_DEFAULT_MULTIPROCESSORS` off CUDA)."""
    if device.type != "cuda":
        return SPLIT_DEFAULT_MULTIPROCESSORS
    if device not in _multiprocessor_counts:
        properties = torch.cuda.get_device_properties(device)
        _multiprocessor_counts[device] = properties.multi_processor_count
    return _multiprocessor_counts[device]


_compiled = None


def _kernel():
    """The Triton kernel, defined on first use (Triton is imported only where it runs)."""
    global _compiled
    if _compiled is None:
        _compiled = _define_kernel()
    return _compiled


def _define_kernel():  # pragma: no cover - needs CUDA and Triton
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    @triton.jit
    def stage(s, code: tl.constexpr, TINY: tl.constexpr):
        if code == 1:
            s = tl.maximum(s, 0.0)
        elif code == 2:
            s = tl.sqrt(tl.maximum(s, TINY))
        elif code == 3:
            s = libdevice.asin(tl.sqrt(tl.minimum(tl.maximum(s, TINY), 1.0)))
        elif code == 4:
            s = tl.maximum(s, TINY)
            s = libdevice.log1p(s + tl.sqrt(s * (s + 2.0)))
        elif code == 5:
            s = s * s
        return s

    @triton.jit
    def term(q, qx0, qx1, K, XK, key_base, key_extra_base, cols, col_ok, stride_kn, stride_xn,
             row_ok, near_x, r0, r1, r2, NK, near_key_base, stride_nkn, NC, near_col_base,
             stride_ncn,
             OFFSET: tl.constexpr, D: tl.constexpr, X: tl.constexpr, SLOT: tl.constexpr,
             S0: tl.constexpr, S1: tl.constexpr, NEAR_OFFSET: tl.constexpr,
             NEAR_DIM: tl.constexpr, REFINE: tl.constexpr, TINY: tl.constexpr,
             PRECISION: tl.constexpr):  # fmt: skip
        dims = OFFSET + tl.arange(0, D)
        k = tl.load(
            K + key_base + cols[None, :] * stride_kn + dims[:, None],
            mask=col_ok[None, :],
            other=0.0,
        )
        s = tl.dot(q, k, input_precision=PRECISION)
        extra = XK + key_extra_base + cols * stride_xn + SLOT * 2
        if X > 0:
            s += qx0[:, None] * tl.load(extra, mask=col_ok, other=0.0)[None, :]
        if X > 1:
            s += qx1[:, None] * tl.load(extra + 1, mask=col_ok, other=0.0)[None, :]
        margin = tl.full(s.shape, float("inf"), tl.float32)
        if NEAR_DIM > 0:
            # The near pairs of a weighted squared distance (numerics.refine_near_pairs;
            # PackedTerms): the first pass over the keys only measures how far each product
            # lies above its screen's bound (`margin`); a row block where some pair lies
            # below it makes a second pass, which recomputes those pairs from x_i - y_j.
            col = NC + near_col_base + cols * stride_ncn + SLOT * 3
            c0 = tl.load(col, mask=col_ok, other=0.0)
            c1 = tl.load(col + 1, mask=col_ok, other=0.0)
            bound = r0[:, None] * c0[None, :] + r1[:, None] * c1[None, :]
            inside = col_ok[None, :] & row_ok[:, None]
            if REFINE:
                near = (s <= bound) & inside
                if tl.max(tl.max(near.to(tl.int32), 1), 0) > 0:
                    c2 = tl.load(col + 2, mask=col_ok, other=0.0)
                    squared = tl.zeros_like(s)
                    for dim in range(NEAR_DIM):
                        xd = tl.load(near_x + NEAR_OFFSET + dim, mask=row_ok, other=0.0)
                        yd = tl.load(
                            NK + near_key_base + cols * stride_nkn + NEAR_OFFSET + dim,
                            mask=col_ok,
                            other=0.0,
                        )
                        difference = xd[:, None] - yd[None, :]
                        squared += difference * difference
                    s = tl.where(near, (r2[:, None] * c2[None, :]) * squared, s)
            else:
                margin = tl.where(inside, s - bound, float("inf"))
        return stage(stage(s, S0, TINY), S1, TINY), margin

    configs = [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)
        for m, n, w, st in [(32, 64, 4, 3), (64, 64, 4, 2), (128, 64, 8, 3)]
    ]

    # Tuned per power-of-two number of queries (`n_bucket`): short contexts need small query
    # blocks to occupy every multiprocessor.
    @triton.autotune(
        configs,
        key=[
            "n_bucket",
            "D0",
            "D1",
            "D2",
            "X0",
            "X1",
            "X2",
            "N0",
            "N1",
            "N2",
            "DV",
            "CAUSAL",
            "PRECISION",
        ],
    )
    @triton.jit
    def kernel(
        Q, K, XQ, XK, V, W, OUT, LSE, NQ, NK, NR, NC,
        stride_qb, stride_qm, stride_kb, stride_kn, stride_xqb, stride_xqm, stride_xkb, stride_xkn,
        stride_vb, stride_vn, stride_ob, stride_om, stride_lb, stride_wb, stride_os, stride_ls,
        stride_nqb, stride_nqm, stride_nkb, stride_nkn, stride_nrb, stride_nrm, stride_ncb,
        stride_ncn,
        n_q, n_k, offset, n_bucket, split_keys, n_splits,
        D0: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr,
        X0: tl.constexpr, X1: tl.constexpr, X2: tl.constexpr,
        A0: tl.constexpr, A1: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr,
        C0: tl.constexpr, C1: tl.constexpr, N0: tl.constexpr, N1: tl.constexpr, N2: tl.constexpr,
        DV: tl.constexpr, CAUSAL: tl.constexpr, TINY: tl.constexpr, FLOOR: tl.constexpr,
        PASSES: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        block = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < n_q
        q_rows = Q + b * stride_qb + rows[:, None] * stride_qm
        x_rows = XQ + b * stride_xqb + rows * stride_xqm
        q0 = tl.load(q_rows + tl.arange(0, D0)[None, :], mask=row_ok[:, None], other=0.0)
        q0x0 = tl.load(x_rows + 0, mask=row_ok, other=0.0)
        q0x1 = tl.load(x_rows + 1, mask=row_ok, other=0.0)
        w0 = tl.load(W + b * stride_wb)
        if D1 > 0:
            q1 = tl.load(q_rows + D0 + tl.arange(0, D1)[None, :], mask=row_ok[:, None], other=0.0)
            q1x0 = tl.load(x_rows + 2, mask=row_ok, other=0.0)
            q1x1 = tl.load(x_rows + 3, mask=row_ok, other=0.0)
            w1 = tl.load(W + b * stride_wb + 1)
        if D2 > 0:
            q2 = tl.load(
                q_rows + D0 + D1 + tl.arange(0, D2)[None, :], mask=row_ok[:, None], other=0.0
            )
            q2x0 = tl.load(x_rows + 4, mask=row_ok, other=0.0)
            q2x1 = tl.load(x_rows + 5, mask=row_ok, other=0.0)
            w2 = tl.load(W + b * stride_wb + 2)
        near_x = NQ + b * stride_nqb + rows * stride_nqm
        near_row = NR + b * stride_nrb + rows * stride_nrm
        near_key_base = b * stride_nkb
        near_col_base = b * stride_ncb
        r00 = tl.load(near_row + 0, mask=row_ok, other=0.0)
        r01 = tl.load(near_row + 1, mask=row_ok, other=0.0)
        r02 = tl.load(near_row + 2, mask=row_ok, other=0.0)
        r10 = tl.load(near_row + 3, mask=row_ok, other=0.0)
        r11 = tl.load(near_row + 4, mask=row_ok, other=0.0)
        r12 = tl.load(near_row + 5, mask=row_ok, other=0.0)
        r20 = tl.load(near_row + 6, mask=row_ok, other=0.0)
        r21 = tl.load(near_row + 7, mask=row_ok, other=0.0)
        r22 = tl.load(near_row + 8, mask=row_ok, other=0.0)
        running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DV], tl.float32)
        end = n_k
        if CAUSAL:
            end = tl.minimum(n_k, (block + 1) * BLOCK_M + offset)
        key_base = b * stride_kb
        key_extra_base = b * stride_xkb
        dv = tl.arange(0, DV)
        split = tl.program_id(2)
        first = split * split_keys
        last = tl.minimum(end, first + split_keys)
        row_margin = tl.full([BLOCK_M], float("inf"), tl.float32)
        for refine in tl.static_range(PASSES):
            stop = last
            if refine == 1:  # again, recomputing near pairs, where the first pass saw one
                again = tl.min(row_margin, 0) <= 0.0
                stop = tl.where(again, last, first)
                running_max = tl.where(again, float("-inf"), running_max)
                total = tl.where(again, 0.0, total)
                acc = tl.where(again, 0.0, acc)
            for start in range(first, stop, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                col_ok = cols < n_k
                logits, margin = term(
                    q0,
                    q0x0,
                    q0x1,
                    K,
                    XK,
                    key_base,
                    key_extra_base,
                    cols,
                    col_ok,
                    stride_kn,
                    stride_xkn,
                    row_ok,
                    near_x,
                    r00,
                    r01,
                    r02,
                    NK,
                    near_key_base,
                    stride_nkn,
                    NC,
                    near_col_base,
                    stride_ncn,
                    0,
                    D0,
                    X0,
                    0,
                    A0,
                    A1,
                    0,
                    N0,
                    refine,
                    TINY,
                    PRECISION,
                )
                logits = w0 * logits
                if D1 > 0:
                    part, part_margin = term(
                        q1,
                        q1x0,
                        q1x1,
                        K,
                        XK,
                        key_base,
                        key_extra_base,
                        cols,
                        col_ok,
                        stride_kn,
                        stride_xkn,
                        row_ok,
                        near_x,
                        r10,
                        r11,
                        r12,
                        NK,
                        near_key_base,
                        stride_nkn,
                        NC,
                        near_col_base,
                        stride_ncn,
                        D0,
                        D1,
                        X1,
                        1,
                        B0,
                        B1,
                        N0,
                        N1,
                        refine,
                        TINY,
                        PRECISION,
                    )
                    logits += w1 * part
                    margin = tl.minimum(margin, part_margin)
                if D2 > 0:
                    part, part_margin = term(
                        q2,
                        q2x0,
                        q2x1,
                        K,
                        XK,
                        key_base,
                        key_extra_base,
                        cols,
                        col_ok,
                        stride_kn,
                        stride_xkn,
                        row_ok,
                        near_x,
                        r20,
                        r21,
                        r22,
                        NK,
                        near_key_base,
                        stride_nkn,
                        NC,
                        near_col_base,
                        stride_ncn,
                        D0 + D1,
                        D2,
                        X2,
                        2,
                        C0,
                        C1,
                        N0 + N1,
                        N2,
                        refine,
                        TINY,
                        PRECISION,
                    )
                    logits += w2 * part
                    margin = tl.minimum(margin, part_margin)
                if PASSES > 1 and refine == 0:
                    row_margin = tl.minimum(row_margin, tl.min(margin, 1))
                valid = col_ok[None, :] & row_ok[:, None]
                if CAUSAL:
                    valid = valid & (cols[None, :] <= rows[:, None] + offset)
                logits = tl.where(valid, logits, float("-inf"))
                new_max = tl.maximum(running_max, tl.max(logits, 1))
                shift = tl.where(new_max == float("-inf"), 0.0, new_max)
                weights = tl.exp2(tl.maximum(logits - shift[:, None], FLOOR))
                weights = tl.where(valid, weights, 0.0)
                rescale = tl.exp2(running_max - shift)
                total = total * rescale + tl.sum(weights, 1)
                values = tl.load(
                    V + b * stride_vb + cols[:, None] * stride_vn + dv[None, :],
                    mask=col_ok[:, None],
                    other=0.0,
                )
                acc = acc * rescale[:, None] + tl.dot(weights, values, input_precision=PRECISION)
                running_max = new_max
        seen = total > 0
        out = acc / tl.where(seen, total, 1.0)[:, None]
        lse = tl.where(seen, (running_max + tl.log2(total)) * 0.6931471805599453, float("-inf"))
        tl.store(
            OUT + split * stride_os + b * stride_ob + rows[:, None] * stride_om + dv[None, :],
            out,
            mask=row_ok[:, None],
        )
        tl.store(LSE + split * stride_ls + b * stride_lb + rows, lse, mask=row_ok)

    return kernel
