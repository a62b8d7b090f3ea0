"""Checks of a call's lengths, offsets and page indices on the GPU, without a synchronisation.

The decode kernels clamp lengths into the cache's capacity and page indices into
the page array, so bad values never read outside the caches; this kernel reports
them. It runs on the call's stream before the decode kernel. The first thread to
find a bad value claims a device-side flag (``claim``, one atomic compare-and-swap,
after which no other thread reports) and writes what it found to ``record``, an
array in pinned host memory that the host reads at a later call, without waiting
for the GPU:

``record = [kind, b, j, value, limit]``: kind 0 when nothing was found; ``LENGTH_BELOW_ZERO``,
``LENGTH_ABOVE_CACHE`` (a contiguous cache of ``limit`` keys) or ``LENGTH_ABOVE_PAGES`` (a page
table of ``limit`` keys) for ``seqlens[b] = value``; ``PAGE_OUT_OF_RANGE`` for ``page_table[b, j] =
value`` with ``limit`` pages. The kind is written last, after a system-wide fence.

A varlen call (``varlen_check_kernel``) records, with ``j`` 0 for ``cu_seqlens_q`` and 1 for
``cu_seqlens_k``: ``OFFSET_NOT_ZERO`` (``cu[0] = value``), ``OFFSETS_DECREASE`` (``cu[b + 1] = value <
cu[b] = limit``), ``OFFSETS_PAST_ROWS`` (the last offset ``cu[b] = value`` beyond ``limit`` rows, or for queries other than ``limit``), ``LONGER_THAN_MAX``
(sequence ``b`` has ``value`` queries, ``limit`` = max_seqlen_q; with ``j`` 1 ``value`` keys, ``limit`` =
max_seqlen_k), ``USED_OUT_OF_RANGE``
(``seqused_k[b] = value`` outside ``[0, limit]``; ``j`` 1 when the keys are paged), ``KEYS_ABOVE_PAGES`` (sequence ``b`` has ``value``
keys, its page-table row ``limit``) and ``PAGE_OUT_OF_RANGE``.
"""

import functools

from numba import int32

from .._cuda import cuda

LENGTH_BELOW_ZERO, LENGTH_ABOVE_CACHE, LENGTH_ABOVE_PAGES, PAGE_OUT_OF_RANGE = 1, 2, 3, 4
OFFSET_NOT_ZERO, OFFSETS_DECREASE, OFFSETS_PAST_ROWS, LONGER_THAN_MAX, USED_OUT_OF_RANGE, KEYS_ABOVE_PAGES = range(5, 11)
RECORD_WORDS = 5
THREADS = 128


def grid(batch, max_pages):
    """``(blocks along the page table's columns, batch)``: one thread per page-table entry (one block
    per sequence without a table)."""
    return -(-max_pages // THREADS), batch


@cuda.jit(device=True)
def _report(claim, record, kind, b, j, value, limit):
    if cuda.atomic.cas(claim, 0, 0, 1) == 0:
        record[1], record[2], record[3], record[4] = b, j, value, int32(min(limit, 2**31 - 1))
        cuda.threadfence_system()
        record[0] = kind


@functools.lru_cache(maxsize=None)
def index_check_kernel(paged):
    """``kernel(page_table, seqlens, capacity, page_size, num_pages, claim, record)`` on ``grid(batch,
    max_pages)`` blocks of ``THREADS`` threads: reports a ``seqlens[b]`` outside ``[0, capacity]`` and,
    when ``paged``, a ``page_table[b, j]`` that sequence ``b`` uses (``j · page_size < seqlens[b]``)
    outside ``[0, num_pages)``. ``claim``: int32 ``[1]`` in device memory, 0 until a report;
    ``record``: int32 ``[RECORD_WORDS]`` in pinned host memory (see the module docstring)."""
    ABOVE = LENGTH_ABOVE_PAGES if paged else LENGTH_ABOVE_CACHE

    @cuda.jit
    def check(page_table, seqlens, capacity, page_size, num_pages, claim, record):
        b = cuda.blockIdx.y
        j = cuda.blockIdx.x * THREADS + cuda.threadIdx.x
        length = seqlens[b]
        if j == 0 and length < 0:
            _report(claim, record, LENGTH_BELOW_ZERO, b, 0, length, capacity)
        if j == 0 and length > capacity:
            _report(claim, record, ABOVE, b, 0, length, capacity)
        if paged and j < page_table.shape[1] and j * page_size < length:
            page = page_table[b, j]
            if page < 0 or page >= num_pages:
                _report(claim, record, PAGE_OUT_OF_RANGE, b, j, page, num_pages)

    return check


@cuda.jit(device=True)
def _check_offsets(claim, record, cu, which, b, rows, batch):
    """Report a bad entry of cumulative offsets ``cu`` (``which``: 0 for queries, 1 for keys) that sequence ``b``
    reads: a first offset other than 0, a decrease, a last offset past ``rows`` (< 0: no bound; the query
    offsets must end at ``rows``)."""
    if b == 0 and cu[0] != 0:
        _report(claim, record, OFFSET_NOT_ZERO, 0, which, cu[0], 0)
    if cu[b + 1] < cu[b]:
        _report(claim, record, OFFSETS_DECREASE, b, which, cu[b + 1], cu[b])
    if rows >= 0 and b == batch - 1 and (cu[batch] > rows or which == 0 and cu[batch] != rows):
        _report(claim, record, OFFSETS_PAST_ROWS, batch, which, cu[batch], rows)


@functools.lru_cache(maxsize=None)
def varlen_check_kernel(has_cu_k, seqused, paged):
    """``kernel(cu_seqlens_q, cu_seqlens_k, seqused_k, page_table, total_q, total_k, max_seqlen_q, max_seqlen_k,
    page_size, num_pages, claim, record)`` on ``grid(batch, max_pages)`` blocks of ``THREADS`` threads: reports what the
    host check of a varlen call would (see the module docstring); ``has_cu_k``, ``seqused`` and ``paged`` say
    which of the arrays the call has (an absent one is not read)."""
    HAS_CU_K, SEQUSED, PAGED = has_cu_k, seqused, paged

    @cuda.jit
    def check(cu_q, cu_k, seqused_k, page_table, total_q, total_k, max_seqlen_q, max_seqlen_k, page_size, num_pages,
              claim, record):
        b = cuda.blockIdx.y
        j = cuda.blockIdx.x * THREADS + cuda.threadIdx.x
        batch = cu_q.shape[0] - 1
        capacity = page_table.shape[1] * page_size
        keys = 0
        if HAS_CU_K:
            keys = cu_k[b + 1] - cu_k[b]
        if SEQUSED:
            limit = capacity if PAGED else keys
            if j == 0 and not 0 <= seqused_k[b] <= limit:
                _report(claim, record, USED_OUT_OF_RANGE, b, 1 if PAGED else 0, seqused_k[b], limit)
            keys = seqused_k[b]
        if j == 0:
            _check_offsets(claim, record, cu_q, 0, b, total_q, batch)
            if cu_q[b + 1] - cu_q[b] > max_seqlen_q:
                _report(claim, record, LONGER_THAN_MAX, b, 0, cu_q[b + 1] - cu_q[b], max_seqlen_q)
            if HAS_CU_K:
                _check_offsets(claim, record, cu_k, 1, b, -1 if PAGED else total_k, batch)
            if keys > max_seqlen_k:  # the backward's grid covers max_seqlen_k keys per sequence
                _report(claim, record, LONGER_THAN_MAX, b, 1, keys, max_seqlen_k)
            if PAGED and keys > capacity:
                _report(claim, record, KEYS_ABOVE_PAGES, b, 0, keys, capacity)
        if PAGED and j < page_table.shape[1] and j * page_size < keys:
            page = page_table[b, j]
            if page < 0 or page >= num_pages:
                _report(claim, record, PAGE_OUT_OF_RANGE, b, j, page, num_pages)

    return check
