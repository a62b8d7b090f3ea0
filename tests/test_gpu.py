"""numattn.attention on a real GPU at realistic sizes: torch CUDA tensors, streams, other libraries."""

import functools

import numpy as np
import pytest

import numattn
from numattn import reference

from conftest import ATOL
from helpers import OnlyDLPack, as_dtype, low_precision_allowance, max_error, on_busy_side_stream, random_qkv

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")


def cuda_qkv(rng, dtype, *shape_args, layout="bhsd"):
    return [t.cuda() for t in as_dtype(random_qkv(rng, *shape_args, layout=layout), dtype, "torch")]


def sdpa_reference(q, k, v, causal, scale=None):
    """torch SDPA on the GPU in the inputs' dtype (its kernels' own rounding, such as P in 16 bits), with
    GQA heads expanded and the bottom-right causal mask."""
    group = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
    mask = None
    if causal:
        sq, sk = q.shape[2], k.shape[2]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(diagonal=sk - sq)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "shape",
    [
        (2, 8, 8, 257, 257, 64, 64),
        (1, 8, 2, 1000, 1000, 128, 128),
        (2, 4, 1, 97, 1025, 64, 64),
        (1, 4, 4, 333, 77, 256, 256),
        (1, 6, 3, 130, 190, 40, 72),
    ],
)
def test_against_float64_and_sdpa(rng, dtype, causal, shape):
    batch, hq, hkv, sq, skv, d, dv = shape
    q, k, v = cuda_qkv(rng, dtype, batch, hq, hkv, sq, skv, d, dv)
    out = torch.full((batch, hq, sq, dv), float("nan"), dtype=q.dtype, device="cuda")
    o, lse = numattn.attention(q, k, v, causal=causal, out=out, return_lse=True)
    assert o is out and lse.device == q.device
    ref_o, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True)
    assert max_error(o, ref_o) <= ATOL[dtype]
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse.cpu().numpy()), finite)
    assert np.abs(lse.cpu().numpy()[finite] - ref_lse[finite]).max() <= 1e-4
    if sq <= skv:  # SDPA returns NaN for rows with no visible key
        # at most twice SDPA's error, plus one unit in the last place of the largest output: rounded
        # to 16 bits, one element that the two kernels round differently moves the maximum by that much
        sdpa_error = max_error(sdpa_reference(q, k, v, causal), ref_o)
        ulp = float(torch.finfo(q.dtype).eps) * np.abs(ref_o).max()
        assert max_error(o, ref_o) <= 2 * sdpa_error + ulp + 1e-6


@pytest.mark.parametrize("causal", [False, True])
def test_a_grid_in_sections_of_heads_computes_every_tile(causal):
    """136 heads whose keys and values (2 MiB each) exceed ``STREAMED_KV_BYTES``: the grid takes them in sections
    (the last one smaller); the output is bit for bit that of runs over 8 heads at a time, whose grids are
    one section."""
    from numattn.configs.attention import SECTIONED_HEADS, STREAMED_KV_BYTES

    heads, seqlen, head_dim = 136, 4096, 128
    assert heads >= SECTIONED_HEADS > 8
    assert heads * seqlen * 2 * head_dim * 2 > STREAMED_KV_BYTES
    q, k, v = (torch.randn(1, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.full_like(q, float("nan"))
    numattn.attention(q, k, v, causal=causal, out=out)
    for h in range(0, heads, 8):
        part = numattn.attention(*(x[:, h:h + 8].contiguous() for x in (q, k, v)), causal=causal)
        assert torch.equal(out[:, h:h + 8], part)


def _clusters_if(wanted, rule, blocks, splits, limits):
    """``rule`` (``configs.attention.cluster_merges``) for a grid of any size where ``wanted``, else no cluster."""
    return wanted and rule(0, splits, limits)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("transposed", [False, True])
def test_key_splits_merged_in_clusters_and_by_the_last_block(rng, monkeypatch, causal, transposed):
    """The mma.sync kernel over 1 to 16 runs of keys, merged in thread-block clusters (2 to 8 runs, sm_90) and
    by each query tile's last block; 150 query rows end mid-tile, 419 keys mid-run; the output is
    poisoned first."""
    from numattn.configs.attention import MmaConfig
    from numattn.ops.attention import _attention_kernel, make_plan, validate

    q = torch.from_numpy(rng.standard_normal((2, 4, 150, 64), dtype=np.float32)).to("cuda", torch.float16)
    shape = (2, 2, 64, 424) if transposed else (2, 2, 420, 64)
    k = torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)).to("cuda", torch.float16)
    k = k.transpose(2, 3)[:, :, :419] if transposed else k[:, :, :419]
    v = torch.from_numpy(rng.standard_normal((2, 2, 419, 64), dtype=np.float32)).to("cuda", torch.float16)
    ref_o, ref_lse = reference.attention(q, k, v, causal=causal, scale=0.125, return_lse=True)
    from numattn.ops import attention as attention_module

    sm90 = torch.cuda.get_device_capability() >= (9, 0)
    config = MmaConfig(64, 4, 1 if causal else 2, True)  # query tiles of 64 and 128 rows
    for splits in (1, 2, 3, 4, 7, 8, 16):
        for clusters in (False, True):
            with monkeypatch.context() as patch:
                rule = functools.partial(_clusters_if, clusters and sm90, attention_module.cluster_merges)
                patch.setattr(attention_module, "cluster_merges", rule)
                problem = validate(q, k, v, None, causal, 0.125, "bhsd", True)
                clustered = _attention_kernel(problem, 0, config, splits).cluster is not None
                assert clustered == (clusters and sm90 and 2 <= splits <= 8)
                out = torch.full((2, 4, 150, 64), float("nan"), dtype=torch.float16, device="cuda")
                o, lse = make_plan(problem, config, splits)(q, k, v, out)
            assert max_error(o, ref_o) <= ATOL["float16"], (config, splits, clusters)
            finite = np.isfinite(ref_lse)
            assert np.array_equal(np.isfinite(lse.cpu().numpy()), finite)
            assert np.abs(lse.cpu().numpy()[finite] - ref_lse[finite]).max() <= 1e-4, (config, splits, clusters)



@pytest.mark.parametrize("head_dim, dtype", [(64, "float16"), (128, "bfloat16")])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("transposed", [False, True])
def test_wgmma_key_splits_and_transposed_keys(rng, head_dim, dtype, causal, transposed):
    """Every wgmma configuration, those without a producer also over 2 to 16 runs of keys merged by each query
    tile's last block; K given with its rows contiguous or transposed (keys contiguous: the configurations of
    key tiles in multiples of 64 that are not persistent); with a sliding window and sinks (the first run's alone); 150 query rows
    end mid-tile, 419 keys mid-run; the output is poisoned first."""
    from numattn.configs.attention import splits_keys, wgmma_configs
    from numattn.ops.attention import make_plan, validate

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the wgmma kernel needs sm_90")
    torch_dtype = getattr(torch, dtype)

    def normal(*shape):
        return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)).to("cuda", torch_dtype)

    q = normal(2, 4, 150, head_dim)
    k = normal(2, 2, head_dim, 424).transpose(2, 3)[:, :, :419] if transposed else normal(2, 2, 420, head_dim)[:, :, :419]
    v = normal(2, 2, 420, head_dim)[:, :, :419]
    sinks = torch.from_numpy(rng.standard_normal(4, dtype=np.float32)).cuda()
    window = (300, 40)
    ref_o, ref_lse = reference.attention(q, k, v, causal=causal, scale=0.125, return_lse=True, window=window,
                                         sinks=sinks)
    finite = np.isfinite(ref_lse)
    problem = validate(q, k, v, None, causal, 0.125, "bhsd", True, window=window, sinks=sinks)
    assert problem.transposed_k_loads == transposed
    configs = [c for c in wgmma_configs(head_dim, head_dim) if not (transposed and (c.block_n % 64 or c.persistent))]
    for config in configs:
        for splits in (1, 2, 3, 4, 7, 16) if splits_keys(config) else (1,):
            out = torch.full((2, 4, 150, head_dim), float("nan"), dtype=torch_dtype, device="cuda")
            o, lse = make_plan(problem, config, splits)(q, k, v, out, None, sinks)
            assert max_error(o, ref_o) <= ATOL[dtype], (config, splits)
            assert np.array_equal(np.isfinite(lse.cpu().numpy()), finite)
            assert np.abs(lse.cpu().numpy()[finite] - ref_lse[finite]).max() <= 1e-4, (config, splits)


@pytest.mark.parametrize("window, alibi", [(None, False), ((300, 0), False), ((200, 17), True)])
@pytest.mark.parametrize("batch, seqlen_q, seqlen_kv", [(2, 150, 419), (3, 2000, 2000), (1, 700, 4100), (2, 1000, 300)])
def test_a_persistent_block_computes_each_tile_as_a_block_of_its_own_does(rng, window, alibi, batch, seqlen_q,
                                                                          seqlen_kv):
    """A persistent block (a block per SM taking query tile after query tile, the next Q copied into a second
    buffer, the ring of stages running on) gives bit for bit the output and LSE of the same tiles with a block
    per query tile, on grids of fewer tiles than SMs and of several tiles per SM; causal, a window, ALiBi and
    sinks, GQA, lengths that end mid-tile, tiles whose rows see no key; the outputs are poisoned first."""
    from numattn.configs.attention import WgmmaConfig
    from numattn.ops.attention import make_plan, validate

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the wgmma kernel needs sm_90")
    q, k, v = cuda_qkv(rng, "bfloat16", batch, 8, 2, seqlen_q, seqlen_kv, 128)
    slopes = torch.from_numpy(rng.uniform(0.01, 0.5, 8).astype(np.float32)).cuda() if alibi else None
    sinks = torch.from_numpy(rng.standard_normal(8, dtype=np.float32)).cuda()
    problem = validate(q, k, v, None, True, None, "bhsd", True, window=window, alibi_slopes=slopes, sinks=sinks)
    results = []
    for config in (WgmmaConfig(128, 2, 2, producer=True), WgmmaConfig(128, 2, 2, producer=True, persistent=True)):
        out = torch.full_like(q, float("nan"))
        o, lse = make_plan(problem, config)(q, k, v, out, slopes, sinks)
        results.append((o, lse))
    (o, lse), (o_persistent, lse_persistent) = results
    assert torch.equal(o_persistent, o) and torch.equal(lse_persistent, lse)
    options = dict(causal=True, window=window, alibi_slopes=slopes, sinks=sinks)
    ref_o = reference.attention(q, k, v, **options)
    assert max_error(o, ref_o) <= max(ATOL["bfloat16"], low_precision_allowance(q, k, v, ref_o, options))


@pytest.mark.parametrize("causal", [False, True])
def test_default_splits_the_keys_of_a_short_grid(rng, causal):
    """``numattn.attention``'s default for few query tiles over many keys splits the keys on sm_90 (4 query
    tiles, 24 key tiles: 2 runs), output and LSE as the reference's."""
    from numattn.ops.attention import make_plan, validate

    q, k, v = cuda_qkv(rng, "bfloat16", 1, 2, 2, 150, 3000, 128)
    plan = make_plan(validate(q, k, v, None, causal, None, "bhsd", True))
    assert plan.splits == (2 if torch.cuda.get_device_capability() == (9, 0) else 1)
    o, lse = numattn.attention(q, k, v, causal=causal, return_lse=True)
    ref_o, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True)
    assert max_error(o, ref_o) <= ATOL["bfloat16"]
    assert np.abs(lse.cpu().numpy() - ref_lse).max() <= 1e-4

def test_bshd_and_strided_views(rng):
    q, k, v = cuda_qkv(rng, "bfloat16", 2, 8, 2, 300, 300, 128, layout="bshd")
    o = numattn.attention(q, k, v, layout="bshd", causal=True)
    assert o.shape == (2, 300, 8, 128)
    assert max_error(o, reference.attention(q, k, v, layout="bshd", causal=True)) <= ATOL["bfloat16"]
    # a bhsd view of the same buffers, read through its strides
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    o2 = numattn.attention(qt, kt, vt, causal=True)
    assert torch.equal(o2, o.transpose(1, 2))


def test_tensor_maps_are_uploaded_on_each_stream(rng):
    """A plan with tensor copies (head dim 128, a producer) uploads its maps on the stream it launches on: the
    same tensors on a busy side stream, then on the default stream, give the reference's output both times."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("tensor copies need sm_90")
    from numattn.ops.attention import _slow_path

    q, k, v = cuda_qkv(rng, "bfloat16", 4, 16, 16, 1024, 1024, 128)
    assert _slow_path(q, k, v, None, True, None, "bhsd", False, (None,) * 4)[0].tensor_maps is not None
    expected = reference.attention(q, k, v, causal=True)
    with on_busy_side_stream(torch):  # maps read before their copy would show
        on_side = numattn.attention(q, k, v, causal=True)
    on_default = numattn.attention(q, k, v, causal=True)
    torch.cuda.synchronize()
    for o in (on_side, on_default):
        assert max_error(o, expected) <= ATOL["bfloat16"]


def test_runs_on_torch_current_stream(rng):
    q, k, v = cuda_qkv(rng, "float16", 1, 8, 8, 512, 512, 64)
    with on_busy_side_stream(torch) as stream:  # a wrong stream would race
        o = numattn.attention(q, k, v)
        checksum = o.float().sum()
    stream.synchronize()
    assert max_error(o, reference.attention(q, k, v)) <= ATOL["float16"]
    assert torch.isfinite(checksum)


def test_numpy_and_torch_cpu_inputs_run_on_gpu(rng):
    q, k, v = random_qkv(rng, 1, 4, 2, 200, 150, 64)
    o = numattn.attention(q, k, v, causal=True)
    assert isinstance(o, np.ndarray)
    assert max_error(o, reference.attention(q, k, v, causal=True)) <= ATOL["float32"]
    qt, kt, vt = as_dtype([q, k, v], "bfloat16", "torch")
    ot = numattn.attention(qt, kt, vt)
    assert ot.device.type == "cpu" and ot.dtype == torch.bfloat16
    assert max_error(ot, reference.attention(qt, kt, vt)) <= ATOL["bfloat16"]


def test_numba_device_arrays(rng):
    from numba import cuda

    arrays = random_qkv(rng, 2, 4, 4, 100, 120, 64)
    q, k, v = (cuda.to_device(a.astype(np.float16)) for a in arrays)
    o = numattn.attention(q, k, v, causal=True)
    assert isinstance(o, type(q)) and o.dtype == np.float16
    assert max_error(o, reference.attention(q, k, v, causal=True)) <= ATOL["float16"]


def test_cupy_arrays(rng):
    cupy = pytest.importorskip("cupy")
    arrays = random_qkv(rng, 1, 4, 2, 90, 70, 64)
    q, k, v = (cupy.asarray(a) for a in arrays)
    o = numattn.attention(q, k, v)
    assert isinstance(o, cupy.ndarray)
    assert max_error(o, reference.attention(q, k, v)) <= ATOL["float32"]


def test_dlpack_only_device_object(rng):
    q, k, v = cuda_qkv(rng, "float16", 1, 2, 2, 64, 64, 64)

    o = numattn.attention(OnlyDLPack(q), OnlyDLPack(k), OnlyDLPack(v))
    assert max_error(o, reference.attention(q, k, v)) <= ATOL["float16"]


def test_mixed_devices_rejected(rng):
    q, k, v = cuda_qkv(rng, "float16", 1, 2, 2, 8, 8, 64)
    with pytest.raises(ValueError, match=r"one device, got q on GPU 0, k on host memory, v on GPU 0"):
        numattn.attention(q, k.cpu(), v)


_CACHED_RUN = """
import hashlib, json, time
import torch
import numattn
from numattn.kernels.launch import LOADED
gen = torch.Generator(device='cuda').manual_seed(7)
q, k, v = (torch.randn(1, 4, 300, 128, device='cuda', dtype=torch.bfloat16, generator=gen) for _ in range(3))
torch.cuda.synchronize()
start = time.perf_counter()
o, lse = numattn.attention(q, k, v, causal=True, return_lse=True)
torch.cuda.synchronize()
first = time.perf_counter() - start
print(json.dumps({"first_call_s": first, "kernels": [[kernel.label, list(kernel.attributes)] for kernel in LOADED],
                  "digest": hashlib.sha256(o.cpu().view(torch.int16).numpy().tobytes()
                                           + lse.cpu().numpy().tobytes()).hexdigest()}))
"""


def test_a_kernel_from_the_cache_is_the_compiled_one(tmp_path):
    """Three fresh processes: the first compiles and stores the kernel, the second loads it from the cache,
    the third (cache off) compiles it again; all three give bit-identical outputs and LSEs and the same
    registers, shared and local memory, and the load takes a fraction of the compile."""
    import json
    import os
    import subprocess
    import sys

    from numattn.kernels import kernel_cache

    def run(cache):
        env = dict(os.environ, NUMATTN_KERNEL_CACHE=str(cache))
        done = subprocess.run([sys.executable, "-c", _CACHED_RUN], env=env, capture_output=True, text=True,
                              check=False, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    stored, loaded, compiled = run(tmp_path), run(tmp_path), run("off")
    assert len(kernel_cache.entries(tmp_path)) == len(stored["kernels"]) >= 1
    assert stored["digest"] == loaded["digest"] == compiled["digest"]
    assert stored["kernels"] == loaded["kernels"] == compiled["kernels"]
    assert loaded["first_call_s"] < 0.25 * min(stored["first_call_s"], compiled["first_call_s"])
