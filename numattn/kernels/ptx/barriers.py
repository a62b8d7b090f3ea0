"""Shared-memory barriers (mbarrier) and named barriers."""

import threading

import numpy as np
from llvmlite import ir
from numba import types
from numba.cuda.extending import intrinsic, overload

from ._core import _asm, _bind, _exchange_lock, _i32, _shared_address
from .copies import land_async_copies

# --------------------------------------------------------------------------
# Shared-memory barriers (mbarrier)
# --------------------------------------------------------------------------
# An mbarrier is a 64-bit word in shared memory that counts arrivals: when
# ``count`` threads have arrived, its current phase completes and the next
# begins. ``mbarrier_try_wait(bars, i, parity)`` tells whether the phase of
# that parity has completed. Producers and consumers of a ring of buffers
# each keep one barrier per buffer and wait for phase ``(use // stages) % 2``.
# The twins keep each barrier's state with the simulated block and block the
# waiting thread on a condition variable.


class _Mbarrier:
    """A phase completes when ``count`` threads have arrived and the transaction count (bytes that
    ``mbarrier_expect_tx`` announced, less those tensor copies delivered) is back at zero."""

    def __init__(self, count):
        self.count = count
        self.pending = count
        self.transactions = 0
        self.phases = 0  # completed phases
        self.changed = threading.Condition()

    def arrive(self):
        with self.changed:
            self.pending -= 1
            self._complete_if_done()

    def expect_transactions(self, nbytes):
        with self.changed:
            self.transactions += nbytes

    def complete_transactions(self, nbytes):
        with self.changed:
            self.transactions -= nbytes
            self._complete_if_done()

    def _complete_if_done(self):
        if self.pending == 0 and self.transactions == 0:
            self.pending = self.count
            self.phases += 1
            self.changed.notify_all()


def _mbarriers():
    manager = threading.current_thread()._manager
    with _exchange_lock:
        return manager.__dict__.setdefault("_numattn_mbarriers", {})


def _mbarrier_key(bars, index):
    return np.asarray(bars).__array_interface__["data"][0], int(index)


def mbarrier_init(bars, index, count):
    """``mbarrier_init(bars, i, count)``: make ``bars[i]`` (shared int64) a barrier of ``count`` arrivals per phase.

    Emits ``mbarrier.init.shared::cta.b64``; one thread initialises, and a block barrier must follow.
    """
    _mbarriers()[_mbarrier_key(bars, index)] = _Mbarrier(int(count))


def mbarrier_arrive(bars, index):
    """``mbarrier_arrive(bars, i)``: this thread arrives at ``bars[i]`` (``mbarrier.arrive.shared::cta.b64``, release)."""
    _mbarriers()[_mbarrier_key(bars, index)].arrive()


def mbarrier_expect_tx(bars, index, nbytes):
    """``mbarrier_expect_tx(bars, i, nbytes)``: the current phase of ``bars[i]`` waits for ``nbytes`` more bytes of
    tensor copies (``tma.tma_load_box``) to land, besides its arrivals; issued before the copies, and before this
    thread's own arrival (``mbarrier.expect_tx.relaxed.cta.shared::cta.b64``)."""
    _mbarriers()[_mbarrier_key(bars, index)].expect_transactions(int(nbytes))


def _complete_transactions(bars, index, nbytes):
    """The twins' delivery of ``nbytes`` of a tensor copy to ``bars[i]`` (the copy engine's, on the GPU)."""
    _mbarriers()[_mbarrier_key(bars, index)].complete_transactions(int(nbytes))


def cp_async_mbarrier_arrive(bars, index):
    """``cp_async_mbarrier_arrive(bars, i)``: arrive at ``bars[i]`` once this thread's earlier ``cp_async_16`` copies land.

    Emits ``cp.async.mbarrier.arrive.noinc.shared::cta.b64``: the arrival is one of the barrier's ``count``.
    """
    land_async_copies(0, uncommitted=True)
    mbarrier_arrive(bars, index)


def mbarrier_try_wait(bars, index, parity):
    """``mbarrier_try_wait(bars, i, parity) -> bool``: whether the phase of ``bars[i]`` with this parity has completed.

    Emits ``mbarrier.try_wait.parity.shared::cta.b64`` (acquire), which may
    suspend the thread for a while before answering; call it in a loop.
    """
    barrier = _mbarriers()[_mbarrier_key(bars, index)]
    with barrier.changed:
        return barrier.changed.wait_for(lambda: barrier.phases % 2 != parity, timeout=0.05)


def _mbarrier_lowering(text, constraints, result, with_value):
    if with_value:

        @intrinsic
        def lowering(typingctx, bars, index, value):
            def codegen(context, builder, sig, args):
                address = _shared_address(context, builder, sig.args[0], args[0], (args[1], sig.args[1]))
                value = context.cast(builder, args[2], sig.args[2], types.uint32)
                out = _asm(builder, text, constraints, result, [address, value], side_effect=True)
                return out if result is _i32 else context.get_dummy_value()

            return_type = types.uint32 if result is _i32 else types.none
            return return_type(bars, index, value), codegen

    else:

        @intrinsic
        def lowering(typingctx, bars, index):
            def codegen(context, builder, sig, args):
                address = _shared_address(context, builder, sig.args[0], args[0], (args[1], sig.args[1]))
                _asm(builder, text, constraints, result, [address], side_effect=True)
                return context.get_dummy_value()

            return types.none(bars, index), codegen

    return lowering


_bind(mbarrier_init, _mbarrier_lowering("mbarrier.init.shared::cta.b64 [$0], $1;", "r,r,~{memory}", ir.VoidType(), True))
_bind(
    mbarrier_arrive,
    _mbarrier_lowering("{ .reg .b64 state; mbarrier.arrive.shared::cta.b64 state, [$0]; }", "r,~{memory}", ir.VoidType(), False),
)
_bind(
    mbarrier_expect_tx,
    _mbarrier_lowering("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [$0], $1;", "r,r,~{memory}", ir.VoidType(), True),
)
_bind(
    cp_async_mbarrier_arrive,
    _mbarrier_lowering("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [$0];", "r,~{memory}", ir.VoidType(), False),
)
_try_wait = _mbarrier_lowering(
    "{ .reg .pred done; mbarrier.try_wait.parity.shared::cta.b64 done, [$1], $2; selp.u32 $0, 1, 0, done; }",
    "=r,r,r,~{memory}",
    _i32,
    True,
)


@overload(mbarrier_try_wait, target="cuda")
def _mbarrier_try_wait_gpu(bars, index, parity):
    def impl(bars, index, parity):
        return _try_wait(bars, index, parity) != 0

    return impl


def mbarrier_wait(bars, index, parity):
    """``mbarrier_wait(bars, i, parity)``: wait until the phase of ``bars[i]`` with this parity (its low bit)
    has completed (``mbarrier_try_wait`` in a loop)."""
    while not mbarrier_try_wait(bars, index, parity % 2):
        pass


@overload(mbarrier_wait, target="cuda")
def _mbarrier_wait_gpu(bars, index, parity):
    def impl(bars, index, parity):
        while _try_wait(bars, index, parity % 2) == 0:  # the low bit, stated: ptxas then keeps a register less
            pass

    return impl


# --------------------------------------------------------------------------
# Named barriers
# --------------------------------------------------------------------------
# Barrier ``id`` (1–15; 0 is the block-wide barrier of syncthreads) completes
# when ``count`` threads (a multiple of 32) have reached it, whether they wait
# (``barrier_sync``) or only signal (``barrier_arrive``).


class _NamedBarrier:
    def __init__(self):
        self.arrived = 0
        self.generation = 0
        self.changed = threading.Condition()

    def arrive(self, count, wait):
        with self.changed:
            generation = self.generation
            self.arrived += 1
            if self.arrived == count:
                self.arrived = 0
                self.generation += 1
                self.changed.notify_all()
            elif wait:
                self.changed.wait_for(lambda: self.generation != generation)


def _named_barrier(key):
    manager = threading.current_thread()._manager
    with _exchange_lock:
        return manager.__dict__.setdefault("_numattn_named_barriers", {}).setdefault(key, _NamedBarrier())


def barrier_sync(barrier_id, count):
    """``barrier_sync(id, count)``: wait at named barrier ``id`` until ``count`` threads have reached it (``bar.sync``)."""
    _named_barrier(int(barrier_id)).arrive(int(count), wait=True)


def barrier_arrive(barrier_id, count):
    """``barrier_arrive(id, count)``: reach named barrier ``id`` without waiting (``bar.arrive``)."""
    _named_barrier(int(barrier_id)).arrive(int(count), wait=False)


def _named_barrier_lowering(instruction):
    @intrinsic
    def lowering(typingctx, barrier_id, count):
        def codegen(context, builder, sig, args):
            operands = [context.cast(builder, v, t, types.uint32) for v, t in zip(args, sig.args, strict=True)]
            _asm(builder, f"{instruction} $0, $1;", "r,r,~{memory}", ir.VoidType(), operands, side_effect=True)
            return context.get_dummy_value()

        return types.none(barrier_id, count), codegen

    return lowering


_bind(barrier_sync, _named_barrier_lowering("bar.sync"))
_bind(barrier_arrive, _named_barrier_lowering("bar.arrive"))
