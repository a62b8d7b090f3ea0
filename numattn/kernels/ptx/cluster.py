"""Thread-block clusters (sm_90): the cluster-wide barrier and loads from another block's shared memory.

A cluster's blocks run at once on one GPU processing cluster and may read each other's shared memory
(distributed shared memory). The simulator runs blocks one after another, so its twins model a cluster
of one block: the barrier is the block's, and a block may read only its own shared memory (rank 0).
"""

import threading

import numpy as np
from llvmlite import ir
from numba import types
from numba.cuda.extending import intrinsic

from ._core import _asm, _bind, _f32, _shared_address, _statement_intrinsic, _unpack_struct


def cluster_sync():
    """``cluster_sync()``: wait until every thread of every block of the cluster has arrived; shared-memory
    writes before it are visible to the cluster's blocks after it (``barrier.cluster.arrive.release`` then
    ``barrier.cluster.wait.acquire``). Every thread of the block calls it."""
    threading.current_thread().syncthreads()  # the simulated block's barrier


_bind(cluster_sync, _statement_intrinsic(
    "barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;"))


def _only_own_block(rank):
    if rank != 0:
        raise NotImplementedError("the simulator runs clusters of one block: only rank 0 can be read")


def ld_cluster_f32(tile, row, col, rank):
    """``ld_cluster_f32(tile, row, col, rank) -> float32``: ``tile[row, col]`` of the shared float32 tile in
    the cluster's block ``rank`` (the same offset in its shared memory): ``mapa`` then ``ld.shared::cluster``."""
    _only_own_block(rank)
    return np.float32(tile[row, col])


def ld_cluster_f32x4(tile, row, col, rank):
    """``ld_cluster_f32x4(tile, row, col, rank) -> (f0, f1, f2, f3)``: ``tile[row, col : col + 4]`` (16-byte
    aligned) of the shared float32 tile in the cluster's block ``rank`` (``ld.shared::cluster.v4.f32``)."""
    _only_own_block(rank)
    return tuple(np.float32(tile[row, col + k]) for k in range(4))


def _cluster_load(width):
    """The lowering of a ``width``-float load from another block's shared memory."""
    vector = "" if width == 1 else f".v{width}"
    outputs = ", ".join(f"${i}" for i in range(width))
    destination = outputs if width == 1 else "{" + outputs + "}"
    text = (f"{{\n\t.reg .u32 remote;\n\tmapa.shared::cluster.u32 remote, ${width}, ${width + 1};\n\t"
            f"ld.shared::cluster{vector}.f32 {destination}, [remote];\n\t}}")
    constraints = ",".join(["=f"] * width + ["r", "r", "~{memory}"])
    result_ir = _f32 if width == 1 else ir.LiteralStructType([_f32] * width)
    result = types.float32 if width == 1 else types.UniTuple(types.float32, width)

    @intrinsic
    def lowering(typingctx, tile, row, col, rank):
        if not (isinstance(tile, types.Array) and tile.dtype == types.float32):
            return None

        def codegen(context, builder, sig, args):
            local = _shared_address(context, builder, sig.args[0], args[0], (args[1], sig.args[1]), (args[2], sig.args[2]))
            block = context.cast(builder, args[3], sig.args[3], types.uint32)
            # a side effect keeps the load after the cluster barrier that orders it behind the other block's writes
            value = _asm(builder, text, constraints, result_ir, [local, block], side_effect=True)
            return value if width == 1 else _unpack_struct(context, builder, sig, value, width)

        return result(tile, row, col, rank), codegen

    return lowering


_bind(ld_cluster_f32, _cluster_load(1))
_bind(ld_cluster_f32x4, _cluster_load(4))
