"""rewa.index: candidate indexes over the exact lifts of rewa.attention geometries (composite
LSH, FAISS). Built by the issue "Candidate indexes and sparse O(N K d) attention"."""
