"""The embedded store: contexts in this process, persisted under a data directory when one is
given (`REWA_DATA_DIR`), so `rewa serve` needs nothing else.

On disk, per namespace and context: `record.json` (the committed record) and
`chunks/<id>.bin`. Every file is written to a temporary name, flushed to disk and renamed over
its final name (atomic on POSIX), and a commit is the rename of `record.json`: a crash leaves
either the old record or the new one. Chunks of uploads that were never committed are deleted
when the store opens; uploads themselves live in memory and end with the process."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any

from .store import (
    ContextRecord,
    NotFound,
    Segment,
    StoreUnavailable,
    committed,
    new_id,
    new_record,
)

RECORD = "record.json"


class EmbeddedStore:
    def __init__(self, data_dir: Path | str | None = None) -> None:
        self.root = Path(data_dir) if data_dir is not None else None
        self._lock = threading.Lock()
        self._records: dict[tuple[str, str], dict] = {}
        self._chunks: dict[tuple[str, str, str], bytes] = {}  # memory mode only
        self._uploads: dict[tuple[str, str, str], list[Segment]] = {}
        self._blobs: dict[tuple[str, str, str], bytes] = {}  # memory mode only
        if self.root is not None:
            self.root.mkdir(parents=True, exist_ok=True)
            self._load()

    # -- persistence ------------------------------------------------------------------------

    def _load(self) -> None:
        """Read every committed record; delete chunks no record refers to."""
        assert self.root is not None
        for directory in self.root.glob("*/*"):
            if directory.name.startswith(".") or not directory.is_dir():
                continue
            record_path = directory / RECORD
            if not record_path.exists():
                shutil.rmtree(directory, ignore_errors=True)
                continue
            record = json.loads(record_path.read_text())
            self._records[(directory.parent.name, directory.name)] = record
            referenced = {segment["chunk"] for segment in record["segments"]}
            for chunk in (directory / "chunks").glob("*"):
                if chunk.stem not in referenced:
                    chunk.unlink()
        for leftover in self.root.glob("*/.deleted-*"):
            shutil.rmtree(leftover, ignore_errors=True)

    def _context_dir(self, namespace: str, context_id: str) -> Path:
        assert self.root is not None
        return self.root / namespace / context_id

    def _write_record(self, namespace: str, record: ContextRecord) -> None:
        if self.root is not None:
            directory = self._context_dir(namespace, record["id"])
            (directory / "chunks").mkdir(parents=True, exist_ok=True)
            _write_atomically(directory / RECORD, json.dumps(record).encode())
        self._records[(namespace, record["id"])] = record

    # -- contexts ---------------------------------------------------------------------------

    def ping(self) -> None:
        if self.root is not None and not os.access(self.root, os.W_OK):
            raise StoreUnavailable(f"the data directory {self.root} is not writable")

    def create(self, namespace: str, info: dict[str, Any]) -> ContextRecord:
        record = new_record(info)
        with self._lock:
            self._write_record(namespace, record)
        return record

    def list(self, namespace: str) -> list[ContextRecord]:
        with self._lock:
            records = [r for (ns, _), r in self._records.items() if ns == namespace]
        return sorted(records, key=lambda record: record["created_at"])

    def get(self, namespace: str, context_id: str) -> ContextRecord:
        with self._lock:
            record = self._records.get((namespace, context_id))
        if record is None:
            raise NotFound("context", context_id)
        return record

    def delete(self, namespace: str, context_id: str) -> None:
        with self._lock:
            if self._records.pop((namespace, context_id), None) is None:
                raise NotFound("context", context_id)
            for key in [k for k in self._chunks if k[:2] == (namespace, context_id)]:
                del self._chunks[key]
            for table in (self._uploads, self._blobs):
                for key in [k for k in table if k[:2] == (namespace, context_id)]:
                    del table[key]
            if self.root is not None:
                directory = self._context_dir(namespace, context_id)
                doomed = directory.with_name(f".deleted-{new_id()}")
                directory.rename(doomed)  # atomic: the context is gone from here on
                shutil.rmtree(doomed, ignore_errors=True)

    # -- uploads ----------------------------------------------------------------------------

    def begin_upload(self, namespace: str, context_id: str) -> str:
        self.get(namespace, context_id)
        upload_id = new_id()
        with self._lock:
            self._uploads[(namespace, context_id, upload_id)] = []
        return upload_id

    def upload(self, namespace: str, context_id: str, upload_id: str) -> list[Segment]:
        with self._lock:
            chunks = self._uploads.get((namespace, context_id, upload_id))
        if chunks is None:
            raise NotFound("upload", upload_id)
        return list(chunks)

    def add_chunk(
        self, namespace: str, context_id: str, upload_id: str, data: bytes, tokens: int
    ) -> list[Segment]:
        self.upload(namespace, context_id, upload_id)
        chunk = new_id()
        if self.root is not None:
            path = self._context_dir(namespace, context_id) / "chunks" / f"{chunk}.bin"
            _write_atomically(path, data)
        with self._lock:
            chunks = self._uploads.get((namespace, context_id, upload_id))
            if chunks is None:
                raise NotFound("upload", upload_id)
            if self.root is None:
                self._chunks[(namespace, context_id, chunk)] = data
            chunks.append({"chunk": chunk, "tokens": tokens, "bytes": len(data)})
            return list(chunks)

    def commit(
        self, namespace: str, context_id: str, upload_id: str, max_tokens: int
    ) -> ContextRecord:
        with self._lock:
            record = self._records.get((namespace, context_id))
            if record is None:
                raise NotFound("context", context_id)
            chunks = self._uploads.get((namespace, context_id, upload_id))
            if chunks is None:
                raise NotFound("upload", upload_id)
            updated = committed(record, chunks, max_tokens)
            self._write_record(namespace, updated)
            del self._uploads[(namespace, context_id, upload_id)]
        return updated

    def abort(self, namespace: str, context_id: str, upload_id: str) -> None:
        with self._lock:
            chunks = self._uploads.pop((namespace, context_id, upload_id), None)
            if chunks is None:
                raise NotFound("upload", upload_id)
            for chunk in chunks:
                self._chunks.pop((namespace, context_id, chunk["chunk"]), None)
                if self.root is not None:
                    path = self._context_dir(namespace, context_id) / "chunks"
                    (path / f"{chunk['chunk']}.bin").unlink(missing_ok=True)

    def read_chunk(self, namespace: str, context_id: str, segment: Segment) -> bytes:
        if self.root is None:
            with self._lock:
                data = self._chunks.get((namespace, context_id, segment["chunk"]))
            if data is None:
                raise NotFound("context", context_id)
            return data
        path = self._context_dir(namespace, context_id) / "chunks" / f"{segment['chunk']}.bin"
        try:
            return path.read_bytes()
        except FileNotFoundError:
            raise NotFound("context", context_id) from None

    # -- blobs ------------------------------------------------------------------------------

    def put_blob(self, namespace: str, context_id: str, name: str, data: bytes) -> None:
        """Keep `data` with the context (deleted with it)."""
        self.get(namespace, context_id)
        if self.root is None:
            with self._lock:
                self._blobs[(namespace, context_id, name)] = data
            return
        _write_atomically(self._context_dir(namespace, context_id) / "blobs" / name, data)

    def get_blob(self, namespace: str, context_id: str, name: str) -> bytes | None:
        if self.root is None:
            with self._lock:
                return self._blobs.get((namespace, context_id, name))
        path = self._context_dir(namespace, context_id) / "blobs" / name
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None


def _write_atomically(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file, fsync and rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{new_id()}.tmp")
    with open(temporary, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
