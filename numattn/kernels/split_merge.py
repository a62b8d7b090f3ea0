"""Merging partial attention results: key splits' fp32 partials and log2-sum-exps merged into the output
by the last block of a split launch to finish (``last_to_finish``, ``split_merger``) or by a kernel of
their own (``combine_kernel``), and two states over disjoint key sets (``merge_kernel``,
``numattn.merge_states``). The decode, attention and MLA kernels share them."""

import functools
import math

import numpy as np
from numba import float32, uint64

from .._cuda import cuda
from .constants import LN2_F32, LOG2E_F32
from .ptx import ex2_approx, ld_cluster_f32, ld_cluster_f32x4, load_l2_f32, load_l2_f32x4
from .tiles import NARROW, WIDEN

_NEG_INF = np.float32(-np.inf)
_ZERO = np.float32(0.0)
MERGE_THREADS = 128  # threads of a merge_kernel block

MAX_SPLITS = 64  # key splits per row at most
MERGE_SPLITS = 16  # splits whose partials of one thread's outputs the merge loads together (decode's many splits)
SPLIT_ATTENTION_MERGE = 4  # the same for an attention launch's few splits (2 to 16): fewer loads repeat the last
KEY_SPLITS = (2, 4, 8, 16)  # key splits offered to tuners with the tensor-core kernels and decode
CLUSTER_SPLITS = 8  # key splits a cluster merges at most: the portable cluster size
_STAGE_PAD = 8  # floats added to a staged row: a warp's 8-byte stores of accumulator pairs miss no bank twice


@cuda.jit(device=True, forceinline=True)
def last_to_finish(counters, counter_row, counter_col, tickets):
    """Whether the calling block is the last of the ``tickets`` blocks that share
    ``counters[counter_row, counter_col]`` to get here (call once, from every thread). The counter
    starts at 0; the last block sets it back to 0 when it is done (one thread, after its merge:
    setting it here, before the merge, gave wrong results on the GPU).

    The block's earlier global writes are made visible device-wide before it takes its ticket, so
    the block that draws the last ticket sees every other block's results: the block barrier orders
    every thread's writes before thread 0's fence (the order CUDA's cooperative grid barrier uses),
    and the last block's thread 0 fences again after its ticket, before the barrier that releases
    the block's reads.
    """
    cuda.syncthreads()
    last = 0
    if cuda.threadIdx.x == 0:
        cuda.threadfence()
        if cuda.atomic.add(counters, (counter_row, counter_col), 1) == tickets - 1:
            cuda.threadfence()
            last = 1
    return cuda.syncthreads_or(last) != 0


@cuda.jit(device=True, forceinline=True)
def split_run(first, n_blocks, tiles, block_n):
    """The run of key tiles of this block of a split launch (split ``blockIdx.y`` of ``gridDim.y``):
    ``(first key, tile count)`` of the query tile's run from key ``first``, ``n_blocks`` tiles long, whose
    ``tiles`` tiles the splits divide evenly (a split past the run's end gets no tile)."""
    per_split = -(-tiles // cuda.gridDim.y)
    taken = cuda.blockIdx.y * per_split
    return first + taken * block_n, max(0, min(n_blocks - taken, per_split))


def split_finisher(store_partial, dtype, head_dim_v, block_m, write_lse, varlen=False):
    """Device function ``finish_split(parts, acc, m_i, l_i, o, lse, b, h, m0, row0, seqlen_q, q_at, q_row0, g, t)``:
    the end of an attention block of a split launch (workspace ``parts = (o_part, lse_part, counters)``, rows
    of sequence ``b``): its partial result stored (``store_partial`` of ``online_softmax.partial_store``, from
    the warp's first row ``row0``), then, in the query tile's last block to finish, the merge of the splits
    into rows ``m0 .. m0 + block_m`` of ``o`` (and ``lse``): of ``o[b]``, or with ``varlen`` rows
    ``q_row0 + m0 ..`` of the packed ``o[q_at]``."""
    merge_splits = split_merger(dtype, head_dim_v, None, write_lse, SPLIT_ATTENTION_MERGE)
    BLOCK_M, VARLEN = block_m, varlen

    @cuda.jit(device=True, forceinline=True)
    def finish_split(parts, acc, m_i, l_i, o, lse, b, h, m0, row0, seqlen_q, q_at, q_row0, g, t):
        o_part, lse_part, counters = parts
        store_partial(o_part, lse_part, acc, m_i, l_i, b, h, row0, seqlen_q, cuda.blockIdx.y, g, t)
        if last_to_finish(counters, 0, cuda.blockIdx.x, cuda.gridDim.y):
            if VARLEN:  # the sequence's partials, as batch 0 of views, into its rows of the packed output
                merge_splits(o_part[b:b + 1], lse_part[b:b + 1], o[q_at:q_at + 1, :, q_row0:],
                             lse[q_at:q_at + 1, :, q_row0:], 0, h, m0, min(BLOCK_M, seqlen_q - m0))
            else:
                merge_splits(o_part, lse_part, o, lse, b, h, m0, min(BLOCK_M, seqlen_q - m0))
            release_counter(counters, 0, cuda.blockIdx.x)

    return finish_split


@cuda.jit(device=True, forceinline=True)
def release_counter(counters, counter_row, counter_col):
    """The last block's closing step, after its merge: the counter of ``last_to_finish`` goes back to 0
    for the next launch (one thread). An atomic exchange, not a store: numba's dead-code elimination
    may drop a store that is the last use of an array passed down through two inlined device
    functions (its alias analysis can lose track of the kernel argument), and then every later
    launch skipped its merge; it never drops a call."""
    if cuda.threadIdx.x == 0:
        cuda.atomic.exch(counters, (counter_row, counter_col), 0)


@cuda.jit(device=True, forceinline=True)
def _load_l2_f32_tuple(src, index):
    """``load_l2_f32`` as a 1-tuple, the shape of ``load_l2_f32x4``'s result."""
    return (load_l2_f32(src, index),)


@functools.lru_cache(maxsize=None)
def split_folding(splits, quad, dtype, write_lse):
    """Device functions ``(fold, finish)`` of a merge over splits, ``quad`` adjacent outputs of a row at a time.

    ``fold(logs, values, m, total, acc) -> (m, total)`` folds ``splits`` splits' log2-sum-exps
    ``logs[u]`` and partial outputs ``values[u, :quad]`` (``-inf`` for a split that saw no key or is
    not there: weight 0) into the running merge: the reference max ``m``, the sum of the splits'
    weights ``total`` and the weighted sum ``acc[:quad]``. A NaN log-sum-exp makes the row NaN.
    ``finish(o, lse, b, h, i, col, acc, m, total)`` writes ``o[b, h, i, col : col + quad]`` and,
    with ``write_lse``, at ``col == 0`` the natural-log ``lse[b, h, i]``; ``col`` is a ``uint64`` (numba
    would widen a sum of signed and unsigned 64-bit integers to float).
    """
    SPLITS, QUAD, WRITE_LSE = splits, quad, write_lse
    narrow = NARROW[dtype]

    @cuda.jit(device=True, forceinline=True)
    def fold(logs, values, m, total, acc):
        m_round = m
        for u in range(SPLITS):
            m_round = max(m_round, logs[u])
        # no split so far saw a key: weights exp2(-inf - 0) = 0 (and a NaN stays NaN)
        m_ref = m_round if m_round != _NEG_INF else _ZERO
        rescale = ex2_approx(m - m_ref)
        total *= rescale
        for c in range(QUAD):
            acc[c] *= rescale
        for u in range(SPLITS):
            weight = ex2_approx(logs[u] - m_ref)
            total += weight
            for c in range(QUAD):
                acc[c] += weight * values[u, c]
        return m_round, total

    @cuda.jit(device=True, forceinline=True)
    def finish(o, lse, b, h, i, col, acc, m, total):
        scale = np.float32(1.0) / total if total != _ZERO else _ZERO
        for c in range(QUAD):
            o[b, h, i, col + uint64(c)] = narrow(acc[c] * scale)
        if WRITE_LSE and col == 0:
            lse[b, h, i] = (m + math.log2(total)) * LN2_F32 if total != _ZERO else _NEG_INF

    return fold, finish


def split_merger(dtype, head_dim_v, seqlen_q, write_lse, round_splits=MERGE_SPLITS):
    """Device function ``merge_splits(o_part, lse_part, o, lse, b, first_head, first_row, n_rows)``:
    the output (and natural-log LSE) of ``n_rows`` rows from every split's fp32 partial output
    and log2-sum-exp; every thread of the block takes part.

    Row ``r`` is query head ``first_head + (first_row + r) // seqlen_q``, new token
    ``(first_row + r) % seqlen_q`` (the rows of a KV head's group of query heads, ``seqlen_q``
    tokens each), or with ``seqlen_q`` None head ``first_head``, query row
    ``first_row + r`` (a tile of one head's rows).

    Each thread merges four adjacent outputs of a row on its own (one 16-byte load per
    split where the head dim is a multiple of 4, else one output): an online softmax
    over the splits' log2-sum-exps, ``round_splits`` splits per round with every load
    of the round (log-sum-exps and partials) in flight at once. A split's NaN log-sum-exp (it
    saw a NaN score) makes the row NaN, output and LSE. Indices are unsigned:
    numba then emits neither negative-index wrapping nor floor-division fix-ups, which
    keeps this once-per-block code short (its instructions are fetched cold).
    """
    U = np.uint64  # every index unsigned and 64-bit: mixed with signed ones numba would widen to float
    ONE_HEAD = seqlen_q is None
    SQ = U(1 if ONE_HEAD else seqlen_q)
    ROUND, SPLITS, ONE = round_splits, U(round_splits), U(1)
    QUAD = 4 if head_dim_v % 4 == 0 else 1  # outputs per load: one 16-byte load where a row holds whole quads
    QUADS_PER_ROW, QUAD_COLS = U(head_dim_v // QUAD), U(QUAD)
    load_quad = load_l2_f32x4 if QUAD == 4 else _load_l2_f32_tuple
    fold, finish = split_folding(ROUND, QUAD, dtype, write_lse)

    @cuda.jit(device=True, forceinline=True)
    def row_head(first_head, first_row, r):
        if ONE_HEAD:
            return first_head, first_row + r
        return first_head + (first_row + r) // SQ, (first_row + r) % SQ

    @cuda.jit(device=True, forceinline=True)
    def merge_splits(o_part, lse_part, o, lse, b, head0, row0, rows_here):
        ub, first_head, first_row, n_rows = uint64(b), uint64(head0), uint64(row0), uint64(rows_here)
        tid, step = uint64(cuda.threadIdx.x), uint64(cuda.blockDim.x)
        splits = uint64(lse_part.shape[3])
        logs = cuda.local.array(ROUND, float32)
        values = cuda.local.array((ROUND, QUAD), float32)
        acc = cuda.local.array(QUAD, float32)
        for quad in range(tid, n_rows * QUADS_PER_ROW, step):
            r, col = quad // QUADS_PER_ROW, quad % QUADS_PER_ROW * QUAD_COLS
            h, i = row_head(first_head, first_row, r)
            m, total = _NEG_INF, _ZERO
            for c in range(QUAD):
                acc[c] = _ZERO
            for s0 in range(U(0), splits, SPLITS):
                # through L2: other blocks of this launch wrote them; past the last split, loads repeat
                # it and its log-sum-exp becomes -inf (weight 0)
                for u in range(ROUND):
                    split = min(s0 + uint64(u), splits - ONE)
                    log = load_l2_f32(lse_part, (ub, h, i, split))
                    logs[u] = log if s0 + uint64(u) < splits else _NEG_INF
                    loaded = load_quad(o_part, (ub, h, i, split, col))
                    for c in range(QUAD):
                        values[u, c] = loaded[c]
                m, total = fold(logs, values, m, total, acc)
            finish(o, lse, ub, h, i, col, acc, m, total)

    return merge_splits


def cluster_stage_cols(head_dim_v):
    """Columns of the float32 tile ``[block_m, cols]`` in which a block stages its split's partial output
    for a cluster merge (its log2-sum-exps follow in a ``[1, block_m]`` tile)."""
    return head_dim_v + _STAGE_PAD


def cluster_stage_bytes(block_m, head_dim_v):
    """Shared-memory bytes of a block's staged partials for a cluster merge."""
    return 4 * block_m * (cluster_stage_cols(head_dim_v) + 1)


def cluster_merger(dtype, head_dim_v, block_m, write_lse):
    """Device function ``merge_cluster(o_s, lse_s, o, lse, b, h, m0, seqlen_q, splits, rank)``: a query
    tile's key splits merged through distributed shared memory.

    Each of the cluster's ``splits`` blocks (``splits <= CLUSTER_SPLITS``) has staged its split's
    partial output (float32, normalized within the split) of the tile's ``block_m`` rows in
    ``o_s[row, :head_dim_v]`` and their log2-sum-exps in ``lse_s[0, row]``, at the same shared-memory
    offsets. Block ``rank`` merges its share of the rows (a ``cdiv(block_m, splits)``-row chunk)
    below ``seqlen_q`` of query rows ``m0 ..`` of head ``h`` into ``o`` (and the natural-log ``lse``),
    reading every block's tiles. Call it between two ``cluster_sync``: after every block has staged,
    before any block leaves. Needs ``head_dim_v % 4 == 0``.
    """
    U = np.uint64  # unsigned indices, as in split_merger
    BLOCK_M, QUADS_PER_ROW, FOUR, ONE = U(block_m), U(head_dim_v // 4), U(4), U(1)
    fold, finish = split_folding(CLUSTER_SPLITS, 4, dtype, write_lse)

    @cuda.jit(device=True, forceinline=True)
    def merge_cluster(o_s, lse_s, o, lse, b, h, m0, seqlen_q, splits, rank):
        ub, uh, um0, n_splits = uint64(b), uint64(h), uint64(m0), uint64(splits)
        per_block = (BLOCK_M + n_splits - ONE) // n_splits
        first = uint64(rank) * per_block
        valid = min(BLOCK_M, uint64(seqlen_q) - um0)  # rows of the tile below seqlen_q
        n_rows = min(per_block, valid - first) if first < valid else U(0)
        logs = cuda.local.array(CLUSTER_SPLITS, float32)
        values = cuda.local.array((CLUSTER_SPLITS, 4), float32)
        acc = cuda.local.array(4, float32)
        for item in range(uint64(cuda.threadIdx.x), n_rows * QUADS_PER_ROW, uint64(cuda.blockDim.x)):
            r, col = first + item // QUADS_PER_ROW, item % QUADS_PER_ROW * FOUR
            # past the last split the loads repeat it and its log-sum-exp becomes -inf (weight 0)
            for u in range(CLUSTER_SPLITS):
                split = min(uint64(u), n_splits - ONE)
                log = ld_cluster_f32(lse_s, U(0), r, split)
                logs[u] = log if uint64(u) < n_splits else _NEG_INF
                loaded = ld_cluster_f32x4(o_s, r, col, split)
                for c in range(4):
                    values[u, c] = loaded[c]
            for c in range(4):
                acc[c] = _ZERO
            m, total = fold(logs, values, _NEG_INF, _ZERO, acc)
            finish(o, lse, ub, uh, um0 + r, col, acc, m, total)

    return merge_cluster


@functools.lru_cache(maxsize=None)
def combine_kernel(dtype, head_dim_v, group, seqlen_q, rows, write_lse):
    """Numba kernel ``kernel(o_part, lse_part, o, lse)``: merge the splits that other kernels wrote.

    o_part ``[B, Hq, Sq, S, Dv]`` and lse_part ``[B, Hq, Sq, S]`` (log2 domain,
    ``S <= MAX_SPLITS``); o ``[B, Hq, Sq, Dv]`` storage dtype, lse natural log.
    Grid ``(Hkv · cdiv(group · Sq, rows), B)`` of any number of threads, a
    block per chunk of ``rows`` rows of a KV head's group. (The decode kernels
    merge their own splits in their last block.)
    """
    ROW_CHUNKS = -(-(group * seqlen_q) // rows)
    merge_splits = split_merger(dtype, head_dim_v, seqlen_q, write_lse)

    def kernel(o_part, lse_part, o, lse):
        h_kv, row0 = cuda.blockIdx.x // ROW_CHUNKS, (cuda.blockIdx.x % ROW_CHUNKS) * rows
        merge_splits(o_part, lse_part, o, lse, cuda.blockIdx.y, h_kv * group, row0,
                     min(rows, group * seqlen_q - row0))

    return cuda.jit(kernel)


@functools.lru_cache(maxsize=None)
def merge_kernel(dtype, head_dim_v):
    """Numba kernel ``kernel(o_a, lse_a, o_b, lse_b, o, lse)``: attention over the union of two disjoint key sets.

    Rows flattened: o_* ``[rows, Dv]`` storage dtype, lse_* ``[rows]`` float32
    natural log (``-inf`` for a state that saw no key). One block of ``MERGE_THREADS`` per row. A NaN or
    ``+inf`` LSE gives the row NaN (its weights are NaN), as in ``split_merger``.
    """
    DV = head_dim_v
    widen, narrow = WIDEN[dtype], NARROW[dtype]

    def kernel(o_a, lse_a, o_b, lse_b, o, lse):
        row = cuda.blockIdx.x
        la, lb = lse_a[row] * LOG2E_F32, lse_b[row] * LOG2E_F32
        m_all = max(la, lb)
        m_ref = m_all if m_all != _NEG_INF else _ZERO  # both -inf: weights exp2(-inf) = 0
        wa, wb = ex2_approx(la - m_ref), ex2_approx(lb - m_ref)
        total = wa + wb
        for col in range(cuda.threadIdx.x, DV, MERGE_THREADS):
            value = _ZERO
            if total != _ZERO:  # else neither state saw a key
                value = (widen(o_a[row, col]) * wa + widen(o_b[row, col]) * wb) / total
            o[row, col] = narrow(value)
        if cuda.threadIdx.x == 0:
            lse[row] = (m_all + math.log2(total)) * LN2_F32 if total != _ZERO else _NEG_INF

    return cuda.jit(kernel)
