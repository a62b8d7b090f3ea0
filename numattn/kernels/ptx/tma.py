"""Tensor copies (TMA, sm_90): a box of a 4-D global array into a shared-memory tile in one instruction.

A tensor map (``CUtensorMap``: 128 bytes that ``kernels/tensor_maps.py`` encodes on the host) describes a
global array ``[batch, heads, rows, cols]`` of 16-bit values and a box of ``box_rows`` rows of 64 columns:
one 128-byte swizzle panel. ``tma_load_box`` copies the box at ``(batch, head, row, col)`` into
``box_rows`` consecutive 128-byte rows of a tile view, with the 128-byte swizzle that wgmma reads
(``tiles.sw128_cell``: chunk ``c`` of view row ``r`` at chunk ``c ^ (r % 8)``, the view 1024-byte
aligned); elements past the array's ends read 0. The copy engine counts the box's bytes against the
transaction count of an mbarrier that ``mbarrier_expect_tx`` announced them to, and the barrier's
phase completes once they have landed: one thread issues a tile's copies, no thread computes an address
per 16 bytes.

Tensor maps reach a kernel in a global ``uint64`` array, one map per row of 16 words; the twins'
maps are keys into ``SIMULATED_TENSOR_MAPS`` (``kernels/tensor_maps.py`` registers them).
"""

from llvmlite import ir
from numba import types
from numba.cuda import cgutils
from numba.cuda.extending import intrinsic
from numba.cuda.np.arrayobj import make_array

from ._core import _asm, _bind, _i32, _i64, _shared_address
from .barriers import _complete_transactions

PANEL_COLUMNS = 64  # 16-bit columns of a box: one 128-byte swizzle panel
SIMULATED_TENSOR_MAPS = {}  # the twins' maps: word 0 of a map → (array [batch, heads, rows, cols], box rows)


def tma_load_box(view, row, maps, map_index, batch, head, first_row, col, bars, index):
    """``tma_load_box(view, row, maps, m, b, h, r, c, bars, i)``: copy the box of tensor map ``maps[m]`` at
    (``b``, ``h``, rows ``r ..``, columns ``c .. c + 64``) into rows ``row ..`` of ``view`` (128-byte rows,
    swizzled), delivering its bytes to ``bars[i]``.

    Emits ``cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes``; one thread
    issues it, after an ``mbarrier_expect_tx`` of the box's bytes on the same barrier.
    """
    array, box_rows = SIMULATED_TENSOR_MAPS[int(maps[map_index, 0])]
    batches, heads, rows, cols = array.shape
    for i in range(box_rows):
        r = first_row + i
        for chunk in range(PANEL_COLUMNS // 8):
            at = (chunk ^ ((row + i) % 8)) * 8
            for e in range(8):
                c = col + 8 * chunk + e
                inside = 0 <= batch < batches and 0 <= head < heads and 0 <= r < rows and 0 <= c < cols
                view[row + i, at + e] = array[batch, head, r, c] if inside else 0
    _complete_transactions(bars, index, box_rows * PANEL_COLUMNS * view.itemsize)


@intrinsic
def _tma_load_box(typingctx, view, row, maps, map_index, batch, head, first_row, col, bars, index):
    if not (isinstance(view, types.Array) and isinstance(maps, types.Array) and isinstance(bars, types.Array)):
        return None
    signature = types.none(view, row, maps, map_index, batch, head, first_row, col, bars, index)

    def codegen(context, builder, sig, args):
        view_t, row_t, maps_t, map_t, b_t, h_t, r_t, c_t, bars_t, index_t = sig.args
        view_v, row_v, maps_v, map_v, b_v, h_v, r_v, c_v, bars_v, index_v = args
        dst = _shared_address(context, builder, view_t, view_v, (row_v, row_t), (ir.Constant(_i32, 0), types.int32))
        maps_array = make_array(maps_t)(context, builder, maps_v)
        word0 = cgutils.get_item_pointer(context, builder, maps_t, maps_array,
                                         [context.cast(builder, map_v, map_t, types.intp),
                                          context.get_constant(types.intp, 0)])
        bar = _shared_address(context, builder, bars_t, bars_v, (index_v, index_t))
        coords = [context.cast(builder, v, t, types.int32) for v, t in ((c_v, c_t), (r_v, r_t), (h_v, h_t), (b_v, b_t))]
        _asm(builder, "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                      "[$0], [$1, {$2, $3, $4, $5}], [$6];",
             "r,l,r,r,r,r,r,~{memory}", ir.VoidType(), [dst, builder.ptrtoint(word0, _i64), *coords, bar],
             side_effect=True)
        return context.get_dummy_value()

    return signature, codegen


_bind(tma_load_box, _tma_load_box)
