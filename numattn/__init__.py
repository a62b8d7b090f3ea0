"""numattn: attention kernels in pure Python with Numba CUDA."""

from . import _cuda  # noqa: F401  (first: picks GPU or simulator before numba.cuda loads)
from . import reference
from ._cuda import SIMULATOR
from .ops.attention import attention

__version__ = "0.1.0"

__all__ = ["attention", "reference", "SIMULATOR", "__version__"]
