"""Fused attention forward on tensor cores: FlashAttention-2's schedule with ``mma.sync`` m16n8k16.

A block of ``num_warps`` warps owns ``16 · num_warps`` query rows of one
(batch, query head); warp ``w`` owns rows ``16w .. 16w + 16``. The Q tile is
copied to shared memory once and its A fragments stay in registers. K/V tiles
of ``BLOCK_N`` keys stream through a ring of shared-memory stages: ``cp.async``
fills the next stages while the tensor cores work on the current one. Per key tile a
warp computes ``S = Q Kᵀ`` (B fragments by ``ldmatrix``), scales it into the
log2 domain, masks it where the tile crosses the sequence end or the causal
diagonal, updates its online softmax in registers (row max and sum shared by the
four lanes of a group through shuffles), turns ``P`` into A fragments without
leaving registers (an accumulator fragment pair is an A fragment) and adds
``P V`` (B fragments by ``ldmatrix.trans``).

Fragment layouts (``kernels/ptx/mma.py``): lane ``l`` has ``g = l // 4`` and
``t = l % 4``; an accumulator tile ``c[0..3]`` holds rows ``g`` (``c[0]``,
``c[1]``) and ``g + 8`` (``c[2]``, ``c[3]``), columns ``2t`` and ``2t + 1``.
So each lane carries two query rows, and the row statistics ``m_i``, ``l_i``
have two entries.

Shared-memory rows are padded by 8 elements (16 bytes): rows stay 16-byte
aligned for ``cp.async`` and the eight rows an ``ldmatrix`` reads fall in
distinct banks. Inputs must have a contiguous head dimension, 16-byte aligned
rows, and head dims that are multiples of 16.
"""

import functools

import numpy as np
from numba import float32, uint16, uint32

from .._cuda import cuda
from .constants import LOG2E_F32
from .fragments import ldmatrix_lane, load_a, load_b, load_b_trans
from .online_softmax import partial_store, seed_sink, softmax_steps
from .ptx import (
    cluster_sync,
    cp_async_commit,
    cp_async_wait_group,
    mma_m16n8k16_bf16,
    mma_m16n8k16_f16,
    pack_bf16x2,
    pack_f16x2,
)
from .score_mods import NO_MODS, crosses_window, window_span
from .sequences import DENSE, block_locator, forward_kernel, source_row
from .split_merge import cluster_merger, cluster_stage_cols, split_finisher, split_run
from .tiles import PAD, row_major_cell, tile_copier, tile_view, transposed_key_copier

_ZERO = np.float32(0.0)


@functools.lru_cache(maxsize=None)
def mma_attention_kernel(config, dtype, head_dim, head_dim_v, causal, write_lse, split=False, k_transposed=False,
                         cluster_merge=False, mods=NO_MODS, sequences=DENSE):
    """Numba kernel ``kernel(q, k, v, o, lse, scale_log2, alibi, sinks, left, right, cap_log2, cap_slope)``;
    arguments as for the SIMT kernel, the score modifications ``mods`` as ``score_mods.py`` says, the
    sequence layout ``sequences`` (varlen and paged arguments after the others) as ``sequences.py`` says.

    16-bit arrays only (``uint16`` bit patterns). Launch with
    ``cdiv(Sq, block_m) · B · Hq`` blocks of ``num_threads`` threads and
    ``config.shared_bytes(D, Dv)`` bytes of dynamic shared memory.

    With ``split`` the kernel is ``kernel(q, k, v, o, lse, o_part, lse_part, counters, scale_log2, ...)``
    and the grid ``(cdiv(Sq, block_m) · B · Hq, S)``: block ``(x, s)`` visits the
    ``s``-th of S equal runs of key tiles (of the window's, with a window; the sink counts in run 0) and writes the float32 partials
    ``o_part [B, Hq, Sq, S, Dv]`` (normalized within the split; varlen: B sequences of at most Sq rows) and
    ``lse_part [B, Hq, Sq, S]`` (log2 domain); the last of a query tile's S blocks
    to finish (``counters [1, cdiv(Sq, block_m) · B · Hq]`` int32, zero at launch
    and left zero) merges them into ``o`` and ``lse``.

    With ``cluster_merge`` as well (sm_90; launch with clusters of ``(1, S, 1)`` blocks, S at most
    ``CLUSTER_SPLITS``, and at least ``cluster_stage_bytes(block_m, Dv)`` bytes of shared memory) a
    query tile's S blocks stage their partials in shared memory and merge them together through
    distributed shared memory, each block a share of the rows; ``o_part``, ``lse_part`` and
    ``counters`` are not touched.
    """
    BLOCK_M, BLOCK_N, NUM_THREADS = config.block_m, config.block_n, config.num_threads
    WARP_M, Q_IN_REGISTERS = config.warp_m, config.q_in_registers
    D, DV = head_dim, head_dim_v
    KSTEPS = D // 16  # k-steps of S = Q Kᵀ
    NTILES = BLOCK_N // 8  # n8 accumulator tiles of S (and P)
    PSTEPS = BLOCK_N // 16  # k-steps of O += P V
    DTILES = DV // 8  # n8 accumulator tiles of O
    Q_FRAGS = KSTEPS if Q_IN_REGISTERS else 1
    LANE_ROWS = 2 * WARP_M  # query rows each lane carries
    K_T = k_transposed
    Q_ROW, V_ROW = D + PAD, DV + PAD
    K_ROWS, K_ROW = (D, BLOCK_N + PAD) if K_T else (BLOCK_N, D + PAD)  # a K tile's shared-memory shape
    K_OFF = BLOCK_M * Q_ROW
    K_STAGE = K_ROWS * K_ROW
    STAGES = config.stages
    IN_FLIGHT = STAGES - 1  # key tiles being copied while one is computed on
    V_OFF = K_OFF + STAGES * K_STAGE
    V_STAGE = BLOCK_N * V_ROW
    CAUSAL, WRITE_LSE, SPLIT, CLUSTER = causal, write_lse, split, split and cluster_merge
    VARLEN = sequences.varlen
    if VARLEN and (cluster_merge or k_transposed):
        raise ValueError("variable-length sequences take neither a cluster merge nor a transposed K")
    locate = block_locator(sequences)
    WINDOW, ALIBI, SINKS = mods.window, mods.alibi, mods.sinks
    STAGE_COLS = cluster_stage_cols(DV)
    mma = mma_m16n8k16_bf16 if dtype == "bfloat16" else mma_m16n8k16_f16
    pack = pack_bf16x2 if dtype == "bfloat16" else pack_f16x2
    init, scale_and_mask, update, rescale, normalize, store = softmax_steps(WARP_M, NTILES, DTILES, causal, dtype,
                                                                            mods=mods)
    store_partial = partial_store(WARP_M, DTILES, staged=CLUSTER)
    finish_split = split_finisher(store_partial, dtype, DV, BLOCK_M, write_lse, sequences.varlen)
    merge_cluster = cluster_merger(dtype, DV, BLOCK_M, write_lse)

    copy_tile = tile_copier(NUM_THREADS, row_major_cell)
    copy_kv_tile = tile_copier(NUM_THREADS, row_major_cell, source_row(sequences))
    copy_kt_tile = transposed_key_copier(NUM_THREADS, row_major_cell, D, BLOCK_N)

    @cuda.jit(device=True)
    def load_tile_async(dst, src, b, h, row0, nrows, ncols):
        """Issue 16-byte copies of ``src[b, h, row0 + r, :ncols]`` into ``dst[r, :ncols]``; rows past ``nrows`` read 0."""
        copy_tile(dst, 0, dst.shape[0], src, b, h, row0, nrows, ncols)

    @cuda.jit(device=True)
    def load_v_tile_async(dst, v, at, h, n0, nkeys):
        """The V tile of keys ``n0 ..`` (found from ``at`` as ``sequences.py`` says); keys from ``nkeys`` on read 0."""
        copy_kv_tile(dst, 0, dst.shape[0], v, at, h, n0, nkeys, DV)

    @cuda.jit(device=True)
    def load_k_tile_async(dst, k, at, h, n0, nkeys):
        """The K tile of keys ``n0 ..``: rows of ``k`` or, transposed, runs of 8 keys per head-dim row;
        keys from ``nkeys`` on read 0."""
        if K_T:
            copy_kt_tile(dst, 0, k, at, h, n0, nkeys)
        else:
            copy_kv_tile(dst, 0, dst.shape[0], k, at, h, n0, nkeys, D)

    @cuda.jit(device=True, forceinline=True)
    def mma_into(c, mt, n, a0, a1, a2, a3, b0, b1):
        """``c[mt, n] += A·B``: accumulator tile ``n`` of the warp's m16 tile ``mt``."""
        c[mt, n, 0], c[mt, n, 1], c[mt, n, 2], c[mt, n, 3] = mma(
            a0, a1, a2, a3, b0, b1, c[mt, n, 0], c[mt, n, 1], c[mt, n, 2], c[mt, n, 3]
        )

    @cuda.jit(device=True)
    def load_q_fragments(q_frag, q_s, ks, slot, warp_row0, mat, mrow):
        """A fragments of k-step ``ks`` for each of the warp's m16 tiles, into ``q_frag[:, slot]``."""
        for mt in range(WARP_M):
            q_frag[mt, slot, 0], q_frag[mt, slot, 1], q_frag[mt, slot, 2], q_frag[mt, slot, 3] = load_a(
                q_s, warp_row0 + 16 * mt, 16 * ks, mat, mrow, False)

    @cuda.jit(device=True, forceinline=True)
    def attend(q, k, v, o, lse, scale_log2, alibi, sinks, left, right, cap_log2, cap_slope, seqs, parts,
               maps):  # no tensor copies: maps ()
        # v for the key count: k may be given transposed
        b, h, h_kv, m0, n_end, seqlen_q, seqlen_kv, q_at, q_row0, kv_at, k_row0 = locate(q, v, seqs, BLOCK_M, CAUSAL,
                                                                                         cuda.blockIdx.x, cuda.gridDim.x)
        if VARLEN and m0 < 0:
            return  # past the sequence's rows
        smem = cuda.shared.array(0, uint16)
        q_s = tile_view(smem, 0, BLOCK_M, Q_ROW)
        diagonal = seqlen_kv - seqlen_q
        first = 0  # the first key of this block's run of tiles
        if WINDOW:
            first, n_end = window_span(m0, BLOCK_M, diagonal, seqlen_kv, left, right)
            first = first // BLOCK_N * BLOCK_N
        n_blocks = (n_end - first + BLOCK_N - 1) // BLOCK_N
        if SPLIT:
            first, n_blocks = split_run(first, n_blocks, n_blocks if WINDOW else (seqlen_kv + BLOCK_N - 1) // BLOCK_N,
                                        BLOCK_N)
        slope_log2 = alibi[b, h] * LOG2E_F32 if ALIBI else _ZERO
        terms = (left, right, cap_log2, cap_slope, slope_log2)

        warp, lane = cuda.threadIdx.x // 32, cuda.threadIdx.x % 32
        g, t = lane // 4, lane % 4
        mat, mrow = ldmatrix_lane(lane)
        warp_row0 = 16 * WARP_M * warp  # the warp's first row within the block

        load_tile_async(q_s, q, q_at, h, q_row0 + m0, q_row0 + seqlen_q, D)
        cp_async_commit()
        for j in range(IN_FLIGHT):  # the first tiles, one commit group each
            if j < n_blocks:
                load_k_tile_async(tile_view(smem, K_OFF + j * K_STAGE, K_ROWS, K_ROW),
                                  k, kv_at, h_kv, k_row0 + first + j * BLOCK_N, k_row0 + seqlen_kv)
                load_v_tile_async(tile_view(smem, V_OFF + j * V_STAGE, BLOCK_N, V_ROW),
                                  v, kv_at, h_kv, k_row0 + first + j * BLOCK_N, k_row0 + seqlen_kv)
            cp_async_commit()
        cp_async_wait_group(IN_FLIGHT)  # the Q tile has landed
        cuda.syncthreads()

        q_frag = cuda.local.array((WARP_M, Q_FRAGS, 4), uint32)
        if Q_IN_REGISTERS:  # every k-step's A fragments, loaded once
            for ks in range(KSTEPS):
                load_q_fragments(q_frag, q_s, ks, ks, warp_row0, mat, mrow)

        # row statistics per lane (online_softmax's layout); m_i in the log2 domain
        m_i = cuda.local.array(LANE_ROWS, float32)
        l_i = cuda.local.array(LANE_ROWS, float32)
        row_max = cuda.local.array(LANE_ROWS, float32)  # of the current key tile
        alpha = cuda.local.array(LANE_ROWS, float32)  # rescaling factors of the output rows
        acc = cuda.local.array((WARP_M, DTILES, 4), float32)
        s = cuda.local.array((WARP_M, NTILES, 4), float32)
        p_frag = cuda.local.array((WARP_M, 4), uint32)  # A fragment of P for one k-step
        init(m_i, l_i, acc)
        if SINKS and (not SPLIT or cuda.blockIdx.y == 0):
            seed_sink(m_i, l_i, sinks[h] * LOG2E_F32, t)

        for j in range(n_blocks):
            stage = j % STAGES
            k_s = tile_view(smem, K_OFF + stage * K_STAGE, K_ROWS, K_ROW)
            v_s = tile_view(smem, V_OFF + stage * V_STAGE, BLOCK_N, V_ROW)
            ahead = j + IN_FLIGHT  # prefetch into the stage that tile j - 1 used
            if ahead < n_blocks:
                free = ahead % STAGES
                load_k_tile_async(tile_view(smem, K_OFF + free * K_STAGE, K_ROWS, K_ROW),
                                  k, kv_at, h_kv, k_row0 + first + ahead * BLOCK_N, k_row0 + seqlen_kv)
                load_v_tile_async(tile_view(smem, V_OFF + free * V_STAGE, BLOCK_N, V_ROW),
                                  v, kv_at, h_kv, k_row0 + first + ahead * BLOCK_N, k_row0 + seqlen_kv)
            cp_async_commit()
            cp_async_wait_group(IN_FLIGHT)  # tile j has landed (later tiles may be in flight)
            cuda.syncthreads()

            # S = Q Kᵀ: one ldmatrix gives the B fragments of two n8 tiles, used by every m16 tile
            for mt in range(WARP_M):
                for nt in range(NTILES):
                    for e in range(4):
                        s[mt, nt, e] = _ZERO
            for ks in range(KSTEPS):
                slot = ks if Q_IN_REGISTERS else 0
                if not Q_IN_REGISTERS:
                    load_q_fragments(q_frag, q_s, ks, 0, warp_row0, mat, mrow)
                for np2 in range(NTILES // 2):
                    if K_T:  # k_s[d, n]: B fragments read transposed, like V's
                        b0, b1, b2, b3 = load_b_trans(k_s, 16 * ks, 16 * np2, mat, mrow, False)
                    else:
                        b0, b1, b2, b3 = load_b(k_s, 16 * np2, 16 * ks, mat, mrow, False)
                    for mt in range(WARP_M):
                        a0, a1, a2, a3 = q_frag[mt, slot, 0], q_frag[mt, slot, 1], q_frag[mt, slot, 2], q_frag[mt, slot, 3]
                        mma_into(s, mt, 2 * np2, a0, a1, a2, a3, b0, b1)
                        mma_into(s, mt, 2 * np2 + 1, a0, a1, a2, a3, b2, b3)

            n0 = first + j * BLOCK_N
            masked = n0 + BLOCK_N > seqlen_kv or (CAUSAL and n0 + BLOCK_N - 1 > m0 + diagonal)
            if WINDOW:
                masked = masked or crosses_window(n0, BLOCK_N, m0, BLOCK_M, diagonal, left, right)
            factor = scale_and_mask(s, scale_log2, masked, m0 + warp_row0, n0, seqlen_kv, diagonal, g, t, terms)
            if update(s, m_i, l_i, row_max, alpha, factor):
                rescale(acc, alpha)

            # O += P V; the accumulator tiles 2kk, 2kk+1 of P are the A fragment of k-step kk
            for kk in range(PSTEPS):
                n = 2 * kk
                for mt in range(WARP_M):
                    p_frag[mt, 0] = pack(s[mt, n, 0], s[mt, n, 1])
                    p_frag[mt, 1] = pack(s[mt, n, 2], s[mt, n, 3])
                    p_frag[mt, 2] = pack(s[mt, n + 1, 0], s[mt, n + 1, 1])
                    p_frag[mt, 3] = pack(s[mt, n + 1, 2], s[mt, n + 1, 3])
                for dp in range(DTILES // 2):
                    b0, b1, b2, b3 = load_b_trans(v_s, 16 * kk, 16 * dp, mat, mrow, False)
                    for mt in range(WARP_M):
                        a0, a1, a2, a3 = p_frag[mt, 0], p_frag[mt, 1], p_frag[mt, 2], p_frag[mt, 3]
                        mma_into(acc, mt, 2 * dp, a0, a1, a2, a3, b0, b1)
                        mma_into(acc, mt, 2 * dp + 1, a0, a1, a2, a3, b2, b3)
            cuda.syncthreads()  # this stage is refilled by the next iteration's prefetch

        if CLUSTER:  # the loop's last barrier has freed the shared memory
            stage = cuda.shared.array(0, float32)
            o_s = tile_view(stage, 0, BLOCK_M, STAGE_COLS)
            lse_s = tile_view(stage, BLOCK_M * STAGE_COLS, 1, BLOCK_M)
            store_partial(o_s, lse_s, acc, m_i, l_i, b, h, warp_row0, BLOCK_M, 0, g, t)
            cluster_sync()
            merge_cluster(o_s, lse_s, o, lse, b, h, m0, seqlen_q, cuda.gridDim.y, cuda.blockIdx.y)
            cluster_sync()  # no block leaves while another reads its shared memory
        elif SPLIT:
            finish_split(parts, acc, m_i, l_i, o, lse, b, h, m0, m0 + warp_row0, seqlen_q, q_at, q_row0, g, t)
        else:
            normalize(acc, m_i, l_i, lse, WRITE_LSE, q_at, h, q_row0 + m0 + warp_row0, q_row0 + seqlen_q, g, t)
            store(o, acc, q_at, h, q_row0 + m0 + warp_row0, q_row0 + seqlen_q, g, t)

    kernel = forward_kernel(attend, sequences, split)

    return cuda.jit(kernel)
