"""Tensor-core ``mma.sync`` (m16n8k16, fp32 accumulators) and the shared-memory matrix loads and stores
that feed it (``ldmatrix``, ``stmatrix``)."""

import numpy as np
from llvmlite import ir
from numba import types
from numba.cuda.extending import intrinsic

from ._core import WARP_SIZE, _asm, _bind, _f32, _i32, _lane, _shared_address, _unpack_struct, _warp_gather

# --------------------------------------------------------------------------
# Tensor-core matrix multiply-accumulate, m16n8k16, fp32 accumulators
# --------------------------------------------------------------------------
# A (16×16, row-major) in a0..a3: a0 = A[g, 2t:2t+2], a1 = A[g+8, 2t:2t+2],
#   a2 = A[g, 2t+8:2t+10], a3 = A[g+8, 2t+8:2t+10]
# B (16×8, column-major) in b0, b1: b0 = B[2t:2t+2, g], b1 = B[2t+8:2t+10, g]
# C, D (16×8) in c0..c3: C[g, 2t], C[g, 2t+1], C[g+8, 2t], C[g+8, 2t+1]
# (g = group, t = tig; a register's bits 0–15 hold the lower column or row index)


_G, _T = np.arange(WARP_SIZE) // 4, np.arange(WARP_SIZE) % 4


def _a_matrix(a, widen_bits):
    """The 16×16 A operand from every lane's four A-fragment registers (``a`` of shape (32, 4))."""
    A = np.empty((16, 16), np.float32)
    for i in range(4):
        rows, cols = _G + 8 * (i % 2), 2 * _T + 8 * (i // 2)
        A[rows, cols], A[rows, cols + 1] = widen_bits(a[:, i] & 0xFFFF), widen_bits(a[:, i] >> 16)
    return A


def _mma_combine(widen_bits):
    """The warp-wide product: lanes' (a, b, c) registers in, every lane's (d0, d1, d2, d3) out."""

    def combine(lanes):
        a = np.array([lane[0] for lane in lanes], dtype=np.uint32)  # (32, 4)
        b = np.array([lane[1] for lane in lanes], dtype=np.uint32)  # (32, 2)
        c = np.array([lane[2] for lane in lanes], dtype=np.float32)  # (32, 4)
        A = _a_matrix(a, widen_bits)
        B = np.empty((16, 8), np.float32)
        C = np.empty((16, 8), np.float32)
        for i in range(4):
            C[_G + 8 * (i // 2), 2 * _T + i % 2] = c[:, i]
        for i in range(2):
            ks = 2 * _T + 8 * i
            B[ks, _G], B[ks + 1, _G] = widen_bits(b[:, i] & 0xFFFF), widen_bits(b[:, i] >> 16)
        D = A @ B + C
        return np.stack([D[_G, 2 * _T], D[_G, 2 * _T + 1], D[_G + 8, 2 * _T], D[_G + 8, 2 * _T + 1]], axis=1)

    return combine


def _widen_f16_bits(bits):
    return bits.astype(np.uint16).view(np.float16).astype(np.float32)


def _widen_bf16_bits(bits):
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


_MMA_F16, _MMA_BF16 = _mma_combine(_widen_f16_bits), _mma_combine(_widen_bf16_bits)


def mma_m16n8k16_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """``mma_m16n8k16_f16(a0..a3, b0, b1, c0..c3) -> (d0, d1, d2, d3)``: D = A·B + C.

    A, B fp16 (``uint32`` registers of two values), C, D fp32. Emits
    ``mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32``; layouts above.
    """
    d = _warp_gather(((a0, a1, a2, a3), (b0, b1), (c0, c1, c2, c3)), _MMA_F16)
    return tuple(d[_lane()])


def mma_m16n8k16_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """``mma_m16n8k16_bf16(...)``: as ``mma_m16n8k16_f16`` with bf16 A and B (``...f32.bf16.bf16.f32``)."""
    d = _warp_gather(((a0, a1, a2, a3), (b0, b1), (c0, c1, c2, c3)), _MMA_BF16)
    return tuple(d[_lane()])


def _mma_lowering(ptx_type):
    text = (
        f"mma.sync.aligned.m16n8k16.row.col.f32.{ptx_type}.{ptx_type}.f32 "
        "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};"
    )

    @intrinsic
    def lowering(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        sig = types.UniTuple(types.float32, 4)(*([types.uint32] * 6 + [types.float32] * 4))

        def codegen(context, builder, sig, args):
            result = ir.LiteralStructType([_f32] * 4)
            out = _asm(builder, text, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", result, args)
            return _unpack_struct(context, builder, sig, out, 4)

        return sig, codegen

    return lowering


_bind(mma_m16n8k16_f16, _mma_lowering("f16"))
_bind(mma_m16n8k16_bf16, _mma_lowering("bf16"))


# --------------------------------------------------------------------------
# Shared-memory matrix loads
# --------------------------------------------------------------------------
# ldmatrix x4 loads four 8×8 matrices of 16-bit elements. Lanes 8i..8i+7 give
# the (row, col) of the eight 8-element rows of matrix i, each 16 bytes long
# and 16-byte aligned. Register i of lane l receives matrix i's elements
#   plain:  row group, columns 2·tig and 2·tig + 1     (an A or B fragment)
#   .trans: rows 2·tig and 2·tig + 1, column group     (the transpose's fragment)


def _pack_bits(lo, hi):
    return np.uint32(int(lo) | int(hi) << 16)


def ldmatrix_x4(tile, row, col):
    """``ldmatrix_x4(tile, row, col) -> (r0, r1, r2, r3)``: four 8×8 b16 matrices from shared ``tile``.

    ``tile`` is a 2-D uint16 shared-memory array; this lane names the row that
    starts at ``tile[row, col]``. Emits ``ldmatrix.sync.aligned.m8n8.x4.shared.b16``.
    """
    lanes = _warp_gather((tile, row, col))
    g, t = divmod(_lane(), 4)
    regs = []
    for i in range(4):
        src, r, c = lanes[8 * i + g]
        regs.append(_pack_bits(src[r, c + 2 * t], src[r, c + 2 * t + 1]))
    return tuple(regs)


def ldmatrix_x4_trans(tile, row, col):
    """``ldmatrix_x4_trans(tile, row, col)``: as ``ldmatrix_x4``, each matrix transposed (``.trans``)."""
    lanes = _warp_gather((tile, row, col))
    g, t = divmod(_lane(), 4)
    regs = []
    for i in range(4):
        src_lo, r_lo, c_lo = lanes[8 * i + 2 * t]
        src_hi, r_hi, c_hi = lanes[8 * i + 2 * t + 1]
        regs.append(_pack_bits(src_lo[r_lo, c_lo + g], src_hi[r_hi, c_hi + g]))
    return tuple(regs)


def _ldmatrix_lowering(variant):
    text = f"ldmatrix.sync.aligned.m8n8.x4{variant}.shared.b16 {{$0,$1,$2,$3}}, [$4];"

    @intrinsic
    def lowering(typingctx, tile, row, col):
        if not (isinstance(tile, types.Array) and tile.ndim == 2 and tile.dtype == types.uint16):
            return None
        sig = types.UniTuple(types.uint32, 4)(tile, row, col)

        def codegen(context, builder, sig, args):
            address = _shared_address(context, builder, sig.args[0], args[0], *zip(args[1:], sig.args[1:], strict=True))
            result = ir.LiteralStructType([_i32] * 4)
            out = _asm(builder, text, "=r,=r,=r,=r,r,~{memory}", result, [address], side_effect=True)
            return _unpack_struct(context, builder, sig, out, 4)

        return sig, codegen

    return lowering


_bind(ldmatrix_x4, _ldmatrix_lowering(""))
_bind(ldmatrix_x4_trans, _ldmatrix_lowering(".trans"))


def stmatrix_x4(tile, row, col, r0, r1, r2, r3):
    """``stmatrix_x4(tile, row, col, r0, r1, r2, r3)``: store four 8×8 b16 matrices.

    The inverse of ``ldmatrix_x4``: ``ri`` holds this lane's entries of matrix
    i in the mma fragment layout (row ``lane // 4``, columns ``2 (lane % 4)``
    and + 1); row j of matrix i is stored as the 8 elements from
    ``tile[row, col]`` of lane ``8 i + j``. ``tile`` is a 2-D uint16
    shared-memory array. Emits ``stmatrix.sync.aligned.m8n8.x4.shared.b16`` (sm_90).
    """
    lanes = _warp_gather((tile, row, col))
    g, t = divmod(_lane(), 4)
    for i, reg in enumerate((r0, r1, r2, r3)):
        dst, r, c = lanes[8 * i + g]
        for half in range(2):
            dst[r, c + 2 * t + half] = (int(reg) >> (16 * half)) & 0xFFFF
    _warp_gather(None)  # every lane's stores are done before any lane goes on


def stmatrix_x4_trans(tile, row, col, r0, r1, r2, r3):
    """``stmatrix_x4_trans(tile, row, col, r0, r1, r2, r3)``: store four 8×8 b16 matrices, each transposed.

    The inverse of ``ldmatrix_x4_trans``: ``ri`` holds this lane's entries of
    matrix i in the mma fragment layout (row ``lane // 4``, columns
    ``2 (lane % 4)`` and + 1); column j of matrix i is stored as the 8
    elements from ``tile[row, col]`` of lane ``8 i + j``. ``tile`` is a 2-D
    uint16 shared-memory array. Emits
    ``stmatrix.sync.aligned.m8n8.x4.trans.shared.b16`` (sm_90).
    """
    lanes = _warp_gather((tile, row, col))
    g, t = divmod(_lane(), 4)
    for i, reg in enumerate((r0, r1, r2, r3)):
        for half in range(2):
            dst, r, c = lanes[8 * i + 2 * t + half]
            dst[r, c + g] = (int(reg) >> (16 * half)) & 0xFFFF
    _warp_gather(None)  # every lane's stores are done before any lane goes on


def _stmatrix_lowering(variant):
    """The intrinsic of ``stmatrix.sync.aligned.m8n8.x4{variant}.shared.b16``."""
    text = f"stmatrix.sync.aligned.m8n8.x4{variant}.shared.b16 [$0], {{$1,$2,$3,$4}};"

    @intrinsic
    def lowering(typingctx, tile, row, col, r0, r1, r2, r3):
        if not (isinstance(tile, types.Array) and tile.ndim == 2 and tile.dtype == types.uint16):
            return None

        def codegen(context, builder, sig, args):
            address = _shared_address(context, builder, sig.args[0], args[0], *zip(args[1:3], sig.args[1:3], strict=True))
            regs = [context.cast(builder, v, t, types.uint32) for v, t in zip(args[3:], sig.args[3:], strict=True)]
            _asm(builder, text, "r,r,r,r,r,~{memory}", ir.VoidType(), [address, *regs], side_effect=True)
            return context.get_dummy_value()

        return types.none(tile, row, col, r0, r1, r2, r3), codegen

    return lowering


_bind(stmatrix_x4, _stmatrix_lowering(""))
_bind(stmatrix_x4_trans, _stmatrix_lowering(".trans"))
