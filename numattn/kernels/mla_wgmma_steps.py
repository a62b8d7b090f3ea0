"""The steps that the schedules of the MLA wgmma kernel (``mla_wgmma.py``) share: the shared-memory layout
(the Q tile, the ring of latent tiles, the shared schedule's P tile and row statistics), the copy streams
that fill the ring, the Q tile's loads, the score and ``P V`` products, the online softmax of a score tile,
and the write-out of an item's output rows, log-sum-exps and key-split partials.
"""

import math
from types import SimpleNamespace

import numpy as np
from numba import int32, int64

from .._cuda import cuda
from .constants import LN2_F32
from .online_softmax import EAGER, RESCALE, p_fragments, softmax_steps
from .ptx import (
    SW128_ALIGN,
    barrier_sync,
    copy_16_to_global,
    cp_async_16_at,
    cp_async_mbarrier_arrive,
    fence_proxy_async,
    fence_registers,
    global_address,
    mbarrier_wait,
    pack_bf16x2,
    pack_f16x2,
    st_shared_b32,
    stmatrix_x4,
    wgmma_commit,
    wgmma_descriptor,
    wgmma_fence,
    wgmma_rs_bf16,
    wgmma_rs_f16,
    wgmma_ss_bf16,
    wgmma_ss_desc_bf16,
    wgmma_ss_desc_f16,
    wgmma_ss_f16,
)
from .score_mods import NO_TERMS

HEADS_PER_BLOCK = 64  # one m64 product
PERSISTENT_HEADS = HEADS_PER_BLOCK // 2  # the persistent kernel's heads: one half of the Q tile per item
ELEM = 2  # bytes per element: the kernel takes 16-bit floats
GROUPS = 2  # warpgroups, each owning half the output columns
THREADS = 128 * GROUPS
STAGED = 3  # named barriers STAGED + w: warpgroup w's output rows are staged
_NEG_INF = np.float32(-np.inf)
_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)


def wgmma_panels(rank, rope):
    """64-column panels of a shared-memory latent row ``[ckv | kpe]``."""
    return -(-(rank + rope) // 64)


# the shared schedule's P tile (one 64-column panel of 64 rows) and float32 row statistics:
# rescaling factors, then each row's final sum and max, then a rescale flag per warp
P_TILE_BYTES = 2 * 64 * HEADS_PER_BLOCK
STATS = 3 * HEADS_PER_BLOCK + 4
ALPHA, L_FINAL, M_FINAL, FLAGS = 0, HEADS_PER_BLOCK, 2 * HEADS_PER_BLOCK, 3 * HEADS_PER_BLOCK


def mla_wgmma_shared_bytes(block_n, stages, rank, rope, shared_scores):
    """The Q tile of 64 heads and ``stages`` latent tiles, in whole panels, slack to align them, and
    with ``shared_scores`` the P tile and row statistics."""
    tiles = 2 * 64 * wgmma_panels(rank, rope) * (HEADS_PER_BLOCK + stages * block_n) + SW128_ALIGN
    return tiles + (P_TILE_BYTES + 4 * STATS if shared_scores else 0)


def softmax_headroom(dtype):
    """The online softmax's rescale headroom in the MLA kernels. Eager in bf16: lazily rescaled, its
    dominant P lose bits to bf16's 8-bit significand, and outputs were 5–10% less accurate than SDPA's
    (as accurate eagerly; see benchmarks). Lazy in fp16, whose rate eager rescaling would cost 0.4–0.6%."""
    return EAGER if dtype == "bfloat16" else RESCALE


def copy_streams(block_n, persistent, locate, next_row, load_tile_async):
    """Device functions of the copy streams that bring an item's latent tiles (an item: a sequence and a
    chunk of its heads) into the ring, one row per thread: ``(item_span, next_item, next_with_keys,
    stream_at, stream_start, copy_next, stream_more)``. Ordinary blocks take one item (and one key split
    of it); ``persistent`` blocks take the items of sequences ``blockIdx.x``, ``+ gridDim.x``, ... in turn,
    their streams running on into the next item with keys. ``locate``, ``next_row`` and
    ``load_tile_async`` are the kernel's page-table walk and tile copy."""
    BLOCK_N, PERSISTENT = block_n, persistent

    @cuda.jit(device=True, forceinline=True)
    def item_span(b, seqlens, capacity, split, splits):
        """``(first, end, n_tiles)``: the keys of sequence ``b`` a block takes, all of them (persistent)
        or key split ``split`` of ``splits``, and their tiles."""
        seqlen = min(max(seqlens[b], 0), capacity)
        if PERSISTENT:
            return int64(0), seqlen, -(-seqlen // BLOCK_N)
        per_split = -(-seqlen // splits)
        first, end = split * per_split, min(seqlen, (split + 1) * per_split)
        return first, end, max(0, -(-(end - first) // BLOCK_N))

    @cuda.jit(device=True, forceinline=True)
    def next_item(b, c, items):
        """The item after (sequence ``b``, head chunk ``c``) among a persistent block's: ``items`` is
        ``(batch, grid size, ...)``; its sequences have one head chunk (``c`` stays 0)."""
        return b + items[1], c

    @cuda.jit(device=True, forceinline=True)
    def with_keys(b, c, seqlens, items):
        """The first of a persistent block's items from (``b``, ``c``) on whose sequence has keys
        (``b`` at or past the batch if none)."""
        batch, capacity = items[0], items[2]
        while b < batch and min(seqlens[b], capacity) <= 0:
            b, c = next_item(b, c, items)
        return b, c

    @cuda.jit(device=True, forceinline=True)
    def next_with_keys(b, c, seqlens, items):
        """The first of a persistent block's items after (``b``, ``c``) whose sequence has keys."""
        b, c = next_item(b, c, items)
        return with_keys(b, c, seqlens, items)

    @cuda.jit(device=True, forceinline=True)
    def stream_at(b, c, page_table, seqlens, items):
        """A persistent thread's copy stream at the first tile of item (``b``, ``c``) or, when that has no
        keys, of the next one with keys: ``(b, c, end, tiles left, key, slot, offset, page, position)``
        as ``stream_start`` gives it (past the last item: no tiles left)."""
        b, c = with_keys(b, c, seqlens, items)
        if b >= items[0]:
            return b, c, int64(0), int64(0), int64(0), int64(0), int64(0), int32(0), int64(0)
        _, end, n_tiles = item_span(b, seqlens, items[2], 0, 1)
        key, slot, offset = items[3], items[4], items[5]  # this thread's first row of any item
        page, position = locate(page_table, b, key, end, slot, offset)
        return b, c, end, n_tiles, key, slot, offset, page, position

    @cuda.jit(device=True, forceinline=True)
    def stream_start(b, c, first, end, n_tiles, page_table, walk, my_row):
        """A thread's copy stream at the first of ``n_tiles`` tiles from key ``first`` of sequence ``b``,
        head chunk ``c``: ``(b, c, end, tiles left, key, slot, offset, page, position)``; ``key`` is the
        thread's row of the tile, ``slot`` and ``offset`` its page-table entry and place in that page, ``page``
        and ``position`` what ``locate`` gives to copy it from."""
        key = first + my_row
        slot, offset = key // walk[0], key % walk[0]
        page, position = locate(page_table, b, key, end, slot, offset)
        return b, c, end, n_tiles, key, slot, offset, page, position

    @cuda.jit(device=True, forceinline=True)
    def copy_next(view, bars, ckv, kpe, stage, stream, page_table, seqlens, items, walk, group, my_row, my_lane):
        """Start this thread's copies of its stream's next tile into ring ``stage``; the stream moves on
        to its row of the tile after, in this item or (persistent) the next one with keys."""
        b, c, end, left, key, slot, offset, page, position = stream
        load_tile_async(view, bars, ckv, kpe, stage, page, position, key < end, group, my_row, my_lane)
        if PERSISTENT and left == 1:
            next_b, next_c = next_item(b, c, items)
            return stream_at(next_b, next_c, page_table, seqlens, items)
        key, slot, offset, page, position = next_row(page_table, b, key, slot, offset, end, walk[0], walk[1], walk[2])
        return b, c, end, left - 1 if PERSISTENT else left, key, slot, offset, page, position

    @cuda.jit(device=True, forceinline=True)
    def stream_more(stream, issued):
        """Whether the copy stream has a tile left: a persistent stream counts its tiles down; otherwise
        ``issued`` of the item's ``stream[3]`` tiles have been started."""
        if PERSISTENT:
            return stream[3] > 0
        return issued < stream[3]

    return item_span, next_item, next_with_keys, stream_at, stream_start, copy_next, stream_more



def kernel_steps(dtype, rank, rope, block_n, stages, shared_scores, split, write_lse, persistent):
    """The compile-time sizes and the device functions of the steps that every schedule of one MLA wgmma
    kernel runs, as a namespace. ``rank``, ``rope``, ``block_n`` and ``stages`` as ``mla_wgmma_kernel`` takes
    them; ``shared_scores``: the shared schedules' layout (warpgroup 0 alone computes scores, warpgroup 1
    copies whole latent tiles; the P tile and row statistics follow the ring); ``split``: key-split partials
    instead of output rows; ``write_lse``: log-sum-exps too (without splits); ``persistent``: the persistent
    grid's items (copy streams run on across items, the Q tile holds two items' queries).

    mbarriers ``FULL + s`` (ring stage s loaded, by ``COPIERS`` threads) and ``Q_FULL + q`` (Q half q loaded
    by ``Q_LOADERS`` threads; the whole tile unless persistent) are every schedule's; a schedule numbers its
    own from ``SCHEDULE_BARRIERS`` on."""
    R, P, BLOCK_N, STAGES = rank, rope, block_n, stages
    SHARED, SPLIT, WRITE_LSE, PERSISTENT = shared_scores, split, write_lse, persistent
    PANELS = wgmma_panels(R, P)
    KSTEPS, PSTEPS = (R + P) // 16, BLOCK_N // 16  # k-steps of S = Q Kᵀ and of O += P V
    COLS = R // GROUPS  # output columns per warpgroup
    NTILES, DTILES = BLOCK_N // 8, COLS // 8
    S_REGS, O_REGS = BLOCK_N // 2, COLS // 2
    GROUP_CHUNKS = R // 8 // GROUPS  # 16-byte chunks of a warpgroup's output columns in a row
    OUT_ROWS_PER_PASS = 128 // GROUP_CHUNKS  # output rows a warpgroup copies out at once, a thread to a chunk
    ROW_THREADS = 128 // BLOCK_N  # threads of a warpgroup copying one latent row
    PANEL_COPIES = 8 // ROW_THREADS  # a thread's chunks of a panel of its row
    OWN_PANELS = R // 64 // GROUPS  # the ckv panels a warpgroup multiplies by P
    ROPE_CHUNKS = P // 8
    ROPE_PANELS = -(-ROPE_CHUNKS // 8)
    # shared memory as 128-byte rows of a 64-column view: the Q tile, then STAGES latent tiles
    Q_ROWS = PANELS * HEADS_PER_BLOCK
    TILE_ROWS = PANELS * BLOCK_N
    P_ROW0 = Q_ROWS + STAGES * TILE_ROWS  # the shared schedule's P tile, then its row statistics
    VIEW_ROWS = P_ROW0 + (HEADS_PER_BLOCK if SHARED else 0)
    V_PANEL = 64 * BLOCK_N  # elements between the 64-column panels of a latent tile
    FULL, Q_FULL = 0, STAGES
    Q_HALF = PERSISTENT_HEADS if PERSISTENT else 0  # rows between the persistent kernel's two Q halves
    # shared: warpgroup 1 copies whole latent tiles; duplicated: each warpgroup the ckv panels it multiplies
    # by P, and warpgroup 0 the kpe columns
    COPY_PANELS = R // 64 if SHARED else OWN_PANELS
    COPIERS = 128 if SHARED else THREADS  # threads whose copies fill a ring stage: shared, warpgroup 1's
    Q_LOADERS = 128 if PERSISTENT else THREADS  # threads that load Q tiles: persistent, warpgroup 1's
    Q_ROWS_PER_PASS = Q_LOADERS // 8  # Q tile rows copied at once, 8 threads per row
    bf16 = dtype == "bfloat16"
    wgmma_ss, wgmma_rs = (wgmma_ss_bf16, wgmma_rs_bf16) if bf16 else (wgmma_ss_f16, wgmma_rs_f16)
    wgmma_ss_desc = wgmma_ss_desc_bf16 if bf16 else wgmma_ss_desc_f16
    pack = pack_bf16x2 if bf16 else pack_f16x2
    init, scale_and_mask, update, rescale, _, _ = softmax_steps(1, NTILES, DTILES, False, dtype,
                                                                softmax_headroom(dtype))
    pack_p = p_fragments(PSTEPS, dtype)

    @cuda.jit(device=True, forceinline=True)
    def locate(page_table, b, key, end, slot, offset):
        """(page index as stored, position) of latent row ``key`` of sequence ``b``, entry ``slot`` of
        its page table at ``offset``; (0, 0) from ``end`` on. The index stays int32 and is clamped where
        it is used, a tile later, so that nothing waits for its read here (not even a sign extension)."""
        if key >= end:
            return int32(0), 0
        return page_table[b, slot], offset

    @cuda.jit(device=True, forceinline=True)
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

    @cuda.jit(device=True, forceinline=True)
    def load_tile_async(view, bars, ckv, kpe, stage, page, position, valid, group, r, lane):
        """Start this thread's copies into ring ``stage`` of its row ``r`` of a latent tile, the panels its
        warpgroup copies (zeros unless ``valid``); the stage's FULL barrier counts them in.

        The ``ROW_THREADS`` threads of a row take alternate 16-byte chunks (``lane`` the first),
        so that together they read whole sectors; a chunk's place in the swizzled panel row
        depends on the thread alone, the panel adds a constant, and so does each chunk's offset
        from the thread's first in the latent row."""
        nbytes = 16 if valid else 0
        page = min(max(page, 0), ckv.shape[0] - 1)
        first_panel = 0 if SHARED else group * OWN_PANELS
        tile_row = Q_ROWS + stage * TILE_ROWS + r  # the row in the tile's first panel
        row0 = tile_row + first_panel * BLOCK_N
        ckv_row = global_address(ckv, (page, position, 64 * first_panel + 8 * lane))
        rope_row = global_address(kpe, (page, position, 8 * lane))
        for k in range(PANEL_COPIES):
            col = ((lane + ROW_THREADS * k) ^ (r & 7)) * 8  # within the panel
            for p in range(COPY_PANELS):
                cp_async_16_at(view, row0 + p * BLOCK_N, col, ckv_row + ELEM * (64 * p + 8 * ROW_THREADS * k), nbytes)
            if SHARED or group == 0:
                for p in range(ROPE_PANELS):
                    if ROPE_CHUNKS % 8 == 0 or 8 * p + lane + ROW_THREADS * k < ROPE_CHUNKS:
                        cp_async_16_at(view, tile_row + (R // 64 + p) * BLOCK_N, col,
                                       rope_row + ELEM * (64 * p + 8 * ROW_THREADS * k), nbytes)
        cp_async_mbarrier_arrive(bars, FULL + stage)

    item_span, next_item, next_with_keys, stream_at, stream_start, copy_next, stream_more = copy_streams(
        BLOCK_N, PERSISTENT, locate, next_row, load_tile_async)

    @cuda.jit(device=True, forceinline=True)
    def scores(group):
        """Whether warpgroup ``group`` computes scores: warpgroup 0 in the shared schedule, both in the
        duplicated one."""
        return not SHARED or group == 0

    @cuda.jit(device=True, forceinline=True)
    def copies_tiles(group):
        """Whether warpgroup ``group`` copies latent tiles: warpgroup 1 in the shared schedule, both in the
        duplicated one."""
        return not SHARED or group == 1

    @cuda.jit(device=True, forceinline=True)
    def load_q_async(view, bars, q_nope, q_pe, b, head0, heads, half):
        """Start the copies of the Q tile, ``[q_nope | q_pe]`` of heads ``head0 ..`` (zeros past the last
        head) by ``Q_LOADERS`` threads, eight to a row, each taking the same 16-byte chunk of every panel;
        Q_FULL + ``half`` counts them in. The persistent kernel copies only its heads, into rows
        ``Q_HALF · half ..`` (the other rows keep whatever they held, which reaches only their own scores
        and output rows, never stored): a trip count known at run time keeps the compiler from unrolling
        the loop and holding every copy's addresses across the item loop."""
        rows = heads if PERSISTENT else HEADS_PER_BLOCK
        row0 = Q_HALF * half  # a multiple of 8: the rows' swizzle is r's
        lane = cuda.threadIdx.x % 8
        for r in range(cuda.threadIdx.x % Q_LOADERS // 8, rows, Q_ROWS_PER_PASS):
            valid = head0 + r < heads
            h = head0 + r if valid else 0
            nbytes = 16 if valid else 0
            col = (lane ^ (r & 7)) * 8
            nope_row = global_address(q_nope, (b, h, 8 * lane))
            for p in range(R // 64):
                cp_async_16_at(view, p * HEADS_PER_BLOCK + row0 + r, col, nope_row + ELEM * 64 * p, nbytes)
            if P > 0:
                pe_row = global_address(q_pe, (b, h, 8 * lane))
                for p in range(ROPE_PANELS):
                    if ROPE_CHUNKS % 8 == 0 or 8 * p + lane < ROPE_CHUNKS:
                        cp_async_16_at(view, (R // 64 + p) * HEADS_PER_BLOCK + row0 + r, col,
                                       pe_row + ELEM * 64 * p, nbytes)
        cp_async_mbarrier_arrive(bars, Q_FULL + half)

    @cuda.jit(device=True, forceinline=True)
    def load_first_q(view, bars, q_nope, q_pe, seqlens, items, heads, q_b, q_c, group):
        """Start the Q loads of the copy stream's first item (``q_b``, ``q_c``) and, persistent, of the next
        one with keys, into the other half; returns the last item whose Q is loaded."""
        if not PERSISTENT or group == 1:
            load_q_async(view, bars, q_nope, q_pe, q_b, q_c * HEADS_PER_BLOCK, heads, int64(0))
        if PERSISTENT:
            q_b, q_c = next_with_keys(q_b, q_c, seqlens, items)
            if q_b < items[0] and group == 1:
                load_q_async(view, bars, q_nope, q_pe, q_b, q_c * HEADS_PER_BLOCK, heads, int64(1))
        return q_b, q_c

    @cuda.jit(device=True, forceinline=True)
    def wait_tile(bars, stage, parity):
        """Wait until ring ``stage`` holds its tile (its ``parity``-th use), then make the copies visible to
        this thread visible to wgmma."""
        mbarrier_wait(bars, FULL + stage, parity)
        fence_proxy_async()

    @cuda.jit(device=True, forceinline=True)
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

    @cuda.jit(device=True, forceinline=True)
    def softmax_tile(s, acc, p_frag, m_i, l_i, row_max, alpha, scale_log2, n0, end, g, t):
        """The online softmax of the score tile of keys ``n0 ..`` (those from ``end`` on masked): ``s``
        into P, the rows' statistics updated and ``acc`` rescaled where they move, P packed into the
        A fragments of ``P V`` (``p_frag``). Returns whether the rows were rescaled (``alpha`` the
        factors)."""
        factor = scale_and_mask(s, scale_log2, n0 + BLOCK_N > end, 0, n0, end, 0, g, t, NO_TERMS)
        rescaled = update(s, m_i, l_i, row_max, alpha, factor)
        if rescaled:
            rescale(acc, alpha)
        pack_p(p_frag, s)
        return rescaled

    @cuda.jit(device=True, forceinline=True)
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

    @cuda.jit(device=True, forceinline=True)
    def issue_pv_shared(acc, smem, start, stage):
        """Warpgroup 1 of the shared schedule: ``O[:, its columns] += P V`` with P from the P tile."""
        v_tile = start + 64 * (Q_ROWS + stage * TILE_ROWS) + OWN_PANELS * V_PANEL
        p_tile = start + 64 * P_ROW0
        fence_registers(acc, O_REGS)
        wgmma_fence()
        for kk in range(PSTEPS):
            wgmma_ss(acc, COLS, smem, p_tile + 16 * kk, v_tile + 64 * 16 * kk, V_PANEL, True, True)
        wgmma_commit()

    @cuda.jit(device=True, forceinline=True)
    def share_p(view, stats, p_frag, alpha, rescaled, warp, g, t):
        """Warpgroup 0 of the shared schedule: P into the swizzled P tile (row-major, K-major A operand
        of warpgroup 1), the warp's rescale flag and, when set, its rows' factors."""
        for kk in range(PSTEPS):
            for half in range(2):
                r = 16 * warp + g + 8 * half
                for e in range(2):  # fragment entries 2·e + half: columns 16kk + 8e + 2t, + 1
                    # sw128_cell of one panel (BLOCK_N <= 64): chunk 2kk + e of row r, swizzled by r % 8 = g
                    st_shared_b32(view, P_ROW0 + r, ((2 * kk + e) ^ g) * 8 + 2 * t, p_frag[kk, 2 * e + half])
        if rescaled and t == 0:
            for half in range(2):
                stats[ALPHA + 16 * warp + g + 8 * half] = alpha[half]
        if cuda.threadIdx.x % 32 == 0:
            stats[FLAGS + warp] = _ONE if rescaled else _ZERO

    @cuda.jit(device=True, forceinline=True)
    def take_factors(stats, acc, warp, g):
        """Warpgroup 1 of the shared schedule: its rows of ``acc`` rescaled by the factors that warpgroup 0
        handed over with P (``share_p``), when its warp's flag says they moved."""
        if stats[FLAGS + warp % 4] != _ZERO:
            for half in range(2):
                factor = stats[ALPHA + 16 * (warp % 4) + g + 8 * half]
                for dt in range(DTILES):
                    acc[0, dt, 2 * half] *= factor
                    acc[0, dt, 2 * half + 1] *= factor

    @cuda.jit(device=True, forceinline=True)
    def share_sums(stats, l_row, m_row, warp, g, t):
        """Warpgroup 0 of the shared schedule: its rows' final sums and maxima into the row statistics."""
        if t == 0:
            for half in range(2):
                stats[L_FINAL + 16 * warp + g + 8 * half] = l_row[half]
                stats[M_FINAL + 16 * warp + g + 8 * half] = m_row[half]

    @cuda.jit(device=True, forceinline=True)
    def take_sums(stats, l_row, m_row, warp, g):
        """Warpgroup 1 of the shared schedule: its rows' final sums and maxima as warpgroup 0 shared them."""
        for half in range(2):
            l_row[half] = stats[L_FINAL + 16 * (warp % 4) + g + 8 * half]
            m_row[half] = stats[M_FINAL + 16 * (warp % 4) + g + 8 * half]

    @cuda.jit(device=True, forceinline=True)
    def store_row_results(o_part, lse, lse_part, acc, l_row, m_row, b, head0, q_row0, heads, warp, g, t, group):
        """This thread's part of the item's split partials (with key splits: its accumulator columns of its
        rows, normalised) and its rows' log2-sum-exps (warpgroup 0's first lane of a quad): partials' or,
        as natural logarithms, ``lse``'s when asked for. ``q_row0``: the M row of the item's first head."""
        for half in range(2):
            l_sum = l_row[half]
            r = 16 * (warp % 4) + g + 8 * half
            h = head0 + r - q_row0
            valid = 0 <= h < heads
            inv = _ONE / l_sum if l_sum != _ZERO else _ZERO
            if SPLIT:
                if valid:
                    for dt in range(DTILES):
                        for e in range(2):
                            col = group * COLS + 8 * dt + 2 * t + e
                            o_part[b, h, 0, cuda.blockIdx.x, col] = acc[0, dt, 2 * half + e] * inv
            if valid and group == 0 and t == 0:
                row_lse = m_row[half] + math.log2(l_sum) if l_sum != _ZERO else _NEG_INF
                if SPLIT:
                    lse_part[b, h, 0, cuda.blockIdx.x] = row_lse
                elif WRITE_LSE:
                    lse[b, h] = row_lse * LN2_F32

    @cuda.jit(device=True, forceinline=True)
    def stage_rows(view, acc, l_row, tid, warp, group, q_half):
        """Stage this warp's normalised output rows in the Q tile (rows 0 .. 63 of the warpgroup's panels),
        for ``copy_rows_out``, so that each global store is a 16-byte chunk; in the persistent kernel only the
        warps of the item's half ``q_half`` (the other half's rows are another item's heads). stmatrix stores
        columns 8·dt .. 8·dt + 15 of the warp's 16 rows at once: matrix m (this lane's row addresses when
        m = lane // 8) holds rows 8·(m % 2) .., columns 8·(dt + m // 2) .., in panel dt // 8 of the
        warpgroup's and at chunk (dt + m // 2) % 8 swizzled by the row's r % 8 = lane % 8."""
        lane, m = tid % 32, (tid % 32) // 8
        inv0 = _ONE / l_row[0] if l_row[0] != _ZERO else _ZERO  # rows g and g + 8 of the warp
        inv1 = _ONE / l_row[1] if l_row[1] != _ZERO else _ZERO
        row0 = (group * (COLS // 64)) * HEADS_PER_BLOCK + 16 * (warp % 4) + lane % 8 + 8 * (m % 2)
        if not PERSISTENT or (warp % 4) // 2 == q_half:
            for dp in range(DTILES // 2):
                dt = 2 * dp
                stmatrix_x4(view, row0 + dt // 8 * HEADS_PER_BLOCK, ((dt % 8 + m // 2) ^ (lane % 8)) * 8,
                            pack(acc[0, dt, 0] * inv0, acc[0, dt, 1] * inv0),
                            pack(acc[0, dt, 2] * inv1, acc[0, dt, 3] * inv1),
                            pack(acc[0, dt + 1, 0] * inv0, acc[0, dt + 1, 1] * inv0),
                            pack(acc[0, dt + 1, 2] * inv1, acc[0, dt + 1, 3] * inv1))

    @cuda.jit(device=True, forceinline=True)
    def copy_rows_out(o, view, b, head0, q_row0, heads, tid, group):
        """Once its warps' rows are staged, this warpgroup copies out its columns of the item's output rows
        (heads ``head0 ..``) from M row ``q_row0`` on, a thread to one 16-byte chunk of every
        OUT_ROWS_PER_PASS-th row: its place in the swizzled panel taken once (sw128_cell), the row's swizzle
        by bit operations."""
        barrier_sync(STAGED + group, 128)
        chunk = group * GROUP_CHUNKS + tid % GROUP_CHUNKS
        panel_row0, chunk_in_panel = (chunk >> 3) * HEADS_PER_BLOCK + q_row0, chunk & 7
        rows = heads if PERSISTENT else min(HEADS_PER_BLOCK, heads - head0)
        for r in range((tid % 128) // GROUP_CHUNKS, rows, OUT_ROWS_PER_PASS):
            col = (chunk_in_panel ^ (r & 7)) * 8
            copy_16_to_global(o, (b, head0 + r, 8 * chunk), view, panel_row0 + r, col)

    return SimpleNamespace(
        R=R, BLOCK_N=BLOCK_N, STAGES=STAGES, SPLIT=SPLIT, PERSISTENT=PERSISTENT, NTILES=NTILES, DTILES=DTILES,
        PSTEPS=PSTEPS, O_REGS=O_REGS, S_REGS=S_REGS, VIEW_ROWS=VIEW_ROWS, ROW_THREADS=ROW_THREADS, FULL=FULL,
        Q_FULL=Q_FULL, COPIERS=COPIERS, Q_LOADERS=Q_LOADERS, SCHEDULE_BARRIERS=STAGES + 2,
        # the copy streams and the Q tile
        item_span=item_span, next_item=next_item, next_with_keys=next_with_keys, stream_at=stream_at,
        stream_start=stream_start, copy_next=copy_next, stream_more=stream_more, copies_tiles=copies_tiles,
        load_q_async=load_q_async, load_first_q=load_first_q,
        # a tile: scores, softmax, P V; the shared schedule's handover of P and of the final row statistics
        scores=scores, wait_tile=wait_tile, issue_scores=issue_scores, init=init, softmax_tile=softmax_tile,
        issue_pv=issue_pv, issue_pv_shared=issue_pv_shared, share_p=share_p, take_factors=take_factors,
        share_sums=share_sums, take_sums=take_sums,
        # the output rows, log-sum-exps and split partials
        store_row_results=store_row_results, stage_rows=stage_rows, copy_rows_out=copy_rows_out)
