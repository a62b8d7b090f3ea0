"""PTX-level primitives for numattn kernels.

Each primitive is a plain-Python function whose body is its simulator twin
(it runs when kernels execute in numba's CUDA simulator), with its GPU lowering,
an llvmlite intrinsic (mostly inline PTX), bound directly below it. Kernels
call the public name and get the right one on either target.

16-bit floating-point values travel through kernels as ``uint16`` bit patterns
(or two to a ``uint32`` register): numba's own fp16/bf16 arithmetic links
NVRTC-compiled shims, and bf16 arrays cannot live in shared or local memory.

Warp-level primitives (``mma``, ``ldmatrix``, shuffles) need every lane's
operands. In the simulator each thread is a Python thread, so their twins meet
at a per-warp exchange (``_warp_gather``) and each lane takes its part of the
result, following the fragment layouts of the PTX ISA. Lane ``l`` of a warp has
``group = l // 4`` and ``tig = l % 4`` (thread in group) below.
"""

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
    """Make the intrinsic ``lowering`` the GPU implementation of ``twin``."""

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


def _unpack_struct(context, builder, sig, value, count):
    """An inline-asm struct result as the numba tuple ``sig.return_type``."""
    return context.make_tuple(builder, sig.return_type, [builder.extract_value(value, i) for i in range(count)])


def _shared_address(context, builder, tile_type, tile, row, col):
    """32-bit shared-state-space address of ``tile[row, col]`` (``tile`` in shared memory)."""
    array = make_array(tile_type)(context, builder, tile)
    indices = [context.cast(builder, v, t, types.intp) for v, t in ((row[0], row[1]), (col[0], col[1]))]
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


# --------------------------------------------------------------------------
# Conversions between fp32 and 16-bit bit patterns
# --------------------------------------------------------------------------


def cvt_f32_f16(bits):
    """``cvt_f32_f16(bits) -> float32``: widen the fp16 value with bit pattern ``bits``.

    Emits ``cvt.f32.f16``. Exact.
    """
    return np.float32(np.uint16(bits).view(np.float16))


def _widen_f16_ir(builder, bits):
    return builder.fpext(builder.bitcast(bits, ir.HalfType()), _f32)


_bind(cvt_f32_f16, _ir_intrinsic(_widen_f16_ir, types.float32(types.uint16)))


def cvt_f32_bf16(bits):
    """``cvt_f32_bf16(bits) -> float32``: widen the bf16 value with bit pattern ``bits``.

    bf16 is the upper half of an fp32, so this is ``bits << 16`` reinterpreted. Exact.
    """
    return (np.uint32(bits) << np.uint32(16)).view(np.float32)


def _widen_bf16_ir(builder, bits):
    return builder.bitcast(builder.shl(builder.zext(bits, _i32), ir.Constant(_i32, 16)), _f32)


_bind(cvt_f32_bf16, _ir_intrinsic(_widen_bf16_ir, types.float32(types.uint16)))


def cvt_rn_f16_f32(x):
    """``cvt_rn_f16_f32(x) -> uint16``: fp16 bit pattern of ``x``, rounded to nearest even.

    Emits ``cvt.rn.f16.f32``; overflows to ±inf as IEEE rounding does; NaN
    becomes the canonical NaN 0x7FFF.
    """
    x = np.float32(x)
    if np.isnan(x):
        return np.uint16(0x7FFF)
    with np.errstate(over="ignore"):
        return np.float16(x).view(np.uint16)


_bind(
    cvt_rn_f16_f32,
    _ir_intrinsic(lambda builder, x: builder.bitcast(builder.fptrunc(x, ir.HalfType()), _i16), types.uint16(types.float32)),
)


def cvt_rn_bf16_f32(x):
    """``cvt_rn_bf16_f32(x) -> uint16``: bf16 bit pattern of ``x``, rounded to nearest even.

    Emits ``cvt.rn.bf16.f32`` (sm_80+). NaN becomes the canonical quiet NaN 0x7FFF.
    """
    bits = int(np.float32(x).view(np.uint32))
    if (bits & 0x7FFFFFFF) > 0x7F800000:
        return np.uint16(0x7FFF)
    rounding = 0x7FFF + ((bits >> 16) & 1)
    return np.uint16(((bits + rounding) >> 16) & 0xFFFF)


_bind(cvt_rn_bf16_f32, _asm_intrinsic("cvt.rn.bf16.f32 $0, $1;", "=h,f", _i16, types.uint16(types.float32)))


# --------------------------------------------------------------------------
# Two 16-bit values in one 32-bit register
# --------------------------------------------------------------------------


def pack_f16x2(lo, hi):
    """``pack_f16x2(lo, hi) -> uint32``: both rounded to fp16, ``lo`` in bits 0–15.

    Emits ``cvt.rn.f16x2.f32``.
    """
    return np.uint32(int(cvt_rn_f16_f32(lo)) | int(cvt_rn_f16_f32(hi)) << 16)


def pack_bf16x2(lo, hi):
    """``pack_bf16x2(lo, hi) -> uint32``: both rounded to bf16, ``lo`` in bits 0–15.

    Emits ``cvt.rn.bf16x2.f32``.
    """
    return np.uint32(int(cvt_rn_bf16_f32(lo)) | int(cvt_rn_bf16_f32(hi)) << 16)


def _pack_lowering(ptx_type):
    @intrinsic
    def lowering(typingctx, lo, hi):
        def codegen(context, builder, sig, args):
            # the first source operand goes to the upper half
            return _asm(builder, f"cvt.rn.{ptx_type}.f32 $0, $1, $2;", "=r,f,f", _i32, [args[1], args[0]])

        return types.uint32(types.float32, types.float32), codegen

    return lowering


_bind(pack_f16x2, _pack_lowering("f16x2"))
_bind(pack_bf16x2, _pack_lowering("bf16x2"))


def unpack_f16x2(x):
    """``unpack_f16x2(x) -> (float32, float32)``: the fp16 values in bits 0–15 and 16–31. Exact."""
    x = int(x)
    return cvt_f32_f16(x & 0xFFFF), cvt_f32_f16(x >> 16)


def unpack_bf16x2(x):
    """``unpack_bf16x2(x) -> (float32, float32)``: the bf16 values in bits 0–15 and 16–31. Exact."""
    x = int(x)
    return cvt_f32_bf16(x & 0xFFFF), cvt_f32_bf16(x >> 16)


def _unpack_lowering(widen_half):
    @intrinsic
    def lowering(typingctx, x):
        def codegen(context, builder, sig, args):
            lo = builder.trunc(args[0], _i16)
            hi = builder.trunc(builder.lshr(args[0], ir.Constant(_i32, 16)), _i16)
            return context.make_tuple(builder, sig.return_type, [widen_half(builder, lo), widen_half(builder, hi)])

        return types.UniTuple(types.float32, 2)(types.uint32), codegen

    return lowering


_bind(unpack_f16x2, _unpack_lowering(_widen_f16_ir))
_bind(unpack_bf16x2, _unpack_lowering(_widen_bf16_ir))


# --------------------------------------------------------------------------
# Special functions and warp shuffles
# --------------------------------------------------------------------------


def ex2_approx(x):
    """``ex2_approx(x) -> float32``: 2**x. Emits ``ex2.approx.ftz.f32`` (relative error below 2**-22; -inf gives 0)."""
    with np.errstate(over="ignore"):
        return np.float32(np.exp2(np.float32(x)))


_bind(ex2_approx, _asm_intrinsic("ex2.approx.ftz.f32 $0, $1;", "=f,f", _f32, types.float32(types.float32)))


def shfl_xor_f32(x, lane_mask):
    """``shfl_xor_f32(x, lane_mask) -> float32``: ``x`` of lane ``laneid ^ lane_mask``, all 32 lanes taking part.

    Emits ``shfl.sync.bfly.b32`` with a full member mask.
    """
    values = _warp_gather(np.float32(x))
    return values[_lane() ^ int(lane_mask)]


_bind(
    shfl_xor_f32,
    _asm_intrinsic("shfl.sync.bfly.b32 $0, $1, $2, 31, -1;", "=f,f,r", _f32, types.float32(types.float32, types.int32)),
)


def ballot(predicate):
    """``ballot(predicate) -> uint32``: bit ``l`` set when lane ``l``'s ``predicate`` is true; all 32 lanes take part.

    Emits ``vote.sync.ballot.b32`` with a full member mask.
    """
    return _warp_gather(bool(predicate), lambda votes: np.uint32(sum(1 << lane for lane, v in enumerate(votes) if v)))


@intrinsic
def _ballot(typingctx, predicate):
    def codegen(context, builder, sig, args):
        flag = builder.zext(args[0], _i32)
        text = "{ .reg .pred p; setp.ne.u32 p, $1, 0; vote.sync.ballot.b32 $0, p, -1; }"
        return _asm(builder, text, "=r,r", _i32, [flag])

    return types.uint32(types.boolean), codegen


_bind(ballot, _ballot)


# --------------------------------------------------------------------------
# Tensor-core matrix multiply-accumulate, m16n8k16, fp32 accumulators
# --------------------------------------------------------------------------
# A (16×16, row-major) in a0..a3: a0 = A[g, 2t:2t+2], a1 = A[g+8, 2t:2t+2],
#   a2 = A[g, 2t+8:2t+10], a3 = A[g+8, 2t+8:2t+10]
# B (16×8, column-major) in b0, b1: b0 = B[2t:2t+2, g], b1 = B[2t+8:2t+10, g]
# C, D (16×8) in c0..c3: C[g, 2t], C[g, 2t+1], C[g+8, 2t], C[g+8, 2t+1]
# (g = group, t = tig; a register's bits 0–15 hold the lower column or row index)


_G, _T = np.arange(WARP_SIZE) // 4, np.arange(WARP_SIZE) % 4


def _mma_combine(widen_bits):
    """The warp-wide product: lanes' (a, b, c) registers in, every lane's (d0, d1, d2, d3) out."""

    def combine(lanes):
        a = np.array([lane[0] for lane in lanes], dtype=np.uint32)  # (32, 4)
        b = np.array([lane[1] for lane in lanes], dtype=np.uint32)  # (32, 2)
        c = np.array([lane[2] for lane in lanes], dtype=np.float32)  # (32, 4)
        A = np.empty((16, 16), np.float32)
        B = np.empty((16, 8), np.float32)
        C = np.empty((16, 8), np.float32)
        for i in range(4):
            rows, cols = _G + 8 * (i % 2), 2 * _T + 8 * (i // 2)
            A[rows, cols], A[rows, cols + 1] = widen_bits(a[:, i] & 0xFFFF), widen_bits(a[:, i] >> 16)
            C[_G + 8 * (i // 2), 2 * _T + i % 2] = c[:, i]
        for i in range(2):
            ks = 2 * _T + 8 * i
            B[ks, _G], B[ks + 1, _G] = widen_bits(b[:, i] & 0xFFFF), widen_bits(b[:, i] >> 16)
        D = A @ B + C
        return np.stack([D[_G, 2 * _T], D[_G, 2 * _T + 1], D[_G + 8, 2 * _T], D[_G + 8, 2 * _T + 1]], axis=1)

    return combine


def _widen_f16_bits(bits):
    return bits.astype(np.uint16).view(np.float16).astype(np.float32)


def _widen_bf16_bits(bits):
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


_MMA_F16, _MMA_BF16 = _mma_combine(_widen_f16_bits), _mma_combine(_widen_bf16_bits)


def mma_m16n8k16_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """``mma_m16n8k16_f16(a0..a3, b0, b1, c0..c3) -> (d0, d1, d2, d3)``: D = A·B + C.

    A, B fp16 (``uint32`` registers of two values), C, D fp32. Emits
    ``mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32``; layouts above.
    """
    d = _warp_gather(((a0, a1, a2, a3), (b0, b1), (c0, c1, c2, c3)), _MMA_F16)
    return tuple(d[_lane()])


def mma_m16n8k16_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """``mma_m16n8k16_bf16(...)``: as ``mma_m16n8k16_f16`` with bf16 A and B (``...f32.bf16.bf16.f32``)."""
    d = _warp_gather(((a0, a1, a2, a3), (b0, b1), (c0, c1, c2, c3)), _MMA_BF16)
    return tuple(d[_lane()])


def _mma_lowering(ptx_type):
    text = (
        f"mma.sync.aligned.m16n8k16.row.col.f32.{ptx_type}.{ptx_type}.f32 "
        "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};"
    )

    @intrinsic
    def lowering(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        sig = types.UniTuple(types.float32, 4)(*([types.uint32] * 6 + [types.float32] * 4))

        def codegen(context, builder, sig, args):
            result = ir.LiteralStructType([_f32] * 4)
            out = _asm(builder, text, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", result, args)
            return _unpack_struct(context, builder, sig, out, 4)

        return sig, codegen

    return lowering


_bind(mma_m16n8k16_f16, _mma_lowering("f16"))
_bind(mma_m16n8k16_bf16, _mma_lowering("bf16"))


# --------------------------------------------------------------------------
# Shared-memory matrix loads
# --------------------------------------------------------------------------
# ldmatrix x4 loads four 8×8 matrices of 16-bit elements. Lanes 8i..8i+7 give
# the (row, col) of the eight 8-element rows of matrix i, each 16 bytes long
# and 16-byte aligned. Register i of lane l receives matrix i's elements
#   plain:  row group, columns 2·tig and 2·tig + 1     (an A or B fragment)
#   .trans: rows 2·tig and 2·tig + 1, column group     (the transpose's fragment)


def _pack_bits(lo, hi):
    return np.uint32(int(lo) | int(hi) << 16)


def ldmatrix_x4(tile, row, col):
    """``ldmatrix_x4(tile, row, col) -> (r0, r1, r2, r3)``: four 8×8 b16 matrices from shared ``tile``.

    ``tile`` is a 2-D uint16 shared-memory array; this lane names the row that
    starts at ``tile[row, col]``. Emits ``ldmatrix.sync.aligned.m8n8.x4.shared.b16``.
    """
    lanes = _warp_gather((tile, row, col))
    g, t = divmod(_lane(), 4)
    regs = []
    for i in range(4):
        src, r, c = lanes[8 * i + g]
        regs.append(_pack_bits(src[r, c + 2 * t], src[r, c + 2 * t + 1]))
    return tuple(regs)


def ldmatrix_x4_trans(tile, row, col):
    """``ldmatrix_x4_trans(tile, row, col)``: as ``ldmatrix_x4``, each matrix transposed (``.trans``)."""
    lanes = _warp_gather((tile, row, col))
    g, t = divmod(_lane(), 4)
    regs = []
    for i in range(4):
        src_lo, r_lo, c_lo = lanes[8 * i + 2 * t]
        src_hi, r_hi, c_hi = lanes[8 * i + 2 * t + 1]
        regs.append(_pack_bits(src_lo[r_lo, c_lo + g], src_hi[r_hi, c_hi + g]))
    return tuple(regs)


def _ldmatrix_lowering(variant):
    text = f"ldmatrix.sync.aligned.m8n8.x4{variant}.shared.b16 {{$0,$1,$2,$3}}, [$4];"

    @intrinsic
    def lowering(typingctx, tile, row, col):
        if not (isinstance(tile, types.Array) and tile.ndim == 2 and tile.dtype == types.uint16):
            return None
        sig = types.UniTuple(types.uint32, 4)(tile, row, col)

        def codegen(context, builder, sig, args):
            address = _shared_address(
                context, builder, sig.args[0], args[0], (args[1], sig.args[1]), (args[2], sig.args[2])
            )
            result = ir.LiteralStructType([_i32] * 4)
            out = _asm(builder, text, "=r,=r,=r,=r,r,~{memory}", result, [address], side_effect=True)
            return _unpack_struct(context, builder, sig, out, 4)

        return sig, codegen

    return lowering


_bind(ldmatrix_x4, _ldmatrix_lowering(""))
_bind(ldmatrix_x4_trans, _ldmatrix_lowering(".trans"))


# --------------------------------------------------------------------------
# Asynchronous global-to-shared copies
# --------------------------------------------------------------------------


def cp_async_16(dst, row, col, src, index, nbytes):
    """``cp_async_16(dst, row, col, src, index, nbytes)``: copy 16 bytes from ``src[index]`` to ``dst[row, col]``.

    ``dst`` is a 2-D shared array, ``src`` a global array whose last axis is
    contiguous, both 16-byte aligned at these elements; ``index`` a tuple of
    ``src.ndim`` ints. With ``nbytes`` 0 nothing is read and the 16 bytes are
    zero-filled (``nbytes`` is 0 or 16). Emits ``cp.async.cg.shared.global``;
    the copy completes at ``cp_async_wait_group``. The twin copies at once.
    """
    count = 16 // dst.itemsize
    for i in range(count):
        dst[row, col + i] = src[(*index[:-1], index[-1] + i)] if nbytes else 0


@intrinsic
def _cp_async_16(typingctx, dst, row, col, src, index, nbytes):
    if not (isinstance(dst, types.Array) and isinstance(src, types.Array) and isinstance(index, types.BaseTuple)):
        return None

    def codegen(context, builder, sig, args):
        dst_type, row_type, col_type, src_type, index_type, nbytes_type = sig.args
        shared = _shared_address(context, builder, dst_type, args[0], (args[1], row_type), (args[2], col_type))
        source = make_array(src_type)(context, builder, args[3])
        indices = [
            context.cast(builder, v, t, types.intp)
            for v, t in zip(cgutils.unpack_tuple(builder, args[4], len(index_type)), index_type)
        ]
        ptr = cgutils.get_item_pointer(context, builder, src_type, source, indices)
        size = context.cast(builder, args[5], nbytes_type, types.int32)
        _asm(
            builder,
            "cp.async.cg.shared.global [$0], [$1], 16, $2;",
            "r,l,r,~{memory}",
            ir.VoidType(),
            [shared, builder.ptrtoint(ptr, _i64), size],
            side_effect=True,
        )
        return context.get_dummy_value()

    return types.none(dst, row, col, src, index, nbytes), codegen


_bind(cp_async_16, _cp_async_16)


def cp_async_commit():
    """``cp_async_commit()``: close the group of ``cp_async_16`` copies issued so far (``cp.async.commit_group``)."""


@intrinsic
def _cp_async_commit(typingctx):
    def codegen(context, builder, sig, args):
        _asm(builder, "cp.async.commit_group;", "~{memory}", ir.VoidType(), [], side_effect=True)
        return context.get_dummy_value()

    return types.none(), codegen


_bind(cp_async_commit, _cp_async_commit)


def cp_async_wait_group(pending):
    """``cp_async_wait_group(N)``: wait until at most ``N`` (a constant) committed groups are still in flight.

    Emits ``cp.async.wait_group N``. Follow it with a barrier before reading
    what other threads copied.
    """


@intrinsic
def _cp_async_wait_group(typingctx, pending):
    if not isinstance(pending, types.IntegerLiteral):
        return None
    text = f"cp.async.wait_group {pending.literal_value};"

    def codegen(context, builder, sig, args):
        _asm(builder, text, "~{memory}", ir.VoidType(), [], side_effect=True)
        return context.get_dummy_value()

    return types.none(pending), codegen


@overload(cp_async_wait_group, target="cuda", prefer_literal=True, inline="always")
def _cp_async_wait_group_gpu(pending):
    if not isinstance(pending, types.IntegerLiteral):
        return None
    PENDING = pending.literal_value

    def impl(pending):
        return _cp_async_wait_group(PENDING)

    return impl
