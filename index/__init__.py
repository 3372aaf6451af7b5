"""rewa.index: candidate indexes over the exact lifts of rewa.attention geometries (composite LSH,
FAISS flat / IVF / HNSW), candidate sets, retrieval attention and its quality measures."""

from .candidates import CandidateSet, build_candidates, query_positions, window_candidates
from .faiss_index import GeometryIndex, IndexSettings, LiftIndex, faiss_device
from .lsh import BoundaryProjectionHash, CompositeLSH, GridHash, SimHash
from .measures import (
    dense_entropy,
    exact_topk,
    mass_recall,
    output_error,
    summary,
    topk_recall,
)
from .retrieval import build_index, retrieval_attention, retrieval_candidates

__all__ = [
    "BoundaryProjectionHash",
    "CandidateSet",
    "CompositeLSH",
    "GeometryIndex",
    "GridHash",
    "IndexSettings",
    "LiftIndex",
    "SimHash",
    "build_candidates",
    "build_index",
    "dense_entropy",
    "exact_topk",
    "faiss_device",
    "mass_recall",
    "output_error",
    "query_positions",
    "retrieval_attention",
    "retrieval_candidates",
    "summary",
    "topk_recall",
    "window_candidates",
]
