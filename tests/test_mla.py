"""numattn.mla_decode against the float64 reference (simulator on CPU, GPU kernels on a GPU), its
configuration space per GPU architecture, and its errors."""

import numpy as np
import pytest
import torch

import numattn
from numattn import reference
from numattn.configs.mla import SHARED_LIMITS, MlaConfig, mla_candidates, mla_default_config, mla_shared_bytes
from numattn.ops import mla as module

from conftest import ATOL
from helpers import as_dtype, max_error

pytestmark = pytest.mark.sim


def _inputs(rng, batch, heads, rank, rope, page_size, max_pages, dtype, library="numpy", device=None):
    """Random queries and latent pages, a shuffled page table and lengths including 0 and the capacity."""
    num_pages = batch * max_pages + 3
    shapes = [(batch, heads, rank), (batch, heads, rope), (num_pages, page_size, rank), (num_pages, page_size, rope)]
    arrays = as_dtype([rng.standard_normal(s, dtype=np.float32) for s in shapes], dtype, library)
    table = rng.permutation(num_pages)[: batch * max_pages].reshape(batch, max_pages).astype(np.int32)
    lengths = rng.integers(1, max_pages * page_size + 1, size=batch).astype(np.int32)
    lengths[0], lengths[-1] = max_pages * page_size, 0 if batch > 2 else lengths[-1]
    if library == "torch":
        arrays = [a.to(device) for a in arrays]
        table, lengths = (torch.from_numpy(x).to(device) for x in (table, lengths))
    return (*arrays, table, lengths)


def _assert_lse_matches(lse, ref_lse, tol):
    """The kernel's LSE against float64: infinite exactly where the reference is (rows that see no
    key), within ``tol`` elsewhere; returns the reference's finite mask."""
    lse = reference.to_float64(lse)
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite)
    assert np.abs(lse[finite] - ref_lse[finite]).max() <= tol
    return finite


def _run_plan(args, config, splits, scale, return_lse):
    """mla_decode through an explicit configuration and split count (the host plan)."""
    p = module.validate(*args, scale, return_lse)
    plan = module._HostPlan(p, config, splits) if p.device is None else module._TorchPlan(p, config, splits)
    return plan(*args)


@pytest.mark.parametrize(
    "rank, rope, heads, page_size, config, splits, dtype",
    [
        (64, 16, 16, 8, MlaConfig(16, 2, 4, "duplicated"), 1, "float16"),
        (64, 0, 8, 1, MlaConfig(16, 3, 4, "sharded"), 2, "bfloat16"),  # no rope part, pages of one row
        (128, 64, 20, 5, MlaConfig(16, 2, 4, "sharded"), 3, "float16"),  # two head chunks, the second partial
        (64, 16, 16, 3, MlaConfig(16, 2, 2, "duplicated"), 2, "bfloat16"),
        # the sm_90 wgmma kernel: 64-head blocks (20 heads: most rows padding), pages refilled in turn
        (128, 64, 20, 3, MlaConfig(32, 2, 8, "duplicated", True), 1, "float16"),
        (128, 0, 70, 1, MlaConfig(16, 3, 8, "duplicated", True), 1, "bfloat16"),  # two head blocks
        (256, 16, 24, 2, MlaConfig(32, 3, 8, "shared", True), 2, "float16"),  # P handed over in shared memory
        # pages longer than a tile: splits start inside a page, each thread's page-table walk wraps mid-tile
        (128, 16, 20, 40, MlaConfig(32, 2, 8, "shared", True), 3, "bfloat16"),
    ],
)
def test_mla_decode_matches_reference(rng, rank, rope, heads, page_size, config, splits, dtype):
    max_pages = 24 if page_size == 1 else 12 if page_size < 32 else 2
    args = _inputs(rng, 3 if page_size > 1 else 2, heads, rank, rope, page_size, max_pages, dtype)
    o, lse = _run_plan(args, config, splits, 0.09, True)
    ref_o, ref_lse = reference.mla_decode(*args, scale=0.09, return_lse=True)
    assert max_error(o, ref_o, dtype) <= ATOL[dtype]
    _assert_lse_matches(lse, ref_lse, 1e-3)


@pytest.mark.parametrize("blocks, heads, page_size, rope, block_n", [(1, 20, 3, 16, 32), (2, 32, 5, 0, 64)])
def test_mla_persistent_kernel_takes_items_in_turn(rng, blocks, heads, page_size, rope, block_n):
    """The persistent wgmma kernel on ``blocks`` blocks: one block taking every sequence, or two taking
    alternate ones; empty sequences first, between and last, so that the copy stream and the Q loads
    skip items and the Q halves alternate over items with keys only; pages not dividing a tile; items of
    one tile and of several; 32- and 64-row tiles, with and without rope columns."""
    pages = 200 // page_size
    args = _inputs(rng, 6, heads, 128, rope, page_size, pages, "bfloat16")
    args[5][:] = (0, args[5][1], 0, pages * page_size, 7, 0)  # 7: one tile, part of it
    p = module.validate(*args, 0.11, True)
    plan = module._HostPlan(p, MlaConfig(block_n, 2, 8, "shared", True, True), 1)
    assert plan.persistent
    plan.grid = (blocks,)
    o, lse = plan(*args)
    ref_o, ref_lse = reference.mla_decode(*args, scale=0.11, return_lse=True)
    assert max_error(o, ref_o, "bfloat16") <= ATOL["bfloat16"]
    _assert_lse_matches(lse, ref_lse, 1e-3)


def test_mla_persistent_grid_and_fallback():
    """A persistent configuration plans a 1-D grid of at most one block per sequence and per SM slot;
    with key splits or more than 32 heads it runs the ordinary kernel; only the wgmma shared schedule
    may be persistent."""
    config = MlaConfig(32, 2, 8, "shared", True, True)
    for batch, expected in ((1, (1,)), (3, (2,))):  # the simulator's one SM holds 2 blocks
        args = _inputs(np.random.default_rng(1), batch, 32, 128, 16, 4, 4, "float16")
        assert module._HostPlan(module.validate(*args, 0.1, False), config, 1).grid == expected
    args = _inputs(np.random.default_rng(1), 3, 33, 128, 16, 4, 4, "float16")
    p = module.validate(*args, 0.1, False)
    unsplit = module._HostPlan(p, config, 1)
    assert unsplit.grid == (1, 1, 3) and not unsplit.persistent
    assert module._HostPlan(p, config, 3).grid == (3, 1, 3)
    with pytest.raises(ValueError, match="persistent"):
        module._HostPlan(p, MlaConfig(32, 2, 8, "duplicated", True, True), 1)


def test_mla_default_tile_follows_the_key_splits():
    """On sm_90 the default takes 64-row tiles where four stages of them fit (R + P <= 320) and the
    keys are not split, 32-row tiles otherwise (both measured on an H100)."""
    for rank, rope, wide in ((256, 64, True), (128, 16, True), (512, 64, False), (512, 0, False)):
        assert mla_default_config(rank, rope, (9, 0)).block_n == (64 if wide else 32)
        assert mla_default_config(rank, rope, (9, 0), split=True).block_n == 32
    args = _inputs(np.random.default_rng(1), 3, 16, 256, 64, 4, 4, "float16")
    p = module.validate(*args, 0.1, False)
    assert module._HostPlan(p).config == MlaConfig(64, 4, 8, "shared", True, True)
    assert module._HostPlan(p, splits=2).config == MlaConfig(32, 4, 8, "shared", True, True)


def test_mla_decode_public_call(rng):
    """The public function with the default configuration and splits, lse off, torch CPU tensors in and out."""
    args = _inputs(rng, 2, 16, 64, 16, 4, 6, "float16", library="torch", device="cpu")
    o = numattn.mla_decode(*args, scale=0.125)
    assert isinstance(o, torch.Tensor) and o.dtype == torch.float16 and o.shape == (2, 16, 64)
    assert max_error(o, reference.mla_decode(*args, scale=0.125), "float16") <= ATOL["float16"]


@pytest.mark.parametrize("library, rope", [("numpy", 16), ("torch", 0)])
def test_mla_decode_in_float32(rng, library, rope):
    """float32 (the test path through the decode kernel) at DeepSeek's rank, numpy and torch CPU, with LSE."""
    args = _inputs(rng, 3, 5, 512, rope, 3, 6, "float32", library=library, device="cpu")
    o, lse = numattn.mla_decode(*args, scale=0.05, return_lse=True)
    assert type(o) is type(args[0]) and o.dtype == args[0].dtype and tuple(o.shape) == (3, 5, 512)
    assert tuple(lse.shape) == (3, 5)
    ref_o, ref_lse = reference.mla_decode(*args, scale=0.05, return_lse=True)
    assert max_error(o, ref_o) <= ATOL["float32"]
    assert not _assert_lse_matches(lse, ref_lse, 1e-4)[-1].any()  # the last sequence is empty


@pytest.mark.parametrize("rank, rope", [(512, 64), (256, 64), (512, 0)])
@pytest.mark.parametrize("cc", [(8, 0), (8, 6), (8, 9), (9, 0)])
def test_mla_configurations_fit_each_architecture(rank, rope, cc):
    candidates = mla_candidates(rank, rope, cc)
    assert candidates, f"no configuration for sm_{cc[0]}{cc[1]}"
    for config in candidates:
        assert mla_shared_bytes(config, rank, rope) <= SHARED_LIMITS[cc]
        assert rank % (16 * config.warps) == 0
    assert mla_default_config(rank, rope, cc) in candidates
    # the architectures' limits shape the space: sm_86/89 (99 KB) cannot hold sm_90's largest rings
    if cc in ((8, 6), (8, 9)):
        largest = max(mla_candidates(rank, rope, (9, 0)), key=lambda c: mla_shared_bytes(c, rank, rope))
        assert largest not in candidates
    if (rank, rope) == (512, 64):  # both score schedules of each kernel
        assert {c.qk for c in candidates if not c.wgmma} == {"duplicated", "sharded"}
        assert {c.qk for c in candidates if c.wgmma} == ({"duplicated", "shared"} if cc == (9, 0) else set())
    # the wgmma kernel is offered (and chosen) on sm_90 only
    assert any(c.wgmma for c in candidates) == (cc == (9, 0))
    assert mla_default_config(rank, rope, cc).wgmma == (cc == (9, 0))
    assert not mla_default_config(rank, rope, cc).persistent  # the persistent grid is a tuning candidate
    # given at most 32 heads, the sm_90 default runs the persistent grid (measured faster there)
    assert mla_default_config(rank, rope, cc, heads=32).persistent == (cc == (9, 0))
    assert not mla_default_config(rank, rope, cc, heads=33).persistent


def test_mla_bad_input_errors(rng):
    qn, qp, ckv, kpe, table, lengths = _inputs(rng, 2, 16, 64, 16, 4, 4, "float16")
    with pytest.raises(ValueError, match="kv_lora_rank 64"):
        numattn.mla_decode(qn, qp, ckv[:, :, :48], kpe, table, lengths, scale=0.1)
    with pytest.raises(ValueError, match="rope dim 16"):
        numattn.mla_decode(qn, qp, ckv, np.zeros((ckv.shape[0], 4, 32), np.float16), table, lengths, scale=0.1)
    with pytest.raises(ValueError, match="q_pe must be"):
        numattn.mla_decode(qn, qp[:1], ckv, kpe, table, lengths, scale=0.1)
    with pytest.raises(TypeError, match="must share one dtype"):
        numattn.mla_decode(qn.astype(np.float32), qp, ckv, kpe, table, lengths, scale=0.1)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        numattn.mla_decode(qn.astype(np.float64), qp, ckv, kpe, table, lengths, scale=0.1)
    with pytest.raises(TypeError, match="scale is required"):
        numattn.mla_decode(qn, qp, ckv, kpe, table, lengths, scale=None)
    with pytest.raises(ValueError, match="multiple of 16"):
        numattn.mla_decode(qn[..., :40], qp, ckv[..., :40], kpe, table, lengths, scale=0.1)
    with pytest.raises(TypeError, match="page_table must have dtype int32"):
        numattn.mla_decode(qn, qp, ckv, kpe, table.astype(np.int64), lengths, scale=0.1)
    with pytest.raises(ValueError, match="exceeds max_pages"):
        numattn.mla_decode(qn, qp, ckv, kpe, table, np.array([17, 1], np.int32), scale=0.1)
    with pytest.raises(ValueError, match="non-negative"):
        numattn.mla_decode(qn, qp, ckv, kpe, table, np.array([-1, 1], np.int32), scale=0.1)
    bad_table = table.copy()
    bad_table[1, 0] = ckv.shape[0]
    with pytest.raises(ValueError, match=r"page_table\[1, 0\]"):
        numattn.mla_decode(qn, qp, ckv, kpe, bad_table, np.array([3, 2], np.int32), scale=0.1)
    with pytest.raises(ValueError, match="configuration"):
        _run_plan((qn, qp, ckv, kpe, table, lengths), MlaConfig(16, 2, 8, "sharded"), 1, 0.1, False)
    with pytest.raises(ValueError, match="multiples of 128"):
        _run_plan((qn, qp, ckv, kpe, table, lengths), MlaConfig(64, 2, 8, "duplicated", True), 1, 0.1, False)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "config",
    [
        MlaConfig(16, 4, 8, "duplicated"),
        MlaConfig(16, 4, 8, "sharded"),
        MlaConfig(32, 4, 8, "shared", True),
        MlaConfig(32, 3, 8, "duplicated", True),
        MlaConfig(64, 2, 8, "duplicated", True),
    ],
)
@pytest.mark.parametrize("page_size", [1, 16])
def test_mla_decode_on_gpu_deepseek_sizes(rng, config, page_size):
    if config.wgmma and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma kernel needs sm_90")
    args = _inputs(rng, 4, 80, 512, 64, page_size, 600 // page_size + 1, "bfloat16", library="torch", device="cuda")
    for splits in (1, 4):
        o, lse = _run_plan(args, config, splits, 0.07, True)
        ref_o, ref_lse = reference.mla_decode(*args, scale=0.07, return_lse=True)
        assert max_error(o, ref_o, "bfloat16") <= ATOL["bfloat16"]
    assert max_error(numattn.mla_decode(*args, scale=0.07), ref_o, "bfloat16") <= ATOL["bfloat16"]


@pytest.mark.gpu
def test_mla_persistent_kernel_on_gpu(rng):
    """The persistent wgmma kernel at DeepSeek's sizes with more sequences than blocks: 600 sequences of
    32 heads over one block per SM, random lengths with empty sequences, pages of 16 and of 1."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma kernel needs sm_90")
    for page_size in (16, 1):
        args = _inputs(rng, 600, 32, 512, 64, page_size, 160 // page_size, "bfloat16", library="torch", device="cuda")
        args[5][7::41] = 0
        p = module.validate(*args, 0.07, True)
        plan = module._TorchPlan(p, MlaConfig(32, 4, 8, "shared", True, True), 1)
        assert plan.persistent and len(plan.grid) == 1 and plan.grid[0] < 600
        ref_o, ref_lse = reference.mla_decode(*args, scale=0.07, return_lse=True)
        for _ in range(2):
            o, lse = plan(*args)
            assert max_error(o, ref_o, "bfloat16") <= ATOL["bfloat16"]
            _assert_lse_matches(lse, ref_lse, 1e-3)
    # with 16 heads the public call's default runs the persistent grid
    args = _inputs(rng, 300, 16, 512, 64, 1, 160, "float16", library="torch", device="cuda")
    plan = module._TorchPlan(module.validate(*args, 0.07, False))
    assert plan.config.persistent and len(plan.grid) == 1
    assert (max_error(numattn.mla_decode(*args, scale=0.07), reference.mla_decode(*args, scale=0.07), "float16")
            <= ATOL["float16"])


@pytest.mark.gpu
def test_mla_decode_float32_on_gpu(rng):
    """float32 on the GPU (the decode kernel over the concatenated keys), DeepSeek's sizes, with LSE."""
    args = _inputs(rng, 4, 16, 512, 64, 16, 40, "float32", library="torch", device="cuda")
    o, lse = numattn.mla_decode(*args, scale=0.07, return_lse=True)
    assert o.is_cuda and o.dtype == torch.float32
    ref_o, ref_lse = reference.mla_decode(*args, scale=0.07, return_lse=True)
    assert max_error(o, ref_o) <= ATOL["float32"]
    _assert_lse_matches(lse, ref_lse, 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 4])
def test_mla_decode_on_every_kind_of_array(rng, splits):
    """torch tensors, numba device arrays (any ``__cuda_array_interface__``) and host arrays run the same
    launches: the same bits, with and without key splits (each kind's split workspace)."""
    from numba import cuda

    args = _inputs(rng, 6, 32, 512, 64, 16, 20, "float16", library="torch", device="cuda")
    p = module.validate(*args, 0.07, True)
    want_o, want_lse = module._TorchPlan(p, None, splits)(*args)
    device_arrays = [cuda.to_device(x.cpu().numpy()) for x in args]
    o, lse = module._DevicePlan(module.validate(*device_arrays, 0.07, True), None, splits)(*device_arrays)
    bits = want_o.cpu().numpy().view(np.uint16)
    assert np.array_equal(o.copy_to_host().view(np.uint16), bits)
    assert np.array_equal(lse.copy_to_host(), want_lse.cpu().numpy())
    host = [x.cpu().numpy() for x in args]
    o, lse = module._HostPlan(module.validate(*host, 0.07, True), None, splits)(*host)
    assert np.array_equal(o.view(np.uint16), bits) and np.array_equal(lse, want_lse.cpu().numpy())
    if splits is None:  # the public call takes device arrays of other libraries too
        assert np.array_equal(numattn.mla_decode(*device_arrays, scale=0.07).copy_to_host().view(np.uint16), bits)
