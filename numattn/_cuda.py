"""Numba CUDA set-up that every numattn module relies on, and where host arrays run.

Imported before anything else in the package:

* On a machine without a usable NVIDIA GPU (and with ``NUMBA_ENABLE_CUDASIM``
  unset), numba's CUDA simulator is selected, so that the GPU kernels can run on
  the CPU. The choice is made before ``numba.cuda`` is first imported; if the
  caller imported ``numba.cuda`` already, its mode is kept.
* Host arrays on a machine without a GPU run on the CPU path (numba's CPU JIT,
  ``kernels/cpu.py``), unless ``NUMATTN_SIMULATE=1`` is set or the call runs
  inside ``numattn.simulate()``: then the GPU kernels run in the simulator, one
  thread per CUDA thread, which checks their logic (the tests) but is slow.
* numba-cuda 0.30 registers an overload for ``np.row_stack``, which numpy 2.5
  removed; the name is restored as a thin wrapper of ``np.vstack``.
* numba-cuda 0.30's simulator makes static shared arrays without a lock; numattn
  makes them under one (``_shared_array``). Its ``cuda.jit`` is given the GPU
  compiler's ``forceinline`` option, which it ignores.
"""

import contextlib
import contextvars
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
"""True when ``numba.cuda`` is numba's CUDA simulator (no GPU found, or ``NUMBA_ENABLE_CUDASIM=1``)."""

if SIMULATOR:
    import threading

    from numba import types as _types
    from numba.cuda.simulator.kernelapi import FakeCUDAShared
    from numba.np.numpy_support import as_dtype as _as_dtype

    _SHARED_ALLOCATION = threading.Lock()
    _allocate_shared = FakeCUDAShared.array

    def _shared_array(self, shape, dtype, alignment=None):
        """The simulator's ``cuda.shared.array``, its static arrays made under a lock: numba-cuda 0.30 makes
        the array of a call site when the first thread reaches it, unlocked, so that two threads switched
        between its check and its store each got an array of their own (seen as garbage in the others')."""
        if shape == 0 or alignment is not None:  # dynamic shared memory: one buffer, no per-site state
            return _allocate_shared(self, shape, dtype, alignment)
        caller = sys._getframe(1)
        site = (caller.f_code.co_filename, caller.f_lineno)
        with _SHARED_ALLOCATION:
            array = self._allocations.get(site)
            if array is None:
                array = self._allocations[site] = np.empty(shape, _as_dtype(dtype) if isinstance(dtype, _types.Type)
                                                           else dtype)
        return array

    FakeCUDAShared.array = _shared_array

    _simulator_jit = cuda.jit

    def _jit(*args, forceinline=False, **options):
        """The simulator's ``cuda.jit``, also taking the GPU compiler's ``forceinline`` (LLVM inlining, which
        numattn's device functions ask for and a simulated call has no use for)."""
        return _simulator_jit(*args, **options)

    cuda.jit = _jit

_SIMULATING = contextvars.ContextVar(
    "numattn_simulating", default=SIMULATOR and os.environ.get("NUMATTN_SIMULATE", "") not in ("", "0"))


def simulating():
    """Whether host arrays run the GPU kernels in numba's CUDA simulator (rather than the CPU path)."""
    return _SIMULATING.get()


@contextlib.contextmanager
def simulate(enabled=True):
    """Within this context (in this thread), host arrays run numattn's GPU kernels in numba's CUDA
    simulator instead of the CPU path: slow, for checking the kernels' logic on a machine without a
    GPU. ``NUMATTN_SIMULATE=1`` in the environment makes it the default there. ``simulate(False)``
    selects the CPU path. RuntimeError where numba runs on a GPU (numba chooses the simulator when it
    loads: ``NUMBA_ENABLE_CUDASIM=1``).

    Examples
    --------
    >>> import numpy as np, numattn
    >>> q = np.random.default_rng(0).standard_normal((1, 2, 8, 16), dtype=np.float32)
    >>> with numattn.simulate():
    ...     numattn.attention(q, q, q).shape
    (1, 2, 8, 16)
    """
    if enabled and not SIMULATOR:
        raise RuntimeError("numba runs on a GPU in this process; set NUMBA_ENABLE_CUDASIM=1 before importing "
                           "numattn to run its kernels in the simulator")
    token = _SIMULATING.set(bool(enabled) and SIMULATOR)
    try:
        yield
    finally:
        _SIMULATING.reset(token)


__all__ = ["cuda", "SIMULATOR", "simulate", "simulating"]
