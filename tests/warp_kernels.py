"""Small one-warp kernels that exercise the tensor-core primitives, on the GPU or in the simulator."""

from numba import cuda, float32, uint16

from numattn.kernels.ptx import (
    ballot,
    cp_async_16,
    cp_async_commit,
    cp_async_wait_group,
    ex2_approx,
    ldmatrix_x4,
    ldmatrix_x4_trans,
    mma_m16n8k16_bf16,
    mma_m16n8k16_f16,
    pack_bf16x2,
    pack_f16x2,
    shfl_xor_f32,
    unpack_bf16x2,
    unpack_f16x2,
)
from numattn.kernels.tiles import tile_view

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
def misc_kernel(x, packed_f16, packed_bf16, unpacked, shuffled, exp2, zero_filled, votes):
    """Per lane: packing round trips, a butterfly shuffle, a ballot, ex2, and a zero-filling cp.async."""
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
    exp2[lane] = ex2_approx(lo)
    z_s[lane, 0] = 7
    cp_async_16(z_s, lane, 0, x, (0, 0), 0)
    cp_async_commit()
    cp_async_wait_group(0)
    for i in range(8):
        zero_filled[lane, i] = z_s[lane, i]


SHARED_BYTES = 48 * ROW * 2
