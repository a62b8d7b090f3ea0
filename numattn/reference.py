"""Float64 numpy references with the exact semantics of numattn's kernels (for tests and the demo)."""

import math

import numpy as np

_LAYOUT_AXES = {"bhsd": (0, 1, 2, 3), "bshd": (0, 2, 1, 3)}


def to_float64(x):
    """Any supported array (numpy, torch, numba device array, ...) as a float64 numpy array."""
    if hasattr(x, "detach"):  # torch
        return x.detach().cpu().double().numpy()
    if hasattr(x, "copy_to_host"):  # numba device array
        x = x.copy_to_host()
    elif hasattr(x, "get"):  # cupy
        x = x.get()
    return np.asarray(x, dtype=np.float64)


def attention(q, k, v, *, causal=False, window=None, softcap=None, alibi_slopes=None, sinks=None, scale=None,
              layout="bhsd", return_lse=False):
    """``softmax(scale · q kᵀ) v`` in float64; same arguments and conventions as ``numattn.attention``.

    With ``i = query index + seqlen_kv − seqlen_q`` and ``j`` a key index: ``window=(left, right)``
    keeps ``i − left ≤ j ≤ i + right`` (None or −1: no bound; right 0 under ``causal``), ``softcap=c``
    maps the scaled score ``s`` to ``c · tanh(s / c)``, ``alibi_slopes`` (``[heads_q]`` or
    ``[batch, heads_q]``) subtract ``slope · |i − j|``, ``sinks`` (``[heads_q]``) add ``exp(sink)`` to
    the softmax's denominator. Returns float64 numpy arrays: ``o`` in ``layout``, and with ``return_lse``
    also ``lse`` ``[batch, num_heads_q, seqlen_q]`` (natural log, ``-inf`` for a query that sees no key
    and has no sink; its output row is 0).
    """
    axes = _LAYOUT_AXES[layout]
    q, k, v = (to_float64(x).transpose(axes) for x in (q, k, v))
    batch, heads_q, seqlen_q, head_dim = q.shape
    heads_kv, seqlen_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    scores = scale * np.einsum("bhid,bhjd->bhij", q, k)
    if softcap:
        scores = softcap * np.tanh(scores / softcap)
    i = np.arange(seqlen_q)[:, None] + (seqlen_kv - seqlen_q)
    j = np.arange(seqlen_kv)[None, :]
    if alibi_slopes is not None:
        slopes = np.broadcast_to(to_float64(alibi_slopes), (batch, heads_q))
        scores = scores - slopes[:, :, None, None] * np.abs(i - j)
    left, right = (None, None) if window is None else window
    visible = np.ones((seqlen_q, seqlen_kv), bool)
    if causal or right is not None and right != -1:
        visible &= j <= i + (0 if causal else right)
    if left is not None and left != -1:
        visible &= j >= i - left
    scores = np.where(visible, scores, -np.inf)
    if sinks is not None:  # a column with no value row
        sink_column = np.broadcast_to(to_float64(sinks)[None, :, None, None], (batch, heads_q, seqlen_q, 1))
        scores = np.concatenate([scores, sink_column], axis=-1)
        v = np.concatenate([v, np.zeros((batch, heads_q, 1, v.shape[3]))], axis=2)
    row_max = scores.max(axis=-1, keepdims=True)
    seen = ~np.isneginf(row_max)  # a NaN or +inf score makes the row NaN, as it does in the kernels
    weights = np.exp(scores - np.where(seen, row_max, 0.0))
    total = weights.sum(axis=-1, keepdims=True)
    o = np.einsum("bhij,bhjd->bhid", weights / np.where(seen, total, 1.0), v)
    o = o.transpose(np.argsort(axes))
    if not return_lse:
        return o
    with np.errstate(divide="ignore"):
        lse = (np.log(total) + np.where(seen, row_max, 0.0))[..., 0]
    return o, np.where(seen[..., 0], lse, -np.inf)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, *, causal=False,
                     window=None, softcap=None, alibi_slopes=None, sinks=None, scale=None, return_lse=False,
                     page_table=None, seqused_k=None):
    """``numattn.attention_varlen`` in float64: each sequence of the packed batch through ``attention``
    (``max_seqlen_q`` and ``max_seqlen_k`` are not needed). Returns ``o`` ``[total_q, heads_q, head_dim_v]``
    and with ``return_lse`` also ``lse`` ``[heads_q, total_q]``."""
    q, k, v = (to_float64(x) for x in (q, k, v))
    cu_q = [int(n) for n in to_float64(cu_seqlens_q)]
    cu_k = None if cu_seqlens_k is None else [int(n) for n in to_float64(cu_seqlens_k)]
    used = None if seqused_k is None else [int(n) for n in to_float64(seqused_k)]
    batch, heads_q, head_dim_v = len(cu_q) - 1, q.shape[1], v.shape[-1]
    slopes = None if alibi_slopes is None else np.broadcast_to(to_float64(alibi_slopes), (batch, heads_q))
    o = np.zeros((q.shape[0], heads_q, head_dim_v))
    lse = np.full((heads_q, q.shape[0]), -np.inf)
    for b in range(batch):
        if page_table is not None:
            n = used[b] if used is not None else cu_k[b + 1] - cu_k[b]
            pages = np.asarray(to_float64(page_table), np.int64)[b, : -(-n // k.shape[1])]
            keys, values = (np.concatenate([x[p] for p in pages])[:n] if n else x[0, :0] for x in (k, v))
        else:
            n = cu_k[b + 1] - cu_k[b] if used is None else min(used[b], cu_k[b + 1] - cu_k[b])
            keys, values = k[cu_k[b] : cu_k[b] + n], v[cu_k[b] : cu_k[b] + n]
        rows = slice(cu_q[b], cu_q[b + 1])
        if rows.stop == rows.start:
            continue
        if n == 0:  # no key: the output is 0, the LSE the sink's logit or -inf
            if sinks is not None:
                lse[:, rows] = to_float64(sinks)[:, None]
            continue
        o_b, lse_b = attention(q[None, rows], keys[None], values[None], causal=causal, window=window, softcap=softcap,
                               alibi_slopes=None if slopes is None else slopes[b : b + 1], sinks=sinks, scale=scale,
                               layout="bshd", return_lse=True)
        o[rows], lse[:, rows] = o_b[0], lse_b[0]
    return (o, lse) if return_lse else o


def decode(q, k_cache, v_cache, *, seqlens=None, scale=None, window=None, softcap=None, alibi_slopes=None, sinks=None,
           layout="bhsd", return_lse=False):
    """``numattn.decode`` in float64: each sequence's new tokens against its first ``seqlens[b]`` keys, with the
    score modifications of ``attention``."""
    axes = _LAYOUT_AXES[layout]
    q = to_float64(q)
    squeezed = q.ndim == 3
    q = q[:, :, None, :] if squeezed else q.transpose(axes)
    k, v = (to_float64(x).transpose(axes) for x in (k_cache, v_cache))
    lengths = [k.shape[2]] * k.shape[0] if seqlens is None else [int(n) for n in to_float64(seqlens)]
    return _per_sequence(q, [k[b, :, :n] for b, n in enumerate(lengths)], [v[b, :, :n] for b, n in enumerate(lengths)],
                         scale, return_lse, squeezed, axes, dict(window=window, softcap=softcap,
                                                                 alibi_slopes=alibi_slopes, sinks=sinks))


def paged_decode(q, k_pages, v_pages, page_table, seqlens, *, scale=None, window=None, softcap=None, alibi_slopes=None,
                 sinks=None, kv_layout="nhd", return_lse=False):
    """``numattn.paged_decode`` in float64: gathers each sequence's keys from its pages."""
    q = to_float64(q)
    squeezed = q.ndim == 3
    q = q[:, :, None, :] if squeezed else q
    to_hnd = (0, 2, 1, 3) if kv_layout == "nhd" else (0, 1, 2, 3)
    k, v = (to_float64(x).transpose(to_hnd) for x in (k_pages, v_pages))
    table = np.asarray(to_float64(page_table), dtype=np.int64)
    lengths = [int(n) for n in to_float64(seqlens)]
    page_size = k.shape[2]
    keys, values = [], []
    for b, n in enumerate(lengths):
        pages = table[b, : -(-n // page_size)]
        keys.append(np.concatenate([k[p] for p in pages], axis=1)[:, :n] if n else k[0, :, :0])
        values.append(np.concatenate([v[p] for p in pages], axis=1)[:, :n] if n else v[0, :, :0])
    return _per_sequence(q, keys, values, scale, return_lse, squeezed, (0, 1, 2, 3),
                         dict(window=window, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks))


def mla_decode(q_nope, q_pe, ckv_cache, kpe_cache, page_table, seqlens, *, scale, return_lse=False):
    """``numattn.mla_decode`` in float64: a paged decode with one KV head whose keys are
    ``[ckv | kpe]`` and whose values are ``ckv``."""
    q = np.concatenate([to_float64(q_nope), to_float64(q_pe)], axis=-1)
    ckv = to_float64(ckv_cache)
    keys = np.concatenate([ckv, to_float64(kpe_cache)], axis=-1)[:, :, None, :]
    o, lse = paged_decode(q, keys, ckv[:, :, None, :], page_table, seqlens, scale=scale, return_lse=True)
    return (o, lse[:, :, 0]) if return_lse else o


def _per_sequence(q, keys, values, scale, return_lse, squeezed, axes, options=None):
    """Causal (bottom-right) attention of ``q[b]`` ``[Hq, Sq, D]`` over ``keys[b]`` ``[Hkv, n, D]``, with the score
    modifications ``options`` (``attention``'s keywords)."""
    options = dict(options or {})
    batch, heads_q, seqlen_q = q.shape[:3]
    head_dim_v = values[0].shape[-1]
    slopes = options.pop("alibi_slopes", None)
    slopes = None if slopes is None else np.broadcast_to(to_float64(slopes), (batch, heads_q))
    sinks = options.get("sinks")
    o = np.zeros((batch, heads_q, seqlen_q, head_dim_v))
    lse = np.full((batch, heads_q, seqlen_q), -np.inf)
    if sinks is not None:  # a sequence without keys: only the sink
        lse[:] = to_float64(sinks)[None, :, None]
    for b in range(batch):
        if keys[b].shape[1]:
            o_b, lse_b = attention(q[b : b + 1], keys[b][None], values[b][None], causal=True, scale=scale,
                                   alibi_slopes=None if slopes is None else slopes[b : b + 1], return_lse=True,
                                   **options)
            o[b], lse[b] = o_b[0], lse_b[0]
    o = o[:, :, 0] if squeezed else o.transpose(np.argsort(axes))
    if not return_lse:
        return o
    return o, lse
