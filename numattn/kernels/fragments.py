"""The operand fragments of ``mma.sync`` m16n8k16, loaded from 16-bit shared tiles with ``ldmatrix_x4``:
where each lane points for each kind of operand, so that kernels name the operand instead of the
addressing. ``ldmatrix_x4`` reads four 8×8 matrices; lane ``l`` gives the address of row ``mrow = l % 8``
of matrix ``mat = l // 8`` (``ldmatrix_lane(lane)``, computed once per kernel). ``swizzled``: the tile's
rows are laid out as ``tiles.swizzled_rows`` (16-byte chunks permuted by the row), else plainly.

- ``load_a(tile, row0, col0, mat, mrow, swizzled)``: the A fragment of the m16 × k16 block at
  ``tile[row0, col0]`` (rows are M, columns K).
- ``load_b(tile, n0, k0, mat, mrow, swizzled)``: the B fragments of two n8 tiles (N ``n0 .. n0 + 16``, K
  ``k0 .. k0 + 16``) from a tile whose rows are N (K in the columns, as K rows are for ``S = Q Kᵀ``): the
  first two registers are the first n8 tile's, the last two the second's.
- ``load_b_trans(tile, k0, n0, mat, mrow, swizzled)``: the same from a tile whose rows are K (as V rows are
  for ``P V``).
- ``load_a_trans(tile, k0, row0, mat, mrow)``: the A fragment of the m16 × k16 block whose M rows are the
  tile's columns ``row0 ..`` and whose K is its rows ``k0 ..`` (A read transposed, as the backward reads
  dS from dSᵀ).
"""

from .._cuda import cuda
from .ptx import ldmatrix_x4, ldmatrix_x4_trans
from .tiles import tile_col


@cuda.jit(device=True, forceinline=True)
def ldmatrix_lane(lane):
    """``(mat, mrow)``: the 8×8 matrix and its row whose address lane ``lane`` gives to ``ldmatrix_x4``."""
    return lane // 8, lane % 8


@cuda.jit(device=True, forceinline=True)
def load_a(tile, row0, col0, mat, mrow, swizzled):
    row = row0 + mrow + 8 * (mat % 2)
    return ldmatrix_x4(tile, row, tile_col(swizzled, row, col0 + 8 * (mat // 2)))


@cuda.jit(device=True, forceinline=True)
def load_b(tile, n0, k0, mat, mrow, swizzled):
    row = n0 + mrow + 8 * (mat // 2)
    return ldmatrix_x4(tile, row, tile_col(swizzled, row, k0 + 8 * (mat % 2)))


@cuda.jit(device=True, forceinline=True)
def load_b_trans(tile, k0, n0, mat, mrow, swizzled):
    row = k0 + mrow + 8 * (mat % 2)
    return ldmatrix_x4_trans(tile, row, tile_col(swizzled, row, n0 + 8 * (mat // 2)))


@cuda.jit(device=True, forceinline=True)
def load_a_trans(tile, k0, row0, mat, mrow):
    return ldmatrix_x4_trans(tile, k0 + 8 * (mat // 2) + mrow, row0 + 8 * (mat % 2))
