"""rewa.llm: rewa as the attention memory of a language model. `RewaCache` and the `"rewa"`
attention implementation plug a memory (in process or over HTTP) into a Hugging Face
transformers model (docs/llm.md)."""

from .document import DocumentLayer, RemoteDocument
from .transformers_memory import (
    AttentionMemory,
    EncoderMemory,
    MemoryLayer,
    RewaCache,
    SequencesLayer,
    enable,
    local_memories,
    register,
    remote_memories,
)

__all__ = [
    "AttentionMemory",
    "DocumentLayer",
    "EncoderMemory",
    "MemoryLayer",
    "RemoteDocument",
    "RewaCache",
    "SequencesLayer",
    "enable",
    "local_memories",
    "register",
    "remote_memories",
]
