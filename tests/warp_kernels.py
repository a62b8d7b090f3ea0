"""Small one-warp kernels that exercise the tensor-core primitives, on the GPU or in the simulator."""

import functools

from numba import cuda, float32, int32, int64, uint16, uint32

from numattn.kernels.online_softmax import softmax_steps
from numattn.kernels.ptx import (
    SW128_ALIGN,
    aligned_start,
    ballot,
    barrier_arrive,
    barrier_sync,
    broadcast_i32,
    bulk_commit,
    bulk_reduce_add_f32,
    bulk_wait,
    bulk_wait_read,
    copy_16_to_global,
    cp_async_4,
    cp_async_16,
    cp_async_16_at,
    cp_async_commit,
    cp_async_mbarrier_arrive,
    cp_async_wait_group,
    ex2_approx,
    fence_proxy_async,
    fence_registers,
    global_address,
    ld_shared_v2_f32,
    ldmatrix_x4,
    ldmatrix_x4_trans,
    load_l2_f32,
    load_l2_f32x4,
    mbarrier_arrive,
    mbarrier_expect_tx,
    mbarrier_init,
    mbarrier_try_wait,
    mma_m16n8k16_bf16,
    mma_m16n8k16_f16,
    opaque,
    pack_bf16x2,
    pack_f16x2,
    shfl_xor_f32,
    st_global_b32_at,
    st_shared_b32,
    stmatrix_x4,
    stmatrix_x4_trans,
    tma_load_box,
    unpack_bf16x2,
    unpack_f16x2,
    wgmma_commit,
    wgmma_fence,
    wgmma_rs_bf16,
    wgmma_rs_f16,
    wgmma_ss_bf16,
    wgmma_ss_f16,
    wgmma_wait,
)
from numattn.kernels.split_merge import last_to_finish, release_counter
from numattn.kernels.tiles import query_tile, sw128_cell, tile_copier, tile_view

ROW = 24  # shared tile row, in elements: 16 plus 8 of padding (rows stay 16-byte aligned)


def make_mma_kernel(bf16):
    """kernel(a, bt, b, d_from_bt, d_from_b): one warp computes D = A·B (16×16×16) twice.

    ``a`` (16, 16) and ``b`` (16, 16) are 16-bit bit patterns, ``bt`` is B
    transposed (n, k). Both are staged into shared memory with cp.async; B
    fragments come from ``bt`` with plain ldmatrix and from ``b`` with .trans.
    """
    mma = mma_m16n8k16_bf16 if bf16 else mma_m16n8k16_f16

    @cuda.jit
    def kernel(a, bt, b, d_from_bt, d_from_b):
        smem = cuda.shared.array(0, uint16)
        a_s = tile_view(smem, 0, 16, ROW)
        bt_s = tile_view(smem, 16 * ROW, 16, ROW)
        b_s = tile_view(smem, 32 * ROW, 16, ROW)
        lane = cuda.threadIdx.x
        row, half = lane // 2, (lane % 2) * 8  # 32 lanes × 16 bytes = one 16×16 tile
        cp_async_16(a_s, row, half, a, (row, half), 16)
        cp_async_16(bt_s, row, half, bt, (row, half), 16)
        cp_async_16(b_s, row, half, b, (row, half), 16)
        cp_async_commit()
        cp_async_wait_group(0)
        cuda.syncthreads()

        m = lane // 8  # the 8×8 matrix whose row this lane addresses
        a0, a1, a2, a3 = ldmatrix_x4(a_s, lane % 8 + 8 * (m % 2), 8 * (m // 2))
        p0, p1, p2, p3 = ldmatrix_x4(bt_s, lane % 8 + 8 * (m // 2), 8 * (m % 2))
        t0, t1, t2, t3 = ldmatrix_x4_trans(b_s, lane % 8 + 8 * (m % 2), 8 * (m // 2))
        g, t = lane // 4, lane % 4
        zero = float32(0)
        for n_tile in range(2):
            if n_tile == 0:
                x = mma(a0, a1, a2, a3, p0, p1, zero, zero, zero, zero)
                y = mma(a0, a1, a2, a3, t0, t1, zero, zero, zero, zero)
            else:
                x = mma(a0, a1, a2, a3, p2, p3, zero, zero, zero, zero)
                y = mma(a0, a1, a2, a3, t2, t3, zero, zero, zero, zero)
            col = 8 * n_tile + 2 * t
            d_from_bt[g, col], d_from_bt[g, col + 1], d_from_bt[g + 8, col], d_from_bt[g + 8, col + 1] = x
            d_from_b[g, col], d_from_b[g, col + 1], d_from_b[g + 8, col], d_from_b[g + 8, col + 1] = y

    return kernel


@cuda.jit
def transpose_kernel(a, out, copy):
    """``out = aᵀ`` and ``copy = a`` for a 16×16 b16 tile: ldmatrix into the mma fragment layout, stmatrix
    .trans and plain stmatrix back out."""
    smem = cuda.shared.array(0, uint16)
    a_s = tile_view(smem, 0, 16, ROW)
    t_s = tile_view(smem, 16 * ROW, 16, ROW)
    c_s = tile_view(smem, 32 * ROW, 16, ROW)
    lane = cuda.threadIdx.x
    row, half = lane // 2, (lane % 2) * 8
    cp_async_16(a_s, row, half, a, (row, half), 16)
    cp_async_commit()
    cp_async_wait_group(0)
    cuda.syncthreads()
    m = lane // 8
    a0, a1, a2, a3 = ldmatrix_x4(a_s, lane % 8 + 8 * (m % 2), 8 * (m // 2))  # blocks (0,0) (1,0) (0,1) (1,1)
    stmatrix_x4_trans(t_s, lane % 8 + 8 * (m // 2), 8 * (m % 2), a0, a1, a2, a3)  # block (r,c) to (c,r), transposed
    stmatrix_x4(c_s, lane % 8 + 8 * (m % 2), 8 * (m // 2), a0, a1, a2, a3)  # each block back in its place
    cuda.syncthreads()
    if lane < 16:
        for c in range(16):
            out[lane, c] = t_s[lane, c]
            copy[lane, c] = c_s[lane, c]


@cuda.jit
def misc_kernel(x, packed_f16, packed_bf16, unpacked, shuffled, exp2, zero_filled, votes, broadcast):
    """Per lane: packing round trips, a butterfly shuffle, a ballot, lane 0's value broadcast, ex2, and a
    zero-filling cp.async."""
    smem = cuda.shared.array(0, uint16)
    z_s = tile_view(smem, 0, 32, 8)
    lane = cuda.threadIdx.x
    lo, hi = x[lane, 0], x[lane, 1]
    packed_f16[lane] = pack_f16x2(lo, hi)
    packed_bf16[lane] = pack_bf16x2(lo, hi)
    f_lo, f_hi = unpack_f16x2(packed_f16[lane])
    b_lo, b_hi = unpack_bf16x2(packed_bf16[lane])
    unpacked[lane, 0], unpacked[lane, 1], unpacked[lane, 2], unpacked[lane, 3] = f_lo, f_hi, b_lo, b_hi
    shuffled[lane] = shfl_xor_f32(lo, 5)
    votes[lane] = ballot(lo > 0)
    broadcast[lane] = broadcast_i32(int32(7 * lane + 3))
    exp2[lane] = ex2_approx(lo)
    z_s[lane, 0] = 7
    cp_async_16(z_s, lane, 0, x, (0, 0), 0)
    cp_async_commit()
    cp_async_wait_group(0)
    for i in range(8):
        zero_filled[lane, i] = z_s[lane, i]


SHARED_BYTES = 48 * ROW * 2


@cuda.jit
def opaque_kernel(base, out32, out64):
    """``opaque`` of 32- and 64-bit integers inside a loop: ``out32[i, k] = 3i + k``, ``out64[i, k] = base + ik``."""
    i = cuda.threadIdx.x
    for k in range(out32.shape[1]):
        out32[i, k] = opaque(int32(i * 3 + k))
        out64[i, k] = opaque(int64(base[0]) + i * k)


@cuda.jit
def staging_kernel(words, out):
    """Lane l stores ``words[l, i]`` over columns ``8i + 2(l % 4)`` and the next of row ``l // 4`` of
    an 8×16 shared tile (``st_shared_b32``); then rows 1 .. 7 go to ``out[1:, 16:]`` in 16-byte
    chunks (``copy_16_to_global``)."""
    smem = cuda.shared.array(0, uint16)
    tile = tile_view(smem, 0, 8, 16)
    lane = cuda.threadIdx.x
    for i in range(2):
        st_shared_b32(tile, lane // 4, 8 * i + 2 * (lane % 4), words[lane, i])
    cuda.syncthreads()
    if 2 <= lane < 16:
        copy_16_to_global(out, (lane // 2, 16 + 8 * (lane % 2)), tile, lane // 2, 8 * (lane % 2))


@cuda.jit
def shared_pairs_kernel(values, out):
    """``values`` (2 × 64 float32) into a shared tile by plain stores; then lane l reads the pair at row
    ``l % 2``, columns ``2 (l // 2)`` and ``+ 1`` (``ld_shared_v2_f32``) into ``out[l]``, and the pair 32
    columns on into ``out[32 + l]``."""
    tile = cuda.shared.array((2, 64), float32)
    lane = cuda.threadIdx.x
    for c in range(lane, 128, 32):
        tile[c // 64, c % 64] = values[c // 64, c % 64]
    cuda.syncthreads()
    for step in range(2):
        pair = ld_shared_v2_f32(tile, lane % 2, 2 * (lane // 2) + 32 * step)
        out[32 * step + lane, 0] = pair[0]
        out[32 * step + lane, 1] = pair[1]


@cuda.jit
def address_copy_kernel(src, out):
    """Lane l copies from the address of ``rows[l // 4, l % 4, 0]`` (``rows = src[:, ::2, :32]``, strided)
    plus constant byte offsets: its elements 8..15 to ``out[l, 0:8]``, and 16..23 to ``out[l, 8:16]``
    (odd lanes only 16..19, the rest zero-filled); ``cp_async_16_at``."""
    smem = cuda.shared.array(0, uint16)
    tile = tile_view(smem, 0, 32, 16)
    lane = cuda.threadIdx.x
    rows = src[:, ::2, :32]
    row = global_address(rows, (lane // 4, lane % 4, 0))
    cp_async_16_at(tile, lane, 0, row + 16, 16)
    cp_async_16_at(tile, lane, 8, row + 32, 8 if lane % 2 else 16)
    cp_async_commit()
    cp_async_wait_group(0)
    for c in range(16):
        out[lane, c] = tile[lane, c]


@cuda.jit
def async_landing_kernel(src, out):
    """One thread fills a shared row with 0xABCD, copies ``src[0, 0:8]`` and, in a second group,
    ``src[0, 8:16]`` into it with ``cp_async_16_at``, and records the row before any wait (``out[0]``), after
    waiting for all groups but the last (``out[1]``) and after waiting for all (``out[2]``). The simulator
    lands a copy at its thread's wait; on the GPU a copy may land any time before."""
    smem = cuda.shared.array(0, uint16)
    tile = tile_view(smem, 0, 1, 16)
    for c in range(16):
        tile[0, c] = 0xABCD
    row = global_address(src, (0, 0))
    cp_async_16_at(tile, 0, 0, row, 16)
    cp_async_commit()
    cp_async_16_at(tile, 0, 8, row + 16, 16)
    cp_async_commit()
    for c in range(16):
        out[0, c] = tile[0, c]
    cp_async_wait_group(1)
    for c in range(16):
        out[1, c] = tile[0, c]
    cp_async_wait_group(0)
    for c in range(16):
        out[2, c] = tile[0, c]


@cuda.jit
def word_gather_kernel(table, order, out):
    """Lane l copies ``table[order[l], ::3][:, l % 4]`` (a strided view) into a shared int32 ring row
    ``l % 2`` with ``cp_async_4``, then reads it back into ``out[l]``; lanes ≥ 24 copy nothing and
    read the -1 stored before."""
    ring = cuda.shared.array((2, 32), int32)
    lane = cuda.threadIdx.x
    ring[lane % 2, lane] = -1
    view = table[:, ::3]
    if lane < 24:
        cp_async_4(ring, lane % 2, lane, view, (order[lane], lane % 4))
    cp_async_commit()
    cp_async_wait_group(0)
    out[lane] = ring[lane % 2, lane]


@cuda.jit
def address_store_kernel(words, out):
    """Lane l stores its words ``words[l, 0:3]`` from the address of ``out[l // 4, l % 4, 2]`` (``out`` a
    strided view) at byte offsets 0, 4 and 12: elements 2..5 and 8..9 of that row; ``st_global_b32_at``."""
    lane = cuda.threadIdx.x
    row = global_address(out, (lane // 4, lane % 4, 2))
    st_global_b32_at(row, words[lane, 0])
    st_global_b32_at(row + 4, words[lane, 1])
    st_global_b32_at(row + 12, words[lane, 2])

WG_N, WG_D, WG_K = 64, 128, 32  # wgmma test: S = A Bᵀ is 64×64 over 128, O = A[:, :32] · V is 64×64 over 32
WG_TILES, WG_REGS = 8, 32  # n8 accumulator tiles of a 64-wide product, and its registers per thread


def make_wgmma_kernel(bf16):
    """kernel(a, bt, v, s_out, o_out): one warpgroup computes ``a @ bt.T`` and ``a[:, :32] @ v``.

    ``a`` (64, 128), ``bt`` (64, 128) and ``v`` (32, 64) are 16-bit bit patterns,
    staged with cp.async into 128-byte swizzled tiles, an mbarrier signalling
    that they landed. ``s_out`` comes from wgmma with both operands in shared
    memory (B K-major), ``o_out`` from wgmma with A fragments in registers
    (read from ``a``) and B MN-major, over two accumulating k-steps.
    """
    wgmma_ss = wgmma_ss_bf16 if bf16 else wgmma_ss_f16
    wgmma_rs = wgmma_rs_bf16 if bf16 else wgmma_rs_f16
    A_ROW0, B_ROW0, V_ROW0 = 0, 2 * 64, 4 * 64  # tiles in 128-byte rows: A, Bᵀ (two panels each), V
    ROWS = V_ROW0 + WG_K

    @cuda.jit
    def kernel(a, bt, v, s_out, o_out):
        smem = cuda.shared.array(0, uint16)
        bars = cuda.shared.array(1, int64)
        start = aligned_start(smem, SW128_ALIGN)
        view = tile_view(smem, start, ROWS, 64)
        tid = cuda.threadIdx.x
        if tid == 0:
            mbarrier_init(bars, 0, 128)
        cuda.syncthreads()
        for i in range(tid, 64 * 16, 128):  # 16 chunks of 8 per row of a and bt
            r, c = i // 16, (i % 16) * 8
            row, col = sw128_cell(A_ROW0, 64, r, c)
            cp_async_16(view, row, col, a, (r, c), 16)
            row, col = sw128_cell(B_ROW0, 64, r, c)
            cp_async_16(view, row, col, bt, (r, c), 16)
        for i in range(tid, WG_K * 8, 128):  # 8 chunks per row of v
            r, c = i // 8, (i % 8) * 8
            row, col = sw128_cell(V_ROW0, WG_K, r, c)
            cp_async_16(view, row, col, v, (r, c), 16)
        cp_async_mbarrier_arrive(bars, 0)
        while not mbarrier_try_wait(bars, 0, 0):
            pass
        fence_proxy_async()

        warp, lane = tid // 32, tid % 32
        g, t = lane // 4, lane % 4
        s = cuda.local.array((WG_TILES, 4), float32)
        o = cuda.local.array((WG_TILES, 4), float32)
        wgmma_fence()
        for ks in range(WG_D // 16):
            panel, col = ks // 4, 16 * (ks % 4)
            a_offset = start + 64 * (A_ROW0 + 64 * panel) + col
            b_offset = start + 64 * (B_ROW0 + 64 * panel) + col
            wgmma_ss(s, WG_N, smem, a_offset, b_offset, 0, False, ks > 0)
        r = 16 * warp + g
        for ks in range(WG_K // 16):  # A fragment of k-step ks straight from global memory
            k0 = 16 * ks + 2 * t
            a0 = uint32(a[r, k0]) | uint32(a[r, k0 + 1]) << uint32(16)
            a1 = uint32(a[r + 8, k0]) | uint32(a[r + 8, k0 + 1]) << uint32(16)
            a2 = uint32(a[r, k0 + 8]) | uint32(a[r, k0 + 9]) << uint32(16)
            a3 = uint32(a[r + 8, k0 + 8]) | uint32(a[r + 8, k0 + 9]) << uint32(16)
            wgmma_rs(o, WG_N, a0, a1, a2, a3, smem, start + 64 * (V_ROW0 + 16 * ks), 64 * WG_K, True, ks > 0)
        wgmma_commit()
        wgmma_wait(0)
        fence_registers(s, WG_REGS)
        fence_registers(o, WG_REGS)
        for j in range(WG_TILES):
            for e in range(4):
                s_out[r + 8 * (e // 2), 8 * j + 2 * t + e % 2] = s[j, e]
                o_out[r + 8 * (e // 2), 8 * j + 2 * t + e % 2] = o[j, e]

    return kernel


WGMMA_SHARED_BYTES = 2 * 64 * (4 * 64 + WG_K) + SW128_ALIGN


TMA_ROWS, TMA_COLS = 64, 128  # the tile of tma_tile_kernel: two 64-column panels
TMA_TILE_ROWS = TMA_ROWS * TMA_COLS // 64  # its 128-byte rows in shared memory
TMA_VIEW_ROWS = 2 * TMA_TILE_ROWS  # the tile copied twice
TMA_SHARED_BYTES = TMA_VIEW_ROWS * 128 + SW128_ALIGN
_copy_tma_tile = tile_copier(128, sw128_cell)


@cuda.jit
def tma_tile_kernel(maps, src, out, b, h, row0):
    """One block of 128 threads: thread 0 copies the tile of rows ``row0 ..`` of ``src[b, h]`` by tensor copies
    (the map ``maps[0]``, boxes of ``TMA_ROWS`` rows) into the first ``TMA_TILE_ROWS`` rows of shared memory,
    every thread the same tile by ``cp.async`` (``tiles.tile_copier``) into the next; ``out`` receives both
    as they lie."""
    smem = cuda.shared.array(0, uint16)
    bars = cuda.shared.array(2, int64)
    view = tile_view(smem, aligned_start(smem, SW128_ALIGN), TMA_VIEW_ROWS, 64)
    tid = cuda.threadIdx.x
    if tid == 0:
        mbarrier_init(bars, 0, 1)  # the tensor copies: one arrival and their bytes
        mbarrier_init(bars, 1, 128)  # the cp.async copies
    cuda.syncthreads()
    if tid == 0:
        mbarrier_expect_tx(bars, 0, TMA_ROWS * TMA_COLS * 2)
        for panel in range(TMA_COLS // 64):
            tma_load_box(view, panel * TMA_ROWS, maps, 0, b, h, row0, 64 * panel, bars, 0)
        mbarrier_arrive(bars, 0)
    _copy_tma_tile(view, TMA_TILE_ROWS, int64(TMA_ROWS), src, b, h, row0, src.shape[2], TMA_COLS)
    cp_async_mbarrier_arrive(bars, 1)
    while not mbarrier_try_wait(bars, 0, 0):
        pass
    while not mbarrier_try_wait(bars, 1, 0):
        pass
    for i in range(tid, TMA_VIEW_ROWS * 64, 128):
        out[i // 64, i % 64] = view[i // 64, i % 64]


@cuda.jit
def turns_kernel(order):
    """Two warps take strict turns through named barriers 1 and 2; ``order`` records whose turn each was."""
    position = cuda.shared.array(1, int32)
    warp, lane = cuda.threadIdx.x // 32, cuda.threadIdx.x % 32
    if cuda.threadIdx.x == 0:
        position[0] = 0
    cuda.syncthreads()
    if warp == 1:
        barrier_arrive(1, 64)  # warp 0 goes first
    for _ in range(4):
        barrier_sync(1 + warp, 64)
        if lane == 0:
            order[position[0]] = warp
            position[0] += 1
        barrier_arrive(1 + (1 - warp), 64)


@cuda.jit
def bulk_reduce_kernel(src, dst):
    """Each of 32 threads stages src[i, :] (float32) in a padded shared row, then adds the row to dst[i, :]
    with one bulk reduction; twice, the second after the first has read the staged rows."""
    staged = cuda.shared.array(640, float32)  # 32 rows of 16 floats, padded to 80 bytes
    i = cuda.threadIdx.x
    for rep in range(2):
        if rep:
            bulk_wait_read(0)
        for c in range(16):
            staged[20 * i + c] = src[i, c] * (rep + 1)
        fence_proxy_async()
        cuda.syncthreads()
        bulk_reduce_add_f32(dst, (i, 0), staged, 20 * i, 64)
        bulk_commit()
        cuda.syncthreads()
    bulk_wait(0)


@cuda.jit
def last_block_sum_kernel(values, counters, totals, launch):
    """Block ``i`` writes ``values[i, :]``; the last block to finish sums every block's row (read through
    L2) into ``totals[launch, 0]`` with 4-byte loads and into ``totals[launch, 1]`` with 16-byte ones.
    Launched several times on the same counters."""
    i, tid = cuda.blockIdx.x, cuda.threadIdx.x
    values[i, tid] = float32(i + 1) * float32(tid + 1) + float32(launch)
    if last_to_finish(counters, 0, 0, cuda.gridDim.x):
        if tid == 0:
            total, total4 = float32(0.0), float32(0.0)
            for j in range(cuda.gridDim.x):
                for t in range(cuda.blockDim.x):
                    total += load_l2_f32(values, (j, t))
                for t in range(0, cuda.blockDim.x, 4):
                    a, b, c, d = load_l2_f32x4(values, (j, t))
                    total4 += (a + b) + (c + d)
            totals[launch, 0] = total
            totals[launch, 1] = total4
        release_counter(counters, 0, 0)


@cuda.jit
def grid_order_kernel(places, heads, group_size, head_bytes):
    """Block ``i`` of ``blocks`` writes its place in a forward grid, ``query_tile(heads, group_size, head_bytes, i,
    blocks)``, into ``places[i]``."""
    places[cuda.blockIdx.x, 0], places[cuda.blockIdx.x, 1] = query_tile(heads, group_size, head_bytes, cuda.blockIdx.x,
                                                                          cuda.gridDim.x)


@functools.lru_cache(maxsize=None)
def softmax_update_kernel(headroom):
    """``kernel(scores, p, m, factor)``: two 16 × 16 key tiles of scores (log2 domain once times ``factor``)
    through the online softmax's ``update`` with this rescale ``headroom``, as one warp's accumulator
    fragments: ``p[tile]`` each tile's P, ``m[row]`` each row's reference max at the end."""
    init, _, update, _, _, _ = softmax_steps(1, 2, 2, False, "bfloat16", headroom)

    @cuda.jit
    def kernel(scores, p, m, factor):
        lane = cuda.threadIdx.x
        g, t = lane // 4, lane % 4
        m_i = cuda.local.array(2, float32)
        l_i = cuda.local.array(2, float32)
        row_max = cuda.local.array(2, float32)
        alpha = cuda.local.array(2, float32)
        acc = cuda.local.array((1, 2, 4), float32)
        s = cuda.local.array((1, 2, 4), float32)
        init(m_i, l_i, acc)
        for tile in range(2):
            for nt in range(2):
                for e in range(4):
                    s[0, nt, e] = scores[tile, g + 8 * (e // 2), 8 * nt + 2 * t + e % 2]
            update(s, m_i, l_i, row_max, alpha, factor)
            for nt in range(2):
                for e in range(4):
                    p[tile, g + 8 * (e // 2), 8 * nt + 2 * t + e % 2] = s[0, nt, e]
        if t == 0:
            m[g], m[g + 8] = m_i[0], m_i[1]

    return kernel
