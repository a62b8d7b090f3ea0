"""Kernel primitives: simulator twins against independent references; PTX of the compiled kernels."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import numattn
from numattn.kernels.ptx import cvt_f32_bf16, cvt_f32_f16, cvt_rn_bf16_f32, cvt_rn_f16_f32, global_address
from numattn.kernels.tiles import ring_after, ring_next, row_of_batch, sw128_cell, tile_copier, tile_view

ALL_BITS = np.arange(1 << 16, dtype=np.uint16)


def _same_floats(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return np.array_equal(a, b) or np.array_equal(np.isnan(a), np.isnan(b)) and np.array_equal(
        a[~np.isnan(a)], b[~np.isnan(b)]
    )


@pytest.mark.sim
def test_cvt_f32_f16_every_pattern():
    widened = [cvt_f32_f16(b) for b in ALL_BITS]
    assert _same_floats(widened, ALL_BITS.view(np.float16).astype(np.float32))


@pytest.mark.sim
def test_cvt_f32_bf16_every_pattern():
    widened = [cvt_f32_bf16(b) for b in ALL_BITS]
    expected = torch.from_numpy(ALL_BITS.view(np.int16)).view(torch.bfloat16).float().numpy()
    assert _same_floats(widened, expected)


def _narrowing_inputs(rng):
    special = np.array([0.0, -0.0, 1.0, -2.5, 65504.0, 65520.0, 1e6, -1e6, 6e-8, 1e-40, np.inf, -np.inf, np.nan])
    ties = (np.arange(1, 200, dtype=np.float32) * np.float32(2.0**-10) + np.float32(2.0**-11)).astype(np.float32)
    return np.concatenate([special.astype(np.float32), ties, rng.standard_normal(2000).astype(np.float32) * 100])


@pytest.mark.sim
def test_cvt_rn_f16_f32(rng):
    x = _narrowing_inputs(rng)
    narrowed = np.array([cvt_rn_f16_f32(v) for v in x], dtype=np.uint16)
    with np.errstate(over="ignore"):
        assert _same_floats(narrowed.view(np.float16), x.astype(np.float16))
    assert np.all(narrowed[np.isnan(x)] == 0x7FFF)


@pytest.mark.sim
def test_cvt_rn_bf16_f32(rng):
    x = _narrowing_inputs(rng)
    narrowed = np.array([cvt_rn_bf16_f32(v) for v in x], dtype=np.uint16)
    expected = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    finite = ~np.isnan(x)
    assert np.array_equal(narrowed[finite], expected[finite])
    assert np.all(narrowed[~finite] == 0x7FFF)


@pytest.mark.sim
def test_tile_view_twin():
    buf = np.arange(40, dtype=np.float32)
    tile = tile_view(buf, 6, 3, 5)
    assert tile.shape == (3, 5) and tile[2, 4] == 6 + 2 * 5 + 4
    tile[0, 0] = -1
    assert buf[6] == -1  # a view, not a copy


@pytest.mark.sim
def test_ring_after_is_ring_next_taken_steps_times():
    for slots in (1, 2, 3, 4):
        for slot in range(slots):
            for parity in (0, 1):
                expected = (slot, parity)
                for steps in range(3 * slots + 2):
                    assert ring_after(slot, parity, steps, slots) == expected, (slots, slot, parity, steps)
                    expected = ring_next(*expected, slots)


def test_tile_copier_is_made_once_for_the_same_arguments():
    """A kernel asking for the same copier with its defaults left out, or passed by keyword, gets the very
    device function it got before (numba types and lowers each device function object apart: a second one
    is a second compile of the same code)."""
    copier = tile_copier(128, sw128_cell, stepping=True, first_thread=256)
    assert tile_copier(128, sw128_cell, row_of_batch, True, 256) is copier
    assert tile_copier(128, sw128_cell, source=row_of_batch, stepping=True, first_thread=256) is copier
    assert tile_copier(128, sw128_cell) is tile_copier(128, sw128_cell, row_of_batch, False, 0)
    assert tile_copier(128, sw128_cell, stepping=False) is not copier


@pytest.mark.sim
def test_global_address_twin_steps_along_any_axis():
    """The twin of a global address finds the element that the same byte offset reaches in memory, along any
    axis of a (batch, heads, rows, dim) view of a (batch, rows, heads, dim) tensor: rows on, elements on, and
    one head past the last head of a row, which is the first head of the next row."""
    base = np.arange(2 * 5 * 3 * 8, dtype=np.uint16).reshape(2, 5, 3, 8)
    view = base.transpose(0, 2, 1, 3)  # (batch 2, heads 3, rows 5, dim 8)
    address = global_address(view, (1, 2, 1, 4))
    assert (address + 3 * view.strides[2]).index == (1, 2, 4, 4)
    assert (address + 2 * view.itemsize).index == (1, 2, 1, 6)
    assert (address + view.strides[1]).index == (1, 0, 2, 4)  # base[1, 2, 0, 4]: row 2, head 0


@pytest.mark.ptx
def test_kernel_ptx_has_no_local_memory_or_fp64():
    """Compile the kernel variants to PTX (no GPU needed) and inspect the code."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    script = Path(__file__).with_name("ptx_report.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)
    assert len(results) == 48
    for variant, facts in results.items():
        mnemonics = set(facts["mnemonics"])
        assert facts["f64_ops"] == 0, (variant, facts)
        if variant.startswith("split"):
            # the last block takes a ticket and sets the counter back to 0 for the next launch (a plain
            # store there was once dropped by numba's dead-code elimination: every later launch skipped
            # its merge)
            assert {"atom.add.u32", "atom.exch.b32"} <= set(facts["atomics"]), (variant, facts)
            continue
        assert facts["local_bytes"] == 0 and facts["local_ops"] == 0, (variant, facts)
        if variant == "cluster-mma-attention":  # no tickets: the blocks meet at cluster barriers
            assert not facts["atomics"], (variant, facts)
            assert {"barrier.cluster.arrive.release.aligned", "barrier.cluster.wait.acquire.aligned",
                    "mapa.shared::cluster.u32", "ld.shared::cluster.f32", "ld.shared::cluster.v4.f32"} <= mnemonics
        if variant.startswith("paged-decode-mma"):
            assert {"cp.async.ca.shared.global", "cp.async.cg.shared.global"} <= mnemonics, (variant, facts)
        if variant.startswith("simt"):
            assert "ex2.approx.f32" in mnemonics, (variant, facts)
        if variant.startswith("simt-bfloat16"):
            assert "cvt.rn.bf16.f32" in mnemonics, (variant, facts)
        if variant.startswith("simt-float16"):
            assert {"cvt.f32.f16", "cvt.rn.f16.f32"} <= mnemonics, (variant, facts)
        if variant.startswith("mma"):
            ptx_type = "bf16" if "bfloat16" in variant else "f16"
            assert {
                f"mma.sync.aligned.m16n8k16.row.col.f32.{ptx_type}.{ptx_type}.f32",
                "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
                "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
                "cp.async.cg.shared.global",
                "cp.async.wait_group",
                "ex2.approx.ftz.f32",
                f"cvt.rn.{ptx_type}x2.f32",
            } <= mnemonics, (variant, facts)
        if variant.startswith("wgmma"):
            ptx_type = "bf16" if "bfloat16" in variant else "f16"
            products = {m for m in mnemonics if m.startswith("wgmma.mma_async.sync.aligned.m64n")}
            assert products and all(m.endswith(f"k16.f32.{ptx_type}.{ptx_type}") for m in products), (variant, facts)
            assert {
                "wgmma.fence.sync.aligned",
                "wgmma.commit_group.sync.aligned",
                "wgmma.wait_group.sync.aligned",
                "mbarrier.try_wait.parity.shared::cta.b64",
                "fence.proxy.async.shared::cta",
            } <= mnemonics, (variant, facts)
            copies_by_threads = "cp.async.mbarrier.arrive.noinc.shared::cta.b64" in mnemonics
            assert copies_by_threads != variant.endswith("-tensor-copies"), (variant, facts)
            if variant.endswith(("-d128", "-sections", "-tensor-copies")):  # a producer hands its registers over
                assert {"setmaxnreg.inc.sync.aligned.u32", "setmaxnreg.dec.sync.aligned.u32"} <= mnemonics, variant
            tensor_copies = {"cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes",
                             "mbarrier.expect_tx.relaxed.cta.shared::cta.b64"}
            assert (tensor_copies <= mnemonics) == variant.endswith("-tensor-copies"), (variant, facts)
        if variant.startswith("backward-wgmma"):  # with a producer: copies and dQ tiles handed over by mbarriers
            assert {"wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16",
                    "cp.async.mbarrier.arrive.noinc.shared::cta.b64", "mbarrier.try_wait.parity.shared::cta.b64",
                    "setmaxnreg.inc.sync.aligned.u32", "setmaxnreg.dec.sync.aligned.u32"} <= mnemonics, (variant, facts)
            tensor_copies = {"cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes",
                             "mbarrier.expect_tx.relaxed.cta.shared::cta.b64"}  # Q and dO tiles, packed too
            assert tensor_copies <= mnemonics, (variant, facts)


@pytest.mark.gpu
def test_conversions_on_gpu_match_twins(rng):
    """The inline-PTX / IR lowerings give bit-identical results to the simulator twins."""
    from numba import cuda

    @cuda.jit
    def convert(bits, floats, f16_wide, bf16_wide, f16_narrow, bf16_narrow):
        i = cuda.grid(1)
        if i < bits.size:
            f16_wide[i] = cvt_f32_f16(bits[i])
            bf16_wide[i] = cvt_f32_bf16(bits[i])
        if i < floats.size:
            f16_narrow[i] = cvt_rn_f16_f32(floats[i])
            bf16_narrow[i] = cvt_rn_bf16_f32(floats[i])

    floats = _narrowing_inputs(rng)
    outs = [np.empty(ALL_BITS.size, np.float32), np.empty(ALL_BITS.size, np.float32)]
    outs += [np.empty(floats.size, np.uint16), np.empty(floats.size, np.uint16)]
    convert[ALL_BITS.size // 256, 256](ALL_BITS, floats, *outs)
    assert _same_floats(outs[0], [cvt_f32_f16(b) for b in ALL_BITS])
    assert _same_floats(outs[1], [cvt_f32_bf16(b) for b in ALL_BITS])
    for gpu, twin in ((outs[2], cvt_rn_f16_f32), (outs[3], cvt_rn_bf16_f32)):
        expected = np.array([twin(x) for x in floats], dtype=np.uint16)
        bad = np.flatnonzero(gpu != expected)
        assert bad.size == 0, [(floats[i], hex(gpu[i]), hex(expected[i])) for i in bad[:8]]


def _bits(m, bf16):
    """16-bit bit patterns of float32 ``m`` rounded to bf16 or fp16."""
    if bf16:
        return torch.from_numpy(m).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return m.astype(np.float16).view(np.uint16)


def _floats(bits, bf16):
    """float64 values of 16-bit bit patterns."""
    if bf16:
        return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).double().numpy()
    return bits.view(np.float16).astype(np.float64)


def _run_mma_kernel(rng, bf16):
    from warp_kernels import SHARED_BYTES, make_mma_kernel

    a = rng.standard_normal((16, 16)).astype(np.float32)
    b = rng.standard_normal((16, 16)).astype(np.float32)
    a_bits, b_bits = _bits(a, bf16), _bits(b, bf16)
    d_bt = np.full((16, 16), np.nan, np.float32)
    d_b = np.full((16, 16), np.nan, np.float32)
    from numba import cuda

    args = [cuda.to_device(x) for x in (a_bits, np.ascontiguousarray(b_bits.T), b_bits, d_bt, d_b)]
    make_mma_kernel(bf16)[1, 32, 0, SHARED_BYTES](*args)
    expected = _floats(a_bits, bf16) @ _floats(b_bits, bf16)
    return args[3].copy_to_host(), args[4].copy_to_host(), expected


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("where", [pytest.param("sim", marks=pytest.mark.sim), pytest.param("gpu", marks=pytest.mark.gpu)])
def test_ldmatrix_mma_fragments(rng, bf16, where):
    """cp.async → ldmatrix (plain and .trans) → mma reproduces A·B: the fragment layouts agree."""
    if (where == "sim") != numattn.SIMULATOR:
        pytest.skip(f"runs on the {where} target")
    d_from_bt, d_from_b, expected = _run_mma_kernel(rng, bf16)
    np.testing.assert_allclose(d_from_bt, expected, rtol=0, atol=1e-4)
    np.testing.assert_allclose(d_from_b, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("where", [pytest.param("sim", marks=pytest.mark.sim), pytest.param("gpu", marks=pytest.mark.gpu)])
def test_stmatrix_inverts_the_fragment_layout(rng, where):
    """ldmatrix fragments stored back with stmatrix .trans, each 8×8 block addressed at its mirror: Aᵀ;
    with plain stmatrix, each block at its own place: A."""
    if (where == "sim") != numattn.SIMULATOR:
        pytest.skip(f"runs on the {where} target")
    if where == "gpu" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("stmatrix needs sm_90")
    from numba import cuda

    from warp_kernels import SHARED_BYTES, transpose_kernel

    a = rng.integers(0, 1 << 16, size=(16, 16), dtype=np.uint16)
    out, copy = (cuda.to_device(np.zeros((16, 16), np.uint16)) for _ in range(2))
    transpose_kernel[1, 32, 0, SHARED_BYTES](cuda.to_device(a), out, copy)
    np.testing.assert_array_equal(out.copy_to_host(), a.T)
    np.testing.assert_array_equal(copy.copy_to_host(), a)


@pytest.mark.parametrize("where", [pytest.param("sim", marks=pytest.mark.sim), pytest.param("gpu", marks=pytest.mark.gpu)])
def test_opaque_passes_integers_on(rng, where):
    """``opaque`` returns its 32- or 64-bit integer unchanged, in a loop as outside one."""
    if (where == "sim") != numattn.SIMULATOR:
        pytest.skip(f"runs on the {where} target")
    from numba import cuda

    from warp_kernels import opaque_kernel

    base = np.array([int(rng.integers(1 << 40, 1 << 50))], np.int64)
    out32, out64 = np.full((32, 5), -1, np.int32), np.full((32, 5), -1, np.int64)
    args = [cuda.to_device(x) for x in (base, out32, out64)]
    opaque_kernel[1, 32](*args)
    i, k = np.arange(32)[:, None], np.arange(5)[None, :]
    np.testing.assert_array_equal(args[1].copy_to_host(), i * 3 + k)
    np.testing.assert_array_equal(args[2].copy_to_host(), base[0] + i * k)


@pytest.mark.parametrize("where", [pytest.param("sim", marks=pytest.mark.sim), pytest.param("gpu", marks=pytest.mark.gpu)])
def test_pack_shuffle_ballot_broadcast_ex2_zero_fill(rng, where):
    if (where == "sim") != numattn.SIMULATOR:
        pytest.skip(f"runs on the {where} target")
    from numba import cuda

    from warp_kernels import misc_kernel

    x = (rng.standard_normal((32, 2)) * 3).astype(np.float32)
    outs = [np.zeros(32, np.uint32), np.zeros(32, np.uint32), np.zeros((32, 4), np.float32),
            np.zeros(32, np.float32), np.zeros(32, np.float32), np.ones((32, 8), np.uint16), np.zeros(32, np.uint32),
            np.zeros(32, np.int32)]
    dev = [cuda.to_device(o) for o in [x] + outs]
    misc_kernel[1, 32, 0, 32 * 8 * 2](*dev)
    f16, bf16, unpacked, shuffled, exp2, zero_filled, votes, broadcast = (d.copy_to_host() for d in dev[1:])
    x16 = x.astype(np.float16)
    assert np.array_equal(f16, x16[:, 0].view(np.uint16).astype(np.uint32) | x16[:, 1].view(np.uint16).astype(np.uint32) << 16)
    xb = torch.from_numpy(x).to(torch.bfloat16)
    xb_bits = xb.view(torch.int16).numpy().view(np.uint16).astype(np.uint32)
    assert np.array_equal(bf16, xb_bits[:, 0] | xb_bits[:, 1] << 16)
    assert np.array_equal(unpacked[:, :2], x16.astype(np.float32))
    assert np.array_equal(unpacked[:, 2:], xb.float().numpy())
    assert np.array_equal(shuffled, x[np.arange(32) ^ 5, 0])
    np.testing.assert_allclose(exp2, np.exp2(x[:, 0].astype(np.float64)), rtol=2e-7)
    assert np.all(zero_filled == 0)
    assert np.all(votes == sum(1 << lane for lane in range(32) if x[lane, 0] > 0))
    assert np.all(broadcast == 3)  # lane 0's 7 · 0 + 3 in every lane


@pytest.mark.parametrize("where", [pytest.param("sim", marks=pytest.mark.sim), pytest.param("gpu", marks=pytest.mark.gpu)])
def test_shared_pair_loads(rng, where):
    """``ld_shared_v2_f32`` reads the two float32 at its row and column of a shared tile."""
    if (where == "sim") != numattn.SIMULATOR:
        pytest.skip(f"runs on the {where} target")
    from numba import cuda

    from warp_kernels import shared_pairs_kernel

    values = rng.standard_normal((2, 64)).astype(np.float32)
    out = cuda.to_device(np.full((64, 2), np.nan, np.float32))
    shared_pairs_kernel[1, 32](cuda.to_device(values), out)
    lanes = np.arange(64) % 32
    columns = 2 * (lanes // 2) + 32 * (np.arange(64) // 32)
    expected = np.stack([values[lanes % 2, columns], values[lanes % 2, columns + 1]], axis=1)
    assert np.array_equal(out.copy_to_host(), expected)


@pytest.mark.parametrize("where", [pytest.param("sim", marks=pytest.mark.sim), pytest.param("gpu", marks=pytest.mark.gpu)])
def test_shared_word_stores_and_chunk_copies(rng, where):
    if (where == "sim") != numattn.SIMULATOR:
        pytest.skip(f"runs on the {where} target")
    from numba import cuda

    from warp_kernels import staging_kernel

    words = rng.integers(0, 1 << 32, size=(32, 2), dtype=np.uint32)
    out = cuda.to_device(np.full((8, 32), 0xABCD, np.uint16))
    staging_kernel[1, 32, 0, 8 * 16 * 2](cuda.to_device(words), out)
    expected = np.full((8, 32), 0xABCD, np.uint16)
    for lane in range(32):
        for i in range(2):
            col = 8 * i + 2 * (lane % 4)
            expected[lane // 4, 16 + col] = words[lane, i] & 0xFFFF
            expected[lane // 4, 17 + col] = words[lane, i] >> 16
    expected[0, 16:] = 0xABCD  # row 0 is not copied
    assert np.array_equal(out.copy_to_host(), expected)


@pytest.mark.parametrize("where", [pytest.param("sim", marks=pytest.mark.sim), pytest.param("gpu", marks=pytest.mark.gpu)])
def test_copies_from_global_addresses(rng, where):
    if (where == "sim") != numattn.SIMULATOR:
        pytest.skip(f"runs on the {where} target")
    from numba import cuda

    from warp_kernels import address_copy_kernel

    src = rng.integers(0, 1 << 16, size=(8, 8, 40), dtype=np.uint16)
    out = cuda.to_device(np.full((32, 16), 0xABCD, np.uint16))
    address_copy_kernel[1, 32, 0, 32 * 16 * 2](cuda.to_device(src), out)
    rows = src[:, ::2, :32].reshape(32, 32)
    expected = np.concatenate([rows[:, 8:16], rows[:, 16:24]], axis=1)
    expected[1::2, 12:] = 0
    assert np.array_equal(out.copy_to_host(), expected)


@pytest.mark.sim
def test_simulated_copies_land_at_the_wait(rng):
    """The twins of ``cp.async`` land at their thread's wait for their group, not when issued, so that the
    simulator shows a tile read before its copies are waited for as stale (the GPU may show either)."""
    if not numattn.SIMULATOR:
        pytest.skip("the simulator's semantics")
    from numba import cuda

    from warp_kernels import async_landing_kernel

    src = rng.integers(0, 0xABCD, size=(2, 16), dtype=np.uint16)
    out = cuda.to_device(np.zeros((3, 16), np.uint16))
    async_landing_kernel[1, 1, 0, 64](cuda.to_device(src), out)
    stale = np.full(16, 0xABCD, np.uint16)
    assert np.array_equal(out.copy_to_host(),
                          [stale, np.concatenate([src[0, :8], stale[8:]]), src[0]])


@pytest.mark.parametrize("where", [pytest.param("sim", marks=pytest.mark.sim), pytest.param("gpu", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("headroom", [0.0, 8.0])
def test_online_softmax_headroom(rng, where, headroom):
    """Eager (no headroom): the reference max follows every row's running max, so each row's largest P
    is exactly 1. Lazy: a max that grows by less than the headroom keeps the old reference."""
    if (where == "sim") != numattn.SIMULATOR:
        pytest.skip(f"runs on the {where} target")
    from numba import cuda

    from warp_kernels import softmax_update_kernel

    first = rng.standard_normal((16, 16)).astype(np.float32) - 20  # negative: unscaled and scaled maxima disagree
    growth = np.where(np.arange(16) % 2 == 0, 3.0, -1.0).astype(np.float32)[:, None]  # even rows' max grows by 3
    scores = np.stack([first, first + growth])
    p, m = cuda.to_device(np.full((2, 16, 16), np.nan, np.float32)), cuda.to_device(np.full(16, np.nan, np.float32))
    # the scores as the kernels hold them before a scale (0.25: exact) that update applies
    softmax_update_kernel(headroom)[1, 32](cuda.to_device(scores * 4), p, m, np.float32(0.25))
    p, m = p.copy_to_host(), m.copy_to_host()
    # the first tile sets every row's reference; the second moves it only without headroom
    references = np.stack([first.max(axis=1), scores.max(axis=(0, 2)) if headroom == 0 else first.max(axis=1)])
    np.testing.assert_array_equal(m, references[1])
    np.testing.assert_allclose(p, np.exp2(scores - references[:, :, None]), rtol=1e-6)
    if headroom == 0:
        assert np.all(p.max(axis=(0, 2)) == 1.0)
    else:
        np.testing.assert_allclose(p[1, ::2].max(axis=1), 8.0, rtol=1e-6)


@pytest.mark.parametrize("where", [pytest.param("sim", marks=pytest.mark.sim), pytest.param("gpu", marks=pytest.mark.gpu)])
def test_word_copies_from_strided_views(rng, where):
    if (where == "sim") != numattn.SIMULATOR:
        pytest.skip(f"runs on the {where} target")
    from numba import cuda

    from warp_kernels import word_gather_kernel

    table = rng.integers(-(1 << 31), 1 << 31, size=(40, 12), dtype=np.int32)
    order = rng.permutation(40)[:32].astype(np.int32)
    out = cuda.to_device(np.zeros(32, np.int32))
    word_gather_kernel[1, 32](cuda.to_device(table), cuda.to_device(order), out)
    lanes = np.arange(32)
    expected = np.where(lanes < 24, table[:, ::3][order, lanes % 4], -1)
    assert np.array_equal(out.copy_to_host(), expected)


@pytest.mark.parametrize("where", [pytest.param("sim", marks=pytest.mark.sim), pytest.param("gpu", marks=pytest.mark.gpu)])
def test_word_stores_at_global_addresses(rng, where):
    if (where == "sim") != numattn.SIMULATOR:
        pytest.skip(f"runs on the {where} target")
    from numba import cuda

    from warp_kernels import address_store_kernel

    words = rng.integers(0, 1 << 32, size=(32, 3), dtype=np.uint32)
    full = np.full((8, 8, 16), 0xABCD, np.uint16)
    out = cuda.to_device(full)
    address_store_kernel[1, 32](cuda.to_device(words), out[:, ::2, :])
    expected = full.copy()
    rows = expected[:, ::2, :]  # a view: rows[l // 4, l % 4] is lane l's row
    for lane in range(32):
        row = rows[lane // 4, lane % 4]
        for offset, word in zip((2, 4, 8), words[lane], strict=True):
            row[offset], row[offset + 1] = word & 0xFFFF, word >> 16
    assert np.array_equal(out.copy_to_host(), expected)


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("where", [pytest.param("sim", marks=pytest.mark.sim), pytest.param("gpu", marks=pytest.mark.gpu)])
def test_wgmma_swizzled_operands(rng, bf16, where):
    """cp.async into 128-byte swizzled tiles → wgmma (shared/shared, K-major B; registers/shared,
    MN-major B) reproduces the products: the descriptors, the swizzle and the fragment layouts agree."""
    if (where == "sim") != numattn.SIMULATOR:
        pytest.skip(f"runs on the {where} target")
    if where == "gpu" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma needs sm_90")
    from numba import cuda

    from warp_kernels import WG_D, WG_K, WG_N, WGMMA_SHARED_BYTES, make_wgmma_kernel

    a, bt = (_bits(rng.standard_normal((rows, WG_D)).astype(np.float32), bf16) for rows in (64, WG_N))
    v = _bits(rng.standard_normal((WG_K, WG_N)).astype(np.float32), bf16)
    s_out = np.full((64, WG_N), np.nan, np.float32)
    o_out = np.full((64, WG_N), np.nan, np.float32)
    args = [cuda.to_device(x) for x in (a, bt, v, s_out, o_out)]
    make_wgmma_kernel(bf16)[1, 128, 0, WGMMA_SHARED_BYTES](*args)
    A = _floats(a, bf16)
    np.testing.assert_allclose(args[3].copy_to_host(), A @ _floats(bt, bf16).T, rtol=0, atol=1e-3)
    np.testing.assert_allclose(args[4].copy_to_host(), A[:, :WG_K] @ _floats(v, bf16), rtol=0, atol=1e-4)


@pytest.mark.parametrize("where", [pytest.param("sim", marks=pytest.mark.sim), pytest.param("gpu", marks=pytest.mark.gpu)])
def test_tensor_copies_place_rows_as_the_tile_copier_does(rng, where):
    """A tensor map's boxes (two 64-column panels of 64 rows of ``src[1, 2]`` from row 64 of 100) land in shared
    memory where ``cp.async``'s tile copier puts the same rows, swizzled, and the rows past the array's end
    read 0 in both."""
    if (where == "sim") != numattn.SIMULATOR:
        pytest.skip(f"runs on the {where} target")
    if where == "gpu" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("tensor copies need sm_90")
    from numba import cuda

    from numattn.kernels.tensor_maps import tile_map

    from warp_kernels import TMA_ROWS, TMA_SHARED_BYTES, TMA_TILE_ROWS, tma_tile_kernel

    src = rng.integers(1, 2**16, (2, 3, 100, 128), dtype=np.uint16)
    device_src = cuda.to_device(src)
    maps = cuda.to_device(tile_map(device_src, TMA_ROWS)[None])
    out = cuda.to_device(np.zeros((2 * TMA_TILE_ROWS, 64), np.uint16))
    tma_tile_kernel[1, 128, 0, TMA_SHARED_BYTES](maps, device_src, out, 1, 2, 64)
    out = out.copy_to_host()
    assert np.array_equal(out[:TMA_TILE_ROWS], out[TMA_TILE_ROWS:])
    rows = np.zeros((TMA_ROWS, 128), np.uint16)
    rows[:36] = src[1, 2, 64:]
    for r in range(TMA_ROWS):
        for c in range(0, 128, 8):
            # the 64-column panel, then the 16-byte chunk ``c // 8 % 8`` at ``(c // 8 % 8) ^ (r % 8)``
            row, col = c // 64 * TMA_ROWS + r, ((c % 64 // 8) ^ (r % 8)) * 8
            assert np.array_equal(out[row, col:col + 8], rows[r, c:c + 8]), (r, c)


@pytest.mark.parametrize("where", [pytest.param("sim", marks=pytest.mark.sim), pytest.param("gpu", marks=pytest.mark.gpu)])
def test_named_barriers_take_turns(where):
    if (where == "sim") != numattn.SIMULATOR:
        pytest.skip(f"runs on the {where} target")
    from numba import cuda

    from warp_kernels import turns_kernel

    order = cuda.to_device(np.full(8, -1, np.int32))
    turns_kernel[1, 64](order)
    assert order.copy_to_host().tolist() == [0, 1] * 4


@pytest.mark.parametrize("where", [pytest.param("sim", marks=pytest.mark.sim), pytest.param("gpu", marks=pytest.mark.gpu)])
def test_bulk_reductions_add_staged_rows(rng, where):
    """cp.reduce.async.bulk .add.f32 from padded shared rows into global rows, twice over the same staging."""
    if (where == "sim") != numattn.SIMULATOR:
        pytest.skip(f"runs on the {where} target")
    if where == "gpu" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("bulk reductions need sm_90")
    from numba import cuda

    from warp_kernels import bulk_reduce_kernel

    src = rng.standard_normal((32, 16)).astype(np.float32)
    start = rng.standard_normal((32, 16)).astype(np.float32)
    dst = cuda.to_device(start)
    bulk_reduce_kernel[1, 32](cuda.to_device(src), dst)
    np.testing.assert_allclose(dst.copy_to_host(), start + 3 * src, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("where", [pytest.param("sim", marks=pytest.mark.sim), pytest.param("gpu", marks=pytest.mark.gpu)])
def test_last_block_reads_every_block_through_l2(where):
    """``last_to_finish`` picks one block per launch, after every block's writes, and leaves its counter at
    zero; ``load_l2_f32`` and ``load_l2_f32x4`` read what the other blocks wrote."""
    if (where == "sim") != numattn.SIMULATOR:
        pytest.skip(f"runs on the {where} target")
    from numba import cuda

    from warp_kernels import last_block_sum_kernel

    blocks, threads, launches = (4, 8, 2) if where == "sim" else (264, 64, 3)
    values = cuda.to_device(np.full((blocks, threads), np.nan, np.float32))
    counters = cuda.to_device(np.zeros((1, 1), np.int32))
    totals = cuda.to_device(np.full((launches, 2), np.nan, np.float32))
    for launch in range(launches):
        last_block_sum_kernel[blocks, threads](values, counters, totals, launch)
    rows, cols = np.arange(1, blocks + 1, dtype=np.float64), np.arange(1, threads + 1, dtype=np.float64)
    expected = rows.sum() * cols.sum() + np.arange(launches) * blocks * threads
    totals = totals.copy_to_host()  # float32 sums of up to 17k terms
    np.testing.assert_allclose(totals[:, 0], expected, rtol=1e-4)
    np.testing.assert_allclose(totals[:, 1], expected, rtol=1e-4)
    assert counters.copy_to_host()[0, 0] == 0



@pytest.mark.parametrize("where", [pytest.param("sim", marks=pytest.mark.sim), pytest.param("gpu", marks=pytest.mark.gpu)])
def test_a_forward_grid_in_sections_visits_every_tile_once(where):
    """A forward grid of 5 query tiles × 28 heads (KV heads shared by 2), each KV head a third of the L2 section,
    walks the heads 3 groups at a time, the last section holding the 4 heads left, tile by tile from the
    longest; heads that all fit make one section."""
    if (where == "sim") != numattn.SIMULATOR:
        pytest.skip(f"runs on the {where} target")
    from numba import cuda

    from numattn.kernels.tiles import L2_SECTION_BYTES

    from warp_kernels import grid_order_kernel

    tiles = 5
    for heads, head_bytes, size in ((28, L2_SECTION_BYTES // 3, 6), (12, L2_SECTION_BYTES // 6, 12)):
        places = cuda.to_device(np.full((tiles * heads, 2), -1, np.int64))
        grid_order_kernel[tiles * heads, 1](places, heads, 2, head_bytes)
        expected = [(t, first + h) for first in range(0, heads, size) for t in range(tiles)
                    for h in range(min(size, heads - first))]
        assert list(map(tuple, places.copy_to_host())) == expected


@pytest.mark.sim
@pytest.mark.skipif(not numattn.SIMULATOR, reason="the simulator's shared memory")
def test_simulator_static_shared_array_is_one_per_call_site():
    """Threads reaching a ``cuda.shared.array`` line together all get its one array (numba-cuda's own
    simulator makes it unlocked: two threads switched between its check and its store got two)."""
    import threading

    from numba.cuda.simulator.kernelapi import FakeCUDAShared

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(1000):
            shared, barrier, arrays = FakeCUDAShared(0), threading.Barrier(16), [None] * 16

            def allocate(i):
                barrier.wait()
                arrays[i] = shared.array(16, np.float32)

            threads = [threading.Thread(target=allocate, args=(i,)) for i in range(16)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert all(array is arrays[0] for array in arrays)
    finally:
        sys.setswitchinterval(interval)
