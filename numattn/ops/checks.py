"""Checks of the lengths and page indices that decode calls read (``check=True``, the default).

Host arrays are checked on the host before the launch. Device arrays are checked
on the GPU by a small kernel queued before the decode kernel
(``kernels/index_check.py``): no copy to the host and no synchronisation. What it
finds is raised as a ``ValueError`` by the next checked call on that GPU (the call
that read the bad value computed with it clamped into range, so it read nothing
outside the caches).
"""

import ctypes

import numpy as np

from .._arrays import FLOAT_DTYPES, describe
from .._cuda import cuda
from ..kernels import index_check
from ..kernels.compile_ahead import KernelSpec
from ..kernels.launch import array_fields, compiled, driver_call, flatten_array, zero_words
from .plans import where


def host_values(x):
    """A numpy view or copy of an index array (for a device array a device-to-host copy, so a synchronisation)."""
    if hasattr(x, "detach"):  # torch
        return x.detach().cpu().numpy()
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "copy_to_host"):  # numba device arrays, the simulator's included
        return x.copy_to_host()
    return cuda.as_cuda_array(x).copy_to_host()


def check_float_operand(op, name, ndims, expected):
    """``op`` (``describe``'s operand) has one of the ranks ``ndims`` (``expected`` says them in words), no
    zero-size dimension and a float dtype; else ValueError or TypeError naming ``name``."""
    if len(op.shape) not in ndims:
        raise ValueError(f"{name} must be {expected}, got shape {op.shape}")
    if 0 in op.shape:
        raise ValueError(f"{name} has a zero-size dimension: shape {op.shape}")
    if op.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} has dtype {op.dtype}; expected float16, bfloat16 or float32")


def check_index_operand(op, name, shape_text, ndim, device):
    """``op`` is int32, of rank ``ndim`` (``shape_text`` in words) and on ``device`` (q's); else TypeError
    or ValueError naming ``name``."""
    if op.dtype != "int32":
        raise TypeError(f"{name} must have dtype int32, got {op.dtype}")
    if len(op.shape) != ndim:
        raise ValueError(f"{name} must be {shape_text}, got shape {op.shape}")
    if op.device != device:
        raise ValueError(f"{name} must be on the same device as q ({where(device)}), got {op.where}")


def page_table_operands(page_table, seqlens, batch, device):
    """Operands of a page table ``[batch, max_pages]`` and lengths ``[batch]``, checked: int32, shapes, device."""
    t_op, s_op = describe(page_table, "page_table"), describe(seqlens, "seqlens")
    check_index_operand(t_op, "page_table", f"2-D (batch, max_pages) with batch {batch}", 2, device)
    check_index_operand(s_op, "seqlens", f"1-D (batch,) = ({batch},)", 1, device)
    if t_op.shape[0] != batch or t_op.shape[1] == 0:
        raise ValueError(f"page_table must be (batch, max_pages) with batch {batch} and max_pages >= 1, got shape {t_op.shape}")
    if s_op.shape[0] != batch:
        raise ValueError(f"seqlens must have one entry per sequence ({batch}), got shape {s_op.shape}")
    return t_op, s_op


def check_lengths_and_pages(seqlens, page_table, capacity, capacity_text, page_size, num_pages):
    """``ValueError`` for a negative length, one above ``capacity``, or a used page index outside
    ``[0, num_pages)``, checked on the host (device arrays are copied: a synchronisation)."""
    if seqlens is None:
        return
    lengths = host_values(seqlens).astype(np.int64)
    if (lengths < 0).any():
        b = int(np.argmax(lengths < 0))
        raise ValueError(_length_message(b, lengths[b], True, capacity, capacity_text))
    if (lengths > capacity).any():
        b = int(np.argmax(lengths > capacity))
        raise ValueError(_length_message(b, lengths[b], False, capacity, capacity_text))
    if page_table is None:
        return
    table = host_values(page_table)
    used = np.arange(table.shape[1])[None, :] < -(-lengths // page_size)[:, None]
    bad = used & ((table < 0) | (table >= num_pages))
    if bad.any():
        b, j = (int(x) for x in np.argwhere(bad)[0])
        raise ValueError(_page_message(b, j, table[b, j], num_pages))


def _length_message(b, value, negative, capacity, capacity_text):
    if negative:
        return f"seqlens must be non-negative, got seqlens[{b}] = {value}"
    return f"seqlens[{b}] = {value} exceeds {capacity_text} ({capacity})"


def _page_message(b, j, value, num_pages):
    return f"page_table[{b}, {j}] = {value} is not a page index in [0, {num_pages})"


class _Reports:
    """One GPU's report slot: ``claim`` (an int32 in device memory) and ``record`` (int32 in pinned,
    mapped host memory), as ``kernels/index_check.py`` writes them."""

    def __init__(self, device):
        from cuda.bindings import driver

        with cuda.gpus[device]:
            flags = driver.CU_MEMHOSTALLOC_PORTABLE | driver.CU_MEMHOSTALLOC_DEVICEMAP
            self.record_host = driver_call(driver.cuMemHostAlloc(4 * index_check.RECORD_WORDS, flags))[0]
            self.record_device = int(driver_call(driver.cuMemHostGetDevicePointer(self.record_host, 0))[0])
            self.claim = int(driver_call(driver.cuMemAlloc(4))[0])
            driver_call(driver.cuMemsetD32(self.claim, 0, 1))
        self.record = (ctypes.c_int32 * index_check.RECORD_WORDS).from_address(self.record_host)
        self.record[0] = 0

    def raise_pending(self, stream):
        """Raise what an earlier check on this GPU found, if anything, and let checks report again."""
        kind = self.record[0]
        if not kind:
            return
        b, j, value, limit = self.record[1:5]
        self.record[0] = 0
        zero_words(self.claim, 1, stream)
        if kind == index_check.PAGE_OUT_OF_RANGE:
            message = _page_message(b, j, value, limit)
        else:
            text = "the cache length" if kind == index_check.LENGTH_ABOVE_CACHE else "max_pages * page_size"
            message = _length_message(b, value, kind == index_check.LENGTH_BELOW_ZERO, limit, text)
        raise ValueError(f"{message} (found on the GPU by the check of an earlier call, whose output was "
                         "computed with the value clamped into range)")


_REPORTS = {}


def index_check_spec(paged):
    """The ``KernelSpec`` of the check kernel for a page table (``paged``) or a contiguous cache."""
    from numba import types

    i32, i64 = types.int32, types.int64
    argtypes = (types.Array(i32, 2, "A"), types.Array(i32, 1, "A"), i64, i64, i64, types.Array(i32, 1, "A"),
                types.Array(i32, 1, "A"))
    return KernelSpec(index_check.index_check_kernel, (paged,), argtypes, f"index check paged={paged}")


class DeviceIndexCheck:
    """The check kernel prepared for one call layout: ``check(stream, page_table, seqlens)`` on data
    pointers (0 for no page table) raises what an earlier check on this GPU found, then queues the
    check of these values on ``stream``."""

    def __init__(self, device, table, seqlens, capacity, page_size, num_pages):
        """``table`` and ``seqlens``: ``(shape, strides)`` of the int32 arrays (``table`` None for a
        contiguous cache of ``capacity`` keys)."""
        reports = _REPORTS.get(device)
        if reports is None:
            reports = _REPORTS[device] = _Reports(device)
        self._reports = reports
        paged = table is not None
        table = table if paged else ((1, 1), (1, 1))
        spec = index_check_spec(paged)
        kernel = compiled(spec.factory(*spec.args), spec.argtypes, device, 0, spec.label)
        fields, slots = array_fields([(*table, 4), (*seqlens, 4)])
        fields += [capacity, page_size, num_pages, *flatten_array(reports.claim, (1,), (1,), 4),
                   *flatten_array(reports.record_device, (index_check.RECORD_WORDS,), (1,), 4)]
        grid = index_check.grid(seqlens[0][0], table[0][1] if paged else 1)
        self._launch = kernel.prepare(grid, index_check.THREADS, fields, slots)

    def __call__(self, stream, page_table, seqlens):
        self._reports.raise_pending(stream)
        self._launch(stream, page_table, seqlens)
