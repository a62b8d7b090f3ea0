"""Split-KV decode (flash decoding): a few query rows against a long, possibly paged, KV cache.

Decode is memory-bound, so the kernel is built around reading every K/V byte
once, 16 bytes per load. A block owns one (batch, KV head, split of the keys)
and up to ``ROWS`` query rows of that KV head's group (query heads × new
tokens), so all the rows share each K/V load. A key's head dim is spread over
``LANES`` lanes, 16 bytes each (``CHUNK`` elements), and a warp holds
``32 / LANES`` keys at a time: every such lane group runs its own online
softmax over its keys (no exchange per key except the ``log2 LANES``-step
shuffle reduction of each score), and the groups, then the warps, merge their
states at the end. With one split the block writes the output; with several it
writes an fp32 partial output and its log2-sum-exp per split, and
``combine_kernel`` merges them.

Keys live in a 4-D array ``k[page, head, position, dim]`` with any strides: a
contiguous cache is the case of one page per sequence (``PAGED`` false, page =
batch index), a paged cache looks up ``page_table[b, t // page_size]``.
Page indices are clamped into the page array and lengths into the capacity, so
bad indices never read outside the caches (the host checks them first).
"""

import functools
import math

import numpy as np
from numba import float32

from .._cuda import cuda
from .ptx import ex2_approx, f32_from_bits, load_16, shfl_xor_f32, unpack_bf16x2, unpack_f16x2
from .tiles import NARROW, WIDEN

NUM_THREADS = 128
WARPS = NUM_THREADS // 32
_NEG_INF = np.float32(-np.inf)
_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)
_LN2 = np.float32(math.log(2.0))
_REGISTER_FLOATS = 32  # per lane and row: query and accumulator entries kept in registers


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


@functools.lru_cache(maxsize=None)
def decode_kernel(dtype, head_dim, head_dim_v, group, seqlen_q, rows, paged, has_seqlens, split, write_lse, vector_loads):
    """Numba kernel ``kernel(q, k, v, page_table, seqlens, o, lse, o_part, lse_part, scale_log2)``.

    q ``[B, Hq, Sq, D]``, o ``[B, Hq, Sq, Dv]`` (storage dtype: 16-bit floats as
    uint16), k ``[pages, Hkv, page_size, D]``, v alike with Dv, page_table
    ``[B, max_pages]`` int32 (when ``paged``), seqlens ``[B]`` int32 (when
    ``has_seqlens``; else every sequence fills its page), lse ``[B, Hq, Sq]``
    float32 (when ``write_lse`` and not ``split``), o_part ``[B, Hq, Sq, S, Dv]``
    and lse_part ``[B, Hq, Sq, S]`` float32 (when ``split``). Query head
    ``h`` reads KV head ``h // group``; query token ``i`` of ``Sq`` sees keys
    ``t <= seqlen - Sq + i``. Grid ``(S, Hkv · cdiv(group · Sq, rows), B)``,
    ``NUM_THREADS`` threads.
    """
    D, DV, G, SQ, ROWS = head_dim, head_dim_v, group, seqlen_q, rows
    PAGED, HAS_SEQLENS, SPLIT, WRITE_LSE = paged, has_seqlens, split, write_lse
    CHUNK, LANES, CPL, CPLV, _ = decode_geometry(dtype, head_dim, head_dim_v, vector_loads)
    NCH, NCHV = -(-D // CHUNK), -(-DV // CHUNK)  # chunks of a K row and of a V row
    QW, VW = CPL * CHUNK, CPLV * CHUNK  # entries per lane of a K row and of a V row
    KEYS_PER_WARP = 32 // LANES
    SLOTS = WARPS * KEYS_PER_WARP  # keys in flight per block, one per lane group
    ROW_CHUNKS = -(-(G * SQ) // ROWS)
    VECTOR = vector_loads
    FP32 = dtype == "float32"
    unpack = unpack_bf16x2 if dtype == "bfloat16" else unpack_f16x2
    widen, narrow = WIDEN[dtype], NARROW[dtype]

    @cuda.jit(device=True, inline="always")
    def load_row(src, page, h, pos, sub, n_chunks, per_lane, out):
        """This lane's chunks ``sub + LANES·j`` (``j < per_lane``) of ``src[page, h, pos, :]`` into ``out``
        as fp32, 0 past the row."""
        for j in range(per_lane):
            c = sub + LANES * j
            if c < n_chunks:
                if VECTOR:
                    w = load_16(src, (page, h, pos, c * CHUNK))
                    for e in range(4):
                        if FP32:
                            out[j * CHUNK + e] = f32_from_bits(w[e])
                        else:
                            out[j * CHUNK + 2 * e], out[j * CHUNK + 2 * e + 1] = unpack(w[e])
                else:
                    out[j] = widen(src[page, h, pos, c])
            else:
                for e in range(CHUNK):
                    out[j * CHUNK + e] = _ZERO

    @cuda.jit(device=True, inline="always")
    def merge(m, l_sum, m_other, l_other):
        """Weights ``(a, b)`` that rescale two softmax states with maxima ``m``, ``m_other`` to their joint max."""
        m_new = max(m, m_other)
        if m_new == _NEG_INF:  # both states saw no key
            return _ZERO, _ZERO, m_new
        return ex2_approx(m - m_new), ex2_approx(m_other - m_new), m_new

    def kernel(q, k, v, page_table, seqlens, o, lse, o_part, lse_part, scale_log2):
        b = cuda.blockIdx.z
        h_kv = cuda.blockIdx.y // ROW_CHUNKS
        row0 = (cuda.blockIdx.y % ROW_CHUNKS) * ROWS  # first row (g · SQ + i) of the group
        split, splits = cuda.blockIdx.x, cuda.gridDim.x
        warp, lane = cuda.threadIdx.x // 32, cuda.threadIdx.x % 32
        sub = lane % LANES
        page_size = k.shape[2]
        capacity = page_table.shape[1] * page_size if PAGED else page_size
        seqlen = min(max(seqlens[b], 0), capacity) if HAS_SEQLENS else capacity
        per_split = -(-seqlen // splits)
        start, end = split * per_split, min(seqlen, (split + 1) * per_split)

        q_reg = cuda.local.array((ROWS, QW), float32)
        acc = cuda.local.array((ROWS, VW), float32)
        m = cuda.local.array(ROWS, float32)
        l_sum = cuda.local.array(ROWS, float32)
        k_row = cuda.local.array(QW, float32)
        v_row = cuda.local.array(VW, float32)
        for r in range(ROWS):
            g, i = (row0 + r) // SQ, (row0 + r) % SQ
            if row0 + r < G * SQ:
                load_row(q, b, h_kv * G + g, i, sub, NCH, CPL, k_row)
            for x in range(QW):
                q_reg[r, x] = k_row[x] * scale_log2 if row0 + r < G * SQ else _ZERO
            for x in range(VW):
                acc[r, x] = _ZERO
            m[r] = _NEG_INF
            l_sum[r] = _ZERO

        # every lane of a warp makes the same trips (the score reductions are warp-wide shuffles);
        # a lane group whose key is past the end computes a score it then ignores
        for first in range(start + warp * KEYS_PER_WARP, end, SLOTS):
            t = first + lane // LANES
            valid = t < end
            if valid:
                if PAGED:
                    page = min(max(page_table[b, t // page_size], 0), k.shape[0] - 1)
                    pos = t % page_size
                else:
                    page, pos = b, t
                load_row(k, page, h_kv, pos, sub, NCH, CPL, k_row)
                load_row(v, page, h_kv, pos, sub, NCHV, CPLV, v_row)
            for r in range(ROWS):
                score = _ZERO
                for x in range(QW):
                    score += q_reg[r, x] * k_row[x]
                offset = LANES // 2
                while offset > 0:
                    score += shfl_xor_f32(score, offset)
                    offset //= 2
                if valid and (SQ == 1 or t <= seqlen - SQ + (row0 + r) % SQ):  # causal among the new tokens
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
        acc_s = cuda.shared.array((WARPS, ROWS, VW * LANES), float32)
        if lane < LANES:
            for r in range(ROWS):
                if lane == 0:
                    m_s[warp, r] = m[r]
                    l_s[warp, r] = l_sum[r]
                for j in range(CPLV):
                    for e in range(CHUNK):
                        acc_s[warp, r, (sub + LANES * j) * CHUNK + e] = acc[r, j * CHUNK + e]
        cuda.syncthreads()
        for idx in range(cuda.threadIdx.x, ROWS * DV, NUM_THREADS):
            r, col = idx // DV, idx % DV
            if row0 + r < G * SQ:
                h, i = h_kv * G + (row0 + r) // SQ, (row0 + r) % SQ
                m_all = m_s[0, r]
                for w in range(1, WARPS):
                    m_all = max(m_all, m_s[w, r])
                total, value = _ZERO, _ZERO
                if m_all != _NEG_INF:
                    for w in range(WARPS):
                        weight = ex2_approx(m_s[w, r] - m_all)
                        total += l_s[w, r] * weight
                        value += acc_s[w, r, col] * weight
                out = value / total if total > _ZERO else _ZERO
                if SPLIT:
                    o_part[b, h, i, split, col] = out
                    if col == 0:
                        lse_part[b, h, i, split] = m_all + math.log2(total) if total > _ZERO else _NEG_INF
                else:
                    o[b, h, i, col] = narrow(out)
                    if WRITE_LSE and col == 0:
                        lse[b, h, i] = (m_all + math.log2(total)) * _LN2 if total > _ZERO else _NEG_INF

    return cuda.jit(kernel)


@functools.lru_cache(maxsize=None)
def combine_kernel(dtype, head_dim_v, write_lse):
    """Numba kernel ``kernel(o_part, lse_part, o, lse)``: merge the splits of each query row.

    o_part ``[B, Hq, Sq, S, Dv]`` and lse_part ``[B, Hq, Sq, S]`` (log2 domain)
    as written by a split ``decode_kernel``; o ``[B, Hq, Sq, Dv]`` storage
    dtype, lse natural log. One block of ``NUM_THREADS`` threads per row.
    """
    DV, WRITE_LSE = head_dim_v, write_lse
    narrow = NARROW[dtype]

    def kernel(o_part, lse_part, o, lse):
        heads, seqlen_q = o.shape[1], o.shape[2]
        row = cuda.blockIdx.x
        b, h, i = row // (heads * seqlen_q), (row // seqlen_q) % heads, row % seqlen_q
        splits = lse_part.shape[3]
        m_all = _NEG_INF
        for s in range(splits):
            m_all = max(m_all, lse_part[b, h, i, s])
        total = _ZERO
        if m_all != _NEG_INF:
            for s in range(splits):
                total += ex2_approx(lse_part[b, h, i, s] - m_all)
        for col in range(cuda.threadIdx.x, DV, NUM_THREADS):
            value = _ZERO
            if total > _ZERO:
                for s in range(splits):
                    value += o_part[b, h, i, s, col] * ex2_approx(lse_part[b, h, i, s] - m_all)
                value /= total
            o[b, h, i, col] = narrow(value)
        if WRITE_LSE and cuda.threadIdx.x == 0:
            lse[b, h, i] = (m_all + math.log2(total)) * _LN2 if total > _ZERO else _NEG_INF

    return cuda.jit(kernel)


@functools.lru_cache(maxsize=None)
def merge_kernel(dtype, head_dim_v):
    """Numba kernel ``kernel(o_a, lse_a, o_b, lse_b, o, lse)``: attention over the union of two disjoint key sets.

    Rows flattened: o_* ``[rows, Dv]`` storage dtype, lse_* ``[rows]`` float32
    natural log (``-inf`` for a state that saw no key). One block per row.
    """
    DV = head_dim_v
    widen, narrow = WIDEN[dtype], NARROW[dtype]
    LOG2E = np.float32(1.0 / math.log(2.0))

    def kernel(o_a, lse_a, o_b, lse_b, o, lse):
        row = cuda.blockIdx.x
        la, lb = lse_a[row] * LOG2E, lse_b[row] * LOG2E
        m_all = max(la, lb)
        wa, wb, total = _ZERO, _ZERO, _ZERO
        if m_all != _NEG_INF:
            wa, wb = ex2_approx(la - m_all), ex2_approx(lb - m_all)
            total = wa + wb
        for col in range(cuda.threadIdx.x, DV, NUM_THREADS):
            value = _ZERO
            if total > _ZERO:
                value = (widen(o_a[row, col]) * wa + widen(o_b[row, col]) * wb) / total
            o[row, col] = narrow(value)
        if cuda.threadIdx.x == 0:
            lse[row] = (m_all + math.log2(total)) * _LN2 if total > _ZERO else _NEG_INF

    return cuda.jit(kernel)

