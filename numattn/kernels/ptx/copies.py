"""Memory movement: asynchronous global-to-shared copies, read-only and L2 global loads, bulk
reductions into global memory (sm_90), shared-memory stores and 16-byte shared-to-global copies."""

import collections
import threading

import numpy as np
from llvmlite import ir
from numba import types
from numba.cuda.extending import intrinsic

from ._core import (
    _asm,
    _bind,
    _bind_constant_statement,
    _f32,
    _global_address,
    _i32,
    _i64,
    _ir_intrinsic,
    _shared_address,
    _statement_intrinsic,
    _unpack_struct,
)

# --------------------------------------------------------------------------
# Asynchronous global-to-shared copies
# --------------------------------------------------------------------------
# The twins land a thread's copies as late as the GPU may: when that thread waits for their group
# (``cp_async_wait_group``) or arrives at an mbarrier behind them (``cp_async_mbarrier_arrive``), so that
# reading a tile before every copying thread has waited for its copies (and met the reader at a barrier)
# reads stale data in the simulator as it may on the GPU.

_async_copies = threading.local()  # of each simulated thread: its open group and its committed groups


def _copy_groups():
    state = _async_copies
    if not hasattr(state, "open"):
        state.open, state.committed = [], collections.deque()
    return state


def land_async_copies(pending, uncommitted=False):
    """Land the calling thread's copies: every committed group but the ``pending`` last ones, and with
    ``uncommitted`` the copies of its open group too (the twins' completion of ``cp.async``)."""
    state = _copy_groups()
    while len(state.committed) > pending:
        for copy in state.committed.popleft():
            copy()
    if uncommitted:
        for copy in state.open:
            copy()
        state.open = []


def cp_async_16(dst, row, col, src, index, nbytes):
    """``cp_async_16(dst, row, col, src, index, nbytes)``: copy 16 bytes from ``src[index]`` to ``dst[row, col]``.

    ``dst`` is a 2-D shared array, ``src`` a global array whose last axis is
    contiguous, both 16-byte aligned at these elements; ``index`` a tuple of
    ``src.ndim`` ints. Only the first ``nbytes`` bytes (0 to 16, whole
    elements) are read, the rest of the 16 are zero-filled. Emits
    ``cp.async.cg.shared.global`` with ``nbytes`` as its source size; the copy
    completes at ``cp_async_wait_group``. The twin's copy lands there too (``land_async_copies``).
    """
    cp_async_16_at(dst, row, col, global_address(src, index), nbytes)


def _cp_async_asm(builder, shared, ptr, size):
    _asm(builder, "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r,~{memory}", ir.VoidType(),
         [shared, ptr, size], side_effect=True)


@intrinsic
def _cp_async_16(typingctx, dst, row, col, src, index, nbytes):
    if not (isinstance(dst, types.Array) and isinstance(src, types.Array) and isinstance(index, types.BaseTuple)):
        return None

    def codegen(context, builder, sig, args):
        dst_type, row_type, col_type, src_type, index_type, nbytes_type = sig.args
        shared = _shared_address(context, builder, dst_type, args[0], (args[1], row_type), (args[2], col_type))
        ptr = _global_address(context, builder, src_type, args[3], index_type, args[4], contiguous_last=True)
        size = context.cast(builder, args[5], nbytes_type, types.int32)
        _cp_async_asm(builder, shared, ptr, size)
        return context.get_dummy_value()

    return types.none(dst, row, col, src, index, nbytes), codegen


_bind(cp_async_16, _cp_async_16)


def cp_async_4(dst, row, col, src, index):
    """``cp_async_4(dst, row, col, src, index)``: copy the 4-byte element ``src[index]`` (any strides) to
    ``dst[row, col]`` of a 2-D shared array of a 4-byte dtype, without holding a register for it.

    Emits ``cp.async.ca.shared.global`` of 4 bytes: a small dependent value (a page index) fetched
    well ahead of its use, completing with its commit group (the twin's copy too).
    """

    def land():
        dst[row, col] = src[index]

    _copy_groups().open.append(land)


@intrinsic
def _cp_async_4(typingctx, dst, row, col, src, index):
    if not (isinstance(dst, types.Array) and isinstance(src, types.Array) and isinstance(index, types.BaseTuple)):
        return None

    def codegen(context, builder, sig, args):
        dst_type, row_type, col_type, src_type, index_type = sig.args
        shared = _shared_address(context, builder, dst_type, args[0], (args[1], row_type), (args[2], col_type))
        ptr = _global_address(context, builder, src_type, args[3], index_type, args[4])
        _asm(builder, "cp.async.ca.shared.global [$0], [$1], 4;", "r,l,~{memory}", ir.VoidType(), [shared, ptr],
             side_effect=True)
        return context.get_dummy_value()

    return types.none(dst, row, col, src, index), codegen


_bind(cp_async_4, _cp_async_4)


class _Address:
    """Twin of a global address: element ``index`` of ``array``; adding ``n`` moves it ``n`` bytes on in
    memory, as adding to the real address does (along any axis: the element found there is ``index``)."""

    def __init__(self, array, index):
        self.array, self.index = array, tuple(int(i) for i in index)

    def __add__(self, nbytes):
        # the byte offset from element 0, unravelled by the strides from the largest (arrays that do not
        # overlap themselves, with positive strides; axes of one element take no part)
        strides, shape = self.array.strides, self.array.shape
        rest = sum(i * stride for i, stride in zip(self.index, strides, strict=True)) + int(nbytes)
        index = [0] * self.array.ndim
        for axis in sorted((axis for axis in range(self.array.ndim) if shape[axis] > 1), key=lambda a: -strides[a]):
            index[axis], rest = divmod(rest, strides[axis])
        assert rest == 0, "an address moves by whole elements"
        return _Address(self.array, index)

    __radd__ = __add__


def global_address(src, index):
    """``global_address(src, index) -> int64``: the address of ``src[index]`` in a global array whose last
    axis is contiguous, for ``cp_async_16_at``.

    The compiler cannot see through it (an inline-assembly move), so it keeps
    the address in one register and folds the constants added to it into each
    copy's address operand, rather than precomputing every copy's offset.
    """
    return _Address(src, index)


@intrinsic
def _global_address_ir(typingctx, src, index):
    if not (isinstance(src, types.Array) and isinstance(index, types.BaseTuple)):
        return None

    def codegen(context, builder, sig, args):
        ptr = _global_address(context, builder, sig.args[0], args[0], sig.args[1], args[1], contiguous_last=True)
        return _asm(builder, "mov.b64 $0, $1;", "=l,l", _i64, [ptr])

    return types.int64(src, index), codegen


_bind(global_address, _global_address_ir)


def cp_async_16_at(dst, row, col, address, nbytes):
    """``cp_async_16_at(dst, row, col, address, nbytes)``: ``cp_async_16`` from the global ``address``
    (``global_address`` plus a byte offset) to ``dst[row, col]``."""
    count = 16 // dst.itemsize
    src, index = address.array, address.index

    def land():
        for i in range(count):
            dst[row, col + i] = src[(*index[:-1], index[-1] + i)] if i * dst.itemsize < nbytes else 0

    _copy_groups().open.append(land)


@intrinsic
def _cp_async_16_at(typingctx, dst, row, col, address, nbytes):
    if not (isinstance(dst, types.Array) and isinstance(address, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        dst_type, row_type, col_type, address_type, nbytes_type = sig.args
        shared = _shared_address(context, builder, dst_type, args[0], (args[1], row_type), (args[2], col_type))
        ptr = context.cast(builder, args[3], address_type, types.int64)
        size = context.cast(builder, args[4], nbytes_type, types.int32)
        _cp_async_asm(builder, shared, ptr, size)
        return context.get_dummy_value()

    return types.none(dst, row, col, address, nbytes), codegen


_bind(cp_async_16_at, _cp_async_16_at)


def st_global_b32_at(address, value):
    """``st_global_b32_at(address, value)``: store the 32-bit ``value`` at the global ``address``
    (``global_address`` of a 16-bit array plus a byte offset, 4-byte aligned), two elements with the
    first in the low half (as ``pack_*x2`` makes them). Emits ``st.global.b32``: an output row written
    from registers at constant offsets from one address."""
    array, index = address.array, address.index
    array[index] = value & 0xFFFF
    array[(*index[:-1], index[-1] + 1)] = value >> 16


@intrinsic
def _st_global_b32_at(typingctx, address, value):
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        ptr = context.cast(builder, args[0], sig.args[0], types.int64)
        word = context.cast(builder, args[1], sig.args[1], types.uint32)
        _asm(builder, "st.global.b32 [$0], $1;", "l,r,~{memory}", ir.VoidType(), [ptr, word], side_effect=True)
        return context.get_dummy_value()

    return types.none(address, value), codegen


_bind(st_global_b32_at, _st_global_b32_at)


def cp_async_commit():
    """``cp_async_commit()``: close the group of ``cp_async_16`` (and ``cp_async_4``) copies issued so far
    (``cp.async.commit_group``)."""
    state = _copy_groups()
    state.committed.append(state.open)
    state.open = []


_bind(cp_async_commit, _statement_intrinsic("cp.async.commit_group;"))


def cp_async_wait_group(pending):
    """``cp_async_wait_group(N)``: wait until at most ``N`` (a constant) committed groups are still in flight.

    Emits ``cp.async.wait_group N``. Follow it with a barrier before reading
    what other threads copied.
    """
    land_async_copies(int(pending))


_bind_constant_statement(cp_async_wait_group, "cp.async.wait_group")


# --------------------------------------------------------------------------
# 16-byte read-only global loads (memory-bound kernels)
# --------------------------------------------------------------------------


def load_16(src, index):
    """``load_16(src, index) -> (w0, w1, w2, w3)``: the 16 bytes at ``src[index]`` as four ``uint32``.

    ``src`` is a global array whose last axis is contiguous, 16-byte aligned
    at ``index`` (a tuple of ``src.ndim`` ints), and not written while the
    kernel runs. Emits ``ld.global.nc.v4.u32``; word ``i`` holds bytes
    ``4i .. 4i + 3`` (so two 16-bit elements, the lower-addressed in its low half).
    """
    count = 16 // src.itemsize
    chunk = np.ascontiguousarray([src[(*index[:-1], index[-1] + i)] for i in range(count)], dtype=src.dtype)
    words = chunk.view(np.uint32)
    return np.uint32(words[0]), np.uint32(words[1]), np.uint32(words[2]), np.uint32(words[3])


@intrinsic
def _load_16(typingctx, src, index):
    if not (isinstance(src, types.Array) and isinstance(index, types.BaseTuple)):
        return None
    result = types.UniTuple(types.uint32, 4)

    def codegen(context, builder, sig, args):
        src_type, index_type = sig.args
        ptr = _global_address(context, builder, src_type, args[0], index_type, args[1], contiguous_last=True)
        words = _asm(
            builder,
            "ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];",
            "=r,=r,=r,=r,l",
            ir.LiteralStructType([_i32] * 4),
            [ptr],
        )
        return _unpack_struct(context, builder, sig, words, 4)

    return result(src, index), codegen


_bind(load_16, _load_16)


def store_16(dst, index, w0, w1, w2, w3):
    """``store_16(dst, index, w0, w1, w2, w3)``: the four ``uint32`` words as the 16 bytes at ``dst[index]``
    on, word ``i`` as bytes ``4i .. 4i + 3`` (``load_16``'s order). ``dst`` is a global array whose last
    axis is contiguous, 16-byte aligned at ``index``. Emits ``st.global.v4.b32``."""
    elements = np.array([w0, w1, w2, w3], dtype=np.uint32).view(dst.dtype)
    for i, element in enumerate(elements):
        dst[(*index[:-1], index[-1] + i)] = element


@intrinsic
def _store_16(typingctx, dst, index, w0, w1, w2, w3):
    if not (isinstance(dst, types.Array) and isinstance(index, types.BaseTuple)):
        return None

    def codegen(context, builder, sig, args):
        dst_type, index_type = sig.args[:2]
        ptr = _global_address(context, builder, dst_type, args[0], index_type, args[1], contiguous_last=True)
        words = [context.cast(builder, v, t, types.uint32) for v, t in zip(args[2:], sig.args[2:], strict=True)]
        _asm(builder, "st.global.v4.b32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r,~{memory}", ir.VoidType(),
             [ptr, *words], side_effect=True)
        return context.get_dummy_value()

    return types.none(dst, index, w0, w1, w2, w3), codegen


_bind(store_16, _store_16)


def load_readonly_i32(src, index):
    """``load_readonly_i32(src, index) -> int32``: ``src[index]`` of a global int32 array (any strides) that
    the kernel never writes, such as a page table. Emits ``ld.global.nc.s32`` as an instruction without
    side effects, so that the compiler may issue it ahead of the copies before it (an ordinary load stays
    behind every ``cp.async``, whose memory clobber orders it)."""
    return np.int32(src[index])


@intrinsic
def _load_readonly_i32(typingctx, src, index):
    if not (isinstance(src, types.Array) and src.dtype == types.int32 and isinstance(index, types.BaseTuple)):
        return None

    def codegen(context, builder, sig, args):
        src_type, index_type = sig.args
        ptr = _global_address(context, builder, src_type, args[0], index_type, args[1])
        return _asm(builder, "ld.global.nc.s32 $0, [$1];", "=r,l", _i32, [ptr])

    return types.int32(src, index), codegen


_bind(load_readonly_i32, _load_readonly_i32)


def load_l2_f32(src, index):
    """``load_l2_f32(src, index) -> float32``: ``src[index]`` of a global float32 array, read through L2
    only (``ld.global.cg.f32``): for data that other blocks of the running kernel wrote, which an
    SM's L1 may hold stale lines of (a neighbour's earlier read of the same 128-byte line)."""
    return np.float32(src[index])


@intrinsic
def _load_l2_f32(typingctx, src, index):
    if not (isinstance(src, types.Array) and src.dtype == types.float32 and isinstance(index, types.BaseTuple)):
        return None

    def codegen(context, builder, sig, args):
        src_type, index_type = sig.args
        ptr = _global_address(context, builder, src_type, args[0], index_type, args[1])
        # a side effect keeps the load after the fences and barriers that order it behind other blocks'
        # writes (a pure inline asm could be hoisted above them)
        return _asm(builder, "ld.global.cg.f32 $0, [$1];", "=f,l", _f32, [ptr], side_effect=True)

    return types.float32(src, index), codegen


_bind(load_l2_f32, _load_l2_f32)


def load_l2_f32x4(src, index):
    """``load_l2_f32x4(src, index) -> (f0, f1, f2, f3)``: ``src[index]`` and the next three elements of its
    contiguous last axis, 16-byte aligned, read through L2 only (``ld.global.cg.v4.f32``; see
    ``load_l2_f32``)."""
    i = index[-1]
    return tuple(np.float32(src[(*index[:-1], i + k)]) for k in range(4))


@intrinsic
def _load_l2_f32x4(typingctx, src, index):
    if not (isinstance(src, types.Array) and src.dtype == types.float32 and isinstance(index, types.BaseTuple)):
        return None
    result = types.UniTuple(types.float32, 4)

    def codegen(context, builder, sig, args):
        src_type, index_type = sig.args
        ptr = _global_address(context, builder, src_type, args[0], index_type, args[1], contiguous_last=True)
        values = _asm(builder, "ld.global.cg.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,l",
                      ir.LiteralStructType([_f32] * 4), [ptr], side_effect=True)
        return _unpack_struct(context, builder, sig, values, 4)

    return result(src, index), codegen


_bind(load_l2_f32x4, _load_l2_f32x4)


def f32_from_bits(bits):
    """``f32_from_bits(bits) -> float32``: the fp32 value with bit pattern ``bits`` (a ``uint32``)."""
    return np.uint32(bits).view(np.float32)


_bind(f32_from_bits, _ir_intrinsic(lambda builder, x: builder.bitcast(x, _f32), types.float32(types.uint32)))


# --------------------------------------------------------------------------
# Bulk asynchronous reductions from shared into global memory (sm_90)
# --------------------------------------------------------------------------

_reduction_lock = threading.Lock()


def bulk_reduce_add_f32(dst, index, src, offset, nbytes):
    """``bulk_reduce_add_f32(dst, index, src, offset, nbytes)``: add ``nbytes`` bytes of float32 elements,
    contiguous in shared ``src`` from element ``offset`` on, to the elements of ``dst`` from ``index`` on.

    ``dst`` is a global float32 array whose last axis is contiguous and holds the range, ``index`` a
    tuple of ``dst.ndim`` ints; ``src`` a 1-D shared float32 array; both
    16-byte aligned there, ``nbytes`` a multiple of 16. One thread issues it:
    ``cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32``, which reads
    ``src`` asynchronously (publish it with ``fence_proxy_async()`` and a barrier
    first; ``bulk_commit()`` and ``bulk_wait_read(0)`` before writing it again)
    and adds in L2 without a round trip per element. The twin adds at once, under a lock.
    """
    row = np.asarray(getattr(dst, "_ary", dst))[tuple(index[:-1])]  # a view, whatever the other axes' strides
    first, count = int(index[-1]), int(nbytes) // 4
    with _reduction_lock:
        row[first : first + count] += src[offset : offset + count]


@intrinsic
def _bulk_reduce_add_f32(typingctx, dst, index, src, offset, nbytes):
    if not (isinstance(dst, types.Array) and dst.dtype == types.float32 and isinstance(index, types.BaseTuple)):
        return None

    def codegen(context, builder, sig, args):
        dst_type, index_type, src_type, offset_type, nbytes_type = sig.args
        ptr = _global_address(context, builder, dst_type, args[0], index_type, args[1], contiguous_last=True)
        shared = _shared_address(context, builder, src_type, args[2], (args[3], offset_type))
        size = context.cast(builder, args[4], nbytes_type, types.int32)
        _asm(builder, "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;",
             "l,r,r,~{memory}", ir.VoidType(), [ptr, shared, size], side_effect=True)
        return context.get_dummy_value()

    return types.none(dst, index, src, offset, nbytes), codegen


_bind(bulk_reduce_add_f32, _bulk_reduce_add_f32)


def bulk_commit():
    """``bulk_commit()``: close the group of bulk operations this thread issued (``cp.async.bulk.commit_group``)."""


_bind(bulk_commit, _statement_intrinsic("cp.async.bulk.commit_group;"))


def bulk_wait_read(pending):
    """``bulk_wait_read(N)``: wait until at most ``N`` (a constant) of this thread's committed bulk groups
    may still read their shared-memory sources (``cp.async.bulk.wait_group.read N``)."""


_bind_constant_statement(bulk_wait_read, "cp.async.bulk.wait_group.read")


def bulk_wait(pending):
    """``bulk_wait(N)``: wait until at most ``N`` (a constant) of this thread's committed bulk groups are
    incomplete (``cp.async.bulk.wait_group N``): their writes are then done."""


_bind_constant_statement(bulk_wait, "cp.async.bulk.wait_group")


# --------------------------------------------------------------------------
# Shared-memory stores and 16-byte shared-to-global copies (output epilogues)
# --------------------------------------------------------------------------


def st_shared_b32(dst, row, col, value):
    """``st_shared_b32(dst, row, col, value)``: store the 32-bit ``value`` over ``dst[row, col : col + 2]``.

    ``dst`` is a 2-D shared array of 16-bit elements, 4-byte aligned there;
    ``value`` holds element ``col`` in its low half (as ``pack_*x2`` makes it).
    """
    dst[row, col] = value & 0xFFFF
    dst[row, col + 1] = value >> 16


@intrinsic
def _st_shared_b32(typingctx, dst, row, col, value):
    if not isinstance(dst, types.Array):
        return None

    def codegen(context, builder, sig, args):
        shared = _shared_address(context, builder, sig.args[0], args[0], (args[1], sig.args[1]), (args[2], sig.args[2]))
        word = context.cast(builder, args[3], sig.args[3], types.uint32)
        _asm(builder, "st.shared.b32 [$0], $1;", "r,r,~{memory}", ir.VoidType(), [shared, word], side_effect=True)
        return context.get_dummy_value()

    return types.none(dst, row, col, value), codegen


_bind(st_shared_b32, _st_shared_b32)


def st_shared_v2_f32(dst, row, col, a, b):
    """``st_shared_v2_f32(dst, row, col, a, b)``: store float32 ``a``, ``b`` over ``dst[row, col : col + 2]``.

    ``dst`` is a 2-D shared float32 array, 8-byte aligned there. Emits ``st.shared.v2.f32``.
    """
    dst[row, col] = a
    dst[row, col + 1] = b


@intrinsic
def _st_shared_v2_f32(typingctx, dst, row, col, a, b):
    if not (isinstance(dst, types.Array) and dst.dtype == types.float32):
        return None

    def codegen(context, builder, sig, args):
        shared = _shared_address(context, builder, sig.args[0], args[0], (args[1], sig.args[1]), (args[2], sig.args[2]))
        pair = [context.cast(builder, v, t, types.float32) for v, t in zip(args[3:], sig.args[3:], strict=True)]
        _asm(builder, "st.shared.v2.f32 [$0], {$1, $2};", "r,f,f,~{memory}", ir.VoidType(), [shared, *pair],
             side_effect=True)
        return context.get_dummy_value()

    return types.none(dst, row, col, a, b), codegen


_bind(st_shared_v2_f32, _st_shared_v2_f32)


def ld_shared_v2_f32(src, row, col):
    """``ld_shared_v2_f32(src, row, col) -> (a, b)``: float32 ``src[row, col]`` and ``src[row, col + 1]``.

    ``src`` is a 2-D shared float32 array, 8-byte aligned there. Emits ``ld.shared.v2.f32`` at a 32-bit
    shared address, so that loads at constant offsets from one another share its arithmetic.
    """
    return np.float32(src[row, col]), np.float32(src[row, col + 1])


@intrinsic
def _ld_shared_v2_f32(typingctx, src, row, col):
    if not (isinstance(src, types.Array) and src.dtype == types.float32):
        return None

    def codegen(context, builder, sig, args):
        shared = _shared_address(context, builder, sig.args[0], args[0], (args[1], sig.args[1]), (args[2], sig.args[2]))
        # a side effect and the memory clobber keep the load after the barrier or wait that orders it behind
        # the writes (asynchronous copies among them)
        pair = _asm(builder, "ld.shared.v2.f32 {$0, $1}, [$2];", "=f,=f,r,~{memory}",
                    ir.LiteralStructType([_f32, _f32]), [shared], side_effect=True)
        return _unpack_struct(context, builder, sig, pair, 2)

    return types.UniTuple(types.float32, 2)(src, row, col), codegen


_bind(ld_shared_v2_f32, _ld_shared_v2_f32)


def copy_16_to_global(dst, index, src, row, col):
    """``copy_16_to_global(dst, index, src, row, col)``: copy 16 bytes from shared ``src[row, col]`` to global ``dst[index]``.

    ``src`` is a 2-D shared array, ``dst`` a global array whose last axis is
    contiguous, both 16-byte aligned at these elements; ``index`` a tuple of
    ``dst.ndim`` ints. Emits ``ld.shared.v4.b32`` and ``st.global.v4.b32``.
    """
    for i in range(16 // src.itemsize):
        dst[(*index[:-1], index[-1] + i)] = src[row, col + i]


@intrinsic
def _copy_16_to_global(typingctx, dst, index, src, row, col):
    if not (isinstance(dst, types.Array) and isinstance(src, types.Array) and isinstance(index, types.BaseTuple)):
        return None

    def codegen(context, builder, sig, args):
        dst_type, index_type, src_type, row_type, col_type = sig.args
        shared = _shared_address(context, builder, src_type, args[2], (args[3], row_type), (args[4], col_type))
        ptr = _global_address(context, builder, dst_type, args[0], index_type, args[1], contiguous_last=True)
        _asm(
            builder,
            "{ .reg .b32 w<4>; ld.shared.v4.b32 {w0, w1, w2, w3}, [$0]; st.global.v4.b32 [$1], {w0, w1, w2, w3}; }",
            "r,l,~{memory}",
            ir.VoidType(),
            [shared, ptr],
            side_effect=True,
        )
        return context.get_dummy_value()

    return types.none(dst, index, src, row, col), codegen


_bind(copy_16_to_global, _copy_16_to_global)
