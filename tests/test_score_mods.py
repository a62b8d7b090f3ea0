"""Sliding window, logit softcap, ALiBi and attention sinks in ``numattn.attention``: the CPU path and every
GPU kernel (in the simulator) against the float64 reference, the tiles a window skips, and the errors."""

import itertools

import numpy as np
import pytest

import numattn
from numattn import reference

from conftest import ATOL
from helpers import as_dtype, low_precision_allowance, max_error, random_qkv, torch_attention


def per_head(rng, heads, low=0.01, high=0.5, batch=None):
    shape = (heads,) if batch is None else (batch, heads)
    return rng.uniform(low, high, shape).astype(np.float32)


def check(o, lse, q, k, v, atol, **options):
    ref_o, ref_lse = reference.attention(q, k, v, return_lse=True, **options)
    assert max_error(o, ref_o) <= max(atol, low_precision_allowance(q, k, v, ref_o, options)), options
    no_key = np.isneginf(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), no_key)
    assert np.abs(np.where(no_key, 0.0, lse - ref_lse)).max() <= 1e-5 * (1 + np.abs(ref_lse[~no_key]).max())


def test_cpu_path_every_combination(rng):
    """The CPU path (float32) with each window, softcap, kind of ALiBi slopes and sinks, causal or not, GQA,
    more keys than queries."""
    q, k, v = random_qkv(rng, 2, 4, 2, 37, 53, 32)
    slopes, batch_slopes, sinks = per_head(rng, 4), per_head(rng, 4, batch=2), rng.standard_normal(4, np.float32)
    windows = (None, (0, 0), (1, -1), (7, 3), (127, None), (100, 100), (-1, 5))
    with numattn.simulate(False):
        for causal, window, softcap, alibi, sink in itertools.product(
                (False, True), windows, (None, 3.0), (None, slopes, batch_slopes), (None, sinks)):
            options = dict(causal=causal, window=window, softcap=softcap, alibi_slopes=alibi, sinks=sink)
            o, lse = numattn.attention(q, k, v, return_lse=True, **options)
            check(o, lse, q, k, v, 1e-5, **options)


OPTION_SETS = [
    dict(causal=True, window=(5, -1)),
    dict(window=(3, 8), softcap=2.0),
    dict(causal=True, alibi=True, sinks=True),
    dict(window=(0, 0), softcap=5.0, alibi=True, sinks=True),
]


def kernels():
    from numattn.configs.attention import MmaConfig, WgmmaConfig

    return {
        "wgmma": (WgmmaConfig(block_n=16, warpgroups=1, stages=2), 1, "float16"),
        "mma": (MmaConfig(block_n=16, num_warps=2), 1, "bfloat16"),
        "mma-3-splits": (MmaConfig(block_n=16, num_warps=2), 3, "float16"),
        "simt": (None, 1, "float32"),
    }


@pytest.mark.parametrize("kernel", ["wgmma", "mma", "mma-3-splits", "simt"])
def test_gpu_kernels_in_the_simulator(rng, kernel):
    """Each GPU kernel family (the wgmma, mma.sync with and without key splits, CUDA-core) with the options,
    alone and together, in the simulator."""
    from numattn.ops.attention import make_plan, validate

    config, splits, dtype = kernels()[kernel]
    q, k, v = as_dtype(random_qkv(rng, 1, 2, 1, 45, 70, 64), dtype)
    for options in OPTION_SETS:
        alibi = per_head(rng, 2) if options.get("alibi") else None
        sinks = (rng.standard_normal(2, np.float32) + 2) if options.get("sinks") else None
        causal, window, softcap = options.get("causal", False), options.get("window"), options.get("softcap")
        problem = validate(q, k, v, None, causal, None, "bhsd", True, window, softcap, alibi, sinks)
        o, lse = make_plan(problem, config, splits)(q, k, v, None, alibi, sinks)
        check(o, lse, q, k, v, ATOL[dtype], causal=causal, window=window, softcap=softcap, alibi_slopes=alibi,
              sinks=sinks)


@pytest.mark.parametrize("cpu", [False, True], ids=["simulator", "cpu"])
def test_tiles_outside_the_window_are_never_read(rng, cpu, fresh_plans):
    """Values of keys far left of every query's window are NaN: a kernel that read their tile (P = 0 times NaN)
    would return NaN. Queries see keys 144 and on (256 keys, 96 queries, a window of 16 to the left)."""
    q, k, v = as_dtype(random_qkv(rng, 1, 2, 2, 96, 256, 64), "float16")
    v[:, :, :64] = np.nan
    with numattn.simulate(not cpu):
        o = numattn.attention(q, k, v, causal=True, window=(16, 0))
    assert np.isfinite(o).all()
    ref_o = reference.attention(q, k, np.nan_to_num(v), causal=True, window=(16, 0))  # unseen values as 0
    assert max_error(o, ref_o) <= ATOL["float16"]


def test_rows_that_see_no_key(rng):
    """More queries than keys under causal masking: the first rows see no key, so they return 0 and an LSE of
    -inf, or the sink's logit with sinks; a window of 0 keys to each side sees only the diagonal."""
    q, k, v = random_qkv(rng, 1, 2, 1, 20, 8, 16)
    sinks = np.array([0.5, -1.0], np.float32)
    o, lse = numattn.attention(q, k, v, causal=True, window=(0, 0), sinks=sinks, return_lse=True)
    np.testing.assert_array_equal(o[:, :, :12], 0.0)
    np.testing.assert_allclose(lse[0, :, :12], np.repeat(sinks[:, None], 12, axis=1))
    check(o, lse, q, k, v, ATOL["float32"], causal=True, window=(0, 0), sinks=sinks)


def test_a_window_wider_than_the_sequence_changes_nothing(rng):
    q, k, v = random_qkv(rng, 1, 2, 1, 30, 30, 16)
    plain = numattn.attention(q, k, v, causal=True)
    windowed = numattn.attention(q, k, v, causal=True, window=(1000, 1000))
    np.testing.assert_allclose(windowed, plain, atol=1e-6)


def test_plans_of_torch_tensors_keep_their_options_apart(rng, fresh_plans):
    """Cached plans are keyed by the options: calls that differ only in the window, the softcap or whether
    there are sinks get their own results; numpy slopes beside torch tensors take the slower key."""
    torch = pytest.importorskip("torch")
    q, k, v = (torch.from_numpy(x) for x in random_qkv(rng, 1, 2, 1, 24, 24, 16))
    sinks = torch.tensor([1.0, 2.0])
    numpy_slopes = np.array([0.5, 0.25], np.float32)  # host arrays of another library beside torch's
    for options in (dict(window=(2, 0)), dict(window=(5, 0)), dict(softcap=1.0), dict(softcap=1.0, sinks=sinks),
                    dict(alibi_slopes=numpy_slopes), dict()):
        for _ in range(2):  # planned, then from the cache
            o = numattn.attention(q, k, v, causal=True, **options)
            ref_o = reference.attention(q, k, v, causal=True, **options)
            assert max_error(o, ref_o) <= ATOL["float32"], options


@pytest.mark.parametrize("options, error, match", [
    (dict(window=5), TypeError, "window must be None or a pair"),
    (dict(window=(1, 2, 3)), TypeError, "window must be None or a pair"),
    (dict(window=(1.5, 0)), TypeError, "window's left side must be an int or None, got float"),
    (dict(window=(True, 0)), TypeError, "window's left side must be an int"),
    (dict(window=(0, -2)), ValueError, "window's right side must be >= 0, or -1 or None"),
    (dict(softcap=-1.0), ValueError, "softcap must be a finite positive number"),
    (dict(softcap=float("nan")), ValueError, "softcap must be a finite positive number"),
    (dict(softcap="30"), TypeError, "softcap must be a real number or None, got str"),
    (dict(softcap=3e38), ValueError, r"softcap must be in \[1e-30, 1e\+30\]"),
    (dict(softcap=2**1100), ValueError, "softcap must be a finite positive number"),
    (dict(alibi_slopes=np.ones(2, np.float64)), TypeError, "alibi_slopes must be float32, got float64"),
    (dict(alibi_slopes=np.ones(3, np.float32)), ValueError, r"alibi_slopes must have shape \(4,\) or \(2, 4\)"),
    (dict(sinks=np.ones((2, 4), np.float32)), ValueError, r"sinks must have shape \(4,\), got \(2, 4\)"),
    (dict(sinks=[1.0, 2.0, 3.0, 4.0]), TypeError, "sinks"),
])
def test_bad_options_name_the_argument(rng, options, error, match):
    q, k, v = random_qkv(rng, 2, 4, 2, 8, 8, 16)
    with pytest.raises(error, match=match):
        numattn.attention(q, k, v, **options)


def test_a_cached_plan_takes_no_window_that_validation_refuses(rng):
    """``(4.0, 0) == (4, 0)`` and ``(True, 0) == (1, 0)``: after a call with int sides, the same values as a
    float or a bool are still refused (by ``attention`` on numpy arrays, ``decode`` on numpy and torch)."""
    import torch

    q, k, v = random_qkv(rng, 1, 2, 2, 8, 8, 16)
    dq, dk, dv, _ = decode_inputs(rng, "float32", batch=1, capacity=16, head_dim=16)
    calls = [lambda window: numattn.attention(q, k, v, window=window),
             lambda window: numattn.decode(dq, dk, dv, window=window),
             lambda window: numattn.decode(*map(torch.from_numpy, (dq, dk, dv)), window=window)]
    for call in calls:
        call((1, 0))
        for bad in ((1.0, 0), (True, 0)):
            with pytest.raises(TypeError, match="window's left side must be an int"):
                call(bad)


def decode_inputs(rng, dtype, seqlen_q=1, batch=3, heads_q=4, heads_kv=2, capacity=90, head_dim=64):
    q = rng.standard_normal((batch, heads_q, seqlen_q, head_dim), dtype=np.float32).astype(dtype)
    k, v = (rng.standard_normal((batch, heads_kv, capacity, head_dim), dtype=np.float32).astype(dtype)
            for _ in range(2))
    lengths = np.array([capacity, 37, 0][:batch], np.int32)
    return q, k, v, lengths


DECODE_OPTION_SETS = [
    dict(window=(20, None)),
    dict(softcap=3.0),
    dict(alibi=True, sinks=True),
    dict(window=(5, 0), softcap=2.0, alibi=True, sinks=True),
]


def decode_options(rng, options, batch=3, heads_q=4):
    options = dict(options)
    if options.pop("alibi", False):
        options["alibi_slopes"] = per_head(rng, heads_q, batch=batch)
    if options.pop("sinks", False):
        options["sinks"] = rng.standard_normal(heads_q, np.float32)
    return options


@pytest.mark.parametrize("kernel, key_splits", [("cpu", 1), ("simt", 1), ("simt", 3), ("mma", 1), ("mma", 3)])
def test_decode_with_options(rng, splits, kernel, key_splits):
    """``decode`` and ``paged_decode`` with each option set, one and two new tokens (a window counts back from
    each token), a sequence of 0 keys (its rows return 0 and the sink's logit): the CPU path, and in the
    simulator the CUDA-core kernel (float32) and the tensor-core kernel (float16), with the keys split or not."""
    from numattn.bench import paged_copy

    splits(key_splits)
    dtype = "float16" if kernel == "mma" else "float32"
    for seqlen_q in (1, 2):
        q, k, v, lengths = decode_inputs(rng, dtype, seqlen_q)
        # the simulator runs the CUDA-core kernel's rows slowly: two new tokens on the other paths only
        for options in DECODE_OPTION_SETS if seqlen_q == 1 else [] if kernel == "simt" else DECODE_OPTION_SETS[-1:]:
            options = decode_options(rng, options)
            with numattn.simulate(kernel != "cpu"):
                o, lse = numattn.decode(q, k, v, seqlens=lengths, return_lse=True, **options)
            ref_o, ref_lse = reference.decode(q, k, v, seqlens=lengths, return_lse=True, **options)
            assert max_error(o, ref_o) <= ATOL[dtype], options
            np.testing.assert_allclose(lse, ref_lse, atol=1e-5)
    torch = pytest.importorskip("torch")
    k_pages, v_pages, table = paged_copy(torch, torch.from_numpy(k), torch.from_numpy(v), 16)
    with numattn.simulate(kernel != "cpu"):
        o = numattn.paged_decode(q, k_pages.numpy(), v_pages.numpy(), table.numpy(), lengths, **options)
    assert max_error(o, reference.decode(q, k, v, seqlens=lengths, **options)) <= ATOL[dtype]


def test_decode_plan_binds_the_slopes_and_sinks(rng):
    """A decode plan holds its ALiBi slopes and sinks like its caches: values changed in place are read."""
    q, k, v, lengths = decode_inputs(rng, "float32")
    slopes, sinks = per_head(rng, 4), rng.standard_normal(4, np.float32)
    step = numattn.decode_plan(q[:, :, 0], k, v, seqlens=lengths, window=(30, None), alibi_slopes=slopes, sinks=sinks)
    for _ in range(2):
        with numattn.simulate(False):
            o = step(q[:, :, 0])
        ref_o = reference.decode(q[:, :, 0], k, v, seqlens=lengths, window=(30, None), alibi_slopes=slopes, sinks=sinks)
        assert max_error(o, ref_o) <= ATOL["float32"]
        slopes *= 2
        sinks += 1


def float64_training_step(q, k, v, do, causal, window, softcap, alibi_slopes, sinks):
    """The float64 gradients ``[dq, dk, dv(, dsinks)]`` of the attention with the options, by torch autograd."""
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    if sinks is not None:
        leaves.append(sinks.detach().double().requires_grad_())
    torch_attention(*leaves[:3], causal, window, softcap, alibi_slopes, leaves[3] if sinks is not None else None
                    ).backward(do.double())
    return [x.grad for x in leaves]


TRAINING_OPTION_SETS = [
    dict(causal=True, window=(5, None)),
    dict(window=(3, 8), softcap=2.0),
    dict(causal=True, alibi=True, sinks=True),
    dict(window=(0, 0), softcap=5.0, alibi=True, sinks=True),
]


def check_gradients(q, k, v, do, options, slopes, sinks, atol):
    """``numattn.torch.attention``'s gradients of q, k, v (and the sinks) against float64 autograd's."""
    import numattn.torch as numattn_torch

    alibi = slopes if options.get("alibi") else None
    sink = sinks.detach().clone().requires_grad_() if options.get("sinks") else None
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    kept = {name: value for name, value in options.items() if name not in ("alibi", "sinks")}
    numattn_torch.attention(*leaves, alibi_slopes=alibi, sinks=sink, **kept).backward(do)
    expected = float64_training_step(q, k, v, do, kept.get("causal", False), kept.get("window"), kept.get("softcap"),
                                     alibi, sink)
    got = [x.grad for x in leaves] + ([sink.grad] if sink is not None else [])
    for name, g, e in zip(("dq", "dk", "dv", "dsinks"), got, expected, strict=False):
        error = (g.double() - e).abs().max().item()
        assert error <= atol * (1 + e.abs().max().item()), (options, name, error)


@pytest.mark.parametrize("path, dtype, head_dim", [("cpu", "float32", 64), ("simulator", "float32", 64),
                                                   ("simulator", "float16", 64), ("simulator", "bfloat16", 48)],
                         ids=["cpu", "cuda-cores", "wgmma", "mma"])
def test_gradients_with_options(rng, path, dtype, head_dim):
    """The backward with each option set, GQA, more keys than queries: the CPU path, and in the simulator the
    CUDA-core kernels (float32), the wgmma kernel (head dim 64) and the mma.sync kernel (48), the sinks'
    gradient included, against float64 autograd."""
    torch = pytest.importorskip("torch")

    q, k, v = (torch.from_numpy(x).to(getattr(torch, dtype)) for x in random_qkv(rng, 1, 4, 2, 37, 45, head_dim))
    do = torch.from_numpy(rng.standard_normal(q.shape, np.float32)).to(q.dtype)
    slopes, sinks = torch.from_numpy(per_head(rng, 4)), torch.from_numpy(rng.standard_normal(4, np.float32) + 1)
    atol = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}[dtype]
    with numattn.simulate(path == "simulator"):
        for options in TRAINING_OPTION_SETS if path == "cpu" or dtype == "float16" else TRAINING_OPTION_SETS[2:]:
            check_gradients(q, k, v, do, options, slopes, sinks, atol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, shape", [
    ("bfloat16", (2, 8, 2, 1000, 1000, 128)),
    ("float16", (1, 4, 4, 333, 777, 64)),
    ("float16", (1, 4, 2, 300, 300, 96)),
    ("bfloat16", (1, 2, 1, 200, 150, 256)),
    ("float32", (1, 2, 1, 200, 150, 40)),
], ids=["bf16-d128-gqa", "fp16-d64-longer-keys", "fp16-d96", "bf16-d256-fewer-keys", "fp32-d40"])
def test_on_gpu_against_float64_and_low_precision(rng, dtype, shape):
    """Every option, windows of 0, 1, 127 keys and wider than the sequence, on the GPU's kernels (wgmma for
    head dims multiples of 64 on sm_90, mma.sync for 96, CUDA cores for float32, and the mma.sync kernel with
    its keys split, merged in clusters on sm_90): within twice the error of the same computation in the low
    precision, plus one unit in the last place of the largest output."""
    import torch

    from numattn.configs.attention import MmaConfig
    from numattn.ops.attention import make_plan, validate

    batch, heads_q, heads_kv, seqlen_q, seqlen_kv, head_dim = shape
    q, k, v = (t.cuda() for t in as_dtype(random_qkv(rng, batch, heads_q, heads_kv, seqlen_q, seqlen_kv, head_dim),
                                          dtype, "torch"))
    slopes = torch.from_numpy(per_head(rng, heads_q, batch=batch)).cuda()
    sinks = torch.from_numpy(rng.standard_normal(heads_q, np.float32)).cuda()
    option_sets = [dict(causal=True, window=(0, 0)), dict(window=(1, 1)), dict(causal=True, window=(127, 0)),
                   dict(causal=True, window=(5000, None)), dict(softcap=5.0, causal=True),
                   dict(alibi_slopes=slopes), dict(sinks=sinks, causal=True),
                   dict(causal=True, window=(127, 0), softcap=30.0, alibi_slopes=slopes[0], sinks=sinks)]
    for options in option_sets:
        options = dict(dict(causal=False, window=None, softcap=None, alibi_slopes=None, sinks=None), **options)
        ref_o = reference.attention(q, k, v, **options)
        allowance = low_precision_allowance(q, k, v, ref_o, options)
        runs = [numattn.attention(q, k, v, **options)]
        if dtype != "float32" and head_dim <= 128:
            problem = validate(q, k, v, None, options["causal"], None, "bhsd", False, options["window"],
                               options["softcap"], options["alibi_slopes"], options["sinks"])
            runs.append(make_plan(problem, MmaConfig(64, 4, 1, True), 3)(q, k, v, None, options["alibi_slopes"],
                                                                        options["sinks"]))
        for o in runs:
            assert max_error(o, ref_o) <= allowance + 1e-6, (options, max_error(o, ref_o), allowance)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_decode_on_gpu_with_options(rng, dtype):
    """Decode at a realistic size on the GPU (the tensor-core kernel in bf16, the CUDA-core one in float32, the
    keys split as the heuristic chooses) with each option set, one and four new tokens, contiguous and paged
    caches, and a decode plan; sequences of 0, 1 and thousands of keys."""
    import torch

    from numattn.bench import paged_copy

    batch, heads_q, heads_kv, capacity, head_dim = 4, 32, 8, 3000, 128
    tdtype = getattr(torch, dtype)
    k, v = (torch.randn(batch, heads_kv, capacity, head_dim, device="cuda", dtype=tdtype) for _ in range(2))
    lengths = torch.tensor([3000, 0, 1, 1777], dtype=torch.int32, device="cuda")
    k_pages, v_pages, table = paged_copy(torch, k, v, 16)
    for seqlen_q in (1, 4):
        q = torch.randn(batch, heads_q, seqlen_q, head_dim, device="cuda", dtype=tdtype)
        for options in DECODE_OPTION_SETS + [dict(window=(1000, None), sinks=True)]:
            options = decode_options(rng, options, batch, heads_q)
            options = {name: torch.from_numpy(x).cuda() if isinstance(x, np.ndarray) else x
                       for name, x in options.items()}
            ref_o, ref_lse = reference.decode(q, k, v, seqlens=lengths, return_lse=True, **options)
            o, lse = numattn.decode(q, k, v, seqlens=lengths, return_lse=True, **options)
            assert max_error(o, ref_o) <= ATOL[dtype], options
            np.testing.assert_allclose(lse.cpu().numpy(), ref_lse, atol=1e-4)
            paged = numattn.paged_decode(q, k_pages, v_pages, table, lengths, **options)
            assert max_error(paged, ref_o) <= ATOL[dtype], options
            planned = numattn.decode_plan(q, k, v, seqlens=lengths, **options)(q)
            assert max_error(planned, ref_o) <= ATOL[dtype], options


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, head_dim", [("bfloat16", 128), ("float16", 96), ("float32", 64)],
                         ids=["wgmma", "mma", "cuda-cores"])
def test_gradients_on_gpu_with_options(rng, dtype, head_dim):
    """``numattn.torch.attention``'s backward on the GPU with each option set and windows of 127 keys, GQA,
    lengths off the tiles: the wgmma (bf16, head dim 128), mma.sync (fp16, 96) and CUDA-core (float32)
    kernels against float64 autograd."""
    import torch

    q, k, v = (torch.from_numpy(x).to("cuda", getattr(torch, dtype))
               for x in random_qkv(rng, 2, 8, 2, 700, 900, head_dim))
    do = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    slopes = torch.from_numpy(per_head(rng, 8, batch=2)).cuda()
    sinks = torch.from_numpy(rng.standard_normal(8, np.float32) + 1).cuda()
    atol = {"float32": 2e-4, "float16": 2e-2, "bfloat16": 8e-2}[dtype]
    for options in TRAINING_OPTION_SETS + [dict(causal=True, window=(127, 0), softcap=30.0, alibi=True, sinks=True)]:
        check_gradients(q, k, v, do, options, slopes, sinks, atol)
