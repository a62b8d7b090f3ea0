"""Tile configurations of the attention forward kernels: per kernel family its configuration class, the
candidates worth trying, the register estimate and device fit, and the heuristic's default choice.
The kernels (``kernels/attention_*.py``) take a configuration and read its fields."""

from dataclasses import dataclass, replace

from .._arrays import storage_dtype
from .._cuda import SIMULATOR
from ..kernels.launch import device_limits
from ..kernels.ptx import SW128_ALIGN
from ..kernels.score_mods import NO_MODS
from ..kernels.sequences import DENSE
from ..kernels.split_merge import CLUSTER_SPLITS, KEY_SPLITS
from ..kernels.tensor_maps import key_box_rows
from ..kernels.tiles import PAD
from . import registers

# --------------------------------------------------------------------------
# CUDA-core (SIMT) kernel: fp32 and what the tensor cores do not take
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class SimtConfig:
    """Tile configuration of the SIMT kernel."""

    block_m: int = 64
    block_n: int = 64
    num_threads: int = 128
    threads_n: int = 8

    def __post_init__(self):
        threads_m, rest = divmod(self.num_threads, self.threads_n)
        if rest or self.block_m % threads_m or self.block_n % self.threads_n:
            raise ValueError(f"inconsistent SIMT tile configuration {self}")

    def shared_words(self, head_dim, head_dim_v):
        """fp32 words of shared memory: Q, K, V, P tiles and the row-max exchange."""
        vcols = -(-head_dim_v // self.threads_n) * self.threads_n
        return (
            self.block_m * (head_dim + 1)
            + self.block_n * (head_dim + 1)
            + self.block_n * vcols
            + self.block_m * (self.block_n + 1)
            + self.block_m * self.threads_n
        )

    def shared_bytes(self, head_dim, head_dim_v):
        return 4 * self.shared_words(head_dim, head_dim_v)


def simt_configs(head_dim, head_dim_v):
    """The tile configurations worth trying for these head dims, largest tiles first."""
    widest = max(head_dim, head_dim_v)
    if widest <= 64:
        return (SimtConfig(64, 64, 128, 8), SimtConfig(64, 32, 128, 8))
    if widest <= 128:
        return (SimtConfig(64, 32, 128, 8), SimtConfig(32, 32, 128, 8))
    return (SimtConfig(32, 32, 128, 16), SimtConfig(32, 16, 128, 16))


def choose_simt_config(head_dim, head_dim_v, max_shared_bytes, simulator=False):
    """Heuristic tile choice: the largest tiles that fit ``max_shared_bytes``."""
    if simulator:
        # Each simulated thread is a Python thread: few of them, small tiles.
        return SimtConfig(block_m=16, block_n=16, num_threads=8, threads_n=2)
    for config in simt_configs(head_dim, head_dim_v):
        if config.shared_bytes(head_dim, head_dim_v) <= max_shared_bytes:
            return config
    return SimtConfig(16, 16, 32, 4)


# --------------------------------------------------------------------------
# Tensor cores, mma.sync (sm_80 and later)
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class MmaConfig:
    """Tile configuration of the tensor-core kernel.

    ``num_warps`` warps each own ``warp_m`` m16 tiles of query rows, so
    ``block_m = 16 · warp_m · num_warps``; keys stream in tiles of ``block_n``
    through ``stages`` shared-memory buffers (``stages - 1`` tiles in flight).
    With ``q_in_registers`` a warp keeps its Q fragments in registers for the
    whole kernel, otherwise it re-reads them from shared memory per key tile.
    """

    block_n: int = 64
    num_warps: int = 4
    warp_m: int = 1
    q_in_registers: bool = True
    stages: int = 2

    def __post_init__(self):
        if (
            self.block_n % 16
            or not 1 <= self.num_warps <= 16
            or self.warp_m not in (1, 2, 4)
            or not 2 <= self.stages <= 4
        ):
            raise ValueError(f"inconsistent tensor-core tile configuration {self}")

    @property
    def block_m(self):
        return 16 * self.warp_m * self.num_warps

    @property
    def num_threads(self):
        return 32 * self.num_warps

    def shared_bytes(self, head_dim, head_dim_v, k_transposed=False):
        """Q tile plus ``stages`` K and V tiles, 16-bit elements, padded rows (K as ``head_dim`` rows of
        keys when ``k_transposed``)."""
        q = self.block_m * (head_dim + PAD)
        k = head_dim * (self.block_n + PAD) if k_transposed else self.block_n * (head_dim + PAD)
        return 2 * (q + self.stages * (k + self.block_n * (head_dim_v + PAD)))

    def register_pressure(self, head_dim, head_dim_v):
        """Registers per thread the kernel asks for, a linear fit to ptxas's counts (calibration below):
        per m16 tile a warp owns, its output accumulator (``head_dim_v``), its Q fragments when kept in
        registers (``head_dim``) and a key tile's scores (``block_n``); plus the tile's copies. Past
        255 it is no count: ptxas fitted pressures up to about 280 into its 255 registers."""
        per_tile = 0.58 * head_dim_v + (0.18 * head_dim if self.q_in_registers else 0) + 0.45 * self.block_n
        return round(78 + self.warp_m * per_tile + 0.35 * self.block_n)

    @property
    def register_pressure_limit(self):
        """The ``register_pressure`` above which configurations spilled (calibration below)."""
        return REGISTER_PRESSURE_LIMIT


# Calibration (ptxas 13, sm_90, fp16, causal with LSE, 2026-11-23; head dim 64: block_n 16–128, 1, 4
# and 8 warps, warp_m 1, 2 and 4; head dims 128 and 256: 4 warps, warp_m 1 and 2; Q in registers or
# not): no configuration put at 278 or less spilled; every one put at 295 or more spilled 100 bytes
# or more; in between, a few words or none.
REGISTER_PRESSURE_LIMIT = 285


def mma_supported(dtype, head_dim, head_dim_v):
    """Whether the tensor-core kernel takes this dtype and these head dims."""
    return dtype in ("float16", "bfloat16") and head_dim % 16 == 0 and head_dim_v % 16 == 0


# Per head-dim class, candidates in order of preference; the first that fits the
# device's shared memory and the registers is used. Measured on an H200 (docs/benchmarks.md).
_MMA_CANDIDATES = {
    64: (MmaConfig(64, 4, 2, True), MmaConfig(64, 4, 1, True), MmaConfig(32, 4, 1, True)),
    128: (MmaConfig(32, 4, 2, False), MmaConfig(64, 4, 1, True), MmaConfig(32, 4, 1, True)),
    256: (MmaConfig(64, 8, 1, False), MmaConfig(32, 8, 1, False), MmaConfig(32, 4, 1, False), MmaConfig(16, 4, 1, False)),
}


# Blocks of 16 and 32 query rows, for grids short of query blocks (a tuner's candidates, after the heuristic's)
_SHORT_QUERY_BLOCKS = (MmaConfig(64, 2, 1, True), MmaConfig(64, 1, 1, True))


def mma_configs(head_dim, head_dim_v):
    """The tile configurations worth trying for these head dims, the heuristic's preference first."""
    widest = max(head_dim, head_dim_v)
    return _MMA_CANDIDATES[64 if widest <= 64 else 128 if widest <= 128 else 256] + _SHORT_QUERY_BLOCKS


def choose_mma_config(head_dim, head_dim_v, max_shared_bytes, simulator=False):
    """Heuristic tile choice: the first candidate for the head dims that fits the device's shared memory
    and the registers."""
    if simulator:
        return MmaConfig(block_n=16, num_warps=1)
    for config in mma_configs(head_dim, head_dim_v):
        if (config.shared_bytes(head_dim, head_dim_v) <= max_shared_bytes
                and config.register_pressure(head_dim, head_dim_v) <= config.register_pressure_limit):
            return config
    return MmaConfig(block_n=16, num_warps=1)


# --------------------------------------------------------------------------
# Tensor cores, warpgroup wgmma (sm_90)
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class WgmmaConfig(registers.WarpgroupBlock):
    """Tile configuration of the wgmma kernel.

    ``warpgroups`` warpgroups of 64 query rows each, so ``block_m = 64 · warpgroups``;
    keys stream in tiles of ``block_n`` through ``stages`` shared-memory buffers. ``producer``: one more
    warpgroup copies the tiles, with ``PRODUCER_REGISTERS`` registers per thread, and the others take the
    rest of the register file (``consumer_registers``). ``persistent`` (with a producer): a block per SM takes
    query tile after query tile, the next tile's Q copied into a second buffer while the block computes the
    current one, and the ring of K/V stages runs on from tile to tile.
    """

    block_n: int = 128
    warpgroups: int = 2
    stages: int = 3
    producer: bool = False
    persistent: bool = False

    def __post_init__(self):
        if (self.block_n % 16 or not 16 <= self.block_n <= 256 or not 1 <= self.warpgroups <= 3
                or not 2 <= self.stages <= 4 or self.persistent and not self.producer):
            raise ValueError(f"inconsistent wgmma tile configuration {self}")

    @property
    def query_buffers(self):
        """Q tiles in shared memory: the current one and, in a persistent block, the next."""
        return 2 if self.persistent else 1

    @property
    def block_m(self):
        return 64 * self.warpgroups

    @property
    def producer_registers(self):
        """Registers per thread of the copying warpgroup."""
        return PRODUCER_REGISTERS

    def register_pressure(self, head_dim, head_dim_v):
        """Registers per thread the kernel asks for, a linear fit to ptxas's counts with two
        warpgroups (calibration below): a thread's share of the 64-row output accumulator
        (``head_dim_v``), of a key tile's scores and P fragments (``block_n``)."""
        return round(48 + 0.59 * head_dim_v + 0.85 * self.block_n)

    @property
    def register_pressure_limit(self):
        """The ``register_pressure`` above which configurations spilled at ``max_registers`` (at
        ``consumer_registers`` beside a producer)."""
        return (self.consumer_registers if self.producer else self.max_registers) + REGISTER_SLACK

    def shared_bytes(self, head_dim, head_dim_v):
        """Q tiles plus ``stages`` K and V tiles of 16-bit elements, and slack to align the buffer."""
        tiles = self.query_buffers * self.block_m * head_dim + self.stages * self.block_n * (head_dim + head_dim_v)
        return 2 * tiles + SW128_ALIGN


# Calibration (ptxas 13, sm_90a, fp16, causal with LSE, 3 stages, 2026-11-23; head dims 64, 128 and
# 256, block_n 32–128, one to three warpgroups, compiled at ``max_registers``): with three warpgroups
# (168 registers) pressures up to 178 compiled without spilling and 195 and more spilled 52 bytes or
# more; with two (255), 254 without spilling and 281 spilled 184 bytes.
REGISTER_SLACK = 12
PRODUCER_REGISTERS = 56  # per thread of a wgmma kernel's copying warpgroup
# Registers a kernel of paged sequences (``kernels/sequences.py``) asks for beyond the estimate: ptxas counts
# rose by 10 to 17 over the dense kernel's (head dims 64, 128, 256, the candidates below, unconstrained). With
# this many the dense kernel's tiles are kept at head dims 64 and 256 and the producer dropped at 128 (B8 L2048
# Hq32 Hkv8 causal, 2026-11-28): at 64 the 96-key tiles spill 40/100 bytes yet took 0.77 of the time of the
# 64-key tiles that 28 registers chose (H200, fp16); at 256 the 48-key tiles compile to 249 registers without
# spilling and took 1.01 of the time of the 32-key tiles (H100, bf16); at 128 the producer's copying warpgroup
# spills 216/352 bytes (H200, bf16: 1.31 of the time). Packed sequences, and pages that split a 128-key tile
# into whole boxes (``tensor_maps.key_box_rows``), take the dense kernel's tiles: with 13 registers more they
# did at 64 and 256 too, and at 128 their producer copies by TMA, which spills only in the copies of a
# sequence's last key tile (packed: 40/80 bytes, bf16, causal).
SEQUENCES_REGISTERS = 13


def wgmma_supported(dtype, head_dim, head_dim_v, cc):
    """Whether the wgmma kernel takes this dtype and these head dims on a GPU of compute capability ``cc``."""
    return (
        cc == (9, 0)
        and dtype in ("float16", "bfloat16")
        and all(d % 64 == 0 and d <= 256 for d in (head_dim, head_dim_v))
    )


# Per widest head dim, candidates in order of preference; the first that fits
# the device's shared memory and the registers is used. Measured on an H100 (docs/benchmarks.md); at head
# dim 128 two warpgroups of 128-key tiles took 0.84-0.97 of the time of three of 64-key tiles on an H100
# and 0.80-0.95 on an H200 (bf16, six shapes, 2026-11-27), at head dim 64 1.13-1.15 (docs/notes); with a
# producer warpgroup 0.86-0.95 of the time of the same tiles without (H200, B4 H16 L8192 bf16: causal,
# not causal, window 1024, ALiBi; docs/notes/wgmma-instruction-count-2026-11-27.md).
_WGMMA_CANDIDATES = {
    64: (WgmmaConfig(96, 3, 4), WgmmaConfig(64, 3, 3)),
    128: (WgmmaConfig(128, 2, 3, producer=True), WgmmaConfig(128, 2, 3), WgmmaConfig(64, 3, 4), WgmmaConfig(64, 3, 3)),
    192: (WgmmaConfig(48, 2, 3), WgmmaConfig(32, 2, 3)),
    256: (WgmmaConfig(48, 2, 3), WgmmaConfig(32, 2, 3)),
}
# Blocks of one or two warpgroups of 128-key tiles, for grids short of query tiles (tuners' candidates, after
# the heuristic's): with four key splits on Mirage's GQA graph (head dim 64, 256 queries, 4096 keys; H200)
# 27.3 µs at b = 8 against 33.3 for three warpgroups of 96-key tiles (docs/notes/w6-key-splits-2026-11-26.md)
_WGMMA_SHORT_QUERY_BLOCKS = {64: (WgmmaConfig(128, 2, 3), WgmmaConfig(128, 1, 3))}
# Persistent blocks (``default_choice`` takes them where query tiles visit few keys)
_WGMMA_PERSISTENT = {128: (WgmmaConfig(128, 2, 2, producer=True, persistent=True),)}


def wgmma_configs(head_dim, head_dim_v):
    """The tile configurations worth trying for these head dims, the heuristic's preference first."""
    widest = max(head_dim, head_dim_v)
    return _WGMMA_CANDIDATES[widest] + _WGMMA_SHORT_QUERY_BLOCKS.get(widest, ()) + _WGMMA_PERSISTENT.get(widest, ())


def producer_fits(mods):
    """Whether a kernel with the score modifications ``mods`` fits the registers its computing warpgroups have
    beside a producer: the plain kernel and one of window, ALiBi or sinks compiled without spilling there
    (bf16, head dim 128, LTO, 2026-11-27); a softcap, or a window with ALiBi, spilled."""
    return not mods.softcap and not (mods.window and mods.alibi)


def choose_wgmma_config(head_dim, head_dim_v, max_shared_bytes, extra_registers=0, mods=NO_MODS):
    """Heuristic tile choice: the first candidate for the head dims that fits the device's shared memory
    and the registers (``extra_registers`` beyond the estimate: a kernel of packed or paged sequences; the
    score modifications ``mods``)."""
    candidates = [config for config in wgmma_configs(head_dim, head_dim_v) if not config.persistent]
    for config in candidates:
        pressure = config.register_pressure(head_dim, head_dim_v) + extra_registers
        if (config.shared_bytes(head_dim, head_dim_v) <= max_shared_bytes and pressure <= config.register_pressure_limit
                and (producer_fits(mods) or not config.producer)):
            return config
    return candidates[-1]


# --------------------------------------------------------------------------
# The choice for one problem (``p``: an attention problem of ``ops/attention.py``: dtype, head dims,
# key length, whether K is read transposed and rows take 16-byte copies)
# --------------------------------------------------------------------------


def fitting_kernels(p, limits):
    """The tile-configuration classes whose kernels can compute problem ``p`` on this device."""
    tensor_cores = mma_supported(p.dtype, p.head_dim, p.head_dim_v) and limits["cc"] >= (8, 0)
    if tensor_cores and p.transposed_k_loads:  # the mma.sync kernel by default, the wgmma one for tuners
        if wgmma_supported(p.dtype, p.head_dim, p.head_dim_v, limits["cc"]):
            return (MmaConfig, WgmmaConfig, SimtConfig)
        return (MmaConfig, SimtConfig)
    if not (tensor_cores and p.vector_loads):
        return (SimtConfig,)
    if wgmma_supported(p.dtype, p.head_dim, p.head_dim_v, limits["cc"]):
        return (WgmmaConfig, MmaConfig)
    return (MmaConfig,)


def default_config(p, limits):
    """The heuristic's tile configuration, of the first fitting kernel (in the simulator the
    mma.sync kernel rather than the wgmma one: its one-warp tiles simulate faster)."""
    kinds = fitting_kernels(p, limits)
    if kinds[0] is WgmmaConfig and not SIMULATOR:
        layout = None if p.sequences is None else p.sequences.layout
        # pages copied by threads take registers beyond the estimate; the producer's 128-key tiles of whole pages,
        # copied by TMA, do not
        extra = SEQUENCES_REGISTERS if layout is not None and layout.paged and not key_box_rows(layout, 128) else 0
        return choose_wgmma_config(p.head_dim, p.head_dim_v, limits["max_shared"], extra, p.options.mods)
    if MmaConfig in kinds:
        config = choose_mma_config(p.head_dim, p.head_dim_v, limits["max_shared"], SIMULATOR)
        if problem_shared_bytes(p, config) <= limits["max_shared"]:
            return config
        return MmaConfig(block_n=16, num_warps=1)  # transposed K tiles of wide heads: the smallest tiles
    return choose_simt_config(p.head_dim, p.head_dim_v, limits["max_shared"], SIMULATOR)


def problem_shared_bytes(p, config):
    """Shared-memory bytes of ``config``'s kernel on problem ``p`` (an ``mma.sync`` kernel reading K transposed
    holds K tiles of another shape)."""
    if type(config) is MmaConfig:
        return config.shared_bytes(p.head_dim, p.head_dim_v, p.transposed_k_loads)
    return config.shared_bytes(p.head_dim, p.head_dim_v)


SPLITTING = WgmmaConfig(128, 2, 3)  # the default's tiles where it splits the keys of a short grid
SPLIT_KEY_TILES = 8  # key tiles each run keeps at least, where the default splits the keys
# Keys a query tile visits at most where the default takes a persistent block (``WgmmaConfig.persistent``): there
# a block's fixed cost (its start, its first copies, its output) weighs on few key tiles, and the persistent
# block's rounds balance long causal tiles no worse than the hardware's block scheduler. Persistent (two split
# stages) over the default's time, bf16 D128 H16, H100, 2026-12-06 (docs/notes/persistent-forward-2026-12-06.md):
# causal window 1024 at L8192 0.824, window 2048 0.826; L1024 causal 0.943, not causal 0.982; L2048 0.934 and
# 0.940; L8192 0.981 and 0.973, with ALiBi 0.993; beyond: L16384 causal 1.045, L32768 1.032.
PERSISTENT_KEYS = 8192


def visited_keys(p, config):
    """The most keys a query tile of ``config``'s visits in problem ``p``: all of them, or under a window its
    width and the tile's rows."""
    left, right = p.options.window or (p.seqlen_kv, p.seqlen_kv)
    return min(p.seqlen_kv, left + right + config.block_m)


def default_choice(p, limits):
    """The heuristic's ``(configuration, key splits)``: ``default_config`` and one run of keys, except for a
    grid of query tiles that fills at most half the SMs with at least four times as many keys as queries
    (few sequences and heads, a chunk of queries against a long context; the shapes measured): on sm_90
    with head dims up to 128, without a window, the wgmma kernel of ``SPLITTING`` then divides the keys
    into as many runs (of ``KEY_SPLITS``) as keep the launch within a block per SM and at least
    ``SPLIT_KEY_TILES`` key tiles per run. On an H200 this took B1 H8 Lq 512 Lkv 16384 D128 bf16 from 213
    to 88 µs (4 runs; SDPA flash 120) and left B2 H8 Lq 1024 Lkv 8192 (128 query tiles, where splits were
    slower) alone (docs/attention.md, "Few query tiles, many keys"). Packed and paged sequences count
    their longest (``max_seqlen_q``, ``max_seqlen_k``): on an H100 four of 256 queries over 16384 keys (H8
    D128 bf16 causal) took 159 µs in 2 runs per query tile against 236 in one (the padded batch 158), one of
    128 over 32768 98 µs in 16 runs against 458. Otherwise, where every query tile of the default's wgmma kernel
    with a producer visits at most ``PERSISTENT_KEYS`` keys, the keys are copied by tensor copies and there are
    more query tiles than SMs, a persistent block per SM takes the query tiles in turn
    (``WgmmaConfig.persistent``; with fewer tiles each block would take one, with a stage less: B2 H8 L1000
    causal took 1.07 of the time). Packed sequences take persistent blocks only where every sequence has
    ``max_seqlen_q`` queries (``Sequences.equal_query_lengths``): on an H100, B8 L2048 Hq32 Hkv8 D128 bf16 causal,
    one process, a block per tile took 0.617 ms padded and 0.639 packed, persistent blocks 0.576 padded and
    0.593 packed; over 16 uneven sequences persistent blocks were 11% slower than a block per tile (measured
    with all four producer warps following the tiles; they pass over the tiles past each sequence's rows)."""
    config = default_config(p, limits)
    if (isinstance(config, WgmmaConfig) and max(p.head_dim, p.head_dim_v) <= 128 and not p.options.mods.window
            and p.seqlen_kv >= 4 * p.seqlen_q and misfit(p, SPLITTING, limits) is None):
        tiles = p.batch * p.heads_q * -(-p.seqlen_q // SPLITTING.block_m)
        key_tiles = -(-p.seqlen_kv // SPLITTING.block_n)  # two runs or more need tiles ≤ SMs / 2
        fitting = [n for n in KEY_SPLITS if tiles * n <= limits["sms"] and key_tiles >= SPLIT_KEY_TILES * n]
        if fitting:
            return SPLITTING, max(fitting)
    tiles = p.batch * p.heads_q * -(-p.seqlen_q // config.block_m)
    if (isinstance(config, WgmmaConfig) and config.producer and visited_keys(p, config) <= PERSISTENT_KEYS
            and tiles > limits["sms"] and (p.sequences is None or p.sequences.equal_query_lengths)):
        persistent = replace(config, stages=2, persistent=True)
        if misfit(p, persistent, limits) is None:
            return persistent, 1
    return config, 1


def tile_candidates(problem, pruned=None):
    """Every tile configuration offered for ``problem`` on its device (in the simulator, the small
    ones that simulate in seconds) that fits the device's shared memory and the registers; the others
    are appended to ``pruned`` as ``(config, reason)`` when a list is given."""
    p = problem
    limits = device_limits(0 if p.device is None else p.device)
    configs = []
    for kind in fitting_kernels(p, limits):
        if SIMULATOR:
            options = {WgmmaConfig: [], MmaConfig: [choose_mma_config(p.head_dim, p.head_dim_v, 0, True)],
                       SimtConfig: [choose_simt_config(p.head_dim, p.head_dim_v, 0, True)]}[kind]
        elif kind is WgmmaConfig:
            options = wgmma_configs(p.head_dim, p.head_dim_v)
        elif kind is MmaConfig:
            options = mma_configs(p.head_dim, p.head_dim_v)
        else:
            options = simt_configs(p.head_dim, p.head_dim_v)
        for config in options:
            reason = misfit(p, config, limits)
            if reason is None:
                configs.append(config)
            elif pruned is not None:
                pruned.append((config, reason))
    return configs


def problem_box_rows(p, block_n):
    """Rows of K and V one tensor copy of a ``block_n``-key tile moves in problem ``p`` (``key_box_rows`` of its
    sequence layout), 0 where its pages do not split a tile into whole boxes."""
    return key_box_rows(DENSE if p.sequences is None else p.sequences.layout, block_n)


def misfit(p, config, limits):
    """Why ``config`` does not fit problem ``p`` on this device, or None."""
    if isinstance(config, WgmmaConfig) and p.transposed_k_loads and config.block_n % 64:
        return "K read transposed takes key tiles in multiples of 64"
    if isinstance(config, WgmmaConfig) and config.persistent and not (
            not p.transposed_k_loads and p.tensor_mappable
            and problem_box_rows(p, config.block_n)):
        return ("a persistent block takes tiles that tensor copies read (K as it lies, 16-byte aligned rows, pages "
                "that tile the key tiles)")
    shared = problem_shared_bytes(p, config)
    if shared > limits["max_shared"]:
        return f"needs {shared} bytes of shared memory, the device allows {limits['max_shared']}"
    if isinstance(config, (MmaConfig, WgmmaConfig)):
        pressure = config.register_pressure(p.head_dim, p.head_dim_v)
        if pressure > config.register_pressure_limit:
            return f"register pressure {pressure} above {config.register_pressure_limit} (would spill)"
    return None


def splits_keys(config):
    """Whether the kernel of ``config`` can divide a query tile's keys among several blocks: the tensor-core
    kernels, the wgmma one without a producer warpgroup."""
    return isinstance(config, MmaConfig) or isinstance(config, WgmmaConfig) and not config.producer


def split_options(problem, config):
    """Key splits worth trying with ``config``: 1, and where ``splits_keys`` 2 to 16 while each run keeps
    at least two key tiles."""
    if not splits_keys(config):
        return [1]
    tiles = -(-problem.seqlen_kv // config.block_n)
    return [1] + [n for n in KEY_SPLITS if 2 * n <= tiles]


SECTIONED_HEADS = 128  # heads from which a forward grid may walk them in sections (``grid_in_sections``)
STREAMED_KV_BYTES = 128 * 1024 * 1024  # and keys and values beyond which it does


def grid_in_sections(p):
    """Whether the forward grid of dense problem ``p`` walks its heads in sections whose keys and values fit
    in L2 together (``kernels.tiles.query_tile``): with ``SECTIONED_HEADS`` heads or more, whose keys and
    values come to more than ``STREAMED_KV_BYTES``, several times the L2 cache. An H100 or H200 runs 132
    blocks at once: in the plain order, one query tile of each of 128 heads, each reading keys of its own.
    Measured on an H200 at B4 H32 L4096 D128 bf16: causal 8–11% faster, non-causal 2–5%; with 64 heads (B4
    H16 L8192 D128) or 64 MiB of keys and values (B8 H16 L2048 D64) sections were no faster."""
    kv_bytes = p.batch * p.heads_kv * p.seqlen_kv * (p.head_dim + p.head_dim_v) * storage_dtype(p.dtype).itemsize
    return p.batch * p.heads_q >= SECTIONED_HEADS and kv_bytes > STREAMED_KV_BYTES


def cluster_merges(blocks, splits, limits):
    """Whether a launch of ``blocks`` query tiles times ``splits`` key splits on a device of ``limits``
    (``device_limits``) merges its splits in thread-block clusters (sm_90 and later, at most
    ``CLUSTER_SPLITS``) rather than by the last block of each query tile: where the launch has at most
    a block per SM. There the last block's merge is the launch's tail (measured on an H200, Mirage's
    GQA graph at b = 1: 20.3 against 34.4 µs); with more blocks other blocks' work hides it, and
    clusters, placed a GPU processing cluster at a time, spread the blocks less evenly over the SMs
    (at b = 8: 41.0 µs merged by the last block, 56.2 in clusters of 4)."""
    return (2 <= splits <= CLUSTER_SPLITS and not SIMULATOR and limits["cc"] >= (9, 0)
            and blocks * splits <= limits["sms"])
