"""The score modifications of an attention call (sliding window, logit softcap, ALiBi, sinks): their
validation, and how the kernels take them (``kernels/score_mods.py``)."""

import math
from dataclasses import dataclass

import numpy as np

from .._arrays import Operand, contiguous_strides, describe, host_storage
from ..kernels.constants import LOG2E
from ..kernels.score_mods import UNBOUNDED, ScoreMods

_ABSENT_ARRAYS = (((1, 1), (1, 1), 4), ((1,), (1,), 4))  # the kernels' alibi and sinks arguments when unused


@dataclass(frozen=True)
class ScoreOptions:
    """A call's validated score modifications.

    ``window``: ``(left, right)`` keys, ``UNBOUNDED`` for a side without a bound (under ``causal`` right
    is 0), or None where no window bounds more than ``causal`` does; ``softcap``: the cap ``c`` or None;
    ``alibi``: float32 slopes ``[heads_q]`` or ``[batch, heads_q]``; ``sinks``: float32 ``[heads_q]``.
    """

    window: tuple | None = None
    softcap: float | None = None
    alibi: Operand | None = None
    sinks: Operand | None = None

    @property
    def mods(self):
        """The kernel specialisation's ``ScoreMods``."""
        return ScoreMods(self.window is not None, self.softcap is not None, self.alibi is not None,
                         self.sinks is not None)

    def scalars(self):
        """The kernels' ``(left, right, cap_log2, cap_slope)`` launch arguments."""
        left, right = self.window or (UNBOUNDED, UNBOUNDED)
        cap = self.softcap or 1.0
        return [left, right, np.float32(cap * LOG2E), np.float32(2.0 / cap)]

    def arrays(self, batch, heads_q):
        """``(shape, strides, itemsize)`` of the kernels' ``alibi [batch, heads_q]`` (slopes shared by the
        batch as a stride of 0) and ``sinks [heads_q]`` arguments."""
        absent_alibi, absent_sinks = _ABSENT_ARRAYS
        alibi, sinks = absent_alibi, absent_sinks
        if self.alibi is not None:
            strides = self.alibi.strides if len(self.alibi.shape) == 2 else (0, *self.alibi.strides)
            alibi = ((batch, heads_q), strides, 4)
        if self.sinks is not None:
            sinks = (self.sinks.shape, self.sinks.strides, 4)
        return [alibi, sinks]

    def host_arrays(self, alibi, sinks, batch, heads_q):
        """The kernels' ``alibi`` and ``sinks`` arguments as float32 numpy arrays (views of host ``alibi``
        and ``sinks``, or unused zeros) for the simulator."""
        alibi = (np.zeros((1, 1), np.float32) if self.alibi is None
                 else np.broadcast_to(host_storage(alibi, self.alibi), (batch, heads_q)))
        sinks = np.zeros(1, np.float32) if self.sinks is None else host_storage(sinks, self.sinks)
        return alibi, sinks

    def on_device(self, device):
        """These options with contiguous copies of the arrays on GPU ``device`` (host arrays run there)."""
        def moved(op):
            return None if op is None else Operand("numba", op.dtype, op.shape, contiguous_strides(op.shape), device)

        return ScoreOptions(self.window, self.softcap, moved(self.alibi), moved(self.sinks))

    def label(self):
        """The options for a kernel label ("" when there are none)."""
        parts = [f"window={self.window}" if self.window else "", f"softcap={self.softcap}" if self.softcap else "",
                 "alibi" if self.alibi else "", "sinks" if self.sinks else ""]
        return " ".join(part for part in parts if part)


NO_OPTIONS = ScoreOptions()


def options_key(window, softcap, alibi_slopes, sinks):
    """The plan-cache key of a call's score-modification arguments, with their types (a cached plan never
    takes what validation would refuse); AttributeError for arrays other than torch tensors."""
    def array(x):
        return None if x is None else (x.__class__, x.dtype, x.shape, x.stride(), x.device)

    if window is None and softcap is None and alibi_slopes is None and sinks is None:
        return None
    return (window.__class__, window, window_side_types(window), softcap.__class__, softcap, array(alibi_slopes),
            array(sinks))


def window_side_types(window):
    """The types of a ``window`` argument's sides for a plan-cache key, which holds the window itself too:
    ``(4.0, 0) == (4, 0)`` and ``(True, 0) == (1, 0)``, but validation takes int sides only."""
    return None if window is None else tuple(map(type, window))


def window_bounds(window, causal):
    """``ScoreOptions.window`` of a ``window`` argument: None, or a pair ``(left, right)`` whose sides are
    non-negative ints, or None or -1 for no bound."""
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be None or a pair (left, right), got {window!r}")
    sides = []
    for name, side in zip(("left", "right"), window, strict=True):
        if side is None:
            side = -1
        if isinstance(side, (bool, np.bool_)) or not isinstance(side, (int, np.integer)):
            raise TypeError(f"window's {name} side must be an int or None, got {type(side).__name__}")
        if side < -1:
            raise ValueError(f"window's {name} side must be >= 0, or -1 or None for no bound, got {side}")
        sides.append(UNBOUNDED if side == -1 else min(int(side), UNBOUNDED))
    left, right = sides
    if causal:
        right = 0
    if left == UNBOUNDED and (right == UNBOUNDED or causal):
        return None
    return left, right


_SOFTCAP_MIN, _SOFTCAP_MAX = 1e-30, 1e30


def softcap_value(softcap):
    """``ScoreOptions.softcap`` of a ``softcap`` argument: None or 0 for none, else a finite positive real."""
    if softcap is None:
        return None
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, (int, float, np.integer, np.floating)):
        raise TypeError(f"softcap must be a real number or None, got {type(softcap).__name__}")
    try:
        value = float(softcap)
    except OverflowError:  # an int beyond float range
        value = math.inf
    if value == 0.0:
        return None
    if not (math.isfinite(value) and value > 0.0):
        raise ValueError(f"softcap must be a finite positive number (or None or 0 for none), got {softcap}")
    if not _SOFTCAP_MIN <= value <= _SOFTCAP_MAX:
        raise ValueError(f"softcap must be in [{_SOFTCAP_MIN:g}, {_SOFTCAP_MAX:g}] (kernels take softcap · log2(e) "
                         f"and 2 / softcap in float32; a larger cap changes no float32 score: pass None), "
                         f"got {softcap}")
    return value


def _per_head_array(x, name, shapes, device):
    """The operand of a float32 array argument of one of ``shapes``, on ``device`` (q's)."""
    op = describe(x, name)
    if op.dtype != "float32":
        raise TypeError(f"{name} must be float32, got {op.dtype}")
    if tuple(op.shape) not in shapes:
        raise ValueError(f"{name} must have shape {' or '.join(map(str, shapes))}, got {tuple(op.shape)}")
    if op.device != device:
        where = "host memory" if device is None else f"GPU {device}"
        raise ValueError(f"{name} must be in {where} like q, got {op.where}")
    return op


def score_options(window, softcap, alibi_slopes, sinks, causal, batch, heads_q, device):
    """The ``ScoreOptions`` of an attention call's arguments, or the TypeError/ValueError that names the bad one
    (``batch``, ``heads_q`` and ``device`` are q's)."""
    alibi = None if alibi_slopes is None else _per_head_array(alibi_slopes, "alibi_slopes",
                                                              ((heads_q,), (batch, heads_q)), device)
    sink_op = None if sinks is None else _per_head_array(sinks, "sinks", ((heads_q,),), device)
    options = ScoreOptions(window_bounds(window, causal), softcap_value(softcap), alibi, sink_op)
    return NO_OPTIONS if options == NO_OPTIONS else options
