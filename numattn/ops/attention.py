"""``numattn.attention``: fused scaled-dot-product attention over whole sequences."""

import math
from dataclasses import dataclass, replace
from typing import NamedTuple

import numba
import numpy as np
from numba import types

from .._arrays import (
    FLOAT_DTYPES,
    Array,
    Operand,
    contiguous_strides,
    describe,
    float32_values,
    from_dlpack,
    host_storage,
    is_torch,
    rounded_storage,
    storage_dtype,
    torch_current,
    upload_on_torch_stream,
    wrap_host,
)
from .._cuda import SIMULATOR, cuda, simulating
from ..configs.attention import (
    MmaConfig,
    SimtConfig,
    WgmmaConfig,
    cluster_merges,
    default_choice,
    fitting_kernels,
    grid_in_sections,
    misfit,
    problem_box_rows,
    problem_shared_bytes,
    split_options,
    splits_keys,
    tile_candidates,
)
from ..kernels import cpu
from ..kernels.attention_mma import mma_attention_kernel
from ..kernels.attention_simt import simt_attention_kernel
from ..kernels.attention_wgmma import wgmma_attention_kernel
from ..kernels.constants import LOG2E
from ..kernels.launch import array_fields, compiled, device_limits
from ..kernels.sequences import DENSE_IN_SECTIONS
from ..kernels.split_merge import MAX_SPLITS, cluster_stage_bytes
from ..kernels.tensor_maps import MAP_WORDS, TensorMapCache, forget, steps_along_every_axis, tile_map
from ..tuning.models import attention_seconds
from ..tuning.store import tuned_config
from .checks import host_values
from .plans import PLANS, LaunchPlan, array_pointer, array_signature, on_device, records_grad, tensor_pointer
from .score_mods import NO_OPTIONS, ScoreOptions, options_key, score_options, window_side_types
from .workspace import WorkspaceLayout

# position of the (batch, heads, seqlen, head_dim) axes in each layout
_LAYOUT_AXES = {"bhsd": (0, 1, 2, 3), "bshd": (0, 2, 1, 3)}
_LAYOUT_DIMS = {"bhsd": "(batch, heads, seqlen, head_dim)", "bshd": "(batch, seqlen, heads, head_dim)"}
MAX_HEAD_DIM = 256
_MAX_GRID = 2**31 - 1
MAX_SCALE = float(np.finfo(np.float32).max) / LOG2E  # kernels take scale · log2(e) as a float32


@dataclass(frozen=True)
class Problem:
    """A validated attention call, in (batch, heads, seqlen, head_dim) order.

    A call of ``attention_varlen`` (``sequences`` set, ``ops/varlen.py``) has ``batch`` sequences of at
    most ``seqlen_q`` and ``seqlen_kv`` rows, layout ``"bshd"``, and ``q``, ``k``, ``v`` as 4-D operands:
    packed rows ``(total, heads, head_dim)`` with a leading axis of 1, pages ``(num_pages, page_size,
    heads, head_dim)`` as they are."""

    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_kv: int
    head_dim: int
    head_dim_v: int
    dtype: str
    device: object  # GPU ordinal, or None for host memory
    causal: bool
    scale: float
    layout: str
    return_lse: bool
    q: Operand
    k: Operand
    v: Operand
    out: Operand  # None when numattn allocates the output
    options: ScoreOptions = NO_OPTIONS  # window, softcap, ALiBi, sinks
    sequences: object = None  # a varlen call's ``Sequences``

    @property
    def out_shape(self):
        """Output shape in the caller's layout (``(total_q, heads_q, head_dim_v)`` for varlen)."""
        if self.sequences is not None:
            return (self.q.shape[1], self.heads_q, self.head_dim_v)
        bhsd = (self.batch, self.heads_q, self.seqlen_q, self.head_dim_v)
        return tuple(bhsd[a] for a in _LAYOUT_AXES[self.layout])

    @property
    def lse_shape(self):
        """The LSE's shape: ``(batch, heads_q, seqlen_q)``, or ``(heads_q, total_q)`` for varlen."""
        if self.sequences is not None:
            return (self.heads_q, self.q.shape[1])
        return (self.batch, self.heads_q, self.seqlen_q)

    def kernel_arrays(self, itemsize):
        """``(shape, strides, itemsize)`` of the kernels' ``o`` ``[B, Hq, Sq, Dv]`` and ``lse`` ``[B, Hq, Sq]``
        (varlen: ``[1, Hq, total_q, ·]``) over the output (``out``'s strides, else contiguous) and a contiguous LSE."""
        out_strides = self.out.strides if self.out is not None else contiguous_strides(self.out_shape)
        lse_strides = contiguous_strides(self.lse_shape)
        out_shape, lse_shape = self.out_shape, self.lse_shape
        if self.sequences is not None:  # a leading axis of 1 over the packed rows
            out_shape, out_strides = (1, *out_shape), (0, *out_strides)
            lse_shape, lse_strides = (1, *lse_shape), (0, *lse_strides)
        return (self.bhsd(out_shape), self.bhsd(out_strides), itemsize), (lse_shape, lse_strides, 4)

    def kernel_view(self, storage):
        """A host array's storage as the kernels take it: 4-D, (batch, heads, seqlen, head_dim) (packed rows
        with a leading axis of 1)."""
        return (storage[None] if storage.ndim == 3 else storage).transpose(_LAYOUT_AXES[self.layout])

    def bhsd(self, values):
        """Reorder shape or strides given in the caller's layout to (batch, heads, seqlen, head_dim)."""
        return tuple(values[a] for a in _LAYOUT_AXES[self.layout])

    def _copies_16_bytes(self, op, axis):
        """Whether ``op`` is contiguous along (bhsd) ``axis`` with every other stride and its start 16-byte aligned."""
        per_copy = 16 // storage_dtype(self.dtype).itemsize
        strides = self.bhsd(op.strides)
        return strides[axis] == 1 and all(s % per_copy == 0 for i, s in enumerate(strides) if i != axis) and (
            op.ptr % 16 == 0)

    @property
    def vector_loads(self):
        """Whether q, k and v rows can be copied 16 bytes at a time: contiguous head dim, aligned rows."""
        return all(self._copies_16_bytes(op, 3) for op in (self.q, self.k, self.v))

    @property
    def tensor_mappable(self):
        """Whether tensor maps describe q, k and v: no axis of more than one element repeats (a stride of 0, as
        ``expand`` gives), which a map cannot step along."""
        return all(steps_along_every_axis(op.shape, op.strides) for op in (self.q, self.k, self.v))

    @property
    def transposed_k_loads(self):
        """Whether the mma.sync kernel can copy K by runs of keys (K contiguous along the sequence, as a
        transposed view of a ``(…, head_dim, seqlen_kv)`` tensor) and q, v by rows."""
        return (self.sequences is None and not self.vector_loads and self._copies_16_bytes(self.k, 2)
                and all(self._copies_16_bytes(op, 3) for op in (self.q, self.v)))

    @property
    def aligned_out(self):
        """Whether output rows can be stored 16 bytes at a time (always so for an output numattn allocates)."""
        per_copy = 16 // storage_dtype(self.dtype).itemsize
        out = self.out
        return out is None or (
            out.strides[-1] == 1 and all(s % per_copy == 0 for s in out.strides[:-1]) and out.ptr % 16 == 0
        )


def validate(q, k, v, out, causal, scale, layout, return_lse, window=None, softcap=None, alibi_slopes=None,
             sinks=None):
    """The ``Problem`` of a call of ``attention`` with these arguments (``out`` None for none), or the
    TypeError/ValueError that names the bad one: with ``make_plan``, the planning API of the op that
    the searcher and the benchmarks use."""
    choice("layout", layout, tuple(_LAYOUT_AXES))
    for flag, value in (("causal", causal), ("return_lse", return_lse)):
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{flag} must be a bool, got {type(value).__name__}")
    ops = {"q": describe(q, "q"), "k": describe(k, "k"), "v": describe(v, "v")}
    for name, op in ops.items():
        if len(op.shape) != 4:
            raise ValueError(
                f"{name} must be 4-D {_LAYOUT_DIMS[layout]} for layout {layout!r}, got shape {op.shape}"
            )
        if 0 in op.shape:
            raise ValueError(f"{name} has a zero-size dimension: shape {op.shape}")
        if op.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} has dtype {op.dtype}; expected float16, bfloat16 or float32")
    check_one_dtype_and_device(ops, "q, k and v")

    axes = _LAYOUT_AXES[layout]
    (bq, hq, sq, dq), (bk, hk, sk, dk), (bv, hv, sv, dv) = (
        tuple(op.shape[a] for a in axes) for op in ops.values()
    )
    if not bq == bk == bv:
        raise ValueError(f"q, k and v must have the same batch size, got {bq}, {bk} and {bv}")
    if dk != dq:
        raise ValueError(f"k head_dim must equal q head_dim {dq}, got {dk}")
    if hv != hk:
        raise ValueError(f"k and v must have the same number of heads, got {hk} and {hv}")
    if sv != sk:
        raise ValueError(f"k and v must have the same sequence length, got {sk} and {sv}")
    if hq % hk:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hk})")
    for name, d in (("q/k head_dim", dq), ("v head_dim", dv)):
        if d > MAX_HEAD_DIM:
            raise ValueError(f"{name} must be at most {MAX_HEAD_DIM}, got {d}")

    scale = softmax_scale(scale, dq)
    q_op = ops["q"]
    options = score_options(window, softcap, alibi_slopes, sinks, causal, bq, hq, q_op.device)
    problem = Problem(
        bq, hq, hk, sq, sk, dq, dv, q_op.dtype, q_op.device, bool(causal), float(scale), layout,
        bool(return_lse), q_op, ops["k"], ops["v"], None, options,
    )
    if out is not None:
        problem = replace(problem, out=out_operand(out, q_op, problem.out_shape))
    return problem


def check_one_dtype_and_device(ops, what):
    """TypeError unless the operands ``ops`` (name -> ``Operand``) share one dtype, ValueError unless they are
    on one device; ``what`` names them in the message."""
    if len({op.dtype for op in ops.values()}) > 1:
        given = ", ".join(f"{n} {op.dtype}" for n, op in ops.items())
        raise TypeError(f"{what} must share one dtype, got {given}")
    if len({op.device for op in ops.values()}) > 1:
        given = ", ".join(f"{n} on {op.where}" for n, op in ops.items())
        raise ValueError(f"{what} must be on one device, got {given}")


def out_operand(out, q_op, shape):
    """The operand of a caller's ``out`` array, checked: q's dtype and device, ``shape``, writable,
    no two elements at one address."""
    out_op = describe(out, "out")
    if out_op.dtype != q_op.dtype:
        raise TypeError(f"out must have dtype {q_op.dtype} like q, got {out_op.dtype}")
    if tuple(out_op.shape) != tuple(shape):
        raise ValueError(f"out must have shape {tuple(shape)}, got {out_op.shape}")
    if out_op.device != q_op.device:
        raise ValueError(f"out must be on {q_op.where} like q, got {out_op.where}")
    if isinstance(out, np.ndarray) and not out.flags.writeable:
        raise ValueError("out must be writable, got a read-only numpy array")
    if overlaps_itself(out_op.shape, out_op.strides):
        raise ValueError(f"out must not overlap itself, got strides {out_op.strides} for shape {out_op.shape}")
    return out_op


def overlaps_itself(shape, strides):
    """Whether a view may put two of its elements at one address: after sorting the axes by stride,
    each axis must step past everything the smaller axes span (layouts that interleave otherwise
    count as overlapping)."""
    span = 1
    for stride, extent in sorted((abs(s), n) for s, n in zip(strides, shape, strict=True) if n > 1):
        if stride < span:
            return True
        span = stride * (extent - 1) + span
    return False


def choice(name, value, options):
    """``value`` when it is one of the strings ``options``; TypeError or ValueError naming ``name`` otherwise."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, one of {', '.join(map(repr, options))}; got {type(value).__name__}")
    if value not in options:
        raise ValueError(f"{name} must be {' or '.join(map(repr, options))}, got {value!r}")
    return value


def softmax_scale(scale, head_dim):
    """The softmax scale as a float: ``1 / sqrt(head_dim)`` for None; TypeError or ValueError for
    anything but a finite real number."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
    try:
        value = float(scale)
    except OverflowError:  # an int beyond float64
        value = math.inf
    if not math.isfinite(value):
        raise ValueError(f"scale must be finite, got {scale}")
    if abs(value) > MAX_SCALE:
        raise ValueError(f"scale must have magnitude at most {MAX_SCALE:.3e} (kernels multiply it by log2(e) "
                         f"in float32), got {value:.3e}")
    return value


_KERNELS = {SimtConfig: simt_attention_kernel, MmaConfig: mma_attention_kernel, WgmmaConfig: wgmma_attention_kernel}


class _Kernel(NamedTuple):
    """The kernel that computes a problem and how to launch it (``splits``: runs of keys per query tile;
    ``cluster``: the launch's cluster shape, or None; ``k_transposed``: the kernel takes K as ``(B, H, D, S)``,
    keys contiguous)."""

    dispatcher: object
    grid: int | tuple
    threads: int
    shared_bytes: int
    label: str
    config: object
    splits: int
    cluster: tuple | None
    k_transposed: bool
    tensor_copies: bool


def map_rows(p, config):
    """Rows of the boxes of the tensor maps of Q, K and V: a query tile's, a key tile's or (pages smaller than a
    tile) a page's."""
    key_rows = problem_box_rows(p, config.block_n)
    return config.block_m, key_rows, key_rows


def _attention_kernel(p, device, config=None, splits=1):
    """The ``_Kernel`` that computes problem ``p``.

    The wgmma kernel on sm_90 where it applies (fp16/bf16, head dims multiples
    of 64), the mma.sync kernel on other tensor-core GPUs, head dims multiples
    of 16, or K stored transposed (keys contiguous; the wgmma kernel too where ``config`` is a
    ``WgmmaConfig``), the SIMT kernel otherwise
    (fp32, other head dims, rows unfit for 16-byte copies); tile configuration ``config`` (a ``WgmmaConfig``,
    ``MmaConfig`` or ``SimtConfig``) or, when None, the heuristic's with its key splits (``default_choice``).
    ``splits`` > 1 (a tensor-core kernel; for the wgmma one a configuration without a producer) divides the
    keys into runs whose partial results are merged by the query tile's last block, or for the ``mma.sync``
    kernel on sm_90 by its blocks together (a cluster) where ``cluster_merges`` says; the grid is then
    ``(blocks, splits)``.
    """
    limits = device_limits(device)
    if config is None:
        if splits != 1:
            raise ValueError(f"key splits ({splits}) need a tile configuration")
        config, splits = default_choice(p, limits)
    kind = type(config)
    if kind not in fitting_kernels(p, limits):
        raise ValueError(f"tile configuration {config} does not fit the kernel this problem needs")
    reason = misfit(p, config, limits) if kind is WgmmaConfig and config.persistent else None
    if reason is not None:
        raise ValueError(f"tile configuration {config} does not fit this problem: {reason}")
    if splits > 1 and not splits_keys(config):
        raise ValueError(f"key splits need a tensor-core kernel (an MmaConfig, or a WgmmaConfig without a producer), "
                         f"got {config}")
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits must be in [1, {MAX_SPLITS}], got {splits}")
    blocks = -(-p.seqlen_q // config.block_m) * p.batch * p.heads_q
    if blocks > _MAX_GRID:
        raise ValueError(f"problem too large: {blocks} thread blocks exceed the grid limit")
    flags = {}
    if kind is WgmmaConfig:
        flags = {"aligned_out": p.aligned_out, "split": splits > 1, "k_transposed": p.transposed_k_loads,
                 # the producer's copies by TMA: tiles of whole pages, one run of keys, K as it lies
                 "tensor_copies": (config.producer and map_rows(p, config)[1] > 0
                                   and splits == 1 and not p.transposed_k_loads and p.tensor_mappable)}
    if kind is MmaConfig:
        flags = {"split": splits > 1, "k_transposed": p.transposed_k_loads,
                 "cluster_merge": p.sequences is None and cluster_merges(blocks, splits, limits)}
    if p.sequences is not None:
        flags["sequences"] = p.sequences.layout
    elif grid_in_sections(p):
        flags["sequences"] = DENSE_IN_SECTIONS
    dispatcher = _KERNELS[kind](config, p.dtype, p.head_dim, p.head_dim_v, p.causal, p.return_lse, **flags,
                                mods=p.options.mods)
    shared_bytes = problem_shared_bytes(p, config)
    cluster = None
    if flags.get("cluster_merge"):
        cluster = (1, splits, 1)
        shared_bytes = max(shared_bytes, cluster_stage_bytes(config.block_m, p.head_dim_v))
    merge = "cluster" if cluster else "last block"
    label = (f"{config} {p.dtype} d={p.head_dim}/{p.head_dim_v} causal={p.causal} lse={p.return_lse} splits={splits}"
             + (f" merged by {merge}" if splits > 1 else "") + (f" {p.options.label()}" if p.options.label() else "")
             + (f" {flags['sequences']}" if "sequences" in flags else ""))
    if kind is WgmmaConfig and config.persistent:
        blocks = min(blocks, limits["sms"])  # a block per SM, each taking query tile after query tile
    return _Kernel(dispatcher, (blocks, splits) if splits > 1 else blocks, config.num_threads, shared_bytes, label,
                   config, splits, cluster, flags.get("k_transposed", False), flags.get("tensor_copies", False))


def _swap_last(values):
    return (*values[:-2], values[-1], values[-2])


def _split_shapes(p, grid, splits):
    """Shapes of a split launch's workspace: fp32 partial outputs, their log2-sum-exps, int32 counters."""
    blocks = grid[0] if splits > 1 else 1
    return ((p.batch, p.heads_q, p.seqlen_q, splits, p.head_dim_v), (p.batch, p.heads_q, p.seqlen_q, splits),
            (1, blocks))


class _DevicePlan(LaunchPlan):
    """Zero-copy launch on device arrays; per call only data pointers and the stream change."""

    def __init__(self, p, config=None, splits=1):
        chosen = _attention_kernel(p, p.device, config, splits)
        grid, self.config, splits = chosen.grid, chosen.config, chosen.splits
        storage = numba.from_dtype(storage_dtype(p.dtype))
        f32 = types.float32
        self.problem, self.splits = p, splits
        self.split_shapes = _split_shapes(p, grid, splits)
        self.device, self.dtype, self.out_shape = p.device, p.dtype, p.out_shape
        self.lse_shape = p.lse_shape if p.return_lse else None
        self.workspace = WorkspaceLayout(self.split_shapes) if splits > 1 else None
        argtypes = (types.Array(storage, 4, "A"),) * 3 + (types.Array(storage, 4, "A"), types.Array(f32, 3, "A"))
        if splits > 1:
            argtypes += (types.Array(f32, 5, "A"), types.Array(f32, 4, "A"), types.Array(types.int32, 2, "A"))
        argtypes += (f32, types.Array(f32, 2, "A"), types.Array(f32, 1, "A"), types.int64, types.int64, f32, f32)
        if p.sequences is not None:
            argtypes += p.sequences.argtypes
        if chosen.tensor_copies:
            argtypes += (types.Array(types.uint64, 2, "A"),)  # the tensor maps of Q, K and V
        kernel = compiled(chosen.dispatcher, argtypes, p.device, chosen.shared_bytes, chosen.label)

        itemsize = storage_dtype(p.dtype).itemsize
        out_array, lse_array = p.kernel_arrays(itemsize)
        k_shape, k_strides = p.bhsd(p.k.shape), p.bhsd(p.k.strides)
        if chosen.k_transposed:
            k_shape, k_strides = _swap_last(k_shape), _swap_last(k_strides)  # the kernel takes (B, H, D, S)
        arrays = [
            (p.bhsd(p.q.shape), p.bhsd(p.q.strides), itemsize),
            (k_shape, k_strides, itemsize),
            (p.bhsd(p.v.shape), p.bhsd(p.v.strides), itemsize),
            out_array, lse_array,
        ]
        if splits > 1:
            arrays += [(shape, contiguous_strides(shape), 4) for shape in self.split_shapes]
        fields, slots = array_fields(arrays)
        fields.append(np.float32(p.scale * LOG2E))
        mod_fields, mod_slots = array_fields(p.options.arrays(p.batch, p.heads_q))
        slots[3:3] = [len(fields) + slot for slot in mod_slots]
        fields += mod_fields + p.options.scalars()
        sequence_slots = []
        if p.sequences is not None:
            sequence_fields, sequence_slots = array_fields(p.sequences.arrays())
            slots[5:5] = [len(fields) + slot for slot in sequence_slots]
            fields += sequence_fields
        self.tensor_maps = None
        if chosen.tensor_copies:  # boxes of a query tile's rows of Q, of a key tile's of K and V
            map_fields, map_slots = array_fields([((3, MAP_WORDS), (MAP_WORDS, 1), 8)])
            at = 5 + len(sequence_slots)
            slots[at:at] = [len(fields) + slot for slot in map_slots]
            fields += map_fields
            rows = map_rows(p, chosen.config)
            self.tensor_maps = TensorMapCache((
                (shape, tuple(stride * size for stride in strides), n)
                for (shape, strides, size), n in zip(arrays[:3], rows, strict=True)), self._upload_maps)
        # (stream, q, k, v, alibi, sinks, out, lse); with splits (..., part, part_lse, counters); varlen
        # (stream, q, k, v, alibi, sinks, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table, out, lse); with tensor
        # copies the maps after sinks and the varlen arrays (stream, q, k, v, alibi, sinks, [...,] maps, out, lse)
        self.launch = kernel.prepare(grid, chosen.threads, fields, slots, cluster=chosen.cluster)

    def _upload_maps(self, maps):
        """The tensor maps on the plan's GPU, copied before this returns: ``(device array, address)``."""
        with cuda.gpus[self.device]:
            on_device = cuda.to_device(maps)
        return on_device, on_device.device_ctypes_pointer.value

    def __call__(self, q, k, v, out, alibi=None, sinks=None, *sequences):
        maps = () if self.tensor_maps is None else (
            self.tensor_maps.entry(None, *(array_pointer(x) for x in (q, k, v)))[0],)
        return self.run_device_arrays((q, k, v, alibi, sinks, *sequences, *maps), out)


class _TorchPlan(_DevicePlan):
    """The same launch for torch CUDA tensors, on torch's current stream, with no host synchronisation."""

    def __init__(self, p, config=None, splits=1):
        super().__init__(p, config, splits)
        self.run = self.torch_runner()
        self._current_stream = torch_current()[1]

    def _upload_maps(self, maps):
        """The tensor maps copied on torch's current stream, without waiting for it: ``(tensor, address)``."""
        return upload_on_torch_stream(maps, self.device)

    def maps_pointer(self, q, k, v):
        """``()``, or with tensor copies the device address of the tensor maps of Q, K and V at these addresses,
        uploaded on torch's current stream (a launch on another stream has its own: none reads maps before
        their copy)."""
        if self.tensor_maps is None:
            return ()
        return (self.tensor_maps.entry(self._current_stream(self.device), q, k, v)[1],)

    def __call__(self, q, k, v, out, alibi=None, sinks=None, *sequences):
        q, k, v = q.data_ptr(), k.data_ptr(), v.data_ptr()
        return self.run(out, q, k, v, tensor_pointer(alibi), tensor_pointer(sinks), *map(tensor_pointer, sequences),
                        *self.maps_pointer(q, k, v))

    def on_pointers(self, out, q, k, v, alibi=0, sinks=0, *sequences):
        """The call on data pointers the caller holds already (0 for an absent ALiBi or sinks array);
        ``out`` a torch tensor or None."""
        return self.run(out, q, k, v, alibi, sinks, *sequences, *self.maps_pointer(q, k, v))


class _HostPlan:
    """Host arrays on a machine with a GPU: copy in, launch on the current device, copy out."""

    def __init__(self, p, config=None, splits=1):
        device = cuda.get_current_device().id
        contiguous = {
            name: replace(op, kind="numba", device=device, strides=contiguous_strides(op.shape))
            for name, op in (("q", p.q), ("k", p.k), ("v", p.v))
        }
        sequences = None if p.sequences is None else p.sequences.on_device(device)
        on_gpu = replace(p, device=device, out=None, options=p.options.on_device(device), sequences=sequences,
                         **contiguous)
        self.device_plan = _DevicePlan(on_gpu, config, splits)
        self.config, self.splits = self.device_plan.config, self.device_plan.splits
        self.problem = p

    def __call__(self, q, k, v, out, alibi=None, sinks=None, *sequences):
        p = self.problem
        stored = [None if x is None else host_storage(x, op)
                  for x, op in ((q, p.q), (k, p.k), (v, p.v), (alibi, p.options.alibi), (sinks, p.options.sinks))]
        stored += [None if x is None else np.asarray(host_values(x), np.int32) for x in sequences]
        result = on_device(lambda q, k, v, alibi, sinks, *sequences: self.device_plan(q, k, v, None, alibi, sinks,
                                                                                      *sequences), stored)
        o, lse = result if p.return_lse else (result, None)
        result = _deliver(o, q, out, p)
        return (result, wrap_host(lse, q, "float32")) if p.return_lse else result


class _NoGpuPlan:
    """Host arrays on a machine without a GPU: the CPU path (``kernels/cpu.py``), or under
    ``numattn.simulate()`` the GPU kernel in numba's CUDA simulator on numpy views (no copies)."""

    def __init__(self, p, config=None, splits=1):
        chosen = _attention_kernel(p, 0, config, splits)
        self.grid, self.block, self.config = chosen.grid, chosen.threads, chosen.config
        self.kernel = compiled(chosen.dispatcher, None, 0, chosen.shared_bytes, chosen.label)
        self.k_transposed, self.tensor_copies = chosen.k_transposed, chosen.tensor_copies
        self.problem, self.splits = p, chosen.splits
        self.split_shapes = _split_shapes(p, self.grid, chosen.splits)

    def __call__(self, q, k, v, out, alibi=None, sinks=None, *sequences):
        p = self.problem
        axes = _LAYOUT_AXES[p.layout]
        views = [p.kernel_view(host_storage(x, op)) for x, op in ((q, p.q), (k, p.k), (v, p.v))]
        alibi, sinks = p.options.host_arrays(alibi, sinks, p.batch, p.heads_q)
        if simulating():
            o, lse = self._simulated(*views, alibi, sinks, p.sequences.host_arrays(*sequences) if sequences else ())
        elif sequences:
            o, lse = cpu.attention_varlen_forward(
                *(float32_values(x, p.dtype) for x in views), *p.sequences.host_arrays(*sequences), p.sequences.layout,
                p.scale, p.causal, p.options.window, p.options.softcap, alibi if p.options.alibi else None,
                sinks if p.options.sinks else None)
            o = rounded_storage(o, p.dtype)
        else:
            o, lse = cpu.attention_forward(*(float32_values(x, p.dtype) for x in views), p.scale, p.causal,
                                           p.options.window, p.options.softcap, alibi if p.options.alibi else None,
                                           sinks if p.options.sinks else None)
            o = np.ascontiguousarray(rounded_storage(o, p.dtype).transpose(axes))  # axes: its own inverse
        result = _deliver(o, q, out, p)
        return (result, wrap_host(lse, q, "float32")) if p.return_lse else result

    def _simulated(self, q, k, v, alibi, sinks, sequences):
        """``(o in the caller's layout, lse)`` of the GPU kernel on (B, H, S, D) views (``sequences``: a varlen
        call's int32 arrays, as the kernels take them)."""
        p = self.problem
        if self.k_transposed:
            k = np.swapaxes(k, 2, 3)  # the kernel takes (B, H, D, S)
        o = np.empty(p.out_shape, dtype=storage_dtype(p.dtype))
        lse = np.empty(p.lse_shape if p.return_lse else (1,) * len(p.lse_shape), dtype=np.float32)
        o_view, lse_view = p.kernel_view(o), (lse[None] if sequences else lse)
        splits = []
        if self.splits > 1:
            part_shape, part_lse_shape, counter_shape = self.split_shapes
            splits = [np.empty(part_shape, np.float32), np.empty(part_lse_shape, np.float32),
                      np.zeros(counter_shape, np.int32)]
        maps = ()
        if self.tensor_copies:  # boxes of a query tile's rows of Q, of a key tile's of K and V
            maps = (np.stack([tile_map(x, n) for x, n in zip((q, k, v), map_rows(p, self.config), strict=True)]),)
        self.kernel.launch_arrays(self.grid, self.block, q, k, v, o_view, lse_view, *splits,
                                  np.float32(p.scale * LOG2E), alibi, sinks, *p.options.scalars(), *sequences, *maps)
        for launched in maps:
            forget(launched)
        return o, lse


def _deliver(o_storage, q, out, p):
    """The host result as an array like ``q``; written into ``out`` when one was given."""
    result = wrap_host(o_storage, q, p.dtype)
    if out is None:
        return result
    if is_torch(out):
        out.copy_(result if is_torch(result) else wrap_host(o_storage, out, p.dtype))
    else:
        host_storage(out, p.out)[...] = o_storage
    return out


def _key(q, k, v, out, causal, scale, layout, return_lse, options):
    """Plan-cache key of a call whose arrays have ``.stride()`` and ``.data_ptr()`` (torch); AttributeError otherwise.

    Flags and scale enter with their types, so that a cached plan never accepts
    what validation would reject (``1 == True``, but ``causal=1`` is an error);
    ``options`` are the score modifications' ``(window, softcap, alibi_slopes, sinks)``.
    """
    return (
        "attention",
        q.__class__, q.dtype, q.shape, q.stride(), q.device,
        k.__class__, k.dtype, k.shape, k.stride(), k.device,
        v.__class__, v.dtype, v.shape, v.stride(), v.device,
        (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15,  # 16-byte alignment picks the kernel
        None if out is None else (out.__class__, out.dtype, out.shape, out.stride(), out.device, out.data_ptr() & 15),
        causal.__class__, causal, scale.__class__, scale, layout, return_lse.__class__, return_lse,
        options_key(*options),
    )


def make_plan(problem, config=None, splits=1):
    """The plan of ``problem`` (from ``validate``) for its kind of arrays, with tile configuration ``config``
    and ``splits`` runs of keys (the heuristic's, ``default_choice``, when ``config`` is None):
    ``plan(q, k, v, out)`` runs it."""
    p = problem
    if p.device is None or p.q.kind == "numba" and SIMULATOR:
        return _NoGpuPlan(p, config, splits) if SIMULATOR else _HostPlan(p, config, splits)
    if p.q.kind == "torch" and all(op is None or op.kind == "torch" for op in (p.k, p.v, p.out)):
        return _TorchPlan(p, config, splits)
    return _DevicePlan(p, config, splits)


def planned(q, k, v, *, scale, config=None, splits=1):
    """``(plan, problem)`` computing ``attention(q, k, v, scale=scale)`` (4-D "bhsd" operands, no
    mask) with tile configuration ``config`` (the heuristic's when None) and ``splits`` runs of
    keys merged at the end (a configuration that ``splits_keys`` when more than one); ``plan(q, k, v,
    None)`` runs it on arrays laid out like these."""
    q, k, v = (from_dlpack(x) for x in (q, k, v))
    problem = validate(q, k, v, None, False, scale, "bhsd", False)
    return make_plan(problem, config, splits), problem


def attention(q: Array, k: Array, v: Array, *, causal: bool = False, window: tuple | None = None,
              softcap: float | None = None, alibi_slopes: Array | None = None, sinks: Array | None = None,
              scale: float | None = None, layout: str = "bhsd", return_lse: bool = False,
              out: Array | None = None) -> Array | tuple[Array, Array]:
    """Fused softmax attention ``softmax(scale · q kᵀ) v`` with an online softmax.

    With ``i`` a query's position among the keys (its index plus ``seqlen_kv - seqlen_q``, bottom-right
    aligned) and ``j`` a key's, the score of ``(i, j)`` is ``s = scale · q_i · k_j``, then
    ``c · tanh(s / c)`` with ``softcap=c``, then ``- slope · |i - j|`` with ``alibi_slopes``; keys outside
    ``causal`` and ``window`` are masked, and ``sinks`` add ``exp(sink)`` to the softmax's denominator.

    Parameters
    ----------
    q : array, ``[batch, num_heads_q, seqlen_q, head_dim]`` (layout ``"bhsd"``)
        or ``[batch, seqlen_q, num_heads_q, head_dim]`` (layout ``"bshd"``);
        float16, bfloat16 or float32. Any strides; nothing is copied on the GPU.
    k : array, ``[batch, num_heads_kv, seqlen_kv, head_dim]`` in the same layout and dtype.
        ``num_heads_q`` must be a multiple of ``num_heads_kv`` (MHA, GQA, MQA):
        query head ``h`` reads key/value head ``h // (num_heads_q // num_heads_kv)``.
    v : array, ``[batch, num_heads_kv, seqlen_kv, head_dim_v]`` in the same layout and dtype.
    causal : bool
        Mask key ``j`` for query ``i`` when ``j > i`` (bottom-right aligned). A query that sees no key
        returns 0.
    window : ``(left, right)``, optional
        Sliding window: query ``i`` sees key ``j`` iff ``i - left <= j <= i + right``; a side of ``None``
        or ``-1`` is unbounded (flash-attn's ``window_size``); with ``causal`` the right side is 0. Key
        tiles wholly outside the window are skipped, so the work goes with the visible area.
    softcap : float, optional
        Logit softcapping (Gemma 2, Grok): the scaled score ``s`` becomes ``softcap · tanh(s / softcap)``;
        None or 0 for none.
    alibi_slopes : float32 array ``[num_heads_q]`` or ``[batch, num_heads_q]``, optional
        ALiBi: ``slope · |i - j|`` is subtracted from the score of head ``h`` (after the softcap).
    sinks : float32 array ``[num_heads_q]``, optional
        Attention sinks (gpt-oss): the logit of a learnable sink per head; the softmax's denominator
        gains ``exp(sink)``, with no value row. The returned LSE includes it.
    scale : float, optional
        Softmax scale; ``1 / sqrt(head_dim)`` by default.
    layout : ``"bhsd"`` or ``"bshd"``
    return_lse : bool
        Also return the natural-log log-sum-exp of the scores per query,
        float32 ``[batch, num_heads_q, seqlen_q]`` (``-inf`` for a query that sees no key and has no sink).
    out : array, optional
        Destination with the output's shape and dtype, on q's device.

    Returns
    -------
    ``o`` ``[batch, num_heads_q, seqlen_q, head_dim_v]`` (in ``layout``), same dtype
    and library as ``q``, or ``(o, lse)`` with ``return_lse``. Torch CUDA tensors
    run on torch's current stream without synchronising; host arrays run on the
    GPU when there is one (copied in and out), else on the CPU path (or, under
    ``numattn.simulate()``, in numba's CUDA simulator).

    Raises
    ------
    TypeError
        Non-array arguments, unsupported or mixed dtypes, non-native byte order,
        non-bool flags, a ``layout`` that is not a str, a ``window`` that is not a pair of ints,
        ALiBi slopes or sinks that are not float32.
    ValueError
        Wrong ranks, mismatched batch / heads / lengths / head dims, head dims
        over 256, zero-size dimensions, arrays on different devices, an unknown
        layout, ``out`` of the wrong shape or device, read-only or overlapping
        itself, a ``scale`` beyond float32, a negative window side (other than -1), a softcap
        that is not a finite positive number, slopes or sinks of the wrong shape or device, or torch
        tensors that require grad while torch records gradients (see ``numattn.torch.attention``).

    Examples
    --------
    >>> import numpy as np, numattn
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((1, 4, 8, 16), dtype=np.float32)
    >>> k = rng.standard_normal((1, 2, 8, 16), dtype=np.float32)
    >>> v = rng.standard_normal((1, 2, 8, 16), dtype=np.float32)
    >>> numattn.attention(q, k, v, causal=True).shape
    (1, 4, 8, 16)
    >>> numattn.attention(q, k, v, causal=True, window=(3, 0), softcap=30.0).shape
    (1, 4, 8, 16)
    """
    if records_grad(q, k, v, sinks):
        raise ValueError(
            "q, k, v or sinks requires grad, and numattn.attention records no gradients: use "
            "numattn.torch.attention(q, k, v, causal=..., scale=...) for autograd, or call under torch.no_grad()")
    options = (window, softcap, alibi_slopes, sinks)
    try:
        plan = PLANS[_key(q, k, v, out, causal, scale, layout, return_lse, options)]
    except (AttributeError, KeyError, TypeError):  # TypeError: an unhashable argument, which validation reports
        plan, q, k, v, out, alibi_slopes, sinks = _slow_path(q, k, v, out, causal, scale, layout, return_lse, options)
    if alibi_slopes is None and sinks is None:
        return plan(q, k, v, out)
    return plan(q, k, v, out, alibi_slopes, sinks)


def tuning_options(p):
    """``[(config, splits, modelled seconds)]`` of problem ``p``: the tile configurations and key splits
    that ``numattn.tune`` tries."""
    dims = ((p.batch, p.heads_q, p.seqlen_q, p.head_dim), (p.batch, p.heads_kv, p.head_dim, p.seqlen_kv),
            (p.batch, p.heads_kv, p.seqlen_kv, p.head_dim_v), (p.batch, p.heads_q, p.seqlen_q, p.head_dim_v))
    itemsize = 4 if p.dtype == "float32" else 2
    return [(config, n, attention_seconds(*dims, itemsize, config, n))
            for config in tile_candidates(p) for n in split_options(p, config)]


def _tuned_or_default_plan(problem):
    """The plan with the configuration ``numattn.tune`` stored for this problem, else the heuristic's."""
    tuned = tuned_config("attention", problem, tuning_options)
    if tuned is not None:
        try:
            return make_plan(problem, *tuned)
        except ValueError:  # an entry that no longer fits this problem's kernels: the heuristic
            pass
    return make_plan(problem)


def _slow_path(q, k, v, out, causal, scale, layout, return_lse, options):
    """Validate and plan a call missing from the cache; cache the plan when the arguments allow. Returns the
    plan and the arrays it takes, ``(plan, q, k, v, out, alibi_slopes, sinks)``."""
    try:
        key = _key(q, k, v, out, causal, scale, layout, return_lse, options)
    except AttributeError:  # not all torch tensors
        window, softcap, alibi_slopes, sinks = options
        try:
            key = ("attention", *map(array_signature, (q, k, v, out, alibi_slopes, sinks)), causal.__class__, causal,
                   scale.__class__, scale, layout, return_lse.__class__, return_lse, window, window_side_types(window),
                   softcap.__class__, softcap)
        except TypeError:  # arrays of other libraries: validated and planned on every call
            key = None
    try:
        hash(key)  # an unhashable argument (say a list for scale) is left to validation to report
    except TypeError:
        key = None
    plan = PLANS.get(key) if key is not None else None
    window, softcap, alibi_slopes, sinks = options
    q, k, v, out, alibi_slopes, sinks = (from_dlpack(x) for x in (q, k, v, out, alibi_slopes, sinks))
    if plan is None:
        problem = validate(q, k, v, out, causal, scale, layout, return_lse, window, softcap, alibi_slopes, sinks)
        plan = _tuned_or_default_plan(problem)
        if key is not None:
            PLANS.store(key, plan)
    return plan, q, k, v, out, alibi_slopes, sinks
