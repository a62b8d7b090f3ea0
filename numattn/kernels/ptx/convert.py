"""Conversions between fp32 and 16-bit bit patterns, and two 16-bit values in one 32-bit register."""

import numpy as np
from llvmlite import ir
from numba import types
from numba.cuda.extending import intrinsic

from ._core import _asm, _asm_intrinsic, _bind, _f32, _i16, _i32, _ir_intrinsic

# --------------------------------------------------------------------------
# Conversions between fp32 and 16-bit bit patterns
# --------------------------------------------------------------------------


def cvt_f32_f16(bits):
    """``cvt_f32_f16(bits) -> float32``: widen the fp16 value with bit pattern ``bits``.

    Emits ``cvt.f32.f16``. Exact.
    """
    return np.float32(np.uint16(bits).view(np.float16))


def _widen_f16_ir(builder, bits):
    return builder.fpext(builder.bitcast(bits, ir.HalfType()), _f32)


_bind(cvt_f32_f16, _ir_intrinsic(_widen_f16_ir, types.float32(types.uint16)))


def cvt_f32_bf16(bits):
    """``cvt_f32_bf16(bits) -> float32``: widen the bf16 value with bit pattern ``bits``.

    bf16 is the upper half of an fp32, so this is ``bits << 16`` reinterpreted. Exact.
    """
    return (np.uint32(bits) << np.uint32(16)).view(np.float32)


def _widen_bf16_ir(builder, bits):
    return builder.bitcast(builder.shl(builder.zext(bits, _i32), ir.Constant(_i32, 16)), _f32)


_bind(cvt_f32_bf16, _ir_intrinsic(_widen_bf16_ir, types.float32(types.uint16)))


def cvt_rn_f16_f32(x):
    """``cvt_rn_f16_f32(x) -> uint16``: fp16 bit pattern of ``x``, rounded to nearest even.

    Emits ``cvt.rn.f16.f32``; overflows to ±inf as IEEE rounding does; NaN
    becomes the canonical NaN 0x7FFF.
    """
    x = np.float32(x)
    if np.isnan(x):
        return np.uint16(0x7FFF)
    with np.errstate(over="ignore"):
        return np.float16(x).view(np.uint16)


_bind(
    cvt_rn_f16_f32,
    _ir_intrinsic(lambda builder, x: builder.bitcast(builder.fptrunc(x, ir.HalfType()), _i16), types.uint16(types.float32)),
)


def cvt_rn_bf16_f32(x):
    """``cvt_rn_bf16_f32(x) -> uint16``: bf16 bit pattern of ``x``, rounded to nearest even.

    Emits ``cvt.rn.bf16.f32`` (sm_80+). NaN becomes the canonical quiet NaN 0x7FFF.
    """
    bits = int(np.float32(x).view(np.uint32))
    if (bits & 0x7FFFFFFF) > 0x7F800000:
        return np.uint16(0x7FFF)
    rounding = 0x7FFF + ((bits >> 16) & 1)
    return np.uint16(((bits + rounding) >> 16) & 0xFFFF)


_bind(cvt_rn_bf16_f32, _asm_intrinsic("cvt.rn.bf16.f32 $0, $1;", "=h,f", _i16, types.uint16(types.float32)))


# --------------------------------------------------------------------------
# Two 16-bit values in one 32-bit register
# --------------------------------------------------------------------------


def pack_f16x2(lo, hi):
    """``pack_f16x2(lo, hi) -> uint32``: both rounded to fp16, ``lo`` in bits 0–15.

    Emits ``cvt.rn.f16x2.f32``.
    """
    return np.uint32(int(cvt_rn_f16_f32(lo)) | int(cvt_rn_f16_f32(hi)) << 16)


def pack_bf16x2(lo, hi):
    """``pack_bf16x2(lo, hi) -> uint32``: both rounded to bf16, ``lo`` in bits 0–15.

    Emits ``cvt.rn.bf16x2.f32``.
    """
    return np.uint32(int(cvt_rn_bf16_f32(lo)) | int(cvt_rn_bf16_f32(hi)) << 16)


def _pack_lowering(ptx_type):
    @intrinsic
    def lowering(typingctx, lo, hi):
        def codegen(context, builder, sig, args):
            # the first source operand goes to the upper half
            return _asm(builder, f"cvt.rn.{ptx_type}.f32 $0, $1, $2;", "=r,f,f", _i32, [args[1], args[0]])

        return types.uint32(types.float32, types.float32), codegen

    return lowering


_bind(pack_f16x2, _pack_lowering("f16x2"))
_bind(pack_bf16x2, _pack_lowering("bf16x2"))


def unpack_f16x2(x):
    """``unpack_f16x2(x) -> (float32, float32)``: the fp16 values in bits 0–15 and 16–31. Exact."""
    x = int(x)
    return cvt_f32_f16(x & 0xFFFF), cvt_f32_f16(x >> 16)


def unpack_bf16x2(x):
    """``unpack_bf16x2(x) -> (float32, float32)``: the bf16 values in bits 0–15 and 16–31. Exact."""
    x = int(x)
    return cvt_f32_bf16(x & 0xFFFF), cvt_f32_bf16(x >> 16)


def _unpack_lowering(widen_half):
    @intrinsic
    def lowering(typingctx, x):
        def codegen(context, builder, sig, args):
            lo = builder.trunc(args[0], _i16)
            hi = builder.trunc(builder.lshr(args[0], ir.Constant(_i32, 16)), _i16)
            return context.make_tuple(builder, sig.return_type, [widen_half(builder, lo), widen_half(builder, hi)])

        return types.UniTuple(types.float32, 2)(types.uint32), codegen

    return lowering


_bind(unpack_f16x2, _unpack_lowering(_widen_f16_ir))
_bind(unpack_bf16x2, _unpack_lowering(_widen_bf16_ir))
