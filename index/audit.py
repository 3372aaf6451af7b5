"""An audit of a memory's answers against exact attention (docs/indexes.md, "The audit").

The probes that size a tail head's pieces (`tail/probe.py`) ask the head's keys, because its
queries are not known when it is indexed; on some heads the real queries miss where the keys do
not (docs/benchmark-notes.md, "The head the probes leave alone"). An audit measures the real
queries instead: one query row in `every`, counted over the memory's life (so the same rows
whatever the sizes of the calls), is also answered by exact dense attention over every token,
and the relative output error of the memory's answer is kept per head, the latest `window` of
them. A head whose 99th percentile over a full window is above `target` is `missing`; the
memory then cuts that head's pieces again at half the size (`LocalMemory`, tail mode).

A halving that does not mend a head is not repeated. Halving mends sharp heads, whose pieces'
keys are too spread for the estimate; it does not mend heads whose answers miss for other
reasons (keys with no structure to cluster, answers near zero that make every relative error
large), and each halving makes a head's calls dearer. So a head the audit halved is halved
again only where the share of its errors above the target came down to `PROBE_GAIN` (0.8) of
the share that cut it, the probes' gain (`tail/probe.py`); otherwise it is `settled`: its
pieces go back to the size they had before that halving, and it is not cut again. The share,
not the 99th percentile, because the two verdicts may rest on different numbers of errors (an
earlier verdict on a few dozen): a 99th percentile of a few dozen errors is about their
largest, above that of a full window, while a share above the target is a fair estimate at
any count.

A head is judged as soon as its verdict is certain: when its window is full, or before, once so
many of its errors are above the target that the full window's 99th percentile will be above it
whatever the errors still to come (`certain_misses`: 7 of a window of 512). A head that misses
by far is cut after a few dozen audited rows; one near the target waits for its full window, as
a 99th percentile over 512 errors rests on their 5 worst. A call with audited rows reads every
key and value once more (their dense attention)."""

from __future__ import annotations

import math
from collections import deque

import torch

from rewa.attention import Geometry, dense_attention

from .clusters import MIN_CLUSTER_KEYS
from .measures import output_error
from .tail.probe import PROBE_GAIN

AUDIT_WINDOW = 512  # the latest errors kept per head, over which the 99th percentile is judged
AUDIT_TARGET = 0.15  # the 99th percentile of the relative output error a head should stay within
# Calls whose audited rows may wait for an audit thread (`LocalMemory` then waits for the oldest;
# the service's engine leaves the rows unaudited).
AUDITS_WAITING = 8
QUANTILE = 0.99  # the quantile of a head's window that is judged


def certain_misses(window: int) -> int:
    """How many errors above the target make a full window of `window` errors miss it, whatever
    the others: its 99th percentile interpolates between the sorted errors at rank
    `floor(0.99 (window - 1))` and the next, so it is above the target when every error from
    that rank on is (7 of 512, 3 of 128, 1 of 1)."""
    return window - math.floor(QUANTILE * (window - 1))


class Audit:
    """The audited errors of `heads` heads: one query row in `every`, the latest `window` per
    head."""

    def __init__(self, heads: int, every: int, window: int = AUDIT_WINDOW) -> None:
        if heads < 1:
            raise ValueError(f"expected heads >= 1, got {heads}")
        if every < 1:
            raise ValueError(f"expected an audit of one query row in every >= 1, got {every}")
        if window < 1:
            raise ValueError(f"expected an audit window of >= 1 errors, got {window}")
        self.every, self.window = every, window
        self._rows_seen = 0
        self._errors = [deque(maxlen=window) for _ in range(heads)]
        self._versions = [0] * heads  # per head, how many times its errors were forgotten
        # per head `to_cut` halved: its version, share of errors above the target and most
        # keys then
        self._halved_at: dict[int, tuple[int, float, int]] = {}
        self._settled: set[int] = set()  # heads whose halving did not mend them

    def rows(self, m: int) -> torch.Tensor:
        """The indices of the audited rows among a call's `m` query rows (those whose count over
        the memory's life is a multiple of `every`); the call's rows count as seen."""
        first = -self._rows_seen % self.every
        self._rows_seen += m
        return torch.arange(first, max(first, m), self.every)

    def versions(self) -> tuple[int, ...]:
        """Per head, how many times its errors were forgotten (`clear`); taken before a call
        reads a head's index, it tells `record` whether the call's errors measured the index
        the head has now."""
        return tuple(self._versions)

    def record(self, errors: torch.Tensor, versions: tuple[int, ...]) -> None:
        """Keep the audited rows' errors `(heads, r)` of a call that read the heads' indexes at
        `versions` (`versions()`), for the heads whose index has not changed since: the others'
        errors measured the index before."""
        for head, (kept, row) in enumerate(zip(self._errors, errors.tolist(), strict=True)):
            if versions[head] == self._versions[head]:
                kept.extend(row)

    def settle(self, head: int) -> None:
        """Never cut `head` again (another audit of it, a replica's, found that its halving did
        not mend it: `to_cut`)."""
        self._settled.add(head)

    def clear(self, head: int) -> None:
        """Forget a head's errors, and those of calls under way (its index changed: they
        measured the one before)."""
        self._errors[head].clear()
        self._versions[head] += 1

    def missing(self, target: float) -> list[int]:
        """The heads whose window's 99th percentile is above `target`, or will be once it is
        full: `certain_misses(window)` of its errors are above `target` already (a window that
        is not full loses none of them before it fills)."""
        return [head for head, _ in self._missing(target)]

    def _missing(self, target: float) -> list[tuple[int, float]]:
        """`missing`'s heads, each with the share of its errors above `target`."""
        found = []
        for head, kept in enumerate(self._errors):
            errors = torch.tensor(list(kept), dtype=torch.float64)
            above = int((errors > target).sum())
            if above >= certain_misses(self.window) or (
                len(kept) == self.window and errors.quantile(QUANTILE).item() > target
            ):
                found.append((head, above / len(kept)))
        return found

    def to_cut(self, target: float, max_keys: list[int]) -> tuple[int, int] | None:
        """`(head, size)`: the first head `missing` the target whose pieces of at most
        `max_keys[head]` keys are to be cut again, and the size to cut them to; None when there
        is none. The size is half (a head whose half would be below `MIN_CLUSTER_KEYS` is left
        alone), unless the audit halved the head before and it was cut since (`clear`) and
        that halving did not mend it, the share of its errors above `target` now above
        `PROBE_GAIN` of the share it had then: then the head is settled, never chosen again,
        and the size is the one it had before that halving (module docstring)."""
        for head, above in self._missing(target):
            if head in self._settled:
                continue
            version, above_then, size_then = self._halved_at.get(head, (-1, math.inf, 0))
            if version != self._versions[head] and above > PROBE_GAIN * above_then:
                self._settled.add(head)
                if max_keys[head] < size_then:
                    return head, size_then
                continue
            if max_keys[head] // 2 >= MIN_CLUSTER_KEYS:
                self._halved_at[head] = self._versions[head], above, max_keys[head]
                return head, max_keys[head] // 2
        return None

    def report(self) -> list[dict]:
        """Per head: `audited` (errors kept), their `err_median` and `err_p99` (None while none
        is kept), and `settled` (a halving did not mend it: `to_cut`)."""
        return [
            {
                "audited": len(kept),
                "err_median": _quantile(kept, 0.5) if kept else None,
                "err_p99": _quantile(kept, QUANTILE) if kept else None,
                "settled": head in self._settled,
            }
            for head, kept in enumerate(self._errors)
        ]


def audited_errors(
    q: torch.Tensor, out: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, geometry: Geometry
) -> torch.Tensor:
    """The relative errors `(heads, r)` of the answers `out` to the audited query rows `q`
    against exact attention over `keys` and `values` (every token the answers read)."""
    with torch.no_grad():
        exact, _ = dense_attention(q, keys, values, geometry)
        return output_error(out, exact)


def _quantile(values: deque, q: float) -> float:
    return torch.tensor(list(values), dtype=torch.float64).quantile(q).item()
