"""numattn.decode / paged_decode / merge_states against the float64 reference (simulator on CPU, GPU kernels on a GPU)."""

import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import numattn
from numattn import reference
from numattn.configs.decode import MMA_SPLITTING
from numattn.kernels.decode import MMA_ROWS
from numattn.ops import decode as module

from conftest import ATOL
from helpers import as_dtype, max_error

pytestmark = pytest.mark.sim


def _random(rng, shape, dtype):
    return as_dtype([rng.standard_normal(shape, dtype=np.float32)], dtype)[0]


def _lengths(rng, batch, capacity):
    """Random lengths in [0, capacity], always including 0, 1 and the capacity when the batch allows."""
    lengths = rng.integers(0, capacity + 1, size=batch)
    lengths[: min(3, batch)] = [0, 1, capacity][: min(3, batch)]
    return rng.permutation(lengths).astype(np.int32)


@pytest.mark.parametrize(
    "shape, h100_splits, h200_splits", [((64, 4096), 1, 1), ((8, 32768), 2, 4), ((1, 8192), 16, 16), ((2, 2048), 8, 8)]
)
def test_decode_splits_heuristic(shape, h100_splits, h200_splits):
    """The tensor-core kernel's key splits for Hq 32, Hkv 8 (W1, W2, W3 and a short batch): one block per
    SM on an H100; on an H200's wider memory a second one where each split keeps long runs of keys."""
    batch, capacity = shape
    p = SimpleNamespace(batch=batch, capacity=capacity, heads_q=32, heads_kv=8, seqlen_q=1)
    for dram_gbs, expected in ((3352.3, h100_splits), (4814.3, h200_splits)):
        limits = {"sms": 132, "dram_gbs": dram_gbs}
        assert module._splits(p, MMA_ROWS, *MMA_SPLITTING, limits) == (expected, 1)


@pytest.mark.parametrize(
    "dtype, group, seqlen_q, head_dim, head_dim_v, layout, split_count",
    [
        ("float16", 3, 1, 64, 64, "bhsd", 3),
        ("bfloat16", 1, 1, 128, 64, "bshd", 1),
        ("float32", 8, 1, 32, 32, "bhsd", 2),
        ("float16", 2, 3, 64, 128, "bshd", 2),  # speculative: 3 new tokens, causal among them; head_dim_v > head_dim
        ("float16", 2, 1, 36, 40, "bhsd", 2),  # head dims off the 16-byte loads: element loads
        ("bfloat16", 2, 1, 96, 48, "bhsd", 2),  # tensor cores, rows of 12 and 6 chunks (not dividing a warp)
        ("float32", 2, 1, 24, 18, "bhsd", 3),  # head_dim_v not a multiple of 4: the merge loads single outputs
    ],
)
def test_decode_matches_reference(rng, splits, dtype, group, seqlen_q, head_dim, head_dim_v, layout, split_count):
    splits(split_count)
    batch, heads_kv, max_len = 4, 2, 45
    heads_q = heads_kv * group
    if seqlen_q == 1:
        q = _random(rng, (batch, heads_q, head_dim), dtype)
    else:
        shape = (batch, heads_q, seqlen_q, head_dim) if layout == "bhsd" else (batch, seqlen_q, heads_q, head_dim)
        q = _random(rng, shape, dtype)
    cache = (batch, heads_kv, max_len) if layout == "bhsd" else (batch, max_len, heads_kv)
    k, v = _random(rng, (*cache, head_dim), dtype), _random(rng, (*cache, head_dim_v), dtype)
    lengths = _lengths(rng, batch, max_len)
    o, lse = numattn.decode(q, k, v, seqlens=lengths, layout=layout, return_lse=True)
    ref_o, ref_lse = reference.decode(q, k, v, seqlens=lengths, layout=layout, return_lse=True)
    assert max_error(o, ref_o) <= ATOL[dtype]
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(np.asarray(lse)), finite)
    assert np.abs(np.asarray(lse)[finite] - ref_lse[finite]).max() <= 1e-4
    assert np.all(reference.to_float64(o)[lengths == 0] == 0)  # empty sequences give zeros


def test_decode_whole_cache_and_scale(rng):
    q = _random(rng, (2, 4, 64), "float32")
    k, v = _random(rng, (2, 4, 30, 64), "float32"), _random(rng, (2, 4, 30, 64), "float32")
    assert max_error(numattn.decode(q, k, v, scale=0.3), reference.decode(q, k, v, scale=0.3)) <= ATOL["float32"]


@pytest.mark.parametrize(
    "page_size, kv_layout, dtype, head_dim",
    [(1, "nhd", "float16", 64), (16, "hnd", "bfloat16", 64), (5, "nhd", "float32", 64), (3, "nhd", "float16", 80)],
)
def test_paged_decode_matches_reference(rng, splits, page_size, kv_layout, dtype, head_dim):
    splits(2)
    batch, heads_q, heads_kv = 3, 4, 2
    # several 16-key tiles per warp either way; with pages of one key, more tiles than the ring of page
    # indices holds
    max_pages = 9 if page_size > 1 else 420
    num_pages = batch * max_pages + 4
    pages = (num_pages, page_size, heads_kv, head_dim) if kv_layout == "nhd" else (num_pages, heads_kv, page_size, head_dim)
    k, v = _random(rng, pages, dtype), _random(rng, pages, dtype)
    table = rng.permutation(num_pages)[: batch * max_pages].reshape(batch, max_pages).astype(np.int32)
    lengths = _lengths(rng, batch, max_pages * page_size)
    q = _random(rng, (batch, heads_q, head_dim), dtype)
    o = numattn.paged_decode(q, k, v, table, lengths, kv_layout=kv_layout)
    ref = reference.paged_decode(q, k, v, table, lengths, kv_layout=kv_layout)
    assert max_error(o, ref) <= ATOL[dtype]


def test_csr_page_table_matches_flashinfer_layout(rng):
    page_size = 4
    kv_indptr = np.array([0, 3, 3, 5])
    kv_indices = np.array([7, 2, 5, 0, 1])
    kv_last_page_len = np.array([2, 0, 4])
    table, lengths = numattn.csr_page_table(kv_indptr, kv_indices, kv_last_page_len, page_size)
    assert table.dtype == np.int32 and lengths.dtype == np.int32
    assert np.array_equal(lengths, [10, 0, 8])
    assert np.array_equal(table[0], [7, 2, 5]) and np.array_equal(table[2, :2], [0, 1])
    k = _random(rng, (8, page_size, 1, 32), "float32")
    v = _random(rng, (8, page_size, 1, 32), "float32")
    q = _random(rng, (3, 2, 32), "float32")
    assert max_error(numattn.paged_decode(q, k, v, table, lengths), reference.paged_decode(q, k, v, table, lengths)) <= 2e-5
    with pytest.raises(ValueError, match="kv_last_page_len"):
        numattn.csr_page_table(kv_indptr, kv_indices, np.array([2, 0, 5]), page_size)


def test_merge_states_is_attention_over_the_union(rng):
    q = _random(rng, (1, 2, 5, 32), "float32")
    k, v = _random(rng, (1, 2, 40, 32), "float32"), _random(rng, (1, 2, 40, 32), "float32")
    o_a, lse_a = numattn.attention(q, k[:, :, :15], v[:, :, :15], return_lse=True)
    o_b, lse_b = numattn.attention(q, k[:, :, 15:], v[:, :, 15:], return_lse=True)
    o, lse = numattn.merge_states(o_a, lse_a, o_b, lse_b)
    ref_o, ref_lse = reference.attention(q, k, v, return_lse=True)
    assert max_error(o, ref_o) <= 2e-5
    assert np.abs(lse - ref_lse).max() <= 1e-5
    empty = np.full_like(lse_b, -np.inf)
    o_same, lse_same = numattn.merge_states(o_a, lse_a, np.zeros_like(o_b), empty)  # an empty state changes nothing
    assert np.abs(o_same - o_a).max() <= 1e-6 and np.abs(lse_same - lse_a).max() <= 1e-6


def test_bad_input_errors(rng):
    q = _random(rng, (2, 4, 32), "float32")
    k = _random(rng, (2, 2, 10, 32), "float32")
    pages = _random(rng, (6, 4, 2, 32), "float32")
    table = np.array([[0, 1, 2], [3, 4, 5]], np.int32)
    with pytest.raises(ValueError, match="seqlens must be non-negative"):
        numattn.decode(q, k, k, seqlens=np.array([3, -1], np.int32))
    with pytest.raises(ValueError, match="exceeds the cache length"):
        numattn.decode(q, k, k, seqlens=np.array([3, 11], np.int32))
    with pytest.raises(TypeError, match="seqlens must have dtype int32"):
        numattn.decode(q, k, k, seqlens=np.array([3, 4], np.int64))
    with pytest.raises(ValueError, match="one entry per sequence"):
        numattn.decode(q, k, k, seqlens=np.array([3], np.int32))
    wide = np.ones((2, 2, 10, 1040), np.float32)
    with pytest.raises(ValueError, match="head_dim must be at most 1024, got 1040"):
        numattn.decode(np.ones((2, 4, 1040), np.float32), wide, wide)
    with pytest.raises(ValueError, match=r"page_table\[1, 1\] = 9 is not a page index in \[0, 6\)"):
        numattn.paged_decode(q, pages, pages, np.array([[0, 1, 2], [3, 9, 5]], np.int32), np.array([12, 5], np.int32))
    with pytest.raises(ValueError, match="exceeds max_pages"):
        numattn.paged_decode(q, pages, pages, table, np.array([13, 5], np.int32))
    with pytest.raises(TypeError, match="page_table must have dtype int32"):
        numattn.paged_decode(q, pages, pages, table.astype(np.int64), np.array([3, 5], np.int32))
    with pytest.raises(ValueError, match="query heads"):
        numattn.decode(_random(rng, (2, 3, 32), "float32"), k, k)
    with pytest.raises(ValueError, match="kv_layout must be"):
        numattn.paged_decode(q, pages, pages, table, np.array([3, 5], np.int32), kv_layout="nhwd")
    with pytest.raises(TypeError, match="check must be a bool"):
        numattn.decode(q, k, k, check="yes")
    with pytest.raises(TypeError, match="share one dtype"):
        numattn.decode(q, k.astype(np.float16), k.astype(np.float16))
    # entries past a sequence's last page are not used, so not checked
    o = numattn.paged_decode(q, pages, pages, np.array([[0, -5, 99], [3, 4, 5]], np.int32), np.array([4, 5], np.int32))
    assert np.isfinite(o).all()


def test_decode_writes_into_out(rng):
    """``out=``: a strided view (its neighbours untouched), torch CPU with LSE, the paged form with
    a 4-D query, and clear errors for an output that does not fit."""
    q = _random(rng, (3, 8, 64), "float16")
    k, v = _random(rng, (3, 2, 90, 64), "float16"), _random(rng, (3, 2, 90, 32), "float16")
    lengths = _lengths(rng, 3, 90)
    ref = reference.decode(q, k, v, seqlens=lengths)
    wide = np.full((3, 8, 48), np.nan, np.float16)
    out = wide[:, :, 8:40]
    assert numattn.decode(q, k, v, seqlens=lengths, out=out) is out
    assert max_error(out, ref) <= ATOL["float16"]
    assert np.isnan(wide[:, :, :8]).all() and np.isnan(wide[:, :, 40:]).all()

    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    t_out = torch.full((3, 8, 32), float("nan"), dtype=torch.float16)
    o, lse = numattn.decode(tq, tk, tv, seqlens=torch.from_numpy(lengths), return_lse=True, out=t_out)
    assert o is t_out and max_error(o, ref) <= ATOL["float16"] and lse.shape == (3, 8, 1)

    from numattn.bench import paged_copy

    k_pages, v_pages, table = paged_copy(torch, tk, tv, 16)
    q4 = tq.unsqueeze(2)
    p_out = torch.full((3, 8, 1, 32), float("nan"), dtype=torch.float16)
    assert numattn.paged_decode(q4, k_pages, v_pages, table, torch.from_numpy(lengths), out=p_out) is p_out
    assert max_error(p_out[:, :, 0], ref) <= ATOL["float16"]

    with pytest.raises(ValueError, match=r"out must have shape \(3, 8, 32\)"):
        numattn.decode(q, k, v, out=np.empty((3, 8, 64), np.float16))
    with pytest.raises(TypeError, match="out must have dtype float16"):
        numattn.decode(q, k, v, out=np.empty((3, 8, 32), np.float32))
    with pytest.raises(ValueError, match="out must not overlap itself"):
        numattn.decode(tq, tk, tv, out=torch.empty(3, 8, 1, dtype=torch.float16).expand(3, 8, 32))


def _plan_steps(rng, tq, tk, tv, t_lengths, capacity, device_copy, steps):
    """``steps`` decode steps of a ``decode_plan`` bound to ``tk, tv, t_lengths``: each step writes a new
    key into the caches, grows the lengths in place and takes a fresh query; every output against the
    float64 reference of that step. ``device_copy`` maps a host array to the tensors' device."""
    step = numattn.decode_plan(tq, tk, tv, seqlens=t_lengths, return_lse=True)
    for _ in range(steps):
        grow = np.minimum(t_lengths.cpu().numpy() + 1, capacity).astype(np.int32)
        for b, t in enumerate(grow):
            if t:
                tk[b, :, t - 1] = device_copy(_random(rng, tk.shape[1:2] + tk.shape[3:], "float16"))
        t_lengths.copy_(device_copy(grow))
        q = device_copy(_random(rng, tuple(tq.shape), "float16"))
        o, lse = step(q)
        ref, ref_lse = reference.decode(q, tk, tv, seqlens=t_lengths, return_lse=True)
        assert max_error(o, ref) <= ATOL["float16"]
        finite = np.isfinite(ref_lse)
        assert np.abs(lse.cpu().numpy()[finite] - ref_lse[finite]).max() <= 1e-3
    return step


def test_decode_plan_follows_its_caches(rng, splits):
    """A plan made once runs every step (caches, lengths and page table changed in place), matches
    ``decode``, takes ``out=``, and refuses queries and outputs that do not fit it."""
    splits(2)
    q, k, v = _random(rng, (2, 4, 32), "float16"), _random(rng, (2, 2, 40, 32), "float16"), _random(rng, (2, 2, 40, 32), "float16")
    lengths = np.array([0, 39], np.int32)
    tq, tk, tv, t_lengths = (torch.from_numpy(x.copy()) for x in (q, k, v, lengths))
    step = _plan_steps(rng, tq, tk, tv, t_lengths, 40, torch.from_numpy, 2)

    out = torch.full((2, 4, 32), float("nan"), dtype=torch.float16)
    o, _ = step(tq, out=out, check=False)
    assert o is out and torch.equal(out, numattn.decode(tq, tk, tv, seqlens=t_lengths))
    with pytest.raises(ValueError, match=r"q must match the plan's query \(shape \(2, 4, 32\)"):
        step(tq[:1])
    with pytest.raises(ValueError, match="q must match"):
        step(tq.float())
    with pytest.raises(ValueError, match="q must match"):
        step(q)  # a numpy array for a plan made on torch tensors
    with pytest.raises(ValueError, match=r"out must be a contiguous torch.float16 tensor of shape \(2, 4, 32\)"):
        step(tq, out=torch.empty(2, 4, 64, dtype=torch.float16)[:, :, :32])
    with pytest.raises(TypeError, match="check must be a bool"):
        step(tq, check=1)
    t_lengths[0] = 41
    with pytest.raises(ValueError, match=r"seqlens\[0\] = 41 exceeds"):
        step(tq)

    # the paged form, its page table remapped in place between calls; numpy arrays take decode's path
    from numattn.bench import paged_copy

    k_pages, v_pages, table = paged_copy(torch, tk, tv, 16)
    t_lengths[0] = 40
    paged = numattn.paged_decode_plan(tq, k_pages, v_pages, table, t_lengths)
    assert torch.equal(paged(tq), numattn.paged_decode(tq, k_pages, v_pages, table, t_lengths))
    table[:] = torch.flip(table, (0,))
    assert torch.equal(paged(tq), numattn.paged_decode(tq, k_pages, v_pages, table, t_lengths))
    host = numattn.decode_plan(q, k, v, seqlens=lengths)
    assert np.array_equal(host(q), numattn.decode(q, k, v, seqlens=lengths))


@pytest.mark.gpu
def test_decode_plan_on_gpu(rng):
    """The plan on CUDA tensors (split keys merged in the launch), then captured in a CUDA graph."""
    q = torch.randn(2, 32, 128, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(2, 8, 6000, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    lengths = torch.tensor([5999, 700], dtype=torch.int32, device="cuda")
    step = _plan_steps(rng, q, k, v, lengths, 6000, lambda x: torch.from_numpy(x).cuda(), 3)
    out = torch.empty(2, 32, 128, device="cuda", dtype=torch.float16)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(q, out=out)  # check=True is skipped while capturing
    for _ in range(2):
        q.normal_()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert max_error(out, reference.decode(q, k, v, seqlens=lengths)) <= ATOL["float16"]


@pytest.mark.gpu
def test_decode_plan_from_threads():
    """One plan called from four threads at once, each on its own stream with its own queries: a launch's
    argument block is shared, so every output must still come from its own query."""
    k, v = (torch.randn(1, 2, 300, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    queries = torch.randn(4, 25, 1, 8, 128, device="cuda", dtype=torch.float16)
    step = numattn.decode_plan(queries[0, 0], k, v)
    outputs = [[] for _ in range(4)]

    def work(t):
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            outputs[t].extend(step(q) for q in queries[t])
        stream.synchronize()

    torch.cuda.synchronize()  # the inputs, made on the default stream, are ready for the threads' streams
    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    got = torch.stack([torch.stack(o) for o in outputs])
    assert max_error(got, reference.decode(queries.reshape(100, 8, 128), k.expand(100, -1, -1, -1),
                                           v.expand(100, -1, -1, -1)).reshape(got.shape)) <= ATOL["float16"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_decode_on_gpu_realistic(rng, dtype):
    tdtype = getattr(torch, dtype)
    batch, heads_q, heads_kv, max_len, head_dim = 8, 32, 8, 3000, 128
    q = torch.randn(batch, heads_q, head_dim, device="cuda", dtype=tdtype)
    k = torch.randn(batch, heads_kv, max_len, head_dim, device="cuda", dtype=tdtype)
    v = torch.randn(batch, heads_kv, max_len, head_dim, device="cuda", dtype=tdtype)
    lengths = torch.from_numpy(_lengths(rng, batch, max_len)).cuda()
    o = numattn.decode(q, k, v, seqlens=lengths)
    assert max_error(o, reference.decode(q, k, v, seqlens=lengths)) <= ATOL[dtype]
    from numattn.bench import paged_copy

    k_pages, v_pages, table = paged_copy(torch, k, v, 16)
    paged = numattn.paged_decode(q, k_pages, v_pages, table, lengths)
    assert max_error(paged, reference.decode(q, k, v, seqlens=lengths)) <= ATOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, head_dim, head_dim_v", [("float16", 512, 512), ("bfloat16", 320, 576), ("float32", 1024, 256)])
def test_decode_on_gpu_wide_heads(rng, dtype, head_dim, head_dim_v):
    """Head dims past the tensor-core kernel's 256 (the CUDA-core kernel), contiguous and paged, split."""
    batch, heads_q, heads_kv, max_len = 3, 8, 2, 1500
    q = torch.from_numpy(_random(rng, (batch, heads_q, head_dim), "float32")).cuda().to(getattr(torch, dtype))
    k, v = (torch.from_numpy(_random(rng, (batch, heads_kv, max_len, d), "float32")).cuda().to(q.dtype)
            for d in (head_dim, head_dim_v))
    lengths = torch.from_numpy(_lengths(rng, batch, max_len)).cuda()
    ref = reference.decode(q, k, v, seqlens=lengths)
    assert max_error(numattn.decode(q, k, v, seqlens=lengths), ref) <= ATOL[dtype]
    from numattn.bench import paged_copy

    k_pages, v_pages, table = paged_copy(torch, k, v, 16)
    assert max_error(numattn.paged_decode(q, k_pages, v_pages, table, lengths), ref) <= ATOL[dtype]


@pytest.mark.gpu
def test_decode_cuda_graph_capture(rng):
    q = torch.randn(4, 16, 128, device="cuda", dtype=torch.float16)
    k = torch.randn(4, 4, 2048, 128, device="cuda", dtype=torch.float16)
    v = torch.randn(4, 4, 2048, 128, device="cuda", dtype=torch.float16)
    lengths = torch.tensor([2048, 1, 700, 0], dtype=torch.int32, device="cuda")
    numattn.decode(q, k, v, seqlens=lengths, check=False)  # warm-up compiles and plans
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = numattn.decode(q, k, v, seqlens=lengths, check=False)
    for _ in range(2):
        q.normal_()
        lengths.copy_(torch.tensor([5, 2048, 33, 1000], dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert max_error(out, reference.decode(q, k, v, seqlens=lengths)) <= ATOL["float16"]


@pytest.mark.gpu
def test_decode_into_out_on_gpu(rng):
    """``out=`` on the GPU: a strided slice of a poisoned buffer, the tensor-core kernel with key splits
    merged by the last block, repeated calls, and a CUDA graph that writes into the same ``out``."""
    q = torch.randn(1, 32, 128, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(1, 8, 8192, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    ref = reference.decode(q, k, v)
    wide = torch.full((1, 32, 192), float("nan"), device="cuda", dtype=torch.float16)
    out = wide[:, :, 32:160]
    for _ in range(3):
        out.fill_(float("nan"))
        assert numattn.decode(q, k, v, check=False, out=out) is out
        assert max_error(out, ref) <= ATOL["float16"]
    assert torch.isnan(wide[:, :, :32]).all() and torch.isnan(wide[:, :, 160:]).all()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        numattn.decode(q, k, v, check=False, out=out)
    for _ in range(2):
        q.normal_()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert max_error(out, reference.decode(q, k, v)) <= ATOL["float16"]


@pytest.mark.gpu
def test_decode_split_workspace_shared_across_plans_and_streams(rng):
    """Split plans of different sizes take turns on one stream's workspace (which grows) and on a second
    stream's; each launch's last blocks must find the counters at zero and leave them so."""
    cases = [(1, 32, 8, 8192, 128), (2, 16, 2, 3000, 64), (1, 8, 1, 20000, 128), (1, 32, 8, 8192, 128)]
    tensors = []
    for batch, heads_q, heads_kv, length, dim in cases:
        q = torch.randn(batch, heads_q, dim, device="cuda", dtype=torch.float16)
        k, v = (torch.randn(batch, heads_kv, length, dim, device="cuda", dtype=torch.float16) for _ in range(2))
        tensors.append((q, k, v, reference.decode(q, k, v)))
    side = torch.cuda.Stream()
    for stream in (torch.cuda.current_stream(), side, torch.cuda.current_stream()):
        with torch.cuda.stream(stream):
            outputs = [numattn.decode(q, k, v, check=False) for q, k, v, _ in tensors for _ in range(3)]
        stream.synchronize()
        for i, out in enumerate(outputs):
            assert max_error(out, tensors[i // 3][3]) <= ATOL["float16"]


class _HostBuffer(np.ndarray):
    def data_ptr(self):
        return self.ctypes.data


class _RecordingTorch:
    """The part of torch that ``SplitWorkspaces`` uses, with host buffers and a capture switch."""

    int32 = np.int32

    def __init__(self):
        self.capturing = False
        self._C = SimpleNamespace(_cuda_isCurrentStreamCapturing=lambda: self.capturing)

    @staticmethod
    def device(kind, index):
        return kind, index

    @staticmethod
    def zeros(words, dtype, device):
        return np.zeros(words, dtype).view(_HostBuffer)


def test_split_workspace_getter_reuses_grows_and_isolates_captures():
    """A plan's per-call workspace lookup: one buffer per (device, stream), reused while large enough,
    replaced by a larger one when a plan needs more (which then serves the smaller plan too), and a
    fresh zeroed buffer per call while a graph is captured on a stream other than the legacy default."""
    from numattn.ops.workspace import _BUFFERS, SplitWorkspaces

    fake, device = _RecordingTorch(), 97
    small = SplitWorkspaces.getter(fake, device, 4, 100)
    large = SplitWorkspaces.getter(fake, device, 8, 1000)
    try:
        counters, part, first = small(5)
        assert (counters, part, first.size) == (first.data_ptr(), first.data_ptr() + 16, 100)
        assert small(5)[2] is first
        counters, part, grown = large(5)
        assert grown is not first and grown.size >= 1000 and part == counters + 4 * 8
        assert small(5)[2] is grown and small(6)[2] is not grown
        fake.capturing = True
        captured = [small(5)[2] for _ in range(2)]
        assert captured[0] is not captured[1] and all(buffer is not grown for buffer in captured)
        assert all(buffer.size == 100 and not buffer.any() for buffer in captured)
        assert small(0)[2] is small(0)[2]  # the legacy default stream cannot capture
    finally:
        for key in [key for key in _BUFFERS if key[0] == device]:
            del _BUFFERS[key]


def test_decode_from_numpy_and_numba(rng):
    """Host arrays (on a GPU machine copied to the device and back) and numba device arrays."""
    from numba import cuda

    q = _random(rng, (2, 8, 64), "float16")
    k, v = _random(rng, (2, 2, 300, 64), "float16"), _random(rng, (2, 2, 300, 64), "float16")
    lengths = np.array([300, 17], np.int32)
    ref = reference.decode(q, k, v, seqlens=lengths)
    assert max_error(numattn.decode(q, k, v, seqlens=lengths), ref) <= ATOL["float16"]
    on_device = [cuda.to_device(x) for x in (q, k, v, lengths)]
    o = numattn.decode(*on_device[:3], seqlens=on_device[3])
    assert max_error(o.copy_to_host(), ref) <= ATOL["float16"]
    out = cuda.to_device(np.full((2, 8, 64), np.nan, np.float16))
    assert numattn.decode(*on_device[:3], seqlens=on_device[3], out=out) is out
    assert max_error(out.copy_to_host(), ref) <= ATOL["float16"]


def test_index_check_kernel_reports_the_bad_value():
    """The GPU check of lengths and page indices (kernels/index_check.py), run on host arrays."""
    from numattn.kernels import index_check
    from numattn.kernels.launch import compiled

    def check(table, lengths, capacity=6, page_size=2, num_pages=4):
        claim, record = np.zeros(1, np.int32), np.zeros(index_check.RECORD_WORDS, np.int32)
        paged = table is not None
        table = table if paged else np.zeros((1, 1), np.int32)
        kernel = compiled(index_check.index_check_kernel(paged), None, 0, 0, "index check")
        grid = index_check.grid(len(lengths), table.shape[1] if paged else 1)
        kernel.launch_arrays(grid, index_check.THREADS, table, lengths, capacity, page_size, num_pages, claim, record)
        return record.tolist()

    table = np.array([[0, 1, 2], [3, 9, -5]], np.int32)
    assert check(table, np.array([5, 2], np.int32)) == [0, 0, 0, 0, 0]  # unused entries are not checked
    assert check(table, np.array([5, 3], np.int32)) == [index_check.PAGE_OUT_OF_RANGE, 1, 1, 9, 4]
    assert check(table, np.array([7, 0], np.int32)) == [index_check.LENGTH_ABOVE_PAGES, 0, 0, 7, 6]
    assert check(None, np.array([3, 8], np.int32)) == [index_check.LENGTH_ABOVE_CACHE, 1, 0, 8, 6]
    assert check(None, np.array([3, -1], np.int32)) == [index_check.LENGTH_BELOW_ZERO, 1, 0, -1, 6]
    # several bad values: one complete report
    assert check(table, np.array([5, 6], np.int32)) in ([index_check.PAGE_OUT_OF_RANGE, 1, 1, 9, 4],
                                                          [index_check.PAGE_OUT_OF_RANGE, 1, 2, -5, 4])


@pytest.mark.gpu
def test_checked_calls_report_bad_indices_without_a_synchronisation():
    """check=True on CUDA tensors: a bad page index or length is raised by the next checked call on the
    GPU, naming it; the call that read it stayed within the caches."""
    from numattn.bench import paged_copy

    q = torch.randn(2, 8, 64, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(2, 2, 40, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    k_pages, v_pages, table = paged_copy(torch, k, v, 8)
    lengths = torch.tensor([40, 17], dtype=torch.int32, device="cuda")
    numattn.paged_decode(q, k_pages, v_pages, table, lengths)
    bad = table.clone()
    bad[1, 2] = k_pages.shape[0] + 5
    numattn.paged_decode(q, k_pages, v_pages, bad, lengths)  # queued; its check reports on the GPU
    torch.cuda.synchronize()
    pages = k_pages.shape[0]
    with pytest.raises(ValueError, match=rf"page_table\[1, 2\] = {pages + 5} is not a page index in \[0, {pages}\)"):
        numattn.decode(q, k, v, seqlens=lengths)  # the next checked call on this GPU raises it, whichever it is
    numattn.paged_decode(q, k_pages, v_pages, table, lengths)  # the report was cleared
    numattn.decode(q, k, v, seqlens=torch.tensor([41, 3], dtype=torch.int32, device="cuda"))
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=r"seqlens\[0\] = 41 exceeds the cache length \(40\)"):
        numattn.decode(q, k, v, seqlens=lengths)
    torch.cuda.synchronize()
