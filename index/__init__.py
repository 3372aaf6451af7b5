"""rewa.index: candidate indexes over the exact lifts of rewa.attention geometries (composite LSH,
FAISS flat / IVF / HNSW), clustered contexts and cluster-tail attention, candidate sets,
retrieval attention and its quality measures."""

from .bands import BandedIndex
from .candidates import CandidateSet, build_candidates, query_positions, window_candidates
from .causal import causal_tail_attention
from .clusters import ClusterHeads, KeyClusters
from .faiss_index import GeometryIndex, IndexSettings, LiftIndex, faiss_device
from .growth import OPEN_SEGMENT, appended, sealed_keys
from .lsh import BoundaryProjectionHash, CompositeLSH, GridHash, SimHash
from .measures import (
    dense_entropy,
    exact_topk,
    mass_recall,
    output_error,
    quality,
    summary,
    topk_recall,
)
from .memory import LocalMemory
from .protocol import KeyIndex
from .retrieval import (
    build_index,
    index_from_bytes,
    index_to_bytes,
    retrieval_attention,
    retrieval_candidates,
    window_and_sinks,
)
from .tail import (
    TailAttention,
    estimate_clusters,
    tail_attention,
    tail_attention_heads,
    tail_attention_heads_with_reads,
    tail_attention_with_reads,
)

__all__ = [
    "OPEN_SEGMENT",
    "BandedIndex",
    "BoundaryProjectionHash",
    "CandidateSet",
    "ClusterHeads",
    "CompositeLSH",
    "GeometryIndex",
    "GridHash",
    "IndexSettings",
    "KeyClusters",
    "KeyIndex",
    "LiftIndex",
    "LocalMemory",
    "SimHash",
    "TailAttention",
    "appended",
    "build_candidates",
    "build_index",
    "causal_tail_attention",
    "dense_entropy",
    "estimate_clusters",
    "exact_topk",
    "faiss_device",
    "index_from_bytes",
    "index_to_bytes",
    "mass_recall",
    "output_error",
    "quality",
    "query_positions",
    "retrieval_attention",
    "retrieval_candidates",
    "sealed_keys",
    "summary",
    "tail_attention",
    "tail_attention_heads",
    "tail_attention_heads_with_reads",
    "tail_attention_with_reads",
    "topk_recall",
    "window_and_sinks",
    "window_candidates",
]
