"""Bad inputs of the decode-side entry points: non-finite LSEs in merge_states, page tables past int32 in
csr_page_table, kv_lora_rank / rope_dim that mla_decode has no kernel for, and NaN scores in attention,
decode and MLA decode (with and without key splits)."""

import numpy as np
import pytest

import numattn
from numattn import reference
from numattn.configs.attention import MmaConfig, SimtConfig
from numattn.configs.mla import SHARED_LIMITS, MlaConfig, mla_candidates
from numattn.ops import attention as attention_module
from numattn.ops import mla as mla_module

from conftest import ATOL
from helpers import as_dtype, max_error

pytestmark = pytest.mark.sim

INT32_MAX = 2**31 - 1


# --- f. merge_states with non-finite LSEs ---------------------------------------------------------


@pytest.mark.parametrize("dtype, device", [("float32", None), ("float16", None),
                                           pytest.param("bfloat16", "cuda", marks=pytest.mark.gpu)])
def test_merge_states_propagates_nan_and_positive_infinity(rng, dtype, device):
    """A NaN LSE on either side, or +inf (an infinite normaliser: no finite weights), gives the row NaN
    output and LSE; both -inf stay (0, -inf); the other rows merge as before. Host arrays, or torch
    tensors on the GPU."""
    rows, dv = 9, 16
    o_a, o_b = as_dtype([rng.standard_normal((rows, dv), dtype=np.float32) for _ in range(2)], dtype)
    lse_a, lse_b = (rng.standard_normal(rows).astype(np.float32) for _ in range(2))
    nan, inf = np.float32(np.nan), np.float32(np.inf)
    cases = [(nan, None), (None, nan), (nan, -inf), (-inf, nan), (inf, None), (None, inf), (inf, -inf)]
    for row, (a, b) in enumerate(cases):
        lse_a[row] = lse_a[row] if a is None else a
        lse_b[row] = lse_b[row] if b is None else b
    lse_a[7] = lse_b[7] = -inf  # row 8 stays finite on both sides
    args = (o_a, lse_a, o_b, lse_b)
    if device is not None:
        import torch

        args = [torch.as_tensor(x).to(device) for x in args]
    o, lse = (reference.to_float64(x) for x in numattn.merge_states(*args))
    bad = np.arange(len(cases))
    assert np.isnan(o[bad]).all() and np.isnan(lse[bad]).all()
    assert (o[7] == 0).all() and lse[7] == -np.inf
    la, lb = lse_a[8].astype(np.float64), lse_b[8].astype(np.float64)
    ref_lse = np.logaddexp(la, lb)
    ref_o = reference.to_float64(o_a)[8] * np.exp(la - ref_lse) + reference.to_float64(o_b)[8] * np.exp(lb - ref_lse)
    assert np.abs(o[8] - ref_o).max() <= ATOL[dtype] and abs(lse[8] - ref_lse) <= 1e-5


def test_merge_states_of_no_columns_merges_the_lse(rng):
    """head_dim_v 0: an empty output, and the LSEs merged."""
    lse_a, lse_b = (rng.standard_normal((2, 3)).astype(np.float32) for _ in range(2))
    empty = np.zeros((2, 3, 0), np.float32)
    o, lse = numattn.merge_states(empty, lse_a, empty, lse_b)
    assert o.shape == (2, 3, 0)
    assert np.abs(lse - np.logaddexp(lse_a.astype(np.float64), lse_b)).max() <= 1e-5


# --- g. csr_page_table past int32 -------------------------------------------------------------------


def test_csr_page_table_rejects_page_indices_outside_int32():
    for index in (2**32 + 3, INT32_MAX + 1, -1):
        with pytest.raises(ValueError, match=rf"kv_indices\[1\] = {index} .*\[0, {INT32_MAX}\]"):
            numattn.csr_page_table(np.array([0, 2]), np.array([5, index], np.int64), np.array([1]), 4)
    with pytest.raises(ValueError, match=rf"kv_indices\[1\] = {2**64 - 1} "):
        numattn.csr_page_table(np.array([0, 2]), np.array([5, 2**64 - 1], np.uint64), np.array([1]), 4)
    table, lengths = numattn.csr_page_table([0, 2, 3], np.array([INT32_MAX, 0, 7, -5]), [1, 4], 4)
    assert table.tolist() == [[INT32_MAX, 0], [7, 0]] and lengths.tolist() == [5, 4]  # kv_indices[3] unused


def test_csr_page_table_rejects_lengths_outside_int32():
    with pytest.raises(ValueError, match=rf"sequence 1 is {2**31 + 4} keys long .*at most {INT32_MAX}"):
        numattn.csr_page_table([0, 1, 4], [0, 1, 2, 3], [3, 4], 2**30)
    table, lengths = numattn.csr_page_table([0, 2], [0, 1], [2**30 - 1], 2**30)
    assert lengths.tolist() == [INT32_MAX] and table.tolist() == [[0, 1]]


def test_csr_page_table_batch_of_at_least_one():
    """paged_decode takes no empty batch, so neither does the conversion; empty lists are empty index arrays."""
    for indptr in ([0], np.array([0]), []):
        with pytest.raises(ValueError, match="at least 1"):
            numattn.csr_page_table(indptr, [], [], 4)
    table, lengths = numattn.csr_page_table([0, 0], [], [0], 4)  # one sequence without pages
    assert table.tolist() == [[0]] and lengths.tolist() == [0]


# --- h. mla_decode's kv_lora_rank and rope_dim --------------------------------------------------------


def _mla_inputs(rng, rank, rope, dtype, heads=2, page_table_dtype=np.int32):
    shapes = [(2, heads, rank), (2, heads, rope), (5, 4, rank), (5, 4, rope)]
    arrays = as_dtype([rng.standard_normal(s, dtype=np.float32) for s in shapes], dtype)
    table = np.array([[3, 0, 4], [1, 2, 0]], page_table_dtype)
    return (*arrays, table, np.array([11, 6], np.int32))


def test_mla_validates_the_ranks_its_kernels_take(rng):
    """16-bit: kv_lora_rank a multiple of 64, rejected before the page-table checks (a bad page table
    here); float32 (the decode kernel) takes multiples of 16."""
    for dtype in ("float16", "bfloat16"):
        for rank in (32, 80):
            args = _mla_inputs(rng, rank, 16, dtype, page_table_dtype=np.int64)
            with pytest.raises(ValueError, match=rf"kv_lora_rank must be a multiple of 64 .*got {rank}"):
                numattn.mla_decode(*args, scale=0.1)
    with pytest.raises(ValueError, match="rope_dim must be a multiple of 16 .*got 8"):
        numattn.mla_decode(*_mla_inputs(rng, 64, 8, "float16"), scale=0.1)
    with pytest.raises(ValueError, match="kv_lora_rank must be .*got 24"):
        numattn.mla_decode(*_mla_inputs(rng, 24, 16, "float32"), scale=0.1)


def test_mla_rank_rule_is_the_kernel_configurations():
    """Every 16-bit (kv_lora_rank, rope_dim) that validation lets through has a kernel configuration on every
    known architecture, and no other."""
    for cc in SHARED_LIMITS:
        for rank in range(16, mla_module.MAX_RANK + 1, 16):
            for rope in range(0, mla_module.MAX_ROPE + 1, 16):
                assert bool(mla_candidates(rank, rope, cc)) == (rank % mla_module.RANK_MULTIPLE == 0), (cc, rank, rope)


def test_mla_float32_small_rank_without_rope(rng):
    args = _mla_inputs(rng, 32, 0, "float32")
    o, lse = numattn.mla_decode(*args, scale=0.2, return_lse=True)
    ref_o, ref_lse = reference.mla_decode(*args, scale=0.2, return_lse=True)
    assert max_error(o, ref_o) <= ATOL["float32"]
    assert np.abs(lse - ref_lse).max() <= 1e-5


# --- i. NaN scores ---------------------------------------------------------------------------------------


def _assert_nan_rows(o, lse, ref_o, ref_lse, nan_rows, dtype):
    """``nan_rows`` (a boolean mask over o's rows) NaN in o and the LSE, the other rows as the reference."""
    o, lse = reference.to_float64(o), reference.to_float64(lse)
    assert np.isnan(o[nan_rows]).all() and np.isnan(lse[nan_rows]).all()
    assert not np.isnan(o[~nan_rows]).any() and not np.isnan(lse[~nan_rows]).any()
    assert np.abs(o[~nan_rows] - ref_o[~nan_rows]).max() <= ATOL[dtype]
    assert np.abs(lse[~nan_rows] - ref_lse[~nan_rows]).max() <= 1e-4


@pytest.mark.parametrize(
    "dtype, config, splits",
    [("float32", SimtConfig(16, 16, 8, 2), 1), ("float16", MmaConfig(16, 1), 1), ("float16", MmaConfig(16, 1), 2)],
)
def test_attention_nan_key_gives_nan_rows(rng, dtype, config, splits):
    """One NaN in key 5 of head 0: causal rows 5 on of head 0 are NaN (output and LSE), rows 0..4 and head 1
    are not; with two splits the NaN reaches the rows of the second query tile through the merge."""
    q, k, v = as_dtype([rng.standard_normal((1, 2, 32, 16), dtype=np.float32) for _ in range(3)], dtype)
    k[0, 0, 5, 3] = np.nan
    p = attention_module.validate(q, k, v, None, True, 0.25, "bhsd", True)
    o, lse = attention_module.make_plan(p, config, splits)(q, k, v, None)
    ref_o, ref_lse = reference.attention(q, k, v, causal=True, scale=0.25, return_lse=True)
    nan_rows = np.zeros((1, 2, 32), bool)
    nan_rows[0, 0, 5:] = True
    _assert_nan_rows(o, lse, ref_o, ref_lse, nan_rows, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_attention_nan_key_on_the_gpu(rng, dtype):
    """The kernel the GPU picks for torch tensors (wgmma on sm_90), several key tiles and query blocks."""
    arrays = [rng.standard_normal((1, 2, 300, 64), dtype=np.float32) for _ in range(3)]
    q, k, v = (x.cuda() for x in as_dtype(arrays, dtype, "torch"))
    k[0, 0, 150, 3] = float("nan")
    o, lse = numattn.attention(q, k, v, causal=True, return_lse=True)
    ref_o, ref_lse = reference.attention(q, k, v, causal=True, return_lse=True)
    nan_rows = np.zeros((1, 2, 300), bool)
    nan_rows[0, 0, 150:] = True
    _assert_nan_rows(o, lse, ref_o, ref_lse, nan_rows, dtype)


@pytest.mark.parametrize("dtype, split_count", [("float32", 1), ("float32", 2), ("float16", 1), ("float16", 2)])
def test_decode_nan_key_gives_nan_rows(rng, splits, dtype, split_count):
    """A NaN in key 5 of sequence 0 (length 40) and in key 30 of sequence 1 (length 20, so unseen): sequence
    0's rows are NaN, sequence 1's are not; CUDA-core (float32) and tensor-core (float16) kernels."""
    splits(split_count)
    q = as_dtype([rng.standard_normal((2, 2, 16), dtype=np.float32)], dtype)[0]
    k, v = as_dtype([rng.standard_normal((2, 1, 40, 16), dtype=np.float32) for _ in range(2)], dtype)
    k[0, 0, 5, 7] = k[1, 0, 30, 0] = np.nan
    lengths = np.array([40, 20], np.int32)
    o, lse = numattn.decode(q, k, v, seqlens=lengths, return_lse=True)
    ref_o, ref_lse = reference.decode(q, k, v, seqlens=lengths, return_lse=True)
    nan_rows = np.zeros((2, 2), bool)
    nan_rows[0] = True
    _assert_nan_rows(o, lse, ref_o, ref_lse, nan_rows, dtype)


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("rank, config, dtype", [
    (64, MlaConfig(16, 2, 4, "duplicated"), "float16"),
    pytest.param(128, None, "bfloat16", marks=pytest.mark.gpu),  # the sm_90 default: the wgmma kernel
])
def test_mla_nan_latent_row_gives_nan_heads(rng, splits, rank, config, dtype):
    """A NaN in latent row 1 of page 3 (sequence 0's row 1): every head of sequence 0 is NaN, sequence 1's
    are not; with splits merged by the decode combine kernel. Host arrays in the simulator (the mma.sync
    kernel), torch tensors on the GPU."""
    args = _mla_inputs(rng, rank, 16, dtype, heads=3)
    args[2][3, 1, 10] = np.nan
    if not numattn.SIMULATOR:
        import torch

        args = [torch.as_tensor(x).cuda() for x in args]
    p = mla_module.validate(*args, 0.1, True)
    o, lse = mla_module.planned(p, config, splits)(*args)
    ref_o, ref_lse = reference.mla_decode(*args, scale=0.1, return_lse=True)
    nan_rows = np.zeros((2, 3), bool)
    nan_rows[0] = True
    _assert_nan_rows(o, lse, ref_o, ref_lse, nan_rows, dtype)
