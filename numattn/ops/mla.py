"""``numattn.mla_decode``: DeepSeek multi-head latent attention decode over a paged latent cache.

With the projections absorbed into the queries, every query head attends to the
same latent rows: ``score = q_nope · ckv + q_pe · kpe``, ``o = softmax(scale · score) · ckv``.
``kernels/mla.py`` computes it with key splits merged by the decode combine kernel.
"""

import dataclasses
from dataclasses import dataclass, replace

import numba
import numpy as np
from numba import types

from .._arrays import (
    Array,
    cai_stream,
    contiguous_strides,
    describe,
    device_pointer,
    float32_values,
    host_storage,
    is_torch,
    rounded_storage,
    storage_dtype,
    torch_current,
    wrap_host,
)
from .._cuda import SIMULATOR, cuda, simulating
from ..configs.mla import mla_candidates, mla_config_error, mla_default_config, mla_shared_bytes
from ..kernels import cpu
from ..kernels.compile_ahead import KernelSpec, compile_ahead
from ..kernels.constants import LOG2E
from ..kernels.decode import NUM_THREADS
from ..kernels.launch import array_fields, compiled, device_limits
from ..kernels.mla import HEAD_ROWS, mla_decode_kernel
from ..kernels.mla_wgmma import PERSISTENT_HEADS
from ..kernels.split_merge import MAX_SPLITS, combine_kernel
from ..tuning.models import split_candidates, split_count
from ..tuning.store import tuned_config
from .attention import softmax_scale
from .checks import DeviceIndexCheck, check_lengths_and_pages, index_check_spec, page_table_operands
from .decode import paged_decode
from .plans import PLANS, LaunchPlan, array_signature, on_device
from .workspace import WorkspaceLayout, capturing_now

MAX_RANK, MAX_ROPE = 512, 64
RANK_MULTIPLE = 64  # the 16-bit kernels: 16 output columns per warp, 4 or 8 warps (``mla_candidates``)


@dataclass(frozen=True)
class MlaProblem:
    """A validated ``mla_decode`` call."""

    batch: int
    heads: int
    rank: int  # kv_lora_rank R
    rope: int  # rope dim P (may be 0)
    page_size: int
    num_pages: int
    max_pages: int
    dtype: str
    device: object
    scale: float
    return_lse: bool
    shapes: tuple  # (shape, strides) of q_nope, q_pe, ckv, kpe, page_table, seqlens


def _aligned_rows(op, name):
    """TypeError/ValueError unless ``op`` has contiguous rows that 16-byte copies can read."""
    per_copy = 16 // storage_dtype(op.dtype).itemsize
    if op.shape[-1] and (op.strides[-1] != 1 or any(s % per_copy for s in op.strides[:-1]) or op.ptr % 16):
        raise ValueError(f"{name} needs contiguous rows starting at 16-byte boundaries (strides {op.strides}); "
                         "pass a contiguous array")


def validate(q_nope, q_pe, ckv_cache, kpe_cache, page_table, seqlens, scale, return_lse):
    """The ``MlaProblem`` of an ``mla_decode`` call, or the error naming a bad argument; ``planned`` makes
    its plan."""
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if scale is None:
        raise TypeError("scale is required (the softmax scale of the un-absorbed head dim)")
    names = ("q_nope", "q_pe", "ckv_cache", "kpe_cache")
    ops = [describe(x, n) for x, n in zip((q_nope, q_pe, ckv_cache, kpe_cache), names, strict=True)]
    texts = ("(batch, heads, kv_lora_rank)", "(batch, heads, rope_dim)", "(num_pages, page_size, kv_lora_rank)",
             "(num_pages, page_size, rope_dim)")
    for op, name, text in zip(ops, names, texts, strict=True):
        if len(op.shape) != 3:
            raise ValueError(f"{name} must be 3-D {text}, got shape {op.shape}")
        if op.dtype not in ("float16", "bfloat16", "float32"):
            raise TypeError(f"{name} has dtype {op.dtype}; mla_decode takes float16, bfloat16 or float32")
    qn, qp, ckv, kpe = ops
    if len({op.dtype for op in ops}) > 1:
        raise TypeError("q_nope, q_pe and the caches must share one dtype, got " +
                        ", ".join(f"{n} {op.dtype}" for n, op in zip(names, ops, strict=True)))
    if len({op.device for op in ops}) > 1:
        raise ValueError("q_nope, q_pe and the caches must be on one device, got " +
                         ", ".join(f"{n} on {op.where}" for n, op in zip(names, ops, strict=True)))
    batch, heads, rank = qn.shape
    rope = qp.shape[2]
    if qp.shape[:2] != (batch, heads):
        raise ValueError(f"q_pe must be (batch, heads, rope_dim) = ({batch}, {heads}, P), got {qp.shape}")
    if ckv.shape[2] != rank:
        raise ValueError(f"ckv_cache's last dim must equal q_nope's kv_lora_rank {rank}, got {ckv.shape[2]}")
    if kpe.shape[2] != rope:
        raise ValueError(f"kpe_cache's last dim must equal q_pe's rope dim {rope}, got {kpe.shape[2]}")
    if kpe.shape[:2] != ckv.shape[:2]:
        raise ValueError(f"kpe_cache must have ckv_cache's (num_pages, page_size) {ckv.shape[:2]}, got {kpe.shape[:2]}")
    if 0 in (batch, heads, *ckv.shape):
        raise ValueError(f"q_nope and ckv_cache must not be empty, got shapes {qn.shape} and {ckv.shape}")
    if rank % (16 if qn.dtype == "float32" else RANK_MULTIPLE) or rank > MAX_RANK:
        raise ValueError(f"kv_lora_rank must be a multiple of {RANK_MULTIPLE} up to {MAX_RANK} in float16 and "
                         f"bfloat16 (a multiple of 16 in float32), got {rank} in {qn.dtype}")
    if rope % 16 or rope > MAX_ROPE:
        raise ValueError(f"rope_dim must be a multiple of 16 up to {MAX_ROPE} (0 allowed), got {rope}")
    if qn.dtype != "float32":  # float32 goes through a concatenated copy of the caches
        for op, name in zip(ops, names, strict=True):
            _aligned_rows(op, name)
    t_op, s_op = page_table_operands(page_table, seqlens, batch, qn.device)
    shapes = tuple((op.shape, op.strides) for op in (*ops, t_op, s_op))
    return MlaProblem(batch, heads, rank, rope, ckv.shape[1], ckv.shape[0], t_op.shape[1], qn.dtype, qn.device,
                      softmax_scale(scale, rank + rope), bool(return_lse), shapes)


class _Plan:
    """Kernel configuration, splits, grid and argument layout of one ``mla_decode`` problem."""

    def __init__(self, p, config=None, splits=None):
        self.problem = p
        limits = device_limits(0 if p.device is None else p.device)

        def occupancy(c):  # blocks of work without splits, blocks per SM, the splits that fill the GPU
            work = p.batch * -(-p.heads // c.heads_per_block)
            blocks_per_sm = max(1, min(2, limits["max_shared"] // mla_shared_bytes(c, p.rank, p.rope)))
            keys = p.max_pages * p.page_size
            return work, blocks_per_sm, split_count(work, keys, blocks_per_sm, 4 * c.block_n, limits["sms"])

        self.config = config or mla_default_config(p.rank, p.rope, limits["cc"], p.heads)
        error = mla_config_error(self.config, p.rank, p.rope, limits["cc"])
        if error:
            raise ValueError(f"MLA configuration {self.config}: {error}")
        work, blocks_per_sm, auto = occupancy(self.config)
        if config is None and (splits or auto) > 1:  # the default differs where the keys are split
            self.config = mla_default_config(p.rank, p.rope, limits["cc"], p.heads, split=True)
            work, blocks_per_sm, auto = occupancy(self.config)
        self.shared_bytes = mla_shared_bytes(self.config, p.rank, p.rope)
        self.splits = min(splits or auto, MAX_SPLITS)
        self.split = self.splits > 1
        self.grid = (self.splits, work // p.batch, p.batch)
        # the persistent grid takes whole sequences of at most PERSISTENT_HEADS heads; otherwise the ordinary one
        self.persistent = self.config.persistent and not self.split and p.heads <= PERSISTENT_HEADS
        if self.persistent:  # blocks that stay, taking the sequences in turn
            self.grid = (min(work, blocks_per_sm * limits["sms"]),)
        self.threads = 32 * self.config.warps
        kernel_config = replace(self.config, persistent=self.persistent)
        self.kernel = mla_decode_kernel(p.dtype, p.rank, p.rope, kernel_config, split=self.split, write_lse=p.return_lse)
        # the decode combine kernel sees the heads as one KV head's group of query rows
        self.combine_args = (p.dtype, p.rank, p.heads, 1, HEAD_ROWS, p.return_lse)
        self.combine = combine_kernel(*self.combine_args) if self.split else None
        self.combine_grid = (-(-p.heads // HEAD_ROWS), p.batch)
        self.part_shape = (p.batch, p.heads, 1, self.splits, p.rank)
        self.label = f"mla {kernel_config} {p.dtype} rank={p.rank} rope={p.rope} splits={self.splits}"

    def check_values(self, q_nope, page_table, seqlens):
        """``ValueError`` for lengths above the table's capacity or used page indices outside the cache
        (host arrays here; see ``_DevicePlan`` for device arrays)."""
        p = self.problem
        check_lengths_and_pages(seqlens, page_table, p.max_pages * p.page_size, "max_pages * page_size", p.page_size,
                                p.num_pages)


class _DevicePlan(_Plan, LaunchPlan):
    """Device arrays: prepared launches of the kernel (and, with splits, the combine), only pointers and the
    stream change per call (``checked_on_device``: lengths and pages checked on the GPU)."""

    def __init__(self, p, config=None, splits=None, checked_on_device=True):
        super().__init__(p, config, splits)
        storage = numba.from_dtype(storage_dtype(p.dtype))
        f32, i32 = types.float32, types.int32
        arrays = [(shape, strides, 2) for shape, strides in p.shapes[:4]]
        arrays += [(shape, strides, 4) for shape, strides in p.shapes[4:]]
        out = ((p.batch, p.heads, p.rank), (p.heads * p.rank, p.rank, 1), 2)
        lse = ((p.batch, p.heads), (p.heads, 1), 4) if p.return_lse else _unused(2)
        part = (self.part_shape, contiguous_strides(self.part_shape), 4) if self.split else _unused(5)
        part_lse = (self.part_shape[:4], contiguous_strides(self.part_shape[:4]), 4) if self.split else _unused(4)
        argtypes = (*(types.Array(storage, 3, "A"),) * 4, types.Array(i32, 2, "A"), types.Array(i32, 1, "A"),
                    types.Array(storage, 3, "A"), types.Array(f32, 2, "A"), types.Array(f32, 5, "A"),
                    types.Array(f32, 4, "A"), f32)
        combine_types = (types.Array(f32, 5, "A"), types.Array(f32, 4, "A"), types.Array(storage, 4, "A"),
                         types.Array(f32, 3, "A"))
        combine_spec = KernelSpec(combine_kernel, self.combine_args, combine_types, f"combine {p.dtype} dv={p.rank}")
        # the call's other kernels (the check's, the combine of splits) compile in a worker while this one does
        compile_ahead([*([index_check_spec(True)] if checked_on_device else []),
                       *([combine_spec] if self.split else [])], p.device)
        kernel = compiled(self.kernel, argtypes, p.device, self.shared_bytes, self.label)
        fields, slots = array_fields([*arrays, out, lse, part, part_lse])
        fields.append(np.float32(p.scale * LOG2E))
        # (stream, q_nope, q_pe, ckv, kpe, page_table, seqlens, out, lse), with splits (..., part, part_lse)
        self.launch_kernel = kernel.prepare(self.grid, self.threads, fields, slots if self.split else slots[:8])
        self.device, self.dtype, self.out_shape = p.device, p.dtype, (p.batch, p.heads, p.rank)
        self.lse_shape = (p.batch, p.heads) if p.return_lse else None
        self.workspace = None
        if self.split:
            combine = compiled(self.combine, combine_spec.argtypes, p.device, 0, combine_spec.label)
            o4 = ((p.batch, p.heads, 1, p.rank), (p.heads * p.rank, p.rank, 0, 1), 2)
            lse3 = ((p.batch, p.heads, 1), (p.heads, 1, 0), 4) if p.return_lse else _unused(3)
            fields, slots = array_fields([part, part_lse, o4, lse3])
            self.launch_combine = combine.prepare(self.combine_grid, NUM_THREADS, fields, slots)
            self.workspace = WorkspaceLayout((self.part_shape, self.part_shape[:4], (0,)))  # partials, no counters
        self._index_check = None

    def launch(self, stream, q_nope, q_pe, ckv, kpe, page_table, seqlens, out, lse, part=0, part_lse=0, _counters=0):
        """The kernel, and with splits the combine of its partial results."""
        if self.workspace is None:
            self.launch_kernel(stream, q_nope, q_pe, ckv, kpe, page_table, seqlens, out, lse)
            return
        self.launch_kernel(stream, q_nope, q_pe, ckv, kpe, page_table, seqlens, out, lse, part, part_lse)
        self.launch_combine(stream, part, part_lse, out, lse)

    def stream_of(self, q_nope):
        """The raw handle of the stream a launch on ``q_nope`` runs on."""
        return cai_stream(q_nope)

    def check_values(self, q_nope, page_table, seqlens):
        """Raise what an earlier call's check found on this GPU, then queue the check of these lengths and
        page indices on the launch's stream (no synchronisation)."""
        if self._index_check is None:
            p = self.problem
            table, lengths = p.shapes[4:]
            self._index_check = DeviceIndexCheck(p.device, table, lengths, p.max_pages * p.page_size, p.page_size,
                                                 p.num_pages)
        self._index_check(self.stream_of(q_nope), device_pointer(page_table), device_pointer(seqlens))

    def __call__(self, *arrays):
        return self.run_device_arrays(arrays)


class _TorchPlan(_DevicePlan):
    """torch CUDA tensors on torch's current stream: outputs from torch's allocator, the split workspace
    from ``SplitWorkspaces``."""

    def __init__(self, p, config=None, splits=None):
        super().__init__(p, config, splits)
        self._current_stream = torch_current()[1]
        self.run = self.torch_runner()

    def stream_of(self, q_nope):
        return self._current_stream(self.problem.device)

    def __call__(self, *arrays):
        return self.run(None, *(x.data_ptr() for x in arrays))


class _HostPlan(_Plan):
    """Host arrays: on a GPU machine contiguous copies go through the device plan of the current GPU;
    without a GPU the CPU path runs, or under ``numattn.simulate()`` the kernels in numba's simulator on
    numpy arrays."""

    def __init__(self, p, config=None, splits=None):
        super().__init__(p, config, splits)
        self._device_plan = None  # made by the first call on a GPU machine

    def __call__(self, q_nope, q_pe, ckv, kpe, page_table, seqlens):
        p = self.problem
        arrays = [np.ascontiguousarray(host_storage(x, describe(x, "x"))) for x in (q_nope, q_pe, ckv, kpe)]
        arrays += [np.ascontiguousarray(_host_index(x)) for x in (page_table, seqlens)]
        if not SIMULATOR:
            out, lse = self._on_device(arrays)
        elif simulating():
            out, lse = self._simulated(arrays)
        else:
            o, lse = cpu.mla_decode(*(float32_values(a, p.dtype) for a in arrays[:4]), *arrays[4:], p.scale)
            out = rounded_storage(o, p.dtype)
        result = wrap_host(out, q_nope, p.dtype)
        return (result, wrap_host(lse, q_nope, "float32")) if p.return_lse else result

    def _on_device(self, arrays):
        """``(output storage, lse or None)`` of this plan's kernels on contiguous copies of ``arrays``, on the
        GPU current at the first call."""
        p = self.problem
        if self._device_plan is None:
            shapes = tuple((a.shape, contiguous_strides(a.shape)) for a in arrays)
            self._device_plan = _DevicePlan(replace(p, device=cuda.get_current_device().id, shapes=shapes),
                                            self.config, self.splits, checked_on_device=False)
        result = on_device(self._device_plan, arrays)
        return result if p.return_lse else (result, None)

    def _simulated(self, arrays):
        """``(output storage, lse)`` of the GPU kernels in numba's simulator."""
        p = self.problem
        out = np.empty((p.batch, p.heads, p.rank), storage_dtype(p.dtype))
        lse = np.empty((p.batch, p.heads) if p.return_lse else (1, 1), np.float32)
        part = np.empty(self.part_shape if self.split else (1,) * 5, np.float32)
        part_lse = np.empty(self.part_shape[:4] if self.split else (1,) * 4, np.float32)
        compiled(self.kernel, None, 0, self.shared_bytes, self.label).launch_arrays(
            self.grid, self.threads, *arrays, out, lse, part, part_lse, np.float32(p.scale * LOG2E))
        if self.split:
            compiled(self.combine, None, 0, 0, "combine").launch_arrays(
                self.combine_grid, NUM_THREADS, part, part_lse, out[:, :, None, :], lse[:, :, None])
        return out, lse


def _host_index(x):
    return x.detach().cpu().numpy() if is_torch(x) else np.asarray(x)


def _unused(ndim):
    """``(shape, strides, itemsize)`` of a placeholder for an array argument the kernel does not read."""
    return (1,) * ndim, (1,) * ndim, 4


def mla_decode(q_nope: Array, q_pe: Array, ckv_cache: Array, kpe_cache: Array, page_table: Array, seqlens: Array,
               *, scale: float, return_lse: bool = False, check: bool = True) -> Array | tuple[Array, Array]:
    """MLA decode (absorbed weights): every query head attends to the shared latent rows of its sequence.

    Parameters
    ----------
    q_nope : ``[batch, heads, kv_lora_rank]``, float16 or bfloat16 (float32 for tests: the CUDA-core
        decode kernel over a copy of the caches with ``[ckv | kpe]`` keys, made on every call).
    q_pe : ``[batch, heads, rope_dim]`` (``rope_dim`` may be 0).
    ckv_cache : ``[num_pages, page_size, kv_lora_rank]``: the latent rows (keys and values).
    kpe_cache : ``[num_pages, page_size, rope_dim]``: their rotary parts (keys only).
    page_table : int32 ``[batch, max_pages]``: sequence ``b``'s row ``t`` is in page
        ``page_table[b, t // page_size]`` at position ``t % page_size``; see ``csr_page_table``
        for FlashInfer's CSR form.
    seqlens : int32 ``[batch]``: latent rows per sequence (0 gives zeros and an LSE of ``-inf``).
    scale : float, required: the softmax scale (of the model's un-absorbed head dim).
    return_lse : also return the natural-log log-sum-exp per head, float32 ``[batch, heads]``.
    check : check ``seqlens`` and the page indices they use, as ``decode`` does: device arrays on the
        GPU without a synchronisation, a bad value raised by the next checked call; skipped under
        CUDA-graph capture. Unchecked values are clamped into range.

    Returns
    -------
    ``o`` ``[batch, heads, kv_lora_rank]`` like ``q_nope``, or ``(o, lse)``; a NaN score makes its
    head's output and LSE NaN.

    Notes
    -----
    ``kv_lora_rank`` a multiple of 64 up to 512 (of 16 in float32), ``rope_dim`` a multiple of 16
    up to 64; rows contiguous.

    Examples
    --------
    >>> import numpy as np, numattn
    >>> rng = np.random.default_rng(0)
    >>> q_nope = rng.standard_normal((2, 16, 64)).astype(np.float16)
    >>> q_pe = rng.standard_normal((2, 16, 16)).astype(np.float16)
    >>> ckv = rng.standard_normal((8, 4, 64)).astype(np.float16)
    >>> kpe = rng.standard_normal((8, 4, 16)).astype(np.float16)
    >>> table = np.array([[0, 1, 2, 3], [4, 5, 6, 7]], np.int32)
    >>> numattn.mla_decode(q_nope, q_pe, ckv, kpe, table, np.array([13, 6], np.int32), scale=0.1).shape
    (2, 16, 64)
    """
    if check.__class__ is not bool and not isinstance(check, np.bool_):
        raise TypeError(f"check must be a bool, got {type(check).__name__}")
    arrays = (q_nope, q_pe, ckv_cache, kpe_cache, page_table, seqlens)
    key = None
    if all(is_torch(x) for x in arrays):
        key = ("mla_decode", *map(array_signature, arrays), type(scale), scale, bool(return_lse))
    plan = PLANS.get(key) if key is not None else None
    if plan is None:
        p = validate(*arrays, scale, return_lse)
        if p.dtype == "float32":
            return _through_decode(arrays, p, check)
        plan = planned(p, *(_tuned(p) or (None, None)), torch=key is not None)
        if key is not None:
            PLANS.store(key, plan)
    if check and not (key is not None and plan.problem.device is not None and _capturing_torch()):
        plan.check_values(q_nope, page_table, seqlens)
    return plan(*arrays)


def _through_decode(arrays, p, check):
    """float32, a path for tests: ``paged_decode`` (its CUDA-core kernel) over one KV head whose keys
    are ``[ckv | kpe]``, concatenated into a copy on every call, and whose values are ``ckv``."""
    q_nope, q_pe, ckv, kpe, page_table, seqlens = arrays
    if all(is_torch(x) for x in arrays[:4]):
        import torch

        concatenate = torch.cat
    elif all(isinstance(x, np.ndarray) for x in arrays[:4]):
        concatenate = np.concatenate
    else:
        raise TypeError(f"float32 mla_decode takes torch tensors or numpy arrays, got {type(q_nope).__name__}")
    q = concatenate([q_nope, q_pe], -1)
    keys = concatenate([ckv, kpe], -1)[:, :, None, :]
    result = paged_decode(q, keys, ckv[:, :, None, :], page_table, seqlens, scale=p.scale, kv_layout="nhd",
                          return_lse=p.return_lse, check=check)
    return (result[0], result[1][:, :, 0]) if p.return_lse else result


def planned(p, config=None, splits=None, torch=True):
    """The plan of problem ``p`` with ``config`` and ``splits`` (the heuristic's where None): host arrays
    (and the simulator), torch CUDA tensors (``torch``) or other device arrays."""
    if p.device is None or SIMULATOR:
        return _HostPlan(p, config, splits)
    return (_TorchPlan if torch else _DevicePlan)(p, config, splits)


def tuning_options(p):
    """``[(config, splits, modelled seconds)]`` of (float16 or bfloat16) MLA decode problem ``p``: the
    configurations and key splits ``numattn.tune`` tries (in the simulator the ones that simulate in
    seconds)."""
    limits = device_limits(0 if p.device is None else p.device)
    row_bytes = 2 * (p.rank + p.rope)
    configs = mla_candidates(p.rank, p.rope, limits["cc"])
    if SIMULATOR:
        configs = [c for c in configs if not c.wgmma and c.block_n == 16 and c.stages == 2 and c.warps == 4]
    # also the default's persistent grid where it has one, unsplit (split, or with more than
    # PERSISTENT_HEADS heads, it runs the ordinary kernel)
    persistent = dataclasses.replace(mla_default_config(p.rank, p.rope, limits["cc"]), persistent=True)
    if p.heads <= PERSISTENT_HEADS and mla_config_error(persistent, p.rank, p.rope, limits["cc"]) is None:
        configs = [*configs, persistent]
    candidates = []
    for config in configs:
        work = p.batch * -(-p.heads // config.heads_per_block)
        for _, splits, seconds in split_candidates(work, p.max_pages * p.page_size, row_bytes, row_bytes * p.heads):
            if splits == 1 or not config.persistent:
                candidates.append((config, splits, seconds))
    return candidates


def _tuned(p):
    """``(config, splits)`` that ``numattn.tune`` stored for this problem, or None."""
    return tuned_config("mla_decode", p, tuning_options)


def _capturing_torch():
    import torch

    return capturing_now(torch)
