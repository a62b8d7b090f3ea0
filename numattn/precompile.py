"""Compile ahead of time the kernels a workload needs, in parallel worker processes, into the kernel
cache (``kernels/kernel_cache.py``), so that a server, a CI job or a container build pays the compiles
once and every later process starts warm.

A workload is a call: an op and its shapes. Each runs once on random inputs in a worker process; what it
compiles is stored in the cache, where a later call of the same specialisation finds it. Without a GPU
the call runs on the CPU path, whose compiled functions numba keeps in its own cache.

Ahead of time for another GPU, or on a machine without one (``gpu=``, ``--gpu``): each workload is planned
for that GPU model's properties on shape-only operands (no arrays, nothing launched), and every kernel its
plans take is compiled for the model's compute capability into the kernel cache, which a process on such a
GPU with the same numattn and toolchain then loads.
"""

import concurrent.futures
import contextlib
import multiprocessing
import os
import time
from dataclasses import asdict, dataclass

DTYPES = ("float16", "bfloat16", "float32")
OPS = ("attention", "decode", "paged_decode", "mla_decode", "train")


@dataclass(frozen=True)
class Workload:
    """One call to compile for.

    ``op``: ``"attention"`` (q ``[batch, heads_q, seqlen, head_dim]``, k and v with ``heads_kv``),
    ``"decode"`` and ``"paged_decode"`` (one new token per sequence over a cache of ``seqlen`` keys,
    pages of ``page_size`` rows), ``"mla_decode"`` (``heads_q`` heads, latent rank ``head_dim``, rope
    ``rope_dim``, pages of ``page_size``), ``"train"`` (``numattn.torch.attention`` forward and backward).
    """

    op: str
    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: str = "bfloat16"
    causal: bool = True
    batch: int = 2
    seqlen: int = 1024
    page_size: int = 16
    rope_dim: int = 64

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"op must be one of {', '.join(map(repr, OPS))}, got {self.op!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(map(repr, DTYPES))}, got {self.dtype!r}")
        for name in ("heads_q", "heads_kv", "head_dim", "batch", "seqlen", "page_size", "rope_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "rope_dim" else 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.heads_q % self.heads_kv:
            raise ValueError(f"heads_q ({self.heads_q}) must be a multiple of heads_kv ({self.heads_kv})")

    def describe(self):
        shape = (f"rank {self.head_dim}, rope {self.rope_dim}, {self.heads_q} heads" if self.op == "mla_decode" else
                 f"heads {self.heads_q}/{self.heads_kv}, head_dim {self.head_dim}")
        return f"{self.op} {self.dtype} {shape}" + (", causal" if self.causal and self.op in ("attention", "train")
                                                     else "")


def _model(heads_q, heads_kv, head_dim):
    """A dense model's calls: causal prefill, decode over a contiguous and a paged cache, training."""
    return tuple(Workload(op, heads_q, heads_kv, head_dim) for op in ("attention", "decode", "paged_decode", "train"))


PRESETS = {
    "llama3-8b": _model(32, 8, 128),
    "llama3-70b": _model(64, 8, 128),
    "qwen2.5-7b": _model(28, 4, 128),
    "qwen2.5-72b": _model(64, 8, 128),
    "deepseek-v3-mla": (Workload("mla_decode", 16, 1, 512, page_size=64), Workload("mla_decode", 128, 1, 512,
                                                                                   page_size=64)),
}
"""Named workloads of common models (bf16): their attention's head counts and head dims, one call of each
op. The MLA preset takes DeepSeek-V3's latent cache with 16 heads per GPU (8-way tensor parallel) and 128."""


ARCHES = {"sm_80": "a100", "sm_86": "a10", "sm_89": "l40s", "sm_90": "h100"}
"""A GPU model of each compute capability, for ``gpu="sm_XY"``: plans depend on the SM count and memory too."""


def precompile(*workloads: "Workload | str", processes: int | None = None, gpu: str | None = None) -> list[dict]:
    """Compile the kernels of ``workloads`` into the kernel cache, in parallel worker processes.

    Parameters
    ----------
    *workloads : ``Workload`` or the name of a preset (``PRESETS``: ``"llama3-8b"``, ``"llama3-70b"``,
        ``"qwen2.5-7b"``, ``"qwen2.5-72b"``, ``"deepseek-v3-mla"``).
    processes : int, optional
        Worker processes (default: the number of workloads, at most 4). Workers that need the same
        kernel wait for the first to compile it.
    gpu : str, optional
        Compile for this GPU model instead of running the calls here: ``"h100"``, ``"h200"``, ``"a100"``,
        ``"l40s"``, ``"a10"`` (``launch.GPUS``), or a compute capability ``"sm_90"``, ``"sm_89"``,
        ``"sm_86"``, ``"sm_80"`` (one model of it, ``ARCHES``). Needs no GPU: the workloads are planned for
        the model and their kernels compiled into the kernel cache, nothing runs.

    Returns
    -------
    list of dict
        Per workload, in order: ``workload`` (its description), ``seconds`` (the call in its worker,
        compiles included), ``error`` (None, or the exception's text).

    Examples
    --------
    >>> import numattn
    >>> report = numattn.precompile(numattn.Workload("attention", 4, 2, 64, dtype="float32", seqlen=64),
    ...                             processes=1)
    >>> [row["error"] for row in report]
    [None]
    """
    expanded = []
    for workload in workloads:
        if isinstance(workload, str):
            if workload not in PRESETS:
                raise ValueError(f"unknown preset {workload!r}; presets: {', '.join(PRESETS)}")
            expanded.extend(PRESETS[workload])
        elif isinstance(workload, Workload):
            expanded.append(workload)
        else:
            raise TypeError(f"workloads must be Workload objects or preset names, got {type(workload).__name__}")
    if processes is None:
        processes = min(4, len(expanded))
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise ValueError(f"processes must be a positive int, got {processes!r}")
    if gpu is not None:
        from .kernels.kernel_cache import cache_directory
        from .kernels.launch import GPUS

        if ARCHES.get(gpu, gpu) not in GPUS:
            raise ValueError(f"gpu must be one of {', '.join(map(repr, [*GPUS, *ARCHES]))}, got {gpu!r}")
        if cache_directory() is None:
            raise ValueError("gpu= compiles into the kernel cache, which NUMATTN_KERNEL_CACHE=off turns off")
        gpu = ARCHES.get(gpu, gpu)
    if not expanded:
        return []
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no inherited CUDA context
    # for a GPU model, numba's GPU target in the workers even without a GPU (not its simulator)
    with _environment(NUMBA_ENABLE_CUDASIM="0") if gpu else contextlib.nullcontext():
        with concurrent.futures.ProcessPoolExecutor(processes, mp_context=context) as pool:
            return list(pool.map(_run, [asdict(w) for w in expanded], [gpu] * len(expanded)))


@contextlib.contextmanager
def _environment(**values):
    """``os.environ`` with ``values`` set (for the processes started meanwhile), restored afterwards."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _run(fields, gpu=None):
    """One workload in a worker process: its call on random inputs (or its plans for ``gpu``), timed; errors
    reported, not raised."""
    workload = Workload(**fields)
    start = time.perf_counter()
    try:
        if gpu is None:
            _call(workload)
        else:
            _plan_for(workload, gpu)
        error = None
    except Exception as exc:  # noqa: BLE001  (reported per workload; the others go on)
        error = f"{type(exc).__name__}: {exc}"
    return {"workload": workload.describe(), "seconds": time.perf_counter() - start, "error": error}


def _plan_for(w, gpu):
    """The plans of workload ``w``'s call made for GPU model ``gpu`` on shape-only operands, which compiles
    their kernels into the kernel cache for it (``launch.targeting``); nothing runs."""
    from ._arrays import Operand, contiguous_strides
    from .kernels.compile_ahead import compile_ahead
    from .kernels.launch import GPUS, targeting
    from .ops import attention, backward, decode, mla

    def operand(*shape, dtype=w.dtype):
        return Operand("cai", dtype, shape, contiguous_strides(shape), 0)

    b, hq, hkv, d, length = w.batch, w.heads_q, w.heads_kv, w.head_dim, w.seqlen
    pages = -(-length // w.page_size)
    lengths, table = operand(b, dtype="int32"), operand(b, pages, dtype="int32")
    with targeting(GPUS[gpu]):
        if w.op in ("attention", "train"):
            q, k, v = operand(b, hq, length, d), operand(b, hkv, length, d), operand(b, hkv, length, d)
            attention.make_plan(attention.validate(q, k, v, None, w.causal, None, "bhsd", w.op == "train"))
            if w.op == "train":  # the backward's kernels (compiled here and now while targeting)
                compile_ahead(backward.backward_specs(w.dtype, d, d, w.causal), 0)
        elif w.op == "decode":
            cache = operand(b, hkv, length, d)
            decode.make_plan(decode.validate_decode_args(operand(b, hq, d), cache, cache, None, lengths, None, "bhsd",
                                                         False))
        elif w.op == "paged_decode":
            cache = operand(b * pages, w.page_size, hkv, d)
            decode.make_plan(decode.validate_paged_args(operand(b, hq, d), cache, cache, table, lengths, None, "nhd",
                                                        False))
        else:  # mla_decode
            problem = mla.validate(operand(b, hq, d), operand(b, hq, w.rope_dim), operand(b * pages, w.page_size, d),
                                   operand(b * pages, w.page_size, w.rope_dim), table, lengths,
                                   1.0 / (d + w.rope_dim) ** 0.5, False)
            mla.planned(problem, torch=False)


def _call(w):
    import numpy as np

    from .ops.attention import attention
    from .ops.decode import decode, paged_decode
    from .ops.mla import mla_decode

    torch = _torch_on_gpu()
    rng = np.random.default_rng(0)

    def array(*shape, dtype=w.dtype):
        values = rng.standard_normal(shape, dtype=np.float32)
        if torch is None:
            return values.astype(dtype) if dtype != "bfloat16" else _bfloat16(values)
        return torch.from_numpy(values).to("cuda", getattr(torch, dtype))

    def ints(values):
        values = np.asarray(values, np.int32)
        return values if torch is None else torch.from_numpy(values).cuda()

    b, hq, hkv, d, length = w.batch, w.heads_q, w.heads_kv, w.head_dim, w.seqlen
    if w.op == "attention":
        attention(array(b, hq, length, d), array(b, hkv, length, d), array(b, hkv, length, d), causal=w.causal)
    elif w.op == "decode":
        decode(array(b, hq, d), array(b, hkv, length, d), array(b, hkv, length, d), seqlens=ints(np.full(b, length)))
    elif w.op == "paged_decode":
        pages = -(-length // w.page_size)
        table = ints(np.arange(b * pages).reshape(b, pages))
        paged_decode(array(b, hq, d), array(b * pages, w.page_size, hkv, d), array(b * pages, w.page_size, hkv, d),
                     table, ints(np.full(b, length)))
    elif w.op == "mla_decode":
        pages = -(-length // w.page_size)
        mla_decode(array(b, hq, d), array(b, hq, w.rope_dim), array(b * pages, w.page_size, d),
                   array(b * pages, w.page_size, w.rope_dim), ints(np.arange(b * pages).reshape(b, pages)),
                   ints(np.full(b, length)), scale=1.0 / np.sqrt(d + w.rope_dim))
    else:  # train
        import torch as torch_module

        from .torch import attention as trained_attention

        device = "cuda" if torch is not None else "cpu"
        q, k, v = (torch_module.randn(b, h, length, d, device=device, dtype=getattr(torch_module, w.dtype),
                                      requires_grad=True) for h in (hq, hkv, hkv))
        trained_attention(q, k, v, causal=w.causal).sum().backward()
    if torch is not None:
        torch.cuda.synchronize()


def _torch_on_gpu():
    """torch, when it is installed and sees a GPU (the workloads then run on torch CUDA tensors); else None."""
    from ._cuda import SIMULATOR

    if SIMULATOR:
        return None
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _bfloat16(values):
    """bfloat16 values of a float32 numpy array as a torch CPU tensor (numpy has no bfloat16)."""
    import torch

    return torch.from_numpy(values).to(torch.bfloat16)


def main(args):
    """``python -m numattn precompile``: the presets and workloads named, then a line per workload."""
    import json

    workloads = list(args.preset or [])
    for text in args.workload or []:
        try:
            workloads.append(Workload(**json.loads(text)))
        except (TypeError, json.JSONDecodeError) as exc:
            raise SystemExit(f"--workload {text!r}: {exc}") from exc
    if not workloads:
        raise SystemExit("nothing to compile: name --preset (" + ", ".join(PRESETS) + ") or --workload JSON")
    from .kernels import kernel_cache

    start = time.perf_counter()
    report = precompile(*workloads, processes=args.processes, gpu=args.gpu)
    for row in report:
        status = "ok" if row["error"] is None else f"FAILED: {row['error']}"
        print(f"{row['workload']:62} {row['seconds']:7.1f} s  {status}")
    from ._cuda import SIMULATOR

    where = kernel_cache.cache_directory()
    kept = ("the kernel cache is off: nothing kept" if where is None
            else f"kernel cache: {where}, for {ARCHES.get(args.gpu, args.gpu)}" if args.gpu
            else "no GPU: the CPU path's compiled functions are kept in numba's cache" if SIMULATOR
            else f"kernel cache: {where}")
    print(f"{len(report)} workloads in {time.perf_counter() - start:.1f} s; {kept}")
    return 1 if any(row["error"] is not None for row in report) else 0
