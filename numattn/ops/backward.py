"""Attention backward for torch tensors (``numattn.torch.attention`` calls it): dq, dk, dv from the
forward's inputs, output and log-sum-exp, on the GPU or in the simulator."""

import numpy as np

from .._arrays import describe, host_storage, numba_storage_view
from .._cuda import SIMULATOR, cuda
from ..kernels.attention_backward import THREADS, backward_kernels, rows_grid
from ..kernels.launch import compiled


def attention_backward(q, k, v, o, lse, do, *, causal, scale):
    """``(dq, dk, dv)`` float32 tensors for 4-D (batch, heads, seq, dim) torch tensors ``q, k, v, o,
    do`` of one dtype (any strides) and the float32 natural-log ``lse`` [B, Hq, Sq]."""
    import torch

    if not SIMULATOR and not q.is_cuda:  # host tensors on a GPU machine: computed on the GPU, as the forward is
        grads = attention_backward(*(x.cuda() for x in (q, k, v, o, lse, do)), causal=causal, scale=scale)
        return tuple(g.cpu() for g in grads)
    dtype = str(q.dtype).removeprefix("torch.")
    delta_kernel, dq_kernel, dkdv_kernel = backward_kernels(dtype, q.shape[-1], v.shape[-1], bool(causal))
    batch, heads, seqlen_q = q.shape[:3]
    heads_kv, seqlen_kv = k.shape[1:3]
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.empty(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    delta = torch.empty(lse.shape, dtype=torch.float32, device=q.device)
    lse = lse.float().contiguous()
    scale = np.float32(scale)
    rows_q, rows_kv = batch * heads * seqlen_q, batch * heads_kv * seqlen_kv
    if SIMULATOR:
        views = [host_storage(x, describe(x, "array")) for x in (q, k, v, o, do)]
        out = [x.numpy() for x in (dq, dk, dv, delta, lse)]
        qs, ks, vs, os_, dos = views
        dqs, dks, dvs, deltas, lses = out

        def launch(kernel, rows, *args):
            compiled(kernel, None, 0, 0, "attention backward").launch_arrays(rows_grid(rows), THREADS, *args)
    else:
        stream = cuda.external_stream(torch.cuda.current_stream(q.device).cuda_stream)
        qs, ks, vs, os_, dos = (numba_storage_view(x.data_ptr(), x.shape, x.stride(), dtype) for x in (q, k, v, o, do))
        dqs, dks, dvs, deltas, lses = (cuda.as_cuda_array(x) for x in (dq, dk, dv, delta, lse))

        def launch(kernel, rows, *args):
            kernel[rows_grid(rows), THREADS, stream](*args)

    launch(delta_kernel, rows_q, os_, dos, deltas)
    launch(dq_kernel, rows_q, qs, ks, vs, dos, lses, deltas, dqs, scale)
    launch(dkdv_kernel, rows_kv, qs, ks, vs, dos, lses, deltas, dks, dvs, scale)
    return dq, dk, dv
