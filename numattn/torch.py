"""Training with numattn: a torch autograd function and a grouped-query attention module.

``numattn.torch.attention(q, k, v, causal=False, scale=None)`` takes (batch, heads, seq, dim)
tensors (GQA/MQA when k, v have fewer heads), runs numattn's fused forward with its log-sum-exp,
and on backward recomputes the softmax from it (``ops/backward.py``). Gradients come back in the
inputs' dtype.
"""

import numpy as np
import torch

from .ops.attention import attention as _attention
from .ops.attention import softmax_scale
from .ops.backward import attention_backward, compile_backward_ahead

_DTYPES = ("float16", "bfloat16", "float32")


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        dtype = str(q.dtype).removeprefix("torch.")
        if any(ctx.needs_input_grad[:3]) and q.is_cuda and dtype in _DTYPES and q.dim() == v.dim() == 4:
            # the backward's kernels compile in a worker process while this process compiles the forward's
            compile_backward_ahead(dtype, q.shape[-1], v.shape[-1], bool(causal), q.device.index)
        o, lse = _attention(q, k, v, causal=causal, scale=scale, return_lse=True)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, softmax_scale(scale, q.shape[-1])
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = attention_backward(q, k, v, o, lse, do.to(q.dtype), causal=ctx.causal, scale=ctx.scale)
        needs = ctx.needs_input_grad[:3]  # of q, k, v (causal and scale get none)
        grads = [g.to(x.dtype) if need else None for g, x, need in zip((dq, dk, dv), (q, k, v), needs, strict=True)]
        return (*grads, None, None)


def attention(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", causal: bool = False,
              scale: float | None = None) -> "torch.Tensor":
    """``softmax(scale · q kᵀ) v`` with gradients for q, k and v (whichever require them).

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

    Returns
    -------
    ``o`` ``[batch, num_heads_q, seqlen_q, head_dim_v]`` in q's dtype, with a ``grad_fn`` when torch
    records gradients through any input.

    Raises
    ------
    TypeError, ValueError
        As ``numattn.attention`` does; TypeError for arguments that are not torch tensors.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__} (numattn.attention takes "
                            "other arrays, without gradients)")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _Attention.apply(q, k, v, bool(causal), scale)
    return _attention(q, k, v, causal=causal, scale=scale)


class GroupedQueryAttention(torch.nn.Module):
    """Multi-head attention with ``kv_heads`` key/value heads shared by groups of the ``heads`` query
    heads (GQA; MQA with one, MHA with ``heads``): q/k/v and output projections around
    ``numattn.torch.attention``. Input and output ``[batch, seqlen, dim]``."""

    def __init__(self, dim, heads, kv_heads, causal=True, bias=False):
        super().__init__()
        for name, value in (("dim", dim), ("heads", heads), ("kv_heads", kv_heads)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name} must be positive, got {value}")
        if dim % heads or heads % kv_heads:
            raise ValueError(f"dim ({dim}) must be a multiple of heads ({heads}), heads of kv_heads ({kv_heads})")
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
        self.dim, self.heads, self.kv_heads, self.head_dim, self.causal = dim, heads, kv_heads, dim // heads, causal
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
        o = attention(q, k, v, causal=self.causal)
        return self.out_proj(o.transpose(1, 2).reshape(batch, seq, -1))
