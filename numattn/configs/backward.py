"""Tile configurations of the attention backward's tensor-core kernels (``kernels/attention_backward_mma.py``,
``kernels/attention_backward_wgmma.py``): configuration classes, candidates, device fit and default choice."""

import math
from dataclasses import dataclass

from ..kernels.attention_backward_wgmma import BLOCK_M
from ..kernels.ptx import SW128_ALIGN
from ..kernels.tiles import PAD
from . import registers


@dataclass(frozen=True)
class BackwardMmaConfig:
    """Tile configuration of the tensor-core backward: ``num_warps`` warps of 16 keys each, query tiles of
    ``block_m`` rows through ``stages`` shared-memory buffers."""

    block_m: int = 64
    num_warps: int = 8
    stages: int = 2

    def __post_init__(self):
        if self.block_m % 16 or not 16 <= self.block_m <= 128 or not 1 <= self.num_warps <= 16 or not 2 <= self.stages <= 4:
            raise ValueError(f"inconsistent backward tile configuration {self}")

    @property
    def block_n(self):
        return 16 * self.num_warps

    @property
    def num_threads(self):
        return 32 * self.num_warps

    @property
    def dq_warps(self):
        """``(row_warps, col_warps)``: the warps' grid over a query tile's dQ (m16 tiles × head-dim columns)."""
        rows = math.gcd(self.num_warps, self.block_m // 16)
        return rows, self.num_warps // rows

    def fits(self, head_dim):
        """Whether each warp's share of dQ's columns is a whole number of 16-column steps."""
        return head_dim % (16 * self.dq_warps[1]) == 0

    def shared_bytes(self, head_dim, head_dim_v):
        """K and V tiles, ``stages`` Q and dO tiles, the dSᵀ tile (16-bit, padded rows), and per stage the
        tile's rows of lse₂ and delta (float32)."""
        n, m = self.block_n, self.block_m
        halves = n * (head_dim + PAD) + n * (head_dim_v + PAD) + n * (m + PAD)
        halves += self.stages * m * (head_dim + PAD + head_dim_v + PAD)
        return 2 * halves + 4 * self.stages * 2 * m


def backward_mma_supported(dtype, head_dim, head_dim_v):
    """Whether the tensor-core backward takes this dtype and these head dims."""
    return dtype in ("float16", "bfloat16") and head_dim % 16 == 0 and head_dim_v % 16 == 0


# Per head-dim class, candidates in order of preference; the first that fits the device is used.
_BACKWARD_MMA_CANDIDATES = {
    64: (BackwardMmaConfig(64, 8), BackwardMmaConfig(64, 4)),
    128: (BackwardMmaConfig(64, 8), BackwardMmaConfig(64, 4), BackwardMmaConfig(32, 4)),
    256: (BackwardMmaConfig(32, 4), BackwardMmaConfig(16, 4)),
}


def choose_backward_config(head_dim, head_dim_v, max_shared_bytes, simulator=False):
    """The first candidate for these head dims that fits the shared memory (in the simulator the
    smallest tile), or None."""
    if simulator:
        candidates = (BackwardMmaConfig(16, 1),)
    else:
        widest = max(head_dim, head_dim_v)
        candidates = _BACKWARD_MMA_CANDIDATES[64 if widest <= 64 else 128 if widest <= 128 else 256]
    for config in candidates:
        if config.fits(head_dim) and config.shared_bytes(head_dim, head_dim_v) <= max_shared_bytes:
            return config
    return None


@dataclass(frozen=True)
class BackwardWgmmaConfig(registers.WarpgroupBlock):
    """Tile configuration of the wgmma backward: ``warpgroups`` warpgroups of 64 keys each, ``dq_stages``
    shared-memory buffers for the dQ tiles on their way to the float32 accumulator. ``producer``: one more
    warpgroup copies the query tiles and adds the dQ tiles, with ``BACKWARD_PRODUCER_REGISTERS`` registers
    per thread, and the computing ones take the rest of the register file (``consumer_registers``).
    ``stages``: shared-memory stages of the query tiles (Q, dO and their rows); three only with a producer.
    ``ds_stages``: buffers of the dS tile; with two (only beside a producer) the computing warpgroups meet
    once per tile instead of twice. ``tensor_copies`` (only with a producer): Q and dO tiles come by tensor
    copies (TMA), one thread issuing a tile's, rather than 16 bytes per ``cp.async`` (but a packed sequence's
    tile that runs past its rows)."""

    warpgroups: int = 2
    dq_stages: int = 2
    producer: bool = False
    stages: int = 2
    ds_stages: int = 1
    tensor_copies: bool = False

    def __post_init__(self):
        if (self.warpgroups not in (1, 2) or self.dq_stages not in (1, 2) or (self.producer and self.warpgroups != 2)
                or self.stages not in (2, 3) or (self.stages == 3 and not self.producer)
                or self.ds_stages not in (1, 2) or (self.ds_stages == 2 and not self.producer)
                or (self.tensor_copies and not self.producer)):
            raise ValueError(f"inconsistent wgmma backward configuration {self}")

    @property
    def block_n(self):
        return 64 * self.warpgroups

    @property
    def block_m(self):
        return BLOCK_M

    @property
    def producer_registers(self):
        """Registers per thread of the producer warpgroup."""
        return BACKWARD_PRODUCER_REGISTERS

    def fits(self, head_dim):
        """Whether the warpgroups divide dQ's head-dim columns into whole 64-column panels."""
        return head_dim % (64 * self.warpgroups) == 0

    def shared_bytes(self, head_dim, head_dim_v):
        """K, V, the stages of Q and dO, the dS tiles (16-bit), the stages' lse₂ and delta rows and the dQ
        tiles (float32), and slack to align the swizzled tiles."""
        n, stages = self.block_n, self.stages
        halves = (n * (head_dim + head_dim_v) + stages * BLOCK_M * (head_dim + head_dim_v)
                  + self.ds_stages * BLOCK_M * n)
        dq_tiles = self.dq_stages * BLOCK_M * head_dim
        return 2 * halves + 4 * (stages * 2 * BLOCK_M + dq_tiles) + SW128_ALIGN


# per thread of the producer, which copies with cp.async and issues the dQ reductions. The computing warpgroups
# take the rest: at 224 (a producer of 56) ptxas serialises their wgmma (each waited for before the next is
# issued), at 232 (40) it does not, and the producer's extra spills cost less than that (H200, causal bf16 D128:
# the backward takes 0.95-0.97 of its time at 56)
BACKWARD_PRODUCER_REGISTERS = 40


def backward_wgmma_supported(dtype, head_dim, head_dim_v, cc):
    """Whether the wgmma backward takes this dtype and these head dims on a GPU of compute capability ``cc``."""
    return cc == (9, 0) and dtype in ("float16", "bfloat16") and all(d % 64 == 0 and d <= 256 for d in (head_dim, head_dim_v))


def choose_backward_wgmma_config(head_dim, head_dim_v, max_shared_bytes):
    """Two warpgroups where they fit (registers: head dims up to 128) beside a producer, with three query
    stages, one dQ buffer and two dS buffers where they fit, else one; else two or one warpgroups without a
    producer, each with two dQ buffers where they fit, else one; None if nothing fits. Every score
    modification and packed sequences take the producer (measured faster: the softcap's and ALiBi's
    backward by 16-17% on an H200, a training step on four packed sequences of 4096 by 17%; three stages
    and one dQ buffer gained up to 4% over two of each on an H100, nothing with a window of 1024 or packed
    sequences; two dS buffers up to 2% on an H200). The producer takes dense Q and dO tiles by tensor copies
    (a training step 0.95-0.96 of the time with them and the forward's, H200, B4 H32 L4096 D128 causal, B4 H16
    L8192 window 1024 or ALiBi)."""
    groups = (2, 1) if max(head_dim, head_dim_v) <= 128 else (1,)
    candidates = [BackwardWgmmaConfig(g, dq) for g in groups for dq in (2, 1)]
    if 2 in groups:
        candidates[:0] = [BackwardWgmmaConfig(2, 1, producer=True, stages=3, ds_stages=ds, tensor_copies=True)
                          for ds in (2, 1)]
    for config in candidates:
        if config.fits(head_dim) and config.shared_bytes(head_dim, head_dim_v) <= max_shared_bytes:
            return config
    return None
