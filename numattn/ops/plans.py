"""What every op's plans share: the one plan cache, the signature of an array a plan depends on, data
pointers, and the launch-plan stack: how one op's launch runs on torch tensors, on other device arrays
(``__cuda_array_interface__``) and on host arrays through the GPU.

An op's device plan derives from ``LaunchPlan`` and supplies its kernels' launch; everything else about
the kinds of arrays lives here, once for every op. Host arrays without a GPU (the CPU path, the
simulator) are each op's own: they run other code than the kernels' launch.
"""

import functools
import sys

import numpy as np

from .._arrays import cai_stream, device_pointer, empty_device_like, is_torch, torch_current
from .._cuda import cuda
from ..kernels.launch import zero_words
from .workspace import SplitWorkspaces


class PlanCache(dict):
    """Plans by call signature, for every op: a key starts with the op's name; ``store`` empties the cache
    when it holds ``limit`` plans (a process whose shapes never repeat keeps no more than that)."""

    def __init__(self, limit):
        super().__init__()
        self.limit = limit

    def store(self, key, plan):
        if len(self) >= self.limit:
            self.clear()
        self[key] = plan


PLANS = PlanCache(limit=4096)


def records_grad(q, k, v, sinks=None):
    """Whether torch would record gradients through q, k, v or the sinks (torch tensors requiring grad, outside
    ``torch.no_grad``): the ops record none, ``numattn.torch`` does."""
    try:
        needs = q.requires_grad or k.requires_grad or v.requires_grad
    except AttributeError:  # not all torch tensors
        needs = any(getattr(x, "requires_grad", False) for x in (q, k, v))
    if sinks is not None and not needs:
        needs = getattr(sinks, "requires_grad", False)
    return needs and sys.modules["torch"].is_grad_enabled()


def array_signature(x):
    """What a plan depends on of one argument (None for an absent one); TypeError for arrays of other
    libraries than torch and numpy, which are validated and planned on every call."""
    if x is None:
        return None
    if is_torch(x):
        return (x.dtype, x.shape, x.stride(), x.device, x.data_ptr() & 15)
    if isinstance(x, np.ndarray):
        return (x.dtype, x.shape, x.strides)
    raise TypeError(f"no plan signature for {type(x).__name__}")


def where(device):
    """Where an operand lives, for messages: host memory or a GPU."""
    return "host memory" if device is None else f"GPU {device}"


def tensor_pointer(x):
    """A torch tensor's data pointer, 0 for None."""
    return 0 if x is None else x.data_ptr()


def array_pointer(x):
    """A device array's data pointer, 0 for None."""
    return 0 if x is None else device_pointer(x)


def tensor_maker(torch, shape, dtype, device, zeroed=False):
    """``make()``: a new torch tensor of ``shape`` and ``dtype`` on ``device``, zeroed or not, made by
    ``torch.empty_like`` (``zeros_like``) of a stride-0 view of one element: torch's cheapest allocation of a
    shape, bound once for a plan's calls."""
    template = torch.empty(1, dtype=dtype, device=device).expand(shape)
    return functools.partial(torch.zeros_like if zeroed else torch.empty_like, template)


class LaunchPlan:
    """An op's kernels prepared for one problem on one GPU, and how they run on each kind of device array.

    A subclass sets ``device`` (the GPU's id), ``dtype`` (the output's), ``out_shape``, ``lse_shape`` (None
    when the call returns no log-sum-exp) and ``workspace`` (a ``WorkspaceLayout`` of the split workspace,
    or None), and defines ``launch(stream, *inputs, out, lse)``, with a workspace ``launch(stream, *inputs,
    out, lse, part, part_lse, counters)``: queue the kernels on the raw stream handle ``stream``, every
    array given by its data pointer (0: absent).
    """

    def torch_runner(self, launch=None):
        """``run(out, *inputs)`` on torch tensors' data pointers: allocate the outputs (``out`` used when
        given), queue ``launch`` (``self.launch`` by default) on torch's current stream of the plan's GPU
        with that stream's split workspace, and return ``out`` or ``(out, lse)``. Everything a call looks
        up is bound here, once: this is the host path of a decode loop."""
        import torch

        device = self.device
        gpu = torch.device("cuda", device)
        new_out = tensor_maker(torch, self.out_shape, getattr(torch, self.dtype), gpu)
        new_lse = None if self.lse_shape is None else tensor_maker(torch, self.lse_shape, torch.float32, gpu)
        launch = launch or self.launch
        get_device, current_stream = torch_current()
        single_device = torch.cuda.device_count() == 1
        layout = self.workspace
        workspace = None if layout is None else SplitWorkspaces.getter(torch, device, layout.counter_words, layout.words)
        part_lse_offset = 0 if layout is None else layout.part_lse_offset

        def run(out, *inputs):
            if not single_device and get_device() != device:
                with torch.cuda.device(device):
                    return run(out, *inputs)
            if out is None:
                out = new_out()
            lse = None if new_lse is None else new_lse()
            stream = current_stream(device)
            if workspace is None:
                launch(stream, *inputs, out.data_ptr(), 0 if lse is None else lse.data_ptr())
            else:
                counters, part, _held = workspace(stream)  # held until the launch is queued
                launch(stream, *inputs, out.data_ptr(), 0 if lse is None else lse.data_ptr(), part,
                       part + part_lse_offset, counters)
            return out if lse is None else (out, lse)

        return run

    def run_device_arrays(self, inputs, out=None):
        """Run on device arrays other than torch's (numba, CuPy, any ``__cuda_array_interface__``; None for an
        absent input), on the stream the first one names: the outputs and the split workspace are allocated
        like it, the workspace's counters zeroed on that stream. Returns ``out`` or ``(out, lse)``."""
        like = inputs[0]
        if out is None:
            out = empty_device_like(like, self.out_shape, self.dtype, self.device)
        lse = None if self.lse_shape is None else empty_device_like(like, self.lse_shape, "float32", self.device)
        stream = cai_stream(like)
        pointers = [*map(array_pointer, inputs), array_pointer(out), array_pointer(lse)]
        if self.workspace is not None:
            workspace = empty_device_like(like, (self.workspace.words,), "float32", self.device)
            counters = device_pointer(workspace)
            if self.workspace.counter_words:
                zero_words(counters, self.workspace.counter_words, stream)
            pointers += [*self.workspace.partials(counters), counters]
        self.launch(stream, *pointers)
        return out if lse is None else (out, lse)


def on_device(run, host_arrays):
    """Host arrays through the current GPU: ``run(*device_arrays)`` on contiguous numba copies of
    ``host_arrays`` (numpy arrays; None passes through), its result (a device array or a tuple of them)
    copied back to numpy arrays."""
    arrays = [None if x is None else cuda.to_device(np.ascontiguousarray(x)) for x in host_arrays]
    result = run(*arrays)
    if isinstance(result, tuple):
        return tuple(x.copy_to_host() for x in result)
    return result.copy_to_host()
