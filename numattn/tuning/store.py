"""Tuned configurations per problem: ``numattn.tune`` stores the fastest (configuration, key splits) of a
call under ``problem_key``; ``numattn.attention``, ``decode``, ``paged_decode`` and ``mla_decode`` read
it back (``tuned_config``) when they plan a call they have not seen, and fall back to their heuristic
without an entry (or, with a warning, past an entry that ``tune`` would not have stored)."""

import hashlib
import os
import warnings

from .._version import __version__
from ..kernels.kernel_cache import source_digest
from ..kernels.launch import device_limits
from . import cache


def problem_key(kind, problem):
    """Cache key of one problem of function ``kind``: what picks and constrains its kernels (the score
    modifications and the window's sides among them), the device, the numattn version and the kernel sources
    (a configuration tuned for other kernels is not reused)."""
    p = problem
    device = device_limits(0 if p.device is None else p.device)
    if kind == "attention":
        fields = (p.batch, p.heads_q, p.heads_kv, p.seqlen_q, p.seqlen_kv, p.head_dim, p.head_dim_v, p.causal,
                  p.vector_loads, p.transposed_k_loads, p.aligned_out, str(p.options.mods), p.options.window)
    elif kind == "decode":
        fields = (p.batch, p.heads_q, p.heads_kv, p.seqlen_q, p.head_dim, p.head_dim_v, p.capacity, p.k.shape,
                  p.page_table is not None, p.seqlens is not None, p.vector_loads, str(p.options.mods),
                  p.options.window)
    else:  # mla_decode
        fields = (p.batch, p.heads, p.rank, p.rope, p.page_size, p.max_pages)
    text = repr((kind, *fields, p.dtype, p.return_lse, device["name"], device["cc"], __version__, source_digest()))
    return f"{kind}-" + hashlib.sha256(text.encode()).hexdigest()


_MEMO = {}  # path → (mtime, {key: (config, splits)}) of the cache file, read once per change


def tuned_config(kind, problem, options):
    """``(config, splits)`` stored by ``tune`` for this problem of function ``kind``, or None: also, with a
    warning, for an entry that is not among ``options(problem)`` (``[(config, splits, modelled seconds)]``,
    the candidates ``tune`` tries for the problem; one written by hand, say), which the kernels might not
    build."""
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
        if tuned is not None and tuned not in [(config, splits) for config, splits, _ in options(problem)]:
            config, splits = tuned
            what = f"{splits} key splits" if config is None else f"{config} with {splits} key splits"
            warnings.warn(f"ignoring numattn tuning cache entry in {path}: {what} is not one that numattn.tune "
                          f"tries for this {kind} problem", cache.CacheWarning, stacklevel=3)
            tuned = None
        memo[1][key] = tuned
    return memo[1][key]
