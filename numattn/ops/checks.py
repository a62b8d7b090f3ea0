"""Checks of the lengths, offsets and page indices that decode and varlen calls read (``check=True``, the
default).

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


def varlen_message(kind, b, j, value, limit):
    """The message of a bad index value of a varlen call, as ``kernels/index_check.py`` records it."""
    name = ("cu_seqlens_q", "cu_seqlens_k")[j] if j in (0, 1) else ""
    if kind == index_check.OFFSET_NOT_ZERO:
        return f"{name} must start at 0, got {name}[0] = {value}"
    if kind == index_check.OFFSETS_DECREASE:
        return f"{name} must not decrease, got {name}[{b}] = {limit} > {name}[{b + 1}] = {value}"
    if kind == index_check.OFFSETS_PAST_ROWS:
        if j == 0:
            return f"{name}[-1] = {value} must equal total_q (q.shape[0]) = {limit}: every query row in a sequence"
        return f"{name}[-1] = {value} exceeds total_k (k.shape[0]) = {limit}"
    if kind == index_check.LONGER_THAN_MAX:
        if j == 1:
            return f"sequence {b} has {value} keys, more than max_seqlen_k = {limit}"
        return (f"sequence {b} has {value} queries (cu_seqlens_q[{b + 1}] - cu_seqlens_q[{b}]), more than "
                f"max_seqlen_q = {limit}")
    if kind == index_check.USED_OUT_OF_RANGE:
        what = "max_pages * page_size" if j else "the sequence's keys in cu_seqlens_k"
        return f"seqused_k[{b}] = {value} is not in [0, {limit}] ({what})"
    if kind == index_check.KEYS_ABOVE_PAGES:
        return f"sequence {b} has {value} keys, more than its page_table row holds (max_pages * page_size = {limit})"
    return _page_message(b, j, value, limit)


def first_varlen_problem(cu_q, cu_k, used, table, total_q, total_k, max_seqlen_q, max_seqlen_k, page_size,
                         num_pages):
    """``(kind, b, j, value, limit)`` of the first bad value among a varlen call's host index arrays (numpy; None
    for absent ones), as ``kernels/index_check.py`` records it; None when all are good."""
    for which, cu, rows in ((0, cu_q, total_q), (1, cu_k, None if table is not None else total_k)):
        if cu is None:
            continue
        cu = cu.astype(np.int64)
        if cu[0] != 0:
            return index_check.OFFSET_NOT_ZERO, 0, which, cu[0], 0
        lengths = np.diff(cu)
        if (lengths < 0).any():
            b = int(np.argmax(lengths < 0))
            return index_check.OFFSETS_DECREASE, b, which, cu[b + 1], cu[b]
        if rows is not None and (cu[-1] > rows or which == 0 and cu[-1] != rows):
            return index_check.OFFSETS_PAST_ROWS, len(cu) - 1, which, cu[-1], rows
        if which == 0 and (lengths > max_seqlen_q).any():
            b = int(np.argmax(lengths > max_seqlen_q))
            return index_check.LONGER_THAN_MAX, b, 0, lengths[b], max_seqlen_q
    capacity = None if table is None else table.shape[1] * page_size
    keys = None if cu_k is None else np.diff(cu_k.astype(np.int64))
    if used is not None:
        used = used.astype(np.int64)
        limits = np.full(len(used), capacity) if table is not None else keys
        bad = (used < 0) | (used > limits)
        if bad.any():
            b = int(np.argmax(bad))
            return index_check.USED_OUT_OF_RANGE, b, int(table is not None), used[b], limits[b]
        keys = used
    if (keys > max_seqlen_k).any():  # the backward's grid covers max_seqlen_k keys per sequence
        b = int(np.argmax(keys > max_seqlen_k))
        return index_check.LONGER_THAN_MAX, b, 1, keys[b], max_seqlen_k
    if table is None:
        return None
    if (keys > capacity).any():
        b = int(np.argmax(keys > capacity))
        return index_check.KEYS_ABOVE_PAGES, b, 0, keys[b], capacity
    used_pages = np.arange(table.shape[1])[None, :] < -(-keys // page_size)[:, None]
    bad = used_pages & ((table < 0) | (table >= num_pages))
    if bad.any():
        b, j = (int(x) for x in np.argwhere(bad)[0])
        return index_check.PAGE_OUT_OF_RANGE, b, j, table[b, j], num_pages
    return None


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
        if kind >= index_check.OFFSET_NOT_ZERO:
            message = varlen_message(kind, b, j, value, limit)
        elif kind == index_check.PAGE_OUT_OF_RANGE:
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


def varlen_check_spec(has_cu_k, seqused, paged):
    """The ``KernelSpec`` of the check kernel of a varlen call with these index arrays."""
    from numba import types

    i32, i64 = types.int32, types.int64
    one = types.Array(i32, 1, "A")
    argtypes = (one, one, one, types.Array(i32, 2, "A"), i64, i64, i64, i64, i64, i64, one, one)
    return KernelSpec(index_check.varlen_check_kernel, (has_cu_k, seqused, paged), argtypes,
                      f"varlen index check cu_seqlens_k={has_cu_k} seqused_k={seqused} paged={paged}")


class DeviceVarlenCheck:
    """The check kernel prepared for one varlen call layout (``sequences``: the call's ``Sequences``):
    ``check(stream, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table)`` on data pointers (0 for an absent
    array) raises what an earlier check on this GPU found, then queues the check of these values on ``stream``."""

    def __init__(self, device, sequences):
        reports = _REPORTS.get(device)
        if reports is None:
            reports = _REPORTS[device] = _Reports(device)
        self._reports = reports
        s = sequences
        spec = varlen_check_spec(s.cu_seqlens_k is not None, s.seqused_k is not None, s.page_table is not None)
        kernel = compiled(spec.factory(*spec.args), spec.argtypes, device, 0, spec.label)
        fields, slots = array_fields(s.arrays())
        page_size = max(s.page_size, 1)
        fields += [s.total_q, s.total_k, s.max_seqlen_q, s.max_seqlen_k, page_size, s.total_k // page_size,
                   *flatten_array(reports.claim, (1,), (1,), 4),
                   *flatten_array(reports.record_device, (index_check.RECORD_WORDS,), (1,), 4)]
        max_pages = 1 if s.page_table is None else s.page_table.shape[1]
        grid = index_check.grid(s.cu_seqlens_q.shape[0] - 1, max_pages)
        self._launch = kernel.prepare(grid, index_check.THREADS, fields, slots)

    def __call__(self, stream, *pointers):
        self._reports.raise_pending(stream)
        self._launch(stream, *pointers)
