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
storage dtype (16-bit floats as uint16), but for the rows kernel's 16-bit ``o`` and ``do`` of a head
dim that is a multiple of 8: rows contiguous and 16-byte aligned, read in 16-byte chunks; gradients,
delta and lse2 are float32.
Causal masking is bottom-right: key j is visible to query i when ``j <= i + Skv - Sq``.

Packed sequences (``sequences.py``): the arrays are ``[1, heads, total, dim]``, the kernels take
``cu_seqlens_q`` and ``cu_seqlens_k`` last, a row finds its sequence by a binary search of them, and
``delta``, ``lse2`` hold sequence ``b``'s rows from ``padded_rows(cu_seqlens_q[b], b)`` on (zeros between).
"""

import functools
import math

from numba import float32

from .._cuda import cuda
from .constants import LOG2E, LOG2E_F32
from .ptx import cvt_f32_bf16, cvt_f32_f16, load_16, shfl_xor_f32, unpack_bf16x2, unpack_f16x2
from .score_mods import NO_MODS, score_gradient
from .sequences import DENSE, padded_rows, sequence_of, sequence_span


@functools.lru_cache(maxsize=None)
def backward_kernels(dtype, head_dim, head_dim_v, causal, mods=NO_MODS, sequences=DENSE):
    """``(rows, dq, dkdv)`` kernels; launch each with one thread per row (``rows_grid``; ``ROW_THREADS``
    per row for ``rows``): ``rows(o, do, lse, delta, lse2)`` over ``delta``'s rows, ``dq(q, k, v, do, lse2, delta, dq, scale,
    *mod_args)``, ``dkdv(q, k, v, do, lse2, delta, dk, dv, scale, *mod_args)``, ``mod_args`` the forward's
    ``alibi, sinks, left, right, cap_log2, cap_slope`` for the score modifications ``mods`` (``sinks`` unused:
    they are in lse2). ``lse`` is the forward's (natural log, ``[B, Hq, Sq]``); ``delta`` and ``lse2`` are
    ``[B, Hq, Sq′]``, ``Sq′ ≥ Sq``, rows past ``Sq`` set to 0. With packed ``sequences`` (the module docstring)
    the rows kernel covers the packed rows, ``rows(o, do, lse, delta, lse2, cu_seqlens_q)``, and the others
    take ``cu_seqlens_q, cu_seqlens_k`` last."""
    D, DV, CAUSAL, VARLEN = head_dim, head_dim_v, causal, sequences.varlen
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

    # 16-bit rows of whole 16-byte chunks are read a chunk (8 elements) per load: the host passes them
    # 16-byte aligned (``ops.backward._copyable_rows``)
    CHUNKS = widen is not None and DV % 8 == 0
    unpack = unpack_bf16x2 if dtype == "bfloat16" else unpack_f16x2

    @cuda.jit(device=True, forceinline=True)
    def row_sum(o, do, b, h, i, part, inside):
        """delta of row ``i``: ``ROW_THREADS`` neighbouring threads share it, reading neighbouring elements
        or chunks (coalesced); every lane of the warp takes part in the sum."""
        total = float32(0.0)
        if inside and CHUNKS:
            for d in range(8 * part, DV, 8 * ROW_THREADS):
                o_words, do_words = load_16(o, (b, h, i, d)), load_16(do, (b, h, i, d))
                for w in range(4):
                    o_lo, o_hi = unpack(o_words[w])
                    do_lo, do_hi = unpack(do_words[w])
                    total += o_lo * do_lo + o_hi * do_hi
        elif inside:
            for d in range(part, DV, ROW_THREADS):
                total += at(o, b, h, i, d) * at(do, b, h, i, d)
        for lanes in (1, 2, 4):
            total += shfl_xor_f32(total, lanes)
        return total

    @cuda.jit
    def rows_kernel(o, do, lse, delta, lse2):
        row, part = cuda.grid(1) // ROW_THREADS, cuda.grid(1) % ROW_THREADS
        heads, rows = delta.shape[1], delta.shape[2]
        b, h, i = row // (heads * rows), (row // rows) % heads, row % rows
        inside = row < delta.shape[0] * heads * rows and i < o.shape[2]
        total = row_sum(o, do, b, h, i, part, inside)
        if part == 0 and row < delta.shape[0] * heads * rows:
            delta[b, h, i] = total
            lse2[b, h, i] = lse[b, h, i] * LOG2E if inside else 0.0

    @cuda.jit
    def packed_rows_kernel(o, do, lse, delta, lse2, cu_q):
        # packed row t of head h, of sequence b, goes to row padded_rows(cu_q[b], b) + t - cu_q[b] (zeros between)
        row, part = cuda.grid(1) // ROW_THREADS, cuda.grid(1) % ROW_THREADS
        heads, total_q = o.shape[1], o.shape[2]
        h, t = row // total_q, row % total_q
        inside = row < heads * total_q
        total = row_sum(o, do, 0, h, t, part, inside)
        if part == 0 and inside:
            b = sequence_of(cu_q, t)
            q_row0, seqlen_q = sequence_span(cu_q, b, total_q)
            if 0 <= t - q_row0 < seqlen_q:  # rows of no sequence are left alone
                padded = padded_rows(q_row0, b) + t - q_row0
                delta[0, h, padded] = total
                lse2[0, h, padded] = lse[0, h, t] * LOG2E

    @cuda.jit(device=True, forceinline=True)
    def probability_and_gradient(q, k, v, do, lse2, delta, b, h, i, h_kv, j, lse_offset, distance, scale, terms):
        """``(P, dS)`` of query row ``i`` and key row ``j`` of ``[b]`` (lse2 and delta at row ``i + lse_offset``), the
        query's position among the keys ``distance`` after the key's."""
        x = scale * LOG2E * dot(q, b, h, i, k, b, h_kv, j, D)
        dp = dot(do, b, h, i, v, b, h_kv, j, DV)
        r = i + lse_offset
        if ELEMENTWISE:
            return gradient(x, dp, lse2[b, h, r], delta[b, h, r], float32(abs(distance)), terms)
        p = math.exp2(x - lse2[b, h, r])
        return p, p * (dp - delta[b, h, r])

    @cuda.jit(device=True, forceinline=True)
    def head_terms(alibi, b, h, left, right, cap_log2, cap_slope):
        return left, right, cap_log2, cap_slope, alibi[b, h] * LOG2E_F32 if ALIBI else float32(0.0)

    @cuda.jit(device=True, forceinline=True)
    def query_row(q, k, row, seqs):
        """``(inside, b, h, i, seqlen_q, seqlen_kv, at, q_row0, k_row0, lse_offset)`` of the dq kernel's ``row``:
        query ``i`` of sequence ``b``, head ``h``, at row ``q_row0 + i`` of ``q[at, h]`` and row ``q_row0 + i +
        lse_offset`` of ``lse2[at, h]``, its keys from row ``k_row0`` of ``k[at]``."""
        heads = q.shape[1]
        if VARLEN:
            cu_q, cu_k = seqs
            h, t = row // q.shape[2], row % q.shape[2]
            b = sequence_of(cu_q, t)
            q_row0, seqlen_q = sequence_span(cu_q, b, q.shape[2])
            k_row0, seqlen_kv = sequence_span(cu_k, b, k.shape[2])
            i = t - q_row0  # a row past every sequence is not inside
            return (row < heads * q.shape[2] and 0 <= i < seqlen_q, b, h, i, seqlen_q, seqlen_kv, 0, q_row0, k_row0,
                    padded_rows(q_row0, b) - q_row0)
        seqlen_q = q.shape[2]
        b, h, i = row // (heads * seqlen_q), (row // seqlen_q) % heads, row % seqlen_q
        return row < q.shape[0] * heads * seqlen_q, b, h, i, seqlen_q, k.shape[2], b, 0, 0, 0

    @cuda.jit(device=True, forceinline=True)
    def key_row(q, k, row, seqs):
        """``(inside, b, h_kv, j, seqlen_q, seqlen_kv, at, q_row0, k_row0, lse_offset)`` of the dkdv kernel's
        ``row``: key ``j`` of sequence ``b``, KV head ``h_kv`` (rows as ``query_row`` says)."""
        heads_kv = k.shape[1]
        if VARLEN:
            cu_q, cu_k = seqs
            h_kv, t = row // k.shape[2], row % k.shape[2]
            b = sequence_of(cu_k, t)
            q_row0, seqlen_q = sequence_span(cu_q, b, q.shape[2])
            k_row0, seqlen_kv = sequence_span(cu_k, b, k.shape[2])
            j = t - k_row0
            return (row < heads_kv * k.shape[2] and 0 <= j < seqlen_kv, b, h_kv, j, seqlen_q, seqlen_kv, 0, q_row0,
                    k_row0, padded_rows(q_row0, b) - q_row0)
        seqlen_kv = k.shape[2]
        b, h_kv, j = row // (heads_kv * seqlen_kv), (row // seqlen_kv) % heads_kv, row % seqlen_kv
        return row < k.shape[0] * heads_kv * seqlen_kv, b, h_kv, j, q.shape[2], seqlen_kv, b, 0, 0, 0

    @cuda.jit(device=True, forceinline=True)
    def dq_rows(q, k, v, do, lse2, delta, dq, scale, alibi, sinks, left, right, cap_log2, cap_slope, seqs):
        heads, heads_kv = q.shape[1], k.shape[1]
        inside, b, h, i, seqlen_q, seqlen_kv, a, q_row0, k_row0, lse_offset = query_row(q, k, cuda.grid(1), seqs)
        if inside:
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
                p, ds = probability_and_gradient(q, k, v, do, lse2, delta, a, h, q_row0 + i, h_kv, k_row0 + j,
                                                 lse_offset, position - j, scale, terms)
                for d in range(D):
                    acc[d] += ds * at(k, a, h_kv, k_row0 + j, d)
            for d in range(D):
                dq[a, h, q_row0 + i, d] = acc[d] * scale

    @cuda.jit(device=True, forceinline=True)
    def dkdv_rows(q, k, v, do, lse2, delta, dk, dv, scale, alibi, sinks, left, right, cap_log2, cap_slope, seqs):
        heads, heads_kv = q.shape[1], k.shape[1]
        inside, b, h_kv, j, seqlen_q, seqlen_kv, a, q_row0, k_row0, lse_offset = key_row(q, k, cuda.grid(1), seqs)
        if inside:
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
                    p, ds = probability_and_gradient(q, k, v, do, lse2, delta, a, h, q_row0 + i, h_kv, k_row0 + j,
                                                     lse_offset, i + diagonal - j, scale, terms)
                    for d in range(DV):
                        dv_acc[d] += p * at(do, a, h, q_row0 + i, d)
                    for d in range(D):
                        dk_acc[d] += ds * at(q, a, h, q_row0 + i, d)
            for d in range(D):
                dk[a, h_kv, k_row0 + j, d] = dk_acc[d] * scale
            for d in range(DV):
                dv[a, h_kv, k_row0 + j, d] = dv_acc[d]

    if VARLEN:
        def dq_kernel(q, k, v, do, lse2, delta, dq, scale, alibi, sinks, left, right, cap_log2, cap_slope, cu_seqlens_q,
                      cu_seqlens_k):
            dq_rows(q, k, v, do, lse2, delta, dq, scale, alibi, sinks, left, right, cap_log2, cap_slope,
                    (cu_seqlens_q, cu_seqlens_k))

        def dkdv_kernel(q, k, v, do, lse2, delta, dk, dv, scale, alibi, sinks, left, right, cap_log2, cap_slope,
                        cu_seqlens_q, cu_seqlens_k):
            dkdv_rows(q, k, v, do, lse2, delta, dk, dv, scale, alibi, sinks, left, right, cap_log2, cap_slope,
                      (cu_seqlens_q, cu_seqlens_k))

        return packed_rows_kernel, cuda.jit(dq_kernel), cuda.jit(dkdv_kernel)

    def dq_kernel(q, k, v, do, lse2, delta, dq, scale, alibi, sinks, left, right, cap_log2, cap_slope):
        dq_rows(q, k, v, do, lse2, delta, dq, scale, alibi, sinks, left, right, cap_log2, cap_slope, ())

    def dkdv_kernel(q, k, v, do, lse2, delta, dk, dv, scale, alibi, sinks, left, right, cap_log2, cap_slope):
        dkdv_rows(q, k, v, do, lse2, delta, dk, dv, scale, alibi, sinks, left, right, cap_log2, cap_slope, ())

    return rows_kernel, cuda.jit(dq_kernel), cuda.jit(dkdv_kernel)


THREADS = 128
ROW_THREADS = 8  # threads per row of the rows kernel


def rows_grid(rows, threads_per_row=1):
    """Blocks of ``THREADS`` threads covering ``rows`` rows of ``threads_per_row`` threads each."""
    return max(1, -(-rows * threads_per_row // THREADS))
