"""Training with numattn: a torch autograd function and a grouped-query attention module.

``numattn.torch.attention(q, k, v, causal=False, scale=None)`` takes (batch, heads, seq, dim)
tensors (GQA/MQA when k, v have fewer heads), runs numattn's fused forward with its log-sum-exp,
and on backward recomputes the softmax from it (``ops/backward.py``); ``numattn.torch.attention_varlen``
does the same for packed sequences of different lengths. Gradients come back in the inputs' dtype.
"""

import numpy as np
import torch

from ._arrays import describe
from .ops.attention import attention as _attention
from .ops.attention import softmax_scale
from .ops.backward import attention_backward, compile_backward_ahead
from .ops.score_mods import score_options, softcap_value, window_bounds
from .ops.varlen import attention_varlen as _attention_varlen

_DTYPES = ("float16", "bfloat16", "float32")


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, causal, scale, window, softcap, alibi_slopes):
        options = None
        if q.dim() == 4:  # else the forward's validation below names q's rank
            options = score_options(window, softcap, alibi_slopes, sinks, causal, q.shape[0], q.shape[1],
                                    describe(q, "q").device)
        dtype = str(q.dtype).removeprefix("torch.")
        if any(ctx.needs_input_grad[:3]) and q.is_cuda and dtype in _DTYPES and q.dim() == v.dim() == 4:
            # the backward's kernels compile in a worker process while this process compiles the forward's
            compile_backward_ahead(dtype, q.shape[-1], v.shape[-1], bool(causal), q.device.index, options.mods)
        o, lse = _attention(q, k, v, causal=causal, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                            sinks=sinks, scale=scale, return_lse=True)
        ctx.save_for_backward(q, k, v, o, lse, alibi_slopes, sinks)
        ctx.causal, ctx.scale, ctx.options = causal, softmax_scale(scale, q.shape[-1]), options
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, alibi_slopes, sinks = ctx.saved_tensors
        dq, dk, dv = attention_backward(q, k, v, o, lse, do.to(q.dtype), causal=ctx.causal, scale=ctx.scale,
                                        options=ctx.options, alibi=alibi_slopes, sinks=sinks)
        needs = ctx.needs_input_grad[:3]  # of q, k, v (the options but the sinks get none)
        grads = [g.to(x.dtype) if need else None for g, x, need in zip((dq, dk, dv), (q, k, v), needs, strict=True)]
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            # d loss / d sink_h = -sum over rows of P(sink) · delta, with P(sink) = exp(sink − lse), delta = dO · O
            delta = (do.float() * o.float()).sum(-1)
            dsinks = -(torch.exp(sinks.float()[None, :, None] - lse) * delta).sum((0, 2)).to(sinks.dtype)
        return (*grads, dsinks, None, None, None, None, None)


class _AttentionVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window,
                softcap, alibi_slopes):
        o, lse = _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                   window=window, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, scale=scale,
                                   return_lse=True)  # validates every argument
        options = score_options(window, softcap, alibi_slopes, sinks, causal, cu_seqlens_q.shape[0] - 1, q.shape[1],
                                describe(q, "q").device)
        ctx.save_for_backward(q, k, v, o, lse, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k)
        ctx.causal, ctx.scale, ctx.options = causal, softmax_scale(scale, q.shape[-1]), options
        ctx.max_seqlen_k = max_seqlen_k
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, alibi_slopes, sinks, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv = attention_backward(q, k, v, o, lse, do.to(q.dtype), causal=ctx.causal, scale=ctx.scale,
                                        options=ctx.options, alibi=alibi_slopes, sinks=sinks,
                                        sequences=(cu_q, cu_k, ctx.max_seqlen_k))
        needs = ctx.needs_input_grad[:3]
        grads = [g.to(x.dtype) if need else None for g, x, need in zip((dq, dk, dv), (q, k, v), needs, strict=True)]
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            # per head h: −Σ_t exp(sink_h − lse[h, t]) · (dO · O)[t, h]
            delta = (do.float() * o.float()).sum(-1).transpose(0, 1)  # [heads, total_q]
            dsinks = -(torch.exp(sinks.float()[:, None] - lse) * delta).sum(1).to(sinks.dtype)
        return (*grads, dsinks, *(None,) * 9)


def attention(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", causal: bool = False,
              scale: float | None = None, *, window: tuple | None = None, softcap: float | None = None,
              alibi_slopes: "torch.Tensor | None" = None, sinks: "torch.Tensor | None" = None) -> "torch.Tensor":
    """``softmax(scale · q kᵀ) v`` with gradients for q, k and v (whichever require them), and for ``sinks``.

    Parameters
    ----------
    q : torch.Tensor ``[batch, num_heads_q, seqlen_q, head_dim]``
    k : torch.Tensor ``[batch, num_heads_kv, seqlen_kv, head_dim]``
    v : torch.Tensor ``[batch, num_heads_kv, seqlen_kv, head_dim_v]``
        One dtype (float16, bfloat16 or float32), any strides; ``num_heads_q`` a multiple of
        ``num_heads_kv`` (GQA, MQA).
    causal : bool
        Bottom-right aligned causal mask, as in ``numattn.attention``.
    scale : float, optional
        ``1 / sqrt(head_dim)`` by default.
    window, softcap, alibi_slopes, sinks : optional
        The score modifications of ``numattn.attention`` (sliding window, logit softcap, ALiBi slopes
        ``[num_heads_q]`` or ``[batch, num_heads_q]``, sinks ``[num_heads_q]``, both float32). The
        backward recomputes the scores with them; ``sinks`` get a gradient when they require one, the
        slopes none.

    Returns
    -------
    ``o`` ``[batch, num_heads_q, seqlen_q, head_dim_v]`` in q's dtype, with a ``grad_fn`` when torch
    records gradients through any input.

    Raises
    ------
    TypeError, ValueError
        As ``numattn.attention`` does; TypeError for arguments that are not torch tensors.
    """
    for name, x in (("q", q), ("k", k), ("v", v), ("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if not isinstance(x, torch.Tensor) and (x is not None or name in "qkv"):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__} (numattn.attention takes "
                            "other arrays, without gradients)")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    tensors = (q, k, v) if sinks is None else (q, k, v, sinks)
    if torch.is_grad_enabled() and any(x.requires_grad for x in tensors if isinstance(x, torch.Tensor)):
        return _Attention.apply(q, k, v, sinks, bool(causal), scale, window, softcap, alibi_slopes)
    return _attention(q, k, v, causal=causal, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                      sinks=sinks, scale=scale)


def attention_varlen(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", cu_seqlens_q: "torch.Tensor",
                     cu_seqlens_k: "torch.Tensor", max_seqlen_q: int, max_seqlen_k: int, causal: bool = False,
                     scale: float | None = None, *, window: tuple | None = None, softcap: float | None = None,
                     alibi_slopes: "torch.Tensor | None" = None, sinks: "torch.Tensor | None" = None) -> "torch.Tensor":
    """``numattn.attention_varlen`` on packed sequences, with gradients for q, k and v (whichever require them)
    and for ``sinks``.

    Parameters
    ----------
    q : torch.Tensor ``[total_q, num_heads_q, head_dim]``
    k, v : torch.Tensor ``[total_k, num_heads_kv, head_dim]`` (``head_dim_v`` for ``v``), packed like ``q``
    cu_seqlens_q, cu_seqlens_k : int32 torch.Tensor ``[batch + 1]``
        Cumulative lengths: sequence ``b``'s queries are rows ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1]``, its
        keys rows ``cu_seqlens_k[b] .. cu_seqlens_k[b + 1]``.
    max_seqlen_q, max_seqlen_k : int
        The longest sequence's query and key counts.
    causal, scale, window, softcap, alibi_slopes, sinks
        As for ``numattn.torch.attention`` (``alibi_slopes`` ``[num_heads_q]`` or ``[batch, num_heads_q]``).

    Returns
    -------
    ``o`` ``[total_q, num_heads_q, head_dim_v]`` in q's dtype, with a ``grad_fn`` when torch records gradients
    through any input. Keys of no sequence get a gradient of 0.

    Raises
    ------
    TypeError, ValueError
        As ``numattn.attention_varlen`` does (the index arrays are checked); TypeError for arguments that are
        not torch tensors. Keys in pages (``page_table``) take no gradients: call ``numattn.attention_varlen``.

    Examples
    --------
    >>> import torch, numattn.torch
    >>> cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    >>> q, k, v = (torch.randn(8, 2, 16, requires_grad=True) for _ in range(3))
    >>> numattn.torch.attention_varlen(q, k, v, cu, cu, 5, 5, causal=True).sum().backward()
    >>> q.grad.shape
    torch.Size([8, 2, 16])
    """
    for name, x in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
                    ("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if not isinstance(x, torch.Tensor) and (x is not None or name not in ("alibi_slopes", "sinks")):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__} (numattn.attention_varlen takes "
                            "other arrays, without gradients)")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    tensors = (q, k, v) if sinks is None else (q, k, v, sinks)
    if torch.is_grad_enabled() and any(x.requires_grad for x in tensors if isinstance(x, torch.Tensor)):
        return _AttentionVarlen.apply(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      bool(causal), scale, window, softcap, alibi_slopes)
    return _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                             window=window, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, scale=scale)


class GroupedQueryAttention(torch.nn.Module):
    """Multi-head attention with ``kv_heads`` key/value heads shared by groups of the ``heads`` query
    heads (GQA; MQA with one, MHA with ``heads``): q/k/v and output projections around
    ``numattn.torch.attention``, with an optional sliding ``window`` and logit ``softcap`` (as
    ``numattn.attention`` takes them, checked here). Input and output ``[batch, seqlen, dim]``."""

    def __init__(self, dim, heads, kv_heads, causal=True, bias=False, window=None, softcap=None):
        super().__init__()
        for name, value in (("dim", dim), ("heads", heads), ("kv_heads", kv_heads)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name} must be positive, got {value}")
        if dim % heads or heads % kv_heads:
            raise ValueError(f"dim ({dim}) must be a multiple of heads ({heads}), heads of kv_heads ({kv_heads})")
        if not isinstance(causal, (bool, np.bool_)):
            raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
        causal = bool(causal)
        self.dim, self.heads, self.kv_heads, self.head_dim, self.causal = dim, heads, kv_heads, dim // heads, causal
        window_bounds(window, causal)  # a bad window fails here, not at the first forward
        self.window, self.softcap = window, softcap_value(softcap)
        self.q_proj = torch.nn.Linear(dim, dim, bias=bias)
        self.k_proj = torch.nn.Linear(dim, kv_heads * self.head_dim, bias=bias)
        self.v_proj = torch.nn.Linear(dim, kv_heads * self.head_dim, bias=bias)
        self.out_proj = torch.nn.Linear(dim, dim, bias=bias)

    def forward(self, x):
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x must be [batch, seqlen, dim] with dim {self.dim}, got shape {tuple(x.shape)}")
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        o = attention(q, k, v, causal=self.causal, window=self.window, softcap=self.softcap)
        return self.out_proj(o.transpose(1, 2).reshape(batch, seq, -1))
