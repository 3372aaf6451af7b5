"""FAISS indexes on a geometry's exact lifts (docs/mathematics.md 6): flat, IVF and HNSW, with the
metric the lift names (L2 or inner product); a product geometry searches each component and takes
the union.

Interfaces follow FAISS: `add(x)`, `search(x, k) -> (D, I)` of shape `(nq, k)`, `ntotal`, and
`serialize() -> bytes` / `load(bytes)`. GPU indexes are used when CUDA and a GPU build of FAISS
are both present (`faiss_device`), otherwise CPU ones.

IVF and HNSW indexes of an inner-product lift whose key norms spread widely (largest over median
above 2, `IndexSettings.ip_as_l2=None`) are built in L2 on augmented vectors: keys
`(k, sqrt(M^2 - |k|^2))` with M the largest key norm, queries `(q, 0)`, whose L2 distance
`|q|^2 + M^2 - 2 q.k` ranks exactly as the inner product. There inner-product k-means lets the
large-norm centroids take everything: on `tree` (Poincare chord lift, norm spread 2.5, N = 32768,
8 of 128 lists probed) top-64 recall rose from 0.45 to 0.87. With even norms (`clustered`, spread
1.35) inner-product lists are better balanced and faster, and stay there.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from rewa.attention import Geometry, Lift

from . import kmeans
from .candidates import best_candidates
from .faiss_lib import add_preassigned, faiss
from .growth import retrains, trained_prefix
from .option_checks import check_fraction, check_int, check_optional_bool

IndexKind = Literal["flat", "ivf", "hnsw"]


def faiss_device(prefer: str | None = None) -> str:
    """`"cuda"` when a GPU can be used by both PyTorch and this FAISS build, else `"cpu"`;
    `prefer="cpu"` forces the CPU."""
    if prefer == "cpu":
        return "cpu"
    gpu_build = hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0
    if torch.cuda.is_available() and gpu_build:
        return "cuda"
    if prefer == "cuda":
        raise RuntimeError("a CUDA FAISS index was asked for, but no GPU build or GPU is present")
    return "cpu"


MAX_LISTS = 1 << 20

# Keys per IVF cell while the trained prefix is small (up to 131072 keys); beyond, the cells grow
# (docs/indexes.md, "How many IVF cells").
CELL_KEYS = 256


def default_lists(trained_keys: int) -> int:
    """IVF cells for an index trained on `trained_keys` keys (P): P / 256 up to 131072, then
    sqrt(2 P), the same 512 at 131072. k-means trains on 64 keys per cell against every cell
    (`IndexSettings.train_points_per_list`), so its work is 64 * cells^2 distances: 128 P beyond
    131072, linear in P instead of P^2 / 1024; assigning n keys costs n * sqrt(2 P)."""
    return max(1, min(trained_keys // CELL_KEYS, math.isqrt(2 * trained_keys)))


@dataclass
class IndexSettings:
    """How to index one lift.

    kind: `"flat"` (exact), `"ivf"` (inverted lists over k-means cells) or `"hnsw"` (graph).
    nlist: IVF cells (default: `default_lists(P)`, P the trained prefix of the keys,
        `growth.trained_prefix`). nprobe: cells visited per query.
    train_points_per_list: k-means training sample per cell (FAISS's default is 256; 64 trains
        faster with the same recall: docs/benchmark-notes.md, "Measurements behind code
        choices").
    ip_as_l2: index an inner-product lift in L2 on augmented vectors (IVF, HNSW); None decides
        from the keys: when the largest key norm exceeds twice the median.
    hnsw_m, ef_search: HNSW graph degree and search breadth.
    bands: for a geometry without an exact lift (cone), how many bands of similar height are
        indexed and searched separately (`BandedIndex`); unused otherwise.
    probe_mass: the IVF block paths (`ivf_blocks`) read a query's probed lists by estimated
        attention mass and leave unread the least massive lists that together hold less than
        this fraction of it; 0 reads every probed list (docs/indexes.md, "Lists read by their
        estimated mass").
    """

    kind: IndexKind = "ivf"
    nlist: int | None = None
    nprobe: int = 8
    train_points_per_list: int = 64
    ip_as_l2: bool | None = None
    hnsw_m: int = 32
    ef_search: int = 128
    bands: int = 8
    probe_mass: float = 1e-4

    def __post_init__(self) -> None:
        """Every value checked (ValueError naming the field): FAISS must never see a value it
        answers with an assertion. An `nlist` above the number of keys is capped at build."""
        if self.kind not in ("flat", "ivf", "hnsw"):
            raise ValueError(f"kind: expected 'flat', 'ivf' or 'hnsw', got {self.kind!r}")
        if self.nlist is not None:
            check_int("nlist", self.nlist, 1, MAX_LISTS)
        check_int("nprobe", self.nprobe, 1, MAX_LISTS)
        check_int("train_points_per_list", self.train_points_per_list, 1, 65536)
        check_optional_bool("ip_as_l2", self.ip_as_l2)
        check_int("hnsw_m", self.hnsw_m, 2, 256)
        check_int("ef_search", self.ef_search, 1, 65536)
        check_int("bands", self.bands, 1, 1024)
        check_fraction("probe_mass", self.probe_mass)


class LiftIndex:
    """A FAISS index over one lift's vectors, metric from the lift."""

    def __init__(
        self, metric: str, settings: IndexSettings | None = None, device: str | None = None
    ):
        if metric not in ("l2", "ip"):
            raise ValueError(f"expected metric 'l2' or 'ip', got {metric!r}")
        self.metric = metric
        self.settings = settings or IndexSettings()
        self.device = faiss_device(device)
        self.index: faiss.Index | None = None
        self._lists: dict[torch.device, list[torch.Tensor]] | None = None
        self._layouts: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self.radius: float | None = None  # M of the inner-product-to-L2 augmentation, if used

    @property
    def ntotal(self) -> int:
        return 0 if self.index is None else self.index.ntotal

    @property
    def augmented(self) -> bool:
        """Whether this inner-product lift is indexed in L2 on augmented vectors."""
        return self.radius is not None

    def _should_augment(self, x: torch.Tensor) -> bool:
        """Whether to index this inner-product lift in L2 on augmented vectors (decided on the
        trained prefix `x`)."""
        if self.metric != "ip" or self.settings.kind not in ("ivf", "hnsw"):
            return False
        if self.settings.ip_as_l2 is not None:
            return self.settings.ip_as_l2
        norms = x.norm(dim=-1)
        return bool(norms.max() > 2 * norms.median())

    def _faiss_metric(self) -> int:
        if self.metric == "l2" or self.augmented:
            return faiss.METRIC_L2
        return faiss.METRIC_INNER_PRODUCT

    def _kmeans_metric(self) -> str:
        """The metric `index/kmeans.py` trains and assigns with, FAISS's for this lift."""
        return "l2" if self._faiss_metric() == faiss.METRIC_L2 else "ip"

    def _keys(self, vectors: torch.Tensor) -> np.ndarray:
        """Key vectors as FAISS takes them (augmented with the radius already decided)."""
        return _as_faiss(self._augmented(vectors.detach().to("cpu", torch.float32)))

    def _augmented(self, x: torch.Tensor) -> torch.Tensor:
        """Keys `x` with the augmentation column where this lift is indexed in L2."""
        if not self.augmented:
            return x
        squared = x.square().sum(-1, keepdim=True)
        return torch.cat([x, (self.radius**2 - squared).clamp_min(0).sqrt()], dim=-1)

    def _queries(self, vectors: torch.Tensor) -> np.ndarray:
        x = vectors.detach().to("cpu", torch.float32)
        if self.augmented:
            x = torch.cat([x, torch.zeros_like(x[..., :1])], dim=-1)
        return _as_faiss(x)

    def _build(self, dim: int, n: int) -> faiss.Index:
        s = self.settings
        if s.kind == "flat":
            return faiss.IndexFlat(dim, self._faiss_metric())
        if s.kind == "hnsw":
            index = faiss.IndexHNSWFlat(dim, s.hnsw_m, self._faiss_metric())
            index.hnsw.efSearch = s.ef_search
            return index
        if s.kind == "ivf":
            nlist = min(s.nlist or default_lists(n), max(n, 1))
            quantizer = faiss.IndexFlat(dim, self._faiss_metric())
            index = faiss.IndexIVFFlat(quantizer, dim, nlist, self._faiss_metric())
            index.nprobe = min(s.nprobe, nlist)
            index.cp.max_points_per_centroid = s.train_points_per_list
            return index
        raise ValueError(f"expected index kind 'flat', 'ivf' or 'hnsw', got {s.kind!r}")

    def add(self, vectors: torch.Tensor) -> None:
        """Index `(n, dim)` vectors, replacing earlier content. IVF trains on the first
        `trained_prefix(n)` of them (and an inner-product lift decides its augmentation there),
        so `add(x[:m])` then `extend(x[m:])` builds the same index as `add(x)`. IVF with a CPU
        FAISS index trains and assigns in PyTorch on the vectors' device (`kmeans`,
        `_add_trained_in_pytorch`); a GPU build of FAISS trains on its GPU."""
        prefix = vectors[: trained_prefix(vectors.shape[0])].detach().to("cpu", torch.float32)
        self.radius = None
        if self._should_augment(prefix):
            self.radius = prefix.square().sum(-1).max().sqrt().item()
        if self.settings.kind == "ivf" and self.device == "cpu":
            self._add_trained_in_pytorch(vectors, len(prefix))
            return
        x = self._keys(vectors)
        index = self._build(x.shape[1], len(prefix))
        if self.device == "cuda":
            index = faiss.index_cpu_to_gpu(faiss.StandardGpuResources(), 0, index)
        if not index.is_trained:
            index.train(x[: len(prefix)])
        index.add(x)
        self.index = index
        self._lists, self._layouts = None, {}

    def _add_trained_in_pytorch(self, vectors: torch.Tensor, n_trained: int) -> None:
        """`add` for a CPU FAISS IVF index, with the k-means and the assignment of every key
        computed in PyTorch on the vectors' device (`index/kmeans.py`, as FAISS's IVF training
        does them: the same sample size, iterations, seed and spherical centroids for the
        inner product), then handed to FAISS as its centroids and lists. On a GPU that FAISS
        cannot use this keeps the keys there; on the CPU it trains and assigns faster than
        FAISS (docs/indexes.md, "IVF lists trained in PyTorch")."""
        x = self._augmented(vectors.detach().to(torch.float32))
        index = self._build(x.shape[1], n_trained)
        metric = self._kmeans_metric()
        centroids = kmeans.kmeans(
            x[:n_trained], index.nlist, index.cp.niter, index.cp.seed,
            self.settings.train_points_per_list, metric, index.cp.spherical,
        )  # fmt: skip
        index.quantizer.add(_as_faiss(centroids))
        index.is_trained = True
        labels = kmeans.nearest(x, centroids, metric)
        add_preassigned(index, _as_faiss(x), labels.cpu().numpy())
        self.index = index
        order = labels.argsort(stable=True)  # ids ascending within each list, as FAISS adds them
        sizes = torch.bincount(labels, minlength=index.nlist)
        self._lists = {vectors.device: list(order.split(sizes.tolist()))}
        self._layouts = {vectors.device: (order, sizes)}  # `list_layout`, already at hand

    def extend(self, vectors: torch.Tensor) -> None:
        """Append `(m, dim)` vectors to a built index: each is assigned to the trained cells (IVF,
        as `add` assigns: `_extend_assigned_in_pytorch` with a CPU FAISS index) or inserted
        (flat, HNSW); the caller retrains with `add` when the trained prefix moves
        (`growth.retrains`)."""
        if self.index is None:
            raise RuntimeError("LiftIndex.extend before add()")
        if vectors.shape[0] == 0:
            return
        if self.settings.kind == "ivf" and self.device == "cpu":
            self._extend_assigned_in_pytorch(vectors)
        else:
            self.index.add(self._keys(vectors))
        self._lists, self._layouts = None, {}

    def _extend_assigned_in_pytorch(self, vectors: torch.Tensor) -> None:
        """`extend` for a CPU FAISS IVF index: each new key joins the list `add` would give it
        (`kmeans.nearest` against the index's centroids), so that an extended index is the
        index built over every key, to the last near tie."""
        x = self._augmented(vectors.detach().to(torch.float32))
        ivf = faiss.extract_index_ivf(self.index)
        centroids = torch.from_numpy(ivf.quantizer.reconstruct_n(0, ivf.nlist)).to(x.device)
        labels = kmeans.nearest(x, centroids, self._kmeans_metric())
        add_preassigned(ivf, _as_faiss(x), labels.cpu().numpy())

    def lists(self, device: torch.device | str = "cpu") -> list[torch.Tensor]:
        """The ids in each IVF list on `device` (computed once per device from the coarse
        quantizer's assignment)."""
        if self.settings.kind != "ivf" or self.index is None:
            raise RuntimeError("LiftIndex.lists needs a built IVF index")
        device = torch.device(device)
        cpu = torch.device("cpu")
        if self._lists is None:
            self._lists = {}
        if device in self._lists:
            return self._lists[device]
        if cpu not in self._lists:
            index = faiss.index_gpu_to_cpu(self.index) if self.device == "cuda" else self.index
            ivf = faiss.extract_index_ivf(index)
            invlists = ivf.invlists
            self._lists[cpu] = [
                torch.from_numpy(
                    faiss.rev_swig_ptr(invlists.get_ids(c), invlists.list_size(c)).copy()
                ).long()
                for c in range(ivf.nlist)
            ]
        if device not in self._lists:
            self._lists[device] = [ids.to(device) for ids in self._lists[cpu]]
        return self._lists[device]

    def list_layout(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """`(ids, sizes)` on `device`: the ids of every IVF list end to end `(n,)`, list after
        list (`lists`), and the lists' sizes `(nlist,)`; made once per device, so that a call
        that reads the lists as one table does not rebuild it."""
        device = torch.device(device)
        if device not in self._layouts:
            lists = self.lists(device)
            sizes = torch.tensor([len(ids) for ids in lists], device=device)
            self._layouts[device] = (torch.cat(lists), sizes)
        return self._layouts[device]

    def search(self, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(D, I)` of shape `(nq, k)` on the queries' device: L2 distances ascending or inner
        products descending; `I = -1` where fewer than k results exist."""
        if self.index is None:
            raise RuntimeError("LiftIndex.search before add()")
        x = self._queries(queries)
        distances, ids = self.index.search(x, k)
        distances = torch.from_numpy(distances)
        if self.augmented:  # back to inner products: (|q|^2 + M^2 - L2^2) / 2
            squared = torch.from_numpy(x).square().sum(-1, keepdim=True)
            distances = (squared + self.radius**2 - distances) / 2
        return distances.to(queries.device), torch.from_numpy(ids).to(queries.device)

    def serialize(self) -> bytes:
        if self.index is None:
            raise RuntimeError("LiftIndex.serialize before add()")
        index = faiss.index_gpu_to_cpu(self.index) if self.device == "cuda" else self.index
        header = struct.pack("<d", math.nan if self.radius is None else self.radius)
        return header + faiss.serialize_index(index).tobytes()

    @classmethod
    def load(
        cls,
        data: bytes,
        metric: str,
        settings: IndexSettings | None = None,
        device: str | None = None,
    ) -> LiftIndex:
        lift_index = cls(metric, settings, device)
        (radius,) = struct.unpack("<d", data[:8])
        lift_index.radius = None if math.isnan(radius) else radius
        index = faiss.deserialize_index(np.frombuffer(data[8:], dtype=np.uint8))
        if lift_index.device == "cuda":
            index = faiss.index_cpu_to_gpu(faiss.StandardGpuResources(), 0, index)
        lift_index.index = index
        return lift_index


class GeometryIndex:
    """FAISS search under a geometry: one `LiftIndex` per lift of the key witnesses, queries
    lifted in the query role; `search` returns the union of every component's neighbours,
    re-scored exactly by the geometry and ordered by logit."""

    def __init__(
        self, geometry: Geometry, settings: IndexSettings | None = None, device: str | None = None
    ):
        self.geometry = geometry
        self.settings = settings or IndexSettings()
        self.device = device
        self.parts: list[LiftIndex] = []
        self.keys: torch.Tensor | None = None

    @property
    def ntotal(self) -> int:
        return 0 if self.keys is None else self.keys.shape[0]

    def add(self, keys_w: torch.Tensor) -> None:
        """Index key witnesses `(n, d_w)`."""
        self.keys = keys_w
        self.parts = []
        for lift in self.geometry.lift(keys_w, "key"):
            part = LiftIndex(lift.metric, self.settings, self.device)
            part.add(lift.vectors)
            self.parts.append(part)

    def extend(self, keys_w: torch.Tensor) -> None:
        """Index the witnesses `(n, d_w)` of the grown context, whose first `ntotal` are the ones
        indexed: only the new ones are added, unless the trained prefix moves (then it is
        rebuilt). The result equals `add(keys_w)` on a fresh index."""
        if self.keys is None or keys_w.shape[0] < self.ntotal:
            raise ValueError(f"extend needs at least the {self.ntotal} keys already indexed")
        if self.settings.kind == "ivf" and retrains(self.ntotal, keys_w.shape[0]):
            self.add(keys_w)
            return
        new = keys_w[self.ntotal :]
        for part, lift in zip(self.parts, self.geometry.lift(new, "key"), strict=True):
            part.extend(lift.vectors)
        self.keys = keys_w

    def candidates(self, queries_w: torch.Tensor, k: int) -> torch.Tensor:
        """Each component's k nearest keys, concatenated: `(nq, k * components)`, `-1` padded."""
        lifts: list[Lift] = self.geometry.lift(queries_w, "query")
        return torch.cat(
            [part.search(lift.vectors, k)[1] for part, lift in zip(self.parts, lifts, strict=True)],
            dim=-1,
        )

    def search(self, queries_w: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(D, I)`: the k best candidates by exact logit, descending."""
        return best_candidates(
            self.geometry, queries_w, self.keys, self.candidates(queries_w, k), k
        )

    def serialize(self) -> list[bytes]:
        return [part.serialize() for part in self.parts]

    def state(self) -> dict[str, np.ndarray]:
        """What `restore` needs besides the key witnesses: each FAISS index, serialised."""
        return {
            f"part{i}": np.frombuffer(data, dtype=np.uint8)
            for i, data in enumerate(self.serialize())
        }

    def restore(self, keys_w: torch.Tensor, state: dict[str, np.ndarray]) -> None:
        """Load `state()` output for the same key witnesses (no training, no adding)."""
        parts = [state[f"part{i}"].tobytes() for i in range(len(state))]
        self.load_parts(keys_w, parts)

    def load_parts(self, keys_w: torch.Tensor, parts: list[bytes]) -> None:
        """Restore serialised component indexes for the same key witnesses."""
        metrics = [lift.metric for lift in self.geometry.lift(keys_w[:1], "key")]
        if len(metrics) != len(parts):
            raise ValueError(f"expected {len(metrics)} serialised parts, got {len(parts)}")
        self.keys = keys_w
        self.parts = [
            LiftIndex.load(data, metric, self.settings, self.device)
            for data, metric in zip(parts, metrics, strict=True)
        ]


def _as_faiss(x: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(x.detach().to("cpu", torch.float32).numpy())
