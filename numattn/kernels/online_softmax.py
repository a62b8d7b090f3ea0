"""The online-softmax steps shared by the tensor-core attention kernels.

Both tensor-core kernels hold a warp's scores in accumulator fragments:
``s[mt, nt, e]`` is entry ``e`` of n8 tile ``nt`` of the warp's m16 tile ``mt``,
at row ``16·mt + g + 8·(e // 2)`` and column ``8·nt + 2t + e % 2`` of the warp's
block (``g = lane // 4``, ``t = lane % 4``); the output accumulator
``acc[mt, dt, e]`` is laid out alike. So each lane carries two rows per m16
tile, and its row statistics ``m_i``, ``l_i`` (and rescaling factors ``alpha``) have ``2 · warp_m`` entries
(row ``r = 2·mt + half`` holds entries ``2·half`` and ``2·half + 1``).
"""

import functools
import math

import numpy as np
from numba import float32

from .._cuda import cuda
from .constants import LN2_F32
from .ptx import ballot, ex2_approx, pack_bf16x2, pack_f16x2, shfl_xor_f32, st_shared_v2_f32
from .score_mods import NO_MODS, softcapped
from .tiles import NARROW

_NEG_INF = np.float32(-np.inf)
_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)
RESCALE = np.float32(8.0)  # log2 headroom before the softmax reference max must move (lazy rescaling)
EAGER = np.float32(0.0)  # no headroom: the reference max is the running max


@cuda.jit(device=True, forceinline=True)
def quad_sum(x):
    """The sum of ``x`` over the four lanes of an mma lane group (lanes 4g .. 4g + 3): a row's total
    when each lane holds a partial sum of its columns."""
    x += shfl_xor_f32(x, 1)
    return x + shfl_xor_f32(x, 2)


@cuda.jit(device=True, forceinline=True)
def seed_sink(m_i, l_i, sink_log2, t):
    """Start every row's softmax from an attention sink of logit ``sink_log2`` (log2 domain): a term of
    the sum with no value row, counted once per lane group (``l_i`` holds lane partials)."""
    for r in range(m_i.shape[0]):
        m_i[r] = sink_log2
        l_i[r] = _ONE if t == 0 else _ZERO


@functools.lru_cache(maxsize=None)
def softmax_steps(warp_m, ntiles, dtiles, causal, dtype, headroom=RESCALE, mods=NO_MODS, fold_scale=False):
    """Device functions ``(init, scale_and_mask, update, rescale, normalize, store)`` for one tile shape.

    ``warp_m`` m16 tiles per warp, ``ntiles`` n8 score tiles per key tile,
    ``dtiles`` n8 output tiles, ``dtype`` the output element type; ``headroom`` (log2) how far a
    row's max may exceed the softmax's reference max before the reference moves (0: eager rescaling);
    ``mods`` the score modifications (``score_mods.py``) that ``scale_and_mask`` applies; ``fold_scale``:
    a positive scale of a tile that takes nothing else folds into ``update``'s exponent (one multiply
    less per score, a register more).
    """
    WARP_M, NTILES, DTILES, CAUSAL, FOLD_SCALE = warp_m, ntiles, dtiles, causal, fold_scale
    WINDOW, SOFTCAP, ALIBI, ELEMENTWISE = mods.window, mods.softcap, mods.alibi, mods.elementwise
    HEADROOM = np.float32(headroom)
    CHAINS = min(4, ntiles)  # partial maxima and sums per row
    narrow = NARROW[dtype]

    @cuda.jit(device=True, forceinline=True)
    def init(m_i, l_i, acc):
        """No key seen yet: m = -inf, l = 0, acc = 0."""
        for r in range(2 * WARP_M):
            m_i[r] = _NEG_INF
            l_i[r] = _ZERO
        for mt in range(WARP_M):
            for dt in range(DTILES):
                for e in range(4):
                    acc[mt, dt, e] = _ZERO

    @cuda.jit(device=True, forceinline=True)
    def modified(x, scale_log2, distance, terms):
        """A raw score into the log2 domain: scaled, softcapped, less ALiBi's bias for a query and a key
        ``distance`` (float32) apart; ``terms`` are ``(left, right, cap_log2, cap_slope, slope_log2)``."""
        x *= scale_log2
        if SOFTCAP:
            x = softcapped(x, terms[2], terms[3])
        if ALIBI:
            x -= terms[4] * distance
        return x

    @cuda.jit(device=True, forceinline=True)
    def scale_and_mask(s, scale_log2, masked, row0, n0, seqlen_kv, diagonal, g, t, terms):
        """Scores into the log2 domain, modified by ``terms`` (see ``modified``); when ``masked``, keys past
        the end, the causal diagonal or the window get -inf. Returns the factor that ``update`` must still
        apply: under ``fold_scale``, ``scale_log2`` where a positive scale is all there is to apply (the
        scores then keep their values), 1 otherwise.

        ``row0`` is the query row of the warp's first row, ``n0`` the key of the tile's first column.
        """
        # ALiBi's distances in float32 from one converted offset (64-bit integer arithmetic per score costs
        # more than the rest of the pass): lane row r = 16 mt + 8 half, column c = 8 nt + e2 sit at
        # |offset + r - c| (exact below 2**24 keys)
        offset = float32(row0 + g + diagonal) - float32(n0 + 2 * t)
        # Two separate passes: with the mask test inside the unmasked pass, the compiler
        # turns it into predicated code that every key tile executes.
        if masked and WINDOW:  # each row's first and last visible key, then one test per score
            for mt in range(WARP_M):
                for half in range(2):
                    position = row0 + 16 * mt + g + 8 * half + diagonal
                    first = position - terms[0]
                    last = min(position + terms[1], seqlen_kv - 1)
                    if CAUSAL:
                        last = min(last, position)
                    for nt in range(NTILES):
                        for e2 in range(2):
                            col = n0 + 8 * nt + 2 * t + e2
                            distance = abs(offset + float32(16 * mt + 8 * half - 8 * nt - e2))
                            x = s[mt, nt, 2 * half + e2]
                            s[mt, nt, 2 * half + e2] = (modified(x, scale_log2, distance, terms)
                                                        if first <= col <= last else _NEG_INF)
        elif masked:
            for mt in range(WARP_M):
                for nt in range(NTILES):
                    for e in range(4):
                        row = row0 + 16 * mt + g + 8 * (e // 2)
                        col = n0 + 8 * nt + 2 * t + e % 2
                        visible = col < seqlen_kv and not (CAUSAL and col > row + diagonal)
                        distance = abs(offset + float32(16 * mt + 8 * (e // 2) - 8 * nt - e % 2))
                        s[mt, nt, e] = modified(s[mt, nt, e], scale_log2, distance, terms) if visible else _NEG_INF
        elif ELEMENTWISE:
            for mt in range(WARP_M):
                for nt in range(NTILES):
                    for e in range(4):
                        distance = abs(offset + float32(16 * mt + 8 * (e // 2) - 8 * nt - e % 2))
                        s[mt, nt, e] = modified(s[mt, nt, e], scale_log2, distance, terms)
        elif FOLD_SCALE and scale_log2 > _ZERO:
            return scale_log2
        else:
            for mt in range(WARP_M):
                for nt in range(NTILES):
                    for e in range(4):
                        s[mt, nt, e] *= scale_log2
        return _ONE

    @cuda.jit(device=True, forceinline=True)
    def update(s, m_i, l_i, row_max, alpha, factor):
        """Fold a key tile's scores, times ``factor`` (positive), into the running softmax; ``s`` becomes P
        (unnormalised).

        Returns whether the output accumulator must be rescaled by ``alpha``
        (one factor per lane row) before this tile's ``P V`` is added.
        Lazy rescaling: the reference max ``m_i`` moves only when a row's max
        exceeds it by more than ``headroom`` (P then stays below 2**headroom), and
        the warp decides together, so most key tiles skip rescaling. With no headroom
        (``EAGER``) the reference is the running max and a row's largest P is exactly 1;
        lazily, the dominant P are rounded when P is packed to 16 bits for ``P V``, which
        costs bf16 outputs a few percent of accuracy (see benchmarks, MLA decode).
        """
        grow = False
        partial = cuda.local.array(CHAINS, float32)  # independent chains keep the reductions short
        for mt in range(WARP_M):
            for half in range(2):
                r = 2 * mt + half
                for c in range(CHAINS):
                    partial[c] = _NEG_INF
                for nt in range(NTILES):
                    partial[nt % CHAINS] = max(partial[nt % CHAINS], max(s[mt, nt, 2 * half], s[mt, nt, 2 * half + 1]))
                m_tile = partial[0]
                for c in range(1, CHAINS):
                    m_tile = max(m_tile, partial[c])
                m_tile = max(m_tile, shfl_xor_f32(m_tile, 1))
                m_tile = max(m_tile, shfl_xor_f32(m_tile, 2))
                row_max[r] = m_tile * factor
                grow = grow or row_max[r] > m_i[r] + HEADROOM
        rescale = ballot(grow) != 0
        if rescale:
            for r in range(2 * WARP_M):
                m_new = max(m_i[r], row_max[r])
                # a row with no visible key yet keeps m = -inf; exp2 against 0 then gives 0
                alpha[r] = ex2_approx(m_i[r] - (m_new if m_new != _NEG_INF else _ZERO))
                m_i[r] = m_new
                l_i[r] *= alpha[r]
        for mt in range(WARP_M):
            for half in range(2):
                r = 2 * mt + half
                m_ref = m_i[r] if m_i[r] != _NEG_INF else _ZERO
                for c in range(CHAINS):
                    partial[c] = _ZERO
                for nt in range(NTILES):
                    p0 = ex2_approx(s[mt, nt, 2 * half] * factor - m_ref)
                    p1 = ex2_approx(s[mt, nt, 2 * half + 1] * factor - m_ref)
                    partial[nt % CHAINS] += p0 + p1
                    s[mt, nt, 2 * half] = p0
                    s[mt, nt, 2 * half + 1] = p1
                for c in range(CHAINS):
                    l_i[r] += partial[c]
        return rescale

    @cuda.jit(device=True, forceinline=True)
    def rescale(acc, alpha):
        """Scale each row of the output accumulator by its ``alpha``."""
        for mt in range(WARP_M):
            for dt in range(DTILES):
                for e in range(4):
                    acc[mt, dt, e] *= alpha[2 * mt + e // 2]

    @cuda.jit(device=True, forceinline=True)
    def normalize(acc, m_i, l_i, lse, write_lse, b, h, row0, seqlen_q, g, t):
        """Full row sums across the four lanes of a group, then ``acc /= l`` (and the LSE for rows below ``seqlen_q``).

        A row without a visible key (``l = 0``) gets 0 and an LSE of -inf. A NaN score makes ``l`` NaN
        (through ``exp2``, whether or not the running max took it), and so the row's output and LSE.
        """
        for mt in range(WARP_M):
            for half in range(2):
                r = 2 * mt + half
                l_sum = quad_sum(l_i[r])
                inv_l = _ONE / l_sum if l_sum != _ZERO else _ZERO
                for dt in range(DTILES):
                    acc[mt, dt, 2 * half] *= inv_l
                    acc[mt, dt, 2 * half + 1] *= inv_l
                row = row0 + 16 * mt + g + 8 * half
                if write_lse and t == 0 and row < seqlen_q:
                    lse[b, h, row] = (m_i[r] + math.log2(l_sum)) * LN2_F32 if l_sum != _ZERO else _NEG_INF

    @cuda.jit(device=True, forceinline=True)
    def store(o, acc, b, h, row0, seqlen_q, g, t):
        """The normalized accumulator into ``o``, rows below ``seqlen_q``."""
        for mt in range(WARP_M):
            for half in range(2):
                row = row0 + 16 * mt + g + 8 * half
                if row < seqlen_q:
                    for dt in range(DTILES):
                        col = 8 * dt + 2 * t
                        o[b, h, row, col] = narrow(acc[mt, dt, 2 * half])
                        o[b, h, row, col + 1] = narrow(acc[mt, dt, 2 * half + 1])

    return init, scale_and_mask, update, rescale, normalize, store


@functools.lru_cache(maxsize=None)
def partial_store(warp_m, dtiles, staged=False):
    """Device function ``store_partial(o_part, lse_part, acc, m_i, l_i, b, h, row0, seqlen_q, split, g, t)``:
    a split's result for rows below ``seqlen_q``: ``acc / l`` into ``o_part[b, h, row, split]`` (float32)
    and the log2-domain ``m + log2(l)`` into ``lse_part[b, h, row, split]`` (-inf where the split saw no key,
    NaN where it saw a NaN score, as in ``normalize``).

    ``staged``: into shared float32 tiles for a cluster's merge instead, ``o_part[row]`` and
    ``lse_part[0, row]`` (``row`` counted from 0 at the block's first row; ``b``, ``h``, ``split`` unused),
    rows 8-byte aligned."""
    WARP_M, DTILES, STAGED = warp_m, dtiles, staged

    @cuda.jit(device=True, forceinline=True)
    def store_partial(o_part, lse_part, acc, m_i, l_i, b, h, row0, seqlen_q, split, g, t):
        for mt in range(WARP_M):
            for half in range(2):
                r = 2 * mt + half
                l_sum = quad_sum(l_i[r])
                inv_l = _ONE / l_sum if l_sum != _ZERO else _ZERO
                row = row0 + 16 * mt + g + 8 * half
                log = m_i[r] + math.log2(l_sum) if l_sum != _ZERO else _NEG_INF
                if STAGED:
                    for dt in range(DTILES):
                        st_shared_v2_f32(o_part, row, 8 * dt + 2 * t, acc[mt, dt, 2 * half] * inv_l,
                                         acc[mt, dt, 2 * half + 1] * inv_l)
                    if t == 0:
                        lse_part[0, row] = log
                elif row < seqlen_q:
                    for dt in range(DTILES):
                        col = 8 * dt + 2 * t
                        o_part[b, h, row, split, col] = acc[mt, dt, 2 * half] * inv_l
                        o_part[b, h, row, split, col + 1] = acc[mt, dt, 2 * half + 1] * inv_l
                    if t == 0:
                        lse_part[b, h, row, split] = log

    return store_partial


@functools.lru_cache(maxsize=None)
def p_fragments(psteps, dtype):
    """Device function ``pack_p(p_frag, s)``: a warp's P (``s`` after ``update``, one m16 tile of
    ``2 · psteps`` n8 tiles) as the 16-bit A fragments of ``psteps`` k-steps, ``p_frag[kk, 0..3]``:
    the accumulator tiles 2kk and 2kk + 1 make k-step kk's fragment."""
    PSTEPS = psteps
    pack = pack_bf16x2 if dtype == "bfloat16" else pack_f16x2

    @cuda.jit(device=True, forceinline=True)
    def pack_p(p_frag, s):
        for kk in range(PSTEPS):
            n = 2 * kk
            p_frag[kk, 0] = pack(s[0, n, 0], s[0, n, 1])
            p_frag[kk, 1] = pack(s[0, n, 2], s[0, n, 3])
            p_frag[kk, 2] = pack(s[0, n + 1, 0], s[0, n + 1, 1])
            p_frag[kk, 3] = pack(s[0, n + 1, 2], s[0, n + 1, 3])

    return pack_p
