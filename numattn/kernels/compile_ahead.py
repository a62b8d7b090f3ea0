"""Kernels compiled ahead of their first launch, in a worker process, into the kernel cache.

numba compiles one function at a time in a process (a global lock), so the kernels a call will need
later, such as a training step's backward, are handed to a worker process while the caller compiles
what it needs now. The worker stores each kernel in the cache (``kernel_cache.py``); when the caller
then asks for one, it finds it there, or waits on the entry's file lock while the worker finishes it.
Nothing depends on the worker: if it fails or is slow, the caller compiles the kernel itself.

Off in the simulator, with the kernel cache off, and with ``NUMATTN_COMPILE_AHEAD=0``. The worker
compiles for the caller's device's compute capability and needs no CUDA context: it takes no GPU memory.
"""

import os
import pickle
import subprocess
import sys
from typing import NamedTuple

from .._cuda import SIMULATOR
from . import kernel_cache
from .launch import compile_into_cache, compiling_for, device_limits, target

_WORKERS = []  # worker processes started by this process, reaped as they finish
_REQUESTED = set()  # keys of the kernels handed to a worker by this process


class KernelSpec(NamedTuple):
    """A kernel to compile: ``factory(*args)`` (a module-level kernel factory, such as
    ``attention_backward_wgmma.backward_wgmma_kernel``) gives its dispatcher, ``argtypes`` its numba
    argument types, ``label`` its name in ``cache info``."""

    factory: object
    args: tuple
    argtypes: tuple
    label: str


def enabled():
    """Whether kernels can be compiled ahead: a GPU, the kernel cache on, ``NUMATTN_COMPILE_AHEAD`` not 0."""
    return (not SIMULATOR and os.environ.get("NUMATTN_COMPILE_AHEAD", "1") != "0"
            and kernel_cache.cache_directory() is not None)


def compile_ahead(specs, device_id):
    """Start a worker process compiling the ``KernelSpec`` s that the kernel cache lacks for device
    ``device_id`` and that no earlier worker of this process was given; return it (a
    ``subprocess.Popen``), or None when nothing is to be done. While ``launch.targeting`` a GPU, compile
    them into the cache here and now."""
    if target() is not None:
        _compile_all(specs, target().cc)
        return None
    if not enabled():
        return None
    cc, directory = device_limits(device_id)["cc"], kernel_cache.cache_directory()
    missing = []
    for spec in specs:
        key = kernel_cache.kernel_key(spec.factory(*spec.args), spec.argtypes, cc)
        if key is not None and key not in _REQUESTED and not (directory / (key + kernel_cache.SUFFIX)).exists():
            _REQUESTED.add(key)
            missing.append(spec)
    _WORKERS[:] = [worker for worker in _WORKERS if worker.poll() is None]
    if not missing:
        return None
    worker = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    worker.stdin.write(pickle.dumps((cc, missing)))
    worker.stdin.close()
    _WORKERS.append(worker)
    return worker


def _compile_all(specs, cc):
    """Compile each ``KernelSpec`` for compute capability ``cc`` into the cache (where another process holds
    an entry's lock, wait for it and find the entry there)."""
    for spec in specs:
        compile_into_cache(spec.factory(*spec.args), spec.argtypes, spec.label, cc)


def _work(cc, specs):
    """The worker: ``specs`` (their factories pickled by name) compiled for ``cc`` without a CUDA context."""
    with compiling_for(cc):
        _compile_all(specs, cc)


if __name__ == "__main__":
    _work(*pickle.load(sys.stdin.buffer))
