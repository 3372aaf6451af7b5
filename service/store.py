"""What a context store keeps, and the interface both stores implement.

A context is a metadata record (its `ContextInfo` fields plus `segments`) and immutable data
chunks. A chunk holds the keys `(heads, n, head_dim)` followed by the values
`(heads, n, value_dim)` of n consecutive tokens, raw bytes in the context's dtype. An upload
writes chunks that no record refers to; a commit replaces the record, in one atomic step, by
one whose segment list is the old one plus the upload's chunks, with `version + 1`. A reader
fetches one record and then only chunks that record names, so it always sees one whole
committed version, and an upload that is never committed is never seen.

Blobs (built indexes) are kept with their context, under names that include its version.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, NotRequired, Protocol, TypedDict


class StoreError(Exception):
    """Base of the store's errors."""


class StoreUnavailable(StoreError):
    """The backing store cannot be reached (503)."""


class NotFound(StoreError):
    """`what` (a context or an upload) does not exist in this namespace (404)."""

    def __init__(self, what: str, name: str) -> None:
        super().__init__(f"{what} {name!r} not found")
        self.what, self.name = what, name


class TooLarge(StoreError):
    """A commit would exceed the tokens-per-context limit (413)."""


class Segment(TypedDict):
    """One committed chunk of a context: its name in the store and its tokens (`pieces`: the
    Redis values it was written as, in the Redis store)."""

    chunk: str
    tokens: int
    pieces: NotRequired[int]


class ContextRecord(TypedDict):
    """A context's metadata record: the `ContextInfo` fields (service/schemas.py) and the
    segments of its committed version. Stores and the engine pass it as this plain dict."""

    id: str
    name: str | None
    geometry: dict[str, Any]  # {"name", **options}
    heads: int
    layers: NotRequired[int]  # a multi-layer document's layers (1 when absent)
    head_dim: int
    value_dim: int
    dtype: str
    index: dict[str, Any]  # {"kind", "top_k", "window", "sinks", "budget", "options"}
    n_tokens: int
    version: int
    created_at: float
    updated_at: float
    segments: list[Segment]


def new_id() -> str:
    return uuid.uuid4().hex


def new_record(info: dict[str, Any]) -> ContextRecord:
    """A version-0 record for a freshly created context."""
    now = time.time()
    return {
        **info,
        "n_tokens": 0,
        "version": 0,
        "created_at": now,
        "updated_at": now,
        "segments": [],
    }


def stored_heads(record: ContextRecord) -> int:
    """The heads a context stores per token: `heads` of each of its `layers` (a multi-layer
    document holds layer 0's heads first)."""
    return record["heads"] * record.get("layers", 1)


def committed(record: ContextRecord, chunks: list[Segment], max_tokens: int) -> ContextRecord:
    """The record after appending `chunks` (`{"chunk", "tokens", ...}`)."""
    added = sum(chunk["tokens"] for chunk in chunks)
    if record["n_tokens"] + added > max_tokens:
        raise TooLarge(
            f"the commit would hold {record['n_tokens'] + added} tokens; at most {max_tokens} "
            f"tokens per context"
        )
    return {
        **record,
        "n_tokens": record["n_tokens"] + added,
        "version": record["version"] + 1,
        "updated_at": time.time(),
        "segments": record["segments"] + chunks,
    }


class ContextStore(Protocol):
    """Namespaced contexts, uploads, chunks and blobs. Every method may raise
    `StoreUnavailable`; lookups of missing contexts or uploads raise `NotFound`."""

    def ping(self) -> None: ...

    def create(self, namespace: str, info: dict[str, Any]) -> ContextRecord: ...

    def list(self, namespace: str) -> list[ContextRecord]: ...

    def get(self, namespace: str, context_id: str) -> ContextRecord: ...

    def delete(self, namespace: str, context_id: str) -> None: ...

    def begin_upload(self, namespace: str, context_id: str) -> str: ...

    def upload(self, namespace: str, context_id: str, upload_id: str) -> list[Segment]: ...

    def add_chunk(
        self, namespace: str, context_id: str, upload_id: str, data: bytes, tokens: int
    ) -> list[Segment]: ...

    def commit(
        self, namespace: str, context_id: str, upload_id: str, max_tokens: int
    ) -> ContextRecord: ...

    def abort(self, namespace: str, context_id: str, upload_id: str) -> None: ...

    def read_chunk(self, namespace: str, context_id: str, segment: Segment) -> bytes: ...

    def put_blob(self, namespace: str, context_id: str, name: str, data: bytes) -> None: ...

    def get_blob(self, namespace: str, context_id: str, name: str) -> bytes | None: ...
