"""MLA decode on Hopper's warpgroup tensor cores (``wgmma``, sm_90 only).

A block owns one (sequence, key split, 64 query heads): the 64 heads are the M
rows of ``wgmma`` m64 products (rows past the last head read zero queries and
are not stored). Latent tiles of ``block_n`` rows ``[ckv | kpe]`` stream
through a ring of ``stages`` shared-memory buffers in wgmma's 128-byte
swizzled layout (``ptx/wgmma.py``), behind the Q tile of the 64 heads; mbarriers
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

A persistent variant of the shared schedule (one block per SM taking the
sequences of at most 32 heads in turn) hides each item's start and drain
behind its neighbours: each copying thread's stream runs on from an item's last
tile into the next item's first, and the Q tile holds two items' queries, the
current item's heads in one half of the 64 rows and the next item's in the
other (the m64 products read both halves; the other half's rows only make
scores and outputs that are never stored). An item's output rows are staged in
its own half, which then takes the queries of the item after next, a whole item
ahead of their use. Warpgroup 0 hands an item's final row sums to warpgroup 1
through an mbarrier once warpgroup 1 has taken the item's last P, so that
neither runs a phase ahead.

In the shared schedule warpgroup 1 copies whole latent tiles: warpgroup 0,
which computes the scores, the softmax and half of ``P V``, is the one whose
work bounds a tile's time (on an H100 its copies took a third of it; see
docs/benchmarks.md). Warpgroup 1 refills the
stage of tile j - 1 once it has P of tile j, since warpgroup 0 completed its
products of tile j - 1 before handing P over. In the duplicated schedule each
warpgroup copies the panels it reads for ``P V`` (warpgroup 0 also the
``kpe`` columns), so that it can refill a buffer as soon as its own ``P V``
of the buffer's tile is complete and the other's scores are (an mbarrier per
buffer and warpgroup), without waiting for the other warpgroup's ``P V``.
Either way the next ``stages - 1`` tiles load during the scores and softmax
of this one. ``128 / block_n`` threads of a copying warpgroup share a latent
row, so a thread looks up one page per tile, a tile ahead
(stepping through its page-table entries without dividing: ``next_row``),
and copies from its row's address plus constants.

Each schedule is written once, by its own builder. ``duplicated_schedule`` and ``shared_schedule`` give
their tile loops and the handover of the rows' final statistics to the ordinary grid's item
(``grid_item``); ``persistent_schedule`` runs items of its own on the persistent grid; the two shared ones
share their tile loop (``shared_parts``). The steps that every schedule takes (the copy streams, the Q
tile's loads, the score and ``P V`` products, the softmax of a tile, the write-out) come from
``mla_wgmma_steps.kernel_steps``, and ``block_kernel`` runs a schedule over a block's items.
"""

import functools
from typing import NamedTuple

from numba import float32, int64, uint16, uint32

from .._cuda import SIMULATOR, cuda
from .mla_wgmma_steps import GROUPS, HEADS_PER_BLOCK, PERSISTENT_HEADS, STAGED, THREADS, kernel_steps
from .online_softmax import quad_sum
from .ptx import (
    SW128_ALIGN,
    aligned_start,
    barrier_arrive,
    barrier_sync,
    fence_proxy_async,
    fence_registers,
    mbarrier_arrive,
    mbarrier_init,
    mbarrier_wait,
    opaque,
    wgmma_wait,
)
from .tiles import tile_view

TURN = 1  # the duplicated schedule's named barriers TURN + w: warpgroup w may issue its products


class Schedule(NamedTuple):
    """A schedule's part of the kernel (``block_kernel``): ``barriers`` mbarriers, set up by thread 0 in
    ``init_barriers(bars)``; ``begin(group)``, its first step once the block's first copies are under way;
    and ``process_item(smem, view, bars, start, stats, inputs, outputs, scale_log2, heads, items, walk, b, c,
    first, end, n_tiles, stream, state, regs, me)``, one item of the block: sequence ``b``'s keys ``first ..
    end`` (``n_tiles`` tiles) against head chunk ``c``, from the ring as the copy stream fills it (``stream``,
    refilled as tiles free up) to the output rows. ``state`` is the ring and handover position ``(stage,
    parity, prev_stage, prev_parity, tiles of earlier items, earlier items with keys, the last item whose Q
    was loaded)``: tile j sits in ring ``stage``, in its ``parity``-th use (mod 2), no runtime divisions.
    ``inputs`` and ``outputs`` are the kernel's array arguments (``q_nope .. seqlens``, ``o .. lse_part``),
    ``regs`` the thread's softmax state, accumulator, scores, P fragments and row statistics, ``me`` its place
    in the block. Returns the stream and the state after the item (the persistent schedule's; a block of the
    ordinary grid takes one item)."""

    barriers: int
    init_barriers: object
    begin: object
    process_item: object


def grid_item(steps, tiles, hand_over):
    """``process_item`` of a block of the ordinary grid (one item): the item's tiles through the schedule's
    ``tiles(smem, view, bars, start, stats, inputs, items, walk, scale_log2, first, end, n_tiles, stream, ring,
    tiles_done, regs, me)`` (``ring``: ``(stage, parity, prev_stage, prev_parity)`` of the item's first tile,
    ``tiles_done`` the block's tiles before it; returns the stream and the ring after the item), the rows'
    statistics made whole, ``hand_over(stats, l_row, m_row, warp, g, t, group)`` (every warpgroup then has
    its rows' statistics, and the Q tile is free for the output rows), then the write-out."""
    Q_FULL = steps.Q_FULL
    STAGED_OUT = not steps.SPLIT  # output rows staged in the Q tile, copied out in 16-byte chunks
    init, store_row_results = steps.init, steps.store_row_results
    stage_rows, copy_rows_out = steps.stage_rows, steps.copy_rows_out

    @cuda.jit(device=True, forceinline=True)
    def process_item(smem, view, bars, start, stats, inputs, outputs, scale_log2, heads, items, walk, b, c, first,
                     end, n_tiles, stream, state, regs, me):
        o, lse, o_part, lse_part = outputs
        m_i, l_i, row_max, alpha, acc, s, p_frag, l_row, m_row = regs
        tid, warp, g, t, group, other, my_row, my_lane = me
        stage, parity, prev_stage, prev_parity, tiles_done, _, _, _ = state
        head0 = c * HEADS_PER_BLOCK
        init(m_i, l_i, acc)
        if n_tiles > 0:
            mbarrier_wait(bars, Q_FULL, 0)
        stream, _ = tiles(smem, view, bars, start, stats, inputs, items, walk, scale_log2, first, end, n_tiles, stream,
                          (stage, parity, prev_stage, prev_parity), tiles_done, regs, me)
        for half in range(2):  # the scorers' row statistics: full sums over the lane quad
            l_row[half], m_row[half] = quad_sum(l_i[half]), m_i[half]
        hand_over(stats, l_row, m_row, warp, g, t, group)
        store_row_results(o_part, lse, lse_part, acc, l_row, m_row, b, head0, 0, heads, warp, g, t, group)
        if STAGED_OUT:
            stage_rows(view, acc, l_row, tid, warp, group, 0)
            copy_rows_out(o, view, b, head0, 0, heads, tid, group)

    return process_item


def duplicated_schedule(steps):
    """The ``"duplicated"`` schedule on ``steps`` (``kernel_steps``): each warpgroup computes S, the softmax
    and ``P V`` of its columns, the two taking turns on the tensor cores (named barriers TURN + w), and
    refills the panels it copies once its own ``P V`` of a tile is complete and the other's scores of the
    tile are done (mbarriers SCORED + STAGES·w + s: warpgroup w's scores of stage s done)."""
    BLOCK_N, STAGES, O_REGS, S_REGS = steps.BLOCK_N, steps.STAGES, steps.O_REGS, steps.S_REGS
    FULL, Q_FULL, SCORED = steps.FULL, steps.Q_FULL, steps.SCHEDULE_BARRIERS
    COPIERS, Q_LOADERS = steps.COPIERS, steps.Q_LOADERS
    STAGED_OUT = not steps.SPLIT  # output rows staged in the Q tile, copied out in 16-byte chunks
    scores, wait_tile, issue_scores = steps.scores, steps.wait_tile, steps.issue_scores
    softmax_tile, issue_pv = steps.softmax_tile, steps.issue_pv
    stream_more, copy_next = steps.stream_more, steps.copy_next

    @cuda.jit(device=True, forceinline=True)
    def init_barriers(bars):
        for stage in range(STAGES):
            mbarrier_init(bars, FULL + stage, COPIERS)
            for w in range(GROUPS):
                mbarrier_init(bars, SCORED + STAGES * w + stage, 128)
        mbarrier_init(bars, Q_FULL, Q_LOADERS)
        mbarrier_init(bars, Q_FULL + 1, Q_LOADERS)

    @cuda.jit(device=True, forceinline=True)
    def begin(group):
        if group == GROUPS - 1:
            barrier_arrive(TURN, THREADS)  # the first warpgroup goes first

    @cuda.jit(device=True, forceinline=True)
    def tiles(smem, view, bars, start, stats, inputs, items, walk, scale_log2, first, end, n_tiles, stream, ring,
              tiles_done, regs, me):
        """An item's ``n_tiles`` tiles (keys ``first .. end``) through both warpgroups in turn, the last
        ``P V`` complete at the end (see ``grid_item``; no P tile, so ``tiles_done`` goes unused)."""
        _, _, ckv, kpe, page_table, seqlens = inputs
        m_i, l_i, row_max, alpha, acc, s, p_frag, _, _ = regs
        _, _, g, t, group, other, my_row, my_lane = me
        stage, parity, prev_stage, prev_parity = ring
        scorer = scores(group)  # every warpgroup, in this schedule
        for j in range(n_tiles):
            wait_tile(bars, stage, parity)
            barrier_sync(TURN + group, THREADS)  # this warpgroup's turn on the tensor cores
            if j > 0:
                issue_pv(acc, p_frag, smem, start, prev_stage, group)
            issue_scores(s, smem, start, stage)
            barrier_arrive(TURN + other, THREADS)
            # refill the stage of the tile before with the stream's next: this warpgroup's panels of it are
            # free once its P V of it is complete and the other's scores of it are done
            more = stream_more(stream, j + STAGES - 1)
            if j > 0:
                wgmma_wait(1)
                fence_registers(acc, O_REGS)
                if more:
                    mbarrier_wait(bars, SCORED + STAGES * other + prev_stage, prev_parity)
            if more:
                stream = copy_next(view, bars, ckv, kpe, prev_stage, stream, page_table, seqlens, items, walk, group,
                                   my_row, my_lane)
            wgmma_wait(0)
            fence_registers(s, S_REGS)
            mbarrier_arrive(bars, SCORED + STAGES * group + stage)
            softmax_tile(s, acc, p_frag, m_i, l_i, row_max, alpha, scale_log2, first + j * BLOCK_N, end, g, t)
            prev_stage, prev_parity = stage, parity
            stage += 1
            if stage == STAGES:
                stage, parity = 0, parity ^ 1
        if n_tiles > 0 and scorer:  # the last tile's P V
            barrier_sync(TURN + group, THREADS)
            issue_pv(acc, p_frag, smem, start, prev_stage, group)
            barrier_arrive(TURN + other, THREADS)
            wgmma_wait(0)
            fence_registers(acc, O_REGS)
        return stream, (stage, parity, prev_stage, prev_parity)

    @cuda.jit(device=True, forceinline=True)
    def hand_over(stats, l_row, m_row, warp, g, t, group):
        """Each warpgroup has its rows' statistics already; with output rows to stage, both warpgroups' last
        products complete first, which frees the Q tile."""
        if STAGED_OUT:
            cuda.syncthreads()

    return Schedule(3 * STAGES + 2, init_barriers, begin, grid_item(steps, tiles, hand_over))


class SharedParts(NamedTuple):
    """What the two shared schedules share (``shared_parts``): the numbers of the mbarriers that the persistent
    one waits on or adds (``p_free``; ``stats_ready``, ``half_free``), their count and the set-up of the
    others; ``begin``; the tile loop of both warpgroups (``tiles``)."""

    p_free: int
    stats_ready: int
    half_free: int
    barriers: int
    init_barriers: object
    begin: object
    tiles: object


def shared_parts(steps):
    """The tile loop of the ``"shared"`` schedules on ``steps``: warpgroup 0 computes S, the softmax and its
    half of ``P V``, and hands P and the rows' rescaling factors to warpgroup 1 through the P tile (mbarriers
    P_READY: warpgroup 0 wrote P, P_FREE: warpgroup 1 read it); warpgroup 1 copies the latent tiles and adds
    ``P V`` for its columns. The persistent schedule's mbarriers follow: STATS_READY (warpgroup 0 wrote an
    item's final row statistics), HALF_FREE (warpgroup 0 copied out its part of an item's output rows)."""
    BLOCK_N, STAGES, O_REGS, S_REGS = steps.BLOCK_N, steps.STAGES, steps.O_REGS, steps.S_REGS
    FULL, Q_FULL, COPIERS, Q_LOADERS = steps.FULL, steps.Q_FULL, steps.COPIERS, steps.Q_LOADERS
    P_READY = steps.SCHEDULE_BARRIERS
    P_FREE, STATS_READY, HALF_FREE = P_READY + 1, P_READY + 2, P_READY + 3
    scores, wait_tile, issue_scores = steps.scores, steps.wait_tile, steps.issue_scores
    softmax_tile, issue_pv, issue_pv_shared = steps.softmax_tile, steps.issue_pv, steps.issue_pv_shared
    share_p, take_factors = steps.share_p, steps.take_factors
    stream_more, copy_next = steps.stream_more, steps.copy_next

    @cuda.jit(device=True, forceinline=True)
    def init_barriers(bars):
        for stage in range(STAGES):
            mbarrier_init(bars, FULL + stage, COPIERS)
        mbarrier_init(bars, Q_FULL, Q_LOADERS)
        mbarrier_init(bars, Q_FULL + 1, Q_LOADERS)
        mbarrier_init(bars, P_READY, 128)
        mbarrier_init(bars, P_FREE, 128)

    @cuda.jit(device=True, forceinline=True)
    def begin(group):
        """Nothing: the shared schedules start on the first tile's mbarriers alone."""

    @cuda.jit(device=True, forceinline=True)
    def tiles(smem, view, bars, start, stats, inputs, items, walk, scale_log2, first, end, n_tiles, stream, ring,
              tiles_done, regs, me):
        """An item's ``n_tiles`` tiles (keys ``first .. end``) through both warpgroups, warpgroup 0's last
        ``P V`` complete at the end; ``ring``: ``(stage, parity, prev_stage, prev_parity)`` of its first tile,
        ``tiles_done`` the block's tiles before it (the P tile's uses). Returns the stream and the ring after
        the item."""
        _, _, ckv, kpe, page_table, seqlens = inputs
        m_i, l_i, row_max, alpha, acc, s, p_frag, _, _ = regs
        _, warp, g, t, group, _, my_row, my_lane = me
        stage, parity, prev_stage, prev_parity = ring
        scorer = scores(group)
        for j in range(n_tiles):
            if scorer:
                wait_tile(bars, stage, parity)
                if j > 0:
                    issue_pv(acc, p_frag, smem, start, prev_stage, group)
                issue_scores(s, smem, start, stage)
                wgmma_wait(0)
                fence_registers(acc, O_REGS)
                fence_registers(s, S_REGS)
                rescaled = softmax_tile(s, acc, p_frag, m_i, l_i, row_max, alpha, scale_log2, first + j * BLOCK_N,
                                        end, g, t)
                # hand P over once warpgroup 1 has read the previous one
                if tiles_done + j > 0:
                    mbarrier_wait(bars, P_FREE, (tiles_done + j - 1) & 1)
                share_p(view, stats, p_frag, alpha, rescaled, warp, g, t)
                fence_proxy_async()
                mbarrier_arrive(bars, P_READY)
            else:
                mbarrier_wait(bars, P_READY, (tiles_done + j) & 1)
                take_factors(stats, acc, warp, g)
                wait_tile(bars, stage, parity)
                issue_pv_shared(acc, smem, start, stage)
                wgmma_wait(0)
                fence_registers(acc, O_REGS)
                mbarrier_arrive(bars, P_FREE)
                # the tile before is done with: warpgroup 0 completed its products of it before handing over
                # this P, so its stage takes the stream's next tile
                if stream_more(stream, j + STAGES - 1):
                    stream = copy_next(view, bars, ckv, kpe, prev_stage, stream, page_table, seqlens, items, walk,
                                       group, my_row, my_lane)
            prev_stage, prev_parity = stage, parity
            stage += 1
            if stage == STAGES:
                stage, parity = 0, parity ^ 1
        if n_tiles > 0 and scorer:
            issue_pv(acc, p_frag, smem, start, prev_stage, group)
            wgmma_wait(0)
            fence_registers(acc, O_REGS)
        return stream, (stage, parity, prev_stage, prev_parity)

    return SharedParts(P_FREE, STATS_READY, HALF_FREE, STAGES + 6, init_barriers, begin, tiles)


def shared_schedule(steps):
    """The ``"shared"`` schedule on the ordinary grid (``shared_parts``): warpgroup 0 hands its rows' final
    statistics to warpgroup 1 at a block barrier, which also leaves the Q tile free for the output rows."""
    parts = shared_parts(steps)
    share_sums, take_sums = steps.share_sums, steps.take_sums

    @cuda.jit(device=True, forceinline=True)
    def hand_over(stats, l_row, m_row, warp, g, t, group):
        if group == 0:
            share_sums(stats, l_row, m_row, warp, g, t)
        cuda.syncthreads()  # also: every product is complete, the Q tile free for the output rows
        if group == 1:
            take_sums(stats, l_row, m_row, warp, g)

    return Schedule(parts.barriers, parts.init_barriers, parts.begin, grid_item(steps, parts.tiles, hand_over))


def persistent_schedule(steps):
    """The ``"shared"`` schedule on the persistent grid (``shared_parts`` and the module docstring): the block's
    items in turn, each in its own half of the Q tile (its queries loaded an item ahead by warpgroup 1, its
    output rows staged there), the final row statistics handed over through mbarriers."""
    R, Q_FULL = steps.R, steps.Q_FULL
    parts = shared_parts(steps)
    P_FREE, STATS_READY, HALF_FREE, tiles = parts.p_free, parts.stats_ready, parts.half_free, parts.tiles
    init_shared_barriers = parts.init_barriers
    init, load_q_async, next_with_keys = steps.init, steps.load_q_async, steps.next_with_keys
    share_sums, take_sums = steps.share_sums, steps.take_sums
    store_row_results, stage_rows, copy_rows_out = steps.store_row_results, steps.stage_rows, steps.copy_rows_out

    @cuda.jit(device=True, forceinline=True)
    def init_barriers(bars):
        init_shared_barriers(bars)
        mbarrier_init(bars, STATS_READY, 128)
        mbarrier_init(bars, HALF_FREE, 128)

    @cuda.jit(device=True, forceinline=True)
    def process_item(smem, view, bars, start, stats, inputs, outputs, scale_log2, heads, items, walk, b, c, first,
                     end, n_tiles, stream, state, regs, me):
        """One of the block's items (see ``Schedule``)."""
        q_nope, q_pe, _, _, _, seqlens = inputs
        o, lse, o_part, lse_part = outputs
        m_i, l_i, row_max, alpha, acc, s, p_frag, l_row, m_row = regs
        tid, warp, g, t, group, other, my_row, my_lane = me
        stage, parity, prev_stage, prev_parity, tiles_done, items_done, q_b, q_c = state
        head0 = c * HEADS_PER_BLOCK
        q_half = items_done & 1  # the item's Q half
        q_row0 = PERSISTENT_HEADS * q_half  # the M row of the item's first head
        init(m_i, l_i, acc)
        if n_tiles > 0 and group == 0:
            mbarrier_wait(bars, Q_FULL + q_half, (items_done >> 1) & 1)
        stream, ring = tiles(smem, view, bars, start, stats, inputs, items, walk, scale_log2, first, end, n_tiles,
                             stream, (stage, parity, prev_stage, prev_parity), tiles_done, regs, me)
        # the epilogue's addresses taken in each item, not held (or spilled) across the tile loop
        tid = opaque(tid)
        warp, g, t = tid // 32, tid % 32 // 4, tid % 4
        group = warp // 4
        for half in range(2):  # warpgroup 0's row statistics: full sums over the lane quad
            l_row[half], m_row[half] = quad_sum(l_i[half]), m_i[half]
        tiles_done += n_tiles
        # an item without keys hands nothing over (warpgroup 1's sums of 0 give zeros); a handover waits until
        # warpgroup 1 has taken every P of the item, so that it has read the previous item's statistics
        if n_tiles > 0:
            if group == 0:
                mbarrier_wait(bars, P_FREE, (tiles_done - 1) & 1)
                share_sums(stats, l_row, m_row, warp, g, t)
                mbarrier_arrive(bars, STATS_READY)
            if group == 1:
                mbarrier_wait(bars, STATS_READY, items_done & 1)
                take_sums(stats, l_row, m_row, warp, g)
        if n_tiles > 0:
            items_done += 1
        store_row_results(o_part, lse, lse_part, acc, l_row, m_row, b, head0, q_row0, heads, warp, g, t, group)
        if n_tiles == 0:  # no keys: zero rows, stored directly (the Q halves are taken)
            for i in range(tid, heads * R, THREADS):
                o[b, i // R, i % R] = uint16(0)
        else:
            # the output rows go out through the item's half of the Q tile, its queries used up
            stage_rows(view, acc, l_row, tid, warp, group, q_half)
            copy_rows_out(o, view, b, head0, q_row0, heads, tid, group)
            # once both warpgroups' rows are out, warpgroup 1 loads the Q of the item after next
            if group == 0:
                mbarrier_arrive(bars, HALF_FREE)
            else:
                q_b, q_c = next_with_keys(q_b, q_c, seqlens, items)
                barrier_sync(STAGED + group, 128)  # its own rows read by all its threads
                mbarrier_wait(bars, HALF_FREE, (items_done - 1) & 1)  # warpgroup 0's rows
                if q_b < items[0]:
                    load_q_async(view, bars, q_nope, q_pe, q_b, q_c * HEADS_PER_BLOCK, heads, q_half)
        return stream, ring + (tiles_done, items_done, q_b, q_c)

    return Schedule(parts.barriers, init_barriers, parts.begin, process_item)


def block_kernel(steps, schedule):
    """The kernel running ``schedule`` (``Schedule``) on ``steps``: a block's place and first item (the ordinary
    grid's: its grid position's; the persistent grid's: sequence ``blockIdx.x``, then every ``gridDim.x``-th),
    the schedule's mbarriers, the Q tile and first tiles but one of the copy stream, then the block's items
    through ``schedule.process_item``."""
    BLOCK_N, STAGES, NTILES, DTILES, PSTEPS = steps.BLOCK_N, steps.STAGES, steps.NTILES, steps.DTILES, steps.PSTEPS
    VIEW_ROWS, ROW_THREADS, PERSISTENT = steps.VIEW_ROWS, steps.ROW_THREADS, steps.PERSISTENT
    item_span, next_item, stream_at = steps.item_span, steps.next_item, steps.stream_at
    stream_start, stream_more, copy_next = steps.stream_start, steps.stream_more, steps.copy_next
    load_first_q, copies_tiles = steps.load_first_q, steps.copies_tiles
    BARRIERS, init_barriers, begin, process_item = schedule

    def kernel(q_nope, q_pe, ckv, kpe, page_table, seqlens, o, lse, o_part, lse_part, scale_log2):
        smem = cuda.shared.array(0, uint16)
        bars = cuda.shared.array(BARRIERS, int64)
        start = aligned_start(smem, SW128_ALIGN)
        view = tile_view(smem, start, VIEW_ROWS, 64)
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        g, t = lane // 4, lane % 4
        group = warp // 4
        heads, page_size = q_nope.shape[1], ckv.shape[1]
        capacity = page_table.shape[1] * page_size
        walk = (page_size, BLOCK_N // page_size, BLOCK_N % page_size)  # see next_row
        my_row = (tid % 128) // ROW_THREADS  # the latent row of each tile this thread copies
        my_lane = tid % ROW_THREADS
        if PERSISTENT:  # the block's sequences b (head chunk c = 0) are blockIdx.x, + gridDim.x, ...
            batch, step = seqlens.shape[0], int64(cuda.gridDim.x)
            items = (batch, step, capacity, int64(my_row), my_row // page_size, my_row % page_size)
            b, c = int64(cuda.blockIdx.x), int64(0)
            rounds = -(-(batch - b) // step)
            stream = stream_at(b, c, page_table, seqlens, items)
        else:  # the grid position's item and key split
            items = None  # only persistent streams cross items
            b, c = int64(cuda.blockIdx.z), int64(cuda.blockIdx.y)
            first, end, n_tiles = item_span(b, seqlens, capacity, cuda.blockIdx.x, cuda.gridDim.x)
            stream = stream_start(b, c, first, end, n_tiles, page_table, walk, my_row)
        other = (group + 1) % GROUPS

        if tid == 0:
            init_barriers(bars)
        cuda.syncthreads()
        q_b, q_c = stream[0], stream[1]  # the last item whose Q is loaded
        # the Q tile of the stream's first item (persistent: also the next one's), then its first tiles but one
        if stream[3] > 0:
            q_b, q_c = load_first_q(view, bars, q_nope, q_pe, seqlens, items, heads, q_b, q_c, group)
            if copies_tiles(group):
                for j in range(STAGES - 1):  # each thread's next page is looked up a tile ahead
                    if stream_more(stream, j):
                        stream = copy_next(view, bars, ckv, kpe, j, stream, page_table, seqlens, items, walk, group,
                                           my_row, my_lane)
            begin(group)

        m_i = cuda.local.array(2, float32)
        l_i = cuda.local.array(2, float32)
        row_max = cuda.local.array(2, float32)
        alpha = cuda.local.array(2, float32)
        acc = cuda.local.array((1, DTILES, 4), float32)
        s = cuda.local.array((1, NTILES, 4), float32)
        p_frag = cuda.local.array((PSTEPS, 4), uint32)
        l_row = cuda.local.array(2, float32)
        m_row = cuda.local.array(2, float32)
        # the shared schedule's row statistics, after the P tile (a view that the duplicated one never reads)
        stats = cuda.shared.array(0, float32)[(start + 64 * VIEW_ROWS) // 2:]

        inputs, outputs = (q_nope, q_pe, ckv, kpe, page_table, seqlens), (o, lse, o_part, lse_part)
        regs = (m_i, l_i, row_max, alpha, acc, s, p_frag, l_row, m_row)
        me = (tid, warp, g, t, group, other, my_row, my_lane)
        # the ring and handover position (see Schedule); typed, not literal, integers: from a tuple of
        # literals the persistent loop would type and lower process_item twice (for the literals, then for the
        # state it returns), a second a compile
        state = (int64(0), int64(0), int64(STAGES - 1), int64(1), int64(0), int64(0), q_b, q_c)
        if PERSISTENT:
            for _ in range(rounds):  # the block's items in turn
                first, end, n_tiles = item_span(b, seqlens, capacity, 0, 1)
                stream, state = process_item(smem, view, bars, start, stats, inputs, outputs, scale_log2, heads, items,
                                             walk, b, c, first, end, n_tiles, stream, state, regs, me)
                b, c = next_item(b, c, items)
        else:
            process_item(smem, view, bars, start, stats, inputs, outputs, scale_log2, heads, items, walk, b, c, first,
                         end, n_tiles, stream, state, regs, me)

    if SIMULATOR:  # the simulator's jit takes no register limit
        return cuda.jit(kernel)
    return cuda.jit(kernel, max_registers=255)


@functools.lru_cache(maxsize=None)
def mla_wgmma_kernel(dtype, rank, rope, block_n, stages, qk, split, write_lse, persistent=False):
    """Numba kernel with the arguments of ``mla.mla_decode_kernel``; grid ``(S, cdiv(H, 64), B)``,
    ``THREADS`` threads, ``mla_wgmma_shared_bytes`` of dynamic shared memory. ``rank`` a multiple
    of 128 (each warpgroup's columns are whole panels), ``block_n`` a multiple of 16 up to 64,
    ``qk`` "duplicated" or "shared"; ``o`` with contiguous rows starting at 16-byte boundaries.
    ``persistent`` (shared schedule, no splits, at most ``PERSISTENT_HEADS`` heads): a 1-D grid of any
    size whose blocks take the sequences in turn (see the module docstring)."""
    if persistent and (qk != "shared" or split):
        raise ValueError("the persistent wgmma MLA kernel runs the shared schedule without key splits")
    shared = qk == "shared"
    steps = kernel_steps(dtype, rank, rope, block_n, stages, shared, split, write_lse, persistent)
    build = persistent_schedule if persistent else shared_schedule if shared else duplicated_schedule
    return block_kernel(steps, build(steps))
