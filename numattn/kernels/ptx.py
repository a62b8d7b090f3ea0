"""PTX-level primitives for numattn kernels.

Each primitive is a plain-Python function whose body is its simulator twin
(it runs when kernels execute in numba's CUDA simulator), with its GPU
lowering registered directly below it through ``@overload(..., target="cuda")``.
Kernels call the public name and get the right one on either target.

16-bit floating-point values travel through kernels as ``uint16`` bit patterns:
numba's own fp16/bf16 arithmetic links NVRTC-compiled shims, and bf16 arrays
cannot live in shared or local memory. Kernels widen on load, accumulate in
fp32 and narrow on store with the conversions below.
"""

import numpy as np
from llvmlite import ir
from numba import types
from numba.cuda.extending import intrinsic, overload

# --------------------------------------------------------------------------
# Public surface: simulator twins
# --------------------------------------------------------------------------


def cvt_f32_f16(bits):
    """``cvt_f32_f16(bits) -> float32``: widen the fp16 value with bit pattern ``bits``.

    Emits ``cvt.f32.f16``. Exact.
    """
    return np.float32(np.uint16(bits).view(np.float16))


def cvt_f32_bf16(bits):
    """``cvt_f32_bf16(bits) -> float32``: widen the bf16 value with bit pattern ``bits``.

    bf16 is the upper half of an fp32, so this is ``bits << 16`` reinterpreted. Exact.
    """
    return (np.uint32(bits) << np.uint32(16)).view(np.float32)


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


def cvt_rn_bf16_f32(x):
    """``cvt_rn_bf16_f32(x) -> uint16``: bf16 bit pattern of ``x``, rounded to nearest even.

    Emits ``cvt.rn.bf16.f32`` (sm_80+). NaN becomes the canonical quiet NaN 0x7FFF.
    """
    bits = int(np.float32(x).view(np.uint32))
    if (bits & 0x7FFFFFFF) > 0x7F800000:
        return np.uint16(0x7FFF)
    rounding = 0x7FFF + ((bits >> 16) & 1)
    return np.uint16(((bits + rounding) >> 16) & 0xFFFF)


# --------------------------------------------------------------------------
# GPU lowerings
# --------------------------------------------------------------------------

_f32 = ir.FloatType()
_i16 = ir.IntType(16)
_i32 = ir.IntType(32)


@intrinsic
def _cvt_f32_f16(typingctx, bits):
    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), _f32)

    return types.float32(types.uint16), codegen


@intrinsic
def _cvt_f32_bf16(typingctx, bits):
    def codegen(context, builder, sig, args):
        widened = builder.shl(builder.zext(args[0], _i32), ir.Constant(_i32, 16))
        return builder.bitcast(widened, _f32)

    return types.float32(types.uint16), codegen


@intrinsic
def _cvt_rn_f16_f32(typingctx, x):
    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), _i16)

    return types.uint16(types.float32), codegen


@intrinsic
def _cvt_rn_bf16_f32(typingctx, x):
    def codegen(context, builder, sig, args):
        asm = ir.InlineAsm(ir.FunctionType(_i16, [_f32]), "cvt.rn.bf16.f32 $0, $1;", "=h,f")
        return builder.call(asm, [args[0]])

    return types.uint16(types.float32), codegen


def _lower_with(fn, lowering):
    """Register ``lowering`` as the GPU implementation of the twin ``fn``."""

    @overload(fn, target="cuda")
    def _gpu(x):
        def impl(x):
            return lowering(x)

        return impl


_lower_with(cvt_f32_f16, _cvt_f32_f16)
_lower_with(cvt_f32_bf16, _cvt_f32_bf16)
_lower_with(cvt_rn_f16_f32, _cvt_rn_f16_f32)
_lower_with(cvt_rn_bf16_f32, _cvt_rn_bf16_f32)
