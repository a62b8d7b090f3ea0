"""The decode kernels' configuration: which kernel a problem takes (tensor cores where they apply, CUDA
cores otherwise), its ring depth or query rows per block, and the terms of its key splitting (blocks
per SM, fewest keys per split) that ``ops/decode.py`` weighs against the device."""

from typing import NamedTuple

from ..kernels.decode import MMA_KEYS, MMA_ROWS, WARPS, decode_geometry
from ..kernels.tiles import tile_row_elems

MAX_MMA_HEAD_DIM = 256  # head dims of the tensor-core kernel; beyond, the CUDA-core kernel runs

# ring depths of the tensor-core kernel, the first that fits the shared memory is used: two stages (one
# tile in flight per warp) measured faster than three on W1, W2 and W3 once the merge's tail was short
MMA_STAGES = (2,)
# the kernels' splitting terms: blocks per SM (the tensor-core kernel's shared memory), fewest keys per split
MMA_SPLITTING = (2, 4 * WARPS * MMA_KEYS)
SIMT_SPLITTING = (16, 128)


class DecodeConfig(NamedTuple):
    """One decode problem's kernel: ``stages`` of the tensor-core kernel's ring (None: the CUDA-core
    kernel), query ``rows`` per block, ``splitting``, ``(blocks per SM, fewest keys per split)``, and the
    kernel's dynamic ``shared_bytes``."""

    stages: int | None
    rows: int
    splitting: tuple
    shared_bytes: int


def decode_mma_supported(dtype, head_dim, head_dim_v, vector_loads):
    """Whether the tensor-core decode kernel takes this dtype, these head dims (multiples of 16 up to
    ``MAX_MMA_HEAD_DIM``) and this alignment."""
    return (dtype in ("float16", "bfloat16") and head_dim % 16 == 0 and head_dim_v % 16 == 0
            and max(head_dim, head_dim_v) <= MAX_MMA_HEAD_DIM and vector_loads)


def decode_mma_shared_bytes(head_dim, head_dim_v, stages):
    """Dynamic shared memory of ``decode_mma_kernel``: the Q tile and each warp's ring of K/V stages
    (the warps' final states reuse it)."""
    ring = WARPS * stages * MMA_KEYS * (tile_row_elems(head_dim) + tile_row_elems(head_dim_v))
    merge = WARPS * MMA_ROWS * head_dim_v * 2  # float32 accumulators, counted in 16-bit elements
    return 2 * max(MMA_ROWS * tile_row_elems(head_dim) + ring, merge)


def decode_config(dtype, head_dim, head_dim_v, vector_loads, query_rows, limits):
    """The ``DecodeConfig`` of a problem with ``query_rows`` query rows per KV head (group size times new
    tokens) on a device of ``limits`` (``device_limits``): the tensor-core kernel with the first ring
    depth that fits the shared memory (fp16/bf16, head dims multiples of 16, 16-byte aligned rows,
    sm_80+), else the CUDA-core kernel with the rows its registers hold."""
    if decode_mma_supported(dtype, head_dim, head_dim_v, vector_loads) and limits["cc"] >= (8, 0):
        for stages in MMA_STAGES:
            shared_bytes = decode_mma_shared_bytes(head_dim, head_dim_v, stages)
            if shared_bytes <= limits["max_shared"]:
                return DecodeConfig(stages, MMA_ROWS, MMA_SPLITTING, shared_bytes)
    *_, rows = decode_geometry(dtype, head_dim, head_dim_v, vector_loads)
    return DecodeConfig(None, min(rows, query_rows), SIMT_SPLITTING, 0)
