"""Warpgroup matrix multiply-accumulate (sm_90 ``wgmma``), its fences, and register and alignment helpers."""

import threading

import numpy as np
from llvmlite import ir
from numba import types
from numba.cuda.extending import intrinsic, overload
from numba.cuda.np.arrayobj import make_array

from ._core import (
    WARP_SIZE,
    _asm,
    _bind,
    _bind_constant_statement,
    _f32,
    _i32,
    _i64,
    _literal_int,
    _shared_address,
    _statement_intrinsic,
    _warp_gather,
)
from .barriers import _named_barrier
from .mma import _a_matrix, _widen_bf16_bits, _widen_f16_bits

# --------------------------------------------------------------------------
# Warpgroup matrix multiply-accumulate (sm_90 wgmma)
# --------------------------------------------------------------------------
# A warpgroup (four consecutive, aligned warps: 128 threads) computes
# D (64×N) = A (64×16) · B (16×N) [+ D] asynchronously. Operands in shared
# memory use the 128-byte-swizzled layout that wgmma's matrix descriptors name
# "SW128": a tile is stored in panels of 64 columns; within a panel row r takes
# the 128 bytes at 128·r and its 16-byte chunk c (columns 8c .. 8c + 7) sits at
# chunk position c ^ (r % 8). Tiles start 1024-byte aligned, since the
# hardware swizzles address bits. An operand is named by the element offset
# of its first element before swizzling:
#   A, K-major (64 rows × 16 of a row-major tile): panel start + 64·row0 + k0 % 64
#   B, K-major (B[k, n] = T[n, k0 + k], T an N-row tile): panel start + k0 % 64
#   B, MN-major (B[k, n] = T[k0 + k, n], T row-major): tile start + 64·k0, with
#      its 64-column panels ``b_panel`` elements apart.
# D is a C-contiguous float32 local array of N/2 entries (of any shape; the
# kernels use (N/8, 4) or (1, N/8, 4)), laid out as mma.sync's accumulator per
# warp for its 16 rows: entry 4j + e of warp w of the group holds row
# 16w + group (e = 0, 1) or 16w + group + 8 (e = 2, 3), column 8j + 2·tig + e % 2. An A operand in registers
# (``wgmma_rs_*``) has mma.sync's A-fragment layout, per warp for its 16 rows.
#
# Order of use: fence_registers(D); wgmma_fence(); wgmma_* ...; wgmma_commit();
# wgmma_wait(0); fence_registers(D). Shared memory written by ordinary stores
# or cp.async must be published with fence_proxy_async() and a barrier first.
# The twins compute at once, so the fences are no-ops there; the wait meets the warpgroup's other warps.

SW128_ALIGN = 1024  # bytes: alignment of a swizzled tile


def _swizzle128(elements):
    """Element offsets (16-bit elements) after the 128-byte swizzle: chunk bits ^= row bits."""
    return elements ^ (((elements >> 6) & 7) << 3)


def _operand_b(buf, widen_bits, offset, n, panel, mn_major):
    """Twin: the (16, n) B operand named by ``offset`` (layouts above), widened to float32."""
    k = np.arange(16)[:, None]
    col = np.arange(n)[None, :]
    if mn_major:
        index = offset + (col // 64) * panel + 64 * k + col % 64
    else:
        index = offset + 64 * col + k
    return widen_bits(np.asarray(buf)[_swizzle128(index)])


def _warpgroup_position():
    """Twin: (row of this thread's first D entries within the 64, tig)."""
    thread = threading.current_thread().thread_id
    group, tig = divmod(thread % WARP_SIZE, 4)
    return 16 * ((thread // WARP_SIZE) % 4) + group, tig


def _store_d(acc, rows, tig, accumulate):
    """Twin: this thread's entries of the (2, N) product ``rows`` (rows g and g + 8) into ``acc``."""
    flat = acc.reshape(-1)  # a view: (N/8, 4) entries, whatever the array's shape
    for j in range(rows.shape[1] // 8):
        for e in range(4):
            value = np.float32(rows[e // 2, 8 * j + 2 * tig + e % 2])
            flat[4 * j + e] = value + flat[4 * j + e] if accumulate else value


def _wgmma_text(n, ptx_type, a_operand, count, tail, descriptors):
    """The product's PTX up to its B operand. ``descriptors`` name the operands that hold a descriptor's
    low word; each is widened into the 64-bit register ``d<operand>`` with the constant upper word, so
    that the compiler keeps descriptor arithmetic in 32 bits."""
    d = ",".join(f"${i}" for i in range(count))
    widen = "".join(f".reg .b64 d{i}; cvt.u64.u32 d{i}, ${i}; or.b64 d{i}, d{i}, {_DESCRIPTOR_HIGH}; "
                    for i in descriptors)
    return (
        f"{{ .reg .pred p; {widen}setp.ne.b32 p, ${2 * count + tail}, 0; "
        f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ptx_type}.{ptx_type} {{{d}}}, {a_operand}, "
    )


# The upper word of every descriptor here: stride byte offset 1024, 128-byte swizzle.
_DESCRIPTOR_HIGH = (1024 >> 4) << 32 | 1 << 62


def _descriptor(builder, address, lbo_bytes):
    """64-bit wgmma matrix descriptor of a SW128 operand at shared ``address`` (i32).

    Bits 0–13 start address / 16, 16–29 leading byte offset / 16 (between MN-major panels),
    32–45 stride byte offset / 16 (1024: between groups of eight 128-byte rows), 62–63 swizzle (1: 128 B).
    """

    def field(value, shift):
        return builder.shl(builder.lshr(builder.and_(value, ir.Constant(_i64, 0x3FFFF)), ir.Constant(_i64, 4)),
                           ir.Constant(_i64, shift))

    start = field(builder.zext(address, _i64), 0)
    return builder.or_(builder.or_(start, field(lbo_bytes, 16)), ir.Constant(_i64, _DESCRIPTOR_HIGH))


def _descriptor_low(context, builder, value, value_type):
    """The low word of a descriptor (its start address and leading byte offset; the upper word is
    ``_DESCRIPTOR_HIGH``): adding a k-step's constant then stays a 32-bit addition."""
    return builder.trunc(context.cast(builder, value, value_type, types.int64), _i32)


def _element_slots(context, builder, array_type, array, count):
    """Pointers to the first ``count`` elements of a (local) array."""
    data = make_array(array_type)(context, builder, array).data
    intp = context.get_value_type(types.intp)
    return [builder.gep(data, [ir.Constant(intp, i)]) for i in range(count)]


def _wgmma_ir(builder, context, acc_type, acc, text, count, operands, operand_constraints):
    """Load ``count`` accumulators, emit the asynchronous product, store the result registers back."""
    slots = _element_slots(context, builder, acc_type, acc, count)
    values = [builder.load(slot) for slot in slots]
    constraints = ",".join(["=f"] * count + [str(i) for i in range(count)] + operand_constraints + ["~{memory}"])
    out = _asm(builder, text, constraints, ir.LiteralStructType([_f32] * count), values + operands, side_effect=True)
    for i, slot in enumerate(slots):
        builder.store(builder.extract_value(out, i), slot)


class _Descriptor:
    """Twin of a matrix descriptor: the operand at element ``offset`` of ``buf``, ``panel`` elements between
    MN-major panels; adding ``k`` moves it ``16 · k`` bytes on, as adding to the real descriptor does."""

    def __init__(self, buf, offset, panel):
        self.buf, self.offset, self.panel = buf, int(offset), int(panel)

    def __add__(self, units):
        return _Descriptor(self.buf, self.offset + 8 * int(units), self.panel)

    __radd__ = __add__


def wgmma_descriptor(buf, offset, panel):
    """``wgmma_descriptor(buf, offset, panel) -> int64``: the matrix descriptor of the SW128 operand at
    element ``offset`` of the shared ``buf`` (1-D uint16), ``panel`` elements between its MN-major
    64-column panels (0 for a K-major operand).

    Adding ``k`` to a descriptor names the operand ``16 · k`` bytes (``8 · k``
    elements) further on, so the descriptors of a tile's k-steps are one
    descriptor plus constants, not an address conversion each. The value is
    lane 0's (a full-warp shuffle: every lane of the warp calls it), which
    lets the compiler keep it, and those sums, in uniform registers.
    """
    return _Descriptor(buf, offset, panel)


def _descriptor_intrinsic(uniform):
    """The lowering of ``wgmma_descriptor``; ``uniform``: broadcast lane 0's low word, which tells the
    compiler that the value is warp-uniform (every lane of a warpgroup names the same operand), so
    that it keeps the descriptor, and the k-steps' sums with it, in uniform registers. A shuffle per
    descriptor pays where one descriptor serves many products, not where each product builds its own."""

    @intrinsic
    def lowering(typingctx, buf, offset, panel):
        if not (isinstance(buf, types.Array) and buf.ndim == 1):
            return None

        def codegen(context, builder, sig, args):
            address = _shared_address(context, builder, sig.args[0], args[0], (args[1], sig.args[1]))
            panel_bytes = builder.mul(context.cast(builder, args[2], sig.args[2], types.int64), ir.Constant(_i64, 2))
            k_major = builder.icmp_signed("==", panel_bytes, ir.Constant(_i64, 0))
            descriptor = _descriptor(builder, address, builder.select(k_major, ir.Constant(_i64, 16), panel_bytes))
            if not uniform:
                return descriptor
            low = _asm(builder, "shfl.sync.idx.b32 $0, $1, 0, 31, -1;", "=r,r", _i32, [builder.trunc(descriptor, _i32)])
            return builder.or_(builder.zext(low, _i64), ir.Constant(_i64, _DESCRIPTOR_HIGH))

        return types.int64(buf, offset, panel), codegen

    return lowering


_wgmma_descriptor = _descriptor_intrinsic(uniform=True)
_operand_descriptor = _descriptor_intrinsic(uniform=False)  # wgmma_ss / wgmma_rs: one per product


_bind(wgmma_descriptor, _wgmma_descriptor)


def _make_wgmma(ptx_type, widen_bits):
    """``wgmma_ss_*``, ``wgmma_rs_*``, ``wgmma_ss_desc_*`` and ``wgmma_rs_desc_*`` (operands named by descriptors)
    for one input type."""

    def wgmma_ss_desc(acc, n, a_desc, b_desc, b_mn_major, accumulate):
        row, tig = _warpgroup_position()
        buf = np.asarray(a_desc.buf)
        index = _swizzle128(a_desc.offset + 64 * np.array([[row], [row + 8]]) + np.arange(16)[None, :])
        a = widen_bits(buf[index])
        b = _operand_b(b_desc.buf, widen_bits, b_desc.offset, n, b_desc.panel, b_mn_major)
        with np.errstate(invalid="ignore", over="ignore"):  # tensor cores pass NaN and infinity on, silently
            _store_d(acc, a @ b, tig, accumulate)

    def wgmma_ss(acc, n, buf, a_offset, b_offset, b_panel, b_mn_major, accumulate):
        wgmma_ss_desc(acc, n, wgmma_descriptor(buf, a_offset, 0), wgmma_descriptor(buf, b_offset, b_panel), b_mn_major,
                      accumulate)

    def wgmma_rs_desc(acc, n, a0, a1, a2, a3, b_desc, b_mn_major, accumulate):
        A = _warp_gather((a0, a1, a2, a3), lambda lanes: _a_matrix(np.array(lanes, dtype=np.uint32), widen_bits))
        row, tig = _warpgroup_position()
        group = row % 16
        b = _operand_b(b_desc.buf, widen_bits, b_desc.offset, n, b_desc.panel, b_mn_major)
        with np.errstate(invalid="ignore", over="ignore"):
            _store_d(acc, A[[group, group + 8]] @ b, tig, accumulate)

    def wgmma_rs(acc, n, a0, a1, a2, a3, buf, b_offset, b_panel, b_mn_major, accumulate):
        wgmma_rs_desc(acc, n, a0, a1, a2, a3, wgmma_descriptor(buf, b_offset, b_panel), b_mn_major, accumulate)

    wgmma_ss.__doc__ = f"""``wgmma_ss_{ptx_type}(acc, N, buf, a_offset, b_offset, b_panel, b_mn_major, accumulate)``.

    ``acc`` (float32, N/2 entries) = A·B (+ ``acc`` when ``accumulate``), both
    operands {ptx_type} in the SW128 shared buffer ``buf`` (1-D uint16) at the
    element offsets named above; ``N`` and ``b_mn_major`` are constants.
    Emits ``wgmma.mma_async.sync.aligned.m64nNk16.f32.{ptx_type}.{ptx_type}``.
    """
    wgmma_rs.__doc__ = f"""``wgmma_rs_{ptx_type}(acc, N, a0, a1, a2, a3, buf, b_offset, b_panel, b_mn_major, accumulate)``.

    As ``wgmma_ss_{ptx_type}`` with A in registers: ``a0..a3`` are the warp's
    A fragment (mma.sync layout) of its 16 rows.
    """
    wgmma_ss_desc.__doc__ = f"""``wgmma_ss_desc_{ptx_type}(acc, N, a_desc, b_desc, b_mn_major, accumulate)``: ``wgmma_ss_{ptx_type}``
    with the operands named by descriptors (``wgmma_descriptor``)."""
    wgmma_rs_desc.__doc__ = f"""``wgmma_rs_desc_{ptx_type}(acc, N, a0, a1, a2, a3, b_desc, b_mn_major, accumulate)``:
    ``wgmma_rs_{ptx_type}`` with B named by a descriptor (``wgmma_descriptor``)."""

    @intrinsic
    def ss_ir(typingctx, acc, n, a_desc, b_desc, b_mn_major, accumulate):
        N, trans = _literal_int(n), _literal_int(b_mn_major)
        if N is None or trans is None:
            return None
        count = N // 2
        a, b = 2 * count, 2 * count + 1
        text = _wgmma_text(N, ptx_type, f"d{a}", count, 2, (a, b)) + f"d{b}, p, 1, 1, 0, {trans}; }}"

        def codegen(context, builder, sig, args):
            descriptors = [_descriptor_low(context, builder, args[i], sig.args[i]) for i in (2, 3)]
            flag = builder.zext(context.cast(builder, args[5], sig.args[5], types.boolean), _i32)
            _wgmma_ir(builder, context, sig.args[0], args[0], text, count, descriptors + [flag], ["r", "r", "r"])
            return context.get_dummy_value()

        return types.none(acc, n, a_desc, b_desc, b_mn_major, accumulate), codegen

    @intrinsic
    def rs_ir(typingctx, acc, n, a0, a1, a2, a3, b_desc, b_mn_major, accumulate):
        N, trans = _literal_int(n), _literal_int(b_mn_major)
        if N is None or trans is None:
            return None
        count = N // 2
        a_regs = "{" + ",".join(f"${2 * count + i}" for i in range(4)) + "}"
        b = 2 * count + 4
        text = _wgmma_text(N, ptx_type, a_regs, count, 5, (b,)) + f"d{b}, p, 1, 1, {trans}; }}"

        def codegen(context, builder, sig, args):
            descriptor = _descriptor_low(context, builder, args[6], sig.args[6])
            flag = builder.zext(context.cast(builder, args[8], sig.args[8], types.boolean), _i32)
            operands = list(args[2:6]) + [descriptor, flag]
            _wgmma_ir(builder, context, sig.args[0], args[0], text, count, operands, ["r"] * 6)
            return context.get_dummy_value()

        return types.none(acc, n, a0, a1, a2, a3, b_desc, b_mn_major, accumulate), codegen

    def constants(n, b_mn_major):
        return _literal_int(n), _literal_int(b_mn_major)  # both must be compile-time constants

    @overload(wgmma_ss_desc, target="cuda", prefer_literal=True, inline="always")
    def _ss_desc_gpu(acc, n, a_desc, b_desc, b_mn_major, accumulate):
        N, MN = constants(n, b_mn_major)
        if N is None or MN is None:
            return None

        def impl(acc, n, a_desc, b_desc, b_mn_major, accumulate):
            return ss_ir(acc, N, a_desc, b_desc, MN, accumulate)

        return impl

    @overload(wgmma_rs_desc, target="cuda", prefer_literal=True, inline="always")
    def _rs_desc_gpu(acc, n, a0, a1, a2, a3, b_desc, b_mn_major, accumulate):
        N, MN = constants(n, b_mn_major)
        if N is None or MN is None:
            return None

        def impl(acc, n, a0, a1, a2, a3, b_desc, b_mn_major, accumulate):
            return rs_ir(acc, N, a0, a1, a2, a3, b_desc, MN, accumulate)

        return impl

    @overload(wgmma_ss, target="cuda", prefer_literal=True, inline="always")
    def _ss_gpu(acc, n, buf, a_offset, b_offset, b_panel, b_mn_major, accumulate):
        N, MN = constants(n, b_mn_major)
        if N is None or MN is None:
            return None

        def impl(acc, n, buf, a_offset, b_offset, b_panel, b_mn_major, accumulate):
            return ss_ir(acc, N, _operand_descriptor(buf, a_offset, 0), _operand_descriptor(buf, b_offset, b_panel), MN,
                         accumulate)

        return impl

    @overload(wgmma_rs, target="cuda", prefer_literal=True, inline="always")
    def _rs_gpu(acc, n, a0, a1, a2, a3, buf, b_offset, b_panel, b_mn_major, accumulate):
        N, MN = constants(n, b_mn_major)
        if N is None or MN is None:
            return None

        def impl(acc, n, a0, a1, a2, a3, buf, b_offset, b_panel, b_mn_major, accumulate):
            return rs_ir(acc, N, a0, a1, a2, a3, _operand_descriptor(buf, b_offset, b_panel), MN, accumulate)

        return impl

    for f, name in ((wgmma_ss, "wgmma_ss"), (wgmma_rs, "wgmma_rs"), (wgmma_ss_desc, "wgmma_ss_desc"),
                    (wgmma_rs_desc, "wgmma_rs_desc")):
        f.__name__ = f"{name}_{ptx_type}"
    return wgmma_ss, wgmma_rs, wgmma_ss_desc, wgmma_rs_desc


wgmma_ss_f16, wgmma_rs_f16, wgmma_ss_desc_f16, wgmma_rs_desc_f16 = _make_wgmma("f16", _widen_f16_bits)
wgmma_ss_bf16, wgmma_rs_bf16, wgmma_ss_desc_bf16, wgmma_rs_desc_bf16 = _make_wgmma("bf16", _widen_bf16_bits)


def wgmma_fence():
    """``wgmma_fence()``: order earlier register and shared-memory accesses before the next wgmma (``wgmma.fence``)."""


def wgmma_commit():
    """``wgmma_commit()``: close the group of wgmma operations issued so far (``wgmma.commit_group``)."""


def fence_proxy_async():
    """``fence_proxy_async()``: make this thread's shared-memory writes visible to wgmma operand reads.

    Emits ``fence.proxy.async.shared::cta``; a barrier must follow before another thread's wgmma reads them.
    """


_bind(wgmma_fence, _statement_intrinsic("wgmma.fence.sync.aligned;"))
_bind(wgmma_commit, _statement_intrinsic("wgmma.commit_group.sync.aligned;"))
_bind(fence_proxy_async, _statement_intrinsic("fence.proxy.async.shared::cta;"))


def wgmma_wait(pending):
    """``wgmma_wait(N)``: wait until at most ``N`` (a constant) committed wgmma groups are in flight.

    A product runs once every warp of the warpgroup has issued it, so after the wait the operands
    have been read by all four warps and may be overwritten. The twins compute at issue; this twin
    waits for the warpgroup's other warps to get here, which gives the same guarantee.
    """
    thread = threading.current_thread().thread_id
    _named_barrier(("wgmma", thread // (4 * WARP_SIZE))).arrive(4 * WARP_SIZE, wait=True)


_bind_constant_statement(wgmma_wait, "wgmma.wait_group.sync.aligned")


def grow_registers(count):
    """``grow_registers(N)``: raise the registers per thread of the calling warpgroup to ``N`` (a constant, a
    multiple of 8 up to 256), taking them from those that other warpgroups gave back (``setmaxnreg.inc``);
    every thread of the warpgroup calls it, in a kernel compiled with a register limit. No-op twin."""


def shrink_registers(count):
    """``shrink_registers(N)``: give back the calling warpgroup's registers beyond ``N`` per thread (a constant,
    a multiple of 8 from 24), for other warpgroups to take (``setmaxnreg.dec``). No-op twin."""


_bind_constant_statement(grow_registers, "setmaxnreg.inc.sync.aligned.u32")
_bind_constant_statement(shrink_registers, "setmaxnreg.dec.sync.aligned.u32")


def fence_registers(acc, count):
    """``fence_registers(regs, COUNT)``: keep the compiler from moving accesses of ``regs[:COUNT]`` across it.

    ``regs`` is a float32 or uint32 local array (its first ``COUNT``
    elements, a constant). Each element passes through an empty volatile
    ``asm``, so reads of a wgmma result stay after ``wgmma_wait``, writes of an
    accumulator stay before ``wgmma_fence``, and registers that an
    in-flight wgmma reads (an A operand) stay reserved until the wait: ptxas
    would otherwise reuse them and pull the wait up to the reuse. No
    instruction is emitted.
    """


@intrinsic
def _fence_registers(typingctx, acc, count):
    if not isinstance(count, types.IntegerLiteral):
        return None
    n = count.literal_value

    register = {types.float32: ("=f,0", _f32), types.uint32: ("=r,0", _i32)}.get(getattr(acc, "dtype", None))
    if register is None:
        return None
    constraints, value_type = register

    def codegen(context, builder, sig, args):
        for slot in _element_slots(context, builder, sig.args[0], args[0], n):
            builder.store(_asm(builder, "", constraints, value_type, [builder.load(slot)], side_effect=True), slot)
        return context.get_dummy_value()

    return types.none(acc, count), codegen


def _bind_counted(twin, lowering):
    """Make ``lowering(regs, COUNT)`` the GPU implementation of ``twin(regs, count)``, ``count`` a constant."""

    @overload(twin, target="cuda", prefer_literal=True, inline="always")
    def _gpu(regs, count):
        COUNT = _literal_int(count)
        if COUNT is None:
            return None

        def impl(regs, count):
            return lowering(regs, COUNT)

        return impl


_bind_counted(fence_registers, _fence_registers)


def opaque(x):
    """``opaque(x)``: the integer ``x``, as a value the compiler cannot see through, taken where it stands.

    ``x`` passes through an empty volatile ``asm`` (no instruction is emitted). Addresses derived from
    the result inside a loop are computed there, instead of being hoisted out of the loop and held in
    registers, or spilled, across everything else the loop does.
    """
    return x


@intrinsic
def _opaque(typingctx, x):
    if not isinstance(x, types.Integer) or x.bitwidth not in (32, 64):
        return None
    constraints = "=l,0" if x.bitwidth == 64 else "=r,0"

    def codegen(context, builder, sig, args):
        return _asm(builder, "", constraints, args[0].type, [args[0]], side_effect=True)

    return x(x), codegen


_bind(opaque, _opaque)


def forget_registers(acc, count):
    """``forget_registers(acc, COUNT)``: the values in ``acc[:COUNT]`` are dead from here on.

    For a float32 accumulator whose next product overwrites it (``accumulate``
    False at its first k-step): a wgmma reads its accumulator registers even
    then, so without this the values of the previous product stay live, in
    registers or spilled, until the next one. Emits nothing (the registers
    become undefined). The twin fills them with NaN, so that a read before the
    next write shows.
    """
    acc.reshape(-1)[:count] = np.nan


@intrinsic
def _forget_registers(typingctx, acc, count):
    if not isinstance(count, types.IntegerLiteral) or getattr(acc, "dtype", None) != types.float32:
        return None
    n = count.literal_value

    def codegen(context, builder, sig, args):
        for slot in _element_slots(context, builder, sig.args[0], args[0], n):
            builder.store(ir.Constant(_f32, ir.Undefined), slot)
        return context.get_dummy_value()

    return types.none(acc, count), codegen


_bind_counted(forget_registers, _forget_registers)


def aligned_start(buf, alignment):
    """``aligned_start(buf, alignment) -> int``: the first index of shared ``buf`` whose address is a multiple of ``alignment`` bytes.

    ``buf`` is a 1-D shared array; ``alignment`` a power of two. The twin
    treats ``buf[0]`` as aligned.
    """
    return 0


@intrinsic
def _aligned_start(typingctx, buf, alignment):
    if not (isinstance(buf, types.Array) and buf.ndim == 1):
        return None

    def codegen(context, builder, sig, args):
        address = _shared_address(context, builder, sig.args[0], args[0], (ir.Constant(_i64, 0), types.int64))
        mask = builder.sub(context.cast(builder, args[1], sig.args[1], types.int32), ir.Constant(_i32, 1))
        pad = builder.and_(builder.neg(address), mask)
        itemsize = context.get_abi_sizeof(context.get_data_type(sig.args[0].dtype))
        return builder.zext(builder.udiv(pad, ir.Constant(_i32, itemsize)), _i64)

    return types.int64(buf, alignment), codegen


_bind(aligned_start, _aligned_start)
