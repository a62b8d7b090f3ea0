"""Cost models of the tuning layer: modelled seconds of a fused attention launch and of a decode's key
splits, used to order candidates (and to rank them where nothing can be timed), and the key splits
that tuners try."""

import numpy as np

from ..configs.attention import MmaConfig, cluster_merges
from ..kernels.split_merge import KEY_SPLITS, MAX_SPLITS

# the cost model's device: an H100's copy bandwidth, tensor/CUDA-core rates and SMs, per-launch cost
BANDWIDTH = 3.0e12
FLOPS = {"WgmmaConfig": 600e12, "MmaConfig": 300e12, "SimtConfig": 15e12, "unfused": 5e12}
SMS = 132
LAUNCH_SECONDS = 5e-6
MODEL_DEVICE = {"cc": (9, 0), "sms": SMS}  # the cost model's device, as ``device_limits`` describes one


def attention_seconds(q, k, v, out, itemsize, config, splits):
    """Modelled seconds of one fused attention kernel (and its combine when split) on dims ``q`` (…, Sq, D),
    ``k`` (…, D, Skv), ``v`` (…, Skv, Dv), ``out`` (…, Sq, Dv). A split launch's merge by each query tile's
    last block runs after the tile's other blocks, a launch's worth of tail; merged in clusters (the
    ``mma.sync`` kernel where ``cluster_merges``) it is not."""
    batch = int(np.prod(out[:-2]))
    flops = 2.0 * batch * out[-2] * k[-1] * (q[-1] + v[-1])
    nbytes = itemsize * sum(int(np.prod(d)) for d in (q, k, v, out))
    rate = FLOPS.get(type(config).__name__, FLOPS["MmaConfig"])  # None: the heuristic's
    clustered = False
    if config is not None:  # whole waves of blocks; under four warps a block leaves sub-partitions idle
        tiles = batch * -(-out[-2] // config.block_m)
        blocks = tiles * splits
        rate *= blocks / (SMS * -(-blocks // SMS)) * min(1.0, config.num_threads / 128)
        clustered = isinstance(config, MmaConfig) and cluster_merges(tiles, splits, MODEL_DEVICE)
    seconds = max(nbytes / BANDWIDTH, flops / rate) + LAUNCH_SECONDS
    if splits > 1:  # the combine: float32 partials written and read back
        seconds += 2 * 4 * batch * out[-2] * splits * (out[-1] + 1) / BANDWIDTH + (0 if clustered else LAUNCH_SECONDS)
    return seconds


def split_candidates(work, capacity, row_bytes, query_bytes):
    """``[(None, splits, modelled seconds)]`` for key splits 1, 2, 4, … of a decode over ``work`` blocks
    and ``capacity`` keys (at least 32 keys per split): whole waves over the SMs of blocks reading
    their share of the keys, plus the combine."""
    out = []
    for splits in (1, *KEY_SPLITS):
        if splits > 1 and 2 * splits > -(-capacity // 16):
            break
        waves = -(-work * splits // SMS)
        seconds = waves * -(-capacity // splits) * row_bytes / (BANDWIDTH / SMS) + query_bytes / BANDWIDTH
        if splits > 1:
            seconds += 2 * splits * query_bytes / BANDWIDTH + LAUNCH_SECONDS
        out.append((None, splits, seconds + LAUNCH_SECONDS))
    return out


def split_count(work, capacity, blocks_per_sm, min_keys, sms, per_sm=1):
    """Key splits for ``work`` blocks' worth of (sequence, head, rows) over ``capacity`` keys: the fewest that
    minimise the waves of blocks times the keys per block, ``ceil(work · n / slots) / n`` with ``slots =
    blocks_per_sm · sms``, with at least ``min_keys`` keys per split, at most ``MAX_SPLITS``, and at most
    ``per_sm`` blocks per SM."""
    slots = blocks_per_sm * sms
    most = max(1, min(-(-capacity // min_keys), per_sm * sms // work, MAX_SPLITS))
    return min(range(1, most + 1), key=lambda n: (-(-work * n // slots) / n, n))
