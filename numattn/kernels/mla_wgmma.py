"""MLA decode on Hopper's warpgroup tensor cores (``wgmma``, sm_90 only).

A block owns one (sequence, key split, 64 query heads): the 64 heads are the M
rows of ``wgmma`` m64 products (rows past the last head read zero queries and
are not stored). Latent tiles of ``block_n`` rows ``[ckv | kpe]`` stream
through a ring of ``stages`` shared-memory buffers in wgmma's 128-byte
swizzled layout (``ptx.py``), behind the Q tile of the 64 heads; mbarriers
track when a buffer is full (every thread's ``cp.async`` copies landed) and
empty (both warpgroups are done with it), as in ``attention_wgmma.py``.

Two warpgroups divide the ``R`` output columns (``R / 2`` accumulator
columns each, 128 registers per thread at ``R`` = 512); both need the whole
64 × ``block_n`` score tile ``S = Q Kᵀ``. Two schedules (``qk``):

* ``"duplicated"``: each warpgroup computes S itself, runs the online
  softmax, and adds ``P V`` for its columns with P from registers. The
  warpgroups take turns on the tensor cores (named barriers), so one's
  softmax overlaps the other's products.
* ``"shared"``: warpgroup 0 alone computes S and the softmax, and hands P
  (a swizzled tile, the A operand of warpgroup 1's ``P V``) and the rows'
  rescaling factors to warpgroup 1 through shared memory (mbarriers: P ready,
  P read). Half the score products and half the shared-memory reads of Q.

Each warpgroup copies the panels it reads for ``P V`` (warpgroup 0 also the
``kpe`` columns), so that it can refill a buffer as soon as its own ``P V``
of the buffer's tile is complete and the tile's scores are (an mbarrier per
buffer and warpgroup when duplicated), without waiting for the other
warpgroup's ``P V``: the next ``stages - 1`` tiles then load during the
scores and softmax of this one. ``128 / block_n`` threads of a warpgroup
share a latent row, so a thread looks up one page per tile, a tile ahead
(stepping through its page-table entries without dividing: ``next_row``),
and copies from its row's address plus constants.
"""

import functools
import math

import numpy as np
from numba import float32, int32, int64, uint16, uint32

from .._cuda import SIMULATOR, cuda
from .online_softmax import p_fragments, quad_sum, softmax_steps
from .ptx import (
    SW128_ALIGN,
    aligned_start,
    barrier_arrive,
    barrier_sync,
    copy_16_to_global,
    cp_async_16,
    cp_async_16_at,
    cp_async_mbarrier_arrive,
    fence_proxy_async,
    fence_registers,
    global_address,
    mbarrier_arrive,
    mbarrier_init,
    mbarrier_try_wait,
    pack_bf16x2,
    pack_f16x2,
    st_shared_b32,
    wgmma_commit,
    wgmma_fence,
    wgmma_rs_bf16,
    wgmma_rs_f16,
    wgmma_descriptor,
    wgmma_ss_bf16,
    wgmma_ss_desc_bf16,
    wgmma_ss_desc_f16,
    wgmma_ss_f16,
    wgmma_wait,
)
from .tiles import sw128_cell, tile_view

HEADS_PER_BLOCK = 64  # one m64 product
ELEM = 2  # bytes per element: the kernel takes 16-bit floats
GROUPS = 2  # warpgroups, each owning half the output columns
THREADS = 128 * GROUPS
_NEG_INF = np.float32(-np.inf)
_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)
_LN2 = np.float32(math.log(2.0))


def wgmma_panels(rank, rope):
    """64-column panels of a shared-memory latent row ``[ckv | kpe]``."""
    return -(-(rank + rope) // 64)


# the shared schedule's P tile (one 64-column panel of 64 rows) and float32 row statistics:
# rescaling factors, then each row's final sum and max, then a rescale flag per warp
P_TILE_BYTES = 2 * 64 * HEADS_PER_BLOCK
STATS = 3 * HEADS_PER_BLOCK + 4


def mla_wgmma_shared_bytes(block_n, stages, rank, rope, shared_scores):
    """The Q tile of 64 heads and ``stages`` latent tiles, in whole panels, slack to align them, and
    with ``shared_scores`` the P tile and row statistics."""
    tiles = 2 * 64 * wgmma_panels(rank, rope) * (HEADS_PER_BLOCK + stages * block_n) + SW128_ALIGN
    return tiles + (P_TILE_BYTES + 4 * STATS if shared_scores else 0)


@functools.lru_cache(maxsize=None)
def mla_wgmma_kernel(dtype, rank, rope, block_n, stages, qk, split, write_lse):
    """Numba kernel with the arguments of ``mla.mla_decode_kernel``; grid ``(S, cdiv(H, 64), B)``,
    ``THREADS`` threads, ``mla_wgmma_shared_bytes`` of dynamic shared memory. ``rank`` a multiple
    of 128 (each warpgroup's columns are whole panels), ``block_n`` a multiple of 16 up to 64,
    ``qk`` "duplicated" or "shared"; ``o`` with contiguous rows starting at 16-byte boundaries."""
    R, P, BLOCK_N, STAGES = rank, rope, block_n, stages
    SHARED = qk == "shared"
    PANELS = wgmma_panels(R, P)
    KSTEPS, PSTEPS = (R + P) // 16, BLOCK_N // 16  # k-steps of S = Q Kᵀ and of O += P V
    COLS = R // GROUPS  # output columns per warpgroup
    NTILES, DTILES = BLOCK_N // 8, COLS // 8
    S_REGS, O_REGS = BLOCK_N // 2, COLS // 2
    CHUNKS, NOPE_CHUNKS = (R + P) // 8, R // 8  # 16-byte chunks of a latent row, of its ckv part
    ROW_THREADS = 128 // BLOCK_N  # threads of a warpgroup copying one latent row
    PANEL_COPIES = 8 // ROW_THREADS  # a thread's chunks of a panel of its row
    OWN_PANELS = R // 64 // GROUPS  # the ckv panels a warpgroup copies (and multiplies by P)
    ROPE_CHUNKS = P // 8
    ROPE_PANELS = -(-ROPE_CHUNKS // 8)
    # shared memory as 128-byte rows of a 64-column view: the Q tile, then STAGES latent tiles
    Q_ROWS = PANELS * HEADS_PER_BLOCK
    TILE_ROWS = PANELS * BLOCK_N
    P_ROW0 = Q_ROWS + STAGES * TILE_ROWS  # the shared schedule's P tile, then its row statistics
    VIEW_ROWS = P_ROW0 + (HEADS_PER_BLOCK if SHARED else 0)
    V_PANEL = 64 * BLOCK_N  # elements between the 64-column panels of a latent tile
    ALPHA, L_FINAL, M_FINAL, FLAGS = 0, HEADS_PER_BLOCK, 2 * HEADS_PER_BLOCK, 3 * HEADS_PER_BLOCK
    # mbarriers: FULL + s (stage s loaded), Q_FULL; duplicated: SCORED + STAGES·w + s (warpgroup w's
    # scores of stage s done); shared: P_READY (warpgroup 0 wrote P), P_FREE (warpgroup 1 read it)
    FULL, Q_FULL, SCORED, P_READY, P_FREE = 0, STAGES, STAGES + 1, STAGES + 1, STAGES + 2
    BARRIERS = STAGES + 3 if SHARED else 3 * STAGES + 1
    TURN = 1  # named barriers TURN + w: warpgroup w may issue its products
    SPLIT, WRITE_LSE = split, write_lse
    bf16 = dtype == "bfloat16"
    wgmma_ss, wgmma_rs = (wgmma_ss_bf16, wgmma_rs_bf16) if bf16 else (wgmma_ss_f16, wgmma_rs_f16)
    wgmma_ss_desc = wgmma_ss_desc_bf16 if bf16 else wgmma_ss_desc_f16
    pack = pack_bf16x2 if bf16 else pack_f16x2
    init, scale_and_mask, update, rescale, _, _ = softmax_steps(1, NTILES, DTILES, False, dtype)
    pack_p = p_fragments(PSTEPS, dtype)

    @cuda.jit(device=True, inline="always")
    def locate(page_table, b, key, end, slot, offset):
        """(page index as stored, position) of latent row ``key`` of sequence ``b``, entry ``slot`` of
        its page table at ``offset``; (0, 0) from ``end`` on. The index stays int32 and is clamped where
        it is used, a tile later, so that nothing waits for its read here (not even a sign extension)."""
        if key >= end:
            return int32(0), 0
        return page_table[b, slot], offset

    @cuda.jit(device=True, inline="always")
    def next_row(page_table, b, key, slot, offset, end, page_size, slot_step, offset_step):
        """``(key, slot, offset, page, position)`` of this thread's row of the next tile, ``BLOCK_N`` rows
        on: the page-table entry and the offset in its page advance by ``BLOCK_N``'s quotient and
        remainder by the page size with one wrap test, no division per tile; the page and position to
        copy from as ``locate`` gives them."""
        key += BLOCK_N
        slot += slot_step
        offset += offset_step
        if offset >= page_size:
            offset -= page_size
            slot += 1
        page, position = locate(page_table, b, key, end, slot, offset)
        return key, slot, offset, page, position

    @cuda.jit(device=True, inline="always")
    def load_tile_async(view, bars, ckv, kpe, stage, page, position, valid, group, r, lane):
        """Start this thread's copies into ring ``stage`` of its row ``r`` of a latent tile, its
        warpgroup's panels (zeros unless ``valid``); the stage's FULL barrier counts them in.

        The ``ROW_THREADS`` threads of a row take alternate 16-byte chunks (``lane`` the first),
        so that together they read whole sectors; a chunk's place in the swizzled panel row
        depends on the thread alone, the panel adds a constant, and so does each chunk's offset
        from the thread's first in the latent row."""
        nbytes = 16 if valid else 0
        page = min(max(page, 0), ckv.shape[0] - 1)
        first_panel = group * OWN_PANELS
        tile_row = Q_ROWS + stage * TILE_ROWS + r  # the row in the tile's first panel
        row0 = tile_row + first_panel * BLOCK_N
        ckv_row = global_address(ckv, (page, position, 64 * first_panel + 8 * lane))
        rope_row = global_address(kpe, (page, position, 8 * lane))
        for k in range(PANEL_COPIES):
            col = ((lane + ROW_THREADS * k) ^ (r & 7)) * 8  # within the panel
            for p in range(OWN_PANELS):
                cp_async_16_at(view, row0 + p * BLOCK_N, col, ckv_row + ELEM * (64 * p + 8 * ROW_THREADS * k), nbytes)
            if group == 0:
                for p in range(ROPE_PANELS):
                    if ROPE_CHUNKS % 8 == 0 or 8 * p + lane + ROW_THREADS * k < ROPE_CHUNKS:
                        cp_async_16_at(view, tile_row + (R // 64 + p) * BLOCK_N, col,
                                       rope_row + ELEM * (64 * p + 8 * ROW_THREADS * k), nbytes)
        cp_async_mbarrier_arrive(bars, FULL + stage)

    @cuda.jit(device=True, inline="always")
    def wait_phase(bars, barrier, parity):
        """Wait for the completion of an mbarrier phase of this parity (phases count from 0)."""
        while not mbarrier_try_wait(bars, barrier, parity):
            pass

    @cuda.jit(device=True, inline="always")
    def issue_scores(s, smem, start, stage):
        """Start ``S = Q Kᵀ`` on the tile in ring ``stage``: four k-steps per 64-column panel of the Q
        and latent tiles, their descriptors the tile's first plus constants (16-byte units)."""
        q_desc = wgmma_descriptor(smem, start, 0)
        k_desc = wgmma_descriptor(smem, start + 64 * (Q_ROWS + stage * TILE_ROWS), 0)
        wgmma_fence()
        for panel in range(PANELS):
            for u in range(4):
                if KSTEPS % 4 == 0 or 4 * panel + u < KSTEPS:
                    wgmma_ss_desc(s, BLOCK_N, q_desc + 8 * HEADS_PER_BLOCK * panel + 2 * u,
                                  k_desc + 8 * BLOCK_N * panel + 2 * u, False, panel > 0 or u > 0)
        wgmma_commit()

    @cuda.jit(device=True, inline="always")
    def issue_pv(acc, p_frag, smem, start, stage, group):
        """Start ``O[:, this warpgroup's columns] += P V`` on the tile in ring ``stage``, V the tile's
        ckv columns (panels), MN-major."""
        v_tile = start + 64 * (Q_ROWS + stage * TILE_ROWS) + group * OWN_PANELS * V_PANEL
        fence_registers(acc, O_REGS)
        wgmma_fence()
        for kk in range(PSTEPS):
            wgmma_rs(acc, COLS, p_frag[kk, 0], p_frag[kk, 1], p_frag[kk, 2], p_frag[kk, 3],
                     smem, v_tile + 64 * 16 * kk, V_PANEL, True, True)
        wgmma_commit()

    @cuda.jit(device=True, inline="always")
    def issue_pv_shared(acc, smem, start, stage):
        """Warpgroup 1 of the shared schedule: ``O[:, its columns] += P V`` with P from the P tile."""
        v_tile = start + 64 * (Q_ROWS + stage * TILE_ROWS) + OWN_PANELS * V_PANEL
        p_tile = start + 64 * P_ROW0
        fence_registers(acc, O_REGS)
        wgmma_fence()
        for kk in range(PSTEPS):
            wgmma_ss(acc, COLS, smem, p_tile + 16 * kk, v_tile + 64 * 16 * kk, V_PANEL, True, True)
        wgmma_commit()

    @cuda.jit(device=True, inline="always")
    def share_p(view, stats, p_frag, alpha, rescaled, warp, g, t):
        """Warpgroup 0 of the shared schedule: P into the swizzled P tile (row-major, K-major A operand
        of warpgroup 1), the warp's rescale flag and, when set, its rows' factors."""
        for kk in range(PSTEPS):
            for half in range(2):
                r = 16 * warp + g + 8 * half
                for e in range(2):  # fragment entries 2·e + half: columns 16kk + 8e + 2t, + 1
                    row, col = sw128_cell(P_ROW0, HEADS_PER_BLOCK, r, 16 * kk + 8 * e)
                    st_shared_b32(view, row, col + 2 * t, p_frag[kk, 2 * e + half])
        if rescaled and t == 0:
            for half in range(2):
                stats[ALPHA + 16 * warp + g + 8 * half] = alpha[half]
        if cuda.threadIdx.x % 32 == 0:
            stats[FLAGS + warp] = _ONE if rescaled else _ZERO

    def kernel(q_nope, q_pe, ckv, kpe, page_table, seqlens, o, lse, o_part, lse_part, scale_log2):
        smem = cuda.shared.array(0, uint16)
        bars = cuda.shared.array(BARRIERS, int64)
        start = aligned_start(smem, SW128_ALIGN)
        view = tile_view(smem, start, VIEW_ROWS, 64)
        b, head0 = cuda.blockIdx.z, cuda.blockIdx.y * HEADS_PER_BLOCK
        split, splits = cuda.blockIdx.x, cuda.gridDim.x
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        g, t = lane // 4, lane % 4
        group = warp // 4
        heads, page_size = q_nope.shape[1], ckv.shape[1]
        seqlen = min(max(seqlens[b], 0), page_table.shape[1] * page_size)
        per_split = -(-seqlen // splits)
        first, end = split * per_split, min(seqlen, (split + 1) * per_split)
        n_tiles = max(0, -(-(end - first) // BLOCK_N))
        my_row = (tid % 128) // ROW_THREADS  # the latent row of each tile this thread copies
        my_lane = tid % ROW_THREADS
        other = (group + 1) % GROUPS

        if tid == 0:
            for stage in range(STAGES):
                mbarrier_init(bars, FULL + stage, THREADS)
                if not SHARED:
                    for w in range(GROUPS):
                        mbarrier_init(bars, SCORED + STAGES * w + stage, 128)
            mbarrier_init(bars, Q_FULL, THREADS)
            if SHARED:
                mbarrier_init(bars, P_READY, 128)
                mbarrier_init(bars, P_FREE, 128)
        cuda.syncthreads()
        page, position = int32(0), 0
        next_key = first + my_row  # this thread's row of the next tile to load, in its page-table entry
        slot, offset = next_key // page_size, next_key % page_size
        slot_step, offset_step = BLOCK_N // page_size, BLOCK_N % page_size
        # tiles loaded before the loop: warpgroup 1 of the shared schedule fills every stage, as it
        # refills a stage after its P V; the others fill all but one, refilled before their P V
        prologue = STAGES if SHARED and group == 1 else STAGES - 1
        if n_tiles > 0:
            for idx in range(tid, HEADS_PER_BLOCK * CHUNKS, THREADS):  # the Q tile: [q_nope | q_pe] per head
                r, c = idx // CHUNKS, idx % CHUNKS
                valid = head0 + r < heads
                h = head0 + r if valid else 0
                row, col = sw128_cell(0, HEADS_PER_BLOCK, r, 8 * c)
                if c < NOPE_CHUNKS:
                    cp_async_16(view, row, col, q_nope, (b, h, 8 * c), 16 if valid else 0)
                else:
                    cp_async_16(view, row, col, q_pe, (b, h, 8 * (c - NOPE_CHUNKS)), 16 if valid else 0)
            cp_async_mbarrier_arrive(bars, Q_FULL)
            page, position = locate(page_table, b, next_key, end, slot, offset)
            for j in range(prologue):  # each thread's next page is looked up a tile ahead
                if j < n_tiles:
                    load_tile_async(view, bars, ckv, kpe, j, page, position, next_key < end, group, my_row, my_lane)
                    next_key, slot, offset, page, position = next_row(page_table, b, next_key, slot, offset, end,
                                                                      page_size, slot_step, offset_step)
            if not SHARED and group == GROUPS - 1:
                barrier_arrive(TURN, THREADS)  # the first warpgroup goes first

        m_i = cuda.local.array(2, float32)
        l_i = cuda.local.array(2, float32)
        row_max = cuda.local.array(2, float32)
        alpha = cuda.local.array(2, float32)
        acc = cuda.local.array((1, DTILES, 4), float32)
        s = cuda.local.array((1, NTILES, 4), float32)
        p_frag = cuda.local.array((PSTEPS, 4), uint32)
        init(m_i, l_i, acc)
        # the shared schedule's row statistics, after the P tile (a view that the duplicated one never reads)
        stats = cuda.shared.array(0, float32)[(start + 64 * VIEW_ROWS) // 2:]

        if n_tiles > 0:
            wait_phase(bars, Q_FULL, 0)
        # ring positions without runtime divisions: tile j sits in ``stage``, in its ``parity``-th use (mod 2)
        stage, parity, prev_stage, prev_parity = 0, 0, STAGES - 1, 1
        scorer = not SHARED or group == 0
        for j in range(n_tiles):
            if scorer:
                wait_phase(bars, FULL + stage, parity)
                fence_proxy_async()  # copies made visible to this thread become visible to wgmma
                if not SHARED:
                    barrier_sync(TURN + group, THREADS)  # this warpgroup's turn on the tensor cores
                if j > 0:
                    issue_pv(acc, p_frag, smem, start, prev_stage, group)
                issue_scores(s, smem, start, stage)
                if not SHARED:
                    barrier_arrive(TURN + other, THREADS)
                # refill the stage of tile j - 1 with tile j + STAGES - 1: this warpgroup's panels are free
                # once its P V(j - 1) is complete and the scores of tile j - 1 (the other's, when duplicated) are
                ahead = j + STAGES - 1 < n_tiles
                if j > 0:
                    wgmma_wait(1)
                    fence_registers(acc, O_REGS)
                    if ahead and not SHARED:
                        wait_phase(bars, SCORED + STAGES * other + prev_stage, prev_parity)
                if ahead:
                    load_tile_async(view, bars, ckv, kpe, prev_stage, page, position, next_key < end, group, my_row,
                                    my_lane)
                    next_key, slot, offset, page, position = next_row(page_table, b, next_key, slot, offset, end,
                                                                      page_size, slot_step, offset_step)
                wgmma_wait(0)
                fence_registers(s, S_REGS)
                if not SHARED:
                    mbarrier_arrive(bars, SCORED + STAGES * group + stage)

                n0 = first + j * BLOCK_N
                scale_and_mask(s, scale_log2, n0 + BLOCK_N > end, 0, n0, end, 0, g, t)
                rescaled = update(s, m_i, l_i, row_max, alpha)
                if rescaled:
                    rescale(acc, alpha)
                pack_p(p_frag, s)
                if SHARED:  # hand P over once warpgroup 1 has read the previous one
                    if j > 0:
                        wait_phase(bars, P_FREE, (j - 1) & 1)
                    share_p(view, stats, p_frag, alpha, rescaled, warp, g, t)
                    fence_proxy_async()
                    mbarrier_arrive(bars, P_READY)
            else:
                wait_phase(bars, P_READY, j & 1)
                if stats[FLAGS + warp % 4] != _ZERO:
                    for half in range(2):
                        factor = stats[ALPHA + 16 * (warp % 4) + g + 8 * half]
                        for dt in range(DTILES):
                            acc[0, dt, 2 * half] *= factor
                            acc[0, dt, 2 * half + 1] *= factor
                wait_phase(bars, FULL + stage, parity)
                fence_proxy_async()
                issue_pv_shared(acc, smem, start, stage)
                wgmma_wait(0)
                fence_registers(acc, O_REGS)
                mbarrier_arrive(bars, P_FREE)
                if j + STAGES < n_tiles:  # this warpgroup's panels of the stage are free
                    load_tile_async(view, bars, ckv, kpe, stage, page, position, next_key < end, group, my_row,
                                    my_lane)
                    next_key, slot, offset, page, position = next_row(page_table, b, next_key, slot, offset, end,
                                                                      page_size, slot_step, offset_step)
            prev_stage, prev_parity = stage, parity
            stage += 1
            if stage == STAGES:
                stage, parity = 0, parity ^ 1
        if n_tiles > 0 and scorer:
            if not SHARED:
                barrier_sync(TURN + group, THREADS)
            issue_pv(acc, p_frag, smem, start, prev_stage, group)
            if not SHARED:
                barrier_arrive(TURN + other, THREADS)
            wgmma_wait(0)
            fence_registers(acc, O_REGS)

        # the scorers' row statistics: full sums over the lane quad (handed to warpgroup 1 when shared)
        l_row = cuda.local.array(2, float32)
        m_row = cuda.local.array(2, float32)
        for half in range(2):
            l_row[half], m_row[half] = quad_sum(l_i[half]), m_i[half]
        if SHARED:
            if group == 0 and t == 0:
                for half in range(2):
                    stats[L_FINAL + 16 * warp + g + 8 * half] = l_row[half]
                    stats[M_FINAL + 16 * warp + g + 8 * half] = m_row[half]
            cuda.syncthreads()
            if group == 1:
                for half in range(2):
                    l_row[half] = stats[L_FINAL + 16 * (warp % 4) + g + 8 * half]
                    m_row[half] = stats[M_FINAL + 16 * (warp % 4) + g + 8 * half]
        if not SPLIT:
            cuda.syncthreads()  # both warpgroups' last products are complete: the Q tile is free
        for half in range(2):
            l_sum = l_row[half]
            r = 16 * (warp % 4) + g + 8 * half
            h = head0 + r
            inv = _ONE / l_sum if l_sum > _ZERO else _ZERO
            if SPLIT:
                if h < heads:
                    for dt in range(DTILES):
                        for e in range(2):
                            o_part[b, h, 0, split, group * COLS + 8 * dt + 2 * t + e] = acc[0, dt, 2 * half + e] * inv
            else:  # the output rows go out through the Q tile, so that each global store is a 16-byte chunk
                for dt in range(DTILES):
                    row, col = sw128_cell(0, HEADS_PER_BLOCK, r, group * COLS + 8 * dt)
                    pair = pack(acc[0, dt, 2 * half] * inv, acc[0, dt, 2 * half + 1] * inv)
                    st_shared_b32(view, row, col + 2 * t, pair)
            if h < heads and group == 0 and t == 0:
                row_lse = m_row[half] + math.log2(l_sum) if l_sum > _ZERO else _NEG_INF
                if SPLIT:
                    lse_part[b, h, 0, split] = row_lse
                elif WRITE_LSE:
                    lse[b, h] = row_lse * _LN2
        if not SPLIT:
            cuda.syncthreads()
            for idx in range(tid, min(HEADS_PER_BLOCK, heads - head0) * NOPE_CHUNKS, THREADS):
                r, c = idx // NOPE_CHUNKS, 8 * (idx % NOPE_CHUNKS)
                row, col = sw128_cell(0, HEADS_PER_BLOCK, r, c)
                copy_16_to_global(o, (b, head0 + r, c), view, row, col)

    if SIMULATOR:  # the simulator's jit takes no register limit
        return cuda.jit(kernel)
    return cuda.jit(kernel, max_registers=255)
