"""Fused element-wise work of dense attention's CPU tiles, compiled by `torch.compile`.

Each CPU tile of a geometry with a product form costs a few matrix products (BLAS) and then a
chain of element-wise stages (`numerics.STAGES`), the terms' weighted sum and an online-softmax
step. Run one operation at a time, every stage is a pass over the tile, and `asin` and `log1p`
run well below the machine's vector speed: the product geometry's element-wise work cost four
times its matrix products. Compiled by TorchInductor's C++ backend, the same Python functions
(`numerics.combine_terms_`, `dense.softmax_step`; one kernel for both in a tile that no mask
touches) become vectorised loops (docs/mathematics.md,
"Fused dense attention"; docs/benchmark-notes.md, "Compiled CPU tiles (issue 27)").

A compilation takes seconds, so it runs in a background thread (`compiled`): calls that come
before it is ready run uncompiled (slowed while the compiling thread holds the interpreter
lock), and later ones compiled. `wait()`
blocks until the compilations under way have ended. Only calls of at least `MIN_LOGITS`
logits, of product forms that gain (`gains`), start one. It needs a C++ compiler and the Python
headers; a process that ends during a compilation waits for it. Where compilation fails, the
next call warns once and the process goes on uncompiled,
with the same results to rounding. `REWA_CPU_COMPILE=0` in the environment, or
`enabled = False`, turns it off.
"""

from __future__ import annotations

import os
import threading
import types
import warnings
from collections.abc import Callable

import torch

from .numerics import Stage

MIN_LOGITS = 1 << 24
"""Logits of a call (batch x queries x keys) from which it starts a compilation: a 4096-token
self-attention. Smaller calls cost too little for the compiled tiles to matter."""
SLOW_STAGES = frozenset({"arcsin_of_root", "acosh1p"})
"""Stages of several operations each, around a transcendental function that PyTorch's eager
kernels compute well below vector speed."""
enabled = os.environ.get("REWA_CPU_COMPILE", "1") != "0"
_DTYPES = (torch.float32, torch.float64)
_kernels: dict[tuple, Callable] = {}
_pending: dict[tuple, threading.Thread] = {}
_lock = threading.Lock()
_failure: str | None = None
_failure_reported = False


def applies(qw: torch.Tensor, stages: list[tuple[Stage, ...]] | None, n_logits: int) -> bool:
    """Whether a call's tiles use compiled kernels (once they are ready): CPU witnesses of
    float32 or float64, a product form (the `stages` of its terms) that `gains`, at least
    `MIN_LOGITS` logits, compilation turned on and never failed in this process."""
    return (
        enabled
        and _failure is None
        and stages is not None
        and gains(stages)
        and qw.device.type == "cpu"
        and qw.dtype in _DTYPES
        and n_logits >= MIN_LOGITS
    )


def gains(stages: list[tuple[Stage, ...]]) -> bool:
    """Whether compiling a product form pays: several terms, or a stage among `SLOW_STAGES`. A
    single term of square roots and squares costs as little run one operation at a time as
    compiled (docs/benchmark-notes.md, "Compiled CPU tiles (issue 27)")."""
    return len(stages) > 1 or any(stage in SLOW_STAGES for term in stages for stage in term)


def compiled(function: Callable, key: tuple, *args) -> Callable | None:
    """The compiled `function` for `key` and this kind of call (`args`) where it is ready;
    else None, with its compilation started in the background (on copies of `args`) unless
    one is under way or has failed."""
    _report_failure()
    key = (*key, _call_kind(args))
    kernel = _kernels.get(key)
    if kernel is not None:
        return kernel
    with _lock:
        if _failure is None and key not in _pending:
            copies = [_copy(arg) for arg in args]
            # Not a daemon: the interpreter waits for it at exit. A daemon thread still inside
            # the compiler when the interpreter finalises can abort the process (SIGABRT).
            thread = threading.Thread(
                target=_compile, args=(function, key, copies), name="rewa-compile", daemon=False
            )
            _pending[key] = thread
            thread.start()
    return None


def wait(timeout: float | None = None) -> bool:
    """Block until the compilations under way have ended (or `timeout` seconds have passed);
    whether none is left. A failure is reported here as at the next call."""
    with _lock:
        threads = list(_pending.values())
    for thread in threads:
        thread.join(timeout)
    _report_failure()
    with _lock:
        return not _pending


def signature(stages: list[tuple[Stage, ...]], dtype: torch.dtype) -> tuple:
    """The key of a product form's kernel: its stages and dtype."""
    return ("combine", tuple(stages), dtype)


def _call_kind(args: tuple) -> tuple:
    """What TorchDynamo specialises a compiled graph on beyond the key, so that a kernel is
    only called on the kind of call it was compiled for (another would be compiled again, in
    the caller's thread): which sizes are 0 or 1, the grad and inference modes and PyTorch's
    number of threads."""
    tensors = [t for arg in args for t in (arg if isinstance(arg, list) else [arg])]
    shapes = tuple(
        tuple(size < 2 for size in t.shape) if isinstance(t, torch.Tensor) else None
        for t in tensors
    )
    modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.get_num_threads())
    return shapes, *modes


def _copy(arg):
    """A copy of a call's tensors (a list or one) for the compiling thread to run on."""
    if isinstance(arg, list):
        return [_copy(item) for item in arg]
    return arg.clone() if isinstance(arg, torch.Tensor) else arg


def _compile(function: Callable, key: tuple, args: list) -> None:
    """Compile `function` (dynamic shapes, one graph) and run it once on `args` in the modes
    of the call that asked for it; keep it for `key` if that worked, else record the failure.

    Each key gets a copy of `function` with a code object of its own: TorchDynamo keeps its
    graphs, and its limit on how many it keeps, per code object, so the product forms of many
    geometries would otherwise crowd each other out."""
    global _failure
    _, grad, inference, threads = key[-1]
    copy = types.FunctionType(
        function.__code__.replace(),
        function.__globals__,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    try:
        kernel = torch.compile(copy, dynamic=True, fullgraph=True)
        torch.set_num_threads(threads)  # OpenMP counts per thread: this one starts at the default
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            kernel(*args)
    except Exception as error:  # any compiler fault: the process runs uncompiled
        with _lock:
            _failure = _failure or f"{type(error).__name__}: {error}"
    else:
        with _lock:
            _kernels[key] = kernel
    finally:
        with _lock:
            _pending.pop(key, None)


def _report_failure() -> None:
    global _failure_reported
    if _failure is not None and not _failure_reported:
        _failure_reported = True
        warnings.warn(
            f"rewa: compiling dense attention's CPU tiles failed ({_failure}); dense attention"
            " runs uncompiled in this process",
            RuntimeWarning,
            stacklevel=3,
        )


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's compiling threads: it starts its own."""
    global _lock, _pending
    _lock = threading.Lock()
    _pending = {}


os.register_at_fork(after_in_child=_after_fork_in_child)
