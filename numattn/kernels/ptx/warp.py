"""Special functions and warp-level primitives: ex2, rcp, shuffles, syncwarp, ballot."""

import numpy as np
from numba import types
from numba.cuda.extending import intrinsic

from ._core import _asm, _asm_intrinsic, _bind, _f32, _i32, _lane, _statement_intrinsic, _warp_gather

# --------------------------------------------------------------------------
# Special functions and warp shuffles
# --------------------------------------------------------------------------


def ex2_approx(x):
    """``ex2_approx(x) -> float32``: 2**x. Emits ``ex2.approx.ftz.f32`` (relative error below 2**-22; -inf gives 0)."""
    with np.errstate(over="ignore"):
        return np.float32(np.exp2(np.float32(x)))


_bind(ex2_approx, _asm_intrinsic("ex2.approx.ftz.f32 $0, $1;", "=f,f", _f32, types.float32(types.float32)))


def rcp_approx(x):
    """``rcp_approx(x) -> float32``: 1 / x. Emits ``rcp.approx.ftz.f32`` (within 1 ulp; inf gives 0, 0 gives inf)."""
    with np.errstate(divide="ignore"):
        return np.float32(np.float32(1.0) / np.float32(x))


_bind(rcp_approx, _asm_intrinsic("rcp.approx.ftz.f32 $0, $1;", "=f,f", _f32, types.float32(types.float32)))


def shfl_xor_f32(x, lane_mask):
    """``shfl_xor_f32(x, lane_mask) -> float32``: ``x`` of lane ``laneid ^ lane_mask``, all 32 lanes taking part.

    Emits ``shfl.sync.bfly.b32`` with a full member mask.
    """
    values = _warp_gather(np.float32(x))
    return values[_lane() ^ int(lane_mask)]


_bind(
    shfl_xor_f32,
    _asm_intrinsic("shfl.sync.bfly.b32 $0, $1, $2, 31, -1;", "=f,f,r", _f32, types.float32(types.float32, types.int32)),
)


def broadcast_i32(x):
    """``broadcast_i32(x) -> int32``: lane 0's ``x`` in every lane, all 32 lanes taking part: a value ptxas then
    knows to be the same across the warp (one loaded from memory it cannot know so of), so that branches on it
    do not make a warpgroup's ``wgmma`` wait for each other (CUDA 13.5's warning C7519).

    Emits ``shfl.sync.idx.b32`` from lane 0 with a full member mask.
    """
    return np.int32(_warp_gather(np.int32(x))[0])


_bind(broadcast_i32, _asm_intrinsic("shfl.sync.idx.b32 $0, $1, 0, 31, -1;", "=r,r", _i32, types.int32(types.int32)))


def syncwarp():
    """``syncwarp()``: barrier among the 32 lanes of the warp, ordering their shared-memory accesses.

    Emits ``bar.warp.sync -1``.
    """
    _warp_gather(None)


_bind(syncwarp, _statement_intrinsic("bar.warp.sync -1;"))


def ballot(predicate):
    """``ballot(predicate) -> uint32``: bit ``l`` set when lane ``l``'s ``predicate`` is true; all 32 lanes take part.

    Emits ``vote.sync.ballot.b32`` with a full member mask.
    """
    return _warp_gather(bool(predicate), lambda votes: np.uint32(sum(1 << lane for lane, v in enumerate(votes) if v)))


@intrinsic
def _ballot(typingctx, predicate):
    def codegen(context, builder, sig, args):
        flag = builder.zext(args[0], _i32)
        text = "{ .reg .pred p; setp.ne.u32 p, $1, 0; vote.sync.ballot.b32 $0, p, -1; }"
        return _asm(builder, text, "=r,r", _i32, [flag])

    return types.uint32(types.boolean), codegen


_bind(ballot, _ballot)
