"""MLA decode (DeepSeek multi-head latent attention, absorbed weights) over a paged latent cache.

Every query head reads the same latent rows: key ``[ckv | kpe]`` (``R + P``
wide), value ``ckv`` (``R`` wide). A block owns one (sequence, key split, 16
query heads); its 16 heads are the M rows of ``mma.sync`` m16n8k16 products.
All warps share each tile of ``block_n`` latent rows, staged in shared memory
through a ring of ``stages`` tiles (``cp.async``, one block barrier per tile),
and the ``R`` output columns are divided among the warps (``R / warps``
accumulator columns each), so that a 512-wide output fits in registers.

The scores ``S = Q Kᵀ`` are needed whole by every warp; a configuration either
*duplicates* them (each warp runs all ``(R + P) / 16`` k-steps) or *shards*
them (each warp runs its share of k-steps and the partial tiles are summed
through shared memory). Every warp then runs the same online softmax on the
same scores, so the warps never merge: each writes its own columns.

On sm_90 a configuration may name the ``wgmma`` kernel instead
(``mla_wgmma.py``): blocks of 64 heads, two warpgroups dividing the columns.

A configuration (``configs/mla.py``: ``MlaConfig``, and ``mla_candidates``, those that fit a GPU
architecture's shared memory and registers) picks the kernel and its tiles.
"""

import functools
import math

import numpy as np
from numba import float32, int32, uint16

from .._cuda import cuda
from .constants import LN2_F32
from .fragments import ldmatrix_lane, load_a, load_b, load_b_trans
from .mla_wgmma import mla_wgmma_kernel
from .mla_wgmma_steps import softmax_headroom
from .online_softmax import quad_sum, softmax_steps
from .ptx import (
    cp_async_16,
    cp_async_commit,
    cp_async_wait_group,
    mma_m16n8k16_bf16,
    mma_m16n8k16_f16,
    pack_bf16x2,
    pack_f16x2,
)
from .tiles import NARROW, swizzled_rows, tile_col, tile_row_elems, tile_view

HEAD_ROWS = 16  # query heads per block: one m16 tile
_NEG_INF = np.float32(-np.inf)
_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)

@functools.lru_cache(maxsize=None)
def mla_decode_kernel(dtype, rank, rope, config, split, write_lse):
    """Numba kernel ``kernel(q_nope, q_pe, ckv, kpe, page_table, seqlens, o, lse, o_part, lse_part, scale_log2)``.

    q_nope ``[B, H, R]``, q_pe ``[B, H, P]``, o ``[B, H, R]`` (16-bit floats as
    uint16), ckv ``[pages, page_size, R]``, kpe ``[pages, page_size, P]``,
    page_table ``[B, max_pages]`` and seqlens ``[B]`` int32, lse ``[B, H]``
    float32 (when ``write_lse`` and not ``split``); with ``split``, o_part
    ``[B, H, 1, S, R]`` and lse_part ``[B, H, 1, S]`` float32 (log2 domain) for
    the decode combine kernel. Grid ``(S, cdiv(H, heads_per_block), B)`` (a persistent configuration
    without splits, for at most ``PERSISTENT_HEADS`` heads: any 1-D grid), ``32 · warps`` threads,
    ``mla_shared_bytes`` of dynamic shared memory. Page indices are clamped into
    the cache and lengths into the page table's capacity. The wgmma kernel writes
    ``o`` in 16-byte chunks: its rows contiguous, 16-byte aligned.
    """
    if config.wgmma:
        return mla_wgmma_kernel(dtype, rank, rope, config.block_n, config.stages, config.qk, split=split,
                                write_lse=write_lse, persistent=config.persistent and not split)
    R, P, BLOCK_N, STAGES, WARPS = rank, rope, config.block_n, config.stages, config.warps
    THREADS = 32 * WARPS
    SHARDED = config.qk == "sharded"
    SPLIT, WRITE_LSE = split, write_lse
    ROW = tile_row_elems(R + P)  # elements per shared-memory row: [ckv | kpe]
    SWIZZLED = swizzled_rows(R + P)
    KSTEPS = (R + P) // 16
    COLS = R // WARPS  # output columns per warp
    DTILES = COLS // 8
    NTILES = BLOCK_N // 8
    CHUNKS = (R + P) // 8  # 16-byte chunks of a latent row
    NOPE_CHUNKS = R // 8
    TILE = BLOCK_N * ROW
    RING = HEAD_ROWS * ROW  # the ring follows the Q tile
    EXCHANGE = RING + STAGES * TILE  # sharded partial scores follow the ring (in 16-bit units)
    EXCHANGE_ROWS = WARPS * HEAD_ROWS
    COPIES = -(-(BLOCK_N * CHUNKS) // THREADS)  # 16-byte copies per thread per tile
    IN_FLIGHT = STAGES - 1
    mma = mma_m16n8k16_bf16 if dtype == "bfloat16" else mma_m16n8k16_f16
    pack = pack_bf16x2 if dtype == "bfloat16" else pack_f16x2
    narrow = NARROW[dtype]
    init, _, update, rescale, _, _ = softmax_steps(1, NTILES, DTILES, False, dtype, softmax_headroom(dtype))

    @cuda.jit(device=True, forceinline=True)
    def copy_tile(smem, stage, ckv, kpe, page_table, b, first, end, tid):
        """Start the block's copies of latent rows ``first .. first + BLOCK_N`` into ring stage ``stage``
        (rows past ``end`` read 0): every thread looks up its rows' pages, then issues its copies."""
        tile = tile_view(smem, RING + stage * TILE, BLOCK_N, ROW)
        page_size, num_pages = ckv.shape[1], ckv.shape[0]
        pages = cuda.local.array(COPIES, int32)
        positions = cuda.local.array(COPIES, int32)
        for n in range(COPIES):  # every page index loaded before the first copy is issued
            key = first + (tid + n * THREADS) // CHUNKS
            pages[n], positions[n] = 0, 0
            if key < end:
                pages[n] = min(max(page_table[b, key // page_size], 0), num_pages - 1)
                positions[n] = key % page_size
        for n in range(COPIES):
            idx = tid + n * THREADS
            if idx < BLOCK_N * CHUNKS:
                r, c = idx // CHUNKS, idx % CHUNKS
                valid = first + r < end
                col = tile_col(SWIZZLED, r, 8 * c)
                if c < NOPE_CHUNKS:
                    cp_async_16(tile, r, col, ckv, (pages[n], positions[n], 8 * c), 16 if valid else 0)
                else:
                    cp_async_16(tile, r, col, kpe, (pages[n], positions[n], 8 * (c - NOPE_CHUNKS)), 16 if valid else 0)

    def kernel(q_nope, q_pe, ckv, kpe, page_table, seqlens, o, lse, o_part, lse_part, scale_log2):
        smem = cuda.shared.array(0, uint16)
        b, head0 = cuda.blockIdx.z, cuda.blockIdx.y * HEAD_ROWS
        split, splits = cuda.blockIdx.x, cuda.gridDim.x
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        g, t = lane // 4, lane % 4
        mat, mrow = ldmatrix_lane(lane)
        heads = q_nope.shape[1]
        seqlen = min(max(seqlens[b], 0), page_table.shape[1] * ckv.shape[1])
        per_split = -(-seqlen // splits)
        start, end = split * per_split, min(seqlen, (split + 1) * per_split)
        n_tiles = max(0, -(-(end - start) // BLOCK_N))

        q_s = tile_view(smem, 0, HEAD_ROWS, ROW)
        for idx in range(tid, HEAD_ROWS * CHUNKS, THREADS):  # the Q tile: [q_nope | q_pe] per head
            r, c = idx // CHUNKS, idx % CHUNKS
            valid = head0 + r < heads
            h = head0 + r if valid else 0
            if c < NOPE_CHUNKS:
                cp_async_16(q_s, r, tile_col(SWIZZLED, r, 8 * c), q_nope, (b, h, 8 * c), 16 if valid else 0)
            else:
                cp_async_16(q_s, r, tile_col(SWIZZLED, r, 8 * c), q_pe, (b, h, 8 * (c - NOPE_CHUNKS)), 16 if valid else 0)
        cp_async_commit()
        for j in range(IN_FLIGHT):
            if j < n_tiles:
                copy_tile(smem, j, ckv, kpe, page_table, b, start + j * BLOCK_N, end, tid)
            cp_async_commit()

        m_i = cuda.local.array(2, float32)
        l_i = cuda.local.array(2, float32)
        row_max = cuda.local.array(2, float32)
        alpha = cuda.local.array(2, float32)
        acc = cuda.local.array((1, DTILES, 4), float32)
        s = cuda.local.array((1, NTILES, 4), float32)
        init(m_i, l_i, acc)
        if SHARDED:  # the warps' partial score tiles, after the ring
            exchange = tile_view(cuda.shared.array(0, float32), EXCHANGE // 2, EXCHANGE_ROWS, BLOCK_N)

        for j in range(n_tiles):
            cuda.syncthreads()  # every warp is done with the stage refilled below
            if j + IN_FLIGHT < n_tiles:
                copy_tile(smem, (j + IN_FLIGHT) % STAGES, ckv, kpe, page_table, b, start + (j + IN_FLIGHT) * BLOCK_N,
                          end, tid)
            cp_async_commit()
            cp_async_wait_group(IN_FLIGHT)  # tile j (and the Q tile) have landed
            cuda.syncthreads()
            tile = tile_view(smem, RING + (j % STAGES) * TILE, BLOCK_N, ROW)

            # S = Q Kᵀ over this warp's k-steps (all of them when duplicated)
            for nt in range(NTILES):
                for e in range(4):
                    s[0, nt, e] = _ZERO
            first_ks, end_ks = (warp * KSTEPS // WARPS, (warp + 1) * KSTEPS // WARPS) if SHARDED else (0, KSTEPS)
            for ks in range(first_ks, end_ks):
                a0, a1, a2, a3 = load_a(q_s, 0, 16 * ks, mat, mrow, SWIZZLED)
                for np_ in range(NTILES // 2):  # one ldmatrix: the B fragments of two n8 tiles
                    b0, b1, b2, b3 = load_b(tile, 16 * np_, 16 * ks, mat, mrow, SWIZZLED)
                    n = 2 * np_
                    s[0, n, 0], s[0, n, 1], s[0, n, 2], s[0, n, 3] = mma(
                        a0, a1, a2, a3, b0, b1, s[0, n, 0], s[0, n, 1], s[0, n, 2], s[0, n, 3])
                    s[0, n + 1, 0], s[0, n + 1, 1], s[0, n + 1, 2], s[0, n + 1, 3] = mma(
                        a0, a1, a2, a3, b2, b3, s[0, n + 1, 0], s[0, n + 1, 1], s[0, n + 1, 2], s[0, n + 1, 3])
            if SHARDED:  # every warp adds up the warps' partial scores, in the same order
                for nt in range(NTILES):
                    for e in range(4):
                        exchange[warp * HEAD_ROWS + g + 8 * (e // 2), 8 * nt + 2 * t + e % 2] = s[0, nt, e]
                cuda.syncthreads()
                for nt in range(NTILES):
                    for e in range(4):
                        total = _ZERO
                        for w in range(WARPS):
                            total += exchange[w * HEAD_ROWS + g + 8 * (e // 2), 8 * nt + 2 * t + e % 2]
                        s[0, nt, e] = total

            n0 = start + j * BLOCK_N
            for nt in range(NTILES):
                for e in range(4):
                    s[0, nt, e] = s[0, nt, e] * scale_log2 if n0 + 8 * nt + 2 * t + e % 2 < end else _NEG_INF
            if update(s, m_i, l_i, row_max, alpha, _ONE):
                rescale(acc, alpha)
            # O[:, this warp's columns] += P V: each pair of score tiles is the A fragment of a k-step
            for kp in range(NTILES // 2):
                p0, p1 = pack(s[0, 2 * kp, 0], s[0, 2 * kp, 1]), pack(s[0, 2 * kp, 2], s[0, 2 * kp, 3])
                p2, p3 = pack(s[0, 2 * kp + 1, 0], s[0, 2 * kp + 1, 1]), pack(s[0, 2 * kp + 1, 2], s[0, 2 * kp + 1, 3])
                for dp in range(DTILES // 2):
                    b0, b1, b2, b3 = load_b_trans(tile, 16 * kp, warp * COLS + 16 * dp, mat, mrow, SWIZZLED)
                    n = 2 * dp
                    acc[0, n, 0], acc[0, n, 1], acc[0, n, 2], acc[0, n, 3] = mma(
                        p0, p1, p2, p3, b0, b1, acc[0, n, 0], acc[0, n, 1], acc[0, n, 2], acc[0, n, 3])
                    acc[0, n + 1, 0], acc[0, n + 1, 1], acc[0, n + 1, 2], acc[0, n + 1, 3] = mma(
                        p0, p1, p2, p3, b2, b3, acc[0, n + 1, 0], acc[0, n + 1, 1], acc[0, n + 1, 2], acc[0, n + 1, 3])
        cp_async_wait_group(0)  # no copy may still target shared memory when the block exits

        # every warp holds the same row statistics: full sums over the lane quad, then its own columns
        for half in range(2):
            l_sum = quad_sum(l_i[half])
            h = head0 + g + 8 * half
            if h < heads:
                inv = _ONE / l_sum if l_sum != _ZERO else _ZERO
                row_lse = m_i[half] + math.log2(l_sum) if l_sum != _ZERO else _NEG_INF
                for dt in range(DTILES):
                    for e in range(2):
                        col = warp * COLS + 8 * dt + 2 * t + e
                        value = acc[0, dt, 2 * half + e] * inv
                        if SPLIT:
                            o_part[b, h, 0, split, col] = value
                        else:
                            o[b, h, col] = narrow(value)
                if warp == 0 and t == 0:
                    if SPLIT:
                        lse_part[b, h, 0, split] = row_lse
                    elif WRITE_LSE:
                        lse[b, h] = row_lse * LN2_F32

    return cuda.jit(kernel)

