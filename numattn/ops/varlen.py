"""``numattn.attention_varlen``: attention over a packed batch of variable-length sequences, keys and
values packed likewise or in pages (paged and chunked prefill).

A call becomes an attention ``Problem`` (``ops/attention.py``) with ``sequences`` set: the kernels map
their blocks to (sequence, query tile) through the cumulative lengths (``kernels/sequences.py``), with no
padding, and the plans of ``attention`` run it.
"""

from dataclasses import dataclass, field, replace

import numpy as np
from numba import types

from .._arrays import Array, Operand, cai_stream, contiguous_strides, describe, from_dlpack, is_torch, torch_current
from .._cuda import SIMULATOR
from ..kernels.sequences import SequenceLayout
from .attention import (
    MAX_HEAD_DIM,
    Problem,
    check_one_dtype_and_device,
    make_plan,
    out_operand,
    softmax_scale,
)
from .checks import (
    DeviceVarlenCheck,
    check_float_operand,
    check_index_operand,
    first_varlen_problem,
    host_values,
    varlen_message,
)
from .plans import PLANS, array_pointer, array_signature, records_grad
from .score_mods import options_key, score_options

_INT32 = types.Array(types.int32, 1, "A")
_ABSENT = (((1,), (1,), 4), ((1,), (1,), 4), ((1,), (1,), 4), ((1, 1), (1, 1), 4))  # cu_q, cu_k, seqused_k, table


@dataclass(frozen=True)
class Sequences:
    """The int32 arrays that place a varlen call's sequences (None: absent), and the sizes they index."""

    cu_seqlens_q: Operand
    cu_seqlens_k: Operand | None
    seqused_k: Operand | None
    page_table: Operand | None
    total_q: int
    total_k: int  # packed key rows, or the page array's keys (num_pages · page_size)
    max_seqlen_q: int
    max_seqlen_k: int
    page_size: int = 0  # keys per page, 0 for packed keys
    _device_check: object = field(default=None, compare=False, repr=False)  # the GPU's check, made on first use

    @property
    def layout(self):
        """The kernels' ``SequenceLayout``."""
        return SequenceLayout(True, self.page_size, self.seqused_k is not None)

    @property
    def equal_query_lengths(self):
        """Whether every sequence has ``max_seqlen_q`` queries (``total_q`` reaches ``batch · max_seqlen_q`` in
        no other way once no sequence is longer): no query tile of the grid lies past its sequence's rows."""
        return self.total_q == (self.cu_seqlens_q.shape[0] - 1) * self.max_seqlen_q

    @property
    def operands(self):
        return (self.cu_seqlens_q, self.cu_seqlens_k, self.seqused_k, self.page_table)

    argtypes = (_INT32, _INT32, _INT32, types.Array(types.int32, 2, "A"))

    def arrays(self):
        """``(shape, strides, itemsize)`` of the kernels' four int32 arguments (absent ones of shape 1)."""
        return [absent if op is None else (op.shape, op.strides, 4) for op, absent in zip(self.operands, _ABSENT,
                                                                                          strict=True)]

    def host_arrays(self, *arrays):
        """The kernels' four arguments as int32 numpy arrays from the call's (None for absent ones)."""
        return [np.zeros(absent[0], np.int32) if x is None else np.asarray(host_values(x), np.int32)
                for x, absent in zip(arrays, _ABSENT, strict=True)]

    def on_device(self, device):
        """These sequences with contiguous copies of the arrays on GPU ``device`` (host arrays run there)."""
        def moved(op):
            return None if op is None else Operand("numba", op.dtype, op.shape, contiguous_strides(op.shape), device)

        return replace(self, _device_check=None, **{
            name: moved(getattr(self, name)) for name in ("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "page_table")})

    def check_values(self, stream, arrays):
        """Check the values of the call's index arrays ``(cu_seqlens_q, cu_seqlens_k, seqused_k, page_table)``
        (None: absent): ValueError for offsets that do not start at 0, decrease or run past the rows, a
        sequence longer than ``max_seqlen_q`` (or with more keys than ``max_seqlen_k``), key counts out of range, or a used page index outside the page
        array. Host arrays are checked here; device arrays on the GPU, on the raw ``stream`` the call runs on
        (what the check finds is raised by the next checked call on that GPU: ``ops/checks.py``)."""
        if self.cu_seqlens_q.device is not None and not SIMULATOR:
            if self._device_check is None:
                object.__setattr__(self, "_device_check", DeviceVarlenCheck(self.cu_seqlens_q.device, self))
            self._device_check(stream, *map(array_pointer, arrays))
            return
        values = [None if x is None else host_values(x) for x in arrays]
        page_size = max(self.page_size, 1)
        found = first_varlen_problem(*values, self.total_q, self.total_k, self.max_seqlen_q, self.max_seqlen_k,
                                     page_size, self.total_k // page_size)
        if found is not None:
            raise ValueError(varlen_message(*found))


def _max_length(value, name):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not 1 <= value <= 2**31 - 1:
        raise ValueError(f"{name} must be in [1, 2**31 - 1], got {value}")
    return int(value)


def validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, causal, scale, return_lse,
                    window=None, softcap=None, alibi_slopes=None, sinks=None, page_table=None, seqused_k=None):
    """The ``Problem`` of a call of ``attention_varlen`` with these arguments, or the TypeError/ValueError
    that names the bad one."""
    for flag, value in (("causal", causal), ("return_lse", return_lse)):
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{flag} must be a bool, got {type(value).__name__}")
    paged = page_table is not None
    kv_text = "4-D (num_pages, page_size, num_heads_kv, head_dim) with page_table" if paged else (
        "3-D (total_k, num_heads_kv, head_dim)")
    ops = {"q": describe(q, "q"), "k": describe(k, "k"), "v": describe(v, "v")}
    check_float_operand(ops["q"], "q", (3,), "3-D (total_q, num_heads_q, head_dim)")
    for name in ("k", "v"):
        check_float_operand(ops[name], name, (4,) if paged else (3,), kv_text)
    check_one_dtype_and_device(ops, "q, k and v")
    q_op, k_op, v_op = ops.values()
    total_q, heads_q, head_dim = q_op.shape
    *k_rows, heads_kv, head_dim_k = k_op.shape
    *v_rows, heads_v, head_dim_v = v_op.shape
    if head_dim_k != head_dim:
        raise ValueError(f"k head_dim must equal q head_dim {head_dim}, got {head_dim_k}")
    if heads_v != heads_kv:
        raise ValueError(f"k and v must have the same number of heads, got {heads_kv} and {heads_v}")
    if v_rows != k_rows:
        raise ValueError(f"k and v must have the same {'pages' if paged else 'rows'}, got shapes {k_op.shape} and "
                         f"{v_op.shape}")
    if heads_q % heads_kv:
        raise ValueError(f"query heads ({heads_q}) must be a multiple of key/value heads ({heads_kv})")
    for name, d in (("q/k head_dim", head_dim), ("v head_dim", head_dim_v)):
        if d > MAX_HEAD_DIM:
            raise ValueError(f"{name} must be at most {MAX_HEAD_DIM}, got {d}")
    max_seqlen_q, max_seqlen_k = _max_length(max_seqlen_q, "max_seqlen_q"), _max_length(max_seqlen_k, "max_seqlen_k")

    device = q_op.device
    cu_q = describe(cu_seqlens_q, "cu_seqlens_q")
    check_index_operand(cu_q, "cu_seqlens_q", "1-D (batch + 1,)", 1, device)
    batch = cu_q.shape[0] - 1
    if batch < 1:
        raise ValueError(f"cu_seqlens_q must have batch + 1 >= 2 entries, got shape {cu_q.shape}")
    cu_k = table = used = None
    if cu_seqlens_k is not None:
        cu_k = describe(cu_seqlens_k, "cu_seqlens_k")
        check_index_operand(cu_k, "cu_seqlens_k", f"1-D (batch + 1,) = ({batch + 1},)", 1, device)
        if cu_k.shape[0] != batch + 1:
            raise ValueError(f"cu_seqlens_k must have batch + 1 = {batch + 1} entries like cu_seqlens_q, "
                             f"got shape {cu_k.shape}")
    if seqused_k is not None:
        used = describe(seqused_k, "seqused_k")
        check_index_operand(used, "seqused_k", f"1-D (batch,) = ({batch},)", 1, device)
        if used.shape[0] != batch:
            raise ValueError(f"seqused_k must have one entry per sequence ({batch}), got shape {used.shape}")
    if paged:
        table = describe(page_table, "page_table")
        check_index_operand(table, "page_table", f"2-D (batch, max_pages) with batch {batch}", 2, device)
        if table.shape[0] != batch or table.shape[1] == 0:
            raise ValueError(f"page_table must be (batch, max_pages) with batch {batch} and max_pages >= 1, "
                             f"got shape {table.shape}")
        if cu_k is None and used is None:
            raise ValueError("a paged call needs the key counts: seqused_k (or cu_seqlens_k)")
    elif cu_k is None:
        raise ValueError("cu_seqlens_k is required unless the keys are paged (page_table given)")

    lifted = {name: op if len(op.shape) == 4 else replace(op, shape=(1, *op.shape), strides=(0, *op.strides))
              for name, op in ops.items()}
    total_k = k_op.shape[0] * (k_op.shape[1] if paged else 1)
    sequences = Sequences(cu_q, cu_k, used, table, total_q, total_k, max_seqlen_q, max_seqlen_k,
                          k_op.shape[1] if paged else 0)
    options = score_options(window, softcap, alibi_slopes, sinks, causal, batch, heads_q, device)
    problem = Problem(batch, heads_q, heads_kv, max_seqlen_q, max_seqlen_k, head_dim, head_dim_v, q_op.dtype, device,
                      bool(causal), float(softmax_scale(scale, head_dim)), "bshd", bool(return_lse), lifted["q"],
                      lifted["k"], lifted["v"], None, options, sequences)
    if out is not None:
        problem = replace(problem, out=out_operand(out, q_op, problem.out_shape))
    return problem


def attention_varlen(q: Array, k: Array, v: Array, cu_seqlens_q: Array, cu_seqlens_k: Array | None, max_seqlen_q: int,
                     max_seqlen_k: int, *, causal: bool = False, window: tuple | None = None,
                     softcap: float | None = None, alibi_slopes: Array | None = None, sinks: Array | None = None,
                     scale: float | None = None, return_lse: bool = False, out: Array | None = None,
                     page_table: Array | None = None, seqused_k: Array | None = None,
                     check: bool = True) -> Array | tuple[Array, Array]:
    """Attention over a packed batch of sequences of different lengths (flash-attn's varlen), with no padding.

    Sequence ``b``'s queries are rows ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1]`` of ``q``; its keys and
    values rows ``cu_seqlens_k[b] .. cu_seqlens_k[b + 1]`` of ``k`` and ``v`` (the first ``seqused_k[b]``
    of them when given), or with ``page_table`` its first ``seqused_k[b]`` keys in pages. Each sequence is
    attended to as ``numattn.attention`` does: bottom-right aligned ``causal``, ``window``, ``softcap``,
    ``alibi_slopes`` and ``sinks`` with the same meaning, query ``i`` at position ``i + seqlen_k −
    seqlen_q`` of its own sequence. Empty sequences and sequences of one row are allowed; a query that
    sees no key returns 0.

    Parameters
    ----------
    q : array, ``[total_q, num_heads_q, head_dim]``; float16, bfloat16 or float32.
    k, v : arrays, ``[total_k, num_heads_kv, head_dim]`` (``head_dim_v`` for ``v``) packed like ``q``, or
        with ``page_table`` pages ``[num_pages, page_size, num_heads_kv, head_dim]`` (any page size).
        ``num_heads_q`` must be a multiple of ``num_heads_kv`` (GQA, MQA).
    cu_seqlens_q : int32 ``[batch + 1]``
        Cumulative query counts: 0, then each sequence's end, the last ``total_q``.
    cu_seqlens_k : int32 ``[batch + 1]`` or None
        Cumulative key counts; may be None with ``page_table`` and ``seqused_k``.
    max_seqlen_q, max_seqlen_k : int
        The longest sequence's query and key counts (the grid covers ``max_seqlen_q`` rows per sequence, the
        backward's ``max_seqlen_k`` keys).
    causal, window, softcap, alibi_slopes, sinks, scale
        As for ``numattn.attention``; ``alibi_slopes`` ``[num_heads_q]`` or ``[batch, num_heads_q]``.
    return_lse : bool
        Also return the natural-log LSE, float32 ``[num_heads_q, total_q]`` (flash-attn's varlen layout).
    out : array, optional
        Destination ``[total_q, num_heads_q, head_dim_v]`` with q's dtype, on q's device.
    page_table : int32 ``[batch, max_pages]``, optional
        Sequence ``b``'s key ``n`` is row ``n % page_size`` of page ``page_table[b, n // page_size]``.
    seqused_k : int32 ``[batch]``, optional
        Each sequence's key count: with ``page_table`` (else taken from ``cu_seqlens_k``), or at most the
        keys ``cu_seqlens_k`` gives it.
    check : bool
        Check the values of the index arrays: ``ValueError`` for offsets that do not start at 0, decrease,
        or run past the rows (the query offsets must end at ``total_q``), a sequence with more queries than
        ``max_seqlen_q`` or keys than ``max_seqlen_k``, key counts out of range or a page index outside the
        page array. Host arrays are
        checked before the call; device arrays on the GPU without a synchronisation, what the check finds
        being raised by the next checked call on that GPU. Unchecked, bad values are clamped into range:
        the kernels read nothing outside the arrays, but the output is undefined.

    Returns
    -------
    ``o`` ``[total_q, num_heads_q, head_dim_v]`` like ``q``, or ``(o, lse)`` with ``return_lse``.

    Raises
    ------
    TypeError, ValueError
        As ``numattn.attention`` for the float arrays and options; index arrays that are not int32, of
        the wrong shapes or on another device; ``max_seqlen_q`` or ``max_seqlen_k`` not a positive int;
        bad index values (``check``).

    Examples
    --------
    >>> import numpy as np, numattn
    >>> rng = np.random.default_rng(0)
    >>> cu = np.array([0, 3, 3, 8], np.int32)  # three sequences: 3 rows, none, 5 rows
    >>> q = rng.standard_normal((8, 4, 16), dtype=np.float32)
    >>> k = rng.standard_normal((8, 2, 16), dtype=np.float32)
    >>> v = rng.standard_normal((8, 2, 16), dtype=np.float32)
    >>> numattn.attention_varlen(q, k, v, cu, cu, 5, 5, causal=True).shape
    (8, 4, 16)
    """
    if records_grad(q, k, v, sinks):
        raise ValueError("q, k, v or sinks requires grad, and numattn.attention_varlen records no gradients: use "
                         "numattn.torch.attention_varlen for autograd, or call it under torch.no_grad()")
    if check.__class__ is not bool and not isinstance(check, np.bool_):
        raise TypeError(f"check must be a bool, got {type(check).__name__}")
    sequences = (cu_seqlens_q, cu_seqlens_k, seqused_k, page_table)
    options = (window, softcap, alibi_slopes, sinks)
    try:
        key = ("attention_varlen", *map(array_signature, (q, k, v, out, *sequences)), max_seqlen_q.__class__,
               max_seqlen_q, max_seqlen_k.__class__, max_seqlen_k, causal.__class__, causal, scale.__class__, scale,
               return_lse.__class__, return_lse, options_key(*options))
        plan = PLANS.get(key)
    except (AttributeError, TypeError):  # arrays of other libraries, unhashable arguments: planned every call
        key = plan = None
    if plan is None:
        q, k, v, out, alibi_slopes, sinks, *sequences = (
            None if x is None else from_dlpack(x) for x in (q, k, v, out, alibi_slopes, sinks, *sequences))
        problem = validate_varlen(q, k, v, sequences[0], sequences[1], max_seqlen_q, max_seqlen_k, out, causal, scale,
                                  return_lse, window, softcap, alibi_slopes, sinks, sequences[3], sequences[2])
        plan = make_plan(problem)
        if key is not None:
            PLANS.store(key, plan)
    if check:
        plan.problem.sequences.check_values(_stream(q, plan.problem.device), sequences)
    return plan(q, k, v, out, alibi_slopes, sinks, *sequences)


def _stream(q, device):
    """The raw handle of the stream a call on ``q`` runs on (0 for host arrays)."""
    if device is None or SIMULATOR:
        return 0
    if is_torch(q):
        return torch_current()[1](device)
    return cai_stream(q)
