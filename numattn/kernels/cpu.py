"""Attention kernels for the CPU: numba's CPU JIT (``njit``, ``prange``), float32 throughout.

The forward kernel is FlashAttention's tiled online softmax. A work item owns
up to ``BLOCK_M`` query rows of one KV head and streams its keys in tiles of
``BLOCK_N``. For each tile it computes the scores ``S = scale · Q Kᵀ`` and
folds them into each row's running max ``m_i``, running sum ``l_i`` and output
accumulator ``acc``:

    m_new = max(m_i, max_j S_ij),  acc ← acc · exp(m_i − m_new) + Σ_j exp(S_ij − m_new) V_j,
    l_i ← l_i · exp(m_i − m_new) + Σ_j exp(S_ij − m_new),  m_i ← m_new,

and at the end writes ``o = acc / l_i`` and ``lse = m_i + log l_i``. The rows of a
KV head are its query heads' rows, head after head (``[batch, heads_kv,
group · seqlen_q, D]``, a view of the query), so all heads of a GQA group share
each K/V tile. Row ``r`` is query token ``r % seqlen_q`` and, bottom-right
aligned, sees the first ``r % seqlen_q + n − seqlen_q + 1`` of the ``n`` keys
when causal; a tile's masked keys are never read, since the keys a row sees
are a prefix.

One kernel serves the forward pass, paged decode and MLA decode: keys are
looked up through a page table (a contiguous cache is one page per sequence)
and a key is the concatenation ``[k_a | k_b]`` (``k_b`` empty, or MLA's rope
part with the latent ``k_a`` also the value). The backward pass is
FlashAttention-2's: one kernel, a work item per (KV head, key tile),
accumulates ``dk`` and ``dv`` over the group's query rows, another, a work item
per (KV head, row tile), accumulates ``dq``; both recompute
``P = exp(S − lse)`` and take ``delta = rowsum(dO ∘ O)`` from the host.

Every output element is computed by one thread in a fixed order (key tiles
from 0, the head dim in order), so results do not depend on the thread count
or on how rows are divided into work items. Only fused multiply-add is
allowed of fast math: NaN and inf follow IEEE arithmetic. A NaN score makes
its row's ``m_i`` NaN, so that it reaches ``o`` and ``lse`` instead of passing
for -inf, the mark of a row that saw no key (``o = 0``, ``lse = -inf``); a
+inf score gives ``exp(inf − inf)``, NaN, as float64 math does.
"""

import math

import numba
import numpy as np
from numba import njit, prange

BLOCK_M = 64  # query rows per work item (fewer where that would leave threads idle)
BLOCK_N = 64  # keys per tile
_FASTMATH = {"contract"}  # fused multiply-add only: no reassociation, NaN and inf kept
_NEG_INF = np.float32(-np.inf)
_INF = np.float32(np.inf)
_NAN = np.float32(np.nan)
_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)
_NO_BOUND = 2**62  # a window side without a bound
_NO_MODS = (_NO_BOUND, _NO_BOUND, _ZERO)  # _attend's (left, right, cap) without a window or softcap


# --------------------------------------------------------------------------
# Tile steps shared by the kernels
# --------------------------------------------------------------------------

@njit(cache=True, fastmath=_FASTMATH)
def _scores(x, y_t, cols, scale, s):
    """``s[r, c] = scale · Σ_d x[r, d] y_t[d, c]`` for every row of ``x`` ``[rows, D]`` and the first
    ``cols`` columns of the transposed tile ``y_t`` ``[D, BLOCK_N]`` (the inner loop runs over
    independent columns, so it vectorises without reassociating sums)."""
    for r in range(x.shape[0]):
        for c in range(cols):
            s[r, c] = _ZERO
        for d in range(x.shape[1]):
            x_rd = x[r, d]
            for c in range(cols):
                s[r, c] += x_rd * y_t[d, c]
        for c in range(cols):
            s[r, c] *= scale


@njit(cache=True)
def _keys_seen(lo, hi, r0, n, seqlen_q, causal, left, right):
    """``lo[r] .. hi[r]``: the keys among ``n`` that row ``r0 + r`` sees, those ``j`` with
    ``i − left <= j <= i + right`` (and ``j <= i`` when ``causal``) for the row's position ``i`` among the
    keys; returns ``(first, end)``, the span of them all (``end <= first`` when no row sees a key)."""
    first, end = n, 0
    for r in range(lo.shape[0]):
        i = (r0 + r) % seqlen_q + n - seqlen_q
        lo[r] = max(0, i - left)
        hi[r] = max(lo[r], min(n, (min(right, 0) if causal else right) + i + 1))
        if hi[r] > lo[r]:
            first, end = min(first, lo[r]), max(end, hi[r])
    return first, end


@njit(cache=True)
def _visible(lo, hi, n0, cols, c_lo, c_hi):
    """``c_lo[r] .. c_hi[r]``: the columns of the ``cols`` keys from key ``n0`` that row ``r`` sees; returns
    their total."""
    total = 0
    for r in range(lo.shape[0]):
        c_lo[r] = min(max(lo[r] - n0, 0), cols)
        c_hi[r] = max(min(hi[r] - n0, cols), c_lo[r])
        total += c_hi[r] - c_lo[r]
    return total


@njit(cache=True, fastmath=_FASTMATH)
def _modify(s, c_lo, c_hi, positions, n0, cap, slopes, derivative):
    """The visible scores ``s[r, c_lo[r] .. c_hi[r]]`` of keys from ``n0``: ``cap · tanh(s / cap)`` when
    ``cap > 0``, then ``− slopes[r] · |i − j|`` when ``slopes`` has rows (``i = positions[r]``); where
    ``derivative`` has rows, the softcap's derivative ``1 − tanh²`` into it."""
    for r in range(s.shape[0]):
        for c in range(c_lo[r], c_hi[r]):
            x = s[r, c]
            if cap > _ZERO:
                tanh = math.tanh(x / cap)
                x = cap * tanh
                if derivative.shape[0]:
                    derivative[r, c] = _ONE - tanh * tanh
            if slopes.shape[0]:
                x -= slopes[r] * abs(positions[r] - (n0 + c))
            s[r, c] = x


@njit(cache=True, fastmath=_FASTMATH)
def _fold_tile(s, c_lo, c_hi, v_tile, m_i, l_i, acc):
    """Fold row ``r``'s scores ``s[r, c_lo[r] .. c_hi[r]]`` with values ``v_tile`` ``[BLOCK_N, Dv]``
    into its online softmax ``(m_i[r], l_i[r], acc[r])``."""
    for r in range(m_i.shape[0]):
        m_new = m_i[r]
        for c in range(c_lo[r], c_hi[r]):
            if s[r, c] > m_new or s[r, c] != s[r, c]:  # a NaN sticks, to reach o and lse
                m_new = s[r, c]
        if m_new == _NEG_INF:  # no key, or only -inf scores, so far: nothing to add
            continue
        alpha = math.exp(m_i[r] - m_new)
        l = l_i[r] * alpha
        for e in range(acc.shape[1]):
            acc[r, e] *= alpha
        for c in range(c_lo[r], c_hi[r]):
            p = math.exp(s[r, c] - m_new)
            l += p
            for e in range(acc.shape[1]):
                acc[r, e] += p * v_tile[c, e]
        m_i[r] = m_new
        l_i[r] = l


@njit(cache=True, fastmath=_FASTMATH)
def _probabilities_and_grads(s, dp, c_lo, c_hi, lse, delta, derivative):
    """In place, for row ``r``'s keys ``c_lo[r] .. c_hi[r]``: scores ``s`` become ``P = exp(s − lse[r])``
    and ``dP`` becomes ``dS = P (dP − delta[r])``, times ``derivative`` (the softcap's) where it has rows."""
    for r in range(c_lo.shape[0]):
        for c in range(c_lo[r], c_hi[r]):
            p = math.exp(s[r, c] - lse[r])
            s[r, c] = p
            dp[r, c] = p * (dp[r, c] - delta[r])
            if derivative.shape[0]:
                dp[r, c] *= derivative[r, c]


@njit(cache=True, fastmath=_FASTMATH)
def _modified_gradients(s, dp, derivative, c_lo, c_hi, r0, n0, seqlen_q, seqlen_kv, cap, slopes, b, h, lse, delta):
    """The backward's step on a tile of raw scores ``s`` and ``dP`` of rows ``r0 ..`` and keys ``n0 ..``: the
    forward's softcap and ALiBi bias (``slopes`` ``[batch, heads_kv, rows]``, empty when unused), then P and dS
    (through the softcap's derivative) as ``_probabilities_and_grads``."""
    row_slopes = slopes[b, h, r0 : r0 + s.shape[0]] if slopes.shape[0] else slopes[0, 0, :0]
    if cap > _ZERO or row_slopes.shape[0]:
        positions = np.empty(s.shape[0], np.int64)
        for r in range(s.shape[0]):
            positions[r] = (r0 + r) % seqlen_q + seqlen_kv - seqlen_q
        _modify(s, c_lo, c_hi, positions, n0, cap, row_slopes, derivative)
    _probabilities_and_grads(s, dp, c_lo, c_hi, lse, delta, derivative)


@njit(cache=True)
def _transpose(src, cols, dst):
    """``dst[d, c] = src[c, d]`` for the first ``cols`` rows of ``src``."""
    for c in range(cols):
        for d in range(src.shape[1]):
            dst[d, c] = src[c, d]


# --------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------

@njit(cache=True)
def _work_item(item, heads_kv, tiles):
    """``(b, h, tile)`` of work item ``item``. Within a KV head the tiles go 0, n−1, 1, n−2, …: prange
    gives each thread an equal run of items, and so each run mixes short and long causal rows."""
    j = item % tiles
    return item // (heads_kv * tiles), item // tiles % heads_kv, j // 2 if j % 2 == 0 else tiles - 1 - j // 2


@njit(cache=True)
def _gather_tile(k_a, k_b, v, page_table, b, h, n0, cols, k_t, v_tile):
    """Keys ``n0 .. n0 + cols`` of sequence ``b``, KV head ``h``: ``[k_a | k_b]`` transposed into ``k_t``,
    values into ``v_tile``. Page indices are clamped into the page array."""
    page_size, last_page, dim_a = k_a.shape[2], k_a.shape[0] - 1, k_a.shape[3]
    for c in range(cols):
        t = n0 + c
        page = min(max(page_table[b, t // page_size], 0), last_page)
        slot = t % page_size
        for d in range(dim_a):
            k_t[d, c] = k_a[page, h, slot, d]
        for d in range(k_b.shape[3]):
            k_t[dim_a + d, c] = k_b[page, h, slot, d]
        for e in range(v.shape[3]):
            v_tile[c, e] = v[page, h, slot, e]


@njit(parallel=True, cache=True, fastmath=_FASTMATH)
def _attend(q_a, q_b, k_a, k_b, v, page_table, seqlens, scale, causal, mods, slopes, sinks, seqlen_q, row_chunk, o,
            lse):
    """Forward attention of query rows ``[q_a | q_b]`` ``[batch, heads_kv, rows, D_a + D_b]`` over paged keys
    ``[k_a | k_b]`` ``[num_pages, heads_kv, page_size, D_a + D_b]`` and values ``v``; writes ``o``
    ``[batch, heads_kv, rows, Dv]`` and ``lse`` ``[batch, heads_kv, rows]``. Work items of ``row_chunk`` rows.
    ``mods`` is ``(left, right, cap)``: the window's sides and the softcap (0: none); ``slopes``
    ``[batch, heads_kv, rows]`` the rows' ALiBi slopes and ``sinks`` ``[heads_kv, rows]`` their sinks'
    logits (each empty when unused)."""
    left, right, cap = mods
    batch, heads_kv, rows_all, dim_a = q_a.shape
    head_dim, head_dim_v = dim_a + q_b.shape[3], v.shape[3]
    capacity = page_table.shape[1] * k_a.shape[2] if k_a.shape[0] > 0 else 0
    chunks = -(-rows_all // row_chunk)
    for item in prange(batch * heads_kv * chunks):
        b, h, chunk = _work_item(item, heads_kv, chunks)
        r0 = chunk * row_chunk
        rows = min(row_chunk, rows_all - r0)
        q_rows = np.empty((rows, head_dim), np.float32)
        for r in range(rows):
            for d in range(dim_a):
                q_rows[r, d] = q_a[b, h, r0 + r, d]
            for d in range(head_dim - dim_a):
                q_rows[r, dim_a + d] = q_b[b, h, r0 + r, d]
        lo, hi = np.empty(rows, np.int64), np.empty(rows, np.int64)
        c_lo, c_hi = np.empty(rows, np.int64), np.empty(rows, np.int64)
        n = min(max(seqlens[b], 0), capacity)
        first, end = _keys_seen(lo, hi, r0, n, seqlen_q, causal, left, right)
        positions = np.empty(rows, np.int64)
        for r in range(rows):
            positions[r] = (r0 + r) % seqlen_q + n - seqlen_q
        row_slopes = slopes[b, h, r0 : r0 + rows] if slopes.shape[0] else slopes[0, 0, :0]
        k_t, v_tile = np.empty((head_dim, BLOCK_N), np.float32), np.empty((BLOCK_N, head_dim_v), np.float32)
        s = np.empty((rows, BLOCK_N), np.float32)
        m_i, l_i = np.full(rows, _NEG_INF, np.float32), np.zeros(rows, np.float32)
        if sinks.shape[0]:  # a sink is a term of the sum with no value
            m_i[:] = sinks[h, r0 : r0 + rows]
            l_i[:] = _ONE
        acc = np.zeros((rows, head_dim_v), np.float32)
        for n0 in range(first, end, BLOCK_N):
            cols = min(BLOCK_N, end - n0)
            _visible(lo, hi, n0, cols, c_lo, c_hi)
            _gather_tile(k_a, k_b, v, page_table, b, h, n0, cols, k_t, v_tile)
            _scores(q_rows, k_t, cols, scale, s)
            if cap > _ZERO or row_slopes.shape[0]:
                _modify(s, c_lo, c_hi, positions, n0, cap, row_slopes, s[:0])
            _fold_tile(s, c_lo, c_hi, v_tile, m_i, l_i, acc)
        for r in range(rows):
            if m_i[r] == _NEG_INF:
                lse[b, h, r0 + r] = _NEG_INF
                for e in range(head_dim_v):
                    o[b, h, r0 + r, e] = _ZERO
            else:
                lse[b, h, r0 + r] = m_i[r] + math.log(l_i[r])
                for e in range(head_dim_v):
                    o[b, h, r0 + r, e] = acc[r, e] / l_i[r]


@njit(cache=True)
def _keys_seen_by_rows(lo, hi, r0, lse, seqlen_kv, seqlen_q, causal, left, right):
    """``_keys_seen`` for the backward pass: rows with ``lse`` -inf saw no key and see none here."""
    _keys_seen(lo, hi, r0, seqlen_kv, seqlen_q, causal, left, right)
    first, end = seqlen_kv, 0
    for r in range(lo.shape[0]):
        if lse[r0 + r] == _NEG_INF:
            hi[r] = lo[r]
        if hi[r] > lo[r]:
            first, end = min(first, lo[r]), max(end, hi[r])
    return first, end


@njit(parallel=True, cache=True, fastmath=_FASTMATH)
def _backward_kv(q, k, v, do, lse, delta, scale, causal, mods, slopes, seqlen_q, dk, dv):
    """``dk``, ``dv`` ``[batch, heads_kv, seqlen_kv, D / Dv]``: one work item per (KV head, key tile), over
    all rows of ``q``, ``do`` ``[batch, heads_kv, rows, D / Dv]`` (``lse``, ``delta`` ``[batch, heads_kv, rows]``),
    with the score modifications ``mods`` and ``slopes`` of ``_attend``."""
    left, right, cap = mods
    batch, heads_kv, rows_all, head_dim = q.shape
    seqlen_kv, head_dim_v = k.shape[2], v.shape[3]
    tiles = -(-seqlen_kv // BLOCK_N)
    for item in prange(batch * heads_kv * tiles):
        b, h, tile = _work_item(item, heads_kv, tiles)
        n0 = tile * BLOCK_N
        cols = min(BLOCK_N, seqlen_kv - n0)
        k_t, v_t = np.empty((head_dim, BLOCK_N), np.float32), np.empty((head_dim_v, BLOCK_N), np.float32)
        _transpose(k[b, h, n0:], cols, k_t)
        _transpose(v[b, h, n0:], cols, v_t)
        dk_acc, dv_acc = np.zeros((cols, head_dim), np.float32), np.zeros((cols, head_dim_v), np.float32)
        lo, hi = np.empty(BLOCK_M, np.int64), np.empty(BLOCK_M, np.int64)
        c_lo, c_hi = np.empty(BLOCK_M, np.int64), np.empty(BLOCK_M, np.int64)
        s, dp = np.empty((BLOCK_M, BLOCK_N), np.float32), np.empty((BLOCK_M, BLOCK_N), np.float32)
        derivative = np.empty((BLOCK_M if cap > _ZERO else 0, BLOCK_N), np.float32)
        for r0 in range(0, rows_all, BLOCK_M):
            rows = min(BLOCK_M, rows_all - r0)
            _keys_seen_by_rows(lo[:rows], hi[:rows], r0, lse[b, h], seqlen_kv, seqlen_q, causal, left, right)
            if _visible(lo[:rows], hi[:rows], n0, cols, c_lo[:rows], c_hi[:rows]) == 0:
                continue
            q_rows, do_rows = q[b, h, r0 : r0 + rows], do[b, h, r0 : r0 + rows]
            _scores(q_rows, k_t, cols, scale, s)
            _scores(do_rows, v_t, cols, _ONE, dp)
            _modified_gradients(s[:rows], dp[:rows], derivative[:rows], c_lo[:rows], c_hi[:rows], r0, n0, seqlen_q,
                                seqlen_kv, cap, slopes, b, h, lse[b, h, r0:], delta[b, h, r0:])
            for r in range(rows):
                for c in range(c_lo[r], c_hi[r]):
                    for e in range(head_dim_v):
                        dv_acc[c, e] += s[r, c] * do_rows[r, e]
                    for d in range(head_dim):
                        dk_acc[c, d] += dp[r, c] * q_rows[r, d]
        for c in range(cols):
            for d in range(head_dim):
                dk[b, h, n0 + c, d] = scale * dk_acc[c, d]
            for e in range(head_dim_v):
                dv[b, h, n0 + c, e] = dv_acc[c, e]


@njit(parallel=True, cache=True, fastmath=_FASTMATH)
def _backward_q(q, k, v, do, lse, delta, scale, causal, mods, slopes, seqlen_q, dq):
    """``dq`` ``[batch, heads_kv, rows, D]`` (arguments as ``_backward_kv``): one work item per
    (KV head, ``BLOCK_M`` rows), over the keys they see."""
    left, right, cap = mods
    batch, heads_kv, rows_all, head_dim = q.shape
    seqlen_kv, head_dim_v = k.shape[2], v.shape[3]
    chunks = -(-rows_all // BLOCK_M)
    for item in prange(batch * heads_kv * chunks):
        b, h, chunk = _work_item(item, heads_kv, chunks)
        r0 = chunk * BLOCK_M
        rows = min(BLOCK_M, rows_all - r0)
        lo, hi = np.empty(rows, np.int64), np.empty(rows, np.int64)
        c_lo, c_hi = np.empty(rows, np.int64), np.empty(rows, np.int64)
        first, end = _keys_seen_by_rows(lo, hi, r0, lse[b, h], seqlen_kv, seqlen_q, causal, left, right)
        k_t, v_t = np.empty((head_dim, BLOCK_N), np.float32), np.empty((head_dim_v, BLOCK_N), np.float32)
        s, dp = np.empty((rows, BLOCK_N), np.float32), np.empty((rows, BLOCK_N), np.float32)
        derivative = np.empty((rows if cap > _ZERO else 0, BLOCK_N), np.float32)
        dq_acc = np.zeros((rows, head_dim), np.float32)
        q_rows, do_rows = q[b, h, r0 : r0 + rows], do[b, h, r0 : r0 + rows]
        for n0 in range(first, end, BLOCK_N):
            cols = min(BLOCK_N, end - n0)
            _visible(lo, hi, n0, cols, c_lo, c_hi)
            _transpose(k[b, h, n0:], cols, k_t)
            _transpose(v[b, h, n0:], cols, v_t)
            _scores(q_rows, k_t, cols, scale, s)
            _scores(do_rows, v_t, cols, _ONE, dp)
            _modified_gradients(s, dp, derivative, c_lo, c_hi, r0, n0, seqlen_q, seqlen_kv, cap, slopes, b, h,
                                lse[b, h, r0:], delta[b, h, r0:])
            for r in range(rows):
                for c in range(c_lo[r], c_hi[r]):
                    for d in range(head_dim):
                        dq_acc[r, d] += dp[r, c] * k[b, h, n0 + c, d]
        for r in range(rows):
            for d in range(head_dim):
                dq[b, h, r0 + r, d] = scale * dq_acc[r, d]


@njit(parallel=True, cache=True, fastmath=_FASTMATH)
def _merge(o_a, lse_a, o_b, lse_b, o, lse):
    """``merge_states`` on flat rows."""
    for row in prange(o.shape[0]):
        la, lb = lse_a[row], lse_b[row]
        if la != la or lb != lb or la == _INF or lb == _INF:
            lse[row] = _NAN
            for e in range(o.shape[1]):
                o[row, e] = _NAN
        elif la == _NEG_INF and lb == _NEG_INF:
            lse[row] = _NEG_INF
            for e in range(o.shape[1]):
                o[row, e] = _ZERO
        else:
            total = max(la, lb) + math.log1p(math.exp(-abs(la - lb)))
            wa, wb = math.exp(la - total), math.exp(lb - total)
            lse[row] = total
            for e in range(o.shape[1]):  # a side that saw no key is not read
                o[row, e] = ((o_a[row, e] * wa if la != _NEG_INF else _ZERO)
                             + (o_b[row, e] * wb if lb != _NEG_INF else _ZERO))


# --------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------

def _host(x, dtype=np.float32):
    """``x`` as the one array type the kernels are compiled for: C-contiguous, aligned and writeable
    (numba types read-only arrays apart; those are copied)."""
    return np.require(x, dtype, "CAW")


def _require(condition, message):
    if not condition:
        raise ValueError(message)


def _row_chunk(rows, outer):
    """Rows per work item of ``_attend``: ``BLOCK_M``, or fewer where there would be fewer than two
    work items per thread (the results do not depend on it)."""
    return max(1, min(BLOCK_M, -(-rows * outer // (2 * numba.get_num_threads()))))


def _paged_attention(q, q_pe, k_pages, kpe_pages, v_pages, page_table, seqlens, scale, causal, mods=_NO_MODS,
                     slopes=None, sinks=None):
    """``(o, lse)`` of ``_attend`` for ``q``, ``q_pe`` ``[batch, heads_q, seqlen_q, D]`` and pages
    ``[num_pages, heads_kv, page_size, D]``; query head ``h`` reads KV head ``h // group``. ``mods``, and
    ``slopes`` ``[batch, heads_q]`` and ``sinks`` ``[heads_q]`` (None: unused), as ``_attend`` takes them."""
    batch, heads_q, seqlen_q, head_dim = q.shape
    num_pages, heads_kv, page_size, head_dim_v = v_pages.shape
    _require(heads_kv > 0 and heads_q % heads_kv == 0, f"heads_q {heads_q} is not a multiple of heads_kv {heads_kv}")
    _require(k_pages.shape[:3] == v_pages.shape[:3] == kpe_pages.shape[:3] and k_pages.shape[3] == head_dim
             and q_pe.shape[:3] == q.shape[:3] and q_pe.shape[3] == kpe_pages.shape[3],
             "inconsistent shapes of queries, keys and values")
    _require(page_table.ndim == 2 and page_table.shape[0] == batch and seqlens.shape == (batch,),
             "page_table must be [batch, max_pages] and seqlens [batch]")
    rows = heads_q // heads_kv * seqlen_q

    slopes = (np.empty((0, 0, 0), np.float32) if slopes is None
              else _per_row(np.broadcast_to(_host(slopes), (batch, heads_q)), heads_kv, seqlen_q))
    sinks = np.empty((0, 0), np.float32) if sinks is None else _per_row(_host(sinks), heads_kv, seqlen_q)
    o = np.empty((batch, heads_q, seqlen_q, head_dim_v), np.float32)
    lse = np.empty((batch, heads_q, seqlen_q), np.float32)
    left, right, cap = mods
    _attend(q.reshape(batch, heads_kv, rows, head_dim), q_pe.reshape(batch, heads_kv, rows, q_pe.shape[3]),
            k_pages, kpe_pages, v_pages, page_table, seqlens, np.float32(scale), bool(causal),
            (int(left), int(right), np.float32(cap)), slopes, sinks, seqlen_q, _row_chunk(rows, batch * heads_kv),
            o.reshape(batch, heads_kv, rows, head_dim_v), lse.reshape(batch, heads_kv, rows))
    return o, lse


def _per_row(x, heads_kv, seqlen_q):
    """``[..., heads_q]`` values as ``[..., heads_kv, rows]``: each query head's value on each of its rows (the
    rows of a KV head are its query heads' tokens, head after head)."""
    x = np.broadcast_to(x[..., None], (*x.shape, seqlen_q))
    return np.ascontiguousarray(x.reshape(*x.shape[:-2], heads_kv, -1))


def _no_dims(x):
    """A float32 array of ``x``'s shape with a last dim of 0."""
    return np.empty(x.shape[:-1] + (0,), np.float32)


def attention_forward(q, k, v, scale, causal, window=None, softcap=None, alibi_slopes=None, sinks=None):
    """``softmax(scale · q kᵀ) v`` and its log-sum-exp.

    ``q`` ``[batch, heads_q, seqlen_q, head_dim]``, ``k`` ``[batch, heads_kv, seqlen_kv, head_dim]``,
    ``v`` ``[batch, heads_kv, seqlen_kv, head_dim_v]`` float32, ``heads_q`` a multiple of ``heads_kv``
    (query head ``h`` reads KV head ``h // (heads_q // heads_kv)``). With ``causal``, query ``i`` sees
    keys ``j <= i + seqlen_kv - seqlen_q`` (bottom-right aligned). The score modifications as
    ``numattn.attention`` takes them: ``window`` ``(left, right)`` (non-negative; large for no bound),
    ``softcap`` (None: none), ``alibi_slopes`` ``[heads_q]`` or ``[batch, heads_q]`` and ``sinks``
    ``[heads_q]`` (float32, or None).

    Returns float32 ``o`` ``[batch, heads_q, seqlen_q, head_dim_v]`` and natural-log ``lse``
    ``[batch, heads_q, seqlen_q]``; a row that sees no key gets ``o = 0``, ``lse = -inf`` (the sink's
    logit with ``sinks``), a row with a NaN or +inf score NaN.
    """
    q, k, v = _host(q), _host(k), _host(v)
    batch, seqlen_kv = q.shape[0], k.shape[2]
    _require(k.shape[0] == v.shape[0] == batch, "q, k and v must share the batch")
    left, right = window or (_NO_BOUND, _NO_BOUND)
    return _paged_attention(q, _no_dims(q), k, _no_dims(k), v, np.arange(batch, dtype=np.int32).reshape(batch, 1),
                            np.full(batch, seqlen_kv, np.int32), scale, causal, (left, right, softcap or 0.0),
                            alibi_slopes, sinks)


def attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table, layout, scale, causal,
                             window=None, softcap=None, alibi_slopes=None, sinks=None):
    """``attention_forward`` of each sequence of a packed batch (``kernels/sequences.py`` says how ``layout``
    places them).

    ``q`` ``[1, heads_q, total_q, head_dim]``; ``k``, ``v`` ``[1, heads_kv, total_k, ·]`` or, paged,
    ``[num_pages, heads_kv, page_size, ·]`` float32; the int32 index arrays as the kernels take them
    (checked by the caller). Returns float32 ``o`` ``[total_q, heads_q, head_dim_v]`` and ``lse``
    ``[heads_q, total_q]``, rows of no sequence left 0 and -inf.
    """
    batch, heads_q, head_dim_v = len(cu_seqlens_q) - 1, q.shape[1], v.shape[3]
    o = np.zeros((q.shape[2], heads_q, head_dim_v), np.float32)
    lse = np.full((heads_q, q.shape[2]), -np.inf, np.float32)
    slopes = None if alibi_slopes is None else np.broadcast_to(_host(alibi_slopes), (batch, heads_q))
    left, right = window or (_NO_BOUND, _NO_BOUND)
    for b in range(batch):
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        if layout.paged:
            keys = int(seqused_k[b] if layout.seqused else cu_seqlens_k[b + 1] - cu_seqlens_k[b])
            k_pages, v_pages, table = k, v, page_table[b : b + 1]
        else:
            k0 = int(cu_seqlens_k[b])
            keys = int(cu_seqlens_k[b + 1]) - k0
            keys = min(keys, int(seqused_k[b])) if layout.seqused else keys
            k_pages, v_pages, table = k[:, :, k0 : k0 + keys], v[:, :, k0 : k0 + keys], np.zeros((1, 1), np.int32)
        if q1 == q0:
            continue
        if keys == 0:  # only the sink, if any
            if sinks is not None:
                lse[:, q0:q1] = _host(sinks)[:, None]
            continue
        q_b = np.ascontiguousarray(q[:, :, q0:q1])
        o_b, lse_b = _paged_attention(q_b, _no_dims(q_b), k_pages, _no_dims(k_pages), v_pages, table,
                                      np.array([keys], np.int32), scale, causal, (left, right, softcap or 0.0),
                                      None if slopes is None else slopes[b : b + 1], sinks)
        o[q0:q1] = o_b[0].transpose(1, 0, 2)
        lse[:, q0:q1] = lse_b[0]
    return o, lse


def attention_backward(q, k, v, o, lse, do, scale, causal, window=None, softcap=None, alibi_slopes=None):
    """Gradients ``(dq, dk, dv)`` of ``attention_forward``'s ``o`` (FlashAttention-2's backward pass).

    ``q``, ``k``, ``v``, ``scale``, ``causal`` and the score modifications as ``attention_forward``
    (sinks need nothing here: they are in ``lse``); ``o`` and ``do`` ``[batch, heads_q, seqlen_q,
    head_dim_v]``, ``lse`` ``[batch, heads_q, seqlen_q]`` its results and the output gradient. Returns
    float32 arrays shaped like ``q``, ``k``, ``v``; ``dk`` and ``dv`` sum over the query heads of each
    KV head's group. Rows with ``lse`` -inf contribute nothing.
    """
    q, k, v, o, lse, do = (_host(x) for x in (q, k, v, o, lse, do))
    batch, heads_q, seqlen_q, head_dim = q.shape
    heads_kv, head_dim_v = k.shape[1], v.shape[3]
    _require(heads_kv > 0 and heads_q % heads_kv == 0, f"heads_q {heads_q} is not a multiple of heads_kv {heads_kv}")
    _require(k.shape[:3] == v.shape[:3] and k.shape[0] == batch and k.shape[3] == head_dim
             and o.shape == do.shape == (batch, heads_q, seqlen_q, head_dim_v) and lse.shape == o.shape[:3],
             "inconsistent shapes of q, k, v, o, lse and do")
    rows = heads_q // heads_kv * seqlen_q

    def by_kv_head(x):
        return x.reshape(batch, heads_kv, rows, *x.shape[3:])

    left, right = window or (_NO_BOUND, _NO_BOUND)
    slopes = (np.empty((0, 0, 0), np.float32) if alibi_slopes is None
              else _per_row(np.broadcast_to(_host(alibi_slopes), (batch, heads_q)), heads_kv, seqlen_q))
    delta = (do * o).sum(axis=-1, dtype=np.float32)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    if q.size and k.size:
        args = (by_kv_head(q), k, v, by_kv_head(do), by_kv_head(lse), by_kv_head(delta), np.float32(scale),
                bool(causal), (int(left), int(right), np.float32(softcap or 0.0)), slopes, seqlen_q)
        _backward_kv(*args, dk, dv)
        _backward_q(*args, by_kv_head(dq))
    return dq, dk, dv


def paged_decode(q, k_pages, v_pages, page_table, seqlens, scale, window=None, softcap=None, alibi_slopes=None,
                 sinks=None):
    """Attention of each sequence's ``seqlen_q`` new tokens over its paged KV cache.

    ``q`` ``[batch, heads_q, seqlen_q, head_dim]``; ``k_pages`` ``[num_pages, heads_kv, page_size, head_dim]``,
    ``v_pages`` ``[num_pages, heads_kv, page_size, head_dim_v]`` float32; ``page_table`` ``[batch, max_pages]``
    and ``seqlens`` ``[batch]`` int32. Sequence ``b`` has ``seqlens[b]`` keys, key ``t`` in page
    ``page_table[b, t // page_size]`` at slot ``t % page_size``; new token ``i`` sees keys
    ``t <= seqlens[b] - seqlen_q + i``. A contiguous cache ``[batch, heads_kv, max_seqlen, D]`` is
    ``page_size = max_seqlen`` with ``page_table[b, 0] = b``. Page indices are clamped into
    ``[0, num_pages)`` and lengths into ``[0, max_pages · page_size]``.

    The score modifications as ``attention_forward`` takes them (the window's right side is 0).

    Returns float32 ``o`` ``[batch, heads_q, seqlen_q, head_dim_v]`` and ``lse`` ``[batch, heads_q, seqlen_q]``
    (``o = 0``, ``lse = -inf`` for a token that sees no key, or the sink's logit with ``sinks``).
    """
    q, k_pages, v_pages = _host(q), _host(k_pages), _host(v_pages)
    page_table, seqlens = (_host(x, np.int32) for x in (page_table, seqlens))
    left = _NO_BOUND if window is None else window[0]
    return _paged_attention(q, _no_dims(q), k_pages, _no_dims(k_pages), v_pages, page_table, seqlens, scale, True,
                            (left, 0, softcap or 0.0), alibi_slopes, sinks)


def mla_decode(q_nope, q_pe, ckv, kpe, page_table, seqlens, scale):
    """DeepSeek MLA decode with absorbed weights: one new token per sequence over a paged latent cache.

    ``q_nope`` ``[batch, heads, rank]``, ``q_pe`` ``[batch, heads, rope]`` (``rope`` may be 0), ``ckv``
    ``[num_pages, page_size, rank]``, ``kpe`` ``[num_pages, page_size, rope]`` float32; ``page_table`` and
    ``seqlens`` as ``paged_decode``. Key ``t`` scores ``scale · (q_nope · ckv_t + q_pe · kpe_t)`` and its value
    is ``ckv_t``. Returns float32 ``o`` ``[batch, heads, rank]`` and ``lse`` ``[batch, heads]``.
    """
    q_nope, q_pe, ckv, kpe = _host(q_nope), _host(q_pe), _host(ckv), _host(kpe)
    page_table, seqlens = (_host(x, np.int32) for x in (page_table, seqlens))
    _require(ckv.ndim == kpe.ndim == 3, "ckv and kpe must be [num_pages, page_size, dim]")
    pages = [x[:, None] for x in (ckv, kpe)]  # one KV head
    o, lse = _paged_attention(q_nope[:, :, None], q_pe[:, :, None], pages[0], pages[1], pages[0], page_table,
                              seqlens, scale, True)
    return o[:, :, 0], lse[:, :, 0]


def merge_states(o_a, lse_a, o_b, lse_b):
    """Attention over the union of two disjoint key sets from the two partial results.

    ``o_a``, ``o_b`` ``[rows, head_dim_v]`` and their natural-log ``lse_a``, ``lse_b`` ``[rows]`` float32.
    Returns ``lse = log(exp(lse_a) + exp(lse_b))`` and ``o = o_a exp(lse_a - lse) + o_b exp(lse_b - lse)``.
    ``-inf`` marks a side that saw no key: its ``o`` is not read, and both ``-inf`` give ``o = 0``,
    ``lse = -inf``. A NaN or +inf ``lse`` on either side gives NaN ``o`` and ``lse``: +inf would be an
    infinite softmax normaliser, which ``attention_forward`` turns into NaN too, so merging partial
    results always agrees with attention over the union.
    """
    o_a, lse_a, o_b, lse_b = (_host(x) for x in (o_a, lse_a, o_b, lse_b))
    _require(o_a.ndim == 2 and o_b.shape == o_a.shape and lse_a.shape == lse_b.shape == o_a.shape[:1],
             "o_a, o_b must be [rows, head_dim_v] and lse_a, lse_b [rows]")
    o, lse = np.empty_like(o_a), np.empty_like(lse_a)
    _merge(o_a, lse_a, o_b, lse_b, o, lse)
    return o, lse
