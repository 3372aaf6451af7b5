"""rewa.clients: the HTTP clients (`Client`, `AsyncClient`), the `rewa` command line, and the
LLM-pipeline integration (`RemoteMemory`, `ShardedMemory`, `merge_attention`)."""

from .http import AsyncClient, AttendResult, Client, RewaConnectionError, RewaError, SearchResult
from .memory import RemoteMemory, ShardedMemory, merge_attention

__all__ = [
    "AsyncClient",
    "AttendResult",
    "Client",
    "RemoteMemory",
    "RewaConnectionError",
    "RewaError",
    "SearchResult",
    "ShardedMemory",
    "merge_attention",
]
