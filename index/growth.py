"""How an index follows a context that grows by appends (docs/indexes.md, "Appends").

A trained structure (IVF cells, k-means clusters) is trained on the first `trained_prefix(n)`
keys of a context of n keys; every key, trained on or appended later, is then assigned to the
trained centres. The prefix is a function of n alone, so an index extended token by token is
the index built from scratch over the same keys, and retraining happens only when n crosses the
next doubling: appends cost an assignment each, and the retraining they trigger adds up to about
twice one build over the context's life.
"""

from __future__ import annotations

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
