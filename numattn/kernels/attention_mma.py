"""Fused attention forward on tensor cores: FlashAttention-2's schedule with ``mma.sync`` m16n8k16.

A block of ``num_warps`` warps owns ``16 · num_warps`` query rows of one
(batch, query head); warp ``w`` owns rows ``16w .. 16w + 16``. The Q tile is
copied to shared memory once and its A fragments stay in registers. K/V tiles
of ``BLOCK_N`` keys are double-buffered in shared memory: ``cp.async`` fills
the next stage while the tensor cores work on the current one. Per key tile a
warp computes ``S = Q Kᵀ`` (B fragments by ``ldmatrix``), scales it into the
log2 domain, masks it where the tile crosses the sequence end or the causal
diagonal, updates its online softmax in registers (row max and sum shared by the
four lanes of a group through shuffles), turns ``P`` into A fragments without
leaving registers (an accumulator fragment pair is an A fragment) and adds
``P V`` (B fragments by ``ldmatrix.trans``).

Fragment layouts (``kernels/ptx.py``): lane ``l`` has ``g = l // 4`` and
``t = l % 4``; an accumulator tile ``c[0..3]`` holds rows ``g`` (``c[0]``,
``c[1]``) and ``g + 8`` (``c[2]``, ``c[3]``), columns ``2t`` and ``2t + 1``.
So each lane carries two query rows, and the row statistics ``m_i``, ``l_i``
have two entries.

Shared-memory rows are padded by 8 elements (16 bytes): rows stay 16-byte
aligned for ``cp.async`` and the eight rows an ``ldmatrix`` reads fall in
distinct banks. Inputs must have a contiguous head dimension, 16-byte aligned
rows, and head dims that are multiples of 16.
"""

import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import float32, uint16, uint32

from .._cuda import cuda
from .ptx import (
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
)
from .tiles import NARROW, query_block, tile_view

_LN2 = np.float32(math.log(2.0))
_NEG_INF = np.float32(-np.inf)
_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)
PAD = 8  # elements added to every shared-memory row


@dataclass(frozen=True)
class MmaConfig:
    """Tile configuration of the tensor-core kernel: ``block_m = 16 · num_warps``."""

    block_n: int = 64
    num_warps: int = 4

    def __post_init__(self):
        if self.block_n % 16 or not 1 <= self.num_warps <= 16:
            raise ValueError(f"inconsistent tensor-core tile configuration {self}")

    @property
    def block_m(self):
        return 16 * self.num_warps

    @property
    def num_threads(self):
        return 32 * self.num_warps

    def shared_bytes(self, head_dim, head_dim_v):
        """Q tile plus two stages of K and V tiles, 16-bit elements, padded rows."""
        q = self.block_m * (head_dim + PAD)
        kv = 2 * self.block_n * (head_dim + PAD + head_dim_v + PAD)
        return 2 * (q + kv)


def mma_supported(dtype, head_dim, head_dim_v):
    """Whether the tensor-core kernel takes this dtype and these head dims."""
    return dtype in ("float16", "bfloat16") and head_dim % 16 == 0 and head_dim_v % 16 == 0


def choose_mma_config(head_dim, head_dim_v, max_shared_bytes, simulator=False):
    """Heuristic tile choice: the largest key tile that fits, one or two blocks per SM."""
    if simulator:
        return MmaConfig(block_n=16, num_warps=1)
    widest = max(head_dim, head_dim_v)
    block_ns = (64, 32, 16) if widest <= 128 else (32, 16)
    for block_n in block_ns:
        config = MmaConfig(block_n=block_n, num_warps=4)
        if config.shared_bytes(head_dim, head_dim_v) <= max_shared_bytes:
            return config
    return MmaConfig(block_n=16, num_warps=1)


@functools.lru_cache(maxsize=None)
def mma_attention_kernel(config, dtype, head_dim, head_dim_v, causal, write_lse):
    """Numba kernel ``kernel(q, k, v, o, lse, scale_log2)``; arguments as for the SIMT kernel.

    16-bit arrays only (``uint16`` bit patterns). Launch with
    ``cdiv(Sq, block_m) · B · Hq`` blocks of ``num_threads`` threads and
    ``config.shared_bytes(D, Dv)`` bytes of dynamic shared memory.
    """
    BLOCK_M, BLOCK_N, NUM_THREADS = config.block_m, config.block_n, config.num_threads
    D, DV = head_dim, head_dim_v
    KSTEPS = D // 16  # k-steps of S = Q Kᵀ
    NTILES = BLOCK_N // 8  # n8 accumulator tiles of S (and P)
    PSTEPS = BLOCK_N // 16  # k-steps of O += P V
    DTILES = DV // 8  # n8 accumulator tiles of O
    Q_ROW, K_ROW, V_ROW = D + PAD, D + PAD, DV + PAD
    K_OFF = BLOCK_M * Q_ROW
    K_STAGE = BLOCK_N * K_ROW
    V_OFF = K_OFF + 2 * K_STAGE
    V_STAGE = BLOCK_N * V_ROW
    CAUSAL, WRITE_LSE = causal, write_lse
    mma = mma_m16n8k16_bf16 if dtype == "bfloat16" else mma_m16n8k16_f16
    pack = pack_bf16x2 if dtype == "bfloat16" else pack_f16x2
    narrow = NARROW[dtype]

    @cuda.jit(device=True)
    def load_tile_async(dst, src, b, h, row0, nrows, ncols):
        """Issue 16-byte copies of ``src[b, h, row0 + r, :ncols]`` into ``dst[r, :ncols]``; rows past ``nrows`` read 0."""
        chunks = ncols // 8
        for c in range(cuda.threadIdx.x, dst.shape[0] * chunks, NUM_THREADS):
            r = c // chunks
            col = (c - r * chunks) * 8
            valid = row0 + r < nrows
            cp_async_16(dst, r, col, src, (b, h, row0 + r if valid else 0, col), 16 if valid else 0)

    def kernel(q, k, v, o, lse, scale_log2):
        smem = cuda.shared.array(0, uint16)
        q_s = tile_view(smem, 0, BLOCK_M, Q_ROW)
        seqlen_q, seqlen_kv = q.shape[2], k.shape[2]
        diagonal = seqlen_kv - seqlen_q
        b, h, h_kv, m0, n_end = query_block(q, k, BLOCK_M, CAUSAL)
        n_blocks = (n_end + BLOCK_N - 1) // BLOCK_N

        warp, lane = cuda.threadIdx.x // 32, cuda.threadIdx.x % 32
        g, t = lane // 4, lane % 4
        # ldmatrix_x4: this lane addresses row mrow of 8×8 matrix mat
        mat, mrow = lane // 8, lane % 8

        load_tile_async(q_s, q, b, h, m0, seqlen_q, D)
        cp_async_commit()
        if n_blocks > 0:
            load_tile_async(tile_view(smem, K_OFF, BLOCK_N, K_ROW), k, b, h_kv, 0, seqlen_kv, D)
            load_tile_async(tile_view(smem, V_OFF, BLOCK_N, V_ROW), v, b, h_kv, 0, seqlen_kv, DV)
        cp_async_commit()
        cp_async_wait_group(1)  # the Q tile has landed
        cuda.syncthreads()

        # A fragments of this warp's 16 query rows, for every k-step
        q_frag = cuda.local.array((KSTEPS, 4), uint32)
        for ks in range(KSTEPS):
            q_frag[ks, 0], q_frag[ks, 1], q_frag[ks, 2], q_frag[ks, 3] = ldmatrix_x4(
                q_s, 16 * warp + mrow + 8 * (mat % 2), 16 * ks + 8 * (mat // 2)
            )

        m_i = cuda.local.array(2, float32)  # rows g and g + 8, log2 domain
        l_i = cuda.local.array(2, float32)  # this lane's partial row sums
        acc = cuda.local.array((DTILES, 4), float32)
        s = cuda.local.array((NTILES, 4), float32)
        for r in range(2):
            m_i[r] = _NEG_INF
            l_i[r] = _ZERO
        for dt in range(DTILES):
            for e in range(4):
                acc[dt, e] = _ZERO

        for j in range(n_blocks):
            stage = j % 2
            k_s = tile_view(smem, K_OFF + stage * K_STAGE, BLOCK_N, K_ROW)
            v_s = tile_view(smem, V_OFF + stage * V_STAGE, BLOCK_N, V_ROW)
            if j + 1 < n_blocks:  # prefetch the next tile into the other stage
                n_next = (j + 1) * BLOCK_N
                load_tile_async(tile_view(smem, K_OFF + (1 - stage) * K_STAGE, BLOCK_N, K_ROW),
                                k, b, h_kv, n_next, seqlen_kv, D)
                load_tile_async(tile_view(smem, V_OFF + (1 - stage) * V_STAGE, BLOCK_N, V_ROW),
                                v, b, h_kv, n_next, seqlen_kv, DV)
            cp_async_commit()
            cp_async_wait_group(1)  # tile j has landed (tile j + 1 may be in flight)
            cuda.syncthreads()

            # S = Q Kᵀ: one ldmatrix gives the B fragments of two n8 tiles
            for nt in range(NTILES):
                for e in range(4):
                    s[nt, e] = _ZERO
            for np2 in range(NTILES // 2):
                for ks in range(KSTEPS):
                    b0, b1, b2, b3 = ldmatrix_x4(k_s, 16 * np2 + mrow + 8 * (mat // 2), 16 * ks + 8 * (mat % 2))
                    a0, a1, a2, a3 = q_frag[ks, 0], q_frag[ks, 1], q_frag[ks, 2], q_frag[ks, 3]
                    n = 2 * np2
                    s[n, 0], s[n, 1], s[n, 2], s[n, 3] = mma(a0, a1, a2, a3, b0, b1, s[n, 0], s[n, 1], s[n, 2], s[n, 3])
                    n += 1
                    s[n, 0], s[n, 1], s[n, 2], s[n, 3] = mma(a0, a1, a2, a3, b2, b3, s[n, 0], s[n, 1], s[n, 2], s[n, 3])

            # into the log2 domain; mask keys past the end and past the diagonal
            n0 = j * BLOCK_N
            masked = n0 + BLOCK_N > seqlen_kv or (CAUSAL and n0 + BLOCK_N - 1 > m0 + diagonal)
            for nt in range(NTILES):
                for e in range(4):
                    s[nt, e] *= scale_log2
                    if masked:
                        row = m0 + 16 * warp + g + 8 * (e // 2)
                        col = n0 + 8 * nt + 2 * t + e % 2
                        if col >= seqlen_kv or (CAUSAL and col > row + diagonal):
                            s[nt, e] = _NEG_INF

            # online softmax for rows g (entries 0, 1) and g + 8 (entries 2, 3)
            for r in range(2):
                m_new = m_i[r]
                for nt in range(NTILES):
                    m_new = max(m_new, max(s[nt, 2 * r], s[nt, 2 * r + 1]))
                m_new = max(m_new, shfl_xor_f32(m_new, 1))
                m_new = max(m_new, shfl_xor_f32(m_new, 2))
                # a row with no visible key yet keeps m = -inf; exp2 against 0 then gives 0
                m_ref = m_new if m_new != _NEG_INF else _ZERO
                alpha = ex2_approx(m_i[r] - m_ref)
                m_i[r] = m_new
                l_i[r] *= alpha
                for dt in range(DTILES):
                    acc[dt, 2 * r] *= alpha
                    acc[dt, 2 * r + 1] *= alpha
                for nt in range(NTILES):
                    p0 = ex2_approx(s[nt, 2 * r] - m_ref)
                    p1 = ex2_approx(s[nt, 2 * r + 1] - m_ref)
                    l_i[r] += p0 + p1
                    s[nt, 2 * r] = p0
                    s[nt, 2 * r + 1] = p1

            # O += P V; the accumulator tiles 2kk, 2kk+1 of P are the A fragment of k-step kk
            for kk in range(PSTEPS):
                n = 2 * kk
                a0 = pack(s[n, 0], s[n, 1])
                a1 = pack(s[n, 2], s[n, 3])
                a2 = pack(s[n + 1, 0], s[n + 1, 1])
                a3 = pack(s[n + 1, 2], s[n + 1, 3])
                for dp in range(DTILES // 2):
                    b0, b1, b2, b3 = ldmatrix_x4_trans(v_s, 16 * kk + mrow + 8 * (mat % 2), 16 * dp + 8 * (mat // 2))
                    d = 2 * dp
                    acc[d, 0], acc[d, 1], acc[d, 2], acc[d, 3] = mma(
                        a0, a1, a2, a3, b0, b1, acc[d, 0], acc[d, 1], acc[d, 2], acc[d, 3]
                    )
                    d += 1
                    acc[d, 0], acc[d, 1], acc[d, 2], acc[d, 3] = mma(
                        a0, a1, a2, a3, b2, b3, acc[d, 0], acc[d, 1], acc[d, 2], acc[d, 3]
                    )
            cuda.syncthreads()  # this stage is refilled by the next iteration's prefetch

        # epilogue: full row sums across the four lanes of a group, O = acc / l
        for r in range(2):
            l_sum = l_i[r]
            l_sum += shfl_xor_f32(l_sum, 1)
            l_sum += shfl_xor_f32(l_sum, 2)
            row = m0 + 16 * warp + g + 8 * r
            if row < seqlen_q:
                inv_l = _ONE / l_sum if l_sum > _ZERO else _ZERO
                for dt in range(DTILES):
                    col = 8 * dt + 2 * t
                    o[b, h, row, col] = narrow(acc[dt, 2 * r] * inv_l)
                    o[b, h, row, col + 1] = narrow(acc[dt, 2 * r + 1] * inv_l)
                if WRITE_LSE and t == 0:
                    lse[b, h, row] = (m_i[r] + math.log2(l_sum)) * _LN2 if l_sum > _ZERO else _NEG_INF

    return cuda.jit(kernel)
