"""Tuning the functional API.

``numattn.tune`` searches the kernel configurations and key splits of one call of
``numattn.attention``, ``decode``, ``paged_decode`` or ``mla_decode``, checks each
candidate's output against the heuristic's, and stores the fastest in the tuning
cache; those functions consult the cache (``tuned_config``) when they plan a call
they have not seen, and fall back to their heuristic without an entry (or, with a
warning, past an entry that ``tune`` would not have stored).
"""

import contextlib
import dataclasses
import hashlib
import inspect
import os
import warnings

import numpy as np

from .._cuda import SIMULATOR, simulate
from ..kernels.launch import device_limits
from . import cache
from .plans import Plan
from .tune import SearchLog, split_candidates

TOLERANCE = {"float16": 2e-2, "bfloat16": 6e-2, "float32": 1e-3}  # max difference / max |heuristic's output|


def problem_key(kind, problem):
    """Cache key of one problem of function ``kind``: what picks and constrains its kernels, the device
    and the numattn version."""
    from .. import __version__

    p = problem
    device = device_limits(0 if p.device is None else p.device)
    if kind == "attention":
        fields = (p.batch, p.heads_q, p.heads_kv, p.seqlen_q, p.seqlen_kv, p.head_dim, p.head_dim_v, p.causal,
                  p.vector_loads, p.transposed_k_loads, p.aligned_out)
    elif kind == "decode":
        fields = (p.batch, p.heads_q, p.heads_kv, p.seqlen_q, p.head_dim, p.head_dim_v, p.capacity, p.k.shape,
                  p.page_table is not None, p.seqlens is not None, p.vector_loads)
    else:  # mla_decode
        fields = (p.batch, p.heads, p.rank, p.rope, p.page_size, p.max_pages)
    text = repr((kind, *fields, p.dtype, p.return_lse, device["name"], device["cc"], __version__))
    return f"{kind}-" + hashlib.sha256(text.encode()).hexdigest()


_MEMO = {}  # path → (mtime, {key: (config, splits)}) of the cache file, read once per change


def tuned_config(kind, problem):
    """``(config, splits)`` stored by ``tune`` for this problem of function ``kind``, or None: also, with a
    warning, for an entry that is not among the candidates ``tune`` tries for the problem (one written
    by hand, say), which the kernels might not build."""
    path = cache.cache_path()
    try:
        mtime = os.stat(path).st_mtime_ns
    except OSError:
        return None
    memo = _MEMO.get(path)
    if memo is None or memo[0] != mtime:
        memo = _MEMO[path] = (mtime, {})
    key = problem_key(kind, problem)
    if key not in memo[1]:
        hit = cache.load(path, key)
        tuned = None if hit is None else (hit["config"], hit["splits"])
        if tuned is not None and tuned not in [(config, splits) for config, splits, _ in _OPTIONS[kind](problem)]:
            config, splits = tuned
            what = f"{splits} key splits" if config is None else f"{config} with {splits} key splits"
            warnings.warn(f"ignoring numattn tuning cache entry in {path}: {what} is not one that numattn.tune "
                          f"tries for this {kind} problem", cache.CacheWarning, stacklevel=3)
            tuned = None
        memo[1][key] = tuned
    return memo[1][key]


def tune(*args, warmup_iters=8, profile_iters=100, verbose=True, **kwargs):
    """Tune one call: ``numattn.tune(q, k, v, **attention_kwargs)`` for ``numattn.attention``, or
    ``numattn.tune(fn, *args, **kwargs)`` with ``fn`` one of ``numattn.attention``, ``decode``,
    ``paged_decode``, ``mla_decode`` and the arguments of a call of it.

    Every configuration the kernels offer (tile configurations, key splits) runs once and is
    checked against the heuristic's output, then timed (on a GPU, CUDA-event medians of
    back-to-back calls; in the simulator, a cost model); the fastest is stored in the tuning cache,
    where later calls of the same problem (shapes, dtype, options, layout class) find it, in this
    process and later ones. Without a GPU the candidates run in numba's CUDA simulator. ``verbose``
    (the default) reports the stages on stderr, with a live bar on a terminal. Returns the table: per
    candidate its configuration, splits, whether its output matched, and its time in seconds."""
    from .. import ops

    fn = args[0] if args and callable(args[0]) else ops.attention.attention
    call_args = args[1:] if args and callable(args[0]) else args
    adapters = {
        ops.attention.attention: _attention_candidates, ops.decode.decode: _decode_candidates,
        ops.decode.paged_decode: _paged_candidates, ops.mla.mla_decode: _mla_candidates,
    }
    if fn not in adapters:
        raise TypeError(f"tune takes numattn.attention, decode, paged_decode or mla_decode, got {fn!r}")
    try:
        inspect.signature(adapters[fn]).bind(*call_args, **kwargs)
    except TypeError as e:
        raise TypeError(f"tune({fn.__name__}, ...): {e}; the arguments are those of a call of {fn.__name__}, "
                        "without out= or check=") from None
    with simulate() if SIMULATOR else contextlib.nullcontext():  # without a GPU: the kernels' logic, simulated
        return _tune(*adapters[fn](*call_args, **kwargs), warmup_iters, profile_iters, SearchLog(verbose))


def _tune(kind, problem, candidates, make, warmup_iters, profile_iters, log):
    log.stage(f"numattn.{kind}: {len(candidates)} candidate configurations and key splits")
    reference = make(None, None)()
    device = None if SIMULATOR or problem.device is None else problem.device
    progress = log.bar(len(candidates), "tune")
    table, best = [], None
    for config, splits, model in candidates:
        row = {"config": repr(config), "splits": splits, "verified": False, "seconds": None, "note": ""}
        try:
            run = make(config, splits)
            error = _relative_difference(run(), reference)
        except Exception as e:  # a configuration that fails to compile or launch is reported, not fatal
            row["note"] = f"failed: {type(e).__name__}: {e}"
        else:
            row["verified"] = bool(error <= TOLERANCE[problem.dtype])
            row["note"] = f"max rel. difference {error:.1e}"
        if row["verified"]:
            if device is None:
                row["seconds"] = model
            else:
                from .tune import time_seconds

                row["seconds"] = time_seconds(lambda _: run(), [None], warmup_iters, profile_iters)
            if best is None or row["seconds"] < best[2]:
                best = (config, splits, row["seconds"])
        table.append(row)
        progress.step(row["config"])
    progress.close()
    verified = sum(row["verified"] for row in table)
    log.stage(f"{verified} of {len(table)} matched the heuristic's output, "
              f"{'modelled (no GPU)' if device is None else 'timed with CUDA events'}")
    if best is None:
        raise RuntimeError("no configuration matched the heuristic's output")
    path = cache.cache_path()
    cache.store(path, problem_key(kind, problem), Plan("fused", (), best[0], "copy", best[1]), table)
    log.stage(f"fastest: {best[0]!r} with {best[1]} key split(s), {best[2] * 1e6:.1f} us; stored in {path}")
    return table


def _relative_difference(output, reference):
    from .verify import to_float64

    got, want = to_float64(output), to_float64(reference)
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))


def _first(result):
    return result[0] if isinstance(result, tuple) else result


# -- adapters: (kind, problem, [(config, splits, modelled seconds)], make(config, splits) → a call), and per
# kind the candidates of a problem (``_OPTIONS``, against which ``tuned_config`` checks entries) ---
def _attention_candidates(q, k, v, *, causal=False, scale=None, layout="bhsd", return_lse=False):
    from ..ops.attention import _make_plan, _validate, from_dlpack

    q, k, v = (from_dlpack(x) for x in (q, k, v))
    p = _validate(q, k, v, None, causal, scale, layout, return_lse)

    def make(config, splits):
        plan = _make_plan(p, config, splits or 1)
        return lambda: _first(plan(q, k, v, None))

    return "attention", p, _attention_options(p), make


def _attention_options(p):
    """``[(config, splits, modelled seconds)]`` of attention problem ``p``: the tile configurations and key splits."""
    from ..ops.attention import split_options, tile_candidates
    from .tune import attention_seconds

    dims = ((p.batch, p.heads_q, p.seqlen_q, p.head_dim), (p.batch, p.heads_kv, p.head_dim, p.seqlen_kv),
            (p.batch, p.heads_kv, p.seqlen_kv, p.head_dim_v), (p.batch, p.heads_q, p.seqlen_q, p.head_dim_v))
    itemsize = 4 if p.dtype == "float32" else 2
    candidates = []
    for config in tile_candidates(p):
        candidates += [(config, n, attention_seconds(*dims, itemsize, config, n)) for n in split_options(p, config)]
    return candidates


def _decode_like(kind, arrays, options, validate):
    from ..ops import decode as module

    arrays = [module.from_dlpack(x) if x is not None else None for x in arrays]
    p = validate(*arrays, *options)

    def make(config, splits):
        plan = module._make_plan(p, splits)
        return lambda: _first(plan(*arrays))

    return kind, p, _decode_options(p), make


def _decode_options(p):
    """``[(None, splits, modelled seconds)]`` of decode problem ``p``: the key splits."""
    itemsize = 4 if p.dtype == "float32" else 2
    row_bytes = itemsize * (p.head_dim + p.head_dim_v)
    return split_candidates(p.batch * p.heads_kv, p.capacity, row_bytes,
                            itemsize * p.heads_q * p.seqlen_q * (p.head_dim + p.head_dim_v))


def _decode_candidates(q, k_cache, v_cache, *, seqlens=None, scale=None, layout="bhsd", return_lse=False):
    from ..ops import decode as module

    return _decode_like("decode", (q, k_cache, v_cache, None, seqlens), (scale, layout, return_lse),
                        module._validate_decode_args)


def _paged_candidates(q, k_pages, v_pages, page_table, seqlens, *, scale=None, kv_layout="nhd", return_lse=False):
    from ..ops import decode as module

    return _decode_like("decode", (q, k_pages, v_pages, page_table, seqlens), (scale, kv_layout, return_lse),
                        module._validate_paged_args)


def _mla_candidates(q_nope, q_pe, ckv_cache, kpe_cache, page_table, seqlens, *, scale, return_lse=False):
    from ..ops import mla as module

    arrays = (q_nope, q_pe, ckv_cache, kpe_cache, page_table, seqlens)
    p = module._validate(*arrays, scale, return_lse)
    if p.dtype == "float32":
        raise TypeError("tune(mla_decode, ...) tunes the float16 and bfloat16 kernels; float32 runs the decode kernel")

    def make(config, splits):
        plan = module.planned(p, config, splits)
        return lambda: _first(plan(*arrays))

    return "mla_decode", p, _mla_options(p), make


def _mla_options(p):
    """``[(config, splits, modelled seconds)]`` of (float16 or bfloat16) MLA decode problem ``p``."""
    from ..kernels.mla import mla_candidates, mla_config_error, mla_default_config
    from ..kernels.mla_wgmma import PERSISTENT_HEADS

    limits = device_limits(0 if p.device is None else p.device)
    row_bytes = 2 * (p.rank + p.rope)
    configs = mla_candidates(p.rank, p.rope, limits["cc"])
    if SIMULATOR:  # the configurations that simulate in seconds
        configs = [c for c in configs if not c.wgmma and c.block_n == 16 and c.stages == 2 and c.warps == 4]
    # also the default's persistent grid where it has one, unsplit (split, or with more than
    # PERSISTENT_HEADS heads, it runs the ordinary kernel)
    persistent = dataclasses.replace(mla_default_config(p.rank, p.rope, limits["cc"]), persistent=True)
    if p.heads <= PERSISTENT_HEADS and mla_config_error(persistent, p.rank, p.rope, limits["cc"]) is None:
        configs = [*configs, persistent]
    candidates = []
    for config in configs:
        work = p.batch * -(-p.heads // config.heads_per_block)
        for _, splits, seconds in split_candidates(work, p.max_pages * p.page_size, row_bytes, row_bytes * p.heads):
            if splits == 1 or not config.persistent:
                candidates.append((config, splits, seconds))
    return candidates


_OPTIONS = {"attention": _attention_options, "decode": _decode_options, "mla_decode": _mla_options}
