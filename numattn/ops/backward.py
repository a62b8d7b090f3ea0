"""Attention backward for torch tensors (``numattn.torch.attention`` calls it): dq, dk, dv from the
forward's inputs, output and log-sum-exp, on the GPU, on the CPU path without one, or in the simulator.

fp16 and bf16 run on tensor cores: on sm_90 with head dims that are multiples of
64 the wgmma kernel (``kernels/attention_backward_wgmma.py``), otherwise, head
dims multiples of 16, the ``mma.sync`` kernel (``kernels/attention_backward_mma.py``);
everything else on CUDA cores (``kernels/attention_backward.py``). All start
from the ``rows`` kernel's delta and log2-domain log-sum-exp.
"""

import functools

import numba
import numpy as np
from numba import types

from .._arrays import describe, host_storage, storage_dtype, torch_current, upload_on_torch_stream
from .._cuda import SIMULATOR, simulating
from ..configs.backward import (
    BackwardMmaConfig,
    BackwardWgmmaConfig,
    backward_mma_supported,
    backward_wgmma_supported,
    choose_backward_config,
    choose_backward_wgmma_config,
)
from ..kernels import cpu
from ..kernels.attention_backward import ROW_THREADS, THREADS, backward_kernels, rows_grid
from ..kernels.attention_backward_mma import backward_mma_kernel
from ..kernels.attention_backward_wgmma import DQ_ROWS_THREADS, backward_wgmma_kernel, dq_rows_kernel
from ..kernels.compile_ahead import KernelSpec, compile_ahead, enabled
from ..kernels.constants import LOG2E_F32
from ..kernels.launch import array_fields, compiled, device_limits
from ..kernels.score_mods import NO_MODS
from ..kernels.sequences import DENSE, SequenceLayout, padded_rows_count
from ..kernels.tensor_maps import TensorMapCache, forget, steps_along_every_axis, tile_map
from .plans import PLANS, array_signature, tensor_maker
from .score_mods import NO_OPTIONS

_KERNELS = {BackwardMmaConfig: backward_mma_kernel, BackwardWgmmaConfig: backward_wgmma_kernel}


def backward_config(dtype, head_dim, head_dim_v, device=0):
    """The tensor-core backward's tile configuration for these operands (a ``BackwardWgmmaConfig`` or
    ``BackwardMmaConfig``), or None for the CUDA-core path."""
    limits = device_limits(device)
    if backward_wgmma_supported(dtype, head_dim, head_dim_v, limits["cc"]):
        config = choose_backward_wgmma_config(head_dim, head_dim_v, limits["max_shared"])
        if config is not None:
            return config
    if not backward_mma_supported(dtype, head_dim, head_dim_v):
        return None
    return choose_backward_config(head_dim, head_dim_v, limits["max_shared"], SIMULATOR)


def _rows_fit(x):
    """Whether ``x``'s rows suit 16-byte copies (a unit last stride, rows 16-byte aligned) and a tensor map
    (no axis of more than one element with a stride of 0, as an output gradient broadcast by ``expand``
    has); the backward reads a contiguous copy of an operand whose rows do not."""
    rows_aligned = all(s * x.element_size() % 16 == 0 for s in x.stride()[:-1])
    return x.stride(-1) == 1 and x.data_ptr() % 16 == 0 and rows_aligned and steps_along_every_axis(x.shape, x.stride())


def backward_kernel(name, dtype, head_dim, head_dim_v, causal, config=None, mods=NO_MODS, sequences=DENSE):
    """The backward's kernel ``name``: ``"rows"`` (delta and the log2-domain LSE of each query row), ``"dq"``
    and ``"dkdv"`` (CUDA cores), ``"tiles"``, the tensor-core kernel of ``config``, with the score
    modifications ``mods``, or ``"dq rows"``, which puts the rows of the wgmma kernel's dQ in order; over
    the sequences of layout ``sequences``."""
    if name == "tiles":
        return _KERNELS[type(config)](config, dtype, head_dim, head_dim_v, causal, mods, sequences)
    if name == "dq rows":
        return dq_rows_kernel(config, dtype, head_dim, sequences)
    rows, dq, dkdv = backward_kernels(dtype, head_dim, head_dim_v, causal, mods, sequences)
    return {"rows": rows, "dq": dq, "dkdv": dkdv}[name]


@functools.lru_cache(maxsize=64)
def _backward_specs(dtype, head_dim, head_dim_v, causal, config, mods=NO_MODS, sequences=DENSE):
    """``{name: KernelSpec}`` of the kernels a backward of these operands launches (``config`` None: on CUDA
    cores): their argument types (each array's storage dtype and rank, then the float32 scalars, then
    but for ``rows`` the score modifications' arguments, then for packed ``sequences`` the int32 offsets)
    are those of the tensors ``attention_backward`` passes. Built once per operand kind, not per backward call."""
    storage, f32 = storage_dtype(dtype), np.dtype(np.float32)
    grads = storage if config is not None else f32  # dk and dv: the inputs' dtype on tensor cores
    what = (f"{dtype} d={head_dim}/{head_dim_v} causal={causal}" + (f" {mods}" if mods != NO_MODS else "")
            + (f" {sequences}" if sequences.varlen else ""))
    offsets = (types.Array(types.int32, 1, "A"),) * (2 if sequences.varlen else 0)
    tiled_dq = isinstance(config, BackwardWgmmaConfig)  # dQ added in whole tiles, in fragment order
    # the tiles kernel's last arguments: the offsets, then with tensor copies the tensor maps of Q and dO
    tiles_tail = offsets + ((types.Array(types.uint64, 2, "A"),) if tensor_copies(config) else ())
    arrays = {
        "rows": ([(storage, 4)] * 2 + [(f32, 3)] * 3, 0),  # o, do, lse, delta, lse2
        "dq": ([(storage, 4)] * 4 + [(f32, 3)] * 2 + [(f32, 4)], 1),  # q, k, v, do, lse2, delta, dq
        "dkdv": ([(storage, 4)] * 4 + [(f32, 3)] * 2 + [(f32, 4)] * 2, 1),  # ..., dk, dv
        # ..., the float32 dQ accumulator, dk, dv
        "tiles": ([(storage, 4)] * 4 + [(f32, 3)] * 2 + [(f32, 3 if tiled_dq else 4)] + [(grads, 4)] * 2, 2),
        "dq rows": ([(f32, 3), (storage, 4)], 0),  # the accumulator in fragment order, dq (, cu_seqlens_q)
    }
    # the slowest to compile first: a worker compiling them ahead starts on the one the backward waits for longest
    names = ("dkdv", "dq", "rows") if config is None else ("tiles", "rows") + (("dq rows",) if tiled_dq else ())
    labels = {"rows": f"backward rows {what}", "dq": f"backward dq {what}", "dkdv": f"backward dkdv {what}",
              "tiles": f"backward {config} {what}", "dq rows": f"backward dq rows {config} {what}"}
    tails = {"rows": offsets[:1], "dq rows": offsets[:1], "tiles": _MOD_TYPES + tiles_tail}
    return {name: KernelSpec(backward_kernel, (name, dtype, head_dim, head_dim_v, causal, config, mods, sequences),
                             _argtypes(*arrays[name]) + tails.get(name, _MOD_TYPES + offsets), labels[name])
            for name in names}


# the score modifications' arguments: alibi [B, Hq], sinks [Hq], left, right, cap_log2, cap_slope
_MOD_TYPES = (types.Array(types.float32, 2, "A"), types.Array(types.float32, 1, "A"), types.int64, types.int64,
              types.float32, types.float32)


def tensor_copies(config):
    """Whether the backward of ``config`` copies Q and dO tiles by tensor copies (TMA), taking their tensor maps
    (``kernels/tensor_maps.py``) as its last argument."""
    return isinstance(config, BackwardWgmmaConfig) and config.tensor_copies


def _argtypes(arrays, scalars):
    """numba argument types of a kernel taking ``arrays`` (numpy storage dtype and rank of each), then
    ``scalars`` float32 scalars."""
    return tuple(types.Array(numba.from_dtype(d), ndim, "A") for d, ndim in arrays) + (types.float32,) * scalars


def backward_specs(dtype, head_dim, head_dim_v, causal, device=0, mods=NO_MODS):
    """The ``KernelSpec`` s of the kernels a backward of these operands (and score modifications ``mods``)
    launches on GPU ``device``, the slowest to compile first."""
    config = backward_config(dtype, head_dim, head_dim_v, device)
    return list(_backward_specs(dtype, head_dim, head_dim_v, causal, config, mods).values())


@functools.lru_cache(maxsize=64)
def compile_backward_ahead(dtype, head_dim, head_dim_v, causal, device, mods=NO_MODS):
    """Start compiling, in a worker process, the kernels a backward of these operands (and score modifications
    ``mods``) will launch on GPU ``device`` (``numattn.torch.attention`` calls it before its forward, which
    compiles meanwhile)."""
    if enabled():
        compile_ahead(backward_specs(dtype, head_dim, head_dim_v, causal, device, mods), device)


def _launch(spec, grid, threads, shared_bytes, arrays, scalars, stream, mods=None, offsets=(), prepared=None):
    """Launch the kernel of ``spec`` on ``(*arrays, *scalars)`` and, given ``mods`` ``(mod_arrays, mod_scalars)``,
    ``(*mod_arrays, *mod_scalars)`` after them, then the int32 ``offsets`` of packed sequences: torch tensors
    (16-bit floats as uint16 storage), float32 scalars, the score modifications' ints and float32s. On a GPU
    the launch is prepared at its first call and kept in the dict ``prepared`` (a backward plan's, whose
    arrays keep their layouts from call to call) under ``spec``'s label: later calls pass data pointers."""
    mod_arrays, mod_scalars = mods or ((), ())
    if SIMULATOR:
        views = [host_storage(x, describe(x, "array")) for x in (*arrays, *mod_arrays)]
        compiled(spec.factory(*spec.args), None, 0, shared_bytes, spec.label).launch_arrays(
            grid, threads, *views[:len(arrays)], *scalars, *views[len(arrays):], *mod_scalars,
            *(x.numpy() for x in offsets))
        return
    launch = prepared.get(spec.label)
    if launch is None:
        layout = tuple((tuple(x.shape), x.stride()) for x in arrays)
        tail_layout = tuple((tuple(x.shape), x.stride()) for x in (*mod_arrays, *offsets))
        launch = prepared[spec.label] = _prepared(spec, grid, threads, shared_bytes, layout, scalars, tail_layout,
                                                  len(mod_arrays), tuple(mod_scalars), arrays[0].device.index)
    launch(stream, *(x.data_ptr() for x in (*arrays, *mod_arrays, *offsets)))


def _prepared(spec, grid, threads, shared_bytes, layout, scalars, tail_layout, mod_count, mod_scalars, device):
    """The prepared launch of ``spec``'s kernel on arrays of ``layout`` (shape and strides of each, their
    types those of ``spec``), ``scalars``, then the first ``mod_count`` arrays of ``tail_layout`` and
    ``mod_scalars``, then the rest of ``tail_layout`` (the offsets)."""
    launcher = compiled(spec.factory(*spec.args), spec.argtypes, device, shared_bytes, spec.label)
    itemsizes = [t.dtype.bitwidth // 8 for t in spec.argtypes if isinstance(t, types.Array)]

    def fields_of(layouts, sizes):
        return array_fields([(shape, strides, size) for (shape, strides), size in zip(layouts, sizes, strict=True)])

    fields, slots = fields_of(layout, itemsizes[:len(layout)])
    fields += list(scalars)
    sizes = itemsizes[len(layout):]
    mod_fields, mod_slots = fields_of(tail_layout[:mod_count], sizes[:mod_count])
    slots += [len(fields) + slot for slot in mod_slots]
    fields += mod_fields + list(mod_scalars)
    offset_fields, offset_slots = fields_of(tail_layout[mod_count:], sizes[mod_count:])
    slots += [len(fields) + slot for slot in offset_slots]
    return launcher.prepare(grid, threads, fields + offset_fields, slots)


def attention_backward(q, k, v, o, lse, do, *, causal, scale, options=NO_OPTIONS, alibi=None, sinks=None,
                       sequences=None):
    """``(dq, dk, dv)`` for 4-D (batch, heads, seq, dim) torch tensors ``q, k, v, o, do`` of one dtype
    (any strides) and the float32 natural-log ``lse`` [B, Hq, Sq]: the gradients in the inputs' dtype on
    tensor cores and in float32 on CUDA cores. ``options`` are the forward's validated score modifications
    (``ops/score_mods.py``) with their ``alibi`` and ``sinks`` tensors.

    With ``sequences`` ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_k)`` (int32 offsets like the tensors, an int):
    packed sequences as ``attention_varlen`` takes them, ``q``, ``o``, ``do`` ``[total_q, Hq, D]``, ``k``,
    ``v`` ``[total_k, Hkv, D]``, ``lse`` ``[Hq, total_q]``; the gradients are packed like their inputs, with
    rows of no sequence 0."""
    if SIMULATOR and not simulating():  # no GPU: the CPU path
        return _cpu_backward(q, k, v, o, lse, do, causal, scale, options, alibi, sequences)
    if not SIMULATOR and not q.is_cuda:  # host tensors on a GPU machine: computed on the GPU, as the forward is
        moved = [None if x is None else x.cuda() for x in (q, k, v, o, lse, do, alibi, sinks)]
        moved_sequences = None if sequences is None else (sequences[0].cuda(), sequences[1].cuda(), sequences[2])
        grads = attention_backward(*moved[:6], causal=causal, scale=scale, options=options, alibi=moved[6],
                                   sinks=moved[7], sequences=moved_sequences)
        return tuple(g.cpu() for g in grads)
    offsets = () if sequences is None else tuple(sequences[:2])
    key = ("attention backward", *map(array_signature, (q, k, v, o, lse, do, alibi, sinks, *offsets)), causal, scale,
           options.window, options.softcap, None if sequences is None else sequences[2])
    plan = PLANS.get(key)
    if plan is None:
        plan = BackwardPlan(q, k, v, o, do, causal, scale, options, sequences)
        PLANS.store(key, plan)
    return plan(q, k, v, o, lse, do, alibi, sinks, offsets)


class BackwardPlan:
    """The backward of one call signature (the dtypes, shapes, strides, devices and alignments of its
    tensors, its flags and score modifications), worked out once: the tile configuration and kernels,
    which operands the kernels read as contiguous copies, the buffers' shapes, the launch grids, and on a
    GPU each kernel's prepared launch (made at its first launch).

    ``plan(q, k, v, o, lse, do, alibi, sinks, offsets)`` runs it on tensors of that signature (``offsets``:
    ``(cu_seqlens_q, cu_seqlens_k)`` of packed sequences, or ``()``) and returns ``(dq, dk, dv)``.
    """

    def __init__(self, q, k, v, o, do, causal, scale, options, sequences):
        import torch

        dtype = str(q.dtype).removeprefix("torch.")
        head_dim, head_dim_v = q.shape[-1], v.shape[-1]
        self.varlen = sequences is not None
        config = self.config = backward_config(dtype, head_dim, head_dim_v, 0 if SIMULATOR else q.device.index)
        self.specs = _backward_specs(dtype, head_dim, head_dim_v, bool(causal), config, options.mods,
                                     SequenceLayout(varlen=True) if self.varlen else DENSE)
        self.scale, self.scale_log2 = np.float32(scale), np.float32(scale * LOG2E_F32)
        self.mod_scalars = tuple(options.scalars())
        if not self.varlen:
            self.batch, self.heads, seqlen_q = q.shape[:3]
            seqlen_kv = k.shape[2]
            # delta and lse2 padded to whole query tiles (the tensor-core kernel copies them by tiles)
            rows = seqlen_q if config is None else -(-seqlen_q // config.block_m) * config.block_m
            self.rows_shape, row_count = (self.batch, self.heads, rows), self.batch * self.heads * rows
        else:
            seqlen_kv, self.batch, self.heads = sequences[2], sequences[0].shape[0] - 1, q.shape[1]
            self.rows_shape = (1, self.heads, padded_rows_count(q.shape[0], self.batch))
            row_count = self.heads * q.shape[0]
        self.rows_grid = rows_grid(row_count, ROW_THREADS)

        def maker(shape, dtype, zeroed=self.varlen):  # packed sequences' buffers zeroed: rows of no sequence stay 0
            return tensor_maker(torch, shape, dtype, q.device, zeroed)

        self.new_rows = maker(self.rows_shape, torch.float32)
        # which of q, k, v, o, do the kernels read as contiguous copies: the rows kernel reads 16-byte chunks
        # of o's and do's rows, the tensor-core kernel those of all five
        self.copied = [(config is not None or i >= 3) and not _rows_fit(x)
                       for i, x in enumerate(self._views(q, k, v, o, do))]
        self.placeholder = torch.empty(1, dtype=torch.float32, device=q.device)  # absent ALiBi slopes, sinks
        self.no_alibi = self.placeholder[None]
        self.stream = (lambda: 0) if SIMULATOR else functools.partial(torch_current()[1], q.device.index)
        if config is None:
            self.dq_grid, self.dkdv_grid = rows_grid(q.numel() // head_dim), rows_grid(k.numel() // head_dim)
            self.new_dq, self.new_dk, self.new_dv = (maker(x.shape, torch.float32) for x in (q, k, v))
        else:
            self.tiles_grid = -(-seqlen_kv // config.block_n) * self.batch * k.shape[1]
            self.tiles_shared = config.shared_bytes(head_dim, head_dim_v)
            self.tiled_dq = "dq rows" in self.specs  # whole tiles in the wgmma kernel's fragment order
            # the float32 accumulator of dQ, to which the kernel adds each key tile's share: whole tiles in the
            # wgmma kernel's fragment order, with the rows of lse2, or packed like q
            accumulator_shape = (*self.rows_shape[:2], self.rows_shape[2] * head_dim) if self.tiled_dq else q.shape
            self.new_accumulator = maker(accumulator_shape, torch.float32, zeroed=True)
            # dq in order from the accumulator (every row written), or the accumulator's conversion
            self.new_dq = maker(q.shape, q.dtype, zeroed=False) if self.tiled_dq else None
            self.new_dk, self.new_dv = maker(k.shape, k.dtype), maker(v.shape, v.dtype)
            self.dq_rows_grid = -(-q.numel() // 8 // DQ_ROWS_THREADS)
        self.prepared = {}

    def _views(self, *tensors):
        """The kernels' 4-D views of ``tensors``: packed ones ``[total, heads, dim]`` as ``[1, heads, total, dim]``."""
        return tuple(x.unsqueeze(0).transpose(1, 2) for x in tensors) if self.varlen else tensors

    def _launch(self, name, grid, threads, shared_bytes, arrays, scalars, stream, mods=None, offsets=()):
        _launch(self.specs[name], grid, threads, shared_bytes, arrays, scalars, stream, mods, offsets, self.prepared)

    def __call__(self, q, k, v, o, lse, do, alibi, sinks, offsets):
        stream = self.stream()
        q4, k4, v4, o4, do4 = (x.contiguous() if copy else x
                               for x, copy in zip(self._views(q, k, v, o, do), self.copied, strict=True))
        lse = lse.unsqueeze(0) if self.varlen else lse
        mods = ((self.no_alibi if alibi is None else alibi.float().expand(self.batch, self.heads),
                 self.placeholder if sinks is None else sinks.float()), self.mod_scalars)
        delta, lse2 = self.new_rows(), self.new_rows()
        self._launch("rows", self.rows_grid, THREADS, 0, (o4, do4, lse.float(), delta, lse2), (), stream,
                     offsets=offsets[:1])
        config = self.config
        dk, dv = self.new_dk(), self.new_dv()
        dk4, dv4 = self._views(dk, dv)
        if config is None:
            dq = self.new_dq()
            (dq4,) = self._views(dq)
            self._launch("dq", self.dq_grid, THREADS, 0, (q4, k4, v4, do4, lse2, delta, dq4), (self.scale,), stream,
                         mods, offsets)
            self._launch("dkdv", self.dkdv_grid, THREADS, 0, (q4, k4, v4, do4, lse2, delta, dk4, dv4), (self.scale,),
                         stream, mods, offsets)
            return dq, dk, dv
        accumulator = self.new_accumulator()
        (accumulator4,) = (accumulator,) if self.tiled_dq else self._views(accumulator)
        maps = _query_tile_maps(q4, do4, config.block_m, stream) if tensor_copies(config) else ()
        self._launch("tiles", self.tiles_grid, config.num_threads, self.tiles_shared,
                     (q4, k4, v4, do4, lse2, delta, accumulator4, dk4, dv4), (self.scale, self.scale_log2), stream,
                     mods, (*offsets, *maps))
        if SIMULATOR and maps:
            forget(maps[0].numpy())
        if not self.tiled_dq:
            return accumulator.to(q.dtype), dk, dv
        dq = self.new_dq()
        self._launch("dq rows", self.dq_rows_grid, DQ_ROWS_THREADS, 0, (accumulator, *self._views(dq)), (), stream,
                     offsets=offsets[:1])
        return dq, dk, dv


def _query_tile_maps(q4, do4, box_rows, stream):
    """``(maps,)``: the tensor maps of ``q4`` and ``do4`` for boxes of ``box_rows`` rows, ``[2, MAP_WORDS]`` on
    their GPU, uploaded on ``stream`` in its order. Kept per GPU and layout, by stream and data addresses,
    which a training loop's tensors keep from step to step; in the simulator made afresh (``forget`` them
    after the launch)."""
    import torch

    if SIMULATOR:
        return (torch.from_numpy(np.stack([tile_map(host_storage(x, describe(x, "array")), box_rows)
                                           for x in (q4, do4)])),)
    layouts = tuple((tuple(x.shape), tuple(stride * x.element_size() for stride in x.stride()), box_rows)
                    for x in (q4, do4))
    return (_tensor_maps(q4.device.index, layouts).entry(stream, q4.data_ptr(), do4.data_ptr())[0],)


@functools.lru_cache(maxsize=16)
def _tensor_maps(device, layouts):
    """The cache of the tensor maps of operands of ``layouts`` (each ``(shape, byte strides, box rows)``) on
    GPU ``device``, uploaded with torch on the launching stream without waiting for it."""
    return TensorMapCache(layouts, functools.partial(upload_on_torch_stream, device=device))


def _cpu_backward(q, k, v, o, lse, do, causal, scale, options, alibi, sequences):
    """``attention_backward`` on the CPU path: each packed sequence alone (``sequences``), else the batch."""
    import torch

    def host(x):
        return None if x is None else x.detach().float().numpy()

    slopes = host(alibi)
    if sequences is None:
        grads = cpu.attention_backward(*map(host, (q, k, v, o, lse, do)), scale, causal, options.window,
                                       options.softcap, slopes)
        return tuple(torch.from_numpy(g) for g in grads)
    cu_q, cu_k = (x.cpu().numpy().astype(np.int64) for x in sequences[:2])
    grads = [torch.zeros(x.shape, dtype=torch.float32) for x in (q, k, v)]
    q, k, v, o, do = (host(x) for x in (q, k, v, o, do))
    lse = host(lse)
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rows.stop <= rows.start or keys.stop <= keys.start:
            continue  # no query or no key: no gradient

        def alone(x, span):
            return np.ascontiguousarray(x[span].transpose(1, 0, 2)[None])  # [1, heads, rows, dim]

        sequence_grads = cpu.attention_backward(alone(q, rows), alone(k, keys), alone(v, keys), alone(o, rows),
                                                lse[None, :, rows], alone(do, rows), scale, causal, options.window,
                                                options.softcap, None if slopes is None else
                                                np.broadcast_to(slopes, (len(cu_q) - 1, q.shape[1]))[b : b + 1])
        for grad, span, value in zip(grads, (rows, keys, keys), sequence_grads, strict=True):
            grad[span] = torch.from_numpy(value[0].transpose(1, 0, 2))
    return tuple(grads)
