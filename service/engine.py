"""The compute engine: loads committed contexts from the store onto the device, builds their
indexes once per context version, keeps both in an LRU cache under a memory budget, and runs
attention, search and self-attention. Every method here is synchronous and runs on the device
worker thread (`batcher.Batcher`), never on the event loop; index builds run on the engine's
own build thread, and an attend does not wait for one (docs/indexes.md, "Builds in the
background").

Per head of a context version the engine may hold a `KeyClusters` (tail mode) and a search
index of the context's kind (topk mode, search, and the ids of `return_topk`); both are put in
the store when `store_indexes` is on, so other replicas load them instead of rebuilding.

The indexes hold the keys of a version's full segments of `open_segment` tokens
(`sealed_keys`); the keys of the open last segment are read exactly by every query and merged
with the indexed answer (docs/indexes.md, "The open segment"). A commit appends tokens. When an
earlier version of the context is cached, the new version is made from it: only the new
segments are read from the store, keys and values are appended to buffers with spare capacity,
and the indexes built so far pass to it unchanged, or, when a segment filled, its build extends
them with the segment's keys (`extend`: an assignment per key; retraining only when the trained
prefix moves), which gives what a build over the whole version gives (docs/indexes.md,
"Appends"); until then the earlier version's indexes answer, the keys after them read exactly.

A context's geometry is its spec's, built from a fixed seed, with the trained state the context
carries (`GEOMETRY_STATE`) loaded over it. A multi-layer document is one context whose stored
heads are its layers' heads, layer 0's first; `Engine.layer` gives one layer as a view whose
indexes are slices of the document's (docs/llm.md).

With `audit_every`, one query row in that many of a non-causal sparse attend is also answered
by exact dense attention, and the errors are kept per context, layer and head (`Audit`); a
tail head whose 99th percentile passes `audit_target` gets pieces of half the size: the choice
is kept in the store with the context (`AUDITED_PIECES`), so that every later build, extension
and replica cuts that head's pieces so, and the newest cached version is cut again on the build
thread. A head whose halving did not mend it goes back and is settled, in the store too
(`SETTLED_HEADS`), so that no replica halves it again (docs/service.md, "The audit")."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NotRequired, TypedDict

import torch
from safetensors.torch import load as safetensors_load

from rewa.attention import (
    DistanceGeometry,
    Geometry,
    dense_attention,
    make_geometry,
    merge_attention,
)
from rewa.index import (
    OPEN_SEGMENT,
    ClusterHeads,
    KeyClusters,
    appended,
    build_index,
    exact_topk,
    index_from_bytes,
    index_to_bytes,
    query_positions,
    retrieval_attention,
    sealed_keys,
    tail_attention_heads,
    window_and_sinks,
)
from rewa.index.audit import AUDIT_TARGET, AUDIT_WINDOW, AUDITS_WAITING, Audit, audited_errors
from rewa.index.growth import EXACT_WHILE_BUILDING
from rewa.index.ivf_blocks import prepare_list_moments
from rewa.index.tail.decode import compiled_step_applies
from rewa.index.tail.threads import background_threads

from .store import ContextRecord, ContextStore, Segment, stored_heads
from .wire import FLOAT_DTYPES

ContextKey = tuple[str, str, int]  # namespace, context id, version
ContextId = tuple[str, str]  # namespace, context id
MODES = ("tail", "topk")  # the modes that read an index
# The store blob of a context's piece sizes chosen by the audit: {stored head: most keys}.
AUDITED_PIECES = "audited-pieces.json"
# The store blob of a context's stored heads that an audit settled (a halving did not mend them;
# `Audit.to_cut`): a list, so that no replica, and no process started later, halves them again.
SETTLED_HEADS = "audit-settled.json"

logger = logging.getLogger(__name__)


def resolve_device(setting: str) -> torch.device:
    """`auto`: CUDA when available, else the CPU."""
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(setting)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"REWA_DEVICE={setting} but CUDA is not available")
    return device


@contextmanager
def intra_op_threads(count: int) -> Iterator[None]:
    """Torch's CPU operations inside the block use `count` threads (0: leave the setting as
    is); the previous setting comes back afterwards, also after an error. The setting is the
    process's, so only the device worker (the one thread that computes) may use this."""
    before = torch.get_num_threads()
    if count <= 0 or count == before:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


GEOMETRY_SEED = 0


def _index_bytes(loaded: LoadedContext) -> int:
    """Memory of the KeyClusters a loaded context holds, stacked ones included (search indexes
    are not counted)."""
    stacked = sum(heads.nbytes for heads in loaded.layer_heads.values())
    return stacked + sum(clusters.nbytes for clusters in loaded.clusters or [])


def geometry_of(spec: dict, head_dim: int) -> Geometry:
    """The geometry of a stored spec (`{"name", **options}`), shared by every head. Geometries
    with randomly initialised parameters (the product's maps) are built from a fixed seed, so
    every load, restart and replica computes the same attention for the same context."""
    options = {key: value for key, value in spec.items() if key != "name"}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(GEOMETRY_SEED)
        return make_geometry(spec["name"], head_dim, **options)


# The blob of a context's trained geometry state (a safetensors state dict), when it has one.
GEOMETRY_STATE = "geometry-state.safetensors"


def load_geometry_state(geometry: Geometry, state: dict[str, torch.Tensor]) -> Geometry:
    """`geometry` with its parameters and buffers replaced by `state` (a `state_dict` of the
    same geometry, e.g. a trained one): every entry must be there with its shape, none more;
    ValueError naming what differs."""
    expected = geometry.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"the geometry's state has the entries {sorted(expected)}; missing {missing}, "
            f"unexpected {unexpected}"
        )
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(
                f"{name}: expected shape {list(expected[name].shape)}, got {list(tensor.shape)}"
            )
    geometry.load_state_dict({name: t.to(expected[name].dtype) for name, t in state.items()})
    return geometry


@dataclass
class LoadedContext:
    """One committed version of a context on the device."""

    key: ContextKey
    record: ContextRecord
    geometry: Geometry
    keys: torch.Tensor  # (H, N, d) float32
    values: torch.Tensor  # (H, N, dv) float32
    # The indexes hold the first `sealed` tokens (`sealed_keys`); the rest are read exactly.
    sealed: int = 0
    clusters: list[KeyClusters] | None = None  # per head; [] when nothing is sealed
    search_indexes: dict[str, list] = field(default_factory=dict)
    nbytes: int = 0
    # `keys` and `values` are the first n_tokens of these (spare capacity for appends).
    key_buffer: torch.Tensor | None = None
    value_buffer: torch.Tensor | None = None
    # A layer of a multi-layer document: the heads `heads` of `parent` (`Engine.layer`).
    parent: LoadedContext | None = None
    heads: slice | None = None
    # The version this one was made from, kept while this one's indexes are being built: its
    # indexes (or its own `earlier`'s) answer meanwhile (`Engine._serving`).
    earlier: LoadedContext | None = None
    # Per mode ("tail", "topk"), the build of this version's index on the build thread.
    builds: dict[str, Future] = field(default_factory=dict)
    # `clusters` stacked for `tail_attention_heads`, by the (start, stop) of the heads read
    # together (a layer's, for a document; `Engine._index_view`).
    layer_heads: dict[tuple[int, int], ClusterHeads] = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return self.keys.shape[1]


class AttendResult(TypedDict):
    """What `Engine.attend` answers, per head and query: the attention's output and
    log-partition, and with `return_topk` the best keys' ids and attention weights."""

    out: torch.Tensor  # (H, nq, dv)
    lse: torch.Tensor  # (H, nq)
    ids: NotRequired[torch.Tensor]  # (H, nq, R), -1 padded
    weights: NotRequired[torch.Tensor]  # (H, nq, R)


class SearchResult(TypedDict):
    """What `Engine.search` answers: the best keys' ids and logits, and for a distance
    geometry their distances."""

    ids: torch.Tensor  # (H, nq, k), -1 padded
    scores: torch.Tensor  # (H, nq, k)
    distances: NotRequired[torch.Tensor]  # (H, nq, k)


@dataclass(frozen=True)
class AttendParams:
    """The per-call knobs of attend and self-attention, after defaults (hashable: the batch
    key)."""

    mode: str
    top_k: int
    budget: float
    window: int
    sinks: int
    return_topk: int | None = None
    measured_queries: int = 0  # tail: queries per head answered exactly (index/tail/measured.py)


class Engine:
    def __init__(
        self,
        store: ContextStore,
        *,
        device: torch.device,
        cache_bytes: int,
        store_indexes: bool,
        sparse_threads: int = 0,
        open_segment: int = OPEN_SEGMENT,
        exact_while_building: int = EXACT_WHILE_BUILDING,
        probed_pieces: bool = True,
        audit_every: int = 0,
        audit_window: int = AUDIT_WINDOW,
        audit_target: float = AUDIT_TARGET,
        metrics=None,
    ) -> None:
        sealed_keys(0, open_segment)  # a negative segment: ValueError
        if exact_while_building < 0:
            raise ValueError(
                f"expected exact_while_building >= 0 query-key pairs, got {exact_while_building}"
            )
        if audit_every < 0:
            raise ValueError(f"expected audit_every >= 0 (0: no audit), got {audit_every}")
        if audit_window < 1:
            raise ValueError(f"expected an audit window of >= 1 errors, got {audit_window}")
        if not audit_target > 0:
            raise ValueError(f"expected an audit_target > 0 (a relative error), got {audit_target}")
        self.store = store
        self.open_segment = open_segment
        self.exact_while_building = exact_while_building
        self.probed_pieces = probed_pieces
        self.audit_every, self.audit_window = audit_every, audit_window
        self.audit_target = audit_target
        self.device = device
        self.cache_bytes = cache_bytes
        self.store_indexes = store_indexes
        self.sparse_threads = sparse_threads
        self.metrics = metrics
        self._cache: OrderedDict[ContextKey, LoadedContext] = OrderedDict()
        self._lock = threading.Lock()
        self._builder = background_threads(1, "rewa-build")
        # The audit: per (namespace, context id, layer) its errors, per context the cut under
        # way; the audited rows' exact answers are computed on a thread of their own.
        self._audits: dict[tuple[str, str, int], Audit] = {}
        self._recuts: dict[ContextId, Future] = {}
        self._auditor = background_threads(1, "rewa-audit")
        self._audits_waiting = 0

    def close(self) -> None:
        """Stop the build and audit threads (the work under way finishes; queued work is
        dropped)."""
        self._auditor.shutdown(wait=True, cancel_futures=True)
        self._builder.shutdown(wait=True, cancel_futures=True)

    # -- loading and caching ----------------------------------------------------------------

    def context(self, namespace: str, record: ContextRecord) -> LoadedContext:
        """The loaded context of a committed record (from the cache, or loaded now)."""
        key = (namespace, record["id"], record["version"])
        with self._lock:
            loaded = self._cache.get(key)
            if loaded is not None:
                self._cache.move_to_end(key)
                self._count("cache_hits")
                return loaded
        earlier = self._take_earlier_version(namespace, record)
        if earlier is not None:
            self._count("cache_extensions")
            loaded = self._extended(earlier, namespace, record)
        else:
            self._count("cache_misses")
            loaded = self._load(namespace, record)
        with self._lock:
            self._cache[key] = loaded
            self._evict()
        return loaded

    def _load(self, namespace: str, record: ContextRecord) -> LoadedContext:
        k, v = self._read_segments(namespace, record, record["segments"])
        geometry = geometry_of(record["geometry"], record["head_dim"])
        state = self.store.get_blob(namespace, record["id"], GEOMETRY_STATE)
        if state is not None:
            load_geometry_state(geometry, safetensors_load(state))
        geometry = geometry.to(self.device)
        loaded = LoadedContext(
            key=(namespace, record["id"], record["version"]),
            record=record,
            geometry=geometry,
            keys=k,
            values=v,
            sealed=sealed_keys(k.shape[1], self.open_segment),
            key_buffer=k,
            value_buffer=v,
        )
        loaded.nbytes = k.nbytes + v.nbytes
        return loaded

    def _read_segments(
        self, namespace: str, record: ContextRecord, segments: list[Segment]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys `(H, n, d)` and values `(H, n, dv)` of `segments`, on the device in float32."""
        heads, d, dv = stored_heads(record), record["head_dim"], record["value_dim"]
        dtype = FLOAT_DTYPES[record["dtype"]]
        keys, values = [], []
        for segment in segments:
            raw = self.store.read_chunk(namespace, record["id"], segment)
            flat = torch.frombuffer(bytearray(raw), dtype=dtype)
            n = segment["tokens"]
            keys.append(flat[: heads * n * d].view(heads, n, d))
            values.append(flat[heads * n * d :].view(heads, n, dv))
        if not keys:
            return (
                torch.zeros(heads, 0, d, device=self.device),
                torch.zeros(heads, 0, dv, device=self.device),
            )
        return (
            torch.cat(keys, dim=1).to(self.device, torch.float32),
            torch.cat(values, dim=1).to(self.device, torch.float32),
        )

    def layer(self, loaded: LoadedContext, layer: int) -> LoadedContext:
        """Layer `layer` of a multi-layer document: its heads' keys and values, and the slices
        of the document's indexes (built over the whole document when first needed)."""
        per_layer = loaded.record["heads"]
        heads = slice(layer * per_layer, (layer + 1) * per_layer)
        return LoadedContext(
            key=loaded.key,
            record=loaded.record,
            geometry=loaded.geometry,
            keys=loaded.keys[heads],
            values=loaded.values[heads],
            sealed=loaded.sealed,
            parent=loaded,
            heads=heads,
        )

    def _take_earlier_version(self, namespace: str, record: ContextRecord) -> LoadedContext | None:
        """The latest cached earlier version of this context whose segments the record's begin
        with, taken out of the cache (its buffers and indexes pass to the new version); None
        when there is none."""
        with self._lock:
            versions = [
                key
                for key in self._cache
                if key[:2] == (namespace, record["id"]) and key[2] < record["version"]
            ]
            if not versions:
                return None
            earlier = self._cache[max(versions, key=lambda key: key[2])]
            segments = earlier.record["segments"]
            if record["segments"][: len(segments)] != segments:
                return None
            return self._cache.pop(earlier.key)

    def _extended(
        self, earlier: LoadedContext, namespace: str, record: ContextRecord
    ) -> LoadedContext:
        """The record's version made from an earlier one: the new segments read and appended,
        the indexes built so far passed on when no segment filled; when one did, they are
        extended with its keys by this version's build (`_build`), and the earlier version's
        answer meanwhile."""
        new_segments = record["segments"][len(earlier.record["segments"]) :]
        new_k, new_v = self._read_segments(namespace, record, new_segments)
        n_old, n = earlier.n_tokens, earlier.n_tokens + new_k.shape[1]
        key_buffer = appended(earlier.key_buffer, n_old, new_k)
        value_buffer = appended(earlier.value_buffer, n_old, new_v)
        loaded = LoadedContext(
            key=(namespace, record["id"], record["version"]),
            record=record,
            geometry=earlier.geometry,
            keys=key_buffer[:, :n],
            values=value_buffer[:, :n],
            sealed=sealed_keys(n, self.open_segment),
            key_buffer=key_buffer,
            value_buffer=value_buffer,
            earlier=earlier,
        )
        if loaded.sealed == earlier.sealed:
            loaded.clusters, loaded.layer_heads = earlier.clusters, earlier.layer_heads
            loaded.search_indexes = dict(earlier.search_indexes)
        self._release_earlier(loaded)
        loaded.nbytes = key_buffer.nbytes + value_buffer.nbytes + _index_bytes(loaded)
        return loaded

    def _evict(self) -> None:
        """Drop least recently used contexts while over the budget (never the newest)."""
        total = sum(loaded.nbytes for loaded in self._cache.values())
        while total > self.cache_bytes and len(self._cache) > 1:
            _, dropped = self._cache.popitem(last=False)
            total -= dropped.nbytes

    def forget(self, namespace: str, context_id: str) -> None:
        """Drop every cached version of a context and its audit (after a delete)."""
        with self._lock:
            for key in [key for key in self._cache if key[:2] == (namespace, context_id)]:
                del self._cache[key]
            for key in [key for key in self._audits if key[:2] == (namespace, context_id)]:
                del self._audits[key]

    def cached_bytes(self) -> int:
        with self._lock:
            return sum(loaded.nbytes for loaded in self._cache.values())

    def _count(self, name: str) -> None:
        if self.metrics is not None:
            self.metrics.count(name)

    # -- indexes ----------------------------------------------------------------------------
    #
    # Indexes are built on the build thread (`_builder`), never on the device worker: an
    # attend that needs an index still being built does not wait for it (unless reading the
    # keys it does not cover exactly would cost more than `exact_while_building` query-key
    # pairs), it reads what the newest built index of an earlier version covers through that
    # index and everything after it exactly (docs/indexes.md, "Builds in the background").

    def _built(self, loaded: LoadedContext, mode: str):
        """This version's index of `mode` over its `sealed` keys (per-head `KeyClusters` for
        tail, per-head search indexes for topk), or None while it is not built."""
        if mode == "tail":
            return loaded.clusters
        return loaded.search_indexes.get(loaded.record["index"]["kind"])

    def _start_build(self, loaded: LoadedContext, mode: str) -> Future:
        """The build of `mode`'s index of this version (a document's, for a layer) on the build
        thread, started now unless it was; a build that failed is started again. An index
        already there (passed on by an append) needs none: a done future, no thread woken."""
        root = loaded.parent or loaded
        if self._built(root, mode) is not None:
            built = Future()
            built.set_result(None)
            return built
        with self._lock:
            build = root.builds.get(mode)
            if build is None or (build.done() and build.exception() is not None):
                build = self._builder.submit(self._build, root, mode)
                root.builds[mode] = build
        return build

    def _raise_failed_build(self, root: LoadedContext, mode: str) -> None:
        """Raise the error of `mode`'s build if it failed, forgetting it (the next attend
        starts it again)."""
        with self._lock:
            build = root.builds.get(mode)
            if build is None or not build.done() or build.exception() is None:
                return
            del root.builds[mode]
        raise build.exception()

    def start_builds(self, loaded: LoadedContext, modes: list[str]) -> list[Future]:
        """Start the builds of what the modes need (the clusters for tail, the search index for
        topk), so that attends find them built; what is built already stays."""
        return [self._start_build(loaded, mode) for mode in modes]

    def build_indexes(self, loaded: LoadedContext, modes: list[str]) -> None:
        """`start_builds`, then wait for them (their error, if one failed)."""
        for build in self.start_builds(loaded, modes):
            build.result()

    def _build(self, loaded: LoadedContext, mode: str) -> None:
        """On the build thread: this version's index of `mode`, the newest earlier version's
        that covers as many keys passed on, one over fewer keys extended (a copy: the earlier
        one keeps answering meanwhile), else built (or loaded from the store)."""
        if self._built(loaded, mode) is not None:
            return
        start = time.perf_counter()
        with torch.no_grad():
            base = self._earlier_built(loaded, mode)
            if base is not None and base.sealed == loaded.sealed:
                built, kind = self._built(base, mode), None
            elif base is not None and base.sealed:
                built, kind = self._extend(base, loaded, mode), "extend"
            elif mode == "tail":
                built, kind = self._build_clusters(loaded), "clusters"
            else:
                built, kind = self._build_search(loaded), loaded.record["index"]["kind"]
        if mode == "tail":
            # Stacked here, so that the first attend after the build does not pay for it.
            loaded.layer_heads = base.layer_heads if kind is None else self._stacked(loaded, built)
            loaded.nbytes += sum(c.nbytes for c in built)
            loaded.nbytes += sum(heads.nbytes for heads in loaded.layer_heads.values())
            loaded.clusters = built
        else:
            loaded.search_indexes[loaded.record["index"]["kind"]] = built
        if kind is not None and built:
            self._observe_build(kind, time.perf_counter() - start)
        self._release_earlier(loaded)

    def _stacked(
        self, loaded: LoadedContext, clusters: list[KeyClusters]
    ) -> dict[tuple[int, int], ClusterHeads]:
        """`clusters` stacked per layer (per context: one layer), as `_index_view` reads them."""
        per_layer = loaded.record["heads"]
        spans = [(start, start + per_layer) for start in range(0, len(clusters), per_layer)]
        return {span: ClusterHeads.stacked(clusters[slice(*span)]) for span in spans}

    def _earlier_built(self, loaded: LoadedContext, mode: str) -> LoadedContext | None:
        """The newest earlier version this one was made from whose index of `mode` is built."""
        earlier = loaded.earlier
        while earlier is not None and self._built(earlier, mode) is None:
            earlier = earlier.earlier
        return earlier

    def _release_earlier(self, loaded: LoadedContext) -> None:
        """Forget the earlier versions once this one has built every index they have built
        or are building."""
        pending = [mode for mode in MODES if self._built(loaded, mode) is None]
        earlier = loaded.earlier
        while earlier is not None and pending:
            if any(self._built(earlier, m) is not None or m in earlier.builds for m in pending):
                return
            earlier = earlier.earlier
        loaded.earlier = None

    def _extend(self, base: LoadedContext, loaded: LoadedContext, mode: str) -> list:
        """`base`'s index of `mode` extended to the keys `loaded` seals; `base`'s is not
        changed (clusters extend into new objects, search indexes are copied first)."""
        witness = loaded.geometry.witness
        new = slice(base.sealed, loaded.sealed)
        if mode == "tail":
            chosen = self.audited_pieces(*loaded.key[:2])
            extended = []
            for head, clusters in enumerate(base.clusters):
                size = chosen.get(head)
                if size and int(clusters.max_keys) != size:  # chosen since these were cut
                    extended.append(self._head_clusters(loaded, head, size))
                    continue
                extended.append(
                    clusters.extend(
                        witness(loaded.keys[head, new]),
                        loaded.values[head, new],
                        **self._cut_options(size),
                    )
                )
            return extended
        spec = loaded.record["index"]
        options = dict(spec.get("options") or {})
        extended = []
        for head, index in enumerate(self._built(base, mode)):
            copy = index_from_bytes(
                index_to_bytes(index), base.keys[head, : base.sealed], loaded.geometry,
                spec["kind"], **options,
            )  # fmt: skip
            copy.extend(witness(loaded.keys[head, : loaded.sealed]))
            prepare_list_moments(copy)
            extended.append(copy)
        return extended

    def _build_clusters(self, loaded: LoadedContext) -> list[KeyClusters]:
        """Per-head `KeyClusters` of the sealed keys (`_head_clusters`); [] when no key is
        sealed."""
        if not loaded.sealed:
            return []
        chosen = self.audited_pieces(*loaded.key[:2])
        return [
            self._head_clusters(loaded, head, chosen.get(head))
            for head in range(loaded.keys.shape[0])
        ]

    def _head_clusters(self, loaded: LoadedContext, head: int, size: int | None) -> KeyClusters:
        """One head's `KeyClusters` of the sealed keys, in pieces of at most `size` keys where
        the audit chose a size (`_cut_options`), loaded from the store where a replica put
        them, else built (and put there)."""
        namespace, context_id, version = loaded.key
        sealed = loaded.sealed
        # Clusters built with `probed_pieces` (the default), without, and at a size the audit
        # chose are stored apart: a replica with another setting would otherwise load them,
        # and answer differently from its own build.
        cut = f"-k{size}" if size else "-probed" if self.probed_pieces else ""
        name = f"clusters{KeyClusters.FORMAT}{cut}-v{version}-n{sealed}-h{head}.npz"
        blob = self.store.get_blob(namespace, context_id, name) if self.store_indexes else None
        if blob is not None:
            return KeyClusters.from_bytes(blob, loaded.geometry, self.device)
        clusters = KeyClusters.build(
            loaded.geometry.witness(loaded.keys[head, :sealed]),
            loaded.values[head, :sealed],
            loaded.geometry,
            **self._cut_options(size),
        )
        if self.store_indexes:
            self.store.put_blob(namespace, context_id, name, clusters.to_bytes())
        return clusters

    def _cut_options(self, size: int | None) -> dict:
        """`KeyClusters.build`'s options for a head: pieces of at most `size` keys where the
        audit chose a size, else the engine's `probed_pieces`."""
        if size:
            return {"max_cluster_keys": size, "probed_pieces": False}
        return {"probed_pieces": self.probed_pieces}

    def _build_search(self, loaded: LoadedContext) -> list:
        """Per-head search indexes of the context's kind over the sealed keys (or loaded from
        the store, where another replica put them); [] when no key is sealed."""
        spec = loaded.record["index"]
        kind = spec["kind"]
        namespace, context_id, version = loaded.key
        options = dict(spec.get("options") or {})
        indexes = []
        sealed = loaded.sealed
        for head in range(loaded.keys.shape[0] if sealed else 0):
            name = f"{kind}-v{version}-n{sealed}-h{head}.npz"
            keys = loaded.keys[head, :sealed]
            blob = self.store.get_blob(namespace, context_id, name) if self.store_indexes else None
            if blob is not None:
                index = index_from_bytes(blob, keys, loaded.geometry, kind, **options)
            else:
                index = build_index(keys, loaded.geometry, kind, **options)
                if self.store_indexes:
                    self.store.put_blob(namespace, context_id, name, index_to_bytes(index))
            prepare_list_moments(index)
            indexes.append(index)
        return indexes

    def _serving(self, loaded: LoadedContext, mode: str, rows: int) -> tuple[int, object]:
        """`(count, index)`: the index an attend of `rows` query rows of `mode` reads, over the
        first `count` keys (`count` 0 and None: none, every key is read exactly). This
        version's once built; while it is being built, the newest earlier version's, unless
        reading the keys it does not cover exactly costs more than `exact_while_building`
        pairs: then the attend waits for the build. A build that failed raises its error here
        once; the next attend starts it again."""
        root = loaded.parent or loaded
        if self._built(root, mode) is None:  # the hot path (built) takes no lock
            self._raise_failed_build(root, mode)
            build = self._start_build(root, mode)
            base = self._earlier_built(root, mode)
            covered = base.sealed if base is not None else 0
            if rows * (loaded.n_tokens - covered) <= self.exact_while_building:
                self._count("attends_while_building")
                return covered, self._index_view(base, loaded, mode) if covered else None
            build.result()
        return root.sealed, self._index_view(root, loaded, mode) if root.sealed else None

    def _index_view(self, owner: LoadedContext, loaded: LoadedContext, mode: str):
        """`owner`'s built index of `mode` as `loaded` reads it: a layer's heads of a
        document's; for tail, their clusters stacked by the build (`_stacked`)."""
        built = self._built(owner, mode)
        heads = loaded.heads or slice(0, len(built))
        if mode != "tail":
            return built[heads]
        return owner.layer_heads[(heads.start, heads.stop)]

    def index_state(self, namespace: str, record: ContextRecord) -> dict:
        """`{"loaded", "built", "building", "sealed_tokens"}` of the record's version in the
        cache (nothing is loaded)."""
        with self._lock:
            loaded = self._cache.get((namespace, record["id"], record["version"]))
        if loaded is None:
            return {"loaded": False, "built": [], "building": [], "sealed_tokens": None}
        built = [mode for mode in MODES if self._built(loaded, mode) is not None]
        building = [
            mode for mode, build in loaded.builds.items() if mode not in built and not build.done()
        ]
        return {
            "loaded": True,
            "built": built,
            "building": sorted(building),
            "sealed_tokens": loaded.sealed,
        }

    def _observe_build(self, kind: str, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.index_build(kind, seconds)

    # -- compute ----------------------------------------------------------------------------

    @torch.no_grad()
    def attend(
        self,
        loaded: LoadedContext,
        queries: torch.Tensor,
        params: AttendParams,
        *,
        positions: torch.Tensor | None = None,
        causal: bool = False,
    ) -> AttendResult:
        """Attention of queries `(H, nq, d)` over the context: `out (H, nq, dv)`, `lse
        (H, nq)`, and with `return_topk` the best `ids (H, nq, R)` and their attention
        `weights`. `positions`/`causal` place the queries inside the context (self-attention)."""
        q = queries.to(self.device, torch.float32)
        if params.mode == "exact":
            out, lse = self._exact(loaded, q, positions, causal)
        else:
            if positions is None:  # bottom-right aligned, as dense attention's
                positions = query_positions(q.shape[1], loaded.n_tokens, q.device)
            # The audit's versions before the answer reads the clusters (`_audit`).
            audit = self._layer_audit(loaded) if self.audit_every and not causal else None
            versions = audit.versions() if audit is not None else None
            out, lse = self._sparse(loaded, q, params, positions, causal)
            if audit is not None:
                self._audit(loaded, audit, versions, q, out, params.mode)
        result = AttendResult(out=out, lse=lse)
        if params.return_topk:
            ids, scores = self._best(loaded, q, params.return_topk, exact=params.mode == "exact")
            result["ids"] = ids
            result["weights"] = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
        return result

    def _sparse(self, loaded, q, params, positions, causal):
        """Tail or topk attention of queries `(H, nq, d)` at `positions`: the keys an index
        covers (`_serving`: the sealed ones, or while they are being indexed fewer) through it,
        merged with the others read exactly; or causal tail."""
        if params.mode == "tail" and causal:
            # Causal tail clusters the keys before each segment of queries itself.
            with intra_op_threads(self.sparse_threads):
                heads = [
                    self._sparse_head(loaded, q[head], head, None, params, positions, causal)
                    for head in range(q.shape[0])
                ]
            return tuple(torch.stack(parts) for parts in zip(*heads, strict=True))
        count, index = self._serving(loaded, params.mode, q.shape[0] * q.shape[1])
        parts = []
        if count:
            parts.append(self._indexed_part(loaded, q, params, positions, causal, count, index))
        if count < loaded.n_tokens or not parts:
            parts.append(self._unindexed_part(loaded, q, positions, causal, count))
        return merge_attention(*parts) if len(parts) > 1 else parts[0]

    def _indexed_part(self, loaded, q, params, positions, causal, count, index):
        """Tail (non-causal) or topk attention over the first `count` keys through `index`
        (`_serving`): `(out, lse)`.

        The attention runs on `sparse_threads`: a sparse call is many small operations, which
        a second thread speeds up far less than it costs the other work of the process
        (benchmarks/service.py --sparse-threads: 32 decode clients, 294 requests/s on one
        thread, 135 on two). A decode step's compiled tail attention (`compiled_step_applies`)
        is one hand-off per thread, and takes PyTorch's default (docs/benchmark-notes.md, "A
        decode step on every thread"). The window's keys among the indexed ones are read
        exactly here, the others in the unindexed part."""
        if params.mode == "tail":
            # Every head in one call (a decode step costs one head's operations).
            always = window_and_sinks(loaded.n_tokens, params.window, params.sinks, q.device)
            always = always[always < count]
            step = compiled_step_applies(q, index, always, True, params.measured_queries)
            with intra_op_threads(0 if step else self.sparse_threads):
                return tail_attention_heads(
                    q,
                    index,
                    budget=params.budget,
                    always=always,
                    measured_queries=params.measured_queries,
                )
        # The window around each query's position: its keys after `count` are dropped here
        # (candidates past the keys given) and read in the unindexed part.
        with intra_op_threads(self.sparse_threads):
            heads = [
                self._sparse_head(
                    loaded, q[head], head, index[head], params, positions, causal, count
                )
                for head in range(q.shape[0])
            ]
        return tuple(torch.stack(parts) for parts in zip(*heads, strict=True))

    def _unindexed_part(self, loaded, q, positions, causal, start):
        """Exact attention over the keys from `start` on (the open segment, and any sealed key
        not indexed yet), `(out, lse)`; a causal query row before `start` sees none of them
        (`lse = -inf`)."""
        keys, values = loaded.keys[:, start:], loaded.values[:, start:]
        if not (causal and positions is not None):
            return dense_attention(q, keys, values, loaded.geometry)
        # Rows are consecutive positions ending at `end - 1`; those at or after `start` see
        # the keys up to their position (bottom-right aligned causal mask).
        end = int(positions[-1]) + 1
        inside = positions >= start
        out = q.new_zeros(*q.shape[:2], values.shape[-1])
        lse = q.new_full(q.shape[:2], -torch.inf)
        if inside.any():
            out[:, inside], lse[:, inside] = dense_attention(
                q[:, inside], keys[:, : end - start], values[:, : end - start],
                loaded.geometry, causal=True,
            )  # fmt: skip
        return out, lse

    def _exact(self, loaded, q, positions, causal):
        if causal and positions is not None:
            # Keys [0, end), bottom-right aligned causal mask: query row i (at position
            # start + i, with end - start rows) sees keys <= start + i.
            end = int(positions[-1]) + 1
            keys, values = loaded.keys[:, :end], loaded.values[:, :end]
            return dense_attention(q, keys, values, loaded.geometry, causal=True)
        return dense_attention(q, loaded.keys, loaded.values, loaded.geometry)

    def _sparse_head(self, loaded, q, head, index, params, positions, causal, count=0):
        """One head's causal tail (`index` None: the keys before each segment of queries are
        clustered per call, over every key) or topk (`index`: its search index, over the
        first `count` keys) attention."""
        if params.mode == "tail":
            k, v = loaded.keys[head], loaded.values[head]
            return retrieval_attention(
                q,
                k,
                v,
                loaded.geometry,
                index="clusters",
                tail=True,
                budget=params.budget,
                measured_queries=params.measured_queries,
                window=params.window,
                sinks=params.sinks,
                causal=causal,
                positions=positions,
            )
        return retrieval_attention(
            q,
            loaded.keys[head, :count],
            loaded.values[head, :count],
            loaded.geometry,
            top_k=params.top_k,
            index=index,
            window=params.window,
            sinks=params.sinks,
            causal=causal,
            positions=positions,
        )

    def _best(self, loaded, q, k, exact):
        """The k best keys per query: `(ids (H, nq, k), logits (H, nq, k))`, `-1`/`-inf`
        padded where an index returns fewer."""
        if not exact:
            count, indexes = self._serving(loaded, "topk", q.shape[0] * q.shape[1])
        ids, scores = [], []
        for head in range(q.shape[0]):
            qw = loaded.geometry.witness(q[head])
            if exact:
                top = exact_topk(q[head], loaded.keys[head], loaded.geometry, k)  # descending
                kw = loaded.geometry.witness(loaded.keys[head][top])
                logits = loaded.geometry.score_at(qw, kw)
            else:
                index = indexes[head] if count else None
                logits, top = self._best_indexed(loaded, qw, head, k, count, index)
            ids.append(top)
            scores.append(logits)
        return torch.stack(ids), torch.stack(scores)

    def _best_indexed(self, loaded, qw, head, k, count, index):
        """One head's k best keys `(logits, ids)` by its search index over the first `count`
        keys and by exact scores over the others, `-inf`/`-1` padded."""
        n = loaded.n_tokens
        logits = loaded.geometry.score(qw, loaded.geometry.witness(loaded.keys[head, count:]))
        ids = torch.arange(count, n, device=qw.device).expand(qw.shape[0], -1)
        if count:
            found_logits, found = index.search(qw, k)
            found_logits = found_logits.masked_fill(found < 0, -torch.inf)
            logits, ids = torch.cat([found_logits, logits], -1), torch.cat([found, ids], -1)
        if logits.shape[-1] < k:
            pad = (0, k - logits.shape[-1])
            logits = torch.nn.functional.pad(logits, pad, value=-torch.inf)
            ids = torch.nn.functional.pad(ids, pad, value=-1)
        logits, best = logits.topk(k, dim=-1)
        return logits, ids.gather(-1, best).masked_fill(logits == -torch.inf, -1)

    # -- the audit ------------------------------------------------------------------------
    #
    # The audit measures the answers of the real queries, which the probes of a build cannot
    # (docs/service.md, "The audit"). Each process judges the rows it answers; the piece sizes
    # it chooses are kept in the store, so that every replica's builds follow them.

    def _layer_audit(self, loaded: LoadedContext) -> Audit:
        """The audit of the context's layer that `loaded` answers (made at its first call,
        `_new_audit`)."""
        per_layer = loaded.record["heads"]
        layer = loaded.heads.start // per_layer if loaded.heads else 0
        key = (*loaded.key[:2], layer)
        with self._lock:
            audit = self._audits.get(key)
        if audit is None:
            settled = self.settled_heads(*loaded.key[:2])
            audit = self._new_audit(layer, per_layer, settled)
            with self._lock:
                audit = self._audits.setdefault(key, audit)
        return audit

    def _new_audit(self, layer: int, per_layer: int, settled: list[int]) -> Audit:
        """A layer's audit with nothing kept yet, its heads among the context's `settled`
        stored heads (`settled_heads`) settled."""
        audit = Audit(per_layer, self.audit_every, self.audit_window)
        for head in settled:
            if head // per_layer == layer:
                audit.settle(head % per_layer)
        return audit

    def settled_heads(self, namespace: str, context_id: str) -> list[int]:
        """The context's stored heads that an audit settled (`SETTLED_HEADS`)."""
        blob = self.store.get_blob(namespace, context_id, SETTLED_HEADS)
        return json.loads(blob or b"[]")

    def _audit(
        self,
        loaded: LoadedContext,
        audit: Audit,
        versions: tuple[int, ...],
        q: torch.Tensor,
        out: torch.Tensor,
        mode: str,
    ):
        """Hand this call's audited rows (`Audit.rows`, counted per context and layer) to the
        audit thread (`_judge`), so that the answer does not wait for their exact attention;
        while `AUDITS_WAITING` calls' rows wait there, a call's rows are not audited (counted
        as skipped). `versions`: the audit's before the call read the clusters, so that a head
        cut meanwhile keeps none of the call's errors (they measured the pieces before)."""
        with self._lock:
            rows = audit.rows(q.shape[1]).to(q.device)
            if len(rows) == 0:
                return
            if self._audits_waiting >= AUDITS_WAITING:
                self._count("audits_skipped")
                return
            self._audits_waiting += 1
        self._auditor.submit(self._judge, loaded, audit, versions, q[:, rows], out[:, rows], mode)

    def _judge(self, loaded, audit: Audit, versions, q: torch.Tensor, out: torch.Tensor, mode: str):
        """On the audit thread: the audited rows' exact answers over every key, their errors
        kept, and in tail mode the first head whose audit misses cut again (`_cut_missing`).
        A failure is logged (the answers were sent; these rows go unaudited)."""
        try:
            errors = audited_errors(q, out, loaded.keys, loaded.values, loaded.geometry).cpu()
            if self.metrics is not None:
                self.metrics.audited(errors)
            with self._lock:
                audit.record(errors, versions)
            if mode == "tail":
                self._cut_missing(loaded, audit)
        except Exception:
            logger.exception("the audit of %s failed", loaded.key)
        finally:
            with self._lock:
                self._audits_waiting -= 1

    def wait_for_audits(self) -> None:
        """Wait until the audited rows handed to the audit thread so far are judged."""
        self._auditor.submit(lambda: None).result()

    def _cut_missing(self, loaded: LoadedContext, audit: Audit) -> None:
        """The layer's first head whose audit misses and whose pieces are to be cut again
        (`Audit.to_cut`: to half their size, or back to the size before a halving that did not
        mend the head) gets pieces of that size: chosen, and cut, on the build thread
        (`_cut_again`); nothing while a cut of this context is under way, or while the version
        answering has no clusters of its own (an earlier version's answered)."""
        root = loaded.parent or loaded
        context = root.key[:2]
        heads = loaded.heads or slice(0, len(root.clusters or []))
        with self._lock:
            under_way = self._recuts.get(context)
            if not root.clusters or (under_way is not None and not under_way.done()):
                return
            max_keys = [int(clusters.max_keys) for clusters in root.clusters[heads]]
            cut = audit.to_cut(self.audit_target, max_keys)
            if cut is not None:
                head, size = cut
                self._recuts[context] = self._builder.submit(
                    self._cut_again, context, heads.start + head, size, size > max_keys[head]
                )

    def _cut_again(self, context: ContextId, head: int, size: int, back: bool = False) -> None:
        """On the build thread: keep in the store the choice of pieces of at most `size` keys
        for the stored head `head` (`back`: the size before a halving that did not mend it),
        then cut again, to the sizes chosen, the clusters of the newest cached version that has
        them, in place in every cached version that shares them (their answers change at
        once), and forget the errors of the heads cut (they measured the pieces before). A
        failure is logged: the next audit that misses tries again."""
        try:
            chosen = self._choose_pieces(context, head, size, back)
            if back:  # settled: no replica halves it again
                settled = set(self.settled_heads(*context)) | {head}
                self.store.put_blob(*context, SETTLED_HEADS, json.dumps(sorted(settled)).encode())
            with self._lock:
                versions = [
                    loaded
                    for key, loaded in self._cache.items()
                    if key[:2] == context and loaded.clusters
                ]
            if not versions:
                return
            newest = max(versions, key=lambda loaded: loaded.key[2])
            old = newest.clusters
            with torch.no_grad():
                new = [
                    self._head_clusters(newest, h, chosen[h])
                    if chosen.get(h) and int(clusters.max_keys) != chosen[h]
                    else clusters
                    for h, clusters in enumerate(old)
                ]
                stacked = self._stacked(newest, new)
            cut = [h for h in range(len(new)) if new[h] is not old[h]]
            grown = sum(new[h].nbytes - old[h].nbytes for h in cut)
            per_layer = newest.record["heads"]
            with self._lock:
                for loaded in self._cache.values():
                    if loaded.clusters is old:
                        loaded.clusters, loaded.layer_heads = new, stacked
                        loaded.nbytes += grown
                for h in cut:
                    audit = self._audits.get((*context, h // per_layer))
                    if audit is not None:
                        audit.clear(h % per_layer)
            if self.metrics is not None and cut:
                self.metrics.audit_cuts.inc(len(cut))
        except Exception:
            logger.exception("the audit's cut of %s head %d failed", context, head)
            raise

    def audited_pieces(self, namespace: str, context_id: str) -> dict[int, int]:
        """The piece sizes the audit chose for the context's stored heads (`AUDITED_PIECES`):
        `{head: most keys}`, {} when none."""
        blob = self.store.get_blob(namespace, context_id, AUDITED_PIECES)
        return {int(head): int(size) for head, size in json.loads(blob or b"{}").items()}

    def _choose_pieces(
        self, context: ContextId, head: int, size: int, back: bool = False
    ) -> dict[int, int]:
        """Keep pieces of at most `size` keys for `head` in the store (the smaller, where a
        replica chose one too, unless the size goes `back` to the one before a halving that did
        not mend the head); the context's choices now (`audited_pieces`)."""
        chosen = self.audited_pieces(*context)
        chosen[head] = size if back else min(size, chosen.get(head, size))
        self.store.put_blob(*context, AUDITED_PIECES, json.dumps(chosen).encode())
        return chosen

    def audit_report(self, namespace: str, record: ContextRecord) -> list[dict] | None:
        """Per stored head (layer 0's first): the errors this process audited (`Audit.report`)
        and `max_keys`, the most keys of the pieces of the cached version's clusters (None
        when none is cached); None without an audit."""
        if not self.audit_every:
            return None
        context, per_layer = (namespace, record["id"]), record["heads"]
        with self._lock:
            loaded = self._cache.get((*context, record["version"]))
            clusters = loaded.clusters if loaded is not None else None
            audits = [
                self._audits.get((*context, layer)) for layer in range(record.get("layers", 1))
            ]
        # Layers not audited yet report as fresh audits, with the settled heads.
        settled = self.settled_heads(*context) if None in audits else []
        report = []
        for layer, audit in enumerate(audits):
            if audit is None:
                report += self._new_audit(layer, per_layer, settled).report()
                continue
            with self._lock:
                report += audit.report()
        for head, row in enumerate(report):
            row["max_keys"] = int(clusters[head].max_keys) if clusters else None
        return report

    @torch.no_grad()
    def search(
        self, loaded: LoadedContext, queries: torch.Tensor, k: int, exact: bool
    ) -> SearchResult:
        q = queries.to(self.device, torch.float32)
        ids, scores = self._best(loaded, q, k, exact)
        result = SearchResult(ids=ids, scores=scores)
        if isinstance(loaded.geometry, DistanceGeometry):
            distances = []
            for head in range(q.shape[0]):
                qw = loaded.geometry.witness(q[head])
                kw = loaded.geometry.witness(loaded.keys[head][ids[head].clamp_min(0)])
                found = loaded.geometry.distance(qw.unsqueeze(-2), kw)
                distances.append(found.masked_fill(ids[head] < 0, float("inf")))
            result["distances"] = torch.stack(distances)
        return result

    @torch.no_grad()
    def stateless(
        self, geometry: Geometry, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
    ) -> AttendResult:
        geometry = geometry.to(self.device)
        out, lse = dense_attention(
            *(t.to(self.device, torch.float32) for t in (q, k, v)), geometry, causal=causal
        )
        return AttendResult(out=out, lse=lse)
