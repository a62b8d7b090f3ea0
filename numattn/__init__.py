"""numattn: attention kernels in pure Python with Numba CUDA."""

from . import _cuda  # noqa: F401  (first: picks GPU or simulator before numba.cuda loads)
from . import reference
from ._cuda import SIMULATOR
from .ops.attention import attention
from .ops.decode import DecodePlan, csr_page_table, decode, decode_plan, merge_states, paged_decode, paged_decode_plan
from .ops.mla import mla_decode
from .search import bfloat16, float16, float32, new_kernel_graph
from .search.functional import tune

__version__ = "0.1.0"

__all__ = [
    "attention", "decode", "paged_decode", "decode_plan", "paged_decode_plan", "DecodePlan", "mla_decode", "merge_states", "csr_page_table", "reference", "SIMULATOR", "__version__",
    "new_kernel_graph", "float16", "bfloat16", "float32", "tune",
]
