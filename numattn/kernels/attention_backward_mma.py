"""Backward of softmax attention on tensor cores: FlashAttention-2's schedule with ``mma.sync`` m16n8k16.

A block owns ``block_n = 16 · num_warps`` keys of one (batch, key/value head);
warp ``w`` owns keys ``16w .. 16w + 16`` and keeps their dK and dV rows in
registers for the whole kernel. The block visits every query tile
(``block_m`` rows) of every query head in the KV head's group that sees its
keys, so a KV head's dK and dV sum its group without atomics. Per query tile
each warp computes, for its keys (``lse₂`` the log-sum-exp in the log2 domain,
``delta_i = Σ_d dO[i, d] O[i, d]``):

    Sᵀ = K Qᵀ      Pᵀ = exp2(scale·log2(e) · Sᵀ − lse₂)      dPᵀ = V dOᵀ
    dSᵀ = Pᵀ ∘ (dPᵀ − delta)      dV += Pᵀ dO      dK += dSᵀ Q

Pᵀ and dSᵀ become A fragments without leaving registers (an accumulator
fragment pair is an A fragment, as in the forward). dSᵀ also goes to shared
memory, where the block's warps, split by query rows and head-dim columns,
compute the tile's ``dQ = dS K`` and add it to a float32 accumulator in global
memory with atomic adds (blocks of other key tiles add to the same rows).

Q and dO tiles, with their rows of ``lse₂`` and ``delta``, stream through a ring
of ``cp.async`` stages; K and V are copied once. Shared-memory rows of 16-bit
tiles are padded by 8 elements (conflict-free ``ldmatrix``). Keys past the
sequence end and, under causal masking, keys after a query's diagonal get
``P = 0``. Query rows past the end are zero-filled Q and dO rows: they add
nothing to dK or dV and their dQ rows are not written.
"""

import functools

import numpy as np
from numba import float32, int32, int64, uint16, uint32

from .._cuda import cuda
from .constants import LOG2E_F32
from .fragments import ldmatrix_lane, load_a, load_a_trans, load_b, load_b_trans
from .ptx import (
    copy_16_to_global,
    cp_async_16,
    cp_async_commit,
    cp_async_wait_group,
    ex2_approx,
    ld_shared_v2_f32,
    mma_m16n8k16_bf16,
    mma_m16n8k16_f16,
    pack_bf16x2,
    pack_f16x2,
    st_shared_b32,
    syncwarp,
)
from .score_mods import NO_MODS, crosses_window, score_gradient, window_queries
from .sequences import DENSE, backward_kernel, key_block_locator
from .tiles import PAD, row_major_cell, tile_copier, tile_view

_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)
_NEG_INF = np.float32(-np.inf)


@functools.lru_cache(maxsize=None)
def gradient_steps(mtiles, causal, dtype, num_threads, mods=NO_MODS, first_copier=0):
    """Device functions ``(copy_rows, to_gradients, add_dq)`` shared by the tensor-core backward
    kernels whose copies are issued by ``num_threads`` threads from thread ``first_copier`` on, for a warp's
    accumulator tiles (mma.sync's layout:
    entry ``e`` of n8 tile ``n`` is row ``g + 8·(e // 2)``, column ``8n + 2t + e % 2`` of the warp's 16
    rows; the scores ``s[0, n, e]`` over ``mtiles`` n8 tiles of query columns), with the score
    modifications ``mods`` (``score_mods.py``)."""
    MTILES, CAUSAL, NUM_THREADS, FIRST_COPIER = mtiles, causal, num_threads, first_copier
    WINDOW, ELEMENTWISE = mods.window, mods.elementwise
    gradient = score_gradient(mods)
    ROW_CHUNKS = 2 * mtiles  # 16-byte chunks of a query tile's lse2 (or delta) row

    @cuda.jit(device=True, forceinline=True)
    def copy_rows(rows, lse2, delta, b, h, m0):
        """Issue the copies of query tile ``m0``'s lse2 and delta (rows past the end: the arrays' zero padding)
        into ``rows[0]`` and ``rows[1]``."""
        for i in range(cuda.threadIdx.x - FIRST_COPIER, 2 * ROW_CHUNKS, NUM_THREADS):
            c = 4 * (i % ROW_CHUNKS)
            if i < ROW_CHUNKS:
                cp_async_16(rows, 0, c, lse2, (b, h, m0 + c), 16)
            else:
                cp_async_16(rows, 1, c, delta, (b, h, m0 + c), 16)

    @cuda.jit(device=True, forceinline=True)
    def column_rows(rows, n, t):
        """The lse2 pair and the delta pair of query columns ``8n + 2t`` and ``8n + 2t + 1`` (a thread's columns
        of n8 tile ``n``), each in one 8-byte load."""
        return ld_shared_v2_f32(rows, 0, 8 * n + 2 * t), ld_shared_v2_f32(rows, 1, 8 * n + 2 * t)

    @cuda.jit(device=True, forceinline=True)
    def to_gradients(s, dp, rows, scale_log2, masked, key0, m0, seqlen_kv, diagonal, g, t, terms):
        """Sᵀ into Pᵀ and dPᵀ into dSᵀ, in place, for the warp's keys ``key0 + 0..15`` and the query tile
        ``m0`` (``rows[0]``, ``rows[1]``: its lse2 and delta, in shared memory), modified by ``terms``
        (``(left, right, cap_log2, cap_slope, slope_log2)``). When ``masked``, keys past the end, after a
        query's causal diagonal or outside its window get P = 0."""
        offset = float32(m0 + diagonal + 2 * t) - float32(key0 + g)  # ALiBi's distances, as in the forward
        # two passes: with the mask test inside, every tile would run it as predicated code. Entries e and e + 2
        # share query column 8n + 2t + e % 2, whose lse2 and delta each n8 tile loads once.
        if masked:
            # In 32 bits (positions stay below 2^31): entry (n, e) has key − position = lag − step(n, e), with
            # step a constant of the unrolled loop, and is a key iff 8 (e // 2) < keys_left.
            lag = int32(key0 + g - (m0 + 2 * t + diagonal))
            keys_left = int32(seqlen_kv - (key0 + g))
            for n in range(MTILES):
                lse2_pair, delta_pair = column_rows(rows, n, t)
                for e in range(4):
                    lse2, delta = (lse2_pair[1], delta_pair[1]) if e % 2 else (lse2_pair[0], delta_pair[0])
                    step = 8 * n + e % 2 - 8 * (e // 2)  # a constant of the unrolled loop
                    ahead = lag - int32(step)  # key − position
                    visible = int32(8 * (e // 2)) < keys_left
                    if CAUSAL:
                        visible &= ahead <= int32(0)
                    if WINDOW:
                        visible &= (ahead >= -int32(terms[0])) & (ahead <= int32(terms[1]))
                    if ELEMENTWISE:  # a masked score may be anything: the gradient is selected, not scaled
                        distance = abs(offset + float32(step))
                        p, ds = gradient(s[0, n, e] * scale_log2, dp[0, n, e], lse2, delta, distance, terms)
                        s[0, n, e] = p if visible else _ZERO
                        dp[0, n, e] = ds if visible else _ZERO
                    else:
                        # the exponent selected, not the exponential: one unpredicated ex2 per entry
                        p = ex2_approx(s[0, n, e] * scale_log2 - lse2 if visible else _NEG_INF)
                        s[0, n, e] = p
                        dp[0, n, e] = p * (dp[0, n, e] - delta)
        elif ELEMENTWISE:
            for n in range(MTILES):
                lse2_pair, delta_pair = column_rows(rows, n, t)
                for e in range(4):
                    lse2, delta = (lse2_pair[1], delta_pair[1]) if e % 2 else (lse2_pair[0], delta_pair[0])
                    distance = abs(offset + float32(8 * n + e % 2 - 8 * (e // 2)))
                    s[0, n, e], dp[0, n, e] = gradient(s[0, n, e] * scale_log2, dp[0, n, e], lse2, delta, distance,
                                                       terms)
        else:  # written out, not through ``gradient``: the bf16 D128 wgmma kernel then spills 4 bytes fewer
            for n in range(MTILES):
                lse2_pair, delta_pair = column_rows(rows, n, t)
                for e in range(4):
                    lse2, delta = (lse2_pair[1], delta_pair[1]) if e % 2 else (lse2_pair[0], delta_pair[0])
                    p = ex2_approx(s[0, n, e] * scale_log2 - lse2)
                    s[0, n, e] = p
                    dp[0, n, e] = p * (dp[0, n, e] - delta)

    @cuda.jit(device=True, forceinline=True)
    def add_dq(dq, acc, mt, tiles, b, h, row0, col0, seqlen_q, scale, g, t):
        """Atomically add ``scale ·`` the ``tiles`` accumulator tiles of m16 tile ``mt`` (queries
        ``row0 + 0..15``, columns from ``col0``) to ``dq[b, h]``, rows below ``seqlen_q``."""
        for half in range(2):
            row = row0 + g + 8 * half
            if row < seqlen_q:
                for n in range(tiles):
                    col = col0 + 8 * n + 2 * t
                    cuda.atomic.add(dq, (b, h, row, col), acc[mt, n, 2 * half] * scale)
                    cuda.atomic.add(dq, (b, h, row, col + 1), acc[mt, n, 2 * half + 1] * scale)

    return copy_rows, to_gradients, add_dq


@functools.lru_cache(maxsize=None)
def backward_mma_kernel(config, dtype, head_dim, head_dim_v, causal, mods=NO_MODS, sequences=DENSE):
    """Numba kernel ``kernel(q, k, v, do, lse2, delta, dq, dk, dv, scale, scale_log2, alibi, sinks, left, right,
    cap_log2, cap_slope)``, the score modifications ``mods`` and their arguments as the forward's (the sinks
    are in lse2 already: ``sinks`` is unused); with packed sequences (``sequences``, ``sequences.py``)
    ``cu_seqlens_q`` and ``cu_seqlens_k`` follow.

    ``q, k, v, do``: 4-D (batch, heads, seq, dim) uint16 bit patterns with a
    contiguous last axis and 16-byte aligned rows; ``lse2``, ``delta``: float32
    ``[B, Hq, Sq′]`` with ``Sq′`` a multiple of ``block_m`` (``lse2`` the
    log-sum-exp times log2(e)); ``dq``: float32 ``[B, Hq, Sq, D]``, zeroed,
    to which the kernel adds ``scale · dS K``; ``dk``, ``dv``: ``[B, Hkv, Skv,
    D or Dv]`` in the inputs' storage dtype, written. Launch with ``cdiv(Skv, block_n) · B ·
    Hkv`` blocks of ``num_threads`` threads and ``config.shared_bytes(D, Dv)``
    bytes of dynamic shared memory.
    """
    BLOCK_M, BLOCK_N, NUM_THREADS, STAGES = config.block_m, config.block_n, config.num_threads, config.stages
    D, DV, CAUSAL = head_dim, head_dim_v, causal
    KSTEPS, VSTEPS = D // 16, DV // 16  # k-steps of Sᵀ = K Qᵀ and dPᵀ = V dOᵀ
    MTILES = BLOCK_M // 8  # n8 tiles of Sᵀ and dPᵀ: the tile's query columns
    MSTEPS = BLOCK_M // 16  # k-steps of dV += Pᵀ dO and dK += dSᵀ Q
    DTILES, DVTILES = D // 8, DV // 8
    NSTEPS = BLOCK_N // 16  # k-steps of dQ = dS K
    ROW_WARPS, COL_WARPS = config.dq_warps
    DQ_MTILES = BLOCK_M // 16 // ROW_WARPS  # m16 tiles of dQ per warp
    DQ_COLS = D // COL_WARPS  # head-dim columns of dQ per warp
    DQ_TILES = DQ_COLS // 8
    K_ROW, V_ROW, Q_ROW, DO_ROW, DS_ROW = D + PAD, DV + PAD, D + PAD, DV + PAD, BLOCK_M + PAD
    V_OFF = BLOCK_N * K_ROW
    DS_OFF = V_OFF + BLOCK_N * V_ROW
    Q_OFF = DS_OFF + BLOCK_N * DS_ROW
    Q_STAGE, DO_STAGE = BLOCK_M * Q_ROW, BLOCK_M * DO_ROW
    DO_OFF = Q_OFF + STAGES * Q_STAGE
    ROWS_OFF = (DO_OFF + STAGES * DO_STAGE) // 2  # float32 elements: per stage, rows of lse2 and delta
    IN_FLIGHT = STAGES - 1
    mma = mma_m16n8k16_bf16 if dtype == "bfloat16" else mma_m16n8k16_f16
    pack = pack_bf16x2 if dtype == "bfloat16" else pack_f16x2
    copy_tile = tile_copier(NUM_THREADS, row_major_cell)
    copy_rows, to_gradients, add_dq = gradient_steps(MTILES, causal, dtype, NUM_THREADS, mods)
    WINDOW, ALIBI = mods.window, mods.alibi
    VARLEN = sequences.varlen
    locate = key_block_locator(sequences)

    @cuda.jit(device=True, forceinline=True)
    def mma_into(c, mt, n, a0, a1, a2, a3, b0, b1):
        """``c[mt, n] += A·B``: accumulator tile ``n`` of m16 tile ``mt``."""
        c[mt, n, 0], c[mt, n, 1], c[mt, n, 2], c[mt, n, 3] = mma(
            a0, a1, a2, a3, b0, b1, c[mt, n, 0], c[mt, n, 1], c[mt, n, 2], c[mt, n, 3]
        )

    @cuda.jit(device=True, forceinline=True)
    def keys_times_queries(c, keys_s, queries_s, steps, key0, mat, mrow):
        """``c[0] += X Yᵀ`` over ``steps`` k-steps: A fragments of the warp's 16 rows of ``keys_s`` (from
        ``key0``), B fragments of two n8 tiles of ``queries_s`` rows per ``ldmatrix``."""
        for ks in range(steps):
            a0, a1, a2, a3 = load_a(keys_s, key0, 16 * ks, mat, mrow, False)
            for np2 in range(MTILES // 2):
                b0, b1, b2, b3 = load_b(queries_s, 16 * np2, 16 * ks, mat, mrow, False)
                mma_into(c, int64(0), 2 * np2, a0, a1, a2, a3, b0, b1)
                mma_into(c, int64(0), 2 * np2 + 1, a0, a1, a2, a3, b2, b3)

    @cuda.jit(device=True, forceinline=True)
    def fragment(a, c, kk):
        """A fragment of k-step ``kk`` from accumulator tiles ``2kk`` and ``2kk + 1``, into ``a[0..3]`` (one
        k-step at a time: at 255 registers there is no room for all of them, as the wgmma kernel keeps)."""
        n = 2 * kk
        a[0] = pack(c[0, n, 0], c[0, n, 1])
        a[1] = pack(c[0, n, 2], c[0, n, 3])
        a[2] = pack(c[0, n + 1, 0], c[0, n + 1, 1])
        a[3] = pack(c[0, n + 1, 2], c[0, n + 1, 3])

    @cuda.jit(device=True, forceinline=True)
    def store_staged(dst, acc, tiles, v_s, at, h, row0, nrows, scale, key0, g, t, lane):
        """``scale ·`` the warp's 16 rows of a key block's gradient (``acc``, ``tiles`` n8 tiles) into rows
        ``row0 + key0 ..`` of ``dst[at, h]`` below ``nrows``, ``DV`` columns at a time through the warp's own
        rows of the V tile (which no other warp reads), so that each global store is a 16-byte chunk of a row."""
        for col0 in range(0, 8 * tiles, DV):
            chunks = min(DV, 8 * tiles - col0) // 8  # of the row's 16-byte chunks, this pass's
            for n in range(chunks):
                for half in range(2):
                    st_shared_b32(v_s, key0 + g + 8 * half, 8 * n + 2 * t,
                                  pack(acc[0, col0 // 8 + n, 2 * half] * scale, acc[0, col0 // 8 + n, 2 * half + 1] * scale))
            syncwarp()
            for i in range(lane, 16 * chunks, 32):
                r, c = i // chunks, 8 * (i % chunks)
                if row0 + key0 + r < nrows:
                    copy_16_to_global(dst, (at, h, row0 + key0 + r, col0 + c), v_s, key0 + r, c)
            syncwarp()  # read before the next pass is staged

    @cuda.jit(device=True)
    def load_query_tile(smem, smem_f, stage, q, do, lse2, delta, at, h, m0, q_row0, seqlen_q, rows0):
        """Issue the copies of query tile ``m0`` of head ``h`` (rows from ``q_row0`` of ``q[at, h]``, from ``rows0``
        of ``lse2[at, h]``, as ``sequences.key_block_locator`` says): Q and dO rows (rows past the end read 0)
        and its rows of lse2 and delta."""
        copy_tile(tile_view(smem, Q_OFF + stage * Q_STAGE, BLOCK_M, Q_ROW), 0, int64(BLOCK_M), q, at, h, q_row0 + m0,
                  q_row0 + seqlen_q, D)
        copy_tile(tile_view(smem, DO_OFF + stage * DO_STAGE, BLOCK_M, DO_ROW), 0, int64(BLOCK_M), do, at, h, q_row0 + m0,
                  q_row0 + seqlen_q, DV)
        copy_rows(tile_view(smem_f, ROWS_OFF + stage * 2 * BLOCK_M, 2, BLOCK_M), lse2, delta, at, h, rows0 + m0)

    @cuda.jit(device=True, forceinline=True)
    def backward(q, k, v, do, lse2, delta, dq, dk, dv, scale, scale_log2, alibi, sinks, left, right, cap_log2,
                 cap_slope, seqs, maps):  # no tensor copies: maps ()
        b, h_kv, n0, m_first, m_tiles, seqlen_q, seqlen_kv, at, q_row0, k_row0, rows0 = locate(
            q, k, seqs, BLOCK_N, BLOCK_M, CAUSAL)
        if VARLEN and n0 >= seqlen_kv:
            return  # past the sequence's keys
        smem = cuda.shared.array(0, uint16)
        smem_f = cuda.shared.array(0, float32)  # the same bytes, for the float32 rows
        heads, heads_kv = q.shape[1], k.shape[1]
        diagonal = seqlen_kv - seqlen_q  # query i sees key j <= i + diagonal
        group = heads // heads_kv
        if WINDOW:
            m_first, m_tiles = window_queries(n0, BLOCK_N, diagonal, seqlen_q, BLOCK_M, left, right)
        n_iters = group * m_tiles  # (query head, query tile) pairs, head-major

        warp, lane = cuda.threadIdx.x // 32, cuda.threadIdx.x % 32
        g, t = lane // 4, lane % 4
        mat, mrow = ldmatrix_lane(lane)
        key0 = 16 * warp  # the warp's first key within the block
        dq_row0 = 16 * DQ_MTILES * (warp % ROW_WARPS)  # the warp's dQ rows and columns within a query tile
        dq_col0 = DQ_COLS * (warp // ROW_WARPS)
        k_s = tile_view(smem, 0, BLOCK_N, K_ROW)
        v_s = tile_view(smem, V_OFF, BLOCK_N, V_ROW)
        ds_s = tile_view(smem, DS_OFF, BLOCK_N, DS_ROW)  # dSᵀ: keys × query columns

        copy_tile(k_s, 0, int64(BLOCK_N), k, at, h_kv, k_row0 + n0, k_row0 + seqlen_kv, D)
        copy_tile(v_s, 0, int64(BLOCK_N), v, at, h_kv, k_row0 + n0, k_row0 + seqlen_kv, DV)
        cp_async_commit()
        for j in range(IN_FLIGHT):
            if j < n_iters:
                load_query_tile(smem, smem_f, j, q, do, lse2, delta, at, h_kv * group + j // m_tiles,
                                m_first + (j % m_tiles) * BLOCK_M, q_row0, seqlen_q, rows0)
            cp_async_commit()

        dk_acc = cuda.local.array((1, DTILES, 4), float32)
        dv_acc = cuda.local.array((1, DVTILES, 4), float32)
        for n in range(DTILES):
            for e in range(4):
                dk_acc[0, n, e] = _ZERO
        for n in range(DVTILES):
            for e in range(4):
                dv_acc[0, n, e] = _ZERO
        s = cuda.local.array((1, MTILES, 4), float32)
        dp = cuda.local.array((1, MTILES, 4), float32)
        dq_acc = cuda.local.array((DQ_MTILES, DQ_TILES, 4), float32)
        a = cuda.local.array(4, uint32)
        dq_a = cuda.local.array((DQ_MTILES, 4), uint32)

        for it in range(n_iters):
            stage = it % STAGES
            ahead = it + IN_FLIGHT  # into the stage tile it - 1 used, free since the barrier before its dQ
            if ahead < n_iters:
                load_query_tile(smem, smem_f, ahead % STAGES, q, do, lse2, delta, at, h_kv * group + ahead // m_tiles,
                                m_first + (ahead % m_tiles) * BLOCK_M, q_row0, seqlen_q, rows0)
            cp_async_commit()
            cp_async_wait_group(IN_FLIGHT)  # tile it has landed
            cuda.syncthreads()  # and every warp is past the previous tile's dQ, which read dSᵀ
            h = h_kv * group + it // m_tiles
            m0 = m_first + (it % m_tiles) * BLOCK_M
            terms = (left, right, cap_log2, cap_slope, alibi[b, h] * LOG2E_F32 if ALIBI else _ZERO)
            q_s = tile_view(smem, Q_OFF + stage * Q_STAGE, BLOCK_M, Q_ROW)
            do_s = tile_view(smem, DO_OFF + stage * DO_STAGE, BLOCK_M, DO_ROW)
            rows = tile_view(smem_f, ROWS_OFF + stage * 2 * BLOCK_M, 2, BLOCK_M)

            # Sᵀ = K Qᵀ and dPᵀ = V dOᵀ: A fragments of the warp's keys, B fragments of two query n8 tiles per ldmatrix
            for n in range(MTILES):
                for e in range(4):
                    s[0, n, e] = _ZERO
                    dp[0, n, e] = _ZERO
            keys_times_queries(s, k_s, q_s, KSTEPS, key0, mat, mrow)
            keys_times_queries(dp, v_s, do_s, VSTEPS, key0, mat, mrow)

            # Pᵀ and dSᵀ in place; entry e of tile n: key g + 8·(e // 2), query column 8n + 2t + e % 2
            masked = n0 + BLOCK_N > seqlen_kv or (CAUSAL and m0 + diagonal < n0 + BLOCK_N - 1)
            if WINDOW:
                masked = masked or crosses_window(n0, BLOCK_N, m0, BLOCK_M, diagonal, left, right)
            to_gradients(s, dp, rows, scale_log2, masked, n0 + key0, m0, seqlen_kv, diagonal, g, t, terms)

            # dV += Pᵀ dO and dK += dSᵀ Q (B fragments of dO, Q read transposed); dSᵀ to shared memory
            for kk in range(MSTEPS):
                fragment(a, s, kk)
                for np2 in range(DVTILES // 2):
                    b0, b1, b2, b3 = load_b_trans(do_s, 16 * kk, 16 * np2, mat, mrow, False)
                    mma_into(dv_acc, int64(0), 2 * np2, a[0], a[1], a[2], a[3], b0, b1)
                    mma_into(dv_acc, int64(0), 2 * np2 + 1, a[0], a[1], a[2], a[3], b2, b3)
                fragment(a, dp, kk)
                st_shared_b32(ds_s, key0 + g, 16 * kk + 2 * t, a[0])
                st_shared_b32(ds_s, key0 + g + 8, 16 * kk + 2 * t, a[1])
                st_shared_b32(ds_s, key0 + g, 16 * kk + 8 + 2 * t, a[2])
                st_shared_b32(ds_s, key0 + g + 8, 16 * kk + 8 + 2 * t, a[3])
                for np2 in range(DTILES // 2):
                    b0, b1, b2, b3 = load_b_trans(q_s, 16 * kk, 16 * np2, mat, mrow, False)
                    mma_into(dk_acc, int64(0), 2 * np2, a[0], a[1], a[2], a[3], b0, b1)
                    mma_into(dk_acc, int64(0), 2 * np2 + 1, a[0], a[1], a[2], a[3], b2, b3)
            cuda.syncthreads()  # dSᵀ complete

            # dQ += scale · dS K: A fragments of dS read transposed from dSᵀ, B fragments of K transposed
            for mt in range(DQ_MTILES):
                for n in range(DQ_TILES):
                    for e in range(4):
                        dq_acc[mt, n, e] = _ZERO
            for kk in range(NSTEPS):
                for mt in range(DQ_MTILES):
                    dq_a[mt, 0], dq_a[mt, 1], dq_a[mt, 2], dq_a[mt, 3] = load_a_trans(ds_s, 16 * kk, dq_row0 + 16 * mt,
                                                                                      mat, mrow)
                for np2 in range(DQ_TILES // 2):
                    b0, b1, b2, b3 = load_b_trans(k_s, 16 * kk, dq_col0 + 16 * np2, mat, mrow, False)
                    for mt in range(DQ_MTILES):
                        mma_into(dq_acc, mt, 2 * np2, dq_a[mt, 0], dq_a[mt, 1], dq_a[mt, 2], dq_a[mt, 3], b0, b1)
                        mma_into(dq_acc, mt, 2 * np2 + 1, dq_a[mt, 0], dq_a[mt, 1], dq_a[mt, 2], dq_a[mt, 3],
                                 b2, b3)
            for mt in range(DQ_MTILES):
                add_dq(dq, dq_acc, mt, DQ_TILES, at, h, q_row0 + m0 + dq_row0 + 16 * mt, dq_col0, q_row0 + seqlen_q,
                       scale, g, t)

        cp_async_wait_group(0)  # with no query tile visited, every thread's copies of K and V may still be landing
        cuda.syncthreads()
        store_staged(dk, dk_acc, DTILES, v_s, at, h_kv, k_row0 + n0, k_row0 + seqlen_kv, scale, key0, g, t, lane)
        store_staged(dv, dv_acc, DVTILES, v_s, at, h_kv, k_row0 + n0, k_row0 + seqlen_kv, _ONE, key0, g, t, lane)

    return cuda.jit(backward_kernel(backward, sequences))
