"""Service settings, read from the environment (prefix `REWA_`); the settings table of
docs/service.md lists them all."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from rewa.index.audit import AUDIT_TARGET, AUDIT_WINDOW
from rewa.index.growth import EXACT_WHILE_BUILDING, OPEN_SEGMENT

MIB = 1 << 20


class Settings(BaseSettings):
    """Every knob of `rewa serve`. Defaults are the embedded single-process set-up."""

    model_config = SettingsConfigDict(env_prefix="REWA_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    # Stores: embedded (in memory; persisted under data_dir when set) or Redis.
    data_dir: Path | None = None
    redis_url: str | None = None
    redis_prefix: str = "rewa"
    redis_cluster: bool = Field(False, description="REWA_REDIS_URL is a Redis Cluster node")
    redis_piece_bytes: int = Field(8 * MIB, ge=1024, description="largest Redis value written")
    upload_ttl_s: int = Field(24 * 3600, ge=1, description="uncommitted uploads expire")
    # Auth: comma-separated Bearer keys; empty means open (one shared namespace).
    api_keys: str = ""
    # Compute.
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    cache_bytes: int = Field(8 * 1024 * MIB, ge=0, description="LRU budget of loaded contexts")
    store_indexes: bool = (
        True  # keep built indexes (clusters, FAISS, LSH) in the store for replicas
    )
    build_on_commit: bool = Field(
        True, description="a commit builds (or extends) the new version's index in the background"
    )
    open_segment: int = Field(
        OPEN_SEGMENT,
        ge=0,
        description="tokens of a context's last segment read exactly before they are indexed; "
        "0: index every token",
    )
    exact_while_building: int = Field(
        EXACT_WHILE_BUILDING,
        ge=0,
        description="query-key pairs an attend reads exactly rather than wait for its index's "
        "build; 0: always wait",
    )
    probed_pieces: bool = Field(
        True,
        description="tail indexes: a head's pieces halved where its own keys, asked as queries, "
        "show the estimate missing and halving mending it",
    )
    audit_every: int = Field(
        0,
        ge=0,
        description="one query row in that many of a non-causal tail or topk attend also "
        "answered exactly, its error kept per head; a tail head whose 99th percentile passes "
        "REWA_AUDIT_TARGET gets pieces of half the size; 0: no audit",
    )
    audit_window: int = Field(
        AUDIT_WINDOW, ge=1, description="the latest audited errors kept per head and judged"
    )
    audit_target: float = Field(
        AUDIT_TARGET, gt=0, description="the audited 99th percentile a tail head stays within"
    )
    sparse_threads: int = Field(
        1,
        ge=0,
        description="CPU threads of one tail or topk attention call (a decode step's "
        "compiled tail attention, at most 8 queries per head, takes torch's default); 0: "
        "torch's default",
    )
    batching: bool = True
    batch_max_queries: int = Field(4096, ge=1, description="queries merged into one call")
    batch_max_wait_ms: float = Field(2.0, ge=0)
    queue_size: int = Field(256, ge=1, description="requests queued or running; then 429")
    max_queue_wait_s: float = Field(
        5.0, gt=0, description="a request not started on the device by then gets 429"
    )
    # Limits.
    max_body_bytes: int = Field(256 * MIB, ge=1024)
    max_tokens_per_context: int = Field(1 << 21, ge=1)
    max_queries_per_request: int = Field(65536, ge=1, description="heads x queries")
    max_k: int = Field(2048, ge=1, le=2048)
    max_stateless_tokens: int = Field(16384, ge=1, description="keys of a stateless request")
    max_self_attention_rows: int = Field(8192, ge=1, description="query rows per request")
    drain_timeout_s: float = Field(30.0, ge=0)
    # Connections.
    keep_alive_s: int = Field(5, ge=1, description="idle keep-alive connections are closed")
    header_timeout_s: float = Field(
        10.0, gt=0, description="a connection without a complete request head is closed"
    )
    body_timeout_s: float = Field(
        120.0, gt=0, description="a request body not received in full by then gets 408"
    )
    body_idle_timeout_s: float = Field(
        10.0, gt=0, description="a request body that stalls this long gets 408"
    )

    def api_key_list(self) -> list[str]:
        return [key.strip() for key in self.api_keys.split(",") if key.strip()]
