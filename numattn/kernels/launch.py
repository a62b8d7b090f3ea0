"""Compile-once, launch-cheaply machinery shared by every numattn kernel.

numba's dispatcher re-types and re-flattens its arguments on every launch,
which costs tens of microseconds of host time. Here a kernel is compiled once
per specialisation and device (and kept on disk for later processes,
``kernel_cache.py``), its argument block is built once per call
signature (``PreparedLaunch``), and each launch only writes the data pointers
that changed into that block before calling ``cuLaunchKernelEx``.

In numba's argument ABI an array becomes ``(meminfo, parent, nitems, itemsize,
data, *shape, *strides_in_bytes)``, each field 8 bytes wide; scalars keep
their own width. In the simulator, ``SimulatedKernel`` launches the numba
dispatcher on numpy arrays instead.
"""

import contextlib
import ctypes
import functools
import gc
import struct
import sys
import threading
import time
from types import FunctionType, SimpleNamespace
from typing import NamedTuple

import numpy as np

from .._cuda import SIMULATOR, cuda
from . import kernel_cache

if not SIMULATOR:
    from cuda.bindings import driver as _driver

    _INVALID_CONTEXT = int(_driver.CUresult.CUDA_ERROR_INVALID_CONTEXT)

_DEFAULT_SHARED_LIMIT = 48 * 1024


def driver_call(result):
    """The values a cuda-bindings driver call returned after its status; RuntimeError naming a failed status."""
    err = result[0]
    if err != _driver.CUresult.CUDA_SUCCESS:
        name = _driver.cuGetErrorName(err)[1]
        raise RuntimeError(f"CUDA driver call failed: {name.decode() if name else err}")
    return result[1:]


class Gpu(NamedTuple):
    """What planning and compiling need of a GPU model: ``device_limits``'s entries."""

    name: str
    cc: tuple
    sms: int
    max_shared: int  # bytes of shared memory a block may opt into
    dram_gbs: float


GPUS = {
    "h100": Gpu("NVIDIA H100 80GB HBM3", (9, 0), 132, 232448, 3352.32),
    "h200": Gpu("NVIDIA H200", (9, 0), 132, 232448, 4814.304),
    "a100": Gpu("NVIDIA A100-SXM4-80GB", (8, 0), 108, 166912, 2039.0),
    "l40s": Gpu("NVIDIA L40S", (8, 9), 142, 101376, 864.0),
    "a10": Gpu("NVIDIA A10", (8, 6), 72, 101376, 600.2),
}
"""GPU models to compile for ahead of time, without them (``targeting``): the H100 and H200 as their drivers
report them, the others from their data sheets."""

_TARGET = None  # the Gpu that ``targeting`` plans and compiles for, in place of the present devices


def device_limits(device_id):
    """Properties of GPU ``device_id`` that kernel configurations must respect (those of the ``targeting``
    GPU while one is set)."""
    if _TARGET is not None:
        return _TARGET._asdict()
    return _present_limits(device_id)


@functools.lru_cache(maxsize=None)
def _present_limits(device_id):
    if SIMULATOR:
        return {"name": "numba CUDA simulator", "cc": (9, 0), "sms": 1, "max_shared": 227 * 1024, "dram_gbs": 0.0}
    attr = _driver.CUdevice_attribute
    dev = driver_call(_driver.cuDeviceGet(device_id))[0]

    def get(name):
        return driver_call(_driver.cuDeviceGetAttribute(getattr(attr, name), dev))[0]

    name = driver_call(_driver.cuDeviceGetName(256, dev))[0]
    return {
        "name": name.split(b"\0", 1)[0].decode(),
        "cc": (
            get("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR"),
            get("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR"),
        ),
        "sms": get("CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT"),
        "max_shared": get("CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"),
        # peak DRAM bandwidth: two transfers per memory clock (kHz) over the bus (bits)
        "dram_gbs": get("CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE") * get("CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH") / 4e6,
    }


def target():
    """The ``Gpu`` that ``targeting`` plans and compiles for, or None."""
    return _TARGET


@contextlib.contextmanager
def targeting(gpu):
    """Plan and compile for ``gpu`` (a ``Gpu``) instead of the present devices, with a GPU or without one:
    ``device_limits`` gives its properties, ``compiled`` and ``compile_ahead`` compile into the kernel cache
    for its compute capability and launch nothing. Ahead-of-time compiles (``numattn.precompile``) run
    plans under it in a process of their own, with numba's GPU target (not its simulator)."""
    global _TARGET
    if SIMULATOR:
        raise RuntimeError("compiling for a GPU needs numba's GPU target: set NUMBA_ENABLE_CUDASIM=0")
    _TARGET = gpu
    try:
        with compiling_for(gpu.cc):
            yield gpu
    finally:
        _TARGET = None


@contextlib.contextmanager
def compiling_for(cc):
    """numba compiles device functions for compute capability ``cc`` meanwhile. It compiles them for its
    current device's, which takes a CUDA context (and a GPU); a kernel's compile for ``cc`` then needs
    neither."""
    import numba.cuda.dispatcher

    present = numba.cuda.dispatcher.get_current_device
    numba.cuda.dispatcher.get_current_device = lambda: SimpleNamespace(compute_capability=cc, id=0)
    try:
        yield
    finally:
        numba.cuda.dispatcher.get_current_device = present


def flatten_array(ptr, shape, strides, itemsize):
    """numba's kernel-argument fields of an array; ``strides`` in elements."""
    nitems = 1
    for extent in shape:
        nitems *= extent
    return (0, 0, nitems, itemsize, ptr, *shape, *(s * itemsize for s in strides))


def array_fields(arrays):
    """``(fields, slots)``: the flattened fields of arrays given as ``(shape, strides, itemsize)``
    with null data pointers, and the index of each array's data-pointer field among them."""
    fields, slots = [], []
    for shape, strides, itemsize in arrays:
        slots.append(len(fields) + 4)  # (meminfo, parent, nitems, itemsize, data, ...)
        fields.extend(flatten_array(0, shape, strides, itemsize))
    return fields, slots


def zero_words(ptr, words, stream):
    """Queue the zeroing of ``words`` 4-byte words at device address ``ptr`` on the raw stream handle ``stream``."""
    if words:
        driver_call(_driver.cuMemsetD32Async(ptr, 0, words, stream))


LOADED = []
"""Every ``CompiledKernel`` loaded in this process, for resource reports."""

COMPILES = []
"""``(label, seconds)`` of every kernel this process compiled (typing and lowering, NVVM, link), in order."""


class FunctionAttributes(NamedTuple):
    """A loaded kernel's resources: registers per thread, static shared, local (spill) and constant
    bytes, the most threads a block may have."""

    regs: int
    shared: int
    local: int
    const: int
    maxthreads: int

    @classmethod
    def of(cls, function):
        attr = _driver.CUfunction_attribute
        names = ("NUM_REGS", "SHARED_SIZE_BYTES", "LOCAL_SIZE_BYTES", "CONST_SIZE_BYTES", "MAX_THREADS_PER_BLOCK")
        return cls(*(driver_call(_driver.cuFuncGetAttribute(getattr(attr, f"CU_FUNC_ATTRIBUTE_{name}"), function))[0]
                     for name in names))


# the options of numba's kernel dispatcher that ``_compile`` follows, and the values of the others it takes
_FOLLOWED_OPTIONS = ("lineinfo", "fastmath", "forceinline", "max_registers", "lto", "opt")
_UNFOLLOWED_DEFAULTS = {"debug": (0, False, None), "link": ((), [], None), "extensions": ([], (), None),
                        "launch_bounds": (None,), "shared_memory_carveout": (None,), "device": (False,),
                        "inline": ("never",)}


def _through(function, *args):
    return function(*args)


# ``_through`` with a frame that reserves 512 KiB of CPython's frame stack (3.11 on) and so starts a 1 MiB
# chunk of it, which the frames of the call then fill. That stack grows by 16 KiB chunks, each mapped when a
# call crosses into it and unmapped as soon as that call returns; numba's nested compiles (a kernel, its
# device functions, their overloads) run their hottest loops across such a boundary, mapping and unmapping
# a chunk on every call: about 150,000 times and a quarter of a kernel's compile. One chunk holds them all.
_in_one_stack_chunk = FunctionType(_through.__code__.replace(co_stacksize=1 << 16), {})


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off meanwhile: a compile allocates hundreds of thousands of
    objects, and the full collections they trigger would traverse them all several times over (a tenth of a
    compile); what is garbage is collected after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


_OPTION_DEFAULTS = {}
"""Each ``TargetConfig`` class's option defaults, by class, for ``_option_values``."""


def _option_values(config):
    """``TargetConfig.values`` (a compile's options as a dict) as the defaults of ``config``'s class updated
    with the options set on it: the same dict, built without a property call per option. numba builds it
    twice for every overload resolved (to hash and compare the options in its cache of implementations),
    tens of thousands of times in a kernel's compile: a twentieth of it."""
    cls = type(config)
    defaults = _OPTION_DEFAULTS.get(cls)
    if defaults is None:
        defaults = _OPTION_DEFAULTS[cls] = {name: option.default for name, option in cls.options.items()}
    return {**defaults, **config._values}


@functools.lru_cache(maxsize=None)
def _quicker_option_values():
    """Install ``_option_values`` as numba's ``TargetConfig.values`` once it has given numba's values for the
    compile flags' class, with no option set and with several set; a numba-cuda that keeps its options
    otherwise keeps its own method."""
    from numba.cuda.core.targetconfig import TargetConfig
    from numba.cuda.flags import Flags

    probes = [Flags(), Flags()]
    probes[1].fastmath, probes[1].forceinline, probes[1].error_model = True, True, "numpy"
    try:
        agrees = all(_option_values(probe) == TargetConfig.values(probe) for probe in probes)
    except AttributeError:  # no ``options`` or ``_values`` where this numba-cuda keeps them
        agrees = False
    if agrees:
        TargetConfig.values = _option_values


def _compile(dispatcher, argtypes, label, cc=None):
    """The ``kernel_cache.Entry`` of ``dispatcher`` compiled by numba for ``argtypes``: its cubin, linked for
    compute capability ``cc`` (the current device's by default) as numba links it (sm_90a on sm_90, where
    wgmma needs it)."""
    start = time.perf_counter()
    cc = cc or cuda.get_current_device().compute_capability
    _quicker_option_values()
    with _collector_paused():
        library, entry_name = _in_one_stack_chunk(_lowered, dispatcher, tuple(argtypes), cc, label)
        cubin = library.get_cubin((*cc, "a" if cc >= (9, 0) else ""))  # arch-specific from sm_90 on, as numba links
    COMPILES.append((label, time.perf_counter() - start))
    return kernel_cache.Entry(label, entry_name, bytes(getattr(cubin, "code", cubin)))  # ObjectCode or bytes


def compile_into_cache(dispatcher, argtypes, label, cc):
    """``dispatcher`` for ``argtypes`` compiled for compute capability ``cc`` into the kernel cache, unless
    it is there; returns its ``kernel_cache.Entry``."""
    key = kernel_cache.kernel_key(dispatcher, tuple(argtypes), cc)
    return kernel_cache.cached_kernel(key, lambda: _compile(dispatcher, argtypes, label, cc))


@functools.lru_cache(maxsize=None)
def _lowered(dispatcher, argtypes, cc, label):
    """numba's code library of the kernel and its entry name: the steps of numba's kernel object (``_Kernel``:
    type and lower, mark the kernel entry) without the PTX listing it makes to look for library functions to
    link, which numattn's kernels never call (under link-time optimisation, numba's default with nvJitLink,
    that listing is an NVVM run of its own: an eighth to a sixth of a compile), and without loading the module
    into numba's own context (numattn loads the cubin itself). Linking the library gives the cubin numba's
    kernel object links (``tests/test_kernel_cache.py`` holds them equal)."""
    from numba import types as numba_types
    from numba.cuda.compiler import compile_cuda, kernel_fixup

    options = dispatcher.targetoptions
    for name, value in options.items():
        if name not in _FOLLOWED_OPTIONS and value not in _UNFOLLOWED_DEFAULTS.get(name, ()):
            raise RuntimeError(f"kernel {label}: numattn's compile does not follow numba's option {name}={value!r}")
    fastmath = options.get("fastmath", False)
    result = compile_cuda(dispatcher.py_func, numba_types.void, argtypes, lineinfo=options.get("lineinfo", False),
                          forceinline=options.get("forceinline", False), fastmath=fastmath,
                          nvvm_options={"fastmath": fastmath, "opt": 3 if options.get("opt", True) else 0}, cc=cc,
                          max_registers=options.get("max_registers"), lto=options.get("lto", False))
    library, entry_name = result.library, result.fndesc.llvm_func_name
    kernel_fixup(library.get_function(entry_name), False)
    if library._setup_functions:  # module initialisation (numba's NRT) that loading a bare cubin would skip
        raise RuntimeError(f"kernel {label} needs numba's module setup; numattn's loader cannot run it")
    if library.use_cooperative:  # a grid sync: numba would link the device runtime and launch it cooperatively
        raise RuntimeError(f"kernel {label} synchronises its grid; numattn's compile and launch do not")
    return library, entry_name


class CompiledKernel:
    """A numba kernel compiled for one signature and loaded on one device; ``label`` names its variant.

    The linked cubin comes from the kernel cache, or from numba (typing, lowering, NVVM, linking) and is
    then stored there; either way the driver loads it as a library, so a kernel from the cache is the
    very code a fresh compile gives.
    """

    def __init__(self, dispatcher, argtypes, device_id, shared_bytes, label):
        argtypes = tuple(argtypes)
        with cuda.gpus[device_id]:  # numba's (primary) context of that device is current
            cc = device_limits(device_id)["cc"]
            entry = kernel_cache.cached_kernel(kernel_cache.kernel_key(dispatcher, argtypes, cc),
                                               lambda: _compile(dispatcher, argtypes, label))
            self.library = driver_call(_driver.cuLibraryLoadData(entry.cubin, None, None, 0, None, None, 0))[0]
            self.handle = driver_call(_driver.cuLibraryGetKernel(self.library, entry.entry_name.encode()))[0]
            self.context = driver_call(_driver.cuCtxGetCurrent())[0]
            # the launch takes this context's function of the library kernel, which the driver would
            # otherwise look up on every launch (about 2 µs of host time)
            self.function = driver_call(_driver.cuKernelGetFunction(self.handle))[0]
        self.device_id = device_id
        self.label = label
        self.attributes = FunctionAttributes.of(self.function)
        self.shared_bytes = shared_bytes
        if shared_bytes > _DEFAULT_SHARED_LIMIT:
            limit = device_limits(device_id)["max_shared"]
            if shared_bytes > limit:
                raise ValueError(f"kernel needs {shared_bytes} bytes of shared memory, device allows {limit}")
            driver_call(
                _driver.cuKernelSetAttribute(
                    _driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    shared_bytes,
                    self.handle,
                    _driver.CUdevice(device_id),
                )
            )
        LOADED.append(self)

    def prepare(self, grid, block, fields, pointer_slots, cluster=None):
        """A ``PreparedLaunch`` of this kernel with the given flattened arguments (``cluster``: the shape of
        its thread-block clusters, or None)."""
        return PreparedLaunch(self, grid, block, fields, pointer_slots, cluster)


class _LaunchConfig(ctypes.Structure):
    """The driver's ``CUlaunchConfig``: grid, block, dynamic shared memory, stream, launch attributes."""

    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attributes", ctypes.c_void_p), ("attribute_count", ctypes.c_uint)]


class _LaunchAttribute(ctypes.Structure):
    """The driver's ``CUlaunchAttribute``: an attribute id, then its value (a 64-byte union)."""

    _fields_ = [("id", ctypes.c_uint), ("padding", ctypes.c_uint), ("value", ctypes.c_uint * 16)]


def _cluster_attribute(cluster):
    """A launch attribute giving thread-block clusters of shape ``cluster`` (x, y, z)."""
    attribute = _LaunchAttribute()
    attribute.id = int(_driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION)
    attribute.value[:3] = cluster
    return attribute


@functools.lru_cache(maxsize=None)
def _launch_kernel_ex():
    """The driver's ``cuLaunchKernelEx(config, function, params, extra)`` as a ctypes function.

    Four pointer arguments cost less host time to pass than ``cuLaunchKernel``'s
    eleven (through ctypes or cuda-bindings alike); the driver's own time is the same.
    The call keeps the GIL (a ``PYFUNCTYPE``, as torch's own launches do): no other thread
    can rewrite a launch's shared argument block before the driver has copied it.
    """
    flags = _driver.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_LEGACY_STREAM
    address = driver_call(_driver.cuGetProcAddress(b"cuLaunchKernelEx", 12000, flags))[0]
    if not address:
        raise RuntimeError("the CUDA driver has no cuLaunchKernelEx (CUDA 12.0 or newer is needed)")
    return ctypes.PYFUNCTYPE(ctypes.c_int, *(ctypes.c_void_p,) * 4)(int(address))


# Python without a GIL (free-threaded builds) needs a lock around filling and launching a prepared launch
_GIL = getattr(sys, "_is_gil_enabled", lambda: True)()


class PreparedLaunch:
    """A kernel with its grid (an int or a tuple of up to three extents) and packed arguments; each call
    writes the data pointers and launches.

    ``fields`` is the flattened argument list: Python ints fill 8-byte slots,
    ``np.float32`` values the low half of one. ``pointer_slots`` index the
    fields that change between launches, in the order ``__call__`` takes them;
    those live in one small array of their own, written with one ``pack_into``
    per launch (the driver takes the address of each argument, so the
    arguments need not be adjacent).
    """

    def __init__(self, kernel, grid, block, fields, pointer_slots, cluster=None):
        self.kernel, self.grid, self.block, self.cluster = kernel, grid, block, cluster
        self._values = np.zeros(len(fields), dtype=np.uint64)
        as_f32 = self._values.view(np.float32)
        for i, field in enumerate(fields):
            if isinstance(field, np.float32):
                as_f32[2 * i] = field
            else:
                self._values[i] = int(field) & 0xFFFFFFFFFFFFFFFF
        self._pointers = (ctypes.c_uint64 * len(pointer_slots))()
        self._write_pointers = functools.partial(struct.Struct(f"{len(pointer_slots)}Q").pack_into, self._pointers, 0)
        self._addresses = np.uint64(self._values.ctypes.data) + np.arange(len(fields), dtype=np.uint64) * 8
        for i, slot in enumerate(pointer_slots):
            self._addresses[slot] = ctypes.addressof(self._pointers) + 8 * i
        self._params = int(self._addresses.ctypes.data)
        self._lock = threading.Lock()  # without a GIL: the pointers and the stream are shared, fill and launch as one step
        extents = (grid,) if isinstance(grid, int) else tuple(grid)
        self._config = _LaunchConfig(extents + (1,) * (3 - len(extents)), (block, 1, 1), kernel.shared_bytes)
        if cluster is not None:
            self._attribute = _cluster_attribute(cluster)  # kept alive with the config that points to it
            self._config.attributes, self._config.attribute_count = ctypes.addressof(self._attribute), 1
        self._config_address = ctypes.addressof(self._config)
        self._stream = 0
        self._function = int(kernel.function)
        self._launch = _launch_kernel_ex()

    def _fill_and_launch(self, stream, *pointers):
        """Launch on the raw stream handle ``stream`` (with the GIL held, nothing interleaves)."""
        self._write_pointers(*pointers)
        if stream != self._stream:
            self._config.stream = self._stream = stream
        err = self._launch(self._config_address, self._function, self._params, None)
        if err == _INVALID_CONTEXT:  # a thread with no current context (torch's autograd threads)
            driver_call(_driver.cuCtxSetCurrent(self.kernel.context))  # lets other threads run: fill again
            self._write_pointers(*pointers)
            self._config.stream = self._stream = stream
            err = self._launch(self._config_address, self._function, self._params, None)
        if err:
            driver_call((_driver.CUresult(err),))

    def _locked_launch(self, stream, *pointers):
        with self._lock:
            self._fill_and_launch(stream, *pointers)

    __call__ = _fill_and_launch if _GIL else _locked_launch


# The simulator runs one kernel at a time per process: its thread-local block state breaks when two
# threads launch at once, and each launch changes the interpreter's switch interval
_SIMULATOR_LOCK = threading.Lock()


class SimulatedKernel:
    """The same interface in numba's CUDA simulator: arrays are numpy arrays."""

    def __init__(self, dispatcher, shared_bytes):
        self.dispatcher = dispatcher
        self.shared_bytes = shared_bytes

    def launch_arrays(self, grid, block, *args):
        """Run the kernel on numpy arrays (used in place, strided views too) and scalars; launches from
        several threads run one after another."""
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        # Wrapped as simulator device arrays, numpy views (strided ones too) are
        # used in place; plain numpy arguments would be copied in and out.
        args = [FakeCUDAArray(a) if isinstance(a, np.ndarray) else a for a in args]
        with _SIMULATOR_LOCK:
            # The simulator's block manager polls its threads; a short GIL switch
            # interval lets threads leave barriers promptly (several times faster).
            interval = sys.getswitchinterval()
            sys.setswitchinterval(1e-4)
            try:
                self.dispatcher[grid, block, 0, self.shared_bytes](*args)
            finally:
                sys.setswitchinterval(interval)


def compiled(dispatcher, argtypes, device_id, shared_bytes, label):
    """Cached ``CompiledKernel`` (or ``SimulatedKernel``) for one signature and device; while ``targeting`` a
    GPU, the kernel compiled into the kernel cache for it, to be loaded by a later process (``AheadOfTime``)."""
    if _TARGET is not None:
        compile_into_cache(dispatcher, argtypes, label, _TARGET.cc)
        return AheadOfTime(label)
    return _loaded(dispatcher, argtypes, device_id, shared_bytes, label)


@functools.lru_cache(maxsize=None)
def _loaded(dispatcher, argtypes, device_id, shared_bytes, label):
    if SIMULATOR:
        return SimulatedKernel(dispatcher, shared_bytes)
    return CompiledKernel(dispatcher, argtypes, device_id, shared_bytes, label)


class AheadOfTime:
    """A kernel compiled for the ``targeting`` GPU: its plans can be made, not launched."""

    def __init__(self, label):
        self.label = label

    def prepare(self, *args, **kwargs):
        def refuse(*args):
            raise RuntimeError(f"kernel {self.label} was compiled ahead of time for another GPU; it does not "
                               "launch in this process")

        return refuse


def resource_report():
    """One line per loaded kernel: registers per thread, shared memory per block, local (spill) bytes."""
    lines = [f"{'kernel':70} {'regs':>5} {'smem B':>8} {'local B':>8}"]
    for kernel in LOADED:
        a = kernel.attributes
        lines.append(f"{kernel.label:70} {a.regs:5d} {a.shared + kernel.shared_bytes:8d} {a.local:8d}")
    return "\n".join(lines)
