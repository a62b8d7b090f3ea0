"""Fused attention forward on Hopper's warpgroup tensor cores (``wgmma``, sm_90 only).

A block of ``warpgroups`` warpgroups owns ``64 · warpgroups`` query rows of one
(batch, query head); each warpgroup 64 of them, each warp 16. K/V tiles of
``BLOCK_N`` keys stream through a ring of ``stages`` shared-memory buffers in
the 128-byte swizzled layout that wgmma reads directly (``ptx/wgmma.py``), copied
with ``cp.async`` by every thread, or with a ``producer`` by one more warpgroup
that gives most of its registers to the computing ones (``setmaxnreg``);
shared-memory barriers (mbarriers) track when a buffer is full (all copies
landed) and empty (every computing warpgroup is done with it), so no block-wide
barrier ties the warpgroups together inside the loop.

Per key tile j a warpgroup issues ``O += P(j-1) V(j-1)`` (P from registers: an
accumulator pair is an A fragment; V an MN-major operand) and ``S = Q Kⱼᵀ``
(both operands in shared memory, one m64nBLOCK_Nk16 instruction per 16 columns
of the head dim), waits for S (with a producer; for both products without),
runs the online softmax of the mma.sync kernel on S (``online_softmax.py``, one
m16 tile per warp: wgmma's accumulator layout is mma.sync's, per warp) while
``P(j-1) V(j-1)`` may still run, waits for it, frees buffer j - 1 and, without a
producer, starts copying tile j + stages - 1. The warpgroups take turns on the
tensor cores (a ring of named barriers orders their issues), so that one's
softmax overlaps the others' products: FlashAttention-3's ping-pong schedule,
and with a producer its overlap within a warpgroup too.

A ``persistent`` configuration launches a block per SM, each taking query tile after query tile (rounds of the
grid's tiles, forwards and backwards in turn): its producer copies the next tile's Q into a second buffer while
the current one is computed, the ring of K/V stages and the warpgroups' turns run on from tile to tile, and K
and V take rings of their own, so that a stage's next K is copied as soon as its scores are done. Where query
tiles see few keys this hides most of a block's start and end (its first copies, its first and last products,
its output), which a block per tile pays in full. In a packed batch the blocks count the query tiles from the
longest sequence, as the grid of a block per tile would, and pass over those past their sequence's rows.

Head dims must be multiples of 64 (whole swizzle panels), inputs 16-bit with
contiguous, 16-byte aligned rows.
"""

import functools

import numpy as np
from numba import float32, int32, int64, uint16, uint32

from .._cuda import SIMULATOR, cuda
from .constants import LOG2E_F32
from .online_softmax import p_fragments, partial_store, seed_sink, softmax_steps
from .ptx import (
    SW128_ALIGN,
    aligned_start,
    barrier_arrive,
    barrier_sync,
    copy_16_to_global,
    cp_async_commit,
    cp_async_mbarrier_arrive,
    cp_async_wait_group,
    fence_proxy_async,
    fence_registers,
    grow_registers,
    mbarrier_arrive,
    mbarrier_expect_tx,
    mbarrier_init,
    mbarrier_wait,
    pack_bf16x2,
    pack_f16x2,
    shrink_registers,
    st_shared_b32,
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
from .score_mods import NO_MODS, crosses_window, window_span
from .sequences import DENSE, block_locator, forward_kernel, sequence_span, source_row
from .split_merge import split_finisher, split_run
from .tensor_maps import key_box_rows
from .tiles import ring_after, ring_next, sw128_cell, tile_copier, tile_view, transposed_key_copier

_ZERO = np.float32(0.0)


@functools.lru_cache(maxsize=None)
def wgmma_attention_kernel(config, dtype, head_dim, head_dim_v, causal, write_lse, aligned_out, split=False,
                           k_transposed=False, mods=NO_MODS, sequences=DENSE, tensor_copies=False):
    """Numba kernel ``kernel(q, k, v, o, lse, scale_log2, alibi, sinks, left, right, cap_log2, cap_slope)``;
    arguments as for the SIMT kernel, the score modifications ``mods`` as ``score_mods.py`` says, the
    sequence layout ``sequences`` (varlen and paged arguments after the others) as ``sequences.py`` says.

    ``aligned_out``: rows of ``o`` are contiguous and 16-byte aligned, so the output is
    written in 16-byte chunks.

    ``split`` (a configuration without a producer): the keys are divided among the ``gridDim.y`` blocks of a
    query tile, whose partial results the last of them merges, with the arguments and workspace of the
    ``mma.sync`` kernel's split (``attention_mma.py``); packed and paged sequences split alike.

    ``k_transposed`` (key tiles in multiples of 64, dense sequences): ``k`` is ``[B, Hkv, D, Skv]`` with the
    keys contiguous (a transposed view of K); its tiles are copied as they lie, a head-dim row of keys per
    tile row, and read as an MN-major operand, as V's are.

    ``tensor_copies`` (a producer, tiles of whole pages (``tensor_maps.key_box_rows``), one run of keys, K as it
    lies): the producer's first thread copies the Q tile and the K/V tiles by tensor copies (TMA), a 64-column
    panel per copy, from the tensor maps ``maps`` (``[3, 16]`` words: Q's for boxes of ``block_m`` rows, K's and
    V's of ``key_box_rows``: a tile's, or with smaller pages a page's), the kernel's last argument. A packed
    sequence's last K/V tile, when it runs past the sequence's keys, is copied by the producer warpgroup (in a
    persistent block its first warp) with ``cp.async``, whose rows past the end read 0: a box would read the next
    sequence's rows, and a value there that is not finite would turn this sequence's ``0 · V`` into NaN.

    16-bit arrays only (``uint16`` bit patterns). Launch with
    ``cdiv(Sq, block_m) · B · Hq`` blocks (a persistent configuration: at most as many, a block per SM) of
    ``num_threads`` threads and ``config.shared_bytes(D, Dv)`` bytes of dynamic shared memory.
    """
    BLOCK_M, BLOCK_N, STAGES = config.block_m, config.block_n, config.stages
    GROUPS, NUM_THREADS = config.warpgroups, config.num_threads
    # with a producer, warpgroup GROUPS copies every tile and the others compute; without, every thread does both
    PRODUCER = config.producer
    CONSUMERS = 128 * GROUPS
    COPIERS, FIRST_COPIER = (128, CONSUMERS) if PRODUCER else (NUM_THREADS, 0)
    PRODUCER_REGISTERS, CONSUMER_REGISTERS = config.producer_registers, config.consumer_registers
    # with a producer, a warpgroup's softmax of tile j also overlaps its own P Vⱼ₋₁ (measured faster there; without
    # one it was slower at head dim 64, measured before the instruction cuts of the loop)
    OVERLAP = PRODUCER
    S_PENDING = 1 if OVERLAP else 0  # product groups that may be in flight once S is complete
    D, DV = head_dim, head_dim_v
    KSTEPS, PSTEPS = D // 16, BLOCK_N // 16  # k-steps of S = Q Kᵀ and of O += P V
    NTILES, DTILES = BLOCK_N // 8, DV // 8  # n8 accumulator tiles of S and of O
    S_REGS, O_REGS = BLOCK_N // 2, DV // 2  # accumulator registers per thread
    # shared memory as 128-byte rows of a 64-column view: Q, then STAGES K tiles, then STAGES V tiles
    # the Q tile's first row in the view, a typed 0 rather than a literal (as are the rings' starting stage and
    # parity, and the tiles' row counts): numba would type and lower the tile copier and sw128_cell once more
    # for each literal value
    Q_VIEW_ROW = np.int64(0)
    K_MAP, V_MAP = np.int64(1), np.int64(2)  # the K and V tensor maps in ``maps`` (Q's is 0), typed likewise
    PERSISTENT, Q_BUFFERS = config.persistent, config.query_buffers
    Q_ROWS = BLOCK_M * D // 64
    K_ROW0 = Q_BUFFERS * Q_ROWS
    K_ROWS = BLOCK_N * D // 64
    V_ROW0 = K_ROW0 + STAGES * K_ROWS
    V_ROWS = BLOCK_N * DV // 64
    VIEW_ROWS = V_ROW0 + STAGES * V_ROWS
    V_PANEL = 64 * BLOCK_N  # elements between the 64-column panels of a V tile
    # mbarriers: FULL + s (stage s loaded), EMPTY + s (stage s read by every computing thread), Q_FULL + i (Q
    # buffer i loaded), in a persistent block Q_FREE + i (buffer i's output tile written out by every computing
    # thread). A persistent block's K and V tiles take split rings (as FlashAttention-3's do), so that a stage's K
    # is copied again once its scores are done, before its V is read: FULL + s then counts the K tile in, V_FULL + s
    # the V tile, K_EMPTY + s the K tile read, EMPTY + s the V tile read
    SPLIT_RING = PERSISTENT
    FULL, EMPTY, Q_FULL = 0, STAGES, 2 * STAGES
    Q_FREE = Q_FULL + Q_BUFFERS
    V_FULL = Q_FREE + (Q_BUFFERS if PERSISTENT else 0)
    K_EMPTY = V_FULL + STAGES
    BARRIERS = K_EMPTY + STAGES if SPLIT_RING else V_FULL
    TURN = 1  # named barriers TURN + w: warpgroup w may issue its products
    STAGED = DV <= D  # the output tile goes out through the warpgroup's Q rows in shared memory
    STAGED_BARRIER = TURN + GROUPS  # named barriers STAGED_BARRIER + w: warpgroup w's output tile is staged
    TAIL_COPIED = STAGED_BARRIER + GROUPS  # named barrier: the producer's copies of a packed sequence's last tile landed
    # the threads that copy K/V tiles by cp.async; a persistent block copies so only a packed sequence's last tile,
    # by the producer's first warp alone (the others leave at once, as in a dense batch: every instruction of a
    # producer warp that follows the tiles takes an issue slot from the computing warps of its scheduler)
    KV_COPIERS = 32 if PERSISTENT else COPIERS
    OUT_CHUNKS = DV // 8  # 16-byte chunks per output row
    ALIGNED_OUT = aligned_out
    CAUSAL, WRITE_LSE = causal, write_lse
    WINDOW, ALIBI, SINKS = mods.window, mods.alibi, mods.sinks
    VARLEN, SPLIT, K_T = sequences.varlen, split, k_transposed
    if SPLIT and PRODUCER:
        raise ValueError(f"key splits take a configuration without a producer warpgroup, got {config}")
    if K_T and (BLOCK_N % 64 or VARLEN):
        raise ValueError(f"K read transposed takes dense sequences and key tiles in multiples of 64, got {config}")
    TENSOR_COPIES = tensor_copies
    if PERSISTENT and not TENSOR_COPIES:
        raise ValueError(f"a persistent block takes tiles copied by tensor copies, got {config}, {sequences}, "
                         f"tensor_copies={tensor_copies}")
    KV_BOX_ROWS = key_box_rows(sequences, BLOCK_N)  # rows of K and V per tensor copy: a tile's or a page's
    if TENSOR_COPIES and (not PRODUCER or not KV_BOX_ROWS or SPLIT or K_T):
        raise ValueError(f"tensor copies take a producer, tiles of whole pages, one run of keys and K as it lies, "
                         f"got {config}, {sequences}, split={split}, k_transposed={k_transposed}")
    ARRIVALS = 1 if TENSOR_COPIES else COPIERS  # per phase of a FULL or Q_FULL barrier
    Q_BYTES, K_BYTES, V_BYTES = 2 * BLOCK_M * D, 2 * BLOCK_N * D, 2 * BLOCK_N * DV
    KV_BYTES = K_BYTES + V_BYTES
    locate = block_locator(sequences)
    bf16 = dtype == "bfloat16"
    wgmma_ss, wgmma_rs = (wgmma_ss_desc_bf16, wgmma_rs_desc_bf16) if bf16 else (wgmma_ss_desc_f16, wgmma_rs_desc_f16)
    pack = pack_bf16x2 if bf16 else pack_f16x2
    init, scale_and_mask, update, rescale, normalize, store = softmax_steps(1, NTILES, DTILES, causal, dtype,
                                                                            mods=mods, fold_scale=True)
    pack_p = p_fragments(PSTEPS, dtype)
    finish_split = split_finisher(partial_store(1, DTILES), dtype, DV, BLOCK_M, write_lse, sequences.varlen)

    # this thread's copies of src[b, h, row0 + r, :ncols] into row r of a swizzled tile; rows past nrows read 0
    load_tile_async = tile_copier(COPIERS, sw128_cell, stepping=True, first_thread=FIRST_COPIER)
    kv_source = source_row(sequences)
    load_kv_tile_async = tile_copier(KV_COPIERS, sw128_cell, kv_source, stepping=True, first_thread=FIRST_COPIER)
    load_partial_kt_tile_async = transposed_key_copier(COPIERS, sw128_cell, D, BLOCK_N, first_thread=FIRST_COPIER)

    @cuda.jit(device=True, forceinline=True)
    def load_kt_tile_async(view, tile_row0, k, at, h, n0, nkeys):
        """This thread's copies of the K tile of keys ``n0 ..`` from ``k`` stored transposed (``k[at, h, d, n]``):
        row ``d`` of the tile holds head-dim row ``d``'s keys, 8 per copy; keys from ``nkeys`` on read 0."""
        if n0 + BLOCK_N <= nkeys:  # a whole tile: D rows of BLOCK_N keys, copied as Q's rows are
            load_tile_async(view, tile_row0, int64(D), k[:, :, :, n0:], at, h, 0, D, BLOCK_N)
        else:
            load_partial_kt_tile_async(view, tile_row0, k, at, h, n0, nkeys)

    @cuda.jit(device=True, forceinline=True)
    def copy_kv_async(view, k, v, kv_at, h_kv, j, stage, first, nkeys):
        """Start this thread's copies of key tile ``j`` (keys from ``first + j · BLOCK_N``, found from ``kv_at`` as
        ``sequences.py`` says; from ``nkeys`` on they read 0) into ``stage``."""
        if K_T:
            load_kt_tile_async(view, K_ROW0 + stage * K_ROWS, k, kv_at, h_kv, first + j * BLOCK_N, nkeys)
        else:
            load_kv_tile_async(view, K_ROW0 + stage * K_ROWS, int64(BLOCK_N), k, kv_at, h_kv, first + j * BLOCK_N, nkeys, D)
        load_kv_tile_async(view, V_ROW0 + stage * V_ROWS, int64(BLOCK_N), v, kv_at, h_kv, first + j * BLOCK_N, nkeys, DV)

    @cuda.jit(device=True, forceinline=True)
    def load_kv_async(view, bars, k, v, kv_at, h_kv, j, stage, first, nkeys):
        """``copy_kv_async``, and the stage's FULL barrier counts the copies in."""
        copy_kv_async(view, k, v, kv_at, h_kv, j, stage, first, nkeys)
        cp_async_mbarrier_arrive(bars, FULL + stage)

    @cuda.jit(device=True, forceinline=True)
    def produce(view, bars, q, k, v, q_at, h, q_start, q_end, kv_at, h_kv, first, nkeys, n_blocks):
        """The producer warpgroup's work: the Q tile, then every K/V tile into its stage once the computing
        warpgroups are done with the stage's previous tile."""
        load_tile_async(view, Q_VIEW_ROW, int64(BLOCK_M), q, q_at, h, q_start, q_end, D)
        cp_async_mbarrier_arrive(bars, Q_FULL)
        stage, parity = int64(0), int64(0)  # tile j's stage and the parity of its use, as the computing loop counts them
        for j in range(n_blocks):
            if j >= STAGES:
                mbarrier_wait(bars, EMPTY + stage, parity ^ 1)  # the stage's previous use is done
            load_kv_async(view, bars, k, v, kv_at, h_kv, j, stage, first, nkeys)
            stage, parity = ring_next(stage, parity, STAGES)
        cp_async_commit()
        cp_async_wait_group(0)  # the copies land before their threads leave

    @cuda.jit(device=True, forceinline=True)
    def copy_boxes(view, maps, operand, view_row0, columns, kv_at, h_kv, keys, bars, barrier):
        """The tensor copies of a K (``operand`` 1) or V (2) tile of ``columns`` columns, keys from ``keys``, into
        view rows from ``view_row0``: one box of rows, or one a page, per 64-column panel, counted by ``barrier``."""
        for i in range(BLOCK_N // KV_BOX_ROWS):
            at, row = kv_source(kv_at, keys + i * KV_BOX_ROWS)
            for p in range(columns // 64):
                tma_load_box(view, view_row0 + p * BLOCK_N + i * KV_BOX_ROWS, maps, operand, at, h_kv, row, 64 * p,
                             bars, barrier)

    @cuda.jit(device=True, forceinline=True)
    def produce_values(view, bars, maps, kv_at, h_kv, keys, stage, parity, issuing):
        """With split rings: the V tile of keys from ``keys`` into ``stage`` (its use of parity ``parity``) once the
        stage's previous V is read; the thread waits, and copies if ``issuing``."""
        mbarrier_wait(bars, EMPTY + stage, parity ^ 1)
        if issuing:
            mbarrier_expect_tx(bars, V_FULL + stage, V_BYTES)
            copy_boxes(view, maps, V_MAP, V_ROW0 + stage * V_ROWS, DV, kv_at, h_kv, keys, bars, V_FULL + stage)
            mbarrier_arrive(bars, V_FULL + stage)

    @cuda.jit(device=True, forceinline=True)
    def produce_boxes(view, bars, maps, q_buffer, q_at, h, q_start, kv_at, h_kv, first, n_blocks, stage, parity,
                      issuing):
        """The tensor copies of the Q tile into Q buffer ``q_buffer`` and of the first ``n_blocks`` K/V tiles into the
        ring from ``stage`` (its use of parity ``parity``): the ring's next stage and parity. The calling thread
        waits for each stage to be free; it announces the bytes, copies and arrives if ``issuing`` (one thread
        issues, the others of its warp may follow the ring beside it)."""
        q_full = Q_FULL + q_buffer
        if issuing:
            mbarrier_expect_tx(bars, q_full, Q_BYTES)
            for p in range(D // 64):
                tma_load_box(view, q_buffer * Q_ROWS + p * BLOCK_M, maps, 0, q_at, h, q_start, 64 * p, bars, q_full)
            mbarrier_arrive(bars, q_full)
        last_stage, last_parity = stage, parity
        for j in range(n_blocks):
            keys = first + j * BLOCK_N
            if SPLIT_RING:  # K into its stage once its scores are done, the previous tile's V once its P V is
                mbarrier_wait(bars, K_EMPTY + stage, parity ^ 1)  # (at once for the parity before the first phase)
                if issuing:
                    mbarrier_expect_tx(bars, FULL + stage, K_BYTES)
                    copy_boxes(view, maps, K_MAP, K_ROW0 + stage * K_ROWS, D, kv_at, h_kv, keys, bars, FULL + stage)
                    mbarrier_arrive(bars, FULL + stage)
                if j > 0:
                    produce_values(view, bars, maps, kv_at, h_kv, keys - BLOCK_N, last_stage, last_parity, issuing)
            else:
                if j >= STAGES:
                    mbarrier_wait(bars, EMPTY + stage, parity ^ 1)
                if issuing:
                    mbarrier_expect_tx(bars, FULL + stage, KV_BYTES)
                    copy_boxes(view, maps, K_MAP, K_ROW0 + stage * K_ROWS, D, kv_at, h_kv, keys, bars, FULL + stage)
                    copy_boxes(view, maps, V_MAP, V_ROW0 + stage * V_ROWS, DV, kv_at, h_kv, keys, bars, FULL + stage)
                    mbarrier_arrive(bars, FULL + stage)
            last_stage, last_parity = stage, parity
            stage, parity = ring_next(stage, parity, STAGES)
        if SPLIT_RING and n_blocks > 0:
            produce_values(view, bars, maps, kv_at, h_kv, first + (n_blocks - 1) * BLOCK_N, last_stage, last_parity,
                           issuing)
        return stage, parity

    @cuda.jit(device=True, forceinline=True)
    def produce_tail(view, bars, k, v, kv_at, h_kv, j, stage, parity, first, nkeys):
        """A packed sequence's last K/V tile ``j`` (keys from ``first + j · BLOCK_N``), which runs past its keys
        ``nkeys``: copied into ``stage`` (its use of parity ``parity``) by the ``KV_COPIERS`` producer threads with
        ``cp.async``, whose rows from ``nkeys`` on read 0, once the stage's previous tile is read; the first thread
        then counts it in."""
        leader = cuda.threadIdx.x == CONSUMERS
        if leader:
            # the leader saw each earlier use of the stage end in turn; a parity names one of only two phases,
            # so a thread that did not could take an older phase's completion for this one
            if SPLIT_RING:
                mbarrier_wait(bars, K_EMPTY + stage, parity ^ 1)
            mbarrier_wait(bars, EMPTY + stage, parity ^ 1)  # (at once for the parity before the first phase)
        barrier_sync(TAIL_COPIED, KV_COPIERS)  # the stage is free for every copying thread
        copy_kv_async(view, k, v, kv_at, h_kv, j, stage, first, nkeys)
        cp_async_commit()
        cp_async_wait_group(0)
        barrier_sync(TAIL_COPIED, KV_COPIERS)  # every copying thread's copies have landed before the one arrival
        if leader:
            mbarrier_arrive(bars, FULL + stage)
            if SPLIT_RING:
                mbarrier_arrive(bars, V_FULL + stage)

    @cuda.jit(device=True, forceinline=True)
    def produce_tile(view, bars, maps, k, v, q_buffer, q_at, h, q_start, kv_at, h_kv, first, nkeys, n_blocks, stage,
                     parity, issuing, waiting):
        """A query tile's copies into the ring from ``stage`` (its use of parity ``parity``): the Q tile and the
        K/V tiles by tensor copies (``produce_boxes``; a thread not ``waiting`` passes over them), then a packed
        sequence's last K/V tile, when it runs past the sequence's keys ``nkeys``, by the ``KV_COPIERS`` producer
        threads (``produce_tail``). The ring's stage and parity after the tile's."""
        tail = VARLEN and first + n_blocks * BLOCK_N > nkeys
        boxed = n_blocks - 1 if tail else n_blocks
        if waiting:
            stage, parity = produce_boxes(view, bars, maps, q_buffer, q_at, h, q_start, kv_at, h_kv, first, boxed,
                                          stage, parity, issuing)
        else:
            stage, parity = ring_after(stage, parity, boxed, STAGES)
        if tail:
            produce_tail(view, bars, k, v, kv_at, h_kv, boxed, stage, parity, first, nkeys)
            stage, parity = ring_next(stage, parity, STAGES)
        return stage, parity

    @cuda.jit(device=True, forceinline=True)
    def produce_by_tensor_copies(view, bars, k, v, maps, q_at, h, q_start, kv_at, h_kv, first, nkeys, n_blocks):
        """``produce`` with tensor copies (``produce_tile``) by the producer's first thread; the other producer
        threads copy only a packed sequence's last tile."""
        produce_tile(view, bars, maps, k, v, Q_VIEW_ROW, q_at, h, q_start, kv_at, h_kv, first, nkeys, n_blocks,
                     int64(0), int64(0), True, cuda.threadIdx.x == CONSUMERS)

    @cuda.jit(device=True, forceinline=True)
    def find_tile(q, v, seqs, left, right, block, blocks):
        """Query tile ``block`` of the launch's ``blocks`` (in ``sequences.block_locator``'s order): ``locate``'s
        fields less ``n_end``, then the first key of its first key tile and its number of key tiles."""
        b, h, h_kv, m0, n_end, seqlen_q, seqlen_kv, q_at, q_row0, kv_at, k_row0 = locate(q, v, seqs, BLOCK_M, CAUSAL,
                                                                                         block, blocks)
        first = 0  # the first key of the first tile
        if WINDOW:
            first, n_end = window_span(m0, BLOCK_M, seqlen_kv - seqlen_q, seqlen_kv, left, right)
            first = first // BLOCK_N * BLOCK_N
        n_blocks = (n_end - first + BLOCK_N - 1) // BLOCK_N
        if SPLIT:
            first, n_blocks = split_run(first, n_blocks, n_blocks if WINDOW else (seqlen_kv + BLOCK_N - 1) // BLOCK_N,
                                        BLOCK_N)
        return b, h, h_kv, m0, seqlen_q, seqlen_kv, q_at, q_row0, kv_at, k_row0, first, n_blocks

    @cuda.jit(device=True, forceinline=True)
    def tile_of_round(round_index):
        """A persistent block's query tile in round ``round_index`` of the grid's tiles (a round: a tile per
        block): the rounds run forwards and backwards in turn, so that a block that takes one of a round's
        longest causal tiles (the first) takes one of the next round's shortest. The round decides, the same in
        every block (the blocks of a packed batch pass over different numbers of tiles)."""
        forwards = round_index % 2 == 0
        return round_index * cuda.gridDim.x + (cuda.blockIdx.x if forwards else cuda.gridDim.x - 1 - cuda.blockIdx.x)

    @cuda.jit(device=True, forceinline=True)
    def produce_tiles(view, bars, maps, q, k, v, seqs, left, right, tiles):
        """A persistent block's producer: for each of the block's query tiles its first thread copies the Q tile
        into the next Q buffer once the output tile staged there two tiles before is written out, then the K/V
        tiles into the ring (``produce_tile``). In a packed batch the whole first warp follows the ring
        (its lanes wait together, the first alone issues: a lane that waited while the others ran elsewhere
        would spin inside a divergent branch) and copies a sequence's last K/V tile when it runs past the
        sequence's keys (``produce_tail``)."""
        leader = cuda.threadIdx.x == CONSUMERS
        if not (leader or VARLEN and cuda.threadIdx.x < CONSUMERS + KV_COPIERS):
            return
        issuing = not VARLEN or leader
        stage, parity, q_buffer, q_parity = int64(0), int64(0), int64(0), int64(0)
        for round_index in range((tiles + cuda.gridDim.x - 1) // cuda.gridDim.x):
            block = tile_of_round(round_index)
            if block >= tiles:
                break
            _, h, h_kv, m0, _, seqlen_kv, q_at, q_row0, kv_at, k_row0, first, n_blocks = find_tile(q, v, seqs, left,
                                                                                                    right, block, tiles)
            if VARLEN and m0 < 0:
                continue  # past its sequence's rows: the computing threads pass over it too
            mbarrier_wait(bars, Q_FREE + q_buffer, q_parity ^ 1)
            stage, parity = produce_tile(view, bars, maps, k, v, q_buffer, q_at, h, q_row0 + m0, kv_at, h_kv,
                                         k_row0 + first, k_row0 + seqlen_kv, n_blocks, stage, parity, issuing, True)
            q_buffer, q_parity = ring_next(q_buffer, q_parity, Q_BUFFERS)

    @cuda.jit(device=True, forceinline=True)
    def count_packed_tiles(q, seqs):
        """A persistent block's query tiles in a packed batch: those of a launch of a block per tile, ``cdiv(the
        longest sequence's rows, BLOCK_M)`` per sequence and query head (every thread of the block calls it)."""
        longest = cuda.shared.array(1, int32)
        if cuda.threadIdx.x == 0:
            longest[0] = 0
        cuda.syncthreads()
        cu_q = seqs[0]
        batch = cu_q.shape[0] - 1
        for b in range(cuda.threadIdx.x, batch, NUM_THREADS):
            cuda.atomic.max(longest, 0, sequence_span(cu_q, b, q.shape[2])[1])
        cuda.syncthreads()
        return (longest[0] + BLOCK_M - 1) // BLOCK_M * batch * q.shape[1]

    @cuda.jit(device=True, forceinline=True)
    def release_stage(bars, acc, j, last_stage):
        """After the wait for ``P Vⱼ₋₁``: the accumulator's registers hold its result, and (from tile 1 on) this
        thread is done with tile j - 1's stage."""
        fence_registers(acc, O_REGS)
        if j > 0:
            mbarrier_arrive(bars, EMPTY + last_stage)

    # descriptors move in units of 16 bytes (8 elements): between stages, panels and k-steps
    K_STAGE_UNITS, V_STAGE_UNITS = 8 * K_ROWS, 8 * V_ROWS

    @cuda.jit(device=True, forceinline=True)
    def issue_scores(s, q_desc, k_desc):
        """Start ``S = Q Kᵀ`` for the warpgroup's Q rows (``q_desc``) and a K tile (``k_desc``): k-step ks reads
        16 columns of panel ks // 4 of both (of a transposed K tile, head-dim rows 16ks .. 16ks + 16)."""
        wgmma_fence()
        for ks in range(KSTEPS):
            a_desc = q_desc + 8 * BLOCK_M * (ks // 4) + 2 * (ks % 4)
            if K_T:
                wgmma_ss(s, BLOCK_N, a_desc, k_desc + 128 * ks, True, ks > 0)
            else:
                wgmma_ss(s, BLOCK_N, a_desc, k_desc + 8 * BLOCK_N * (ks // 4) + 2 * (ks % 4), False, ks > 0)
        wgmma_commit()

    @cuda.jit(device=True, forceinline=True)
    def issue_pv(acc, p_frag, v_desc):
        """Start ``O += P V`` for a V tile (``v_desc``): k-step kk multiplies P's A fragment kk by keys
        16kk .. 16kk + 16 of the tile."""
        fence_registers(acc, O_REGS)
        wgmma_fence()
        for kk in range(PSTEPS):
            wgmma_rs(acc, DV, p_frag[kk, 0], p_frag[kk, 1], p_frag[kk, 2], p_frag[kk, 3], v_desc + 128 * kk, True, True)
        wgmma_commit()

    @cuda.jit(device=True, forceinline=True)
    def store_staged(o, view, q_view_row, acc, b, h, m0, group, seqlen_q, warp, g, t):
        """Write the warpgroup's output rows through its Q rows in shared memory (the Q tile's from view row
        ``q_view_row``, free once its last ``P V`` is complete), so that each global store is a whole 16-byte chunk
        of a row."""
        for dt in range(DTILES):
            for half in range(2):
                row, col = sw128_cell(q_view_row, int64(BLOCK_M), 16 * warp + g + 8 * half, 8 * dt)
                st_shared_b32(view, row, col + 2 * t, pack(acc[0, dt, 2 * half], acc[0, dt, 2 * half + 1]))
        barrier_sync(STAGED_BARRIER + group, 128)
        for i in range(cuda.threadIdx.x % 128, 64 * OUT_CHUNKS, 128):
            r = 64 * group + i // OUT_CHUNKS
            c = (i % OUT_CHUNKS) * 8
            if m0 + r < seqlen_q:
                row, col = sw128_cell(q_view_row, int64(BLOCK_M), r, c)
                if ALIGNED_OUT:
                    copy_16_to_global(o, (b, h, m0 + r, c), view, row, col)
                else:
                    for e in range(8):
                        o[b, h, m0 + r, c + e] = view[row, col + e]

    @cuda.jit(device=True, forceinline=True)
    def attend_tile(k, v, o, lse, scale_log2, alibi, sinks, left, right, cap_log2, cap_slope, parts, view, bars, q_desc,
                    k_desc, v_desc, tile, q_buffer, q_parity, ring):
        """The computing threads' work on one query tile (``find_tile``'s fields ``tile``): its Q in buffer
        ``q_buffer`` (the use of parity ``q_parity``), its K/V tiles through the ring from ``ring``'s state (this
        tile's stage and parity, the previous tile's, as the loop counts them); the ring's state after it."""
        b, h, h_kv, m0, seqlen_q, seqlen_kv, q_at, q_row0, kv_at, k_row0, first, n_blocks = tile
        stage, parity, last_stage, last_parity = ring
        diagonal = seqlen_kv - seqlen_q
        terms = (left, right, cap_log2, cap_slope, alibi[b, h] * LOG2E_F32 if ALIBI else _ZERO)
        q_rows_desc = q_desc + q_buffer * (8 * Q_ROWS)  # descriptors step in 16-byte units

        warp, lane = cuda.threadIdx.x // 32, cuda.threadIdx.x % 32
        g, t = lane // 4, lane % 4
        group = warp // 4
        row0 = m0 + 16 * warp  # the warp's first query row

        m_i = cuda.local.array(2, float32)
        l_i = cuda.local.array(2, float32)
        row_max = cuda.local.array(2, float32)
        alpha = cuda.local.array(2, float32)
        acc = cuda.local.array((1, DTILES, 4), float32)
        s = cuda.local.array((1, NTILES, 4), float32)
        p_frag = cuda.local.array((PSTEPS, 4), uint32)
        init(m_i, l_i, acc)
        if SINKS and (not SPLIT or cuda.blockIdx.y == 0):
            seed_sink(m_i, l_i, sinks[h] * LOG2E_F32, t)

        if PERSISTENT or n_blocks > 0:  # a persistent block's producer copies every tile's Q, seen or not
            mbarrier_wait(bars, Q_FULL + q_buffer, q_parity)
        for j in range(n_blocks):
            mbarrier_wait(bars, FULL + stage, parity)
            if SPLIT_RING and j > 0:
                mbarrier_wait(bars, V_FULL + last_stage, last_parity)
            fence_proxy_async()  # copies made visible to this thread become visible to wgmma
            if GROUPS > 1:
                barrier_sync(TURN + group, 256)  # this warpgroup's turn on the tensor cores
            if OVERLAP:  # S first, so that the softmax can start while P Vⱼ₋₁ runs
                issue_scores(s, q_rows_desc, k_desc + stage * K_STAGE_UNITS)
            if j > 0:
                issue_pv(acc, p_frag, v_desc + last_stage * V_STAGE_UNITS)
            elif OVERLAP:
                wgmma_commit()  # an empty group in P V's place keeps the waits below constant
            if not OVERLAP:
                issue_scores(s, q_rows_desc, k_desc + stage * K_STAGE_UNITS)
            if GROUPS > 1:
                barrier_arrive(TURN + (group + 1) % GROUPS, 256)
            wgmma_wait(S_PENDING)  # S = Q Kⱼᵀ is complete
            fence_registers(s, S_REGS)
            if SPLIT_RING:
                mbarrier_arrive(bars, K_EMPTY + stage)
            if not OVERLAP:
                release_stage(bars, acc, j, last_stage)

            n0 = first + j * BLOCK_N
            masked = n0 + BLOCK_N > seqlen_kv or (CAUSAL and n0 + BLOCK_N - 1 > m0 + diagonal)
            if WINDOW:
                masked = masked or crosses_window(n0, BLOCK_N, m0, BLOCK_M, diagonal, left, right)
            factor = scale_and_mask(s, scale_log2, masked, row0, n0, seqlen_kv, diagonal, g, t, terms)
            grown = update(s, m_i, l_i, row_max, alpha, factor)
            if OVERLAP:
                wgmma_wait(0)  # P Vⱼ₋₁ is complete: the accumulator and P's registers are free
                release_stage(bars, acc, j, last_stage)
            if grown:
                rescale(acc, alpha)
            pack_p(p_frag, s)

            ahead = j + STAGES - 1  # into the stage of tile j - 1, once every warpgroup is done with it
            if not PRODUCER and ahead < n_blocks:
                if j > 0:
                    mbarrier_wait(bars, EMPTY + last_stage, last_parity)
                load_kv_async(view, bars, k, v, kv_at, h_kv, ahead, last_stage, k_row0 + first, k_row0 + seqlen_kv)
            last_stage, last_parity = stage, parity
            stage, parity = ring_next(stage, parity, STAGES)
        if n_blocks > 0:
            if SPLIT_RING:
                mbarrier_wait(bars, V_FULL + last_stage, last_parity)
                fence_proxy_async()
            if GROUPS > 1:
                barrier_sync(TURN + group, 256)
            issue_pv(acc, p_frag, v_desc + last_stage * V_STAGE_UNITS)
            if GROUPS > 1:
                barrier_arrive(TURN + (group + 1) % GROUPS, 256)
            wgmma_wait(0)
            fence_registers(acc, O_REGS)
            if PERSISTENT:
                mbarrier_arrive(bars, EMPTY + last_stage)  # the tile's last stage, free for the next tile's keys

        if SPLIT:
            finish_split(parts, acc, m_i, l_i, o, lse, b, h, m0, row0, seqlen_q, q_at, q_row0, g, t)
            return stage, parity, last_stage, last_parity
        normalize(acc, m_i, l_i, lse, WRITE_LSE, q_at, h, q_row0 + row0, q_row0 + seqlen_q, g, t)
        if STAGED:
            store_staged(o, view, q_buffer * Q_ROWS, acc, q_at, h, q_row0 + m0, group, q_row0 + seqlen_q, warp, g, t)
        else:
            store(o, acc, q_at, h, q_row0 + row0, q_row0 + seqlen_q, g, t)
        if PERSISTENT:
            fence_proxy_async()  # the staged output's writes come before the next Q's tensor copies into the buffer
            mbarrier_arrive(bars, Q_FREE + q_buffer)
        return stage, parity, last_stage, last_parity

    @cuda.jit(device=True, forceinline=True)
    def attend(q, k, v, o, lse, scale_log2, alibi, sinks, left, right, cap_log2, cap_slope, seqs, parts, maps):
        if PERSISTENT and not VARLEN:  # a persistent block's query tiles are those of a launch of a block per tile
            tiles = (q.shape[2] + BLOCK_M - 1) // BLOCK_M * q.shape[0] * q.shape[1]
        else:  # a block per tile (a persistent block of a packed batch counts its tiles below)
            tiles = cuda.gridDim.x
        # a persistent block's first tile as the loop's later ones (int64): one compile of find_tile, not two
        tile = find_tile(q, v, seqs, left, right, int64(cuda.blockIdx.x) if PERSISTENT else cuda.blockIdx.x, tiles)
        b, h, h_kv, m0, seqlen_q, seqlen_kv, q_at, q_row0, kv_at, k_row0, first, n_blocks = tile
        if VARLEN and not PERSISTENT and m0 < 0:
            return  # past the sequence's rows
        smem = cuda.shared.array(0, uint16)
        bars = cuda.shared.array(BARRIERS, int64)
        start = aligned_start(smem, SW128_ALIGN)
        view = tile_view(smem, start, VIEW_ROWS, 64)
        group = cuda.threadIdx.x // 128

        if cuda.threadIdx.x == 0:
            for stage in range(STAGES):
                mbarrier_init(bars, FULL + stage, ARRIVALS)
                mbarrier_init(bars, EMPTY + stage, CONSUMERS)
            for i in range(Q_BUFFERS):
                mbarrier_init(bars, Q_FULL + i, ARRIVALS)
                if PERSISTENT:
                    mbarrier_init(bars, Q_FREE + i, CONSUMERS)
            if SPLIT_RING:
                for stage in range(STAGES):
                    mbarrier_init(bars, V_FULL + stage, ARRIVALS)
                    mbarrier_init(bars, K_EMPTY + stage, CONSUMERS)
        cuda.syncthreads()
        if PERSISTENT and VARLEN:
            tiles = count_packed_tiles(q, seqs)
        if PRODUCER and group == GROUPS:
            shrink_registers(PRODUCER_REGISTERS)
            if PERSISTENT:
                produce_tiles(view, bars, maps, q, k, v, seqs, left, right, tiles)
            elif TENSOR_COPIES:
                if n_blocks > 0:
                    produce_by_tensor_copies(view, bars, k, v, maps, q_at, h, q_row0 + m0, kv_at, h_kv, k_row0 + first,
                                             k_row0 + seqlen_kv, n_blocks)
            elif n_blocks > 0:
                produce(view, bars, q, k, v, q_at, h, q_row0 + m0, q_row0 + seqlen_q, kv_at, h_kv, k_row0 + first,
                        k_row0 + seqlen_kv, n_blocks)
            return
        if PRODUCER:
            grow_registers(CONSUMER_REGISTERS)
        q_desc = wgmma_descriptor(smem, start + 64 * 64 * group, 0)  # the warpgroup's Q rows (of the first buffer)
        k_desc = wgmma_descriptor(smem, start + 64 * K_ROW0, 64 * D if K_T else 0)  # the K tile of stage 0
        v_desc = wgmma_descriptor(smem, start + 64 * V_ROW0, V_PANEL)  # the V tile of stage 0
        ring = (int64(0), int64(0), int64(STAGES - 1), int64(1))  # tile 0's stage and parity, tile -1's
        if PERSISTENT:
            if GROUPS > 1 and group == GROUPS - 1:
                barrier_arrive(TURN, 256)  # the first warpgroup goes first; each tile's last turn hands on the next's
            q_buffer, q_parity = int64(0), int64(0)
            for round_index in range((tiles + cuda.gridDim.x - 1) // cuda.gridDim.x):
                block = tile_of_round(round_index)
                if block >= tiles:
                    break
                tile = find_tile(q, v, seqs, left, right, block, tiles)
                if VARLEN and tile[3] < 0:
                    continue  # past its sequence's rows (m0 < 0), as for the producer
                ring = attend_tile(k, v, o, lse, scale_log2, alibi, sinks, left, right, cap_log2, cap_slope, parts,
                                   view, bars, q_desc, k_desc, v_desc, tile, q_buffer, q_parity, ring)
                q_buffer, q_parity = ring_next(q_buffer, q_parity, Q_BUFFERS)
            return
        if n_blocks > 0:
            if not PRODUCER:
                load_tile_async(view, Q_VIEW_ROW, int64(BLOCK_M), q, q_at, h, q_row0 + m0, q_row0 + seqlen_q, D)
                cp_async_mbarrier_arrive(bars, Q_FULL)
                for j in range(STAGES - 1):  # the first tiles
                    if j < n_blocks:
                        load_kv_async(view, bars, k, v, kv_at, h_kv, j, j, k_row0 + first, k_row0 + seqlen_kv)
            if GROUPS > 1 and group == GROUPS - 1:
                barrier_arrive(TURN, 256)  # the first warpgroup goes first
        attend_tile(k, v, o, lse, scale_log2, alibi, sinks, left, right, cap_log2, cap_slope, parts, view, bars, q_desc,
                    k_desc, v_desc, tile, Q_VIEW_ROW, Q_VIEW_ROW, ring)

    kernel = forward_kernel(attend, sequences, split, TENSOR_COPIES)

    if SIMULATOR:  # the simulator's jit takes no register limit
        return cuda.jit(kernel)
    return cuda.jit(kernel, max_registers=config.max_registers)
