"""rewa.clients: the HTTP clients (`Client`, `AsyncClient`), the `rewa` command line, and the
LLM-pipeline integration (`RemoteMemory`, `ShardedMemory`, `merge_attention`).

The clients need numpy, httpx and safetensors only; the integration needs torch and is imported
the first time one of its names is used (PEP 562), so `import rewa.clients` never loads torch."""

from typing import Any

from .http import (
    AsyncClient,
    AttendResult,
    Client,
    InlineResult,
    RewaConnectionError,
    RewaError,
    SearchResult,
)

_NEEDS_TORCH = ("RemoteMemory", "ShardedMemory", "merge_attention")

__all__ = [
    "AsyncClient",
    "AttendResult",
    "Client",
    "InlineResult",
    "RemoteMemory",
    "RewaConnectionError",
    "RewaError",
    "SearchResult",
    "ShardedMemory",
    "merge_attention",
]


def __getattr__(name: str) -> Any:
    if name in _NEEDS_TORCH:
        from . import memory

        return getattr(memory, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
