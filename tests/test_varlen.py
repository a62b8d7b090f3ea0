"""``numattn.attention_varlen``: packed variable-length batches, keys packed or in pages (paged and chunked
prefill), with every score modification; the CPU path and each GPU kernel family (in the simulator) against
the float64 reference; the checks of the index arrays and the errors; on the GPU the low-precision bound."""

import numpy as np
import pytest

import numattn
from numattn import reference

from conftest import ATOL
from helpers import as_dtype, max_error, torch_attention


def offsets(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def packed(rng, lengths_q, lengths_k, heads_q, heads_kv, head_dim, head_dim_v=None):
    """Float32 q, k, v of packed sequences and their cumulative lengths."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    q = rng.standard_normal((sum(lengths_q), heads_q, head_dim), dtype=np.float32)
    k = rng.standard_normal((sum(lengths_k), heads_kv, head_dim), dtype=np.float32)
    v = rng.standard_normal((sum(lengths_k), heads_kv, head_dim_v), dtype=np.float32)
    return q, k, v, offsets(lengths_q), offsets(lengths_k)


def paged(rng, key_counts, page_size, heads_kv, head_dim, spare_pages=3):
    """Float32 key and value pages holding sequences of ``key_counts`` keys in shuffled pages, the page table
    (unused entries -1: never read) and the counts as ``seqused_k``."""
    pages_per_sequence = [-(-n // page_size) for n in key_counts]
    num_pages = sum(pages_per_sequence) + spare_pages
    order = rng.permutation(num_pages)
    table = np.full((len(key_counts), max(1, max(pages_per_sequence))), -1, np.int32)
    start = 0
    for b, count in enumerate(pages_per_sequence):
        table[b, :count] = order[start : start + count]
        start += count
    k = rng.standard_normal((num_pages, page_size, heads_kv, head_dim), dtype=np.float32)
    v = rng.standard_normal((num_pages, page_size, heads_kv, head_dim), dtype=np.float32)
    return k, v, table, np.array(key_counts, np.int32)


def check(o, lse, atol, *args, **options):
    ref_o, ref_lse = reference.attention_varlen(*args, return_lse=True, **options)
    assert max_error(o, ref_o) <= atol, options
    no_key = np.isneginf(ref_lse)
    lse = reference.to_float64(lse)
    np.testing.assert_array_equal(np.isneginf(lse), no_key)
    seen = ~no_key
    assert np.abs(lse[seen] - ref_lse[seen]).max() <= 1e-5 * (1 + np.abs(ref_lse[seen]).max())


# lengths with an empty sequence, one of a single row, and more keys than queries (chunked prefill)
LENGTHS_Q = [5, 0, 1, 23, 9]
LENGTHS_K = [5, 3, 1, 40, 0]
OPTION_SETS = [
    dict(),
    dict(causal=True),
    dict(causal=True, window=(0, 0)),
    dict(causal=True, window=(1, -1), sinks=True),
    dict(window=(7, 3), softcap=4.0, alibi=True),
    dict(causal=True, window=(127, 0), softcap=2.0, alibi=True, sinks=True),
]


def resolved(rng, options, batch, heads):
    """``options`` with random ALiBi slopes (per sequence) and sinks where asked for."""
    options = dict(options)
    if options.pop("alibi", False):
        options["alibi_slopes"] = rng.uniform(0.01, 0.5, (batch, heads)).astype(np.float32)
    if options.pop("sinks", False):
        options["sinks"] = rng.standard_normal(heads).astype(np.float32)
    return options


def test_cpu_path_packed_and_paged(rng):
    """The CPU path: packed keys, packed keys cut by ``seqused_k``, paged keys; GQA, empty sequences."""
    q, k, v, cu_q, cu_k = packed(rng, LENGTHS_Q, LENGTHS_K, 4, 2, 32)
    k_pages, v_pages, table, used = paged(rng, [7, 3, 1, 40, 0], 6, 2, 32)
    cut = np.array([5, 1, 0, 33, 0], np.int32)
    with numattn.simulate(False):
        for base in OPTION_SETS:
            options = resolved(rng, base, len(LENGTHS_Q), 4)
            calls = [((q, k, v, cu_q, cu_k), {}), ((q, k, v, cu_q, cu_k), dict(seqused_k=cut)),
                     ((q, k_pages, v_pages, cu_q, None), dict(page_table=table, seqused_k=used))]
            for args, where in calls:
                o, lse = numattn.attention_varlen(*args, 23, 40, return_lse=True, **where, **options)
                assert o.shape == (sum(LENGTHS_Q), 4, 32) and lse.shape == (4, sum(LENGTHS_Q))
                check(o, lse, ATOL["float32"], *args, **where, **options)


def test_each_sequence_is_its_own_attention(rng):
    """A packed batch gives what ``attention`` gives each sequence alone (query positions bottom-right
    aligned within the sequence)."""
    q, k, v, cu_q, cu_k = packed(rng, [4, 11], [9, 11], 2, 2, 16)
    o = numattn.attention_varlen(q, k, v, cu_q, cu_k, 11, 11, causal=True)
    for b in range(2):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        alone = numattn.attention(q[None, rows], k[None, keys], v[None, keys], causal=True, layout="bshd")
        np.testing.assert_allclose(o[rows], alone[0], atol=1e-6)


def kernels():
    from numattn.configs.attention import MmaConfig, WgmmaConfig

    return {
        "wgmma": (WgmmaConfig(block_n=16, warpgroups=1, stages=2), "float16"),
        "mma": (MmaConfig(block_n=16, num_warps=2), "bfloat16"),
        "simt": (None, "float32"),
    }


@pytest.mark.parametrize("kernel", ["wgmma", "mma", "simt"])
def test_gpu_kernels_in_the_simulator(rng, kernel):
    """Each GPU kernel family on packed keys, packed keys cut by ``seqused_k`` and pages of 5 keys (a page
    boundary inside each key tile), with the options, in the simulator."""
    from numattn.ops.attention import make_plan
    from numattn.ops.varlen import validate_varlen

    config, dtype = kernels()[kernel]
    lengths_q, lengths_k = [3, 0, 19, 1], [4, 2, 25, 0]
    q, k, v, cu_q, cu_k = packed(rng, lengths_q, lengths_k, 2, 1, 64)
    k_pages, v_pages, table, used = paged(rng, [4, 2, 25, 0], 5, 1, 64)
    q, k, v, k_pages, v_pages = as_dtype([q, k, v, k_pages, v_pages], dtype)
    cut = np.array([4, 0, 20, 0], np.int32)
    # the wgmma kernel simulates slowly: every option at once only (plain causal runs on the GPU tests)
    for base in (OPTION_SETS[5],) if kernel == "wgmma" else (OPTION_SETS[1], OPTION_SETS[5]):
        options = resolved(rng, base, 4, 2)
        alibi, sinks = options.get("alibi_slopes"), options.get("sinks")
        for args, seqused, table_arg in (((q, k, v, cu_q, cu_k), None, None), ((q, k, v, cu_q, cu_k), cut, None),
                                         ((q, k_pages, v_pages, cu_q, None), used, table)):
            problem = validate_varlen(*args, 19, 25, None, options.get("causal", False), None, True,
                                      options.get("window"), options.get("softcap"), alibi, sinks, table_arg, seqused)
            o, lse = make_plan(problem, config)(*args[:3], None, alibi, sinks, *args[3:], seqused, table_arg)
            check(o, lse, ATOL[dtype], *args, seqused_k=seqused, page_table=table_arg, **options)


@pytest.mark.parametrize("kernel", ["wgmma", "mma"])
def test_key_splits_of_packed_sequences_in_the_simulator(rng, kernel):
    """The tensor-core kernels with each query tile's keys split into runs, merged by its last block into the
    sequence's rows of the packed output: packed and paged keys, empty and one-row sequences, every option;
    five runs take the merge's rounds of four twice, and runs past a sequence's keys see none."""
    from numattn.ops.attention import make_plan
    from numattn.ops.varlen import validate_varlen

    config, dtype = kernels()[kernel]
    lengths_q, lengths_k = [3, 0, 19, 1], [4, 2, 70, 0]
    q, k, v, cu_q, cu_k = packed(rng, lengths_q, lengths_k, 2, 1, 64)
    k_pages, v_pages, table, used = paged(rng, lengths_k, 5, 1, 64)
    q, k, v, k_pages, v_pages = as_dtype([q, k, v, k_pages, v_pages], dtype)
    options = resolved(rng, OPTION_SETS[5], 4, 2)
    alibi, sinks = options.get("alibi_slopes"), options.get("sinks")
    splits = 3 if kernel == "wgmma" else 5  # 5 key tiles: runs of 2, 2 and 1 tiles; a tile each
    for args, seqused, table_arg in (((q, k, v, cu_q, cu_k), None, None),
                                     ((q, k_pages, v_pages, cu_q, None), used, table)):
        problem = validate_varlen(*args, 19, 70, None, True, None, True, options.get("window"),
                                  options.get("softcap"), alibi, sinks, table_arg, seqused)
        plan = make_plan(problem, config, splits)
        assert plan.splits == splits
        o, lse = plan(*args[:3], None, alibi, sinks, *args[3:], seqused, table_arg)
        check(o, lse, ATOL[dtype], *args, seqused_k=seqused, page_table=table_arg, **options)


def test_keys_of_other_sequences_and_unused_pages_are_never_read(rng):
    """NaN in the keys and values outside every sequence's range (past ``seqused_k``, in pages no sequence
    uses) leave the output finite: no kernel reads them."""
    q, k, v, cu_q, cu_k = packed(rng, [6, 10], [8, 12], 2, 2, 64)
    q, k, v = as_dtype([q, k, v], "float16")
    used = np.array([5, 12], np.int32)
    k[5:8], v[5:8] = np.nan, np.nan  # sequence 0's keys past seqused_k
    k_pages, v_pages, table, counts = paged(rng, [8, 12], 4, 2, 64)
    k_pages, v_pages = as_dtype([k_pages, v_pages], "float16")
    unused = np.setdiff1d(np.arange(len(k_pages)), table[table >= 0])
    k_pages[unused], v_pages[unused] = np.nan, np.nan
    o = numattn.attention_varlen(q, k, v, cu_q, cu_k, 10, 12, causal=True, seqused_k=used)
    assert np.isfinite(o).all()
    o = numattn.attention_varlen(q, k_pages, v_pages, cu_q, None, 10, 12, page_table=table, seqused_k=counts)
    assert np.isfinite(o).all()


def test_plans_come_from_the_cache_with_the_arrays_of_the_call(rng, fresh_plans):
    """A second call with other index values (same shapes) runs with its own values, not the first call's."""
    torch = pytest.importorskip("torch")
    q, k, v, cu_q, cu_k = packed(rng, [6, 10], [6, 10], 2, 1, 16)
    q, k, v = (torch.from_numpy(x) for x in (q, k, v))
    for lengths in ([6, 10], [10, 6], [16, 0]):
        cu = torch.from_numpy(offsets(lengths))
        o = numattn.attention_varlen(q, k, v, cu, cu, 16, 16, causal=True)
        assert max_error(o, reference.attention_varlen(q, k, v, cu, cu, causal=True)) <= ATOL["float32"]
    assert len(fresh_plans) == 1


def test_unchecked_bad_offsets_read_nothing_outside(rng):
    """With ``check=False`` offsets past the rows and pages outside the page array are clamped: the call
    returns finite values and no kernel reads out of bounds."""
    q, k, v, cu_q, _ = packed(rng, [4, 4], [4, 4], 2, 1, 16)
    bad = np.array([0, 4, 100], np.int32)
    o = numattn.attention_varlen(q, k, v, cu_q, bad, 4, 4, check=False)
    assert np.isfinite(o).all()
    k_pages, v_pages, table, used = paged(rng, [4, 4], 4, 1, 16)
    table[1, 0] = 999
    o = numattn.attention_varlen(q, k_pages, v_pages, cu_q, None, 4, 4, page_table=table, seqused_k=used, check=False)
    assert np.isfinite(o).all()


def test_the_gpu_check_finds_what_the_host_check_finds():
    """The GPU's check of a varlen call's index arrays (``kernels/index_check.py``, run on host arrays here)
    records the same bad value as the host check, for each kind of bad value alone."""
    from numattn.kernels import index_check
    from numattn.kernels.launch import compiled
    from numattn.ops.checks import first_varlen_problem

    def on_gpu(cu_q, cu_k, used, table, total_q=8, total_k=10, max_seqlen_q=5, max_seqlen_k=10, page_size=4,
               num_pages=6):
        claim, record = np.zeros(1, np.int32), np.zeros(index_check.RECORD_WORDS, np.int32)
        kernel = compiled(index_check.varlen_check_kernel(cu_k is not None, used is not None, table is not None),
                          None, 0, 0, "varlen index check")
        placeholders = (np.zeros(1, np.int32), np.zeros(1, np.int32), np.zeros((1, 1), np.int32))
        cu_k_arg, used_arg, table_arg = (x if x is not None else empty for x, empty in zip((cu_k, used, table),
                                                                                          placeholders, strict=True))
        grid = index_check.grid(len(cu_q) - 1, table_arg.shape[1])
        kernel.launch_arrays(grid, index_check.THREADS, cu_q, cu_k_arg, used_arg, table_arg, total_q, total_k,
                             max_seqlen_q, max_seqlen_k, page_size, num_pages, claim, record)
        return record.tolist()

    def on_host(cu_q, cu_k, used, table, total_q=8, total_k=10, max_seqlen_q=5, max_seqlen_k=10, page_size=4,
                num_pages=6):
        found = first_varlen_problem(cu_q, cu_k, used, table, total_q, total_k, max_seqlen_q, max_seqlen_k, page_size,
                                     num_pages)
        return [0] * index_check.RECORD_WORDS if found is None else [int(x) for x in found]

    i32 = lambda *values: np.array(values, np.int32)  # noqa: E731
    table = i32([0, 1], [2, 3])
    cases = [
        (i32(0, 3, 8), i32(0, 4, 10), None, None),  # good
        (i32(1, 3, 8), i32(0, 4, 10), None, None),
        (i32(0, 3, 8), i32(0, 6, 5), None, None),
        (i32(0, 3, 9), i32(0, 4, 10), None, None),
        (i32(0, 2, 8), i32(0, 4, 10), None, None),  # 6 queries, max_seqlen_q 5
        (i32(0, 3, 8), i32(0, 4, 10), None, None, 8, 10, 5, 5),  # 6 keys, max_seqlen_k 5
        (i32(0, 3, 8), None, i32(4, 7), table, 8, 10, 5, 6),  # 7 keys in pages, max_seqlen_k 6
        (i32(0, 3, 8), i32(0, 4, 11), None, None),
        (i32(0, 3, 8), i32(0, 4, 10), i32(4, 7), None),
        (i32(0, 3, 8), None, i32(4, 9), table),
        (i32(0, 3, 8), None, i32(4, 5), i32([0, 1], [2, 6])),
        (i32(0, 3, 8), None, i32(4, 4), i32([0, 1], [2, 6])),  # the bad page unused
    ]
    for case in cases:
        assert on_gpu(*case) == on_host(*case), case
    assert on_gpu(*cases[0]) == [0] * index_check.RECORD_WORDS and on_gpu(*cases[-1])[0] == 0


def sequence_gradients(q, k, v, do, cu_q, cu_k, sinks=None, dtype=None, **options):
    """``(o, dq, dk, dv, dsinks)`` of packed sequences, each through torch autograd of the helpers' torch attention
    in ``dtype`` (float64 by default: the reference; the inputs' own for the error of a plain low-precision
    implementation)."""
    import torch

    dtype = dtype or torch.float64
    leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    sink = None if sinks is None else sinks.detach().double().requires_grad_()
    slopes = options.pop("alibi_slopes", None)
    o = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=dtype)
    for b in range(len(cu_q) - 1):
        rows, keys = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if rows.stop > rows.start:
            alone = torch_attention(*(x[None, span].transpose(1, 2) for x, span in zip(leaves, (rows, keys, keys),
                                                                                       strict=True)),
                                    options.get("causal", False), options.get("window"), options.get("softcap"),
                                    None if slopes is None else (slopes[b] if slopes.dim() == 2 else slopes).double(),
                                    sink)
            o[rows] = alone[0].transpose(0, 1).to(dtype)
    o.backward(do.to(dtype))
    return o, *(x.grad for x in leaves), None if sink is None else sink.grad


@pytest.mark.parametrize("path, dtype, head_dim", [("cpu", "float32", 32), ("simulator", "float32", 32),
                                                   ("simulator", "float16", 48), ("simulator", "bfloat16", 64),
                                                   ("simulator", "bfloat16", 128)],
                         ids=["cpu", "cuda-cores", "mma", "wgmma", "wgmma-producer"])
def test_gradients_of_packed_sequences(rng, path, dtype, head_dim):
    """``numattn.torch.attention_varlen``'s gradients (the sinks' too) with options, GQA, an empty sequence, one
    of a single row and more keys than queries: the CPU path, and in the simulator each backward kernel family
    (the CUDA-core kernels, mma.sync at head dim 48, wgmma at 64, and at 128 beside a producer warpgroup, with
    key blocks that visit no query tile or fewer than its stages), against float64 autograd."""
    torch = pytest.importorskip("torch")
    import numattn.torch as numattn_torch

    heads_q, heads_kv = (2, 1) if head_dim >= 64 else (4, 2)  # the wgmma kernels simulate slowly: fewer heads
    q, k, v, cu_q, cu_k = packed(rng, [3, 0, 19, 1, 7], [4, 2, 25, 3, 7], heads_q, heads_kv, head_dim)
    q, k, v = (torch.from_numpy(x).to(getattr(torch, dtype)) for x in (q, k, v))
    cu_q, cu_k = torch.from_numpy(cu_q), torch.from_numpy(cu_k)
    do = torch.from_numpy(rng.standard_normal(q.shape, np.float32)).to(q.dtype)
    atol = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}[dtype]
    for base in (OPTION_SETS[1], OPTION_SETS[5]) if path == "cpu" else (OPTION_SETS[5],):  # the simulator is slow
        options = {name: torch.from_numpy(x) if isinstance(x, np.ndarray) else x
                   for name, x in resolved(rng, base, 5, heads_q).items()}
        sinks = options.pop("sinks", None)
        sink = None if sinks is None else sinks.clone().requires_grad_()
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        with numattn.simulate(path == "simulator"):
            numattn_torch.attention_varlen(*leaves, cu_q, cu_k, 19, 25, sinks=sink, **options).backward(do)
        expected = sequence_gradients(q, k, v, do, cu_q, cu_k, sinks, **options)[1:]
        for name, got, want in zip(("dq", "dk", "dv", "dsinks"), [x.grad for x in leaves] + [
                None if sink is None else sink.grad], expected, strict=True):
            if want is not None:
                error = (got.double() - want).abs().max().item()
                assert error <= atol * (1 + want.abs().max().item()), (options, name, error)


def _arguments(rng):
    q, k, v, cu_q, cu_k = packed(rng, [3, 5], [4, 6], 4, 2, 16)
    k_pages, v_pages, table, used = paged(rng, [4, 6], 4, 2, 16)
    return dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5, max_seqlen_k=6), dict(
        k=k_pages, v=v_pages, cu_seqlens_k=None, page_table=table, seqused_k=used)


@pytest.mark.parametrize("change, error, match", [
    (dict(q=np.ones((8, 4, 16, 1), np.float32)), ValueError, r"q must be 3-D \(total_q, num_heads_q, head_dim\)"),
    (dict(k=np.ones((10, 2, 8), np.float32)), ValueError, "k head_dim must equal q head_dim 16, got 8"),
    (dict(v=np.ones((9, 2, 16), np.float32)), ValueError, "k and v must have the same rows"),
    (dict(k=np.ones((10, 3, 16), np.float32), v=np.ones((10, 3, 16), np.float32)), ValueError,
     r"query heads \(4\) must be a multiple of key/value heads \(3\)"),
    (dict(q=np.ones((8, 4, 16), np.float16)), TypeError, "q, k and v must share one dtype"),
    (dict(cu_seqlens_q=np.array([0, 3, 8], np.int64)), TypeError, "cu_seqlens_q must have dtype int32, got int64"),
    (dict(cu_seqlens_q=np.array([0], np.int32)), ValueError, "cu_seqlens_q must have batch \\+ 1 >= 2 entries"),
    (dict(cu_seqlens_k=np.array([0, 10], np.int32)), ValueError, "cu_seqlens_k must have batch \\+ 1 = 3 entries"),
    (dict(cu_seqlens_k=None), ValueError, "cu_seqlens_k is required unless the keys are paged"),
    (dict(max_seqlen_q=5.0), TypeError, "max_seqlen_q must be an int, got float"),
    (dict(max_seqlen_k=0), ValueError, r"max_seqlen_k must be in \[1, 2\*\*31 - 1\], got 0"),
    (dict(cu_seqlens_q=np.array([1, 3, 8], np.int32)), ValueError, "cu_seqlens_q must start at 0"),
    (dict(cu_seqlens_q=np.array([0, 4, 3], np.int32)), ValueError, r"cu_seqlens_q must not decrease, got "
     r"cu_seqlens_q\[1\] = 4 > cu_seqlens_q\[2\] = 3"),
    (dict(cu_seqlens_q=np.array([0, 3, 9], np.int32)), ValueError, r"cu_seqlens_q\[-1\] = 9 must equal total_q"),
    (dict(cu_seqlens_q=np.array([0, 3, 7], np.int32)), ValueError, r"cu_seqlens_q\[-1\] = 7 must equal total_q"),
    (dict(max_seqlen_q=4), ValueError, "sequence 1 has 5 queries .* more than max_seqlen_q = 4"),
    (dict(max_seqlen_k=5), ValueError, "sequence 1 has 6 keys, more than max_seqlen_k = 5"),
    (dict(cu_seqlens_k=np.array([0, 4, 11], np.int32)), ValueError, r"cu_seqlens_k\[-1\] = 11 exceeds total_k"),
    (dict(seqused_k=np.array([4, 7], np.int32)), ValueError, r"seqused_k\[1\] = 7 is not in \[0, 6\]"),
    (dict(seqused_k=np.array([4], np.int32)), ValueError, r"seqused_k must have one entry per sequence \(2\)"),
    (dict(page_table=np.zeros((2, 2), np.int32)), ValueError, "k must be 4-D .* with page_table"),
    (dict(check="yes"), TypeError, "check must be a bool, got str"),
    (dict(out=np.ones((8, 4, 8), np.float32)), ValueError, r"out must have shape \(8, 4, 16\)"),
])
def test_bad_arguments_name_the_argument(rng, change, error, match):
    arguments, _ = _arguments(rng)
    arguments.update(change)
    with pytest.raises(error, match=match):
        numattn.attention_varlen(**arguments)


@pytest.mark.parametrize("change, error, match", [
    (dict(seqused_k=None), ValueError, r"a paged call needs the key counts: seqused_k"),
    (dict(seqused_k=np.array([4, 13], np.int32)), ValueError, r"seqused_k\[1\] = 13 is not in \[0, 8\] "
     r"\(max_pages \* page_size\)"),
    (dict(page_table=np.array([[0, 1], [2, 40]], np.int32)), ValueError,
     r"page_table\[1, 1\] = 40 is not a page index in \[0, 6\)"),
    (dict(page_table=np.zeros((3, 2), np.int32)), ValueError, "page_table must be \\(batch, max_pages\\) with batch 2"),
    (dict(k=np.ones((7, 4, 2, 16), np.float32)), ValueError, "k and v must have the same pages"),
    (dict(seqused_k=np.array([4, 3], np.int32), max_seqlen_k=3), ValueError,
     "sequence 0 has 4 keys, more than max_seqlen_k = 3"),
])
def test_bad_paged_arguments_name_the_argument(rng, change, error, match):
    arguments, paged_arguments = _arguments(rng)
    arguments.update(paged_arguments)
    arguments.update(change)
    with pytest.raises(error, match=match):
        numattn.attention_varlen(**arguments)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, head_dim", [("bfloat16", 128), ("float16", 64)])
def test_key_splits_of_packed_sequences_on_gpu(rng, dtype, head_dim):
    """On the GPU: a few sequences of few queries over many keys (chunked prefill), packed and paged, with a
    query tile's keys split into runs by the tensor-core kernel of the device (the wgmma kernel without a
    producer on sm_90, else mma.sync); outputs poisoned, against the float64 reference."""
    torch = pytest.importorskip("torch")
    from numattn.configs.attention import MmaConfig, WgmmaConfig
    from numattn.ops.attention import make_plan
    from numattn.ops.varlen import validate_varlen

    config = WgmmaConfig(128, 2, 3) if torch.cuda.get_device_capability() == (9, 0) else MmaConfig(64, 4, 1, True, 2)
    lengths_q, lengths_k = [130, 0, 1, 64], [3000, 7, 1200, 4096]
    q, k, v, cu_q, cu_k = packed(rng, lengths_q, lengths_k, 8, 2, head_dim)
    k_pages, v_pages, table, used = paged(rng, lengths_k, 16, 2, head_dim)
    q_t, k_t, v_t, kp_t, vp_t = (torch.from_numpy(x).to(getattr(torch, dtype)).cuda()
                                 for x in (q, k, v, k_pages, v_pages))
    cu_q_t, cu_k_t, table_t, used_t = (torch.from_numpy(x).cuda() for x in (cu_q, cu_k, table, used))
    for options in (dict(causal=True), dict(causal=True, window=(700, 0), softcap=20.0, sinks=torch.randn(8, device="cuda"))):
        sinks = options.get("sinks")
        for args, seqused, page_table in (((q_t, k_t, v_t, cu_q_t, cu_k_t), None, None),
                                          ((q_t, kp_t, vp_t, cu_q_t, None), used_t, table_t)):
            problem = validate_varlen(*args, 130, 4096, None, options["causal"], None, True, options.get("window"),
                                      options.get("softcap"), None, sinks, page_table, seqused)
            for splits in (1, 4, 7):
                out = torch.full_like(q_t, float("nan"))  # poisoned
                o, lse = make_plan(problem, config, splits)(*args[:3], out, None, sinks, *args[3:], seqused,
                                                            page_table)
                check(o, lse, ATOL[dtype], *args, seqused_k=seqused, page_table=page_table, **options)
            # the default: on sm_90 the same kernel in 2 runs per query tile (4 × 8 × 2 query tiles), but with a window
            splitting = isinstance(config, WgmmaConfig) and "window" not in options
            assert make_plan(problem).splits == (2 if splitting else 1)
            out = torch.full_like(q_t, float("nan"))
            o, lse = numattn.attention_varlen(*args, 130, 4096, return_lse=True, out=out, seqused_k=seqused,
                                              page_table=page_table, **options)
            check(o, lse, ATOL[dtype], *args, seqused_k=seqused, page_table=page_table, **options)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 80])
def test_on_gpu_against_float64_and_low_precision(rng, dtype, head_dim):
    """On the GPU, torch tensors: packed and paged keys with options; the error is at most twice that of the
    same computation in the low precision (torch's SDPA of each sequence, after rounding the inputs) plus an ulp."""
    torch = pytest.importorskip("torch")
    lengths_q, lengths_k = [1, 0, 300, 77, 128], [1, 5, 300, 200, 128]
    q, k, v, cu_q, cu_k = packed(rng, lengths_q, lengths_k, 8, 2, head_dim)
    k_pages, v_pages, table, used = paged(rng, lengths_k, 16, 2, head_dim)
    cuda = [torch.from_numpy(x).to(getattr(torch, dtype)).cuda() for x in (q, k, v, k_pages, v_pages)]
    q_t, k_t, v_t, kp_t, vp_t = cuda
    cu_q_t, cu_k_t, table_t, used_t = (torch.from_numpy(x).cuda() for x in (cu_q, cu_k, table, used))
    for options in (dict(causal=True), dict(causal=True, window=(64, 0), softcap=20.0),
                    dict(alibi_slopes=torch.rand(8, device="cuda") / 4, sinks=torch.randn(8, device="cuda"))):
        for args, where in (((q_t, k_t, v_t, cu_q_t, cu_k_t), {}),
                            ((q_t, kp_t, vp_t, cu_q_t, None), dict(page_table=table_t, seqused_k=used_t))):
            out = torch.full_like(q_t[..., :head_dim], float("nan"))  # poisoned
            o = numattn.attention_varlen(*args, 300, 300, out=out, **where, **options)
            ref_o = reference.attention_varlen(*args, **where, **options)
            low = torch.zeros_like(o)
            for b in range(len(lengths_q)):
                rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
                if rows.stop > rows.start:
                    alone = torch_attention(*(x[None].transpose(1, 2) for x in (q_t[rows], k_t[keys], v_t[keys])),
                                            options.get("causal", False), options.get("window"),
                                            options.get("softcap"), options.get("alibi_slopes"), options.get("sinks"))
                    low[rows] = alone[0].transpose(0, 1)
            low_error = max_error(low, ref_o)
            assert max_error(o, ref_o) <= 2 * low_error + ATOL[dtype] / 4, (options, where)


@pytest.mark.gpu
def test_checked_calls_report_bad_offsets_without_a_synchronisation(rng):
    """check=True on CUDA tensors: a bad offset is raised by the next checked call on the GPU, naming it."""
    torch = pytest.importorskip("torch")
    q, k, v, cu_q, cu_k = packed(rng, [3, 5], [4, 6], 4, 2, 64)
    q, k, v, cu_q, cu_k = (torch.from_numpy(x).cuda() for x in (q, k, v, cu_q, cu_k))
    q, k, v = (x.half() for x in (q, k, v))
    numattn.attention_varlen(q, k, v, cu_q, cu_k, 5, 6)
    bad = cu_k.clone()
    bad[2] = 11
    numattn.attention_varlen(q, k, v, cu_q, bad, 5, 6)  # queued; its check reports on the GPU
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=r"cu_seqlens_k\[-1\] = 11 exceeds total_k \(k.shape\[0\]\) = 10 \(found on"):
        numattn.attention_varlen(q, k, v, cu_q, cu_k, 5, 6)
    numattn.attention_varlen(q, k, v, cu_q, cu_k, 5, 6)  # the report was cleared
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, head_dim", [("bfloat16", 128), ("float16", 64), ("float16", 80), ("float32", 64)])
def test_gradients_on_gpu_against_float64_and_low_precision(rng, dtype, head_dim):
    """On the GPU: the gradients of packed sequences with options within twice the error of the same
    computation in the low precision (plus an ulp-scale term), against float64."""
    torch = pytest.importorskip("torch")
    import numattn.torch as numattn_torch

    lengths_q, lengths_k = [1, 0, 300, 77, 128], [1, 5, 300, 200, 128]
    q, k, v, cu_q, cu_k = packed(rng, lengths_q, lengths_k, 8, 2, head_dim)
    q, k, v = (torch.from_numpy(x).to(getattr(torch, dtype)) for x in (q, k, v))
    do = torch.from_numpy(rng.standard_normal(q.shape, np.float32)).to(q.dtype)
    cu_q_t, cu_k_t = torch.from_numpy(cu_q), torch.from_numpy(cu_k)
    for options in (dict(causal=True), dict(causal=True, window=(64, 0), softcap=20.0,
                                            alibi_slopes=torch.rand(8) / 4)):
        sinks = torch.randn(8)
        leaves = [x.cuda().requires_grad_() for x in (q, k, v)]
        sink = sinks.cuda().requires_grad_()
        gpu_options = {n: x.cuda() if isinstance(x, torch.Tensor) else x for n, x in options.items()}
        numattn_torch.attention_varlen(*leaves, cu_q_t.cuda(), cu_k_t.cuda(), 300, 300, sinks=sink,
                                       **gpu_options).backward(do.cuda())
        expected = sequence_gradients(q, k, v, do, cu_q, cu_k, sinks, **dict(options))
        low = sequence_gradients(q, k, v, do, cu_q, cu_k, sinks, dtype=q.dtype, **dict(options))
        for name, got, want, plain in zip(("dq", "dk", "dv"), [x.grad.cpu() for x in leaves], expected[1:4], low[1:4],
                                          strict=True):
            error = (got.double() - want).abs().max().item()
            low_error = (plain.double() - want).abs().max().item()
            assert error <= 2 * low_error + 1e-3 * (1 + want.abs().max().item()), (options, name, error, low_error)
        assert (sink.grad.cpu().double() - expected[4]).abs().max().item() <= 1e-2 * (1 + expected[4].abs().max())


@pytest.mark.parametrize("where", [pytest.param("sim", marks=pytest.mark.sim), pytest.param("gpu", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("pages", ["packed", "pages smaller than a tile", "pages larger than a tile"])
@pytest.mark.parametrize("blocks", ["a block per tile", "persistent"])
def test_tensor_copies_of_packed_sequences_stop_at_each_sequence_end(rng, where, pages, blocks, monkeypatch,
                                                                     fresh_plans):
    """The producer's tensor copies over packed sequences and over pages that split a tile into whole boxes: a
    key tile that runs past its sequence's keys (or its ``seqused_k``) is copied with zeros past them, so NaN
    keys and values of a sequence without queries, of unused pages and past each sequence's used keys leave the
    outputs finite and right
    (causal and not; an empty sequence, one of a single key, and one whose last tile takes a stage for the
    third time: the producer's threads wait for it in turn). Three persistent blocks take the query tiles in turn:
    each passes over those past their sequence's rows (a different number in each block, the same rounds of tiles
    in all), and its ring of stages runs on through the tails."""
    if (where == "sim") != numattn.SIMULATOR:
        pytest.skip(f"runs on the {where} target")
    from numattn.configs.attention import WgmmaConfig
    from numattn.ops import attention as attention_ops
    from numattn.ops.attention import make_plan
    from numattn.ops.varlen import validate_varlen

    persistent = blocks == "persistent"
    if where == "sim":  # small tiles simulate in reasonable time
        config, dtype, head_dim, lengths_q, lengths_k = (
            WgmmaConfig(block_n=16, warpgroups=2 if persistent else 1, stages=2, producer=True, persistent=persistent),
            "float16", 64, [3, 0, 130 if persistent else 19, 1], [4, 3, 90, 1])
    else:
        torch = pytest.importorskip("torch")
        if torch.cuda.get_device_capability() != (9, 0):
            pytest.skip("tensor copies need sm_90")
        config, dtype, head_dim, lengths_q, lengths_k = (
            WgmmaConfig(128, 2, 2 if persistent else 3, producer=True, persistent=persistent), "bfloat16", 128,
            [100, 0, 300, 1], [130, 7, 1000, 1])
    if persistent:  # three blocks take the 16 (simulated) or 24 query tiles, 8 or 14 past their sequence's rows
        limits = attention_ops.device_limits
        monkeypatch.setattr(attention_ops, "device_limits", lambda device: {**limits(device), "sms": 3})
    page_size = {"pages smaller than a tile": config.block_n // 2, "pages larger than a tile": 2 * config.block_n}
    q, k, v, cu_q, cu_k = packed(rng, lengths_q, lengths_k, 2, 1, head_dim)
    if pages == "packed":
        k[cu_k[1]:cu_k[2]], v[cu_k[1]:cu_k[2]] = np.nan, np.nan  # sequence 1: keys, no queries
        k[cu_k[3] - 5:cu_k[3]], v[cu_k[3] - 5:cu_k[3]] = np.nan, np.nan  # sequence 2's last 5 keys, cut off
        keys, seqused, table = (k, v, cu_q, cu_k), np.array(lengths_k, np.int32) - np.array([0, 0, 5, 0], np.int32), None
    else:
        k, v, table, seqused = paged(rng, lengths_k, page_size[pages], 1, head_dim)
        unused = np.setdiff1d(np.arange(len(k)), table[table >= 0])
        k[unused], v[unused] = np.nan, np.nan
        for b, n in enumerate(lengths_k):  # past each sequence's keys in its last page
            if n % page_size[pages]:
                last = table[b, n // page_size[pages]]
                k[last, n % page_size[pages]:], v[last, n % page_size[pages]:] = np.nan, np.nan
        keys = (k, v, cu_q, None)
    q, k, v = as_dtype([q, *keys[:2]], dtype)
    args = (q, k, v, *keys[2:])
    for causal in (False, True):
        problem = validate_varlen(*args, max(lengths_q), max(lengths_k), None, causal, None, True, None, None, None,
                                  None, table, seqused)
        plan = make_plan(problem, config)
        assert plan.tensor_copies if where == "sim" else plan.device_plan.tensor_maps is not None
        o, lse = plan(q, k, v, None, None, None, *args[3:], seqused, table)
        assert np.isfinite(reference.to_float64(o)).all(), causal
        check(o, lse, ATOL[dtype], *args, seqused_k=seqused, page_table=table, causal=causal)


@pytest.mark.parametrize("where", [pytest.param("sim", marks=pytest.mark.sim), pytest.param("gpu", marks=pytest.mark.gpu)])
def test_persistent_blocks_of_equal_packed_sequences_with_options(rng, where, monkeypatch, fresh_plans):
    """Packed sequences of equal lengths, which the default gives persistent blocks on sm_90 (on the GPU the
    default's plan, in the simulator the same kind of configuration with small tiles): three blocks take the
    query tiles in turn with a window and sinks, and with ALiBi slopes per sequence (options whose default kernel
    has a producer; with a softcap it has none), against the float64 reference."""
    if (where == "sim") != numattn.SIMULATOR:
        pytest.skip(f"runs on the {where} target")
    from numattn.configs.attention import WgmmaConfig
    from numattn.ops import attention as attention_ops
    from numattn.ops.attention import make_plan
    from numattn.ops.varlen import validate_varlen

    if where == "sim":  # small tiles simulate in reasonable time
        config, dtype, head_dim, length, heads = (
            WgmmaConfig(block_n=16, warpgroups=2, stages=2, producer=True, persistent=True), "float16", 64, 40, 2)
    else:
        torch = pytest.importorskip("torch")
        if torch.cuda.get_device_capability() != (9, 0):
            pytest.skip("persistent blocks need sm_90")
        config, dtype, head_dim, length, heads = None, "bfloat16", 128, 300, 4
    limits = attention_ops.device_limits  # three blocks take the 6 (simulated) or 36 query tiles
    monkeypatch.setattr(attention_ops, "device_limits", lambda device: {**limits(device), "sms": 3})
    batch = 3
    q, k, v, cu, _ = packed(rng, [length] * batch, [length] * batch, heads, heads // 2, head_dim)
    q, k, v = as_dtype([q, k, v], dtype)
    for options in (dict(causal=True, window=(7, 0), sinks=True), dict(causal=True, alibi=True)):
        options = resolved(rng, options, batch, heads)
        problem = validate_varlen(q, k, v, cu, cu, length, length, None, True, None, True, options.get("window"),
                                  options.get("softcap"), options.get("alibi_slopes"), options.get("sinks"))
        plan = make_plan(problem, config)
        assert plan.config.persistent, plan.config
        o, lse = plan(q, k, v, None, options.get("alibi_slopes"), options.get("sinks"), cu, cu, None, None)
        check(o, lse, ATOL[dtype], q, k, v, cu, cu, **options)


@pytest.mark.parametrize("where", [pytest.param("sim", marks=pytest.mark.sim), pytest.param("gpu", marks=pytest.mark.gpu)])
def test_backward_tensor_copies_of_packed_sequences_stop_at_each_sequence_end(rng, where, monkeypatch,
                                                                                  fresh_plans):
    """The wgmma backward's tensor copies over packed sequences: a query tile that runs past its sequence's rows
    is copied with zeros past them, so NaN queries and output gradients of the next sequence (which has no
    keys) leave the gradients of the sequence before it finite and right; whole tiles come by tensor copies."""
    torch = pytest.importorskip("torch")
    if (where == "sim") != numattn.SIMULATOR:
        pytest.skip(f"runs on the {where} target")
    if where == "gpu" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("tensor copies need sm_90")
    import numattn.ops.backward as backward_ops
    import numattn.torch as numattn_torch
    from numattn.configs.backward import BackwardWgmmaConfig

    config = BackwardWgmmaConfig(2, 1, producer=True, stages=3, ds_stages=2, tensor_copies=True)
    monkeypatch.setattr(backward_ops, "choose_backward_wgmma_config", lambda *_: config)
    lengths_q, lengths_k = [150, 5, 20], [40, 0, 30]  # query tiles of 64: two whole ones, then one past the end
    q, k, v, cu_q, cu_k = packed(rng, lengths_q, lengths_k, 1, 1, 128)
    q[cu_q[1]:cu_q[2]] = np.nan
    device = "cuda" if where == "gpu" else "cpu"
    q, k, v = (torch.from_numpy(x).to(torch.bfloat16).to(device) for x in (q, k, v))
    do = torch.from_numpy(rng.standard_normal(q.shape, np.float32)).to(q.dtype).to(device)
    do[cu_q[1]:cu_q[2]] = torch.nan
    cu_q_t, cu_k_t = (torch.from_numpy(x).to(device) for x in (cu_q, cu_k))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    numattn_torch.attention_varlen(*leaves, cu_q_t, cu_k_t, 150, 40, causal=True).backward(do)
    expected = sequence_gradients(q.cpu(), k.cpu(), v.cpu(), do.cpu(), torch.from_numpy(cu_q), torch.from_numpy(cu_k),
                                  causal=True)[1:4]
    rows = np.r_[cu_q[0]:cu_q[1], cu_q[2]:cu_q[3]]  # every sequence's but the one of NaN
    for name, got, want in zip(("dq", "dk", "dv"), [x.grad.cpu() for x in leaves], expected, strict=True):
        if name == "dq":
            got, want = got[rows], want[rows]
        assert torch.isfinite(got).all(), name
        error = (got.double() - want).abs().max().item()
        assert error <= 3e-2 * (1 + want.abs().max().item()), (name, error)
