"""How an index follows a context that grows by appends (docs/indexes.md, "Appends").

A trained structure (IVF cells, k-means clusters) is trained on the first `trained_prefix(n)`
keys of a context of n keys; every key, trained on or appended later, is then assigned to the
trained centres. The prefix is a function of n alone, so an index extended token by token is
the index built from scratch over the same keys, and retraining happens only when n crosses the
next doubling: appends cost an assignment each, and the retraining they trigger adds up to about
twice one build over the context's life.
"""

from __future__ import annotations

import torch

TRAINING_BASE = 4096


def trained_prefix(n_keys: int) -> int:
    """How many leading keys of `n_keys` a trained index learns its centres from: all of them up
    to `TRAINING_BASE`, then the largest `TRAINING_BASE * 2^j` not above `n_keys`."""
    if n_keys <= TRAINING_BASE:
        return n_keys
    return TRAINING_BASE << ((n_keys // TRAINING_BASE).bit_length() - 1)


def retrains(old_keys: int, new_keys: int) -> bool:
    """Whether growing from `old_keys` to `new_keys` keys moves the trained prefix."""
    return trained_prefix(old_keys) != trained_prefix(new_keys)


# Spare capacity of a key or value buffer when an append outgrows it: amortised, each element is
# copied 1 / (GROWTH - 1) times.
GROWTH = 1.25


def appended(
    buffer: torch.Tensor, used: int, new: torch.Tensor, spare: bool = True
) -> torch.Tensor:
    """`buffer[:, :used]` followed by `new` along dimension 1: written into `buffer` when it has
    room (what lies before `used` is never touched, so views of earlier versions stay valid),
    else into a larger buffer, `GROWTH` times the old one or, with `spare`, times what it now
    holds if that is more: a buffer that took a long prompt in one append then takes the next
    appends without copying the prompt again (docs/indexes.md, "Appends")."""
    needed = used + new.shape[1]
    if needed > buffer.shape[1]:
        capacity = max(needed, int(buffer.shape[1] * GROWTH))
        if spare:
            capacity = max(capacity, int(needed * GROWTH))
        grown = buffer.new_empty(buffer.shape[0], capacity, buffer.shape[2])
        grown[:, :used] = buffer[:, :used]
        buffer = grown
    buffer[:, used:needed] = new
    return buffer


# Keys of a context's open last segment: read exactly by every query until the segment fills,
# then sealed into the indexes (docs/indexes.md, "The open segment").
OPEN_SEGMENT = 2048
# An attend that finds its index being built (the service) or extended (`LocalMemory`) reads
# the keys no built index covers exactly, unless that is more query-key pairs than this (then
# it waits for the build; what 2^26 pairs cost is in docs/indexes.md, "Builds in the
# background").
EXACT_WHILE_BUILDING = 1 << 26


def sealed_keys(n_keys: int, segment: int = OPEN_SEGMENT) -> int:
    """How many leading keys of `n_keys` the indexes hold: those of the full segments of
    `segment` keys (`n_keys` rounded down to a multiple of it); every key when `segment` is 0.
    A function of `n_keys` alone, so a context's answers do not depend on how its tokens
    arrived, and an append extends the indexes once per `segment` keys."""
    if segment < 0:
        raise ValueError(f"expected a segment of >= 0 keys (0: no open segment), got {segment}")
    return n_keys - n_keys % segment if segment else n_keys
