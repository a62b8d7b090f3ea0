"""``numattn.merge_states``: attention over the union of two key sets from their partial results."""

import functools

import numba
import numpy as np
from numba import types

from .._arrays import (
    FLOAT_DTYPES,
    Array,
    describe,
    float32_values,
    host_storage,
    rounded_storage,
    storage_dtype,
    wrap_host,
)
from .._cuda import SIMULATOR, cuda, simulating
from ..kernels import cpu
from ..kernels.launch import array_fields, compiled
from ..kernels.split_merge import MERGE_THREADS, merge_kernel


def merge_states(o_a: Array, lse_a: Array, o_b: Array, lse_b: Array) -> tuple[Array, Array]:
    """Attention over the union of two disjoint key sets from the two partial results.

    ``o_*`` ``[..., head_dim_v]`` and their natural-log ``lse_*`` ``[...]`` (float32), as
    ``attention(..., return_lse=True)`` or ``decode(..., return_lse=True)`` return them for
    the two key sets; ``-inf`` marks a row that saw no key (both ``-inf``: ``o`` 0, ``lse`` ``-inf``).
    A NaN or ``+inf`` ``lse`` on either side makes that row's ``o`` and ``lse`` NaN (``+inf`` leaves
    no finite weights). Returns ``(o, lse)`` like ``o_a``. The split-KV combine step uses the same
    weights: ``exp(lse_x - lse)``.
    """
    ops = [describe(x, n) for x, n in ((o_a, "o_a"), (lse_a, "lse_a"), (o_b, "o_b"), (lse_b, "lse_b"))]
    oa, la, ob, lb = ops
    if oa.dtype not in FLOAT_DTYPES or ob.dtype != oa.dtype:
        raise TypeError(f"o_a and o_b must share a float dtype, got {oa.dtype} and {ob.dtype}")
    if la.dtype != "float32" or lb.dtype != "float32":
        raise TypeError(f"lse_a and lse_b must be float32, got {la.dtype} and {lb.dtype}")
    if oa.shape != ob.shape or len(oa.shape) < 1 or la.shape != oa.shape[:-1] or lb.shape != la.shape:
        raise ValueError(f"o_a, o_b must share a shape [..., head_dim_v] and lse_a, lse_b be [...]: got "
                         f"{oa.shape}, {ob.shape}, {la.shape}, {lb.shape}")
    if len({op.device for op in ops}) > 1:
        raise ValueError("o_a, lse_a, o_b and lse_b must be on one device")
    rows, dv = int(np.prod(oa.shape[:-1])), oa.shape[-1]
    kernel = merge_kernel(oa.dtype, dv)
    if oa.device is None:
        flat = [np.ascontiguousarray(host_storage(x, op)).reshape(rows, dv) if i % 2 == 0
                else np.ascontiguousarray(host_storage(x, op)).reshape(rows)
                for i, (x, op) in enumerate(zip((o_a, lse_a, o_b, lse_b), ops, strict=True))]
        o = np.empty((rows, dv), storage_dtype(oa.dtype))
        lse = np.empty(rows, np.float32)
        if rows and SIMULATOR and not simulating():  # the CPU path
            merged, lse = cpu.merge_states(float32_values(flat[0], oa.dtype), flat[1], float32_values(flat[2], oa.dtype),
                                           flat[3])
            o = rounded_storage(merged, oa.dtype)
        elif rows:
            if SIMULATOR:
                compiled(kernel, None, 0, 0, f"merge {oa.dtype}").launch_arrays(rows, MERGE_THREADS, *flat, o, lse)
            else:
                device = [cuda.to_device(a) for a in (*flat, o, lse)]
                kernel[rows, MERGE_THREADS](*device)
                o, lse = device[4].copy_to_host(), device[5].copy_to_host()
        return (wrap_host(o.reshape(oa.shape), o_a, oa.dtype), wrap_host(lse.reshape(la.shape), o_a, "float32"))
    if not all(op.kind == "torch" for op in ops):
        raise TypeError("merge_states on a GPU takes torch tensors")
    import torch

    a, b = o_a.reshape(rows, dv).contiguous(), o_b.reshape(rows, dv).contiguous()
    la_flat, lb_flat = lse_a.reshape(rows).contiguous(), lse_b.reshape(rows).contiguous()
    o, lse = torch.empty_like(a), torch.empty_like(la_flat)
    if rows:
        launch = _merge_launch(oa.dtype, dv, rows, oa.device)
        stream = torch.cuda.current_stream(a.device).cuda_stream
        launch(stream, *(x.data_ptr() for x in (a, la_flat, b, lb_flat, o, lse)))
    return o.reshape(oa.shape), lse.reshape(la.shape)


@functools.lru_cache(maxsize=256)
def _merge_launch(dtype, head_dim_v, rows, device):
    storage = numba.from_dtype(storage_dtype(dtype))
    o_type, lse_type = types.Array(storage, 2, "A"), types.Array(types.float32, 1, "A")
    kernel = compiled(merge_kernel(dtype, head_dim_v), (o_type, lse_type) * 3, device, 0, f"merge {dtype} dv={head_dim_v}")
    item = storage_dtype(dtype).itemsize
    fields, slots = array_fields((((rows, head_dim_v), (head_dim_v, 1), item), ((rows,), (1,), 4)) * 3)
    return kernel.prepare(rows, MERGE_THREADS, fields, slots)
