"""Tile primitives shared by numattn kernels, each with its simulator twin.

* ``tile_view`` carves a 2-D tile with compile-time shape out of the dynamic
  shared-memory buffer, so kernels index ``k_s[n, d]`` rather than offsets.
* ``tile_copier`` builds the loop in which a block's threads copy a tile of
  rows from global to shared memory with 16-byte ``cp.async`` copies;
  ``row_major_cell`` and ``sw128_cell`` say where each element lands;
  ``transposed_key_copier`` copies a K tile from K stored transposed.
* ``sw128_cell`` places an element of a tile stored in wgmma's 128-byte
  swizzled layout (see ``ptx/wgmma.py``) in a 64-column view of shared memory.
* ``swizzled_rows``, ``tile_row_elems`` and ``tile_col`` lay out 16-bit tiles that
  ``cp.async`` fills and ``ldmatrix`` reads: unpadded rows with 16-byte chunks
  XOR-swizzled by row where the row allows it, padded rows elsewhere.
* ``key_block`` maps a backward block to its (batch, key/value head, key rows, query tiles)
  (``sequences.py`` maps a forward block to its query rows).
* ``WIDEN`` / ``NARROW`` map an element dtype name to the conversion a kernel
  applies when it loads an element into fp32 or stores an fp32 result.
"""

import functools

import numpy as np
from llvmlite import ir
from numba import int64, types, uint32
from numba.cuda.extending import intrinsic, overload
from numba.cuda.np.arrayobj import make_array, populate_array

from .._cuda import cuda
from .ptx import cp_async_16, cp_async_16_at, cvt_f32_bf16, cvt_f32_f16, cvt_rn_bf16_f32, cvt_rn_f16_f32, global_address

# Conversions by element type; 16-bit floats travel through kernels as uint16 bit patterns.
WIDEN = {"float16": cvt_f32_f16, "bfloat16": cvt_f32_bf16, "float32": np.float32}
NARROW = {"float16": cvt_rn_f16_f32, "bfloat16": cvt_rn_bf16_f32, "float32": np.float32}


def tile_view(buf, offset, rows, cols):
    """``tile_view(buf, offset, ROWS, COLS)``: C-ordered ``(ROWS, COLS)`` view of ``buf[offset:]``.

    ``buf`` is a 1-D array (the dynamic shared-memory buffer), ``offset`` counts
    elements, ``ROWS`` and ``COLS`` are compile-time constants, so every index
    into the tile folds into an immediate address offset. No copy.
    """
    return buf[offset : offset + rows * cols].reshape(rows, cols)


@intrinsic
def _tile_view(typingctx, buf, offset, rows, cols):
    if not (isinstance(rows, types.IntegerLiteral) and isinstance(cols, types.IntegerLiteral)):
        return None
    nrows, ncols = rows.literal_value, cols.literal_value
    tile_type = types.Array(buf.dtype, 2, "C")

    def codegen(context, builder, sig, args):
        source = make_array(sig.args[0])(context, builder, args[0])
        start = context.cast(builder, args[1], sig.args[1], types.intp)
        intp = context.get_value_type(types.intp)
        itemsize = context.get_abi_sizeof(context.get_data_type(buf.dtype))
        tile = make_array(tile_type)(context, builder)
        populate_array(
            tile,
            data=builder.gep(source.data, [start]),
            shape=[ir.Constant(intp, nrows), ir.Constant(intp, ncols)],
            strides=[ir.Constant(intp, ncols * itemsize), ir.Constant(intp, itemsize)],
            itemsize=ir.Constant(intp, itemsize),
            meminfo=None,
        )
        return tile._getvalue()

    return tile_type(buf, offset, rows, cols), codegen


@overload(tile_view, target="cuda", prefer_literal=True, inline="always")
def _tile_view_gpu(buf, offset, rows, cols):
    if not (isinstance(rows, types.IntegerLiteral) and isinstance(cols, types.IntegerLiteral)):
        return None  # ROWS and COLS must be compile-time constants
    ROWS, COLS = rows.literal_value, cols.literal_value  # re-enter the intrinsic as literals

    def impl(buf, offset, rows, cols):
        return _tile_view(buf, offset, ROWS, COLS)

    return impl


@cuda.jit(device=True, forceinline=True)
def row_major_cell(tile_row0, rows, r, c):
    """``(row, col)`` of element ``(r, c)`` of a row-major tile that starts at row ``tile_row0`` of a view."""
    return tile_row0 + r, c


@cuda.jit(device=True, forceinline=True)
def row_of_batch(at, row):
    """``(index along axis 0, row)`` of ``row`` of a dense or packed array: ``at`` is the batch index."""
    return at, row


def tile_copier(num_threads, place, source=row_of_batch, stepping=False, first_thread=0):
    """Device function ``copy(view, tile_row0, rows, src, at, h, row0, nrows, ncols)`` for ``num_threads`` copying
    threads, from thread ``first_thread`` of the block on.

    The block's threads issue 16-byte ``cp.async`` copies of row ``row0 + r``
    of ``src`` (``src[a, h, row, :ncols]`` for ``(a, row) = source(at, row0 + r)``: ``src[at, h, row0 + r]``
    by default, a page's row for ``sequences.source_row``) into tile row ``r`` (rows past ``nrows``
    read 0), element ``(r, c)`` landing at ``view[place(tile_row0, rows, r, c)]``.
    Thread ``i`` copies chunk ``i % chunks`` of rows ``i // chunks + n · step``
    when ``chunks`` divides the thread count (the trip count and the per-copy
    arithmetic are then compile-time constants), chunk by chunk otherwise.
    ``stepping``: a tile of whole passes that lies within ``nrows`` rows of a batch (``source`` the default)
    takes one address computation and steps by the row stride from copy to copy (fewer instructions per
    copy, a few more registers).
    """
    return _tile_copier(num_threads, place, source, stepping, first_thread)


@functools.cache  # keyed on every argument, positional: a keyword or default would key the same copier apart
def _tile_copier(num_threads, place, source, stepping, first_thread):
    """``tile_copier``'s device function, one per set of arguments: each is typed and lowered apart."""
    NUM_THREADS, FIRST_THREAD = num_threads, first_thread
    AFFINE = stepping and source is row_of_batch  # row r of the tile sits r row strides after row 0

    @cuda.jit(device=True, forceinline=True)
    def copy(view, tile_row0, rows, src, at, h, row0, nrows, ncols):
        chunks = ncols // 8
        thread = cuda.threadIdx.x - FIRST_THREAD
        if NUM_THREADS % chunks == 0:
            step = NUM_THREADS // chunks
            first, c = thread // chunks, (thread % chunks) * 8
            if AFFINE and rows % step == 0 and row0 + rows <= nrows:
                address = global_address(src, (at, h, row0 + first, c))
                pass_bytes = src.strides[2] * step
                for n in range(rows // step):
                    view_row, view_col = place(tile_row0, rows, first + n * step, c)
                    cp_async_16_at(view, view_row, view_col, address + n * pass_bytes, 16)
                return
            for n in range((rows + step - 1) // step):
                r = first + n * step
                if rows % step == 0 or r < rows:  # first < step: r < rows unless the last pass is partial
                    view_row, view_col = place(tile_row0, rows, r, c)
                    valid = row0 + r < nrows
                    a, row = source(at, row0 + r if valid else 0)
                    cp_async_16(view, view_row, view_col, src, (a, h, row, c), 16 if valid else 0)
        else:
            for i in range(thread, rows * chunks, NUM_THREADS):
                r = i // chunks
                c = (i - r * chunks) * 8
                view_row, view_col = place(tile_row0, rows, r, c)
                valid = row0 + r < nrows
                a, row = source(at, row0 + r if valid else 0)
                cp_async_16(view, view_row, view_col, src, (a, h, row, c), 16 if valid else 0)

    return copy


@functools.cache
def transposed_key_copier(num_threads, place, head_dim, keys, first_thread=0):
    """Device function ``copy(view, tile_row0, k, at, h, n0, nkeys)`` for ``num_threads`` copying threads,
    from thread ``first_thread`` of the block on: the K tile of keys ``n0 .. n0 + keys`` from ``k`` stored
    transposed (``k[at, h, d, n]``, keys contiguous), head-dim row ``d`` (of ``head_dim``) into tile row
    ``d``, 8 keys per 16-byte ``cp.async`` copy; keys from ``nkeys`` on read 0. Element ``(d, c)`` lands at
    ``view[place(tile_row0, head_dim, d, c)]``."""
    NUM_THREADS, FIRST_THREAD, D, CHUNKS = num_threads, first_thread, head_dim, keys // 8

    @cuda.jit(device=True, forceinline=True)
    def copy(view, tile_row0, k, at, h, n0, nkeys):
        for i in range(cuda.threadIdx.x - FIRST_THREAD, D * CHUNKS, NUM_THREADS):
            d, c = i // CHUNKS, (i % CHUNKS) * 8
            valid = min(max(nkeys - n0 - c, 0), 8)
            view_row, view_col = place(tile_row0, D, d, c)
            cp_async_16(view, view_row, view_col, k, (at, h, d, n0 + c if valid > 0 else 0), 2 * valid)

    return copy


@cuda.jit(device=True, forceinline=True)
def sw128_cell(tile_row0, rows, r, c):
    """``(row, col)`` of element ``(r, c)`` (``c`` a multiple of 8) of a swizzled tile in a 64-column view.

    The tile has ``rows`` rows and starts at row ``tile_row0`` of the view; its
    64-column panels follow one another, and within a panel the 16-byte chunk
    ``c // 8 % 8`` of row ``r`` sits at chunk position ``(c // 8 % 8) ^ (r % 8)``.
    """
    return tile_row0 + (c // 64) * rows + r, (((c % 64) // 8) ^ (r % 8)) * 8


PAD = 8  # elements added to a padded row of a 16-bit tile (16-byte aligned rows, conflict-free ldmatrix)


def swizzled_rows(cols):
    """Whether shared-memory tile rows of ``cols`` 16-bit elements are stored swizzled rather than padded.

    Rows whose 16-byte chunks come in groups of eight are stored unpadded, chunk ``c``
    of row ``r`` at chunk position ``c ^ (r % 8)``: every 128-byte line of a global row
    then lands in one 128-byte line of shared memory (``cp.async`` moves it without
    splitting it; padded rows made 1.5 times the ideal L2 sector reads) and ``ldmatrix``
    reads eight rows from eight different bank groups. Other rows get ``PAD`` elements.
    """
    return cols % 64 == 0


def tile_row_elems(cols):
    """Elements per shared-memory row of a tile with ``cols`` columns (see ``swizzled_rows``)."""
    return cols if swizzled_rows(cols) else cols + PAD


@cuda.jit(device=True, forceinline=True)
def tile_col(swizzled, r, c):
    """Shared-memory column of element ``c`` (a multiple of 8) of row ``r`` of a tile (see ``swizzled_rows``)."""
    return ((c // 8) ^ (r % 8)) * 8 if swizzled else c


HEAD_GROUP = 8  # (batch, KV head) pairs whose causal backward key blocks the grid interleaves
L2_SECTION_BYTES = 32 * 1024 * 1024  # keys and values of a section of heads (an H100's or H200's L2 holds 50 MB)


@cuda.jit(device=True, forceinline=True)
def query_tile(heads, group_size, kv_head_bytes, block, blocks):
    """``(tiles_from_end, head)`` of block ``block`` of a forward grid of ``blocks = tiles · heads`` blocks in
    sections: ``heads`` (batch × query heads, ``group_size`` consecutive ones reading each KV head of
    ``kv_head_bytes`` keys and values) taken a section at a time, as many whole groups as fit in
    ``L2_SECTION_BYTES``, and within a section tile by tile from each head's last (under causal masking the
    longest first), head by head: the blocks running at once read the keys of a few heads."""
    block, all_heads = uint32(block), uint32(heads)  # 32-bit: grid indices
    size = uint32(min(heads, max(1, L2_SECTION_BYTES // max(kv_head_bytes, 1)) * group_size))
    span = size * (uint32(blocks) // all_heads)  # the blocks of a whole section
    first = block // span * size  # the section's first head
    heads_here = min(size, all_heads - first)  # the last section may be smaller
    within = block % span
    return int64(within // heads_here), int64(first + within % heads_here)


@cuda.jit(device=True)
def key_block(q, k, block_n, block_m, causal):
    """``(b, h_kv, n0, m_first, m_tiles)`` of the calling thread block of an attention backward.

    The grid has ``cdiv(seqlen_kv, block_n) · batch · heads_kv`` blocks; this one
    owns keys ``n0 .. n0 + block_n`` of batch ``b``, key/value head ``h_kv``, and
    must visit the ``m_tiles`` query tiles of ``block_m`` rows from row
    ``m_first`` on (``query_tiles``). The blocks are ordered as ``key_tile`` says.
    """
    heads_kv, seqlen_q, seqlen_kv = k.shape[1], q.shape[2], k.shape[2]
    pair, n0 = key_tile((seqlen_kv + block_n - 1) // block_n, k.shape[0] * heads_kv, block_n, causal)
    m_first, m_tiles = query_tiles(n0, seqlen_q, seqlen_kv, block_m, causal)
    return pair // heads_kv, pair % heads_kv, n0, m_first, m_tiles


@cuda.jit(device=True, forceinline=True)
def key_tile(key_blocks, pairs, block_n, causal):
    """``(pair, n0)``: the (batch, key/value head) pair and first key of the calling block of a backward grid of
    ``key_blocks · pairs`` blocks. A head's key blocks run together (the dQ rows they add to stay in L2).
    Under causal masking, where the first key blocks are the longest, the grid walks ``HEAD_GROUP`` pairs
    at a time, key block by key block, so that the lightest blocks of a group run last."""
    size = HEAD_GROUP if causal else 1
    group = cuda.blockIdx.x // (size * key_blocks)
    within = cuda.blockIdx.x - group * size * key_blocks
    group_pairs = min(size, pairs - group * size)  # the last group may be smaller
    return group * size + within % group_pairs, (within // group_pairs) * block_n


@cuda.jit(device=True, forceinline=True)
def query_tiles(n0, seqlen_q, seqlen_kv, block_m, causal):
    """``(m_first, m_tiles)``: the query tiles of ``block_m`` rows a backward block of keys from ``n0`` visits
    (under causal masking from the first that holds a row seeing key ``n0``)."""
    m_first = max(0, n0 - (seqlen_kv - seqlen_q)) // block_m * block_m if causal else 0
    return m_first, max(0, (seqlen_q - m_first + block_m - 1) // block_m)


@cuda.jit(device=True, forceinline=True)
def ring_next(slot, parity, slots):
    """The next tile's buffer in a ring of ``slots`` buffers and the parity of its use (the use's count in that
    buffer modulo 2, as mbarrier phases go), from this tile's."""
    return (0, parity ^ 1) if slot + 1 == slots else (slot + 1, parity)


@cuda.jit(device=True, forceinline=True)
def ring_after(slot, parity, steps, slots):
    """``ring_next`` taken ``steps`` times: the buffer and parity of the tile ``steps`` tiles after this one."""
    return (slot + steps) % slots, parity ^ ((slot + steps) // slots % 2)
