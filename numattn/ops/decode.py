"""``numattn.decode``, ``numattn.paged_decode`` and their plans: attention for generation.

Both decode entry points reduce to one problem: query rows ``[B, Hq, Sq, D]``
against keys and values in 4-D ``[pages, Hkv, page_size, D]`` views (any
strides; a contiguous cache is one page per sequence), an optional page table
and optional per-sequence lengths. ``kernels/decode.py`` computes it with
split-KV flash decoding.
"""

import sys
from dataclasses import dataclass, replace

import numba
import numpy as np
from numba import types

from .._arrays import (
    FLOAT_DTYPES,
    Array,
    Operand,
    cai_stream,
    contiguous_strides,
    describe,
    float32_values,
    from_dlpack,
    host_storage,
    is_torch,
    rounded_storage,
    storage_dtype,
    torch_current,
    wrap_host,
)
from .._cuda import SIMULATOR, cuda, simulating
from ..configs.decode import decode_config
from ..kernels import cpu
from ..kernels.compile_ahead import compile_ahead
from ..kernels.constants import LOG2E
from ..kernels.decode import NUM_THREADS, decode_kernel, decode_mma_kernel
from ..kernels.launch import array_fields, compiled, device_limits
from ..kernels.split_merge import MAX_SPLITS
from ..tuning.models import split_candidates, split_count
from ..tuning.store import tuned_config
from .attention import check_one_dtype_and_device, choice, out_operand, softmax_scale
from .checks import (
    DeviceIndexCheck,
    check_float_operand,
    check_index_operand,
    check_lengths_and_pages,
    host_values,
    index_check_spec,
    page_table_operands,
)
from .plans import PLANS, LaunchPlan, array_pointer, array_signature, on_device, records_grad, tensor_pointer
from .score_mods import NO_OPTIONS, ScoreOptions, score_options, window_side_types
from .workspace import WorkspaceLayout, capturing_now

_LAYOUTS = ("bhsd", "bshd")
_KV_LAYOUTS = ("nhd", "hnd")
# Head dims the decode takes: what the CUDA-core kernel holds (a row over 32 lanes, at most 32 floats
# each); the tensor-core kernel takes up to 256 (``configs.decode.decode_mma_supported``).
MAX_DECODE_HEAD_DIM = 1024


@dataclass(frozen=True)
class _Array:
    """One kernel argument: its operand (None for an unused placeholder) and the 4-D (or other) view the kernel reads."""

    op: Operand
    shape: tuple
    strides: tuple  # in elements


@dataclass(frozen=True)
class DecodeProblem:
    """A validated decode call in the kernel's terms."""

    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    head_dim: int
    head_dim_v: int
    dtype: str
    device: object
    scale: float
    return_lse: bool
    q: _Array  # [B, Hq, Sq, D]
    k: _Array  # [pages, Hkv, page_size, D]
    v: _Array
    page_table: _Array  # [B, max_pages] int32, or None
    seqlens: _Array  # [B] int32, or None
    out_shape: tuple  # the user's layout
    out_view: tuple  # (shape, strides) of the output as [B, Hq, Sq, Dv]: over a contiguous out_shape array, or out
    capacity: int  # keys a sequence can hold
    layout: str  # of q and the output
    squeezed: bool  # q and the output without their seqlen_q axis
    options: ScoreOptions = NO_OPTIONS  # window, softcap, ALiBi, sinks

    def with_contiguous_out(self):
        """This problem with the output written to a contiguous array of ``out_shape``."""
        return replace(self, out_view=_output_view(self.out_shape, self.layout, self.squeezed))

    @property
    def vector_loads(self):
        per_copy = 16 // storage_dtype(self.dtype).itemsize
        return all(
            a.strides[-1] == 1 and all(s % per_copy == 0 for s in a.strides[:-1]) and a.op.ptr % 16 == 0
            and a.shape[-1] % per_copy == 0
            for a in (self.q, self.k, self.v)
        )

    @property
    def lse_shape(self):
        return (self.batch, self.heads_q, self.seqlen_q)


def _query(q, layout):
    """``(operand, [B, Hq, Sq, D] view, squeezed)`` of the query argument."""
    op = describe(q, "q")
    check_float_operand(op, "q", (3, 4), "(batch, heads, head_dim) or 4-D " + (
        "(batch, heads, seqlen_q, head_dim)" if layout == "bhsd" else "(batch, seqlen_q, heads, head_dim)"))
    if len(op.shape) == 3:
        b, h, d = op.shape
        return op, _Array(op, (b, h, 1, d), (op.strides[0], op.strides[1], 0, op.strides[2])), True
    axes = (0, 1, 2, 3) if layout == "bhsd" else (0, 2, 1, 3)
    return op, _Array(op, tuple(op.shape[a] for a in axes), tuple(op.strides[a] for a in axes)), False


def _output_view(shape, layout, squeezed, strides=None):
    """The output of ``shape`` (contiguous, or with ``strides`` in elements) seen as ``[B, Hq, Sq, Dv]``."""
    strides = contiguous_strides(shape) if strides is None else strides
    if squeezed:
        b, h, dv = shape
        return (b, h, 1, dv), (strides[0], strides[1], 0, strides[2])
    axes = (0, 1, 2, 3) if layout == "bhsd" else (0, 2, 1, 3)
    return tuple(shape[a] for a in axes), tuple(strides[a] for a in axes)


def _common_checks(q_op, q4, k_op, v_op, k4, v4):
    check_one_dtype_and_device({"q": q_op, "k": k_op, "v": v_op}, "q and the key/value caches")
    heads_q, head_dim = q4.shape[1], q4.shape[3]
    heads_kv = k4.shape[1]
    if k4.shape[3] != head_dim:
        raise ValueError(f"key head_dim must equal q head_dim {head_dim}, got {k4.shape[3]}")
    if v4.shape[:3] != k4.shape[:3]:
        raise ValueError(f"the value cache must match the key cache except in head_dim, got {v_op.shape} and {k_op.shape}")
    if heads_q % heads_kv:
        raise ValueError(f"query heads ({heads_q}) must be a multiple of key/value heads ({heads_kv})")
    for name, d in (("q/k head_dim", head_dim), ("v head_dim", v4.shape[3])):
        if d > MAX_DECODE_HEAD_DIM:
            raise ValueError(f"{name} must be at most {MAX_DECODE_HEAD_DIM}, got {d}")


def _caches(q_op, q4, k, v, names, text, axes):
    """Operands and ``[pages, Hkv, page_size, D]`` views of a key and a value cache, checked against q."""
    k_op, v_op = describe(k, names[0]), describe(v, names[1])
    for name, op in zip(names, (k_op, v_op), strict=True):
        check_float_operand(op, name, (4,), text)
    k4, v4 = (_Array(op, tuple(op.shape[a] for a in axes), tuple(op.strides[a] for a in axes)) for op in (k_op, v_op))
    _common_checks(q_op, q4, k_op, v_op, k4, v4)
    return k4, v4


def _validate_decode(q, k_cache, v_cache, seqlens, scale, layout, return_lse, out, mods):
    choice("layout", layout, _LAYOUTS)
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    q_op, q4, squeezed = _query(q, layout)
    text = "(batch, heads, max_seqlen, head_dim)" if layout == "bhsd" else "(batch, max_seqlen, heads, head_dim)"
    axes = (0, 1, 2, 3) if layout == "bhsd" else (0, 2, 1, 3)
    k4, v4 = _caches(q_op, q4, k_cache, v_cache, ("k_cache", "v_cache"), text, axes)
    if k4.shape[0] != q4.shape[0]:
        raise ValueError(f"k_cache must have q's batch size {q4.shape[0]}, got {k4.shape[0]}")
    seq = None
    if seqlens is not None:
        s_op = describe(seqlens, "seqlens")
        check_index_operand(s_op, "seqlens", f"1-D (batch,) = ({q4.shape[0]},)", 1, q_op.device)
        if s_op.shape[0] != q4.shape[0]:
            raise ValueError(f"seqlens must have one entry per sequence ({q4.shape[0]}), got shape {s_op.shape}")
        seq = _Array(s_op, s_op.shape, s_op.strides)
    return _problem(q_op, q4, k4, v4, None, seq, k4.shape[2], scale, layout, return_lse, squeezed, out, mods)


def _validate_paged(q, k_pages, v_pages, page_table, seqlens, scale, kv_layout, return_lse, out, mods):
    choice("kv_layout", kv_layout, _KV_LAYOUTS)
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    q_op, q4, squeezed = _query(q, "bhsd")
    text = "(num_pages, page_size, heads, head_dim)" if kv_layout == "nhd" else "(num_pages, heads, page_size, head_dim)"
    axes = (0, 2, 1, 3) if kv_layout == "nhd" else (0, 1, 2, 3)
    k4, v4 = _caches(q_op, q4, k_pages, v_pages, ("k_pages", "v_pages"), text, axes)
    batch = q4.shape[0]
    t_op, s_op = page_table_operands(page_table, seqlens, batch, q_op.device)
    table, seq = _Array(t_op, t_op.shape, t_op.strides), _Array(s_op, s_op.shape, s_op.strides)
    return _problem(q_op, q4, k4, v4, table, seq, t_op.shape[1] * k4.shape[2], scale, "bhsd", return_lse, squeezed,
                    out, mods)


def _problem(q_op, q4, k4, v4, table, seq, capacity, scale, layout, return_lse, squeezed, out, mods):
    """The ``DecodeProblem``; ``mods`` the arguments ``(window, softcap, alibi_slopes, sinks)``."""
    batch, heads_q, seqlen_q, head_dim = q4.shape
    head_dim_v = v4.shape[3]
    if squeezed:
        out_shape = (batch, heads_q, head_dim_v)
    elif layout == "bhsd":
        out_shape = (batch, heads_q, seqlen_q, head_dim_v)
    else:
        out_shape = (batch, seqlen_q, heads_q, head_dim_v)
    out_strides = None
    if out is not None:
        out_strides = out_operand(out, q_op, out_shape).strides
    return DecodeProblem(
        batch, heads_q, k4.shape[1], seqlen_q, head_dim, head_dim_v, q_op.dtype, q_op.device,
        softmax_scale(scale, head_dim), bool(return_lse), q4, k4, v4, table, seq, out_shape,
        _output_view(out_shape, layout, squeezed, out_strides), capacity, layout, squeezed,
        score_options(*mods, True, batch, heads_q, q_op.device),
    )


# GPUs whose DRAM feeds each SM faster than this (GB/s; an H200's 4.8 TB/s on 132 SMs, not an H100's
# 3.35) take a second block per SM where each split still streams at least LONG_SPLIT_KEYS keys:
# measured on an H200, W2 (32768 keys) ran 2% faster in 4 splits than in 2, W3 (8192 keys) 9% slower
# in 32 than in 16; on an H100, 4 splits were not faster on W2
WIDE_GBS_PER_SM = 30
LONG_SPLIT_KEYS = 4096


def _splits(p, rows, blocks_per_sm, min_keys, limits):
    """``(splits, row_chunks)``: key splits per (sequence, KV head, chunk of query rows).

    Time goes as the waves of blocks times the keys per block, ``ceil(blocks / slots) / splits``
    with ``slots = blocks_per_sm · sms``; the fewest splits that minimise it win (each split adds
    partial results to combine), with at least ``min_keys`` keys per split, at most ``MAX_SPLITS``,
    and no more splits than keep one block per SM (more only added combine work where measured),
    or two on GPUs with a wide memory per SM (see ``WIDE_GBS_PER_SM``).
    """
    row_chunks = -(-(p.heads_q // p.heads_kv * p.seqlen_q) // rows)
    work, sms = p.batch * p.heads_kv * row_chunks, limits["sms"]
    splits = split_count(work, p.capacity, blocks_per_sm, min_keys, sms)
    if limits["dram_gbs"] > WIDE_GBS_PER_SM * sms and blocks_per_sm >= 2:
        wide = split_count(work, p.capacity, blocks_per_sm, min_keys, sms, per_sm=2)
        if p.capacity >= wide * LONG_SPLIT_KEYS:
            splits = wide
    return splits, row_chunks


class _Plan:
    """Kernels, grid and argument layout of one decode problem.

    The tensor-core kernel where it applies (fp16/bf16, head dims multiples of
    16, 16-byte aligned rows, sm_80+), the CUDA-core kernel otherwise; with
    several splits, fp32 workspaces for the partial results and the kernel
    that combines them.
    """

    def __init__(self, p, splits=None):
        self.problem = p
        limits = device_limits(0 if p.device is None else p.device)
        vector = p.vector_loads
        group = p.heads_q // p.heads_kv
        config = decode_config(p.dtype, p.head_dim, p.head_dim_v, vector, group * p.seqlen_q, limits)
        self.stages, self.shared_bytes = config.stages, config.shared_bytes
        auto_splits, row_chunks = _splits(p, config.rows, *config.splitting, limits)
        self.splits = min(splits or auto_splits, MAX_SPLITS)
        self.split = self.splits > 1
        self.grid = (self.splits, p.heads_kv * row_chunks, p.batch)
        flags = {"paged": p.page_table is not None, "has_seqlens": p.seqlens is not None, "split": self.split,
                 "write_lse": p.return_lse, "mods": p.options.mods}
        if self.stages is not None:
            self.decode = decode_mma_kernel(p.dtype, p.head_dim, p.head_dim_v, group, p.seqlen_q, config, **flags)
        else:
            self.decode = decode_kernel(p.dtype, p.head_dim, p.head_dim_v, group, p.seqlen_q, config,
                                        vector_loads=vector, **flags)
        self.part_shape = (p.batch, p.heads_q, p.seqlen_q, self.splits, p.head_dim_v)
        self.counter_shape = self.grid[2:0:-1]  # [B, row chunks of every KV head]: the merge's tickets
        kind = f"mma stages={self.stages}" if self.stages else f"simt rows={config.rows} vector={vector}"
        self.label = (f"decode {kind} {p.dtype} d={p.head_dim}/{p.head_dim_v} group={group} sq={p.seqlen_q} "
                      f"paged={p.page_table is not None} splits={self.splits} {p.options.label()}").rstrip()

    @property
    def workspace_shapes(self):
        """Shapes of the split workspace's parts: fp32 partial outputs, their fp32 log2-sum-exps, int32 counters."""
        return self.part_shape, self.part_shape[:4], self.counter_shape

    def check_values(self, q, page_table, seqlens):
        """``ValueError`` for lengths the caches cannot serve or used page indices outside the pages
        (host arrays: checked here; device arrays: see ``DeviceIndexCheck``)."""
        p = self.problem
        what = "the cache length" if p.page_table is None else "max_pages * page_size"
        check_lengths_and_pages(seqlens, page_table, p.capacity, what, p.k.shape[2], p.k.shape[0])

    def arrays(self):
        """``(shape, strides, itemsize)`` of the decode kernel's array arguments, in order."""
        p = self.problem
        item = storage_dtype(p.dtype).itemsize

        def array(shape, used, itemsize=4):
            return (shape, contiguous_strides(shape), itemsize) if used else ((1,) * len(shape), (1,) * len(shape), itemsize)

        table = (p.page_table.shape, p.page_table.strides, 4) if p.page_table is not None else array((1, 1), False)
        seq = (p.seqlens.shape, p.seqlens.strides, 4) if p.seqlens is not None else array((1,), False)
        return [
            (p.q.shape, p.q.strides, item), (p.k.shape, p.k.strides, item), (p.v.shape, p.v.strides, item),
            table, seq, (*p.out_view, item), array(p.lse_shape, p.return_lse),
            *(array(shape, self.split) for shape in self.workspace_shapes),
        ]


class _DevicePlan(_Plan, LaunchPlan):
    """Launches on device arrays: prepared argument blocks, only pointers and the stream change per call
    (``checked_on_device``: lengths checked on the GPU, whose kernel compiles ahead in a worker)."""

    def __init__(self, p, splits=None, checked_on_device=True):
        super().__init__(p, splits)
        storage = numba.from_dtype(storage_dtype(p.dtype))
        f32, i32 = types.float32, types.int32
        argtypes = (
            types.Array(storage, 4, "A"), types.Array(storage, 4, "A"), types.Array(storage, 4, "A"),
            types.Array(i32, 2, "A"), types.Array(i32, 1, "A"), types.Array(storage, 4, "A"),
            types.Array(f32, 3, "A"), types.Array(f32, 5, "A"), types.Array(f32, 4, "A"), types.Array(i32, 2, "A"),
            f32, types.Array(f32, 2, "A"), types.Array(f32, 1, "A"), types.int64, types.int64, f32, f32,
        )
        if checked_on_device and p.seqlens is not None:  # the check's kernel compiles in a worker meanwhile
            compile_ahead([index_check_spec(p.page_table is not None)], p.device)
        kernel = compiled(self.decode, argtypes, p.device, self.shared_bytes, self.label)
        fields, slots = array_fields(self.arrays())
        fields.append(np.float32(p.scale * LOG2E))
        mod_fields, mod_slots = array_fields(p.options.arrays(p.batch, p.heads_q))
        slots[5:5] = [len(fields) + slot for slot in mod_slots]
        fields += mod_fields + p.options.scalars()
        # (stream, q, k, v, page_table, seqlens, alibi, sinks, out, lse) and with splits (..., part, part_lse,
        # counters); the kernel reads no workspace without splits
        self._kernel, self._fields, self._slots = kernel, fields, slots if self.split else slots[:9]
        self.launch = kernel.prepare(self.grid, NUM_THREADS, fields, self._slots)
        self.device, self.dtype, self.out_shape = p.device, p.dtype, p.out_shape
        self.lse_shape = p.lse_shape if p.return_lse else None
        self.workspace = WorkspaceLayout(self.workspace_shapes) if self.split else None
        self._index_check = None

    def __call__(self, q, k, v, page_table, seqlens, alibi=None, sinks=None, out=None):
        return self.run_device_arrays((q, k, v, page_table, seqlens, alibi, sinks), out)

    def check_values(self, q, page_table, seqlens):
        """Raise what an earlier call's check found on this GPU, then queue the check of these lengths and
        page indices on q's stream (no synchronisation)."""
        if self._index_check is None:
            p = self.problem
            table = None if p.page_table is None else (p.page_table.shape, p.page_table.strides)
            self._index_check = DeviceIndexCheck(p.device, table, (p.seqlens.shape, p.seqlens.strides), p.capacity,
                                                 p.k.shape[2], p.k.shape[0])
        self._index_check(self.stream_of(q), array_pointer(page_table), array_pointer(seqlens))

    def stream_of(self, q):
        """The raw handle of the stream a launch on ``q`` runs on."""
        return cai_stream(q)

    def bound_launch(self, k, v, page_table, seqlens, alibi, sinks):
        """A launch with the data pointers of the caches, page table, lengths, ALiBi slopes and sinks (ints, 0
        for none) fixed; it takes those of q, out, lse (and with splits the workspace's, as ``launch``)."""
        fields = list(self._fields)
        for slot, pointer in zip(self._slots[1:7], (k, v, page_table, seqlens, alibi, sinks), strict=True):
            fields[slot] = pointer
        return self._kernel.prepare(self.grid, NUM_THREADS, fields, self._slots[:1] + self._slots[7:])


class _TorchPlan(_DevicePlan):
    """torch CUDA tensors, on torch's current stream; outputs from torch's allocator, the split workspace
    from ``SplitWorkspaces``."""

    def __init__(self, p, splits=None):
        super().__init__(p, splits)
        self._current_stream = torch_current()[1]
        self._run = self.torch_runner()

    def __call__(self, q, k, v, page_table, seqlens, alibi=None, sinks=None, out=None):
        return self._run(out, q.data_ptr(), k.data_ptr(), v.data_ptr(), tensor_pointer(page_table),
                         tensor_pointer(seqlens), tensor_pointer(alibi), tensor_pointer(sinks))

    def stream_of(self, q):
        return self._current_stream(self.problem.device)


class _HostPlan(_Plan):
    """Host arrays: on a GPU machine contiguous copies go to the device and the result comes back;
    without a GPU the CPU path runs, or under ``numattn.simulate()`` the kernels in numba's simulator
    on numpy views."""

    def __init__(self, p, splits=None):
        super().__init__(p, splits)
        self._device_plan = None  # made by the first call on a GPU machine

    def __call__(self, q, k, v, page_table, seqlens, alibi=None, sinks=None, out=None):
        result = self._compute(q, k, v, page_table, seqlens, alibi, sinks)
        if out is None:
            return result
        o = result[0] if self.problem.return_lse else result
        if is_torch(out):
            out.copy_(o)
        elif isinstance(out, np.ndarray):
            np.copyto(out, o)
        else:  # numba device arrays (the simulator's)
            out.copy_to_device(o)
        return (out, result[1]) if self.problem.return_lse else out

    def _compute(self, q, k, v, page_table, seqlens, alibi, sinks):
        p = self.problem
        views = []
        for x, a in ((q, p.q), (k, p.k), (v, p.v), (page_table, p.page_table), (seqlens, p.seqlens)):
            if x is None:
                views.append(None)
                continue
            storage = host_storage(x, a.op) if a.op.dtype in FLOAT_DTYPES else host_values(x)
            item = storage.itemsize
            views.append(np.lib.stride_tricks.as_strided(storage, a.shape, tuple(s * item for s in a.strides)))
        head_terms = [None if x is None else host_storage(x, op)
                      for x, op in ((alibi, p.options.alibi), (sinks, p.options.sinks))]
        if not SIMULATOR:
            return self._on_device(q, views + head_terms)
        out = np.empty(p.out_shape, storage_dtype(p.dtype))
        item = out.itemsize
        o4 = np.lib.stride_tricks.as_strided(out, p.out_view[0], tuple(s * item for s in p.out_view[1]))
        if not simulating():
            lse = self._on_cpu(views, o4, *head_terms)
            result = wrap_host(out, q, p.dtype)
            return (result, wrap_host(lse, q, "float32")) if p.return_lse else result
        lse, part, part_lse = (np.empty(shape, np.float32) for shape in (p.lse_shape, *self.workspace_shapes[:2]))
        counters = np.zeros(self.counter_shape, np.int32)
        table = views[3] if views[3] is not None else np.zeros((1, 1), np.int32)
        lengths = views[4] if views[4] is not None else np.zeros(1, np.int32)
        compiled(self.decode, None, 0, self.shared_bytes, self.label).launch_arrays(
            self.grid, NUM_THREADS, *views[:3], table, lengths, o4, lse, part, part_lse, counters,
            np.float32(p.scale * LOG2E), *p.options.host_arrays(alibi, sinks, p.batch, p.heads_q),
            *p.options.scalars())
        result = wrap_host(out, q, p.dtype)
        return (result, wrap_host(lse, q, "float32")) if p.return_lse else result

    def _on_cpu(self, views, o4, alibi, sinks):
        """The CPU path: writes the output into the storage view ``o4`` ``[B, Hq, Sq, Dv]``, returns the LSE."""
        p = self.problem
        table, lengths = views[3:]
        if table is None:  # a contiguous cache: one page per sequence
            table = np.arange(p.batch, dtype=np.int32)[:, None]
        if lengths is None:
            lengths = np.full(p.batch, p.capacity, np.int32)
        o, lse = cpu.paged_decode(*(float32_values(x, p.dtype) for x in views[:3]), table, lengths, p.scale,
                                  p.options.window, p.options.softcap, alibi, sinks)
        o4[...] = rounded_storage(o, p.dtype)
        return lse

    def _on_device(self, q, views):
        """The device plan of this problem, made on the first call for the then current GPU, on contiguous
        copies of ``views``."""
        p = self.problem
        if self._device_plan is None:
            device = cuda.get_current_device().id

            def moved(a, x):
                strides = contiguous_strides(x.shape)
                return _Array(replace(a.op, kind="numba", device=device, ptr=0, strides=strides), x.shape, strides)

            names = ("q", "k", "v", "page_table", "seqlens")
            fields = {name: moved(getattr(p, name), x) for name, x in zip(names, views[:5], strict=True) if x is not None}
            on_gpu = replace(p, device=device, options=p.options.on_device(device), **fields)
            self._device_plan = _DevicePlan(on_gpu, self.splits, checked_on_device=False)
        result = on_device(self._device_plan, views)
        if p.return_lse:
            return wrap_host(result[0], q, p.dtype), wrap_host(result[1], q, "float32")
        return wrap_host(result, q, p.dtype)


def tuning_options(p):
    """``[(None, splits, modelled seconds)]`` of decode problem ``p``: the key splits ``numattn.tune`` tries."""
    itemsize = 4 if p.dtype == "float32" else 2
    row_bytes = itemsize * (p.head_dim + p.head_dim_v)
    return split_candidates(p.batch * p.heads_kv, p.capacity, row_bytes,
                            itemsize * p.heads_q * p.seqlen_q * (p.head_dim + p.head_dim_v))


def _tuned_splits(problem):
    """The key splits ``numattn.tune`` stored for this problem, or None (the heuristic's)."""
    tuned = tuned_config("decode", problem, tuning_options)
    return None if tuned is None else tuned[1]


def make_plan(p, splits=None):
    """The plan of problem ``p`` (from ``validate_decode_args`` or ``validate_paged_args``) for its kind of
    arrays with ``splits`` key splits (the heuristic's when None): ``plan(q, k, v, page_table, seqlens,
    out)`` runs it."""
    ops = [a.op for a in (p.q, p.k, p.v, p.page_table, p.seqlens) if a is not None]
    if p.device is None or SIMULATOR:  # the simulator's device arrays are numpy arrays underneath
        return _HostPlan(p.with_contiguous_out(), splits)  # computes into its own array, copied into an ``out``
    if all(op.kind == "torch" for op in ops):
        return _TorchPlan(p, splits)
    return _DevicePlan(p, splits)


def _torch_key(kind, q, k, v, table, lengths, alibi, sinks, out, options):
    """Plan-cache key of a call on torch tensors, ``array_signature``'s fields in one flat tuple (the hot path);
    AttributeError for other arrays. Options enter with their types, so that a cached plan never accepts
    what validation would reject."""
    return (
        kind,
        q.__class__, q.dtype, q.shape, q.stride(), q.device,
        k.__class__, k.dtype, k.shape, k.stride(), k.device,
        v.__class__, v.dtype, v.shape, v.stride(), v.device,
        (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15,  # 16-byte alignment picks the kernel
        None if table is None else (table.__class__, table.dtype, table.shape, table.stride(), table.device),
        None if lengths is None else (lengths.__class__, lengths.dtype, lengths.shape, lengths.stride(), lengths.device),
        None if out is None else (out.__class__, out.dtype, out.shape, out.stride(), out.device, out.data_ptr() & 15),
        None if alibi is None else (alibi.__class__, alibi.dtype, alibi.shape, alibi.stride(), alibi.device),
        None if sinks is None else (sinks.__class__, sinks.dtype, sinks.shape, sinks.stride(), sinks.device),
        *options, *map(type, options), window_side_types(options[3]),  # options[3]: the window
    )


def _validated(validate, arrays, options, out):
    """``validate``'s problem of a call's ``arrays`` ``[q, caches, page_table, seqlens, alibi, sinks]`` and
    ``options`` ``(scale, layout, return_lse, window, softcap)``."""
    *arrays, alibi, sinks = (from_dlpack(x) if x is not None else None for x in arrays)
    scale, layout, return_lse, window, softcap = options
    return validate(*arrays, scale, layout, return_lse, out, window, softcap, alibi, sinks)


_NO_GRADIENTS = ("q, k, v or sinks requires grad, and numattn.{} records no gradients (decode is inference): call it "
                 "under torch.no_grad() or torch.inference_mode()")


def _refuse_gradients(kind, arrays):
    """ValueError where torch would record gradients through a call's ``arrays`` ``[q, caches, page_table,
    seqlens, alibi, sinks]``: q, the caches or the sinks."""
    if records_grad(arrays[0], arrays[1], arrays[2], arrays[6]):
        raise ValueError(_NO_GRADIENTS.format(kind))


def _run(kind, validate, arrays, options, check, out):
    if check.__class__ is not bool and not isinstance(check, np.bool_):
        raise TypeError(f"check must be a bool, got {type(check).__name__}")
    _refuse_gradients(kind, arrays)
    try:
        try:
            key = _torch_key(kind, *arrays, out, options)
        except AttributeError:  # not all torch tensors
            key = (kind, *map(array_signature, arrays), array_signature(out), *options, *map(type, options),
                   window_side_types(options[3]))
        plan = PLANS.get(key)  # hashes the key once
    except TypeError:  # an argument without a signature, or unhashable options: validated and planned every call
        key = plan = None
    if plan is None:
        arrays = [from_dlpack(x) if x is not None else None for x in arrays]
        out = from_dlpack(out) if out is not None else None
        problem = _validated(validate, arrays, options, out)
        plan = make_plan(problem, _tuned_splits(problem))
        if key is not None:
            PLANS.store(key, plan)
    if check and arrays[4] is not None and not _capturing(plan.problem):  # the values checked are seqlens
        plan.check_values(arrays[0], arrays[3], arrays[4])
    return plan(*arrays, out)


def _capturing(p):
    """Whether torch is capturing a CUDA graph on the current stream (no host copies allowed then)."""
    if p.device is None or p.q.op.kind != "torch":
        return False
    import torch

    return capturing_now(torch)


def decode(q: Array, k_cache: Array, v_cache: Array, *, seqlens: Array | None = None, scale: float | None = None,
           window: tuple | None = None, softcap: float | None = None, alibi_slopes: Array | None = None,
           sinks: Array | None = None, layout: str = "bhsd", return_lse: bool = False, check: bool = True,
           out: Array | None = None) -> Array | tuple[Array, Array]:
    """Attention of a few new query tokens per sequence over a KV cache (split-KV flash decoding).

    Parameters
    ----------
    q : array ``[batch, heads_q, head_dim]`` (one new token per sequence), or
        ``[batch, heads_q, seqlen_q, head_dim]`` (``"bhsd"``) / ``[batch, seqlen_q, heads_q, head_dim]``
        (``"bshd"``) for a few new tokens (speculative decoding): token ``i`` sees keys
        ``t <= seqlen - seqlen_q + i`` (causal, bottom-right aligned). float16, bfloat16 or float32.
    k_cache, v_cache : ``[batch, heads_kv, max_seqlen, head_dim]`` (``"bhsd"``) or
        ``[batch, max_seqlen, heads_kv, head_dim]`` (``"bshd"``); v's head dim may differ.
        ``heads_q`` must be a multiple of ``heads_kv`` (any group size).
    seqlens : int32 array ``[batch]``, optional
        Valid keys per sequence (the first ``seqlens[b]`` positions); ``max_seqlen`` when omitted.
        A sequence of length 0 returns zeros (and an LSE of ``-inf``).
    scale : float, optional
        Softmax scale, ``1 / sqrt(head_dim)`` by default.
    window, softcap, alibi_slopes, sinks : optional
        As in ``numattn.attention`` (a query's position among the keys is ``seqlen - seqlen_q + i``;
        the window's right side is the causal one): a sliding window of ``window[0]`` keys before each
        token (the keys before the first token's window are never read), a logit softcap, ALiBi slopes
        ``[heads_q]`` or ``[batch, heads_q]`` and attention sinks ``[heads_q]`` (float32).
    return_lse : bool
        Also return the natural-log log-sum-exp per query row, float32 ``[batch, heads_q, seqlen_q]``.
    check : bool
        Check ``seqlens`` values (non-negative, at most ``max_seqlen``): host arrays before the
        launch; device arrays on the GPU, by a small kernel queued before the decode kernel, with
        no copy and no synchronisation: a bad value is raised as a ``ValueError`` by the next
        checked call on that GPU (the call that read it computed with the value clamped into
        range). Skipped while torch captures a CUDA graph. Unchecked lengths are clamped into
        ``[0, max_seqlen]``, so no kernel reads outside the caches.
    out : array, optional
        Where to write ``o`` (any strides, no self-overlap): the shape and dtype ``o`` would have,
        on q's device; it is returned. Saves the allocation on hot paths.

    Returns
    -------
    ``o`` shaped like ``q`` with ``head_dim_v`` last, same dtype and library (``out`` when given),
    or ``(o, lse)``.

    Examples
    --------
    >>> import numpy as np, numattn
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((2, 8, 64), dtype=np.float32)
    >>> k = rng.standard_normal((2, 2, 100, 64), dtype=np.float32)
    >>> v = rng.standard_normal((2, 2, 100, 64), dtype=np.float32)
    >>> numattn.decode(q, k, v, seqlens=np.array([100, 37], np.int32)).shape
    (2, 8, 64)
    """
    return _run("decode", validate_decode_args, [q, k_cache, v_cache, None, seqlens, alibi_slopes, sinks],
                (scale, layout, return_lse, window, softcap), check, out)


def validate_decode_args(q, k_cache, v_cache, page_table, seqlens, scale, layout, return_lse, out=None, window=None,
                         softcap=None, alibi_slopes=None, sinks=None):
    """The ``DecodeProblem`` of a ``decode`` call (``page_table`` None), or the error naming a bad argument."""
    return _validate_decode(q, k_cache, v_cache, seqlens, scale, layout, return_lse, out,
                            (window, softcap, alibi_slopes, sinks))


def paged_decode(q: Array, k_pages: Array, v_pages: Array, page_table: Array, seqlens: Array, *,
                 scale: float | None = None, window: tuple | None = None, softcap: float | None = None,
                 alibi_slopes: Array | None = None, sinks: Array | None = None, kv_layout: str = "nhd",
                 return_lse: bool = False, check: bool = True, out: Array | None = None) -> Array | tuple[Array, Array]:
    """Decode attention over a paged KV cache.

    Parameters
    ----------
    q : ``[batch, heads_q, head_dim]`` or ``[batch, heads_q, seqlen_q, head_dim]`` (as in ``decode``).
    k_pages, v_pages : ``[num_pages, page_size, heads_kv, head_dim]`` (``kv_layout="nhd"``) or
        ``[num_pages, heads_kv, page_size, head_dim]`` (``"hnd"``); any ``page_size >= 1``.
    page_table : int32 ``[batch, max_pages]``: sequence ``b``'s key ``t`` is in page
        ``page_table[b, t // page_size]`` at position ``t % page_size``. Entries past a
        sequence's last page are ignored.
    seqlens : int32 ``[batch]``: keys per sequence, at most ``max_pages * page_size``.
    scale, window, softcap, alibi_slopes, sinks, return_lse, check, out : as in ``decode``; ``check``
        also checks that every page index a sequence uses lies in ``[0, num_pages)`` (unchecked indices
        are clamped into it).

    See Also
    --------
    numattn.csr_page_table : the page table of FlashInfer's ``(kv_indptr, kv_indices, kv_last_page_len)`` form.
    """
    return _run("paged", validate_paged_args, [q, k_pages, v_pages, page_table, seqlens, alibi_slopes, sinks],
                (scale, kv_layout, return_lse, window, softcap), check, out)


def validate_paged_args(q, k_pages, v_pages, page_table, seqlens, scale, kv_layout, return_lse, out=None, window=None,
                        softcap=None, alibi_slopes=None, sinks=None):
    """The ``DecodeProblem`` of a ``paged_decode`` call, or the error naming a bad argument."""
    return _validate_paged(q, k_pages, v_pages, page_table, seqlens, scale, kv_layout, return_lse, out,
                           (window, softcap, alibi_slopes, sinks))


def decode_plan(q: Array, k_cache: Array, v_cache: Array, *, seqlens: Array | None = None,
                scale: float | None = None, window: tuple | None = None, softcap: float | None = None,
                alibi_slopes: Array | None = None, sinks: Array | None = None, layout: str = "bhsd",
                return_lse: bool = False) -> "DecodePlan":
    """``numattn.decode`` prepared once for a decode loop: a ``DecodePlan`` bound to these caches
    (and ``seqlens``), called with each step's new ``q``.

    Arguments as in ``decode``; ``q`` fixes the shape, strides, dtype and device of every later ``q``;
    the ALiBi slopes and sinks are bound like the caches (their values may change in place).

    Examples
    --------
    >>> import numpy as np, numattn
    >>> rng = np.random.default_rng(0)
    >>> k = rng.standard_normal((2, 2, 100, 64), dtype=np.float32)
    >>> v = rng.standard_normal((2, 2, 100, 64), dtype=np.float32)
    >>> lengths = np.array([90, 37], np.int32)
    >>> step = numattn.decode_plan(np.zeros((2, 8, 64), np.float32), k, v, seqlens=lengths)
    >>> lengths += 1  # the caches and lengths may change in place between calls
    >>> step(rng.standard_normal((2, 8, 64), dtype=np.float32)).shape
    (2, 8, 64)
    """
    return DecodePlan("decode", validate_decode_args, [q, k_cache, v_cache, None, seqlens, alibi_slopes, sinks],
                      (scale, layout, return_lse, window, softcap))


def paged_decode_plan(q: Array, k_pages: Array, v_pages: Array, page_table: Array, seqlens: Array, *,
                      scale: float | None = None, window: tuple | None = None, softcap: float | None = None,
                      alibi_slopes: Array | None = None, sinks: Array | None = None, kv_layout: str = "nhd",
                      return_lse: bool = False) -> "DecodePlan":
    """``numattn.paged_decode`` prepared once for a decode loop: a ``DecodePlan`` bound to these pages,
    page table and lengths, called with each step's new ``q`` (see ``decode_plan``)."""
    return DecodePlan("paged", validate_paged_args, [q, k_pages, v_pages, page_table, seqlens, alibi_slopes, sinks],
                      (scale, kv_layout, return_lse, window, softcap))


def _tensor_signature(x):
    """``(signature, data pointer)``: what a plan's torch tensor argument must keep (class, dtype, shape,
    strides, device, 16-byte alignment), and its address; ``(None, 0)`` for an object that is not a torch tensor."""
    try:
        address = x.data_ptr()
        return (x.__class__, x.dtype, x.shape, x.stride(), x.device, address & 15), address
    except (AttributeError, TypeError):
        return None, 0


def _signature_text(signature):
    if signature is None:
        return "not a torch tensor"
    _, dtype, shape, strides, device, offset = signature
    return f"shape {tuple(shape)}, strides {strides}, {dtype} on {device}, address {offset} mod 16"


class DecodePlan:
    """A decode call prepared once and run many times: ``plan(q, *, out=None, check=True)``.

    Made by ``numattn.decode_plan`` or ``numattn.paged_decode_plan`` (the plan / run split of
    FlashInfer's wrappers). The plan holds the key and value caches (and page table and lengths) it
    was made with: their contents may change between calls (new keys written, lengths grown, pages
    remapped in place), their shapes, strides and storage may not. Each call takes a new ``q`` with
    the planned query's shape, strides, dtype, device and 16-byte alignment, or raises a
    ``ValueError``; ``out``, when given, must be contiguous with the output's shape and dtype.
    ``check`` and the results are those of ``decode``.

    With torch tensors a call skips ``decode``'s argument validation and plan lookup (its host
    time is the launch's and the output allocation's, see benchmarks); other arrays take
    ``decode``'s path at every call.
    """

    def __init__(self, kind, validate, arrays, options):
        self._kind, self.validate, self._options = kind, validate, options
        self._bound = tuple(arrays[1:])  # k, v, page table, seqlens, ALiBi slopes, sinks
        self._table, self._lengths = arrays[3:5]
        _refuse_gradients(kind, arrays)
        problem = _validated(validate, arrays, options, None)
        self.problem = problem
        q = arrays[0]
        self._torch = all(x is None or is_torch(x) for x in arrays)
        if self._torch:
            self._plan = make_plan(problem, _tuned_splits(problem))
            # on the GPU the caches' pointers are fixed in the launch (CPU tensors: the simulator's plan)
            self._run = (self._plan.torch_runner(self._plan.bound_launch(*map(tensor_pointer, self._bound)))
                         if isinstance(self._plan, _TorchPlan) else None)
            self._q_signature = _tensor_signature(q)[0]
            self._out_signature = self._q_signature[:2] + (
                type(q.shape)(problem.out_shape), contiguous_strides(problem.out_shape), q.device)

    def __call__(self, q, *, out=None, check=True):
        if not self._torch:
            return _run(self._kind, self.validate, [q, *self._bound], self._options, check, out)
        if check.__class__ is not bool and not isinstance(check, np.bool_):
            raise TypeError(f"check must be a bool, got {type(check).__name__}")
        signature, address = _tensor_signature(q)
        if signature != self._q_signature:
            raise ValueError(f"q must match the plan's query ({_signature_text(self._q_signature)}), got "
                             f"{_signature_text(signature)}: make a new plan for other queries")
        if q.requires_grad and sys.modules["torch"].is_grad_enabled():  # the bound arrays were checked at planning
            raise ValueError(_NO_GRADIENTS.format(self._kind))
        if out is not None:
            given = _tensor_signature(out)[0]
            if given is None or given[:5] != self._out_signature:
                _, dtype, shape, strides, device = self._out_signature
                raise ValueError(f"out must be a contiguous {dtype} tensor of shape {tuple(shape)} on {device} "
                                 f"(strides {strides}), got {_signature_text(given)}")
        if check and self._lengths is not None and not _capturing(self.problem):
            self._plan.check_values(q, self._table, self._lengths)
        if self._run is None:
            return self._plan(q, *self._bound, out)
        return self._run(out, address)
