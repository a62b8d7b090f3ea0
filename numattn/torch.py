"""Training with numattn: a torch autograd function and a grouped-query attention module.

``numattn.torch.attention(q, k, v, causal=False, scale=None)`` takes (batch, heads, seq, dim)
tensors (GQA/MQA when k, v have fewer heads), runs numattn's fused forward with its log-sum-exp,
and on backward recomputes the softmax from it (``ops/backward.py``). Gradients come back in the
inputs' dtype.
"""

import math

import torch

from .ops.attention import attention as _attention
from .ops.backward import attention_backward


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        o, lse = _attention(q, k, v, causal=causal, scale=scale, return_lse=True)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = attention_backward(q, k, v, o, lse, do.to(q.dtype), causal=ctx.causal, scale=ctx.scale)
        grads = [g.to(x.dtype) if need else None for g, x, need in zip((dq, dk, dv), (q, k, v), ctx.needs_input_grad)]
        return (*grads, None, None)


def attention(q, k, v, causal=False, scale=None):
    """``softmax(scale · q kᵀ) v`` with gradients for q, k and v (whichever require them).

    q ``[batch, heads_q, seqlen_q, head_dim]``, k ``[batch, heads_kv, seqlen_kv, head_dim]``, v
    ``[batch, heads_kv, seqlen_kv, head_dim_v]``, one dtype, any strides; ``heads_q`` a multiple of
    ``heads_kv``; causal masking bottom-right; ``scale`` 1/sqrt(head_dim) by default."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        return _Attention.apply(q, k, v, bool(causal), scale)
    return _attention(q, k, v, causal=causal, scale=scale)


class GroupedQueryAttention(torch.nn.Module):
    """Multi-head attention with ``kv_heads`` key/value heads shared by groups of the ``heads`` query
    heads (GQA; MQA with one, MHA with ``heads``): q/k/v and output projections around
    ``numattn.torch.attention``. Input and output ``[batch, seq, dim]``."""

    def __init__(self, dim, heads, kv_heads, causal=True, bias=False):
        super().__init__()
        if dim % heads or heads % kv_heads:
            raise ValueError(f"dim ({dim}) must be a multiple of heads ({heads}), heads of kv_heads ({kv_heads})")
        self.heads, self.kv_heads, self.head_dim, self.causal = heads, kv_heads, dim // heads, causal
        self.q_proj = torch.nn.Linear(dim, dim, bias=bias)
        self.k_proj = torch.nn.Linear(dim, kv_heads * self.head_dim, bias=bias)
        self.v_proj = torch.nn.Linear(dim, kv_heads * self.head_dim, bias=bias)
        self.out_proj = torch.nn.Linear(dim, dim, bias=bias)

    def forward(self, x):
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        o = attention(q, k, v, causal=self.causal)
        return self.out_proj(o.transpose(1, 2).reshape(batch, seq, -1))
