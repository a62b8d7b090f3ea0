"""Fused attention forward on CUDA cores (the SIMT backend).

One thread block computes ``BLOCK_M`` query rows of one (batch, query head):
the Q tile is loaded once into shared memory (pre-scaled by ``scale·log2 e``),
then K/V tiles of ``BLOCK_N`` keys stream through shared memory while an online
softmax keeps, per row, the running max ``m_i``, the running sum ``l_i`` and the
unnormalised output ``acc`` in registers. Scores live in the log2 domain so that
``exp2`` is the only transcendental.

Threads form a ``THREADS_M × THREADS_N`` grid. Thread ``(tm, tn)`` owns rows
``tm + i·THREADS_M`` (``i < ROWS``); of each score tile it computes columns
``tn + j·THREADS_N`` (``j < COLS``), and of the output columns
``tn + j·THREADS_N`` (``j < VCOLS``). Row maxima are combined through shared
memory; each thread keeps a partial ``l_i`` over its own columns, and the
partials are summed once, in the epilogue.

Causal masking is bottom-right aligned: row ``i`` sees key ``j`` when
``j <= i + seqlen_kv - seqlen_q``. Key tiles entirely past the diagonal (or outside a window) are not
visited; a row that sees no key writes 0 and an LSE of ``-inf``. A NaN score makes its row's
output and LSE NaN: ``exp2`` turns it into a NaN row sum, whether or not the row max took it.
"""

import functools
import math

import numpy as np
from numba import float32

from .._cuda import cuda
from .constants import LN2_F32, LOG2E_F32
from .score_mods import NO_MODS, window_span
from .sequences import DENSE, block_locator, forward_kernel, source_row
from .tiles import NARROW, WIDEN, row_of_batch, tile_view

_NEG_INF = np.float32(-np.inf)
_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)


def _cdiv(a, b):
    return -(-a // b)


@functools.lru_cache(maxsize=None)
def simt_attention_kernel(config, dtype, head_dim, head_dim_v, causal, write_lse, mods=NO_MODS, sequences=DENSE):
    """Numba kernel ``kernel(q, k, v, o, lse, scale_log2, alibi, sinks, left, right, cap_log2, cap_slope)``
    for one specialisation.

    ``q`` (B, Hq, Sq, D), ``k`` (B, Hkv, Skv, D), ``v`` (B, Hkv, Skv, Dv) and
    ``o`` (B, Hq, Sq, Dv) are strided 4-D arrays of the storage dtype,
    ``lse`` (B, Hq, Sq) float32 (unused unless ``write_lse``), ``scale_log2``
    the softmax scale times log2(e), float32; the score modifications ``mods`` and the arguments after
    ``scale_log2`` as ``score_mods.py`` says; the sequence layout ``sequences`` (varlen and paged arguments
    after the others) as ``sequences.py`` says. Launch with
    ``cdiv(Sq, block_m) · B · Hq`` blocks of ``num_threads`` threads and
    ``config.shared_bytes(D, Dv)`` bytes of dynamic shared memory.
    """
    BLOCK_M, BLOCK_N = config.block_m, config.block_n
    NUM_THREADS, THREADS_N = config.num_threads, config.threads_n
    THREADS_M = NUM_THREADS // THREADS_N
    ROWS = BLOCK_M // THREADS_M
    COLS = BLOCK_N // THREADS_N
    VCOLS = _cdiv(head_dim_v, THREADS_N)
    D, DV, DV_PAD = head_dim, head_dim_v, VCOLS * THREADS_N
    # Rows of the Q, K and P tiles are padded by one word so that a warp
    # reading one column of several rows hits distinct banks.
    QK_ROW, P_ROW = D + 1, BLOCK_N + 1
    Q_OFF = 0
    K_OFF = Q_OFF + BLOCK_M * QK_ROW
    V_OFF = K_OFF + BLOCK_N * QK_ROW
    P_OFF = V_OFF + BLOCK_N * DV_PAD
    X_OFF = P_OFF + BLOCK_M * P_ROW
    CAUSAL, WRITE_LSE = causal, write_lse
    WINDOW, SOFTCAP, ALIBI, SINKS = mods.window, mods.softcap, mods.alibi, mods.sinks
    VARLEN = sequences.varlen
    locate = block_locator(sequences)
    widen, narrow = WIDEN[dtype], NARROW[dtype]

    def tile_loader(source):
        @cuda.jit(device=True)
        def load_tile(dst, src, at, h, row0, nrows, ncols, scale):
            """dst[r, c] = scale · src[a, h, row, c] for ``(a, row) = source(at, row0 + r)``; rows or columns out
            of range read 0."""
            rows, cols = dst.shape
            for idx in range(cuda.threadIdx.x, rows * cols, NUM_THREADS):
                r = idx // cols
                c = idx - r * cols
                value = _ZERO
                if row0 + r < nrows and c < ncols:
                    a, row = source(at, row0 + r)
                    value = widen(src[a, h, row, c]) * scale
                dst[r, c] = value

        return load_tile

    load_tile, load_kv_tile = tile_loader(row_of_batch), tile_loader(source_row(sequences))

    @cuda.jit(device=True, forceinline=True)
    def attend(q, k, v, o, lse, scale_log2, alibi, sinks, left, right, cap_log2, cap_slope, seqs, parts,
               maps):  # no tensor copies: maps ()
        b, h, h_kv, m0, n_end, seqlen_q, seqlen_kv, q_at, q_row0, kv_at, k_row0 = locate(q, v, seqs, BLOCK_M, CAUSAL,
                                                                                         cuda.blockIdx.x, cuda.gridDim.x)
        if VARLEN and m0 < 0:
            return  # past the sequence's rows
        smem = cuda.shared.array(0, float32)
        q_s = tile_view(smem, Q_OFF, BLOCK_M, QK_ROW)
        k_s = tile_view(smem, K_OFF, BLOCK_N, QK_ROW)
        v_s = tile_view(smem, V_OFF, BLOCK_N, DV_PAD)
        p_s = tile_view(smem, P_OFF, BLOCK_M, P_ROW)
        x_s = tile_view(smem, X_OFF, BLOCK_M, THREADS_N)  # per-thread row partials

        diagonal = seqlen_kv - seqlen_q
        first = 0
        if WINDOW:
            first, n_end = window_span(m0, BLOCK_M, diagonal, seqlen_kv, left, right)
        slope_log2 = alibi[b, h] * LOG2E_F32 if ALIBI else _ZERO

        tn = cuda.threadIdx.x % THREADS_N
        tm = cuda.threadIdx.x // THREADS_N

        load_tile(q_s, q, q_at, h, q_row0 + m0, q_row0 + seqlen_q, D, scale_log2)

        m_i = cuda.local.array(ROWS, float32)
        l_i = cuda.local.array(ROWS, float32)
        acc = cuda.local.array((ROWS, VCOLS), float32)
        s = cuda.local.array((ROWS, COLS), float32)
        for i in range(ROWS):
            m_i[i] = sinks[h] * LOG2E_F32 if SINKS else _NEG_INF  # a sink counts once, in column thread 0's sum
            l_i[i] = _ONE if SINKS and tn == 0 else _ZERO
            for j in range(VCOLS):
                acc[i, j] = _ZERO

        for n0 in range(first, n_end, BLOCK_N):
            cuda.syncthreads()  # the previous tile is no longer read
            load_kv_tile(k_s, k, kv_at, h_kv, k_row0 + n0, k_row0 + seqlen_kv, D, _ONE)
            load_kv_tile(v_s, v, kv_at, h_kv, k_row0 + n0, k_row0 + seqlen_kv, DV, _ONE)
            cuda.syncthreads()

            # S = Q Kᵀ (log2 domain)
            for i in range(ROWS):
                for j in range(COLS):
                    s[i, j] = _ZERO
            for d in range(D):
                for i in range(ROWS):
                    q_val = q_s[tm + i * THREADS_M, d]
                    for j in range(COLS):
                        s[i, j] += q_val * k_s[tn + j * THREADS_N, d]

            # modify the scores, mask keys past the sequence end, the diagonal or the window, partial row max
            for i in range(ROWS):
                position = m0 + tm + i * THREADS_M + diagonal
                row_max = _NEG_INF
                for j in range(COLS):
                    col = n0 + tn + j * THREADS_N
                    if SOFTCAP:  # libdevice's tanh: this kernel is float32's, where ex2 and rcp approximations show
                        s[i, j] = cap_log2 * math.tanh(s[i, j] / cap_log2)
                    if ALIBI:
                        s[i, j] -= slope_log2 * float32(abs(position - col))
                    if col >= seqlen_kv or (CAUSAL and col > position):
                        s[i, j] = _NEG_INF
                    if WINDOW and not position - left <= col <= position + right:
                        s[i, j] = _NEG_INF
                    row_max = max(row_max, s[i, j])
                x_s[tm + i * THREADS_M, tn] = row_max
            cuda.syncthreads()

            # online softmax: new max, rescale, P = exp2(S - m)
            for i in range(ROWS):
                r = tm + i * THREADS_M
                m_new = m_i[i]
                for c in range(THREADS_N):
                    m_new = max(m_new, x_s[r, c])
                # a row with no visible key yet keeps m = -inf; exp2 against 0 then gives 0
                m_ref = m_new if m_new != _NEG_INF else _ZERO
                alpha = math.exp2(m_i[i] - m_ref)
                m_i[i] = m_new
                l_i[i] *= alpha
                for j in range(VCOLS):
                    acc[i, j] *= alpha
                for j in range(COLS):
                    p = math.exp2(s[i, j] - m_ref)
                    l_i[i] += p
                    p_s[r, tn + j * THREADS_N] = p
            cuda.syncthreads()

            # acc += P V
            for n in range(BLOCK_N):
                for i in range(ROWS):
                    p = p_s[tm + i * THREADS_M, n]
                    for j in range(VCOLS):
                        acc[i, j] += p * v_s[n, tn + j * THREADS_N]

        # epilogue: full row sums from the per-thread partials, then O = acc / l
        for i in range(ROWS):
            x_s[tm + i * THREADS_M, tn] = l_i[i]
        cuda.syncthreads()
        for i in range(ROWS):
            r = tm + i * THREADS_M
            row = m0 + r
            if row < seqlen_q:
                l_sum = _ZERO
                for c in range(THREADS_N):
                    l_sum += x_s[r, c]
                inv_l = _ONE / l_sum if l_sum != _ZERO else _ZERO  # NaN scores leave l NaN: the row is NaN
                for j in range(VCOLS):
                    col = tn + j * THREADS_N
                    if col < DV:
                        o[q_at, h, q_row0 + row, col] = narrow(acc[i, j] * inv_l)
                if WRITE_LSE and tn == 0:
                    lse[q_at, h, q_row0 + row] = (m_i[i] + math.log2(l_sum)) * LN2_F32 if l_sum != _ZERO else _NEG_INF

    kernel = forward_kernel(attend, sequences)

    return cuda.jit(kernel)
