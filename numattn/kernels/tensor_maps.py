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


def tile_map(array, box_rows):
    """The tensor map (``uint64 [MAP_WORDS]``) of ``array`` — a 4-D array of 16-bit values on the GPU (any
    object with ``__cuda_array_interface__``: a torch CUDA tensor, a numba device array) — for boxes of
    ``box_rows`` rows of 64 columns. ValueError for an array a tensor map cannot describe."""
    if not 1 <= box_rows <= MAX_BOX_ROWS:
        raise ValueError(f"box_rows must be in [1, {MAX_BOX_ROWS}], got {box_rows}")
    if SIMULATOR:
        if np.dtype(array.dtype).itemsize != 2 or len(array.shape) != 4:
            raise ValueError(f"a tensor map describes a 4-D array of 16-bit values, got {array.dtype} {array.shape}")
        key = next(_simulated_keys)
        SIMULATED_TENSOR_MAPS[key] = (array, box_rows)
        return np.array([key] + [0] * (MAP_WORDS - 1), dtype=np.uint64)
    interface = array.__cuda_array_interface__
    shape, pointer = tuple(interface["shape"]), interface["data"][0]
    itemsize = np.dtype(interface["typestr"]).itemsize
    strides = interface.get("strides") or tuple(int(np.prod(shape[axis + 1:])) * itemsize for axis in range(len(shape)))
    if itemsize != 2 or len(shape) != 4:
        raise ValueError(f"a tensor map describes a 4-D array of 16-bit values, got {interface['typestr']} {shape}")
    if strides[3] != itemsize or pointer % 16 or any(stride % 16 for stride in strides[:3]):
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
