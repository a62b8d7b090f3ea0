"""Checks of a decode call's lengths and page indices on the GPU, without a synchronisation.

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
"""

import functools

from numba import int32

from .._cuda import cuda

LENGTH_BELOW_ZERO, LENGTH_ABOVE_CACHE, LENGTH_ABOVE_PAGES, PAGE_OUT_OF_RANGE = 1, 2, 3, 4
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
