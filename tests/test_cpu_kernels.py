"""numattn.kernels.cpu (numba CPU JIT) against the float64 references."""

import math

import numba
import numpy as np
import pytest
import torch

from numattn import reference
from numattn._arrays import float32_values, rounded_storage
from numattn.kernels import cpu

from conftest import ATOL
from helpers import random_qkv

pytestmark = pytest.mark.sim

TOL = ATOL["float32"]


def _assert_close(actual, expected, atol=TOL):
    """Same shape, -inf and NaN in the same places, within ``atol`` elsewhere."""
    actual = np.asarray(actual, dtype=np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected))
    np.testing.assert_array_equal(np.isneginf(actual), np.isneginf(expected))
    finite = np.isfinite(expected)
    assert np.isfinite(actual[finite]).all()
    if finite.any():
        assert np.abs(actual[finite] - expected[finite]).max() <= atol


def _random(rng, *shape):
    return rng.standard_normal(shape, dtype=np.float32)


ATTENTION_SHAPES = [
    # batch, heads_q, heads_kv, seqlen_q, seqlen_kv, head_dim, head_dim_v
    (2, 4, 2, 97, 97, 64, 64),  # GQA, odd length
    (1, 4, 1, 33, 1025, 32, 48),  # MQA, long odd key count, head_dim_v != head_dim
    (2, 2, 2, 130, 70, 16, 16),  # seqlen_q > seqlen_kv: causal rows that see no key
    (1, 3, 3, 1, 97, 64, 40),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", ATTENTION_SHAPES)
def test_attention_forward(rng, shape, causal):
    batch, heads_q, heads_kv, seqlen_q, seqlen_kv, head_dim, head_dim_v = shape
    q, k, v = random_qkv(rng, batch, heads_q, heads_kv, seqlen_q, seqlen_kv, head_dim, head_dim_v)
    scale = 1.0 / math.sqrt(head_dim)
    o, lse = cpu.attention_forward(q, k, v, scale, causal)
    assert o.dtype == lse.dtype == np.float32
    expected_o, expected_lse = reference.attention(q, k, v, causal=causal, scale=scale, return_lse=True)
    _assert_close(o, expected_o)
    _assert_close(lse, expected_lse)
    if causal and seqlen_q > seqlen_kv:
        blind = seqlen_q - seqlen_kv  # rows that see no key
        assert (o[:, :, :blind] == 0).all() and np.isneginf(lse[:, :, :blind]).all()
        assert np.isfinite(lse[:, :, blind:]).all()


def _reference_gradients(q, k, v, do, scale, causal):
    """Float64 ``(dq, dk, dv)`` of ``o = softmax(scale q kᵀ) v`` (bottom-right causal, GQA)."""
    q, k, v, do = (x.astype(np.float64) for x in (q, k, v, do))
    batch, heads_kv, seqlen_kv = k.shape[:3]
    group, seqlen_q = q.shape[1] // heads_kv, q.shape[2]
    k_q, v_q = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = scale * np.einsum("bhid,bhjd->bhij", q, k_q)
    visible = np.ones((seqlen_q, seqlen_kv), bool)
    if causal:
        visible = np.arange(seqlen_kv)[None, :] <= np.arange(seqlen_q)[:, None] + seqlen_kv - seqlen_q
    s = np.where(visible, s, -np.inf)
    row_max = s.max(axis=-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(row_max), row_max, 0.0))
    p /= np.maximum(p.sum(axis=-1, keepdims=True), np.finfo(np.float64).tiny)
    dp = np.einsum("bhie,bhje->bhij", do, v_q)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
    dq = scale * np.einsum("bhij,bhjd->bhid", ds, k_q)
    dk = scale * np.einsum("bhij,bhid->bhjd", ds, q).reshape(batch, heads_kv, group, seqlen_kv, -1).sum(axis=2)
    dv = np.einsum("bhij,bhie->bhje", p, do).reshape(batch, heads_kv, group, seqlen_kv, -1).sum(axis=2)
    return dq, dk, dv


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", ATTENTION_SHAPES)
def test_attention_backward(rng, shape, causal):
    batch, heads_q, heads_kv, seqlen_q, seqlen_kv, head_dim, head_dim_v = shape
    q, k, v = random_qkv(rng, batch, heads_q, heads_kv, seqlen_q, seqlen_kv, head_dim, head_dim_v)
    do = _random(rng, batch, heads_q, seqlen_q, head_dim_v)
    scale = 1.0 / math.sqrt(head_dim)
    o, lse = cpu.attention_forward(q, k, v, scale, causal)
    grads = cpu.attention_backward(q, k, v, o, lse, do, scale, causal)
    for name, actual, expected, like in zip("dq dk dv".split(), grads, _reference_gradients(q, k, v, do, scale, causal),
                                            (q, k, v), strict=True):
        assert actual.dtype == np.float32 and actual.shape == like.shape, name
        # dk and dv sum over many query rows: allow for their magnitude
        _assert_close(actual, expected, atol=TOL * max(1.0, np.abs(expected).max()))


def test_nan_and_inf_propagate(rng):
    """A NaN score poisons exactly the rows that see it, even as a row's only key; a +inf score gives NaN
    (an infinite normaliser), only -inf scores a row that saw no key."""
    q, k, v = random_qkv(rng, 1, 2, 1, 70, 70, 16)
    k[0, 0, 0, 3] = np.nan  # key 0: seen by every row, the only key of row 0
    o, lse = cpu.attention_forward(q, k, v, 0.25, True)
    assert np.isnan(o).all() and np.isnan(lse).all()
    k[0, 0, 0, 3] = 1.0
    k[0, 0, 69, 3] = np.nan  # the last key: causal, only the last row sees it
    k[0, 0, :6, 2] = np.abs(k[0, 0, :6, 2]) + 0.5
    q[0, 1, 5, 2] = np.inf  # row 5 of head 1: scores +inf
    q[0, 0, 5, 2] = -np.inf  # row 5 of head 0: scores -inf
    o, lse = cpu.attention_forward(q, k, v, 0.25, True)
    assert np.isnan(lse[0, :, 69]).all() and np.isnan(o[0, :, 69]).all()
    assert np.isnan(lse[0, 1, 5]) and np.isnan(o[0, 1, 5]).all()
    assert np.isneginf(lse[0, 0, 5]) and (o[0, 0, 5] == 0).all()
    expected_o, expected_lse = reference.attention(q, k, v, causal=True, scale=0.25, return_lse=True)
    _assert_close(o, expected_o)
    _assert_close(lse, expected_lse)


def test_results_independent_of_thread_count(rng):
    """Bit for bit, whatever the thread count and so the rows per work item (24 or 12 for the decode)."""
    q, k, v = random_qkv(rng, 2, 8, 1, 3, 300, 32)
    table, lengths = np.arange(2, dtype=np.int32)[:, None], np.array([300, 123], np.int32)
    results = []
    threads = numba.get_num_threads()
    try:
        for count in (1, numba.config.NUMBA_NUM_THREADS):
            numba.set_num_threads(count)
            results.append([*cpu.attention_forward(q, k, v, 0.2, True), *cpu.paged_decode(q, k, v, table, lengths, 0.2),
                            *cpu.attention_forward(k, k, v, 0.2, True)])
    finally:
        numba.set_num_threads(threads)
    for a, b in zip(*results, strict=True):
        np.testing.assert_array_equal(a, b)


def _paged_cache(rng, lengths, page_size, heads_kv, head_dim, head_dim_v, spare_pages=3):
    """Pages in a random order, each sequence's in a random place, plus unused pages; page tables with
    entries past a sequence's last page set to the out-of-range index -1 (never read)."""
    counts = [-(-int(n) // page_size) for n in lengths]
    num_pages = sum(counts) + spare_pages
    order = rng.permutation(num_pages).astype(np.int32)
    table = np.full((len(lengths), max(max(counts), 1) + 1), -1, np.int32)
    start = 0
    for b, count in enumerate(counts):
        table[b, :count] = order[start : start + count]
        start += count
    k_pages = _random(rng, num_pages, heads_kv, page_size, head_dim)
    v_pages = _random(rng, num_pages, heads_kv, page_size, head_dim_v)
    return k_pages, v_pages, table


@pytest.mark.parametrize("page_size", [1, 16, 7])
@pytest.mark.parametrize("seqlen_q", [1, 3])
@pytest.mark.parametrize("heads_q, heads_kv", [(4, 2), (3, 1)])
def test_paged_decode(rng, page_size, seqlen_q, heads_q, heads_kv):
    lengths = np.array([0, 1, 2, 77, 130, 64], np.int32)
    head_dim, head_dim_v = 32, 24
    k_pages, v_pages, table = _paged_cache(rng, lengths, page_size, heads_kv, head_dim, head_dim_v)
    q = _random(rng, len(lengths), heads_q, seqlen_q, head_dim)
    o, lse = cpu.paged_decode(q, k_pages, v_pages, table, lengths, 0.3)
    expected_o, expected_lse = reference.paged_decode(q, k_pages, v_pages, np.maximum(table, 0), lengths, scale=0.3,
                                                      kv_layout="hnd", return_lse=True)
    _assert_close(o, expected_o)
    _assert_close(lse, expected_lse)
    assert (o[0] == 0).all() and np.isneginf(lse[0]).all()  # length 0
    if seqlen_q > 1:  # length 1: only the last new token sees the key
        assert np.isneginf(lse[1, :, :-1]).all() and np.isfinite(lse[1, :, -1]).all()


def test_paged_decode_clamps_indices(rng):
    """Page indices out of range read the first or last page, lengths past the table its capacity."""
    k_pages, v_pages = _random(rng, 5, 1, 4, 8), _random(rng, 5, 1, 4, 8)
    table = np.array([[-3, 9, 2], [4, 1, 0]], np.int32)
    q = _random(rng, 2, 2, 1, 8)
    o, lse = cpu.paged_decode(q, k_pages, v_pages, table, np.array([100, -5], np.int32), 0.5)
    expected = cpu.paged_decode(q, k_pages, v_pages, np.array([[0, 4, 2], [4, 1, 0]], np.int32),
                                np.array([12, 0], np.int32), 0.5)
    np.testing.assert_array_equal(o, expected[0])
    np.testing.assert_array_equal(lse, expected[1])


@pytest.mark.parametrize("seqlen_q", [1, 3])
def test_paged_decode_contiguous_matches_forward(rng, seqlen_q):
    """A contiguous cache (one page per sequence) gives attention_forward over each sequence's keys, bit for bit."""
    batch, heads_q, heads_kv, max_seqlen, head_dim = 4, 4, 2, 150, 32
    q = _random(rng, batch, heads_q, seqlen_q, head_dim)
    k, v = _random(rng, batch, heads_kv, max_seqlen, head_dim), _random(rng, batch, heads_kv, max_seqlen, head_dim)
    lengths = np.array([0, 1, 150, 67], np.int32)
    o, lse = cpu.paged_decode(q, k, v, np.arange(batch, dtype=np.int32)[:, None], lengths, 0.17)
    for b, n in enumerate(lengths):
        o_b, lse_b = cpu.attention_forward(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], 0.17, True)
        np.testing.assert_array_equal(o[b], o_b[0])
        np.testing.assert_array_equal(lse[b], lse_b[0])


@pytest.mark.parametrize("rope", [0, 64])
@pytest.mark.parametrize("page_size", [16, 5])
def test_mla_decode(rng, rope, page_size):
    heads, rank = 8, 128 if rope == 0 else 512
    lengths = np.array([0, 1, 45, 100], np.int32)
    ckv, kpe, table = _paged_cache(rng, lengths, page_size, 1, rank, rope)
    ckv, kpe = ckv[:, 0], kpe[:, 0]
    q_nope, q_pe = _random(rng, len(lengths), heads, rank), _random(rng, len(lengths), heads, rope)
    scale = 1.0 / math.sqrt(rank + rope)
    o, lse = cpu.mla_decode(q_nope, q_pe, ckv, kpe, table, lengths, scale)
    expected_o, expected_lse = reference.mla_decode(q_nope, q_pe, ckv, kpe, np.maximum(table, 0), lengths, scale=scale,
                                                    return_lse=True)
    assert o.shape == (len(lengths), heads, rank) and lse.shape == (len(lengths), heads)
    _assert_close(o, expected_o)
    _assert_close(lse, expected_lse)


def test_merge_states(rng):
    rows, head_dim_v = 9, 40
    o_a, o_b = _random(rng, rows, head_dim_v), _random(rng, rows, head_dim_v)
    lse_a, lse_b = 3 * _random(rng, rows), 3 * _random(rng, rows)
    lse_a[0] = lse_b[0] = -np.inf  # neither saw a key
    lse_a[1], o_a[1] = -np.inf, np.nan  # a saw no key: its o is not read
    lse_b[2] = -np.inf
    lse_a[3] = np.nan  # NaN: propagates, whatever the other side
    lse_b[4] = np.nan
    lse_a[5], lse_b[5] = np.nan, -np.inf
    lse_a[6] = np.inf  # an infinite normaliser: undefined
    lse_b[7] = 90.0  # far apart: b dominates
    o, lse = cpu.merge_states(o_a, lse_a, o_b, lse_b)

    la, lb = lse_a.astype(np.float64), lse_b.astype(np.float64)
    with np.errstate(invalid="ignore"):
        expected_lse = np.logaddexp(la, lb)
        expected_lse[6] = np.nan
        weight_a = np.where(np.isneginf(la), 0.0, np.exp(la - expected_lse))[:, None]
        weight_b = np.where(np.isneginf(lb), 0.0, np.exp(lb - expected_lse))[:, None]
        expected_o = np.where(weight_a == 0, 0.0, weight_a * o_a) + weight_b * o_b
    expected_o[np.isnan(expected_lse)] = np.nan
    _assert_close(lse, expected_lse)
    _assert_close(o, expected_o)
    assert (o[0] == 0).all() and np.isneginf(lse[0])
    np.testing.assert_array_equal(o[1], o_b[1])
    np.testing.assert_array_equal(o[2], o_a[2])
    assert np.isnan(o[3:7]).all() and np.isnan(lse[3:7]).all()


def test_merge_states_of_split_keys_is_attention(rng):
    """Merging the results over two halves of the keys gives the result over all of them."""
    q, k, v = random_qkv(rng, 1, 2, 2, 50, 150, 32)
    o_a, lse_a = cpu.attention_forward(q, k[:, :, :90], v[:, :, :90], 0.2, False)
    o_b, lse_b = cpu.attention_forward(q, k[:, :, 90:], v[:, :, 90:], 0.2, False)
    o, lse = cpu.merge_states(o_a.reshape(-1, 32), lse_a.reshape(-1), o_b.reshape(-1, 32), lse_b.reshape(-1))
    expected_o, expected_lse = reference.attention(q, k, v, scale=0.2, return_lse=True)
    _assert_close(o, expected_o.reshape(-1, 32))
    _assert_close(lse, expected_lse.reshape(-1))


def test_bf16_conversions(rng):
    specials = np.array([0.0, -0.0, 1.0, np.inf, -np.inf, np.finfo(np.float32).max, 1e-40, -1e-42,
                         1.00390625, 1.01171875, 1.0039063, np.nan], np.float32)  # ties to even, just past a tie
    x = np.concatenate([specials, 1e3 * _random(rng, 10_000)]).reshape(-1, 2)
    bits = rounded_storage(x, "bfloat16")
    assert bits.dtype == np.uint16 and bits.shape == x.shape
    expected = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    finite = ~np.isnan(x)
    np.testing.assert_array_equal(bits[finite], expected[finite])
    assert np.isnan(float32_values(bits[~finite], "bfloat16")).all()

    every = np.arange(1 << 16, dtype=np.uint16)
    widened = float32_values(every, "bfloat16")
    assert widened.dtype == np.float32
    np.testing.assert_array_equal(widened, torch.from_numpy(every.view(np.int16)).view(torch.bfloat16).float().numpy())
    numbers = ~np.isnan(widened)
    np.testing.assert_array_equal(rounded_storage(widened, "bfloat16")[numbers], every[numbers])
    assert np.isnan(float32_values(rounded_storage(widened[~numbers], "bfloat16"), "bfloat16")).all()


def test_inputs_converted_to_one_specialisation(rng):
    """float64, strided and read-only inputs give the float32 results, through one compiled kernel each."""
    q, k, v = random_qkv(rng, 1, 2, 1, 5, 40, 16)
    expected = cpu.attention_forward(q, k, v, 0.25, True)
    k_strided = np.repeat(k, 2, axis=-1)[..., ::2]
    v_read_only = v.copy()
    v_read_only.setflags(write=False)
    actual = cpu.attention_forward(q.astype(np.float64), k_strided, v_read_only, 0.25, True)
    for a, b in zip(actual, expected, strict=True):
        np.testing.assert_array_equal(a, b)
    cpu.attention_backward(q, k_strided, v_read_only, *expected, q.astype(np.float64), 0.25, False)
    for kernel in (cpu._attend, cpu._backward_kv, cpu._backward_q):
        assert len(kernel.signatures) == 1, kernel.signatures
