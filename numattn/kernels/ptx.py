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


def _bind_wait_group(twin, mnemonic):
    """Make ``twin(N)`` emit ``mnemonic N;`` on the GPU; ``N`` must be a compile-time constant."""

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


def syncwarp():
    """``syncwarp()``: barrier among the 32 lanes of the warp, ordering their shared-memory accesses.

    Emits ``bar.warp.sync -1``.
    """
    _warp_gather(None)


_bind(syncwarp, _statement_intrinsic("bar.warp.sync -1;"))


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


def _a_matrix(a, widen_bits):
    """The 16×16 A operand from every lane's four A-fragment registers (``a`` of shape (32, 4))."""
    A = np.empty((16, 16), np.float32)
    for i in range(4):
        rows, cols = _G + 8 * (i % 2), 2 * _T + 8 * (i // 2)
        A[rows, cols], A[rows, cols + 1] = widen_bits(a[:, i] & 0xFFFF), widen_bits(a[:, i] >> 16)
    return A


def _mma_combine(widen_bits):
    """The warp-wide product: lanes' (a, b, c) registers in, every lane's (d0, d1, d2, d3) out."""

    def combine(lanes):
        a = np.array([lane[0] for lane in lanes], dtype=np.uint32)  # (32, 4)
        b = np.array([lane[1] for lane in lanes], dtype=np.uint32)  # (32, 2)
        c = np.array([lane[2] for lane in lanes], dtype=np.float32)  # (32, 4)
        A = _a_matrix(a, widen_bits)
        B = np.empty((16, 8), np.float32)
        C = np.empty((16, 8), np.float32)
        for i in range(4):
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
            address = _shared_address(context, builder, sig.args[0], args[0], *zip(args[1:], sig.args[1:], strict=True))
            result = ir.LiteralStructType([_i32] * 4)
            out = _asm(builder, text, "=r,=r,=r,=r,r,~{memory}", result, [address], side_effect=True)
            return _unpack_struct(context, builder, sig, out, 4)

        return sig, codegen

    return lowering


_bind(ldmatrix_x4, _ldmatrix_lowering(""))
_bind(ldmatrix_x4_trans, _ldmatrix_lowering(".trans"))


def stmatrix_x4(tile, row, col, r0, r1, r2, r3):
    """``stmatrix_x4(tile, row, col, r0, r1, r2, r3)``: store four 8×8 b16 matrices.

    The inverse of ``ldmatrix_x4``: ``ri`` holds this lane's entries of matrix
    i in the mma fragment layout (row ``lane // 4``, columns ``2 (lane % 4)``
    and + 1); row j of matrix i is stored as the 8 elements from
    ``tile[row, col]`` of lane ``8 i + j``. ``tile`` is a 2-D uint16
    shared-memory array. Emits ``stmatrix.sync.aligned.m8n8.x4.shared.b16`` (sm_90).
    """
    lanes = _warp_gather((tile, row, col))
    g, t = divmod(_lane(), 4)
    for i, reg in enumerate((r0, r1, r2, r3)):
        dst, r, c = lanes[8 * i + g]
        for half in range(2):
            dst[r, c + 2 * t + half] = (int(reg) >> (16 * half)) & 0xFFFF
    _warp_gather(None)  # every lane's stores are done before any lane goes on


def stmatrix_x4_trans(tile, row, col, r0, r1, r2, r3):
    """``stmatrix_x4_trans(tile, row, col, r0, r1, r2, r3)``: store four 8×8 b16 matrices, each transposed.

    The inverse of ``ldmatrix_x4_trans``: ``ri`` holds this lane's entries of
    matrix i in the mma fragment layout (row ``lane // 4``, columns
    ``2 (lane % 4)`` and + 1); column j of matrix i is stored as the 8
    elements from ``tile[row, col]`` of lane ``8 i + j``. ``tile`` is a 2-D
    uint16 shared-memory array. Emits
    ``stmatrix.sync.aligned.m8n8.x4.trans.shared.b16`` (sm_90).
    """
    lanes = _warp_gather((tile, row, col))
    g, t = divmod(_lane(), 4)
    for i, reg in enumerate((r0, r1, r2, r3)):
        for half in range(2):
            dst, r, c = lanes[8 * i + 2 * t + half]
            dst[r, c + g] = (int(reg) >> (16 * half)) & 0xFFFF
    _warp_gather(None)  # every lane's stores are done before any lane goes on


def _stmatrix_lowering(variant):
    """The intrinsic of ``stmatrix.sync.aligned.m8n8.x4{variant}.shared.b16``."""
    text = f"stmatrix.sync.aligned.m8n8.x4{variant}.shared.b16 [$0], {{$1,$2,$3,$4}};"

    @intrinsic
    def lowering(typingctx, tile, row, col, r0, r1, r2, r3):
        if not (isinstance(tile, types.Array) and tile.ndim == 2 and tile.dtype == types.uint16):
            return None

        def codegen(context, builder, sig, args):
            address = _shared_address(context, builder, sig.args[0], args[0], *zip(args[1:3], sig.args[1:3], strict=True))
            regs = [context.cast(builder, v, t, types.uint32) for v, t in zip(args[3:], sig.args[3:], strict=True)]
            _asm(builder, text, "r,r,r,r,r,~{memory}", ir.VoidType(), [address, *regs], side_effect=True)
            return context.get_dummy_value()

        return types.none(tile, row, col, r0, r1, r2, r3), codegen

    return lowering


_bind(stmatrix_x4, _stmatrix_lowering(""))
_bind(stmatrix_x4_trans, _stmatrix_lowering(".trans"))


# --------------------------------------------------------------------------
# Asynchronous global-to-shared copies
# --------------------------------------------------------------------------


def cp_async_16(dst, row, col, src, index, nbytes):
    """``cp_async_16(dst, row, col, src, index, nbytes)``: copy 16 bytes from ``src[index]`` to ``dst[row, col]``.

    ``dst`` is a 2-D shared array, ``src`` a global array whose last axis is
    contiguous, both 16-byte aligned at these elements; ``index`` a tuple of
    ``src.ndim`` ints. Only the first ``nbytes`` bytes (0 to 16, whole
    elements) are read, the rest of the 16 are zero-filled. Emits
    ``cp.async.cg.shared.global`` with ``nbytes`` as its source size; the copy
    completes at ``cp_async_wait_group``. The twin copies at once.
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
    well ahead of its use, completing with its commit group. The twin copies at once.
    """
    dst[row, col] = src[index]


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
    """Twin of a global address: element ``index`` of ``array``; adding ``n`` moves it ``n`` bytes
    along the (contiguous) last axis, as adding to the real address does."""

    def __init__(self, array, index):
        self.array, self.index = array, tuple(int(i) for i in index)

    def __add__(self, nbytes):
        step, rest = divmod(int(nbytes), self.array.itemsize)
        assert rest == 0, "an address moves by whole elements"
        return _Address(self.array, (*self.index[:-1], self.index[-1] + step))

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
    for i in range(count):
        dst[row, col + i] = src[(*index[:-1], index[-1] + i)] if i * dst.itemsize < nbytes else 0


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


_bind(cp_async_commit, _statement_intrinsic("cp.async.commit_group;"))


def cp_async_wait_group(pending):
    """``cp_async_wait_group(N)``: wait until at most ``N`` (a constant) committed groups are still in flight.

    Emits ``cp.async.wait_group N``. Follow it with a barrier before reading
    what other threads copied.
    """


_bind_wait_group(cp_async_wait_group, "cp.async.wait_group")


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

    ``dst`` is a global float32 array, contiguous over the range, ``index`` a
    tuple of ``dst.ndim`` ints; ``src`` a 1-D shared float32 array; both
    16-byte aligned there, ``nbytes`` a multiple of 16. One thread issues it:
    ``cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32``, which reads
    ``src`` asynchronously (publish it with ``fence_proxy_async()`` and a barrier
    first; ``bulk_commit()`` and ``bulk_wait_read(0)`` before writing it again)
    and adds in L2 without a round trip per element. The twin adds at once, under a lock.
    """
    flat = np.asarray(getattr(dst, "_ary", dst)).reshape(-1)  # a view: dst is contiguous over the range
    first = int(np.ravel_multi_index(index, dst.shape))
    count = int(nbytes) // 4
    with _reduction_lock:
        flat[first : first + count] += src[offset : offset + count]


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


_bind_wait_group(bulk_wait_read, "cp.async.bulk.wait_group.read")


def bulk_wait(pending):
    """``bulk_wait(N)``: wait until at most ``N`` (a constant) of this thread's committed bulk groups are
    incomplete (``cp.async.bulk.wait_group N``): their writes are then done."""


_bind_wait_group(bulk_wait, "cp.async.bulk.wait_group")


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
    """``wgmma_ss_*``, ``wgmma_rs_*`` and ``wgmma_ss_desc_*`` (operands named by descriptors) for one input type."""

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

    def wgmma_rs(acc, n, a0, a1, a2, a3, buf, b_offset, b_panel, b_mn_major, accumulate):
        A = _warp_gather((a0, a1, a2, a3), lambda lanes: _a_matrix(np.array(lanes, dtype=np.uint32), widen_bits))
        row, tig = _warpgroup_position()
        group = row % 16
        with np.errstate(invalid="ignore", over="ignore"):
            rows = A[[group, group + 8]] @ _operand_b(buf, widen_bits, b_offset, n, b_panel, b_mn_major)
            _store_d(acc, rows, tig, accumulate)

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

    for f, name in ((wgmma_ss, "wgmma_ss"), (wgmma_rs, "wgmma_rs"), (wgmma_ss_desc, "wgmma_ss_desc")):
        f.__name__ = f"{name}_{ptx_type}"
    return wgmma_ss, wgmma_rs, wgmma_ss_desc


wgmma_ss_f16, wgmma_rs_f16, wgmma_ss_desc_f16 = _make_wgmma("f16", _widen_f16_bits)
wgmma_ss_bf16, wgmma_rs_bf16, wgmma_ss_desc_bf16 = _make_wgmma("bf16", _widen_bf16_bits)


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


_bind_wait_group(wgmma_wait, "wgmma.wait_group.sync.aligned")


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
    def __init__(self, count):
        self.count = count
        self.pending = count
        self.phases = 0  # completed phases
        self.changed = threading.Condition()

    def arrive(self):
        with self.changed:
            self.pending -= 1
            if self.pending == 0:
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


def cp_async_mbarrier_arrive(bars, index):
    """``cp_async_mbarrier_arrive(bars, i)``: arrive at ``bars[i]`` once this thread's earlier ``cp_async_16`` copies land.

    Emits ``cp.async.mbarrier.arrive.noinc.shared::cta.b64``: the arrival is one of the barrier's ``count``.
    """
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
