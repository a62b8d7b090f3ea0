"""numattn: attention kernels in pure Python with Numba CUDA."""

from . import (
    _cuda,  # noqa: F401  (first: picks GPU or simulator before numba.cuda loads)
    reference,
)
from ._cuda import SIMULATOR, simulate
from ._version import __version__
from .ops.attention import attention
from .ops.decode import DecodePlan, decode, decode_plan, paged_decode, paged_decode_plan
from .ops.merge import merge_states
from .ops.mla import mla_decode
from .ops.pages import csr_page_table
from .ops.varlen import attention_varlen
from .precompile import Workload, precompile
from .search import bfloat16, float16, float32, new_kernel_graph, superoptimize
from .search.functional import tune

__all__ = [
    "attention", "attention_varlen", "decode", "paged_decode", "decode_plan", "paged_decode_plan", "DecodePlan", "mla_decode", "merge_states", "csr_page_table", "reference", "SIMULATOR", "simulate", "__version__",
    "new_kernel_graph", "superoptimize", "float16", "bfloat16", "float32", "tune", "precompile", "Workload",
]


def __getattr__(name):
    """``numattn.torch`` on first access (PEP 562), so that ``import numattn`` does not import torch."""
    if name != "torch":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        import torch  # noqa: F401
    except ImportError as e:
        raise ImportError("numattn.torch needs PyTorch: pip install torch (or pip install \"numattn[torch]\")") from e
    import importlib

    return importlib.import_module(".torch", __name__)
