"""Tuning the functional API.

``numattn.tune`` searches the kernel configurations and key splits of one call of
``numattn.attention``, ``decode``, ``paged_decode`` or ``mla_decode`` (each op's
``tuning_options``), checks each candidate's output against the heuristic's, and
stores the fastest in the tuning cache, where those functions find it
(``numattn.tuning.store``).
"""

import contextlib
import inspect

import numpy as np

from .._arrays import is_torch
from .._cuda import SIMULATOR, simulate
from ..ops import attention as attention_op
from ..ops import decode as decode_op
from ..ops import mla as mla_op
from ..tuning import cache
from ..tuning.store import problem_key
from .plans import Plan
from .tune import SearchLog, search, time_seconds
from .verify import TOLERANCE, to_float64


def tune(*args, warmup_iters: int = 8, profile_iters: int = 100, verbose: bool = True, **kwargs) -> list[dict]:
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
    fn = args[0] if args and callable(args[0]) else attention_op.attention
    call_args = args[1:] if args and callable(args[0]) else args
    adapters = {
        attention_op.attention: _attention_candidates, decode_op.decode: _decode_candidates,
        decode_op.paged_decode: _paged_candidates, mla_op.mla_decode: _mla_candidates,
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

    def verify(candidate):
        config, splits, _ = candidate
        try:
            run = make(config, splits)
            error = _relative_difference(run(), reference)
        except Exception as e:  # a configuration that fails to compile or launch is reported, not fatal
            return False, f"failed: {type(e).__name__}: {e}", None
        return bool(error <= TOLERANCE[problem.dtype]), f"max rel. difference {error:.1e}", run

    def measure(candidate, run):
        if device is None:
            return candidate[2]  # the cost model's seconds
        return time_seconds(lambda _: run(), [None], warmup_iters, profile_iters)

    rows, best, seconds = search(candidates, lambda c: repr(c[0]), verify, measure, log.bar(len(candidates), "tune"))
    table = [{"config": row.pop("plan"), "splits": splits, **row} for row, (_, splits, _) in
             zip(rows, candidates, strict=True)]
    verified = sum(row["verified"] for row in table)
    log.stage(f"{verified} of {len(table)} matched the heuristic's output, "
              f"{'modelled (no GPU)' if device is None else 'timed with CUDA events'}")
    if best is None:
        raise RuntimeError("no configuration matched the heuristic's output")
    path = cache.cache_path()
    cache.store(path, problem_key(kind, problem), Plan("fused", (), best[0], "copy", best[1]), table)
    log.stage(f"fastest: {best[0]!r} with {best[1]} key split(s), {seconds * 1e6:.1f} us; stored in {path}")
    return table


def _relative_difference(output, reference):
    got, want = to_float64(output), to_float64(reference)
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))


def _first(result):
    return result[0] if isinstance(result, tuple) else result


# -- adapters: (kind, problem, [(config, splits, modelled seconds)], make(config, splits) → a call) ---
def _attention_candidates(q, k, v, *, causal=False, window=None, softcap=None, alibi_slopes=None, sinks=None,
                          scale=None, layout="bhsd", return_lse=False):
    q, k, v, alibi_slopes, sinks = (attention_op.from_dlpack(x) if x is not None else None
                                    for x in (q, k, v, alibi_slopes, sinks))
    p = attention_op.validate(q, k, v, None, causal, scale, layout, return_lse, window, softcap, alibi_slopes, sinks)

    def make(config, splits):
        plan = attention_op.make_plan(p, config, splits or 1)
        return lambda: _first(plan(q, k, v, None, alibi_slopes, sinks))

    return "attention", p, attention_op.tuning_options(p), make


def _decode_like(kind, arrays, options, score_options, validate):
    """``arrays``: q, the caches, the page table and seqlens; ``options``: scale, layout and return_lse;
    ``score_options``: window, softcap, alibi_slopes and sinks."""
    window, softcap, alibi_slopes, sinks = score_options
    arrays = [decode_op.from_dlpack(x) if x is not None else None for x in (*arrays, alibi_slopes, sinks)]
    p = validate(*arrays[:5], *options, None, window, softcap, *arrays[5:])
    q, _, _, page_table, seqlens = arrays[:5]
    if seqlens is not None:  # the lengths' and the page table's values, checked as a call checks them
        decode_op.make_plan(p, 1).check_values(q, page_table, seqlens)

    def make(config, splits):
        plan = decode_op.make_plan(p, splits)
        return lambda: _first(plan(*arrays))

    return kind, p, decode_op.tuning_options(p), make


def _decode_candidates(q, k_cache, v_cache, *, seqlens=None, scale=None, window=None, softcap=None,
                       alibi_slopes=None, sinks=None, layout="bhsd", return_lse=False):
    return _decode_like("decode", (q, k_cache, v_cache, None, seqlens), (scale, layout, return_lse),
                        (window, softcap, alibi_slopes, sinks), decode_op.validate_decode_args)


def _paged_candidates(q, k_pages, v_pages, page_table, seqlens, *, scale=None, window=None, softcap=None,
                      alibi_slopes=None, sinks=None, kv_layout="nhd", return_lse=False):
    return _decode_like("decode", (q, k_pages, v_pages, page_table, seqlens), (scale, kv_layout, return_lse),
                        (window, softcap, alibi_slopes, sinks), decode_op.validate_paged_args)


def _mla_candidates(q_nope, q_pe, ckv_cache, kpe_cache, page_table, seqlens, *, scale, return_lse=False):
    arrays = (q_nope, q_pe, ckv_cache, kpe_cache, page_table, seqlens)
    p = mla_op.validate(*arrays, scale, return_lse)
    if p.dtype == "float32":
        raise TypeError("tune(mla_decode, ...) tunes the float16 and bfloat16 kernels; float32 runs the decode kernel")

    def make(config, splits):
        plan = mla_op.planned(p, config, splits, torch=all(is_torch(x) for x in arrays))
        return lambda: _first(plan(*arrays))

    return "mla_decode", p, mla_op.tuning_options(p), make
