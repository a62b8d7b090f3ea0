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

The primitives are grouped by instruction family: ``convert`` (fp32 and 16-bit conversions,
packing), ``warp`` (ex2, shuffles, ballot), ``mma`` (``mma.sync``, ``ldmatrix``, ``stmatrix``),
``copies`` (``cp.async``, global loads, bulk reductions, shared stores), ``wgmma`` (warpgroup
multiply-accumulate and its fences), ``tma`` (tensor copies), ``barriers`` (mbarriers, named barriers), ``cluster`` (the
cluster barrier, loads from another block's shared memory); ``_core`` holds what they share. Every public name is importable from ``numattn.kernels.ptx``.
"""

from ._core import WARP_SIZE  # noqa: F401
from .barriers import (  # noqa: F401
    barrier_arrive,
    barrier_sync,
    cp_async_mbarrier_arrive,
    mbarrier_arrive,
    mbarrier_expect_tx,
    mbarrier_init,
    mbarrier_try_wait,
    mbarrier_wait,
)
from .cluster import cluster_sync, ld_cluster_f32, ld_cluster_f32x4  # noqa: F401
from .convert import (  # noqa: F401
    cvt_f32_bf16,
    cvt_f32_f16,
    cvt_rn_bf16_f32,
    cvt_rn_f16_f32,
    pack_bf16x2,
    pack_f16x2,
    unpack_bf16x2,
    unpack_f16x2,
)
from .copies import (  # noqa: F401
    bulk_commit,
    bulk_reduce_add_f32,
    bulk_wait,
    bulk_wait_read,
    copy_16_to_global,
    cp_async_4,
    cp_async_16,
    cp_async_16_at,
    cp_async_commit,
    cp_async_wait_group,
    f32_from_bits,
    global_address,
    ld_shared_v2_f32,
    load_16,
    load_l2_f32,
    load_l2_f32x4,
    load_readonly_i32,
    st_global_b32_at,
    st_shared_b32,
    st_shared_v2_f32,
    store_16,
)
from .mma import (  # noqa: F401
    ldmatrix_x4,
    ldmatrix_x4_trans,
    mma_m16n8k16_bf16,
    mma_m16n8k16_f16,
    stmatrix_x4,
    stmatrix_x4_trans,
)
from .tma import PANEL_COLUMNS, tma_load_box  # noqa: F401
from .warp import (  # noqa: F401
    ballot,
    broadcast_i32,
    ex2_approx,
    rcp_approx,
    shfl_xor_f32,
    syncwarp,
)
from .wgmma import (  # noqa: F401
    SW128_ALIGN,
    aligned_start,
    fence_proxy_async,
    fence_registers,
    forget_registers,
    grow_registers,
    opaque,
    shrink_registers,
    wgmma_commit,
    wgmma_descriptor,
    wgmma_fence,
    wgmma_rs_bf16,
    wgmma_rs_desc_bf16,
    wgmma_rs_desc_f16,
    wgmma_rs_f16,
    wgmma_ss_bf16,
    wgmma_ss_desc_bf16,
    wgmma_ss_desc_f16,
    wgmma_ss_f16,
    wgmma_wait,
)
