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


def attention(q, k, v, *, causal=False, scale=None, layout="bhsd", return_lse=False):
    """``softmax(scale · q kᵀ) v`` in float64; same arguments and conventions as ``numattn.attention``.

    Returns float64 numpy arrays: ``o`` in ``layout``, and with ``return_lse``
    also ``lse`` ``[batch, num_heads_q, seqlen_q]`` (natural log, ``-inf`` for
    a query that sees no key, whose output row is 0).
    """
    axes = _LAYOUT_AXES[layout]
    q, k, v = (to_float64(x).transpose(axes) for x in (q, k, v))
    heads_q, seqlen_q, head_dim = q.shape[1], q.shape[2], q.shape[3]
    heads_kv, seqlen_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    scores = scale * np.einsum("bhid,bhjd->bhij", q, k)
    if causal:
        i = np.arange(seqlen_q)[:, None]
        j = np.arange(seqlen_kv)[None, :]
        scores = np.where(j > i + (seqlen_kv - seqlen_q), -np.inf, scores)
    row_max = scores.max(axis=-1, keepdims=True)
    visible = np.isfinite(row_max)
    weights = np.exp(scores - np.where(visible, row_max, 0.0))
    total = weights.sum(axis=-1, keepdims=True)
    o = np.einsum("bhij,bhjd->bhid", weights / np.where(visible, total, 1.0), v)
    o = o.transpose(np.argsort(axes))
    if not return_lse:
        return o
    with np.errstate(divide="ignore"):
        lse = (np.log(total) + np.where(visible, row_max, 0.0))[..., 0]
    return o, np.where(visible[..., 0], lse, -np.inf)
