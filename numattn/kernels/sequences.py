"""Where a block of an attention kernel finds its sequence: a dense batch, a packed batch of
variable-length sequences, or keys and values in pages.

A kernel specialisation names its layout (``SequenceLayout``, compile-time flags); ``block_locator(layout)``
gives the device function that maps a forward's thread block to its rows, ``key_block_locator(layout)``
a backward's:

* dense: ``q [B, Hq, Sq, D]``, ``k``, ``v [B, Hkv, Skv, D]``; sequence ``b`` is ``q[b]``, ``k[b]``.
* varlen: packed ``q (total_q, Hq, D)`` reaches the kernel as ``[1, Hq, total_q, D]``; sequence ``b``
  holds rows ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1]``, its keys rows ``cu_seqlens_k[b] ..
  cu_seqlens_k[b + 1]`` of ``k``, ``v [1, Hkv, total_k, D]``, the first ``seqused_k[b]`` of them
  with ``seqused``.
* paged (with varlen queries): ``k``, ``v [num_pages, Hkv, page_size, D]``, ``page_size`` a compile-time
  constant; key ``n`` of sequence ``b`` is row ``n % page_size`` of page ``page_table[b, n // page_size]``;
  the sequence has ``seqused_k[b]`` keys with ``seqused``, else ``cu_seqlens_k[b + 1] − cu_seqlens_k[b]``.

A forward kernel takes ``cu_seqlens_q [B + 1]``, ``cu_seqlens_k [B + 1]``, ``seqused_k [B]`` and
``page_table [B, max_pages]`` (int32; unused ones of shape 1) after its other arguments, and runs
on ``cdiv(max_seqlen_q, block_m) · B · Hq`` blocks; those past their sequence's rows return at once.
A backward kernel (packed keys) takes ``cu_seqlens_q`` and ``cu_seqlens_k`` and runs on
``cdiv(max_seqlen_k, block_n) · B · Hkv`` blocks; its ``lse2`` and ``delta`` rows of sequence ``b`` start at
``padded_rows(cu_seqlens_q[b], b)``, a multiple of ``ROWS_ALIGNMENT`` (whole tiles are copied 16 bytes at a
time, and the rows past a sequence's end read the zeros between sequences).
Every value read from these arrays is clamped into range (offsets into the packed rows, key counts
into the page table's capacity, pages into the page array), so that bad values never make a kernel
read outside its arrays; the host checks them.
"""

import functools
from dataclasses import dataclass

import numpy as np
from numba import int32, uint32

from .._cuda import cuda
from .ptx import broadcast_i32, load_readonly_i32
from .tiles import key_block, key_tile, query_tile, query_tiles, row_of_batch

ROWS_ALIGNMENT = 128  # the start of a sequence's rows of a varlen backward's lse2 and delta; at least any block_m


@dataclass(frozen=True)
class SequenceLayout:
    """How a kernel specialisation finds its sequences (see the module docstring)."""

    varlen: bool = False
    page_size: int = 0  # keys per page of a paged layout, 0 for packed keys
    seqused: bool = False
    sections: bool = False  # dense: a forward grid walks its heads in sections (``tiles.query_tile``)

    @property
    def paged(self):
        return self.page_size > 0

    def __str__(self):
        names = [name for name in ("varlen", "paged", "seqused", "sections") if getattr(self, name)]
        return "+".join(names).replace("paged", f"pages of {self.page_size}") or "dense"


DENSE = SequenceLayout()
DENSE_IN_SECTIONS = SequenceLayout(sections=True)


@functools.cache
def source_row(layout):
    """How a tile copier finds a K/V row: ``row_of_batch``, or for a paged layout ``row_of_pages(at, row)``:
    ``(page, row within it)`` of key ``row`` of a sequence whose pages ``at = (page_table, b, last_page)``
    lists, the page clamped into ``[0, last_page]`` (32-bit arithmetic: a page table's entries are int32;
    read-only loads, which the compiler may issue ahead of the copies of earlier rows)."""
    if not layout.paged:
        return row_of_batch
    PAGE_SIZE = np.uint32(layout.page_size)
    ZERO = np.int32(0)

    @cuda.jit(device=True, forceinline=True)
    def row_of_pages(at, row):
        table, b, last_page = at
        key = uint32(row)
        return min(max(load_readonly_i32(table, (b, key // PAGE_SIZE)), ZERO), last_page), key % PAGE_SIZE

    return row_of_pages


@cuda.jit(device=True, forceinline=True)
def sequence_span(cu, b, total):
    """``(start, length)`` of sequence ``b`` in ``total`` packed rows, clamped into them. The offsets come by
    global loads: a generic load (which may read shared memory) makes ptxas pad every later memory fence of the
    kernel, such as each key tile's proxy fence, with dummy shared loads."""
    start = min(max(load_readonly_i32(cu, (b,)), 0), total)
    return int32(start), int32(min(max(load_readonly_i32(cu, (b + 1,)), start), total) - start)


@functools.cache
def block_locator(layout):
    """Device function ``locate(q, v, sequences, block_m, causal, block, blocks)`` of thread block ``block`` of a
    grid of ``blocks`` (``cuda.blockIdx.x`` and ``cuda.gridDim.x``, or the query tile a persistent block takes):
    ``(b, h, h_kv, m0, n_end, seqlen_q, seqlen_kv, q_at, q_row0, kv_at, k_row0)``.

    The block owns query rows ``m0 .. m0 + block_m`` of sequence ``b``, query head ``h`` (reading KV head
    ``h_kv``), and must visit its keys ``0 .. n_end``; ``m0 < 0`` for a block past its sequence's rows.
    Row ``r`` of the sequence is row ``q_row0 + r`` of ``q[q_at, h]`` (and of ``o``, ``lse``); key ``n`` is
    found by ``source_row(layout)(kv_at, k_row0 + n)``. A sequence's last query rows, the longest under
    causal masking, come first in the grid (with ``sections``, first in a section of heads). ``sequences`` is
    ``(cu_seqlens_q, cu_seqlens_k, seqused_k, page_table)``, or ``()`` for a dense layout.
    """
    VARLEN, PAGED, SEQUSED, PAGE_SIZE = layout.varlen, layout.paged, layout.seqused, layout.page_size
    SECTIONS = layout.sections

    @cuda.jit(device=True, forceinline=True)
    def locate(q, v, sequences, block_m, causal, block, blocks):
        heads_q, heads_kv = q.shape[1], v.shape[1]
        if VARLEN:
            cu_q, cu_k, seqused_k, page_table = sequences
            batch = cu_q.shape[0] - 1
        else:
            batch = q.shape[0]
        heads = batch * heads_q
        if SECTIONS:
            kv_head_bytes = v.shape[2] * (q.shape[3] + v.shape[3]) * v.itemsize
            tiles_from_end, head = query_tile(heads, heads_q // heads_kv, kv_head_bytes, block, blocks)
            b, h = head // heads_q, head % heads_q
        else:
            tiles_from_end = block // heads
            b, h = (block % heads) // heads_q, block % heads_q
        if PAGED:
            q_at, k_row0 = 0, 0
            kv_at = (page_table, b, int32(v.shape[0] - 1))
            q_row0, seqlen_q = sequence_span(cu_q, b, q.shape[2])
            seqlen_kv = (load_readonly_i32(seqused_k, (b,)) if SEQUSED
                         else load_readonly_i32(cu_k, (b + 1,)) - load_readonly_i32(cu_k, (b,)))
            seqlen_kv = int32(min(max(seqlen_kv, 0), page_table.shape[1] * PAGE_SIZE))
        elif VARLEN:
            q_at, kv_at = 0, 0
            q_row0, seqlen_q = sequence_span(cu_q, b, q.shape[2])
            k_row0, seqlen_kv = sequence_span(cu_k, b, v.shape[2])
            if SEQUSED:
                seqlen_kv = min(max(load_readonly_i32(seqused_k, (b,)), 0), seqlen_kv)
        else:
            q_at, kv_at, q_row0, k_row0 = b, b, 0, 0
            seqlen_q, seqlen_kv = q.shape[2], v.shape[2]
        if VARLEN:  # loaded alike by every lane, which ptxas cannot know: lane 0's values tell it (``broadcast_i32``)
            q_row0, seqlen_q = broadcast_i32(int32(q_row0)), broadcast_i32(int32(seqlen_q))
            k_row0, seqlen_kv = broadcast_i32(int32(k_row0)), broadcast_i32(int32(seqlen_kv))
        m0 = ((seqlen_q + block_m - 1) // block_m - 1 - tiles_from_end) * block_m
        n_end = seqlen_kv
        if causal:
            n_end = min(seqlen_kv, m0 + block_m + seqlen_kv - seqlen_q)
        return (b, h, h // (heads_q // heads_kv), m0, n_end, seqlen_q, seqlen_kv, q_at, q_row0, kv_at, k_row0)

    return locate


@cuda.jit(device=True, forceinline=True)
def padded_rows(q_row0, b):
    """The first row of sequence ``b``'s lse2 and delta in a varlen backward, for its first packed query row
    ``q_row0``: ``q_row0 + b · ROWS_ALIGNMENT`` rounded down to a multiple of ``ROWS_ALIGNMENT``, so that the
    sequences' rows never overlap and each sequence's whole tiles fit before the next one's."""
    return (q_row0 + b * ROWS_ALIGNMENT) // ROWS_ALIGNMENT * ROWS_ALIGNMENT


def padded_rows_count(total_q, batch):
    """Rows of a varlen backward's lse2 and delta: room for every sequence's rows from ``padded_rows`` and a
    last tile past them, a multiple of ``ROWS_ALIGNMENT`` (so that each head's rows start 16-byte aligned)."""
    return -(-(total_q + (batch + 1) * ROWS_ALIGNMENT) // ROWS_ALIGNMENT) * ROWS_ALIGNMENT


@cuda.jit(device=True, forceinline=True)
def sequence_of(cu, row):
    """The sequence ``b`` whose rows ``cu[b] .. cu[b + 1]`` hold packed ``row`` (``cu`` non-decreasing; the last
    sequence for a row past them): a binary search."""
    low, high = 0, cu.shape[0] - 2
    while low < high:
        middle = (low + high + 1) // 2
        if load_readonly_i32(cu, (middle,)) <= row:
            low = middle
        else:
            high = middle - 1
    return low


@functools.cache
def key_block_locator(layout):
    """Device function ``locate(q, k, sequences, block_n, block_m, causal)`` of the calling block of a backward:
    ``(b, h_kv, n0, m_first, m_tiles, seqlen_q, seqlen_kv, at, q_row0, k_row0, rows0)``.

    The block owns keys ``n0 .. n0 + block_n`` of sequence ``b``, KV head ``h_kv``, and visits the
    ``m_tiles`` query tiles of ``block_m`` rows from ``m_first`` on (``tiles.key_block``'s order and
    range; ``n0 >= seqlen_kv`` for a block past its sequence's keys). Query row ``i`` of the sequence is
    row ``q_row0 + i`` of ``q[at, h]`` (``do``, ``dq`` alike) and row ``rows0 + i`` of ``lse2[at, h]`` and
    ``delta``; key ``j`` row ``k_row0 + j`` of ``k[at, h_kv]`` (``v``, ``dk``, ``dv`` alike). ``sequences``
    is ``(cu_seqlens_q, cu_seqlens_k)``, or ``()`` for a dense layout.
    """
    VARLEN = layout.varlen

    @cuda.jit(device=True, forceinline=True)
    def locate(q, k, sequences, block_n, block_m, causal):
        if VARLEN:
            cu_q, cu_k = sequences
            heads_kv, pairs = k.shape[1], (cu_q.shape[0] - 1) * k.shape[1]
            pair, n0 = key_tile(cuda.gridDim.x // pairs, pairs, block_n, causal)
            b = pair // heads_kv
            q_row0, seqlen_q = sequence_span(cu_q, b, q.shape[2])
            k_row0, seqlen_kv = sequence_span(cu_k, b, k.shape[2])
            m_first, m_tiles = query_tiles(n0, seqlen_q, seqlen_kv, block_m, causal)
            return (b, pair % heads_kv, n0, m_first, m_tiles, seqlen_q, seqlen_kv, 0, q_row0, k_row0,
                    padded_rows(q_row0, b))
        b, h_kv, n0, m_first, m_tiles = key_block(q, k, block_n, block_m, causal)
        return b, h_kv, n0, m_first, m_tiles, q.shape[2], k.shape[2], b, 0, 0, 0

    return locate


def forward_kernel(attend, layout, split=False, tensor_maps=False):
    """The kernel function of a forward's body ``attend(q, k, v, o, lse, scale_log2, alibi, sinks, left, right,
    cap_log2, cap_slope, sequences, parts, maps)``: with a varlen ``layout`` it takes the four arrays of the module
    docstring after the other arguments (``sequences``, else ``()``); with ``split`` (a launch whose blocks split
    the keys) the workspace ``o_part, lse_part, counters`` after ``lse`` (``parts``, else ``()``); with
    ``tensor_maps`` (one run of keys) the tensor maps of its tensor copies last (``maps``, else ``()``)."""
    if split and layout.varlen:
        def kernel(q, k, v, o, lse, o_part, lse_part, counters, scale_log2, alibi, sinks, left, right, cap_log2,
                   cap_slope, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table):
            attend(q, k, v, o, lse, scale_log2, alibi, sinks, left, right, cap_log2, cap_slope,
                   (cu_seqlens_q, cu_seqlens_k, seqused_k, page_table), (o_part, lse_part, counters), ())
    elif split:
        def kernel(q, k, v, o, lse, o_part, lse_part, counters, scale_log2, alibi, sinks, left, right, cap_log2,
                   cap_slope):
            attend(q, k, v, o, lse, scale_log2, alibi, sinks, left, right, cap_log2, cap_slope, (),
                   (o_part, lse_part, counters), ())
    elif layout.varlen and tensor_maps:
        def kernel(q, k, v, o, lse, scale_log2, alibi, sinks, left, right, cap_log2, cap_slope, cu_seqlens_q,
                   cu_seqlens_k, seqused_k, page_table, maps):
            attend(q, k, v, o, lse, scale_log2, alibi, sinks, left, right, cap_log2, cap_slope,
                   (cu_seqlens_q, cu_seqlens_k, seqused_k, page_table), (), maps)
    elif layout.varlen:
        def kernel(q, k, v, o, lse, scale_log2, alibi, sinks, left, right, cap_log2, cap_slope, cu_seqlens_q,
                   cu_seqlens_k, seqused_k, page_table):
            attend(q, k, v, o, lse, scale_log2, alibi, sinks, left, right, cap_log2, cap_slope,
                   (cu_seqlens_q, cu_seqlens_k, seqused_k, page_table), (), ())
    elif tensor_maps:
        def kernel(q, k, v, o, lse, scale_log2, alibi, sinks, left, right, cap_log2, cap_slope, maps):
            attend(q, k, v, o, lse, scale_log2, alibi, sinks, left, right, cap_log2, cap_slope, (), (), maps)
    else:
        def kernel(q, k, v, o, lse, scale_log2, alibi, sinks, left, right, cap_log2, cap_slope):
            attend(q, k, v, o, lse, scale_log2, alibi, sinks, left, right, cap_log2, cap_slope, (), (), ())
    return _named_after(kernel, attend)


def backward_kernel(backward, layout, tensor_maps=False):
    """The kernel function of a tensor-core backward's body ``backward(..., cap_slope, sequences, maps)``: with a
    varlen ``layout`` it takes ``cu_seqlens_q`` and ``cu_seqlens_k`` after the other arguments; with
    ``tensor_maps`` the tensor maps of its tensor copies last (``maps``, else ``()``)."""
    if layout.varlen and tensor_maps:
        def kernel(q, k, v, do, lse2, delta, dq, dk, dv, scale, scale_log2, alibi, sinks, left, right, cap_log2,
                   cap_slope, cu_seqlens_q, cu_seqlens_k, maps):
            backward(q, k, v, do, lse2, delta, dq, dk, dv, scale, scale_log2, alibi, sinks, left, right, cap_log2,
                     cap_slope, (cu_seqlens_q, cu_seqlens_k), maps)
    elif layout.varlen:
        def kernel(q, k, v, do, lse2, delta, dq, dk, dv, scale, scale_log2, alibi, sinks, left, right, cap_log2,
                   cap_slope, cu_seqlens_q, cu_seqlens_k):
            backward(q, k, v, do, lse2, delta, dq, dk, dv, scale, scale_log2, alibi, sinks, left, right, cap_log2,
                     cap_slope, (cu_seqlens_q, cu_seqlens_k), ())
    elif tensor_maps:
        def kernel(q, k, v, do, lse2, delta, dq, dk, dv, scale, scale_log2, alibi, sinks, left, right, cap_log2,
                   cap_slope, maps):
            backward(q, k, v, do, lse2, delta, dq, dk, dv, scale, scale_log2, alibi, sinks, left, right, cap_log2,
                     cap_slope, (), maps)
    else:
        def kernel(q, k, v, do, lse2, delta, dq, dk, dv, scale, scale_log2, alibi, sinks, left, right, cap_log2,
                   cap_slope):
            backward(q, k, v, do, lse2, delta, dq, dk, dv, scale, scale_log2, alibi, sinks, left, right, cap_log2,
                     cap_slope, (), ())
    return _named_after(kernel, backward)


def _named_after(kernel, body):
    """``kernel`` named beside its ``body`` (a device function), in the body's module and factory: the name
    profilers show and the module that tells a kernel family."""
    kernel.__module__ = body.py_func.__module__
    kernel.__qualname__ = body.py_func.__qualname__.rsplit(".", 1)[0] + ".kernel"
    return kernel
