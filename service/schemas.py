"""Request and response bodies of the HTTP API (pydantic). Tensors travel as
`wire.TensorPayload`; shapes are checked against the context in the routes."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from rewa.attention import GEOMETRIES

from .wire import TensorPayload, integer

Mode = Literal["exact", "topk", "tail"]
IndexKind = Literal["ivf", "hnsw", "flat", "lsh"]
ContextDtype = Literal["float32", "float16", "bfloat16"]
# How many keys a query attends or ids it gets is `top_k`, as in the library (where `k` is the
# keys); `k`, its name in 0.1, is still read, and records stored with it still load.
TOP_K_ALIASES = AliasChoices("top_k", "k")


class Strict(BaseModel):
    """A request body: unknown fields are refused, and values are not coerced (`false` is not
    an integer, `"5"` is not a number; `Integer` fields take 23.0 as JSON Schema does)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class ErrorDetail(BaseModel):
    type: str = Field(description="machine-readable kind, e.g. invalid_request, overloaded")
    message: str = Field(description="what was expected and what arrived")
    param: str | None = Field(description="the offending field as a dotted path, or null")


class ErrorBody(BaseModel):
    """The body of every error response."""

    error: ErrorDetail


class GeometrySpec(BaseModel):
    """A geometry of `rewa.attention` by name with its options, e.g.
    `{"name": "kappa", "kappa": -1.0}` (`rewa.attention.make_geometry`); an unknown name or
    option is a 400 naming it."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(json_schema_extra={"enum": sorted(GEOMETRIES)})

    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class IndexSpec(Strict):
    """How the context is searched in `topk` mode, and the defaults of every sparse mode."""

    kind: IndexKind = "ivf"
    top_k: integer(ge=1, le=2048) = Field(
        64, validation_alias=TOP_K_ALIASES, description="keys attended per query in topk mode"
    )
    window: integer(ge=0) = Field(0, description="last keys always read (tail and topk)")
    sinks: integer(ge=0) = Field(0, description="first keys always read (tail and topk)")
    budget: float = Field(0.02, gt=0, le=1, description="fraction of keys read in tail mode")
    options: dict[str, Any] = Field(
        default_factory=dict, description="IndexSettings fields (FAISS) or CompositeLSH arguments"
    )


Layer = Annotated[
    integer(ge=0) | None,
    Field(description="the layer queried, for a multi-layer context (required there)"),
]


class ContextCreate(Strict):
    name: str | None = Field(None, max_length=200)
    geometry: GeometrySpec
    heads: integer(ge=1, le=256) = Field(description="heads per layer")
    layers: integer(ge=1, le=256) = Field(
        1,
        description="layers of one sequence held together (a multi-layer document): tokens "
        "carry layers x heads heads, layer 0's first; every query names its layer",
    )
    head_dim: integer(ge=1, le=4096)
    value_dim: integer(ge=1, le=4096) | None = Field(None, description="default: head_dim")
    dtype: ContextDtype = "float32"
    index: IndexSpec = Field(default_factory=IndexSpec)


class ContextInfo(BaseModel):
    id: str
    name: str | None
    geometry: dict[str, Any]
    heads: int
    layers: int = 1
    head_dim: int
    value_dim: int
    dtype: ContextDtype
    index: IndexSpec
    n_tokens: int
    version: int
    created_at: float
    updated_at: float


IndexMode = Literal["tail", "topk"]


class AuditedHead(BaseModel):
    """One stored head's audit on this replica (`REWA_AUDIT_EVERY`; docs/service.md, "The
    audit"): `audited`, the errors kept (at most `REWA_AUDIT_WINDOW`), their median and 99th
    percentile (None while none is kept), each the relative output error `||out - exact|| /
    ||exact||` of one audited query's answer; `settled`, whether the audit halved its pieces
    and that did not mend it, so that it is not cut again; and `max_keys`, the most keys of the
    pieces of the cached version's tail clusters (None when they are not built)."""

    audited: int
    err_median: float | None = None
    err_p99: float | None = None
    settled: bool = False
    max_keys: int | None = None


class IndexState(BaseModel):
    """What this replica holds of a context's latest version: whether it is loaded on the
    device, which modes have their index built (`tail`: the clusters; `topk`: the search
    index of the context's kind, which `/search` and `return_topk` use too) and which are being
    built. A mode that is neither starts its build at its first attend; until a build is done,
    attends read the keys no built index covers exactly (docs/indexes.md, "Builds in the
    background"). `seconds`: the time this request waited for the builds. `sealed_tokens`: the
    leading tokens the indexes hold once built (every full segment of `REWA_OPEN_SEGMENT`
    tokens); the others are read exactly by every query. `audit`: per stored head (a
    document's layer 0 first), what this replica's audit measured; None when it is off."""

    context_id: str
    version: int
    loaded: bool
    built: list[IndexMode]
    building: list[IndexMode] = []
    sealed_tokens: int | None = None
    seconds: float | None = None
    audit: list[AuditedHead] | None = None


class IndexBuildRequest(Strict):
    """Which modes' indexes to build; by default the context's default mode (tail, or topk for
    a geometry without an exact lift)."""

    modes: list[IndexMode] | None = Field(None, min_length=1, max_length=2)


class ContextList(BaseModel):
    contexts: list[ContextInfo]


class UploadInfo(BaseModel):
    upload_id: str
    context_id: str
    chunks: int
    n_tokens: int


class ChunkBody(Strict):
    """One chunk of an upload: keys `(heads, n, head_dim)` and values `(heads, n, value_dim)`
    in the context's dtype."""

    keys: TensorPayload
    values: TensorPayload


class AttendOptions(Strict):
    """An attend request without its queries: the `options` metadata of a safetensors body."""

    layer: Layer = None
    mode: Mode | None = Field(None, description="default: tail")
    exact: bool = Field(False, description="shorthand for mode=exact")
    top_k: integer(ge=1) | None = Field(
        None, validation_alias=TOP_K_ALIASES, description="topk mode: keys attended (<= max_k)"
    )
    budget: float | None = Field(None, gt=0, le=1, description="tail mode: fraction read")
    window: integer(ge=0) | None = None
    sinks: integer(ge=0) | None = None
    measured_queries: integer(ge=0) | None = Field(
        None,
        description="tail mode: queries per head answered exactly, fitting how far the others "
        "move toward the estimate (docs/indexes.md, 'Measured shrinkage of the tail')",
    )
    return_topk: integer(ge=1) | None = Field(
        None, description="also return each query's best ids and attention weights"
    )


class AttendRequest(AttendOptions):
    queries: TensorPayload = Field(description="(heads, n_queries, head_dim)")


class AttendResponse(BaseModel):
    out: TensorPayload
    lse: TensorPayload
    mode: Mode
    version: int
    ids: TensorPayload | None = None
    weights: TensorPayload | None = None


class SearchRequest(Strict):
    queries: TensorPayload
    top_k: integer(ge=1) = Field(10, validation_alias=TOP_K_ALIASES, description="ids per query")
    exact: bool = Field(False, description="exact top-K instead of the context's index")
    layer: Layer = None


class SearchResponse(BaseModel):
    ids: TensorPayload
    scores: TensorPayload = Field(description="attention logits, higher is closer")
    distances: TensorPayload | None = Field(None, description="distance geometries only")
    version: int


class SelfAttentionRequest(Strict):
    """Rows `[start, start + n)` of the stored context attend over its keys. `queries`
    `(heads, n, head_dim)` are those rows' query vectors; without them the stored keys of the
    rows are the queries (shared query-key attention). `causal`: row i sees keys `<= i`."""

    queries: TensorPayload | None = None
    start: integer(ge=0) = 0
    end: integer(ge=1) | None = Field(None, description="without queries; default: the end")
    causal: bool = False
    mode: Mode | None = Field(None, description="default: tail, or topk when causal")
    exact: bool = False
    top_k: integer(ge=1) | None = Field(None, validation_alias=TOP_K_ALIASES)
    budget: float | None = Field(None, gt=0, le=1)
    window: integer(ge=0) | None = None
    sinks: integer(ge=0) | None = None
    measured_queries: integer(ge=0) | None = Field(
        None,
        description="tail mode: queries per head answered exactly, fitting how far the others "
        "move toward the estimate (docs/indexes.md, 'Measured shrinkage of the tail')",
    )
    layer: Layer = None


class SelfAttentionResponse(BaseModel):
    out: TensorPayload
    lse: TensorPayload
    mode: Mode
    version: int
    start: int
    end: int


class StatelessAttendRequest(Strict):
    geometry: GeometrySpec
    q: TensorPayload = Field(description="(heads, n_queries, d)")
    k: TensorPayload = Field(description="(heads, n_keys, d)")
    v: TensorPayload = Field(description="(heads, n_keys, dv)")
    causal: bool = False


class StatelessAttendResponse(BaseModel):
    out: TensorPayload
    lse: TensorPayload
