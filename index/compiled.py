"""The index's loops compiled by Numba (the IVF shortlist's, `largest.py`; the LSH walk's,
`lsh_attention.py`; tail attention's, `tail/kernel.py` and `tail/decode.py`)."""

from __future__ import annotations

import functools
from collections.abc import Callable


@functools.cache
def compiled_loop(loop: Callable) -> Callable:
    """`loop` compiled by Numba without the GIL and cached on disk (its cache directory,
    `NUMBA_CACHE_DIR`), its floating-point sums free to be reordered into vector lanes
    (`fastmath`: reassociation and fused multiply-adds, as BLAS orders them). Numba is imported
    here, on first use: a process that never runs a loop does not pay for importing it."""
    import numba

    return numba.njit(nogil=True, cache=True, fastmath={"reassoc", "contract"})(loop)
