"""Backward of softmax attention on CUDA cores (FlashAttention-2's recomputation, no atomics).

With ``P = exp(scale · q kᵀ - lse)`` recomputed from the forward's log-sum-exp
and ``delta_i = Σ_d dO[i, d] O[i, d]``:

    dV_j = Σ_i P_ij dO_i          dS_ij = P_ij (dO_i · V_j - delta_i)
    dK_j = scale Σ_i dS_ij Q_i    dQ_i = scale Σ_j dS_ij K_j

Three kernels: ``rows`` (``ROW_THREADS`` threads per query row: delta, and the log-sum-exp
in the log2 domain, ``lse2``, for this and the tensor-core backward), ``dq``
(one thread per query row, looping over its visible keys) and ``dkdv`` (one
thread per key row of a key/value head, looping over every query row of every
query head in its group, so that a KV head's gradients sum its group without
atomics). Arrays are 4-D (batch, heads, seq, dim) with any strides, in the
storage dtype (16-bit floats as uint16); gradients, delta and lse2 are float32.
Causal masking is bottom-right: key j is visible to query i when ``j <= i + Skv - Sq``.
"""

import functools
import math

from numba import float32

from .._cuda import cuda
from .constants import LOG2E, LOG2E_F32
from .ptx import cvt_f32_bf16, cvt_f32_f16, shfl_xor_f32
from .score_mods import NO_MODS, score_gradient


@functools.lru_cache(maxsize=None)
def backward_kernels(dtype, head_dim, head_dim_v, causal, mods=NO_MODS):
    """``(rows, dq, dkdv)`` kernels; launch each with one thread per row (``rows_grid``; ``ROW_THREADS``
    per row for ``rows``): ``rows(o, do, lse, delta, lse2)`` over ``delta``'s rows, ``dq(q, k, v, do, lse2, delta, dq, scale,
    *mod_args)``, ``dkdv(q, k, v, do, lse2, delta, dk, dv, scale, *mod_args)``, ``mod_args`` the forward's
    ``alibi, sinks, left, right, cap_log2, cap_slope`` for the score modifications ``mods`` (``sinks`` unused:
    they are in lse2). ``lse`` is the forward's (natural log, ``[B, Hq, Sq]``); ``delta`` and ``lse2`` are
    ``[B, Hq, Sq′]``, ``Sq′ ≥ Sq``, rows past ``Sq`` set to 0."""
    D, DV, CAUSAL = head_dim, head_dim_v, causal
    WINDOW, ALIBI, ELEMENTWISE = mods.window, mods.alibi, mods.elementwise
    gradient = score_gradient(mods)
    widen = {"float16": cvt_f32_f16, "bfloat16": cvt_f32_bf16}.get(dtype)

    @cuda.jit(device=True, forceinline=True)
    def at(x, b, h, i, d):
        return widen(x[b, h, i, d]) if widen is not None else x[b, h, i, d]

    @cuda.jit(device=True, forceinline=True)
    def dot(x, bx, hx, ix, y, by, hy, iy, n):
        total = float32(0.0)
        for d in range(n):
            total += at(x, bx, hx, ix, d) * at(y, by, hy, iy, d)
        return total

    @cuda.jit
    def rows_kernel(o, do, lse, delta, lse2):
        # ROW_THREADS neighbouring threads share a row, reading neighbouring elements (coalesced)
        row, part = cuda.grid(1) // ROW_THREADS, cuda.grid(1) % ROW_THREADS
        heads, rows = delta.shape[1], delta.shape[2]
        b, h, i = row // (heads * rows), (row // rows) % heads, row % rows
        inside = row < delta.shape[0] * heads * rows and i < o.shape[2]
        total = float32(0.0)
        if inside:
            for d in range(part, DV, ROW_THREADS):
                total += at(o, b, h, i, d) * at(do, b, h, i, d)
        for lanes in (1, 2, 4):  # every lane of the warp takes part
            total += shfl_xor_f32(total, lanes)
        if part == 0 and row < delta.shape[0] * heads * rows:
            delta[b, h, i] = total
            lse2[b, h, i] = lse[b, h, i] * LOG2E if inside else 0.0

    @cuda.jit(device=True, forceinline=True)
    def probability_and_gradient(q, k, v, do, lse2, delta, b, h, i, h_kv, j, position, scale, terms):
        """``(P, dS)`` of query ``i`` (at ``position`` among the keys) and key ``j``."""
        x = scale * LOG2E * dot(q, b, h, i, k, b, h_kv, j, D)
        dp = dot(do, b, h, i, v, b, h_kv, j, DV)
        if ELEMENTWISE:
            return gradient(x, dp, lse2[b, h, i], delta[b, h, i], float32(abs(position - j)), terms)
        p = math.exp2(x - lse2[b, h, i])
        return p, p * (dp - delta[b, h, i])

    @cuda.jit(device=True, forceinline=True)
    def head_terms(alibi, b, h, left, right, cap_log2, cap_slope):
        return left, right, cap_log2, cap_slope, alibi[b, h] * LOG2E_F32 if ALIBI else float32(0.0)

    @cuda.jit
    def dq_kernel(q, k, v, do, lse2, delta, dq, scale, alibi, sinks, left, right, cap_log2, cap_slope):
        row = cuda.grid(1)
        heads, seqlen_q, heads_kv, seqlen_kv = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
        if row < q.shape[0] * heads * seqlen_q:
            b, h, i = row // (heads * seqlen_q), (row // seqlen_q) % heads, row % seqlen_q
            h_kv = h // (heads // heads_kv)
            terms = head_terms(alibi, b, h, left, right, cap_log2, cap_slope)
            acc = cuda.local.array(D, float32)
            for d in range(D):
                acc[d] = 0.0
            position = i + seqlen_kv - seqlen_q
            first, end = 0, min(seqlen_kv, position + 1) if CAUSAL else seqlen_kv
            if WINDOW:
                first, end = max(0, position - left), min(end, position + right + 1)
            for j in range(first, end):
                p, ds = probability_and_gradient(q, k, v, do, lse2, delta, b, h, i, h_kv, j, position, scale, terms)
                for d in range(D):
                    acc[d] += ds * at(k, b, h_kv, j, d)
            for d in range(D):
                dq[b, h, i, d] = acc[d] * scale

    @cuda.jit
    def dkdv_kernel(q, k, v, do, lse2, delta, dk, dv, scale, alibi, sinks, left, right, cap_log2, cap_slope):
        row = cuda.grid(1)
        heads, seqlen_q, heads_kv, seqlen_kv = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
        if row < k.shape[0] * heads_kv * seqlen_kv:
            b, h_kv, j = row // (heads_kv * seqlen_kv), (row // seqlen_kv) % heads_kv, row % seqlen_kv
            group = heads // heads_kv
            dk_acc = cuda.local.array(D, float32)
            dv_acc = cuda.local.array(DV, float32)
            for d in range(D):
                dk_acc[d] = 0.0
            for d in range(DV):
                dv_acc[d] = 0.0
            diagonal = seqlen_kv - seqlen_q
            first, end = max(0, j - diagonal) if CAUSAL else 0, seqlen_q
            if WINDOW:  # the rows whose window holds key j
                first, end = max(first, j - right - diagonal), min(end, j + left - diagonal + 1)
            for h in range(h_kv * group, (h_kv + 1) * group):
                terms = head_terms(alibi, b, h, left, right, cap_log2, cap_slope)
                for i in range(first, end):
                    p, ds = probability_and_gradient(q, k, v, do, lse2, delta, b, h, i, h_kv, j, i + diagonal, scale,
                                                     terms)
                    for d in range(DV):
                        dv_acc[d] += p * at(do, b, h, i, d)
                    for d in range(D):
                        dk_acc[d] += ds * at(q, b, h, i, d)
            for d in range(D):
                dk[b, h_kv, j, d] = dk_acc[d] * scale
            for d in range(DV):
                dv[b, h_kv, j, d] = dv_acc[d]

    return rows_kernel, dq_kernel, dkdv_kernel


THREADS = 128
ROW_THREADS = 8  # threads per row of the rows kernel


def rows_grid(rows, threads_per_row=1):
    """Blocks of ``THREADS`` threads covering ``rows`` rows of ``threads_per_row`` threads each."""
    return max(1, -(-rows * threads_per_row // THREADS))
