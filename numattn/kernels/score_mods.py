"""The score modifications the attention kernels compile in: sliding window, logit softcap, ALiBi, sinks.

A kernel specialisation names which it applies (``ScoreMods``, compile-time flags: a kernel without
any is the plain kernel) and takes their values at launch, after ``scale_log2``:
``alibi [batch or 1, heads_q]`` and ``sinks [heads_q]`` float32 arrays, then ``left``, ``right``,
``cap_log2`` and ``cap_slope``. With ``i`` a query row's position among the keys (its index plus
``seqlen_kv − seqlen_q``):

* window: key ``j`` is visible iff ``i − left ≤ j ≤ i + right`` (``UNBOUNDED`` for a side without
  a bound; under ``causal`` the host passes ``right = 0``); key tiles wholly outside are not visited;
* softcap: the score ``x`` (scaled, log2 domain) becomes ``cap_log2 · tanh(x / cap_log2)``, where
  ``cap_log2 = c · log2 e`` for a cap ``c`` and ``cap_slope = 2 / c``;
* ALiBi: ``slope · log2 e · |i − j|`` is subtracted, after the softcap;
* sinks: the softmax's denominator gains ``exp(sinks[h])`` (a value of zero): the row's running max
  and sum start from the sink instead of ``(-inf, 0)``.
"""

import functools
from dataclasses import dataclass

import numpy as np

from .._cuda import cuda
from .ptx import ex2_approx, rcp_approx

UNBOUNDED = 2**30  # a window side without a bound: farther than any sequence
_ONE = np.float32(1.0)
_ZERO = np.float32(0.0)
NO_TERMS = (0, 0, _ZERO, _ZERO, _ZERO)  # (left, right, cap_log2, cap_slope, slope_log2) of a kernel without mods


@dataclass(frozen=True)
class ScoreMods:
    """Which score modifications a kernel specialisation applies."""

    window: bool = False
    softcap: bool = False
    alibi: bool = False
    sinks: bool = False

    def __str__(self):
        names = [name for name in ("window", "softcap", "alibi", "sinks") if getattr(self, name)]
        return "+".join(names) or "none"

    @property
    def elementwise(self):
        """Whether every score takes more than the scale (the softcap or ALiBi's bias)."""
        return self.softcap or self.alibi


NO_MODS = ScoreMods()


@cuda.jit(device=True, forceinline=True)
def softcapped(x, cap_log2, cap_slope):
    """``cap_log2 · tanh(x / cap_log2)`` of a log2-domain score ``x``, as ``c·log2e·(1 − 2 / (1 + e^(2s/c)))``
    for the natural-domain score ``s = x / log2 e``: one ``ex2`` and one ``rcp``, odd, ±cap at ±inf,
    absolute error a few ulps of ``cap_log2``."""
    return cap_log2 - (cap_log2 + cap_log2) * rcp_approx(_ONE + ex2_approx(x * cap_slope))


@cuda.jit(device=True, forceinline=True)
def window_span(m0, rows, diagonal, seqlen_kv, left, right):
    """``(n_start, n_end)``: the keys that query rows ``m0 .. m0 + rows`` see under a window of ``left``
    and ``right`` keys (``diagonal = seqlen_kv − seqlen_q``); ``(0, 0)`` when they see none."""
    n_start = max(0, m0 + diagonal - left)
    n_end = min(seqlen_kv, m0 + rows + diagonal + right)
    return (n_start, n_end) if n_end > n_start else (0, 0)


@cuda.jit(device=True, forceinline=True)
def crosses_window(n0, cols, m0, rows, diagonal, left, right):
    """Whether a tile of ``cols`` keys from ``n0`` holds a key that some of rows ``m0 .. m0 + rows`` do not
    see under the window (its left edge passes the last row's first key, or its right edge the first
    row's last key)."""
    return n0 < m0 + rows - 1 + diagonal - left or n0 + cols - 1 > m0 + diagonal + right


@cuda.jit(device=True, forceinline=True)
def window_queries(n0, cols, diagonal, seqlen_q, block_m, left, right):
    """``(m_first, m_tiles)``: the query tiles of ``block_m`` rows (from a multiple of it) holding a row that sees
    one of the ``cols`` keys from ``n0`` under the window (row ``i`` at position ``i + diagonal``)."""
    m_first = max(0, n0 - right - diagonal) // block_m * block_m
    m_end = min(seqlen_q, n0 + cols + left - diagonal)
    return m_first, max(0, -(-(m_end - m_first) // block_m))


@functools.lru_cache(maxsize=None)
def score_gradient(mods):
    """Device function ``gradient(x, dp, lse2, delta, distance, terms) -> (P, dS)`` of the backward: a scaled
    score ``x`` (log2 domain) modified as the forward did (softcap, then ALiBi's bias for a query and key
    ``distance`` apart; ``terms`` ``(left, right, cap_log2, cap_slope, slope_log2)``), its probability
    against the row's ``lse2``, and ``dS = P (dP − delta)`` through the softcap's derivative ``1 − tanh²``."""
    SOFTCAP, ALIBI = mods.softcap, mods.alibi

    @cuda.jit(device=True, forceinline=True)
    def gradient(x, dp, lse2, delta, distance, terms):
        if SOFTCAP:
            x = softcapped(x, terms[2], terms[3])
        capped = x
        if ALIBI:
            x -= terms[4] * distance
        p = ex2_approx(x - lse2)
        ds = p * (dp - delta)
        if SOFTCAP:
            tanh = capped / terms[2]
            ds *= _ONE - tanh * tanh
        return p, ds

    return gradient
