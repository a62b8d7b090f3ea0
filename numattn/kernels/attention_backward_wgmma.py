"""Backward of softmax attention on Hopper's warpgroup tensor cores (``wgmma``, sm_90 only).

The schedule of the ``mma.sync`` backward (``attention_backward_mma.py``) with
warpgroups for warps: a block owns ``64 · warpgroups`` keys of one (batch,
key/value head), each warpgroup 64 of them (each warp 16), and visits every
query tile of 64 rows of every query head in the group that sees its keys.
Per tile a warpgroup computes

    Sᵀ = K Qᵀ, dPᵀ = V dOᵀ        both operands in shared memory (K-major)
    Pᵀ, dSᵀ                       in registers, as the mma.sync kernel
    dV += Pᵀ dO, dK += dSᵀ Q       A from registers, B (dO, Q) MN-major

and writes dS (query rows × key columns) to shared memory, from which the
block computes the tile's ``dQ = dS K`` (A K-major, B = K MN-major; warpgroup
``w`` takes head-dim columns ``w·D/warpgroups ..``) and adds it to the float32
accumulator with a bulk asynchronous reduction (``cp.reduce.async.bulk``) of
the tile staged in shared memory. The accumulator holds each query tile's dQ
(a packed sequence's tiles from the row where its lse₂ and delta rows start)
in the order of the accumulator fragments, the *fragment order*: axes
(warpgroup, warp within the warpgroup, n8 tile, half, lane // 4, lane % 4,
element) of sizes (warpgroups, 4, D / warpgroups / 8, 2, 8, 4, 2), holding row
``16 warp + 8 half + lane // 4`` and column ``warpgroup · D / warpgroups + 8 tile
+ 2 (lane % 4) + element``. The warps stage their fragments as they hold them,
with no bank conflicts, and one reduction adds the whole tile;
``dq_rows_kernel`` then puts the rows in order and converts dQ to the inputs'
dtype. With two staging buffers (``dq_stages``) a tile's reduction reads while
the next tile is computed. Q and dO tiles, with their rows of lse₂ and delta,
stream through ``cp.async`` stages; K and V are copied once. All 16-bit tiles use the 128-byte swizzled layout that wgmma reads (``ptx/wgmma.py``).
At the end each warpgroup writes its dK and dV rows through its own rows of the V
tile, which no other warpgroup reads, so that each global store is a 16-byte chunk.

With a ``producer`` one more warpgroup, holding few registers (``setmaxnreg``), takes
the copies and the dQ reductions (a tile's dQ is added once the copy into the stage
it gave up is issued) off the computing warpgroups: mbarriers tell when a query
stage is full and when the computing warpgroups are done with it, when a dQ tile is
staged and when its buffer has been read, so that the computing warpgroups meet
only around the dS tile (a named barrier: before it is written, once every dQ has
read the previous one, and after; with two dS buffers, ``ds_stages``, only after)
and never wait for a copy to be issued or a reduction to be accepted,
FlashAttention-3's division of the backward.

Head dims must be multiples of 64, inputs 16-bit with contiguous, 16-byte aligned rows.
"""

import functools

import numpy as np
from numba import float32, int64, uint16, uint32

from .._cuda import SIMULATOR, cuda
from .attention_backward_mma import gradient_steps
from .constants import LOG2E_F32
from .online_softmax import p_fragments
from .ptx import (
    SW128_ALIGN,
    aligned_start,
    barrier_sync,
    bulk_commit,
    bulk_reduce_add_f32,
    bulk_wait,
    bulk_wait_read,
    copy_16_to_global,
    cp_async_commit,
    cp_async_mbarrier_arrive,
    cp_async_wait_group,
    fence_proxy_async,
    fence_registers,
    forget_registers,
    grow_registers,
    load_l2_f32x4,
    mbarrier_arrive,
    mbarrier_expect_tx,
    mbarrier_init,
    mbarrier_wait,
    pack_bf16x2,
    pack_f16x2,
    shrink_registers,
    st_shared_v2_f32,
    stmatrix_x4,
    stmatrix_x4_trans,
    store_16,
    tma_load_box,
    wgmma_commit,
    wgmma_descriptor,
    wgmma_fence,
    wgmma_rs_desc_bf16,
    wgmma_rs_desc_f16,
    wgmma_ss_desc_bf16,
    wgmma_ss_desc_f16,
    wgmma_wait,
)
from .score_mods import NO_MODS, crosses_window, window_queries
from .sequences import DENSE, backward_kernel, key_block_locator, padded_rows, sequence_of
from .tiles import ring_next, sw128_cell, tile_copier, tile_view

_ZERO = np.float32(0.0)

BLOCK_M = 64  # query rows per tile: the M of dQ = dS K
DQ_ROWS_THREADS = 256  # per block of the kernel that puts dQ's rows in order


@functools.lru_cache(maxsize=None)
def dq_rows_kernel(config, dtype, head_dim, sequences=DENSE):
    """Numba kernel ``kernel(accumulator, dq)`` (packed ``sequences``: ``kernel(accumulator, dq, cu_seqlens_q)``):
    dQ ``[B, Hq, Sq, D]`` (packed: ``[1, Hq, total_q, D]``; 16-bit storage, 16-byte aligned rows with a
    contiguous last axis) from the float32 ``accumulator`` of the backward of ``config`` (``[B or 1, Hq, rows ·
    D]``, tiles in the fragment order of the module docstring; a packed sequence's rows from ``padded_rows``),
    converted to ``dtype`` and put in row order. Launch ``DQ_ROWS_THREADS`` threads per block, one per 8
    columns of a row of ``dq`` (contiguous in the accumulator): ``dq.size / 8`` in all."""
    N8_TILES = head_dim // config.warpgroups // 8  # of a warpgroup's dQ columns
    CHUNKS, TILE = head_dim // 8, BLOCK_M * head_dim  # 8-column chunks of a row; a tile's elements
    pack = pack_bf16x2 if dtype == "bfloat16" else pack_f16x2

    @cuda.jit(device=True, forceinline=True)
    def convert(accumulator, dq, at, h, row, padded_row, chunk):
        """Chunk ``chunk`` of ``dq[at, h, row]`` from the accumulator's row ``padded_row``."""
        tile, r = padded_row // BLOCK_M, padded_row % BLOCK_M
        warpgroup, n8 = chunk // N8_TILES, chunk % N8_TILES
        warp, half, group = r // 16, r // 8 % 2, r % 8
        first = TILE * tile + ((((4 * warpgroup + warp) * N8_TILES + n8) * 2 + half) * 32 + 4 * group) * 2
        a = load_l2_f32x4(accumulator, (at, h, first))
        c = load_l2_f32x4(accumulator, (at, h, first + 4))
        store_16(dq, (at, h, row, 8 * chunk), pack(a[0], a[1]), pack(a[2], a[3]), pack(c[0], c[1]), pack(c[2], c[3]))

    if sequences.varlen:
        def kernel(accumulator, dq, cu_seqlens_q):
            i = cuda.grid(1)
            heads, total = dq.shape[1], dq.shape[2]
            chunk, h, row = i % CHUNKS, i // CHUNKS % heads, i // (CHUNKS * heads)  # the order of q's packed rows
            if row >= total:
                return
            b = sequence_of(cu_seqlens_q, row)
            row0 = cu_seqlens_q[b]
            convert(accumulator, dq, 0, h, row, padded_rows(row0, b) + row - row0, chunk)
    else:
        def kernel(accumulator, dq):
            i = cuda.grid(1)
            chunk, row = i % CHUNKS, i // CHUNKS % dq.shape[2]
            bh = i // (CHUNKS * dq.shape[2])
            if bh < dq.shape[0] * dq.shape[1]:
                convert(accumulator, dq, bh // dq.shape[1], bh % dq.shape[1], row, row, chunk)

    return cuda.jit(kernel)


@functools.lru_cache(maxsize=None)
def backward_wgmma_kernel(config, dtype, head_dim, head_dim_v, causal, mods=NO_MODS, sequences=DENSE):
    """Numba kernel ``kernel(q, k, v, do, lse2, delta, dq, dk, dv, scale, scale_log2, alibi, sinks, left, right,
    cap_log2, cap_slope)``, arguments, score modifications, packed ``sequences`` and launch as for
    ``backward_mma_kernel`` (``lse2``, ``delta`` padded to whole tiles of 64 rows), but for the float32
    accumulator ``dq``, ``[B or 1, Hq, rows · D]`` with the rows of ``lse2``, each tile of 64 rows in the order
    of the module docstring's fragment order."""
    GROUPS, BLOCK_N, NUM_THREADS, DQ_STAGES = config.warpgroups, config.block_n, config.num_threads, config.dq_stages
    PRODUCER, STAGES = config.producer, config.stages  # stages of the query tiles
    CONSUMERS = 128 * GROUPS  # the computing threads
    DQ_PENDING = DQ_STAGES - 1  # reductions that may still read their dQ buffer when one is reused
    # the copying threads: the producer's, else every thread
    COPIERS, FIRST_COPIER = (128, CONSUMERS) if PRODUCER else (NUM_THREADS, 0)
    REDUCER = CONSUMERS if PRODUCER else 0  # the thread that adds the dQ tiles
    # mbarriers (with a producer): FULL + s (query stage s landed; the first use brings K and V too), EMPTY + s
    # (every computing thread is done with stage s), DQ_FULL + b (dQ buffer b staged), DQ_EMPTY + b (it was read)
    FULL, EMPTY = 0, STAGES
    DQ_FULL, DQ_EMPTY = 2 * STAGES, 2 * STAGES + DQ_STAGES
    BARRIERS = 2 * STAGES + 2 * DQ_STAGES
    DS_BARRIER = 1  # named barrier of the computing threads around the dS tile
    DS_STAGES = config.ds_stages  # with two, tile it's dS goes where tile it - 2's was, which every dQ has read
    STAGED_BARRIER = 2  # named barriers STAGED_BARRIER + w: warpgroup w's panel of dK or dV is staged (or read)
    D, DV, CAUSAL = head_dim, head_dim_v, causal
    KSTEPS, VSTEPS = D // 16, DV // 16  # k-steps of Sᵀ = K Qᵀ and dPᵀ = V dOᵀ
    MTILES, MSTEPS = BLOCK_M // 8, BLOCK_M // 16  # n8 tiles of Sᵀ; k-steps of dV, dK
    NSTEPS = BLOCK_N // 16  # k-steps of dQ = dS K
    DTILES, DVTILES = D // 8, DV // 8
    DQ_N = D // GROUPS  # dQ columns per warpgroup
    DQ_TILES = DQ_N // 8
    S_REGS, DK_REGS, DV_REGS, DQ_REGS = BLOCK_M // 2, D // 2, DV // 2, DQ_N // 2
    FRAG_REGS = 4 * MSTEPS  # A fragments of Pᵀ (or dSᵀ)
    # shared memory as 128-byte rows of a 64-column view (each tile a multiple of 8 rows: 1024-byte aligned)
    K_ROW0 = 0
    V_ROW0 = K_ROW0 + BLOCK_N * D // 64
    Q_ROW0 = V_ROW0 + BLOCK_N * DV // 64
    Q_ROWS = BLOCK_M * D // 64
    DO_ROW0 = Q_ROW0 + STAGES * Q_ROWS
    DO_ROWS = BLOCK_M * DV // 64
    DS_ROW0 = DO_ROW0 + STAGES * DO_ROWS  # dS: BLOCK_M query rows × BLOCK_N key columns
    DS_ROWS = BLOCK_M * BLOCK_N // 64
    VIEW_ROWS = DS_ROW0 + DS_STAGES * DS_ROWS
    ROWS_OFF = 32 * VIEW_ROWS  # float32 elements after the view: per stage, rows of lse2 and delta
    DQ_OFF = STAGES * 2 * BLOCK_M  # then the staged dQ tiles
    DQ_FRAGMENT_ROWS = BLOCK_M * D // 64  # a staged tile in fragment order: per warp and n8 tile two rows of 64
    bf16 = dtype == "bfloat16"
    wgmma_ss, wgmma_rs = (wgmma_ss_desc_bf16, wgmma_rs_desc_bf16) if bf16 else (wgmma_ss_desc_f16, wgmma_rs_desc_f16)
    pack = pack_bf16x2 if bf16 else pack_f16x2
    copy_tile = tile_copier(COPIERS, sw128_cell, stepping=PRODUCER, first_thread=FIRST_COPIER)
    copy_rows, to_gradients, _ = gradient_steps(MTILES, causal, dtype, COPIERS, mods, FIRST_COPIER)
    WINDOW, ALIBI = mods.window, mods.alibi
    PRODUCER_REGISTERS, CONSUMER_REGISTERS = config.producer_registers, config.consumer_registers
    VARLEN = sequences.varlen
    # Q and dO tiles by tensor copies, the first producer thread issuing them: maps[0] is Q's, maps[1] dO's; a
    # packed sequence's tile that runs past its rows by cp.async (a box would read the next sequence's rows)
    TENSOR_COPIES = config.tensor_copies
    QUERY_TILE_BYTES = 2 * BLOCK_M * (D + DV)
    locate = key_block_locator(sequences)
    fragments = p_fragments(MSTEPS, dtype)  # A fragments of every k-step from the accumulator tiles

    @cuda.jit(device=True)
    def load_query_tile(view, rows_f, bars, stage, q, do, lse2, delta, at, h, m0, q_row0, seqlen_q, rows0, maps):
        """Issue the copies of query tile ``m0`` of head ``h`` (Q and dO rows, rows past the end read 0) and its
        rows of lse2 and delta (rows from ``q_row0`` and ``rows0`` of ``[at, h]``: ``sequences.py``); with tensor
        copies, Q's and dO's land on the stage's FULL barrier (``bars``), a panel of 64 columns per copy."""
        if TENSOR_COPIES and (not VARLEN or m0 + BLOCK_M <= seqlen_q):
            if cuda.threadIdx.x == CONSUMERS:
                mbarrier_expect_tx(bars, FULL + stage, QUERY_TILE_BYTES)
                for p in range(D // 64):
                    tma_load_box(view, Q_ROW0 + stage * Q_ROWS + p * BLOCK_M, maps, 0, at, h, q_row0 + m0, 64 * p,
                                 bars, FULL + stage)
                for p in range(DV // 64):
                    tma_load_box(view, DO_ROW0 + stage * DO_ROWS + p * BLOCK_M, maps, 1, at, h, q_row0 + m0, 64 * p,
                                 bars, FULL + stage)
        else:
            copy_tile(view, Q_ROW0 + stage * Q_ROWS, int64(BLOCK_M), q, at, h, q_row0 + m0, q_row0 + seqlen_q, D)
            copy_tile(view, DO_ROW0 + stage * DO_ROWS, int64(BLOCK_M), do, at, h, q_row0 + m0, q_row0 + seqlen_q, DV)
        copy_rows(tile_view(rows_f, stage * 2 * BLOCK_M, 2, BLOCK_M), lse2, delta, at, h, rows0 + m0)

    @cuda.jit(device=True, forceinline=True)
    def next_query_tile(head, m_tile, m_tiles):
        """The (query head within the group, query tile) after this one: tiles of a head, head after head."""
        return (head, m_tile + 1) if m_tile + 1 < m_tiles else (head + 1, 0)

    @cuda.jit(device=True, forceinline=True)
    def add_dq(dq, rows_f, offset, at, h, row0):
        """Add the dQ tile staged from ``rows_f[offset]`` to the accumulator's tile from row ``row0`` of head
        ``h``, as one bulk group."""
        bulk_reduce_add_f32(dq, (at, h, row0 * D), rows_f, offset, 4 * BLOCK_M * D)
        bulk_commit()

    @cuda.jit(device=True, forceinline=True)
    def produce(view, rows_f, bars, q, k, v, do, lse2, delta, dq, at, h_kv, h0, n0, k_row0, seqlen_kv, m_first, m_tiles,
                n_iters, q_row0, seqlen_q, rows0, maps):
        """The producer warpgroup's work: K and V, then every query tile (of heads from ``h0``) into its stage once
        the computing warpgroups are done with the stage's previous tile; after that copy is issued, the dQ
        tile the previous tile of the stage staged is added to the accumulator and its buffer given back, so
        that no reduction holds up a copy."""
        # typed, not literal, rows and counters: numba would type and lower the callees once more for literals
        copy_tile(view, int64(K_ROW0), int64(BLOCK_N), k, at, h_kv, k_row0 + n0, k_row0 + seqlen_kv, D)
        copy_tile(view, int64(V_ROW0), int64(BLOCK_N), v, at, h_kv, k_row0 + n0, k_row0 + seqlen_kv, DV)
        head, m_tile, stage, parity = int64(0), int64(0), int64(0), int64(0)  # the tile to copy
        # the tile whose dQ to add
        added_head, added_tile, buffer, buffer_parity = int64(0), int64(0), int64(0), int64(0)
        for it in range(n_iters + STAGES):
            if it < n_iters:  # copy tile it
                if it >= STAGES:
                    mbarrier_wait(bars, EMPTY + stage, parity ^ 1)  # the stage's previous tile is done
                load_query_tile(view, rows_f, bars, stage, q, do, lse2, delta, at, h0 + head, m_first + m_tile * BLOCK_M,
                                q_row0, seqlen_q, rows0, maps)
                cp_async_mbarrier_arrive(bars, FULL + stage)
                head, m_tile = next_query_tile(head, m_tile, m_tiles)
                stage, parity = ring_next(stage, parity, STAGES)
            if it >= STAGES:  # add the dQ of tile it - STAGES, which gave its stage to the copy above
                mbarrier_wait(bars, DQ_FULL + buffer, buffer_parity)
                if cuda.threadIdx.x == REDUCER:
                    add_dq(dq, rows_f, DQ_OFF + buffer * BLOCK_M * D, at, h0 + added_head,
                           rows0 + m_first + added_tile * BLOCK_M)
                    bulk_wait_read(0)
                mbarrier_arrive(bars, DQ_EMPTY + buffer)
                added_head, added_tile = next_query_tile(added_head, added_tile, m_tiles)
                buffer, buffer_parity = ring_next(buffer, buffer_parity, DQ_STAGES)
        cp_async_commit()
        cp_async_wait_group(0)  # the copies land before their threads leave
        if cuda.threadIdx.x == REDUCER:
            bulk_wait(0)  # the reductions are done before the block's shared memory goes

    @cuda.jit(device=True, forceinline=True)
    def store_staged(dst, view, acc, panels, at, h, row0, nrows, scale, wg, warp, lane):
        """``scale ·`` the warpgroup's 64 rows of a key block's gradient (``acc``, each warp's 16 rows of
        ``panels`` panels of 64 columns) into rows ``row0 + 64 wg ..`` of ``dst[at, h]`` below ``nrows``, a
        panel at a time through the warpgroup's rows of the V tile in shared memory, which no other warpgroup
        reads: each global store is then a whole 16-byte chunk of a row."""
        for p in range(panels):
            for i in range(4):  # the n8 tiles 8p + 2i and 8p + 2i + 1 of rows g and g + 8: stmatrix's four matrices
                n = 8 * p + 2 * i
                row, col = sw128_cell(int64(V_ROW0), int64(BLOCK_N), 64 * wg + 16 * (warp % 4) + lane % 8 + 8 * ((lane // 8) % 2),
                                      16 * i + 8 * (lane // 16))
                stmatrix_x4(view, row, col, pack(acc[0, n, 0] * scale, acc[0, n, 1] * scale),
                            pack(acc[0, n, 2] * scale, acc[0, n, 3] * scale),
                            pack(acc[0, n + 1, 0] * scale, acc[0, n + 1, 1] * scale),
                            pack(acc[0, n + 1, 2] * scale, acc[0, n + 1, 3] * scale))
            barrier_sync(STAGED_BARRIER + wg, 128)
            for i in range(cuda.threadIdx.x % 128, 64 * 8, 128):  # 8 chunks of 16 bytes per row of the panel
                r, c = 64 * wg + i // 8, 8 * (i % 8)
                if row0 + r < nrows:
                    row, col = sw128_cell(int64(V_ROW0), int64(BLOCK_N), r, c)
                    copy_16_to_global(dst, (at, h, row0 + r, 64 * p + c), view, row, col)
            barrier_sync(STAGED_BARRIER + wg, 128)  # the panel is read before the next one is staged

    @cuda.jit(device=True, forceinline=True)
    def backward(q, k, v, do, lse2, delta, dq, dk, dv, scale, scale_log2, alibi, sinks, left, right, cap_log2,
                 cap_slope, seqs, maps):
        b, h_kv, n0, m_first, m_tiles, seqlen_q, seqlen_kv, at, q_row0, k_row0, rows0 = locate(
            q, k, seqs, BLOCK_N, BLOCK_M, CAUSAL)
        if VARLEN and n0 >= seqlen_kv:
            return  # past the sequence's keys
        smem = cuda.shared.array(0, uint16)
        bars = cuda.shared.array(BARRIERS, int64)
        start = aligned_start(smem, SW128_ALIGN)
        view = tile_view(smem, start, VIEW_ROWS, 64)
        rows_f = cuda.shared.array(0, float32)[start // 2 + ROWS_OFF:]  # the same bytes, past the view
        heads, heads_kv = q.shape[1], k.shape[1]
        diagonal = seqlen_kv - seqlen_q  # query i sees key j <= i + diagonal
        group_size = heads // heads_kv
        h0 = h_kv * group_size  # the group's first query head
        if WINDOW:
            m_first, m_tiles = window_queries(n0, BLOCK_N, diagonal, seqlen_q, BLOCK_M, left, right)
        n_iters = group_size * m_tiles  # (query head, query tile) pairs, head-major

        warp, lane = cuda.threadIdx.x // 32, cuda.threadIdx.x % 32
        g, t = lane // 4, lane % 4
        wg = warp // 4
        key0 = 16 * warp  # the warp's first key within the block (warpgroup wg: keys 64wg ..)
        dq_col0 = DQ_N * wg  # the warpgroup's dQ columns
        reducer = cuda.threadIdx.x == REDUCER

        if PRODUCER:
            if cuda.threadIdx.x == 0:
                for stage in range(STAGES):
                    mbarrier_init(bars, FULL + stage, COPIERS)
                    mbarrier_init(bars, EMPTY + stage, CONSUMERS)
                for buffer in range(DQ_STAGES):
                    mbarrier_init(bars, DQ_FULL + buffer, CONSUMERS)
                    mbarrier_init(bars, DQ_EMPTY + buffer, 128)  # every producer thread
            cuda.syncthreads()
            if wg == GROUPS:
                shrink_registers(PRODUCER_REGISTERS)
                if n_iters > 0:
                    produce(view, rows_f, bars, q, k, v, do, lse2, delta, dq, at, h_kv, h0, n0, k_row0, seqlen_kv,
                            m_first, m_tiles, n_iters, q_row0, seqlen_q, rows0, maps)
                return
            grow_registers(CONSUMER_REGISTERS)
        else:
            copy_tile(view, int64(K_ROW0), int64(BLOCK_N), k, at, h_kv, k_row0 + n0, k_row0 + seqlen_kv, D)
            copy_tile(view, int64(V_ROW0), int64(BLOCK_N), v, at, h_kv, k_row0 + n0, k_row0 + seqlen_kv, DV)
            if n_iters > 0:
                load_query_tile(view, rows_f, bars, int64(0), q, do, lse2, delta, at, h0, m_first, q_row0, seqlen_q,
                                rows0, maps)
            cp_async_commit()

        dk_acc = cuda.local.array((1, DTILES, 4), float32)
        dv_acc = cuda.local.array((1, DVTILES, 4), float32)
        for n in range(DTILES):
            for e in range(4):
                dk_acc[0, n, e] = 0.0
        for n in range(DVTILES):
            for e in range(4):
                dv_acc[0, n, e] = 0.0
        s = cuda.local.array((1, MTILES, 4), float32)
        dp = cuda.local.array((1, MTILES, 4), float32)
        dq_acc = cuda.local.array((DQ_TILES, 4), float32)
        p_frag = cuda.local.array((MSTEPS, 4), uint32)
        ds_frag = cuda.local.array((MSTEPS, 4), uint32)
        # the tiles' offsets pass through an opaque register per iteration: hoisted out of the loop, the
        # matrix descriptors of every k-step would stay live in registers
        tile_offsets = cuda.local.array(1, uint32)

        # iteration it's query head within the group and query tile (it // m_tiles, it % m_tiles), its query
        # stage and dQ buffer with the parities of their uses, counted along rather than divided out
        head, m_tile, stage, parity = int64(0), int64(0), int64(0), int64(0)  # typed, as in produce
        dq_buffer, dq_parity = int64(0), int64(0)
        for it in range(n_iters):
            next_head, next_tile = next_query_tile(head, m_tile, m_tiles)
            next_stage, next_parity = ring_next(stage, parity, STAGES)
            dq_off = DQ_OFF + dq_buffer * BLOCK_M * D  # this tile's dQ buffer
            ds_row0 = DS_ROW0 + (it % DS_STAGES) * DS_ROWS  # and dS buffer
            if PRODUCER:
                mbarrier_wait(bars, FULL + stage, parity)  # tile it (and, the first time, K and V) has landed
                fence_proxy_async()  # copies made visible to this thread become visible to wgmma
            else:
                if reducer:
                    bulk_wait_read(DQ_PENDING)  # the reduction that last used the buffer has read it
                cp_async_wait_group(0)  # tile it has landed
                fence_proxy_async()  # this thread's copies, visible to wgmma
                cuda.syncthreads()  # every thread's, and every warpgroup is done with tile it - 1 and dS
                if it + 1 < n_iters:  # into the stage of tile it - 1
                    load_query_tile(view, rows_f, bars, next_stage, q, do, lse2, delta, at, h0 + next_head,
                                    m_first + next_tile * BLOCK_M, q_row0, seqlen_q, rows0, maps)
                cp_async_commit()
            tile_offsets[0] = start
            fence_registers(tile_offsets, 1)
            # matrix descriptors (units of 16 bytes: 8 elements) of the tiles, each k-step one constant on
            k_desc = wgmma_descriptor(smem, tile_offsets[0] + 64 * K_ROW0, 0)
            v_desc = wgmma_descriptor(smem, tile_offsets[0] + 64 * V_ROW0, 0)
            ds_desc = wgmma_descriptor(smem, tile_offsets[0] + 64 * ds_row0, 0)
            k_mn_desc = wgmma_descriptor(smem, tile_offsets[0] + 64 * K_ROW0 + (dq_col0 // 64) * 64 * BLOCK_N,
                                         64 * BLOCK_N)  # K as dQ's MN-major B operand
            h = h0 + head
            m0 = m_first + m_tile * BLOCK_M
            terms = (left, right, cap_log2, cap_slope, alibi[b, h] * LOG2E_F32 if ALIBI else _ZERO)
            q_desc = wgmma_descriptor(smem, tile_offsets[0] + 64 * (Q_ROW0 + stage * Q_ROWS), 0)
            do_desc = wgmma_descriptor(smem, tile_offsets[0] + 64 * (DO_ROW0 + stage * DO_ROWS), 0)
            q_mn_desc = wgmma_descriptor(smem, tile_offsets[0] + 64 * (Q_ROW0 + stage * Q_ROWS), 64 * BLOCK_M)
            do_mn_desc = wgmma_descriptor(smem, tile_offsets[0] + 64 * (DO_ROW0 + stage * DO_ROWS), 64 * BLOCK_M)
            rows = tile_view(rows_f, stage * 2 * BLOCK_M, 2, BLOCK_M)

            # Sᵀ = K Qᵀ and dPᵀ = V dOᵀ for the warpgroup's 64 keys: k-step ks reads 16 columns of panel ks // 4
            forget_registers(s, S_REGS)
            forget_registers(dp, S_REGS)
            wgmma_fence()
            for ks in range(KSTEPS):
                wgmma_ss(s, BLOCK_M, k_desc + 8 * ((ks // 4) * BLOCK_N + 64 * wg) + 2 * (ks % 4),
                         q_desc + 8 * (ks // 4) * BLOCK_M + 2 * (ks % 4), False, ks > 0)
            for ks in range(VSTEPS):
                wgmma_ss(dp, BLOCK_M, v_desc + 8 * ((ks // 4) * BLOCK_N + 64 * wg) + 2 * (ks % 4),
                         do_desc + 8 * (ks // 4) * BLOCK_M + 2 * (ks % 4), False, ks > 0)
            wgmma_commit()
            wgmma_wait(0)
            fence_registers(s, S_REGS)
            fence_registers(dp, S_REGS)

            masked = n0 + BLOCK_N > seqlen_kv or (CAUSAL and m0 + diagonal < n0 + BLOCK_N - 1)
            if WINDOW:
                masked = masked or crosses_window(n0, BLOCK_N, m0, BLOCK_M, diagonal, left, right)
            to_gradients(s, dp, rows, scale_log2, masked, n0 + key0, m0, seqlen_kv, diagonal, g, t, terms)
            fragments(p_frag, s)
            fragments(ds_frag, dp)

            # dV += Pᵀ dO and dK += dSᵀ Q: k-step kk multiplies queries 16kk .. 16kk + 16 of the dO and Q tiles
            fence_registers(dv_acc, DV_REGS)
            fence_registers(dk_acc, DK_REGS)
            wgmma_fence()
            for kk in range(MSTEPS):
                wgmma_rs(dv_acc, DV, p_frag[kk, 0], p_frag[kk, 1], p_frag[kk, 2], p_frag[kk, 3], do_mn_desc + 128 * kk,
                         True, True)
            for kk in range(MSTEPS):
                wgmma_rs(dk_acc, D, ds_frag[kk, 0], ds_frag[kk, 1], ds_frag[kk, 2], ds_frag[kk, 3], q_mn_desc + 128 * kk,
                         True, True)
            wgmma_commit()

            if PRODUCER and DS_STAGES == 1:
                barrier_sync(DS_BARRIER, CONSUMERS)  # every warpgroup's dQ of tile it - 1 has read dS
            # dS into shared memory, query-major: k-step kk's fragments are the 8 × 8 blocks (keys key0 + 8(i % 2) ..,
            # queries 16kk + 8(i // 2) ..), stored transposed; lane 8i + j addresses query row j of block i
            for kk in range(MSTEPS):
                row, col = sw128_cell(ds_row0, int64(BLOCK_M), 16 * kk + 8 * (lane // 16) + lane % 8, key0 + 8 * ((lane // 8) % 2))
                stmatrix_x4_trans(view, row, col, ds_frag[kk, 0], ds_frag[kk, 1], ds_frag[kk, 2], ds_frag[kk, 3])
            fence_proxy_async()
            if PRODUCER:
                barrier_sync(DS_BARRIER, CONSUMERS)  # dS complete
            else:
                cuda.syncthreads()

            # dQ = dS K for the warpgroup's columns: A = dS (K-major), B = K tile rows 16kk .. (MN-major),
            # queued behind dV and dK (no drain in between)
            forget_registers(dq_acc, DQ_REGS)
            wgmma_fence()
            for kk in range(NSTEPS):
                wgmma_ss(dq_acc, DQ_N, ds_desc + 8 * (kk // 4) * BLOCK_M + 2 * (kk % 4), k_mn_desc + 128 * kk, True, kk > 0)
            wgmma_commit()
            wgmma_wait(0)  # dV, dK and dQ: the A fragments' registers are free again
            fence_registers(dv_acc, DV_REGS)
            fence_registers(dk_acc, DK_REGS)
            fence_registers(p_frag, FRAG_REGS)
            fence_registers(ds_frag, FRAG_REGS)
            fence_registers(dq_acc, DQ_REGS)
            if PRODUCER:
                mbarrier_arrive(bars, EMPTY + stage)  # done with the query stage
                if it >= DQ_STAGES:
                    mbarrier_wait(bars, DQ_EMPTY + dq_buffer, dq_parity ^ 1)  # the buffer's last tile was read
            # each warp's fragments in rows of their own (the fragment order): 256 contiguous bytes per store
            dq_stage = tile_view(rows_f, dq_off, DQ_FRAGMENT_ROWS, 64)
            for n in range(DQ_TILES):
                for half in range(2):
                    st_shared_v2_f32(dq_stage, (warp * DQ_TILES + n) * 2 + half, 2 * lane,
                                     dq_acc[n, 2 * half] * scale, dq_acc[n, 2 * half + 1] * scale)
            fence_proxy_async()
            if PRODUCER:
                mbarrier_arrive(bars, DQ_FULL + dq_buffer)
            else:
                cuda.syncthreads()  # the tile's dQ is staged
                if reducer:
                    add_dq(dq, rows_f, dq_off, at, h, rows0 + m0)
            head, m_tile, stage, parity = next_head, next_tile, next_stage, next_parity
            dq_buffer, dq_parity = ring_next(dq_buffer, dq_parity, DQ_STAGES)

        if not PRODUCER:  # with no query tile visited, every thread's copies of K and V may still be landing
            cp_async_wait_group(0)
            cuda.syncthreads()
        store_staged(dk, view, dk_acc, D // 64, at, h_kv, k_row0 + n0, k_row0 + seqlen_kv, scale, wg, warp, lane)
        store_staged(dv, view, dv_acc, DV // 64, at, h_kv, k_row0 + n0, k_row0 + seqlen_kv, float32(1.0), wg, warp,
                     lane)
        if reducer:
            bulk_wait(0)  # the last reduction is done before the block's shared memory goes

    kernel = backward_kernel(backward, sequences, TENSOR_COPIES)
    if SIMULATOR or not PRODUCER:  # the simulator's jit takes no register limit
        return cuda.jit(kernel)
    return cuda.jit(kernel, max_registers=config.max_registers)
