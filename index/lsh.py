"""Locality-sensitive hash families and composite LSH tables (docs/mathematics.md 6, seed 000 Alg. 2
and 4).

Families (each produces integer codes `(..., n, L, t)` for L tables):
- `GridHash` (E2LSH, Euclidean): `floor((A x + b) / r)`, A Gaussian, b ~ U[0, r).
- `SimHash` (spherical; also the dot product, on raw vectors): the sign bits of `Phi x`.
- `BoundaryProjectionHash` (hyperbolic, unit Poincare ball): SimHash of the ideal point
  `x / ||x||` plus the radial band `floor(d_H(0, x) / r_H)`.

`CompositeLSH` picks the families a geometry needs (a product geometry concatenates all three per
table), hashes each table's codes into one bucket id, and finds every key that shares a bucket
with a query in any table by sorting and binary search: no Python loop over tokens.
Collision probabilities are measured as recall (docs/mathematics.md 9.6), never asserted.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from rewa.attention import (
    DotProduct,
    Euclidean,
    Geometry,
    KappaStereographic,
    ProductGeometry,
    Sphere,
)
from rewa.attention.numerics import compute_dtype

from .candidates import best_candidates
from .option_checks import check_int, check_positive


class GridHash:
    """E2LSH: `t` quantised Gaussian projections per table, bucket width `r`. With `width=None`
    `calibrate` sets it from the keys: 4x the median distance from a sample of keys to their
    16th nearest key, the scale at which neighbours must collide."""

    def __init__(
        self,
        dim: int,
        tables: int,
        hashes: int,
        width: float | None,
        generator: torch.Generator,
    ):
        self.projection = torch.randn(dim, tables * hashes, generator=generator)
        self.unit_offset = torch.rand(tables * hashes, generator=generator)
        self.width, self.tables = width, tables

    def calibrate(self, keys: torch.Tensor) -> None:
        if self.width is None:
            sample = keys[
                torch.randperm(keys.shape[0], generator=torch.Generator().manual_seed(2))[:256]
            ]
            neighbours = min(16, keys.shape[0] - 1)
            scale = torch.cdist(sample, keys).kthvalue(neighbours + 1, dim=-1).values.median()
            self.width = max(4 * scale.item(), 1e-12)

    def codes(self, x: torch.Tensor) -> torch.Tensor:
        if self.width is None:
            raise RuntimeError("GridHash.codes before calibrate() with width=None")
        projected = (x @ self.projection.to(x)) / self.width + self.unit_offset.to(x)
        return projected.floor().long().unflatten(-1, (self.tables, -1))


class SimHash:
    """Sign random projections: `bits` per table."""

    def __init__(self, dim: int, tables: int, bits: int, generator: torch.Generator):
        self.projection = torch.randn(dim, tables * bits, generator=generator)
        self.tables = tables

    def codes(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.projection.to(x) > 0).long().unflatten(-1, (self.tables, -1))


class BoundaryProjectionHash:
    """SimHash of the ideal point `x/||x||` and the radial band `floor(d_H(0, x) / band)` for
    points of the unit Poincare ball."""

    def __init__(self, dim: int, tables: int, bits: int, band: float, generator: torch.Generator):
        self.direction = SimHash(dim, tables, bits, generator)
        self.band, self.tables = band, tables

    def codes(self, x: torch.Tensor) -> torch.Tensor:
        norm = x.norm(dim=-1, keepdim=True)
        radius = 2 * torch.atanh(norm.clamp_max(1 - 1e-7))
        band = (radius / self.band).floor().long().expand(*x.shape[:-1], self.tables).unsqueeze(-1)
        return torch.cat([self.direction.codes(x / norm.clamp_min(1e-12)), band], dim=-1)


BUCKET_ROWS = 2048  # rows hashed at a time by `CompositeLSH._buckets`
BASE_BITS, BASE_KEYS = 10, 8192
"""SimHash bits per table for up to `BASE_KEYS` keys (`default_bits`); also the bits of every
table whose stored state does not record them (states written before bits grew with N)."""
MAX_DEFAULT_BITS = 16


def default_bits(n_keys: int) -> int:
    """SimHash bits per table for `n_keys` keys: `BASE_BITS`, and one more for each fourfold of
    `BASE_KEYS` that `n_keys` reaches (11 from 32768, 12 from 131072, 13 from 524288; at most
    `MAX_DEFAULT_BITS`). With fixed
    bits the buckets outgrow `bucket_limit` as N grows and recall falls (docs/indexes.md,
    "Composite LSH")."""
    fourfold_growths = max(0, ((n_keys // BASE_KEYS).bit_length() - 1) // 2)
    return min(BASE_BITS + fourfold_growths, MAX_DEFAULT_BITS)


class CompositeLSH:
    """Composite LSH over a geometry's witnesses, L tables, FAISS-shaped (`add`, `search`).

    Args:
        geometry: the geometry whose witnesses are hashed.
        tables: L.
        bits: SimHash bits per table (sphere, dot product, ideal points); None: chosen from the
            number of keys when they are added (`default_bits`).
        grid_hashes, grid_width: E2LSH projections per table and bucket width (Euclidean;
            default: 4x the median distance of a key to its 16th nearest key).
        band: radial band width r_H (hyperbolic).
        bucket_limit: at most this many keys are taken from one bucket per table (the first in a
            fixed random order), which bounds the candidate width.
        seed: seed of the random projections.

    The hash families are drawn when the keys are added (`add`, `restore`), since their bits
    may depend on how many keys there are. Defaults (64 tables, 10 bits up to 32767 keys, 48 per
    bucket) give top-64 recall 0.97 on `clustered` at N = 8192 with about 730 candidates per
    query (tests/test_index.py).
    """

    def __init__(
        self,
        geometry: Geometry,
        tables: int = 64,
        bits: int | None = None,
        grid_hashes: int = 4,
        grid_width: float | None = None,
        band: float = 1.0,
        bucket_limit: int = 48,
        seed: int = 0,
    ) -> None:
        check_int("tables", tables, 1, 256)
        if bits is not None:
            check_int("bits", bits, 1, 32)
        check_int("grid_hashes", grid_hashes, 1, 32)
        if grid_width is not None:
            check_positive("grid_width", grid_width)
        check_positive("band", band)
        check_int("bucket_limit", bucket_limit, 1, 65536)
        check_int("seed", seed, 0, 2**63 - 1)
        self.geometry, self.tables, self.bucket_limit = geometry, tables, bucket_limit
        self.bits, self.grid_hashes, self.grid_width = bits, grid_hashes, grid_width
        self.band, self.seed = band, seed
        # Drawn here once to raise now, not at `add`, for a geometry without hash families.
        _families(
            geometry, tables, bits or BASE_BITS, grid_hashes, grid_width, band, torch.Generator()
        )
        self.parts: list | None = None  # (family, view) pairs, drawn by `_draw_families`
        self.mixer: torch.Tensor | None = None
        self.table_bits: int | None = None  # the bits the families were drawn with
        self.order: torch.Tensor | None = None
        self.sorted_buckets: torch.Tensor | None = None
        self.keys: torch.Tensor | None = None
        self.admitted: torch.Tensor | None = None  # made by `admitted_buckets` when first asked

    @property
    def ntotal(self) -> int:
        return 0 if self.keys is None else self.keys.shape[0]

    def _buckets(self, w: torch.Tensor, role: str) -> torch.Tensor:
        """One int64 bucket id per table: `(n, L)`, hashed `BUCKET_ROWS` rows at a time (their
        `(rows, L, codes)` int64 codes stay in the cache; all of them at once took most of a
        build, docs/benchmark-notes.md, "Measurements behind code choices")."""
        buckets = torch.empty(w.shape[0], self.tables, dtype=torch.long, device=w.device)
        dtype = compute_dtype(w.dtype)  # half-precision witnesses hashed in float32
        for start in range(0, w.shape[0], BUCKET_ROWS):
            rows = w[start : start + BUCKET_ROWS].to(dtype)
            codes = torch.cat(
                [family.codes(view(rows, role)) for family, view in self.parts], dim=-1
            )
            mixer = self.mixer[: codes.shape[-1]].to(codes.device)
            torch.sum(codes.mul_(mixer), dim=-1, out=buckets[start : start + BUCKET_ROWS])
        return buckets

    def _draw_families(self, bits: int) -> None:
        """The hash families and the bucket mixer for `bits` SimHash bits per table, drawn from
        the seed (the same draws for the same bits)."""
        generator = torch.Generator().manual_seed(self.seed)
        self.parts = _families(
            self.geometry,
            self.tables,
            bits,
            self.grid_hashes,
            self.grid_width,
            self.band,
            generator,
        )
        self.mixer = torch.randint(1, 2**31 - 1, (256,), generator=generator) * 2 + 1
        self.table_bits = bits

    def add(self, keys_w: torch.Tensor) -> None:
        """Index key witnesses `(n, d_w)` (replaces what was added before), with families
        drawn for their number (`bits`, `default_bits`)."""
        self._draw_families(self.bits or default_bits(keys_w.shape[0]))
        self.keys = keys_w
        for family, view in self.parts:
            if isinstance(family, GridHash):
                family.calibrate(view(keys_w.to(compute_dtype(keys_w.dtype)), "key"))
        buckets = self._buckets(keys_w, "key")  # (n, L)
        generator = torch.Generator().manual_seed(1)
        shuffle = torch.randperm(keys_w.shape[0], generator=generator).to(keys_w.device)
        buckets = buckets[shuffle]
        self.sorted_buckets, within = buckets.T.contiguous().sort(dim=-1, stable=True)  # (L, n)
        self.order = shuffle[within]  # key index at each sorted position, per table
        self.admitted = None

    def extend(self, keys_w: torch.Tensor) -> None:
        """Index the witnesses of the grown context: rebuilt, since the grid widths are
        calibrated on all keys and the tables are shuffled as a whole."""
        self.add(keys_w)

    def candidates(self, queries_w: torch.Tensor, k: int | None = None) -> torch.Tensor:
        """Keys sharing a bucket with each query in any table: `(nq, L * bucket_limit)` int64,
        `-1` padded (duplicates across tables are left for `build_candidates` to remove). `k`
        is not used: the tables fix how many there are (`KeyIndex.candidates`)."""
        start, stop = (bound.T for bound in self.bucket_ranges(queries_w))  # (L, nq)
        slots = start.unsqueeze(-1) + torch.arange(self.bucket_limit, device=start.device)
        inside = slots < stop.unsqueeze(-1)
        picked = self.order.gather(1, slots.clamp_max(self.ntotal - 1).flatten(1)).view_as(slots)
        picked = picked.masked_fill(~inside, -1)
        return picked.permute(1, 0, 2).reshape(queries_w.shape[0], -1)

    def bucket_ranges(self, queries_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where each query's bucket lies in each table's sorted keys: `(first, last)`, both
        `(nq, L)` int64, the keys `order[t, first:last]` (an empty range where none)."""
        if self.order is None:
            raise RuntimeError("CompositeLSH queried before add()")
        buckets = self._buckets(queries_w, "query").T.contiguous()  # (L, nq)
        first = torch.searchsorted(self.sorted_buckets, buckets, side="left")
        last = torch.searchsorted(self.sorted_buckets, buckets, side="right")
        return first.T.contiguous(), last.T.contiguous()

    def admitted_buckets(self) -> torch.Tensor:
        """`(n, L)` int32: where key j's bucket starts in table t's sorted keys if key j is
        among the `bucket_limit` keys its bucket yields (`candidates`), else -1. Key j is a
        candidate of a query in table t exactly when this equals the query's `first[t]`
        (`bucket_ranges`) and that range is not empty. Made when first asked, then kept."""
        if self.order is None:
            raise RuntimeError("CompositeLSH.admitted_buckets before add()")
        if self.admitted is None:
            n = self.ntotal
            position = torch.arange(n, device=self.order.device).expand(self.tables, n)
            starts = torch.ones_like(self.sorted_buckets, dtype=torch.bool)
            starts[:, 1:] = self.sorted_buckets[:, 1:] != self.sorted_buckets[:, :-1]
            first = torch.where(starts, position, 0).cummax(dim=1).values
            admitted = torch.where(position - first < self.bucket_limit, first, -1)
            table = torch.empty(n, self.tables, dtype=torch.int32, device=self.order.device)
            columns = torch.arange(self.tables, device=self.order.device).expand(n, -1).T
            table[self.order, columns] = admitted.to(torch.int32)
            self.admitted = table
        return self.admitted

    def search(self, queries_w: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """FAISS-shaped search: the `k` candidates with the best exact logits per query,
        `(D, I)` of shape `(nq, k)`, logits descending, `-inf`/`-1` where fewer exist. On the
        CPU, for an inner-product geometry, by the compiled walk over the buckets
        (`lsh_attention.lsh_best`), else by scoring the candidate sets."""
        from .lsh_attention import inner_product_geometry, lsh_best  # it imports this module

        on_cpu = queries_w.device.type == "cpu" and self.keys.device.type == "cpu"
        needs_grad = torch.is_grad_enabled() and queries_w.requires_grad
        if on_cpu and not needs_grad and inner_product_geometry(self.geometry):
            return lsh_best(self, self.geometry, queries_w, self.keys, k)
        return best_candidates(self.geometry, queries_w, self.keys, self.candidates(queries_w), k)

    def state(self) -> dict[str, np.ndarray]:
        """The sorted buckets and key order of every table, the calibrated grid widths and the
        bits per table (the projections follow from the seed and the bits)."""
        if self.order is None:
            raise RuntimeError("CompositeLSH.state before add()")
        widths = [family.width for family, _ in self.parts if isinstance(family, GridHash)]
        return {
            "order": self.order.cpu().numpy(),
            "sorted_buckets": self.sorted_buckets.cpu().numpy(),
            "grid_widths": np.array(widths, dtype=np.float64),
            "bits": np.array(self.table_bits, dtype=np.int64),
        }

    def restore(self, keys_w: torch.Tensor, state: dict[str, np.ndarray]) -> None:
        """Load `state()` output for the same key witnesses and constructor arguments. A state
        without its bits (written before they grew with N) has `BASE_BITS`, or the
        constructor's `bits`."""
        bits = int(state["bits"]) if "bits" in state else self.bits or BASE_BITS
        if self.bits is not None and bits != self.bits:
            raise ValueError(f"the stored LSH state has {bits} bits per table, not {self.bits}")
        self._draw_families(bits)
        grids = [family for family, _ in self.parts if isinstance(family, GridHash)]
        if len(grids) != len(state["grid_widths"]):
            raise ValueError("the stored LSH state was built with other hash families")
        for family, width in zip(grids, state["grid_widths"].tolist(), strict=True):
            family.width = width
        self.keys = keys_w
        self.order = torch.from_numpy(state["order"])
        self.sorted_buckets = torch.from_numpy(state["sorted_buckets"])
        self.admitted = None


def _families(geometry, tables, bits, grid_hashes, grid_width, band, generator):
    """(family, view) pairs for a geometry; a view selects and prepares the witness part."""
    dim = geometry.dim
    if isinstance(geometry, ProductGeometry):
        # The components share one bucket per table, so they share its bits as well.
        share = len(geometry.present)
        part_bits, part_hashes = max(1, bits // share), max(1, grid_hashes // share)
        offset, parts = 0, []
        for name in geometry.present:
            size = geometry.sizes[name]
            select = _slice_view(offset, offset + size)
            if name == "euclidean":
                family = GridHash(size, tables, part_hashes, grid_width, generator)
            elif name == "sphere":
                family = SimHash(size, tables, part_bits, generator)
            else:
                family = BoundaryProjectionHash(size, tables, part_bits, band, generator)
            parts.append((family, select))
            offset += size
        return parts
    if isinstance(geometry, DotProduct):
        # Angular hashing of the raw vectors as a proxy for the inner product (candidates are
        # re-scored exactly). The MIPS-to-cosine augmentation measured worse on `clustered`
        # (N = 8192, 32 tables, 8 bits): top-64 recall 0.67 against 0.92 for the raw vectors.
        return [(SimHash(dim, tables, bits, generator), _identity_view)]
    if isinstance(geometry, Sphere):
        return [(SimHash(dim, tables, bits, generator), _identity_view)]
    if isinstance(geometry, Euclidean):
        return [(GridHash(dim, tables, grid_hashes, grid_width, generator), _identity_view)]
    if isinstance(geometry, KappaStereographic):
        kappa = geometry.curvature().detach()
        if kappa.numel() != 1:
            raise ValueError("CompositeLSH hashes one head at a time; got several curvatures")
        value = kappa.item()
        if value < 0:
            scale = math.sqrt(-value)
            family = BoundaryProjectionHash(dim, tables, bits, band, generator)
            return [(family, lambda w, role: w * scale)]
        if value > 0:
            return [(SimHash(dim + 1, tables, bits, generator), _sphere_lift_view(value))]
        return [(GridHash(dim, tables, grid_hashes, grid_width, generator), _identity_view)]
    return _lift_families(geometry, tables, bits, grid_hashes, grid_width, generator)


def _lift_families(geometry, tables, bits, grid_hashes, grid_width, generator):
    """Any other geometry with one lift (graded, random features, operator, and cone's
    candidate lift): SimHash on inner-product lift vectors, E2LSH grids on L2 ones; each role
    hashes its own lift (graded queries lift to `M q`)."""
    if not geometry.exact_lift:
        raise TypeError(
            f"CompositeLSH needs an exact lift, which {type(geometry).__name__} has not (top-32 "
            f"recall 0.30 on its candidate lift); use a 'flat', 'ivf' or 'hnsw' index, which "
            f"searches height bands"
        )
    with torch.no_grad():
        probe = geometry.witness(torch.zeros(1, geometry.dim))
        lifts = geometry.lift(probe, "key")
    if len(lifts) != 1:
        raise TypeError(f"CompositeLSH has no hash family for {type(geometry).__name__}")
    size = lifts[0].vectors.shape[-1]

    def view(w: torch.Tensor, role: str) -> torch.Tensor:
        return geometry.lift(w, role)[0].vectors

    if lifts[0].metric == "ip":
        return [(SimHash(size, tables, bits, generator), view)]
    return [(GridHash(size, tables, grid_hashes, grid_width, generator), view)]


def _identity_view(w: torch.Tensor, role: str) -> torch.Tensor:
    return w


def _slice_view(start: int, stop: int):
    return lambda w, role: w[..., start:stop]


def _sphere_lift_view(kappa: float):
    """Points of the projected sphere (kappa > 0) on the unit sphere of R^{d+1}."""

    def view(w: torch.Tensor, role: str) -> torch.Tensor:
        p = w * math.sqrt(kappa)
        squared = p.square().sum(-1, keepdim=True)
        return torch.cat([1 - squared, 2 * p], dim=-1) / (1 + squared)

    return view
