"""Kernel primitives: simulator twins against independent references; PTX of the compiled kernels."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from numattn.kernels.ptx import cvt_f32_bf16, cvt_f32_f16, cvt_rn_bf16_f32, cvt_rn_f16_f32
from numattn.kernels.tiles import tile_view

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


@pytest.mark.ptx
def test_kernel_ptx_has_no_local_memory_or_fp64():
    """Compile the SIMT kernel variants to PTX (no GPU needed) and inspect the code."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    script = Path(__file__).with_name("ptx_report.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)
    assert len(results) == 12
    for variant, facts in results.items():
        assert facts["local_bytes"] == 0 and facts["local_ops"] == 0, (variant, facts)
        assert facts["f64_ops"] == 0, (variant, facts)
        assert "ex2.approx.f32" in facts["mnemonics"], (variant, facts)
        if variant.startswith("bfloat16"):
            assert "cvt.rn.bf16.f32" in facts["mnemonics"], (variant, facts)
        if variant.startswith("float16"):
            assert {"cvt.f32.f16", "cvt.rn.f16.f32"} <= set(facts["mnemonics"]), (variant, facts)


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
