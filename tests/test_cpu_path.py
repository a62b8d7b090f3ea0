"""The public functions on host arrays without a GPU: the CPU path (numba's CPU JIT), not the simulator."""

import numpy as np
import pytest
import torch

import numattn
from numattn import reference

from conftest import ATOL
from helpers import as_dtype, max_error, random_qkv

pytestmark = [
    pytest.mark.sim,
    pytest.mark.skipif(not numattn.SIMULATOR, reason="the CPU path serves host arrays on machines without a GPU"),
]


@pytest.fixture(autouse=True)
def cpu_path():
    with numattn.simulate(False):
        yield


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_attention(rng, dtype, causal, layout):
    q, k, v = as_dtype(random_qkv(rng, 2, 6, 2, 97, 130, 40, 24, layout=layout), dtype)
    o, lse = numattn.attention(q, k, v, causal=causal, layout=layout, return_lse=True, scale=0.3)
    expected, expected_lse = reference.attention(q, k, v, causal=causal, layout=layout, scale=0.3, return_lse=True)
    assert type(o) is type(q) and o.dtype == q.dtype and o.shape == expected.shape
    assert max_error(o, expected, rounded_to=dtype) <= ATOL[dtype]
    assert max_error(lse, expected_lse) <= 1e-4


def test_attention_into_out_and_many_queries_per_key(rng):
    """``out=`` a strided slice; more queries than keys, causal: rows that see no key are 0, LSE -inf."""
    q, k, v = random_qkv(rng, 1, 2, 1, 40, 25, 16)
    buffer = np.full((1, 2, 40, 32), np.nan, np.float32)
    out = buffer[..., 8:24]
    result, lse = numattn.attention(q, k, v, causal=True, out=out, return_lse=True)
    assert result is out
    assert max_error(out, reference.attention(q, k, v, causal=True)) <= ATOL["float32"]
    assert np.isnan(buffer[..., :8]).all() and (out[:, :, :15] == 0).all() and np.isneginf(lse[:, :, :15]).all()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_decode_and_paged_decode(rng, dtype):
    batch, heads_q, heads_kv, capacity, head_dim = 3, 8, 2, 70, 32
    shapes = [(batch, heads_q, 2, head_dim)] + [(batch, heads_kv, capacity, head_dim)] * 2
    q, k, v = as_dtype([rng.standard_normal(s, dtype=np.float32) for s in shapes], dtype, "torch")
    lengths = torch.tensor([70, 0, 33], dtype=torch.int32)
    o, lse = numattn.decode(q, k, v, seqlens=lengths, return_lse=True)
    expected, expected_lse = reference.decode(q, k, v, seqlens=lengths, return_lse=True)
    assert max_error(o, expected, rounded_to=dtype) <= ATOL[dtype]
    assert max_error(lse[[0, 2]], expected_lse[[0, 2]]) <= 1e-4 and torch.isneginf(lse[1]).all()
    page_size = 16
    pages = -(-capacity // page_size)
    table = torch.randperm(batch * pages).reshape(batch, pages).int()
    k_pages, v_pages = (torch.zeros(batch * pages, page_size, heads_kv, head_dim, dtype=x.dtype) for x in (k, v))
    for pages_of, cache in ((k_pages, k), (v_pages, v)):
        padded = torch.zeros(batch, heads_kv, pages * page_size, head_dim, dtype=cache.dtype)
        padded[:, :, :capacity] = cache
        pages_of[table.long().flatten()] = (
            padded.reshape(batch, heads_kv, pages, page_size, head_dim).permute(0, 2, 3, 1, 4).flatten(0, 1))
    paged = numattn.paged_decode(q, k_pages, v_pages, table, lengths)
    assert max_error(paged, expected, rounded_to=dtype) <= ATOL[dtype]


def test_decode_checks_lengths_and_pages():
    q, k = np.ones((1, 2, 16), np.float32), np.ones((1, 1, 8, 16), np.float32)
    with pytest.raises(ValueError, match=r"seqlens\[0\] = 9 exceeds the cache length \(8\)"):
        numattn.decode(q, k, k, seqlens=np.array([9], np.int32))
    with pytest.raises(ValueError, match=r"page_table\[0, 1\] = 5 is not a page index in \[0, 2\)"):
        numattn.paged_decode(q, k.reshape(2, 4, 1, 16), k.reshape(2, 4, 1, 16), np.array([[0, 5]], np.int32),
                             np.array([6], np.int32))


@pytest.mark.parametrize("rope", [0, 64])
def test_mla_decode(rng, rope):
    batch, heads, rank, page_size, max_pages = 3, 16, 64, 4, 5
    num_pages = batch * max_pages
    shapes = [(batch, heads, rank), (batch, heads, rope), (num_pages, page_size, rank), (num_pages, page_size, rope)]
    arrays = as_dtype([rng.standard_normal(s, dtype=np.float32) for s in shapes], "float16")
    table = rng.permutation(num_pages).reshape(batch, max_pages).astype(np.int32)
    lengths = np.array([20, 0, 7], np.int32)
    o, lse = numattn.mla_decode(*arrays, table, lengths, scale=0.1, return_lse=True)
    expected, expected_lse = reference.mla_decode(*arrays, table, lengths, scale=0.1, return_lse=True)
    assert max_error(o, expected, rounded_to="float16") <= ATOL["float16"]
    assert max_error(lse[[0, 2]], expected_lse[[0, 2]]) <= 1e-4


def test_merge_states(rng):
    q, k, v = random_qkv(rng, 1, 2, 2, 9, 30, 16)
    o_a, lse_a = numattn.attention(q, k[:, :, :12], v[:, :, :12], return_lse=True)
    o_b, lse_b = numattn.attention(q, k[:, :, 12:], v[:, :, 12:], return_lse=True)
    o, lse = numattn.merge_states(o_a, lse_a, o_b, lse_b)
    expected, expected_lse = reference.attention(q, k, v, return_lse=True)
    assert max_error(o, expected) <= ATOL["float32"] and max_error(lse, expected_lse) <= 1e-5


def test_torch_autograd(rng):
    """numattn.torch.attention on CPU tensors: the forward and the gradients against float64 autograd."""
    import numattn.torch as nt

    leaves = [torch.from_numpy(x).requires_grad_() for x in random_qkv(rng, 2, 4, 2, 33, 47, 16)]
    o = nt.attention(*leaves, causal=True)
    do = torch.randn_like(o)
    o.backward(do)
    exact = [x.detach().double().requires_grad_() for x in leaves]
    k, v = (x.repeat_interleave(2, 1) for x in exact[1:])
    s = (exact[0] @ k.transpose(-1, -2) / 4.0).masked_fill(~torch.ones(33, 47, dtype=torch.bool).tril(14), -torch.inf)
    (torch.softmax(s, -1) @ v).backward(do.double())
    for x, e in zip(leaves, exact, strict=True):
        assert (x.grad.double() - e.grad).abs().max().item() <= 1e-4


def test_kernel_graph(rng, tmp_path, monkeypatch):
    """A searched graph runs its winner on the CPU path; the unfused plan runs numpy operations."""
    monkeypatch.setenv("NUMATTN_CACHE_DIR", str(tmp_path))
    g = numattn.new_kernel_graph()
    x = g.new_input((3, 40), numattn.float32)
    w = g.new_input((40, 24), numattn.float32)
    g.mark_output(g.rms_norm(g.silu(g.matmul(x, w))))
    opt = g.superoptimize(verbose=False)
    a, b = rng.standard_normal((3, 40), dtype=np.float32), rng.standard_normal((40, 24), dtype=np.float32)
    (y,) = opt([a, b])
    h = a.astype(np.float64) @ b
    h = h / (1 + np.exp(-h))
    expected = h / np.sqrt((h * h).mean(-1, keepdims=True) + 1e-6)
    assert np.abs(y - expected).max() <= 1e-4
