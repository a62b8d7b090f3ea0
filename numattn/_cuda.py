"""Numba CUDA set-up that every numattn module relies on.

Imported before anything else in the package:

* On a machine without a usable NVIDIA GPU (and with ``NUMBA_ENABLE_CUDASIM``
  unset), numba's CUDA simulator is selected, so the same kernels run on the
  CPU. The choice is made before ``numba.cuda`` is first imported; if the
  caller imported ``numba.cuda`` already, its mode is kept.
* numba-cuda 0.30 registers an overload for ``np.row_stack``, which numpy 2.5
  removed; the name is restored as a thin wrapper of ``np.vstack``.
"""

import ctypes
import os
import sys

import numpy as np


def _driver_sees_gpu():
    """True when the CUDA driver loads, initialises and reports a device."""
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        count = ctypes.c_int(0)
        if lib.cuInit(0) != 0:
            return False
        return lib.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0
    return False


if "numba.cuda" not in sys.modules and "NUMBA_ENABLE_CUDASIM" not in os.environ:
    if not _driver_sees_gpu():
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

if not hasattr(np, "row_stack"):

    def _row_stack(tup, *, dtype=None, casting="same_kind"):
        return np.vstack(tup, dtype=dtype, casting=casting)

    np.row_stack = _row_stack

from numba import cuda  # noqa: E402
from numba.cuda.core import config as _numba_config  # noqa: E402

SIMULATOR = bool(_numba_config.ENABLE_CUDASIM)
"""True when kernels run in numba's CUDA simulator on the CPU."""

__all__ = ["cuda", "SIMULATOR"]
