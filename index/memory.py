"""`LocalMemory`: an attention memory in the calling process, with the interface of the service's
remote memory (`rewa.clients.RemoteMemory`): `append(keys, values)` adds tokens, `attend(queries)`
returns `(out, lse)` over every token appended so far, `close()` frees it. A pipeline picks the
process-local or the shared remote memory by which one it constructs (docs/llm.md).

It computes what the service's engine computes for a context of the same geometry and mode (the
same `tail_attention_heads` and `retrieval_attention` calls, the same defaults), without the
store, the HTTP request or the device queue: keys and values live in buffers with spare
capacity, and the index of the mode (clusters for `tail`, the search index for `topk`) is built
at the first attend and extended by later appends (`KeyClusters.extend`, `LiftIndex.extend`;
docs/indexes.md, "Appends").

As in the service, the index holds the tokens of the full segments of `open_segment` tokens
(`growth.sealed_keys`); those of the open last segment are read exactly by every query and
merged with the index's answer (docs/mathematics.md 7, docs/indexes.md "The open segment"), and
the index is extended when a segment fills. Extending costs time per cluster the new keys join,
not per key (docs/indexes.md), so a decoding model that spills a few hundred tokens at a time
pays it once per segment instead of once per spill. `open_segment=0` indexes every token.

As in the service too, a tail memory extends its clusters on a build thread (one for every
memory of the process), not in the attend that fills the segment: until the extension ends,
attends read the clusters they had and every later token exactly, unless that is more than
`exact_while_building` query-key pairs (then they wait; 0: always wait, so that answers never
depend on when an extension ended). `wait_for_index` waits for it (docs/indexes.md, "Builds
in the background"). The first index of a memory is built in the attend that needs it.

With `audit_every`, one query row in that many is also answered exactly, on an audit thread
(one for every memory of the process; the call does not wait for it), and the error of the
memory's answer kept per head (`audit.py`, `audit_report`); a tail head whose 99th percentile
of them passes `audit_target` has its pieces cut again at half the size, on the build thread
(docs/indexes.md, "The audit")."""

from __future__ import annotations

import functools
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal

import torch

from rewa.attention import Geometry, dense_attention, make_geometry, merge_attention

from .audit import AUDIT_TARGET, AUDIT_WINDOW, AUDITS_WAITING, Audit, audited_errors
from .clusters import ClusterHeads, KeyClusters, check_clusterable
from .growth import EXACT_WHILE_BUILDING, OPEN_SEGMENT, appended, sealed_keys
from .retrieval import build_index, retrieval_attention
from .tail import tail_attention_heads
from .tail.threads import background_threads

MODES = ("tail", "topk", "exact")
INITIAL_CAPACITY = 1024


@functools.cache
def _builder() -> ThreadPoolExecutor:
    """The thread that extends every tail memory's clusters, one extension at a time. A forked
    child gets its own (the parent's thread does not exist in it)."""
    return background_threads(1, "rewa-memory-build")


@functools.cache
def _auditor() -> ThreadPoolExecutor:
    """The thread that answers every memory's audited rows exactly (`audited_errors`)."""
    return background_threads(1, "rewa-memory-audit")


def _clear_threads() -> None:
    _builder.cache_clear()
    _auditor.cache_clear()


os.register_at_fork(after_in_child=_clear_threads)


class LocalMemory:
    """Keys `(heads, n, head_dim)` and values `(heads, n, value_dim)` of one sequence, attended
    by queries `(heads, m, head_dim)` (head h of the queries reads head h of the memory).

    `geometry` is a geometry name with `geometry_options`, or a `Geometry` (a trained one, used
    as it is). `mode`: `tail` (clusters read within `budget`, a fraction of the keys, and every
    other cluster estimated), `topk` (the `top_k` best keys of an `index` of that kind) or `exact`
    (dense attention). `open_segment`: the size of the segments the index takes whole; the
    tokens of the last, open one are read exactly (module docstring). `exact_while_building`:
    the most query-key pairs an attend reads exactly instead of waiting for a tail extension
    under way (module docstring). `probed_pieces`: tail mode's clusters built with pieces sized
    by probes (the default) or, with `False`, of the default size on every head
    (`KeyClusters.build`; docs/indexes.md, "Pieces sized by probes"). `audit_every`: one query
    row in that many also answered exactly, and its error kept per head, the latest
    `audit_window`; 0 (the default): no audit. In tail mode a head whose audited 99th
    percentile passes `audit_target` gets pieces of half the size (module docstring). The
    memory holds float32 tensors on `device`."""

    def __init__(
        self,
        heads: int,
        head_dim: int,
        *,
        value_dim: int | None = None,
        geometry: str | Geometry = "dot",
        mode: Literal["tail", "topk", "exact"] = "tail",
        budget: float = 0.02,
        top_k: int = 64,
        index: str = "ivf",
        open_segment: int = OPEN_SEGMENT,
        exact_while_building: int = EXACT_WHILE_BUILDING,
        probed_pieces: bool = True,
        audit_every: int = 0,
        audit_window: int = AUDIT_WINDOW,
        audit_target: float = AUDIT_TARGET,
        device: torch.device | str = "cpu",
        **geometry_options,
    ) -> None:
        if heads < 1 or head_dim < 1:
            raise ValueError(f"expected heads >= 1 and head_dim >= 1, got {heads}, {head_dim}")
        if mode not in MODES:
            raise ValueError(f"expected mode in {MODES}, got {mode!r}")
        if not 0 < budget <= 1:
            raise ValueError(f"expected a budget in (0, 1] (a fraction of keys), got {budget}")
        if top_k < 1:
            raise ValueError(f"expected top_k >= 1, got {top_k}")
        if open_segment < 0:
            raise ValueError(
                f"expected open_segment >= 0 (0: index every token), got {open_segment}"
            )
        if exact_while_building < 0:
            raise ValueError(
                f"expected exact_while_building >= 0 query-key pairs, got {exact_while_building}"
            )
        if audit_every < 0:
            raise ValueError(f"expected audit_every >= 0 (0: no audit), got {audit_every}")
        if audit_every and mode == "exact":
            raise ValueError("mode 'exact' answers exactly: there is nothing to audit")
        if not audit_target > 0:
            raise ValueError(f"expected an audit_target > 0 (a relative error), got {audit_target}")
        if isinstance(geometry, str):
            geometry = make_geometry(geometry, head_dim, **geometry_options)
        elif geometry_options:
            raise ValueError("geometry options go with a geometry name, not a Geometry")
        if geometry.dim != head_dim:
            raise ValueError(f"the geometry's dim is {geometry.dim}, the head_dim {head_dim}")
        if mode == "tail":
            check_clusterable(geometry)  # here, not at the first attend after a build
        self.heads, self.head_dim = heads, head_dim
        self.value_dim = value_dim or head_dim
        self.device = torch.device(device)
        self.geometry = geometry.to(self.device)
        self.mode, self.budget, self.top_k, self.index_kind = mode, budget, top_k, index
        self.open_segment, self.exact_while_building = open_segment, exact_while_building
        self.probed_pieces = probed_pieces
        self.audit_target = audit_target
        self._audit = Audit(heads, audit_every, audit_window) if audit_every else None
        # the audited rows' errors on the audit thread, and the audit's versions when they
        # were answered (`Audit.versions`)
        self._audits_under_way: deque[tuple[Future, tuple[int, ...]]] = deque()
        # tail: the heads whose pieces the audit cut again -> their pieces' most keys, which
        # extensions and retrainings keep
        self._audited_keys: dict[int, int] = {}
        self._recutting: int | None = None  # the head the extension under way cuts again
        self._key_buffer = torch.empty(heads, INITIAL_CAPACITY, head_dim, device=self.device)
        self._value_buffer = torch.empty(
            heads, INITIAL_CAPACITY, self.value_dim, device=self.device
        )
        self._n_tokens = 0
        self._indexes: list | None = None  # per head: KeyClusters (tail) or a search index
        self._cluster_heads: ClusterHeads | None = None  # tail: the heads' clusters, stacked
        self._indexed = 0  # tokens the indexes hold
        # tail: the extension under way on the build thread, to how many tokens
        self._extension: Future | None = None
        self._extending_to = 0

    @property
    def n_tokens(self) -> int:
        return self._n_tokens

    @property
    def keys(self) -> torch.Tensor:
        return self._key_buffer[:, : self._n_tokens]

    @property
    def values(self) -> torch.Tensor:
        return self._value_buffer[:, : self._n_tokens]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add tokens: keys `(heads, n, head_dim)`, values `(heads, n, value_dim)`."""
        expected_k = (self.heads, keys.shape[1] if keys.dim() == 3 else -1, self.head_dim)
        if keys.dim() != 3 or tuple(keys.shape) != expected_k:
            raise ValueError(
                f"expected keys (heads={self.heads}, n, head_dim={self.head_dim}), got "
                f"{tuple(keys.shape)}"
            )
        if tuple(values.shape) != (self.heads, keys.shape[1], self.value_dim):
            raise ValueError(
                f"expected values ({self.heads}, {keys.shape[1]}, {self.value_dim}), got "
                f"{tuple(values.shape)}"
            )
        keys = keys.detach().to(self.device, torch.float32)
        values = values.detach().to(self.device, torch.float32)
        if not (torch.isfinite(keys).all() and torch.isfinite(values).all()):
            raise ValueError("keys and values must be finite")
        used = self._n_tokens
        self._key_buffer = appended(self._key_buffer, used, keys)
        self._value_buffer = appended(self._value_buffer, used, values)
        self._n_tokens = used + keys.shape[1]

    @torch.no_grad()
    def attend(self, queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of queries `(heads, m, head_dim)` over every token appended: `out (heads,
        m, value_dim)`, `lse (heads, m)`, float32 on the memory's device."""
        if (
            queries.dim() != 3
            or queries.shape[0] != self.heads
            or queries.shape[2] != self.head_dim
        ):
            raise ValueError(
                f"expected queries (heads={self.heads}, m, head_dim={self.head_dim}), got "
                f"{tuple(queries.shape)}"
            )
        if self._n_tokens == 0:
            raise ValueError("attend on an empty memory: append tokens first")
        q = queries.detach().to(self.device, torch.float32)
        if self.mode == "exact":
            return dense_attention(q, self.keys, self.values, self.geometry)
        indexes = self._current_indexes(rows=q.shape[0] * q.shape[1])
        parts = []
        if self.mode == "tail" and indexes:
            parts.append(tail_attention_heads(q, self._cluster_heads, budget=self.budget))
        elif indexes:
            heads = [self._topk_head(q[head], head, indexes[head]) for head in range(self.heads)]
            parts.append(tuple(torch.stack(part) for part in zip(*heads, strict=True)))
        if self._indexed < self._n_tokens or not parts:  # the open segment, read exactly
            recent = slice(self._indexed, self._n_tokens)
            parts.append(
                dense_attention(
                    q, self._key_buffer[:, recent], self._value_buffer[:, recent], self.geometry
                )
            )
        out, lse = merge_attention(*parts) if len(parts) > 1 else parts[0]
        if self._audit is not None:
            self._take_audits()
            self._start_audit(q, out)
        return out, lse

    __call__ = attend

    def audit_report(self) -> list[dict]:
        """Per head: `audited` (the errors kept, at most `audit_window`), their `err_median` and
        `err_p99` (None while none is kept), `settled` (a halving did not mend it: it is not
        cut again) and, in tail mode, `max_keys`, the most keys of the head's pieces (0 before
        its first index). An error is `||out - exact|| /
        ||exact||` of one audited query row's answer."""
        if self._audit is None:
            raise ValueError("this memory has no audit: construct it with audit_every >= 1")
        self._take_audits(wait=True)
        report = self._audit.report()
        if self.mode == "tail":
            for head, row in enumerate(report):
                row["max_keys"] = int(self._indexes[head].max_keys) if self._indexes else 0
        return report

    def _start_audit(self, q: torch.Tensor, out: torch.Tensor) -> None:
        """Hand this call's audited rows (`Audit.rows`) to the audit thread, which answers them
        exactly over the tokens held now (`audited_errors`; appends write after them); the
        call does not wait for it, unless `AUDITS_WAITING` calls' rows are waiting there
        already (then for the oldest)."""
        rows = self._audit.rows(q.shape[1]).to(q.device)
        if len(rows) == 0:
            return
        while len(self._audits_under_way) >= AUDITS_WAITING:
            self._take_audit()
        errors = _auditor().submit(
            audited_errors, q[:, rows], out[:, rows], self.keys, self.values, self.geometry
        )
        # No index changed since this call read them (`_take_extension` runs before the answer).
        self._audits_under_way.append((errors, self._audit.versions()))

    def _take_audits(self, wait: bool = False) -> None:
        """Keep the errors of the audits done (with `wait`, of every one handed over), in the
        order of their calls."""
        while self._audits_under_way and (wait or self._audits_under_way[0][0].done()):
            self._take_audit()

    def _take_audit(self) -> None:
        """Keep the errors of the oldest audit handed over (waiting for it), and, in tail mode,
        start cutting again the first head whose audit misses (`Audit.to_cut`: to half its
        pieces' size, or back to the size before a halving that did not mend it), unless an
        extension is under way (then a later call does). A head cut again since that call
        keeps none of its errors: they measured the pieces before."""
        errors, versions = self._audits_under_way.popleft()
        self._audit.record(errors.result(), versions)
        if self.mode != "tail" or not self._indexes or self._extension is not None:
            return
        cut = self._audit.to_cut(
            self.audit_target, [int(index.max_keys) for index in self._indexes]
        )
        if cut is not None:
            head, max_keys = cut
            keys = self.geometry.witness(self._key_buffer[head, : self._indexed])
            self._extension = _builder().submit(
                _recut, self._indexes, head, keys, self._value_buffer[head, : self._indexed],
                self.geometry, max_keys,
            )  # fmt: skip
            self._extending_to, self._recutting = self._indexed, head

    def wait_for_index(self) -> None:
        """Wait until the index holds every sealed token: for the audits handed over (a cut
        one of them starts), for the extension under way, then for the index of what was
        sealed meanwhile (built or extended now; its error, if it fails). Nothing to wait for
        in `exact` mode."""
        if self._audit is not None:
            self._take_audits(wait=True)
        self._finish_extension()
        if self.mode != "exact" and self._n_tokens > 0:
            self._current_indexes()  # starts (tail) or makes (topk) what is missing
            self._finish_extension()

    def _finish_extension(self) -> None:
        """Wait for the extension under way, if any, and take it (its error, if it failed)."""
        if self._extension is not None:
            self._extension.exception()  # waits for it; `_take_extension` raises its error
            self._take_extension()

    def close(self) -> None:
        """Free the tensors and indexes (the memory is empty afterwards); an extension under way
        finishes on the build thread and is dropped."""
        self._extension, self._extending_to, self._recutting = None, 0, None
        self._audited_keys = {}
        self._audits_under_way.clear()  # audits under way finish on the audit thread, unread
        if self._audit is not None:
            self._audit = Audit(self.heads, self._audit.every, self._audit.window)
        self._key_buffer = self._key_buffer[:, :0]
        self._value_buffer = self._value_buffer[:, :0]
        self._n_tokens = self._indexed = 0
        self._indexes = self._cluster_heads = None

    def _topk_head(self, q, head, index):
        k, v = self._key_buffer[head, : self._indexed], self._value_buffer[head, : self._indexed]
        return retrieval_attention(q, k, v, self.geometry, top_k=self.top_k, index=index)

    def _current_indexes(self, rows: int = 0) -> list:
        """The mode's index of every head over the first `_indexed` tokens, the sealed ones
        (`sealed_keys`): built at the first attend that has any, then extended when a segment
        fills (a tail memory's on the build thread; this index meanwhile, unless reading the
        unindexed keys exactly costs more than `exact_while_building` pairs for `rows` query
        rows: then it waits); [] while none is sealed."""
        sealed = sealed_keys(self._n_tokens, self.open_segment)
        if self._extension is not None and self._extension.done():
            self._take_extension()
        if sealed == 0 or (self._indexes is not None and sealed == self._indexed):
            return self._indexes or []
        witness, probed = self.geometry.witness, self.probed_pieces
        keys, values = self._key_buffer[:, :sealed], self._value_buffer[:, :sealed]
        if self._indexes is None:
            if self.mode == "tail":
                self._indexes = [
                    KeyClusters.build(
                        witness(keys[h]), values[h], self.geometry, probed_pieces=probed
                    )
                    for h in range(self.heads)
                ]
                self._cluster_heads = ClusterHeads.stacked(self._indexes)
            else:
                self._indexes = [
                    build_index(keys[h], self.geometry, self.index_kind) for h in range(self.heads)
                ]
            self._indexed = sealed
        elif self.mode == "tail":
            if self._extension is None:
                # The sealed keys are never written again (appends go after them), so the
                # build thread reads them in place while the memory takes more tokens.
                self._extension = _builder().submit(
                    _extended, self._indexes, witness(keys[:, self._indexed :]),
                    values[:, self._indexed :], probed, dict(self._audited_keys),
                )  # fmt: skip
                self._extending_to = sealed
            if rows * (self._n_tokens - self._indexed) > self.exact_while_building:
                self._finish_extension()
                return self._current_indexes(rows)
        else:
            for h, index in enumerate(self._indexes):
                index.extend(witness(keys[h]))
            self._indexed = sealed
        return self._indexes

    def _take_extension(self) -> None:
        """The finished extension's clusters in place of the current ones (its error raised, and
        forgotten, if it failed: the next attend starts it again)."""
        extension, self._extension = self._extension, None
        recut, self._recutting = self._recutting, None
        self._indexes, self._cluster_heads = extension.result()
        self._indexed = self._extending_to
        if recut is not None:
            self._audited_keys[recut] = int(self._indexes[recut].max_keys)
            self._audit.clear(recut)  # its errors measured the pieces before

    def __repr__(self) -> str:
        return (
            f"LocalMemory(heads={self.heads}, head_dim={self.head_dim}, "
            f"value_dim={self.value_dim}, mode={self.mode!r}, n_tokens={self._n_tokens})"
        )


def _extended(
    clusters: list[KeyClusters],
    keys_w: torch.Tensor,
    values: torch.Tensor,
    probed_pieces: bool,
    audited_keys: dict[int, int],
) -> tuple[list[KeyClusters], ClusterHeads]:
    """On the build thread: every head's clusters extended by its new key witnesses `(heads,
    m, d_w)` and values (new objects: the old ones keep answering), and the heads stacked;
    `probed_pieces` is the build's option, for a retraining, except on the heads of
    `audited_keys`, whose pieces keep the size the audit chose."""
    with torch.no_grad():
        extended = [
            head.extend(keys_w[h], values[h], **_build_options(h, probed_pieces, audited_keys))
            for h, head in enumerate(clusters)
        ]
        return extended, ClusterHeads.stacked(extended)


def _build_options(head: int, probed_pieces: bool, audited_keys: dict[int, int]) -> dict:
    if head in audited_keys:
        return {"max_cluster_keys": audited_keys[head], "probed_pieces": False}
    return {"probed_pieces": probed_pieces}


def _recut(
    clusters: list[KeyClusters],
    head: int,
    keys_w: torch.Tensor,
    values: torch.Tensor,
    geometry: Geometry,
    max_keys: int,
) -> tuple[list[KeyClusters], ClusterHeads]:
    """On the build thread: `clusters` with the head `head` built again from its key witnesses
    `(n, d_w)` and values in pieces of at most `max_keys` keys, and the heads stacked."""
    with torch.no_grad():
        recut = list(clusters)
        recut[head] = KeyClusters.build(
            keys_w, values, geometry, max_cluster_keys=max_keys, probed_pieces=False
        )
        return recut, ClusterHeads.stacked(recut)
