"""Tuning the functional API: ``numattn.tune`` searches the tile configurations (and key splits) of
``numattn.attention`` for one problem and stores the winner in the tuning cache, which
``numattn.attention`` consults when it plans a call it has not seen."""

import hashlib
import os
import sys

import numpy as np

from .._cuda import SIMULATOR
from ..kernels.attention_mma import MmaConfig
from ..kernels.launch import device_limits
from . import cache
from .plans import Plan
from .tune import Progress

SPLITS = (2, 4, 8, 16)
TOLERANCE = {"float16": 2e-2, "bfloat16": 6e-2, "float32": 1e-3}  # max difference / max |heuristic's output|


def problem_key(problem):
    """Cache key of an attention problem: what picks and constrains its kernel (shapes, dtype, masking,
    LSE, which loads its layout allows), the device and the numattn version."""
    from .. import __version__

    p = problem
    device = device_limits(0 if p.device is None else p.device)
    text = repr((
        "attention", p.batch, p.heads_q, p.heads_kv, p.seqlen_q, p.seqlen_kv, p.head_dim, p.head_dim_v, p.dtype,
        p.causal, p.return_lse, p.vector_loads, p.transposed_k_loads, p.aligned_out, device["name"], device["cc"],
        __version__,
    ))
    return "attention-" + hashlib.sha256(text.encode()).hexdigest()


_MEMO = {}  # path → (mtime, {key: (config, splits)}) of the cache file, read once per change


def tuned_config(problem):
    """``(config, splits)`` stored by ``tune`` for this problem, or None."""
    path = cache.cache_path()
    try:
        mtime = os.stat(path).st_mtime_ns
    except OSError:
        return None
    memo = _MEMO.get(path)
    if memo is None or memo[0] != mtime:
        memo = _MEMO[path] = (mtime, {})
    key = problem_key(problem)
    if key not in memo[1]:
        hit = cache.load(path, key)
        memo[1][key] = None if hit is None else (hit["config"], hit["splits"])
    return memo[1][key]


def tune(q, k, v, *, causal=False, scale=None, layout="bhsd", warmup_iters=8, profile_iters=100, verbose=False):
    """Time every tile configuration (and, for the ``mma.sync`` kernel, key splits) of
    ``numattn.attention(q, k, v, causal=causal, scale=scale, layout=layout)``, check each
    candidate's output against the heuristic's, and store the fastest in the tuning cache; later
    calls with the same shapes, dtype and layout (in this or another process) use it.

    Returns the table: one dict per candidate with its configuration, splits, whether its output
    matched, and its time (seconds; on a GPU CUDA-event medians of back-to-back calls, in the
    simulator the cost model's estimate)."""
    from ..ops.attention import _make_plan, _validate, from_dlpack, tile_candidates
    from .pipeline import _device_id
    from .tune import attention_seconds, time_seconds
    from .verify import to_float64

    q, k, v = (from_dlpack(x) for x in (q, k, v))
    problem = _validate(q, k, v, None, causal, scale, layout, False)
    reference = to_float64(_make_plan(problem)(q, k, v, None))
    candidates = []
    for config in tile_candidates(problem):
        candidates.append((config, 1))
        if isinstance(config, MmaConfig):
            tiles = -(-problem.seqlen_kv // config.block_n)
            candidates += [(config, n) for n in SPLITS if 2 * n <= tiles]
    device = None if SIMULATOR else _device_id()
    progress = Progress(len(candidates), verbose or sys.stderr.isatty())
    table, best = [], None
    for config, splits in candidates:
        row = {"config": repr(config), "splits": splits, "verified": False, "seconds": None, "note": ""}
        try:
            plan = _make_plan(problem, config, splits)
            error = np.max(np.abs(to_float64(plan(q, k, v, None)) - reference)) / max(np.max(np.abs(reference)), 1e-30)
        except Exception as e:  # a configuration that fails to compile or launch is reported, not fatal
            row["note"] = f"failed: {type(e).__name__}: {e}"
        else:
            row["verified"] = bool(error <= TOLERANCE[problem.dtype])
            row["note"] = f"max rel. difference {error:.1e}"
        if row["verified"]:
            if device is None:
                p = problem
                dims = ((p.batch, p.heads_q, p.seqlen_q, p.head_dim), (p.batch, p.heads_kv, p.head_dim, p.seqlen_kv),
                        (p.batch, p.heads_kv, p.seqlen_kv, p.head_dim_v), (p.batch, p.heads_q, p.seqlen_q, p.head_dim_v))
                itemsize = 4 if p.dtype == "float32" else 2
                row["seconds"] = attention_seconds(*dims, itemsize, config, splits)
            else:
                row["seconds"] = time_seconds(lambda args: plan(*args, None), [(q, k, v)], warmup_iters, profile_iters)
            if best is None or row["seconds"] < best[2]:
                best = (config, splits, row["seconds"])
        table.append(row)
        progress.step(row["config"])
    if best is None:
        raise RuntimeError("no tile configuration matched the heuristic's output")
    winner = Plan("fused", (), best[0], "copy", best[1])
    cache.store(cache.cache_path(), problem_key(problem), winner, table)
    return table
