"""Split-KV decode (flash decoding): a few query rows against a long, possibly paged, KV cache.

Decode is memory-bound: every K/V byte should be read once, at full bandwidth.
A block owns one (batch, KV head, split of the keys) and a chunk of that KV
head's group of query rows (query heads × new tokens), so all those rows share
each K/V load. With one split the block writes the output; with several it
writes an fp32 partial output and its log2-sum-exp per split, and the last
block of a row chunk to finish merges them (a counter per row chunk, set back
to 0 by that block). ``combine_kernel`` is the same merge as a kernel of its own
for other kernels' splits, ``merge_kernel`` the merge of two states given by
the user.

* ``decode_mma_kernel`` (fp16/bf16, head dims multiples of 16, aligned rows):
  the rows are the 16 M rows of ``mma.sync`` products; each warp streams its
  share of 16-key tiles through its own ``cp.async`` ring and keeps its own
  online softmax; the warps merge at the end.
* ``decode_kernel`` (CUDA cores, everything else): a key's head dim is spread
  over ``LANES`` lanes, 16 bytes (or one element) each, and a warp holds
  ``32 / LANES`` keys at a time; every lane group runs its own online softmax
  over its keys (a ``log2 LANES``-step shuffle reduction per score), with
  ``UNROLL`` keys' loads in flight, and the groups, then the warps, merge.

Keys live in a 4-D array ``k[page, head, position, dim]`` with any strides: a
contiguous cache is the case of one page per sequence (``paged`` false, page =
batch index), a paged cache looks up ``page_table[b, t // page_size]``.
Page indices are clamped into the page array and lengths into the capacity, so
bad indices never read outside the caches (the host checks them first).
"""

import functools
import math

import numpy as np
from numba import float32, int32, uint16, uint32

from .._cuda import cuda
from .constants import LN2_F32, LOG2E_F32
from .fragments import ldmatrix_lane, load_a, load_b, load_b_trans
from .online_softmax import softmax_steps
from .ptx import (
    cp_async_4,
    cp_async_16,
    cp_async_commit,
    cp_async_wait_group,
    ex2_approx,
    f32_from_bits,
    load_16,
    mma_m16n8k16_bf16,
    mma_m16n8k16_f16,
    pack_bf16x2,
    pack_f16x2,
    shfl_xor_f32,
    st_shared_v2_f32,
    syncwarp,
    unpack_bf16x2,
    unpack_f16x2,
)
from .score_mods import NO_MODS, softcapped
from .split_merge import last_to_finish, release_counter, split_merger
from .tiles import NARROW, WIDEN, swizzled_rows, tile_col, tile_row_elems, tile_view

NUM_THREADS = 128
WARPS = NUM_THREADS // 32
_NEG_INF = np.float32(-np.inf)
_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)
_REGISTER_FLOATS = 32  # per lane and row: query and accumulator entries kept in registers
UNROLL = 4  # keys per lane group whose loads are in flight together


def decode_geometry(dtype, head_dim, head_dim_v, vector_loads):
    """``(chunk, lanes, chunks_per_lane, chunks_per_lane_v, rows)``: how a block spreads the head dims.

    ``chunk`` elements per load (16 bytes with vector loads, else 1), ``lanes``
    lanes per key, each holding ``chunks_per_lane`` chunks of a K row and
    ``chunks_per_lane_v`` of a V row; ``rows`` query rows fit a block's registers.
    """
    chunk = (4 if dtype == "float32" else 8) if vector_loads else 1
    chunks, chunks_v = -(-head_dim // chunk), -(-head_dim_v // chunk)
    lanes = min(32, 1 << (max(chunks, chunks_v) - 1).bit_length())
    per_lane, per_lane_v = -(-chunks // lanes), -(-chunks_v // lanes)
    rows = max(1, _REGISTER_FLOATS // (chunk * max(per_lane, per_lane_v)))
    return chunk, lanes, per_lane, per_lane_v, rows


def _finisher(dtype, head_dim_v, group, seqlen_q, rows, split, write_lse):
    """Device function ``finish(m_s, l_s, acc_s, o, lse, o_part, lse_part, counters, b, h_kv, row0)``.

    Merges the softmax states ``(m_s[w, r], l_s[w, r], acc_s[w · rows + r, :])``
    (log2 domain, unnormalized) of a block's warps for each of its rows and
    writes the normalized output and LSE, or, with ``split``, the split's fp32
    partial output and log2-sum-exp; the weights of each row are computed once
    (into ``m_s``). With ``split``, the last block of a row chunk to finish (the
    one that takes ``counters[b, blockIdx.y]`` to the number of splits) then
    merges every split's partials into the output and sets the counter back to
    0, so that no second kernel is needed. Call after a barrier; every thread
    takes part.
    """
    DV, G, SQ, ROWS, SPLIT, WRITE_LSE = head_dim_v, group, seqlen_q, rows, split, write_lse
    narrow = NARROW[dtype]
    merge_splits = split_merger(dtype, head_dim_v, seqlen_q, write_lse)

    @cuda.jit(device=True, forceinline=True)
    def row_head(h_kv, row0, r):
        """``(query head, new token)`` of row ``r`` of the block's rows."""
        return h_kv * G + (row0 + r) // SQ, (row0 + r) % SQ

    @cuda.jit(device=True, forceinline=True)
    def finish(m_s, l_s, acc_s, o, lse, o_part, lse_part, counters, b, h_kv, row0):
        warps = m_s.shape[0]
        n_rows = min(ROWS, G * SQ - row0)
        tid = cuda.threadIdx.x
        split = cuda.blockIdx.x
        if tid < n_rows:  # the warps' weights of each row: m_s[w, r] becomes exp2(m_w - m) / l
            r = tid
            m_all = m_s[0, r]
            for w in range(1, warps):
                m_all = max(m_all, m_s[w, r])
            m_ref = m_all if m_all != _NEG_INF else _ZERO  # no warp saw a key: l = 0, or NaN after a NaN score
            total = _ZERO
            for w in range(warps):
                total += l_s[w, r] * ex2_approx(m_s[w, r] - m_ref)
            for w in range(warps):
                m_s[w, r] = ex2_approx(m_s[w, r] - m_ref) / total if total != _ZERO else _ZERO
            h, i = row_head(h_kv, row0, r)
            row_lse = m_all + math.log2(total) if total != _ZERO else _NEG_INF
            if SPLIT:
                lse_part[b, h, i, split] = row_lse
            elif WRITE_LSE:
                lse[b, h, i] = row_lse * LN2_F32
        cuda.syncthreads()
        for idx in range(tid, n_rows * DV, cuda.blockDim.x):
            r, col = idx // DV, idx % DV
            h, i = row_head(h_kv, row0, r)
            value = _ZERO
            for w in range(warps):
                value += acc_s[w * ROWS + r, col] * m_s[w, r]
            if SPLIT:
                o_part[b, h, i, split, col] = value
            else:
                o[b, h, i, col] = narrow(value)
        if SPLIT:
            if last_to_finish(counters, b, cuda.blockIdx.y, cuda.gridDim.x):
                merge_splits(o_part, lse_part, o, lse, b, h_kv * G, row0, n_rows)
                release_counter(counters, b, cuda.blockIdx.y)

    return finish


@cuda.jit(device=True, forceinline=True)
def split_keys(seqlen, seqlen_q, window, left, split, splits):
    """``(start, end)``: the keys of ``split`` of ``splits`` equal runs of the keys some new token sees,
    all ``seqlen`` of them or, with a ``window`` of ``left`` keys, those from the first token's first."""
    first = max(0, seqlen - seqlen_q - left) if window else 0
    per_split = -(-(seqlen - first) // splits)
    start = first + split * per_split
    return start, min(seqlen, start + per_split)


@cuda.jit(device=True, forceinline=True)
def row_terms(alibi, sinks, b, h, alibi_used, sinks_used):
    """A query head's ALiBi slope and sink logit in the log2 domain (0 where unused)."""
    return alibi[b, h] * LOG2E_F32 if alibi_used else _ZERO, sinks[h] * LOG2E_F32 if sinks_used else _ZERO


@functools.lru_cache(maxsize=None)
def decode_kernel(dtype, head_dim, head_dim_v, group, seqlen_q, config, *, paged, has_seqlens, split, write_lse,
                  vector_loads, mods=NO_MODS):
    """Numba kernel ``kernel(q, k, v, page_table, seqlens, o, lse, o_part, lse_part, counters, scale_log2, alibi,
    sinks, left, right, cap_log2, cap_slope)`` taking ``config.rows`` query rows per block
    (``configs/decode.py: DecodeConfig``); the score modifications ``mods`` as ``score_mods.py`` says (the
    window's right side is the causal one: 0).

    q ``[B, Hq, Sq, D]``, o ``[B, Hq, Sq, Dv]`` (storage dtype: 16-bit floats as
    uint16), k ``[pages, Hkv, page_size, D]``, v alike with Dv, page_table
    ``[B, max_pages]`` int32 (when ``paged``), seqlens ``[B]`` int32 (when
    ``has_seqlens``; else every sequence fills its page), lse ``[B, Hq, Sq]``
    float32 (when ``write_lse`` and not ``split``), o_part ``[B, Hq, Sq, S, Dv]``
    and lse_part ``[B, Hq, Sq, S]`` float32 and counters ``[B, Hkv · cdiv(group · Sq, rows)]``
    int32, zero at launch and left zero (when ``split``: the last block of a row chunk merges
    the splits). Query head
    ``h`` reads KV head ``h // group``; query token ``i`` of ``Sq`` sees keys
    ``t <= seqlen - Sq + i``. Grid ``(S, Hkv · cdiv(group · Sq, rows), B)``,
    ``NUM_THREADS`` threads.
    """
    D, DV, G, SQ, ROWS = head_dim, head_dim_v, group, seqlen_q, config.rows
    PAGED, HAS_SEQLENS = paged, has_seqlens
    CHUNK, LANES, CPL, CPLV, _ = decode_geometry(dtype, head_dim, head_dim_v, vector_loads)
    NCH, NCHV = -(-D // CHUNK), -(-DV // CHUNK)  # chunks of a K row and of a V row
    QW, VW = CPL * CHUNK, CPLV * CHUNK  # entries per lane of a K row and of a V row
    ACC_COLS = VW * LANES  # a V row as the lanes of a key hold it (at least DV)
    STATE_ROWS = WARPS * ROWS  # the warps' states in shared memory, warp-major
    KEYS_PER_WARP = 32 // LANES
    TILE = WARPS * KEYS_PER_WARP * UNROLL  # keys a block takes per trip
    VECTOR = vector_loads
    WORD, WORDS = (uint32, 4) if VECTOR else (float32, 1)  # a loaded chunk: four raw words, or one element
    ROW_CHUNKS = -(-(G * SQ) // ROWS)
    FP32 = dtype == "float32"
    unpack = unpack_bf16x2 if dtype == "bfloat16" else unpack_f16x2
    widen = WIDEN[dtype]
    finish = _finisher(dtype, head_dim_v, group, seqlen_q, ROWS, split, write_lse)
    WINDOW, SOFTCAP, ALIBI, SINKS = mods.window, mods.softcap, mods.alibi, mods.sinks

    @cuda.jit(device=True, forceinline=True)
    def fetch(src, page, h, pos, sub, n_chunks, per_lane, words, u):
        """Start loading this lane's chunks ``sub + LANES·j`` (``j < per_lane``) of ``src[page, h, pos, :]``
        into ``words[u]``: four 32-bit words per 16-byte chunk, or one widened element."""
        for j in range(per_lane):
            c = sub + LANES * j
            if c < n_chunks:
                if VECTOR:
                    w = load_16(src, (page, h, pos, c * CHUNK))
                    for e in range(4):
                        words[u, j, e] = w[e]
                else:
                    words[u, j, 0] = widen(src[page, h, pos, c])

    @cuda.jit(device=True, forceinline=True)
    def expand(words, u, sub, n_chunks, per_lane, out):
        """``words[u]`` as fp32 row entries, 0 past the row."""
        for j in range(per_lane):
            if sub + LANES * j < n_chunks:
                if not VECTOR:
                    out[j] = words[u, j, 0]
                elif FP32:
                    for e in range(4):
                        out[j * CHUNK + e] = f32_from_bits(words[u, j, e])
                else:
                    for e in range(4):
                        out[j * CHUNK + 2 * e], out[j * CHUNK + 2 * e + 1] = unpack(words[u, j, e])
            else:
                for e in range(CHUNK):
                    out[j * CHUNK + e] = _ZERO

    @cuda.jit(device=True, forceinline=True)
    def merge(m, l_sum, m_other, l_other):
        """``(a, c, m_new)``: the weights that rescale two softmax states with maxima ``m`` and
        ``m_other`` to their joint maximum ``m_new`` (both 0 when neither state saw a key)."""
        m_new = max(m, m_other)
        if m_new == _NEG_INF:  # both states saw no key
            return _ZERO, _ZERO, m_new
        return ex2_approx(m - m_new), ex2_approx(m_other - m_new), m_new

    @cuda.jit(device=True, forceinline=True)
    def update_rows(t, valid, seqlen, row0, q_reg, k_row, v_row, m, l_sum, acc, slopes, terms):
        """Fold key ``t`` (this lane group's; ignored unless ``valid``) into every row's online softmax;
        ``slopes`` the rows' ALiBi slopes, ``terms`` ``(left, right, cap_log2, cap_slope)``."""
        for r in range(ROWS):
            score = _ZERO
            for x in range(QW):
                score += q_reg[r, x] * k_row[x]
            offset = LANES // 2
            while offset > 0:
                score += shfl_xor_f32(score, offset)
                offset //= 2
            position = seqlen - SQ + (row0 + r) % SQ
            if SOFTCAP:
                score = softcapped(score, terms[2], terms[3])
            if ALIBI:
                score -= slopes[r] * float32(position - t)
            if (valid and (SQ == 1 or t <= position)  # causal among the new tokens
                    and (not WINDOW or t >= position - terms[0])):
                if score > m[r]:
                    alpha = ex2_approx(m[r] - score)
                    m[r] = score
                    l_sum[r] *= alpha
                    for x in range(VW):
                        acc[r, x] *= alpha
                p = ex2_approx(score - m[r])
                l_sum[r] += p
                for x in range(VW):
                    acc[r, x] += p * v_row[x]

    def kernel(q, k, v, page_table, seqlens, o, lse, o_part, lse_part, counters, scale_log2, alibi, sinks, left, right,
               cap_log2, cap_slope):
        b = cuda.blockIdx.z
        h_kv = cuda.blockIdx.y // ROW_CHUNKS
        row0 = (cuda.blockIdx.y % ROW_CHUNKS) * ROWS  # first row (g · SQ + i) of the group
        split, splits = cuda.blockIdx.x, cuda.gridDim.x
        warp, lane = cuda.threadIdx.x // 32, cuda.threadIdx.x % 32
        sub = lane % LANES
        page_size = k.shape[2]
        capacity = page_table.shape[1] * page_size if PAGED else page_size
        seqlen = min(max(seqlens[b], 0), capacity) if HAS_SEQLENS else capacity
        start, end = split_keys(seqlen, SQ, WINDOW, left, split, splits)
        terms = (left, right, cap_log2, cap_slope)
        slopes = cuda.local.array(ROWS, float32)
        seeded = SINKS and split == 0 and warp == 0 and lane < LANES  # the lane group that counts the sinks

        q_reg = cuda.local.array((ROWS, QW), float32)
        acc = cuda.local.array((ROWS, VW), float32)
        m = cuda.local.array(ROWS, float32)
        l_sum = cuda.local.array(ROWS, float32)
        k_row = cuda.local.array(QW, float32)
        v_row = cuda.local.array(VW, float32)
        k_words = cuda.local.array((UNROLL, CPL, WORDS), WORD)
        v_words = cuda.local.array((UNROLL, CPLV, WORDS), WORD)
        for r in range(ROWS):
            g, i = (row0 + r) // SQ, (row0 + r) % SQ
            if row0 + r < G * SQ:
                fetch(q, b, h_kv * G + g, i, sub, NCH, CPL, k_words, 0)
            expand(k_words, 0, sub, NCH, CPL, k_row)
            for x in range(QW):
                q_reg[r, x] = k_row[x] * scale_log2 if row0 + r < G * SQ else _ZERO
            for x in range(VW):
                acc[r, x] = _ZERO
            slopes[r], sink = row_terms(alibi, sinks, b, h_kv * G + min(g, G - 1), ALIBI, SINKS)
            m[r] = sink if seeded else _NEG_INF  # a sink is a term of the sum with no value row
            l_sum[r] = _ONE if seeded else _ZERO

        # Every lane of a warp makes the same trips (the score reductions are warp-wide shuffles);
        # a lane group whose key is past the end computes a score it then ignores. A warp takes
        # UNROLL · KEYS_PER_WARP keys per trip and issues all their loads before using any.
        for first in range(start + warp * KEYS_PER_WARP * UNROLL, end, TILE):
            for u in range(UNROLL):
                t = first + u * KEYS_PER_WARP + lane // LANES
                if t < end:
                    if PAGED:
                        page = min(max(page_table[b, t // page_size], 0), k.shape[0] - 1)
                        pos = t % page_size
                    else:
                        page, pos = b, t
                    fetch(k, page, h_kv, pos, sub, NCH, CPL, k_words, u)
                    fetch(v, page, h_kv, pos, sub, NCHV, CPLV, v_words, u)
            for u in range(UNROLL):
                t = first + u * KEYS_PER_WARP + lane // LANES
                valid = t < end
                expand(k_words, u, sub, NCH, CPL, k_row)
                expand(v_words, u, sub, NCHV, CPLV, v_row)
                update_rows(t, valid, seqlen, row0, q_reg, k_row, v_row, m, l_sum, acc, slopes, terms)

        # merge the lane groups of a warp (they hold different keys, the same columns)
        offset = LANES
        while offset < 32:
            for r in range(ROWS):
                m_other = shfl_xor_f32(m[r], offset)
                l_other = shfl_xor_f32(l_sum[r], offset)
                a, c, m[r] = merge(m[r], l_sum[r], m_other, l_other)
                l_sum[r] = l_sum[r] * a + l_other * c
                for x in range(VW):
                    acc[r, x] = acc[r, x] * a + shfl_xor_f32(acc[r, x], offset) * c
            offset *= 2

        # then the warps, through shared memory
        m_s = cuda.shared.array((WARPS, ROWS), float32)
        l_s = cuda.shared.array((WARPS, ROWS), float32)
        acc_s = cuda.shared.array((STATE_ROWS, ACC_COLS), float32)
        if lane < LANES:
            for r in range(ROWS):
                if lane == 0:
                    m_s[warp, r] = m[r]
                    l_s[warp, r] = l_sum[r]
                for j in range(CPLV):
                    for e in range(CHUNK):
                        acc_s[warp * ROWS + r, (sub + LANES * j) * CHUNK + e] = acc[r, j * CHUNK + e]
        cuda.syncthreads()
        finish(m_s, l_s, acc_s, o, lse, o_part, lse_part, counters, b, h_kv, row0)

    return cuda.jit(kernel)


# --------------------------------------------------------------------------
# Tensor-core decode: the query rows of a KV head's group are the 16 rows of an mma tile
# --------------------------------------------------------------------------

MMA_ROWS = 16  # query rows per block (one m16 tile; a larger group takes several blocks)
MMA_KEYS = 16  # keys per warp tile
# A paged cache: tiles between the copy of a tile's page indices and the copies of its keys. At
# least the ring's tiles in flight plus one, so that the indices' commit group has completed.
PAGE_INDICES_AHEAD = 2


@functools.lru_cache(maxsize=None)
def decode_mma_kernel(dtype, head_dim, head_dim_v, group, seqlen_q, config, *, paged, has_seqlens, split, write_lse,
                      mods=NO_MODS):
    """Tensor-core (``mma.sync``) variant of ``decode_kernel``, same arguments and grid with ``rows = 16``,
    a ring of ``config.stages`` stages per warp.

    A block's query rows (``group · Sq`` rows of one KV head, 16 at a time) are
    the M side of m16n8k16 products. Each warp streams every fourth 16-key tile
    of the block's split through its own ring of ``stages`` shared-memory
    stages (``cp.async``, a warp-level barrier per tile, no block barrier in
    the loop) and keeps its own online softmax; the warps merge at the end.
    16-bit inputs with contiguous, 16-byte aligned rows; head dims multiples of 16.
    """
    D, DV, G, SQ, STAGES = head_dim, head_dim_v, group, seqlen_q, config.stages
    IN_FLIGHT = STAGES - 1  # tiles a warp has in flight while it computes on one
    INDICES_AHEAD = max(PAGE_INDICES_AHEAD, IN_FLIGHT + 1)
    INDEX_SLOTS = IN_FLIGHT + INDICES_AHEAD  # a warp's tiles whose page indices are in shared memory
    PAGED, HAS_SEQLENS = paged, has_seqlens
    KSTEPS, DTILES = D // 16, DV // 8
    NTILES = MMA_KEYS // 8  # n8 score tiles of a key tile
    Q_IN_REGISTERS = D <= 128  # wider Q fragments would leave too few registers for the accumulator
    Q_FRAGS = KSTEPS if Q_IN_REGISTERS else 1
    STATE_ROWS = WARPS * MMA_ROWS  # the warps' states in shared memory, warp-major
    K_ROW, V_ROW = tile_row_elems(D), tile_row_elems(DV)
    K_SWIZZLED, V_SWIZZLED = swizzled_rows(D), swizzled_rows(DV)
    Q_ELEMS = MMA_ROWS * K_ROW
    STAGE = MMA_KEYS * (K_ROW + V_ROW)  # a stage: K tile, then V tile
    WARP_RING = STAGES * STAGE
    ROW_CHUNKS = -(-(G * SQ) // MMA_ROWS)
    mma = mma_m16n8k16_bf16 if dtype == "bfloat16" else mma_m16n8k16_f16
    pack = pack_bf16x2 if dtype == "bfloat16" else pack_f16x2
    init, _, update, rescale, _, _ = softmax_steps(1, NTILES, DTILES, False, dtype)
    finish = _finisher(dtype, head_dim_v, group, seqlen_q, MMA_ROWS, split, write_lse)
    WINDOW, SOFTCAP, ALIBI, SINKS = mods.window, mods.softcap, mods.alibi, mods.sinks

    @cuda.jit(device=True, forceinline=True)
    def tile_first(start, warp, tile):
        """First key of a warp's ``tile``-th key tile: the warps take the split's 16-key tiles in turn."""
        return start + (warp + tile * WARPS) * MMA_KEYS

    @cuda.jit(device=True, forceinline=True)
    def fetch_page_indices(indices, page_table, b, first, end, page_size, tile, lane):
        """Start copying the page-table entries of keys ``first .. first + 16`` (lane ``l < 16`` copies
        key ``first + l``'s) into row ``tile % INDEX_SLOTS`` of this warp's ``indices``."""
        key = first + lane
        if lane < MMA_KEYS and key < end:
            cp_async_4(indices, tile % INDEX_SLOTS, lane, page_table, (b, key // page_size))

    @cuda.jit(device=True, forceinline=True)
    def copy_rows(dst, src, ncols, swizzled, locations, b, h_kv, first, end, lane):
        """Start this warp's 16-byte copies of keys ``first .. first + 16`` of ``src`` into the tile
        ``dst`` (``swizzled`` or padded rows); keys past ``end`` read 0. A paged cache gives each key's
        ``(page, position)`` in ``locations[:, r]``. When a row's ``chunks`` divide 32, lane ``l``
        copies chunk ``l % chunks`` of rows ``l // chunks + n · step`` (``step = 32 // chunks``,
        compile-time trip counts, every lane busy); otherwise the lanes take the tile's chunks in turn."""
        chunks = ncols // 8
        if 32 % chunks == 0:
            step = 32 // chunks
            c, r0 = (lane % chunks) * 8, lane // chunks
            pages = cuda.local.array(MMA_KEYS, int32)
            positions = cuda.local.array(MMA_KEYS, int32)
            for n in range(MMA_KEYS // step):  # every location read before the first copy is issued
                r = r0 + n * step
                pages[n], positions[n] = (locations[0, r], locations[1, r]) if PAGED else (b, first + r)
            for n in range(MMA_KEYS // step):
                r = r0 + n * step
                valid = first + r < end
                cp_async_16(dst, r, tile_col(swizzled, r, c), src, (pages[n], h_kv, positions[n] if valid else 0, c),
                            16 if valid else 0)
        else:
            for i in range(lane, MMA_KEYS * chunks, 32):
                r, c = i // chunks, (i % chunks) * 8
                valid = first + r < end
                page, pos = (locations[0, r], locations[1, r]) if PAGED else (b, first + r if valid else 0)
                cp_async_16(dst, r, tile_col(swizzled, r, c), src, (page, h_kv, pos, c), 16 if valid else 0)

    @cuda.jit(device=True, forceinline=True)
    def copy_keys(smem, stage_off, k, v, locations, indices, tile, b, h_kv, first, end, lane):
        """Start this warp's copies of keys ``first .. first + 16`` into a stage (K tile, then V tile).
        With a paged cache lane ``l < 16`` turns the page index it copied into ``indices`` for key
        ``first + l`` (landed: its group is older than the ring's) into the key's ``(page, position)``
        in ``locations``, the page clamped into the cache."""
        if PAGED:
            syncwarp()  # every lane has read the previous tile's locations
            key = first + lane
            if lane < MMA_KEYS:
                valid = key < end
                locations[0, lane] = min(max(indices[tile % INDEX_SLOTS, lane], 0), k.shape[0] - 1) if valid else 0
                locations[1, lane] = key % k.shape[2] if valid else 0
            syncwarp()
        copy_rows(tile_view(smem, stage_off, MMA_KEYS, K_ROW), k, D, K_SWIZZLED, locations, b, h_kv, first, end, lane)
        copy_rows(tile_view(smem, stage_off + MMA_KEYS * K_ROW, MMA_KEYS, V_ROW), v, DV, V_SWIZZLED, locations, b,
                  h_kv, first, end, lane)

    @cuda.jit(device=True, forceinline=True)
    def load_q_fragment(q_frag, slot, q_s, ks, mat, mrow):
        """The A fragment of k-step ``ks`` of the Q tile into ``q_frag[slot]``."""
        q_frag[slot, 0], q_frag[slot, 1], q_frag[slot, 2], q_frag[slot, 3] = load_a(q_s, 0, 16 * ks, mat, mrow,
                                                                                    K_SWIZZLED)

    @cuda.jit(device=True, forceinline=True)
    def modified(x, scale_log2, position, col, slope, terms):
        """A score into the log2 domain, softcapped and less ALiBi's bias (``terms`` as ``update_rows``'s)."""
        x *= scale_log2
        if SOFTCAP:
            x = softcapped(x, terms[2], terms[3])
        if ALIBI:
            x -= slope * float32(position - col)
        return x

    @cuda.jit(device=True, forceinline=True)
    def scale_and_mask(s, scale_log2, masked, n0, end, last_visible, row0, g, t, slopes, terms):
        """Scores into the log2 domain, modified (``modified``; ``slopes`` of the lane's two rows); when
        ``masked``, keys at or past ``end``, with several new tokens keys after ``last_visible + i`` for
        token ``i``, and keys left of the window get -inf. (Two passes, so that the unmasked tiles run no
        mask test.)"""
        if masked:
            for nt in range(MMA_KEYS // 8):
                for e in range(4):
                    col = n0 + 8 * nt + 2 * t + e % 2
                    position = last_visible + (row0 + g + 8 * (e // 2)) % SQ
                    visible = col < end and (SQ == 1 or col <= position)
                    if WINDOW:
                        visible = visible and col >= position - terms[0]
                    s[0, nt, e] = (modified(s[0, nt, e], scale_log2, position, col, slopes[e // 2], terms)
                                   if visible else _NEG_INF)
        elif SOFTCAP or ALIBI:
            for nt in range(MMA_KEYS // 8):
                for e in range(4):
                    position = last_visible + (row0 + g + 8 * (e // 2)) % SQ
                    s[0, nt, e] = modified(s[0, nt, e], scale_log2, position, n0 + 8 * nt + 2 * t + e % 2,
                                           slopes[e // 2], terms)
        else:
            for nt in range(MMA_KEYS // 8):
                for e in range(4):
                    s[0, nt, e] *= scale_log2

    def kernel(q, k, v, page_table, seqlens, o, lse, o_part, lse_part, counters, scale_log2, alibi, sinks, left, right,
               cap_log2, cap_slope):
        smem = cuda.shared.array(0, uint16)
        b = cuda.blockIdx.z
        h_kv = cuda.blockIdx.y // ROW_CHUNKS
        row0 = (cuda.blockIdx.y % ROW_CHUNKS) * MMA_ROWS
        split, splits = cuda.blockIdx.x, cuda.gridDim.x
        warp, lane = cuda.threadIdx.x // 32, cuda.threadIdx.x % 32
        g, t = lane // 4, lane % 4
        mat, mrow = ldmatrix_lane(lane)
        capacity = page_table.shape[1] * k.shape[2] if PAGED else k.shape[2]
        seqlen = min(max(seqlens[b], 0), capacity) if HAS_SEQLENS else capacity
        start, end = split_keys(seqlen, SQ, WINDOW, left, split, splits)
        terms = (left, right, cap_log2, cap_slope)
        n_tiles = max(0, -(-(end - start) // MMA_KEYS))
        my_tiles = (n_tiles - warp + WARPS - 1) // WARPS  # this warp takes tiles warp, warp + WARPS, ...
        ring = Q_ELEMS + warp * WARP_RING

        # a paged cache: the page indices of this warp's next tiles (each lane < 16 copies and reads
        # its own key's), and the (page, position) of the keys of the tile it issues
        indices = cuda.shared.array((WARPS, INDEX_SLOTS, MMA_KEYS), int32)[warp]
        locations = cuda.shared.array((WARPS, 2, MMA_KEYS), int32)[warp]
        page_size = k.shape[2]
        if PAGED:
            for j in range(IN_FLIGHT + INDICES_AHEAD):
                if j < my_tiles:
                    fetch_page_indices(indices, page_table, b, tile_first(start, warp, j), end, page_size,
                                       j, lane)
            cp_async_commit()
        q_s = tile_view(smem, 0, MMA_ROWS, K_ROW)
        for idx in range(cuda.threadIdx.x, MMA_ROWS * (D // 8), NUM_THREADS):
            r, c = idx // (D // 8), (idx % (D // 8)) * 8
            valid = row0 + r < G * SQ
            h = h_kv * G + (row0 + r) // SQ if valid else 0
            cp_async_16(q_s, r, tile_col(K_SWIZZLED, r, c), q, (b, h, (row0 + r) % SQ if valid else 0, c),
                        16 if valid else 0)
        cp_async_commit()
        if PAGED:
            cp_async_wait_group(1)  # the first tiles' page indices have landed (the Q tile may not have)
        for j in range(IN_FLIGHT):  # the first tiles, one commit group each
            if j < my_tiles:
                copy_keys(smem, ring + j * STAGE, k, v, locations, indices, j, b, h_kv,
                          tile_first(start, warp, j), end, lane)
            cp_async_commit()
        cp_async_wait_group(IN_FLIGHT)  # the Q tile has landed
        cuda.syncthreads()

        q_frag = cuda.local.array((Q_FRAGS, 4), uint32)
        if Q_IN_REGISTERS:
            for ks in range(KSTEPS):
                load_q_fragment(q_frag, ks, q_s, ks, mat, mrow)
        m_i = cuda.local.array(2, float32)
        l_i = cuda.local.array(2, float32)
        row_max = cuda.local.array(2, float32)
        alpha = cuda.local.array(2, float32)
        acc = cuda.local.array((1, DTILES, 4), float32)
        s = cuda.local.array((1, NTILES, 4), float32)
        init(m_i, l_i, acc)
        slopes = cuda.local.array(2, float32)
        for half in range(2):  # the lane's rows g and g + 8: their heads' slopes and sinks
            head = h_kv * G + min((row0 + g + 8 * half) // SQ, G - 1)
            slopes[half], sink = row_terms(alibi, sinks, b, head, ALIBI, SINKS)
            if SINKS and split == 0 and warp == 0:  # warp 0 counts the sinks (l_i holds lane partials)
                m_i[half] = sink
                l_i[half] = _ONE if t == 0 else _ZERO

        for j in range(my_tiles):
            syncwarp()  # every lane is done with the stage refilled below
            ahead = j + IN_FLIGHT
            if ahead < my_tiles:
                copy_keys(smem, ring + (ahead % STAGES) * STAGE, k, v, locations, indices, ahead, b, h_kv,
                          tile_first(start, warp, ahead), end, lane)
            indexed = ahead + INDICES_AHEAD  # its slot is tile j's, read when tile j was issued
            if PAGED and indexed < my_tiles:
                fetch_page_indices(indices, page_table, b, tile_first(start, warp, indexed), end,
                                   page_size, indexed, lane)
            cp_async_commit()
            cp_async_wait_group(IN_FLIGHT)  # tile j has landed
            syncwarp()
            k_s = tile_view(smem, ring + (j % STAGES) * STAGE, MMA_KEYS, K_ROW)
            v_s = tile_view(smem, ring + (j % STAGES) * STAGE + MMA_KEYS * K_ROW, MMA_KEYS, V_ROW)

            for nt in range(MMA_KEYS // 8):
                for e in range(4):
                    s[0, nt, e] = _ZERO
            for ks in range(KSTEPS):  # S = Q Kᵀ: one ldmatrix gives the B fragments of both n8 tiles
                slot = ks if Q_IN_REGISTERS else 0
                if not Q_IN_REGISTERS:
                    load_q_fragment(q_frag, 0, q_s, ks, mat, mrow)
                b0, b1, b2, b3 = load_b(k_s, 0, 16 * ks, mat, mrow, K_SWIZZLED)
                a0, a1, a2, a3 = q_frag[slot, 0], q_frag[slot, 1], q_frag[slot, 2], q_frag[slot, 3]
                s[0, 0, 0], s[0, 0, 1], s[0, 0, 2], s[0, 0, 3] = mma(a0, a1, a2, a3, b0, b1, s[0, 0, 0], s[0, 0, 1],
                                                                     s[0, 0, 2], s[0, 0, 3])
                s[0, 1, 0], s[0, 1, 1], s[0, 1, 2], s[0, 1, 3] = mma(a0, a1, a2, a3, b2, b3, s[0, 1, 0], s[0, 1, 1],
                                                                     s[0, 1, 2], s[0, 1, 3])
            n0 = tile_first(start, warp, j)
            masked = n0 + MMA_KEYS > end or (SQ > 1 and n0 + MMA_KEYS - 1 > seqlen - SQ)
            if WINDOW:  # the tile starts left of the last token's window
                masked = masked or n0 < seqlen - 1 - left
            scale_and_mask(s, scale_log2, masked, n0, end, seqlen - SQ, row0, g, t, slopes, terms)
            if update(s, m_i, l_i, row_max, alpha, _ONE):
                rescale(acc, alpha)
            # O += P V: the two score tiles are the A fragment of one k-step
            p0, p1 = pack(s[0, 0, 0], s[0, 0, 1]), pack(s[0, 0, 2], s[0, 0, 3])
            p2, p3 = pack(s[0, 1, 0], s[0, 1, 1]), pack(s[0, 1, 2], s[0, 1, 3])
            for dp in range(DTILES // 2):
                b0, b1, b2, b3 = load_b_trans(v_s, 0, 16 * dp, mat, mrow, V_SWIZZLED)
                n = 2 * dp
                acc[0, n, 0], acc[0, n, 1], acc[0, n, 2], acc[0, n, 3] = mma(
                    p0, p1, p2, p3, b0, b1, acc[0, n, 0], acc[0, n, 1], acc[0, n, 2], acc[0, n, 3])
                acc[0, n + 1, 0], acc[0, n + 1, 1], acc[0, n + 1, 2], acc[0, n + 1, 3] = mma(
                    p0, p1, p2, p3, b2, b3, acc[0, n + 1, 0], acc[0, n + 1, 1], acc[0, n + 1, 2], acc[0, n + 1, 3])

        # the warps' states, through shared memory (the rings are free once every warp is here)
        for half in range(2):
            l_i[half] += shfl_xor_f32(l_i[half], 1)
            l_i[half] += shfl_xor_f32(l_i[half], 2)
        m_s = cuda.shared.array((WARPS, MMA_ROWS), float32)
        l_s = cuda.shared.array((WARPS, MMA_ROWS), float32)
        acc_s = tile_view(cuda.shared.array(0, float32), 0, STATE_ROWS, DV)
        cuda.syncthreads()
        n_rows = min(MMA_ROWS, G * SQ - row0)
        for half in range(2):
            r = g + 8 * half
            if r < n_rows:  # the m16 tile's rows past the group's are padding: never merged
                if t == 0:
                    m_s[warp, r] = m_i[half]
                    l_s[warp, r] = l_i[half]
                for dt in range(DTILES):
                    st_shared_v2_f32(acc_s, warp * MMA_ROWS + r, 8 * dt + 2 * t, acc[0, dt, 2 * half],
                                     acc[0, dt, 2 * half + 1])
        cuda.syncthreads()
        finish(m_s, l_s, acc_s, o, lse, o_part, lse_part, counters, b, h_kv, row0)

    return cuda.jit(kernel)
