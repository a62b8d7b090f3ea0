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
"""

import functools
import math

import numpy as np
from numba import float32, int32, int64, uint16, uint32

from .._cuda import SIMULATOR, cuda
from .constants import LN2_F32
from .online_softmax import EAGER, RESCALE, p_fragments, quad_sum, softmax_steps
from .ptx import (
    SW128_ALIGN,
    aligned_start,
    barrier_arrive,
    barrier_sync,
    copy_16_to_global,
    cp_async_16_at,
    cp_async_mbarrier_arrive,
    fence_proxy_async,
    fence_registers,
    global_address,
    mbarrier_arrive,
    mbarrier_init,
    mbarrier_wait,
    opaque,
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
    wgmma_wait,
)
from .score_mods import NO_TERMS
from .tiles import tile_view

HEADS_PER_BLOCK = 64  # one m64 product
PERSISTENT_HEADS = HEADS_PER_BLOCK // 2  # the persistent kernel's heads: one half of the Q tile per item
ELEM = 2  # bytes per element: the kernel takes 16-bit floats
GROUPS = 2  # warpgroups, each owning half the output columns
THREADS = 128 * GROUPS
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
    R, P, BLOCK_N, STAGES = rank, rope, block_n, stages
    SHARED = qk == "shared"
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
    ALPHA, L_FINAL, M_FINAL, FLAGS = 0, HEADS_PER_BLOCK, 2 * HEADS_PER_BLOCK, 3 * HEADS_PER_BLOCK
    # mbarriers: FULL + s (stage s loaded), Q_FULL + q (Q half q loaded; one whole tile unless persistent);
    # duplicated: SCORED + STAGES·w + s (warpgroup w's scores of stage s done); shared: P_READY (warpgroup 0
    # wrote P), P_FREE (warpgroup 1 read it); persistent: STATS_READY (warpgroup 0 wrote an item's final
    # row statistics), HALF_FREE (warpgroup 0 copied out its part of an item's output rows)
    FULL, Q_FULL, SCORED, P_READY, P_FREE = 0, STAGES, STAGES + 2, STAGES + 2, STAGES + 3
    STATS_READY, HALF_FREE = STAGES + 4, STAGES + 5
    BARRIERS = STAGES + 6 if SHARED else 3 * STAGES + 2
    TURN = 1  # named barriers TURN + w: warpgroup w may issue its products
    STAGED = 3  # named barriers STAGED + w: warpgroup w's output rows are staged
    SPLIT, WRITE_LSE, PERSISTENT = split, write_lse, persistent
    STAGED_OUT = not SPLIT  # output rows staged in the Q tile, copied out in 16-byte chunks
    Q_HALF = PERSISTENT_HEADS if PERSISTENT else 0  # rows between the persistent kernel's two Q halves
    # shared: warpgroup 1 copies whole latent tiles; duplicated: each warpgroup the ckv panels it multiplies
    # by P, and warpgroup 0 the kpe columns
    COPY_PANELS = R // 64 if SHARED else OWN_PANELS
    COPIERS = 128 if SHARED else THREADS  # threads whose copies fill a ring stage
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

    item_span, next_item, next_with_keys, stream_at, stream_start, copy_next, stream_more = copy_streams(
        BLOCK_N, PERSISTENT, locate, next_row, load_tile_async)

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
    def process_item(smem, view, bars, start, stats, arrays, scale_log2, heads, items, walk, b, c, first, end,
                     n_tiles, stream, state, regs, me):
        """One item of a block: sequence ``b``'s keys ``first .. end`` (``n_tiles`` tiles) against head chunk
        ``c``, from the ring as the copy stream fills it (``stream``, refilled as tiles free up) to the output
        rows; ``state`` is the ring and handover position ``(stage, parity, prev_stage, prev_parity, tiles
        of earlier items, earlier items with keys, the last item whose Q was loaded)``: tile j sits in ring
        ``stage``, in its ``parity``-th use (mod 2), no runtime divisions. ``arrays`` are the kernel's array
        arguments, ``regs`` the thread's softmax state, accumulator, scores and row statistics, ``me`` its
        place in the block. Returns the stream and the state after the item."""
        q_nope, q_pe, ckv, kpe, page_table, seqlens, o, lse, o_part, lse_part = arrays
        m_i, l_i, row_max, alpha, acc, s, p_frag, l_row, m_row = regs
        tid, warp, g, t, group, other, my_row, my_lane = me
        stage, parity, prev_stage, prev_parity, tiles_done, items_done, q_b, q_c = state
        scorer = not SHARED or group == 0
        head0 = c * HEADS_PER_BLOCK
        q_half = items_done & 1 if PERSISTENT else 0  # persistent: the item's Q half
        q_row0 = Q_HALF * q_half  # the M row of the item's first head
        init(m_i, l_i, acc)
        if n_tiles > 0 and (scorer or not PERSISTENT):
            mbarrier_wait(bars, Q_FULL + q_half, (items_done >> 1) & 1)
        for j in range(n_tiles):
            if scorer:
                mbarrier_wait(bars, FULL + stage, parity)
                fence_proxy_async()  # copies made visible to this thread become visible to wgmma
                if not SHARED:
                    barrier_sync(TURN + group, THREADS)  # this warpgroup's turn on the tensor cores
                if j > 0:
                    issue_pv(acc, p_frag, smem, start, prev_stage, group)
                issue_scores(s, smem, start, stage)
                if not SHARED:
                    barrier_arrive(TURN + other, THREADS)
                if not SHARED:
                    # refill the stage of the tile before with the stream's next: this warpgroup's panels of
                    # it are free once its P V of it is complete and the other's scores of it are done
                    more = stream_more(stream, j + STAGES - 1)
                    if j > 0:
                        wgmma_wait(1)
                        fence_registers(acc, O_REGS)
                        if more:
                            mbarrier_wait(bars, SCORED + STAGES * other + prev_stage, prev_parity)
                    if more:
                        stream = copy_next(view, bars, ckv, kpe, prev_stage, stream, page_table, seqlens, items,
                                           walk, group, my_row, my_lane)
                wgmma_wait(0)
                if SHARED:
                    fence_registers(acc, O_REGS)
                fence_registers(s, S_REGS)
                if not SHARED:
                    mbarrier_arrive(bars, SCORED + STAGES * group + stage)
                n0 = first + j * BLOCK_N
                factor = scale_and_mask(s, scale_log2, n0 + BLOCK_N > end, 0, n0, end, 0, g, t, NO_TERMS)
                rescaled = update(s, m_i, l_i, row_max, alpha, factor)
                if rescaled:
                    rescale(acc, alpha)
                pack_p(p_frag, s)
                if SHARED:  # hand P over once warpgroup 1 has read the previous one
                    if tiles_done + j > 0:
                        mbarrier_wait(bars, P_FREE, (tiles_done + j - 1) & 1)
                    share_p(view, stats, p_frag, alpha, rescaled, warp, g, t)
                    fence_proxy_async()
                    mbarrier_arrive(bars, P_READY)
            else:
                mbarrier_wait(bars, P_READY, (tiles_done + j) & 1)
                if stats[FLAGS + warp % 4] != _ZERO:
                    for half in range(2):
                        factor = stats[ALPHA + 16 * (warp % 4) + g + 8 * half]
                        for dt in range(DTILES):
                            acc[0, dt, 2 * half] *= factor
                            acc[0, dt, 2 * half + 1] *= factor
                mbarrier_wait(bars, FULL + stage, parity)
                fence_proxy_async()
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
            if not SHARED:
                barrier_sync(TURN + group, THREADS)
            issue_pv(acc, p_frag, smem, start, prev_stage, group)
            if not SHARED:
                barrier_arrive(TURN + other, THREADS)
            wgmma_wait(0)
            fence_registers(acc, O_REGS)
        if PERSISTENT:  # the epilogue's addresses taken in each item, not held (or spilled) across the tile loop
            tid = opaque(tid)
            warp, g, t = tid // 32, tid % 32 // 4, tid % 4
            group = warp // 4

        # the scorers' row statistics: full sums over the lane quad (handed to warpgroup 1 when shared)
        for half in range(2):
            l_row[half], m_row[half] = quad_sum(l_i[half]), m_i[half]
        if PERSISTENT:
            tiles_done += n_tiles
        # persistent: an item without keys hands nothing over (warpgroup 1's sums of 0 give zeros); a
        # handover waits until warpgroup 1 has taken every P of the item, so that it has read the
        # previous item's statistics, and signals through an mbarrier instead of a block barrier
        if SHARED and (n_tiles > 0 or not PERSISTENT):
            if group == 0:
                if PERSISTENT:
                    mbarrier_wait(bars, P_FREE, (tiles_done - 1) & 1)
                if t == 0:
                    for half in range(2):
                        stats[L_FINAL + 16 * warp + g + 8 * half] = l_row[half]
                        stats[M_FINAL + 16 * warp + g + 8 * half] = m_row[half]
                if PERSISTENT:
                    mbarrier_arrive(bars, STATS_READY)
            if not PERSISTENT:
                cuda.syncthreads()  # also: every product is complete, the Q tile free for the output rows
            if group == 1:
                if PERSISTENT:
                    mbarrier_wait(bars, STATS_READY, items_done & 1)
                for half in range(2):
                    l_row[half] = stats[L_FINAL + 16 * (warp % 4) + g + 8 * half]
                    m_row[half] = stats[M_FINAL + 16 * (warp % 4) + g + 8 * half]
        if PERSISTENT and n_tiles > 0:
            items_done += 1
        if STAGED_OUT and not SHARED:
            cuda.syncthreads()  # both warpgroups' last products are complete: the Q tile is free
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
        if PERSISTENT and n_tiles == 0:  # no keys: zero rows, stored directly (the Q halves are taken)
            for i in range(tid, heads * R, THREADS):
                o[b, i // R, i % R] = uint16(0)
        elif STAGED_OUT:
            # the output rows go out through the Q tile (persistent: the item's half, its queries used up), so
            # that each global store is a 16-byte chunk; stmatrix stores columns 8·dt .. 8·dt + 15 of the
            # warp's 16 rows at once: matrix m (this lane's row addresses when m = lane // 8) holds rows
            # 8·(m % 2) .., columns 8·(dt + m // 2) .., in panel dt // 8 of the warpgroup's and at chunk
            # (dt + m // 2) % 8 swizzled by the row's r % 8 = lane % 8
            lane, m = tid % 32, (tid % 32) // 8
            inv0 = _ONE / l_row[0] if l_row[0] != _ZERO else _ZERO  # rows g and g + 8 of the warp
            inv1 = _ONE / l_row[1] if l_row[1] != _ZERO else _ZERO
            row0 = (group * (COLS // 64)) * HEADS_PER_BLOCK + 16 * (warp % 4) + lane % 8 + 8 * (m % 2)
            if not PERSISTENT or (warp % 4) // 2 == q_half:  # persistent: the warps of the item's half
                for dp in range(DTILES // 2):
                    dt = 2 * dp
                    stmatrix_x4(view, row0 + dt // 8 * HEADS_PER_BLOCK, ((dt % 8 + m // 2) ^ (lane % 8)) * 8,
                                pack(acc[0, dt, 0] * inv0, acc[0, dt, 1] * inv0),
                                pack(acc[0, dt, 2] * inv1, acc[0, dt, 3] * inv1),
                                pack(acc[0, dt + 1, 0] * inv0, acc[0, dt + 1, 1] * inv0),
                                pack(acc[0, dt + 1, 2] * inv1, acc[0, dt + 1, 3] * inv1))
            # each warpgroup copies out its own columns once its warps' rows are staged, a thread to one
            # 16-byte chunk of every OUT_ROWS_PER_PASS-th row: its place in the swizzled panel taken once
            # (sw128_cell), the row's swizzle by bit operations
            barrier_sync(STAGED + group, 128)
            chunk = group * GROUP_CHUNKS + tid % GROUP_CHUNKS
            panel_row0, chunk_in_panel = (chunk >> 3) * HEADS_PER_BLOCK + q_row0, chunk & 7
            rows = heads if PERSISTENT else min(HEADS_PER_BLOCK, heads - head0)
            for r in range((tid % 128) // GROUP_CHUNKS, rows, OUT_ROWS_PER_PASS):
                col = (chunk_in_panel ^ (r & 7)) * 8
                copy_16_to_global(o, (b, head0 + r, 8 * chunk), view, panel_row0 + r, col)
            if PERSISTENT:  # once both warpgroups' rows are out, warpgroup 1 loads the Q of the item after next
                if group == 0:
                    mbarrier_arrive(bars, HALF_FREE)
                else:
                    q_b, q_c = next_with_keys(q_b, q_c, seqlens, items)
                    barrier_sync(STAGED + group, 128)  # its own rows read by all its threads
                    mbarrier_wait(bars, HALF_FREE, (items_done - 1) & 1)  # warpgroup 0's rows
                    if q_b < items[0]:
                        load_q_async(view, bars, q_nope, q_pe, q_b, q_c * HEADS_PER_BLOCK, heads, q_half)
        return stream, (stage, parity, prev_stage, prev_parity, tiles_done, items_done, q_b, q_c)

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
            for stage in range(STAGES):
                mbarrier_init(bars, FULL + stage, COPIERS)
                if not SHARED:
                    for w in range(GROUPS):
                        mbarrier_init(bars, SCORED + STAGES * w + stage, 128)
            mbarrier_init(bars, Q_FULL, Q_LOADERS)
            mbarrier_init(bars, Q_FULL + 1, Q_LOADERS)
            if SHARED:
                mbarrier_init(bars, P_READY, 128)
                mbarrier_init(bars, P_FREE, 128)
            if PERSISTENT:
                mbarrier_init(bars, STATS_READY, 128)
                mbarrier_init(bars, HALF_FREE, 128)
        cuda.syncthreads()
        q_b, q_c = stream[0], stream[1]  # the last item whose Q is loaded
        # the Q tile of the stream's first item (persistent: also the next one's), then its first tiles but one
        if stream[3] > 0:
            if not PERSISTENT or group == 1:
                load_q_async(view, bars, q_nope, q_pe, q_b, q_c * HEADS_PER_BLOCK, heads, 0)
            if PERSISTENT:
                q_b, q_c = next_with_keys(q_b, q_c, seqlens, items)
                if q_b < items[0] and group == 1:
                    load_q_async(view, bars, q_nope, q_pe, q_b, q_c * HEADS_PER_BLOCK, heads, 1)
            if not SHARED or group == 1:
                for j in range(STAGES - 1):  # each thread's next page is looked up a tile ahead
                    if stream_more(stream, j):
                        stream = copy_next(view, bars, ckv, kpe, j, stream, page_table, seqlens, items, walk, group,
                                           my_row, my_lane)
            if not SHARED and group == GROUPS - 1:
                barrier_arrive(TURN, THREADS)  # the first warpgroup goes first

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

        arrays = (q_nope, q_pe, ckv, kpe, page_table, seqlens, o, lse, o_part, lse_part)
        regs = (m_i, l_i, row_max, alpha, acc, s, p_frag, l_row, m_row)
        me = (tid, warp, g, t, group, other, my_row, my_lane)
        # see process_item; typed, not literal, integers: from a tuple of literals the persistent loop would
        # type and lower process_item twice (for the literals, then for the state it returns), a second a compile
        state = (int64(0), int64(0), int64(STAGES - 1), int64(1), int64(0), int64(0), q_b, q_c)
        if PERSISTENT:
            for _ in range(rounds):  # the block's items in turn
                first, end, n_tiles = item_span(b, seqlens, capacity, 0, 1)
                stream, state = process_item(smem, view, bars, start, stats, arrays, scale_log2, heads, items, walk, b,
                                             c, first, end, n_tiles, stream, state, regs, me)
                b, c = next_item(b, c, items)
        else:
            process_item(smem, view, bars, start, stats, arrays, scale_log2, heads, items, walk, b, c, first, end,
                         n_tiles, stream, state, regs, me)

    if SIMULATOR:  # the simulator's jit takes no register limit
        return cuda.jit(kernel)
    return cuda.jit(kernel, max_registers=255)
