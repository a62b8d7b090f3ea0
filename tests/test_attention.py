"""numattn.attention against the float64 reference (simulator on CPU, real kernels on a GPU)."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import numattn
from numattn import reference
from numattn.configs.attention import WgmmaConfig
from numattn.configs.backward import BackwardWgmmaConfig

from conftest import ATOL
from helpers import OnlyDLPack, as_dtype, max_error, random_qkv

pytestmark = pytest.mark.sim

DTYPES = ["float32", "float16", "bfloat16"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads_q,heads_kv", [(2, 2), (4, 2), (4, 1)])
@pytest.mark.parametrize("seqlen_q,seqlen_kv", [(1, 7), (7, 1), (33, 20), (17, 65)])
def test_matches_reference(rng, dtype, causal, heads_q, heads_kv, seqlen_q, seqlen_kv):
    q, k, v = as_dtype(random_qkv(rng, 1, heads_q, heads_kv, seqlen_q, seqlen_kv, 16), dtype)
    o = numattn.attention(q, k, v, causal=causal)
    assert o.dtype == q.dtype and type(o) is type(q)
    assert max_error(o, reference.attention(q, k, v, causal=causal)) <= ATOL[dtype]


@pytest.mark.parametrize("head_dim,head_dim_v", [(16, 16), (40, 40), (64, 64), (128, 128), (16, 40), (64, 24)])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_head_dims(rng, head_dim, head_dim_v, dtype):
    q, k, v = as_dtype(random_qkv(rng, 1, 2, 1, 5, 18, head_dim, head_dim_v), dtype)
    o = numattn.attention(q, k, v, causal=True)
    assert o.shape == (1, 2, 5, head_dim_v)
    assert max_error(o, reference.attention(q, k, v, causal=True)) <= ATOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_return_lse(rng, dtype, causal):
    q, k, v = as_dtype(random_qkv(rng, 2, 2, 1, 19, 23, 16), dtype)
    o, lse = numattn.attention(q, k, v, causal=causal, return_lse=True, scale=0.3)
    ref_o, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True, scale=0.3)
    assert max_error(o, ref_o) <= ATOL[dtype]
    assert lse.dtype in (np.float32, torch.float32) and tuple(lse.shape) == (2, 2, 19)
    assert max_error(lse, ref_lse) <= 1e-5 * (1 + np.abs(ref_lse).max())


def test_rows_without_visible_keys(rng):
    """Causal with seqlen_q > seqlen_kv: the first queries see no key and return exact zeros."""
    q, k, v = random_qkv(rng, 1, 2, 2, 20, 6, 16)
    o, lse = numattn.attention(q, k, v, causal=True, return_lse=True)
    ref_o, ref_lse = reference.attention(q, k, v, causal=True, return_lse=True)
    blind = 20 - 6  # rows 0..13 see nothing
    assert np.all(o[:, :, :blind] == 0) and np.all(np.isneginf(lse[:, :, :blind]))
    assert max_error(o, ref_o) <= ATOL["float32"]
    assert np.abs(lse[:, :, blind:] - ref_lse[:, :, blind:]).max() <= 1e-5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bshd_layout(rng, dtype):
    q, k, v = as_dtype(random_qkv(rng, 2, 4, 2, 9, 21, 16, layout="bshd"), dtype)
    o = numattn.attention(q, k, v, layout="bshd", causal=True)
    assert tuple(o.shape) == (2, 9, 4, 16)
    assert max_error(o, reference.attention(q, k, v, layout="bshd", causal=True)) <= ATOL[dtype]


def test_strided_views_are_read_in_place(rng):
    """Transposed, sliced and head-broadcast views, read through their strides."""
    big = rng.standard_normal((2, 30, 6, 40), dtype=np.float32)
    q = big[:, 3:14, :4, :16].transpose(0, 2, 1, 3)  # (2, 4, 11, 16) from a bshd buffer
    k = big[:, ::2, 4:5, 16:32].transpose(0, 2, 1, 3)  # (2, 1, 15, 16), every other position
    v = np.broadcast_to(big[:, :15, 5:6, 20:], (2, 15, 1, 20)).transpose(0, 2, 1, 3)
    o = numattn.attention(q, k, v, causal=True)
    assert max_error(o, reference.attention(q, k, v, causal=True)) <= ATOL["float32"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_cpu_tensors(rng, dtype):
    q, k, v = as_dtype(random_qkv(rng, 1, 2, 2, 12, 12, 16), dtype, library="torch")
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2)  # non-contiguous view
    o = numattn.attention(q_t, k, v, causal=True)
    assert isinstance(o, torch.Tensor) and o.dtype == q.dtype and o.device.type == "cpu"
    assert max_error(o, reference.attention(q, k, v, causal=True)) <= ATOL[dtype]


@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_out_argument(rng, library):
    """A poisoned ``out`` is overwritten in place, every element."""
    q, k, v = as_dtype(random_qkv(rng, 1, 2, 1, 10, 14, 16), "float16", library)
    if library == "torch":
        out = torch.full((1, 2, 10, 16), float("nan"), dtype=torch.float16)
    else:
        out = np.full((1, 2, 10, 16), np.nan, dtype=np.float16)
    result = numattn.attention(q, k, v, out=out)
    assert result is out
    assert max_error(out, reference.attention(q, k, v)) <= ATOL["float16"]


def test_numba_device_arrays(rng):
    from numba import cuda

    q, k, v = (cuda.to_device(a) for a in random_qkv(rng, 1, 2, 1, 9, 13, 16))
    o = numattn.attention(q, k, v, causal=True)
    assert type(o) is type(q)
    assert max_error(o, reference.attention(q, k, v, causal=True)) <= ATOL["float32"]


def test_repeated_calls_reuse_the_plan(rng, fresh_plans):
    q, k, v = random_qkv(rng, 1, 2, 2, 8, 8, 16)
    numattn.attention(q, k, v)
    plans = len(fresh_plans)
    q2, k2, v2 = random_qkv(rng, 1, 2, 2, 8, 8, 16)
    o = numattn.attention(q2, k2, v2)
    assert len(fresh_plans) == plans == 1
    assert max_error(o, reference.attention(q2, k2, v2)) <= ATOL["float32"]


def test_dlpack_host_object(rng):
    q, k, v = random_qkv(rng, 1, 1, 1, 5, 6, 16)

    o = numattn.attention(OnlyDLPack(q), OnlyDLPack(k), OnlyDLPack(v))
    assert max_error(o, reference.attention(q, k, v)) <= ATOL["float32"]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    group=st.sampled_from([1, 2, 3]),
    heads_kv=st.integers(1, 2),
    seqlen_q=st.integers(1, 40),
    seqlen_kv=st.integers(1, 40),
    head_dim=st.sampled_from([8, 16, 24]),
    head_dim_v=st.sampled_from([8, 16, 20]),
    causal=st.booleans(),
    layout=st.sampled_from(["bhsd", "bshd"]),
    scale=st.one_of(st.none(), st.floats(0.05, 2.0)),
)
def test_any_small_problem(rng, group, heads_kv, seqlen_q, seqlen_kv, head_dim, head_dim_v, causal, layout, scale):
    """Property: any consistent small problem matches the float64 reference, output and LSE."""
    q, k, v = random_qkv(rng, 1, group * heads_kv, heads_kv, seqlen_q, seqlen_kv, head_dim, head_dim_v, layout)
    o, lse = numattn.attention(q, k, v, causal=causal, scale=scale, layout=layout, return_lse=True)
    ref_o, ref_lse = reference.attention(q, k, v, causal=causal, scale=scale, layout=layout, return_lse=True)
    assert max_error(o, ref_o) <= ATOL["float32"]
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    seen = np.isfinite(ref_lse)
    assert np.abs(lse[seen] - ref_lse[seen]).max(initial=0.0) <= 1e-5 * (1 + np.abs(ref_lse[seen]).max(initial=0.0))


@pytest.mark.parametrize(
    "config",
    [
        dict(block_n=16, num_warps=2, warp_m=1, q_in_registers=True),
        dict(block_n=32, num_warps=1, warp_m=2, q_in_registers=False),
    ],
    ids=["2warps", "warp_m2-q_in_smem"],
)
def test_tensor_core_configurations(rng, monkeypatch, fresh_plans, config):
    """The tensor-core kernel's other tile configurations (the GPU's defaults are larger)."""
    from numattn.configs import attention as configs
    from numattn.configs.attention import MmaConfig

    monkeypatch.setattr(configs, "choose_mma_config", lambda *args: MmaConfig(**config))
    q, k, v = as_dtype(random_qkv(rng, 1, 2, 1, 37, 45, 32), "float16")
    o, lse = numattn.attention(q, k, v, causal=True, return_lse=True)
    ref_o, ref_lse = reference.attention(q, k, v, causal=True, return_lse=True)
    assert max_error(o, ref_o) <= ATOL["float16"]
    assert np.abs(lse - ref_lse).max() <= 1e-5 * (1 + np.abs(ref_lse).max())


@pytest.mark.parametrize(
    "config",
    [dict(block_n=16, warpgroups=1, stages=2), dict(block_n=32, warpgroups=2, stages=3),
     dict(block_n=16, warpgroups=2, stages=2, producer=True),
     dict(block_n=16, warpgroups=2, stages=2, producer=True, persistent=True)],
    ids=["1group-2stages", "2groups-3stages", "2groups-producer", "2groups-persistent"],
)
def test_wgmma_configurations(rng, monkeypatch, fresh_plans, config):
    """The warpgroup (wgmma) kernel, which sm_90 GPUs run by default, in the simulator: GQA, causal,
    lengths off the tiles, several key tiles per block (ring of stages, turns of the warpgroups, tiles copied
    by every thread or by a producer warpgroup, in a persistent block one query tile after another); the
    output staged through shared memory into a fresh array (16-byte stores) or into a misaligned view
    (element stores), or, when head_dim_v > head_dim, stored from registers."""
    import torch

    from numattn.configs.attention import WgmmaConfig
    from numattn.ops import attention as module

    monkeypatch.setattr(module, "default_choice", lambda *args: (WgmmaConfig(**config), 1))
    for dtype, causal, head_dim_v, misaligned_out in (
        ("float16", True, 64, False), ("bfloat16", False, 64, True), ("bfloat16", True, 128, False)
    ):
        q, k, v = as_dtype(random_qkv(rng, 1, 2, 1, 70, 83, 64, head_dim_v), dtype)
        out = None
        if misaligned_out:  # rows 65 elements apart, starting 2 bytes into the buffer
            out = torch.full((1, 2, 70, head_dim_v + 1), float("nan"), dtype=getattr(torch, dtype))[..., 1:]
        o, lse = numattn.attention(q, k, v, causal=causal, return_lse=True, out=out)
        ref_o, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True)
        assert max_error(o, ref_o) <= ATOL[dtype]
        assert np.abs(lse - ref_lse).max() <= 1e-5 * (1 + np.abs(ref_lse).max())


def test_a_persistent_block_between_tiles_that_see_no_key(rng, monkeypatch, fresh_plans):
    """A persistent block (one simulated SM: every query tile through one block) whose tiles alternate between
    rows that see no key (more queries than keys under a causal mask) and rows that do: every tile's Q is
    copied and its output staged in its buffer, the Q buffers and the ring of stages run on past the tiles
    without keys; rows without a key get 0, and the sink's LSE."""
    import torch

    from numattn.configs.attention import WgmmaConfig
    from numattn.ops import attention as module

    monkeypatch.setattr(module, "default_choice",
                        lambda *args: (WgmmaConfig(16, 2, 2, producer=True, persistent=True), 1))
    q, k, v = as_dtype(random_qkv(rng, 1, 2, 1, 300, 40, 64), "bfloat16")
    sinks = rng.standard_normal(2).astype(np.float32)
    out = torch.full_like(q, float("nan"))  # poisoned: every row must be written
    o, lse = numattn.attention(q, k, v, causal=True, sinks=sinks, return_lse=True, out=out)
    ref_o, ref_lse = reference.attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
    assert max_error(o, ref_o) <= ATOL["bfloat16"]
    assert np.abs(lse - ref_lse).max() <= 1e-5 * (1 + np.abs(ref_lse).max())
    assert not o[:, :, :260].any()


def test_wgmma_producer_where_it_fits():
    """At head dim 128 the wgmma default copies its tiles with a producer warpgroup, except for kernels that
    would spill beside one (a softcap, a window with ALiBi, pages copied by threads: ``SEQUENCES_REGISTERS``
    more); other head dims have none, and there paged sequences keep the dense kernel's tiles (measured faster
    than smaller ones)."""
    from numattn.configs.attention import SEQUENCES_REGISTERS, choose_wgmma_config
    from numattn.kernels.score_mods import ScoreMods

    def producer(extra=0, head_dim=128, **mods):
        return choose_wgmma_config(head_dim, head_dim, 227 * 1024, extra, ScoreMods(**mods)).producer

    assert producer() and producer(window=True) and producer(alibi=True) and producer(sinks=True)
    assert not producer(softcap=True) and not producer(window=True, alibi=True) and not producer(SEQUENCES_REGISTERS)
    assert not producer(head_dim=64) and not producer(head_dim=256)
    for head_dim in (64, 256):
        dense, packed = (choose_wgmma_config(head_dim, head_dim, 227 * 1024, extra) for extra in (0, SEQUENCES_REGISTERS))
        assert packed == dense, head_dim


def test_persistent_blocks_where_query_tiles_see_few_keys(monkeypatch):
    """On an H100 the default takes a persistent block (``WgmmaConfig.persistent``) where every query tile visits
    at most ``PERSISTENT_KEYS`` keys (a window, short sequences), the keys are read by tensor copies and
    the query tiles outnumber the SMs, and a block per query tile elsewhere; packed sequences take persistent
    blocks where all have the longest one's queries, and when asked for; keys in pages that do not split a tile
    into whole boxes may not: a persistent configuration asked for where it cannot run is refused, naming why."""
    from numattn.configs import attention as configs
    from numattn.ops.attention import make_plan, validate
    from numattn.ops.varlen import validate_varlen

    monkeypatch.setattr(configs, "SIMULATOR", False)  # the wgmma kernel as a GPU's default, not the simulator's
    h100 = {"name": "H100", "cc": (9, 0), "sms": 132, "max_shared": 227 * 1024, "dram_gbs": 3350.0}

    def default(seqlen, causal=True, window=None, transposed=False, head_dim=128, heads=32):
        q = np.zeros((1, heads, seqlen, head_dim), np.float16)
        k = np.zeros((1, heads, head_dim, seqlen), np.float16).swapaxes(2, 3) if transposed else q
        return configs.default_choice(validate(q, k, q, None, causal, None, "bhsd", False, window=window), h100)

    persistent = WgmmaConfig(128, 2, 2, producer=True, persistent=True)
    assert default(16384, window=(1024, 0), heads=2) == default(8192, heads=4) == (persistent, 1)
    assert default(1024) == default(2048, causal=False) == (persistent, 1)
    plain = (WgmmaConfig(128, 2, 3, producer=True), 1)
    assert default(16384, heads=2) == default(16384, window=(8192, 0), heads=2) == plain
    assert default(1024, heads=16) == plain  # 128 query tiles: a block each
    assert not any(getattr(default(1024, **other)[0], "persistent", False)
                   for other in ({"transposed": True}, {"head_dim": 64}))  # mma.sync; wgmma without a producer

    q = np.zeros((4096, 8, 128), np.float16)  # four packed sequences of 1024 rows: 256 query tiles
    cu = np.arange(0, 4097, 1024, dtype=np.int32)
    packed = validate_varlen(q, q, q, cu, cu, 1024, 1024, None, True, None, False)
    assert configs.default_choice(packed, h100) == (persistent, 1)  # every sequence at the longest
    uneven = np.array([0, 1024, 1500, 2048, 3000], np.int32)  # as many query tiles, some past their sequence's rows
    packed_uneven = validate_varlen(q[:3000], q, q, uneven, cu, 1024, 1024, None, True, None, False)
    assert configs.default_choice(packed_uneven, h100) == plain  # a block per tile by default
    assert configs.misfit(packed_uneven, persistent, h100) is None  # persistent blocks when asked for
    pages = np.zeros((200, 24, 8, 128), np.float16)  # pages of 24 keys do not split a key tile into whole boxes
    table = np.arange(200, dtype=np.int32).reshape(4, 50)
    paged = validate_varlen(q, pages, pages, cu, None, 1024, 1024, None, True, None, False, page_table=table,
                            seqused_k=np.full(4, 1024, np.int32))
    assert not configs.default_choice(paged, h100)[0].persistent
    with pytest.raises(ValueError, match="persistent block takes tiles that tensor copies read"):
        make_plan(paged, persistent)


@pytest.mark.parametrize("config", [WgmmaConfig(128, 2, 3, producer=True), WgmmaConfig(64, 3, 4, producer=True),
                                    WgmmaConfig(128, 1, 3, producer=True), BackwardWgmmaConfig(2, 2, producer=True)],
                         ids=str)
def test_producer_registers_come_from_the_block(config):
    """``setmaxnreg`` only moves registers within a block: the computing warpgroups may grow only by what the
    producer gives back from the launch's count (asking for more would wait forever on the GPU)."""
    given_back = 128 * (config.max_registers - config.producer_registers)
    taken = 128 * config.warpgroups * (config.consumer_registers - config.max_registers)
    assert config.consumer_registers % 8 == 0 and config.producer_registers % 8 == 0
    assert 0 <= taken <= given_back



def test_key_splits_offered_to_the_tensor_core_kernels():
    """Tuners may split the keys of the mma.sync kernel and of the wgmma kernel without a producer warpgroup
    (2 to 16 runs while each keeps two key tiles: 96-key tiles take 2 or 4 runs of 1000 keys, 64-key tiles up
    to 8); a producer's configuration, or the SIMT kernel's, takes none, and planning one with splits names
    why."""
    from numattn.configs.attention import MmaConfig, SimtConfig, split_options
    from numattn.ops.attention import _attention_kernel, validate

    half = np.ones((1, 2, 8, 64), np.float16)
    problem = validate(half, np.ones((1, 2, 1000, 64), np.float16), np.ones((1, 2, 1000, 64), np.float16), None,
                       False, None, "bhsd", False)
    assert split_options(problem, WgmmaConfig(96, 3, 4, producer=False)) == [1, 2, 4]
    assert split_options(problem, MmaConfig(64, 4, 1, True)) == [1, 2, 4, 8]
    assert split_options(problem, WgmmaConfig(128, 2, 3, producer=True)) == [1]
    assert split_options(problem, SimtConfig(64, 32, 128, 8)) == [1]
    with pytest.raises(ValueError, match="without a producer"):
        _attention_kernel(problem, 0, WgmmaConfig(128, 2, 3, producer=True), 2)


def test_tensor_copies_where_a_map_describes_the_operands():
    """A producer's copies go by tensor maps for dense or packed operands, but not for operands repeated by
    ``expand`` (a stride of 0), which a map cannot step along: those take ``cp.async``, and a broadcast output
    gradient is read from a contiguous copy by the backward's maps."""
    torch = pytest.importorskip("torch")
    from numattn.kernels.tensor_maps import encode_tile_map
    from numattn.ops.attention import _attention_kernel, validate
    from numattn.ops.backward import _rows_fit

    producer = WgmmaConfig(128, 2, 3, producer=True)
    q = np.ones((2, 4, 256, 128), np.float16)
    keys = np.ones((1, 4, 256, 128), np.float16)
    repeated = np.broadcast_to(keys, (2, 4, 256, 128))
    for k, mappable in ((q, True), (repeated, False)):
        problem = validate(q, k, k, None, True, None, "bhsd", False)
        assert problem.tensor_mappable == mappable
        assert _attention_kernel(problem, 0, producer, 1).tensor_copies == mappable
    with pytest.raises(ValueError, match="a tensor map cannot repeat rows"):
        encode_tile_map(0, (2, 4, 256, 128), (0, 256 * 256, 256, 2), 128)
    grad = torch.ones(128, dtype=torch.bfloat16).expand(2, 4, 256, 128)
    assert not _rows_fit(grad) and _rows_fit(grad.contiguous())


def test_tensor_map_cache_uploads_once_per_stream_and_operands(monkeypatch):
    """The cache of a plan's tensor maps encodes and uploads the maps of a set of operand pointers once per
    stream, and starts afresh after ``ENTRIES`` sets."""
    from numattn.kernels import tensor_maps

    monkeypatch.setattr(tensor_maps, "encode_tile_map", lambda pointer, shape, strides, rows: np.full(16, pointer))
    uploads = []
    cache = tensor_maps.TensorMapCache([((1, 1, 64, 64), (8192, 8192, 128, 2), 64)] * 3,
                                       lambda maps: uploads.append(maps) or (maps, len(uploads)))
    assert cache.entry(7, 16, 32, 48)[1] == 1 and cache.entry(7, 16, 32, 48)[1] == 1
    assert cache.entry(8, 16, 32, 48)[1] == 2  # another stream, its own upload
    assert uploads[0][:, 0].tolist() == [16, 32, 48]
    for pointer in range(cache.ENTRIES):
        cache.entry(7, pointer, 0, 0)
    assert len(cache.entries) <= cache.ENTRIES


def test_transposed_keys_offer_the_wgmma_kernel_to_tuners():
    """K stored transposed (keys contiguous) takes the mma.sync kernel by default and offers tuners the wgmma
    one on sm_90, with key tiles in multiples of 64 (a head-dim row of keys per 128-byte swizzle panel)."""
    from numattn.configs.attention import MmaConfig, SimtConfig, default_config, fitting_kernels, misfit
    from numattn.ops.attention import validate

    half = np.ones((1, 2, 8, 64), np.float16)
    keys = np.ones((1, 2, 64, 1024), np.float16).transpose(0, 1, 3, 2)
    problem = validate(half, keys, np.ones((1, 2, 1024, 64), np.float16), None, False, None, "bhsd", False)
    assert problem.transposed_k_loads
    sm90 = {"cc": (9, 0), "max_shared": 227 * 1024}
    assert fitting_kernels(problem, sm90) == (MmaConfig, WgmmaConfig, SimtConfig)
    assert isinstance(default_config(problem, sm90), MmaConfig)
    assert fitting_kernels(problem, {"cc": (8, 0), "max_shared": 163 * 1024}) == (MmaConfig, SimtConfig)
    assert "multiples of 64" in misfit(problem, WgmmaConfig(96, 3, 4), sm90)
    assert misfit(problem, WgmmaConfig(128, 1, 3), sm90) is None


def test_large_grids_walk_their_heads_in_sections():
    """A forward grid takes its heads in sections from 128 heads whose keys and values exceed 128 MiB: B4 H32
    L4096 D128 (256 MiB), not with 64 heads (B4 H16 L8192) nor at 64 MiB (B8 H16 L2048 D64 fp16, B4 Hq32
    Hkv8 L4096 D128); float32 values count 4 bytes."""
    from types import SimpleNamespace

    from numattn.configs.attention import grid_in_sections

    def sections(batch, heads_q, heads_kv, seqlen_kv, head_dim, dtype="bfloat16"):
        return grid_in_sections(SimpleNamespace(batch=batch, heads_q=heads_q, heads_kv=heads_kv, seqlen_kv=seqlen_kv,
                                                head_dim=head_dim, head_dim_v=head_dim, dtype=dtype))

    assert sections(4, 32, 32, 4096, 128)
    assert not sections(4, 16, 16, 8192, 128)
    assert not sections(8, 16, 16, 2048, 64, "float16")
    assert not sections(8, 16, 16, 4096, 64, "float16")  # 128 MiB
    assert sections(8, 16, 16, 4096, 64, "float32")
    assert not sections(4, 32, 8, 4096, 128)


def test_default_splits_the_keys_of_short_grids(monkeypatch):
    """On sm_90 the default splits the keys where the query tiles fill at most half the SMs over at least four
    times as many keys, into as many runs as keep a block per SM and 8 key tiles per run, packed sequences
    too; larger grids, fewer keys, windows and wide heads keep one run."""
    from numattn.configs import attention as configs
    from numattn.ops.attention import validate
    from numattn.ops.varlen import validate_varlen

    monkeypatch.setattr(configs, "SIMULATOR", False)
    h200 = {"cc": (9, 0), "max_shared": 232448, "sms": 132}

    def choice(batch, heads, seqlen_q, seqlen_kv, head_dim, **options):
        q = np.ones((batch, heads, seqlen_q, head_dim), np.float16)
        kv = np.ones((batch, heads, seqlen_kv, head_dim), np.float16)
        problem = validate(q, kv, kv, None, False, None, "bhsd", False, **options)
        return configs.default_choice(problem, h200)

    assert choice(1, 8, 512, 16384, 128) == (configs.SPLITTING, 4)  # 32 query tiles
    assert choice(1, 16, 256, 32768, 64) == (configs.SPLITTING, 4)
    assert choice(1, 2, 128, 16384, 128) == (configs.SPLITTING, 16)  # 2 query tiles: 16 runs of 8 key tiles
    assert choice(1, 2, 128, 2048, 128) == (configs.SPLITTING, 2)  # 16 key tiles
    assert choice(1, 2, 128, 1024, 128)[1] == 1  # too few key tiles
    assert choice(1, 2, 4096, 4096, 128)[1] == 1  # as many keys as queries
    assert choice(2, 8, 1024, 8192, 128)[1] == 1  # 128 query tiles
    assert choice(1, 8, 512, 16384, 128, window=(1024, 0))[1] == 1
    assert choice(1, 8, 512, 16384, 256)[1] == 1

    def packed_choice(lengths_q, lengths_k, heads, head_dim):  # packed sequences count their longest
        cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lengths_q, lengths_k))
        q = np.ones((cu_q[-1], heads, head_dim), np.float16)
        kv = np.ones((cu_k[-1], heads, head_dim), np.float16)
        problem = validate_varlen(q, kv, kv, cu_q, cu_k, max(lengths_q), max(lengths_k), None, True, None, False)
        return configs.default_choice(problem, h200)

    assert packed_choice([256, 0, 100, 256], [16384, 7, 9000, 16384], 8, 128) == (configs.SPLITTING, 2)  # 64 tiles
    assert packed_choice([128], [32768], 8, 128) == (configs.SPLITTING, 16)
    assert packed_choice([512, 512], [8192, 8192], 16, 128)[1] == 1  # 128 query tiles

def test_default_kernel_per_device(monkeypatch):
    """sm_90 GPUs take the wgmma kernel for head dims in multiples of 64, other tensor-core GPUs
    and other head dims the mma.sync kernel; the simulator the mma.sync one (it simulates faster)."""
    from numattn.configs import attention as configs
    from numattn.ops.attention import validate

    def kind(cc, head_dim, simulator):
        monkeypatch.setattr(configs, "SIMULATOR", simulator)
        half = np.ones((1, 2, 8, head_dim), np.float16)
        problem = validate(half, half, half, None, False, None, "bhsd", False)
        return type(configs.default_config(problem, {"cc": cc, "max_shared": 227 * 1024})).__name__

    assert kind((9, 0), 128, False) == "WgmmaConfig"
    assert kind((9, 0), 64, False) == "WgmmaConfig"
    assert kind((9, 0), 80, False) == "MmaConfig"
    assert kind((8, 0), 128, False) == "MmaConfig"
    assert kind((10, 0), 128, False) == "MmaConfig"  # wgmma is sm_90 only
    assert kind((9, 0), 128, True) == "MmaConfig"


def test_kernel_choice():
    """fp16/bf16 with head dims in multiples of 16 and rows fit for 16-byte copies take the tensor-core kernel."""
    from numattn.ops.attention import _attention_kernel, validate

    def family(q, k, v):
        problem = validate(q, k, v, None, False, None, "bhsd", False)
        return _attention_kernel(problem, 0)[0].py_func.__module__.rsplit(".", 1)[-1]

    half = np.ones((1, 2, 8, 64), np.float16)
    assert family(half, half, half) == "attention_mma"
    assert family(*(np.ones((1, 2, 8, 40), np.float16),) * 3) == "attention_simt"  # head dim 40
    assert family(*(np.ones((1, 2, 8, 64), np.float32),) * 3) == "attention_simt"  # fp32
    strided = np.ones((1, 2, 8, 128), np.float16)[..., ::2]
    assert family(strided, half, half) == "attention_simt"  # head dim not contiguous


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_scores_growing_along_the_keys(rng, dtype):
    """Later keys score far higher than earlier ones: the running max keeps jumping, and the
    accumulated output must be rescaled (and the lazy rescale threshold crossed) many times."""
    q, k, v = random_qkv(rng, 1, 2, 1, 24, 90, 32)
    k *= np.linspace(0.1, 3.0, 90, dtype=np.float32)[None, None, :, None]  # row maxima climb ~30 in log2
    q, k, v = as_dtype([q, k, v], dtype)
    o, lse = numattn.attention(q, k, v, return_lse=True, scale=0.5)
    ref_o, ref_lse = reference.attention(q, k, v, return_lse=True, scale=0.5)
    # attention concentrates on a few keys, so |o| reaches |v|'s extremes: scale the tolerance with it
    assert max_error(o, ref_o) <= ATOL[dtype] * max(1.0, np.abs(ref_o).max())
    assert max_error(lse, ref_lse) <= 1e-5 * (1 + np.abs(ref_lse).max())


def test_simulated_calls_from_threads(rng):
    """Several threads calling at once all get their own correct result, and the interpreter's
    switch interval is left as it was (the simulator runs one kernel at a time)."""
    import sys
    from concurrent.futures import ThreadPoolExecutor

    interval = sys.getswitchinterval()
    cases = [[rng.standard_normal((1, 2, 5, 16), dtype=np.float32) for _ in range(3)] for _ in range(8)]

    def run(case):
        return numattn.attention(*case, causal=True)

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, cases))
    for (q, k, v), o in zip(cases, results, strict=True):
        assert max_error(o, reference.attention(q, k, v, causal=True)) < ATOL["float32"]
    assert sys.getswitchinterval() == interval


@pytest.mark.parametrize("causal", [False, True])
def test_cluster_merge_stages_and_merges_a_tile(rng, causal):
    """The key-split kernel's cluster merge (sm_90) in the simulator's cluster of one block: each block stages
    its partials in shared memory and merges its tile's rows from there (40 rows: the second 32-row tile
    is part padding). The GPU tests run clusters of 2 to 8 blocks."""
    from numattn.configs.attention import MmaConfig
    from numattn.kernels.attention_mma import mma_attention_kernel
    from numattn.kernels.constants import LOG2E
    from numattn.kernels.launch import compiled
    from numattn.kernels.split_merge import cluster_stage_bytes
    from numattn.ops.score_mods import NO_OPTIONS

    q, k, v = as_dtype(random_qkv(rng, 1, 2, 1, 40, 37, 32, 16), "float16")
    config = MmaConfig(block_n=16, num_warps=2)
    kernel = mma_attention_kernel(config, "float16", 32, 16, causal, True, split=True, cluster_merge=True)
    shared = max(config.shared_bytes(32, 16), cluster_stage_bytes(config.block_m, 16))
    o = np.full((1, 2, 40, 16), np.nan, np.float16)
    lse = np.full((1, 2, 40), np.nan, np.float32)
    unused = (np.zeros((1, 1, 1, 1, 1), np.float32), np.zeros((1, 1, 1, 1), np.float32), np.zeros((1, 1), np.int32))
    grid = (-(-40 // config.block_m) * 2, 1)
    compiled(kernel, None, 0, shared, "cluster merge").launch_arrays(
        grid, config.num_threads, *(x.view(np.uint16) for x in (q, k, v)), o.view(np.uint16), lse, *unused,
        np.float32(0.3 * LOG2E), *NO_OPTIONS.host_arrays(None, None, 1, 2), *NO_OPTIONS.scalars())
    ref_o, ref_lse = reference.attention(q, k, v, causal=causal, scale=0.3, return_lse=True)
    assert max_error(o, ref_o) <= ATOL["float16"]
    finite = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isfinite(lse), finite)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=1e-4)
