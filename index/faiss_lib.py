"""The FAISS module rewa.index uses (a CPU or GPU build), or a clear error when rewa was
installed without one."""

try:
    import faiss
    from faiss.contrib.ivf_tools import add_preassigned
except ImportError as error:  # rewa installed without its cpu or gpu extra
    raise ImportError(
        "rewa.index needs a FAISS build: pip install 'rewa[cpu]' (faiss-cpu) or 'rewa[gpu]' "
        "(faiss-gpu-cu12)"
    ) from error

__all__ = ["add_preassigned", "faiss"]
