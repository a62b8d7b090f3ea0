"""Shared machinery of the primitives: inline-PTX and IR intrinsics, binding a simulator twin to its
GPU lowering, addresses of array elements, and the simulator's per-warp exchange."""

import threading

import numpy as np
from llvmlite import ir
from numba import types
from numba.cuda import cgutils
from numba.cuda.extending import intrinsic, overload
from numba.cuda.np.arrayobj import make_array

_f32 = ir.FloatType()
_i16 = ir.IntType(16)
_i32 = ir.IntType(32)
_i64 = ir.IntType(64)
WARP_SIZE = 32


def _bind(twin, lowering):
    """Make the intrinsic ``lowering`` the GPU implementation of ``twin``, through an overload whose wrapper
    calls it. Binding the intrinsic as ``twin``'s typing directly compiles about a third fewer functions,
    but changes the code NVVM hands ptxas under link-time optimisation: the bf16 D128 backward wgmma kernel
    spilled 192 bytes instead of 88 and ran 20% slower (H200), so the wrapper stays."""

    @overload(twin, target="cuda")
    def _gpu(*args):
        def impl(*args):
            return lowering(*args)

        return impl


def _asm(builder, text, constraints, result, operands, side_effect=False):
    """Emit inline PTX; ``result`` is the LLVM result type, ``operands`` the LLVM values."""
    fnty = ir.FunctionType(result, [op.type for op in operands])
    return builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=side_effect), operands)


def _asm_intrinsic(text, constraints, result, signature):
    """An intrinsic of one or two arguments whose whole body is one inline-PTX instruction."""

    def codegen(context, builder, sig, args):
        return _asm(builder, text, constraints, result, args)

    if len(signature.args) == 1:

        @intrinsic
        def lowering(typingctx, x):
            return signature, codegen

    else:

        @intrinsic
        def lowering(typingctx, x, y):
            return signature, codegen

    return lowering


def _ir_intrinsic(build, signature):
    """A one-argument intrinsic whose body is ``build(builder, value)`` in LLVM IR."""

    @intrinsic
    def lowering(typingctx, x):
        def codegen(context, builder, sig, args):
            return build(builder, args[0])

        return signature, codegen

    return lowering


def _literal_int(numba_type):
    """The value of an integer or boolean literal type, None for any other type."""
    return int(numba_type.literal_value) if isinstance(numba_type, types.Literal) else None


def _statement_intrinsic(text):
    """A no-argument intrinsic emitting one PTX statement, ordered with memory accesses."""

    @intrinsic
    def lowering(typingctx):
        def codegen(context, builder, sig, args):
            _asm(builder, text, "~{memory}", ir.VoidType(), [], side_effect=True)
            return context.get_dummy_value()

        return types.none(), codegen

    return lowering


def _bind_constant_statement(twin, mnemonic):
    """Make ``twin(N)`` emit ``mnemonic N;`` on the GPU (a wait for groups of asynchronous operations, a
    register count); ``N`` must be a compile-time constant."""

    @intrinsic
    def lowering(typingctx, pending):
        if not isinstance(pending, types.IntegerLiteral):
            return None
        text = f"{mnemonic} {pending.literal_value};"

        def codegen(context, builder, sig, args):
            _asm(builder, text, "~{memory}", ir.VoidType(), [], side_effect=True)
            return context.get_dummy_value()

        return types.none(pending), codegen

    @overload(twin, target="cuda", prefer_literal=True, inline="always")
    def _gpu(pending):
        PENDING = _literal_int(pending)
        if PENDING is None:
            return None

        def impl(pending):
            return lowering(PENDING)

        return impl


def _global_address(context, builder, array_type, array, index_type, index, contiguous_last=False):
    """64-bit address of ``array[index]`` (``index`` a tuple with one integer per axis).

    ``contiguous_last``: the last axis is contiguous (the caller's contract), so the last index is
    scaled by the constant item size; constant column offsets then fold into the address operand.
    """
    values = cgutils.unpack_tuple(builder, index, len(index_type))
    indices = [context.cast(builder, v, t, types.intp) for v, t in zip(values, index_type, strict=True)]
    aryty = make_array(array_type)(context, builder, array)
    if not contiguous_last:
        return builder.ptrtoint(cgutils.get_item_pointer(context, builder, array_type, aryty, indices), _i64)
    row = cgutils.get_item_pointer(context, builder, array_type, aryty, indices[:-1] + [indices[-1].type(0)])
    return builder.ptrtoint(builder.gep(row, [indices[-1]]), _i64)


def _unpack_struct(context, builder, sig, value, count):
    """An inline-asm struct result as the numba tuple ``sig.return_type``."""
    return context.make_tuple(builder, sig.return_type, [builder.extract_value(value, i) for i in range(count)])


def _shared_address(context, builder, tile_type, tile, *index):
    """32-bit shared-state-space address of ``tile[index]`` (``tile`` in shared memory).

    ``index`` holds one ``(value, numba type)`` pair per axis.
    """
    array = make_array(tile_type)(context, builder, tile)
    indices = [context.cast(builder, v, t, types.intp) for v, t in index]
    ptr = cgutils.get_item_pointer(context, builder, tile_type, array, indices)
    shared = builder.addrspacecast(ptr, ir.PointerType(ptr.type.pointee, addrspace=3))
    return builder.ptrtoint(shared, _i32)


# --------------------------------------------------------------------------
# Simulator warp exchange
# --------------------------------------------------------------------------

_exchange_lock = threading.Lock()


class _WarpExchange:
    """Slots where a warp's lanes meet. Two generations alternate, so that one
    wait per exchange suffices: a lane can refill a generation's slots only
    after every lane has arrived at the next exchange, hence read these."""

    def __init__(self, lanes):
        self.lanes = lanes
        self.slots = ([None] * WARP_SIZE, [None] * WARP_SIZE)
        self.results = [None, None]
        self.arrived = [0, 0]
        self.lock = threading.Lock()
        # one event per lane and generation: the last lane to arrive wakes each of the others
        self.wake = tuple([threading.Event() for _ in range(WARP_SIZE)] for _ in range(2))
        self.generation = [0] * WARP_SIZE


def _lane():
    return threading.current_thread().thread_id % WARP_SIZE


def _warp_gather(value, combine=list):
    """Simulator: every lane of the caller's warp contributes ``value``; all get ``combine(values)``.

    ``values`` lists the lanes' contributions in lane order; ``combine`` runs
    once per exchange, in the last lane to arrive.
    """
    thread = threading.current_thread()
    manager = thread._manager  # the simulator's per-block manager
    warp, lane = divmod(thread.thread_id, WARP_SIZE)
    with _exchange_lock:
        warps = manager.__dict__.setdefault("_numattn_warps", {})
        if warp not in warps:
            block_threads = int(np.prod(manager._block_dim))
            warps[warp] = _WarpExchange(min(WARP_SIZE, block_threads - warp * WARP_SIZE))
        exchange = warps[warp]
    gen = exchange.generation[lane]
    exchange.generation[lane] = 1 - gen
    exchange.slots[gen][lane] = value
    with exchange.lock:
        exchange.arrived[gen] += 1
        last = exchange.arrived[gen] == exchange.lanes
        if last:
            exchange.arrived[gen] = 0
    if last:
        exchange.results[gen] = combine(exchange.slots[gen][: exchange.lanes])
        for other, event in enumerate(exchange.wake[gen]):
            if other != lane:
                event.set()
    else:
        exchange.wake[gen][lane].wait()
        exchange.wake[gen][lane].clear()
    return exchange.results[gen]
