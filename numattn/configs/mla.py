"""Configurations of the MLA decode kernels (``kernels/mla.py``, ``kernels/mla_wgmma.py``): the configuration
class, shared-memory and register estimates, the fit test per architecture, the candidates and the default."""

from dataclasses import dataclass, replace

from ..kernels.mla import HEAD_ROWS
from ..kernels.mla_wgmma_steps import HEADS_PER_BLOCK, PERSISTENT_HEADS, mla_wgmma_shared_bytes
from ..kernels.tiles import tile_row_elems

# Per-block limits by compute capability: opt-in shared memory (bytes) and registers per SM.
SHARED_LIMITS = {(8, 0): 166_912, (8, 6): 101_376, (8, 7): 166_912, (8, 9): 101_376, (9, 0): 232_448}
REGISTERS_PER_SM = 65_536
MAX_REGISTERS_PER_THREAD = 255
_REGISTER_BASE = 100  # addresses, loop state, softmax statistics
_SHARDED_REGISTERS = 60  # the exchange of partial scores
_WGMMA_REGISTER_BASE = 64  # descriptors, barriers' phases, copy addresses, softmax statistics


@dataclass(frozen=True)
class MlaConfig:
    """One MLA decode kernel configuration.

    ``block_n`` latent rows per tile (a multiple of 16), ``stages`` tiles in the
    ``cp.async`` ring, ``warps`` warps per block (each owns ``R / warps`` output
    columns), ``qk`` ``"duplicated"`` or ``"sharded"`` (see the module docstring);
    ``wgmma``: the sm_90 kernel of ``mla_wgmma.py`` instead (8 warps; ``qk`` "duplicated" or "shared");
    ``persistent``: its shared schedule on a grid of one block per SM taking the sequences in turn
    (calls with key splits or more than ``mla_wgmma.PERSISTENT_HEADS`` heads run the ordinary kernel).
    """

    block_n: int
    stages: int
    warps: int
    qk: str
    wgmma: bool = False
    persistent: bool = False

    @property
    def heads_per_block(self):
        """Query heads of one block: an m16 tile, or wgmma's m64."""
        return HEADS_PER_BLOCK if self.wgmma else HEAD_ROWS


def mla_shared_bytes(config, rank, rope):
    """Dynamic shared memory of the kernel: the Q tile, the ring of latent tiles, the score exchange."""
    if config.wgmma:
        return mla_wgmma_shared_bytes(config.block_n, config.stages, rank, rope, config.qk == "shared")
    row = tile_row_elems(rank + rope)
    exchange = config.warps * HEAD_ROWS * config.block_n * 4 if config.qk == "sharded" else 0
    return 2 * (HEAD_ROWS + config.stages * config.block_n) * row + exchange


def mla_registers_estimate(config, rank, rope):
    """Registers per thread, estimated from the kernel's live values: the output accumulator, the
    scores (and their P fragments and ldmatrix addresses), each copy's page and address.

    Calibrated on ptxas for sm_90 (bf16; rank, rope 512, 64 / 256, 64 / 512, 0): every candidate
    it lets through compiled without spills (e.g. rank 512, rope 64: block_n 16, 8 warps,
    duplicated 156 registers, estimate 184; sharded 254, estimate 244; block_n 32, 8 warps,
    duplicated 224, estimate 232), the configurations that spilled are estimated above 255
    (block_n 32, 4 warps at rank 512: 300; block_n 32, 8 warps, sharded at rank 256: 260).
    The wgmma kernel keeps its accumulator (half the columns of 64 rows), scores and P fragments;
    at rank 512, rope 64, block_n 64 ptxas gives it 255 registers and 60–124 bytes of spills
    (estimate 232), block_n 128 would not fit."""
    if config.wgmma:
        return _WGMMA_REGISTER_BASE + rank // 4 + config.block_n // 2 + config.block_n // 8
    accumulator = HEAD_ROWS * (rank // config.warps) // 32
    scores = HEAD_ROWS * config.block_n // 32
    copies = -(-(config.block_n * (rank + rope) // 8) // (32 * config.warps))
    sharded = _SHARDED_REGISTERS if config.qk == "sharded" else 0
    return _REGISTER_BASE + accumulator + 4 * scores + 4 * copies + sharded


def mla_config_error(config, rank, rope, cc):
    """Why ``config`` cannot run rank ``rank``, rope dim ``rope`` on compute capability ``cc`` (None if it can)."""
    schedules = ("duplicated", "shared") if config.wgmma else ("duplicated", "sharded")
    if config.qk not in schedules:
        return f"qk must be one of {schedules}, got {config.qk!r}"
    if config.block_n % 16 or config.stages < 2 or config.warps < 1:
        return "block_n must be a multiple of 16, stages at least 2, warps at least 1"
    if config.persistent and not (config.wgmma and config.qk == "shared"):
        return "the persistent kernel is the wgmma kernel's shared schedule"
    if config.wgmma:
        if tuple(cc) != (9, 0):
            return "the wgmma kernel runs on sm_90 only"
        if config.warps != 8 or config.block_n > 64:
            return "the wgmma kernel takes 8 warps and block_n up to 64"
        if rank % 128:
            return f"the wgmma kernel takes kv_lora_rank multiples of 128, got {rank}"
    if rank % (16 * config.warps):
        return f"kv_lora_rank {rank} does not split into {config.warps} warps' multiples of 16 columns"
    if config.qk == "sharded" and (rank + rope) // 16 < config.warps:
        return f"{(rank + rope) // 16} k-steps are fewer than the {config.warps} warps to shard them over"
    limit = SHARED_LIMITS.get(tuple(cc))
    if limit is None:
        return f"no shared-memory limit known for compute capability {cc}"
    if mla_shared_bytes(config, rank, rope) > limit:
        return f"needs {mla_shared_bytes(config, rank, rope)} bytes of shared memory, sm_{cc[0]}{cc[1]} allows {limit}"
    registers = mla_registers_estimate(config, rank, rope)
    if registers > MAX_REGISTERS_PER_THREAD or registers * 32 * config.warps > REGISTERS_PER_SM:
        return f"needs about {registers} registers per thread"
    return None


def mla_candidates(rank, rope, cc):
    """Every configuration of the search space that fits compute capability ``cc``."""
    space = [
        MlaConfig(block_n, stages, warps, qk)
        for block_n in (16, 32, 64)
        for stages in (2, 3, 4, 6)
        for warps in (4, 8)
        for qk in ("duplicated", "sharded")
    ]
    space += [
        MlaConfig(block_n, stages, 8, qk, True)
        for block_n in (16, 32, 64)
        for stages in (2, 3, 4, 6)
        for qk in ("duplicated", "shared")
    ]
    return [c for c in space if mla_config_error(c, rank, rope, cc) is None]


# the measured best on an H100 (docs/benchmarks.md#mla-decode): warpgroup 0 computes the scores and
# hands P to warpgroup 1, over 32-row tiles in four stages (three tiles in flight), on the ordinary grid;
# with at most 32 heads on the persistent grid. Where four stages of 64 rows fit (R + P <= 320) the
# wider tile is faster, except with the keys split across blocks, one block per SM
_SM90_MEASURED = MlaConfig(32, 4, 8, "shared", True)
_SM90_MEASURED_WIDE = replace(_SM90_MEASURED, block_n=64)


def mla_default_config(rank, rope, cc, heads=None, split=False):
    """The choice among ``mla_candidates`` (for ``heads`` query heads, when given; ``split``: for keys
    split across blocks). On sm_90: the wgmma kernel's measured best (4 stages of 64-row tiles where
    they fit and the keys are not split, else of 32-row tiles, shared scores; on the persistent grid
    for at most ``PERSISTENT_HEADS`` heads, else the ordinary grid) where it fits, else the largest
    tiles, shared scores, then the most stages. Elsewhere: the most latent bytes in flight per SM
    (two blocks per SM where they fit), then sharded scores, then fewer warps."""
    limit = SHARED_LIMITS.get(tuple(cc))
    candidates = mla_candidates(rank, rope, cc)
    if not candidates:
        raise ValueError(f"no MLA decode configuration fits kv_lora_rank {rank}, rope dim {rope} on sm_{cc[0]}{cc[1]}")
    if _SM90_MEASURED in candidates:
        wide = _SM90_MEASURED_WIDE in candidates and not split
        best = _SM90_MEASURED_WIDE if wide else _SM90_MEASURED
        few_heads = heads is not None and heads <= PERSISTENT_HEADS
        return replace(best, persistent=True) if few_heads else best

    def score(c):
        blocks = max(1, min(2, limit // mla_shared_bytes(c, rank, rope)))
        if c.wgmma:
            return (1, c.block_n, c.qk == "shared", c.stages)
        return (0, blocks * (c.stages - 1) * c.block_n, c.qk == "sharded", -c.warps)

    return max(candidates, key=score)
