"""What every op's plans share: the one plan cache, the signature of an array a plan depends on, data
pointers, and the per-call outputs of a plan on torch tensors."""

import numpy as np

from .._arrays import device_pointer, is_torch


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


class TorchOutputs:
    """A plan's output, LSE and split workspace, allocated per call from torch's allocator.

    The workspace is one fp32 buffer: the partial outputs ``part_shape``, then their
    log2-sum-exps (``part_shape[:-1]``). ``lse_shape`` / ``part_shape`` None: not needed.
    """

    def __init__(self, torch, device, dtype, out_shape, lse_shape, part_shape):
        one = torch.empty(1, dtype=getattr(torch, dtype), device=torch.device("cuda", device))
        self._empty_like = torch.empty_like
        # expanded views of one element: ``empty_like`` of these is torch's cheapest allocation of the shape
        self.out_template = one.expand(out_shape)
        self.lse_template = one.float().expand(lse_shape) if lse_shape is not None else None
        self._part_size = int(np.prod(part_shape)) if part_shape is not None else 0
        self._workspace = (one.float().expand(self._part_size + self._part_size // part_shape[-1])
                           if part_shape is not None else None)

    def allocate(self, out=None):
        """``(out, lse or None, workspace or None, partials pointer, their LSEs pointer)`` (0s without a
        workspace); a given ``out`` is used as it is."""
        empty_like = self._empty_like
        if out is None:
            out = empty_like(self.out_template)
        lse = empty_like(self.lse_template) if self.lse_template is not None else None
        if self._workspace is None:
            return out, lse, None, 0, 0
        workspace = empty_like(self._workspace)
        part = workspace.data_ptr()
        return out, lse, workspace, part, part + 4 * self._part_size
