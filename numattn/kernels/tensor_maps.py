"""Tensor maps (``CUtensorMap``) of 4-D arrays of 16-bit values, for the tensor copies of ``ptx.tma_load_box``.

A map describes an array ``[batch, heads, rows, cols]`` whose columns are contiguous, its base and other
strides multiples of 16 bytes, and the box a copy moves: ``box_rows`` rows of 64 columns, swizzled by
128 bytes as wgmma reads a tile. The CUDA driver encodes it (``cuTensorMapEncodeTiled``) into 16 words
that a kernel reads from global memory. In the simulator a map's first word is a key under which the
array and box wait for the twin of ``tma_load_box``.
"""

import itertools

import numpy as np

from .._cuda import SIMULATOR
from .ptx.tma import PANEL_COLUMNS, SIMULATED_TENSOR_MAPS

MAP_WORDS = 16  # 64-bit words of a tensor map
MAX_BOX_ROWS = 256

_simulated_keys = itertools.count(1)


def steps_along_every_axis(shape, strides):
    """Whether a map can describe an array of ``shape`` and ``strides``: no axis of more than one element
    repeats (a stride of 0, as ``expand`` gives)."""
    return all(stride or n == 1 for stride, n in zip(strides, shape, strict=True))


def tile_map(array, box_rows):
    """The tensor map (``uint64 [MAP_WORDS]``) of ``array`` — a 4-D array of 16-bit values on the GPU (any
    object with ``__cuda_array_interface__``: a torch CUDA tensor, a numba device array) — for boxes of
    ``box_rows`` rows of 64 columns. ValueError for an array a tensor map cannot describe."""
    if SIMULATOR:
        shape, dtype = array.shape, np.dtype(array.dtype)
    else:
        interface = array.__cuda_array_interface__
        shape, dtype = tuple(interface["shape"]), np.dtype(interface["typestr"])
    if dtype.itemsize != 2 or len(shape) != 4:
        raise ValueError(f"a tensor map describes a 4-D array of 16-bit values, got {dtype} {shape}")
    if SIMULATOR:
        _check_box(box_rows)
        key = next(_simulated_keys)
        SIMULATED_TENSOR_MAPS[key] = (array, box_rows)
        return np.array([key] + [0] * (MAP_WORDS - 1), dtype=np.uint64)
    strides = interface.get("strides") or tuple(int(np.prod(shape[axis + 1:])) * dtype.itemsize
                                                for axis in range(len(shape)))
    return encode_tile_map(interface["data"][0], shape, strides, box_rows)


def encode_tile_map(pointer, shape, strides, box_rows):
    """The tensor map (``uint64 [MAP_WORDS]``) of the 4-D array of 16-bit values at device address ``pointer``
    with ``shape`` and byte ``strides``, for boxes of ``box_rows`` rows of 64 columns (the CUDA driver's
    encoding; ValueError for an array a tensor map cannot describe)."""
    _check_box(box_rows)
    if not steps_along_every_axis(shape, strides):
        raise ValueError(f"a tensor map cannot repeat rows (a stride of 0 over more than one element), got shape "
                         f"{shape}, strides {strides}")
    # an axis of extent 1 (a packed layout's leading axis, stride 0) takes no step: give it the array's span
    span = max(stride * n for stride, n in zip(strides, shape, strict=True))
    strides = tuple(stride if n > 1 else span for stride, n in zip(strides, shape, strict=True))
    if strides[3] != 2 or pointer % 16 or any(stride % 16 for stride in strides[:3]):
        raise ValueError(f"a tensor map needs contiguous columns and 16-byte aligned rows, got strides {strides} "
                         f"at address {pointer:#x}")
    from cuda.bindings import driver

    from .launch import driver_call

    tensor_map = driver_call(driver.cuTensorMapEncodeTiled(
        driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, pointer,
        [driver.cuuint64_t(n) for n in reversed(shape)],  # columns, rows, heads, batch
        [driver.cuuint64_t(stride) for stride in reversed(strides[:3])],  # bytes between rows, heads, batches
        [driver.cuuint32_t(n) for n in (PANEL_COLUMNS, box_rows, 1, 1)],
        [driver.cuuint32_t(1)] * 4,
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE))[0]
    return np.array([int(word) for word in tensor_map.opaque], dtype=np.uint64)


def forget(maps):
    """In the simulator, drop the arrays that the tensor maps ``maps`` (rows of ``MAP_WORDS`` words) registered,
    once the launch that reads them has run."""
    if SIMULATOR:
        for key in np.asarray(maps).reshape(-1, MAP_WORDS)[:, 0]:
            SIMULATED_TENSOR_MAPS.pop(int(key), None)


def key_box_rows(layout, block_n):
    """Rows of K and V one tensor copy of a ``block_n``-key tile moves under sequence layout ``layout``: the
    tile's, or with pages of fewer keys a page's; 0 where pages do not split a tile into whole boxes (a box
    starts on a 1024-byte swizzle atom, 8 rows, and a tile's keys start at a multiple of ``block_n``: the page
    size must be a multiple of 8 that divides ``block_n`` or that ``block_n`` divides)."""
    if not layout.paged:
        return block_n
    page_size = layout.page_size
    if page_size % 8 or (block_n % page_size and page_size % block_n):
        return 0
    return min(page_size, block_n)


def _check_box(box_rows):
    if not 1 <= box_rows <= MAX_BOX_ROWS:
        raise ValueError(f"box_rows must be in [1, {MAX_BOX_ROWS}], got {box_rows}")


class TensorMapCache:
    """The tensor maps of a launch's operands, by the stream they were uploaded on and the operands' data
    pointers: the operands of a launch plan (fixed shapes and strides, ``layouts``: ``(shape, byte strides, box
    rows)`` of each), whose pointers recur from call to call, find their maps encoded and uploaded once.
    ``upload(maps)`` puts the ``[operands, MAP_WORDS]`` words on the GPU, in the order of that stream's work,
    and returns ``(device buffer, its address)``; after ``ENTRIES`` sets of pointers the cache starts afresh."""

    ENTRIES = 64

    def __init__(self, layouts, upload):
        self.layouts, self.upload = tuple(layouts), upload
        self.entries = {}

    def entry(self, stream, *pointers):
        """``(device buffer, address)`` of the maps of the operands at ``pointers`` for launches on ``stream``."""
        key = (stream, *pointers)
        entry = self.entries.get(key)
        if entry is None:
            if len(self.entries) >= self.ENTRIES:
                self.entries.clear()
            maps = np.stack([encode_tile_map(pointer, shape, strides, rows)
                             for pointer, (shape, strides, rows) in zip(pointers, self.layouts, strict=True)])
            entry = self.entries[key] = self.upload(maps)
        return entry
