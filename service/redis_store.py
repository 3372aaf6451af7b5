"""The Redis store (`REWA_REDIS_URL`): contexts shared by every replica.

Keys, for prefix P, namespace N and context C (the hash tag `{N:C}` keeps one context's keys in
one Redis Cluster slot, so its transactions stay single-slot):

- `P:N:ids`: the set of N's context ids;
- `P:{N:C}:record`: the committed record (JSON);
- `P:{N:C}:chunk:<chunk>:<i>`: piece i of a chunk, at most `piece_bytes` (far below Redis's
  512 MB value limit);
- `P:{N:C}:upload:<upload>`: an open upload's chunk list (JSON);
- `P:{N:C}:blob:<name>:<i>` and `P:{N:C}:blobs` (name -> piece count): built indexes.

With `cluster=True` the URL names any node of a Redis Cluster (a cluster-aware client routes
each key to its slot's node): every transaction touches one context's keys (one slot), and
the one read across contexts (`list`) goes key by key.

An upload writes its pieces with a time-to-live (`upload_ttl_s`), so an upload that is never
committed (the client gave up, the server was killed) disappears by itself. A commit is one
MULTI/EXEC under WATCH of the record and the upload: it writes the new record (version + 1,
segments appended), persists the upload's pieces and deletes the upload, all or nothing. A
delete removes the record and gives every piece a short time-to-live, so a reader that already
holds the old record can finish reading it."""

from __future__ import annotations

import functools
import json
from typing import Any

import redis
from redis.exceptions import ClusterDownError

from .store import (
    ContextRecord,
    NotFound,
    Segment,
    StoreUnavailable,
    committed,
    new_id,
    new_record,
)

DELETED_PIECE_TTL_S = 60


def _unavailable_on_connection_errors(method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError, ClusterDownError) as error:
            raise StoreUnavailable(f"Redis is unavailable: {error}") from None

    return wrapper


class RedisStore:
    def __init__(
        self,
        url: str,
        *,
        prefix: str = "rewa",
        piece_bytes: int = 8 << 20,
        upload_ttl_s: int = 24 * 3600,
        cluster: bool = False,
    ) -> None:
        client_class = redis.RedisCluster if cluster else redis.Redis
        self.client = client_class.from_url(
            url, socket_timeout=10, socket_connect_timeout=2, retry_on_timeout=False
        )
        self.prefix = prefix
        self.piece_bytes = piece_bytes
        self.upload_ttl_s = upload_ttl_s

    # -- key names --------------------------------------------------------------------------

    def _ids(self, namespace: str) -> str:
        return f"{self.prefix}:{namespace}:ids"

    def _key(self, namespace: str, context_id: str, *parts: str) -> str:
        return ":".join([f"{self.prefix}:{{{namespace}:{context_id}}}", *parts])

    def _pieces(self, namespace: str, context_id: str, kind: str, name: str, count: int):
        return [self._key(namespace, context_id, kind, name, str(i)) for i in range(count)]

    def _split(self, data: bytes) -> list[bytes]:
        step = self.piece_bytes
        return [data[i : i + step] for i in range(0, len(data), step)] or [b""]

    # -- contexts ---------------------------------------------------------------------------

    @_unavailable_on_connection_errors
    def ping(self) -> None:
        self.client.ping()

    @_unavailable_on_connection_errors
    def create(self, namespace: str, info: dict[str, Any]) -> ContextRecord:
        record = new_record(info)
        self.client.set(self._key(namespace, record["id"], "record"), json.dumps(record))
        self.client.sadd(self._ids(namespace), record["id"])
        return record

    @_unavailable_on_connection_errors
    def list(self, namespace: str) -> list[ContextRecord]:
        ids = sorted(member.decode() for member in self.client.smembers(self._ids(namespace)))
        if not ids:
            return []
        # One GET per context, not MGET: the records live in different cluster slots.
        with self.client.pipeline(transaction=False) as pipe:
            for context_id in ids:
                pipe.get(self._key(namespace, context_id, "record"))
            raws = pipe.execute()
        records = [json.loads(raw) for raw in raws if raw is not None]
        return sorted(records, key=lambda record: record["created_at"])

    @_unavailable_on_connection_errors
    def get(self, namespace: str, context_id: str) -> ContextRecord:
        raw = self.client.get(self._key(namespace, context_id, "record"))
        if raw is None:
            raise NotFound("context", context_id)
        return json.loads(raw)

    @_unavailable_on_connection_errors
    def delete(self, namespace: str, context_id: str) -> None:
        record_key = self._key(namespace, context_id, "record")
        blobs_key = self._key(namespace, context_id, "blobs")
        with self.client.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(record_key, blobs_key)
                    raw = pipe.get(record_key)
                    if raw is None:
                        raise NotFound("context", context_id)
                    record = json.loads(raw)
                    blobs = pipe.hgetall(blobs_key)
                    pipe.multi()
                    pipe.delete(record_key, blobs_key)
                    for segment in record["segments"]:
                        keys = self._pieces(
                            namespace, context_id, "chunk", segment["chunk"], segment["pieces"]
                        )
                        for key in keys:
                            pipe.expire(key, DELETED_PIECE_TTL_S)
                    for name, count in blobs.items():
                        for key in self._pieces(
                            namespace, context_id, "blob", name.decode(), int(count)
                        ):
                            pipe.expire(key, DELETED_PIECE_TTL_S)
                    pipe.execute()
                    break
                except redis.WatchError:
                    continue
        self.client.srem(self._ids(namespace), context_id)

    # -- uploads ----------------------------------------------------------------------------

    @_unavailable_on_connection_errors
    def begin_upload(self, namespace: str, context_id: str) -> str:
        self.get(namespace, context_id)
        upload_id = new_id()
        key = self._key(namespace, context_id, "upload", upload_id)
        self.client.set(key, "[]", ex=self.upload_ttl_s)
        return upload_id

    @_unavailable_on_connection_errors
    def upload(self, namespace: str, context_id: str, upload_id: str) -> list[Segment]:
        raw = self.client.get(self._key(namespace, context_id, "upload", upload_id))
        if raw is None:
            raise NotFound("upload", upload_id)
        return json.loads(raw)

    @_unavailable_on_connection_errors
    def add_chunk(
        self, namespace: str, context_id: str, upload_id: str, data: bytes, tokens: int
    ) -> list[Segment]:
        self.upload(namespace, context_id, upload_id)
        chunk = new_id()
        pieces = self._split(data)
        with self.client.pipeline(transaction=False) as pipe:
            for key, piece in zip(
                self._pieces(namespace, context_id, "chunk", chunk, len(pieces)),
                pieces,
                strict=True,
            ):
                pipe.set(key, piece, ex=self.upload_ttl_s)
            pipe.execute()
        entry = {"chunk": chunk, "tokens": tokens, "bytes": len(data), "pieces": len(pieces)}
        upload_key = self._key(namespace, context_id, "upload", upload_id)
        with self.client.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(upload_key)
                    raw = pipe.get(upload_key)
                    if raw is None:
                        raise NotFound("upload", upload_id)
                    chunks = [*json.loads(raw), entry]
                    pipe.multi()
                    pipe.set(upload_key, json.dumps(chunks), keepttl=True)
                    pipe.execute()
                    return chunks
                except redis.WatchError:
                    continue

    @_unavailable_on_connection_errors
    def commit(
        self, namespace: str, context_id: str, upload_id: str, max_tokens: int
    ) -> ContextRecord:
        record_key = self._key(namespace, context_id, "record")
        upload_key = self._key(namespace, context_id, "upload", upload_id)
        with self.client.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(record_key, upload_key)
                    raw_record, raw_upload = pipe.get(record_key), pipe.get(upload_key)
                    if raw_record is None:
                        raise NotFound("context", context_id)
                    if raw_upload is None:
                        raise NotFound("upload", upload_id)
                    chunks = json.loads(raw_upload)
                    record = committed(json.loads(raw_record), chunks, max_tokens)
                    pipe.multi()
                    pipe.set(record_key, json.dumps(record))
                    for chunk in chunks:
                        for key in self._pieces(
                            namespace, context_id, "chunk", chunk["chunk"], chunk["pieces"]
                        ):
                            pipe.persist(key)
                    pipe.delete(upload_key)
                    pipe.execute()
                    return record
                except redis.WatchError:
                    continue

    @_unavailable_on_connection_errors
    def abort(self, namespace: str, context_id: str, upload_id: str) -> None:
        chunks = self.upload(namespace, context_id, upload_id)
        keys = [self._key(namespace, context_id, "upload", upload_id)]
        for chunk in chunks:
            keys += self._pieces(namespace, context_id, "chunk", chunk["chunk"], chunk["pieces"])
        self.client.delete(*keys)

    @_unavailable_on_connection_errors
    def read_chunk(self, namespace: str, context_id: str, segment: Segment) -> bytes:
        keys = self._pieces(namespace, context_id, "chunk", segment["chunk"], segment["pieces"])
        pieces = self.client.mget(keys)
        if any(piece is None for piece in pieces):
            raise NotFound("context", context_id)  # deleted while being read
        return b"".join(pieces)

    # -- blobs ------------------------------------------------------------------------------

    @_unavailable_on_connection_errors
    def put_blob(self, namespace: str, context_id: str, name: str, data: bytes) -> None:
        self.get(namespace, context_id)
        pieces = self._split(data)
        with self.client.pipeline(transaction=False) as pipe:
            for key, piece in zip(
                self._pieces(namespace, context_id, "blob", name, len(pieces)), pieces, strict=True
            ):
                pipe.set(key, piece)
            pipe.execute()
        # The piece count is written last: a reader never sees a partly written blob.
        self.client.hset(self._key(namespace, context_id, "blobs"), name, len(pieces))

    @_unavailable_on_connection_errors
    def get_blob(self, namespace: str, context_id: str, name: str) -> bytes | None:
        count = self.client.hget(self._key(namespace, context_id, "blobs"), name)
        if count is None:
            return None
        pieces = self.client.mget(self._pieces(namespace, context_id, "blob", name, int(count)))
        if any(piece is None for piece in pieces):
            return None
        return b"".join(pieces)
