"""Per-operation kernels of the kernel graph's unfused plan (CUDA cores, float32).

Every tensor is a 4-D float32 array (shapes padded with leading 1s); an operand
dimension of extent 1 broadcasts. Inputs are widened from their storage (fp16
and bf16 as 16-bit patterns) once, results narrowed once: intermediates stay in
float32, so an ``exp`` of scores that would overflow fp16 stays finite. One
thread per output element; these kernels are the fallback that makes any graph
run, not the fast path (the fused candidates are). ``cpu_op`` is the CPU path's
version of each operation, in numpy.
"""

import functools
import math

import numpy as np
from numba import float32

from .._cuda import cuda
from .ptx import cvt_f32_bf16, cvt_f32_f16, cvt_rn_bf16_f32, cvt_rn_f16_f32

THREADS = 256


def _unravel(i, shape):
    """(i0, i1, i2, i3) of flat index ``i`` in a C-ordered 4-D ``shape``."""
    i3 = i % shape[3]
    i //= shape[3]
    i2 = i % shape[2]
    i //= shape[2]
    return i // shape[1], i % shape[1], i2, i3


_unravel_gpu = cuda.jit(device=True, forceinline=True)(_unravel)


@cuda.jit(device=True, forceinline=True)
def _at(x, i0, i1, i2, i3):
    """``x`` at the broadcast position (extent-1 dims read index 0)."""
    return x[i0 if x.shape[0] > 1 else 0, i1 if x.shape[1] > 1 else 0,
             i2 if x.shape[2] > 1 else 0, i3 if x.shape[3] > 1 else 0]


def grid(n):
    return max(1, -(-n // THREADS))


@functools.lru_cache(maxsize=None)
def _convert_kernel(convert):
    """``kernel(src, dst)``: ``dst = convert(src)`` elementwise (a copy when ``convert`` is None)."""

    @cuda.jit
    def kernel(src, dst):
        i = cuda.grid(1)
        if i < dst.size:
            i0, i1, i2, i3 = _unravel_gpu(i, dst.shape)
            x = src[i0, i1, i2, i3]
            dst[i0, i1, i2, i3] = convert(x) if convert is not None else x

    return kernel


def widen_kernel(dtype):
    """``kernel(src, dst)``: ``dst`` (float32) = ``src`` (storage of ``dtype``, any strides)."""
    return _convert_kernel({"float16": cvt_f32_f16, "bfloat16": cvt_f32_bf16}.get(dtype))


def narrow_kernel(dtype):
    """``kernel(src, dst)``: ``dst`` (storage of ``dtype``) = ``src`` (float32), rounded to nearest."""
    return _convert_kernel({"float16": cvt_rn_f16_f32, "bfloat16": cvt_rn_bf16_f32}.get(dtype))


def _exp(x, _):
    return math.exp(x)


def _sqrt(x, _):
    return math.sqrt(x)


def _square(x, _):
    return x * x


def _silu(x, _):
    return x / (float32(1.0) + math.exp(-x))


def _scale(x, c):
    return x * c


def _add(a, b):
    return a + b


def _sub(a, b):
    return a - b


def _mul(a, b):
    return a * b


def _div(a, b):
    return a / b


_UNARY = {"exp": _exp, "sqrt": _sqrt, "square": _square, "silu": _silu, "mul_scalar": _scale}
_BINARY = {"add": _add, "sub": _sub, "mul": _mul, "div": _div}


def cpu_op(op, args, attrs, dim):
    """The CPU path's version of one graph operation on float32 numpy arrays (4-D, broadcasting):
    ``dim`` is the reduced axis of the 4-D arrays (the last for rms_norm)."""
    if op in _BINARY:
        return {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide}[op](*args)
    x = args[0]
    if op == "matmul":
        return np.matmul(x, args[1])
    if op == "mul_scalar":
        return x * np.float32(attrs["scalar"])
    if op == "exp":
        return np.exp(x)
    if op == "sqrt":
        return np.sqrt(x)
    if op == "square":
        return x * x
    if op == "silu":
        return x / (np.float32(1.0) + np.exp(-x))
    if op == "reduction":
        return x.sum(axis=dim, keepdims=True, dtype=np.float32)
    if op == "reduction_max":
        return x.max(axis=dim, keepdims=True)
    return x / np.sqrt(np.mean(x * x, axis=dim, keepdims=True, dtype=np.float32) + np.float32(attrs["eps"]))


@functools.lru_cache(maxsize=None)
def unary_kernel(op):
    """``kernel(x, out, c)``: ``out = op(x)`` elementwise (``c`` the scalar of ``mul_scalar``)."""
    f = cuda.jit(device=True, forceinline=True)(_UNARY[op])

    @cuda.jit
    def kernel(x, out, c):
        i = cuda.grid(1)
        if i < out.size:
            i0, i1, i2, i3 = _unravel_gpu(i, out.shape)
            out[i0, i1, i2, i3] = f(x[i0, i1, i2, i3], c)

    return kernel


@functools.lru_cache(maxsize=None)
def binary_kernel(op):
    """``kernel(a, b, out)``: ``out = a op b`` with numpy broadcasting."""
    f = cuda.jit(device=True, forceinline=True)(_BINARY[op])

    @cuda.jit
    def kernel(a, b, out):
        i = cuda.grid(1)
        if i < out.size:
            i0, i1, i2, i3 = _unravel_gpu(i, out.shape)
            out[i0, i1, i2, i3] = f(_at(a, i0, i1, i2, i3), _at(b, i0, i1, i2, i3))

    return kernel


@functools.lru_cache(maxsize=None)
def reduce_kernel(op, dim):
    """``kernel(x, out, eps)``: over ``dim``, "reduction" sums, "reduction_max" takes the maximum,
    "rms_norm" (``dim`` 3) writes ``x / sqrt(mean(x²) + eps)``; ``out`` keeps ``dim`` (extent 1)
    except for rms_norm, whose output has ``x``'s shape."""
    is_max, is_norm = op == "reduction_max", op == "rms_norm"

    @cuda.jit
    def kernel(x, out, eps):
        i = cuda.grid(1)
        rows = out.size if not is_norm else out.size // out.shape[3]
        if i < rows:
            shape = (out.shape[0], out.shape[1], out.shape[2], 1 if is_norm else out.shape[3])
            idx = _unravel_gpu(i, shape)
            n = x.shape[dim]
            total = -math.inf if is_max else float32(0.0)
            for r in range(n):
                j0 = r if dim == 0 else idx[0]
                j1 = r if dim == 1 else idx[1]
                j2 = r if dim == 2 else idx[2]
                j3 = r if dim == 3 else idx[3]
                value = x[j0, j1, j2, j3]
                if is_max:
                    total = max(total, value)
                elif is_norm:
                    total += value * value
                else:
                    total += value
            if is_norm:
                inv = float32(1.0) / math.sqrt(total / n + eps)
                for r in range(n):
                    out[idx[0], idx[1], idx[2], r] = x[idx[0], idx[1], idx[2], r] * inv
            else:
                out[idx[0], idx[1], idx[2], idx[3]] = total

    return kernel


@cuda.jit
def matmul_kernel(a, b, out):
    """``out[..., i, j] = Σ_k a[..., i, k] b[..., k, j]`` with broadcast batch dims."""
    i = cuda.grid(1)
    if i < out.size:
        i0, i1, r, c = _unravel_gpu(i, out.shape)
        a0, a1 = (i0 if a.shape[0] > 1 else 0), (i1 if a.shape[1] > 1 else 0)
        b0, b1 = (i0 if b.shape[0] > 1 else 0), (i1 if b.shape[1] > 1 else 0)
        total = float32(0.0)
        for k in range(a.shape[3]):
            total += a[a0, a1, r, k] * b[b0, b1, k, c]
        out[i0, i1, r, c] = total
