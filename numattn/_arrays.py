"""Array interop: what numattn needs to know of an array, whatever library made it.

Supported inputs: torch tensors (CPU or CUDA), numpy arrays, numba device
arrays, any object exposing ``__cuda_array_interface__`` (CuPy, JAX, ...) and
any object exposing ``__dlpack__``. ``describe`` reads an array's metadata
without copying; the helpers below give host (numpy) views of the storage and
wrap results back into the caller's library.
"""

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._cuda import SIMULATOR, cuda

Array = Any
"""Type of numattn's array arguments and results: a torch tensor, numpy array, numba device array, or any
object with ``__cuda_array_interface__`` or ``__dlpack__`` (results come back in the caller's library)."""

if SIMULATOR:
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray as _NumbaDeviceArray
else:
    from numba.cuda.cudadrv.devicearray import DeviceNDArray as _NumbaDeviceArray

FLOAT_DTYPES = ("float16", "bfloat16", "float32")
_STORAGE = {"float16": np.uint16, "bfloat16": np.uint16, "float32": np.float32}
_TYPESTR = {"f2": "float16", "f4": "float32", "f8": "float64", "i4": "int32", "i8": "int64"}


@dataclass(frozen=True)
class Operand:
    """Metadata of one array argument. ``strides`` count elements; ``device`` is None on the host."""

    kind: str  # "torch", "numpy", "numba", "cai"
    dtype: str  # a name from FLOAT_DTYPES when supported, else how the library spells it
    shape: tuple
    strides: tuple
    device: object
    ptr: int = 0  # address of element 0 on the device; 0 in host memory

    @property
    def where(self):
        return "host memory" if self.device is None else f"GPU {self.device}"


def _torch():
    return sys.modules.get("torch")


def is_torch(x):
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def _element_strides(byte_strides, itemsize, name):
    strides = []
    for s in byte_strides:
        if s % itemsize:
            raise ValueError(f"{name} has a stride of {s} bytes, not a multiple of its {itemsize}-byte elements")
        strides.append(s // itemsize)
    return tuple(strides)


def contiguous_strides(shape):
    """Element strides of a C-contiguous array of ``shape``."""
    strides, step = [], 1
    for extent in reversed(shape):
        strides.append(step)
        step *= max(extent, 1)
    return tuple(reversed(strides))


def _numpy_dtype_name(dtype):
    return "bfloat16" if dtype.name == "bfloat16" else dtype.name


def _cai_device(ptr):
    from cuda.bindings import driver

    attr = driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    err, ordinal = driver.cuPointerGetAttribute(attr, ptr)
    return ordinal if err == driver.CUresult.CUDA_SUCCESS else cuda.get_current_device().id


def _check_byte_order(order, spelling, name):
    """TypeError for elements stored in the other byte order than this machine's ('>' on x86 and Arm)."""
    if order not in ("=", "|", np.dtype("=f4").str[0]):
        raise TypeError(
            f"{name} has non-native byte order ({spelling!r}); convert it first, e.g. "
            f"{name}.astype({name}.dtype.newbyteorder('='))"
        )


def describe(x, name):
    """``Operand`` for argument ``name``; TypeError for objects that are not arrays. An ``Operand`` describes
    itself: planning ahead of time takes shapes without arrays."""
    if isinstance(x, Operand):
        return x
    if is_torch(x):
        dtype = str(x.dtype).removeprefix("torch.")
        if x.device.type == "cuda":
            device = x.device.index if x.device.index is not None else 0
        elif x.device.type == "cpu":
            device = None
        else:
            raise ValueError(f"{name} is on torch device {x.device}; numattn runs on CUDA tensors or host memory")
        ptr = x.data_ptr() if device is not None else 0
        return Operand("torch", dtype, tuple(x.shape), tuple(x.stride()), device, ptr)
    if isinstance(x, np.ndarray):
        _check_byte_order(x.dtype.byteorder, x.dtype.str, name)
        dtype = _numpy_dtype_name(x.dtype)
        return Operand("numpy", dtype, x.shape, _element_strides(x.strides, x.itemsize, name), None)
    if isinstance(x, _NumbaDeviceArray) and SIMULATOR:  # the simulator's device arrays wrap numpy
        host = x._ary
        _check_byte_order(host.dtype.byteorder, host.dtype.str, name)
        strides = _element_strides(host.strides, host.itemsize, name)
        return Operand("numba", _numpy_dtype_name(host.dtype), host.shape, strides, 0)
    if hasattr(x, "__cuda_array_interface__"):
        cai = x.__cuda_array_interface__
        typestr = cai["typestr"]
        _check_byte_order(typestr[0], typestr, name)
        dtype = _TYPESTR.get(typestr[1:], typestr)
        itemsize = int(typestr[2:]) if typestr[2:].isdigit() else 1
        shape = tuple(cai["shape"])
        if cai.get("strides") is None:
            strides = contiguous_strides(shape)
        else:
            strides = _element_strides(cai["strides"], itemsize, name)
        kind = "numba" if isinstance(x, _NumbaDeviceArray) else "cai"
        ptr = cai["data"][0]
        return Operand(kind, dtype, shape, strides, _cai_device(ptr), ptr)
    raise TypeError(
        f"{name} must be an array (torch tensor, numpy array, numba device array, or an object with "
        f"__cuda_array_interface__ or __dlpack__), got {type(x).__name__}"
    )


def from_dlpack(x):
    """``x`` itself when ``describe`` reads it directly; a zero-copy numpy or torch view of a DLPack-only object."""
    if (
        is_torch(x)
        or isinstance(x, (np.ndarray, _NumbaDeviceArray))
        or hasattr(x, "__cuda_array_interface__")
        or not hasattr(x, "__dlpack__")
    ):
        return x
    device_type, _ = x.__dlpack_device__()
    if device_type == 1:  # kDLCPU
        return np.from_dlpack(x)
    torch = _torch()
    if torch is None:
        try:
            import torch
        except ImportError:
            raise TypeError(
                f"{type(x).__name__} offers only DLPack on a device; install torch or pass an object "
                "with __cuda_array_interface__"
            ) from None
    return torch.from_dlpack(x)


def device_pointer(x):
    """Address of element 0 of a device array."""
    if is_torch(x):
        return x.data_ptr()
    return x.__cuda_array_interface__["data"][0]


def cai_stream(x):
    """The stream a ``__cuda_array_interface__`` producer asks consumers to order after (0: legacy default)."""
    stream = x.__cuda_array_interface__.get("stream")
    return stream or 0


def torch_current():
    """``(device, stream)``: torch's cheapest getters of the current CUDA device and of the raw handle
    of its current stream on a device (private fast paths where torch has them)."""
    torch = _torch()
    device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return device, raw if raw is not None else (lambda d: torch.cuda.current_stream(d).cuda_stream)


def upload_on_torch_stream(host, device):
    """``(tensor, address)``: the numpy array ``host`` copied to GPU ``device`` on torch's current stream, in
    the order of its work and without waiting for it (staged from host memory at once)."""
    torch = _torch()
    on_device = torch.from_numpy(host).to(torch.device("cuda", device), non_blocking=True)
    return on_device, on_device.data_ptr()


def storage_dtype(dtype):
    """numpy dtype that carries elements of ``dtype`` inside kernels (16-bit floats as uint16)."""
    return np.dtype(_STORAGE[dtype])


def host_storage(x, op):
    """Zero-copy numpy view of a host (or simulator) array's storage, 16-bit floats as uint16."""
    if op.kind == "torch":
        torch = _torch()
        x = x.detach()
        if op.dtype == "bfloat16":
            x = x.view(torch.int16)
        x = x.numpy()
    elif op.kind == "numba":
        x = x._ary if hasattr(x, "_ary") else x.copy_to_host()
    return x.view(_STORAGE[op.dtype])


def float32_values(storage, dtype):
    """The float32 values of host ``storage`` holding ``dtype`` elements (16-bit floats as their uint16
    bits, see ``storage_dtype``): exact."""
    if dtype == "float32":
        return storage
    if dtype == "float16":
        return storage.view(np.float16).astype(np.float32)
    return (storage.astype(np.uint32) << 16).view(np.float32)


def rounded_storage(values, dtype):
    """Host storage of ``dtype`` elements holding float32 ``values`` rounded to the nearest, ties to even
    (a bf16 NaN keeps its sign and top payload bits, quieted)."""
    values = np.asarray(values, dtype=np.float32)
    if dtype == "float32":
        return values
    if dtype == "float16":
        return values.astype(np.float16).view(np.uint16)
    u = values.view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16
    return np.where(np.isnan(values), (u >> 16) | np.uint32(0x0040), rounded).astype(np.uint16)


def wrap_host(storage, like, dtype):
    """Host ``storage`` (storage dtype) as a ``dtype`` array of the same library as ``like``."""
    if is_torch(like):
        torch = _torch()
        if dtype == "bfloat16":
            return torch.from_numpy(storage.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(storage.view(np.dtype(dtype)))
    if dtype == "bfloat16":  # only reachable from a bfloat16 input, whose numpy dtype is reused
        array = storage.view(like.dtype if isinstance(like, np.ndarray) else like._ary.dtype)
    else:
        array = storage.view(np.dtype(dtype))
    return array if isinstance(like, np.ndarray) else cuda.to_device(array)


class _StorageInterface:
    """A device buffer described through ``__cuda_array_interface__``."""

    def __init__(self, ptr, shape, byte_strides, typestr):
        self.__cuda_array_interface__ = {
            "shape": tuple(shape), "strides": tuple(byte_strides), "typestr": typestr, "data": (ptr, False), "version": 3,
        }


def numba_storage_view(ptr, shape, strides, dtype):
    """A numba device array over the device buffer at ``ptr`` holding ``dtype`` elements (``strides`` in
    elements), in the storage dtype kernels index (16-bit floats as uint16)."""
    itemsize = storage_dtype(dtype).itemsize
    typestr = "<f4" if dtype == "float32" else "<u2"
    return cuda.as_cuda_array(_StorageInterface(ptr, shape, (s * itemsize for s in strides), typestr))


def empty_device_like(x, shape, dtype, device):
    """Uninitialised device array of ``shape`` and ``dtype`` of the same library as ``x``."""
    if is_torch(x):
        torch = _torch()
        return torch.empty(shape, dtype=getattr(torch, dtype), device=f"cuda:{device}")
    with cuda.gpus[device]:
        out = cuda.device_array(shape, dtype=np.float16 if dtype == "float16" else _STORAGE[dtype])
    module = sys.modules.get(type(x).__module__.split(".")[0])
    if module is not None and module.__name__ == "cupy":
        return module.asarray(out)
    return out
